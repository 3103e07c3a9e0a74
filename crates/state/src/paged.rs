//! Paged attention KV: one preallocated pool of fixed-size blocks per attention layer, and per
//! row a block table naming the blocks that hold its positions.
//!
//! Position `p` of a row lives in pool row `table[p / block_size] * block_size + p % block_size`
//! of the layer's key and value tensors (`[blocks * block_size, Hkv, D]`, token-major, as the
//! CUDA kernels read them). A row joining, leaving or growing changes block tables, never the
//! pool tensors, so their addresses stay put. Blocks are reference-counted: cloning a row
//! shares its blocks, and a write into a shared block first copies it (copy on write), so a
//! clone keeps value semantics while holding its prefix once.
//!
//! Each attention layer has its own blocks and block tables: a layer's table is independent of
//! the others', so every store answers for itself (and the pool's counts are those of its
//! first layer, which every layer repeats, since all are fed the same positions).

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor};

use crate::spec::{KvShape, LayerSpec, StateSpec};
use crate::{BatchState, LayerState, Result, StateError};

/// How many blocks a pool holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolSize {
    /// Exactly this many per layer, allocated at start; a write past them is
    /// [`StateError::PoolExhausted`].
    Fixed(usize),
    /// As many as the rows need: the pool doubles when it runs out (moving its tensors, so not
    /// for captured CUDA graphs; for one-off runs that were not given a memory size).
    Growing,
}

/// A model's attention KV blocks: the pool a [`BatchState`] built by [`KvPool::new_state`]
/// stores its full-attention layers in. Cheap to clone (a handle).
#[derive(Clone, Debug)]
pub struct KvPool {
    pool: Arc<Pool>,
}

#[derive(Debug)]
struct Pool {
    spec: StateSpec,
    device: Device,
    block_size: usize,
    size: PoolSize,
    /// One per [`LayerSpec::Attention`] layer of the spec, in order.
    layers: Vec<Mutex<LayerBlocks>>,
}

#[derive(Debug)]
struct LayerBlocks {
    shape: KvShape,
    /// `[blocks * block_size, Hkv, D]` each.
    k: Tensor,
    v: Tensor,
    /// Holders of each block (row tables); 0 = free.
    refs: Vec<u32>,
    /// Free block ids, the next to hand out last.
    free: Vec<u32>,
    used_peak: usize,
}

/// What a pool holds, for `/stats` and `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolStats {
    pub block_size: usize,
    pub blocks_total: usize,
    pub blocks_used: usize,
    pub blocks_used_peak: usize,
    /// Blocks held by more than one row.
    pub blocks_shared: usize,
}

impl KvPool {
    /// A pool for `spec`'s attention layers on `device`, in blocks of `block_size` positions.
    pub fn new(spec: &StateSpec, block_size: usize, size: PoolSize, device: &Device) -> Result<Self> {
        if block_size == 0 {
            return Err(StateError::BadPart("a KV block of 0 positions".into()));
        }
        let blocks = match size {
            PoolSize::Fixed(blocks) => blocks,
            PoolSize::Growing => 0,
        };
        let layers = spec
            .layers
            .iter()
            .filter_map(|layer| match layer {
                LayerSpec::Attention(shape) => Some(LayerBlocks::new(*shape, blocks, block_size, spec.dtype, device)),
                _ => None,
            })
            .map(|layer| layer.map(Mutex::new))
            .collect::<Result<_>>()?;
        Ok(Self { pool: Arc::new(Pool { spec: spec.clone(), device: device.clone(), block_size, size, layers }) })
    }

    /// Blocks that hold every row a state budget of `budget` bytes admits, for at most `rows`
    /// rows at once: the positions the budget pays for (at its attention layers' cost per
    /// position, a bound whatever else the rows hold), plus per row one partly filled block and
    /// room for a speculative round's positions past its length ([`crate::ROUND_SLACK`]).
    pub fn blocks_for_budget(spec: &StateSpec, block_size: usize, budget: usize, rows: usize) -> usize {
        let per_token: usize = spec
            .layers
            .iter()
            .filter_map(|layer| match layer {
                LayerSpec::Attention(shape) => Some(shape.bytes_per_token(spec.dtype)),
                _ => None,
            })
            .sum();
        let paid = (budget / per_token.max(1)).div_ceil(block_size);
        paid + rows * (1 + crate::ROUND_SLACK.div_ceil(block_size))
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size
    }

    /// Fresh state for `rows` empty sequences: full-attention layers in this pool, the others
    /// as the spec declares them.
    pub fn new_state(&self, rows: usize) -> Result<BatchState> {
        let mut state = self.pool.spec.new_state(rows, &self.pool.device)?;
        let mut layer = 0;
        for slot in &mut state.layers {
            if let LayerState::Attention(store) = slot {
                let paged = PagedRows { pool: self.pool.clone(), layer, rows: Vec::new() };
                *store = store.clone().into_paged(paged, rows);
                layer += 1;
            }
        }
        Ok(state)
    }

