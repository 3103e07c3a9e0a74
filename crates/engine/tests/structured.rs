//! Structured output on a random-weight fixture, whose free output is noise: every constrained
//! output is checked by a reader independent of llguidance (serde_json and the schema's rules,
//! the regex crate, the choice list), sampled and greedy, in a batch mixed with free rows, with
//! prompt-lookup drafts, after prompt-cache hits and from a generation checkpoint; greedy
//! constrained rows give what the single-sequence loop gives.

use std::sync::mpsc;
use std::time::Duration;

use candle_core::{DType, Device};
use serde_json::{json, Value};
use strata_engine::structured::Constraint;
use strata_engine::{
    generate, CacheConfig, DraftSource, EngineConfig, Event, FinishReason, GenerationOptions, Grammars, Job, SamplingParams,
    Speculation, Structure, Worker,
};
use strata_model::{Model, ModelFolder, Tokenizer};

mod common;
use common::{fixtures, prompt_tokens, Channel};

struct Fixture {
    model: Model,
    tokenizer: Tokenizer,
    grammars: Grammars,
    eos: Vec<u32>,
    prompt: Vec<u32>,
    vocab_size: usize,
}

fn fixture() -> Fixture {
    let dir = &fixtures()[0];
    let folder = ModelFolder::open(dir).unwrap();
    let eos = folder.eos_token_ids();
    let vocab_size = folder.config.vocab_size;
    let grammars = Grammars::new(&folder.tokenizer, vocab_size, eos[0]).unwrap();
    let model = folder.load(DType::F32, &Device::Cpu).unwrap();
    let prompt = prompt_tokens(dir);
    Fixture { model, tokenizer: folder.tokenizer, grammars, eos, prompt, vocab_size }
}

/// A bounded schema: nested objects, an array with `maxItems`, strings with `maxLength`, an
/// enum and required fields.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "kind": {"enum": ["cat", "dog", "owl"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "home": {
                "type": "object",
                "properties": {"zip": {"type": "integer", "minimum": 0, "maximum": 99999}, "ok": {"type": "boolean"}},
                "required": ["zip", "ok"],
                "additionalProperties": false
            }
        },
        "required": ["name", "kind", "tags", "home"],
        "additionalProperties": false
    })
}

/// Checks `text` against [`schema`] by its rules, independently of llguidance.
fn check_schema(text: &str) -> Result<(), String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let o = v.as_object().ok_or("not an object")?;
    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
    let mut sorted = keys.clone();
    sorted.sort_unstable();
    if sorted != ["home", "kind", "name", "tags"] {
        return Err(format!("keys {keys:?}"));
    }
    let short = |v: &Value, n: usize| v.as_str().is_some_and(|s| s.chars().count() <= n);
    if !short(&o["name"], 8) {
        return Err("name".into());
    }
    if !["cat", "dog", "owl"].iter().any(|k| o["kind"] == *k) {
        return Err("kind".into());
    }
    let tags = o["tags"].as_array().ok_or("tags")?;
    if tags.len() > 3 || !tags.iter().all(|t| short(t, 4)) {
        return Err("tags".into());
    }
    let home = o["home"].as_object().ok_or("home")?;
    let zip_ok = home.get("zip").and_then(Value::as_i64).is_some_and(|z| (0..=99999).contains(&z));
    if home.len() != 2 || !zip_ok || !home.get("ok").is_some_and(Value::is_boolean) {
        return Err("home".into());
    }
    Ok(())
}

const REGEX: &str = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)";
const LARK: &str = r#"start: sum
sum: term ("+" term)*
term: NUMBER | "(" sum ")"
NUMBER: /[0-9]{1,3}/"#;
/// What [`LARK`] accepts, as a regular expression (its nesting bounded by the output budget;
/// the check below removes parentheses from the inside out).
fn check_lark(text: &str) -> bool {
    let flat = regex::Regex::new(r"^[0-9]{1,3}(\+[0-9]{1,3})*$").unwrap();
    let inner = regex::Regex::new(r"\(([0-9]{1,3}(\+[0-9]{1,3})*)\)").unwrap();
    let mut text = text.to_string();
    loop {
        let next = inner.replace_all(&text, "0").into_owned();
        if next == text {
            return flat.is_match(&text);
        }
        text = next;
    }
}

fn structures() -> Vec<Structure> {
    vec![
        Structure::JsonSchema(schema()),
        Structure::Regex(REGEX.into()),
        Structure::Lark(LARK.into()),
        Structure::Choice(vec!["alpha".into(), "beta gamma".into(), "δ".into()]),
    ]
}

