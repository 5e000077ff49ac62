//! The publisher: an engine's tap to JetStream, without ever slowing the
//! engine.
//!
//! Two halves. A thread of its own drains the tap (polling, like the
//! recorder: blocking in `recv` would make the engine pay a wake-up on
//! nearly every event) and gathers events into batches
//! ([`wire::BatchEncoder`]), sealing one when it reaches
//! [`PublisherConfig::batch_bytes`], when [`PublisherConfig::linger`] has
//! passed since its first event, or when the tap reports a loss. Sealed
//! batches wait in a bounded buffer ([`PublisherConfig::buffer_bytes`]). A
//! task on the runtime publishes them one at a time, in order, each with
//! the message id [`wire::message_id`]`(engine, run, first seq)`, and
//! retries the same batch (same id) until JetStream acknowledges it; a
//! batch stored twice (its acknowledgement lost) is dropped by JetStream
//! inside the duplicate window and by the consumer's seq check outside it.
//!
//! When NATS is out of reach the buffer fills; when full, the *oldest*
//! waiting batch is dropped and its events counted
//! ([`PublisherCounters::dropped`]), so the engine never waits and what is
//! sent after the outage is the most recent. Every batch declares the
//! run's losses so far (the tap's and the buffer's) in its header, so a
//! consumer can tell a declared loss from an unexplained hole.
//!
//! One at a time keeps the stream in the engine's order (a pipelined
//! publish that failed and was retried could land after a later one);
//! a batch holds thousands of events, so one round trip per batch is not
//! the limit (see the README's fleet benchmark).

use super::wire::{self, BatchEncoder};
use super::{NatsError, StreamLimits, check_engine_name, connect, ensure_stream, events_subject};
use async_nats::jetstream;
use kvbm_events::Event;
use kvbm_events::bus::{TapItem, TapReceiver, TryRecvError};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How a publisher runs.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// `nats://HOST:PORT`.
    pub url: String,
    /// The engine's name (a subject token).
    pub engine: String,
    /// This incarnation's run id ([`new_run_id`] by default).
    pub run: u64,
    /// Seal a batch at this many block bytes.
    pub batch_bytes: usize,
    /// … or this long after its first event.
    pub linger: Duration,
    /// Bytes of sealed batches kept while they cannot be sent; past it the
    /// oldest are dropped (counted).
    pub buffer_bytes: usize,
    /// How long one publish waits for JetStream's acknowledgement.
    pub publish_timeout: Duration,
    /// Sleep between polls of an empty tap.
    pub idle_poll: Duration,
    /// The stream's limits, if the publisher has to create it.
    pub limits: StreamLimits,
    /// LZ4 on the batches.
    pub compress: bool,
}

impl PublisherConfig {
    /// Defaults for `engine` publishing to `url`.
    pub fn new(url: impl Into<String>, engine: impl Into<String>) -> Self {
        PublisherConfig {
            url: url.into(),
            engine: engine.into(),
            run: new_run_id(),
            batch_bytes: 60 << 10,
            linger: Duration::from_millis(20),
            buffer_bytes: 64 << 20,
            publish_timeout: Duration::from_secs(2),
            idle_poll: Duration::from_micros(500),
            limits: StreamLimits::default(),
            compress: true,
        }
    }
}

/// A run id no other incarnation is likely to have: the clock and the
/// process id through a randomly keyed hash.
pub fn new_run_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish().max(1)
}

/// What a publisher did. Exact counts; a snapshot of a moving system.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PublisherCounters {
    /// Events taken from the tap.
    pub events_in: u64,
    /// Events the tap dropped before the publisher saw them.
    pub tap_dropped: u64,
    /// Events in batches JetStream acknowledged.
    pub events_sent: u64,
    /// Batches acknowledged.
    pub batches_sent: u64,
    /// Of those, acknowledged as duplicates (a re-send of a stored batch).
    pub duplicate_acks: u64,
    /// Events dropped from the full buffer while NATS was out of reach,
    /// plus, after [`Publisher::stop`], those never sent.
    pub dropped: u64,
    /// Batches waiting now, and their bytes.
    pub buffered_batches: u64,
    /// Bytes waiting now.
    pub buffered_bytes: u64,
    /// Publishes that failed (each is retried).
    pub publish_errors: u64,
    /// The last failure.
    pub last_error: Option<String>,
    /// Connected to NATS now.
    pub connected: bool,
}

