//! The architecture families strata runs, behind one config and one model type, chosen by
//! `config.json`'s `model_type`.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use strata_state::{BatchState, KvFormat, KvPolicy, StateCost, StateSpec};

use crate::config::Qwen35Config;
use crate::dense::{Dense, DenseConfig};
use crate::error::{ModelError, Result};
use crate::gemma3::{Gemma3, Gemma3Config};
use crate::qwen3_5::{ImageInputs, Logits, MtpHead, Qwen35, Round, Segment, SegmentOutput, VisionTower};
use crate::source::WeightSource;

/// A parsed `config.json`, by family.
#[derive(Clone, Debug, PartialEq)]
pub enum ArchConfig {
    /// `qwen3_5` (nested) and `qwen3_5_text`, and their mixture-of-experts twins `qwen3_5_moe`
    /// and `qwen3_5_moe_text`.
    Qwen35(Qwen35Config),
    /// `qwen3`, `qwen2`, `llama`.
    Dense(DenseConfig),
    /// `gemma3_text`, `gemma3` (its text model).
    Gemma3(Gemma3Config),
}

impl ArchConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json(&crate::error::read_json(path)?, path)
    }

    /// Parses a config in the Hugging Face layout; `path` names where it came from in errors.
    pub fn from_json(root: &Value, path: &Path) -> Result<Self> {
        match root.get("model_type").and_then(Value::as_str) {
            Some(t) if crate::config::SUPPORTED_MODEL_TYPES.contains(&t) => Ok(ArchConfig::Qwen35(Qwen35Config::from_json(root, path)?)),
            Some("qwen3" | "qwen2" | "llama") => Ok(ArchConfig::Dense(DenseConfig::from_json(root, path)?)),
            Some("gemma3" | "gemma3_text") => Ok(ArchConfig::Gemma3(Gemma3Config::from_json(root, path)?)),
            Some(other) => Err(ModelError::field(
                path,
                "model_type",
                format!(
                    "`{other}` is not supported (supported: qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, qwen3, qwen2, llama, gemma3, gemma3_text)"
                ),
            )),
            None => Err(ModelError::field(path, "model_type", "missing")),
        }
    }
}

/// What every caller needs of a config whatever its family, beside the family's own fields.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    pub arch: ArchConfig,
}

impl From<ArchConfig> for ModelConfig {
    fn from(arch: ArchConfig) -> Self {
        let (vocab_size, max_position_embeddings, eos_token_ids) = match &arch {
            ArchConfig::Qwen35(c) => (c.vocab_size, c.max_position_embeddings, c.eos_token_ids.clone()),
            ArchConfig::Dense(c) => (c.vocab_size, c.max_position_embeddings, c.eos_token_ids.clone()),
            ArchConfig::Gemma3(c) => (c.vocab_size, c.max_position_embeddings, c.eos_token_ids.clone()),
        };
        Self { vocab_size, max_position_embeddings, eos_token_ids, arch }
    }
}

/// Decode steps recorded as CUDA graphs and replayed, and where the replayed steps' time went:
/// on the host before each replay (checks, block tables, uploads), and on the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub recordings: usize,
    pub replays: usize,
    pub prepare_ns: u64,
    pub replay_gpu_ns: u64,
}

/// A loaded model of any supported family.
pub enum Model {
    Qwen35(Qwen35),
    Dense(Dense),
    Gemma3(Gemma3),
}

impl Model {
    pub fn load(cfg: &ArchConfig, src: &dyn WeightSource, dtype: DType) -> Result<Self> {
        Ok(match cfg {
            ArchConfig::Qwen35(c) => Model::Qwen35(Qwen35::load(c, src, dtype)?),
            ArchConfig::Dense(c) => Model::Dense(Dense::load(c, src, dtype)?),
            ArchConfig::Gemma3(c) => Model::Gemma3(Gemma3::load(c, src, dtype)?),
        })
    }

    /// Runs `tokens` (`[B, T]`, u32), each row from its own position in `state`; f32 logits.
    pub fn forward(&self, tokens: &Tensor, state: &mut BatchState, logits: Logits) -> Result<Tensor> {
        match self {
            Model::Qwen35(m) => m.forward(tokens, state, logits),
            Model::Dense(m) => m.forward(tokens, state, logits),
            Model::Gemma3(m) => m.forward(tokens, state, logits),
        }
    }

