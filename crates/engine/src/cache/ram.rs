//! The RAM tier: a byte-capped LRU of snapshots, held where the model runs.
//!
//! Entries are immutable once inserted; a restore hands out a deep copy, so a running sequence
//! that writes into its state in place can never change what the cache holds.

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

    /// A copy of the best entry's state cut to its score's length (only trimmable entries are
    /// ever scored below their length), and bumps the entry in the LRU order.
    pub fn restore(&mut self, ns: u64, score: impl Fn(&[u32], bool) -> usize) -> strata_state::Result<Option<Restored>> {
        let Some((i, tokens)) = self.pick(ns, &score) else { return Ok(None) };
        self.clock += 1;
        let entry = &mut self.entries[i];
        entry.last_used = self.clock;
        let mut state = entry.snap.state.extract(0)?;
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
        while self.bytes + bytes > self.max_bytes {
            let Some(oldest) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i) else { break };
            let e = self.entries.swap_remove(oldest);
            self.bytes -= e.bytes;
            self.stats.ram_evictions.fetch_add(1, Ordering::Relaxed);
        }
        self.clock += 1;
        self.entries.push(Entry { snap, bytes, last_used: self.clock });
        self.bytes += bytes;
        self.publish_stats();
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
