//! `GET /events`: one WebSocket client.
//!
//! Two tasks per client: the writer (this connection's own cursor over the
//! live window and the ring, plus replies, breakpoint pushes and pings)
//! and the reader (control commands from the client, and the time anything
//! was last heard from it). A [`ConnGuard`] releases the client's
//! breakpoints however the connection ends: closed, too slow, silent, or
//! the server shutting down.

use super::api::{Access, Fail, bad_request, json_error};
use super::conn::ConnInfo;
use super::control;
use super::live::{Cursor, Out, Step};
use super::{AppState, Counters};
use axum::Extension;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use kvbm_events::RunId;
use kvbm_events::control::ControlCommand;
use kvbm_events::text::{MAX_MESSAGE_CHARS, MAX_QUOTED_CHARS, clip};
use kvbm_schema::protocol::{ApiError, ClientMsg, ServerMsg};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Replies and breakpoint updates queued for one client at most; while
/// the queue is full the client's commands wait unread.
const CONTROL_QUEUE: usize = 64;

/// Leave for one WebSocket client to be connected, one of at most
/// [`ServerConfig::max_clients`](super::ServerConfig::max_clients): counted
/// in `connected` while it lives, given back when dropped.
struct ClientPermit {
    state: Arc<AppState>,
}

impl ClientPermit {
    fn reserve(state: &Arc<AppState>) -> Option<ClientPermit> {
        let max = state.cfg.max_clients;
        state
            .counters
            .connected
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        state.counters.accepted.fetch_add(1, Ordering::Relaxed);
        Some(ClientPermit {
            state: state.clone(),
        })
    }
}

impl Drop for ClientPermit {
    fn drop(&mut self) {
        self.state.counters.connected.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Runs when a connection ends, however it ends (even when its task is
/// cancelled): stops the reader, forgets the client and releases its
/// breakpoints and pauses.
struct ConnGuard {
    state: Arc<AppState>,
    id: u64,
    reader: Option<tokio::task::AbortHandle>,
    _permit: ClientPermit,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        if let Some(r) = &self.reader {
            r.abort();
        }
        self.state
            .clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
        // After the removal (under the registry's lock) no command can give
        // this client a new breakpoint, so this catches them all.
        if self.state.cfg.release_on_disconnect
            && let Some(b) = &self.state.engine.control
        {
            let r = b.release_owner(self.id);
            if r.breakpoints > 0 || r.resumed > 0 {
                tracing::info!(
                    client = self.id,
                    breakpoints = r.breakpoints,
                    resumed = r.resumed,
                    "client gone: its breakpoints removed and its pauses resumed"
                );
                self.state.bp_poke.notify_one();
            }
        }
    }
}

/// Where a client wants its stream to start: `since` (a sequence number)
/// in engine run `run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Resume {
    since: Option<u64>,
    run: Option<RunId>,
}

impl Resume {
    /// The first sequence number to send when serving run `served`: a
    /// client resuming in another run (the engine restarted) gets this
    /// run from its start, so nothing of it is skipped because the old
    /// run had got further.
    fn since_in(&self, served: RunId) -> Option<u64> {
        match self.run {
            Some(r) if r != served => Some(0),
            _ => self.since,
        }
    }
}

fn parse_query(query: Option<&str>) -> Result<Resume, Fail> {
    let mut q = Resume::default();
    for pair in query.unwrap_or("").split('&') {
        match pair.split_once('=') {
            Some(("since", v)) => {
                q.since = Some(v.parse::<u64>().map_err(|_| {
                    bad_request(format!(
                        "`since` must be a sequence number, got {:?}",
                        clip(v, MAX_QUOTED_CHARS)
                    ))
                })?);
            }
            Some(("run", v)) => {
                q.run = Some(v.parse::<RunId>().map_err(|e| {
                    bad_request(format!("`run`: {e}, got {:?}", clip(v, MAX_QUOTED_CHARS)))
                })?);
            }
            _ => {}
        }
    }
    Ok(q)
}

pub(super) async fn events(
    State(state): State<Arc<AppState>>,
    access: Option<Extension<Access>>,
    conn: Option<Extension<ConnInfo>>,
    RawQuery(query): RawQuery,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let resume = match parse_query(query.as_deref()) {
        Ok(s) => s,
        Err(f) => return f.into_response(),
    };
    if conn.is_some_and(|Extension(c)| c.reserved) {
        return json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            ApiError::new(
                "too_many_connections",
                "every place for a stream is taken; this connection holds the one kept for \
                 a loopback health check or command, which takes no WebSocket",
            ),
        );
    }
    let since = resume.since_in(state.engine.run);
    let ws = match ws {
        Ok(ws) => ws,
        Err(e) => {
            let status = if e.status().is_client_error() {
                e.status()
            } else {
                StatusCode::BAD_REQUEST
            };
            return json_error(
                status,
                ApiError::new(
                    "bad_request",
                    format!("GET /events must be a WebSocket upgrade: {e}"),
                ),
            );
        }
    };
    let Some(permit) = ClientPermit::reserve(&state) else {
        state.counters.rejected.fetch_add(1, Ordering::Relaxed);
        return json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            ApiError::new(
                "too_many_clients",
                format!(
                    "{} WebSocket clients are connected, the most this server accepts",
                    state.cfg.max_clients
                ),
            ),
        );
    };
    let control = access.is_some_and(|Extension(a)| a.control);
    let id = state.next_client.fetch_add(1, Ordering::Relaxed);
    let limit = state.cfg.max_body_bytes;
    ws.max_message_size(limit)
        .max_frame_size(limit)
        .on_upgrade(move |socket| serve_client(state, socket, permit, id, since, control))
}

