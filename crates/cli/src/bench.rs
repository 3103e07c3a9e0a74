//! `strata bench`: a fixed workload through the batched engine at one or more concurrencies,
//! or with `--request-rate`, a serving benchmark over HTTP (see [`crate::serving`]).

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use strata_engine::cache::{Identity, SsdOptions};
use strata_engine::{
    CacheConfig, Counters, EngineConfig, Event, EventSink, GenerationOptions, Grammar, Grammars, Job, SamplingParams,
    Speculation, SsdConfig, Structure, Worker,
};
use strata_model::config::FeedForward;
use strata_model::images::{Rgb, RgbImage};
use strata_model::{synthetic, GenerationConfig, ImageProcessor, Model, ModelFolder, Tokenizer, VisionTower};
use strata_server::{HttpLimits, ResponseStore, ServerConfig};

use crate::common::{machine, open_model, parse_device, DTypeArg, KvCacheArgs};
use crate::draft::DraftArgs;
use crate::serve::{PoolArgs, ServedText};
use crate::serving::{LocalServer, ServingArgs, Target};

#[derive(Clone, clap::Args)]
pub struct Args {
    /// Model folder to measure.
    #[arg(long, group = "source")]
    model: Option<PathBuf>,
    /// A random-weight model with the shapes of a public release: qwen3.5-0.8b, -2b, -4b, -9b.
    #[arg(long, group = "source")]
    synthetic: Option<String>,
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    #[arg(long, default_value_t = 64)]
    gen_len: usize,
    /// Spread the requests' output lengths evenly from this up to --gen-len, so rows leave the
    /// batch while others run (default: all --gen-len).
    #[arg(long)]
    gen_len_min: Option<usize>,
    /// Concurrent requests, one run per value, e.g. 1,4,8,16,32.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    concurrency: Vec<usize>,
    /// One or more compute dtypes, e.g. f32,bf16 (default: f32 on CPU, bf16 on GPU).
    #[arg(long, value_enum, value_delimiter = ',')]
    dtype: Vec<DTypeArg>,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[command(flatten)]
    kv: KvCacheArgs,
    /// Prompt tokens per prefill forward (default: 512 on CPU, 2048 on GPU).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// A step's token budget: decode positions, then prompts' whole chunks while they fit (as
    /// serve's).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    max_num_batched_tokens: Option<u64>,
    /// Run every decode step launch by launch instead of replaying a captured CUDA graph.
    #[arg(long)]
    no_cuda_graphs: bool,
    /// One JSON object per configuration instead of a table.
    #[arg(long)]
    json: bool,
    /// Instead of text throughput: milliseconds for the vision tower to encode one PIXELS×PIXELS
    /// image (a --synthetic shape with a tower, or a folder with one), preprocessing apart.
    #[arg(long, value_name = "PIXELS")]
    image_size: Option<u32>,
    /// Instead of throughput: time to first token of one prompt cold, then served from the RAM
    /// tier, then from the SSD tier after a restart of the engine (the prompt cache is off in
    /// throughput runs, so repeated prompts measure compute).
    #[arg(long)]
    cache_ttft: bool,
    /// The SSD tier's folder for --cache-ttft (default: a temporary folder).
    #[arg(long)]
    ssd_cache: Option<PathBuf>,
    /// Build each prompt by repeating a cycle of this many tokens (a repetitive text, where
    /// prompt-lookup drafting shines) instead of pseudo-random tokens.
    #[arg(long)]
    prompt_cycle: Option<usize>,
    /// Hold every measured request's output to the JSON schema in this file (structured
    /// output; the report adds the mask time per token). A synthetic model needs --tokenizer.
    #[arg(long)]
    json_schema: Option<PathBuf>,
    /// With --synthetic and --json-schema: the tokenizer.json whose vocabulary the masks cover
    /// (random weights have none of their own; scripts/bench/tekken-tokenizer.py writes one).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Sample every measured request at this temperature, seeded by its index, with --top-k
    /// and --top-p (default: greedy): what the draw costs beside the argmax.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[command(flatten)]
    draft: DraftArgs,
    #[command(flatten)]
    serving: ServingArgs,
    /// With --request-rate, these size the engine of the server started in process, as they
    /// do `strata serve`'s.
    #[command(flatten)]
    pool: PoolArgs,
}

