//! The console attached to a remote engine (`kvbm-console attach URL`).
//!
//! [`Remote::start`] runs a [`kvbm_attach::client::Client`] on the
//! runtime and a forwarding task that pushes what it receives into a local
//! bounded [`RingBuffer`]: events with [`RingBuffer::push`], the server's
//! gaps with [`RingBuffer::record_gap`] (so they show as "dropped"). The
//! console reads that ring with the ordinary [`LiveSource`], so every view
//! works unchanged. The breakpoint views the server pushes are cached for
//! [`RemoteControl`], which implements [`Control`] over the connection.
//! [`RemoteStatus`] is the source's [`Link`]: it puts the connection state
//! in the header's mode badge: `ATTACHED`, `RECONNECTING (attempt 3, next
//! in 0.8 s)`, `DETACHED (failed)`.
//!
//! This module builds sources, never an app: the caller puts
//! [`Remote::source`] (or [`ZmqRemote::source`]) in an `App`.
//!
//! Breakpoints set from the console belong to its connection: when the
//! connection drops, the server removes them and resumes their paused
//! calls (the engine is never left paused by a console that went away), so
//! the cache is emptied on a disconnect and read again on connect.
//!
//! When the engine restarts, the client says so ([`ClientEvent::NewRun`])
//! and follows the new run from its start; the ring position where it
//! begins is kept ([`Link::run_starts`]), so the live source starts a fresh
//! model there instead of folding two runs into one, and the badge says
//! `ATTACHED · RUN n (engine restarted)`.
//!
//! What the engine runs as (its `engine_info`, whose summary the header
//! shows: [`Link::engine_summary`]) comes with the server's hello at every
//! connection ([`ClientHandle::engine_info`]): an engine that restarted
//! may run otherwise.

use crate::source::{Badge, Link, LiveSource, Tone};
use kvbm_attach::client::{
    Client, ClientConfig, ClientCounters, ClientEvent, ClientHandle, ConnState,
    ControlError as ClientControlError,
};
use kvbm_events::control::{BreakpointsView, Control, ControlCommand, ControlError, ControlResult};
use kvbm_events::ring::{RingBuffer, RingConfig};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a key's control command waits for the server's reply.
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(2);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A remote engine, attached; see the module docs. Dropping it
/// disconnects (the forwarding task and the client stop).
pub struct Remote {
    ring: Arc<RingBuffer>,
    status: Arc<RemoteStatus>,
    control: Arc<RemoteControl>,
    task: tokio::task::JoinHandle<()>,
}

impl Remote {
    /// Connects (in the background) and starts filling a ring of
    /// `ring_capacity` events.
    pub fn start(
        cfg: ClientConfig,
        ring_capacity: usize,
        rt: &tokio::runtime::Handle,
    ) -> anyhow::Result<Remote> {
        let ring = Arc::new(RingBuffer::new(RingConfig::with_capacity(ring_capacity))?);
        let url = cfg.endpoint.to_string();
        let client = Client::spawn(cfg, rt)?;
        let handle = client.handle();
        let view = Arc::new(Mutex::new(BreakpointsView::default()));
        let control = Arc::new(RemoteControl {
            handle: handle.clone(),
            view: view.clone(),
            timeout: CONTROL_TIMEOUT,
            last_error: Mutex::new(None),
            errors: AtomicU64::new(0),
        });
        let status = Arc::new(RemoteStatus {
            url,
            handle,
            run_starts: Mutex::new(Vec::new()),
        });
        let task = rt.spawn(forward(client, ring.clone(), view, status.clone()));
        Ok(Remote {
            ring,
            status,
            control,
            task,
        })
    }

    /// The local ring the events land in.
    pub fn ring(&self) -> &Arc<RingBuffer> {
        &self.ring
    }

    /// The connection's status, for the header.
    pub fn status(&self) -> Arc<RemoteStatus> {
        self.status.clone()
    }

    /// The breakpoint control over the connection.
    pub fn control(&self) -> Arc<RemoteControl> {
        self.control.clone()
    }

