//! Plain RMSNorm, as Llama and Qwen2/3 use it: `w * rmsnorm(x)` (not Qwen3.5's `1 + w`).

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::source::WeightSource;

pub struct RmsNorm {
    /// In the model dtype, as transformers keeps it.
    weight: Tensor,
    /// All ones (f32): the fused normaliser's own scale, so `weight` is applied after rounding.
    ones: Tensor,
    eps: f32,
}

impl RmsNorm {
    pub fn load(src: &dyn WeightSource, name: &str, dim: usize, eps: f64, dtype: DType) -> Result<Self> {
        let weight = src.get(&format!("{name}.weight"), &[dim], dtype)?;
        let ones = Tensor::ones(dim, DType::F32, src.device())?;
        Ok(Self { weight, ones, eps: eps as f32 })
    }

    /// Normalises in f32, rounds to `x`'s dtype, then scales: transformers' order, so half
    /// precision rounds where it does.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let normed = candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?.contiguous()?, &self.ones, self.eps)?;
        Ok(normed.to_dtype(x.dtype())?.broadcast_mul(&self.weight)?)
    }
}

/// The weight, in the model dtype, is the scale: rescaled by powers of two it stays exact.
impl crate::smoothing::ChannelNorm for RmsNorm {
    fn scale(&self) -> &Tensor {
        &self.weight
    }

    fn rescaled(&self, factors: &Tensor) -> Result<RmsNorm> {
        let weight = (self.weight.to_dtype(DType::F32)? * factors)?.to_dtype(self.weight.dtype())?;
        Ok(Self { weight, ones: self.ones.clone(), eps: self.eps })
    }
}
