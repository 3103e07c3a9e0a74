//! Causal softmax attention for one row, with grouped-query heads, over that row's KV history.

use std::ops::RangeInclusive;

use candle_core::{DType, Storage, Tensor, D};
use rayon::prelude::*;

use crate::kv_quant::LayerCodes;
use crate::matmul::{dot1, Widen};
use crate::Result;

/// How scores are formed and which keys a query sees.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scoring {
    /// Multiplies `q · k`.
    pub scale: f64,
    /// Sliding window: the query at position `p` sees keys `p - window + 1 ..= p` only.
    pub window: Option<usize>,
}

impl Scoring {
    pub fn scaled(scale: f64) -> Self {
        Self { scale, window: None }
    }

    /// The keys `first..=pos` the query at `pos` sees.
    fn first_visible(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// `q` `[Hq, T, D]` for the row's newest `T` positions; `k`, `v` `[Hkv, L, D]` hold its history
/// including those `T` (so the query at index `i` sits at position `L - T + i` and sees keys
/// `0..=L-T+i`, or the last `window` of them). Query head `h` reads KV head `h / (Hq / Hkv)`.
/// Scores and softmax are f32; the result `[Hq, T, D]` is in `q`'s dtype.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scoring: Scoring) -> Result<Tensor> {
    let few_rows = q.dim(1)? <= crate::matmul::MAX_EXACT_ROWS;
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && gpu::takes(q, k, v)? {
        return match few_rows {
            true => gpu::attention_rows(&q.unsqueeze(0)?, &[(k.clone(), v.clone())], scoring, None)?.squeeze(0),
            false => gpu::prefill(&q.unsqueeze(0)?, &k.unsqueeze(0)?, &v.unsqueeze(0)?, scoring, true)?.squeeze(0),
        };
    }
    let few = few_rows && q.device().is_cpu() && k.dtype() == v.dtype();
    match k.dtype() {
        DType::F32 if few => few_queries::<f32>(q, k, v, scoring),
        DType::BF16 if few => few_queries::<half::bf16>(q, k, v, scoring),
        _ => reference(q, k, v, scoring),
    }
}

/// [`causal_attention`] for a batch whose rows have their own histories: `q` `[B, Hq, T, D]`,
/// `kv[r]` row `r`'s keys and values `[Hkv, L_r, D]`. Returns `[B, Hq, T, D]`. On CUDA, a few
/// queries per row run as one kernel over every row.
pub fn causal_attention_rows(q: &Tensor, kv: &[(Tensor, Tensor)], scoring: Scoring) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gpu::takes_rows(q, kv)? {
        return gpu::attention_rows(q, kv, scoring, None);
    }
    let rows = kv
        .iter()
        .enumerate()
        .map(|(r, (k, v))| causal_attention(&q.get(r)?.contiguous()?, k, v, scoring))
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&rows, 0)
}

/// [`causal_attention_rows`] for rows whose histories are equally long, given as one batch:
/// `k`, `v` `[B, Hkv, L, D]` (a cohort of prompts prefilled together). On CUDA, rows of many
/// queries (past the decode kernels' few) run as one batched prefill instead of one per row.
pub fn causal_attention_batch(q: &Tensor, k: &Tensor, v: &Tensor, scoring: Scoring) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gpu::takes_batch(q, k, v)? {
        return gpu::prefill(q, k, v, scoring, true);
    }
    causal_attention_rows(q, &batch_rows(k, v)?, scoring)
}

/// [`causal_attention_batch`] gated as [`gated_attention_rows`] gates it.
pub fn gated_attention_batch(q: &Tensor, k: &Tensor, v: &Tensor, scoring: Scoring, gate: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gpu::takes_batch(q, k, v)? {
        return sigmoid_gate(&gpu::prefill(q, k, v, scoring, true)?, gate);
    }
    gated_attention_rows(q, &batch_rows(k, v)?, scoring, gate)
}

/// Each row's keys and values of a batch `[B, Hkv, L, D]`.
fn batch_rows(k: &Tensor, v: &Tensor) -> Result<Vec<(Tensor, Tensor)>> {
    (0..k.dim(0)?).map(|r| Ok((k.get(r)?, v.get(r)?))).collect()
}

/// The output of a gated attention (Qwen3.5's full-attention layers): [`causal_attention_rows`]
/// laid out `[B, T, H·D]` and times `sigmoid(gate)` ([`sigmoid_gate`]); `gate` `[B, T, H, D]`,
/// any strides. On CUDA, a few queries per row take the gate in the attention's last kernel.
pub fn gated_attention_rows(q: &Tensor, kv: &[(Tensor, Tensor)], scoring: Scoring, gate: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gpu::takes_rows(q, kv)? {
        return gpu::attention_rows(q, kv, scoring, Some(gate));
    }
    sigmoid_gate(&causal_attention_rows(q, kv, scoring)?, gate)
}

/// Attention without a mask, every query seeing every key (a vision encoder's): `q` `[B, H, T, D]`,
/// `k`, `v` `[B, H, L, D]`. On CUDA in bf16 / f16 with a head width the flash kernels take, one
/// kernel that keeps scores in f32 registers and never writes them out (as SDPA's flash backend
/// computes them); otherwise scores in `q`'s dtype and softmax in f32, as transformers' eager
/// attention rounds them, the two matmuls on tensor cores on CUDA with one softmax kernel
/// between.
///
/// Outside the flash kernel the queries go in blocks whose scores take at most
/// [`FULL_ATTENTION_SCORES`] values, so a large image's attention needs memory linear in its
/// patches, not quadratic.
pub fn full_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    if q.rank() != 4 || k.dims() != v.dims() || q.dims()[..2] != k.dims()[..2] || q.dim(3)? != k.dim(3)? {
        candle_core::bail!("full_attention: queries {:?} over keys {:?} and values {:?}", q.dims(), k.dims(), v.dims());
    }
    #[cfg(feature = "cuda")]
    if let Some(out) = flash_attention(q, k, v, Scoring::scaled(scale), false)? {
        return Ok(out);
    }
    full_attention_within(q, k, v, scale, FULL_ATTENTION_SCORES)
}

/// `q` `[B, Hq, T, D]` over `k`, `v` `[B, Hkv, L, D]` by the flash kernels (cuda/flash.cu):
/// every query sees every key, or with `causal` query `i` sits at position `L - T + i` and sees
/// the keys up to it (the last `scoring.window` of them). The result is a `[B, Hq, T, D]` view of
/// a `[B, T, Hq, D]` tensor (the layout the output projection reads). `None` where the kernels do
/// not take these tensors (not on CUDA, f32, a head width other than 64, 128 or 256).
#[cfg(feature = "cuda")]
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, scoring: Scoring, causal: bool) -> Result<Option<Tensor>> {
    gpu::flash(q, k, v, scoring, causal)
}

/// [`full_attention`] holding at most `max_scores` scores at once.
fn full_attention_within(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, max_scores: usize) -> Result<Tensor> {
    let (b, h, t, _) = q.dims4()?;
    let block = (max_scores / (b * h * k.dim(2)?).max(1)).clamp(1, t.max(1));
    if block < t {
        let blocks =
            (0..t).step_by(block).map(|s| full_attention_within(&q.narrow(2, s, block.min(t - s))?, k, v, scale, max_scores));
        return Tensor::cat(&blocks.collect::<Result<Vec<_>>>()?, 2);
    }
    #[cfg(feature = "cuda")]
    if gpu::takes_batch(q, k, v)? {
        // full_attention tried the flash kernel already.
        return gpu::scored_prefill(q, k, v, Scoring::scaled(scale), false);
    }
    let scores = (q.matmul(&k.contiguous()?.t()?)? * scale)?.to_dtype(DType::F32)?;
    candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(q.dtype())?.matmul(&v.contiguous()?)
}

/// Most scores [`full_attention`] holds at once: 2²⁸ (1 GiB in f32).
pub const FULL_ATTENTION_SCORES: usize = 1 << 28;

/// `attended` `[B, H, T, D]` laid out `[B, T, H·D]`, times `sigmoid(gate)` (`gate` `[B, T, H, D]`),
/// in `attended`'s dtype: the sigmoid computed in f32 and rounded to it once, then the product
/// rounded, as transformers multiplies them (candle's CPU sigmoid in bf16 rounds after each of
/// its three steps).
pub fn sigmoid_gate(attended: &Tensor, gate: &Tensor) -> Result<Tensor> {
    let (b, h, t, d) = attended.dims4()?;
    if gate.dims() != [b, t, h, d] {
        candle_core::bail!("sigmoid_gate: gate {:?} for attention output {:?}", gate.dims(), attended.dims());
    }
    let out = attended.transpose(1, 2)?.reshape((b, t, h * d))?;
    let gate = candle_nn::ops::sigmoid(&gate.reshape((b, t, h * d))?.to_dtype(DType::F32)?)?;
    out * gate.to_dtype(attended.dtype())?
}

