//! The ZMQ side: a SUB socket on the publisher, a DEALER on its replay
//! endpoint when one is given, the publisher's sequence and identity, and a
//! bounded channel of kvbm events.
//!
//! What the publisher's seq and connection say, and what is done:
//!
//! - **in order**: the batch is translated;
//! - **a jump** on the same connection (the publisher's high-water mark, a
//!   lossy link): the skipped batches are asked of the replay endpoint;
//!   what it does not return is lost ([`ZmqItem::Gap`], one hole in the
//!   kvbm seq per batch);
//! - **the connection dropped** ([`ZmqItem::Disconnected`]): the source
//!   reconnects by itself, at once and then every 100 ms doubling to 1 s
//!   (not the zeromq crate's own reconnection, which backs off to 30 s and
//!   logs on every try), so a restarted engine is found within about a
//!   second. The first batch on the new connection decides who is there:
//!   a seq not above the last one seen is a new publisher; otherwise the
//!   replay endpoint is asked for the last batch seen, and only the same
//!   bytes at the same seq prove the same publisher (its gap is then filled
//!   from that answer). Anything else, and any reconnection without a
//!   replay endpoint, is taken as a restart ([`ZmqItem::Restart`],
//!   [`RestartCause`]): rather than merge two engines' states, every block
//!   of the old one is evicted, and the new one's batches before the first
//!   seen (from its seq 0) are fetched from its replay endpoint or counted
//!   lost;
//! - **a seq going back** on the same connection: a restart too;
//! - **a seq jumping ahead further than any engine publishes** (more than
//!   [`MAX_SEQ_JUMP`] batches, or once the kvbm seq has reached
//!   [`HOLE_LIMIT`]): a restart ([`RestartCause::SeqJumped`]), not a loss
//!   of that many batches, so a hostile seq cannot use up the kvbm seq; a
//!   new publisher whose first seq is that far on has the batches before
//!   it counted in [`ZmqCounters::seq_too_far`], not as lost;
//! - **joining late** (the first batch seen has seq > 0): with
//!   [`ZmqConfig::since`] and a replay endpoint, the batches from `since`
//!   are fetched; what was not fetched is reported ([`ZmqItem::Joined`])
//!   as missed before the start (not a loss inside the recording).
//!
//! Replay answers are read in both framings engines use: vLLM's and
//! SGLang's `["", topic, seq, payload]` (and `["", "", END_SEQ, ""]`), and
//! the older `["", seq, payload]`; a missing delimiter is tolerated. One
//! answer is bounded in time ([`ZmqConfig::replay_deadline`]) and frames
//! ([`ZmqConfig::max_replay_frames`]): past either it counts as failed,
//! what it brought in range is kept, the rest of the range is lost, and
//! live reading resumes.
//!
//! A panic in the source's task ends it like a consumer going away would,
//! but is kept: [`ZmqHandle::failure`] says so, and
//! [`ZmqCounters::failure`] carries it into a recording.

use super::ZmqEndpoint;
use super::decode::{DecodeError, decode_payload};
use super::translate::{HOLE_LIMIT, TranslateCounters, Translator, TranslatorConfig};
use crate::vllm::decode::Skipped;
use futures_util::{FutureExt, StreamExt};
use kvbm_events::Event;
use serde::Serialize;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

/// The replay protocol's end marker.
pub const END_SEQ: u64 = u64::MAX;

/// Most unrecovered ranges (and restarts) the counters keep, in order;
/// later ones are only counted.
pub const MAX_LOGGED: usize = 1024;

/// The most publisher batches one jump in its seq is believed to have lost
/// (2^32). vLLM publishes at most one batch per engine step (a few hundred
/// a second): losing 2^32 of them between two batches received on one
/// connection would take months. A longer jump is not a count of batches
/// but a publisher that is not the one seen before (or a hostile one), and
/// placing it as holes could use up the kvbm seq.
pub const MAX_SEQ_JUMP: u64 = 1 << 32;

/// The default bound on one replay request. vLLM answers from its replay
/// buffer in memory (10,000 batches by default, each a few KB: tens of
/// MB) in well under a second on loopback or a LAN; 5 s is several times
/// that, and no longer than that does a slow endpoint stop live reading.
const REPLAY_DEADLINE: Duration = Duration::from_secs(5);

/// The default cap on one replay answer's frames: 6.5 times vLLM's default
/// buffer (10,000 batches), so an answer from a buffer several times
/// larger still fits; an endpoint sending more without an end marker is
/// not answering.
const MAX_REPLAY_FRAMES: usize = 1 << 16;

