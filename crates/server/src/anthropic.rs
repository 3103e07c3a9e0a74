//! Anthropic Messages API: `POST /v1/messages`, translated to the same chat pipeline.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use crate::error::{parse_body, ApiError, ApiResult, Dialect};
use crate::images::{ImagePart, PLACEHOLDER};
use crate::output::{client_gone, drive, Finish, Outcome, OutputOptions, Piece};
use crate::parse::tool_calls::schema_problem;
use crate::request::{generation_options, null_as_default, render_chat, SamplingFields};
use crate::state::AppState;
use crate::structured::{self, ToolChoice};

#[derive(Debug, Deserialize)]
struct MessagesRequest {
    model: Option<String>,
    max_tokens: i64,
    messages: Vec<Value>,
    system: Option<Value>,
    #[serde(default, deserialize_with = "null_as_default")]
    stream: bool,
    stop_sequences: Option<Vec<String>>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    thinking: Option<Value>,
}

fn bad(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(message, Some(param)).in_dialect(Dialect::Anthropic)
}

/// Text of a string or of a list of text blocks.
fn text_of(v: &Value, param: &str) -> ApiResult<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                _ => Err(bad(format!("{param}: only text blocks are supported here"), param)),
            })
            .collect::<ApiResult<Vec<_>>>()
            .map(|parts| parts.concat()),
        _ => Err(bad(format!("{param} must be a string or a list of blocks"), param)),
    }
}

/// Anthropic messages → the OpenAI-shaped messages the chat template reads.
fn to_chat_messages(system: Option<&Value>, messages: &[Value], images: &mut Vec<ImagePart>) -> ApiResult<Vec<Value>> {
    if messages.is_empty() {
        return Err(bad("messages must not be empty", "messages"));
    }
    let mut out = Vec::new();
    if let Some(system) = system {
        out.push(json!({"role": "system", "content": text_of(system, "system")?}));
    }
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        if role != "user" && role != "assistant" {
            return Err(bad(format!("messages[{i}].role `{role}` must be user or assistant"), &format!("messages[{i}].role")));
        }
        let blocks = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(b)) => b.clone(),
            _ => {
                return Err(bad(
                    format!("messages[{i}].content must be a string or a list of blocks"),
                    &format!("messages[{i}].content"),
                ))
            }
        };
        let (mut text, mut reasoning, mut calls) = (String::new(), None, Vec::new());
        for (j, b) in blocks.iter().enumerate() {
            let param = format!("messages[{i}].content[{j}]");
            match b.get("type").and_then(Value::as_str) {
                Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or_default()),
                Some("image") if role == "user" => {
                    let source = b.get("source").unwrap_or(&Value::Null);
                    let field = |name: &str| source.get(name).and_then(Value::as_str);
                    let part = match field("type") {
                        Some("base64") => match (field("media_type"), field("data")) {
                            (Some(media_type), Some(data)) => ImagePart::from_base64(media_type, data, &param),
                            _ => Err(bad(format!("{param}: a base64 source needs media_type and data"), &param)),
                        },
                        Some("url") => match field("url") {
                            Some(url) if url.starts_with("http://") || url.starts_with("https://") => {
                                ImagePart::from_url(url, &param)
                            }
                            _ => Err(bad(format!("{param}: a url source needs an http(s) url"), &param)),
                        },
                        other => Err(bad(format!("{param}: source.type {other:?} is not base64"), &param)),
                    };
                    images.push(part.map_err(|e| e.in_dialect(Dialect::Anthropic))?);
                    text.push(PLACEHOLDER);
                }
                Some("thinking") => reasoning = b.get("thinking").and_then(Value::as_str).map(str::to_string),
                Some("tool_use") if role == "assistant" => calls.push(json!({
                    "type": "function",
                    "id": b.get("id"),
                    "function": {"name": b.get("name"), "arguments": b.get("input").cloned().unwrap_or(json!({}))},
                })),
                Some("tool_result") if role == "user" => {
                    let content = b.get("content").map(|c| text_of(c, &param)).transpose()?.unwrap_or_default();
                    out.push(json!({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": content}));
                }
                other => return Err(bad(format!("{param}: block type {other:?} is not supported in a {role} message"), &param)),
            }
        }
        if !text.is_empty() || !calls.is_empty() || reasoning.is_some() || role == "assistant" {
            let mut msg = json!({"role": role, "content": text});
            if let Some(r) = reasoning {
                msg["reasoning_content"] = Value::String(r);
            }
            if !calls.is_empty() {
                msg["tool_calls"] = Value::Array(calls);
            }
            out.push(msg);
        }
    }
    Ok(out)
}

