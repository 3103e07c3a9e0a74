//! GGUF block-quantized matrices (Q8_0, Q5_0, Q4_K, Q6_K) and `x W^T` against them on CPU, with
//! llama.cpp's kind of arithmetic: each row of `x` is quantized to 8-bit blocks of 32, and every
//! block pair contributes `scale_w * scale_x * (integer dot product)` (minus the weight format's
//! offset or minimum times the block's byte sum).
//!
//! Weights stay in the file's packed blocks — decode is bound by reading them, so strata reads
//! exactly the bytes llama.cpp reads — and are unpacked in registers inside the dot product:
//! 256-bit byte multiplies on x86-64 with AVX2, FMA and F16C. Elsewhere a scalar loop forms the
//! same sums from each block decoded to bytes. Each output depends only on its own weight row
//! and input row, so results do not depend on how many input rows share a call.

use candle_core::{Device, Result, Tensor};
use half::f16;
use rayon::prelude::*;

/// Values per input block (and per Q8_0 / Q5_0 block).
pub const BLOCK: usize = 32;
/// Values per weight group in a decoded block (the k-quants' finest scale granularity).
const GROUP: usize = 16;
/// Values per k-quant super-block.
const SUPER: usize = 256;
/// Input rows multiplied together against a task's weight rows (~45 KB of quantized inputs at
/// 640 columns: they stay in L2 while the weight rows stream past).
const INPUT_TILE: usize = 64;

/// The block formats strata multiplies itself (GGUF / ggml layouts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockFormat {
    /// `d: f16, q: [i8; 32]`; value `d * q`.
    Q8_0,
    /// `d: f16, qh: u32, qs: [u8; 16]`; value `d * (q - 16)` with q's low four bits in `qs`
    /// nibbles (values 0-15 low, 16-31 high) and its fifth in bit i of `qh`.
    Q5_0,
    /// Per 256 values `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`; 32 values share a
    /// 6-bit scale and minimum: value `d * sc * q - dmin * m`, q in 0..16.
    Q4K,
    /// Per 256 values `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`; value
    /// `d * scales[g] * (q - 32)`, q six bits, g the group of 16.
    Q6K,
}

impl BlockFormat {
    /// Values and bytes per block.
    pub const fn block(self) -> (usize, usize) {
        match self {
            BlockFormat::Q8_0 => (BLOCK, 34),
            BlockFormat::Q5_0 => (BLOCK, 22),
            BlockFormat::Q4K => (SUPER, 144),
            BlockFormat::Q6K => (SUPER, 210),
        }
    }
}

/// A `[rows, cols]` matrix in one block format, rows of whole blocks.
pub struct QuantMatrix {
    rows: usize,
    cols: usize,
    format: BlockFormat,
    data: Vec<u8>,
}

