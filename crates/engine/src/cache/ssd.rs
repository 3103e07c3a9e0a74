//! The SSD tier: one file per snapshot, and the files are the database.
//!
//! Layout: `<dir>/<identity fingerprint>/<namespace, 16 hex>/<uuid>.entry`; what a file holds is
//! in `ssd/format.rs`. Writes go to `<uuid>.entry.tmp`, are fsynced and renamed, so a crash leaves
//! either a whole entry or an orphan `.tmp` that the next start reaps. The in-memory index is
//! rebuilt from the files at start; the file mtime is the LRU clock, so eviction order survives
//! restarts too. Only our own fingerprint folder is ever scanned or changed, and a file naming
//! another identity is left alone: it may belong to another build sharing the folder. Below the
//! cache folder no link is followed and only regular files are opened or deleted (`ssd/files.rs`).

mod files;
mod format;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use strata_state::{BatchState, StateError};
use xxhash_rust::xxh3::xxh3_64;

use super::{supersedes, CacheStats, Snapshot};
use format::AtPath;

/// What a stored state depends on besides its tokens. Entries of another identity are never
/// served, and live in another folder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub model: String,
    pub config_hash: u64,
    pub tokenizer_hash: u64,
    pub dtype: String,
}

impl Identity {
    /// The name of this identity's folder: 16 hex digits of xxh3 over every field, each prefixed
    /// with its length so that no two identities run together into the same bytes.
    pub fn fingerprint(&self) -> String {
        let mut bytes = Vec::new();
        let fields: [&[u8]; 4] =
            [self.model.as_bytes(), &self.config_hash.to_le_bytes(), &self.tokenizer_hash.to_le_bytes(), self.dtype.as_bytes()];
        for field in fields {
            bytes.extend_from_slice(&(field.len() as u64).to_le_bytes());
            bytes.extend_from_slice(field);
        }
        format!("{:016x}", xxh3_64(&bytes))
    }
}

#[derive(Clone, Debug)]
pub struct SsdOptions {
    pub dir: PathBuf,
    /// Cap on the bytes of all entry files, enforced when writing.
    pub max_bytes: u64,
    /// Hash every tensor at startup too (otherwise tensors are checked when loaded).
    pub verify: bool,
}

/// What the startup scan found and did.
#[derive(Debug, Default, Clone)]
pub struct Recovery {
    pub entries: usize,
    pub bytes: u64,
    /// Orphan `.tmp` files of interrupted writes, deleted.
    pub reaped_tmp: usize,
    /// Entries that failed their checks, deleted.
    pub removed_corrupt: usize,
    /// Files naming another identity, left where they are.
    pub skipped_foreign: usize,
    /// Links, FIFOs, sockets, devices or folders where a namespace folder, entry or `.tmp` file
    /// should be: never followed, opened or deleted, each logged.
    pub skipped_unsafe: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum SsdError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("{}: not a valid cache entry: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error("{}: written for another model or configuration ({found})", path.display())]
    Foreign { path: PathBuf, found: String },
    #[error("{}: the stored state does not fit this model: {source}", path.display())]
    Mismatch { path: PathBuf, source: StateError },
    #[error("cannot store this state: {0}")]
    Unstorable(String),
    /// A link, FIFO, device or the like where the tier keeps its folders and files: it follows
    /// no link below its folder and opens or deletes nothing else.
    #[error("{} is {found}, not {wanted}; the SSD cache leaves it alone", path.display())]
    Unsafe { path: PathBuf, found: &'static str, wanted: &'static str },
}

impl SsdError {
    /// A short name for what went wrong, so callers can log each kind of failure once.
    pub fn kind(&self) -> String {
        match self {
            SsdError::Io { source, .. } => format!("io {:?}", source.kind()),
            SsdError::Corrupt { .. } => "corrupt".into(),
            SsdError::Foreign { .. } => "foreign".into(),
            SsdError::Mismatch { .. } => "mismatch".into(),
            SsdError::Unstorable(_) => "unstorable".into(),
            SsdError::Unsafe { .. } => "unsafe".into(),
        }
    }

