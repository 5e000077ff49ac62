//! Connections below the HTTP router: caps on how many are open (in all
//! and per client address, with one place kept for loopback), deadlines
//! for each request's headers, JSON for the errors the HTTP layer answers
//! by itself, and the accept loop.
//!
//! `max_clients` bounds WebSocket subscribers, but every HTTP connection
//! (kept alive, or idle half-way through its headers) also holds a task and
//! buffers. [`CappedListener`] accepts at most `max_connections` at once,
//! and at most `per_ip` from one address, so that one client cannot take
//! every place. When every place it may take is taken, a connection from
//! `127.0.0.1` or `::1` still gets the one *reserved* place (if free): for
//! one request, with short deadlines and no WebSocket, so that a health
//! check or an operator's command gets through a flood. A connection
//! refused gets a short `503` written (best effort, never waiting) and is
//! closed, and is counted, so that a flood shows up in `/metrics` instead
//! of as a silently growing process; the warning it logs is written at
//! most every [`WARN_EVERY`], saying how many went unlogged.
//!
//! [`serve`] runs each connection with hyper's header-read timeout, which
//! `axum::serve` does not set: a connection that does not finish a
//! request's headers in time (a stuck or deliberately slow client, or an
//! idle keep-alive) is closed and gives its place back. (The body's own
//! deadline is the router's, see `http`.)
//!
//! hyper answers a request it cannot parse (`400`, `414`, `431`) itself,
//! with an empty body and none of our headers. [`CappedStream`] recognises
//! that answer as it is written (a status line with an error status and no
//! `x-kvbm-protocol` header, which every answer of the router carries) and
//! writes the JSON error every other refusal gets in its place.

use std::collections::HashMap;
use std::future::Future as _;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use kvbm_schema::protocol::{ApiError, PROTOCOL_VERSION, VERSION_HEADER};

/// The most often a refusal is logged.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(10);

/// Deadline for the headers and the body of a request on the reserved
/// place.
pub(crate) const RESERVED_DEADLINE: Duration = Duration::from_secs(2);

/// A complete HTTP/1.1 response carrying `e` as JSON, then closing.
fn json_response(status: &str, e: &ApiError) -> Vec<u8> {
    let body = serde_json::to_string(e).unwrap_or_default();
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\n\
         {VERSION_HEADER}: {PROTOCOL_VERSION}\r\n\
         Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// What a refused connection is told before it is closed: a `503` with
/// the same JSON error body as every other refusal.
fn refusal(why: &str) -> Vec<u8> {
    json_response(
        "503 Service Unavailable",
        &ApiError::new("too_many_connections", why),
    )
}

/// The JSON answer for a response hyper wrote by itself, by its status.
fn parse_error_response(status: u16) -> Vec<u8> {
    let (line, code, message) = match status {
        431 => (
            "431 Request Header Fields Too Large",
            "headers_too_large",
            "the request's headers are larger than this server reads",
        ),
        414 => (
            "414 URI Too Long",
            "uri_too_long",
            "the request's URI is longer than this server reads",
        ),
        408 => (
            "408 Request Timeout",
            "request_timeout",
            "the request did not arrive in time",
        ),
        505 => (
            "505 HTTP Version Not Supported",
            "bad_request",
            "this server speaks HTTP/1.1",
        ),
        s if (500..600).contains(&s) => (
            "500 Internal Server Error",
            "internal",
            "the server could not answer this request",
        ),
        _ => (
            "400 Bad Request",
            "bad_request",
            "the request is not well-formed HTTP/1.1 (request line, header or framing)",
        ),
    };
    json_response(line, &ApiError::new(code, message))
}

/// The status of a response head hyper wrote by itself: an error status
/// line without our version header. `None` for anything else (our own
/// responses, a body, WebSocket frames).
fn automatic_error_status(buf: &[u8]) -> Option<u16> {
    let rest = buf
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| buf.strip_prefix(b"HTTP/1.0 "))?;
    let code = std::str::from_utf8(rest.get(..3)?)
        .ok()?
        .parse::<u16>()
        .ok()?;
    if code < 400 {
        return None;
    }
    let head_end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(buf.len());
    let needle = VERSION_HEADER.as_bytes();
    let ours = buf[..head_end].split(|&b| b == b'\n').any(|line| {
        line.len() > needle.len()
            && line[..needle.len()].eq_ignore_ascii_case(needle)
            && line[needle.len()] == b':'
    });
    (!ours).then_some(code)
}

