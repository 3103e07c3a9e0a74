//! Write-behind for the SSD tier: the token loop hands snapshots to a bounded queue and never
//! waits on a disk; one background thread writes them. When the disk falls behind, new
//! snapshots are dropped (and counted) rather than letting the queue hold ever more state.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{CacheStats, Snapshot, SsdStore};

pub struct SsdWriter {
    store: Arc<SsdStore>,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    queue: Mutex<Queue>,
    /// Signalled when work arrives or the queue closes.
    work: Condvar,
    /// Signalled when a write finishes.
    done: Condvar,
    capacity: usize,
    stats: Arc<CacheStats>,
}

#[derive(Default)]
struct Queue {
    pending: VecDeque<Snapshot>,
    /// Whether the thread is writing a snapshot it has taken off `pending`.
    writing: bool,
    closed: bool,
}

impl Shared {
    /// A panicking store must not take the token loop down with it; the queue's fields stay
    /// consistent under any panic, so a poisoned lock is used as is.
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next snapshot to write; `None` once the queue is closed and empty.
    fn next(&self) -> Option<Snapshot> {
        let mut queue = self.lock();
        loop {
            if let Some(snap) = queue.pending.pop_front() {
                queue.writing = true;
                return Some(snap);
            }
            if queue.closed {
                return None;
            }
            queue = self.work.wait(queue).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn finished(&self) {
        self.lock().writing = false;
        self.done.notify_all();
    }

    fn close(&self) {
        self.lock().closed = true;
        self.work.notify_all();
    }
}

impl SsdWriter {
    /// A background thread ("strata-ssd-writer") writing snapshots from a queue of at most
    /// `capacity` waiting snapshots.
    pub fn spawn(store: Arc<SsdStore>, capacity: usize, stats: Arc<CacheStats>) -> SsdWriter {
        let shared =
            Arc::new(Shared { queue: Mutex::new(Queue::default()), work: Condvar::new(), done: Condvar::new(), capacity, stats });
        let spawned = std::thread::Builder::new().name("strata-ssd-writer".into()).spawn({
            let (store, shared) = (store.clone(), shared.clone());
            move || write_loop(&store, &shared)
        });
        let thread = match spawned {
            Ok(handle) => Some(handle),
            Err(e) => {
                // Without a writer the SSD tier only stops growing; serving goes on.
                tracing::error!(error = %e, "cannot start the SSD cache writer; nothing will be written to SSD");
                shared.close();
                None
            }
        };
        SsdWriter { store, shared, thread: Mutex::new(thread) }
    }

    /// Queues a snapshot without blocking. False when it is not taken: the queue is full (counted
    /// in `ssd_writes_dropped`) or the writer has shut down.
    pub fn enqueue(&self, snap: Snapshot) -> bool {
        let mut queue = self.shared.lock();
        if queue.closed {
            return false;
        }
        if queue.pending.len() >= self.shared.capacity {
            self.shared.stats.ssd_writes_dropped.fetch_add(1, Relaxed);
            return false;
        }
        queue.pending.push_back(snap);
        self.shared.work.notify_one();
        true
    }

    /// Stops taking new work and waits up to `deadline` for queued writes to finish. Returns how
    /// many snapshots were still unwritten when it gave up (0: all flushed); those still queued
    /// are dropped so the thread ends after its current write. Calling it again is harmless.
    pub fn shutdown(&self, deadline: Duration) -> usize {
        let give_up = Instant::now() + deadline;
        self.shared.close();
        let mut queue = self.shared.lock();
        while !queue.pending.is_empty() || queue.writing {
            let now = Instant::now();
            if now >= give_up {
                let unwritten = queue.pending.len() + usize::from(queue.writing);
                queue.pending.clear();
                return unwritten;
            }
            queue = self.shared.done.wait_timeout(queue, give_up - now).unwrap_or_else(PoisonError::into_inner).0;
        }
        drop(queue);
        // The queue is closed and empty, so the thread is returning: joining does not wait.
        if let Some(handle) = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take() {
            let _ = handle.join();
        }
        0
    }

    pub fn store(&self) -> &Arc<SsdStore> {
        &self.store
    }
}

impl Drop for SsdWriter {
    /// Lets the thread finish what is queued and end, without waiting for it.
    fn drop(&mut self) {
        self.shared.close();
    }
}

fn write_loop(store: &SsdStore, shared: &Shared) {
    // Each kind of failure is logged loudly once; repeats (a full disk fails every write) only
    // count, so the log stays readable.
    let mut reported = HashSet::new();
    while let Some(snap) = shared.next() {
        // The snapshot's device reads and its drop (device frees) must not land in a decode step
        // being recorded on the engine thread.
        let device = snap.state.layers.first().map(|layer| layer.device()).unwrap_or(candle_core::Device::Cpu);
        let _device = strata_kernels::device_use(&device);
        if let Err(e) = store.store(&snap) {
            shared.stats.ssd_write_failures.fetch_add(1, Relaxed);
            if reported.insert(e.kind()) {
                tracing::warn!(error = %e, "SSD cache write failed; the entry is not stored (further failures of this kind are only counted in ssd_write_failures)");
            } else {
                tracing::debug!(error = %e, "SSD cache write failed");
            }
        }
        drop(snap);
        shared.finished();
    }
}
