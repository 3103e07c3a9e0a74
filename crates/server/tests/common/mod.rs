//! What the server's tests share: a fixture model's state, served in process.

#![allow(dead_code)] // each test file uses its own part

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use candle_core::{DType, Device};
use serde_json::Value;
use strata_engine::{CacheConfig, EngineConfig, Worker};
use strata_model::ModelFolder;
use strata_server::{AppState, Cutoff, HttpLimits, ResponseStore, ServerConfig, Shared};
use tower::ServiceExt;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

pub fn state(name: &str, max_context: usize, api_key: Option<&str>) -> AppState {
    state_configured(name, max_context, api_key, EngineConfig::for_device(&Device::Cpu), None)
}

/// The fixture's state with these connection limits.
pub fn state_limited(max_context: usize, http: HttpLimits) -> AppState {
    let mut state = state("qwen3_5-tiny-a", max_context, None);
    Arc::get_mut(&mut state).expect("a fresh state").config.http = http;
    state
}

pub fn state_with(name: &str, max_context: usize, engine: EngineConfig) -> AppState {
    state_configured(name, max_context, None, engine, None)
}

/// With `template`, that chat template in place of the folder's.
pub fn state_configured(
    name: &str,
    max_context: usize,
    api_key: Option<&str>,
    engine: EngineConfig,
    template: Option<&str>,
) -> AppState {
    build(name, max_context, api_key, engine, template, CacheConfig::for_device(&Device::Cpu))
}

/// Without a prompt cache: every request computes its whole prompt.
pub fn state_uncached(name: &str, max_context: usize, engine: EngineConfig) -> AppState {
    build(name, max_context, None, engine, None, CacheConfig::off())
}

fn build(
    name: &str,
    max_context: usize,
    api_key: Option<&str>,
    engine: EngineConfig,
    template: Option<&str>,
    cache: CacheConfig,
) -> AppState {
    let mut folder = ModelFolder::open(&fixture(name)).unwrap();
    if let Some(source) = template {
        folder.chat_template = Some(strata_model::ChatTemplate::new(source).unwrap());
    }
    let model = folder.load(DType::F32, &Device::Cpu).unwrap();
    let eos_token_ids = folder.eos_token_ids();
    Arc::new(Shared {
        config: ServerConfig {
            model_name: name.into(),
            dtype: "f32".into(),
            device: "cpu".into(),
            max_context,
            api_key: api_key.map(str::to_string),
            special_tokens_in_content: false,
            http: HttpLimits::default(),
            images: Default::default(),
        },
        worker: Worker::spawn(model, engine, cache, None).unwrap(),
        vocab_size: folder.config.vocab_size,
        tokenizer: folder.tokenizer,
        template: folder.chat_template,
        image_processor: folder.image_processor,
        generation: folder.generation,
        eos_token_ids,
        started: Instant::now(),
        http_requests: AtomicU64::new(0),
        http_errors: AtomicU64::new(0),
        cutoff: Cutoff::default(),
        responses: ResponseStore::default(),
        grammars: Default::default(),
    })
}

pub async fn call(app: &Router, method: &str, path: &str, body: Value, headers: &[(&str, &str)]) -> (StatusCode, Vec<u8>) {
    let mut req = Request::builder().method(method).uri(path).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let body = if body.is_null() { Body::empty() } else { Body::from(body.to_string()) };
    let resp = app.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = resp.status();
    (status, axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap().to_vec())
}

pub async fn post(app: &Router, path: &str, body: Value) -> (StatusCode, Value) {
    let (s, b) = call(app, "POST", path, body, &[]).await;
    (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

/// `(event name, data)` pairs of an SSE body.
pub fn sse(body: &[u8]) -> Vec<(String, String)> {
    let text = String::from_utf8_lossy(body);
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut name = String::new();
            let mut data = String::new();
            for line in e.lines() {
                if let Some(v) = line.strip_prefix("event: ").or_else(|| line.strip_prefix("event:")) {
                    name = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("data: ").or_else(|| line.strip_prefix("data:")) {
                    data.push_str(v);
                }
            }
            (name, data)
        })
        .collect()
}
