//! Sliding-window attention KV: per row, a buffer that keeps only the most recent positions.
//!
//! A query at position `p` of a window-`W` layer reads keys `p - W + 1 ..= p`, so between
//! forwards a row needs its last `W - 1` positions. The store keeps at least the last
//! `W - 1 + ROUND_SLACK`: the slack lets the positions of a speculative round (or of several
//! one-token draft steps, up to `ROUND_SLACK` in all) be taken back. Once a row has dropped
//! positions, it can only be trimmed back to where its window is still whole; a row that has
//! dropped none trims like a full KV store.
//!
//! Held positions sit in order in one buffer of `W - 1 + 2 * ROUND_SLACK` slots, so the keys
//! and values a forward needs are a view of it, never a copy. When the buffer is full, the
//! positions still needed move to its front: `W - 1 + ROUND_SLACK` positions once every
//! `ROUND_SLACK` appended (a ring would avoid the move but hand out two pieces to join, a copy
//! of the whole window on every decode step).

use candle_core::{Device, Tensor};

use strata_kernels::attention;

use crate::format::{KvCoding, Prefix};
use crate::spec::{StateCost, Storage, StoreContext, WindowShape};
use crate::{buffer_bytes, KvFormat, KvPart, Result, StateError};

/// Positions kept beyond the window, so that this many fed positions can be rolled back after
/// older ones were dropped (a verify forward feeds at most 64).
pub const ROUND_SLACK: usize = 64;

#[derive(Clone, Debug)]
struct WindowRow {
    /// `[Hkv, slots, width]` (as [`crate::KvStore`] stores positions); position `p` lives in
    /// slot `p - start`. `slots` grows by doubling up to the store's capacity.
    k: Tensor,
    v: Tensor,
    /// The position in slot 0.
    start: usize,
    /// Positions consumed.
    len: usize,
    /// The oldest position still held (at or after `start`).
    oldest: usize,
}

#[derive(Clone, Debug)]
pub struct WindowKvStore {
    rows: Vec<WindowRow>,
    /// Per row, a delayed format's unquantized first positions (see `format.rs`).
    prefixes: Vec<Option<Prefix>>,
    shape: WindowShape,
    coding: KvCoding,
    device: Device,
}

impl Storage for WindowKvStore {
    type Shape = WindowShape;
    const NAME: &'static str = "sliding-window KV";
    const PARTS: &'static [&'static str] = &["k", "v"];

    fn empty(shape: &WindowShape, rows: usize, cx: &StoreContext, device: &Device) -> Result<Self> {
        if shape.window == 0 {
            return Err(StateError::BadPart("a sliding window of 0 positions".into()));
        }
        let coding = KvCoding::new(cx.kv, &shape.kv, cx.layer, cx.dtype, cx.kv_start)?;
        let mut store = Self { rows: Vec::new(), prefixes: Vec::new(), shape: *shape, coding, device: device.clone() };
        store.rows = (0..rows).map(|_| store.empty_row(0, 0)).collect::<Result<_>>()?;
        store.prefixes = (0..rows).map(|_| store.coding.empty_prefix(&shape.kv, device)).collect::<Result<_>>()?;
        Ok(store)
    }

    /// A full buffer's positions at the per-token cost: what a row holds at most (and, for a
    /// delayed format, its unquantized first positions).
    fn cost(shape: &WindowShape, cx: &StoreContext) -> StateCost {
        let delayed = cx.kv.is_quantized() && cx.kv_start > 0;
        StateCost {
            window_bytes_per_token: cx.kv.bytes_per_token(&shape.kv, cx.dtype),
            window_positions: Self::capacity_for(shape.window),
            prefix_bytes_per_token: if delayed { KvFormat::Auto.bytes_per_token(&shape.kv, cx.dtype) } else { 0 },
            prefix_positions: if delayed { cx.kv_start } else { 0 },
            ..StateCost::default()
        }
    }
}

impl WindowKvStore {
    /// Slots of a full buffer.
    pub fn capacity(&self) -> usize {
        Self::capacity_for(self.shape.window)
    }