/// Connections held and refused, shared with `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct ConnCounters {
    pub(crate) refused: AtomicU64,
    pub(crate) unlogged: AtomicU64,
    pub(crate) reserve_used: AtomicU64,
    pub(crate) unparsable: AtomicU64,
}

/// How many connections a [`CappedListener`] holds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    /// In all (not counting the reserved place).
    pub max: usize,
    /// From one address (at most `max`).
    pub per_ip: usize,
}

type PerIp = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// A TCP listener that holds at most `max` connections open at once, at
/// most `per_ip` of them from one address, plus one reserved for loopback.
pub(crate) struct CappedListener {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    reserve: Arc<Semaphore>,
    per_ip: PerIp,
    caps: Caps,
    counters: Arc<ConnCounters>,
    /// When a refusal was last logged, and how many since went unlogged.
    last_warn: Option<Instant>,
    unlogged: u64,
}

/// The address as the caps count it (an IPv4 address mapped into IPv6
/// counts as itself).
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

impl CappedListener {
    pub(crate) fn new(inner: TcpListener, caps: Caps, counters: Arc<ConnCounters>) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(caps.max)),
            reserve: Arc::new(Semaphore::new(1)),
            per_ip: Arc::default(),
            caps,
            counters,
            last_warn: None,
            unlogged: 0,
        }
    }

    /// Connections open now (for `/metrics`).
    pub(crate) fn open_gauge(&self) -> OpenGauge {
        OpenGauge {
            permits: self.permits.clone(),
            reserve: self.reserve.clone(),
            max: self.caps.max,
        }
    }

    /// A place for a connection from `ip`, if it may have one.
    fn admit(&self, ip: IpAddr) -> Option<Place> {
        let mut per_ip = self.per_ip.lock().unwrap_or_else(|e| e.into_inner());
        let n = per_ip.get(&ip).copied().unwrap_or(0);
        if n < self.caps.per_ip
            && let Ok(permit) = self.permits.clone().try_acquire_owned()
        {
            per_ip.insert(ip, n + 1);
            return Some(Place {
                _permit: permit,
                ip: Some((ip, self.per_ip.clone())),
                reserved: false,
            });
        }
        drop(per_ip);
        if super::is_loopback_exempt(&SocketAddr::new(ip, 0))
            && let Ok(permit) = self.reserve.clone().try_acquire_owned()
        {
            self.counters.reserve_used.fetch_add(1, Ordering::Relaxed);
            return Some(Place {
                _permit: permit,
                ip: None,
                reserved: true,
            });
        }
        None
    }

    /// Logs a refusal, at most every [`WARN_EVERY`]; the others are
    /// counted and said in the next line.
    fn warn_refused(&mut self, addr: SocketAddr, why: &str) {
        let now = Instant::now();
        match self.last_warn {
            Some(t) if now.duration_since(t) < WARN_EVERY => {
                self.unlogged += 1;
                self.counters.unlogged.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                let unlogged = std::mem::take(&mut self.unlogged);
                tracing::warn!(
                    %addr,
                    unlogged,
                    "refusing a connection: {why} (refusals are logged at most every {}s; {unlogged} since the last line were not)",
                    WARN_EVERY.as_secs()
                );
                self.last_warn = Some(now);
            }
        }
    }
}

/// Reads how many connections a [`CappedListener`] holds.
#[derive(Clone, Debug)]
pub(crate) struct OpenGauge {
    permits: Arc<Semaphore>,
    reserve: Arc<Semaphore>,
    max: usize,
}

impl OpenGauge {
    pub(crate) fn open(&self) -> usize {
        self.max.saturating_sub(self.permits.available_permits())
            + (1 - self.reserve.available_permits().min(1))
    }
}

/// A connection's place: given back (and its address's count lowered)
/// when dropped.
#[derive(Debug)]
struct Place {
    _permit: OwnedSemaphorePermit,
    ip: Option<(IpAddr, PerIp)>,
    reserved: bool,
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some((ip, per_ip)) = &self.ip {
            let mut m = per_ip.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = m.get_mut(ip) {
                *n -= 1;
                if *n == 0 {
                    m.remove(ip);
                }
            }
        }
    }
}

