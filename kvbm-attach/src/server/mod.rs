//! The attach server (see [`kvbm_schema::protocol`]): a live WebSocket stream of
//! an engine's events with backfill from the ring, a reducer snapshot,
//! breakpoint control, Prometheus metrics and a health check, over HTTP/1.1
//! with `axum`.
//!
//! # Pieces
//!
//! ```text
//! engine ──tap──▶ feeder thread ──push──▶ RingBuffer ──▶ encoder task ──▶ live window
//!                  (spawn_feeder)   │                 └─▶ reducer task    (encoded batches)
//!                                   └─ RingSignal (wakes the tasks)              │
//!                                                          WebSocket clients ◀───┘
//! ```
//!
//! - [`spawn_feeder`] drains the engine's lossless tap into the ring on a
//!   thread of its own, polling (drain, then sleep ~200 µs) so the engine
//!   never pays for a wake-up, and signals the server after every burst.
//!   Without a feeder (something else fills the ring, such as the
//!   recorder), the server polls the ring every millisecond instead.
//! - One *encoder* task follows the ring and encodes each event once into
//!   shared, sequence-contiguous binary batches (the *live window*, the
//!   newest [`ServerConfig::live_window_events`] events). A client that is
//!   caught up is sent those very batches (a reference count, no copy, no
//!   re-encoding), so fifty clients cost little more than one.
//! - One *reducer* task folds the ring into an `EngineState` for
//!   `GET /snapshot` and `GET /metrics`.
//! - Each WebSocket client has its own cursor (a ring position) and its own
//!   pace: it is sent batches from the live window when its cursor is in
//!   it, and reads (and encodes) from the ring itself while it is further
//!   behind, e.g. during backfill.
//!
//! # Slow clients
//!
//! The engine and the other clients never wait for a client:
//!
//! - A client that falls behind the ring (the ring overwrote events it had
//!   not been sent yet) is told so with a [`ServerMsg::Gap`](kvbm_schema::protocol::ServerMsg::Gap) (reason
//!   `overwritten`) naming the exact sequence numbers, and goes on from the
//!   oldest event still held. It is not disconnected for that.
//! - A single send (one frame) that does not complete within
//!   [`ServerConfig::send_timeout`] (5 s by default: the client stopped
//!   reading and the socket buffers are full) disconnects the client, and
//!   `kvbm_ws_slow_disconnects_total` counts it.
//! - A client may send commands faster than it reads the replies: while
//!   its queue of replies and breakpoint updates (64 messages) is full, its
//!   commands are simply not read (TCP pushes back); if it never reads, the
//!   send timeout above ends it.
//! - Every client is pinged every [`ServerConfig::ping_interval`] (5 s);
//!   one from which nothing at all (not even a pong) has arrived for
//!   [`ServerConfig::silence_timeout`] (15 s) is disconnected and counted
//!   (`kvbm_ws_silent_disconnects_total`), and its breakpoints released. A
//!   paused engine sends nothing, so without this a console that froze
//!   (stopped, or behind a half-open connection) would hold the pause until
//!   its deadline.
//!
//! Memory per client is bounded: one batch in flight plus that queue.
//!
//! # Safety
//!
//! - Binds `127.0.0.1:7070` by default. On any address other than
//!   `127.0.0.1` and `::1`, [`Server::bind`] refuses to start without a
//!   token ([`ServerError::TokenRequired`]), before binding anything.
//! - With a token, every request needs `Authorization: Bearer TOKEN`
//!   (compared in constant time), on loopback too; with
//!   [`ServerConfig::open_read`], `GET` requests (including the WebSocket
//!   stream) are let through without it, but control is not (a WebSocket
//!   opened without the token gets `unauthorized` replies to its control
//!   commands).
//! - Request bodies are capped ([`ServerConfig::max_body_bytes`], `413`,
//!   at once for a declared `Content-Length` over it), and so are WebSocket
//!   messages from clients. A body must arrive within
//!   [`ServerConfig::request_timeout`] of its headers (`408`), and the
//!   headers within [`ServerConfig::header_read_timeout`], so no request
//!   holds its connection for longer than the two together. Every error is
//!   a JSON [`ApiError`](kvbm_schema::protocol::ApiError) with a 4xx status
//!   (a 5xx only for a failure of the server itself), requests the HTTP
//!   layer cannot parse included.
//! - At most [`ServerConfig::max_clients`] WebSocket clients at once
//!   (`503 too_many_clients` beyond), at most
//!   [`ServerConfig::max_connections`] TCP connections, and at most
//!   [`ServerConfig::max_connections_per_ip`] from one address, so one
//!   client cannot take every place. One more place is kept for a
//!   connection from `127.0.0.1` or `::1` when every other is taken (a
//!   health check or an operator's command: one request, short deadlines,
//!   no WebSocket). Refusals are counted; the warning they log is written
//!   at most every 10 s, with the number left unsaid
//!   (`kvbm_http_refusals_unlogged_total`).
//! - Every breakpoint has an owner. One set over a WebSocket (or over HTTP
//!   with that client's id *and* key, [`CLIENT_KEY_HEADER`](kvbm_schema::protocol::CLIENT_KEY_HEADER))
//!   belongs to that connection; one set over HTTP without them (a step
//!   too) belongs to a lease of [`ServerConfig::lease`] (5 minutes) and is
//!   removed, with what it paused, when the lease runs out.
//! - When a WebSocket client goes away (closes, stalls, falls silent), the
//!   breakpoints it set are removed and the calls they paused resume
//!   ([`ServerConfig::release_on_disconnect`], on by default), so an engine
//!   is never left stuck on a console that is not there. This happens in a
//!   drop guard, so it runs however the connection ends, the server's
//!   shutdown included. And a pause that runs out its deadline removes the
//!   breakpoint that made it (see `kvbm_core::hooks`).

