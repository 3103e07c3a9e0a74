//! Images through the Qwen3.5 vision path against transformers (the fixture written by
//! scripts/oracle/make_vision_fixture.py): the processor's pixels, the tower's merged tokens.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use strata_model::{ImageLimits, ModelFolder};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/vision/qwen3_5-vl-tiny-g")
}

fn reference() -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture().join("reference.safetensors"), &Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

fn image(name: &str) -> Vec<u8> {
    std::fs::read(fixture().join(name)).unwrap()
}

#[test]
fn pixels_match_the_processor() {
    let folder = ModelFolder::open(&fixture()).unwrap();
    let processor = folder.image_processor.as_ref().expect("the fixture has preprocessor_config.json");
    let want = reference();
    for (name, key) in [("image-a.png", "a"), ("image-b.png", "b")] {
        let prepared = processor.prepare(&image(name), ImageLimits::default()).unwrap();
        let grid: Vec<i64> = want[&format!("grid_{key}")].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(prepared.grid.map(|g| g as i64).to_vec(), grid, "{name}: grid");
        let pixels = Tensor::from_slice(&prepared.pixels, want[&format!("pixels_{key}")].dims(), &Device::Cpu).unwrap();
        let d = max_diff(&pixels, &want[&format!("pixels_{key}")]);
        if key == "a" {
            // No resize: only the arithmetic of rescale and normalize differs.
            assert!(d <= 1e-6, "{name}: pixel values differ by {d}");
        }
    }
    // The resized image, in [0, 1] before normalization.
    let decoded = strata_model::images::decode(&image("image-b.png"), ImageLimits::default()).unwrap();
    let resized = processor.resize(decoded).unwrap();
    let (w, h) = (resized.width() as usize, resized.height() as usize);
    let ours = Tensor::from_vec(resized.into_raw(), (h, w, 3), &Device::Cpu).unwrap().permute((2, 0, 1)).unwrap();
    let ours = (ours.to_dtype(DType::F32).unwrap() / 255.0).unwrap();
    let d = max_diff(&ours, &want["resized_b"]);
    assert!(d <= 2.0 / 255.0 + 1e-6, "resized image-b.png differs by {} / 255", d * 255.0);
}

#[test]
fn vision_tower_matches_transformers() {
    let folder = ModelFolder::open(&fixture()).unwrap();
    let tower = folder.load_vision(DType::F32, &Device::Cpu).unwrap();
    let processor = folder.image_processor.as_ref().unwrap();
    let want = reference();
    for (name, key) in [("image-a.png", "a"), ("image-b.png", "b")] {
        let prepared = processor.prepare(&image(name), ImageLimits::default()).unwrap();
        // Fed the processor's own pixels, so only the tower is compared.
        let theirs: Vec<f32> = want[&format!("pixels_{key}")].flatten_all().unwrap().to_vec1().unwrap();
        let prepared = strata_model::PreparedImage { pixels: theirs, ..prepared };
        let got = tower.forward(&prepared).unwrap();
        let d = max_diff(&got, &want[&format!("features_{key}")]);
        assert!(d < 1e-4, "{name}: merged tokens differ by {d}");
    }
}
