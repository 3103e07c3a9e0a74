//! The mixture-of-experts feed-forward of `qwen3_5_moe`, in transformers' order of operations:
//! the router's logits (a linear map in the model's dtype), their softmax in f32, the top k
//! renormalized to sum to one and rounded to the model's dtype; each chosen expert (a SwiGLU
//! MLP) on its tokens, scaled by its weight and summed per token in ascending expert order; plus
//! the shared expert behind its sigmoid gate.
//!
//! A token's bits do not depend on the other tokens of the forward: its route is computed alone,
//! an expert's matmul runs batch-invariantly where the forward's rows are a few positions long
//! (decode, verify; as every other projection of the layer), and its sum takes its experts in a
//! fixed order. So batched rows equal solo ones and a verify forward equals decode steps, which
//! exact speculative rollback needs.
//!
//! On a GPU, a forward of few positions per row (decode, verify) keeps the routes on the device
//! ([`strata_kernels::experts`]): nothing is read back to the host, so the decode step can be
//! recorded as a CUDA graph, and each (token, expert) pair runs as a row of its own of the
//! batch-invariant kernel — its expert's own matmul's bits. (The device's route weights may
//! differ from the host's in the last bits: its softmax sums in another order.) A long prefill
//! chunk routes on the host and runs each expert on all its tokens at once.

use candle_core::{DType, Tensor};
use candle_nn::ops::sigmoid;
use strata_kernels::experts::{self as kernels, Routes};
use strata_kernels::matmul::MAX_EXACT_ROWS;
use strata_kernels::norm;

use super::layers::{Linear, Matrix, Mlp};
use crate::config::ExpertsConfig;
use crate::error::{ModelError, Result};
use crate::source::WeightSource;

/// (token, expert) pairs up to which a forward routes on the device: each pair reads its
/// expert's weights on its own (from the L2 cache where pairs share an expert), which for
/// prefill-sized batches costs more than the host's grouping of each expert's tokens into one
/// tensor-core matmul. 2,048 covers decode batches of 256 rows at 8 experts a token; where the
/// two costs cross is not measured yet (scripts/cuda/moe-matmul-bench.cu measures the first).
const MAX_DEVICE_PAIRS: usize = 2048;

pub struct Experts {
    router: Linear,
    /// Each expert's MLP; views of `stacked` where that is held.
    experts: Vec<Mlp>,
    /// Every expert's weights in two tensors, where they are plain: what the GPU's gathered
    /// matmuls read.
    stacked: Option<Stacked>,
    shared: Mlp,
    shared_gate: Linear,
    top_k: usize,
}

/// `gate_up` `[E, 2·inter, hidden]` (each expert's gate rows, then its up rows), `down`
/// `[E, hidden, inter]`.
struct Stacked {
    gate_up: Tensor,
    down: Tensor,
    inter: usize,
}

impl Experts {
    /// Loads `{prefix}.gate` (the router), the experts — fused as transformers holds them
    /// (`{prefix}.experts.gate_up_proj` `[E, 2I, H]`, `{prefix}.experts.down_proj` `[E, H, I]`)
    /// or one by one as released checkpoints store them (`{prefix}.experts.N.{gate,up,down}_proj`,
    /// stacked into the fused layout where they are plain tensors) — and the shared expert with
    /// its gate.
    pub fn load(src: &dyn WeightSource, prefix: &str, hidden: usize, cfg: &ExpertsConfig, dtype: DType) -> Result<Self> {
        let (count, inter) = (cfg.num_experts, cfg.moe_intermediate_size);
        if cfg.num_experts_per_tok == 0 || cfg.num_experts_per_tok > count {
            return Err(ModelError::Invalid(format!("{prefix}: {} experts per token out of {count}", cfg.num_experts_per_tok)));
        }
        let fused = format!("{prefix}.experts.gate_up_proj");
        let (experts, stacked) = if src.contains(&fused) {
            let gate_up = src.get(&fused, &[count, 2 * inter, hidden], dtype)?;
            let down = src.get(&format!("{prefix}.experts.down_proj"), &[count, hidden, inter], dtype)?;
            let stacked = Stacked { gate_up, down, inter };
            (stacked.views()?, Some(stacked))
        } else {
            let one = |e: usize, part: &str, rows: usize, cols: usize| {
                Linear::load(src, &format!("{prefix}.experts.{e}.{part}_proj"), rows, cols, false, dtype)
            };
            let parts = (0..count)
                .map(|e| Ok([one(e, "gate", inter, hidden)?, one(e, "up", inter, hidden)?, one(e, "down", hidden, inter)?]))
                .collect::<Result<Vec<_>>>()?;
            match Stacked::of(&parts, inter)? {
                Some(stacked) => (stacked.views()?, Some(stacked)),
                None => {
                    let mlps =
                        parts.into_iter().map(|[gate, up, down]| Mlp::from_parts(gate, up, down)).collect::<Result<_>>()?;
                    (mlps, None)
                }
            }
        };
        Ok(Self {
            router: Linear::load(src, &format!("{prefix}.gate"), count, hidden, false, dtype)?,
            experts,
            stacked,
            shared: Mlp::load(src, &format!("{prefix}.shared_expert"), hidden, cfg.shared_expert_intermediate_size, dtype)?,
            shared_gate: Linear::load(src, &format!("{prefix}.shared_expert_gate"), 1, hidden, false, dtype)?,
            top_k: cfg.num_experts_per_tok,
        })
    }

