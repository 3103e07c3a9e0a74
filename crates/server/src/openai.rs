//! OpenAI endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use strata_engine::GenerationOptions;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use crate::error::{parse_body, ApiError, ApiResult};
use crate::images::{ImagePart, PLACEHOLDER};
use crate::output::{client_gone, drive, Finish, Outcome, OutputOptions, Piece};
use crate::parse::tool_calls::schema_problem;
use crate::request::{encode_prompt, generation_options, null_as_default, render_chat, Prompt, SamplingFields, StopField};
use crate::state::AppState;
use crate::structured::{self, ToolChoice};

#[derive(Debug, Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct ChatRequest {
    model: Option<String>,
    messages: Vec<Value>,
    #[serde(default, deserialize_with = "null_as_default")]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    stop: Option<StopField>,
    n: Option<i64>,
    #[serde(default, deserialize_with = "null_as_default")]
    logprobs: bool,
    top_logprobs: Option<usize>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    chat_template_kwargs: Option<Map<String, Value>>,
    reasoning_effort: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    ignore_eos: bool,
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
    parallel_tool_calls: Option<bool>,
}

impl ChatRequest {
    /// A request of these messages, for a dialect that translates onto chat.
    pub(crate) fn translated(
        messages: Vec<Value>,
        max_tokens: Option<i64>,
        tools: Option<Vec<Value>>,
        tool_choice: Option<Value>,
        chat_template_kwargs: Map<String, Value>,
        response_format: Option<Value>,
    ) -> Self {
        Self {
            messages,
            max_completion_tokens: max_tokens,
            tools,
            tool_choice,
            chat_template_kwargs: Some(chat_template_kwargs),
            response_format,
            ..Self::default()
        }
    }
}

pub(crate) fn new_id(prefix: &str) -> String {
    format!("{prefix}{:016x}{:08x}", rand::random::<u64>(), rand::random::<u32>())
}

pub(crate) fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Messages as the chat template expects them: text content parts joined, tool-call arguments
/// given as JSON strings parsed into objects, `developer` treated as `system`.
fn template_messages(messages: &[Value], images: &mut Vec<ImagePart>) -> ApiResult<Vec<Value>> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty", Some("messages")));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let obj = m
                .as_object()
                .ok_or_else(|| ApiError::bad_request(format!("messages[{i}] must be an object"), Some("messages")))?;
            let role = obj.get("role").and_then(Value::as_str).unwrap_or_default();
            let role = match role {
                "system" | "user" | "assistant" | "tool" => role,
                "developer" => "system",
                other => {
                    return Err(ApiError::bad_request(
                        format!("messages[{i}].role `{other}` is not one of system, developer, user, assistant, tool"),
                        Some(&format!("messages[{i}].role")),
                    ))
                }
            };
            let mut out = obj.clone();
            out.insert("role".into(), role.into());
            let content = match obj.get("content") {
                None | Some(Value::Null) => Value::String(String::new()),
                Some(Value::String(s)) => Value::String(s.clone()),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for (j, part) in parts.iter().enumerate() {
                        let param = format!("messages[{i}].content[{j}]");
                        match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            (Some("image_url"), _) if role == "user" => {
                                let url = part.get("image_url").and_then(|u| u.get("url").or(Some(u))).and_then(Value::as_str);
                                let url = url.ok_or_else(|| {
                                    ApiError::bad_request(format!("{param}: image_url.url must be a string"), Some(&param))
                                })?;
                                images.push(ImagePart::from_url(url, &param)?);
                                text.push(PLACEHOLDER);
                            }
                            _ => {
                                return Err(ApiError::bad_request(
                                    format!("{param}: only text parts (and image_url parts in user messages) are supported"),
                                    Some(&format!("messages[{i}].content")),
                                ))
                            }
                        }
                    }
                    Value::String(text)
                }
                Some(_) => {
                    return Err(ApiError::bad_request(
                        format!("messages[{i}].content must be a string or an array of content parts"),
                        Some(&format!("messages[{i}].content")),
                    ))
                }
            };
            out.insert("content".into(), content);
            match obj.get("tool_calls") {
                None | Some(Value::Null) => {}
                Some(Value::Array(calls)) => {
                    let calls = calls.iter().enumerate().map(|(j, c)| template_tool_call(i, j, c)).collect::<ApiResult<_>>()?;
                    out.insert("tool_calls".into(), Value::Array(calls));
                }
                Some(_) => {
                    return Err(ApiError::bad_request(
                        format!("messages[{i}].tool_calls must be an array of tool calls"),
                        Some(&format!("messages[{i}].tool_calls")),
                    ))
                }
            }
            Ok(Value::Object(out))
        })
        .collect()
}

