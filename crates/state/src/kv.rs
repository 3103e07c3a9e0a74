//! Attention KV store: per row, keys and values of every past position.
//!
//! Rows have their own lengths. They live either in a pool of fixed-size blocks shared by the
//! batch's rows ([`crate::KvPool`], see `paged.rs`), or each in its own buffers `[Hkv,
//! capacity, D]`, written in place and grown by doubling, so appending a token costs O(1)
//! amortised instead of a copy of the whole history. Stores built from a [`crate::StateSpec`]
//! alone (one-off runs, snapshots, restored entries) own their buffers; a served batch is
//! paged. The two answer the same questions with the same bits.

use candle_core::{Device, Tensor};
use strata_kernels::attention::{self, PagedKv, Scoring};

use crate::format::{KvCoding, Prefix};
use crate::paged::{PagedLayout, PagedRows};
use crate::spec::{KvShape, StateCost, Storage, StoreContext};
use crate::{buffer_bytes, KvFormat, KvPart, Result, StateError};

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

/// Positions are stored as the layer's [`KvCoding`] writes them: `[.., width]` with `width`
/// the head dimension, or a code's bytes for a quantized format (see `format.rs`); everything
/// but writing and reading moves stored tensors as they are.
#[derive(Clone, Debug)]
pub struct KvStore {
    rows: Rows,
    /// Per row, a delayed format's unquantized first positions (see `format.rs`).
    prefixes: Vec<Option<Prefix>>,
    shape: KvShape,
    coding: KvCoding,
    device: Device,
}

impl Storage for KvStore {
    type Shape = KvShape;
    const NAME: &'static str = "attention KV";
    const PARTS: &'static [&'static str] = &["k", "v"];

    fn empty(shape: &KvShape, rows: usize, cx: &StoreContext, device: &Device) -> Result<Self> {
        let coding = KvCoding::new(cx.kv, shape, cx.layer, cx.dtype, cx.kv_start)?;
        let mut store =
            Self { rows: Rows::Owned(Vec::new()), prefixes: Vec::new(), shape: *shape, coding, device: device.clone() };
        store.rows = Rows::Owned((0..rows).map(|_| store.empty_row(0)).collect::<Result<_>>()?);
        store.prefixes = (0..rows).map(|_| store.coding.empty_prefix(shape, device)).collect::<Result<_>>()?;
        Ok(store)
    }

    /// Codes for every position; a delayed format's first positions unquantized as well.
    fn cost(shape: &KvShape, cx: &StoreContext) -> StateCost {
        let delayed = cx.kv.is_quantized() && cx.kv_start > 0;
        StateCost {
            bytes_per_token: cx.kv.bytes_per_token(shape, cx.dtype),
            prefix_bytes_per_token: if delayed { KvFormat::Auto.bytes_per_token(shape, cx.dtype) } else { 0 },
            prefix_positions: if delayed { cx.kv_start } else { 0 },
            ..StateCost::default()
        }
    }
}

impl KvStore {
    /// A store of `paged`'s rows.
    pub(crate) fn paged(shape: KvShape, coding: KvCoding, device: &Device, paged: PagedRows) -> Result<KvStore> {
        let prefixes = (0..paged.rows()).map(|_| coding.empty_prefix(&shape, device)).collect::<Result<_>>()?;
        Ok(KvStore { rows: Rows::Paged(paged), prefixes, shape, coding, device: device.clone() })
    }

    pub(crate) fn paged_rows(&self) -> Option<&PagedRows> {
        match &self.rows {
            Rows::Paged(paged) => Some(paged),
            Rows::Owned(_) => None,
        }
    }

