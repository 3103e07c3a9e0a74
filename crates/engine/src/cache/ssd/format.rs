//! One entry file, byte by byte (format version 1, codec `raw-le-v1`): the magic `STRATAKV`, the
//! version (u32), the header length (u32), a JSON header (identity, codec, namespace, tokens,
//! position, whether the state trims, resume facts, and a table of tensors with their dtype,
//! shape, offset, length and xxh3), the xxh3 of the header (u64), then each tensor's raw
//! little-endian bytes at a page-aligned offset. All integers are little-endian.

use std::collections::HashMap;
use std::fs::{self, File, Metadata};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use strata_state::{BatchState, LayerState, StateError};
use xxhash_rust::xxh3::xxh3_64;

use super::{Identity, SsdError};
use crate::cache::{Resume, Snapshot};

const MAGIC: &[u8; 8] = b"STRATAKV";
const VERSION: u32 = 1;
const CODEC: &str = "raw-le-v1";
/// Tensors start on page boundaries, so a reader may map or read them without realigning.
const ALIGN: u64 = 4096;
/// Magic, version and header length.
const PREAMBLE: u64 = 16;
/// No header we write comes near this; it bounds the allocation a damaged length could ask for.
const MAX_HEADER: u32 = 64 << 20;

// The codec writes host bytes and calls them little-endian; `Tensor::from_raw_buffer` reads them
// back in host order.
const _: () = assert!(cfg!(target_endian = "little"), "the raw-le-v1 cache codec needs a little-endian host");

#[derive(Serialize, Deserialize)]
pub(super) struct Header {
    identity: Identity,
    codec: String,
    pub(super) namespace: u64,
    pub(super) tokens: Vec<u32>,
    position: usize,
    pub(super) trimmable: bool,
    pub(super) resume: Option<Resume>,
    tensors: Vec<TensorRecord>,
}

#[derive(Serialize, Deserialize)]
struct TensorRecord {
    name: String,
    dtype: String,
    shape: Vec<usize>,
    /// Absolute offset in the file, a multiple of [`ALIGN`].
    offset: u64,
    len: u64,
    hash: u64,
}

/// Attaches the path to I/O errors; a read that runs past the end means the file was cut short.
pub(super) trait AtPath<T> {
    fn at(self, path: &Path) -> Result<T, SsdError>;
}

impl<T> AtPath<T> for io::Result<T> {
    fn at(self, path: &Path) -> Result<T, SsdError> {
        self.map_err(|source| match source.kind() {
            io::ErrorKind::UnexpectedEof => corrupt(path, "the file ends early"),
            _ => SsdError::Io { path: path.to_path_buf(), source },
        })
    }
}

fn corrupt(path: &Path, reason: impl Into<String>) -> SsdError {
    SsdError::Corrupt { path: path.to_path_buf(), reason: reason.into() }
}

/// An entry laid out but not yet written.
pub(super) struct Plan {
    /// Every tensor placed; hashes are filled in as the tensors are written.
    pub(super) header: Header,
    parts: Vec<(String, Tensor)>,
    /// Bytes of the file.
    pub(super) size: u64,
}

/// Lays out `snap`'s file.
pub(super) fn plan(identity: &Identity, snap: &Snapshot) -> Result<Plan, SsdError> {
    if snap.state.positions != [snap.tokens.len()] {
        let why = format!("state positions {:?} for {} tokens", snap.state.positions, snap.tokens.len());
        return Err(SsdError::Unstorable(why));
    }
    let parts = snap.state.parts().map_err(|e| SsdError::Unstorable(e.to_string()))?;
    let mut header = Header {
        identity: identity.clone(),
        codec: CODEC.into(),
        namespace: snap.namespace,
        tokens: snap.tokens.clone(),
        position: snap.tokens.len(),
        trimmable: snap.can_trim(),
        resume: snap.resume,
        tensors: parts.iter().map(|(name, t)| record(name, t)).collect::<Result<_, _>>()?,
    };
    let size = layout(&mut header)?;
    Ok(Plan { header, parts, size })
}

