//! Connections: strata's own accept loop over hyper's HTTP/1, because a server facing clients it
//! does not control needs limits that `axum::serve` does not have — on how long a request's
//! header may take, how long an idle connection is kept, and how many connections are held.
//!
//! hyper's own `header_read_timeout` is not used: its timer also runs while a kept-alive
//! connection waits for its next request, so it cannot be longer than the keep-alive wait
//! (and Go's and Envoy's servers, like this one, tell the two apart). Here each connection's
//! task watches its connection (`Conn`): from the end of a response until the next request's
//! first byte it is idle (`keep_alive_timeout`), from that byte until the header is whole it
//! reads a header (`header_read_timeout`; for a connection's first request, from its accept),
//! and while a request is answered it is busy (its body's deadline is `read_body`'s). In any
//! phase, a client that takes none of the bytes sent to it for `send_timeout` is dropped.
//!
//! At `max_connections`, a new connection closes the oldest one that is not busy (an idle one
//! cleanly, one still sending a header at once), so slow or idle clients cannot keep new ones
//! — `/health` among them — out; only when every connection held is busy do new ones wait.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::ServiceExt;

use crate::state::AppState;

/// How long each phase of a connection may last, and how many connections are held.
#[derive(Clone, Debug)]
pub struct HttpLimits {
    /// A request's header must have arrived whole within this of its first byte (of the
    /// connection's accept, for its first request); a connection that is slower is closed.
    pub header_read_timeout: Duration,
    /// A request's body must have arrived whole within this of its header; else a 408.
    pub body_read_timeout: Duration,
    /// A connection that sends no byte of a next request for this long after a response is
    /// closed.
    pub keep_alive_timeout: Duration,
    /// A connection whose client takes none of the bytes waiting to be sent to it for this long
    /// is closed (and a generation streaming to it cancelled).
    pub send_timeout: Duration,
    /// Connections held at once.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            // A header is a few hundred bytes: any real client sends it in well under a second,
            // and 30 s leaves room for a congested link (hyper's and Go's usual value).
            header_read_timeout: Duration::from_secs(30),
            // The largest body (16 MiB) arrives within 60 s at 2.3 Mbit/s; a client trickling
            // its body holds a connection for no longer than this.
            body_read_timeout: Duration::from_secs(60),
            // Longer than the 60 s idle timeout of the usual load balancers, so the balancer
            // drops an idle connection first and never sends a request into one being closed
            // (nginx's default is 75 s too); idle connections cost little and are the first to
            // go at the connection cap.
            keep_alive_timeout: Duration::from_secs(75),
            // nginx's `send_timeout`: a client that reads nothing for a minute while its answer
            // waits has gone, or means to hold the connection.
            send_timeout: Duration::from_secs(60),
            max_connections: default_max_connections(open_files_limit()),
        }
    }
}

/// Most connections held by default, whatever the open-file limit: far beyond what a batch of
/// requests (16 on CPU, 64 on GPU) and its queue can use, while keeping the buffers of idle
/// connections small.
const MAX_CONNECTIONS_CEILING: usize = 4096;

/// Half the open-file limit, at most [`MAX_CONNECTIONS_CEILING`]: each connection is a file,
/// and the other half stays for the model's files, the SSD cache and the runtime, so accepting
/// never fails for want of one.
pub fn default_max_connections(open_files: Option<u64>) -> usize {
    open_files.map_or(MAX_CONNECTIONS_CEILING, |n| (n / 2).clamp(1, MAX_CONNECTIONS_CEILING as u64) as usize)
}

#[cfg(unix)]
fn open_files_limit() -> Option<u64> {
    rlimit_nofile().map(|l| l.rlim_cur)
}

#[cfg(not(unix))]
fn open_files_limit() -> Option<u64> {
    None
}

#[cfg(unix)]
fn rlimit_nofile() -> Option<libc::rlimit> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit through a pointer to a local one.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0).then_some(limit)
}