/// How a [`ZmqSource`] connects.
#[derive(Debug, Clone)]
pub struct ZmqConfig {
    /// The publisher.
    pub endpoint: ZmqEndpoint,
    /// Its replay (ROUTER) endpoint, for filling gaps, proving the
    /// publisher's identity after a reconnection, and joining late.
    pub replay: Option<ZmqEndpoint>,
    /// Topic prefix subscribed to (`""`: everything).
    pub topic: String,
    /// Stamping and bounds.
    pub translator: TranslatorConfig,
    /// [`ZmqItem`]s buffered for the consumer (≥ 1).
    pub channel_capacity: usize,
    /// Longest wait for one replay answer frame (and for connecting to
    /// the replay endpoint and sending the request).
    pub replay_timeout: Duration,
    /// Longest one replay request may take, end marker included; past it
    /// the replay counts as failed. Live reading waits while a replay is
    /// answered, so this bounds that stall.
    pub replay_deadline: Duration,
    /// Most frames one replay answer may send before its end marker, kept
    /// or not; past it the replay counts as failed.
    pub max_replay_frames: usize,
    /// Most batches one replay answer may bring; the rest of a longer
    /// answer is read but not kept (counted lost).
    pub max_replay_batches: usize,
    /// When the first batch seen is later than this publisher seq, fetch
    /// the batches from it through the replay endpoint (`None`: fetch
    /// nothing; those before the first are reported missed).
    pub since: Option<u64>,
    /// Longest wait for one connection attempt.
    pub connect_timeout: Duration,
    /// Wait before the first reconnection attempt; doubles up to
    /// [`reconnect_max`](Self::reconnect_max).
    pub reconnect_min: Duration,
    /// Longest wait between reconnection attempts.
    pub reconnect_max: Duration,
}

impl ZmqConfig {
    /// Defaults for `endpoint`.
    pub fn new(endpoint: ZmqEndpoint) -> Self {
        ZmqConfig {
            endpoint,
            replay: None,
            topic: String::new(),
            translator: TranslatorConfig::default(),
            channel_capacity: 256,
            replay_timeout: Duration::from_secs(2),
            replay_deadline: REPLAY_DEADLINE,
            max_replay_batches: 1 << 14,
            max_replay_frames: MAX_REPLAY_FRAMES,
            since: None,
            connect_timeout: Duration::from_secs(1),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(1),
        }
    }
}

/// Why a publisher was taken for a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum RestartCause {
    /// Its seq went back (a new publisher counts from 0).
    SeqWentBack,
    /// After a reconnection, its replay endpoint holds other bytes at the
    /// last seq seen: another publisher.
    ReplayDiffers,
    /// After a reconnection, nothing could prove it the same publisher (no
    /// replay endpoint, a replay that failed, or a buffer that no longer
    /// holds the last batch seen). It may be the same; kvbm assumes a new
    /// one rather than merge two engines' states.
    Unverified,
    /// Its seq jumped ahead by more than [`MAX_SEQ_JUMP`] batches (or the
    /// kvbm seq has no room left for the holes): no engine publishes that
    /// many in between, so it is taken for another publisher rather than
    /// counted as that many lost batches.
    SeqJumped,
}

impl RestartCause {
    /// In words, for summaries.
    pub fn describe(self) -> &'static str {
        match self {
            RestartCause::SeqWentBack => "its seq went back",
            RestartCause::ReplayDiffers => "its replay buffer holds other batches",
            RestartCause::Unverified => "it reconnected and could not be proved the same publisher",
            RestartCause::SeqJumped => "its seq jumped further ahead than an engine publishes",
        }
    }
}

/// A publisher restart, as detected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RestartAt {
    /// The last seq seen from the old publisher.
    pub last_seq: u64,
    /// The first seq seen from the new one.
    pub new_seq: u64,
    /// Why it was taken for a new one.
    pub cause: RestartCause,
}

/// Publisher batches `from..=to` (inclusive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SeqRange {
    /// First.
    pub from: u64,
    /// Last.
    pub to: u64,
}

/// What the source hands its consumer.
#[derive(Debug, Clone, PartialEq)]
pub enum ZmqItem {
    /// kvbm events, seqs gapless except where a [`ZmqItem::Gap`] left holes.
    Events(Vec<Event>),
    /// Publisher batches `from_seq..=to_seq` were missed and not recovered:
    /// lost inside the stream, one hole in the kvbm seq per batch.
    Gap {
        /// First missed publisher seq.
        from_seq: u64,
        /// Last missed publisher seq.
        to_seq: u64,
    },
    /// The first batch seen had seq `first_seq > 0`: the publisher ran
    /// before this source joined. `fetched` batches came from the replay
    /// endpoint; `missed` are not in the stream (and not a loss inside it).
    Joined {
        /// The first seq received live.
        first_seq: u64,
        /// Batches before it fetched through replay.
        fetched: u64,
        /// Batches before it neither received nor fetched.
        missed: u64,
    },
    /// A new publisher: every block of the old one is evicted (the
    /// evictions follow as [`ZmqItem::Events`]); the new one's batches
    /// before `new_seq` follow, replayed or as a [`ZmqItem::Gap`].
    Restart(RestartAt),
    /// The connection to the publisher dropped; the source reconnects.
    Disconnected,
    /// Connected to the publisher (`connects` so far, this one included).
    Connected {
        /// Connections made so far.
        connects: u64,
    },
    /// A replay request failed; what it was to recover follows as a
    /// [`ZmqItem::Gap`] (or as missed before the start).
    ReplayFailed {
        /// Why.
        error: String,
    },
}

impl ZmqItem {
    /// Batches a gap lost (0 for other items).
    pub fn missed(&self) -> u64 {
        match self {
            ZmqItem::Gap { from_seq, to_seq } => to_seq.saturating_sub(*from_seq) + 1,
            _ => 0,
        }
    }
}

/// Connection state, for display.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ZmqState {
    /// Waiting for the publisher (never connected yet).
    Connecting,
    /// Subscribed.
    Subscribed,
    /// The publisher went away; reconnecting.
    Gone,
    /// The task ended (the consumer went away).
    Stopped,
}

