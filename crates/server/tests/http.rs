//! The connection layer over real sockets, with raw HTTP/1.1 clients: header, body and
//! keep-alive timeouts, the body limit from `Content-Length`, the connection cap under slow
//! clients, and the endings a shutdown gives requests still running.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_server::{AppState, HttpLimits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

/// Serves `state` on a free port; dropping `stop` (or sending on it) begins the shutdown.
async fn start(state: AppState, drain: Duration) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(strata_server::serve(
        listener,
        state,
        async move {
            let _ = stopped.await;
        },
        drain,
    ));
    Server { addr, stop: Some(stop), task }
}

fn limits(change: impl FnOnce(&mut HttpLimits)) -> HttpLimits {
    let mut limits = HttpLimits::default();
    change(&mut limits);
    limits
}

fn request(method: &str, path: &str, body: &str, headers: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nhost: strata\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{headers}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

struct Response {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Response {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
}

/// One whole response at the start of `buf` (a body by `content-length`, or chunked up to its
/// terminating chunk), and the bytes it took; None while it is incomplete.
fn parse_response(buf: &[u8]) -> Option<(Response, usize)> {
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8(buf[..head_end].to_vec()).unwrap().to_ascii_lowercase();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let header = |name: &str| head.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_string());
    let rest = &buf[head_end..];
    if header("transfer-encoding:").as_deref() == Some("chunked") {
        let (mut body, mut at) = (Vec::new(), 0);
        loop {
            let line_end = rest[at..].windows(2).position(|w| w == b"\r\n")? + at;
            let size = usize::from_str_radix(std::str::from_utf8(&rest[at..line_end]).unwrap().trim(), 16).unwrap();
            let data = line_end + 2;
            if rest.len() < data + size + 2 {
                return None;
            }
            assert_eq!(&rest[data + size..data + size + 2], b"\r\n", "a chunk not ended by CRLF");
            body.extend_from_slice(&rest[data..data + size]);
            at = data + size + 2;
            if size == 0 {
                return Some((Response { status, head, body }, head_end + at));
            }
        }
    }
    let length: usize = header("content-length:").map_or(0, |v| v.parse().unwrap());
    (rest.len() >= length).then(|| (Response { status, head, body: rest[..length].to_vec() }, head_end + length))
}

/// Reads one whole response, failing if it does not come within `within`.
async fn read_response(stream: &mut TcpStream, within: Duration) -> Response {
    let mut buf = Vec::new();
    let read = async {
        loop {
            if let Some((response, used)) = parse_response(&buf) {
                assert_eq!(used, buf.len(), "bytes after the response");
                return response;
            }
            let mut chunk = [0u8; 4096];
            let n = stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed before a whole response: {}", String::from_utf8_lossy(&buf));
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(within, read).await.expect("no whole response in time")
}

/// Reads until the server closes the connection; what it sent, and when it closed.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> (Vec<u8>, Instant) {
    let mut buf = Vec::new();
    let read = async {
        loop {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return Instant::now(),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    let closed = tokio::time::timeout(within, read).await.expect("the connection is still open");
    (buf, closed)
}

async fn connect(server: &Server) -> TcpStream {
    TcpStream::connect(server.addr).await.unwrap()
}

/// A connection whose request header never ends: a header line's first bytes.
async fn slow_connection(server: &Server) -> TcpStream {
    let mut stream = connect(server).await;
    stream.write_all(b"GET /health HTTP/1.1\r\nhost: strata\r\nx-slow: ").await.unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread")]
async fn a_header_sent_a_byte_at_a_time_is_cut_at_the_header_timeout() {
    let http = limits(|l| l.header_read_timeout = Duration::from_secs(1));
    let server = start(common::state_limited(4096, http), Duration::ZERO).await;
    let started = Instant::now();
    let (mut reader, mut writer) = connect(&server).await.into_split();
    tokio::spawn(async move {
        for byte in b"GET /health HTTP/1.1\r\nhost: strata\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
            if writer.write_all(&[*byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), reader.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "still open after 5 s of a header trickling in");
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(3), "closed after {elapsed:?}");
    assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
}

/// The keep-alive wait is not header time: a connection idle for longer than the header
/// timeout is still served, and closed once idle for the keep-alive timeout.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_connection_is_closed_after_the_keep_alive_timeout() {
    let http = limits(|l| {
        l.header_read_timeout = Duration::from_secs(1);
        l.keep_alive_timeout = Duration::from_secs(2);
    });
    let server = start(common::state_limited(4096, http), Duration::ZERO).await;
    let mut stream = connect(&server).await;
    stream.write_all(&request("GET", "/health", "", "")).await.unwrap();
    assert_eq!(read_response(&mut stream, Duration::from_secs(2)).await.status, 200);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stream.write_all(&request("GET", "/health", "", "")).await.unwrap();
    assert_eq!(read_response(&mut stream, Duration::from_secs(2)).await.status, 200);
    let answered = Instant::now();
    let (rest, closed) = read_until_closed(&mut stream, Duration::from_secs(6)).await;
    assert!(rest.is_empty());
    let idle = closed - answered;
    assert!(idle >= Duration::from_millis(1900) && idle < Duration::from_secs(4), "closed after {idle:?} idle");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trickled_body_gets_a_408_in_its_dialect() {
    let http = limits(|l| l.body_read_timeout = Duration::from_secs(1));
    let server = start(common::state_limited(4096, http), Duration::ZERO).await;
    for (path, anthropic) in [("/v1/chat/completions", false), ("/v1/messages", true)] {
        let started = Instant::now();
        let (mut reader, mut writer) = connect(&server).await.into_split();
        let head =
            format!("POST {path} HTTP/1.1\r\nhost: strata\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n");
        writer.write_all(head.as_bytes()).await.unwrap();
        let trickle = tokio::spawn(async move {
            for _ in 0..100 {
                if writer.write_all(b" ").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), reader.read_to_end(&mut answer)).await.expect("no answer in 5 s").ok();
        let (response, _) = parse_response(&answer).unwrap_or_else(|| panic!("{}", String::from_utf8_lossy(&answer)));
        let elapsed = started.elapsed();
        assert_eq!(response.status, 408, "{path}");
        assert!(elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(3), "{path}: answered after {elapsed:?}");
        assert!(response.head.contains("connection: close"), "{}", response.head);
        let error = response.json();
        assert_eq!(error["type"] == "error", anthropic, "{path}: {error}");
        assert!(error["error"]["message"].as_str().unwrap().contains("did not arrive"), "{error}");
        trickle.abort();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_oversized_content_length_gets_a_413_before_its_body() {
    let server = start(common::state("qwen3_5-tiny-a", 4096, None), Duration::ZERO).await;
    let length = strata_server::MAX_BODY_BYTES + 1;
    for (path, kind) in [("/v1/completions", "invalid_request_error"), ("/v1/messages", "request_too_large")] {
        let mut stream = connect(&server).await;
        let head =
            format!("POST {path} HTTP/1.1\r\nhost: strata\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n");
        stream.write_all(head.as_bytes()).await.unwrap();
        let response = read_response(&mut stream, Duration::from_secs(1)).await;
        assert_eq!(response.status, 413, "{path}");
        let error = response.json();
        assert_eq!(error["error"]["type"], kind, "{error}");
        assert!(error["error"]["message"].as_str().unwrap().contains("larger than"), "{error}");
    }
}

/// 500 connections that never finish their header: with a connection cap below that (the
/// oldest idle ones make room), and with the default cap.
async fn health_answers_while_slow_connections_are_held(http: HttpLimits) {
    strata_server::raise_open_files_limit();
    let max = http.max_connections;
    let server = start(common::state_limited(4096, http), Duration::ZERO).await;
    let mut slow = Vec::new();
    for _ in 0..500 {
        slow.push(slow_connection(&server).await);
    }
    let started = Instant::now();
    let mut stream = connect(&server).await;
    stream.write_all(&request("GET", "/health", "", "")).await.unwrap();
    let response = read_response(&mut stream, Duration::from_secs(1)).await;
    assert_eq!((response.status, response.json()), (200, json!({"status": "ok"})));
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
    // Those still held, at most the cap (the first ones were closed to make room, if needed).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut open = 0;
    for s in &slow {
        let mut byte = [0u8; 1];
        if matches!(s.try_read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock) {
            open += 1;
        }
    }
    assert!(open <= max && open >= max.min(500) - 1, "{open} slow connections open with a cap of {max}");
}

#[tokio::test(flavor = "multi_thread")]
async fn health_answers_while_500_slow_connections_are_held_over_the_cap() {
    health_answers_while_slow_connections_are_held(limits(|l| l.max_connections = 50)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn health_answers_while_500_slow_connections_are_held_by_default() {
    strata_server::raise_open_files_limit();
    health_answers_while_slow_connections_are_held(HttpLimits::default()).await;
}

/// At the cap with every connection busy (here one reading a slow body), a new connection
/// waits until one ends.
#[tokio::test(flavor = "multi_thread")]
async fn new_connections_wait_while_every_held_one_is_busy() {
    let http = limits(|l| {
        l.max_connections = 1;
        l.body_read_timeout = Duration::from_secs(1);
    });
    let server = start(common::state_limited(4096, http), Duration::ZERO).await;
    let mut busy = connect(&server).await;
    let head = "POST /v1/completions HTTP/1.1\r\nhost: strata\r\ncontent-type: application/json\r\ncontent-length: 10\r\n\r\n{";
    busy.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let mut waiting = connect(&server).await;
    waiting.write_all(&request("GET", "/health", "", "")).await.unwrap();
    assert_eq!(read_response(&mut waiting, Duration::from_secs(4)).await.status, 200);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(700), "served after {waited:?}, before the busy connection ended");
    assert_eq!(read_response(&mut busy, Duration::from_secs(1)).await.status, 408);
}

/// A client that reads nothing of its stream is dropped at the send timeout, and its
/// generation cancelled.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_reads_nothing_is_dropped_at_the_send_timeout() {
    let state = common::state_limited(100_000, limits(|l| l.send_timeout = Duration::from_secs(1)));
    let stats = state.worker.stats();
    let no_end: serde_json::Map<String, Value> = state.eos_token_ids.iter().map(|id| (id.to_string(), json!(-100))).collect();
    let server = start(state.clone(), Duration::ZERO).await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(server.addr).await.unwrap();
    // Each token's chunk a few kilobytes, so the socket's buffers fill soon.
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50_000, "stream": true,
                      "logprobs": true, "top_logprobs": 20, "logit_bias": no_end});
    stream.write_all(&request("POST", "/v1/chat/completions", &body.to_string(), "")).await.unwrap();
    let started = Instant::now();
    while stats.cancelled.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        assert!(started.elapsed() < Duration::from_secs(30), "a client reading nothing still held after 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(started.elapsed() >= Duration::from_secs(1), "cancelled after {:?}", started.elapsed());
    let (sent, _) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    assert!(sent.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&sent));
}

/// Requests still running when a shutdown's wait runs out get their dialect's proper ending:
/// streams their last events and a terminated chunked body, whole answers a 503.
#[tokio::test(flavor = "multi_thread")]
async fn a_shutdown_ends_running_requests_properly() {
    let state = common::state("qwen3_5-tiny-a", 100_000, None);
    let stats = state.worker.stats();
    let no_end: serde_json::Map<String, Value> = state.eos_token_ids.iter().map(|id| (id.to_string(), json!(-100))).collect();
    let mut server = start(state.clone(), Duration::from_millis(300)).await;
    let endless = |path: &'static str, stream: bool| {
        let messages = json!([{"role": "user", "content": "hello there"}]);
        let mut body = json!({"max_tokens": 50_000, "temperature": 0, "stream": stream, "logit_bias": no_end});
        if path == "/v1/completions" {
            body["prompt"] = json!([1, 2, 3]);
        } else {
            body["messages"] = messages;
        }
        if path == "/v1/chat/completions" && stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        (path, stream, request("POST", path, &body.to_string(), "connection: close\r\n"))
    };
    let cases = [
        endless("/v1/chat/completions", true),
        endless("/v1/completions", true),
        endless("/v1/messages", true),
        endless("/v1/chat/completions", false),
        endless("/v1/messages", false),
    ];
    let mut streams = Vec::new();
    for (path, stream, raw) in &cases {
        let mut s = connect(&server).await;
        s.write_all(raw).await.unwrap();
        let mut seen = Vec::new();
        while *stream && !seen.windows(5).any(|w| w == b"data:") {
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk)).await.unwrap().unwrap();
            assert!(n > 0, "{path}: closed early");
            seen.extend_from_slice(&chunk[..n]);
        }
        streams.push((*path, *stream, s, seen));
    }
    let running = Instant::now();
    while stats.active.load(std::sync::atomic::Ordering::Relaxed) < cases.len() {
        assert!(running.elapsed() < Duration::from_secs(10), "the requests never all ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stopping = Instant::now();
    server.stop.take();
    for (path, stream, mut s, mut seen) in streams {
        let (rest, _) = read_until_closed(&mut s, Duration::from_secs(10)).await;
        seen.extend_from_slice(&rest);
        let (response, used) =
            parse_response(&seen).unwrap_or_else(|| panic!("{path}: unfinished: {}", String::from_utf8_lossy(&seen)));
        assert_eq!(used, seen.len(), "{path}");
        if !stream {
            assert_eq!(response.status, 503, "{path}");
            let error = response.json();
            assert_eq!(error["type"] == "error", path == "/v1/messages", "{error}");
            assert!(error["error"]["message"].as_str().unwrap().contains("shutting down"), "{error}");
            continue;
        }
        assert_eq!(response.status, 200);
        let text = String::from_utf8(response.body).unwrap();
        let events: Vec<(&str, &str)> = text
            .split("\n\n")
            .filter_map(|e| {
                let field = |name: &str| e.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
                Some((field("event:").unwrap_or(""), field("data:")?))
            })
            .collect();
        let data = |i: usize| -> Value { serde_json::from_str(events[events.len() - i].1).unwrap() };
        match path {
            "/v1/messages" => {
                assert_eq!(events.last().unwrap().0, "message_stop", "{text}");
                let delta = data(2);
                assert_eq!(
                    (delta["type"].as_str(), delta["delta"]["stop_reason"].as_str()),
                    (Some("message_delta"), Some("max_tokens"))
                );
                assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0, "{delta}");
            }
            _ => {
                assert_eq!(events.last().unwrap().1, "[DONE]", "{text}");
                let with_usage = path == "/v1/chat/completions";
                let last = data(if with_usage { 3 } else { 2 });
                assert_eq!(last["choices"][0]["finish_reason"], "length", "{text}");
                if with_usage {
                    assert!(data(2)["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{text}");
                }
            }
        }
    }
    tokio::time::timeout(Duration::from_secs(5), server.task).await.expect("serve returned").unwrap();
    assert!(stopping.elapsed() >= Duration::from_millis(300), "{:?}", stopping.elapsed());
}
