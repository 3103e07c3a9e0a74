//! Safetensors weights of a model folder: `model.safetensors`, or the shards listed by
//! `model.safetensors.index.json`. Files are memory-mapped and their headers validated once at
//! open; a tensor is read only when asked for, with its name, file and shape in every error.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use safetensors::SafeTensors;

use crate::error::{ModelError, Result};

struct Entry {
    file: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Byte range within the file.
    start: usize,
    end: usize,
}

pub struct Weights {
    files: Vec<(PathBuf, Mmap)>,
    entries: HashMap<String, Entry>,
}

impl Weights {
    /// Opens the weights of the folder `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let paths = if index.exists() {
            shard_paths(&index)?
        } else if single.exists() {
            vec![single]
        } else {
            return Err(ModelError::file(dir, "no weights: expected model.safetensors or model.safetensors.index.json"));
        };
        Self::from_files(&paths)
    }

    pub fn from_files(paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::new();
        let mut entries = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = std::fs::File::open(path).map_err(|e| ModelError::file(path, format!("cannot open: {e}")))?;
            // SAFETY: the map is read-only; strata never writes model files while serving them.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::file(path, format!("cannot map: {e}")))?;
            let invalid = |e: &dyn std::fmt::Display| {
                ModelError::file(path, format!("not a valid safetensors file (truncated or corrupt?): {e}"))
            };
            SafeTensors::deserialize(&mmap).map_err(|e| invalid(&e))?;
            let (header_len, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| invalid(&e))?;
            let data_start = 8 + header_len;
            for (name, info) in meta.tensors() {
                let dtype = match info.dtype {
                    safetensors::Dtype::F32 => DType::F32,
                    safetensors::Dtype::BF16 => DType::BF16,
                    safetensors::Dtype::F16 => DType::F16,
                    safetensors::Dtype::I64 => DType::I64,
                    safetensors::Dtype::U32 => DType::U32,
                    safetensors::Dtype::U8 => DType::U8,
                    // Not a dtype any architecture reads; `get` reports it if one ever asks.
                    _ => continue,
                };
                let (s, e) = info.data_offsets;
                entries.insert(
                    name.clone(),
                    Entry { file: i, dtype, shape: info.shape.clone(), start: data_start + s, end: data_start + e },
                );
            }
            files.push((path.clone(), mmap));
        }
        Ok(Self { files, entries })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Loads `name`, checks it has `shape`, converts it to `dtype` on `device`.
    pub fn get(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        let entry = self.entries.get(name).ok_or_else(|| ModelError::Tensor {
            name: name.to_string(),
            what: "is missing from the weights (or has an unsupported dtype)".into(),
        })?;
        let (path, mmap) = &self.files[entry.file];
        if entry.shape != shape {
            return Err(ModelError::Tensor {
                name: name.to_string(),
                what: format!("in {} has shape {:?}, expected {:?}", path.display(), entry.shape, shape),
            });
        }
        let bytes = &mmap[entry.start..entry.end];
        let t = Tensor::from_raw_buffer(bytes, entry.dtype, shape, &Device::Cpu)?;
        Ok(t.to_dtype(dtype)?.to_device(device)?)
    }
}

fn shard_paths(index: &Path) -> Result<Vec<PathBuf>> {
    let json = crate::error::read_json(index)?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::field(index, "weight_map", "missing or not an object"))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file =
            file.as_str().ok_or_else(|| ModelError::field(index, format!("weight_map.{tensor}"), "expected a file name"))?;
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    files.sort();
    let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
    if let Some(missing) = paths.iter().find(|p| !p.exists()) {
        return Err(ModelError::file(missing, format!("listed in {} but missing", index.display())));
    }
    Ok(paths)
}
