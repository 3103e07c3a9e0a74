//! The tokenizer rebuilt from GGUF metadata: Gemma 3's against llama.cpp's token ids, and tiny
//! hand-made vocabularies whose expected ids follow from llama.cpp's algorithms by hand.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use candle_core::quantized::gguf_file::{self, Value};
use strata_model::gguf::tokenizer::{from_metadata, GgufTokenizer};

const MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// The demo model, where `scripts/fetch-demo-model.sh` puts it.
fn model_path() -> PathBuf {
    let dir = match std::env::var_os("STRATA_MODELS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is not set")).join(".cache/strata/models"),
    };
    let path = dir.join(MODEL_FILE);
    assert!(path.exists(), "{} is missing: run scripts/fetch-demo-model.sh to download it", path.display());
    path
}

/// Gemma 3's tokenizer, built once for all tests in this file.
fn gemma() -> &'static GgufTokenizer {
    static TOKENIZER: OnceLock<GgufTokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = model_path();
        let mut file = std::fs::File::open(&path).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let start = Instant::now();
        let tokenizer = from_metadata(&content.metadata).unwrap();
        eprintln!("built Gemma 3's tokenizer from GGUF metadata in {:.2?}", start.elapsed());
        tokenizer
    })
}

fn encode(tokenizer: &GgufTokenizer, text: &str, add_special: bool) -> Vec<u32> {
    tokenizer.tokenizer.encode(text, add_special).unwrap().get_ids().to_vec()
}

fn decode(tokenizer: &GgufTokenizer, ids: &[u32]) -> String {
    tokenizer.tokenizer.decode(ids, true).unwrap()
}

/// llama.cpp's ids for Gemma 3 (`scripts/reference/llama_cpp_reference.py`).
fn reference() -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gemma3/llama_cpp_reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn ids(value: &serde_json::Value) -> Vec<u32> {
    value.as_array().unwrap().iter().map(|id| id.as_u64().unwrap() as u32).collect()
}

#[test]
fn gemma3_test_strings_match_llama_cpp() {
    let tokenizer = gemma();
    let reference = reference();
    assert_eq!(tokenizer.bos.map(u64::from), reference["bos"].as_u64());
    assert_eq!(tokenizer.eos.map(u64::from), reference["eos"].as_u64());
    assert!(tokenizer.add_bos && !tokenizer.add_eos);
    assert_eq!(tokenizer.tokenizer.get_vocab_size(true) as u64, reference["n_vocab"].as_u64().unwrap());
    let cases = reference["tokenize"]["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let (name, text) = (case["name"].as_str().unwrap(), case["text"].as_str().unwrap());
        let with_bos = encode(tokenizer, text, true);
        assert_eq!(with_bos, ids(&case["ids"]), "{name}: {text:?}");
        assert_eq!(encode(tokenizer, text, false), with_bos[1..], "{name}: only BOS is added");
        // Control tokens written in the text come back only when special tokens are kept.
        assert_eq!(
            decode(tokenizer, &with_bos),
            ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>"]
                .iter()
                .fold(text.to_string(), |text, control| text.replace(control, "")),
            "{name}"
        );
        assert_eq!(tokenizer.tokenizer.decode(&with_bos[1..], false).unwrap(), text, "{name}");
    }
}

#[test]
fn gemma3_gpl3_matches_llama_cpp() {
    let tokenizer = gemma();
    let reference = &reference()["tokenize"]["gpl3"];
    let path = reference["path"].as_str().unwrap();
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert_eq!(text.len() as u64, reference["bytes"].as_u64().unwrap(), "{path} is not the text the reference tokenized");
    let start = Instant::now();
    let got = encode(tokenizer, &text, false);
    eprintln!("encoded {} bytes of GPL-3 into {} tokens in {:.2?}", text.len(), got.len(), start.elapsed());
    let want = ids(&reference["ids"]);
    if let Some(at) = got.iter().zip(&want).position(|(a, b)| a != b) {
        panic!(
            "first difference at token {at}: got {:?}, llama.cpp {:?}",
            &got[at..(at + 8).min(got.len())],
            &want[at..(at + 8).min(want.len())]
        );
    }
    assert_eq!(got.len(), want.len());
    assert_eq!(decode(tokenizer, &got), text);
}

fn strings(items: &[&str]) -> Value {
    Value::Array(items.iter().map(|s| Value::String(s.to_string())).collect())
}

