//! Matrices in llama.cpp's Q8_0 scheme — blocks of 32 signed bytes sharing one scale — and
//! `x W^T` against them on CPU, as llama.cpp computes it: each row of `x` is quantized to Q8_0
//! too, and every block pair contributes `scale_w * scale_x * (integer dot product)`.
//!
//! Weights are held as the raw signed bytes plus one f32 scale per block (converted from the
//! file's f16 once, at load), so the inner loop is pure integer dot products. On x86-64 with AVX2
//! and FMA the dot products use 256-bit byte multiplies; elsewhere a scalar loop computes the same
//! sums. Each output depends only on its own weight row and input row, so results do not depend
//! on how many input rows share a call.

use candle_core::{Device, Result, Tensor};
use half::f16;
use rayon::prelude::*;

/// Values per block.
pub const BLOCK: usize = 32;
/// Bytes of one block in a GGUF file: f16 scale, then 32 signed bytes.
pub const BLOCK_BYTES: usize = 2 + BLOCK;

/// A `[rows, cols]` Q8_0 matrix.
pub struct Q8Matrix {
    rows: usize,
    cols: usize,
    quants: Vec<i8>,
    scales: Vec<f32>,
}

impl Q8Matrix {
    /// From GGUF Q8_0 bytes (`rows * cols / 32` blocks, row-major).
    pub fn from_blocks(rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        let blocks = rows * cols / BLOCK;
        if !cols.is_multiple_of(BLOCK) || bytes.len() != blocks * BLOCK_BYTES {
            candle_core::bail!("Q8_0 data of {} bytes does not hold a [{rows}, {cols}] matrix", bytes.len());
        }
        let mut quants = Vec::with_capacity(rows * cols);
        let mut scales = Vec::with_capacity(blocks);
        for block in bytes.chunks_exact(BLOCK_BYTES) {
            scales.push(f16::from_le_bytes([block[0], block[1]]).to_f32());
            quants.extend(block[2..].iter().map(|&b| b as i8));
        }
        Ok(Self { rows, cols, quants, scales })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Rows `ids` dequantized, `[ids.len(), cols]` f32 (an embedding lookup).
    pub fn gather(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        let mut out = Vec::with_capacity(ids.len() * self.cols);
        for &id in ids {
            let r = id as usize;
            if r >= self.rows {
                candle_core::bail!("row {r} of a {}-row matrix", self.rows);
            }
            let per_row = self.cols / BLOCK;
            for b in r * per_row..(r + 1) * per_row {
                let scale = self.scales[b];
                out.extend(self.quants[b * BLOCK..(b + 1) * BLOCK].iter().map(|&q| q as f32 * scale));
            }
        }
        Tensor::from_vec(out, (ids.len(), self.cols), device)
    }

    /// `x W^T` for `x` `[M, cols]` (any float dtype, CPU) → `[M, rows]` f32.
    pub fn matmul_t(&self, x: &Tensor) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.cols {
            candle_core::bail!("Q8_0 matmul: input has {k} columns, the matrix {}", self.cols);
        }
        let xs = crate::cpu_f32(x)?;
        let inputs: Vec<Quantized> = xs.chunks_exact(k).map(quantize).collect();
        let per_row = k / BLOCK;
        // Output transposed, `[rows, M]`, so that each task owns a contiguous run of it. A few
        // tasks per thread: enough to balance, few enough that scheduling costs nothing.
        let mut out_t = vec![0f32; self.rows * m];
        let rows_per_task = (self.rows / (8 * rayon::current_num_threads())).max(16);
        let kernel = kernel();
        out_t.par_chunks_mut(rows_per_task * m).enumerate().for_each(|(task, out)| {
            let first = task * rows_per_task;
            for (i, o) in out.chunks_exact_mut(m).enumerate() {
                let r = first + i;
                let quants = &self.quants[r * k..(r + 1) * k];
                let scales = &self.scales[r * per_row..(r + 1) * per_row];
                for (o, input) in o.iter_mut().zip(&inputs) {
                    *o = kernel(quants, scales, &input.quants, &input.scales);
                }
            }
        });
        let t = Tensor::from_vec(out_t, (self.rows, m), &Device::Cpu)?;
        t.t()?.contiguous()?.to_device(x.device())
    }
}

/// One input row in Q8_0: signed bytes and a scale per block.
struct Quantized {
    quants: Vec<i8>,
    scales: Vec<f32>,
}

/// ggml's Q8_0 quantization of a row: per block, scale `max|x| / 127` rounded to f16 for the
/// dot product (the bytes are computed with the unrounded scale, as ggml does).
fn quantize(x: &[f32]) -> Quantized {
    let mut quants = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / BLOCK);
    for block in x.chunks_exact(BLOCK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        quants.extend(block.iter().map(|v| (v * inv).round() as i8));
        scales.push(f16::from_f32(d).to_f32());
    }
    Quantized { quants, scales }
}

/// `Σ_blocks w_scale * x_scale * (w_bytes · x_bytes)` over one weight row and one input row.
type DotKernel = fn(&[i8], &[f32], &[i8], &[f32]) -> f32;

/// The fastest dot product this CPU runs.
fn kernel() -> DotKernel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return |w, ws, x, xs| {
                // SAFETY: the features the function is compiled for were detected above.
                unsafe { avx2::dot(w, ws, x, xs) }
            };
        }
    }
    dot_scalar
}

