//! The event bus: how events leave the engine for observers.
//!
//! Two ways out, with different promises:
//!
//! - **Live subscribers** ([`EventBus::subscribe`]) ride a
//!   `tokio::sync::broadcast` channel. They are lossy by design: a console
//!   that falls behind loses the oldest events, is told how many
//!   ([`Received::Lagged`]) and the bus adds them to
//!   [`BusCounters::lagged_total`], so the loss reaches the screen. The
//!   publisher never waits for them.
//! - **The tap** ([`EventBus::take_tap`]) is for the recorder: one consumer,
//!   bounded, and nothing is lost *silently*. When the consumer falls so far
//!   behind that the tap is full, the publisher still does not wait (the
//!   engine never waits for an observer): the event is dropped and counted in
//!   [`BusCounters::tap_dropped`], and the consumer receives a
//!   [`TapItem::Gap`] carrying the number lost before the next event that
//!   got through (or, if none does, when the bus closes). Publishers take
//!   turns under the bus's lock, so the marker sits exactly where the
//!   events were lost, however many threads publish. At any quiet moment
//!   `tap_offered == tap_delivered + tap_dropped + tap_queued`.
//!
//! **Publishing costs one lock.** Publishers take the bus's lock
//! ([`EventBus::lock`]; [`EventBus::publish`] takes it for one event),
//! which makes them, together, the tap's single producer. Everything
//! publishing touches is under it as plain numbers: the counts, who
//! listens, and the producer end of the tap, a single-producer,
//! single-consumer ring (`rtrb`) whose push is a store rather than a
//! locked instruction. The [`Emitter`](crate::Emitter) numbers and stamps
//! its events under the same lock, so an emit pays for that lock and for
//! nothing else shared but its request id's reference count.
//! [`EventBus::counters`], subscribing and the consumer's leaving take the
//! lock too; they are rare. Before, the emitter had a lock of its own
//! beside a bus of atomic counters and a `std::sync::mpsc::sync_channel`
//! tap: five locked instructions an emit rather than two, and a fifth to
//! nearly half again as much time here (the README's *Events and
//! recording* has the figures).
//! Only publishers take the lock; the consumer never does, so the lock's
//! cache line stays with the engine's thread. (A queue that both sides
//! locked was tried first and cost about six times as much per event with
//! the consumer on another core: the lock's line moved between the cores
//! on nearly every event.) The ring's only shared lines are its slots,
//! which carry the events anyway, and its two indices, which each side
//! reads only when its cached copy says the ring is full or empty.
//!
//! The consumer end polls: [`TapReceiver::try_recv`], or a receive that
//! sleeps between polls (50 µs, doubling to at most 1 ms), so publishing
//! never wakes a thread. That is how a recorder should drain the tap
//! anyway (take everything there is, then sleep a little): a wake-up on
//! every event would cost the engine a system call. It is not async: a
//! recorder writes and syncs files, which is blocking work for a thread
//! of its own (or `spawn_blocking`) in any case.
//!
//! The bus is generic over the event type, so it knows nothing of the event
//! vocabulary. [`EventBus::publish`] is synchronous (the engine is not
//! necessarily async) and cheap when nobody listens: it takes the lock,
//! bumps one counter and reads two flags; the event is neither cloned nor
//! copied anywhere. It is cloned once only when both a live subscriber and
//! the tap want it.
//!
//! Share a bus between threads behind an `Arc`; dropping the bus closes it
//! (subscribers and the tap drain what they have, then see the end).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::broadcast;

use Ordering::{Acquire, Relaxed, Release, SeqCst};

/// Largest accepted broadcast capacity. tokio allocates every slot up front
/// (rounded up to a power of two), so an absurd value would be an absurd
/// allocation.
pub const MAX_BROADCAST_CAPACITY: usize = 1 << 24;
/// Largest accepted tap capacity. The tap's ring is allocated in full when
/// the tap is taken: at this cap and a 64-byte event, about 320 MiB.
pub const MAX_TAP_CAPACITY: usize = 1 << 22;

/// Sizes of the bus's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusConfig {
    /// Events a live subscriber may fall behind before it lags. tokio rounds
    /// it up to a power of two. 1 to [`MAX_BROADCAST_CAPACITY`].
    pub broadcast_capacity: usize,
    /// Events the tap holds for its consumer before it starts dropping. 1 to
    /// [`MAX_TAP_CAPACITY`]; allocated when the tap is taken.
    pub tap_capacity: usize,
}

impl Default for BusConfig {
    fn default() -> Self {
        BusConfig {
            broadcast_capacity: 4096,
            tap_capacity: 65_536,
        }
    }
}

/// Errors from building a bus.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BusError {
    /// A capacity is out of range.
    #[error("`{field}` must be between 1 and {max}, got {got}")]
    BadCapacity {
        /// Which capacity.
        field: &'static str,
        /// What was given.
        got: usize,
        /// The largest accepted value.
        max: usize,
    },
}

/// A snapshot of the bus's counters. Each is exact; taken together they are a
/// snapshot of a moving system, so only quiet moments balance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BusCounters {
    /// Events published, listened to or not.
    pub published: u64,
    /// Live subscribers now.
    pub subscribers: usize,
    /// Events live subscribers missed by lagging, summed over subscribers,
    /// counted when each subscriber learns of its lag.
    pub lagged_total: u64,
    /// Whether a tap consumer is attached now.
    pub tap_attached: bool,
    /// Events offered to the tap (published while it was attached).
    pub tap_offered: u64,
    /// Events the tap consumer has received.
    pub tap_delivered: u64,
    /// Events the tap dropped because it was full, plus, once the consumer
    /// has gone, everything it never received.
    pub tap_dropped: u64,
    /// Events in the tap not yet received:
    /// `tap_offered - tap_delivered - tap_dropped`.
    pub tap_queued: u64,
}

