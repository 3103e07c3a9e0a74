//! Recurrent state in slots: per recurrent layer, one preallocated conv-window tensor
//! `[slots + 1, K-1, C]` and one recurrent-matrix tensor `[slots + 1, Hv, Dv, Dk]` (see
//! [`crate::StatePool`]); a row holds one slot of each layer. The last slot is the scratch slot.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use strata_kernels::rows;

use crate::pool::{grown, lock, tensor_bytes, Ids, Pool, PoolSize};
use crate::{RecurrentShape, Result, StateError};

/// One recurrent layer's slots.
#[derive(Debug)]
pub(crate) struct LayerSlots {
    conv: Tensor,
    ssm: Tensor,
    ids: Ids,
}

impl LayerSlots {
    pub(crate) fn new(shape: RecurrentShape, slots: usize, dtype: DType, device: &Device) -> Result<Self> {
        let (conv, ssm) = Self::tensors(&shape, slots, dtype, device)?;
        Ok(Self { conv, ssm, ids: Ids::new(slots) })
    }

    fn tensors(shape: &RecurrentShape, slots: usize, dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
        Ok((
            Tensor::zeros((slots + 1, shape.conv_kernel - 1, shape.conv_dim), dtype, device)?,
            Tensor::zeros((slots + 1, shape.value_heads, shape.value_dim, shape.key_dim), shape.ssm_dtype, device)?,
        ))
    }

    pub(crate) fn ids(&self) -> &Ids {
        &self.ids
    }

    pub(crate) fn bytes(&self) -> usize {
        tensor_bytes(&self.conv) + tensor_bytes(&self.ssm)
    }

    /// A free slot; a growing pool doubles when none is left (moving its tensors).
    fn take(&mut self, size: PoolSize, layer: usize) -> Result<u32> {
        if let Some(id) = self.ids.take() {
            return Ok(id);
        }
        let PoolSize::Growing = size else {
            return Err(StateError::PoolExhausted { what: "recurrent slots", layer, total: self.ids.len() });
        };
        let (old, new) = (self.ids.len(), grown(self.ids.len()));
        let shape = RecurrentShape {
            conv_kernel: self.conv.dim(1)? + 1,
            conv_dim: self.conv.dim(2)?,
            value_heads: self.ssm.dim(1)?,
            value_dim: self.ssm.dim(2)?,
            key_dim: self.ssm.dim(3)?,
            ssm_dtype: self.ssm.dtype(),
        };
        let (conv, ssm) = Self::tensors(&shape, new, self.conv.dtype(), self.conv.device())?;
        if old > 0 {
            conv.slice_set(&self.conv.narrow(0, 0, old)?, 0, 0)?;
            ssm.slice_set(&self.ssm.narrow(0, 0, old)?, 0, 0)?;
        }
        (self.conv, self.ssm) = (conv, ssm);
        self.ids.grow_to(new);
        Ok(self.ids.take().expect("grown above"))
    }
}

/// A row's slot in one layer. Cloning shares it; dropping releases it.
#[derive(Debug)]
struct Slot {
    pool: Arc<Pool>,
    layer: usize,
    id: u32,
}

impl Clone for Slot {
    fn clone(&self) -> Self {
        lock(&self.pool.recurrent[self.layer]).ids.share(self.id);
        Self { pool: self.pool.clone(), layer: self.layer, id: self.id }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.pool.recurrent[self.layer]).ids.release(self.id);
    }
}

/// The rows of one recurrent layer's [`crate::RecurrentState`] held in a pool's slots.
#[derive(Clone, Debug)]
pub(crate) struct SlottedRows {
    pub(crate) pool: Arc<Pool>,
    layer: usize,
    slots: Vec<Slot>,
}

/// What a device kernel needs to update a layer's slotted rows in place: the pool tensors and
/// each row's slot; `scratch` is a slot no row holds.
#[derive(Clone, Debug)]
pub struct SlotLayout {
    pub conv: Tensor,
    pub ssm: Tensor,
    pub slots: Vec<u32>,
    pub scratch: u32,
}

impl SlottedRows {
    /// `rows` rows, each in a fresh zeroed slot.
    pub(crate) fn new(pool: Arc<Pool>, layer: usize, rows: usize) -> Result<Self> {
        let mut slotted = Self { pool, layer, slots: Vec::with_capacity(rows) };
        for _ in 0..rows {
            let slot = slotted.take()?;
            slotted.slots.push(slot);
        }
        let ids = slotted.ids();
        let (conv, ssm) = slotted.pool_tensors();
        for t in [&conv, &ssm] {
            let mut dims = t.dims().to_vec();
            dims[0] = ids.len();
            rows::scatter(t, &ids, &Tensor::zeros(dims, t.dtype(), t.device())?)?;
        }
        Ok(slotted)
    }

