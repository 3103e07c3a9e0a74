//! Speculative-decoding flags shared by `serve`, `generate` and `bench`, and `strata
//! draft-vocab`, which lists a text's most used tokens for `--draft-vocab`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use strata_engine::{DraftSource, Speculation};
use strata_model::{Model, MtpHead};

use crate::common::open_model;

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
    /// With `--draft mtp`: draft only among these tokens, so a draft step reads their rows of
    /// the output head instead of all of them — `N`, the N lowest token ids (a byte-level BPE
    /// numbers its tokens about in order of frequency), or a JSON file holding a list of token
    /// ids (a frequency-ranked hot vocabulary, as FR-Spec builds). Output is unchanged: the
    /// target still verifies over the whole vocabulary; only what is drafted changes.
    #[arg(long, value_name = "N|FILE", requires = "draft")]
    draft_vocab: Option<String>,
}

impl DraftArgs {
    /// `, draft ngram ×4` (`, draft mtp ×4 among 32768`) for report headers (empty without
    /// speculation).
    pub fn describe(&self) -> String {
        let among = self.draft_vocab.as_ref().map_or(String::new(), |v| format!(" among {v}"));
        self.draft.as_ref().map_or(String::new(), |d| format!(", draft {d} ×{}{among}", self.num_draft_tokens))
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
        if self.draft_vocab.is_some() && draft != "mtp" {
            bail!("--draft-vocab applies to --draft mtp, not --draft {draft}");
        }
        let source = match draft.as_str() {
            "ngram" => DraftSource::Ngram,
            "mtp" => {
                let mut head = load_mtp().context("--draft mtp")?;
                if let Some(vocab) = &self.draft_vocab {
                    head.restrict_drafts(draft_vocab(vocab, target_vocab)?).context("--draft-vocab")?;
                }
                DraftSource::Mtp(Box::new(head))
            }
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

/// `strata draft-vocab`: the tokens a text uses most, as `--draft-vocab FILE` reads them.
#[derive(clap::Args)]
pub struct VocabArgs {
    /// A model folder, a .gguf file, or a Hugging Face repo id (its tokenizer counts the text).
    #[arg(long)]
    model: Option<String>,
    /// Text files like the traffic to draft for (their tokens are counted together).
    #[arg(long, required = true)]
    file: Vec<PathBuf>,
    /// Tokens to list.
    #[arg(long, default_value_t = 32768)]
    size: usize,
    /// Where to write the JSON list (default: standard output).
    #[arg(long)]
    output: Option<PathBuf>,
}

pub fn run_vocab(a: VocabArgs) -> Result<()> {
    let folder = open_model(&crate::hub::resolve_model(a.model.as_deref())?)?;
    let vocab = folder.config.vocab_size;
    if a.size == 0 || a.size > vocab {
        bail!("--size {}: expected between 1 and the vocabulary's {vocab} tokens", a.size);
    }
    let mut counts = vec![0u64; vocab];
    for path in &a.file {
        let text = std::fs::read_to_string(path).with_context(|| format!("--file {}: cannot read", path.display()))?;
        for id in folder.tokenizer.encode(&text)? {
            // A tokenizer may know ids past the output head's rows (added tokens): never drafted.
            if let Some(c) = counts.get_mut(id as usize) {
                *c += 1;
            }
        }
    }
    let ids = most_frequent(&counts, a.size);
    let (total, covered) = (counts.iter().sum::<u64>(), ids.iter().map(|&id| counts[id as usize]).sum::<u64>());
    let used = counts.iter().filter(|&&c| c > 0).count();
    eprintln!(
        "{total} tokens, {used} distinct; the {} listed cover {:.1}% of them",
        ids.len(),
        if total == 0 { 0.0 } else { 100.0 * covered as f64 / total as f64 }
    );
    let json = serde_json::to_string(&ids)?;
    match &a.output {
        Some(path) => std::fs::write(path, json + "\n").with_context(|| format!("--output {}: cannot write", path.display()))?,
        None => println!("{json}"),
    }
    Ok(())
}

/// The `size` ids counted most (the lower id first among equals), then, where the text used
/// fewer, the lowest ids it did not use (a byte-level BPE numbers its tokens about in order of
/// frequency).
fn most_frequent(counts: &[u64], size: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..counts.len() as u32).collect();
    ids.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
    ids.truncate(size);
    ids
}

/// `--draft-vocab`'s tokens: `0..N`, or the ids listed in a JSON file.
fn draft_vocab(arg: &str, target_vocab: usize) -> Result<Vec<u32>> {
    if let Ok(n) = arg.parse::<usize>() {
        if n == 0 || n > target_vocab {
            bail!("--draft-vocab {n}: expected between 1 and the vocabulary's {target_vocab} tokens");
        }
        return Ok((0..n as u32).collect());
    }
    let text =
        std::fs::read_to_string(arg).with_context(|| format!("--draft-vocab {arg}: neither a count nor a readable file"))?;
    serde_json::from_str(&text).with_context(|| format!("--draft-vocab {arg}: expected a JSON list of token ids"))
}

#[cfg(test)]
mod tests {
    use super::{draft_vocab, most_frequent};

    #[test]
    fn the_most_frequent_tokens_come_first_then_the_lowest_unused() {
        let counts = [0, 5, 2, 5, 0, 9, 1];
        assert_eq!(most_frequent(&counts, 3), vec![5, 1, 3]);
        assert_eq!(most_frequent(&counts, 7), vec![5, 1, 3, 2, 6, 0, 4]);
    }

    #[test]
    fn a_draft_vocabulary_is_a_count_or_a_list_of_ids() {
        assert_eq!(draft_vocab("3", 10).unwrap(), vec![0, 1, 2]);
        assert!(draft_vocab("0", 10).unwrap_err().to_string().contains("between 1 and the vocabulary's 10"));
        assert!(draft_vocab("11", 10).is_err());
        let dir = std::env::temp_dir().join(format!("strata-draft-vocab-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (list, bad) = (dir.join("hot.json"), dir.join("bad.json"));
        std::fs::write(&list, "[5, 1, 9]").unwrap();
        std::fs::write(&bad, "{\"tokens\": 1}").unwrap();
        assert_eq!(draft_vocab(list.to_str().unwrap(), 10).unwrap(), vec![5, 1, 9]);
        assert!(draft_vocab(bad.to_str().unwrap(), 10).unwrap_err().to_string().contains("a JSON list of token ids"));
        let missing = dir.join("missing.json");
        assert!(draft_vocab(missing.to_str().unwrap(), 10)
            .unwrap_err()
            .to_string()
            .contains("neither a count nor a readable file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
