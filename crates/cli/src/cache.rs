//! Prompt-cache flags shared by `serve` and `bench`, and the model identity that keys the SSD
//! tier (a cache written by one model is never read by another).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use strata_engine::cache::{Identity, SsdOptions};
use strata_engine::{CacheConfig, SsdConfig};
use xxhash_rust::xxh3::Xxh3;

#[derive(Clone, clap::Args)]
pub struct CacheArgs {
    /// Bytes of prompt-cache snapshots kept in memory (default: 4 GiB on CPU, 8 GiB of GPU
    /// memory on GPU; 0 turns the RAM tier off).
    #[arg(long)]
    prompt_cache_bytes: Option<usize>,
    /// During long prefills, snapshot the state every this many prompt tokens so a later
    /// prompt that diverges part-way still reuses the shared part (0: only at the prompt end;
    /// default: the prefill chunk, as prefill chunks end at stride points).
    #[arg(long)]
    cache_stride: Option<usize>,
    /// Folder for the SSD tier: snapshots persisted as files that survive restarts and crashes.
    #[arg(long)]
    ssd_cache: Option<PathBuf>,
    /// Most bytes the SSD tier may use; least recently used entries make room.
    #[arg(long, default_value_t = 64 << 30)]
    ssd_cache_bytes: u64,
    /// At startup, also check every stored tensor's hash (restores always check the entry
    /// they read).
    #[arg(long)]
    ssd_cache_verify: bool,
    /// Persist each reproducible (greedy or seeded) generation every N output tokens, so an
    /// identical request after a crash resumes instead of starting over. Needs --ssd-cache.
    #[arg(long)]
    checkpoint_every: Option<usize>,
}

impl CacheArgs {
    /// The SSD tier's folder, if one is set.
    pub fn ssd_dir(&self) -> Option<&Path> {
        self.ssd_cache.as_deref()
    }

    /// The cache settings on `device` for an engine that prefills `prefill_chunk` tokens a forward.
    pub fn config(
        &self,
        device: &Device,
        prefill_chunk: usize,
        identity: impl FnOnce() -> Result<Identity>,
    ) -> Result<CacheConfig> {
        let defaults = CacheConfig::for_device(device);
        let checkpoint_every = self.checkpoint_every.unwrap_or(0);
        if self.checkpoint_every == Some(0) {
            bail!("--checkpoint-every must be at least 1");
        }
        if checkpoint_every > 0 && self.ssd_cache.is_none() {
            bail!("--checkpoint-every needs --ssd-cache DIR: checkpoints are kept on disk to survive a crash");
        }
        let ssd = match &self.ssd_cache {
            Some(dir) => {
                if dir.exists() && !dir.is_dir() {
                    bail!("--ssd-cache {}: not a folder", dir.display());
                }
                let options = SsdOptions { dir: dir.clone(), max_bytes: self.ssd_cache_bytes, verify: self.ssd_cache_verify };
                Some(SsdConfig { options, identity: identity()?, queue: 64 })
            }
            None => None,
        };
        Ok(CacheConfig {
            ram_bytes: self.prompt_cache_bytes.unwrap_or(defaults.ram_bytes),
            stride: self.cache_stride.unwrap_or(prefill_chunk),
            ssd,
            checkpoint_every,
        })
    }
}

/// The identity of a model loaded at `dtype` from `dir` (a [`strata_model::ModelFolder`]'s
/// path: a folder, or a `.gguf` file): its name, a fingerprint of its config and weight files
/// (names, sizes, modification times and safetensors headers — hashing gigabytes of weights at
/// every start would cost too much), and a hash of its tokenizer.
pub fn folder_identity(dir: &Path, dtype: &str) -> Result<Identity> {
    if dir.is_file() {
        return gguf_identity(dir, dtype);
    }
    let read = |name: &str| std::fs::read(dir.join(name)).with_context(|| format!("cannot read {}", dir.join(name).display()));
    let mut config = Xxh3::new();
    config.update(&read("config.json")?);
    // How images are prepared decides what their cached tokens hold.
    if let Ok(processor) = std::fs::read(dir.join("preprocessor_config.json")) {
        config.update(&processor);
    }
    let mut weights: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    weights.sort();
    for path in weights {
        config.update(path.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        stamp(&mut config, &path)?;
        config.update(&safetensors_header(&path)?);
    }
    let name = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let name = name.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(Identity {
        model: name,
        config_hash: config.digest(),
        tokenizer_hash: xxhash_rust::xxh3::xxh3_64(&read("tokenizer.json")?),
        dtype: dtype.into(),
    })
}

/// A GGUF file's identity: its name, and a fingerprint of its size, modification time and first
/// bytes — the header and metadata (architecture, hyperparameters, the tokenizer's vocabulary
/// and merges), which is also what `tokenizer_hash` would cover.
fn gguf_identity(path: &Path, dtype: &str) -> Result<Identity> {
    use std::io::Read;
    const FINGERPRINT_BYTES: u64 = 32 << 20;
    let mut head = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(FINGERPRINT_BYTES).read_to_end(&mut head))
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut fingerprint = Xxh3::new();
    stamp(&mut fingerprint, path)?;
    fingerprint.update(&head);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(Identity { model: name, config_hash: fingerprint.digest(), tokenizer_hash: 0, dtype: dtype.into() })
}

/// Adds a file's size and modification time to `fingerprint`: a replaced file changes them.
fn stamp(fingerprint: &mut Xxh3, path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    let modified = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).unwrap_or_default();
    fingerprint.update(&meta.len().to_le_bytes());
    fingerprint.update(&modified.as_nanos().to_le_bytes());
    Ok(())
}

/// The identity of a synthetic (random-weight, seeded) model.
pub fn synthetic_identity(name: &str, dtype: &str) -> Identity {
    Identity {
        model: format!("synthetic:{name}"),
        config_hash: xxhash_rust::xxh3::xxh3_64(name.as_bytes()),
        tokenizer_hash: 0,
        dtype: dtype.into(),
    }
}

fn safetensors_header(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).with_context(|| format!("{}: not a safetensors file", path.display()))?;
    let mut header = vec![0u8; u64::from_le_bytes(len).min(100 << 20) as usize];
    file.read_exact(&mut header).with_context(|| format!("{}: truncated safetensors header", path.display()))?;
    Ok(header)
}
