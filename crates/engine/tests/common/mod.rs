//! What the engine's test files share: the fixture folders and their reference prompt.

use std::path::{Path, PathBuf};

use candle_core::Device;

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
