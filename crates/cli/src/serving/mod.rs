//! `strata bench --request-rate`: a serving benchmark over HTTP, as `vllm bench serve` runs one.
//! Requests of random token ids arrive at each rate (Poisson arrivals) at an OpenAI-compatible
//! server — strata's own, started in process, or any other at `--url` — as streamed
//! completions, and each run reports vLLM's metrics.

mod client;
mod metrics;
mod plot;
mod workload;

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use serde_json::{json, Value};
use strata_server::AppState;
use tokio::sync::oneshot;

pub use client::Endpoint;
use metrics::{Completion, Summary};
use workload::{Rate, Request};

#[derive(Clone, clap::Args)]
pub struct ServingArgs {
    /// Serving benchmark: requests per second, one run per value (`inf`: all at once), e.g.
    /// 4,16,64,inf. Requests go over HTTP to strata's server, started in process with this
    /// command's model and engine flags, or to the server at --url.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["concurrency", "cache_ttft", "gen_len_min", "prompt_cycle"])]
    request_rate: Vec<Rate>,
    /// Measure the OpenAI-compatible server at this base URL (e.g. http://127.0.0.1:8000, a
    /// vLLM or llama.cpp server) instead of strata's own. `OPENAI_API_KEY`, if set, is sent as
    /// its bearer token.
    #[arg(
        long,
        requires_all = ["request_rate", "vocab_size"],
        conflicts_with_all = ["source", "dtype", "device", "prefill_chunk", "no_cuda_graphs", "draft", "PoolArgs"]
    )]
    pub url: Option<String>,
    /// With --url: the model its requests name (default: the first that GET /v1/models lists).
    #[arg(long, requires = "url")]
    served_model_name: Option<String>,
    /// Prompt token ids are drawn below this: needed with --url (at most the served tokenizer's
    /// size; vLLM's own random prompts are drawn below its tokenizer's `vocab_size`); strata's
    /// own server defaults to its model's. The same value and --seed give two servers the same
    /// prompts.
    #[arg(long, requires = "request_rate", value_parser = clap::value_parser!(u32).range(1..))]
    vocab_size: Option<u32>,
    /// Requests per run.
    #[arg(long, default_value_t = 200, requires = "request_rate")]
    num_prompts: usize,
    /// Draw each request's prompt and output lengths uniformly from [len·(1−F), len·(1+F)]
    /// around --prompt-len and --gen-len (0: fixed lengths).
    #[arg(long, default_value_t = 0.0, value_parser = range_ratio, requires = "request_rate")]
    random_range_ratio: f64,
    /// Seed of the prompts, their lengths and the arrival times: the same workload for the
    /// same seed.
    #[arg(long, default_value_t = 0, requires = "request_rate")]
    seed: u64,
    /// Most requests in flight: later arrivals wait for one to finish (default: no cap).
    #[arg(long, requires = "request_rate", value_parser = clap::value_parser!(u64).range(1..))]
    max_concurrency: Option<u64>,
    /// Draw output throughput against TTFT p50 and TPOT p50 over the rates, as a PNG.
    #[arg(long, requires = "request_rate")]
    plot: Option<PathBuf>,
}

/// A share in [0, 1).
fn range_ratio(s: &str) -> Result<f64, String> {
    s.parse::<f64>().ok().filter(|r| (0.0..1.0).contains(r)).ok_or(format!("`{s}` is not a ratio in [0, 1)"))
}

/// A server under measurement, and how the reports name it.
pub struct Target {
    pub endpoint: Endpoint,
    /// The `model` its requests name.
    pub model: String,
    /// Prompt token ids are drawn below this.
    pub vocab_size: usize,
    /// What its table's heading says of it.
    pub title: String,
    /// Its curve's name in the plot.
    pub label: String,
    /// The fields every JSON line about it starts with (model, device, dtype…): an object.
    pub facts: Value,
    /// strata's engine, where the server runs in this process: its counters are read around
    /// each run, so the report tells how the steps went (prefill forwards, mixed steps, decode
    /// step time, CUDA graph replays).
    pub engine: Option<strata_engine::Worker>,
}

/// A target's runs, rate by rate.
pub struct Sweep {
    label: String,
    runs: Vec<(Rate, Summary)>,
}

impl ServingArgs {
    /// Whether `--request-rate` asks for the serving benchmark.
    pub fn is_on(&self) -> bool {
        !self.request_rate.is_empty()
    }

    /// Prompt token ids are drawn below `--vocab-size`, else below `served`, the served
    /// model's vocabulary size.
    pub fn prompt_vocab(&self, served: usize) -> usize {
        self.vocab_size.map_or(served, |v| v as usize)
    }