/// Each tool must have a name and a usable JSON schema as its `input_schema`.
fn check_tools(tools: &[Value]) -> ApiResult<()> {
    for (i, tool) in tools.iter().enumerate() {
        let Some(name) = tool.get("name").and_then(Value::as_str) else {
            return Err(bad(format!("tools[{i}] must be {{\"name\", \"input_schema\"}}"), &format!("tools[{i}].name")));
        };
        let problem = match tool.get("input_schema") {
            Some(schema) => schema_problem(schema, "input_schema"),
            None => Some("input_schema is required".to_string()),
        };
        if let Some(problem) = problem {
            return Err(bad(format!("tools[{i}] (`{name}`): {problem}"), &format!("tools[{i}].input_schema")));
        }
    }
    Ok(())
}

fn stop_reason(o: &Outcome) -> &'static str {
    match (o.finish, &o.stop_string) {
        (Finish::ToolCalls, _) => "tool_use",
        (Finish::Length | Finish::Shutdown, _) => "max_tokens",
        (Finish::Stop, Some(_)) => "stop_sequence",
        (Finish::Stop, None) => "end_turn",
    }
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}{:016x}{:08x}", rand::random::<u64>(), rand::random::<u32>())
}

pub async fn messages(State(state): State<AppState>, body: Bytes) -> Response {
    match handle(state, body).await {
        Ok(r) => r,
        Err(e) => e.in_dialect(Dialect::Anthropic).into_response(),
    }
}

