//! The decode step as a CUDA graph. A decode step launches a few hundred small kernels, and
//! launching them from the host costs more than running them at batch 1; recorded once as a
//! graph, the step is one launch. The recording bakes in every address and scalar, so:
//! - the batch's state lives in a [`strata_state::StatePool`], whose tensors never move: the
//!   attention layers' KV in blocks read through block tables, the recurrent layers' state in
//!   slots updated in place;
//! - what changes between steps — the tokens, the rotary tables, each row's KV length, block
//!   table and slot — is uploaded into tensors the graph reads, before each replay;
//! - a graph is recorded for a *shape*: the batch rounded up to a bucket ([`Shape`]), the extra
//!   rows padding (their KV goes to the pool's scratch block, their recurrent kernels skip them),
//!   and block tables as wide as a length bucket. Rows joining and leaving, and KV growing within
//!   the bucket, replay the same graph; a shape seen for the first time runs eagerly, and its
//!   second step records it.
//!
//! A replay computes the same kernels on the same values as the eager step, so its logits are
//! the same bits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::{DType, Tensor};
use strata_kernels::attention::{lens_i32, PagedDecodeRows};
use strata_kernels::{device_address, upload, GpuSpan, StepGraph};
use strata_state::{BatchState, LayerState, PagedLayout, SlotLayout};

use super::layers::Residual;
use super::{Logits, Mixer, Qwen35};
use crate::error::Result;

/// Recorded graphs kept at once; the least recently replayed goes first. Each holds its step's
/// activations and logits (a few hundred MB at the widest batches of a 4B model).
const MAX_GRAPHS: usize = 24;

/// Keys an attention split covers (`SPLIT_KEYS` in cuda/attention.cu): block tables are at least
/// this wide, so short rows share one recording.
const SPLIT_KEYS: usize = 512;

pub(super) struct DecodeGraphs {
    pub(super) enabled: AtomicBool,
    slot: Mutex<Recorded>,
    pub(super) recordings: AtomicUsize,
    pub(super) replays: AtomicUsize,
    /// Host time of replayed steps before their replay (checks, block tables, uploads), and the
    /// GPU time of the replays themselves.
    pub(super) prepare_ns: AtomicU64,
    pub(super) replay_gpu_ns: AtomicU64,
}

impl Default for DecodeGraphs {
    fn default() -> Self {
        Self {
            enabled: AtomicBool::new(true),
            slot: Mutex::default(),
            recordings: AtomicUsize::new(0),
            replays: AtomicUsize::new(0),
            prepare_ns: AtomicU64::new(0),
            replay_gpu_ns: AtomicU64::new(0),
        }
    }
}

#[derive(Default)]
struct Recorded {
    graphs: HashMap<Shape, DecodeGraph>,
    /// Shapes seen once, not recorded yet.
    seen: Vec<Shape>,
    /// Replays so far, to find the least recently used graph.
    clock: u64,
    /// Around the latest replay; read (and cleared) at the next step, when it is surely done.
    span: Option<(GpuSpan, bool)>,
}

/// What a recording is made for: a number of rows and a block-table width, each rounded up to a
/// bucket, and the pool tensors it reads.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Shape {
    rows: usize,
    blocks: usize,
    pool: Vec<u64>,
}

/// Batch sizes a graph is recorded for: powers of two to 32, then multiples of 32 (vLLM's are
/// multiples of 8; a padding row costs only its share of the matmuls and the output head here,
/// since the recurrent kernels skip it and its attention reads one key).
fn rows_bucket(rows: usize) -> usize {
    if rows <= 32 {
        rows.next_power_of_two()
    } else {
        rows.div_ceil(32) * 32
    }
}

/// The pooled state a decode step reads and writes in place: per attention layer its blocks,
/// per recurrent layer its slots.
struct Pooled {
    kv: Vec<PagedLayout>,
    recurrent: Vec<SlotLayout>,
}

