//! The prefetch thread: reads stored SSD state for the job the engine thread admits next, so
//! that the token loop never waits on a disk read.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use strata_state::BatchState;

use crate::cache::{usable_prefix, CacheStats, Snapshot, PROMPT_NAMESPACE};
use crate::job::{Fetch, Job};
use crate::shared::SharedCache;

struct FetchRequest {
    id: u64,
    prompt: Vec<u32>,
    /// The job's generation-checkpoint namespace, when it has one.
    checkpoints: Option<u64>,
}

/// The engine thread's end of the prefetch thread: one request in flight at a time.
pub(crate) struct Prefetcher {
    requests: mpsc::Sender<FetchRequest>,
    results: mpsc::Receiver<(u64, Option<Snapshot>)>,
    next_id: u64,
}

impl Prefetcher {
    /// Asks for the stored state `job` can use; the answer comes to [`Prefetcher::take`].
    pub fn ask(&mut self, job: &Job, checkpoints: Option<u64>) -> Fetch {
        self.next_id += 1;
        let request = FetchRequest { id: self.next_id, prompt: job.cache_tokens().to_vec(), checkpoints };
        match self.requests.send(request) {
            Ok(()) => Fetch::Pending(self.next_id),
            // Without its thread there is no SSD tier to read: a miss.
            Err(_) => Fetch::Ready(None),
        }
    }

    /// The answer to request `id` once it is in (waiting for it with `block`); answers to
    /// earlier requests, whose jobs went away meanwhile, are dropped.
    pub fn take(&self, id: u64, block: bool, stats: &CacheStats) -> Option<Option<Snapshot>> {
        loop {
            let answer = match block {
                true => self.results.recv().map_err(|_| mpsc::TryRecvError::Disconnected),
                false => self.results.try_recv(),
            };
            match answer {
                Ok((answered, snap)) if answered == id => return Some(snap),
                Ok((_, stale)) => release_waiting(stats, stale.as_ref()),
                Err(mpsc::TryRecvError::Empty) => return None,
                // The thread is gone and will never answer: a miss.
                Err(mpsc::TryRecvError::Disconnected) => return Some(None),
            }
        }
    }
}

/// A restored snapshot stops waiting for admission: taken by its job, or dropped.
pub(crate) fn release_waiting(stats: &CacheStats, snap: Option<&Snapshot>) {
    if let Some(snap) = snap {
        stats.ssd_restored_waiting_bytes.fetch_sub(snap.bytes(), Ordering::Relaxed);
    }
}

/// Starts the thread that reads usable SSD state for the jobs the engine asks about. It reads
/// only when the SSD holds more of the prompt than the RAM tier does.
pub(crate) fn spawn_prefetch(cache: Arc<SharedCache>, template: BatchState) -> Prefetcher {
    let (requests, incoming) = mpsc::channel::<FetchRequest>();
    let (answers, results) = mpsc::channel();
    std::thread::Builder::new()
        .name("strata-prefetch".into())
        .spawn(move || {
            for request in incoming {
                let snap = prefetch(&cache, &template, &request);
                if let Some(snap) = &snap {
                    cache.stats.ssd_restored_waiting_bytes.fetch_add(snap.bytes(), Ordering::Relaxed);
                }
                if let Err(unsent) = answers.send((request.id, snap)) {
                    let _device = strata_kernels::device_use(&cache.device);
                    drop(unsent);
                    break;
                }
            }
            // The template's device tensors are freed on this thread, which may never have
            // touched the device (nothing was restored).
            let _device = strata_kernels::device_use(&cache.device);
            drop(template);
        })
        .expect("the OS can start a thread");
    Prefetcher { requests, results, next_id: 0 }
}

fn prefetch(cache: &SharedCache, template: &BatchState, request: &FetchRequest) -> Option<Snapshot> {
    let store = cache.writer.as_ref()?.store();
    let prompt = &request.prompt;
    let hit = match request.checkpoints.and_then(|ns| {
        store.lookup(ns, |tokens, _| if tokens.len() >= prompt.len() && tokens.starts_with(prompt) { tokens.len() } else { 0 })
    }) {
        Some(checkpoint) => checkpoint,
        None => {
            let limit = prompt.len().saturating_sub(1);
            let score = |tokens: &[u32], trim: bool| usable_prefix(tokens, trim, prompt, limit);
            let hit = store.lookup(PROMPT_NAMESPACE, score)?;
            if hit.usable <= cache.ram().best(PROMPT_NAMESPACE, score) {
                return None;
            }
            hit
        }
    };
    let started = Instant::now();
    // Creating the state on the device must not land in a decode step being recorded.
    let _device = strata_kernels::device_use(&cache.device);
    match store.load(&hit, template) {
        Ok(snap) => {
            tracing::debug!(tokens = hit.usable, micros = started.elapsed().as_micros() as u64, "restored from SSD");
            Some(snap)
        }
        Err(e) => {
            tracing::warn!(error = %e, "dropped an unreadable SSD cache entry; the prompt is prefilled instead");
            None
        }
    }
}
