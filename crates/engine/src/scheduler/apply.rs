//! Applying a forward's results: per-row sampling, events to the jobs' sinks, finished rows,
//! and the prompt cache's snapshots and checkpoints.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use strata_state::BatchState;

use crate::cache::{Resume, Snapshot};
use crate::generate::{with_logprobs, FinishReason, Generation, Sampled};
use crate::job::{Event, Job};
use crate::sampler::Sampler;
use crate::shared::{SharedCache, WorkerStats};
use crate::structured::{Constraint, Progress};
use strata_kernels::sampling::argmax_rows;

/// A running row: one sequence of the batch.
pub(super) struct Row {
    pub job: Job,
    pub sampler: Sampler,
    pub context: Vec<u32>,
    pub generated: Vec<u32>,
    pub reserved: usize,
    /// Where this row's generation checkpoints go, when it takes them.
    pub checkpoints: Option<u64>,
    /// Output length at the last checkpoint.
    pub checkpointed: usize,
    /// Speculation: tokens drafted for this row, and how many of them were accepted.
    pub rounds: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// Tokens to draft for this row next step: grows while drafts are all accepted, falls to
    /// just past what was accepted when one fails, so a poor draft source costs little.
    pub draft_len: usize,
    pub prefill_time: Duration,
    pub decode_start: Instant,
    /// Structured output: where the row stands in its grammar.
    pub constraint: Option<Constraint>,
}

impl Row {
    /// Whether this row's next token needs its logits on the host (to sample, bias, penalise
    /// or report log-probabilities) rather than only their argmax.
    fn needs_logits(&self) -> bool {
        !self.sampler.is_plain_argmax() || self.job.opts.logprobs.is_some() || self.constraint.is_some()
    }

    /// The logits the row may choose from (see [`Constraint::choosable`]); `None` (logged)
    /// when its structure allows nothing, which ends the row.
    fn choosable<'a>(&mut self, stats: &WorkerStats, logits: &'a [f32]) -> Option<std::borrow::Cow<'a, [f32]>> {
        let Some(constraint) = &mut self.constraint else { return Some(logits.into()) };
        let started = Instant::now();
        let choosable = constraint.choosable(logits, &self.job.opts.stop_tokens);
        stats.structured_mask_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        stats.structured_masks.fetch_add(1, Ordering::Relaxed);
        choosable.map_err(|e| tracing::warn!("structured output ends early: {e}")).ok()
    }
}

/// What a decode step hands the sampler for one position of one row: its logits, or only their
/// argmax when every row of the step would take the argmax as it is (greedy, nothing that reads
/// the logits) — then it is computed where the logits are, and on a GPU only the token ids
/// cross to the host.
pub(super) enum Scores {
    Logits(Vec<f32>),
    Argmax(u32),
}

impl Scores {
    /// Per row, per position, from a step's f32 logits `[B, vocab]` or `[B, width, vocab]`.
    pub fn of_step(logits: &Tensor, rows: &[Row]) -> strata_model::Result<Vec<Vec<Scores>>> {
        let (b, width) = (logits.dim(0)?, if logits.rank() == 3 { logits.dim(1)? } else { 1 });
        if rows.iter().any(Row::needs_logits) {
            let rows = logits.reshape((b, width, ()))?.to_vec3::<f32>()?;
            return Ok(rows.into_iter().map(|row| row.into_iter().map(Scores::Logits).collect()).collect());
        }
        let ids = argmax_rows(&logits.reshape((b * width, ()))?)?;
        Ok(ids.chunks(width).map(|row| row.iter().map(|&id| Scores::Argmax(id)).collect()).collect())
    }
}

/// How a row's step ended.
pub(super) enum Step {
    Continue,
    Done(FinishReason),
}

/// Walks a row's verified positions: position `j`'s logits follow `[last, d1..dj]`, so while
/// drafts stand, the next position is valid too. Emits every token that stands (accepted
/// drafts, then the target's own token where a draft failed or ran out) and returns how many
/// fed positions the state keeps.
pub(super) fn verify_row(
    stats: &WorkerStats,
    row: &mut Row,
    logits: &[Scores],
    drafts: &[u32],
    max_draft: usize,
) -> (usize, Step) {
    row.rounds += !drafts.is_empty() as usize;
    row.drafted += drafts.len();
    for (j, logits) in logits.iter().enumerate() {
        // Drafts never exceed the row's budget, so a draft position always has room.
        let Some(&draft) = drafts.get(j) else {
            if !drafts.is_empty() {
                row.draft_len = (row.draft_len + 1).min(max_draft);
            }
            return (j + 1, sample_and_send(stats, row, logits));
        };
        let (token, accepted) = match logits {
            Scores::Logits(logits) => {
                let Some(choosable) = row.choosable(stats, logits) else { return (j + 1, Step::Done(FinishReason::Stop)) };
                row.sampler.verify(&choosable, &row.context, &row.generated, draft)
            }
            &Scores::Argmax(id) => (id, id == draft),
        };
        row.accepted += accepted as usize;
        let step = send(stats, row, token, logits);
        if !accepted || matches!(step, Step::Done(_)) {
            if !accepted {
                row.draft_len = (j + 1).min(max_draft);
            }
            return (j + 1, step);
        }
    }
    unreachable!("the walk ends at the position after the last draft")
}