/// What went through the source.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ZmqCounters {
    /// Messages received on the SUB socket.
    pub messages: u64,
    /// Messages whose frames or payload could not be read (skipped).
    pub malformed: u64,
    /// Events inside good payloads that were skipped, by reason.
    pub skipped: Skipped,
    /// Ranges of publisher batches that had to be filled (seq jumps, a new
    /// publisher's first batches), whether replay recovered them or not.
    pub gaps: u64,
    /// Publisher batches missed and not recovered by replay (lost inside
    /// the stream).
    pub missed: u64,
    /// The unrecovered ranges, in order (the first [`MAX_LOGGED`]).
    pub missed_ranges: Vec<SeqRange>,
    /// Replay requests sent.
    pub replay_requests: u64,
    /// Batches recovered through replay.
    pub replayed: u64,
    /// Replays that failed (connect, timeout or a bad answer).
    pub replay_failures: u64,
    /// The last replay failure.
    pub last_replay_error: Option<String>,
    /// Publisher restarts detected.
    pub restarts: u64,
    /// The restarts, in order (the first [`MAX_LOGGED`]).
    pub restart_log: Vec<RestartAt>,
    /// Connections made to the publisher.
    pub connects: u64,
    /// Times the publisher's connection dropped.
    pub disconnects: u64,
    /// Reconnections proved (through replay) to reach the same publisher.
    pub same_publisher: u64,
    /// The first publisher seq seen.
    pub first_seq: Option<u64>,
    /// The last publisher seq seen.
    pub last_seq: Option<u64>,
    /// Batches before the first seen, fetched through replay.
    pub fetched_before_start: u64,
    /// Batches before the first seen, neither received nor fetched.
    pub missed_before_start: u64,
    /// The last malformed message's error (or connection error).
    pub last_error: Option<String>,
    /// New publishers whose first seq was too far on (more than
    /// [`MAX_SEQ_JUMP`], or no room left in the kvbm seq) for the batches
    /// before it to be counted: those are in neither `missed` nor the
    /// restart's gap.
    pub seq_too_far: u64,
    /// Why the source's task died, if it did (a panic); the counters stop
    /// where it did.
    pub failure: Option<String>,
    /// The translator's counters.
    pub translate: TranslateCounters,
}

impl ZmqCounters {
    fn log_missed(&mut self, from: u64, to: u64) {
        if self.missed_ranges.len() < MAX_LOGGED {
            self.missed_ranges.push(SeqRange { from, to });
        }
    }

    /// What was lost, refused or skipped, in one line for a command's
    /// exit line: `2 gaps (7 batches lost), 1 malformed messages, 3 events
    /// skipped (unknown medium 1, …; last: …), 0 restarts`, then the
    /// failure of a source that died. Every consumer says the same.
    pub fn summary(&self) -> impl std::fmt::Display + '_ {
        Summary(self)
    }
}

struct Summary<'a>(&'a ZmqCounters);

impl std::fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = self.0;
        write!(
            f,
            "{} gaps ({} batches lost), {} malformed messages, ",
            c.gaps, c.missed, c.malformed
        )?;
        if c.skipped.total() > 0 {
            // `Skipped`'s own form: the total, then by reason.
            write!(f, "skipped events {}", c.skipped)?;
        } else {
            write!(f, "0 events skipped")?;
        }
        write!(f, ", {} restarts", c.restarts)?;
        if c.translate.bad_timestamps > 0 {
            write!(
                f,
                ", {} batch timestamps refused (not a time, or over a day ahead of this clock)",
                c.translate.bad_timestamps
            )?;
        }
        if c.seq_too_far > 0 {
            write!(
                f,
                " ({} with a first seq too far on to count what came before)",
                c.seq_too_far
            )?;
        }
        if let Some(e) = &c.failure {
            write!(f, "; {e}")?;
        }
        Ok(())
    }
}

#[derive(Default)]
struct Shared {
    state: AtomicU8,
    counters: Mutex<ZmqCounters>,
    received: AtomicU64,
    gone_since: Mutex<Option<Instant>>,
    failure: Mutex<Option<SourceError>>,
}

/// Why a [`ZmqSource`] ended other than by its consumer going away.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// Its task panicked (a bug): what it had read until then was handed
    /// on; nothing after.
    #[error("the ZMQ source's task panicked: {0}")]
    Panicked(String),
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A handle for display and counters; cheap to clone.
#[derive(Clone)]
pub struct ZmqHandle {
    shared: Arc<Shared>,
    url: String,
}

impl ZmqHandle {
    /// The publisher's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Where the connection stands.
    pub fn state(&self) -> ZmqState {
        match self.shared.state.load(Ordering::Relaxed) {
            CONNECTING => ZmqState::Connecting,
            SUBSCRIBED => ZmqState::Subscribed,
            GONE => ZmqState::Gone,
            _ => ZmqState::Stopped,
        }
    }

    /// How long the publisher has been gone, while it is.
    pub fn gone_for(&self, now: Instant) -> Option<Duration> {
        if self.state() != ZmqState::Gone {
            return None;
        }
        lock(&self.shared.gone_since).map(|t| now.saturating_duration_since(t))
    }

    /// Messages received so far (cheap).
    pub fn received(&self) -> u64 {
        self.shared.received.load(Ordering::Relaxed)
    }

    /// The counters now.
    pub fn counters(&self) -> ZmqCounters {
        lock(&self.shared.counters).clone()
    }

