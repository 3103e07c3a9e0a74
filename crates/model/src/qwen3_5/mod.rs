//! The Qwen3.5 text model (transformers `qwen3_5` and `qwen3_5_moe`): decoder layers that are
//! either Gated DeltaNet or gated full attention, each followed by a SwiGLU MLP or a mixture of
//! SwiGLU experts, with zero-centred RMSNorms.

mod attention;
mod deltanet;
mod experts;
#[cfg(feature = "cuda")]
mod graph;
pub mod layers;
mod mtp;
pub mod vision;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use strata_state::{BatchState, KvPolicy, KvShape, LayerSpec, LayerState, RecurrentShape, StateSpec};

use self::attention::Attention;
use self::deltanet::GatedDeltaNet;
use self::experts::Experts;
use self::layers::{Linear, Matrix, Mlp, Residual, RmsNorm, Rotary};
pub use self::mtp::MtpHead;
pub use self::vision::{expand_image_tokens, image_cache_key, mrope_positions, ImagePrompt, VisionConfig, VisionTower};
use crate::config::{FeedForward, LayerKind, Qwen35Config};
use crate::error::{ModelError, Result};
use crate::parallel::{Collective, Parallel, ShardedSource, TensorParallel};
use crate::smoothing::ChannelNorm;
use crate::source::WeightSource;

enum Mixer {
    Linear(GatedDeltaNet),
    Full(Attention),
}

/// The block after a layer's mixer (`{layer}.mlp`).
enum Mlps {
    Dense(Mlp),
    Experts(Box<Experts>),
}