    /// Where a kernel writing and reading the rows in place finds them: the pool's tensors and
    /// the rows' block tables; `None` for rows in buffers of their own. The tensors hold codes
    /// for a quantized format, described for the device kernels (see [`KvStore::in_place`]).
    pub fn paged_layout(&self) -> Result<Option<PagedLayout>> {
        let Some(paged) = self.paged_rows() else { return Ok(None) };
        let mut layout = paged.layout();
        layout.codes = self.coding.device_codes(&self.device)?;
        Ok(Some(layout))
    }

    /// Whether positions are stored as computed, not quantized.
    pub fn is_plain(&self) -> bool {
        self.coding.is_plain()
    }

    /// Whether device kernels may write the next positions of every row and read its history
    /// in place (a captured decode step): rows in a pool, as computed, or as codes the kernels
    /// read in place once every row is past a delayed format's unquantized first positions
    /// (which the kernels neither write nor read).
    pub fn in_place(&self) -> Result<bool> {
        if !self.is_paged() || self.is_plain() {
            return Ok(self.is_paged());
        }
        let codes = self.coding.device_codes(&self.device)?;
        Ok(codes.is_some_and(|c| c.read_in_place()) && self.lens().into_iter().all(|len| len >= self.coding.start()))
    }

    fn empty_row(&self, capacity: usize) -> Result<KvRow> {
        let zeros = |part| {
            let width = self.coding.width(&self.shape, part);
            Tensor::zeros((self.shape.kv_heads, capacity, width), self.coding.stored_dtype(), &self.device)
        };
        Ok(KvRow { k: zeros(KvPart::Keys)?, v: zeros(KvPart::Values)?, len: 0 })
    }

    /// `k`, `v` (`[.., Hkv, T, D]`) as this layer stores them.
    fn encode(&self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((self.coding.encode(k, KvPart::Keys)?, self.coding.encode(v, KvPart::Values)?))
    }

    /// Stored keys and values as attention reads them.
    fn decode(&self, (k, v): (Tensor, Tensor)) -> Result<(Tensor, Tensor)> {
        Ok((self.coding.decode(&k, KvPart::Keys)?, self.coding.decode(&v, KvPart::Values)?))
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
        self.lens().iter().sum::<usize>() * self.coding.bytes_per_token(&self.shape) + self.prefix_bytes()
    }

    /// Bytes of delayed rows' unquantized first positions.
    fn prefix_bytes(&self) -> usize {
        let held: usize = self.prefixes.iter().flatten().map(Prefix::len).sum();
        held * KvFormat::Auto.bytes_per_token(&self.shape, self.coding.dtype())
    }

    /// Bytes of the buffers held: spare capacity of grown rows included, or the whole blocks
    /// a paged row holds (a block shared by rows counts for each).
    pub fn allocated_bytes(&self) -> usize {
        match &self.rows {
            Rows::Owned(rows) => {
                rows.iter().map(|r| buffer_bytes(&r.k) + buffer_bytes(&r.v)).sum::<usize>() + self.prefix_bytes()
            }
            Rows::Paged(paged) => paged.held_positions() * self.coding.bytes_per_token(&self.shape) + self.prefix_bytes(),
        }
    }

    /// Appends `k`, `v` (`[Hkv, T, D]`) to `row` and returns its whole history ([`KvStore::history`]:
    /// decoded codes, also before a delayed format's start).
    pub fn append(&mut self, row: usize, k_new: &Tensor, v_new: &Tensor) -> Result<(Tensor, Tensor)> {
        let len = self.len(row);
        let (k, v) = self.encode(k_new, v_new)?;
        match &mut self.rows {
            Rows::Owned(_) => {
                let t = k.dim(1)?;
                self.reserve(row, t)?;
                let r = &mut self.owned_mut()[row];
                r.k.slice_set(&k.contiguous()?, 1, r.len)?;
                r.v.slice_set(&v.contiguous()?, 1, r.len)?;
                r.len += t;
            }
            Rows::Paged(paged) => paged.append(row, &k, &v)?,
        }
        // After the write, which may fail (a full pool), so that the prefix never runs ahead.
        self.coding.extend_prefix(&mut self.prefixes[row], len, k_new, v_new)?;
        self.history(row)
    }

