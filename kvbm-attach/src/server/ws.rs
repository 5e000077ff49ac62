//! `GET /events`: one WebSocket client.
//!
//! Two tasks per client: the writer (this connection's own cursor over the
//! live window and the ring, plus replies and breakpoint pushes) and the
//! reader (control commands from the client). A [`ConnGuard`] releases the
//! client's breakpoints however the connection ends.

use super::api::{Access, Fail, bad_request, json_error};
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
use kvbm_events::control::ControlCommand;
use kvbm_events::text::{MAX_MESSAGE_CHARS, MAX_QUOTED_CHARS, clip};
use kvbm_schema::protocol::{ApiError, ClientMsg, ServerMsg};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;

/// Replies and breakpoint updates queued for one client at most; a client
/// that lets more pile up is disconnected as slow.
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

fn parse_since(query: Option<&str>) -> Result<Option<u64>, Fail> {
    let mut since = None;
    for pair in query.unwrap_or("").split('&') {
        if let Some(("since", v)) = pair.split_once('=') {
            since = Some(v.parse::<u64>().map_err(|_| {
                bad_request(format!(
                    "`since` must be a sequence number, got {:?}",
                    clip(v, MAX_QUOTED_CHARS)
                ))
            })?);
        }
    }
    Ok(since)
}

pub(super) async fn events(
    State(state): State<Arc<AppState>>,
    access: Option<Extension<Access>>,
    RawQuery(query): RawQuery,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let since = match parse_since(query.as_deref()) {
        Ok(s) => s,
        Err(f) => return f.into_response(),
    };
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
    /// A send stalled, or the client let replies pile up.
    Slow,
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
        .insert(id);
    let mut guard = ConnGuard {
        state: state.clone(),
        id,
        reader: None,
        _permit: permit,
    };
    let (mut sink, stream) = socket.split();
    let (tx, mut rx) = mpsc::channel(CONTROL_QUEUE);
    let overflow = Arc::new(AtomicBool::new(false));
    let reader = tokio::spawn(read_client(
        state.clone(),
        stream,
        tx,
        id,
        control,
        overflow.clone(),
    ));
    guard.reader = Some(reader.abort_handle());
    let mut w = Writer {
        sink: &mut sink,
        counters: &state.counters,
        timeout: state.cfg.send_timeout,
    };
    let end = write_loop(&state, &mut w, &mut rx, &overflow, id, since).await;
    match end {
        End::Slow => {
            state.counters.slow.fetch_add(1, Ordering::Relaxed);
            tracing::info!(client = id, "slow client disconnected");
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
    ServerMsg::Hello {
        protocol: kvbm_schema::protocol::PROTOCOL_VERSION,
        engine: state.engine.id,
        client: id,
        first_seq: first.filter(|_| last.is_some()),
        last_seq: last.filter(|_| first.is_some()),
    }
}

async fn write_loop(
    state: &AppState,
    w: &mut Writer<'_>,
    rx: &mut mpsc::Receiver<ServerMsg>,
    overflow: &AtomicBool,
    id: u64,
    since: Option<u64>,
) -> End {
    match write_loop_inner(state, w, rx, id, since).await {
        Ok(()) | Err(End::Gone) if overflow.load(Ordering::Acquire) => End::Slow,
        Ok(()) => End::Gone,
        Err(e) => e,
    }
}

async fn write_loop_inner(
    state: &AppState,
    w: &mut Writer<'_>,
    rx: &mut mpsc::Receiver<ServerMsg>,
    id: u64,
    since: Option<u64>,
) -> Result<(), End> {
    let ring = &state.engine.ring;
    let mut live_rx = state.live.subscribe();
    let mut bp_rx = state.bp_view.clone();
    let mut shutdown = state.shutdown.clone();
    w.send(&hello(state, id)).await?;
    let view = (**bp_rx.borrow_and_update()).clone();
    w.send(&ServerMsg::Breakpoints(view)).await?;
    let mut cursor = Cursor::new(ring, since, state.max_batch());
    let mut live_sent = false;
    loop {
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
                if !live_sent {
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
    overflow: Arc<AtomicBool>,
) {
    while let Some(m) = stream.next().await {
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
        match tx.try_send(reply) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                overflow.store(true, Ordering::Release);
                return;
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return,
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
                control::execute_for(state, command, Some(client)).map_err(|(_, e)| e)
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
        assert_eq!(parse_since(None).ok(), Some(None));
        assert_eq!(parse_since(Some("version=1&since=42")).ok(), Some(Some(42)));
        let long = "9".repeat(1000) + "x";
        let Err(Fail(status, e)) = parse_since(Some(&format!("since={long}"))) else {
            panic!("accepted")
        };
        assert_eq!(
            (status, e.code.as_str()),
            (StatusCode::BAD_REQUEST, "bad_request")
        );
        let quoted = format!("{:?}", clip(&long, MAX_QUOTED_CHARS));
        assert!(e.message.ends_with(&quoted), "{}", e.message);
    }
}
