//! The SSD tier of the prompt cache against real model state (the tiny fixture, run over a few
//! tokens): bitwise round trips across restarts, lookups that never offer what an entry cannot
//! serve, crash and corruption recovery, the byte cap, superseding, and the write-behind queue.

use std::fs;
use std::os::unix::fs::{symlink, FileTypeExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use strata_engine::cache::ssd::SsdError;
use strata_engine::cache::{usable_prefix, CacheStats, Identity, Recovery, Resume, Snapshot, SsdOptions, SsdStore, SsdWriter};
use strata_model::{Logits, Model, ModelFolder};
use strata_state::{BatchState, KvShape, LayerSpec, LayerState, StateSpec};

const GIB: u64 = 1 << 30;

fn model(dtype: DType) -> Model {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5-tiny-a");
    ModelFolder::open(&dir).unwrap().load(dtype, &Device::Cpu).unwrap()
}

/// The model's state after `tokens`: real, non-trivial tensors (untrimmable: it has DeltaNet layers).
fn run(model: &Model, tokens: &[u32]) -> BatchState {
    let mut state = model.new_state(1).unwrap();
    let input = Tensor::new(tokens, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    model.forward(&input, &mut state, Logits::Last).unwrap();
    state
}

/// A fresh attention-only state: trimmable, unlike the fixture's.
fn kv_template() -> BatchState {
    let kv = KvShape { kv_heads: 2, head_dim: 8 };
    StateSpec { layers: vec![LayerSpec::Attention(kv)], dtype: DType::F32, kv: strata_state::KvPolicy::default() }
        .new_state(1, &Device::Cpu)
        .unwrap()
}

fn kv_state(len: usize) -> BatchState {
    let mut state = kv_template();
    let LayerState::Attention(kv) = &mut state.layers[0] else { unreachable!() };
    let k = Tensor::rand(-1f32, 1f32, (2, len, 8), &Device::Cpu).unwrap();
    let v = Tensor::rand(-1f32, 1f32, (2, len, 8), &Device::Cpu).unwrap();
    kv.append(0, &k, &v).unwrap();
    state.positions = vec![len];
    state
}

fn snap(namespace: u64, tokens: &[u32], state: BatchState, resume: Option<Resume>) -> Snapshot {
    Snapshot { namespace, tokens: tokens.to_vec(), state, resume }
}

fn identity(model: &str) -> Identity {
    Identity { model: model.into(), config_hash: 0xC0FF_EE00_1234_5678, tokenizer_hash: 42, dtype: "f32".into() }
}

fn open_as(dir: &Path, identity: Identity, max_bytes: u64, verify: bool) -> (SsdStore, Recovery, Arc<CacheStats>) {
    let stats = Arc::new(CacheStats::default());
    let (store, recovery) = SsdStore::open(SsdOptions { dir: dir.into(), max_bytes, verify }, identity, stats.clone()).unwrap();
    (store, recovery, stats)
}

fn open(dir: &Path, max_bytes: u64, verify: bool) -> (SsdStore, Recovery, Arc<CacheStats>) {
    open_as(dir, identity("tiny-a"), max_bytes, verify)
}

/// Every file below `dir`, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files(&path));
        } else {
            out.push(path);
        }
    }
    out.sort();
    out
}

fn entry_files(dir: &Path) -> Vec<PathBuf> {
    files(dir).into_iter().filter(|p| p.extension().is_some_and(|e| e == "entry")).collect()
}

fn no_tmp_left(dir: &Path) -> bool {
    files(dir).iter().all(|p| p.extension().is_none_or(|e| e != "tmp"))
}

/// Stores `snap` and returns the path of the file it wrote.
fn store_one(dir: &Path, store: &SsdStore, snap: &Snapshot) -> PathBuf {
    let before = entry_files(dir);
    assert!(store.store(snap).unwrap());
    let new: Vec<PathBuf> = entry_files(dir).into_iter().filter(|p| !before.contains(p)).collect();
    assert_eq!(new.len(), 1);
    new[0].clone()
}

/// Scores only the entry holding exactly `tokens`.
fn exact(tokens: &[u32]) -> impl Fn(&[u32], bool) -> usize + '_ {
    move |entry, _| if entry == tokens { entry.len() } else { 0 }
}

