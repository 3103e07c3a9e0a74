//! Sliding-window attention KV: per row, a ring that keeps only the most recent positions.
//!
//! A query at position `p` of a window-`W` layer reads keys `p - W + 1 ..= p`, so between
//! forwards a row needs its last `W - 1` positions. The ring keeps `W - 1 + ROUND_SLACK`: the
//! slack lets a speculative round that fed up to `ROUND_SLACK` positions be taken back. Once a
//! row has dropped positions (wrapped), it can only be trimmed back to where its window is still
//! whole; a row that has not wrapped trims like a full KV store.

use candle_core::{DType, Device, Tensor};

use crate::{Result, StateError};

/// Positions kept beyond the window, so that a round of this many fed positions can be rolled
/// back after the ring wrapped (a verify forward feeds at most 64).
pub const ROUND_SLACK: usize = 64;

#[derive(Clone, Debug)]
struct WindowRow {
    /// `[Hkv, slots, D]`; position `p` lives in slot `p % capacity`. `slots` grows by doubling
    /// up to `capacity`, and while it is smaller no position has wrapped.
    k: Tensor,
    v: Tensor,
    /// Positions consumed.
    len: usize,
    /// The oldest position still held.
    oldest: usize,
}

#[derive(Clone, Debug)]
pub struct WindowKvStore {
    rows: Vec<WindowRow>,
    window: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

impl WindowKvStore {
    pub fn new(rows: usize, window: usize, kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Result<Self> {
        if window == 0 {
            return Err(StateError::BadPart("a sliding window of 0 positions".into()));
        }
        let mut store = Self { rows: Vec::new(), window, kv_heads, head_dim, dtype, device: device.clone() };
        for _ in 0..rows {
            let row = store.empty_row(0)?;
            store.rows.push(row);
        }
        Ok(store)
    }

    /// Slots of a full ring.
    pub fn capacity(&self) -> usize {
        Self::capacity_for(self.window)
    }

    /// Slots of a full ring for a window of `window` positions.
    pub fn capacity_for(window: usize) -> usize {
        window - 1 + ROUND_SLACK
    }

    fn empty_row(&self, slots: usize) -> Result<WindowRow> {
        let shape = (self.kv_heads, slots, self.head_dim);
        Ok(WindowRow {
            k: Tensor::zeros(shape, self.dtype, &self.device)?,
            v: Tensor::zeros(shape, self.dtype, &self.device)?,
            len: 0,
            oldest: 0,
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

    /// Bytes of held positions.
    pub fn bytes(&self) -> usize {
        let held: usize = self.rows.iter().map(|r| r.len - r.oldest).sum();
        held * crate::KvStore::bytes_per_token(self.kv_heads, self.head_dim, self.dtype)
    }

    /// Appends `k`, `v` (`[Hkv, T, D]`) to `row` and returns the keys and values the `T` new
    /// queries need, in position order: the held positions within the window of the first new
    /// query, then the new ones. The caller masks each query to its own window.
    pub fn append(&mut self, row: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = (k.to_dtype(self.dtype)?.contiguous()?, v.to_dtype(self.dtype)?.contiguous()?);
        let t = k.dim(1)?;
        let len = self.rows[row].len;
        let from = len.saturating_sub(self.window - 1).max(self.rows[row].oldest);
        let (past_k, past_v) = self.range(row, from, len)?;
        let keys = Tensor::cat(&[&past_k, &k], 1)?;
        let values = Tensor::cat(&[&past_v, &v], 1)?;
        self.store(row, &k, &v)?;
        debug_assert_eq!(self.rows[row].len, len + t);
        Ok((keys, values))
    }

    /// Writes new positions into the ring, growing it while it is below capacity.
    fn store(&mut self, row: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let capacity = self.capacity();
        let t = k.dim(1)?;
        let (len, slots) = (self.rows[row].len, self.rows[row].k.dim(1)?);
        if slots < capacity && len + t > slots {
            let grown_slots = (len + t).max(2 * slots).max(16).min(capacity);
            let mut grown = self.empty_row(grown_slots)?;
            let old = &self.rows[row];
            // Not wrapped yet: positions 0..len sit in slots 0..len.
            if len > 0 {
                grown.k.slice_set(&old.k.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                grown.v.slice_set(&old.v.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
            }
            grown.len = len;
            self.rows[row] = grown;
        }
        let slots = self.rows[row].k.dim(1)?;
        // Only the last `slots` new positions can be held.
        let skip = t.saturating_sub(slots);
        let mut p = len + skip;
        while p < len + t {
            let slot = p % capacity;
            let n = (slots - slot).min(len + t - p);
            let r = &mut self.rows[row];
            r.k.slice_set(&k.narrow(1, p - len, n)?.contiguous()?, 1, slot)?;
            r.v.slice_set(&v.narrow(1, p - len, n)?.contiguous()?, 1, slot)?;
            p += n;
        }
        let r = &mut self.rows[row];
        r.len = len + t;
        r.oldest = r.oldest.max(r.len.saturating_sub(capacity));
        Ok(())
    }

    /// Keys and values of positions `from..to` of `row` (all held), in order.
    fn range(&self, row: usize, from: usize, to: usize) -> Result<(Tensor, Tensor)> {
        let r = &self.rows[row];
        debug_assert!(r.oldest <= from && to <= r.len);
        let capacity = self.capacity();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut p = from;
        while p < to {
            let slot = p % capacity;
            let n = (r.k.dim(1)? - slot).min(to - p);
            ks.push(r.k.narrow(1, slot, n)?);
            vs.push(r.v.narrow(1, slot, n)?);
            p += n;
        }
        if ks.is_empty() {
            let empty = Tensor::zeros((self.kv_heads, 0, self.head_dim), self.dtype, &self.device)?;
            return Ok((empty.clone(), empty));
        }
        Ok((Tensor::cat(&ks, 1)?, Tensor::cat(&vs, 1)?))
    }

    /// Whether `row` can be cut back to `len`: its window there must still be held.
    pub fn can_trim_to(&self, row: usize, len: usize) -> bool {
        let r = &self.rows[row];
        len <= r.len && len.saturating_sub(self.window - 1) >= r.oldest
    }

    /// Whether every row can be cut back to any earlier position (none has wrapped).
    pub fn can_trim(&self) -> bool {
        self.rows.iter().all(|r| r.oldest == 0)
    }

    pub fn trim(&mut self, row: usize, len: usize) -> Result<()> {
        if !self.can_trim_to(row, len) {
            return Err(StateError::Untrimmable { kind: "sliding-window KV", from: self.rows[row].len, to: len });
        }
        self.rows[row].len = len;
        Ok(())
    }

    pub fn merge(&mut self, other: &WindowKvStore) -> Result<()> {
        if other.window != self.window {
            return Err(StateError::KindMismatch("sliding-window KV", "sliding-window KV of another window"));
        }
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

    /// An owned single-row copy of `row`.
    pub fn extract(&self, row: usize) -> Result<WindowKvStore> {
        let n = self.rows.len();
        let src = self.rows.get(row).ok_or(StateError::RowOutOfRange { row, rows: n })?;
        let copy = WindowRow { k: src.k.copy()?, v: src.v.copy()?, len: src.len, oldest: src.oldest };
        Ok(WindowKvStore { rows: vec![copy], ..self.clone_empty() })
    }

    /// The held positions of `row` in order (`[Hkv, n, D]` each): what persistence stores.
    pub fn held(&self, row: usize) -> Result<(Tensor, Tensor)> {
        let r = &self.rows[row];
        let (k, v) = self.range(row, r.oldest, r.len)?;
        Ok((k.force_contiguous()?, v.force_contiguous()?))
    }

    /// A single-row store at `position` holding `k`, `v` (`[Hkv, n, D]`, the last `n` positions
    /// before `position`), shaped like this store; the error names what does not fit.
    pub fn single_row(&self, k: Tensor, v: Tensor, position: usize) -> Result<WindowKvStore> {
        for (name, t) in [("k", &k), ("v", &v)] {
            let (h, _, d) = t.dims3()?;
            if (h, d) != (self.kv_heads, self.head_dim) || t.dtype() != self.dtype {
                return Err(StateError::BadPart(format!(
                    "sliding-window {name} is {:?} {:?}, expected [{}, n, {}] {:?}",
                    t.dtype(),
                    t.dims(),
                    self.kv_heads,
                    self.head_dim,
                    self.dtype
                )));
            }
        }
        let held = k.dim(1)?;
        if k.dims() != v.dims() {
            return Err(StateError::BadPart(format!("sliding-window k {:?} and v {:?} differ", k.dims(), v.dims())));
        }
        let needed = position.min(self.window - 1);
        if held > position || held > self.capacity() || held < needed {
            return Err(StateError::BadPart(format!(
                "sliding-window state holds {held} positions at position {position}; expected {needed}..={}",
                position.min(self.capacity())
            )));
        }
        let mut store = WindowKvStore { rows: vec![self.empty_row(0)?], ..self.clone_empty() };
        let oldest = position - held;
        store.rows[0].len = oldest;
        store.rows[0].oldest = oldest;
        if oldest > 0 {
            // Positions before `oldest` are gone: start from a full ring so slots line up.
            store.rows[0] = WindowRow { len: oldest, oldest, ..self.empty_row(self.capacity())? };
        }
        store.store(0, &k.to_device(&self.device)?, &v.to_device(&self.device)?)?;
        Ok(store)
    }

    fn clone_empty(&self) -> WindowKvStore {
        WindowKvStore {
            rows: Vec::new(),
            window: self.window,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype: self.dtype,
            device: self.device.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[1, t, 1]` holding the positions `start..start + t` as values.
    fn positions(start: usize, t: usize) -> Tensor {
        let data: Vec<f32> = (start..start + t).map(|p| p as f32).collect();
        Tensor::from_vec(data, (1, t, 1), &Device::Cpu).unwrap()
    }

    fn values(t: &Tensor) -> Vec<usize> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(|x| x as usize).collect()
    }

    /// Against the definition: after any sequence of chunk sizes, `append` hands out exactly the
    /// positions `max(0, first query - W + 1) .. end`, and the ring holds the last `capacity`.
    #[test]
    fn appends_hand_out_each_window_in_order() {
        let window = 5;
        let mut kv = WindowKvStore::new(2, window, 1, 1, DType::F32, &Device::Cpu).unwrap();
        let capacity = kv.capacity();
        let mut len = 0;
        for t in [1, 3, 2, 7, 1, 1, 40, 1, 70, 2, 1, 130, 1] {
            let (k, v) = kv.append(1, &positions(len, t), &positions(len, t)).unwrap();
            let first = len.saturating_sub(window - 1);
            assert_eq!(values(&k), (first..len + t).collect::<Vec<_>>(), "chunk of {t} at {len}");
            assert_eq!(values(&k), values(&v));
            len += t;
            let (held, _) = kv.held(1).unwrap();
            assert_eq!(values(&held), (len.saturating_sub(capacity)..len).collect::<Vec<_>>());
        }
        assert_eq!((kv.len(0), kv.len(1)), (0, len));
    }

    #[test]
    fn trims_only_while_the_window_is_held() {
        let window = 4;
        let mut kv = WindowKvStore::new(1, window, 1, 1, DType::F32, &Device::Cpu).unwrap();
        let capacity = kv.capacity();
        kv.append(0, &positions(0, 10), &positions(0, 10)).unwrap();
        assert!(kv.can_trim());
        kv.trim(0, 2).unwrap();
        kv.append(0, &positions(2, 3), &positions(2, 3)).unwrap();
        let (held, _) = kv.held(0).unwrap();
        assert_eq!(values(&held), (0..5).collect::<Vec<_>>());

        // Wrap: now only trims that keep the window whole are possible.
        kv.append(0, &positions(5, capacity), &positions(5, capacity)).unwrap();
        let len = 5 + capacity;
        assert!(!kv.can_trim());
        let oldest = len - capacity;
        assert!(kv.can_trim_to(0, oldest + window - 1));
        assert!(!kv.can_trim_to(0, oldest + window - 2));
        assert!(kv.trim(0, oldest + window - 2).is_err());
        // A round of ROUND_SLACK positions fed after the wrap can be taken back to one kept.
        let before = len;
        kv.append(0, &positions(before, ROUND_SLACK), &positions(before, ROUND_SLACK)).unwrap();
        kv.trim(0, before + 1).unwrap();
        let (k, _) = kv.append(0, &positions(before + 1, 1), &positions(before + 1, 1)).unwrap();
        assert_eq!(values(&k), (before + 2 - window..before + 2).collect::<Vec<_>>());
    }

    #[test]
    fn held_positions_round_trip_through_single_row() {
        let window = 6;
        let kv0 = WindowKvStore::new(1, window, 1, 1, DType::F32, &Device::Cpu).unwrap();
        for total in [0, 3, 5, 50, 69, 70, 71, 200] {
            let mut kv = kv0.clone();
            kv.append(0, &positions(0, total), &positions(0, total)).unwrap();
            let (k, v) = kv.held(0).unwrap();
            let mut back = kv0.single_row(k, v, total).unwrap();
            assert_eq!(back.can_trim(), kv.can_trim());
            // Both continue identically.
            let a = kv.append(0, &positions(total, 2), &positions(total, 2)).unwrap().0;
            let b = back.append(0, &positions(total, 2), &positions(total, 2)).unwrap().0;
            assert_eq!(values(&a), values(&b), "after {total}");
        }
        let k = positions(0, 2);
        assert!(kv0.single_row(k.clone(), k.clone(), 40).is_err(), "too few positions for the window");
        assert!(kv0.single_row(k.clone(), k, 1).is_err(), "more positions than consumed");
    }
}
