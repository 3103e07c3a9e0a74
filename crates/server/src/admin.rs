//! `/health`, `/stats` (JSON), `/metrics` (Prometheus text) and `POST /admin/cache/flush`.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};

use crate::state::AppState;

pub async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// With `--api-key`, a client without the key sees no filesystem paths: not the model (its
/// `--model`, which may be a path) nor the SSD cache's folder; the counters stay open to
/// monitoring, like `/metrics`.
pub async fn stats(State(state): State<AppState>, headers: HeaderMap) -> Json<Value> {
    let mut stats = all_stats(&state);
    if !crate::has_key(&state, &headers) {
        for (at, field) in [("", "model"), ("/prompt_cache/ssd", "dir")] {
            if let Some(Value::Object(object)) = stats.pointer_mut(at) {
                object.remove(field);
            }
        }
    }
    Json(stats)
}

fn all_stats(state: &AppState) -> Value {
    let w = state.worker.stats();
    let pool = state.worker.pool_stats();
    let c = &state.config;
    json!({
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
        "prefill": {
            "forwards": w.prefill_forwards.load(Ordering::Relaxed),
            "chunks": w.prefill_chunks.load(Ordering::Relaxed),
            "mixed_steps": w.mixed_steps.load(Ordering::Relaxed),
            "seconds": w.prefill_ns.load(Ordering::Relaxed) as f64 / 1e9,
        },
        "structured_output": {
            "masks": w.structured_masks.load(Ordering::Relaxed),
            "mask_seconds": w.structured_mask_ns.load(Ordering::Relaxed) as f64 / 1e9,
        },
        "prompt_cache": cache_stats(state),
        "kv_pool": {
            "kv_cache_dtype": pool.kv_format,
            "bytes_per_token": {
                "full_attention": pool.kv_bytes_per_token,
                "sliding_window": pool.window_kv_bytes_per_token,
                // A delayed format's unquantized copy of a row's first positions.
                "delayed_first_positions": pool.delayed_bytes_per_token,
            },
            "quantized_kv_start": pool.delayed_positions,
            "block_size": pool.block_size,
            "blocks_total": pool.blocks_total,
            "blocks_used": pool.blocks_used,
            "blocks_used_peak": pool.blocks_used_peak,
            "blocks_shared": pool.blocks_shared,
            "tokens_total": pool.blocks_total * pool.block_size,
            "rows": w.active.load(Ordering::Relaxed),
            "slots_total": pool.slots_total,
            "slots_used": pool.slots_used,
            "preemptions": w.preemptions.load(Ordering::Relaxed),
            "bytes": state.worker.pool_bytes(),
        },
        "speculation": {
            "draft_rounds": w.draft_rounds.load(Ordering::Relaxed),
            "drafted_tokens": w.drafted_tokens.load(Ordering::Relaxed),
            "accepted_tokens": w.accepted_tokens.load(Ordering::Relaxed),
            "acceptance_rate": ratio(w.accepted_tokens.load(Ordering::Relaxed), w.drafted_tokens.load(Ordering::Relaxed)),
            "mean_accepted_per_round": ratio(w.accepted_tokens.load(Ordering::Relaxed), w.draft_rounds.load(Ordering::Relaxed)),
            "draft_seconds": w.draft_ns.load(Ordering::Relaxed) as f64 / 1e9,
        },
    })
}

fn ratio(a: u64, b: u64) -> Option<f64> {
    (b > 0).then(|| a as f64 / b as f64)
}