/// A past tool call as the template reads it: `{"function": {"name", "arguments"}}`, the
/// arguments' JSON string parsed into an object.
fn template_tool_call(i: usize, j: usize, call: &Value) -> ApiResult<Value> {
    if call.pointer("/function/name").and_then(Value::as_str).is_none() {
        return Err(ApiError::bad_request(
            format!(
                "messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"
            ),
            Some(&format!("messages[{i}].tool_calls[{j}]")),
        ));
    }
    let mut call = call.clone();
    if let Some(args) = call.pointer("/function/arguments").and_then(Value::as_str) {
        let parsed = serde_json::from_str::<Value>(args).unwrap_or(Value::String(args.to_string()));
        call["function"]["arguments"] = parsed;
    }
    Ok(call)
}

/// Each tool must be a named function whose `parameters`, if any, are a usable JSON schema.
fn check_tools(tools: &[Value]) -> ApiResult<()> {
    for (i, tool) in tools.iter().enumerate() {
        let Some(name) = tool.pointer("/function/name").and_then(Value::as_str) else {
            return Err(ApiError::bad_request(
                format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}"),
                Some(&format!("tools[{i}]")),
            ));
        };
        if let Some(problem) = tool.pointer("/function/parameters").and_then(|s| schema_problem(s, "parameters")) {
            return Err(ApiError::bad_request(
                format!("tools[{i}] (`{name}`): {problem}"),
                Some(&format!("tools[{i}].function.parameters")),
            ));
        }
    }
    Ok(())
}

fn finish_name(outcome: &Outcome) -> &'static str {
    match outcome.finish {
        Finish::Stop => "stop",
        Finish::Length | Finish::Shutdown => "length",
        Finish::ToolCalls => "tool_calls",
    }
}

fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
    })
}

fn tool_call_json(index: usize, call: &crate::parse::tool_calls::ToolCall) -> Value {
    json!({
        "index": index,
        "id": new_id("call_"),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments.to_string()},
    })
}

fn logprob_json(token: &str, logprob: f32, top: &[(String, f32)]) -> Value {
    let entry = |t: &str, l: f32| json!({"token": t, "logprob": l, "bytes": t.as_bytes()});
    let mut v = entry(token, logprob);
    v["top_logprobs"] = Value::Array(top.iter().map(|(t, l)| entry(t, *l)).collect());
    v
}

/// A chat request made ready for the engine: its prompt, generation options and how to read its
/// output. Chat completions run one, and so does the Responses API, translated onto chat.
pub(crate) struct ChatJob {
    pub prompt: Prompt,
    pub opts: GenerationOptions,
    pub output: OutputOptions,
}

