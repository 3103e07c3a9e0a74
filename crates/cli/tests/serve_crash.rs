//! `strata serve` with an SSD cache survives `kill -9`: killed while requests run and entries
//! are being written, with debris planted in its cache folder, it starts again, serves the
//! same output as a cold server, keeps another model's files, and reports what it dropped.
//! And SIGTERM ends it within its shutdown timeout even while a stream is open, with the
//! stream's proper ending.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use serde_json::{json, Value};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5-tiny-a")
}

struct Server {
    child: Child,
    url: String,
}

impl Server {
    /// Starts the server on a free port and waits until it listens.
    fn start(ssd: &Path) -> Server {
        let (child, url, _) = common::start_server(
            Command::new(env!("CARGO_BIN_EXE_strata"))
                .args(["serve", "--port", "0", "--cache-stride", "8", "--prefill-chunk", "8", "--checkpoint-every", "2"])
                .arg("--model")
                .arg(fixture())
                .arg("--ssd-cache")
                .arg(ssd),
        );
        Server { child, url }
    }

    fn post(&self, path: &str, body: &Value) -> Value {
        ureq::post(&format!("{}{path}", self.url)).send_json(body.clone()).unwrap().into_json().unwrap()
    }

    fn get(&self, path: &str) -> Value {
        ureq::get(&format!("{}{path}", self.url)).call().unwrap().into_json().unwrap()
    }

    /// SIGKILL: no shutdown code runs.
    fn kill(self) {}
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every file under `dir`, recursively.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries.flatten().map(|e| e.path()).flat_map(|p| if p.is_dir() { walk(&p) } else { vec![p] }).collect()
}

fn completion(prompt: &[u32], max_tokens: usize) -> Value {
    json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

#[test]
fn killed_server_restarts_and_serves_the_right_state() {
    let ssd = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 500).collect();

    let server = Server::start(ssd.path());
    let cold = server.post("/v1/completions", &completion(&prompt, 12));
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The cold run's entries reach the disk behind its answer (the write-behind queue): what the
    // restarted server must find is on disk before the kill, however slow this machine is.
    let written = |dir: &Path| walk(dir).iter().any(|p| p.extension().is_some_and(|e| e == "entry"));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !written(ssd.path()) {
        assert!(std::time::Instant::now() < deadline, "the cold run's entries were never written");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Requests in flight (each writing snapshots and checkpoints) when the kill comes.
    let url = server.url.clone();
    let busy: Vec<_> = (0..4)
        .map(|i| {
            let url = url.clone();
            let p: Vec<u32> = (0..60).map(|t| (t * 13 + i * 101) % 500).collect();
            std::thread::spawn(move || {
                let _ = ureq::post(&format!("{url}/v1/completions")).send_json(completion(&p, 64));
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    server.kill();
    busy.into_iter().for_each(|t| drop(t.join()));

    // Debris of other crashes, and another model's entries, in the folder.
    // Found through an entry the cold run wrote (the folder may hold others by now).
    let entry = walk(ssd.path()).into_iter().find(|p| p.extension().is_some_and(|e| e == "entry")).expect("an entry");
    let namespace = entry.parent().unwrap().to_path_buf();
    let own = namespace.parent().unwrap().to_path_buf();
    std::fs::write(namespace.join("0123456789abcdef0123456789abcdef.entry.tmp"), b"half a write").unwrap();
    // Our format's magic and version, then damage (a file of another version would be kept).
    std::fs::write(namespace.join("fedcba9876543210fedcba9876543210.entry"), b"STRATAKV\x01\0\0\0truncated").unwrap();
    let foreign = ssd.path().join("0000000000000000/0000000000000000/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa.entry");
    std::fs::create_dir_all(foreign.parent().unwrap()).unwrap();
    std::fs::write(&foreign, b"another model's entry").unwrap();
    // A FIFO named like an entry (opening it would block startup for ever), and a namespace
    // folder that links outside the cache, to an entry and a `.tmp` file strata did not write.
    assert!(Command::new("mkfifo").arg(namespace.join("x.entry")).status().unwrap().success());
    let outside = tempfile::tempdir().unwrap();
    let victims = [outside.path().join("victim.entry"), outside.path().join("victim.entry.tmp")];
    victims.iter().for_each(|victim| std::fs::write(victim, b"not strata's").unwrap());
    std::os::unix::fs::symlink(outside.path(), own.join("00000000000000aa")).unwrap();

    let server = Server::start(ssd.path());
    let recovered = &server.get("/stats")["prompt_cache"]["ssd"]["recovered"];
    assert!(recovered["reaped_tmp"].as_u64().unwrap() >= 1, "{recovered}");
    assert!(recovered["removed_corrupt"].as_u64().unwrap() >= 1, "{recovered}");
    assert_eq!(recovered["skipped_unsafe"], 2, "{recovered}");
    assert!(victims.iter().all(|victim| victim.exists()), "nothing outside the cache folder is deleted");
    let warm = server.post("/v1/completions", &completion(&prompt, 12));
    assert_eq!(warm["choices"][0]["text"], cold["choices"][0]["text"], "the restarted server serves the cold run's output");
    // Served from the SSD tier: the prompt entry (all but the last token) or, as this greedy
    // request was checkpointed, its finished generation's last checkpoint (the whole prompt).
    let cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= 39, "{cached} cached tokens");
    let ssd = &server.get("/stats")["prompt_cache"]["ssd"];
    assert_eq!(ssd["hits"].as_u64().unwrap() + ssd["checkpoint_resumes"].as_u64().unwrap(), 1, "{ssd}");
    // Flushing the SSD tier removes this model's entries only.
    let flushed = ureq::post(&format!("{}/admin/cache/flush", server.url)).send_string(r#"{"ssd": true}"#).unwrap();
    let flushed: Value = flushed.into_json().unwrap();
    assert!(flushed["flushed"]["ssd_entries"].as_u64().unwrap() > 0);
    assert!(foreign.exists(), "another model's files are never deleted");
    server.kill();
}

/// And the stream cut gets a proper end: its last chunk with a finish reason, `data: [DONE]`,
/// and a terminated chunked body (which the client's reader checks).
#[test]
fn sigterm_ends_the_server_within_its_timeout_while_a_stream_runs() {
    let (child, url, _) = common::start_server(
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["serve", "--port", "0", "--shutdown-timeout", "1", "--max-context", "100000", "--model"])
            .arg(fixture()),
    );
    let mut server = Server { child, url };
    // A stream that would run for 50000 tokens: the fixture's end-of-sequence ids are banned.
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 50_000, "temperature": 0, "stream": true,
                      "logit_bias": {"0": -100, "2": -100}});
    let stream = ureq::post(&format!("{}/v1/completions", server.url)).send_json(body).unwrap();
    let mut reader = std::io::BufReader::new(stream.into_reader());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut reader, &mut first).unwrap();
    assert!(first.starts_with("data: "), "{first}");

    let started = std::time::Instant::now();
    assert!(Command::new("kill").args(["-TERM", &server.child.id().to_string()]).status().unwrap().success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut reader, &mut rest).expect("a whole chunked body");
    let events: Vec<&str> = rest.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{rest}");
    let last: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{rest}");
    while server.child.try_wait().unwrap().is_none() {
        assert!(started.elapsed() < Duration::from_secs(15), "still running 15 s after SIGTERM with --shutdown-timeout 1");
        std::thread::sleep(Duration::from_millis(20));
    }
    // It waited for the stream (about the timeout), then ended it.
    assert!(started.elapsed() >= Duration::from_millis(900), "exited after {:?}", started.elapsed());
}
