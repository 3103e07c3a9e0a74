//! The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, rebuilt as a
//! `tokenizers` tokenizer that gives the token ids llama.cpp gives.
//!
//! Two vocabulary kinds are supported:
//! - `llama`: SentencePiece as llama.cpp runs it. llama.cpp does not search for the best
//!   segmentation (Unigram Viterbi); it repeatedly merges the adjacent pair of symbols whose
//!   concatenation is the highest-scoring vocabulary piece, leftmost first on equal scores. That
//!   is a BPE whose merges are every split of a piece into two pieces, ranked by the merged
//!   piece's score, with byte fallback for characters outside the vocabulary.
//! - `gpt2`: byte-level BPE with explicit merges, after the pre-tokenizer regexes llama.cpp picks
//!   from `tokenizer.ggml.pre`.
//!
//! In both, control and unknown pieces are special added tokens (matched in text, as llama.cpp
//! does with `parse_special`, and dropped by `decode(.., true)`); user-defined pieces are plain
//! added tokens, which llama.cpp always matches as whole tokens before running the model.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::Display;
use std::hash::{BuildHasherDefault, Hasher};

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use crate::error::{ModelError, Result};

const MODEL: &str = "tokenizer.ggml.model";
const PRE: &str = "tokenizer.ggml.pre";
const TOKENS: &str = "tokenizer.ggml.tokens";
const SCORES: &str = "tokenizer.ggml.scores";
const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const MERGES: &str = "tokenizer.ggml.merges";
const BOS_ID: &str = "tokenizer.ggml.bos_token_id";
const EOS_ID: &str = "tokenizer.ggml.eos_token_id";
const UNK_ID: &str = "tokenizer.ggml.unknown_token_id";
const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
const ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

/// llama.cpp's token types (`tokenizer.ggml.token_type`) that are matched in text before the
/// model runs; absent types default to normal.
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

/// SentencePiece's word-boundary marker, which stands for a space inside pieces.
const SPACE_MARKER: &str = "\u{2581}";

/// A GGUF file's tokenizer with the BOS/EOS settings llama.cpp reads from the same metadata.
/// `tokenizer.encode(text, true)` already adds BOS/EOS per `add_bos`/`add_eos`.
pub struct GgufTokenizer {
    pub tokenizer: Tokenizer,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
}