/// Why a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The client closed, or its stream failed.
    Gone,
    /// A send stalled.
    Slow,
    /// Nothing came from the client (not even a pong) for the silence
    /// timeout.
    Silent,
    /// The server is shutting down.
    Shutdown,
}

async fn serve_client(
    state: Arc<AppState>,
    socket: WebSocket,
    permit: ClientPermit,
    id: u64,
    since: Option<u64>,
    control: bool,
) {
    state
        .clients
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id, super::secret::client_key());
    let mut guard = ConnGuard {
        state: state.clone(),
        id,
        reader: None,
        _permit: permit,
    };
    let (mut sink, stream) = socket.split();
    let (tx, mut rx) = mpsc::channel(CONTROL_QUEUE);
    let heard = Arc::new(Heard::new());
    let reader = tokio::spawn(read_client(
        state.clone(),
        stream,
        tx,
        id,
        control,
        heard.clone(),
    ));
    guard.reader = Some(reader.abort_handle());
    let mut w = Writer {
        sink: &mut sink,
        counters: &state.counters,
        timeout: state.cfg.send_timeout,
    };
    let end = write_loop(&state, &mut w, &mut rx, &heard, id, since).await;
    match end {
        End::Slow => {
            state.counters.slow.fetch_add(1, Ordering::Relaxed);
            tracing::info!(client = id, "slow client disconnected");
        }
        End::Silent => {
            state.counters.silent.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                client = id,
                "silent client disconnected: nothing from it, not even a pong, for {:?}",
                state.cfg.silence_timeout
            );
            // Best effort: a frozen client will not read it.
            let bye = ServerMsg::Error(ApiError::new(
                "silent",
                format!(
                    "nothing came from this client for {:?}; disconnected",
                    state.cfg.silence_timeout
                ),
            ));
            let _ = tokio::time::timeout(Duration::from_millis(200), async {
                let _ = sink.send(text(&bye)).await;
                let _ = sink.close().await;
            })
            .await;
        }
        End::Shutdown | End::Gone => {
            let _ = tokio::time::timeout(Duration::from_millis(500), sink.close()).await;
        }
    }
    drop(guard);
}

struct Writer<'a> {
    sink: &'a mut SplitSink<WebSocket, Message>,
    counters: &'a Counters,
    timeout: Duration,
}

impl Writer<'_> {
    async fn send_all(&mut self, msgs: Vec<Message>) -> Result<(), End> {
        let sink = &mut *self.sink;
        let fut = async move {
            for m in msgs {
                sink.feed(m).await?;
            }
            sink.flush().await
        };
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(End::Gone),
            Err(_) => Err(End::Slow),
        }
    }

    async fn send(&mut self, msg: &ServerMsg) -> Result<(), End> {
        self.send_all(vec![text(msg)]).await
    }

    async fn send_outs(&mut self, outs: Vec<Out>) -> Result<(), End> {
        let mut msgs = Vec::with_capacity(outs.len());
        for o in outs {
            match o {
                Out::Gap(g) => {
                    self.counters.gaps_sent.fetch_add(1, Ordering::Relaxed);
                    self.counters
                        .gap_events
                        .fetch_add(g.to - g.from + 1, Ordering::Relaxed);
                    msgs.push(text(&ServerMsg::Gap {
                        from_seq: g.from,
                        to_seq: g.to,
                        reason: g.reason,
                    }));
                }
                Out::Frame { bytes, events } => {
                    self.counters
                        .events_sent
                        .fetch_add(events, Ordering::Relaxed);
                    msgs.push(Message::Binary(bytes));
                }
            }
        }
        self.send_all(msgs).await
    }
}

fn text(msg: &ServerMsg) -> Message {
    // ServerMsg is plain data; serialising it cannot fail.
    Message::Text(serde_json::to_string(msg).unwrap_or_default().into())
}