impl Mlps {
    fn load(src: &dyn WeightSource, prefix: &str, cfg: &Qwen35Config, dtype: DType) -> Result<Self> {
        Ok(match &cfg.feed_forward {
            FeedForward::Dense { intermediate_size } => {
                Mlps::Dense(Mlp::load(src, prefix, cfg.hidden_size, *intermediate_size, dtype)?)
            }
            FeedForward::Experts(e) => Mlps::Experts(Box::new(Experts::load(src, prefix, cfg.hidden_size, e, dtype)?)),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Mlps::Dense(m) => m.forward(x),
            Mlps::Experts(m) => m.forward(x),
        }
    }

    /// Whether a decode step of `rows` rows passes through it on the GPU alone (what a CUDA
    /// graph records).
    #[cfg(feature = "cuda")]
    fn stays_on_device(&self, rows: usize) -> bool {
        match self {
            Mlps::Dense(_) => true,
            Mlps::Experts(m) => m.routes_on_device(rows),
        }
    }
}

struct DecoderLayer {
    input_norm: RmsNorm,
    mixer: Mixer,
    post_norm: RmsNorm,
    mlp: Mlps,
    /// Sums the shares of the mixer's and the MLP's outputs where the model is split over
    /// devices (see [`crate::parallel`]).
    parallel: Parallel,
}

impl DecoderLayer {
    fn load(
        src: &dyn WeightSource,
        prefix: &str,
        kind: LayerKind,
        cfg: &Qwen35Config,
        dtype: DType,
        parallel: Parallel,
    ) -> Result<Self> {
        let (hidden, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(Self {
            parallel,
            input_norm: RmsNorm::load(src, &format!("{prefix}.input_layernorm"), hidden, eps)?,
            mixer: match kind {
                LayerKind::Linear => Mixer::Linear(GatedDeltaNet::load(src, &format!("{prefix}.linear_attn"), cfg, dtype)?),
                LayerKind::Full => Mixer::Full(Attention::load(src, &format!("{prefix}.self_attn"), cfg, dtype)?),
            },
            post_norm: RmsNorm::load(src, &format!("{prefix}.post_attention_layernorm"), hidden, eps)?,
            mlp: Mlps::load(src, &format!("{prefix}.mlp"), cfg, dtype)?,
        })
    }

    /// The layer on the stream `x` (`[B, T, hidden]`), reading its state and replacing it with
    /// the next.
    fn forward(&self, x: &Residual, state: &mut LayerState, rope: &(Tensor, Tensor)) -> Result<Residual> {
        self.forward_with(x, |mixer, h| match (mixer, state) {
            (Mixer::Linear(m), LayerState::Recurrent(s)) => m.forward(h, s),
            (Mixer::Full(m), LayerState::Attention(s)) => m.forward(h, s, rope),
            (_, s) => Err(mismatched(s)),
        })
    }

    /// `x + mixer(norm(x))`, then `+ mlp(norm(.))` left pending for the next norm, where `mix`
    /// runs the mixer (with whatever state it reaches) on the normed input.
    fn forward_with(&self, x: &Residual, mix: impl FnOnce(&Mixer, &Tensor) -> Result<Tensor>) -> Result<Residual> {
        self.forward_split(x, &Segments::Whole, mix)
    }

    /// [`DecoderLayer::forward_with`] over a stream of several segments' positions: the MLP's
    /// matmuls take them as `segments` says.
    fn forward_split(
        &self,
        x: &Residual,
        segments: &Segments,
        mix: impl FnOnce(&Mixer, &Tensor) -> Result<Tensor>,
    ) -> Result<Residual> {
        let (x, normed) = self.input_norm.forward_stream(x)?;
        let h = self.parallel.sum(mix(&self.mixer, &normed)?)?;
        let (x, h) = self.post_norm.forward_residual(&x, &h)?;
        Ok(Residual::pending(x, segments.positionwise(&h, |h| self.parallel.sum(self.mlp.forward(h)?))?))
    }
}

/// How the positions of a forward's stream group for position-wise matmuls.
enum Segments {
    /// One rectangle of rows, as the stream's shape says.
    Whole,
    /// `[N, hidden]` holding several segments' positions in turn, each `(rows, positions)`.
    Split(Vec<(usize, usize)>),
}

impl Segments {
    /// `f` of the stream `x`. On CPU each segment of a split stream goes through `f` alone, as
    /// `[rows, positions, hidden]`, so its matmuls take the kernels (and the bits) it gets in
    /// a forward of its own — a decode row stays in the batch-invariant kernel beside a prompt's
    /// chunk; elsewhere every position shares one pass over the weights.
    fn positionwise(&self, x: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        match self {
            Segments::Split(shapes) if x.device().is_cpu() && shapes.len() > 1 => {
                let mut at = 0;
                let parts = shapes
                    .iter()
                    .map(|&(rows, positions)| {
                        let n = rows * positions;
                        let part = x.narrow(0, at, n)?.reshape((rows, positions, x.dim(1)?))?;
                        at += n;
                        let y = f(&part)?;
                        Ok(y.reshape((n, y.dim(2)?))?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&parts, 0)?)
            }
            Segments::Split(_) | Segments::Whole => f(x),
        }
    }
}

/// Rows fed together in one forward (see [`Qwen35::forward_segments`]): `tokens` `[B, T]`
/// (u32) continuing the `B` rows of `state`, and which positions' logits to return. A segment
/// with `images` is one row whose image tokens take the images' merged tokens and whose
/// positions take explicit rotary positions (see [`Qwen35::forward_images`]).
pub struct Segment<'a> {
    pub tokens: &'a Tensor,
    pub state: &'a mut BatchState,
    pub logits: Logits,
    pub images: Option<&'a ImageInputs>,
}

/// What a forward gives a [`Segment`]: f32 logits (`[B, vocab]` or `[B, T, vocab]`, as it
/// asked), and every position's final normed hidden state `[B, T, hidden]` where asked for.
pub struct SegmentOutput {
    pub logits: Tensor,
    pub hidden: Option<Tensor>,
}

/// Moves `state`'s rows `t` positions on; tokens fed after explicit (image) positions continue
/// past the largest of them.
fn advance(state: &mut BatchState, t: usize, images: Option<&ImageInputs>) {
    for p in &mut state.positions {
        *p += t;
    }
    if let Some(next) = images.and_then(|i| i.positions.iter().flatten().max()).map(|&p| p as i64 + 1) {
        state.rope_offsets[0] = next - state.positions[0] as i64;
    }
}

fn mismatched(state: &LayerState) -> ModelError {
    ModelError::Invalid(format!("layer state of kind {} does not match its layer", state.kind()))
}

/// A weight source that notes whether any matrix it hands out is kept block-quantized.
#[cfg(feature = "cuda")]
struct PlainWatch<'a> {
    src: &'a dyn WeightSource,
    plain: std::cell::Cell<bool>,
}

#[cfg(feature = "cuda")]
impl WeightSource for PlainWatch<'_> {
    fn get(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        self.src.get(name, shape, dtype)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize, dtype: DType) -> Result<Matrix> {
        let m = self.src.matrix(name, rows, cols, dtype)?;
        self.plain.set(self.plain.get() && matches!(m, Matrix::Dense(_)));
        Ok(m)
    }