/// Builds the tokenizer described by `tokenizer.ggml.*` in `md` (the metadata of
/// `gguf_file::Content::read`).
pub fn from_metadata(md: &HashMap<String, Value>) -> Result<GgufTokenizer> {
    let model = string(md, MODEL)?.ok_or_else(|| invalid(MODEL, "missing"))?;
    let named = strings(md, TOKENS)?.ok_or_else(|| invalid(TOKENS, "missing"))?;
    // llama.cpp renames empty pieces, which keeps them distinct.
    let named: Vec<Cow<str>> = named
        .into_iter()
        .enumerate()
        .map(|(id, piece)| if piece.is_empty() { Cow::Owned(format!("[EMPTY_{id}]")) } else { Cow::Borrowed(piece) })
        .collect();
    let pieces: Vec<&str> = named.iter().map(AsRef::as_ref).collect();
    if pieces.is_empty() {
        return Err(invalid(TOKENS, "empty"));
    }
    let types = match array(md, TOKEN_TYPE)? {
        Some(values) => values.iter().map(|v| integer(TOKEN_TYPE, v).map(|t| t as i32)).collect::<Result<Vec<_>>>()?,
        None => vec![1; pieces.len()],
    };
    if types.len() < pieces.len() {
        return Err(invalid(TOKEN_TYPE, format!("{} entries for {} tokens", types.len(), pieces.len())));
    }
    let mut vocab = Vocab::with_capacity(pieces.len());
    for (id, piece) in pieces.iter().enumerate() {
        if let Some(first) = vocab.insert(piece.to_string(), id as u32) {
            return Err(invalid(TOKENS, format!("duplicate token {piece:?} at ids {first} and {id}")));
        }
    }

    // Defaults when the keys are absent, as llama.cpp has them per vocabulary kind.
    let (mut tokenizer, default_bos, default_eos, default_add_bos) = match model {
        "llama" => (sentencepiece(md, &pieces, &types, vocab)?, Some(1), Some(2), true),
        "gpt2" => {
            let pre = string(md, PRE)?.unwrap_or("default");
            let (tokenizer, add_bos) = byte_level_bpe(md, pre, vocab)?;
            (tokenizer, None, None, add_bos)
        }
        other => {
            return Err(ModelError::Tokenizer(format!(
                "GGUF metadata `{MODEL}` is {other:?}; supported: \"llama\" (SentencePiece) and \"gpt2\" (byte-level BPE)"
            )))
        }
    };
    add_matched_pieces(&mut tokenizer, &pieces, &types)?;

    let n = pieces.len() as u32;
    let bos = token_id(md, BOS_ID, n)?.or(default_bos.filter(|&id| id < n));
    let eos = token_id(md, EOS_ID, n)?.or(default_eos.filter(|&id| id < n));
    let add_bos = boolean(md, ADD_BOS)?.unwrap_or(default_add_bos);
    let add_eos = boolean(md, ADD_EOS)?.unwrap_or(false);
    let mut template = Vec::new();
    let mut specials = Vec::new();
    if add_bos {
        specials.push(("bos", bos.ok_or_else(|| invalid(ADD_BOS, format!("is true but `{BOS_ID}` is not set")))?));
        template.push("bos");
    }
    template.push("$A");
    if add_eos {
        specials.push(("eos", eos.ok_or_else(|| invalid(ADD_EOS, format!("is true but `{EOS_ID}` is not set")))?));
        template.push("eos");
    }
    let post = TemplateProcessing::builder()
        .try_single(template)
        .map_err(ModelError::Tokenizer)?
        .special_tokens(specials)
        .build()
        .map_err(tokenizer_error)?;
    tokenizer.with_post_processor(Some(post));
    Ok(GgufTokenizer { tokenizer, bos, eos, add_bos, add_eos })
}

