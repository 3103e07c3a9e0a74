//! The handle requesters hold: submit jobs, read counters, flush the cache, shut down.
//!
//! A job goes in, events come out; requesters never touch model state. With an SSD tier, a
//! prefetch thread reads any stored state a job can use from disk, so the engine thread (the
//! token loop) never waits on a disk read. The engine asks for it only for the job it admits
//! next, once that job fits the state budget: restored state never piles up on the device
//! ahead of admission, however many jobs a burst queues.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use strata_model::{image_cache_key, mrope_positions, Model, VisionConfig};
use strata_state::{PoolSize, PoolStats, StateCost, StatePool};

use crate::cache::ssd::SsdError;
use crate::cache::{CacheStats, RamCache, Recovery, SsdStore, SsdWriter};
use crate::prefetch::spawn_prefetch;
use crate::scheduler::Engine;
use crate::speculative::{Drafter, Speculation};

pub use crate::job::{Event, EventSink, Job};
use crate::job::{Fetch, Queued};
use crate::shared::SharedCache;
pub use crate::shared::{
    CacheConfig, Counters, EngineConfig, SsdConfig, WorkerStats, DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_BLOCK_SIZE,
};

impl EngineConfig {
    /// The state pool the running batch keeps its rows in (see `kv_cache_bytes`).
    fn state_pool(&self, model: &Model, cache: &CacheConfig) -> Result<StatePool, SpawnError> {
        let spec = model.state_spec();
        let rows = self.max_batch + 1; // the running and prefilling rows (at most max_batch), and a spare
        let device = model.device();
        let memory = strata_kernels::device_memory(device).map_err(strata_model::ModelError::from)?;
        let blocks = match (self.kv_cache_bytes, self.gpu_memory_utilization, memory) {
            (Some(bytes), ..) => {
                let slots = spec.cost().row_bytes_besides_kv().saturating_mul(rows);
                let blocks = bytes.checked_sub(slots).map_or(0, |kv| StatePool::blocks_in(&spec, self.kv_block_size, kv));
                if blocks <= rows {
                    return Err(SpawnError::Memory(format!(
                        "--kv-cache-memory {bytes} holds {blocks} KV blocks after the recurrent state (and delayed KV's \
                         unquantized first positions) of {rows} rows ({slots} bytes): not one block per row; raise it or \
                         lower --max-num-seqs"
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
        // A step's forward, the decode steps recorded as CUDA graphs (one per batch-size bucket,
        // whose sizes sum to about five times the widest), the prompt cache's RAM tier (which
        // holds its snapshots in the device's memory), and 1 GiB for cuBLAS's workspaces and
        // the CUDA context's own.
        let widest = 5 * config.max_batch;
        let reserve = model
            .activation_bytes(config.step_tokens().max(config.prefill_chunk), 1)
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
        let per_row = spec.cost().row_bytes_besides_kv();
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
    /// The vision tower's config, where the model takes images.
    vision: Option<VisionConfig>,
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
        let vision = model.vision().map(|tower| tower.config().clone());
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
        Ok(Self { jobs, stats, cache: shared, recovery, cost, config, max_positions, pool, vision })
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

    pub fn submit(&self, mut job: Job) -> Result<(), String> {
        self.admissible(job.prompt.len() + job.opts.max_tokens)?;
        if !job.images.is_empty() {
            let vision = self.vision.as_ref().ok_or("this model takes no images (it has no vision tower)")?;
            // The images fit their runs of image tokens, as the engine will place them.
            let grids: Vec<[usize; 3]> = job.images.iter().map(|i| i.grid).collect();
            mrope_positions(&job.prompt, &grids, vision).map_err(|e| e.to_string())?;
            job.image_key = Some(image_cache_key(&job.prompt, &job.images, vision.image_token_id).map_err(|e| e.to_string())?);
        }
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        self.jobs.send(Queued { job, fetch: Fetch::Unasked }).map_err(|_| {
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            "the engine thread has stopped".to_string()
        })
    }

    /// The positions the model has (`max_position_embeddings`): the most tokens a sequence may
    /// hold.
    /// The vision tower's config (its image token, patch and merge sizes), where the model
    /// takes images.
    pub fn vision(&self) -> Option<&VisionConfig> {
        self.vision.as_ref()
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    pub fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    /// The engine's counters once it has no request left (waiting at most `within`): read
    /// after a benchmark's requests ended, they include the step that ended them, whose
    /// counters are published after its last events went out.
    pub fn settled_counters(&self, within: Duration) -> Counters {
        let deadline = Instant::now() + within;
        while (self.stats.active.load(Ordering::Acquire) > 0 || self.stats.queued.load(Ordering::Relaxed) > 0)
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.stats.counters()
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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use candle_core::{DType, Device};
    use strata_model::ModelFolder;

    use strata_state::BatchState;

    use super::*;
    use crate::cache::{Snapshot, PROMPT_NAMESPACE};
    use crate::{GenerationOptions, SamplingParams};

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
        let rowless = BatchState::new(model.new_state(0).unwrap().layers, vec![5]);
        let config = EngineConfig {
            max_batch: 4,
            prefill_chunk: 8,
            max_batched_tokens: None,
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
            grammar: None,
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
