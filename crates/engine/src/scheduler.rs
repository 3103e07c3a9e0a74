//! The engine thread: continuous batching over one model, with the prompt cache.
//!
//! Each step it admits waiting jobs (first come, first admitted, while the batch has room, the
//! pool has free KV blocks for the prompt, and a `--state-budget-bytes` cap, where set, covers
//! the job's whole prompt + output), feeds one prefill chunk of the oldest joiner, then runs
//! one batched decode forward for every running row — each row at its own position — and
//! samples each row with its own parameters. A long prompt therefore holds the running streams
//! up for at most one chunk per step. A finished row (end token, length, or a requester that
//! went away) leaves the batch without disturbing the others.
//!
//! When the pool runs short of blocks for a decode step, the prompt cache gives up entries
//! first, then the prefilling job starts over, then the youngest running rows are preempted:
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

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use strata_model::{Logits, Model};
use strata_state::{BatchState, StateCost, StatePool};

use crate::cache::{usable_prefix, Resume, Snapshot, PROMPT_NAMESPACE};
use crate::generate::{with_logprobs, FinishReason, Generation, Sampled};
use crate::sampler::Sampler;
use crate::speculative::{Drafter, JoinerDraft};
use crate::worker::{release_waiting, EngineConfig, Event, Fetch, Job, Prefetcher, Queued, SharedCache, WorkerStats};
use strata_kernels::matmul::MAX_EXACT_ROWS;
use strata_kernels::sampling::argmax_rows;

/// A running row: one sequence of the batch.
struct Row {
    job: Job,
    sampler: Sampler,
    context: Vec<u32>,
    generated: Vec<u32>,
    reserved: usize,
    /// Where this row's generation checkpoints go, when it takes them.
    checkpoints: Option<u64>,
    /// Output length at the last checkpoint.
    checkpointed: usize,
    /// Speculation: tokens drafted for this row, and how many of them were accepted.
    rounds: usize,
    drafted: usize,
    accepted: usize,
    /// Tokens to draft for this row next step: grows while drafts are all accepted, falls to
    /// just past what was accepted when one fails, so a poor draft source costs little.
    draft_len: usize,
    prefill_time: Duration,
    decode_start: Instant,
}

impl Row {
    /// Whether this row's next token needs its logits on the host (to sample, bias, penalise
    /// or report log-probabilities) rather than only their argmax.
    fn needs_logits(&self) -> bool {
        !self.sampler.is_plain_argmax() || self.job.opts.logprobs.is_some()
    }
}

/// What a decode step hands the sampler for one position of one row: its logits, or only their
/// argmax when every row of the step would take the argmax as it is (greedy, nothing that reads
/// the logits) — then it is computed where the logits are, and on a GPU only the token ids
/// cross to the host.
enum Scores {
    Logits(Vec<f32>),
    Argmax(u32),
}

impl Scores {
    /// Per row, per position, from a step's f32 logits `[B, vocab]` or `[B, width, vocab]`.
    fn of_step(logits: &Tensor, rows: &[Row]) -> strata_model::Result<Vec<Vec<Scores>>> {
        let (b, width) = (logits.dim(0)?, if logits.rank() == 3 { logits.dim(1)? } else { 1 });
        if rows.iter().any(Row::needs_logits) {
            let rows = logits.reshape((b, width, ()))?.to_vec3::<f32>()?;
            return Ok(rows.into_iter().map(|row| row.into_iter().map(Scores::Logits).collect()).collect());
        }
        let ids = argmax_rows(&logits.reshape((b * width, ()))?)?;
        Ok(ids.chunks(width).map(|row| row.iter().map(|&id| Scores::Argmax(id)).collect()).collect())
    }
}

/// A running row taken out of the batch when the pool ran short of KV blocks: its state as
/// host tensors named as [`BatchState::parts`] names them, at `position`.
struct Preempted {
    row: Row,
    parts: Vec<(String, Tensor)>,
    position: usize,
}

