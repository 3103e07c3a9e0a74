//! Gemma 3 text decoder (transformers `gemma3_text`): local layers attend over a sliding window
//! (their KV lives in a rotating window store) and every few layers one attends globally; each
//! has its own RoPE base. Per-head q/k norms, `(1 + w)` RMSNorms before and after both blocks,
//! embeddings scaled by √hidden, a GELU-tanh gated MLP, the LM head tied to the embeddings, and
//! optional soft-capping of the final logits.

pub mod config;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use strata_kernels::attention::Scoring;
use strata_state::{BatchState, KvPolicy, KvShape, LayerSpec, LayerState, StateSpec, WindowShape};

use crate::error::{ModelError, Result};
use crate::parallel::{Collective, Parallel, ShardedSource, TensorParallel};
use crate::qwen3_5::layers::{Linear, Matrix, RmsNorm, Rotary};
use crate::qwen3_5::Logits;
use crate::smoothing::{self, AttentionWeights, ChannelNorm, Side};
use crate::source::WeightSource;

pub use self::config::{Gemma3Config, RopeSettings};

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    /// The query and key norms with the keys smoothed, where the layer's KV is quantized
    /// ([`smoothing`]).
    smoothed: Option<(RmsNorm, RmsNorm)>,
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up] = Linear::forward_many([&self.gate, &self.up], x)?;
        self.down.forward(&strata_kernels::norm::gelu_mul(&gate, &up)?)
    }
}

struct DecoderLayer {
    sliding: bool,
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    pre_mlp_norm: RmsNorm,
    mlp: Mlp,
    post_mlp_norm: RmsNorm,
}

pub struct Gemma3 {
    cfg: Gemma3Config,
    /// The shapes this model's layers hold: `cfg`'s, or a tensor-parallel rank's share of them.
    local: Gemma3Config,
    parallel: Parallel,
    embed: Matrix,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    global_rotary: Rotary,
    local_rotary: Rotary,
    dtype: DType,
    /// How attention KV is stored (`--kv-cache-dtype`).
    kv: KvPolicy,
    device: Device,
}

fn rotary(head_dim: usize, rope: RopeSettings) -> Rotary {
    let mut r = Rotary::new(head_dim, rope.theta);
    // Linear scaling divides positions, i.e. every frequency, by the factor.
    for f in &mut r.inv_freq {
        *f = (*f as f64 / rope.linear_factor) as f32;
    }
    r
}

impl Gemma3 {
    /// Builds the model from `src`, whose names are relative to the decoder (`embed_tokens.weight`,
    /// `layers.N.…`, `norm.weight`); the LM head is the embedding matrix.
    pub fn load(cfg: &Gemma3Config, src: &dyn WeightSource, dtype: DType) -> Result<Self> {
        Self::load_share(cfg, cfg, src, dtype, Parallel::default())
    }

    /// This rank's share of the model split over `group` (see [`crate::parallel`]).
    pub fn load_sharded(cfg: &Gemma3Config, src: &dyn WeightSource, dtype: DType, group: Arc<dyn Collective>) -> Result<Self> {
        let parallel = Arc::new(TensorParallel::new(cfg.split_dims(), group)?);
        let src = ShardedSource { inner: src, parallel: &parallel };
        Self::load_share(cfg, &cfg.share(&parallel), &src, dtype, Parallel::new(parallel.clone()))
    }

    /// Loads layers of `local`'s shapes from `src`, as a model of `cfg`.
    fn load_share(
        cfg: &Gemma3Config,
        local: &Gemma3Config,
        src: &dyn WeightSource,
        dtype: DType,
        parallel: Parallel,
    ) -> Result<Self> {
        let (hidden, eps, d) = (cfg.hidden_size, cfg.rms_norm_eps, cfg.head_dim);
        let (h, kv, inter) = (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size);
        let embed = src.matrix("embed_tokens.weight", local.vocab_size, hidden, dtype)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("layers.{i}");
                let linear =
                    |name: &str, out_dim, in_dim| Linear::load(src, &format!("{p}.{name}"), out_dim, in_dim, false, dtype);
                let norm = |name: &str, dim| RmsNorm::load(src, &format!("{p}.{name}"), dim, eps);
                Ok(DecoderLayer {
                    sliding: cfg.sliding[i],
                    input_norm: norm("input_layernorm", hidden)?,
                    attn: Attention {
                        q_proj: linear("self_attn.q_proj", h * d, hidden)?,
                        k_proj: linear("self_attn.k_proj", kv * d, hidden)?,
                        v_proj: linear("self_attn.v_proj", kv * d, hidden)?,
                        o_proj: linear("self_attn.o_proj", hidden, h * d)?,
                        q_norm: norm("self_attn.q_norm", d)?,
                        k_norm: norm("self_attn.k_norm", d)?,
                        smoothed: None,
                    },
                    post_attn_norm: norm("post_attention_layernorm", hidden)?,
                    pre_mlp_norm: norm("pre_feedforward_layernorm", hidden)?,
                    mlp: Mlp {
                        gate: linear("mlp.gate_proj", inter, hidden)?,
                        up: linear("mlp.up_proj", inter, hidden)?,
                        down: linear("mlp.down_proj", hidden, inter)?,
                    },
                    post_mlp_norm: norm("post_feedforward_layernorm", hidden)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cfg: cfg.clone(),
            local: local.clone(),
            parallel,
            lm_head: Linear::from_weight(embed.clone()),
            embed,
            layers,
            norm: RmsNorm::load(src, "norm", hidden, eps)?,
            global_rotary: rotary(d, cfg.global_rope),
            local_rotary: rotary(d, cfg.local_rope),
            dtype,
            kv: KvPolicy::default(),
            device: src.device().clone(),
        })
    }