/// Checks a chat request's messages, tools and limits and renders its prompt.
pub(crate) async fn prepare_chat(state: &AppState, req: ChatRequest, sampling: &SamplingFields) -> ApiResult<ChatJob> {
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("only n = 1 is supported", Some("n")));
    }
    let sampling = sampling.resolve(state)?;
    let mut images = Vec::new();
    let messages = template_messages(&req.messages, &mut images)?;
    let tool_choice = ToolChoice::openai(req.tool_choice.as_ref())?;
    check_tools(req.tools.as_deref().unwrap_or_default())?;
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let forced = tool_choice.structure(req.tools.as_deref().unwrap_or_default(), parallel)?;
    let requested = structured::requested(req.response_format.as_ref(), req.structured_outputs.as_ref())?;
    let structure = match (forced, requested) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "a forced tool_choice and response_format (or structured_outputs) both constrain the output: give one",
                Some("tool_choice"),
            ))
        }
        (Some(calls), None) => Some((calls, "tool_choice")),
        (None, requested) => requested,
    };
    let tools = req.tools.filter(|t| !t.is_empty() && tool_choice != ToolChoice::None);
    let mut kwargs = req.chat_template_kwargs.unwrap_or_default();
    if req.reasoning_effort.as_deref() == Some("none") {
        kwargs.insert("enable_thinking".into(), Value::Bool(false));
    }
    let (opens_thinking, prompt) = render_chat(state, messages, tools.clone(), kwargs, images).await?;
    if req.top_logprobs.is_some_and(|n| n > 20) {
        return Err(ApiError::bad_request("top_logprobs must be at most 20", Some("top_logprobs")));
    }
    let top = if req.logprobs { Some(req.top_logprobs.unwrap_or(0)) } else { None };
    let mut opts = generation_options(
        state,
        (prompt.tokens.len(), "messages"),
        req.max_completion_tokens.or(req.max_tokens),
        4096,
        sampling,
        top,
        req.ignore_eos,
    )?;
    if let Some((structure, field)) = structure {
        opts.grammar = Some(structured::compile(state, structure, opens_thinking, field).await?);
    }
    let output =
        OutputOptions { stop: req.stop.map(StopField::into_vec).unwrap_or_default(), thinking: Some(opens_thinking), tools };
    Ok(ChatJob { prompt, opts, output })
}

