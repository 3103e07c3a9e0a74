//! Draft sources for speculative decoding. A drafter proposes up to `k` next tokens per row;
//! the engine verifies them in one forward of the target and keeps the accepted prefix (see
//! `Model::open_round` / `close_round` for how the state rolls back exactly, and
//! `Sampler::verify` for the acceptance rule that keeps the output distribution the target's).

use candle_core::Tensor;
use strata_model::{Logits, Model, Round};
use strata_state::BatchState;

/// Where draft tokens come from.
pub enum DraftSource {
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the context's
    /// last few tokens. No model; shines on repetitive text (code edits, quoting, summaries).
    Ngram,
    /// A smaller model sharing the tokenizer, drafting greedily (or the target itself, which
    /// accepts everything and so measures the overhead ceiling).
    Model(Box<Model>),
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
    /// The draft model's state for the running rows (model drafters only).
    state: Option<BatchState>,
    round: Option<Round>,
}

impl Drafter {
    pub fn new(spec: Speculation) -> Self {
        Self { source: spec.source, tokens: spec.tokens.max(1), state: None, round: None }
    }

    /// A row joins the batch with `covered` tokens already in the target's state: the draft
    /// model reads them too.
    pub fn join(&mut self, covered: &[u32], chunk: usize) -> strata_model::Result<()> {
        let DraftSource::Model(model) = &self.source else { return Ok(()) };
        let mut state = model.new_state(1)?;
        for part in covered.chunks(chunk.max(1)) {
            model.forward(&Tensor::new(part, model.device())?.unsqueeze(0)?, &mut state, Logits::Last)?;
        }
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
        Ok(())
    }

    pub fn clear(&mut self) {
        self.state = None;
        self.round = None;
    }

    /// Drafts for every row, at most `limits[r]` tokens for row `r`. A draft model feeds
    /// `last` and each draft in a round of its own, so it can keep what the target keeps.
    pub fn propose(&mut self, contexts: &[&[u32]], limits: &[usize]) -> strata_model::Result<Vec<Vec<u32>>> {
        match &self.source {
            DraftSource::Ngram => {
                Ok(contexts.iter().zip(limits).map(|(c, &limit)| ngram_draft(c, self.tokens.min(limit))).collect())
            }
            DraftSource::Model(model) => {
                let state = self.state.as_mut().ok_or_else(|| strata_model::ModelError::Invalid("draft state missing".into()))?;
                self.round = Some(model.open_round(state));
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
                    input = logits.argmax(1)?.to_vec1::<u32>()?;
                    for (d, &t) in drafts.iter_mut().zip(&input) {
                        d.push(t);
                    }
                }
                for (d, &limit) in drafts.iter_mut().zip(limits) {
                    d.truncate(limit);
                }
                Ok(drafts)
            }
        }
    }

    /// Ends the step: the draft model keeps what the target kept.
    pub fn settle(&mut self, keep: &[usize]) -> strata_model::Result<()> {
        if let (DraftSource::Model(model), Some(state), Some(round)) = (&self.source, &mut self.state, self.round.take()) {
            model.close_round(state, round, keep)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
