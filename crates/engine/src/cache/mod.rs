//! The prompt cache: state snapshots keyed by (namespace, exact token prefix), in a byte-capped
//! RAM tier and an SSD tier of files that survive restarts and crashes.
//!
//! Hybrid models make reuse subtle: attention KV can be trimmed back to any shorter prefix, but
//! a recurrent state exists only at the exact position it was taken. Every entry therefore says
//! whether it can be trimmed, and both tiers pick entries through [`usable_prefix`], which never
//! returns an entry it cannot serve. A cache is always droppable: any failure means "no hit".

mod ram;
pub mod ssd;
mod writer;

use std::sync::atomic::{AtomicU64, AtomicUsize};

use strata_state::BatchState;

pub use ram::{RamCache, Restored};
pub use ssd::{Identity, Recovery, SsdOptions, SsdStore};
pub use writer::SsdWriter;

/// Namespace of the shared prompt cache (others, e.g. generation checkpoints, hash their key).
pub const PROMPT_NAMESPACE: u64 = 0;

/// The state of one sequence after `tokens`, single row: `state.positions == [tokens.len()]`.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub namespace: u64,
    pub tokens: Vec<u32>,
    pub state: BatchState,
    /// Set on generation checkpoints: what resuming the generation needs beyond the state.
    pub resume: Option<Resume>,
}

/// A generation checkpoint's extra facts: `tokens[..prompt_len]` is the prompt, the rest the
/// output so far; `next_token` is the last output token (sampled, not yet fed to the model).
/// Nothing of the sampler: its draws depend on the seed and the output length alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Resume {
    pub prompt_len: usize,
    pub next_token: u32,
}

impl Snapshot {
    pub fn can_trim(&self) -> bool {
        self.state.can_trim()
    }

    /// Bytes this snapshot holds: its state's buffers, spare room included, and its tokens.
    pub fn bytes(&self) -> usize {
        self.state.allocated_bytes() + self.tokens.len() * 4
    }
}

/// How many leading tokens of `prompt` an entry holding `entry` tokens can serve, when no more
/// than `limit` may be served (0: unusable). A trimmable entry serves any common prefix; an
/// untrimmable one only its whole length, and only when that is a prefix of the prompt.
pub fn usable_prefix(entry: &[u32], trimmable: bool, prompt: &[u32], limit: usize) -> usize {
    let limit = limit.min(prompt.len());
    if trimmable {
        entry.iter().zip(&prompt[..limit]).take_while(|(a, b)| a == b).count()
    } else if entry.len() <= limit && prompt.starts_with(entry) {
        entry.len()
    } else {
        0
    }
}

/// Whether `entry` may supersede (make redundant) an existing entry holding `old` tokens in
/// the same namespace: an exact duplicate always; a shorter ancestor only when the new entry
/// can itself serve every prefix the old one served (it trims), or when both are checkpoints
/// of one generation (the newer replaces the older).
pub fn supersedes(new: &Snapshot, old: &[u32], old_is_checkpoint: bool) -> bool {
    if new.tokens == old {
        return true;
    }
    let ancestor = old.len() < new.tokens.len() && new.tokens.starts_with(old);
    ancestor && (new.can_trim() || (new.resume.is_some() && old_is_checkpoint))
}

/// Counters read by `/stats` and `/metrics`.
#[derive(Debug, Default)]
pub struct CacheStats {
    pub ram_entries: AtomicUsize,
    pub ram_bytes: AtomicUsize,
    pub ram_evictions: AtomicU64,
    pub ssd_entries: AtomicUsize,
    pub ssd_bytes: AtomicU64,
    pub ram_hits: AtomicU64,
    pub ssd_hits: AtomicU64,
    pub misses: AtomicU64,
    pub hit_tokens: AtomicU64,
    /// SSD entries read back into memory, and the time spent reading them.
    pub ssd_restores: AtomicU64,
    pub ssd_restore_micros: AtomicU64,
    /// SSD entries that failed to read back (corrupt, vanished): dropped, the prompt re-prefilled.
    pub ssd_restore_failures: AtomicU64,
    /// Bytes of SSD state read back for the job admitted next and not yet taken by it (at most
    /// one job's: reads wait until that job fits the state budget).
    pub ssd_restored_waiting_bytes: AtomicUsize,
    /// Copies of state into or out of the cache that failed (e.g. out of device memory): a
    /// restore that fails is a miss, a snapshot that fails is not kept; the batch goes on.
    pub copy_failures: AtomicU64,
    /// Entries written to SSD, writes that failed, and writes dropped because the queue was full.
    pub ssd_writes: AtomicU64,
    pub ssd_write_failures: AtomicU64,
    pub ssd_writes_dropped: AtomicU64,
    /// SSD entries removed to stay under the byte cap, or superseded by a newer entry.
    pub ssd_evictions: AtomicU64,
    pub checkpoints_written: AtomicU64,
    pub checkpoint_resumes: AtomicU64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usable_prefix_never_offers_what_an_entry_cannot_serve() {
        let prompt = [1, 2, 3, 4, 5];
        // Untrimmable: only its whole length, and only within the limit.
        assert_eq!(usable_prefix(&[1, 2, 3], false, &prompt, 4), 3);
        assert_eq!(usable_prefix(&[1, 2, 3, 4, 5], false, &prompt, 4), 0);
        assert_eq!(usable_prefix(&[1, 2, 9], false, &prompt, 4), 0);
        // Trimmable: any common prefix, capped by the limit.
        assert_eq!(usable_prefix(&[1, 2, 9], true, &prompt, 4), 2);
        assert_eq!(usable_prefix(&[1, 2, 3, 4, 5, 6], true, &prompt, 4), 4);
        assert_eq!(usable_prefix(&[7], true, &prompt, 4), 0);
    }
}