mod api;
mod conn;
mod control;
mod feeder;
mod http;
mod live;
mod metrics;
mod reduce;
mod secret;
mod ws;

pub use feeder::{Feeder, FeederConfig, FeederStats, spawn_feeder};

use kvbm_events::RunId;
use kvbm_events::bus::BusCounters;
use kvbm_events::control::BreakpointsView;
use kvbm_events::control::Control;
use kvbm_events::ring::RingBuffer;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// Default address: loopback, port 7070.
pub const DEFAULT_ADDR: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 7070);

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Where to listen (`127.0.0.1:7070`; port 0 picks a free port).
    pub addr: SocketAddr,
    /// The bearer token; required to bind anything but `127.0.0.1`/`::1`.
    pub token: Option<String>,
    /// With a token: let read-only requests (`GET`, the event stream)
    /// through without it.
    pub open_read: bool,
    /// Most WebSocket clients at once.
    pub max_clients: usize,
    /// Most TCP connections open at once (HTTP and WebSocket together; at
    /// least `max_clients`). One more is answered `503` and closed, and
    /// counted (`kvbm_http_connections_refused_total`).
    pub max_connections: usize,
    /// Most TCP connections from one client address at once (taken as at
    /// most `max_connections`). One more connection is accepted from
    /// `127.0.0.1` or `::1` when every place is taken, for one request.
    pub max_connections_per_ip: usize,
    /// A connection that has not delivered a request's headers this long
    /// after it opened (or after its previous response) is closed: a
    /// stuck or deliberately slow client cannot hold its place.
    pub header_read_timeout: Duration,
    /// A request whose body has not arrived this long after its headers is
    /// answered `408` and its connection closed.
    pub request_timeout: Duration,
    /// How often each WebSocket client is pinged.
    pub ping_interval: Duration,
    /// A WebSocket client from which nothing (not even a pong) has arrived
    /// this long is disconnected, and its breakpoints released.
    pub silence_timeout: Duration,
    /// How long a breakpoint (or a step) set over HTTP without a client
    /// lives: when its lease runs out it is removed (the step disarmed)
    /// and what it paused resumes.
    pub lease: Duration,
    /// Largest request body (and WebSocket message from a client), bytes.
    pub max_body_bytes: usize,
    /// Remove a WebSocket client's breakpoints and resume its paused calls
    /// when it disconnects.
    pub release_on_disconnect: bool,
    /// A send to a WebSocket client that takes longer than this
    /// disconnects it (see the module docs).
    pub send_timeout: Duration,
    /// Most events in one binary frame (also capped by the ring's
    /// `max_read`).
    pub max_batch_events: usize,
    /// Events kept encoded for the live stream (the live window).
    pub live_window_events: usize,
    /// How often breakpoints and paused calls are polled for changes to
    /// push to WebSocket clients.
    pub breakpoints_poll: Duration,
    /// Finished slots the server's reducer keeps (older ones are pruned, so
    /// a long-running engine's snapshot stays bounded).
    pub keep_finished_slots: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            addr: DEFAULT_ADDR,
            token: None,
            open_read: false,
            max_clients: 64,
            max_connections: 256,
            max_connections_per_ip: 64,
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            ping_interval: Duration::from_secs(5),
            silence_timeout: Duration::from_secs(15),
            lease: crate::ANONYMOUS_LEASE,
            max_body_bytes: 64 * 1024,
            release_on_disconnect: true,
            send_timeout: Duration::from_secs(5),
            max_batch_events: 1024,
            live_window_events: 65_536,
            breakpoints_poll: Duration::from_millis(100),
            keep_finished_slots: 10_000,
        }
    }
}

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A non-loopback address without a token.
    #[error(
        "refusing to serve on {addr} without a token: only 127.0.0.1 and ::1 may be bound \
         without one (set a token, e.g. --token)"
    )]
    TokenRequired {
        /// The address asked for.
        addr: SocketAddr,
    },
    /// An unusable token.
    #[error("unusable token: {0}")]
    BadToken(&'static str),
    /// An unusable setting.
    #[error("invalid server setting {field}: {reason}")]
    BadConfig {
        /// The setting.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// Binding the address failed.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving: {0}")]
    Io(#[from] std::io::Error),
    /// The server task panicked or was cancelled.
    #[error("the server task ended abnormally: {0}")]
    Task(String),
}

/// Wakes the server when the ring gets new events. The feeder
/// ([`spawn_feeder`]) signals it; clone it freely.
#[derive(Clone)]
pub struct RingSignal {
    tx: Arc<watch::Sender<u64>>,
    attached: Arc<AtomicBool>,
}

impl fmt::Debug for RingSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingSignal")
            .field("pushed", &*self.tx.borrow())
            .field("attached", &self.is_attached())
            .finish()
    }
}

