//! The handle requesters hold: submit jobs, read counters, flush the cache, shut down.
//!
//! A job goes in, events come out; requesters never touch model state. With an SSD tier, a
//! prefetch thread reads any stored state a job can use from disk, so the engine thread (the
//! token loop) never waits on a disk read. The engine asks for it only for the job it admits
//! next, once that job fits the state budget: restored state never piles up on the device
//! ahead of admission, however many jobs a burst queues.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use strata_model::Model;
use strata_state::{BatchState, PoolSize, PoolStats, StateCost, StatePool};

use crate::cache::ssd::SsdError;
use crate::cache::{
    usable_prefix, CacheStats, Identity, RamCache, Recovery, Snapshot, SsdOptions, SsdStore, SsdWriter, PROMPT_NAMESPACE,
};
use crate::generate::{Generation, GenerationOptions, Sampled};
use crate::scheduler::Engine;
use crate::speculative::{Drafter, Speculation};

/// What a job reports, in order: `Started` once its prompt state is in place, tokens, then
/// exactly one `Finished` or `Failed` (which may also come first).
#[derive(Debug)]
pub enum Event {
    /// `cached_tokens` prompt tokens came from the prompt cache instead of a forward.
    Started {
        cached_tokens: usize,
    },
    Token(Sampled),
    Finished(Generation),
    Failed(String),
}

/// Where a job's events go. `send` returns false once nobody is listening.
pub trait EventSink: Send {
    fn send(&mut self, event: Event) -> bool;
    fn is_closed(&self) -> bool;
}

pub struct Job {
    pub prompt: Vec<u32>,
    pub opts: GenerationOptions,
    pub sink: Box<dyn EventSink>,
    /// Prompt lengths at which the prompt cache should also keep a snapshot, e.g. where the
    /// conversation so far ends in a chat prompt: the next turn re-renders the history and
    /// shares exactly that prefix, while the tail after it (the generation prompt) may differ.
    pub cache_points: Vec<usize>,
}

impl Job {
    pub fn new(prompt: Vec<u32>, opts: GenerationOptions, sink: Box<dyn EventSink>) -> Self {
        Self { prompt, opts, sink, cache_points: Vec::new() }
    }
}

/// A job waiting for the engine thread, with the SSD read done for it.
pub(crate) struct Queued {
    pub job: Job,
    pub fetch: Fetch,
}

/// Where the SSD read for a waiting job stands.
pub(crate) enum Fetch {
    /// Not asked for yet (the job is not next, or does not fit the budget yet).
    Unasked,
    /// Asked for under this request id.
    Pending(u64),
    /// Done: a prompt-cache entry read from SSD, a generation checkpoint to resume from, or
    /// nothing usable.
    Ready(Option<Snapshot>),
}

struct FetchRequest {
    id: u64,
    prompt: Vec<u32>,
    /// The job's generation-checkpoint namespace, when it has one.
    checkpoints: Option<u64>,
}

/// The engine thread's end of the prefetch thread: one request in flight at a time.
pub(crate) struct Prefetcher {
    requests: mpsc::Sender<FetchRequest>,
    results: mpsc::Receiver<(u64, Option<Snapshot>)>,
    next_id: u64,
}

impl Prefetcher {
    /// Asks for the stored state `job` can use; the answer comes to [`Prefetcher::take`].
    pub fn ask(&mut self, job: &Job, checkpoints: Option<u64>) -> Fetch {
        self.next_id += 1;
        let request = FetchRequest { id: self.next_id, prompt: job.prompt.clone(), checkpoints };
        match self.requests.send(request) {
            Ok(()) => Fetch::Pending(self.next_id),
            // Without its thread there is no SSD tier to read: a miss.
            Err(_) => Fetch::Ready(None),
        }
    }