    fn take(&self) -> Result<Slot> {
        let id = lock(&self.pool.recurrent[self.layer]).take(self.pool.slots, self.layer)?;
        Ok(Slot { pool: self.pool.clone(), layer: self.layer, id })
    }

    fn ids(&self) -> Vec<u32> {
        self.slots.iter().map(|s| s.id).collect()
    }

    pub(crate) fn pool_tensors(&self) -> (Tensor, Tensor) {
        let layer = lock(&self.pool.recurrent[self.layer]);
        (layer.conv.clone(), layer.ssm.clone())
    }

    pub(crate) fn rows(&self) -> usize {
        self.slots.len()
    }

    /// Bytes of one row's state.
    pub(crate) fn row_bytes(&self) -> usize {
        let layer = lock(&self.pool.recurrent[self.layer]);
        layer.bytes() / (layer.ids.len() + 1)
    }

    /// The rows' conv windows `[B, K-1, C]` and matrices `[B, Hv, Dv, Dk]`, copied out of their slots.
    pub(crate) fn gather(&self) -> Result<(Tensor, Tensor)> {
        let (conv, ssm) = self.pool_tensors();
        let ids = Tensor::from_vec(self.ids(), self.rows(), conv.device())?;
        Ok((conv.index_select(&ids, 0)?, ssm.index_select(&ids, 0)?))
    }

    /// Writes the rows' new state (`[B, ...]` each) into their slots, first moving a row whose
    /// slot is shared into one of its own.
    pub(crate) fn set(&mut self, conv: &Tensor, ssm: &Tensor) -> Result<()> {
        self.make_unique(false)?;
        let (pool_conv, pool_ssm) = self.pool_tensors();
        let ids = self.ids();
        rows::scatter(&pool_conv, &ids, &conv.to_dtype(pool_conv.dtype())?.contiguous()?)?;
        rows::scatter(&pool_ssm, &ids, &ssm.to_dtype(pool_ssm.dtype())?.contiguous()?)?;
        Ok(())
    }

    /// Gives every row whose slot another holder shares a slot of its own (copying its state
    /// into it when `copy`), so that writing a row's slot in place changes no other holder.
    pub(crate) fn make_unique(&mut self, copy: bool) -> Result<()> {
        for i in 0..self.slots.len() {
            if !lock(&self.pool.recurrent[self.layer]).ids.is_shared(self.slots[i].id) {
                continue;
            }
            let fresh = self.take()?;
            if copy {
                let (conv, ssm) = self.pool_tensors();
                for t in [&conv, &ssm] {
                    t.slice_set(&t.narrow(0, self.slots[i].id as usize, 1)?.force_contiguous()?, 0, fresh.id as usize)?;
                }
            }
            self.slots[i] = fresh;
        }
        Ok(())
    }

    /// The pool tensors and every row's slot, for a kernel that updates them in place; rows
    /// sharing a slot get their own first.
    pub(crate) fn layout(&mut self) -> Result<SlotLayout> {
        self.make_unique(true)?;
        let (conv, ssm) = self.pool_tensors();
        let scratch = lock(&self.pool.recurrent[self.layer]).ids.len() as u32;
        Ok(SlotLayout { conv, ssm, slots: self.ids(), scratch })
    }

    /// Appends `conv`, `ssm` (`[B, ...]`) as new rows, each in a slot of its own.
    pub(crate) fn push(&mut self, conv: &Tensor, ssm: &Tensor) -> Result<()> {
        let at = self.slots.len();
        for _ in 0..conv.dim(0)? {
            let slot = self.take()?;
            self.slots.push(slot);
        }
        let (pool_conv, pool_ssm) = self.pool_tensors();
        let ids = &self.ids()[at..];
        rows::scatter(&pool_conv, ids, &conv.to_dtype(pool_conv.dtype())?.contiguous()?)?;
        rows::scatter(&pool_ssm, ids, &ssm.to_dtype(pool_ssm.dtype())?.contiguous()?)?;
        Ok(())
    }

    /// Whether `other` stores the same layer of the same pool.
    pub(crate) fn same_pool(&self, other: &SlottedRows) -> bool {
        Arc::ptr_eq(&self.pool, &other.pool) && self.layer == other.layer
    }

    /// Appends `other`'s rows, sharing their slots.
    pub(crate) fn merge(&mut self, other: &SlottedRows) {
        self.slots.extend(other.slots.iter().cloned());
    }