/// What a measured request reports, with when and which request.
enum Progress {
    Token,
    Finished,
    Failed(String),
}

struct Timing(mpsc::Sender<(usize, Instant, Progress)>, usize);

impl EventSink for Timing {
    fn send(&mut self, event: Event) -> bool {
        let progress = match event {
            Event::Started { .. } => return true,
            Event::Token(_) => Progress::Token,
            Event::Finished(_) => Progress::Finished,
            Event::Failed(e) => Progress::Failed(e),
        };
        let _ = self.0.send((self.1, Instant::now(), progress));
        true
    }
    fn is_closed(&self) -> bool {
        false
    }
}

struct Measured {
    prefill_tok_s: f64,
    aggregate_decode_tok_s: f64,
    ttft_ms_p50: f64,
    itl_ms_p50: f64,
    itl_ms_p99: f64,
    /// The engine's counters over the run: its steps, prefill forwards, graph replays, drafts.
    run: Counters,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Submits `concurrency` requests at once (held to `grammar`, where given) and times every token.
fn measure(worker: &Worker, vocab: u64, a: &Args, grammar: Option<&Arc<Grammar>>, concurrency: usize) -> Result<Measured> {
    let (tx, rx) = mpsc::channel();
    let before = worker.stats().counters();
    let start = Instant::now();
    for i in 0..concurrency {
        // Distinct fixed pseudo-random prompts: the same workload on every run.
        let cycle = a.prompt_cycle.unwrap_or(a.prompt_len).max(1) as u64;
        let prompt: Vec<u32> = (0..a.prompt_len as u64)
            .map(|t| (((t % cycle) * 2_654_435_761 + 12_345 + i as u64 * 7_919) % vocab) as u32)
            .collect();
        let shortest = a.gen_len_min.unwrap_or(a.gen_len);
        let opts = GenerationOptions {
            max_tokens: shortest + (a.gen_len - shortest) * i / concurrency.saturating_sub(1).max(1),
            sampling: a.sampling(i as u64),
            stop_tokens: vec![],
            prefill_chunk: a.prefill_chunk(),
            logprobs: None,
            grammar: grammar.cloned(),
        };
        worker.submit(Job::new(prompt, opts, Box::new(Timing(tx.clone(), i)))).map_err(anyhow::Error::msg)?;
    }
    let mut times: Vec<Vec<Instant>> = vec![Vec::new(); concurrency];
    let mut done = 0;
    while done < concurrency {
        match rx.recv()? {
            (i, t, Progress::Token) => times[i].push(t),
            (_, _, Progress::Finished) => done += 1,
            (i, _, Progress::Failed(e)) => anyhow::bail!("measured request {i} failed: {e}"),
        }
    }
    if let Some(i) = times.iter().position(Vec::is_empty) {
        anyhow::bail!("measured request {i} finished without a token");
    }
    let firsts: Vec<Instant> = times.iter().map(|t| t[0]).collect();
    let first = *firsts.iter().min().expect("at least one request");
    let last = times.iter().filter_map(|t| t.last()).max().copied().expect("tokens");
    let all_first = *firsts.iter().max().expect("at least one request");
    let mut ttft: Vec<f64> = firsts.iter().map(|t| (*t - start).as_secs_f64() * 1e3).collect();
    let mut itl: Vec<f64> = times.iter().flat_map(|t| t.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)).collect();
    ttft.sort_by(f64::total_cmp);
    itl.sort_by(f64::total_cmp);
    // Decode throughput over the steady window when every request is decoding (after the last
    // joiner's second token — a joiner's first token comes before it enters the batch, and a
    // draft model then reads its prompt — and before the first request ends); prefill work
    // interleaved before it would otherwise count against decode. Falls back to the whole span
    // when that window is empty (very short generations).
    let all_joined = times.iter().map(|t| t.get(1).unwrap_or(&t[0])).max().copied().expect("at least one request");
    let first_done = times.iter().filter_map(|t| t.last()).min().copied().expect("tokens");
    let (decode_tokens, window) = if first_done > all_joined {
        let n = times.iter().flatten().filter(|t| **t > all_joined && **t <= first_done).count();
        (n, first_done - all_joined)
    } else {
        (times.iter().map(|t| t.len() - 1).sum(), last - first)
    };
    let window = window.max(Duration::from_nanos(1)).as_secs_f64();
    Ok(Measured {
        prefill_tok_s: (a.prompt_len * concurrency) as f64 / (all_first - start).as_secs_f64().max(1e-9),
        aggregate_decode_tok_s: decode_tokens as f64 / window,
        ttft_ms_p50: percentile(&ttft, 0.5),
        itl_ms_p50: percentile(&itl, 0.5),
        itl_ms_p99: percentile(&itl, 0.99),
        run: worker.settled_counters(Duration::from_secs(5)).since(&before),
    })
}

