//! The benchmark's HTTP client: streamed `/v1/completions` requests to an OpenAI-compatible
//! server, each output chunk timed as it arrives.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use super::metrics::Completion;
use super::workload::Request;

/// An OpenAI-compatible server at a base URL (what comes before `/v1`).
pub struct Endpoint {
    base: String,
    agent: ureq::Agent,
    /// Sent as `Authorization: Bearer KEY`.
    api_key: Option<String>,
}

impl Endpoint {
    pub fn new(base: &str, api_key: Option<String>) -> Result<Self> {
        let url = url::Url::parse(base).with_context(|| format!("--url {base}: not a URL (expected http://HOST:PORT)"))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            bail!("--url {base}: expected http://HOST:PORT or https://HOST:PORT");
        }
        // No proxy from the environment: the benchmark measures the server, not a detour.
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(10))
            .user_agent(concat!("strata-bench/", env!("CARGO_PKG_VERSION")))
            .build();
        Ok(Self { base: base.trim_end_matches('/').to_string(), agent, api_key })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn request(&self, method: &str, path: &str) -> ureq::Request {
        let request = self.agent.request(method, &format!("{}{path}", self.base));
        match &self.api_key {
            Some(key) => request.set("Authorization", &format!("Bearer {key}")),
            None => request,
        }
    }

    /// The first model `GET /v1/models` lists.
    pub fn first_model(&self) -> Result<String> {
        let response = self.request("GET", "/v1/models").call().map_err(|e| anyhow!(self.failure("/v1/models", e)))?;
        let body = response.into_string().with_context(|| format!("reading {}/v1/models", self.base))?;
        let listed: Value = serde_json::from_str(&body)
            .with_context(|| format!("{}/v1/models answered no JSON: {}", self.base, excerpt(&body)))?;
        let id = listed.pointer("/data/0/id").and_then(Value::as_str);
        id.map(str::to_string)
            .with_context(|| format!("{}/v1/models lists no model; name the model with --served-model-name", self.base))
    }

    /// Sends `request` as a streamed, greedy completion of `model` that ignores end tokens (so
    /// it generates its `max_tokens`), and times its output.
    pub fn complete(&self, model: &str, request: &Request) -> Result<Completion, String> {
        let body = json!({
            "model": model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let sent = Instant::now();
        let response = self
            .request("POST", "/v1/completions")
            .set("Content-Type", "application/json")
            .send_string(&body.to_string())
            .map_err(|e| self.failure("/v1/completions", e))?;
        let mut reader = BufReader::new(response.into_reader());
        let mut events = Events::new(sent);
        let mut line = String::new();
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) => break,
                Ok(_) if events.read(line.trim_end(), Instant::now())? => {
                    // Past `[DONE]`, the body's end is read too, so the connection can be reused.
                    let _ = std::io::copy(&mut reader, &mut std::io::sink());
                    break;
                }
                Ok(_) => {}
                Err(e) => return Err(format!("the stream broke off: {e}")),
            }
        }
        events.finish(request.prompt.len())
    }

    /// A failed call in one line: the answer's status and error message, or why the server
    /// could not be reached.
    fn failure(&self, path: &str, e: ureq::Error) -> String {
        match e {
            ureq::Error::Status(code, response) => {
                format!("{path} answered HTTP {code}: {}", error_message(&response.into_string().unwrap_or_default()))
            }
            ureq::Error::Transport(t) => {
                // ureq's text starts with the URL already.
                let url = format!("{}{path}", self.base);
                let why = t.to_string();
                format!("cannot reach {url}: {}", why.strip_prefix(&format!("{url}: ")).unwrap_or(&why))
            }
        }
    }
}

/// What a completion's server-sent events have told so far.
struct Events {
    sent: Instant,
    /// When each chunk that carried output text arrived.
    chunks: Vec<Instant>,
    /// From the usage chunk.
    output_tokens: Option<usize>,
}

impl Events {
    fn new(sent: Instant) -> Self {
        Self { sent, chunks: Vec::new(), output_tokens: None }
    }

    /// Reads a line of the stream that arrived at `at`; true once it is `data: [DONE]`.
    fn read(&mut self, line: &str, at: Instant) -> Result<bool, String> {
        // Events are in data lines; the rest are separators, comments (keep-alives) and names.
        let Some(data) = line.strip_prefix("data:").map(str::trim_start) else { return Ok(false) };
        if data == "[DONE]" {
            return Ok(true);
        }
        let event: Value =
            serde_json::from_str(data).map_err(|e| format!("a streamed event is not JSON ({e}): {}", excerpt(data)))?;
        if event.get("error").is_some_and(|e| !e.is_null()) || event["object"] == "error" {
            return Err(format!("the stream ended in an error: {}", error_message(data)));
        }
        // Chunks with text are the output: a chunk that only names the finish reason is not.
        if event.pointer("/choices/0/text").and_then(Value::as_str).is_some_and(|t| !t.is_empty()) {
            self.chunks.push(at);
        }
        if let Some(n) = event.pointer("/usage/completion_tokens").and_then(Value::as_u64) {
            self.output_tokens = Some(n as usize);
        }
        Ok(false)
    }

