//! Structured output through the APIs on a random-weight fixture (whose free output is noise):
//! `response_format`, `structured_outputs`, forced tool calls in both dialects, and the 400s
//! for what cannot be used. Outputs are checked by serde_json, the regex crate and the tools'
//! own schemas, not by the grammar that produced them.

mod common;

use axum::http::StatusCode;
use axum::Router;
use common::{post, sse, state};
use serde_json::{json, Value};
use strata_server::router;

fn app() -> Router {
    router(state("qwen3_5-tiny-a", 4096, None))
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 200, "temperature": 1.0, "seed": 3,
        "chat_template_kwargs": {"enable_thinking": false},
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "days"],
        }}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        }}},
    ])
}

/// Checks a call's arguments against the two tools' schemas by hand.
fn check_call(name: &str, arguments: &Value) {
    let args = arguments.as_object().unwrap_or_else(|| panic!("{name}: arguments {arguments}"));
    match name {
        "get_weather" => {
            assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{arguments}");
            assert!(args["days"].as_i64().is_some_and(|d| (1..=9).contains(&d)), "{arguments}");
            assert!(args.get("unit").is_none_or(|u| u == "c" || u == "f"), "{arguments}");
            assert!(args.keys().all(|k| ["city", "days", "unit"].contains(&k.as_str())), "{arguments}");
        }
        "get_time" => assert!(args.len() == 1 && (args["zone"] == "utc" || args["zone"] == "cet"), "{arguments}"),
        other => panic!("called {other}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn response_format_and_structured_outputs_hold_the_content() {
    let app = app();
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "n"], "additionalProperties": false});
    for seed in 0..4 {
        let rf = json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": true}});
        let (s, r) = post(&app, "/v1/chat/completions", chat(json!({"response_format": rf, "seed": seed}))).await;
        assert_eq!(s, StatusCode::OK, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        let content: Value = serde_json::from_str(r["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
        assert!(content["ok"].is_boolean() && content["n"].as_i64().is_some_and(|n| (0..=99).contains(&n)), "{content}");
        assert_eq!(content.as_object().unwrap().len(), 2, "{content}");

        let regex = r"[A-Z][a-z]{1,5} [0-9]{2}";
        let (s, r) =
            post(&app, "/v1/chat/completions", chat(json!({"structured_outputs": {"regex": regex}, "seed": seed}))).await;
        assert_eq!(s, StatusCode::OK, "{r}");
        let content = r["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(regex::Regex::new(&format!("^{regex}$")).unwrap().is_match(content), "{content:?}");

        let body = json!({"prompt": "Pick one:", "max_tokens": 20, "temperature": 1.0, "seed": seed,
            "structured_outputs": {"choice": ["red", "green", "blue"]}});
        let (s, r) = post(&app, "/v1/completions", body).await;
        assert_eq!(s, StatusCode::OK, "{r}");
        assert!(["red", "green", "blue"].contains(&r["choices"][0]["text"].as_str().unwrap()), "{r}");
    }
    let (s, raw) = common::call(&app, "GET", "/stats", Value::Null, &[]).await;
    assert_eq!(s, StatusCode::OK);
    let stats: Value = serde_json::from_slice(&raw).unwrap();
    assert!(stats["structured_output"]["masks"].as_u64().unwrap() > 0, "{stats}");
}

#[tokio::test(flavor = "multi_thread")]
async fn forced_tool_calls_parse_into_schema_valid_calls() {
    let app = app();
    for seed in 0..4 {
        for choice in [json!("required"), json!({"type": "function", "function": {"name": "get_time"}})] {
            let body = chat(json!({"tools": weather_tools(), "tool_choice": choice, "seed": seed, "parallel_tool_calls": false}));
            let (s, r) = post(&app, "/v1/chat/completions", body).await;
            assert_eq!(s, StatusCode::OK, "{r}");
            assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{choice}: {r}");
            let calls = r["choices"][0]["message"]["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 1, "{r}");
            let name = calls[0]["function"]["name"].as_str().unwrap();
            if choice != "required" {
                assert_eq!(name, "get_time");
            }
            check_call(name, &serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap());
        }
        // Streamed: the same call arrives in the deltas.
        let body = chat(json!({"tools": weather_tools(), "tool_choice": "required", "seed": seed, "stream": true}));
        let (_, raw) = common::call(&app, "POST", "/v1/chat/completions", body, &[]).await;
        let events = sse(&raw);
        let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
        let calls: Vec<&Value> =
            chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
        assert!(!calls.is_empty(), "{chunks:?}");
        for call in calls {
            check_call(
                call["function"]["name"].as_str().unwrap(),
                &serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap(),
            );
        }
    }
    // Anthropic: `any` and a named tool.
    let tools: Vec<Value> = weather_tools()
        .as_array()
        .unwrap()
        .iter()
        .map(|t| json!({"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}))
        .collect();
    for (seed, choice) in
        [(1, json!({"type": "any"})), (2, json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true}))]
    {
        let body = json!({"max_tokens": 200, "temperature": 1.0, "seed": seed, "tools": tools, "tool_choice": choice,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]});
        let (s, r) = post(&app, "/v1/messages", body).await;
        assert_eq!(s, StatusCode::OK, "{r}");
        assert_eq!(r["stop_reason"], "tool_use", "{r}");
        let uses: Vec<&Value> = r["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").collect();
        assert!(!uses.is_empty(), "{r}");
        for block in uses {
            let name = block["name"].as_str().unwrap();
            if choice["type"] == "tool" {
                assert_eq!(name, "get_weather");
            }
            check_call(name, &block["input"]);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn unusable_structures_are_400s_naming_the_field() {
    let app = app();
    let cases = [
        (json!({"structured_outputs": {"regex": "[a-"}}), "structured_outputs"),
        (json!({"structured_outputs": {"grammar": "start: nowhere"}}), "structured_outputs"),
        (json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
        (json!({"structured_outputs": {"choice": [1, 2]}}), "structured_outputs.choice"),
        (json!({"structured_outputs": {"json": "{not json"}}), "structured_outputs.json"),
        (json!({"structured_outputs": {"ebnf": "x"}}), "structured_outputs.ebnf"),
        (json!({"response_format": {"type": "yaml"}}), "response_format.type"),
        (json!({"response_format": {"type": "json_schema"}}), "response_format.json_schema"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}),
            "response_format",
        ),
        (json!({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}), "structured_outputs"),
        (json!({"tools": weather_tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice"),
        (json!({"tools": weather_tools(), "tool_choice": "sometimes"}), "tool_choice"),
        (json!({"tools": weather_tools(), "tool_choice": "required", "response_format": {"type": "json_object"}}), "tool_choice"),
    ];
    for (extra, param) in cases {
        let (s, r) = post(&app, "/v1/chat/completions", chat(extra.clone())).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{extra} -> {r}");
        assert_eq!(r["error"]["param"], param, "{extra} -> {r}");
    }
    let body = json!({"max_tokens": 20, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool", "name": "x"},
        "tools": [{"name": "y", "input_schema": {"type": "object"}}]});
    let (s, r) = post(&app, "/v1/messages", body).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{r}");
}
