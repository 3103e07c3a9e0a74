//! The greedy sampling tail: each row's argmax. On CUDA it is one kernel and only the token ids
//! cross to the host, not the rows of logits.

use candle_core::{DType, Tensor};

use crate::Result;

/// The index of the first maximum of `logits` (NaN never wins; 0 for an empty or all-NaN row).
pub fn first_max(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if !x.is_nan() && best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// [`first_max`] of each row of `logits` `[R, V]`.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    let logits = logits.to_dtype(DType::F32)?;
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        return gpu::argmax_rows(&logits.contiguous()?);
    }
    Ok(logits.to_vec2::<f32>()?.iter().map(|row| first_max(row)).collect())
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
    /// an atomic max (a row is ~31 blocks, not one block walking the whole vocabulary).
    pub(super) fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
        let (rows, vocab) = logits.dims2()?;
        if rows == 0 || vocab == 0 {
            return Ok(vec![0; rows]);
        }
        let keys = Tensor::zeros(rows, DType::I64, logits.device())?;
        let chunks = u32::try_from(vocab.div_ceil(CHUNK)).map_err(candle_core::Error::wrap)?;
        let rows_y = u32::try_from(rows).ok().filter(|&r| r <= 65_535);
        let rows_y = rows_y.ok_or_else(|| candle_core::Error::Msg(format!("argmax of {rows} rows exceeds a CUDA grid")))?;
        let cfg = LaunchConfig { grid_dim: (chunks, rows_y, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let args = [Arg::at(logits)?, Arg::at(&keys)?, Arg::dim(vocab)?];
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
}
