//! The prompt cache against cold runs: a request served from a RAM hit, from a stride
//! snapshot, or from the SSD tier after a restart gives the same log-probabilities (every
//! vocabulary entry, within 1e-5) and the same greedy tokens as the same request run cold; a
//! resent conversation reuses the previous turn; a generation interrupted by a crash resumes
//! from its checkpoint with the output of an uninterrupted run.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use strata_engine::cache::{Identity, SsdOptions};
use strata_engine::{CacheConfig, EngineConfig, Event, EventSink, GenerationOptions, Job, SamplingParams, SsdConfig, Worker};
use strata_model::ModelFolder;

mod common;
use common::{assert_same, fixtures, greedy, prompt_tokens, run, run_with, small_engine, HangUp};

fn cache(ssd: Option<&Path>, checkpoint_every: usize) -> CacheConfig {
    let ssd = ssd.map(|dir| SsdConfig {
        options: SsdOptions { dir: dir.to_path_buf(), max_bytes: 1 << 30, verify: false },
        identity: Identity { model: "fixture".into(), config_hash: 1, tokenizer_hash: 2, dtype: "f32".into() },
        queue: 256,
    });
    CacheConfig { ram_bytes: 1 << 30, stride: 8, ssd, checkpoint_every }
}

/// A fresh engine on the fixture in `dir` (each worker owns its model).
fn engine(dir: &Path, cache: CacheConfig) -> Worker {
    small_engine(ModelFolder::open(dir).unwrap().load(DType::F32, &Device::Cpu).unwrap(), cache, None)
}

#[test]
fn ram_hit_and_stride_snapshot_match_cold_runs() {
    for dir in fixtures() {
        let prompt = prompt_tokens(&dir);
        let worker = engine(&dir, cache(None, 0));
        let cold = run(&worker, &prompt, 12);
        assert_eq!(cold.cached, 0, "{dir:?}: the first request is cold");
        let warm = run(&worker, &prompt, 12);
        assert_eq!(warm.cached, prompt.len() - 1, "{dir:?}: a repeated prompt reuses all but its last token");
        assert_same(&cold, &warm, "RAM hit");

        // Shares 21 tokens with the first prompt: a state that trims (all KV) serves all 21, a
        // recurrent one the snapshot at 16 (stride 8).
        let mut other = prompt[..21].to_vec();
        other.extend(prompt[25..].iter().rev());
        let from_stride = run(&worker, &other, 12);
        let trims = ModelFolder::open(&dir).unwrap().load(DType::F32, &Device::Cpu).unwrap().new_state(1).unwrap().can_trim();
        let served = if trims { 21 } else { 16 };
        assert_eq!(from_stride.cached, served, "{dir:?}: served from the longest usable snapshot");
        let cold_other = run(&engine(&dir, cache(None, 0)), &other, 12);
        assert_eq!(cold_other.cached, 0);
        assert_same(&cold_other, &from_stride, "stride snapshot");
        let stats = worker.cache_stats();
        assert_eq!(stats.ram_hits.load(Ordering::Relaxed), 2);
        assert_eq!(stats.hit_tokens.load(Ordering::Relaxed), (prompt.len() - 1 + served) as u64);
    }
}

#[test]
fn ssd_hit_after_restart_matches_cold_run() {
    for dir in fixtures() {
        let prompt = prompt_tokens(&dir);
        let ssd = tempfile::tempdir().unwrap();
        let first = engine(&dir, cache(Some(ssd.path()), 0));
        let cold = run(&first, &prompt, 12);
        assert_eq!(cold.cached, 0);
        assert_eq!(first.shutdown(Duration::from_secs(60)), 0, "every queued write lands");
        drop(first);

        let restarted = engine(&dir, cache(Some(ssd.path()), 0));
        assert!(restarted.recovery().unwrap().entries > 0, "the restarted engine finds the stored entries");
        let warm = run(&restarted, &prompt, 12);
        assert_eq!(warm.cached, prompt.len() - 1, "{dir:?}: served from the SSD tier");
        assert_eq!(restarted.cache_stats().ssd_hits.load(Ordering::Relaxed), 1);
        assert_same(&cold, &warm, "SSD hit after restart");
    }
}

