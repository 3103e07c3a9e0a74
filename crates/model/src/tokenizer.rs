//! `tokenizer.json` through the `tokenizers` crate, and streaming detokenisation.

use std::path::Path;

use crate::error::{ModelError, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<String>,
    eos: Option<String>,
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(ModelError::file(path, "missing: the model folder needs a tokenizer.json"));
        }
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|e| ModelError::file(path, format!("not a valid tokenizer: {e}")))?;
        Ok(Self { inner, bos: None, eos: None })
    }

    /// `tokenizer.json` of a model folder, with the BOS/EOS strings `tokenizer_config.json` names
    /// (chat templates write them as `bos_token` / `eos_token`).
    pub fn from_folder(dir: &Path) -> Result<Self> {
        let mut tokenizer = Self::from_file(&dir.join("tokenizer.json"))?;
        let cfg = dir.join("tokenizer_config.json");
        if cfg.exists() {
            let json = crate::error::read_json(&cfg)?;
            // Written as a string or as an added-token object with `content`.
            let special = |name: &str| match json.get(name) {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(v) => v.get("content").and_then(|c| c.as_str()).map(str::to_string),
                None => None,
            };
            tokenizer.bos = special("bos_token");
            tokenizer.eos = special("eos_token");
        }
        Ok(tokenizer)
    }

    /// The tokenizer a GGUF file's metadata describes.
    pub fn from_gguf(metadata: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>) -> Result<Self> {
        let built = crate::gguf::tokenizer::from_metadata(metadata)?;
        let name = |id: Option<u32>| id.and_then(|id| built.tokenizer.id_to_token(id));
        Ok(Self { bos: name(built.bos), eos: name(built.eos), inner: built.tokenizer })
    }

    /// The beginning-of-sequence token, as text and id, when the model has one.
    pub fn bos(&self) -> Option<(&str, u32)> {
        let text = self.bos.as_deref()?;
        Some((text, self.inner.token_to_id(text)?))
    }

    pub fn eos_text(&self) -> Option<&str> {
        self.eos.as_deref()
    }

    /// Token ids of a plain-text prompt, with the special tokens the tokenizer adds to every
    /// sequence (e.g. BOS for Llama and Gemma), as transformers and llama.cpp do by default.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, true).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
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