/// Keeps a value on cache lines of its own (128 bytes: two lines, since
/// x86 prefetches lines in pairs), so that a field one thread writes often
/// does not slow down another thread reading its neighbour.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// What the bus, its subscriptions and its tap's consumer share.
struct Shared<E> {
    /// Everything publishing touches, under the one lock.
    producer: Mutex<Producer<E>>,
    /// Written by subscribers when they lag; apart from the lock's lines.
    lagged_total: Padded<AtomicU64>,
}

impl<E> Shared<E> {
    /// The lock. A publisher that panicked mid-publish (an event's
    /// `clone`) leaves counts that are at worst one event off; publishing
    /// goes on.
    #[inline]
    fn lock(&self) -> MutexGuard<'_, Producer<E>> {
        self.producer.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The publishing side's state: counts, who listens, the ring's producer
/// end. Plain numbers, under the lock; [`EventBus::counters`] takes it too,
/// which is rare.
struct Producer<E> {
    published: u64,
    /// Live subscribers now.
    subscribers: usize,
    /// A tap consumer is attached (its ring is in `tap`).
    attached: bool,
    /// The ring's producer end, while the tap is attached.
    tap: Option<rtrb::Producer<TapEntry<E>>>,
    /// Events offered to the tap.
    offered: u64,
    /// Dropped because the tap was full.
    dropped: u64,
    /// Dropped and not yet carried by an event that got through.
    pending: u64,
}

/// The tap's state that its consumer reads without the lock. Every field
/// changes only when the tap is taken and when the bus closes, except
/// `delivered`, which is on lines of its own.
#[derive(Debug, Default)]
struct TapShared {
    taken: AtomicBool,
    /// The bus is gone: nothing more will be pushed.
    closed: AtomicBool,
    /// Losses no event got through to carry, handed to the consumer when
    /// the bus closes.
    unclaimed: AtomicU64,
    /// The consumer only.
    delivered: Padded<AtomicU64>,
}

/// An event in the tap, with the number dropped just before it.
type TapEntry<E> = (u64, E);

/// A publish/subscribe bus for events of type `E`. See the module docs.
pub struct EventBus<E: Clone + Send + 'static> {
    live: broadcast::Sender<E>,
    shared: Arc<Shared<E>>,
    tap: Arc<TapShared>,
    config: BusConfig,
}

impl<E: Clone + Send + 'static> fmt::Debug for EventBus<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventBus")
            .field("config", &self.config)
            .field("counters", &self.counters())
            .finish()
    }
}

impl<E: Clone + Send + 'static> EventBus<E> {
    /// A bus with the given buffer sizes.
    pub fn new(config: BusConfig) -> Result<Self, BusError> {
        for (field, got, max) in [
            (
                "broadcast_capacity",
                config.broadcast_capacity,
                MAX_BROADCAST_CAPACITY,
            ),
            ("tap_capacity", config.tap_capacity, MAX_TAP_CAPACITY),
        ] {
            if got == 0 || got > max {
                return Err(BusError::BadCapacity { field, got, max });
            }
        }
        let (live, _) = broadcast::channel(config.broadcast_capacity);
        Ok(EventBus {
            live,
            shared: Arc::new(Shared {
                producer: Mutex::new(Producer {
                    published: 0,
                    subscribers: 0,
                    attached: false,
                    tap: None,
                    offered: 0,
                    dropped: 0,
                    pending: 0,
                }),
                lagged_total: Padded(AtomicU64::new(0)),
            }),
            tap: Arc::new(TapShared::default()),
            config,
        })
    }

    /// The buffer sizes it was built with.
    pub fn config(&self) -> BusConfig {
        self.config
    }

    /// Publishes an event to every live subscriber and the tap. Never blocks
    /// on an observer, never fails; see the module docs for what happens to
    /// observers that cannot keep up. Takes the bus's lock for the one
    /// event; [`lock`](Self::lock) holds it across several.
    #[inline]
    pub fn publish(&self, event: E) {
        self.lock().publish(event);
    }

    /// Takes the bus's lock: until the guard drops, this thread is the only
    /// publisher. What it publishes meanwhile goes out in that order with
    /// nothing between, and whatever the caller does under the guard (the
    /// [`Emitter`](crate::Emitter) numbers and stamps its events there) is
    /// ordered with it.
    #[inline]
    pub fn lock(&self) -> Publishing<'_, E> {
        Publishing {
            bus: self,
            producer: self.shared.lock(),
        }
    }

    fn send_live(&self, event: E) {
        // An error only means the last subscriber left just now: nobody to
        // deliver to, nothing lost.
        let _ = self.live.send(event);
    }

    /// A new live subscriber. It sees events published from now on.
    pub fn subscribe(&self) -> Subscription<E> {
        let rx = self.live.subscribe();
        self.shared.lock().subscribers += 1;
        Subscription {
            rx,
            shared: Arc::clone(&self.shared),
        }
    }

    /// The tap's consumer end. Only one consumer ever exists: the first call
    /// returns it (allocating the tap's ring), later calls return `None`
    /// (even after it is dropped, so a second recorder cannot silently start
    /// mid-stream).
    pub fn take_tap(&self) -> Option<TapReceiver<E>> {
        if self.tap.taken.swap(true, SeqCst) {
            return None;
        }
        let (tx, rx) = rtrb::RingBuffer::new(self.config.tap_capacity);
        let mut p = self.shared.lock();
        p.tap = Some(tx);
        p.attached = true;
        drop(p);
        Some(TapReceiver {
            rx,
            shared: Arc::clone(&self.shared),
            tap: Arc::clone(&self.tap),
            held: None,
            delivered: 0,
        })
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> BusCounters {
        let p = self.shared.lock();
        let (published, subscribers, attached) = (p.published, p.subscribers, p.attached);
        let (offered, tap_dropped) = (p.offered, p.dropped);
        drop(p);
        let delivered = self.tap.delivered.load(SeqCst);
        let dropped = if attached || !self.tap.taken.load(SeqCst) {
            tap_dropped
        } else {
            // The consumer is gone: whatever it did not receive is lost,
            // including events still in the ring when it left.
            offered.saturating_sub(delivered)
        };
        BusCounters {
            published,
            subscribers,
            lagged_total: self.shared.lagged_total.load(Relaxed),
            tap_attached: attached,
            tap_offered: offered,
            tap_delivered: delivered,
            tap_dropped: dropped,
            // Read apart from `offered`, so clamp rather than underflow.
            tap_queued: offered.saturating_sub(delivered.saturating_add(dropped)),
        }
    }
}