    /// Why the source's task died, if it did. Set before its channel
    /// closes, so a consumer whose [`ZmqSource::recv`] returned `None`
    /// sees it.
    pub fn failure(&self) -> Option<SourceError> {
        lock(&self.shared.failure).clone()
    }
}

/// A running source: one task reading the publisher. Dropping it stops
/// the task.
pub struct ZmqSource {
    rx: mpsc::Receiver<ZmqItem>,
    handle: ZmqHandle,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ZmqSource {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ZmqSource {
    /// Starts the task on `rt`; it connects in the background and keeps
    /// reconnecting (see the module docs).
    pub fn spawn(cfg: ZmqConfig, rt: &tokio::runtime::Handle) -> ZmqSource {
        let (tx, rx) = mpsc::channel(cfg.channel_capacity.max(1));
        let shared = Arc::new(Shared::default());
        let handle = ZmqHandle {
            shared: shared.clone(),
            url: cfg.endpoint.to_string(),
        };
        let task = rt.spawn(guarded(run(cfg, tx.clone(), shared.clone()), tx, shared));
        ZmqSource { rx, handle, task }
    }

    /// The next item; `None` once the task ended ([`ZmqHandle::failure`]
    /// then says whether it died rather than stopped).
    pub async fn recv(&mut self) -> Option<ZmqItem> {
        self.rx.recv().await
    }

    /// A handle for display.
    pub fn handle(&self) -> ZmqHandle {
        self.handle.clone()
    }
}

/// Runs the source's task `f`; a panic in it is kept as its failure. `tx`
/// is held until then, so the consumer's channel closes only after the
/// failure is readable: a dead source must not look like one that ended
/// cleanly.
async fn guarded(f: impl Future<Output = ()>, tx: mpsc::Sender<ZmqItem>, shared: Arc<Shared>) {
    if let Err(panic) = AssertUnwindSafe(f).catch_unwind().await {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_string());
        let e = SourceError::Panicked(why);
        lock(&shared.counters).failure = Some(e.to_string());
        *lock(&shared.failure) = Some(e);
        shared.state.store(STOPPED, Ordering::Relaxed);
    }
    drop(tx);
}

/// Reads a live message: `[topic, seq, payload]` (or `[seq, payload]`).
pub fn split_frames<'a>(frames: &[&'a [u8]]) -> Result<(u64, &'a [u8]), DecodeError> {
    let (seq, payload) = match frames {
        [_topic, seq, payload] => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return Err(DecodeError::Shape("expected [topic, seq, payload] frames")),
    };
    Ok((seq_of(seq)?, payload))
}

fn seq_of(frame: &[u8]) -> Result<u64, DecodeError> {
    let seq: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::Shape("the seq frame is not 8 bytes"))?;
    Ok(u64::from_be_bytes(seq))
}

/// Reads one frame of a replay answer as a DEALER receives it: vLLM's and
/// SGLang's `["", topic, seq, payload]`, the older `["", seq, payload]`,
/// or either without the empty delimiter. The last two frames are always
/// the seq and the payload; a leading frame of four must be the empty
/// delimiter.
pub fn split_replay_frames<'a>(frames: &[&'a [u8]]) -> Result<(u64, &'a [u8]), DecodeError> {
    let (seq, payload) = match frames {
        [[], _topic, seq, payload] => (seq, payload),
        [_, seq, payload] | [seq, payload] => (seq, payload),
        _ => {
            return Err(DecodeError::Shape(
                "expected [\"\", topic, seq, payload] replay frames",
            ));
        }
    };
    Ok((seq_of(seq)?, payload))
}

/// A replay request that failed, with what it brought before it did.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error}")]
pub struct ReplayFailure {
    /// Why.
    pub error: String,
    /// Batches in the asked range received before it failed (an answer
    /// cut short), in the order sent: real batches, kept rather than lost.
    pub partial: Vec<(u64, Vec<u8>)>,
}

impl From<String> for ReplayFailure {
    fn from(error: String) -> Self {
        ReplayFailure {
            error,
            partial: Vec::new(),
        }
    }
}

impl From<&str> for ReplayFailure {
    fn from(error: &str) -> Self {
        error.to_string().into()
    }
}

/// Asks a replay endpoint for batches.
pub trait Replay {
    /// The batches it holds with `from <= seq <= to`, in the order sent
    /// (at most `max` kept), or why the request failed (with what it had
    /// brought).
    fn fetch(
        &mut self,
        from: u64,
        to: u64,
    ) -> impl Future<Output = Result<Vec<(u64, Vec<u8>)>, ReplayFailure>> + Send;
}

/// [`Replay`] over ZeroMQ: a fresh DEALER per request (so a half-read
/// answer, or a connection to a publisher that has gone, is never reused).
pub struct ZmqReplay {
    endpoint: ZmqEndpoint,
    timeout: Duration,
    deadline: Duration,
    max: usize,
    max_frames: usize,
}

impl ZmqReplay {
    /// A replay client for `endpoint`: `timeout` per frame,
    /// `max_batches` kept per answer, and the defaults of [`ZmqConfig`]
    /// for the bounds on a whole answer ([`bounded`](Self::bounded)
    /// changes them).
    pub fn new(endpoint: ZmqEndpoint, timeout: Duration, max_batches: usize) -> Self {
        ZmqReplay {
            endpoint,
            timeout,
            deadline: REPLAY_DEADLINE,
            max: max_batches.max(1),
            max_frames: MAX_REPLAY_FRAMES,
        }
    }