/// Writes `src` `[B, H, T, D]` in place into each row's buffer `dst[r].0` `[H, capacity, D]`
/// from position `dst[r].1` (a KV store's append). One kernel for every row on CUDA.
pub fn write_rows(src: &Tensor, dst: &[(&Tensor, usize)]) -> Result<()> {
    let (b, h, t, d) = src.dims4()?;
    if dst.len() != b {
        candle_core::bail!("write_rows: {b} source rows for {} buffers", dst.len());
    }
    for (r, (buf, position)) in dst.iter().enumerate() {
        let (bh, capacity, bd) = buf.dims3()?;
        if (bh, bd) != (h, d) || !buf.is_contiguous() || position + t > capacity {
            candle_core::bail!(
                "write_rows: row {r}'s buffer {:?} cannot take {t} positions of [{h}, _, {d}] at {position}",
                buf.dims()
            );
        }
    }
    #[cfg(feature = "cuda")]
    if src.device().is_cuda() && crate::cuda::supports(src.dtype()) && dst.iter().all(|(buf, _)| buf.dtype() == src.dtype()) {
        return gpu::write_rows(src, dst);
    }
    for (r, (buf, position)) in dst.iter().enumerate() {
        buf.slice_set(&src.get(r)?.to_dtype(buf.dtype())?.contiguous()?, 1, *position)?;
    }
    Ok(())
}

/// The same attention from tensor ops (batched matmuls), for long query blocks and any device.
pub fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scoring: Scoring) -> Result<Tensor> {
    let (hq, t_len, d) = q.dims3()?;
    let (hkv, l_len, _) = k.dims3()?;
    let group = hq / hkv;
    let dtype = q.dtype();
    // Fold the query heads that share a KV head into the time axis: [Hkv, G*T, D].
    let qg = q.reshape((hkv, group * t_len, d))?;
    let mut scores = (qg.matmul(&k.t()?)? * scoring.scale)?.to_dtype(DType::F32)?;
    let past = l_len - t_len;
    if t_len > 1 || scoring.first_visible(past) > 0 {
        let mask: Vec<f32> = (0..group * t_len)
            .flat_map(|r| {
                let pos = past + r % t_len;
                let first = scoring.first_visible(pos);
                (0..l_len).map(move |j| if (first..=pos).contains(&j) { 0.0 } else { f32::NEG_INFINITY })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (group * t_len, l_len), q.device())?;
        scores = scores.broadcast_add(&mask)?;
    }
    let probs = softmax_last_dim(&scores)?.to_dtype(dtype)?;
    probs.matmul(&v.contiguous()?)?.reshape((hq, t_len, d))
}

/// CPU path for a few queries (decode steps, speculative verify forwards). Every score is one
/// fixed-order dot product and every output one fixed-order weighted sum over the query's own
/// keys, in f32, so a query's result does not depend on how many queries share the call: a
/// verify forward computes each position exactly as decoding it alone would, which exact
/// rollback and acceptance rely on. Keys and values are read in place from the KV store.
fn few_queries<W: Widen>(q: &Tensor, k: &Tensor, v: &Tensor, scoring: Scoring) -> Result<Tensor> {
    let scale = scoring.scale as f32;
    let (hq, t_len, d) = q.dims3()?;
    let (hkv, l_len, _) = k.dims3()?;
    let group = hq / hkv;
    let qs = crate::cpu_f32(&q.contiguous()?)?;
    let (k_storage, k_layout) = k.storage_and_layout();
    let (v_storage, v_layout) = v.storage_and_layout();
    let (Storage::Cpu(k_cpu), Storage::Cpu(v_cpu)) = (&*k_storage, &*v_storage) else { unreachable!("checked CPU above") };
    let (ks, vs) = (k_cpu.as_slice::<W>()?, v_cpu.as_slice::<W>()?);
    if k_layout.stride()[2] != 1 || v_layout.stride()[2] != 1 {
        return reference(q, k, v, scoring);
    }
    let mut out = vec![0f32; hq * t_len * d];
    let attend = attend_for_cpu::<W>();
    out.par_chunks_mut(d).enumerate().for_each(|(index, o)| {
        let (h, i) = (index / t_len, index % t_len);
        let kv_head = h / group;
        let pos = l_len - t_len + i;
        let keys = Rows { data: ks, layout: k_layout, head: kv_head, d };
        let values = Rows { data: vs, layout: v_layout, head: kv_head, d };
        attend(&qs[index * d..(index + 1) * d], keys, values, scoring.first_visible(pos)..=pos, scale, o);
    });
    Tensor::from_vec(out, (hq, t_len, d), q.device())?.to_dtype(q.dtype())
}

/// Position after position of one head of a `[H, L, D]` view whose last dimension is contiguous.
#[derive(Clone, Copy)]
struct Rows<'a, W> {
    data: &'a [W],
    layout: &'a candle_core::Layout,
    head: usize,
    d: usize,
}

impl<'a, W> Rows<'a, W> {
    fn at(&self, pos: usize) -> &'a [W] {
        let stride = self.layout.stride();
        let at = self.layout.start_offset() + self.head * stride[0] + pos * stride[1];
        &self.data[at..at + self.d]
    }
}

type Attend<W> = fn(&[f32], Rows<W>, Rows<W>, RangeInclusive<usize>, f32, &mut [f32]);

/// [`attend`] compiled for AVX2 + FMA when the CPU has them (the crate is built for baseline
/// x86-64), chosen once per call so every query of a call runs the same code.
fn attend_for_cpu<W: Widen>() -> Attend<W> {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        return |query, keys, values, visible, scale, out| {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            unsafe { attend_avx2(query, keys, values, visible, scale, out) }
        };
    }
    attend
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2<W: Widen>(
    query: &[f32],
    keys: Rows<W>,
    values: Rows<W>,
    visible: RangeInclusive<usize>,
    scale: f32,
    out: &mut [f32],
) {
    attend(query, keys, values, visible, scale, out)
}

/// `out = softmax(scale · query · keys) · values` over the `visible` positions: every score one
/// fixed-order dot product and `out` one fixed-order weighted sum, in f32.
#[inline(always)]
fn attend<W: Widen>(query: &[f32], keys: Rows<W>, values: Rows<W>, visible: RangeInclusive<usize>, scale: f32, out: &mut [f32]) {
    // A plain loop: code in a closure would not get the caller's AVX2 (the collect around it
    // is compiled for the baseline).
    let mut weights = Vec::with_capacity(visible.clone().count());
    for j in visible.clone() {
        weights.push(dot1(keys.at(j), query) * scale);
    }
    let max = weights.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0f32;
    for w in &mut weights {
        *w = (*w - max).exp();
        total += *w;
    }
    for (j, w) in visible.zip(&weights) {
        let p = w / total;
        for (o, x) in out.iter_mut().zip(values.at(j)) {
            *o += p * x.widen();
        }
    }
}

/// The NeoX half-split rotary embedding on the first `2·half` dims of each head of `x`
/// `[B, H, T, D]`, with `cos`, `sin` f32 `[B, 1, T, half]` (per row's positions), in `x`'s dtype
/// (the tables rounded to it first, as transformers does).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = cos.dim(D::Minus1)?;
    let d = x.dim(D::Minus1)?;
    let (cos, sin) = (cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?);
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let r2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    let mut parts = vec![r1, r2];
    if d > 2 * half {
        parts.push(x.narrow(D::Minus1, 2 * half, d - 2 * half)?);
    }
    Tensor::cat(&parts, D::Minus1)
}

#[cfg(feature = "cuda")]
pub use gpu::{DecodeRows, PagedDecodeRows};

/// A layer's paged KV as the paged kernels read it: one key and one value pool
/// `[blocks · block_size, Hkv, D]` shared by the rows, row `r`'s position `p` at pool row
/// `tables[r][p / block_size] · block_size + p % block_size`, row `r` `lens[r]` positions long
/// (its new positions included). With `codes`, the pools hold quantized vectors
/// (`[.., Hkv, width]` u8) coded so.
pub struct PagedKv<'a> {
    pub keys: &'a Tensor,
    pub values: &'a Tensor,
    pub block_size: usize,
    pub tables: &'a [Vec<u32>],
    pub lens: &'a [usize],
    pub codes: Option<&'a LayerCodes>,
}

