//! The state pool a served batch keeps its rows in, allocated once: attention KV in fixed-size
//! blocks with a block table per row (`paged.rs`), recurrent state in slots, one per row
//! (`slots.rs`).
//!
//! A row joining, leaving or growing changes block tables and slot ids, never the pool's
//! tensors, so their addresses stay put (a recorded CUDA graph keeps reading the same memory).
//! Blocks and slots are reference-counted: cloning a row shares them, and a write into a shared
//! one first copies it (copy on write), so a clone keeps value semantics while holding its
//! prefix once. Each layer has its own blocks or slots and its own tables, so every store
//! answers for itself; the pool's counts are those of its first layer of each kind, which every
//! other layer repeats, since all are fed the same positions.
//!
//! Every layer also has one *scratch* block or slot outside the free list: what the padding rows
//! of a recorded CUDA step (batches rounded up to a recorded size) write into, so that they touch
//! no row's state.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{Device, Tensor};

use crate::format::KvCoding;
use crate::paged::{LayerBlocks, PagedRows};
use crate::slots::{LayerSlots, SlottedRows};
use crate::spec::{LayerSpec, StateSpec, Storage};
use crate::{BatchState, KvFormat, KvStore, LayerState, RecurrentState, Result, StateError, WindowKvStore};

/// How many blocks (or slots) a pool holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolSize {
    /// Exactly this many per layer, allocated at start; taking one past them is
    /// [`StateError::PoolExhausted`].
    Fixed(usize),
    /// As many as the rows need: the pool doubles when it runs out (moving its tensors, so not
    /// for recorded CUDA graphs; for one-off runs that were not given a memory size).
    Growing,
}

impl PoolSize {
    fn initial(self) -> usize {
        match self {
            PoolSize::Fixed(n) => n,
            PoolSize::Growing => 0,
        }
    }
}

/// A model's state pool: the pool a [`BatchState`] built by [`StatePool::new_state`] keeps its
/// full-attention and recurrent layers in. Cheap to clone (a handle).
#[derive(Clone, Debug)]
pub struct StatePool {
    pub(crate) pool: Arc<Pool>,
}

#[derive(Debug)]
pub(crate) struct Pool {
    spec: StateSpec,
    device: Device,
    pub(crate) block_size: usize,
    pub(crate) blocks: PoolSize,
    pub(crate) slots: PoolSize,
    /// One per [`LayerSpec::Attention`] layer of the spec, in order.
    pub(crate) kv: Vec<Mutex<LayerBlocks>>,
    /// One per [`LayerSpec::Recurrent`] layer of the spec, in order.
    pub(crate) recurrent: Vec<Mutex<LayerSlots>>,
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
    pub slots_total: usize,
    pub slots_used: usize,
    /// The format attention KV is stored in (`--kv-cache-dtype`).
    pub kv_format: KvFormat,
    /// Bytes a position costs over the full-attention layers, over the sliding-window layers
    /// (while it is within their windows), and more while it is among the first
    /// `delayed_positions` of a delayed format (their unquantized copy).
    pub kv_bytes_per_token: usize,
    pub window_kv_bytes_per_token: usize,
    pub delayed_bytes_per_token: usize,
    pub delayed_positions: usize,
    /// Bytes a row holds whatever its length: its recurrent layers' state (in
    /// `--mamba-ssm-cache-dtype`).
    pub recurrent_bytes_per_row: usize,
}

/// Reference-counted ids (blocks or slots) handed out from `0..len`.
#[derive(Debug)]
pub(crate) struct Ids {
    /// Holders of each id; 0 = free.
    refs: Vec<u32>,
    /// Free ids, the next to hand out last.
    free: Vec<u32>,
    used_peak: usize,
}

impl Ids {
    pub(crate) fn new(n: usize) -> Self {
        Self { refs: vec![0; n], free: (0..n as u32).rev().collect(), used_peak: 0 }
    }

    pub(crate) fn len(&self) -> usize {
        self.refs.len()
    }

