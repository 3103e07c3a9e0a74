//! Property test of the request parsers of `/v1/chat/completions`, `/v1/completions`,
//! `/v1/messages` and `/v1/responses`: valid bodies truncated at every byte, and mutated (fields deleted at any
//! depth, values swapped for other types, huge numbers, deep nesting, flipped bytes, bad
//! UTF-8). Every answer must be a 200 — a whole answer, or a stream that ends properly — or a
//! 4xx in the endpoint's dialect; never a 5xx, a panic or a hang. A seeded PRNG makes every
//! case reproducible: a failure names its seed and case.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tower::ServiceExt;

const SEED: u64 = 25;
/// Random mutations of each valid body (truncations come on top, one per byte).
const MUTATIONS_PER_BODY: usize = 250;
/// Longer than any answer here takes: the context is small, so is every generation.
const PER_REQUEST: Duration = Duration::from_secs(20);

fn valid_bodies() -> Vec<(&'static str, Value)> {
    let user = json!({"role": "user", "content": "Hello! How are you today?"});
    let weather = json!({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": ["integer", "null"]}}, "required": ["city"]}}});
    let call = json!({"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}});
    vec![
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [user], "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                   "seed": 1, "stop": ["x", "y"], "logprobs": true, "top_logprobs": 2, "presence_penalty": 0.5,
                   "logit_bias": {"5": 1.5}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, user,
                                {"role": "assistant", "content": null, "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
                   "tools": [weather], "tool_choice": "auto", "max_completion_tokens": 3, "stream": true,
                   "stream_options": {"include_usage": true}, "chat_template_kwargs": {"enable_thinking": false}}),
        ),
        ("/v1/completions", json!({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "echo": true, "stop": "x", "n": 1})),
        ("/v1/completions", json!({"prompt": ["text"], "max_tokens": 3, "logprobs": 2, "stream": true, "seed": 7})),
        (
            "/v1/messages",
            json!({"model": "m", "max_tokens": 3, "temperature": 0, "system": "s", "messages": [user], "stop_sequences": ["x"]}),
        ),
        (
            "/v1/messages",
            json!({"max_tokens": 3, "stream": true, "system": [{"type": "text", "text": "Be brief."}],
                   "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                   "thinking": {"type": "disabled"},
                   "messages": [user,
                                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
                                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]}),
        ),
        (
            "/v1/responses",
            json!({"model": "m", "input": "Hello!", "instructions": "Be brief.", "max_output_tokens": 3, "temperature": 0,
                   "top_p": 0.9, "reasoning": {"effort": "low"}, "metadata": {"k": "v"}, "store": false}),
        ),
        (
            "/v1/responses",
            json!({"input": [user, {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
                             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                             {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}],
                   "tools": [{"type": "function", "name": "get_weather", "parameters": weather["function"]["parameters"]}],
                   "tool_choice": "auto", "max_output_tokens": 3, "stream": true, "reasoning": {"effort": "none"}}),
        ),
    ]
}

/// JSON pointers to every node of `v` but the root.
fn pointers(v: &Value, at: &str, out: &mut Vec<String>) {
    let children: Vec<(String, &Value)> = match v {
        Value::Object(o) => o.iter().map(|(k, c)| (format!("{at}/{k}"), c)).collect(),
        Value::Array(a) => a.iter().enumerate().map(|(i, c)| (format!("{at}/{i}"), c)).collect(),
        _ => return,
    };
    for (pointer, child) in children {
        out.push(pointer.clone());
        pointers(child, &pointer, out);
    }
}

fn nested(depth: usize, rng: &mut StdRng) -> Value {
    (0..depth).fold(json!("leaf"), |inner, _| if rng.random() { json!([inner]) } else { json!({"a": inner}) })
}

/// A value of another type, or an edge of its own.
fn swapped(rng: &mut StdRng) -> Value {
    match rng.random_range(0..16) {
        0 => Value::Null,
        1 => json!(-1),
        2 => json!(0),
        3 => json!(1e308),
        4 => json!(u64::MAX),
        5 => json!(i64::MIN),
        6 => json!(0.5),
        7 => json!(""),
        8 => json!("text"),
        9 => json!("\u{0}<|im_start|>\u{202e}"),
        10 => json!([]),
        11 => json!([1, "a", null, {}]),
        12 => json!({}),
        13 => json!({"role": "user", "type": "text"}),
        14 => json!(true),
        _ => nested(rng.random_range(1..40), rng),
    }
}

/// One to three mutations of `body`, structural or of its bytes.
fn mutate(body: &Value, rng: &mut StdRng) -> Vec<u8> {
    let mut value = body.clone();
    let mut raw = None;
    for _ in 0..rng.random_range(1..=3) {
        let mut all = Vec::new();
        pointers(&value, "", &mut all);
        let pointer = all[rng.random_range(0..all.len())].clone();
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        match rng.random_range(0..8) {
            0 | 1 => match value.pointer_mut(parent).unwrap() {
                Value::Object(o) => drop(o.remove(key)),
                Value::Array(a) => drop(a.remove(key.parse::<usize>().unwrap())),
                _ => unreachable!("a pointer's parent holds it"),
            },
            2..=4 => *value.pointer_mut(&pointer).unwrap() = swapped(rng),
            5 => *value.pointer_mut(&pointer).unwrap() = nested(rng.random_range(100..300), rng),
            _ => {
                let mut bytes = raw.take().unwrap_or_else(|| value.to_string().into_bytes());
                let at = rng.random_range(0..bytes.len());
                match rng.random_range(0..4) {
                    0 => bytes[at] ^= 1 << rng.random_range(0..8),
                    1 => {
                        // Bad UTF-8: a stray continuation byte, a lone lead byte, an encoded surrogate.
                        let bad: [&[u8]; 3] = [&[0x80], &[0xc3], &[0xed, 0xa0, 0x80]];
                        bytes.splice(at..at, bad[rng.random_range(0..3)].iter().copied());
                    }
                    2 => {
                        // A number made huge: 400 more digits after one of its digits.
                        let digit = (at..bytes.len()).chain(0..at).find(|&i| bytes[i].is_ascii_digit()).unwrap_or(at);
                        bytes.splice(digit..digit, std::iter::repeat_n(b'0', 400));
                    }
                    _ => bytes = [b"[".repeat(10_000), bytes].concat(),
                }
                raw = Some(bytes);
            }
        }
    }
    raw.unwrap_or_else(|| value.to_string().into_bytes())
}

/// Sends `body` and checks what comes back; returns the status.
async fn check(app: &Router, path: &str, body: Vec<u8>, case: &str) -> StatusCode {
    let req =
        Request::builder().method("POST").uri(path).header("content-type", "application/json").body(Body::from(body)).unwrap();
    let answer = async {
        let resp = app.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let is_stream = resp.headers().get("content-type").is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        (status, is_stream, axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap())
    };
    let (status, is_stream, bytes) =
        tokio::time::timeout(PER_REQUEST, answer).await.unwrap_or_else(|_| panic!("{case}: no answer"));
    let text = String::from_utf8_lossy(&bytes);
    let anthropic = path == "/v1/messages";
    assert!(status == StatusCode::OK || status.is_client_error(), "{case} -> {status}: {text}");
    if status.is_client_error() {
        let error: Value =
            serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{case} -> {status}, not JSON ({e}): {text}"));
        assert!(error["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{case} -> {error}");
        assert_eq!(error["type"] == "error", anthropic, "{case}: wrong dialect {error}");
    } else if is_stream {
        let last_event = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
        let ends: &[&str] = match path {
            "/v1/messages" => &["event: message_stop"],
            "/v1/responses" => &["event: response.completed", "event: response.incomplete"],
            _ => &["data: [DONE]"],
        };
        let ended = ends.iter().any(|end| last_event.starts_with(end));
        assert!(ended && !text.contains("event: error"), "{case}: stream ended badly: {text}");
    } else {
        let answer: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{case}: not JSON ({e}): {text}"));
        assert!(answer["usage"].is_object(), "{case}: {answer}");
    }
    status
}

#[tokio::test(flavor = "multi_thread")]
async fn mutated_and_truncated_bodies_get_a_200_or_a_4xx_in_their_dialect() {
    // A small context bounds every generation a mutation may ask for.
    let app = strata_server::router(common::state("qwen3_5-tiny-a", 1024, None));
    let mut rng = StdRng::seed_from_u64(SEED);
    let mut answered_200 = 0;
    for (b, (path, body)) in valid_bodies().into_iter().enumerate() {
        let raw = body.to_string().into_bytes();
        assert_eq!(check(&app, path, raw.clone(), &format!("valid body {b}")).await, StatusCode::OK, "valid body {b}: {body}");
        for cut in 0..raw.len() {
            let case = format!("body {b} cut at {cut}: {}", String::from_utf8_lossy(&raw[..cut]));
            check(&app, path, raw[..cut].to_vec(), &case).await;
        }
        for m in 0..MUTATIONS_PER_BODY {
            let mutated = mutate(&body, &mut rng);
            let shown: String = String::from_utf8_lossy(&mutated).chars().take(2000).collect();
            let case = format!("seed {SEED}, body {b}, mutation {m}: {shown}");
            if check(&app, path, mutated, &case).await == StatusCode::OK {
                answered_200 += 1;
            }
        }
    }
    // Mutations must not all be refused, or the parsers past the first would go untested.
    assert!(answered_200 > 100, "only {answered_200} mutated bodies were answered");
}
