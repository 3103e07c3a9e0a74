//! `config.json` of a dense decoder (`qwen3`, `qwen2`, `llama`). Both spellings of RoPE settings
//! are read: transformers 5's `rope_parameters` and the older top-level `rope_theta` with
//! `rope_scaling`. A present field whose value would change the math in a way not implemented is
//! an error naming it.

use std::path::Path;

use serde_json::Value;

use crate::config::{token_ids, Fields};
use crate::error::{ModelError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseFamily {
    /// Qwen3ForCausalLM: per-head q/k RMSNorm, `attention_bias` on all four projections.
    Qwen3,
    /// Qwen2ForCausalLM: bias on q/k/v (always), none on o.
    Qwen2,
    /// LlamaForCausalLM: `attention_bias` on all four projections.
    Llama,
}

/// Llama 3's frequency-dependent RoPE scaling (`rope_type: "llama3"`).
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

impl Llama3Scaling {
    /// Rescales inverse frequencies as transformers' `_compute_llama3_parameters` does: long
    /// wavelengths divided by `factor`, short ones kept, the band between interpolated.
    pub fn apply(&self, inv_freq: &mut [f32]) {
        let low_wavelen = self.original_max_position_embeddings / self.low_freq_factor;
        let high_wavelen = self.original_max_position_embeddings / self.high_freq_factor;
        for f in inv_freq {
            let freq = *f as f64;
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen > low_wavelen {
                *f = (freq / self.factor) as f32;
            } else if wavelen >= high_wavelen {
                let smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor)
                    / (self.high_freq_factor - self.low_freq_factor);
                *f = ((1.0 - smooth) * freq / self.factor + smooth * freq) as f32;
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct DenseConfig {
    pub family: DenseFamily,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3Scaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
}

impl DenseConfig {
    /// Whether attention normalises q and k per head before RoPE (Qwen3 only).
    pub fn qk_norm(&self) -> bool {
        self.family == DenseFamily::Qwen3
    }

    pub fn from_json(root: &Value, path: &Path) -> Result<Self> {
        let map = root.as_object().ok_or_else(|| ModelError::file(path, "expected a JSON object"))?;
        let f = Fields { map, prefix: "", path: path.to_path_buf() };
        let family = match map.get("model_type").and_then(Value::as_str) {
            Some("qwen3") => DenseFamily::Qwen3,
            Some("qwen2") => DenseFamily::Qwen2,
            Some("llama") => DenseFamily::Llama,
            other => return Err(f.err("model_type", format!("{other:?} is not a dense model (qwen3, qwen2, llama)"))),
        };
        reject_unsupported(&f)?;
        let (rope_theta, rope_scaling) = rope(&f)?;

        let hidden_size = f.usize_or("hidden_size", 4096)?;
        let num_attention_heads = f.usize_or("num_attention_heads", 32)?;
        if num_attention_heads == 0 {
            return Err(f.err("num_attention_heads", "must be at least 1"));
        }
        // Qwen3 configs default head_dim to 128; the others derive it from the hidden size.
        let head_dim_default = if family == DenseFamily::Qwen3 { 128 } else { hidden_size / num_attention_heads };
        let attention_bias = f.bool_or("attention_bias", false)?;
        let cfg = DenseConfig {
            family,
            vocab_size: f.usize_or("vocab_size", 151_936)?,
            hidden_size,
            intermediate_size: f.usize_or("intermediate_size", 11_008)?,
            num_hidden_layers: f.usize_or("num_hidden_layers", 32)?,
            num_attention_heads,
            num_key_value_heads: f.usize_or("num_key_value_heads", num_attention_heads)?,
            head_dim: f.usize_or("head_dim", head_dim_default)?,
            qkv_bias: family == DenseFamily::Qwen2 || attention_bias,
            o_bias: family != DenseFamily::Qwen2 && attention_bias,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            rope_scaling,
            max_position_embeddings: f.usize_or("max_position_embeddings", 32_768)?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            eos_token_ids: f.get("eos_token_id").map(token_ids).unwrap_or_default(),
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
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
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
        Ok(())
    }
}

/// Fields that, when present with these values, change the math in ways not implemented.
fn reject_unsupported(f: &Fields) -> Result<()> {
    if let Some(act) = f.get("hidden_act") {
        if act.as_str() != Some("silu") {
            return Err(f.err("hidden_act", format!("{act} is not supported (only \"silu\")")));
        }
    }
    if f.bool_or("use_sliding_window", false)? {
        return Err(f.err("use_sliding_window", "sliding-window attention is not supported"));
    }
    if f.bool_or("mlp_bias", false)? {
        return Err(f.err("mlp_bias", "MLP biases are not supported"));
    }
    full_rotary(f)?;
    if let Some(Value::Array(kinds)) = f.get("layer_types") {
        if let Some(i) = kinds.iter().position(|k| k.as_str() != Some("full_attention")) {
            return Err(f.err(&format!("layer_types[{i}]"), format!("{} is not supported (only \"full_attention\")", kinds[i])));
        }
    }
    Ok(())
}

fn full_rotary(f: &Fields) -> Result<()> {
    match f.get("partial_rotary_factor") {
        Some(factor) if factor.as_f64() != Some(1.0) => {
            Err(f.err("partial_rotary_factor", format!("{factor} is not supported (only 1.0)")))
        }
        _ => Ok(()),
    }
}

/// `rope_theta` and the optional Llama 3 scaling, from `rope_parameters` (transformers 5) or
/// `rope_scaling` (older configs; the theta then sits at the top level).
fn rope(f: &Fields) -> Result<(f64, Option<Llama3Scaling>)> {
    let (key, params) = match (f.get("rope_parameters"), f.get("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", p),
        (None, Some(p)) => ("rope_scaling", p),
        (None, None) => return Ok((f.f64_or("rope_theta", 10_000.0)?, None)),
    };
    let map = params.as_object().ok_or_else(|| f.err(key, format!("expected an object, found {params}")))?;
    let prefix = format!("{key}.");
    let p = Fields { map, prefix: &prefix, path: f.path.clone() };
    let theta = p.f64_or("rope_theta", f.f64_or("rope_theta", 10_000.0)?)?;
    full_rotary(&p)?;
    // Older configs spell the kind `type`.
    let type_key = if p.get("rope_type").is_some() { "rope_type" } else { "type" };
    let scaling = match p.get(type_key) {
        None => None,
        Some(kind) => match kind.as_str() {
            Some("default") => None,
            Some("llama3") => Some(llama3(&p)?),
            _ => return Err(p.err(type_key, format!("{kind} is not supported (only \"default\" and \"llama3\")"))),
        },
    };
    Ok((theta, scaling))
}

fn llama3(p: &Fields) -> Result<Llama3Scaling> {
    let required = |name: &str| -> Result<f64> {
        let v = p.get(name).and_then(Value::as_f64).filter(|v| *v > 0.0);
        v.ok_or_else(|| p.err(name, "required by llama3 scaling, as a positive number"))
    };
    let s = Llama3Scaling {
        factor: required("factor")?,
        low_freq_factor: required("low_freq_factor")?,
        high_freq_factor: required("high_freq_factor")?,
        original_max_position_embeddings: required("original_max_position_embeddings")?,
    };
    if s.high_freq_factor <= s.low_freq_factor {
        return Err(p.err("high_freq_factor", "must exceed low_freq_factor"));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<DenseConfig> {
        DenseConfig::from_json(&v, Path::new("config.json"))
    }

    #[test]
    fn families_and_rope_spellings() {
        let q2 = parse(json!({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 1e6,
                              "rope_scaling": null, "eos_token_id": 7}))
        .unwrap();
        assert_eq!((q2.head_dim, q2.num_key_value_heads, q2.qkv_bias, q2.o_bias, q2.qk_norm()), (16, 4, true, false, false));
        assert_eq!((q2.rope_theta, q2.rope_scaling.clone(), q2.eos_token_ids.clone()), (1e6, None, vec![7]));

        let q3 = parse(json!({"model_type": "qwen3", "attention_bias": true, "layer_types": ["full_attention"]})).unwrap();
        assert_eq!((q3.head_dim, q3.qkv_bias, q3.o_bias, q3.qk_norm()), (128, true, true, true));

        let want =
            Llama3Scaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192.0 };
        let old = json!({"model_type": "llama", "rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}});
        let new = json!({"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}});
        for v in [old, new] {
            let c = parse(v).unwrap();
            assert_eq!((c.rope_theta, c.rope_scaling), (5e5, Some(want.clone())));
        }
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (json!({"model_type": "mistral"}), "model_type"),
            (json!({"model_type": "qwen3", "use_sliding_window": true}), "use_sliding_window"),
            (json!({"model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"]}), "layer_types[1]"),
            (json!({"model_type": "llama", "mlp_bias": true}), "mlp_bias"),
            (json!({"model_type": "llama", "hidden_act": "gelu"}), "hidden_act"),
            (json!({"model_type": "llama", "rope_scaling": {"type": "yarn", "factor": 4.0}}), "rope_scaling.type"),
            (json!({"model_type": "qwen3", "rope_parameters": {"rope_type": "dynamic"}}), "rope_parameters.rope_type"),
            (
                json!({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
                "rope_scaling.low_freq_factor",
            ),
            (json!({"model_type": "llama", "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
            (json!({"model_type": "qwen3", "num_key_value_heads": 3}), "num_key_value_heads"),
            (json!({"model_type": "qwen3", "head_dim": 15}), "head_dim"),
        ];
        for (json, field) in cases {
            let err = parse(json.clone()).unwrap_err().to_string();
            assert!(err.contains(&format!("`{field}`")), "{json}: {err}");
        }
    }
}
