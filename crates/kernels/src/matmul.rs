//! `x W^T` for a few rows against bf16 weights on CPU — the decode-time case, where the cost is
//! reading the weights once. candle's CPU bf16 matmul is not vectorised for it; this reads each
//! weight row once, widens bf16 to f32 (a 16-bit shift the compiler vectorises) and accumulates
//! in f32, parallel over output features.

use candle_core::{DType, Device, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::Result;

/// Rows up to which [`matmul_t`] takes the weight-streaming path.
pub const MAX_STREAMED_ROWS: usize = 8;

/// `x` `[M, K]`, `w` `[N, K]` → `[M, N]` in `x`'s dtype. Uses the streaming path for bf16
/// weights on CPU when `M <= MAX_STREAMED_ROWS`, and candle's matmul otherwise.
pub fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, _) = x.dims2()?;
    if matches!(x.device(), Device::Cpu) && w.dtype() == DType::BF16 && m <= MAX_STREAMED_ROWS && w.is_contiguous() {
        return streamed(x, w);
    }
    x.matmul(&w.t()?)
}

fn streamed(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let n = w.dim(0)?;
    let xs = crate::cpu_f32(x)?;
    let (storage, layout) = w.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else { unreachable!("checked CPU above") };
    let all: &[bf16] = cpu.as_slice::<bf16>()?;
    let ws = &all[layout.start_offset()..layout.start_offset() + n * k];
    let mut out = vec![0f32; m * n];
    // out is [M, N]; compute it transposed per output feature, then scatter.
    let cols: Vec<[f32; MAX_STREAMED_ROWS]> = ws
        .par_chunks(k)
        .map(|row| {
            let mut acc = [0f32; MAX_STREAMED_ROWS];
            for (r, a) in acc.iter_mut().enumerate().take(m) {
                *a = dot(row, &xs[r * k..(r + 1) * k]);
            }
            acc
        })
        .collect();
    for (j, col) in cols.iter().enumerate() {
        for r in 0..m {
            out[r * n + j] = col[r];
        }
    }
    Tensor::from_vec(out, (m, n), x.device())?.to_dtype(x.dtype())
}

fn dot(w: &[bf16], x: &[f32]) -> f32 {
    // Eight independent accumulators let the loop vectorise.
    let mut acc = [0f32; 8];
    let chunks = w.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            let i = c * 8 + l;
            acc[l] += f32::from_bits((w[i].to_bits() as u32) << 16) * x[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..w.len() {
        s += w[i].to_f32() * x[i];
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_matches_candle_matmul() {
        let dev = Device::Cpu;
        for (m, k, n) in [(1, 64, 10), (3, 37, 5), (8, 128, 33)] {
            let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.13).sin()).collect();
            let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.07).cos()).collect();
            let x = Tensor::from_vec(x, (m, k), &dev).unwrap();
            let w = Tensor::from_vec(w, (n, k), &dev).unwrap().to_dtype(DType::BF16).unwrap();
            let want = x.matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap();
            let got = matmul_t(&x, &w).unwrap();
            let d: f32 = (want - got).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap();
            assert!(d < 1e-4, "{m}x{k}x{n}: {d}");
        }
    }
}
