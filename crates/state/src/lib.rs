//! Per-layer inference state, with a batch of rows each at its own position.
//!
//! Layer state is a closed set ([`LayerState`]): every kind answers the same questions (bytes
//! held, whether it can be trimmed back, how rows merge, filter and extract), and a kind the code
//! does not handle is a compile error. This crate knows tensors, never models.

mod kv;
mod recurrent;
pub use recurrent::RecurrentShape;

pub use kv::KvStore;
pub use recurrent::RecurrentState;

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
}

/// The state of one layer for every row of a batch.
#[derive(Clone, Debug)]
pub enum LayerState {
    /// Full attention: keys and values of every past position.
    Attention(KvStore),
    /// Gated DeltaNet: conv window and recurrent matrix, fixed size per row.
    Recurrent(RecurrentState),
}

impl LayerState {
    pub fn kind(&self) -> &'static str {
        match self {
            LayerState::Attention(_) => "attention KV",
            LayerState::Recurrent(_) => "recurrent",
        }
    }

    pub fn rows(&self) -> usize {
        match self {
            LayerState::Attention(s) => s.rows(),
            LayerState::Recurrent(s) => s.rows(),
        }
    }

    /// Bytes of state held for all rows.
    pub fn bytes(&self) -> usize {
        match self {
            LayerState::Attention(s) => s.bytes(),
            LayerState::Recurrent(s) => s.bytes(),
        }
    }

    /// Whether a row's state can be cut back to an earlier position. KV can; a recurrent state
    /// only exists at the position it was computed for.
    pub fn can_trim(&self) -> bool {
        match self {
            LayerState::Attention(_) => true,
            LayerState::Recurrent(_) => false,
        }
    }

    /// Appends the rows of `other` after this batch's rows.
    pub fn merge(&mut self, other: &LayerState) -> Result<()> {
        match (self, other) {
            (LayerState::Attention(a), LayerState::Attention(b)) => a.merge(b),
            (LayerState::Recurrent(a), LayerState::Recurrent(b)) => a.merge(b),
            (a, b) => Err(StateError::KindMismatch(b.kind(), a.kind())),
        }
    }

    /// Keeps only the listed rows, in the listed order.
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        match self {
            LayerState::Attention(s) => s.filter(keep),
            LayerState::Recurrent(s) => s.filter(keep),
        }
    }

    /// An owned single-row copy of `row` (never a view into the batch buffers).
    pub fn extract(&self, row: usize) -> Result<LayerState> {
        Ok(match self {
            LayerState::Attention(s) => LayerState::Attention(s.extract(row)?),
            LayerState::Recurrent(s) => LayerState::Recurrent(s.extract(row)?),
        })
    }
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
#[derive(Clone, Debug)]
pub struct BatchState {
    pub layers: Vec<LayerState>,
    pub positions: Vec<usize>,
}

impl BatchState {
    pub fn rows(&self) -> usize {
        self.positions.len()
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerState::bytes).sum()
    }

    /// Appends `other`'s rows after this batch's rows.
    pub fn merge(&mut self, other: &BatchState) -> Result<()> {
        for (a, b) in self.layers.iter_mut().zip(&other.layers) {
            a.merge(b)?;
        }
        self.positions.extend_from_slice(&other.positions);
        Ok(())
    }

    /// Keeps only the listed rows, in the listed order.
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        for layer in &mut self.layers {
            layer.filter(keep)?;
        }
        self.positions = keep.iter().map(|&r| self.positions[r]).collect();
        Ok(())
    }

    /// An owned single-row copy of `row`.
    pub fn extract(&self, row: usize) -> Result<BatchState> {
        let rows = self.rows();
        let position = *self.positions.get(row).ok_or(StateError::RowOutOfRange { row, rows })?;
        Ok(BatchState { layers: self.layers.iter().map(|l| l.extract(row)).collect::<Result<_>>()?, positions: vec![position] })
    }
}
