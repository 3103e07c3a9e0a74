//! The Qwen3.5 multi-token-prediction head against its public definition, built in
//! scripts/oracle/add_mtp_head.py from transformers' own decoder layer and hidden states.

use std::path::Path;

use candle_core::{DType, Device, IndexOp, Tensor, D};
use strata_model::{Logits, ModelFolder};

mod common;
use common::fixtures;

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

fn row(tokens: &[u32]) -> Tensor {
    Tensor::new(tokens, &Device::Cpu).unwrap().unsqueeze(0).unwrap()
}

fn reference(dir: &Path) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap()
}

#[test]
fn mtp_head_matches_its_definition_on_transformers_layers() {
    for dir in fixtures() {
        let name = dir.display();
        let folder = ModelFolder::open(&dir).unwrap();
        let model = folder.load(DType::F32, &Device::Cpu).unwrap();
        let head = folder.load_mtp(&model).unwrap();
        let refs = reference(&dir);
        let tokens: Vec<u32> = refs["tokens"].to_vec1::<i64>().unwrap().into_iter().map(|t| t as u32).collect();
        let n = tokens.len();

        // The target's hidden states, with logits unchanged by asking for them.
        let (logits, hidden) = model.forward_with_hidden(&row(&tokens), &mut model.new_state(1).unwrap(), Logits::All).unwrap();
        let plain = model.forward(&row(&tokens), &mut model.new_state(1).unwrap(), Logits::All).unwrap();
        assert_eq!(max_diff(&logits, &plain), 0.0, "{name}: logits with hidden states differ from plain logits");
        let d = max_diff(&hidden.squeeze(0).unwrap(), &refs["mtp_hidden"]);
        assert!(d < 1e-4, "{name}: hidden states differ by {d}");

        // The head over (prompt[1..], hidden[..n-1]), fed in two pieces through its KV history.
        let mut state = head.new_state(1).unwrap();
        let split = 17;
        let mut ys = Vec::new();
        for (from, to) in [(0, split), (split, n - 1)] {
            let h = hidden.narrow(1, from, to - from).unwrap();
            ys.push(head.forward(&row(&tokens[from + 1..to + 1]), &h, &mut state).unwrap());
        }
        let y = Tensor::cat(&ys, 1).unwrap();
        let d = max_diff(&head.logits(&y).unwrap().squeeze(0).unwrap(), &refs["mtp_logits"]);
        assert!(d < 1e-4, "{name}: MTP logits differ by {d}");

        // A further draft step feeds the head its own last output, after a round of throwaway
        // positions that is taken back.
        let last = y.i((.., n - 2..n - 1, ..)).unwrap();
        let draft = head.logits(&last).unwrap().argmax(D::Minus1).unwrap().flatten_all().unwrap().to_vec1::<u32>().unwrap();
        let round = head.open_round(&state);
        head.forward(&row(&[5, 6, 7]), &hidden.narrow(1, 0, 3).unwrap(), &mut state).unwrap();
        head.close_round(&mut state, round, &[0]).unwrap();
        let chain = head.logits(&head.forward(&row(&draft), &last, &mut state).unwrap()).unwrap();
        let d = max_diff(&chain.squeeze(0).unwrap(), &refs["mtp_chain_logits"]);
        assert!(d < 1e-4, "{name}: chained draft step differs by {d}");
        assert_eq!(state.positions, vec![n]);
    }
}

/// A head restricted to a draft vocabulary drafts, at every position, the most likely of those
/// tokens by the whole vocabulary's transformers-checked logits (the first among equals); the
/// unrestricted head drafts their overall argmax. Bad vocabularies are refused by name.
#[test]
fn drafts_among_a_reduced_vocabulary_are_its_most_likely_tokens() {
    for dir in fixtures() {
        let name = dir.display();
        let folder = ModelFolder::open(&dir).unwrap();
        let model = folder.load(DType::F32, &Device::Cpu).unwrap();
        let refs = reference(&dir);
        let tokens: Vec<u32> = refs["tokens"].to_vec1::<i64>().unwrap().into_iter().map(|t| t as u32).collect();
        let n = tokens.len();
        let (_, hidden) = model.forward_with_hidden(&row(&tokens), &mut model.new_state(1).unwrap(), Logits::All).unwrap();
        let mut head = folder.load_mtp(&model).unwrap();
        let y = head.forward(&row(&tokens[1..]), &hidden.narrow(1, 0, n - 1).unwrap(), &mut head.new_state(1).unwrap()).unwrap();
        let positions = y.squeeze(0).unwrap().unsqueeze(1).unwrap(); // each position a row
        let full: Vec<Vec<f32>> = head.logits(&positions).unwrap().squeeze(1).unwrap().to_vec2().unwrap();
        let best_among =
            |ids: &[u32], l: &[f32]| *ids.iter().fold(&ids[0], |b, t| if l[*t as usize] > l[*b as usize] { t } else { b });
        let all: Vec<u32> = (0..full[0].len() as u32).collect();
        let want: Vec<u32> = full.iter().map(|l| best_among(&all, l)).collect();
        assert_eq!(head.draft(&positions).unwrap(), want, "{name}: unrestricted drafts");

        // Every third token, listed in a shuffled order; then the lowest ids.
        let vocab = all.len();
        let mut hot: Vec<u32> = (0..vocab as u32).filter(|t| t % 3 == 1).collect();
        hot.reverse();
        let middle = hot.len() / 2;
        hot.swap(0, middle);
        for ids in [hot, (0..vocab as u32 / 4).collect()] {
            head.restrict_drafts(ids.clone()).unwrap();
            assert_eq!(head.draft_vocab_size().unwrap(), ids.len());
            let want: Vec<u32> = full.iter().map(|l| best_among(&ids, l)).collect();
            assert_eq!(head.draft(&positions).unwrap(), want, "{name}: drafts among {} tokens", ids.len());
        }
        let mut refused = |ids: Vec<u32>| head.restrict_drafts(ids).unwrap_err().to_string();
        assert!(refused(vec![1, vocab as u32]).contains("past the vocabulary"), "{name}");
        assert!(refused(vec![4, 2, 4]).contains("token 4 is listed twice"), "{name}");
        assert!(refused(vec![]).contains("no tokens"), "{name}");
    }
}

#[test]
fn mtp_head_refusals_name_what_is_missing() {
    let dense = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/dense/qwen3-tiny-draft");
    let folder = ModelFolder::open(&dense).unwrap();
    let model = folder.load(DType::F32, &Device::Cpu).unwrap();
    let err = folder.load_mtp(&model).err().expect("refused").to_string();
    assert!(err.contains("needs a Qwen3.5 model"), "{err}");

    // A Qwen3.5 folder whose weights lack the head (a conversion that dropped it).
    let dir = tempfile::tempdir().unwrap();
    let src = &fixtures()[2];
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let weights = dir.path().join("model.safetensors");
    let tensors = candle_core::safetensors::load(&weights, &Device::Cpu).unwrap();
    let kept: Vec<(String, Tensor)> = tensors.into_iter().filter(|(k, _)| !k.starts_with("mtp.")).collect();
    candle_core::safetensors::save(&kept.into_iter().collect(), &weights).unwrap();
    let folder = ModelFolder::open(dir.path()).unwrap();
    let model = folder.load(DType::F32, &Device::Cpu).unwrap();
    let err = folder.load_mtp(&model).err().expect("refused").to_string();
    assert!(err.contains("no multi-token-prediction head") && err.contains(&dir.path().display().to_string()), "{err}");
}
