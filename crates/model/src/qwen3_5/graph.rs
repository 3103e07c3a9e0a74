//! The decode step as a CUDA graph. A decode step launches a few hundred small kernels, and
//! launching them from the host costs more than running them at batch 1; recorded once as a
//! graph, the step is one launch. The recording bakes in every address and scalar, so:
//! - what changes between steps — the tokens, the rotary tables and each row's KV length — is
//!   uploaded into tensors the graph reads, before each replay;
//! - the recurrent state is updated in place (the same kernels, writing over their input), and
//!   the KV append and attention read the row buffers through device tables;
//! - a batch whose rows, KV buffers or state tensors changed records again. The first step of
//!   a new batch layout runs eagerly; the second runs the launches a graph records and then
//!   records them, so a layout that lasts one step (a row joining as another leaves) costs no
//!   recording.
//!
//! A replay computes the same kernels on the same values as the eager step, so its logits are
//! the same bits.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::{DType, Tensor};
use strata_kernels::attention::DecodeRows;
use strata_kernels::{device_address, upload, StepGraph};
use strata_state::{BatchState, LayerState};

use super::layers::Residual;
use super::{mismatched, Logits, Mixer, Qwen35};
use crate::error::Result;

pub(super) struct DecodeGraphs {
    pub(super) enabled: AtomicBool,
    slot: Mutex<Slot>,
    pub(super) recordings: AtomicUsize,
    pub(super) replays: AtomicUsize,
}

impl Default for DecodeGraphs {
    fn default() -> Self {
        Self {
            enabled: AtomicBool::new(true),
            slot: Mutex::default(),
            recordings: AtomicUsize::new(0),
            replays: AtomicUsize::new(0),
        }
    }
}

#[derive(Default)]
struct Slot {
    graph: Option<DecodeGraph>,
    /// The layout of the last decode step, recorded or not.
    last: Option<BatchLayout>,
}

/// What a recording depends on besides the state tensors: the rows and their KV buffers.
#[derive(Clone, PartialEq)]
struct BatchLayout {
    rows: usize,
    /// Per attention layer, per row: key and value buffer addresses and capacity.
    kv: Vec<Vec<(u64, u64, usize)>>,
}

impl BatchLayout {
    fn of(state: &BatchState) -> Result<Self> {
        let mut kv = Vec::new();
        for layer in &state.layers {
            if let LayerState::Attention(store) = layer {
                let rows: candle_core::Result<_> =
                    store.buffers()?.iter().map(|(k, v)| Ok((device_address(k)?, device_address(v)?, k.dim(1)?))).collect();
                kv.push(rows?);
            }
        }
        Ok(Self { rows: state.rows(), kv })
    }
}

/// The recurrent tensors' addresses, layer by layer.
fn recurrent_addresses(state: &BatchState) -> Result<Vec<(u64, u64)>> {
    let mut at = Vec::new();
    for layer in &state.layers {
        if let LayerState::Recurrent(s) = layer {
            at.push((device_address(&s.conv)?, device_address(&s.ssm)?));
        }
    }
    Ok(at)
}

/// One recorded decode step and the tensors it reads and writes besides the batch state.
struct DecodeGraph {
    layout: BatchLayout,
    recurrent: Vec<(u64, u64)>,
    graph: StepGraph,
    inputs: StepInputs,
    /// `[B, vocab]` f32, written by every replay.
    logits: Tensor,
}

/// What a replay reads that changes from step to step.
pub(super) struct StepInputs {
    /// `[B, 1]` u32.
    tokens: Tensor,
    /// cos, sin `[B, 1, 1, rotary_dim / 2]` f32 for each row's position.
    rope: (Tensor, Tensor),
    /// `[B]` i32: each row's KV length after the step.
    lens: Tensor,
    /// Per attention layer, its KV buffers as the kernels' device tables.
    kv: Vec<DecodeRows>,
}

impl StepInputs {
    /// This step's tokens, rotary tables and KV lengths, where the graph reads them.
    fn upload(&self, model: &Qwen35, ids: &[u32], state: &BatchState) -> Result<()> {
        upload(&self.tokens, ids)?;
        let (cos, sin) = model.rotary.values(&state.positions, 1);
        upload(&self.rope.0, &cos)?;
        upload(&self.rope.1, &sin)?;
        let lens = state.positions.iter().map(|&p| i32::try_from(p + 1)).collect::<std::result::Result<Vec<_>, _>>();
        let lens = lens.map_err(|_| crate::ModelError::Invalid("a position past the KV kernels' int range".into()))?;
        Ok(upload(&self.lens, &lens)?)
    }
}