impl Default for RingSignal {
    fn default() -> Self {
        Self::new()
    }
}

impl RingSignal {
    /// A signal nobody has attached to yet.
    pub fn new() -> Self {
        RingSignal {
            tx: Arc::new(watch::Sender::new(0)),
            attached: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Says that the ring now holds `pushed` events in all (its
    /// `counters().pushed`); wakes whoever waits.
    pub fn notify(&self, pushed: u64) {
        self.tx.send_replace(pushed);
    }

    /// Marks the signal as driven by a feeder: the server then relies on
    /// it rather than polling the ring every millisecond.
    pub fn mark_attached(&self) {
        self.attached.store(true, Ordering::Release);
    }

    /// Whether a feeder drives the signal.
    pub fn is_attached(&self) -> bool {
        self.attached.load(Ordering::Acquire)
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.tx.subscribe()
    }
}

type BusCountersFn = Arc<dyn Fn() -> BusCounters + Send + Sync>;

/// What the server serves: an engine's ring, its breakpoint control (if it
/// takes commands), its id, and optionally its bus counters (for
/// `/metrics`) and what it runs as (for `/health` and `/snapshot`).
#[derive(Clone)]
pub struct ServedEngine {
    ring: Arc<RingBuffer>,
    control: Option<Arc<dyn Control>>,
    id: u32,
    run: RunId,
    bus_counters: Option<BusCountersFn>,
    signal: RingSignal,
    info: Option<Arc<serde_json::Value>>,
}

impl fmt::Debug for ServedEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServedEngine")
            .field("id", &self.id)
            .field("run", &self.run)
            .field("ring_capacity", &self.ring.capacity())
            .field("control", &self.control.is_some())
            .field("bus_counters", &self.bus_counters.is_some())
            .field("info", &self.info)
            .finish()
    }
}

impl ServedEngine {
    /// An engine whose events are in `ring` (fed by [`spawn_feeder`] with
    /// [`signal`](Self::signal), or by anything else). Its run id is a
    /// fresh random one unless [`with_run`](Self::with_run) names the
    /// engine's own ([`kvbm_events::Emitter::run`]), which a recording of
    /// the same engine then shares.
    pub fn new(ring: Arc<RingBuffer>, id: u32) -> Self {
        ServedEngine {
            ring,
            control: None,
            id,
            run: RunId::random(),
            bus_counters: None,
            signal: RingSignal::new(),
            info: None,
        }
    }

