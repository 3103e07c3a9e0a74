//! What the model's test files share: the Qwen3.5 fixture folders.

use std::path::PathBuf;

/// Every Qwen3.5 fixture folder (dense ones live under `fixtures/dense/`).
pub fn fixtures() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).filter(|p| p.join("config.json").exists()).collect();
    dirs.sort();
    assert!(dirs.len() >= 3, "fixtures missing under {}", root.display());
    dirs
}
