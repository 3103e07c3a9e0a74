//! Stored responses, for `GET /v1/responses/{id}` and `previous_response_id`: each response with
//! the conversation that led to it, bounded in count and bytes, the least recently used dropped
//! first. Opened on a folder (`--ssd-cache`'s `responses/`), each is also a file there,
//! `resp_<hex>.json`, written to a temporary name and renamed (a crash leaves the old file or
//! the new one, never half of one), so a restart keeps them; a file's modification time is its
//! last use, so the use order survives too.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use serde_json::Value;

pub struct ResponseStore {
    max_entries: usize,
    max_bytes: usize,
    dir: Option<PathBuf>,
    index: Mutex<Index>,
}

#[derive(Default)]
struct Index {
    /// Id → the stored record's JSON text and its last use.
    entries: HashMap<String, (Arc<str>, u64)>,
    /// Last use → id: the least recently used first.
    order: BTreeMap<u64, String>,
    bytes: usize,
    clock: u64,
}

impl Index {
    /// Adds (or replaces) an entry as the most recently used; returns the ids dropped to keep
    /// within the limits.
    fn insert(&mut self, id: &str, text: Arc<str>, max_entries: usize, max_bytes: usize) -> Vec<String> {
        self.remove(id);
        self.clock += 1;
        self.bytes += text.len();
        self.order.insert(self.clock, id.to_string());
        self.entries.insert(id.to_string(), (text, self.clock));
        let mut dropped = Vec::new();
        while self.entries.len() > max_entries || self.bytes > max_bytes {
            let Some((_, oldest)) = self.order.pop_first() else { break };
            if let Some((text, _)) = self.entries.remove(&oldest) {
                self.bytes -= text.len();
            }
            dropped.push(oldest);
        }
        dropped
    }

    fn remove(&mut self, id: &str) -> bool {
        let Some((text, used)) = self.entries.remove(id) else { return false };
        self.bytes -= text.len();
        self.order.remove(&used);
        true
    }

    /// The entry's text, marked as just used.
    fn touch(&mut self, id: &str) -> Option<Arc<str>> {
        let (text, used) = self.entries.get_mut(id)?;
        self.order.remove(used);
        self.clock += 1;
        *used = self.clock;
        self.order.insert(self.clock, id.to_string());
        Some(text.clone())
    }
}

