//! Gated DeltaNet layer: projections, causal conv1d + SiLU, the gated delta recurrence (f32
//! state), gated RMSNorm per value head, output projection.

use candle_core::{DType, Tensor};
use strata_kernels::{conv1d::causal_conv1d_silu, gated_delta};
use strata_state::{RecurrentShape, RecurrentState};

use super::layers::{GatedRmsNorm, Linear};
use crate::config::Qwen35Config;
use crate::error::Result;
use crate::source::WeightSource;

pub struct GatedDeltaNet {
    in_proj_qkv: Linear,
    in_proj_z: Linear,
    in_proj_b: Linear,
    in_proj_a: Linear,
    /// `[conv_dim, K]`, f32.
    conv_weight: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    norm: GatedRmsNorm,
    out_proj: Linear,
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
            in_proj_qkv: Linear::load(src, &format!("{name}.in_proj_qkv"), shape.conv_dim, hidden, false, dtype)?,
            in_proj_z: Linear::load(src, &format!("{name}.in_proj_z"), hv * dv, hidden, false, dtype)?,
            in_proj_b: Linear::load(src, &format!("{name}.in_proj_b"), hv, hidden, false, dtype)?,
            in_proj_a: Linear::load(src, &format!("{name}.in_proj_a"), hv, hidden, false, dtype)?,
            conv_weight,
            a_log: src.get(&format!("{name}.A_log"), &[hv], DType::F32)?,
            dt_bias: src.get(&format!("{name}.dt_bias"), &[hv], DType::F32)?,
            norm: GatedRmsNorm::load(src, &format!("{name}.norm"), dv, cfg.rms_norm_eps)?,
            out_proj: Linear::load(src, &format!("{name}.out_proj"), hidden, hv * dv, false, dtype)?,
            shape,
            key_heads: cfg.linear_num_key_heads,
        })
    }

    /// `x` `[B, T, hidden]`.
    pub fn forward(&self, x: &Tensor, state: &mut RecurrentState) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (hk, dk) = (self.key_heads, self.shape.key_dim);
        let (hv, dv) = (self.shape.value_heads, self.shape.value_dim);
        let qkv = self.in_proj_qkv.forward(x)?;
        let z = self.in_proj_z.forward(x)?.reshape((b, t, hv, dv))?;
        let beta_logits = self.in_proj_b.forward(x)?;
        let a = self.in_proj_a.forward(x)?;
        let (mixed, conv) = causal_conv1d_silu(&qkv, &state.conv, &self.conv_weight)?;
        let q = mixed.narrow(2, 0, hk * dk)?.reshape((b, t, hk, dk))?;
        let k = mixed.narrow(2, hk * dk, hk * dk)?.reshape((b, t, hk, dk))?;
        let v = mixed.narrow(2, 2 * hk * dk, hv * dv)?.reshape((b, t, hv, dv))?;
        let gating = gated_delta::Gating { a_log: &self.a_log, dt_bias: &self.dt_bias };
        let (o, ssm) = gated_delta::gated_delta_rule(&q, &k, &v, &a, &beta_logits, &gating, &state.ssm)?;
        state.conv = conv;
        state.ssm = ssm;
        // transformers hands the recurrence output back in the model dtype before the norm.
        let o = self.norm.forward(&o.to_dtype(x.dtype())?, &z)?;
        self.out_proj.forward(&o.reshape((b, t, hv * dv))?)
    }
}
