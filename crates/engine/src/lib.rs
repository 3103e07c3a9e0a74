//! Turning logits into tokens: the sampler, the generation loop, and the engine thread that
//! serves queued requests. Knows models only through their forward and state; knows nothing
//! of HTTP or files.

pub mod cache;
pub mod generate;
mod job;
mod prefetch;
pub mod sampler;
mod scheduler;
mod shared;
pub mod speculative;
pub mod structured;
pub mod worker;

pub use generate::{generate, FinishReason, Generation, GenerationOptions, Sampled};
pub use sampler::{Sampler, SamplingChoice, SamplingParams};
pub use speculative::{DraftSource, Speculation};
pub use structured::{Grammar, Grammars, Structure};
pub use worker::{
    CacheConfig, Counters, EngineConfig, Event, EventSink, Job, SpawnError, SsdConfig, Worker, WorkerStats, DEFAULT_KV_BLOCK_SIZE,
};
