//! From engine events to API output: detokenise, cut at stop strings, split thinking from
//! content, parse tool calls. Shared by the OpenAI and Anthropic endpoints so both dialects
//! see the same pieces.

use std::time::{Duration, Instant};

use strata_engine::{Event, EventSink, FinishReason, GenerationOptions, Job, Sampled};
use tokio::sync::mpsc;

use crate::error::{ApiError, ApiResult};
use crate::parse::stop::StopMatcher;
use crate::parse::thinking::ThinkingSplitter;
use crate::parse::tool_calls::{ToolCall, ToolCallParser, ToolEvent};
use crate::request::Prompt;
use crate::state::AppState;

/// A piece of the answer, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
    /// A token's log-probability (`token` is its text).
    Logprob {
        token: String,
        logprob: f32,
        top: Vec<(String, f32)>,
    },
}

/// How the answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end token or a stop string.
    Stop,
    Length,
    ToolCalls,
    /// Cut by a shutdown whose wait for running requests (`--shutdown-timeout`) ran out.
    /// Streams then end as if at their token limit (OpenAI `finish_reason: "length"`,
    /// Anthropic `stop_reason: "max_tokens"`, values every client library handles as an answer
    /// cut short); a request waiting for its whole answer gets a 503 instead (`Outcome::whole`).
    Shutdown,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub finish: Finish,
    /// The stop string that ended the answer, if one did.
    pub stop_string: Option<String>,
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prompt cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub ttft: Option<Duration>,
    pub elapsed: Duration,
    /// Speculative decoding, when the generation ran to its end in the engine: verify steps
    /// with drafts, tokens drafted, tokens accepted.
    pub speculation: Option<(usize, usize, usize)>,
}

impl Outcome {
    /// The outcome of a request answered whole (not streamed): one cut by a shutdown is a 503,
    /// which SDKs retry (behind a load balancer, on a server that is not stopping); the text
    /// so far under "length" would pass for a whole answer that hit `max_tokens`.
    pub fn whole(self) -> ApiResult<Self> {
        if self.finish == Finish::Shutdown {
            return Err(ApiError::unavailable(format!(
                "the server is shutting down: this request was stopped after {} generated tokens; retry it",
                self.completion_tokens
            )));
        }
        Ok(self)
    }
}

/// How to read the generated text.
pub struct OutputOptions {
    pub stop: Vec<String>,
    /// Some(opens_in_thinking) splits `<think>` blocks out as reasoning; None leaves text alone.
    pub thinking: Option<bool>,
    /// Tools to parse calls against (None: no tool parsing).
    pub tools: Option<Vec<serde_json::Value>>,
}

/// Completes when the receiving end of a stream's channel (its SSE response body) is dropped:
/// the client has gone.
pub fn client_gone<T>(stream: &mpsc::UnboundedSender<T>) -> impl std::future::Future<Output = ()> + 'static
where
    T: Send + 'static,
{
    let stream = stream.clone();
    async move { stream.closed().await }
}

struct ChannelSink(mpsc::UnboundedSender<Event>);

