//! What every handler shares: the engine handle, tokenizer, template and the model's defaults.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use strata_engine::Worker;
use strata_model::{ChatTemplate, GenerationConfig, Tokenizer};

use crate::http::HttpLimits;

pub struct ServerConfig {
    /// Name reported by `/v1/models` (requests for any model name are served by this one).
    pub model_name: String,
    pub dtype: String,
    pub device: String,
    /// Longest prompt + output a request may ask for.
    pub max_context: usize,
    pub api_key: Option<String>,
    /// Connection and request-reading limits.
    pub http: HttpLimits,
}

pub struct Shared {
    pub config: ServerConfig,
    pub worker: Worker,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub generation: GenerationConfig,
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: usize,
    pub started: Instant,
    pub http_requests: AtomicU64,
    pub http_errors: AtomicU64,
}

pub type AppState = Arc<Shared>;
