//! Softmax attention of the dense decoders: q/k/v projections (optional bias), optional per-head
//! q/k RMSNorm (Qwen3), full RoPE, GQA over each row's own KV history, `o_proj`.

use candle_core::{DType, Tensor};
use strata_kernels::attention::{rope, Scoring};
use strata_state::KvStore;

use super::config::DenseConfig;
use super::norm::RmsNorm;
use crate::error::Result;
use crate::qwen3_5::layers::Linear;
use crate::smoothing::{self, AttentionWeights, ChannelNorm, Side};
use crate::source::WeightSource;

pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    /// The q/k norms with the keys smoothed, where the layer's KV is quantized
    /// ([`crate::smoothing`]; models with q/k norms only).
    smoothed: Option<(RmsNorm, RmsNorm)>,
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
            smoothed: None,
            heads: h,
            kv_heads: kv,
            head_dim: d,
        })
    }

    /// Smooths the keys ([`crate::smoothing`]) where `quantized` (the layer's KV is stored in
    /// codes) and the layer normalises its queries and keys, or stops: `input_scale` is the
    /// layer's input norm's weight. The rotary embedding turns channel pairs half a head apart.
    pub fn smooth_keys(&mut self, quantized: bool, input_scale: &Tensor) -> Result<()> {
        self.smoothed = None;
        let Some((q_norm, k_norm)) = self.qk_norm.as_ref().filter(|_| quantized) else {
            return Ok(());
        };
        let (h, kv, d) = (self.heads as u32, self.kv_heads as u32, self.head_dim as u32);
        let weights = AttentionWeights {
            query: Side { proj: self.q_proj.weight(), rows: (0..h * d).collect(), norm_scale: q_norm.scale() },
            key: Side { proj: self.k_proj.weight(), rows: (0..kv * d).collect(), norm_scale: k_norm.scale() },
            input_scale,
            rotary_half: self.head_dim / 2,
        };
        self.smoothed = smoothing::smoothed_norms(&weights, q_norm, k_norm)?;
        Ok(())
    }

    /// `x` `[B, T, hidden]`; `rope_tables` holds the per-row cos/sin tables for these positions.
    pub fn forward(&self, x: &Tensor, kv: &mut KvStore, rope_tables: &(Tensor, Tensor)) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, d) = (self.heads, self.head_dim);
        let mut q = self.q_proj.forward(x)?.reshape((b, t, h, d))?;
        let mut k = self.k_proj.forward(x)?.reshape((b, t, self.kv_heads, d))?;
        let v = self.v_proj.forward(x)?.reshape((b, t, self.kv_heads, d))?.transpose(1, 2)?;
        if let Some((q_norm, k_norm)) = self.smoothed.as_ref().or(self.qk_norm.as_ref()) {
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
