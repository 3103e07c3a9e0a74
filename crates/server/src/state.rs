//! What every handler shares: the engine handle, tokenizer, template and the model's defaults.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use strata_engine::{Grammars, Worker};
use strata_model::{ChatTemplate, GenerationConfig, ImageProcessor, Tokenizer};
use tokio::sync::watch;

use crate::http::HttpLimits;
use crate::images::ImageOptions;
use crate::response_store::ResponseStore;

pub struct ServerConfig {
    /// Name reported by `/v1/models` (requests for any model name are served by this one).
    pub model_name: String,
    pub dtype: String,
    pub device: String,
    /// Longest prompt + output a request may ask for.
    pub max_context: usize,
    pub api_key: Option<String>,
    /// Special-token strings typed in message content become control tokens, as with
    /// transformers' `apply_chat_template` (off: content is only ever text).
    pub special_tokens_in_content: bool,
    /// Connection and request-reading limits.
    pub http: HttpLimits,
    /// How many images a request may hold, and how large.
    pub images: ImageOptions,
}

pub struct Shared {
    pub config: ServerConfig,
    pub worker: Worker,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// How the model's images are prepared, where it takes images.
    pub image_processor: Option<ImageProcessor>,
    pub generation: GenerationConfig,
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: usize,
    pub started: Instant,
    pub http_requests: AtomicU64,
    pub http_errors: AtomicU64,
    pub cutoff: Cutoff,
    /// Responses kept for `GET /v1/responses/{id}` and `previous_response_id`.
    pub responses: ResponseStore,
    /// Structured output's compiler over this model's vocabulary, built on first use.
    pub grammars: OnceLock<Result<Grammars, String>>,
}

/// Reached when a shutdown's wait for the requests still running is over: each then ends at
/// once, with a proper ending (see `output::Finish::Shutdown`).
#[derive(Default)]
pub struct Cutoff(watch::Sender<bool>);

impl Cutoff {
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }

    pub async fn reached(&self) {
        // The sender is self: waiting ends only at the cutoff.
        let _ = self.0.subscribe().wait_for(|&cut| cut).await;
    }
}

impl Shared {
    /// Longest prompt + output a request may ask for: the configured context, within the
    /// model's positions.
    pub fn context(&self) -> usize {
        self.config.max_context.min(self.worker.max_positions())
    }
}

pub type AppState = Arc<Shared>;