fn check(structure: &Structure, text: &str) -> Result<(), String> {
    let ok = match structure {
        Structure::JsonSchema(_) => return check_schema(text),
        Structure::Regex(rx) => regex::Regex::new(&format!("^(?:{rx})$")).unwrap().is_match(text),
        Structure::Lark(_) => check_lark(text),
        Structure::Choice(options) => options.iter().any(|o| o == text),
        other => unreachable!("{other:?} is not among the structures under test"),
    };
    if ok {
        Ok(())
    } else {
        Err("no match".into())
    }
}

fn options(f: &Fixture, structure: Option<&Structure>, sampling: SamplingParams) -> GenerationOptions {
    GenerationOptions {
        max_tokens: 160,
        sampling,
        stop_tokens: f.eos.clone(),
        prefill_chunk: 16,
        logprobs: None,
        grammar: structure.map(|s| f.grammars.compile(s, None).unwrap()),
    }
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 1.0, seed: Some(seed), ..SamplingParams::greedy() }
}

fn submit(worker: &Worker, prompt: &[u32], opts: GenerationOptions) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    worker.submit(Job::new(prompt.to_vec(), opts, Box::new(Channel(tx)))).unwrap();
    rx
}

fn collect(rx: &mpsc::Receiver<Event>) -> (Vec<u32>, FinishReason) {
    let mut tokens = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(300)).expect("the engine answers") {
            Event::Token(s) => tokens.push(s.id),
            Event::Finished(g) => {
                assert_eq!(g.tokens, tokens);
                return (tokens, g.finish);
            }
            Event::Failed(e) => panic!("generation failed: {e}"),
            Event::Started { .. } => {}
        }
    }
}

fn worker(cache: CacheConfig, speculation: Option<Speculation>) -> Worker {
    let config = EngineConfig { max_batch: 16, prefill_chunk: 16, ..EngineConfig::for_device(&Device::Cpu) };
    let model = ModelFolder::open(&fixtures()[0]).unwrap().load(DType::F32, &Device::Cpu).unwrap();
    Worker::spawn(model, config, cache, speculation).unwrap()
}

#[test]
fn token_bytes_spell_what_the_tokenizer_decodes() {
    let f = fixture();
    let words = f.tokenizer.token_bytes(f.tokenizer.vocab_size(), 0xFF);
    let mut checked = 0;
    for (id, bytes) in words.iter().enumerate() {
        let Ok(text) = std::str::from_utf8(bytes) else { continue };
        if bytes.first() == Some(&0xFF) {
            continue;
        }
        // Decoding one token alone may drop a leading space (`add_prefix_space`); two
        // tokens keep the second's bytes exactly.
        let both = f.tokenizer.decode(&[67, id as u32], false).unwrap();
        assert_eq!(both, format!("a{text}"), "token {id}");
        checked += 1;
    }
    // Every token but the lone bytes 0x80..=0xFF (no UTF-8 alone) and the specials.
    assert!(checked > 350, "{checked} tokens checked");
}

#[test]
fn sampled_outputs_follow_their_structure_in_a_speculative_batch_with_free_rows() {
    let f = fixture();
    let ngram = Speculation { source: DraftSource::Ngram, tokens: 4 };
    let worker = worker(CacheConfig::for_device(&Device::Cpu), Some(ngram));
    let structures = structures();
    // Two rounds of 16 rows: the second's prompts are the first's, so they start from the
    // prompt cache.
    for round in 0..2 {
        let jobs: Vec<_> = (0..16u64)
            .map(|i| {
                let structure = (i % 5 != 4).then(|| &structures[i as usize % 5]);
                let prompt = &f.prompt[..8 + i as usize];
                (structure, submit(&worker, prompt, options(&f, structure, sampled(100 * round + i))))
            })
            .collect();
        for (i, (structure, rx)) in jobs.iter().enumerate() {
            let (tokens, finish) = collect(rx);
            let Some(structure) = structure else { continue };
            let text = f.tokenizer.decode(&tokens, false).unwrap();
            assert_eq!(finish, FinishReason::Stop, "round {round} row {i}: {text:?}");
            check(structure, &text).unwrap_or_else(|e| panic!("round {round} row {i} ({structure:?}): {e}: {text:?}"));
        }
    }
    let cache = worker.cache_stats();
    assert!(cache.ram_hits.load(std::sync::atomic::Ordering::Relaxed) > 0, "the second round hit the prompt cache");
    assert!(worker.stats().structured_masks.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

#[test]
fn greedy_constrained_rows_match_the_single_sequence_loop() {
    let f = fixture();
    let structures = structures();
    let worker = worker(CacheConfig::off(), Some(Speculation { source: DraftSource::Ngram, tokens: 3 }));
    let jobs: Vec<_> = structures
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let opts = options(&f, Some(s), SamplingParams::greedy());
            (s, opts.clone(), submit(&worker, &f.prompt[..10 + i], opts))
        })
        .collect();
    for (i, (structure, opts, rx)) in jobs.into_iter().enumerate() {
        let (batched, _) = collect(&rx);
        let solo = generate(&f.model, &f.prompt[..10 + i], &opts, |_| true).unwrap();
        assert_eq!(batched, solo.tokens, "{structure:?}");
        let text = f.tokenizer.decode(&solo.tokens, false).unwrap();
        check(structure, &text).unwrap_or_else(|e| panic!("{structure:?}: {e}: {text:?}"));
    }
}

