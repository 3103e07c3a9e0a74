//! `config.json` of a Gemma 3 text model (`gemma3_text`, or `gemma3` with a `text_config`).
//! Both spellings of the RoPE settings are read: transformers 5's `rope_parameters` keyed by
//! layer type, and the older `rope_theta` / `rope_local_base_freq` / `rope_scaling`. A GGUF file
//! reaches this parser through [`crate::gguf::GgufFile::hf_config`].

use std::path::Path;

use serde_json::Value;

use crate::config::{token_ids, Fields};
use crate::error::{ModelError, Result};

/// RoPE of one layer type: base and linear position scaling (`factor` 1 = none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeSettings {
    pub theta: f64,
    pub linear_factor: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    /// Per layer: whether it attends over a sliding window (else over everything).
    pub sliding: Vec<bool>,
    pub sliding_window: usize,
    pub global_rope: RopeSettings,
    pub local_rope: RopeSettings,
    /// Queries are scaled by `query_pre_attn_scalar ^ -0.5`.
    pub query_pre_attn_scalar: f64,
    /// Logits become `cap * tanh(logits / cap)`. (`attn_logit_softcapping` is read by neither
    /// transformers' Gemma 3 nor llama.cpp's — q/k norms replaced it — so it is ignored here too.)
    pub final_logit_softcapping: Option<f64>,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
}

impl Gemma3Config {
    pub fn from_json(root: &Value, path: &Path) -> Result<Self> {
        let top = root.as_object().ok_or_else(|| ModelError::file(path, "expected a JSON object"))?;
        // The multimodal `gemma3` config nests the text model's settings.
        let (map, prefix) = match top.get("text_config").and_then(Value::as_object) {
            Some(text) if top.get("model_type").and_then(Value::as_str) == Some("gemma3") => (text, "text_config."),
            _ => (top, ""),
        };
        let f = Fields { map, prefix, path: path.to_path_buf() };
        if let Some(act) = f.get("hidden_activation").or(f.get("hidden_act")) {
            if act.as_str() != Some("gelu_pytorch_tanh") {
                return Err(f.err("hidden_activation", format!("{act} is not supported (only \"gelu_pytorch_tanh\")")));
            }
        }
        if f.bool_or("use_bidirectional_attention", false)? {
            return Err(f.err("use_bidirectional_attention", "bidirectional attention is not supported"));
        }
        if f.bool_or("attention_bias", false)? {
            return Err(f.err("attention_bias", "attention biases are not supported for gemma3"));
        }
        let num_hidden_layers = f.usize_or("num_hidden_layers", 26)?;
        let num_attention_heads = f.usize_or("num_attention_heads", 8)?;
        let head_dim = f.usize_or("head_dim", 256)?;
        let (global_rope, local_rope) = rope(&f)?;
        let cfg = Gemma3Config {
            vocab_size: f.usize_or("vocab_size", 262_208)?,
            hidden_size: f.usize_or("hidden_size", 2304)?,
            intermediate_size: f.usize_or("intermediate_size", 9216)?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", 4)?,
            head_dim,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            sliding: layer_types(&f, num_hidden_layers)?,
            sliding_window: f.usize_or("sliding_window", 4096)?,
            global_rope,
            local_rope,
            query_pre_attn_scalar: f.f64_or("query_pre_attn_scalar", 256.0)?,
            final_logit_softcapping: f
                .get("final_logit_softcapping")
                .map(|_| f.f64_or("final_logit_softcapping", 0.0))
                .transpose()?,
            max_position_embeddings: f.usize_or("max_position_embeddings", 131_072)?,
            eos_token_ids: f.get("eos_token_id").or(top.get("eos_token_id")).map(token_ids).unwrap_or_default(),
        };
        cfg.validate(&f)?;
        Ok(cfg)
    }

    fn validate(&self, f: &Fields) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("sliding_window", self.sliding_window),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(f.err(name, "must be at least 1"));
            }
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(f.err("head_dim", format!("{} is odd; RoPE rotates halves of each head", self.head_dim)));
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(f.err(
                "num_key_value_heads",
                format!("{} does not divide num_attention_heads {}", self.num_key_value_heads, self.num_attention_heads),
            ));
        }
        if self.final_logit_softcapping.is_some_and(|c| c <= 0.0) {
            return Err(f.err("final_logit_softcapping", "must be positive"));
        }
        if self.query_pre_attn_scalar <= 0.0 {
            return Err(f.err("query_pre_attn_scalar", "must be positive"));
        }
        Ok(())
    }
}