    /// Slots of a full buffer for a window of `window` positions.
    fn capacity_for(window: usize) -> usize {
        window - 1 + 2 * ROUND_SLACK
    }

    /// Positions always held (when consumed): the window and the rollback slack.
    fn kept(&self) -> usize {
        self.shape.window - 1 + ROUND_SLACK
    }

    fn empty_row(&self, slots: usize, start: usize) -> Result<WindowRow> {
        let zeros = |part| {
            let width = self.coding.width(&self.shape.kv, part);
            Tensor::zeros((self.shape.kv.kv_heads, slots, width), self.coding.stored_dtype(), &self.device)
        };
        Ok(WindowRow { k: zeros(KvPart::Keys)?, v: zeros(KvPart::Values)?, start, len: start, oldest: start })
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
        held * self.coding.bytes_per_token(&self.shape.kv) + self.prefix_bytes()
    }

    /// Bytes of delayed rows' unquantized first positions.
    fn prefix_bytes(&self) -> usize {
        let held: usize = self.prefixes.iter().flatten().map(Prefix::len).sum();
        held * KvFormat::Auto.bytes_per_token(&self.shape.kv, self.coding.dtype())
    }

    /// Bytes of the buffers held, free slots included.
    pub fn allocated_bytes(&self) -> usize {
        self.rows.iter().map(|r| buffer_bytes(&r.k) + buffer_bytes(&r.v)).sum::<usize>() + self.prefix_bytes()
    }

    /// Appends `k`, `v` (`[Hkv, T, D]`) to `row` and returns the keys and values the `T` new
    /// queries need, in position order: the held positions within the window of the first new
    /// query, then the new ones. The caller masks each query to its own window.
    /// (Decoded codes, also before a delayed format's start.)
    pub fn append(&mut self, row: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let len = self.rows[row].len;
        let (held_k, held_v) = self.append_stored(row, k, v)?;
        self.coding.extend_prefix(&mut self.prefixes[row], len, k, v)?;
        Ok((self.coding.decode(&held_k, KvPart::Keys)?, self.coding.decode(&held_v, KvPart::Values)?))
    }

    /// [`WindowKvStore::append`], returning what the queries need as stored.
    fn append_stored(&mut self, row: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let k = self.coding.encode(k, KvPart::Keys)?.contiguous()?;
        let v = self.coding.encode(v, KvPart::Values)?.contiguous()?;
        let t = k.dim(1)?;
        let (len, oldest) = (self.rows[row].len, self.rows[row].oldest);
        let end = len + t;
        let from = len.saturating_sub(self.shape.window - 1).max(oldest);
        // Keep the slack before the new window too, unless the new positions alone fill it.
        let keep = from.min(end.saturating_sub(self.kept()).max(oldest));
        if end - keep > self.capacity() {
            // A chunk longer than the slack: join it to the window (a copy as large as the
            // chunk's forward anyway) and hold the last `kept` positions.
            let r = &self.rows[row];
            let past = |t: &Tensor| t.narrow(1, from - r.start, len - from);
            let keys = Tensor::cat(&[&past(&r.k)?, &k], 1)?;
            let values = Tensor::cat(&[&past(&r.v)?, &v], 1)?;
            let held = self.kept();
            let mut fresh = self.empty_row(self.capacity(), end - held)?;
            fresh.k.slice_set(&keys.narrow(1, keys.dim(1)? - held, held)?.contiguous()?, 1, 0)?;
            fresh.v.slice_set(&values.narrow(1, values.dim(1)? - held, held)?.contiguous()?, 1, 0)?;
            fresh.len = end;
            self.rows[row] = fresh;
            return Ok((keys, values));
        }
        self.make_room(row, keep, end)?;
        let r = &mut self.rows[row];
        r.k.slice_set(&k, 1, len - r.start)?;
        r.v.slice_set(&v, 1, len - r.start)?;
        r.len = end;
        Ok((r.k.narrow(1, from - r.start, end - from)?, r.v.narrow(1, from - r.start, end - from)?))
    }