impl Args {
    /// `--prefill-chunk`, which [`run`] fills in with the device's default when it is absent.
    fn prefill_chunk(&self) -> usize {
        self.prefill_chunk.expect("run resolves --prefill-chunk")
    }

    /// The sampling of measured request `index`.
    fn sampling(&self, index: u64) -> SamplingParams {
        let (temperature, top_k, top_p) = (self.temperature, self.top_k, self.top_p);
        SamplingParams { temperature, top_k, top_p, seed: Some(index), ..SamplingParams::greedy() }
    }
}

pub fn run(mut a: Args) -> Result<()> {
    if a.prompt_len == 0 || a.gen_len < 2 {
        bail!("--prompt-len must be at least 1 and --gen-len at least 2");
    }
    if let Some(url) = &a.serving.url {
        let target = a.serving.remote_target(url)?;
        let sweep = a.serving.sweep(&target, (a.prompt_len, a.gen_len), a.json)?;
        return a.serving.plot(&target.model, (a.prompt_len, a.gen_len), &[sweep]);
    }
    if !a.serving.is_on() && a.pool != PoolArgs::default() {
        bail!(
            "--max-num-seqs, --kv-cache-memory, --state-budget-bytes, --gpu-memory-utilization and --kv-block-size \
             size the server of --request-rate runs"
        );
    }
    let device = parse_device(&a.device)?;
    a.prefill_chunk = Some(a.prefill_chunk.unwrap_or(EngineConfig::for_device(&device).prefill_chunk).max(1));
    if a.dtype.is_empty() {
        a.dtype.push(DTypeArg::or_default_for(None, &device));
    }
    if a.gen_len_min.is_some_and(|min| min < 2 || min > a.gen_len) {
        bail!("--gen-len-min must be at least 2 and at most --gen-len");
    }
    if a.concurrency.contains(&0) {
        bail!("--concurrency values must be at least 1");
    }
    let (name, source) = Source::open(&a)?;
    let machine = machine();
    if let Some(size) = a.image_size {
        return vision(&a, size, &source, &name, &machine, &device);
    }
    let cuda_graphs = !a.no_cuda_graphs;
    let load = |dtype: DTypeArg| a.kv.apply(source.load(dtype, &device, cuda_graphs)?);
    if a.cache_ttft {
        return cache_ttft(&a, &name, &machine, load, |dtype| source.identity(&a.kv.identity_dtype(dtype)?));
    }
    if a.serving.is_on() {
        if a.json_schema.is_some() {
            bail!("--json-schema holds the engine's requests (runs without --request-rate)");
        }
        return serve_and_measure(&a, &name, &source, &device, &machine);
    }
    let structure = a.json_schema.as_deref().map(read_schema).transpose()?;
    a.sampling(0).validate().map_err(anyhow::Error::msg)?;
    if !a.json {
        let draft = a.draft.describe();
        let graphs = if device.is_cuda() && a.no_cuda_graphs { ", no CUDA graphs" } else { "" };
        println!("strata bench: {name} on {} ({machine}){draft}{graphs}", a.device);
        println!(
            "{:<6} {:>5} {:>7} {:>5} {:>14} {:>14} {:>10} {:>10} {:>10} {:>8}",
            "dtype", "conc", "prompt", "gen", "prefill tok/s", "decode tok/s", "TTFT p50", "ITL p50", "ITL p99", "accepted"
        );
    }
    let max_concurrency = *a.concurrency.iter().max().expect("clap gives at least one value");
    for dtype in &a.dtype {
        let model = load(*dtype)?;
        let vocab = model.vocab_size() as u64;
        let grammar = match &structure {
            Some(structure) => {
                Some(source.grammars(&a, model.vocab_size())?.compile(structure, None).map_err(anyhow::Error::msg)?)
            }
            None => None,
        };
        let speculation = source.speculation(&a.draft, &model, *dtype, &device, cuda_graphs)?;
        let worker = Worker::spawn(
            model,
            EngineConfig {
                max_batch: max_concurrency,
                prefill_chunk: a.prefill_chunk(),
                max_batched_tokens: a.max_num_batched_tokens.map(|n| n as usize),
                state_budget_bytes: usize::MAX,
                ..EngineConfig::for_device(&device)
            },
            CacheConfig::off(),
            speculation,
        )?;
        // Warm-up, one request of the measured prompt length: first touch of weights and of
        // allocator pools as large as a full prompt chunk needs, and on a GPU the first load of
        // the kernels of both the step-by-step (decode) and the chunked (prefill) paths and of
        // cuBLAS's for the chunk's shapes (the transformers baseline, too, runs each shape once
        // before timing it); a 64-token warm-up left them in the timed prefill.
        measure(&worker, vocab, &Args { gen_len: 2, gen_len_min: None, ..a.clone() }, grammar.as_ref(), 1)?;
        for &c in &a.concurrency {
            let m = measure(&worker, vocab, &a, grammar.as_ref(), c)?;
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "model": name, "device": a.device, "machine": machine, "threads": candle_core::utils::get_num_threads(),
                        "dtype": dtype.name(), "kv_cache_dtype": a.kv.policy()?.to_string(),
                        "mamba_ssm_cache_dtype": a.kv.ssm_dtype_name(),
                        "concurrency": c, "prompt_len": a.prompt_len, "gen_len": a.gen_len,
                        "prefill_tok_s": m.prefill_tok_s, "aggregate_decode_tok_s": m.aggregate_decode_tok_s,
                        "ttft_ms_p50": m.ttft_ms_p50, "itl_ms_p50": m.itl_ms_p50, "itl_ms_p99": m.itl_ms_p99,
                        "draft": a.draft.describe().trim_start_matches(", "), "acceptance": m.run.acceptance(), "draft_ms": m.run.draft_ms(),
                        "cuda_graphs": !a.no_cuda_graphs && device.is_cuda(),
                        "gen_len_min": a.gen_len_min.unwrap_or(a.gen_len),
                        "cuda_graph_recordings": m.run.graph_recordings, "cuda_graph_replays": m.run.graph_replays,
                        "decode_step_ms": m.run.decode_step_ms(), "decode_forward_ms": m.run.decode_forward_ms(),
                        "graph_prepare_ms": m.run.graph_prepare_ms(), "graph_replay_gpu_ms": m.run.graph_replay_gpu_ms(),
                        "max_num_seqs": worker.config().max_batch, "max_num_batched_tokens": worker.config().step_tokens(), "pool": worker.pool_stats(),
                        "json_schema": a.json_schema, "mask_us_per_token": m.run.mask_us(),
                        "prefill_forwards": m.run.prefill_forwards, "prefill_forward_ms": m.run.prefill_forward_ms(), "mixed_steps": m.run.mixed_steps,
                        "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p,
                    })
                );
            } else {
                println!(
                    "{:<6} {:>5} {:>7} {:>5} {:>14.1} {:>14.2} {:>8.0}ms {:>8.1}ms {:>8.1}ms {:>8}{}",
                    dtype.name(),
                    c,
                    a.prompt_len,
                    a.gen_len,
                    m.prefill_tok_s,
                    m.aggregate_decode_tok_s,
                    m.ttft_ms_p50,
                    m.itl_ms_p50,
                    m.itl_ms_p99,
                    m.run.acceptance().map_or("-".into(), |x| format!("{:.0}%", 100.0 * x)),
                    m.run.mask_us().map_or(String::new(), |us| format!("  (masks: {us:.0} µs per token)")),
                );
            }
        }
    }
    Ok(())
}