/// Scores as the engine does for `prompt`: at least one token must be left to compute.
fn for_prompt(prompt: &[u32]) -> impl Fn(&[u32], bool) -> usize + '_ {
    move |entry, trimmable| usable_prefix(entry, trimmable, prompt, prompt.len() - 1)
}

fn flip_byte(path: &Path, at: usize) {
    let mut bytes = fs::read(path).unwrap();
    bytes[at] ^= 0x40;
    fs::write(path, bytes).unwrap();
}

fn assert_bitwise_eq(a: &BatchState, b: &BatchState) {
    let (a, b) = (a.parts().unwrap(), b.parts().unwrap());
    assert_eq!(a.iter().map(|p| &p.0).collect::<Vec<_>>(), b.iter().map(|p| &p.0).collect::<Vec<_>>());
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert_eq!((x.dtype(), x.dims()), (y.dtype(), y.dims()), "{name}");
        // Widening to f32 is exact for every stored dtype, so equal bits here are equal bits there.
        let bits = |t: &Tensor| -> Vec<u32> {
            t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        assert_eq!(bits(x), bits(y), "{name}");
    }
}

#[test]
fn round_trip_is_bitwise_across_a_restart() {
    for dtype in [DType::F32, DType::BF16] {
        let dir = tempfile::tempdir().unwrap();
        let model = model(dtype);
        let tokens: Vec<u32> = (1..=12).collect();
        let state = run(&model, &tokens);
        let resume = Some(Resume { prompt_len: 9, next_token: 77 });
        {
            let (store, recovery, _) = open(dir.path(), GIB, false);
            assert_eq!(recovery.entries, 0);
            assert!(store.store(&snap(7, &tokens, state.clone(), resume)).unwrap());
        }
        let file = entry_files(dir.path()).pop().unwrap();
        assert!(file.parent().unwrap().ends_with(format!("{}/{:016x}", identity("tiny-a").fingerprint(), 7)));

        let (store, recovery, stats) = open(dir.path(), GIB, true);
        assert_eq!((recovery.entries, recovery.bytes), (1, fs::metadata(&file).unwrap().len()));
        assert_eq!((recovery.reaped_tmp, recovery.removed_corrupt, recovery.skipped_foreign), (0, 0, 0));
        assert_eq!((store.entries(), store.bytes()), (1, recovery.bytes));
        assert_eq!(stats.ssd_entries.load(Relaxed), 1);

        let hit = store.lookup(7, exact(&tokens)).unwrap();
        assert_eq!((hit.tokens, hit.usable), (12, 12));
        let back = store.load(&hit, &model.new_state(1).unwrap()).unwrap();
        assert_eq!((back.namespace, &back.tokens, back.resume), (7, &tokens, resume));
        assert_eq!(back.state.positions, vec![12]);
        assert_bitwise_eq(&back.state, &state);
        assert_eq!((stats.ssd_restores.load(Relaxed), stats.ssd_restore_failures.load(Relaxed)), (1, 0));

        // The restored state carries on exactly like the one that was stored.
        let next = Tensor::new(&[[5u32]], &Device::Cpu).unwrap();
        let (mut original, mut restored) = (state, back.state);
        let want = model.forward(&next, &mut original, Logits::Last).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let got = model.forward(&next, &mut restored, Logits::Last).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(want, got);
    }
}

