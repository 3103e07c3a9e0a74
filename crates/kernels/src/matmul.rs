//! `x W^T` for a few rows on CPU — the decode-time case, where the cost is reading the weights
//! once. Each weight row is read once for all input rows (bf16 widened to f32 in registers, a
//! 16-bit shift the compiler vectorises), parallel over output features.
//!
//! Every output element is one [`dot`] over K whatever the number of rows, so a row's result is
//! bit-identical whether it is decoded alone or in a batch: continuous batching then changes no
//! token, even under seeded sampling. (candle's CPU bf16 matmul is also not vectorised for a
//! handful of rows; this path is several times faster there.)

use candle_core::{DType, Device, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::Result;

/// Rows up to which [`matmul_t`] streams: a decode batch, and a speculative verify forward
/// (rows × (drafts + 1)), whose positions must compute exactly as they would one at a time for
/// rollback and acceptance to be exact. (candle's matmul is somewhat faster for 17–64-row
/// prefill chunks; exactness wins.) The input rows stay in cache up to here.
pub const MAX_EXACT_ROWS: usize = 64;

/// `x` `[M, K]`, `w` `[N, K]` → `[M, N]` in `x`'s dtype. On CUDA the streaming kernel reads
/// the first weights before waiting for the kernel launched before it (cuda/matmul.cu), so `w`
/// must not be that kernel's output (weights never are). Streams the weights for f32 and bf16
/// on CPU when `M <= MAX_EXACT_ROWS`, and on CUDA for up to 4 rows (strata's kernel in
/// cuda/matmul.cu; past a few rows its re-reads of the inputs make it slower than cuBLAS, as
/// commit c4ccd01 records); candle's matmul otherwise.
pub fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, _) = x.dims2()?;
    if matches!(x.device(), Device::Cpu) && m <= MAX_EXACT_ROWS && w.is_contiguous() {
        match w.dtype() {
            DType::BF16 => return streamed::<bf16>(x, w),
            DType::F32 => return streamed::<f32>(x, w),
            _ => {}
        }
    }
    #[cfg(feature = "cuda")]
    if let Some(y) = gpu::matmul_rows(x, w)? {
        return Ok(y);
    }
    x.matmul(&w.t()?)
}

/// [`matmul_t`] with every row computed as it is among at most [`MAX_EXACT_ROWS`] rows: past
/// them on CPU, the streaming kernel runs over slices of rows, where each output is one [`dot`]
/// whatever the slice. A forward of many sequences, each a few positions long (a decode batch
/// of hundreds of rows, prompts prefilled together), so gives each sequence the bits it gets
/// alone.
pub fn matmul_t_rowwise(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, _) = x.dims2()?;
    if m <= MAX_EXACT_ROWS || !matches!(x.device(), Device::Cpu) {
        return matmul_t(x, w);
    }
    let slices = (0..m)
        .step_by(MAX_EXACT_ROWS)
        .map(|at| matmul_t(&x.narrow(0, at, MAX_EXACT_ROWS.min(m - at))?, w))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&slices, 0)?)
}

