//! `config.json` of a Qwen3.5 model: the nested `qwen3_5` layout real releases ship (text fields
//! under `text_config`) and the flat `qwen3_5_text` one, and the same two of the
//! mixture-of-experts family (`qwen3_5_moe`, `qwen3_5_moe_text`). Every field that changes the math is
//! read; a present field whose value the code does not implement is an error naming it.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};
pub use crate::qwen3_5::vision::VisionConfig;

/// The `model_type`s this module reads.
pub const SUPPORTED_MODEL_TYPES: [&str; 4] = ["qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention, recurrent state).
    Linear,
    /// Gated softmax attention (KV state).
    Full,
}

/// The feed-forward block after each layer's mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeedForward {
    /// One SwiGLU MLP of this width (`qwen3_5`).
    Dense { intermediate_size: usize },
    /// Routed SwiGLU experts and a shared one behind a sigmoid gate (`qwen3_5_moe`).
    Experts(ExpertsConfig),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertsConfig {
    pub num_experts: usize,
    /// Experts each token is routed to (top-k of the router's softmax, renormalized).
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
}

impl FeedForward {
    /// The widest activation a token's pass through it holds (for memory planning).
    pub fn widest(&self) -> usize {
        match *self {
            FeedForward::Dense { intermediate_size } => intermediate_size,
            FeedForward::Experts(e) => {
                (e.num_experts_per_tok * e.moe_intermediate_size).max(e.shared_expert_intermediate_size).max(e.num_experts)
            }
        }
    }
}

/// A model's weights in elements: those stored in the compute dtype (the matrices; all of them,
/// and those one token reads, which for a mixture of experts is its routed experts only) and the
/// few kept in f32 whatever the dtype (norms, the DeltaNet's conv and decay).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightCount {
    pub at_dtype: u64,
    pub active_at_dtype: u64,
    pub f32: u64,
}

impl WeightCount {
    fn add(&mut self, at_dtype: u64, active_at_dtype: u64, f32: u64) {
        self.at_dtype += at_dtype;
        self.active_at_dtype += active_at_dtype;
        self.f32 += f32;
    }

    /// Parameters in all.
    pub fn total(&self) -> u64 {
        self.at_dtype + self.f32
    }

    /// Bytes resident with the matrices in `dtype`.
    pub fn bytes(&self, dtype: candle_core::DType) -> u64 {
        self.at_dtype * dtype.size_in_bytes() as u64 + 4 * self.f32
    }

    /// Bytes one token's forward reads with the matrices in `dtype` (the roofline's weight traffic).
    pub fn active_bytes(&self, dtype: candle_core::DType) -> u64 {
        self.active_at_dtype * dtype.size_in_bytes() as u64 + 4 * self.f32
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Qwen35Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub feed_forward: FeedForward,
    pub layer_types: Vec<LayerKind>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub attention_bias: bool,
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    /// Rotary frequencies driven by the temporal, height and width position streams (mRoPE,
    /// interleaved t, h, w, t, h, w, …; the rest temporal). Text alone moves all three together.
    pub mrope_section: [usize; 3],
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    /// Layers of the multi-token-prediction head shipped under `mtp.*` (0 when absent).
    pub mtp_num_hidden_layers: usize,
    /// The vision tower of nested (`qwen3_5`, `qwen3_5_moe`) configs: images in.
    pub vision: Option<VisionConfig>,
}

impl Qwen35Config {
    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// Width of the rotated part of each attention head (NeoX half-split, even).
    pub fn rotary_dim(&self) -> usize {
        let d = (self.head_dim as f64 * self.partial_rotary_factor) as usize;
        d - d % 2
    }