    /// Says what the engine runs as: a JSON object whose `summary` is one
    /// line for a person (e.g. `"vLLM · tp 2 · async scheduling · G2 8,192
    /// tokens (4.0 MiB a rank) · G3 none"`), with the facts behind it
    /// beside (`tensor_parallel`, `async_scheduling`, ...). Served as is
    /// as `engine_info` in each WebSocket's `Hello` (an attached console
    /// shows the summary in its header) and in `GET /health` and
    /// `GET /snapshot` (for scripts).
    pub fn with_info(mut self, info: serde_json::Value) -> Self {
        self.info = Some(Arc::new(info));
        self
    }

    /// What the engine runs as ([`with_info`](Self::with_info)), if said.
    pub fn info(&self) -> Option<&serde_json::Value> {
        self.info.as_deref()
    }

    /// Takes breakpoint commands through `control` (for a kvbm engine, its
    /// `kvbm_core::hooks::Breakpoints`).
    pub fn with_control(mut self, control: Arc<dyn Control>) -> Self {
        self.control = Some(control);
        self
    }

    /// Reports the engine's bus counters in `/metrics` (events emitted,
    /// lagged, dropped), e.g. `move || emitter.bus().counters()`.
    pub fn with_bus_counters(
        mut self,
        f: impl Fn() -> BusCounters + Send + Sync + 'static,
    ) -> Self {
        self.bus_counters = Some(Arc::new(f));
        self
    }

    /// Serves the engine run `run` (its emitter's [`kvbm_events::Emitter::run`]).
    pub fn with_run(mut self, run: RunId) -> Self {
        self.run = run;
        self
    }

    /// Uses this signal rather than a fresh one (to share one feeder's
    /// signal between engines built from the same ring).
    pub fn with_signal(mut self, signal: RingSignal) -> Self {
        self.signal = signal;
        self
    }

    /// The signal to hand to [`spawn_feeder`].
    pub fn signal(&self) -> RingSignal {
        self.signal.clone()
    }

    /// The ring.
    pub fn ring(&self) -> &Arc<RingBuffer> {
        &self.ring
    }

    /// The breakpoint control, if the engine takes commands.
    pub fn control(&self) -> Option<&Arc<dyn Control>> {
        self.control.as_ref()
    }

    /// The engine id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The engine run.
    pub fn run(&self) -> RunId {
        self.run
    }
}

/// The server's own counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServerStats {
    /// WebSocket clients connected now.
    pub clients_connected: usize,
    /// WebSocket clients accepted since start.
    pub clients_accepted: u64,
    /// WebSocket clients refused because of the cap.
    pub clients_rejected: u64,
    /// Clients disconnected for being too slow.
    pub slow_disconnects: u64,
    /// Clients disconnected because nothing, not even a pong, came from
    /// them for the silence timeout.
    pub silent_disconnects: u64,
    /// WebSocket messages from clients over the size limit (each answered
    /// with an error, then the connection closed).
    pub messages_too_large: u64,
    /// Events sent, summed over clients.
    pub events_sent: u64,
    /// Gap messages sent, summed over clients.
    pub gaps_sent: u64,
    /// Events announced missing by those gaps.
    pub gap_events: u64,
    /// Requests refused for a missing or wrong token.
    pub unauthorized: u64,
    /// TCP connections open now (HTTP and WebSocket).
    pub connections_open: usize,
    /// TCP connections refused because `max_connections` were open, or
    /// `max_connections_per_ip` from the same address.
    pub connections_refused: u64,
    /// Refusals not logged one by one (the warning is rate-limited).
    pub refusals_unlogged: u64,
    /// Connections taken into the place kept for loopback.
    pub reserve_used: u64,
    /// Requests the HTTP layer could not parse (answered with a JSON
    /// error all the same).
    pub unparsable_requests: u64,
    /// Requests whose body did not arrive in time (`408`).
    pub request_timeouts: u64,
    /// Breakpoint leases that ran out (their breakpoints removed).
    pub leases_expired: u64,
    /// Breakpoints and steps without a client refused because as many
    /// leases as the server keeps owned something (`409`).
    pub leases_refused: u64,
    /// Leases of breakpoints and steps set without a client, alive now.
    pub leases_alive: usize,
}

