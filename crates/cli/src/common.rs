//! Flags and helpers shared by the subcommands.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use strata_model::{Model, ModelFolder};
use strata_state::{KvFormat, KvPolicy};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DTypeArg {
    F32,
    Bf16,
}

impl DTypeArg {
    /// The compute dtype asked for, else the device's default: f32 on CPU (exact against the
    /// oracle), bf16 on GPUs (tensor cores; recurrent state stays f32 unless
    /// `--mamba-ssm-cache-dtype` says otherwise).
    pub fn or_default_for(asked: Option<DTypeArg>, device: &Device) -> DTypeArg {
        asked.unwrap_or(if device.is_cpu() { DTypeArg::F32 } else { DTypeArg::Bf16 })
    }

    pub fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DTypeArg::F32 => "f32",
            DTypeArg::Bf16 => "bf16",
        }
    }
}

/// What DeltaNet recurrent state is stored in (`--mamba-ssm-cache-dtype`, vLLM's name and values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SsmCacheDtype {
    /// float32 (vLLM's auto is the model's dtype; strata keeps the exact one).
    Auto,
    Float32,
    Bfloat16,
}

impl SsmCacheDtype {
    pub fn dtype(self) -> DType {
        match self {
            SsmCacheDtype::Auto | SsmCacheDtype::Float32 => DType::F32,
            SsmCacheDtype::Bfloat16 => DType::BF16,
        }
    }
}

/// How attention KV and recurrent state are stored: `--kv-cache-dtype` and its options, and
/// `--mamba-ssm-cache-dtype`, for every command that loads a model.
#[derive(Clone, Debug, clap::Args)]
pub struct KvCacheArgs {
    /// How attention keys and values are stored: auto (as computed, in --dtype);
    /// affine2..affine8 (that many bits a coordinate, a bf16 scale and bias per group of
    /// --kv-group-size), or affine-k<bits>v<bits> with keys and values at their own bits (e.g.
    /// affine-k8v4); turbo1..turbo8 or turbo-k<bits>[ip]v<bits> (TurboQuant, keys and values
    /// at their own bits, `ip` for unbiased inner-product keys), e.g. turbo4, turbo-k4v3.
    #[arg(long, default_value = "auto", value_parser = clap::value_parser!(KvFormat))]
    pub kv_cache_dtype: KvFormat,
    /// Coordinates per affine group along the head dimension: 32, 64 or 128 (default 64).
    #[arg(long)]
    pub kv_group_size: Option<usize>,
    /// Layers whose KV stays unquantized, counted among the layers that hold KV (full or
    /// sliding-window attention), negative from the last: e.g. 0,-1 for the first and last.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    pub kv_unquantized_layers: Vec<isize>,
    /// Delays quantization: queries before this position read unquantized keys and values (a
    /// row keeps its first N positions both ways), later ones read codes (mlx-lm's
    /// `quantized_kv_start`).
    #[arg(long, default_value_t = 0)]
    pub quantized_kv_start: usize,
    /// What Gated DeltaNet layers store their recurrent state in: auto (= float32, exact) or
    /// bfloat16 — half the bytes each request holds and each decode step reads and writes; the
    /// recurrence still computes in f32, rounding the state after every token (once per prompt
    /// chunk where a prompt runs by chunks on tensor cores).
    #[arg(long, value_enum, default_value = "auto")]
    pub mamba_ssm_cache_dtype: SsmCacheDtype,
}

impl KvCacheArgs {
    /// The formats asked for.
    pub fn policy(&self) -> Result<KvPolicy> {
        let format = match (self.kv_cache_dtype, self.kv_group_size) {
            (format, None) => format,
            (format @ KvFormat::Affine { .. }, Some(group)) => {
                let format = format.with_group(group);
                format.check_limits().map_err(|e| anyhow::anyhow!("--kv-group-size {group}: `{format}`: {e}"))?;
                format
            }
            (format, Some(_)) => bail!("--kv-group-size applies to affine formats, not --kv-cache-dtype {format}"),
        };
        if !format.is_quantized() && (!self.kv_unquantized_layers.is_empty() || self.quantized_kv_start > 0) {
            bail!("--kv-unquantized-layers and --quantized-kv-start need a quantized --kv-cache-dtype");
        }
        Ok(KvPolicy { format, unquantized: self.kv_unquantized_layers.clone(), start: self.quantized_kv_start })
    }

