//! Connections below the HTTP router: a cap on how many are open, a
//! deadline for each request's headers, and the accept loop.
//!
//! `max_clients` bounds WebSocket subscribers, but every HTTP connection
//! (kept alive, or idle half-way through its headers) also holds a task and
//! buffers. [`CappedListener`] accepts at most `max_connections` at once;
//! one over the cap gets a short `503` written (best effort, never
//! waiting) and is closed, and is counted, so that a flood shows up in
//! `/metrics` instead of as a silently growing process. [`serve`] runs
//! each connection with hyper's header-read timeout, which `axum::serve`
//! does not set: a connection that does not finish a request's headers in
//! time (a stuck or deliberately slow client, or an idle keep-alive) is
//! closed and gives its place back.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use kvbm_schema::protocol::ApiError;

/// What a refused connection is told before it is closed: a `503` with
/// the same JSON error body as every other refusal.
fn refusal(max: usize) -> Vec<u8> {
    let body = serde_json::to_string(&ApiError::new(
        "too_many_connections",
        format!("{max} connections are open, the most this server holds"),
    ))
    .unwrap_or_default();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n\
         Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Connections held and refused, shared with `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct ConnCounters {
    pub(crate) refused: AtomicU64,
}

/// A TCP listener that holds at most `max` connections open at once.
pub(crate) struct CappedListener {
    inner: TcpListener,
    permits: Arc<Semaphore>,
    max: usize,
    counters: Arc<ConnCounters>,
    refusal: Vec<u8>,
}

impl CappedListener {
    pub(crate) fn new(inner: TcpListener, max: usize, counters: Arc<ConnCounters>) -> Self {
        Self {
            inner,
            permits: Arc::new(Semaphore::new(max)),
            max,
            counters,
            refusal: refusal(max),
        }
    }

    /// Connections open now (for `/metrics`).
    pub(crate) fn open_gauge(&self) -> OpenGauge {
        OpenGauge {
            permits: self.permits.clone(),
            max: self.max,
        }
    }
}

/// Reads how many connections a [`CappedListener`] holds.
#[derive(Clone, Debug)]
pub(crate) struct OpenGauge {
    permits: Arc<Semaphore>,
    max: usize,
}

impl OpenGauge {
    pub(crate) fn open(&self) -> usize {
        self.max.saturating_sub(self.permits.available_permits())
    }
}

impl axum::serve::Listener for CappedListener {
    type Io = CappedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // Accept errors are logged and retried by axum's own listener.
            let (tcp, addr) = axum::serve::Listener::accept(&mut self.inner).await;
            match self.permits.clone().try_acquire_owned() {
                Ok(permit) => {
                    // Small frames must leave at once: Nagle's algorithm and
                    // delayed ACKs would hold a live event for up to 40 ms.
                    let _ = tcp.set_nodelay(true);
                    return (
                        CappedStream {
                            tcp,
                            _permit: permit,
                        },
                        addr,
                    );
                }
                Err(_) => {
                    self.counters.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%addr, max = self.max, "refusing a connection: too many open");
                    // Best effort: a fresh socket's send buffer takes this
                    // at once; if it does not, the client just sees a close.
                    let _ = tcp.try_write(&self.refusal);
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// An accepted connection; its slot is given back when it is dropped.
#[derive(Debug)]
pub(crate) struct CappedStream {
    tcp: TcpStream,
    _permit: OwnedSemaphorePermit,
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
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// Serves `router` on `listener` until `shutdown` completes, each
/// connection with `header_timeout` to deliver each request's headers (and
/// upgrades, for WebSockets). On shutdown it stops accepting, asks every
/// connection to finish its request in flight, and returns when they have
/// (or after [`SHUTDOWN_GRACE`], leaving the stragglers to be dropped with
/// the runtime).
pub(crate) async fn serve(
    mut listener: CappedListener,
    router: axum::Router,
    header_timeout: std::time::Duration,
    shutdown: impl std::future::Future<Output = ()> + Send,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    // Connections hold `closed` receivers; all gone = all finished.
    let (closed_tx, closed_rx) = tokio::sync::watch::channel(());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (io, _addr) = tokio::select! {
            accepted = axum::serve::Listener::accept(&mut listener) => accepted,
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(router.clone());
        let mut stop = stop_rx.clone();
        let closed = closed_rx.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
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

    #[test]
    fn the_refusal_is_a_well_formed_response() {
        let raw = refusal(7);
        let text = std::str::from_utf8(&raw).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(len, body.len());
        let e: ApiError = serde_json::from_str(body).unwrap();
        assert_eq!(e.code, "too_many_connections");
        assert!(e.message.contains('7'), "{}", e.message);
    }
}
