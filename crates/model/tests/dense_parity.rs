//! The attention-only decoders (qwen3, qwen2, llama; gemma3 with its sliding-window layers)
//! against transformers (fixtures written by scripts/oracle/make_dense_fixtures.py and
//! make_gemma3_fixture.py under fixtures/dense/).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use strata_model::{Logits, Model, ModelFolder};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn fixtures() -> Vec<PathBuf> {
    let dense = root().join("dense");
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(&dense).unwrap().map(|e| e.unwrap().path()).filter(|p| p.join("config.json").exists()).collect();
    dirs.sort();
    assert!(dirs.len() >= 4, "dense fixtures missing under {}", dense.display());
    dirs
}

fn load(dir: &Path) -> Model {
    let model = ModelFolder::open(dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
    let family = dir.file_name().unwrap().to_str().unwrap().split('-').next().unwrap().to_string();
    let loaded_as = match &model {
        Model::Dense(m) => format!("{:?}", m.config().family).to_lowercase(),
        Model::Gemma3(_) => "gemma3".into(),
        Model::Qwen35(_) => "qwen3_5".into(),
    };
    assert_eq!(loaded_as, family, "{} loaded as the wrong family", dir.display());
    model
}

struct Reference {
    tokens: Vec<u32>,
    logits: Tensor,
    incremental: Tensor,
    from: usize,
    greedy: Vec<u32>,
}

fn reference(dir: &Path) -> Reference {
    let tensors = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    Reference {
        tokens: tensors["tokens"].to_vec1::<i64>().unwrap().into_iter().map(|t| t as u32).collect(),
        logits: tensors["logits"].clone(),
        incremental: tensors["incremental_logits"].clone(),
        from: json["incremental_from"].as_u64().unwrap() as usize,
        greedy: json["greedy_tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect(),
    }
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
        let model = load(&dir);
        let r = reference(&dir);

        let mut state = model.new_state(1).unwrap();
        let got = model.forward(&row(&r.tokens), &mut state, Logits::All).unwrap().squeeze(0).unwrap();
        let d = max_diff(&got, &r.logits);
        assert!(d < 1e-4, "{}: one-shot logits differ by {d}", dir.display());
        assert_eq!(Some(state.bytes()), model.state_cost().bytes(r.tokens.len()));

        let mut state = model.new_state(1).unwrap();
        let mut rows = vec![model.forward(&row(&r.tokens[..r.from]), &mut state, Logits::Last).unwrap()];
        for &t in &r.tokens[r.from..] {
            rows.push(model.forward(&row(&[t]), &mut state, Logits::Last).unwrap());
        }
        let d = max_diff(&Tensor::cat(&rows, 0).unwrap(), &r.incremental);
        assert!(d < 1e-4, "{}: incremental logits differ by {d}", dir.display());
        assert_eq!(state.positions, vec![r.tokens.len()]);
    }
}

#[test]
fn greedy_tokens_match_transformers() {
    for dir in fixtures() {
        let model = load(&dir);
        let r = reference(&dir);
        let mut state = model.new_state(1).unwrap();
        let mut logits = model.forward(&row(&r.tokens), &mut state, Logits::Last).unwrap();
        let mut got = Vec::new();
        for _ in 0..r.greedy.len() {
            let next = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap()[0];
            got.push(next);
            logits = model.forward(&row(&[next]), &mut state, Logits::Last).unwrap();
        }
        assert_eq!(got, r.greedy, "{}", dir.display());
    }
}

/// Rows at different positions, fed together, give exactly (bitwise) what each gives alone.
#[test]
fn batched_rows_equal_single_rows() {
    for dir in fixtures() {
        let model = load(&dir);
        let tokens = reference(&dir).tokens;
        let starts = [0, 10, 25];
        let mut batch = model.new_state(0).unwrap();
        let mut singles = Vec::new();
        for &start in &starts {
            let mut s = model.new_state(1).unwrap();
            if start > 0 {
                model.forward(&row(&tokens[..start]), &mut s, Logits::Last).unwrap();
            }
            batch.merge(&s).unwrap();
            singles.push(s);
        }
        // A three-token chunk per row, then two single-token steps.
        for (at, len) in [(0, 3), (3, 1), (4, 1)] {
            let chunks: Vec<Vec<u32>> = starts.iter().map(|&s| tokens[s + at..s + at + len].to_vec()).collect();
            let input = Tensor::from_vec(chunks.concat(), (starts.len(), len), &Device::Cpu).unwrap();
            let got = model.forward(&input, &mut batch, Logits::All).unwrap();
            for (i, (chunk, single)) in chunks.iter().zip(&mut singles).enumerate() {
                let want = model.forward(&row(chunk), single, Logits::All).unwrap();
                let d = max_diff(&got.narrow(0, i, 1).unwrap(), &want);
                assert_eq!(d, 0.0, "{} row {i} at {at}: differs by {d}", dir.display());
            }
        }
        assert_eq!(batch.positions, vec![5, 15, 30]);
    }
}

#[test]
fn the_draft_shares_the_qwen3_5_tokenizer() {
    let read = |dir: PathBuf| std::fs::read(dir.join("tokenizer.json")).unwrap();
    assert_eq!(read(root().join("dense/qwen3-tiny-draft")), read(root().join("qwen3_5-tiny-a")));
}

#[test]
fn load_picks_the_family_from_the_config() {
    let dense = ModelFolder::open(&root().join("dense/qwen3-tiny-draft")).unwrap();
    assert!(matches!(dense.load(DType::F32, &Device::Cpu).unwrap(), Model::Dense(_)));
    let hybrid = ModelFolder::open(&root().join("qwen3_5-tiny-a")).unwrap();
    let model = hybrid.load(DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(model, Model::Qwen35(_)));
    assert_eq!((model.vocab_size(), model.max_position_embeddings()), (512, 131_072));
}

#[test]
fn config_errors_name_the_field() {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("dense/qwen3-tiny-draft/config.json")).unwrap()).unwrap();
    let cases = [
        ("use_sliding_window", serde_json::json!(true), "use_sliding_window"),
        ("rope_parameters", serde_json::json!({"rope_type": "yarn", "factor": 4.0}), "rope_parameters.rope_type"),
        ("model_type", serde_json::json!("gemma"), "model_type"),
        ("num_key_value_heads", serde_json::json!(3), "num_key_value_heads"),
    ];
    for (key, value, field) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut bad = config.clone();
        bad[key] = value;
        std::fs::write(dir.path().join("config.json"), bad.to_string()).unwrap();
        let err = ModelFolder::open(dir.path()).err().unwrap().to_string();
        assert!(err.contains(&format!("`{field}`")) && err.contains("config.json"), "{key}: {err}");
    }
}