/// `--image-size`: one square image (a smooth colour field, deterministic) through the
/// processor on the CPU, then the tower: median milliseconds of 10 encodes after 2 warm-ups.
fn vision(a: &Args, size: u32, source: &Source, name: &str, machine: &str, device: &Device) -> Result<()> {
    if size == 0 {
        bail!("--image-size must be at least 1");
    }
    let image =
        RgbImage::from_fn(size, size, |x, y| Rgb([(x * 255 / size) as u8, (y * 255 / size) as u8, ((x + y) % 256) as u8]));
    for (i, &dtype) in a.dtype.iter().enumerate() {
        let (tower, processor) = source.vision(dtype, device)?;
        if !a.json && i == 0 {
            println!("strata bench --image-size {size}: {name}'s vision tower on {} ({machine})", a.device);
            println!(
                "{:<6} {:>9} {:>8} {:>7} {:>14} {:>12}",
                "dtype", "image", "patches", "tokens", "preprocess ms", "encode ms"
            );
        }
        let started = Instant::now();
        let prepared = processor.prepare_rgb(image.clone()).map_err(anyhow::Error::msg)?;
        let preprocess_ms = started.elapsed().as_secs_f64() * 1e3;
        let encode = || -> Result<f64> {
            let started = Instant::now();
            let merged = tower.forward(&prepared)?;
            merged.device().synchronize()?;
            Ok(started.elapsed().as_secs_f64() * 1e3)
        };
        for _ in 0..2 {
            encode()?;
        }
        let mut times = (0..10).map(|_| encode()).collect::<Result<Vec<f64>>>()?;
        times.sort_by(f64::total_cmp);
        let encode_ms = (times[4] + times[5]) / 2.0;
        let [_, h, w] = prepared.grid;
        let tokens = h * w / tower.config().spatial_merge_size.pow(2);
        let image = format!("{}x{}", w * processor.patch_size, h * processor.patch_size);
        match a.json {
            true => println!(
                "{}",
                serde_json::json!({
                    "kind": "vision", "model": name, "device": a.device, "machine": machine, "dtype": dtype.name(),
                    "image_size": size, "resized": image, "patches": h * w, "image_tokens": tokens,
                    "preprocess_ms": preprocess_ms, "encode_ms_p50": encode_ms,
                })
            ),
            false => println!("{:<6} {image:>9} {:>8} {tokens:>7} {preprocess_ms:>14.1} {encode_ms:>12.2}", dtype.name(), h * w),
        }
    }
    Ok(())
}

