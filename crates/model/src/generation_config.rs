//! `generation_config.json`: end-of-sequence ids and the model's default sampling.

use std::path::Path;

use serde_json::Value;

use crate::error::{ModelError, Result};

#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
}

impl GenerationConfig {
    /// Reads `generation_config.json` in `dir`; absent means no defaults.
    pub fn from_folder(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let json = crate::error::read_json(&path)?;
        let num = |name: &str| -> Result<Option<f64>> {
            match json.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => {
                    v.as_f64().map(Some).ok_or_else(|| ModelError::field(&path, name, format!("expected a number, found {v}")))
                }
            }
        };
        Ok(Self {
            eos_token_ids: json.get("eos_token_id").map(crate::config::token_ids).unwrap_or_default(),
            do_sample: json.get("do_sample").and_then(Value::as_bool),
            temperature: num("temperature")?,
            top_p: num("top_p")?,
            top_k: num("top_k")?.map(|k| k as usize),
            min_p: num("min_p")?,
            repetition_penalty: num("repetition_penalty")?,
            presence_penalty: num("presence_penalty")?,
            frequency_penalty: num("frequency_penalty")?,
        })
    }
}