    /// Appends `k[r]`, `v[r]` (`k`, `v` `[rows, Hkv, T, D]`) to every row `r` and returns each
    /// row's whole history ([`KvStore::history`]); one write for all rows where the device
    /// allows.
    pub fn append_rows(&mut self, k: &Tensor, v: &Tensor) -> Result<Vec<(Tensor, Tensor)>> {
        self.append_stored(k, v)?;
        (0..self.rows()).map(|row| self.history(row)).collect()
    }

    /// [`KvStore::append_rows`] without reading the histories back.
    fn append_stored(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let lens = self.lens();
        if let Rows::Paged(paged) = &mut self.rows {
            Self::append_paged(paged, &self.coding, k, v)?;
        } else {
            let t = k.dim(2)?;
            self.reserve_rows(t)?;
            let (k, v) = self.encode(k, v)?;
            let rows = self.owned_mut();
            attention::write_rows(&k, &rows.iter().map(|r| (&r.k, r.len)).collect::<Vec<_>>())?;
            attention::write_rows(&v, &rows.iter().map(|r| (&r.v, r.len)).collect::<Vec<_>>())?;
            rows.iter_mut().for_each(|r| r.len += t);
        }
        for (row, len) in lens.into_iter().enumerate() {
            self.coding.extend_prefix(&mut self.prefixes[row], len, &k.get(row)?, &v.get(row)?)?;
        }
        Ok(())
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
        if self.in_place()? {
            let t = k.dim(2)?;
            self.reserve_rows(t)?;
            let layout = self.paged_layout()?.expect("in place rows are paged");
            let lens: Vec<usize> = layout.lens.iter().map(|len| len + t).collect();
            if let Some(out) = attention::paged_append_attend(q, k, v, &kernel_view(&layout, &lens), scoring, gate)? {
                self.commit_written(t)?;
                return Ok(out);
            }
        }
        if !self.coding.is_plain() {
            let lens = self.lens();
            self.append_stored(k, v)?;
            return self.attend_coded(q, &lens, scoring, gate);
        }
        if let Rows::Paged(paged) = &mut self.rows {
            if paged.rows() > 1 {
                Self::append_paged(paged, &self.coding, k, v)?;
                // Rows equally long (prompts prefilled together) attend as one batch.
                if let Some((keys, values)) = paged.stacked_history()? {
                    return Ok(match gate {
                        Some(gate) => attention::gated_attention_batch(q, &keys, &values, scoring, gate)?,
                        None => attention::causal_attention_batch(q, &keys, &values, scoring)?,
                    });
                }
                let history = (0..self.rows()).map(|row| self.history(row)).collect::<Result<Vec<_>>>()?;
                return Self::attend_rows(q, &history, scoring, gate);
            }
        }
        let history = self.append_rows(k, v)?;
        Self::attend_rows(q, &history, scoring, gate)
    }

    /// Attention over quantized rows whose lengths before this chunk were `lens`: over every
    /// row's codes, read as the coding reads them; for a delayed format, row by row, each row's
    /// queries before the start over its unquantized first positions instead.
    fn attend_coded(&self, q: &Tensor, lens: &[usize], scoring: Scoring, gate: Option<&Tensor>) -> Result<Tensor> {
        let stored = (0..self.rows()).map(|row| self.stored(row)).collect::<Result<Vec<_>>>()?;
        if !self.is_delayed() {
            return self.attend_codes(q, &stored, scoring, gate);
        }
        // Query positions run along dim 2 of `q` and of the ungated output, dim 1 of a gated one.
        let (t, out_dim) = (q.dim(2)?, if gate.is_some() { 1 } else { 2 });
        let mut rows = Vec::with_capacity(stored.len());
        for (row, (stored, &len)) in stored.into_iter().zip(lens).enumerate() {
            let mut pieces = Vec::new();
            for s in self.coding.segments(len, t) {
                let q = q.narrow(0, row, 1)?.narrow(2, s.offset, s.count)?;
                let gate = gate.map(|g| g.narrow(0, row, 1)?.narrow(1, s.offset, s.count)).transpose()?;
                pieces.push(match (s.plain, &self.prefixes[row]) {
                    (true, Some(prefix)) => {
                        Self::attend_rows(&q, &[prefix.range(0, len + s.offset + s.count)?], scoring, gate.as_ref())?
                    }
                    _ => self.attend_codes(&q, std::slice::from_ref(&stored), scoring, gate.as_ref())?,
                });
            }
            rows.push(Tensor::cat(&pieces, out_dim)?);
        }
        Ok(Tensor::cat(&rows, 0)?)
    }

