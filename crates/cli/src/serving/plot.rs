//! `--plot`: output throughput against latency over a sweep of request rates, as a PNG.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::metrics::Summary;
use super::workload::Rate;

const SIZE: (u32, u32) = (1280, 560);
/// The family every text is drawn in: plotters draws text with fonts registered under a name.
const FONT: &str = "sans-serif";

/// One server's (or dtype's) runs, drawn as a line through its rates.
pub struct Curve<'a> {
    pub label: &'a str,
    pub runs: &'a [(Rate, Summary)],
}

/// Draws TTFT p50 and TPOT p50 against output tokens/s side by side, each point named by its
/// rate, and writes the picture to `path`.
pub fn draw(path: &Path, title: &str, curves: &[Curve]) -> Result<()> {
    plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| anyhow!("the embedded DejaVu Sans font is not a valid font"))?;
    let mut rgb = vec![0u8; SIZE.0 as usize * SIZE.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, (FONT, 22))?;
        let panels = root.split_evenly((1, 2));
        panel(&panels[0], "TTFT p50 (ms)", curves, |s| s.ttft.p50)?;
        panel(&panels[1], "TPOT p50 (ms)", curves, |s| s.tpot.p50)?;
        root.present()?;
    }
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut png = png::Encoder::new(BufWriter::new(file), SIZE.0, SIZE.1);
    png.set_color(png::ColorType::Rgb);
    png.set_depth(png::BitDepth::Eight);
    png.write_header()?.write_image_data(&rgb)?;
    Ok(())
}

fn panel(
    area: &DrawingArea<BitMapBackend, Shift>,
    latency_name: &str,
    curves: &[Curve],
    latency: fn(&Summary) -> f64,
) -> Result<()> {
    let runs = || curves.iter().flat_map(|c| c.runs.iter().map(|(_, s)| s));
    // Room above and to the right of the farthest point for its label.
    let x_max = runs().map(|s| s.output_tok_s).fold(0.0, f64::max).max(1e-3) * 1.15;
    let y_max = runs().map(latency).fold(0.0, f64::max).max(1e-3) * 1.2;
    let mut chart = ChartBuilder::on(area)
        .margin(20)
        .caption(format!("{latency_name} against output throughput"), (FONT, 18))
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("output tokens/s")
        .y_desc(latency_name)
        .label_style((FONT, 14))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    for (i, curve) in curves.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(f64, f64)> = curve.runs.iter().map(|(_, s)| (s.output_tok_s, latency(s))).collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(curve.label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(points.into_iter().zip(curve.runs).map(|(point, (rate, _))| {
            let name = match rate {
                Rate::PerSecond(_) => format!("{rate} req/s"),
                Rate::Unlimited => "inf".to_string(),
            };
            EmptyElement::at(point) + Circle::new((0, 0), 4, color.filled()) + Text::new(name, (6, -18), (FONT, 14).into_font())
        }))?;
    }
    if curves.len() > 1 {
        // Upper left: latency grows with throughput, so the points keep to the other corners.
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .label_font((FONT, 14))
            .draw()?;
    }
    Ok(())
}
