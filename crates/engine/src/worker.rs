//! The engine thread: continuous batching over one model.
//!
//! Each step it admits waiting jobs (first come, first admitted, while the batch has room and
//! the state budget covers the job's whole prompt + output), feeds one prefill chunk of the
//! oldest joiner, then runs one batched decode forward for every running row — each row at its
//! own position — and samples each row with its own parameters. A long prompt therefore holds
//! the running streams up for at most one chunk per step. A finished row (end token, length, or
//! a requester that went away) leaves the batch without disturbing the others.
//!
//! Requesters never touch model state: a job goes in, events come out, and a closed sink
//! cancels the job within one step.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use strata_model::{Logits, Qwen35, StateCost};
use strata_state::BatchState;

use crate::generate::{with_logprobs, FinishReason, Generation, GenerationOptions, Sampled};
use crate::sampler::Sampler;

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

#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Most rows decoded together.
    pub max_batch: usize,
    /// Prompt tokens per prefill forward.
    pub prefill_chunk: usize,
    /// Bytes of sequence state (KV + recurrent) the running batch may hold.
    pub state_budget_bytes: usize,
}

impl EngineConfig {
    /// Defaults for a device: CPU decode gains little past 16 rows; GPUs batch wider.
    pub fn for_device(device: &candle_core::Device) -> Self {
        let (max_batch, gib) = if device.is_cpu() { (16, 8) } else { (64, 32) };
        Self { max_batch, prefill_chunk: 512, state_budget_bytes: gib << 30 }
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
}

#[derive(Clone)]
pub struct Worker {
    jobs: mpsc::Sender<Job>,
    stats: Arc<WorkerStats>,
    cost: StateCost,
    config: EngineConfig,
}

impl Worker {
    /// Starts the engine thread with `model`.
    pub fn spawn(model: Qwen35, config: EngineConfig) -> Self {
        let (jobs, queue) = mpsc::channel::<Job>();
        let stats = Arc::new(WorkerStats::default());
        let cost = model.state_cost();
        let thread_stats = stats.clone();
        std::thread::Builder::new()
            .name("strata-engine".into())
            .spawn(move || {
                Engine {
                    model,
                    config,
                    cost,
                    stats: &thread_stats,
                    waiting: VecDeque::new(),
                    joiner: None,
                    batch: None,
                    rows: Vec::new(),
                }
                .run(queue)
            })
            .expect("the OS can start a thread");
        Self { jobs, stats, cost, config }
    }

    /// Whether a job of `tokens` total tokens (prompt + output budget) can ever be admitted;
    /// the error says why not.
    pub fn admissible(&self, tokens: usize) -> Result<(), String> {
        let need = self.cost.bytes(tokens);
        if need > self.config.state_budget_bytes {
            return Err(format!(
                "the request needs {need} bytes of state for {tokens} tokens but the engine's state budget is {} bytes",
                self.config.state_budget_bytes
            ));
        }
        Ok(())
    }

    pub fn submit(&self, job: Job) -> Result<(), String> {
        self.admissible(job.prompt.len() + job.opts.max_tokens)?;
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        self.jobs.send(job).map_err(|_| {
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            "the engine thread has stopped".to_string()
        })
    }

    pub fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }
}

/// A running row: one sequence of the batch.
struct Row {
    job: Job,
    sampler: Sampler,
    context: Vec<u32>,
    generated: Vec<u32>,
    reserved: usize,
    prefill_time: Duration,
    decode_start: Instant,
}

/// The job being prefilled, in its own single-row state until it joins the batch.
struct Joiner {
    job: Job,
    state: BatchState,
    fed: usize,
    reserved: usize,
    started: Instant,
}

struct Engine<'a> {
    model: Qwen35,
    config: EngineConfig,
    cost: StateCost,
    stats: &'a WorkerStats,
    waiting: VecDeque<Job>,
    joiner: Option<Joiner>,
    /// State of the running rows, in `rows` order.
    batch: Option<BatchState>,
    rows: Vec<Row>,
}

/// How a row's step ended.
enum Step {
    Continue,
    Done(FinishReason),
}

