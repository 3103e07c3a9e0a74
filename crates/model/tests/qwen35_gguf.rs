//! Qwen3.5 (llama.cpp architecture `qwen35`) from GGUF files that llama.cpp's own converter
//! wrote from fixtures/qwen3_5-tiny-a and fixtures/qwen3_5-tiny-b (fixtures/gguf/README.md):
//! the config strata builds from the metadata is the folder's, every tensor the model reads is
//! the safetensors tensor once the converter's transforms are undone, and greedy decoding gives
//! transformers' tokens.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use strata_model::gguf::GgufFile;
use strata_model::qwen3_5::layers::Matrix;
use strata_model::source::WeightSource;
use strata_model::{ArchConfig, Logits, Model, ModelFolder, Qwen35Config};

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(path)
}

fn qwen35(folder: &ModelFolder) -> Qwen35Config {
    match &folder.config.arch {
        ArchConfig::Qwen35(c) => c.clone(),
        _ => panic!("{} is not Qwen3.5", folder.path.display()),
    }
}

/// Passes reads through, remembering every tensor name and shape the model asked for.
struct Recorder<'a> {
    inner: &'a dyn WeightSource,
    asked: RefCell<Vec<(String, Vec<usize>)>>,
}

impl WeightSource for Recorder<'_> {
    fn get(&self, name: &str, shape: &[usize], dtype: DType) -> strata_model::Result<Tensor> {
        self.asked.borrow_mut().push((name.to_string(), shape.to_vec()));
        self.inner.get(name, shape, dtype)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize, dtype: DType) -> strata_model::Result<Matrix> {
        self.asked.borrow_mut().push((name.to_string(), vec![rows, cols]));
        self.inner.matrix(name, rows, cols, dtype)
    }

    fn device(&self) -> &Device {
        self.inner.device()
    }
}

fn greedy(model: &Model, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut state = model.new_state(1).unwrap();
    let row = |t: &[u32]| Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let mut logits = model.forward(&row(prompt), &mut state, Logits::Last).unwrap();
    let mut out = Vec::new();
    for _ in 0..steps {
        let next = logits.flatten_all().unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap();
        out.push(next);
        logits = model.forward(&row(&[next]), &mut state, Logits::Last).unwrap();
    }
    out
}

fn reference(dir: &str) -> (Vec<u32>, Vec<u32>) {
    let dir = fixture(dir);
    let tensors = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let prompt = tensors["tokens"].to_vec1::<i64>().unwrap().into_iter().map(|t| t as u32).collect();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    (prompt, serde_json::from_value(json["greedy_tokens"].clone()).unwrap())
}

#[test]
fn config_is_the_folders() {
    let gguf = ModelFolder::open(&fixture("gguf/qwen3_5-tiny-a-f32.gguf")).unwrap();
    let folder = ModelFolder::open(&fixture("qwen3_5-tiny-a")).unwrap();
    let (got, mut want) = (qwen35(&gguf), qwen35(&folder));
    // GGUF carries no vision tower (llama.cpp writes it to a separate mmproj file) and its eos
    // id comes from the tokenizer metadata.
    want.vision = None;
    assert_eq!(got.eos_token_ids, vec![2]);
    want.eos_token_ids = got.eos_token_ids.clone();
    assert_eq!(got, want);
    assert_eq!(got.rotary_dim(), 4);
    assert_eq!(got.mtp_num_hidden_layers, 1, "the MTP block is counted out of block_count");
    assert_eq!(gguf.config.vocab_size, folder.config.vocab_size);
    // The Q8_0 file says the same.
    assert_eq!(qwen35(&ModelFolder::open(&fixture("gguf/qwen3_5-tiny-a-q8_0.gguf")).unwrap()), got);
}

