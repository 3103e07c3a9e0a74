//! Running what the policy planned: the model's forwards (and their CUDA graphs, inside the
//! model), the state pool, the running batch's state and the drafter. Moves state between the
//! pool, the prompt cache and host memory; samples nothing.

use std::sync::atomic::Ordering;
use std::time::Instant;

use candle_core::{Device, Tensor};
use rayon::prelude::*;
use strata_model::{ImageInputs, ImagePrompt, Logits, Model, Round, Segment, SegmentOutput};
use strata_state::{BatchState, StatePool};

use super::apply::{Row, RowMasks, Scores};
use super::policy::Blocks;
use crate::cache::{usable_prefix, Snapshot, PROMPT_NAMESPACE};
use crate::job::Job;
use crate::shared::{SharedCache, WorkerStats};
use crate::speculative::{Drafter, JoinerDraft};
use strata_kernels::matmul::MAX_EXACT_ROWS;

pub(super) struct Runner {
    model: Model,
    /// Where the rows' state lives (see [`crate::EngineConfig`]).
    pool: StatePool,
    drafter: Option<Drafter>,
    /// State of the running rows, in the engine's row order.
    batch: Option<BatchState>,
}

/// A decode forward's output, before its rows are sampled.
pub(super) struct Decoded {
    /// Per row, per fed position.
    pub scores: Vec<Vec<Scores>>,
    /// Per row, the drafts fed after its last token.
    pub drafts: Vec<Vec<u32>>,
    /// Per row, its structure's masks for the fed positions.
    pub masks: Vec<RowMasks>,
    round: Option<Round>,
    hidden: Option<Tensor>,
}

/// A step's results: the running rows' decode output, and the prompts' last logits `[jobs,
/// vocab]` (in the jobs' order), each where the step had them; and the forward's time (to the
/// decode rows' scores on the host, and the device's work done where prompts were fed).
pub(super) struct Stepped {
    pub decoded: Option<Decoded>,
    pub prefilled: Option<Tensor>,
    pub elapsed: std::time::Duration,
}

/// The running rows' part of a step.
struct DecodeInput {
    input: Tensor,
    drafts: Vec<Vec<u32>>,
    round: Option<Round>,
    logits: Logits,
}

/// A prefilling job's next chunk: its prompt from `fed` on, into its single-row `state` (lent
/// to the forward) and its drafter's record.
pub(super) struct Feed<'a> {
    pub prompt: &'a [u32],
    pub fed: usize,
    pub state: BatchState,
    pub draft: &'a mut JoinerDraft,
    /// Its images, where the prompt has them (its chunks are segments of their own, and the
    /// drafter does not read them: its drafts start after the prompt).
    pub images: Option<&'a ImagePrompt>,
}

/// The pool's blocks, with the prompt cache giving up entries on demand.
pub(super) struct PoolBlocks<'a> {
    pool: &'a StatePool,
    cache: &'a SharedCache,
}

impl Blocks for PoolBlocks<'_> {
    fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    fn free_toward(&mut self, need: usize) -> Option<usize> {
        let mut free = self.pool.blocks_free()?;
        if free < need {
            let mut ram = self.cache.ram();
            while free < need && ram.evict_oldest() {
                free = self.pool.blocks_free().unwrap_or(usize::MAX);
            }
        }
        Some(free)
    }
}

impl Runner {
    pub fn new(model: Model, pool: StatePool, drafter: Option<Drafter>) -> Self {
        Self { model, pool, drafter, batch: None }
    }

    pub fn blocks<'a>(&'a self, cache: &'a SharedCache) -> PoolBlocks<'a> {
        PoolBlocks { pool: &self.pool, cache }
    }

    /// The running batch's state, while a row runs.
    pub fn batch(&self) -> Option<&BatchState> {
        self.batch.as_ref()
    }

    /// Tokens the drafter drafts per row at most (0 without one).
    pub fn max_draft(&self) -> usize {
        self.drafter.as_ref().map_or(0, |d| d.tokens)
    }

