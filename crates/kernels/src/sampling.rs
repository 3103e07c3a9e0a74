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

    /// One block of 1024 threads per row (cuda/sampling.cu).
    pub(super) fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
        let (rows, vocab) = logits.dims2()?;
        let ids = cuda::output(rows, DType::U32, logits.device())?;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let args = [Arg::at(logits)?, Arg::at(&ids)?, Arg::dim(vocab)?];
        cuda::launch(logits.device(), &cuda::SAMPLING, "argmax_rows", DType::F32, cfg, &args)?;
        ids.to_vec1::<u32>()
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
