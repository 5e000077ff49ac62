//! A client of the attach server (see [`kvbm_schema::protocol`]): what the
//! console's `attach` and `kvbm-recorder record --from` run.
//!
//! [`Client::spawn`] starts one task on a tokio runtime that connects to
//! `GET /events?since=SEQ&run=RUN&version=3`, checks the server's
//! [`ServerMsg::Hello`], and hands everything it reads to the caller as
//! [`ClientEvent`]s through a bounded channel, in order:
//!
//! - events (each binary frame decoded with [`decode_batch`]), with
//!   duplicates (sequence numbers already delivered) dropped and counted;
//! - gaps: the server's [`ServerMsg::Gap`]s, and any jump in the sequence
//!   the server did not announce (reported as a [`Gap`] with
//!   `announced: false` and counted), so no loss is ever silent;
//! - breakpoint views the server pushes, the end of the backfill, and the
//!   connection coming and going.
//!
//! When the connection drops, the task reconnects with capped exponential
//! backoff ([`Backoff`]: 100 ms doubling to 5 s by default, back to the
//! start after a connection that stayed up [`ClientConfig::healthy_after`])
//! and resumes with `since = last seq + 1` in the run it was following, so
//! a consumer sees every event once, or a gap saying it will not.
//! [`ClientHandle::state`] says where the connection stands ([`ConnState`])
//! for display, and [`ClientHandle::engine_info`] what the engine runs as
//! (its latest hello's `engine_info`, kept while disconnected and replaced
//! at every connection, so a restarted engine's new description shows).
//!
//! **Engine restarts.** Every hello names the engine's run
//! ([`kvbm_events::RunId`]). When the run after a reconnection is not the
//! one the client was following (the engine restarted, whatever its
//! sequence numbers and clocks say), the client never splices the two: it
//! delivers [`ClientEvent::NewRun`] before the new run's `Connected`, and
//! the new run's events from its first (the server starts a client that
//! resumes in another run at seq 0, announcing what it no longer holds as
//! a gap). A consumer starts a new recording (or a new model) there.
//!
//! Errors a retry cannot fix end the task: a protocol version mismatch
//! (from the server's `Hello`, or its HTTP 400 `protocol_mismatch` refusal),
//! a refused token, another 4xx refusal, or a stream that went back within
//! one run (which a sound server never sends). The last [`ClientEvent`] is
//! then [`ClientEvent::Failed`] and the state [`ConnState::Failed`].
//!
//! Control commands ([`ControlCommand`]) go over the same connection and
//! wait for their [`ServerMsg::Reply`] with a timeout, from async code
//! ([`ClientHandle::control`]) or from a plain thread
//! ([`ClientHandle::control_blocking`], for synchronous callers like the
//! console's key handling; it blocks the calling thread, so it must not be
//! called on a current-thread runtime's own thread).
//!
//! Every queue is bounded: the event channel (a slow consumer holds the
//! reader back, so TCP pushes back on the server, whose ring then reports
//! what it overwrote as a gap), the command channel (a full one refuses
//! with [`ControlError::Busy`]) and the table of commands awaiting a reply.
//! [`ClientHandle::counters`] counts what went through each.

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use kvbm_events::control::{BreakpointsView, ControlCommand, ControlResult};
use kvbm_events::{Event, RunId};
use kvbm_schema::protocol::{
    ApiError, ClientMsg, GapReason, PROTOCOL_VERSION, ServerMsg, VERSION_HEADER, decode_batch,
};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::{self, Message};

// ---------------------------------------------------------------- URLs

/// An attach server's address, from `http://HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// Host name or IP address (IPv6 without its brackets).
    pub host: String,
    /// TCP port (never 0).
    pub port: u16,
}

/// Why an attach URL was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Not of the form `http://HOST:PORT`.
    #[error("`{url}` is not an attach URL ({reason}); expected http://HOST:PORT")]
    Malformed {
        /// What was given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A ZeroMQ KV-event stream (`zmq://` or `tcp://`): read by
    /// `kvbm_ingest::vllm::ZmqSource`, not by this client.
    #[error(
        "`{url}` is a ZeroMQ KV-event stream, not an attach server (`attach` and `record --from` read it with the vLLM source)"
    )]
    ZmqStream {
        /// What was given.
        url: String,
    },
    /// A scheme kvbm knows of but does not read yet.
    #[error("`{url}`: {scheme}:// sources are not supported yet ({what})")]
    NotSupportedYet {
        /// What was given.
        url: String,
        /// Its scheme.
        scheme: String,
        /// What that scheme would be.
        what: &'static str,
    },
}

/// Longest URL accepted (a DNS name is at most 253 characters).
const MAX_URL: usize = 512;

impl Endpoint {
    /// Parses `http://HOST:PORT` (or `ws://HOST:PORT`; a trailing `/` is
    /// allowed). `HOST` is a DNS name, an IPv4 address or a bracketed IPv6
    /// address. Never panics.
    pub fn parse(url: &str) -> Result<Endpoint, UrlError> {
        let bad = |reason: &str| UrlError::Malformed {
            url: url.chars().take(80).collect(),
            reason: reason.to_string(),
        };
        let s = url.trim();
        if s.len() > MAX_URL {
            return Err(bad("too long"));
        }
        let Some((scheme, rest)) = s.split_once("://") else {
            return Err(bad("no scheme"));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "http" | "ws" => {}
            "zmq" | "tcp" => {
                return Err(UrlError::ZmqStream { url: s.to_string() });
            }
            "ipc" => {
                return Err(UrlError::NotSupportedYet {
                    url: s.to_string(),
                    scheme: scheme.to_ascii_lowercase(),
                    what: "ZeroMQ ipc:// transport",
                });
            }
            "https" | "wss" => {
                return Err(bad(
                    "TLS is not supported: attach over http:// on loopback or through an SSH tunnel",
                ));
            }
            _ => return Err(bad("the scheme must be http")),
        }
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        // Said here, before the authority is read, for the hint.
        if authority.contains('@') && !authority.contains(['/', '?', '#']) {
            return Err(bad("user info is not expected; pass a token with --token"));
        }
        let (host, port) = kvbm_events::addr::parse_authority(authority).map_err(bad)?;
        Ok(Endpoint {
            host: host.to_string(),
            port,
        })
    }

    fn host_port(&self) -> String {
        kvbm_events::addr::join_authority(&self.host, self.port)
    }

    /// The WebSocket URL of the event stream, resuming at `since` in run
    /// `run` (in another run the server starts from that run's beginning).
    pub fn events_url(&self, since: Option<u64>, run: Option<RunId>) -> String {
        let mut q = String::new();
        if let Some(s) = since {
            q.push_str(&format!("since={s}&"));
        }
        if let Some(r) = run {
            q.push_str(&format!("run={r}&"));
        }
        format!(
            "ws://{}/events?{q}version={PROTOCOL_VERSION}",
            self.host_port()
        )
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.host_port())
    }
}

// ---------------------------------------------------------------- backoff

/// When to try again after a connection failed: `initial`, doubling on
/// each consecutive failure, never more than `max`. No jitter: there is one
/// client per console, and a predictable schedule is easier to show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The wait after the first failure.
    pub initial: Duration,
    /// The longest wait.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(5),
        }
    }
}

impl Backoff {
    /// The wait before attempt `failures + 1`, after `failures` (≥ 1)
    /// consecutive failures: `initial × 2^(failures-1)`, capped at `max`.
    pub fn delay(&self, failures: u32) -> Duration {
        let shift = failures.saturating_sub(1).min(31);
        self.initial
            .checked_mul(1u32 << shift)
            .unwrap_or(self.max)
            .min(self.max)
    }
}

// ---------------------------------------------------------------- config

/// How a [`Client`] connects.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The server.
    pub endpoint: Endpoint,
    /// Sent as `Authorization: Bearer TOKEN`.
    pub token: Option<String>,
    /// First sequence number wanted (`None`: the oldest the server holds).
    pub since: Option<u64>,
    /// The reconnection schedule.
    pub backoff: Backoff,
    /// A connection that stayed up this long resets the backoff.
    pub healthy_after: Duration,
    /// Stop after this many consecutive failed attempts (`None`: never).
    pub max_failures: Option<u32>,
    /// [`ClientEvent`]s buffered for the consumer (≥ 1).
    pub channel_capacity: usize,
    /// Control commands queued for the connection (≥ 1).
    pub command_capacity: usize,
    /// Commands sent and awaiting a reply (≥ 1).
    pub max_pending: usize,
    /// Default wait for a command's reply.
    pub control_timeout: Duration,
    /// Wait for the TCP connection, the upgrade and the `Hello`.
    pub connect_timeout: Duration,
}

impl ClientConfig {
    /// Defaults for the server at `url` (`http://HOST:PORT`).
    pub fn new(url: &str) -> Result<Self, UrlError> {
        Ok(ClientConfig {
            endpoint: Endpoint::parse(url)?,
            token: None,
            since: None,
            backoff: Backoff::default(),
            healthy_after: Duration::from_secs(2),
            max_failures: None,
            channel_capacity: 256,
            command_capacity: 64,
            max_pending: 256,
            control_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
        })
    }

    /// With a bearer token.
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Starting at `since`.
    pub fn with_since(mut self, since: u64) -> Self {
        self.since = Some(since);
        self
    }
}

