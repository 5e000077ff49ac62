//! The ZMQ side: a SUB socket on the publisher, an optional DEALER on its
//! replay endpoint, sequence tracking, and a bounded channel of kvbm events.

use super::ZmqEndpoint;
use super::decode::{DecodeError, KvBatch, decode_payload};
use super::translate::{TranslateCounters, Translator, TranslatorConfig};
use kvbm_events::Event;
use serde::Serialize;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// The replay protocol's end marker.
pub const END_SEQ: u64 = u64::MAX;

/// How a [`ZmqSource`] connects.
#[derive(Debug, Clone)]
pub struct ZmqConfig {
    /// The publisher.
    pub endpoint: ZmqEndpoint,
    /// Its replay (ROUTER) endpoint, for filling gaps.
    pub replay: Option<ZmqEndpoint>,
    /// Topic prefix subscribed to (`""`: everything).
    pub topic: String,
    /// Stamping and bounds.
    pub translator: TranslatorConfig,
    /// [`ZmqItem`]s buffered for the consumer (≥ 1).
    pub channel_capacity: usize,
    /// Longest wait for one replay answer frame.
    pub replay_timeout: Duration,
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
        }
    }
}

/// What the source hands its consumer.
#[derive(Debug, Clone, PartialEq)]
pub enum ZmqItem {
    /// kvbm events, seqs gapless.
    Events(Vec<Event>),
    /// Publisher batches `from_seq..=to_seq` were missed (and not replayed).
    Gap {
        /// First missed publisher seq.
        from_seq: u64,
        /// Last missed publisher seq.
        to_seq: u64,
    },
    /// The publisher's seq went back (it restarted); the evictions of every
    /// live block follow as [`ZmqItem::Events`].
    Restart {
        /// The last seq seen before.
        last_seq: u64,
        /// The seq that went back.
        new_seq: u64,
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

/// What the publisher's seq says about a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The first message seen.
    First,
    /// The one expected.
    InOrder,
    /// Later than expected: `from..=to` are missing.
    Gap {
        /// First missing.
        from: u64,
        /// Last missing.
        to: u64,
    },
    /// Earlier than expected: the publisher restarted (PUB/SUB never
    /// repeats a message, so a seq going back is a new publisher).
    Restart {
        /// The last seq seen before.
        last: u64,
    },
}

/// Follows the publisher's seq.
#[derive(Debug, Clone, Copy, Default)]
pub struct SeqTracker {
    last: Option<u64>,
}

impl SeqTracker {
    /// The last seq accepted.
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Judges `seq` and accepts it as the last.
    pub fn observe(&mut self, seq: u64) -> SeqVerdict {
        let v = match self.last {
            None => SeqVerdict::First,
            Some(last) => {
                let expected = last.wrapping_add(1);
                if seq == expected {
                    SeqVerdict::InOrder
                } else if seq > expected {
                    SeqVerdict::Gap {
                        from: expected,
                        to: seq - 1,
                    }
                } else {
                    SeqVerdict::Restart { last }
                }
            }
        };
        self.last = Some(seq);
        v
    }
}

/// Connection state, for display.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ZmqState {
    /// Waiting for the publisher.
    Connecting,
    /// Subscribed.
    Subscribed,
    /// The task ended (the consumer went away, or the socket failed).
    Stopped,
}

/// What went through the source.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ZmqCounters {
    /// Messages received on the SUB socket.
    pub messages: u64,
    /// Messages whose frames or payload could not be read (skipped).
    pub malformed: u64,
    /// Events inside good payloads that could not be read (skipped).
    pub bad_events: u64,
    /// Gaps in the publisher's seq.
    pub gaps: u64,
    /// Publisher batches missed and not recovered by replay.
    pub missed: u64,
    /// Replay requests sent.
    pub replay_requests: u64,
    /// Batches recovered through replay.
    pub replayed: u64,
    /// Replays that failed (connect, timeout or a bad answer).
    pub replay_failures: u64,
    /// Publisher restarts.
    pub restarts: u64,
    /// The first publisher seq seen (batches before it were never asked for).
    pub first_seq: Option<u64>,
    /// The last publisher seq seen.
    pub last_seq: Option<u64>,
    /// The last malformed payload's error.
    pub last_error: Option<String>,
    /// The translator's counters.
    pub translate: TranslateCounters,
}

