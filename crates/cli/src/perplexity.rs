//! `strata perplexity`: perplexity of a model over a text file, with sliding windows.
//!
//! The text is tokenized without special tokens. Windows of `--ctx` positions start every
//! `--stride` text tokens; each holds BOS (when the model has one) and the next `ctx - 1` text
//! tokens. Every text token is scored once, in the first window that holds it, conditioned on the
//! tokens before it in that window: the first window scores all its tokens, later ones only the
//! `stride` tokens no earlier window reached. `scripts/reference/llama_cpp_reference.py`
//! computes the same definition with llama.cpp.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use strata_model::{Logits, Model};

use crate::common::{open_model, parse_device, DTypeArg, KvCacheArgs};

#[derive(clap::Args)]
pub struct Args {
    /// A model folder, a .gguf file, or a Hugging Face repo id; default: as `strata serve`.
    #[arg(long)]
    model: Option<String>,
    /// The text file to score.
    #[arg(long)]
    file: PathBuf,
    /// Positions per window, BOS included.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Text tokens between window starts (default: half the window).
    #[arg(long)]
    stride: Option<usize>,
    /// Score only the first N text tokens.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Positions per forward within a window (bounds the logits held at once).
    #[arg(long, default_value_t = 256)]
    chunk: usize,
    /// Load GGUF weights dequantized to --dtype instead of multiplying them quantized.
    #[arg(long)]
    dequantize: bool,
    /// Compute dtype (default: f32 on CPU, bf16 on GPU).
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    #[command(flatten)]
    kv: KvCacheArgs,
    /// Print, as the last line, a JSON object with the figures.
    #[arg(long)]
    json: bool,
}

/// Negative log-likelihood of the scored tokens, summed in f64.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Score {
    pub nll: f64,
    pub tokens: usize,
    pub windows: usize,
    /// Positions run through the model (BOS included).
    pub positions: usize,
}

impl Score {
    pub fn perplexity(&self) -> f64 {
        (self.nll / self.tokens as f64).exp()
    }
}

/// Scores `text` (token ids, no BOS) as the module documentation defines.
pub fn score(model: &Model, bos: Option<u32>, text: &[u32], ctx: usize, stride: usize, chunk: usize) -> Result<Score> {
    let with_bos = usize::from(bos.is_some());
    let room = ctx.saturating_sub(with_bos);
    if room < 2 {
        bail!("--ctx {ctx}: a window needs at least 2 text tokens, so --ctx must be at least {}", 2 + with_bos);
    }
    if stride == 0 || stride >= room {
        bail!("--ctx {ctx} --stride {stride}: the stride must be in 1..{room} (less than the window's text tokens)");
    }
    let mut total = Score::default();
    let mut start = 0;
    loop {
        let end = (start + room).min(text.len());
        let first_scored = if start == 0 { 0 } else { start + room - stride };
        let mut window: Vec<u32> = bos.into_iter().collect();
        window.extend_from_slice(&text[start..end]);
        // Input position i predicts window[i + 1]; text token j sits at window index j - start + offset.
        let offset = usize::from(bos.is_some());
        let mut state = model.new_state(1)?;
        for from in (0..window.len() - 1).step_by(chunk.max(1)) {
            let to = (from + chunk.max(1)).min(window.len() - 1);
            let input = Tensor::new(&window[from..to], model.device())?.unsqueeze(0)?;
            let logits = model.forward(&input, &mut state, Logits::All)?.squeeze(0)?;
            let log_probs = log_softmax(&logits)?;
            for i in from..to {
                let target_index = i + 1;
                let j = start + target_index - offset;
                if target_index < offset || j < first_scored {
                    continue;
                }
                let lp = log_probs.get(i - from)?.get(window[target_index] as usize)?.to_scalar::<f32>()?;
                total.nll -= lp as f64;
                total.tokens += 1;
            }
        }
        total.windows += 1;
        total.positions += window.len() - 1;
        if end >= text.len() {
            return Ok(total);
        }
        start += stride;
    }
}

/// Log-softmax over the vocabulary, in f32.
fn log_softmax(logits: &Tensor) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
    let max = logits.max_keepdim(D::Minus1)?;
    let shifted = logits.broadcast_sub(&max)?;
    let log_z = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&log_z)?)
}

pub fn run(a: Args) -> Result<()> {
    let device = parse_device(&a.device)?;
    let dtype = DTypeArg::or_default_for(a.dtype, &device);
    let dir = crate::hub::resolve_model(a.model.as_deref())?;
    let folder = open_model(&dir)?;
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("--file {}: cannot read", a.file.display()))?;
    let mut tokens = folder.tokenizer.encode(&text)?;
    if let Some(n) = a.max_tokens {
        tokens.truncate(n);
    }
    if tokens.len() < 2 {
        bail!("--file {}: holds {} tokens; at least 2 are needed", a.file.display(), tokens.len());
    }
    let stride = a.stride.unwrap_or(a.ctx / 2);
    let model =
        if a.dequantize { folder.load_dequantized(dtype.dtype(), &device)? } else { folder.load(dtype.dtype(), &device)? };
    let model = a.kv.apply(model)?;
    let bos = folder.tokenizer.bos().map(|(_, id)| id);
    let started = Instant::now();
    let s = score(&model, bos, &tokens, a.ctx, stride, a.chunk)?;
    let seconds = started.elapsed().as_secs_f64();
    let rate = s.positions as f64 / seconds;
    eprintln!(
        "perplexity {:.4} over {} tokens of {} (ctx {}, stride {stride}, {} windows, KV {}); {:.1} tokens/s ({})",
        s.perplexity(),
        s.tokens,
        a.file.display(),
        a.ctx,
        s.windows,
        model.kv_format(),
        rate,
        crate::common::machine()
    );
    if a.json {
        let json = serde_json::json!({
            "perplexity": s.perplexity(), "nll_sum": s.nll, "tokens_scored": s.tokens, "windows": s.windows,
            "ctx": a.ctx, "stride": stride, "max_tokens": a.max_tokens, "kv_cache_dtype": model.kv_format().to_string(), "mamba_ssm_cache_dtype": a.kv.ssm_dtype_name(), "seconds": seconds, "tokens_per_second": rate,
        });
        println!("{json}");
    }
    Ok(())
}
