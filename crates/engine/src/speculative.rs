//! Draft sources for speculative decoding. A drafter proposes up to `k` next tokens per row;
//! the engine verifies them in one forward of the target and keeps the accepted prefix (see
//! `Model::open_round` / `close_round` for how the state rolls back exactly, and
//! `Sampler::verify` for the acceptance rule: a draft stands when it is the token the target
//! draws at its position, so the output is the one decoding without drafts gives).

use candle_core::{IndexOp, Tensor};
use strata_kernels::sampling::argmax_rows;
use strata_model::{Logits, Model, MtpHead, Round};
use strata_state::BatchState;

/// Where draft tokens come from.
pub enum DraftSource {
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the context's
    /// last few tokens. No model; shines on repetitive text (code edits, quoting, summaries).
    Ngram,
    /// A smaller model sharing the tokenizer, drafting greedily (or the target itself, which
    /// accepts everything and so measures the overhead ceiling).
    Model(Box<Model>),
    /// The target's own multi-token-prediction head (Qwen3.5 `mtp.*`), drafting greedily from
    /// the target's hidden states: no second model, one small layer per draft token.
    Mtp(Box<MtpHead>),
}

pub struct Speculation {
    pub source: DraftSource,
    /// Most tokens drafted per row and step.
    pub tokens: usize,
}

/// Longest n-gram the lookup tries to match.
const MAX_NGRAM: usize = 3;

/// Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
/// `context` (length `MAX_NGRAM` down to 1) found earlier in it.
pub fn ngram_draft(context: &[u32], k: usize) -> Vec<u32> {
    let len = context.len();
    for n in (1..=MAX_NGRAM.min(len.saturating_sub(1))).rev() {
        let suffix = &context[len - n..];
        if let Some(start) = (0..len - n).rev().find(|&s| &context[s..s + n] == suffix) {
            let from = start + n;
            return context[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// The engine's drafter with its per-row state, kept row-aligned with the running batch.
pub(crate) struct Drafter {
    pub source: DraftSource,
    pub tokens: usize,
    /// The draft model's or MTP head's state for the running rows.
    state: Option<BatchState>,
    round: Option<Round>,
    /// MTP: per running row, the target's hidden states `[n, hidden]` the head has not read
    /// yet. Their next tokens are the row context's last `n` tokens.
    unread: Vec<Option<Tensor>>,
}

/// What the MTP head read of a job while it prefilled: the head's state, and the hidden state
/// of the prompt's last position (whose next token is the first one sampled). It lives with the
/// joiner, so an abandoned joiner leaves nothing behind.
#[derive(Default)]
pub(crate) struct JoinerDraft(Option<(BatchState, Option<Tensor>)>);

impl Drafter {
    pub fn new(spec: Speculation) -> Self {
        Self { source: spec.source, tokens: spec.tokens.max(1), state: None, round: None, unread: Vec::new() }
    }

    /// Whether the target's forwards must return hidden states (for [`Drafter::prefilled`] and
    /// [`Drafter::settle`]).
    pub fn wants_hidden(&self) -> bool {
        matches!(self.source, DraftSource::Mtp(_))
    }

    /// The joiner's target read `prompt[from..from + T]`, giving `hidden` `[T, hidden]`: the
    /// MTP head reads every position whose next token is known. (Positions restored from the
    /// prompt cache have no hidden states; the head's history starts after them. Its RoPE
    /// counts from there, which attention, depending only on relative positions, does not see.)
    pub fn prefilled(&self, joining: &mut JoinerDraft, prompt: &[u32], from: usize, hidden: &Tensor) -> strata_model::Result<()> {
        let DraftSource::Mtp(head) = &self.source else { return Ok(()) };
        let (mut head_state, _) = match joining.0.take() {
            Some(joining) => joining,
            None => (head.new_state(1)?, None),
        };
        let fed = hidden.dim(0)?;
        let known = fed.min(prompt.len() - from - 1);
        if known > 0 {
            let next = Tensor::new(&prompt[from + 1..from + 1 + known], head.device())?.unsqueeze(0)?;
            head.forward(&next, &hidden.narrow(0, 0, known)?.unsqueeze(0)?, &mut head_state)?;
        }
        let last = (known < fed).then(|| hidden.narrow(0, known, fed - known)).transpose()?;
        joining.0 = Some((head_state, last));
        Ok(())
    }

    /// A row joins the batch with `covered` tokens already in the target's state: a draft model
    /// reads them too; the MTP head takes what it read during the row's prefill (`joining`).
    pub fn join(&mut self, covered: &[u32], chunk: usize, joining: JoinerDraft) -> strata_model::Result<()> {
        let state = match &self.source {
            DraftSource::Ngram => return Ok(()),
            DraftSource::Model(model) => {
                let mut state = model.new_state(1)?;
                for part in covered.chunks(chunk.max(1)) {
                    model.forward(&Tensor::new(part, model.device())?.unsqueeze(0)?, &mut state, Logits::Last)?;
                }
                state
            }
            // A row resumed from a checkpoint has no prefill: its head history starts empty.
            DraftSource::Mtp(head) => {
                let (state, last) = match joining.0 {
                    Some(joining) => joining,
                    None => (head.new_state(1)?, None),
                };
                self.unread.push(last);
                state
            }
        };
        match &mut self.state {
            Some(batch) => batch.merge(&state)?,
            None => self.state = Some(state),
        }
        Ok(())
    }

    /// Keeps the listed rows (as the running batch does).
    pub fn filter(&mut self, keep: &[usize]) -> strata_model::Result<()> {
        if let Some(state) = &mut self.state {
            if keep.is_empty() {
                self.state = None;
            } else {
                state.filter(keep)?;
            }
        }
        if !self.unread.is_empty() {
            self.unread = keep.iter().map(|&r| self.unread[r].take()).collect();
        }
        Ok(())
    }

    pub fn clear(&mut self) {
        self.state = None;
        self.round = None;
        self.unread.clear();
    }

    /// Drafts for every row, at most `limits[r]` tokens for row `r`. A draft model feeds
    /// `last` and each draft in a round of its own, so it can keep what the target keeps.
    pub fn propose(&mut self, contexts: &[&[u32]], limits: &[usize]) -> strata_model::Result<Vec<Vec<u32>>> {
        let state = self.state.as_mut();
        match &self.source {
            DraftSource::Ngram => {
                Ok(contexts.iter().zip(limits).map(|(c, &limit)| ngram_draft(c, self.tokens.min(limit))).collect())
            }
            DraftSource::Model(model) => {
                let state = state.ok_or_else(missing_state)?;
                self.round = Some(model.open_round(state)?);
                let mut input: Vec<u32> = contexts.iter().map(|c| *c.last().expect("a running row has a token")).collect();
                let steps = self.tokens.min(limits.iter().copied().max().unwrap_or(0));
                let mut drafts = vec![Vec::with_capacity(steps); contexts.len()];
                // steps + 1 forwards: the last feeds the final draft, so the draft model has
                // seen every position the target verifies (even with nothing to draft, it
                // reads `last`, staying in step).
                for step in 0..=steps {
                    let x = Tensor::new(input.as_slice(), model.device())?.unsqueeze(1)?;
                    let logits = model.forward(&x, state, Logits::Last)?;
                    if step == steps {
                        break;
                    }
                    input = argmax_rows(&logits, &[])?;
                    for (d, &t) in drafts.iter_mut().zip(&input) {
                        d.push(t);
                    }
                }
                for (d, &limit) in drafts.iter_mut().zip(limits) {
                    d.truncate(limit);
                }
                Ok(drafts)
            }
            DraftSource::Mtp(head) => {
                let state = state.ok_or_else(missing_state)?;
                let (drafts, round) = mtp_drafts(head, state, &mut self.unread, contexts, limits, self.tokens)?;
                self.round = round;
                Ok(drafts)
            }
        }
    }

    /// Ends the step: the draft model keeps what the target kept; the MTP head drops its draft
    /// steps and queues the target's hidden states `[B, T, hidden]` of the kept positions.
    pub fn settle(&mut self, keep: &[usize], hidden: Option<&Tensor>) -> strata_model::Result<()> {
        let (Some(state), round) = (&mut self.state, self.round.take()) else { return Ok(()) };
        match &self.source {
            DraftSource::Ngram => {}
            DraftSource::Model(model) => {
                if let Some(round) = round {
                    model.close_round(state, round, keep)?;
                }
            }
            DraftSource::Mtp(head) => {
                if let Some(round) = round {
                    head.close_round(state, round, &vec![0; keep.len()])?;
                }
                let hidden =
                    hidden.ok_or_else(|| strata_model::ModelError::Invalid("MTP drafting needs hidden states".into()))?;
                self.unread =
                    keep.iter().enumerate().map(|(r, &k)| hidden.i((r, ..k)).map(Some)).collect::<candle_core::Result<_>>()?;
            }
        }
        Ok(())
    }
}

fn missing_state() -> strata_model::ModelError {
    strata_model::ModelError::Invalid("draft state missing".into())
}

/// One MTP drafting step over the batch. First the head catches up: each row reads its unread
/// target hidden states (rows padded to one width; padding is trimmed away), and the last one
/// gives the row's first draft. Then each further draft feeds the head its own output, in a
/// round the caller closes (keeping none of it) once the target has verified.
fn mtp_drafts(
    head: &MtpHead,
    state: &mut BatchState,
    unread: &mut [Option<Tensor>],
    contexts: &[&[u32]],
    limits: &[usize],
    tokens: usize,
) -> strata_model::Result<(Vec<Vec<u32>>, Option<Round>)> {
    let rows = contexts.len();
    let counts: Vec<usize> = unread.iter().map(|u| u.as_ref().map_or(Ok(0), |h| h.dim(0))).collect::<candle_core::Result<_>>()?;
    let width = counts.iter().copied().max().unwrap_or(0);
    let mut drafts = vec![Vec::new(); rows];
    if width == 0 {
        return Ok((drafts, None));
    }
    let device = head.device();
    let (dim, dtype) = unread.iter().flatten().next().map(|h| (h.dim(1), h.dtype())).expect("a row has unread states");
    let (dim, mut ids, mut hidden) = (dim?, Vec::with_capacity(rows * width), Vec::with_capacity(rows));
    for ((context, unread), &n) in contexts.iter().zip(unread.iter_mut()).zip(&counts) {
        let last = *context.last().expect("a running row has a token");
        ids.extend_from_slice(&context[context.len() - n..]);
        ids.resize(ids.len() + width - n, last);
        let padding = Tensor::zeros((width - n, dim), dtype, device)?;
        hidden.push(match unread.take() {
            Some(h) if n < width => Tensor::cat(&[h, padding], 0)?,
            Some(h) => h,
            None => padding,
        });
    }
    let catch_up = head.open_round(state);
    let y = head.forward(&Tensor::from_vec(ids, (rows, width), device)?, &Tensor::stack(&hidden, 0)?, state)?;
    head.close_round(state, catch_up, &counts)?;
    let mut last_y = Tensor::stack(
        &counts
            .iter()
            .enumerate()
            .map(|(r, &n)| y.i((r, n.max(1) - 1..n.max(1), ..)))
            .collect::<candle_core::Result<Vec<_>>>()?,
        0,
    )?;
    let drafting: Vec<bool> = counts.iter().zip(limits).map(|(&n, &limit)| n > 0 && limit > 0).collect();
    let steps = tokens.min(limits.iter().zip(&drafting).filter(|(_, &d)| d).map(|(&l, _)| l).max().unwrap_or(0));
    let round = head.open_round(state);
    for step in 0..steps {
        if step > 0 {
            let input: Vec<u32> = drafts.iter().map(|d| *d.last().expect("every row drafted a step")).collect();
            let input = Tensor::new(input, device)?.unsqueeze(1)?;
            last_y = head.forward(&input, &last_y, state)?;
        }
        for (d, t) in drafts.iter_mut().zip(head.draft(&last_y)?) {
            d.push(t);
        }
    }
    for ((d, &limit), &on) in drafts.iter_mut().zip(limits).zip(&drafting) {
        d.truncate(if on { limit } else { 0 });
    }
    Ok((drafts, Some(round)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::D;

    #[test]
    fn ngram_lookup_continues_the_latest_match_of_the_longest_suffix() {
        // "1 2 3" occurred before, followed by 4 5 6; the longest suffix wins over "3".
        assert_eq!(ngram_draft(&[1, 2, 3, 4, 5, 6, 9, 3, 7, 1, 2, 3], 3), vec![4, 5, 6]);
        // Only the last token matches: continue after its latest earlier occurrence.
        assert_eq!(ngram_draft(&[7, 8, 7, 9, 7], 2), vec![9, 7]);
        assert_eq!(ngram_draft(&[1, 2, 3], 4), Vec::<u32>::new());
        assert_eq!(ngram_draft(&[5], 4), Vec::<u32>::new());
        // Never past the end of the context.
        assert_eq!(ngram_draft(&[4, 4], 5), vec![4]);
    }

    /// The MTP drafter's bookkeeping (prefill in chunks, catch-up of rows with different unread
    /// counts, padding, draft rounds taken back) gives, every step, the drafts of the head's
    /// definition applied from scratch to the row's whole accepted history.
    #[test]
    fn mtp_drafts_follow_the_head_over_the_accepted_history() {
        use candle_core::{DType, Device};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5-tiny-b");
        let folder = strata_model::ModelFolder::open(&dir).unwrap();
        let target = folder.load(DType::F32, &Device::Cpu).unwrap();
        let reference_head = folder.load_mtp(&target).unwrap();
        let head = folder.load_mtp(&target).unwrap();
        let mut drafter = Drafter::new(Speculation { source: DraftSource::Mtp(Box::new(head)), tokens: 3 });
        let row = |t: &[u32]| Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let argmax = |l: &Tensor| l.argmax(D::Minus1).unwrap().flatten_all().unwrap().to_vec1::<u32>().unwrap();

        // Two rows, prefilled in chunks of 5.
        let prompts: [Vec<u32>; 2] = [(10..33).collect(), (100..111).rev().collect()];
        let mut contexts = Vec::new();
        let mut batch: Option<BatchState> = None;
        for prompt in &prompts {
            let mut state = target.new_state(1).unwrap();
            let mut joining = JoinerDraft::default();
            let mut logits = None;
            for from in (0..prompt.len()).step_by(5) {
                let to = (from + 5).min(prompt.len());
                let (l, hidden) = target.forward_with_hidden(&row(&prompt[from..to]), &mut state, Logits::Last).unwrap();
                drafter.prefilled(&mut joining, prompt, from, &hidden.squeeze(0).unwrap()).unwrap();
                logits = Some(l);
            }
            let mut context = prompt.clone();
            context.push(argmax(&logits.unwrap())[0]);
            drafter.join(&context[..context.len() - 1], 5, joining).unwrap();
            match &mut batch {
                Some(b) => b.merge(&state).unwrap(),
                None => batch = Some(state),
            }
            contexts.push(context);
        }
        let batch = batch.as_mut().unwrap();

        // What the head drafts from scratch for a history: the target's hidden states over all
        // but the last token, the head over (tokens[1..], hidden), then its own chain.
        let expected = |context: &[u32], k: usize| -> Vec<u32> {
            let (_, hidden) = target
                .forward_with_hidden(&row(&context[..context.len() - 1]), &mut target.new_state(1).unwrap(), Logits::All)
                .unwrap();
            let mut state = reference_head.new_state(1).unwrap();
            let y = reference_head.forward(&row(&context[1..]), &hidden, &mut state).unwrap();
            let mut y = y.narrow(1, context.len() - 2, 1).unwrap();
            let mut drafts = vec![argmax(&reference_head.logits(&y).unwrap())[0]];
            while drafts.len() < k {
                y = reference_head.forward(&row(&drafts[drafts.len() - 1..]), &y, &mut state).unwrap();
                drafts.push(argmax(&reference_head.logits(&y).unwrap())[0]);
            }
            drafts
        };

        for step in 0..8 {
            let limits = [3, 1 + step % 3];
            let views: Vec<&[u32]> = contexts.iter().map(Vec::as_slice).collect();
            let drafts = drafter.propose(&views, &limits).unwrap();
            for (r, d) in drafts.iter().enumerate() {
                assert_eq!(d, &expected(&contexts[r], limits[r]), "step {step}, row {r}");
            }
            // Each row keeps a prefix of its drafts that varies by step and row (a random head is
            // rarely right, and which tokens stand does not matter to the bookkeeping), then the
            // target's token after it.
            let width = 1 + drafts.iter().map(Vec::len).max().unwrap();
            let input: Vec<Vec<u32>> = contexts
                .iter()
                .zip(&drafts)
                .map(|(c, d)| {
                    let mut fed = vec![*c.last().unwrap()];
                    fed.extend(d);
                    fed.resize(width, 0);
                    fed
                })
                .collect();
            let round = target.open_round(batch).unwrap();
            let (logits, hidden) =
                target.forward_with_hidden(&Tensor::new(input, &Device::Cpu).unwrap(), batch, Logits::All).unwrap();
            let mut kept = Vec::new();
            for (r, d) in drafts.iter().enumerate() {
                let a = (step + r) % (d.len() + 1);
                contexts[r].extend_from_slice(&d[..a]);
                contexts[r].push(argmax(&logits.get(r).unwrap())[a]);
                kept.push(a + 1);
            }
            target.close_round(batch, round, &kept).unwrap();
            drafter.settle(&kept, Some(&hidden)).unwrap();
        }
    }
}