fn dot_scalar(w: &[i8], w_scales: &[f32], x: &[i8], x_scales: &[f32]) -> f32 {
    let mut sum = 0f32;
    for (b, (ws, xs)) in w_scales.iter().zip(x_scales).enumerate() {
        let range = b * BLOCK..(b + 1) * BLOCK;
        let ints: i32 = w[range.clone()].iter().zip(&x[range]).map(|(&a, &b)| a as i32 * b as i32).sum();
        sum += ws * xs * ints as f32;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::BLOCK;

    /// The block sums as [`super::dot_scalar`] forms them; the f32 accumulation runs in eight
    /// lanes, so the last bits can differ from the scalar order.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(w: &[i8], w_scales: &[f32], x: &[i8], x_scales: &[f32]) -> f32 {
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for (b, (ws, xs)) in w_scales.iter().zip(x_scales).enumerate() {
            // SAFETY: block `b` lies inside both slices (one scale per 32 bytes).
            let (a, y) = unsafe {
                (
                    _mm256_loadu_si256(w.as_ptr().add(b * BLOCK) as *const __m256i),
                    _mm256_loadu_si256(x.as_ptr().add(b * BLOCK) as *const __m256i),
                )
            };
            // maddubs multiplies unsigned by signed bytes: move w's sign onto x.
            let products = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(y, a));
            let ints = _mm256_madd_epi16(products, ones);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(ws * xs), _mm256_cvtepi32_ps(ints), acc);
        }
        let half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
        _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 * 0.618 + seed).sin() * 3.0) * (1.0 + (i % 7) as f32)).collect()
    }

    /// Against candle's Q8_0 (ggml's blocks and dequantization) and an f64 loop over the same
    /// quantized values.
    #[test]
    fn matches_ggml_blocks_and_a_plain_loop() {
        let (rows, cols, m) = (37, 96, 3);
        let w = Tensor::from_vec(data(rows * cols, 0.3), (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let matrix = Q8Matrix::from_blocks(rows, cols, &q.data().unwrap()).unwrap();
        // Gathered rows are candle's dequantization of the same blocks.
        let ids: Vec<u32> = (0..rows as u32).collect();
        let gathered = matrix.gather(&ids, &Device::Cpu).unwrap();
        assert_eq!(gathered.to_vec2::<f32>().unwrap(), q.dequantize(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap());

        let x = Tensor::from_vec(data(m * cols, 1.7), (m, cols), &Device::Cpu).unwrap();
        let got = matrix.matmul_t(&x).unwrap().to_vec2::<f32>().unwrap();
        let xs = x.to_vec2::<f32>().unwrap();
        for (i, row) in xs.iter().enumerate() {
            let xq = quantize(row);
            for r in 0..rows {
                let mut want = 0f64;
                for b in 0..cols / BLOCK {
                    let ints: i64 = (0..BLOCK)
                        .map(|j| matrix.quants[r * cols + b * BLOCK + j] as i64 * xq.quants[b * BLOCK + j] as i64)
                        .sum();
                    want += matrix.scales[r * cols / BLOCK + b] as f64 * xq.scales[b] as f64 * ints as f64;
                }
                let g = got[i][r] as f64;
                assert!((g - want).abs() <= 1e-5 * want.abs().max(1.0), "row {i} col {r}: {g} vs {want}");
            }
        }
        // And close to the float product (Q8_0 keeps about 2-3 significant digits per block).
        let exact = x.matmul(&w.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
        for (g, e) in got.iter().flatten().zip(exact.iter().flatten()) {
            assert!((g - e).abs() < 0.02 * e.abs().max(10.0), "{g} vs {e}");
        }
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        let (rows, cols) = (20, 64);
        let w = Tensor::from_vec(data(rows * cols, 0.9), (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let matrix = Q8Matrix::from_blocks(rows, cols, &q.data().unwrap()).unwrap();
        let x = Tensor::from_vec(data(5 * cols, 2.2), (5, cols), &Device::Cpu).unwrap();
        let all = matrix.matmul_t(&x).unwrap();
        let one = matrix.matmul_t(&x.narrow(0, 3, 1).unwrap()).unwrap();
        assert_eq!(one.to_vec2::<f32>().unwrap()[0], all.to_vec2::<f32>().unwrap()[3]);
    }

    #[test]
    fn scalar_and_simd_agree() {
        // Q8_0 bytes lie in -127..=127 (the byte multiply's pair sums cannot saturate there).
        let w: Vec<i8> = (0..256).map(|i| ((i * 37) % 255 - 127) as i8).collect();
        let x: Vec<i8> = (0..256).map(|i| ((i * 91 + 7) % 255 - 127) as i8).collect();
        let ws: Vec<f32> = (0..8).map(|i| 0.01 + i as f32 * 0.003).collect();
        let xs: Vec<f32> = (0..8).map(|i| 0.02 - i as f32 * 0.001).collect();
        let scalar = dot_scalar(&w, &ws, &x, &xs);
        let fast = kernel()(&w, &ws, &x, &xs);
        assert!((scalar - fast).abs() <= 1e-5 * scalar.abs(), "{scalar} vs {fast}");
    }
}