pub async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Response {
    match chat(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat(state: AppState, body: Bytes) -> ApiResult<Response> {
    let req: ChatRequest = parse_body(&body)?;
    // Parsed on its own rather than flattened into the request, so errors name the field.
    let sampling: SamplingFields = parse_body(&body)?;
    let (stream, wants_logprobs) = (req.stream, req.logprobs);
    let include_usage = req.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
    let model = req.model.clone().unwrap_or_else(|| state.config.model_name.clone());
    let ChatJob { prompt, opts, output } = prepare_chat(&state, req, &sampling).await?;
    let id = new_id("chatcmpl-");

    if !stream {
        let (mut content, mut reasoning, mut calls, mut logprobs) = (String::new(), String::new(), Vec::new(), Vec::new());
        let outcome = drive(&state, prompt, opts, output, std::future::pending(), |p| {
            match p {
                Piece::Content(t) => content.push_str(&t),
                Piece::Reasoning(t) => reasoning.push_str(&t),
                Piece::ToolCall(c) => calls.push(c),
                Piece::Logprob { token, logprob, top } => logprobs.push(logprob_json(&token, logprob, &top)),
            }
            true
        })
        .await?
        .expect("the collector never stops early")
        .whole()?;
        crate::log_request(&id, &outcome);
        let mut message = json!({"role": "assistant", "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(content) }});
        if !reasoning.is_empty() {
            message["reasoning_content"] = Value::String(reasoning);
        }
        if !calls.is_empty() {
            message["tool_calls"] = calls.iter().enumerate().map(|(i, c)| tool_call_json(i, c)).collect();
        }
        let logprobs = if wants_logprobs { json!({"content": logprobs}) } else { Value::Null };
        return Ok(Json(json!({
            "id": id, "object": "chat.completion", "created": now(), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_name(&outcome)}],
            "usage": usage(&outcome),
        }))
        .into_response());
    }

    let (tx, rx) = mpsc::unbounded_channel::<Value>();
    let created = now();
    let chunk = {
        let (id, model) = (id.clone(), model.clone());
        move |delta: Value, finish: Value, logprobs: Value| {
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
        }
    };
    let _ = tx.send(chunk(json!({"role": "assistant", "content": ""}), Value::Null, Value::Null));
    tokio::spawn(async move {
        let mut calls = 0;
        let sent = drive(&state, prompt, opts, output, client_gone(&tx), |p| {
            let c = match p {
                Piece::Content(t) => chunk(json!({"content": t}), Value::Null, Value::Null),
                Piece::Reasoning(t) => chunk(json!({"reasoning_content": t}), Value::Null, Value::Null),
                Piece::ToolCall(c) => {
                    calls += 1;
                    chunk(json!({"tool_calls": [tool_call_json(calls - 1, &c)]}), Value::Null, Value::Null)
                }
                Piece::Logprob { token, logprob, top } => {
                    chunk(json!({}), Value::Null, json!({"content": [logprob_json(&token, logprob, &top)]}))
                }
            };
            tx.send(c).is_ok()
        })
        .await;
        match sent {
            Ok(Some(outcome)) => {
                crate::log_request(&id, &outcome);
                let mut last = chunk(json!({}), Value::String(finish_name(&outcome).into()), Value::Null);
                if include_usage {
                    let _ = tx.send(last);
                    last = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": usage(&outcome)});
                }
                let _ = tx.send(last);
            }
            Ok(None) => tracing::info!(id = %id, "client disconnected; generation cancelled"),
            Err(e) => {
                let _ = tx.send(e.body());
            }
        }
    });
    Ok(sse(rx))
}

/// An SSE response from a channel of JSON payloads, closed with `data: [DONE]`.
fn sse(rx: mpsc::UnboundedReceiver<Value>) -> Response {
    let events = UnboundedReceiverStream::new(rx)
        .map(|v| Ok::<_, Infallible>(SseEvent::default().data(v.to_string())))
        .chain(tokio_stream::once(Ok(SseEvent::default().data("[DONE]"))));
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Batch(Vec<PromptField>),
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: PromptField,
    #[serde(default, deserialize_with = "null_as_default")]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    stop: Option<StopField>,
    n: Option<i64>,
    #[serde(default, deserialize_with = "null_as_default")]
    echo: bool,
    logprobs: Option<usize>,
    #[serde(default, deserialize_with = "null_as_default")]
    ignore_eos: bool,
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
}

pub async fn completions(State(state): State<AppState>, body: Bytes) -> Response {
    match completion(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completion(state: AppState, body: Bytes) -> ApiResult<Response> {
    let req: CompletionRequest = parse_body(&body)?;
    let sampling: SamplingFields = parse_body(&body)?;
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("only n = 1 is supported", Some("n")));
    }
    if req.logprobs.is_some_and(|n| n > 5) {
        return Err(ApiError::bad_request("logprobs must be between 0 and 5", Some("logprobs")));
    }
    // The legacy API then scores the prompt's own tokens too (what evaluation harnesses read);
    // answering with the generated tokens' logprobs alone would score every prompt as empty.
    if req.echo && req.logprobs.is_some() {
        return Err(ApiError::bad_request(
            "echo with logprobs (the prompt's own logprobs) is not supported; `strata perplexity` scores text",
            Some("echo"),
        ));
    }
    let prompt = match req.prompt {
        PromptField::Batch(mut items) if items.len() == 1 => items.remove(0),
        PromptField::Batch(_) => return Err(ApiError::bad_request("only one prompt per request is supported", Some("prompt"))),
        single => single,
    };
    let prompt = match prompt {
        PromptField::Text(t) => encode_prompt(&state, t).await?,
        PromptField::Tokens(ids) => ids,
        PromptField::Batch(_) => return Err(ApiError::bad_request("prompt: nested lists are not supported", Some("prompt"))),
    };
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= state.vocab_size) {
        return Err(ApiError::bad_request(
            format!("prompt token {bad} is outside the vocabulary (size {})", state.vocab_size),
            Some("prompt"),
        ));
    }
    let sampling = sampling.resolve(&state)?;
    let mut opts =
        generation_options(&state, (prompt.len(), "prompt"), req.max_tokens, 16, sampling, req.logprobs, req.ignore_eos)?;
    if let Some((structure, field)) = structured::requested(req.response_format.as_ref(), req.structured_outputs.as_ref())? {
        opts.grammar = Some(structured::compile(&state, structure, false, field).await?);
    }
    let output = OutputOptions { stop: req.stop.map(StopField::into_vec).unwrap_or_default(), thinking: None, tools: None };
    let echo = if req.echo {
        state.tokenizer.decode(&prompt, false).map_err(|e| ApiError::internal(e.to_string()))?
    } else {
        String::new()
    };
    let model = req.model.unwrap_or_else(|| state.config.model_name.clone());
    let id = new_id("cmpl-");
    let created = now();
    let choice = |text: String, logprobs: Value, finish: Value| json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish});
    let legacy_logprobs = |entries: &[(String, f32, Vec<(String, f32)>)]| {
        json!({
            "tokens": entries.iter().map(|e| e.0.clone()).collect::<Vec<_>>(),
            "token_logprobs": entries.iter().map(|e| e.1).collect::<Vec<_>>(),
            "top_logprobs": entries.iter().map(|e| e.2.iter().map(|(t, l)| (t.clone(), json!(l))).collect::<Map<_, _>>()).collect::<Vec<_>>(),
        })
    };

    if !req.stream {
        let mut text = echo;
        let mut entries = Vec::new();
        let outcome = drive(&state, Prompt::plain(prompt), opts, output, std::future::pending(), |p| {
            match p {
                Piece::Content(t) | Piece::Reasoning(t) => text.push_str(&t),
                Piece::ToolCall(_) => {}
                Piece::Logprob { token, logprob, top } => entries.push((token, logprob, top)),
            }
            true
        })
        .await?
        .expect("the collector never stops early")
        .whole()?;
        crate::log_request(&id, &outcome);
        let logprobs = if req.logprobs.is_some() { legacy_logprobs(&entries) } else { Value::Null };
        return Ok(Json(json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice(text, logprobs, Value::String(finish_name(&outcome).into()))],
            "usage": usage(&outcome),
        }))
        .into_response());
    }

    let include_usage = req.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    let (tx, rx) = mpsc::unbounded_channel::<Value>();
    let chunk = {
        let (id, model) = (id.clone(), model.clone());
        move |c: Value| json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": [c]})
    };
    if !echo.is_empty() {
        let _ = tx.send(chunk(choice(echo, Value::Null, Value::Null)));
    }
    tokio::spawn(async move {
        let sent = drive(&state, Prompt::plain(prompt), opts, output, client_gone(&tx), |p| {
            let c = match p {
                Piece::Content(t) | Piece::Reasoning(t) => choice(t, Value::Null, Value::Null),
                Piece::ToolCall(_) => return true,
                Piece::Logprob { token, logprob, top } => {
                    choice(String::new(), legacy_logprobs(&[(token, logprob, top)]), Value::Null)
                }
            };
            tx.send(chunk(c)).is_ok()
        })
        .await;
        match sent {
            Ok(Some(outcome)) => {
                crate::log_request(&id, &outcome);
                let _ = tx.send(chunk(choice(String::new(), Value::Null, Value::String(finish_name(&outcome).into()))));
                if include_usage {
                    let _ = tx.send(json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": [], "usage": usage(&outcome)}));
                }
            }
            Ok(None) => tracing::info!(id = %id, "client disconnected; generation cancelled"),
            Err(e) => {
                let _ = tx.send(e.body());
            }
        }
    });
    Ok(sse(rx))
}

pub async fn models(State(state): State<AppState>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": state.config.model_name, "object": "model", "created": 0, "owned_by": "strata"}],
    }))
}