/// Raises this process's soft limit on open files to its hard limit, as servers do (the soft
/// limit is often 1024, a few hundred connections); returns the limit now in force.
pub fn raise_open_files_limit() -> Option<u64> {
    #[cfg(unix)]
    if let Some(limit) = rlimit_nofile().filter(|l| l.rlim_cur < l.rlim_max) {
        let raised = libc::rlimit { rlim_cur: limit.rlim_max, ..limit };
        // SAFETY: setrlimit reads one rlimit through a pointer to a local one.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            tracing::warn!(soft = limit.rlim_cur, hard = limit.rlim_max, "cannot raise the open-file limit");
        }
    }
    open_files_limit()
}

/// How long, after the shutdown's wait has ended the requests still running, their last
/// events may take to reach clients before the connections are dropped.
const FINAL_WRITE_GRACE: Duration = Duration::from_secs(2);

/// Serves `state` on `listener` until `shutdown` resolves; then stops accepting connections,
/// closes the idle ones and lets the requests in flight finish for up to `drain`. A stream may
/// run for as long as its `max_tokens` allows, so a shutdown waiting for every one would not
/// end: past `drain` the rest are ended (a stream with its dialect's last events, a request
/// waiting for a whole answer with a 503: see `output::Finish::Shutdown`), given
/// [`FINAL_WRITE_GRACE`] to reach their clients, and then dropped.
pub async fn serve(listener: TcpListener, state: AppState, shutdown: impl std::future::Future<Output = ()>, drain: Duration) {
    let limits = state.config.http.clone();
    let router = crate::router(state.clone());
    let registry = Arc::new(Registry::default());
    let (draining, draining_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    let mut next_id = 0;
    'accept: loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) if accept_failed(&e, &mut shutdown).await => break,
                Err(_) => continue,
            },
            () = &mut shutdown => break,
        };
        while !registry.make_room(limits.max_connections) {
            tokio::select! {
                () = registry.changed.notified() => {}
                () = &mut shutdown => break 'accept,
            }
        }
        while tasks.try_join_next().is_some() {}
        let conn = registry.register(next_id);
        next_id += 1;
        let task = serve_connection(stream, conn, registry.clone(), router.clone(), limits.clone(), draining_rx.clone());
        tasks.spawn(task);
    }
    drop(listener);
    draining.send_replace(true);
    if !registry.emptied_within(drain).await {
        tracing::warn!(drain_s = drain.as_secs_f64(), "requests still running at the end of the shutdown's wait are ended");
        state.cutoff.trigger();
        if !registry.emptied_within(FINAL_WRITE_GRACE).await {
            tracing::warn!("connections still sending their last bytes are dropped");
        }
    }
}

/// An accept that failed: a connection reset before it was accepted is skipped; anything else
/// (out of file descriptors) waits a moment, as every accept would fail alike. Whether the
/// shutdown came meanwhile.
async fn accept_failed(e: &io::Error, shutdown: &mut Pin<&mut impl std::future::Future<Output = ()>>) -> bool {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(e.kind(), ConnectionAborted | ConnectionRefused | ConnectionReset) {
        return false;
    }
    tracing::warn!(error = %e, "cannot accept a connection; retrying in 1 s");
    tokio::select! {
        () = tokio::time::sleep(Duration::from_secs(1)) => false,
        () = shutdown.as_mut() => true,
    }
}