fn hello(state: &AppState, id: u64) -> ServerMsg {
    let ring = &state.engine.ring;
    let c = ring.counters();
    let first = ring
        .read_at_most(c.oldest_position(), 1)
        .events
        .first()
        .map(|e| e.seq);
    let last = ring.latest(1).last().map(|e| e.seq);
    let client_key = state
        .clients
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .cloned()
        .unwrap_or_default();
    ServerMsg::Hello {
        protocol: kvbm_schema::protocol::PROTOCOL_VERSION,
        engine: state.engine.id,
        run: state.engine.run,
        client: id,
        client_key,
        first_seq: first.filter(|_| last.is_some()),
        last_seq: last.filter(|_| first.is_some()),
        // What the engine runs as, as `/health` serves it.
        engine_info: state.engine.info().cloned(),
    }
}

/// When anything (a message, a ping, a pong) was last heard from a
/// client, as milliseconds since the connection opened.
struct Heard {
    start: Instant,
    ms: AtomicU64,
}

impl Heard {
    fn new() -> Self {
        Heard {
            start: Instant::now(),
            ms: AtomicU64::new(0),
        }
    }

    fn now(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// How long since.
    fn silence(&self) -> Duration {
        self.start
            .elapsed()
            .saturating_sub(Duration::from_millis(self.ms.load(Ordering::Relaxed)))
    }
}

/// Pings a client on schedule and ends it when it has been silent too
/// long.
struct Pinger<'a> {
    heard: &'a Heard,
    every: Duration,
    silence: Duration,
    next: tokio::time::Instant,
}

impl Pinger<'_> {
    /// Pings if one is due; `Err(Silent)` when the client has been silent
    /// past the timeout.
    async fn tick(&mut self, w: &mut Writer<'_>) -> Result<(), End> {
        if self.heard.silence() >= self.silence {
            return Err(End::Silent);
        }
        let now = tokio::time::Instant::now();
        if now >= self.next {
            self.next = now + self.every;
            w.send_all(vec![Message::Ping(Default::default())]).await?;
        }
        Ok(())
    }

    /// When to look again: the next ping, or when the silence would run out.
    fn wake_at(&self) -> tokio::time::Instant {
        let left = self.silence.saturating_sub(self.heard.silence());
        self.next.min(tokio::time::Instant::now() + left)
    }
}

async fn write_loop(
    state: &AppState,
    w: &mut Writer<'_>,
    rx: &mut mpsc::Receiver<ServerMsg>,
    heard: &Heard,
    id: u64,
    since: Option<u64>,
) -> End {
    match write_loop_inner(state, w, rx, heard, id, since).await {
        Ok(()) => End::Gone,
        Err(e) => e,
    }
}

async fn write_loop_inner(
    state: &AppState,
    w: &mut Writer<'_>,
    rx: &mut mpsc::Receiver<ServerMsg>,
    heard: &Heard,
    id: u64,
    since: Option<u64>,
) -> Result<(), End> {
    let ring = &state.engine.ring;
    let mut live_rx = state.live.subscribe();
    let mut bp_rx = state.bp_view.clone();
    let mut shutdown = state.shutdown.clone();
    let mut pinger = Pinger {
        heard,
        every: state.cfg.ping_interval,
        silence: state.cfg.silence_timeout,
        next: tokio::time::Instant::now() + state.cfg.ping_interval,
    };
    w.send(&hello(state, id)).await?;
    // The ring's end once the Hello was read from it: Live, which says
    // the backfill is done, waits until the cursor has passed it, so
    // that it comes after every event the Hello announced even when the
    // live window, which the cursor reads, has not encoded them yet.
    let backfill_end = ring.counters().pushed;
    let view = (**bp_rx.borrow_and_update()).clone();
    w.send(&ServerMsg::Breakpoints(view)).await?;
    let mut cursor = Cursor::new(ring, since, state.max_batch());
    let mut live_sent = false;
    loop {
        pinger.tick(w).await?;
        // Replies and breakpoint changes go before more events.
        loop {
            match rx.try_recv() {
                Ok(m) => w.send(&m).await?,
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => return Ok(()),
            }
        }
        if bp_rx.has_changed().unwrap_or(false) {
            let view = (**bp_rx.borrow_and_update()).clone();
            w.send(&ServerMsg::Breakpoints(view)).await?;
        }
        if *shutdown.borrow() {
            let bye = ServerMsg::Error(ApiError::new(
                "shutting_down",
                "the server is shutting down",
            ));
            let _ = w.send(&bye).await;
            return Err(End::Shutdown);
        }
        live_rx.borrow_and_update();
        match cursor.next(ring, &state.live) {
            Step::Send(outs) => w.send_outs(outs).await?,
            Step::CaughtUp => {
                if !live_sent && cursor.pos() >= backfill_end {
                    live_sent = true;
                    w.send(&ServerMsg::Live).await?;
                    continue;
                }
                tokio::select! {
                    Ok(()) = live_rx.changed() => {}
                    m = rx.recv() => match m {
                        Some(m) => w.send(&m).await?,
                        None => return Ok(()),
                    },
                    Ok(()) = bp_rx.changed() => {
                        let view = (**bp_rx.borrow_and_update()).clone();
                        w.send(&ServerMsg::Breakpoints(view)).await?;
                    }
                    _ = tokio::time::sleep_until(pinger.wake_at()) => {}
                    _ = super::shutting_down(&mut shutdown) => {}
                }
            }
        }
    }
}

