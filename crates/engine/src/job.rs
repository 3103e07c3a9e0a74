//! A job and what it reports: what requesters hand the engine thread, and how it answers.

use strata_model::PreparedImage;

use crate::cache::Snapshot;
use crate::generate::{Generation, GenerationOptions, Sampled};

/// What a job reports, in order: `Started` once its prompt state is in place, tokens, then
/// exactly one `Finished` or `Failed` (which may also come first).
#[derive(Debug)]
pub enum Event {
    /// `cached_tokens` prompt tokens came from the prompt cache instead of a forward.
    Started {
        cached_tokens: usize,
    },
    Token(Sampled),
    Finished(Generation),
    Failed(String),
}

/// Where a job's events go. `send` returns false once nobody is listening.
pub trait EventSink: Send {
    fn send(&mut self, event: Event) -> bool;
    fn is_closed(&self) -> bool;
}

pub struct Job {
    pub prompt: Vec<u32>,
    pub opts: GenerationOptions,
    pub sink: Box<dyn EventSink>,
    /// Prompt lengths at which the prompt cache should also keep a snapshot, e.g. where the
    /// conversation so far ends in a chat prompt: the next turn re-renders the history and
    /// shares exactly that prefix, while the tail after it (the generation prompt) may differ.
    pub cache_points: Vec<usize>,
    /// The prompt's images, in order: each run of the model's image token takes the next.
    /// Prepared by the requester, off the engine thread.
    pub images: Vec<PreparedImage>,
    /// The prompt as the prompt cache keys it, where it holds images (set by `submit`).
    pub(crate) image_key: Option<Vec<u32>>,
}

impl Job {
    pub fn new(prompt: Vec<u32>, opts: GenerationOptions, sink: Box<dyn EventSink>) -> Self {
        Self { prompt, opts, sink, cache_points: Vec::new(), images: Vec::new(), image_key: None }
    }

    /// Whether the prompt holds images (known from `submit` on; the images themselves are let
    /// go once the vision tower has read them).
    pub fn has_images(&self) -> bool {
        self.image_key.is_some()
    }

    /// The prompt's tokens as the prompt cache and the SSD tier key them: images by content.
    pub fn cache_tokens(&self) -> &[u32] {
        self.image_key.as_deref().unwrap_or(&self.prompt)
    }
}

/// A job waiting for the engine thread, with the SSD read done for it.
pub(crate) struct Queued {
    pub job: Job,
    pub fetch: Fetch,
}

/// Where the SSD read for a waiting job stands.
pub(crate) enum Fetch {
    /// Not asked for yet (the job is not next, or does not fit the budget yet).
    Unasked,
    /// Asked for under this request id.
    Pending(u64),
    /// Done: a prompt-cache entry read from SSD, a generation checkpoint to resume from, or
    /// nothing usable.
    Ready(Option<Snapshot>),
}
