//! The HTTP server: OpenAI- (chat, completions, responses) and Anthropic-compatible endpoints over the engine. The only crate
//! that knows HTTP and the wire schemas; handlers never touch model state (they queue jobs
//! for the engine thread and read its events).

mod admin;
mod anthropic;
pub mod error;
mod http;
mod images;
mod openai;
mod output;
pub mod parse;
mod request;
mod response_store;
mod responses;
pub mod state;
mod structured;

use std::sync::atomic::Ordering;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::error::{ApiError, Dialect};
pub use crate::http::{default_max_connections, raise_open_files_limit, serve, HttpLimits};
pub use crate::images::ImageOptions;
pub use crate::response_store::ResponseStore;
pub use crate::state::{AppState, Cutoff, ServerConfig, Shared};

/// Largest request body accepted (larger ones get a 413 error object).
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/admin/cache/flush", post(admin::flush_cache))
        .route_layer(middleware::from_fn_with_state(state.clone(), read_body))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .merge(api)
        .route("/health", get(admin::health))
        .route("/stats", get(admin::stats))
        .route("/metrics", get(admin::metrics))
        .layer(middleware::from_fn_with_state(state.clone(), count_and_shape_errors))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

fn dialect_of(path: &str) -> Dialect {
    if path.starts_with("/v1/messages") {
        Dialect::Anthropic
    } else {
        Dialect::OpenAi
    }
}

/// With `--api-key`, `/v1/*` needs `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY`
/// (Anthropic).
async fn authorize(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if !has_key(&state, req.headers()) {
        return ApiError::unauthorized().in_dialect(dialect_of(req.uri().path())).into_response();
    }
    next.run(req).await
}

/// Whether a request may do what `--api-key` guards: no key is set, or it presents the key
/// (the auth scheme, like every HTTP auth scheme, in any case).
pub(crate) fn has_key(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(key) = &state.config.api_key else { return true };
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let bearer = text(header::AUTHORIZATION.as_str())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    bearer == Some(key.as_str()) || text("x-api-key") == Some(key.as_str())
}

/// Reads a request's body before its handler runs. A `Content-Length` over the limit is
/// refused from the header alone (413, no byte of the body read); a body that has not arrived
/// whole within `--body-read-timeout` of its header is cut off with a 408. Both close the
/// connection, whose unread rest cannot be told from a next request.
async fn read_body(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let dialect = dialect_of(req.uri().path());
    let refuse = |status, message: String| {
        let mut response = ApiError { status, message, param: None, dialect }.into_response();
        response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
        response
    };
    let too_large = || refuse(StatusCode::PAYLOAD_TOO_LARGE, format!("request body is larger than {MAX_BODY_BYTES} bytes"));
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return too_large();
    }
    let (parts, body) = req.into_parts();
    let timeout = state.config.http.body_read_timeout;
    let body = match tokio::time::timeout(timeout, Limited::new(body, MAX_BODY_BYTES).collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return too_large(),
        Ok(Err(e)) => return refuse(StatusCode::BAD_REQUEST, format!("cannot read the request body: {e}")),
        Err(_) => {
            let message = format!("the request body did not arrive within {} s of its header", timeout.as_secs_f64());
            return refuse(StatusCode::REQUEST_TIMEOUT, message);
        }
    };
    next.run(Request::from_parts(parts, Body::from(body))).await
}

/// Counts requests and errors, and gives axum's own rejections (unknown route, wrong method)
/// the API's error shape.
async fn count_and_shape_errors(State(state): State<AppState>, req: Request, next: Next) -> Response {
    state.http_requests.fetch_add(1, Ordering::Relaxed);
    let dialect = dialect_of(req.uri().path());
    let response = next.run(req).await;
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        state.http_errors.fetch_add(1, Ordering::Relaxed);
    }
    let is_json = response.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if is_json || status.is_success() {
        return response;
    }
    let message = match status {
        StatusCode::NOT_FOUND => "no such endpoint".to_string(),
        StatusCode::METHOD_NOT_ALLOWED => "method not allowed on this endpoint".to_string(),
        s => s.canonical_reason().unwrap_or("error").to_string(),
    };
    ApiError { status, message, param: None, dialect }.into_response()
}

/// One structured log line per finished request.
fn log_request(id: &str, o: &output::Outcome) {
    let decode_s = o.elapsed.saturating_sub(o.ttft.unwrap_or_default()).as_secs_f64();
    tracing::info!(
        id,
        prompt_tokens = o.prompt_tokens,
        cached_tokens = o.cached_tokens,
        generated_tokens = o.completion_tokens,
        ttft_ms = o.ttft.map(|t| t.as_secs_f64() * 1e3).unwrap_or(0.0),
        tok_s = o.completion_tokens.saturating_sub(1) as f64 / decode_s.max(1e-9),
        finish = ?o.finish,
        draft_acceptance = o.speculation.map(|(_, drafted, accepted)| accepted as f64 / drafted as f64),
        mean_accepted = o.speculation.map(|(rounds, _, accepted)| accepted as f64 / rounds.max(1) as f64),
        "request done"
    );
}
