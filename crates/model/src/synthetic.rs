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

/// A model of the named shape with random weights; an error, before anything is allocated, when
/// its weights alone take more memory than the device has free.
pub fn build(name: &str, dtype: DType, device: &Device) -> Result<Model> {
    let cfg = config(name)?;
    fits(name, cfg.weight_count().bytes(dtype), dtype, free_memory(device), device.is_cuda())?;
    Ok(Model::Qwen35(Qwen35::load(&cfg, &RandomSource::new(device.clone(), 0x5EED), dtype)?))
}

/// Whether `need` bytes of weights fit the `free` bytes of a GPU or the CPU's (fits where
/// unknown).
fn fits(name: &str, need: u64, dtype: DType, free: Option<u64>, gpu: bool) -> Result<()> {
    match free {
        Some(free) if need > free => Err(ModelError::Invalid(format!(
            "the synthetic model `{name}` does not fit: its weights take {} in {dtype:?}, and this {} has {} free \
             (a model this large needs several GPUs, or quantized weights)",
            gigabytes(need),
            if gpu { "GPU" } else { "machine" },
            gigabytes(free)
        ))),
        _ => Ok(()),
    }
}

fn gigabytes(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

/// Free memory on `device`: the GPU's, or on the CPU what Linux says can be taken without
/// swapping (`MemAvailable`), within the cgroup's limit where one is set; `None` where it cannot
/// tell.
fn free_memory(device: &Device) -> Option<u64> {
    if device.is_cuda() {
        return strata_kernels::device_memory(device).ok().flatten().map(|(free, _)| free as u64);
    }
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let available = read("/proc/meminfo")?
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)?;
    let number = |path: &str| read(path).and_then(|s| s.trim().parse::<u64>().ok());
    let cgroup_room = number("/sys/fs/cgroup/memory.max")
        .zip(number("/sys/fs/cgroup/memory.current"))
        .map(|(max, current)| max.saturating_sub(current));
    Some(cgroup_room.map_or(available, |room| room.min(available)))
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

    /// Counts what the loader asks a random source for.
    struct Counting {
        random: RandomSource,
        bytes: std::cell::Cell<u64>,
    }

    impl crate::source::WeightSource for Counting {
        fn get(&self, name: &str, shape: &[usize], dtype: DType) -> Result<candle_core::Tensor> {
            self.bytes.set(self.bytes.get() + (shape.iter().product::<usize>() * dtype.size_in_bytes()) as u64);
            self.random.get(name, shape, dtype)
        }

        fn device(&self) -> &Device {
            &self.random.device
        }
    }

    #[test]
    fn the_weight_count_is_what_the_loader_reads() {
        let mut cfg = config("qwen3.5-35b-a3b").unwrap();
        (cfg.vocab_size, cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads) = (96, 32, 16, 4, 2);
        (cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads) = (8, 8, 2, 4);
        cfg.layer_types.truncate(4);
        let experts = FeedForward::Experts(ExpertsConfig {
            num_experts: 6,
            num_experts_per_tok: 2,
            moe_intermediate_size: 12,
            shared_expert_intermediate_size: 20,
        });
        for (feed_forward, tied, bias) in [(experts, false, false), (FeedForward::Dense { intermediate_size: 40 }, true, true)] {
            (cfg.feed_forward, cfg.tie_word_embeddings, cfg.attention_bias) = (feed_forward, tied, bias);
            for dtype in [DType::F32, DType::BF16] {
                let source = Counting { random: RandomSource::new(Device::Cpu, 1), bytes: 0.into() };
                Qwen35::load(&cfg, &source, dtype).unwrap();
                assert_eq!(cfg.weight_count().bytes(dtype), source.bytes.get(), "{feed_forward:?} {dtype:?}");
            }
        }
    }

    #[test]
    fn the_shapes_have_their_releases_parameter_counts() {
        // Billions of parameters in all and per token, as the releases name them. The count is the
        // text decoder's (the releases add a vision tower of 0.1–0.6B and the MTP head), and a
        // token's excludes the embedding table it reads one row of (the releases count it: 0.5B at
        // 35B-A3B, 0.8B at 122B-A10B).
        for (name, total, active) in [
            ("qwen3.5-4b", 4.0, None),
            ("qwen3.5-9b", 9.0, None),
            ("qwen3.5-35b-a3b", 35.0, Some(3.0)),
            ("qwen3.5-122b-a10b", 122.0, Some(10.0)),
        ] {
            let count = config(name).unwrap().weight_count();
            let got_total = count.total() as f64 / 1e9;
            assert!((got_total / total - 1.0).abs() < 0.06, "{name}: {got_total:.2}B parameters");
            if let Some(active) = active {
                let got_active = (count.active_at_dtype + count.f32) as f64 / 1e9;
                assert!((got_active / active - 1.0).abs() < 0.12, "{name}: {got_active:.2}B per token");
            }
        }
    }

    #[test]
    fn a_shape_larger_than_free_memory_is_refused_before_any_allocation() {
        let need = config("qwen3.5-122b-a10b").unwrap().weight_count().bytes(DType::BF16);
        let err = fits("qwen3.5-122b-a10b", need, DType::BF16, Some(141_000_000_000), true).unwrap_err().to_string();
        assert!(err.contains("its weights take 244.2 GB in BF16, and this GPU has 141.0 GB free"), "{err}");
        assert!(fits("qwen3.5-122b-a10b", need, DType::BF16, Some(300_000_000_000), true).is_ok());
        assert!(fits("qwen3.5-122b-a10b", need, DType::BF16, None, false).is_ok());
        // This machine's own free memory is read (a number, and it does not hold 488 GB of f32).
        let free = free_memory(&Device::Cpu).expect("Linux tells MemAvailable");
        assert!(free > 0);
        if free < 400_000_000_000 {
            assert!(build("qwen3.5-122b-a10b", DType::F32, &Device::Cpu).err().unwrap().to_string().contains("does not fit"));
        }
    }
}
