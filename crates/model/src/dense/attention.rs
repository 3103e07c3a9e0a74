//! Softmax attention of the dense decoders: q/k/v projections (optional bias), optional per-head
//! q/k RMSNorm (Qwen3), full RoPE, GQA over each row's own KV history, `o_proj`.

use candle_core::{DType, Tensor};
use strata_kernels::attention::{rope, Scoring};
use strata_state::KvStore;

use super::config::DenseConfig;
use super::norm::RmsNorm;
use crate::error::Result;
use crate::qwen3_5::layers::Linear;
use crate::source::WeightSource;

pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    pub fn load(src: &dyn WeightSource, name: &str, cfg: &DenseConfig, dtype: DType) -> Result<Self> {
        let (h, kv, d, hidden) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size);
        let linear =
            |proj: &str, out_dim, in_dim, bias| Linear::load(src, &format!("{name}.{proj}"), out_dim, in_dim, bias, dtype);
        let norm = |which: &str| RmsNorm::load(src, &format!("{name}.{which}"), d, cfg.rms_norm_eps, dtype);
        Ok(Self {
            q_proj: linear("q_proj", h * d, hidden, cfg.qkv_bias)?,
            k_proj: linear("k_proj", kv * d, hidden, cfg.qkv_bias)?,
            v_proj: linear("v_proj", kv * d, hidden, cfg.qkv_bias)?,
            o_proj: linear("o_proj", hidden, h * d, cfg.o_bias)?,
            qk_norm: if cfg.qk_norm() { Some((norm("q_norm")?, norm("k_norm")?)) } else { None },
            heads: h,
            kv_heads: kv,
            head_dim: d,
        })
    }

    /// `x` `[B, T, hidden]`; `rope_tables` holds the per-row cos/sin tables for these positions.
    pub fn forward(&self, x: &Tensor, kv: &mut KvStore, rope_tables: &(Tensor, Tensor)) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, d) = (self.heads, self.head_dim);
        let mut q = self.q_proj.forward(x)?.reshape((b, t, h, d))?;
        let mut k = self.k_proj.forward(x)?.reshape((b, t, self.kv_heads, d))?;
        let v = self.v_proj.forward(x)?.reshape((b, t, self.kv_heads, d))?.transpose(1, 2)?;
        if let Some((q_norm, k_norm)) = &self.qk_norm {
            q = q_norm.forward(&q)?;
            k = k_norm.forward(&k)?;
        }
        let q = rope(&q.transpose(1, 2)?, &rope_tables.0, &rope_tables.1)?;
        let k = rope(&k.transpose(1, 2)?, &rope_tables.0, &rope_tables.1)?;
        let scoring = Scoring::scaled(1.0 / (d as f64).sqrt());
        let out = kv.attend(&q, &k, &v, scoring, None)?.transpose(1, 2)?.reshape((b, t, h * d))?;
        self.o_proj.forward(&out)
    }
}