    /// One forward over several segments of rows of different lengths, each continuing its
    /// own state (see [`Qwen35::forward_segments`]); with `hidden`, also every position's final
    /// normed hidden state. A single segment is a plain forward (a decode step may replay a
    /// CUDA graph), and so is a first segment of decode rows a graph may run (see
    /// [`Qwen35::replays_decode`]), the others following in a forward of their own; dense and
    /// Gemma 3 models run one forward per segment. A segment with images gives no hidden
    /// states (an MTP head does not read image prompts).
    pub fn forward_segments(&self, segments: &mut [Segment<'_>], hidden: bool) -> Result<Vec<SegmentOutput>> {
        match (self, segments) {
            (_, [one]) => Ok(vec![self.forward_segment(one, hidden)?]),
            (Model::Qwen35(m), [decode, prompts @ ..]) if m.replays_decode(decode, hidden) => {
                let mut outputs = vec![self.forward_segment(decode, hidden)?];
                match prompts {
                    [one] => outputs.push(self.forward_segment(one, hidden)?),
                    _ => outputs.extend(m.forward_segments(prompts, hidden)?),
                }
                Ok(outputs)
            }
            (Model::Qwen35(m), segments) => m.forward_segments(segments, hidden),
            (Model::Dense(_) | Model::Gemma3(_), segments) => {
                segments.iter_mut().map(|s| self.forward_segment(s, hidden)).collect()
            }
        }
    }

    /// A forward of one segment alone.
    fn forward_segment(&self, s: &mut Segment<'_>, hidden: bool) -> Result<SegmentOutput> {
        let (logits, hidden) = match (s.images, hidden) {
            (Some(images), _) => (self.forward_images(s.tokens, images, s.state, s.logits)?, None),
            (None, true) => self.forward_with_hidden(s.tokens, s.state, s.logits).map(|(l, h)| (l, Some(h)))?,
            (None, false) => (self.forward(s.tokens, s.state, s.logits)?, None),
        };
        Ok(SegmentOutput { logits, hidden })
    }

    /// [`Model::forward`] of one row holding images (see [`Qwen35::forward_images`]).
    pub fn forward_images(
        &self,
        tokens: &Tensor,
        images: &ImageInputs,
        state: &mut BatchState,
        logits: Logits,
    ) -> Result<Tensor> {
        match self {
            Model::Qwen35(m) => m.forward_images(tokens, images, state, logits),
            Model::Dense(_) | Model::Gemma3(_) => {
                Err(ModelError::Invalid("images need a Qwen3.5 model with a vision tower".into()))
            }
        }
    }

    /// The vision tower, where the model takes images.
    pub fn vision(&self) -> Option<&VisionTower> {
        match self {
            Model::Qwen35(m) => m.vision(),
            Model::Dense(_) | Model::Gemma3(_) => None,
        }
    }

    /// [`Model::forward`], also returning every position's final normed hidden state `[B, T,
    /// hidden]`, for a multi-token-prediction head (Qwen3.5 only).
    pub fn forward_with_hidden(&self, tokens: &Tensor, state: &mut BatchState, logits: Logits) -> Result<(Tensor, Tensor)> {
        match self {
            Model::Qwen35(m) => m.forward_with_hidden(tokens, state, logits),
            Model::Dense(_) => Err(no_mtp_head("dense (llama / qwen2 / qwen3)")),
            Model::Gemma3(_) => Err(no_mtp_head("gemma3")),
        }
    }

    /// The model's multi-token-prediction head, read from `src`.
    pub fn mtp_head(&self, src: &dyn WeightSource) -> Result<MtpHead> {
        match self {
            Model::Qwen35(m) => m.mtp_head(src),
            Model::Dense(_) => Err(no_mtp_head("dense (llama / qwen2 / qwen3)")),
            Model::Gemma3(_) => Err(no_mtp_head("gemma3")),
        }
    }

    /// What each layer's state is, as the family declares it.
    pub fn state_spec(&self) -> StateSpec {
        match self {
            Model::Qwen35(m) => m.state_spec(),
            Model::Dense(m) => m.state_spec(),
            Model::Gemma3(m) => m.state_spec(),
        }
    }

    /// Stores attention KV in `kv` (`--kv-cache-dtype`) in every state built from now on; an
    /// error when the model's head dimension does not fit the format, or the device cannot read
    /// its codes.
    pub fn set_kv_format(&mut self, kv: KvPolicy) -> Result<()> {
        // TurboQuant's inner-product keys have no device kernels (their sign sketch is read on
        // the CPU only); every other quantized format encodes and reads on the GPU.
        if matches!(kv.format, KvFormat::Turbo { key_inner_product: true, .. }) && !self.device().is_cpu() {
            return Err(ModelError::Invalid(format!(
                "--kv-cache-dtype {}: TurboQuant inner-product keys run on the CPU only; use turbo{{bits}} or turbo-k{{k}}v{{v}} on a GPU",
                kv.format
            )));
        }
        self.state_spec().with_kv(kv.clone())?;
        match self {
            Model::Qwen35(m) => m.set_kv_format(kv)?,
            Model::Dense(m) => m.set_kv_format(kv)?,
            Model::Gemma3(m) => m.set_kv_format(kv)?,
        }
        Ok(())
    }

    /// Stores recurrent (DeltaNet) state in `dtype` (`--mamba-ssm-cache-dtype`) in every state
    /// built from now on: f32, exact and the default, or bf16, half the bytes a row holds and a
    /// decode step reads and writes, computed in f32 and rounded after every token (once per
    /// prefill chunk where a prompt runs by chunks: see [`strata_kernels::gated_delta`]). Models
    /// without recurrent layers have nothing to store.
    pub fn set_ssm_cache_dtype(&mut self, dtype: DType) -> Result<()> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(ModelError::Invalid(format!("recurrent state is stored in f32 or bf16, not {dtype:?}")));
        }
        if let Model::Qwen35(m) = self {
            m.set_ssm_cache_dtype(dtype);
        }
        Ok(())
    }

    /// How attention KV is stored.
    pub fn kv_format(&self) -> KvPolicy {
        self.state_spec().kv
    }

    /// Fresh state for `rows` empty sequences.
    pub fn new_state(&self, rows: usize) -> Result<BatchState> {
        Ok(self.state_spec().new_state(rows, self.device())?)
    }

    /// What a sequence's state costs in memory, from the declared spec.
    pub fn state_cost(&self) -> StateCost {
        self.state_spec().cost()
    }

    /// Whether CUDA decode steps replay a captured graph (on by default; Qwen3.5 models).
    pub fn set_decode_graphs(&self, on: bool) {
        if let Model::Qwen35(m) = self {
            m.set_decode_graphs(on);
        }
    }

    /// Decode steps recorded as CUDA graphs and replayed from one so far (Qwen3.5 on CUDA; none
    /// elsewhere).
    pub fn decode_graph_stats(&self) -> GraphStats {
        match self {
            Model::Qwen35(m) => m.decode_graph_stats(),
            Model::Dense(_) | Model::Gemma3(_) => GraphStats::default(),
        }
    }

    pub fn device(&self) -> &Device {
        match self {
            Model::Qwen35(m) => m.device(),
            Model::Dense(m) => m.device(),
            Model::Gemma3(m) => m.device(),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Model::Qwen35(m) => m.dtype(),
            Model::Dense(m) => m.dtype(),
            Model::Gemma3(m) => m.dtype(),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Model::Qwen35(m) => m.config().vocab_size,
            Model::Dense(m) => m.config().vocab_size,
            Model::Gemma3(m) => m.config().vocab_size,
        }
    }

    /// A bound on the device memory a forward of `tokens` positions over `rows` rows (last
    /// logits only) takes beyond weights and state: the layers' activations at a few live copies
    /// of the widest (the MLP's, the DeltaNet projections' or the attention's per position) and
    /// each row's logits in bf16 and f32. Memory planning reserves it before sizing the state
    /// pool.
    pub fn activation_bytes(&self, tokens: usize, rows: usize) -> usize {
        let (hidden, intermediate, vocab) = match self {
            Model::Qwen35(m) => {
                let c = m.config();
                let widest = c.feed_forward.widest().max(c.linear_conv_dim()).max(2 * c.num_attention_heads * c.head_dim);
                (c.hidden_size, widest, c.vocab_size)
            }
            Model::Dense(m) => (m.config().hidden_size, m.config().intermediate_size, m.config().vocab_size),
            Model::Gemma3(m) => (m.config().hidden_size, m.config().intermediate_size, m.config().vocab_size),
        };
        let per_token = tokens.saturating_mul(16 * hidden + 8 * intermediate);
        per_token.saturating_add(rows.saturating_mul(3 * vocab)).saturating_mul(4)
    }

    pub fn max_position_embeddings(&self) -> usize {
        match self {
            Model::Qwen35(m) => m.config().max_position_embeddings,
            Model::Dense(m) => m.config().max_position_embeddings,
            Model::Gemma3(m) => m.config().max_position_embeddings,
        }
    }

    /// Opens a speculative round: forwards until [`Model::close_round`] can be taken back.
    pub fn open_round(&self, state: &mut BatchState) -> Result<Round> {
        match self {
            Model::Qwen35(m) => m.open_round(state),
            Model::Dense(_) | Model::Gemma3(_) => Ok(Round { start: state.positions.clone() }),
        }
    }

    /// Closes `round` keeping the first `keep[r]` positions each row was fed since it opened;
    /// every row's state is then that of a forward over only its kept tokens (an all-KV state
    /// just trims).
    pub fn close_round(&self, state: &mut BatchState, round: Round, keep: &[usize]) -> Result<()> {
        match self {
            Model::Qwen35(m) => m.close_round(state, round, keep),
            Model::Dense(_) | Model::Gemma3(_) => {
                for (r, (&start, &kept)) in round.start.iter().zip(keep).enumerate() {
                    if start + kept > state.positions[r] {
                        return Err(ModelError::Invalid(format!("cannot keep {kept} positions of row {r}")));
                    }
                    state.trim(r, start + kept)?;
                }
                Ok(())
            }
        }
    }
}

/// The error for asking a model of `family` for what only Qwen3.5's multi-token-prediction head has.
fn no_mtp_head(family: &str) -> ModelError {
    ModelError::Invalid(format!("a multi-token-prediction head needs a Qwen3.5 model; this one is {family}"))
}
