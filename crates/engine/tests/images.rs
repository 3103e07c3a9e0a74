//! Prompts with images through the engine, against transformers and against each other: the
//! fixture's two images give transformers' greedy tokens (alone, drafted by the model itself,
//! and with prefill chunks that cut through both images); the same text with another image gives
//! another output and reuses no state past the first image token, while the same images reuse
//! it all; 8 requests mixing images and text at once, sharing forwards, give their solo outputs.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

use candle_core::{DType, Device};
use strata_engine::{CacheConfig, DraftSource, EngineConfig, Event, Job, Speculation, Worker};
use strata_model::images::RgbImage;
use strata_model::{ImageProcessor, Model, ModelFolder, PreparedImage};

mod common;
use common::{greedy, prompt_tokens, small_engine, Channel, Run};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/vision/qwen3_5-vl-tiny-g")
}

fn load() -> Model {
    ModelFolder::open(&fixture()).unwrap().load_with_vision(DType::F32, &Device::Cpu).unwrap()
}

fn processor() -> ImageProcessor {
    ModelFolder::open(&fixture()).unwrap().image_processor.unwrap()
}

/// The fixture's image `name`, and the same image with its colours inverted (same size, so the
/// prompt's runs of image tokens fit both).
fn images(name: &str) -> (PreparedImage, PreparedImage) {
    let bytes = std::fs::read(fixture().join(name)).unwrap();
    let image = processor().prepare(&bytes, Default::default()).unwrap();
    let mut inverted: RgbImage = strata_model::images::decode(&bytes, Default::default()).unwrap();
    inverted.pixels_mut().for_each(|p| p.0 = p.0.map(|c| 255 - c));
    (image, processor().prepare_rgb(inverted).unwrap())
}

fn submit(worker: &Worker, prompt: &[u32], images: &[PreparedImage], max_tokens: usize) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    let mut job = Job::new(prompt.to_vec(), greedy(max_tokens, vec![]), Box::new(Channel(tx)));
    job.images = images.to_vec();
    worker.submit(job).unwrap();
    rx
}

fn collect(rx: mpsc::Receiver<Event>) -> Run {
    let mut run = Run { cached: usize::MAX, tokens: Vec::new(), logprobs: Vec::new() };
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("the engine answers") {
            Event::Started { cached_tokens } => run.cached = cached_tokens,
            Event::Token(s) => run.tokens.push(s.id),
            Event::Finished(_) => return run,
            Event::Failed(e) => panic!("generation failed: {e}"),
        }
    }
}

