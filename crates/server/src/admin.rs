//! `/health`, `/stats` (JSON) and `/metrics` (Prometheus text).

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};

use crate::state::AppState;

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn stats(State(state): State<AppState>) -> Json<Value> {
    let w = state.worker.stats();
    let c = &state.config;
    Json(json!({
        "model": c.model_name,
        "dtype": c.dtype,
        "device": c.device,
        "uptime_s": state.started.elapsed().as_secs_f64(),
        "http_requests": state.http_requests.load(Ordering::Relaxed),
        "http_errors": state.http_errors.load(Ordering::Relaxed),
        "requests": w.requests.load(Ordering::Relaxed),
        "cancelled": w.cancelled.load(Ordering::Relaxed),
        "active": w.active.load(Ordering::Relaxed),
        "queued": w.queued.load(Ordering::Relaxed),
        "prompt_tokens": w.prompt_tokens.load(Ordering::Relaxed),
        "generated_tokens": w.generated_tokens.load(Ordering::Relaxed),
        "max_context": c.max_context,
    }))
}

pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let w = state.worker.stats();
    let rows: [(&str, &str, &str, f64); 9] = [
        ("strata_uptime_seconds", "gauge", "Seconds since the server started.", state.started.elapsed().as_secs_f64()),
        ("strata_http_requests_total", "counter", "HTTP requests received.", state.http_requests.load(Ordering::Relaxed) as f64),
        (
            "strata_http_errors_total",
            "counter",
            "HTTP requests answered with an error status.",
            state.http_errors.load(Ordering::Relaxed) as f64,
        ),
        ("strata_requests_total", "counter", "Generations taken by the engine.", w.requests.load(Ordering::Relaxed) as f64),
        (
            "strata_requests_cancelled_total",
            "counter",
            "Generations cancelled by a disconnected client.",
            w.cancelled.load(Ordering::Relaxed) as f64,
        ),
        ("strata_requests_active", "gauge", "Generations running now.", w.active.load(Ordering::Relaxed) as f64),
        ("strata_requests_queued", "gauge", "Generations waiting for the engine.", w.queued.load(Ordering::Relaxed) as f64),
        ("strata_prompt_tokens_total", "counter", "Prompt tokens processed.", w.prompt_tokens.load(Ordering::Relaxed) as f64),
        ("strata_generated_tokens_total", "counter", "Tokens generated.", w.generated_tokens.load(Ordering::Relaxed) as f64),
    ];
    let mut text = String::new();
    for (name, kind, help, value) in rows {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}
