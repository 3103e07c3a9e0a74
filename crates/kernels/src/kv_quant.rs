//! Codecs for quantized KV: how one head's key or value vector becomes a few bytes and back.
//! Two families, each a [`KvCodec`]:
//! - [`Affine`]: groups of 32, 64 or 128 coordinates, each coordinate `bits` wide between a
//!   per-group bf16 bias (the minimum, rounded down) and bias + (2^bits - 1) · scale (rounded up),
//!   so no coordinate is ever clipped: the error is at most half a step (mlx-lm's
//!   `QuantizedKVCache` layout).
//! - [`Turbo`] (TurboQuant, Zandieh et al. 2025, arXiv 2504.19874): the vector's norm kept as
//!   bf16, its direction turned by a random rotation fixed by a seed (per layer and head), and
//!   each rotated coordinate — all distributed alike, nearly independent — quantized by the
//!   Lloyd–Max codebook of that distribution. The inner-product variant spends one bit on a
//!   sign sketch of the residual (QJL), which makes `⟨q, decoded⟩` an unbiased estimate of
//!   `⟨q, k⟩` for keys.
//!
//! Everything a code depends on (rotations, sketches, codebooks) is computed from integers with
//! this module's own generator, so a code written by one build reads back the same in any other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::{DType, Device, Tensor};
use half::bf16;

/// One head vector's codec: a fixed number of bytes per vector.
pub trait KvCodec {
    /// Coordinates per vector.
    fn dim(&self) -> usize;
    /// Bytes of one encoded vector.
    fn bytes(&self) -> usize;
    /// Encodes `x` (`dim` values) into `out` (`bytes` bytes).
    fn encode(&self, x: &[f32], out: &mut [u8]);
    /// Decodes `code` (`bytes` bytes) into `out` (`dim` values).
    fn decode(&self, code: &[u8], out: &mut [f32]);
}

/// Why a codec cannot be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecError(pub String);

impl std::fmt::Display for CodecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CodecError {}

/// Affine quantization in groups along the head dimension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Affine {
    dim: usize,
    bits: u32,
    group: usize,
}

impl Affine {
    pub const BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
    pub const GROUPS: [usize; 3] = [32, 64, 128];

    pub fn new(dim: usize, bits: u32, group: usize) -> Result<Self, CodecError> {
        if !Self::BITS.contains(&bits) {
            return Err(CodecError(format!("affine KV takes 2, 3, 4, 5, 6 or 8 bits, not {bits}")));
        }
        if !Self::GROUPS.contains(&group) {
            return Err(CodecError(format!("affine KV groups are 32, 64 or 128 coordinates, not {group}")));
        }
        if dim == 0 || dim % group != 0 {
            return Err(CodecError(format!("a head dimension of {dim} does not split into groups of {group}")));
        }
        Ok(Self { dim, bits, group })
    }

    fn levels(&self) -> u32 {
        (1 << self.bits) - 1
    }

    fn code_bytes(&self) -> usize {
        self.dim * self.bits as usize / 8
    }

    /// A group's (scale, bias) as stored, read back from a code.
    pub fn group_params(&self, code: &[u8], group: usize) -> (f32, f32) {
        let at = self.code_bytes() + 4 * group;
        let half = |i: usize| bf16::from_le_bytes([code[i], code[i + 1]]).to_f32();
        (half(at), half(at + 2))
    }
}

impl KvCodec for Affine {
    fn dim(&self) -> usize {
        self.dim
    }

    /// `dim · bits / 8` bytes of codes, then a bf16 scale and bias per group.
    fn bytes(&self) -> usize {
        self.code_bytes() + 4 * (self.dim / self.group)
    }

    fn encode(&self, x: &[f32], out: &mut [u8]) {
        let levels = self.levels() as f32;
        let mut codes = BitWriter::new(&mut out[..self.code_bytes()], self.bits);
        let mut params = Vec::with_capacity(self.dim / self.group);
        for group in x.chunks(self.group) {
            let finite = || group.iter().copied().filter(|v| v.is_finite());
            let (lo, hi) = (finite().fold(f32::INFINITY, f32::min), finite().fold(f32::NEG_INFINITY, f32::max));
            let (lo, hi) = if lo <= hi { (lo, hi) } else { (0.0, 0.0) };
            let bias = bf16_at_most(lo);
            let scale = bf16_at_least((hi - bias.to_f32()) / levels);
            let (b, s) = (bias.to_f32(), scale.to_f32());
            for &v in group {
                let q = if s > 0.0 { ((v - b) / s).round().clamp(0.0, levels) } else { 0.0 };
                codes.push(q as u32);
            }
            params.push((scale, bias));
        }
        let tail = &mut out[self.code_bytes()..];
        for (i, (scale, bias)) in params.into_iter().enumerate() {
            tail[4 * i..4 * i + 2].copy_from_slice(&scale.to_le_bytes());
            tail[4 * i + 2..4 * i + 4].copy_from_slice(&bias.to_le_bytes());
        }
    }

    fn decode(&self, code: &[u8], out: &mut [f32]) {
        let codes = &code[..self.code_bytes()];
        let params = |g| self.group_params(code, g);
        match self.bits {
            // Whole bytes and nibbles (the low one first, as BitWriter packs them) read in
            // place: the bit reader's values without its bookkeeping per code (a CPU step
            // decodes every row's whole history).
            8 => decode_groups(out, self.group, params, |e| codes[e]),
            4 => decode_groups(out, self.group, params, |e| (codes[e / 2] >> (4 * (e % 2))) & 15),
            _ => {
                let mut reader = BitReader::new(codes, self.bits);
                decode_groups(out, self.group, params, |_| reader.next() as u8)
            }
        }
    }
}

