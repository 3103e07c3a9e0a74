//! Attention KV store: per row, keys and values of every past position.
//!
//! Rows have their own lengths, so each row owns its buffers: `[Hkv, capacity, D]`, written in
//! place and grown by doubling, so appending a token costs O(1) amortised instead of a copy of
//! the whole history.

use candle_core::{DType, Device, Tensor};
use strata_kernels::attention;

use crate::spec::{KvShape, StateCost, Storage};
use crate::{buffer_bytes, Result, StateError};

#[derive(Clone, Debug)]
struct KvRow {
    k: Tensor,
    v: Tensor,
    len: usize,
}

#[derive(Clone, Debug)]
pub struct KvStore {
    rows: Vec<KvRow>,
    shape: KvShape,
    dtype: DType,
    device: Device,
}

impl Storage for KvStore {
    type Shape = KvShape;
    const NAME: &'static str = "attention KV";
    const PARTS: &'static [&'static str] = &["k", "v"];

    fn empty(shape: &KvShape, rows: usize, dtype: DType, device: &Device) -> Result<Self> {
        let mut store = Self { rows: Vec::new(), shape: *shape, dtype, device: device.clone() };
        store.rows = (0..rows).map(|_| store.empty_row(0)).collect::<Result<_>>()?;
        Ok(store)
    }

    fn cost(shape: &KvShape, dtype: DType) -> StateCost {
        StateCost { bytes_per_token: shape.bytes_per_token(dtype), ..StateCost::default() }
    }
}

impl KvShape {
    /// Bytes per stored position (keys + values).
    pub(crate) fn bytes_per_token(&self, dtype: DType) -> usize {
        2 * self.kv_heads * self.head_dim * dtype.size_in_bytes()
    }
}

