//! `strata logits`: the logits of a token sequence, for comparison with a reference.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use strata_model::{ImagePrompt, Logits};

use crate::common::{open_model, parse_device, parse_tokens, DTypeArg};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    model: PathBuf,
    /// Token ids, e.g. 1,2,3.
    #[arg(long)]
    tokens: String,
    /// An image file (PNG, JPEG, WebP, GIF) for a model with a vision tower; repeatable. Each
    /// run of the image token in --tokens is filled by the next image, in order.
    #[arg(long = "image", value_name = "PATH")]
    images: Vec<PathBuf>,
    /// Output safetensors file; holds `logits`, f32, [positions, vocab].
    #[arg(long)]
    out: PathBuf,
    /// Prefill the first N tokens, then feed the rest one at a time; writes positions N-1..T-1.
    #[arg(long)]
    incremental_from: Option<usize>,
    /// Compute dtype (default: f32 on CPU, bf16 on GPU).
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
    #[arg(long, default_value = "cpu")]
    device: String,
}

pub fn run(a: Args) -> Result<()> {
    let device = parse_device(&a.device)?;
    let dtype = DTypeArg::or_default_for(a.dtype, &device);
    let tokens = parse_tokens(&a.tokens)?;
    let folder = open_model(&a.model)?;
    let images = crate::common::prepare_images(&folder, &a.images)?;
    let (model, images) = match images.is_empty() {
        true => (folder.load(dtype.dtype(), &device)?, None),
        false => {
            let model = folder.load_with_vision(dtype.dtype(), &device)?;
            let tower = model.vision().expect("prepare_images checked the folder has a vision tower");
            let prompt = ImagePrompt::new(tower, &tokens, &images)?;
            (model, Some(prompt))
        }
    };
    let mut state = model.new_state(1)?;
    // Positions `range` of the tokens, with their images' inputs where there are images.
    let mut feed = |range: std::ops::Range<usize>, which: Logits| -> Result<Tensor> {
        let row = Tensor::new(&tokens[range.clone()], &device)?.unsqueeze(0)?;
        Ok(match &images {
            Some(images) => model.forward_images(&row, &images.inputs(range)?, &mut state, which)?,
            None => model.forward(&row, &mut state, which)?,
        })
    };
    let logits = match a.incremental_from {
        None => feed(0..tokens.len(), Logits::All)?.squeeze(0)?,
        Some(n) => {
            if n == 0 || n > tokens.len() {
                bail!("--incremental-from {n}: must be between 1 and the number of tokens ({})", tokens.len());
            }
            let mut rows = vec![feed(0..n, Logits::Last)?];
            for t in n..tokens.len() {
                rows.push(feed(t..t + 1, Logits::Last)?);
            }
            Tensor::cat(&rows, 0)?
        }
    };
    let tensors = HashMap::from([("logits".to_string(), logits.to_device(&candle_core::Device::Cpu)?)]);
    candle_core::safetensors::save(&tensors, &a.out).with_context(|| format!("cannot write {}", a.out.display()))?;
    eprintln!("wrote {} ({:?})", a.out.display(), tensors["logits"].dims());
    Ok(())
}