    fn device(&self) -> &Device {
        self.src.device()
    }

    fn contains(&self, name: &str) -> bool {
        self.src.contains(name)
    }
}

/// An open speculative round: each row's position when it opened.
#[derive(Debug)]
pub struct Round {
    pub(crate) start: Vec<usize>,
}

/// Images in a forward (one row): their merged tokens replace the embeddings of the image
/// tokens, in order, and every position takes an explicit (temporal, height, width) rotary
/// position (see [`ImagePrompt`]).
pub struct ImageInputs {
    /// Merged image tokens `[tokens, hidden]` ([`VisionTower::forward`]) for the image tokens
    /// fed, in order (none when the positions fed hold no image token).
    pub embeds: Option<Tensor>,
    /// One per position fed.
    pub positions: Vec<[usize; 3]>,
}

/// Which positions' logits a forward returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Every position: `[B, T, vocab]`.
    All,
    /// The last position of each row: `[B, vocab]`.
    Last,
}

pub struct Qwen35 {
    cfg: Qwen35Config,
    /// The shapes this model's layers hold: `cfg`'s, or a tensor-parallel rank's share of them.
    local: Qwen35Config,
    parallel: Parallel,
    embed: Matrix,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: Rotary,
    dtype: DType,
    /// How attention KV is stored (`--kv-cache-dtype`).
    kv: KvPolicy,
    /// What DeltaNet layers store their recurrent matrices in (`--mamba-ssm-cache-dtype`).
    ssm_dtype: DType,
    device: Device,
    /// The vision tower, when the model takes images ([`Qwen35::set_vision`]).
    vision: Option<VisionTower>,
    /// Whether every weight matrix is a plain tensor (none kept block-quantized).
    #[cfg(feature = "cuda")]
    plain_weights: bool,
    /// The captured decode step (CUDA).
    #[cfg(feature = "cuda")]
    graphs: graph::DecodeGraphs,
}

impl Qwen35 {
    /// Builds the model from `src`, whose names are relative to the text model
    /// (`embed_tokens.weight`, `layers.N.…`, `norm.weight`), plus `lm_head.weight` when untied.
    pub fn load(cfg: &Qwen35Config, src: &dyn WeightSource, dtype: DType) -> Result<Self> {
        Self::load_share(cfg, cfg, src, dtype, Parallel::default())
    }

    /// This rank's share of the model split over `group` (see [`crate::parallel`]): `src`
    /// holds the whole model's tensors, of which it loads the rank's slices. Every rank of the
    /// group runs each forward together, on its own state; each returns every logit.
    pub fn load_sharded(cfg: &Qwen35Config, src: &dyn WeightSource, dtype: DType, group: Arc<dyn Collective>) -> Result<Self> {
        let parallel = Arc::new(TensorParallel::new(cfg.split_dims(), group)?);
        let src = ShardedSource { inner: src, parallel: &parallel };
        Self::load_share(cfg, &cfg.share(&parallel), &src, dtype, Parallel::new(parallel.clone()))
    }