impl Pooled {
    /// The layouts of `state`'s layers after giving every row room for one more position (and
    /// blocks and slots of its own); `None` where a layer is not in a pool.
    fn of(state: &mut BatchState) -> Result<Option<Self>> {
        let (mut kv, mut recurrent) = (Vec::new(), Vec::new());
        for layer in &mut state.layers {
            match layer {
                LayerState::Attention(store) => {
                    // The graph's kernels write and read keys and values (or their codes) in place.
                    if !store.in_place()? {
                        return Ok(None);
                    }
                    store.reserve_rows(1)?;
                    kv.push(store.paged_layout()?.expect("in place rows are paged"));
                }
                LayerState::Recurrent(s) => match s.slot_layout()? {
                    Some(layout) => recurrent.push(layout),
                    None => return Ok(None),
                },
                LayerState::Window(_) => return Ok(None),
            }
        }
        Ok(Some(Self { kv, recurrent }))
    }

    fn shape(&self, rows: usize) -> Result<Shape> {
        let block_size = self.kv.first().map_or(1, |l| l.block_size);
        let longest = self.kv.iter().flat_map(|l| l.tables.iter().map(Vec::len)).max().unwrap_or(0);
        let blocks = longest.next_power_of_two().max(SPLIT_KEYS.div_ceil(block_size));
        let mut pool = Vec::new();
        for l in &self.kv {
            pool.extend([device_address(&l.keys)?, device_address(&l.values)?]);
        }
        for l in &self.recurrent {
            pool.extend([device_address(&l.conv)?, device_address(&l.ssm)?]);
        }
        Ok(Shape { rows: rows_bucket(rows), blocks, pool })
    }

    /// Block tables `[attention layers, shape.rows, shape.blocks]` and slots `[recurrent layers,
    /// shape.rows]` for the graph's tensors: padding rows at the scratch block and slot -1.
    fn tables(&self, shape: &Shape) -> (Vec<i32>, Vec<i32>) {
        let mut tables = Vec::with_capacity(self.kv.len() * shape.rows * shape.blocks);
        for layer in &self.kv {
            for r in 0..shape.rows {
                let row = layer.tables.get(r).map_or(&[][..], Vec::as_slice);
                let scratch = layer.scratch as i32;
                tables.extend(row.iter().map(|&b| b as i32));
                tables.extend(std::iter::repeat_n(scratch, shape.blocks - row.len()));
            }
        }
        let mut slots = Vec::with_capacity(self.recurrent.len() * shape.rows);
        for layer in &self.recurrent {
            slots.extend(layer.slots.iter().map(|&s| s as i32));
            slots.extend(std::iter::repeat_n(-1, shape.rows - layer.slots.len()));
        }
        (tables, slots)
    }
}

/// One recorded decode step and the tensors it reads and writes besides the pool.
struct DecodeGraph {
    graph: StepGraph,
    inputs: StepInputs,
    /// `[shape.rows, vocab]` f32, written by every replay.
    logits: Tensor,
    last_used: u64,
}

/// What a replay reads that changes from step to step.
pub(super) struct StepInputs {
    /// `[rows, 1]` u32.
    tokens: Tensor,
    /// cos, sin `[rows, 1, 1, rotary_dim / 2]` f32 for each row's position.
    rope: (Tensor, Tensor),
    /// `[rows]` i32: each row's KV length after the step.
    lens: Tensor,
    /// `[attention layers, rows, blocks]` i32 and `[recurrent layers, rows]` i32.
    tables: Tensor,
    slots: Tensor,
    /// Per attention layer, its pool and block tables as the kernels read them.
    kv: Vec<PagedDecodeRows>,
    /// Per recurrent layer, its pool tensors.
    recurrent: Vec<(Tensor, Tensor)>,
    /// What was uploaded last into `tables` and `slots`, which change only when rows join,
    /// leave or cross into a new block.
    uploaded: Option<(Vec<i32>, Vec<i32>)>,
}

