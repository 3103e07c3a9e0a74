//! RMS normalisations and the gated MLP products (SwiGLU, GELU). On CUDA the norms and SwiGLU
//! are one fused kernel each and GELU's product is candle's ops; on CPU GELU's product has its
//! own loop; elsewhere the same arithmetic from tensor ops (f32 inside, intermediates rounded to
//! the model dtype where transformers stores them in it).

use candle_core::{DType, Tensor};
use rayon::prelude::*;

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

/// LayerNorm over the last dimension, `weight` and `bias` `[D]`: `(x - mean) / sqrt(var + eps)
/// · weight + bias` in f32, rounded to `x`'s dtype once. One kernel on CUDA.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some((_, y)) = gpu::layer_norm(x, None, weight, bias, eps)? {
        return Ok(y);
    }
    candle_nn::ops::layer_norm(x, weight, bias, eps)
}

/// A residual add and the LayerNorm after it: `(x + h, layer_norm(x + h))`, the sum in `x`'s
/// dtype.
pub fn add_layer_norm(x: &Tensor, h: &Tensor, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if let Some((Some(sum), y)) = gpu::layer_norm(x, Some(h), weight, bias, eps)? {
        return Ok((sum, y));
    }
    let sum = (x + h)?;
    let normed = layer_norm(&sum, weight, bias, eps)?;
    Ok((sum, normed))
}

/// What a projection's output goes through after its bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Identity,
    /// GELU, tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
    /// GELU, exact (erf).
    GeluErf,
}

/// `act(x + bias)`, `bias` `[cols]` for `x` `[.., cols]`: the sum rounded to `x`'s dtype, the
/// activation in f32 rounded once on CUDA (one kernel), candle's ops elsewhere.
pub fn add_bias_act(x: &Tensor, bias: &Tensor, act: Activation) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = gpu::add_bias_act(x, bias, act)? {
        return Ok(y);
    }
    let sum = x.broadcast_add(bias)?;
    match act {
        Activation::Identity => Ok(sum),
        Activation::GeluTanh => sum.gelu(),
        Activation::GeluErf => sum.gelu_erf(),
    }
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

