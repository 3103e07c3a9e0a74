//! The RAM tier: a byte-capped LRU of snapshots, held where the model runs.
//!
//! Entries are immutable once inserted; a restore hands out a state that shares only what is
//! copied on write (a pool's KV blocks, see [`BatchState::share`]) and copies the rest, so a
//! running sequence that writes into its state can never change what the cache holds.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use strata_state::BatchState;

use super::{supersedes, CacheStats, Snapshot};

struct Entry {
    snap: Snapshot,
    bytes: usize,
    last_used: u64,
}

pub struct RamCache {
    max_bytes: usize,
    entries: Vec<Entry>,
    bytes: usize,
    clock: u64,
    stats: Arc<CacheStats>,
}

/// A restored state: a private single-row copy holding the first `tokens` tokens.
pub struct Restored {
    pub state: BatchState,
    pub tokens: usize,
}

impl RamCache {
    pub fn new(max_bytes: usize, stats: Arc<CacheStats>) -> Self {
        Self { max_bytes, entries: Vec::new(), bytes: 0, clock: 0, stats }
    }

    /// The best score `score(entry tokens, trimmable)` of namespace `ns` (0: nothing usable).
    pub fn best(&self, ns: u64, score: impl Fn(&[u32], bool) -> usize) -> usize {
        self.pick(ns, &score).map_or(0, |(_, s)| s)
    }

    fn pick(&self, ns: u64, score: &impl Fn(&[u32], bool) -> usize) -> Option<(usize, usize)> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.snap.namespace == ns)
            .map(|(i, e)| (i, score(&e.snap.tokens, e.snap.can_trim()), e.last_used))
            .filter(|&(_, s, _)| s > 0)
            .max_by_key(|&(_, s, used)| (s, used))
            .map(|(i, s, _)| (i, s))
    }

    /// The best entry's state (shared as [`BatchState::share`] shares it) cut to its score's
    /// length (only trimmable entries are ever scored below their length), and bumps the entry
    /// in the LRU order.
    pub fn restore(&mut self, ns: u64, score: impl Fn(&[u32], bool) -> usize) -> strata_state::Result<Option<Restored>> {
        let Some((i, tokens)) = self.pick(ns, &score) else { return Ok(None) };
        self.clock += 1;
        let entry = &mut self.entries[i];
        entry.last_used = self.clock;
        let mut state = entry.snap.state.share(0)?;
        if tokens < entry.snap.tokens.len() {
            state.trim(0, tokens)?;
        }
        Ok(Some(Restored { state, tokens }))
    }

    /// Adds `snap`, first dropping entries it supersedes, then the least recently used until
    /// it fits. An entry larger than the whole cap is not kept.
    pub fn insert(&mut self, snap: Snapshot) {
        let bytes = snap.bytes();
        if bytes > self.max_bytes {
            return;
        }
        self.remove_where(|e| e.snap.namespace == snap.namespace && supersedes(&snap, &e.snap.tokens, e.snap.resume.is_some()));
        while self.bytes + bytes > self.max_bytes && self.evict_oldest() {}
        self.clock += 1;
        self.entries.push(Entry { snap, bytes, last_used: self.clock });
        self.bytes += bytes;
        self.publish_stats();
    }

    /// Drops the least recently used entry; false when there is none.
    pub fn evict_oldest(&mut self) -> bool {
        let Some(oldest) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i) else {
            return false;
        };
        let e = self.entries.swap_remove(oldest);
        self.bytes -= e.bytes;
        self.stats.ram_evictions.fetch_add(1, Ordering::Relaxed);
        self.publish_stats();
        true
    }

    pub fn clear(&mut self) -> usize {
        let n = self.entries.len();
        self.remove_where(|_| true);
        n
    }

    fn remove_where(&mut self, drop: impl Fn(&Entry) -> bool) {
        self.entries.retain(|e| !drop(e));
        self.bytes = self.entries.iter().map(|e| e.bytes).sum();
        self.publish_stats();
    }

    fn publish_stats(&self) {
        self.stats.ram_entries.store(self.entries.len(), Ordering::Relaxed);
        self.stats.ram_bytes.store(self.bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};
    use strata_state::{KvShape, LayerSpec, LayerState, StateSpec, WindowShape};

    use super::*;

    const HEADS: usize = 2;
    const HEAD_DIM: usize = 8;
    /// Keys and values of one position, f32.
    const PER_SLOT: usize = 2 * HEADS * HEAD_DIM * 4;

    /// A one-layer snapshot after `tokens` positions appended one at a time, as decoding does:
    /// the layer's buffers grow by doubling on the way.
    fn grown(mut layer: LayerState, tokens: usize) -> Snapshot {
        for p in 0..tokens {
            let k = Tensor::full(p as f32, (HEADS, 1, HEAD_DIM), &Device::Cpu).unwrap();
            match &mut layer {
                LayerState::Attention(kv) => kv.append(0, &k, &k),
                LayerState::Window(kv) => kv.append(0, &k, &k),
                LayerState::Recurrent(_) => unreachable!(),
            }
            .unwrap();
        }
        let state = BatchState::new(vec![layer], vec![tokens]);
        Snapshot { namespace: 0, tokens: (0..tokens as u32).collect(), state, resume: None }
    }

    #[test]
    fn counts_the_bytes_grown_buffers_hold() {
        let kv = KvShape { kv_heads: HEADS, head_dim: HEAD_DIM };
        let spec = StateSpec {
            layers: vec![LayerSpec::Attention(kv), LayerSpec::Window(WindowShape { kv, window: 4 })],
            dtype: DType::F32,
            kv: strata_state::KvPolicy::default(),
        };
        let [kv, window] = spec.new_state(1, &Device::Cpu).unwrap().layers.try_into().unwrap();
        // 17 positions: the KV buffer doubled from 16 to 32 slots; the window's buffer too
        // (it holds all 17, under its 131-slot capacity).
        for layer in [kv, window] {
            let snap = grown(layer, 17);
            let held = 32 * PER_SLOT + 17 * 4;
            let stats = Arc::new(CacheStats::default());
            let mut ram = RamCache::new(1 << 20, stats.clone());
            ram.insert(snap.clone());
            assert_eq!(stats.ram_bytes.load(Ordering::Relaxed), held, "{}", snap.state.layers[0].kind());

            // A cap that covers the positions but not the buffers keeps nothing.
            let stats = Arc::new(CacheStats::default());
            let mut ram = RamCache::new(held - 1, stats.clone());
            ram.insert(snap);
            assert_eq!(stats.ram_entries.load(Ordering::Relaxed), 0);
        }
    }
}