async fn handle(state: AppState, body: Bytes) -> ApiResult<Response> {
    let req: MessagesRequest = parse_body(&body)?;
    // temperature, top_p, top_k, and the OpenAI-style extensions (seed, penalties, logit_bias).
    let sampling: SamplingFields = parse_body(&body)?;
    let sampling = sampling.resolve(&state)?;
    let mut images = Vec::new();
    let messages = to_chat_messages(req.system.as_ref(), &req.messages, &mut images)?;
    let (tool_choice, parallel) = ToolChoice::anthropic(req.tool_choice.as_ref())?;
    check_tools(req.tools.as_deref().unwrap_or_default())?;
    let tools: Option<Vec<Value>> = req.tools.filter(|t| !t.is_empty() && tool_choice != ToolChoice::None).map(|tools| {
        tools
            .iter()
            .map(|t| json!({"type": "function", "function": {"name": t.get("name"), "description": t.get("description"), "parameters": t.get("input_schema")}}))
            .collect()
    });
    let thinking_on = req.thinking.as_ref().and_then(|t| t.get("type")).and_then(Value::as_str) == Some("enabled");
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), Value::Bool(thinking_on));
    let (opens_thinking, prompt) = render_chat(&state, messages, tools.clone(), kwargs, images).await?;
    let mut opts = generation_options(&state, (prompt.tokens.len(), "messages"), Some(req.max_tokens), 0, sampling, None, false)?;
    if let Some(calls) = tool_choice.structure(tools.as_deref().unwrap_or_default(), parallel)? {
        opts.grammar = Some(structured::compile(&state, calls, opens_thinking, "tool_choice").await?);
    }
    let output = OutputOptions { stop: req.stop_sequences.unwrap_or_default(), thinking: Some(opens_thinking), tools };
    let model = req.model.unwrap_or_else(|| state.config.model_name.clone());
    let id = new_id("msg_");

    if !req.stream {
        let mut blocks: Vec<Value> = Vec::new();
        let outcome = drive(&state, prompt, opts, output, std::future::pending(), |p| {
            append_block(&mut blocks, p);
            true
        })
        .await?
        .expect("the collector never stops early")
        .whole()?;
        crate::log_request(&id, &outcome);
        return Ok(Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop_reason(&outcome), "stop_sequence": outcome.stop_string,
            "usage": {"input_tokens": outcome.prompt_tokens - outcome.cached_tokens, "cache_read_input_tokens": outcome.cached_tokens, "output_tokens": outcome.completion_tokens},
        }))
        .into_response());
    }

    let (tx, rx) = mpsc::unbounded_channel::<(&'static str, Value)>();
    let _ = tx.send((
        "message_start",
        json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": prompt.tokens.len(), "output_tokens": 0}}}),
    ));
    let _ = tx.send(("ping", json!({"type": "ping"})));
    tokio::spawn(async move {
        // The open block: its index and kind ("text" or "thinking").
        let mut open: Option<(usize, &'static str)> = None;
        let mut next = 0;
        let sent = drive(&state, prompt, opts, output, client_gone(&tx), |p| {
            let send = |name, v| tx.send((name, v)).is_ok();
            let kind = match &p {
                Piece::Content(_) => "text",
                Piece::Reasoning(_) => "thinking",
                Piece::ToolCall(_) => "tool_use",
                Piece::Logprob { .. } => return true,
            };
            if let Some((index, k)) = open {
                if k != kind || kind == "tool_use" {
                    if !send("content_block_stop", json!({"type": "content_block_stop", "index": index})) {
                        return false;
                    }
                    open = None;
                }
            }
            let index = match open {
                Some((index, _)) => index,
                None => {
                    let index = next;
                    next += 1;
                    let start = match &p {
                        Piece::Content(_) => json!({"type": "text", "text": ""}),
                        Piece::Reasoning(_) => json!({"type": "thinking", "thinking": "", "signature": ""}),
                        Piece::ToolCall(c) => json!({"type": "tool_use", "id": new_id("toolu_"), "name": c.name, "input": {}}),
                        Piece::Logprob { .. } => unreachable!("returned above"),
                    };
                    if !send(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": index, "content_block": start}),
                    ) {
                        return false;
                    }
                    open = Some((index, kind));
                    index
                }
            };
            let delta = match p {
                Piece::Content(t) => json!({"type": "text_delta", "text": t}),
                Piece::Reasoning(t) => json!({"type": "thinking_delta", "thinking": t}),
                Piece::ToolCall(c) => json!({"type": "input_json_delta", "partial_json": c.arguments.to_string()}),
                Piece::Logprob { .. } => unreachable!("returned above"),
            };
            send("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": delta}))
        })
        .await;
        match sent {
            Ok(Some(outcome)) => {
                crate::log_request(&id, &outcome);
                if let Some((index, _)) = open {
                    let _ = tx.send(("content_block_stop", json!({"type": "content_block_stop", "index": index})));
                }
                let _ = tx.send((
                    "message_delta",
                    json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(&outcome), "stop_sequence": outcome.stop_string},
                           "usage": {"output_tokens": outcome.completion_tokens}}),
                ));
                let _ = tx.send(("message_stop", json!({"type": "message_stop"})));
            }
            Ok(None) => tracing::info!(id = %id, "client disconnected; generation cancelled"),
            Err(e) => {
                let _ = tx.send(("error", e.in_dialect(Dialect::Anthropic).body()));
            }
        }
    });
    let events = UnboundedReceiverStream::new(rx)
        .map(|(name, v)| Ok::<_, Infallible>(SseEvent::default().event(name).data(v.to_string())));
    Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
}

/// Adds a piece to the content blocks of a non-streaming answer, extending the last block
/// when it is of the same kind.
fn append_block(blocks: &mut Vec<Value>, piece: Piece) {
    let (kind, field, text) = match piece {
        Piece::Content(t) => ("text", "text", t),
        Piece::Reasoning(t) => ("thinking", "thinking", t),
        Piece::ToolCall(c) => {
            blocks.push(json!({"type": "tool_use", "id": new_id("toolu_"), "name": c.name, "input": c.arguments}));
            return;
        }
        Piece::Logprob { .. } => return,
    };
    match blocks.last_mut() {
        Some(last) if last["type"] == kind => {
            let joined = format!("{}{}", last[field].as_str().unwrap_or_default(), text);
            last[field] = Value::String(joined);
        }
        _ => {
            let mut block = json!({"type": kind, field: text});
            if kind == "thinking" {
                block["signature"] = Value::String(String::new());
            }
            blocks.push(block);
        }
    }
}
