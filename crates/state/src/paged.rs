//! Paged attention KV: per full-attention layer, one preallocated tensor of fixed-size blocks
//! (see [`crate::StatePool`]), and per row a block table naming the blocks that hold its
//! positions.
//!
//! Position `p` of a row lives in pool row `table[p / block_size] * block_size + p % block_size`
//! of the layer's key and value tensors (`[blocks * block_size, Hkv, width]`, token-major, as the
//! CUDA kernels read them; `width` is the head dimension, or a code's bytes for quantized KV).

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::format::KvCoding;
use crate::pool::{grown, lock, tensor_bytes, Ids, Pool, PoolSize};
use crate::spec::KvShape;
use crate::{KvPart, Result, StateError};
use strata_kernels::kv_quant::LayerCodes;

/// One attention layer's blocks: its key and value tensors, plus one scratch block past them.
#[derive(Debug)]
pub(crate) struct LayerBlocks {
    shape: KvShape,
    pub(crate) coding: KvCoding,
    /// `[(blocks + 1) * block_size, Hkv, width]` each; the last block is the scratch block.
    k: Tensor,
    v: Tensor,
    ids: Ids,
    block_size: usize,
}

impl LayerBlocks {
    pub(crate) fn new(shape: KvShape, coding: KvCoding, blocks: usize, block_size: usize, device: &Device) -> Result<Self> {
        let mut layer = Self {
            shape,
            k: Tensor::zeros(0, DType::U8, device)?,
            v: Tensor::zeros(0, DType::U8, device)?,
            coding,
            ids: Ids::new(blocks),
            block_size,
        };
        (layer.k, layer.v) = (layer.zeros(blocks, KvPart::Keys, device)?, layer.zeros(blocks, KvPart::Values, device)?);
        Ok(layer)
    }

    /// A `part` tensor of `blocks` blocks and the scratch block.
    fn zeros(&self, blocks: usize, part: KvPart, device: &Device) -> Result<Tensor> {
        let dims = ((blocks + 1) * self.block_size, self.shape.kv_heads, self.coding.width(&self.shape, part));
        Ok(Tensor::zeros(dims, self.coding.stored_dtype(), device)?)
    }

    pub(crate) fn ids(&self) -> &Ids {
        &self.ids
    }

    pub(crate) fn bytes(&self) -> usize {
        tensor_bytes(&self.k) + tensor_bytes(&self.v)
    }

    fn take(&mut self, size: PoolSize, layer: usize) -> Result<u32> {
        if let Some(id) = self.ids.take() {
            return Ok(id);
        }
        match size {
            PoolSize::Fixed(blocks) => Err(StateError::PoolExhausted { what: "KV blocks", layer, total: blocks }),
            PoolSize::Growing => {
                self.grow()?;
                Ok(self.ids.take().expect("grown above"))
            }
        }
    }

    /// Doubles the pool (at least 16 blocks), keeping every block's contents and id (the scratch
    /// block moves to the new end; what it holds is nobody's).
    fn grow(&mut self) -> Result<()> {
        let (old, new) = (self.ids.len(), grown(self.ids.len()));
        let device = self.k.device().clone();
        let (k, v) = (self.zeros(new, KvPart::Keys, &device)?, self.zeros(new, KvPart::Values, &device)?);
        if old > 0 {
            k.slice_set(&self.k.narrow(0, 0, old * self.block_size)?, 0, 0)?;
            v.slice_set(&self.v.narrow(0, 0, old * self.block_size)?, 0, 0)?;
        }
        (self.k, self.v) = (k, v);
        self.ids.grow_to(new);
        Ok(())
    }

    /// Copies block `from`'s positions into block `to`.
    fn copy_block(&self, from: u32, to: u32) -> Result<()> {
        let bs = self.block_size;
        for t in [&self.k, &self.v] {
            let src = t.narrow(0, from as usize * bs, bs)?.force_contiguous()?;
            t.slice_set(&src, 0, to as usize * bs)?;
        }
        Ok(())
    }
}

/// One row's blocks in one layer. Cloning shares them; dropping releases them.
#[derive(Debug)]
struct BlockTable {
    pool: Arc<Pool>,
    layer: usize,
    blocks: Vec<u32>,
}

impl Clone for BlockTable {
    fn clone(&self) -> Self {
        let mut layer = lock(&self.pool.kv[self.layer]);
        self.blocks.iter().for_each(|&id| layer.ids.share(id));
        Self { pool: self.pool.clone(), layer: self.layer, blocks: self.blocks.clone() }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        let mut layer = lock(&self.pool.kv[self.layer]);
        self.blocks.drain(..).for_each(|id| layer.ids.release(id));
    }
}