impl PublisherCounters {
    /// Everything this run lost on the way: the tap's drops and the
    /// buffer's.
    pub fn lost(&self) -> u64 {
        self.tap_dropped + self.dropped
    }
}

struct Sealed {
    bytes: Vec<u8>,
    first_seq: u64,
    count: u64,
    /// The tap's losses before this batch (cumulative).
    tap_dropped_before: u64,
}

#[derive(Default)]
struct Queue {
    batches: VecDeque<Sealed>,
    bytes: usize,
    /// Events of batches dropped from the front (cumulative).
    dropped: u64,
    /// The encoder is done (tap closed or stopped).
    closed: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Notify,
    events_in: AtomicU64,
    tap_dropped: AtomicU64,
    events_sent: AtomicU64,
    batches_sent: AtomicU64,
    duplicate_acks: AtomicU64,
    publish_errors: AtomicU64,
    last_error: Mutex<Option<String>>,
    client: Mutex<Option<async_nats::Client>>,
    stop: AtomicBool,
    /// Give up sending at this instant (set by `stop`).
    give_up: Mutex<Option<Instant>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn counters(&self) -> PublisherCounters {
        let q = lock(&self.queue);
        PublisherCounters {
            events_in: self.events_in.load(Ordering::Relaxed),
            tap_dropped: self.tap_dropped.load(Ordering::Relaxed),
            events_sent: self.events_sent.load(Ordering::Relaxed),
            batches_sent: self.batches_sent.load(Ordering::Relaxed),
            duplicate_acks: self.duplicate_acks.load(Ordering::Relaxed),
            dropped: q.dropped,
            buffered_batches: q.batches.len() as u64,
            buffered_bytes: q.bytes as u64,
            publish_errors: self.publish_errors.load(Ordering::Relaxed),
            last_error: lock(&self.last_error).clone(),
            connected: lock(&self.client)
                .as_ref()
                .is_some_and(|c| c.connection_state() == async_nats::connection::State::Connected),
        }
    }

    fn enqueue(&self, s: Sealed, limit: usize) {
        let mut q = lock(&self.queue);
        q.bytes += s.bytes.len();
        q.batches.push_back(s);
        // Drop the oldest waiting batches until within bounds (the newest
        // always stays, however large).
        while q.bytes > limit && q.batches.len() > 1 {
            if let Some(old) = q.batches.pop_front() {
                q.bytes -= old.bytes.len();
                q.dropped += old.count;
            }
        }
        drop(q);
        self.ready.notify_one();
    }

    fn failed(&self, e: String) {
        self.publish_errors.fetch_add(1, Ordering::Relaxed);
        *lock(&self.last_error) = Some(e);
    }
}