// ---------------------------------------------------------------- events

/// The server's greeting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The engine id.
    pub engine: u32,
    /// The engine run being served.
    pub run: RunId,
    /// This connection's client id.
    pub client: u64,
    /// This connection's secret, for acting for it over HTTP
    /// ([`kvbm_schema::protocol::CLIENT_KEY_HEADER`]).
    pub client_key: String,
    /// Oldest sequence number the server held when it said hello.
    pub first_seq: Option<u64>,
    /// Newest.
    pub last_seq: Option<u64>,
    /// What the engine runs as, when it said (a JSON object whose
    /// `summary` is one line for a person); `None` from a server that
    /// says nothing, or is older than the field.
    pub engine_info: Option<serde_json::Value>,
}

/// Events `from_seq ..= to_seq` will never arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    /// First missing sequence number.
    pub from_seq: u64,
    /// Last missing sequence number.
    pub to_seq: u64,
    /// Why (an unannounced jump is reported as `Lost`).
    pub reason: GapReason,
    /// False when the server did not say so and the client saw the jump.
    pub announced: bool,
}

impl Gap {
    /// Events missing.
    pub fn len(&self) -> u64 {
        self.to_seq - self.from_seq + 1
    }

    /// Never true: a gap holds at least one event.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// What the client hands its consumer, in stream order.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientEvent {
    /// The engine restarted: the server now serves another run than the
    /// one followed so far. Comes just before that run's `Connected`; what
    /// follows is the new run from its start, never a continuation of the
    /// old one.
    NewRun {
        /// The run followed until now.
        previous: RunId,
        /// The new run.
        run: RunId,
        /// How many runs this client has followed, this one included.
        number: u32,
    },
    /// Connected (again); the server said hello.
    Connected(Hello),
    /// Events, in sequence order, none delivered before.
    Events(Vec<Event>),
    /// Events that will not arrive.
    Gap(Gap),
    /// The backfill is over; what follows is live.
    Live,
    /// The server's breakpoints and paused calls.
    Breakpoints(BreakpointsView),
    /// The connection dropped; the next attempt comes after `retry_in`.
    Disconnected {
        /// Why.
        error: String,
        /// Consecutive failures so far.
        failures: u32,
        /// Wait before the next attempt.
        retry_in: Duration,
    },
    /// The client gave up; nothing follows.
    Failed(ClientError),
}

/// Why the client gave up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// A bad URL.
    #[error(transparent)]
    Url(#[from] UrlError),
    /// The server speaks another protocol version.
    #[error(
        "protocol mismatch: this client speaks kvbm attach protocol v{client}, the server {}{}",
        server.map_or_else(|| "refused it".to_string(), |s| format!("speaks v{s}")),
        if message.is_empty() { String::new() } else { format!(" ({message})") }
    )]
    ProtocolMismatch {
        /// Our version.
        client: u32,
        /// The server's, when it said.
        server: Option<u32>,
        /// The server's message.
        message: String,
    },
    /// The token was missing or wrong.
    #[error("unauthorized: {0} (pass the server's token with --token)")]
    Unauthorized(String),
    /// Another refusal a retry cannot fix.
    #[error("the server refused the connection with HTTP {status}: {message}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// Its message.
        message: String,
    },
    /// After a reconnection to the same engine run, the server's stream
    /// went back: it holds fewer events than were already delivered, or
    /// its time went back. A sound server never does this (a restarted
    /// engine has another run id, and is followed as a
    /// [`ClientEvent::NewRun`]).
    #[error(
        "the server's stream went back within one engine run ({why}); attach again to \
         follow it"
    )]
    StreamReset {
        /// What went back.
        why: String,
    },
    /// `max_failures` consecutive attempts failed.
    #[error("gave up after {failures} failed attempts; last: {last}")]
    GaveUp {
        /// Attempts.
        failures: u32,
        /// The last error.
        last: String,
    },
}

/// Where the connection stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnState {
    /// Trying to connect (attempt `attempt`, 1 for the first).
    Connecting {
        /// Attempt number since the last healthy connection.
        attempt: u32,
    },
    /// Connected.
    Connected {
        /// The server's greeting.
        hello: Hello,
        /// Since when.
        since: Instant,
        /// How many engine runs this client has followed (1 until the
        /// engine restarts).
        run_number: u32,
    },
    /// Waiting to try again.
    Reconnecting {
        /// The attempt that comes next.
        attempt: u32,
        /// When.
        next_try: Instant,
        /// Why the last one ended.
        error: String,
    },
    /// Gave up (see [`ClientEvent::Failed`]).
    Failed {
        /// Why.
        error: String,
    },
    /// The client was stopped.
    Stopped,
}

impl ConnState {
    /// True while connected.
    pub fn is_connected(&self) -> bool {
        matches!(self, ConnState::Connected { .. })
    }

    /// A short line for a status bar, e.g. `ATTACHED`,
    /// `RECONNECTING (attempt 3, next in 0.8 s)`.
    pub fn describe(&self, now: Instant) -> String {
        match self {
            ConnState::Connecting { attempt: 1 } => "CONNECTING".into(),
            ConnState::Connecting { attempt } => format!("CONNECTING (attempt {attempt})"),
            ConnState::Connected { run_number, .. } if *run_number > 1 => {
                format!("ATTACHED · RUN {run_number} (engine restarted)")
            }
            ConnState::Connected { .. } => "ATTACHED".into(),
            ConnState::Reconnecting {
                attempt, next_try, ..
            } => format!(
                "RECONNECTING (attempt {attempt}, next in {:.1} s)",
                next_try.saturating_duration_since(now).as_secs_f64()
            ),
            ConnState::Failed { .. } => "DETACHED (failed)".into(),
            ConnState::Stopped => "DETACHED".into(),
        }
    }
}

// ---------------------------------------------------------------- counters

#[derive(Debug, Default)]
struct Counters {
    events: AtomicU64,
    batches: AtomicU64,
    bytes: AtomicU64,
    duplicates: AtomicU64,
    gaps: AtomicU64,
    gap_events: AtomicU64,
    unannounced_gap_events: AtomicU64,
    bad_frames: AtomicU64,
    connects: AtomicU64,
    new_runs: AtomicU64,
    disconnects: AtomicU64,
    consumer_full: AtomicU64,
    commands_sent: AtomicU64,
    replies: AtomicU64,
    command_timeouts: AtomicU64,
    commands_refused_busy: AtomicU64,
    orphan_replies: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// What the client has done, since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ClientCounters {
    /// Events delivered.
    pub events: u64,
    /// Binary frames read.
    pub batches: u64,
    /// Bytes of binary frames read.
    pub bytes: u64,
    /// Events dropped as already delivered (after a reconnect).
    pub duplicates: u64,
    /// Gaps delivered.
    pub gaps: u64,
    /// Events those gaps cover.
    pub gap_events: u64,
    /// Of which the server did not announce.
    pub unannounced_gap_events: u64,
    /// Frames that did not decode (each ends the connection; the events
    /// are asked for again).
    pub bad_frames: u64,
    /// Connections made (Hello received).
    pub connects: u64,
    /// Engine restarts seen (a hello naming another run than the one
    /// followed).
    pub new_runs: u64,
    /// Connections lost or attempts failed.
    pub disconnects: u64,
    /// Times the consumer's channel was full (the reader waited).
    pub consumer_full: u64,
    /// Commands sent.
    pub commands_sent: u64,
    /// Replies received.
    pub replies: u64,
    /// Commands whose reply did not come in time.
    pub command_timeouts: u64,
    /// Commands refused because the queue or the pending table was full.
    pub commands_refused_busy: u64,
    /// Replies nobody waited for any more.
    pub orphan_replies: u64,
}

impl Counters {
    fn snapshot(&self) -> ClientCounters {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ClientCounters {
            events: g(&self.events),
            batches: g(&self.batches),
            bytes: g(&self.bytes),
            duplicates: g(&self.duplicates),
            gaps: g(&self.gaps),
            gap_events: g(&self.gap_events),
            unannounced_gap_events: g(&self.unannounced_gap_events),
            bad_frames: g(&self.bad_frames),
            connects: g(&self.connects),
            new_runs: g(&self.new_runs),
            disconnects: g(&self.disconnects),
            consumer_full: g(&self.consumer_full),
            commands_sent: g(&self.commands_sent),
            replies: g(&self.replies),
            command_timeouts: g(&self.command_timeouts),
            commands_refused_busy: g(&self.commands_refused_busy),
            orphan_replies: g(&self.orphan_replies),
        }
    }
}

// ---------------------------------------------------------------- control

/// Why a control command got no result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// Not connected now.
    #[error("not connected to the server")]
    NotConnected,
    /// No reply in time.
    #[error("no reply from the server within {0:?}")]
    Timeout(Duration),
    /// The connection closed before the reply.
    #[error("the connection closed before the reply came")]
    Disconnected,
    /// Too many commands queued or in flight.
    #[error("too many commands in flight")]
    Busy,
    /// The client has stopped.
    #[error("the client has stopped")]
    Stopped,
    /// The server answered with an error.
    #[error("the server refused: {0}")]
    Server(ApiError),
}

type ControlReply = Result<ControlResult, ControlError>;

enum ReplyTo {
    Async(oneshot::Sender<ControlReply>),
    Sync(std::sync::mpsc::SyncSender<ControlReply>),
}