#[derive(Debug, Default)]
struct Counters {
    connected: AtomicUsize,
    accepted: AtomicU64,
    rejected: AtomicU64,
    slow: AtomicU64,
    silent: AtomicU64,
    too_large: AtomicU64,
    request_timeouts: AtomicU64,
    leases_expired: AtomicU64,
    leases_refused: AtomicU64,
    events_sent: AtomicU64,
    gaps_sent: AtomicU64,
    gap_events: AtomicU64,
    unauthorized: AtomicU64,
    conns: Arc<conn::ConnCounters>,
    open: Option<conn::OpenGauge>,
}

impl Counters {
    fn stats(&self) -> ServerStats {
        ServerStats {
            clients_connected: self.connected.load(Ordering::Relaxed),
            clients_accepted: self.accepted.load(Ordering::Relaxed),
            clients_rejected: self.rejected.load(Ordering::Relaxed),
            slow_disconnects: self.slow.load(Ordering::Relaxed),
            silent_disconnects: self.silent.load(Ordering::Relaxed),
            messages_too_large: self.too_large.load(Ordering::Relaxed),
            events_sent: self.events_sent.load(Ordering::Relaxed),
            gaps_sent: self.gaps_sent.load(Ordering::Relaxed),
            gap_events: self.gap_events.load(Ordering::Relaxed),
            unauthorized: self.unauthorized.load(Ordering::Relaxed),
            connections_open: self.open.as_ref().map_or(0, conn::OpenGauge::open),
            connections_refused: self.conns.refused.load(Ordering::Relaxed),
            refusals_unlogged: self.conns.unlogged.load(Ordering::Relaxed),
            reserve_used: self.conns.reserve_used.load(Ordering::Relaxed),
            unparsable_requests: self.conns.unparsable.load(Ordering::Relaxed),
            request_timeouts: self.request_timeouts.load(Ordering::Relaxed),
            leases_expired: self.leases_expired.load(Ordering::Relaxed),
            leases_refused: self.leases_refused.load(Ordering::Relaxed),
            // Filled in by `AppState::stats`, which holds the leases.
            leases_alive: 0,
        }
    }
}

/// Everything the handlers share.
struct AppState {
    cfg: ServerConfig,
    engine: ServedEngine,
    counters: Counters,
    next_client: AtomicU64,
    /// Connected WebSocket clients: id → the key that proves a request
    /// comes from whoever holds the connection. Locked around every command
    /// that gives a breakpoint an owner, and around a client's removal, so
    /// a breakpoint is never given to a client that is already gone.
    clients: Mutex<HashMap<u64, String>>,
    /// Leases owning breakpoints set over HTTP without a client: owner id
    /// → when it runs out.
    leases: Mutex<HashMap<u64, std::time::Instant>>,
    live: Arc<live::LiveWindow>,
    reduced: Arc<reduce::Reduced>,
    /// The newest breakpoints view, pushed to clients.
    bp_view: watch::Receiver<Arc<BreakpointsView>>,
    bp_tx: Arc<watch::Sender<Arc<BreakpointsView>>>,
    /// Poked after every control command, so the push follows at once.
    bp_poke: Notify,
    shutdown: watch::Receiver<bool>,
}

