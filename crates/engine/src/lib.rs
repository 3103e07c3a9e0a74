//! Turning logits into tokens: the sampler and the generation loop. Knows models only through
//! their forward and state; knows nothing of HTTP or files.

pub mod generate;
pub mod sampler;

pub use generate::{generate, FinishReason, Generation, GenerationOptions};
pub use sampler::{Sampler, SamplingParams};