    /// The answer to request `id` once it is in (waiting for it with `block`); answers to
    /// earlier requests, whose jobs went away meanwhile, are dropped.
    pub fn take(&self, id: u64, block: bool, stats: &CacheStats) -> Option<Option<Snapshot>> {
        loop {
            let answer = match block {
                true => self.results.recv().map_err(|_| mpsc::TryRecvError::Disconnected),
                false => self.results.try_recv(),
            };
            match answer {
                Ok((answered, snap)) if answered == id => return Some(snap),
                Ok((_, stale)) => release_waiting(stats, stale.as_ref()),
                Err(mpsc::TryRecvError::Empty) => return None,
                // The thread is gone and will never answer: a miss.
                Err(mpsc::TryRecvError::Disconnected) => return Some(None),
            }
        }
    }
}

/// A restored snapshot stops waiting for admission: taken by its job, or dropped.
pub(crate) fn release_waiting(stats: &CacheStats, snap: Option<&Snapshot>) {
    if let Some(snap) = snap {
        stats.ssd_restored_waiting_bytes.fetch_sub(snap.bytes(), Ordering::Relaxed);
    }
}

#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Most rows decoded together (`--max-num-seqs`).
    pub max_batch: usize,
    /// Prompt tokens per prefill forward.
    pub prefill_chunk: usize,
    /// Admission by worst case (`--state-budget-bytes`): a job is admitted only while the
    /// running rows' state at their full length (prompt + `max_tokens`) fits in these bytes,
    /// and the pool is sized to hold them, so no row is ever preempted. `usize::MAX` (the
    /// default): admission by the pool's free blocks instead, preempting rows when it runs short.
    pub state_budget_bytes: usize,
    /// Bytes of the state pool (`--kv-cache-memory`): its KV blocks and the rows' recurrent
    /// slots. `None`: on a GPU sized from `gpu_memory_utilization`; else from
    /// `state_budget_bytes` where that is bounded; else a pool that grows with the rows
    /// (one-off runs).
    pub kv_cache_bytes: Option<usize>,
    /// Positions per KV block of the pool (`--kv-block-size`).
    pub kv_block_size: usize,
    /// On a GPU, the share of its memory for weights, activations and the state pool
    /// (`--gpu-memory-utilization`, vLLM's meaning): the pool gets what the loaded weights and
    /// the activations' reserve leave of it, and the state budget is what the pool holds.
    pub gpu_memory_utilization: Option<f64>,
}

impl EngineConfig {
    /// Defaults for a device: CPU decode gains little past 16 rows; GPUs batch wider (256 rows,
    /// vLLM's default), size the pool from their memory, and take prompts in longer chunks (a
    /// GPU forward of 512 tokens leaves its matmuls and the chunked DeltaNet kernels short of
    /// work; 2048 prefilled an 8K prompt of the 4B shape ~20% faster on an H200, for a longer
    /// pause of running streams while a prompt joins).
    pub fn for_device(device: &candle_core::Device) -> Self {
        let cpu = device.is_cpu();
        let (max_batch, prefill_chunk) = if cpu { (16, 512) } else { (256, 2048) };
        Self {
            max_batch,
            prefill_chunk,
            state_budget_bytes: usize::MAX,
            kv_cache_bytes: None,
            kv_block_size: DEFAULT_KV_BLOCK_SIZE,
            gpu_memory_utilization: (!cpu).then_some(DEFAULT_GPU_MEMORY_UTILIZATION),
        }
    }