/// `out`'s values from their codes (`code(e)` for element `e`, asked in order): each group's
/// `bias + code · scale`.
fn decode_groups(out: &mut [f32], group: usize, params: impl Fn(usize) -> (f32, f32), mut code: impl FnMut(usize) -> u8) {
    for (g, values) in out.chunks_mut(group).enumerate() {
        let (scale, bias) = params(g);
        for (i, v) in values.iter_mut().enumerate() {
            *v = bias + f32::from(code(g * group + i)) * scale;
        }
    }
}

/// The largest bf16 not above `x` (finite `x`).
fn bf16_at_most(x: f32) -> bf16 {
    let b = bf16::from_f32(x);
    if b.to_f32() <= x {
        b
    } else {
        step_down(b)
    }
}

/// The smallest bf16 not below `x` (finite, non-negative `x`).
fn bf16_at_least(x: f32) -> bf16 {
    let b = bf16::from_f32(x);
    if b.to_f32() >= x {
        b
    } else {
        bf16::from_bits(b.to_bits() + 1)
    }
}

fn step_down(b: bf16) -> bf16 {
    match b.to_f32() {
        v if v > 0.0 => bf16::from_bits(b.to_bits() - 1),
        v if v == 0.0 => bf16::from_bits(0x8001), // the least negative subnormal
        _ => bf16::from_bits(b.to_bits() + 1),
    }
}

/// TurboQuant: a rotation, a per-coordinate Lloyd–Max codebook, the norm.
#[derive(Clone, Debug)]
pub struct Turbo {
    dim: usize,
    bits: u32,
    /// `[dim, dim]`, row-major, orthogonal.
    rotation: Vec<f32>,
    /// The MSE code's codebook, shared by every codec of its (dim, bits).
    codebook: Arc<Codebook>,
    /// The inner-product variant's Gaussian sketch `[dim, dim]` (its residual signs take one of
    /// the bits).
    sketch: Option<Vec<f32>>,
}

/// Which TurboQuant estimate a code serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TurboVariant {
    /// Least squared error (values, and keys by default).
    Mse,
    /// Unbiased inner products (keys): bits - 1 for the MSE code, 1 for the residual's signs.
    InnerProduct,
}

impl Turbo {
    /// A codec for `dim`-coordinate vectors at `bits` per coordinate, its rotation (and sketch)
    /// drawn from `seed`.
    pub fn new(dim: usize, bits: u32, variant: TurboVariant, seed: u64) -> Result<Self, CodecError> {
        let least = if variant == TurboVariant::InnerProduct { 2 } else { 1 };
        if !(least..=8).contains(&bits) {
            return Err(CodecError(format!("TurboQuant {variant:?} takes {least} to 8 bits, not {bits}")));
        }
        if dim < 8 || dim % 8 != 0 {
            return Err(CodecError(format!("TurboQuant needs a head dimension that is a multiple of 8, not {dim}")));
        }
        let mut rng = Normals::new(seed);
        let rotation = random_rotation(dim, &mut rng);
        let mse_bits = if variant == TurboVariant::InnerProduct { bits - 1 } else { bits };
        let codebook = codebook(dim, mse_bits);
        let sketch = (variant == TurboVariant::InnerProduct).then(|| (0..dim * dim).map(|_| rng.next() as f32).collect());
        Ok(Self { dim, bits, rotation, codebook, sketch })
    }

    fn mse_bits(&self) -> u32 {
        self.bits - self.sketch.is_some() as u32
    }

    fn code_bytes(&self) -> usize {
        self.dim * self.mse_bits() as usize / 8
    }

    /// The MSE code's expected squared error on a unit vector (its codebook's distortion).
    pub fn distortion(&self) -> f64 {
        self.codebook.distortion
    }

    /// The rotation `R` (`[dim, dim]`, row-major): a vector is coded as `R·x`, decoded as
    /// `Rᵀ·ŷ`.
    pub fn rotation(&self) -> &[f32] {
        &self.rotation
    }

    /// Whether codes are of the MSE variant, which [`Turbo::decode_rotated`] reads.
    pub fn is_mse(&self) -> bool {
        self.sketch.is_none()
    }

    /// An MSE code decoded short of the last rotation: `ŷ·norm`, whose product with `R·q` is
    /// the decoded vector's with `q` (attention rotates each query once instead of every key,
    /// and its weighted sum of values once instead of every value).
    pub fn decode_rotated(&self, code: &[u8], out: &mut [f32]) {
        debug_assert!(self.is_mse(), "the inner-product variant's sketch is not rotated");
        let mut codes = BitReader::new(&code[..self.code_bytes()], self.mse_bits());
        let at = self.code_bytes();
        let norm = bf16::from_le_bytes([code[at], code[at + 1]]).to_f32();
        for o in &mut out[..self.dim] {
            *o = self.codebook.centroids[codes.next() as usize] * norm;
        }
    }
}

impl KvCodec for Turbo {
    fn dim(&self) -> usize {
        self.dim
    }

