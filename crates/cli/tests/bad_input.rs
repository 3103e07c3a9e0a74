//! Bad model folders and flags: each gives one clear error line naming what is wrong and a
//! non-zero exit, never a panic or a backtrace.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5-tiny-a")
}

fn copy_fixture(src: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    dir
}

/// Runs `strata generate` on `dir` and returns stderr after checking it is one clean error line.
fn generate_error(dir: &Path, extra: &[&str]) -> String {
    command_error(&["generate"], dir, &[&["--tokens", "1,2,3", "--max-tokens", "2"], extra].concat())
}

/// The same for `strata serve`, which must fail before it serves (else it is killed after a
/// minute, and the test fails).
fn serve_error(dir: &Path, extra: &[&str]) -> String {
    command_error(&["serve", "--port", "0"], dir, extra)
}

fn command_error(command: &[&str], dir: &Path, extra: &[&str]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(command)
        .arg("--model")
        .arg(dir)
        .args(extra)
        .env("RUST_BACKTRACE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "expected failure, got success; stderr: {stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("stack backtrace"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "more than one line: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    stderr
}

fn check(setup: impl FnOnce(&Path), expect: &[&str]) {
    let dir = copy_fixture(&fixture());
    setup(dir.path());
    let err = generate_error(dir.path(), &[]);
    for e in expect {
        assert!(err.contains(e), "expected `{e}` in: {err}");
    }
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

fn rewrite_weights(dir: &Path, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let path = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, &path).unwrap();
}

#[test]
fn missing_folder() {
    let err = generate_error(Path::new("/nonexistent/model"), &[]);
    assert!(err.contains("/nonexistent/model") && err.contains("no such model folder"), "{err}");
}

#[test]
fn missing_or_broken_config() {
    check(|d| std::fs::remove_file(d.join("config.json")).unwrap(), &["config.json", "missing"]);
    check(|d| write(d, "config.json", "{ not json"), &["config.json", "invalid JSON"]);
    check(|d| write(d, "config.json", r#"{"model_type": "gpt2"}"#), &["config.json", "`model_type`", "gpt2", "not supported"]);
    // A config of another supported family, with its defaults, does not fit these weights.
    check(|d| write(d, "config.json", r#"{"model_type": "llama"}"#), &["model.safetensors", "embed_tokens", "shape"]);
    check(
        |d| {
            let text = std::fs::read_to_string(d.join("config.json"))
                .unwrap()
                .replace("\"hidden_act\": \"silu\"", "\"hidden_act\": \"relu\"");
            write(d, "config.json", &text);
        },
        &["`text_config.hidden_act`", "relu"],
    );
}

#[test]
fn missing_or_broken_tokenizer() {
    check(|d| std::fs::remove_file(d.join("tokenizer.json")).unwrap(), &["tokenizer.json", "missing"]);
    check(|d| write(d, "tokenizer.json", "{\"version\": 1}"), &["tokenizer.json", "not a valid tokenizer"]);
}

#[test]
fn broken_template_and_generation_config() {
    check(
        |d| write(d, "tokenizer_config.json", r#"{"chat_template": "{% for m in messages %}"}"#),
        &["tokenizer_config.json", "`chat_template`"],
    );
    check(|d| write(d, "generation_config.json", "[1,"), &["generation_config.json", "invalid JSON"]);
}

#[test]
fn missing_truncated_or_corrupt_weights() {
    check(|d| std::fs::remove_file(d.join("model.safetensors")).unwrap(), &["no weights", "model.safetensors"]);
    check(
        |d| {
            let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
            std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
        },
        &["model.safetensors", "not a valid safetensors file"],
    );
    check(
        |d| {
            let mut bytes = std::fs::read(d.join("model.safetensors")).unwrap();
            bytes[8..40].copy_from_slice(&[b'#'; 32]);
            std::fs::write(d.join("model.safetensors"), &bytes).unwrap();
        },
        &["model.safetensors", "not a valid safetensors file"],
    );
    check(|d| write(d, "model.safetensors", ""), &["model.safetensors", "not a valid safetensors file"]);
}

#[test]
fn missing_or_misshaped_tensor() {
    let name = "model.language_model.layers.1.linear_attn.in_proj_qkv.weight";
    check(|d| rewrite_weights(d, |t| drop(t.remove(name))), &[name, "missing"]);
    check(
        |d| {
            rewrite_weights(d, |t| {
                let w = t[name].narrow(0, 0, 10).unwrap();
                t.insert(name.to_string(), w);
            })
        },
        &[name, "[10, 64]", "expected [96, 64]"],
    );
}

#[test]
fn missing_shard() {
    let dir = copy_fixture(&fixture().with_file_name("qwen3_5-tiny-b"));
    std::fs::remove_file(dir.path().join("model-00002-of-00005.safetensors")).unwrap();
    let err = generate_error(dir.path(), &[]);
    assert!(err.contains("model-00002-of-00005.safetensors") && err.contains("missing"), "{err}");
}

/// Runs `strata generate` on fixture A with `args` and returns stderr, which must report failure.
fn flag_error(args: &[&str]) -> String {
    let out =
        Command::new(env!("CARGO_BIN_EXE_strata")).args(["generate", "--model"]).arg(fixture()).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && !err.contains("panicked"), "{err}");
    err
}

#[test]
fn bad_flags() {
    assert!(flag_error(&["--tokens", "1", "--dtype", "f8"]).contains("'f8'"));
    assert!(flag_error(&["--tokens", "1,x"]).contains("`x` is not a token id"));
    assert!(flag_error(&["--tokens", "1,600"]).contains("token id 600 is outside the vocabulary"));
    assert!(flag_error(&["--tokens", "1", "--top-p", "0"]).contains("top_p"));
    assert!(flag_error(&["--tokens", "1", "--device", "tpu"]).contains("--device tpu"));
    assert!(flag_error(&[]).contains("--prompt, --chat or --tokens"));
}

#[test]
fn draft_mtp_without_a_head() {
    let dense = fixture().with_file_name("dense").join("qwen3-tiny-draft");
    let err = generate_error(&dense, &["--draft", "mtp"]);
    assert!(err.contains("--draft mtp") && err.contains("needs a Qwen3.5 model"), "{err}");
    // A Qwen3.5 folder whose conversion dropped `mtp.*`.
    let dir = copy_fixture(&fixture());
    rewrite_weights(dir.path(), |t| t.retain(|k, _| !k.starts_with("mtp.")));
    let err = generate_error(dir.path(), &["--draft", "mtp"]);
    assert!(err.contains("--draft mtp") && err.contains("no multi-token-prediction head"), "{err}");
}

/// Sizes that would overflow are refused at start, naming the flag or field: a context past the
/// model's positions, a config's positions whose state no byte count holds, none at all.
#[test]
fn contexts_past_the_model_or_past_counting() {
    let err = serve_error(&fixture(), &["--max-context", "4611686018427387904"]);
    assert!(err.contains("--max-context 4611686018427387904") && err.contains("max_position_embeddings"), "{err}");
    let with_positions = |n: &'static str| {
        move |d: &Path| {
            let config = std::fs::read_to_string(d.join("config.json")).unwrap();
            let config = config.replace("\"max_position_embeddings\": 131072", &format!("\"max_position_embeddings\": {n}"));
            write(d, "config.json", &config);
        }
    };
    let dir = copy_fixture(&fixture());
    with_positions("4611686018427387904")(dir.path());
    let err = serve_error(dir.path(), &[]);
    assert!(err.contains("--max-context 4611686018427387904") && err.contains("more bytes than"), "{err}");
    check(with_positions("0"), &["config.json", "max_position_embeddings`", "at least 1"]);
}

#[test]
fn model_path_in_a_symlink_loop() {
    let dir = tempfile::tempdir().unwrap();
    let looped = dir.path().join("loop");
    std::os::unix::fs::symlink("loop", &looped).unwrap();
    let err = serve_error(&looped, &[]);
    assert!(err.contains(looped.to_str().unwrap()) && err.contains("Too many levels of symbolic links"), "{err}");
    assert!(!err.contains("no such model folder"), "{err}");
}

#[test]
fn ssd_cache_errors_give_the_os_reason_once() {
    // A folder below a file cannot be created, even by root.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("file"), "").unwrap();
    let cache = dir.path().join("file").join("cache");
    let err = serve_error(&fixture(), &["--ssd-cache", cache.to_str().unwrap()]);
    assert!(err.contains(cache.to_str().unwrap()), "{err}");
    assert_eq!(err.matches("Not a directory").count(), 1, "{err}");
}