    /// Bounds one whole request: at most `deadline`, and at most
    /// `max_frames` frames before the end marker.
    pub fn bounded(mut self, deadline: Duration, max_frames: usize) -> Self {
        self.deadline = deadline;
        self.max_frames = max_frames.max(1);
        self
    }
}

impl Replay for ZmqReplay {
    async fn fetch(&mut self, from: u64, to: u64) -> Result<Vec<(u64, Vec<u8>)>, ReplayFailure> {
        let ep = &self.endpoint;
        // The per-frame timeout alone lets an endpoint that drips frames
        // (or streams them without end) hold live reading forever.
        let deadline = tokio::time::Instant::now() + self.deadline;
        let mut opts = SocketOptions::default();
        opts.connect_timeout(self.timeout);
        let mut d = zeromq::DealerSocket::with_options(opts);
        d.connect(&ep.zmq_addr())
            .await
            .map_err(|e| format!("replay endpoint {ep}: {e}"))?;
        let mut req = ZmqMessage::from(Vec::<u8>::new());
        req.push_back(from.to_be_bytes().to_vec().into());
        tokio::time::timeout(self.timeout, d.send(req))
            .await
            .map_err(|_| format!("replay endpoint {ep}: the request could not be sent"))?
            .map_err(|e| format!("replay endpoint {ep}: {e}"))?;
        let mut got = Vec::new();
        let fail = |error: String, partial| ReplayFailure {
            error: format!("replay endpoint {ep}: {error}"),
            partial,
        };
        let mut frames = 0usize;
        loop {
            let frame_by = (tokio::time::Instant::now() + self.timeout).min(deadline);
            let m = match tokio::time::timeout_at(frame_by, d.recv()).await {
                Err(_) if frame_by == deadline => {
                    return Err(fail(
                        format!(
                            "no end marker within {:.1} s ({frames} frames)",
                            self.deadline.as_secs_f64()
                        ),
                        got,
                    ));
                }
                Err(_) => {
                    return Err(fail(
                        format!("no answer within {:.1} s", self.timeout.as_secs_f64()),
                        got,
                    ));
                }
                Ok(Err(e)) => return Err(fail(e.to_string(), got)),
                Ok(Ok(m)) => m,
            };
            let parts: Vec<&[u8]> = m.iter().map(|b| b.as_ref()).collect();
            let (seq, payload) = match split_replay_frames(&parts) {
                Ok(x) => x,
                Err(e) => return Err(fail(e.to_string(), got)),
            };
            if seq == END_SEQ {
                tracing::debug!("replay {from}..={to} answered: {} batches", got.len());
                return Ok(got);
            }
            frames += 1;
            if frames > self.max_frames {
                return Err(fail(
                    format!("more than {} frames without an end marker", self.max_frames),
                    got,
                ));
            }
            if (from..=to).contains(&seq) && got.len() < self.max {
                got.push((seq, payload.to_vec()));
            }
        }
    }
}

/// A [`Replay`] that has nothing (no replay endpoint).
pub struct NoReplay;

impl Replay for NoReplay {
    async fn fetch(&mut self, _from: u64, _to: u64) -> Result<Vec<(u64, Vec<u8>)>, ReplayFailure> {
        Err("no replay endpoint".into())
    }
}

/// Whether missing batches are a loss inside the stream or were published
/// before it started.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Missing {
    Lost,
    BeforeStart,
}

/// The per-message logic, without the sockets: the publisher's seq and
/// identity, replay, decoding and translation. [`ZmqSource`] drives it;
/// tests drive it with an in-memory [`Replay`].
pub struct Pipeline {
    last: Option<u64>,
    /// xxh3-64 of the last payload seen, to recognise its publisher.
    last_hash: u64,
    /// A new connection whose first message has not been seen.
    fresh: bool,
    has_replay: bool,
    since: Option<u64>,
    tr: Translator,
    counters: ZmqCounters,
}

impl Pipeline {
    /// A pipeline stamping with `cfg.translator`, with `cfg`'s `since` and
    /// replay endpoint (or none).
    pub fn new(cfg: &ZmqConfig) -> Self {
        Pipeline {
            last: None,
            last_hash: 0,
            fresh: false,
            has_replay: cfg.replay.is_some(),
            since: cfg.since,
            tr: Translator::new(cfg.translator),
            counters: ZmqCounters::default(),
        }
    }

    /// The counters now.
    pub fn counters(&self) -> ZmqCounters {
        let mut c = self.counters.clone();
        c.translate = self.tr.counters();
        c
    }

    /// A (new) connection to the publisher is up: its first message must
    /// prove who is there.
    pub fn connected(&mut self) -> ZmqItem {
        self.counters.connects += 1;
        self.fresh = true;
        ZmqItem::Connected {
            connects: self.counters.connects,
        }
    }

    /// The connection dropped.
    pub fn disconnected(&mut self) -> ZmqItem {
        self.counters.disconnects += 1;
        ZmqItem::Disconnected
    }

    fn malformed(&mut self, e: impl std::fmt::Display) {
        self.counters.malformed += 1;
        self.counters.last_error = Some(e.to_string());
    }