    /// The state pool the running batch keeps its rows in (see `kv_cache_bytes`).
    fn state_pool(&self, model: &Model, cache: &CacheConfig) -> Result<StatePool, SpawnError> {
        let spec = model.state_spec();
        let rows = self.max_batch + 1; // the running rows and the one prefilling
        let device = model.device();
        let memory = strata_kernels::device_memory(device).map_err(strata_model::ModelError::from)?;
        let blocks = match (self.kv_cache_bytes, self.gpu_memory_utilization, memory) {
            (Some(bytes), ..) => {
                let slots = spec.cost().bytes_per_row.saturating_mul(rows);
                let blocks = bytes.checked_sub(slots).map_or(0, |kv| StatePool::blocks_in(&spec, self.kv_block_size, kv));
                if blocks <= rows {
                    return Err(SpawnError::Memory(format!(
                        "--kv-cache-memory {bytes} holds {blocks} KV blocks after the recurrent state of {rows} rows \
                         ({slots} bytes): not one block per row; raise it or lower --max-num-seqs"
                    )));
                }
                PoolSize::Fixed(blocks)
            }
            // The worst case of the budget's rows, so that none is ever preempted.
            _ if self.state_budget_bytes != usize::MAX => {
                PoolSize::Fixed(StatePool::blocks_for_budget(&spec, self.kv_block_size, self.state_budget_bytes, rows))
            }
            (None, Some(share), Some((free, total))) => {
                let plan = MemoryPlan::new(model, self, cache.ram_bytes, share, free, total);
                PoolSize::Fixed(plan.blocks(&spec, self)?)
            }
            (None, ..) => PoolSize::Growing,
        };
        let slots = match blocks {
            PoolSize::Fixed(_) => PoolSize::Fixed(rows),
            PoolSize::Growing => PoolSize::Growing,
        };
        Ok(StatePool::new(&spec, self.kv_block_size, blocks, slots, device).map_err(strata_model::ModelError::from)?)
    }
}

/// How a GPU's memory is shared out: `share` of it for the weights (already loaded), the
/// activations' reserve and the state pool.
struct MemoryPlan {
    /// What the state pool may take.
    for_state: Option<usize>,
    share: f64,
    total: usize,
    used: usize,
    reserve: usize,
}

impl MemoryPlan {
    fn new(model: &Model, config: &EngineConfig, cache_bytes: usize, share: f64, free: usize, total: usize) -> Self {
        let used = total.saturating_sub(free);
        // A prompt chunk, the decode steps recorded as CUDA graphs (one per batch-size bucket,
        // whose sizes sum to about five times the widest), the prompt cache's RAM tier (which
        // holds its snapshots in the device's memory), and 1 GiB for cuBLAS's workspaces and
        // the CUDA context's own.
        let widest = 5 * config.max_batch;
        let reserve = model
            .activation_bytes(config.prefill_chunk, 1)
            .saturating_add(model.activation_bytes(widest, widest))
            .saturating_add(cache_bytes)
            .saturating_add(1 << 30);
        let target = (share * total as f64) as usize;
        let for_state = target.checked_sub(used).and_then(|left| left.checked_sub(reserve));
        Self { for_state, share, total, used, reserve }
    }

    /// KV blocks for the pool, after the rows' recurrent slots.
    fn blocks(&self, spec: &strata_state::StateSpec, config: &EngineConfig) -> Result<usize, SpawnError> {
        let rows = config.max_batch + 1;
        let per_row = spec.cost().bytes_per_row;
        let slots = per_row.saturating_mul(rows);
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let too_small = |what: String| {
            SpawnError::Memory(format!(
                "--gpu-memory-utilization {} of {:.1} GiB leaves {what} for the state pool after {:.1} GiB in use (weights) \
                 and a {:.1} GiB reserve for activations and the prompt cache's RAM tier; raise it, or lower \
                 --max-num-seqs ({}) or --prompt-cache-bytes",
                self.share,
                gib(self.total),
                gib(self.used),
                gib(self.reserve),
                config.max_batch
            ))
        };
        let Some(for_state) = self.for_state else { return Err(too_small("nothing".into())) };
        let for_kv = for_state.checked_sub(slots).ok_or_else(|| {
            too_small(format!("{:.1} GiB, less than the {rows} rows' recurrent state ({:.1} GiB)", gib(for_state), gib(slots)))
        })?;
        let blocks = StatePool::blocks_in(spec, config.kv_block_size, for_kv);
        let slack = rows * (1 + strata_state::ROUND_SLACK.div_ceil(config.kv_block_size));
        if blocks <= slack {
            return Err(too_small(format!("{:.1} GiB, not a block past every row's partly filled ones", gib(for_state))));
        }
        Ok(blocks)
    }
}