#[test]
fn lookup_never_offers_an_entry_it_cannot_serve() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(DType::F32);
    let (store, _, _) = open(dir.path(), GIB, false);
    let prompt: Vec<u32> = (1..=10).collect();
    store.store(&snap(1, &prompt[..6], run(&model, &prompt[..6]), None)).unwrap();
    store.store(&snap(1, &prompt, run(&model, &prompt), None)).unwrap();
    assert_eq!(store.entries(), 2);

    // Untrimmable entries serve only their whole length: the 10-token entry would leave nothing
    // to compute for the same prompt, so the 6-token one is chosen.
    let hit = store.lookup(1, for_prompt(&prompt)).unwrap();
    assert_eq!((hit.tokens, hit.usable), (6, 6));
    assert_eq!(store.load(&hit, &model.new_state(1).unwrap()).unwrap().tokens, prompt[..6]);
    assert!(store.lookup(1, for_prompt(&prompt[..6])).is_none());
    assert!(store.lookup(1, for_prompt(&[1, 2, 3, 99, 5, 6, 7, 8])).is_none());
    assert!(store.lookup(2, for_prompt(&prompt)).is_none());

    // Trimmable entries serve any common prefix; the longest usable wins.
    let kv_tokens: Vec<u32> = (1..=8).collect();
    store.store(&snap(2, &kv_tokens, kv_state(8), None)).unwrap();
    store.store(&snap(2, &[1, 2, 3, 9, 9], kv_state(5), None)).unwrap();
    let hit = store.lookup(2, for_prompt(&prompt)).unwrap();
    assert_eq!((hit.tokens, hit.usable), (8, 8));
    let hit = store.lookup(2, for_prompt(&prompt[..5])).unwrap();
    assert_eq!((hit.tokens, hit.usable), (8, 4));
    let mut loaded = store.load(&hit, &kv_template()).unwrap();
    assert_eq!(loaded.tokens, kv_tokens);
    loaded.state.trim(0, 4).unwrap();

    // Equal scores go to the most recently used entry.
    store.store(&snap(3, &[1, 2, 3, 7], kv_state(4), None)).unwrap();
    store.store(&snap(3, &[1, 2, 3, 8], kv_state(4), None)).unwrap();
    let tied = [1, 2, 3, 4, 5];
    let newest = |store: &SsdStore| store.load(&store.lookup(3, for_prompt(&tied)).unwrap(), &kv_template()).unwrap().tokens;
    assert_eq!(newest(&store), [1, 2, 3, 8]);
    store.load(&store.lookup(3, exact(&[1, 2, 3, 7])).unwrap(), &kv_template()).unwrap();
    assert_eq!(newest(&store), [1, 2, 3, 7]);
}

/// Five tokens from `first` on.
fn five(first: u32) -> Vec<u32> {
    (first..first + 5).collect()
}

/// Four entries in a fresh store in `dir` (namespace 1, the state after `five(10)`, `five(20)`,
/// `five(30)`, `five(40)`), the store closed again; their files.
fn store_four(dir: &Path, model: &Model) -> [PathBuf; 4] {
    let (store, _, _) = open(dir, GIB, false);
    [10, 20, 30, 40].map(|first| store_one(dir, &store, &snap(1, &five(first), run(model, &five(first)), None)))
}

#[test]
fn startup_reaps_tmp_files_and_removes_damaged_entries() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(DType::F32);
    let [intact, cut_in_header, cut_in_data, flipped_header] = store_four(dir.path(), &model);

    let tmp = intact.parent().unwrap().join("0123456789abcdef0123456789abcdef.entry.tmp");
    fs::write(&tmp, b"half of an entry").unwrap();
    let len = fs::metadata(&cut_in_data).unwrap().len();
    fs::File::options().write(true).open(&cut_in_header).unwrap().set_len(40).unwrap();
    fs::File::options().write(true).open(&cut_in_data).unwrap().set_len(len - 100).unwrap();
    flip_byte(&flipped_header, 16 + 30);

    let (store, recovery, stats) = open(dir.path(), GIB, false);
    assert_eq!((recovery.reaped_tmp, recovery.removed_corrupt, recovery.skipped_foreign), (1, 3, 0));
    assert_eq!((recovery.entries, store.entries()), (1, 1));
    assert_eq!(entry_files(dir.path()), vec![intact]);
    assert!(no_tmp_left(dir.path()));
    assert_eq!(stats.ssd_entries.load(Relaxed), 1);
    let hit = store.lookup(1, exact(&five(10))).unwrap();
    assert_bitwise_eq(&store.load(&hit, &model.new_state(1).unwrap()).unwrap().state, &run(&model, &five(10)));
}

/// Rewrites an entry's JSON header through `edit` (given the file's bytes) with its hash
/// recomputed: a header that passes its hash but whose own numbers disagree, as a buggy or
/// hostile writer could leave. The header may grow into the room before the page-aligned first
/// tensor.
fn rewrite_header(path: &Path, edit: impl FnOnce(&mut serde_json::Value, &[u8])) {
    let mut bytes = fs::read(path).unwrap();
    let len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[16..16 + len]).unwrap();
    let room = header["tensors"].as_array().unwrap().iter().map(|t| t["offset"].as_u64().unwrap()).min().unwrap() as usize;
    edit(&mut header, &bytes);
    let json = serde_json::to_vec(&header).unwrap();
    assert!(16 + json.len() + 8 <= room, "the edited header does not fit before the first tensor");
    bytes[12..16].copy_from_slice(&(json.len() as u32).to_le_bytes());
    bytes[16..16 + json.len()].copy_from_slice(&json);
    bytes[16 + json.len()..24 + json.len()].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(&json).to_le_bytes());
    fs::write(path, bytes).unwrap();
}

