//! A mixture of experts' feed-forward as pairs: each token's route picks `k` experts; each
//! (token, expert) pair runs that expert's projections on the token; a token's pairs are summed
//! with their weights. On a GPU every step stays on the device — the routes are computed there
//! ([`Routes::on_device`]), the projections read each pair's expert through its id
//! ([`matmul_gathered`]) — so a decode step reads nothing back to the host and can be recorded
//! as a CUDA graph; and since every pair is computed as one input row of the batch-invariant
//! streaming kernel, a token's result is the same in any batch.
//!
//! Elsewhere the same functions run as slow twins built from tensor ops, the reference the GPU
//! tests compare against.

use candle_core::{Device, Tensor};

use crate::Result;

/// Experts per layer the device route takes (cuda/experts.cu's `MAX_EXPERTS`), and experts per
/// token (a lane each).
pub const MAX_EXPERTS: usize = 1024;
pub const MAX_PER_TOKEN: usize = 32;
/// (token, expert) pairs a gathered matmul takes on a GPU (one per block along the grid's y).
pub const MAX_PAIRS: usize = 65535;

/// Whether the device path takes a mixture of `count` experts, `per_token` of them a token, of
/// width `hidden` and `inter`: within the route kernel's limits, and with rows in whole 16-byte
/// pieces in every dtype the kernels take (which the gathered matmul reads them in).
pub fn device_takes(count: usize, per_token: usize, hidden: usize, inter: usize) -> bool {
    let pieces = |d: usize| d % 8 == 0;
    count <= MAX_EXPERTS && per_token <= MAX_PER_TOKEN.min(count) && pieces(hidden) && pieces(inter)
}

/// A token's route from its router logits: the `k` experts of highest softmax probability (the
/// lower index first among equals), ascending by expert, each with its probability over the
/// sum of the `k` (f32, summed highest first, as transformers computes them).
pub fn route(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let total: f32 = exps.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
    let top: Vec<(usize, f32)> = order[..k].iter().map(|&e| (e, exps[e] / total)).collect();
    let kept: f32 = top.iter().map(|&(_, p)| p).sum();
    let mut route: Vec<(usize, f32)> = top.into_iter().map(|(e, p)| (e, p / kept)).collect();
    route.sort_by_key(|&(e, _)| e);
    route
}

/// The routes of `n` tokens over `count` experts, `k` each, as pairs `p = t·k + s` (a token's
/// experts ascending): where they are computed, on the host or on the GPU.
pub struct Routes {
    /// `[n·k]` u32: each pair's expert.
    pub experts: Tensor,
    /// `[n·k]` f32: each pair's weight.
    pub weights: Tensor,
    /// `[n·k]` u32: the pairs grouped by expert (the order the GPU runs them in).
    #[cfg(feature = "cuda")]
    order: Tensor,
    pub per_token: usize,
    count: usize,
}

impl Routes {
    /// Routes computed on the host (each token's [`route`]) and placed on `device`.
    pub fn from_host(routes: &[Vec<(usize, f32)>], count: usize, device: &Device) -> Result<Self> {
        let per_token = routes.first().map_or(1, Vec::len);
        if routes.iter().any(|r| r.len() != per_token) || routes.iter().flatten().any(|&(e, _)| e >= count) {
            candle_core::bail!("routes: every token needs {per_token} experts below {count}");
        }
        let (experts, weights): (Vec<u32>, Vec<f32>) = routes.iter().flatten().map(|&(e, w)| (e as u32, w)).unzip();
        let n = experts.len();
        #[cfg(feature = "cuda")]
        let order = {
            let mut order: Vec<u32> = (0..n as u32).collect();
            order.sort_by_key(|&p| experts[p as usize]);
            Tensor::from_vec(order, n, device)?
        };
        Ok(Self {
            experts: Tensor::from_vec(experts, n, device)?,
            weights: Tensor::from_vec(weights, n, device)?,
            #[cfg(feature = "cuda")]
            order,
            per_token,
            count,
        })
    }

    /// The routes of router logits `[n, experts]` computed on their GPU — [`route`]'s picks,
    /// weights within float rounding of it (the softmax's sum in another order) — or `None`
    /// where they cannot be: not a GPU, or more experts than the kernel holds.
    pub fn on_device(logits: &Tensor, k: usize) -> Result<Option<Self>> {
        #[cfg(feature = "cuda")]
        return gpu::route(logits, k);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (logits, k);
            Ok(None)
        }
    }

    fn pairs(&self) -> usize {
        self.experts.dim(0).unwrap_or(0)
    }
}