impl Engine<'_> {
    fn run(mut self, queue: mpsc::Receiver<Job>) {
        loop {
            let idle = self.rows.is_empty() && self.joiner.is_none() && self.waiting.is_empty();
            if idle {
                match queue.recv() {
                    Ok(job) => self.waiting.push_back(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = queue.try_recv() {
                self.waiting.push_back(job);
            }
            if let Err(e) = self.step() {
                self.fail_all(&e.to_string());
            }
        }
    }

    fn reserved(&self) -> usize {
        self.rows.iter().map(|r| r.reserved).sum::<usize>() + self.joiner.as_ref().map_or(0, |j| j.reserved)
    }

    /// Admission, one prefill chunk, one decode step.
    fn step(&mut self) -> strata_model::Result<()> {
        self.admit()?;
        self.prefill_chunk()?;
        self.decode()?;
        self.stats.active.store(self.rows.len() + self.joiner.is_some() as usize, Ordering::Relaxed);
        self.stats.state_bytes_reserved.store(self.reserved(), Ordering::Relaxed);
        Ok(())
    }

    /// Starts prefilling the oldest waiting job when the batch has room and the budget covers
    /// it. Strictly in arrival order: a job never overtakes an older one, so none starves.
    fn admit(&mut self) -> strata_model::Result<()> {
        while self.joiner.is_none() && self.rows.len() < self.config.max_batch {
            let Some(job) = self.waiting.front() else { return Ok(()) };
            if job.sink.is_closed() {
                self.waiting.pop_front();
                self.stats.queued.fetch_sub(1, Ordering::Relaxed);
                self.stats.requests.fetch_add(1, Ordering::Relaxed);
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let need = self.cost.bytes(job.prompt.len() + job.opts.max_tokens);
            if self.reserved() + need > self.config.state_budget_bytes {
                return Ok(());
            }
            let job = self.waiting.pop_front().expect("front exists");
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            self.stats.prompt_tokens.fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
            let state = self.model.new_state(1)?;
            self.joiner = Some(Joiner { job, state, fed: 0, reserved: need, started: Instant::now() });
        }
        Ok(())
    }

    /// Feeds the joiner one chunk; when its prompt is done, samples its first token and moves
    /// its state into the batch.
    fn prefill_chunk(&mut self) -> strata_model::Result<()> {
        let Some(joiner) = self.joiner.as_mut() else { return Ok(()) };
        if joiner.job.sink.is_closed() {
            self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
            self.joiner = None;
            return Ok(());
        }
        let prompt = &joiner.job.prompt;
        if prompt.is_empty() {
            let mut j = self.joiner.take().expect("checked above");
            j.job.sink.send(Event::Failed("the prompt is empty".into()));
            return Ok(());
        }
        let end = (joiner.fed + self.config.prefill_chunk.max(1)).min(prompt.len());
        let input = Tensor::new(&prompt[joiner.fed..end], self.model.device())?.unsqueeze(0)?;
        let logits = self.model.forward(&input, &mut joiner.state, Logits::Last)?;
        joiner.fed = end;
        self.stats.prefill_chunks.fetch_add(1, Ordering::Relaxed);
        if end < prompt.len() {
            return Ok(());
        }
        let j = self.joiner.take().expect("checked above");
        let mut row = Row {
            sampler: Sampler::new(j.job.opts.sampling.clone()),
            context: j.job.prompt.clone(),
            generated: Vec::new(),
            reserved: j.reserved,
            prefill_time: j.started.elapsed(),
            decode_start: Instant::now(),
            job: j.job,
        };
        let logits = logits.squeeze(0)?.to_vec1::<f32>()?;
        match Self::sample_and_send(self.stats, &mut row, &logits) {
            Step::Done(reason) => self.finish(row, reason),
            Step::Continue => {
                match &mut self.batch {
                    Some(batch) => batch.merge(&j.state)?,
                    None => self.batch = Some(j.state),
                }
                self.rows.push(row);
            }
        }
        Ok(())
    }

    /// One forward for every running row, then per-row sampling; finished rows leave.
    fn decode(&mut self) -> strata_model::Result<()> {
        let Some(batch) = self.batch.as_mut() else { return Ok(()) };
        let last: Vec<u32> = self.rows.iter().map(|r| *r.context.last().expect("a running row has a token")).collect();
        let input = Tensor::new(last.as_slice(), self.model.device())?.unsqueeze(1)?;
        let logits = self.model.forward(&input, batch, Logits::Last)?.to_vec2::<f32>()?;
        self.stats.decode_steps.fetch_add(1, Ordering::Relaxed);
        let mut keep = Vec::with_capacity(self.rows.len());
        let mut done = Vec::new();
        for (i, (row, logits)) in self.rows.iter_mut().zip(&logits).enumerate() {
            match Self::sample_and_send(self.stats, row, logits) {
                Step::Continue => keep.push(i),
                Step::Done(reason) => done.push((i, reason)),
            }
        }
        if done.is_empty() {
            return Ok(());
        }
        let mut rows: Vec<Option<Row>> = std::mem::take(&mut self.rows).into_iter().map(Some).collect();
        for (i, reason) in done {
            let row = rows[i].take().expect("each row finishes once");
            self.finish(row, reason);
        }
        self.rows = rows.into_iter().flatten().collect();
        if keep.is_empty() {
            self.batch = None;
        } else {
            self.batch.as_mut().expect("checked above").filter(&keep)?;
        }
        Ok(())
    }

    /// Samples the row's next token from `logits` and streams it; says whether the row goes on.
    fn sample_and_send(stats: &WorkerStats, row: &mut Row, logits: &[f32]) -> Step {
        let opts = &row.job.opts;
        if row.generated.len() >= opts.max_tokens {
            return Step::Done(FinishReason::Length);
        }
        let next = row.sampler.sample(logits, &row.context, &row.generated);
        if opts.stop_tokens.contains(&next) {
            return Step::Done(FinishReason::Stop);
        }
        row.generated.push(next);
        row.context.push(next);
        stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let sampled = match opts.logprobs {
            None => Sampled { id: next, logprob: None, top_logprobs: Vec::new() },
            Some(top) => with_logprobs(logits, next, top),
        };
        if !row.job.sink.send(Event::Token(sampled)) {
            return Step::Done(FinishReason::Cancelled);
        }
        if row.generated.len() >= opts.max_tokens {
            return Step::Done(FinishReason::Length);
        }
        Step::Continue
    }

    fn finish(&self, mut row: Row, reason: FinishReason) {
        if reason == FinishReason::Cancelled {
            self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        let generation = Generation {
            tokens: std::mem::take(&mut row.generated),
            finish: reason,
            prefill_time: row.prefill_time,
            decode_time: row.decode_start.elapsed(),
        };
        row.job.sink.send(Event::Finished(generation));
    }

    /// A forward failed: the batch state can no longer be trusted, so every job in flight fails.
    fn fail_all(&mut self, message: &str) {
        for mut row in self.rows.drain(..) {
            row.job.sink.send(Event::Failed(message.to_string()));
        }
        if let Some(mut j) = self.joiner.take() {
            j.job.sink.send(Event::Failed(message.to_string()));
        }
        self.batch = None;
    }
}
