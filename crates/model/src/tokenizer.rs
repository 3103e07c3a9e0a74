//! `tokenizer.json` through the `tokenizers` crate, and streaming detokenisation.

use std::path::Path;

use crate::error::{ModelError, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(ModelError::file(path, "missing: the model folder needs a tokenizer.json"));
        }
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|e| ModelError::file(path, format!("not a valid tokenizer: {e}")))?;
        Ok(Self { inner })
    }

    /// Token ids of `text`. Special-token strings in the text (e.g. `<|im_start|>` from a chat
    /// template) map to their ids; no BOS/EOS is added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// A detokeniser that yields text as soon as it forms whole characters.
    pub fn stream(&self, skip_special: bool) -> TextStream<'_> {
        TextStream { tokenizer: self, ids: Vec::new(), emitted: 0, skip_special }
    }
}

/// Incremental decoding: decodes the whole generated sequence and emits the new suffix, holding
/// it back while it ends in an incomplete UTF-8 character.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    emitted: usize,
    skip_special: bool,
}

impl TextStream<'_> {
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, self.skip_special)?;
        if text.ends_with('\u{FFFD}') || text.len() < self.emitted || !text.is_char_boundary(self.emitted) {
            return Ok(String::new());
        }
        let new = text[self.emitted..].to_string();
        self.emitted = text.len();
        Ok(new)
    }
}