/// vLLM's default block size.
pub const DEFAULT_KV_BLOCK_SIZE: usize = 16;

/// vLLM's default share of a GPU's memory.
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// The prompt cache's settings.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Bytes of snapshots the RAM tier (memory of the model's device) may hold; 0 turns it off.
    pub ram_bytes: usize,
    /// During a long prefill, snapshot every `stride` prompt tokens (0: only at the prompt end).
    pub stride: usize,
    pub ssd: Option<SsdConfig>,
    /// Persist each deterministic generation's state every this many output tokens (0: off);
    /// needs the SSD tier.
    pub checkpoint_every: usize,
}

#[derive(Clone, Debug)]
pub struct SsdConfig {
    pub options: SsdOptions,
    pub identity: Identity,
    /// Snapshots waiting to be written; when full, new ones are dropped (and counted).
    pub queue: usize,
}

impl CacheConfig {
    /// RAM tier only, sized for a device: host memory on CPU, device memory on GPU. The stride
    /// follows the device's prefill chunk (chunks end at stride points).
    pub fn for_device(device: &candle_core::Device) -> Self {
        let gib = if device.is_cpu() { 4 } else { 8 };
        Self { ram_bytes: gib << 30, stride: EngineConfig::for_device(device).prefill_chunk, ssd: None, checkpoint_every: 0 }
    }

    pub fn off() -> Self {
        Self { ram_bytes: 0, stride: 0, ssd: None, checkpoint_every: 0 }
    }
}

/// Counters read by `/stats` and `/metrics`.
#[derive(Debug, Default)]
pub struct WorkerStats {
    pub queued: AtomicUsize,
    pub active: AtomicUsize,
    pub requests: AtomicU64,
    pub cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub state_bytes_reserved: AtomicUsize,
    pub decode_steps: AtomicU64,
    pub prefill_chunks: AtomicU64,
    /// Speculative decoding: tokens drafted, and how many the target accepted.
    pub draft_rounds: AtomicU64,
    pub drafted_tokens: AtomicU64,
    pub accepted_tokens: AtomicU64,
    /// Decode steps recorded as CUDA graphs, and replayed from one.
    pub graph_recordings: AtomicUsize,
    pub graph_replays: AtomicUsize,
    /// Of the replayed steps: host time before each replay, and the replays' GPU time.
    pub graph_prepare_ns: AtomicU64,
    pub graph_replay_gpu_ns: AtomicU64,
    /// Time spent in decode steps, and the part of it in the target's forward (to its logits
    /// on the host): the rest is the scheduler's own work (drafting, sampling, bookkeeping).
    pub decode_ns: AtomicU64,
    pub decode_forward_ns: AtomicU64,
    /// Running rows taken out of the batch (their state moved to host memory) because the
    /// pool ran short of KV blocks; each resumed later, bit for bit where it stopped.
    pub preemptions: AtomicU64,
}

/// The cache parts shared by the handle, the prefetch thread and the engine thread.
pub(crate) struct SharedCache {
    pub config: CacheConfig,
    pub stats: Arc<CacheStats>,
    pub ram: Mutex<RamCache>,
    pub writer: Option<SsdWriter>,
    /// The model's device, where the cached states live.
    pub device: candle_core::Device,
}

impl SharedCache {
    /// The namespace of `opts`' generation checkpoints, or None when the generation is not
    /// reproducible (unseeded sampling, or logprobs that a resume could not replay).
    /// Every checkpoint of one namespace belongs to the same prompt and settings, so the
    /// longest one is the one to resume from.
    pub fn checkpoint_namespace(&self, prompt: &[u32], opts: &GenerationOptions) -> Option<u64> {
        let deterministic = opts.sampling.is_greedy() || opts.sampling.seed.is_some();
        if self.config.checkpoint_every == 0 || self.writer.is_none() || !deterministic || opts.logprobs.is_some() {
            return None;
        }
        let mut key = xxhash_rust::xxh3::Xxh3::new();
        prompt.iter().for_each(|t| key.update(&t.to_le_bytes()));
        key.update(format!("{:?} {:?} {}", opts.sampling, opts.stop_tokens, opts.max_tokens).as_bytes());
        // Never 0, the prompt cache's namespace.
        Some(key.digest() | 1)
    }