/// The measured model: a folder, or random weights with a public release's shapes.
enum Source {
    Folder(Box<ModelFolder>),
    Synthetic(String),
}

impl Source {
    /// The model `--model` or `--synthetic` names, and its name for reports.
    fn open(a: &Args) -> Result<(String, Self)> {
        match (&a.model, &a.synthetic) {
            (Some(dir), _) => Ok((dir.display().to_string(), Source::Folder(Box::new(open_model(dir)?)))),
            (_, Some(name)) => {
                let cfg = synthetic::config(name)?;
                let count = cfg.weight_count();
                let billions = |n: u64| n as f64 / 1e9;
                let mut size = format!("{:.1}B parameters", billions(count.total()));
                if matches!(cfg.feed_forward, FeedForward::Experts(_)) {
                    size += &format!(", {:.1}B per token", billions(count.active_at_dtype + count.f32));
                }
                Ok((format!("{name} (synthetic, {size})"), Source::Synthetic(name.clone())))
            }
            _ => bail!("give --model DIR or --synthetic NAME (or --url with --request-rate)"),
        }
    }

    fn load(&self, dtype: DTypeArg, device: &Device, cuda_graphs: bool) -> Result<Model> {
        let model = match self {
            Source::Folder(f) => f.load(dtype.dtype(), device)?,
            Source::Synthetic(name) => synthetic::build(name, dtype.dtype(), device)?,
        };
        model.set_decode_graphs(cuda_graphs);
        Ok(model)
    }

