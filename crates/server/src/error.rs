//! API errors in the shapes the SDKs parse: OpenAI's `{"error": {message, type, param, code}}`
//! and Anthropic's `{"type": "error", "error": {type, message}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Anthropic,
}

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub dialect: Dialect,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.map(str::to_string),
            dialect: Dialect::OpenAi,
        }
    }

    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "invalid or missing API key".into(),
            param: None,
            dialect: Dialect::OpenAi,
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), param: None, dialect: Dialect::OpenAi }
    }

    /// The server is shutting down (SDKs retry a 503).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self { status: StatusCode::SERVICE_UNAVAILABLE, message: message.into(), param: None, dialect: Dialect::OpenAi }
    }

    pub fn in_dialect(mut self, dialect: Dialect) -> Self {
        self.dialect = dialect;
        self
    }

    fn kind(&self) -> &'static str {
        match (self.status, self.dialect) {
            (StatusCode::UNAUTHORIZED, Dialect::OpenAi) => "invalid_api_key",
            (StatusCode::UNAUTHORIZED, Dialect::Anthropic) => "authentication_error",
            (StatusCode::PAYLOAD_TOO_LARGE, Dialect::Anthropic) => "request_too_large",
            (s, Dialect::OpenAi) if s.is_client_error() => "invalid_request_error",
            (s, Dialect::Anthropic) if s.is_client_error() => "invalid_request_error",
            (_, Dialect::OpenAi) => "server_error",
            (_, Dialect::Anthropic) => "api_error",
        }
    }

    pub fn body(&self) -> serde_json::Value {
        match self.dialect {
            Dialect::OpenAi => {
                json!({"error": {"message": self.message, "type": self.kind(), "param": self.param, "code": null}})
            }
            Dialect::Anthropic => json!({"type": "error", "error": {"type": self.kind(), "message": self.message}}),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// Parses a JSON request body, naming the offending field in the error.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> ApiResult<T> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let param = (path != ".").then_some(path);
        let inner = e.into_inner();
        let message = if inner.is_syntax() || inner.is_eof() {
            format!("request body is not valid JSON: {inner}")
        } else {
            format!("invalid request: {inner}{}", param.as_ref().map(|p| format!(" (at `{p}`)")).unwrap_or_default())
        };
        ApiError { status: StatusCode::BAD_REQUEST, message, param, dialect: Dialect::OpenAi }
    })
}