    /// Takes one SUB message's frames; what follows from it goes to `out`
    /// in order, asking `replay` for what is missing.
    pub async fn message<R: Replay>(
        &mut self,
        frames: &[&[u8]],
        replay: &mut R,
        out: &mut Vec<ZmqItem>,
    ) {
        self.counters.messages += 1;
        let (seq, payload) = match split_frames(frames) {
            Ok(x) => x,
            Err(e) => return self.malformed(e),
        };
        let hash = xxhash_rust::xxh3::xxh3_64(payload);
        match self.last {
            None => {
                self.counters.first_seq = Some(seq);
                if seq > 0 {
                    self.join(seq, replay, out).await;
                }
            }
            Some(last) if self.fresh => self.reconnected(last, seq, replay, out).await,
            Some(last) if seq == last.wrapping_add(1) => {}
            Some(last) if seq > last && self.believable(seq - last - 1) => {
                self.fill(last + 1, seq - 1, replay, Missing::Lost, out)
                    .await;
            }
            Some(last) if seq > last => {
                self.restart(last, seq, RestartCause::SeqJumped, replay, out)
                    .await;
            }
            Some(last) => {
                self.restart(last, seq, RestartCause::SeqWentBack, replay, out)
                    .await;
            }
        }
        self.fresh = false;
        self.last = Some(seq);
        self.last_hash = hash;
        self.counters.last_seq = Some(seq);
        // The seq is real even when the payload is not: it is tracked, the
        // message counted as malformed, and its events are lost as surely
        // as a batch that never came: one hole in the kvbm seq, placed in
        // the recording, so its verdict does not call the stream whole.
        if !self.apply_payload(payload, out) {
            self.counters.gaps += 1;
            self.missing(seq, seq, Missing::Lost, out);
        }
    }

    /// Whether `n` batches missing inside the stream can be taken at the
    /// publisher's word and placed as `n` holes in the kvbm seq: not a
    /// jump no engine makes ([`MAX_SEQ_JUMP`]), and the kvbm seq not yet
    /// at [`HOLE_LIMIT`] (so holes can never use it up).
    fn believable(&self, n: u64) -> bool {
        n <= MAX_SEQ_JUMP && self.tr.next_seq() < HOLE_LIMIT
    }

    fn apply_payload(&mut self, payload: &[u8], out: &mut Vec<ZmqItem>) -> bool {
        match decode_payload(payload) {
            Ok(b) => {
                self.counters.skipped.add(&b.skipped);
                let mut evs = Vec::new();
                self.tr.batch(&b, &mut evs);
                if !evs.is_empty() {
                    out.push(ZmqItem::Events(evs));
                }
                true
            }
            Err(e) => {
                self.malformed(e);
                false
            }
        }
    }

    async fn join<R: Replay>(&mut self, seq: u64, replay: &mut R, out: &mut Vec<ZmqItem>) {
        let before = (
            self.counters.fetched_before_start,
            self.counters.missed_before_start,
        );
        match self.since {
            // A later hole in the answer is a loss inside the stream, so
            // the range must be one whose holes can be placed.
            Some(since) if since < seq && self.has_replay && self.believable(seq - since) => {
                self.fill(since, seq - 1, replay, Missing::BeforeStart, out)
                    .await;
                // What lies before `since` was not asked for.
                self.counters.missed_before_start =
                    self.counters.missed_before_start.saturating_add(since);
            }
            _ => {
                self.counters.missed_before_start =
                    self.counters.missed_before_start.saturating_add(seq)
            }
        }
        out.push(ZmqItem::Joined {
            first_seq: seq,
            fetched: self.counters.fetched_before_start - before.0,
            missed: self.counters.missed_before_start - before.1,
        });
    }

    async fn reconnected<R: Replay>(
        &mut self,
        last: u64,
        seq: u64,
        replay: &mut R,
        out: &mut Vec<ZmqItem>,
    ) {
        if seq <= last {
            return self
                .restart(last, seq, RestartCause::SeqWentBack, replay, out)
                .await;
        }
        if !self.believable(seq - last - 1) {
            return self
                .restart(last, seq, RestartCause::SeqJumped, replay, out)
                .await;
        }
        if !self.has_replay {
            return self
                .restart(last, seq, RestartCause::Unverified, replay, out)
                .await;
        }
        self.counters.replay_requests += 1;
        let answer = match replay.fetch(last, seq - 1).await {
            Ok(answer) => answer,
            Err(f) => {
                self.replay_failed(f.error, out);
                // An answer cut short may still hold the proof.
                f.partial
            }
        };
        let cause = match answer.first() {
            Some((s, p)) if *s == last && xxhash_rust::xxh3::xxh3_64(p) == self.last_hash => {
                // The same publisher: the rest of the answer fills the gap.
                self.counters.same_publisher += 1;
                if seq > last + 1 {
                    self.counters.gaps += 1;
                    self.apply_answer(last + 1, seq - 1, &answer[1..], Missing::Lost, out);
                }
                return;
            }
            Some((s, _)) if *s == last => RestartCause::ReplayDiffers,
            _ => RestartCause::Unverified,
        };
        self.restart(last, seq, cause, replay, out).await;
    }

