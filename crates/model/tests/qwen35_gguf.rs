//! Qwen3.5 (llama.cpp architectures `qwen35` and `qwen35moe`) from GGUF files that llama.cpp's
//! own converter wrote from fixtures/qwen3_5-tiny-a, -b and fixtures/qwen3_5_moe-tiny-e, -f
//! (fixtures/gguf/README.md): the config strata builds from the metadata is the folder's, every
//! tensor the model reads is the safetensors tensor once the converter's transforms are undone,
//! and greedy decoding gives transformers' tokens.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use strata_model::config::FeedForward;
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

/// The checkpoint's tensors by name; transformers' fused experts (`experts.gate_up_proj`
/// `[E, 2I, H]`, `experts.down_proj` `[E, H, I]`) also under the per-expert names strata asks
/// a GGUF file for (`experts.N.{gate,up,down}_proj.weight`).
fn checkpoint(folder: &str) -> HashMap<String, Tensor> {
    let mut want: HashMap<String, Tensor> = HashMap::new();
    for entry in std::fs::read_dir(fixture(folder)).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap();
        if name.starts_with("model") && name.ends_with(".safetensors") {
            want.extend(candle_core::safetensors::load(&path, &Device::Cpu).unwrap());
        }
    }
    let fused: Vec<String> = want.keys().filter_map(|k| k.strip_suffix(".gate_up_proj")).map(String::from).collect();
    for experts in fused {
        let gate_up = want[&format!("{experts}.gate_up_proj")].clone();
        let down = want[&format!("{experts}.down_proj")].clone();
        let inter = gate_up.dim(1).unwrap() / 2;
        for e in 0..gate_up.dim(0).unwrap() {
            let g = gate_up.get(e).unwrap();
            want.insert(format!("{experts}.{e}.gate_proj.weight"), g.narrow(0, 0, inter).unwrap());
            want.insert(format!("{experts}.{e}.up_proj.weight"), g.narrow(0, inter, inter).unwrap());
            want.insert(format!("{experts}.{e}.down_proj.weight"), down.get(e).unwrap());
        }
    }
    want
}

/// Every tensor the model reads from the GGUF, against the safetensors tensor. The converter's
/// arithmetic (`1 + w` for the zero-centred norms, `-exp(A_log)`) rounds, so those compare as
/// the model uses them (`1 + w` exactly, from an f32 checkpoint) or within the rounding;
/// everything else is bit-exact, or for a Q8_0 file (`quantized`) within the 8-bit rounding of
/// the row's largest value (the norms and `A_log` stay f32 there). A Q8_0 file's matrices are
/// checked twice: dequantized by the loader, and as the model keeps them (quantized blocks,
/// read back row by row).
fn assert_tensors_match(gguf: &str, folder: &str, cfg: &Qwen35Config, quantized: bool) -> Vec<String> {
    let file = GgufFile::open(&fixture(gguf)).unwrap();
    let src = file.source(&Device::Cpu, true).unwrap();
    let kept = file.source(&Device::Cpu, false).unwrap();
    let recorder = Recorder { inner: &src, asked: RefCell::new(Vec::new()) };
    Model::load(&ArchConfig::Qwen35(cfg.clone()), &recorder, DType::F32).unwrap();
    let want = checkpoint(folder);
    let asked = recorder.asked.into_inner();
    assert!(asked.iter().any(|(n, _)| n.ends_with("linear_attn.A_log")));
    for (name, shape) in &asked {
        let stored = match name.as_str() {
            "lm_head.weight" => name.clone(),
            _ if want.contains_key("model.language_model.embed_tokens.weight") => format!("model.language_model.{name}"),
            _ => format!("model.{name}"),
        };
        let want = &want[&stored];
        assert_tensor_matches(name, "dequantized", &src.get(name, shape, DType::F32).unwrap(), want, quantized);
        if let (true, &[rows, cols]) = (quantized, shape.as_slice()) {
            let all = Tensor::arange(0u32, rows as u32, &Device::Cpu).unwrap();
            let got = kept.matrix(name, rows, cols, DType::F32).unwrap().rows_at(&all, DType::F32).unwrap();
            assert_tensor_matches(name, "kept quantized", &got, want, quantized);
        }
    }
    asked.into_iter().map(|(name, _)| name).collect()
}

