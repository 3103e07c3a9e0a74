//! OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`. A
//! request's items become chat messages and run as a chat completion does
//! (`openai::prepare_chat`); the answer's pieces become output items and, streamed, the
//! Responses event sequence. A stored response (`store`, on by default as at OpenAI) keeps its
//! conversation, which `previous_response_id` continues exactly as if its items were sent again,
//! so the next turn's prompt starts with the previous one and reuses its prompt cache.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

use crate::error::{parse_body, ApiError, ApiResult, Dialect};
use crate::openai::{new_id, now, prepare_chat, ChatJob, ChatRequest};
use crate::output::{client_gone, drive, Finish, Outcome, Piece};
use crate::parse::tool_calls::ToolCall;
use crate::request::{null_as_default, SamplingFields};
use crate::state::AppState;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum InputField {
    Text(String),
    Items(Vec<Value>),
}

#[derive(Debug, Deserialize)]
struct ReasoningField {
    effort: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    model: Option<String>,
    input: Option<InputField>,
    instructions: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    stream: bool,
    store: Option<bool>,
    previous_response_id: Option<String>,
    max_output_tokens: Option<i64>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    reasoning: Option<ReasoningField>,
    metadata: Option<Map<String, Value>>,
    text: Option<Value>,
    parallel_tool_calls: Option<bool>,
}

fn bad(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(message, Some(param))
}

fn not_found(id: &str, param: Option<&str>) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no stored response with id '{id}'"),
        param: param.map(str::to_string),
        dialect: Dialect::OpenAi,
    }
}

/// Text of a message's `content` (or an output's `output`), the field at `param`: a string, or
/// a list of text parts.
fn text_of(content: Option<&Value>, param: &str) -> ApiResult<String> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                let field = if kind == Some("refusal") { "refusal" } else { "text" };
                match (kind, part.get(field).and_then(Value::as_str)) {
                    (Some("input_text" | "output_text" | "refusal"), Some(t)) => text.push_str(t),
                    _ => {
                        return Err(bad(
                            format!(
                                "{param}[{j}]: only input_text, output_text and refusal parts are supported, with their text"
                            ),
                            &format!("{param}[{j}]"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(bad(format!("{param} must be a string or a list of content parts"), param)),
    }
}

/// A reasoning item's text: its `reasoning_text` content, else its summary.
fn reasoning_text(item: &Map<String, Value>) -> String {
    let texts = |field: &str| -> String {
        let parts = item.get(field).and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect()
    };
    Some(texts("content")).filter(|t| !t.is_empty()).unwrap_or_else(|| texts("summary"))
}

/// The items of one assistant turn, gathered into one chat message.
#[derive(Default)]
struct AssistantTurn {
    text: String,
    reasoning: String,
    calls: Vec<Value>,
}

impl AssistantTurn {
    fn into_message(self) -> Value {
        let mut message = json!({"role": "assistant", "content": self.text});
        if !self.reasoning.is_empty() {
            message["reasoning_content"] = Value::String(self.reasoning);
        }
        if !self.calls.is_empty() {
            message["tool_calls"] = Value::Array(self.calls);
        }
        message
    }
}

/// The conversation's items as chat messages. Items in a row of one assistant turn (reasoning,
/// assistant messages, function calls) make one assistant message, as the answer they came
/// from was one. `first_new` is where this request's own `input` starts (what came before is
/// a stored conversation, checked when it was sent), for the errors' field paths.
fn chat_messages(instructions: Option<&str>, items: &[Value], first_new: usize) -> ApiResult<Vec<Value>> {
    let mut messages = Vec::new();
    if let Some(text) = instructions {
        messages.push(json!({"role": "system", "content": text}));
    }
    let mut turn: Option<AssistantTurn> = None;
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{}]", i.saturating_sub(first_new));
        let item = item.as_object().ok_or_else(|| bad(format!("{at} must be an object"), &at))?;
        let role = item.get("role").and_then(Value::as_str);
        let kind = match item.get("type") {
            None if role.is_some() => "message",
            Some(Value::String(kind)) => kind.as_str(),
            _ => return Err(bad(format!("{at} needs a `type` (or, for a message, a `role`)"), &format!("{at}.type"))),
        };
        let string = |field: &str| {
            item.get(field)
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("{at}.{field} must be a string"), &format!("{at}.{field}")))
        };
        match kind {
            "message" if role == Some("assistant") => {
                turn.get_or_insert_default().text.push_str(&text_of(item.get("content"), &format!("{at}.content"))?);
            }
            "reasoning" => turn.get_or_insert_default().reasoning.push_str(&reasoning_text(item)),
            "function_call" => {
                let call = json!({"type": "function", "id": string("call_id")?,
                                  "function": {"name": string("name")?, "arguments": string("arguments")?}});
                turn.get_or_insert_default().calls.push(call);
            }
            "message" | "function_call_output" => {
                messages.extend(turn.take().map(AssistantTurn::into_message));
                messages.push(if kind == "message" {
                    let role = match role {
                        Some(role @ ("user" | "system" | "developer")) => role,
                        other => {
                            return Err(bad(
                                format!("{at}.role {other:?} is not one of user, system, developer, assistant"),
                                &format!("{at}.role"),
                            ))
                        }
                    };
                    json!({"role": role, "content": text_of(item.get("content"), &format!("{at}.content"))?})
                } else {
                    let output = text_of(item.get("output"), &format!("{at}.output"))?;
                    json!({"role": "tool", "tool_call_id": string("call_id")?, "content": output})
                });
            }
            other => {
                return Err(bad(
                    format!(
                    "{at}.type `{other}` is not supported: only message, function_call, function_call_output and reasoning items"
                ),
                    &format!("{at}.type"),
                ))
            }
        }
    }
    messages.extend(turn.take().map(AssistantTurn::into_message));
    Ok(messages)
}