/// The connections held, oldest first.
#[derive(Default)]
struct Registry {
    conns: Mutex<BTreeMap<u64, Arc<Conn>>>,
    /// A connection ended, or one finished a request: whoever waits for room looks again.
    changed: Notify,
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Arc<Conn>>> {
        self.conns.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether a new connection may be held now. At the cap, asks the oldest connection that
    /// is not busy to close (false until it has).
    fn make_room(&self, max: usize) -> bool {
        let conns = self.lock();
        if conns.len() < max {
            return true;
        }
        if !conns.values().any(|c| c.evict.load(Ordering::Relaxed)) {
            if let Some(oldest) = conns.values().find(|c| !matches!(c.lock().phase, Phase::Busy(_))) {
                oldest.evict.store(true, Ordering::Relaxed);
                oldest.wake.notify_one();
            }
        }
        false
    }

    fn register(&self, id: u64) -> Arc<Conn> {
        let conn = Arc::new(Conn {
            id,
            state: Mutex::new(ConnState { phase: Phase::Header { since: Instant::now() }, send_stalled: None }),
            wake: Notify::new(),
            evict: AtomicBool::new(false),
        });
        self.lock().insert(id, conn.clone());
        conn
    }

    fn deregister(&self, id: u64) {
        self.lock().remove(&id);
        self.changed.notify_one();
    }

    /// Waits up to `limit` for every connection to end; whether they did.
    async fn emptied_within(&self, limit: Duration) -> bool {
        let deadline = tokio::time::sleep(limit);
        tokio::pin!(deadline);
        loop {
            if self.lock().is_empty() {
                return true;
            }
            tokio::select! {
                () = self.changed.notified() => {}
                () = &mut deadline => return false,
            }
        }
    }
}

/// One connection, as its task and the accept loop see it.
struct Conn {
    /// Order of acceptance.
    id: u64,
    state: Mutex<ConnState>,
    /// Its state changed so that its deadline moved, or it is asked to close.
    wake: Notify,
    /// Asked to close to make room for a new connection.
    evict: AtomicBool,
}

#[derive(Clone, Copy, Debug)]
struct ConnState {
    phase: Phase,
    /// Since when the socket has taken none of the bytes waiting to be sent on it.
    send_stalled: Option<Instant>,
}

#[derive(Clone, Copy, Debug)]
enum Phase {
    /// Requests being answered: from a header's arrival until its response has been sent.
    Busy(usize),
    /// Waiting, since the last response was sent, for a next request: no byte of it yet.
    Idle { since: Instant },
    /// A request's header is arriving since `since` (its first byte; the accept, for a
    /// connection's first request).
    Header { since: Instant },
}

/// What a connection's task does with it.
enum Verdict {
    Keep,
    /// Close once its response in flight, if any, is sent (hyper's graceful shutdown).
    Close,
    /// Close now: its client is mid-header, which hyper's graceful shutdown would wait for, or
    /// takes nothing of what is sent to it.
    Drop,
}

impl Conn {
    fn lock(&self) -> MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Bytes came in: a next request's header starts, if the connection was idle.
    fn bytes_arrived(&self) {
        let mut state = self.lock();
        if let Phase::Idle { .. } = state.phase {
            state.phase = Phase::Header { since: Instant::now() };
            drop(state);
            self.wake.notify_one();
        }
    }

    /// A write: whether the socket took bytes, or had no room for any.
    fn wrote(&self, took_bytes: bool) {
        let mut state = self.lock();
        match (took_bytes, state.send_stalled) {
            (true, _) => state.send_stalled = None,
            (false, Some(_)) => {}
            (false, None) => {
                state.send_stalled = Some(Instant::now());
                drop(state);
                self.wake.notify_one();
            }
        }
    }

    fn request_began(&self) {
        let mut state = self.lock();
        state.phase = match state.phase {
            Phase::Busy(n) => Phase::Busy(n + 1),
            Phase::Idle { .. } | Phase::Header { .. } => Phase::Busy(1),
        };
    }

    fn request_ended(&self) {
        let mut state = self.lock();
        state.phase = match state.phase {
            Phase::Busy(n) if n > 1 => Phase::Busy(n - 1),
            _ => Phase::Idle { since: Instant::now() },
        };
        drop(state);
        self.wake.notify_one();
    }

    /// When the phase the connection is in runs out, and when its stalled send does (None:
    /// never, or too far to say).
    fn deadlines(&self, limits: &HttpLimits) -> (Option<Instant>, Option<Instant>) {
        let state = *self.lock();
        let phase = match state.phase {
            Phase::Busy(_) => None,
            Phase::Idle { since } => since.checked_add(limits.keep_alive_timeout),
            Phase::Header { since } => since.checked_add(limits.header_read_timeout),
        };
        (phase, state.send_stalled.and_then(|since| since.checked_add(limits.send_timeout)))
    }