    /// The vision tower at `dtype` and the processor of its images.
    fn vision(&self, dtype: DTypeArg, device: &Device) -> Result<(VisionTower, ImageProcessor)> {
        match self {
            Source::Folder(f) => match &f.image_processor {
                Some(processor) => Ok((f.load_vision(dtype.dtype(), device)?, processor.clone())),
                None => bail!("--image-size: {} has no vision tower", f.path.display()),
            },
            Source::Synthetic(name) => Ok((synthetic::build_vision(name, dtype.dtype(), device)?, synthetic::vision(name)?.1)),
        }
    }

    /// `--draft`'s speculation for `model`, loaded from this source at `dtype`.
    fn speculation(
        &self,
        draft: &DraftArgs,
        model: &Model,
        dtype: DTypeArg,
        device: &Device,
        cuda_graphs: bool,
    ) -> Result<Option<Speculation>> {
        // A synthetic draft (`model:synthetic:NAME`) needs no folder either.
        let load_draft = |path: &Path| match path.to_str().and_then(|p| p.strip_prefix("synthetic:")) {
            Some(name) => Ok(synthetic::build(name, dtype.dtype(), device)?),
            None => Ok(open_model(path)?.load(dtype.dtype(), device)?),
        };
        let load_mtp = || match self {
            Source::Folder(f) => Ok(f.load_mtp(model)?),
            Source::Synthetic(_) => Ok(synthetic::build_mtp(model)?),
        };
        draft.speculation(model.vocab_size(), || self.load(dtype, device, cuda_graphs), load_draft, load_mtp)
    }

    /// Structured output's compiler over this model's vocabulary (`--tokenizer`'s for random
    /// weights), `vocab_size` tokens wide.
    fn grammars(&self, a: &Args, vocab_size: usize) -> Result<Grammars> {
        let text = match (self, &a.tokenizer) {
            (Source::Folder(_), None) => self.text()?,
            (Source::Synthetic(_), Some(path)) => ServedText { tokenizer: Tokenizer::from_file(path)?, ..self.text()? },
            (Source::Folder(_), Some(_)) => bail!("--tokenizer is for --synthetic models (a folder has its own)"),
            (Source::Synthetic(_), None) => {
                bail!("--json-schema with --synthetic needs --tokenizer (random weights have no vocabulary)")
            }
        };
        let eos = text.eos_token_ids.first().copied().unwrap_or(0);
        Grammars::new(&text.tokenizer, vocab_size, eos).map_err(anyhow::Error::msg)
    }

    /// The SSD tier's key for this model at `dtype` (see [`KvCacheArgs::identity_dtype`]).
    fn identity(&self, dtype: &str) -> Result<Identity> {
        match self {
            Source::Folder(f) => crate::cache::folder_identity(&f.path, dtype),
            Source::Synthetic(name) => Ok(crate::cache::synthetic_identity(name, dtype)),
        }
    }