impl QuantMatrix {
    /// From GGUF block bytes, row after row.
    pub fn new(format: BlockFormat, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self> {
        let (values, bytes) = format.block();
        if !cols.is_multiple_of(values) || data.len() != rows * cols / values * bytes {
            candle_core::bail!("{format:?} data of {} bytes does not hold a [{rows}, {cols}] matrix", data.len());
        }
        Ok(Self { rows, cols, format, data })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    fn row_bytes(&self) -> usize {
        self.data.len() / self.rows
    }

    fn row(&self, r: usize) -> &[u8] {
        let len = self.row_bytes();
        &self.data[r * len..(r + 1) * len]
    }

    /// Rows `ids`, in that order, as a matrix of their own still in blocks (a row's products
    /// are the same bits in either matrix).
    pub fn select_rows(&self, ids: &[u32]) -> Result<Self> {
        let mut data = Vec::with_capacity(ids.len() * self.row_bytes());
        for &id in ids {
            if id as usize >= self.rows {
                candle_core::bail!("row {id} of a {}-row matrix", self.rows);
            }
            data.extend_from_slice(self.row(id as usize));
        }
        Self::new(self.format, ids.len(), self.cols, data)
    }

    /// Rows `ids` dequantized, `[ids.len(), cols]` f32 (an embedding lookup).
    pub fn gather(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        let (values, bytes) = self.format.block();
        let mut out = Vec::with_capacity(ids.len() * self.cols);
        let mut decoded = Decoded::default();
        for &id in ids {
            let r = id as usize;
            if r >= self.rows {
                candle_core::bail!("row {r} of a {}-row matrix", self.rows);
            }
            for block in self.row(r).chunks_exact(bytes) {
                decoded.decode(self.format, block);
                for (g, q) in decoded.quants[..values].chunks_exact(GROUP).enumerate() {
                    out.extend(q.iter().map(|&q| decoded.scales[g] * q as f32 - decoded.mins[g]));
                }
            }
        }
        Tensor::from_vec(out, (ids.len(), self.cols), device)
    }

    /// `x W^T` for `x` `[M, cols]` (any float dtype, CPU) → `[M, rows]` f32.
    pub fn matmul_t(&self, x: &Tensor) -> Result<Tensor> {
        let mut out = Self::matmul_t_many(&[self], x)?;
        Ok(out.remove(0))
    }

    /// `x W_i^T` for several matrices of `x`'s width (projections of one input): `x` is
    /// quantized once and one parallel pass covers all their rows — one fork-join of the
    /// threads instead of one per matrix, which on a decode step costs as much as a small
    /// matrix's arithmetic.
    pub fn matmul_t_many(matrices: &[&QuantMatrix], x: &Tensor) -> Result<Vec<Tensor>> {
        let (m, k) = x.dims2()?;
        if let Some(w) = matrices.iter().find(|w| w.cols != k) {
            candle_core::bail!("quantized matmul: input has {k} columns, the matrix {}", w.cols);
        }
        if m == 0 {
            return matrices.iter().map(|w| Tensor::zeros((0, w.rows), candle_core::DType::F32, x.device())).collect();
        }
        let xs = crate::cpu_f32(x)?;
        let inputs: Vec<Quantized> = xs.chunks_exact(k).map(quantize).collect();
        // The matrices' rows one after another; output transposed, `[rows, M]`, so that each
        // task owns a contiguous run of it. A few tasks per thread: enough to balance, few
        // enough that scheduling costs nothing.
        let starts: Vec<usize> = matrices.iter().scan(0, |at, w| Some(std::mem::replace(at, *at + w.rows))).collect();
        let rows: usize = matrices.iter().map(|w| w.rows).sum();
        let mut out_t = vec![0f32; rows * m];
        let rows_per_task = (rows / (8 * rayon::current_num_threads())).max(16);
        let kernel = rows_kernel();
        out_t.par_chunks_mut(rows_per_task * m).enumerate().for_each(|(task, out)| {
            let (first, last) = (task * rows_per_task, task * rows_per_task + out.len() / m);
            // A tile of inputs at a time stays in cache while the task's rows pass over it.
            for tile in (0..m).step_by(INPUT_TILE) {
                let inputs = &inputs[tile..(tile + INPUT_TILE).min(m)];
                // The task's rows, a run of consecutive rows of each matrix they cover.
                for (w, &start) in matrices.iter().zip(&starts) {
                    let (from, to) = (first.max(start), last.min(start + w.rows));
                    if from < to {
                        let rows = &w.data[(from - start) * w.row_bytes()..(to - start) * w.row_bytes()];
                        kernel(w.format, rows, w.row_bytes(), inputs, &mut out[(from - first) * m + tile..], m);
                    }
                }
            }
        });
        let t = Tensor::from_vec(out_t, (rows, m), &Device::Cpu)?;
        matrices
            .iter()
            .zip(&starts)
            .map(|(w, &start)| t.narrow(0, start, w.rows)?.t()?.contiguous()?.to_device(x.device()))
            .collect()
    }
}

/// One input row in 8-bit blocks of 32: bytes, a scale per block, and the byte sums of every 16
/// and every 32 (what a weight group's offset or minimum multiplies).
struct Quantized {
    quants: Vec<i8>,
    scales: Vec<f32>,
    sums16: Vec<f32>,
    sums32: Vec<i32>,
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
    let sums16: Vec<f32> = quants.chunks_exact(GROUP).map(|c| c.iter().map(|&q| q as i32).sum::<i32>() as f32).collect();
    let sums32 = sums16.chunks_exact(2).map(|p| (p[0] + p[1]) as i32).collect();
    Quantized { quants, scales, sums16, sums32 }
}

/// One block decoded: `value = scales[g] * quants[i] - mins[g]` for i in group g (16 values).
/// Sized for the largest block; a 32-value block fills the first two groups.
struct Decoded {
    quants: [i8; SUPER],
    scales: [f32; SUPER / GROUP],
    mins: [f32; SUPER / GROUP],
}

impl Default for Decoded {
    fn default() -> Self {
        Self { quants: [0; SUPER], scales: [0.0; SUPER / GROUP], mins: [0.0; SUPER / GROUP] }
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Q4_K's eight 6-bit scales and minimums, packed in 12 bytes.
fn q4_k_scales_mins(packed: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut scales, mut mins) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        (scales[j], mins[j]) = if j < 4 {
            (packed[j] & 63, packed[j + 4] & 63)
        } else {
            ((packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4), (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4))
        };
    }
    (scales, mins)
}

impl Decoded {
    /// Decodes one block exactly: every value equals ggml's dequantization of it.
    fn decode(&mut self, format: BlockFormat, block: &[u8]) {
        let (q, scales, mins) = (&mut self.quants, &mut self.scales, &mut self.mins);
        match format {
            BlockFormat::Q8_0 => {
                let d = f16_at(block, 0);
                scales[..2].fill(d);
                mins[..2].fill(0.0);
                for (q, &b) in q.iter_mut().zip(&block[2..]) {
                    *q = b as i8;
                }
            }
            BlockFormat::Q5_0 => {
                let d = f16_at(block, 0);
                scales[..2].fill(d);
                mins[..2].fill(0.0);
                let high = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
                for (j, &nibbles) in block[6..].iter().enumerate() {
                    let bit = |i: usize| (((high >> i) & 1) as u8) << 4;
                    q[j] = ((nibbles & 0xF) | bit(j)) as i8 - 16;
                    q[j + 16] = ((nibbles >> 4) | bit(j + 16)) as i8 - 16;
                }
            }
            BlockFormat::Q4K => {
                let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
                let (sc, m) = q4_k_scales_mins(&block[4..16]);
                for (j, packed) in block[16..].chunks_exact(32).enumerate() {
                    for (sub, shift) in [(2 * j, 0), (2 * j + 1, 4)] {
                        // A sub-block of 32 is two groups of 16 with the same scale.
                        scales[2 * sub..2 * sub + 2].fill(d * sc[sub] as f32);
                        mins[2 * sub..2 * sub + 2].fill(dmin * m[sub] as f32);
                        for (q, &b) in q[32 * sub..32 * sub + 32].iter_mut().zip(packed) {
                            *q = ((b >> shift) & 0xF) as i8;
                        }
                    }
                }
            }
            BlockFormat::Q6K => {
                let (ql, qh, sc) = (&block[..128], &block[128..192], &block[192..208]);
                let d = f16_at(block, 208);
                for (g, &s) in sc.iter().enumerate() {
                    (scales[g], mins[g]) = (d * (s as i8) as f32, 0.0);
                }
                for half in 0..2 {
                    let (ql, qh, q) = (&ql[64 * half..], &qh[32 * half..], &mut q[128 * half..]);
                    for l in 0..32 {
                        q[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                        q[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                        q[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                        q[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                    }
                }
            }
        }
    }
}

/// `Σ_groups w_scale * x_scale * (w_bytes · x_bytes) - w_min * x_scale * Σ x_bytes` for each of
/// a run of consecutive weight rows (`rows`, of `row_bytes` each) and each quantized input:
/// `out[i * stride + j]` = row `i` · input `j`.
type RowsKernel = fn(BlockFormat, &[u8], usize, &[Quantized], &mut [f32], usize);

/// The fastest kernel this CPU runs. The format is matched once per run of rows, so the dot
/// product inlines into the loop over them: rows are short (Gemma 3 270M's LM head is 262144
/// rows of 680 bytes), and a division, a search and an indirect call per row showed in profiles.
fn rows_kernel() -> RowsKernel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the features the function is compiled for were detected above.
            return |format, rows, row_bytes, inputs, out, stride| unsafe {
                avx2::rows(format, rows, row_bytes, inputs, out, stride)
            };
        }
    }
    |format, rows, row_bytes, inputs, out, stride| each_row(rows, row_bytes, inputs, out, stride, |w, x| dot_scalar(format, w, x))
}

/// `out[i * stride + j] = dot(row i, inputs[j])` over the rows of `row_bytes` in `rows`.
#[inline(always)]
fn each_row(
    rows: &[u8],
    row_bytes: usize,
    inputs: &[Quantized],
    out: &mut [f32],
    stride: usize,
    dot: impl Fn(&[u8], &Quantized) -> f32,
) {
    for (row, o) in rows.chunks_exact(row_bytes).zip(out.chunks_mut(stride)) {
        for (o, x) in o.iter_mut().zip(inputs) {
            *o = dot(row, x);
        }
    }
}

fn dot_scalar(format: BlockFormat, row: &[u8], x: &Quantized) -> f32 {
    let (values, bytes) = format.block();
    let mut decoded = Decoded::default();
    let mut sum = 0f32;
    for (b, block) in row.chunks_exact(bytes).enumerate() {
        decoded.decode(format, block);
        for (g, q) in decoded.quants[..values].chunks_exact(GROUP).enumerate() {
            let at = b * values + g * GROUP;
            let ints: i32 = q.iter().zip(&x.quants[at..at + GROUP]).map(|(&a, &b)| a as i32 * b as i32).sum();
            let xs = x.scales[at / BLOCK];
            sum += decoded.scales[g] * xs * ints as f32 - decoded.mins[g] * xs * x.sums16[at / GROUP];
        }
    }
    sum
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The sums [`super::dot_scalar`] forms, with the blocks unpacked in registers: weights as
    //! unsigned bytes (`maddubs` multiplies unsigned by signed bytes), a format's offset taken
    //! off afterwards through the input's byte sums. The f32 accumulation runs in eight lanes, so
    //! the last bits can differ from the scalar order.
    use std::arch::x86_64::*;

    use super::{each_row, BlockFormat, Quantized, BLOCK};

    /// How far ahead of the block being multiplied to ask for weight bytes. Decode is bound by
    /// the weight stream, and each task's run of rows is short (a few KB for small matrices),
    /// too short for the hardware prefetcher to ramp up.
    const PREFETCH_AHEAD: usize = 1024;

    /// Asks for the cache lines `PREFETCH_AHEAD` bytes past `block`'s `bytes` (past the end of
    /// the matrix this only hints at memory that is never read).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn prefetch(block: *const u8, bytes: usize) {
        for line in (0..bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(block.wrapping_add(PREFETCH_AHEAD + line) as *const i8);
        }
    }

    /// The f16 at `p` in all eight lanes. (Broadcast from memory, then converted: a scalar
    /// conversion would merge into some register's upper lanes, which LLVM may pick to be the
    /// accumulator, chaining every block to the previous one.)
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_at(p: *const u8) -> __m256 {
        // SAFETY: the caller points at two readable bytes.
        let bits = unsafe { std::ptr::read_unaligned(p as *const i16) };
        _mm256_cvtph_ps(_mm_set1_epi16(bits))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(p: *const u8) -> __m256i {
        // SAFETY: the caller points at 32 readable bytes.
        unsafe { _mm256_loadu_si256(p as *const __m256i) }
    }

    /// Input block `b`'s bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn input(x: &Quantized, b: usize) -> __m256i {
        debug_assert!(b * BLOCK + BLOCK <= x.quants.len());
        // SAFETY: the caller's block index lies inside the row.
        unsafe { load(x.quants.as_ptr().add(b * BLOCK) as *const u8) }
    }

    /// Eight i32 sums of unsigned `w` bytes times signed `x` bytes (lanes 0-3 from bytes 0-15,
    /// 4-7 from 16-31), each pair weighted by `pair_weights` (i16 lanes).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn products(w: __m256i, x: __m256i, pair_weights: __m256i) -> __m256i {
        // Pairs of bytes reach at most 2 * 128 * 127, inside i16: no saturation.
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), pair_weights)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(acc: __m256) -> f32 {
        let half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
        _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)))
    }

    /// [`super::RowsKernel`] with this module's dot products inlined into the loop over rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows(format: BlockFormat, rows: &[u8], row_bytes: usize, inputs: &[Quantized], out: &mut [f32], stride: usize) {
        // SAFETY (each arm): this function's features are the dot products' features.
        match format {
            BlockFormat::Q8_0 => each_row(rows, row_bytes, inputs, out, stride, |w, x| unsafe { dot_q8_0(w, x) }),
            BlockFormat::Q5_0 => each_row(rows, row_bytes, inputs, out, stride, |w, x| unsafe { dot_q5_0(w, x) }),
            BlockFormat::Q4K => each_row(rows, row_bytes, inputs, out, stride, |w, x| unsafe { dot_q4_k(w, x) }),
            BlockFormat::Q6K => each_row(rows, row_bytes, inputs, out, stride, |w, x| unsafe { dot_q6_k(w, x) }),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0(row: &[u8], x: &Quantized) -> f32 {
        assert_eq!(row.len(), x.scales.len() * 34);
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for (b, &xs) in x.scales.iter().enumerate() {
            // SAFETY: block b lies inside both rows (asserted lengths).
            let (block, y) = unsafe { (row.as_ptr().add(b * 34), input(x, b)) };
            prefetch(block, 34);
            let (d, w) = unsafe { (f16_at(block), load(block.add(2))) };
            // Signed weights: move w's sign onto x.
            let ints = products(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w), ones);
            acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xs)), _mm256_cvtepi32_ps(ints), acc);
        }
        hsum(acc)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_0(row: &[u8], x: &Quantized) -> f32 {
        assert_eq!(row.len(), x.scales.len() * 22);
        let ones = _mm256_set1_epi16(1);
        let nibble = _mm256_set1_epi8(0xF);
        // Byte i of the fifth-bit mask takes bit i % 8 of byte i / 8 of `qh`.
        let spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
        let sixteen = _mm256_set1_epi8(0x10);
        let mut acc = _mm256_setzero_ps();
        for (b, (&xs, &sum)) in x.scales.iter().zip(&x.sums32).enumerate() {
            // SAFETY: block b lies inside both rows (asserted lengths).
            let (block, y) = unsafe { (row.as_ptr().add(b * 22), input(x, b)) };
            prefetch(block, 22);
            let (d, high, low) = unsafe {
                (
                    _mm256_mul_ps(f16_at(block), _mm256_set1_ps(xs)),
                    std::ptr::read_unaligned(block.add(2) as *const i32),
                    _mm_loadu_si128(block.add(6) as *const __m128i),
                )
            };
            let fifth = _mm256_shuffle_epi8(_mm256_set1_epi32(high), spread);
            let fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(fifth, bit), bit), sixteen);
            let low = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(low, 4), low), nibble);
            // The values are `q - 16`: take 16 * (the block's byte sum) off the eight lanes'
            // total in integers, 2 * sum from each lane.
            let ints = _mm256_sub_epi32(products(_mm256_or_si256(low, fifth), y, ones), _mm256_set1_epi32(2 * sum));
            acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(ints), acc);
        }
        hsum(acc)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_k(row: &[u8], x: &Quantized) -> f32 {
        assert_eq!(row.len() / 144 * 8, x.scales.len());
        let ones = _mm256_set1_epi16(1);
        let nibble = _mm256_set1_epi8(0xF);
        let (mut acc, mut mins) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (s, block) in row.chunks_exact(144).enumerate() {
            let p = block.as_ptr();
            prefetch(p, 144);
            // SAFETY: a 144-byte block.
            let (d, dmin) = unsafe { (f16_at(p), f16_at(p.add(2))) };
            let (sc, m) = super::q4_k_scales_mins(&block[4..16]);
            for j in 0..4 {
                // SAFETY: bytes 16 + 32j .. + 32 lie in the block.
                let q = unsafe { load(p.add(16 + 32 * j)) };
                let halves = [_mm256_and_si256(q, nibble), _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble)];
                for (k, w) in halves.into_iter().enumerate() {
                    let sub = 2 * j + k;
                    let b = 8 * s + sub;
                    let xs = x.scales[b];
                    // SAFETY: block b lies inside the input (asserted lengths).
                    let ints = products(w, unsafe { input(x, b) }, ones);
                    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(sc[sub] as f32 * xs)), _mm256_cvtepi32_ps(ints), acc);
                    let sum = m[sub] as f32 * xs * x.sums32[b] as f32;
                    mins = _mm256_fmadd_ps(dmin, _mm256_set1_ps(sum), mins);
                }
            }
        }
        // Every lane of `mins` holds the same sum.
        hsum(acc) - _mm256_cvtss_f32(mins)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q6_k(row: &[u8], x: &Quantized) -> f32 {
        assert_eq!(row.len() / 210 * 8, x.scales.len());
        let nibble = _mm256_set1_epi8(0xF);
        let two_bits = _mm256_set1_epi8(3);
        let (mut acc, mut offset) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (s, block) in row.chunks_exact(210).enumerate() {
            let p = block.as_ptr();
            prefetch(p, 210);
            // SAFETY: a 210-byte block.
            let d = unsafe { f16_at(p.add(208)) };
            let sc = &block[192..208];
            for local in 0..8 {
                // 32 values: low four bits from `ql` (nibble `local / 2 % 2` of bytes
                // 64 * half + 32 * (local % 2) ..), high two from bits 2 * (local % 4) of `qh`.
                let (half, quarter) = (local / 4, local % 4);
                // SAFETY: ql (0..128) and qh (128..192) lie in the block.
                let (ql, qh) = unsafe { (load(p.add(64 * half + 32 * (quarter % 2))), load(p.add(128 + 32 * half))) };
                let low = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (quarter / 2) as i32)), nibble);
                let high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * quarter as i32)), two_bits);
                let w = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
                let (b, g) = (8 * s + local, 2 * local);
                let (s0, s1) = (sc[g] as i8 as i16, sc[g + 1] as i8 as i16);
                let scales = _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0));
                // SAFETY: block b lies inside the input (asserted lengths).
                let ints = products(w, unsafe { input(x, b) }, scales);
                let dx = _mm256_mul_ps(d, _mm256_set1_ps(x.scales[b]));
                acc = _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(ints), acc);
                let sum = s0 as f32 * x.sums16[2 * b] + s1 as f32 * x.sums16[2 * b + 1];
                offset = _mm256_fmadd_ps(dx, _mm256_set1_ps(sum), offset);
            }
        }
        // Every lane of `offset` holds the same sum.
        hsum(acc) - 32.0 * _mm256_cvtss_f32(offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};

    const FORMATS: [(BlockFormat, GgmlDType); 4] = [
        (BlockFormat::Q8_0, GgmlDType::Q8_0),
        (BlockFormat::Q5_0, GgmlDType::Q5_0),
        (BlockFormat::Q4K, GgmlDType::Q4K),
        (BlockFormat::Q6K, GgmlDType::Q6K),
    ];

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 * 0.618 + seed).sin() * 3.0) * (1.0 + (i % 7) as f32)).collect()
    }

    /// `w` quantized by candle (ggml's block formats), in both forms.
    fn quantized(w: &Tensor, format: BlockFormat, dtype: GgmlDType) -> (QTensor, QuantMatrix) {
        let (rows, cols) = w.dims2().unwrap();
        let q = QTensor::quantize(w, dtype).unwrap();
        let m = QuantMatrix::new(format, rows, cols, q.data().unwrap().into_owned()).unwrap();
        (q, m)
    }

    /// Blocks of random bytes (every bit pattern a block can hold, Q8_0's -128 included) with
    /// finite f16 scales.
    fn random_blocks(format: BlockFormat, blocks: usize, seed: u64) -> Vec<u8> {
        let mut state = seed;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as u8
        };
        let (_, bytes) = format.block();
        let scale_at: &[usize] = match format {
            BlockFormat::Q8_0 | BlockFormat::Q5_0 => &[0],
            BlockFormat::Q4K => &[0, 2],
            BlockFormat::Q6K => &[208],
        };
        let mut out: Vec<u8> = (0..blocks * bytes).map(|_| next()).collect();
        for block in out.chunks_exact_mut(bytes) {
            for &at in scale_at {
                let scale = f16::from_f32(0.001 + next() as f32 * 1e-4);
                block[at..at + 2].copy_from_slice(&scale.to_le_bytes());
            }
        }
        out
    }

    /// Decoding is exact (gathered rows are candle's dequantization of the same blocks), and
    /// the product equals an f64 sum over the dequantized weights times the quantized inputs.
    #[test]
    fn every_format_matches_ggml_blocks_and_a_plain_loop() {
        let (rows, cols, m) = (19, 512, 3);
        let w = Tensor::from_vec(data(rows * cols, 0.3), (rows, cols), &Device::Cpu).unwrap();
        let x = Tensor::from_vec(data(m * cols, 1.7), (m, cols), &Device::Cpu).unwrap();
        for (format, dtype) in FORMATS {
            let (q, matrix) = quantized(&w, format, dtype);
            let ids: Vec<u32> = (0..rows as u32).collect();
            let weights = matrix.gather(&ids, &Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(weights, q.dequantize(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap(), "{format:?}");

            let got = matrix.matmul_t(&x).unwrap().to_vec2::<f32>().unwrap();
            for (i, row) in x.to_vec2::<f32>().unwrap().iter().enumerate() {
                let xq = quantize(row);
                let x_values: Vec<f64> =
                    xq.quants.iter().enumerate().map(|(j, &v)| v as f64 * xq.scales[j / BLOCK] as f64).collect();
                for (r, w_row) in weights.iter().enumerate() {
                    let terms = w_row.iter().zip(&x_values).map(|(&a, &b)| a as f64 * b);
                    let (want, size) = terms.fold((0f64, 0f64), |(s, n), t| (s + t, n + t.abs()));
                    let g = got[i][r] as f64;
                    assert!((g - want).abs() <= 1e-5 * size, "{format:?} row {i} col {r}: {g} vs {want}");
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
        let got = quantized(&w, BlockFormat::Q8_0, GgmlDType::Q8_0).1.matmul_t(&x).unwrap().to_vec2::<f32>().unwrap();
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
        for (format, dtype) in FORMATS {
            let matrix = quantized(&w, format, dtype).1;
            let all = matrix.matmul_t(&x).unwrap();
            let one = matrix.matmul_t(&x.narrow(0, 3, 1).unwrap()).unwrap();
            assert_eq!(one.to_vec2::<f32>().unwrap()[0], all.to_vec2::<f32>().unwrap()[3], "{format:?}");
        }
    }

    /// Several matrices in one pass give each matrix's own product, bit for bit.
    #[test]
    fn many_matrices_in_one_pass_equal_each_alone() {
        let cols = 512;
        let x = Tensor::from_vec(data(3 * cols, 0.7), (3, cols), &Device::Cpu).unwrap();
        let matrices: Vec<QuantMatrix> = FORMATS
            .iter()
            .enumerate()
            .map(|(i, &(format, dtype))| {
                let rows = 17 + 40 * i;
                let w = Tensor::from_vec(data(rows * cols, i as f32), (rows, cols), &Device::Cpu).unwrap();
                quantized(&w, format, dtype).1
            })
            .collect();
        let all = QuantMatrix::matmul_t_many(&matrices.iter().collect::<Vec<_>>(), &x).unwrap();
        for (matrix, together) in matrices.iter().zip(all) {
            let alone = matrix.matmul_t(&x).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(together.to_vec2::<f32>().unwrap(), alone, "{:?}", matrix.format);
        }
    }

    /// A batch of no rows (every request of a step finished, say) gives each matrix an empty
    /// `[0, rows]` product instead of dividing the work by zero rows.
    #[test]
    fn no_input_rows_give_empty_products() {
        let cols = 256;
        let w = Tensor::from_vec(data(9 * cols, 0.4), (9, cols), &Device::Cpu).unwrap();
        let (_, matrix) = quantized(&w, BlockFormat::Q8_0, GgmlDType::Q8_0);
        let x = Tensor::zeros((0, cols), candle_core::DType::F32, &Device::Cpu).unwrap();
        let products = QuantMatrix::matmul_t_many(&[&matrix, &matrix], &x).unwrap();
        assert_eq!(products.iter().map(|p| p.dims().to_vec()).collect::<Vec<_>>(), [[0, 9], [0, 9]]);
    }

    /// The SIMD kernels unpack blocks in registers; on arbitrary block bytes they form the same
    /// sums as decoding each block and a scalar loop.
    #[test]
    fn scalar_and_simd_agree_on_any_block_bytes() {
        let cols = 1024;
        let x = quantize(&data(cols, 1.1));
        for (format, _) in FORMATS {
            let (values, _) = format.block();
            for seed in 0..8 {
                let row = random_blocks(format, cols / values, seed);
                let mut fast = [0f32];
                rows_kernel()(format, &row, row.len(), std::slice::from_ref(&x), &mut fast, 1);
                let (scalar, fast) = (dot_scalar(format, &row, &x), fast[0]);
                let size: f32 = QuantMatrix::new(format, 1, cols, row.clone())
                    .unwrap()
                    .gather(&[0], &Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .zip(&x.quants)
                    .enumerate()
                    .map(|(i, (w, &q))| (w * q as f32 * x.scales[i / BLOCK]).abs())
                    .sum();
                assert!((scalar - fast).abs() <= 1e-5 * size, "{format:?} seed {seed}: {scalar} vs {fast}");
            }
        }
    }

    #[test]
    fn data_of_the_wrong_size_is_refused() {
        let err = QuantMatrix::new(BlockFormat::Q4K, 2, 256, vec![0; 144]).err().unwrap();
        assert!(err.to_string().contains("Q4K data of 144 bytes does not hold a [2, 256] matrix"), "{err}");
        assert!(QuantMatrix::new(BlockFormat::Q8_0, 1, 48, vec![0; 68]).is_err());
    }
}
