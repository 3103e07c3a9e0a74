//! How attention keys and values are stored: as computed, or quantized into codes
//! ([`strata_kernels::kv_quant`]) — `--kv-cache-dtype`.
//!
//! A quantized layer stores each head vector as a fixed number of bytes, so its tensors are
//! `u8` with the codes' byte width as the last dimension in place of the head dimension. Every
//! store keeps its positions in that form and moves them (blocks, copy on write, trim, merge,
//! persistence) as it moves any tensor, so all of that is the same code for every format; only
//! writing (encode) and reading (decode) differ. Every position is encoded on its own, from its
//! own keys and values alone, so a row's codes do not depend on how its tokens were batched,
//! chunked or rolled back, and a query always reads decoded codes, its own position's included:
//! a prefill chunk, a decode step and a verify round see the same keys and values.
//!
//! A *delayed* format (`--quantized-kv-start N`) also keeps a row's first `N` positions as
//! computed: a query before position `N` reads them, a query at or after `N` reads codes only,
//! every position's. Since both forms of the first positions are kept, what a query reads
//! depends only on its position, never on where a chunk or a speculative round ended, and a row
//! cut back below `N` still has what its queries there read.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::{DType, Tensor};
use rayon::prelude::*;
use strata_kernels::attention::{self, Scoring};
use strata_kernels::kv_quant::{self, Affine, KvCodec, LayerCodes, PartCodes, Turbo, TurboVariant};

use crate::spec::KvShape;
use crate::{Result, StateError};

/// What `--kv-cache-dtype` names. Serialized as its name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(into = "String")]
pub enum KvFormat {
    /// Keys and values as the model computes them, in its dtype.
    #[default]
    Auto,
    /// `key_bits` per key coordinate and `value_bits` per value coordinate, in groups of `group`
    /// along the head dimension, with a bf16 scale and bias per group.
    Affine { key_bits: u32, value_bits: u32, group: usize },
    /// TurboQuant: keys and values each at their own bits; keys optionally in the
    /// inner-product variant (unbiased scores).
    Turbo { key_bits: u32, key_inner_product: bool, value_bits: u32 },
}

/// Which format each attention layer stores its KV in: one format, except for the layers named
/// to stay unquantized (`--kv-unquantized-layers`, counted among the layers that hold KV, full or
/// sliding-window; negative from the last).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvPolicy {
    pub format: KvFormat,
    pub unquantized: Vec<isize>,
    /// Queries before this position read unquantized keys and values (a delayed format; 0:
    /// every query reads codes).
    pub start: usize,
}

impl From<KvFormat> for KvPolicy {
    fn from(format: KvFormat) -> KvPolicy {
        KvPolicy { format, ..KvPolicy::default() }
    }
}

impl KvPolicy {
    /// The format of the `index`th of `layers` KV-holding layers; an error for a named layer
    /// past them.
    pub fn format_at(&self, index: usize, layers: usize) -> Result<KvFormat> {
        let mut plain = false;
        for &named in &self.unquantized {
            let at = if named < 0 { layers.checked_sub(named.unsigned_abs()) } else { Some(named as usize) };
            match at {
                Some(at) if at < layers => plain |= at == index,
                _ => {
                    return Err(StateError::Format(format!(
                    "--kv-unquantized-layers {named}: the model has {layers} layers holding KV (0..{layers}, or -{layers}..-1)"
                )))
                }
            }
        }
        Ok(if plain { KvFormat::Auto } else { self.format })
    }
}

impl fmt::Display for KvPolicy {
    /// The format, its start if delayed and the unquantized layers if any
    /// (`affine4-g64/start:256/plain:0,-1`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.format)?;
        if self.format.is_quantized() {
            if self.start > 0 {
                write!(f, "/start:{}", self.start)?;
            }
            if !self.unquantized.is_empty() {
                let layers: Vec<String> = self.unquantized.iter().map(isize::to_string).collect();
                write!(f, "/plain:{}", layers.join(","))?;
            }
        }
        Ok(())
    }
}

/// Keys or values: the two halves of a KV layer, which may be coded differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvPart {
    Keys,
    Values,
}

impl KvPart {
    /// `keys` for the keys, `values` for the values.
    fn pick<T>(self, keys: T, values: T) -> T {
        match self {
            KvPart::Keys => keys,
            KvPart::Values => values,
        }
    }
}

impl KvFormat {
    /// The group size affine formats take when none is named.
    pub const DEFAULT_GROUP: usize = 64;

    /// This format with affine groups of `group` coordinates (other formats have no groups).
    pub fn with_group(self, group: usize) -> KvFormat {
        match self {
            KvFormat::Affine { key_bits, value_bits, .. } => KvFormat::Affine { key_bits, value_bits, group },
            other => other,
        }
    }

