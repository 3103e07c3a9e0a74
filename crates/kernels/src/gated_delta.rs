//! Gated DeltaNet recurrence (Qwen3.5 / Qwen3-Next linear attention): token by token, or by
//! chunks of tokens in the equivalent chunk-parallel form.
//!
//! Per value head `h` with key head `h / (Hv / Hk)` and state `S` laid out `[Dv, Dk]`:
//! ```text
//! q, k  = l2norm(q), l2norm(k);  q *= 1/sqrt(Dk)
//! g     = -exp(A_log) * softplus(a + dt_bias);   beta = sigmoid(b)
//! S     = exp(g) * S
//! S    += (beta * (v - S k)) k^T
//! o     = S q
//! ```
//! Inputs are taken in any float dtype; the arithmetic is f32, as in transformers (CUDA's chunked
//! kernels round the operands of their tensor-core products to the 16-bit input dtype and
//! accumulate in f32). The state is f32, or stored in bf16 (vLLM's `mamba_ssm_cache_dtype`):
//! held in f32 and rounded to bf16 after every token where the recurrence steps token by token
//! (every CPU path, decode and verify steps on CUDA: a verify block leaves each position what
//! decoding it alone would), after every call where it runs by chunks (prompts on tensor cores).
//! The state layout `[B, Hv, Dv, Dk]` keeps every inner loop contiguous over `Dk`.

use candle_core::{DType, Device, Tensor, D};
use rayon::prelude::*;

use crate::{cpu_f32, Result};

/// Per-layer constants of the gating.
pub struct Gating<'a> {
    /// `A_log`, `[Hv]`.
    pub a_log: &'a Tensor,
    /// `dt_bias`, `[Hv]`.
    pub dt_bias: &'a Tensor,
}

/// One call's per-token inputs, in any float dtype.
#[derive(Clone, Copy)]
pub struct Inputs<'a> {
    /// `[B, T, Hk, Dk]`.
    pub q: &'a Tensor,
    /// `[B, T, Hk, Dk]`.
    pub k: &'a Tensor,
    /// `[B, T, Hv, Dv]`.
    pub v: &'a Tensor,
    /// The decay's raw projection, `[B, T, Hv]`.
    pub a: &'a Tensor,
    /// The write strength's raw projection (before the sigmoid), `[B, T, Hv]`.
    pub b: &'a Tensor,
}

/// Runs the recurrence over `T` tokens for `B` rows from `state` `[B, Hv, Dv, Dk]` (f32 or bf16).
/// Returns the output `[B, T, Hv, Dv]` (f32) and the new state, in `state`'s dtype.
pub fn gated_delta_rule(inputs: &Inputs, gating: &Gating, state: &Tensor) -> Result<(Tensor, Tensor)> {
    if !matches!(state.dtype(), DType::F32 | DType::BF16) {
        candle_core::bail!("a recurrent state is stored in f32 or bf16, not {:?}", state.dtype());
    }
    let (out, new_state) = gated_delta_rule_f32(inputs, gating, state)?;
    Ok((out, new_state.to_dtype(state.dtype())?))
}

/// [`gated_delta_rule`], its new state in f32 (or already in `state`'s dtype, where a kernel
/// writes it so).
fn gated_delta_rule_f32(inputs: &Inputs, gating: &Gating, state: &Tensor) -> Result<(Tensor, Tensor)> {
    let q = inputs.q;
    // Decode steps and verify blocks go token by token (on CUDA the fused step kernel, whose
    // arithmetic per token does not depend on the block's length: what speculative rollback
    // relies on); prompts go by chunks (on CUDA, the tensor-core kernels for 16-bit inputs with
    // 128-wide heads; f32 inputs keep the step kernel's exact f32 arithmetic at every length).
    // (A rollback re-folds its kept positions through this same dispatch, so it matches a
    // forward over only those tokens.)
    match q.device() {
        Device::Cpu => cpu::run(inputs, gating, state),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) if gpu::takes(inputs)? => match gpu::takes_chunked(inputs)? {
            true => gpu::chunked(inputs, gating, state),
            false => gpu::steps(inputs, gating, state, None),
        },
        _ if q.dim(1)? > STEPWISE_MAX => chunked(inputs, gating, state),
        _ => reference(inputs, gating, state),
    }
}

/// Whether [`gated_delta_rule`] takes `inputs` by chunks on tensor cores (CUDA kernels for 16-bit
/// prompts with 128-wide heads, on GPUs that grant their shared memory) rather than step by step.
#[cfg(feature = "cuda")]
pub fn on_tensor_cores(inputs: &Inputs) -> Result<bool> {
    Ok(inputs.q.device().is_cuda() && gpu::takes(inputs)? && gpu::takes_chunked(inputs)?)
}

