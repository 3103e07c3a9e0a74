//! Gated full attention: per head `[q | gate]` from `q_proj`, q/k norms, partial RoPE, GQA over
//! each row's KV history, output times `sigmoid(gate)`.

use candle_core::{DType, Tensor};
use strata_kernels::attention::Scoring;
use strata_state::KvStore;

use super::layers::{Linear, Projections, RmsNorm};
use crate::config::Qwen35Config;
use crate::error::Result;
use crate::source::WeightSource;

pub struct Attention {
    /// `q_proj` (`[q | gate]` per head), `k_proj`, `v_proj`.
    qkv_proj: Projections,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    pub fn load(src: &dyn WeightSource, name: &str, cfg: &Qwen35Config, dtype: DType) -> Result<Self> {
        let (h, kv, d, hidden) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size);
        let bias = cfg.attention_bias;
        Ok(Self {
            qkv_proj: Projections::load(
                src,
                &[(format!("{name}.q_proj"), 2 * h * d), (format!("{name}.k_proj"), kv * d), (format!("{name}.v_proj"), kv * d)],
                hidden,
                bias,
                dtype,
            )?,
            o_proj: Linear::load(src, &format!("{name}.o_proj"), hidden, h * d, bias, dtype)?,
            q_norm: RmsNorm::load(src, &format!("{name}.q_norm"), d, cfg.rms_norm_eps)?,
            k_norm: RmsNorm::load(src, &format!("{name}.k_norm"), d, cfg.rms_norm_eps)?,
            heads: h,
            kv_heads: kv,
            head_dim: d,
        })
    }

    /// `x` `[B, T, hidden]`; `rope` holds the per-row cos/sin tables for these positions.
    pub fn forward(&self, x: &Tensor, kv: &mut KvStore, rope: &(Tensor, Tensor)) -> Result<Tensor> {
        let Heads { q, k, v, gate } = self.heads(x, rope)?;
        Ok(self.o_proj.forward(&kv.attend(&q, &k, &v, self.scoring(), Some(&gate))?)?)
    }

    /// [`Attention::forward`] of one recorded decode step: the KV append and the attention go
    /// through `rows`' block tables, each row's length after the step read from `lens`.
    #[cfg(feature = "cuda")]
    pub fn forward_captured(
        &self,
        x: &Tensor,
        rows: &strata_kernels::attention::PagedDecodeRows,
        lens: &Tensor,
        rope: &(Tensor, Tensor),
    ) -> Result<Tensor> {
        let Heads { q, k, v, gate } = self.heads(x, rope)?;
        Ok(self.o_proj.forward(&rows.append_attend_gated(&q, &k, &v, lens, self.scoring(), &gate)?)?)
    }

    /// q, k (normed and rotated, `[B, H, T, D]`), v `[B, Hkv, T, D]` and the output gate
    /// `[B, T, H, D]`.
    fn heads(&self, x: &Tensor, rope: &(Tensor, Tensor)) -> Result<Heads> {
        let (b, t, _) = x.dims3()?;
        let (h, d) = (self.heads, self.head_dim);
        let [qg, k, v] = self.qkv_proj.forward(x)?;
        let qg = qg.reshape((b, t, h, 2 * d))?;
        let q = self.q_norm.forward_rope(&qg.narrow(3, 0, d)?, rope)?;
        let gate = qg.narrow(3, d, d)?;
        let k = self.k_norm.forward_rope(&k.reshape((b, t, self.kv_heads, d))?, rope)?;
        let v = v.reshape((b, t, self.kv_heads, d))?.transpose(1, 2)?;
        Ok(Heads { q, k, v, gate })
    }

    fn scoring(&self) -> Scoring {
        Scoring::scaled(1.0 / (self.head_dim as f64).sqrt())
    }
}

struct Heads {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gate: Tensor,
}