fn metadata(entries: Vec<(&str, Value)>) -> HashMap<String, Value> {
    entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// A SentencePiece vocabulary where llama.cpp's greedy merging and a Viterbi search disagree:
/// in "▁abcd", "ab" (score -1) is merged first, which leaves "c" and "d" alone ("cd" is not a
/// piece), whereas the best-scoring segmentation is "▁" "a" "bcd" (-10 -10 -2 against
/// -10 -1 -10 -10).
fn tiny_spm() -> HashMap<String, Value> {
    let mut pieces: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    pieces.extend((0..=255).map(|b| format!("<0x{b:02X}>")));
    let normal = [
        ("▁", -10.0),
        ("a", -10.0),
        ("b", -10.0),
        ("c", -10.0),
        ("d", -10.0),
        ("ab", -1.0),
        ("bc", -3.0),
        ("bcd", -2.0),
        ("aa", -4.0),
    ];
    let mut scores = vec![0.0f32; pieces.len()];
    let mut types = vec![2, 3, 3];
    types.extend([6; 256]);
    for (piece, score) in normal {
        pieces.push(piece.to_string());
        scores.push(score);
        types.push(1);
    }
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    metadata(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(&pieces)),
        ("tokenizer.ggml.scores", Value::Array(scores.into_iter().map(Value::F32).collect())),
        ("tokenizer.ggml.token_type", Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
        ("tokenizer.ggml.add_eos_token", Value::Bool(true)),
    ])
}

#[test]
fn spm_merges_greedily_by_score_like_llama_cpp() {
    let tokenizer = from_metadata(&tiny_spm()).unwrap();
    // Ids: 0 <unk>, 1 <s>, 2 </s>, 3..=258 bytes, 259 ▁, 260 a, 261 b, 262 c, 263 d, 264 ab,
    // 265 bc, 266 bcd, 267 aa.
    assert!(tokenizer.add_bos && tokenizer.add_eos, "add_bos defaults to true for llama vocabularies");
    assert_eq!((tokenizer.bos, tokenizer.eos), (Some(1), Some(2)));
    // Greedy by score, not Viterbi ("▁" "a" "bcd").
    assert_eq!(encode(&tokenizer, "abcd", true), [1, 259, 264, 262, 263, 2]);
    assert_eq!(encode(&tokenizer, "abcd", false), [259, 264, 262, 263]);
    // "bc" (-3) then "bc"+"d" = "bcd" (-2): merges chain through earlier results.
    assert_eq!(encode(&tokenizer, "bcd", false), [259, 266]);
    // Equal scores: the leftmost pair is merged first.
    assert_eq!(encode(&tokenizer, "aaa", false), [259, 267, 260]);
    // Outside the vocabulary: UTF-8 bytes.
    assert_eq!(encode(&tokenizer, "ab é", false), [259, 264, 259, 3 + 0xC3, 3 + 0xA9]);
    // llama.cpp puts the space prefix before every stretch of text that follows a token.
    assert_eq!(encode(&tokenizer, "<s>ab", false), [1, 259, 264]);
    assert_eq!(decode(&tokenizer, &encode(&tokenizer, "ab é bcd", true)), "ab é bcd");
}

#[test]
fn gpt2_byte_level_bpe_with_merges() {
    let tokens = ["h", "e", "l", "o", "w", "r", "d", "Ġ", "he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "oĠ", "<|endoftext|>"];
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "o Ġ"];
    let mut types = vec![Value::I32(1); tokens.len()];
    types[16] = Value::I32(3);
    let md = |pre: &str| {
        metadata(vec![
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String(pre.into())),
            ("tokenizer.ggml.tokens", strings(&tokens)),
            ("tokenizer.ggml.merges", strings(&merges)),
            ("tokenizer.ggml.token_type", Value::Array(types.clone())),
            ("tokenizer.ggml.bos_token_id", Value::U32(16)),
        ])
    };
    for pre in ["gpt-2", "default", "llama-bpe", "qwen2"] {
        let tokenizer = from_metadata(&md(pre)).unwrap();
        // "hello" and " world" are separate words, so "o Ġ" never applies; "l" "d" stay unmerged.
        assert_eq!(encode(&tokenizer, "hello world", false), [11, 14, 2, 6], "{pre}");
        // llama.cpp adds BOS by default only for the Llama 3 pre-tokenizer.
        assert_eq!(tokenizer.add_bos, pre == "llama-bpe", "{pre}");
    }
    let mut md = md("gpt-2");
    md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
    let tokenizer = from_metadata(&md).unwrap();
    assert_eq!(encode(&tokenizer, "hello world<|endoftext|>", true), [16, 11, 14, 2, 6, 16]);
    assert_eq!(decode(&tokenizer, &encode(&tokenizer, "hello world<|endoftext|>", true)), "hello world");
}

#[test]
fn bad_metadata_names_the_key() {
    let error = |md: &HashMap<String, Value>| match from_metadata(md) {
        Ok(_) => panic!("bad metadata accepted"),
        Err(e) => e.to_string(),
    };
    let mut md = tiny_spm();
    md.remove("tokenizer.ggml.tokens");
    assert!(error(&md).contains("tokenizer.ggml.tokens"), "{}", error(&md));

    let mut md = tiny_spm();
    md.insert("tokenizer.ggml.model".into(), Value::String("rwkv".into()));
    let e = error(&md);
    assert!(e.contains("tokenizer.ggml.model") && e.contains("rwkv"), "{e}");

    let mut md = tiny_spm();
    md.remove("tokenizer.ggml.scores");
    assert!(error(&md).contains("tokenizer.ggml.scores"), "{}", error(&md));
}
