//! Request pieces shared by the endpoints: sampling with the model's defaults, limits, the
//! chat-template prompt.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Map, Value};
use strata_engine::{GenerationOptions, SamplingChoice, SamplingParams};
use strata_model::tokenizer::Bound;
use strata_model::{ModelError, PreparedImage};

use crate::images::{ImagePart, PLACEHOLDER};

use crate::error::{ApiError, ApiResult};
use crate::parse::thinking::prompt_opens_thinking;
use crate::state::AppState;

/// For the flags the APIs mark nullable (`stream`, `logprobs`, `echo`): `null` reads as leaving
/// the field out, as it does for every optional field.
pub(crate) fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Sampling fields as the APIs spell them; absent ones default from generation_config.json.
#[derive(Debug, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<HashMap<String, f64>>,
}

impl SamplingFields {
    pub fn resolve(&self, state: &AppState) -> ApiResult<SamplingParams> {
        let mut logit_bias = Vec::new();
        for (token, bias) in self.logit_bias.iter().flatten() {
            let id: u32 = token
                .parse()
                .map_err(|_| ApiError::bad_request(format!("logit_bias key `{token}` is not a token id"), Some("logit_bias")))?;
            if id as usize >= state.vocab_size {
                return Err(ApiError::bad_request(
                    format!("logit_bias token {id} is outside the vocabulary"),
                    Some("logit_bias"),
                ));
            }
            logit_bias.push((id, bias.clamp(-100.0, 100.0) as f32));
        }
        if let Some(k) = self.top_k {
            if k < -1 {
                return Err(ApiError::bad_request("top_k must be >= 0 (or -1 for off)", Some("top_k")));
            }
        }
        let choice = SamplingChoice {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k.map(|k| k.max(0) as usize),
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias,
            seed: self.seed,
        };
        choice.resolve(&state.generation).map_err(|msg| {
            let param = msg.split_whitespace().next().unwrap_or_default().to_string();
            ApiError::bad_request(msg, Some(&param))
        })
    }
}

/// Checks the output budget and the context limit; returns the options for the engine. With
/// `ignore_eos` (vLLM's extension), the model's end tokens do not end the generation: only
/// `max_tokens` and stop strings do.
pub fn generation_options(
    state: &AppState,
    (prompt_len, prompt_field): (usize, &'static str),
    max_tokens: Option<i64>,
    default_max: usize,
    sampling: SamplingParams,
    logprobs: Option<usize>,
    ignore_eos: bool,
) -> ApiResult<GenerationOptions> {
    let limit = state.context();
    if prompt_len == 0 {
        return Err(ApiError::bad_request("the prompt is empty", Some(prompt_field)));
    }
    if prompt_len >= limit {
        return Err(ApiError::bad_request(
            format!("the prompt has {prompt_len} tokens; this server's context is {limit} tokens"),
            Some(prompt_field),
        ));
    }
    let max_tokens = match max_tokens {
        Some(n) if n <= 0 => return Err(ApiError::bad_request("max_tokens must be at least 1", Some("max_tokens"))),
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => default_max.min(limit - prompt_len),
    };
    // limit - prompt_len: no overflow, whatever max_tokens asks.
    if max_tokens > limit - prompt_len {
        return Err(ApiError::bad_request(
            format!("prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this server's context of {limit} tokens"),
            Some("max_tokens"),
        ));
    }
    state.worker.admissible(prompt_len + max_tokens).map_err(|m| ApiError::bad_request(m, Some("max_tokens")))?;
    Ok(GenerationOptions {
        max_tokens,
        sampling,
        stop_tokens: if ignore_eos { Vec::new() } else { state.eos_token_ids.clone() },
        prefill_chunk: state.worker.config().prefill_chunk,
        logprobs,
        grammar: None,
    })
}

/// `stop` as a string or a list of strings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// A tokenised prompt, and the lengths at which the prompt cache should keep a snapshot.
pub struct Prompt {
    pub tokens: Vec<u32>,
    pub cache_points: Vec<usize>,
    /// The images its runs of image tokens stand for, in order.
    pub images: Vec<PreparedImage>,
}

impl Prompt {
    pub fn plain(tokens: Vec<u32>) -> Self {
        Self { tokens, cache_points: Vec::new(), images: Vec::new() }
    }
}

/// Runs a request's CPU-heavy preparation (rendering, tokenizing) on the blocking pool, off the
/// async threads. When the request is dropped (its client hung up), `cancelled` is set: the
/// tokenizer stops at its next piece.
pub async fn prepare<T: Send + 'static>(work: impl FnOnce(&AtomicBool) -> ApiResult<T> + Send + 'static) -> ApiResult<T> {
    struct CancelOnDrop(Arc<AtomicBool>);
    impl Drop for CancelOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let cancelled = Arc::new(AtomicBool::new(false));
    let _cancel_on_drop = CancelOnDrop(cancelled.clone());
    tokio::task::spawn_blocking(move || work(&cancelled))
        .await
        .map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))?
}

