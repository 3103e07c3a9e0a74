//! Gated full attention: per head `[q | gate]` from `q_proj`, q/k norms, partial RoPE, GQA over
//! each row's KV history, output times `sigmoid(gate)`.

use candle_core::{DType, Tensor};
use strata_kernels::attention::Scoring;
use strata_state::KvStore;

use super::layers::{Linear, Projections, RmsNorm};
use crate::config::Qwen35Config;
use crate::error::Result;
use crate::smoothing::{self, AttentionWeights, ChannelNorm, Side};
use crate::source::WeightSource;

pub struct Attention {
    /// `q_proj` (`[q | gate]` per head), `k_proj`, `v_proj`.
    qkv_proj: Projections,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    /// The query and key norms with the keys smoothed, where the layer's KV is quantized
    /// ([`crate::smoothing`]).
    smoothed: Option<(RmsNorm, RmsNorm)>,
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
            smoothed: None,
            heads: h,
            kv_heads: kv,
            head_dim: d,
        })
    }

    /// Smooths the keys ([`crate::smoothing`]) where `quantized` (the layer's KV is stored in
    /// codes), or stops: `input_scale` is the layer's input norm's, `rotary_half` half the
    /// rotated channels. The query rows are the first `D` of each head's `[q | gate]` in `q_proj`.
    pub fn smooth_keys(&mut self, quantized: bool, input_scale: &Tensor, rotary_half: usize) -> Result<()> {
        self.smoothed = None;
        if !quantized {
            return Ok(());
        }
        let (h, kv, d) = (self.heads as u32, self.kv_heads as u32, self.head_dim as u32);
        let (q_proj, k_proj, k_first) = match &self.qkv_proj {
            // One matrix: q_proj's rows, then k_proj's.
            Projections::Joined { linear, .. } => (linear.weight(), linear.weight(), 2 * h * d),
            Projections::Apart(parts) => (parts[0].weight(), parts[1].weight(), 0),
        };
        let weights = AttentionWeights {
            query: Side {
                proj: q_proj,
                rows: (0..h).flat_map(|head| (0..d).map(move |c| head * 2 * d + c)).collect(),
                norm_scale: self.q_norm.scale(),
            },
            key: Side { proj: k_proj, rows: (k_first..k_first + kv * d).collect(), norm_scale: self.k_norm.scale() },
            input_scale,
            rotary_half,
        };
        self.smoothed = smoothing::smoothed_norms(&weights, &self.q_norm, &self.k_norm)?;
        Ok(())
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
        let (q_norm, k_norm) = self.smoothed.as_ref().map_or((&self.q_norm, &self.k_norm), |(q, k)| (q, k));
        let q = q_norm.forward_rope(&qg.narrow(3, 0, d)?, rope)?;
        let gate = qg.narrow(3, d, d)?;
        let k = k_norm.forward_rope(&k.reshape((b, t, self.kv_heads, d))?, rope)?;
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