impl StepInputs {
    fn new(model: &Qwen35, shape: &Shape, pooled: &Pooled) -> Result<Self> {
        let (rows, dev) = (shape.rows, &model.device);
        let half = model.rotary.inv_freq.len();
        let tables = Tensor::zeros((pooled.kv.len(), rows, shape.blocks), DType::I32, dev)?;
        let kv = pooled
            .kv
            .iter()
            .enumerate()
            .map(|(i, l)| match &l.codes {
                Some(codes) => PagedDecodeRows::coded(&l.keys, &l.values, l.block_size, &tables.get(i)?, codes),
                None => PagedDecodeRows::new(&l.keys, &l.values, l.block_size, &tables.get(i)?),
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self {
            tokens: Tensor::zeros((rows, 1), DType::U32, dev)?,
            rope: (Tensor::zeros((rows, 1, 1, half), DType::F32, dev)?, Tensor::zeros((rows, 1, 1, half), DType::F32, dev)?),
            lens: Tensor::zeros(rows, DType::I32, dev)?,
            slots: Tensor::zeros((pooled.recurrent.len(), rows), DType::I32, dev)?,
            tables,
            kv,
            recurrent: pooled.recurrent.iter().map(|l| (l.conv.clone(), l.ssm.clone())).collect(),
            uploaded: None,
        })
    }

    /// This step's tokens, rotary tables, KV lengths, block tables and slots, where the graph
    /// reads them; padding rows get token 0 at position 0 (one key, in the scratch block).
    fn upload(&mut self, model: &Qwen35, ids: &[u32], state: &BatchState, pooled: &Pooled, shape: &Shape) -> Result<()> {
        let pad = shape.rows - ids.len();
        let ids: Vec<u32> = ids.iter().copied().chain(std::iter::repeat_n(0, pad)).collect();
        let padded = |p: Vec<usize>| -> Vec<usize> { p.into_iter().chain(std::iter::repeat_n(0, pad)).collect() };
        let (positions, rope_starts) = (padded(state.positions.clone()), padded(state.rope_starts()));
        upload(&self.tokens, &ids)?;
        let (cos, sin) = model.rotary.values(&rope_starts, 1);
        upload(&self.rope.0, &cos)?;
        upload(&self.rope.1, &sin)?;
        let lens: Vec<usize> = positions.iter().map(|&p| p + 1).collect();
        upload(&self.lens, &lens_i32(&lens)?)?;
        let tables = pooled.tables(shape);
        if self.uploaded.as_ref() != Some(&tables) {
            upload(&self.tables, &tables.0)?;
            upload(&self.slots, &tables.1)?;
            self.uploaded = Some(tables);
        }
        Ok(())
    }
}

impl DecodeGraphs {
    /// Whether a step of `tokens` over `state` may run through a recorded graph: CUDA, graphs
    /// on, one token per row, last-position logits, no speculative round open, plain weights, a
    /// feed-forward that stays on the device (dense, or experts routed there), the state in a
    /// pool with every attention layer's KV length at the row's position.
    pub(super) fn apply(&self, model: &Qwen35, tokens: &Tensor, state: &BatchState, logits: Logits) -> bool {
        let rows = state.rows();
        let eligible = |layer: &LayerState| match layer {
            LayerState::Recurrent(s) => s.round.is_none(),
            LayerState::Attention(kv) => (0..rows).all(|r| kv.len(r) == state.positions[r]),
            LayerState::Window(_) => false,
        };
        self.enabled.load(Ordering::Relaxed)
            && StepGraph::can_capture(&model.device)
            && logits == Logits::Last
            && tokens.dims() == [rows, 1]
            && model.plain_weights
            // A mixture of experts whose routes stay on the device.
            && model.layers.iter().all(|l| l.mlp.stays_on_device(rows_bucket(rows)))
            && state.is_pooled()
            && state.layers.iter().all(eligible)
    }

