//! Row copies between a batch and the rows of a pool: how state computed for a batch goes back
//! into each row's slot.

use candle_core::Tensor;

use crate::Result;

/// Writes row `i` of `src` (`[n, ...]`, contiguous) into row `rows[i]` of `dst` (`[S, ...]`,
/// contiguous, the same row shape and dtype), in place. One kernel on CUDA.
pub fn scatter(dst: &Tensor, rows: &[u32], src: &Tensor) -> Result<()> {
    let (s, n) = (dst.dim(0)?, src.dim(0)?);
    if src.dims().get(1..) != dst.dims().get(1..)
        || src.dtype() != dst.dtype()
        || !src.is_contiguous()
        || !dst.is_contiguous()
        || rows.len() != n
        || rows.iter().any(|&r| r as usize >= s)
    {
        candle_core::bail!(
            "scatter: {} rows of {:?} ({:?}) into rows {rows:?} of {:?} ({:?})",
            n,
            src.shape(),
            src.dtype(),
            dst.shape(),
            dst.dtype()
        );
    }
    if n == 0 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if dst.device().is_cuda() && crate::cuda::supports(dst.dtype()) {
        return gpu::scatter(dst, rows, src);
    }
    for (i, &row) in rows.iter().enumerate() {
        dst.slice_set(&src.narrow(0, i, 1)?, 0, row as usize)?;
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::Tensor;

    use crate::cuda::{self, Arg};
    use crate::Result;

    /// One thread per element.
    pub(super) fn scatter(dst: &Tensor, rows: &[u32], src: &Tensor) -> Result<()> {
        let n = src.elem_count();
        let row_len = n / rows.len();
        let rows = Tensor::from_vec(rows.iter().map(|&r| r as i32).collect::<Vec<_>>(), rows.len(), dst.device())?;
        let args = [Arg::at(src)?, Arg::at(dst)?, Arg::at(&rows)?, Arg::I64(row_len as i64), Arg::I64(n as i64)];
        cuda::launch(dst.device(), &cuda::RECURRENT, "scatter_rows", dst.dtype(), cuda::grid_for(n, 256)?, &args)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    #[test]
    fn rows_land_where_they_are_sent() {
        let dst = Tensor::zeros((5, 2, 3), DType::F32, &Device::Cpu).unwrap();
        let src = Tensor::arange(0f32, 12., &Device::Cpu).unwrap().reshape((2, 2, 3)).unwrap();
        scatter(&dst, &[3, 0], &src).unwrap();
        let got = dst.to_vec3::<f32>().unwrap();
        assert_eq!(got[3], src.get(0).unwrap().to_vec2::<f32>().unwrap());
        assert_eq!(got[0], src.get(1).unwrap().to_vec2::<f32>().unwrap());
        assert!(got[1].iter().chain(&got[2]).chain(&got[4]).flatten().all(|&x| x == 0.0), "other rows untouched");
        assert!(scatter(&dst, &[5, 0], &src).is_err(), "a row past the pool is refused");
    }
}
