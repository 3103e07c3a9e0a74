//! Depthwise causal conv1d followed by SiLU, over a window of `T` tokens, carrying the last
//! `K - 1` inputs of each row as its conv state (token-major: `[B, K - 1, C]`).
//!
//! `y[t, c] = silu(sum_j w[c, j] * x'[t + j, c])` where `x' = concat(state, x)` along time.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::{cpu_f32, Result};

/// `x` `[B, T, C]`, `state` `[B, K-1, C]`, `weight` `[C, K]`. Returns `(y [B, T, C], new_state)`,
/// both in `x`'s dtype; the arithmetic is f32.
pub fn causal_conv1d_silu(x: &Tensor, state: &Tensor, weight: &Tensor) -> Result<(Tensor, Tensor)> {
    match x.device() {
        Device::Cpu => cpu(x, state, weight),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) if gpu::takes(x, state, weight)? => gpu::run(x, state, weight),
        _ => reference(x, state, weight),
    }
}

/// [`causal_conv1d_silu`] of one token per row (`x` `[B, 1, C]`) writing the new window over
/// `state` (contiguous) instead of to fresh memory, for a recorded decode step whose buffers stay
/// put; returns the output. With `slots` (`[B]` i32, device), `state` is a pool `[S, K-1, C]` and
/// row `b`'s window is `state[slots[b]]`; without, `state` is `[B, K-1, C]`. The caller must be
/// the state's only holder. CUDA only; the same sums as [`causal_conv1d_silu`] there.
#[cfg(feature = "cuda")]
pub fn causal_conv1d_silu_step_in_place(x: &Tensor, state: &Tensor, weight: &Tensor, slots: Option<&Tensor>) -> Result<Tensor> {
    let (b, t, c) = x.dims3()?;
    let kernel = weight.dim(1)?;
    let rows_fit = match slots {
        Some(slots) => {
            slots.dims() == [b] && slots.dtype() == candle_core::DType::I32 && state.dims().get(1..) == Some(&[kernel - 1, c][..])
        }
        None => state.dims() == [b, kernel - 1, c],
    };
    if !x.device().is_cuda()
        || !gpu::takes(x, state, weight)?
        || t != 1
        || !state.is_contiguous()
        || !rows_fit
        || kernel > gpu::MAX_KERNEL
    {
        candle_core::bail!(
            "the in-place conv step takes one CUDA token per row, a contiguous window and a kernel of at most {} taps",
            gpu::MAX_KERNEL
        );
    }
    gpu::step_in_place(x, state, weight, slots)
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::{DType, Tensor};

    use crate::cuda::{self, Arg};
    use crate::Result;

    /// The widest conv the kernels hold in registers (cuda/recurrent.cu's `MAX_CONV_KERNEL`),
    /// and the run of tokens one thread of the window kernel computes (`CONV_TOKENS`).
    pub(super) const MAX_KERNEL: usize = 8;
    const RUN: usize = 16;

    pub(super) fn takes(x: &Tensor, state: &Tensor, weight: &Tensor) -> Result<bool> {
        let kernel = weight.dim(1)?;
        Ok(cuda::supports(x.dtype()) && state.dtype() == x.dtype() && (1..=MAX_KERNEL).contains(&kernel))
    }

    /// One thread per (row, run of RUN tokens, channel), the channels fastest.
    pub(super) fn run(x: &Tensor, state: &Tensor, weight: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, t, c) = x.dims3()?;
        let kernel = weight.dim(1)?;
        let (x, x_stride) = cuda::row_strided(x)?;
        let (state, weight) = (state.contiguous()?, weight.to_dtype(DType::F32)?.contiguous()?);
        let y = cuda::output((b, t, c), x.dtype(), x.device())?;
        let new_state = cuda::output((b, kernel - 1, c), x.dtype(), x.device())?;
        if b * c == 0 {
            return Ok((y, new_state)); // both outputs are empty
        }
        let args = [
            Arg::at(&x)?,
            Arg::I64(x_stride as i64),
            Arg::at(&state)?,
            Arg::at(&weight)?,
            Arg::at(&y)?,
            Arg::at(&new_state)?,
            Arg::dim(b)?,
            Arg::dim(t)?,
            Arg::dim(c)?,
            Arg::dim(kernel)?,
        ];
        cuda::launch(
            x.device(),
            &cuda::RECURRENT,
            "causal_conv1d_silu",
            x.dtype(),
            cuda::grid_for(b * t.max(kernel - 1).div_ceil(RUN) * c.div_ceil(256) * 256, 256)?,
            &args,
        )?;
        Ok((y, new_state))
    }

    /// One thread per (row, channel).
    pub(super) fn step_in_place(x: &Tensor, state: &Tensor, weight: &Tensor, slots: Option<&Tensor>) -> Result<Tensor> {
        let (b, _, c) = x.dims3()?;
        let kernel = weight.dim(1)?;
        let (x, x_stride) = cuda::row_strided(x)?;
        let weight = weight.to_dtype(DType::F32)?.contiguous()?;
        let y = cuda::output((b, 1, c), x.dtype(), x.device())?;
        let args = [
            Arg::at(&x)?,
            Arg::I64(x_stride as i64),
            Arg::at(state)?,
            Arg::at_or_null(slots)?,
            Arg::at(&weight)?,
            Arg::at(&y)?,
            Arg::dim(b)?,
            Arg::dim(c)?,
            Arg::dim(kernel)?,
        ];
        cuda::launch(x.device(), &cuda::RECURRENT, "causal_conv1d_silu_step", x.dtype(), cuda::grid_rows(b, c, 256)?, &args)?;
        Ok(y)
    }
}