    /// CUDA graphs recorded and replayed for decode steps.
    pub fn graph_stats(&self) -> strata_model::GraphStats {
        self.model.decode_graph_stats()
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

    /// Moves a row's state into the running batch (and the draft model's); `context` is the
    /// row's tokens so far.
    pub fn join(
        &mut self,
        context: &[u32],
        state: BatchState,
        draft: JoinerDraft,
        prefill_chunk: usize,
    ) -> strata_model::Result<()> {
        if let Some(drafter) = &mut self.drafter {
            drafter.join(&context[..context.len() - 1], prefill_chunk, draft)?;
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
        Ok(())
    }

    /// Takes running row `i` of `rows` out of the batch: returns its state as host tensors
    /// named as [`BatchState::parts`] names them, and its position; its blocks and slot go
    /// back to the pool.
    pub fn preempt(&mut self, i: usize, rows: usize) -> strata_model::Result<(Vec<(String, Tensor)>, usize)> {
        let batch = self.batch.as_mut().expect("a row runs");
        let position = batch.positions[i];
        let parts = batch.extract(i)?.parts()?;
        let parts =
            parts.into_iter().map(|(name, t)| Ok((name, t.to_device(&Device::Cpu)?))).collect::<strata_model::Result<_>>()?;
        let keep: Vec<usize> = (0..rows).filter(|&r| r != i).collect();
        self.filter(&keep)?;
        Ok((parts, position))
    }

    /// A preempted row's state, from its host tensors back into the pool.
    pub fn restore(&self, parts: &[(String, Tensor)], position: usize) -> strata_model::Result<BatchState> {
        let device = self.model.device().clone();
        Ok(BatchState::from_parts(&self.new_state(0)?, position, |name| {
            let (_, part) = parts.iter().find(|(n, _)| n == name).expect("parts() named every part from_parts asks for");
            Ok(part.to_device(&device)?)
        })?)
    }

    /// `job`'s images through the model's vision tower, placed in its prompt.
    pub fn image_prompt(&self, job: &Job) -> strata_model::Result<ImagePrompt> {
        let tower = self.model.vision().ok_or_else(|| strata_model::ModelError::Invalid("the model takes no images".into()))?;
        ImagePrompt::new(tower, &job.prompt, &job.images)
    }

    /// Gives a prefilling job's blocks and slot back to the pool, then fresh state for it.
    pub fn restart(&self, state: &mut BatchState) -> strata_model::Result<()> {
        state.filter(&[])?; // its blocks and slot back to the pool first
        *state = self.new_state(1)?;
        Ok(())
    }

    /// The state to prefill `prompt` from: a copy of the longest usable cached prefix (the SSD
    /// entry read ahead, or the RAM tier's best), else a fresh state; and the tokens it covers.
    /// At least the last prompt token is always computed, since its logits choose the first
    /// output token. A copy that fails is a miss.
    pub fn restore_prompt(
        &self,
        cache: &SharedCache,
        prompt: &[u32],
        from_ssd: Option<Snapshot>,
    ) -> strata_model::Result<(BatchState, usize)> {
        let limit = prompt.len().saturating_sub(1);
        let score = |tokens: &[u32], trim: bool| usable_prefix(tokens, trim, prompt, limit);
        let stats = &cache.stats;
        let mut ram = cache.ram();
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
                let restored = cache.copied("an SSD entry", copy).map(|(state, entry)| {
                    stats.ssd_hits.fetch_add(1, Ordering::Relaxed);
                    ram.insert(Snapshot { state: entry, ..snap.clone() });
                    (state, usable)
                });
                if restored.is_none() {
                    ram.insert(snap);
                }
                restored
            }
            _ => cache.copied("a RAM entry", ram.restore(PROMPT_NAMESPACE, score)).flatten().map(|r| {
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

    /// Blocks a decode step of `width` positions per row would take from the pool.
    pub fn blocks_to_grow(&self, width: usize) -> usize {
        self.batch.as_ref().map_or(0, |batch| batch.blocks_to_grow(width))
    }

    /// One step's forward: every running row's decode positions — its last token, and with
    /// speculation its drafts (`[last, d1..dk]`; a structured row's only as far as its
    /// structure allows them) — and prompts' prefill chunks, job `i` of `feeds` feeding
    /// `lens[i]` more tokens, as segments of one forward (`Model::forward_segments`, which on a
    /// GPU may run the rows' segment through its CUDA graph on its own; on a GPU jobs feeding
    /// equally many tokens merged into one segment, their attention one batch, and split back
    /// after it, each keeping its own blocks and slot; no padding enters any state). Either
    /// side may be empty.
    /// The structured rows' masks are computed on other threads while the forward runs.
    pub fn step(
        &mut self,
        rows: &mut [Row],
        stats: &WorkerStats,
        feeds: &mut [Feed<'_>],
        lens: &[usize],
    ) -> strata_model::Result<Stepped> {
        let decode = match rows.is_empty() {
            true => None,
            false => Some(self.decode_input(rows, stats)?),
        };
        // Prompts' segments: text jobs feeding equally many tokens together, in the order their
        // first job comes; a job with images alone (its embeddings and positions are its own).
        // On CPU every job is a segment of its own: a segment's matmuls take the kernels they
        // take alone, so a prompt keeps its bits whatever prefills beside it (rows of a shared
        // segment past the batch-invariant kernels' 64 round differently), at the cost of no
        // batched attention, which gains little there.
        let cpu = self.model.device().is_cpu();
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            // A state outside the pool is never merged: the merge would copy it into the pool.
            let mergeable = |f: &Feed| !cpu && f.images.is_none() && f.state.is_pooled();
            let joins = mergeable(&feeds[i]);
            let shared = |(l, members): &&mut (usize, Vec<usize>)| *l == len && joins && mergeable(&feeds[members[0]]);
            match groups.iter_mut().find(shared) {
                Some((_, members)) => members.push(i),
                None => groups.push((len, vec![i])),
            }
        }
        let images: Vec<Option<ImageInputs>> = groups
            .iter()
            .map(|(len, members)| {
                let feed = &feeds[members[0]];
                feed.images.map(|images| images.inputs(feed.fed..feed.fed + len)).transpose()
            })
            .collect::<strata_model::Result<_>>()?;
        let mut states = Vec::with_capacity(groups.len());
        let mut inputs = Vec::with_capacity(groups.len());
        for (len, members) in &groups {
            let state = match &members[..] {
                &[one] => std::mem::take(&mut feeds[one].state),
                _ => {
                    let mut cohort = self.new_state(0)?;
                    for &i in members {
                        // Taken, not shared: a block or slot two states hold is copied when written.
                        cohort.merge(&std::mem::take(&mut feeds[i].state))?;
                    }
                    cohort
                }
            };
            states.push(state);
            let chunks: Vec<Vec<u32>> =
                members.iter().map(|&i| feeds[i].prompt[feeds[i].fed..feeds[i].fed + len].to_vec()).collect();
            inputs.push(Tensor::new(chunks, self.model.device())?);
        }
        let hidden = self.drafter.as_ref().is_some_and(Drafter::wants_hidden);
        let started = Instant::now();
        let mut segments: Vec<Segment> = Vec::with_capacity(1 + groups.len());
        if let Some(d) = &decode {
            let batch = self.batch.as_mut().expect("a row runs");
            segments.push(Segment { tokens: &d.input, state: batch, logits: d.logits, images: None });
        }
        segments.extend(states.iter_mut().zip(&inputs).zip(&images).map(|((state, tokens), images)| Segment {
            tokens,
            state,
            logits: Logits::Last,
            images: images.as_ref(),
        }));
        let n = rows.len();
        let structured = rows.iter().any(|r| r.constraint.is_some());
        let (forwarded, masks) = std::thread::scope(|scope| {
            // One thread beside the forward (which stays on this one: it may record a CUDA
            // graph), the rows spread over rayon's pool from there: a mask of a large
            // vocabulary can take a large share of a millisecond.
            let masking = structured.then(|| {
                let (rows, drafts) = (&mut *rows, decode.as_ref().map(|d| &d.drafts));
                let drafts = drafts.expect("structured rows run");
                scope.spawn(move || rows.par_iter_mut().zip(drafts).map(|(r, d)| r.masks(stats, d)).collect::<Vec<_>>())
            });
            let forwarded = self.model.forward_segments(&mut segments, hidden);
            let masks = masking.map(|m| m.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)));
            (forwarded, masks.unwrap_or_else(|| vec![None; n]))
        });
        let mut outputs = forwarded?.into_iter();
        let decoded = match decode {
            Some(DecodeInput { drafts, round, .. }) => {
                let out = outputs.next().expect("a decode segment ran");
                let scores = Scores::of_step(&out.logits, rows, &masks, &drafts)?;
                Some(Decoded { scores, drafts, masks, round, hidden: out.hidden })
            }
            None => None,
        };
        let outputs: Vec<SegmentOutput> = outputs.collect();
        // Back to the jobs' order: each job's state, logits row and hidden states.
        let mut place = vec![(0, 0); feeds.len()];
        for (g, ((_, members), state)) in groups.iter().zip(states).enumerate() {
            let parts = if members.len() == 1 { vec![state] } else { state.split()? };
            for (k, (&i, part)) in members.iter().zip(parts).enumerate() {
                feeds[i].state = part;
                place[i] = (g, k);
            }
        }
        if let Some(drafter) = &self.drafter {
            for (feed, &(g, k)) in feeds.iter_mut().zip(&place) {
                if let Some(hidden) = &outputs[g].hidden {
                    drafter.prefilled(feed.draft, feed.prompt, feed.fed, &hidden.get(k)?)?;
                }
            }
        }
        let firsts = match &outputs[..] {
            [] => None,
            [one] => Some(one.logits.clone()), // one segment: already in the jobs' order
            _ => {
                let rows: Vec<Tensor> =
                    place.iter().map(|&(g, k)| outputs[g].logits.get(k)).collect::<candle_core::Result<_>>()?;
                Some(Tensor::stack(&rows, 0)?)
            }
        };
        if firsts.is_some() {
            // Waits for the device, so that the time counts the prompts' work too (their logits
            // are read next).
            self.model.device().synchronize()?;
        }
        Ok(Stepped { decoded, prefilled: firsts, elapsed: started.elapsed() })
    }

    /// The running rows' decode input: each row's last token and drafts, a speculative round
    /// opened where any row has drafts.
    fn decode_input(&mut self, rows: &mut [Row], stats: &WorkerStats) -> strata_model::Result<DecodeInput> {
        let batch = self.batch.as_mut().expect("a row runs");
        let mut drafts = match &mut self.drafter {
            Some(drafter) => {
                let contexts: Vec<&[u32]> = rows.iter().map(|r| r.context.as_slice()).collect();
                // No point drafting past a row's budget (the last token it may emit is
                // verified), and the verify forward stays within the rows the kernels compute
                // exactly (each position as if alone).
                let width_cap = (MAX_EXACT_ROWS / rows.len()).saturating_sub(1);
                let limits: Vec<usize> = rows
                    .iter()
                    .map(|r| r.job.opts.max_tokens.saturating_sub(r.generated.len() + 1).min(width_cap).min(r.draft_len))
                    .collect();
                let drafting = Instant::now();
                let drafts = drafter.propose(&contexts, &limits)?;
                stats.draft_ns.fetch_add(drafting.elapsed().as_nanos() as u64, Ordering::Relaxed);
                drafts
            }
            None => vec![Vec::new(); rows.len()],
        };
        for (row, drafts) in rows.iter_mut().zip(&mut drafts) {
            if let Some(constraint) = &mut row.constraint {
                drafts.truncate(constraint.allowed_drafts(drafts, &row.job.opts.stop_tokens));
            }
        }
        let width = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
        let input: Vec<Vec<u32>> = rows
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
        let logits = if width > 1 { Logits::All } else { Logits::Last };
        Ok(DecodeInput { input: Tensor::new(input, self.model.device())?, drafts, round, logits })
    }

    /// After a decode step's rows were verified: the state (and the drafter's) keeps `kept[i]`
    /// of the positions fed for row `i`.
    pub fn settle(&mut self, decoded: Decoded, kept: &[usize]) -> strata_model::Result<()> {
        if let Some(round) = decoded.round {
            self.model.close_round(self.batch.as_mut().expect("a row runs"), round, kept)?;
        }
        if let Some(drafter) = &mut self.drafter {
            drafter.settle(kept, decoded.hidden.as_ref())?;
        }
        Ok(())
    }

    /// Keeps only the running rows `keep` (indices into the batch), in that order.
    pub fn filter(&mut self, keep: &[usize]) -> strata_model::Result<()> {
        if let Some(drafter) = &mut self.drafter {
            drafter.filter(keep)?;
        }
        match keep.is_empty() {
            true => self.batch = None,
            false => self.batch.as_mut().expect("a row runs").filter(keep)?,
        }
        Ok(())
    }

    /// Drops the running batch's state (it can no longer be trusted after a failed forward).
    pub fn clear(&mut self) {
        self.batch = None;
        if let Some(drafter) = &mut self.drafter {
            drafter.clear();
        }
    }
}