impl AppState {
    /// The counters, and the gauges kept outside them.
    fn stats(&self) -> ServerStats {
        ServerStats {
            leases_alive: self.leases.lock().unwrap_or_else(|e| e.into_inner()).len(),
            ..self.counters.stats()
        }
    }

    fn new(
        cfg: ServerConfig,
        engine: ServedEngine,
        counters: Counters,
        shutdown: watch::Receiver<bool>,
    ) -> AppState {
        let (bp_tx, bp_view) = watch::channel(Arc::new(BreakpointsView::default()));
        let live = Arc::new(live::LiveWindow::new(
            cfg.live_window_events,
            engine.ring.counters().pushed,
        ));
        AppState {
            cfg,
            engine,
            counters,
            next_client: AtomicU64::new(1),
            clients: Mutex::new(HashMap::new()),
            leases: Mutex::new(HashMap::new()),
            live,
            reduced: Arc::new(reduce::Reduced::new()),
            bp_view,
            bp_tx: Arc::new(bp_tx),
            bp_poke: Notify::new(),
            shutdown,
        }
    }

    fn max_batch(&self) -> usize {
        self.cfg
            .max_batch_events
            .clamp(1, self.engine.ring.config().max_read)
    }
}

/// A bound, not yet running, server.
pub struct Server {
    listener: conn::CappedListener,
    local_addr: SocketAddr,
    state: Arc<AppState>,
    shutdown_tx: watch::Sender<bool>,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

/// Whether `addr` may be bound without a token.
pub fn is_loopback_exempt(addr: &SocketAddr) -> bool {
    match addr.ip() {
        IpAddr::V4(ip) => ip == Ipv4Addr::LOCALHOST,
        IpAddr::V6(ip) => ip == std::net::Ipv6Addr::LOCALHOST,
    }
}

/// Why `token` cannot be a bearer token (it goes in an HTTP header), if
/// it cannot: so a program taking one from its user can refuse it where
/// it was given, before any server starts.
pub fn token_unusable(token: &str) -> Option<&'static str> {
    if token.is_empty() {
        Some("it is empty")
    } else if token.len() > 4096 {
        Some("it is longer than 4096 bytes")
    } else if !token.bytes().all(|b| b.is_ascii_graphic()) {
        Some("it must be printable ASCII without spaces")
    } else {
        None
    }
}

fn check_config(cfg: &ServerConfig) -> Result<(), ServerError> {
    if let Some(t) = &cfg.token {
        if let Some(why) = token_unusable(t) {
            return Err(ServerError::BadToken(why));
        }
    } else if !is_loopback_exempt(&cfg.addr) {
        return Err(ServerError::TokenRequired { addr: cfg.addr });
    }
    let bad = |field, reason: &str| {
        Err(ServerError::BadConfig {
            field,
            reason: reason.to_string(),
        })
    };
    if cfg.max_clients == 0 {
        return bad("max_clients", "must be at least 1");
    }
    if cfg.max_connections < cfg.max_clients {
        return bad("max_connections", "must be at least max_clients");
    }
    if cfg.max_connections_per_ip == 0 {
        return bad("max_connections_per_ip", "must be at least 1");
    }
    if cfg.header_read_timeout.is_zero() {
        return bad("header_read_timeout", "must be more than 0");
    }
    if cfg.request_timeout.is_zero() {
        return bad("request_timeout", "must be more than 0");
    }
    if cfg.ping_interval.is_zero() {
        return bad("ping_interval", "must be more than 0");
    }
    if cfg.silence_timeout <= cfg.ping_interval {
        return bad(
            "silence_timeout",
            "must be longer than ping_interval (a client needs a ping to answer)",
        );
    }
    if cfg.lease.is_zero() {
        return bad("lease", "must be more than 0");
    }
    if !(256..=(64 << 20)).contains(&cfg.max_body_bytes) {
        return bad("max_body_bytes", "must be between 256 bytes and 64 MiB");
    }
    if cfg.send_timeout.is_zero() {
        return bad("send_timeout", "must be positive");
    }
    if cfg.max_batch_events == 0 {
        return bad("max_batch_events", "must be at least 1");
    }
    if cfg.live_window_events == 0 {
        return bad("live_window_events", "must be at least 1");
    }
    if cfg.breakpoints_poll.is_zero() {
        return bad("breakpoints_poll", "must be positive");
    }
    Ok(())
}