    /// Channels of the DeltaNet conv: q and k for all key heads, v for all value heads.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// The text decoder's weights (embedding, layers, output head; not the MTP head or a vision
    /// tower), counted from the shapes its loader asks for.
    pub fn weight_count(&self) -> WeightCount {
        let (h, v) = (self.hidden_size as u64, self.vocab_size as u64);
        let mut count = WeightCount::default();
        // A token reads one row of the embedding, and all of the output head.
        count.add(v * h * if self.tie_word_embeddings { 1 } else { 2 }, v * h, 0);
        count.add(0, 0, h); // the final norm
        let (hv, dv) = (self.linear_num_value_heads as u64, self.linear_value_head_dim as u64);
        let (q, kv, d) = (self.num_attention_heads as u64, self.num_key_value_heads as u64, self.head_dim as u64);
        for kind in &self.layer_types {
            count.add(0, 0, 2 * h); // the input and post-attention norms
            match kind {
                LayerKind::Linear => {
                    let conv = self.linear_conv_dim() as u64;
                    let matrices = h * (conv + hv * dv + 2 * hv) + hv * dv * h;
                    count.add(matrices, matrices, conv * self.linear_conv_kernel_dim as u64 + 2 * hv + dv);
                }
                LayerKind::Full => {
                    let matrices = h * (2 * q * d + 2 * kv * d) + q * d * h;
                    let biases = if self.attention_bias { 2 * q * d + 2 * kv * d + h } else { 0 };
                    count.add(matrices + biases, matrices + biases, 2 * d);
                }
            }
            match self.feed_forward {
                FeedForward::Dense { intermediate_size } => {
                    let mlp = 3 * h * intermediate_size as u64;
                    count.add(mlp, mlp, 0);
                }
                FeedForward::Experts(e) => {
                    let expert = 3 * h * e.moe_intermediate_size as u64;
                    let always = h * e.num_experts as u64 + 3 * h * e.shared_expert_intermediate_size as u64 + h;
                    count.add(e.num_experts as u64 * expert + always, e.num_experts_per_tok as u64 * expert + always, 0);
                }
            }
        }
        count
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let root = crate::error::read_json(path)?;
        Self::from_json(&root, path)
    }

    pub fn from_json(root: &Value, path: &Path) -> Result<Self> {
        let top = root.as_object().ok_or_else(|| ModelError::file(path, "expected a JSON object"))?;
        let model_type = top.get("model_type").and_then(Value::as_str).unwrap_or("");
        let ((text, text_field), experts) = match model_type {
            "qwen3_5" | "qwen3_5_moe" => {
                let text = top.get("text_config").and_then(Value::as_object).ok_or_else(|| {
                    ModelError::field(path, "text_config", format!("missing: model_type {model_type} nests its text model there"))
                })?;
                ((text, "text_config."), model_type == "qwen3_5_moe")
            }
            "qwen3_5_text" => ((top, ""), false),
            "qwen3_5_moe_text" => ((top, ""), true),
            "" => return Err(ModelError::field(path, "model_type", "missing")),
            other => {
                return Err(ModelError::field(
                    path,
                    "model_type",
                    format!("`{other}` is not supported (supported: {})", SUPPORTED_MODEL_TYPES.join(", ")),
                ))
            }
        };
        let f = Fields { map: text, prefix: text_field, path: path.to_path_buf() };
        f.reject_unsupported(experts)?;
        let feed_forward = if experts {
            FeedForward::Experts(ExpertsConfig {
                num_experts: f.usize_or("num_experts", 256)?,
                num_experts_per_tok: f.usize_or("num_experts_per_tok", 8)?,
                moe_intermediate_size: f.usize_or("moe_intermediate_size", 512)?,
                shared_expert_intermediate_size: f.usize_or("shared_expert_intermediate_size", 512)?,
            })
        } else {
            FeedForward::Dense { intermediate_size: f.usize_or("intermediate_size", 12_288)? }
        };

        let num_layers = f.usize_or("num_hidden_layers", 32)?;
        let layer_types = match f.map.get("layer_types") {
            Some(Value::Array(items)) => {
                let kinds = items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| match v.as_str() {
                        Some("linear_attention") => Ok(LayerKind::Linear),
                        Some("full_attention") => Ok(LayerKind::Full),
                        _ => Err(f.err(
                            &format!("layer_types[{i}]"),
                            format!("{v} is not supported (expected \"linear_attention\" or \"full_attention\")"),
                        )),
                    })
                    .collect::<Result<Vec<_>>>()?;
                if kinds.len() != num_layers {
                    return Err(
                        f.err("layer_types", format!("has {} entries but num_hidden_layers is {num_layers}", kinds.len()))
                    );
                }
                kinds
            }
            Some(Value::Null) | None => {
                let interval = f.usize_or("full_attention_interval", 4)?;
                if interval == 0 {
                    return Err(f.err("full_attention_interval", "must be at least 1"));
                }
                (0..num_layers).map(|i| if (i + 1) % interval == 0 { LayerKind::Full } else { LayerKind::Linear }).collect()
            }
            Some(other) => return Err(f.err("layer_types", format!("expected a list, found {other}"))),
        };

