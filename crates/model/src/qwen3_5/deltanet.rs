//! Gated DeltaNet layer: projections, causal conv1d + SiLU, the gated delta recurrence (f32
//! arithmetic; the state stored as the model's spec declares), gated RMSNorm per value head,
//! output projection.

use candle_core::{DType, Tensor};
use strata_kernels::{conv1d::causal_conv1d_silu, gated_delta};
use strata_state::{RecurrentRound, RecurrentShape, RecurrentState};

use super::layers::{GatedRmsNorm, Linear, Projections};
use crate::config::Qwen35Config;
use crate::error::Result;
use crate::source::WeightSource;

pub struct GatedDeltaNet {
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    in_proj: Projections,
    /// `[conv_dim, K]`, f32.
    conv_weight: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    norm: GatedRmsNorm,
    out_proj: Linear,
    /// The layer's dimensions (its `ssm_dtype` is the default: what the state is stored in is
    /// the model's [`Qwen35::state_spec`](super::Qwen35::state_spec) to declare).
    shape: RecurrentShape,
    key_heads: usize,
}

impl GatedDeltaNet {
    pub fn state_shape(cfg: &Qwen35Config) -> RecurrentShape {
        RecurrentShape {
            conv_kernel: cfg.linear_conv_kernel_dim,
            conv_dim: cfg.linear_conv_dim(),
            value_heads: cfg.linear_num_value_heads,
            value_dim: cfg.linear_value_head_dim,
            key_dim: cfg.linear_key_head_dim,
            ssm_dtype: DType::F32,
        }
    }

    pub fn load(src: &dyn WeightSource, name: &str, cfg: &Qwen35Config, dtype: DType) -> Result<Self> {
        let hidden = cfg.hidden_size;
        let shape = Self::state_shape(cfg);
        let (hv, dv) = (cfg.linear_num_value_heads, cfg.linear_value_head_dim);
        let conv_weight = src
            .get(&format!("{name}.conv1d.weight"), &[shape.conv_dim, 1, shape.conv_kernel], DType::F32)?
            .reshape((shape.conv_dim, shape.conv_kernel))?;
        Ok(Self {
            in_proj: Projections::load(
                src,
                &[
                    (format!("{name}.in_proj_qkv"), shape.conv_dim),
                    (format!("{name}.in_proj_z"), hv * dv),
                    (format!("{name}.in_proj_b"), hv),
                    (format!("{name}.in_proj_a"), hv),
                ],
                hidden,
                false,
                dtype,
            )?,
            conv_weight,
            a_log: src.get(&format!("{name}.A_log"), &[hv], DType::F32)?,
            dt_bias: src.get(&format!("{name}.dt_bias"), &[hv], DType::F32)?,
            norm: GatedRmsNorm::load(src, &format!("{name}.norm"), dv, cfg.rms_norm_eps)?,
            out_proj: Linear::load(src, &format!("{name}.out_proj"), hidden, hv * dv, false, dtype)?,
            shape,
            key_heads: cfg.linear_num_key_heads,
        })
    }

