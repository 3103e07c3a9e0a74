//! Random-weight models with the exact shapes of public Qwen3.5 releases, so benchmarks need no
//! download. Shapes follow the released `config.json` text configs.

use candle_core::{DType, Device};

use crate::config::{LayerKind, Qwen35Config};
use crate::error::{ModelError, Result};
use crate::model::Model;
use crate::qwen3_5::{MtpHead, Qwen35};
use crate::source::RandomSource;

pub const NAMES: [&str; 4] = ["qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b"];

/// The text config of a named public model shape.
pub fn config(name: &str) -> Result<Qwen35Config> {
    // (hidden, layers, intermediate, attention heads, kv heads, linear key heads, linear value heads, tied)
    let (hidden, layers, inter, heads, kv, lk, lv, tied) = match name {
        "qwen3.5-0.8b" => (1024, 24, 3584, 8, 2, 16, 16, true),
        "qwen3.5-2b" => (2048, 24, 6144, 8, 2, 16, 16, true),
        "qwen3.5-4b" => (2560, 32, 9216, 16, 4, 16, 32, true),
        "qwen3.5-9b" => (4096, 32, 12288, 16, 4, 16, 32, false),
        other => return Err(ModelError::Invalid(format!("unknown synthetic model `{other}` (known: {})", NAMES.join(", ")))),
    };
    Ok(Qwen35Config {
        vocab_size: 248_320,
        hidden_size: hidden,
        intermediate_size: inter,
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
        max_position_embeddings: 262_144,
        tie_word_embeddings: tied,
        eos_token_ids: vec![248_044],
        mtp_num_hidden_layers: 1,
    })
}

/// A model of the named shape with random weights.
pub fn build(name: &str, dtype: DType, device: &Device) -> Result<Model> {
    let cfg = config(name)?;
    Ok(Model::Qwen35(Qwen35::load(&cfg, &RandomSource::new(device.clone(), 0x5EED), dtype)?))
}

/// A random multi-token-prediction head for a synthetic `target` (for benchmarks of `--draft mtp`:
/// its drafts are as good as chance, so it measures the head's cost, not its acceptance).
pub fn build_mtp(target: &Model) -> Result<MtpHead> {
    target.mtp_head(&RandomSource::new(target.device().clone(), 0x3779))
}
