//! Continuous batching against single-sequence runs: rows joining at different steps, at their
//! own positions — their prompts' chunks in the same forwards as the running rows' decode
//! positions — give the tokens they give alone; a long prompt joining a running batch is fed
//! one chunk per step while the running streams keep flowing.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use strata_engine::{generate, CacheConfig, EngineConfig, Event, EventSink, GenerationOptions, Job, SamplingParams, Worker};
use strata_model::{Model, ModelFolder};

mod common;
use common::{fixtures, prompt_tokens};

fn load(dir: &PathBuf) -> (Model, Vec<u32>) {
    let model = ModelFolder::open(dir).unwrap().load(DType::F32, &Device::Cpu).unwrap();
    (model, prompt_tokens(dir))
}

/// Records every event with the time it was sent.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<(Instant, Event)>>>);

impl EventSink for Recorder {
    fn send(&mut self, event: Event) -> bool {
        self.0.lock().unwrap().push((Instant::now(), event));
        true
    }
    fn is_closed(&self) -> bool {
        false
    }
}

impl Recorder {
    fn tokens(&self) -> Vec<u32> {
        self.0.lock().unwrap().iter().filter_map(|(_, e)| if let Event::Token(s) = e { Some(s.id) } else { None }).collect()
    }
    /// Each token with its top log-probabilities.
    fn tokens_with_logprobs(&self) -> Vec<(u32, Vec<(u32, f32)>)> {
        let events = self.0.lock().unwrap();
        events
            .iter()
            .filter_map(|(_, e)| if let Event::Token(s) = e { Some((s.id, s.top_logprobs.clone())) } else { None })
            .collect()
    }
    fn token_times(&self) -> Vec<Instant> {
        self.0.lock().unwrap().iter().filter_map(|(t, e)| matches!(e, Event::Token(_)).then_some(*t)).collect()
    }
    fn finished(&self) -> bool {
        self.0.lock().unwrap().iter().any(|(_, e)| matches!(e, Event::Finished(_) | Event::Failed(_)))
    }
    fn wait(&self, f: impl Fn(&Self) -> bool) {
        let start = Instant::now();
        while !f(self) {
            assert!(start.elapsed() < Duration::from_secs(120), "timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// An engine of up to 8 rows taking prompts in 128-token chunks (past the batch-invariant
/// kernels' rows), with the step budget given or the default.
fn long_prompt_engine(dir: &PathBuf, max_batched_tokens: Option<usize>) -> Worker {
    let config = EngineConfig { max_batch: 8, prefill_chunk: 128, max_batched_tokens, ..EngineConfig::for_device(&Device::Cpu) };
    Worker::spawn(load(dir).0, config, CacheConfig::off(), None).unwrap()
}

fn opts(max_tokens: usize, sampling: SamplingParams) -> GenerationOptions {
    GenerationOptions { max_tokens, sampling, stop_tokens: vec![], prefill_chunk: 512, logprobs: None, grammar: None }
}

fn batch_matches_solo(sampling: impl Fn(usize) -> SamplingParams) {
    for dir in fixtures() {
        let (model, tokens) = load(&dir);
        // Eight requests of different prompt lengths and budgets.
        let jobs: Vec<(Vec<u32>, GenerationOptions)> =
            [(3, 10), (7, 24), (12, 16), (20, 20), (25, 12), (33, 24), (40, 18), (5, 22)]
                .iter()
                .enumerate()
                .map(|(i, &(len, max))| (tokens[i..(i + len).min(tokens.len())].to_vec(), opts(max, sampling(i))))
                .collect();
        // Alone, with the engine's prefill chunking: a row's logits are then bit-identical in and
        // out of a batch, so even seeded sampling must give the same tokens.
        let chunk = 4;
        let solo: Vec<Vec<u32>> = jobs
            .iter()
            .map(|(p, o)| generate(&model, p, &GenerationOptions { prefill_chunk: chunk, ..o.clone() }, |_| true).unwrap().tokens)
            .collect();
        let worker = Worker::spawn(
            model,
            EngineConfig {
                max_batch: 8,
                prefill_chunk: chunk,
                max_batched_tokens: None,
                state_budget_bytes: 1 << 30,
                kv_cache_bytes: None,
                kv_block_size: strata_engine::DEFAULT_KV_BLOCK_SIZE,
                gpu_memory_utilization: None,
            },
            CacheConfig::off(),
            None,
        )
        .unwrap();
        let recorders: Vec<Recorder> = (0..jobs.len()).map(|_| Recorder::default()).collect();
        let submit = |i: usize| {
            let (prompt, o) = jobs[i].clone();
            worker.submit(Job::new(prompt, o, Box::new(recorders[i].clone()))).unwrap();
        };
        // Join in three waves, each while the earlier rows are mid-generation.
        (0..3).for_each(submit);
        recorders[0].wait(|r| r.tokens().len() >= 3);
        (3..6).for_each(submit);
        recorders[4].wait(|r| !r.tokens().is_empty());
        (6..8).for_each(submit);
        for (i, r) in recorders.iter().enumerate() {
            r.wait(Recorder::finished);
            assert_eq!(r.tokens(), solo[i], "{} request {i}", dir.display());
        }
        // The later waves' prompts rode in the running rows' steps.
        assert!(worker.stats().mixed_steps.load(Ordering::Relaxed) > 0, "{}: no step mixed decode and prefill", dir.display());
        // The engine retires a row right after sending its last event: allow it that moment.
        let active = || worker.stats().active.load(std::sync::atomic::Ordering::Relaxed);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while active() != 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(active(), 0, "rows still active after every request finished");
    }
}

#[test]
fn greedy_rows_joining_at_different_steps_match_solo_runs() {
    batch_matches_solo(|_| SamplingParams::greedy());
}

#[test]
fn seeded_rows_joining_at_different_steps_match_solo_runs() {
    batch_matches_solo(|i| SamplingParams {
        temperature: 1.0,
        top_k: 40,
        top_p: 0.95,
        seed: Some(100 + i as u64),
        ..SamplingParams::greedy()
    });
}

#[test]
fn a_long_prompt_joins_one_chunk_per_step() {
    let dir = &fixtures()[0];
    let (model, tokens) = load(dir);
    let long: Vec<u32> = tokens.iter().cycle().take(640).copied().collect();
    let chunk = 32;
    let chunks = long.len() / chunk;
    // Time the whole prefill alone, for scale.
    let start = Instant::now();
    generate(&model, &long, &GenerationOptions { prefill_chunk: chunk, ..opts(1, SamplingParams::greedy()) }, |_| true).unwrap();
    let full_prefill = start.elapsed();

    let worker = Worker::spawn(
        model,
        EngineConfig {
            max_batch: 8,
            prefill_chunk: chunk,
            max_batched_tokens: None,
            state_budget_bytes: 1 << 30,
            kv_cache_bytes: None,
            kv_block_size: strata_engine::DEFAULT_KV_BLOCK_SIZE,
            gpu_memory_utilization: None,
        },
        CacheConfig::off(),
        None,
    )
    .unwrap();
    let running = Recorder::default();
    worker.submit(Job::new(tokens[..5].to_vec(), opts(400, SamplingParams::greedy()), Box::new(running.clone()))).unwrap();
    running.wait(|r| r.tokens().len() >= 5);
    let joiner = Recorder::default();
    let joined_at = Instant::now();
    worker.submit(Job::new(long, opts(2, SamplingParams::greedy()), Box::new(joiner.clone()))).unwrap();
    joiner.wait(|r| !r.tokens().is_empty());
    let first = joiner.token_times()[0];
    let during: Vec<Instant> = running.token_times().into_iter().filter(|t| *t >= joined_at && *t <= first).collect();
    // One decode step per prefill chunk: the running stream got a token for (almost) every chunk.
    assert!(during.len() + 1 >= chunks, "only {} tokens during {chunks} prefill chunks", during.len());
    // The gaps are wall-clock and so only printed: a loaded machine stalls any one step.
    let longest_gap = during.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    println!("longest gap {longest_gap:?} while a {chunks}-chunk prompt joined (its whole prefill alone: {full_prefill:?})");
}

#[test]
fn admission_respects_the_state_budget_and_arrival_order() {
    let dir = &fixtures()[0];
    let (model, tokens) = load(dir);
    let cost = model.state_cost();
    // Room for exactly one request of 30 tokens at a time.
    let budget = cost.bytes(30).unwrap() + cost.bytes(30).unwrap() / 2;
    let worker = Worker::spawn(
        model,
        EngineConfig {
            max_batch: 8,
            prefill_chunk: 8,
            max_batched_tokens: None,
            state_budget_bytes: budget,
            kv_cache_bytes: None,
            kv_block_size: strata_engine::DEFAULT_KV_BLOCK_SIZE,
            gpu_memory_utilization: None,
        },
        CacheConfig::off(),
        None,
    )
    .unwrap();
    assert!(worker.admissible(10_000).unwrap_err().contains("state budget"));
    let recorders: Vec<Recorder> = (0..3).map(|_| Recorder::default()).collect();
    for r in &recorders {
        worker.submit(Job::new(tokens[..10].to_vec(), opts(20, SamplingParams::greedy()), Box::new(r.clone()))).unwrap();
    }
    for r in &recorders {
        r.wait(Recorder::finished);
    }
    // Each ran only after the previous one finished: first tokens come in arrival order, and
    // no two requests overlapped.
    let spans: Vec<(Instant, Instant)> = recorders
        .iter()
        .map(|r| {
            let t = r.token_times();
            (t[0], *t.last().unwrap())
        })
        .collect();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "requests overlapped despite the budget");
}

/// Prompts that arrive together prefill as rows of shared forwards — fewer forwards than
/// chunks — and each request gets the tokens it gets alone, under greedy and seeded sampling:
/// chunks short enough for the batch-invariant kernels keep every row's bits.
#[test]
fn prompts_arriving_together_prefill_together_and_match_solo_runs() {
    for dir in fixtures() {
        let (model, tokens) = load(&dir);
        let text: Vec<u32> = tokens.iter().cycle().take(400).copied().collect();
        let chunk = 48;
        let jobs: Vec<(Vec<u32>, GenerationOptions)> = [20, 20, 33, 7, 20, 45, 12, 20]
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let sampling = match i % 2 {
                    0 => SamplingParams::greedy(),
                    _ => SamplingParams { temperature: 0.8, top_k: 20, seed: Some(7 + i as u64), ..SamplingParams::greedy() },
                };
                (text[30 * i..30 * i + len].to_vec(), opts(10, sampling))
            })
            .collect();
        let solo: Vec<Vec<u32>> = jobs
            .iter()
            .map(|(p, o)| generate(&model, p, &GenerationOptions { prefill_chunk: chunk, ..o.clone() }, |_| true).unwrap().tokens)
            .collect();
        let config = EngineConfig {
            max_batch: 8,
            prefill_chunk: chunk,
            max_batched_tokens: None,
            state_budget_bytes: 1 << 30,
            kv_cache_bytes: None,
            kv_block_size: strata_engine::DEFAULT_KV_BLOCK_SIZE,
            gpu_memory_utilization: None,
        };
        let worker = Worker::spawn(model, config, CacheConfig::off(), None).unwrap();
        let recorders: Vec<Recorder> = (0..jobs.len()).map(|_| Recorder::default()).collect();
        for ((prompt, o), r) in jobs.iter().zip(&recorders) {
            worker.submit(Job::new(prompt.clone(), o.clone(), Box::new(r.clone()))).unwrap();
        }
        for (i, r) in recorders.iter().enumerate() {
            r.wait(Recorder::finished);
            assert_eq!(r.tokens(), solo[i], "{} request {i}", dir.display());
        }
        let stats = worker.stats();
        let (forwards, chunks) = (stats.prefill_forwards.load(Ordering::Relaxed), stats.prefill_chunks.load(Ordering::Relaxed));
        assert!(forwards < chunks && chunks >= jobs.len() as u64, "{forwards} prefill forwards for {chunks} chunks");
    }
}

/// Two prompts arriving together prefill in the same steps, their chunks (128 positions, past
/// the batch-invariant kernels' rows) side by side: on CPU each keeps every log-probability it
/// gets with the engine to itself, as each is a segment of its own — greedy and seeded, on
/// every fixture.
#[test]
fn prompts_prefilled_together_get_their_bits_alone() {
    for dir in fixtures() {
        let tokens = load(&dir).1;
        let prompts: Vec<Vec<u32>> =
            (0..2).map(|k| tokens.iter().cycle().skip(3 + 11 * k).take(300).copied().collect()).collect();
        let engine = || long_prompt_engine(&dir, Some(512));
        for sampling in [SamplingParams::greedy(), SamplingParams { temperature: 0.8, seed: Some(7), ..SamplingParams::greedy() }]
        {
            let options = GenerationOptions { logprobs: Some(64), ..opts(6, sampling.clone()) };
            let alone: Vec<Recorder> = prompts
                .iter()
                .map(|prompt| {
                    let r = Recorder::default();
                    engine().submit(Job::new(prompt.clone(), options.clone(), Box::new(r.clone()))).unwrap();
                    r.wait(Recorder::finished);
                    r
                })
                .collect();
            let worker = engine();
            let together: Vec<Recorder> = (0..2).map(|_| Recorder::default()).collect();
            for (prompt, r) in prompts.iter().zip(&together) {
                worker.submit(Job::new(prompt.clone(), options.clone(), Box::new(r.clone()))).unwrap();
            }
            together.iter().for_each(|r| r.wait(Recorder::finished));
            for (k, (got, want)) in together.iter().zip(&alone).enumerate() {
                assert_eq!(got.tokens_with_logprobs(), want.tokens_with_logprobs(), "{} prompt {k}: {sampling:?}", dir.display());
            }
            let stats = worker.stats();
            let (forwards, chunks) =
                (stats.prefill_forwards.load(Ordering::Relaxed), stats.prefill_chunks.load(Ordering::Relaxed));
            assert!(chunks > forwards, "{}: the prompts never shared a forward ({chunks} chunks in {forwards})", dir.display());
        }
    }
}

/// A prompt fed in chunks longer than the batch-invariant kernels' rows (128 positions, whose
/// bits depend on where a chunk starts and ends) joins rows that are decoding, its chunks in
/// their steps: its every log-probability is the one it gets with the engine to itself, since
/// a prompt's chunks never depend on what else runs — greedy and seeded, on every fixture.
#[test]
fn a_long_prompt_joining_running_rows_gets_its_bits_alone() {
    for dir in fixtures() {
        let tokens = load(&dir).1;
        let long: Vec<u32> = tokens.iter().cycle().skip(3).take(300).copied().collect();
        let engine = || long_prompt_engine(&dir, None);
        // Each token with its log-probabilities.
        for sampling in [SamplingParams::greedy(), SamplingParams { temperature: 0.8, seed: Some(7), ..SamplingParams::greedy() }]
        {
            let joiner_opts = GenerationOptions { logprobs: Some(64), ..opts(6, sampling.clone()) };
            let alone = Recorder::default();
            let worker = engine();
            worker.submit(Job::new(long.clone(), joiner_opts.clone(), Box::new(alone.clone()))).unwrap();
            alone.wait(Recorder::finished);
            let worker = engine();
            let running: Vec<Recorder> = (0..6).map(|_| Recorder::default()).collect();
            for (i, r) in running.iter().enumerate() {
                worker.submit(Job::new(tokens[i..i + 4].to_vec(), opts(60, sampling.clone()), Box::new(r.clone()))).unwrap();
            }
            running[5].wait(|r| r.tokens().len() >= 2);
            let joiner = Recorder::default();
            worker.submit(Job::new(long.clone(), joiner_opts, Box::new(joiner.clone()))).unwrap();
            joiner.wait(Recorder::finished);
            assert_eq!(joiner.tokens_with_logprobs(), alone.tokens_with_logprobs(), "{}: {sampling:?}", dir.display());
            assert!(
                worker.stats().mixed_steps.load(Ordering::Relaxed) > 0,
                "{}: the prompt never rode in a decode step",
                dir.display()
            );
        }
    }
}
