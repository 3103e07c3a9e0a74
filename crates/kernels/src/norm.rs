//! RMS normalisations and the SwiGLU product. On CUDA each is one fused kernel; elsewhere the
//! same arithmetic from tensor ops (f32 inside, intermediates rounded to the model dtype where
//! transformers stores them in it).

use candle_core::{DType, Tensor};

use crate::Result;

/// `x · rsqrt(mean(x²) + eps) · scale` over the last dim, in f32; `scale` f32 `[D]`. Returns
/// `x`'s dtype.
pub fn rms_norm(x: &Tensor, scale: &Tensor, eps: f32) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = gpu::rms_norm(x, scale, eps)? {
        return Ok(y);
    }
    candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?.contiguous()?, scale, eps)?.to_dtype(x.dtype())
}

/// A residual add and the norm after it: `(x + h, rms_norm(x + h))`, the sum in `x`'s dtype.
pub fn add_rms_norm(x: &Tensor, h: &Tensor, scale: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if let Some(pair) = gpu::add_rms_norm(x, h, scale, eps)? {
        return Ok(pair);
    }
    let sum = (x + h)?;
    let normed = rms_norm(&sum, scale, eps)?;
    Ok((sum, normed))
}

/// The Gated DeltaNet output norm per head: `x` (f32 `[.., H, D]`, rounded to `gate`'s dtype
/// first) normalised, rounded again, times `weight` (f32 `[D]`; the product rounded again) and
/// `silu(gate)`; in `gate`'s dtype, shaped like `x`. `gate` holds the same elements as `[.., H·D]` or `[.., H, D]`.
pub fn gated_rms_norm(x: &Tensor, gate: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = gpu::gated_rms_norm(x, gate, weight, eps)? {
        return Ok(y);
    }
    let dtype = gate.dtype();
    let gate = gate.reshape(x.shape())?;
    let rounded = x.to_dtype(dtype)?.to_dtype(DType::F32)?.contiguous()?;
    let ones = Tensor::ones(weight.shape(), DType::F32, x.device())?;
    let normed = candle_nn::ops::rms_norm(&rounded, &ones, eps)?;
    // transformers multiplies the weight in the model dtype: the product is rounded to it too.
    let normed = normed.to_dtype(dtype)?.to_dtype(DType::F32)?.broadcast_mul(weight)?.to_dtype(dtype)?.to_dtype(DType::F32)?;
    let gate = candle_nn::ops::silu(&gate.to_dtype(DType::F32)?)?;
    (normed * gate)?.to_dtype(dtype)
}