impl EventSink for ChannelSink {
    fn send(&mut self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// Runs one generation and hands each piece to `emit` as soon as it is known. `emit` returns
/// false when the client has gone, and `client_gone` completes when it goes (a stream's
/// client can leave while its request waits, prefills or has its text held back, when nothing
/// is emitted); either cancels the generation: the engine notices the dropped channel before
/// admitting the request, between prefill chunks and within one decode step. A shutdown's
/// cutoff ends it too, as `Finish::Shutdown`, with the text held back so far emitted.
pub async fn drive(
    state: &AppState,
    prompt: Prompt,
    opts: GenerationOptions,
    output: OutputOptions,
    client_gone: impl std::future::Future<Output = ()>,
    mut emit: impl FnMut(Piece) -> bool,
) -> ApiResult<Option<Outcome>> {
    let started = Instant::now();
    let prompt_tokens = prompt.tokens.len();
    let mut cached_tokens = 0;
    let wants_logprobs = opts.logprobs.is_some();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut job = Job::new(prompt.tokens, opts, Box::new(ChannelSink(tx)));
    (job.cache_points, job.images) = (prompt.cache_points, prompt.images);
    state.worker.submit(job).map_err(ApiError::internal)?;

    let tokenizer = &state.tokenizer;
    let mut text = tokenizer.stream(true);
    let mut stop = StopMatcher::new(output.stop.clone());
    let mut think = output.thinking.map(ThinkingSplitter::new);
    let mut tools = output.tools.as_deref().map(ToolCallParser::new);
    let mut pipeline = |delta: &str, flush: bool, saw_call: &mut bool, emit: &mut dyn FnMut(Piece) -> bool| -> bool {
        let (content_parts, reasoning) = match &mut think {
            Some(t) => {
                let mut split = t.push(delta);
                if flush {
                    let rest = t.finish();
                    split.reasoning.push_str(&rest.reasoning);
                    split.content.push_str(&rest.content);
                }
                (split.content, split.reasoning)
            }
            None => (delta.to_string(), String::new()),
        };
        if !reasoning.is_empty() && !emit(Piece::Reasoning(reasoning)) {
            return false;
        }
        let events = match &mut tools {
            Some(p) => {
                let mut ev = p.push(&content_parts);
                if flush {
                    ev.extend(p.finish());
                }
                ev
            }
            None => vec![ToolEvent::Text(content_parts)],
        };
        for e in events {
            let piece = match e {
                ToolEvent::Text(t) if t.is_empty() => continue,
                ToolEvent::Text(t) => Piece::Content(t),
                ToolEvent::Call(c) => {
                    *saw_call = true;
                    Piece::ToolCall(c)
                }
            };
            if !emit(piece) {
                return false;
            }
        }
        true
    };

    let mut ttft = None;
    let mut completion_tokens = 0;
    let mut saw_call = false;
    let cutoff = state.cutoff.reached();
    tokio::pin!(client_gone, cutoff);
    // The engine's end of the generation; None when the shutdown's cutoff came first.
    let finished = loop {
        let event = tokio::select! {
            event = rx.recv() => event,
            () = &mut client_gone => return Ok(None),
            () = &mut cutoff => break None,
        };
        let Some(event) = event else { return Err(ApiError::internal("the engine dropped the request")) };
        match event {
            Event::Token(Sampled { id, logprob, top_logprobs }) => {
                ttft.get_or_insert_with(|| started.elapsed());
                completion_tokens += 1;
                let delta = text.push(id).map_err(|e| ApiError::internal(e.to_string()))?;
                if let (true, Some(lp)) = (wants_logprobs, logprob) {
                    let name = |t: u32| tokenizer.decode(&[t], false).unwrap_or_default();
                    let top = top_logprobs.iter().map(|&(t, l)| (name(t), l)).collect();
                    if !emit(Piece::Logprob { token: name(id), logprob: lp, top }) {
                        return Ok(None);
                    }
                }
                let (safe, hit) = stop.push(&delta);
                if !pipeline(&safe, hit, &mut saw_call, &mut emit) {
                    return Ok(None);
                }
                if hit {
                    // Returning drops the receiver, which cancels the generation at its next token.
                    return Ok(Some(Outcome {
                        finish: if saw_call { Finish::ToolCalls } else { Finish::Stop },
                        stop_string: stop.matched().map(str::to_string),
                        prompt_tokens,
                        cached_tokens,
                        completion_tokens,
                        ttft,
                        elapsed: started.elapsed(),
                        speculation: None,
                    }));
                }
            }
            Event::Finished(g) => break Some(g),
            Event::Started { cached_tokens: n } => cached_tokens = n,
            Event::Failed(message) => return Err(ApiError::internal(message)),
        }
    };
    let rest = stop.finish();
    if !pipeline(&rest, true, &mut saw_call, &mut emit) {
        return Ok(None);
    }
    let finish = match (&finished, saw_call) {
        (None, _) => Finish::Shutdown,
        (Some(_), true) => Finish::ToolCalls,
        (Some(g), false) if matches!(g.finish, FinishReason::Length) => Finish::Length,
        (Some(_), false) => Finish::Stop,
    };
    Ok(Some(Outcome {
        finish,
        stop_string: None,
        prompt_tokens,
        cached_tokens,
        completion_tokens,
        ttft,
        elapsed: started.elapsed(),
        speculation: finished.filter(|g| g.drafted_tokens > 0).map(|g| (g.draft_rounds, g.drafted_tokens, g.accepted_tokens)),
    }))
}