impl<E: Clone + Send + 'static> Drop for EventBus<E> {
    fn drop(&mut self) {
        let mut p = self.shared.lock();
        // Losses no event carried go to the consumer with the close; the
        // Release store of `closed` publishes them and every push before.
        self.tap.unclaimed.store(p.pending, Relaxed);
        p.tap = None;
        drop(p);
        self.tap.closed.store(true, Release);
    }
}

/// The bus's lock, held: publish through it ([`EventBus::lock`]).
pub struct Publishing<'a, E: Clone + Send + 'static> {
    bus: &'a EventBus<E>,
    producer: MutexGuard<'a, Producer<E>>,
}

impl<E: Clone + Send + 'static> fmt::Debug for Publishing<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Publishing")
            .field("published", &self.producer.published)
            .finish_non_exhaustive()
    }
}

impl<E: Clone + Send + 'static> Publishing<'_, E> {
    /// True when a live subscriber or the tap would receive an event now:
    /// lets a producer skip building events nobody wants (it must still
    /// count them, as `Emitter` does).
    #[inline]
    pub fn has_listeners(&self) -> bool {
        self.producer.subscribers != 0 || self.producer.attached
    }

    /// Publishes an event to every live subscriber and the tap
    /// ([`EventBus::publish`]).
    #[inline]
    pub fn publish(&mut self, event: E) {
        let bus = self.bus;
        let p = &mut *self.producer;
        p.published += 1;
        let (live, tap) = (p.subscribers != 0, p.attached);
        match (live, tap) {
            (false, false) => {}
            (true, false) => bus.send_live(event),
            (false, true) => Self::send_tap(p, event),
            (true, true) => {
                Self::send_tap(p, event.clone());
                bus.send_live(event);
            }
        }
    }

    #[inline]
    fn send_tap(p: &mut Producer<E>, event: E) {
        let Some(tx) = p.tap.as_mut() else {
            return; // `attached` is only set once the ring is in place
        };
        p.offered += 1;
        // The event carries the losses since the last one that got through.
        match tx.push((p.pending, event)) {
            Ok(()) => p.pending = 0,
            // Full. (A consumer that left is not an error here: what it
            // did not take is counted as dropped once it has gone.)
            Err(_) => {
                p.pending += 1;
                p.dropped += 1;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Live subscribers
// ---------------------------------------------------------------------------

/// What a live subscriber receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received<E> {
    /// The next event.
    Event(E),
    /// The subscriber fell behind and this many events were overwritten
    /// before it read them. Reception continues with the oldest event still
    /// held. Already added to [`BusCounters::lagged_total`].
    Lagged(u64),
}

/// Why a non-blocking receive returned nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TryRecvError {
    /// Nothing to receive right now.
    #[error("no event waiting")]
    Empty,
    /// The bus is gone and everything it sent has been received.
    #[error("the bus is closed")]
    Closed,
}

/// A live, lossy subscriber. Dropping it unsubscribes.
pub struct Subscription<E: Clone + Send + 'static> {
    rx: broadcast::Receiver<E>,
    shared: Arc<Shared<E>>,
}

impl<E: Clone + Send + 'static> fmt::Debug for Subscription<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("pending", &self.rx.len())
            .finish()
    }
}