/// Which layers slide: `layer_types`, else every `sliding_window_pattern`-th layer is global.
fn layer_types(f: &Fields, layers: usize) -> Result<Vec<bool>> {
    if let Some(kinds) = f.get("layer_types") {
        let kinds = kinds.as_array().ok_or_else(|| f.err("layer_types", "expected a list"))?;
        if kinds.len() != layers {
            return Err(f.err("layer_types", format!("has {} entries for {layers} layers", kinds.len())));
        }
        return kinds
            .iter()
            .enumerate()
            .map(|(i, k)| match k.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(
                    f.err(&format!("layer_types[{i}]"), format!("{k} is not a layer type (sliding_attention, full_attention)"))
                ),
            })
            .collect();
    }
    let key = if f.get("sliding_window_pattern").is_some() { "sliding_window_pattern" } else { "_sliding_window_pattern" };
    let pattern = f.usize_or(key, 6)?;
    if pattern == 0 {
        return Err(f.err(key, "must be at least 1"));
    }
    Ok((0..layers).map(|i| (i + 1) % pattern != 0).collect())
}

/// Global and local RoPE settings.
fn rope(f: &Fields) -> Result<(RopeSettings, RopeSettings)> {
    if let Some(params) = f.get("rope_parameters") {
        let map = params.as_object().ok_or_else(|| f.err("rope_parameters", format!("expected an object, found {params}")))?;
        let by_type = |kind: &str, default_theta: f64| -> Result<RopeSettings> {
            let prefix = format!("{}rope_parameters.{kind}.", f.prefix);
            match map.get(kind).and_then(Value::as_object) {
                Some(m) => settings(&Fields { map: m, prefix: &prefix, path: f.path.clone() }, default_theta),
                None => Ok(RopeSettings { theta: default_theta, linear_factor: 1.0 }),
            }
        };
        return Ok((by_type("full_attention", 1e6)?, by_type("sliding_attention", 10_000.0)?));
    }
    let global = match f.get("rope_scaling").and_then(Value::as_object) {
        Some(m) => {
            let prefix = format!("{}rope_scaling.", f.prefix);
            let s = settings(&Fields { map: m, prefix: &prefix, path: f.path.clone() }, 1e6)?;
            RopeSettings { theta: f.f64_or("rope_theta", 1e6)?, ..s }
        }
        None => RopeSettings { theta: f.f64_or("rope_theta", 1e6)?, linear_factor: 1.0 },
    };
    Ok((global, RopeSettings { theta: f.f64_or("rope_local_base_freq", 10_000.0)?, linear_factor: 1.0 }))
}

fn settings(p: &Fields, default_theta: f64) -> Result<RopeSettings> {
    let type_key = if p.get("rope_type").is_some() { "rope_type" } else { "type" };
    let linear_factor = match p.get(type_key).and_then(Value::as_str) {
        None | Some("default") => 1.0,
        Some("linear") => p.f64_or("factor", 1.0)?,
        Some(other) => return Err(p.err(type_key, format!("\"{other}\" is not supported (only \"default\" and \"linear\")"))),
    };
    if linear_factor <= 0.0 {
        return Err(p.err("factor", "must be positive"));
    }
    Ok(RopeSettings { theta: p.f64_or("rope_theta", default_theta)?, linear_factor })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Gemma3Config> {
        Gemma3Config::from_json(&v, Path::new("config.json"))
    }

    #[test]
    fn both_rope_spellings_and_layer_patterns() {
        let new = parse(json!({"model_type": "gemma3_text", "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}))
        .unwrap();
        assert_eq!(new.sliding, vec![true, false, true, true]);
        assert_eq!(new.global_rope, RopeSettings { theta: 1e6, linear_factor: 8.0 });
        assert_eq!(new.local_rope, RopeSettings { theta: 1e4, linear_factor: 1.0 });

        let old = parse(json!({"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
            "num_hidden_layers": 7, "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "final_logit_softcapping": 30.0}}))
        .unwrap();
        assert_eq!(old.sliding, vec![true, true, true, true, true, false, true]);
        assert_eq!(old.global_rope, RopeSettings { theta: 1e6, linear_factor: 8.0 });
        assert_eq!(old.final_logit_softcapping, Some(30.0));
        assert_eq!(old.eos_token_ids, vec![1, 106]);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (json!({"model_type": "gemma3_text", "hidden_activation": "gelu"}), "hidden_activation"),
            (json!({"model_type": "gemma3_text", "num_hidden_layers": 2, "layer_types": ["sliding_attention"]}), "layer_types"),
            (json!({"model_type": "gemma3_text", "num_hidden_layers": 1, "layer_types": ["chunked"]}), "layer_types[0]"),
            (
                json!({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "yarn"}}}),
                "rope_parameters.full_attention.rope_type",
            ),
            (json!({"model_type": "gemma3_text", "num_key_value_heads": 3}), "num_key_value_heads"),
            (json!({"model_type": "gemma3_text", "use_bidirectional_attention": true}), "use_bidirectional_attention"),
            (json!({"model_type": "gemma3", "text_config": {"sliding_window": 0}}), "text_config.sliding_window"),
        ];
        for (json, field) in cases {
            let err = parse(json.clone()).unwrap_err().to_string();
            assert!(err.contains(&format!("`{field}`")), "{json}: {err}");
        }
    }
}