/// One tensor read (`how`) against the checkpoint's, as [`assert_tensors_match`] says.
fn assert_tensor_matches(name: &str, how: &str, got: &Tensor, want: &Tensor, quantized: bool) {
    // The converter does its arithmetic in the checkpoint's dtype: in a bf16 one, `1 + w`
    // and `-exp(A_log)` round to bf16 before the f32 file stores them.
    let rounding = match want.dtype() {
        DType::F32 => None,
        DType::BF16 => Some(8e-3),
        other => panic!("{name}: checkpoint dtype {other:?}"),
    };
    assert_eq!(got.dims(), want.dims(), "{name} ({how})");
    let g = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let w = want.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // Q8_0 scales each block of 32 along a row by its largest magnitude over 127 and rounds to
    // the nearest step (with an f16 scale), so the row's largest magnitude over 127 bounds the
    // error wherever the row's blocks went.
    let cols = want.dims().last().copied().unwrap_or(1).max(1);
    let row_max: Vec<f32> = w.chunks(cols).map(|row| row.iter().fold(0f32, |m, x| m.max(x.abs()))).collect();
    for (i, (g, w)) in g.iter().zip(&w).enumerate() {
        if stored_plus_one(name) {
            match rounding {
                Some(tol) => assert!((g - w).abs() <= tol, "{name}[{i}] ({how}): {g} vs {w}"),
                None => assert_eq!(1.0 + g, 1.0 + w, "{name}[{i}] ({how}): 1 + w differs"),
            }
        } else if name.ends_with("A_log") {
            let tol = rounding.unwrap_or(2.0 * f32::EPSILON * w.abs().max(1.0));
            assert!((g - w).abs() <= tol, "{name}[{i}] ({how}): {g} vs {w}");
        } else if quantized {
            let amax = row_max[i / cols];
            assert!((g - w).abs() <= amax / 127.0, "{name}[{i}] ({how}): {g} vs {w} (row's largest {amax})");
        } else {
            assert_eq!(g.to_bits(), w.to_bits(), "{name}[{i}] ({how}): {g} vs {w}");
        }
    }
}

/// Whether the converter stores `name` as `1 + w`: the zero-centred norms (all but the DeltaNet
/// output norm), the multi-token-prediction head's included, whose pre-`fc` norms it renames
/// `enorm` / `hnorm` before adding the 1.
fn stored_plus_one(name: &str) -> bool {
    (name.ends_with("norm.weight") && !name.ends_with("linear_attn.norm.weight"))
        || name == "mtp.pre_fc_norm_embedding.weight"
        || name == "mtp.pre_fc_norm_hidden.weight"
}

#[test]
fn every_tensor_equals_the_safetensors_one() {
    let cfg = qwen35(&ModelFolder::open(&fixture("gguf/qwen3_5-tiny-a-f32.gguf")).unwrap());
    let n = assert_tensors_match("gguf/qwen3_5-tiny-a-f32.gguf", "qwen3_5-tiny-a", &cfg, false).len();
    assert!(n > 40, "only {n} tensors read");
}

