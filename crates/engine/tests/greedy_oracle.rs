//! Generation against transformers: 24 greedy tokens per fixture, and seeded sampling that
//! repeats itself.

use std::path::PathBuf;

use candle_core::{DType, Device};
use strata_engine::{generate, FinishReason, GenerationOptions, SamplingParams};
use strata_model::ModelFolder;

mod common;
use common::{fixtures, prompt_tokens};

fn reference(dir: &PathBuf) -> (Vec<u32>, serde_json::Value) {
    (prompt_tokens(dir), serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap())
}

fn opts(sampling: SamplingParams) -> GenerationOptions {
    // No stop tokens: the oracle's greedy run does not stop at end tokens either.
    GenerationOptions { max_tokens: 24, sampling, stop_tokens: vec![], prefill_chunk: 16, logprobs: None, grammar: None }
}

#[test]
fn greedy_tokens_match_transformers() {
    for dir in fixtures() {
        let model = ModelFolder::open(&dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
        let (prompt, reference) = reference(&dir);
        let want: Vec<u32> = serde_json::from_value(reference["greedy_tokens"].clone()).unwrap();
        let mut streamed = Vec::new();
        let out = generate(&model, &prompt, &opts(SamplingParams::greedy()), |t| {
            streamed.push(t.id);
            true
        })
        .unwrap();
        assert_eq!(out.tokens, want, "{}", dir.display());
        assert_eq!(streamed, want);
        assert_eq!(out.finish, FinishReason::Length);
    }
}

/// `--mamba-ssm-cache-dtype bfloat16`: the recurrent state rounded to bf16 after every token
/// (f32 compute) keeps transformers' f32 greedy tokens on every fixture with recurrent layers.
#[test]
fn a_bf16_recurrent_state_keeps_transformers_greedy_tokens() {
    let mut ran = 0;
    for dir in fixtures() {
        let mut model = ModelFolder::open(&dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
        let recurrent = |m: &strata_model::Model| m.state_cost().bytes_per_row;
        let f32_row = recurrent(&model);
        model.set_ssm_cache_dtype(DType::BF16).unwrap();
        if recurrent(&model) == f32_row {
            continue; // no recurrent layers: nothing stored differently
        }
        let (prompt, reference) = reference(&dir);
        let want: Vec<u32> = serde_json::from_value(reference["greedy_tokens"].clone()).unwrap();
        let out = generate(&model, &prompt, &opts(SamplingParams::greedy()), |_| true).unwrap();
        assert_eq!(out.tokens, want, "{}", dir.display());
        ran += 1;
    }
    assert!(ran > 0, "no fixture has recurrent layers");
}

#[test]
fn bf16_generates_and_reports_agreement() {
    for dir in fixtures() {
        let model = ModelFolder::open(&dir).unwrap().load(DType::BF16, &Device::Cpu).unwrap();
        let (prompt, reference) = reference(&dir);
        let f32_tokens: Vec<u32> = serde_json::from_value(reference["greedy_tokens"].clone()).unwrap();
        let out = generate(&model, &prompt, &opts(SamplingParams::greedy()), |_| true).unwrap();
        assert_eq!(out.tokens.len(), 24);
        let agree = out.tokens.iter().zip(&f32_tokens).take_while(|(a, b)| a == b).count();
        println!("{}: bf16 greedy {:?} (first {agree} of 24 equal to f32)", dir.display(), out.tokens);
    }
}

#[test]
fn seeded_sampling_repeats_and_stops_on_end_tokens() {
    let dir = &fixtures()[0];
    let model = ModelFolder::open(dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
    let (prompt, _) = reference(dir);
    let sampling =
        |seed| SamplingParams { temperature: 1.0, top_p: 0.95, top_k: 50, seed: Some(seed), ..SamplingParams::greedy() };
    let run = |seed| generate(&model, &prompt, &opts(sampling(seed)), |_| true).unwrap().tokens;
    assert_eq!(run(3), run(3));
    assert_ne!(run(3), run(4));
    // Stopping on the first greedy token ends at once with reason Stop.
    let first = generate(&model, &prompt, &opts(SamplingParams::greedy()), |_| true).unwrap().tokens[0];
    let stopped =
        generate(&model, &prompt, &GenerationOptions { stop_tokens: vec![first], ..opts(SamplingParams::greedy()) }, |_| true)
            .unwrap();
    assert_eq!((stopped.tokens.len(), stopped.finish), (0, FinishReason::Stop));
}