impl ReplyTo {
    fn send(self, r: ControlReply) -> bool {
        match self {
            ReplyTo::Async(tx) => tx.send(r).is_ok(),
            ReplyTo::Sync(tx) => tx.try_send(r).is_ok(),
        }
    }
}

struct Command {
    command: ControlCommand,
    reply: ReplyTo,
    deadline: Instant,
}

// ---------------------------------------------------------------- client

/// A running client; see the module docs. Dropping it stops the
/// connection task (the server then sees the client go away).
pub struct Client {
    events: mpsc::Receiver<ClientEvent>,
    handle: ClientHandle,
    task: tokio::task::JoinHandle<()>,
}

/// A cheap, cloneable handle for the connection state, the counters and
/// control commands.
#[derive(Clone)]
pub struct ClientHandle {
    commands: mpsc::Sender<Command>,
    state: watch::Receiver<ConnState>,
    engine_info: watch::Receiver<Option<Arc<serde_json::Value>>>,
    counters: Arc<Counters>,
    control_timeout: Duration,
    endpoint: Endpoint,
}

impl Client {
    /// Starts the connection task on `rt`. Fails only on a bad
    /// configuration (a token that is not a valid header value).
    pub fn spawn(cfg: ClientConfig, rt: &tokio::runtime::Handle) -> Result<Client, ClientError> {
        if let Some(t) = &cfg.token
            && HeaderValue::from_str(&format!("Bearer {t}")).is_err()
        {
            return Err(ClientError::Unauthorized(
                "the token has characters a header cannot carry".into(),
            ));
        }
        let (ev_tx, ev_rx) = mpsc::channel(cfg.channel_capacity.max(1));
        let (cmd_tx, cmd_rx) = mpsc::channel(cfg.command_capacity.max(1));
        let (state_tx, state_rx) = watch::channel(ConnState::Connecting { attempt: 1 });
        let (info_tx, info_rx) = watch::channel(None);
        let counters = Arc::new(Counters::default());
        let handle = ClientHandle {
            commands: cmd_tx,
            state: state_rx,
            engine_info: info_rx,
            counters: counters.clone(),
            control_timeout: cfg.control_timeout,
            endpoint: cfg.endpoint.clone(),
        };
        let task = rt.spawn(run(cfg, ev_tx, cmd_rx, state_tx, info_tx, counters));
        Ok(Client {
            events: ev_rx,
            handle,
            task,
        })
    }

    /// The next event; `None` once the client stopped (after
    /// [`ClientEvent::Failed`], or when stopped).
    pub async fn recv(&mut self) -> Option<ClientEvent> {
        self.events.recv().await
    }

    /// The next event if one is waiting.
    pub fn try_recv(&mut self) -> Option<ClientEvent> {
        self.events.try_recv().ok()
    }

    /// A handle for state, counters and control.
    pub fn handle(&self) -> ClientHandle {
        self.handle.clone()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ClientHandle {
    /// The connection state now.
    pub fn state(&self) -> ConnState {
        self.state.borrow().clone()
    }

    /// A receiver of state changes.
    pub fn watch_state(&self) -> watch::Receiver<ConnState> {
        self.state.clone()
    }

    /// What the engine runs as: the `engine_info` of the latest hello
    /// (`None` before the first, or when the engine said nothing). Kept
    /// while disconnected; replaced at every connection, before the state
    /// says connected, so a restarted engine's description shows as soon
    /// as the new connection does.
    pub fn engine_info(&self) -> Option<Arc<serde_json::Value>> {
        self.engine_info.borrow().clone()
    }

    /// The counters now.
    pub fn counters(&self) -> ClientCounters {
        self.counters.snapshot()
    }

    /// The server.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    fn queue(
        &self,
        command: ControlCommand,
        reply: ReplyTo,
        timeout: Duration,
    ) -> Result<(), ControlError> {
        if !self.state.borrow().is_connected() {
            return Err(ControlError::NotConnected);
        }
        let cmd = Command {
            command,
            reply,
            deadline: Instant::now() + timeout,
        };
        match self.commands.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => {
                bump(&self.counters.commands_refused_busy, 1);
                Err(ControlError::Busy)
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(ControlError::Stopped),
        }
    }

    /// Sends `command` and waits for its reply (at most the configured
    /// `control_timeout`).
    pub async fn control(&self, command: ControlCommand) -> ControlReply {
        self.control_with_timeout(command, self.control_timeout)
            .await
    }

    /// Sends `command` and waits for its reply, at most `timeout`.
    pub async fn control_with_timeout(
        &self,
        command: ControlCommand,
        timeout: Duration,
    ) -> ControlReply {
        let (tx, rx) = oneshot::channel();
        self.queue(command, ReplyTo::Async(tx), timeout)?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ControlError::Stopped),
            Err(_) => {
                bump(&self.counters.command_timeouts, 1);
                Err(ControlError::Timeout(timeout))
            }
        }
    }

    /// [`ClientHandle::control_with_timeout`] for synchronous code: blocks
    /// the calling thread on a std channel (never a tokio primitive, so it
    /// cannot panic inside a runtime). The connection task must be able to
    /// run meanwhile: do not call it from a current-thread runtime's thread.
    pub fn control_blocking(&self, command: ControlCommand, timeout: Duration) -> ControlReply {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.queue(command, ReplyTo::Sync(tx), timeout)?;
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                bump(&self.counters.command_timeouts, 1);
                Err(ControlError::Timeout(timeout))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(ControlError::Stopped),
        }
    }
}

// ---------------------------------------------------------------- the task

/// How one connection ended.
enum Ended {
    /// Worth another try.
    Lost {
        error: String,
        connected_for: Option<Duration>,
    },
    /// Not worth another try.
    Fatal(ClientError),
    /// The consumer dropped its receiver.
    ConsumerGone,
}

/// What the stream has delivered; survives reconnections.
#[derive(Default)]
struct Cursor {
    /// The engine run followed (`None` until the first hello).
    run: Option<RunId>,
    /// Runs followed so far.
    runs: u32,
    /// The next sequence number wanted (`None` until known).
    next: Option<u64>,
    /// Timestamp of the last event delivered.
    last_ts: Option<u64>,
    /// Set on a reconnection: the next event's time is compared with
    /// `last_ts`.
    check_time: bool,
}

/// How far back in engine time the first event after a reconnection may
/// be before it is taken for another run (events emitted concurrently may
/// be stamped slightly out of sequence order).
const TIME_SLACK_NS: u64 = 1_000_000_000;

async fn run(
    cfg: ClientConfig,
    tx: mpsc::Sender<ClientEvent>,
    mut commands: mpsc::Receiver<Command>,
    state: watch::Sender<ConnState>,
    engine_info: watch::Sender<Option<Arc<serde_json::Value>>>,
    counters: Arc<Counters>,
) {
    let mut cursor = Cursor {
        next: cfg.since,
        ..Cursor::default()
    };
    let mut failures = 0u32;
    loop {
        state.send_replace(ConnState::Connecting {
            attempt: failures + 1,
        });
        let ended = session(
            &cfg,
            &mut cursor,
            &tx,
            &mut commands,
            (&state, &engine_info),
            &counters,
        )
        .await;
        let error = match ended {
            Ended::ConsumerGone => {
                state.send_replace(ConnState::Stopped);
                return;
            }
            Ended::Fatal(e) => {
                state.send_replace(ConnState::Failed {
                    error: e.to_string(),
                });
                let _ = tx.send(ClientEvent::Failed(e)).await;
                return;
            }
            Ended::Lost {
                error,
                connected_for,
            } => {
                if connected_for.is_some_and(|d| d >= cfg.healthy_after) {
                    failures = 0;
                }
                error
            }
        };
        bump(&counters.disconnects, 1);
        failures = failures.saturating_add(1);
        if cfg.max_failures.is_some_and(|m| failures >= m) {
            let e = ClientError::GaveUp {
                failures,
                last: error,
            };
            state.send_replace(ConnState::Failed {
                error: e.to_string(),
            });
            let _ = tx.send(ClientEvent::Failed(e)).await;
            return;
        }
        let retry_in = cfg.backoff.delay(failures);
        let next_try = Instant::now() + retry_in;
        state.send_replace(ConnState::Reconnecting {
            attempt: failures + 1,
            next_try,
            error: error.clone(),
        });
        if tx
            .send(ClientEvent::Disconnected {
                error,
                failures,
                retry_in,
            })
            .await
            .is_err()
        {
            state.send_replace(ConnState::Stopped);
            return;
        }
        // Commands that arrive while waiting are answered at once.
        let sleep = tokio::time::sleep(retry_in);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => break,
                Some(c) = commands.recv() => { c.reply.send(Err(ControlError::NotConnected)); }
            }
        }
    }
}

/// Sends to the consumer, counting when it had to wait.
async fn deliver(
    tx: &mpsc::Sender<ClientEvent>,
    counters: &Counters,
    ev: ClientEvent,
) -> Result<(), ()> {
    match tx.try_send(ev) {
        Ok(()) => Ok(()),
        Err(mpsc::error::TrySendError::Full(ev)) => {
            bump(&counters.consumer_full, 1);
            tx.send(ev).await.map_err(|_| ())
        }
        Err(mpsc::error::TrySendError::Closed(_)) => Err(()),
    }
}