/// Writes `k`, `v` (`[B, Hkv, T, D]`) into `kv`'s pools at each row's last `T` positions, in one
/// kernel per side on CUDA; `false` (nothing written) where the kernels do not take them (on the
/// CPU, a block size that is not a power of two), for the caller to write them itself.
pub fn write_paged(k: &Tensor, v: &Tensor, kv: &PagedKv) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if let Some(rows) = gpu::paged_rows(kv)? {
        rows.write(k, v, &Tensor::from_vec(lens_i32(kv.lens)?, kv.lens.len(), k.device())?)?;
        return Ok(true);
    }
    let _ = (k, v, kv);
    Ok(false)
}

/// [`write_paged`], then the attention of `q` (`[B, Hq, T, D]`) over each row's history as
/// [`gated_attention_rows`] (with `gate`) or [`causal_attention_rows`] compute it, reading the
/// pools in place: `None` (nothing written) where the paged kernels do not take the inputs —
/// on the CPU, or more than a few queries per row. Quantized pools are written and read as
/// codes (quantize on append, dequantize in registers).
pub fn paged_append_attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    kv: &PagedKv,
    scoring: Scoring,
    gate: Option<&Tensor>,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if q.dim(2)? <= crate::matmul::MAX_EXACT_ROWS {
        if let Some(rows) = gpu::paged_rows(kv)? {
            let lens = Tensor::from_vec(lens_i32(kv.lens)?, kv.lens.len(), q.device())?;
            return Ok(Some(match gate {
                Some(gate) => rows.append_attend_gated(q, k, v, &lens, scoring, gate)?,
                None => rows.append_attend(q, k, v, &lens, scoring)?,
            }));
        }
    }
    let _ = (q, k, v, kv, scoring, gate);
    Ok(None)
}

/// Row lengths as the kernels' `int`s.
pub fn lens_i32(lens: &[usize]) -> Result<Vec<i32>> {
    lens.iter()
        .map(|&len| {
            i32::try_from(len).map_err(|_| candle_core::Error::Msg(format!("a KV length of {len} past the kernels' int")))
        })
        .collect()
}

/// Per-head RMSNorm (`scale` f32 `[D]`, result rounded to `x`'s dtype) then [`rope`]: `x`
/// `[B, T, H, D]` in, `[B, H, T, D]` out (the layout attention reads). One kernel on CUDA.
pub fn norm_rope(x: &Tensor, scale: &Tensor, eps: f32, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && crate::cuda::supports(x.dtype()) && 2 * cos.dim(D::Minus1)? <= x.dim(D::Minus1)? {
        return gpu::norm_rope(x, scale, eps, cos, sin);
    }
    let normed = crate::norm::rms_norm(x, scale, eps)?;
    rope(&normed.transpose(1, 2)?, cos, sin)
}

/// [`rope`] in f32 with the result rounded to `x`'s dtype once, as transformers rotates a vision
/// tower's queries and keys: `x` `[B, T, H, D]` (any strides) in, `[B, H, T, D]` out (the layout
/// attention reads); `cos`, `sin` `[.., T, half]`. One kernel on CUDA, reading `x` where it lies.
pub fn rope_f32(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && crate::cuda::supports(x.dtype()) && 2 * cos.dim(D::Minus1)? <= x.dim(D::Minus1)? {
        return gpu::rope_f32(x, cos, sin);
    }
    let rotated = rope(&x.transpose(1, 2)?.to_dtype(DType::F32)?.contiguous()?, cos, sin)?;
    rotated.to_dtype(x.dtype())
}