impl DecodeGraphs {
    /// Runs a decode step through a recorded graph where one applies: CUDA, one token per row,
    /// last-position logits, no speculative round open, plain weights, every attention layer's
    /// KV length at the row's position. `None` leaves the step to the eager forward.
    pub(super) fn decode(
        &self,
        model: &Qwen35,
        tokens: &Tensor,
        state: &mut BatchState,
        logits: Logits,
    ) -> Result<Option<Tensor>> {
        let rows = state.rows();
        if !self.enabled.load(Ordering::Relaxed)
            || !StepGraph::can_capture(&model.device)
            || logits != Logits::Last
            || tokens.dims() != [rows, 1]
            || !model.plain_weights
        {
            return Ok(None);
        }
        for layer in &state.layers {
            let eligible = match layer {
                LayerState::Recurrent(s) => s.round.is_none(),
                LayerState::Attention(kv) => (0..rows).all(|r| kv.len(r) == state.positions[r]),
                _ => false,
            };
            if !eligible {
                return Ok(None);
            }
        }
        let ids = tokens.flatten_all()?.to_vec1::<u32>()?;
        model.check_tokens(&ids)?;
        for layer in &mut state.layers {
            if let LayerState::Attention(kv) = layer {
                kv.reserve_rows(1)?;
            }
        }
        let layout = BatchLayout::of(state)?;
        let mut slot = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        let recorded = match &slot.graph {
            Some(g) => g.layout == layout && g.recurrent == recurrent_addresses(state)?,
            None => false,
        };
        let logits = if recorded {
            let graph = slot.graph.as_ref().expect("checked above");
            graph.inputs.upload(model, &ids, state)?;
            graph.graph.replay()?;
            self.replays.fetch_add(1, Ordering::Relaxed);
            graph.logits.clone()
        } else {
            let seen = slot.last.as_ref() == Some(&layout);
            slot.last = Some(layout.clone());
            slot.graph = None;
            if !seen {
                return Ok(None);
            }
            let (graph, logits) = DecodeGraph::run_and_record(model, &ids, state, layout)?;
            match graph {
                Some(graph) => {
                    slot.graph = Some(graph);
                    self.recordings.fetch_add(1, Ordering::Relaxed);
                }
                None => self.enabled.store(false, Ordering::Relaxed),
            }
            logits
        };
        finish(state, &logits).map(Some)
    }
}

/// After a step ran: advances the state's bookkeeping as the eager forward would, and returns a
/// copy of the logits (a graph's own are overwritten by its next step).
fn finish(state: &mut BatchState, logits: &Tensor) -> Result<Tensor> {
    for layer in &mut state.layers {
        if let LayerState::Attention(kv) = layer {
            kv.commit_written(1)?;
        }
    }
    state.positions.iter_mut().for_each(|p| *p += 1);
    Ok(logits.copy()?)
}

impl DecodeGraph {
    /// Runs this step through the launches a graph records, then records them for the steps
    /// after it; returns the graph (none where the recording failed, which is logged: the step
    /// itself ran, and later ones run eagerly) and the step's logits.
    fn run_and_record(
        model: &Qwen35,
        ids: &[u32],
        state: &mut BatchState,
        layout: BatchLayout,
    ) -> Result<(Option<Self>, Tensor)> {
        // The replays write the recurrent state in place: make it this graph's alone.
        for layer in &mut state.layers {
            if let LayerState::Recurrent(s) = layer {
                s.conv = s.conv.copy()?;
                s.ssm = s.ssm.copy()?;
            }
        }
        let (rows, dev) = (state.rows(), &model.device);
        let half = model.rotary.inv_freq.len();
        let kv = state
            .layers
            .iter()
            .filter_map(|layer| match layer {
                LayerState::Attention(store) => {
                    Some(store.buffers().map_err(Into::into).and_then(|b| DecodeRows::new(&b).map_err(Into::into)))
                }
                _ => None,
            })
            .collect::<Result<Vec<_>>>()?;
        let inputs = StepInputs {
            tokens: Tensor::zeros((rows, 1), DType::U32, dev)?,
            rope: (Tensor::zeros((rows, 1, 1, half), DType::F32, dev)?, Tensor::zeros((rows, 1, 1, half), DType::F32, dev)?),
            lens: Tensor::zeros(rows, DType::I32, dev)?,
            kv,
        };
        let logits = Tensor::zeros((rows, model.cfg.vocab_size), DType::F32, dev)?;
        inputs.upload(model, ids, state)?;
        let recorded = {
            let state = &*state;
            StepGraph::run_and_record(dev, || model.record_step(state, &inputs, &logits))?
        };
        match recorded {
            Ok(graph) => {
                let recurrent = recurrent_addresses(state)?;
                Ok((Some(Self { layout, recurrent, graph, inputs, logits: logits.clone() }), logits))
            }
            Err(e) => {
                tracing::warn!(error = %e, "recording the decode step as a CUDA graph failed; decoding launch by launch from now on");
                Ok((None, logits))
            }
        }
    }
}

impl Qwen35 {
    /// The launches of one decode step, reading `inputs` and writing `logits`: what a
    /// [`DecodeGraph`] records.
    fn record_step(&self, state: &BatchState, inputs: &StepInputs, logits: &Tensor) -> Result<()> {
        let mut x = Residual::new(self.embed_checked(&inputs.tokens)?);
        let mut kv = inputs.kv.iter();
        for (layer, layer_state) in self.layers.iter().zip(&state.layers) {
            x = layer.forward_with(&x, |mixer, h| match (mixer, layer_state) {
                (Mixer::Linear(m), LayerState::Recurrent(s)) => m.forward_in_place(h, s),
                (Mixer::Full(m), LayerState::Attention(_)) => {
                    let rows = kv.next().expect("one table per attention layer");
                    m.forward_captured(h, rows, &inputs.lens, &inputs.rope)
                }
                (_, s) => Err(mismatched(s)),
            })?;
        }
        let (_, normed) = self.norm.forward_stream(&x.map(|t| t.squeeze(1))?)?;
        let out = self.lm_head.forward(&normed)?.to_dtype(DType::F32)?;
        logits.slice_set(&out, 0, 0)?;
        Ok(())
    }
}