fn http_refusal(resp: &tungstenite::http::Response<Option<Vec<u8>>>) -> (Option<u32>, ApiError) {
    let server = resp
        .headers()
        .get(VERSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    let body = resp.body().as_deref().unwrap_or_default();
    let err = serde_json::from_slice::<ApiError>(body).unwrap_or_else(|_| {
        ApiError::new(
            "http",
            String::from_utf8_lossy(&body[..body.len().min(200)])
                .trim()
                .to_string(),
        )
    });
    (server, err)
}

fn classify_connect_error(e: tungstenite::Error) -> Ended {
    match e {
        tungstenite::Error::Http(resp) => {
            let status = resp.status().as_u16();
            let (server, api) = http_refusal(&resp);
            if api.code == "protocol_mismatch" || server.is_some_and(|s| s != PROTOCOL_VERSION) {
                Ended::Fatal(ClientError::ProtocolMismatch {
                    client: PROTOCOL_VERSION,
                    server,
                    message: api.message,
                })
            } else if status == 401 || status == 403 || api.code == "unauthorized" {
                Ended::Fatal(ClientError::Unauthorized(api.message))
            } else if status == 408 || status == 429 || status >= 500 {
                lost(format!("HTTP {status}: {api}"))
            } else {
                Ended::Fatal(ClientError::Refused {
                    status,
                    message: api.to_string(),
                })
            }
        }
        tungstenite::Error::Io(io) => lost(io.to_string()),
        other => lost(other.to_string()),
    }
}

fn fatal_api_error(api: &ApiError) -> Option<ClientError> {
    match api.code.as_str() {
        "protocol_mismatch" => Some(ClientError::ProtocolMismatch {
            client: PROTOCOL_VERSION,
            server: None,
            message: api.message.clone(),
        }),
        "unauthorized" => Some(ClientError::Unauthorized(api.message.clone())),
        _ => None,
    }
}

/// The WebSocket as the client holds it.
type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A connection that ended before it was up (no time connected to count).
fn lost(error: String) -> Ended {
    Ended::Lost {
        error,
        connected_for: None,
    }
}

/// One connection, from the upgrade request to its end: the handshake
/// ([`open`], [`await_hello`], [`check_same_run`]), then [`Session::run`].
async fn session(
    cfg: &ClientConfig,
    cursor: &mut Cursor,
    tx: &mpsc::Sender<ClientEvent>,
    commands: &mut mpsc::Receiver<Command>,
    (state, engine_info): (
        &watch::Sender<ConnState>,
        &watch::Sender<Option<Arc<serde_json::Value>>>,
    ),
    counters: &Counters,
) -> Ended {
    let (ws, deadline) = match open(cfg, cursor.next, cursor.run).await {
        Ok(x) => x,
        Err(ended) => return ended,
    };
    let (sink, mut stream) = ws.split();
    let hello = match await_hello(&mut stream, deadline, counters).await {
        Ok(h) => h,
        Err(ended) => return ended,
    };
    let new_run = match cursor.run {
        Some(previous) if previous != hello.run => {
            // Another run: nothing of the old one continues. The server
            // starts this run at seq 0 for a client that named the old run.
            *cursor = Cursor {
                run: Some(hello.run),
                runs: cursor.runs + 1,
                next: Some(0),
                ..Cursor::default()
            };
            bump(&counters.new_runs, 1);
            Some(previous)
        }
        Some(_) => {
            if let Err(ended) = check_same_run(cursor, &hello, counters) {
                return ended;
            }
            cursor.check_time = cursor.last_ts.is_some();
            None
        }
        None => {
            cursor.run = Some(hello.run);
            cursor.runs = 1;
            None
        }
    };
    let connected_at = Instant::now();
    bump(&counters.connects, 1);
    // What the engine (perhaps restarted) runs as now, said before the
    // state says connected.
    engine_info.send_replace(hello.engine_info.clone().map(Arc::new));
    state.send_replace(ConnState::Connected {
        hello: hello.clone(),
        since: connected_at,
        run_number: cursor.runs,
    });
    if let Some(previous) = new_run {
        let ev = ClientEvent::NewRun {
            previous,
            run: hello.run,
            number: cursor.runs,
        };
        if deliver(tx, counters, ev).await.is_err() {
            return Ended::ConsumerGone;
        }
    }
    if deliver(tx, counters, ClientEvent::Connected(hello))
        .await
        .is_err()
    {
        return Ended::ConsumerGone;
    }
    let mut session = Session {
        cursor,
        tx,
        counters,
        sink,
        pending: Pending::new(cfg.max_pending),
        connected_at,
    };
    let ended = session.run(&mut stream, commands).await;
    session.close().await;
    ended
}

/// Sends the upgrade request for the stream from `since` in `run` (with
/// the protocol version and the token) and checks the version the server
/// answers with. Returns the socket and the deadline for the whole
/// handshake, hello included.
async fn open(
    cfg: &ClientConfig,
    since: Option<u64>,
    run: Option<RunId>,
) -> Result<(Ws, tokio::time::Instant), Ended> {
    let mut req = cfg
        .endpoint
        .events_url(since, run)
        .into_client_request()
        .map_err(|e| {
            Ended::Fatal(ClientError::Url(UrlError::Malformed {
                url: cfg.endpoint.to_string(),
                reason: e.to_string(),
            }))
        })?;
    req.headers_mut()
        .insert(VERSION_HEADER, HeaderValue::from(PROTOCOL_VERSION));
    if let Some(t) = &cfg.token
        && let Ok(v) = HeaderValue::from_str(&format!("Bearer {t}"))
    {
        req.headers_mut()
            .insert(tungstenite::http::header::AUTHORIZATION, v);
    }
    let deadline = tokio::time::Instant::now() + cfg.connect_timeout;
    let (ws, resp) = match tokio::time::timeout_at(
        deadline,
        tokio_tungstenite::connect_async_with_config(req, None, true),
    )
    .await
    {
        Err(_) => return Err(lost(format!("no answer within {:?}", cfg.connect_timeout))),
        Ok(Err(e)) => return Err(classify_connect_error(e)),
        Ok(Ok(x)) => x,
    };
    if let Some(v) = resp.headers().get(VERSION_HEADER)
        && let Some(s) = v.to_str().ok().and_then(|v| v.trim().parse::<u32>().ok())
        && s != PROTOCOL_VERSION
    {
        return Err(Ended::Fatal(ClientError::ProtocolMismatch {
            client: PROTOCOL_VERSION,
            server: Some(s),
            message: String::new(),
        }));
    }
    Ok((ws, deadline))
}

/// Waits (until `deadline`) for the server's hello, which comes first, and
/// checks its protocol version.
async fn await_hello(
    stream: &mut SplitStream<Ws>,
    deadline: tokio::time::Instant,
    counters: &Counters,
) -> Result<Hello, Ended> {
    loop {
        let msg = match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => return Err(lost("no hello from the server".into())),
            Ok(None) => return Err(lost("the server closed before its hello".into())),
            Ok(Some(Err(e))) => return Err(lost(e.to_string())),
            Ok(Some(Ok(m))) => m,
        };
        let text = match msg {
            Message::Text(t) => t,
            Message::Ping(_) | Message::Pong(_) => continue,
            Message::Close(f) => {
                return Err(lost(format!(
                    "the server closed before its hello{}",
                    f.map(|f| format!(": {}", f.reason)).unwrap_or_default()
                )));
            }
            other => return Err(lost(format!("expected a hello, got {other:?}"))),
        };
        return match serde_json::from_str::<ServerMsg>(&text) {
            Ok(ServerMsg::Hello {
                protocol,
                engine,
                run,
                client,
                client_key,
                first_seq,
                last_seq,
                engine_info,
            }) => {
                if protocol != PROTOCOL_VERSION {
                    return Err(Ended::Fatal(ClientError::ProtocolMismatch {
                        client: PROTOCOL_VERSION,
                        server: Some(protocol),
                        message: String::new(),
                    }));
                }
                Ok(Hello {
                    engine,
                    run,
                    client,
                    client_key,
                    first_seq,
                    last_seq,
                    engine_info,
                })
            }
            Ok(ServerMsg::Error(api)) => Err(match fatal_api_error(&api) {
                Some(e) => Ended::Fatal(e),
                None => lost(format!("the server said: {api}")),
            }),
            Ok(other) => Err(lost(format!("expected a hello, got {other:?}"))),
            Err(e) => {
                bump(&counters.bad_frames, 1);
                Err(lost(format!("expected a hello: {e}")))
            }
        };
    }
}

/// After a reconnection to the same run, a server that holds fewer events
/// than were already delivered went back (never expected of a sound
/// server). Only if something was delivered: a `since` ahead of the server
/// is just a wait.
fn check_same_run(cursor: &Cursor, hello: &Hello, counters: &Counters) -> Result<(), Ended> {
    if let (Some(next), Some(last)) = (cursor.next, hello.last_seq)
        && next > 0
        && last < next - 1
        && counters.events.load(Ordering::Relaxed) > 0
    {
        return Err(Ended::Fatal(ClientError::StreamReset {
            why: format!(
                "it holds up to seq {last}, this client had seq {}",
                next - 1
            ),
        }));
    }
    Ok(())
}