    /// `dim · bits / 8` bytes of codes (signs included) and a bf16 norm; the inner-product
    /// variant adds the residual's bf16 norm.
    fn bytes(&self) -> usize {
        self.dim * self.bits as usize / 8 + 2 + 2 * self.sketch.is_some() as usize
    }

    fn encode(&self, x: &[f32], out: &mut [u8]) {
        let d = self.dim;
        let norm = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt() as f32;
        let norm = if norm.is_finite() { norm } else { 0.0 };
        let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        let rotated = matvec(&self.rotation, x, d);
        let mut codes = BitWriter::new(&mut out[..self.code_bytes()], self.mse_bits());
        let mut residual = vec![0f32; d];
        for (r, &y) in residual.iter_mut().zip(&rotated) {
            let y = y * inv;
            let q = self.codebook.boundaries.partition_point(|&b| b < y);
            codes.push(q as u32);
            *r = y - self.codebook.centroids[q];
        }
        let mut at = self.code_bytes();
        if let Some(sketch) = &self.sketch {
            let projected = matvec(sketch, &residual, d);
            let signs = &mut out[at..at + d / 8];
            signs.fill(0);
            for (i, p) in projected.iter().enumerate() {
                signs[i / 8] |= u8::from(*p >= 0.0) << (i % 8);
            }
            at += d / 8;
        }
        out[at..at + 2].copy_from_slice(&bf16::from_f32(norm).to_le_bytes());
        if self.sketch.is_some() {
            let r = residual.iter().map(|&v| v * v).sum::<f32>().sqrt();
            out[at + 2..at + 4].copy_from_slice(&bf16::from_f32(r).to_le_bytes());
        }
    }

    fn decode(&self, code: &[u8], out: &mut [f32]) {
        let d = self.dim;
        let mut codes = BitReader::new(&code[..self.code_bytes()], self.mse_bits());
        let mut rotated: Vec<f32> = (0..d).map(|_| self.codebook.centroids[codes.next() as usize]).collect();
        let mut at = self.code_bytes();
        let half = |i: usize| bf16::from_le_bytes([code[i], code[i + 1]]).to_f32();
        if let Some(sketch) = &self.sketch {
            // ⟨s_i, r⟩'s sign times s_i, summed, times |r|·√(π/2)/d: E over the sketch is r.
            let signs = &code[at..at + d / 8];
            let residual_norm = half(at + d / 8 + 2);
            let k = residual_norm * (std::f32::consts::FRAC_PI_2).sqrt() / d as f32;
            for (i, row) in sketch.chunks(d).enumerate() {
                let s = if signs[i / 8] >> (i % 8) & 1 == 1 { k } else { -k };
                rotated.iter_mut().zip(row).for_each(|(y, &v)| *y += s * v);
            }
            at += d / 8;
        }
        let norm = half(at);
        // Rᵀ·ŷ, scaled by the norm.
        out[..d].fill(0.0);
        for (row, &y) in self.rotation.chunks(d).zip(&rotated) {
            out.iter_mut().zip(row).for_each(|(o, &r)| *o += r * y * norm);
        }
    }
}

/// `m · x` for a `[d, d]` matrix (d a multiple of 8), eight partial sums a row so it vectorises.
fn matvec(m: &[f32], x: &[f32], d: usize) -> Vec<f32> {
    m.chunks(d)
        .map(|row| {
            let mut acc = [0f32; 8];
            for (r, v) in row.chunks_exact(8).zip(x.chunks_exact(8)) {
                (0..8).for_each(|i| acc[i] += r[i] * v[i]);
            }
            acc.iter().sum()
        })
        .collect()
}

/// A Haar-random orthogonal `[d, d]` matrix: Gram–Schmidt (twice, for orthogonality to f32
/// precision) over Gaussian rows, in f64.
fn random_rotation(d: usize, rng: &mut Normals) -> Vec<f32> {
    let mut rows: Vec<Vec<f64>> = Vec::with_capacity(d);
    for _ in 0..d {
        let mut v: Vec<f64> = (0..d).map(|_| rng.next()).collect();
        for _ in 0..2 {
            for u in &rows {
                let dot: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
                v.iter_mut().zip(u).for_each(|(a, b)| *a -= dot * b);
            }
        }
        let n = v.iter().map(|a| a * a).sum::<f64>().sqrt();
        v.iter_mut().for_each(|a| *a /= n);
        rows.push(v);
    }
    rows.into_iter().flatten().map(|a| a as f32).collect()
}

/// The Lloyd–Max quantizer of one coordinate of a uniformly random unit vector in `d`
/// dimensions (density ∝ (1 - x²)^((d-3)/2) on [-1, 1]) at some bits.
#[derive(Debug)]
struct Codebook {
    /// Ascending, and the boundaries between neighbouring cells.
    centroids: Vec<f32>,
    boundaries: Vec<f32>,
    /// Its expected squared error on a unit vector (per coordinate, times `d`).
    distortion: f64,
}

/// The codebook of (d, bits), computed once per process: every layer and head shares it.
fn codebook(d: usize, bits: u32) -> Arc<Codebook> {
    static CODEBOOKS: OnceLock<Mutex<HashMap<(usize, u32), Arc<Codebook>>>> = OnceLock::new();
    let codebooks = CODEBOOKS.get_or_init(Default::default);
    let mut codebooks = codebooks.lock().unwrap_or_else(|e| e.into_inner());
    codebooks.entry((d, bits)).or_insert_with(|| Arc::new(Codebook::lloyd_max(d, bits))).clone()
}