/// A running publisher; see the module docs.
pub struct Publisher {
    shared: Arc<Shared>,
    encoder: Option<std::thread::JoinHandle<()>>,
    sender: Option<tokio::task::JoinHandle<()>>,
    rt: tokio::runtime::Handle,
    engine: String,
    run: u64,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("engine", &self.engine)
            .field("run", &self.run)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// Starts draining `tap` and publishing (connecting in the background:
    /// an engine starts whether or not NATS is up).
    pub fn spawn(
        tap: TapReceiver<Event>,
        cfg: PublisherConfig,
        rt: &tokio::runtime::Handle,
    ) -> Result<Publisher, NatsError> {
        check_engine_name(&cfg.engine)?;
        super::check_url(&cfg.url)?;
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            ready: Notify::new(),
            events_in: AtomicU64::new(0),
            tap_dropped: AtomicU64::new(0),
            events_sent: AtomicU64::new(0),
            batches_sent: AtomicU64::new(0),
            duplicate_acks: AtomicU64::new(0),
            publish_errors: AtomicU64::new(0),
            last_error: Mutex::new(None),
            client: Mutex::new(None),
            stop: AtomicBool::new(false),
            give_up: Mutex::new(None),
        });
        let (s2, c2) = (shared.clone(), cfg.clone());
        let encoder = std::thread::Builder::new()
            .name("kvbm-nats-batch".into())
            .spawn(move || encode_loop(tap, &c2, &s2))
            .map_err(|e| NatsError::Nats(format!("starting the batch thread: {e}")))?;
        let sender = rt.spawn(send_loop(shared.clone(), cfg.clone()));
        Ok(Publisher {
            shared,
            encoder: Some(encoder),
            sender: Some(sender),
            rt: rt.clone(),
            engine: cfg.engine,
            run: cfg.run,
        })
    }

    /// The run id its batches carry.
    pub fn run(&self) -> u64 {
        self.run
    }

    /// The counters now.
    pub fn counters(&self) -> PublisherCounters {
        self.shared.counters()
    }

    /// Stops taking events (those already in the tap are batched), sends
    /// what is buffered for at most `drain`, and counts anything still
    /// unsent as dropped. Returns the final counters. Must not be called
    /// from inside the runtime's own threads.
    pub fn stop(mut self, drain: Duration) -> PublisherCounters {
        *lock(&self.shared.give_up) = Some(Instant::now() + drain);
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.encoder.take() {
            let _ = t.join();
        }
        self.shared.ready.notify_one();
        if let Some(task) = self.sender.take() {
            let _ = self.rt.block_on(async {
                tokio::time::timeout(drain + Duration::from_secs(1), task).await
            });
        }
        let mut q = lock(&self.shared.queue);
        let unsent: u64 = q.batches.drain(..).map(|b| b.count).sum();
        q.dropped += unsent;
        q.bytes = 0;
        drop(q);
        self.shared.counters()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        *lock(&self.shared.give_up) = Some(Instant::now());
        if let Some(task) = self.sender.take() {
            task.abort();
        }
    }
}

fn encode_loop(mut tap: TapReceiver<Event>, cfg: &PublisherConfig, shared: &Shared) {
    let mut enc = BatchEncoder::new(cfg.compress);
    let mut started: Option<Instant> = None;
    let mut tap_dropped = 0u64;
    let seal = |enc: &mut BatchEncoder, tap_dropped: u64| {
        let mut bytes = Vec::new();
        if let Some(h) = enc.seal(cfg.run, tap_dropped, &mut bytes) {
            shared.enqueue(
                Sealed {
                    bytes,
                    first_seq: h.first_seq,
                    count: u64::from(h.count),
                    tap_dropped_before: tap_dropped,
                },
                cfg.buffer_bytes,
            );
        }
    };
    let mut stop_seen = false;
    loop {
        match tap.try_recv() {
            Ok(TapItem::Event(ev)) => {
                shared.events_in.fetch_add(1, Ordering::Relaxed);
                if !enc.push(&ev, cfg.batch_bytes) {
                    seal(&mut enc, tap_dropped);
                    started = None;
                    enc.push(&ev, cfg.batch_bytes);
                }
                started.get_or_insert_with(Instant::now);
            }
            Ok(TapItem::Gap { dropped }) => {
                // Seal before the loss, so the next batch's declaration
                // covers exactly the events before it.
                seal(&mut enc, tap_dropped);
                started = None;
                tap_dropped += dropped;
                shared.tap_dropped.fetch_add(dropped, Ordering::Relaxed);
            }
            Err(TryRecvError::Empty) => {
                if started.is_some_and(|t| t.elapsed() >= cfg.linger) {
                    seal(&mut enc, tap_dropped);
                    started = None;
                }
                if shared.stop.load(Ordering::Acquire) {
                    // One more pass: events emitted before the stop may
                    // have come after the `Empty` above.
                    if !stop_seen {
                        stop_seen = true;
                        continue;
                    }
                    // The engine has stopped, but the bus lives on: losses
                    // at the end that no event carried would never reach
                    // this loop. Counted, after the last batch is sealed
                    // (they came after its events; no batch follows to
                    // declare them).
                    seal(&mut enc, tap_dropped);
                    if let Some(TapItem::Gap { dropped }) = tap.take_uncarried() {
                        shared.tap_dropped.fetch_add(dropped, Ordering::Relaxed);
                    }
                    break;
                }
                std::thread::sleep(cfg.idle_poll);
            }
            Err(TryRecvError::Closed) => break,
        }
        if started.is_some_and(|t| t.elapsed() >= cfg.linger) {
            seal(&mut enc, tap_dropped);
            started = None;
        }
    }
    seal(&mut enc, tap_dropped);
    lock(&shared.queue).closed = true;
    shared.ready.notify_one();
}

