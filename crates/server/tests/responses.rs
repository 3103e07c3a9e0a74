//! The OpenAI Responses API end to end (in process, through the router) on a fixture model.

mod common;

use std::sync::Arc;

use axum::http::StatusCode;
use axum::Router;
use common::{call, fixture, post, sse, state};
use serde_json::{json, Value};
use strata_model::ModelFolder;
use strata_server::{router, AppState, ResponseStore};

fn app() -> Router {
    router(state("qwen3_5-tiny-a", 4096, None))
}

/// A request body: greedy, thinking off, 12 tokens, with `extra` fields.
fn ask(input: Value, extra: Value) -> Value {
    let mut body =
        json!({"model": "tiny", "input": input, "max_output_tokens": 12, "temperature": 0, "reasoning": {"effort": "none"}});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// What an answer said, ids aside: each output item's type and text (or call).
fn said(response: &Value) -> Vec<(String, String)> {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| {
            let text = match item["type"].as_str().unwrap() {
                "function_call" => format!("{}({})", item["name"], item["arguments"]),
                _ => item["content"][0]["text"].as_str().unwrap().to_string(),
            };
            (item["type"].as_str().unwrap().to_string(), text)
        })
        .collect()
}

fn cached(response: &Value) -> u64 {
    response["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

/// The events of a streamed answer, checked for the grammar the SDK relies on: one
/// response.created then response.in_progress first, consecutive sequence numbers, every item
/// added before its deltas and done after them.
async fn stream(app: &Router, body: Value) -> Vec<Value> {
    let mut body = body;
    body["stream"] = json!(true);
    let (status, raw) = call(app, "POST", "/v1/responses", body, &[]).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&raw));
    let events: Vec<Value> = sse(&raw)
        .into_iter()
        .map(|(name, data)| {
            let event: Value = serde_json::from_str(&data).unwrap();
            assert_eq!(event["type"], name.as_str(), "the SSE event name is the payload's type");
            event
        })
        .collect();
    let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types[..2], ["response.created", "response.in_progress"]);
    for (n, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], n, "{e}");
    }
    let mut open = Vec::new();
    for e in &events[2..events.len() - 1] {
        let index = e["output_index"].as_u64().unwrap() as usize;
        match e["type"].as_str().unwrap() {
            "response.output_item.added" => {
                assert_eq!(index, open.len());
                open.push(true);
            }
            "response.output_item.done" => {
                assert!(open[index]);
                open[index] = false;
            }
            _ => assert!(open[index], "{e} after its item was done"),
        }
    }
    assert!(open.iter().all(|o| !o), "every item is done");
    events
}