fn cache_stats(state: &AppState) -> Value {
    let s = state.worker.cache_stats();
    let config = state.worker.cache_config();
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    json!({
        "ram": {
            "max_bytes": config.ram_bytes,
            "entries": s.ram_entries.load(Ordering::Relaxed),
            "bytes": s.ram_bytes.load(Ordering::Relaxed),
            "hits": n(&s.ram_hits),
            "evictions": n(&s.ram_evictions),
        },
        "ssd": config.ssd.as_ref().map(|ssd| json!({
            "dir": ssd.options.dir.display().to_string(),
            "max_bytes": ssd.options.max_bytes,
            "entries": s.ssd_entries.load(Ordering::Relaxed),
            "bytes": n(&s.ssd_bytes),
            "hits": n(&s.ssd_hits),
            "restores": n(&s.ssd_restores),
            "restore_seconds": n(&s.ssd_restore_micros) as f64 / 1e6,
            "restore_failures": n(&s.ssd_restore_failures),
            "restored_waiting_bytes": s.ssd_restored_waiting_bytes.load(Ordering::Relaxed),
            "writes": n(&s.ssd_writes),
            "write_failures": n(&s.ssd_write_failures),
            "writes_dropped": n(&s.ssd_writes_dropped),
            "evictions": n(&s.ssd_evictions),
            "checkpoints_written": n(&s.checkpoints_written),
            "checkpoint_resumes": n(&s.checkpoint_resumes),
            "recovered": state.worker.recovery().map(|r| json!({
                "entries": r.entries, "bytes": r.bytes, "reaped_tmp": r.reaped_tmp,
                "removed_corrupt": r.removed_corrupt, "skipped_foreign": r.skipped_foreign,
                "skipped_unsafe": r.skipped_unsafe,
            })),
        })),
        "misses": n(&s.misses),
        "hit_tokens": n(&s.hit_tokens),
        "copy_failures": n(&s.copy_failures),
        "stride": config.stride,
    })
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FlushRequest {
    #[serde(default)]
    ssd: bool,
}

/// Drops the RAM tier, and with `{"ssd": true}` the SSD tier too. The body may be empty.
pub async fn flush_cache(State(state): State<AppState>, body: axum::body::Bytes) -> Result<Json<Value>, crate::error::ApiError> {
    let req: FlushRequest = if body.iter().all(u8::is_ascii_whitespace) {
        FlushRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| crate::error::ApiError::bad_request(format!("invalid flush request: {e}"), None))?
    };
    let worker = state.worker.clone();
    let (ram, ssd) = tokio::task::spawn_blocking(move || worker.flush_cache(req.ssd))
        .await
        .map_err(|e| crate::error::ApiError::internal(e.to_string()))?;
    tracing::info!(ram_entries = ram, ssd_entries = ssd, "prompt cache flushed");
    Ok(Json(json!({"flushed": {"ram_entries": ram, "ssd_entries": ssd}})))
}

pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let w = state.worker.stats();
    let s = state.worker.cache_stats();
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    let rows: [(&str, &str, &str, f64); 37] = [
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
        ("strata_prefill_forwards_total", "counter", "Prefill forwards run.", n(&w.prefill_forwards)),
        (
            "strata_prefill_chunks_total",
            "counter",
            "Prompt chunks fed by prefill forwards (several per forward for prompts prefilled together).",
            n(&w.prefill_chunks),
        ),
        (
            "strata_mixed_steps_total",
            "counter",
            "Steps that carried running requests' decode positions and prompt chunks together.",
            n(&w.mixed_steps),
        ),
        (
            "strata_prefill_seconds_total",
            "counter",
            "Time in forwards that fed prompt chunks (a step that also decoded counts whole).",
            n(&w.prefill_ns) / 1e9,
        ),
        (
            "strata_structured_masks_total",
            "counter",
            "Token masks computed for structured output (one per constrained position).",
            n(&w.structured_masks),
        ),
        (
            "strata_structured_mask_seconds_total",
            "counter",
            "Time computing structured-output token masks.",
            n(&w.structured_mask_ns) / 1e9,
        ),
        ("strata_cache_ram_entries", "gauge", "Prompt-cache entries in RAM.", s.ram_entries.load(Ordering::Relaxed) as f64),
        ("strata_cache_ram_bytes", "gauge", "Prompt-cache bytes in RAM.", s.ram_bytes.load(Ordering::Relaxed) as f64),
        ("strata_cache_ram_hits_total", "counter", "Prompts served from the RAM tier.", n(&s.ram_hits)),
        ("strata_cache_ram_evictions_total", "counter", "RAM entries evicted to stay under the cap.", n(&s.ram_evictions)),
        ("strata_cache_ssd_entries", "gauge", "Prompt-cache entries on SSD.", s.ssd_entries.load(Ordering::Relaxed) as f64),
        ("strata_cache_ssd_bytes", "gauge", "Prompt-cache bytes on SSD.", n(&s.ssd_bytes)),
        ("strata_cache_ssd_hits_total", "counter", "Prompts served from the SSD tier.", n(&s.ssd_hits)),
        ("strata_cache_misses_total", "counter", "Prompts with no usable cached prefix.", n(&s.misses)),
        ("strata_cache_hit_tokens_total", "counter", "Prompt tokens served from the cache.", n(&s.hit_tokens)),
        ("strata_cache_ssd_restores_total", "counter", "SSD entries read back.", n(&s.ssd_restores)),
        ("strata_cache_ssd_restore_seconds_total", "counter", "Time spent reading SSD entries.", n(&s.ssd_restore_micros) / 1e6),
        ("strata_cache_ssd_restore_failures_total", "counter", "SSD entries dropped as unreadable.", n(&s.ssd_restore_failures)),
        (
            "strata_cache_ssd_restored_waiting_bytes",
            "gauge",
            "Bytes read back from SSD for the next job, not yet admitted.",
            s.ssd_restored_waiting_bytes.load(Ordering::Relaxed) as f64,
        ),
        ("strata_cache_copy_failures_total", "counter", "Cache copies that failed (served as misses).", n(&s.copy_failures)),
        ("strata_cache_ssd_writes_total", "counter", "Entries written (spilled) to SSD.", n(&s.ssd_writes)),
        ("strata_cache_ssd_write_failures_total", "counter", "SSD writes that failed.", n(&s.ssd_write_failures)),
        ("strata_cache_ssd_writes_dropped_total", "counter", "SSD writes dropped on a full queue.", n(&s.ssd_writes_dropped)),
        ("strata_cache_checkpoint_resumes_total", "counter", "Generations resumed from a checkpoint.", n(&s.checkpoint_resumes)),
        ("strata_draft_rounds_total", "counter", "Decode steps that verified drafted tokens.", n(&w.draft_rounds)),
        ("strata_drafted_tokens_total", "counter", "Tokens drafted for speculative decoding.", n(&w.drafted_tokens)),
        ("strata_accepted_tokens_total", "counter", "Drafted tokens the model accepted.", n(&w.accepted_tokens)),
        (
            "strata_draft_seconds_total",
            "counter",
            "Time spent drafting (a draft model's or head's forwards).",
            n(&w.draft_ns) / 1e9,
        ),
    ];
    let p = state.worker.pool_stats();
    let pool = [
        ("strata_kv_block_size", "gauge", "Positions per attention KV block.", p.block_size as f64),
        ("strata_kv_blocks_total", "gauge", "Blocks of the attention KV pool (per attention layer).", p.blocks_total as f64),
        ("strata_kv_blocks_used", "gauge", "KV blocks held by requests.", p.blocks_used as f64),
        ("strata_kv_blocks_used_peak", "gauge", "Most KV blocks held at once since start.", p.blocks_used_peak as f64),
        ("strata_kv_blocks_shared", "gauge", "KV blocks held by more than one request.", p.blocks_shared as f64),
        ("strata_kv_slots_total", "gauge", "Recurrent-state slots of the pool (per recurrent layer).", p.slots_total as f64),
        ("strata_kv_slots_used", "gauge", "Recurrent-state slots held by requests.", p.slots_used as f64),
        (
            "strata_kv_preemptions_total",
            "counter",
            "Running requests preempted (state moved to host memory) when the pool ran short of blocks.",
            state.worker.stats().preemptions.load(Ordering::Relaxed) as f64,
        ),
    ];
    let mut text = String::new();
    for (name, kind, help, value) in rows.into_iter().chain(pool) {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}
