//! `tokenizer.json` through the `tokenizers` crate, and streaming detokenisation.

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::error::{ModelError, Result};
use crate::literal::Literal;

/// Bytes of a long text tokenized at a time: the tokenizers crate's working memory is a few
/// hundred bytes per byte of text (3.6 GB for a 15 MB prompt, tokenized whole).
const PIECE_BYTES: usize = 64 * 1024;

/// How far tokenizing a long text may go: it stops with [`ModelError::TooLong`] once past
/// `max_tokens`, with [`ModelError::Cancelled`] once `cancelled` is set (both checked between
/// pieces of [`PIECE_BYTES`]), so the work and memory spent are bounded by the limit, not by
/// the text.
pub struct Bound<'a> {
    pub max_tokens: usize,
    pub cancelled: &'a AtomicBool,
}

impl Bound<'static> {
    pub fn none() -> Self {
        static NEVER: AtomicBool = AtomicBool::new(false);
        Bound { max_tokens: usize::MAX, cancelled: &NEVER }
    }
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<String>,
    eos: Option<String>,
    /// Made on first use: a copy of `inner` that reads every added token's string as plain
    /// text, and the matcher that finds those strings in request text.
    as_text: OnceLock<tokenizers::Tokenizer>,
    literal: OnceLock<Literal>,
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(ModelError::file(path, "missing: the model folder needs a tokenizer.json"));
        }
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|e| ModelError::file(path, format!("not a valid tokenizer: {e}")))?;
        Ok(Self::new(inner, None, None))
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
        let (bos, eos) = (name(built.bos), name(built.eos));
        Ok(Self::new(built.tokenizer, bos, eos))
    }

    /// A tokenizer for random weights with no vocabulary of their own (`--synthetic` shapes):
    /// token `i` is the word `<i>`, and a text is such words separated by spaces.
    pub fn numbered(vocab_size: u32) -> Result<Self> {
        let model = tokenizers::models::wordlevel::WordLevel::builder()
            .vocab((0..vocab_size).map(|id| (format!("<{id}>"), id)).collect())
            .build()
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::new(model);
        inner.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::WhitespaceSplit));
        Ok(Self::new(inner, None, None))
    }

    fn new(inner: tokenizers::Tokenizer, bos: Option<String>, eos: Option<String>) -> Self {
        Self { inner, bos, eos, as_text: OnceLock::new(), literal: OnceLock::new() }
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
        self.encode_prompt_within(text, &Bound::none())
    }

    /// [`Self::encode_prompt`] within `bound`.
    pub fn encode_prompt_within(&self, text: &str, bound: &Bound) -> Result<Vec<u32>> {
        let ids = self.encode_pieces(text, bound, |piece| {
            let enc = self.inner.encode(&text[piece], false).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
            Ok(enc.get_ids().to_vec())
        })?;
        // The post-processor reads the ids alone.
        let tokens = ids.into_iter().map(|id| tokenizers::Token::new(id, String::new(), (0, 0))).collect();
        let enc = self
            .inner
            .post_process(tokenizers::Encoding::from_tokens(tokens, 0), None, true)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text`. Special-token strings in the text (e.g. `<|im_start|>` from a chat
    /// template) map to their ids; no BOS/EOS is added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of a rendered chat prompt in which the byte ranges `typed` are added-token
    /// strings that came from the request (see [`Literal`]): those are tokenized as the text
    /// they are; only the template's own markup yields added tokens.
    pub fn encode_rendered(&self, text: &str, typed: &[Range<usize>], bound: &Bound) -> Result<Vec<u32>> {
        self.encode_pieces(text, bound, |piece| {
            // Pieces are never cut inside an added-token string, so a typed one is in one piece.
            let typed: Vec<Range<usize>> =
                typed.iter().filter(|r| piece.contains(&r.start)).map(|r| r.start - piece.start..r.end - piece.start).collect();
            self.encode_rendered_piece(&text[piece], &typed)
        })
    }

    fn encode_rendered_piece(&self, text: &str, typed: &[Range<usize>]) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        if typed.is_empty() {
            return Ok(enc.get_ids().to_vec());
        }
        // The added tokens split the text into pieces the tokenizer reads one by one: a piece
        // between two of the template's is kept as it was tokenized unless it holds a typed
        // one, then it is tokenized again with added tokens read as text. (A pre-tokenizer that
        // marks only the text's start, SentencePiece's `▁` prepended "first", marks that
        // piece's start too: there alone the tokens differ from the whole text's read as text.)
        let added = self.inner.get_added_vocabulary().get_added_tokens_decoder();
        let is_typed = |start: usize, end: usize| typed.iter().any(|r| r.start < end && start < r.end);
        let tokens = enc.get_ids();
        let mut ids = Vec::with_capacity(tokens.len());
        // Where the current piece starts in the text and in `tokens`, and whether it holds a
        // typed added token.
        let mut piece = (0, 0, false);
        for (i, (&id, &(start, end))) in tokens.iter().zip(enc.get_offsets()).enumerate() {
            match (added.contains_key(&id), is_typed(start, end)) {
                (true, false) => {
                    self.push_piece(&mut ids, &text[piece.0..start], &tokens[piece.1..i], piece.2)?;
                    ids.push(id);
                    piece = (end, i + 1, false);
                }
                (true, true) => piece.2 = true,
                (false, _) => {}
            }
        }
        self.push_piece(&mut ids, &text[piece.0..], &tokens[piece.1..], piece.2)?;
        Ok(ids)
    }

    /// Tokenizes a text piece by piece with `encode`, each piece (but the last) ending before a
    /// space that follows a non-space, outside any added-token string: where the tokenizers of
    /// these models split their words anyway, so the ids are those of the whole text. A piece
    /// with no such space (text without spaces, as Chinese is) ends at a character boundary,
    /// where its tokens may differ from the whole text's.
    fn encode_pieces(
        &self,
        text: &str,
        bound: &Bound,
        mut encode: impl FnMut(Range<usize>) -> Result<Vec<u32>>,
    ) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut start = 0;
        loop {
            if bound.cancelled.load(Ordering::Relaxed) {
                return Err(ModelError::Cancelled);
            }
            let end = self.piece_end(text, start);
            ids.extend(encode(start..end)?);
            if ids.len() > bound.max_tokens {
                return Err(ModelError::TooLong(bound.max_tokens));
            }
            if end == text.len() {
                return Ok(ids);
            }
            start = end;
        }
    }

    fn piece_end(&self, text: &str, start: usize) -> usize {
        if text.len() - start <= PIECE_BYTES {
            return text.len();
        }
        let end = floor_char_boundary(text, start + PIECE_BYTES);
        let search = start + PIECE_BYTES / 2..end;
        // The added-token strings that may hold a cut in `search`.
        let longest = self.literal().longest();
        let lo = floor_char_boundary(text, search.start.saturating_sub(longest));
        let hi = floor_char_boundary(text, (end + longest).min(text.len()));
        let added = self.literal().spans(&text[lo..hi]);
        let in_added = |p: usize| added.iter().any(|r| lo + r.start < p && p < lo + r.end);
        let bytes = text.as_bytes();
        search.rev().find(|&p| bytes[p] == b' ' && !bytes[p - 1].is_ascii_whitespace() && !in_added(p)).unwrap_or(end)
    }

    fn push_piece(&self, ids: &mut Vec<u32>, text: &str, tokens: &[u32], typed: bool) -> Result<()> {
        if typed {
            let enc = self.as_text().encode(text, false).map_err(|e| ModelError::Tokenizer(e.to_string()))?;
            ids.extend_from_slice(enc.get_ids());
        } else {
            ids.extend_from_slice(tokens);
        }
        Ok(())
    }

    fn as_text(&self) -> &tokenizers::Tokenizer {
        self.as_text.get_or_init(|| {
            // Special tokens can be read as text; the others are made special to be so too.
            let mut copy = self.inner.clone();
            let all = copy.get_added_tokens_decoder().into_values().map(|token| token.special(true));
            copy.add_special_tokens(all).expect("re-adding the tokenizer's own added tokens");
            copy.set_encode_special_tokens(true);
            copy
        })
    }

    /// The matcher of this tokenizer's added-token strings, for [`Literal`] rendering.
    pub fn literal(&self) -> &Literal {
        self.literal.get_or_init(|| {
            let added = self.inner.get_added_vocabulary().get_added_tokens_decoder();
            Literal::new(added.values().map(|token| (token.content.clone(), token.special)))
        })
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

    /// Every token's bytes, by id, for `vocab_size` ids (a model's output width may exceed the
    /// tokenizer's). Special added tokens start with `special_marker` (so a grammar's text never
    /// matches them); ids the tokenizer lacks are the marker alone.
    pub fn token_bytes(&self, vocab_size: usize, special_marker: u8) -> Vec<Vec<u8>> {
        use tokenizers::decoders::DecoderWrapper;
        let byte_level = match self.inner.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => true,
            Some(DecoderWrapper::Sequence(seq)) => seq.get_decoders().iter().any(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
            _ => false,
        };
        let unicode_to_byte: std::collections::HashMap<char, u8> = byte_level_alphabet().map(|(b, c)| (c, b)).collect();
        let added = self.inner.get_added_vocabulary().get_added_tokens_decoder();
        (0..vocab_size as u32)
            .map(|id| {
                if let Some(token) = added.get(&id) {
                    let mut bytes = if token.special { vec![special_marker] } else { Vec::new() };
                    bytes.extend_from_slice(token.content.as_bytes());
                    return bytes;
                }
                let Some(piece) = self.inner.id_to_token(id) else { return vec![special_marker] };
                if byte_level {
                    let mut bytes = Vec::with_capacity(piece.len());
                    for c in piece.chars() {
                        match unicode_to_byte.get(&c) {
                            Some(&b) => bytes.push(b),
                            None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    return bytes;
                }
                // SentencePiece: byte-fallback pieces `<0xNN>`, and `▁` for a space.
                match piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) if piece.len() == 6 => vec![b],
                    _ => piece.replace('\u{2581}', " ").into_bytes(),
                }
            })
            .collect()
    }

    /// A detokeniser that yields text as soon as it forms whole characters.
    pub fn stream(&self, skip_special: bool) -> TextStream<'_> {
        TextStream { tokenizer: self, ids: Vec::new(), prefix: 0, read: 0, skip_special }
    }
}

/// GPT-2's byte-level alphabet: each byte and the printable character a byte-level BPE writes
/// it as (printable bytes stand for themselves, the rest take characters from U+0100 on).
fn byte_level_alphabet() -> impl Iterator<Item = (u8, char)> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut shifted = 0u32;
    (0..=255u8).map(move |b| {
        if printable(b) {
            (b, char::from(b))
        } else {
            shifted += 1;
            (b, char::from_u32(255 + shifted).expect("below U+0200"))
        }
    })
}

fn floor_char_boundary(text: &str, mut i: usize) -> usize {
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
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

    use super::*;

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

    /// A numbered tokenizer's text names each id, streamed a token at a time, and reads back
    /// as the same ids.
    #[test]
    fn numbered_tokens_read_back_as_their_ids() {
        let tokenizer = Tokenizer::numbered(1000).unwrap();
        assert_eq!(tokenizer.vocab_size(), 1000);
        let ids = [7, 0, 999, 42];
        let mut stream = tokenizer.stream(true);
        let pieces: Vec<String> = ids.iter().map(|&id| stream.push(id).unwrap()).collect();
        assert_eq!(pieces, ["<7>", " <0>", " <999>", " <42>"]);
        assert_eq!(tokenizer.encode(&pieces.concat()).unwrap(), ids);
    }

    /// A long text is tokenized piece by piece into the whole text's ids, typed added-token
    /// strings included; past its bound, or once cancelled, tokenizing stops.
    #[test]
    fn long_texts_are_tokenized_in_pieces_as_whole() {
        let tokenizer = tokenizer();
        let text = "Grüße, 世界! <|im_start|>user naïve <think> 1234567   spaced\n\tand <|im_end|> x".repeat(2_000);
        assert!(text.len() > 2 * PIECE_BYTES);
        let whole = tokenizer.inner.encode(text.as_str(), true).unwrap().get_ids().to_vec();
        assert_eq!(tokenizer.encode_prompt(&text).unwrap(), whole);
        let typed: Vec<Range<usize>> = text.match_indices("<|im_start|>").map(|(i, s)| i..i + s.len()).collect();
        let as_text = tokenizer.encode_rendered(&text, &typed, &Bound::none()).unwrap();
        assert_eq!(as_text, tokenizer.encode_rendered_piece(&text, &typed).unwrap());
        assert!(as_text.len() > whole.len());

        let cancelled = AtomicBool::new(false);
        let bound = Bound { max_tokens: 1000, cancelled: &cancelled };
        assert!(matches!(tokenizer.encode_prompt_within(&text, &bound), Err(ModelError::TooLong(1000))));
        cancelled.store(true, Ordering::Relaxed);
        let bound = Bound { max_tokens: usize::MAX, cancelled: &cancelled };
        assert!(matches!(tokenizer.encode_prompt_within(&text, &bound), Err(ModelError::Cancelled)));
    }
}