    /// Whether the file is ours and can never be served, so it should be deleted.
    fn condemns_file(&self) -> bool {
        matches!(self, SsdError::Corrupt { .. } | SsdError::Mismatch { .. })
    }
}

/// An entry found by [`SsdStore::lookup`], to pass to [`SsdStore::load`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryId(PathBuf);

#[derive(Clone, Debug)]
pub struct SsdHit {
    pub id: EntryId,
    /// The entry's length in tokens.
    pub tokens: usize,
    /// What the lookup's score said this entry can serve.
    pub usable: usize,
}

/// What the index knows of one entry file, keyed by its path.
struct Entry {
    ns: u64,
    tokens: Vec<u32>,
    trimmable: bool,
    checkpoint: bool,
    bytes: u64,
    used: SystemTime,
}

struct Index {
    entries: HashMap<PathBuf, Entry>,
    /// Bytes of indexed files, and bytes promised to writes in progress.
    bytes: u64,
    reserved: u64,
    last_stamp: SystemTime,
}

impl Index {
    /// A use time later than every earlier one, so LRU order and "most recent" ties stay strict
    /// even when two uses fall on the same clock tick.
    fn stamp(&mut self) -> SystemTime {
        self.last_stamp = SystemTime::now().max(self.last_stamp + Duration::from_nanos(1));
        self.last_stamp
    }

    fn insert(&mut self, path: PathBuf, entry: Entry) {
        self.last_stamp = self.last_stamp.max(entry.used);
        self.bytes += entry.bytes;
        if let Some(old) = self.entries.insert(path, entry) {
            self.bytes -= old.bytes;
        }
    }

    fn remove(&mut self, path: &Path) -> Option<Entry> {
        let entry = self.entries.remove(path)?;
        self.bytes -= entry.bytes;
        Some(entry)
    }
}

pub struct SsdStore {
    /// `<dir>/<fingerprint>`: everything this store reads or changes lies below it.
    root: PathBuf,
    identity: Identity,
    max_bytes: u64,
    stats: Arc<CacheStats>,
    index: Mutex<Index>,
}

impl SsdStore {
    /// Opens (creating if needed) this identity's folder and rebuilds the index from its files:
    /// orphan `.tmp` files are deleted, entries failing their checks deleted, other identities'
    /// files kept. Errors only when the folder itself cannot be created or listed, or when this
    /// identity's folder is a link or no folder at all.
    pub fn open(opts: SsdOptions, identity: Identity, stats: Arc<CacheStats>) -> Result<(SsdStore, Recovery), SsdError> {
        let root = opts.dir.join(identity.fingerprint());
        fs::create_dir_all(&opts.dir).at(&opts.dir)?;
        files::ensure_dir(&root, &root)?;
        let index = Index { entries: HashMap::new(), bytes: 0, reserved: 0, last_stamp: SystemTime::UNIX_EPOCH };
        let store = SsdStore { root, identity, max_bytes: opts.max_bytes, stats, index: Mutex::new(index) };
        let recovery = store.recover(opts.verify)?;
        Ok((store, recovery))
    }

    fn recover(&self, verify: bool) -> Result<Recovery, SsdError> {
        let mut recovery = Recovery::default();
        let mut index = self.index();
        let skip_unsafe = |recovery: &mut Recovery, e: &SsdError| {
            tracing::warn!(error = %e, "skipping a file in the SSD cache folder that strata did not write");
            recovery.skipped_unsafe += 1;
        };
        for ns_dir in fs::read_dir(&self.root).at(&self.root)? {
            let ns_dir = ns_dir.at(&self.root)?.path();
            // Only namespace folders are ours to look into; anything else is left alone.
            let is_namespace = ns_dir.file_name().and_then(|n| n.to_str()).is_some_and(|n| u64::from_str_radix(n, 16).is_ok());
            if !is_namespace {
                continue;
            }
            if let Err(e) = files::is_real_dir(&self.root, &ns_dir) {
                skip_unsafe(&mut recovery, &e);
                continue;
            }
            let listing = match fs::read_dir(&ns_dir) {
                Ok(listing) => listing,
                Err(e) => {
                    tracing::warn!(folder = %ns_dir.display(), error = %e, "cannot list SSD cache folder; its entries are not served");
                    continue;
                }
            };
            for path in listing.filter_map(|f| f.ok().map(|f| f.path())) {
                let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                if name.ends_with(".entry.tmp") {
                    match files::remove(&self.root, &path) {
                        Ok(()) => recovery.reaped_tmp += 1,
                        Err(e @ SsdError::Unsafe { .. }) => skip_unsafe(&mut recovery, &e),
                        Err(e) => tracing::warn!(error = %e, "cannot delete an interrupted SSD cache write"),
                    }
                } else if name.ends_with(".entry") {
                    match self.scan(&path, verify) {
                        Ok(entry) => index.insert(path, entry),
                        Err(e @ SsdError::Unsafe { .. }) => skip_unsafe(&mut recovery, &e),
                        Err(e @ SsdError::Foreign { .. }) => {
                            tracing::debug!(error = %e, "skipping SSD cache entry of another identity");
                            recovery.skipped_foreign += 1;
                        }
                        Err(e) if e.condemns_file() => {
                            tracing::warn!(error = %e, "removing corrupt SSD cache entry");
                            self.unlink(&path);
                            recovery.removed_corrupt += 1;
                        }
                        Err(e) => tracing::warn!(error = %e, "cannot read SSD cache entry; leaving it unserved"),
                    }
                }
            }
        }
        recovery.entries = index.entries.len();
        recovery.bytes = index.bytes;
        self.publish(&index);
        Ok(recovery)
    }