#[derive(Clone, Debug)]
struct PagedRow {
    table: BlockTable,
    len: usize,
}

/// The rows of one attention layer's [`crate::KvStore`] held in a pool.
#[derive(Clone, Debug)]
pub(crate) struct PagedRows {
    pub(crate) pool: Arc<Pool>,
    layer: usize,
    rows: Vec<PagedRow>,
}

/// What a device kernel needs to read and write a layer's paged rows in place: the pool tensors,
/// the block size, and per row its blocks and length; `scratch` is a block no row holds.
#[derive(Clone, Debug)]
pub struct PagedLayout {
    pub keys: Tensor,
    pub values: Tensor,
    pub block_size: usize,
    pub tables: Vec<Vec<u32>>,
    pub lens: Vec<usize>,
    pub scratch: u32,
    /// How the pool tensors are coded where they hold quantized KV (see `format.rs`).
    pub codes: Option<LayerCodes>,
}

impl PagedRows {
    pub(crate) fn new(pool: Arc<Pool>, layer: usize, rows: usize) -> Self {
        let mut paged = Self { pool, layer, rows: Vec::with_capacity(rows) };
        (0..rows).for_each(|_| paged.push_empty());
        paged
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows.len()
    }

    pub(crate) fn len(&self, row: usize) -> usize {
        self.rows[row].len
    }