        let rope = f.map.get("rope_parameters").and_then(Value::as_object);
        if let Some(rope) = rope {
            let kind = rope.get("rope_type").and_then(Value::as_str).unwrap_or("default");
            if kind != "default" {
                return Err(f.err("rope_parameters.rope_type", format!("`{kind}` is not supported (only \"default\")")));
            }
        }
        let rope_field = |name: &str| rope.and_then(|r| r.get(name)).or_else(|| f.map.get(name)).and_then(Value::as_f64);
        let rope_theta = rope_field("rope_theta").unwrap_or(10_000.0);
        let partial_rotary_factor = rope_field("partial_rotary_factor").unwrap_or(0.25);
        if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
            return Err(f.err("partial_rotary_factor", format!("{partial_rotary_factor} is outside (0, 1]")));
        }
        let mrope_section = match rope.and_then(|r| r.get("mrope_section")).filter(|v| !v.is_null()) {
            None => [11, 11, 10],
            Some(v) => v
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect::<Option<Vec<_>>>())
                .and_then(|a| <[usize; 3]>::try_from(a).ok())
                .ok_or_else(|| {
                    f.err("rope_parameters.mrope_section", format!("expected three non-negative integers, found {v}"))
                })?,
        };
        // Only nested configs describe a tower (a flat text config is the text model alone).
        let vision = match top.get("vision_config").filter(|v| !v.is_null()) {
            Some(_) if !text_field.is_empty() => Some(VisionConfig::from_json(top, path)?),
            _ => None,
        };

        // Nested releases carry the tie flag (and eos ids) at the top level.
        let tie_word_embeddings =
            top.get("tie_word_embeddings").or_else(|| text.get("tie_word_embeddings")).and_then(Value::as_bool).unwrap_or(false);
        let mut eos_token_ids = Vec::new();
        for source in [top.get("eos_token_id"), text.get("eos_token_id")].into_iter().flatten() {
            for id in token_ids(source) {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }

        let cfg = Qwen35Config {
            vocab_size: f.usize_or("vocab_size", 248_320)?,
            hidden_size: f.usize_or("hidden_size", 4096)?,
            feed_forward,
            layer_types,
            num_attention_heads: f.usize_or("num_attention_heads", 16)?,
            num_key_value_heads: f.usize_or("num_key_value_heads", 4)?,
            head_dim: f.usize_or("head_dim", 256)?,
            attention_bias: f.bool_or("attention_bias", false)?,
            linear_conv_kernel_dim: f.usize_or("linear_conv_kernel_dim", 4)?,
            linear_key_head_dim: f.usize_or("linear_key_head_dim", 128)?,
            linear_value_head_dim: f.usize_or("linear_value_head_dim", 128)?,
            linear_num_key_heads: f.usize_or("linear_num_key_heads", 16)?,
            linear_num_value_heads: f.usize_or("linear_num_value_heads", 32)?,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            partial_rotary_factor,
            mrope_section,
            max_position_embeddings: f.usize_or("max_position_embeddings", 32_768)?,
            tie_word_embeddings,
            eos_token_ids,
            mtp_num_hidden_layers: f.usize_or("mtp_num_hidden_layers", 0)?,
            vision,
        };
        cfg.validate(&f)?;
        Ok(cfg)
    }

    fn validate(&self, f: &Fields) -> Result<()> {
        let feed_forward = match self.feed_forward {
            FeedForward::Dense { intermediate_size } => vec![("intermediate_size", intermediate_size)],
            FeedForward::Experts(e) => vec![
                ("num_experts", e.num_experts),
                ("num_experts_per_tok", e.num_experts_per_tok),
                ("moe_intermediate_size", e.moe_intermediate_size),
                ("shared_expert_intermediate_size", e.shared_expert_intermediate_size),
            ],
        };
        if let FeedForward::Experts(e) = self.feed_forward {
            if e.num_experts_per_tok > e.num_experts {
                return Err(f.err(
                    "num_experts_per_tok",
                    format!("{} is more than num_experts {}", e.num_experts_per_tok, e.num_experts),
                ));
            }
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.layer_types.len()),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in positive.into_iter().chain(feed_forward) {
            if v == 0 {
                return Err(f.err(name, "must be at least 1"));
            }
        }
        if self.linear_conv_kernel_dim < 2 {
            return Err(f.err("linear_conv_kernel_dim", "must be at least 2"));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                format!("{} does not divide num_attention_heads {}", self.num_key_value_heads, self.num_attention_heads),
            ));
        }
        if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            return Err(f.err(
                "linear_num_key_heads",
                format!("{} does not divide linear_num_value_heads {}", self.linear_num_key_heads, self.linear_num_value_heads),
            ));
        }
        Ok(())
    }
}