/// llama.cpp's SPM tokenizer as a byte-fallback BPE over the whole (space-escaped) text.
fn sentencepiece(md: &HashMap<String, Value>, pieces: &[&str], types: &[i32], vocab: Vocab) -> Result<Tokenizer> {
    let scores = floats(md, SCORES)?.ok_or_else(|| invalid(SCORES, "missing (needed by the llama tokenizer)"))?;
    if scores.len() < pieces.len() {
        return Err(invalid(SCORES, format!("{} entries for {} tokens", scores.len(), pieces.len())));
    }
    // llama.cpp's default unknown piece for this vocabulary kind is id 0.
    let unk = token_id(md, UNK_ID, pieces.len() as u32)?.unwrap_or(0);
    let merges = score_merges(pieces, types, &scores);
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .unk_token(pieces[unk as usize].to_string())
        .build()
        .map_err(|e| ModelError::Tokenizer(format!("building the llama tokenizer: {e}")))?;

    // llama.cpp puts a space before every stretch of text that starts the input or follows a
    // matched token, then escapes spaces; the normalizer runs on exactly those stretches.
    let add_space_prefix = boolean(md, ADD_SPACE_PREFIX)?.unwrap_or(true);
    let escape = Replace::new(" ", SPACE_MARKER).map_err(tokenizer_error)?;
    let unescape = Replace::new(SPACE_MARKER, " ").map_err(tokenizer_error)?;
    let mut normalizers = vec![NormalizerWrapper::from(escape)];
    let mut decoders = vec![DecoderWrapper::from(unescape), ByteFallback::new().into(), Fuse::new().into()];
    if add_space_prefix {
        normalizers.insert(0, Prepend::new(SPACE_MARKER.to_string()).into());
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_normalizer(Some(NormalizerSequence::new(normalizers))).map_err(tokenizer_error)?;
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// The merges llama.cpp's SPM tokenizer effectively applies: every split of a piece into two
/// pieces, best merged score first. Pieces matched before the model runs (control, unknown,
/// user-defined) never reach it, so they take no part. Splits of one piece sit next to each
/// other; `tokenizers` cannot give them one rank, so where two splits of the same piece
/// compete at overlapping positions the longer left part wins rather than the leftmost.
fn score_merges(pieces: &[&str], types: &[i32], scores: &[f32]) -> Vec<(String, String)> {
    let mergeable = |id: usize| !matches!(types[id], TYPE_UNKNOWN | TYPE_CONTROL | TYPE_USER_DEFINED);
    let ids: HashMap<&str, u32, BuildHasherDefault<Fnv1a>> =
        pieces.iter().enumerate().filter(|&(id, _)| mergeable(id)).map(|(id, &piece)| (piece, id as u32)).collect();
    let mut ranked = Vec::new();
    for (id, piece) in pieces.iter().enumerate().filter(|&(id, _)| mergeable(id)) {
        for (split, _) in piece.char_indices().skip(1) {
            if let (Some(&left), Some(&right)) = (ids.get(&piece[..split]), ids.get(&piece[split..])) {
                // llama.cpp compares scores as floats, where -0.0 == 0.0; adding 0.0 turns -0.0
                // into 0.0 so the total order below agrees.
                ranked.push((scores[id] + 0.0, id as u32, split as u32, left, right));
            }
        }
    }
    ranked.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(b.2.cmp(&a.2)));
    ranked
        .into_iter()
        .map(|(_, _, _, left, right)| (pieces[left as usize].to_string(), pieces[right as usize].to_string()))
        .collect()
}

/// FNV-1a: the piece lookups above (two million for a 262k vocabulary) hash short strings,
/// where it is markedly cheaper than the default SipHash.
#[derive(Default)]
struct Fnv1a(u64);

impl Hasher for Fnv1a {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
        const PRIME: u64 = 0x0000_0100_0000_01b3;
        let start = if self.0 == 0 { OFFSET } else { self.0 };
        self.0 = bytes.iter().fold(start, |h, &b| (h ^ b as u64).wrapping_mul(PRIME));
    }
}