    /// Stores `model`'s KV as asked.
    pub fn apply(&self, mut model: Model) -> Result<Model> {
        model.set_kv_format(self.policy()?)?;
        model.set_ssm_cache_dtype(self.mamba_ssm_cache_dtype.dtype())?;
        Ok(model)
    }

    /// `--mamba-ssm-cache-dtype` as it was given (`auto`, `float32`, `bfloat16`).
    pub fn ssm_dtype_name(&self) -> String {
        use clap::ValueEnum;
        let value = self.mamba_ssm_cache_dtype.to_possible_value().expect("no variant is skipped");
        value.get_name().to_string()
    }

    /// `dtype`'s name with the KV formats and a bf16 recurrent state, for cache identities
    /// (stored state is never read as another format's; the defaults keep the plain dtype name).
    pub fn identity_dtype(&self, dtype: DTypeArg) -> Result<String> {
        let policy = self.policy()?;
        let mut name = match policy.format {
            KvFormat::Auto => dtype.name().to_string(),
            // Codes hold smoothed keys where the model smooths them (strata_model::smoothing):
            // entries written before that are never read as theirs. Revision 2: Qwen3 and
            // Qwen3.5 smoothed too (revision 1, `+smoothed`, was Gemma 3 alone).
            _ => format!("{}+kv-{policy}+smoothing2", dtype.name()),
        };
        if self.mamba_ssm_cache_dtype.dtype() == DType::BF16 {
            name.push_str("+ssm-bf16");
        }
        Ok(name)
    }
}

/// `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(spec: &str) -> Result<Device> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        "cuda" => cuda(0),
        s if s.starts_with("cuda:") => {
            cuda(s[5..].parse().with_context(|| format!("--device {s}: expected cuda:N with N a GPU index"))?)
        }
        s => bail!("--device {s}: expected cpu, cuda or cuda:N"),
    }
}

fn cuda(index: usize) -> Result<Device> {
    if !cfg!(feature = "cuda") {
        bail!("--device cuda:{index}: this strata binary was built without CUDA (build it with scripts/cuda/build.sh)");
    }
    let device = Device::new_cuda(index)
        .with_context(|| format!("--device cuda:{index}: no usable GPU (is the NVIDIA driver installed?)"))?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(gpu) = &device {
        strata_kernels::prepare_device(gpu).with_context(|| format!("--device cuda:{index}: setting up the GPU"))?;
    }
    Ok(device)
}

/// A comma-separated token id list such as `1,2,3`.
pub fn parse_tokens(list: &str) -> Result<Vec<u32>> {
    let ids = list
        .split(',')
        .map(|s| s.trim().parse::<u32>().with_context(|| format!("--tokens: `{s}` is not a token id (expected e.g. 1,2,3)")))
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--tokens: no token ids given");
    }
    Ok(ids)
}

pub fn open_model(dir: &Path) -> Result<ModelFolder> {
    Ok(ModelFolder::open(dir)?)
}

/// The image files at `paths` (`--image`) through `folder`'s processor.
pub fn prepare_images(folder: &ModelFolder, paths: &[PathBuf]) -> Result<Vec<strata_model::PreparedImage>> {
    if paths.is_empty() {
        return Ok(Vec::new());
    }
    let processor = match (&folder.image_processor, folder.has_vision()) {
        (Some(processor), true) => processor,
        _ => bail!("--image: {} takes no images (no vision tower and preprocessor_config.json)", folder.path.display()),
    };
    paths
        .iter()
        .map(|path| {
            let bytes = std::fs::read(path).with_context(|| format!("--image {}: cannot read", path.display()))?;
            processor
                .prepare(&bytes, strata_model::ImageLimits::default())
                .map_err(|e| anyhow::anyhow!("--image {}: {e}", path.display()))
        })
        .collect()
}

/// The CPU's model name, for benchmark reports.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("{cpu}, {} threads", candle_core::utils::get_num_threads())
}