    /// A live source reading the ring, with the remote control, whose
    /// header badge is the connection's state.
    pub fn source(&self) -> LiveSource {
        LiveSource::new(
            self.ring.clone(),
            Some(self.control.clone() as Arc<dyn Control>),
        )
        .with_link(self.status.clone())
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Most run starts remembered (older ones have long been applied).
const MAX_RUN_STARTS: usize = 64;

/// Moves what the client receives into the ring and the breakpoint cache,
/// and notes where new engine runs begin.
async fn forward(
    mut client: Client,
    ring: Arc<RingBuffer>,
    view: Arc<Mutex<BreakpointsView>>,
    status: Arc<RemoteStatus>,
) {
    let handle = client.handle();
    while let Some(ev) = client.recv().await {
        match ev {
            ClientEvent::Events(events) => {
                for e in events {
                    ring.push(e);
                }
            }
            ClientEvent::Gap(g) => ring.record_gap(g.len()),
            ClientEvent::Breakpoints(v) => *lock(&view) = v,
            ClientEvent::Connected(_) => {
                *lock(&view) = BreakpointsView::default();
                // Read the server's breakpoints now rather than at its next
                // push (there is none while nothing is set).
                let (h, v) = (handle.clone(), view.clone());
                tokio::spawn(async move {
                    if let Ok(ControlResult::List(list)) = h.control(ControlCommand::List).await {
                        *lock(&v) = list;
                    }
                });
            }
            ClientEvent::Disconnected { .. } | ClientEvent::Failed(_) => {
                // The server released this connection's breakpoints.
                *lock(&view) = BreakpointsView::default();
            }
            ClientEvent::NewRun { .. } => {
                // The new run's first event takes the next position.
                let mut starts = lock(&status.run_starts);
                starts.push(ring.counters().pushed);
                if starts.len() > MAX_RUN_STARTS {
                    starts.remove(0);
                }
            }
            ClientEvent::Live => {}
        }
    }
}

/// The connection state, for display.
pub struct RemoteStatus {
    url: String,
    handle: ClientHandle,
    /// Ring positions where new engine runs began.
    run_starts: Mutex<Vec<u64>>,
}

impl RemoteStatus {
    /// The server's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Where the connection stands.
    pub fn state(&self) -> ConnState {
        self.handle.state()
    }

    /// The header's badge text, e.g. `ATTACHED`.
    pub fn badge(&self, now: Instant) -> String {
        self.handle.state().describe(now)
    }

    /// The client's counters.
    pub fn counters(&self) -> ClientCounters {
        self.handle.counters()
    }

    /// What the engine runs as (the `engine_info` of the server's hello
    /// at the last connection), if it said.
    pub fn engine_info(&self) -> Option<serde_json::Value> {
        self.handle.engine_info().map(Arc::unwrap_or_clone)
    }
}

impl Link for RemoteStatus {
    fn badge(&self, now: Instant) -> Badge {
        let state = self.state();
        let tone = match state {
            ConnState::Connected { .. } => Tone::Ok,
            ConnState::Connecting { .. } | ConnState::Reconnecting { .. } => Tone::Caution,
            ConnState::Failed { .. } | ConnState::Stopped => Tone::Down,
        };
        Badge::new(state.describe(now), tone)
    }

    fn run_starts(&self) -> Vec<u64> {
        lock(&self.run_starts).clone()
    }

    fn engine_summary(&self) -> Option<String> {
        self.handle
            .engine_info()
            .and_then(|i| kvbm_recorder::sidecar::engine_summary(&i))
    }
}

/// [`Control`] over the attach connection. `List` is answered from the
/// cache of what the server pushed (a read never waits on the network);
/// every other command is sent and its reply awaited for at most
/// [`CONTROL_TIMEOUT`] on a std channel (never a tokio primitive, so
/// calling it inside the runtime cannot panic); after a change the cache
/// is read again from the server so the screen shows it at once. A failure
/// is returned as [`ControlError::Unavailable`], kept for
/// [`RemoteControl::take_error`] and counted.
pub struct RemoteControl {
    handle: ClientHandle,
    view: Arc<Mutex<BreakpointsView>>,
    timeout: Duration,
    last_error: Mutex<Option<String>>,
    errors: AtomicU64,
}

impl RemoteControl {
    /// Sends one command and waits for its reply.
    fn call(&self, command: ControlCommand) -> Result<ControlResult, ClientControlError> {
        let r = self.handle.control_blocking(command, self.timeout);
        if let Err(e) = &r {
            self.failed(format!("remote control: {e}"));
        }
        r
    }

    fn failed(&self, error: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        *lock(&self.last_error) = Some(error);
    }

    /// The last command failure, once.
    pub fn take_error(&self) -> Option<String> {
        lock(&self.last_error).take()
    }

    /// Commands that failed since the start.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Reads the server's breakpoints into the cache.
    pub fn refresh(&self) {
        if let Ok(ControlResult::List(v)) = self.call(ControlCommand::List) {
            *lock(&self.view) = v;
        }
    }
}

/// Whether `reply` is the kind of answer `command` gets.
fn answers(command: &ControlCommand, reply: &ControlResult) -> bool {
    use ControlCommand as C;
    use ControlResult as R;
    match command {
        C::Add { .. } => matches!(reply, R::Added(_)),
        C::Clear { .. } | C::Step | C::Resume { pause_id: Some(_) } => matches!(reply, R::Done(_)),
        C::ClearAll | C::Resume { pause_id: None } => matches!(reply, R::Count(_)),
        C::List => matches!(reply, R::List(_)),
    }
}

impl Control for RemoteControl {
    /// The server makes this connection the owner of what it sets, so
    /// `owner` is not sent.
    fn execute(
        &self,
        command: ControlCommand,
        _owner: Option<u64>,
    ) -> Result<ControlResult, ControlError> {
        if command == ControlCommand::List {
            return Ok(ControlResult::List(lock(&self.view).clone()));
        }
        let probe = command.clone();
        let reply = self
            .call(command)
            .map_err(|e| ControlError::Unavailable(e.to_string()))?;
        self.refresh();
        if answers(&probe, &reply) {
            Ok(reply)
        } else {
            self.failed(format!("remote control: unexpected reply {reply:?}"));
            Err(ControlError::Unavailable(format!(
                "unexpected reply {reply:?}"
            )))
        }
    }
}

/// The console on vLLM's KV-event ZMQ stream (`kvbm-console attach
/// zmq://HOST:PORT`): a [`kvbm_ingest::vllm::ZmqSource`] whose kvbm
/// events (block registrations, evictions, per-tier gauges) are pushed into
/// a local ring, read by the ordinary [`LiveSource`]; the publisher's
/// unrecovered gaps are recorded in the ring as losses (one per missed
/// publisher batch). There are no breakpoints and no requests: its source
/// says so ([`LiveSource::without_slots`]), and the Slots view shows that.
/// Dropping it unsubscribes.
pub struct ZmqRemote {
    ring: Arc<RingBuffer>,
    handle: kvbm_ingest::vllm::ZmqHandle,
    task: tokio::task::JoinHandle<()>,
}

impl ZmqRemote {
    /// Subscribes (in the background) and starts filling a ring of
    /// `ring_capacity` events.
    pub fn start(
        cfg: kvbm_ingest::vllm::ZmqConfig,
        ring_capacity: usize,
        rt: &tokio::runtime::Handle,
    ) -> anyhow::Result<ZmqRemote> {
        let ring = Arc::new(RingBuffer::new(RingConfig::with_capacity(ring_capacity))?);
        let mut src = kvbm_ingest::vllm::ZmqSource::spawn(cfg, rt);
        let handle = src.handle();
        let r = ring.clone();
        let task = rt.spawn(async move {
            while let Some(item) = src.recv().await {
                forward_zmq(&r, item);
            }
        });
        Ok(ZmqRemote { ring, handle, task })
    }

    /// The local ring the events land in.
    pub fn ring(&self) -> &Arc<RingBuffer> {
        &self.ring
    }

    /// The source's state and counters.
    pub fn handle(&self) -> &kvbm_ingest::vllm::ZmqHandle {
        &self.handle
    }

    /// A live source reading the ring (no control, no slots), whose
    /// header badge is the subscription's state.
    pub fn source(&self) -> LiveSource {
        LiveSource::new(self.ring.clone(), None)
            .with_link(Arc::new(self.handle.clone()))
            .without_slots(kvbm_ingest::vllm::NO_SLOTS_REASON)
    }
}

impl Link for kvbm_ingest::vllm::ZmqHandle {
    fn badge(&self, now: Instant) -> Badge {
        zmq_badge(self.state(), self.gone_for(now), &self.counters())
    }
}

/// The header's badge for a ZMQ source: its state (`ZMQ SUBSCRIBED`,
/// `ZMQ PUBLISHER GONE 4s, reconnecting`, …) and what went wrong so far
/// (restarts, replay failures, skipped events, malformed messages), so none
/// of it is only in a log.
pub fn zmq_badge(
    state: kvbm_ingest::vllm::ZmqState,
    gone_for: Option<Duration>,
    c: &kvbm_ingest::vllm::ZmqCounters,
) -> Badge {
    use kvbm_ingest::vllm::ZmqState;
    let (mut text, tone) = match state {
        ZmqState::Connecting => ("ZMQ CONNECTING".to_string(), Tone::Caution),
        ZmqState::Subscribed => ("ZMQ SUBSCRIBED".to_string(), Tone::Ok),
        ZmqState::Gone => (
            format!(
                "ZMQ PUBLISHER GONE {}s, reconnecting",
                gone_for.unwrap_or_default().as_secs()
            ),
            Tone::Down,
        ),
        ZmqState::Stopped => ("ZMQ STOPPED".to_string(), Tone::Down),
    };
    let mut troubles = Vec::new();
    for (name, n) in [
        ("restarts", c.restarts),
        ("replay failed", c.replay_failures),
        ("skipped", c.skipped.total()),
        ("malformed", c.malformed),
    ] {
        if n > 0 {
            troubles.push(format!("{name} {n}"));
        }
    }
    let tone = if troubles.is_empty() || tone != Tone::Ok {
        tone
    } else {
        Tone::Caution
    };
    for t in troubles {
        text.push_str(" · ");
        text.push_str(&t);
    }
    Badge::new(text, tone)
}

/// Turns changes in a ZMQ source's counters into bottom-line messages
/// (the newest wins): the publisher going away, a restart, a replay
/// failure, skipped or malformed input, and joining a publisher late.
#[derive(Debug, Default)]
pub struct ZmqNotices {
    seen: kvbm_ingest::vllm::ZmqCounters,
    said_joined: bool,
}

impl ZmqNotices {
    /// The message for what changed since the last call, if anything did:
    /// `(text, is_error)`. `has_replay`: whether a replay endpoint was given.
    pub fn next(
        &mut self,
        c: &kvbm_ingest::vllm::ZmqCounters,
        has_replay: bool,
    ) -> Option<(String, bool)> {
        let old = std::mem::replace(&mut self.seen, c.clone());
        let mut msg = None;
        if !self.said_joined && c.first_seq.is_some_and(|s| s > 0) {
            self.said_joined = true;
            msg = Some((
                format!(
                    "joined the publisher at its batch {}: {} earlier batches fetched, {} not shown{}",
                    c.first_seq.unwrap_or(0),
                    c.fetched_before_start,
                    c.missed_before_start,
                    if has_replay || c.missed_before_start == 0 {
                        ""
                    } else {
                        " (attach with --replay-endpoint to fetch what its buffer holds)"
                    }
                ),
                c.missed_before_start > 0,
            ));
        }
        if c.malformed > old.malformed {
            msg = Some((
                format!(
                    "{} malformed message(s) skipped: {}",
                    c.malformed,
                    c.last_error.clone().unwrap_or_default()
                ),
                true,
            ));
        }
        if c.skipped.total() > old.skipped.total() {
            msg = Some((format!("events skipped: {}", c.skipped), true));
        }
        if c.disconnects > old.disconnects {
            msg = Some(("the publisher went away; reconnecting".into(), true));
        }
        if c.replay_failures > old.replay_failures {
            msg = Some((
                format!(
                    "replay failed: {}",
                    c.last_replay_error.clone().unwrap_or_default()
                ),
                true,
            ));
        }
        if c.restarts > old.restarts
            && let Some(r) = c.restart_log.last()
        {
            msg = Some((
                format!(
                    "publisher restarted (batch {} then {}; {}): the old engine's blocks were evicted",
                    r.last_seq,
                    r.new_seq,
                    r.cause.describe()
                ),
                true,
            ));
        }
        msg
    }
}

impl Drop for ZmqRemote {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Moves one item of the ZMQ source into the ring: its events, and its
/// losses inside the stream (what was published before the console joined
/// is not one; the header and the messages say it).
pub fn forward_zmq(ring: &RingBuffer, item: kvbm_ingest::vllm::ZmqItem) {
    use kvbm_ingest::vllm::ZmqItem;
    match item {
        ZmqItem::Events(events) => {
            for e in events {
                ring.push(e);
            }
        }
        g @ ZmqItem::Gap { .. } => ring.record_gap(g.missed()),
        ZmqItem::Joined { .. }
        | ZmqItem::Restart(_)
        | ZmqItem::Disconnected
        | ZmqItem::Connected { .. }
        | ZmqItem::ReplayFailed { .. } => {}
    }
}
