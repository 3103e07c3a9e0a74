//! Key smoothing for quantized KV. An affine group of key coordinates spends its levels on its
//! largest value: where a few channels are far larger than the rest, the rest are rounded away
//! (Gemma 3 270M with 4-bit groups of 64: +48% perplexity); TurboQuant's rotation spreads such
//! channels over all of them, but a vector's error still grows with their size (+17%). In a
//! model that normalises queries and keys per head (Gemma 3, Qwen3, Qwen3.5), a channel's size
//! is set by weights: the projection's row for it (over inputs scaled by the input norm) and the
//! per-head norm's weight. So, as SmoothQuant moves a matmul's outliers between its operands,
//! the key norm's output is divided per channel by a factor and the query norm's multiplied by
//! the same, the factor `sqrt(key size / query size)` relative to the head's median channel: every
//! score `q·k` is the same number, while the stored keys' channels are nearer one size. The two
//! channels a rotary embedding turns together share a factor (the rotation commutes with it),
//! and factors are powers of two, so scaling changes no bit of a score: a layer whose KV is not
//! quantized computes exactly what it does without. Sizes are averaged over the heads a model
//! holds (a tensor-parallel rank's own).

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::qwen3_5::layers::Matrix;

/// One side (queries or keys) of an attention layer: the weights that set its channels' sizes.
pub struct Side<'a> {
    /// The projection `[rows, hidden]` that makes this side's channels (possibly with others').
    pub proj: &'a Matrix,
    /// The projection's rows that are this side's channels, head after head (`heads · D`).
    pub rows: Vec<u32>,
    /// The per-head norm's per-channel scale `[D]`.
    pub norm_scale: &'a Tensor,
}

/// An attention layer's weights that set its queries' and keys' channel sizes.
pub struct AttentionWeights<'a> {
    pub query: Side<'a>,
    pub key: Side<'a>,
    /// The input norm's per-channel scale `[hidden]`.
    pub input_scale: &'a Tensor,
    /// Channels `c` and `c + rotary_half` (for `c < rotary_half`) are rotated together.
    pub rotary_half: usize,
}

/// Per-channel factors `[D]` (f32): the query norm's output is multiplied by them and the key
/// norm's divided. `None` where every factor is 1.
pub fn key_factors(layer: &AttentionWeights) -> Result<Option<Tensor>> {
    let (k, q) = (channel_sizes(&layer.key, layer)?, channel_sizes(&layer.query, layer)?);
    let half = layer.rotary_half;
    let pair = |size: &[f32], c: usize| match c {
        c if c < half => size[c].max(size[c + half]),
        c if c < 2 * half => size[c].max(size[c - half]),
        c => size[c],
    };
    // Half the way (SmoothQuant's migration strength 0.5): on Gemma 3 270M with affine4 it gave
    // perplexity 15.53 (unsmoothed 20.87, unquantized 14.11; README). Variants of this line tried
    // once while choosing it, not kept: keys all the way to one size from the key side alone
    // gave 15.85, exponents 0.75 / 0.25 on the key / query sizes 15.69.
    let wanted: Vec<f32> = (0..k.len()).map(|c| (pair(&k, c) / pair(&q, c)).sqrt()).collect();
    let mut sorted = wanted.clone();
    sorted.sort_by(f32::total_cmp);
    let median = sorted[sorted.len() / 2];
    if !(median.is_finite() && median > 0.0) {
        return Ok(None);
    }
    let factors: Vec<f32> = wanted.iter().map(|w| 2f32.powi((w / median).log2().round().clamp(-8.0, 8.0) as i32)).collect();
    if factors.iter().all(|&f| f == 1.0) {
        return Ok(None);
    }
    Ok(Some(Tensor::new(factors, layer.input_scale.device())?))
}

/// A per-head norm whose output channels smoothing rescales (Qwen3.5 / Gemma 3's `1 + w` norm,
/// the dense decoders' `w` norm).
pub trait ChannelNorm: Sized {
    /// Its per-channel scale `[D]`.
    fn scale(&self) -> &Tensor;
    /// This norm with its output channels multiplied by `factors` `[D]` (f32 powers of two).
    fn rescaled(&self, factors: &Tensor) -> Result<Self>;
}

/// The layer's query and key norms rescaled by [`key_factors`] (queries multiplied, keys
/// divided); `None` where every factor is 1. `layer`'s sides read these norms' scales.
pub fn smoothed_norms<N: ChannelNorm>(layer: &AttentionWeights, q_norm: &N, k_norm: &N) -> Result<Option<(N, N)>> {
    key_factors(layer)?.map(|f| Ok((q_norm.rescaled(&f)?, k_norm.rescaled(&f.recip()?)?))).transpose()
}

