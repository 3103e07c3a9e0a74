//! The engine thread: owns the model and runs queued generations one at a time, streaming each
//! token to its requester. Requesters never touch model state; a requester that goes away
//! (its sink reports closed) cancels its generation within one decode step, or before it starts.
//!
//! One sequence at a time until continuous batching replaces this loop; the interface (a job
//! in, events out, drop to cancel) is the one the batched scheduler keeps.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use strata_model::Qwen35;

use crate::generate::{generate, Generation, GenerationOptions, Sampled};

/// What a job reports, in order: tokens, then exactly one `Finished` or `Failed`.
#[derive(Debug)]
pub enum Event {
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
}

#[derive(Clone)]
pub struct Worker {
    jobs: mpsc::Sender<Job>,
    stats: Arc<WorkerStats>,
}

impl Worker {
    /// Starts the engine thread with `model`.
    pub fn spawn(model: Qwen35) -> Self {
        let (jobs, queue) = mpsc::channel::<Job>();
        let stats = Arc::new(WorkerStats::default());
        let thread_stats = stats.clone();
        std::thread::Builder::new()
            .name("strata-engine".into())
            .spawn(move || run(model, queue, &thread_stats))
            .expect("the OS can start a thread");
        Self { jobs, stats }
    }

    pub fn submit(&self, job: Job) -> Result<(), String> {
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        self.jobs.send(job).map_err(|_| {
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            "the engine thread has stopped".to_string()
        })
    }

    pub fn stats(&self) -> &WorkerStats {
        &self.stats
    }
}

fn run(model: Qwen35, queue: mpsc::Receiver<Job>, stats: &WorkerStats) {
    for mut job in queue {
        stats.queued.fetch_sub(1, Ordering::Relaxed);
        stats.requests.fetch_add(1, Ordering::Relaxed);
        if job.sink.is_closed() {
            stats.cancelled.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        stats.active.fetch_add(1, Ordering::Relaxed);
        stats.prompt_tokens.fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
        let sink = &mut job.sink;
        let result = generate(&model, &job.prompt, &job.opts, |s| {
            stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
            sink.send(Event::Token(s.clone()))
        });
        match result {
            Ok(g) => {
                if g.finish == crate::FinishReason::Cancelled {
                    stats.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                job.sink.send(Event::Finished(g));
            }
            Err(e) => {
                job.sink.send(Event::Failed(e.to_string()));
            }
        }
        stats.active.fetch_sub(1, Ordering::Relaxed);
    }
}