    fn next_deadline(&self, limits: &HttpLimits) -> Option<Instant> {
        let (phase, send) = self.deadlines(limits);
        phase.into_iter().chain(send).min()
    }

    /// An evicted connection keeps its mark while it closes, so that no other is evicted for
    /// the same newcomer.
    fn verdict(&self, limits: &HttpLimits, draining: bool, registry: &Registry) -> Verdict {
        let now = Instant::now();
        let (phase_deadline, send_deadline) = self.deadlines(limits);
        if send_deadline.is_some_and(|d| d <= now) {
            return Verdict::Drop;
        }
        let evicted = self.evict.load(Ordering::Relaxed);
        let expired = phase_deadline.is_some_and(|d| d <= now);
        match self.lock().phase {
            Phase::Busy(_) => {
                if evicted {
                    // A request came in meanwhile: the accept loop looks for another.
                    self.evict.store(false, Ordering::Relaxed);
                    registry.changed.notify_one();
                }
                if draining {
                    Verdict::Close
                } else {
                    Verdict::Keep
                }
            }
            Phase::Idle { .. } if evicted || draining || expired => Verdict::Close,
            Phase::Header { .. } if evicted || draining || expired => Verdict::Drop,
            Phase::Idle { .. } | Phase::Header { .. } => Verdict::Keep,
        }
    }
}

async fn serve_connection(
    stream: TcpStream,
    conn: Arc<Conn>,
    registry: Arc<Registry>,
    router: Router,
    limits: HttpLimits,
    mut draining: watch::Receiver<bool>,
) {
    // Tokens stream as small writes, each wanted at once.
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(Watched { stream, conn: conn.clone() });
    let service = {
        let (conn, registry) = (conn.clone(), registry.clone());
        hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let request = InFlight::begin(conn.clone(), registry.clone());
            let response = router.clone().oneshot(req.map(Body::new));
            async move {
                let response = response.await?;
                Ok::<_, Infallible>(response.map(|body| InFlightBody { body, _request: request }))
            }
        })
    };
    let mut http = hyper::server::conn::http1::Builder::new();
    // The header's deadline is this task's (see the module's comment): hyper's is off.
    http.header_read_timeout(None);
    let connection = http.serve_connection(io, service);
    tokio::pin!(connection);
    let _registered = Registered { id: conn.id, registry: registry.clone() };
    let (mut closing, mut drain_seen) = (false, false);
    loop {
        let deadline = conn.next_deadline(&limits);
        tokio::select! {
            served = connection.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            () = conn.wake.notified() => {}
            () = sleep_until(deadline) => {}
            _ = draining.changed(), if !drain_seen => drain_seen = true,
        }
        match conn.verdict(&limits, drain_seen, &registry) {
            Verdict::Keep => {}
            Verdict::Close if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
            Verdict::Close => {}
            Verdict::Drop => return,
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Removes its connection from the registry when the connection's task ends.
struct Registered {
    id: u64,
    registry: Arc<Registry>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.registry.deregister(self.id);
    }
}

/// A request from its header's arrival until its response body is dropped (sent, or abandoned
/// with the connection).
struct InFlight {
    conn: Arc<Conn>,
    registry: Arc<Registry>,
}

impl InFlight {
    fn begin(conn: Arc<Conn>, registry: Arc<Registry>) -> Self {
        conn.request_began();
        Self { conn, registry }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.conn.request_ended();
        self.registry.changed.notify_one();
    }
}

/// A response body that keeps its request in flight until hyper is done with it.
struct InFlightBody {
    body: Body,
    _request: InFlight,
}

impl HttpBody for InFlightBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The socket, telling its connection when bytes arrive and when sending stalls.
struct Watched {
    stream: TcpStream,
    conn: Arc<Conn>,
}

impl AsyncRead for Watched {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.conn.bytes_arrived();
        }
        polled
    }
}

impl Watched {
    fn note_write<T>(&self, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        self.conn.wrote(polled.is_ready());
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.note_write(polled)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.note_write(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