    /// Runs a decode step through a recorded graph where one applies ([`Self::apply`]); `None`
    /// leaves the step to the eager forward.
    pub(super) fn decode(
        &self,
        model: &Qwen35,
        tokens: &Tensor,
        state: &mut BatchState,
        logits: Logits,
    ) -> Result<Option<Tensor>> {
        let started = std::time::Instant::now();
        let rows = state.rows();
        if !self.apply(model, tokens, state, logits) {
            return Ok(None);
        }
        let ids = tokens.flatten_all()?.to_vec1::<u32>()?;
        model.check_tokens(&ids)?;
        let Some(pooled) = Pooled::of(state)? else { return Ok(None) };
        let shape = pooled.shape(rows)?;
        let mut guard = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        let Recorded { graphs, seen, clock, span } = &mut *guard;
        *clock += 1;
        if span.is_none() {
            *span = Some((GpuSpan::new(&model.device)?, false));
        }
        let (timer, timed) = span.as_mut().expect("set above");
        if std::mem::take(timed) {
            self.replay_gpu_ns.fetch_add(timer.elapsed_ns()?, Ordering::Relaxed);
        }
        let logits = if let Some(graph) = graphs.get_mut(&shape) {
            graph.inputs.upload(model, &ids, state, &pooled, &shape)?;
            self.prepare_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            timer.start()?;
            graph.graph.replay()?;
            timer.end()?;
            *timed = true;
            graph.last_used = *clock;
            self.replays.fetch_add(1, Ordering::Relaxed);
            graph.logits.narrow(0, 0, rows)?
        } else if !seen.contains(&shape) {
            // A first sight runs eagerly: a shape that lasts one step costs no recording.
            seen.push(shape);
            return Ok(None);
        } else {
            seen.retain(|s| s != &shape);
            let (graph, logits) = DecodeGraph::run_and_record(model, &ids, state, &pooled, &shape)?;
            match graph {
                Some(mut graph) => {
                    graph.last_used = *clock;
                    if graphs.len() >= MAX_GRAPHS {
                        let oldest = graphs.iter().min_by_key(|(_, g)| g.last_used).map(|(s, _)| s.clone());
                        oldest.map(|s| graphs.remove(&s));
                    }
                    graphs.insert(shape, graph);
                    self.recordings.fetch_add(1, Ordering::Relaxed);
                }
                None => self.enabled.store(false, Ordering::Relaxed),
            }
            logits.narrow(0, 0, rows)?
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
    /// itself ran, and later ones run eagerly) and the step's logits (`[shape.rows, vocab]`).
    fn run_and_record(
        model: &Qwen35,
        ids: &[u32],
        state: &BatchState,
        pooled: &Pooled,
        shape: &Shape,
    ) -> Result<(Option<Self>, Tensor)> {
        let mut inputs = StepInputs::new(model, shape, pooled)?;
        let logits = Tensor::zeros((shape.rows, model.cfg.vocab_size), DType::F32, &model.device)?;
        inputs.upload(model, ids, state, pooled, shape)?;
        let recorded = StepGraph::run_and_record(&model.device, || model.record_step(&inputs, &logits))?;
        match recorded {
            Ok(graph) => Ok((Some(Self { graph, inputs, logits: logits.clone(), last_used: 0 }), logits)),
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
    fn record_step(&self, inputs: &StepInputs, logits: &Tensor) -> Result<()> {
        let mut x = Residual::new(self.embed_checked(&inputs.tokens)?);
        let (mut kv, mut recurrent) = (inputs.kv.iter(), inputs.recurrent.iter().enumerate());
        for layer in &self.layers {
            x = layer.forward_with(&x, |mixer, h| match mixer {
                Mixer::Linear(m) => {
                    let (i, (conv, ssm)) = recurrent.next().expect("one pool per recurrent layer");
                    m.forward_in_place(h, conv, ssm, &inputs.slots.get(i)?)
                }
                Mixer::Full(m) => {
                    let rows = kv.next().expect("one pool per attention layer");
                    m.forward_captured(h, rows, &inputs.lens, &inputs.rope)
                }
            })?;
        }
        let (_, normed) = self.norm.forward_stream(&x.map(|t| t.squeeze(1))?)?;
        let out = self.lm_head.forward(&normed)?.to_dtype(DType::F32)?;
        logits.slice_set(&out, 0, 0)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::rows_bucket;

    #[test]
    fn buckets_cover_every_batch_with_few_recordings() {
        let buckets: std::collections::BTreeSet<usize> = (1..=256).map(rows_bucket).collect();
        assert_eq!(buckets.len(), 6 + 7, "1, 2, 4, 8, 16, 32, then 64, 96, ..., 256");
        for rows in 1..=256 {
            let b = rows_bucket(rows);
            assert!(b >= rows && b - rows < rows.max(32), "{rows} rows in a bucket of {b}");
        }
    }
}