    /// Attention of `q` over rows' `stored` codes as [`KvCoding::read`] reads them.
    fn attend_codes(&self, q: &Tensor, stored: &[(Tensor, Tensor)], scoring: Scoring, gate: Option<&Tensor>) -> Result<Tensor> {
        let out = self.coding.attend(q, stored, scoring)?;
        Ok(match gate {
            Some(gate) => attention::sigmoid_gate(&out, gate)?,
            None => out,
        })
    }

    fn attend_rows(q: &Tensor, history: &[(Tensor, Tensor)], scoring: Scoring, gate: Option<&Tensor>) -> Result<Tensor> {
        Ok(match gate {
            Some(gate) => attention::gated_attention_rows(q, history, scoring, gate)?,
            None => attention::causal_attention_rows(q, history, scoring)?,
        })
    }

    /// Writes `k`, `v` (`[B, Hkv, T, D]`) after every paged row's positions.
    fn append_paged(paged: &mut PagedRows, coding: &KvCoding, k: &Tensor, v: &Tensor) -> Result<()> {
        let t = k.dim(2)?;
        paged.reserve_rows(t)?;
        let mut layout = paged.layout();
        layout.codes = coding.device_codes(k.device())?;
        if coding.is_plain() || layout.codes.as_ref().is_some_and(|c| c.read_in_place()) {
            let lens: Vec<usize> = layout.lens.iter().map(|len| len + t).collect();
            if attention::write_paged(k, v, &kernel_view(&layout, &lens))? {
                return paged.commit_written(t);
            }
        }
        let (k, v) = (coding.encode(k, KvPart::Keys)?, coding.encode(v, KvPart::Values)?);
        for row in 0..paged.rows() {
            paged.append(row, &k.get(row)?, &v.get(row)?)?;
        }
        Ok(())
    }

    /// Each row's whole key and value buffers `[Hkv, capacity, D]`, for kernels that write a
    /// step's positions in place themselves (a captured decode step); they stay these buffers
    /// while appends fit the capacity. [`KvStore::commit_written`] then counts what was written.
    /// Only for unquantized KV.
    pub fn buffers(&self) -> Result<Vec<(Tensor, Tensor)>> {
        self.plain_only("row buffers")?;
        Ok(self.not_paged("row buffers")?.iter().map(|r| (r.k.clone(), r.v.clone())).collect())
    }

    /// An error for a quantized store: device kernels write positions as computed.
    fn plain_only(&self, what: &str) -> Result<()> {
        match self.is_plain() {
            true => Ok(()),
            false => Err(StateError::Format(format!("{what}: written in place only for unquantized KV, not {}", self.format()))),
        }
    }

