//! What the engine's test files share: the fixture folders and their reference prompt.

use std::path::{Path, PathBuf};
use std::sync::mpsc;

use candle_core::Device;
use strata_engine::{Event, EventSink};

/// Every Qwen3.5 fixture folder, and the Gemma 3 one (other dense ones live under
/// `fixtures/dense/` and serve as drafts).
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