    pub fn config(&self) -> &Gemma3Config {
        &self.cfg
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Stores attention KV in `kv` in states built from now on (see [`crate::Model::set_kv_format`]).
    pub fn set_kv_format(&mut self, kv: KvPolicy) -> Result<()> {
        let (layers, rotary_half, d) = (self.layers.len(), self.cfg.head_dim / 2, self.cfg.head_dim);
        let (heads, kv_heads) = (self.local.num_attention_heads, self.local.num_key_value_heads);
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let a = &mut layer.attn;
            a.smoothed = None;
            if kv.format_at(i, layers)?.is_quantized() {
                let weights = AttentionWeights {
                    query: Side {
                        proj: a.q_proj.weight(),
                        rows: (0..(heads * d) as u32).collect(),
                        norm_scale: a.q_norm.scale(),
                    },
                    key: Side {
                        proj: a.k_proj.weight(),
                        rows: (0..(kv_heads * d) as u32).collect(),
                        norm_scale: a.k_norm.scale(),
                    },
                    input_scale: layer.input_norm.scale(),
                    rotary_half,
                };
                a.smoothed = smoothing::smoothed_norms(&weights, &a.q_norm, &a.k_norm)?;
            }
        }
        self.kv = kv;
        Ok(())
    }

    /// Global layers hold every position's KV, local ones a sliding window's.
    pub fn state_spec(&self) -> StateSpec {
        let kv = KvShape { kv_heads: self.local.num_key_value_heads, head_dim: self.cfg.head_dim };
        let window = WindowShape { kv, window: self.cfg.sliding_window };
        let layers =
            self.layers.iter().map(|l| if l.sliding { LayerSpec::Window(window) } else { LayerSpec::Attention(kv) }).collect();
        StateSpec { layers, dtype: self.dtype, kv: self.kv.clone() }
    }

    /// Runs `tokens` (`[B, T]`, u32), each row continuing from its own position in `state`, and
    /// advances the state. Returns f32 logits.
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
        // transformers rounds √hidden to the model dtype before scaling.
        let normalizer = Tensor::new((self.cfg.hidden_size as f32).sqrt(), &self.device)?.to_dtype(self.dtype)?;
        let embedded = self.parallel.embed(&ids, |ids| self.embed.rows_at(ids, self.dtype))?;
        let mut x = embedded.reshape((b, t, self.cfg.hidden_size))?.broadcast_mul(&normalizer)?;
        let global_rope = self.global_rotary.tables(&state.positions, t, &self.device)?;
        let local_rope = self.local_rotary.tables(&state.positions, t, &self.device)?;
        for (layer, layer_state) in self.layers.iter().zip(state.layers.iter_mut()) {
            let h = layer.input_norm.forward(&x)?;
            let h = if layer.sliding {
                let LayerState::Window(kv) = layer_state else {
                    return Err(ModelError::Invalid(format!("a sliding-window layer got {} state", layer_state.kind())));
                };
                self.attention(layer, &h, &local_rope, |q, k, v, scoring| kv.attend(q, k, v, scoring))?
            } else {
                let LayerState::Attention(kv) = layer_state else {
                    return Err(ModelError::Invalid(format!("a global attention layer got {} state", layer_state.kind())));
                };
                self.attention(layer, &h, &global_rope, |q, k, v, scoring| kv.attend(q, k, v, scoring, None))?
            };
            let h = self.parallel.sum(h)?;
            let (sum, h) = layer.pre_mlp_norm.forward_residual(&x, &layer.post_attn_norm.forward(&h)?)?;
            let h = self.parallel.sum(layer.mlp.forward(&h)?)?;
            x = (&sum + layer.post_mlp_norm.forward(&h)?)?;
        }
        for p in &mut state.positions {
            *p += t;
        }
        let x = match logits {
            Logits::All => x,
            Logits::Last => x.narrow(1, t - 1, 1)?.squeeze(1)?,
        };
        let out = self.parallel.gather_vocab(self.lm_head.forward(&self.norm.forward(&x)?)?)?.to_dtype(DType::F32)?;
        Ok(match self.cfg.final_logit_softcapping {
            Some(cap) => ((out / cap)?.tanh()? * cap)?,
            None => out,
        })
    }

    /// Attention of one layer; `attend` stores the rows' new keys and values and attends the
    /// queries over what each row holds (the whole history, or the window's), `[B, H, T, D]`.
    fn attention(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        rope: &(Tensor, Tensor),
        attend: impl FnOnce(&Tensor, &Tensor, &Tensor, Scoring) -> strata_state::Result<Tensor>,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, kv, d) = (self.local.num_attention_heads, self.local.num_key_value_heads, self.cfg.head_dim);
        let a = &layer.attn;
        let [q, k, v] = Linear::forward_many([&a.q_proj, &a.k_proj, &a.v_proj], x)?;
        let (q_norm, k_norm) = a.smoothed.as_ref().map_or((&a.q_norm, &a.k_norm), |(q, k)| (q, k));
        let q = q_norm.forward_rope(&q.reshape((b, t, h, d))?, rope)?;
        let k = k_norm.forward_rope(&k.reshape((b, t, kv, d))?, rope)?;
        let v = v.reshape((b, t, kv, d))?.transpose(1, 2)?;
        let scoring = Scoring {
            scale: 1.0 / self.cfg.query_pre_attn_scalar.sqrt(),
            window: layer.sliding.then_some(self.cfg.sliding_window),
        };
        let out = attend(&q, &k, &v, scoring)?.transpose(1, 2)?.reshape((b, t, h * d))?;
        a.o_proj.forward(&out)
    }
}