impl Codebook {
    /// Lloyd's iteration over a fine grid of the density, from its quantiles.
    fn lloyd_max(d: usize, bits: u32) -> Self {
        const POINTS: usize = 1 << 14;
        let reach = (12.0 / (d as f64).sqrt()).min(1.0);
        let xs: Vec<f64> = (0..POINTS).map(|i| -reach + 2.0 * reach * (i as f64 + 0.5) / POINTS as f64).collect();
        let exponent = (d as f64 - 3.0) / 2.0;
        let weights: Vec<f64> = xs.iter().map(|x| (1.0 - x * x).max(0.0).powf(exponent)).collect();
        let total: f64 = weights.iter().sum();
        let weights: Vec<f64> = weights.iter().map(|w| w / total).collect();
        let n = 1usize << bits;
        // Start from the quantiles' midpoints.
        let mut centroids = Vec::with_capacity(n);
        let mut acc = 0.0;
        let mut next = 0;
        for (x, w) in xs.iter().zip(&weights) {
            acc += w;
            while next < n && acc >= (next as f64 + 0.5) / n as f64 {
                centroids.push(*x);
                next += 1;
            }
        }
        centroids.resize(n, reach);
        let mut boundaries = vec![0.0; n - 1];
        for _ in 0..500 {
            for (b, pair) in boundaries.iter_mut().zip(centroids.windows(2)) {
                *b = (pair[0] + pair[1]) / 2.0;
            }
            let (mut sums, mut masses) = (vec![0.0; n], vec![0.0; n]);
            for (x, w) in xs.iter().zip(&weights) {
                let cell = boundaries.partition_point(|b| b < x);
                sums[cell] += w * x;
                masses[cell] += w;
            }
            for ((c, s), m) in centroids.iter_mut().zip(&sums).zip(&masses) {
                if *m > 0.0 {
                    *c = s / m;
                }
            }
        }
        let distortion: f64 = xs
            .iter()
            .zip(&weights)
            .map(|(x, w)| {
                let c = centroids[boundaries.partition_point(|b| b < x)];
                w * (x - c) * (x - c)
            })
            .sum::<f64>()
            * d as f64;
        Self {
            centroids: centroids.iter().map(|&c| c as f32).collect(),
            boundaries: boundaries.iter().map(|&b| b as f32).collect(),
            distortion,
        }
    }
}

/// Standard normal draws from splitmix64 and Box–Muller: fixed by the seed, in any build.
struct Normals {
    state: u64,
    spare: Option<f64>,
}

impl Normals {
    fn new(seed: u64) -> Self {
        Self { state: seed, spare: None }
    }

    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn next(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let (u, v) = (self.uniform(), self.uniform());
        let r = (-2.0 * u.ln()).sqrt();
        let t = std::f64::consts::TAU * v;
        self.spare = Some(r * t.sin());
        r * t.cos()
    }
}

/// Each vector of `x` (`[B, H, T, D]`) times its head's matrix of `m` (`[Hkv, D, D]`, H a
/// multiple of Hkv: heads `G·k .. G·k + G` take matrix k, as query heads share their KV head's),
/// as row vectors (`x·m`), in f32: every row's vectors of one matrix as one batched matmul.
pub fn turn(x: &Tensor, m: &Tensor) -> candle_core::Result<Tensor> {
    let (b, h, t, d) = x.dims4()?;
    let hkv = m.dim(0)?;
    let grouped = x.to_dtype(DType::F32)?.reshape((b, hkv, h / hkv * t, d))?.transpose(0, 1)?.contiguous()?;
    let turned = grouped.reshape((hkv, b * h / hkv * t, d))?.matmul(m)?;
    turned.reshape((hkv, b, h / hkv * t, d))?.transpose(0, 1)?.reshape((b, h, t, d))
}

/// [`turn`] on the device where each vector's result does not depend on the others (CUDA's
/// `turn_rows`, whose sums run in one order per vector, where a batched matmul picks its
/// algorithm by the batch): rotated keys, queries and outputs are the same bits alone or batched.
fn turn_each(x: &Tensor, m: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return gpu::turn_rows(x, m);
    }
    turn(x, m)
}

/// One half (keys or values) of a quantized layer as the CUDA kernels write and read it
/// (`cuda/kv_codes.cuh`): the format's numbers and, for TurboQuant (MSE codes), the codebook
/// and the KV heads' rotations on the device. Codes read short of their rotation, as
/// [`Turbo::decode_rotated`] reads them: attention turns its queries by the keys' rotation
/// ([`PartCodes::rotate`]) and its output back by the values' ([`PartCodes::unrotate`]).
#[derive(Clone, Debug)]
pub struct PartCodes {
    dim: usize,
    // Read by the device kernels' arguments only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    bits: u32,
    /// The affine group; 0 for TurboQuant.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    group: usize,
    width: usize,
    turbo: Option<TurboTables>,
}

#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct TurboTables {
    /// `[2^bits]` and `[2^bits - 1]` f32.
    centroids: Tensor,
    boundaries: Tensor,
    /// Per KV head `Rᵀ` and `R` (`[Hkv, D, D]` f32): row vectors times `Rᵀ` are turned (`R·x`),
    /// times `R` turned back.
    forward: Tensor,
    back: Tensor,
}

