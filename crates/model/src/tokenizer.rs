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
        TextStream { tokenizer: self, ids: Vec::new(), prefix: 0, read: 0, skip_special }
    }
}

/// Incremental decoding at a constant cost a token: each step decodes only a short window —
/// the ids of the last piece emitted, as context, and those after them — and emits what the
/// window's text adds to the context's (decoding the whole sequence each step cost O(n) a
/// token, O(n²) a generation). The context keeps decoders that treat a sequence's start
/// specially (a leading space stripped) from doing so mid-text; a piece that ends in an
/// incomplete UTF-8 character waits for the tokens that complete it.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    /// The window: `ids[..read]` decode to text already emitted, `ids[prefix..read]` of it
    /// being the context.
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    skip_special: bool,
}

impl TextStream<'_> {
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let context = self.tokenizer.decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let text = self.tokenizer.decode(&self.ids[self.prefix..], self.skip_special)?;
        if text.len() <= context.len() || text.ends_with('\u{FFFD}') || !text.is_char_boundary(context.len()) {
            return Ok(String::new());
        }
        let new = text[context.len()..].to_string();
        // The ids just emitted become the next context; those before it are done with.
        self.ids.drain(..self.read);
        (self.prefix, self.read) = (0, self.ids.len());
        Ok(new)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::Tokenizer;

    fn tokenizer() -> Tokenizer {
        Tokenizer::from_folder(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5-tiny-a")).unwrap()
    }

    /// Streamed pieces join to the whole sequence's decoding — multi-byte characters split
    /// across tokens included — while the stream holds a window of a few ids, not the sequence.
    #[test]
    fn streamed_text_is_the_whole_decoding_in_a_bounded_window() {
        let tokenizer = tokenizer();
        let text = "Grüße, 世界! naïve café — 🦀🚀 emoji, ﬁ ligature, \"quotes\"\n\tand  spaces <think> 1234567 ".repeat(40);
        let ids = tokenizer.encode(&text).unwrap();
        assert!(ids.len() > 1000);
        let mut stream = tokenizer.stream(true);
        let mut joined = String::new();
        let mut widest = 0;
        for &id in &ids {
            joined.push_str(&stream.push(id).unwrap());
            widest = widest.max(stream.ids.len());
        }
        assert_eq!(joined, tokenizer.decode(&ids, true).unwrap());
        assert_eq!(joined, text);
        assert!(widest <= 8, "the stream held {widest} ids");
    }
}