/// llama.cpp's BPE tokenizer: the pre-tokenizer regexes for `pre`, then byte-level BPE with the
/// file's merges. Returns the tokenizer and llama.cpp's default for adding BOS.
fn byte_level_bpe(md: &HashMap<String, Value>, pre: &str, vocab: Vocab) -> Result<(Tokenizer, bool)> {
    let merges = strings(md, MERGES)?.ok_or_else(|| invalid(MERGES, "missing (needed by the gpt2 tokenizer)"))?;
    let merges = merges
        .iter()
        .map(|merge| {
            // Split at the first space after the first character, as llama.cpp does.
            let at = merge.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(i, _)| i);
            at.map(|i| (merge[..i].to_string(), merge[i + 1..].to_string()))
                .ok_or_else(|| invalid(MERGES, format!("entry {merge:?} is not two tokens separated by a space")))
        })
        .collect::<Result<Vec<_>>>()?;
    let (regexes, ignore_merges, add_bos) = pre_tokenizer_regexes(pre)?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| invalid(MERGES, format!("does not fit `{TOKENS}`: {e}")))?;

    // llama.cpp applies each regex to the pieces the previous one produced, keeping both the
    // matches and the text between them.
    let mut pre_tokenizers = regexes
        .iter()
        .map(|r| {
            Split::new(SplitPattern::Regex(r.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map(PreTokenizerWrapper::from)
                .map_err(|e| ModelError::Tokenizer(format!("pre-tokenizer regex for `{PRE}` = {pre:?}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    pre_tokenizers.push(ByteLevel::new(false, false, false).into());
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(PreTokenizerSequence::new(pre_tokenizers)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    Ok((tokenizer, add_bos))
}

/// The regexes llama.cpp (`llama-vocab.cpp`) splits text with before byte-level BPE, for the
/// `tokenizer.ggml.pre` values supported here, with its `ignore_merges` and `add_bos` defaults.
fn pre_tokenizer_regexes(pre: &str) -> Result<(&'static [&'static str], bool, bool)> {
    const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    // llama.cpp spells the case-insensitive contractions out, as its regex engine lacks `(?i:)`.
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    // Qwen3.5's: Qwen2's with combining marks (`\p{M}`) kept inside words.
    const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Ok(match pre {
        "default" => (&[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"], false, false),
        "gpt-2" | "phi-2" => (&[GPT2], false, false),
        "llama3" | "llama-v3" | "llama-bpe" => (&[LLAMA3], true, true),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => (&[QWEN2], false, false),
        "qwen35" => (&[QWEN35], false, false),
        other => {
            return Err(ModelError::Tokenizer(format!(
                "GGUF metadata `{PRE}` is {other:?}; supported: \"default\", \"gpt-2\", \"llama-bpe\"/\"llama3\", \"qwen2\", \"qwen35\""
            )))
        }
    })
}

/// Registers the pieces llama.cpp matches in text before tokenizing: control and unknown pieces
/// as special tokens, user-defined pieces as plain ones, all on the raw (unnormalized) text.
fn add_matched_pieces(tokenizer: &mut Tokenizer, pieces: &[&str], types: &[i32]) -> Result<()> {
    let matched = |wanted: &[i32], special: bool| {
        pieces
            .iter()
            .zip(types)
            .filter(|(_, t)| wanted.contains(t))
            .map(|(p, _)| AddedToken::from(p.to_string(), special).normalized(false))
            .collect::<Vec<_>>()
    };
    tokenizer.add_special_tokens(matched(&[TYPE_CONTROL, TYPE_UNKNOWN], true)).map_err(tokenizer_error)?;
    tokenizer.add_tokens(matched(&[TYPE_USER_DEFINED], false)).map_err(tokenizer_error)?;
    Ok(())
}

fn tokenizer_error(e: impl Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

fn invalid(key: &str, what: impl Display) -> ModelError {
    ModelError::Invalid(format!("GGUF metadata `{key}`: {what}"))
}

fn array<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a [Value]>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Array(values)) => Ok(Some(values)),
        Some(v) => Err(invalid(key, format!("expected an array, found {:?}", v.value_type()))),
    }
}

fn strings<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<Vec<&'a str>>> {
    let Some(values) = array(md, key)? else { return Ok(None) };
    let strings = values.iter().map(|v| match v {
        Value::String(s) => Ok(s.as_str()),
        v => Err(invalid(key, format!("expected strings, found {:?}", v.value_type()))),
    });
    strings.collect::<Result<Vec<_>>>().map(Some)
}

/// Scores as floats; llama.cpp also accepts integer scores.
fn floats(md: &HashMap<String, Value>, key: &str) -> Result<Option<Vec<f32>>> {
    let Some(values) = array(md, key)? else { return Ok(None) };
    let floats = values.iter().map(|v| match v {
        Value::F32(f) => Ok(*f),
        Value::F64(f) => Ok(*f as f32),
        v => integer(key, v).map(|i| i as f32),
    });
    floats.collect::<Result<Vec<_>>>().map(Some)
}

fn integer(key: &str, v: &Value) -> Result<i64> {
    super::integer(v).map_err(|what| invalid(key, what))
}

fn string<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(invalid(key, format!("expected a string, found {:?}", v.value_type()))),
    }
}

fn boolean(md: &HashMap<String, Value>, key: &str) -> Result<Option<bool>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(invalid(key, format!("expected a bool, found {:?}", v.value_type()))),
    }
}

/// A token id key, checked against the vocabulary size `n`.
fn token_id(md: &HashMap<String, Value>, key: &str, n: u32) -> Result<Option<u32>> {
    let Some(v) = md.get(key) else { return Ok(None) };
    let id = integer(key, v)?;
    if !(0..n as i64).contains(&id) {
        return Err(invalid(key, format!("id {id} is outside the {n}-token vocabulary")));
    }
    Ok(Some(id as u32))
}
