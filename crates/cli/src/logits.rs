//! `strata logits`: the logits of a token sequence, for comparison with a reference.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use strata_model::Logits;

use crate::common::{open_model, parse_device, parse_tokens, DTypeArg};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    model: PathBuf,
    /// Token ids, e.g. 1,2,3.
    #[arg(long)]
    tokens: String,
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
    let model = open_model(&a.model)?.load(dtype.dtype(), &device)?;
    let row = |ids: &[u32]| -> Result<Tensor> { Ok(Tensor::new(ids, &device)?.unsqueeze(0)?) };
    let mut state = model.new_state(1)?;
    let logits = match a.incremental_from {
        None => model.forward(&row(&tokens)?, &mut state, Logits::All)?.squeeze(0)?,
        Some(n) => {
            if n == 0 || n > tokens.len() {
                bail!("--incremental-from {n}: must be between 1 and the number of tokens ({})", tokens.len());
            }
            let mut rows = vec![model.forward(&row(&tokens[..n])?, &mut state, Logits::Last)?];
            for &t in &tokens[n..] {
                rows.push(model.forward(&row(&[t])?, &mut state, Logits::Last)?);
            }
            Tensor::cat(&rows, 0)?
        }
    };
    let tensors = HashMap::from([("logits".to_string(), logits.to_device(&candle_core::Device::Cpu)?)]);
    candle_core::safetensors::save(&tensors, &a.out).with_context(|| format!("cannot write {}", a.out.display()))?;
    eprintln!("wrote {} ({:?})", a.out.display(), tensors["logits"].dims());
    Ok(())
}
