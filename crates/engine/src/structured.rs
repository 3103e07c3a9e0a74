//! Structured output: a row's tokens held to a JSON schema, a regular expression, a Lark grammar
//! or a list of choices. llguidance computes, from the tokens so far, which tokens may come next
//! (a bit per vocabulary entry); the sampler only ever sees those.
//!
//! A grammar is compiled once per request ([`Grammars::compile`], where a bad one is the
//! requester's error) and each row runs its own copy ([`Constraint`]). Rows only advance by
//! tokens that stand, so speculative drafts need no rollback here: a position's mask is
//! computed once the tokens before it are accepted, and a draft outside it is rejected.

use std::borrow::Cow;
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

    /// `logits` as the row may choose from them: every token outside the structure's mask at
    /// minus infinity, the row's `stop_tokens` standing only where the structure may end. As
    /// they are while the output is free; an error when the structure allows nothing.
    pub fn choosable<'a>(&mut self, logits: &'a [f32], stop_tokens: &[u32]) -> Result<Cow<'a, [f32]>, String> {
        if self.waiting_for.is_some() {
            return Ok(logits.into());
        }
        let mask = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        let may_end = mask.is_allowed(self.eos);
        let allowed = |i: usize| i < mask.len() && mask.is_allowed(i as u32);
        let mut out: Vec<f32> = logits.iter().enumerate().map(|(i, &l)| if allowed(i) { l } else { f32::NEG_INFINITY }).collect();
        for &t in stop_tokens {
            if let (Some(o), Some(&l)) = (out.get_mut(t as usize), logits.get(t as usize)) {
                *o = if may_end { l } else { f32::NEG_INFINITY };
            }
        }
        if out.iter().all(|&l| l == f32::NEG_INFINITY) {
            return Err("the grammar allows no token here".into());
        }
        Ok(out.into())
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