impl PartCodes {
    pub fn affine(codec: &Affine) -> PartCodes {
        PartCodes { dim: codec.dim, bits: codec.bits, group: codec.group, width: codec.bytes(), turbo: None }
    }

    /// The codes of a layer's KV heads, one TurboQuant codec each (alike but for their
    /// rotations), with their tables on `device`. MSE codes only: the inner-product variant's
    /// sketch has no device kernels.
    pub fn turbo(heads: &[&Turbo], device: &Device) -> Result<PartCodes, CodecError> {
        let first = heads.first().ok_or_else(|| CodecError("no KV heads".into()))?;
        if heads.iter().any(|h| !h.is_mse()) {
            return Err(CodecError(
                "TurboQuant's inner-product keys run on the CPU only (the GPU kernels read MSE codes)".into(),
            ));
        }
        let d = first.dim;
        let tensors = || -> candle_core::Result<TurboTables> {
            let rotations: Vec<f32> = heads.iter().flat_map(|h| h.rotation.iter().copied()).collect();
            let back = Tensor::from_vec(rotations, (heads.len(), d, d), &Device::Cpu)?;
            let forward = back.transpose(1, 2)?.contiguous()?;
            let codebook = &first.codebook;
            Ok(TurboTables {
                centroids: Tensor::new(codebook.centroids.as_slice(), device)?,
                boundaries: Tensor::new(codebook.boundaries.as_slice(), device)?,
                forward: forward.to_device(device)?,
                back: back.to_device(device)?,
            })
        };
        let turbo = tensors().map_err(|e| CodecError(format!("TurboQuant tables on {device:?}: {e}")))?;
        Ok(PartCodes { dim: d, bits: first.bits, group: 0, width: first.bytes(), turbo: Some(turbo) })
    }

    /// Coordinates per vector.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Bytes of one vector's code.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Whether codes are read short of a rotation (TurboQuant).
    pub fn is_rotated(&self) -> bool {
        self.turbo.is_some()
    }

    /// `x` (`[B, H, T, D]`, heads grouped on KV heads as [`turn`] takes them) with each vector
    /// turned as its head's codes are (`R·x`, f32); itself in f32 where codes are not rotated.
    pub fn rotate(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.turbo {
            Some(t) => turn_each(x, &t.forward),
            None => x.to_dtype(DType::F32),
        }
    }

    /// [`PartCodes::rotate`] undone (`Rᵀ·y`, f32).
    pub fn unrotate(&self, y: &Tensor) -> candle_core::Result<Tensor> {
        match &self.turbo {
            Some(t) => turn_each(y, &t.back),
            None => y.to_dtype(DType::F32),
        }
    }

    /// `x` (`[.., H, T, D]`, on CUDA) encoded: `[.., H, T, width]` u8, each vector as its head's
    /// codec encodes it on the CPU (see `cuda/kv_codes.cuh`).
    pub fn encode(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dims = x.dims().to_vec();
        let [lead @ .., h, t, d] = dims.as_slice() else {
            candle_core::bail!("KV codes: {dims:?} is not [.., heads, positions, dim]");
        };
        let mut shape = dims.clone();
        *shape.last_mut().expect("three dims") = self.width;
        #[cfg(feature = "cuda")]
        {
            let x = x.reshape((lead.iter().product::<usize>(), *h, *t, *d))?;
            gpu::encode(self, &x, None)?.expect("a fresh output").reshape(shape)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (lead, h, t, d, shape);
            candle_core::bail!("encoding KV codes on a device needs a build with CUDA")
        }
    }

    /// Codes (`[.., width]` u8, on CUDA) as attention reads them (TurboQuant short of its
    /// rotation): `[.., D]` in `dtype`.
    pub fn read(&self, codes: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        return gpu::read(self, codes, dtype);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (codes, dtype);
            candle_core::bail!("reading KV codes on a device needs a build with CUDA")
        }
    }
}

/// A quantized layer's keys and values as the CUDA kernels write and read them.
#[derive(Clone, Debug)]
pub struct LayerCodes {
    pub keys: PartCodes,
    pub values: PartCodes,
}

