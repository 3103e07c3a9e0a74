//! Gated DeltaNet layer state: the causal-conv window and the recurrent matrix, per row.

use candle_core::{DType, Device, Tensor};

use crate::spec::{StateCost, Storage};
use crate::{select_rows, Result, StateError};

/// `conv`: `[B, K-1, conv_dim]`, the last `K - 1` conv inputs (compute dtype).
/// `ssm`: `[B, Hv, Dv, Dk]`, the recurrent matrix, always f32.
#[derive(Clone, Debug)]
pub struct RecurrentState {
    pub conv: Tensor,
    pub ssm: Tensor,
    /// Set while a speculative round is open.
    pub round: Option<RecurrentRound>,
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
}

impl Storage for RecurrentState {
    type Shape = RecurrentShape;
    const NAME: &'static str = "recurrent";
    const PARTS: &'static [&'static str] = &["conv", "ssm"];

    /// Zero state: the conv window in `dtype`, the matrix in f32.
    fn empty(shape: &RecurrentShape, rows: usize, dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self {
            conv: Tensor::zeros((rows, shape.conv_kernel - 1, shape.conv_dim), dtype, device)?,
            ssm: Tensor::zeros((rows, shape.value_heads, shape.value_dim, shape.key_dim), DType::F32, device)?,
            round: None,
        })
    }

    fn cost(shape: &RecurrentShape, dtype: DType) -> StateCost {
        let conv = (shape.conv_kernel - 1) * shape.conv_dim * dtype.size_in_bytes();
        StateCost { bytes_per_row: conv + shape.value_heads * shape.value_dim * shape.key_dim * 4, ..StateCost::default() }
    }
}

impl RecurrentState {
    pub fn rows(&self) -> usize {
        self.conv.dims()[0]
    }

    pub fn bytes(&self) -> usize {
        self.conv.elem_count() * self.conv.dtype().size_in_bytes() + self.ssm.elem_count() * 4
    }

    pub fn merge(&mut self, other: &RecurrentState) -> Result<()> {
        self.no_open_round()?;
        self.conv = Tensor::cat(&[&self.conv, &other.conv], 0)?;
        self.ssm = Tensor::cat(&[&self.ssm, &other.ssm], 0)?;
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
        self.conv = select_rows(&self.conv, keep)?;
        self.ssm = select_rows(&self.ssm, keep)?;
        Ok(())
    }

    /// A single-row state from `conv` and `ssm`, shaped like one row of this state; the error
    /// names what does not match.
    pub fn single_row(&self, conv: Tensor, ssm: Tensor) -> Result<RecurrentState> {
        for (name, t, like) in [("conv", &conv, &self.conv), ("ssm", &ssm, &self.ssm)] {
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
        Ok(Self { conv: conv.to_device(self.conv.device())?, ssm: ssm.to_device(self.ssm.device())?, round: None })
    }

    pub fn extract(&self, row: usize) -> Result<RecurrentState> {
        Ok(Self { conv: select_rows(&self.conv, &[row])?, ssm: select_rows(&self.ssm, &[row])?, round: None })
    }
}