/// `y [n·k, N]`: for each pair `p`, row `p / per_input` of `x` (`per_input` = k: the pair's
/// token; 1: a row per pair) times its expert's matrix in `w` `[experts, N, K]`. On a GPU each
/// pair is one row of the streaming matmul ([`crate::matmul::matmul_t`]'s bits for that row and
/// expert alone); elsewhere that matmul, pair by pair.
pub fn matmul_gathered(x: &Tensor, w: &Tensor, routes: &Routes, per_input: usize) -> Result<Tensor> {
    let (rows, k) = x.dims2()?;
    let (count, n, wk) = w.dims3()?;
    if wk != k || count != routes.count || per_input == 0 || rows * per_input != routes.pairs() {
        candle_core::bail!(
            "matmul_gathered: x {:?}, w {:?}, {} pairs of {} experts, {per_input} a row",
            x.dims(),
            w.dims(),
            routes.pairs(),
            routes.count
        );
    }
    #[cfg(feature = "cuda")]
    if let Some(y) = gpu::matmul_gathered(x, w, routes, per_input)? {
        return Ok(y);
    }
    let experts = routes.experts.to_vec1::<u32>()?;
    let rows = experts
        .iter()
        .enumerate()
        .map(|(p, &e)| crate::matmul::matmul_t(&x.narrow(0, p / per_input, 1)?, &w.get(e as usize)?))
        .collect::<Result<Vec<_>>>()?;
    if rows.is_empty() {
        return Tensor::zeros((0, n), x.dtype(), x.device());
    }
    Tensor::cat(&rows, 0)
}

