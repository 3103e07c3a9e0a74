//! Where a model's tensors come from: a checkpoint on disk, or random values of the right
//! shapes (synthetic models for benchmarks that need no download).

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Tensor};

use crate::error::Result;
use crate::qwen3_5::layers::Matrix;
use crate::weights::Weights;

/// Tensors by their Hugging Face name (relative to the text decoder) and convention; a source
/// in another layout (GGUF) translates names and conventions to these.
pub trait WeightSource {
    /// The tensor `name`, which must have `shape`, as `dtype` on the source's device.
    fn get(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor>;

    /// The weight matrix `name` (`[rows, cols]`): kept quantized where the source stores it so
    /// and the model multiplies it as stored, else as `dtype`.
    fn matrix(&self, name: &str, rows: usize, cols: usize, dtype: DType) -> Result<Matrix> {
        Ok(Matrix::Dense(self.get(name, &[rows, cols], dtype)?))
    }

    fn device(&self) -> &Device;

    /// Whether the source holds a tensor `name`, for weights stored in more than one layout;
    /// a source that does not say (random weights, GGUF) answers no, and gets asked for the
    /// layout loaders fall back to.
    fn contains(&self, name: &str) -> bool {
        let _ = name;
        false
    }
}

pub struct FileSource<'a> {
    pub weights: &'a Weights,
    pub prefix: String,
    pub device: Device,
}

impl<'a> FileSource<'a> {
    /// The text model's tensors of a checkpoint. Qwen3.5 releases name them
    /// `model.language_model.*` (with `model.visual.*` and `mtp.*` beside them, not used by the
    /// text model); flat text checkpoints and dense models name them `model.*`.
    pub fn text_model(weights: &'a Weights, device: &Device) -> Self {
        let prefix =
            if weights.contains("model.language_model.embed_tokens.weight") { "model.language_model." } else { "model." };
        FileSource { weights, prefix: prefix.into(), device: device.clone() }
    }

    /// The checkpoint's name for `name`: under the text model's prefix, except the output head
    /// and the multi-token-prediction head, which sit beside the text model.
    fn stored_name(&self, name: &str) -> String {
        let beside = name == "lm_head.weight" || name.starts_with("mtp.");
        if beside {
            name.to_string()
        } else {
            format!("{}{name}", self.prefix)
        }
    }
}

impl WeightSource for FileSource<'_> {
    fn get(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        self.weights.get(&self.stored_name(name), shape, dtype, &self.device)
    }

    fn contains(&self, name: &str) -> bool {
        self.weights.contains(&self.stored_name(name))
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// Uniform random weights scaled by 1/sqrt(fan-in), so activations stay in range through deep
/// stacks; 1-D tensors (norms, biases, gating constants) get small values.
pub struct RandomSource {
    pub device: Device,
    seed: AtomicU64,
}

impl RandomSource {
    pub fn new(device: Device, seed: u64) -> Self {
        Self { device, seed: AtomicU64::new(seed) }
    }
}

impl WeightSource for RandomSource {
    fn get(&self, _name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let seed = self.seed.fetch_add(1, Ordering::Relaxed);
        let n: usize = shape.iter().product();
        let scale = if shape.len() >= 2 { 1.0 / (shape[shape.len() - 1] as f32).sqrt() } else { 0.1 };
        let host = match dtype {
            DType::BF16 => Tensor::from_vec(uniform(seed, n, scale, half::bf16::from_f32), shape, &Device::Cpu)?,
            DType::F16 => Tensor::from_vec(uniform(seed, n, scale, half::f16::from_f32), shape, &Device::Cpu)?,
            _ => Tensor::from_vec(uniform(seed, n, scale, |x| x), shape, &Device::Cpu)?.to_dtype(dtype)?,
        };
        Ok(host.to_device(&self.device)?)
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// `n` values uniform in `[-scale, scale)` from `seed`, made in pieces on every core (a 4B
/// model's weights took ~20 s on one) and written straight in their dtype; each piece draws
/// from its own seed, so the values depend on `seed` and `n` alone.
fn uniform<T: Copy + Default + Send>(seed: u64, n: usize, scale: f32, convert: impl Fn(f32) -> T + Sync) -> Vec<T> {
    use rayon::prelude::*;
    const PIECE: usize = 1 << 16;
    let mut values = vec![T::default(); n];
    values.par_chunks_mut(PIECE).enumerate().for_each(|(piece, values)| {
        let mut x = (seed ^ (piece as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for v in values {
            // xorshift64*: fast and plenty for benchmark weights.
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let r = (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
            *v = convert((2.0 * r - 1.0) * scale);
        }
    });
    values
}