/// Responses function tools (`{"type": "function", "name", "parameters"}`) in chat's shape.
fn chat_tools(tools: &[Value]) -> ApiResult<Vec<Value>> {
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            let kind = tool.get("type").and_then(Value::as_str);
            if kind != Some("function") {
                return Err(bad(
                    format!("tools[{i}]: type {kind:?} is not supported: only function tools"),
                    &format!("tools[{i}].type"),
                ));
            }
            let name = tool.get("name").filter(|n| n.is_string());
            let name = name.ok_or_else(|| bad(format!("tools[{i}].name must be a string"), &format!("tools[{i}].name")))?;
            let mut function = json!({"name": name});
            for field in ["description", "parameters"] {
                if let Some(v) = tool.get(field).filter(|v| !v.is_null()) {
                    function[field] = v.clone();
                }
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect()
}

/// Chat's field names in an error from `prepare_chat`, in the Responses API's terms.
fn in_responses_terms(mut e: ApiError) -> ApiError {
    e.param = e.param.map(|p| match p.as_str() {
        "messages" => "input".to_string(),
        "max_tokens" => "max_output_tokens".to_string(),
        _ => p.replace(".function.", "."),
    });
    e
}

/// `reasoning.effort` as the chat template's thinking switch.
fn thinking_for(effort: &str) -> ApiResult<bool> {
    match effort {
        "none" | "minimal" => Ok(false),
        "low" | "medium" | "high" | "xhigh" => Ok(true),
        other => Err(bad(
            format!("reasoning.effort `{other}` is not one of none, minimal, low, medium, high, xhigh"),
            "reasoning.effort",
        )),
    }
}

/// OpenAI's bounds: at most 16 pairs, keys of at most 64 characters, string values of at most 512.
fn check_metadata(metadata: &Map<String, Value>) -> ApiResult<()> {
    if metadata.len() > 16 {
        return Err(bad("metadata may have at most 16 pairs", "metadata"));
    }
    for (key, value) in metadata {
        if key.chars().count() > 64 {
            return Err(bad(format!("metadata key `{key}` is longer than 64 characters"), "metadata"));
        }
        if !value.as_str().is_some_and(|v| v.chars().count() <= 512) {
            return Err(bad(format!("metadata `{key}` must be a string of at most 512 characters"), &format!("metadata.{key}")));
        }
    }
    Ok(())
}

fn usage(outcome: &Outcome, reasoning_tokens: usize) -> Value {
    json!({
        "input_tokens": outcome.prompt_tokens,
        "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
        "output_tokens": outcome.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
    })
}

/// A stream-event sink: false once the client has gone.
type Send<'a> = &'a mut dyn FnMut(Value) -> bool;

/// The output items of an answer, built from its pieces in order, with the stream events that
/// announce each step. A whole answer builds the same items and drops the events, so streamed
/// and whole answers cannot differ.
#[derive(Default)]
struct OutputItems {
    items: Vec<Value>,
    /// The text so far of the last item, while it is an open message or reasoning item.
    open: Option<String>,
}

impl OutputItems {
    fn push(&mut self, piece: Piece, send: Send) -> bool {
        let (kind, text) = match piece {
            Piece::Content(t) => ("message", t),
            Piece::Reasoning(t) => ("reasoning", t),
            Piece::ToolCall(call) => return self.close("completed", send) && self.function_call(call, send),
            Piece::Logprob { .. } => return true,
        };
        let continues = self.open.is_some() && self.items.last().is_some_and(|item| item["type"] == kind);
        if !continues && !(self.close("completed", send) && self.start(kind, send)) {
            return false;
        }
        let index = self.items.len() - 1;
        let id = self.items[index]["id"].clone();
        self.open.get_or_insert_default().push_str(&text);
        let event = if kind == "message" {
            json!({"type": "response.output_text.delta", "item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []})
        } else {
            json!({"type": "response.reasoning_text.delta", "item_id": id, "output_index": index, "content_index": 0, "delta": text})
        };
        send(event)
    }

    fn start(&mut self, kind: &str, send: Send) -> bool {
        let (item, part) = if kind == "message" {
            (
                json!({"id": new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}),
                json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []}),
            )
        } else {
            (
                json!({"id": new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}),
                json!({"type": "reasoning_text", "text": ""}),
            )
        };
        let index = self.items.len();
        let id = item["id"].clone();
        self.items.push(item.clone());
        self.open = Some(String::new());
        send(json!({"type": "response.output_item.added", "output_index": index, "item": item}))
            && send(
                json!({"type": "response.content_part.added", "item_id": id, "output_index": index, "content_index": 0, "part": part}),
            )
    }

    /// Closes the open item, if any, with `status` (`incomplete` for one cut by the token limit).
    fn close(&mut self, status: &str, send: Send) -> bool {
        let Some(text) = self.open.take() else { return true };
        let index = self.items.len() - 1;
        let item = &mut self.items[index];
        let id = item["id"].clone();
        let (part, done) = if item["type"] == "message" {
            (
                json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []}),
                json!({"type": "response.output_text.done", "item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
            )
        } else {
            (
                json!({"type": "reasoning_text", "text": text}),
                json!({"type": "response.reasoning_text.done", "item_id": id, "output_index": index, "content_index": 0, "text": text}),
            )
        };
        item["content"] = json!([part]);
        item["status"] = status.into();
        let item = item.clone();
        send(done)
            && send(
                json!({"type": "response.content_part.done", "item_id": id, "output_index": index, "content_index": 0, "part": part}),
            )
            && send(json!({"type": "response.output_item.done", "output_index": index, "item": item}))
    }

    fn function_call(&mut self, call: ToolCall, send: Send) -> bool {
        let index = self.items.len();
        let arguments = call.arguments.to_string();
        let added = json!({"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": new_id("call_"),
                           "name": call.name, "arguments": ""});
        let id = added["id"].clone();
        let mut item = added.clone();
        item["status"] = "completed".into();
        item["arguments"] = arguments.clone().into();
        self.items.push(item.clone());
        send(json!({"type": "response.output_item.added", "output_index": index, "item": added}))
            && send(
                json!({"type": "response.function_call_arguments.delta", "item_id": id, "output_index": index, "delta": arguments}),
            )
            && send(
                json!({"type": "response.function_call_arguments.done", "item_id": id, "output_index": index, "name": call.name, "arguments": arguments}),
            )
            && send(json!({"type": "response.output_item.done", "output_index": index, "item": item}))
    }

    /// The finished response: `base` with these items, its status and usage.
    fn finish(mut self, base: &Value, outcome: &Outcome, state: &AppState, send: Send) -> Option<Value> {
        let cut = matches!(outcome.finish, Finish::Length | Finish::Shutdown);
        if !self.close(if cut { "incomplete" } else { "completed" }, send) {
            return None;
        }
        // The engine counts tokens, not which were reasoning: re-encoding the reasoning text
        // counts them (the think tags aside).
        let reasoning: String =
            self.items.iter().filter(|i| i["type"] == "reasoning").filter_map(|i| i["content"][0]["text"].as_str()).collect();
        let reasoning_tokens = state.tokenizer.encode(&reasoning).map_or(0, |t| t.len());
        let mut response = base.clone();
        response["status"] = if cut { "incomplete" } else { "completed" }.into();
        if cut {
            response["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        response["output"] = Value::Array(self.items);
        response["usage"] = usage(outcome, reasoning_tokens);
        Some(response)
    }
}

pub async fn create(State(state): State<AppState>, body: Bytes) -> Response {
    match create_response(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn create_response(state: AppState, body: Bytes) -> ApiResult<Response> {
    let req: ResponsesRequest = parse_body(&body)?;
    let sampling: SamplingFields = parse_body(&body)?;
    check_metadata(req.metadata.as_ref().unwrap_or(&Map::new()))?;
    let format = req.text.as_ref().and_then(|t| t.pointer("/format/type"));
    if format.is_some_and(|f| f != "text") {
        return Err(bad(format!("text.format {} is not supported: only text", format.unwrap_or(&Value::Null)), "text.format"));
    }
    // The conversation: the stored one this continues (its instructions not carried over),
    // then this request's input.
    let mut items = match &req.previous_response_id {
        Some(id) => {
            let record = state.responses.get(id).ok_or_else(|| not_found(id, Some("previous_response_id")))?;
            let mut items = record["input"].as_array().cloned().unwrap_or_default();
            items.extend(record["response"]["output"].as_array().cloned().unwrap_or_default());
            items
        }
        None => Vec::new(),
    };
    let first_new = items.len();
    match req.input {
        Some(InputField::Text(text)) => items.push(json!({"type": "message", "role": "user", "content": text})),
        Some(InputField::Items(input)) => items.extend(input),
        None => {}
    }
    if items.len() == first_new {
        return Err(bad("input must not be empty", "input"));
    }
    let messages = chat_messages(req.instructions.as_deref(), &items, first_new)?;
    let tools = req.tools.as_deref().map(chat_tools).transpose()?;
    let effort = req.reasoning.as_ref().and_then(|r| r.effort.clone());
    let mut kwargs = Map::new();
    if let Some(effort) = &effort {
        kwargs.insert("enable_thinking".into(), Value::Bool(thinking_for(effort)?));
    }
    if req.max_output_tokens.is_some_and(|n| n < 1) {
        return Err(bad("max_output_tokens must be at least 1", "max_output_tokens"));
    }
    let format = req.text.as_ref().and_then(|t| t.get("format")).cloned();
    let chat = ChatRequest::translated(messages, req.max_output_tokens, tools, req.tool_choice.clone(), kwargs, format.clone());
    let ChatJob { prompt, opts, output } = prepare_chat(&state, chat, &sampling).await.map_err(in_responses_terms)?;

    let id = new_id("resp_");
    let store = req.store.unwrap_or(true);
    let base = json!({
        "id": id, "object": "response", "created_at": now(), "status": "in_progress", "error": null,
        "incomplete_details": null, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata.unwrap_or_default(), "model": req.model.unwrap_or_else(|| state.config.model_name.clone()),
        "output": [], "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
        "previous_response_id": req.previous_response_id, "reasoning": {"effort": effort, "summary": null},
        "store": store, "temperature": opts.sampling.temperature, "top_p": opts.sampling.top_p,
        "text": {"format": format.unwrap_or_else(|| json!({"type": "text"}))}, "tool_choice": req.tool_choice.unwrap_or_else(|| "auto".into()),
        "tools": req.tools.unwrap_or_default(), "truncation": "disabled", "usage": null, "user": null,
    });
    // Kept with the conversation that led to it, for GET and previous_response_id.
    let keep = move |state: &AppState, response: &Value| {
        if store {
            state.responses.put(&id, &json!({"response": response, "input": items}));
        }
    };

    if !req.stream {
        let mut out = OutputItems::default();
        let outcome = drive(&state, prompt, opts, output, std::future::pending(), |p| out.push(p, &mut |_| true))
            .await?
            .expect("the collector never stops early")
            .whole()?;
        crate::log_request(base["id"].as_str().unwrap_or_default(), &outcome);
        let response = out.finish(&base, &outcome, &state, &mut |_| true).expect("the collector never stops early");
        keep(&state, &response);
        return Ok(Json(response).into_response());
    }

    let (tx, rx) = mpsc::unbounded_channel::<Value>();
    let mut sequence = 0;
    let sender = tx.clone();
    let mut send = move |mut event: Value| {
        event["sequence_number"] = sequence.into();
        sequence += 1;
        sender.send(event).is_ok()
    };
    send(json!({"type": "response.created", "response": base}));
    send(json!({"type": "response.in_progress", "response": base}));
    tokio::spawn(async move {
        let mut out = OutputItems::default();
        let sent = drive(&state, prompt, opts, output, client_gone(&tx), |p| out.push(p, &mut send)).await;
        let id = base["id"].as_str().unwrap_or_default();
        match sent {
            Ok(Some(outcome)) => {
                crate::log_request(id, &outcome);
                let Some(response) = out.finish(&base, &outcome, &state, &mut send) else { return };
                keep(&state, &response);
                let kind = if response["status"] == "completed" { "response.completed" } else { "response.incomplete" };
                send(json!({"type": kind, "response": response}));
            }
            Ok(None) => tracing::info!(id, "client disconnected; generation cancelled"),
            Err(e) => {
                let mut failed = base.clone();
                failed["status"] = "failed".into();
                failed["error"] = json!({"code": "server_error", "message": e.message});
                failed["output"] = Value::Array(out.items);
                send(json!({"type": "response.failed", "response": failed}));
            }
        }
    });
    let events = UnboundedReceiverStream::new(rx).map(|event| {
        let name = event["type"].as_str().unwrap_or_default().to_string();
        Ok::<_, Infallible>(SseEvent::default().event(name).data(event.to_string()))
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
}

pub async fn retrieve(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    match state.responses.get(&id) {
        Some(record) => Json(record["response"].clone()).into_response(),
        None => not_found(&id, None).into_response(),
    }
}

pub async fn delete(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    if state.responses.delete(&id) {
        Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        not_found(&id, None).into_response()
    }
}