/// `[n, H]`: each token's pairs of `y` `[n·k, H]` scaled by their weights and summed in
/// ascending expert order, each weight rounded to `y`'s dtype and each product and partial sum
/// stored in it (the bits of scaling and adding the experts' outputs one by one).
pub fn combine(y: &Tensor, routes: &Routes) -> Result<Tensor> {
    let (pairs, h) = y.dims2()?;
    let k = routes.per_token;
    if pairs != routes.pairs() || k == 0 {
        candle_core::bail!("combine: y {:?} for {} pairs, {k} a token", y.dims(), routes.pairs());
    }
    #[cfg(feature = "cuda")]
    if let Some(out) = gpu::combine(y, routes)? {
        return Ok(out);
    }
    let scaled = y.broadcast_mul(&routes.weights.to_dtype(y.dtype())?.unsqueeze(1)?)?.reshape((pairs / k, k, h))?;
    let mut sum = scaled.narrow(1, 0, 1)?;
    for s in 1..k {
        sum = (sum + scaled.narrow(1, s, 1)?)?;
    }
    sum.squeeze(1)
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::{DType, Tensor};

    use super::{Routes, MAX_EXPERTS, MAX_PAIRS, MAX_PER_TOKEN};
    use crate::cuda::{self, Arg};
    use crate::Result;

    /// The route kernel's one block.
    const ROUTE_THREADS: u32 = 1024;
    /// The streaming matmul's warps per block (cuda/matmul.cu's `ROWS_WARPS`).
    const WARPS: usize = 4;

    pub(super) fn route(logits: &Tensor, k: usize) -> Result<Option<Routes>> {
        let (n, count) = logits.dims2()?;
        let dtype = logits.dtype();
        if !logits.device().is_cuda() || !cuda::supports(dtype) || count > MAX_EXPERTS || k == 0 || k > MAX_PER_TOKEN.min(count) {
            return Ok(None);
        }
        let logits = logits.contiguous()?;
        let device = logits.device();
        let pairs = n * k;
        let experts = cuda::output(pairs, DType::U32, device)?;
        let weights = cuda::output(pairs, DType::F32, device)?;
        let order = cuda::output(pairs, DType::U32, device)?;
        if pairs > 0 {
            let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (ROUTE_THREADS, 1, 1), shared_mem_bytes: 0 };
            let args = [
                Arg::at(&logits)?,
                Arg::dim(n)?,
                Arg::dim(count)?,
                Arg::dim(k)?,
                Arg::at(&experts)?,
                Arg::at(&weights)?,
                Arg::at(&order)?,
            ];
            cuda::launch(device, &cuda::EXPERTS, "moe_route", dtype, cfg, &args)?;
        }
        Ok(Some(Routes { experts, weights, order, per_token: k, count }))
    }

    /// The gathered kernel where it applies (as [`crate::matmul::matmul_t`]'s streaming kernel:
    /// a supported dtype, rows in whole 16-byte pieces), with the split that kernel takes for
    /// `N` rows, so a pair gets the bits of its expert's matmul.
    pub(super) fn matmul_gathered(x: &Tensor, w: &Tensor, routes: &Routes, per_input: usize) -> Result<Option<Tensor>> {
        let ((_, k), (count, n, _)) = (x.dims2()?, w.dims3()?);
        let dtype = x.dtype();
        let pairs = routes.pairs();
        let same_device = [w, &routes.experts, &routes.order].iter().all(|t| t.device().same_device(x.device()));
        if !x.device().is_cuda()
            || !same_device
            || !cuda::supports(dtype)
            || w.dtype() != dtype
            || !w.is_contiguous()
            || pairs > MAX_PAIRS
        {
            return Ok(None);
        }
        let (x, x_stride) = cuda::row_strided(x)?;
        if !cuda::in_pieces(&x, x_stride)? || !cuda::in_pieces(w, k)? {
            return Ok(None);
        }
        let y = cuda::output((pairs, n), dtype, x.device())?;
        if pairs == 0 || n == 0 {
            return Ok(Some(y));
        }
        let split = crate::matmul::gpu::warps_per_row(n);
        let kernel = if split == 4 { "matmul_gathered_s4" } else { "matmul_gathered_s2" };
        let blocks = u32::try_from((n * split).div_ceil(WARPS))
            .map_err(|_| candle_core::Error::Msg(format!("{n} weight rows exceed a CUDA grid")))?;
        let cfg =
            LaunchConfig { grid_dim: (blocks, pairs as u32, 1), block_dim: ((WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        let args = [
            Arg::at(&x)?,
            Arg::I64(x_stride as i64),
            Arg::at(w)?,
            Arg::at(&y)?,
            Arg::dim(k)?,
            Arg::dim(n)?,
            Arg::dim(count)?,
            Arg::at(&routes.experts)?,
            Arg::at(&routes.order)?,
            Arg::dim(per_input)?,
        ];
        cuda::launch(x.device(), &cuda::MATMUL, kernel, dtype, cfg, &args)?;
        Ok(Some(y))
    }

    pub(super) fn combine(y: &Tensor, routes: &Routes) -> Result<Option<Tensor>> {
        let (pairs, h) = y.dims2()?;
        let dtype = y.dtype();
        if !y.device().is_cuda() || !cuda::supports(dtype) || !routes.weights.device().same_device(y.device()) {
            return Ok(None);
        }
        let y = y.contiguous()?;
        let n = pairs / routes.per_token;
        let out = cuda::output((n, h), dtype, y.device())?;
        if n == 0 || h == 0 {
            return Ok(Some(out));
        }
        let args =
            [Arg::at(&y)?, Arg::at(&routes.weights)?, Arg::at(&out)?, Arg::dim(n)?, Arg::dim(h)?, Arg::dim(routes.per_token)?];
        cuda::launch(y.device(), &cuda::EXPERTS, "moe_combine", dtype, cuda::grid_rows(n, h, 256)?, &args)?;
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_takes_the_top_k_renormalized_in_expert_order() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 1.0];
        let r = route(&logits, 3);
        assert_eq!(r.iter().map(|&(e, _)| e).collect::<Vec<_>>(), vec![1, 3, 4]);
        let (e2, e1) = (2.0f64.exp(), 1.0f64.exp());
        let want = [e2 / (2.0 * e2 + e1), e2 / (2.0 * e2 + e1), e1 / (2.0 * e2 + e1)];
        for (&(_, w), want) in r.iter().zip(want) {
            assert!((f64::from(w) - want).abs() < 1e-6, "{r:?}");
        }
        assert!((r.iter().map(|&(_, w)| w).sum::<f32>() - 1.0).abs() < 1e-6);
        // Ties go to the lower index; k = all keeps every expert.
        assert_eq!(route(&[1.0, 1.0, 1.0], 2).iter().map(|&(e, _)| e).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(route(&logits, 5).len(), 5);
    }

    /// The twins against sums written out by hand: two tokens, two experts each of three.
    #[test]
    fn gathered_pairs_are_each_tokens_experts_weighted_and_summed() {
        let dev = Device::Cpu;
        let x = Tensor::new(&[[1f32, 2.0], [3.0, -1.0]], &dev).unwrap();
        // Expert e's matrix [N = 2, K = 2]: [[e + 1, 0], [0, 1 - e]].
        let w = Tensor::new(&[[[1f32, 0.0], [0.0, 1.0]], [[2.0, 0.0], [0.0, 0.0]], [[3.0, 0.0], [0.0, -1.0]]], &dev).unwrap();
        let routes = Routes::from_host(&[vec![(0, 0.25), (2, 0.75)], vec![(1, 0.5), (2, 0.5)]], 3, &dev).unwrap();
        let y = matmul_gathered(&x, &w, &routes, 2).unwrap();
        assert_eq!(y.to_vec2::<f32>().unwrap(), [[1.0, 2.0], [3.0, -2.0], [6.0, 0.0], [9.0, 1.0]]);
        let out = combine(&y, &routes).unwrap();
        assert_eq!(out.to_vec2::<f32>().unwrap(), [[0.25 + 2.25, 0.5 - 1.5], [3.0 + 4.5, 0.5]]);
        // A row per pair.
        assert_eq!(matmul_gathered(&y, &w, &routes, 1).unwrap().to_vec2::<f32>().unwrap()[1], [9.0, 2.0]);
        assert!(Routes::from_host(&[vec![(3, 1.0)]], 3, &dev).is_err(), "an expert out of range");
        assert!(matmul_gathered(&x, &w, &routes, 1).is_err(), "two rows for four pairs");
    }
}
