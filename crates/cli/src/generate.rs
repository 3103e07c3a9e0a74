//! `strata generate`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use anyhow::{bail, Result};
use strata_engine::{CacheConfig, EngineConfig, Event, EventSink, FinishReason, GenerationOptions, Job, SamplingChoice, Worker};

use crate::common::{open_model, parse_device, parse_tokens, DTypeArg, KvCacheArgs};
use crate::draft::DraftArgs;

#[derive(clap::Args)]
pub struct Args {
    /// A model folder, a .gguf file, or a Hugging Face repo id; default: as `strata serve`.
    #[arg(long)]
    model: Option<String>,
    /// Raw prompt text (no chat template).
    #[arg(long, group = "input")]
    prompt: Option<String>,
    /// A user message, wrapped in the model's chat template.
    #[arg(long, group = "input")]
    chat: Option<String>,
    /// Prompt token ids, e.g. 1,2,3.
    #[arg(long, group = "input")]
    tokens: Option<String>,
    /// With --chat: switch the model's thinking off (template kwarg enable_thinking=false).
    #[arg(long)]
    no_thinking: bool,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Keep generating past end-of-sequence tokens (for benchmarks and oracle comparisons).
    #[arg(long)]
    ignore_eos: bool,
    /// 0 means greedy. Defaults to the model's generation_config.json.
    #[arg(long)]
    temperature: Option<f64>,
    #[arg(long)]
    top_p: Option<f64>,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    min_p: Option<f64>,
    #[arg(long)]
    repetition_penalty: Option<f64>,
    #[arg(long)]
    presence_penalty: Option<f64>,
    #[arg(long)]
    frequency_penalty: Option<f64>,
    #[arg(long)]
    seed: Option<u64>,
    /// Compute dtype (default: f32 on CPU, bf16 on GPU).
    #[arg(long, value_enum)]
    dtype: Option<DTypeArg>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    #[command(flatten)]
    kv: KvCacheArgs,
    /// Prompt tokens per prefill forward (default: 512 on CPU, 2048 on GPU).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// An image file (PNG, JPEG, WebP, GIF) for a model with a vision tower; repeatable. With
    /// --chat the images go into the user message before the text; with --tokens each run of
    /// the image token is filled by the next image, in order.
    #[arg(long = "image", value_name = "PATH")]
    images: Vec<PathBuf>,
    /// Print, as the last line, a JSON object with the generated tokens and text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    draft: DraftArgs,
}

/// Events to this thread; `stop` (set when stdout closes) cancels the generation.
struct Channel(mpsc::Sender<Event>, Arc<AtomicBool>);

impl EventSink for Channel {
    fn send(&mut self, event: Event) -> bool {
        self.0.send(event).is_ok() && !self.1.load(Ordering::Relaxed)
    }
    fn is_closed(&self) -> bool {
        self.1.load(Ordering::Relaxed)
    }
}