#[test]
fn a_structure_cut_short_by_max_tokens_ends_with_length() {
    let f = fixture();
    let opts = GenerationOptions { max_tokens: 5, ..options(&f, Some(&Structure::JsonSchema(schema())), sampled(7)) };
    let generation = generate(&f.model, &f.prompt, &opts, |_| true).unwrap();
    assert_eq!(generation.finish, FinishReason::Length);
    let text = f.tokenizer.decode(&generation.tokens, false).unwrap();
    assert!(text.starts_with("{\""), "{text:?}");
}

#[test]
fn bad_structures_are_refused_with_the_reason() {
    let f = fixture();
    let cases = [
        (Structure::Regex("[a-".into()), "regex"),
        (Structure::Lark("start: undefined_rule".into()), "undefined_rule"),
        (Structure::JsonSchema(json!({"type": "no-such-type"})), "no-such-type"),
        (Structure::JsonSchema(json!([1, 2])), "object"),
        (Structure::Choice(vec![]), "empty"),
    ];
    for (structure, needle) in cases {
        let error = f.grammars.compile(&structure, None).unwrap_err();
        assert!(error.to_lowercase().contains(needle), "{structure:?}: {error}");
    }
}

#[test]
fn output_is_free_until_thinking_ends() {
    let f = fixture();
    let think_end = f.tokenizer.token_id("</think>").unwrap();
    let grammar = f.grammars.compile(&Structure::Choice(vec!["yes".into(), "no".into()]), Some(think_end)).unwrap();
    let mut constraint = Constraint::new(&grammar);
    assert_eq!(constraint.masks(&[], &f.eos), [None]);
    constraint.advance(think_end).unwrap();
    let [Some(mask)] = &constraint.masks(&[], &f.eos)[..] else { panic!("one mask after thinking") };
    let allowed = (0..f.vocab_size as u32).filter(|&t| mask.allows(t)).count();
    assert!(allowed > 0 && allowed < 10, "{allowed} tokens may start yes or no");
    assert!(!f.eos.iter().any(|&t| mask.allows(t)), "nothing to end on yet");
}

/// A speculative step's masks: drafts the structure refuses are cut before the forward; the
/// masks of the drafted positions are those of a row advanced token by token, through the end
/// of thinking; none follows a draft that completes the structure; the row is left where it was.
#[test]
fn drafted_positions_get_the_masks_of_a_row_advanced_token_by_token() {
    let f = fixture();
    let think_end = f.tokenizer.token_id("</think>").unwrap();
    let grammar = f.grammars.compile(&Structure::Regex("(ab|cd)+e".into()), Some(think_end)).unwrap();
    let thinking = f.tokenizer.encode("hm").unwrap();
    let body = f.tokenizer.encode("abcdabe").unwrap();
    let refused = f.tokenizer.encode("a").unwrap();
    let drafts: Vec<u32> = [&thinking[..], &[think_end], &body, &refused].concat();

    let mut row = Constraint::new(&grammar);
    let allowed = row.allowed_drafts(&drafts, &f.eos);
    assert_eq!(allowed, drafts.len() - refused.len(), "nothing follows the closing e");
    let masks = row.masks(&drafts[..allowed], &f.eos);
    assert_eq!(masks.len(), allowed, "no mask after the draft that completes the structure");

    let mut stepped = Constraint::new(&grammar);
    for (j, mask) in masks.iter().enumerate() {
        assert_eq!(*mask, stepped.masks(&[], &f.eos).pop().unwrap(), "position {j}");
        assert_eq!(mask.is_none(), j <= thinking.len(), "free through the end of thinking, position {j}");
        if let Some(mask) = mask {
            assert!(mask.allows(drafts[j]), "position {j}'s draft is allowed");
        }
        stepped.advance(drafts[j]).unwrap();
    }
    // Taken back: the row's next masks are a fresh row's, and a stop token is not drafted.
    assert_eq!(row.masks(&[], &f.eos), Constraint::new(&grammar).masks(&[], &f.eos));
    let mut fresh = Constraint::new(&grammar);
    fresh.advance(think_end).unwrap();
    assert_eq!(fresh.allowed_drafts(&[f.eos[0]], &f.eos), 0);
}