impl<E: Clone + Send + 'static> Subscription<E> {
    fn lagged(&self, n: u64) -> Received<E> {
        self.shared.lagged_total.fetch_add(n, Relaxed);
        Received::Lagged(n)
    }

    /// The next event or lag notice; `None` once the bus is gone and
    /// everything has been received.
    pub async fn recv(&mut self) -> Option<Received<E>> {
        match self.rx.recv().await {
            Ok(e) => Some(Received::Event(e)),
            Err(broadcast::error::RecvError::Lagged(n)) => Some(self.lagged(n)),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }

    /// [`recv`](Self::recv) for synchronous code: blocks the thread. Like
    /// tokio's `blocking_recv`, it panics if called from inside an async
    /// runtime (use `recv().await` there).
    pub fn blocking_recv(&mut self) -> Option<Received<E>> {
        match self.rx.blocking_recv() {
            Ok(e) => Some(Received::Event(e)),
            Err(broadcast::error::RecvError::Lagged(n)) => Some(self.lagged(n)),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }

    /// The next event or lag notice if one is waiting.
    pub fn try_recv(&mut self) -> Result<Received<E>, TryRecvError> {
        match self.rx.try_recv() {
            Ok(e) => Ok(Received::Event(e)),
            Err(broadcast::error::TryRecvError::Lagged(n)) => Ok(self.lagged(n)),
            Err(broadcast::error::TryRecvError::Empty) => Err(TryRecvError::Empty),
            Err(broadcast::error::TryRecvError::Closed) => Err(TryRecvError::Closed),
        }
    }
}

impl<E: Clone + Send + 'static> Drop for Subscription<E> {
    fn drop(&mut self) {
        self.shared.lock().subscribers -= 1;
    }
}

// ---------------------------------------------------------------------------
// The tap
// ---------------------------------------------------------------------------

/// A blocking receive's first sleep when the tap is empty.
pub const FIRST_NAP: Duration = Duration::from_micros(50);
/// Its longest: how long an event may wait to be noticed by a blocked
/// receiver.
pub const LAST_NAP: Duration = Duration::from_millis(1);

/// What the tap's consumer receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TapItem<E> {
    /// The next event.
    Event(E),
    /// Exactly `dropped` events were lost here, between the previous item and
    /// the next, because the tap was full.
    Gap {
        /// How many.
        dropped: u64,
    },
}

/// The tap's single consumer. Dropping it detaches the tap: publishing stops
/// offering events to it, and whatever it did not receive counts as dropped.
pub struct TapReceiver<E> {
    rx: rtrb::Consumer<TapEntry<E>>,
    shared: Arc<Shared<E>>,
    tap: Arc<TapShared>,
    /// An event held back while its gap marker is delivered first.
    held: Option<E>,
    delivered: u64,
}

impl<E> fmt::Debug for TapReceiver<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TapReceiver")
            .field("delivered", &self.delivered)
            .field("holding", &self.held.is_some())
            .finish()
    }
}

impl<E> TapReceiver<E> {
    fn deliver(&mut self, event: E) -> TapItem<E> {
        self.delivered += 1;
        // Only this thread writes it; `counters` reads it.
        self.tap.delivered.store(self.delivered, Relaxed);
        TapItem::Event(event)
    }

    fn unpack(&mut self, (gap, event): TapEntry<E>) -> TapItem<E> {
        if gap == 0 {
            return self.deliver(event);
        }
        self.held = Some(event);
        TapItem::Gap { dropped: gap }
    }

    /// The bus is gone and the ring is empty: report losses no later event
    /// could carry, then the end.
    fn closed(&mut self) -> Option<TapItem<E>> {
        match self.tap.unclaimed.swap(0, Relaxed) {
            0 => None,
            dropped => Some(TapItem::Gap { dropped }),
        }
    }

    /// Losses after the last event received that no later event carried
    /// (the tap was full for the last events published, and nothing has
    /// got through since), as a gap taken now; `None` while items wait or
    /// there were none. For a consumer that stops before the bus closes:
    /// the close would hand them over, but it never sees the close, and
    /// uncounted they would be a silent loss.
    pub fn take_uncarried(&mut self) -> Option<TapItem<E>> {
        if self.held.is_some() {
            return None;
        }
        // Under the publishing lock nothing is pushed meanwhile: with the
        // ring empty, these losses come after everything received.
        let mut p = self.shared.lock();
        if !self.rx.is_empty() {
            return None;
        }
        match std::mem::take(&mut p.pending) {
            0 => None,
            dropped => Some(TapItem::Gap { dropped }),
        }
    }

    /// The next item if one is waiting.
    pub fn try_recv(&mut self) -> Result<TapItem<E>, TryRecvError> {
        if let Some(e) = self.held.take() {
            return Ok(self.deliver(e));
        }
        if let Ok(slot) = self.rx.pop() {
            return Ok(self.unpack(slot));
        }
        if !self.tap.closed.load(Acquire) {
            return Err(TryRecvError::Empty);
        }
        // Closed: every push came before the close, so one more look sees
        // whatever was still arriving.
        match self.rx.pop() {
            Ok(slot) => Ok(self.unpack(slot)),
            Err(_) => self.closed().ok_or(TryRecvError::Closed),
        }
    }