/// [`gated_delta_rule`] writing the new state over `state` (f32 or bf16, contiguous) instead of to fresh
/// memory, for a captured decode step whose state buffers stay put between replays; returns the
/// output. With `slots` (`[B]` i32, device), `state` is a pool `[S, Hv, Dv, Dk]` and row `b`'s
/// state is `state[slots[b]]`; without, `state` is `[B, Hv, Dv, Dk]`. The caller must be the
/// state's only holder. CUDA only; the same kernel and the same bits as [`gated_delta_rule`]
/// there (each block reads its state rows before writing them).
#[cfg(feature = "cuda")]
pub fn gated_delta_rule_in_place(inputs: &Inputs, gating: &Gating, state: &Tensor, slots: Option<&Tensor>) -> Result<Tensor> {
    let Inputs { q, v, .. } = *inputs;
    let (bsz, _, _, dk) = q.dims4()?;
    let (_, _, hv, dv) = v.dims4()?;
    let rows_fit = match slots {
        Some(slots) => slots.dims() == [bsz] && slots.dtype() == DType::I32 && state.dims().get(1..) == Some(&[hv, dv, dk][..]),
        None => state.dims() == [bsz, hv, dv, dk],
    };
    let stored = matches!(state.dtype(), DType::F32 | DType::BF16);
    if !q.device().is_cuda() || !gpu::takes(inputs)? || !stored || !state.is_contiguous() || !rows_fit {
        candle_core::bail!(
            "the in-place gated delta rule takes CUDA inputs the kernel handles and a contiguous f32 or bf16 state"
        );
    }
    Ok(gpu::steps(inputs, gating, state, Some(slots))?.0)
}

fn softplus(x: &Tensor) -> Result<Tensor> {
    // Stable: max(x, 0) + log(1 + exp(-|x|)).
    x.relu()? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?
}

fn l2norm(x: &Tensor) -> Result<Tensor> {
    x.broadcast_div(&(x.sqr()?.sum_keepdim(D::Minus1)? + 1e-6)?.sqrt()?)
}

/// The inputs in f32, per value head: `q` (normalised, scaled), `k` (normalised) `[B, T, Hv, Dk]`,
/// `v` `[B, T, Hv, Dv]`, the log decay `g` and the write strength `beta` `[B, T, Hv]`.
fn prepared(inputs: &Inputs, gating: &Gating) -> Result<[Tensor; 5]> {
    let Inputs { q, k, v, a, b } = *inputs;
    let dk = q.dim(3)?;
    let group = v.dim(2)? / q.dim(2)?;
    let f = |x: &Tensor| x.to_dtype(DType::F32);
    let expand = |x: Tensor| -> Result<Tensor> {
        // [B, T, Hk, Dk] -> [B, T, Hv, Dk], value head h reads key head h / group.
        let (b_, t_, h_, d_) = x.dims4()?;
        x.unsqueeze(3)?.expand((b_, t_, h_, group, d_))?.reshape((b_, t_, h_ * group, d_))
    };
    let q = (expand(l2norm(&f(q)?)?)? * (1.0 / (dk as f64).sqrt()))?;
    let k = expand(l2norm(&f(k)?)?)?;
    let g = softplus(&f(a)?.broadcast_add(&f(gating.dt_bias)?)?)?.broadcast_mul(&f(gating.a_log)?.exp()?.neg()?)?;
    Ok([q, k, f(v)?, g, sigmoid(&f(b)?)?])
}

/// The slow twin: the same recurrence from tensor ops, one token per step. Runs on any device.
pub fn reference(inputs: &Inputs, gating: &Gating, state: &Tensor) -> Result<(Tensor, Tensor)> {
    let Inputs { q, v, .. } = *inputs;
    let (bsz, t_len, _, _) = q.dims4()?;
    let hv = v.dim(2)?;
    let [q, k, v, g, beta] = prepared(inputs, gating)?;
    let mut s = state.to_dtype(DType::F32)?;
    let mut outs = Vec::with_capacity(t_len);
    for t in 0..t_len {
        let q_t = q.narrow(1, t, 1)?.squeeze(1)?.contiguous()?; // [B, Hv, Dk]
        let k_t = k.narrow(1, t, 1)?.squeeze(1)?.contiguous()?;
        let v_t = v.narrow(1, t, 1)?.squeeze(1)?; // [B, Hv, Dv]
        let decay = g.narrow(1, t, 1)?.squeeze(1)?.exp()?.reshape((bsz, hv, 1, 1))?;
        let beta_t = beta.narrow(1, t, 1)?.squeeze(1)?.unsqueeze(2)?; // [B, Hv, 1]
        s = s.broadcast_mul(&decay)?;
        let kv_mem = s.matmul(&k_t.unsqueeze(3)?)?.squeeze(3)?; // [B, Hv, Dv]
        let delta = (v_t - kv_mem)?.broadcast_mul(&beta_t)?;
        s = (s + delta.unsqueeze(3)?.matmul(&k_t.unsqueeze(2)?)?)?;
        outs.push(s.matmul(&q_t.unsqueeze(3)?)?.squeeze(3)?);
        if state.dtype() == DType::BF16 {
            s = s.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        }
    }
    Ok((Tensor::stack(&outs, 1)?, s))
}