/// Every tensor the model reads from the GGUF, against the safetensors tensor. The converter's
/// arithmetic (`1 + w` for the zero-centred norms, `-exp(A_log)`) rounds, so those compare as
/// the model uses them (`1 + w` exactly, from an f32 checkpoint) or within the rounding;
/// everything else is bit-exact.
fn assert_tensors_match(gguf: &str, folder: &str, cfg: &Qwen35Config) -> usize {
    let file = GgufFile::open(&fixture(gguf)).unwrap();
    let src = file.source(&Device::Cpu, true).unwrap();
    let recorder = Recorder { inner: &src, asked: RefCell::new(Vec::new()) };
    Model::load(&ArchConfig::Qwen35(cfg.clone()), &recorder, DType::F32).unwrap();
    let mut want: HashMap<String, Tensor> = HashMap::new();
    for entry in std::fs::read_dir(fixture(folder)).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap();
        if name.starts_with("model") && name.ends_with(".safetensors") {
            want.extend(candle_core::safetensors::load(&path, &Device::Cpu).unwrap());
        }
    }
    let asked = recorder.asked.into_inner();
    assert!(asked.iter().any(|(n, _)| n.ends_with("linear_attn.A_log")));
    for (name, shape) in &asked {
        let got = src.get(name, shape, DType::F32).unwrap();
        let stored = match name.as_str() {
            "lm_head.weight" => name.clone(),
            _ if want.contains_key("model.language_model.embed_tokens.weight") => format!("model.language_model.{name}"),
            _ => format!("model.{name}"),
        };
        let want = &want[&stored];
        // The converter does its arithmetic in the checkpoint's dtype: in a bf16 one, `1 + w`
        // and `-exp(A_log)` round to bf16 before the f32 file stores them.
        let rounding = match want.dtype() {
            DType::F32 => None,
            DType::BF16 => Some(8e-3),
            other => panic!("{name}: checkpoint dtype {other:?}"),
        };
        assert_eq!(got.dims(), want.dims(), "{name}");
        let g = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let w = want.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (i, (g, w)) in g.iter().zip(&w).enumerate() {
            if name.ends_with("norm.weight") && !name.ends_with("linear_attn.norm.weight") {
                match rounding {
                    Some(tol) => assert!((g - w).abs() <= tol, "{name}[{i}]: {g} vs {w}"),
                    None => assert_eq!(1.0 + g, 1.0 + w, "{name}[{i}]: 1 + w differs"),
                }
            } else if name.ends_with("A_log") {
                let tol = rounding.unwrap_or(2.0 * f32::EPSILON * w.abs().max(1.0));
                assert!((g - w).abs() <= tol, "{name}[{i}]: {g} vs {w}");
            } else {
                assert_eq!(g.to_bits(), w.to_bits(), "{name}[{i}]: {g} vs {w}");
            }
        }
    }
    asked.len()
}

#[test]
fn every_tensor_equals_the_safetensors_one() {
    let cfg = qwen35(&ModelFolder::open(&fixture("gguf/qwen3_5-tiny-a-f32.gguf")).unwrap());
    let n = assert_tensors_match("gguf/qwen3_5-tiny-a-f32.gguf", "qwen3_5-tiny-a", &cfg);
    assert!(n > 40, "only {n} tensors read");
}

/// tiny-b (bf16) has two value heads per key head, which llama.cpp's converter reorders (qkv
/// and z rows, a/b rows, A_log, dt_bias, conv channels, out_proj columns). Its layers are
/// [linear, full, linear, linear, full], which llama.cpp's metadata cannot say (the converter
/// writes only `full_attention_interval`, 4 by default), so the file reads as
/// [linear, linear, linear, full, linear], as llama.cpp reads it: the tensors are checked against
/// the folder's own config.
#[test]
fn reordered_value_heads_are_put_back() {
    let gguf = ModelFolder::open(&fixture("gguf/qwen3_5-tiny-b-f32.gguf")).unwrap();
    let folder = qwen35(&ModelFolder::open(&fixture("qwen3_5-tiny-b")).unwrap());
    assert_eq!((folder.linear_num_key_heads, folder.linear_num_value_heads), (2, 4));
    let got = qwen35(&gguf);
    use strata_model::config::LayerKind::{Full, Linear};
    assert_eq!(got.layer_types, vec![Linear, Linear, Linear, Full, Linear]);
    assert_eq!((got.linear_num_key_heads, got.linear_num_value_heads), (2, 4));
    assert!(!got.tie_word_embeddings);
    let n = assert_tensors_match("gguf/qwen3_5-tiny-b-f32.gguf", "qwen3_5-tiny-b", &folder);
    assert!(n > 50, "only {n} tensors read");
}

#[test]
fn greedy_tokens_are_transformers() {
    let (prompt, want) = reference("qwen3_5-tiny-a");
    assert_eq!(want.len(), 24);
    let folder = ModelFolder::open(&fixture("gguf/qwen3_5-tiny-a-f32.gguf")).unwrap();
    let got = greedy(&folder.load(DType::F32, &Device::Cpu).unwrap(), &prompt, want.len());
    assert_eq!(got, want);
}

