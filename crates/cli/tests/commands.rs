//! The CLI's stable interfaces against the transformers oracle: `logits` (one-shot and
//! incremental) and `generate --json`.

use std::path::PathBuf;
use std::process::Command;

use candle_core::{Device, Tensor};

fn fixtures() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(root).unwrap().map(|e| e.unwrap().path()).filter(|p| p.join("config.json").exists()).collect();
    dirs.sort();
    dirs
}

fn strata(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_strata")).args(args).output().unwrap();
    assert!(out.status.success(), "strata {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

#[test]
fn logits_command_matches_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    for dir in fixtures() {
        let reference = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
        let tokens: Vec<String> = reference["tokens"].to_vec1::<i64>().unwrap().iter().map(|t| t.to_string()).collect();
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let from = json["incremental_from"].to_string();
        let model = dir.to_str().unwrap();
        let out = tmp.path().join("logits.safetensors");
        let out_s = out.to_str().unwrap();
        strata(&["logits", "--model", model, "--tokens", &tokens.join(","), "--out", out_s]);
        let got = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
        assert!(max_diff(&got["logits"], &reference["logits"]) < 1e-4, "{}", dir.display());
        strata(&["logits", "--model", model, "--tokens", &tokens.join(","), "--out", out_s, "--incremental-from", &from]);
        let got = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
        assert!(max_diff(&got["logits"], &reference["incremental_logits"]) < 1e-4, "{}", dir.display());
    }
}

#[test]
fn generate_json_reports_greedy_tokens() {
    for dir in fixtures() {
        let reference = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
        let tokens: Vec<String> = reference["tokens"].to_vec1::<i64>().unwrap().iter().map(|t| t.to_string()).collect();
        let tokens = tokens.join(",");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        // Plain, and drafted by the model's multi-token-prediction head: the same tokens.
        for draft in [&[][..], &["--draft", "mtp", "--num-draft-tokens", "3"]] {
            let mut args = vec![
                "generate",
                "--model",
                dir.to_str().unwrap(),
                "--tokens",
                &tokens,
                "--max-tokens",
                "24",
                "--temperature",
                "0",
                "--ignore-eos",
                "--json",
            ];
            args.extend_from_slice(draft);
            let stdout = strata(&args);
            let last: serde_json::Value = serde_json::from_str(stdout.trim_end().lines().last().unwrap()).unwrap();
            assert_eq!(last["tokens"], json["greedy_tokens"], "{} {draft:?}", dir.display());
            assert!(last["text"].is_string());
            if !draft.is_empty() {
                assert!(last["drafted_tokens"].as_u64().unwrap() > 0, "{}: nothing drafted", dir.display());
            }
        }
    }
}

/// `logits --image`: the fixture's two images from their files, through strata's own processor.
/// Up to the image that needs resizing the logits are transformers' (its pixels equal to 1e-6);
/// past it strata's resize differs by a level at some pixels, so the prediction is compared.
#[test]
fn logits_command_takes_images() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/vision/qwen3_5-vl-tiny-g");
    let reference = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids = reference["tokens"].to_vec1::<i64>().unwrap();
    let tokens: Vec<String> = ids.iter().map(|t| t.to_string()).collect();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let pad = json["vision_token_ids"]["<|image_pad|>"].as_i64().unwrap();
    let first_image_len = json["image_tokens"][0].as_u64().unwrap() as usize;
    let resized_start = ids.iter().enumerate().filter(|(_, &t)| t == pad).nth(first_image_len).unwrap().0;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("logits.safetensors");
    let (a, b) = (dir.join("image-a.png"), dir.join("image-b.png"));
    let model = dir.to_str().unwrap();
    let tokens = tokens.join(",");
    for incremental in [None, Some("60")] {
        let mut args =
            vec!["logits", "--model", model, "--tokens", &tokens, "--image", a.to_str().unwrap(), "--image", b.to_str().unwrap()];
        args.extend(["--out", out.to_str().unwrap()]);
        if let Some(from) = incremental {
            args.extend(["--incremental-from", from]);
        }
        strata(&args);
        let got = candle_core::safetensors::load(&out, &Device::Cpu).unwrap()["logits"].clone();
        if incremental.is_none() {
            let diff =
                max_diff(&got.narrow(0, 0, resized_start).unwrap(), &reference["logits"].narrow(0, 0, resized_start).unwrap());
            assert!(diff < 1e-4, "logits before the resized image differ by {diff}");
        }
        let last = got.get(got.dim(0).unwrap() - 1).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap();
        assert_eq!(last as u64, json["greedy_tokens"][0].as_u64().unwrap(), "{incremental:?}");
    }
    // Images the prompt has no place for are refused.
    let out_s = out.to_str().unwrap();
    let err = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["logits", "--model", model, "--tokens", "1,2,3", "--image", a.to_str().unwrap(), "--out", out_s])
        .output()
        .unwrap();
    assert!(!err.status.success());
    assert!(String::from_utf8_lossy(&err.stderr).contains("image"), "{}", String::from_utf8_lossy(&err.stderr));
}

/// `generate --image` with --tokens: transformers' 16 greedy tokens from the fixture's image
/// files; with --chat the images go before the text, each placed as one run of image tokens.
#[test]
fn generate_takes_images() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/vision/qwen3_5-vl-tiny-g");
    let reference = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let tokens: Vec<String> = reference["tokens"].to_vec1::<i64>().unwrap().iter().map(|t| t.to_string()).collect();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let (a, b) = (dir.join("image-a.png"), dir.join("image-b.png"));
    let (model, a, b) = (dir.to_str().unwrap(), a.to_str().unwrap(), b.to_str().unwrap());
    let tokens = tokens.join(",");
    let common = ["--max-tokens", "16", "--temperature", "0", "--ignore-eos", "--json"];
    let last = |args: &[&str]| -> serde_json::Value {
        let stdout = strata(&[&["generate", "--model", model][..], args, &common].concat());
        serde_json::from_str(stdout.trim_end().lines().last().unwrap()).unwrap()
    };
    assert_eq!(last(&["--tokens", &tokens, "--image", a, "--image", b])["tokens"], json["greedy_tokens"]);
    // Two images of 12 and 54 tokens before the text, each between its start and end tokens.
    let with = last(&["--chat", "What differs?", "--image", a, "--image", b]);
    let without = last(&["--chat", "What differs?"]);
    let count = |v: &serde_json::Value| v["prompt_tokens"].as_u64().unwrap();
    assert_eq!(count(&with), count(&without) + 2 * 2 + 12 + 54, "a start and an end token an image, 12 and 54 image tokens");
    assert_ne!(with["tokens"], without["tokens"]);
}
