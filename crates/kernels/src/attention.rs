//! Causal softmax attention for one row, with grouped-query heads, over that row's KV history.

use candle_core::{DType, Tensor, D};

use crate::Result;

/// `q` `[Hq, T, D]` for the row's newest `T` positions; `k`, `v` `[Hkv, L, D]` hold its whole
/// history including those `T` (so the query at index `i` sits at position `L - T + i` and sees
/// keys `0..=L-T+i`). Query head `h` reads KV head `h / (Hq / Hkv)`. Scores and softmax are f32;
/// the result `[Hq, T, D]` is in `q`'s dtype.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (hq, t_len, d) = q.dims3()?;
    let (hkv, l_len, _) = k.dims3()?;
    let group = hq / hkv;
    let dtype = q.dtype();
    // Fold the query heads that share a KV head into the time axis: [Hkv, G*T, D].
    let qg = q.reshape((hkv, group * t_len, d))?;
    let scores = (qg.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?;
    let scores = if t_len > 1 {
        let past = l_len - t_len;
        let mask: Vec<f32> = (0..group * t_len)
            .flat_map(|r| {
                let pos = past + r % t_len;
                (0..l_len).map(move |j| if j <= pos { 0.0 } else { f32::NEG_INFINITY })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (group * t_len, l_len), q.device())?;
        scores.broadcast_add(&mask)?
    } else {
        scores
    };
    let probs = softmax_last_dim(&scores)?.to_dtype(dtype)?;
    probs.matmul(&v.contiguous()?)?.reshape((hq, t_len, d))
}

fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Against a direct per-head, per-position loop.
    #[test]
    fn matches_naive_loop() {
        let dev = Device::Cpu;
        let (hq, hkv, t, l, d) = (4, 2, 3, 5, 8);
        let gen = |n: usize, s: f32| (0..n).map(|i| (i as f32 * 0.31 + s).cos()).collect::<Vec<_>>();
        let qd = gen(hq * t * d, 0.2);
        let kd = gen(hkv * l * d, 1.1);
        let vd = gen(hkv * l * d, 2.3);
        let q = Tensor::from_vec(qd.clone(), (hq, t, d), &dev).unwrap();
        let k = Tensor::from_vec(kd.clone(), (hkv, l, d), &dev).unwrap();
        let v = Tensor::from_vec(vd.clone(), (hkv, l, d), &dev).unwrap();
        let scale = 1.0 / (d as f64).sqrt();
        let out = causal_attention(&q, &k, &v, scale).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for h in 0..hq {
            let kh = h / (hq / hkv);
            for i in 0..t {
                let pos = l - t + i;
                let s: Vec<f32> = (0..=pos)
                    .map(|j| (0..d).map(|x| qd[(h * t + i) * d + x] * kd[(kh * l + j) * d + x]).sum::<f32>() * scale as f32)
                    .collect();
                let m = s.iter().cloned().fold(f32::MIN, f32::max);
                let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
                for x in 0..d {
                    let want: f32 = (0..=pos).map(|j| (s[j] - m).exp() / z * vd[(kh * l + j) * d + x]).sum();
                    let got = out[(h * t + i) * d + x];
                    assert!((want - got).abs() < 1e-5, "h{h} i{i} x{x}: {want} vs {got}");
                }
            }
        }
    }
}
