//! `strata serve` facing slow and unknown clients: its connection flags reach the server, bad
//! values are refused, `/health` answers under a low open-file limit with slow connections
//! holding most of it, and `/stats` shows no paths to clients without the API key.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5-tiny-a")
}

struct Server {
    child: Child,
    url: String,
}

impl Server {
    /// `strata serve` on the fixture with `args`, through `sh` so that `shell` (e.g. a ulimit)
    /// applies to it.
    fn start(shell: &str, args: &[&str]) -> Server {
        let script = format!("{shell} exec \"$0\" \"$@\"");
        let mut command = Command::new("sh");
        command.args(["-c", &script, env!("CARGO_BIN_EXE_strata"), "serve", "--port", "0", "--model"]).arg(fixture()).args(args);
        let (child, url, _) = common::start_server(&mut command);
        Server { child, url }
    }

    fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(self.url.trim_start_matches("http://")).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        stream
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads until the server closes the connection; what it sent, and how long that took.
fn read_until_closed(stream: &mut TcpStream) -> (String, Duration) {
    let started = Instant::now();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    (String::from_utf8_lossy(&answer).into_owned(), started.elapsed())
}

#[test]
fn the_connection_flags_reach_the_server() {
    let server = Server::start("", &["--header-read-timeout", "1", "--keep-alive-timeout", "1.5", "--body-read-timeout", "1"]);
    // A header that never ends.
    let mut slow = server.connect();
    slow.write_all(b"GET /health HTTP/1.1\r\nhost: strata\r\nx-slow: ").unwrap();
    let (answer, after) = read_until_closed(&mut slow);
    assert!(answer.is_empty() && after >= Duration::from_millis(900) && after < Duration::from_secs(4), "{after:?}: {answer}");
    // An idle connection after its response.
    let mut idle = server.connect();
    idle.write_all(b"GET /health HTTP/1.1\r\nhost: strata\r\n\r\n").unwrap();
    let (answer, after) = read_until_closed(&mut idle);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(after >= Duration::from_millis(1400) && after < Duration::from_secs(5), "{after:?}");
    // A body that never ends.
    let mut trickle = server.connect();
    trickle.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: strata\r\ncontent-length: 20\r\n\r\n{").unwrap();
    let (answer, after) = read_until_closed(&mut trickle);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(after >= Duration::from_millis(900) && after < Duration::from_secs(4), "{after:?}");
}

#[test]
fn bad_connection_flags_are_refused() {
    for (flag, value) in [
        ("--header-read-timeout", "0"),
        ("--body-read-timeout", "0"),
        ("--keep-alive-timeout", "-1"),
        ("--header-read-timeout", "inf"),
        ("--max-connections", "0"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_strata")).args(["serve", &format!("{flag}={value}")]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(err.contains(flag) && err.contains(value) && !err.contains("panicked"), "{err}");
    }
}

/// The issue's case: 295 sockets sending a header byte now and then starved `/health` of file
/// descriptors under `ulimit -n 300`. The default connection cap (half the limit) keeps room,
/// and at the cap new connections replace the oldest of those still sending a header.
#[test]
fn health_answers_under_a_low_open_file_limit_while_slow_connections_pile_up() {
    let server = Server::start("ulimit -n 300 &&", &[]);
    let mut slow = Vec::new();
    for _ in 0..400 {
        let mut s = server.connect();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: strata\r\nx-slow: ").unwrap();
        slow.push(s);
    }
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    let mut health = server.connect();
    health.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    health.write_all(b"GET /health HTTP/1.1\r\nhost: strata\r\nconnection: close\r\n\r\n").unwrap();
    let (answer, _) = read_until_closed(&mut health);
    assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with(r#"{"status":"ok"}"#), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
}

/// With `--api-key`, `/stats` names no file to a client without the key: not the model's
/// folder (given as a path) nor the SSD cache's.
#[test]
fn stats_shows_paths_only_with_the_api_key() {
    let ssd = tempfile::tempdir().unwrap();
    let ssd_path = ssd.path().to_str().unwrap().to_string();
    let server = Server::start("", &["--api-key", "sekrit", "--ssd-cache", &ssd_path]);
    let stats = |authorization: Option<&str>| {
        let mut request = ureq::get(&format!("{}/stats", server.url));
        if let Some(value) = authorization {
            request = request.set("authorization", value);
        }
        request.call().unwrap().into_string().unwrap()
    };
    let fixture = fixture().to_str().unwrap().to_string();
    let open = stats(None);
    assert!(open.contains("\"generated_tokens\"") && open.contains("\"ssd\""), "{open}");
    assert!(!open.contains(&ssd_path) && !open.contains(&fixture), "{open}");
    for key in ["Bearer sekrit", "bearer sekrit"] {
        let full = stats(Some(key));
        assert!(full.contains(&ssd_path) && full.contains(&fixture), "{full}");
    }
}
