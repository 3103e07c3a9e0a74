//! Per-layer inference state, with a batch of rows each at its own position.
//!
//! Models declare what their state is ([`StateSpec`]); this crate builds it and counts its cost
//! from a table of storage kinds ([`Storage`]). Layer state is a closed set ([`LayerState`]):
//! every kind answers the same questions (bytes held, how far it can be trimmed back, how rows
//! merge, filter and extract, what it persists), and a kind the code does not handle is a
//! compile error. This crate knows tensors, never models.

mod format;
mod kv;
mod paged;
mod pool;
mod recurrent;
mod slots;
mod spec;
mod window;

pub use format::{KvFormat, KvPart, KvPolicy};
pub use kv::KvStore;
pub use paged::PagedLayout;
pub use pool::{PoolSize, PoolStats, StatePool};
pub use recurrent::{RecurrentRound, RecurrentShape, RecurrentState};
pub use slots::SlotLayout;
pub use spec::{KvShape, LayerSpec, StateCost, StateSpec, Storage, StoreContext, WindowShape};
pub use window::{WindowKvStore, ROUND_SLACK};

use candle_core::Tensor;

pub type Result<T> = std::result::Result<T, StateError>;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
    #[error("row {row} out of range for a batch of {rows}")]
    RowOutOfRange { row: usize, rows: usize },
    #[error("cannot merge state of kind {0} into {1}")]
    KindMismatch(&'static str, &'static str),
    #[error("cannot trim {kind} state from position {from} to {to}")]
    Untrimmable { kind: &'static str, from: usize, to: usize },
    #[error("{written} positions written after {len} past a KV capacity of {capacity}")]
    PastCapacity { len: usize, written: usize, capacity: usize },
    #[error("the state pool's {total} {what} (layer {layer} of that kind) are all in use")]
    PoolExhausted { what: &'static str, layer: usize, total: usize },
    #[error("rows cannot join or leave a batch while a speculative round is open")]
    RoundOpen,
    #[error("stored state does not fit this model: {0}")]
    BadPart(String),
    #[error("{0}")]
    Format(String),
}

/// What a delayed KV format's layer persists: the codes, then the unquantized first positions.
const DELAYED_KV_PARTS: &[&str] = &["k", "v", "k_prefix", "v_prefix"];

/// The state of one layer for every row of a batch.
#[derive(Clone, Debug)]
pub enum LayerState {
    /// Full attention: keys and values of every past position.
    Attention(KvStore),
    /// Gated DeltaNet: conv window and recurrent matrix, fixed size per row.
    Recurrent(RecurrentState),
    /// Sliding-window attention: keys and values of the most recent positions only.
    Window(WindowKvStore),
}

impl LayerState {
    pub fn kind(&self) -> &'static str {
        match self {
            LayerState::Attention(_) => KvStore::NAME,
            LayerState::Recurrent(_) => RecurrentState::NAME,
            LayerState::Window(_) => WindowKvStore::NAME,
        }
    }

    /// The names this layer's kind persists a row's tensors under, in order.
    fn part_names(&self) -> &'static [&'static str] {
        match self {
            LayerState::Attention(s) if s.is_delayed() => DELAYED_KV_PARTS,
            LayerState::Window(s) if s.is_delayed() => DELAYED_KV_PARTS,
            LayerState::Attention(_) => KvStore::PARTS,
            LayerState::Recurrent(_) => RecurrentState::PARTS,
            LayerState::Window(_) => WindowKvStore::PARTS,
        }
    }

    pub fn rows(&self) -> usize {
        match self {
            LayerState::Attention(s) => s.rows(),
            LayerState::Recurrent(s) => s.rows(),
            LayerState::Window(s) => s.rows(),
        }
    }

    /// Where the layer's tensors live.
    pub fn device(&self) -> candle_core::Device {
        match self {
            LayerState::Attention(s) => s.device().clone(),
            LayerState::Recurrent(s) => s.device(),
            LayerState::Window(s) => s.device().clone(),
        }
    }

    /// Bytes of state held for all rows.
    pub fn bytes(&self) -> usize {
        match self {
            LayerState::Attention(s) => s.bytes(),
            LayerState::Recurrent(s) => s.bytes(),
            LayerState::Window(s) => s.bytes(),
        }
    }

    /// Bytes of the buffers this layer holds: [`LayerState::bytes`] plus the spare room of
    /// KV buffers grown by doubling and the free slots of sliding-window buffers. (A recurrent
    /// state is all in use.)
    pub fn allocated_bytes(&self) -> usize {
        match self {
            LayerState::Attention(s) => s.allocated_bytes(),
            LayerState::Recurrent(s) => s.bytes(),
            LayerState::Window(s) => s.allocated_bytes(),
        }
    }

    /// Whether every row can be cut back to any earlier position. KV can; a recurrent state
    /// only exists at the position it was computed for; a sliding window only until it wraps.
    pub fn can_trim(&self) -> bool {
        match self {
            LayerState::Attention(_) => true,
            LayerState::Recurrent(_) => false,
            LayerState::Window(s) => s.can_trim(),
        }
    }

    /// Whether `row` can be cut back to its first `len` positions.
    pub fn can_trim_to(&self, row: usize, len: usize) -> bool {
        match self {
            LayerState::Attention(s) => len <= s.len(row),
            LayerState::Recurrent(_) => false,
            LayerState::Window(s) => s.can_trim_to(row, len),
        }
    }

    /// Appends the rows of `other` after this batch's rows.
    pub fn merge(&mut self, other: &LayerState) -> Result<()> {
        match (self, other) {
            (LayerState::Attention(a), LayerState::Attention(b)) => a.merge(b),
            (LayerState::Recurrent(a), LayerState::Recurrent(b)) => a.merge(b),
            (LayerState::Window(a), LayerState::Window(b)) => a.merge(b),
            (a, b) => Err(StateError::KindMismatch(b.kind(), a.kind())),
        }
    }

    /// Keeps only the listed rows, in the listed order.
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        match self {
            LayerState::Attention(s) => s.filter(keep),
            LayerState::Recurrent(s) => s.filter(keep),
            LayerState::Window(s) => s.filter(keep),
        }
    }

    /// One single-row layer per row, in order, each holding what its row held (nothing is
    /// copied out of a pool).
    pub fn split(self) -> Result<Vec<LayerState>> {
        Ok(match self {
            LayerState::Attention(s) => s.split().into_iter().map(LayerState::Attention).collect(),
            LayerState::Recurrent(s) => s.split()?.into_iter().map(LayerState::Recurrent).collect(),
            LayerState::Window(s) => s.split().into_iter().map(LayerState::Window).collect(),
        })
    }

    /// An owned single-row copy of `row` (never a view into the batch buffers).
    pub fn extract(&self, row: usize) -> Result<LayerState> {
        Ok(match self {
            LayerState::Attention(s) => LayerState::Attention(s.extract(row)?),
            LayerState::Recurrent(s) => LayerState::Recurrent(s.extract(row)?),
            LayerState::Window(s) => LayerState::Window(s.extract(row)?),
        })
    }

    /// A single-row state of `row` that holds what it can share instead of a copy: a pool's KV
    /// blocks (copied on write) and a single-row recurrent state's tensors (never written in
    /// place); everything else is copied as [`LayerState::extract`] copies it.
    pub fn share(&self, row: usize) -> Result<LayerState> {
        Ok(match self {
            LayerState::Attention(s) => LayerState::Attention(s.share(row)?),
            LayerState::Recurrent(s) => LayerState::Recurrent(s.share(row)?),
            LayerState::Window(s) => LayerState::Window(s.extract(row)?),
        })
    }

    /// Cuts `row` back to its first `len` positions; an error for kinds that cannot trim.
    pub fn trim(&mut self, row: usize, len: usize) -> Result<()> {
        match self {
            LayerState::Attention(s) => s.trim(row, len),
            LayerState::Recurrent(_) => Err(StateError::Untrimmable { kind: "recurrent", from: usize::MAX, to: len }),
            LayerState::Window(s) => s.trim(row, len),
        }
    }

    /// The tensors of a single-row state, by part name, for persistence (contiguous copies).
    pub fn parts(&self) -> Result<Vec<(&'static str, Tensor)>> {
        if self.rows() != 1 {
            return Err(StateError::BadPart(format!("only single-row state is stored, this has {} rows", self.rows())));
        }
        let (kv, prefix) = match self {
            LayerState::Attention(s) => (s.stored(0)?, s.prefix(0)),
            LayerState::Recurrent(s) => (s.tensors()?, None),
            LayerState::Window(s) => (s.held(0)?, s.prefix(0)),
        };
        let mut tensors = vec![kv.0.force_contiguous()?, kv.1.force_contiguous()?];
        if let Some((k, v)) = prefix {
            tensors.extend([k.force_contiguous()?, v.force_contiguous()?]);
        }
        Ok(self.part_names().iter().copied().zip(tensors).collect())
    }

    /// Rebuilds a single-row layer at `position` of this layer's kind and shape from its parts;
    /// `part` hands out each named tensor (and may read it from disk on demand).
    pub fn from_parts(&self, position: usize, mut part: impl FnMut(&str) -> Result<Tensor>) -> Result<LayerState> {
        let names = self.part_names();
        let mut read = |i: usize| part(names[i]);
        let (first, second) = (read(0)?, read(1)?);
        let prefix = match names.len() {
            4 => Some((read(2)?, read(3)?)),
            _ => None,
        };
        Ok(match self {
            LayerState::Attention(s) => LayerState::Attention(s.single_row(first, second, prefix)?),
            LayerState::Recurrent(s) => LayerState::Recurrent(s.single_row(first, second)?),
            LayerState::Window(s) => LayerState::Window(s.single_row(first, second, position, prefix)?),
        })
    }

    /// The number of positions a single-row layer has consumed, where the kind records it.
    fn stored_len(&self) -> Option<usize> {
        match self {
            LayerState::Attention(s) => Some(s.len(0)),
            LayerState::Window(s) => Some(s.len(0)),
            LayerState::Recurrent(_) => None,
        }
    }
}