/// Commands sent and awaiting their reply, by the id they were sent with.
struct Pending {
    waiting: HashMap<u64, (ReplyTo, Instant)>,
    next_id: u64,
    max: usize,
}

impl Pending {
    fn new(max: usize) -> Self {
        Pending {
            waiting: HashMap::new(),
            next_id: 1,
            max: max.max(1),
        }
    }

    /// Forgets the commands whose caller has stopped waiting.
    fn sweep(&mut self) {
        let now = Instant::now();
        self.waiting.retain(|_, (_, d)| *d > now);
    }

    /// Whether one more command may be sent (after a sweep, if full).
    fn has_room(&mut self) -> bool {
        if self.waiting.len() >= self.max {
            self.sweep();
        }
        self.waiting.len() < self.max
    }

    /// The id for the next command.
    fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn insert(&mut self, id: u64, reply: ReplyTo, deadline: Instant) {
        self.waiting.insert(id, (reply, deadline));
    }

    /// Hands command `id` its result; false when nobody waits for it.
    fn answer(&mut self, id: u64, result: Result<ControlResult, ApiError>) -> bool {
        self.waiting
            .remove(&id)
            .is_some_and(|(r, _)| r.send(result.map_err(ControlError::Server)))
    }

    /// The connection ended: every command still waiting is told.
    fn disconnect_all(&mut self) {
        for (_, (r, _)) in self.waiting.drain() {
            r.send(Err(ControlError::Disconnected));
        }
    }
}

/// A connection past its hello: what the server sends goes to the
/// consumer, commands go to the server, replies to whoever waits.
struct Session<'a> {
    cursor: &'a mut Cursor,
    tx: &'a mpsc::Sender<ClientEvent>,
    counters: &'a Counters,
    sink: SplitSink<Ws, Message>,
    pending: Pending,
    connected_at: Instant,
}

impl Session<'_> {
    /// Serves the connection until it ends, and says how.
    async fn run(
        &mut self,
        stream: &mut SplitStream<Ws>,
        commands: &mut mpsc::Receiver<Command>,
    ) -> Ended {
        let mut sweep = tokio::time::interval(Duration::from_millis(500));
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let step = tokio::select! {
                msg = stream.next() => self.on_frame(msg).await,
                Some(c) = commands.recv() => self.on_command(c).await,
                _ = sweep.tick() => {
                    self.pending.sweep();
                    Ok(())
                }
            };
            if let Err(ended) = step {
                return ended;
            }
        }
    }

    /// Fails the commands still waiting and closes the socket.
    async fn close(mut self) {
        self.pending.disconnect_all();
        let _ = self.sink.close().await;
    }

    /// A connection that ended after this long up.
    fn lost(&self, error: String) -> Ended {
        Ended::Lost {
            error,
            connected_for: Some(self.connected_at.elapsed()),
        }
    }

    async fn deliver(&self, ev: ClientEvent) -> Result<(), Ended> {
        deliver(self.tx, self.counters, ev)
            .await
            .map_err(|()| Ended::ConsumerGone)
    }

    /// One frame (or the end of the stream).
    async fn on_frame(
        &mut self,
        msg: Option<Result<Message, tungstenite::Error>>,
    ) -> Result<(), Ended> {
        let msg = match msg {
            None => return Err(self.lost("the server closed the connection".into())),
            Some(Err(e)) => return Err(self.lost(e.to_string())),
            Some(Ok(m)) => m,
        };
        match msg {
            Message::Binary(b) => self.on_batch(&b).await,
            Message::Text(t) => self.on_text(&t).await,
            Message::Close(f) => Err(self.lost(format!(
                "the server closed the connection{}",
                f.map(|f| format!(": {}", f.reason)).unwrap_or_default()
            ))),
            _ => Ok(()),
        }
    }

    /// A binary frame: a batch of events.
    async fn on_batch(&mut self, frame: &[u8]) -> Result<(), Ended> {
        bump(&self.counters.batches, 1);
        bump(&self.counters.bytes, frame.len() as u64);
        let events = match decode_batch(frame) {
            Ok(ev) => ev,
            Err(e) => {
                // The events are asked for again on the next connection.
                bump(&self.counters.bad_frames, 1);
                return Err(self.lost(format!("a bad event batch: {e}")));
            }
        };
        deliver_events(events, self.cursor, self.tx, self.counters).await
    }

    /// A text frame: any server message but events.
    async fn on_text(&mut self, text: &str) -> Result<(), Ended> {
        let m = match serde_json::from_str::<ServerMsg>(text) {
            Ok(m) => m,
            Err(e) => {
                bump(&self.counters.bad_frames, 1);
                tracing::warn!("ignoring a text frame that does not parse: {e}");
                return Ok(());
            }
        };
        match m {
            ServerMsg::Gap {
                from_seq,
                to_seq,
                reason,
            } => match clip_gap(self.cursor, from_seq, to_seq, reason, true) {
                Some(g) => deliver_gap(g, self.cursor, self.tx, self.counters)
                    .await
                    .map_err(|()| Ended::ConsumerGone),
                None => Ok(()),
            },
            ServerMsg::Live => self.deliver(ClientEvent::Live).await,
            ServerMsg::Breakpoints(v) => self.deliver(ClientEvent::Breakpoints(v)).await,
            ServerMsg::Reply { id, result } => {
                bump(&self.counters.replies, 1);
                if !self.pending.answer(id, result) {
                    bump(&self.counters.orphan_replies, 1);
                }
                Ok(())
            }
            ServerMsg::Error(api) => Err(match fatal_api_error(&api) {
                Some(e) => Ended::Fatal(e),
                None => self.lost(format!("the server said: {api}")),
            }),
            ServerMsg::Hello { .. } => {
                bump(&self.counters.bad_frames, 1);
                Ok(())
            }
        }
    }

    /// A command from the handle: sent with a fresh id, unless its caller
    /// already gave up or too many are waiting.
    async fn on_command(&mut self, c: Command) -> Result<(), Ended> {
        if Instant::now() >= c.deadline {
            bump(&self.counters.command_timeouts, 1);
            return Ok(());
        }
        if !self.pending.has_room() {
            bump(&self.counters.commands_refused_busy, 1);
            c.reply.send(Err(ControlError::Busy));
            return Ok(());
        }
        let id = self.pending.take_id();
        let text = match serde_json::to_string(&ClientMsg::Control {
            id,
            command: c.command,
        }) {
            Ok(t) => t,
            Err(e) => {
                c.reply.send(Err(ControlError::Server(ApiError::new(
                    "bad_request",
                    e.to_string(),
                ))));
                return Ok(());
            }
        };
        self.pending.insert(id, c.reply, c.deadline);
        bump(&self.counters.commands_sent, 1);
        match self.sink.send(Message::text(text)).await {
            Ok(()) => Ok(()),
            Err(e) => Err(self.lost(e.to_string())),
        }
    }
}

/// Clips a gap to what was not delivered yet; advances the cursor.
fn clip_gap(
    cursor: &mut Cursor,
    from_seq: u64,
    to_seq: u64,
    reason: GapReason,
    announced: bool,
) -> Option<Gap> {
    if to_seq < from_seq {
        return None;
    }
    let from = cursor.next.map_or(from_seq, |n| from_seq.max(n));
    if to_seq < from {
        return None;
    }
    Some(Gap {
        from_seq: from,
        to_seq,
        reason,
        announced,
    })
}

async fn deliver_gap(
    g: Gap,
    cursor: &mut Cursor,
    tx: &mpsc::Sender<ClientEvent>,
    counters: &Counters,
) -> Result<(), ()> {
    cursor.next = Some(g.to_seq.saturating_add(1));
    bump(&counters.gaps, 1);
    bump(&counters.gap_events, g.len());
    if !g.announced {
        bump(&counters.unannounced_gap_events, g.len());
    }
    deliver(tx, counters, ClientEvent::Gap(g)).await
}

