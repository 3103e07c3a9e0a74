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
use crate::structured::{Constraint, Progress, TokenMask};
use strata_kernels::sampling::{draw_rows, Draw};

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

/// A row's structured-output masks for one step, per fed position (see [`Constraint::masks`]);
/// `None` for a row without a structure.
pub(super) type RowMasks = Option<Vec<Option<TokenMask>>>;

impl Row {
    /// The first `covered` tokens of the row's context as the prompt cache keys them (images
    /// by content).
    pub fn cache_tokens(&self, covered: usize) -> Vec<u32> {
        let key = self.job.cache_tokens();
        let n = key.len().min(covered);
        key[..n].iter().chain(&self.context[n..covered]).copied().collect()
    }
}

/// The tokens position `j` of a row may take: any (`Ok(None)`), those of a mask, or none
/// (`Err`: the structure cannot go on there, and the row ends).
fn allowed_at(masks: &RowMasks, j: usize) -> Result<Option<&TokenMask>, ()> {
    let Some(masks) = masks else { return Ok(None) };
    match masks.get(j) {
        Some(None) => Ok(None),
        Some(Some(mask)) if !mask.is_empty() => Ok(Some(mask)),
        _ => Err(()),
    }
}

impl Row {
    /// Whether this row's tokens need their logits on the host (to report log-probabilities)
    /// rather than being chosen where the logits are.
    fn needs_logits(&self) -> bool {
        self.job.opts.logprobs.is_some()
    }

    /// The structure's masks for a step that feeds `drafts` after the row's tokens (allowed
    /// ones: see [`Constraint::allowed_drafts`]).
    pub fn masks(&mut self, stats: &WorkerStats, drafts: &[u32]) -> RowMasks {
        let constraint = self.constraint.as_mut()?;
        let started = Instant::now();
        let masks = constraint.masks(drafts, &self.job.opts.stop_tokens);
        stats.structured_mask_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        stats.structured_masks.fetch_add(masks.len() as u64, Ordering::Relaxed);
        Some(masks)
    }
}

/// What a decode step hands the sampler for one position of one row: the token chosen where
/// the logits are (within the position's mask, after the row's adjustments, drawn as its
/// sampler says: on a GPU only token ids cross to the host), or the logits themselves for a row
/// that reports log-probabilities, to choose the same token from on the host.
pub(super) enum Scores {
    Logits(Vec<f32>),
    Chosen(u32),
}

impl Scores {
    /// Per row, per position, from a step's f32 logits `[B, vocab]` or `[B, width, vocab]`, the
    /// rows' masks for the step and the drafts fed after each row's tokens.
    pub fn of_step(
        logits: &Tensor,
        rows: &[Row],
        masks: &[RowMasks],
        drafts: &[Vec<u32>],
    ) -> strata_model::Result<Vec<Vec<Scores>>> {
        let (b, width) = (logits.dim(0)?, if logits.rank() == 3 { logits.dim(1)? } else { 1 });
        let vocab = logits.dim(candle_core::D::Minus1)?;
        let logits = logits.reshape((b, width, ()))?;
        let on_host: Vec<bool> = rows.iter().map(Row::needs_logits).collect();
        let host_rows: Vec<u32> = (0..b as u32).filter(|&i| on_host[i as usize]).collect();
        let mut host = match host_rows.len() {
            0 => Vec::new(),
            n if n == b => logits.to_vec3::<f32>()?,
            _ => logits.index_select(&Tensor::new(host_rows, logits.device())?, 0)?.to_vec3::<f32>()?,
        }
        .into_iter();
        let mut ids = Vec::new();
        if on_host.iter().any(|h| !h) {
            let mask = |i: usize, j: usize| masks.get(i)?.as_ref()?.get(j)?.as_ref().map(TokenMask::words);
            let flat: Vec<Option<&[u32]>> = (0..b * width).map(|k| mask(k / width, k % width)).collect();
            let flat = if flat.iter().any(Option::is_some) { &flat[..] } else { &[] };
            // Positions past a row's drafts are padding, never kept: the cheapest draw.
            let (mut draws, mut adjust) = (Vec::with_capacity(b * width), Vec::new());
            for (i, row) in rows.iter().enumerate() {
                let drafted = drafts.get(i).map_or(&[][..], Vec::as_slice);
                for j in 0..width {
                    if on_host[i] || j > drafted.len() {
                        draws.push(Draw::GREEDY);
                        continue;
                    }
                    draws.push(row.sampler.draw(row.generated.len() + j));
                    let index = (i * width + j) as u32;
                    adjust.extend(row.sampler.adjustments(index, vocab, &row.context, &row.generated, &drafted[..j]));
                }
            }
            ids = draw_rows(&logits.reshape((b * width, ()))?, &draws, flat, &adjust)?;
        }
        Ok((0..b)
            .map(|i| match on_host[i] {
                true => host.next().expect("a host row per row that needs one").into_iter().map(Scores::Logits).collect(),
                false => ids[i * width..(i + 1) * width].iter().map(|&id| Scores::Chosen(id)).collect(),
            })
            .collect())
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
    masks: &RowMasks,
    drafts: &[u32],
    max_draft: usize,
) -> (usize, Step) {
    row.rounds += !drafts.is_empty() as usize;
    row.drafted += drafts.len();
    for (j, logits) in logits.iter().enumerate() {
        let Ok(allowed) = allowed_at(masks, j) else { return (j + 1, Step::Done(FinishReason::Stop)) };
        // Drafts never exceed the row's budget, so a draft position always has room.
        let Some(&draft) = drafts.get(j) else {
            if !drafts.is_empty() {
                row.draft_len = (row.draft_len + 1).min(max_draft);
            }
            return (j + 1, sample_and_send(stats, row, logits, allowed));
        };
        let (token, accepted) = match logits {
            Scores::Logits(logits) => row.sampler.verify(logits, allowed, &row.context, &row.generated, draft),
            &Scores::Chosen(id) => (id, id == draft),
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

/// Samples the row's next token from `logits`, among those `allowed`, and streams it; says
/// whether the row goes on.
pub(super) fn sample_and_send(stats: &WorkerStats, row: &mut Row, logits: &Scores, allowed: Option<&TokenMask>) -> Step {
    if row.generated.len() >= row.job.opts.max_tokens {
        return Step::Done(FinishReason::Length);
    }
    let next = match logits {
        Scores::Logits(logits) => row.sampler.sample(logits, allowed, &row.context, &row.generated),
        &Scores::Chosen(id) => id,
    };
    send(stats, row, next, logits)
}

/// A joiner's first token, from its prompt's last `logits`; says whether the row goes on.
pub(super) fn first_token(stats: &WorkerStats, row: &mut Row, logits: Vec<f32>) -> Step {
    let masks = row.masks(stats, &[]);
    match allowed_at(&masks, 0) {
        Ok(allowed) => sample_and_send(stats, row, &Scores::Logits(logits), allowed),
        Err(()) => Step::Done(FinishReason::Stop),
    }
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
        let resume = Resume { prompt_len: row.job.prompt.len(), next_token: row.context[covered] };
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