    /// The server at `--url`.
    pub fn remote_target(&self, url: &str) -> Result<Target> {
        let endpoint = Endpoint::new(url, std::env::var("OPENAI_API_KEY").ok().filter(|k| !k.is_empty()))?;
        let model = match &self.served_model_name {
            Some(name) => name.clone(),
            None => endpoint.first_model()?,
        };
        let facts = json!({"model": model, "url": endpoint.base()});
        Ok(Target {
            title: format!("{model} at {}", endpoint.base()),
            label: model.clone(),
            vocab_size: self.vocab_size.context("--url needs --vocab-size")? as usize,
            endpoint,
            model,
            facts,
            engine: None,
        })
    }

    /// Measures `target` at each rate with `--num-prompts` requests of (about) `lengths`
    /// (prompt, output) tokens, printing a JSON line per run as it ends, or a table at the end.
    pub fn sweep(&self, target: &Target, lengths: (usize, usize), json: bool) -> Result<Sweep> {
        let requests = workload::requests(self.num_prompts, lengths, self.random_range_ratio, target.vocab_size, self.seed);
        // As vLLM does before measuring: one request alone, which must succeed (it also warms
        // the server up).
        let first = requests.first().context("--num-prompts must be at least 1")?;
        target
            .endpoint
            .complete(&target.model, first)
            .map_err(|e| anyhow!("the first request, sent alone before measuring, failed: {e}"))?;
        let mut runs = Vec::new();
        for &rate in &self.request_rate {
            let before = target.engine.as_ref().map(|w| w.stats().counters());
            let mut summary = self.run(target, &requests, rate);
            let after = |w: &strata_engine::Worker| w.settled_counters(Duration::from_secs(5));
            summary.engine = target.engine.as_ref().zip(before).map(|(w, before)| after(w).since(&before));
            if let Some(e) = &summary.first_error {
                eprintln!(
                    "warning: at {rate} requests/s, {} of {} requests failed; the first: {e}",
                    summary.failed,
                    requests.len()
                );
            }
            if json {
                println!("{}", self.json(target, lengths, rate, &summary));
            }
            runs.push((rate, summary));
        }
        if !json {
            self.print_table(target, lengths, &runs);
        }
        Ok(Sweep { label: target.label.clone(), runs })
    }