/// The first tensor record whose name ends with `suffix`.
fn record<'a>(header: &'a mut serde_json::Value, suffix: &str) -> &'a mut serde_json::Value {
    let tensors = header["tensors"].as_array_mut().unwrap();
    tensors.iter_mut().find(|t| t["name"].as_str().unwrap().ends_with(suffix)).unwrap()
}

#[test]
fn entries_of_another_format_are_kept_and_inconsistent_headers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(DType::F32);
    let [newer_format, wrong_length, past_u64, rank_zero] = store_four(dir.path(), &model);

    // Another strata build's format version: its file, not damage.
    let mut bytes = fs::read(&newer_format).unwrap();
    bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
    fs::write(&newer_format, bytes).unwrap();
    // A length that is not what the shape takes; an offset whose end overflows u64.
    rewrite_header(&wrong_length, |h, _| {
        let r = record(h, ".conv");
        r["len"] = (r["len"].as_u64().unwrap() + 4).into();
    });
    rewrite_header(&past_u64, |h, _| record(h, ".conv")["offset"] = u64::MAX.into());
    // Self-consistent and hash-correct, but a rank-0 tensor where the model keeps a row of
    // conv state: it panicked the reader, which the engine's prefetch thread runs.
    rewrite_header(&rank_zero, |h, bytes| {
        let r = record(h, ".conv");
        let at = r["offset"].as_u64().unwrap() as usize;
        r["shape"] = serde_json::json!([]);
        r["len"] = 4.into();
        r["hash"] = xxhash_rust::xxh3::xxh3_64(&bytes[at..at + 4]).into();
    });

    let (store, recovery, _) = open(dir.path(), GIB, false);
    assert_eq!((recovery.skipped_foreign, recovery.removed_corrupt, recovery.entries), (1, 2, 1));
    assert!(newer_format.exists() && !wrong_length.exists() && !past_u64.exists());
    let hit = store.lookup(1, exact(&five(40))).unwrap();
    let err = store.load(&hit, &model.new_state(1).unwrap()).unwrap_err();
    assert!(matches!(err, SsdError::Mismatch { .. }) && err.to_string().contains("conv"), "{err}");
}

#[test]
fn corrupt_tensor_data_is_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(DType::F32);
    let tokens: Vec<u32> = (1..=6).collect();
    let entry = snap(1, &tokens, run(&model, &tokens), None);
    let damaged = |verify: bool| {
        let (store, _, _) = open(dir.path(), GIB, false);
        let path = store_one(dir.path(), &store, &entry);
        drop(store);
        // The last byte belongs to the last tensor; the header is intact.
        flip_byte(&path, fs::metadata(&path).unwrap().len() as usize - 1);
        let (store, recovery, stats) = open(dir.path(), GIB, verify);
        (path, store, recovery, stats)
    };

    // Without verification the entry is indexed, but loading it checks every tensor's hash.
    let (path, store, recovery, stats) = damaged(false);
    assert_eq!((recovery.entries, recovery.removed_corrupt), (1, 0));
    let hit = store.lookup(1, exact(&tokens)).unwrap();
    let err = store.load(&hit, &model.new_state(1).unwrap()).unwrap_err();
    assert!(matches!(err, SsdError::Corrupt { .. }) && err.to_string().contains("fails its hash"), "{err}");
    assert!(!path.exists());
    assert_eq!((store.entries(), store.bytes()), (0, 0));
    assert_eq!((stats.ssd_restore_failures.load(Relaxed), stats.ssd_restores.load(Relaxed)), (1, 0));
    assert!(store.lookup(1, exact(&tokens)).is_none());
    drop(store);

    // With verification the same damage is found at startup.
    let (path, store, recovery, _) = damaged(true);
    assert_eq!((recovery.entries, recovery.removed_corrupt), (0, 1));
    assert!(!path.exists());
    assert!(store.lookup(1, exact(&tokens)).is_none());
}