/// Samples the row's next token from `logits` and streams it; says whether the row goes on.
pub(super) fn sample_and_send(stats: &WorkerStats, row: &mut Row, logits: &Scores) -> Step {
    if row.generated.len() >= row.job.opts.max_tokens {
        return Step::Done(FinishReason::Length);
    }
    let next = match logits {
        Scores::Logits(logits) => {
            let Some(choosable) = row.choosable(stats, logits) else { return Step::Done(FinishReason::Stop) };
            row.sampler.sample(&choosable, &row.context, &row.generated)
        }
        &Scores::Argmax(id) => id,
    };
    send(stats, row, next, logits)
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
    if let Step::Done(reason) = follow_structure(row, next) {
        return Step::Done(reason);
    }
    if row.generated.len() >= row.job.opts.max_tokens {
        return Step::Done(FinishReason::Length);
    }
    Step::Continue
}

/// Feeds a token that stands to the row's structure, if it has one: a complete structure ends
/// the row, as if the model had ended it.
fn follow_structure(row: &mut Row, token: u32) -> Step {
    let Some(constraint) = &mut row.constraint else { return Step::Continue };
    match constraint.advance(token) {
        Ok(Progress::Open) => Step::Continue,
        Ok(Progress::Complete) => Step::Done(FinishReason::Stop),
        Err(e) => {
            tracing::warn!("structured output ends early: {e}");
            Step::Done(FinishReason::Stop)
        }
    }
}

/// Replays a resumed generation's output so far to its requester, and to its structure's
/// constraint; says whether the row goes on.
pub(super) fn replay(row: &mut Row) -> Step {
    for i in 0..row.generated.len() {
        let id = row.generated[i];
        if !row.job.sink.send(Event::Token(Sampled { id, logprob: None, top_logprobs: Vec::new() })) {
            return Step::Done(FinishReason::Cancelled);
        }
        if let Step::Done(reason) = follow_structure(row, id) {
            return Step::Done(reason);
        }
    }
    if row.generated.len() >= row.job.opts.max_tokens {
        return Step::Done(FinishReason::Length);
    }
    Step::Continue
}

/// Reports a row's end to its requester.
pub(super) fn finish(stats: &WorkerStats, mut row: Row, reason: FinishReason) {
    if reason == FinishReason::Cancelled {
        stats.cancelled.fetch_add(1, Ordering::Relaxed);
    }
    stats.draft_rounds.fetch_add(row.rounds as u64, Ordering::Relaxed);
    stats.drafted_tokens.fetch_add(row.drafted as u64, Ordering::Relaxed);
    stats.accepted_tokens.fetch_add(row.accepted as u64, Ordering::Relaxed);
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

/// Persists a checkpoint of every running row (of `batch`, by index) whose output grew
/// `checkpoint_every` tokens since its last one.
pub(super) fn checkpoint(cache: &SharedCache, rows: &mut [Row], running: &[usize], batch: &BatchState) {
    let Some(writer) = &cache.writer else { return };
    let every = cache.config.checkpoint_every;
    for &i in running {
        let row = &mut rows[i];
        let Some(namespace) = row.checkpoints.filter(|_| row.generated.len() >= row.checkpointed + every) else { continue };
        row.checkpointed = row.generated.len();
        let Some(state) = cache.copied("a generation checkpoint", batch.extract(i)) else { continue };
        let covered = row.context.len() - 1;
        let resume =
            Resume { prompt_len: row.job.prompt.len(), next_token: row.context[covered], sampler_draws: row.sampler.draws() };
        writer.enqueue(Snapshot { namespace, tokens: row.context[..covered].to_vec(), state, resume: Some(resume) });
    }
}

/// Whether the prompt cache keeps anything.
pub(super) fn caching(cache: &SharedCache) -> bool {
    cache.config.ram_bytes > 0 || cache.writer.is_some()
}

/// Hands a snapshot (of [`BatchState::share`]) to the RAM tier, and a copy of its own to the
/// SSD write queue: the writer thread never touches the pool.
pub(super) fn publish(cache: &SharedCache, snap: Snapshot) {
    if let Some(writer) = &cache.writer {
        if let Some(state) = cache.copied("a snapshot for the SSD tier", snap.state.extract(0)) {
            writer.enqueue(Snapshot { state, ..snap.clone() });
        }
    }
    if cache.config.ram_bytes > 0 {
        cache.ram().insert(snap);
    }
}