/// `silu(gate) · up`, elementwise, in their dtype.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = gpu::silu_mul(gate, up)? {
        return Ok(y);
    }
    candle_nn::ops::silu(gate)? * up
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::{DType, Tensor};

    use crate::cuda::{self, Arg};
    use crate::Result;

    /// Whether the fused kernels can take these tensors (all on one CUDA device, a float dtype).
    fn on_cuda(first: &Tensor, others: &[&Tensor]) -> bool {
        first.device().is_cuda() && cuda::supports(first.dtype()) && others.iter().all(|t| t.device().same_device(first.device()))
    }

    const WARPS: u32 = 4;

    /// `rows` rows, one warp each.
    fn per_row(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((rows as u32).div_ceil(WARPS).max(1), 1, 1),
            block_dim: (32 * WARPS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn rows_and_dim(x: &Tensor) -> Result<(usize, usize)> {
        let d = x.dims().last().copied().unwrap_or(1);
        Ok((x.elem_count() / d.max(1), d))
    }

    fn f32_param(t: &Tensor) -> Result<Tensor> {
        t.to_dtype(DType::F32)?.contiguous()
    }

    pub(super) fn rms_norm(x: &Tensor, scale: &Tensor, eps: f32) -> Result<Option<Tensor>> {
        if !on_cuda(x, &[scale]) {
            return Ok(None);
        }
        let (x, scale) = (x.contiguous()?, f32_param(scale)?);
        let (rows, d) = rows_and_dim(&x)?;
        let y = cuda::output(x.shape(), x.dtype(), x.device())?;
        let args = [Arg::at(&x)?, Arg::at(&scale)?, Arg::at(&y)?, Arg::dim(rows)?, Arg::dim(d)?, Arg::F32(eps)];
        cuda::launch(x.device(), &cuda::NORM, "rms_norm", x.dtype(), per_row(rows), &args)?;
        Ok(Some(y))
    }

    pub(super) fn add_rms_norm(x: &Tensor, h: &Tensor, scale: &Tensor, eps: f32) -> Result<Option<(Tensor, Tensor)>> {
        if !on_cuda(x, &[h, scale]) || h.dtype() != x.dtype() || h.shape() != x.shape() {
            return Ok(None);
        }
        let (x, h, scale) = (x.contiguous()?, h.contiguous()?, f32_param(scale)?);
        let (rows, d) = rows_and_dim(&x)?;
        let sum = cuda::output(x.shape(), x.dtype(), x.device())?;
        let y = cuda::output(x.shape(), x.dtype(), x.device())?;
        let args = [
            Arg::at(&x)?,
            Arg::at(&h)?,
            Arg::at(&scale)?,
            Arg::at(&sum)?,
            Arg::at(&y)?,
            Arg::dim(rows)?,
            Arg::dim(d)?,
            Arg::F32(eps),
        ];
        cuda::launch(x.device(), &cuda::NORM, "add_rms_norm", x.dtype(), per_row(rows), &args)?;
        Ok(Some((sum, y)))
    }

    pub(super) fn gated_rms_norm(x: &Tensor, gate: &Tensor, weight: &Tensor, eps: f32) -> Result<Option<Tensor>> {
        if !on_cuda(gate, &[x, weight]) || x.elem_count() != gate.elem_count() {
            return Ok(None);
        }
        let (x, weight) = (f32_param(x)?, f32_param(weight)?);
        let (rows, d) = rows_and_dim(&x)?;
        // The gate as [tokens, H·D] with its tokens apart.
        let gate_cols = gate.dims().last().copied().unwrap_or(1);
        let gate = if gate_cols % d == 0 { gate.clone() } else { gate.reshape(x.shape())? };
        let (gate, gate_stride) = cuda::row_strided(&gate)?;
        let heads = gate.dims().last().copied().unwrap_or(1) / d;
        let y = cuda::output(x.shape(), gate.dtype(), x.device())?;
        let args = [
            Arg::at(&x)?,
            Arg::at(&gate)?,
            Arg::I64(gate_stride as i64),
            Arg::at(&weight)?,
            Arg::at(&y)?,
            Arg::dim(rows)?,
            Arg::dim(heads)?,
            Arg::dim(d)?,
            Arg::F32(eps),
        ];
        cuda::launch(x.device(), &cuda::NORM, "gated_rms_norm", gate.dtype(), per_row(rows), &args)?;
        Ok(Some(y))
    }

    pub(super) fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
        if !on_cuda(gate, &[up]) || up.dtype() != gate.dtype() || up.shape() != gate.shape() {
            return Ok(None);
        }
        let ((gate, gate_stride), (up, up_stride)) = (cuda::row_strided(gate)?, cuda::row_strided(up)?);
        let (rows, cols) = rows_and_dim(&gate)?;
        let y = cuda::output(gate.shape(), gate.dtype(), gate.device())?;
        let args = [
            Arg::at(&gate)?,
            Arg::I64(gate_stride as i64),
            Arg::at(&up)?,
            Arg::I64(up_stride as i64),
            Arg::at(&y)?,
            Arg::dim(rows)?,
            Arg::dim(cols)?,
        ];
        cuda::launch(gate.device(), &cuda::NORM, "silu_mul", gate.dtype(), cuda::grid_for(rows * cols, 256)?, &args)?;
        Ok(Some(y))
    }
}