pub fn run(a: Args) -> Result<()> {
    let device = parse_device(&a.device)?;
    let dtype = DTypeArg::or_default_for(a.dtype, &device);
    let dir = crate::hub::resolve_model(a.model.as_deref())?;
    let folder = open_model(&dir)?;
    let images = crate::common::prepare_images(&folder, &a.images)?;
    let prompt = match (&a.prompt, &a.chat, &a.tokens) {
        (Some(text), _, _) => folder.tokenizer.encode_prompt(text)?,
        (_, Some(text), _) => {
            let Some(template) = &folder.chat_template else {
                bail!(
                    "--chat: {} has no chat template (tokenizer_config.json chat_template, chat_template.jinja or GGUF \
                     tokenizer.chat_template); use --prompt",
                    dir.display()
                );
            };
            // prepare_images checked that a folder given images has a vision tower.
            let vision = folder.vision_config().filter(|_| !images.is_empty());
            let markup = vision.map(|v| v.markup(&folder.tokenizer)).transpose()?.unwrap_or_default().repeat(images.len());
            let rendered = template.render(serde_json::json!({
                "messages": [{"role": "user", "content": markup + text}],
                "add_generation_prompt": true,
                "enable_thinking": !a.no_thinking,
            }))?;
            let tokens = folder.tokenizer.encode(&rendered)?;
            match vision {
                Some(v) => strata_model::expand_image_tokens(&tokens, &images, v)?,
                None => tokens,
            }
        }
        (_, _, Some(list)) => parse_tokens(list)?,
        _ => bail!("give one of --prompt, --chat or --tokens"),
    };
    let sampling = SamplingChoice {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        logit_bias: Vec::new(),
        seed: a.seed,
    }
    .resolve(&folder.generation)
    .map_err(anyhow::Error::msg)?;
    let model = match images.is_empty() {
        true => folder.load(dtype.dtype(), &device)?,
        false => folder.load_with_vision(dtype.dtype(), &device)?,
    };
    let model = a.kv.apply(model)?;
    let speculation = a.draft.speculation(
        folder.config.vocab_size,
        || Ok(folder.load(dtype.dtype(), &device)?),
        |path| Ok(open_model(path)?.load(dtype.dtype(), &device)?),
        || Ok(folder.load_mtp(&model)?),
    )?;
    // The same engine that serves requests, for one request.
    let prefill_chunk = a.prefill_chunk.unwrap_or(EngineConfig::for_device(&device).prefill_chunk).max(1);
    // No state budget: on a GPU the pool takes its share of the memory, on the CPU it grows.
    let engine =
        EngineConfig { max_batch: 1, prefill_chunk, state_budget_bytes: usize::MAX, ..EngineConfig::for_device(&device) };
    let worker = Worker::spawn(model, engine, CacheConfig::off(), speculation)?;
    let opts = GenerationOptions {
        max_tokens: a.max_tokens,
        sampling,
        stop_tokens: if a.ignore_eos { vec![] } else { folder.eos_token_ids() },
        prefill_chunk,
        logprobs: None,
        grammar: None,
    };

    let mut stream = folder.tokenizer.stream(true);
    let mut stdout = std::io::stdout().lock();
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let mut job = Job::new(prompt.clone(), opts, Box::new(Channel(tx, stop.clone())));
    job.images = images;
    worker.submit(job).map_err(anyhow::Error::msg)?;
    let out = loop {
        match rx.recv()? {
            Event::Started { .. } => {}
            Event::Token(s) => {
                let piece = stream.push(s.id)?;
                // A closed stdout (e.g. piped into `head`) ends the generation quietly.
                if write!(stdout, "{piece}").and_then(|_| stdout.flush()).is_err() {
                    stop.store(true, Ordering::Relaxed);
                }
            }
            Event::Finished(g) => break g,
            Event::Failed(e) => bail!("generation failed: {e}"),
        }
    };
    let _ = writeln!(stdout);
    let finish = match out.finish {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    };
    let drafts = match out.drafted_tokens {
        0 => String::new(),
        n => {
            format!(" | drafts: {} of {n} accepted ({:.0}%)", out.accepted_tokens, 100.0 * out.accepted_tokens as f64 / n as f64)
        }
    };
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s | finish: {finish}{drafts}",
        prompt.len(),
        out.prefill_tok_s(prompt.len()),
        out.tokens.len(),
        out.decode_tok_s()
    );
    if a.json {
        let text = folder.tokenizer.decode(&out.tokens, true)?;
        let json = serde_json::json!({
            "tokens": out.tokens,
            "text": text,
            "prompt_tokens": prompt.len(),
            "finish_reason": finish,
            "prefill_tok_s": out.prefill_tok_s(prompt.len()),
            "decode_tok_s": out.decode_tok_s(),
            "drafted_tokens": out.drafted_tokens,
            "accepted_tokens": out.accepted_tokens,
        });
        let _ = writeln!(stdout, "{json}");
    }
    Ok(())
}