impl LayerCodes {
    /// Whether the attention kernels that read codes in place take these: head dims of 64, 128
    /// or 256 (other codes are read through a decoded copy).
    pub fn read_in_place(&self) -> bool {
        let d = self.keys.dim;
        self.values.dim == d && [64, 128, 256].contains(&d)
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::{DType, Tensor};

    use super::PartCodes;
    use crate::attention::gpu::PoolTarget;
    use crate::cuda::{self, Arg};

    /// Warps (one vector each) per block of the encode and decode kernels (`CODE_WARPS`).
    const CODE_WARPS: usize = 8;

    /// The kernels' description of a part: bits, group, width, centroids (and boundaries).
    pub(crate) fn part_args(part: &PartCodes, boundaries: bool) -> candle_core::Result<Vec<Arg>> {
        let mut args = vec![Arg::dim(part.bits as usize)?, Arg::dim(part.group)?, Arg::dim(part.width)?];
        args.push(Arg::at_or_null(part.turbo.as_ref().map(|t| &t.centroids))?);
        if boundaries {
            args.push(Arg::at_or_null(part.turbo.as_ref().map(|t| &t.boundaries))?);
        }
        Ok(args)
    }

    /// Encodes `x` (`[B, H, T, D]`) into a pool's blocks at each row's last `T` positions
    /// (`pool`), or into a fresh `[B, H, T, width]` tensor, returned.
    pub(crate) fn encode(part: &PartCodes, x: &Tensor, pool: Option<PoolTarget>) -> candle_core::Result<Option<Tensor>> {
        let (b, h, t, d) = x.dims4()?;
        if d != part.dim || d > 512 || !cuda::supports(x.dtype()) || !x.device().is_cuda() {
            candle_core::bail!("KV codes: {:?} ({:?}) to encode as vectors of {}", x.shape(), x.dtype(), part.dim);
        }
        let fresh = match pool {
            Some(_) => None,
            None => Some(cuda::output((b, h, t, part.width), DType::U8, x.device())?),
        };
        if b * h * t == 0 {
            return Ok(fresh);
        }
        let x = if x.stride()[3] == 1 { x.clone() } else { x.contiguous()? };
        let rotated = part.turbo.as_ref().map(|_| part.rotate(&x)?.contiguous()).transpose()?;
        let mut args = vec![Arg::at(&x)?, Arg::at_or_null(rotated.as_ref())?];
        match (&pool, &fresh) {
            (Some(p), _) => args.extend([
                Arg::at(p.pool)?,
                Arg::at(p.tables)?,
                Arg::at(p.lens)?,
                Arg::dim(p.max_blocks)?,
                Arg::dim(p.shift as usize)?,
            ]),
            (None, Some(out)) => args.extend([Arg::at(out)?, Arg::Ptr(0), Arg::Ptr(0), Arg::I32(0), Arg::I32(0)]),
            (None, None) => unreachable!("a fresh output without a pool"),
        }
        args.extend(crate::attention::gpu::shape_args(&x)?);
        args.extend(part_args(part, true)?);
        let cfg = cuda::grid_for(b * h * t * 32, (CODE_WARPS * 32) as u32)?;
        cuda::launch(x.device(), &cuda::ATTENTION, "encode_codes", x.dtype(), cfg, &args)?;
        Ok(fresh)
    }

    /// Vectors turned per block (`TURN_VECTORS`).
    const TURN_VECTORS: usize = 8;

    pub(super) fn turn_rows(x: &Tensor, m: &Tensor) -> candle_core::Result<Tensor> {
        let (b, h, t, d) = x.dims4()?;
        let (hm, rows, cols) = m.dims3()?;
        if (rows, cols) != (d, d) || hm == 0 || h % hm != 0 || d > 512 || !cuda::supports(x.dtype()) || m.dtype() != DType::F32 {
            candle_core::bail!("turn_rows: vectors {:?} ({:?}) by matrices {:?}", x.shape(), x.dtype(), m.shape());
        }
        let out = cuda::output((b, h, t, d), DType::F32, x.device())?;
        let per_matrix = b * h / hm * t;
        if per_matrix == 0 {
            return Ok(out);
        }
        let (x, m) = (x.contiguous()?, m.contiguous()?);
        let blocks = u32::try_from(per_matrix.div_ceil(TURN_VECTORS)).ok().filter(|&y| y <= 65535);
        let Some(blocks) = blocks else { candle_core::bail!("turn_rows: {per_matrix} vectors per matrix exceed a grid") };
        let cfg = LaunchConfig { grid_dim: (hm as u32, blocks, 1), block_dim: (d.min(256) as u32, 1, 1), shared_mem_bytes: 0 };
        let args =
            [Arg::at(&x)?, Arg::at(&m)?, Arg::at(&out)?, Arg::dim(b)?, Arg::dim(h)?, Arg::dim(t)?, Arg::dim(d)?, Arg::dim(hm)?];
        cuda::launch(x.device(), &cuda::ATTENTION, "turn_rows", x.dtype(), cfg, &args)?;
        Ok(out)
    }

    pub(super) fn read(part: &PartCodes, codes: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        let dims = codes.dims().to_vec();
        if codes.dtype() != DType::U8 || dims.last() != Some(&part.width) || !codes.device().is_cuda() || !cuda::supports(dtype) {
            candle_core::bail!("KV codes: {dims:?} ({:?}) are not codes of {} bytes on a GPU", codes.dtype(), part.width);
        }
        let codes = codes.contiguous()?;
        let vectors = codes.elem_count() / part.width;
        let mut shape = dims;
        *shape.last_mut().expect("a last dim") = part.dim;
        let out = cuda::output(shape, dtype, codes.device())?;
        if vectors == 0 {
            return Ok(out);
        }
        let mut args = vec![Arg::at(&codes)?, Arg::at(&out)?, Arg::I64(vectors as i64), Arg::dim(part.dim)?];
        args.extend(part_args(part, false)?);
        let cfg = cuda::grid_for(vectors * 32, (CODE_WARPS * 32) as u32)?;
        cuda::launch(codes.device(), &cuda::ATTENTION, "decode_codes", dtype, cfg, &args)?;
        Ok(out)
    }
}

/// Packs `bits`-wide codes (at most 8) little-endian, least significant bit first: code `n`
/// takes bits `n·bits ..` of the byte stream, so it spans at most two bytes.
struct BitWriter<'a> {
    out: &'a mut [u8],
    bits: u32,
    at: usize,
}

impl<'a> BitWriter<'a> {
    fn new(out: &'a mut [u8], bits: u32) -> Self {
        out.fill(0);
        Self { out, bits, at: 0 }
    }