/// The job being prefilled, in its own single-row state until it joins the batch.
struct Joiner {
    job: Job,
    state: BatchState,
    /// What an MTP drafter's head read of the prompt so far.
    draft: JoinerDraft,
    fed: usize,
    reserved: usize,
    started: Instant,
}

pub(crate) struct Engine<'a> {
    model: Model,
    config: EngineConfig,
    cost: StateCost,
    stats: &'a WorkerStats,
    cache: &'a SharedCache,
    waiting: VecDeque<Queued>,
    joiner: Option<Joiner>,
    /// State of the running rows, in `rows` order.
    batch: Option<BatchState>,
    rows: Vec<Row>,
    /// Rows waiting to resume, the first to resume first.
    preempted: VecDeque<Preempted>,
    drafter: Option<Drafter>,
    /// Reads SSD state for the job at the front of `waiting` (with an SSD tier).
    prefetch: Option<Prefetcher>,
    /// Where the rows' state lives (see [`EngineConfig`]).
    pool: StatePool,
}

/// How a row's step ended.
enum Step {
    Continue,
    Done(FinishReason),
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
        let (waiting, joiner, batch, rows, preempted) = (VecDeque::new(), None, None, Vec::new(), VecDeque::new());
        Self { model, config, cost, stats, cache, waiting, joiner, batch, rows, preempted, drafter, prefetch, pool }
    }

    /// Fresh state for `rows` sequences, in the pool.
    fn new_state(&self, rows: usize) -> strata_model::Result<BatchState> {
        Ok(self.pool.new_state(rows)?)
    }

    /// A copy of `state` in the pool.
    fn into_pool(&self, state: &BatchState) -> strata_state::Result<BatchState> {
        let mut pooled = self.pool.new_state(0)?;
        pooled.merge(state)?;
        Ok(pooled)
    }

    pub fn run(mut self, queue: mpsc::Receiver<Queued>) {
        loop {
            let idle = self.rows.is_empty() && self.joiner.is_none() && self.preempted.is_empty();
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
        rows.map(|r| r.reserved).sum::<usize>() + self.joiner.as_ref().map_or(0, |j| j.reserved)
    }

    /// Admission, one prefill chunk, one decode step.
    fn step(&mut self) -> strata_model::Result<()> {
        self.admit()?;
        self.prefill_chunk()?;
        self.decode()?;
        let active = self.rows.len() + self.preempted.len() + self.joiner.is_some() as usize;
        self.stats.active.store(active, Ordering::Relaxed);
        self.stats.state_bytes_reserved.store(self.reserved(), Ordering::Relaxed);
        let graphs = self.model.decode_graph_stats();
        self.stats.graph_recordings.store(graphs.recordings, Ordering::Relaxed);
        self.stats.graph_replays.store(graphs.replays, Ordering::Relaxed);
        self.stats.graph_prepare_ns.store(graphs.prepare_ns, Ordering::Relaxed);
        self.stats.graph_replay_gpu_ns.store(graphs.replay_gpu_ns, Ordering::Relaxed);
        Ok(())
    }

    /// Starts the oldest waiting job when the batch has room, the budget covers it and its SSD
    /// read is done. Strictly in arrival order: a job never overtakes an older one, so none
    /// starves. The read is asked for once the job fits the budget, even while the batch is
    /// full or another job prefills, so that it overlaps their work; the restored state then
    /// waits within the budget, and no other job's does.
    fn admit(&mut self) -> strata_model::Result<()> {
        self.resume_preempted()?;
        if !self.preempted.is_empty() {
            return Ok(());
        }
        loop {
            let Some(queued) = self.waiting.front() else { return Ok(()) };
            let job = &queued.job;
            if job.sink.is_closed() {
                if let Some(Queued { fetch: Fetch::Ready(snap), .. }) = self.waiting.pop_front() {
                    release_waiting(&self.cache.stats, snap.as_ref());
                }
                self.stats.queued.fetch_sub(1, Ordering::Relaxed);
                self.stats.requests.fetch_add(1, Ordering::Relaxed);
                self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let prompt_len = job.prompt.len();
            let need = self.cost.bytes(prompt_len + job.opts.max_tokens).expect("submit() checked the job's state size");
            if self.reserved().checked_add(need).is_none_or(|total| total > self.config.state_budget_bytes) {
                return Ok(());
            }
            if !self.poll_fetch(false) || self.joiner.is_some() || self.rows.len() >= self.config.max_batch {
                return Ok(());
            }
            if !self.has_room(prompt_len) {
                return Ok(());
            }
            let Some(Queued { job, fetch: Fetch::Ready(restored) }) = self.waiting.pop_front() else {
                unreachable!("poll_fetch said the front job's read is done")
            };
            release_waiting(&self.cache.stats, restored.as_ref());
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            self.stats.prompt_tokens.fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
            match restored {
                Some(snap) if snap.resume.is_some_and(|r| r.prompt_len == job.prompt.len()) => self.resume(job, snap, need)?,
                restored => {
                    let (state, cached) = self.restore_prompt(&job.prompt, restored)?;
                    let mut job = job;
                    job.sink.send(Event::Started { cached_tokens: cached });
                    self.joiner = Some(Joiner {
                        job,
                        state,
                        draft: JoinerDraft::default(),
                        fed: cached,
                        reserved: need,
                        started: Instant::now(),
                    });
                }
            }
        }
    }

    /// Whether the pool's free blocks — after the prompt cache gives up what it must — hold
    /// `tokens` positions of one more row besides a block for each running row's next step.
    fn has_room(&self, tokens: usize) -> bool {
        let need = tokens.div_ceil(self.pool.block_size()) + 1 + self.rows.len();
        make_room(&self.pool, self.cache, need);
        self.pool.blocks_free().is_none_or(|free| free >= need)
    }

    /// Brings preempted rows back into the batch, the first preempted first, while it and the
    /// pool have room for them.
    fn resume_preempted(&mut self) -> strata_model::Result<()> {
        while let Some(front) = self.preempted.front() {
            if front.row.job.sink.is_closed() {
                let gone = self.preempted.pop_front().expect("checked above");
                self.finish(gone.row, FinishReason::Cancelled);
                continue;
            }
            let batch_full = self.rows.len() + self.joiner.is_some() as usize >= self.config.max_batch;
            if batch_full || !self.has_room(front.position) {
                return Ok(());
            }
            let Preempted { row, parts, position } = self.preempted.pop_front().expect("checked above");
            let device = self.model.device().clone();
            let state = BatchState::from_parts(&self.new_state(0)?, position, |name| {
                let (_, part) = parts.iter().find(|(n, _)| n == name).expect("parts() named every part from_parts asks for");
                Ok(part.to_device(&device)?)
            })?;
            // The draft model reads the context again, as after a checkpoint's resume.
            self.join_batch(row, state, JoinerDraft::default())?;
        }
        Ok(())
    }

    /// Frees pool blocks for a decode step of `width` positions per row: the prompt cache gives
    /// up entries first, then the prefilling job starts over (its prompt is fed again later),
    /// then the youngest rows are preempted, until the step fits. One row always fits alone:
    /// admission checked that its longest state fits the pool.
    fn room_for_step(&mut self, width: usize) -> strata_model::Result<()> {
        loop {
            let Some(batch) = &self.batch else { return Ok(()) };
            let need = batch.blocks_to_grow(width);
            make_room(&self.pool, self.cache, need);
            if self.pool.blocks_free().is_none_or(|free| free >= need) {
                return Ok(());
            }
            if let Some(mut joiner) = self.joiner.take_if(|j| j.fed > 0) {
                joiner.state.filter(&[])?; // its blocks and slot back to the pool first
                (joiner.state, joiner.fed, joiner.draft) = (self.new_state(1)?, 0, JoinerDraft::default());
                self.joiner = Some(joiner);
                continue;
            }
            if self.rows.len() == 1 {
                return Ok(());
            }
            self.preempt(self.rows.len() - 1)?;
        }
    }

    /// Takes running row `i` out of the batch: its state to host memory, its blocks and slot
    /// back to the pool.
    fn preempt(&mut self, i: usize) -> strata_model::Result<()> {
        let batch = self.batch.as_mut().expect("a row runs");
        let position = batch.positions[i];
        let parts = batch.extract(i)?.parts()?;
        let parts =
            parts.into_iter().map(|(name, t)| Ok((name, t.to_device(&Device::Cpu)?))).collect::<strata_model::Result<_>>()?;
        let keep: Vec<usize> = (0..self.rows.len()).filter(|&r| r != i).collect();
        batch.filter(&keep)?;
        if let Some(drafter) = &mut self.drafter {
            drafter.filter(&keep)?;
        }
        let row = self.rows.remove(i);
        self.preempted.push_front(Preempted { row, parts, position });
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
            Fetch::Unasked => {
                queued.fetch = prefetch.ask(&queued.job, self.cache.checkpoint_namespace(&queued.job.prompt, &queued.job.opts))
            }
            Fetch::Pending(id) => {
                if let Some(snap) = prefetch.take(id, block, &self.cache.stats) {
                    queued.fetch = Fetch::Ready(snap);
                }
            }
        }
        matches!(queued.fetch, Fetch::Ready(_))
    }

    /// The state to prefill `prompt` from: a copy of the longest usable cached prefix (the SSD
    /// entry read ahead, or the RAM tier's best), else a fresh state. At least the last prompt
    /// token is always computed, since its logits choose the first output token. A copy that
    /// fails is a miss.
    fn restore_prompt(&self, prompt: &[u32], from_ssd: Option<Snapshot>) -> strata_model::Result<(BatchState, usize)> {
        let limit = prompt.len().saturating_sub(1);
        let score = |tokens: &[u32], trim: bool| usable_prefix(tokens, trim, prompt, limit);
        let stats = &self.cache.stats;
        let mut ram = self.cache.ram();
        let ssd = from_ssd.map(|snap| (score(&snap.tokens, snap.can_trim()), snap)).filter(|(usable, _)| *usable > 0);
        let restored = match ssd {
            Some((usable, snap)) if usable > ram.best(PROMPT_NAMESPACE, score) => {
                // Into the pool once: the request starts from the copy, and the RAM tier's entry
                // shares its KV blocks.
                let copy = self.into_pool(&snap.state).and_then(|mut state| {
                    let entry = state.share(0)?;
                    if usable < snap.tokens.len() {
                        state.trim(0, usable)?;
                    }
                    Ok((state, entry))
                });
                let restored = self.cache.copied("an SSD entry", copy).map(|(state, entry)| {
                    stats.ssd_hits.fetch_add(1, Ordering::Relaxed);
                    ram.insert(Snapshot { state: entry, ..snap.clone() });
                    (state, usable)
                });
                if restored.is_none() {
                    ram.insert(snap);
                }
                restored
            }
            _ => self.cache.copied("a RAM entry", ram.restore(PROMPT_NAMESPACE, score)).flatten().map(|r| {
                stats.ram_hits.fetch_add(1, Ordering::Relaxed);
                (r.state, r.tokens)
            }),
        };
        Ok(match restored {
            Some((state, tokens)) => {
                stats.hit_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
                (state, tokens)
            }
            None => {
                stats.misses.fetch_add(1, Ordering::Relaxed);
                (self.new_state(1)?, 0)
            }
        })
    }

    /// Continues a generation from its checkpoint: the output so far is replayed to the
    /// requester, the sampler is wound to where it was, and the row joins the batch.
    fn resume(&mut self, job: Job, snap: Snapshot, reserved: usize) -> strata_model::Result<()> {
        let resume = snap.resume.expect("checked by the caller");
        self.cache.stats.checkpoint_resumes.fetch_add(1, Ordering::Relaxed);
        let mut context = snap.tokens;
        context.push(resume.next_token);
        let mut row = Row {
            sampler: Sampler::resumed(job.opts.sampling.clone(), resume.sampler_draws),
            generated: context[resume.prompt_len..].to_vec(),
            context,
            reserved,
            checkpoints: self.cache.checkpoint_namespace(&job.prompt, &job.opts),
            checkpointed: 0,
            rounds: 0,
            draft_len: self.drafter.as_ref().map_or(0, |d| d.tokens),
            drafted: 0,
            accepted: 0,
            prefill_time: Duration::ZERO,
            decode_start: Instant::now(),
            job,
        };
        row.job.sink.send(Event::Started { cached_tokens: resume.prompt_len });
        for &id in &row.generated {
            if !row.job.sink.send(Event::Token(Sampled { id, logprob: None, top_logprobs: Vec::new() })) {
                self.finish(row, FinishReason::Cancelled);
                return Ok(());
            }
        }
        if row.generated.len() >= row.job.opts.max_tokens {
            self.finish(row, FinishReason::Length);
            return Ok(());
        }
        row.checkpointed = row.generated.len();
        // No prefill: the MTP head's history starts empty.
        self.join_batch(row, snap.state, JoinerDraft::default())
    }

    /// Moves a row whose state is in place into the running batch (and the draft model's).
    fn join_batch(&mut self, row: Row, state: BatchState, draft: JoinerDraft) -> strata_model::Result<()> {
        if let Some(drafter) = &mut self.drafter {
            drafter.join(&row.context[..row.context.len() - 1], self.config.prefill_chunk, draft)?;
        }
        match &mut self.batch {
            Some(batch) => batch.merge(&state)?,
            // A restored state owns its tensors: the batch starts in the pool and copies it in.
            None if !self.pool.holds(&state) => {
                let mut batch = self.new_state(0)?;
                batch.merge(&state)?;
                self.batch = Some(batch);
            }
            None => self.batch = Some(state),
        }
        self.rows.push(row);
        Ok(())
    }

    fn caching(&self) -> bool {
        self.cache.config.ram_bytes > 0 || self.cache.writer.is_some()
    }

    /// Hands a snapshot (of [`BatchState::share`]) to the RAM tier, and a copy of its own to
    /// the SSD write queue: the writer thread never touches the pool.
    fn publish(&self, snap: Snapshot) {
        if let Some(writer) = &self.cache.writer {
            if let Some(state) = self.cache.copied("a snapshot for the SSD tier", snap.state.extract(0)) {
                writer.enqueue(Snapshot { state, ..snap.clone() });
            }
        }
        if self.cache.config.ram_bytes > 0 {
            self.cache.ram().insert(snap);
        }
    }

    /// Feeds the joiner one chunk; when its prompt is done, samples its first token and moves
    /// its state into the batch.
    fn prefill_chunk(&mut self) -> strata_model::Result<()> {
        let (caching, cache) = (self.caching(), self.cache);
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
        let len = prompt.len();
        let mut end = (joiner.fed + self.config.prefill_chunk.max(1)).min(len);
        // Chunks end where snapshots are due (without a cache, chunking is left alone).
        let stride = if caching { self.cache.config.stride } else { 0 };
        let fed = joiner.fed;
        let next_point = joiner.job.cache_points.iter().copied().filter(|&p| p > fed && p < len).min();
        if caching && fed + 1 < len {
            end = end.min(len - 1).min(next_point.unwrap_or(len));
        }
        if stride > 0 {
            end = end.min((fed / stride + 1) * stride);
        }
        // The running rows come first: a block each stays free for their next step, and the
        // chunk waits while that would not leave it room.
        let need = joiner.state.blocks_to_grow(end - joiner.fed) + self.rows.len();
        make_room(&self.pool, cache, need);
        if !self.rows.is_empty() && self.pool.blocks_free().is_some_and(|free| free < need) {
            return Ok(());
        }
        let input = Tensor::new(&prompt[joiner.fed..end], self.model.device())?.unsqueeze(0)?;
        let hidden = self.drafter.as_ref().is_some_and(Drafter::wants_hidden);
        let (logits, hidden) = forward(&self.model, &input, &mut joiner.state, Logits::Last, hidden)?;
        if let (Some(drafter), Some(hidden)) = (&self.drafter, hidden) {
            drafter.prefilled(&mut joiner.draft, prompt, joiner.fed, &hidden.squeeze(0)?)?;
        }
        joiner.fed = end;
        self.stats.prefill_chunks.fetch_add(1, Ordering::Relaxed);
        if end < len {
            let point = end + 1 == len || (stride > 0 && end % stride == 0) || next_point == Some(end);
            let copy = (caching && point).then(|| cache.copied("a prefill snapshot", joiner.state.share(0))).flatten();
            if let Some(state) = copy {
                let snap = Snapshot { namespace: PROMPT_NAMESPACE, tokens: prompt[..end].to_vec(), state, resume: None };
                self.publish(snap);
            }
            return Ok(());
        }
        let j = self.joiner.take().expect("checked above");
        let mut row = Row {
            sampler: Sampler::new(j.job.opts.sampling.clone()),
            context: j.job.prompt.clone(),
            generated: Vec::new(),
            reserved: j.reserved,
            checkpoints: self.cache.checkpoint_namespace(&j.job.prompt, &j.job.opts),
            checkpointed: 0,
            rounds: 0,
            draft_len: self.drafter.as_ref().map_or(0, |d| d.tokens),
            drafted: 0,
            accepted: 0,
            prefill_time: j.started.elapsed(),
            decode_start: Instant::now(),
            job: j.job,
        };
        let logits = Scores::Logits(logits.squeeze(0)?.to_vec1::<f32>()?);
        match Self::sample_and_send(self.stats, &mut row, &logits) {
            Step::Done(reason) => {
                if let Some(state) = caching.then(|| cache.copied("a prompt snapshot", j.state.share(0))).flatten() {
                    self.publish(Snapshot { namespace: PROMPT_NAMESPACE, tokens: row.job.prompt.clone(), state, resume: None });
                }
                self.finish(row, reason)
            }
            Step::Continue => self.join_batch(row, j.state, j.draft)?,
        }
        Ok(())
    }

    /// One forward for every running row, then per-row sampling; checkpoints are taken, and
    /// finished rows publish their state and leave. With speculation, each row's drafts ride in
    /// the same forward (`[last, d1..dk]`), each position is verified in order, and the state
    /// keeps exactly the positions whose tokens stand.
    fn decode(&mut self) -> strata_model::Result<()> {
        if self.batch.is_none() {
            return Ok(());
        }
        let started = Instant::now();
        let result = self.decode_step();
        self.stats.decode_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        result
    }

    /// [`Self::decode`]'s work, which it times.
    fn decode_step(&mut self) -> strata_model::Result<()> {
        self.room_for_step(1 + self.drafter.as_ref().map_or(0, |d| d.tokens))?;
        let Some(batch) = self.batch.as_mut() else { return Ok(()) };
        let drafts = match &mut self.drafter {
            Some(drafter) => {
                let contexts: Vec<&[u32]> = self.rows.iter().map(|r| r.context.as_slice()).collect();
                // No point drafting past a row's budget (the last token it may emit is
                // verified), and the verify forward stays within the rows the kernels compute
                // exactly (each position as if alone).
                let width_cap = (MAX_EXACT_ROWS / self.rows.len()).saturating_sub(1);
                let limits: Vec<usize> = self
                    .rows
                    .iter()
                    .map(|r| r.job.opts.max_tokens.saturating_sub(r.generated.len() + 1).min(width_cap).min(r.draft_len))
                    .collect();
                drafter.propose(&contexts, &limits)?
            }
            None => vec![Vec::new(); self.rows.len()],
        };
        let width = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
        let input: Vec<Vec<u32>> = self
            .rows
            .iter()
            .zip(&drafts)
            .map(|(r, d)| {
                let last = *r.context.last().expect("a running row has a token");
                let mut fed = vec![last];
                fed.extend(d);
                fed.resize(width, last); // padding past a short draft is never kept
                fed
            })
            .collect();
        let round = if width > 1 { Some(self.model.open_round(batch)?) } else { None };
        let which = if width > 1 { Logits::All } else { Logits::Last };
        let hidden = self.drafter.as_ref().is_some_and(Drafter::wants_hidden);
        let forward_started = Instant::now();
        let (logits, hidden) = forward(&self.model, &Tensor::new(input, self.model.device())?, batch, which, hidden)?;
        let logits = Scores::of_step(&logits, &self.rows)?;
        self.stats.decode_forward_ns.fetch_add(forward_started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.stats.decode_steps.fetch_add(1, Ordering::Relaxed);
        let mut kept = Vec::with_capacity(self.rows.len());
        let mut keep = Vec::with_capacity(self.rows.len());
        let mut done = Vec::new();
        for (i, ((row, logits), drafts)) in self.rows.iter_mut().zip(&logits).zip(&drafts).enumerate() {
            let max_draft = self.drafter.as_ref().map_or(0, |d| d.tokens);
            let (positions, step) = Self::verify_row(self.stats, row, logits, drafts, max_draft);
            kept.push(positions);
            match step {
                Step::Continue => keep.push(i),
                Step::Done(reason) => done.push((i, reason)),
            }
        }
        if let Some(round) = round {
            self.model.close_round(self.batch.as_mut().expect("checked above"), round, &kept)?;
        }
        if let Some(drafter) = &mut self.drafter {
            drafter.settle(&kept, hidden.as_ref())?;
        }
        self.checkpoint(&keep);
        if done.is_empty() {
            return Ok(());
        }
        let batch = self.batch.as_ref().expect("checked above");
        let mut published = Vec::new();
        if self.caching() {
            for &(i, _) in &done {
                let covered = batch.positions[i];
                let tokens = self.rows[i].context[..covered].to_vec();
                if let Some(state) = self.cache.copied("a finished row's state", batch.share(i)) {
                    published.push(Snapshot { namespace: PROMPT_NAMESPACE, tokens, state, resume: None });
                }
            }
        }
        published.into_iter().for_each(|snap| self.publish(snap));
        let mut rows: Vec<Option<Row>> = std::mem::take(&mut self.rows).into_iter().map(Some).collect();
        for (i, reason) in done {
            let row = rows[i].take().expect("each row finishes once");
            self.finish(row, reason);
        }
        self.rows = rows.into_iter().flatten().collect();
        if let Some(drafter) = &mut self.drafter {
            drafter.filter(&keep)?;
        }
        if keep.is_empty() {
            self.batch = None;
        } else {
            self.batch.as_mut().expect("checked above").filter(&keep)?;
        }
        Ok(())
    }

    /// Walks a row's verified positions: position `j`'s logits follow `[last, d1..dj]`, so while
    /// drafts stand, the next position is valid too. Emits every token that stands (accepted
    /// drafts, then the target's own token where a draft failed or ran out) and returns how
    /// many fed positions the state keeps.
    fn verify_row(stats: &WorkerStats, row: &mut Row, logits: &[Scores], drafts: &[u32], max_draft: usize) -> (usize, Step) {
        row.rounds += !drafts.is_empty() as usize;
        row.drafted += drafts.len();
        for (j, logits) in logits.iter().enumerate() {
            // Drafts never exceed the row's budget, so a draft position always has room.
            let Some(&draft) = drafts.get(j) else {
                if !drafts.is_empty() {
                    row.draft_len = (row.draft_len + 1).min(max_draft);
                }
                return (j + 1, Self::sample_and_send(stats, row, logits));
            };
            let (token, accepted) = match logits {
                Scores::Logits(logits) => row.sampler.verify(logits, &row.context, &row.generated, draft),
                &Scores::Argmax(id) => (id, id == draft),
            };
            row.accepted += accepted as usize;
            let step = Self::send(stats, row, token, logits);
            if !accepted || matches!(step, Step::Done(_)) {
                if !accepted {
                    row.draft_len = (j + 1).min(max_draft);
                }
                return (j + 1, step);
            }
        }
        unreachable!("the walk ends at the position after the last draft")
    }

    /// Persists a checkpoint of every running row whose output grew `checkpoint_every` tokens
    /// since its last one.
    fn checkpoint(&mut self, running: &[usize]) {
        let (Some(writer), Some(batch)) = (&self.cache.writer, &self.batch) else { return };
        let every = self.cache.config.checkpoint_every;
        for &i in running {
            let row = &mut self.rows[i];
            let Some(namespace) = row.checkpoints.filter(|_| row.generated.len() >= row.checkpointed + every) else { continue };
            row.checkpointed = row.generated.len();
            let Some(state) = self.cache.copied("a generation checkpoint", batch.extract(i)) else { continue };
            let covered = row.context.len() - 1;
            let resume =
                Resume { prompt_len: row.job.prompt.len(), next_token: row.context[covered], sampler_draws: row.sampler.draws() };
            writer.enqueue(Snapshot { namespace, tokens: row.context[..covered].to_vec(), state, resume: Some(resume) });
        }
    }

    /// Samples the row's next token from `logits` and streams it; says whether the row goes on.
    fn sample_and_send(stats: &WorkerStats, row: &mut Row, logits: &Scores) -> Step {
        if row.generated.len() >= row.job.opts.max_tokens {
            return Step::Done(FinishReason::Length);
        }
        let next = match logits {
            Scores::Logits(logits) => row.sampler.sample(logits, &row.context, &row.generated),
            &Scores::Argmax(id) => id,
        };
        Self::send(stats, row, next, logits)
    }

    /// Streams a chosen token (an end token finishes the row instead).
    fn send(stats: &WorkerStats, row: &mut Row, next: u32, logits: &Scores) -> Step {
        let opts = &row.job.opts;
        if opts.stop_tokens.contains(&next) {
            return Step::Done(FinishReason::Stop);
        }
        row.generated.push(next);
        row.context.push(next);
        stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let sampled = match (opts.logprobs, logits) {
            (Some(top), Scores::Logits(logits)) => with_logprobs(logits, next, top),
            _ => Sampled { id: next, logprob: None, top_logprobs: Vec::new() },
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
        self.stats.draft_rounds.fetch_add(row.rounds as u64, Ordering::Relaxed);
        self.stats.drafted_tokens.fetch_add(row.drafted as u64, Ordering::Relaxed);
        self.stats.accepted_tokens.fetch_add(row.accepted as u64, Ordering::Relaxed);
        let generation = Generation {
            tokens: std::mem::take(&mut row.generated),
            finish: reason,
            draft_rounds: row.rounds,
            drafted_tokens: row.drafted,
            accepted_tokens: row.accepted,
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
        if let Some(drafter) = &mut self.drafter {
            drafter.clear();
        }
    }
}

/// Lets the prompt cache give up pool blocks until `blocks` are free (or it holds no more): its
/// entries share the pool with the running requests, which come first.
fn make_room(pool: &StatePool, cache: &SharedCache, blocks: usize) {
    let Some(mut free) = pool.blocks_free() else { return };
    if free >= blocks {
        return;
    }
    let mut ram = cache.ram();
    while free < blocks && ram.evict_oldest() {
        free = pool.blocks_free().unwrap_or(usize::MAX);
    }
}

/// The target's forward, also returning every position's hidden state when `hidden` (for an
/// MTP drafter).
fn forward(
    model: &Model,
    tokens: &Tensor,
    state: &mut BatchState,
    logits: Logits,
    hidden: bool,
) -> strata_model::Result<(Tensor, Option<Tensor>)> {
    if hidden {
        let (logits, hidden) = model.forward_with_hidden(tokens, state, logits)?;
        Ok((logits, Some(hidden)))
    } else {
        Ok((model.forward(tokens, state, logits)?, None))
    }
}