    pub fn stats(&self) -> PoolStats {
        let Some(first) = self.pool.layers.first() else {
            return PoolStats { block_size: self.pool.block_size, ..PoolStats::default() };
        };
        let blocks = lock(first);
        PoolStats {
            block_size: self.pool.block_size,
            blocks_total: blocks.refs.len(),
            blocks_used: blocks.refs.len() - blocks.free.len(),
            blocks_used_peak: blocks.used_peak,
            blocks_shared: blocks.refs.iter().filter(|&&r| r > 1).count(),
        }
    }
}

fn lock(layer: &Mutex<LayerBlocks>) -> MutexGuard<'_, LayerBlocks> {
    // A panic while holding the lock leaves counts, not tensors, half-updated at worst; the
    // counts are only ever changed in whole steps below, so the data is still consistent.
    layer.lock().unwrap_or_else(|e| e.into_inner())
}

impl LayerBlocks {
    fn new(shape: KvShape, blocks: usize, block_size: usize, dtype: DType, device: &Device) -> Result<Self> {
        let dims = (blocks * block_size, shape.kv_heads, shape.head_dim);
        Ok(Self {
            shape,
            k: Tensor::zeros(dims, dtype, device)?,
            v: Tensor::zeros(dims, dtype, device)?,
            refs: vec![0; blocks],
            free: (0..blocks as u32).rev().collect(),
            used_peak: 0,
        })
    }

    fn take(&mut self, pool: &Pool, layer: usize) -> Result<u32> {
        if self.free.is_empty() {
            match pool.size {
                PoolSize::Fixed(blocks) => return Err(StateError::PoolExhausted { layer, blocks }),
                PoolSize::Growing => self.grow(pool.block_size)?,
            }
        }
        let id = self.free.pop().expect("grown above");
        self.refs[id as usize] = 1;
        self.used_peak = self.used_peak.max(self.refs.len() - self.free.len());
        Ok(id)
    }

    fn release(&mut self, id: u32) {
        let refs = &mut self.refs[id as usize];
        *refs -= 1;
        if *refs == 0 {
            self.free.push(id);
        }
    }

    /// Doubles the pool (at least 16 blocks), keeping every block's contents and id.
    fn grow(&mut self, block_size: usize) -> Result<()> {
        let (old, new) = (self.refs.len(), (2 * self.refs.len()).max(16));
        let dims = (new * block_size, self.shape.kv_heads, self.shape.head_dim);
        let (k, v) =
            (Tensor::zeros(dims, self.k.dtype(), self.k.device())?, Tensor::zeros(dims, self.v.dtype(), self.v.device())?);
        if old > 0 {
            k.slice_set(&self.k, 0, 0)?;
            v.slice_set(&self.v, 0, 0)?;
        }
        (self.k, self.v) = (k, v);
        self.refs.resize(new, 0);
        self.free.extend((old as u32..new as u32).rev());
        Ok(())
    }

    /// Copies block `from`'s positions into block `to`.
    fn copy_block(&self, from: u32, to: u32, block_size: usize) -> Result<()> {
        for t in [&self.k, &self.v] {
            let src = t.narrow(0, from as usize * block_size, block_size)?.force_contiguous()?;
            t.slice_set(&src, 0, to as usize * block_size)?;
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
        let mut layer = lock(&self.pool.layers[self.layer]);
        for &id in &self.blocks {
            layer.refs[id as usize] += 1;
        }
        Self { pool: self.pool.clone(), layer: self.layer, blocks: self.blocks.clone() }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        let mut layer = lock(&self.pool.layers[self.layer]);
        self.blocks.drain(..).for_each(|id| layer.release(id));
    }
}

#[derive(Clone, Debug)]
struct PagedRow {
    table: BlockTable,
    len: usize,
}

/// The rows of one attention layer's [`KvStore`] held in a pool.
#[derive(Clone, Debug)]
pub(crate) struct PagedRows {
    pool: Arc<Pool>,
    layer: usize,
    rows: Vec<PagedRow>,
}

impl PagedRows {
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