#[test]
fn other_identities_files_are_never_touched() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(DType::F32);
    let tokens: Vec<u32> = (1..=5).collect();
    let (ours, theirs) = (identity("tiny-a"), identity("another-model"));
    let (their_store, _, _) = open_as(dir.path(), theirs.clone(), GIB, false);
    let their_file = store_one(dir.path(), &their_store, &snap(1, &tokens, run(&model, &tokens), None));
    drop(their_store);
    let their_bytes = fs::read(&their_file).unwrap();

    // A copy of their entry placed in our folder, and a file we know nothing about.
    let our_root = dir.path().join(ours.fingerprint());
    fs::create_dir_all(our_root.join(format!("{:016x}", 1))).unwrap();
    let planted = our_root.join(format!("{:016x}", 1)).join("feedfacefeedfacefeedfacefeedface.entry");
    fs::copy(&their_file, &planted).unwrap();
    let unknown = our_root.join("notes.txt");
    fs::write(&unknown, b"keep me").unwrap();

    let (store, recovery, _) = open_as(dir.path(), ours.clone(), GIB, true);
    assert_eq!((recovery.entries, recovery.skipped_foreign, recovery.removed_corrupt), (0, 1, 0));
    assert!(store.lookup(1, |_, _| 1).is_none());
    store.store(&snap(1, &tokens, run(&model, &tokens), None)).unwrap();
    assert_eq!(store.clear().unwrap(), 1);
    assert_eq!(store.entries(), 0);
    drop(store);

    assert!(planted.exists() && unknown.exists());
    assert_eq!(fs::read(&their_file).unwrap(), their_bytes);
    assert_eq!(entry_files(&dir.path().join(theirs.fingerprint())), vec![their_file]);
    let (_, recovery, _) = open_as(dir.path(), ours, GIB, false);
    assert_eq!((recovery.entries, recovery.skipped_foreign), (0, 1));
}

#[test]
fn a_failed_write_leaves_the_index_and_disk_clean() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(DType::F32);
    let tokens: Vec<u32> = (1..=5).collect();
    let (store, _, _) = open(dir.path(), GIB, false);
    store.store(&snap(1, &tokens, run(&model, &tokens), None)).unwrap();
    let before = (store.entries(), store.bytes(), entry_files(dir.path()));

    // Namespace 5's folder is a regular file, so the entry cannot be created.
    let blocked = dir.path().join(identity("tiny-a").fingerprint()).join(format!("{:016x}", 5));
    fs::write(&blocked, b"not a folder").unwrap();
    let err = store.store(&snap(5, &tokens, run(&model, &tokens), None)).unwrap_err();
    assert!(matches!(err, SsdError::Unsafe { .. }) && err.to_string().contains(&*blocked.to_string_lossy()), "{err}");
    assert_eq!((store.entries(), store.bytes(), entry_files(dir.path())), before);
    assert!(no_tmp_left(dir.path()));

    assert!(store.lookup(5, exact(&tokens)).is_none());
    let hit = store.lookup(1, exact(&tokens)).unwrap();
    store.load(&hit, &model.new_state(1).unwrap()).unwrap();
}

#[test]
fn byte_cap_evicts_least_recently_used() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(DType::F32);
    let tokens = |first: u32| -> Vec<u32> { (first..first + 5).collect() };
    let entry = |first: u32| snap(1, &tokens(first), run(&model, &tokens(first)), None);
    let size = {
        let scratch = tempfile::tempdir().unwrap();
        let (store, _, _) = open(scratch.path(), GIB, false);
        store.store(&entry(10)).unwrap();
        store.bytes()
    };
    let cap = 3 * size + size / 2;

    let (store, _, stats) = open(dir.path(), cap, false);
    let [a, b, c] = [10, 20, 30].map(|first| store_one(dir.path(), &store, &entry(first)));
    // Reading `a` makes it the most recently used, so `b` is the oldest now.
    store.load(&store.lookup(1, exact(&five(10))).unwrap(), &model.new_state(1).unwrap()).unwrap();
    let d = store_one(dir.path(), &store, &entry(40));
    assert!(!b.exists() && a.exists() && c.exists() && d.exists());
    assert_eq!((store.entries(), store.bytes()), (3, 3 * size));
    assert_eq!((stats.ssd_evictions.load(Relaxed), stats.ssd_bytes.load(Relaxed)), (1, 3 * size));
    assert!(store.lookup(1, exact(&tokens(20))).is_none());
    drop(store);

    // The order lives in the files' mtimes, so it survives a restart: `c` goes next.
    let (store, _, _) = open(dir.path(), cap, false);
    store_one(dir.path(), &store, &entry(50));
    assert!(!c.exists() && a.exists() && d.exists());

    // An entry larger than the whole cap is not stored, and evicts nothing.
    let small = tempfile::tempdir().unwrap();
    let (store, _, stats) = open(small.path(), size - 1, false);
    assert!(!store.store(&entry(10)).unwrap());
    assert_eq!((store.entries(), stats.ssd_writes.load(Relaxed)), (0, 0));
    assert!(files(small.path()).is_empty());
}

