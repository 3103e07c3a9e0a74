//! Attention KV store: per row, keys and values of every past position.
//!
//! Rows have their own lengths. They live either in a pool of fixed-size blocks shared by the
//! batch's rows ([`crate::KvPool`], see `paged.rs`), or each in its own buffers `[Hkv,
//! capacity, D]`, written in place and grown by doubling, so appending a token costs O(1)
//! amortised instead of a copy of the whole history. Stores built from a [`crate::StateSpec`]
//! alone (one-off runs, snapshots, restored entries) own their buffers; a served batch is
//! paged. The two answer the same questions with the same bits.

use candle_core::{DType, Device, Tensor};
use strata_kernels::attention::{self, PagedKv, Scoring};

use crate::paged::{PagedLayout, PagedRows};
use crate::spec::{KvShape, StateCost, Storage};
use crate::{buffer_bytes, Result, StateError};

#[derive(Clone, Debug)]
struct KvRow {
    k: Tensor,
    v: Tensor,
    len: usize,
}

#[derive(Clone, Debug)]
enum Rows {
    Owned(Vec<KvRow>),
    Paged(PagedRows),
}

#[derive(Clone, Debug)]
pub struct KvStore {
    rows: Rows,
    shape: KvShape,
    dtype: DType,
    device: Device,
}

