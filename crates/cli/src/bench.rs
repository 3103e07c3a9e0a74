//! `strata bench`: prefill and decode tokens/s on a fixed workload.

use std::path::PathBuf;

use anyhow::{bail, Result};
use strata_engine::{generate, GenerationOptions, SamplingParams};
use strata_model::{synthetic, Qwen35};

use crate::common::{machine, open_model, parse_device, DTypeArg};

#[derive(clap::Args)]
pub struct Args {
    /// Model folder to measure.
    #[arg(long, group = "source")]
    model: Option<PathBuf>,
    /// A random-weight model with the shapes of a public release: qwen3.5-0.8b, -2b, -4b, -9b.
    #[arg(long, group = "source")]
    synthetic: Option<String>,
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    #[arg(long, default_value_t = 64)]
    gen_len: usize,
    /// One or more compute dtypes, e.g. f32,bf16.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "f32")]
    dtype: Vec<DTypeArg>,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
    /// One JSON object per configuration instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let device = parse_device(&a.device)?;
    if a.prompt_len == 0 || a.gen_len == 0 {
        bail!("--prompt-len and --gen-len must be at least 1");
    }
    let (name, folder) = match (&a.model, &a.synthetic) {
        (Some(dir), _) => (dir.display().to_string(), Some(open_model(dir)?)),
        (_, Some(name)) => {
            synthetic::config(name)?;
            (format!("{name} (synthetic)"), None)
        }
        _ => bail!("give --model DIR or --synthetic NAME"),
    };
    let machine = machine();
    if !a.json {
        println!("strata bench: {name} on {} ({machine})", a.device);
        println!("{:<6} {:>7} {:>5} {:>14} {:>13}", "dtype", "prompt", "gen", "prefill tok/s", "decode tok/s");
    }
    for dtype in &a.dtype {
        let model: Qwen35 = match &folder {
            Some(f) => f.load(dtype.dtype(), &device)?,
            None => synthetic::build(a.synthetic.as_deref().expect("checked above"), dtype.dtype(), &device)?,
        };
        let vocab = model.config().vocab_size as u64;
        // A fixed pseudo-random prompt: the same workload on every run.
        let prompt: Vec<u32> = (0..a.prompt_len as u64).map(|i| ((i * 2_654_435_761 + 12_345) % vocab) as u32).collect();
        let opts = GenerationOptions {
            max_tokens: a.gen_len,
            sampling: SamplingParams::greedy(),
            stop_tokens: vec![],
            prefill_chunk: a.prefill_chunk,
            logprobs: None,
        };
        // Warm-up: first-touch of weights and allocator pools.
        generate(&model, &prompt[..prompt.len().min(8)], &GenerationOptions { max_tokens: 2, ..opts.clone() }, |_| true)?;
        let out = generate(&model, &prompt, &opts, |_| true)?;
        let (prefill, decode) = (out.prefill_tok_s(prompt.len()), out.decode_tok_s());
        if a.json {
            println!(
                "{}",
                serde_json::json!({
                    "model": name, "device": a.device, "machine": machine, "threads": candle_core::utils::get_num_threads(),
                    "dtype": dtype.name(), "prompt_len": a.prompt_len, "gen_len": a.gen_len,
                    "prefill_tok_s": prefill, "decode_tok_s": decode,
                })
            );
        } else {
            println!("{:<6} {:>7} {:>5} {:>14.1} {:>13.2}", dtype.name(), a.prompt_len, a.gen_len, prefill, decode);
        }
    }
    Ok(())
}
