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