/// Longest input that devices without a fused kernel run step by step rather than by chunks: at
/// least the widest verify block (16 drafts and the last token), whose positions must compute as
/// decode steps would.
const STEPWISE_MAX: usize = 32;

/// Tokens per chunk of [`chunked`].
pub const CHUNK: usize = 64;

/// The same recurrence in the chunk-parallel (WY / UT-transform) form: within a chunk of
/// `CHUNK` tokens every interaction is a matrix product, and only the state passes from chunk
/// to chunk — a few dozen batched matmuls per chunk instead of a dozen ops per token. Runs on
/// any device from tensor ops: the path for long inputs on devices without a fused kernel, and
/// the algebra CUDA's chunked tensor-core kernels (cuda/recurrent.cu) implement. With `G` the
/// within-chunk cumulative log decay and
/// `Γ[i, j] = exp(G_i − G_j)` for `j ≤ i`:
/// ```text
/// T      = (I + strict_lower(diag(β) K Kᵀ ∘ Γ))⁻¹          (the UT transform)
/// U      = T diag(β) V;   W = T diag(β exp(G)) K
/// V'     = U − W Sᵀ                                         (per chunk, S carried)
/// O      = diag(exp(G)) Q Sᵀ + lower(Q Kᵀ ∘ Γ) V'
/// S      = exp(G_last) S + V'ᵀ diag(exp(G_last − G)) K
/// ```
/// The inverse of `I + L` (`L` strictly lower, so nilpotent) is the product
/// `(I − L)(I + L²)(I + L⁴)…(I + L³²)` for 64 tokens: six factors, five squarings.
pub fn chunked(inputs: &Inputs, gating: &Gating, state: &Tensor) -> Result<(Tensor, Tensor)> {
    let Inputs { q, v, .. } = *inputs;
    let (bsz, t_len, _, _) = q.dims4()?;
    let hv = v.dim(2)?;
    let dev = q.device();
    let n = t_len.div_ceil(CHUNK);
    let padded = n * CHUNK;
    let heads = bsz * hv;
    // [B, T, Hv, D] -> [B·Hv·N, C, D], zero-padded: a padded token has k = v = 0 and g = 0, so
    // it neither decays nor writes the state.
    let chunks = |x: Tensor| -> Result<Tensor> {
        let x = x.transpose(1, 2)?.contiguous()?;
        let x = if padded > t_len { x.pad_with_zeros(2, 0, padded - t_len)? } else { x };
        let d = x.dim(3)?;
        x.reshape((heads * n, CHUNK, d))
    };
    let [q, k, v, g, beta] = prepared(inputs, gating)?;
    let (q, k, v) = (chunks(q)?, chunks(k)?, chunks(v)?);
    let beta = chunks(beta.unsqueeze(3)?)?; // [B·Hv·N, C, 1]
    let cum = chunks(g.unsqueeze(3)?)?.squeeze(2)?.cumsum(1)?; // G, [B·Hv·N, C]
    let lower = Tensor::tril2(CHUNK, DType::F32, dev)?;
    let eye = Tensor::eye(CHUNK, DType::F32, dev)?;
    // Γ: exp(G_i − G_j) on and below the diagonal, 0 above; clamped before exp so the masked
    // entries cannot overflow.
    let diff = cum.unsqueeze(2)?.broadcast_sub(&cum.unsqueeze(1)?)?;
    let gamma = diff.minimum(0f32)?.exp()?.broadcast_mul(&lower)?;
    let k_t = k.transpose(1, 2)?.contiguous()?;
    let k_beta = k.broadcast_mul(&beta)?;
    let l = k_beta.matmul(&k_t)?.mul(&gamma)?.broadcast_mul(&(&lower - &eye)?)?;
    let mut inverse = eye.broadcast_sub(&l)?;
    let mut power = l;
    for _ in 1..CHUNK.trailing_zeros() {
        power = power.matmul(&power)?;
        inverse = inverse.matmul(&power.broadcast_add(&eye)?)?;
    }
    let decay = cum.exp()?.unsqueeze(2)?; // exp(G), [B·Hv·N, C, 1]
                                          // Per chunk from here: [B·Hv, N, C, ·].
    let per_chunk = |x: Tensor| -> Result<Tensor> {
        let (c, d) = (x.dim(1)?, x.dim(2)?);
        x.reshape((heads, n, c, d))
    };
    let u = per_chunk(inverse.matmul(&v.broadcast_mul(&beta)?)?)?;
    let w = per_chunk(inverse.matmul(&k_beta.broadcast_mul(&decay)?)?)?;
    let intra = per_chunk(q.matmul(&k_t)?.mul(&gamma)?)?;
    let q_decayed = per_chunk(q.broadcast_mul(&decay)?)?;
    let (k, cum) = (per_chunk(k)?, per_chunk(cum.unsqueeze(2)?)?);
    let (dv, dk) = (state.dim(2)?, state.dim(3)?);
    let mut s = state.to_dtype(DType::F32)?.reshape((heads, dv, dk))?;
    let mut outs = Vec::with_capacity(n);
    for c in 0..n {
        let at = |x: &Tensor| x.narrow(1, c, 1)?.squeeze(1); // [B·Hv, C, ·]
        let s_t = s.transpose(1, 2)?.contiguous()?; // [B·Hv, Dk, Dv]
        let v_new = (at(&u)? - at(&w)?.matmul(&s_t)?)?;
        outs.push((at(&q_decayed)?.matmul(&s_t)? + at(&intra)?.matmul(&v_new)?)?);
        let cum_c = at(&cum)?; // [B·Hv, C, 1]
        let last = cum_c.narrow(1, CHUNK - 1, 1)?; // [B·Hv, 1, 1]
        let k_weighted = at(&k)?.broadcast_mul(&last.broadcast_sub(&cum_c)?.exp()?)?;
        s = (s.broadcast_mul(&last.exp()?)? + v_new.transpose(1, 2)?.contiguous()?.matmul(&k_weighted)?)?;
    }
    // [B·Hv, N·C, Dv] -> [B, T, Hv, Dv]
    let out = Tensor::cat(&outs, 1)?.reshape((bsz, hv, padded, dv))?.narrow(2, 0, t_len)?.transpose(1, 2)?.contiguous()?;
    let s = s.reshape((bsz, hv, dv, dk))?;
    Ok((out, s))
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::{DType, Tensor};

    use super::{Gating, Inputs};
    use crate::cuda::{self, Arg};
    use crate::Result;

    /// The kernel's tiling (cuda/recurrent.cu): warps per block, state rows per warp, tokens
    /// staged at once, and the key head widths it is compiled for (each lane holds a 32nd of a
    /// row), the widest last.
    const WARPS: usize = 4;
    const ROWS_PER_WARP: usize = 2;
    const TOKEN_TILE: usize = 16;
    const KEY_WIDTHS: [usize; 3] = [32, 128, 256];
    const MAX_KEY_DIM: usize = KEY_WIDTHS[2];
    /// The step kernels by state dtype (f32, bf16) and key width.
    const STEPS: [[&str; 3]; 2] = [
        ["gated_delta_steps_k32", "gated_delta_steps_k128", "gated_delta_steps_k256"],
        ["gated_delta_steps_bf16_state_k32", "gated_delta_steps_bf16_state_k128", "gated_delta_steps_bf16_state_k256"],
    ];

    pub(super) fn takes(inputs: &Inputs) -> Result<bool> {
        let Inputs { q, k, v, a, b } = *inputs;
        let dtype = q.dtype();
        let same = [k, v, a, b].iter().all(|t| t.dtype() == dtype);
        let (hk, hv) = (q.dim(2)?, v.dim(2)?);
        Ok(cuda::supports(dtype) && same && q.dim(3)? <= MAX_KEY_DIM && hk > 0 && hv % hk == 0)
    }

    /// The distance between consecutive tokens of `x` `[B, T, H, D]` whose heads lie contiguous
    /// (the narrowed conv output of a single token is such a view; candle's reshape copies it
    /// otherwise), after copying `x` if its layout is another.
    fn token_strided(x: &Tensor) -> Result<(Tensor, usize)> {
        let (b, t, h, d) = x.dims4()?;
        let s = x.stride();
        let token = if t == 1 { s[0] } else { s[1] };
        if (s[3] == 1 || d == 1) && (s[2] == d || h == 1) && (b == 1 || s[0] == t * token) {
            return Ok((x.clone(), token));
        }
        Ok((x.contiguous()?, h * d))
    }

    /// Tokens per chunk and head width of the chunked kernels (cuda/recurrent.cu).
    const CHUNK: usize = super::CHUNK;
    const CHUNK_HEAD: usize = 128;
    /// State columns per block of the chunk scan. The kernels' dynamic shared memory (rows padded
    /// by 16 bytes): the preparation's two `[CHUNK][128 + 8]` 16-bit tiles, `[CHUNK][CHUNK + 4]`
    /// f32 matrix and three f32 vectors; the scan's two chunk buffers (`ScanChunk`: three
    /// `[CHUNK][128 + 8]` and a `[CHUNK][CHUNK + 8]` 16-bit tile, a `[CHUNK][SCAN_COLS + 8]` f32 tile).
    const SCAN_COLS: usize = 32;
    const PREPARE_SHARED: u32 = (2 * CHUNK * (CHUNK_HEAD + 8) * 2 + CHUNK * (CHUNK + 4) * 4 + 3 * CHUNK * 4) as u32;
    const SCAN_SHARED: u32 =
        (2 * (3 * CHUNK * (CHUNK_HEAD + 8) * 2 + CHUNK * (CHUNK + 8) * 2 + CHUNK * (SCAN_COLS + 8) * 4)) as u32;

    /// Whether a call goes to the chunked tensor-core kernels: a prompt (at least a chunk of
    /// tokens) of 16-bit inputs with 128-wide heads, on a GPU that has them (compute capability
    /// 8.0 on, in the build) and grants the scan's shared memory (Hopper does; an A100 does not).
    pub(super) fn takes_chunked(&Inputs { q, v, .. }: &Inputs) -> Result<bool> {
        let (dev, dtype) = (q.device(), q.dtype());
        Ok(matches!(dtype, DType::BF16 | DType::F16)
            && q.dim(1)? >= CHUNK
            && q.dim(3)? == CHUNK_HEAD
            && v.dim(3)? == CHUNK_HEAD
            && cuda::fits(dev, &cuda::RECURRENT, "gated_delta_chunk_prepare", dtype, PREPARE_SHARED)
            && cuda::fits(dev, &cuda::RECURRENT, "gated_delta_chunk_scan", dtype, SCAN_SHARED))
    }

    /// The chunk-parallel form on tensor cores (cuda/recurrent.cu): every chunk's products and
    /// UT transform at once, then one pass over the chunks carrying the state.
    pub(super) fn chunked(inputs: &Inputs, gating: &Gating, state: &Tensor) -> Result<(Tensor, Tensor)> {
        let Inputs { q, k, v, a, b } = *inputs;
        let (bsz, t_len, hk, _) = q.dims4()?;
        let hv = v.dim(2)?;
        let chunks = t_len.div_ceil(CHUNK);
        let pieces = |x: &Tensor| token_strided(x).and_then(in_pieces);
        let ((q, qs), (k, ks), (v, vs)) = (pieces(q)?, pieces(k)?, pieces(v)?);
        let ((a, b), gate_stride) = gates(a, b, hv)?;
        let f32 = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
        let (a_log, dt_bias, state) = (f32(gating.a_log)?, f32(gating.dt_bias)?, f32(state)?);
        let (dev, dtype) = (q.device(), q.dtype());
        let heads = bsz * hv;
        let per_token = (heads, chunks * CHUNK, CHUNK_HEAD);
        let (qg, kw, w_neg) =
            (cuda::output(per_token, dtype, dev)?, cuda::output(per_token, dtype, dev)?, cuda::output(per_token, dtype, dev)?);
        let u = cuda::output(per_token, DType::F32, dev)?;
        let p = cuda::output((heads, chunks, CHUNK, CHUNK), dtype, dev)?;
        let chunk_decay = cuda::output((heads, chunks), DType::F32, dev)?;
        // Rows · heads along x (up to 2³¹ − 1 blocks), chunks or state columns along y (65535).
        let blocks = |n: usize, limit: u32| {
            u32::try_from(n)
                .ok()
                .filter(|&n| n <= limit)
                .ok_or_else(|| candle_core::Error::Msg(format!("{t_len} tokens of {heads} heads exceed a CUDA grid")))
        };
        let threads = (CHUNK / 16 * 32) as u32;
        let prepare = LaunchConfig {
            grid_dim: (blocks(heads, i32::MAX as u32)?, blocks(chunks, 65535)?, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: PREPARE_SHARED,
        };
        let args = [
            Arg::at(&q)?,
            Arg::at(&k)?,
            Arg::at(&v)?,
            Arg::I64(qs as i64),
            Arg::I64(ks as i64),
            Arg::I64(vs as i64),
            Arg::at(&a)?,
            Arg::at(&b)?,
            Arg::I64(gate_stride as i64),
            Arg::at(&a_log)?,
            Arg::at(&dt_bias)?,
            Arg::at(&qg)?,
            Arg::at(&kw)?,
            Arg::at(&w_neg)?,
            Arg::at(&u)?,
            Arg::at(&p)?,
            Arg::at(&chunk_decay)?,
            Arg::dim(t_len)?,
            Arg::dim(hk)?,
            Arg::dim(hv)?,
            Arg::dim(chunks)?,
        ];
        cuda::launch(dev, &cuda::RECURRENT, "gated_delta_chunk_prepare", dtype, prepare, &args)?;
        let out = cuda::output((bsz, t_len, hv, CHUNK_HEAD), DType::F32, dev)?;
        let new_state = cuda::output((bsz, hv, CHUNK_HEAD, CHUNK_HEAD), DType::F32, dev)?;
        let scan = LaunchConfig {
            grid_dim: (blocks(heads, i32::MAX as u32)?, (CHUNK_HEAD / SCAN_COLS) as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: SCAN_SHARED,
        };
        let args = [
            Arg::at(&qg)?,
            Arg::at(&kw)?,
            Arg::at(&w_neg)?,
            Arg::at(&u)?,
            Arg::at(&p)?,
            Arg::at(&chunk_decay)?,
            Arg::at(&state)?,
            Arg::at(&new_state)?,
            Arg::at(&out)?,
            Arg::dim(t_len)?,
            Arg::dim(hv)?,
            Arg::dim(chunks)?,
        ];
        cuda::launch(dev, &cuda::RECURRENT, "gated_delta_chunk_scan", dtype, scan, &args)?;
        Ok((out, new_state))
    }

    /// `x` (with `stride` between tokens) as the chunked kernels read it, in 16-byte pieces: its
    /// first element and token stride 16-byte aligned, copied otherwise.
    fn in_pieces((x, stride): (Tensor, usize)) -> Result<(Tensor, usize)> {
        if cuda::in_pieces(&x, stride)? {
            return Ok((x, stride));
        }
        let (_, _, h, d) = x.dims4()?;
        Ok((x.force_contiguous()?, h * d))
    }

    /// The gate inputs `a` and `b` `[B, T, Hv]` with one distance between tokens (two narrows of
    /// one projection's output have the same), copied when they do not share one.
    fn gates(a: &Tensor, b: &Tensor, hv: usize) -> Result<((Tensor, Tensor), usize)> {
        let ((a, a_stride), (b, b_stride)) = (cuda::row_strided(a)?, cuda::row_strided(b)?);
        Ok(if a_stride == b_stride { ((a, b), a_stride) } else { ((a.contiguous()?, b.contiguous()?), hv) })
    }

    /// One block per (row, value head, 8 state rows); each warp keeps 2 rows of the state in
    /// registers across all tokens. With `in_place` (`Some`), the new state goes over `state`,
    /// at the rows' slots where they are given.
    pub(super) fn steps(
        inputs: &Inputs,
        gating: &Gating,
        state: &Tensor,
        in_place: Option<Option<&Tensor>>,
    ) -> Result<(Tensor, Tensor)> {
        let Inputs { q, k, v, a, b } = *inputs;
        let (bsz, t_len, hk, dk) = q.dims4()?;
        let (hv, dv) = (v.dim(2)?, v.dim(3)?);
        let ((q, qs), (k, ks), (v, vs)) = (token_strided(q)?, token_strided(k)?, token_strided(v)?);
        let ((a, b), gate_stride) = gates(a, b, hv)?;
        let f32 = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
        let (a_log, dt_bias) = (f32(gating.a_log)?, f32(gating.dt_bias)?);
        // The state is read and written in its own dtype (f32, or bf16 stored), held in f32.
        let (state, kernels) = match state.dtype() {
            DType::BF16 => (state.contiguous()?, STEPS[1]),
            _ => (f32(state)?, STEPS[0]),
        };
        let kernel = kernels[KEY_WIDTHS.iter().position(|&w| dk <= w).expect("takes() checked the key width")];
        let dev = q.device();
        let out = cuda::output((bsz, t_len, hv, dv), DType::F32, dev)?;
        let (new_state, slots) = match in_place {
            Some(slots) => (state.clone(), slots),
            None => (cuda::output((bsz, hv, dv, dk), state.dtype(), dev)?, None),
        };
        let rows_per_block = WARPS * ROWS_PER_WARP;
        let cfg = LaunchConfig {
            grid_dim: ((bsz * hv) as u32, dv.div_ceil(rows_per_block) as u32, 1),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            // Normalised q and k of the tokens staged at once.
            shared_mem_bytes: (2 * t_len.min(TOKEN_TILE) * dk * 4) as u32,
        };
        let args = [
            Arg::at(&q)?,
            Arg::at(&k)?,
            Arg::at(&v)?,
            Arg::I64(qs as i64),
            Arg::I64(ks as i64),
            Arg::I64(vs as i64),
            Arg::at(&a)?,
            Arg::at(&b)?,
            Arg::I64(gate_stride as i64),
            Arg::at(&a_log)?,
            Arg::at(&dt_bias)?,
            Arg::at(&state)?,
            Arg::at(&new_state)?,
            Arg::at_or_null(slots)?,
            Arg::at(&out)?,
            Arg::dim(bsz)?,
            Arg::dim(t_len)?,
            Arg::dim(hk)?,
            Arg::dim(hv)?,
            Arg::dim(dk)?,
            Arg::dim(dv)?,
        ];
        cuda::launch(dev, &cuda::RECURRENT, kernel, q.dtype(), cfg, &args)?;
        Ok((out, new_state))
    }
}

fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

mod cpu {
    use super::*;

    fn normalize(x: &mut [f32], dim: usize, scale: f32) {
        for row in x.chunks_mut(dim) {
            let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt() * scale;
            row.iter_mut().for_each(|v| *v *= inv);
        }
    }

    pub(super) fn run(inputs: &Inputs, gating: &Gating, state: &Tensor) -> Result<(Tensor, Tensor)> {
        let Inputs { q, k, v, a, b } = *inputs;
        let (bsz, t_len, hk, dk) = q.dims4()?;
        let (_, _, hv, dv) = v.dims4()?;
        let group = hv / hk;
        let mut qd = cpu_f32(q)?;
        let mut kd = cpu_f32(k)?;
        normalize(&mut qd, dk, 1.0 / (dk as f32).sqrt());
        normalize(&mut kd, dk, 1.0);
        let vd = cpu_f32(v)?;
        let ad = cpu_f32(a)?;
        let bd = cpu_f32(b)?;
        let a_log = cpu_f32(gating.a_log)?;
        let dt_bias = cpu_f32(gating.dt_bias)?;
        let mut sd = cpu_f32(state)?;
        let stored_bf16 = state.dtype() == DType::BF16;
        let mut out = vec![0f32; bsz * t_len * hv * dv];

        // One task per (row, value head): the state slice is private to it.
        let tasks: Vec<(usize, &mut [f32])> = sd.chunks_mut(dv * dk).enumerate().collect();
        let head_outs: Vec<(usize, Vec<f32>)> = tasks
            .into_par_iter()
            .map(|(bh, s)| {
                let (row, h) = (bh / hv, bh % hv);
                let kh = h / group;
                let neg_a = -a_log[h].exp();
                let mut o = vec![0f32; t_len * dv];
                let mut delta = vec![0f32; dv];
                for t in 0..t_len {
                    let gi = (row * t_len + t) * hv + h;
                    let x = ad[gi] + dt_bias[h];
                    let softplus = x.max(0.0) + (-x.abs()).exp().ln_1p();
                    let decay = (neg_a * softplus).exp();
                    let beta = 1.0 / (1.0 + (-bd[gi]).exp());
                    let qk_off = ((row * t_len + t) * hk + kh) * dk;
                    let q_t = &qd[qk_off..qk_off + dk];
                    let k_t = &kd[qk_off..qk_off + dk];
                    let v_t = &vd[gi * dv..gi * dv + dv];
                    for (j, srow) in s.chunks_mut(dk).enumerate() {
                        let mut mem = 0f32;
                        for (sv, kv) in srow.iter_mut().zip(k_t) {
                            *sv *= decay;
                            mem += *sv * kv;
                        }
                        delta[j] = beta * (v_t[j] - mem);
                    }
                    let o_t = &mut o[t * dv..(t + 1) * dv];
                    for (j, srow) in s.chunks_mut(dk).enumerate() {
                        let d = delta[j];
                        let mut acc = 0f32;
                        for ((sv, kv), qv) in srow.iter_mut().zip(k_t).zip(q_t) {
                            *sv += kv * d;
                            acc += *sv * qv;
                        }
                        o_t[j] = acc;
                    }
                    if stored_bf16 {
                        s.iter_mut().for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
                    }
                }
                (bh, o)
            })
            .collect();
        for (bh, o) in head_outs {
            let (row, h) = (bh / hv, bh % hv);
            for t in 0..t_len {
                let dst = ((row * t_len + t) * hv + h) * dv;
                out[dst..dst + dv].copy_from_slice(&o[t * dv..(t + 1) * dv]);
            }
        }
        let dev = q.device();
        Ok((Tensor::from_vec(out, (bsz, t_len, hv, dv), dev)?, Tensor::from_vec(sd, (bsz, hv, dv, dk), dev)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn randn(shape: &[usize], scale: f32, seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        // Small deterministic LCG: the test needs varied values, not a distribution.
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let data: Vec<f32> = (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 2.0 * scale
            })
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    fn check(bsz: usize, t: usize, hk: usize, hv: usize, dk: usize, dv: usize) {
        let q = randn(&[bsz, t, hk, dk], 1.0, 1);
        let k = randn(&[bsz, t, hk, dk], 1.0, 2);
        let v = randn(&[bsz, t, hv, dv], 1.0, 3);
        let a = randn(&[bsz, t, hv], 3.0, 4);
        let b = randn(&[bsz, t, hv], 3.0, 5);
        let a_log = randn(&[hv], 1.0, 6);
        let dt_bias = randn(&[hv], 1.0, 7);
        let s0 = randn(&[bsz, hv, dv, dk], 0.5, 8);
        let gating = Gating { a_log: &a_log, dt_bias: &dt_bias };
        let inputs = Inputs { q: &q, k: &k, v: &v, a: &a, b: &b };
        let (o1, s1) = reference(&inputs, &gating, &s0).unwrap();
        let (o2, s2) = cpu::run(&inputs, &gating, &s0).unwrap();
        assert!(max_diff(&o1, &o2) < 1e-5, "output differs by {}", max_diff(&o1, &o2));
        assert!(max_diff(&s1, &s2) < 1e-5, "state differs by {}", max_diff(&s1, &s2));
        // The chunk-parallel form: other summation orders, the same recurrence.
        let (o3, s3) = chunked(&inputs, &gating, &s0).unwrap();
        assert!(max_diff(&o3, &o2) < 1e-4, "chunked output differs by {}", max_diff(&o3, &o2));
        assert!(max_diff(&s3, &s2) < 1e-4, "chunked state differs by {}", max_diff(&s3, &s2));
        // Splitting the sequence in two through the carried state changes nothing.
        let half = t / 2;
        let part = |from: usize, len: usize| [&q, &k, &v, &a, &b].map(|x| x.narrow(1, from, len).unwrap());
        let run_part =
            |[q, k, v, a, b]: &[Tensor; 5], state: &Tensor| cpu::run(&Inputs { q, k, v, a, b }, &gating, state).unwrap();
        let (oa, sa) = run_part(&part(0, half), &s0);
        let (ob, sb) = run_part(&part(half, t - half), &sa);
        assert_eq!(max_diff(&Tensor::cat(&[oa, ob], 1).unwrap(), &o2), 0.0);
        assert_eq!(max_diff(&sb, &s2), 0.0);
    }

    fn max_diff(x: &Tensor, y: &Tensor) -> f32 {
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        (f(x) - f(y)).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
    }

    #[test]
    fn a_bf16_state_is_rounded_after_every_token() {
        let (bsz, t, hk, hv, dk, dv) = (2, 11, 2, 4, 16, 8);
        let q = randn(&[bsz, t, hk, dk], 1.0, 1);
        let k = randn(&[bsz, t, hk, dk], 1.0, 2);
        let v = randn(&[bsz, t, hv, dv], 1.0, 3);
        let a = randn(&[bsz, t, hv], 3.0, 4);
        let b = randn(&[bsz, t, hv], 3.0, 5);
        let (a_log, dt_bias) = (randn(&[hv], 1.0, 6), randn(&[hv], 1.0, 7));
        let gating = Gating { a_log: &a_log, dt_bias: &dt_bias };
        let s0 = randn(&[bsz, hv, dv, dk], 0.5, 8).to_dtype(DType::BF16).unwrap();
        let inputs = Inputs { q: &q, k: &k, v: &v, a: &a, b: &b };
        let (o, s) = gated_delta_rule(&inputs, &gating, &s0).unwrap();
        assert_eq!(s.dtype(), DType::BF16, "the new state comes back as stored");
        // Fed one token a call, each call rounding the state it returns: the same bits.
        let (mut state, mut outs) = (s0.clone(), Vec::new());
        for i in 0..t {
            let [q, k, v, a, b] = [&q, &k, &v, &a, &b].map(|x| x.narrow(1, i, 1).unwrap());
            let (o_i, next) = gated_delta_rule(&Inputs { q: &q, k: &k, v: &v, a: &a, b: &b }, &gating, &state).unwrap();
            (state, outs) = (next, [outs, vec![o_i]].concat());
        }
        assert_eq!(max_diff(&Tensor::cat(&outs, 1).unwrap(), &o), 0.0);
        assert_eq!(max_diff(&state, &s), 0.0);
        // The tensor-op twin rounds as often (a rounding may land the other side of a tie).
        let (o_ref, s_ref) = reference(&inputs, &gating, &s0).unwrap();
        assert!(max_diff(&o_ref, &o) < 2e-2 && max_diff(&s_ref.to_dtype(DType::BF16).unwrap(), &s) < 2e-2);
        // Against the f32 state from the same start: near, and not the same.
        let (o32, s32) = gated_delta_rule(&inputs, &gating, &s0.to_dtype(DType::F32).unwrap()).unwrap();
        let (do_, ds) = (max_diff(&o32, &o), max_diff(&s32, &s));
        assert!(do_ > 1e-5 && do_ < 5e-2 && ds > 1e-4 && ds < 5e-2, "f32 state against bf16: outputs {do_}, states {ds}");
    }

    #[test]
    fn fast_path_matches_reference() {
        check(1, 7, 2, 2, 16, 16);
        check(3, 9, 2, 4, 8, 12);
        check(2, 1, 1, 3, 4, 4);
        // Several chunks, the last one padded.
        check(2, 150, 2, 4, 16, 8);
        check(1, 64, 1, 1, 32, 32);
    }
}
