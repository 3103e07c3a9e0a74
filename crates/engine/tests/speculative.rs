//! Speculative decoding against plain decoding: greedy output with every draft source equals
//! greedy output without speculation, token for token, alone and in a batch whose rows accept
//! different counts, after a prompt-cache hit, and with cache hits and prompts' chunks sharing
//! the rows' forwards; seeded sampled output with speculation equals
//! the output without, and draws from the target's distribution (chi-square).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

use candle_core::{DType, Device};
use strata_engine::{CacheConfig, DraftSource, EngineConfig, Event, GenerationOptions, Job, SamplingParams, Speculation, Worker};
use strata_model::{ArchConfig, Model, ModelFolder};

mod common;
use common::{fixtures, prompt_tokens, Channel};

fn load(dir: &Path) -> Model {
    ModelFolder::open(dir).unwrap().load(DType::F32, &Device::Cpu).unwrap()
}

fn engine(dir: &Path, cache: CacheConfig, speculation: Option<Speculation>) -> Worker {
    Worker::spawn(
        load(dir),
        EngineConfig {
            max_batch: 8,
            prefill_chunk: 16,
            max_batched_tokens: None,
            state_budget_bytes: 1 << 30,
            kv_cache_bytes: None,
            kv_block_size: strata_engine::DEFAULT_KV_BLOCK_SIZE,
            gpu_memory_utilization: None,
        },
        cache,
        speculation,
    )
    .unwrap()
}

/// The draft sources under test for a target fixture: prompt lookup, the target itself,
/// another Qwen3.5 fixture and a dense Qwen3 (same tokenizer, different weights: drafts that
/// are often wrong), and on Qwen3.5 the fixture's own multi-token-prediction head, over the
/// whole vocabulary and over half of it.
fn sources(dir: &Path) -> Vec<(&'static str, Speculation)> {
    let other = fixtures().into_iter().find(|d| d != dir).unwrap();
    let qwen3 = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/dense/qwen3-tiny-draft");
    let folder = ModelFolder::open(dir).unwrap();
    let mtp = |restricted: bool| {
        let mut head = folder.load_mtp(&load(dir)).ok().expect("every Qwen3.5 fixture has an MTP head");
        if restricted {
            // The lower half of the vocabulary: drafts the target often rejects.
            head.restrict_drafts((0..folder.config.vocab_size as u32 / 2).collect()).unwrap();
        }
        Speculation { source: DraftSource::Mtp(Box::new(head)), tokens: 4 }
    };
    let qwen35 = matches!(folder.config.arch, ArchConfig::Qwen35(_));
    let heads = qwen35.then(|| [("mtp", mtp(false)), ("mtp among half the vocabulary", mtp(true))]);
    heads
        .into_iter()
        .flatten()
        .chain([
            ("ngram", Speculation { source: DraftSource::Ngram, tokens: 4 }),
            ("self", Speculation { source: DraftSource::Model(Box::new(load(dir))), tokens: 3 }),
            ("other model", Speculation { source: DraftSource::Model(Box::new(load(&other))), tokens: 5 }),
            ("qwen3 draft", Speculation { source: DraftSource::Model(Box::new(load(&qwen3))), tokens: 4 }),
        ])
        .collect()
}

/// Submits every prompt at once (one batch) and collects each one's tokens and counts.
fn run_all(worker: &Worker, prompts: &[Vec<u32>], opts: &GenerationOptions) -> Vec<(Vec<u32>, usize, usize)> {
    let receivers: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (tx, rx) = mpsc::channel();
            worker.submit(Job::new(p.clone(), opts.clone(), Box::new(Channel(tx)))).unwrap();
            rx
        })
        .collect();
    receivers.iter().map(collect).collect()
}

/// A job's tokens, drafted and accepted counts.
fn collect(rx: &mpsc::Receiver<Event>) -> (Vec<u32>, usize, usize) {
    let mut tokens = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("the engine answers") {
            Event::Token(s) => tokens.push(s.id),
            Event::Finished(g) => return (tokens, g.drafted_tokens, g.accepted_tokens),
            Event::Failed(e) => panic!("generation failed: {e}"),
            Event::Started { .. } => {}
        }
    }
}

fn greedy(max_tokens: usize) -> GenerationOptions {
    GenerationOptions {
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_tokens: vec![],
        prefill_chunk: 16,
        logprobs: None,
        grammar: None,
    }
}

/// Eight prompts, repetitive enough that prompt lookup finds matches.
fn prompts(dir: &Path) -> Vec<Vec<u32>> {
    let tokens = prompt_tokens(dir);
    (0..8).map(|i| tokens[i..i + 6 + i].iter().cycle().take(12 + 3 * i).copied().collect()).collect()
}