    /// What a server of this model needs besides its weights. Random weights have no
    /// vocabulary: their tokens read as numbered words.
    fn text(&self) -> Result<ServedText> {
        match self {
            // Read again: the folder read first stays with the loader, for the other dtypes.
            Source::Folder(f) => Ok(ServedText::of(open_model(&f.path)?)),
            Source::Synthetic(name) => {
                let config = synthetic::config(name)?;
                Ok(ServedText {
                    tokenizer: Tokenizer::numbered(u32::try_from(config.vocab_size)?)?,
                    template: None,
                    generation: GenerationConfig::default(),
                    eos_token_ids: config.eos_token_ids,
                    vocab_size: config.vocab_size,
                    image_processor: None,
                })
            }
        }
    }
}

/// `--request-rate`: the model at each dtype served in process, as `strata serve` would serve
/// it (with the prompt cache off, as in the other runs: the sweep sends the same prompts at
/// every rate), and measured over HTTP as any server is.
fn serve_and_measure(a: &Args, name: &str, source: &Source, device: &Device, machine: &str) -> Result<()> {
    let open_files = strata_server::raise_open_files_limit();
    let mut sweeps = Vec::new();
    for &dtype in &a.dtype {
        let model = a.kv.apply(source.load(dtype, device, !a.no_cuda_graphs)?)?;
        let speculation = source.speculation(&a.draft, &model, dtype, device, !a.no_cuda_graphs)?;
        let config = ServerConfig {
            model_name: name.to_string(),
            dtype: dtype.name().into(),
            device: a.device.clone(),
            max_context: model.max_position_embeddings(),
            api_key: None,
            special_tokens_in_content: false,
            http: HttpLimits { max_connections: strata_server::default_max_connections(open_files), ..HttpLimits::default() },
            images: Default::default(),
        };
        let engine = a.pool.engine_config(device, a.prefill_chunk, a.max_num_batched_tokens)?;
        let state = crate::serve::start(
            model,
            source.text()?,
            engine,
            CacheConfig::off(),
            speculation,
            config,
            ResponseStore::default(),
        )?;
        let vocab_size = a.serving.prompt_vocab(state.vocab_size);
        let max_num_seqs = state.worker.config().max_batch;
        let engine = state.worker.clone();
        let server = LocalServer::start(state)?;
        let target = Target {
            endpoint: crate::serving::Endpoint::new(server.url(), None)?,
            model: name.to_string(),
            vocab_size,
            title: format!("{name} on {} ({machine}), {}{}, served in process", a.device, dtype.name(), a.draft.describe()),
            label: dtype.name().to_string(),
            facts: serde_json::json!({
                "model": name, "device": a.device, "machine": machine, "dtype": dtype.name(), "max_num_seqs": max_num_seqs,
            }),
            engine: Some(engine),
        };
        sweeps.push(a.serving.sweep(&target, (a.prompt_len, a.gen_len), a.json)?);
    }
    a.serving.plot(name, (a.prompt_len, a.gen_len), &sweeps)
}

/// `--json-schema`'s file as a structure.
fn read_schema(path: &Path) -> Result<Structure> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading --json-schema {}", path.display()))?;
    let schema = serde_json::from_str(&text).with_context(|| format!("--json-schema {} is not JSON", path.display()))?;
    Ok(Structure::JsonSchema(schema))
}

/// Time to the first token of `prompt`, and how many prompt tokens came from the cache.
fn first_token(worker: &Worker, prompt: &[u32]) -> Result<(Duration, usize)> {
    struct First(mpsc::Sender<Event>);
    impl EventSink for First {
        fn send(&mut self, event: Event) -> bool {
            self.0.send(event).is_ok()
        }
        fn is_closed(&self) -> bool {
            false
        }
    }
    let (tx, rx) = mpsc::channel();
    let opts = GenerationOptions {
        max_tokens: 1,
        sampling: SamplingParams::greedy(),
        stop_tokens: vec![],
        prefill_chunk: usize::MAX,
        logprobs: None,
        grammar: None,
    };
    let start = Instant::now();
    worker.submit(Job::new(prompt.to_vec(), opts, Box::new(First(tx)))).map_err(anyhow::Error::msg)?;
    let mut cached = 0;
    loop {
        match rx.recv()? {
            Event::Started { cached_tokens } => cached = cached_tokens,
            Event::Token(_) => return Ok((start.elapsed(), cached)),
            Event::Finished(_) => bail!("the benchmark request ended without a token"),
            Event::Failed(e) => bail!("the benchmark request failed: {e}"),
        }
    }
}

