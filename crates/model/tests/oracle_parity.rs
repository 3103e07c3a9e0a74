//! The Qwen3.5 forward against transformers (fixtures written by scripts/oracle/make_fixtures.py).

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use strata_model::{Logits, ModelFolder};

mod common;
use common::fixtures;

fn reference(dir: &PathBuf) -> (Vec<u32>, Tensor, Tensor, usize) {
    let tensors = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let tokens: Vec<u32> = tensors["tokens"].to_vec1::<i64>().unwrap().into_iter().map(|t| t as u32).collect();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let from = json["incremental_from"].as_u64().unwrap() as usize;
    (tokens, tensors["logits"].clone(), tensors["incremental_logits"].clone(), from)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

fn row(tokens: &[u32]) -> Tensor {
    Tensor::new(tokens, &Device::Cpu).unwrap().unsqueeze(0).unwrap()
}

#[test]
fn one_shot_and_incremental_logits_match_transformers() {
    for dir in fixtures() {
        let folder = ModelFolder::open(&dir).unwrap();
        let model = folder.load(DType::F32, &Device::Cpu).unwrap();
        let (tokens, want, want_inc, from) = reference(&dir);

        let mut state = model.new_state(1).unwrap();
        let got = model.forward(&row(&tokens), &mut state, Logits::All).unwrap().squeeze(0).unwrap();
        let d = max_diff(&got, &want);
        assert!(d < 1e-4, "{}: one-shot logits differ by {d}", dir.display());

        let mut state = model.new_state(1).unwrap();
        let mut rows = vec![model.forward(&row(&tokens[..from]), &mut state, Logits::Last).unwrap()];
        for &t in &tokens[from..] {
            rows.push(model.forward(&row(&[t]), &mut state, Logits::Last).unwrap());
        }
        let got_inc = Tensor::cat(&rows, 0).unwrap();
        let d = max_diff(&got_inc, &want_inc);
        assert!(d < 1e-4, "{}: incremental logits differ by {d}", dir.display());
        assert_eq!(state.positions, vec![tokens.len()]);
    }
}

#[test]
fn chunked_prefill_equals_one_shot() {
    for dir in fixtures() {
        let model = ModelFolder::open(&dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
        let (tokens, ..) = reference(&dir);
        let mut state = model.new_state(1).unwrap();
        let one_shot = model.forward(&row(&tokens), &mut state, Logits::All).unwrap();
        for chunk in [1, 3, 7, 16, 39] {
            let mut state = model.new_state(1).unwrap();
            let parts: Vec<Tensor> =
                tokens.chunks(chunk).map(|c| model.forward(&row(c), &mut state, Logits::All).unwrap()).collect();
            // The recurrences are bit-exact across chunkings; matmuls of other shapes accumulate in
            // another order, which moves logits by ~1e-5 through the layers.
            let d = max_diff(&Tensor::cat(&parts, 1).unwrap(), &one_shot);
            assert!(d < 5e-5, "{} chunk {chunk}: differs by {d}", dir.display());
        }
    }
}

#[test]
fn rows_of_a_batch_at_different_positions_match_single_runs() {
    let dir = &fixtures()[1];
    let model = ModelFolder::open(dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
    let (tokens, want, ..) = reference(dir);
    // Row 0 prefilled with 10 tokens, row 1 with 25; then both advance together one token a step.
    let mut a = model.new_state(1).unwrap();
    model.forward(&row(&tokens[..10]), &mut a, Logits::Last).unwrap();
    let mut b = model.new_state(1).unwrap();
    model.forward(&row(&tokens[..25]), &mut b, Logits::Last).unwrap();
    a.merge(&b).unwrap();
    for step in 0..5 {
        let batch = Tensor::new(&[[tokens[10 + step]], [tokens[25 + step]]], &Device::Cpu).unwrap();
        let out = model.forward(&batch, &mut a, Logits::Last).unwrap();
        let d0 = max_diff(&out.get(0).unwrap(), &want.get(10 + step).unwrap());
        let d1 = max_diff(&out.get(1).unwrap(), &want.get(25 + step).unwrap());
        assert!(d0 < 1e-4 && d1 < 1e-4, "step {step}: {d0} {d1}");
    }
    assert_eq!(a.positions, vec![15, 30]);
    // An extracted row carries on alone exactly as in the batch.
    let mut solo = a.extract(1).unwrap();
    let out = model.forward(&row(&[tokens[30]]), &mut solo, Logits::Last).unwrap();
    assert!(max_diff(&out.get(0).unwrap(), &want.get(30).unwrap()) < 1e-4);
}