#[test]
fn resent_conversation_reuses_the_previous_turn() {
    for dir in fixtures() {
        let prompt = prompt_tokens(&dir)[..20].to_vec();
        let worker = engine(&dir, cache(None, 0));
        // End the first answer on a token of its own, as an end-of-turn token would.
        let probe = run(&worker, &prompt, 8).tokens;
        let stop = probe[5];
        let first = run_with(&worker, &prompt, greedy(8, vec![stop]), None);
        let answer = &probe[..probe.iter().position(|&t| t == stop).unwrap()];
        assert_eq!(first.tokens, answer);

        let mut second = prompt.clone();
        second.extend_from_slice(answer);
        second.push(stop);
        second.extend(prompt_tokens(&dir)[20..30].iter());
        let warm = run(&worker, &second, 8);
        assert!(
            warm.cached >= prompt.len() + answer.len(),
            "{dir:?}: turn two reused {} tokens, the first turn held {}",
            warm.cached,
            prompt.len() + answer.len()
        );
        let cold = run(&engine(&dir, cache(None, 0)), &second, 8);
        assert_same(&cold, &warm, "second turn");
    }
}

#[test]
fn interrupted_generation_resumes_from_its_checkpoint() {
    let dir = &fixtures()[0];
    let prompt = prompt_tokens(dir);
    let sampling = SamplingParams { temperature: 1.0, seed: Some(11), ..SamplingParams::greedy() };
    let folder = strata_model::ModelFolder::open(dir).unwrap();
    let grammars = strata_engine::Grammars::new(&folder.tokenizer, folder.config.vocab_size, 2).unwrap();
    // Structured output too: the resumed row's constraint is where the interrupted one's was.
    let structured = grammars.compile(&strata_engine::Structure::Regex("[a-z ]{60,300}".into()), None).unwrap();
    for grammar in [None, Some(structured)] {
        let opts = GenerationOptions {
            max_tokens: 24,
            sampling: sampling.clone(),
            stop_tokens: vec![],
            prefill_chunk: 8,
            logprobs: None,
            grammar,
        };
        let whole = run_with(&engine(dir, CacheConfig::off()), &prompt, opts.clone(), None).tokens;
        assert_eq!(whole.len(), 24);

        let ssd = tempfile::tempdir().unwrap();
        let crashed = engine(dir, cache(Some(ssd.path()), 4));
        let partial = run_with(&crashed, &prompt, opts.clone(), Some(10)).tokens;
        assert_eq!(partial, whole[..10]);
        assert_eq!(crashed.shutdown(Duration::from_secs(60)), 0);
        assert!(crashed.cache_stats().checkpoints_written.load(Ordering::Relaxed) >= 2);
        drop(crashed);

        let restarted = engine(dir, cache(Some(ssd.path()), 4));
        let resumed = run_with(&restarted, &prompt, opts.clone(), None);
        assert_eq!(restarted.cache_stats().checkpoint_resumes.load(Ordering::Relaxed), 1, "resumed, not started over");
        assert_eq!(resumed.tokens, whole, "the resumed output equals an uninterrupted run");
        if opts.grammar.is_some() {
            let text = folder.tokenizer.decode(&whole, false).unwrap();
            assert!(text.chars().all(|c| c == ' ' || c.is_ascii_lowercase()), "{text:?}");
        }
    }
}

/// A requester that holds the engine thread (it calls `send`): at `Started` and again at its
/// third token, each time until the test gives way on `gate`.
struct Gate {
    events: mpsc::Sender<Event>,
    gate: mpsc::Receiver<()>,
    tokens: usize,
}