#[test]
fn greedy_speculation_matches_plain_decoding_alone_and_batched() {
    for dir in fixtures() {
        let prompts = prompts(&dir);
        let plain: Vec<Vec<u32>> =
            run_all(&engine(&dir, CacheConfig::off(), None), &prompts, &greedy(64)).into_iter().map(|r| r.0).collect();
        for (name, spec) in sources(&dir) {
            let worker = engine(&dir, CacheConfig::off(), Some(spec));
            let alone = run_all(&worker, &prompts[..1], &greedy(64));
            assert_eq!(alone[0].0, plain[0], "{dir:?} {name}: alone");
            let batched = run_all(&worker, &prompts, &greedy(64));
            let accepted: Vec<usize> = batched.iter().map(|r| r.2).collect();
            for (i, (tokens, drafted, _)) in batched.iter().enumerate() {
                assert_eq!(tokens, &plain[i], "{dir:?} {name}: row {i} of the batch (accepted {accepted:?})");
                assert!(*drafted > 0, "{dir:?} {name}: row {i} was never drafted for");
            }
            if name == "self" {
                for (tokens, drafted, accepted) in &batched {
                    assert_eq!(drafted, accepted, "a model drafting for itself is always right ({} tokens)", tokens.len());
                }
            }
            let stats = worker.stats();
            assert!(stats.drafted_tokens.load(Ordering::Relaxed) >= stats.accepted_tokens.load(Ordering::Relaxed));
        }
    }
}

/// Seeded sampling draws each output position from (seed, position): with every draft source,
/// alone and batched, a seeded row's output is plain decoding's token for token — with filters,
/// a logit bias, and penalties that count the drafts before each verified position.
#[test]
fn seeded_speculation_matches_plain_seeded_decoding() {
    let sampled = |row: usize| GenerationOptions {
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.2,
            presence_penalty: 0.3,
            frequency_penalty: 0.2,
            logit_bias: vec![(40 + row as u32, 2.0)],
            seed: Some(100 + row as u64),
            ..SamplingParams::greedy()
        },
        ..greedy(48)
    };
    let run = |worker: &Worker, prompts: &[Vec<u32>]| -> Vec<(Vec<u32>, usize, usize)> {
        let receivers: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (tx, rx) = mpsc::channel();
                worker.submit(Job::new(p.clone(), sampled(i), Box::new(Channel(tx)))).unwrap();
                rx
            })
            .collect();
        receivers.iter().map(collect).collect()
    };
    let dir = &fixtures()[0];
    let prompts = prompts(dir);
    let plain: Vec<Vec<u32>> = run(&engine(dir, CacheConfig::off(), None), &prompts).into_iter().map(|r| r.0).collect();
    for (name, spec) in sources(dir) {
        let worker = engine(dir, CacheConfig::off(), Some(spec));
        assert_eq!(run(&worker, &prompts[..1])[0].0, plain[0], "{name}: alone");
        let batched = run(&worker, &prompts);
        for (i, (tokens, _, _)) in batched.iter().enumerate() {
            assert_eq!(tokens, &plain[i], "{name}: row {i} of the batch");
        }
        // Prompt lookup rarely matches sampled text; the target's own drafts often do.
        let accepted = worker.stats().accepted_tokens.load(Ordering::Relaxed);
        assert!(accepted > 0 || !matches!(name, "self" | "mtp"), "{name}: no draft stood, so acceptance was not exercised");
    }
}

#[test]
fn cache_hit_then_speculation_matches_a_cold_plain_run() {
    let dir = &fixtures()[0];
    let prompt = prompts(dir)[7].clone();
    let cold = run_all(&engine(dir, CacheConfig::off(), None), &[prompt.clone()], &greedy(32));
    let cache = CacheConfig { ram_bytes: 1 << 30, stride: 8, ssd: None, checkpoint_every: 0 };
    for (name, spec) in sources(dir) {
        let worker = engine(dir, cache.clone(), Some(spec));
        let first = run_all(&worker, &[prompt.clone()], &greedy(32));
        let hit = run_all(&worker, &[prompt.clone()], &greedy(32));
        assert_eq!(worker.cache_stats().ram_hits.load(Ordering::Relaxed), 1, "{name}: the second run hits");
        assert_eq!(first[0].0, cold[0].0, "{name}: first run");
        assert_eq!(hit[0].0, cold[0].0, "{name}: after a cache hit");
    }
}

