//! A model: a folder in the layout Hugging Face uses, or a single GGUF file (or a folder holding
//! one), opened and checked as a whole.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};

use crate::chat_template::ChatTemplate;
use crate::config::Qwen35Config;
use crate::dense::Dense;
use crate::error::{ModelError, Result};
use crate::gemma3::Gemma3;
use crate::generation_config::GenerationConfig;
use crate::gguf::GgufFile;
use crate::images::ImageProcessor;
use crate::model::{ArchConfig, Model, ModelConfig};
use crate::parallel::Collective;
use crate::qwen3_5::{MtpHead, Qwen35, VisionConfig, VisionTower};
use crate::source::{FileSource, WeightSource};
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;

/// Where the tensors are.
enum Tensors {
    Safetensors(Weights),
    Gguf(GgufFile),
}

pub struct ModelFolder {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub generation: GenerationConfig,
    /// How images are prepared (`preprocessor_config.json`), for a model with a vision tower.
    pub image_processor: Option<ImageProcessor>,
    tensors: Tensors,
}

/// Gemma's turn format, for GGUF files of the family that carry no template of their own.
const GEMMA_CHAT_TEMPLATE: &str = include_str!("gguf/gemma_chat.jinja");

impl ModelFolder {
    /// Reads config, tokenizer, template and generation config, and validates the weight
    /// files' headers. Tensors are read by [`ModelFolder::load`]. `path` is a Hugging Face
    /// folder, a `.gguf` file, or a folder holding exactly one `.gguf` file and no config.json.
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_file() {
            return Self::open_gguf(path);
        }
        if !path.is_dir() {
            return Err(ModelError::MissingFolder(path.to_path_buf()));
        }
        let config_path = path.join("config.json");
        if !config_path.exists() {
            return match gguf_files(path)?.as_slice() {
                [one] => Self::open_gguf(one),
                [] => Err(ModelError::file(&config_path, "missing: a model folder needs config.json (or a single .gguf file)")),
                many => Err(ModelError::file(
                    path,
                    format!("holds {} .gguf files and no config.json; pass the file to use", many.len()),
                )),
            };
        }
        let config = ArchConfig::from_file(&config_path)?.into();
        let tokenizer = Tokenizer::from_folder(path)?;
        let chat_template = ChatTemplate::from_folder(path)?.map(|t| t.with_special_tokens(&tokenizer));
        let generation = GenerationConfig::from_folder(path)?;
        let weights = Weights::open(path)?;
        let image_processor = match &config {
            ModelConfig { arch: ArchConfig::Qwen35(Qwen35Config { vision: Some(vision), .. }), .. } => {
                ImageProcessor::from_folder(path)?
                    .map(|p| p.checked_against(vision, &path.join("preprocessor_config.json")))
                    .transpose()?
            }
            _ => None,
        };
        Ok(Self {
            path: path.to_path_buf(),
            config,
            tokenizer,
            chat_template,
            generation,
            image_processor,
            tensors: Tensors::Safetensors(weights),
        })
    }

    fn open_gguf(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let config: ModelConfig = ArchConfig::from_json(&file.hf_config()?, path)?.into();
        let tokenizer = Tokenizer::from_gguf(file.metadata()).map_err(|e| ModelError::file(path, e))?;
        let template_source = match file.chat_template() {
            Some(t) => Some(t.to_string()),
            None if file.architecture() == "gemma3" => Some(GEMMA_CHAT_TEMPLATE.to_string()),
            None => None,
        };
        let chat_template = template_source
            .map(|source| ChatTemplate::new(&source).map_err(|e| ModelError::file(path, format!("tokenizer.chat_template: {e}"))))
            .transpose()?
            .map(|t| t.with_special_tokens(&tokenizer));
        // Chat turns end with an end-of-turn token the template writes; stop there too.
        let mut eos_token_ids = config.eos_token_ids.clone();
        for marker in ["<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>"] {
            if let Some(id) = tokenizer.token_id(marker).filter(|id| !eos_token_ids.contains(id)) {
                eos_token_ids.push(id);
            }
        }
        // GGUF files carry no sampling settings: take llama.cpp's defaults, which its users expect.
        let generation = GenerationConfig {
            eos_token_ids,
            do_sample: Some(true),
            temperature: Some(0.8),
            top_k: Some(40),
            top_p: Some(0.95),
            min_p: Some(0.05),
            ..GenerationConfig::default()
        };
        Ok(Self {
            path: path.to_path_buf(),
            config,
            tokenizer,
            chat_template,
            generation,
            image_processor: None,
            tensors: Tensors::Gguf(file),
        })
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

    /// Loads the model of whatever supported family the folder holds. GGUF matrices stay
    /// quantized (activations in `dtype`).
    pub fn load(&self, dtype: DType, device: &Device) -> Result<Model> {
        match &self.tensors {
            Tensors::Safetensors(weights) => Model::load(&self.config.arch, &FileSource::text_model(weights, device), dtype),
            Tensors::Gguf(file) => Model::load(&self.config.arch, &file.source(device, false)?, dtype),
        }
    }

    /// This rank's share of the model split over `group` (tensor parallelism, see
    /// [`crate::parallel`]); GGUF matrices are dequantized to `dtype`.
    pub fn load_sharded(&self, dtype: DType, device: &Device, group: Arc<dyn Collective>) -> Result<Model> {
        let load = |src: &dyn WeightSource| -> Result<Model> {
            Ok(match &self.config.arch {
                ArchConfig::Qwen35(cfg) => Model::Qwen35(Qwen35::load_sharded(cfg, src, dtype, group)?),
                ArchConfig::Dense(cfg) => Model::Dense(Dense::load_sharded(cfg, src, dtype, group)?),
                ArchConfig::Gemma3(cfg) => Model::Gemma3(Gemma3::load_sharded(cfg, src, dtype, group)?),
            })
        };
        match &self.tensors {
            Tensors::Safetensors(weights) => load(&FileSource::text_model(weights, device)),
            Tensors::Gguf(file) => load(&file.source(device, true)?),
        }
        .map_err(|e| ModelError::file(&self.path, e))
    }

    /// [`ModelFolder::load`], with the vision tower attached where the folder has one.
    pub fn load_with_vision(&self, dtype: DType, device: &Device) -> Result<Model> {
        let mut model = self.load(dtype, device)?;
        if let (Model::Qwen35(m), true) = (&mut model, self.has_vision()) {
            m.set_vision(self.load_vision(dtype, device)?)?;
        }
        Ok(model)
    }

    /// Whether the folder has a vision tower and the processor of its images.
    pub fn has_vision(&self) -> bool {
        self.vision_config().is_some() && self.image_processor.is_some()
    }

    /// The vision tower's config (`vision_config` of a Qwen3.5 `config.json`), where there is one.
    pub fn vision_config(&self) -> Option<&VisionConfig> {
        match &self.config.arch {
            ArchConfig::Qwen35(Qwen35Config { vision, .. }) => vision.as_ref(),
            _ => None,
        }
    }

    /// Loads the model with every GGUF tensor dequantized to `dtype` (the same as [`load`] for
    /// safetensors folders): for comparison against references that dequantize.
    ///
    /// [`load`]: ModelFolder::load
    pub fn load_dequantized(&self, dtype: DType, device: &Device) -> Result<Model> {
        match &self.tensors {
            Tensors::Safetensors(_) => self.load(dtype, device),
            Tensors::Gguf(file) => Model::load(&self.config.arch, &file.source(device, true)?, dtype),
        }
    }

    /// The multi-token-prediction head shipped beside `target` (loaded from this folder), in
    /// `target`'s dtype and device: a draft source that needs no second model.
    pub fn load_mtp(&self, target: &Model) -> Result<MtpHead> {
        match &self.tensors {
            Tensors::Safetensors(weights) if weights.contains("mtp.fc.weight") || !matches!(target, Model::Qwen35(_)) => {
                target.mtp_head(&FileSource::text_model(weights, target.device())).map_err(|e| ModelError::file(&self.path, e))
            }
            Tensors::Safetensors(_) => Err(ModelError::file(
                &self.path,
                "holds no multi-token-prediction head (no mtp.* tensors; some conversions drop them)",
            )),
            // llama.cpp's converter writes the head as an extra block, `blk.{N}.nextn.*`.
            Tensors::Gguf(file) => {
                let has_head = file.mtp_block()?.is_some();
                if !has_head && matches!(target, Model::Qwen35(_)) {
                    return Err(ModelError::file(
                        &self.path,
                        "holds no multi-token-prediction head (no nextn block `blk.N.nextn.*`; \
                         some conversions drop it)",
                    ));
                }
                let src = file.source(target.device(), false)?;
                target.mtp_head(&src).map_err(|e| ModelError::file(&self.path, e))
            }
        }
    }

    /// The vision tower (`model.visual.*`) in `dtype` on `device`: an error naming what is
    /// missing when the folder cannot take images (no `vision_config`, no
    /// `preprocessor_config.json`, a GGUF file).
    pub fn load_vision(&self, dtype: DType, device: &Device) -> Result<VisionTower> {
        let Some(vision) = self.vision_config() else {
            return Err(ModelError::file(&self.path, "has no vision tower (its config.json has no vision_config)"));
        };
        if self.image_processor.is_none() {
            return Err(ModelError::file(&self.path, "has no preprocessor_config.json, which says how images are prepared"));
        }
        match &self.tensors {
            Tensors::Safetensors(weights) => {
                let src = FileSource { weights, prefix: "model.visual.".into(), device: device.clone() };
                VisionTower::load(vision, &src, dtype)
            }
            Tensors::Gguf(_) => {
                Err(ModelError::file(&self.path, "is a GGUF file; strata reads a vision tower only from safetensors"))
            }
        }
    }
}

/// The `.gguf` files directly in `dir`.
fn gguf_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| ModelError::file(dir, format!("cannot list: {e}")))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x.eq_ignore_ascii_case("gguf")))
        .collect();
    files.sort();
    Ok(files)
}
