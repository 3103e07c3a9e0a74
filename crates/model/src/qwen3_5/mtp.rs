//! Qwen3.5's multi-token-prediction head (`mtp.*`, config `mtp_num_hidden_layers`): a draft
//! source that ships with the model. For position `i`, given the target's final normed hidden
//! state `h_i` and the next token `x_{i+1}`, it predicts `x_{i+2}`:
//!
//! ```text
//! y_i = norm(layer(fc([norm_e(embed(x_{i+1})) ; norm_h(h_i)])))     logits = lm_head(y_i)
//! ```
//!
//! `layer` is one full-attention Qwen3.5 decoder layer with its own KV history; `embed` and
//! `lm_head` are the target's. A further draft step feeds the head's own `y` where `h` would be
//! (the public definition as vLLM and SGLang serve it; transformers does not run the head).
//!
//! Drafting may read a reduced vocabulary ([`MtpHead::restrict_drafts`]): the output head is
//! the largest matrix a draft step reads (Qwen3.5's 248K rows), and a draft only has to be the
//! likely token, not every token's score (FR-Spec's observation). Verification still scores the
//! whole vocabulary, so output is unchanged; only which tokens get drafted is.

use candle_core::{DType, Device, Tensor};
use strata_kernels::sampling::argmax_rows;
use strata_state::{BatchState, KvPolicy, KvShape, LayerSpec, StateSpec};

use super::layers::{Linear, Matrix, Residual, RmsNorm, Rotary};
use super::{DecoderLayer, Qwen35, Round};
use crate::config::LayerKind;
use crate::error::{ModelError, Result};
use crate::parallel::Parallel;
use crate::source::WeightSource;