/// Drops duplicates, reports unannounced jumps as gaps, delivers the rest.
async fn deliver_events(
    events: Vec<Event>,
    cursor: &mut Cursor,
    tx: &mpsc::Sender<ClientEvent>,
    counters: &Counters,
) -> Result<(), Ended> {
    let mut run: Vec<Event> = Vec::with_capacity(events.len());
    for ev in events {
        if cursor.next.is_some_and(|n| ev.seq < n) {
            bump(&counters.duplicates, 1);
            continue;
        }
        if std::mem::take(&mut cursor.check_time)
            && let Some(last) = cursor.last_ts
            && ev.ts_ns.saturating_add(TIME_SLACK_NS) < last
        {
            return Err(Ended::Fatal(ClientError::StreamReset {
                why: format!(
                    "seq {} is stamped {:.3} s, before the {:.3} s of the last event delivered",
                    ev.seq,
                    ev.ts_ns as f64 / 1e9,
                    last as f64 / 1e9
                ),
            }));
        }
        if let Some(n) = cursor.next
            && ev.seq > n
        {
            if !run.is_empty() {
                bump(&counters.events, run.len() as u64);
                deliver(tx, counters, ClientEvent::Events(std::mem::take(&mut run)))
                    .await
                    .map_err(|_| Ended::ConsumerGone)?;
            }
            let g = Gap {
                from_seq: n,
                to_seq: ev.seq - 1,
                reason: GapReason::Lost,
                announced: false,
            };
            deliver_gap(g, cursor, tx, counters)
                .await
                .map_err(|_| Ended::ConsumerGone)?;
        }
        cursor.next = Some(ev.seq.saturating_add(1));
        cursor.last_ts = Some(ev.ts_ns);
        run.push(ev);
    }
    if !run.is_empty() {
        bump(&counters.events, run.len() as u64);
        deliver(tx, counters, ClientEvent::Events(run))
            .await
            .map_err(|_| Ended::ConsumerGone)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn urls_parse_or_say_why() {
        let e = Endpoint::parse("http://127.0.0.1:6669").unwrap();
        assert_eq!(
            e,
            Endpoint {
                host: "127.0.0.1".into(),
                port: 6669
            }
        );
        assert_eq!(e.to_string(), "http://127.0.0.1:6669");
        assert_eq!(
            e.events_url(Some(42), None),
            "ws://127.0.0.1:6669/events?since=42&version=3"
        );
        assert_eq!(
            e.events_url(Some(42), Some(RunId(0xab))),
            "ws://127.0.0.1:6669/events?since=42&run=00000000000000ab&version=3"
        );
        assert_eq!(
            e.events_url(None, None),
            "ws://127.0.0.1:6669/events?version=3"
        );
        assert_eq!(
            Endpoint::parse(" HTTP://localhost:80/ ").unwrap().host,
            "localhost"
        );
        let v6 = Endpoint::parse("http://[::1]:9000").unwrap();
        assert_eq!(v6.host, "::1");
        assert_eq!(
            v6.events_url(None, None),
            "ws://[::1]:9000/events?version=3"
        );
        assert_eq!(Endpoint::parse("ws://h:1").unwrap().port, 1);
        for (bad, why) in [
            ("127.0.0.1:6669", "no scheme"),
            ("http://127.0.0.1", "no port"),
            ("http://127.0.0.1:0", "port"),
            ("http://127.0.0.1:70000", "port"),
            ("http://127.0.0.1:+80", "port"),
            ("http://:80", "no host"),
            ("http://h:80/events", "path"),
            ("http://u:p@h:80", "user info"),
            ("https://h:80", "TLS"),
            ("ftp://h:80", "scheme"),
            ("http://[::1:80", "closing"),
            ("http://[zz]:80", "IPv6"),
            ("http://a b:80", "host"),
        ] {
            let e = Endpoint::parse(bad).unwrap_err();
            assert!(e.to_string().contains(why), "{bad}: {e}");
        }
        let z = Endpoint::parse("zmq://127.0.0.1:5557").unwrap_err();
        assert!(matches!(z, UrlError::ZmqStream { .. }));
        assert!(z.to_string().contains("not an attach server"), "{z}");
        let i = Endpoint::parse("ipc:///tmp/kv").unwrap_err();
        assert!(matches!(i, UrlError::NotSupportedYet { .. }));
        assert!(i.to_string().contains("not supported yet"), "{i}");
    }

    #[test]
    fn backoff_doubles_from_100ms_to_a_5s_cap() {
        let b = Backoff::default();
        let ms: Vec<u128> = (1..=10).map(|n| b.delay(n).as_millis()).collect();
        assert_eq!(ms, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000]);
        assert_eq!(b.delay(0), Duration::from_millis(100));
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(5));
        let odd = Backoff {
            initial: Duration::from_secs(u64::MAX / 2),
            max: Duration::from_secs(7),
        };
        assert_eq!(odd.delay(40), Duration::from_secs(7));
    }

    fn hello() -> Hello {
        Hello {
            engine: 0,
            run: RunId(1),
            client: 1,
            client_key: String::new(),
            first_seq: None,
            last_seq: None,
            engine_info: None,
        }
    }

    #[test]
    fn state_lines_for_a_status_bar() {
        let now = Instant::now();
        let s = ConnState::Reconnecting {
            attempt: 3,
            next_try: now + Duration::from_millis(800),
            error: "refused".into(),
        };
        assert_eq!(s.describe(now), "RECONNECTING (attempt 3, next in 0.8 s)");
        assert_eq!(
            ConnState::Connected {
                hello: hello(),
                since: now,
                run_number: 1,
            }
            .describe(now),
            "ATTACHED"
        );
        assert_eq!(
            ConnState::Connected {
                hello: hello(),
                since: now,
                run_number: 3,
            }
            .describe(now),
            "ATTACHED · RUN 3 (engine restarted)"
        );
        assert_eq!(
            ConnState::Connecting { attempt: 1 }.describe(now),
            "CONNECTING"
        );
    }

    #[test]
    fn gaps_are_clipped_to_what_was_not_delivered() {
        let mut c = Cursor {
            next: Some(10),
            ..Cursor::default()
        };
        assert_eq!(clip_gap(&mut c, 3, 8, GapReason::Lost, true), None);
        let g = clip_gap(&mut c, 5, 12, GapReason::Overwritten, true).unwrap();
        assert_eq!((g.from_seq, g.to_seq, g.len()), (10, 12, 3));
        assert_eq!(clip_gap(&mut c, 9, 3, GapReason::Lost, true), None);
        let mut fresh = Cursor::default();
        assert_eq!(
            clip_gap(&mut fresh, 0, 4, GapReason::Lost, true).map(|g| g.len()),
            Some(5)
        );
    }

    /// The reply table: ids in order, room made by forgetting commands
    /// whose caller gave up, replies matched by id, the rest told when the
    /// connection ends.
    #[test]
    fn pending_commands_are_matched_swept_and_disconnected() {
        let reply = || {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            (ReplyTo::Sync(tx), rx)
        };
        let mut p = Pending::new(2);
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let (r1, rx1) = reply();
        let (r2, rx2) = reply();
        let (r3, rx3) = reply();
        assert!(p.has_room());
        let id1 = p.take_id();
        p.insert(id1, r1, later);
        let id2 = p.take_id();
        p.insert(id2, r2, now); // its caller has already given up
        assert_eq!((id1, id2), (1, 2));
        // Full, but the sweep makes room by dropping id 2.
        assert!(p.has_room());
        assert!(!p.answer(id2, Ok(ControlResult::Done(true))));
        assert!(rx2.try_recv().is_err());
        let id3 = p.take_id();
        p.insert(id3, r3, later);
        assert!(!p.has_room());
        assert!(p.answer(id1, Ok(ControlResult::Added(7))));
        assert_eq!(rx1.try_recv().unwrap(), Ok(ControlResult::Added(7)));
        p.disconnect_all();
        assert_eq!(rx3.try_recv().unwrap(), Err(ControlError::Disconnected));
        assert!(p.has_room());
    }

    fn ev(seq: u64) -> Event {
        Event {
            engine: 0,
            seq,
            ts_ns: seq,
            iteration: 0,
            request: None,
            kind: kvbm_events::EventKind::TokensScheduled {
                prefill: 0,
                decode: 1,
                computed: 0,
            },
        }
    }

    #[tokio::test]
    async fn duplicates_are_dropped_and_jumps_become_gaps() {
        let (tx, mut rx) = mpsc::channel(16);
        let counters = Counters::default();
        let mut c = Cursor {
            next: Some(3),
            ..Cursor::default()
        };
        let batch = [1, 2, 3, 4, 7, 8].map(ev).to_vec();
        assert!(deliver_events(batch, &mut c, &tx, &counters).await.is_ok());
        drop(tx);
        let mut got = Vec::new();
        while let Some(e) = rx.recv().await {
            got.push(e);
        }
        assert_eq!(
            got,
            vec![
                ClientEvent::Events(vec![ev(3), ev(4)]),
                ClientEvent::Gap(Gap {
                    from_seq: 5,
                    to_seq: 6,
                    reason: GapReason::Lost,
                    announced: false
                }),
                ClientEvent::Events(vec![ev(7), ev(8)]),
            ]
        );
        let s = counters.snapshot();
        assert_eq!(
            (
                s.duplicates,
                s.events,
                s.gap_events,
                s.unannounced_gap_events
            ),
            (2, 4, 2, 2)
        );
        assert_eq!(c.next, Some(9));
    }

    /// After a reconnection, an event stamped well before the last one
    /// delivered means another engine run: fatal, nothing delivered.
    #[tokio::test]
    async fn time_going_back_after_a_reconnection_is_another_run() {
        let (tx, mut rx) = mpsc::channel(16);
        let counters = Counters::default();
        let at = |seq: u64, ts_ns: u64| Event { ts_ns, ..ev(seq) };
        let mut c = Cursor {
            next: Some(10),
            last_ts: Some(5_000_000_000),
            check_time: true,
            ..Cursor::default()
        };
        // Within the slack: fine, and checked once only.
        let ok = vec![at(10, 4_500_000_000), at(11, 0)];
        assert!(deliver_events(ok, &mut c, &tx, &counters).await.is_ok());
        assert!(!c.check_time);
        c.check_time = true;
        c.last_ts = Some(5_000_000_000);
        let r = deliver_events(vec![at(40, 1_000)], &mut c, &tx, &counters).await;
        let Err(Ended::Fatal(e)) = r else {
            panic!("not fatal")
        };
        assert!(
            e.to_string().contains("went back within one engine run"),
            "{e}"
        );
        drop(tx);
        assert_eq!(
            rx.recv().await.map(|e| matches!(e, ClientEvent::Events(_))),
            Some(true)
        );
        assert!(
            rx.recv().await.is_none(),
            "no gap, no events from the other run"
        );
    }

    #[test]
    fn refusals_are_classified() {
        let resp = |status: u16, header: Option<&str>, body: &str| {
            let mut b = tungstenite::http::Response::builder().status(status);
            if let Some(h) = header {
                b = b.header(VERSION_HEADER, h);
            }
            tungstenite::Error::Http(Box::new(b.body(Some(body.as_bytes().to_vec())).unwrap()))
        };
        let mismatch = classify_connect_error(resp(
            400,
            Some("4"),
            r#"{"code":"protocol_mismatch","message":"this server speaks v4"}"#,
        ));
        let Ended::Fatal(e) = mismatch else {
            panic!("a mismatch is fatal")
        };
        assert_eq!(
            e.to_string(),
            "protocol mismatch: this client speaks kvbm attach protocol v3, the server speaks v4 \
             (this server speaks v4)"
        );
        assert!(matches!(
            classify_connect_error(resp(401, None, r#"{"code":"unauthorized","message":"no"}"#)),
            Ended::Fatal(ClientError::Unauthorized(_))
        ));
        assert!(matches!(
            classify_connect_error(resp(404, None, "nope")),
            Ended::Fatal(ClientError::Refused { status: 404, .. })
        ));
        assert!(matches!(
            classify_connect_error(resp(
                503,
                None,
                r#"{"code":"too_many_clients","message":"x"}"#
            )),
            Ended::Lost { .. }
        ));
    }

    /// A scripted server: each accepted connection gets the URI it asked
    /// for recorded, then runs `script(n, ws)`.
    mod fake {
        use super::*;
        use tokio::net::TcpListener;
        use tokio_tungstenite::WebSocketStream;
        use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};

        pub type Ws = WebSocketStream<tokio::net::TcpStream>;

        pub async fn serve<F, Fut>(script: F) -> (String, Arc<std::sync::Mutex<Vec<String>>>)
        where
            F: Fn(usize, Ws) -> Fut + Send + Sync + 'static,
            Fut: std::future::Future<Output = ()> + Send + 'static,
        {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", l.local_addr().unwrap());
            let uris = Arc::new(std::sync::Mutex::new(Vec::new()));
            let seen = uris.clone();
            tokio::spawn(async move {
                for n in 0.. {
                    let Ok((tcp, _)) = l.accept().await else {
                        return;
                    };
                    let seen = seen.clone();
                    // The callback's error type is tungstenite's, not ours.
                    #[allow(clippy::result_large_err)]
                    let cb = move |req: &Request, resp: Response| {
                        seen.lock().unwrap().push(req.uri().to_string());
                        Ok(resp)
                    };
                    if let Ok(ws) = tokio_tungstenite::accept_hdr_async(tcp, cb).await {
                        tokio::spawn(script(n, ws));
                    }
                }
            });
            (url, uris)
        }

        pub async fn text(ws: &mut Ws, m: &ServerMsg) {
            ws.send(Message::text(serde_json::to_string(m).unwrap()))
                .await
                .unwrap();
        }

        pub async fn hello(ws: &mut Ws, protocol: u32, last_seq: Option<u64>) {
            hello_run(ws, protocol, RunId(7), last_seq).await;
        }

        pub async fn hello_run(ws: &mut Ws, protocol: u32, run: RunId, last_seq: Option<u64>) {
            text(
                ws,
                &ServerMsg::Hello {
                    protocol,
                    engine: 7,
                    run,
                    client: 1,
                    client_key: "k".into(),
                    first_seq: Some(0),
                    last_seq,
                    engine_info: None,
                },
            )
            .await;
        }

        pub async fn batch(ws: &mut Ws, seqs: impl IntoIterator<Item = u64>) {
            let events: Vec<Event> = seqs.into_iter().map(super::ev).collect();
            let mut buf = Vec::new();
            kvbm_schema::protocol::encode_batch(
                &events,
                &mut kvbm_schema::columnar::BlockEncoder::new(),
                &mut buf,
            );
            ws.send(Message::binary(buf)).await.unwrap();
        }
    }

    fn quick(url: &str) -> ClientConfig {
        let mut cfg = ClientConfig::new(url).unwrap();
        cfg.backoff = Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(40),
        };
        cfg.connect_timeout = Duration::from_secs(5);
        cfg
    }

    async fn drain(c: &mut Client) -> Vec<ClientEvent> {
        let mut out = Vec::new();
        while let Ok(Some(e)) = tokio::time::timeout(Duration::from_secs(10), c.recv()).await {
            let end = matches!(e, ClientEvent::Failed(_));
            out.push(e);
            if end {
                break;
            }
        }
        out
    }

    /// Three connections: the first drops mid-stream, the second resends
    /// what was delivered (dropped as duplicates) and announces a gap, the
    /// third speaks another protocol version (fatal).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reconnects_resume_without_duplicates_and_a_mismatch_is_fatal() {
        let (url, uris) = fake::serve(|n, mut ws| async move {
            match n {
                0 => {
                    fake::hello(&mut ws, PROTOCOL_VERSION, Some(4)).await;
                    fake::batch(&mut ws, 0..5).await;
                    // Dropped without a close frame.
                }
                1 => {
                    fake::hello(&mut ws, PROTOCOL_VERSION, Some(11)).await;
                    fake::batch(&mut ws, 3..8).await;
                    fake::text(
                        &mut ws,
                        &ServerMsg::Gap {
                            from_seq: 8,
                            to_seq: 9,
                            reason: GapReason::Overwritten,
                        },
                    )
                    .await;
                    fake::batch(&mut ws, 10..12).await;
                    fake::text(&mut ws, &ServerMsg::Live).await;
                    let _ = ws.close(None).await;
                }
                _ => fake::hello(&mut ws, PROTOCOL_VERSION + 1, Some(11)).await,
            }
        })
        .await;
        let mut c = Client::spawn(
            quick(&url).with_since(0),
            &tokio::runtime::Handle::current(),
        )
        .unwrap();
        let got = drain(&mut c).await;
        let seqs: Vec<u64> = got
            .iter()
            .filter_map(|e| match e {
                ClientEvent::Events(v) => Some(v.iter().map(|e| e.seq)),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(seqs, [0, 1, 2, 3, 4, 5, 6, 7, 10, 11]);
        let gaps: Vec<&Gap> = got
            .iter()
            .filter_map(|e| match e {
                ClientEvent::Gap(g) => Some(g),
                _ => None,
            })
            .collect();
        assert_eq!(
            gaps,
            [&Gap {
                from_seq: 8,
                to_seq: 9,
                reason: GapReason::Overwritten,
                announced: true
            }]
        );
        assert!(got.contains(&ClientEvent::Live));
        let Some(ClientEvent::Failed(ClientError::ProtocolMismatch { server, .. })) = got.last()
        else {
            panic!("{got:?}")
        };
        assert_eq!(*server, Some(PROTOCOL_VERSION + 1));
        let uris = uris.lock().unwrap().clone();
        assert_eq!(
            uris,
            [
                "/events?since=0&version=3",
                "/events?since=5&run=0000000000000007&version=3",
                "/events?since=12&run=0000000000000007&version=3"
            ]
        );
        let h = c.handle();
        let k = h.counters();
        assert_eq!(
            (k.duplicates, k.connects, k.disconnects, k.gap_events),
            (2, 2, 2, 2)
        );
        assert!(matches!(h.state(), ConnState::Failed { .. }));
        assert!(c.recv().await.is_none(), "nothing after Failed");
    }

    /// An engine restart whose new run has already passed the old run's
    /// sequence numbers (and time) by the time the client reconnects: the
    /// client says it is a new run, asks to resume in the old run (which
    /// the server answers with the new run from seq 0), and delivers the
    /// new run whole: nothing dropped as a "duplicate", nothing spliced.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restarted_engine_is_a_new_run_whatever_its_sequence_numbers() {
        let (url, uris) = fake::serve(|n, mut ws| async move {
            match n {
                0 => {
                    fake::hello_run(&mut ws, PROTOCOL_VERSION, RunId(1), Some(49)).await;
                    fake::batch(&mut ws, 0..50).await;
                }
                _ => {
                    fake::hello_run(&mut ws, PROTOCOL_VERSION, RunId(2), Some(119)).await;
                    fake::batch(&mut ws, 0..120).await;
                    fake::text(&mut ws, &ServerMsg::Live).await;
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
            }
        })
        .await;
        let mut c = Client::spawn(
            quick(&url).with_since(0),
            &tokio::runtime::Handle::current(),
        )
        .unwrap();
        let mut got = Vec::new();
        while let Ok(Some(e)) = tokio::time::timeout(Duration::from_secs(10), c.recv()).await {
            let live = e == ClientEvent::Live;
            got.push(e);
            if live {
                break;
            }
        }
        let at = got
            .iter()
            .position(|e| matches!(e, ClientEvent::NewRun { .. }))
            .unwrap_or_else(|| panic!("no NewRun in {got:?}"));
        assert_eq!(
            got[at],
            ClientEvent::NewRun {
                previous: RunId(1),
                run: RunId(2),
                number: 2
            }
        );
        assert!(matches!(&got[at + 1], ClientEvent::Connected(h) if h.run == RunId(2)));
        let seqs = |evs: &[ClientEvent]| -> Vec<u64> {
            evs.iter()
                .filter_map(|e| match e {
                    ClientEvent::Events(v) => Some(v.iter().map(|e| e.seq)),
                    _ => None,
                })
                .flatten()
                .collect()
        };
        assert_eq!(seqs(&got[..at]), (0..50).collect::<Vec<_>>());
        assert_eq!(seqs(&got[at..]), (0..120).collect::<Vec<_>>());
        assert!(
            !got.iter().any(|e| matches!(e, ClientEvent::Gap(_))),
            "{got:?}"
        );
        let k = c.handle().counters();
        assert_eq!((k.duplicates, k.new_runs, k.events), (0, 1, 170));
        assert!(
            c.handle()
                .state()
                .describe(Instant::now())
                .contains("RUN 2"),
            "{:?}",
            c.handle().state()
        );
        assert_eq!(
            uris.lock().unwrap()[1],
            "/events?since=50&run=0000000000000001&version=3"
        );
    }

    /// Commands are answered by id; one without an answer times out; an
    /// unreachable server means NotConnected at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn control_commands_get_their_replies_or_time_out() {
        let (url, _) = fake::serve(|_, mut ws| async move {
            fake::hello(&mut ws, PROTOCOL_VERSION, None).await;
            while let Some(Ok(m)) = ws.next().await {
                let Message::Text(t) = m else { continue };
                let ClientMsg::Control { id, command } = serde_json::from_str(&t).unwrap();
                let result = match command {
                    ControlCommand::Add { .. } => Ok(ControlResult::Added(41 + id)),
                    ControlCommand::Step => continue, // never answered
                    _ => Err(ApiError::new("no_breakpoints", "none")),
                };
                fake::text(&mut ws, &ServerMsg::Reply { id, result }).await;
            }
        })
        .await;
        let mut c = Client::spawn(quick(&url), &tokio::runtime::Handle::current()).unwrap();
        assert!(matches!(c.recv().await, Some(ClientEvent::Connected(_))));
        let h = c.handle();
        let spec = kvbm_events::breakpoint::BreakpointSpec::default().with_state("Decoding");
        assert_eq!(
            h.control(ControlCommand::Add { spec: spec.clone() }).await,
            Ok(ControlResult::Added(42))
        );
        assert_eq!(
            h.control(ControlCommand::ClearAll).await,
            Err(ControlError::Server(ApiError::new(
                "no_breakpoints",
                "none"
            )))
        );
        let h2 = h.clone();
        let blocking = tokio::task::spawn_blocking(move || {
            h2.control_blocking(ControlCommand::Add { spec }, Duration::from_secs(2))
        });
        assert_eq!(blocking.await.unwrap(), Ok(ControlResult::Added(44)));
        assert_eq!(
            h.control_with_timeout(ControlCommand::Step, Duration::from_millis(100))
                .await,
            Err(ControlError::Timeout(Duration::from_millis(100)))
        );
        let k = h.counters();
        assert_eq!((k.commands_sent, k.replies, k.command_timeouts), (4, 3, 1));

        let dead = ClientConfig::new("http://127.0.0.1:9").unwrap();
        let d = Client::spawn(dead, &tokio::runtime::Handle::current()).unwrap();
        assert_eq!(
            d.handle().control(ControlCommand::List).await,
            Err(ControlError::NotConnected)
        );
    }

    /// An HTTP 400 `protocol_mismatch` refusal of the upgrade becomes the
    /// same clear error as a mismatched hello.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_http_protocol_mismatch_refusal_is_a_clear_error() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut tcp, _) = l.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = tcp.read(&mut buf).await;
            let body = r#"{"code":"protocol_mismatch","message":"server speaks v4, asked v1"}"#;
            let resp = format!(
                "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n\
                 x-kvbm-protocol: 4\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            tcp.write_all(resp.as_bytes()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
        });
        let mut c = Client::spawn(quick(&url), &tokio::runtime::Handle::current()).unwrap();
        let got = drain(&mut c).await;
        let Some(ClientEvent::Failed(e)) = got.last() else {
            panic!("{got:?}")
        };
        assert_eq!(
            e.to_string(),
            "protocol mismatch: this client speaks kvbm attach protocol v3, the server speaks v4 \
             (server speaks v4, asked v1)"
        );
    }

    /// Connection refused: the attempts back off and `max_failures` gives up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refused_connections_back_off_then_give_up() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        drop(l);
        let mut cfg = quick(&url);
        cfg.max_failures = Some(4);
        let t0 = Instant::now();
        let mut c = Client::spawn(cfg, &tokio::runtime::Handle::current()).unwrap();
        let got = drain(&mut c).await;
        let waits: Vec<Duration> = got
            .iter()
            .filter_map(|e| match e {
                ClientEvent::Disconnected { retry_in, .. } => Some(*retry_in),
                _ => None,
            })
            .collect();
        assert_eq!(waits, [10, 20, 40].map(Duration::from_millis), "{got:?}");
        assert!(t0.elapsed() >= Duration::from_millis(70));
        assert!(matches!(
            got.last(),
            Some(ClientEvent::Failed(ClientError::GaveUp { failures: 4, .. }))
        ));
    }

    /// Each hello says what the engine runs as, or not: with the
    /// description, as an older server writes it (without the field) and
    /// with another description, one connection after another. The hello
    /// delivered, the state and the handle agree at each; between two
    /// connections the handle keeps what the last hello said.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_hello_says_what_the_engine_runs_as_or_not() {
        let a = serde_json::json!({"summary": "vLLM · tp 2", "tensor_parallel": 2});
        let b = serde_json::json!({"summary": "vLLM · tp 4 · G3 none", "disk_tokens": 0});
        let new = |info: &serde_json::Value| {
            serde_json::to_string(&ServerMsg::Hello {
                protocol: PROTOCOL_VERSION,
                engine: 7,
                run: RunId(7),
                client: 1,
                client_key: "k".into(),
                first_seq: None,
                last_seq: None,
                engine_info: Some(info.clone()),
            })
            .unwrap()
        };
        // Word for word what a server older than the field sends.
        let old = r#"{"type":"hello","protocol":3,"engine":7,"run":"0000000000000007","client":2,"client_key":"k","first_seq":null,"last_seq":null}"#;
        let hellos: Arc<[String]> = [new(&a), old.to_string(), new(&b)].into();
        // One permit lets a connection say hello (after the first), the
        // next lets it close: the test looks in between.
        let go = Arc::new(tokio::sync::Semaphore::new(0));
        let (url, _) = fake::serve({
            let go = go.clone();
            move |n, mut ws| {
                let (go, hello) = (go.clone(), hellos.get(n).cloned());
                async move {
                    let Some(hello) = hello else { return };
                    if n > 0 {
                        go.acquire().await.unwrap().forget();
                    }
                    ws.send(Message::text(hello)).await.unwrap();
                    go.acquire().await.unwrap().forget();
                }
            }
        })
        .await;
        let mut c = Client::spawn(quick(&url), &tokio::runtime::Handle::current()).unwrap();
        let handle = c.handle();
        async fn next(c: &mut Client) -> ClientEvent {
            tokio::time::timeout(Duration::from_secs(10), c.recv())
                .await
                .expect("an event within 10 s")
                .expect("the client still runs")
        }
        assert_eq!(handle.engine_info(), None, "before any hello");
        for (i, want) in [Some(a), None, Some(b)].into_iter().enumerate() {
            let hello = loop {
                match next(&mut c).await {
                    ClientEvent::Connected(h) => break h,
                    ClientEvent::Failed(e) => panic!("{e}"),
                    _ => {}
                }
            };
            assert_eq!(hello.engine_info, want, "hello {i}");
            assert_eq!((hello.engine, hello.run), (7, RunId(7)));
            assert_eq!(handle.engine_info().as_deref(), want.as_ref(), "hello {i}");
            match handle.state() {
                ConnState::Connected { hello, .. } => assert_eq!(hello.engine_info, want),
                other => panic!("hello {i}: {other:?}"),
            }
            if i == 2 {
                break;
            }
            go.add_permits(1); // this connection closes
            loop {
                match next(&mut c).await {
                    ClientEvent::Disconnected { .. } => break,
                    ClientEvent::Failed(e) => panic!("{e}"),
                    _ => {}
                }
            }
            // Not connected, the next hello not said: what the last said.
            assert_eq!(handle.engine_info().as_deref(), want.as_ref(), "after {i}");
            go.add_permits(1); // the next connection says hello
        }
        assert_eq!(handle.counters().connects, 3);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]
        #[test]
        fn url_parsing_never_panics(s in ".{0,80}", port in any::<u32>(), host in "[a-z0-9.:\\[\\]-]{0,20}") {
            let _ = Endpoint::parse(&s);
            let _ = Endpoint::parse(&format!("http://{host}:{port}"));
            let _ = Endpoint::parse(&format!("http://{s}"));
            if let Ok(e) = Endpoint::parse(&format!("http://{host}:{port}")) {
                // What parses round-trips through its display form.
                prop_assert_eq!(Endpoint::parse(&e.to_string()), Ok(e.clone()));
                prop_assert!(e.events_url(Some(1), Some(RunId(u64::MAX))).into_client_request().is_ok());
            }
        }
    }
}