impl KvStore {
    fn empty_row(&self, capacity: usize) -> Result<KvRow> {
        let shape = (self.shape.kv_heads, capacity, self.shape.head_dim);
        Ok(KvRow {
            k: Tensor::zeros(shape, self.dtype, &self.device)?,
            v: Tensor::zeros(shape, self.dtype, &self.device)?,
            len: 0,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn len(&self, row: usize) -> usize {
        self.rows[row].len
    }

    pub fn is_empty(&self) -> bool {
        self.rows.iter().all(|r| r.len == 0)
    }

    /// Bytes of stored positions (not of spare capacity).
    pub fn bytes(&self) -> usize {
        self.rows.iter().map(|r| r.len).sum::<usize>() * self.shape.bytes_per_token(self.dtype)
    }

    /// Bytes of the buffers held, spare capacity of grown rows included.
    pub fn allocated_bytes(&self) -> usize {
        self.rows.iter().map(|r| buffer_bytes(&r.k) + buffer_bytes(&r.v)).sum()
    }

    /// Appends `k`, `v` (`[Hkv, T, D]`) to `row` and returns views of its whole history.
    pub fn append(&mut self, row: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let t = k.dim(1)?;
        self.reserve(row, t)?;
        let r = &mut self.rows[row];
        r.k.slice_set(&k.to_dtype(self.dtype)?.contiguous()?, 1, r.len)?;
        r.v.slice_set(&v.to_dtype(self.dtype)?.contiguous()?, 1, r.len)?;
        r.len += t;
        self.history(row)
    }

    /// Appends `k[r]`, `v[r]` (`k`, `v` `[rows, Hkv, T, D]`) to every row `r` and returns views
    /// of each row's whole history; one write for all rows where the device allows.
    pub fn append_rows(&mut self, k: &Tensor, v: &Tensor) -> Result<Vec<(Tensor, Tensor)>> {
        let t = k.dim(2)?;
        for row in 0..self.rows.len() {
            self.reserve(row, t)?;
        }
        let (k, v) = (k.to_dtype(self.dtype)?, v.to_dtype(self.dtype)?);
        attention::write_rows(&k, &self.rows.iter().map(|r| (&r.k, r.len)).collect::<Vec<_>>())?;
        attention::write_rows(&v, &self.rows.iter().map(|r| (&r.v, r.len)).collect::<Vec<_>>())?;
        for r in &mut self.rows {
            r.len += t;
        }
        (0..self.rows.len()).map(|row| self.history(row)).collect()
    }

    /// Room for `t` more positions in every row (see [`KvStore::buffers`]).
    pub fn reserve_rows(&mut self, t: usize) -> Result<()> {
        (0..self.rows.len()).try_for_each(|row| self.reserve(row, t))
    }

    /// Each row's whole key and value buffers `[Hkv, capacity, D]`, for kernels that write a
    /// step's positions in place themselves (a captured decode step); they stay these buffers
    /// while appends fit the capacity. [`KvStore::commit_written`] then counts what was written.
    pub fn buffers(&self) -> Vec<(Tensor, Tensor)> {
        self.rows.iter().map(|r| (r.k.clone(), r.v.clone())).collect()
    }

    /// Counts `t` more positions in every row, written into [`KvStore::buffers`] by a device
    /// kernel rather than through [`KvStore::append_rows`].
    pub fn commit_written(&mut self, t: usize) -> Result<()> {
        for r in &mut self.rows {
            let capacity = r.k.dim(1)?;
            if r.len + t > capacity {
                return Err(StateError::PastCapacity { len: r.len, written: t, capacity });
            }
        }
        self.rows.iter_mut().for_each(|r| r.len += t);
        Ok(())
    }

    /// Room for `t` more positions in `row`, doubling its buffers when full.
    fn reserve(&mut self, row: usize, t: usize) -> Result<()> {
        let needed = self.rows[row].len + t;
        if needed > self.rows[row].k.dim(1)? {
            let capacity = needed.max(2 * self.rows[row].k.dim(1)?).max(16);
            let mut grown = self.empty_row(capacity)?;
            let old = &self.rows[row];
            if old.len > 0 {
                grown.k.slice_set(&old.k.narrow(1, 0, old.len)?.contiguous()?, 1, 0)?;
                grown.v.slice_set(&old.v.narrow(1, 0, old.len)?.contiguous()?, 1, 0)?;
            }
            grown.len = old.len;
            self.rows[row] = grown;
        }
        Ok(())
    }

    /// Views of `row`'s stored keys and values, `[Hkv, len, D]`.
    pub fn history(&self, row: usize) -> Result<(Tensor, Tensor)> {
        let r = &self.rows[row];
        Ok((r.k.narrow(1, 0, r.len)?, r.v.narrow(1, 0, r.len)?))
    }

    /// Cuts `row` back to its first `len` positions.
    pub fn trim(&mut self, row: usize, len: usize) -> Result<()> {
        let r = &mut self.rows[row];
        if len > r.len {
            return Err(StateError::Untrimmable { kind: "attention KV", from: r.len, to: len });
        }
        r.len = len;
        Ok(())
    }

    pub fn merge(&mut self, other: &KvStore) -> Result<()> {
        self.rows.extend(other.rows.iter().cloned());
        Ok(())
    }

    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        let n = self.rows.len();
        if let Some(&bad) = keep.iter().find(|&&r| r >= n) {
            return Err(StateError::RowOutOfRange { row: bad, rows: n });
        }
        self.rows = keep.iter().map(|&r| self.rows[r].clone()).collect();
        Ok(())
    }

    pub fn extract(&self, row: usize) -> Result<KvStore> {
        let n = self.rows.len();
        let src = self.rows.get(row).ok_or(StateError::RowOutOfRange { row, rows: n })?;
        let mut copy = self.empty_row(src.len)?;
        if src.len > 0 {
            copy.k = src.k.narrow(1, 0, src.len)?.force_contiguous()?;
            copy.v = src.v.narrow(1, 0, src.len)?.force_contiguous()?;
        }
        copy.len = src.len;
        Ok(KvStore { rows: vec![copy], ..self.clone_empty() })
    }

    /// A single-row store holding `k`, `v` (`[Hkv, len, D]`), shaped like this store's rows;
    /// the error names what does not match.
    pub fn single_row(&self, k: Tensor, v: Tensor) -> Result<KvStore> {
        for (name, t) in [("k", &k), ("v", &v)] {
            let (h, _, d) = t.dims3()?;
            if (h, d) != (self.shape.kv_heads, self.shape.head_dim) || t.dtype() != self.dtype {
                return Err(StateError::BadPart(format!(
                    "attention {name} is {:?} {:?}, expected [{}, len, {}] {:?}",
                    t.dtype(),
                    t.dims(),
                    self.shape.kv_heads,
                    self.shape.head_dim,
                    self.dtype
                )));
            }
        }
        if k.dims() != v.dims() {
            return Err(StateError::BadPart(format!("attention k {:?} and v {:?} differ in shape", k.dims(), v.dims())));
        }
        let len = k.dim(1)?;
        let row = KvRow { k: k.to_device(&self.device)?, v: v.to_device(&self.device)?, len };
        Ok(KvStore { rows: vec![row], ..self.clone_empty() })
    }

    fn clone_empty(&self) -> KvStore {
        KvStore { rows: Vec::new(), shape: self.shape, dtype: self.dtype, device: self.device.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(h: usize, t: usize, d: usize, base: f32) -> Tensor {
        let data: Vec<f32> = (0..h * t * d).map(|i| base + i as f32).collect();
        Tensor::from_vec(data, (h, t, d), &Device::Cpu).unwrap()
    }

    #[test]
    fn append_grow_trim_extract() {
        let mut kv = KvStore::empty(&KvShape { kv_heads: 2, head_dim: 3 }, 2, DType::F32, &Device::Cpu).unwrap();
        let mut all = Vec::new();
        for step in 0..40 {
            let k = seq(2, 1, 3, step as f32 * 100.0);
            all.push(k.clone());
            let (hk, _) = kv.append(1, &k, &k).unwrap();
            let want = Tensor::cat(&all, 1).unwrap();
            assert_eq!(hk.to_vec3::<f32>().unwrap(), want.to_vec3::<f32>().unwrap());
        }
        assert_eq!((kv.len(0), kv.len(1)), (0, 40));
        kv.trim(1, 10).unwrap();
        assert!(kv.trim(1, 11).is_err());
        let one = kv.extract(1).unwrap();
        assert_eq!(one.rows(), 1);
        assert_eq!(one.len(0), 10);
        // The copy owns its data: writing more to the batch leaves it unchanged.
        kv.append(1, &seq(2, 1, 3, -1.0), &seq(2, 1, 3, -1.0)).unwrap();
        let (k, _) = one.history(0).unwrap();
        assert_eq!(k.to_vec3::<f32>().unwrap(), Tensor::cat(&all[..10], 1).unwrap().to_vec3::<f32>().unwrap());
        kv.filter(&[1]).unwrap();
        assert_eq!((kv.rows(), kv.len(0)), (1, 11));
    }
}