/// Speculation, the prompt cache and prompts prefilled together, combined: after one prompt
/// warmed the cache, a burst of prompts extending it (some hit the cache, their chunks of
/// different lengths sharing forwards with rows that already decode and verify drafts) gives
/// plain cold greedy output, with every draft source.
#[test]
fn speculation_cache_hits_and_mixed_steps_together_match_plain_decoding() {
    let dir = &fixtures()[0];
    let base = prompts(dir)[7].clone();
    let burst: Vec<Vec<u32>> = (0..6)
        .map(|i| base.iter().chain(&prompts(dir)[i][..3 + 2 * i]).copied().collect())
        .chain(prompts(dir)[..2].to_vec())
        .collect();
    let plain = engine(dir, CacheConfig::off(), None);
    let cold: Vec<Vec<u32>> = burst.iter().map(|p| run_all(&plain, &[p.clone()], &greedy(24)).remove(0).0).collect();
    let cache = CacheConfig { ram_bytes: 1 << 30, stride: 8, ssd: None, checkpoint_every: 0 };
    for (name, spec) in sources(dir) {
        let worker = engine(dir, cache.clone(), Some(spec));
        run_all(&worker, &[base.clone()], &greedy(4));
        let together = run_all(&worker, &burst, &greedy(24));
        for (i, (tokens, _, _)) in together.iter().enumerate() {
            assert_eq!(tokens, &cold[i], "{name}: prompt {i} of the burst");
        }
        assert!(worker.cache_stats().ram_hits.load(Ordering::Relaxed) > 0, "{name}: no prompt hit the cache");
        assert!(worker.stats().mixed_steps.load(Ordering::Relaxed) > 0, "{name}: no step mixed decode and prefill");
        assert!(worker.stats().drafted_tokens.load(Ordering::Relaxed) > 0, "{name}: nothing was drafted");
    }
}

/// Pearson's chi-square statistic of a two-sample test over the categories both samples share,
/// rare ones pooled; returns (statistic, degrees of freedom).
fn chi_square(a: &HashMap<Vec<u32>, usize>, b: &HashMap<Vec<u32>, usize>) -> (f64, usize) {
    let (na, nb) = (a.values().sum::<usize>() as f64, b.values().sum::<usize>() as f64);
    let mut keys: Vec<&Vec<u32>> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut pooled = (0.0, 0.0);
    for k in keys {
        let (x, y) = (*a.get(k).unwrap_or(&0) as f64, *b.get(k).unwrap_or(&0) as f64);
        if x + y < 20.0 {
            pooled = (pooled.0 + x, pooled.1 + y);
        } else {
            cells.push((x, y));
        }
    }
    if pooled.0 + pooled.1 > 0.0 {
        cells.push(pooled);
    }
    let stat = cells
        .iter()
        .map(|&(x, y)| {
            let total = x + y;
            let (ex, ey) = (total * na / (na + nb), total * nb / (na + nb));
            (x - ex).powi(2) / ex + (y - ey).powi(2) / ey
        })
        .sum();
    (stat, cells.len() - 1)
}

#[test]
fn seeded_sampling_with_speculation_has_the_target_distribution() {
    let dir = &fixtures()[0];
    let prompt = prompts(dir)[3].clone();
    let runs = 800;
    let sampling = |seed| SamplingParams { temperature: 1.0, top_k: 3, seed: Some(seed), ..SamplingParams::greedy() };
    let sample = |worker: &Worker, offset: u64| {
        let mut counts: HashMap<Vec<u32>, usize> = HashMap::new();
        for chunk in (0..runs as u64).collect::<Vec<_>>().chunks(8) {
            let batch: Vec<_> = chunk
                .iter()
                .map(|&s| {
                    let (tx, rx) = mpsc::channel();
                    let opts = GenerationOptions { sampling: sampling(offset + s), ..greedy(3) };
                    worker.submit(Job::new(prompt.clone(), opts, Box::new(Channel(tx)))).unwrap();
                    rx
                })
                .collect();
            for rx in batch {
                let tokens = collect(&rx).0;
                // The two tokens drawn after the first (those verified against drafts).
                *counts.entry(tokens[1..].to_vec()).or_default() += 1;
            }
        }
        counts
    };
    let plain = sample(&engine(dir, CacheConfig::off(), None), 0);
    // The target drafting for itself, greedily: its drafts are often but not always the sampled
    // token, so both acceptance and the draw from the rest are exercised.
    let spec = Speculation { source: DraftSource::Model(Box::new(load(dir))), tokens: 2 };
    let worker = engine(dir, CacheConfig::off(), Some(spec));
    let speculative = sample(&worker, 1_000_000);
    let accepted = worker.stats().accepted_tokens.load(Ordering::Relaxed);
    let drafted = worker.stats().drafted_tokens.load(Ordering::Relaxed);
    assert!(accepted > 100 && drafted > accepted + 100, "both outcomes must be exercised ({accepted} of {drafted} accepted)");
    let (stat, df) = chi_square(&plain, &speculative);
    // The 0.999 quantile of chi-square (Wilson–Hilferty).
    let k = df as f64;
    let critical = k * (1.0 - 2.0 / (9.0 * k) + 3.09 * (2.0 / (9.0 * k)).sqrt()).powi(3);
    assert!(df >= 3, "too few categories to test ({df})");
    assert!(stat < critical, "chi-square {stat:.1} with {df} degrees of freedom (critical {critical:.1})");
}