    pub fn ram(&self) -> std::sync::MutexGuard<'_, RamCache> {
        self.ram.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The result of copying state into or out of the cache, or `None` (counted and logged)
    /// when the copy failed, e.g. the device was out of memory: the cache is then a miss, or
    /// keeps nothing, and the batch carries on.
    pub fn copied<T>(&self, what: &str, copy: strata_state::Result<T>) -> Option<T> {
        copy.inspect_err(|e| {
            self.stats.copy_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "prompt cache: could not copy {what}; going on without it");
        })
        .ok()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error(transparent)]
    Ssd(#[from] SsdError),
    #[error(transparent)]
    Model(#[from] strata_model::ModelError),
    #[error("{0}")]
    Memory(String),
}

#[derive(Clone)]
pub struct Worker {
    jobs: mpsc::Sender<Queued>,
    stats: Arc<WorkerStats>,
    cache: Arc<SharedCache>,
    recovery: Option<Recovery>,
    cost: StateCost,
    config: EngineConfig,
    max_positions: usize,
    pool: StatePool,
}

impl Worker {
    /// Starts the engine thread with `model`. Fails only when the SSD tier's folder cannot be
    /// opened.
    pub fn spawn(
        model: Model,
        config: EngineConfig,
        cache: CacheConfig,
        speculation: Option<Speculation>,
    ) -> Result<Self, SpawnError> {
        let stats = Arc::new(WorkerStats::default());
        let cache_stats = Arc::new(CacheStats::default());
        let cost = model.state_cost();
        let pool = config.state_pool(&model, &cache)?;
        let max_positions = model.max_position_embeddings();
        let (writer, recovery) = match &cache.ssd {
            Some(ssd) => {
                let (store, recovery) = SsdStore::open(ssd.options.clone(), ssd.identity.clone(), cache_stats.clone())?;
                (Some(SsdWriter::spawn(Arc::new(store), ssd.queue.max(1), cache_stats.clone())), Some(recovery))
            }
            None => (None, None),
        };
        let shared = Arc::new(SharedCache {
            ram: Mutex::new(RamCache::new(cache.ram_bytes, cache_stats.clone())),
            config: cache,
            stats: cache_stats,
            writer,
            device: model.device().clone(),
        });
        let (jobs, queue) = mpsc::channel::<Queued>();
        let prefetch = match &shared.writer {
            Some(_) => Some(spawn_prefetch(shared.clone(), model.new_state(1)?)),
            None => None,
        };
        let (thread_stats, thread_cache, engine_pool) = (stats.clone(), shared.clone(), pool.clone());
        std::thread::Builder::new()
            .name("strata-engine".into())
            .spawn(move || {
                // The engine thread computes too: as a worker of its own pool, each parallel
                // kernel runs part of its work here and hands the rest to the pool's other
                // threads, instead of handing all of it over and sleeping until it is done — a
                // wake-up on each side of ~130 kernels per decode step.
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(rayon::current_num_threads())
                    .thread_name(|i| format!("strata-compute-{i}"))
                    .use_current_thread()
                    .build();
                if let Err(e) = &pool {
                    tracing::warn!(error = %e, "could not make the engine thread a compute thread");
                }
                let drafter = speculation.map(Drafter::new);
                Engine::new(model, config, cost, &thread_stats, &thread_cache, drafter, prefetch, engine_pool).run(queue)
            })
            .expect("the OS can start a thread");
        Ok(Self { jobs, stats, cache: shared, recovery, cost, config, max_positions, pool })
    }

    /// Whether a job of `tokens` total tokens (prompt + output budget) can ever be admitted;
    /// the error says why not.
    pub fn admissible(&self, tokens: usize) -> Result<(), String> {
        let Some(need) = self.cost.bytes(tokens) else {
            return Err(format!("the state of {tokens} tokens would be more bytes than this machine can count"));
        };
        if need > self.config.state_budget_bytes {
            return Err(format!(
                "the request needs {need} bytes of state for {tokens} tokens but the engine's state budget is {} bytes",
                self.config.state_budget_bytes
            ));
        }
        // The longest a row of it gets (with a speculative round's slack and a partly filled
        // block) must fit the pool alone: everything else can wait or be preempted.
        let block_size = self.pool.block_size();
        let blocks = (tokens + strata_state::ROUND_SLACK).div_ceil(block_size) + 1;
        if let Some(total) = self.pool.blocks_total().filter(|&total| blocks > total) {
            return Err(format!(
                "the request's {tokens} tokens need {blocks} KV blocks of {block_size} positions but the pool holds \
                 {total}; raise --kv-cache-memory (or --gpu-memory-utilization)"
            ));
        }
        Ok(())
    }

    pub fn submit(&self, job: Job) -> Result<(), String> {
        self.admissible(job.prompt.len() + job.opts.max_tokens)?;
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        self.jobs.send(Queued { job, fetch: Fetch::Unasked }).map_err(|_| {
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            "the engine thread has stopped".to_string()
        })
    }

    /// The positions the model has (`max_position_embeddings`): the most tokens a sequence may
    /// hold.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    pub fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    pub fn cache_stats(&self) -> &CacheStats {
        &self.cache.stats
    }

    /// The state pool's counts: KV blocks and recurrent slots.
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Bytes of device memory the state pool's buffers take.
    pub fn pool_bytes(&self) -> usize {
        self.pool.bytes()
    }

    pub fn cache_config(&self) -> &CacheConfig {
        &self.cache.config
    }

    /// What the SSD tier found and cleaned up when it opened.
    pub fn recovery(&self) -> Option<&Recovery> {
        self.recovery.as_ref()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Drops every RAM entry and, with `ssd`, every SSD entry of this model; returns how many
    /// of each went.
    pub fn flush_cache(&self, ssd: bool) -> (usize, usize) {
        // Dropping the RAM tier's device tensors queues frees on the device.
        let ram = {
            let _device = strata_kernels::device_use(&self.cache.device);
            self.cache.ram().clear()
        };
        let ssd = match (&self.cache.writer, ssd) {
            (Some(w), true) => w.store().clear().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "could not clear the SSD cache");
                0
            }),
            _ => 0,
        };
        (ram, ssd)
    }

    /// Waits up to `deadline` for queued SSD writes; returns how many were left unwritten.
    pub fn shutdown(&self, deadline: Duration) -> usize {
        self.cache.writer.as_ref().map_or(0, |w| w.shutdown(deadline))
    }
}

