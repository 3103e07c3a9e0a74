//! Random-weight models with the exact shapes of public Qwen3.5 releases, so benchmarks need no
//! download. Shapes follow the released `config.json` text configs.

use candle_core::{DType, Device};

use crate::config::{ExpertsConfig, FeedForward, LayerKind, Qwen35Config};
use crate::error::{ModelError, Result};
use crate::images::ImageProcessor;
use crate::model::Model;
use crate::qwen3_5::{MtpHead, Qwen35, VisionConfig, VisionTower};
use crate::source::RandomSource;

/// The shapes that vary between releases, by name; also read by
/// scripts/cuda/bench_transformers.py, so both sides of the GPU benchmark build the same models.
const SHAPES: &str = include_str!("synthetic_shapes.json");

#[derive(serde::Deserialize)]
struct Shape {
    hidden: usize,
    layers: usize,
    /// The dense MLP's width, or the experts of a mixture-of-experts shape.
    intermediate: Option<usize>,
    experts: Option<ExpertsShape>,
    heads: usize,
    kv_heads: usize,
    linear_key_heads: usize,
    linear_value_heads: usize,
    tied: bool,
    /// The release's vision tower, where the shape has one.
    vision: Option<VisionShape>,
}

#[derive(Clone, Copy, serde::Deserialize)]
struct VisionShape {
    depth: usize,
    hidden: usize,
    intermediate: usize,
    heads: usize,
}

#[derive(Clone, Copy, serde::Deserialize)]
struct ExpertsShape {
    count: usize,
    per_token: usize,
    intermediate: usize,
    shared: usize,
}

fn shape(name: &str) -> Result<Shape> {
    let mut shapes: std::collections::BTreeMap<String, Shape> =
        serde_json::from_str(SHAPES).expect("synthetic_shapes.json is valid (a test parses it)");
    shapes.remove(name).ok_or_else(|| {
        let known: Vec<&str> = shapes.keys().map(String::as_str).collect();
        ModelError::Invalid(format!("unknown synthetic model `{name}` (known: {})", known.join(", ")))
    })
}

/// The text config of a named public model shape.
pub fn config(name: &str) -> Result<Qwen35Config> {
    let Shape {
        hidden,
        layers,
        intermediate,
        experts,
        heads,
        kv_heads: kv,
        linear_key_heads: lk,
        linear_value_heads: lv,
        tied,
        vision: _,
    } = shape(name)?;
    let feed_forward = match (intermediate, experts) {
        (Some(intermediate_size), None) => FeedForward::Dense { intermediate_size },
        (None, Some(e)) => FeedForward::Experts(ExpertsConfig {
            num_experts: e.count,
            num_experts_per_tok: e.per_token,
            moe_intermediate_size: e.intermediate,
            shared_expert_intermediate_size: e.shared,
        }),
        _ => unreachable!("synthetic_shapes.json gives each shape an intermediate size or experts (a test checks)"),
    };
    Ok(Qwen35Config {
        vocab_size: 248_320,
        hidden_size: hidden,
        feed_forward,
        layer_types: (0..layers).map(|i| if (i + 1) % 4 == 0 { LayerKind::Full } else { LayerKind::Linear }).collect(),
        num_attention_heads: heads,
        num_key_value_heads: kv,
        head_dim: 256,
        attention_bias: false,
        linear_conv_kernel_dim: 4,
        linear_key_head_dim: 128,
        linear_value_head_dim: 128,
        linear_num_key_heads: lk,
        linear_num_value_heads: lv,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000_000.0,
        partial_rotary_factor: 0.25,
        mrope_section: [11, 11, 10],
        max_position_embeddings: 262_144,
        tie_word_embeddings: tied,
        eos_token_ids: vec![248_044],
        mtp_num_hidden_layers: 1,
        vision: None,
    })
}