#[test]
fn superseding_keeps_only_what_a_newer_entry_cannot_serve() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(DType::F32);
    let (store, _, _) = open(dir.path(), GIB, false);
    let short: Vec<u32> = (1..=5).collect();
    let long: Vec<u32> = (1..=8).collect();

    // An exact duplicate replaces the older file.
    let first = store_one(dir.path(), &store, &snap(1, &short, run(&model, &short), None));
    let second = store_one(dir.path(), &store, &snap(1, &short, run(&model, &short), None));
    assert!(!first.exists() && second.exists());
    assert_eq!(store.entries(), 1);

    // A longer untrimmable entry cannot serve its ancestor's prompts: both stay.
    store_one(dir.path(), &store, &snap(1, &long, run(&model, &long), None));
    assert!(second.exists());
    assert_eq!(store.entries(), 2);

    // A longer trimmable entry serves every prefix the shorter one did: it replaces it.
    let kv_short = store_one(dir.path(), &store, &snap(2, &short, kv_state(5), None));
    store_one(dir.path(), &store, &snap(2, &long, kv_state(8), None));
    assert!(!kv_short.exists());
    assert_eq!(store.entries(), 3);
}

#[test]
fn a_checkpoint_replaces_older_checkpoints_of_its_generation_once_written() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(DType::F32);
    let (store, _, stats) = open(dir.path(), GIB, false);
    let generation: Vec<u32> = (1..=20).collect();
    let checkpoint = |n: usize| {
        let resume = Resume { prompt_len: 6, next_token: generation[n] };
        snap(9, &generation[..n], run(&model, &generation[..n]), Some(resume))
    };
    let prompt_entry = store_one(dir.path(), &store, &snap(9, &generation[..6], run(&model, &generation[..6]), None));
    let older = store_one(dir.path(), &store, &checkpoint(8));
    let branch: Vec<u32> = [&generation[..6], &[100, 101]].concat();
    let resume = Resume { prompt_len: 6, next_token: 102 };
    let other_branch = store_one(dir.path(), &store, &snap(9, &branch, run(&model, &branch), Some(resume)));

    // While the newer checkpoint cannot be written, the older one stays served.
    let ns_dir = older.parent().unwrap().to_path_buf();
    let aside = ns_dir.with_extension("aside");
    fs::rename(&ns_dir, &aside).unwrap();
    fs::write(&ns_dir, b"").unwrap();
    assert!(store.store(&checkpoint(12)).is_err());
    assert_eq!(store.entries(), 3);
    fs::remove_file(&ns_dir).unwrap();
    fs::rename(&aside, &ns_dir).unwrap();
    let hit = store.lookup(9, exact(&generation[..8])).unwrap();
    assert_eq!(store.load(&hit, &model.new_state(1).unwrap()).unwrap().resume.unwrap().next_token, generation[8]);

    // Once written, it replaces the older checkpoint, not the prompt entry nor another branch.
    let newer = store_one(dir.path(), &store, &checkpoint(12));
    assert!(!older.exists());
    assert!(newer.exists() && prompt_entry.exists() && other_branch.exists());
    assert_eq!(store.entries(), 3);
    assert_eq!(stats.checkpoints_written.load(Relaxed), 3);
}