    /// The codecs' limits that do not depend on the model (its head dimension is checked on load).
    pub fn check_limits(&self) -> std::result::Result<(), &'static str> {
        match *self {
            KvFormat::Affine { key_bits, value_bits, group }
                if ![key_bits, value_bits].iter().all(|b| Affine::BITS.contains(b)) || !Affine::GROUPS.contains(&group) =>
            {
                Err("affine KV takes 2, 3, 4, 5, 6 or 8 bits in groups of 32, 64 or 128")
            }
            KvFormat::Turbo { key_bits, key_inner_product, value_bits }
                if !(1 + u32::from(key_inner_product)..=8).contains(&key_bits) || !(1..=8).contains(&value_bits) =>
            {
                Err("TurboQuant takes 1 to 8 bits (2 to 8 for inner-product keys)")
            }
            _ => Ok(()),
        }
    }

    pub fn is_quantized(&self) -> bool {
        *self != KvFormat::Auto
    }

    /// Bytes one position of a layer of `shape` costs (keys and values), stored in this format
    /// with `dtype` the compute dtype.
    pub fn bytes_per_token(&self, shape: &KvShape, dtype: DType) -> usize {
        let per_head = |part| self.vector_bytes(shape.head_dim, dtype, part);
        shape.kv_heads * (per_head(KvPart::Keys) + per_head(KvPart::Values))
    }

    /// Bytes of one stored head vector of `head_dim` coordinates.
    fn vector_bytes(&self, head_dim: usize, dtype: DType, part: KvPart) -> usize {
        match *self {
            KvFormat::Auto => head_dim * dtype.size_in_bytes(),
            KvFormat::Affine { key_bits, value_bits, group } => {
                head_dim * part.pick(key_bits, value_bits) as usize / 8 + 4 * (head_dim / group)
            }
            KvFormat::Turbo { key_bits, key_inner_product, value_bits } => match part {
                // The inner-product variant keeps the residual's norm next to the vector's.
                KvPart::Keys => head_dim * key_bits as usize / 8 + 2 + 2 * usize::from(key_inner_product),
                KvPart::Values => head_dim * value_bits as usize / 8 + 2,
            },
        }
    }

    /// The codec of `part`'s head `head` of layer `layer`, for head vectors of `head_dim`.
    fn codec(&self, head_dim: usize, layer: usize, head: usize, part: KvPart) -> Result<HeadCodec> {
        let bad = |e: strata_kernels::kv_quant::CodecError| StateError::Format(format!("--kv-cache-dtype {self}: {e}"));
        match *self {
            KvFormat::Auto => Err(StateError::Format("unquantized KV has no codec".into())),
            KvFormat::Affine { key_bits, value_bits, group } => {
                Ok(HeadCodec::Affine(Affine::new(head_dim, part.pick(key_bits, value_bits), group).map_err(bad)?))
            }
            KvFormat::Turbo { key_bits, key_inner_product, value_bits } => {
                let (bits, variant) = match part {
                    KvPart::Keys if key_inner_product => (key_bits, TurboVariant::InnerProduct),
                    KvPart::Keys => (key_bits, TurboVariant::Mse),
                    KvPart::Values => (value_bits, TurboVariant::Mse),
                };
                // One rotation per layer, head and half, fixed by where it is used.
                let seed = (layer as u64) << 32 | (head as u64) << 1 | u64::from(part == KvPart::Values);
                Ok(HeadCodec::Turbo(Arc::new(Turbo::new(head_dim, bits, variant, seed).map_err(bad)?)))
            }
        }
    }

    /// Checks that layers of `shape` can be stored in this format.
    pub fn check(&self, shape: &KvShape) -> Result<()> {
        if self.is_quantized() {
            for part in [KvPart::Keys, KvPart::Values] {
                self.codec(shape.head_dim, 0, 0, part)?;
            }
        }
        Ok(())
    }
}

impl fmt::Display for KvFormat {
    /// The canonical name, which parses back to the same format (and names it in cache
    /// identities: codes of one format are never read as another's).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            KvFormat::Auto => f.write_str("auto"),
            KvFormat::Affine { key_bits, value_bits, group } if key_bits == value_bits => write!(f, "affine{key_bits}-g{group}"),
            KvFormat::Affine { key_bits, value_bits, group } => write!(f, "affine-k{key_bits}v{value_bits}-g{group}"),
            KvFormat::Turbo { key_bits, key_inner_product: false, value_bits } if key_bits == value_bits => {
                write!(f, "turbo{key_bits}")
            }
            KvFormat::Turbo { key_bits, key_inner_product, value_bits } => {
                write!(f, "turbo-k{key_bits}{}v{value_bits}", if key_inner_product { "ip" } else { "" })
            }
        }
    }
}

impl From<KvFormat> for String {
    fn from(format: KvFormat) -> String {
        format.to_string()
    }
}

impl FromStr for KvFormat {
    type Err = String;

    /// `auto`, `affine<bits>[-g<group>]`, `affine-k<bits>v<bits>[-g<group>]`, `turbo<bits>` or
    /// `turbo-k<bits>[ip]v<bits>`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let expected = "expected auto, affine2..affine8 (e.g. affine4, affine4-g32), affine-k<bits>v<bits> \
                        (e.g. affine-k8v4, affine-k8v4-g32), turbo1..turbo8 or turbo-k<bits>[ip]v<bits> \
                        (e.g. turbo-k4v3, turbo-k4ipv4)";
        let bits = |b: &str| b.parse::<u32>().map_err(|_| format!("`{s}`: {expected}"));
        let format = if s == "auto" {
            KvFormat::Auto
        } else if let Some(rest) = s.strip_prefix("affine") {
            let (b, group) = match rest.split_once("-g") {
                Some((b, g)) => (b, g.parse::<usize>().map_err(|_| format!("`{s}`: {expected}"))?),
                None => (rest, KvFormat::DEFAULT_GROUP),
            };
            match b.strip_prefix("-k").and_then(|kv| kv.split_once('v')) {
                Some((k, v)) => KvFormat::Affine { key_bits: bits(k)?, value_bits: bits(v)?, group },
                None => KvFormat::Affine { key_bits: bits(b)?, value_bits: bits(b)?, group },
            }
        } else if let Some(rest) = s.strip_prefix("turbo-k") {
            let (k, v) = rest.split_once('v').ok_or_else(|| format!("`{s}`: {expected}"))?;
            let (k, ip) = k.strip_suffix("ip").map_or((k, false), |k| (k, true));
            KvFormat::Turbo { key_bits: bits(k)?, key_inner_product: ip, value_bits: bits(v)? }
        } else if let Some(b) = s.strip_prefix("turbo") {
            let b = bits(b)?;
            KvFormat::Turbo { key_bits: b, key_inner_product: false, value_bits: b }
        } else if ["bf16", "f16", "f32", "float16", "bfloat16", "float32"].contains(&s) {
            return Err(format!("`{s}`: unquantized KV is stored in the compute dtype; choose it with --dtype (and auto here)"));
        } else {
            return Err(format!("`{s}`: {expected}"));
        };
        format.check_limits().map(|()| format).map_err(|e| format!("`{s}`: {e}"))
    }
}

/// One head's codec.
#[derive(Debug)]
enum HeadCodec {
    Affine(Affine),
    Turbo(Arc<Turbo>),
}

impl HeadCodec {
    fn get(&self) -> &dyn KvCodec {
        match self {
            HeadCodec::Affine(c) => c,
            HeadCodec::Turbo(c) => c.as_ref(),
        }
    }
}

