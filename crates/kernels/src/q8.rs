//! Block-quantized matrices (GGUF's Q8_0, Q6_K, Q4_K) and `x W^T` against them on CPU, with
//! llama.cpp's kind of arithmetic: each row of `x` is quantized to 8-bit blocks of 32 too, and
//! every block pair contributes `scale_w * scale_x * (integer dot product)`.
//!
//! Weights are expanded at load to one signed byte per value plus an f32 scale (and, for formats
//! with an offset, an f32 minimum) per group of 32 (Q8_0) or 16 (the k-quants' sub-blocks). The
//! expansion is exact — every value equals the file's dequantized value — and the inner loop is
//! pure integer dot products: 256-bit byte multiplies on x86-64 with AVX2 and FMA, a scalar loop
//! with the same sums elsewhere. Each output depends only on its own weight row and input row,
//! so results do not depend on how many input rows share a call.

use candle_core::{Device, Result, Tensor};
use half::f16;
use rayon::prelude::*;

/// Values per input block (and per Q8_0 group).
pub const BLOCK: usize = 32;
/// Bytes of one Q8_0 block in a GGUF file: f16 scale, then 32 signed bytes.
pub const BLOCK_BYTES: usize = 2 + BLOCK;
/// Values per k-quant super-block.
const SUPER: usize = 256;

/// A `[rows, cols]` matrix as signed bytes with per-group scales (and minimums).
pub struct Q8Matrix {
    rows: usize,
    cols: usize,
    /// Values per scale: 32 or 16.
    group: usize,
    quants: Vec<i8>,
    scales: Vec<f32>,
    /// Value = scale * q - min; empty for formats without an offset.
    mins: Vec<f32>,
}

impl Q8Matrix {
    fn check(rows: usize, cols: usize, bytes: &[u8], block_values: usize, block_bytes: usize, format: &str) -> Result<()> {
        if !cols.is_multiple_of(block_values) || bytes.len() != rows * cols / block_values * block_bytes {
            candle_core::bail!("{format} data of {} bytes does not hold a [{rows}, {cols}] matrix", bytes.len());
        }
        Ok(())
    }

    /// From GGUF Q8_0 bytes: `d: f16, q: [i8; 32]` per block, value `d * q`.
    pub fn from_q8_0(rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        Self::check(rows, cols, bytes, BLOCK, BLOCK_BYTES, "Q8_0")?;
        let mut quants = Vec::with_capacity(rows * cols);
        let mut scales = Vec::with_capacity(rows * cols / BLOCK);
        for block in bytes.chunks_exact(BLOCK_BYTES) {
            scales.push(f16::from_le_bytes([block[0], block[1]]).to_f32());
            quants.extend(block[2..].iter().map(|&b| b as i8));
        }
        Ok(Self { rows, cols, group: BLOCK, quants, scales, mins: Vec::new() })
    }