    fn push(&mut self, code: u32) {
        let (byte, shift) = (self.at / 8, self.at % 8);
        let v = (code & ((1 << self.bits) - 1)) << shift;
        self.out[byte] |= v as u8;
        if shift + self.bits as usize > 8 {
            self.out[byte + 1] |= (v >> 8) as u8;
        }
        self.at += self.bits as usize;
    }
}

struct BitReader<'a> {
    code: &'a [u8],
    bits: u32,
    at: usize,
}

impl<'a> BitReader<'a> {
    fn new(code: &'a [u8], bits: u32) -> Self {
        Self { code, bits, at: 0 }
    }

    fn next(&mut self) -> u32 {
        let (byte, shift) = (self.at / 8, self.at % 8);
        let mut window = u32::from(self.code[byte]);
        if shift + self.bits as usize > 8 {
            window |= u32::from(self.code[byte + 1]) << 8;
        }
        self.at += self.bits as usize;
        (window >> shift) & ((1 << self.bits) - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The byte and nibble fast paths read what the bit reader reads, bit for bit.
    #[test]
    fn affine_decodes_whole_bytes_and_nibbles_as_the_bit_reader() {
        for (bits, group) in [(4, 32), (4, 64), (8, 64), (8, 128)] {
            let codec = Affine::new(256, bits, group).unwrap();
            let mut code = vec![0u8; codec.bytes()];
            for (i, b) in code.iter_mut().enumerate() {
                *b = ((i as u32).wrapping_mul(2654435761) >> 13) as u8;
            }
            // Scales and biases finite: small positive and negative bf16s.
            for g in 0..256 / group {
                let at = codec.code_bytes() + 4 * g;
                code[at..at + 2].copy_from_slice(&bf16::from_f32(0.01 * (g + 1) as f32).to_le_bytes());
                code[at + 2..at + 4].copy_from_slice(&bf16::from_f32(-0.5 + g as f32).to_le_bytes());
            }
            let mut fast = vec![0f32; 256];
            codec.decode(&code, &mut fast);
            let mut reader = BitReader::new(&code[..codec.code_bytes()], bits);
            let want: Vec<f32> = (0..256)
                .map(|e| {
                    let (scale, bias) = codec.group_params(&code, e / group);
                    bias + reader.next() as f32 * scale
                })
                .collect();
            assert_eq!(
                fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    fn unit_vectors(d: usize, n: usize, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = Normals::new(seed);
        (0..n)
            .map(|_| {
                let v: Vec<f64> = (0..d).map(|_| rng.next()).collect();
                let norm = v.iter().map(|a| a * a).sum::<f64>().sqrt();
                v.iter().map(|a| (a / norm) as f32).collect()
            })
            .collect()
    }

    fn round_trip(codec: &impl KvCodec, x: &[f32]) -> Vec<f32> {
        let mut code = vec![0u8; codec.bytes()];
        codec.encode(x, &mut code);
        let mut back = vec![0f32; codec.dim()];
        codec.decode(&code, &mut back);
        back
    }

    #[test]
    fn affine_round_trip_is_within_half_a_step() {
        let mut rng = Normals::new(3);
        for bits in Affine::BITS {
            for group in Affine::GROUPS {
                let codec = Affine::new(256, bits, group).unwrap();
                assert_eq!(codec.bytes(), 256 * bits as usize / 8 + 4 * 256 / group);
                for trial in 0..20 {
                    // Mixed scales and offsets, one constant group.
                    let x: Vec<f32> = (0..256)
                        .map(|i| {
                            if trial == 0 && i < group {
                                1.3
                            } else {
                                (rng.next() * 3.0 + (i / group) as f64) as f32 * 10f32.powi(trial % 5 - 2)
                            }
                        })
                        .collect();
                    let mut code = vec![0u8; codec.bytes()];
                    codec.encode(&x, &mut code);
                    let mut back = vec![0f32; 256];
                    codec.decode(&code, &mut back);
                    for (g, (xs, bs)) in x.chunks(group).zip(back.chunks(group)).enumerate() {
                        let (scale, bias) = codec.group_params(&code, g);
                        let (lo, hi) = xs.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| (l.min(v), h.max(v)));
                        // The step is the group's range over the levels, widened by two bf16 roundings.
                        assert!(
                            bias <= lo && scale <= (hi - lo) / ((1 << bits) - 1) as f32 * 1.02 + (lo.abs() * 0.008),
                            "{bits} bits, group {group}"
                        );
                        for (a, b) in xs.iter().zip(bs) {
                            assert!(
                                (a - b).abs() <= scale / 2.0 * 1.0001 + a.abs() * 1e-6,
                                "{bits}/{group}: {a} -> {b} (step {scale})"
                            );
                        }
                    }
                }
            }
        }
        assert!(Affine::new(16, 4, 32).is_err());
        assert!(Affine::new(128, 7, 32).is_err());
    }

    #[test]
    fn turbo_mse_approaches_the_lloyd_max_distortions() {
        // Gaussian Lloyd–Max distortions at 1-4 bits: Theorem 1's limit for unit vectors.
        let want = [0.3634, 0.1175, 0.03454, 0.009497];
        for d in [128, 256] {
            let keys = unit_vectors(d, 100_000, d as u64);
            for (bits, want) in (1..=4).zip(want) {
                let codec = Turbo::new(d, bits, TurboVariant::Mse, 11).unwrap();
                assert_eq!(codec.bytes(), d * bits as usize / 8 + 2);
                let mse: f64 = keys
                    .iter()
                    .map(|k| round_trip(&codec, k).iter().zip(k).map(|(a, b)| f64::from(a - b).powi(2)).sum::<f64>())
                    .sum::<f64>()
                    / keys.len() as f64;
                assert!((mse / want - 1.0).abs() < 0.05, "d {d}, {bits} bits: MSE {mse:.5}, want {want}");
                assert!((codec.distortion() / want - 1.0).abs() < 0.05, "d {d}, {bits} bits: codebook {}", codec.distortion());
            }
        }
    }

    #[test]
    fn turbo_inner_products_are_unbiased_and_the_mse_code_is_not() {
        let d = 128;
        // Keys at ⟨q, k⟩ = 0.5: half q plus a random unit direction orthogonal to it; codecs
        // drawn anew every 500 keys (the estimate is unbiased over the rotation and sketch).
        let q = &unit_vectors(d, 1, 1)[0];
        let keys: Vec<Vec<f32>> = unit_vectors(d, 100_000, 2)
            .into_iter()
            .map(|u| {
                let along: f32 = u.iter().zip(q).map(|(a, b)| a * b).sum();
                let v: Vec<f32> = u.iter().zip(q).map(|(a, b)| a - along * b).collect();
                let n = v.iter().map(|a| a * a).sum::<f32>().sqrt();
                v.iter().zip(q).map(|(a, b)| 0.5 * b + 0.75f32.sqrt() * a / n).collect()
            })
            .collect();
        let mean = |bits, variant| {
            let mut total = 0.0;
            for (c, chunk) in keys.chunks(500).enumerate() {
                let codec = Turbo::new(d, bits, variant, 1000 + c as u64).unwrap();
                total += chunk
                    .iter()
                    .map(|k| f64::from(round_trip(&codec, k).iter().zip(q).map(|(a, b)| a * b).sum::<f32>()))
                    .sum::<f64>();
            }
            total / keys.len() as f64
        };
        for bits in [3, 4] {
            let unbiased = mean(bits, TurboVariant::InnerProduct);
            assert!((unbiased - 0.5).abs() < 0.005, "{bits} bits: mean estimate {unbiased}");
            // The MSE code shrinks: about (1 - distortion) of the truth.
            let shrunk = mean(bits, TurboVariant::Mse);
            assert!(0.5 - shrunk > 0.002, "{bits} bits: the MSE code's mean {shrunk} should fall short of 0.5");
        }
    }

    #[test]
    fn turbo_codes_depend_on_the_seed_alone() {
        let x = &unit_vectors(64, 1, 9)[0];
        let code = |seed| {
            let codec = Turbo::new(64, 3, TurboVariant::InnerProduct, seed).unwrap();
            let mut out = vec![0u8; codec.bytes()];
            codec.encode(x, &mut out);
            out
        };
        assert_eq!(code(5), code(5));
        assert_ne!(code(5), code(6));
        assert!(Turbo::new(64, 1, TurboVariant::InnerProduct, 0).is_err());
        assert!(Turbo::new(20, 4, TurboVariant::Mse, 0).is_err());
    }

    /// An MSE code decoded short of the rotation, turned back by `Rᵀ`, is the decoded vector.
    #[test]
    fn rotated_decodes_turn_back_into_the_decoded_vectors() {
        for (d, bits) in [(32, 3), (128, 4)] {
            let codec = Turbo::new(d, bits, TurboVariant::Mse, 9).unwrap();
            for x in unit_vectors(d, 20, 3) {
                let mut code = vec![0u8; codec.bytes()];
                codec.encode(&x, &mut code);
                let (mut decoded, mut rotated) = (vec![0f32; d], vec![0f32; d]);
                codec.decode(&code, &mut decoded);
                codec.decode_rotated(&code, &mut rotated);
                for (i, want) in decoded.iter().enumerate() {
                    let back: f32 = (0..d).map(|j| codec.rotation()[j * d + i] * rotated[j]).sum();
                    assert!((back - want).abs() < 1e-5, "d {d}, coordinate {i}: {back} vs {want}");
                }
            }
        }
        assert!(!Turbo::new(32, 3, TurboVariant::InnerProduct, 9).unwrap().is_mse());
    }

    /// Codes of every width pack least significant bit first, each `bits` wide from bit
    /// `n · bits` of the stream, and read back as written.
    #[test]
    fn codes_pack_lsb_first_and_read_back() {
        for bits in 1..=8u32 {
            let codes: Vec<u32> = (0..37u32).map(|n| n.wrapping_mul(2_654_435_761) >> (32 - bits)).collect();
            let mut out = vec![0u8; (codes.len() * bits as usize).div_ceil(8)];
            let mut writer = BitWriter::new(&mut out, bits);
            codes.iter().for_each(|&c| writer.push(c));
            for (n, &c) in codes.iter().enumerate() {
                let bit = |b: usize| u32::from(out[b / 8] >> (b % 8) & 1);
                let packed = (0..bits as usize).map(|b| bit(n * bits as usize + b) << b).sum::<u32>();
                assert_eq!(packed, c, "{bits} bits, code {n}");
            }
            let mut reader = BitReader::new(&out, bits);
            assert!(codes.iter().all(|&c| reader.next() == c), "{bits} bits read back");
        }
    }
}
