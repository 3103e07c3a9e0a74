//! Structured output: a row's tokens held to a JSON schema, a regular expression, a Lark grammar
//! or a list of choices. llguidance computes, from the tokens so far, which tokens may come next
//! (a bit per vocabulary entry); the sampler only ever sees those.
//!
//! A grammar is compiled once per request ([`Grammars::compile`], where a bad one is the
//! requester's error) and each row runs its own copy ([`Constraint`]). Rows only advance by
//! tokens that stand, so speculative drafts need no rollback here: a position's mask is
//! computed once the tokens before it are accepted, and a draft outside it is rejected.

use std::fmt;
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use strata_model::Tokenizer;
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};

/// What a row's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Structure {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A value valid under this JSON schema.
    JsonSchema(Value),
    /// A regular expression, matched whole.
    Regex(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl Structure {
    fn grammar(&self) -> Result<TopLevelGrammar, String> {
        // Compact JSON: with whitespace free to vary, a weak model can spend its whole budget
        // on indentation.
        let compact = |mut schema: Value| {
            if let Some(object) = schema.as_object_mut() {
                object.entry("x-guidance").or_insert_with(|| json!({"whitespace_flexible": false}));
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        Ok(match self {
            Structure::JsonObject => compact(json!({"type": "object"})),
            Structure::JsonSchema(schema) => match schema {
                Value::Object(_) => compact(schema.clone()),
                // `true` accepts any value, `false` none.
                Value::Bool(_) => compact(json!({"anyOf": [schema]})),
                _ => return Err("the JSON schema must be an object or a boolean".into()),
            },
            Structure::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Structure::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Structure::Choice(options) => {
                if options.is_empty() {
                    return Err("the list of choices is empty".into());
                }
                let quoted: Vec<String> = options.iter().map(|o| Value::String(o.clone()).to_string()).collect();
                TopLevelGrammar::from_lark(format!("start: {}", quoted.join(" | ")))
            }
        })
    }
}

/// Compiles structures over one model's vocabulary: the token trie over every token's bytes,
/// built once per model.
pub struct Grammars {
    factory: ParserFactory,
    eos: u32,
}

impl Grammars {
    /// `vocab_size`: the model's output width; `eos`: a token that ends the output (the one
    /// llguidance's masks allow where a structure may end; every stop token of a row follows it).
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, eos: u32) -> Result<Self, String> {
        let words = tokenizer.token_bytes(vocab_size, TokTrie::SPECIAL_TOKEN_MARKER);
        let trie = TokTrie::from(&TokRxInfo::new(vocab_size as u32, eos), &words);
        let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Self { factory, eos })
    }

    /// Compiles `structure`; the error says why it cannot be used. With `starts_after`, output
    /// is free until that token (a reasoning model's end of thinking), held to the structure
    /// after it.
    pub fn compile(&self, structure: &Structure, starts_after: Option<u32>) -> Result<Arc<Grammar>, String> {
        let parser = self.factory.create_parser(structure.grammar()?).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(error);
        }
        let key = xxhash_rust::xxh3::xxh3_64(format!("{structure:?} {starts_after:?}").as_bytes());
        Ok(Arc::new(Grammar { fresh: Mutex::new(matcher), eos: self.eos, starts_after, key }))
    }
}

/// A compiled structure, shared by the rows that follow it.
pub struct Grammar {
    /// The matcher before any token; each row runs a deep copy.
    fresh: Mutex<Matcher>,
    eos: u32,
    starts_after: Option<u32>,
    /// Identifies the structure (generation checkpoints of different ones never mix).
    pub key: u64,
}

impl fmt::Debug for Grammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Grammar({:016x})", self.key)
    }
}

/// The tokens one position may take: a bit per vocabulary entry (bit `i % 32` of word `i / 32`),
/// as llguidance computes them and the argmax kernels read them.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenMask {
    words: Vec<u32>,
}

impl TokenMask {
    /// A mask that allows nothing: the structure cannot go on.
    fn nothing() -> Self {
        Self { words: Vec::new() }
    }

    pub fn words(&self) -> &[u32] {
        &self.words
    }

    pub fn allows(&self, token: u32) -> bool {
        self.words.get(token as usize / 32).is_some_and(|w| w >> (token % 32) & 1 == 1)
    }