/// TTFT cold, from the RAM tier, and from the SSD tier after restarting the engine.
fn cache_ttft(
    a: &Args,
    name: &str,
    machine: &str,
    load: impl Fn(DTypeArg) -> Result<Model>,
    identity: impl Fn(DTypeArg) -> Result<Identity>,
) -> Result<()> {
    let temp;
    let dir = match &a.ssd_cache {
        Some(dir) => dir.clone(),
        None => {
            temp = tempfile::tempdir()?;
            temp.path().to_path_buf()
        }
    };
    if !a.json {
        println!("strata bench --cache-ttft: {name} on {} ({machine}), SSD tier in {}", a.device, dir.display());
        println!(
            "{:<6} {:>7} {:>12} {:>12} {:>12} {:>9} {:>9}",
            "dtype", "prompt", "cold TTFT", "RAM hit", "SSD hit", "RAM ×", "SSD ×"
        );
    }
    for &dtype in &a.dtype {
        let config = || -> Result<CacheConfig> {
            let options = SsdOptions { dir: dir.clone(), max_bytes: u64::MAX, verify: false };
            Ok(CacheConfig {
                // On a GPU the RAM tier's memory is set aside before the state pool is sized.
                ram_bytes: CacheConfig::for_device(&parse_device(&a.device)?).ram_bytes,
                stride: a.prefill_chunk(),
                ssd: Some(SsdConfig { options, identity: identity(dtype)?, queue: 1024 }),
                checkpoint_every: 0,
            })
        };
        let engine = EngineConfig {
            max_batch: 1,
            prefill_chunk: a.prefill_chunk(),
            state_budget_bytes: usize::MAX,
            ..EngineConfig::for_device(&parse_device(&a.device)?)
        };
        let model = load(dtype)?;
        let vocab = model.vocab_size() as u64;
        let prompt: Vec<u32> = (0..a.prompt_len as u64).map(|t| ((t * 2_654_435_761 + 12_345) % vocab) as u32).collect();
        let worker = Worker::spawn(model, engine, config()?, None)?;
        worker.flush_cache(true);
        let (cold, _) = first_token(&worker, &prompt)?;
        let (ram, ram_cached) = first_token(&worker, &prompt)?;
        let unwritten = worker.shutdown(Duration::from_secs(600));
        if unwritten > 0 {
            bail!("{unwritten} SSD writes did not finish");
        }
        drop(worker);
        let restarted = Worker::spawn(load(dtype)?, engine, config()?, None)?;
        let (ssd, ssd_cached) = first_token(&restarted, &prompt)?;
        if ram_cached == 0 || ssd_cached == 0 {
            bail!("expected cache hits, got {ram_cached} (RAM) and {ssd_cached} (SSD) cached tokens");
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        if a.json {
            println!(
                "{}",
                serde_json::json!({
                    "model": name, "device": a.device, "machine": machine, "dtype": dtype.name(), "prompt_len": a.prompt_len,
                    "cold_ttft_ms": ms(cold), "ram_hit_ttft_ms": ms(ram), "ssd_hit_ttft_ms": ms(ssd),
                    "ram_cached_tokens": ram_cached, "ssd_cached_tokens": ssd_cached,
                })
            );
        } else {
            println!(
                "{:<6} {:>7} {:>10.0}ms {:>10.0}ms {:>10.0}ms {:>8.1}× {:>8.1}×",
                dtype.name(),
                a.prompt_len,
                ms(cold),
                ms(ram),
                ms(ssd),
                ms(cold) / ms(ram),
                ms(cold) / ms(ssd)
            );
        }
    }
    Ok(())
}