fn giving_up(shared: &Shared) -> bool {
    lock(&shared.give_up).is_some_and(|t| Instant::now() >= t)
}

async fn send_loop(shared: Arc<Shared>, cfg: PublisherConfig) {
    let client = match connect(&cfg.url, &format!("kvbm-publisher {}", cfg.engine)).await {
        Ok(c) => c,
        Err(e) => {
            shared.failed(e.to_string());
            return;
        }
    };
    *lock(&shared.client) = Some(client.clone());
    let js = jetstream::ContextBuilder::new()
        .timeout(cfg.publish_timeout)
        .build(client);
    let subject = events_subject(&cfg.engine);
    let mut stream_ready = false;
    loop {
        // The next batch, or wait for one.
        let next = {
            let mut q = lock(&shared.queue);
            match q.batches.pop_front() {
                Some(b) => {
                    q.bytes -= b.bytes.len();
                    Some((b, q.dropped))
                }
                None if q.closed => return,
                None => None,
            }
        };
        let Some((mut batch, queue_dropped)) = next else {
            if giving_up(&shared) {
                return;
            }
            tokio::select! {
                _ = shared.ready.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
            continue;
        };
        // Every batch dropped from the queue so far was older than this
        // one (the oldest go first), so this is the run's loss before it.
        wire::set_dropped_before(&mut batch.bytes, batch.tap_dropped_before + queue_dropped);
        let id = wire::message_id(&cfg.engine, cfg.run, batch.first_seq);
        let payload = bytes::Bytes::from(std::mem::take(&mut batch.bytes));
        let mut backoff = Duration::from_millis(50);
        loop {
            if !stream_ready {
                match ensure_stream(&js, &cfg.limits).await {
                    Ok(_) => stream_ready = true,
                    Err(e) => shared.failed(e.to_string()),
                }
            }
            if stream_ready {
                let publish = jetstream::message::PublishMessage::build()
                    .payload(payload.clone())
                    .message_id(&id);
                let acked = match js.send_publish(subject.clone(), publish).await {
                    Ok(ack) => ack.await.map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                match acked {
                    Ok(ack) => {
                        shared.batches_sent.fetch_add(1, Ordering::Relaxed);
                        shared.events_sent.fetch_add(batch.count, Ordering::Relaxed);
                        if ack.duplicate {
                            shared.duplicate_acks.fetch_add(1, Ordering::Relaxed);
                        }
                        break;
                    }
                    Err(e) => {
                        // "no responders": the stream is gone (a memory
                        // store after a server restart): make it again.
                        if e.contains("no responders") {
                            stream_ready = false;
                        }
                        shared.failed(format!("publishing {id}: {e}"));
                    }
                }
            }
            if giving_up(&shared) {
                // Counted as dropped by `stop`.
                let mut q = lock(&shared.queue);
                q.dropped += batch.count;
                return;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }
}