    pub(crate) fn used(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    pub(crate) fn free(&self) -> usize {
        self.free.len()
    }

    pub(crate) fn used_peak(&self) -> usize {
        self.used_peak
    }

    pub(crate) fn shared(&self) -> usize {
        self.refs.iter().filter(|&&r| r > 1).count()
    }

    pub(crate) fn is_shared(&self, id: u32) -> bool {
        self.refs[id as usize] > 1
    }

    /// A free id, now held once; None when all are in use.
    pub(crate) fn take(&mut self) -> Option<u32> {
        let id = self.free.pop()?;
        self.refs[id as usize] = 1;
        self.used_peak = self.used_peak.max(self.used());
        Some(id)
    }

    pub(crate) fn share(&mut self, id: u32) {
        self.refs[id as usize] += 1;
    }

    pub(crate) fn release(&mut self, id: u32) {
        let refs = &mut self.refs[id as usize];
        *refs -= 1;
        if *refs == 0 {
            self.free.push(id);
        }
    }

    /// `n` ids in all, the new ones free.
    pub(crate) fn grow_to(&mut self, n: usize) {
        let old = self.refs.len();
        self.refs.resize(n, 0);
        self.free.splice(0..0, (old as u32..n as u32).rev());
    }
}

/// The doubled size of a growing pool of `len` (at least 16).
pub(crate) fn grown(len: usize) -> usize {
    (2 * len).max(16)
}

pub(crate) fn lock<T>(layer: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves counts, not tensors, half-updated at worst; the
    // counts are only ever changed in whole steps, so the data is still consistent.
    layer.lock().unwrap_or_else(|e| e.into_inner())
}

impl StatePool {
    /// A pool for `spec`'s full-attention and recurrent layers on `device`: attention KV in
    /// blocks of `block_size` positions, recurrent state in slots of one row each.
    pub fn new(spec: &StateSpec, block_size: usize, blocks: PoolSize, slots: PoolSize, device: &Device) -> Result<Self> {
        if block_size == 0 {
            return Err(StateError::BadPart("a KV block of 0 positions".into()));
        }
        let mut kv = Vec::new();
        let mut recurrent = Vec::new();
        for (layer, cx) in spec.layers.iter().zip(spec.contexts()) {
            match layer {
                LayerSpec::Attention(shape) => {
                    let coding = KvCoding::new(cx.kv, shape, cx.layer, cx.dtype, cx.kv_start)?;
                    kv.push(Mutex::new(LayerBlocks::new(*shape, coding, blocks.initial(), block_size, device)?))
                }
                LayerSpec::Recurrent(shape) => {
                    recurrent.push(Mutex::new(LayerSlots::new(*shape, slots.initial(), spec.dtype, device)?))
                }
                LayerSpec::Window(_) => {}
            }
        }
        let pool = Pool { spec: spec.clone(), device: device.clone(), block_size, blocks, slots, kv, recurrent };
        Ok(Self { pool: Arc::new(pool) })
    }

    /// Blocks that hold every row a state budget of `budget` bytes admits, for at most `rows`
    /// rows at once: the positions the budget pays for (at its attention layers' cost per
    /// position, a bound whatever else the rows hold), plus per row one partly filled block and
    /// room for a speculative round's positions past its length ([`crate::ROUND_SLACK`]).
    pub fn blocks_for_budget(spec: &StateSpec, block_size: usize, budget: usize, rows: usize) -> usize {
        let paid = (budget / spec.kv_bytes_per_token().max(1)).div_ceil(block_size);
        paid + rows * (1 + crate::ROUND_SLACK.div_ceil(block_size))
    }

    /// Blocks of `block_size` positions that `bytes` of device memory hold, over all the
    /// attention layers of `spec`.
    pub fn blocks_in(spec: &StateSpec, block_size: usize, bytes: usize) -> usize {
        bytes / (spec.kv_bytes_per_token().max(1) * block_size)
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size
    }

    /// Bytes of device memory the pool's buffers take.
    pub fn bytes(&self) -> usize {
        let kv: usize = self.pool.kv.iter().map(|l| lock(l).bytes()).sum();
        kv + self.pool.recurrent.iter().map(|l| lock(l).bytes()).sum::<usize>()
    }