    /// Loads layers of `local`'s shapes from `src`, as a model of `cfg`.
    fn load_share(
        cfg: &Qwen35Config,
        local: &Qwen35Config,
        src: &dyn WeightSource,
        dtype: DType,
        parallel: Parallel,
    ) -> Result<Self> {
        #[cfg(feature = "cuda")]
        let src = &PlainWatch { src, plain: std::cell::Cell::new(true) };
        let (hidden, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let embed = src.matrix("embed_tokens.weight", local.vocab_size, hidden, dtype)?;
        let layers = local
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, &kind)| DecoderLayer::load(src, &format!("layers.{i}"), kind, local, dtype, parallel.clone()))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::from_weight(embed.clone())
        } else {
            Linear::load(src, "lm_head", local.vocab_size, hidden, false, dtype)?
        };
        Ok(Self {
            cfg: cfg.clone(),
            local: local.clone(),
            parallel,
            embed,
            layers,
            norm: RmsNorm::load(src, "norm", hidden, eps)?,
            lm_head,
            rotary: Rotary::new(cfg.rotary_dim(), cfg.rope_theta),
            dtype,
            kv: KvPolicy::default(),
            ssm_dtype: DType::F32,
            device: src.device().clone(),
            vision: None,
            #[cfg(feature = "cuda")]
            plain_weights: src.plain.get(),
            #[cfg(feature = "cuda")]
            graphs: graph::DecodeGraphs::default(),
        })
    }

    pub fn config(&self) -> &Qwen35Config {
        &self.cfg
    }

    /// Lets the model take images through `tower` (its merged tokens must be the text width).
    pub fn set_vision(&mut self, tower: VisionTower) -> Result<()> {
        if tower.config().out_hidden_size != self.cfg.hidden_size {
            return Err(ModelError::Invalid(format!(
                "a vision tower of width {} for a text model of width {}",
                tower.config().out_hidden_size,
                self.cfg.hidden_size
            )));
        }
        self.vision = Some(tower);
        Ok(())
    }

    pub fn vision(&self) -> Option<&VisionTower> {
        self.vision.as_ref()
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether CUDA decode steps replay a captured graph (the default); off, every step runs
    /// eagerly, launch by launch. Elsewhere there is nothing to switch.
    pub fn set_decode_graphs(&self, on: bool) {
        #[cfg(feature = "cuda")]
        self.graphs.enabled.store(on, std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(feature = "cuda"))]
        let _ = on;
    }

    /// Whether `segment` is a decode step a recorded CUDA graph may run (see the graphs'
    /// conditions; besides them no hidden states, no images, the model whole). Beside prompts'
    /// chunks such a step runs on its own: on a GPU, launched eagerly inside their forward it
    /// cost more in launches than sharing their weights' reads saved (an H100, 64 rows beside a
    /// 1,024-token chunk: a 33.7 ms forward, where a replayed 64-row step took 9.1 ms of GPU
    /// time; docs/benchmarks.md). Where no graph can run it (quantized weights), the shared
    /// forward stays.
    pub fn replays_decode(&self, segment: &Segment<'_>, hidden: bool) -> bool {
        #[cfg(feature = "cuda")]
        {
            !hidden
                && segment.images.is_none()
                && self.parallel.get().is_none()
                && self.graphs.apply(self, segment.tokens, segment.state, segment.logits)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (segment, hidden);
            false
        }
    }

    /// Decode steps recorded as CUDA graphs and replayed so far, and where replayed steps' time
    /// went.
    pub fn decode_graph_stats(&self) -> crate::GraphStats {
        #[cfg(feature = "cuda")]
        {
            let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
            crate::GraphStats {
                recordings: self.graphs.recordings.load(std::sync::atomic::Ordering::Relaxed),
                replays: self.graphs.replays.load(std::sync::atomic::Ordering::Relaxed),
                prepare_ns: load(&self.graphs.prepare_ns),
                replay_gpu_ns: load(&self.graphs.replay_gpu_ns),
            }
        }
        #[cfg(not(feature = "cuda"))]
        crate::GraphStats::default()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Stores attention KV in `kv` in states built from now on (see [`crate::Model::set_kv_format`]),
    /// with the keys of layers whose KV is quantized smoothed ([`crate::smoothing`]).
    pub fn set_kv_format(&mut self, kv: KvPolicy) -> Result<()> {
        let attention_layers = self.layers.iter().filter(|l| matches!(l.mixer, Mixer::Full(_))).count();
        let rotary_half = self.cfg.rotary_dim() / 2;
        let mut index = 0;
        for layer in &mut self.layers {
            if let Mixer::Full(attention) = &mut layer.mixer {
                let quantized = kv.format_at(index, attention_layers)?.is_quantized();
                attention.smooth_keys(quantized, layer.input_norm.scale(), rotary_half)?;
                index += 1;
            }
        }
        self.kv = kv;
        Ok(())
    }

    /// Stores DeltaNet layers' recurrent matrices in `dtype` (f32 or bf16) in states built from
    /// now on (see [`crate::Model::set_ssm_cache_dtype`]).
    pub fn set_ssm_cache_dtype(&mut self, dtype: DType) {
        self.ssm_dtype = dtype;
    }

    /// What each layer's state is: KV for full attention, a conv window and recurrent matrix
    /// for Gated DeltaNet.
    pub fn state_spec(&self) -> StateSpec {
        let cfg = &self.local;
        let kv = KvShape { kv_heads: cfg.num_key_value_heads, head_dim: cfg.head_dim };
        let layers = cfg
            .layer_types
            .iter()
            .map(|kind| match kind {
                LayerKind::Linear => {
                    LayerSpec::Recurrent(RecurrentShape { ssm_dtype: self.ssm_dtype, ..GatedDeltaNet::state_shape(cfg) })
                }
                LayerKind::Full => LayerSpec::Attention(kv),
            })
            .collect();
        StateSpec { layers, dtype: self.dtype, kv: self.kv.clone() }
    }

    /// Opens a speculative round on `state`: forwards until [`Qwen35::close_round`] can be
    /// taken back, per row. Opening is cheap: the round keeps references (state tensors are only
    /// written in place by a recorded CUDA decode step, which does not run while a round is open).
    pub fn open_round(&self, state: &mut BatchState) -> Result<Round> {
        for layer in &mut state.layers {
            if let LayerState::Recurrent(s) = layer {
                GatedDeltaNet::open_round(s)?;
            }
        }
        Ok(Round { start: state.positions.clone() })
    }

    /// Closes `round`, keeping the first `keep[r]` positions row `r` was fed since it opened
    /// and dropping the rest: attention KV is trimmed; DeltaNet layers fold the kept positions
    /// into the state from before the round with the recurrence the forward used, so every
    /// row's state equals, bit for bit, the state of a forward over only its kept tokens.
    pub fn close_round(&self, state: &mut BatchState, round: Round, keep: &[usize]) -> Result<()> {
        let fed: Vec<usize> = state.positions.iter().zip(&round.start).map(|(now, start)| now - start).collect();
        if keep.len() != fed.len() || keep.iter().zip(&fed).any(|(k, f)| k > f) {
            return Err(ModelError::Invalid(format!("cannot keep {keep:?} positions of rows fed {fed:?}")));
        }
        for (layer, layer_state) in self.layers.iter().zip(state.layers.iter_mut()) {
            match (&layer.mixer, layer_state) {
                (Mixer::Linear(m), LayerState::Recurrent(s)) => m.close_round(s, &fed, keep)?,
                (Mixer::Full(_), LayerState::Attention(kv)) => {
                    for (r, (&start, &kept)) in round.start.iter().zip(keep).enumerate() {
                        kv.trim(r, start + kept)?;
                    }
                }
                (_, s) => return Err(mismatched(s)),
            }
        }
        for (p, (&start, &kept)) in state.positions.iter_mut().zip(round.start.iter().zip(keep)) {
            *p = start + kept;
        }
        Ok(())
    }

    /// Runs `tokens` (`[B, T]`, u32) through the model, each row continuing from its own
    /// position in `state`, and advances the state. Returns f32 logits. On CUDA, a decode step
    /// (one token per row, last logits) replays a captured graph where one fits the batch.
    pub fn forward(&self, tokens: &Tensor, state: &mut BatchState, logits: Logits) -> Result<Tensor> {
        // A split model runs eagerly: its steps' collectives are not in the recorded graphs.
        #[cfg(feature = "cuda")]
        if self.parallel.get().is_none() {
            if let Some(logits) = self.graphs.decode(self, tokens, state, logits)? {
                return Ok(logits);
            }
        }
        self.finish(self.decode_layers(tokens, state, None)?, logits)
    }

    /// [`Qwen35::forward`] of one row whose tokens hold images (or follow them: decode steps
    /// after an image prompt give their positions, the prompt's offset added), always eager.
    pub fn forward_images(
        &self,
        tokens: &Tensor,
        images: &ImageInputs,
        state: &mut BatchState,
        logits: Logits,
    ) -> Result<Tensor> {
        self.finish(self.decode_layers(tokens, state, Some(images))?, logits)
    }

    /// The output head over the stream `x` `[B, T, hidden]`: f32 logits.
    fn finish(&self, x: Residual, logits: Logits) -> Result<Tensor> {
        let x = match logits {
            Logits::All => x,
            Logits::Last => x.map(|t| t.narrow(1, t.dim(1)? - 1, 1)?.squeeze(1))?,
        };
        let (_, normed) = self.norm.forward_stream(&x)?;
        self.head(&normed)
    }

    /// f32 logits of final normed hidden states; a split model gathers its ranks' vocabulary rows.
    fn head(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.parallel.gather_vocab(self.lm_head.forward(x)?)?.to_dtype(DType::F32)?)
    }

    /// [`Qwen35::forward`], also returning every position's final normed hidden state
    /// `[B, T, hidden]` (what the multi-token-prediction head reads). The logits are the same.
    pub fn forward_with_hidden(&self, tokens: &Tensor, state: &mut BatchState, logits: Logits) -> Result<(Tensor, Tensor)> {
        let (_, hidden) = self.norm.forward_stream(&self.decode_layers(tokens, state, None)?)?;
        let x = match logits {
            Logits::All => hidden.clone(),
            Logits::Last => hidden.narrow(1, hidden.dim(1)? - 1, 1)?.squeeze(1)?,
        };
        Ok((self.head(&x)?, hidden))
    }

    /// One forward over several segments — rows of different lengths, each group of rows
    /// continuing its own state: a decode batch beside prompts' prefill chunks, or prompts whose
    /// chunks differ in length. Position-wise work (embedding, norms, projections, MLP, output
    /// head) runs over every segment's positions at once; attention and DeltaNet layers run per
    /// segment on its own state. Each segment's results are what a forward of it alone gives:
    /// bit for bit on CPU (see [`Segments::positionwise`]), within the matmuls' rounding on
    /// CUDA. With `hidden`, also every position's final normed hidden state (for an MTP head),
    /// except a segment with images'. Always eager: [`crate::Model::forward_segments`] gives a
    /// single segment to the plain forward, which may replay a CUDA graph.
    pub fn forward_segments(&self, segments: &mut [Segment<'_>], hidden: bool) -> Result<Vec<SegmentOutput>> {
        let mut shapes = Vec::with_capacity(segments.len());
        let mut embedded = Vec::with_capacity(segments.len());
        let mut ropes = Vec::with_capacity(segments.len());
        for s in segments.iter() {
            let (b, t) = s.tokens.dims2()?;
            if b != s.state.rows() {
                return Err(ModelError::Invalid(format!(
                    "a segment of {b} rows of tokens for a state of {} rows",
                    s.state.rows()
                )));
            }
            shapes.push((b, t));
            let (x, rope) = self.embed_segment(s.tokens, s.state, s.images)?;
            embedded.push(x.reshape((b * t, self.cfg.hidden_size))?);
            ropes.push(rope);
        }
        let mut x = Residual::new(Tensor::cat(&embedded, 0)?);
        let split = Segments::Split(shapes.clone());
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward_split(&x, &split, |mixer, normed| {
                let mut at = 0;
                let outputs = segments
                    .iter_mut()
                    .zip(&shapes)
                    .zip(&ropes)
                    .map(|((s, &(b, t)), rope)| {
                        let h = normed.narrow(0, at, b * t)?.reshape((b, t, normed.dim(1)?))?;
                        at += b * t;
                        let out = match (mixer, &mut s.state.layers[i]) {
                            (Mixer::Linear(m), LayerState::Recurrent(state)) => m.forward(&h, state)?,
                            (Mixer::Full(m), LayerState::Attention(kv)) => m.forward(&h, kv, rope)?,
                            (_, state) => return Err(mismatched(state)),
                        };
                        Ok(out.reshape((b * t, out.dim(2)?))?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&outputs, 0)?)
            })?;
        }
        for (s, &(_, t)) in segments.iter_mut().zip(&shapes) {
            advance(s.state, t, s.images);
        }
        let (_, normed) = self.norm.forward_stream(&x)?;
        // The positions whose logits are asked for, segment by segment.
        let (mut picked, mut picked_shapes, mut at) = (Vec::new(), Vec::new(), 0u32);
        for (s, &(b, t)) in segments.iter().zip(&shapes) {
            let (b32, t32) = (b as u32, t as u32);
            match s.logits {
                Logits::All => {
                    picked.extend(at..at + b32 * t32);
                    picked_shapes.push((b, t));
                }
                Logits::Last => {
                    picked.extend((1..=b32).map(|r| at + r * t32 - 1));
                    picked_shapes.push((b, 1));
                }
            }
            at += b32 * t32;
        }
        let rows = normed.index_select(&Tensor::new(picked, &self.device)?, 0)?;
        let logits = Segments::Split(picked_shapes.clone()).positionwise(&rows, |x| self.head(x))?;
        let (mut at, mut hidden_at) = (0, 0);
        let vocab = logits.dim(1)?;
        segments
            .iter()
            .zip(shapes.iter().zip(&picked_shapes))
            .map(|(s, (&(b, t), &(_, picked)))| {
                let rows = logits.narrow(0, at, b * picked)?;
                at += b * picked;
                let logits = match s.logits {
                    Logits::All => rows.reshape((b, t, vocab))?,
                    Logits::Last => rows,
                };
                let hidden = (hidden && s.images.is_none())
                    .then(|| normed.narrow(0, hidden_at, b * t)?.reshape((b, t, normed.dim(1)?)))
                    .transpose()?;
                hidden_at += b * t;
                Ok(SegmentOutput { logits, hidden })
            })
            .collect()
    }

    /// The multi-token-prediction head shipped beside the model (`mtp.*` in `src`), sharing
    /// its embedding and output head; on a split model, this rank's share of it (its layer split
    /// as the model's are, from `src`'s whole tensors).
    pub fn mtp_head(&self, src: &dyn WeightSource) -> Result<MtpHead> {
        match self.parallel.get() {
            Some(parallel) => MtpHead::load(self, &ShardedSource { inner: src, parallel }),
            None => MtpHead::load(self, src),
        }
    }

    /// Embedding and decoder layers: the stream of pre-norm hidden states `[B, T, hidden]`.
    fn decode_layers(&self, tokens: &Tensor, state: &mut BatchState, images: Option<&ImageInputs>) -> Result<Residual> {
        let (b, t) = tokens.dims2()?;
        if b != state.rows() {
            return Err(ModelError::Invalid(format!("forward got {b} rows of tokens for a state of {} rows", state.rows())));
        }
        let (embedded, rope) = self.embed_segment(tokens, state, images)?;
        let mut x = Residual::new(embedded);
        for (layer, layer_state) in self.layers.iter().zip(state.layers.iter_mut()) {
            x = layer.forward(&x, layer_state, &rope)?;
        }
        advance(state, t, images);
        Ok(x)
    }

    /// `tokens`' embeddings `[B, T, hidden]` (each image token's replaced by the images' next
    /// merged token) and their rotary tables: from each row's position in `state`, or the
    /// images' explicit positions.
    fn embed_segment(
        &self,
        tokens: &Tensor,
        state: &BatchState,
        images: Option<&ImageInputs>,
    ) -> Result<(Tensor, (Tensor, Tensor))> {
        let (b, t) = tokens.dims2()?;
        Ok(match images {
            None => (self.embed_tokens(tokens)?, self.rotary.tables(&state.rope_starts(), t, &self.device)?),
            Some(images) => {
                if b != 1 || images.positions.len() != t {
                    return Err(ModelError::Invalid(format!(
                        "a forward with images takes one row and a position per token, not {b} rows of {t} and {} positions",
                        images.positions.len()
                    )));
                }
                let rope = self.rotary.tables_at(&images.positions, 1, self.cfg.mrope_section, &self.device)?;
                (self.embed_with_images(tokens, images.embeds.as_ref())?, rope)
            }
        })
    }

    /// `[B, T]` token ids as `[B, T, hidden]` embeddings, refusing ids outside the vocabulary.
    fn embed_tokens(&self, tokens: &Tensor) -> Result<Tensor> {
        self.check_tokens(&tokens.flatten_all()?.to_vec1::<u32>()?)?;
        self.embed_checked(tokens)
    }

    /// `[1, T]` token ids as embeddings, each image token's replaced by the next row of the
    /// images' merged tokens.
    fn embed_with_images(&self, tokens: &Tensor, embeds: Option<&Tensor>) -> Result<Tensor> {
        let ids = tokens.flatten_all()?.to_vec1::<u32>()?;
        let embedded = self.embed_tokens(tokens)?.squeeze(0)?;
        let image_token = self.cfg.vision.as_ref().map(|v| v.image_token_id);
        let slots = ids.iter().filter(|&&id| Some(id) == image_token).count();
        let given = embeds.map(|e| e.dim(0)).transpose()?.unwrap_or(0);
        if slots != given {
            return Err(ModelError::Invalid(format!("{slots} image tokens for {given} merged image tokens")));
        }
        let Some(embeds) = embeds.filter(|_| slots > 0) else {
            return Ok(embedded.unsqueeze(0)?);
        };
        // Rows of [embeddings; image tokens]: each position's own, or the next image row.
        let mut next_image_row = ids.len() as u32;
        let pick: Vec<u32> = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                if Some(id) != image_token {
                    return i as u32;
                }
                next_image_row += 1;
                next_image_row - 1
            })
            .collect();
        let all = Tensor::cat(&[embedded, embeds.to_dtype(self.dtype)?], 0)?;
        Ok(all.index_select(&Tensor::from_vec(pick, ids.len(), &self.device)?, 0)?.unsqueeze(0)?)
    }

    fn check_tokens(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
            Some(bad) => {
                Err(ModelError::Invalid(format!("token id {bad} is outside the vocabulary (size {})", self.cfg.vocab_size)))
            }
            None => Ok(()),
        }
    }

    /// [`Qwen35::embed_tokens`] of ids already checked.
    fn embed_checked(&self, tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let rows = self.parallel.embed(&tokens.flatten_all()?, |ids| self.embed.rows_at(ids, self.dtype))?;
        Ok(rows.reshape((b, t, self.cfg.hidden_size))?)
    }
}
