//! Dense decoders (transformers `qwen3`, `qwen2`, `llama`): every layer is softmax attention then
//! a SwiGLU MLP, each behind a plain RMSNorm. The state is attention KV only, so every row can be
//! trimmed back to any earlier position (what a speculative draft model needs).

mod attention;
pub mod config;
mod norm;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use strata_state::{BatchState, KvPolicy, KvShape, LayerSpec, LayerState, StateSpec};

use self::attention::Attention;
use self::norm::RmsNorm;
use crate::error::{ModelError, Result};
use crate::parallel::{Collective, Parallel, ShardedSource, TensorParallel};
use crate::qwen3_5::layers::{Linear, Matrix, Mlp, Rotary};
use crate::qwen3_5::Logits;
use crate::smoothing::ChannelNorm;
use crate::source::WeightSource;

pub use self::config::{DenseConfig, DenseFamily, Llama3Scaling};

struct DecoderLayer {
    input_norm: RmsNorm,
    attn: Attention,
    post_norm: RmsNorm,
    mlp: Mlp,
}

pub struct Dense {
    cfg: DenseConfig,
    /// The shapes this model's layers hold: `cfg`'s, or a tensor-parallel rank's share of them.
    local: DenseConfig,
    parallel: Parallel,
    embed: Matrix,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: Rotary,
    dtype: DType,
    /// How attention KV is stored (`--kv-cache-dtype`).
    kv: KvPolicy,
    device: Device,
}

impl Dense {
    /// Builds the model from `src`, whose names are relative to the decoder
    /// (`embed_tokens.weight`, `layers.N.…`, `norm.weight`), plus `lm_head.weight` when untied.
    pub fn load(cfg: &DenseConfig, src: &dyn WeightSource, dtype: DType) -> Result<Self> {
        Self::load_share(cfg, cfg, src, dtype, Parallel::default())
    }

    /// This rank's share of the model split over `group` (see [`crate::parallel`]).
    pub fn load_sharded(cfg: &DenseConfig, src: &dyn WeightSource, dtype: DType, group: Arc<dyn Collective>) -> Result<Self> {
        let parallel = Arc::new(TensorParallel::new(cfg.split_dims(), group)?);
        let src = ShardedSource { inner: src, parallel: &parallel };
        Self::load_share(cfg, &cfg.share(&parallel), &src, dtype, Parallel::new(parallel.clone()))
    }

    /// Loads layers of `local`'s shapes from `src`, as a model of `cfg`.
    fn load_share(
        cfg: &DenseConfig,
        local: &DenseConfig,
        src: &dyn WeightSource,
        dtype: DType,
        parallel: Parallel,
    ) -> Result<Self> {
        let (hidden, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let embed = src.matrix("embed_tokens.weight", local.vocab_size, hidden, dtype)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("layers.{i}");
                Ok(DecoderLayer {
                    input_norm: RmsNorm::load(src, &format!("{p}.input_layernorm"), hidden, eps, dtype)?,
                    attn: Attention::load(src, &format!("{p}.self_attn"), local, dtype)?,
                    post_norm: RmsNorm::load(src, &format!("{p}.post_attention_layernorm"), hidden, eps, dtype)?,
                    mlp: Mlp::load(src, &format!("{p}.mlp"), hidden, local.intermediate_size, dtype)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::from_weight(embed.clone())
        } else {
            Linear::load(src, "lm_head", local.vocab_size, hidden, false, dtype)?
        };
        let mut rotary = Rotary::new(cfg.head_dim, cfg.rope_theta);
        if let Some(scaling) = &cfg.rope_scaling {
            scaling.apply(&mut rotary.inv_freq);
        }
        Ok(Self {
            cfg: cfg.clone(),
            local: local.clone(),
            parallel,
            embed,
            layers,
            norm: RmsNorm::load(src, "norm", hidden, eps, dtype)?,
            lm_head,
            rotary,
            dtype,
            kv: KvPolicy::default(),
            device: src.device().clone(),
        })
    }

    pub fn config(&self) -> &DenseConfig {
        &self.cfg
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Stores attention KV in `kv` in states built from now on (see [`crate::Model::set_kv_format`]),
    /// with the keys of layers whose KV is quantized smoothed ([`crate::smoothing`]).
    pub fn set_kv_format(&mut self, kv: KvPolicy) -> Result<()> {
        let layers = self.layers.len();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            layer.attn.smooth_keys(kv.format_at(i, layers)?.is_quantized(), layer.input_norm.scale())?;
        }
        self.kv = kv;
        Ok(())
    }

    /// Every layer holds full-attention KV.
    pub fn state_spec(&self) -> StateSpec {
        let kv = KvShape { kv_heads: self.local.num_key_value_heads, head_dim: self.cfg.head_dim };
        StateSpec { layers: vec![LayerSpec::Attention(kv); self.layers.len()], dtype: self.dtype, kv: self.kv.clone() }
    }

    /// Runs `tokens` (`[B, T]`, u32) through the model, each row continuing from its own
    /// position in `state`, and advances the state. Returns f32 logits.
    pub fn forward(&self, tokens: &Tensor, state: &mut BatchState, logits: Logits) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        if b != state.rows() || state.layers.len() != self.layers.len() {
            return Err(ModelError::Invalid(format!(
                "forward got {b} rows for {} layers, but the state has {} rows and {} layers",
                self.layers.len(),
                state.rows(),
                state.layers.len()
            )));
        }
        let ids = tokens.flatten_all()?;
        if let Some(&bad) = ids.to_vec1::<u32>()?.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
            return Err(ModelError::Invalid(format!("token id {bad} is outside the vocabulary (size {})", self.cfg.vocab_size)));
        }
        let mut x =
            self.parallel.embed(&ids, |ids| self.embed.rows_at(ids, self.dtype))?.reshape((b, t, self.cfg.hidden_size))?;
        let rope = self.rotary.tables(&state.positions, t, &self.device)?;
        for (layer, layer_state) in self.layers.iter().zip(state.layers.iter_mut()) {
            let LayerState::Attention(kv) = layer_state else {
                return Err(ModelError::Invalid(format!("a dense layer got {} state", layer_state.kind())));
            };
            x = (&x + self.parallel.sum(layer.attn.forward(&layer.input_norm.forward(&x)?, kv, &rope)?)?)?;
            x = (&x + self.parallel.sum(layer.mlp.forward(&layer.post_norm.forward(&x)?)?)?)?;
        }
        for p in &mut state.positions {
            *p += t;
        }
        let x = match logits {
            Logits::All => x,
            Logits::Last => x.narrow(1, t - 1, 1)?.squeeze(1)?,
        };
        Ok(self.parallel.gather_vocab(self.lm_head.forward(&self.norm.forward(&x)?)?)?.to_dtype(DType::F32)?)
    }
}