/// Whether `id` is one of ours (`resp_` and hex digits): only such names become paths.
fn is_response_id(id: &str) -> bool {
    id.strip_prefix("resp_").is_some_and(|hex| !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl Default for ResponseStore {
    fn default() -> Self {
        Self::in_memory(Self::DEFAULT_ENTRIES, Self::DEFAULT_BYTES)
    }
}

impl ResponseStore {
    pub const DEFAULT_ENTRIES: usize = 10_000;
    pub const DEFAULT_BYTES: usize = 256 << 20;

    /// A store that a restart empties.
    pub fn in_memory(max_entries: usize, max_bytes: usize) -> Self {
        Self { max_entries, max_bytes, dir: None, index: Mutex::default() }
    }

    /// A store kept in `dir` (created if needed), loaded with the responses stored there. Files
    /// past the limits are removed, the least recently used first, and so are a write's leftover
    /// temporary files and files that do not parse; other names are left alone.
    pub fn open(dir: &Path, max_entries: usize, max_bytes: usize) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let store = Self { max_entries, max_bytes, dir: Some(dir.to_path_buf()), index: Mutex::default() };
        let mut found = Vec::new();
        for entry in fs::read_dir(dir)? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if name.strip_suffix(".json.tmp").is_some_and(is_response_id) {
                let _ = fs::remove_file(&path);
                continue;
            }
            let Some(id) = name.strip_suffix(".json").filter(|id| is_response_id(id)) else { continue };
            let text = fs::read_to_string(&path)
                .ok()
                .filter(|t| serde_json::from_str::<Value>(t).is_ok_and(|v| v["response"].is_object()));
            let Some(text) = text else {
                tracing::warn!(file = %path.display(), "removing a stored response that does not parse");
                let _ = fs::remove_file(&path);
                continue;
            };
            let used = fs::metadata(&path).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
            found.push((used, id.to_string(), text));
        }
        found.sort();
        for (_, id, text) in found {
            let dropped = store.index().insert(&id, text.into(), max_entries, max_bytes);
            store.remove_files(&dropped);
        }
        Ok(store)
    }

    fn index(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn len(&self) -> usize {
        self.index().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn file(&self, id: &str) -> Option<PathBuf> {
        Some(self.dir.as_ref()?.join(format!("{id}.json")))
    }

    fn remove_files(&self, ids: &[String]) {
        for path in ids.iter().filter_map(|id| self.file(id)) {
            let _ = fs::remove_file(path);
        }
    }

    /// Keeps `record` (`{"response", "input"}`) under `id`, a response id of ours. One larger than
    /// the byte limit is not kept; a failed file write keeps it in memory only (both logged).
    pub(crate) fn put(&self, id: &str, record: &Value) {
        debug_assert!(is_response_id(id));
        let text = record.to_string();
        if self.max_entries == 0 || text.len() > self.max_bytes {
            tracing::warn!(id, bytes = text.len(), "response not stored: larger than --response-store-bytes");
            return;
        }
        if let Some(path) = self.file(id) {
            let tmp = path.with_extension("json.tmp");
            if let Err(e) = fs::write(&tmp, &text).and_then(|()| fs::rename(&tmp, &path)) {
                let _ = fs::remove_file(&tmp);
                tracing::warn!(id, error = %e, "cannot write a stored response to disk; it is kept in memory only");
            }
        }
        let dropped = self.index().insert(id, text.into(), self.max_entries, self.max_bytes);
        self.remove_files(&dropped);
    }

    /// The record stored under `id`, now the most recently used.
    pub(crate) fn get(&self, id: &str) -> Option<Value> {
        let text = self.index().touch(id)?;
        if let Some(path) = self.file(id) {
            // The file's time is its last use, for the order after a restart.
            let _ = fs::File::options().write(true).open(path).and_then(|f| f.set_modified(SystemTime::now()));
        }
        serde_json::from_str(&text).ok()
    }

    /// Forgets `id`; false when it was not stored.
    pub(crate) fn delete(&self, id: &str) -> bool {
        let removed = self.index().remove(id);
        if removed {
            self.remove_files(&[id.to_string()]);
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn record(n: usize) -> Value {
        json!({"response": {"id": format!("resp_{n:x}")}, "input": ["x".repeat(n)]})
    }

    #[test]
    fn least_recently_used_go_first_by_count_and_bytes() {
        let store = ResponseStore::in_memory(2, 1 << 20);
        store.put("resp_1", &record(1));
        store.put("resp_2", &record(2));
        assert!(store.get("resp_1").is_some(), "a use makes resp_1 the newest");
        store.put("resp_3", &record(3));
        assert!(store.get("resp_2").is_none());
        assert_eq!(store.get("resp_1"), Some(record(1)));
        assert_eq!(store.len(), 2);

        let size = record(100).to_string().len();
        let store = ResponseStore::in_memory(100, 2 * size + 10);
        for id in ["resp_a", "resp_b", "resp_c"] {
            store.put(id, &record(100));
        }
        assert!(store.get("resp_a").is_none() && store.get("resp_b").is_some() && store.get("resp_c").is_some());
        store.put("resp_d", &record(10 * size));
        assert!(store.get("resp_d").is_none(), "a record over the byte limit is not kept");
        assert_eq!(store.len(), 2, "nor does it push others out");
        assert!(store.delete("resp_b") && !store.delete("resp_b"));
        assert!(store.get("resp_b").is_none());
    }

    #[test]
    fn a_folder_keeps_responses_and_their_use_order_across_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let store = ResponseStore::open(dir.path(), 2, 1 << 20).unwrap();
        store.put("resp_1", &record(1));
        store.put("resp_2", &record(2));
        std::thread::sleep(std::time::Duration::from_millis(20));
        store.get("resp_1");
        store.put("resp_3", &record(3));
        store.delete("resp_3");
        // Leftovers of an interrupted write and a damaged file go; other files stay.
        fs::write(dir.path().join("resp_9.json.tmp"), "{").unwrap();
        fs::write(dir.path().join("resp_8.json"), "{\"resp").unwrap();
        fs::write(dir.path().join("notes.txt"), "mine").unwrap();
        drop(store);

        let store = ResponseStore::open(dir.path(), 2, 1 << 20).unwrap();
        assert_eq!(store.len(), 1, "resp_2 was pushed out by resp_3, which was deleted");
        assert_eq!(store.get("resp_1"), Some(record(1)));
        let mut names: Vec<String> =
            fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(names, ["notes.txt", "resp_1.json"]);

        // Reopened with a smaller limit, the least recently used go first.
        store.put("resp_4", &record(4));
        std::thread::sleep(std::time::Duration::from_millis(20));
        store.get("resp_1");
        drop(store);
        let store = ResponseStore::open(dir.path(), 1, 1 << 20).unwrap();
        assert!(store.get("resp_1").is_some() && store.get("resp_4").is_none());
        assert!(!dir.path().join("resp_4.json").exists());
    }
}
