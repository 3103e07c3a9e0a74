//! Settings and counters the handle and the engine thread share.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::cache::{CacheStats, Identity, RamCache, SsdOptions, SsdWriter};
use crate::job::Job;

#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Most rows decoded together (`--max-num-seqs`).
    pub max_batch: usize,
    /// Most tokens of one prompt a forward takes (`--prefill-chunk`; also the prompt cache's
    /// snapshot stride by default).
    pub prefill_chunk: usize,
    /// A step's token budget (`--max-num-batched-tokens`, vLLM's name): every running row's
    /// decode positions, then prompts' whole chunks, oldest first, while they fit (the oldest
    /// prompt's chunk always runs); it also caps a chunk. A smaller budget bounds the pause a
    /// joining prompt makes in running streams; a larger one prefills bursts of prompts in
    /// fewer, fuller forwards. `None`: the prefill chunk plus a position for each row of a full
    /// batch, so that the running rows never crowd a whole chunk out of a step.
    pub max_batched_tokens: Option<usize>,
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
            max_batched_tokens: None,
            state_budget_bytes: usize::MAX,
            kv_cache_bytes: None,
            kv_block_size: DEFAULT_KV_BLOCK_SIZE,
            gpu_memory_utilization: (!cpu).then_some(DEFAULT_GPU_MEMORY_UTILIZATION),
        }
    }
}

impl EngineConfig {
    /// A step's token budget (`max_batched_tokens`, else the prefill chunk beside a full batch's
    /// decode positions: with the prefill chunk alone, 64 rows left room for one 1,024-token
    /// prompt a step where two fit before they ran, and a burst of such prompts prefilled
    /// ~30% slower on an H100).
    pub fn step_tokens(&self) -> usize {
        self.max_batched_tokens.unwrap_or(self.prefill_chunk.saturating_add(self.max_batch)).max(1)
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
    /// Prefill forwards, and the prompt chunks they fed: several per forward when prompts
    /// that arrived together prefill as one cohort.
    pub prefill_forwards: AtomicU64,
    pub prefill_chunks: AtomicU64,
    /// Time in forwards that fed prompts' chunks, the device's work included (a mixed step's
    /// whole forward).
    pub prefill_ns: AtomicU64,
    /// Steps that carried running rows' decode positions and prompts' chunks together (their
    /// time counts in both the prefill and the decode forward times).
    pub mixed_steps: AtomicU64,
    /// Structured output: token masks computed, and the time computing them took.
    pub structured_masks: AtomicU64,
    pub structured_mask_ns: AtomicU64,
    /// Speculative decoding: tokens drafted, and how many the target accepted.
    pub draft_rounds: AtomicU64,
    pub drafted_tokens: AtomicU64,
    pub accepted_tokens: AtomicU64,
    /// Host wall time of the decode steps' drafting (a draft model's or head's forwards, to the
    /// drafts on the host), part of the steps' time outside the target's forward.
    pub draft_ns: AtomicU64,
    /// Decode steps recorded as CUDA graphs, and replayed from one.
    pub graph_recordings: AtomicUsize,
    pub graph_replays: AtomicUsize,
    /// Of the replayed steps: host time before each replay, and the replays' GPU time.
    pub graph_prepare_ns: AtomicU64,
    pub graph_replay_gpu_ns: AtomicU64,
    /// Time spent in steps with running rows, and the part of it in the target's forward (to
    /// its logits on the host): the rest is the scheduler's own work (drafting, sampling,
    /// planning, bookkeeping). A mixed step counts whole, its prompts' chunks included.
    pub decode_ns: AtomicU64,
    pub decode_forward_ns: AtomicU64,
    /// Running rows taken out of the batch (their state moved to host memory) because the
    /// pool ran short of KV blocks; each resumed later, bit for bit where it stopped.
    pub preemptions: AtomicU64,
}

/// The engine's step counters at one moment ([`WorkerStats::counters`]): a benchmark reads them
/// before and after a run and reports the run's own steps from the difference
/// ([`Counters::since`]).
macro_rules! counters {
    ($($field:ident),* $(,)?) => {
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct Counters {
            $(pub $field: u64,)*
        }

        impl WorkerStats {
            pub fn counters(&self) -> Counters {
                Counters { $($field: self.$field.load(Ordering::Relaxed) as u64,)* }
            }
        }

        impl Counters {
            /// What was counted between `before` and these.
            pub fn since(&self, before: &Counters) -> Counters {
                Counters { $($field: self.$field.saturating_sub(before.$field),)* }
            }
        }
    };
}

counters!(
    decode_steps,
    decode_ns,
    decode_forward_ns,
    prefill_forwards,
    prefill_chunks,
    prefill_ns,
    mixed_steps,
    graph_recordings,
    graph_replays,
    graph_prepare_ns,
    graph_replay_gpu_ns,
    draft_rounds,
    drafted_tokens,
    accepted_tokens,
    draft_ns,
    structured_masks,
    structured_mask_ns,
    preemptions,
);

impl Counters {
    /// Mean wall time of a step with running rows, and of its forward (to the logits on the
    /// host): the difference is the scheduler's own work between forwards.
    pub fn decode_step_ms(&self) -> Option<f64> {
        mean_ms(self.decode_ns, self.decode_steps)
    }