    async fn restart<R: Replay>(
        &mut self,
        last: u64,
        seq: u64,
        cause: RestartCause,
        replay: &mut R,
        out: &mut Vec<ZmqItem>,
    ) {
        let at = RestartAt {
            last_seq: last,
            new_seq: seq,
            cause,
        };
        self.counters.restarts += 1;
        if self.counters.restart_log.len() < MAX_LOGGED {
            self.counters.restart_log.push(at);
        }
        out.push(ZmqItem::Restart(at));
        let mut evs = Vec::new();
        self.tr.restart(&mut evs);
        if !evs.is_empty() {
            out.push(ZmqItem::Events(evs));
        }
        if seq > 0 && self.believable(seq) {
            self.fill(0, seq - 1, replay, Missing::Lost, out).await;
        } else if seq > 0 {
            // Not a count of batches this publisher sent: nothing is
            // placed as lost, but the user is told.
            self.counters.seq_too_far += 1;
        }
    }

    fn replay_failed(&mut self, error: String, out: &mut Vec<ZmqItem>) {
        tracing::warn!("replay failed: {error}");
        self.counters.replay_failures += 1;
        self.counters.last_replay_error = Some(error.clone());
        out.push(ZmqItem::ReplayFailed { error });
    }

    /// Batches `from..=to` are missing: asks the replay endpoint (when
    /// there is one) and applies what it returns in order; the rest is
    /// `how` missing.
    async fn fill<R: Replay>(
        &mut self,
        from: u64,
        to: u64,
        replay: &mut R,
        how: Missing,
        out: &mut Vec<ZmqItem>,
    ) {
        self.counters.gaps += u64::from(how == Missing::Lost);
        let answer = if self.has_replay {
            self.counters.replay_requests += 1;
            match replay.fetch(from, to).await {
                Ok(a) => a,
                Err(f) => {
                    self.replay_failed(f.error, out);
                    // What it brought before failing is kept.
                    f.partial
                }
            }
        } else {
            Vec::new()
        };
        self.apply_answer(from, to, &answer, how, out);
    }

    fn apply_answer(
        &mut self,
        from: u64,
        to: u64,
        answer: &[(u64, Vec<u8>)],
        mut how: Missing,
        out: &mut Vec<ZmqItem>,
    ) {
        let history = how == Missing::BeforeStart;
        let mut next = from;
        for (s, payload) in answer {
            // In order, inside the range, no repeats.
            if *s < next || *s > to {
                continue;
            }
            if *s > next {
                self.missing(next, *s - 1, how, out);
            }
            if history {
                self.counters.fetched_before_start += 1;
            } else {
                self.counters.replayed += 1;
            }
            if !self.apply_payload(payload, out) {
                // Fetched but unreadable: missing as the rest of the range.
                self.missing(*s, *s, how, out);
            }
            // Once something is in, a later hole is a loss inside.
            how = Missing::Lost;
            next = *s + 1;
        }
        if next <= to {
            self.missing(next, to, how, out);
        }
    }

    fn missing(&mut self, from: u64, to: u64, how: Missing, out: &mut Vec<ZmqItem>) {
        // Saturating: `from..=to` may be every seq before a first batch.
        let n = (to - from).saturating_add(1);
        match how {
            Missing::BeforeStart => {
                self.counters.missed_before_start =
                    self.counters.missed_before_start.saturating_add(n)
            }
            Missing::Lost => {
                self.counters.missed = self.counters.missed.saturating_add(n);
                self.counters.log_missed(from, to);
                self.tr.skip(n);
                out.push(ZmqItem::Gap {
                    from_seq: from,
                    to_seq: to,
                });
            }
        }
    }
}

const CONNECTING: u8 = 0;
const SUBSCRIBED: u8 = 1;
const GONE: u8 = 2;
const STOPPED: u8 = 3;

/// A SUB socket connected and subscribed, with its monitor (which reports
/// the peer going away).
async fn connect(
    cfg: &ZmqConfig,
) -> Result<
    (
        zeromq::SubSocket,
        impl futures_util::Stream<Item = SocketEvent>,
    ),
    String,
> {
    let mut opts = SocketOptions::default();
    opts.connect_timeout(cfg.connect_timeout);
    let mut sub = zeromq::SubSocket::with_options(opts);
    let monitor = sub.monitor();
    sub.connect(&cfg.endpoint.zmq_addr())
        .await
        .map_err(|e| format!("connect {}: {e}", cfg.endpoint))?;
    sub.subscribe(&cfg.topic)
        .await
        .map_err(|e| format!("subscribe {}: {e}", cfg.endpoint))?;
    Ok((sub, monitor))
}