impl Server {
    /// Checks the configuration (a non-loopback address needs a token) and
    /// binds the address. Nothing runs until [`run`](Self::run) or
    /// [`spawn`](Self::spawn).
    pub async fn bind(cfg: ServerConfig, engine: ServedEngine) -> Result<Server, ServerError> {
        check_config(&cfg)?;
        let listener = tokio::net::TcpListener::bind(cfg.addr)
            .await
            .map_err(|source| ServerError::Bind {
                addr: cfg.addr,
                source,
            })?;
        let local_addr = listener.local_addr()?;
        let conns = Arc::new(conn::ConnCounters::default());
        let listener = conn::CappedListener::new(
            listener,
            conn::Caps {
                max: cfg.max_connections,
                per_ip: cfg.max_connections_per_ip.min(cfg.max_connections),
            },
            conns.clone(),
        );
        let counters = Counters {
            conns,
            open: Some(listener.open_gauge()),
            ..Counters::default()
        };
        let (shutdown_tx, shutdown) = watch::channel(false);
        let state = Arc::new(AppState::new(cfg, engine, counters, shutdown));
        Ok(Server {
            listener,
            local_addr,
            state,
            shutdown_tx,
        })
    }

    /// The address bound (with the real port when asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The server's counters.
    pub fn stats(&self) -> ServerStats {
        self.state.stats()
    }

    /// Serves until `shutdown` completes; then closes every WebSocket
    /// (releasing its breakpoints) and returns.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let Server {
            listener,
            local_addr: _,
            state,
            shutdown_tx,
        } = self;
        let shutdown_tx = Arc::new(shutdown_tx);
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(live::run_encoder(state.clone()));
        tasks.spawn(reduce::run_reducer(state.clone()));
        if state.engine.control.is_some() {
            tasks.spawn(control::run_breakpoint_watch(state.clone()));
        }
        let router = http::router(state.clone());
        let tx = shutdown_tx.clone();
        // The listener caps connections and sets TCP_NODELAY on each.
        let header_timeout = state.cfg.header_read_timeout;
        let write_stall = state.cfg.request_timeout;
        conn::serve(listener, router, header_timeout, write_stall, async move {
            shutdown.await;
            tx.send_replace(true);
        })
        .await;
        shutdown_tx.send_replace(true);
        // WebSocket tasks outlive the HTTP connections they came from; give
        // them a moment to say goodbye (their drop guards release their
        // breakpoints either way).
        let t = tokio::time::Instant::now();
        while state.counters.connected.load(Ordering::Acquire) > 0
            && t.elapsed() < Duration::from_secs(2)
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tasks.shutdown().await;
        Ok(())
    }

    /// Runs the server on the current tokio runtime; the handle stops it.
    pub fn spawn(self) -> ServerHandle {
        let addr = self.local_addr;
        let state = self.state.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let join = tokio::spawn(self.run(async move {
            let _ = rx.await;
        }));
        ServerHandle {
            addr,
            state,
            stop: Some(tx),
            join,
        }
    }
}

/// A running server ([`Server::spawn`]).
pub struct ServerHandle {
    addr: SocketAddr,
    state: Arc<AppState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    join: tokio::task::JoinHandle<Result<(), ServerError>>,
}

impl fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerHandle")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl ServerHandle {
    /// The address bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's counters.
    pub fn stats(&self) -> ServerStats {
        self.state.stats()
    }

    /// Stops the server and waits for it.
    pub async fn shutdown(mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match (&mut self.join).await {
            Ok(r) => r,
            Err(e) => Err(ServerError::Task(e.to_string())),
        }
    }
}

/// Completes when the server starts shutting down.
async fn shutting_down(rx: &mut watch::Receiver<bool>) {
    // The `Ref` is dropped here, never held across an await of the caller.
    let _ = rx.wait_for(|s| *s).await.map(|_| ());
}