    /// Polls until an item comes, the bus is closed and drained, or
    /// `deadline` passes; sleeps between polls ([`FIRST_NAP`] doubling to
    /// [`LAST_NAP`]).
    fn recv_until(&mut self, deadline: Option<Instant>) -> Result<TapItem<E>, TryRecvError> {
        let mut nap = FIRST_NAP;
        loop {
            match self.try_recv() {
                Err(TryRecvError::Empty) => {}
                got => return got,
            }
            let nap_now = match deadline {
                None => nap,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => nap.min(left),
                    _ => return Err(TryRecvError::Empty),
                },
            };
            std::thread::sleep(nap_now);
            nap = (nap * 2).min(LAST_NAP);
        }
    }

    /// The next item, blocking the thread until there is one; `None` once the
    /// bus is gone and everything has been received. It polls (see the
    /// module docs): an item waits at most [`LAST_NAP`] to be noticed.
    pub fn recv_blocking(&mut self) -> Option<TapItem<E>> {
        self.recv_until(None).ok()
    }

    /// The next item, waiting at most `timeout` (a recorder uses this to
    /// flush on a schedule even when the engine is quiet).
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<TapItem<E>, TryRecvError> {
        // A timeout past the clock's range waits as long as it takes.
        self.recv_until(Instant::now().checked_add(timeout))
    }

    /// Receives up to `max` items into `out`, blocking until at least one is
    /// there, then taking whatever else is already waiting. Returns how many
    /// were added; 0 means the bus is gone and everything has been received
    /// (or `max` is 0).
    pub fn recv_batch_blocking(&mut self, out: &mut Vec<TapItem<E>>, max: usize) -> usize {
        if max == 0 {
            return 0;
        }
        let Some(first) = self.recv_blocking() else {
            return 0;
        };
        out.push(first);
        let mut n = 1;
        while n < max {
            match self.try_recv() {
                Ok(item) => {
                    out.push(item);
                    n += 1;
                }
                Err(_) => break,
            }
        }
        n
    }
}