#[derive(Default)]
struct Shared {
    state: AtomicU8,
    counters: Mutex<ZmqCounters>,
    received: AtomicU64,
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
            0 => ZmqState::Connecting,
            1 => ZmqState::Subscribed,
            _ => ZmqState::Stopped,
        }
    }

    /// Messages received so far (cheap).
    pub fn received(&self) -> u64 {
        self.shared.received.load(Ordering::Relaxed)
    }

    /// The counters now.
    pub fn counters(&self) -> ZmqCounters {
        self.shared
            .counters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
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
    /// Starts the task on `rt`; it connects in the background (and keeps
    /// reconnecting, as ZeroMQ does).
    pub fn spawn(cfg: ZmqConfig, rt: &tokio::runtime::Handle) -> ZmqSource {
        let (tx, rx) = mpsc::channel(cfg.channel_capacity.max(1));
        let shared = Arc::new(Shared::default());
        let handle = ZmqHandle {
            shared: shared.clone(),
            url: cfg.endpoint.to_string(),
        };
        let task = rt.spawn(run(cfg, tx, shared));
        ZmqSource { rx, handle, task }
    }

    /// The next item; `None` once the task ended.
    pub async fn recv(&mut self) -> Option<ZmqItem> {
        self.rx.recv().await
    }

    /// A handle for display.
    pub fn handle(&self) -> ZmqHandle {
        self.handle.clone()
    }
}

/// Reads `[topic, seq, payload]` (or `[seq, payload]`).
pub fn split_frames<'a>(frames: &[&'a [u8]]) -> Result<(u64, &'a [u8]), DecodeError> {
    let (seq, payload) = match frames {
        [_topic, seq, payload] => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return Err(DecodeError::Shape("expected [topic, seq, payload] frames")),
    };
    let seq: [u8; 8] = (*seq)
        .try_into()
        .map_err(|_| DecodeError::Shape("the seq frame is not 8 bytes"))?;
    Ok((u64::from_be_bytes(seq), payload))
}

/// The per-message logic, without sockets: seq tracking, decoding and
/// translation. `run` (private) drives it; tests can too.
pub struct Pipeline {
    seq: SeqTracker,
    tr: Translator,
    counters: ZmqCounters,
}

/// What one message did, before any replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Handled (or skipped as malformed).
    Done,
    /// A gap `from..=to` precedes the message: fill it (or
    /// [`Pipeline::give_up`]), then [`Pipeline::apply`] the message.
    Gap {
        /// First missing.
        from: u64,
        /// Last missing.
        to: u64,
    },
}

impl Pipeline {
    /// A pipeline stamping with `cfg`.
    pub fn new(cfg: TranslatorConfig) -> Self {
        Pipeline {
            seq: SeqTracker::default(),
            tr: Translator::new(cfg),
            counters: ZmqCounters::default(),
        }
    }

    /// The counters now.
    pub fn counters(&self) -> ZmqCounters {
        let mut c = self.counters.clone();
        c.translate = self.tr.counters();
        c
    }

    fn malformed(&mut self, e: DecodeError) {
        self.counters.malformed += 1;
        self.counters.last_error = Some(e.to_string());
    }

    /// Takes one SUB message's frames. Events go to `out`; a restart is
    /// pushed as an item before them. A gap is returned, not applied.
    pub fn message(
        &mut self,
        frames: &[&[u8]],
        out: &mut Vec<ZmqItem>,
    ) -> (Step, Option<(u64, KvBatch)>) {
        self.counters.messages += 1;
        let (seq, payload) = match split_frames(frames) {
            Ok(x) => x,
            Err(e) => {
                self.malformed(e);
                return (Step::Done, None);
            }
        };
        let batch = match decode_payload(payload) {
            Ok(b) => b,
            Err(e) => {
                // The seq is still real: a gap before it is a gap, and it
                // is not missing itself.
                self.malformed(e);
                let step = self.track(seq, out);
                return (step, None);
            }
        };
        let step = self.track(seq, out);
        match step {
            Step::Done => {
                self.apply(&batch, out);
                (Step::Done, None)
            }
            gap => (gap, Some((seq, batch))),
        }
    }

    fn track(&mut self, seq: u64, out: &mut Vec<ZmqItem>) -> Step {
        self.counters.last_seq = Some(seq);
        match self.seq.observe(seq) {
            SeqVerdict::First => {
                self.counters.first_seq = Some(seq);
                Step::Done
            }
            SeqVerdict::InOrder => Step::Done,
            SeqVerdict::Gap { from, to } => {
                self.counters.gaps += 1;
                Step::Gap { from, to }
            }
            SeqVerdict::Restart { last } => {
                self.counters.restarts += 1;
                out.push(ZmqItem::Restart {
                    last_seq: last,
                    new_seq: seq,
                });
                let mut evs = Vec::new();
                self.tr.restart(&mut evs);
                if !evs.is_empty() {
                    out.push(ZmqItem::Events(evs));
                }
                Step::Done
            }
        }
    }

    /// Translates one good batch.
    pub fn apply(&mut self, batch: &KvBatch, out: &mut Vec<ZmqItem>) {
        self.counters.bad_events += batch.bad_events;
        let mut evs = Vec::new();
        self.tr.batch(batch, &mut evs);
        if !evs.is_empty() {
            out.push(ZmqItem::Events(evs));
        }
    }