    /// `x` `[B, T, hidden]`. In an open speculative round, the recurrence inputs are kept
    /// for [`GatedDeltaNet::close_round`].
    pub fn forward(&self, x: &Tensor, state: &mut RecurrentState) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let [qkv, z, beta_logits, a] = self.in_proj.forward(x)?;
        let (conv, ssm) = state.tensors()?;
        let (o, conv, ssm) = self.recurrence(&qkv, &a, &beta_logits, &conv, &ssm)?;
        if let Some(round) = &mut state.round {
            round.inputs.push(vec![qkv, a, beta_logits]);
        }
        state.set(conv, ssm)?;
        self.output(&o, &z, (b, t))
    }

    /// [`GatedDeltaNet::forward`] of one recorded decode step over a state pool's slots: the
    /// new conv windows and recurrent states are written over the old ones in `conv` `[S, K-1,
    /// C]` and `ssm` `[S, Hv, Dv, Dk]`, row `b` at slot `slots[b]` (`[B]` i32, device), which
    /// the step must hold alone.
    #[cfg(feature = "cuda")]
    pub fn forward_in_place(&self, x: &Tensor, conv: &Tensor, ssm: &Tensor, slots: &Tensor) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let [qkv, z, beta_logits, a] = self.in_proj.forward(x)?;
        let mixed = strata_kernels::conv1d::causal_conv1d_silu_step_in_place(&qkv, conv, &self.conv_weight, Some(slots))?;
        let [q, k, v] = self.split_heads(&mixed)?;
        let o = gated_delta::gated_delta_rule_in_place(
            &gated_delta::Inputs { q: &q, k: &k, v: &v, a: &a, b: &beta_logits },
            &self.gating(),
            ssm,
            Some(slots),
        )?;
        self.output(&o, &z, (b, t))
    }

    /// Gated norm of the recurrence output `[B, T, Hv, Dv]`, then `out_proj`.
    fn output(&self, o: &Tensor, z: &Tensor, (b, t): (usize, usize)) -> Result<Tensor> {
        let (hv, dv) = (self.shape.value_heads, self.shape.value_dim);
        let o = self.norm.forward(o, z)?;
        self.out_proj.forward(&o.reshape((b, t, hv * dv))?)
    }

    /// q, k `[B, T, Hk, Dk]` and v `[B, T, Hv, Dv]` from the conv output: views of it when key
    /// and value heads are as wide (candle copies a reshaped narrow, the other way round).
    fn split_heads(&self, mixed: &Tensor) -> Result<[Tensor; 3]> {
        let (b, t, c) = mixed.dims3()?;
        let (hk, dk) = (self.key_heads, self.shape.key_dim);
        let (hv, dv) = (self.shape.value_heads, self.shape.value_dim);
        if dk == dv && mixed.is_contiguous() {
            let heads = mixed.reshape((b, t, c / dk, dk))?;
            return Ok([heads.narrow(2, 0, hk)?, heads.narrow(2, hk, hk)?, heads.narrow(2, 2 * hk, hv)?]);
        }
        Ok([
            mixed.narrow(2, 0, hk * dk)?.reshape((b, t, hk, dk))?,
            mixed.narrow(2, hk * dk, hk * dk)?.reshape((b, t, hk, dk))?,
            mixed.narrow(2, 2 * hk * dk, hv * dv)?.reshape((b, t, hv, dv))?,
        ])
    }

    fn gating(&self) -> gated_delta::Gating<'_> {
        gated_delta::Gating { a_log: &self.a_log, dt_bias: &self.dt_bias }
    }

    /// Conv + SiLU, then the gated delta rule, from the projections of `[B, T]` positions and
    /// the state before them; returns the outputs and the state after them.
    fn recurrence(
        &self,
        qkv: &Tensor,
        a: &Tensor,
        beta_logits: &Tensor,
        conv: &Tensor,
        ssm: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (mixed, conv) = causal_conv1d_silu(qkv, conv, &self.conv_weight)?;
        let [q, k, v] = self.split_heads(&mixed)?;
        let (o, ssm) =
            gated_delta::gated_delta_rule(&gated_delta::Inputs { q: &q, k: &k, v: &v, a, b: beta_logits }, &self.gating(), ssm)?;
        Ok((o, conv, ssm))
    }

    /// Opens a speculative round: remembers the state (references to the rows' own tensors,
    /// or copies out of their slots) and starts recording.
    pub fn open_round(state: &mut RecurrentState) -> Result<()> {
        let (conv, ssm) = state.tensors()?;
        state.round = Some(RecurrentRound { conv, ssm, inputs: Vec::new() });
        Ok(())
    }

    /// Closes the round keeping the first `keep[r]` of the `fed[r]` positions row `r` was fed:
    /// from the state before the round, the same recurrence folds in the kept positions' recorded
    /// inputs, so the state is what a forward over only those positions leaves.
    pub fn close_round(&self, state: &mut RecurrentState, fed: &[usize], keep: &[usize]) -> Result<()> {
        let round = state.round.take().ok_or_else(|| crate::ModelError::Invalid("no speculative round is open".into()))?;
        if keep.iter().zip(fed).all(|(k, f)| k == f) {
            return Ok(());
        }
        let recorded = |i: usize| Tensor::cat(&round.inputs.iter().map(|step| &step[i]).collect::<Vec<_>>(), 1);
        let (qkv, a, beta_logits) = (recorded(0)?, recorded(1)?, recorded(2)?);
        let (now_conv, now_ssm) = state.tensors()?;
        let (mut convs, mut ssms) = (Vec::with_capacity(fed.len()), Vec::with_capacity(fed.len()));
        for (r, (&kept, &fed)) in keep.iter().zip(fed).enumerate() {
            let (conv, ssm) = if kept == fed {
                (now_conv.narrow(0, r, 1)?, now_ssm.narrow(0, r, 1)?)
            } else if kept == 0 {
                (round.conv.narrow(0, r, 1)?, round.ssm.narrow(0, r, 1)?)
            } else {
                let row = |t: &Tensor| t.narrow(0, r, 1)?.narrow(1, 0, kept);
                let (_, conv, ssm) = self.recurrence(
                    &row(&qkv)?,
                    &row(&a)?,
                    &row(&beta_logits)?,
                    &round.conv.narrow(0, r, 1)?,
                    &round.ssm.narrow(0, r, 1)?,
                )?;
                (conv, ssm)
            };
            convs.push(conv);
            ssms.push(ssm);
        }
        state.set(Tensor::cat(&convs, 0)?, Tensor::cat(&ssms, 0)?)?;
        Ok(())
    }
}