    /// Writes `k`, `v` (`[Hkv, T, D]`) after `row`'s positions: takes blocks as needed and
    /// copies any shared block the write lands in first.
    pub(crate) fn append(&mut self, row: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let bs = self.pool.block_size;
        let t = k.dim(1)?;
        let r = &mut self.rows[row];
        let mut layer = lock(&self.pool.layers[self.layer]);
        let (first, last) = (r.len / bs, (r.len + t).div_ceil(bs));
        for i in first..last {
            if i == r.table.blocks.len() {
                let id = layer.take(&self.pool, self.layer)?;
                r.table.blocks.push(id);
            } else if layer.refs[r.table.blocks[i] as usize] > 1 {
                let (shared, id) = (r.table.blocks[i], layer.take(&self.pool, self.layer)?);
                layer.copy_block(shared, id, bs)?;
                layer.release(shared);
                r.table.blocks[i] = id;
            }
        }
        let dtype = layer.k.dtype();
        let (k, v) = (k.to_dtype(dtype)?.transpose(0, 1)?.contiguous()?, v.to_dtype(dtype)?.transpose(0, 1)?.contiguous()?);
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

    /// Copies of `row`'s stored keys and values, `[Hkv, len, D]` contiguous.
    pub(crate) fn history(&self, row: usize) -> Result<(Tensor, Tensor)> {
        let (bs, r) = (self.pool.block_size, &self.rows[row]);
        let ids: Vec<u32> = (0..r.len).map(|p| r.table.blocks[p / bs] * bs as u32 + (p % bs) as u32).collect();
        let layer = lock(&self.pool.layers[self.layer]);
        let ids = Tensor::from_vec(ids, r.len, layer.k.device())?;
        let gather = |t: &Tensor| -> Result<Tensor> { Ok(t.index_select(&ids, 0)?.transpose(0, 1)?.contiguous()?) };
        Ok((gather(&layer.k)?, gather(&layer.v)?))
    }

    /// Cuts `row` back to `len` positions, releasing the blocks past them.
    pub(crate) fn trim(&mut self, row: usize, len: usize) -> Result<()> {
        let r = &mut self.rows[row];
        if len > r.len {
            return Err(StateError::Untrimmable { kind: "attention KV", from: r.len, to: len });
        }
        let mut layer = lock(&self.pool.layers[self.layer]);
        r.table.blocks.drain(len.div_ceil(self.pool.block_size)..).for_each(|id| layer.release(id));
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvStore, RecurrentShape};

    const HEADS: usize = 2;
    const DIM: usize = 3;

    fn spec() -> StateSpec {
        let kv = KvShape { kv_heads: HEADS, head_dim: DIM };
        let recurrent = RecurrentShape { conv_kernel: 2, conv_dim: 2, value_heads: 1, value_dim: 1, key_dim: 1 };
        StateSpec {
            layers: vec![LayerSpec::Attention(kv), LayerSpec::Recurrent(recurrent), LayerSpec::Attention(kv)],
            dtype: DType::F32,
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
            let pool = KvPool::new(&spec(), block_size, PoolSize::Fixed(4096 / block_size), &Device::Cpu).unwrap();
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
    #[test]
    fn shared_blocks_are_copied_on_write() {
        let pool = KvPool::new(&spec(), 16, PoolSize::Fixed(8), &Device::Cpu).unwrap();
        let mut a = pool.new_state(1).unwrap();
        attention(&mut a, 0).append(0, &values(20, 1), &values(20, 2)).unwrap();
        let mut b = a.clone();
        assert_eq!((pool.stats().blocks_used, pool.stats().blocks_shared), (2, 2));
        let (before, _) = attention(&mut a, 0).history(0).unwrap();
        attention(&mut b, 0).append(0, &values(1, 3), &values(1, 4)).unwrap();
        assert_eq!(
            pool.stats(),
            PoolStats { block_size: 16, blocks_total: 8, blocks_used: 3, blocks_used_peak: 3, blocks_shared: 1 }
        );
        let (after, _) = attention(&mut a, 0).history(0).unwrap();
        assert!(same(&before, &after), "the original is untouched by its clone's write");
        let (bk, _) = attention(&mut b, 0).history(0).unwrap();
        assert!(same(&bk.narrow(1, 0, 20).unwrap(), &before) && same(&bk.narrow(1, 20, 1).unwrap(), &values(1, 3)));
    }

    #[test]
    fn a_fixed_pool_says_when_it_is_full_and_a_growing_one_grows() {
        let pool = KvPool::new(&spec(), 4, PoolSize::Fixed(2), &Device::Cpu).unwrap();
        let mut state = pool.new_state(1).unwrap();
        attention(&mut state, 0).append(0, &values(8, 1), &values(8, 1)).unwrap();
        let full = attention(&mut state, 0).append(0, &values(1, 2), &values(1, 2));
        assert!(matches!(full, Err(StateError::PoolExhausted { blocks: 2, .. })), "{full:?}");
        let (k, _) = attention(&mut state, 0).history(0).unwrap();
        assert!(same(&k, &values(8, 1)), "a refused write leaves the row as it was");

        let pool = KvPool::new(&spec(), 4, PoolSize::Growing, &Device::Cpu).unwrap();
        let mut state = pool.new_state(1).unwrap();
        let (k, _) = attention(&mut state, 0).append(0, &values(100, 1), &values(100, 1)).unwrap();
        assert!(same(&k, &values(100, 1)));
        assert_eq!(pool.stats().blocks_used, 25);
    }
}
