//! The engine thread: continuous batching over one model, with the prompt cache.
//!
//! Each step it admits waiting jobs (first come, first admitted, while the batch has room, the
//! pool has free KV blocks for the prompt, and a `--state-budget-bytes` cap, where set, covers
//! the job's whole prompt + output), then runs one forward over segments that carries every
//! running row's decode positions — each row at its own position — and, beside them, the
//! prefilling jobs' next chunks (the joiners: several prompts that arrived together feed their
//! chunks as segments of the same forward; on a GPU the rows' segment may replay its CUDA graph
//! on its own, see `Model::forward_segments`) in the room the step's token budget
//! (`--max-num-batched-tokens`) leaves, oldest first; then samples each row with its own
//! parameters. A prompt therefore holds the running streams up by at most its share of one
//! step's budget. (A prompt with images is a segment of its own: its embeddings and positions
//! are its own.) A finished row (end token, length, or a requester that went away) leaves the batch
//! without disturbing the others.
//!
//! When the pool runs short of blocks for a decode step, the prompt cache gives up entries
//! first, then the prefilling jobs start over, then the youngest running rows are preempted:
//! their state is copied to host memory and their blocks freed. Preempted rows come back, the
//! oldest first and before any new job, once their blocks are free again, and go on exactly
//! where they stopped (the copy is bit for bit; the sampler travels with the row).
//!
//! The cache: a joiner starts from the longest usable stored prefix (RAM, or SSD read by the
//! prefetch thread for the job admitted next, once it fits the budget). Prefill chunks end at
//! every `stride` tokens and one token before the prompt's end, where snapshots are taken —
//! recurrent state exists only where it was computed, so these are the positions later prompts
//! can resume from. A finished row publishes its state. Snapshots are copies; the SSD gets them
//! through the write-behind queue, so this thread never touches the disk.
//!
//! The work splits three ways. The [`policy`] decides from plain bookkeeping (no model, no
//! tensors) what the step does: which row resumes or job starts, which joiners' chunks ride in
//! the step and where they end, which measures free blocks for a decode step. The [`runner`]
//! does it: forwards, the pool, the batch's state, the drafter. [`apply`] turns a forward's logits into
//! tokens and events, finishes rows, and feeds the prompt cache. This module holds the rows'
//! bookkeeping and asks each in turn.

mod apply;
mod policy;
mod runner;

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use strata_model::{ImagePrompt, Model};
use strata_state::{BatchState, StateCost, StatePool};

use self::apply::{Row, Step};
use self::policy::{Admission, Chunk, Fed, Load, Measure, Policy, Prompt, Waiting};
use self::runner::{Decoded, Feed, Runner};
use crate::cache::{Snapshot, PROMPT_NAMESPACE};
use crate::generate::FinishReason;
use crate::job::{Event, Fetch, Job, Queued};
use crate::prefetch::{release_waiting, Prefetcher};
use crate::sampler::Sampler;
use crate::shared::{EngineConfig, SharedCache, WorkerStats};
use crate::speculative::{Drafter, JoinerDraft};
use crate::structured::Constraint;

/// A running row taken out of the batch when the pool ran short of KV blocks: its state as
/// host tensors named as [`BatchState::parts`] names them, at `position`.
struct Preempted {
    row: Row,
    parts: Vec<(String, Tensor)>,
    position: usize,
    /// Its rotary positions' offset from its sequence positions (after images; not a part).
    rope_offset: i64,
}

/// A job being prefilled, in its own single-row state until it joins the batch.
struct Joiner {
    job: Job,
    state: BatchState,
    /// What an MTP drafter's head read of the prompt so far.
    draft: JoinerDraft,
    /// The prompt's images through the vision tower, with every position's rotary position.
    images: Option<ImagePrompt>,
    fed: usize,
    reserved: usize,
    started: Instant,
}

pub(crate) struct Engine<'a> {
    policy: Policy,
    runner: Runner,
    cost: StateCost,
    stats: &'a WorkerStats,
    cache: &'a SharedCache,
    waiting: VecDeque<Queued>,
    /// The jobs being prefilled, oldest first.
    joiners: Vec<Joiner>,
    /// The running rows, in the batch state's order.
    rows: Vec<Row>,
    /// Rows waiting to resume, the first to resume first.
    preempted: VecDeque<Preempted>,
    /// Reads SSD state for the job at the front of `waiting` (with an SSD tier).
    prefetch: Option<Prefetcher>,
}