#[test]
fn writer_flushes_on_shutdown_and_counts_failures() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _, stats) = open(dir.path(), GIB, false);
    let writer = SsdWriter::spawn(Arc::new(store), 64, stats.clone());
    // Namespace 6 cannot be written: its folder is a regular file.
    fs::write(dir.path().join(identity("tiny-a").fingerprint()).join(format!("{:016x}", 6)), b"").unwrap();
    assert!(writer.enqueue(snap(6, &[1, 2, 3], kv_state(3), None)));
    for i in 0..20 {
        assert!(writer.enqueue(snap(4, &[100 + i, 1, 2], kv_state(3), None)));
    }
    assert!(writer.enqueue(snap(6, &[4, 5, 6], kv_state(3), None)));

    assert_eq!(writer.shutdown(Duration::from_secs(60)), 0);
    assert_eq!(entry_files(dir.path()).len(), 20);
    assert_eq!(writer.store().entries(), 20);
    assert_eq!((stats.ssd_writes.load(Relaxed), stats.ssd_write_failures.load(Relaxed)), (20, 2));
    assert!(no_tmp_left(dir.path()));

    // Shut down once is shut down: new work is refused, not counted as dropped.
    assert_eq!(writer.shutdown(Duration::from_secs(1)), 0);
    assert!(!writer.enqueue(snap(4, &[1], kv_state(1), None)));
    assert_eq!(stats.ssd_writes_dropped.load(Relaxed), 0);
}

#[test]
fn writer_drops_and_counts_what_a_full_queue_cannot_take() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _, stats) = open(dir.path(), GIB, false);
    let writer = SsdWriter::spawn(Arc::new(store), 2, stats.clone());
    // Enqueueing takes microseconds, each write at least an fsync: the queue of two overflows.
    let accepted = (0..200u32).filter(|&i| writer.enqueue(snap(4, &[1000 + i], kv_state(1), None))).count();
    let dropped = 200 - accepted;
    assert!(dropped > 0 && accepted >= 2, "accepted {accepted}");
    assert_eq!(stats.ssd_writes_dropped.load(Relaxed), dropped as u64);
    assert_eq!(writer.shutdown(Duration::from_secs(60)), 0);
    assert_eq!(writer.store().entries(), accepted);
    assert_eq!(entry_files(dir.path()).len(), accepted);
}

/// Opens the store on another thread and gives up after a while: a startup that blocks (in
/// `open` of a FIFO, say) fails the test instead of hanging it.
fn open_within_seconds(dir: &Path, seconds: u64) -> Result<(SsdStore, Recovery), SsdError> {
    let (done, result) = mpsc::channel();
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        let stats = Arc::new(CacheStats::default());
        let _ = done.send(SsdStore::open(SsdOptions { dir, max_bytes: GIB, verify: false }, identity("tiny-a"), stats));
    });
    result.recv_timeout(Duration::from_secs(seconds)).expect("opening the SSD cache hung")
}

fn mkfifo(path: &Path) {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
}

/// Nothing but regular files is opened or deleted: a FIFO, a socket and a folder named like
/// entries and `.tmp` files are skipped (without blocking) and left where they are.
#[test]
fn entries_that_are_not_regular_files_are_skipped_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (1..=4).collect();
    let ns = {
        let (store, _, _) = open(dir.path(), GIB, false);
        store_one(dir.path(), &store, &snap(1, &tokens, kv_state(4), None)).parent().unwrap().to_path_buf()
    };
    let (fifo, fifo_tmp) = (ns.join("x.entry"), ns.join("y.entry.tmp"));
    mkfifo(&fifo);
    mkfifo(&fifo_tmp);
    let _socket = UnixListener::bind(ns.join("s.entry")).unwrap();
    fs::create_dir(ns.join("d.entry")).unwrap();
    fs::create_dir(ns.join("d.entry.tmp")).unwrap();

    let (store, recovery) = open_within_seconds(dir.path(), 20).unwrap();
    assert_eq!((recovery.entries, recovery.skipped_unsafe, recovery.removed_corrupt, recovery.reaped_tmp), (1, 5, 0, 0));
    for name in ["x.entry", "y.entry.tmp", "s.entry", "d.entry", "d.entry.tmp"] {
        assert!(fs::symlink_metadata(ns.join(name)).is_ok(), "{name} was deleted");
    }
    let hit = store.lookup(1, exact(&tokens)).unwrap();
    store.load(&hit, &kv_template()).unwrap();
    assert_eq!(store.clear().unwrap(), 1);
    assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());

    // An indexed entry replaced by a FIFO after startup is refused when read, not waited on.
    let (store, _, stats) = open(dir.path(), GIB, false);
    let entry = store_one(dir.path(), &store, &snap(1, &tokens, kv_state(4), None));
    let hit = store.lookup(1, exact(&tokens)).unwrap();
    fs::remove_file(&entry).unwrap();
    mkfifo(&entry);
    let err = store.load(&hit, &kv_template()).unwrap_err();
    assert!(matches!(err, SsdError::Unsafe { .. }) && err.to_string().contains("FIFO"), "{err}");
    assert_eq!((stats.ssd_restore_failures.load(Relaxed), store.entries()), (1, 0));
    assert!(fs::symlink_metadata(&entry).unwrap().file_type().is_fifo(), "the FIFO is not ours to delete");
}