/// The codecs of one quantized layer: one per head for keys and for values.
#[derive(Debug)]
struct LayerCodecs {
    format: KvFormat,
    keys: Vec<HeadCodec>,
    values: Vec<HeadCodec>,
    /// Per half of TurboQuant MSE codes, what attention multiplies row vectors by, `[Hkv, D, D]`
    /// f32, contiguous (see [`KvCoding::read`]): queries by `Rᵀ` (each becomes `R·q`) to meet
    /// keys read short of their rotation, the output by `R` (`Rᵀ·y`) to undo the values'.
    key_turns: Option<Tensor>,
    value_turns: Option<Tensor>,
    /// The codes as device kernels write and read them, per GPU they were asked for on.
    on_devices: Mutex<Vec<(candle_core::DeviceLocation, LayerCodes)>>,
}

/// How one attention layer writes and reads its positions: the layer's format, its compute
/// dtype and (for a quantized format) its codecs, built once per process and shared.
#[derive(Clone, Debug)]
pub(crate) struct KvCoding {
    dtype: DType,
    codecs: Option<Arc<LayerCodecs>>,
    /// A delayed format's start (0 for others).
    start: usize,
}

/// A delayed format's unquantized copy of a row's first positions: `[Hkv, n, D]` each, `n` the
/// row's length or the start, whichever is less.
#[derive(Clone, Debug)]
pub(crate) struct Prefix {
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
}

impl Prefix {
    pub(crate) fn len(&self) -> usize {
        self.k.dim(1).unwrap_or(0)
    }

    /// Keeps the first `len` positions.
    pub(crate) fn trim(&mut self, len: usize) -> Result<()> {
        let len = len.min(self.len());
        (self.k, self.v) = (self.k.narrow(1, 0, len)?, self.v.narrow(1, 0, len)?);
        Ok(())
    }

    /// Positions `from .. to` (`[Hkv, to - from, D]`).
    pub(crate) fn range(&self, from: usize, to: usize) -> Result<(Tensor, Tensor)> {
        Ok((self.k.narrow(1, from, to - from)?, self.v.narrow(1, from, to - from)?))
    }
}

/// A piece of a chunk of queries: `count` of them from `offset`, reading unquantized keys
/// (`plain`) or codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    pub(crate) offset: usize,
    pub(crate) count: usize,
    pub(crate) plain: bool,
}