impl axum::serve::Listener for CappedListener {
    type Io = CappedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // Accept errors are logged and retried by axum's own listener.
            let (tcp, addr) = axum::serve::Listener::accept(&mut self.inner).await;
            let ip = canonical(addr.ip());
            match self.admit(ip) {
                Some(place) => {
                    // Small frames must leave at once: Nagle's algorithm and
                    // delayed ACKs would hold a live event for up to 40 ms.
                    let _ = tcp.set_nodelay(true);
                    return (
                        CappedStream {
                            place,
                            tcp,
                            counters: self.counters.clone(),
                            replaced: None,
                            write_stall: Duration::from_secs(10),
                            stalled: None,
                        },
                        addr,
                    );
                }
                None => {
                    self.counters.refused.fetch_add(1, Ordering::Relaxed);
                    let open_here = self
                        .per_ip
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get(&ip)
                        .copied()
                        .unwrap_or(0);
                    let why = if open_here >= self.caps.per_ip {
                        format!(
                            "{open_here} connections from {ip} are open, the most this server holds from one address"
                        )
                    } else {
                        format!(
                            "{} connections are open, the most this server holds",
                            self.caps.max
                        )
                    };
                    self.warn_refused(addr, &why);
                    // Best effort: a fresh socket's send buffer takes this
                    // at once; if it does not, the client just sees a close.
                    let _ = tcp.try_write(&refusal(&why));
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// An accepted connection; its place is given back when it is dropped.
#[derive(Debug)]
pub(crate) struct CappedStream {
    /// Before `tcp`, so the place is free by the time the peer sees the
    /// connection close.
    place: Place,
    tcp: TcpStream,
    counters: Arc<ConnCounters>,
    /// The JSON answer written in place of hyper's own, and how much of it
    /// is written.
    replaced: Option<(Vec<u8>, usize)>,
    /// A write that makes no progress this long fails (the peer stopped
    /// reading): no response holds a place for good.
    write_stall: Duration,
    /// Armed while a write waits.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl CappedStream {
    /// Whether it holds the place kept for loopback.
    pub(crate) fn is_reserved(&self) -> bool {
        self.place.reserved
    }

    /// Writes the replacement answer, if one was started; then every byte
    /// hyper hands over is taken as written (and dropped).
    fn poll_replaced(&mut self, cx: &mut Context<'_>) -> Option<Poll<io::Result<()>>> {
        let (bytes, off) = self.replaced.as_mut()?;
        while *off < bytes.len() {
            match Pin::new(&mut self.tcp).poll_write(cx, &bytes[*off..]) {
                Poll::Ready(Ok(0)) => {
                    return Some(Poll::Ready(Err(io::ErrorKind::WriteZero.into())));
                }
                Poll::Ready(Ok(n)) => *off += n,
                Poll::Ready(Err(e)) => return Some(Poll::Ready(Err(e))),
                Poll::Pending => return Some(Poll::Pending),
            }
        }
        Some(Poll::Ready(Ok(())))
    }

    /// Turns a write's `Pending` into an error once the write has waited
    /// `write_stall`; any progress disarms it.
    fn stall_guard<T>(
        &mut self,
        cx: &mut Context<'_>,
        p: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match p {
            Poll::Pending => {
                let limit = self.write_stall;
                let sleep = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        self.stalled = None;
                        Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("the peer read nothing for {limit:?}"),
                        )))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
            ready => {
                self.stalled = None;
                ready
            }
        }
    }

    /// Starts replacing hyper's own error answer when `first` is one.
    fn watch(&mut self, first: &[u8]) {
        if self.replaced.is_none()
            && let Some(status) = automatic_error_status(first)
        {
            self.counters.unparsable.fetch_add(1, Ordering::Relaxed);
            self.replaced = Some((parse_error_response(status), 0));
        }
    }
}

impl AsyncRead for CappedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for CappedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        this.watch(buf);
        let p = match this.poll_replaced(cx) {
            Some(p) => p.map_ok(|()| buf.len()),
            None => Pin::new(&mut this.tcp).poll_write(cx, buf),
        };
        this.stall_guard(cx, p)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if let Some(first) = bufs.iter().find(|b| !b.is_empty()) {
            this.watch(first);
        }
        let p = match this.poll_replaced(cx) {
            Some(p) => p.map_ok(|()| bufs.iter().map(|b| b.len()).sum()),
            None => Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs),
        };
        this.stall_guard(cx, p)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let p = match this.poll_replaced(cx) {
            Some(p) => p,
            None => Pin::new(&mut this.tcp).poll_flush(cx),
        };
        this.stall_guard(cx, p)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// What the router may want to know of the connection a request came on
