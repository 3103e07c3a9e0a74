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

/// Sends every completion request at once and returns their answers in order, each a 200.
async fn complete_at_once(app: &axum::Router, bodies: impl Iterator<Item = Value>) -> Vec<Value> {
    let tasks: Vec<_> = bodies
        .map(|body| {
            let app = app.clone();
            tokio::spawn(async move { post(&app, "/v1/completions", body).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        let (s, r) = task.await.unwrap();
        assert_eq!(s, StatusCode::OK, "{r}");
        answers.push(r);
    }
    answers
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
    let bodies = requests.iter().map(|(prompt, max_tokens)| completion(prompt, *max_tokens));
    let mut answers = Vec::new();
    for r in complete_at_once(&shared, bodies).await {
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

/// A pool sized for two long requests (232 positions: 15 blocks of 16) with six submitted at
/// once: all six are admitted on their short prompts, outgrow the pool (four of them run past
/// 100 tokens before an end token), and the youngest are preempted (their state moved to host
/// memory) and resumed later. Every answer —
/// greedy, and sampled with a seed — equals the same request run alone in an unbounded pool,
/// and `/stats` and `/metrics` count the preemptions.
#[tokio::test(flavor = "multi_thread")]
async fn requests_outgrowing_the_pool_are_preempted_and_resume_exactly() {
    let fixture = "qwen3_5-tiny-a";
    let cost = strata_model::ModelFolder::open(&common::fixture(fixture))
        .unwrap()
        .load(candle_core::DType::F32, &Device::Cpu)
        .unwrap()
        .state_cost();
    let (rows, blocks) = (6, 2 * 16);
    let pool_bytes = (rows + 1) * cost.bytes_per_row + blocks * BLOCK as usize * cost.bytes_per_token;
    let engine = EngineConfig {
        max_batch: rows,
        kv_block_size: BLOCK as usize,
        kv_cache_bytes: Some(pool_bytes),
        ..EngineConfig::for_device(&Device::Cpu)
    };
    let small = strata_server::router(state_with(fixture, 100_000, engine));
    assert_eq!(stats(&small).await["kv_pool"]["blocks_total"], blocks as u64);

    let body = |i: u32| {
        let prompt: Vec<u32> = (0..32).map(|t| (i * 503 + t * 13) % 500 + 3).collect();
        let mut body = json!({"prompt": prompt, "max_tokens": 200, "temperature": 0});
        if i % 2 == 1 {
            body["temperature"] = json!(0.9);
            body["seed"] = json!(1000 + i);
        }
        body
    };
    let answers: Vec<String> = complete_at_once(&small, (0..rows as u32).map(body))
        .await
        .iter()
        .map(|r| r["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    let preemptions = stats(&small).await["kv_pool"]["preemptions"].as_u64().unwrap();
    assert!(preemptions > 0, "six rows growing to 15 blocks each in a pool of {blocks} were preempted");
    let (_, metrics) = call(&small, "GET", "/metrics", Value::Null, &[]).await;
    let metrics = String::from_utf8(metrics).unwrap();
    assert!(metrics.contains(&format!("\nstrata_kv_preemptions_total {preemptions}\n")), "{metrics}");

    let alone = strata_server::router(state_uncached(fixture, 100_000, EngineConfig::for_device(&Device::Cpu)));
    for (i, answer) in answers.iter().enumerate() {
        let (s, r) = post(&alone, "/v1/completions", body(i as u32)).await;
        assert_eq!(s, StatusCode::OK, "{r}");
        assert_eq!(r["choices"][0]["text"].as_str().unwrap(), answer, "request {i}");
    }
}