    /// From GGUF Q6_K bytes: per 256 values `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16],
    /// d: f16`; value `d * scales[g] * q` with q a 6-bit signed integer, g the group of 16.
    pub fn from_q6_k(rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        Self::check(rows, cols, bytes, SUPER, 210, "Q6_K")?;
        let mut quants = vec![0i8; rows * cols];
        let mut scales = Vec::with_capacity(rows * cols / 16);
        for (block, out) in bytes.chunks_exact(210).zip(quants.chunks_exact_mut(SUPER)) {
            let (ql, qh, sc) = (&block[..128], &block[128..192], &block[192..208]);
            let d = f16::from_le_bytes([block[208], block[209]]).to_f32();
            scales.extend(sc.iter().map(|&s| d * (s as i8) as f32));
            for half in 0..2 {
                let (ql, qh, out) = (&ql[64 * half..], &qh[32 * half..], &mut out[128 * half..]);
                for l in 0..32 {
                    out[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                    out[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    out[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    out[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                }
            }
        }
        Ok(Self { rows, cols, group: 16, quants, scales, mins: Vec::new() })
    }

    /// From GGUF Q4_K bytes: per 256 values `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`;
    /// each 32 values share a 6-bit scale and minimum: value `d * sc * q - dmin * m`, q in 0..16.
    pub fn from_q4_k(rows: usize, cols: usize, bytes: &[u8]) -> Result<Self> {
        Self::check(rows, cols, bytes, SUPER, 144, "Q4_K")?;
        let mut quants = vec![0i8; rows * cols];
        let mut scales = Vec::with_capacity(rows * cols / 16);
        let mut mins = Vec::with_capacity(rows * cols / 16);
        for (block, out) in bytes.chunks_exact(144).zip(quants.chunks_exact_mut(SUPER)) {
            let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
            let dmin = f16::from_le_bytes([block[2], block[3]]).to_f32();
            let (packed, qs) = (&block[4..16], &block[16..]);
            // Scale and minimum of 32-value sub-block j, six bits each, packed in 12 bytes.
            let scale_min = |j: usize| -> (u8, u8) {
                if j < 4 {
                    (packed[j] & 63, packed[j + 4] & 63)
                } else {
                    ((packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4), (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4))
                }
            };
            for j in 0..4 {
                let q = &qs[32 * j..32 * j + 32];
                for (sub, shift) in [(2 * j, 0), (2 * j + 1, 4)] {
                    let (sc, m) = scale_min(sub);
                    // Two groups of 16 per sub-block.
                    scales.extend([d * sc as f32; 2]);
                    mins.extend([dmin * m as f32; 2]);
                    for l in 0..32 {
                        out[32 * sub + l] = ((q[l] >> shift) & 0xF) as i8;
                    }
                }
            }
        }
        Ok(Self { rows, cols, group: 16, quants, scales, mins })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Rows `ids` dequantized, `[ids.len(), cols]` f32 (an embedding lookup).
    pub fn gather(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        let mut out = Vec::with_capacity(ids.len() * self.cols);
        for &id in ids {
            let r = id as usize;
            if r >= self.rows {
                candle_core::bail!("row {r} of a {}-row matrix", self.rows);
            }
            let per_row = self.cols / self.group;
            for g in r * per_row..(r + 1) * per_row {
                let (scale, min) = (self.scales[g], self.mins.get(g).copied().unwrap_or(0.0));
                let values = &self.quants[g * self.group..(g + 1) * self.group];
                if self.mins.is_empty() {
                    out.extend(values.iter().map(|&q| q as f32 * scale));
                } else {
                    out.extend(values.iter().map(|&q| scale * q as f32 - min));
                }
            }
        }
        Tensor::from_vec(out, (ids.len(), self.cols), device)
    }

    /// `x W^T` for `x` `[M, cols]` (any float dtype, CPU) → `[M, rows]` f32.
    pub fn matmul_t(&self, x: &Tensor) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.cols {
            candle_core::bail!("quantized matmul: input has {k} columns, the matrix {}", self.cols);
        }
        let xs = crate::cpu_f32(x)?;
        let inputs: Vec<Quantized> = xs.chunks_exact(k).map(quantize).collect();
        let per_row = k / self.group;
        // Output transposed, `[rows, M]`, so that each task owns a contiguous run of it. A few
        // tasks per thread: enough to balance, few enough that scheduling costs nothing.
        let mut out_t = vec![0f32; self.rows * m];
        let rows_per_task = (self.rows / (8 * rayon::current_num_threads())).max(16);
        let kernel = kernel();
        out_t.par_chunks_mut(rows_per_task * m).enumerate().for_each(|(task, out)| {
            let first = task * rows_per_task;
            for (i, o) in out.chunks_exact_mut(m).enumerate() {
                let r = first + i;
                let groups = r * per_row..(r + 1) * per_row;
                let row = Row {
                    quants: &self.quants[r * k..(r + 1) * k],
                    scales: &self.scales[groups.clone()],
                    mins: if self.mins.is_empty() { &[] } else { &self.mins[groups] },
                };
                for (o, input) in o.iter_mut().zip(&inputs) {
                    *o = kernel(&row, input);
                }
            }
        });
        let t = Tensor::from_vec(out_t, (self.rows, m), &Device::Cpu)?;
        t.t()?.contiguous()?.to_device(x.device())
    }
}

/// One weight row: bytes, and per group (`quants.len() / scales.len()` values) a scale and
/// optionally a minimum.
struct Row<'a> {
    quants: &'a [i8],
    scales: &'a [f32],
    mins: &'a [f32],
}

/// One input row in 8-bit blocks of 32: bytes, a scale per block, and the byte sum of every
/// 16 (what a weight group's minimum multiplies).
struct Quantized {
    quants: Vec<i8>,
    scales: Vec<f32>,
    sums16: Vec<f32>,
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
    let sums16 = quants.chunks_exact(16).map(|c| c.iter().map(|&q| q as i32).sum::<i32>() as f32).collect();
    Quantized { quants, scales, sums16 }
}

/// `Σ_groups w_scale * x_scale * (w_bytes · x_bytes) - w_min * x_scale * Σ x_bytes`.
type DotKernel = fn(&Row, &Quantized) -> f32;

/// The fastest dot product this CPU runs.
fn kernel() -> DotKernel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return |w, x| {
                // SAFETY: the features the function is compiled for were detected above.
                unsafe { avx2::dot(w, x) }
            };
        }
    }
    dot_scalar
}