    pub fn decode_forward_ms(&self) -> Option<f64> {
        mean_ms(self.decode_forward_ns, self.decode_steps)
    }

    /// Mean wall time of a forward that fed prompts' chunks (a mixed step's counts whole).
    pub fn prefill_forward_ms(&self) -> Option<f64> {
        mean_ms(self.prefill_ns, self.prefill_forwards)
    }

    /// Mean per replayed step: host time before the replay, and the replay's GPU time.
    pub fn graph_prepare_ms(&self) -> Option<f64> {
        mean_ms(self.graph_prepare_ns, self.graph_replays)
    }

    pub fn graph_replay_gpu_ms(&self) -> Option<f64> {
        mean_ms(self.graph_replay_gpu_ns, self.graph_replays)
    }

    /// Drafting's wall time per decode step (steps that drafted nothing count too), where any
    /// drafting was timed.
    pub fn draft_ms(&self) -> Option<f64> {
        (self.draft_ns > 0).then(|| mean_ms(self.draft_ns, self.decode_steps)).flatten()
    }

    /// Share of drafted tokens accepted, where any were drafted.
    pub fn acceptance(&self) -> Option<f64> {
        (self.drafted_tokens > 0).then(|| self.accepted_tokens as f64 / self.drafted_tokens as f64)
    }

    /// Mean host time to compute one structured-output mask, in µs.
    pub fn mask_us(&self) -> Option<f64> {
        mean_ms(self.structured_mask_ns, self.structured_masks).map(|ms| ms * 1e3)
    }
}

fn mean_ms(ns: u64, events: u64) -> Option<f64> {
    (events > 0).then(|| ns as f64 / events as f64 / 1e6)
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
    pub fn checkpoint_namespace(&self, job: &Job) -> Option<u64> {
        let (prompt, opts) = (&job.prompt, &job.opts);
        let deterministic = opts.sampling.is_greedy() || opts.sampling.seed.is_some();
        if self.config.checkpoint_every == 0 || self.writer.is_none() || !deterministic || opts.logprobs.is_some() {
            return None;
        }
        // A checkpoint resumes from tokens alone, which do not hold a prompt's images.
        if job.has_images() {
            return None;
        }
        let mut key = xxhash_rust::xxh3::Xxh3::new();
        prompt.iter().for_each(|t| key.update(&t.to_le_bytes()));
        key.update(format!("{:?} {:?} {} {:?}", opts.sampling, opts.stop_tokens, opts.max_tokens, opts.grammar).as_bytes());
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