/// Snapshot of every file below `dir` with its bytes, links included as links.
fn contents(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    files(dir).into_iter().map(|p| (p.clone(), fs::read(&p).unwrap())).collect()
}

/// A namespace folder (or the identity's folder) that links outside the cache is never followed:
/// the entry and `.tmp` files out there survive startup, and nothing is written through it.
#[test]
fn a_symlinked_folder_is_never_followed_out_of_the_cache() {
    let (dir, outside) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    fs::write(outside.path().join("victim.entry"), b"not an entry, and not ours").unwrap();
    fs::write(outside.path().join("victim.entry.tmp"), b"not ours either").unwrap();
    let before = contents(outside.path());

    let root = dir.path().join(identity("tiny-a").fingerprint());
    fs::create_dir_all(&root).unwrap();
    symlink(outside.path(), root.join(format!("{:016x}", 1))).unwrap();
    let (store, recovery) = open_within_seconds(dir.path(), 20).unwrap();
    assert_eq!((recovery.entries, recovery.skipped_unsafe, recovery.removed_corrupt, recovery.reaped_tmp), (0, 1, 0, 0));
    assert_eq!(contents(outside.path()), before);

    let err = store.store(&snap(1, &[1, 2, 3], kv_state(3), None)).unwrap_err();
    assert!(matches!(err, SsdError::Unsafe { .. }) && err.to_string().contains("symbolic link"), "{err}");
    assert_eq!(contents(outside.path()), before);
    assert_eq!(store.entries(), 0);
    drop(store);

    // The identity's own folder as a link: refused at startup, with a message naming it.
    fs::remove_dir_all(&root).unwrap();
    symlink(outside.path(), &root).unwrap();
    let err = open_within_seconds(dir.path(), 20).err().expect("a linked identity folder is refused");
    assert!(matches!(err, SsdError::Unsafe { .. }) && err.to_string().contains(&*root.to_string_lossy()), "{err}");
    assert_eq!(contents(outside.path()), before);
}

/// Entry and `.tmp` files that are links are neither served nor deleted, even when they point
/// at a valid entry of ours.
#[test]
fn a_symlinked_entry_file_is_neither_served_nor_deleted() {
    let (dir, outside) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let tokens: Vec<u32> = (1..=4).collect();
    let valid = {
        let (store, _, _) = open(outside.path(), GIB, false);
        store_one(outside.path(), &store, &snap(1, &tokens, kv_state(4), None))
    };
    let garbage = outside.path().join("garbage");
    fs::write(&garbage, b"not an entry").unwrap();
    let before = contents(outside.path());

    let ns = dir.path().join(identity("tiny-a").fingerprint()).join(format!("{:016x}", 1));
    fs::create_dir_all(&ns).unwrap();
    let links = [(ns.join("valid.entry"), &valid), (ns.join("garbage.entry"), &garbage), (ns.join("g.entry.tmp"), &garbage)];
    for (link, target) in &links {
        symlink(target, link).unwrap();
    }
    let (store, recovery) = open_within_seconds(dir.path(), 20).unwrap();
    assert_eq!((recovery.entries, recovery.skipped_unsafe, recovery.removed_corrupt, recovery.reaped_tmp), (0, 3, 0, 0));
    assert!(store.lookup(1, |_, _| 1).is_none());
    for (link, _) in &links {
        assert!(fs::symlink_metadata(link).unwrap().file_type().is_symlink(), "{} was deleted", link.display());
    }
    assert_eq!(contents(outside.path()), before);
}