fn reference_tokens() -> Vec<u32> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap()).unwrap();
    json["greedy_tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

#[test]
fn greedy_tokens_match_transformers_alone_and_drafted() {
    let prompt = prompt_tokens(&fixture());
    let pictures = [images("image-a.png").0, images("image-b.png").0];
    let drafted = Speculation { source: DraftSource::Model(Box::new(load())), tokens: 3 };
    for (what, speculation) in [("alone", None), ("drafted by itself", Some(drafted))] {
        let worker = small_engine(load(), CacheConfig::off(), speculation);
        let run = collect(submit(&worker, &prompt, &pictures, 16));
        assert_eq!(run.tokens, reference_tokens(), "{what}");
    }
}

#[test]
fn the_prompt_cache_keys_on_the_images() {
    let prompt = prompt_tokens(&fixture());
    let first_image = prompt.iter().position(|&t| t == 514).unwrap();
    let ((a, inverted_a), b) = (images("image-a.png"), images("image-b.png").0);
    let cache = CacheConfig { ram_bytes: 1 << 30, stride: 8, ssd: None, checkpoint_every: 0 };
    let worker = small_engine(load(), cache, None);
    let cold = collect(submit(&worker, &prompt, &[a.clone(), b.clone()], 12));
    assert_eq!(cold.cached, 0);
    let other = collect(submit(&worker, &prompt, &[inverted_a.clone(), b.clone()], 12));
    assert!(other.cached <= first_image, "reused {} tokens, past the first image at {first_image}", other.cached);
    assert!(other.cached > 0, "the text before the image (a stride snapshot) is reused");
    assert_ne!(other.tokens, cold.tokens, "another image, the same output");
    let again = collect(submit(&worker, &prompt, &[a, b.clone()], 12));
    assert_eq!(again.cached, prompt.len() - 1, "the same images reuse the whole prompt");
    assert_eq!(again.tokens, cold.tokens);
    let cold_other = collect(submit(&small_engine(load(), CacheConfig::off(), None), &prompt, &[inverted_a, b], 12));
    assert_eq!(cold_other.tokens, other.tokens, "served from the text before the image");
    // A text prompt sharing the text before the image reuses it, and gives its cold output.
    let text: Vec<u32> = prompt[..first_image - 1].iter().chain(&prompt[first_image + 12..first_image + 20]).copied().collect();
    let warm_text = collect(submit(&worker, &text, &[], 12));
    assert!(warm_text.cached > 0 && warm_text.cached < first_image, "{}", warm_text.cached);
    assert_eq!(warm_text.tokens, collect(submit(&small_engine(load(), CacheConfig::off(), None), &text, &[], 12)).tokens);
}

/// Rows with images outgrowing a small pool are preempted (their state to host memory) and
/// resumed with their rotary offsets: every output equals its solo run.
#[test]
fn preempted_rows_with_images_resume_exactly() {
    let prompt = prompt_tokens(&fixture());
    let ((a, inverted_a), b) = (images("image-a.png"), images("image-b.png").0);
    let cost = load().state_cost();
    let (rows, blocks, block) = (4, 28, 16);
    let config = EngineConfig {
        max_batch: rows,
        prefill_chunk: 8,
        kv_block_size: block,
        kv_cache_bytes: Some((rows + 1) * cost.bytes_per_row + blocks * block * cost.bytes_per_token),
        ..EngineConfig::for_device(&Device::Cpu)
    };
    let pictures = [vec![a.clone(), b.clone()], vec![inverted_a.clone(), b.clone()], vec![a, b.clone()], vec![inverted_a, b]];
    let solo: Vec<Run> =
        pictures.iter().map(|p| collect(submit(&small_engine(load(), CacheConfig::off(), None), &prompt, p, 90))).collect();
    let worker = Worker::spawn(load(), config, CacheConfig::off(), None).unwrap();
    let pending: Vec<_> = pictures.iter().map(|p| submit(&worker, &prompt, p, 90)).collect();
    for (i, (rx, solo)) in pending.into_iter().zip(&solo).enumerate() {
        assert_eq!(collect(rx).tokens, solo.tokens, "request {i}");
    }
    assert!(
        worker.stats().preemptions.load(Ordering::Relaxed) > 0,
        "four rows of 190 positions (17 blocks each) in {blocks} blocks"
    );
}

#[test]
fn requests_mixing_images_and_text_give_their_solo_outputs() {
    let prompt = prompt_tokens(&fixture());
    let text_end = prompt.iter().position(|&t| t == 514).unwrap() - 1;
    let ((a, inverted_a), b) = (images("image-a.png"), images("image-b.png").0);
    let requests: Vec<(Vec<u32>, Vec<PreparedImage>)> = (0..8)
        .map(|i| match i % 4 {
            0 => (prompt.clone(), vec![a.clone(), b.clone()]),
            1 => (prompt.clone(), vec![inverted_a.clone(), b.clone()]),
            2 => (prompt[..text_end].to_vec(), vec![]),
            _ => (prompt[i..text_end + 5].iter().map(|&t| if t == 514 { 7 } else { t }).collect(), vec![]),
        })
        .collect();
    let solo: Vec<Run> =
        requests.iter().map(|(p, imgs)| collect(submit(&small_engine(load(), CacheConfig::off(), None), p, imgs, 10))).collect();
    // Steps of up to 32 positions: several prompts' chunks of 8 share each forward.
    let config =
        EngineConfig { max_batch: 4, prefill_chunk: 8, max_batched_tokens: Some(32), ..EngineConfig::for_device(&Device::Cpu) };
    let worker = Worker::spawn(load(), config, CacheConfig::off(), None).unwrap();
    let pending: Vec<_> = requests.iter().map(|(p, imgs)| submit(&worker, p, imgs, 10)).collect();
    for (i, (rx, solo)) in pending.into_iter().zip(&solo).enumerate() {
        assert_eq!(collect(rx).tokens, solo.tokens, "request {i}");
    }
    // Prompts with images were segments of forwards that also carried other prompts' chunks
    // and running rows.
    let stats = worker.stats();
    assert!(stats.prefill_chunks.load(Ordering::Relaxed) > stats.prefill_forwards.load(Ordering::Relaxed));
    assert!(stats.mixed_steps.load(Ordering::Relaxed) > 0);
}

#[test]
fn images_the_prompt_has_no_place_for_are_refused() {
    let prompt = prompt_tokens(&fixture());
    let a = images("image-a.png").0;
    let worker = small_engine(load(), CacheConfig::off(), None);
    let (tx, _rx) = mpsc::channel();
    let mut job = Job::new(prompt.clone(), greedy(4, vec![]), Box::new(Channel(tx)));
    job.images = vec![a.clone()];
    assert!(worker.submit(job).unwrap_err().contains("image"));
    // The second image given where the first belongs: its grid does not fit that run.
    let (tx, _rx) = mpsc::channel();
    let mut job = Job::new(prompt, greedy(4, vec![]), Box::new(Channel(tx)));
    job.images = vec![images("image-b.png").0, a];
    assert!(worker.submit(job).is_err());
    // A model without a vision tower takes none.
    let text = small_engine(load_text(), CacheConfig::off(), None);
    let (tx, _rx) = mpsc::channel();
    let mut job = Job::new(vec![1, 2, 3], greedy(4, vec![]), Box::new(Channel(tx)));
    job.images = vec![images("image-a.png").0];
    assert!(text.submit(job).unwrap_err().contains("no images"));
}

fn load_text() -> Model {
    ModelFolder::open(&fixture()).unwrap().load(DType::F32, &Device::Cpu).unwrap()
}