    pub(crate) fn lens(&self) -> impl Iterator<Item = usize> + '_ {
        self.rows.iter().map(|r| r.len)
    }

    /// Positions the blocks held by every row have room for.
    pub(crate) fn held_positions(&self) -> usize {
        self.rows.iter().map(|r| r.table.blocks.len()).sum::<usize>() * self.pool.block_size
    }

    pub(crate) fn push_empty(&mut self) {
        self.rows.push(PagedRow { table: BlockTable { pool: self.pool.clone(), layer: self.layer, blocks: Vec::new() }, len: 0 });
    }

    /// Makes `row`'s blocks for positions `len .. len + t` its own: takes blocks past its
    /// table, and copies a shared block the positions land in first. On an error (the pool is
    /// full) the row keeps what it held, with at most some unused blocks more.
    pub(crate) fn reserve(&mut self, row: usize, t: usize) -> Result<()> {
        let bs = self.pool.block_size;
        let r = &mut self.rows[row];
        let mut layer = lock(&self.pool.kv[self.layer]);
        for i in r.len / bs..(r.len + t).div_ceil(bs) {
            if i == r.table.blocks.len() {
                let id = layer.take(self.pool.blocks, self.layer)?;
                r.table.blocks.push(id);
            } else if layer.ids.is_shared(r.table.blocks[i]) {
                let (shared, id) = (r.table.blocks[i], layer.take(self.pool.blocks, self.layer)?);
                layer.copy_block(shared, id)?;
                layer.ids.release(shared);
                r.table.blocks[i] = id;
            }
        }
        Ok(())
    }

    /// Blocks [`PagedRows::reserve_rows`]`(t)` would take from the pool: new ones past the rows'
    /// tables, and copies of shared ones the positions land in.
    pub(crate) fn blocks_to_reserve(&self, t: usize) -> usize {
        let bs = self.pool.block_size;
        let layer = lock(&self.pool.kv[self.layer]);
        let row_needs = |r: &PagedRow| {
            let needed = r.len / bs..(r.len + t).div_ceil(bs);
            needed.filter(|&i| r.table.blocks.get(i).is_none_or(|&id| layer.ids.is_shared(id))).count()
        };
        self.rows.iter().map(row_needs).sum()
    }

    /// Room for `t` more positions in every row (see [`PagedRows::reserve`]).
    pub(crate) fn reserve_rows(&mut self, t: usize) -> Result<()> {
        (0..self.rows()).try_for_each(|row| self.reserve(row, t))
    }

    /// Counts `t` more positions in every row, written into its blocks by a device kernel.
    pub(crate) fn commit_written(&mut self, t: usize) -> Result<()> {
        let bs = self.pool.block_size;
        if let Some(r) = self.rows.iter().find(|r| r.len + t > r.table.blocks.len() * bs) {
            return Err(StateError::PastCapacity { len: r.len, written: t, capacity: r.table.blocks.len() * bs });
        }
        self.rows.iter_mut().for_each(|r| r.len += t);
        Ok(())
    }

    /// The pool tensors and every row's blocks, for a kernel that writes and reads them in place.
    pub(crate) fn layout(&self) -> PagedLayout {
        let layer = lock(&self.pool.kv[self.layer]);
        PagedLayout {
            keys: layer.k.clone(),
            values: layer.v.clone(),
            block_size: self.pool.block_size,
            tables: self.rows.iter().map(|r| r.table.blocks.clone()).collect(),
            lens: self.lens().collect(),
            scratch: layer.ids.len() as u32,
            codes: None,
        }
    }

    /// Writes `k`, `v` (`[Hkv, T, width]`, as stored) after `row`'s positions.
    pub(crate) fn append(&mut self, row: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let t = k.dim(1)?;
        self.reserve(row, t)?;
        let bs = self.pool.block_size;
        let r = &mut self.rows[row];
        let layer = lock(&self.pool.kv[self.layer]);
        let (k, v) = (k.transpose(0, 1)?.contiguous()?, v.transpose(0, 1)?.contiguous()?);
        let mut done = 0;
        while done < t {
            let at = r.len + done;
            let n = (bs - at % bs).min(t - done);
            let to = r.table.blocks[at / bs] as usize * bs + at % bs;
            layer.k.slice_set(&k.narrow(0, done, n)?, 0, to)?;
            layer.v.slice_set(&v.narrow(0, done, n)?, 0, to)?;
            done += n;
        }
        r.len += t;
        Ok(())
    }

    /// Copies of `row`'s stored keys and values, `[Hkv, len, width]` contiguous.
    pub(crate) fn history(&self, row: usize) -> Result<(Tensor, Tensor)> {
        let (bs, r) = (self.pool.block_size, &self.rows[row]);
        let ids: Vec<u32> = (0..r.len).map(|p| r.table.blocks[p / bs] * bs as u32 + (p % bs) as u32).collect();
        let layer = lock(&self.pool.kv[self.layer]);
        let ids = Tensor::from_vec(ids, r.len, layer.k.device())?;
        let gather = |t: &Tensor| -> Result<Tensor> { Ok(t.index_select(&ids, 0)?.transpose(0, 1)?.contiguous()?) };
        Ok((gather(&layer.k)?, gather(&layer.v)?))
    }

    /// Every row's stored keys and values as one batch `[B, Hkv, len, width]` (one gather), when
    /// the rows are equally long; `None` otherwise.
    pub(crate) fn stacked_history(&self) -> Result<Option<(Tensor, Tensor)>> {
        let (bs, len) = (self.pool.block_size, self.rows.first().map_or(0, |r| r.len));
        if self.rows.iter().any(|r| r.len != len) {
            return Ok(None);
        }
        let ids: Vec<u32> =
            self.rows.iter().flat_map(|r| (0..len).map(move |p| r.table.blocks[p / bs] * bs as u32 + (p % bs) as u32)).collect();
        let layer = lock(&self.pool.kv[self.layer]);
        let ids = Tensor::from_vec(ids, self.rows.len() * len, layer.k.device())?;
        let gather = |t: &Tensor| -> Result<Tensor> {
            let (_, heads, width) = t.dims3()?;
            Ok(t.index_select(&ids, 0)?.reshape((self.rows.len(), len, heads, width))?.transpose(1, 2)?.contiguous()?)
        };
        Ok(Some((gather(&layer.k)?, gather(&layer.v)?)))
    }

    /// Cuts `row` back to `len` positions, releasing the blocks past them.
    pub(crate) fn trim(&mut self, row: usize, len: usize) -> Result<()> {
        let r = &mut self.rows[row];
        if len > r.len {
            return Err(StateError::Untrimmable { kind: "attention KV", from: r.len, to: len });
        }
        let mut layer = lock(&self.pool.kv[self.layer]);
        r.table.blocks.drain(len.div_ceil(self.pool.block_size)..).for_each(|id| layer.ids.release(id));
        r.len = len;
        Ok(())
    }

    /// Whether `other` stores the same layer of the same pool.
    pub(crate) fn same_pool(&self, other: &PagedRows) -> bool {
        Arc::ptr_eq(&self.pool, &other.pool) && self.layer == other.layer
    }

    /// Appends `other`'s rows, sharing their blocks.
    pub(crate) fn merge(&mut self, other: &PagedRows) {
        self.rows.extend(other.rows.iter().cloned());
    }

    pub(crate) fn filter(&mut self, keep: &[usize]) {
        self.rows = keep.iter().map(|&r| self.rows[r].clone()).collect();
    }

    /// One single-row set per row, each with its row's blocks.
    pub(crate) fn split(&self) -> Vec<PagedRows> {
        (0..self.rows.len()).map(|r| self.row(r)).collect()
    }

    /// Row `row` alone, sharing its blocks.
    pub(crate) fn row(&self, row: usize) -> PagedRows {
        PagedRows { pool: self.pool.clone(), layer: self.layer, rows: vec![self.rows[row].clone()] }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{LayerSpec, StateSpec};
    use crate::{BatchState, KvStore, LayerState, PoolStats, RecurrentShape, StatePool};

    const HEADS: usize = 2;
    const DIM: usize = 3;

    fn spec() -> StateSpec {
        let kv = KvShape { kv_heads: HEADS, head_dim: DIM };
        let recurrent =
            RecurrentShape { conv_kernel: 2, conv_dim: 2, value_heads: 1, value_dim: 1, key_dim: 1, ssm_dtype: DType::F32 };
        StateSpec {
            layers: vec![LayerSpec::Attention(kv), LayerSpec::Recurrent(recurrent), LayerSpec::Attention(kv)],
            dtype: DType::F32,
            kv: crate::KvPolicy::default(),
        }
    }

    fn values(t: usize, seed: usize) -> Tensor {
        let data: Vec<f32> = (0..HEADS * t * DIM).map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 / 7.0).collect();
        Tensor::from_vec(data, (HEADS, t, DIM), &Device::Cpu).unwrap()
    }

    fn attention(state: &mut BatchState, layer: usize) -> &mut KvStore {
        match &mut state.layers[layer] {
            LayerState::Attention(kv) => kv,
            _ => unreachable!("layers 0 and 2 are attention"),
        }
    }

    fn same(a: &Tensor, b: &Tensor) -> bool {
        a.dims() == b.dims()
            && a.flatten_all().unwrap().to_vec1::<f32>().unwrap() == b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// Rows fed chunks of uneven lengths (crossing block boundaries at every block size) hold
    /// the same bits in the pool as in contiguous buffers, through appends, trims, filters and
    /// merges.
    #[test]
    fn paged_rows_hold_what_contiguous_rows_hold() {
        for block_size in [1, 16, 64] {
            let pool =
                StatePool::new(&spec(), block_size, PoolSize::Fixed(4096 / block_size), PoolSize::Growing, &Device::Cpu).unwrap();
            let mut paged = pool.new_state(3).unwrap();
            let mut plain = spec().new_state(3, &Device::Cpu).unwrap();
            let mut seed = 0;
            for (row, t) in [(0, 1), (1, 17), (2, 70), (0, 15), (1, 1), (2, 64), (0, 33), (1, 47)] {
                for layer in [0, 2] {
                    seed += 1;
                    let (k, v) = (values(t, seed), values(t, seed + 1000));
                    let (pk, pv) = attention(&mut paged, layer).append(row, &k, &v).unwrap();
                    let (ck, cv) = attention(&mut plain, layer).append(row, &k, &v).unwrap();
                    assert!(same(&pk, &ck) && same(&pv, &cv), "block size {block_size}, row {row}");
                }
            }
            for state in [&mut paged, &mut plain] {
                state.positions = vec![49, 65, 134];
                for layer in [0, 2] {
                    attention(state, layer).trim(2, 100).unwrap();
                }
                state.filter(&[2, 0]).unwrap();
            }
            paged.merge(&pool.new_state(1).unwrap()).unwrap();
            plain.merge(&spec().new_state(1, &Device::Cpu).unwrap()).unwrap();
            for (row, t) in [(0, 30), (1, 16), (2, 5)] {
                let (k, v) = (values(t, row), values(t, row + 7));
                let (pk, pv) = attention(&mut paged, 2).append(row, &k, &v).unwrap();
                let (ck, cv) = attention(&mut plain, 2).append(row, &k, &v).unwrap();
                assert!(same(&pk, &ck) && same(&pv, &cv), "block size {block_size}, row {row} after trim, filter, merge");
            }
            let used = pool.stats().blocks_used;
            let want: usize = [100usize, 49].iter().map(|len| len.div_ceil(block_size)).sum();
            assert_eq!(used, want, "layer 0's rows hold their blocks and no more (block size {block_size})");
            drop(paged);
            assert_eq!(pool.stats().blocks_used, 0, "dropped rows give every block back");
        }
    }

    /// A cloned row shares its blocks; writing to either copies the partly filled last block,
    /// and neither sees the other's writes.
    /// Merging single-row states into one batch and splitting it back moves every row's
    /// blocks and slot: nothing is copied or left shared, and each row reads what it held, in
    /// the pool as in buffers of its own.
    #[test]
    fn a_merged_batch_splits_back_into_its_rows_without_copies() {
        let pool = StatePool::new(&spec(), 16, PoolSize::Fixed(64), PoolSize::Fixed(3), &Device::Cpu).unwrap();
        for pooled in [true, false] {
            let fresh = || if pooled { pool.new_state(1).unwrap() } else { spec().new_state(1, &Device::Cpu).unwrap() };
            let mut batch = if pooled { pool.new_state(0).unwrap() } else { spec().new_state(0, &Device::Cpu).unwrap() };
            for (row, len) in [20, 1, 40].into_iter().enumerate() {
                let mut one = fresh();
                attention(&mut one, 2).append(0, &values(len, row), &values(len, row + 9)).unwrap();
                one.positions = vec![len];
                batch.merge(&one).unwrap();
            }
            let before: Vec<Tensor> = (0..3).map(|r| attention(&mut batch, 2).history(r).unwrap().0).collect();
            let used = pool.stats();
            let rows = batch.split().unwrap();
            assert_eq!(rows.iter().map(|r| r.positions.clone()).collect::<Vec<_>>(), [[20], [1], [40]]);
            assert_eq!(pool.stats(), PoolStats { blocks_shared: 0, ..used }, "nothing copied, nothing left shared");
            for (mut row, want) in rows.into_iter().zip(&before) {
                assert_eq!(row.rows(), 1);
                assert!(same(&attention(&mut row, 2).history(0).unwrap().0, want));
            }
            assert_eq!(pool.stats().blocks_used, 0, "every block came back with its row");
        }
    }

    #[test]
    fn shared_blocks_are_copied_on_write() {
        let pool = StatePool::new(&spec(), 16, PoolSize::Fixed(8), PoolSize::Fixed(2), &Device::Cpu).unwrap();
        let mut a = pool.new_state(1).unwrap();
        attention(&mut a, 0).append(0, &values(20, 1), &values(20, 2)).unwrap();
        let mut b = a.clone();
        assert_eq!((pool.stats().blocks_used, pool.stats().blocks_shared), (2, 2));
        let (before, _) = attention(&mut a, 0).history(0).unwrap();
        // b's next position lands in the shared second block (a copy); 13 more cross into a
        // third block (one more).
        assert_eq!((b.blocks_to_grow(1), b.blocks_to_grow(13), a.blocks_to_grow(12)), (1, 2, 1));
        attention(&mut b, 0).append(0, &values(1, 3), &values(1, 4)).unwrap();
        assert_eq!(b.blocks_to_grow(1), 0, "b's last block is its own now");
        assert_eq!(
            pool.stats(),
            PoolStats {
                block_size: 16,
                blocks_total: 8,
                blocks_used: 3,
                blocks_used_peak: 3,
                blocks_shared: 1,
                slots_total: 2,
                slots_used: 1,
                kv_format: crate::KvFormat::Auto,
                kv_bytes_per_token: 2 * 2 * HEADS * DIM * 4,
                window_kv_bytes_per_token: 0,
                delayed_bytes_per_token: 0,
                delayed_positions: 0,
                // The recurrent layer's conv window (1 × 2 f32) and matrix (1 × 1 × 1 f32).
                recurrent_bytes_per_row: 2 * 4 + 4,
            }
        );
        let (after, _) = attention(&mut a, 0).history(0).unwrap();
        assert!(same(&before, &after), "the original is untouched by its clone's write");
        let (bk, _) = attention(&mut b, 0).history(0).unwrap();
        assert!(same(&bk.narrow(1, 0, 20).unwrap(), &before) && same(&bk.narrow(1, 20, 1).unwrap(), &values(1, 3)));
    }

    #[test]
    fn a_fixed_pool_says_when_it_is_full_and_a_growing_one_grows() {
        let pool = StatePool::new(&spec(), 4, PoolSize::Fixed(2), PoolSize::Fixed(1), &Device::Cpu).unwrap();
        let mut state = pool.new_state(1).unwrap();
        attention(&mut state, 0).append(0, &values(8, 1), &values(8, 1)).unwrap();
        let full = attention(&mut state, 0).append(0, &values(1, 2), &values(1, 2));
        assert!(matches!(full, Err(StateError::PoolExhausted { total: 2, .. })), "{full:?}");
        let (k, _) = attention(&mut state, 0).history(0).unwrap();
        assert!(same(&k, &values(8, 1)), "a refused write leaves the row as it was");

        let pool = StatePool::new(&spec(), 4, PoolSize::Growing, PoolSize::Growing, &Device::Cpu).unwrap();
        let mut state = pool.new_state(1).unwrap();
        let (k, _) = attention(&mut state, 0).append(0, &values(100, 1), &values(100, 1)).unwrap();
        assert!(same(&k, &values(100, 1)));
        assert_eq!(pool.stats().blocks_used, 25);
    }
}