async fn run(cfg: ZmqConfig, tx: mpsc::Sender<ZmqItem>, shared: Arc<Shared>) {
    let mut pipe = Pipeline::new(&cfg);
    let mut zmq_replay = cfg.replay.clone().map(|ep| {
        ZmqReplay::new(ep, cfg.replay_timeout, cfg.max_replay_batches)
            .bounded(cfg.replay_deadline, cfg.max_replay_frames)
    });
    let publish = |pipe: &Pipeline| *lock(&shared.counters) = pipe.counters();
    let set_state = |s: u8| shared.state.store(s, Ordering::Relaxed);
    let mut out = Vec::new();
    let mut wait = cfg.reconnect_min;
    // Hands `out` to the consumer; false once it has gone.
    async fn flush(out: &mut Vec<ZmqItem>, tx: &mpsc::Sender<ZmqItem>) -> bool {
        for item in out.drain(..) {
            if tx.send(item).await.is_err() {
                return false;
            }
        }
        true
    }
    loop {
        let (mut sub, mut monitor) = match connect(&cfg).await {
            Ok(l) => l,
            Err(e) => {
                pipe.counters.last_error = Some(e);
                publish(&pipe);
                if tx.is_closed() {
                    break;
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(cfg.reconnect_max);
                continue;
            }
        };
        wait = cfg.reconnect_min;
        out.push(pipe.connected());
        set_state(SUBSCRIBED);
        publish(&pipe);
        if !flush(&mut out, &tx).await {
            break;
        }
        loop {
            tokio::select! {
                m = sub.recv() => match m {
                    Ok(msg) => {
                        shared.received.fetch_add(1, Ordering::Relaxed);
                        let frames: Vec<&[u8]> = msg.iter().map(|b| b.as_ref()).collect();
                        match zmq_replay.as_mut() {
                            Some(r) => pipe.message(&frames, r, &mut out).await,
                            None => pipe.message(&frames, &mut NoReplay, &mut out).await,
                        }
                        publish(&pipe);
                        if !flush(&mut out, &tx).await {
                            set_state(STOPPED);
                            return;
                        }
                    }
                    Err(e) => {
                        // The monitor says whether the peer went away.
                        tracing::debug!("zmq sub: {e}");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                },
                ev = monitor.next() => match ev {
                    Some(SocketEvent::Disconnected(_)) | None => break,
                    Some(_) => {}
                },
            }
        }
        // Dropping the socket stops the crate's own reconnection task.
        drop(sub);
        tracing::warn!("the publisher {} went away; reconnecting", cfg.endpoint);
        *lock(&shared.gone_since) = Some(Instant::now());
        set_state(GONE);
        out.push(pipe.disconnected());
        publish(&pipe);
        if !flush(&mut out, &tx).await {
            break;
        }
        tokio::time::sleep(cfg.reconnect_min).await;
    }
    set_state(STOPPED);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipeline() -> Pipeline {
        Pipeline::new(&ZmqConfig::new(
            ZmqEndpoint::parse("zmq://127.0.0.1:1").unwrap(),
        ))
    }

    fn feed(p: &mut Pipeline, seq: u64, payload: &[u8]) -> Vec<ZmqItem> {
        let mut out = Vec::new();
        let s = seq.to_be_bytes();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(p.message(&[b"".as_slice(), &s, payload], &mut NoReplay, &mut out));
        out
    }

    /// `[ts, [], None]`: a batch with no events.
    const EMPTY: &[u8] = &[0x93, 0x01, 0x90, 0xc0];

    /// Jumps each within [`MAX_SEQ_JUMP`] could still, many of them, use
    /// up the kvbm seq with holes; once it is at [`HOLE_LIMIT`] a jump is a
    /// restart, and the stamp stays far from `u64::MAX`.
    #[test]
    fn no_hole_is_placed_past_the_hole_limit() {
        let mut p = pipeline();
        feed(&mut p, 0, EMPTY);
        p.tr.skip(HOLE_LIMIT);
        let items = feed(&mut p, 2, EMPTY);
        assert!(
            matches!(
                items[..],
                [ZmqItem::Restart(RestartAt {
                    cause: RestartCause::SeqJumped,
                    ..
                })]
            ),
            "{items:?}"
        );
        assert_eq!(p.tr.next_seq(), HOLE_LIMIT, "no hole left");
        let c = p.counters();
        assert_eq!((c.missed, c.seq_too_far), (0, 1));
    }

    /// A panic in the source's task closed its channel like a clean stop
    /// (the recorder then exited 0 with a recording that looked whole).
    /// The failure is kept, and readable once the channel has closed.
    #[test]
    fn a_panic_in_the_task_is_kept_as_its_failure() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let shared = Arc::new(Shared::default());
        let handle = ZmqHandle {
            shared: shared.clone(),
            url: String::new(),
        };
        let (tx, mut rx) = mpsc::channel::<ZmqItem>(1);
        let task_tx = tx.clone();
        rt.block_on(async {
            let task = tokio::spawn(guarded(
                async move {
                    let _tx = task_tx;
                    panic!("attempt to add with overflow");
                },
                tx,
                shared,
            ));
            assert_eq!(rx.recv().await, None);
            // The failure was recorded before the channel closed.
            assert_eq!(
                handle.failure(),
                Some(SourceError::Panicked("attempt to add with overflow".into()))
            );
            task.await.unwrap();
        });
        assert_eq!(handle.state(), ZmqState::Stopped);
        let c = handle.counters();
        assert!(
            c.failure.as_deref().is_some_and(|f| f.contains("panicked")),
            "{c:?}"
        );
        assert!(c.summary().to_string().contains("panicked"));
    }

    /// The bridge's exit line said nothing of skipped events; every
    /// consumer's summary now says what was skipped, by reason.
    #[test]
    fn the_summary_says_what_was_skipped_by_reason() {
        let mut c = ZmqCounters {
            gaps: 2,
            missed: 7,
            malformed: 1,
            ..ZmqCounters::default()
        };
        assert_eq!(
            c.summary().to_string(),
            "2 gaps (7 batches lost), 1 malformed messages, 0 events skipped, 0 restarts"
        );
        c.skipped = Skipped {
            unknown_medium: 2,
            unknown_type: 2,
            malformed: 9,
            last: Some("medium `TAPE` is not one kvbm maps".into()),
        };
        assert_eq!(
            c.summary().to_string(),
            "2 gaps (7 batches lost), 1 malformed messages, skipped events 13 (unknown medium 2, \
             unknown type 2, malformed 9; last: medium `TAPE` is not one kvbm maps), 0 restarts"
        );
    }
}