    /// Whether no token is allowed.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// Sets every logit the mask does not allow to minus infinity.
    pub fn restrict(&self, logits: &mut [f32]) {
        let covered = logits.len().min(self.words.len() * 32);
        let (head, tail) = logits.split_at_mut(covered);
        for (&word, chunk) in self.words.iter().zip(head.chunks_mut(32)) {
            if word == u32::MAX {
                continue;
            }
            for (bit, logit) in chunk.iter_mut().enumerate() {
                if word >> bit & 1 == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        tail.fill(f32::NEG_INFINITY);
    }

    fn set(&mut self, token: u32, allowed: bool) {
        if let Some(word) = self.words.get_mut(token as usize / 32) {
            let bit = 1 << (token % 32);
            *word = if allowed { *word | bit } else { *word & !bit };
        }
    }
}

/// One row's progress through its grammar.
pub struct Constraint {
    matcher: Matcher,
    eos: u32,
    /// Output is free until this token is emitted.
    waiting_for: Option<u32>,
}

/// Where a row stands after a token.
#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    /// More may follow.
    Open,
    /// The structure is complete and nothing more can follow: the output ends.
    Complete,
}

impl Constraint {
    pub fn new(grammar: &Grammar) -> Self {
        let fresh = grammar.fresh.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Self { matcher: fresh.deep_clone(), eos: grammar.eos, waiting_for: grammar.starts_after }
    }

    /// How many of `drafts`, proposed to follow the row's tokens, the structure allows in a row:
    /// the rest are not worth a forward. A stop token ends the drafts (the row may end there
    /// next step instead).
    pub fn allowed_drafts(&mut self, drafts: &[u32], stop_tokens: &[u32]) -> usize {
        let free = match self.waiting_for {
            Some(start) => drafts.iter().position(|&d| d == start).map_or(drafts.len(), |at| at + 1),
            None => 0,
        };
        let rest = &drafts[free..];
        let body = &rest[..rest.iter().position(|t| stop_tokens.contains(t)).unwrap_or(rest.len())];
        free + self.matcher.validate_tokens(body).unwrap_or(0)
    }

    /// The masks of a step's positions: after the row's tokens, then after each of `drafts`
    /// (allowed ones, see [`Self::allowed_drafts`], fed to the matcher for the purpose and taken
    /// back). `None` where the output is still free. The row's `stop_tokens` are allowed exactly
    /// where the structure may end. Stops after a draft that completes the structure (nothing
    /// follows it); a mask that allows nothing says the structure cannot go on (logged).
    pub fn masks(&mut self, drafts: &[u32], stop_tokens: &[u32]) -> Vec<Option<TokenMask>> {
        let mut waiting = self.waiting_for;
        let (mut masks, mut fed) = (Vec::with_capacity(drafts.len() + 1), 0);
        for j in 0..=drafts.len() {
            masks.push(waiting.is_none().then(|| self.mask(stop_tokens)));
            let Some(&draft) = drafts.get(j) else { break };
            if let Some(start) = waiting {
                waiting = (draft != start).then_some(start);
                continue;
            }
            if self.matcher.consume_token(draft).is_err() {
                break;
            }
            fed += 1;
            if self.matcher.is_stopped() {
                break;
            }
        }
        if let Err(e) = self.matcher.rollback(fed) {
            tracing::warn!("structured output: taking drafts back failed: {e}");
        }
        masks
    }

    fn mask(&mut self, stop_tokens: &[u32]) -> TokenMask {
        match self.matcher.compute_mask() {
            Ok(vob) => {
                let may_end = vob.is_allowed(self.eos);
                let mut mask = TokenMask { words: vob.as_slice().to_vec() };
                // llguidance's end of output is the row's stop tokens.
                mask.set(self.eos, false);
                for &t in stop_tokens {
                    mask.set(t, may_end);
                }
                mask
            }
            Err(e) => {
                tracing::warn!("structured output ends early: {e}");
                TokenMask::nothing()
            }
        }
    }

    /// Feeds a token that stands (a stop token is never fed: it ends the row).
    pub fn advance(&mut self, token: u32) -> Result<Progress, String> {
        if let Some(start) = self.waiting_for {
            self.waiting_for = (token != start).then_some(start);
            return Ok(Progress::Open);
        }
        self.matcher.consume_token(token).map_err(|e| e.to_string())?;
        Ok(if self.matcher.is_stopped() { Progress::Complete } else { Progress::Open })
    }
}
