//! Speculative-decoding flags shared by `serve`, `generate` and `bench`.

use anyhow::{bail, Context, Result};
use strata_engine::{DraftSource, Speculation};
use strata_model::{Model, MtpHead};

#[derive(Clone, clap::Args)]
pub struct DraftArgs {
    /// Speculative decoding: `ngram` (prompt lookup, no model), `mtp` (a Qwen3.5 model's own
    /// multi-token-prediction head, `mtp.*` in its folder), `model:PATH` (a smaller model folder
    /// sharing the tokenizer), or `self` (the model drafts for itself: every draft is accepted,
    /// which measures the overhead ceiling). Output is unchanged: greedy tokens are identical and
    /// sampled tokens follow the same distribution.
    #[arg(long)]
    draft: Option<String>,
    /// Tokens drafted per step.
    #[arg(long, default_value_t = 4)]
    num_draft_tokens: usize,
}

impl DraftArgs {
    /// `, draft ngram ×4` for report headers (empty without speculation).
    pub fn describe(&self) -> String {
        self.draft.as_ref().map_or(String::new(), |d| format!(", draft {d} ×{}", self.num_draft_tokens))
    }

    /// The speculation settings, loading a draft model with `load_self` (the target's own
    /// weights again) or from its folder with `load_folder`, or the MTP head with `load_mtp`.
    pub fn speculation(
        &self,
        target_vocab: usize,
        load_self: impl FnOnce() -> Result<Model>,
        load_folder: impl FnOnce(&std::path::Path) -> Result<Model>,
        load_mtp: impl FnOnce() -> Result<MtpHead>,
    ) -> Result<Option<Speculation>> {
        let Some(draft) = &self.draft else { return Ok(None) };
        if self.num_draft_tokens == 0 || self.num_draft_tokens > 16 {
            bail!("--num-draft-tokens must be between 1 and 16");
        }
        let source = match draft.as_str() {
            "ngram" => DraftSource::Ngram,
            "mtp" => DraftSource::Mtp(Box::new(load_mtp().context("--draft mtp")?)),
            "self" => DraftSource::Model(Box::new(load_self()?)),
            spec => match spec.strip_prefix("model:") {
                Some(path) => {
                    let model = load_folder(std::path::Path::new(path)).with_context(|| format!("--draft {spec}"))?;
                    let vocab = model.vocab_size();
                    if vocab != target_vocab {
                        bail!("--draft {spec}: its vocabulary has {vocab} tokens, the model's {target_vocab}; a draft model must share the tokenizer");
                    }
                    DraftSource::Model(Box::new(model))
                }
                None => bail!("--draft {spec}: expected ngram, mtp, self or model:PATH"),
            },
        };
        Ok(Some(Speculation { source, tokens: self.num_draft_tokens }))
    }
}