/// A model of the named shape with random weights.
pub fn build(name: &str, dtype: DType, device: &Device) -> Result<Model> {
    let cfg = config(name)?;
    Ok(Model::Qwen35(Qwen35::load(&cfg, &RandomSource::new(device.clone(), 0x5EED), dtype)?))
}

/// The vision config of a named shape, and its release's image processor (patches of 16, 2×2
/// merges, between 256 and 16,384 patches' worth of pixels, mean and std 0.5).
pub fn vision(name: &str) -> Result<(VisionConfig, ImageProcessor)> {
    let shape = shape(name)?;
    let Some(v) = shape.vision else {
        return Err(ModelError::Invalid(format!("the synthetic model `{name}` has no vision tower")));
    };
    // Through the parsers a checkpoint's files go through, so the same checks apply.
    let path = std::path::Path::new("synthetic_shapes.json");
    let top = serde_json::json!({"vision_config": {
        "depth": v.depth, "hidden_size": v.hidden, "intermediate_size": v.intermediate, "num_heads": v.heads,
        "out_hidden_size": shape.hidden, "patch_size": 16, "num_position_embeddings": 2304,
    }});
    let cfg = VisionConfig::from_json(top.as_object().expect("an object"), path)?;
    let processor = serde_json::json!({
        "patch_size": 16, "merge_size": 2, "size": {"shortest_edge": 65_536, "longest_edge": 16_777_216},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    });
    let processor = ImageProcessor::from_json(&processor, path)?.checked_against(&cfg, path)?;
    Ok((cfg, processor))
}

/// The vision tower of a named shape with random weights.
pub fn build_vision(name: &str, dtype: DType, device: &Device) -> Result<VisionTower> {
    VisionTower::load(&vision(name)?.0, &RandomSource::new(device.clone(), 0x515), dtype)
}

/// A random multi-token-prediction head for a synthetic `target` (for benchmarks of `--draft mtp`:
/// its drafts are as good as chance, so it measures the head's cost, not its acceptance).
pub fn build_mtp(target: &Model) -> Result<MtpHead> {
    target.mtp_head(&RandomSource::new(target.device().clone(), 0x3779))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_parses_with_a_full_attention_layer_in_four() {
        let shapes: std::collections::BTreeMap<String, serde_json::Value> = serde_json::from_str(SHAPES).unwrap();
        assert!(shapes.len() >= 5);
        for name in shapes.keys() {
            let cfg = config(name).unwrap();
            assert_eq!(cfg.layer_types.iter().filter(|k| **k == LayerKind::Full).count() * 4, cfg.layer_types.len());
        }
        // transformers' Qwen3_5MoeTextConfig defaults, which are Qwen3.5-35B-A3B's.
        let moe = config("qwen3.5-35b-a3b").unwrap();
        assert_eq!((moe.hidden_size, moe.num_layers(), moe.num_attention_heads, moe.num_key_value_heads), (2048, 40, 16, 2));
        assert_eq!((moe.linear_num_key_heads, moe.linear_num_value_heads, moe.tie_word_embeddings), (16, 32, false));
        let want = ExpertsConfig {
            num_experts: 256,
            num_experts_per_tok: 8,
            moe_intermediate_size: 512,
            shared_expert_intermediate_size: 512,
        };
        assert_eq!(moe.feed_forward, FeedForward::Experts(want));
        // A 1024×1024 image is 64×64 patches, 1,024 tokens of the text model's width.
        let (tower, processor) = vision("qwen3.5-4b").unwrap();
        assert_eq!((tower.depth, tower.hidden_size, tower.out_hidden_size), (24, 1024, 2560));
        assert_eq!(processor.resized(1024, 1024).unwrap(), (1024, 1024));
        assert!(vision("qwen3.5-9b").unwrap_err().to_string().contains("no vision tower"));
        assert!(config("qwen3.5-1t").unwrap_err().to_string().contains("known: qwen3.5-0.8b"));
    }
}