#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::Tensor;

    use crate::cuda::{self, Arg};
    use crate::Result;

    /// Input rows the kernel takes (cuda/matmul.cu's `MAX_INPUT_ROWS`), and its warps per
    /// block, `split` of them per weight row.
    const MAX_INPUT_ROWS: usize = 4;
    const WARPS: usize = 4;

    /// The kernel for `m` input rows and `n` weight rows, and its warps per weight row: two,
    /// which measured ahead of one and four on every matrix of the 4B shape on an H200 (2560 to
    /// 248K rows; figures in commit 590ec36's message); four below 2048 rows, where two would
    /// make at most 1024 blocks of loads in flight — a guess for the smaller shapes' narrow
    /// matrices (the 0.8B shape's have 1024 rows), not measured.
    fn kernel_for(m: usize, n: usize) -> (&'static str, usize) {
        const TWO: [&str; MAX_INPUT_ROWS] = ["matmul_rows1_s2", "matmul_rows2_s2", "matmul_rows3_s2", "matmul_rows4_s2"];
        const FOUR: [&str; MAX_INPUT_ROWS] = ["matmul_rows1_s4", "matmul_rows2_s4", "matmul_rows3_s4", "matmul_rows4_s4"];
        match warps_per_row(n) {
            4 => (FOUR[m - 1], 4),
            _ => (TWO[m - 1], 2),
        }
    }

    /// Warps per weight row for `n` weight rows: also the gathered experts' kernel's
    /// (crate::experts), whose pairs so get the bits of this kernel's rows.
    pub(crate) fn warps_per_row(n: usize) -> usize {
        if n < 2048 {
            4
        } else {
            2
        }
    }

    /// `x W^T` by strata's streaming kernel, or `None` where it does not apply: more rows than
    /// it takes, another dtype, or a layout other than rows in whole 16-byte pieces.
    pub(super) fn matmul_rows(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
        let ((m, k), n) = (x.dims2()?, w.dim(0)?);
        let dtype = x.dtype();
        let vec = 16 / dtype.size_in_bytes();
        if !x.device().is_cuda()
            || m > MAX_INPUT_ROWS
            || !cuda::supports(dtype)
            || w.dtype() != dtype
            || !w.is_contiguous()
            || !w.device().same_device(x.device())
            || k % vec != 0
        {
            return Ok(None);
        }
        if m == 0 || n == 0 {
            return Ok(Some(cuda::output((m, n), dtype, x.device())?));
        }
        let (x, x_stride) = cuda::row_strided(x)?;
        if !cuda::in_pieces(&x, x_stride)? || !cuda::in_pieces(w, k)? {
            return Ok(None);
        }
        let (kernel, split) = kernel_for(m, n);
        let y = cuda::output((m, n), dtype, x.device())?;
        let blocks = u32::try_from((n * split).div_ceil(WARPS))
            .map_err(|_| candle_core::Error::Msg(format!("{n} weight rows exceed a CUDA grid")))?;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: ((WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        let args = [Arg::at(&x)?, Arg::I64(x_stride as i64), Arg::at(w)?, Arg::at(&y)?, Arg::dim(k)?, Arg::dim(n)?];
        cuda::launch(x.device(), &cuda::MATMUL, kernel, dtype, cfg, &args)?;
        Ok(Some(y))
    }
}

/// A stored element widened to f32 for accumulation.
pub(crate) trait Widen: candle_core::WithDType {
    fn widen(self) -> f32;
}

impl Widen for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

fn streamed<W: Widen>(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let n = w.dim(0)?;
    let xs = crate::cpu_f32(x)?;
    let (storage, layout) = w.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else { unreachable!("checked CPU above") };
    let all: &[W] = cpu.as_slice::<W>()?;
    let ws = &all[layout.start_offset()..layout.start_offset() + n * k];
    // Computed as [N, M] (a block of weight rows per task), then laid out as [M, N].
    let mut out_t = vec![0f32; n * m];
    let kernel = kernel_for_cpu::<W>();
    out_t.par_chunks_mut(m * WEIGHT_BLOCK).zip(ws.par_chunks(k * WEIGHT_BLOCK)).for_each(|(o, rows)| kernel(rows, k, &xs, o));
    let out = if m == 1 {
        out_t
    } else {
        let mut out = vec![0f32; m * n];
        for (j, col) in out_t.chunks(m).enumerate() {
            for (r, v) in col.iter().enumerate() {
                out[r * n + j] = *v;
            }
        }
        out
    };
    Tensor::from_vec(out, (m, n), x.device())?.to_dtype(x.dtype())
}

/// The per-block kernel for this CPU: the same code compiled for AVX2 + FMA when the CPU has
/// them (the crate is built for baseline x86-64, which has neither). Chosen once per call, so
/// every row of a matmul uses the same code.
fn kernel_for_cpu<W: Widen>() -> fn(&[W], usize, &[f32], &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        return |w, k, xs, out| {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            unsafe { weight_block_avx2(w, k, xs, out) }
        };
    }
    weight_block
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weight_block_avx2<W: Widen>(w: &[W], k: usize, xs: &[f32], out: &mut [f32]) {
    weight_block(w, k, xs, out)
}

/// Weight rows per task: each pair of input rows is read once for the whole block (from L1)
/// instead of once per weight row, which keeps many-row calls (speculative verify forwards,
/// short prefill chunks) from being bound by re-reading the inputs.
const WEIGHT_BLOCK: usize = 8;

/// Accumulator lanes per input row: four 8-lane vectors, enough to hide the add latency.
const LANES: usize = 32;

/// `out[j * M + r] = w_j · xs[r]` for the block's weight rows `w_j` and every input row `r`,
/// two input rows at a time so each widened weight chunk serves both from registers. A row's
/// arithmetic is the same sequence whether it is paired or alone and whatever the block (lane
/// accumulators over the chunks in order, lanes summed in order, then the tail), so its result
/// does not depend on the batch around it.
#[inline(always)]
fn weight_block<W: Widen>(ws: &[W], k: usize, xs: &[f32], out: &mut [f32]) {
    let (m, rows) = (xs.len() / k, ws.len() / k);
    let weight = |j: usize| &ws[j * k..(j + 1) * k];
    let mut r = 0;
    while r + 2 <= m {
        let (x0, x1) = (&xs[r * k..(r + 1) * k], &xs[(r + 1) * k..(r + 2) * k]);
        for j in 0..rows {
            (out[j * m + r], out[j * m + r + 1]) = dot2(weight(j), x0, x1);
        }
        r += 2;
    }
    if r < m {
        let x0 = &xs[r * k..(r + 1) * k];
        for j in 0..rows {
            out[j * m + r] = dot1(weight(j), x0);
        }
    }
}

/// `(w · x0, w · x1)`, each exactly as [`dot1`] computes it.
#[inline(always)]
fn dot2<W: Widen>(w: &[W], x0: &[f32], x1: &[f32]) -> (f32, f32) {
    let (mut a0, mut a1) = ([0f32; LANES], [0f32; LANES]);
    for ((wc, c0), c1) in w.chunks_exact(LANES).zip(x0.chunks_exact(LANES)).zip(x1.chunks_exact(LANES)) {
        for l in 0..LANES {
            let wv = wc[l].widen();
            a0[l] += wv * c0[l];
            a1[l] += wv * c1[l];
        }
    }
    (reduce(&a0, w, x0), reduce(&a1, w, x1))
}

/// `w · x0`: lane accumulators over the chunks in order, then [`reduce`] (a fixed order).
#[inline(always)]
pub(crate) fn dot1<W: Widen>(w: &[W], x0: &[f32]) -> f32 {
    let mut a0 = [0f32; LANES];
    for (wc, c0) in w.chunks_exact(LANES).zip(x0.chunks_exact(LANES)) {
        for l in 0..LANES {
            a0[l] += wc[l].widen() * c0[l];
        }
    }
    reduce(&a0, w, x0)
}

/// Lanes summed in order, then the tail past the last whole chunk.
#[inline(always)]
fn reduce<W: Widen>(acc: &[f32; LANES], w: &[W], x: &[f32]) -> f32 {
    let mut s: f32 = acc.iter().sum();
    for i in (w.len() / LANES) * LANES..w.len() {
        s += w[i].widen() * x[i];
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_matches_candle_matmul() {
        let dev = Device::Cpu;
        for dtype in [DType::BF16, DType::F32] {
            for (m, k, n) in [(1, 64, 10), (3, 37, 5), (8, 128, 33), (16, 100, 7), (41, 96, 19), (64, 64, 8)] {
                let x: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.13).sin()).collect();
                let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.07).cos()).collect();
                let x = Tensor::from_vec(x, (m, k), &dev).unwrap();
                let w = Tensor::from_vec(w, (n, k), &dev).unwrap().to_dtype(dtype).unwrap();
                let want = x.matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap();
                let got = matmul_t(&x, &w).unwrap();
                let d: f32 = (want - &got).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap();
                assert!(d < 1e-4, "{dtype:?} {m}x{k}x{n}: {d}");
                // Each row alone gives bit-identical results to the batch.
                for r in 0..m {
                    let alone = matmul_t(&x.narrow(0, r, 1).unwrap(), &w).unwrap();
                    assert_eq!(
                        alone.squeeze(0).unwrap().to_vec1::<f32>().unwrap(),
                        got.get(r).unwrap().to_vec1::<f32>().unwrap()
                    );
                }
            }
        }
    }
}