/// Tokenizing stops once a prompt cannot fit the context (it must leave room for a token).
fn prompt_bound<'a>(state: &AppState, cancelled: &'a AtomicBool) -> Bound<'a> {
    Bound { max_tokens: state.context() - 1, cancelled }
}

/// A rendering or tokenizing error as a response: a prompt past the context or a template
/// error is the request's fault, a 400 naming `field`.
fn prompt_error(state: &AppState, e: ModelError, field: &str) -> ApiError {
    match e {
        ModelError::TooLong(n) => ApiError::bad_request(
            format!("the prompt has more than {n} tokens; this server's context is {} tokens", state.context()),
            Some(field),
        ),
        ModelError::Template(_) => ApiError::bad_request(e.to_string(), Some(field)),
        other => ApiError::internal(other.to_string()),
    }
}

/// Token ids of a `/v1/completions` text prompt (see [`prepare`]).
pub async fn encode_prompt(state: &AppState, text: String) -> ApiResult<Vec<u32>> {
    let state = state.clone();
    prepare(move |cancelled| {
        state
            .tokenizer
            .encode_prompt_within(&text, &prompt_bound(&state, cancelled))
            .map_err(|e| prompt_error(&state, e, "prompt"))
    })
    .await
}

/// Renders the chat template; returns whether the answer starts inside a think block, and the
/// prompt's tokens. The conversation without the generation prompt is rendered too: where it
/// ends is where the next turn's prompt (which re-renders this history, often differently after
/// it — e.g. without the empty think block the generation prompt opened) stops sharing tokens,
/// so the cache keeps a snapshot there; and what the generation prompt adds to it is what may
/// open a think block (a `<think>` in a message's own text does not). Runs in [`prepare`].
pub async fn render_chat(
    state: &AppState,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    kwargs: Map<String, Value>,
    images: Vec<ImagePart>,
) -> ApiResult<(bool, Prompt)> {
    let state = state.clone();
    prepare(move |cancelled| {
        let prepared = crate::images::prepare(&state, &images)?;
        let markup = match (prepared.is_empty(), state.worker.vision()) {
            (false, Some(vision)) => Some(vision.markup(&state.tokenizer).map_err(|e| ApiError::internal(e.to_string()))?),
            _ => None,
        };
        let template = state
            .template
            .as_ref()
            .ok_or_else(|| ApiError::bad_request("this model has no chat template; use /v1/completions", Some("messages")))?;
        let bound = prompt_bound(&state, cancelled);
        let render = |generation_prompt: bool| {
            let mut context = serde_json::json!({
                "messages": messages,
                "tools": tools,
                "add_generation_prompt": generation_prompt,
            });
            for (k, v) in &kwargs {
                context[k] = v.clone();
            }
            let content_as_text = !state.config.special_tokens_in_content;
            template
                .render_tokens(context, &state.tokenizer, content_as_text, &bound, markup.as_deref().map(|m| (PLACEHOLDER, m)))
                .map_err(|e| prompt_error(&state, e, "messages"))
        };
        // The prompt first: one past the context is refused before its history is rendered.
        let (text, tokens) = render(true)?;
        let (history_text, history) = render(false)?;
        // A template whose history renders differently with the generation prompt leaves no
        // clean suffix: then the whole prompt decides.
        let opens_thinking = prompt_opens_thinking(text.strip_prefix(history_text.as_str()).unwrap_or(&text));
        let cache_points =
            if history.len() < tokens.len() && tokens.starts_with(&history) { vec![history.len()] } else { Vec::new() };
        // Each image's one token becomes as many as the image gives (the cache point, where the
        // history ends, follows every image: it moves by as many).
        let grown = |tokens: Vec<u32>| crate::images::expand(&state, tokens, &prepared);
        let (before, tokens) = (tokens.len(), grown(tokens)?);
        let cache_points = cache_points.into_iter().map(|p| p + tokens.len() - before).collect();
        if tokens.len() > state.context() {
            return Err(prompt_error(&state, ModelError::TooLong(state.context()), "messages"));
        }
        Ok((opens_thinking, Prompt { tokens, cache_points, images: prepared }))
    })
    .await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A request dropped while its prompt is prepared (its client hung up) stops that work.
    #[tokio::test(flavor = "multi_thread")]
    async fn dropping_a_request_cancels_its_preparation() {
        let (stopped, saw_stop) = std::sync::mpsc::channel();
        let work = prepare(move |cancelled| {
            while !cancelled.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
            }
            stopped.send(()).unwrap();
            Ok(())
        });
        assert!(tokio::time::timeout(Duration::from_millis(50), work).await.is_err(), "the work runs until cancelled");
        saw_stop.recv_timeout(Duration::from_secs(10)).expect("the work was cancelled");
    }
}