/// Token ids from a JSON int or list of ints (as `eos_token_id` is written).
pub fn token_ids(v: &Value) -> Vec<u32> {
    match v {
        Value::Number(n) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Value::Array(items) => items.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// One JSON object of a config, with the file and key prefix its errors name.
pub(crate) struct Fields<'a> {
    pub(crate) map: &'a Map<String, Value>,
    pub(crate) prefix: &'a str,
    pub(crate) path: PathBuf,
}

impl Fields<'_> {
    pub(crate) fn err(&self, field: &str, what: impl std::fmt::Display) -> ModelError {
        ModelError::field(&self.path, format!("{}{field}", self.prefix), what)
    }

    pub(crate) fn get(&self, name: &str) -> Option<&Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    pub(crate) fn usize_or(&self, name: &str, default: usize) -> Result<usize> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| self.err(name, format!("expected a non-negative integer, found {v}"))),
        }
    }

    pub(crate) fn f64_or(&self, name: &str, default: f64) -> Result<f64> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.err(name, format!("expected a number, found {v}"))),
        }
    }

    pub(crate) fn bool_or(&self, name: &str, default: bool) -> Result<bool> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.err(name, format!("expected true or false, found {v}"))),
        }
    }

    /// Fields that, when present with these values, change the math in ways not implemented
    /// (`experts`: the mixture-of-experts family).
    fn reject_unsupported(&self, experts: bool) -> Result<()> {
        if let Some(act) = self.get("hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(self.err("hidden_act", format!("{act} is not supported (only \"silu\")")));
            }
        }
        if let Some(v) = self.get("rope_scaling") {
            return Err(self.err("rope_scaling", format!("{v} is not supported")));
        }
        if self.get("attn_output_gate").and_then(Value::as_bool) == Some(false) {
            return Err(self.err("attn_output_gate", "false is not supported (Qwen3.5 attention is gated)"));
        }
        if self.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(self.err("use_sliding_window", "sliding-window attention is not supported for qwen3_5"));
        }
        if let Some(v) = self.get("mlp_only_layers") {
            if v.as_array().is_some_and(|a| !a.is_empty()) {
                return Err(self.err("mlp_only_layers", format!("{v} is not supported (expected empty)")));
            }
        }
        if experts {
            // transformers' qwen3_5_moe renormalizes the top-k weights and routes in every layer.
            if self.get("norm_topk_prob").and_then(Value::as_bool) == Some(false) {
                return Err(self.err("norm_topk_prob", "false is not supported (qwen3_5_moe renormalizes its top-k weights)"));
            }
            if self.get("decoder_sparse_step").and_then(Value::as_u64).is_some_and(|n| n != 1) {
                return Err(self.err("decoder_sparse_step", "only 1 is supported (every layer routed)"));
            }
        } else {
            for moe in ["num_experts", "num_experts_per_tok"] {
                if self.get(moe).and_then(Value::as_u64).is_some_and(|n| n > 0) {
                    return Err(self.err(moe, "mixture-of-experts layers need model_type qwen3_5_moe"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Qwen35Config> {
        Qwen35Config::from_json(&v, Path::new("config.json"))
    }

    #[test]
    fn flat_defaults_and_interval() {
        let c = parse(
            json!({"model_type": "qwen3_5_text", "num_hidden_layers": 8, "full_attention_interval": 4, "eos_token_id": [5, 6]}),
        )
        .unwrap();
        use LayerKind::*;
        assert_eq!(c.layer_types, vec![Linear, Linear, Linear, Full, Linear, Linear, Linear, Full]);
        assert_eq!(c.rotary_dim(), 64);
        assert_eq!(c.eos_token_ids, vec![5, 6]);
    }

    #[test]
    fn moe_configs_read_their_experts_with_transformers_defaults() {
        let c = parse(json!({"model_type": "qwen3_5_moe", "text_config": {"num_experts": 8, "num_experts_per_tok": 3}})).unwrap();
        let want = ExpertsConfig {
            num_experts: 8,
            num_experts_per_tok: 3,
            moe_intermediate_size: 512,
            shared_expert_intermediate_size: 512,
        };
        assert_eq!(c.feed_forward, FeedForward::Experts(want));
        let flat = parse(json!({"model_type": "qwen3_5_moe_text"})).unwrap();
        assert_eq!(flat.feed_forward, FeedForward::Experts(ExpertsConfig { num_experts: 256, num_experts_per_tok: 8, ..want }));
        let dense = parse(json!({"model_type": "qwen3_5_text", "intermediate_size": 100})).unwrap();
        assert_eq!(dense.feed_forward, FeedForward::Dense { intermediate_size: 100 });
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (json!({"model_type": "llama"}), "model_type"),
            (json!({}), "model_type"),
            (json!({"model_type": "qwen3_5"}), "text_config"),
            (json!({"model_type": "qwen3_5_text", "hidden_size": "big"}), "hidden_size"),
            (json!({"model_type": "qwen3_5", "text_config": {"hidden_act": "gelu"}}), "text_config.hidden_act"),
            (json!({"model_type": "qwen3_5_text", "rope_parameters": {"rope_type": "yarn"}}), "rope_parameters.rope_type"),
            (json!({"model_type": "qwen3_5_text", "num_hidden_layers": 2, "layer_types": ["linear_attention"]}), "layer_types"),
            (
                json!({"model_type": "qwen3_5_text", "num_hidden_layers": 1, "layer_types": ["sliding_attention"]}),
                "layer_types[0]",
            ),
            (json!({"model_type": "qwen3_5_text", "num_key_value_heads": 3}), "num_key_value_heads"),
            (json!({"model_type": "qwen3_5_text", "num_experts": 8}), "num_experts"),
            (json!({"model_type": "qwen3_5_moe"}), "text_config"),
            (json!({"model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 5}), "num_experts_per_tok"),
            (json!({"model_type": "qwen3_5_moe_text", "moe_intermediate_size": 0}), "moe_intermediate_size"),
            (json!({"model_type": "qwen3_5_moe", "text_config": {"norm_topk_prob": false}}), "text_config.norm_topk_prob"),
        ];
        for (json, field) in cases {
            let err = parse(json.clone()).unwrap_err().to_string();
            assert!(err.contains(&format!("`{field}`")), "{json}: {err}");
        }
    }
}
