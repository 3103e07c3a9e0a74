//! The state pool under load, through the HTTP API: requests extending one cached prefix hold
//! its KV blocks once, and their answers are what each computes alone.

mod common;

use axum::http::StatusCode;
use candle_core::Device;
use serde_json::{json, Value};
use strata_engine::EngineConfig;

use common::{call, post, state_uncached, state_with};

const BLOCK: u64 = 16;

/// A request's prompt: `prefix` then a suffix of its own (its ids follow `seed`; the fixture's
/// vocabulary has 512 tokens).
fn extend(prefix: &[u32], suffix: usize, seed: u32) -> Vec<u32> {
    prefix.iter().copied().chain((0..suffix as u32).map(|t| (seed * 37 + t) % 500 + 3)).collect()
}

fn completion(prompt: &[u32], max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

async fn stats(app: &axum::Router) -> Value {
    let (_, body) = call(app, "GET", "/stats", Value::Null, &[]).await;
    serde_json::from_slice(&body).unwrap()
}

/// After one request has sent a 2,000-token prefix, 32 concurrent requests extend it (suffixes
/// of 1 to 32 tokens, 1 to 32 output tokens): they restore it from the prompt cache, whose
/// entry shares its KV blocks with them, so at peak the pool holds less than 3× the blocks one
/// such request needs on its own; and each answer equals the same request run alone without a
/// cache.
#[tokio::test(flavor = "multi_thread")]
async fn requests_extending_a_cached_prefix_share_its_blocks() {
    let engine = EngineConfig { max_batch: 32, kv_block_size: BLOCK as usize, ..EngineConfig::for_device(&Device::Cpu) };
    let shared = strata_server::router(state_with("qwen3_5-tiny-a", 100_000, engine));
    let prefix: Vec<u32> = (0..2000u32).map(|t| (t * 7919 + 13) % 500 + 3).collect();
    let (s, r) = post(&shared, "/v1/completions", completion(&prefix, 4)).await;
    assert_eq!(s, StatusCode::OK, "{r}");

    let requests: Vec<(Vec<u32>, usize)> = (0..32).map(|i| (extend(&prefix, 1 + i % 32, i as u32), 32 - (i * 7) % 32)).collect();
    let tasks: Vec<_> = requests
        .iter()
        .map(|(prompt, max_tokens)| {
            let (app, body) = (shared.clone(), completion(prompt, *max_tokens));
            tokio::spawn(async move { post(&app, "/v1/completions", body).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        let (s, r) = task.await.unwrap();
        assert_eq!(s, StatusCode::OK, "{r}");
        // The prefix's snapshot at its last token but one, or the first request's own state at
        // its end where it stopped at once.
        let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        assert!(cached >= 1999, "each request reused the prefix: {r}");
        answers.push(r["choices"][0]["text"].as_str().unwrap().to_string());
    }

    let pool = &stats(&shared).await["kv_pool"];
    let one = (2000 + 32 + 32u64).div_ceil(BLOCK);
    let peak = pool["blocks_used_peak"].as_u64().unwrap();
    assert!(peak <= 3 * one, "33 requests held {peak} blocks at peak, one alone needs {one}: {pool}");
    assert!(peak > one, "the 32 requests ran together: {pool}");

    let alone = strata_server::router(state_uncached("qwen3_5-tiny-a", 100_000, engine));
    for ((prompt, max_tokens), shared_answer) in requests.iter().zip(&answers) {
        let (_, r) = post(&alone, "/v1/completions", completion(prompt, *max_tokens)).await;
        assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        assert_eq!(r["choices"][0]["text"].as_str().unwrap(), shared_answer, "{} prompt tokens", prompt.len());
    }
}