pub struct MtpHead {
    embed: Matrix,
    lm_head: Linear,
    /// The output head's rows for a reduced draft vocabulary, and those tokens.
    drafts_among: Option<(Linear, Vec<u32>)>,
    /// The target's split over devices, which the head's layer, embedding and output head share.
    parallel: Parallel,
    embed_norm: RmsNorm,
    hidden_norm: RmsNorm,
    fc: Linear,
    layer: DecoderLayer,
    norm: RmsNorm,
    rotary: Rotary,
    hidden: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

impl MtpHead {
    /// Loads `mtp.*` from `src` for `target`, whose embedding and output head it shares.
    pub(super) fn load(target: &Qwen35, src: &dyn WeightSource) -> Result<Self> {
        let cfg = &target.cfg;
        match cfg.mtp_num_hidden_layers {
            0 => {
                return Err(ModelError::Invalid(
                    "the model has no multi-token-prediction head (mtp_num_hidden_layers is 0)".into(),
                ))
            }
            1 => {}
            n => {
                return Err(ModelError::Invalid(format!(
                    "multi-token-prediction heads of {n} layers are not supported (Qwen3.5 releases have 1)"
                )))
            }
        }
        let (hidden, eps, dtype, local) = (cfg.hidden_size, cfg.rms_norm_eps, target.dtype, &target.local);
        Ok(Self {
            embed: target.embed.clone(),
            lm_head: target.lm_head.clone(),
            drafts_among: None,
            parallel: target.parallel.clone(),
            embed_norm: RmsNorm::load(src, "mtp.pre_fc_norm_embedding", hidden, eps)?,
            hidden_norm: RmsNorm::load(src, "mtp.pre_fc_norm_hidden", hidden, eps)?,
            fc: Linear::load(src, "mtp.fc", hidden, 2 * hidden, false, dtype)?,
            layer: DecoderLayer::load(src, "mtp.layers.0", LayerKind::Full, local, dtype, target.parallel.clone())?,
            norm: RmsNorm::load(src, "mtp.norm", hidden, eps)?,
            rotary: Rotary::new(cfg.rotary_dim(), cfg.rope_theta),
            hidden,
            kv_heads: local.num_key_value_heads,
            head_dim: cfg.head_dim,
            dtype,
            device: target.device.clone(),
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Fresh (empty) KV history for `rows` sequences.
    pub fn new_state(&self, rows: usize) -> Result<BatchState> {
        let kv = KvShape { kv_heads: self.kv_heads, head_dim: self.head_dim };
        // The draft head's own KV stays unquantized: it only proposes, the target verifies.
        let spec = StateSpec { layers: vec![LayerSpec::Attention(kv)], dtype: self.dtype, kv: KvPolicy::default() };
        Ok(spec.new_state(rows, &self.device)?)
    }

    /// Runs the head over `tokens` `[B, T]` (each position's next token) and `hidden`
    /// `[B, T, hidden]` (the target's final normed hidden states, or the head's own output for a
    /// further draft step), each row continuing its history in `state`. Returns `y`
    /// `[B, T, hidden]`; [`MtpHead::logits`] turns rows of it into draft logits.
    pub fn forward(&self, tokens: &Tensor, hidden: &Tensor, state: &mut BatchState) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        if b != state.rows() || hidden.dims() != [b, t, self.hidden] {
            return Err(ModelError::Invalid(format!(
                "MTP head got tokens {:?} and hidden states {:?} for {} rows of width {}",
                tokens.dims(),
                hidden.dims(),
                state.rows(),
                self.hidden
            )));
        }
        let rows = self.parallel.embed(&tokens.flatten_all()?, |ids| self.embed.rows_at(ids, self.dtype))?;
        let embedded = rows.reshape((b, t, self.hidden))?;
        let joined =
            Tensor::cat(&[self.embed_norm.forward(&embedded)?, self.hidden_norm.forward(&hidden.to_dtype(self.dtype)?)?], 2)?;
        let x = self.fc.forward(&joined)?;
        let rope = self.rotary.tables(&state.positions, t, &self.device)?;
        let x = self.layer.forward(&Residual::new(x), &mut state.layers[0], &rope)?;
        for p in &mut state.positions {
            *p += t;
        }
        Ok(self.norm.forward_stream(&x)?.1)
    }

    /// f32 logits for `y` `[.., hidden]`, over the whole vocabulary.
    pub fn logits(&self, y: &Tensor) -> Result<Tensor> {
        Ok(self.parallel.gather_vocab(self.lm_head.forward(y)?)?.to_dtype(DType::F32)?)
    }

    /// Drafts only among `tokens` (ids below the vocabulary size, each once): their rows of the
    /// output head are copied out once, in the head's own form (blocks stay blocks, so each
    /// token's score is the whole head's bits for it), and a draft step reads those instead of
    /// the whole head. The whole vocabulary is no restriction.
    pub fn restrict_drafts(&mut self, tokens: Vec<u32>) -> Result<()> {
        if self.parallel.get().is_some() {
            return Err(ModelError::Invalid("a draft vocabulary is not taken by a model split over devices yet".into()));
        }
        let vocab = self.lm_head.weight().rows()?;
        let mut seen = vec![false; vocab];
        for &t in &tokens {
            match seen.get_mut(t as usize) {
                None => return Err(ModelError::Invalid(format!("draft vocabulary: token {t} is past the vocabulary ({vocab})"))),
                Some(true) => return Err(ModelError::Invalid(format!("draft vocabulary: token {t} is listed twice"))),
                Some(s) => *s = true,
            }
        }
        if tokens.is_empty() {
            return Err(ModelError::Invalid("draft vocabulary: no tokens".into()));
        }
        self.drafts_among = match tokens.len() == vocab {
            true => None,
            false => Some((Linear::from_weight(self.lm_head.weight().select_rows(&tokens)?), tokens)),
        };
        Ok(())
    }

    /// The tokens a draft step reads scores for: the restricted vocabulary's size, or all.
    pub fn draft_vocab_size(&self) -> Result<usize> {
        match (&self.drafts_among, self.parallel.get()) {
            (Some((_, tokens)), _) => Ok(tokens.len()),
            (None, Some(p)) => Ok(p.group.size() * self.lm_head.weight().rows()?),
            (None, None) => self.lm_head.weight().rows(),
        }
    }

    /// Each row's draft for `y` `[R, 1, hidden]`: its most likely token (the first among
    /// equals), among the draft vocabulary where one is set.
    pub fn draft(&self, y: &Tensor) -> Result<Vec<u32>> {
        let rows = y.dim(0)?;
        let Some((head, tokens)) = &self.drafts_among else {
            return Ok(argmax_rows(&self.logits(y)?.reshape((rows, ()))?, &[])?);
        };
        let logits = head.forward(y)?.to_dtype(DType::F32)?.reshape((rows, ()))?;
        Ok(argmax_rows(&logits, &[])?.into_iter().map(|i| tokens[i as usize]).collect())
    }

    /// Opens a round: positions fed from here on can be dropped by [`MtpHead::close_round`].
    pub fn open_round(&self, state: &BatchState) -> Round {
        Round { start: state.positions.clone() }
    }

    /// Keeps the first `keep[r]` positions row `r` was fed since `round` opened.
    pub fn close_round(&self, state: &mut BatchState, round: Round, keep: &[usize]) -> Result<()> {
        for (r, (&start, &kept)) in round.start.iter().zip(keep).enumerate() {
            state.trim(r, start + kept)?;
        }
        Ok(())
    }
}