#[tokio::test(flavor = "multi_thread")]
async fn streamed_and_whole_answers_agree_and_follow_the_event_grammar() {
    let app = app();
    for effort in ["none", "medium"] {
        let body = ask(json!("Hello! How are you today?"), json!({"reasoning": {"effort": effort}}));
        let (s, whole) = post(&app, "/v1/responses", body.clone()).await;
        assert_eq!(s, StatusCode::OK, "{whole}");
        assert_eq!(whole["object"], "response");
        assert_eq!(whole["status"], "incomplete", "12 tokens of the tiny model do not end: {whole}");
        assert_eq!(whole["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(whole["usage"]["output_tokens"], 12);
        assert_eq!(whole["model"], "tiny");
        let kinds: Vec<String> = said(&whole).into_iter().map(|(kind, _)| kind).collect();
        // Thinking on: the template opens a think block the tiny model never closes.
        assert_eq!(kinds, [if effort == "none" { "message" } else { "reasoning" }], "{whole}");
        let reasoning_tokens = whole["usage"]["output_tokens_details"]["reasoning_tokens"].as_u64().unwrap();
        assert_eq!(reasoning_tokens > 0, effort != "none");

        let events = stream(&app, body).await;
        let last = events.last().unwrap();
        assert_eq!(last["type"], "response.incomplete");
        assert_eq!(said(&last["response"]), said(&whole));
        assert_eq!(last["response"]["usage"]["output_tokens"], 12);
        let delta = if effort == "none" { "response.output_text.delta" } else { "response.reasoning_text.delta" };
        let joined: String = events.iter().filter(|e| e["type"] == delta).map(|e| e["delta"].as_str().unwrap()).collect();
        assert_eq!(joined, said(&whole)[0].1);
        let done = events.iter().find(|e| e["type"] == "response.output_item.done").unwrap();
        assert_eq!(done["item"]["status"], "incomplete", "cut by the token limit");
    }
}

/// The conversation's prompt up to its generation prompt, in tokens: what the next turn's
/// prompt starts with.
fn history_tokens(messages: &[Value]) -> usize {
    let folder = ModelFolder::open(&fixture("qwen3_5-tiny-a")).unwrap();
    let template = folder.chat_template.unwrap();
    let text = template.render(json!({"messages": messages, "add_generation_prompt": false, "enable_thinking": false})).unwrap();
    folder.tokenizer.encode(&text).unwrap().len()
}

/// Items of a conversation (messages and answers without reasoning) as chat messages.
fn chat_messages(items: &[Value]) -> Vec<Value> {
    items
        .iter()
        .map(|item| match item["role"].as_str().unwrap() {
            "assistant" => json!({"role": "assistant", "content": item["content"][0]["text"]}),
            role => json!({"role": role, "content": item["content"]}),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn previous_response_id_continues_as_if_the_conversation_were_sent_again() {
    let app = app();
    let turns = ["Hello! How are you today?", "Tell me about Paris.", "And London?"];
    // Instructions are not carried over: each turn gives them, as the Agents SDK does.
    let brief = json!({"instructions": "Answer briefly."});
    let (_, mut previous) = post(&app, "/v1/responses", ask(json!(turns[0]), brief.clone())).await;
    let mut conversation = vec![json!({"type": "message", "role": "user", "content": turns[0]})];
    for turn in &turns[1..] {
        let mut messages = vec![json!({"role": "system", "content": "Answer briefly."})];
        messages.extend(chat_messages(&conversation));
        let history = history_tokens(&messages) as u64;
        assert!(previous["usage"]["input_tokens"].as_u64().unwrap() > history);
        let id = previous["id"].as_str().unwrap();
        let continuing = |extra: Value| {
            let mut body = ask(json!(turn), json!({"previous_response_id": id}));
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            body
        };
        let (s, next) = post(&app, "/v1/responses", continuing(brief.clone())).await;
        assert_eq!(s, StatusCode::OK, "{next}");
        assert_eq!(next["previous_response_id"], id);
        assert!(cached(&next) >= history, "{} cached of a {history}-token history", cached(&next));
        // The same conversation sent whole, not stored.
        conversation.extend(previous["output"].as_array().unwrap().iter().cloned());
        conversation.push(json!({"type": "message", "role": "user", "content": turn}));
        let whole = |extra: Value| {
            let mut body = ask(json!(conversation), json!({"store": false}));
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            body
        };
        let (_, sent_whole) = post(&app, "/v1/responses", whole(brief.clone())).await;
        assert_eq!(said(&sent_whole), said(&next));
        assert_eq!(sent_whole["usage"]["input_tokens"], next["usage"]["input_tokens"]);
        let (s, _) = call(&app, "GET", &format!("/v1/responses/{}", sent_whole["id"].as_str().unwrap()), Value::Null, &[]).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "store: false keeps nothing");
        // Without instructions, the continuation has none, whatever the stored turns had.
        let (_, bare) = post(&app, "/v1/responses", continuing(json!({"store": false}))).await;
        let (_, bare_whole) = post(&app, "/v1/responses", whole(json!({}))).await;
        assert_eq!(bare["usage"]["input_tokens"], bare_whole["usage"]["input_tokens"]);
        assert!(bare["usage"]["input_tokens"].as_u64() < next["usage"]["input_tokens"].as_u64());
        previous = next;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn stored_responses_are_retrieved_deleted_and_unknown_ids_are_404s() {
    let app = app();
    let (_, created) = post(&app, "/v1/responses", ask(json!("Hi"), json!({"metadata": {"run": "7"}}))).await;
    let path = format!("/v1/responses/{}", created["id"].as_str().unwrap());
    let (s, got) = call(&app, "GET", &path, Value::Null, &[]).await;
    assert_eq!(s, StatusCode::OK);
    let got: Value = serde_json::from_slice(&got).unwrap();
    assert_eq!(got, created);
    assert_eq!(got["metadata"]["run"], "7");
    let (s, deleted) = call(&app, "DELETE", &path, Value::Null, &[]).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(serde_json::from_slice::<Value>(&deleted).unwrap()["deleted"], true);
    for (method, path) in [("GET", path.as_str()), ("DELETE", path.as_str()), ("GET", "/v1/responses/resp_../../etc")] {
        let (s, body) = call(&app, method, path, Value::Null, &[]).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{method} {path}");
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    }
    let (s, body) = post(&app, "/v1/responses", ask(json!("Hi"), json!({"previous_response_id": created["id"]}))).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["param"], "previous_response_id");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_function_call_round_trip_renders_as_chat_does() {
    let app = app();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_5-tiny-a").join("reference.json")).unwrap()).unwrap();
    let weather = json!({"type": "function", "name": "get_weather", "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}});
    // The fixture tokenizer has one token spelling a whole tool call: biased to it, the model calls.
    let force =
        json!({"tools": [weather], "logit_bias": {reference["tool_call_token"].to_string(): 100}, "max_output_tokens": 1});
    let (s, called) = post(&app, "/v1/responses", ask(json!("What is the weather?"), force.clone())).await;
    assert_eq!(s, StatusCode::OK, "{called}");
    assert_eq!(called["status"], "completed");
    let call_item = &called["output"][0];
    assert_eq!(call_item["type"], "function_call");
    assert_eq!(call_item["name"], "get_weather");
    let arguments: Value = serde_json::from_str(call_item["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris", "days": 2}));
    let events = stream(&app, ask(json!("What is the weather?"), force)).await;
    let args: String = events
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&args).unwrap(), arguments);
    assert_eq!(events.last().unwrap()["type"], "response.completed");

    // The result sent back renders exactly as the same turn through chat completions.
    let output = json!({"type": "function_call_output", "call_id": call_item["call_id"], "output": "sunny"});
    let follow =
        ask(json!([{"role": "user", "content": "What is the weather?"}, call_item, output]), json!({"tools": [weather]}));
    let (s, answered) = post(&app, "/v1/responses", follow).await;
    assert_eq!(s, StatusCode::OK, "{answered}");
    let chat = json!({"messages": [
            {"role": "user", "content": "What is the weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": call_item["call_id"], "type": "function",
                "function": {"name": "get_weather", "arguments": call_item["arguments"]}}]},
            {"role": "tool", "tool_call_id": call_item["call_id"], "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": weather["parameters"]}}],
        "max_tokens": 12, "temperature": 0, "reasoning_effort": "none"});
    let (_, chat) = post(&app, "/v1/chat/completions", chat).await;
    assert_eq!(answered["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    assert_eq!(said(&answered)[0].1, chat["choices"][0]["message"]["content"].as_str().unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_is_a_4xx_naming_the_field() {
    let app = router(state("qwen3_5-tiny-a", 64, None));
    let hi = json!("Hi");
    let cases = [
        (json!({"input": [{"type": "web_search_call", "id": "x"}]}), "input[0].type"),
        (json!({"input": [{"type": "message", "role": "wizard", "content": "x"}]}), "input[0].role"),
        (json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}), "input[0].content[0]"),
        (json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}), "input[0].call_id"),
        (json!({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}), "input[0].output"),
        (json!({"input": 5}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": "x ".repeat(100)}), "input"),
        (json!({"input": hi, "max_output_tokens": 0}), "max_output_tokens"),
        (json!({"input": hi, "max_output_tokens": 60}), "max_output_tokens"),
        (json!({"input": hi, "temperature": "hot"}), "temperature"),
        (json!({"input": hi, "tools": [{"type": "web_search"}]}), "tools[0].type"),
        (json!({"input": hi, "tools": [{"type": "function", "name": "f", "parameters": "nope"}]}), "tools[0].parameters"),
        (json!({"input": hi, "tool_choice": "required"}), "tool_choice"),
        (json!({"input": hi, "reasoning": {"effort": "max"}}), "reasoning.effort"),
        (json!({"input": hi, "text": {"format": {"type": "json_schema"}}}), "text.format"),
        (json!({"input": hi, "metadata": {"k": 5}}), "metadata.k"),
        (json!({"input": hi, "previous_response_id": 7}), "previous_response_id"),
    ];
    for (body, param) in cases {
        let (s, e) = post(&app, "/v1/responses", body.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error", "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
        assert!(!e["error"]["message"].as_str().unwrap().is_empty());
    }
    let keyed = router(state("qwen3_5-tiny-a", 64, Some("sekrit")));
    let (s, e) = post(&keyed, "/v1/responses", json!({"input": "Hi"})).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(e["error"]["type"], "invalid_api_key");
    let (s, _) = call(&keyed, "GET", "/v1/responses/resp_0", Value::Null, &[]).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

fn state_storing_in(dir: &std::path::Path) -> AppState {
    let mut state = state("qwen3_5-tiny-a", 4096, None);
    Arc::get_mut(&mut state).expect("a fresh state").responses = ResponseStore::open(dir, 100, 1 << 20).unwrap();
    state
}

#[tokio::test(flavor = "multi_thread")]
async fn responses_stored_in_a_folder_outlive_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let app = router(state_storing_in(dir.path()));
    let (_, created) = post(&app, "/v1/responses", ask(json!("Hello! How are you today?"), json!({}))).await;
    let (_, continued) =
        post(&app, "/v1/responses", ask(json!("Tell me more."), json!({"previous_response_id": created["id"]}))).await;
    drop(app);

    let app = router(state_storing_in(dir.path()));
    let (s, got) = call(&app, "GET", &format!("/v1/responses/{}", created["id"].as_str().unwrap()), Value::Null, &[]).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(serde_json::from_slice::<Value>(&got).unwrap(), created);
    let (s, again) =
        post(&app, "/v1/responses", ask(json!("Tell me more."), json!({"previous_response_id": created["id"]}))).await;
    assert_eq!(s, StatusCode::OK, "{again}");
    assert_eq!(said(&again), said(&continued));
}