impl Storage for KvStore {
    type Shape = KvShape;
    const NAME: &'static str = "attention KV";
    const PARTS: &'static [&'static str] = &["k", "v"];

    fn empty(shape: &KvShape, rows: usize, dtype: DType, device: &Device) -> Result<Self> {
        let mut store = Self { rows: Rows::Owned(Vec::new()), shape: *shape, dtype, device: device.clone() };
        store.rows = Rows::Owned((0..rows).map(|_| store.empty_row(0)).collect::<Result<_>>()?);
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
    /// A store of `paged`'s rows.
    pub(crate) fn paged(shape: KvShape, dtype: DType, device: &Device, paged: PagedRows) -> KvStore {
        KvStore { rows: Rows::Paged(paged), shape, dtype, device: device.clone() }
    }

    pub(crate) fn paged_rows(&self) -> Option<&PagedRows> {
        match &self.rows {
            Rows::Paged(paged) => Some(paged),
            Rows::Owned(_) => None,
        }
    }

    /// Where a kernel writing and reading the rows in place finds them: the pool's tensors and
    /// the rows' block tables; `None` for rows in buffers of their own.
    pub fn paged_layout(&self) -> Option<PagedLayout> {
        self.paged_rows().map(PagedRows::layout)
    }

    fn empty_row(&self, capacity: usize) -> Result<KvRow> {
        let shape = (self.shape.kv_heads, capacity, self.shape.head_dim);
        Ok(KvRow {
            k: Tensor::zeros(shape, self.dtype, &self.device)?,
            v: Tensor::zeros(shape, self.dtype, &self.device)?,
            len: 0,
        })
    }

    /// Whether the rows live in a block pool (see [`crate::KvPool`]).
    pub fn is_paged(&self) -> bool {
        matches!(self.rows, Rows::Paged(_))
    }

    pub fn rows(&self) -> usize {
        match &self.rows {
            Rows::Owned(rows) => rows.len(),
            Rows::Paged(paged) => paged.rows(),
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn len(&self, row: usize) -> usize {
        match &self.rows {
            Rows::Owned(rows) => rows[row].len,
            Rows::Paged(paged) => paged.len(row),
        }
    }

    fn lens(&self) -> Vec<usize> {
        match &self.rows {
            Rows::Owned(rows) => rows.iter().map(|r| r.len).collect(),
            Rows::Paged(paged) => paged.lens().collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.lens().iter().all(|&len| len == 0)
    }

    /// Bytes of stored positions (not of spare capacity).
    pub fn bytes(&self) -> usize {
        self.lens().iter().sum::<usize>() * self.shape.bytes_per_token(self.dtype)
    }

    /// Bytes of the buffers held: spare capacity of grown rows included, or the whole blocks
    /// a paged row holds (a block shared by rows counts for each).
    pub fn allocated_bytes(&self) -> usize {
        match &self.rows {
            Rows::Owned(rows) => rows.iter().map(|r| buffer_bytes(&r.k) + buffer_bytes(&r.v)).sum(),
            Rows::Paged(paged) => paged.held_positions() * self.shape.bytes_per_token(self.dtype),
        }
    }

    /// Appends `k`, `v` (`[Hkv, T, D]`) to `row` and returns its whole history.
    pub fn append(&mut self, row: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        match &mut self.rows {
            Rows::Owned(_) => {
                let t = k.dim(1)?;
                self.reserve(row, t)?;
                let dtype = self.dtype;
                let r = &mut self.owned_mut()[row];
                r.k.slice_set(&k.to_dtype(dtype)?.contiguous()?, 1, r.len)?;
                r.v.slice_set(&v.to_dtype(dtype)?.contiguous()?, 1, r.len)?;
                r.len += t;
            }
            Rows::Paged(paged) => paged.append(row, k, v)?,
        }
        self.history(row)
    }

    /// Appends `k[r]`, `v[r]` (`k`, `v` `[rows, Hkv, T, D]`) to every row `r` and returns each
    /// row's whole history; one write for all rows where the device allows.
    pub fn append_rows(&mut self, k: &Tensor, v: &Tensor) -> Result<Vec<(Tensor, Tensor)>> {
        if let Rows::Paged(paged) = &mut self.rows {
            Self::append_paged(paged, k, v)?;
            return (0..self.rows()).map(|row| self.history(row)).collect();
        }
        let t = k.dim(2)?;
        self.reserve_rows(t)?;
        let (k, v) = (k.to_dtype(self.dtype)?, v.to_dtype(self.dtype)?);
        let rows = self.owned_mut();
        attention::write_rows(&k, &rows.iter().map(|r| (&r.k, r.len)).collect::<Vec<_>>())?;
        attention::write_rows(&v, &rows.iter().map(|r| (&r.v, r.len)).collect::<Vec<_>>())?;
        rows.iter_mut().for_each(|r| r.len += t);
        (0..self.rows()).map(|row| self.history(row)).collect()
    }

    /// The rows of an owned store. Only called where `self.rows` was matched as owned.
    fn owned_mut(&mut self) -> &mut Vec<KvRow> {
        match &mut self.rows {
            Rows::Owned(rows) => rows,
            Rows::Paged(_) => unreachable!("owned_mut on a paged store"),
        }
    }

    fn not_paged(&self, what: &str) -> Result<&Vec<KvRow>> {
        match &self.rows {
            Rows::Owned(rows) => Ok(rows),
            Rows::Paged(_) => Err(StateError::BadPart(format!("{what} needs a store that owns its buffers, not a paged one"))),
        }
    }

    /// Pool blocks that room for `t` more positions in every row would take (0 for rows in
    /// their own buffers).
    pub fn blocks_to_reserve(&self, t: usize) -> usize {
        self.paged_rows().map_or(0, |paged| paged.blocks_to_reserve(t))
    }

    /// Room for `t` more positions in every row, in buffers or blocks of its own (see
    /// [`KvStore::buffers`], [`KvStore::paged_layout`]).
    pub fn reserve_rows(&mut self, t: usize) -> Result<()> {
        if let Rows::Paged(paged) = &mut self.rows {
            return paged.reserve_rows(t);
        }
        (0..self.rows()).try_for_each(|row| self.reserve(row, t))
    }

    /// Appends `k`, `v` (`[B, Hkv, T, D]`) to every row and attends `q` (`[B, Hq, T, D]`) over
    /// each row's history: with `gate` (`[B, T, Hq, D]`), gated as
    /// [`attention::gated_attention_rows`] returns it (`[B, T, Hq·D]`), else `[B, Hq, T, D]`.
    /// The one attention every family's full-attention layers go through: on CUDA, paged rows
    /// of a few positions are written and read through their block tables in place.
    pub fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, scoring: Scoring, gate: Option<&Tensor>) -> Result<Tensor> {
        if let Rows::Paged(paged) = &mut self.rows {
            let t = k.dim(2)?;
            paged.reserve_rows(t)?;
            let layout = paged.layout();
            let lens: Vec<usize> = layout.lens.iter().map(|len| len + t).collect();
            if let Some(out) = attention::paged_append_attend(q, k, v, &kernel_view(&layout, &lens), scoring, gate)? {
                paged.commit_written(t)?;
                return Ok(out);
            }
        }
        if let Rows::Paged(paged) = &mut self.rows {
            if paged.rows() > 1 {
                Self::append_paged(paged, k, v)?;
                // Rows equally long (prompts prefilled together) attend as one batch.
                if let Some((keys, values)) = paged.stacked_history()? {
                    return Ok(match gate {
                        Some(gate) => attention::gated_attention_batch(q, &keys, &values, scoring, gate)?,
                        None => attention::causal_attention_batch(q, &keys, &values, scoring)?,
                    });
                }
                let history = (0..paged.rows()).map(|row| paged.history(row)).collect::<Result<Vec<_>>>()?;
                return Self::attend_rows(q, &history, scoring, gate);
            }
        }
        let history = self.append_rows(k, v)?;
        Self::attend_rows(q, &history, scoring, gate)
    }

    fn attend_rows(q: &Tensor, history: &[(Tensor, Tensor)], scoring: Scoring, gate: Option<&Tensor>) -> Result<Tensor> {
        Ok(match gate {
            Some(gate) => attention::gated_attention_rows(q, history, scoring, gate)?,
            None => attention::causal_attention_rows(q, history, scoring)?,
        })
    }

    /// Writes `k`, `v` (`[B, Hkv, T, D]`) after every paged row's positions.
    fn append_paged(paged: &mut PagedRows, k: &Tensor, v: &Tensor) -> Result<()> {
        let t = k.dim(2)?;
        paged.reserve_rows(t)?;
        let layout = paged.layout();
        let lens: Vec<usize> = layout.lens.iter().map(|len| len + t).collect();
        if attention::write_paged(k, v, &kernel_view(&layout, &lens))? {
            return paged.commit_written(t);
        }
        for row in 0..paged.rows() {
            paged.append(row, &k.get(row)?, &v.get(row)?)?;
        }
        Ok(())
    }

    /// Each row's whole key and value buffers `[Hkv, capacity, D]`, for kernels that write a
    /// step's positions in place themselves (a captured decode step); they stay these buffers
    /// while appends fit the capacity. [`KvStore::commit_written`] then counts what was written.
    pub fn buffers(&self) -> Result<Vec<(Tensor, Tensor)>> {
        Ok(self.not_paged("row buffers")?.iter().map(|r| (r.k.clone(), r.v.clone())).collect())
    }

    /// Counts `t` more positions in every row, written into [`KvStore::buffers`] (or the blocks
    /// of [`KvStore::paged_layout`]) by a device kernel rather than through
    /// [`KvStore::append_rows`].
    pub fn commit_written(&mut self, t: usize) -> Result<()> {
        if let Rows::Paged(paged) = &mut self.rows {
            return paged.commit_written(t);
        }
        for r in self.not_paged("counting written positions")? {
            let capacity = r.k.dim(1)?;
            if r.len + t > capacity {
                return Err(StateError::PastCapacity { len: r.len, written: t, capacity });
            }
        }
        self.owned_mut().iter_mut().for_each(|r| r.len += t);
        Ok(())
    }

    /// Room for `t` more positions in owned `row`, doubling its buffers when full.
    fn reserve(&mut self, row: usize, t: usize) -> Result<()> {
        let (len, capacity) = {
            let r = &self.not_paged("reserving buffer room")?[row];
            (r.len, r.k.dim(1)?)
        };
        if len + t > capacity {
            let mut grown = self.empty_row((len + t).max(2 * capacity).max(16))?;
            let old = &mut self.owned_mut()[row];
            if len > 0 {
                grown.k.slice_set(&old.k.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                grown.v.slice_set(&old.v.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
            }
            grown.len = len;
            *old = grown;
        }
        Ok(())
    }

    /// `row`'s stored keys and values, `[Hkv, len, D]`: views of an owned row's buffers, or
    /// copies gathered from a paged row's blocks.
    pub fn history(&self, row: usize) -> Result<(Tensor, Tensor)> {
        match &self.rows {
            Rows::Owned(rows) => {
                let r = &rows[row];
                Ok((r.k.narrow(1, 0, r.len)?, r.v.narrow(1, 0, r.len)?))
            }
            Rows::Paged(paged) => paged.history(row),
        }
    }

    /// Cuts `row` back to its first `len` positions.
    pub fn trim(&mut self, row: usize, len: usize) -> Result<()> {
        match &mut self.rows {
            Rows::Owned(rows) => {
                let r = &mut rows[row];
                if len > r.len {
                    return Err(StateError::Untrimmable { kind: "attention KV", from: r.len, to: len });
                }
                r.len = len;
                Ok(())
            }
            Rows::Paged(paged) => paged.trim(row, len),
        }
    }

    /// Appends `other`'s rows after this store's: a paged row of the same pool joins by its
    /// block table (no copy); any other row is copied in.
    pub fn merge(&mut self, other: &KvStore) -> Result<()> {
        match (&mut self.rows, &other.rows) {
            (Rows::Owned(a), Rows::Owned(b)) => a.extend(b.iter().cloned()),
            (Rows::Paged(a), Rows::Paged(b)) if a.same_pool(b) => a.merge(b),
            _ => {
                for row in 0..other.rows() {
                    let (k, v) = other.history(row)?;
                    let at = self.rows();
                    match &mut self.rows {
                        Rows::Owned(rows) => {
                            rows.push(KvRow { k: k.force_contiguous()?, v: v.force_contiguous()?, len: k.dim(1)? })
                        }
                        Rows::Paged(paged) => {
                            paged.push_empty();
                            paged.append(at, &k, &v)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        let n = self.rows();
        if let Some(&bad) = keep.iter().find(|&&r| r >= n) {
            return Err(StateError::RowOutOfRange { row: bad, rows: n });
        }
        match &mut self.rows {
            Rows::Owned(rows) => *rows = keep.iter().map(|&r| rows[r].clone()).collect(),
            Rows::Paged(paged) => paged.filter(keep),
        }
        Ok(())
    }

    /// One single-row store per row, each keeping its row's buffers or blocks.
    pub fn split(self) -> Vec<KvStore> {
        let one = |rows| KvStore { rows, ..self.clone_empty() };
        match &self.rows {
            Rows::Owned(rows) => rows.iter().map(|r| one(Rows::Owned(vec![r.clone()]))).collect(),
            Rows::Paged(paged) => paged.split().into_iter().map(|p| one(Rows::Paged(p))).collect(),
        }
    }

    /// An owned single-row copy of `row`, in buffers of its own (a paged row's blocks are
    /// copied out: snapshots and cache entries never hold pool blocks).
    pub fn extract(&self, row: usize) -> Result<KvStore> {
        let n = self.rows();
        if row >= n {
            return Err(StateError::RowOutOfRange { row, rows: n });
        }
        let (k, v) = self.history(row)?;
        Ok(KvStore {
            rows: Rows::Owned(vec![KvRow { k: k.force_contiguous()?, v: v.force_contiguous()?, len: k.dim(1)? }]),
            ..self.clone_empty()
        })
    }

    /// A single-row store of `row`: a pooled row shares its blocks (each copied when either
    /// side writes into it), a row in buffers of its own is copied ([`KvStore::extract`]).
    pub fn share(&self, row: usize) -> Result<KvStore> {
        let n = self.rows();
        if row >= n {
            return Err(StateError::RowOutOfRange { row, rows: n });
        }
        match &self.rows {
            Rows::Paged(paged) => Ok(KvStore { rows: Rows::Paged(paged.row(row)), ..self.clone_empty() }),
            Rows::Owned(_) => self.extract(row),
        }
    }

    /// A single-row store holding `k`, `v` (`[Hkv, len, D]`) in its own buffers, shaped like
    /// this store's rows; the error names what does not match.
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
        Ok(KvStore { rows: Rows::Owned(vec![row]), ..self.clone_empty() })
    }

    fn clone_empty(&self) -> KvStore {
        KvStore { rows: Rows::Owned(Vec::new()), shape: self.shape, dtype: self.dtype, device: self.device.clone() }
    }
}

/// `layout`'s pool as the paged kernels read it, each row `lens[r]` positions long.
fn kernel_view<'a>(layout: &'a PagedLayout, lens: &'a [usize]) -> PagedKv<'a> {
    PagedKv { keys: &layout.keys, values: &layout.values, block_size: layout.block_size, tables: &layout.tables, lens }
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
