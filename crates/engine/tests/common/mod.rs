//! What the engine's test files share: the fixture folders and their reference prompt.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use candle_core::Device;
use strata_engine::{CacheConfig, EngineConfig, Event, EventSink, GenerationOptions, Job, SamplingParams, Speculation, Worker};
use strata_model::Model;

/// Every Qwen3.5 fixture folder, and the Gemma 3 one (other dense ones live under
/// `fixtures/dense/` and serve as drafts).
#[allow(dead_code)] // not every test file runs every fixture
pub fn fixtures() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).filter(|p| p.join("config.json").exists()).collect();
    dirs.sort();
    // Gemma 3: the sliding-window KV store under batching, speculation and the prompt cache.
    dirs.push(root.join("dense/gemma3-tiny"));
    dirs
}

/// The prompt transformers' references were computed for.
pub fn prompt_tokens(dir: &Path) -> Vec<u32> {
    let t = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    t["tokens"].to_vec1::<i64>().unwrap().into_iter().map(|x| x as u32).collect()
}

/// A job's events, into a channel the test reads.
#[allow(dead_code)] // not every test file submits jobs this way
pub struct Channel(pub mpsc::Sender<Event>);

impl EventSink for Channel {
    fn send(&mut self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// What a job produced.
#[allow(dead_code)] // not every test file reads every field
pub struct Run {
    pub cached: usize,
    pub tokens: Vec<u32>,
    /// Log-probabilities of the whole vocabulary at every step.
    pub logprobs: Vec<Vec<(u32, f32)>>,
}

/// A job's events into a channel; with a count, the requester goes away after that many tokens.
pub struct HangUp(pub mpsc::Sender<Event>, pub Option<usize>);

impl EventSink for HangUp {
    fn send(&mut self, event: Event) -> bool {
        let token = matches!(event, Event::Token(_));
        let alive = self.0.send(event).is_ok();
        if let (true, Some(left)) = (token, self.1.as_mut()) {
            *left -= 1;
            return alive && *left > 0;
        }
        alive
    }
    fn is_closed(&self) -> bool {
        self.1 == Some(0)
    }
}

/// Runs `prompt`; with `hang_up_after`, the requester goes away after that many tokens.
#[allow(dead_code)]
pub fn run_with(worker: &Worker, prompt: &[u32], opts: GenerationOptions, hang_up_after: Option<usize>) -> Run {
    let (tx, rx) = mpsc::channel();
    worker.submit(Job::new(prompt.to_vec(), opts, Box::new(HangUp(tx, hang_up_after)))).unwrap();
    let mut run = Run { cached: usize::MAX, tokens: Vec::new(), logprobs: Vec::new() };
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("the engine answers") {
            Event::Started { cached_tokens } => run.cached = cached_tokens,
            Event::Token(s) => {
                run.tokens.push(s.id);
                run.logprobs.push(s.top_logprobs);
            }
            Event::Finished(_) => return run,
            Event::Failed(e) => panic!("generation failed: {e}"),
        }
    }
}

#[allow(dead_code)]
pub fn greedy(max_tokens: usize, stop_tokens: Vec<u32>) -> GenerationOptions {
    GenerationOptions {
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_tokens,
        prefill_chunk: 8,
        logprobs: Some(512),
        grammar: None,
    }
}

#[allow(dead_code)]
pub fn run(worker: &Worker, prompt: &[u32], max_tokens: usize) -> Run {
    run_with(worker, prompt, greedy(max_tokens, vec![]), None)
}

#[allow(dead_code)]
pub fn assert_same(cold: &Run, warm: &Run, what: &str) {
    assert_eq!(cold.tokens, warm.tokens, "{what}: tokens differ from the cold run");
    for (step, (a, b)) in cold.logprobs.iter().zip(&warm.logprobs).enumerate() {
        let mut a = a.clone();
        let mut b = b.clone();
        a.sort_by_key(|x| x.0);
        b.sort_by_key(|x| x.0);
        assert_eq!(a.len(), 512);
        let worst = a.iter().zip(&b).map(|(x, y)| (x.1 - y.1).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{what}: step {step} log-probabilities differ by {worst}");
    }
}

/// A fresh engine on `model`: 4 rows, prefill chunks of 8 positions, state in a growing pool.
#[allow(dead_code)]
pub fn small_engine(model: Model, cache: CacheConfig, speculation: Option<Speculation>) -> Worker {
    let config = EngineConfig {
        max_batch: 4,
        prefill_chunk: 8,
        max_batched_tokens: None,
        state_budget_bytes: 1 << 30,
        kv_cache_bytes: None,
        kv_block_size: strata_engine::DEFAULT_KV_BLOCK_SIZE,
        gpu_memory_utilization: None,
    };
    Worker::spawn(model, config, cache, speculation).unwrap()
}