/// `gelu(gate) · up`, elementwise, in their dtype, with transformers' `gelu_pytorch_tanh`
/// (`gate` rounded to the dtype after the activation, as there). On CPU in f32 as
/// [`gelu_tanh`], in parallel for long inputs; elsewhere from tensor ops.
pub fn gelu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() != up.shape() {
        candle_core::bail!("gelu_mul: gate {:?} and up {:?} differ in shape", gate.shape(), up.shape());
    }
    if !gate.device().is_cpu() || !up.device().is_cpu() {
        return gate.gelu()? * up;
    }
    // Rounds an activation to the dtype the product is stored in.
    let round: fn(f32) -> f32 = match gate.dtype() {
        DType::BF16 => |v| half::bf16::from_f32(v).to_f32(),
        DType::F16 => |v| half::f16::from_f32(v).to_f32(),
        _ => |v| v,
    };
    let (gates, ups) = (crate::cpu_f32(gate)?, crate::cpu_f32(up)?);
    let mut out = vec![0f32; gates.len()];
    const CHUNK: usize = 1 << 14;
    out.par_chunks_mut(CHUNK).zip(gates.par_chunks(CHUNK).zip(ups.par_chunks(CHUNK))).for_each(|(out, (gates, ups))| {
        for ((o, &g), &u) in out.iter_mut().zip(gates).zip(ups) {
            *o = round(gelu_tanh(g)) * u;
        }
    });
    Tensor::from_vec(out, gate.shape(), gate.device())?.to_dtype(gate.dtype())
}

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, written as `x · sigmoid(2·inner)`: the same
/// function with one `exp` instead of a `tanh` (glibc's `tanhf` stood out in a `perf` profile
/// of Gemma 3 270M's decode), and no cancellation in `1 + tanh` for negative inputs.
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    x / (1.0 + (-2.0 * inner).exp())
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::{DType, Tensor};

    use super::Activation;
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

    /// Items per thread of a row block (cuda/norm.cu's `MAX_ROW_ITEMS`).
    const MAX_ROW_ITEMS: usize = 16;
    /// Items per lane of a per-head norm's warp (cuda/norm.cu's `MAX_HEAD_ITEMS`).
    const MAX_HEAD_ITEMS: usize = 8;

    /// Threads of the block that takes a row of `d` (about four items each), `None` for rows too
    /// wide for a block.
    fn row_block(d: usize) -> Option<usize> {
        let threads = d.div_ceil(4).next_multiple_of(32).clamp(32, 1024);
        (d <= MAX_ROW_ITEMS * threads).then_some(threads)
    }

    fn rows_and_dim(x: &Tensor) -> Result<(usize, usize)> {
        let d = x.dims().last().copied().unwrap_or(1);
        Ok((x.elem_count() / d.max(1), d))
    }

    fn f32_param(t: &Tensor) -> Result<Tensor> {
        t.to_dtype(DType::F32)?.contiguous()
    }

    /// The row block of a model-width norm over rows of `d` whose inputs are `inputs`: its
    /// threads and whether they move 16-byte pieces (every row 16-byte aligned), `None` for rows
    /// too wide for a block.
    fn norm_block(d: usize, inputs: &[&Tensor]) -> Result<Option<(usize, bool)>> {
        let vec = 16 / inputs[0].dtype().size_in_bytes();
        let mut aligned = true;
        for t in inputs {
            aligned &= cuda::in_pieces(t, d)?;
        }
        let pieces = d / vec;
        let by_pieces = (pieces.next_multiple_of(32).clamp(32, 1024), true);
        Ok(if aligned && pieces <= MAX_ROW_ITEMS / vec * by_pieces.0 {
            Some(by_pieces)
        } else {
            row_block(d).map(|t| (t, false))
        })
    }

    pub(super) fn rms_norm(x: &Tensor, scale: &Tensor, eps: f32) -> Result<Option<Tensor>> {
        Ok(row_norm(x, None, scale, None, eps)?.map(|(_, y)| y))
    }

    pub(super) fn add_rms_norm(x: &Tensor, h: &Tensor, scale: &Tensor, eps: f32) -> Result<Option<(Tensor, Tensor)>> {
        Ok(row_norm(x, Some(h), scale, None, eps)?.map(|(sum, y)| (sum.expect("a sum with h"), y)))
    }

    /// LayerNorm (`h`: after adding it).
    pub(super) fn layer_norm(
        x: &Tensor,
        h: Option<&Tensor>,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
    ) -> Result<Option<(Option<Tensor>, Tensor)>> {
        row_norm(x, h, weight, Some(bias), eps)
    }

    /// The row norm kernels: RMSNorm (its `scale` taken in f32) or, with a `bias`, LayerNorm
    /// (its parameters taken in `x`'s dtype); with `h`, after the residual add `x + h`, which
    /// they return too.
    fn row_norm(
        x: &Tensor,
        h: Option<&Tensor>,
        scale: &Tensor,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Option<(Option<Tensor>, Tensor)>> {
        let others: Vec<&Tensor> = [Some(scale), h, bias].into_iter().flatten().collect();
        if !on_cuda(x, &others) || h.is_some_and(|h| h.dtype() != x.dtype() || h.shape() != x.shape()) {
            return Ok(None);
        }
        let param = |p: &Tensor| match bias {
            Some(_) => p.to_dtype(x.dtype())?.contiguous(),
            None => f32_param(p),
        };
        let scale = param(scale)?;
        let bias = bias.map(param).transpose()?;
        let (rows, d) = rows_and_dim(x)?;
        let x = x.contiguous()?;
        let h = h.map(Tensor::contiguous).transpose()?;
        let inputs: Vec<&Tensor> = [Some(&x), h.as_ref()].into_iter().flatten().collect();
        let Some((threads, pieces)) = norm_block(d, &inputs)? else { return Ok(None) };
        let sum = h.as_ref().map(|_| cuda::output(x.shape(), x.dtype(), x.device())).transpose()?;
        let y = cuda::output(x.shape(), x.dtype(), x.device())?;
        if rows > 0 {
            let cfg = cuda::grid_rows(rows, threads, threads as u32)?;
            let mut args = vec![Arg::at(&x)?, Arg::at_or_null(h.as_ref())?, Arg::at(&scale)?];
            if let Some(bias) = &bias {
                args.push(Arg::at(bias)?);
            }
            args.extend([Arg::at_or_null(sum.as_ref())?, Arg::at(&y)?, Arg::dim(d)?, Arg::F32(eps), Arg::I32(pieces.into())]);
            let name = if bias.is_some() { "layer_norm" } else { "rms_norm" };
            cuda::launch(x.device(), &cuda::NORM, name, x.dtype(), cfg, &args)?;
        }
        Ok(Some((sum, y)))
    }

    pub(super) fn add_bias_act(x: &Tensor, bias: &Tensor, act: Activation) -> Result<Option<Tensor>> {
        let cols = x.dims().last().copied().unwrap_or(1);
        if !on_cuda(x, &[bias]) || bias.dims() != [cols] {
            return Ok(None);
        }
        let (x, bias) = (x.contiguous()?, bias.to_dtype(x.dtype())?.contiguous()?);
        let rows = x.elem_count() / cols.max(1);
        let y = cuda::output(x.shape(), x.dtype(), x.device())?;
        let vec = 16 / x.dtype().size_in_bytes();
        let pieces = cuda::in_pieces(&x, cols)? && cuda::in_pieces(&bias, 0)? && cuda::in_pieces(&y, cols)?;
        let act = match act {
            Activation::Identity => 0,
            Activation::GeluTanh => 1,
            Activation::GeluErf => 2,
        };
        let args = [
            Arg::at(&x)?,
            Arg::at(&bias)?,
            Arg::at(&y)?,
            Arg::dim(rows)?,
            Arg::dim(cols)?,
            Arg::I32(act),
            Arg::I32(pieces.into()),
        ];
        if rows > 0 {
            cuda::launch(x.device(), &cuda::NORM, "bias_act", x.dtype(), cuda::grid_rows(rows, cols.div_ceil(vec), 256)?, &args)?;
        }
        Ok(Some(y))
    }

    pub(super) fn gated_rms_norm(x: &Tensor, gate: &Tensor, weight: &Tensor, eps: f32) -> Result<Option<Tensor>> {
        if !on_cuda(gate, &[x, weight]) || x.elem_count() != gate.elem_count() {
            return Ok(None);
        }
        let (x, weight) = (f32_param(x)?, f32_param(weight)?);
        let (rows, d) = rows_and_dim(&x)?;
        if d > MAX_HEAD_ITEMS * 32 {
            return Ok(None);
        }
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
        // Each thread takes a 16-byte piece of a row: one load per input where every row starts
        // 16-byte aligned.
        let vec = 16 / gate.dtype().size_in_bytes();
        let pieces = cuda::in_pieces(&gate, gate_stride)? && cuda::in_pieces(&up, up_stride)? && cuda::in_pieces(&y, cols)?;
        let args = [
            Arg::at(&gate)?,
            Arg::I64(gate_stride as i64),
            Arg::at(&up)?,
            Arg::I64(up_stride as i64),
            Arg::at(&y)?,
            Arg::dim(rows)?,
            Arg::dim(cols)?,
            Arg::I32(pieces.into()),
        ];
        let grid = cuda::grid_rows(rows, cols.div_ceil(vec), 256)?;
        cuda::launch(gate.device(), &cuda::NORM, "silu_mul", gate.dtype(), grid, &args)?;
        Ok(Some(y))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    fn ramp(n: usize, from: f32, to: f32) -> Vec<f32> {
        (0..n).map(|i| from + (to - from) * i as f32 / (n - 1) as f32).collect()
    }

    /// Against the textbook formula in f64 (the oracle's `gelu_pytorch_tanh`), over the range
    /// activations reach and past where the sigmoid saturates; long enough to run in chunks.
    #[test]
    fn gelu_mul_matches_the_tanh_formula() {
        let n = 40_000;
        let (gate, up) = (ramp(n, -30.0, 30.0), ramp(n, 2.0, -1.0));
        let y =
            gelu_mul(&Tensor::new(gate.as_slice(), &Device::Cpu).unwrap(), &Tensor::new(up.as_slice(), &Device::Cpu).unwrap())
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
        for ((&g, &u), &y) in gate.iter().zip(&up).zip(&y) {
            let (g64, u64) = (g as f64, u as f64);
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (g64 + 0.044715 * g64.powi(3));
            let expected = 0.5 * g64 * (1.0 + inner.tanh()) * u64;
            assert!((y as f64 - expected).abs() <= 1e-6 * expected.abs().max(1e-3), "gelu({g}) * {u}: {y} vs {expected}");
        }
    }

    /// In bf16 the activation is computed in f32 and rounded to bf16 before the product, as
    /// PyTorch does (candle's own bf16 `gelu` rounds every intermediate and differs).
    #[test]
    fn gelu_mul_rounds_the_activation_to_bf16() {
        let bf16 = |v: f64| half::bf16::from_f64(v).to_f64();
        let (gate, up) = ([0.3f32, -1.7, 2.9, 0.01, -4.2], [1.1f32, 0.7, -3.3, 5.0, 0.9]);
        let to_bf16 = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        let y = gelu_mul(&to_bf16(&gate), &to_bf16(&up)).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let y = y.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        for ((&g, &u), &y) in gate.iter().zip(&up).zip(&y) {
            let (g, u) = (bf16(g as f64), bf16(u as f64));
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3));
            assert_eq!(y as f64, bf16(bf16(0.5 * g * (1.0 + inner.tanh())) * u), "gelu({g}) * {u}");
        }
    }

    #[test]
    fn gelu_mul_refuses_mismatched_shapes() {
        let a = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(gelu_mul(&a, &b).is_err());
    }
}