impl<'a> Engine<'a> {
    pub fn new(
        model: Model,
        config: EngineConfig,
        cost: StateCost,
        stats: &'a WorkerStats,
        cache: &'a SharedCache,
        drafter: Option<Drafter>,
        prefetch: Option<Prefetcher>,
        pool: StatePool,
    ) -> Self {
        let (policy, runner) = (Policy::new(&config), Runner::new(model, pool, drafter));
        let (waiting, joiners, rows, preempted) = (VecDeque::new(), Vec::new(), Vec::new(), VecDeque::new());
        Self { policy, runner, cost, stats, cache, waiting, joiners, rows, preempted, prefetch }
    }

    pub fn run(mut self, queue: mpsc::Receiver<Queued>) {
        loop {
            let idle = self.rows.is_empty() && self.joiners.is_empty() && self.preempted.is_empty();
            if idle && self.waiting.is_empty() {
                match queue.recv() {
                    Ok(job) => self.waiting.push_back(job),
                    Err(_) => return,
                }
            } else if idle {
                // Nothing runs: the only thing to do may be waiting for the next job's SSD read.
                self.poll_fetch(true);
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
        let rows = self.rows.iter().chain(self.preempted.iter().map(|p| &p.row));
        rows.map(|r| r.reserved).sum::<usize>() + self.joiners.iter().map(|j| j.reserved).sum::<usize>()
    }

    /// The jobs in flight, as the policy sees them.
    fn load(&self) -> Load {
        let joiners = self.joiners.iter().map(|j| Fed { fed: j.fed, len: j.job.prompt.len() }).collect();
        Load { running: self.rows.len(), joiners, reserved_bytes: self.reserved() }
    }

    /// Admission, then one forward for the running rows' decode positions and the prompts'
    /// chunks that fit the step's token budget beside them.
    fn step(&mut self) -> strata_model::Result<()> {
        self.admit()?;
        self.drop_gone_joiners();
        self.forward_step()?;
        self.stats.state_bytes_reserved.store(self.reserved(), Ordering::Relaxed);
        let graphs = self.runner.graph_stats();
        self.stats.graph_recordings.store(graphs.recordings, Ordering::Relaxed);
        self.stats.graph_replays.store(graphs.replays, Ordering::Relaxed);
        self.stats.graph_prepare_ns.store(graphs.prepare_ns, Ordering::Relaxed);
        self.stats.graph_replay_gpu_ns.store(graphs.replay_gpu_ns, Ordering::Relaxed);
        // Last, and released: whoever sees the engine idle sees the step's counters too
        // (`Worker::settled_counters`).
        let active = self.rows.len() + self.preempted.len() + self.joiners.len();
        self.stats.active.store(active, Ordering::Release);
        Ok(())
    }

    /// Brings preempted rows back and starts waiting jobs while the policy says so; rows and
    /// jobs whose requester went away leave first. The restored state of a job's SSD read
    /// waits within the budget, and no other job's does.
    fn admit(&mut self) -> strata_model::Result<()> {
        loop {
            if self.preempted.front().is_some_and(|p| p.row.job.sink.is_closed()) {
                let gone = self.preempted.pop_front().expect("checked above");
                apply::finish(self.stats, gone.row, FinishReason::Cancelled);
                continue;
            }
            if self.preempted.is_empty() && self.waiting.front().is_some_and(|q| q.job.sink.is_closed()) {
                if let Some(Queued { fetch: Fetch::Ready(snap), .. }) = self.waiting.pop_front() {
                    release_waiting(&self.cache.stats, snap.as_ref());
                }
                self.stats.queued.fetch_sub(1, Ordering::Relaxed);
                self.stats.requests.fetch_add(1, Ordering::Relaxed);
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let mut next = self.admission();
            if next == Admission::Fetch {
                if !self.poll_fetch(false) {
                    return Ok(());
                }
                next = self.admission();
            }
            match next {
                Admission::Resume => self.resume_preempted()?,
                Admission::Start => self.start()?,
                Admission::Wait => return Ok(()),
                Admission::Fetch => unreachable!("poll_fetch said the front job's read is done"),
            }
        }
    }

    /// What the policy admits next.
    fn admission(&mut self) -> Admission {
        let waiting = self.waiting.front().map(|Queued { job, fetch }| Waiting {
            prompt_len: job.prompt.len(),
            bytes: self.job_bytes(job),
            fetched: matches!(fetch, Fetch::Ready(_)),
        });
        let preempted = self.preempted.front().map(|p| p.position);
        self.policy.admission(&self.load(), preempted, waiting, &mut self.runner.blocks(self.cache))
    }

    /// A job's worst-case state: its prompt and all of its output.
    fn job_bytes(&self, job: &Job) -> usize {
        self.cost.bytes(job.prompt.len() + job.opts.max_tokens).expect("submit() checked the job's state size")
    }

    /// Brings the first preempted row back into the batch.
    fn resume_preempted(&mut self) -> strata_model::Result<()> {
        let Preempted { row, parts, position, rope_offset } =
            self.preempted.pop_front().expect("the policy resumes a preempted row");
        let mut state = self.runner.restore(&parts, position)?;
        state.rope_offsets[0] = rope_offset;
        // The draft model reads the context again, as after a checkpoint's resume.
        self.join_batch(row, state, JoinerDraft::default())
    }

    /// Starts the oldest waiting job: from its generation checkpoint, or as a joiner.
    fn start(&mut self) -> strata_model::Result<()> {
        let Some(Queued { job, fetch: Fetch::Ready(restored) }) = self.waiting.pop_front() else {
            unreachable!("the policy starts a job whose read is done")
        };
        let need = self.job_bytes(&job);
        release_waiting(&self.cache.stats, restored.as_ref());
        self.stats.queued.fetch_sub(1, Ordering::Relaxed);
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        self.stats.prompt_tokens.fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
        match restored {
            Some(snap) if snap.resume.is_some_and(|r| r.prompt_len == job.prompt.len()) => self.resume(job, snap, need),
            restored => {
                let mut job = job;
                // The tower runs once per prompt, before its first chunk; an image it cannot
                // take fails this job only.
                let images = match job.images.is_empty() {
                    true => None,
                    false => match self.runner.image_prompt(&job) {
                        // The pixels are let go: the merged tokens and the cache key hold what
                        // the job still needs of them.
                        Ok(images) => {
                            job.images = Vec::new();
                            Some(images)
                        }
                        Err(e) => {
                            job.sink.send(Event::Failed(format!("the images: {e}")));
                            return Ok(());
                        }
                    },
                };
                let (mut state, cached) = self.runner.restore_prompt(self.cache, job.cache_tokens(), restored)?;
                // A text prompt's cached prefix holds no image; an entry made past one carries
                // that prompt's offset. (A prompt with images gives every prefill position its
                // own, and the offset follows the last.)
                if images.is_none() {
                    state.rope_offsets[0] = 0;
                }
                job.sink.send(Event::Started { cached_tokens: cached });
                let (draft, started) = (JoinerDraft::default(), Instant::now());
                self.joiners.push(Joiner { job, state, draft, images, fed: cached, reserved: need, started });
                Ok(())
            }
        }
    }

    /// Frees pool blocks for a decode step of `width` positions per row: the prompt cache gives
    /// up entries before each check, and the policy's measures are taken in turn until the
    /// step fits or none is left.
    fn room_for_step(&mut self, width: usize) -> strata_model::Result<()> {
        let mut relief = self.policy.relief(&self.load()).into_iter();
        while !self.policy.step_fits(self.runner.blocks_to_grow(width), &mut self.runner.blocks(self.cache)) {
            match relief.next() {
                Some(Measure::RestartJoiner(i)) => {
                    let joiner = &mut self.joiners[i];
                    self.runner.restart(&mut joiner.state)?;
                    (joiner.fed, joiner.draft) = (0, JoinerDraft::default());
                }
                Some(Measure::Preempt(i)) => self.preempt(i)?,
                None => break,
            }
        }
        Ok(())
    }

    /// Takes running row `i` out of the batch: its state to host memory, its blocks and slot
    /// back to the pool.
    fn preempt(&mut self, i: usize) -> strata_model::Result<()> {
        let rope_offset = self.runner.batch().expect("a row runs").rope_offsets[i];
        let (parts, position) = self.runner.preempt(i, self.rows.len())?;
        let row = self.rows.remove(i);
        self.preempted.push_front(Preempted { row, parts, position, rope_offset });
        self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Moves the front job's SSD read along: asks for it, or takes its answer (waiting for it
    /// with `block`). Says whether the read is done. Without an SSD tier there is nothing to read.
    fn poll_fetch(&mut self, block: bool) -> bool {
        let Some(queued) = self.waiting.front_mut() else { return false };
        let Some(prefetch) = &mut self.prefetch else {
            queued.fetch = Fetch::Ready(None);
            return true;
        };
        match queued.fetch {
            Fetch::Ready(_) => return true,
            Fetch::Unasked => queued.fetch = prefetch.ask(&queued.job, self.cache.checkpoint_namespace(&queued.job)),
            Fetch::Pending(id) => {
                if let Some(snap) = prefetch.take(id, block, &self.cache.stats) {
                    queued.fetch = Fetch::Ready(snap);
                }
            }
        }
        matches!(queued.fetch, Fetch::Ready(_))
    }

    /// Continues a generation from its checkpoint: the output so far is replayed to the
    /// requester and the row joins the batch (a seeded sampler draws on from the output's
    /// length, as it would have).
    fn resume(&mut self, job: Job, snap: Snapshot, reserved: usize) -> strata_model::Result<()> {
        let resume = snap.resume.expect("checked by the caller");
        self.cache.stats.checkpoint_resumes.fetch_add(1, Ordering::Relaxed);
        let mut context = snap.tokens;
        context.push(resume.next_token);
        let mut row = Row {
            sampler: Sampler::new(job.opts.sampling.clone()),
            generated: context[resume.prompt_len..].to_vec(),
            context,
            reserved,
            checkpoints: self.cache.checkpoint_namespace(&job),
            checkpointed: 0,
            rounds: 0,
            draft_len: self.runner.max_draft(),
            drafted: 0,
            accepted: 0,
            prefill_time: Duration::ZERO,
            decode_start: Instant::now(),
            constraint: job.opts.grammar.as_deref().map(Constraint::new),
            job,
        };
        row.job.sink.send(Event::Started { cached_tokens: resume.prompt_len });
        if let Step::Done(reason) = apply::replay(&mut row) {
            apply::finish(self.stats, row, reason);
            return Ok(());
        }
        row.checkpointed = row.generated.len();
        // No prefill: the MTP head's history starts empty.
        self.join_batch(row, snap.state, JoinerDraft::default())
    }

    /// Moves a row whose state is in place into the running batch (and the draft model's).
    fn join_batch(&mut self, row: Row, state: BatchState, draft: JoinerDraft) -> strata_model::Result<()> {
        self.runner.join(&row.context, state, draft, self.policy.prefill_chunk)?;
        self.rows.push(row);
        Ok(())
    }

    /// The joiner `i`'s next chunk as the policy plans it.
    fn planned_chunk(&self, i: usize) -> Chunk {
        let snapshots = apply::caching(self.cache).then_some(self.cache.config.stride);
        let j = &self.joiners[i];
        self.policy.chunk(&Prompt { fed: j.fed, len: j.job.prompt.len(), cache_points: &j.job.cache_points, snapshots })
    }

    /// The prompts' chunks this step carries beside the running rows' decode positions (the
    /// policy's cohort): each joiner with its chunk.
    fn plan_prompts(&mut self) -> Vec<(usize, Chunk)> {
        let width = 1 + self.runner.max_draft();
        let (decode_positions, decode_blocks) = match self.runner.batch() {
            Some(_) => (self.rows.len() * width, self.runner.blocks_to_grow(width)),
            None => (0, 0),
        };
        // A state outside the pool would be copied in by the merge, taking blocks no check
        // counted: such a job prefills only as the oldest, in a segment of its own.
        let candidates: Vec<usize> = (0..self.joiners.len()).filter(|&i| i == 0 || self.joiners[i].state.is_pooled()).collect();
        let chunks: Vec<Chunk> = candidates.iter().map(|&i| self.planned_chunk(i)).collect();
        let lens: Vec<usize> = candidates.iter().zip(&chunks).map(|(&i, c)| c.end - self.joiners[i].fed).collect();
        let members = self.policy.cohort(decode_positions, &lens);
        let grow = members.iter().map(|&k| self.joiners[candidates[k]].state.blocks_to_grow(lens[k])).sum();
        let (load, cache) = (self.load(), self.cache);
        if members.is_empty() || !self.policy.chunk_runs(&load, grow, decode_blocks, &mut self.runner.blocks(cache)) {
            return Vec::new();
        }
        members.into_iter().map(|k| (candidates[k], chunks[k])).collect()
    }

    /// One forward for the running rows (after room is made for their step) and the prompts'
    /// chunks that fit beside them; then each row is verified and sampled, and each prompt that
    /// is done samples its first token and joins the batch.
    fn forward_step(&mut self) -> strata_model::Result<()> {
        let started = Instant::now();
        if self.runner.batch().is_some() {
            self.room_for_step(1 + self.runner.max_draft())?;
        }
        let plan = self.plan_prompts();
        let decoding = self.runner.batch().is_some();
        if !decoding && plan.is_empty() {
            return Ok(());
        }
        // Chunks are whole: each feeds from where its joiner stands to the chunk's end.
        let lens: Vec<usize> = plan.iter().map(|&(i, chunk)| chunk.end - self.joiners[i].fed).collect();
        let mut feeds: Vec<Feed> = Vec::with_capacity(plan.len());
        let mut member = plan.iter().map(|&(i, _)| i).peekable();
        for (i, j) in self.joiners.iter_mut().enumerate() {
            if member.next_if_eq(&i).is_some() {
                let state = std::mem::take(&mut j.state);
                feeds.push(Feed { prompt: &j.job.prompt, fed: j.fed, state, draft: &mut j.draft, images: j.images.as_ref() });
            }
        }
        let rows: &mut [Row] = if decoding { &mut self.rows } else { &mut [] };
        let stepped = self.runner.step(rows, self.stats, &mut feeds, &lens)?;
        let states: Vec<BatchState> = feeds.into_iter().map(|f| f.state).collect();
        for (&(i, _), state) in plan.iter().zip(states) {
            self.joiners[i].state = state;
        }
        if stepped.prefilled.is_some() {
            self.stats.prefill_ns.fetch_add(stepped.elapsed.as_nanos() as u64, Ordering::Relaxed);
        }
        if let Some(decoded) = stepped.decoded {
            if stepped.prefilled.is_some() {
                self.stats.mixed_steps.fetch_add(1, Ordering::Relaxed);
            }
            self.stats.decode_forward_ns.fetch_add(stepped.elapsed.as_nanos() as u64, Ordering::Relaxed);
            self.decoded(decoded)?;
            self.stats.decode_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        match stepped.prefilled {
            Some(logits) => self.prefilled(&plan, logits),
            None => Ok(()),
        }
    }

    /// After a forward fed each joiner of `plan` its chunk, with `logits` their last
    /// positions': snapshots where due, and each joiner whose prompt is done samples its first
    /// token and joins the batch.
    fn prefilled(&mut self, plan: &[(usize, Chunk)], logits: Tensor) -> strata_model::Result<()> {
        let cache = self.cache;
        self.stats.prefill_forwards.fetch_add(1, Ordering::Relaxed);
        self.stats.prefill_chunks.fetch_add(plan.len() as u64, Ordering::Relaxed);
        let mut done = Vec::new();
        for (k, &(i, chunk)) in plan.iter().enumerate() {
            let joiner = &mut self.joiners[i];
            joiner.fed = chunk.end;
            if joiner.fed == joiner.job.prompt.len() {
                done.push((i, k));
            } else if chunk.snapshot {
                if let Some(state) = cache.copied("a prefill snapshot", joiner.state.share(0)) {
                    let tokens = joiner.job.cache_tokens()[..joiner.fed].to_vec();
                    apply::publish(cache, Snapshot { namespace: PROMPT_NAMESPACE, tokens, state, resume: None });
                }
            }
        }
        if done.is_empty() {
            return Ok(());
        }
        // Only the finished jobs' logits cross to the host.
        let rows: Vec<u32> = done.iter().map(|&(_, k)| k as u32).collect();
        let firsts = logits.index_select(&Tensor::new(rows, logits.device())?, 0)?.to_vec2::<f32>()?;
        let finished: Vec<Joiner> = done.iter().rev().map(|&(i, _)| self.joiners.remove(i)).collect();
        for (j, first) in finished.into_iter().rev().zip(firsts) {
            self.first_token(j, first)?;
        }
        Ok(())
    }

    /// Joiners whose requester went away leave; an empty prompt fails.
    fn drop_gone_joiners(&mut self) {
        let stats = self.stats;
        self.joiners.retain_mut(|j| {
            if j.job.sink.is_closed() {
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            if j.job.prompt.is_empty() {
                j.job.sink.send(Event::Failed("the prompt is empty".into()));
                return false;
            }
            true
        });
    }

    /// A joiner whose prompt is done: its first token from the last position's `logits`, then
    /// it joins the batch (or finishes, publishing its prompt's state).
    fn first_token(&mut self, j: Joiner, logits: Vec<f32>) -> strata_model::Result<()> {
        let (caching, cache) = (apply::caching(self.cache), self.cache);
        let mut row = Row {
            sampler: Sampler::new(j.job.opts.sampling.clone()),
            context: j.job.prompt.clone(),
            generated: Vec::new(),
            reserved: j.reserved,
            checkpoints: cache.checkpoint_namespace(&j.job),
            checkpointed: 0,
            rounds: 0,
            draft_len: self.runner.max_draft(),
            drafted: 0,
            accepted: 0,
            prefill_time: j.started.elapsed(),
            decode_start: Instant::now(),
            constraint: j.job.opts.grammar.as_deref().map(Constraint::new),
            job: j.job,
        };
        match apply::first_token(self.stats, &mut row, logits) {
            Step::Done(reason) => {
                if let Some(state) = caching.then(|| cache.copied("a prompt snapshot", j.state.share(0))).flatten() {
                    let tokens = row.job.cache_tokens().to_vec();
                    apply::publish(cache, Snapshot { namespace: PROMPT_NAMESPACE, tokens, state, resume: None });
                }
                apply::finish(self.stats, row, reason)
            }
            Step::Continue => self.join_batch(row, j.state, j.draft)?,
        }
        Ok(())
    }

    /// The running rows' part of a step, after its forward: per-row verification and
    /// sampling; checkpoints are taken, and finished rows publish their state and leave. With
    /// speculation each row's drafts rode in the forward, each position is verified in order,
    /// and the state keeps exactly the positions whose tokens stand.
    fn decoded(&mut self, decoded: Decoded) -> strata_model::Result<()> {
        let max_draft = self.runner.max_draft();
        self.stats.decode_steps.fetch_add(1, Ordering::Relaxed);
        let mut kept = Vec::with_capacity(self.rows.len());
        let mut keep = Vec::with_capacity(self.rows.len());
        let mut done = Vec::new();
        let outputs = decoded.scores.iter().zip(&decoded.masks).zip(&decoded.drafts);
        for (i, (row, ((scores, masks), drafts))) in self.rows.iter_mut().zip(outputs).enumerate() {
            let (positions, step) = apply::verify_row(self.stats, row, scores, masks, drafts, max_draft);
            kept.push(positions);
            match step {
                Step::Continue => keep.push(i),
                Step::Done(reason) => done.push((i, reason)),
            }
        }
        self.runner.settle(decoded, &kept)?;
        let batch = self.runner.batch().expect("a row runs");
        apply::checkpoint(self.cache, &mut self.rows, &keep, batch);
        if done.is_empty() {
            return Ok(());
        }
        let mut published = Vec::new();
        if apply::caching(self.cache) {
            for &(i, _) in &done {
                let covered = batch.positions[i];
                let tokens = self.rows[i].cache_tokens(covered);
                if let Some(state) = self.cache.copied("a finished row's state", batch.share(i)) {
                    published.push(Snapshot { namespace: PROMPT_NAMESPACE, tokens, state, resume: None });
                }
            }
        }
        published.into_iter().for_each(|snap| apply::publish(self.cache, snap));
        let mut rows: Vec<Option<Row>> = std::mem::take(&mut self.rows).into_iter().map(Some).collect();
        for (i, reason) in done {
            let row = rows[i].take().expect("each row finishes once");
            apply::finish(self.stats, row, reason);
        }
        self.rows = rows.into_iter().flatten().collect();
        self.runner.filter(&keep)
    }

    /// A forward failed: the batch state can no longer be trusted, so every job in flight fails.
    fn fail_all(&mut self, message: &str) {
        for mut row in self.rows.drain(..) {
            row.job.sink.send(Event::Failed(message.to_string()));
        }
        for mut j in self.joiners.drain(..) {
            j.job.sink.send(Event::Failed(message.to_string()));
        }
        self.runner.clear();
    }
}