impl EventSink for Gate {
    fn send(&mut self, event: Event) -> bool {
        self.tokens += matches!(event, Event::Token(_)) as usize;
        if matches!(event, Event::Started { .. }) || self.tokens == 3 && matches!(event, Event::Token(_)) {
            self.gate.recv().unwrap();
        }
        self.events.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// Waits until `done` holds (failing after 30 s).
fn wait_for(what: &str, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(30), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// After a restart, a burst of requests that all hit the SSD tier: while the first one runs,
/// only what the state budget and the batch can take next is restored onto the device — the
/// job admitted next, once it fits — never the whole queue.
#[test]
fn a_burst_after_restart_restores_only_what_admission_can_take() {
    let dir = &fixtures()[0];
    let base = prompt_tokens(dir);
    // Six prompts sharing no prefix, so each is served by its own SSD entry.
    let prompts: Vec<Vec<u32>> = (1..=6).map(|first| [&[first][..], &base[..15]].concat()).collect();
    let opts = GenerationOptions { logprobs: None, ..greedy(6, vec![]) };
    let ssd = tempfile::tempdir().unwrap();
    let first = engine(dir, cache(Some(ssd.path()), 0));
    for prompt in &prompts {
        run_with(&first, prompt, opts.clone(), None);
    }
    assert_eq!(first.shutdown(Duration::from_secs(60)), 0);
    drop(first);

    // The budget fits one job and a half: the next is not read while the first runs. With two
    // and a half and a batch of one, the next is read, and waits within the budget.
    for (max_batch, halves, restored_ahead) in [(4, 3, 0), (1, 5, 1)] {
        let model = ModelFolder::open(dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
        let need = model.state_cost().bytes(16 + opts.max_tokens).unwrap();
        let config = EngineConfig {
            max_batch,
            prefill_chunk: 8,
            max_batched_tokens: None,
            state_budget_bytes: need * halves / 2,
            kv_cache_bytes: None,
            kv_block_size: strata_engine::DEFAULT_KV_BLOCK_SIZE,
            gpu_memory_utilization: None,
        };
        let worker = Worker::spawn(model, config, cache(Some(ssd.path()), 0), None).unwrap();
        let stats = worker.cache_stats();
        let (open, gate) = mpsc::channel();
        let mut gate = Some(gate);
        let answers: Vec<mpsc::Receiver<Event>> = prompts
            .iter()
            .map(|prompt| {
                let (events, answer) = mpsc::channel();
                let sink: Box<dyn EventSink> = match gate.take() {
                    Some(gate) => Box::new(Gate { events, gate, tokens: 0 }),
                    None => Box::new(HangUp(events, None)),
                };
                worker.submit(Job::new(prompt.clone(), opts.clone(), sink)).unwrap();
                answer
            })
            .collect();
        // Every job is queued; the first starts and holds the engine at its third token.
        open.send(()).unwrap();
        let restores = || stats.ssd_restores.load(Ordering::Relaxed);
        let waiting = || stats.ssd_restored_waiting_bytes.load(Ordering::Relaxed);
        wait_for("the restores", || restores() == 1 + restored_ahead && (waiting() > 0) == (restored_ahead > 0));
        std::thread::sleep(Duration::from_secs(1));
        assert_eq!(restores(), 1 + restored_ahead, "restored ahead of admission (batch {max_batch}, budget {halves}/2 jobs)");
        assert_eq!(waiting() > 0, restored_ahead > 0);

        open.send(()).unwrap();
        for (prompt, answer) in prompts.iter().zip(answers) {
            let mut cached = None;
            loop {
                match answer.recv_timeout(Duration::from_secs(120)).expect("the engine answers") {
                    Event::Started { cached_tokens } => cached = Some(cached_tokens),
                    Event::Token(_) => {}
                    Event::Finished(_) => break,
                    Event::Failed(e) => panic!("generation failed: {e}"),
                }
            }
            assert_eq!(cached, Some(prompt.len() - 1), "each job is served from its SSD entry");
        }
        assert_eq!((restores(), waiting()), (6, 0));
    }
}
