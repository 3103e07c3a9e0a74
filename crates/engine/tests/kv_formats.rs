//! Stored state formats through the engine — quantized KV (`--kv-cache-dtype`, also delayed and
//! with a layer left unquantized) on every fixture with every format its head dimension takes,
//! and recurrent state in bf16 (`--mamba-ssm-cache-dtype bfloat16`) on every fixture with
//! recurrent layers: a request gives the same greedy tokens and log-probabilities (every
//! vocabulary entry, within 1e-5) whether it runs cold, from a RAM hit, or from the SSD tier
//! after a restart; the same tokens with speculative decoding (drafts rejected and rolled back,
//! rows batched) and when resumed from a checkpoint after a crash — each the same format's
//! uninterrupted run. And the format is in force: its log-probabilities are not the plain
//! ones.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use candle_core::{DType, Device};
use strata_engine::cache::{Identity, SsdOptions};
use strata_engine::{CacheConfig, DraftSource, GenerationOptions, SamplingParams, Speculation, SsdConfig, Worker};
use strata_model::{Model, ModelFolder};
use strata_state::{KvFormat, KvPolicy};

mod common;
use common::{assert_same, fixtures, greedy, prompt_tokens, run, run_with, small_engine};

/// The formats under test, each run on every fixture whose head dimension it codes: alone, and
/// then delayed to position 20 (within the fixtures' prompts) and with the last KV layer left
/// unquantized.
const FORMATS: [&str; 5] = ["turbo3", "turbo-k4ipv2", "affine4-g32", "affine-k8v4-g128", "affine3-g64"];

/// How a run stores its state: attention KV, and the recurrent layers' matrices.
#[derive(Clone, Default)]
struct Stored {
    kv: KvPolicy,
    ssm_bf16: bool,
}

impl std::fmt::Display for Stored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "kv-{}{}", self.kv, if self.ssm_bf16 { "+ssm-bf16" } else { "" })
    }
}

