//! Flags and helpers shared by the subcommands.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use strata_model::ModelFolder;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DTypeArg {
    F32,
    Bf16,
}

impl DTypeArg {
    /// The compute dtype asked for, else the device's default: f32 on CPU (exact against the
    /// oracle), bf16 on GPUs (tensor cores; recurrent state stays f32 either way).
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
