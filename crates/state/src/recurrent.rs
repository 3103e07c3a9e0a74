//! Gated DeltaNet layer state: the causal-conv window and the recurrent matrix, per row.

use candle_core::{DType, Device, Tensor};

use crate::slots::{SlotLayout, SlottedRows};
use crate::spec::{StateCost, Storage, StoreContext};
use crate::{buffer_bytes, select_rows, Result, StateError};

/// Per row, the conv window `[K-1, conv_dim]` (compute dtype) and the recurrent matrix
/// `[Hv, Dv, Dk]` (in [`RecurrentShape::ssm_dtype`]): in batch tensors of its own (`conv`
/// `[B, K-1, conv_dim]`, `ssm` `[B, Hv, Dv, Dk]`), or each row in a slot of a
/// [`crate::StatePool`]. The two answer the same questions with the same bits.
#[derive(Clone, Debug)]
pub struct RecurrentState {
    rows: Rows,
    /// Set while a speculative round is open.
    pub round: Option<RecurrentRound>,
}

#[derive(Clone, Debug)]
enum Rows {
    Owned { conv: Tensor, ssm: Tensor },
    Slotted(SlottedRows),
}

/// An open speculative round: the state before it, and what the layer's recurrence was fed
/// during it, so that rolling back can fold in exactly the kept positions with the same
/// recurrence instead of re-running the layer. A recurrent state cannot be trimmed; this is
/// how it rolls back.
#[derive(Clone, Debug)]
pub struct RecurrentRound {
    pub conv: Tensor,
    pub ssm: Tensor,
    /// One entry per forward in the round: the layer's per-position recurrence inputs, each
    /// `[B, T, ·]` (what they mean is the layer's business).
    pub inputs: Vec<Vec<Tensor>>,
}

/// Shape of one layer's recurrent state, from the model config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecurrentShape {
    pub conv_kernel: usize,
    pub conv_dim: usize,
    pub value_heads: usize,
    pub value_dim: usize,
    pub key_dim: usize,
    /// What the recurrent matrix is stored in: f32 (exact, the default) or bf16 (half the
    /// bytes; `--mamba-ssm-cache-dtype bfloat16`), computed in f32 either way.
    pub ssm_dtype: DType,
}

impl Storage for RecurrentState {
    type Shape = RecurrentShape;
    const NAME: &'static str = "recurrent";
    const PARTS: &'static [&'static str] = &["conv", "ssm"];

    /// Zero state: the conv window in `dtype`, the matrix in its declared dtype.
    fn empty(shape: &RecurrentShape, rows: usize, cx: &StoreContext, device: &Device) -> Result<Self> {
        let conv = Tensor::zeros((rows, shape.conv_kernel - 1, shape.conv_dim), cx.dtype, device)?;
        let ssm = Tensor::zeros((rows, shape.value_heads, shape.value_dim, shape.key_dim), shape.ssm_dtype, device)?;
        Ok(Self::owned(conv, ssm))
    }

    fn cost(shape: &RecurrentShape, cx: &StoreContext) -> StateCost {
        let conv = (shape.conv_kernel - 1) * shape.conv_dim * cx.dtype.size_in_bytes();
        let ssm = shape.value_heads * shape.value_dim * shape.key_dim * shape.ssm_dtype.size_in_bytes();
        StateCost { bytes_per_row: conv + ssm, ..StateCost::default() }
    }
}

impl RecurrentState {
    fn owned(conv: Tensor, ssm: Tensor) -> Self {
        Self { rows: Rows::Owned { conv, ssm }, round: None }
    }

    pub(crate) fn slotted(rows: SlottedRows) -> Self {
        Self { rows: Rows::Slotted(rows), round: None }
    }

    pub(crate) fn slotted_rows(&self) -> Option<&SlottedRows> {
        match &self.rows {
            Rows::Slotted(s) => Some(s),
            Rows::Owned { .. } => None,
        }
    }

    pub fn rows(&self) -> usize {
        match &self.rows {
            Rows::Owned { conv, .. } => conv.dims()[0],
            Rows::Slotted(s) => s.rows(),
        }
    }

    /// Where the state lives.
    pub fn device(&self) -> Device {
        match &self.rows {
            Rows::Owned { conv, .. } => conv.device().clone(),
            Rows::Slotted(s) => s.pool_tensors().0.device().clone(),
        }
    }

    /// Bytes of the rows' state.
    pub fn bytes(&self) -> usize {
        match &self.rows {
            Rows::Owned { conv, ssm } => buffer_bytes(conv) + buffer_bytes(ssm),
            Rows::Slotted(s) => s.rows() * s.row_bytes(),
        }
    }

    /// The rows' conv windows `[B, K-1, C]` and recurrent matrices `[B, Hv, Dv, Dk]`: the
    /// tensors themselves, or copies out of the rows' slots.
    pub fn tensors(&self) -> Result<(Tensor, Tensor)> {
        match &self.rows {
            Rows::Owned { conv, ssm } => Ok((conv.clone(), ssm.clone())),
            Rows::Slotted(s) => s.gather(),
        }
    }