    /// Counts `t` more positions in every row, written into [`KvStore::buffers`] (or the blocks
    /// of [`KvStore::paged_layout`]) by a device kernel rather than through
    /// [`KvStore::append_rows`].
    pub fn commit_written(&mut self, t: usize) -> Result<()> {
        if self.is_paged() {
            // Codes too; but a delayed format's first positions are written only through
            // `append_rows`, which keeps their unquantized copy.
            if self.lens().into_iter().any(|len| len < self.coding.start()) {
                return Err(StateError::Format(format!(
                    "counting written positions: rows still in the unquantized first {} positions of {}",
                    self.coding.start(),
                    self.format()
                )));
            }
        }
        if let Rows::Paged(paged) = &mut self.rows {
            return paged.commit_written(t);
        }
        self.plain_only("counting written positions")?;
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

    /// `row`'s keys and values as attention reads them, `[Hkv, len, D]`: views of an owned
    /// row's buffers, or copies gathered from a paged row's blocks (decoded, for a quantized
    /// format).
    pub fn history(&self, row: usize) -> Result<(Tensor, Tensor)> {
        self.decode(self.stored(row)?)
    }

    /// `row`'s positions as stored (`[Hkv, len, width]`, see [`KvStore`]): what persistence
    /// writes and [`KvStore::single_row`] reads back.
    pub fn stored(&self, row: usize) -> Result<(Tensor, Tensor)> {
        match &self.rows {
            Rows::Owned(rows) => {
                let r = &rows[row];
                Ok((r.k.narrow(1, 0, r.len)?, r.v.narrow(1, 0, r.len)?))
            }
            Rows::Paged(paged) => paged.history(row),
        }
    }

    /// The format positions are stored in.
    pub fn format(&self) -> KvFormat {
        self.coding.format()
    }

    /// Whether the format is delayed (rows keep their first positions unquantized too).
    pub fn is_delayed(&self) -> bool {
        self.coding.start() > 0
    }

    /// A delayed row's unquantized first positions (`[Hkv, n, D]` each); `None` for other formats.
    pub fn prefix(&self, row: usize) -> Option<(Tensor, Tensor)> {
        self.prefixes[row].as_ref().map(|p| (p.k.clone(), p.v.clone()))
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
            }
            Rows::Paged(paged) => paged.trim(row, len)?,
        }
        self.prefixes[row].as_mut().map_or(Ok(()), |p| p.trim(len))
    }

    /// Appends `other`'s rows after this store's: a paged row of the same pool joins by its
    /// block table (no copy); any other row is copied in.
    pub fn merge(&mut self, other: &KvStore) -> Result<()> {
        if !self.coding.same_as(&other.coding) {
            return Err(StateError::KindMismatch("attention KV of another format", "attention KV"));
        }
        match (&mut self.rows, &other.rows) {
            (Rows::Owned(a), Rows::Owned(b)) => a.extend(b.iter().cloned()),
            (Rows::Paged(a), Rows::Paged(b)) if a.same_pool(b) => a.merge(b),
            _ => {
                for row in 0..other.rows() {
                    let (k, v) = other.stored(row)?;
                    let at = self.rows();
                    // A row and its prefix join together, whatever fails after.
                    self.prefixes.push(other.prefixes[row].clone());
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
                return Ok(());
            }
        }
        self.prefixes.extend(other.prefixes.iter().cloned());
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
        self.prefixes = keep.iter().map(|&r| self.prefixes[r].clone()).collect();
        Ok(())
    }

    /// One single-row store per row, each keeping its row's buffers or blocks.
    pub fn split(self) -> Vec<KvStore> {
        let rows: Vec<Rows> = match &self.rows {
            Rows::Owned(rows) => rows.iter().map(|r| Rows::Owned(vec![r.clone()])).collect(),
            Rows::Paged(paged) => paged.split().into_iter().map(Rows::Paged).collect(),
        };
        let one = |(rows, prefix)| KvStore { rows, prefixes: vec![prefix], ..self.clone_empty() };
        rows.into_iter().zip(self.prefixes.iter().cloned()).map(one).collect()
    }

    /// An owned single-row copy of `row`, in buffers of its own (a paged row's blocks are
    /// copied out: snapshots and cache entries never hold pool blocks).
    pub fn extract(&self, row: usize) -> Result<KvStore> {
        let n = self.rows();
        if row >= n {
            return Err(StateError::RowOutOfRange { row, rows: n });
        }
        let (k, v) = self.stored(row)?;
        Ok(KvStore {
            rows: Rows::Owned(vec![KvRow { k: k.force_contiguous()?, v: v.force_contiguous()?, len: k.dim(1)? }]),
            prefixes: vec![self.prefixes[row].clone()],
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
            Rows::Paged(paged) => Ok(KvStore {
                rows: Rows::Paged(paged.row(row)),
                prefixes: vec![self.prefixes[row].clone()],
                ..self.clone_empty()
            }),
            Rows::Owned(_) => self.extract(row),
        }
    }

    /// A single-row store holding `k`, `v` (`[Hkv, len, width]`, as [`KvStore::stored`] gives
    /// them) in its own buffers, and a delayed format's `prefix` ([`KvStore::prefix`]), shaped
    /// like this store's rows; the error names what does not match.
    pub fn single_row(&self, k: Tensor, v: Tensor, prefix: Option<(Tensor, Tensor)>) -> Result<KvStore> {
        for (name, t, part) in [("k", &k, KvPart::Keys), ("v", &v, KvPart::Values)] {
            let (h, _, width) = t.dims3()?;
            let (want, dtype) = (self.coding.width(&self.shape, part), self.coding.stored_dtype());
            if (h, width) != (self.shape.kv_heads, want) || t.dtype() != dtype {
                return Err(StateError::BadPart(format!(
                    "attention {name} is {:?} {:?}, expected [{}, len, {want}] {dtype:?} ({} KV)",
                    t.dtype(),
                    t.dims(),
                    self.shape.kv_heads,
                    self.coding.format(),
                )));
            }
        }
        if k.dim(1)? != v.dim(1)? {
            return Err(StateError::BadPart(format!("attention k {:?} and v {:?} differ in length", k.dims(), v.dims())));
        }
        let len = k.dim(1)?;
        let prefix =
            prefix.map(|(k, v)| Ok::<_, StateError>(Prefix { k: k.to_device(&self.device)?, v: v.to_device(&self.device)? }));
        let prefix = prefix.transpose()?;
        self.coding.check_prefix(&prefix, &self.shape, len)?;
        let row = KvRow { k: k.to_device(&self.device)?, v: v.to_device(&self.device)?, len };
        Ok(KvStore { rows: Rows::Owned(vec![row]), prefixes: vec![prefix], ..self.clone_empty() })
    }

    fn clone_empty(&self) -> KvStore {
        KvStore {
            rows: Rows::Owned(Vec::new()),
            prefixes: Vec::new(),
            shape: self.shape,
            coding: self.coding.clone(),
            device: self.device.clone(),
        }
    }
}

/// `layout`'s pool as the paged kernels read it, each row `lens[r]` positions long.
fn kernel_view<'a>(layout: &'a PagedLayout, lens: &'a [usize]) -> PagedKv<'a> {
    PagedKv {
        keys: &layout.keys,
        values: &layout.values,
        block_size: layout.block_size,
        tables: &layout.tables,
        lens,
        codes: layout.codes.as_ref(),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::DType;

    use super::*;

    fn seq(h: usize, t: usize, d: usize, base: f32) -> Tensor {
        let data: Vec<f32> = (0..h * t * d).map(|i| base + i as f32).collect();
        Tensor::from_vec(data, (h, t, d), &Device::Cpu).unwrap()
    }

    #[test]
    fn append_grow_trim_extract() {
        let cx = StoreContext { layer: 0, dtype: DType::F32, kv: crate::KvFormat::Auto, kv_start: 0 };
        let mut kv = KvStore::empty(&KvShape { kv_heads: 2, head_dim: 3 }, 2, &cx, &Device::Cpu).unwrap();
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
