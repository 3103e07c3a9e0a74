//! Model folders and architectures: `config.json`, safetensors weights (single or sharded,
//! memory-mapped), `tokenizer.json`, the chat template, `generation_config.json`, the Qwen3.5
//! hybrid text model and the dense decoders (Qwen3, Qwen2, Llama). Knows nothing of HTTP,
//! scheduling or sampling.

pub mod chat_template;
pub mod config;
pub mod dense;
pub mod error;
pub mod folder;
pub mod gemma3;
pub mod generation_config;
pub mod gguf;
pub mod images;
pub mod literal;
pub mod model;
pub mod parallel;
pub mod qwen3_5;
pub mod smoothing;
pub mod source;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;

pub use chat_template::ChatTemplate;
pub use config::Qwen35Config;
pub use dense::{Dense, DenseConfig};
pub use error::{ModelError, Result};
pub use folder::ModelFolder;
pub use gemma3::{Gemma3, Gemma3Config};
pub use generation_config::GenerationConfig;
pub use images::{ImageLimits, ImageProcessor, Normalization, Pixels, PreparedImage};
pub use model::{ArchConfig, GraphStats, Model, ModelConfig};
pub use qwen3_5::{
    expand_image_tokens, image_cache_key, mrope_positions, ImageInputs, ImagePrompt, Logits, MtpHead, Qwen35, Round, Segment,
    SegmentOutput, VisionConfig, VisionTower,
};
pub use tokenizer::Tokenizer;