/// tiny-b (bf16) has two value heads per key head, which llama.cpp's converter reorders (qkv
/// and z rows, a/b rows, A_log, dt_bias, conv channels, out_proj columns). Its layers are
/// [linear, full, linear, linear, full], which llama.cpp's metadata cannot say (the converter
/// writes only `full_attention_interval`, 4 by default), so the file reads as
/// [linear, linear, linear, full, linear], as llama.cpp reads it: the tensors are checked against
/// the folder's own config. In the Q8_0 file qkv, z, a and b are quantized (their rows move as
/// whole blocks) and a value head (16 wide) is narrower than a block, so `out_proj`'s columns
/// can only move dequantized: the model keeps it dense. conv1d, A_log and dt_bias stay f32.
#[test]
fn reordered_value_heads_are_put_back() {
    let folder = qwen35(&ModelFolder::open(&fixture("qwen3_5-tiny-b")).unwrap());
    assert_eq!((folder.linear_num_key_heads, folder.linear_num_value_heads), (2, 4));
    assert_eq!(folder.linear_value_head_dim, 16);
    for (gguf, quantized) in [("gguf/qwen3_5-tiny-b-f32.gguf", false), ("gguf/qwen3_5-tiny-b-q8_0.gguf", true)] {
        let got = qwen35(&ModelFolder::open(&fixture(gguf)).unwrap());
        use strata_model::config::LayerKind::{Full, Linear};
        assert_eq!(got.layer_types, vec![Linear, Linear, Linear, Full, Linear], "{gguf}");
        assert_eq!((got.linear_num_key_heads, got.linear_num_value_heads), (2, 4), "{gguf}");
        assert!(!got.tie_word_embeddings, "{gguf}");
        let asked = assert_tensors_match(gguf, "qwen3_5-tiny-b", &folder, quantized);
        assert!(asked.len() > 50, "{gguf}: only {} tensors read", asked.len());
        let reordered = ["in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight"];
        for part in reordered.iter().chain(&["A_log", "dt_bias", "conv1d.weight", "out_proj.weight"]) {
            assert!(asked.iter().any(|n| n == &format!("layers.0.linear_attn.{part}")), "{gguf}: {part} not read");
        }
        if quantized {
            let file = GgufFile::open(&fixture(gguf)).unwrap();
            let src = file.source(&Device::Cpu, false).unwrap();
            let matrix = |part: &str, rows| src.matrix(&format!("layers.0.linear_attn.{part}"), rows, 64, DType::F32).unwrap();
            for (part, rows) in reordered.into_iter().zip([128, 64, 4, 4]) {
                assert!(matches!(matrix(part, rows), Matrix::Packed(_)), "{part} is not kept in Q8_0");
            }
            assert!(matches!(matrix("out_proj.weight", 64), Matrix::Dense(_)), "out_proj is not dense");
        }
    }
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

/// A fixture file rewritten without one metadata key or one tensor.
fn without(gguf: &str, key: Option<&str>, tensor: Option<&str>, tag: &str) -> PathBuf {
    use candle_core::quantized::gguf_file::{self, Content};
    let path = fixture(gguf);
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
    let path = without("gguf/qwen3_5-tiny-a-f32.gguf", Some("qwen35.ssm.conv_kernel"), None, "key");
    let err = ModelFolder::open(&path).err().expect("opens without ssm.conv_kernel").to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(err.contains("qwen35.ssm.conv_kernel"), "{err}");

    let path = without("gguf/qwen3_5-tiny-a-f32.gguf", None, Some("blk.2.ssm_a"), "tensor");
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

// Qwen3.5 MoE (`qwen35moe`). tiny-e: a bf16 `Qwen3_5MoeForConditionalGeneration` checkpoint,
// experts stored one by one, 8 routed (top 3), untied output; tiny-f: an f32
// `Qwen3_5MoeForCausalLM` with transformers' fused experts, 4 routed (top 2), tied. The
// converter stacks both into `ffn_{gate,up,down}_exps`; tiny-e's Q8_0 file was written with
// `--fuse-gate-up-exps` (`ffn_gate_up_exps`).

const MOE_FILES: [(&str, &str); 3] = [
    ("gguf/qwen3_5_moe-tiny-e-f32.gguf", "qwen3_5_moe-tiny-e"),
    ("gguf/qwen3_5_moe-tiny-e-q8_0.gguf", "qwen3_5_moe-tiny-e"),
    ("gguf/qwen3_5_moe-tiny-f-f32.gguf", "qwen3_5_moe-tiny-f"),
];

#[test]
fn moe_config_is_the_folders() {
    for (gguf, folder) in MOE_FILES {
        let (got, mut want) =
            (qwen35(&ModelFolder::open(&fixture(gguf)).unwrap()), qwen35(&ModelFolder::open(&fixture(folder)).unwrap()));
        want.vision = None;
        assert_eq!(got.eos_token_ids, vec![2], "{gguf}");
        want.eos_token_ids = got.eos_token_ids.clone();
        assert!(matches!(got.feed_forward, FeedForward::Experts(_)), "{gguf}");
        assert_eq!(got, want, "{gguf}");
        assert_eq!(got.mtp_num_hidden_layers, 1, "{gguf}: the MTP block is counted out of block_count");
    }
}

#[test]
fn moe_every_tensor_equals_the_safetensors_one() {
    for (gguf, folder) in MOE_FILES {
        let cfg = qwen35(&ModelFolder::open(&fixture(folder)).unwrap());
        let FeedForward::Experts(experts) = &cfg.feed_forward else { panic!("{folder} has no experts") };
        let asked = assert_tensors_match(gguf, folder, &cfg, gguf.ends_with("q8_0.gguf"));
        // Every expert of every layer, the router and the shared expert with its gate.
        let layers = cfg.layer_types.len();
        let routed = asked.iter().filter(|n| n.contains(".mlp.experts.")).count();
        assert_eq!(routed, layers * experts.num_experts * 3, "{gguf}");
        for part in ["mlp.gate.weight", "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"] {
            assert_eq!(asked.iter().filter(|n| n.ends_with(part)).count(), layers, "{gguf}: {part}");
        }
    }
}

#[test]
fn moe_greedy_tokens_are_transformers() {
    for folder in ["qwen3_5_moe-tiny-e", "qwen3_5_moe-tiny-f"] {
        let (prompt, want) = reference(folder);
        assert_eq!(want.len(), 24);
        let gguf = ModelFolder::open(&fixture(&format!("gguf/{folder}-f32.gguf"))).unwrap();
        let got = greedy(&gguf.load(DType::F32, &Device::Cpu).unwrap(), &prompt, want.len());
        assert_eq!(got, want, "{folder}");
    }
}

/// The positions where the model, fed the prompt and transformers' tokens, predicts
/// transformers' next token (one forward; a wrong pick does not derail the rest).
fn forced_agreement(model: &Model, prompt: &[u32], want: &[u32]) -> usize {
    let mut state = model.new_state(1).unwrap();
    let tokens: Vec<u32> = prompt.iter().chain(&want[..want.len() - 1]).copied().collect();
    let input = Tensor::new(tokens.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let logits = model.forward(&input, &mut state, Logits::All).unwrap().squeeze(0).unwrap();
    let picks = logits.narrow(0, prompt.len() - 1, want.len()).unwrap().argmax(1).unwrap().to_vec1::<u32>().unwrap();
    picks.iter().zip(want).filter(|(a, b)| a == b).count()
}

/// tiny-e's Q8_0 file (experts fused gate-and-up, sliced per expert and kept in Q8_0), through
/// strata's packed kernel and dequantized to f32, against transformers' tokens from the
/// checkpoint. Routing makes this fixture touchy: a small change to a router logit swaps an
/// expert (transformers' own bf16 run leaves its f32 tokens after 5), so greedy runs part early
/// and the robust measure is the next-token agreement along transformers' tokens.
#[test]
fn moe_q8_0_greedy_tokens() {
    let (prompt, want) = reference("qwen3_5_moe-tiny-e");
    let folder = ModelFolder::open(&fixture("gguf/qwen3_5_moe-tiny-e-q8_0.gguf")).unwrap();
    // The experts stay in Q8_0 for strata's packed kernel.
    let file = GgufFile::open(&fixture("gguf/qwen3_5_moe-tiny-e-q8_0.gguf")).unwrap();
    let src = file.source(&Device::Cpu, false).unwrap();
    for proj in ["gate", "up"] {
        let m = src.matrix(&format!("layers.2.mlp.experts.5.{proj}_proj.weight"), 32, 64, DType::F32).unwrap();
        assert!(matches!(m, Matrix::Packed(_)), "{proj}");
    }
    assert!(matches!(src.matrix("layers.2.mlp.experts.5.down_proj.weight", 64, 32, DType::F32).unwrap(), Matrix::Packed(_)));
    let leading = |a: &[u32]| a.iter().zip(&want).take_while(|(a, b)| a == b).count();
    for (how, model) in [
        ("packed", folder.load(DType::F32, &Device::Cpu).unwrap()),
        ("dequantized", folder.load_dequantized(DType::F32, &Device::Cpu).unwrap()),
    ] {
        let tokens = greedy(&model, &prompt, want.len());
        let forced = forced_agreement(&model, &prompt, &want);
        println!(
            "MoE Q8_0 {how}: greedy {tokens:?} ({} leading tokens agree with transformers); along transformers' tokens {forced} of {} agree",
            leading(&tokens),
            want.len()
        );
        // Observed: 20 of 24 along transformers' tokens both ways; greedy runs agree on the first
        // 13 (packed) and 3 (dequantized). Asserted with room.
        assert!(leading(&tokens) >= 2 && forced >= 16, "{how}: {tokens:?} ({forced} forced) vs {want:?}");
    }
}

#[test]
fn moe_missing_pieces_are_named() {
    let gguf = "gguf/qwen3_5_moe-tiny-e-f32.gguf";
    let path = without(gguf, Some("qwen35moe.expert_count"), None, "moe-key");
    let err = ModelFolder::open(&path).err().expect("opens without expert_count").to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(err.contains("qwen35moe.expert_count"), "{err}");

    let path = without(gguf, None, Some("blk.1.ffn_up_exps.weight"), "moe-experts");
    let err =
        ModelFolder::open(&path).unwrap().load(DType::F32, &Device::Cpu).err().expect("loads without ffn_up_exps").to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(
        err.contains("blk.1.ffn_up_exps.weight")
            && err.contains("layers.1.mlp.experts.0.up_proj.weight")
            && err.contains("blk.1.ffn_gate_up_exps.weight"),
        "{err}"
    );

    let path = without(gguf, None, Some("blk.2.ffn_gate_inp_shexp.weight"), "moe-shared");
    let err = ModelFolder::open(&path)
        .unwrap()
        .load(DType::F32, &Device::Cpu)
        .err()
        .expect("loads without the shared gate")
        .to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(err.contains("blk.2.ffn_gate_inp_shexp.weight") && err.contains("layers.2.mlp.shared_expert_gate.weight"), "{err}");
}

/// Qwen3.5's multi-token-prediction head from the block the converter appends (`blk.{N}`, N the
/// decoder layers: `nextn.eh_proj`, `nextn.enorm`, `nextn.hnorm`, `nextn.shared_head_norm` and a
/// full-attention layer's tensors): every `mtp.*` tensor the head reads is the safetensors one
/// (dense and MoE), and the head loaded from the f32 file drafts the folder head's logits.
#[test]
fn mtp_head_reads_the_nextn_block() {
    for (gguf, dir) in
        [("gguf/qwen3_5-tiny-a-f32.gguf", "qwen3_5-tiny-a"), ("gguf/qwen3_5_moe-tiny-e-f32.gguf", "qwen3_5_moe-tiny-e")]
    {
        let file = GgufFile::open(&fixture(gguf)).unwrap();
        let src = file.source(&Device::Cpu, true).unwrap();
        let target = ModelFolder::open(&fixture(gguf)).unwrap().load(DType::F32, &Device::Cpu).unwrap();
        let recorder = Recorder { inner: &src, asked: RefCell::new(Vec::new()) };
        target.mtp_head(&recorder).unwrap();
        let asked = recorder.asked.into_inner();
        let want = checkpoint(dir);
        for name in ["mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"] {
            assert!(asked.iter().any(|(n, _)| n == name), "{gguf}: {name} not read");
        }
        assert!(asked.iter().any(|(n, _)| n == "mtp.layers.0.self_attn.q_norm.weight"), "{gguf}: the layer not read");
        for (name, shape) in &asked {
            assert!(name.starts_with("mtp."), "{gguf}: the head read {name}");
            assert_tensor_matches(name, "dequantized", &src.get(name, shape, DType::F32).unwrap(), &want[name], false);
        }
    }

    let gguf = ModelFolder::open(&fixture("gguf/qwen3_5-tiny-a-f32.gguf")).unwrap();
    let folder = ModelFolder::open(&fixture("qwen3_5-tiny-a")).unwrap();
    let (g_model, f_model) = (gguf.load(DType::F32, &Device::Cpu).unwrap(), folder.load(DType::F32, &Device::Cpu).unwrap());
    let (g_head, f_head) = (gguf.load_mtp(&g_model).unwrap(), folder.load_mtp(&f_model).unwrap());
    let (prompt, _) = reference("qwen3_5-tiny-a");
    let tokens = &prompt[..prompt.len().min(12)];
    let row = |t: &[u32]| Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let n = tokens.len();
    let mut drafts = Vec::new();
    for (model, head) in [(&g_model, &g_head), (&f_model, &f_head)] {
        let (_, hidden) = model.forward_with_hidden(&row(tokens), &mut model.new_state(1).unwrap(), Logits::All).unwrap();
        // Position i's hidden state with token i + 1: the draft for token i + 2.
        let y = head.forward(&row(&tokens[1..]), &hidden.narrow(1, 0, n - 1).unwrap(), &mut head.new_state(1).unwrap()).unwrap();
        drafts.push(head.logits(&y).unwrap());
    }
    assert_eq!(drafts[0].dims(), &[1, n - 1, gguf.config.vocab_size]);
    assert_eq!(drafts[0].dims(), drafts[1].dims());
    let d: f32 = (&drafts[0] - &drafts[1]).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap();
    assert!(d <= 1e-5, "MTP draft logits from the GGUF differ from the folder's by {d}");
}

/// A block-quantized (Q8_0) head drafting among a reduced vocabulary keeps those rows in blocks:
/// each kept token's score is the whole head's, bit for bit, so every draft is the most likely
/// of the kept tokens by the whole head (the first among equals).
#[test]
fn a_quantized_head_drafts_among_a_reduced_vocabulary_by_its_own_scores() {
    let gguf = ModelFolder::open(&fixture("gguf/qwen3_5-tiny-a-q8_0.gguf")).unwrap();
    let model = gguf.load(DType::F32, &Device::Cpu).unwrap();
    let mut head = gguf.load_mtp(&model).unwrap();
    let (prompt, _) = reference("qwen3_5-tiny-a");
    let n = prompt.len().min(16);
    let row = |t: &[u32]| Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let (_, hidden) = model.forward_with_hidden(&row(&prompt[..n]), &mut model.new_state(1).unwrap(), Logits::All).unwrap();
    let y = head.forward(&row(&prompt[1..n]), &hidden.narrow(1, 0, n - 1).unwrap(), &mut head.new_state(1).unwrap()).unwrap();
    let positions = y.squeeze(0).unwrap().unsqueeze(1).unwrap();
    let full: Vec<Vec<f32>> = head.logits(&positions).unwrap().squeeze(1).unwrap().to_vec2().unwrap();
    let mut kept: Vec<u32> = (0..gguf.config.vocab_size as u32).filter(|t| t % 3 != 0).collect();
    kept.reverse();
    head.restrict_drafts(kept.clone()).unwrap();
    let want: Vec<u32> =
        full.iter().map(|l| *kept.iter().fold(&kept[0], |b, t| if l[*t as usize] > l[*b as usize] { t } else { b })).collect();
    assert_eq!(head.draft(&positions).unwrap(), want);
}

/// A file converted without the head (or missing its `eh_proj`) is refused by name.
#[test]
fn gguf_without_mtp_head_is_refused() {
    let path = without("gguf/qwen3_5-tiny-a-f32.gguf", None, Some("blk.4.nextn.eh_proj.weight"), "no-mtp");
    let folder = ModelFolder::open(&path).unwrap();
    let model = folder.load(DType::F32, &Device::Cpu).unwrap();
    let err = folder.load_mtp(&model).err().expect("loads an MTP head without eh_proj").to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(err.contains("no multi-token-prediction head") && err.contains("no-mtp"), "{err}");
}