/// Bytes of a buffer the stores allocated whole (their buffers are never views).
fn buffer_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Gathers `rows` of a batch-major tensor as a fresh contiguous tensor.
fn select_rows(t: &Tensor, rows: &[usize]) -> Result<Tensor> {
    let n = t.dim(0)?;
    if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
        return Err(StateError::RowOutOfRange { row: bad, rows: n });
    }
    let idx = Tensor::from_vec(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), t.device())?;
    Ok(t.index_select(&idx, 0)?.contiguous()?)
}

/// The state of every layer for a batch of rows, with each row's position (tokens consumed).
/// The default holds no rows and no layers (a placeholder while a row's state is lent out).
#[derive(Clone, Debug, Default)]
pub struct BatchState {
    pub layers: Vec<LayerState>,
    pub positions: Vec<usize>,
    /// Added to each row's position for its rotary position: negative after images, whose
    /// tokens take fewer rotary positions than they are tokens (mRoPE); zero for text.
    pub rope_offsets: Vec<i64>,
}

impl BatchState {
    /// Rows at `positions`, with text's rotary positions (offsets zero).
    pub fn new(layers: Vec<LayerState>, positions: Vec<usize>) -> Self {
        let rope_offsets = vec![0; positions.len()];
        Self { layers, positions, rope_offsets }
    }