impl KvCoding {
    /// The coding of attention layer `layer` (its index in the model, which seeds TurboQuant's
    /// rotations) of `shape` in `format`, delayed to `start`.
    pub(crate) fn new(format: KvFormat, shape: &KvShape, layer: usize, dtype: DType, start: usize) -> Result<Self> {
        if !format.is_quantized() {
            return Ok(Self { dtype, codecs: None, start: 0 });
        }
        type Key = (KvFormat, usize, usize, usize);
        static BUILT: OnceLock<Mutex<HashMap<Key, Arc<LayerCodecs>>>> = OnceLock::new();
        let key = (format, shape.kv_heads, shape.head_dim, layer);
        let built = BUILT.get_or_init(Default::default);
        if let Some(codecs) = built.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(Self { dtype, codecs: Some(codecs.clone()), start });
        }
        let heads = |part| (0..shape.kv_heads).map(|h| format.codec(shape.head_dim, layer, h, part)).collect::<Result<Vec<_>>>();
        let (keys, values) = (heads(KvPart::Keys)?, heads(KvPart::Values)?);
        let key_turns = rotations(&keys, shape)?.map(|r| r.t()?.contiguous()).transpose()?;
        let value_turns = rotations(&values, shape)?;
        let codecs = Arc::new(LayerCodecs { format, keys, values, key_turns, value_turns, on_devices: Mutex::default() });
        // Another thread may have built the same codecs meanwhile: every coding of a layer
        // shares the first (merges compare codings by identity).
        let codecs = built.lock().unwrap_or_else(|e| e.into_inner()).entry(key).or_insert(codecs).clone();
        Ok(Self { dtype, codecs: Some(codecs), start })
    }

    /// The layer's codes as device kernels write and read them on `device` (built there once):
    /// `None` for unquantized KV and on the CPU, an error for a format with no device kernels.
    pub(crate) fn device_codes(&self, device: &candle_core::Device) -> Result<Option<LayerCodes>> {
        let Some(codecs) = &self.codecs else { return Ok(None) };
        if device.is_cpu() {
            return Ok(None);
        }
        let mut built = codecs.on_devices.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, codes)) = built.iter().find(|(at, _)| *at == device.location()) {
            return Ok(Some(codes.clone()));
        }
        let bad = |e: kv_quant::CodecError| StateError::Format(format!("--kv-cache-dtype {}: {e}", codecs.format));
        let part = |heads: &[HeadCodec]| -> Result<PartCodes> {
            match &heads[0] {
                HeadCodec::Affine(affine) => Ok(PartCodes::affine(affine)),
                HeadCodec::Turbo(_) => {
                    let turbo: Vec<&Turbo> = heads
                        .iter()
                        .map(|h| match h {
                            HeadCodec::Turbo(t) => t.as_ref(),
                            HeadCodec::Affine(_) => unreachable!("a layer's heads share a family"),
                        })
                        .collect();
                    PartCodes::turbo(&turbo, device).map_err(bad)
                }
            }
        };
        let codes = LayerCodes { keys: part(&codecs.keys)?, values: part(&codecs.values)? };
        built.push((device.location(), codes.clone()));
        Ok(Some(codes))
    }

    /// A delayed format's start; 0 when every query reads codes.
    pub(crate) fn start(&self) -> usize {
        self.start
    }

    /// A fresh row's prefix: empty for a delayed format, none otherwise.
    pub(crate) fn empty_prefix(&self, shape: &KvShape, device: &candle_core::Device) -> Result<Option<Prefix>> {
        if self.start == 0 {
            return Ok(None);
        }
        let empty = || Tensor::zeros((shape.kv_heads, 0, shape.head_dim), self.dtype, device);
        Ok(Some(Prefix { k: empty()?, v: empty()? }))
    }

    /// Adds to a row's prefix what of `k`, `v` (`[Hkv, T, D]`, positions `len .. len + T`) comes
    /// before the start.
    pub(crate) fn extend_prefix(&self, prefix: &mut Option<Prefix>, len: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let Some(prefix) = prefix else { return Ok(()) };
        let n = self.start.saturating_sub(len).min(k.dim(1)?);
        if n > 0 {
            let (k, v) = (k.narrow(1, 0, n)?.to_dtype(self.dtype)?, v.narrow(1, 0, n)?.to_dtype(self.dtype)?);
            prefix.k = Tensor::cat(&[&prefix.k, &k], 1)?;
            prefix.v = Tensor::cat(&[&prefix.v, &v], 1)?;
        }
        Ok(())
    }

    /// The queries at positions `len .. len + t` cut where they stop reading unquantized keys.
    pub(crate) fn segments(&self, len: usize, t: usize) -> Vec<Segment> {
        let plain = self.start.saturating_sub(len).min(t);
        [Segment { offset: 0, count: plain, plain: true }, Segment { offset: plain, count: t - plain, plain: false }]
            .into_iter()
            .filter(|s| s.count > 0)
            .collect()
    }

    /// Checks a persisted prefix against a row of `len` positions of layers of `shape`.
    pub(crate) fn check_prefix(&self, prefix: &Option<Prefix>, shape: &KvShape, len: usize) -> Result<()> {
        let expected = (self.start > 0).then(|| (shape.kv_heads, len.min(self.start), shape.head_dim));
        let got = prefix.as_ref().map(|p| p.k.dims3().and_then(|k| Ok((k, p.v.dims3()?, p.k.dtype(), p.v.dtype()))));
        match (expected, got) {
            (None, None) => Ok(()),
            (Some(want), Some(Ok((k, v, dk, dv)))) if k == want && v == want && dk == self.dtype && dv == self.dtype => Ok(()),
            (want, _) => Err(StateError::BadPart(format!(
                "the unquantized first positions of a delayed format do not fit: expected {want:?} {:?}",
                self.dtype
            ))),
        }
    }

    pub(crate) fn format(&self) -> KvFormat {
        self.codecs.as_ref().map_or(KvFormat::Auto, |c| c.format)
    }

    /// The compute dtype: what decoded keys and values (and a prefix) are.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether positions are stored as computed (the device kernels' layout).
    pub(crate) fn is_plain(&self) -> bool {
        self.codecs.is_none()
    }

    /// The dtype of stored tensors.
    pub(crate) fn stored_dtype(&self) -> DType {
        if self.is_plain() {
            self.dtype
        } else {
            DType::U8
        }
    }

    /// The last dimension of `part`'s stored tensors: the head dimension, or a code's bytes.
    pub(crate) fn width(&self, shape: &KvShape, part: KvPart) -> usize {
        match &self.codecs {
            None => shape.head_dim,
            Some(c) => c.of(part)[0].get().bytes(),
        }
    }

    pub(crate) fn bytes_per_token(&self, shape: &KvShape) -> usize {
        self.format().bytes_per_token(shape, self.dtype)
    }

    /// Whether two layers store positions alike (so stored tensors move between them as they are).
    pub(crate) fn same_as(&self, other: &KvCoding) -> bool {
        self.dtype == other.dtype
            && self.start == other.start
            && match (&self.codecs, &other.codecs) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }

    /// Stored `part` as attention reads it: [`KvCoding::decode`]d, except TurboQuant MSE codes,
    /// decoded short of their rotation (`ŷ·norm`); queries are then turned by
    /// [`KvCoding::rotate_queries`] and the output back by [`KvCoding::unrotate_output`], which
    /// reads every key and value in `O(D)` instead of `O(D²)`.
    pub(crate) fn read(&self, stored: &Tensor, part: KvPart) -> Result<Tensor> {
        if let Some(codes) = self.device_codes(stored.device())? {
            return Ok(part_of(&codes, part).read(stored, self.dtype)?);
        }
        if self.codecs.as_ref().and_then(|c| c.rotations(part)).is_none() {
            return self.decode(stored, part);
        }
        self.decode_with(stored, part, |codec, code, x| match codec {
            HeadCodec::Turbo(turbo) => turbo.decode_rotated(code, x),
            HeadCodec::Affine(_) => unreachable!("rotations exist only for TurboQuant heads"),
        })
    }

    /// Attention of `q` (`[B, Hq, T, D]`) over rows' `stored` keys and values as
    /// [`KvCoding::read`] reads them, ungated: `[B, Hq, T, D]`.
    pub(crate) fn attend(&self, q: &Tensor, stored: &[(Tensor, Tensor)], scoring: Scoring) -> Result<Tensor> {
        let read = |(k, v): &(Tensor, Tensor)| Ok((self.read(k, KvPart::Keys)?, self.read(v, KvPart::Values)?));
        let kv = stored.iter().map(read).collect::<Result<Vec<_>>>()?;
        let out = attention::causal_attention_rows(&self.rotate_queries(q)?, &kv, scoring)?;
        self.unrotate_output(&out)
    }

    /// `q` (`[B, Hq, T, D]`) as it meets keys [`KvCoding::read`] returns: each query head turned
    /// by its KV head's key rotation when keys are read rotated.
    fn rotate_queries(&self, q: &Tensor) -> Result<Tensor> {
        self.turn(q, KvPart::Keys)
    }

    /// Attention output (`[B, Hq, T, D]`) over values [`KvCoding::read`] returns, turned back
    /// when values are read rotated.
    fn unrotate_output(&self, out: &Tensor) -> Result<Tensor> {
        self.turn(out, KvPart::Values)
    }

    /// Each head's rows of `x` times its KV head's turn for `part` (see
    /// [`LayerCodecs::key_turns`]). In f32 whatever the compute dtype, so that reading rotated
    /// costs no precision.
    fn turn(&self, x: &Tensor, part: KvPart) -> Result<Tensor> {
        let Some(r) = self.codecs.as_ref().and_then(|c| c.rotations(part)) else {
            return Ok(x.clone());
        };
        let turned = match self.device_codes(x.device())? {
            // The device's copies: queries by the keys' rotation, output back by the values'.
            Some(codes) => match part {
                KvPart::Keys => codes.keys.rotate(x)?,
                KvPart::Values => codes.values.unrotate(x)?,
            },
            None => kv_quant::turn(x, r)?,
        };
        Ok(turned.to_dtype(x.dtype())?)
    }

    /// `x` (`[.., Hkv, T, D]`, heads third from last) as stored: in the compute dtype, or
    /// `[.., Hkv, T, bytes]` codes.
    pub(crate) fn encode(&self, x: &Tensor, part: KvPart) -> Result<Tensor> {
        let Some(codecs) = &self.codecs else {
            return Ok(x.to_dtype(self.dtype)?);
        };
        if let Some(codes) = self.device_codes(x.device())? {
            return Ok(part_of(&codes, part).encode(x)?);
        }
        let codecs = codecs.of(part);
        let dims = x.dims().to_vec();
        let (heads, t, d) = three_last(&dims)?;
        let width = codecs[0].get().bytes();
        let values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0u8; values.len() / d * width];
        for (i, (x, code)) in values.chunks_exact(d).zip(out.chunks_exact_mut(width)).enumerate() {
            codecs[i / t % heads].get().encode(x, code);
        }
        let mut shape = dims;
        *shape.last_mut().expect("three dims") = width;
        Ok(Tensor::from_vec(out, shape, x.device())?)
    }

    /// Stored `part` (`[.., Hkv, T, width]`) as keys or values in the compute dtype.
    pub(crate) fn decode(&self, stored: &Tensor, part: KvPart) -> Result<Tensor> {
        if self.codecs.is_none() {
            return Ok(stored.clone());
        }
        if let Some(codes) = self.device_codes(stored.device())? {
            // Read, then turned back where codes are read short of a rotation.
            let codes = part_of(&codes, part);
            let read = codes.read(stored, self.dtype)?;
            if !codes.is_rotated() {
                return Ok(read);
            }
            let dims = read.dims().to_vec();
            let (h, t, d) = three_last(&dims)?;
            let vectors = read.reshape(((), h, t, d))?;
            return Ok(codes.unrotate(&vectors)?.to_dtype(self.dtype)?.reshape(dims)?);
        }
        self.decode_with(stored, part, |codec, code, x| codec.get().decode(code, x))
    }

    /// Stored codes of `part` (a quantized layer's) turned into `[.., Hkv, T, D]` values in the
    /// compute dtype, each vector by `decode` with its head's codec, blocks of vectors on all
    /// threads (a CPU step decodes every row's whole history).
    fn decode_with(
        &self,
        stored: &Tensor,
        part: KvPart,
        decode: impl Fn(&HeadCodec, &[u8], &mut [f32]) + Sync,
    ) -> Result<Tensor> {
        /// Vectors a task decodes.
        const BLOCK: usize = 256;
        let codecs = self.codecs.as_ref().expect("called for quantized layers").of(part);
        let dims = stored.dims().to_vec();
        let (heads, t, width) = three_last(&dims)?;
        let d = codecs[0].get().dim();
        let codes = stored.flatten_all()?.to_vec1::<u8>()?;
        let mut out = vec![0f32; codes.len() / width * d];
        out.par_chunks_mut(BLOCK * d).zip(codes.par_chunks(BLOCK * width)).enumerate().for_each(|(block, (out, codes))| {
            for (i, (code, x)) in codes.chunks_exact(width).zip(out.chunks_exact_mut(d)).enumerate() {
                decode(&codecs[(block * BLOCK + i) / t % heads], code, x);
            }
        });
        let mut shape = dims;
        *shape.last_mut().expect("three dims") = d;
        Ok(Tensor::from_vec(out, shape, stored.device())?.to_dtype(self.dtype)?)
    }
}