    /// One run: each request sent at its arrival time (once a place is free under
    /// `--max-concurrency`), each on a thread of its own that reads its stream.
    fn run(&self, target: &Target, requests: &[Request], rate: Rate) -> Summary {
        let arrivals = workload::arrivals(requests.len(), rate, self.seed);
        // Places in flight, as tokens in a channel: a request takes one to start and gives it
        // back when it ends.
        let places = self.max_concurrency.map(|cap| {
            let (give, take) = mpsc::sync_channel(cap as usize);
            (0..cap).for_each(|_| give.send(()).expect("the channel holds `cap` places"));
            (give, take)
        });
        let progress = indicatif::ProgressBar::new(requests.len() as u64).with_message(format!("{rate} requests/s"));
        if let Ok(style) = indicatif::ProgressStyle::with_template("{msg} [{wide_bar}] {pos}/{len} requests {elapsed}") {
            progress.set_style(style.progress_chars("=> "));
        }
        let start = Instant::now();
        let results: Vec<Result<Completion, String>> = std::thread::scope(|scope| {
            let mut handles = Vec::with_capacity(requests.len());
            for (request, &at) in requests.iter().zip(&arrivals) {
                std::thread::sleep(at.saturating_sub(start.elapsed()));
                let place = places.as_ref().map(|(give, take)| {
                    take.recv().expect("the sender is held here");
                    give.clone()
                });
                let progress = &progress;
                handles.push(scope.spawn(move || {
                    let result = target.endpoint.complete(&target.model, request);
                    if let Some(place) = place {
                        let _ = place.send(());
                    }
                    progress.inc(1);
                    result
                }));
            }
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("the request's thread panicked".into()))).collect()
        });
        let duration = start.elapsed();
        progress.finish_and_clear();
        Summary::of(&results, duration)
    }

    fn json(&self, target: &Target, (prompt_len, gen_len): (usize, usize), rate: Rate, s: &Summary) -> Value {
        let mut line = target.facts.clone();
        let fields = [
            ("request_rate", rate.json()),
            ("max_concurrency", self.max_concurrency.into()),
            ("num_prompts", self.num_prompts.into()),
            ("prompt_len", prompt_len.into()),
            ("gen_len", gen_len.into()),
            ("random_range_ratio", self.random_range_ratio.into()),
            ("seed", self.seed.into()),
            ("completed", s.completed.into()),
            ("failed", s.failed.into()),
            ("duration_s", s.duration_s.into()),
            ("total_input_tokens", s.input_tokens.into()),
            ("total_output_tokens", s.output_tokens.into()),
            ("req_s", s.req_s.into()),
            ("output_tok_s", s.output_tok_s.into()),
            ("total_tok_s", s.total_tok_s.into()),
        ];
        for (key, value) in fields {
            line[key] = value;
        }
        for (name, spread) in [("ttft", s.ttft), ("tpot", s.tpot), ("itl", s.itl), ("e2el", s.e2el)] {
            line[format!("{name}_ms_mean")] = spread.mean.into();
            line[format!("{name}_ms_p50")] = spread.p50.into();
            line[format!("{name}_ms_p99")] = spread.p99.into();
        }
        line["first_error"] = s.first_error.clone().into();
        if let Some(run) = &s.engine {
            line["engine"] = json!({
                "prefill_forwards": run.prefill_forwards, "prefill_chunks": run.prefill_chunks,
                "prefill_forward_ms": run.prefill_forward_ms(), "mixed_steps": run.mixed_steps,
                "decode_steps": run.decode_steps, "decode_step_ms": run.decode_step_ms(),
                "decode_forward_ms": run.decode_forward_ms(),
                "cuda_graph_recordings": run.graph_recordings, "cuda_graph_replays": run.graph_replays,
                "preemptions": run.preemptions, "acceptance": run.acceptance(),
            });
        }
        line
    }

    /// The runs side by side: a column per rate.
    fn print_table(&self, target: &Target, lengths: (usize, usize), runs: &[(Rate, Summary)]) {
        let cap = self.max_concurrency.map_or(String::new(), |c| format!(", at most {c} in flight"));
        println!("strata bench --request-rate: {}; {}, seed {}{cap}", target.title, self.workload(lengths), self.seed);
        let row = |label: &str, value: &dyn Fn(&Summary) -> String| {
            let cells: String = runs.iter().map(|(_, s)| format!(" {:>10}", value(s))).collect();
            println!("{label:<26}{cells}");
        };
        let rates: String = runs.iter().map(|(rate, _)| format!(" {:>10}", rate.to_string())).collect();
        println!("{:<26}{rates}", "request rate (req/s)");
        row("successful requests", &|s| s.completed.to_string());
        row("failed requests", &|s| s.failed.to_string());
        row("duration (s)", &|s| format!("{:.2}", s.duration_s));
        row("request throughput (req/s)", &|s| format!("{:.2}", s.req_s));
        row("output tok/s", &|s| format!("{:.1}", s.output_tok_s));
        row("total tok/s", &|s| format!("{:.1}", s.total_tok_s));
        for (name, pick) in [
            ("TTFT", (|s: &Summary| s.ttft) as fn(&Summary) -> metrics::Spread),
            ("TPOT", |s| s.tpot),
            ("ITL", |s| s.itl),
            ("E2E latency", |s| s.e2el),
        ] {
            row(&format!("{name} mean (ms)"), &|s| format!("{:.1}", pick(s).mean));
            row(&format!("{name} p50 (ms)"), &|s| format!("{:.1}", pick(s).p50));
            row(&format!("{name} p99 (ms)"), &|s| format!("{:.1}", pick(s).p99));
        }
        if runs.iter().all(|(_, s)| s.engine.is_some()) {
            let engine = |s: &Summary| s.engine.unwrap_or_default();
            let ms = |v: Option<f64>| v.map_or("-".into(), |ms| format!("{ms:.1}"));
            row("prefill forwards (mixed)", &|s| format!("{} ({})", engine(s).prefill_forwards, engine(s).mixed_steps));
            row("prefill forward (ms)", &|s| ms(engine(s).prefill_forward_ms()));
            row("decode steps", &|s| engine(s).decode_steps.to_string());
            row("decode step (ms)", &|s| ms(engine(s).decode_step_ms()));
            row("CUDA graph replays", &|s| engine(s).graph_replays.to_string());
            row("preemptions", &|s| engine(s).preemptions.to_string());
        }
    }

    /// What each run sends, in words.
    fn workload(&self, (prompt_len, gen_len): (usize, usize)) -> String {
        let ratio = self.random_range_ratio;
        let spread = if ratio > 0.0 { format!(" (±{:.0}%)", ratio * 100.0) } else { String::new() };
        format!("{} requests of {prompt_len} prompt → {gen_len} output tokens{spread}", self.num_prompts)
    }

    /// `--plot`: the sweeps' throughput against latency, for `model` under this workload.
    pub fn plot(&self, model: &str, lengths: (usize, usize), sweeps: &[Sweep]) -> Result<()> {
        let Some(path) = &self.plot else { return Ok(()) };
        let curves: Vec<plot::Curve> = sweeps.iter().map(|s| plot::Curve { label: &s.label, runs: &s.runs }).collect();
        let title = format!("{model}: {}", self.workload(lengths));
        plot::draw(path, &title, &curves).with_context(|| format!("--plot {}", path.display()))
    }
}

/// A server run in this process on a free port of 127.0.0.1, until dropped.
pub struct LocalServer {
    url: String,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LocalServer {
    pub fn start(state: AppState) -> Result<Self> {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the async runtime")?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).context("cannot listen on 127.0.0.1")?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name("strata-bench-server".into()).spawn(move || {
            // Stopped after the last run: no request is left to wait for.
            runtime.block_on(strata_server::serve(listener, state, async { stopped.await.unwrap_or_default() }, Duration::ZERO));
        })?;
        Ok(Self { url, stop: Some(stop), thread: Some(thread) })
    }

    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
