//! The greedy sampling tail: each row's argmax, among the tokens a row's mask allows (structured
//! output). On CUDA it is one kernel and only the token ids cross to the host (and the masks to
//! the device), not the rows of logits.

use candle_core::{DType, Tensor};

use crate::Result;

/// The index of the first maximum of `logits` (NaN never wins; 0 for an empty or all-NaN row).
pub fn first_max(logits: &[f32]) -> u32 {
    first_allowed_max(logits, None)
}

/// [`first_max`] among the entries `mask` allows: bit `i % 32` of word `i / 32` (`None`: all;
/// entries past the mask's words are not allowed). 0 where it allows none.
pub fn first_allowed_max(logits: &[f32], mask: Option<&[u32]>) -> u32 {
    let allowed = |i: usize| mask.is_none_or(|words| words.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1));
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if !x.is_nan() && best.is_none_or(|(_, b)| x > b) && allowed(i) {
            best = Some((i, x));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// [`first_allowed_max`] of each row of `logits` `[R, V]`, row `r` within `masks[r]` (no masks:
/// every row unrestricted).
pub fn argmax_rows(logits: &Tensor, masks: &[Option<&[u32]>]) -> Result<Vec<u32>> {
    let logits = logits.to_dtype(DType::F32)?;
    if !masks.is_empty() && masks.len() != logits.dim(0)? {
        candle_core::bail!("argmax_rows: {} masks for {} rows", masks.len(), logits.dim(0)?);
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        return gpu::argmax_rows(&logits.contiguous()?, masks);
    }
    let mask = |r: usize| masks.get(r).copied().flatten();
    Ok(logits.to_vec2::<f32>()?.iter().enumerate().map(|(r, row)| first_allowed_max(row, mask(r))).collect())
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::{DType, Tensor};

    use crate::cuda::{self, Arg};
    use crate::Result;

    /// Logits per block and threads per block of the kernel (cuda/sampling.cu).
    const CHUNK: usize = 8192;
    const THREADS: u32 = 256;

    /// Every block of a row folds its chunk's best (value, index) key into the row's key with
    /// an atomic max (a row is ~31 blocks, not one block walking the whole vocabulary). The
    /// masks that are there go up packed, a row's index into them beside.
    pub(super) fn argmax_rows(logits: &Tensor, masks: &[Option<&[u32]>]) -> Result<Vec<u32>> {
        let (rows, vocab) = logits.dims2()?;
        if rows == 0 || vocab == 0 {
            return Ok(vec![0; rows]);
        }
        let words = vocab.div_ceil(32);
        let (mut packed, mut which) = (Vec::new(), vec![-1i32; rows]);
        for (r, mask) in masks.iter().enumerate() {
            if let Some(mask) = mask {
                which[r] = (packed.len() / words) as i32;
                let from = packed.len();
                packed.extend(mask.iter().take(words));
                packed.resize(from + words, 0); // a short mask allows nothing past its end
            }
        }
        let device = logits.device();
        let masked = match packed.len() {
            0 => None,
            n => Some((Tensor::from_vec(packed, n, device)?, Tensor::new(which, device)?)),
        };
        let keys = Tensor::zeros(rows, DType::I64, logits.device())?;
        let chunks = u32::try_from(vocab.div_ceil(CHUNK)).map_err(candle_core::Error::wrap)?;
        let rows_y = u32::try_from(rows).ok().filter(|&r| r <= 65_535);
        let rows_y = rows_y.ok_or_else(|| candle_core::Error::Msg(format!("argmax of {rows} rows exceeds a CUDA grid")))?;
        let cfg = LaunchConfig { grid_dim: (chunks, rows_y, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let args = [
            Arg::at(logits)?,
            Arg::at(&keys)?,
            Arg::dim(vocab)?,
            Arg::at_or_null(masked.as_ref().map(|(m, _)| m))?,
            Arg::at_or_null(masked.as_ref().map(|(_, w)| w))?,
            Arg::dim(words)?,
        ];
        cuda::launch(logits.device(), &cuda::SAMPLING, "argmax_keys", DType::F32, cfg, &args)?;
        // The key's low word is the index complemented; no key (0) is a row of NaN.
        Ok(keys.to_vec1::<i64>()?.into_iter().map(|key| if key == 0 { 0 } else { u32::MAX - key as u32 }).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_max_takes_the_first_of_ties_and_skips_nan() {
        assert_eq!(first_max(&[1.0, 3.0, 2.0, 3.0]), 1);
        assert_eq!(first_max(&[f32::NAN, -1.0, f32::NAN, 0.5]), 3);
        assert_eq!(first_max(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(first_max(&[f32::NAN]), 0);
        assert_eq!(first_max(&[]), 0);
    }

    #[test]
    fn first_allowed_max_skips_what_the_mask_forbids() {
        let logits: Vec<f32> = (0..70).map(|i| (i % 7) as f32).collect(); // maxima at 6, 13, 20, ...
        assert_eq!(first_allowed_max(&logits, None), 6);
        // Word 0 allows 3 and 13; word 1 allows 34 (= 32 + 2); nothing past the words (64+).
        let mask = [(1 << 3) | (1 << 13), 1 << 2];
        assert_eq!(first_allowed_max(&logits, Some(&mask)), 13);
        assert_eq!(first_allowed_max(&logits, Some(&[1 << 3, 1 << 2])), 34); // 34 % 7 = 6 > 3
        assert_eq!(first_allowed_max(&logits, Some(&[0, 0])), 0);
        let rows = Tensor::new(&[[1f32, 5.0, 2.0], [4.0, 0.0, 9.0]], &candle_core::Device::Cpu).unwrap();
        assert_eq!(argmax_rows(&rows, &[]).unwrap(), [1, 2]);
        assert_eq!(argmax_rows(&rows, &[Some(&[0b101]), None]).unwrap(), [2, 2]);
    }
}