    pub(crate) fn filter(&mut self, keep: &[usize]) {
        self.slots = keep.iter().map(|&r| self.slots[r].clone()).collect();
    }

    /// One single-row set per row, each with its row's slot.
    pub(crate) fn split(self) -> Vec<SlottedRows> {
        let (pool, layer) = (self.pool, self.layer);
        self.slots.into_iter().map(|slot| SlottedRows { pool: pool.clone(), layer, slots: vec![slot] }).collect()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::spec::{LayerSpec, StateSpec};
    use crate::{BatchState, LayerState, PoolSize, RecurrentState, StatePool};

    const SHAPE: RecurrentShape =
        RecurrentShape { conv_kernel: 3, conv_dim: 4, value_heads: 2, value_dim: 3, key_dim: 2, ssm_dtype: DType::F32 };

    fn spec() -> StateSpec {
        StateSpec { layers: vec![LayerSpec::Recurrent(SHAPE)], dtype: DType::F32, kv: crate::KvPolicy::default() }
    }

    fn recurrent(state: &mut BatchState) -> &mut RecurrentState {
        match &mut state.layers[0] {
            LayerState::Recurrent(s) => s,
            _ => unreachable!("one recurrent layer"),
        }
    }

    /// `rows` rows of distinct values.
    fn values(rows: usize, seed: f32) -> (Tensor, Tensor) {
        let n = |dims: &[usize]| dims.iter().product::<usize>();
        let ramp = |dims: &[usize]| {
            let data: Vec<f32> = (0..n(dims)).map(|i| seed + i as f32 / 8.0).collect();
            Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
        };
        (ramp(&[rows, 2, 4]), ramp(&[rows, 2, 3, 2]))
    }

    fn same(a: &RecurrentState, b: &RecurrentState) -> bool {
        let bits = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let ((ac, as_), (bc, bs)) = (a.tensors().unwrap(), b.tensors().unwrap());
        bits(ac) == bits(bc) && bits(as_) == bits(bs)
    }

    /// Rows in slots hold the bits rows in tensors of their own hold, through writes, filters,
    /// merges and extracts; a clone shares its slots until written (copy on write); the pool
    /// says when its slots are all taken, and a dropped state gives its slots back.
    #[test]
    fn slotted_rows_hold_what_owned_rows_hold() {
        let pool = StatePool::new(&spec(), 16, PoolSize::Fixed(0), PoolSize::Fixed(4), &Device::Cpu).unwrap();
        let (mut slotted, mut owned) = (pool.new_state(2).unwrap(), spec().new_state(2, &Device::Cpu).unwrap());
        assert!(same(recurrent(&mut slotted), recurrent(&mut owned)), "fresh rows are zero in both");
        for state in [&mut slotted, &mut owned] {
            let (conv, ssm) = values(2, 1.0);
            recurrent(state).set(conv, ssm).unwrap();
        }
        assert!(same(recurrent(&mut slotted), recurrent(&mut owned)));

        let mut clone = slotted.clone();
        assert_eq!(pool.stats().slots_used, 2, "a clone shares its slots");
        let (conv, ssm) = values(2, 50.0);
        recurrent(&mut clone).set(conv, ssm).unwrap();
        assert_eq!(pool.stats().slots_used, 4, "writing a shared slot copies it first");
        assert!(same(recurrent(&mut slotted), recurrent(&mut owned)), "the original is untouched by its clone's write");
        assert!(matches!(pool.new_state(1), Err(StateError::PoolExhausted { total: 4, .. })));
        drop(clone);
        assert_eq!(pool.stats().slots_used, 2, "dropped rows give their slots back");

        let (conv, ssm) = values(1, -7.0);
        let mut one = spec().new_state(1, &Device::Cpu).unwrap();
        recurrent(&mut one).set(conv, ssm).unwrap();
        for state in [&mut slotted, &mut owned] {
            state.filter(&[1]).unwrap();
            state.merge(&one).unwrap();
        }
        assert_eq!(pool.stats().slots_used, 2, "a filtered row left, a merged one took a slot");
        assert!(same(recurrent(&mut slotted), recurrent(&mut owned)));
        for row in 0..2 {
            let (a, b) = (slotted.extract(row).unwrap(), owned.extract(row).unwrap());
            let LayerState::Recurrent(a) = &a.layers[0] else { unreachable!() };
            let LayerState::Recurrent(b) = &b.layers[0] else { unreachable!() };
            assert!(a.slotted_rows().is_none(), "an extract owns its tensors");
            assert!(same(a, b), "row {row}");
        }
    }
}