    /// Checks one entry file at startup and describes it for the index.
    fn scan(&self, path: &Path, verify: bool) -> Result<Entry, SsdError> {
        let file = files::open_entry(&self.root, path)?;
        let (header, meta) = format::inspect(&file, path, &self.identity, verify)?;
        Ok(Entry {
            ns: header.namespace,
            checkpoint: header.resume.is_some(),
            tokens: header.tokens,
            trimmable: header.trimmable,
            bytes: meta.len(),
            used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        })
    }

    /// The best entry of namespace `ns` by `score(entry_tokens, trimmable)` (0: unusable); ties
    /// go to the most recently used. Never fails: no usable entry is `None`.
    pub fn lookup(&self, ns: u64, score: impl Fn(&[u32], bool) -> usize) -> Option<SsdHit> {
        let index = self.index();
        let (path, entry, usable) = index
            .entries
            .iter()
            .filter(|(_, e)| e.ns == ns)
            .map(|(path, e)| (path, e, score(&e.tokens, e.trimmable)))
            .filter(|&(_, _, usable)| usable > 0)
            .max_by_key(|&(_, e, usable)| (usable, e.used))?;
        Some(SsdHit { id: EntryId(path.clone()), tokens: entry.tokens.len(), usable })
    }

    /// Reads an entry back tensor by tensor onto `template`'s device, checking identity, every
    /// tensor's hash and every shape (against `template`, a fresh state of the model), and marks
    /// it used. On failure the entry leaves the index (its file is deleted when it is ours and
    /// unusable) and the failure is counted; the caller re-prefills.
    pub fn load(&self, hit: &SsdHit, template: &BatchState) -> Result<Snapshot, SsdError> {
        let start = Instant::now();
        let path = &hit.id.0;
        let read = files::open_entry(&self.root, path)
            .and_then(|file| Ok((format::read_entry(&file, path, &self.identity, template)?, file)));
        let (snap, file) = match read {
            Ok(read) => read,
            Err(e) => {
                let mut index = self.index();
                index.remove(path);
                self.publish(&index);
                drop(index);
                if e.condemns_file() {
                    self.unlink(path);
                }
                self.stats.ssd_restore_failures.fetch_add(1, Relaxed);
                return Err(e);
            }
        };
        let now = {
            let mut index = self.index();
            let now = index.stamp();
            if let Some(entry) = index.entries.get_mut(path) {
                entry.used = now;
            }
            now
        };
        // The mtime carries the LRU order across restarts; failing to set it only makes a later
        // eviction less exact.
        if let Err(e) = file.set_modified(now) {
            tracing::debug!(file = %path.display(), error = %e, "cannot bump SSD cache entry mtime");
        }
        self.stats.ssd_restores.fetch_add(1, Relaxed);
        self.stats.ssd_restore_micros.fetch_add(start.elapsed().as_micros() as u64, Relaxed);
        Ok(snap)
    }