    /// Publisher batches `from..=to` are lost.
    pub fn give_up(&mut self, from: u64, to: u64, out: &mut Vec<ZmqItem>) {
        let g = ZmqItem::Gap {
            from_seq: from,
            to_seq: to,
        };
        self.counters.missed += g.missed();
        self.tr.skip(g.missed());
        out.push(g);
    }

    /// A replayed batch (its seq already checked to be in the gap).
    pub fn replayed(&mut self, payload: &[u8], out: &mut Vec<ZmqItem>) -> bool {
        match decode_payload(payload) {
            Ok(b) => {
                self.counters.replayed += 1;
                self.apply(&b, out);
                true
            }
            Err(e) => {
                self.malformed(e);
                false
            }
        }
    }
}

fn set_state(shared: &Shared, s: ZmqState) {
    shared.state.store(s as u8, Ordering::Relaxed);
}

async fn run(cfg: ZmqConfig, tx: mpsc::Sender<ZmqItem>, shared: Arc<Shared>) {
    let mut pipe = Pipeline::new(cfg.translator);
    let publish = |pipe: &Pipeline| {
        *shared.counters.lock().unwrap_or_else(|p| p.into_inner()) = pipe.counters();
    };
    let mut sub = zeromq::SubSocket::new();
    if let Err(e) = sub.connect(&cfg.endpoint.zmq_addr()).await {
        pipe.counters.last_error = Some(format!("connect {}: {e}", cfg.endpoint));
        publish(&pipe);
        set_state(&shared, ZmqState::Stopped);
        return;
    }
    if let Err(e) = sub.subscribe(&cfg.topic).await {
        pipe.counters.last_error = Some(format!("subscribe: {e}"));
        publish(&pipe);
        set_state(&shared, ZmqState::Stopped);
        return;
    }
    set_state(&shared, ZmqState::Subscribed);
    let mut dealer: Option<zeromq::DealerSocket> = None;
    let mut out = Vec::new();
    loop {
        let msg = match sub.recv().await {
            Ok(m) => m,
            Err(e) => {
                // A dropped peer: the socket reconnects by itself.
                tracing::debug!("zmq sub: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        shared.received.fetch_add(1, Ordering::Relaxed);
        let frames: Vec<&[u8]> = msg.iter().map(|b| b.as_ref()).collect();
        let (step, pending) = pipe.message(&frames, &mut out);
        if let Step::Gap { from, to } = step {
            let filled = match &cfg.replay {
                Some(ep) => replay(ep, &cfg, &mut dealer, &mut pipe, from, to, &mut out).await,
                None => from,
            };
            if filled <= to {
                pipe.give_up(filled, to, &mut out);
            }
            if let Some((_, batch)) = pending {
                pipe.apply(&batch, &mut out);
            }
        }
        publish(&pipe);
        for item in out.drain(..) {
            if tx.send(item).await.is_err() {
                set_state(&shared, ZmqState::Stopped);
                return;
            }
        }
    }
}

/// Asks the replay endpoint for `from..` and applies what it returns up to
/// `to`, in order. Returns the first seq not recovered (`to + 1` when the
/// whole gap was filled).
async fn replay(
    ep: &ZmqEndpoint,
    cfg: &ZmqConfig,
    dealer: &mut Option<zeromq::DealerSocket>,
    pipe: &mut Pipeline,
    from: u64,
    to: u64,
    out: &mut Vec<ZmqItem>,
) -> u64 {
    pipe.counters.replay_requests += 1;
    let mut next = from;
    let ok = async {
        if dealer.is_none() {
            let mut d = zeromq::DealerSocket::new();
            tokio::time::timeout(cfg.replay_timeout, d.connect(&ep.zmq_addr()))
                .await
                .ok()?
                .ok()?;
            *dealer = Some(d);
        }
        let d = dealer.as_mut()?;
        let mut req = ZmqMessage::from(Vec::<u8>::new());
        req.push_back(from.to_be_bytes().to_vec().into());
        d.send(req).await.ok()?;
        loop {
            let m = tokio::time::timeout(cfg.replay_timeout, d.recv())
                .await
                .ok()?
                .ok()?;
            let frames: Vec<&[u8]> = m.iter().map(|b| b.as_ref()).collect();
            // [empty delimiter, seq, payload]; tolerate a missing delimiter.
            let body = match frames.as_slice() {
                [first, rest @ ..] if first.is_empty() && rest.len() == 2 => rest,
                all if all.len() == 2 => all,
                _ => return None,
            };
            let seq = u64::from_be_bytes(body[0].try_into().ok()?);
            if seq == END_SEQ {
                return Some(());
            }
            if seq == next && seq <= to {
                pipe.replayed(body[1], out);
                next += 1;
            }
            // Others (before the gap, after it, or past a hole in the
            // publisher's buffer) are not needed.
        }
    }
    .await;
    if ok.is_none() {
        pipe.counters.replay_failures += 1;
        // A half-read answer must not be read as the next one's.
        *dealer = None;
    }
    next
}