#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::{DType, Tensor};

    use super::Scoring;
    use crate::cuda::{self, Arg};
    use crate::kv_quant::LayerCodes;
    use crate::Result;

    /// The kernels' warps per block, widest head and keys per split (cuda/attention.cu).
    const WARPS: u32 = 16;
    const MAX_HEAD_DIM: usize = 512;
    const SPLIT_KEYS: usize = 512;

    pub(super) fn takes(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<bool> {
        let dtype = q.dtype();
        let (hq, hkv) = (q.dim(0)?, k.dim(0)?);
        Ok(cuda::supports(dtype)
            && k.dtype() == dtype
            && v.dtype() == dtype
            && q.dim(2)? <= MAX_HEAD_DIM
            && k.dim(2)? == q.dim(2)?
            && v.dim(2)? == q.dim(2)?
            && hkv > 0
            && hq % hkv == 0)
    }

    /// `[H, L, D]` with contiguous positions (as the KV store's views are): its head stride,
    /// after copying if its layout is another.
    fn head_strided(x: &Tensor) -> Result<(Tensor, usize)> {
        let (_, l, d) = x.dims3()?;
        let s = x.stride();
        if (s[2] == 1 || d == 1) && (s[1] == d || l == 1) {
            return Ok((x.clone(), s[0]));
        }
        Ok((x.contiguous()?, l * d))
    }

    /// Whether [`prefill`] takes a batch: on CUDA, more queries per row than the decode kernels
    /// take, heads the kernels support.
    pub(super) fn takes_batch(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<bool> {
        Ok(q.device().is_cuda() && q.dim(2)? > crate::matmul::MAX_EXACT_ROWS && takes(&q.get(0)?, &k.get(0)?, &v.get(0)?)?)
    }

    /// Warps of a flash block (cuda/flash.cu's FLASH_WARPS).
    const FLASH_WARPS: u32 = 4;

    /// [`super::flash_attention`].
    pub(super) fn flash(q: &Tensor, k: &Tensor, v: &Tensor, scoring: Scoring, causal: bool) -> Result<Option<Tensor>> {
        let (b, hq, t, d) = q.dims4()?;
        let (kb, hkv, l, kd) = k.dims4()?;
        let name = match d {
            64 => "flash_attention_d64",
            128 => "flash_attention_d128",
            256 => "flash_attention_d256",
            _ => return Ok(None),
        };
        let dtype = q.dtype();
        if !matches!(dtype, DType::BF16 | DType::F16)
            || k.dtype() != dtype
            || v.dtype() != dtype
            || v.dims() != k.dims()
            || (kb, kd) != (b, d)
            || hkv == 0
            || hq % hkv != 0
            || l < if causal { t } else { 1 }
        {
            return Ok(None);
        }
        // Queries a block takes (16 or 32 a warp), keys per tile (fewer at 256) and the shared
        // memory of the queries and two tiles of keys and values, rows padded by 16 bytes
        // (cuda/flash.cu's flash_queries, flash_keys, flash_stride).
        let queries = if d <= 64 { 32 } else { 16 } * FLASH_WARPS as usize;
        let keys = if d <= 128 { 64 } else { 32 };
        let shared = ((queries + 4 * keys) * (d + 8) * dtype.size_in_bytes()) as u32;
        if !cuda::fits(q.device(), &cuda::FLASH, name, dtype, shared) {
            return Ok(None);
        }
        let (q, qs) = rows_in_pieces(q)?;
        let (k, ks) = rows_in_pieces(k)?;
        let (v, vs) = rows_in_pieces(v)?;
        // Written [B, T, Hq, D] (what the projection after attention reads), returned as a
        // [B, Hq, T, D] view of it.
        let out = cuda::output((b, t, hq, d), dtype, q.device())?;
        let grid = |n: usize| u32::try_from(n).ok().filter(|&n| n <= 65535);
        let (Some(heads), Some(rows)) = (grid(hq), grid(b)) else { return Ok(None) };
        let cfg = LaunchConfig {
            grid_dim: (t.div_ceil(queries).max(1) as u32, heads, rows),
            block_dim: (FLASH_WARPS * 32, 1, 1),
            shared_mem_bytes: shared,
        };
        let mut args = vec![Arg::at(&q)?, Arg::at(&k)?, Arg::at(&v)?, Arg::at(&out)?];
        let os = [t * hq * d, d, hq * d];
        args.extend([qs, ks, vs, os].into_iter().flatten().map(|s| Arg::I64(s as i64)));
        args.extend([
            Arg::dim(hq)?,
            Arg::dim(hkv)?,
            Arg::dim(t)?,
            Arg::dim(l)?,
            Arg::I32(i32::from(causal)),
            Arg::F32(scoring.scale as f32),
            Arg::dim(if causal { scoring.window.unwrap_or(0) } else { 0 })?,
        ]);
        cuda::launch(q.device(), &cuda::FLASH, name, dtype, cfg, &args)?;
        Ok(Some(out.transpose(1, 2)?))
    }

    /// `x` `[B, H, L, D]` with its last dimension contiguous and every position's row 16-byte
    /// aligned (copied where not), and its strides of rows, heads and positions (0 for a dimension
    /// of one, whose stride nothing reads).
    fn rows_in_pieces(x: &Tensor) -> Result<(Tensor, [usize; 3])> {
        let strides =
            |x: &Tensor| -> [usize; 3] { std::array::from_fn(|i| if x.dim(i).unwrap_or(1) == 1 { 0 } else { x.stride()[i] }) };
        let whole_pieces = |x: &Tensor| -> Result<bool> {
            let piece = 16 / x.dtype().size_in_bytes();
            Ok(x.stride()[3] == 1 && cuda::in_pieces(x, 0)? && strides(x).iter().all(|s| s % piece == 0))
        };
        let x = if whole_pieces(x)? { x.clone() } else { x.contiguous()? };
        let s = strides(&x);
        Ok((x, s))
    }

    /// Prompt blocks of a batch of rows, `q` `[B, Hq, T, D]` over `k`, `v` `[B, Hkv, L, D]`
    /// (every row's history equally long): the flash kernel where it takes them, else
    /// [`scored_prefill`].
    pub(super) fn prefill(q: &Tensor, k: &Tensor, v: &Tensor, scoring: Scoring, causal: bool) -> Result<Tensor> {
        match flash(q, k, v, scoring, causal)? {
            Some(out) => Ok(out),
            None => scored_prefill(q, k, v, scoring, causal),
        }
    }

    /// [`prefill`] with its scores written out: the scores and the weighted values as
    /// (tensor-core) matmuls batched over rows and KV heads, the causal mask (unless `causal` is
    /// false) and softmax between them as one kernel, without a mask tensor.
    pub(super) fn scored_prefill(q: &Tensor, k: &Tensor, v: &Tensor, scoring: Scoring, causal: bool) -> Result<Tensor> {
        let (b, hq, t_len, d) = q.dims4()?;
        let (_, hkv, l_len, _) = k.dims4()?;
        let qg = q.contiguous()?.reshape((b * hkv, hq / hkv * t_len, d))?;
        // One row keeps its KV views as they are (strided positions are fine for the matmul).
        let heads = |x: &Tensor| if b == 1 { x.squeeze(0) } else { x.reshape((b * hkv, l_len, d)) };
        let (k, v) = (heads(k)?, heads(v)?);
        let scores = qg.matmul(&k.t()?)?.contiguous()?;
        let probs = cuda::output(scores.shape(), scores.dtype(), q.device())?;
        let rows = scores.elem_count() / l_len;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let args = [
            Arg::at(&scores)?,
            Arg::at(&probs)?,
            Arg::dim(l_len)?,
            // The kernel places a row's queries at the last `Tq` positions; as one, every query
            // sits at the last position and sees every key.
            Arg::dim(if causal { t_len } else { 1 })?,
            Arg::F32(scoring.scale as f32),
            Arg::dim(scoring.window.unwrap_or(0))?,
        ];
        cuda::launch(q.device(), &cuda::ATTENTION, "causal_softmax", q.dtype(), cfg, &args)?;
        probs.matmul(&v.contiguous()?)?.reshape((b, hq, t_len, d))
    }

    /// Per row of a batch: its keys' and values' addresses, head strides and length, as the
    /// kernels' `KvRow` table (kept alive with the copies it may point into).
    fn kv_table(kv: &[(Tensor, Tensor)], device: &candle_core::Device) -> Result<(Tensor, Vec<Tensor>)> {
        let mut table = Vec::with_capacity(kv.len() * 5);
        let mut held = Vec::with_capacity(2 * kv.len());
        for (k, v) in kv {
            let ((k, ks), (v, vs)) = (head_strided(k)?, head_strided(v)?);
            let (Arg::Ptr(kp), Arg::Ptr(vp)) = (Arg::at(&k)?, Arg::at(&v)?) else { unreachable!("addresses") };
            table.extend([kp as i64, vp as i64, ks as i64, vs as i64, k.dim(1)? as i64]);
            held.extend([k, v]);
        }
        Ok((Tensor::from_vec(table, (kv.len(), 5), device)?, held))
    }

    /// Whether [`attention_rows`] takes a batch: on CUDA, a few queries per row, every row's
    /// keys and values in a layout the kernels read.
    pub(super) fn takes_rows(q: &Tensor, kv: &[(Tensor, Tensor)]) -> Result<bool> {
        if !q.device().is_cuda() || q.dim(2)? > crate::matmul::MAX_EXACT_ROWS || kv.is_empty() {
            return Ok(false);
        }
        let row = q.get(0)?;
        for (k, v) in kv {
            if !takes(&row, k, v)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Flash-decoding: one block per (query head, or group of heads sharing a KV head
    /// ([`split_kernel`]), and query, row, split of `SPLIT_KEYS` keys) writes a partial softmax,
    /// then one block per query merges its row's partials — with
    /// `gate`, times the output gate as [`attend_table`] applies it (`[B, T, Hq·D]`).
    pub(super) fn attention_rows(q: &Tensor, kv: &[(Tensor, Tensor)], scoring: Scoring, gate: Option<&Tensor>) -> Result<Tensor> {
        let longest = kv.iter().map(|(k, _)| k.dim(1)).collect::<Result<Vec<_>>>()?.into_iter().max().unwrap_or(1);
        let (table, _held) = kv_table(kv, q.device())?;
        let kv_source = KvSource::Rows { table: &table, lens: None };
        attend_table(q, kv_source, kv[0].0.dim(0)?, longest.div_ceil(SPLIT_KEYS).max(1), scoring, gate)
    }

    /// The output gate `[B, T, Hq, D]` for queries `q` `[B, Hq, T, D]` as the combining kernel
    /// reads it: elements contiguous, tokens and heads at strides (copied where they are not).
    fn gate_strided(gate: &Tensor, q: &Tensor) -> Result<(Tensor, usize, usize)> {
        let (b, hq, t, d) = q.dims4()?;
        if gate.dims() != [b, t, hq, d] || gate.dtype() != q.dtype() || !gate.device().same_device(q.device()) {
            candle_core::bail!(
                "attention: gate {:?} ({:?}) for queries {:?} ({:?})",
                gate.dims(),
                gate.dtype(),
                q.dims(),
                q.dtype()
            );
        }
        let s = gate.stride();
        if s[3] == 1 && (b == 1 || s[0] == t * s[1]) {
            return Ok((gate.clone(), s[1], s[2]));
        }
        Ok((gate.contiguous()?, hq * d, d))
    }

    /// Where the split kernel reads a batch's keys and values.
    enum KvSource<'a> {
        /// A `KvRow` table, each row's length from `lens` where given (`attention_split`).
        Rows { table: &'a Tensor, lens: Option<&'a Tensor> },
        /// A paged pool through its rows' block tables, their lengths from `lens`
        /// (`attention_split_paged`).
        Paged { pool: &'a PagedDecodeRows, lens: &'a Tensor },
    }

    impl KvSource<'_> {
        fn is_paged(&self) -> bool {
            matches!(self, KvSource::Paged { .. })
        }
    }

    /// The grouped split kernels (cuda/attention.cu) as (query heads per block, head dim, kernel
    /// over rows, kernel over a pool); the first that fits a launch is taken.
    const GROUPED: [(usize, usize, &str, &str); 6] = [
        (4, 256, "attention_split_g4_d256", "attention_split_paged_g4_d256"),
        (4, 128, "attention_split_g4_d128", "attention_split_paged_g4_d128"),
        (4, 64, "attention_split_g4_d64", "attention_split_paged_g4_d64"),
        (2, 256, "attention_split_g2_d256", "attention_split_paged_g2_d256"),
        (2, 128, "attention_split_g2_d128", "attention_split_paged_g2_d128"),
        (2, 64, "attention_split_g2_d64", "attention_split_paged_g2_d64"),
    ];

    /// The split kernel for `b` rows of `t_len` queries of `hq` heads over `hkv` KV heads of `d`
    /// in `splits` splits, and the query heads each of its blocks takes. The plain kernel has a
    /// block per query head (and query, row, split); a grouped one takes 2 or 4 heads that share
    /// a KV head (where the group divides by them and `d` is one it is compiled for) and loads
    /// each key and value once for them, the plain kernel's bits for each query (attention.cu).
    /// Both run one block per multiprocessor (the grouped ones with 64 registers or fewer, two),
    /// so the plain grid runs in waves of as many blocks; a grouped block does 2 or 4 plain blocks'
    /// queries in less than as many of their times (it loads the keys and values once, and its
    /// warps have more independent work between loads), but on 2 or 4 times fewer
    /// multiprocessors. So the grouped kernel where the plain grid takes two full waves or more
    /// (64 rows of the 4B shape's decode under 512 keys: 1024 plain blocks on 132 H200
    /// multiprocessors; not a batch-1 step, 16 blocks, whose few blocks want all the parallelism
    /// they can get). A judgement from that model, not a measured crossover. Captured steps count
    /// the splits of their tables' width, at most twice their rows' lengths.
    ///
    /// Over codes, the coded kernels of the same grouping (attention_split_codes_g{1,2,4}_d{D}),
    /// which all know D.
    #[allow(clippy::too_many_arguments)]
    fn split_kernel(
        device: &candle_core::Device,
        kv: &KvSource,
        b: usize,
        hq: usize,
        hkv: usize,
        t_len: usize,
        d: usize,
        splits: usize,
    ) -> Result<(&'static str, usize)> {
        let group = hq / hkv;
        let grouped = GROUPED.iter().find(|&&(heads, dim, ..)| group % heads == 0 && dim == d);
        let wide = b * hq * t_len * splits >= 2 * cuda::multiprocessors(device)?;
        let heads = match grouped {
            Some(&(heads, ..)) if wide => heads,
            _ => 1,
        };
        Ok(match (kv, grouped) {
            (KvSource::Paged { pool, .. }, _) if pool.codes.is_some() => {
                let name = CODED
                    .iter()
                    .find(|&&(h, dim, _)| h == heads && dim == d)
                    .map(|&(_, _, name)| name)
                    .ok_or_else(|| candle_core::Error::Msg(format!("no coded attention kernel for heads of {d}")))?;
                (name, heads)
            }
            (kv, Some(&(heads, _, rows, pool))) if wide => (if kv.is_paged() { pool } else { rows }, heads),
            (kv, _) => (if kv.is_paged() { "attention_split_paged" } else { "attention_split" }, 1),
        })
    }

    /// The coded split kernels as (query heads per block, head dim, name).
    const CODED: [(usize, usize, &str); 9] = [
        (1, 64, "attention_split_codes_g1_d64"),
        (1, 128, "attention_split_codes_g1_d128"),
        (1, 256, "attention_split_codes_g1_d256"),
        (2, 64, "attention_split_codes_g2_d64"),
        (2, 128, "attention_split_codes_g2_d128"),
        (2, 256, "attention_split_codes_g2_d256"),
        (4, 64, "attention_split_codes_g4_d64"),
        (4, 128, "attention_split_codes_g4_d128"),
        (4, 256, "attention_split_codes_g4_d256"),
    ];

    /// [`attention_rows`] over the rows of `kv`; `splits` must cover the longest row.
    fn attend_table(
        q: &Tensor,
        kv: KvSource,
        hkv: usize,
        splits: usize,
        scoring: Scoring,
        gate: Option<&Tensor>,
    ) -> Result<Tensor> {
        let gate = gate.map(|g| gate_strided(g, q)).transpose()?;
        let q = q.contiguous()?;
        let (b, hq, t_len, d) = q.dims4()?;
        let queries = b * hq * t_len;
        let partial = cuda::output(queries * splits * (d + 2), DType::F32, q.device())?;
        let block = (32 * WARPS, 1, 1);
        let (kernel, heads) = split_kernel(q.device(), &kv, b, hq, hkv, t_len, d, splits)?;
        let grid = ((hq / heads * t_len) as u32, b as u32, splits as u32);
        let cfg = LaunchConfig { grid_dim: grid, block_dim: block, shared_mem_bytes: 0 };
        // The kernels over rows and over a pool differ only in the KV arguments after q (and
        // over codes, the codes' descriptions at the end).
        let (kv_args, code_args) = match kv {
            KvSource::Rows { table, lens } => (vec![Arg::at(table)?, Arg::at_or_null(lens)?], Vec::new()),
            KvSource::Paged { pool, lens } => (pool.kernel_args(lens)?, pool.code_args()?),
        };
        let mut args = vec![Arg::at(&q)?];
        args.extend(kv_args);
        args.extend([
            Arg::at(&partial)?,
            Arg::dim(hq)?,
            Arg::dim(hkv)?,
            Arg::dim(t_len)?,
            Arg::dim(d)?,
            Arg::dim(splits)?,
            Arg::F32(scoring.scale as f32),
            Arg::dim(scoring.window.unwrap_or(0))?,
        ]);
        args.extend(code_args);
        cuda::launch(q.device(), &cuda::ATTENTION, kernel, q.dtype(), cfg, &args)?;
        let out = match gate {
            Some(_) => cuda::output((b, t_len, hq * d), q.dtype(), q.device())?,
            None => cuda::output((b, hq, t_len, d), q.dtype(), q.device())?,
        };
        let cfg = LaunchConfig { grid_dim: (queries as u32, 1, 1), block_dim: block, shared_mem_bytes: 0 };
        let (gate, gate_token_stride, gate_head_stride) = match &gate {
            Some((g, ts, hs)) => (Arg::at(g)?, *ts, *hs),
            None => (Arg::Ptr(0), 0, 0),
        };
        let args = [
            Arg::at(&partial)?,
            Arg::at(&out)?,
            Arg::dim(queries)?,
            Arg::dim(splits)?,
            Arg::dim(d)?,
            gate,
            Arg::I64(gate_token_stride as i64),
            Arg::I64(gate_head_stride as i64),
            Arg::dim(hq)?,
            Arg::dim(t_len)?,
        ];
        cuda::launch(q.device(), &cuda::ATTENTION, "attention_combine", q.dtype(), cfg, &args)?;
        Ok(out)
    }

    /// One thread per element written.
    pub(super) fn write_rows(src: &Tensor, dst: &[(&Tensor, usize)]) -> Result<()> {
        let table = destinations(dst, src.device())?;
        write_table(src, &table, None)
    }

    /// Per destination buffer: its address, head stride and first position to write, as the
    /// kernel's `KvDestination` table.
    fn destinations(dst: &[(&Tensor, usize)], device: &candle_core::Device) -> Result<Tensor> {
        let mut table = Vec::with_capacity(3 * dst.len());
        for (buf, position) in dst {
            let Arg::Ptr(p) = Arg::at(buf)? else { unreachable!("an address") };
            table.extend([p as i64, buf.stride()[0] as i64, *position as i64]);
        }
        Tensor::from_vec(table, (dst.len(), 3), device)
    }

    /// Writes `src` `[B, H, T, D]` through a `KvDestination` table, each row from `lens - T`
    /// where `lens` is given.
    fn write_table(src: &Tensor, table: &Tensor, lens: Option<&Tensor>) -> Result<()> {
        write_kv(src, "write_rows", vec![Arg::at(table)?, Arg::at_or_null(lens)?])
    }

    /// Writes `src` `[B, H, T, D]` with kernel `name` (`write_rows` or `write_paged`), whose
    /// destination arguments `dst` sit between the source and its shape.
    fn write_kv(src: &Tensor, name: &'static str, dst: Vec<Arg>) -> Result<()> {
        let (b, h, t, d) = src.dims4()?;
        let src = if src.stride()[3] == 1 { src.clone() } else { src.contiguous()? };
        let mut args = vec![Arg::at(&src)?];
        args.extend(dst);
        args.extend(shape_args(&src)?);
        cuda::launch(src.device(), &cuda::ATTENTION, name, src.dtype(), cuda::grid_for(b * h * t * d, 256)?, &args)
    }

    /// The shape of vectors `src` (`[B, H, T, D]`, D contiguous) and its strides for B, H and T,
    /// as the KV writing kernels take them after their destination.
    pub(crate) fn shape_args(src: &Tensor) -> Result<[Arg; 7]> {
        let (b, h, t, d) = src.dims4()?;
        let s = src.stride();
        Ok([
            Arg::dim(b)?,
            Arg::dim(h)?,
            Arg::dim(t)?,
            Arg::dim(d)?,
            Arg::I64(s[0] as i64),
            Arg::I64(s[1] as i64),
            Arg::I64(s[2] as i64),
        ])
    }

    /// A KV store's row buffers (`[Hkv, capacity, D]` each) as the decode kernels read them,
    /// made once for a captured decode step: the tables hold the buffers' addresses (the caller
    /// keeps those buffers, and only uses the tables while they are still the store's), and each
    /// replay's row lengths come from a device tensor the step uploads. The attention splits
    /// cover the buffers' capacity (empty splits add nothing), so the result is the same bits as
    /// [`super::gated_attention_rows`] over the same histories.
    pub struct DecodeRows {
        keys: Tensor,
        values: Tensor,
        rows: Tensor,
        batch: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        splits: usize,
    }

    impl DecodeRows {
        pub fn new(buffers: &[(Tensor, Tensor)]) -> Result<Self> {
            let Some((first, _)) = buffers.first() else { candle_core::bail!("DecodeRows: no rows") };
            let device = first.device();
            let mut capacity = 0;
            for (k, v) in buffers {
                let (_, cap, _) = k.dims3()?;
                if !k.is_contiguous() || !v.is_contiguous() || v.dims() != k.dims() || k.dtype() != first.dtype() {
                    candle_core::bail!("DecodeRows: buffers {:?} / {:?} are not a KV store's", k.shape(), v.shape());
                }
                capacity = capacity.max(cap);
            }
            let at = |side: fn(&(Tensor, Tensor)) -> &Tensor| -> Vec<(&Tensor, usize)> {
                buffers.iter().map(|kv| (side(kv), 0)).collect()
            };
            let (keys, values) = (destinations(&at(|kv| &kv.0), device)?, destinations(&at(|kv| &kv.1), device)?);
            let (rows, _) = kv_table(buffers, device)?;
            let (kv_heads, _, head_dim) = first.dims3()?;
            Ok(Self {
                keys,
                values,
                rows,
                batch: buffers.len(),
                kv_heads,
                head_dim,
                dtype: first.dtype(),
                splits: capacity.div_ceil(SPLIT_KEYS).max(1),
            })
        }

        /// Appends `k`, `v` (`[B, Hkv, T, D]`) to each row and attends `q` (`[B, Hq, T, D]`)
        /// over its history, the output gated as [`super::gated_attention_rows`] gates it
        /// (`[B, T, Hq·D]`); `lens` (`[B]` i32, device) holds each row's length after the append.
        pub fn append_attend_gated(
            &self,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            lens: &Tensor,
            scoring: Scoring,
            gate: &Tensor,
        ) -> Result<Tensor> {
            let (b, hq, _, d) = q.dims4()?;
            if b != self.batch || d != self.head_dim || d > MAX_HEAD_DIM || hq % self.kv_heads != 0 || q.dtype() != self.dtype {
                candle_core::bail!(
                    "DecodeRows: queries {:?} ({:?}) do not fit {} rows of {} KV heads of {}",
                    q.shape(),
                    q.dtype(),
                    self.batch,
                    self.kv_heads,
                    self.head_dim
                );
            }
            write_table(&k.to_dtype(self.dtype)?, &self.keys, Some(lens))?;
            write_table(&v.to_dtype(self.dtype)?, &self.values, Some(lens))?;
            let kv = KvSource::Rows { table: &self.rows, lens: Some(lens) };
            attend_table(q, kv, self.kv_heads, self.splits, scoring, Some(gate))
        }
    }

    /// `kv` as [`PagedDecodeRows`] with its tables uploaded, where the paged kernels take it: a
    /// CUDA pool of a dtype they have (or codes of a head dim the coded kernels are built for),
    /// a power-of-two block size.
    pub(super) fn paged_rows(kv: &super::PagedKv) -> Result<Option<PagedDecodeRows>> {
        let device = kv.keys.device();
        let stored = match kv.codes {
            Some(codes) => kv.keys.dtype() == DType::U8 && codes.read_in_place(),
            None => cuda::supports(kv.keys.dtype()),
        };
        if !device.is_cuda() || !stored || !kv.block_size.is_power_of_two() || kv.tables.is_empty() {
            return Ok(None);
        }
        let width = kv.tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut flat = Vec::with_capacity(kv.tables.len() * width);
        for table in kv.tables {
            flat.extend(table.iter().map(|&b| b as i32));
            flat.extend(std::iter::repeat_n(0, width - table.len()));
        }
        let tables = Tensor::from_vec(flat, (kv.tables.len(), width), device)?;
        PagedDecodeRows::build(kv.keys, kv.values, kv.block_size, &tables, kv.codes.cloned()).map(Some)
    }

    /// Where `encode_codes` writes a pool's new positions: the pool, block tables, each row's
    /// length after the write, the tables' width and the block shift.
    pub(crate) struct PoolTarget<'a> {
        pub(crate) pool: &'a Tensor,
        pub(crate) tables: &'a Tensor,
        pub(crate) lens: &'a Tensor,
        pub(crate) max_blocks: usize,
        pub(crate) shift: u32,
    }

    /// A layer's paged KV as the decode kernels read it, made once for a captured decode step
    /// (as [`DecodeRows`] is for rows in their own buffers): one key and one value pool
    /// `[blocks · block_size, Hkv, D]` shared by every row, token-major, row `b`'s position `p`
    /// at pool row `tables[b][p / block_size] · block_size + p % block_size`; `tables`
    /// (`[B, max_blocks]` i32, device) holds each row's blocks in order (entries past a row's
    /// length are not read). A recording holds the tensors' addresses, not their contents: the
    /// caller rewrites the tables in place between replays, as it uploads `lens`. The attention
    /// splits cover `max_blocks · block_size` keys, so a recording serves any lengths up to that,
    /// and the split kernel runs [`DecodeRows`]' arithmetic in the same order, only its addresses
    /// differ: the same bits over the same histories.
    ///
    /// Pools of codes ([`PagedDecodeRows::coded`], `[.., Hkv, width]` u8) are written by
    /// quantizing each new vector and read by kernels that dequantize in registers; TurboQuant
    /// turns the queries before and the output after (see [`crate::kv_quant::PartCodes`]).
    pub struct PagedDecodeRows {
        keys: Tensor,
        values: Tensor,
        tables: Tensor,
        max_blocks: usize,
        /// log2 of the block size: the kernels find a position's block with a shift.
        block_shift: u32,
        kv_heads: usize,
        head_dim: usize,
        splits: usize,
        codes: Option<LayerCodes>,
    }

    impl PagedDecodeRows {
        /// The layer's pools `keys`, `values` in blocks of `block_size` rows (a power of two) and
        /// the batch's block tables `tables`; its rows are the batch.
        pub fn new(keys: &Tensor, values: &Tensor, block_size: usize, tables: &Tensor) -> Result<Self> {
            Self::build(keys, values, block_size, tables, None)
        }

        /// [`PagedDecodeRows::new`] over pools of codes coded as `codes`.
        pub fn coded(keys: &Tensor, values: &Tensor, block_size: usize, tables: &Tensor, codes: &LayerCodes) -> Result<Self> {
            Self::build(keys, values, block_size, tables, Some(codes.clone()))
        }

        fn build(keys: &Tensor, values: &Tensor, block_size: usize, tables: &Tensor, codes: Option<LayerCodes>) -> Result<Self> {
            let (rows, kv_heads, key_width) = keys.dims3()?;
            let (value_rows, value_heads, value_width) = values.dims3()?;
            let (stored, head_dim) = match &codes {
                Some(c) => (
                    keys.dtype() == DType::U8
                        && key_width == c.keys.width()
                        && value_width == c.values.width()
                        && c.read_in_place(),
                    c.keys.dim(),
                ),
                None => (cuda::supports(keys.dtype()) && value_width == key_width, key_width),
            };
            if (value_rows, value_heads) != (rows, kv_heads)
                || values.dtype() != keys.dtype()
                || !stored
                || !keys.is_contiguous()
                || !values.is_contiguous()
                || !keys.device().is_cuda()
                || !values.device().same_device(keys.device())
                || kv_heads == 0
                || head_dim > MAX_HEAD_DIM
            {
                candle_core::bail!(
                    "PagedDecodeRows: pools {:?} ({:?}) / {:?} ({:?}) are not one CUDA KV pool{}",
                    keys.shape(),
                    keys.dtype(),
                    values.shape(),
                    values.dtype(),
                    if codes.is_some() { " of codes the kernels read" } else { "" }
                );
            }
            if !block_size.is_power_of_two() || rows % block_size != 0 {
                candle_core::bail!(
                    "PagedDecodeRows: block size {block_size} is not a power of two dividing the pool's {rows} rows"
                );
            }
            let (batch, max_blocks) = tables.dims2()?;
            let keys_per_row = max_blocks * block_size;
            if tables.dtype() != DType::I32
                || !tables.is_contiguous()
                || !tables.device().same_device(keys.device())
                || batch == 0
                || max_blocks == 0
                || i32::try_from(keys_per_row).is_err()
            {
                candle_core::bail!(
                    "PagedDecodeRows: block tables {:?} ({:?}) are not [B, max_blocks] i32 on the pools' device",
                    tables.shape(),
                    tables.dtype()
                );
            }
            Ok(Self {
                keys: keys.clone(),
                values: values.clone(),
                tables: tables.clone(),
                max_blocks,
                block_shift: block_size.trailing_zeros(),
                kv_heads,
                head_dim,
                splits: keys_per_row.div_ceil(SPLIT_KEYS).max(1),
                codes,
            })
        }

        /// [`DecodeRows::append_attend_gated`] on the pool: appends `k`, `v` (`[B, Hkv, T, D]`)
        /// at each row's positions `lens - T ..` and attends `q` (`[B, Hq, T, D]`) over its
        /// history, gated (`[B, T, Hq·D]`); `lens` (`[B]` i32, device) holds each row's length
        /// after the append, at most `max_blocks · block_size`.
        pub fn append_attend_gated(
            &self,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            lens: &Tensor,
            scoring: Scoring,
            gate: &Tensor,
        ) -> Result<Tensor> {
            self.append(q, k, v, lens)?;
            self.attend(q, lens, scoring, Some(gate))
        }

        /// [`Self::append_attend_gated`] without the gate (`[B, Hq, T, D]`, as
        /// [`super::causal_attention_rows`] returns it): a verify step of a model whose attention
        /// is not gated.
        pub fn append_attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, lens: &Tensor, scoring: Scoring) -> Result<Tensor> {
            self.append(q, k, v, lens)?;
            self.attend(q, lens, scoring, None)
        }

        /// The split kernels over the pool; for codes, with queries and output turned where
        /// TurboQuant reads its codes short of their rotation.
        fn attend(&self, q: &Tensor, lens: &Tensor, scoring: Scoring, gate: Option<&Tensor>) -> Result<Tensor> {
            let source = KvSource::Paged { pool: self, lens };
            let Some(codes) = &self.codes else {
                return attend_table(q, source, self.kv_heads, self.splits, scoring, gate);
            };
            let turned = match codes.keys.is_rotated() {
                true => codes.keys.rotate(q)?.to_dtype(q.dtype())?,
                false => q.clone(),
            };
            if !codes.values.is_rotated() {
                return attend_table(&turned, source, self.kv_heads, self.splits, scoring, gate);
            }
            let out = attend_table(&turned, source, self.kv_heads, self.splits, scoring, None)?;
            let out = codes.values.unrotate(&out)?.to_dtype(q.dtype())?;
            match gate {
                Some(gate) => super::sigmoid_gate(&out, gate),
                None => Ok(out),
            }
        }

        /// Writes `k`, `v` (`[B, Hkv, T, D]`) at each row's positions `lens - T ..` (`lens` `[B]`
        /// i32, device: each row's length after the write), encoded where the pool holds codes.
        pub fn write(&self, k: &Tensor, v: &Tensor, lens: &Tensor) -> Result<()> {
            let (b, _, t, d) = k.dims4()?;
            let batch = self.tables.dim(0)?;
            let new = [b, self.kv_heads, t, d];
            if b != batch
                || d != self.head_dim
                || k.dims() != new
                || v.dims() != new
                || lens.dims() != [b]
                || lens.dtype() != DType::I32
            {
                candle_core::bail!(
                    "PagedDecodeRows: keys {:?}, values {:?}, lengths {:?} ({:?}) do not fit {batch} rows of {} KV heads of {}",
                    k.shape(),
                    v.shape(),
                    lens.shape(),
                    lens.dtype(),
                    self.kv_heads,
                    self.head_dim,
                );
            }
            if let Some(codes) = &self.codes {
                for (src, pool, part) in [(k, &self.keys, &codes.keys), (v, &self.values, &codes.values)] {
                    let target =
                        PoolTarget { pool, tables: &self.tables, lens, max_blocks: self.max_blocks, shift: self.block_shift };
                    crate::kv_quant::gpu::encode(part, src, Some(target))?;
                }
                return Ok(());
            }
            for (src, pool) in [(k, &self.keys), (v, &self.values)] {
                let dst = [Arg::at(pool)?, Arg::at(&self.tables)?, Arg::at(lens)?, Arg::dim(self.max_blocks)?, self.shift()?];
                write_kv(&src.to_dtype(pool.dtype())?, "write_paged", dst.into())?;
            }
            Ok(())
        }

        /// Checks the queries against the pool and writes `k`, `v` into it.
        fn append(&self, q: &Tensor, k: &Tensor, v: &Tensor, lens: &Tensor) -> Result<()> {
            let (b, hq, t, d) = q.dims4()?;
            let dtype_fits = self.codes.is_some() && cuda::supports(q.dtype()) || q.dtype() == self.keys.dtype();
            if d != self.head_dim || hq % self.kv_heads != 0 || !dtype_fits || k.dims4()?.2 != t || k.dim(0)? != b {
                candle_core::bail!(
                    "PagedDecodeRows: queries {:?} ({:?}) for keys {:?} do not fit KV heads of {} ({:?})",
                    q.shape(),
                    q.dtype(),
                    k.shape(),
                    self.head_dim,
                    self.keys.dtype()
                );
            }
            self.write(k, v, lens)
        }

        /// The split kernel's KV arguments before `partial`: the pools, the block tables, `lens`,
        /// the tables' width and the block shift.
        fn kernel_args(&self, lens: &Tensor) -> Result<Vec<Arg>> {
            Ok(vec![
                Arg::at(&self.keys)?,
                Arg::at(&self.values)?,
                Arg::at(&self.tables)?,
                Arg::at(lens)?,
                Arg::dim(self.max_blocks)?,
                self.shift()?,
            ])
        }

        /// The coded split kernel's arguments after the scoring: each part's description.
        fn code_args(&self) -> Result<Vec<Arg>> {
            let mut args = Vec::new();
            if let Some(codes) = &self.codes {
                args.extend(crate::kv_quant::gpu::part_args(&codes.keys, false)?);
                args.extend(crate::kv_quant::gpu::part_args(&codes.values, false)?);
            }
            Ok(args)
        }

        fn shift(&self) -> Result<Arg> {
            Arg::dim(self.block_shift as usize)
        }
    }

    /// One warp per (row, token, head).
    pub(super) fn norm_rope(x: &Tensor, scale: &Tensor, eps: f32, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (b, t, h, d) = x.dims4()?;
        let half = cos.dim(3)?;
        let s = x.stride();
        // Heads may sit apart (q is cut from q_proj's [q | gate] per head); elements may not.
        let (x, token_stride, head_stride) =
            if s[3] == 1 && (b == 1 || s[0] == t * s[1]) { (x.clone(), s[1], s[2]) } else { (x.contiguous()?, h * d, d) };
        let f32 = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
        let (scale, cos, sin) = (f32(scale)?, f32(cos)?, f32(sin)?);
        let out = cuda::output((b, h, t, d), x.dtype(), x.device())?;
        let rows = b * t * h;
        let cfg = LaunchConfig {
            grid_dim: ((rows as u32).div_ceil(WARPS).max(1), 1, 1),
            block_dim: (32 * WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            Arg::at(&x)?,
            Arg::at(&scale)?,
            Arg::at(&cos)?,
            Arg::at(&sin)?,
            Arg::at(&out)?,
            Arg::dim(b)?,
            Arg::dim(t)?,
            Arg::dim(h)?,
            Arg::dim(d)?,
            Arg::dim(half)?,
            Arg::I64(token_stride as i64),
            Arg::I64(head_stride as i64),
            Arg::F32(eps),
        ];
        cuda::launch(x.device(), &cuda::ATTENTION, "norm_rope", x.dtype(), cfg, &args)?;
        Ok(out)
    }

    /// [`super::rope_f32`].
    pub(super) fn rope_f32(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (b, t, h, d) = x.dims4()?;
        let half = cos.dim(candle_core::D::Minus1)?;
        let x = if x.stride()[3] == 1 { x.clone() } else { x.contiguous()? };
        let table = |c: &Tensor| c.to_dtype(DType::F32)?.reshape(((), t, half))?.broadcast_as((b, t, half))?.contiguous();
        let (cos, sin) = (table(cos)?, table(sin)?);
        let out = cuda::output((b, h, t, d), x.dtype(), x.device())?;
        let s = x.stride();
        let args = [
            Arg::at(&x)?,
            Arg::at(&cos)?,
            Arg::at(&sin)?,
            Arg::at(&out)?,
            Arg::dim(b)?,
            Arg::dim(t)?,
            Arg::dim(h)?,
            Arg::dim(d)?,
            Arg::dim(half)?,
            Arg::I64(s[0] as i64),
            Arg::I64(s[1] as i64),
            Arg::I64(s[2] as i64),
        ];
        // One thread per rotated pair or unrotated dim.
        cuda::launch(x.device(), &cuda::ATTENTION, "rope_f32", x.dtype(), cuda::grid_for(b * h * t * (d - half), 256)?, &args)?;
        Ok(out)
    }
}

fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Scorings every test covers: plain causal and two sliding windows.
    fn scorings(scale: f64) -> [Scoring; 3] {
        [Scoring::scaled(scale), Scoring { scale, window: Some(3) }, Scoring { scale, window: Some(1) }]
    }

    /// Every query over every key, by the definition; and in blocks of queries, the same.
    #[test]
    fn full_attention_sees_every_key_in_any_blocks() {
        let dev = Device::Cpu;
        let (h, t, d) = (2, 7, 4);
        let q = Tensor::randn(0f32, 1.0, (1, h, t, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, h, t, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, h, t, d), &dev).unwrap();
        let (qs, ks, vs) = [&q, &k, &v].map(|x| x.flatten_all().unwrap().to_vec1::<f32>().unwrap()).into();
        let at = |x: &[f32], hh: usize, i: usize, j: usize| x[(hh * t + i) * d + j];
        let mut want = vec![0f32; h * t * d];
        for hh in 0..h {
            for i in 0..t {
                let scores: Vec<f32> =
                    (0..t).map(|j| (0..d).map(|c| at(&qs, hh, i, c) * at(&ks, hh, j, c)).sum::<f32>() * 0.5).collect();
                let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let total: f32 = scores.iter().map(|s| (s - max).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    for c in 0..d {
                        want[(hh * t + i) * d + c] += (s - max).exp() / total * at(&vs, hh, j, c);
                    }
                }
            }
        }
        for max_scores in [FULL_ATTENTION_SCORES, h * t * 3, 1] {
            let got =
                full_attention_within(&q, &k, &v, 0.5, max_scores).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 1e-5, "blocks of {max_scores} scores: off by {worst}");
        }
    }

    /// Against a direct per-head, per-position loop, for both paths.
    #[test]
    fn matches_naive_loop() {
        let dev = Device::Cpu;
        let (hq, hkv, t, l, d) = (4, 2, 3, 5, 8);
        let gen = |n: usize, s: f32| (0..n).map(|i| (i as f32 * 0.31 + s).cos()).collect::<Vec<_>>();
        let qd = gen(hq * t * d, 0.2);
        let kd = gen(hkv * l * d, 1.1);
        let vd = gen(hkv * l * d, 2.3);
        let q = Tensor::from_vec(qd.clone(), (hq, t, d), &dev).unwrap();
        let k = Tensor::from_vec(kd.clone(), (hkv, l, d), &dev).unwrap();
        let v = Tensor::from_vec(vd.clone(), (hkv, l, d), &dev).unwrap();
        for scoring in scorings(1.0 / (d as f64).sqrt()) {
            let fast = causal_attention(&q, &k, &v, scoring).unwrap();
            let slow = reference(&q, &k, &v, scoring).unwrap();
            for out in [fast, slow] {
                let out = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for h in 0..hq {
                    let kh = h / (hq / hkv);
                    for i in 0..t {
                        let pos = l - t + i;
                        let first = scoring.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                        let s: Vec<f32> = (first..=pos)
                            .map(|j| {
                                let dot = (0..d).map(|x| qd[(h * t + i) * d + x] * kd[(kh * l + j) * d + x]).sum::<f32>();
                                dot * scoring.scale as f32
                            })
                            .collect();
                        let m = s.iter().cloned().fold(f32::MIN, f32::max);
                        let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
                        for x in 0..d {
                            let want: f32 =
                                (first..=pos).zip(&s).map(|(j, s)| (s - m).exp() / z * vd[(kh * l + j) * d + x]).sum();
                            let got = out[(h * t + i) * d + x];
                            assert!((want - got).abs() < 1e-5, "{scoring:?} h{h} i{i} x{x}: {want} vs {got}");
                        }
                    }
                }
            }
        }
    }

    /// The gate against its formula element by element: the layout, the sigmoid rounded once
    /// to bf16 (over inputs where rounding each of its steps gives other bits), the product
    /// rounded again.
    #[test]
    fn sigmoid_gate_rounds_as_transformers() {
        let dev = Device::Cpu;
        let (b, h, t, d) = (2, 3, 2, 64);
        let n = b * h * t * d;
        let ramp = |n: usize, s: f32, f: f32| (0..n).map(|i| (i as f32 * f + s).sin() * 6.0).collect::<Vec<_>>();
        let round = |x: f32| half::bf16::from_f32(x).to_f32();
        let attended = Tensor::from_vec(ramp(n, 0.3, 0.71), (b, h, t, d), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        // The gate cut from a wider per-head [q | gate] tensor, as the model cuts it.
        let wide = Tensor::from_vec(ramp(2 * n, 1.7, 0.13), (b, t, h, 2 * d), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let gate = wide.narrow(3, d, d).unwrap();
        let got = sigmoid_gate(&attended, &gate).unwrap();
        assert_eq!(got.dims(), [b, t, h * d]);
        let (a, g, got) = [&attended, &gate, &got]
            .map(|x| x.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .into();
        let mut steps_differ = 0;
        for (bi, ti, hi, di) in
            (0..b).flat_map(|bi| (0..t).flat_map(move |ti| (0..h).flat_map(move |hi| (0..d).map(move |di| (bi, ti, hi, di)))))
        {
            let gv = g[((bi * t + ti) * h + hi) * d + di];
            let sigmoid = round(1.0 / (1.0 + (-gv).exp()));
            let stepwise = round(1.0 / round(round((-gv).exp()) + 1.0));
            steps_differ += usize::from(sigmoid != stepwise);
            let want = round(a[((bi * h + hi) * t + ti) * d + di] * sigmoid);
            assert_eq!(got[((bi * t + ti) * h + hi) * d + di], want, "b{bi} t{ti} h{hi} d{di}");
        }
        assert!(steps_differ > 0, "no input where rounding each step of the sigmoid differs: the test would not see it");
    }

    /// The fast path against the tensor-op twin on a strided KV view (as the KV store hands
    /// out), and each query's result independent of how many queries share the call.
    #[test]
    fn few_queries_match_reference_and_do_not_depend_on_t() {
        let dev = Device::Cpu;
        let (hq, hkv, l, cap, d) = (4, 2, 9, 16, 40);
        let gen = |n: usize, s: f32| (0..n).map(|i| (i as f32 * 0.37 + s).sin()).collect::<Vec<_>>();
        for (dtype, scoring) in [DType::F32, DType::BF16].into_iter().flat_map(|t| scorings(0.2).map(|s| (t, s))) {
            let buf = |s| Tensor::from_vec(gen(hkv * cap * d, s), (hkv, cap, d), &dev).unwrap().to_dtype(dtype).unwrap();
            let (k, v) = (buf(0.5).narrow(1, 0, l).unwrap(), buf(1.5).narrow(1, 0, l).unwrap());
            let q = Tensor::from_vec(gen(hq * 5 * d, 2.5), (hq, 5, d), &dev).unwrap().to_dtype(dtype).unwrap();
            let fast = causal_attention(&q, &k, &v, scoring).unwrap().to_dtype(DType::F32).unwrap();
            let slow = reference(&q, &k, &v, scoring).unwrap().to_dtype(DType::F32).unwrap();
            let diff = (&fast - &slow).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
            assert!(diff < if dtype == DType::F32 { 1e-5 } else { 2e-2 }, "{dtype:?} {scoring:?}: {diff}");
            // The last query alone, over the same keys: the same bits.
            let last = causal_attention(&q.narrow(1, 4, 1).unwrap(), &k, &v, scoring).unwrap();
            let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(bits(&last), bits(&fast.narrow(1, 4, 1).unwrap().to_dtype(dtype).unwrap()));
        }
    }
}