    /// Replaces the rows' state with `conv`, `ssm` (`[B, ...]`, as [`RecurrentState::tensors`]
    /// gives them; stored in the state's dtypes).
    pub fn set(&mut self, conv: Tensor, ssm: Tensor) -> Result<()> {
        match &mut self.rows {
            Rows::Owned { conv: c, ssm: s } => {
                (*c, *s) = (conv.to_dtype(c.dtype())?, ssm.to_dtype(s.dtype())?);
                Ok(())
            }
            Rows::Slotted(s) => s.set(&conv, &ssm),
        }
    }

    /// Where a kernel updating the rows in place finds them: the pool's tensors and each row's
    /// slot (rows sharing a slot get one of their own first); `None` for rows in tensors of
    /// their own.
    pub fn slot_layout(&mut self) -> Result<Option<SlotLayout>> {
        match &mut self.rows {
            Rows::Owned { .. } => Ok(None),
            Rows::Slotted(s) => s.layout().map(Some),
        }
    }

    pub fn merge(&mut self, other: &RecurrentState) -> Result<()> {
        self.no_open_round()?;
        match (&mut self.rows, &other.rows) {
            (Rows::Slotted(a), Rows::Slotted(b)) if a.same_pool(b) => a.merge(b),
            (Rows::Owned { conv, ssm }, _) => {
                let (c, s) = other.tensors()?;
                *conv = Tensor::cat(&[&*conv, &c], 0)?;
                *ssm = Tensor::cat(&[&*ssm, &s], 0)?;
            }
            (Rows::Slotted(a), _) => {
                let (c, s) = other.tensors()?;
                a.push(&c, &s)?;
            }
        }
        Ok(())
    }

    fn no_open_round(&self) -> Result<()> {
        match self.round {
            Some(_) => Err(StateError::RoundOpen),
            None => Ok(()),
        }
    }

    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        self.no_open_round()?;
        let n = self.rows();
        if let Some(&bad) = keep.iter().find(|&&r| r >= n) {
            return Err(StateError::RowOutOfRange { row: bad, rows: n });
        }
        match &mut self.rows {
            Rows::Owned { conv, ssm } => {
                *conv = select_rows(conv, keep)?;
                *ssm = select_rows(ssm, keep)?;
            }
            Rows::Slotted(s) => s.filter(keep),
        }
        Ok(())
    }

    /// One single-row state per row: a slotted row keeps its slot, rows in batch tensors become
    /// views of their row.
    pub fn split(self) -> Result<Vec<RecurrentState>> {
        self.no_open_round()?;
        match self.rows {
            Rows::Slotted(s) => Ok(s.split().into_iter().map(Self::slotted).collect()),
            Rows::Owned { conv, ssm } => {
                (0..conv.dim(0)?).map(|r| Ok(Self::owned(conv.narrow(0, r, 1)?, ssm.narrow(0, r, 1)?))).collect()
            }
        }
    }

    /// A single-row state from `conv` and `ssm`, shaped like one row of this state; the error
    /// names what does not match.
    pub fn single_row(&self, conv: Tensor, ssm: Tensor) -> Result<RecurrentState> {
        let (like_conv, like_ssm) = self.row_shapes()?;
        for (name, t, like) in [("conv", &conv, &like_conv), ("ssm", &ssm, &like_ssm)] {
            if t.dims().get(1..) != like.dims().get(1..) || t.dims().first() != Some(&1) || t.dtype() != like.dtype() {
                return Err(StateError::BadPart(format!(
                    "recurrent {name} is {:?} {:?}, expected [1, {:?}] {:?}",
                    t.dtype(),
                    t.dims(),
                    &like.dims()[1..],
                    like.dtype()
                )));
            }
        }
        let device = like_conv.device();
        Ok(Self::owned(conv.to_device(device)?, ssm.to_device(device)?))
    }

    /// Tensors with this state's row shapes and dtypes (the rows' own, or the pool's).
    fn row_shapes(&self) -> Result<(Tensor, Tensor)> {
        Ok(match &self.rows {
            Rows::Owned { conv, ssm } => (conv.clone(), ssm.clone()),
            Rows::Slotted(s) => s.pool_tensors(),
        })
    }

    /// A single-row state of `row`: the tensors themselves when this is a single row in
    /// tensors of its own (they are replaced, never written in place), else a copy
    /// ([`RecurrentState::extract`]).
    pub fn share(&self, row: usize) -> Result<RecurrentState> {
        match &self.rows {
            Rows::Owned { conv, ssm } if row == 0 && self.rows() == 1 => Ok(Self::owned(conv.clone(), ssm.clone())),
            _ => self.extract(row),
        }
    }

    /// An owned single-row copy of `row`, in tensors of its own.
    pub fn extract(&self, row: usize) -> Result<RecurrentState> {
        let n = self.rows();
        if row >= n {
            return Err(StateError::RowOutOfRange { row, rows: n });
        }
        let (conv, ssm) = match &self.rows {
            Rows::Owned { conv, ssm } => (select_rows(conv, &[row])?, select_rows(ssm, &[row])?),
            Rows::Slotted(s) => {
                let mut one = s.clone();
                one.filter(&[row]);
                one.gather()?
            }
        };
        Ok(Self::owned(conv, ssm))
    }
}