/// Starts the thread that reads usable SSD state for the jobs the engine asks about. It reads
/// only when the SSD holds more of the prompt than the RAM tier does.
fn spawn_prefetch(cache: Arc<SharedCache>, template: BatchState) -> Prefetcher {
    let (requests, incoming) = mpsc::channel::<FetchRequest>();
    let (answers, results) = mpsc::channel();
    std::thread::Builder::new()
        .name("strata-prefetch".into())
        .spawn(move || {
            for request in incoming {
                let snap = prefetch(&cache, &template, &request);
                if let Some(snap) = &snap {
                    cache.stats.ssd_restored_waiting_bytes.fetch_add(snap.bytes(), Ordering::Relaxed);
                }
                if let Err(unsent) = answers.send((request.id, snap)) {
                    let _device = strata_kernels::device_use(&cache.device);
                    drop(unsent);
                    break;
                }
            }
            // The template's device tensors are freed on this thread, which may never have
            // touched the device (nothing was restored).
            let _device = strata_kernels::device_use(&cache.device);
            drop(template);
        })
        .expect("the OS can start a thread");
    Prefetcher { requests, results, next_id: 0 }
}

fn prefetch(cache: &SharedCache, template: &BatchState, request: &FetchRequest) -> Option<Snapshot> {
    let store = cache.writer.as_ref()?.store();
    let prompt = &request.prompt;
    let hit = match request.checkpoints.and_then(|ns| {
        store.lookup(ns, |tokens, _| if tokens.len() >= prompt.len() && tokens.starts_with(prompt) { tokens.len() } else { 0 })
    }) {
        Some(checkpoint) => checkpoint,
        None => {
            let limit = prompt.len().saturating_sub(1);
            let score = |tokens: &[u32], trim: bool| usable_prefix(tokens, trim, prompt, limit);
            let hit = store.lookup(PROMPT_NAMESPACE, score)?;
            if hit.usable <= cache.ram().best(PROMPT_NAMESPACE, score) {
                return None;
            }
            hit
        }
    };
    let started = Instant::now();
    // Creating the state on the device must not land in a decode step being recorded.
    let _device = strata_kernels::device_use(&cache.device);
    match store.load(&hit, template) {
        Ok(snap) => {
            tracing::debug!(tokens = hit.usable, micros = started.elapsed().as_micros() as u64, "restored from SSD");
            Some(snap)
        }
        Err(e) => {
            tracing::warn!(error = %e, "dropped an unreadable SSD cache entry; the prompt is prefilled instead");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use candle_core::{DType, Device};
    use strata_model::ModelFolder;

    use super::*;
    use crate::SamplingParams;

    struct Events(mpsc::Sender<Event>);

    impl EventSink for Events {
        fn send(&mut self, event: Event) -> bool {
            self.0.send(event).is_ok()
        }
        fn is_closed(&self) -> bool {
            false
        }
    }

    /// A cached entry that cannot be copied out (as when the device has no memory left for the
    /// copy; here a state with no rows, so its copy fails on every device) is a miss: the job
    /// is prefilled from scratch and the batch carries on.
    #[test]
    fn a_failed_cache_copy_is_a_miss() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5-tiny-a");
        let model = ModelFolder::open(&dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
        let rowless = BatchState { layers: model.new_state(0).unwrap().layers, positions: vec![5] };
        let config = EngineConfig {
            max_batch: 4,
            prefill_chunk: 8,
            state_budget_bytes: 1 << 30,
            kv_cache_bytes: None,
            kv_block_size: 16,
            gpu_memory_utilization: None,
        };
        let cache = CacheConfig { ram_bytes: 1 << 30, stride: 0, ssd: None, checkpoint_every: 0 };
        let worker = Worker::spawn(model, config, cache, None).unwrap();
        let tokens: Vec<u32> = (1..=5).collect();
        worker.cache.ram().insert(Snapshot { namespace: PROMPT_NAMESPACE, tokens: tokens.clone(), state: rowless, resume: None });

        let opts = GenerationOptions {
            max_tokens: 3,
            sampling: SamplingParams::greedy(),
            stop_tokens: vec![],
            prefill_chunk: 8,
            logprobs: None,
        };
        let (events, answer) = mpsc::channel();
        worker.submit(Job::new((1..=9).collect(), opts, Box::new(Events(events)))).unwrap();
        let mut cached = None;
        loop {
            match answer.recv_timeout(Duration::from_secs(120)).expect("the engine answers") {
                Event::Started { cached_tokens } => cached = Some(cached_tokens),
                Event::Token(_) => {}
                Event::Finished(generation) => {
                    assert_eq!(generation.tokens.len(), 3);
                    break;
                }
                Event::Failed(e) => panic!("the job failed: {e}"),
            }
        }
        let stats = worker.cache_stats();
        assert_eq!(cached, Some(0));
        assert_eq!((stats.copy_failures.load(Ordering::Relaxed), stats.misses.load(Ordering::Relaxed)), (1, 1));
        assert_eq!(stats.ram_hits.load(Ordering::Relaxed), 0);
    }
}