/// The slow twin, from tensor ops; runs on any device.
pub fn reference(x: &Tensor, state: &Tensor, weight: &Tensor) -> Result<(Tensor, Tensor)> {
    let dtype = x.dtype();
    let (_, t_len, _) = x.dims3()?;
    let kernel = weight.dim(1)?;
    let xx = Tensor::cat(&[state.to_dtype(DType::F32)?, x.to_dtype(DType::F32)?], 1)?;
    let w = weight.to_dtype(DType::F32)?;
    let mut acc = xx.narrow(1, 0, t_len)?.broadcast_mul(&w.narrow(1, 0, 1)?.squeeze(1)?)?;
    for j in 1..kernel {
        acc = (acc + xx.narrow(1, j, t_len)?.broadcast_mul(&w.narrow(1, j, 1)?.squeeze(1)?)?)?;
    }
    let y = (&acc * (acc.neg()?.exp()? + 1.0)?.recip()?)?;
    let new_state = xx.narrow(1, t_len, kernel - 1)?;
    Ok((y.to_dtype(dtype)?, new_state.to_dtype(state.dtype())?))
}

fn cpu(x: &Tensor, state: &Tensor, weight: &Tensor) -> Result<(Tensor, Tensor)> {
    let (bsz, t_len, c) = x.dims3()?;
    let kernel = weight.dim(1)?;
    let hist = kernel - 1;
    let xd = cpu_f32(x)?;
    let sd = cpu_f32(state)?;
    let w = cpu_f32(weight)?;
    let mut y = vec![0f32; bsz * t_len * c];
    let mut new_state = vec![0f32; bsz * hist * c];
    // Row of the concatenated window [state; x] at time index i.
    let window = |row: usize, i: usize| -> &[f32] {
        if i < hist {
            &sd[(row * hist + i) * c..(row * hist + i + 1) * c]
        } else {
            &xd[(row * t_len + i - hist) * c..(row * t_len + i - hist + 1) * c]
        }
    };
    y.par_chunks_mut(c).enumerate().for_each(|(bt, out)| {
        let (row, t) = (bt / t_len, bt % t_len);
        for j in 0..kernel {
            let src = window(row, t + j);
            for ch in 0..c {
                out[ch] += w[ch * kernel + j] * src[ch];
            }
        }
        for v in out.iter_mut() {
            *v /= 1.0 + (-*v).exp();
        }
    });
    for row in 0..bsz {
        for i in 0..hist {
            new_state[(row * hist + i) * c..(row * hist + i + 1) * c].copy_from_slice(window(row, t_len + i));
        }
    }
    let dev = x.device();
    Ok((
        Tensor::from_vec(y, (bsz, t_len, c), dev)?.to_dtype(x.dtype())?,
        Tensor::from_vec(new_state, (bsz, hist, c), dev)?.to_dtype(state.dtype())?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_path_matches_reference_and_splits() {
        let dev = Device::Cpu;
        let (b, t, c, k) = (2, 9, 6, 4);
        let ramp = |n: usize, s: f32| (0..n).map(|i| (i as f32 * 0.37 + s).sin()).collect::<Vec<_>>();
        let x = Tensor::from_vec(ramp(b * t * c, 0.1), (b, t, c), &dev).unwrap();
        let s0 = Tensor::from_vec(ramp(b * (k - 1) * c, 0.7), (b, k - 1, c), &dev).unwrap();
        let w = Tensor::from_vec(ramp(c * k, 1.3), (c, k), &dev).unwrap();
        let (y1, n1) = reference(&x, &s0, &w).unwrap();
        let (y2, n2) = cpu(&x, &s0, &w).unwrap();
        let diff = |a: &Tensor, b: &Tensor| -> f32 {
            (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
        };
        assert!(diff(&y1, &y2) < 1e-6);
        assert_eq!(diff(&n1, &n2), 0.0);
        // Token by token through the state gives the same as the window at once, and a window
        // shorter than the kernel keeps the right history.
        let mut s = s0.clone();
        let mut ys = vec![];
        for i in 0..t {
            let (yi, si) = cpu(&x.narrow(1, i, 1).unwrap(), &s, &w).unwrap();
            ys.push(yi);
            s = si;
        }
        assert!(diff(&Tensor::cat(&ys, 1).unwrap(), &y2) < 1e-6);
        assert_eq!(diff(&s, &n2), 0.0);
    }
}