/// Each channel's size `[D]` on one side: over the heads, the RMS of the norm of the projection's
/// row for it weighted by the input norm's scale (the size it gives inputs of unit channels),
/// times the per-head norm's scale.
fn channel_sizes(side: &Side, layer: &AttentionWeights) -> Result<Vec<f32>> {
    let norm_scale: Vec<f32> = side.norm_scale.to_dtype(DType::F32)?.to_vec1()?;
    let d = norm_scale.len();
    let ids = Tensor::new(side.rows.as_slice(), layer.input_scale.device())?;
    let weighted = side.proj.rows_at(&ids, DType::F32)?.broadcast_mul(&layer.input_scale.to_dtype(DType::F32)?)?;
    // [heads, D]: each row's squared norm, then the mean over heads.
    let row_sq = weighted.sqr()?.sum(1)?.reshape((side.rows.len() / d, d))?.mean(0)?.to_vec1::<f32>()?;
    Ok(row_sq.iter().zip(&norm_scale).map(|(sq, s)| sq.sqrt() * s.abs()).collect())
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};
    use strata_kernels::attention::norm_rope;

    use super::*;
    use crate::qwen3_5::layers::Rotary;

    fn dense(rows: &[[f32; 4]; 4]) -> Matrix {
        Matrix::Dense(Tensor::new(rows, &Device::Cpu).unwrap())
    }

    #[test]
    fn factors_are_powers_of_two_shared_by_rotated_pairs() {
        let ones = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
        let layer = |k_rows: &Matrix, q_rows: &Matrix| {
            let weights = AttentionWeights {
                query: Side { proj: q_rows, rows: (0..4).collect(), norm_scale: &ones },
                key: Side { proj: k_rows, rows: (0..4).collect(), norm_scale: &ones },
                input_scale: &ones,
                rotary_half: 1,
            };
            key_factors(&weights).unwrap().map(|f| f.to_vec1::<f32>().unwrap())
        };
        let q = dense(&[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]);
        assert_eq!(layer(&q, &q), None, "keys and queries alike: nothing to move");
        // Key channel 2 (not rotated) 16 times the others: its keys divided by 4 (half the way).
        let k = dense(&[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 16.0, 0.0], [0.0, 0.0, 0.0, 1.0]]);
        assert_eq!(layer(&k, &q), Some(vec![1.0, 1.0, 4.0, 1.0]));
        // Channel 0 large: channels 0 and 1, rotated together, share its factor.
        let k = dense(&[[16.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]);
        let f = layer(&k, &q).expect("channel 0 moves");
        assert_eq!(f[0], f[1]);
        assert_eq!(f[0] / f[2], 4.0);
        assert!(f.iter().all(|x| x.log2().fract() == 0.0), "{f:?} are not powers of two");
    }

    /// What smoothing rests on: with the query norm's scale multiplied by power-of-two factors
    /// (rotated pairs alike) and the key norm's divided, every score `q·k` is the same bits, in
    /// f32 and in bf16, rotated and unrotated channels alike.
    #[test]
    fn smoothed_norms_give_the_same_scores_bit_for_bit() {
        let dev = Device::Cpu;
        let (t, h, d) = (5, 2, 8);
        // Rotary over the first 4 channels: pairs (0, 2) and (1, 3).
        let rope = Rotary::new(4, 10_000.0).tables(&[3], t, &dev).unwrap();
        let factors = Tensor::new(&[4.0f32, 0.5, 4.0, 0.5, 2.0, 1.0, 0.25, 8.0], &dev).unwrap();
        let values = |n: usize, seed: u32| -> Tensor {
            let v: Vec<f32> =
                (0..n).map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000).map(|h| h as f32 / 250.0 - 2.0).collect();
            Tensor::new(v, &dev).unwrap()
        };
        let (q_scale, k_scale) = (values(d, 1).abs().unwrap(), (values(d, 2).abs().unwrap() * 3.0).unwrap());
        for dtype in [DType::F32, DType::BF16] {
            let x = |seed| values(t * h * d, seed).reshape((1, t, h, d)).unwrap().to_dtype(dtype).unwrap();
            let (xq, xk) = (x(3), x(4));
            let scores = |q_scale: &Tensor, k_scale: &Tensor| {
                let q = norm_rope(&xq, q_scale, 1e-6, &rope.0, &rope.1).unwrap();
                let k = norm_rope(&xk, k_scale, 1e-6, &rope.0, &rope.1).unwrap();
                let (q, k) = (q.to_dtype(DType::F32).unwrap(), k.to_dtype(DType::F32).unwrap());
                q.matmul(&k.transpose(2, 3).unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
            };
            let plain = scores(&q_scale, &k_scale);
            let smoothed = scores(&(&q_scale * &factors).unwrap(), &(&k_scale / &factors).unwrap());
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&smoothed), bits(&plain), "{dtype:?}");
        }
    }
}
