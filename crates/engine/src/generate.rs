//! The single-sequence generation loop: chunked prefill, then one token per step until an end
//! token, the token budget, or the caller stops it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use strata_model::{Logits, Model, ModelError};

use crate::sampler::{Sampler, SamplingParams};
use crate::structured::{Constraint, Grammar, Progress, TokenMask};

#[derive(Clone, Debug)]
pub struct GenerationOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end the generation (not included in the output).
    pub stop_tokens: Vec<u32>,
    /// Prompt tokens fed per forward during prefill, by [`generate`] (the batched engine uses its
    /// own `EngineConfig::prefill_chunk` for every job).
    pub prefill_chunk: usize,
    /// Report each token's log-probability and this many alternatives (`None`: skip the work).
    pub logprobs: Option<usize>,
    /// Structured output: what the tokens must match.
    pub grammar: Option<Arc<Grammar>>,
}

/// A chosen token, with its log-probability under the model's raw distribution when asked.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub id: u32,
    pub logprob: Option<f32>,
    /// The most likely tokens and their log-probabilities, best first.
    pub top_logprobs: Vec<(u32, f32)>,
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
    /// Speculative decoding: verify steps that carried drafts, tokens drafted, and how many of
    /// them the target accepted.
    pub draft_rounds: usize,
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
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
    model: &Model,
    prompt: &[u32],
    opts: &GenerationOptions,
    mut on_token: impl FnMut(&Sampled) -> bool,
) -> strata_model::Result<Generation> {
    if prompt.is_empty() {
        return Err(strata_model::ModelError::Invalid("the prompt is empty".into()));
    }
    let device = model.device();
    let mut state = model.new_state(1)?;
    let sampler = Sampler::new(opts.sampling.clone());
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
    let mut constraint = opts.grammar.as_deref().map(Constraint::new);
    let finish = loop {
        if tokens.len() >= opts.max_tokens {
            break FinishReason::Length;
        }
        let allowed = constraint.as_mut().and_then(|c| c.masks(&[], &opts.stop_tokens).pop().flatten());
        if allowed.as_ref().is_some_and(TokenMask::is_empty) {
            return Err(ModelError::Invalid("the structure allows no token here".into()));
        }
        let next = sampler.sample(&logits, allowed.as_ref(), &context, &tokens);
        if opts.stop_tokens.contains(&next) {
            break FinishReason::Stop;
        }
        tokens.push(next);
        context.push(next);
        let complete = match &mut constraint {
            Some(c) => c.advance(next).map_err(ModelError::Invalid)? == Progress::Complete,
            None => false,
        };
        let sampled = match opts.logprobs {
            None => Sampled { id: next, logprob: None, top_logprobs: Vec::new() },
            Some(top) => with_logprobs(&logits, next, top),
        };
        if !on_token(&sampled) {
            break FinishReason::Cancelled;
        }
        if complete {
            break FinishReason::Stop;
        }
        if tokens.len() >= opts.max_tokens {
            break FinishReason::Length;
        }
        let input = Tensor::new(&[next], device)?.unsqueeze(0)?;
        logits = model.forward(&input, &mut state, Logits::Last)?.squeeze(0)?.to_vec1::<f32>()?;
    };
    Ok(Generation {
        tokens,
        finish,
        draft_rounds: 0,
        drafted_tokens: 0,
        accepted_tokens: 0,
        prefill_time,
        decode_time: decode_start.elapsed(),
    })
}

/// Log-softmax of `logits` at `id`, and the `top` most likely tokens.
pub(crate) fn with_logprobs(logits: &[f32], id: u32, top: usize) -> Sampled {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let log_z = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let top = top.min(order.len());
    if top > 0 {
        order.select_nth_unstable_by(top - 1, |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        order.truncate(top);
        order.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    }
    Sampled {
        id,
        logprob: Some(logits[id as usize] - log_z),
        top_logprobs: order.iter().take(top).map(|&t| (t, logits[t as usize] - log_z)).collect(),
    }
}
