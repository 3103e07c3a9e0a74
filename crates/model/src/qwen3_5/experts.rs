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

use candle_core::{DType, Tensor};
use candle_nn::ops::sigmoid;
use strata_kernels::matmul::MAX_EXACT_ROWS;

use super::layers::{Linear, Matrix, Mlp};
use crate::config::ExpertsConfig;
use crate::error::{ModelError, Result};
use crate::source::WeightSource;

pub struct Experts {
    router: Linear,
    experts: Vec<Mlp>,
    shared: Mlp,
    shared_gate: Linear,
    top_k: usize,
}

impl Experts {
    /// Loads `{prefix}.gate` (the router), the experts — fused as transformers holds them
    /// (`{prefix}.experts.gate_up_proj` `[E, 2I, H]`, `{prefix}.experts.down_proj` `[E, H, I]`)
    /// or one by one as released checkpoints store them (`{prefix}.experts.N.{gate,up,down}_proj`)
    /// — and the shared expert with its gate.
    pub fn load(src: &dyn WeightSource, prefix: &str, hidden: usize, cfg: &ExpertsConfig, dtype: DType) -> Result<Self> {
        let (count, inter) = (cfg.num_experts, cfg.moe_intermediate_size);
        if cfg.num_experts_per_tok == 0 || cfg.num_experts_per_tok > count {
            return Err(ModelError::Invalid(format!("{prefix}: {} experts per token out of {count}", cfg.num_experts_per_tok)));
        }
        let fused = format!("{prefix}.experts.gate_up_proj");
        let experts = if src.contains(&fused) {
            let gate_up = src.get(&fused, &[count, 2 * inter, hidden], dtype)?;
            let down = src.get(&format!("{prefix}.experts.down_proj"), &[count, hidden, inter], dtype)?;
            (0..count).map(|e| Ok(Mlp::joined(gate_up.get(e)?, inter, Matrix::Dense(down.get(e)?)))).collect::<Result<_>>()?
        } else {
            (0..count).map(|e| Mlp::load(src, &format!("{prefix}.experts.{e}"), hidden, inter, dtype)).collect::<Result<_>>()?
        };
        Ok(Self {
            router: Linear::load(src, &format!("{prefix}.gate"), count, hidden, false, dtype)?,
            experts,
            shared: Mlp::load(src, &format!("{prefix}.shared_expert"), hidden, cfg.shared_expert_intermediate_size, dtype)?,
            shared_gate: Linear::load(src, &format!("{prefix}.shared_expert_gate"), 1, hidden, false, dtype)?,
            top_k: cfg.num_experts_per_tok,
        })
    }

    /// `x` `[B, T, hidden]` (or `[B, hidden]`, one position per row).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let hidden = x.dim(x.rank() - 1)?;
        let positions = if x.rank() == 3 { x.dim(1)? } else { 1 };
        let tokens = x.reshape(((), hidden))?;
        let n = tokens.dim(0)?;
        let logits = self.router.forward(&tokens)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let routes: Vec<Vec<(usize, f32)>> = logits.iter().map(|l| route(l, self.top_k)).collect();

        // Each expert on its tokens, in ascending expert order, into one `[n·k, hidden]` tensor.
        let mut chosen: Vec<Vec<(u32, f32)>> = vec![Vec::new(); self.experts.len()];
        for (t, route) in routes.iter().enumerate() {
            for &(e, w) in route {
                chosen[e].push((t as u32, w));
            }
        }
        let device = x.device();
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
        let shared = self.shared.forward(x)?.reshape((n, hidden))?;
        let gate = sigmoid(&self.shared_gate.forward(x)?.reshape((n, 1))?)?;
        Ok((routed + shared.broadcast_mul(&gate)?)?.reshape(x.shape())?)
    }
}

/// A token's route from its router logits: the `k` experts of highest softmax probability (the
/// lower index first among equals), ascending by expert, each with its probability over the
/// sum of the `k` (f32, as transformers computes them).
fn route(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
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
}