    fn finish(self, prompt_tokens: usize) -> Result<Completion, String> {
        let (Some(&first), Some(&last)) = (self.chunks.first(), self.chunks.last()) else {
            return Err("the stream carried no output text".into());
        };
        let output_tokens =
            self.output_tokens.ok_or("the stream ended without a usage chunk (stream_options.include_usage ignored?)")?;
        Ok(Completion {
            prompt_tokens,
            output_tokens,
            ttft: first - self.sent,
            latency: last - self.sent,
            itl: self.chunks.windows(2).map(|w| w[1] - w[0]).collect(),
        })
    }
}

/// An error body's message: OpenAI's `{"error": {"message"}}` (strata's, vLLM's), a bare
/// `error` or `message` string, FastAPI's `detail`; else the body's start.
fn error_message(body: &str) -> String {
    let json = serde_json::from_str::<Value>(body).unwrap_or_default();
    let message =
        ["/error/message", "/error", "/message", "/detail"].iter().find_map(|p| json.pointer(p).and_then(Value::as_str));
    match message {
        Some(m) => m.to_string(),
        None if body.trim().is_empty() => "(no body)".into(),
        None => excerpt(body),
    }
}

/// The first 200 characters of `text`.
fn excerpt(text: &str) -> String {
    match text.char_indices().nth(200) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `lines`, each arriving `at` milliseconds after the request was sent.
    fn stream(lines: &[(u64, &str)]) -> Result<Completion, String> {
        let sent = Instant::now();
        let mut events = Events::new(sent);
        for &(at, line) in lines {
            if events.read(line, sent + Duration::from_millis(at))? {
                break;
            }
        }
        events.finish(3)
    }

    #[test]
    fn output_chunks_are_timed_and_usage_counts_the_tokens() {
        let c = stream(&[
            (0, ": keep-alive"),
            (40, r#"data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}"#),
            (40, ""),
            (55, r#"data:{"choices":[{"index":0,"text":" b","finish_reason":null}]}"#),
            (90, r#"data: {"choices":[{"index":0,"text":" c","finish_reason":"length"}]}"#),
            (91, r#"data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}"#),
            (92, r#"data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#),
            (93, "data: [DONE]"),
            (500, r#"data: {"choices":[{"index":0,"text":"after the end"}]}"#),
        ])
        .unwrap();
        let ms = Duration::from_millis;
        assert_eq!((c.prompt_tokens, c.output_tokens), (3, 4));
        assert_eq!((c.ttft, c.latency, c.itl), (ms(40), ms(90), vec![ms(15), ms(35)]));
    }

    #[test]
    fn streams_that_fail_say_why() {
        let text = r#"data: {"choices":[{"text":"a"}]}"#;
        let error = r#"data: {"error":{"message":"the server is shutting down","type":"server_error"}}"#;
        assert_eq!(stream(&[(1, text), (2, error)]).unwrap_err(), "the stream ended in an error: the server is shutting down");
        let old_vllm = r#"data: {"object":"error","message":"out of memory"}"#;
        assert_eq!(stream(&[(1, old_vllm)]).unwrap_err(), "the stream ended in an error: out of memory");
        assert!(stream(&[(1, text), (2, "data: [DONE]")]).unwrap_err().contains("without a usage chunk"));
        let usage = r#"data: {"choices":[],"usage":{"completion_tokens":4}}"#;
        assert_eq!(stream(&[(1, usage)]).unwrap_err(), "the stream carried no output text");
        assert!(stream(&[(1, "data: {oops")]).unwrap_err().starts_with("a streamed event is not JSON"));
    }

    #[test]
    fn error_bodies_give_their_message() {
        assert_eq!(error_message(r#"{"error":{"message":"max_tokens too large","param":"max_tokens"}}"#), "max_tokens too large");
        assert_eq!(error_message(r#"{"detail":"Not Found"}"#), "Not Found");
        assert_eq!(error_message(""), "(no body)");
        assert_eq!(error_message(&"x".repeat(300)), format!("{}…", "x".repeat(200)));
    }

    #[test]
    fn urls_must_be_http() {
        assert!(Endpoint::new("http://127.0.0.1:8000/", None).is_ok_and(|e| e.base() == "http://127.0.0.1:8000"));
        for bad in ["127.0.0.1:8000", "ftp://host", "not a url"] {
            assert!(Endpoint::new(bad, None).is_err(), "{bad}");
        }
    }
}
