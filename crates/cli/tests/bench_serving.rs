//! `strata bench --request-rate`: the serving benchmark against strata's server on the tiny
//! fixture, started in process and at `--url`, with the server's refusals counted or reported.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Output};

use serde_json::{json, Value};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5-tiny-a")
}

/// `strata bench ARGS`, with `api_key` as `OPENAI_API_KEY`.
fn bench(args: &[&str], api_key: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_strata"));
    command.arg("bench").args(args).env_remove("OPENAI_API_KEY");
    if let Some(key) = api_key {
        command.env("OPENAI_API_KEY", key);
    }
    command.output().unwrap()
}

fn json_lines(out: &Output) -> Vec<Value> {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// A server that is stopped however the test ends (it would outlive a failed test, holding the
/// test's output open).
struct KilledOnDrop(Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

const METRICS: [&str; 20] = [
    "duration_s",
    "req_s",
    "output_tok_s",
    "total_tok_s",
    "ttft_ms_mean",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_mean",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "itl_ms_mean",
    "itl_ms_p50",
    "itl_ms_p99",
    "e2el_ms_mean",
    "e2el_ms_p50",
    "e2el_ms_p99",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
];

#[test]
fn in_process_runs_measure_every_request_at_each_rate() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("sweep.png");
    let model = fixture();
    let args = ["--request-rate", "inf,50", "--num-prompts", "8", "--prompt-len", "16", "--gen-len", "8", "--json"];
    let out = bench(&[&["--model", model.to_str().unwrap(), "--plot", plot.to_str().unwrap()][..], &args].concat(), None);
    let runs = json_lines(&out);
    assert_eq!(runs.len(), 2);
    for (run, rate) in runs.iter().zip([json!("inf"), json!(50.0)]) {
        assert_eq!(run["request_rate"], rate);
        for key in METRICS {
            assert!(run[key].as_f64().is_some_and(|v| v >= 0.0), "{key} in {run}");
        }
        assert_eq!((run["completed"].as_u64(), run["failed"].as_u64()), (Some(8), Some(0)), "{run}");
        assert_eq!((run["total_input_tokens"].as_u64(), run["total_output_tokens"].as_u64()), (Some(8 * 16), Some(8 * 8)));
        assert_eq!((&run["dtype"], &run["first_error"]), (&json!("f32"), &Value::Null));
        let ms = |key: &str| run[key].as_f64().unwrap();
        for stat in ["mean", "p50", "p99"] {
            let (ttft, e2el) = (ms(&format!("ttft_ms_{stat}")), ms(&format!("e2el_ms_{stat}")));
            assert!(0.0 < ttft && ttft <= e2el, "TTFT {stat} {ttft} ms, E2E {e2el} ms");
            assert!(ms(&format!("tpot_ms_{stat}")) > 0.0 && ms(&format!("itl_ms_{stat}")) > 0.0, "{run}");
        }
        // Throughputs are the run's totals over its duration.
        assert!((ms("output_tok_s") * ms("duration_s") - 64.0).abs() < 1e-6, "{run}");
        assert!((ms("total_tok_s") * ms("duration_s") - 192.0).abs() < 1e-6, "{run}");
        assert!(ms("e2el_ms_p99") <= ms("duration_s") * 1e3);
        // The engine's own counters over the run: each 16-token prompt one chunk, and every
        // request's 7 tokens after its first from steps with running rows.
        let engine = &run["engine"];
        assert_eq!(engine["prefill_chunks"].as_u64(), Some(8), "{engine}");
        let (forwards, mixed) = (engine["prefill_forwards"].as_u64().unwrap(), engine["mixed_steps"].as_u64().unwrap());
        assert!((1..=8).contains(&forwards) && mixed <= forwards, "{engine}");
        assert!(engine["decode_steps"].as_u64().is_some_and(|steps| (7..=56).contains(&steps)), "{engine}");
        assert!(engine["decode_step_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{engine}");
    }
    let png = std::fs::read(&plot).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000, "{} bytes", png.len());
}

#[test]
fn a_server_at_a_url_is_measured_and_its_refusals_are_counted_or_reported() {
    // Room for 16 prompt + 8 output tokens, and no more.
    let mut command = Command::new(env!("CARGO_BIN_EXE_strata"));
    command.args(["serve", "--port", "0", "--api-key", "secret", "--max-context", "24", "--model"]).arg(fixture());
    let (server, url, _) = common::start_server(&mut command);
    let server = KilledOnDrop(server);
    let measure = |extra: &[&str], api_key| {
        let args = ["--url", &url, "--vocab-size", "512", "--request-rate", "inf", "--prompt-len", "16", "--gen-len", "8"];
        bench(&[&args[..], extra].concat(), api_key)
    };

    let refused = measure(&["--num-prompts", "4"], None);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("/v1/models answered HTTP 401"), "{stderr}");

    // The model named as GET /v1/models lists it; the table has a column for the rate.
    let table = measure(&["--num-prompts", "4"], Some("secret"));
    assert!(table.status.success(), "{}", String::from_utf8_lossy(&table.stderr));
    let stdout = String::from_utf8(table.stdout).unwrap();
    assert!(stdout.contains(&format!("{} at {url}", fixture().display())), "{stdout}");
    let row =
        |name: &str| stdout.lines().find(|l| l.starts_with(name)).map(|l| l[name.len()..].split_whitespace().collect::<Vec<_>>());
    assert_eq!(row("request rate (req/s)"), Some(vec!["inf"]));
    assert_eq!((row("successful requests"), row("failed requests")), (Some(vec!["4"]), Some(vec!["0"])));
    assert!(row("TPOT p99 (ms)").is_some());
    assert!(row("decode steps").is_none(), "another server's engine is not counted: {stdout}");

    // Lengths drawn around 16 and 8: those past the context are refused, counted as failures
    // (with seed 5, the first request, which is sent alone first and must succeed, fits).
    let spread = measure(&["--num-prompts", "16", "--random-range-ratio", "0.5", "--seed", "5", "--json"], Some("secret"));
    let run = &json_lines(&spread)[0];
    let (completed, failed) = (run["completed"].as_u64().unwrap(), run["failed"].as_u64().unwrap());
    assert!(completed > 0 && failed > 0 && completed + failed == 16, "{run}");
    assert!(run["first_error"].as_str().unwrap().contains("HTTP 400"), "{run}");
    assert!(String::from_utf8_lossy(&spread.stderr).contains(&format!("{failed} of 16 requests failed")));

    drop(server);
    let gone = measure(&["--num-prompts", "4", "--served-model-name", "m"], Some("secret"));
    assert!(!gone.status.success());
    let stderr = String::from_utf8_lossy(&gone.stderr);
    assert!(stderr.contains(&format!("cannot reach {url}/v1/completions")), "{stderr}");
}
