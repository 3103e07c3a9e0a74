//! The single-sequence generation loop: chunked prefill, then one token per step until an end
//! token, the token budget, or the caller stops it.

use std::time::{Duration, Instant};

use candle_core::Tensor;
use strata_model::{Logits, Qwen35};

use crate::sampler::{Sampler, SamplingParams};

#[derive(Clone, Debug)]
pub struct GenerationOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end the generation (not included in the output).
    pub stop_tokens: Vec<u32>,
    /// Prompt tokens fed per forward during prefill (bounds activation memory).
    pub prefill_chunk: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end token was produced.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The caller's callback asked to stop.
    Cancelled,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

impl Generation {
    pub fn prefill_tok_s(&self, prompt_len: usize) -> f64 {
        prompt_len as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Tokens/s of the decode steps (the first token comes from the prefill).
    pub fn decode_tok_s(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Generates from `prompt`. `on_token` sees each new token as it is chosen and returns false to
/// stop early.
pub fn generate(
    model: &Qwen35,
    prompt: &[u32],
    opts: &GenerationOptions,
    mut on_token: impl FnMut(u32) -> bool,
) -> strata_model::Result<Generation> {
    if prompt.is_empty() {
        return Err(strata_model::ModelError::Invalid("the prompt is empty".into()));
    }
    let device = model.device();
    let mut state = model.new_state(1)?;
    let mut sampler = Sampler::new(opts.sampling.clone());
    let start = Instant::now();
    let mut logits = None;
    for chunk in prompt.chunks(opts.prefill_chunk.max(1)) {
        let input = Tensor::new(chunk, device)?.unsqueeze(0)?;
        logits = Some(model.forward(&input, &mut state, Logits::Last)?);
    }
    let mut logits = logits.expect("prompt is not empty").squeeze(0)?.to_vec1::<f32>()?;
    let prefill_time = start.elapsed();
    let decode_start = Instant::now();
    let mut context = prompt.to_vec();
    let mut tokens = Vec::new();
    let finish = loop {
        if tokens.len() >= opts.max_tokens {
            break FinishReason::Length;
        }
        let next = sampler.sample(&logits, &context, &tokens);
        if opts.stop_tokens.contains(&next) {
            break FinishReason::Stop;
        }
        tokens.push(next);
        context.push(next);
        if !on_token(next) {
            break FinishReason::Cancelled;
        }
        if tokens.len() >= opts.max_tokens {
            break FinishReason::Length;
        }
        let input = Tensor::new(&[next], device)?.unsqueeze(0)?;
        logits = model.forward(&input, &mut state, Logits::Last)?.squeeze(0)?.to_vec1::<f32>()?;
    };
    Ok(Generation { tokens, finish, prefill_time, decode_time: decode_start.elapsed() })
}