    /// Whether a forward of `tokens` tokens, few positions per row, runs on the device
    /// throughout (on a GPU): plain weights of a shape the kernels take
    /// ([`kernels::device_takes`]), and at most [`MAX_DEVICE_PAIRS`] pairs. A decode step is
    /// recorded as a CUDA graph only then.
    pub fn routes_on_device(&self, tokens: usize) -> bool {
        let Some(stacked) = &self.stacked else { return false };
        let hidden = stacked.down.dim(1).unwrap_or(0);
        kernels::device_takes(self.experts.len(), self.top_k, hidden, stacked.inter) && tokens * self.top_k <= MAX_DEVICE_PAIRS
    }

    /// `x` `[B, T, hidden]` (or `[B, hidden]`, one position per row).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let hidden = x.dim(x.rank() - 1)?;
        let positions = if x.rank() == 3 { x.dim(1)? } else { 1 };
        let tokens = x.reshape(((), hidden))?;
        let n = tokens.dim(0)?;
        let logits = self.router.forward(&tokens)?;
        let routed = match self.routed_on_device(&tokens, &logits, positions)? {
            Some(routed) => routed,
            None => self.routed_on_host(&tokens, &logits, positions)?,
        };
        let shared = self.shared.forward(x)?.reshape((n, hidden))?;
        let gate = sigmoid(&self.shared_gate.forward(x)?.reshape((n, 1))?)?;
        Ok((routed + shared.broadcast_mul(&gate)?)?.reshape(x.shape())?)
    }

    /// The routed experts' sum `[n, hidden]` without leaving the GPU, where
    /// [`Self::routes_on_device`] and the forward has few positions per row; `None` otherwise.
    fn routed_on_device(&self, tokens: &Tensor, logits: &Tensor, positions: usize) -> Result<Option<Tensor>> {
        let few = positions <= MAX_EXACT_ROWS && self.routes_on_device(tokens.dim(0)?);
        let Some(stacked) = self.stacked.as_ref().filter(|_| few) else { return Ok(None) };
        let Some(routes) = Routes::on_device(logits, self.top_k)? else { return Ok(None) };
        stacked.routed(tokens, &routes).map(Some)
    }

    /// The routed experts' sum `[n, hidden]` with the routes read to the host: each expert on
    /// all of its tokens at once.
    fn routed_on_host(&self, tokens: &Tensor, logits: &Tensor, positions: usize) -> Result<Tensor> {
        let hidden = tokens.dim(1)?;
        let n = tokens.dim(0)?;
        let logits = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let routes: Vec<Vec<(usize, f32)>> = logits.iter().map(|l| kernels::route(l, self.top_k)).collect();

        // Each expert on its tokens, in ascending expert order, into one `[n·k, hidden]` tensor.
        let mut chosen: Vec<Vec<(u32, f32)>> = vec![Vec::new(); self.experts.len()];
        for (t, route) in routes.iter().enumerate() {
            for &(e, w) in route {
                chosen[e].push((t as u32, w));
            }
        }
        let device = tokens.device();
        let mut outputs = Vec::new();
        // Per token, the rows of its experts' contributions in the concatenation, in expert order.
        let mut rows_of = vec![Vec::with_capacity(self.top_k); n];
        let mut at = 0u32;
        for (e, picks) in chosen.iter().enumerate().filter(|(_, p)| !p.is_empty()) {
            let (ids, weights): (Vec<u32>, Vec<f32>) = picks.iter().copied().unzip();
            for &t in &ids {
                rows_of[t as usize].push(at);
                at += 1;
            }
            let input = tokens.index_select(&Tensor::new(ids.as_slice(), device)?, 0)?;
            // A forward of few positions per row computes each token as a row of its own (the
            // batch-invariant kernels); a long prefill chunk takes the expert's tokens together.
            let input = if positions <= MAX_EXACT_ROWS { input.unsqueeze(1)? } else { input.unsqueeze(0)? };
            let y = self.experts[e].forward(&input)?.reshape((picks.len(), hidden))?;
            // The weight rounds to the model's dtype before it scales, as transformers casts it.
            let weights = Tensor::from_vec(weights, (picks.len(), 1), device)?.to_dtype(y.dtype())?;
            outputs.push(y.broadcast_mul(&weights)?);
        }
        let all = Tensor::cat(&outputs, 0)?;
        // Per token, its experts' contributions summed in ascending expert order (top_k ≥ 1,
        // checked at load).
        let slot = |k: usize| -> Result<Tensor> {
            let rows: Vec<u32> = rows_of.iter().map(|r| r[k]).collect();
            Ok(all.index_select(&Tensor::new(rows.as_slice(), device)?, 0)?)
        };
        let mut routed = slot(0)?;
        for k in 1..self.top_k {
            routed = (routed + slot(k)?)?;
        }
        Ok(routed)
    }
}