    /// Each row's rotary position: its position plus its offset.
    pub fn rope_starts(&self) -> Vec<usize> {
        self.positions.iter().zip(&self.rope_offsets).map(|(&p, &o)| (p as i64 + o).max(0) as usize).collect()
    }

    pub fn rows(&self) -> usize {
        self.positions.len()
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerState::bytes).sum()
    }

    /// Bytes of the buffers held, spare capacity included (see [`LayerState::allocated_bytes`]).
    pub fn allocated_bytes(&self) -> usize {
        self.layers.iter().map(LayerState::allocated_bytes).sum()
    }

    /// Appends `other`'s rows after this batch's rows.
    pub fn merge(&mut self, other: &BatchState) -> Result<()> {
        for (a, b) in self.layers.iter_mut().zip(&other.layers) {
            a.merge(b)?;
        }
        self.positions.extend_from_slice(&other.positions);
        self.rope_offsets.extend_from_slice(&other.rope_offsets);
        Ok(())
    }

    /// Keeps only the listed rows, in the listed order.
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        for layer in &mut self.layers {
            layer.filter(keep)?;
        }
        self.positions = keep.iter().map(|&r| self.positions[r]).collect();
        self.rope_offsets = keep.iter().map(|&r| self.rope_offsets[r]).collect();
        Ok(())
    }

    /// One single-row state per row, in order: the inverse of merging them. Each keeps what its
    /// row held — a pooled row its blocks and slot — so a batch formed for one forward (a
    /// cohort of prompts) hands its rows back without a copy.
    pub fn split(self) -> Result<Vec<BatchState>> {
        let mut rows: Vec<BatchState> = self
            .positions
            .iter()
            .zip(&self.rope_offsets)
            .map(|(&p, &o)| BatchState {
                layers: Vec::with_capacity(self.layers.len()),
                positions: vec![p],
                rope_offsets: vec![o],
            })
            .collect();
        for layer in self.layers {
            for (row, layer) in rows.iter_mut().zip(layer.split()?) {
                row.layers.push(layer);
            }
        }
        Ok(rows)
    }

    /// Whether the layers keep their rows in a [`StatePool`].
    pub fn is_pooled(&self) -> bool {
        self.layers.iter().any(|l| match l {
            LayerState::Attention(kv) => kv.is_paged(),
            LayerState::Recurrent(s) => s.slotted_rows().is_some(),
            LayerState::Window(_) => false,
        })
    }

    /// KV blocks each attention layer of a pool would take to give every row room for `t` more
    /// positions (the layers are fed the same positions, so each takes as many): what must be
    /// free in [`StatePool::blocks_free`] before such a step.
    pub fn blocks_to_grow(&self, t: usize) -> usize {
        self.layers
            .iter()
            .find_map(|l| match l {
                LayerState::Attention(kv) if kv.is_paged() => Some(kv.blocks_to_reserve(t)),
                _ => None,
            })
            .unwrap_or(0)
    }

    /// Whether every layer can be cut back to an earlier position.
    pub fn can_trim(&self) -> bool {
        self.layers.iter().all(LayerState::can_trim)
    }

    /// Cuts `row` back to its first `len` positions (only when every layer can; otherwise
    /// nothing changes).
    pub fn trim(&mut self, row: usize, len: usize) -> Result<()> {
        let from = self.positions[row];
        if len > from {
            return Err(StateError::Untrimmable { kind: "batch", from, to: len });
        }
        if let Some(layer) = self.layers.iter().find(|l| !l.can_trim_to(row, len)) {
            return Err(StateError::Untrimmable { kind: layer.kind(), from, to: len });
        }
        for layer in &mut self.layers {
            layer.trim(row, len)?;
        }
        self.positions[row] = len;
        Ok(())
    }

    /// The tensors of a single-row state, named `layers.{i}.{part}`, for persistence.
    pub fn parts(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            out.extend(layer.parts()?.into_iter().map(|(name, t)| (format!("layers.{i}.{name}"), t)));
        }
        Ok(out)
    }

    /// Rebuilds a single-row state at `position` shaped like `template` (a fresh state of the
    /// same model) from parts named as [`BatchState::parts`] names them. Every shape, dtype and
    /// length is checked, so a stored state can never be restored into the wrong model.
    pub fn from_parts(
        template: &BatchState,
        position: usize,
        mut part: impl FnMut(&str) -> Result<Tensor>,
    ) -> Result<BatchState> {
        let mut layers = Vec::with_capacity(template.layers.len());
        for (i, like) in template.layers.iter().enumerate() {
            let layer = like.from_parts(position, |name| part(&format!("layers.{i}.{name}")))?;
            if let Some(len) = layer.stored_len().filter(|&len| len != position) {
                return Err(StateError::BadPart(format!("layer {i} holds {len} positions, expected {position}")));
            }
            layers.push(layer);
        }
        Ok(BatchState::new(layers, vec![position]))
    }

    /// An owned single-row copy of `row`.
    pub fn extract(&self, row: usize) -> Result<BatchState> {
        let rows = self.rows();
        let position = *self.positions.get(row).ok_or(StateError::RowOutOfRange { row, rows })?;
        let layers = self.layers.iter().map(|l| l.extract(row)).collect::<Result<_>>()?;
        Ok(BatchState { layers, positions: vec![position], rope_offsets: vec![self.rope_offsets[row]] })
    }

    /// A single-row state of `row` sharing what it can (see [`LayerState::share`]): a prompt
    /// cache entry of a pooled row holds its KV blocks once, with the row and with every
    /// request that reuses it.
    pub fn share(&self, row: usize) -> Result<BatchState> {
        let rows = self.rows();
        let position = *self.positions.get(row).ok_or(StateError::RowOutOfRange { row, rows })?;
        let layers = self.layers.iter().map(|l| l.share(row)).collect::<Result<_>>()?;
        Ok(BatchState { layers, positions: vec![position], rope_offsets: vec![self.rope_offsets[row]] })
    }
}