    /// Writes `snap` now (blocking; the writer thread calls this). Least recently used entries
    /// are evicted first until it fits under the cap; an entry larger than the cap is skipped
    /// (`Ok(false)`). Entries it supersedes are removed only once it is safely on disk.
    pub fn store(&self, snap: &Snapshot) -> Result<bool, SsdError> {
        let mut plan = format::plan(&self.identity, snap)?;
        let size = plan.size;
        if size > self.max_bytes {
            tracing::debug!(size, max = self.max_bytes, "state larger than the SSD cache cap; not stored");
            return Ok(false);
        }

        let (evicted, stamp) = {
            let mut index = self.index();
            let mut evicted = Vec::new();
            while index.bytes + index.reserved + size > self.max_bytes {
                let Some(oldest) = index.entries.iter().min_by_key(|(_, e)| e.used).map(|(p, _)| p.clone()) else { break };
                index.remove(&oldest);
                evicted.push(oldest);
            }
            index.reserved += size;
            self.publish(&index);
            (evicted, index.stamp())
        };
        evicted.iter().for_each(|p| self.unlink(p));
        self.stats.ssd_evictions.fetch_add(evicted.len() as u64, Relaxed);

        let dir = self.root.join(format!("{:016x}", snap.namespace));
        let written = format::write_entry(&self.root, &dir, &mut plan, stamp);
        let mut index = self.index();
        index.reserved -= size;
        let path = written?;
        let entry = Entry {
            ns: snap.namespace,
            tokens: snap.tokens.clone(),
            trimmable: plan.header.trimmable,
            checkpoint: snap.resume.is_some(),
            bytes: size,
            used: stamp,
        };
        index.insert(path.clone(), entry);
        let superseded: Vec<PathBuf> = index
            .entries
            .iter()
            .filter(|(p, e)| **p != path && e.ns == snap.namespace && supersedes(snap, &e.tokens, e.checkpoint))
            .map(|(p, _)| p.clone())
            .collect();
        for p in &superseded {
            index.remove(p);
        }
        self.publish(&index);
        drop(index);
        superseded.iter().for_each(|p| self.unlink(p));

        self.stats.ssd_evictions.fetch_add(superseded.len() as u64, Relaxed);
        self.stats.ssd_writes.fetch_add(1, Relaxed);
        if snap.resume.is_some() {
            self.stats.checkpoints_written.fetch_add(1, Relaxed);
        }
        Ok(true)
    }

    /// Removes every entry of this identity (other identities' files stay); returns how many.
    pub fn clear(&self) -> Result<usize, SsdError> {
        let paths: Vec<PathBuf> = {
            let mut index = self.index();
            let paths = index.entries.drain().map(|(p, _)| p).collect();
            index.bytes = 0;
            self.publish(&index);
            paths
        };
        let mut first_error = None;
        for path in &paths {
            if let Err(e) = files::remove(&self.root, path) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(paths.len()), Err)
    }

    pub fn entries(&self) -> usize {
        self.index().entries.len()
    }

    pub fn bytes(&self) -> u64 {
        self.index().bytes
    }

    /// A panic elsewhere while holding the lock leaves the index consistent (every change is a
    /// few field updates), so a poisoned lock is used as is: the cache never takes serving down.
    fn index(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn publish(&self, index: &Index) {
        self.stats.ssd_entries.store(index.entries.len(), Relaxed);
        self.stats.ssd_bytes.store(index.bytes, Relaxed);
    }

    /// Deletes an entry file of ours; one already gone is fine, and a failure only leaves a
    /// file the next startup scan sees again.
    fn unlink(&self, path: &Path) {
        if let Err(e) = files::remove(&self.root, path) {
            tracing::warn!(error = %e, "cannot delete SSD cache file");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_keeps_fields_apart() {
        let id =
            |model: &str, dtype: &str| Identity { model: model.into(), config_hash: 1, tokenizer_hash: 2, dtype: dtype.into() };
        let a = id("qwen", "f32");
        assert_eq!(a.fingerprint(), id("qwen", "f32").fingerprint());
        assert_eq!(a.fingerprint().len(), 16);
        assert_ne!(a.fingerprint(), id("qwen", "bf16").fingerprint());
        // Length prefixes: moving bytes from one field to the next changes the fingerprint.
        assert_ne!(id("ab", "c").fingerprint(), id("a", "bc").fingerprint());
    }
}
