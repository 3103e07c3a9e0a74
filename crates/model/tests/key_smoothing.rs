//! Key smoothing (strata_model::smoothing) on the dense Qwen3 and the hybrid Qwen3.5 fixtures.
//! A model is rewritten into an equivalent one with outlier key channels: a few channels of
//! every key norm's scale multiplied by 16 and the same channels of the query norm's divided by
//! 16 (every score `q·k` the same number), as trained models' keys have them. Unquantized, the
//! rewritten model gives the original's logits. With quantized KV, smoothing is to find those
//! channels from the weights and move them back before the keys are coded, so the rewritten
//! model's quantized logits are the original's: bit for bit where the rewrite is exact (Qwen3's
//! norms multiply by their weight), within rounding where the scale is stored as `1 + w`
//! (Qwen3.5). Unsmoothed, the outliers take the coding groups' range from the other channels:
//! with smoothing switched off (a local edit, not kept) the Qwen3 test fails and the Qwen3.5
//! rewritten model's affine4 logits are 1.26 from the original's, whose own coding error is
//! 0.45 (with smoothing: 0).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use strata_model::qwen3_5::layers::Matrix;
use strata_model::source::{FileSource, WeightSource};
use strata_model::weights::Weights;
use strata_model::{ArchConfig, Logits, Model};
use strata_state::KvPolicy;

/// `inner`'s weights with `channels` of every key norm's scale times `GAIN` and of every query
/// norm's divided by it; `zero_centred` norms store their scale as `1 + w`.
struct Outliers<'a> {
    inner: &'a dyn WeightSource,
    channels: &'a [usize],
    zero_centred: bool,
}

const GAIN: f32 = 16.0;

impl WeightSource for Outliers<'_> {
    fn get(&self, name: &str, shape: &[usize], dtype: DType) -> strata_model::Result<Tensor> {
        let tensor = self.inner.get(name, shape, dtype)?;
        let factor = match name {
            n if n.ends_with("self_attn.k_norm.weight") => GAIN,
            n if n.ends_with("self_attn.q_norm.weight") => 1.0 / GAIN,
            _ => return Ok(tensor),
        };
        let mut w: Vec<f32> = tensor.to_dtype(DType::F32)?.to_vec1()?;
        for &c in self.channels {
            w[c] = if self.zero_centred { (1.0 + w[c]) * factor - 1.0 } else { w[c] * factor };
        }
        Ok(Tensor::new(w, tensor.device())?.to_dtype(dtype)?)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize, dtype: DType) -> strata_model::Result<Matrix> {
        self.inner.matrix(name, rows, cols, dtype)
    }

    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

/// The fixture's model (f32, CPU) and the same with outlier key channels.
fn original_and_rewritten(dir: &Path, channels: &[usize], zero_centred: bool) -> (Model, Model) {
    let cfg = ArchConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = Weights::open(dir).unwrap();
    let src = FileSource::text_model(&weights, &Device::Cpu);
    let original = Model::load(&cfg, &src, DType::F32).unwrap();
    let rewritten = Model::load(&cfg, &Outliers { inner: &src, channels, zero_centred }, DType::F32).unwrap();
    (original, rewritten)
}

/// Logits at every position of a 40-token prompt, then of 6 decode steps, KV stored as `kv`.
fn logits(model: &mut Model, kv: &str) -> Vec<f32> {
    model.set_kv_format(kv.parse::<strata_state::KvFormat>().unwrap().into()).unwrap();
    let vocab = model.vocab_size() as u32;
    let mut state = model.new_state(1).unwrap();
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut out = model.forward(&Tensor::new(vec![prompt], &Device::Cpu).unwrap(), &mut state, Logits::All).unwrap();
    let mut all = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for step in 0..6u32 {
        let token = (step * 31 + 5) % vocab;
        out = model.forward(&Tensor::new(vec![vec![token]], &Device::Cpu).unwrap(), &mut state, Logits::Last).unwrap();
        all.extend(out.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    model.set_kv_format(KvPolicy::default()).unwrap();
    all
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn smoothing_undoes_outlier_key_channels_in_qwen3_bit_for_bit() {
    // Head dim 32, every channel rotated: the pairs (3, 19) and (7, 23).
    let (mut original, mut rewritten) = original_and_rewritten(&fixture("dense/qwen3-tiny-draft"), &[3, 19, 7, 23], false);
    assert_eq!(logits(&mut rewritten, "auto"), logits(&mut original, "auto"), "the rewrite changed the model");
    for kv in ["affine4-g32", "turbo4"] {
        assert_eq!(logits(&mut rewritten, kv), logits(&mut original, kv), "{kv}: smoothing left the outliers in the codes");
    }
}

#[test]
fn smoothing_undoes_outlier_key_channels_in_qwen35() {
    // Head dim 128 with 32 rotated channels: the rotated pair (3, 19) and the unrotated 100.
    let (mut original, mut rewritten) = original_and_rewritten(&fixture("qwen3_5-tiny-d"), &[3, 19, 100], true);
    let plain = logits(&mut original, "auto");
    let rounding = max_diff(&logits(&mut rewritten, "auto"), &plain);
    assert!(rounding < 1e-4, "the rewrite changed the model by {rounding}");
    for kv in ["affine4", "turbo4"] {
        let coded = logits(&mut original, kv);
        let (coding, smoothed) = (max_diff(&coded, &plain), max_diff(&logits(&mut rewritten, kv), &coded));
        assert!(coding > 1e-3, "{kv}: coding moved the logits by only {coding}: the test would not see outliers");
        assert!(smoothed < 1e-4, "{kv}: the rewritten model's logits are {smoothed} from the original's (coding error {coding})");
    }
}