/// A tensor-table row for `t`, hash still unknown (the widest placeholder, see [`layout`]).
fn record(name: &str, t: &Tensor) -> Result<TensorRecord, SsdError> {
    if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16 | DType::U8) {
        return Err(SsdError::Unstorable(format!("tensor `{name}` is {}, which the codec does not store", t.dtype().as_str())));
    }
    Ok(TensorRecord {
        name: name.into(),
        dtype: t.dtype().as_str().into(),
        shape: t.dims().to_vec(),
        offset: 0,
        len: (t.elem_count() * t.dtype().size_in_bytes()) as u64,
        hash: u64::MAX,
    })
}

fn align(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

fn header_json(header: &Header) -> Result<Vec<u8>, SsdError> {
    serde_json::to_vec(header).map_err(|e| SsdError::Unstorable(e.to_string()))
}

/// Places the tensors on page boundaries after the header and returns the file size. The header
/// records the offsets, so its length depends on them: repeat until the header fits before the
/// first tensor (two or three rounds). Hashes are still the widest placeholder, so the final
/// header is never longer than the one measured here.
fn layout(header: &mut Header) -> Result<u64, SsdError> {
    let mut data_start = 0;
    loop {
        let mut offset = data_start;
        for record in &mut header.tensors {
            record.offset = offset;
            offset = align(offset + record.len);
        }
        let needed = align(PREAMBLE + header_json(header)?.len() as u64 + 8);
        if needed <= data_start {
            return Ok(header.tensors.last().map_or(data_start, |t| t.offset + t.len));
        }
        data_start = needed;
    }
}

/// Writes a planned entry as `<uuid>.entry.tmp`, fsyncs it, renames it to `<uuid>.entry` and
/// fsyncs the folder so the rename itself survives a crash. On failure nothing is left behind.
/// `dir` is a real folder below `root` (created if missing; a link in its place is refused).
pub(super) fn write_entry(root: &Path, dir: &Path, plan: &mut Plan, mtime: SystemTime) -> Result<PathBuf, SsdError> {
    super::files::ensure_dir(root, dir)?;
    let name = format!("{:032x}", rand::random::<u128>());
    let tmp = dir.join(format!("{name}.entry.tmp"));
    let path = dir.join(format!("{name}.entry"));
    let result = (|| {
        // A new file only: never one planted under this name, nor the target of a link.
        let mut file = File::options().write(true).create_new(true).custom_flags(libc::O_NOFOLLOW).open(&tmp).at(&tmp)?;
        // Tensors first, one at a time, so only one is ever copied to the host at once; the
        // header, which needs their hashes, goes last into the space `layout` kept for it.
        for ((_, tensor), record) in plan.parts.iter().zip(&mut plan.header.tensors) {
            let bytes = host_bytes(tensor)?;
            record.hash = xxh3_64(&bytes);
            file.seek(SeekFrom::Start(record.offset)).at(&tmp)?;
            file.write_all(&bytes).at(&tmp)?;
        }
        let json = header_json(&plan.header)?;
        let mut head = Vec::with_capacity(json.len() + 24);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.extend_from_slice(&(json.len() as u32).to_le_bytes());
        head.extend_from_slice(&json);
        head.extend_from_slice(&xxh3_64(&json).to_le_bytes());
        file.seek(SeekFrom::Start(0)).at(&tmp)?;
        file.write_all(&head).at(&tmp)?;
        // Pads a tensorless entry to its size; a no-op otherwise.
        file.set_len(plan.size).at(&tmp)?;
        file.set_modified(mtime).at(&tmp)?;
        file.sync_all().at(&tmp)?;
        fs::rename(&tmp, &path).at(&path)?;
        File::open(dir).and_then(|d| d.sync_all()).at(dir)
    })();
    if result.is_err() {
        // Whichever name the file had when the write failed; the other does not exist.
        let _ = fs::remove_file(&tmp);
        let _ = fs::remove_file(&path);
    }
    result.map(|()| path)
}

/// The raw little-endian bytes of a tensor, copied to the host.
fn host_bytes(t: &Tensor) -> Result<Vec<u8>, SsdError> {
    let unstorable = |e: candle_core::Error| SsdError::Unstorable(e.to_string());
    let flat = t.flatten_all().map_err(unstorable)?;
    Ok(match t.dtype() {
        DType::F32 => flat.to_vec1::<f32>().map_err(unstorable)?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => flat.to_vec1::<half::bf16>().map_err(unstorable)?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => flat.to_vec1::<half::f16>().map_err(unstorable)?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        // Quantized KV codes.
        DType::U8 => flat.to_vec1::<u8>().map_err(unstorable)?,
        other => return Err(SsdError::Unstorable(format!("dtype {} has no codec", other.as_str()))),
    })
}

/// Reads and checks the header: magic, version, header hash, then identity, codec and
/// self-consistency. A file of another format version or codec (another strata build sharing
/// the folder) is reported as foreign, never as corrupt, like one of another identity. The
/// hash guards against damage, not against a header whose own numbers disagree: every tensor
/// record's length must be what its dtype and shape take, and lie within the file, before
/// anything is allocated for it.
fn read_header(mut file: &File, path: &Path, identity: &Identity) -> Result<Header, SsdError> {
    let mut preamble = [0u8; PREAMBLE as usize];
    file.read_exact(&mut preamble).at(path)?;
    if &preamble[..8] != MAGIC {
        return Err(corrupt(path, "no STRATAKV magic"));
    }
    let version = u32::from_le_bytes(preamble[8..12].try_into().expect("4 bytes"));
    if version != VERSION {
        let found = format!("cache format version {version}; this build reads version {VERSION}");
        return Err(SsdError::Foreign { path: path.to_path_buf(), found });
    }
    let len = u32::from_le_bytes(preamble[12..16].try_into().expect("4 bytes"));
    if len > MAX_HEADER {
        return Err(corrupt(path, format!("header length {len} is implausible")));
    }
    let mut buf = vec![0u8; len as usize + 8];
    file.read_exact(&mut buf).at(path)?;
    let (json, hash) = buf.split_at(len as usize);
    if xxh3_64(json) != u64::from_le_bytes(hash.try_into().expect("8 bytes")) {
        return Err(corrupt(path, "the header fails its hash"));
    }
    let header: Header = serde_json::from_slice(json).map_err(|e| corrupt(path, format!("unreadable header: {e}")))?;
    if header.identity != *identity {
        let Identity { model, config_hash, tokenizer_hash, dtype } = &header.identity;
        let found = format!("{model} config {config_hash:016x} tokenizer {tokenizer_hash:016x} {dtype}");
        return Err(SsdError::Foreign { path: path.to_path_buf(), found });
    }
    if header.codec != CODEC {
        let found = format!("codec `{}`; this build reads `{CODEC}`", header.codec);
        return Err(SsdError::Foreign { path: path.to_path_buf(), found });
    }
    if header.position != header.tokens.len() {
        return Err(corrupt(path, format!("position {} for {} tokens", header.position, header.tokens.len())));
    }
    let file_len = file.metadata().at(path)?.len();
    for t in &header.tensors {
        let dtype = t.dtype.parse::<DType>().map_err(|e| corrupt(path, format!("tensor `{}`: {e}", t.name)))?;
        let len = t.shape.iter().try_fold(dtype.size_in_bytes() as u64, |n, &d| n.checked_mul(d as u64));
        if len != Some(t.len) {
            return Err(corrupt(path, format!("tensor `{}` records {} bytes for {} {:?}", t.name, t.len, t.dtype, t.shape)));
        }
        if t.offset.checked_add(t.len).is_none_or(|end| end > file_len) {
            return Err(corrupt(
                path,
                format!("the file has {file_len} bytes, tensor `{}` needs {} from offset {}", t.name, t.len, t.offset),
            ));
        }
    }
    Ok(header)
}

/// Checks the entry file `file` (read from `path`) at startup: its header, that it is long
/// enough for its tensor table, and with `verify` every tensor's hash.
pub(super) fn inspect(file: &File, path: &Path, identity: &Identity, verify: bool) -> Result<(Header, Metadata), SsdError> {
    let meta = file.metadata().at(path)?;
    let header = read_header(file, path, identity)?;
    if verify {
        for record in &header.tensors {
            read_tensor(file, record, path)?;
        }
    }
    Ok((header, meta))
}

/// Reads one tensor's bytes into a buffer of its own and checks its hash.
fn read_tensor(mut file: &File, record: &TensorRecord, path: &Path) -> Result<Vec<u8>, SsdError> {
    file.seek(SeekFrom::Start(record.offset)).at(path)?;
    let mut bytes = vec![0u8; record.len as usize];
    file.read_exact(&mut bytes).at(path)?;
    if xxh3_64(&bytes) != record.hash {
        return Err(corrupt(path, format!("tensor `{}` fails its hash", record.name)));
    }
    Ok(bytes)
}

/// Reads a whole entry from `file` (opened from `path`) back onto `template`'s device, every
/// tensor hash-checked and every shape checked against `template` (a fresh state of the model).
pub(super) fn read_entry(file: &File, path: &Path, identity: &Identity, template: &BatchState) -> Result<Snapshot, SsdError> {
    let header = read_header(file, path, identity)?;
    let device = device_of(template);
    let records: HashMap<&str, &TensorRecord> = header.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    // `from_parts` speaks `StateError`; the reading errors it cannot carry wait here.
    let mut failure = None;
    let mut used = 0;
    let state = BatchState::from_parts(template, header.position, |name| {
        let record = records.get(name).ok_or_else(|| StateError::BadPart(format!("the file has no tensor `{name}`")))?;
        used += 1;
        let read = read_tensor(file, record, path)
            .and_then(|bytes| Ok((bytes, record.dtype.parse::<DType>().map_err(|e| corrupt(path, e.to_string()))?)));
        match read {
            Ok((bytes, dtype)) => Ok(Tensor::from_raw_buffer(&bytes, dtype, &record.shape, &device)?),
            Err(e) => {
                let message = e.to_string();
                failure = Some(e);
                Err(StateError::BadPart(message))
            }
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    let mismatch = |source| SsdError::Mismatch { path: path.to_path_buf(), source };
    let state = state.map_err(mismatch)?;
    if used != header.tensors.len() {
        let extra = format!("the file holds {} tensors, the model uses {used}", header.tensors.len());
        return Err(mismatch(StateError::BadPart(extra)));
    }
    Ok(Snapshot { namespace: header.namespace, tokens: header.tokens, state, resume: header.resume })
}

/// Where the template's tensors live, so restored tensors go straight there.
fn device_of(template: &BatchState) -> Device {
    template.layers.first().map_or(Device::Cpu, LayerState::device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_puts_every_tensor_on_a_page_after_the_header() {
        let rec = |len| TensorRecord { name: "t".into(), dtype: "f32".into(), shape: vec![1], offset: 0, len, hash: u64::MAX };
        let identity = Identity { model: "m".into(), config_hash: 0, tokenizer_hash: 0, dtype: "f32".into() };
        let mut header = Header {
            identity,
            codec: CODEC.into(),
            namespace: 0,
            tokens: (0..2000).collect(),
            position: 2000,
            trimmable: true,
            resume: None,
            tensors: vec![rec(10), rec(5000), rec(7)],
        };
        let size = layout(&mut header).unwrap();
        let offsets: Vec<u64> = header.tensors.iter().map(|t| t.offset).collect();
        assert!(offsets.iter().all(|o| o % ALIGN == 0));
        assert!(offsets[0] >= PREAMBLE + header_json(&header).unwrap().len() as u64 + 8);
        assert_eq!(offsets[1], offsets[0] + ALIGN);
        assert_eq!(offsets[2], offsets[1] + 2 * ALIGN);
        assert_eq!(size, offsets[2] + 7);
    }
}