impl LayerCodecs {
    fn of(&self, part: KvPart) -> &[HeadCodec] {
        match part {
            KvPart::Keys => &self.keys,
            KvPart::Values => &self.values,
        }
    }

    fn rotations(&self, part: KvPart) -> Option<&Tensor> {
        match part {
            KvPart::Keys => self.key_turns.as_ref(),
            KvPart::Values => self.value_turns.as_ref(),
        }
    }
}

/// The heads' rotations `[Hkv, D, D]` when every head is a TurboQuant MSE codec.
fn rotations(heads: &[HeadCodec], shape: &KvShape) -> Result<Option<Tensor>> {
    let mut all = Vec::with_capacity(heads.len() * shape.head_dim * shape.head_dim);
    for head in heads {
        match head {
            HeadCodec::Turbo(t) if t.is_mse() => all.extend_from_slice(t.rotation()),
            _ => return Ok(None),
        }
    }
    let d = shape.head_dim;
    Ok(Some(Tensor::from_vec(all, (heads.len(), d, d), &candle_core::Device::Cpu)?))
}

fn part_of(codes: &LayerCodes, part: KvPart) -> &PartCodes {
    match part {
        KvPart::Keys => &codes.keys,
        KvPart::Values => &codes.values,
    }
}

fn three_last(dims: &[usize]) -> Result<(usize, usize, usize)> {
    match dims {
        [.., h, t, d] => Ok((*h, *t, *d)),
        _ => Err(StateError::BadPart(format!("KV of shape {dims:?}: expected [.., heads, positions, dim]"))),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    #[test]
    fn names_parse_back_to_their_format() {
        for name in [
            "auto",
            "affine8-g64",
            "affine4-g32",
            "affine2-g128",
            "affine-k8v4-g64",
            "affine-k4v8-g32",
            "turbo4",
            "turbo1",
            "turbo-k4v3",
            "turbo-k4ipv4",
        ] {
            let format: KvFormat = name.parse().unwrap();
            assert_eq!(format.to_string(), name);
        }
        assert_eq!("affine4".parse::<KvFormat>().unwrap(), KvFormat::Affine { key_bits: 4, value_bits: 4, group: 64 });
        assert_eq!(
            "affine4".parse::<KvFormat>().unwrap().with_group(32),
            KvFormat::Affine { key_bits: 4, value_bits: 4, group: 32 }
        );
        for bad in [
            "affine7",
            "affine4-g48",
            "affine-k7v4",
            "affine-k8",
            "affine-k8v4-g48",
            "turbo9",
            "turbo-k1ipv4",
            "turbo-k4",
            "fp8",
            "",
            "affine",
        ] {
            assert!(bad.parse::<KvFormat>().is_err(), "{bad} parsed");
        }
        assert!("bf16".parse::<KvFormat>().unwrap_err().contains("--dtype"));
    }

    /// The formulas: affine 2·H·D·(bits + 32/group)/8; TurboQuant H·(D·bits/8 + 2) per
    /// half at each half's bits; and the codecs' own byte counts agree.
    #[test]
    fn bytes_per_token_follow_the_formulas_and_the_codecs() {
        let shape = KvShape { kv_heads: 4, head_dim: 128 };
        let formats: [(&str, usize); 7] = [
            ("auto", 2 * 4 * 128 * 2),
            // (bits + 32 / group) in 64ths.
            ("affine4-g64", 2 * 4 * 128 * (4 * 64 + 32) / 8 / 64),
            ("affine8-g32", 2 * 4 * 128 * (8 * 64 + 64) / 8 / 64),
            ("affine3-g128", 2 * 4 * (128 * 3 / 8 + 4)),
            // Keys and values each at their own bits, with their groups' scale and bias.
            ("affine-k8v4-g64", 4 * (128 * 8 / 8 + 2 * 4) + 4 * (128 * 4 / 8 + 2 * 4)),
            ("turbo4", 2 * 4 * (128 * 4 / 8 + 2)),
            ("turbo-k4v3", 4 * (128 * 4 / 8 + 2) + 4 * (128 * 3 / 8 + 2)),
        ];
        for (name, want) in formats {
            let format: KvFormat = name.parse().unwrap();
            assert_eq!(format.bytes_per_token(&shape, DType::BF16), want, "{name}");
            let coding = KvCoding::new(format, &shape, 0, DType::BF16, 0).unwrap();
            let widths = coding.width(&shape, KvPart::Keys) + coding.width(&shape, KvPart::Values);
            let per_head = if format.is_quantized() { widths } else { widths * 2 };
            assert_eq!(shape.kv_heads * per_head, want, "{name}: the codecs' bytes");
        }
        // At the same memory, 4-bit formats hold ≥ 3.4× the positions of bf16.
        let bf16 = KvFormat::Auto.bytes_per_token(&shape, DType::BF16) as f64;
        for name in ["affine4-g64", "affine4-g128", "turbo4"] {
            let ratio = bf16 / name.parse::<KvFormat>().unwrap().bytes_per_token(&shape, DType::BF16) as f64;
            assert!(ratio >= 3.4, "{name}: {ratio:.2}×");
        }
    }

    /// A tensor encoded and decoded through a layer's coding is, vector by vector, what each
    /// head's codec gives — heads find their own codec whatever the leading dimensions.
    #[test]
    fn tensors_code_vector_by_vector_with_each_heads_codec() {
        let shape = KvShape { kv_heads: 3, head_dim: 32 };
        let x = Tensor::randn(0f32, 1.0, (2, 3, 5, 32), &Device::Cpu).unwrap();
        for name in ["affine4-g32", "turbo-k3ipv2"] {
            let format: KvFormat = name.parse().unwrap();
            let coding = KvCoding::new(format, &shape, 7, DType::F32, 0).unwrap();
            for part in [KvPart::Keys, KvPart::Values] {
                let codes = coding.encode(&x, part).unwrap();
                assert_eq!(codes.dims(), [2, 3, 5, coding.width(&shape, part)]);
                let decoded = coding.decode(&codes, part).unwrap();
                for (b, h, t) in [(0, 0, 0), (1, 2, 4), (0, 1, 3)] {
                    let vector = x.get(b).unwrap().get(h).unwrap().get(t).unwrap().to_vec1::<f32>().unwrap();
                    let codec = format.codec(32, 7, h, part).unwrap();
                    let mut code = vec![0u8; codec.get().bytes()];
                    codec.get().encode(&vector, &mut code);
                    let mut want = vec![0f32; 32];
                    codec.get().decode(&code, &mut want);
                    let got = decoded.get(b).unwrap().get(h).unwrap().get(t).unwrap().to_vec1::<f32>().unwrap();
                    assert_eq!(got, want, "{name} {part:?} at {b},{h},{t}");
                }
            }
        }
    }

    /// Every layout (owned buffers, pool blocks, sliding windows) stores exactly the codes of the
    /// vectors it was fed, whatever the chunking; a row cut back and fed again holds the codes
    /// of a row that was only ever fed what it kept; a persisted row restores to the same codes,
    /// and never into a state of another format.
    #[test]
    fn every_layout_stores_the_codes_of_what_it_was_fed_and_rolls_back_exactly() {
        use crate::{LayerSpec, LayerState, PoolSize, StatePool, StateSpec, WindowShape};

        let kv = KvShape { kv_heads: 2, head_dim: 32 };
        let window = 8;
        let layers = vec![LayerSpec::Attention(kv), LayerSpec::Window(WindowShape { kv, window }), LayerSpec::Attention(kv)];
        let feed = |t: usize, seed: u64| {
            let n = 2 * t * 32;
            let data: Vec<f32> = (0..n).map(|i| ((i as u64 * 7919 + seed * 104_729) % 997) as f32 / 83.0 - 6.0).collect();
            Tensor::from_vec(data, (2, t, 32), &Device::Cpu).unwrap()
        };
        for name in ["affine4-g32", "turbo-k3ipv2"] {
            let format: KvFormat = name.parse().unwrap();
            let spec = StateSpec { layers: layers.clone(), dtype: DType::F32, kv: format.into() };
            let pool = StatePool::new(&spec, 16, PoolSize::Growing, PoolSize::Growing, &Device::Cpu).unwrap();
            let codings: Vec<KvCoding> = (0..3).map(|l| KvCoding::new(format, &kv, l, DType::F32, 0).unwrap()).collect();
            for mut state in [pool.new_state(2).unwrap(), spec.new_state(2, &Device::Cpu).unwrap()] {
                // What each layer and row was fed, keys then values.
                let mut fed: Vec<Vec<(Vec<Tensor>, Vec<Tensor>)>> = vec![vec![(vec![], vec![]); 2]; 3];
                let mut seed = 0;
                let check = |state: &crate::BatchState, fed: &Vec<Vec<(Vec<Tensor>, Vec<Tensor>)>>| {
                    for (l, layer) in state.layers.iter().enumerate() {
                        for (row, (ks, vs)) in fed[l].iter().enumerate() {
                            let (k, v) = match layer {
                                LayerState::Attention(s) => s.stored(row).unwrap(),
                                LayerState::Window(s) => s.held(row).unwrap(),
                                LayerState::Recurrent(_) => unreachable!(),
                            };
                            let held = k.dim(1).unwrap();
                            let all = |parts: &[Tensor], part| {
                                let all = Tensor::cat(parts, 1).unwrap();
                                let codes = codings[l].encode(&all, part).unwrap();
                                codes.narrow(1, all.dim(1).unwrap() - held, held).unwrap()
                            };
                            for (got, want) in [(k, all(ks, KvPart::Keys)), (v, all(vs, KvPart::Values))] {
                                let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                                assert_eq!(bytes(&got), bytes(&want), "{name}: layer {l} row {row}");
                            }
                        }
                    }
                };
                for (row, t) in [(0, 1), (1, 17), (0, 30), (1, 2), (0, 1), (1, 40)] {
                    for (l, layer) in state.layers.iter_mut().enumerate() {
                        seed += 2;
                        let (k, v) = (feed(t, seed), feed(t, seed + 1));
                        match layer {
                            LayerState::Attention(s) => drop(s.append(row, &k, &v).unwrap()),
                            LayerState::Window(s) => drop(s.append(row, &k, &v).unwrap()),
                            LayerState::Recurrent(_) => unreachable!(),
                        }
                        fed[l][row].0.push(k);
                        fed[l][row].1.push(v);
                    }
                }
                check(&state, &fed);
                // A speculative round's rollback: row 1 cut back by 3 positions (within the
                // window's slack), then fed other tokens.
                state.positions = vec![32, 59];
                state.trim(1, 56).unwrap();
                for (l, layer) in state.layers.iter_mut().enumerate() {
                    let cut = |parts: &mut Vec<Tensor>| {
                        let all = Tensor::cat(parts, 1).unwrap();
                        *parts = vec![all.narrow(1, 0, 56).unwrap()];
                    };
                    cut(&mut fed[l][1].0);
                    cut(&mut fed[l][1].1);
                    let (k, v) = (feed(5, 900 + l as u64), feed(5, 950 + l as u64));
                    match layer {
                        LayerState::Attention(s) => drop(s.append(1, &k, &v).unwrap()),
                        LayerState::Window(s) => drop(s.append(1, &k, &v).unwrap()),
                        LayerState::Recurrent(_) => unreachable!(),
                    }
                    fed[l][1].0.push(k);
                    fed[l][1].1.push(v);
                }
                state.positions[1] = 61;
                check(&state, &fed);

                // Persisted and restored: the same codes; a state of another format refuses them.
                let row = state.extract(1).unwrap();
                let parts: HashMap<String, Tensor> = row.parts().unwrap().into_iter().collect();
                let template = spec.new_state(0, &Device::Cpu).unwrap();
                let restored = crate::BatchState::from_parts(&template, 61, |n| Ok(parts[n].clone())).unwrap();
                assert_eq!(restored.parts().unwrap().len(), parts.len());
                for (n, t) in restored.parts().unwrap() {
                    let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
                    assert_eq!(bytes(&t), bytes(&parts[&n]), "{name}: {n} restored");
                }
                let other = StateSpec { kv: "turbo2".parse::<KvFormat>().unwrap().into(), ..spec.clone() }
                    .new_state(0, &Device::Cpu)
                    .unwrap();
                assert!(crate::BatchState::from_parts(&other, 61, |n| Ok(parts[n].clone())).is_err(), "{name} read as turbo2");
                let mut plain = StateSpec { kv: KvPolicy::default(), ..spec.clone() }.new_state(1, &Device::Cpu).unwrap();
                assert!(plain.merge(&row).is_err(), "{name} rows merged into unquantized ones");
            }
        }
    }

    /// Layers named unquantized (counted among KV layers, negative from the last) store their KV
    /// as computed and cost what unquantized KV costs; a name past the layers is an error.
    #[test]
    fn named_layers_stay_unquantized() {
        use crate::{LayerSpec, LayerState, RecurrentShape, StateSpec};

        let kv = KvShape { kv_heads: 1, head_dim: 32 };
        let recurrent =
            RecurrentShape { conv_kernel: 2, conv_dim: 2, value_heads: 1, value_dim: 1, key_dim: 1, ssm_dtype: DType::F32 };
        let layers = vec![LayerSpec::Recurrent(recurrent), LayerSpec::Attention(kv), LayerSpec::Recurrent(recurrent)]
            .into_iter()
            .chain([LayerSpec::Attention(kv), LayerSpec::Attention(kv)])
            .collect();
        let spec = StateSpec { layers, dtype: DType::F32, kv: KvPolicy::default() };
        let affine: KvFormat = "affine4-g32".parse().unwrap();
        let policy = KvPolicy { format: affine, unquantized: vec![0, -1], start: 0 };
        let spec = spec.with_kv(policy.clone()).unwrap();
        assert_eq!(policy.to_string(), "affine4-g32/plain:0,-1");
        let formats: Vec<KvFormat> = spec
            .new_state(1, &Device::Cpu)
            .unwrap()
            .layers
            .iter()
            .filter_map(|l| match l {
                LayerState::Attention(s) => Some(s.format()),
                _ => None,
            })
            .collect();
        assert_eq!(formats, [KvFormat::Auto, affine, KvFormat::Auto]);
        let plain = KvFormat::Auto.bytes_per_token(&kv, DType::F32);
        assert_eq!(spec.cost().bytes_per_token, 2 * plain + affine.bytes_per_token(&kv, DType::F32));
        for bad in [3, -4] {
            let policy = KvPolicy { format: affine, unquantized: vec![bad], start: 0 };
            let err = spec.clone().with_kv(policy).unwrap_err().to_string();
            assert!(err.contains("3 layers holding KV"), "{err}");
        }
    }

    /// A delayed format: queries before the start attend as unquantized KV would, the others as
    /// the quantized format would, however the positions are chunked, in full-attention and
    /// sliding-window layers; the unquantized first positions are cut back with the row and
    /// persisted with it.
    #[test]
    fn delayed_rows_read_unquantized_keys_before_the_start_and_codes_after() {
        use strata_kernels::attention::Scoring;

        use crate::{BatchState, LayerSpec, LayerState, StateSpec, WindowShape};

        let kv = KvShape { kv_heads: 1, head_dim: 32 };
        let layers = vec![LayerSpec::Attention(kv), LayerSpec::Window(WindowShape { kv, window: 6 })];
        let spec = |kv: KvPolicy| StateSpec { layers: layers.clone(), dtype: DType::F32, kv };
        let start = 10;
        for (format, chunks) in [
            ("affine3-g32", vec![4, 9, 3, 1]),
            ("affine3-g32", vec![12, 5]),
            ("affine3-g32", vec![1; 17]),
            ("turbo3", vec![4, 9, 3, 1]),
            ("turbo-k3ipv2", vec![12, 5]),
        ] {
            let affine: KvFormat = format.parse().unwrap();
            let delayed = spec(KvPolicy { format: affine, start, ..KvPolicy::default() });
            let random = |t: usize, heads: usize| Tensor::randn(0f32, 1.0, (1, heads, t, 32), &Device::Cpu).unwrap();
            let attend = |state: &mut BatchState, q: &Tensor, k: &Tensor, v: &Tensor| -> Vec<Tensor> {
                let scoring = |window| Scoring { scale: 0.2, window };
                state
                    .layers
                    .iter_mut()
                    .map(|layer| match layer {
                        LayerState::Attention(s) => s.attend(q, k, v, scoring(None), None).unwrap(),
                        LayerState::Window(s) => s.attend(q, k, v, scoring(Some(6))).unwrap(),
                        LayerState::Recurrent(_) => unreachable!(),
                    })
                    .collect()
            };
            let mut states = [delayed.clone(), spec(KvPolicy::default()), spec(affine.into())]
                .map(|spec| spec.new_state(1, &Device::Cpu).unwrap());
            let mut len = 0;
            for t in chunks {
                let (q, k, v) = (random(t, 2), random(t, 1), random(t, 1));
                let [got, plain, coded] = states.each_mut().map(|s| attend(s, &q, &k, &v));
                for layer in 0..2 {
                    for i in 0..t {
                        let want = if len + i < start { &plain[layer] } else { &coded[layer] };
                        let query = |x: &Tensor| x.narrow(2, i, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                        let worst = query(&got[layer]).iter().zip(query(want)).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                        assert!(worst < 1e-5, "layer {layer}, position {}: off by {worst}", len + i);
                    }
                }
                len += t;
            }
            for s in &mut states {
                s.positions = vec![len];
            }
            assert_eq!(
                Some(states[0].bytes()),
                delayed.cost().bytes(len),
                "the declared cost, unquantized first positions included"
            );
            // Cut back below the start and fed again: still exact; persisted and restored:
            // the same codes and unquantized positions.
            let [d, p, c] = &mut states;
            for s in [&mut *d, &mut *p, &mut *c] {
                s.trim(0, 8).unwrap();
            }
            let (q, k, v) = (random(5, 2), random(5, 1), random(5, 1));
            let [got, plain, coded] = [d, p, c].map(|s| attend(s, &q, &k, &v));
            for layer in 0..2 {
                for (i, want) in [(0, &plain), (1, &plain), (2, &coded), (4, &coded)] {
                    let query = |x: &Tensor| x.narrow(2, i, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let worst =
                        query(&got[layer]).iter().zip(query(&want[layer])).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(worst < 1e-5, "after the cut, layer {layer}, position {}: off by {worst}", 8 + i);
                }
            }
            let row = &states[0];
            let parts: HashMap<String, Tensor> = row.parts().unwrap().into_iter().collect();
            assert_eq!(parts["layers.0.k_prefix"].dims(), [1, start, 32]);
            let template = delayed.new_state(0, &Device::Cpu).unwrap();
            let restored = BatchState::from_parts(&template, 13, |n| Ok(parts[n].clone())).unwrap();
            for (n, t) in restored.parts().unwrap() {
                let values = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(values(&t), values(&parts[&n]), "{n} restored");
            }
            let short = |n: &str| Ok(if n.ends_with("k_prefix") { parts[n].narrow(1, 0, 5)? } else { parts[n].clone() });
            assert!(BatchState::from_parts(&template, 13, short).is_err(), "a prefix of the wrong length");
        }
    }

    /// Attention over TurboQuant codes read short of their rotation (queries and output turned
    /// instead) is attention over the decoded keys and values, with GQA and for either key
    /// variant.
    #[test]
    fn rotated_reads_attend_as_decoded_codes_do() {
        use strata_kernels::attention::{self, Scoring};

        use crate::{KvStore, Storage, StoreContext};

        let shape = KvShape { kv_heads: 2, head_dim: 32 };
        for name in ["turbo3", "turbo-k3ipv2", "turbo-k2v4"] {
            let cx = StoreContext { layer: 3, dtype: DType::F32, kv: name.parse().unwrap(), kv_start: 0 };
            let mut store = KvStore::empty(&shape, 2, &cx, &Device::Cpu).unwrap();
            let scoring = Scoring::scaled(0.3);
            for t in [7, 1, 3] {
                let q = Tensor::randn(0f32, 1.0, (2, 4, t, 32), &Device::Cpu).unwrap();
                let (k, v) = (
                    Tensor::randn(0f32, 1.0, (2, 2, t, 32), &Device::Cpu).unwrap(),
                    Tensor::randn(0f32, 1.0, (2, 2, t, 32), &Device::Cpu).unwrap(),
                );
                let got = store.attend(&q, &k, &v, scoring, None).unwrap();
                let history = (0..2).map(|r| store.history(r).unwrap()).collect::<Vec<_>>();
                let want = attention::causal_attention_rows(&q, &history, scoring).unwrap();
                let worst =
                    (got - want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
                assert!(worst < 1e-4, "{name}, chunk of {t}: off by {worst}");
            }
        }
    }
}