impl<E> Drop for TapReceiver<E> {
    fn drop(&mut self) {
        // Stop offering. Under the lock, so nothing is pushed after this;
        // what is still in the ring is counted as dropped by `counters`
        // (offered - delivered once detached).
        let mut p = self.shared.lock();
        p.attached = false;
        // The ring goes when both ends have (what it still holds with it).
        p.tap = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::thread;

    fn bus<E: Clone + Send + 'static>(broadcast: usize, tap: usize) -> EventBus<E> {
        EventBus::new(BusConfig {
            broadcast_capacity: broadcast,
            tap_capacity: tap,
        })
        .unwrap()
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn bus_is_send_and_sync() {
        assert_send_sync::<EventBus<u64>>();
        assert_send_sync::<Arc<EventBus<String>>>();
        fn assert_send<T: Send>() {}
        assert_send::<Subscription<u64>>();
        assert_send::<TapReceiver<u64>>();
    }

    #[test]
    fn bad_capacities_are_typed_errors() {
        for (b, t, field) in [
            (0, 1, "broadcast_capacity"),
            (MAX_BROADCAST_CAPACITY + 1, 1, "broadcast_capacity"),
            (1, 0, "tap_capacity"),
            (1, MAX_TAP_CAPACITY + 1, "tap_capacity"),
        ] {
            match EventBus::<u8>::new(BusConfig {
                broadcast_capacity: b,
                tap_capacity: t,
            }) {
                Err(BusError::BadCapacity { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{other:?}"),
            }
        }
        assert!(EventBus::<u8>::new(BusConfig::default()).is_ok());
    }

    /// Counts clones, to prove the fast paths do not clone.
    #[derive(Debug)]
    struct Counted(Arc<AtomicUsize>);
    impl Clone for Counted {
        fn clone(&self) -> Self {
            self.0.fetch_add(1, Relaxed);
            Counted(Arc::clone(&self.0))
        }
    }

    #[test]
    fn no_listener_fast_path_does_not_clone() {
        let clones = Arc::new(AtomicUsize::new(0));
        let b = bus::<Counted>(4, 4);
        for _ in 0..100 {
            b.publish(Counted(Arc::clone(&clones)));
        }
        assert_eq!(clones.load(Relaxed), 0);
        let c = b.counters();
        assert_eq!(c.published, 100);
        assert_eq!(
            (c.subscribers, c.tap_offered, c.tap_attached),
            (0, 0, false)
        );
        // One consumer of either kind: still no clone on publish.
        let tap = b.take_tap().unwrap();
        b.publish(Counted(Arc::clone(&clones)));
        assert_eq!(clones.load(Relaxed), 0);
        drop(tap);
        let sub = b.subscribe();
        b.publish(Counted(Arc::clone(&clones)));
        assert_eq!(clones.load(Relaxed), 0);
        drop(sub);
        assert_eq!(b.counters().subscribers, 0);
    }

    /// Losses at the end that no event carried are handed to a consumer
    /// that stops before the bus closes, once, after everything it had
    /// to receive; a later event carries only its own losses.
    #[test]
    fn losses_no_event_carried_are_taken_by_a_consumer_that_stops_first() {
        let b = bus::<u32>(4, 4);
        let mut tap = b.take_tap().unwrap();
        for i in 0..10 {
            b.publish(i);
        }
        // Four in the ring, six dropped after them: not before they are read.
        assert_eq!(tap.take_uncarried(), None);
        let got: Vec<_> = std::iter::from_fn(|| tap.try_recv().ok()).collect();
        assert_eq!(got, (0..4).map(TapItem::Event).collect::<Vec<_>>());
        assert_eq!(tap.take_uncarried(), Some(TapItem::Gap { dropped: 6 }));
        assert_eq!(tap.take_uncarried(), None, "taken once");
        b.publish(10);
        assert_eq!(tap.try_recv(), Ok(TapItem::Event(10)), "no gap again");
        drop(b);
        assert_eq!(
            tap.try_recv(),
            Err(TryRecvError::Closed),
            "nor at the close"
        );
    }

    #[test]
    fn subscribers_receive_in_order_and_see_the_end() {
        let b = bus::<u32>(64, 4);
        let mut s1 = b.subscribe();
        let mut s2 = b.subscribe();
        assert_eq!(b.counters().subscribers, 2);
        for i in 0..50 {
            b.publish(i);
        }
        drop(b);
        for s in [&mut s1, &mut s2] {
            let got: Vec<_> = std::iter::from_fn(|| s.blocking_recv()).collect();
            assert_eq!(got, (0..50).map(Received::Event).collect::<Vec<_>>());
            assert_eq!(s.try_recv(), Err(TryRecvError::Closed));
        }
    }

    #[test]
    fn lag_is_reported_and_counted() {
        let b = bus::<u32>(4, 4);
        let mut slow = b.subscribe();
        let mut also_slow = b.subscribe();
        for i in 0..20 {
            b.publish(i);
        }
        // 16 were overwritten before `slow` read anything; then the 4 kept.
        assert_eq!(slow.try_recv(), Ok(Received::Lagged(16)));
        for i in 16..20 {
            assert_eq!(slow.try_recv(), Ok(Received::Event(i)));
        }
        assert_eq!(slow.try_recv(), Err(TryRecvError::Empty));
        assert_eq!(b.counters().lagged_total, 16);
        assert_eq!(also_slow.blocking_recv(), Some(Received::Lagged(16)));
        assert_eq!(b.counters().lagged_total, 32);
        // Lag on one subscriber does not disturb the publisher or counters.
        assert_eq!(b.counters().published, 20);
    }

    #[tokio::test]
    async fn async_subscriber_lags_and_recovers() {
        let b = Arc::new(bus::<u32>(8, 4));
        let mut sub = b.subscribe();
        for i in 0..100 {
            b.publish(i);
        }
        let first = sub.recv().await;
        assert_eq!(first, Some(Received::Lagged(92)));
        assert_eq!(sub.recv().await, Some(Received::Event(92)));
        let b2 = Arc::clone(&b);
        let h = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            b2.publish(1000);
        });
        for want in 93..100 {
            assert_eq!(sub.recv().await, Some(Received::Event(want)));
        }
        assert_eq!(sub.recv().await, Some(Received::Event(1000)));
        h.await.unwrap();
        drop(b);
        assert_eq!(sub.recv().await, None);
    }

    #[test]
    fn only_one_tap() {
        let b = bus::<u8>(4, 4);
        let t = b.take_tap();
        assert!(t.is_some());
        assert!(b.take_tap().is_none());
        drop(t);
        assert!(b.take_tap().is_none());
    }

    /// Drains a tap into events and gap totals.
    fn drain<E>(t: &mut TapReceiver<E>) -> (Vec<TapItem<E>>, u64) {
        let mut items = Vec::new();
        while let Ok(i) = t.try_recv() {
            items.push(i);
        }
        let gaps = items
            .iter()
            .map(|i| match i {
                TapItem::Gap { dropped } => *dropped,
                TapItem::Event(_) => 0,
            })
            .sum();
        (items, gaps)
    }

    #[test]
    fn full_tap_drops_counts_and_marks_the_gap() {
        let b = bus::<u32>(4, 3);
        let mut t = b.take_tap().unwrap();
        for i in 0..10 {
            b.publish(i);
        }
        let c = b.counters();
        assert_eq!(
            (c.tap_offered, c.tap_dropped, c.tap_queued, c.tap_delivered),
            (10, 7, 3, 0)
        );
        assert_eq!(t.try_recv(), Ok(TapItem::Event(0)));
        // Room again: the next event carries the gap before it.
        b.publish(10);
        let (items, gaps) = drain(&mut t);
        assert_eq!(
            items,
            vec![
                TapItem::Event(1),
                TapItem::Event(2),
                TapItem::Gap { dropped: 7 },
                TapItem::Event(10)
            ]
        );
        assert_eq!(gaps, 7);
        let c = b.counters();
        assert_eq!(c.tap_offered, c.tap_delivered + c.tap_dropped);
        assert_eq!((c.tap_delivered, c.tap_dropped, c.tap_queued), (4, 7, 0));
    }

    #[test]
    fn a_trailing_loss_rides_on_the_next_event_or_is_reported_at_close() {
        let b = bus::<u32>(4, 2);
        let mut t = b.take_tap().unwrap();
        for i in 0..5 {
            b.publish(i);
        }
        assert_eq!(t.try_recv(), Ok(TapItem::Event(0)));
        assert_eq!(t.try_recv(), Ok(TapItem::Event(1)));
        // Nothing has got through since the loss: nothing to say yet, but the
        // counter already knows.
        assert_eq!(t.try_recv(), Err(TryRecvError::Empty));
        assert_eq!(b.counters().tap_dropped, 3);
        b.publish(5);
        assert_eq!(t.try_recv(), Ok(TapItem::Gap { dropped: 3 }));
        assert_eq!(t.try_recv(), Ok(TapItem::Event(5)));
        b.publish(6);
        b.publish(7);
        b.publish(8);
        drop(b);
        assert_eq!(t.recv_blocking(), Some(TapItem::Event(6)));
        assert_eq!(t.recv_blocking(), Some(TapItem::Event(7)));
        assert_eq!(t.recv_blocking(), Some(TapItem::Gap { dropped: 1 }));
        assert_eq!(t.recv_blocking(), None);
        assert_eq!(t.try_recv(), Err(TryRecvError::Closed));
    }

    #[test]
    fn recv_timeout_waits_then_returns() {
        let b = Arc::new(bus::<u32>(4, 4));
        let mut t = b.take_tap().unwrap();
        b.publish(1);
        assert_eq!(t.recv_timeout(Duration::MAX), Ok(TapItem::Event(1)));
        assert_eq!(
            t.recv_timeout(Duration::from_millis(5)),
            Err(TryRecvError::Empty)
        );
        let b2 = Arc::clone(&b);
        let h = thread::spawn(move || {
            thread::sleep(Duration::from_millis(5));
            b2.publish(9);
        });
        assert_eq!(
            t.recv_timeout(Duration::from_secs(10)),
            Ok(TapItem::Event(9))
        );
        h.join().unwrap();
        drop(b);
        assert_eq!(
            t.recv_timeout(Duration::from_secs(10)),
            Err(TryRecvError::Closed)
        );
    }

    #[test]
    fn dropping_the_tap_counts_what_it_held_and_detaches() {
        let b = bus::<u32>(4, 8);
        let mut t = b.take_tap().unwrap();
        for i in 0..6 {
            b.publish(i);
        }
        assert_eq!(t.try_recv(), Ok(TapItem::Event(0)));
        b.publish(6);
        drop(t);
        let c = b.counters();
        assert!(!c.tap_attached);
        assert_eq!(
            (c.tap_offered, c.tap_delivered, c.tap_dropped, c.tap_queued),
            (7, 1, 6, 0)
        );
        b.publish(7);
        assert_eq!(
            b.counters().tap_offered,
            7,
            "a detached tap is not offered events"
        );
    }

    #[test]
    fn tap_and_subscriber_both_get_everything() {
        let clones = Arc::new(AtomicUsize::new(0));
        let b = bus::<Counted>(64, 64);
        let mut t = b.take_tap().unwrap();
        let mut s = b.subscribe();
        for _ in 0..10 {
            b.publish(Counted(Arc::clone(&clones)));
        }
        assert_eq!(
            clones.load(Relaxed),
            10,
            "one clone per event when both listen"
        );
        assert_eq!(drain(&mut t).0.len(), 10);
        for _ in 0..10 {
            assert!(matches!(s.try_recv(), Ok(Received::Event(_))));
        }
    }

    #[test]
    fn tap_overflow_accounting_under_a_consumer_thread() {
        // A tiny tap and a consumer that sleeps now and then: many drops, and
        // every one accounted for, in order.
        let b = bus::<u64>(4, 16);
        let mut t = b.take_tap().unwrap();
        let consumer = thread::spawn(move || {
            let (mut events, mut gaps, mut last) = (0u64, 0u64, None::<u64>);
            let mut buf = Vec::new();
            let mut batches = 0u64;
            loop {
                buf.clear();
                if t.recv_batch_blocking(&mut buf, 7) == 0 {
                    break;
                }
                batches += 1;
                for item in buf.drain(..) {
                    match item {
                        TapItem::Event(e) => {
                            assert!(last.is_none_or(|l| e > l), "out of order");
                            last = Some(e);
                            events += 1;
                        }
                        TapItem::Gap { dropped } => {
                            assert!(dropped > 0);
                            gaps += dropped;
                        }
                    }
                }
                if batches.is_multiple_of(8) {
                    thread::sleep(Duration::from_micros(200));
                }
            }
            (events, gaps)
        });
        for i in 0..100_000u64 {
            b.publish(i);
        }
        let before_close = b.counters();
        drop(b);
        let (events, gaps) = consumer.join().unwrap();
        assert_eq!(before_close.published, 100_000);
        assert_eq!(before_close.tap_offered, 100_000);
        assert_eq!(events + gaps, 100_000, "{events} events + {gaps} dropped");
        assert!(gaps > 0, "the test should overflow the tap");
        assert_eq!(gaps, before_close.tap_dropped);
    }

    #[test]
    fn multi_threaded_publishers_keep_per_thread_order() {
        const THREADS: u64 = 4;
        const PER: u64 = 20_000;
        let b = Arc::new(bus::<(u64, u64)>(1024, (THREADS * PER) as usize));
        let mut t = b.take_tap().unwrap();
        let mut sub = b.subscribe();
        let handles: Vec<_> = (0..THREADS)
            .map(|th| {
                let b = Arc::clone(&b);
                thread::spawn(move || {
                    for i in 0..PER {
                        b.publish((th, i));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let c = b.counters();
        assert_eq!(c.published, THREADS * PER);
        assert_eq!((c.tap_offered, c.tap_dropped), (THREADS * PER, 0));
        drop(b);
        let mut next = [0u64; THREADS as usize];
        let mut n = 0;
        while let Some(item) = t.recv_blocking() {
            let TapItem::Event((th, i)) = item else {
                panic!("no gap expected: the tap holds everything")
            };
            assert_eq!(i, next[th as usize]);
            next[th as usize] += 1;
            n += 1;
        }
        assert_eq!(n, THREADS * PER);
        // The subscriber lagged (capacity 1024 for 80,000 events) but what it
        // got is in per-thread order, and events + lag add up.
        let (mut got, mut lagged) = (0u64, 0u64);
        let mut last = [None::<u64>; THREADS as usize];
        while let Some(r) = sub.blocking_recv() {
            match r {
                Received::Event((th, i)) => {
                    assert!(last[th as usize].is_none_or(|l| i > l));
                    last[th as usize] = Some(i);
                    got += 1;
                }
                Received::Lagged(k) => lagged += k,
            }
        }
        assert_eq!(got + lagged, THREADS * PER);
    }

    /// What a single publisher's tap stream must look like: a model queue
    /// of (dropped before, event), where an event whose gap marker has been
    /// handed out no longer takes room.
    #[derive(Default)]
    struct Model {
        queue: std::collections::VecDeque<(u64, u32)>,
        held: Option<u32>,
        pending: u64,
    }

    impl Model {
        fn publish(&mut self, cap: usize, e: u32) {
            if self.queue.len() < cap {
                self.queue.push_back((std::mem::take(&mut self.pending), e));
            } else {
                self.pending += 1;
            }
        }
        fn recv(&mut self) -> Option<TapItem<u32>> {
            if let Some(e) = self.held.take() {
                return Some(TapItem::Event(e));
            }
            let (gap, e) = self.queue.pop_front()?;
            if gap == 0 {
                return Some(TapItem::Event(e));
            }
            self.held = Some(e);
            Some(TapItem::Gap { dropped: gap })
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// With one publisher the tap's stream, gap markers included, is
        /// exactly the model's, and the counters balance at every step.
        #[test]
        fn single_publisher_gaps_are_exact(
            cap in 1usize..6,
            ops in proptest::collection::vec(proptest::prelude::any::<bool>(), 0..200),
        ) {
            let b = bus::<u32>(4, cap);
            let mut t = b.take_tap().unwrap();
            let mut m = Model::default();
            let mut next = 0u32;
            let (mut delivered, mut gaps) = (0u64, 0u64);
            for publish in ops {
                if publish {
                    b.publish(next);
                    m.publish(cap, next);
                    next += 1;
                } else {
                    let got = t.try_recv().ok();
                    proptest::prop_assert_eq!(&got, &m.recv());
                    match got {
                        Some(TapItem::Event(_)) => delivered += 1,
                        Some(TapItem::Gap { dropped }) => gaps += dropped,
                        None => {}
                    }
                }
                let c = b.counters();
                proptest::prop_assert_eq!(c.tap_offered, u64::from(next));
                proptest::prop_assert_eq!(c.tap_delivered, delivered);
                proptest::prop_assert_eq!(
                    c.tap_offered,
                    c.tap_delivered + c.tap_dropped + c.tap_queued
                );
            }
            // At close, everything left comes out, and the final marker makes
            // the books balance exactly.
            let dropped = b.counters().tap_dropped;
            drop(b);
            while let Some(item) = t.recv_blocking() {
                // After close the model reports its unclaimed losses last.
                let want = m.recv().or_else(|| {
                    (m.pending > 0).then(|| TapItem::Gap {
                        dropped: std::mem::take(&mut m.pending),
                    })
                });
                proptest::prop_assert_eq!(Some(&item), want.as_ref());
                match item {
                    TapItem::Event(_) => delivered += 1,
                    TapItem::Gap { dropped } => gaps += dropped,
                }
            }
            proptest::prop_assert_eq!(gaps, dropped);
            proptest::prop_assert_eq!(delivered + gaps, u64::from(next));
        }
    }

    /// Publishers that number their events under the bus's lock (as the
    /// emitter does) get exact gap markers however many threads publish at
    /// once: each marker says exactly how many numbers are missing before
    /// the event it precedes, with a consumer draining a tiny tap
    /// meanwhile.
    #[test]
    fn gap_markers_are_exact_with_several_publishers() {
        const THREADS: u64 = 4;
        const PER: u64 = 25_000;
        let b = Arc::new(bus::<u64>(4, 8));
        let mut t = b.take_tap().unwrap();
        let next = Arc::new(AtomicU64::new(0));
        let consumer = thread::spawn(move || {
            let (mut last, mut events, mut gaps, mut pending) = (None::<u64>, 0u64, 0u64, 0u64);
            let mut polls = 0u64;
            while let Some(item) = t.recv_blocking() {
                match item {
                    TapItem::Gap { dropped } => {
                        assert_eq!(pending, 0, "two markers in a row");
                        pending = dropped;
                        gaps += dropped;
                    }
                    TapItem::Event(v) => {
                        let expected = last.map_or(0, |l| l + 1) + pending;
                        assert_eq!(v, expected, "after {last:?}, {pending} said missing");
                        last = Some(v);
                        pending = 0;
                        events += 1;
                    }
                }
                polls += 1;
                if polls.is_multiple_of(64) {
                    thread::sleep(Duration::from_micros(100));
                }
            }
            (events, gaps, last)
        });
        let publishers: Vec<_> = (0..THREADS)
            .map(|_| {
                let (b, next) = (Arc::clone(&b), Arc::clone(&next));
                thread::spawn(move || {
                    for _ in 0..PER {
                        let mut out = b.lock();
                        out.publish(next.fetch_add(1, Relaxed));
                    }
                })
            })
            .collect();
        for p in publishers {
            p.join().unwrap();
        }
        let c = b.counters();
        drop(b);
        let (events, gaps, _) = consumer.join().unwrap();
        assert_eq!(events + gaps, THREADS * PER);
        assert_eq!(gaps, c.tap_dropped);
        assert!(gaps > 0, "the test should overflow the tap");
    }

    /// A blocking receive polls (nothing wakes it): it still gets every
    /// event, and the end.
    #[test]
    fn blocking_consumer_polls_and_gets_everything() {
        let b = Arc::new(bus::<u32>(4, 100));
        let mut t = b.take_tap().unwrap();
        let consumer = thread::spawn(move || std::iter::from_fn(|| t.recv_blocking()).count());
        for i in 0..20 {
            // Long enough gaps that the consumer blocks between events.
            thread::sleep(Duration::from_millis(2));
            b.publish(i);
        }
        drop(b);
        assert_eq!(consumer.join().unwrap(), 20);
    }
}