    /// Appends `k`, `v` (`[B, Hkv, T, D]`) to every row and attends `q` (`[B, Hq, T, D]`) over
    /// each row's window (`scoring` masks each query to it): `[B, Hq, T, D]`. The sliding-window
    /// twin of [`crate::KvStore::attend`].
    pub fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, scoring: attention::Scoring) -> Result<Tensor> {
        let lens: Vec<usize> = self.rows.iter().map(|r| r.len).collect();
        let mut held = Vec::with_capacity(self.rows());
        for (row, &len) in lens.iter().enumerate() {
            let (k, v) = (k.get(row)?, v.get(row)?);
            held.push(self.append_stored(row, &k, &v)?);
            self.coding.extend_prefix(&mut self.prefixes[row], len, &k, &v)?;
        }
        if !self.is_delayed() {
            return self.coding.attend(q, &held, scoring);
        }
        // A delayed format: per row, the queries before the start over the unquantized first
        // positions (from the first query's window on), the others over the codes.
        let t = q.dim(2)?;
        let mut rows = Vec::with_capacity(held.len());
        for (row, (held, &len)) in held.into_iter().zip(&lens).enumerate() {
            let mut pieces = Vec::new();
            for s in self.coding.segments(len, t) {
                let q = q.narrow(0, row, 1)?.narrow(2, s.offset, s.count)?;
                pieces.push(match (s.plain, &self.prefixes[row]) {
                    (true, Some(prefix)) => {
                        let keys = prefix.range(len.saturating_sub(self.shape.window - 1), len + s.offset + s.count)?;
                        attention::causal_attention_rows(&q, &[keys], scoring)?
                    }
                    _ => self.coding.attend(&q, std::slice::from_ref(&held), scoring)?,
                });
            }
            rows.push(Tensor::cat(&pieces, 2)?);
        }
        Ok(Tensor::cat(&rows, 0)?)
    }

    /// Whether the format is delayed (rows keep their first positions unquantized too).
    pub fn is_delayed(&self) -> bool {
        self.coding.start() > 0
    }

    /// A delayed row's unquantized first positions (`[Hkv, n, D]` each); `None` for other formats.
    pub fn prefix(&self, row: usize) -> Option<(Tensor, Tensor)> {
        self.prefixes[row].as_ref().map(|p| (p.k.clone(), p.v.clone()))
    }

    /// Makes slots for positions up to `end`, growing the buffer, or once it is full moving the
    /// positions from `keep` on to its front (`end - keep` fits the capacity).
    fn make_room(&mut self, row: usize, keep: usize, end: usize) -> Result<()> {
        let capacity = self.capacity();
        let r = &self.rows[row];
        let slots = r.k.dim(1)?;
        if end - r.start <= slots {
            return Ok(());
        }
        // Where slot 0 will be, and the size of a new buffer if this one is too small.
        let (start, grown) = if end - r.start <= capacity {
            (r.start, Some((end - r.start).max(2 * slots).max(16).min(capacity)))
        } else {
            (keep, (slots < capacity).then_some(capacity))
        };
        let (held_from, held) = (r.oldest.max(start), r.len - r.oldest.max(start));
        // Copies: the move may overlap its source.
        let (k, v) = (
            r.k.narrow(1, held_from - r.start, held)?.force_contiguous()?,
            r.v.narrow(1, held_from - r.start, held)?.force_contiguous()?,
        );
        let len = r.len;
        if let Some(slots) = grown {
            self.rows[row] = self.empty_row(slots, start)?;
        }
        let r = &mut self.rows[row];
        (r.start, r.len, r.oldest) = (start, len, held_from);
        r.k.slice_set(&k, 1, held_from - start)?;
        r.v.slice_set(&v, 1, held_from - start)?;
        Ok(())
    }

    /// Keys and values of `row`'s held positions, in order (views of the buffer).
    fn held_views(&self, row: usize) -> Result<(Tensor, Tensor)> {
        let r = &self.rows[row];
        let (at, n) = (r.oldest - r.start, r.len - r.oldest);
        Ok((r.k.narrow(1, at, n)?, r.v.narrow(1, at, n)?))
    }

    /// Whether `row` can be cut back to `len`: its window there must still be held.
    pub fn can_trim_to(&self, row: usize, len: usize) -> bool {
        let r = &self.rows[row];
        len <= r.len && len.saturating_sub(self.shape.window - 1) >= r.oldest
    }

    /// Whether every row can be cut back to any earlier position (none has dropped any).
    pub fn can_trim(&self) -> bool {
        self.rows.iter().all(|r| r.oldest == 0)
    }

    pub fn trim(&mut self, row: usize, len: usize) -> Result<()> {
        if !self.can_trim_to(row, len) {
            return Err(StateError::Untrimmable { kind: "sliding-window KV", from: self.rows[row].len, to: len });
        }
        self.rows[row].len = len;
        self.prefixes[row].as_mut().map_or(Ok(()), |p| p.trim(len))
    }

    pub fn merge(&mut self, other: &WindowKvStore) -> Result<()> {
        if other.shape.window != self.shape.window || !self.coding.same_as(&other.coding) {
            return Err(StateError::KindMismatch("sliding-window KV", "sliding-window KV of another window or format"));
        }
        self.rows.extend(other.rows.iter().cloned());
        self.prefixes.extend(other.prefixes.iter().cloned());
        Ok(())
    }

    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        let n = self.rows.len();
        if let Some(&bad) = keep.iter().find(|&&r| r >= n) {
            return Err(StateError::RowOutOfRange { row: bad, rows: n });
        }
        self.rows = keep.iter().map(|&r| self.rows[r].clone()).collect();
        self.prefixes = keep.iter().map(|&r| self.prefixes[r].clone()).collect();
        Ok(())
    }

    /// One single-row store per row, each keeping its row's buffers.
    pub fn split(self) -> Vec<WindowKvStore> {
        let one = |(row, prefix)| WindowKvStore { rows: vec![row], prefixes: vec![prefix], ..self.clone_empty() };
        self.rows.iter().cloned().zip(self.prefixes.iter().cloned()).map(one).collect()
    }

    /// An owned single-row copy of `row`, in a buffer sized for its held positions (not the
    /// batch row's whole buffer).
    pub fn extract(&self, row: usize) -> Result<WindowKvStore> {
        let n = self.rows.len();
        let src = self.rows.get(row).ok_or(StateError::RowOutOfRange { row, rows: n })?;
        let (k, v) = self.held(row)?;
        self.single_row(k, v, src.len, self.prefix(row))
    }

    /// The held positions of `row` in order, as stored (`[Hkv, n, width]` each): what
    /// persistence stores.
    pub fn held(&self, row: usize) -> Result<(Tensor, Tensor)> {
        let (k, v) = self.held_views(row)?;
        Ok((k.force_contiguous()?, v.force_contiguous()?))
    }

    /// A single-row store at `position` holding `k`, `v` (`[Hkv, n, width]` as stored, the last
    /// `n` positions before `position`) and a delayed format's `prefix`, shaped like this store;
    /// the error names what does not fit.
    pub fn single_row(&self, k: Tensor, v: Tensor, position: usize, prefix: Option<(Tensor, Tensor)>) -> Result<WindowKvStore> {
        for (name, t, part) in [("k", &k, KvPart::Keys), ("v", &v, KvPart::Values)] {
            let (h, _, width) = t.dims3()?;
            let (want, dtype) = (self.coding.width(&self.shape.kv, part), self.coding.stored_dtype());
            if (h, width) != (self.shape.kv.kv_heads, want) || t.dtype() != dtype {
                return Err(StateError::BadPart(format!(
                    "sliding-window {name} is {:?} {:?}, expected [{}, n, {want}] {dtype:?} ({} KV)",
                    t.dtype(),
                    t.dims(),
                    self.shape.kv.kv_heads,
                    self.coding.format(),
                )));
            }
        }
        let held = k.dim(1)?;
        if k.dim(1)? != v.dim(1)? {
            return Err(StateError::BadPart(format!("sliding-window k {:?} and v {:?} differ", k.dims(), v.dims())));
        }
        let needed = position.min(self.shape.window - 1);
        if held > position || held > self.capacity() || held < needed {
            return Err(StateError::BadPart(format!(
                "sliding-window state holds {held} positions at position {position}; expected {needed}..={}",
                position.min(self.capacity())
            )));
        }
        let oldest = position - held;
        let mut row = self.empty_row(held.max(16).min(self.capacity()), oldest)?;
        row.k.slice_set(&k.to_device(&self.device)?, 1, 0)?;
        row.v.slice_set(&v.to_device(&self.device)?, 1, 0)?;
        row.len = position;
        let prefix =
            prefix.map(|(k, v)| Ok::<_, StateError>(Prefix { k: k.to_device(&self.device)?, v: v.to_device(&self.device)? }));
        let prefix = prefix.transpose()?;
        self.coding.check_prefix(&prefix, &self.shape.kv, position)?;
        Ok(WindowKvStore { rows: vec![row], prefixes: vec![prefix], ..self.clone_empty() })
    }

    fn clone_empty(&self) -> WindowKvStore {
        WindowKvStore {
            rows: Vec::new(),
            prefixes: Vec::new(),
            shape: self.shape,
            coding: self.coding.clone(),
            device: self.device.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;

    /// `[1, t, 1]` holding the positions `start..start + t` as values.
    fn positions(start: usize, t: usize) -> Tensor {
        let data: Vec<f32> = (start..start + t).map(|p| p as f32).collect();
        Tensor::from_vec(data, (1, t, 1), &Device::Cpu).unwrap()
    }

    fn shape(window: usize) -> WindowShape {
        WindowShape { kv: crate::KvShape { kv_heads: 1, head_dim: 1 }, window }
    }

    fn values(t: &Tensor) -> Vec<usize> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(|x| x as usize).collect()
    }

    /// Against the definition: after any sequence of chunk sizes (runs of single positions
    /// move the held ones to the front of the buffer many times), `append` hands out exactly
    /// the positions `max(0, first query - W + 1) .. end`, and the store holds at least the last
    /// `W - 1 + ROUND_SLACK` of them, at most `capacity`.
    #[test]
    fn appends_hand_out_each_window_in_order() {
        let window = 5;
        let mut kv = WindowKvStore::empty(
            &shape(window),
            2,
            &crate::StoreContext { layer: 0, dtype: DType::F32, kv: crate::KvFormat::Auto, kv_start: 0 },
            &Device::Cpu,
        )
        .unwrap();
        let (capacity, kept) = (kv.capacity(), window - 1 + ROUND_SLACK);
        let mut chunks = vec![1, 3, 2, 7, 1, 1, 40, 1, 70, 2, 1, 130, 1];
        chunks.extend([1; 300]);
        chunks.extend([64, 1, 65, 3, 200]);
        chunks.extend([1; 100]);
        let mut len = 0;
        for t in chunks {
            let (k, v) = kv.append(1, &positions(len, t), &positions(len, t)).unwrap();
            let first = len.saturating_sub(window - 1);
            assert_eq!(values(&k), (first..len + t).collect::<Vec<_>>(), "chunk of {t} at {len}");
            assert_eq!(values(&k), values(&v));
            len += t;
            let held = values(&kv.held(1).unwrap().0);
            assert!(held.len() <= capacity && held.len() >= len.min(kept), "{} held at {len}", held.len());
            assert_eq!(held, (len - held.len()..len).collect::<Vec<_>>());
        }
        assert_eq!((kv.len(0), kv.len(1)), (0, len));
    }

    #[test]
    fn trims_only_while_the_window_is_held() {
        let window = 4;
        let mut kv = WindowKvStore::empty(
            &shape(window),
            1,
            &crate::StoreContext { layer: 0, dtype: DType::F32, kv: crate::KvFormat::Auto, kv_start: 0 },
            &Device::Cpu,
        )
        .unwrap();
        let capacity = kv.capacity();
        kv.append(0, &positions(0, 10), &positions(0, 10)).unwrap();
        assert!(kv.can_trim());
        kv.trim(0, 2).unwrap();
        kv.append(0, &positions(2, 3), &positions(2, 3)).unwrap();
        let (held, _) = kv.held(0).unwrap();
        assert_eq!(values(&held), (0..5).collect::<Vec<_>>());

        // Drop positions: now only trims that keep the window whole are possible.
        kv.append(0, &positions(5, capacity), &positions(5, capacity)).unwrap();
        let len = 5 + capacity;
        assert!(!kv.can_trim());
        let oldest = len - (window - 1 + ROUND_SLACK);
        assert!(kv.can_trim_to(0, oldest + window - 1));
        assert!(!kv.can_trim_to(0, oldest + window - 2));
        assert!(kv.trim(0, oldest + window - 2).is_err());
        // ROUND_SLACK positions fed one at a time (draft steps) can be taken back to one kept,
        // also when the held positions moved to the buffer's front on the way.
        for p in len..len + 37 {
            kv.append(0, &positions(p, 1), &positions(p, 1)).unwrap();
        }
        let before = len + 37;
        for p in before..before + ROUND_SLACK {
            kv.append(0, &positions(p, 1), &positions(p, 1)).unwrap();
        }
        kv.trim(0, before + 1).unwrap();
        let (k, _) = kv.append(0, &positions(before + 1, 1), &positions(before + 1, 1)).unwrap();
        assert_eq!(values(&k), (before + 2 - window..before + 2).collect::<Vec<_>>());
    }

    #[test]
    fn extract_copies_only_the_held_positions() {
        let mut kv = WindowKvStore::empty(
            &shape(4),
            1,
            &crate::StoreContext { layer: 0, dtype: DType::F32, kv: crate::KvFormat::Auto, kv_start: 0 },
            &Device::Cpu,
        )
        .unwrap();
        // A chunk past the capacity: the row's buffer is full-size, and holds the last 67.
        kv.append(0, &positions(0, 300), &positions(0, 300)).unwrap();
        let per_slot = 2 * 4;
        assert_eq!(kv.allocated_bytes(), kv.capacity() * per_slot);
        let one = kv.extract(0).unwrap();
        assert_eq!((one.allocated_bytes(), one.bytes()), (67 * per_slot, 67 * per_slot));
        assert_eq!(values(&one.held(0).unwrap().0), values(&kv.held(0).unwrap().0));
        assert_eq!((one.len(0), one.can_trim()), (300, false));
    }

    #[test]
    fn held_positions_round_trip_through_single_row() {
        let window = 6;
        let kv0 = WindowKvStore::empty(
            &shape(window),
            1,
            &crate::StoreContext { layer: 0, dtype: DType::F32, kv: crate::KvFormat::Auto, kv_start: 0 },
            &Device::Cpu,
        )
        .unwrap();
        for total in [0, 3, 5, 50, 69, 70, 71, 200] {
            let mut kv = kv0.clone();
            kv.append(0, &positions(0, total), &positions(0, total)).unwrap();
            let (k, v) = kv.held(0).unwrap();
            let mut back = kv0.single_row(k, v, total, None).unwrap();
            assert_eq!(back.can_trim(), kv.can_trim());
            // Both continue identically.
            let a = kv.append(0, &positions(total, 2), &positions(total, 2)).unwrap().0;
            let b = back.append(0, &positions(total, 2), &positions(total, 2)).unwrap().0;
            assert_eq!(values(&a), values(&b), "after {total}");
        }
        let k = positions(0, 2);
        assert!(kv0.single_row(k.clone(), k.clone(), 40, None).is_err(), "too few positions for the window");
        assert!(kv0.single_row(k.clone(), k, 1, None).is_err(), "more positions than consumed");
    }
}