impl Stacked {
    /// The experts' projections stacked, where every one is a plain tensor.
    fn of(parts: &[[Linear; 3]], inter: usize) -> Result<Option<Self>> {
        let plain = |l: &Linear| if let Matrix::Dense(w) = l.weight() { Some(w.clone()) } else { None };
        let mut gate_up = Vec::with_capacity(parts.len());
        let mut down = Vec::with_capacity(parts.len());
        for [gate, up, d] in parts {
            let (Some(gate), Some(up), Some(d)) = (plain(gate), plain(up), plain(d)) else { return Ok(None) };
            gate_up.push(Tensor::cat(&[gate, up], 0)?);
            down.push(d);
        }
        Ok(Some(Self { gate_up: Tensor::stack(&gate_up, 0)?, down: Tensor::stack(&down, 0)?, inter }))
    }

    /// The routed experts' sum `[n, hidden]` for `tokens` `[n, hidden]` over `routes`, pair by
    /// pair: gate and up of each pair's token, SwiGLU, down, each token's pairs weighted and
    /// summed.
    fn routed(&self, tokens: &Tensor, routes: &Routes) -> Result<Tensor> {
        let inter = self.inter;
        let gate_up = kernels::matmul_gathered(tokens, &self.gate_up, routes, routes.per_token)?;
        let act = norm::silu_mul(&gate_up.narrow(1, 0, inter)?, &gate_up.narrow(1, inter, inter)?)?;
        let down = kernels::matmul_gathered(&act, &self.down, routes, 1)?;
        Ok(kernels::combine(&down, routes)?)
    }

    /// Each expert's MLP as views of the stacked tensors.
    fn views(&self) -> Result<Vec<Mlp>> {
        (0..self.gate_up.dim(0)?)
            .map(|e| Ok(Mlp::joined(self.gate_up.get(e)?, self.inter, Matrix::Dense(self.down.get(e)?))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::source::RandomSource;

    /// The device path's pipeline (routes as pairs, gathered projections, weighted sums), run
    /// here through the kernels' CPU twins on the host's routes, gives the host path's bits: a
    /// GPU session then only has the kernels themselves to check.
    #[test]
    fn pairs_give_the_host_paths_bits() {
        let device = Device::Cpu;
        let cfg = ExpertsConfig {
            num_experts: 12,
            num_experts_per_tok: 3,
            moe_intermediate_size: 40,
            shared_expert_intermediate_size: 24,
        };
        let experts = Experts::load(&RandomSource::new(device.clone(), 7), "mlp", 32, &cfg, DType::F32).unwrap();
        let stacked = experts.stacked.as_ref().expect("random weights are plain");
        let tokens = Tensor::randn(0f32, 1.0, (9, 32), &device).unwrap();
        let logits = experts.router.forward(&tokens).unwrap();
        let host = experts.routed_on_host(&tokens, &logits, 1).unwrap();
        let routes: Vec<Vec<(usize, f32)>> = logits.to_vec2::<f32>().unwrap().iter().map(|l| kernels::route(l, 3)).collect();
        let pairs = stacked.routed(&tokens, &Routes::from_host(&routes, 12, &device).unwrap()).unwrap();
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bits(&pairs), bits(&host));
        assert!(
            experts.routes_on_device(9) && !experts.routes_on_device(MAX_DEVICE_PAIRS),
            "prefill-sized forwards route on the host"
        );
    }
}