fn dot_scalar(w: &Row, x: &Quantized) -> f32 {
    let group = w.quants.len() / w.scales.len();
    let mut sum = 0f32;
    for (g, ws) in w.scales.iter().enumerate() {
        let range = g * group..(g + 1) * group;
        let ints: i32 = w.quants[range.clone()].iter().zip(&x.quants[range]).map(|(&a, &b)| a as i32 * b as i32).sum();
        let xs = x.scales[g * group / BLOCK];
        sum += ws * xs * ints as f32;
        if let Some(min) = w.mins.get(g) {
            sum -= min * xs * x.sums16[g * group / 16..(g + 1) * group / 16].iter().sum::<f32>();
        }
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Quantized, Row, BLOCK};

    /// The sums [`super::dot_scalar`] forms; the f32 accumulation runs in eight lanes, so the
    /// last bits can differ from the scalar order.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(w: &Row, x: &Quantized) -> f32 {
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        let mut min_sum = 0f32;
        let halves = w.scales.len() * BLOCK / w.quants.len() == 2;
        for (b, xs) in x.scales.iter().enumerate() {
            // SAFETY: block `b` lies inside both rows (they have the same length).
            let (a, y) = unsafe {
                (
                    _mm256_loadu_si256(w.quants.as_ptr().add(b * BLOCK) as *const __m256i),
                    _mm256_loadu_si256(x.quants.as_ptr().add(b * BLOCK) as *const __m256i),
                )
            };
            // maddubs multiplies unsigned by signed bytes: move w's sign onto x. The eight i32
            // lanes then hold the sums of bytes 0-15 (lanes 0-3) and 16-31 (lanes 4-7).
            let products = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(y, a));
            let ints = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, ones));
            let scale = if halves {
                let (lo, hi) = (w.scales[2 * b] * xs, w.scales[2 * b + 1] * xs);
                if !w.mins.is_empty() {
                    min_sum += (w.mins[2 * b] * x.sums16[2 * b] + w.mins[2 * b + 1] * x.sums16[2 * b + 1]) * xs;
                }
                _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo))
            } else {
                _mm256_set1_ps(w.scales[b] * xs)
            };
            acc = _mm256_fmadd_ps(scale, ints, acc);
        }
        let half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
        _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1))) - min_sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 * 0.618 + seed).sin() * 3.0) * (1.0 + (i % 7) as f32)).collect()
    }

    /// `w` quantized by candle (ggml's block formats) and expanded here.
    fn expanded(w: &Tensor, dtype: GgmlDType) -> (QTensor, Q8Matrix) {
        let (rows, cols) = w.dims2().unwrap();
        let q = QTensor::quantize(w, dtype).unwrap();
        let bytes = q.data().unwrap();
        let m = match dtype {
            GgmlDType::Q8_0 => Q8Matrix::from_q8_0(rows, cols, &bytes),
            GgmlDType::Q6K => Q8Matrix::from_q6_k(rows, cols, &bytes),
            GgmlDType::Q4K => Q8Matrix::from_q4_k(rows, cols, &bytes),
            _ => unreachable!(),
        };
        (q, m.unwrap())
    }

    /// Expansion is exact (gathered rows are candle's dequantization of the same blocks), and the
    /// product equals an f64 sum over the dequantized weights times the quantized inputs.
    #[test]
    fn every_format_matches_ggml_blocks_and_a_plain_loop() {
        let (rows, cols, m) = (19, 512, 3);
        let w = Tensor::from_vec(data(rows * cols, 0.3), (rows, cols), &Device::Cpu).unwrap();
        let x = Tensor::from_vec(data(m * cols, 1.7), (m, cols), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q6K, GgmlDType::Q4K] {
            let (q, matrix) = expanded(&w, dtype);
            let ids: Vec<u32> = (0..rows as u32).collect();
            let weights = matrix.gather(&ids, &Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(weights, q.dequantize(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap(), "{dtype:?}");

            let got = matrix.matmul_t(&x).unwrap().to_vec2::<f32>().unwrap();
            for (i, row) in x.to_vec2::<f32>().unwrap().iter().enumerate() {
                let xq = quantize(row);
                let x_values: Vec<f64> =
                    xq.quants.iter().enumerate().map(|(j, &v)| v as f64 * xq.scales[j / BLOCK] as f64).collect();
                for (r, w_row) in weights.iter().enumerate() {
                    let terms = w_row.iter().zip(&x_values).map(|(&a, &b)| a as f64 * b);
                    let (want, size) = terms.fold((0f64, 0f64), |(s, n), t| (s + t, n + t.abs()));
                    let g = got[i][r] as f64;
                    assert!((g - want).abs() <= 1e-5 * size, "{dtype:?} row {i} col {r}: {g} vs {want}");
                }
            }
        }
    }

    /// Q8_0 of the inputs and weights stays close to the float product.
    #[test]
    fn q8_0_is_close_to_the_float_product() {
        let (rows, cols, m) = (37, 96, 3);
        let w = Tensor::from_vec(data(rows * cols, 0.3), (rows, cols), &Device::Cpu).unwrap();
        let x = Tensor::from_vec(data(m * cols, 1.7), (m, cols), &Device::Cpu).unwrap();
        let got = expanded(&w, GgmlDType::Q8_0).1.matmul_t(&x).unwrap().to_vec2::<f32>().unwrap();
        let exact = x.matmul(&w.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
        for (g, e) in got.iter().flatten().zip(exact.iter().flatten()) {
            assert!((g - e).abs() < 0.02 * e.abs().max(10.0), "{g} vs {e}");
        }
    }

    #[test]
    fn a_row_does_not_depend_on_its_batch() {
        let (rows, cols) = (20, 256);
        let w = Tensor::from_vec(data(rows * cols, 0.9), (rows, cols), &Device::Cpu).unwrap();
        let x = Tensor::from_vec(data(5 * cols, 2.2), (5, cols), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4K] {
            let matrix = expanded(&w, dtype).1;
            let all = matrix.matmul_t(&x).unwrap();
            let one = matrix.matmul_t(&x.narrow(0, 3, 1).unwrap()).unwrap();
            assert_eq!(one.to_vec2::<f32>().unwrap()[0], all.to_vec2::<f32>().unwrap()[3], "{dtype:?}");
        }
    }

    #[test]
    fn scalar_and_simd_agree() {
        let w = Tensor::from_vec(data(4 * 256, 0.5), (4, 256), &Device::Cpu).unwrap();
        let xq = quantize(&data(256, 1.1));
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q6K, GgmlDType::Q4K] {
            let m = expanded(&w, dtype).1;
            let groups = 256 / m.group;
            let row = Row {
                quants: &m.quants[..256],
                scales: &m.scales[..groups],
                mins: if m.mins.is_empty() { &[] } else { &m.mins[..groups] },
            };
            let (scalar, fast) = (dot_scalar(&row, &xq), kernel()(&row, &xq));
            assert!((scalar - fast).abs() <= 1e-4 * scalar.abs().max(1.0), "{dtype:?}: {scalar} vs {fast}");
        }
    }
}