    /// Fresh state for `rows` empty sequences: full-attention and recurrent layers in this pool
    /// (each row taking a slot now), the others as the spec declares them.
    pub fn new_state(&self, rows: usize) -> Result<BatchState> {
        let (pool, spec) = (&self.pool, &self.pool.spec);
        let (mut kv, mut recurrent) = (0, 0);
        let mut layers = Vec::with_capacity(spec.layers.len());
        for (layer, cx) in spec.layers.iter().zip(spec.contexts()) {
            layers.push(match layer {
                LayerSpec::Attention(shape) => {
                    kv += 1;
                    let coding = lock(&pool.kv[kv - 1]).coding.clone();
                    LayerState::Attention(KvStore::paged(
                        *shape,
                        coding,
                        &pool.device,
                        PagedRows::new(pool.clone(), kv - 1, rows),
                    )?)
                }
                LayerSpec::Recurrent(_) => {
                    recurrent += 1;
                    LayerState::Recurrent(RecurrentState::slotted(SlottedRows::new(pool.clone(), recurrent - 1, rows)?))
                }
                LayerSpec::Window(shape) => LayerState::Window(WindowKvStore::empty(shape, rows, &cx, &pool.device)?),
            });
        }
        Ok(BatchState::new(layers, vec![0; rows]))
    }

    /// KV blocks free in every attention layer; `None` for a pool that grows instead of running
    /// out.
    pub fn blocks_free(&self) -> Option<usize> {
        match self.pool.blocks {
            PoolSize::Growing => None,
            PoolSize::Fixed(_) => Some(self.pool.kv.iter().map(|l| lock(l).ids().free()).min().unwrap_or(usize::MAX)),
        }
    }

    /// KV blocks per attention layer; `None` for a pool that grows.
    pub fn blocks_total(&self) -> Option<usize> {
        match self.pool.blocks {
            PoolSize::Growing => None,
            PoolSize::Fixed(n) => Some(n),
        }
    }

    pub fn stats(&self) -> PoolStats {
        let cost = self.pool.spec.cost();
        let mut stats = PoolStats {
            block_size: self.pool.block_size,
            kv_format: self.pool.spec.kv.format,
            kv_bytes_per_token: cost.bytes_per_token,
            window_kv_bytes_per_token: cost.window_bytes_per_token,
            delayed_bytes_per_token: cost.prefix_bytes_per_token,
            delayed_positions: cost.prefix_positions,
            recurrent_bytes_per_row: cost.bytes_per_row,
            ..PoolStats::default()
        };
        if let Some(first) = self.pool.kv.first() {
            let blocks = lock(first);
            let ids = blocks.ids();
            (stats.blocks_total, stats.blocks_used, stats.blocks_used_peak) = (ids.len(), ids.used(), ids.used_peak());
            stats.blocks_shared = ids.shared();
        }
        if let Some(first) = self.pool.recurrent.first() {
            let slots = lock(first);
            (stats.slots_total, stats.slots_used) = (slots.ids().len(), slots.ids().used());
        }
        stats
    }

    /// Whether `state`'s pooled layers live in this pool.
    pub fn holds(&self, state: &BatchState) -> bool {
        state.layers.iter().all(|layer| match layer {
            LayerState::Attention(kv) => kv.paged_rows().is_some_and(|p| Arc::ptr_eq(&p.pool, &self.pool)),
            LayerState::Recurrent(s) => s.slotted_rows().is_some_and(|p| Arc::ptr_eq(&p.pool, &self.pool)),
            LayerState::Window(_) => true,
        })
    }
}

impl StateSpec {
    /// Bytes of keys and values one position costs over the full-attention layers.
    pub(crate) fn kv_bytes_per_token(&self) -> usize {
        self.layers
            .iter()
            .zip(self.contexts())
            .filter_map(|(layer, cx)| match layer {
                LayerSpec::Attention(shape) => Some(cx.kv.bytes_per_token(shape, self.dtype)),
                _ => None,
            })
            .sum()
    }
}

/// A pool tensor's bytes.
pub(crate) fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}
