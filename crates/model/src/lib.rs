//! Model folders and architectures: `config.json`, safetensors weights (single or sharded,
//! memory-mapped), `tokenizer.json`, the chat template, `generation_config.json`, and the
//! Qwen3.5 hybrid text model. Knows nothing of HTTP, scheduling or sampling.

pub mod chat_template;
pub mod config;
pub mod error;
pub mod folder;
pub mod generation_config;
pub mod qwen3_5;
pub mod source;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;

pub use chat_template::ChatTemplate;
pub use config::Qwen35Config;
pub use error::{ModelError, Result};
pub use folder::ModelFolder;
pub use generation_config::GenerationConfig;
pub use qwen3_5::{Logits, Qwen35, Round, StateCost};
pub use tokenizer::Tokenizer;