/// (a request extension).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnInfo {
    /// It holds the place kept for loopback: one request, short deadlines,
    /// no WebSocket.
    pub reserved: bool,
}

/// Serves `router` on `listener` until `shutdown` completes, each
/// connection with `header_timeout` to deliver each request's headers (and
/// upgrades, for WebSockets), and `write_stall` for a response write that
/// makes no progress; a connection on the reserved place gets one request
/// and [`RESERVED_DEADLINE`] for its headers. Each request carries its
/// connection's [`ConnInfo`]. On shutdown it stops accepting, asks every
/// connection to finish its request in flight, and returns when they have
/// (or after [`SHUTDOWN_GRACE`], leaving the stragglers to be dropped with
/// the runtime).
pub(crate) async fn serve(
    mut listener: CappedListener,
    router: axum::Router,
    header_timeout: Duration,
    write_stall: Duration,
    shutdown: impl std::future::Future<Output = ()> + Send,
) {
    use hyper::service::Service as _;
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    // Connections hold `closed` receivers; all gone = all finished.
    let (closed_tx, closed_rx) = tokio::sync::watch::channel(());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (mut io, _addr) = tokio::select! {
            accepted = axum::serve::Listener::accept(&mut listener) => accepted,
            () = &mut shutdown => break,
        };
        io.write_stall = write_stall;
        let info = ConnInfo {
            reserved: io.is_reserved(),
        };
        let inner = TowerToHyperService::new(router.clone());
        let service =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(info);
                inner.call(req)
            });
        let mut stop = stop_rx.clone();
        let closed = closed_rx.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new());
            if info.reserved {
                builder
                    .header_read_timeout(header_timeout.min(RESERVED_DEADLINE))
                    .keep_alive(false);
            } else {
                builder.header_read_timeout(header_timeout);
            }
            let conn = builder
                .serve_connection(TokioIo::new(io), service)
                .with_upgrades();
            tokio::pin!(conn);
            let mut stopping = false;
            loop {
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            tracing::trace!("connection ended: {e}");
                        }
                        break;
                    }
                    changed = stop.changed(), if !stopping => {
                        stopping = true;
                        if changed.is_ok() {
                            conn.as_mut().graceful_shutdown();
                        }
                    }
                }
            }
            drop(closed);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(closed_rx);
    // A client that never reads its response would hold a connection (and
    // the shutdown) forever; give requests in flight a bounded time.
    if tokio::time::timeout(SHUTDOWN_GRACE, closed_tx.closed())
        .await
        .is_err()
    {
        tracing::warn!(
            "connections still open {SHUTDOWN_GRACE:?} after shutdown began; leaving them"
        );
    }
}

/// How long shutdown waits for requests in flight to finish.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    fn split(raw: &[u8]) -> (String, String) {
        let text = std::str::from_utf8(raw).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(len, body.len());
        assert!(head.contains("x-kvbm-protocol: "), "{head}");
        (head.to_string(), body.to_string())
    }

    #[test]
    fn the_refusal_is_a_well_formed_response() {
        let (head, body) = split(&refusal("7 connections are open"));
        assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
        let e: ApiError = serde_json::from_str(&body).unwrap();
        assert_eq!(e.code, "too_many_connections");
        assert!(e.message.contains('7'), "{}", e.message);
    }

    /// Only an error head without our version header is hyper's own: our
    /// responses, bodies and WebSocket frames pass untouched.
    #[test]
    fn hypers_own_error_answers_are_recognised_and_replaced() {
        let hyper400 = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        assert_eq!(automatic_error_status(hyper400), Some(400));
        assert_eq!(
            automatic_error_status(b"HTTP/1.1 431 Request Header Fields Too Large\r\n\r\n"),
            Some(431)
        );
        let ours = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nx-kvbm-protocol: 2\r\n\r\n{}";
        assert_eq!(automatic_error_status(ours), None);
        assert_eq!(automatic_error_status(b"HTTP/1.1 200 OK\r\n\r\n"), None);
        assert_eq!(automatic_error_status(b"{\"status\":\"ok\"}"), None);
        assert_eq!(automatic_error_status(&[0x82, 0x05, 1, 2, 3]), None);
        for status in [400, 414, 431, 408, 505] {
            let (head, body) = split(&parse_error_response(status));
            assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{head}");
            let e: ApiError = serde_json::from_str(&body).unwrap();
            assert!(!e.message.is_empty());
            assert_eq!(automatic_error_status(head.as_bytes()), None);
        }
    }
}