fn load(dir: &Path, stored: &Stored) -> Model {
    let mut model = ModelFolder::open(dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
    model.set_kv_format(stored.kv.clone()).unwrap();
    model.set_ssm_cache_dtype(if stored.ssm_bf16 { DType::BF16 } else { DType::F32 }).unwrap();
    model
}

/// The policies of [`FORMATS`] that `dir`'s model can store its KV in, and a bf16 recurrent
/// state where it has recurrent layers.
fn formats(dir: &Path) -> Vec<Stored> {
    let spec = load(dir, &Stored::default()).state_spec();
    let formats = FORMATS.iter().map(|f| f.parse::<KvFormat>().unwrap());
    let policies = formats.flat_map(|format| {
        [
            KvPolicy::from(format),
            KvPolicy { format, start: 20, ..KvPolicy::default() },
            KvPolicy { format, unquantized: vec![-1], ..KvPolicy::default() },
        ]
    });
    // Leaving the last layer unquantized needs another layer to quantize.
    let is_recurrent = |l: &strata_state::LayerSpec| matches!(l, strata_state::LayerSpec::Recurrent(_));
    let kv_layers = spec.layers.iter().filter(|l| !is_recurrent(l)).count();
    let kv = policies.filter(|p| spec.clone().with_kv(p.clone()).is_ok() && (p.unquantized.is_empty() || kv_layers > 1));
    let mut formats: Vec<Stored> = kv.map(|kv| Stored { kv, ssm_bf16: false }).collect();
    if spec.layers.iter().any(is_recurrent) {
        formats.push(Stored { kv: KvPolicy::default(), ssm_bf16: true });
    }
    formats
}

fn cache(ssd: Option<&Path>, format: &Stored, checkpoint_every: usize) -> CacheConfig {
    let ssd = ssd.map(|dir| SsdConfig {
        options: SsdOptions { dir: dir.to_path_buf(), max_bytes: 1 << 30, verify: false },
        identity: Identity { model: "fixture".into(), config_hash: 1, tokenizer_hash: 2, dtype: format!("f32+{format}") },
        queue: 256,
    });
    CacheConfig { ram_bytes: 1 << 30, stride: 8, ssd, checkpoint_every }
}

fn engine(dir: &Path, format: &Stored, cache: CacheConfig, speculation: Option<Speculation>) -> Worker {
    small_engine(load(dir, format), cache, speculation)
}

#[test]
fn stored_formats_are_exact_under_cache_hits_restarts_speculation_and_resumes() {
    let mut ran = Vec::new();
    for dir in fixtures() {
        let prompt = prompt_tokens(&dir);
        let plain = run(&engine(&dir, &Stored::default(), CacheConfig::off(), None), &prompt, 12);
        for stored in formats(&dir) {
            let format = &stored;
            let what = |case: &str| format!("{}, {format}: {case}", dir.display());
            ran.push(stored.to_string());
            let ssd = tempfile::tempdir().unwrap();
            let worker = engine(&dir, format, cache(Some(ssd.path()), format, 0), None);
            let cold = run(&worker, &prompt, 12);
            assert_eq!(cold.cached, 0);
            let worst = plain.logprobs[0].iter().zip(&cold.logprobs[0]).map(|(a, b)| (a.1 - b.1).abs()).fold(0f32, f32::max);
            assert!(worst > 1e-4, "{}: the stored format's log-probabilities are the plain ones", what("in force"));

            let warm = run(&worker, &prompt, 12);
            assert_eq!(warm.cached, prompt.len() - 1, "{}", what("RAM hit"));
            assert_same(&cold, &warm, &what("RAM hit"));
            assert_eq!(worker.shutdown(Duration::from_secs(60)), 0, "every queued write lands");
            drop(worker);
            let restarted = engine(&dir, format, cache(Some(ssd.path()), format, 0), None);
            let from_ssd = run(&restarted, &prompt, 12);
            assert_eq!(from_ssd.cached, prompt.len() - 1, "{}", what("SSD hit"));
            assert_eq!(restarted.cache_stats().ssd_hits.load(Ordering::Relaxed), 1);
            assert_same(&cold, &from_ssd, &what("SSD hit after restart"));

            // Speculation: a draft model with other weights (often wrong, so rounds are rolled
            // back), two rows batched.
            let other = fixtures().into_iter().find(|d| *d != dir).unwrap();
            let draft = ModelFolder::open(&other).unwrap().load(DType::F32, &Device::Cpu).unwrap();
            let speculation = Speculation { source: DraftSource::Model(Box::new(draft)), tokens: 4 };
            let speculative = engine(&dir, format, CacheConfig::off(), Some(speculation));
            let both = run_with_both(&speculative, &prompt);
            assert_eq!(both[0], cold.tokens, "{}", what("speculative decoding"));
            assert_eq!(both[1], cold.tokens, "{}", what("speculative decoding, batched"));

            // A sampled generation interrupted by a crash resumes from its checkpoint (requests
            // asking for log-probabilities are not checkpointed).
            let sampled = GenerationOptions {
                sampling: SamplingParams { temperature: 1.0, seed: Some(5), ..SamplingParams::greedy() },
                logprobs: None,
                ..greedy(20, vec![])
            };
            let whole = run_with(&engine(&dir, format, CacheConfig::off(), None), &prompt, sampled.clone(), None).tokens;
            let ssd = tempfile::tempdir().unwrap();
            let crashed = engine(&dir, format, cache(Some(ssd.path()), format, 4), None);
            let partial = run_with(&crashed, &prompt, sampled.clone(), Some(9)).tokens;
            assert_eq!(partial, whole[..9]);
            assert_eq!(crashed.shutdown(Duration::from_secs(60)), 0);
            drop(crashed);
            let restarted = engine(&dir, format, cache(Some(ssd.path()), format, 4), None);
            let resumed = run_with(&restarted, &prompt, sampled, None);
            assert_eq!(restarted.cache_stats().checkpoint_resumes.load(Ordering::Relaxed), 1, "{}", what("resumed"));
            assert_eq!(resumed.tokens, whole, "{}", what("checkpoint resume"));
        }
    }
    for kind in ["kv-turbo", "kv-affine", "kv-auto+ssm-bf16"] {
        assert!(ran.iter().any(|f| f.starts_with(kind)), "no fixture ran {kind}: {ran:?}");
    }
}

/// Two copies of `prompt` submitted at once; each one's greedy tokens.
fn run_with_both(worker: &Worker, prompt: &[u32]) -> Vec<Vec<u32>> {
    let (tx_a, rx_a) = std::sync::mpsc::channel();
    let (tx_b, rx_b) = std::sync::mpsc::channel();
    for tx in [tx_a, tx_b] {
        let job = strata_engine::Job::new(prompt.to_vec(), greedy(12, vec![]), Box::new(common::HangUp(tx, None)));
        worker.submit(job).unwrap();
    }
    [rx_a, rx_b]
        .iter()
        .map(|rx| {
            let mut tokens = Vec::new();
            loop {
                match rx.recv_timeout(Duration::from_secs(120)).expect("the engine answers") {
                    strata_engine::Event::Token(s) => tokens.push(s.id),
                    strata_engine::Event::Finished(g) => {
                        assert!(g.accepted_tokens < g.drafted_tokens, "some drafts were rejected and rolled back");
                        return tokens;
                    }
                    strata_engine::Event::Failed(e) => panic!("generation failed: {e}"),
                    _ => {}
                }
            }
        })
        .collect()
}