async fn read_client(
    state: Arc<AppState>,
    mut stream: SplitStream<WebSocket>,
    tx: mpsc::Sender<ServerMsg>,
    id: u64,
    control: bool,
    heard: Arc<Heard>,
) {
    while let Some(m) = stream.next().await {
        heard.now();
        let (reply, fatal) = match m {
            Ok(Message::Text(t)) => handle_text(&state, t.as_str(), id, control),
            Ok(Message::Binary(_)) => (
                ServerMsg::Error(ApiError::new(
                    "bad_request",
                    "binary frames are not accepted from clients",
                )),
                true,
            ),
            Ok(Message::Close(_)) => return,
            Err(e) => match too_large(e) {
                // Told why, counted, then closed like any frame that
                // cannot be answered.
                Some(why) => {
                    state.counters.too_large.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(client = id, "{why}");
                    (
                        ServerMsg::Error(ApiError::new("payload_too_large", why)),
                        true,
                    )
                }
                None => return,
            },
            Ok(Message::Ping(_) | Message::Pong(_)) => continue,
        };
        // A full queue holds this reader (and so the client's next
        // commands) back until the writer has sent replies; a client that
        // never reads them is ended by the writer's send timeout.
        if tx.send(reply).await.is_err() {
            return;
        }
        if fatal {
            return;
        }
    }
}

/// Why a read failed, when it was a message over the size limit (which
/// the client should hear about rather than see the connection drop).
fn too_large(e: axum::Error) -> Option<String> {
    use tokio_tungstenite::tungstenite::Error;
    match e.into_inner().downcast_ref::<Error>() {
        Some(Error::Capacity(c)) => Some(format!("message refused: {c}")),
        _ => None,
    }
}

/// Answers one text frame; `true` when the connection must end (a frame
/// that cannot even be answered).
fn handle_text(state: &AppState, text: &str, client: u64, control: bool) -> (ServerMsg, bool) {
    match serde_json::from_str::<ClientMsg>(text) {
        Ok(ClientMsg::Control { id, command }) => {
            let result = if control || matches!(command, ControlCommand::List) {
                control::execute_for(state, command, client, None).map_err(|(_, e)| e)
            } else {
                Err(ApiError::new(
                    "unauthorized",
                    "this connection was opened without the token; control needs it",
                ))
            };
            (ServerMsg::Reply { id, result }, false)
        }
        Err(e) => {
            let err = ApiError::new(
                "bad_request",
                format!(
                    "malformed message: {}",
                    clip(&e.to_string(), MAX_MESSAGE_CHARS)
                ),
            );
            // Answer the command's id when it can be found.
            match serde_json::from_str::<serde_json::Value>(text)
                .ok()
                .and_then(|v| v.get("id").and_then(|i| i.as_u64()))
            {
                Some(id) => (
                    ServerMsg::Reply {
                        id,
                        result: Err(err),
                    },
                    false,
                ),
                None => (ServerMsg::Error(err), true),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_since_is_refused_quoting_its_start() {
        assert_eq!(parse_query(None).ok(), Some(Resume::default()));
        assert_eq!(
            parse_query(Some("version=3&since=42"))
                .ok()
                .map(|q| q.since),
            Some(Some(42))
        );
        assert!(parse_query(Some("run=xyz")).is_err());
        let long = "9".repeat(1000) + "x";
        let Err(Fail(status, e)) = parse_query(Some(&format!("since={long}"))) else {
            panic!("accepted")
        };
        assert_eq!(
            (status, e.code.as_str()),
            (StatusCode::BAD_REQUEST, "bad_request")
        );
        let quoted = format!("{:?}", clip(&long, MAX_QUOTED_CHARS));
        assert!(e.message.ends_with(&quoted), "{}", e.message);
    }

    /// `since` counts in the run the client names: in another run the
    /// stream starts at that run's beginning.
    #[test]
    fn since_applies_only_in_its_own_run() {
        let (a, b) = (RunId(1), RunId(2));
        let q = parse_query(Some(&format!("since=500&run={a}"))).unwrap();
        assert_eq!(q.since_in(a), Some(500));
        assert_eq!(q.since_in(b), Some(0));
        let no_run = parse_query(Some("since=500")).unwrap();
        assert_eq!(no_run.since_in(b), Some(500));
    }
}
