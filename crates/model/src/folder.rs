//! A model folder in the layout Hugging Face uses, opened and checked as a whole.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};

use crate::chat_template::ChatTemplate;
use crate::error::{ModelError, Result};
use crate::generation_config::GenerationConfig;
use crate::model::{ArchConfig, Model, ModelConfig};
use crate::source::FileSource;
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;

pub struct ModelFolder {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub generation: GenerationConfig,
    weights: Weights,
}

impl ModelFolder {
    /// Reads config, tokenizer, template and generation config, and validates the weight
    /// files' headers. Tensors are read by [`ModelFolder::load_model`] (or `load`).
    pub fn open(path: &Path) -> Result<Self> {
        if !path.is_dir() {
            return Err(ModelError::MissingFolder(path.to_path_buf()));
        }
        let config_path = path.join("config.json");
        if !config_path.exists() {
            return Err(ModelError::file(&config_path, "missing: a model folder needs config.json"));
        }
        let config = ArchConfig::from_file(&config_path)?.into();
        let tokenizer = Tokenizer::from_file(&path.join("tokenizer.json"))?;
        let chat_template = ChatTemplate::from_folder(path)?;
        let generation = GenerationConfig::from_folder(path)?;
        let weights = Weights::open(path)?;
        Ok(Self { path: path.to_path_buf(), config, tokenizer, chat_template, generation, weights })
    }

    /// End-of-sequence ids from the config and generation config.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let mut ids = self.generation.eos_token_ids.clone();
        for id in &self.config.eos_token_ids {
            if !ids.contains(id) {
                ids.push(*id);
            }
        }
        ids
    }

    /// Loads the model of whatever supported family the folder holds.
    pub fn load(&self, dtype: DType, device: &Device) -> Result<Model> {
        Model::load(&self.config.arch, &self.source(device), dtype)
    }

    /// Where the text model's tensors are. Qwen3.5 releases name them `model.language_model.*`
    /// (with `model.visual.*` and `mtp.*` beside them, not used by the text model); flat text
    /// checkpoints and dense models name them `model.*`.
    fn source(&self, device: &Device) -> FileSource<'_> {
        let prefix =
            if self.weights.contains("model.language_model.embed_tokens.weight") { "model.language_model." } else { "model." };
        FileSource { weights: &self.weights, prefix: prefix.into(), device: device.clone() }
    }
}