/// The Q8_0 file, through strata's packed kernel and dequantized to f32: greedy tokens agree
/// with transformers' (from the f32 checkpoint) as far as the 8-bit rounding lets them.
#[test]
fn q8_0_greedy_tokens() {
    let (prompt, want) = reference("qwen3_5-tiny-a");
    let folder = ModelFolder::open(&fixture("gguf/qwen3_5-tiny-a-q8_0.gguf")).unwrap();
    let packed = greedy(&folder.load(DType::F32, &Device::Cpu).unwrap(), &prompt, want.len());
    let dequantized = greedy(&folder.load_dequantized(DType::F32, &Device::Cpu).unwrap(), &prompt, want.len());
    let agree = |a: &[u32]| a.iter().zip(&want).take_while(|(a, b)| a == b).count();
    println!(
        "Q8_0: packed {packed:?} ({} leading tokens agree with transformers), dequantized {dequantized:?} ({})",
        agree(&packed),
        agree(&dequantized)
    );
    // Observed: both agree with transformers on the first 19 tokens (the fixture's random weights
    // leave top-2 margins of ~2e-3, which 8-bit weights move); asserted with room.
    assert!(agree(&packed) >= 12 && agree(&dequantized) >= 12, "{packed:?} / {dequantized:?} vs {want:?}");
}

/// The tiny-a file rewritten without one metadata key or one tensor.
fn without(key: Option<&str>, tensor: Option<&str>, tag: &str) -> PathBuf {
    use candle_core::quantized::gguf_file::{self, Content};
    let path = fixture("gguf/qwen3_5-tiny-a-f32.gguf");
    let mut file = std::fs::File::open(&path).unwrap();
    let content = Content::read(&mut file).unwrap();
    let metadata: Vec<(&str, &gguf_file::Value)> =
        content.metadata.iter().filter(|(k, _)| Some(k.as_str()) != key).map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = content
        .tensor_infos
        .keys()
        .filter(|n| Some(n.as_str()) != tensor)
        .map(|n| (n.clone(), content.tensor(&mut file, n, &Device::Cpu).unwrap()))
        .collect();
    let tensors: Vec<(&str, &candle_core::quantized::QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let out = std::env::temp_dir().join(format!("strata-qwen35-{tag}-{}.gguf", std::process::id()));
    gguf_file::write(&mut std::fs::File::create(&out).unwrap(), &metadata, &tensors).unwrap();
    out
}

#[test]
fn missing_pieces_are_named() {
    let path = without(Some("qwen35.ssm.conv_kernel"), None, "key");
    let err = ModelFolder::open(&path).err().expect("opens without ssm.conv_kernel").to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(err.contains("qwen35.ssm.conv_kernel"), "{err}");

    let path = without(None, Some("blk.2.ssm_a"), "tensor");
    let err = ModelFolder::open(&path).unwrap().load(DType::F32, &Device::Cpu).err().expect("loads without ssm_a").to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(err.contains("blk.2.ssm_a") && err.contains("layers.2.linear_attn.A_log"), "{err}");
}

/// The tokenizer rebuilt from the file's metadata (`gpt2` BPE, `tokenizer.ggml.pre = "gpt-2"`)
/// gives the ids transformers gave for the fixture's rendered chats, and the folder's own
/// tokenizer's ids for the decoded prompt.
#[test]
fn tokenizer_matches_the_folders() {
    let gguf = ModelFolder::open(&fixture("gguf/qwen3_5-tiny-a-f32.gguf")).unwrap();
    let folder = ModelFolder::open(&fixture("qwen3_5-tiny-a")).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_5-tiny-a/reference.json")).unwrap()).unwrap();
    for chat in json["chats"].as_array().unwrap() {
        let want: Vec<u32> = serde_json::from_value(chat["ids"].clone()).unwrap();
        assert_eq!(gguf.tokenizer.encode(chat["text"].as_str().unwrap()).unwrap(), want);
    }
    let text = json["decoded_prompt"].as_str().unwrap();
    assert_eq!(gguf.tokenizer.encode(text).unwrap(), folder.tokenizer.encode(text).unwrap());
}
