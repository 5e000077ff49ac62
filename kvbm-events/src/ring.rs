//! The in-memory ring buffer: the last N events, kept so that a console that
//! attaches late, a crash handler or a `replay` of "what just happened" can
//! read them while the recorder keeps writing.
//!
//! # Design
//!
//! One writer (the thread draining the bus's tap) calls [`RingBuffer::push`]
//! for every event; any number of readers call [`RingBuffer::read`],
//! [`RingBuffer::since_seq`] or [`RingBuffer::latest`] at the same time.
//! The ring is a `VecDeque` behind a `Mutex`:
//!
//! - The writer holds the lock for one `push_back` (and one `pop_front` when
//!   full). The evicted event is dropped *after* the lock is released, so
//!   freeing its request id or block list never happens under the lock.
//! - A reader holds the lock only to clone events out, and never more than
//!   [`RingConfig::max_read`] of them per call (default 1,024), so the
//!   writer waits at most that long — tens of microseconds — however large
//!   the ring is. A reader that wants more calls again with the cursor it
//!   got back.
//!
//! A lock-free ring (a seqlock per slot) would spare the writer even that
//! wait, but events are not `Copy` (request ids are `Arc`s, allocations
//! carry block lists), so readers could not copy a slot optimistically and
//! validate afterwards without unsafe code; the bounded critical section is
//! the simpler promise that is easy to check.
//!
//! # Positions and losses
//!
//! Every pushed event gets a *position*: 0 for the first, 1 for the next, and
//! so on, whatever its sequence number. A reader keeps a cursor (the next
//! position it wants); when the writer has overwritten positions the reader
//! had not read yet, [`RingRead::missed`] says how many, so a slow reader
//! learns of its loss exactly as a lagging bus subscriber does.
//!
//! Three counters describe the ring ([`RingCounters`]): events pushed, events
//! overwritten (pushed out by newer ones), and events *lost before they
//! reached the ring* — the tap's [`TapItem::Gap`] markers, fed in through
//! [`RingBuffer::push_item`] or [`RingBuffer::record_gap`].

use crate::Event;
use crate::bus::TapItem;
use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

/// Largest accepted ring capacity, so a typo cannot reserve the machine's
/// memory: at ~100 bytes an event, about 1.6 GiB.
pub const MAX_RING_CAPACITY: usize = 1 << 24;

/// Default number of events kept.
pub const DEFAULT_RING_CAPACITY: usize = 65_536;

/// Default cap on events copied out by one read.
pub const DEFAULT_MAX_READ: usize = 1_024;

/// Sizes of a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    /// Events kept; older ones are overwritten. 1 to [`MAX_RING_CAPACITY`].
    pub capacity: usize,
    /// Most events one read copies out (bounds how long a reader holds the
    /// lock). At least 1.
    pub max_read: usize,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            capacity: DEFAULT_RING_CAPACITY,
            max_read: DEFAULT_MAX_READ,
        }
    }
}

impl RingConfig {
    /// A config keeping `capacity` events, with the default read cap.
    pub fn with_capacity(capacity: usize) -> Self {
        RingConfig {
            capacity,
            ..RingConfig::default()
        }
    }
}

/// A refused ring configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// `capacity` is zero or above [`MAX_RING_CAPACITY`].
    #[error("ring capacity must be between 1 and {max}, got {got}")]
    BadCapacity {
        /// What was given.
        got: usize,
        /// The largest accepted value.
        max: usize,
    },
    /// `max_read` is zero.
    #[error("ring max_read must be at least 1")]
    BadMaxRead,
}

/// The ring's counters, read together under the lock (so they balance:
/// `pushed == overwritten + len`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RingCounters {
    /// Events pushed since creation.
    pub pushed: u64,
    /// Events overwritten by newer ones (no longer readable).
    pub overwritten: u64,
    /// Events lost before they reached the ring (the tap's gap markers).
    pub lost: u64,
    /// Gap markers received.
    pub gaps: u64,
    /// Events held now.
    pub len: u64,
}

impl RingCounters {
    /// Position of the oldest event still held (equals `pushed` when empty).
    pub fn oldest_position(&self) -> u64 {
        self.pushed - self.len
    }
}

/// What one read returned.
#[derive(Debug, Clone, PartialEq)]
pub struct RingRead {
    /// The events, oldest first, contiguous in push order.
    pub events: Vec<Event>,
    /// Events between the requested start and the first returned one that
    /// are gone (overwritten, or — for [`RingBuffer::since_seq`] — missing
    /// from the sequence for any reason).
    pub missed: u64,
    /// The cursor for the next read: the position after the last event
    /// returned.
    pub next: u64,
    /// The counters at the time of the read.
    pub counters: RingCounters,
}

impl RingRead {
    /// True when the read reached the newest event (nothing more to read now).
    pub fn caught_up(&self) -> bool {
        self.next >= self.counters.pushed
    }
}

#[derive(Debug)]
struct Inner {
    buf: VecDeque<Event>,
    pushed: u64,
    overwritten: u64,
    lost: u64,
    gaps: u64,
}

impl Inner {
    fn counters(&self) -> RingCounters {
        RingCounters {
            pushed: self.pushed,
            overwritten: self.overwritten,
            lost: self.lost,
            gaps: self.gaps,
            len: self.buf.len() as u64,
        }
    }
}

/// The last N events; see the module docs. Share it behind an `Arc`.
#[derive(Debug)]
pub struct RingBuffer {
    inner: Mutex<Inner>,
    config: RingConfig,
}

impl RingBuffer {
    /// An empty ring.
    pub fn new(config: RingConfig) -> Result<Self, RingError> {
        if config.capacity == 0 || config.capacity > MAX_RING_CAPACITY {
            return Err(RingError::BadCapacity {
                got: config.capacity,
                max: MAX_RING_CAPACITY,
            });
        }
        if config.max_read == 0 {
            return Err(RingError::BadMaxRead);
        }
        Ok(RingBuffer {
            // Allocated up front so the writer never reallocates (and never
            // copies the whole ring) while holding the lock.
            inner: Mutex::new(Inner {
                buf: VecDeque::with_capacity(config.capacity),
                pushed: 0,
                overwritten: 0,
                lost: 0,
                gaps: 0,
            }),
            config,
        })
    }

    /// An empty ring keeping `capacity` events.
    pub fn with_capacity(capacity: usize) -> Result<Self, RingError> {
        Self::new(RingConfig::with_capacity(capacity))
    }

    /// The configuration it was built with.
    pub fn config(&self) -> RingConfig {
        self.config
    }

    /// Events kept at most.
    pub fn capacity(&self) -> usize {
        self.config.capacity
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing under the lock can panic half-way through an update, but a
        // poisoned lock must not take the recorder down with it either.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends an event, overwriting the oldest when full. Returns its
    /// position.
    pub fn push(&self, event: Event) -> u64 {
        let mut g = self.lock();
        let evicted = if g.buf.len() >= self.config.capacity {
            g.overwritten += 1;
            g.buf.pop_front()
        } else {
            None
        };
        g.buf.push_back(event);
        let pos = g.pushed;
        g.pushed += 1;
        drop(g);
        // Freed outside the lock.
        drop(evicted);
        pos
    }

    /// Counts `dropped` events lost before they reached the ring.
    pub fn record_gap(&self, dropped: u64) {
        let mut g = self.lock();
        g.lost = g.lost.saturating_add(dropped);
        g.gaps += 1;
    }

    /// Takes one item from the bus's tap: an event is pushed, a gap marker
    /// counted.
    pub fn push_item(&self, item: TapItem<Event>) {
        match item {
            TapItem::Event(e) => {
                self.push(e);
            }
            TapItem::Gap { dropped } => self.record_gap(dropped),
        }
    }

    /// The counters now.
    pub fn counters(&self) -> RingCounters {
        self.lock().counters()
    }

    /// Events held now.
    pub fn len(&self) -> usize {
        self.lock().buf.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Up to [`RingConfig::max_read`] events from position `cursor` on. A
    /// cursor older than the oldest held event starts at the oldest and
    /// reports the difference in `missed`; a cursor past the newest returns
    /// nothing. Pass `next` back for the following read.
    pub fn read(&self, cursor: u64) -> RingRead {
        self.read_at_most(cursor, self.config.max_read)
    }

    /// [`read`](Self::read) with a smaller cap (`max` is clamped to
    /// [`RingConfig::max_read`]).
    pub fn read_at_most(&self, cursor: u64, max: usize) -> RingRead {
        let max = max.min(self.config.max_read);
        let g = self.lock();
        let counters = g.counters();
        let oldest = counters.oldest_position();
        let start = cursor.clamp(oldest, counters.pushed);
        let missed = start - cursor.min(start);
        // `start - oldest <= len`, which fits in usize.
        let skip = usize::try_from(start - oldest).unwrap_or(usize::MAX);
        let events: Vec<Event> = g.buf.iter().skip(skip).take(max).cloned().collect();
        drop(g);
        RingRead {
            next: start + events.len() as u64,
            events,
            missed,
            counters,
        }
    }

    /// Up to [`RingConfig::max_read`] events whose sequence number is at least
    /// `seq`, for a reader that tracks sequence numbers rather than positions
    /// (a console resuming after a reconnect). `missed` counts the sequence
    /// numbers from `seq` up to the first returned event that the ring does
    /// not hold, whatever the reason (overwritten or lost upstream), but only
    /// when the ring has lost or overwritten anything: a ring that holds the
    /// whole stream reports no miss for numbers that were never emitted.
    ///
    /// Assumes the held events are in ascending `seq` order, as one engine
    /// emits them; with mixed engines the answer is some suffix of the ring,
    /// never a panic.
    pub fn since_seq(&self, seq: u64) -> RingRead {
        let max = self.config.max_read;
        let g = self.lock();
        let counters = g.counters();
        let skip = g.buf.partition_point(|e| e.seq < seq);
        let events: Vec<Event> = g.buf.iter().skip(skip).take(max).cloned().collect();
        drop(g);
        let anything_lost = counters.overwritten > 0 || counters.lost > 0;
        let missed = match events.first() {
            Some(first) if anything_lost => first.seq.saturating_sub(seq),
            _ => 0,
        };
        RingRead {
            next: counters.oldest_position() + (skip + events.len()) as u64,
            events,
            missed,
            counters,
        }
    }

    /// The newest `n` events (at most [`RingConfig::max_read`]), oldest
    /// first.
    pub fn latest(&self, n: usize) -> Vec<Event> {
        let n = n.min(self.config.max_read);
        let g = self.lock();
        let skip = g.buf.len().saturating_sub(n);
        g.buf.iter().skip(skip).cloned().collect()
    }

    /// Every held event, read in bounded chunks so the writer is never held
    /// up for long; with a writer running, the result is a contiguous run
    /// from some point on (whatever was overwritten while reading is counted
    /// in the returned `missed`).
    pub fn snapshot(&self) -> (Vec<Event>, u64) {
        let mut out = Vec::new();
        let mut missed = 0;
        let mut cursor = self.counters().oldest_position();
        loop {
            let r = self.read(cursor);
            missed += r.missed;
            let done = r.events.is_empty() || r.caught_up();
            cursor = r.next;
            out.extend(r.events);
            if done {
                return (out, missed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EventKind;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn ev(seq: u64) -> Event {
        Event {
            engine: 0,
            seq,
            ts_ns: seq * 10,
            iteration: 0,
            request: Some(Arc::from(format!("r{}", seq % 7))),
            kind: EventKind::TokensScheduled {
                prefill: 1,
                decode: 0,
                computed: seq as u32,
            },
        }
    }

    fn seqs(events: &[Event]) -> Vec<u64> {
        events.iter().map(|e| e.seq).collect()
    }

    #[test]
    fn rejects_bad_configs() {
        assert!(matches!(
            RingBuffer::with_capacity(0),
            Err(RingError::BadCapacity { got: 0, .. })
        ));
        assert!(RingBuffer::with_capacity(MAX_RING_CAPACITY + 1).is_err());
        assert_eq!(
            RingBuffer::new(RingConfig {
                capacity: 4,
                max_read: 0
            })
            .unwrap_err(),
            RingError::BadMaxRead
        );
    }

    #[test]
    fn keeps_the_last_n_and_counts_overwrites() {
        let ring = RingBuffer::with_capacity(4).unwrap();
        assert!(ring.is_empty());
        for s in 0..10 {
            assert_eq!(ring.push(ev(s)), s);
        }
        let c = ring.counters();
        assert_eq!((c.pushed, c.overwritten, c.len, c.lost), (10, 6, 4, 0));
        assert_eq!(seqs(&ring.latest(100)), [6, 7, 8, 9]);
        assert_eq!(seqs(&ring.latest(2)), [8, 9]);
        // A reader that started at 0 missed the 6 overwritten events.
        let r = ring.read(0);
        assert_eq!(
            (seqs(&r.events), r.missed, r.next),
            (vec![6, 7, 8, 9], 6, 10)
        );
        assert!(r.caught_up());
        // A reader in the middle misses nothing.
        let r = ring.read(8);
        assert_eq!((seqs(&r.events), r.missed), (vec![8, 9], 0));
        // Past the end: nothing, no miss.
        let r = ring.read(99);
        assert_eq!((r.events.len(), r.missed, r.next), (0, 0, 10));
    }

    #[test]
    fn reads_are_bounded_and_resume_with_the_cursor() {
        let ring = RingBuffer::new(RingConfig {
            capacity: 100,
            max_read: 3,
        })
        .unwrap();
        for s in 0..10 {
            ring.push(ev(s));
        }
        let mut cursor = 0;
        let mut got = Vec::new();
        loop {
            let r = ring.read(cursor);
            assert!(r.events.len() <= 3);
            got.extend(seqs(&r.events));
            cursor = r.next;
            if r.caught_up() {
                break;
            }
        }
        assert_eq!(got, (0..10).collect::<Vec<_>>());
        assert_eq!(ring.read_at_most(0, 2).events.len(), 2);
        assert_eq!(ring.read_at_most(0, 50).events.len(), 3);
        assert_eq!(ring.latest(10).len(), 3);
        let (all, missed) = ring.snapshot();
        assert_eq!((seqs(&all), missed), ((0..10).collect(), 0));
    }

    #[test]
    fn gap_markers_are_counted_and_since_seq_reports_holes() {
        let ring = RingBuffer::with_capacity(8).unwrap();
        ring.push_item(TapItem::Event(ev(0)));
        ring.push_item(TapItem::Event(ev(1)));
        ring.push_item(TapItem::Gap { dropped: 3 });
        ring.push_item(TapItem::Event(ev(5)));
        let c = ring.counters();
        assert_eq!((c.pushed, c.lost, c.gaps), (3, 3, 1));
        let r = ring.since_seq(2);
        assert_eq!((seqs(&r.events), r.missed), (vec![5], 3));
        let r = ring.since_seq(0);
        assert_eq!((seqs(&r.events), r.missed), (vec![0, 1, 5], 0));
        // The cursor from a seq read continues as a position read.
        let r = ring.since_seq(1);
        assert_eq!(r.next, 3);
        // Nothing at or after: empty, no miss.
        let r = ring.since_seq(6);
        assert_eq!((r.events.len(), r.missed, r.next), (0, 0, 3));
    }

    #[test]
    fn since_seq_without_losses_reports_no_miss() {
        let ring = RingBuffer::with_capacity(8).unwrap();
        ring.push(ev(10));
        ring.push(ev(11));
        // The ring holds everything it was given: seq 0..10 were never
        // pushed, which is not a loss the ring knows of.
        let r = ring.since_seq(0);
        assert_eq!((seqs(&r.events), r.missed), (vec![10, 11], 0));
    }

    /// One writer flat out, three readers following with cursors: every read
    /// is a contiguous run of positions, and for each reader what it read
    /// plus what it was told it missed is exactly what was pushed.
    #[test]
    fn concurrent_writer_and_readers_account_for_every_event() {
        const N: u64 = 200_000;
        let ring = Arc::new(
            RingBuffer::new(RingConfig {
                capacity: 512,
                max_read: 64,
            })
            .unwrap(),
        );
        let done = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..3)
            .map(|i| {
                let ring = ring.clone();
                let done = done.clone();
                std::thread::spawn(move || {
                    let (mut cursor, mut read, mut missed) = (0u64, 0u64, 0u64);
                    loop {
                        let finished = done.load(Ordering::Acquire);
                        let r = ring.read(cursor);
                        // Contiguous, and positions equal seqs here.
                        for (k, e) in r.events.iter().enumerate() {
                            assert_eq!(e.seq, cursor + r.missed + k as u64);
                        }
                        read += r.events.len() as u64;
                        missed += r.missed;
                        cursor = r.next;
                        if i == 2 {
                            // A reader that also samples the newest events.
                            let l = ring.latest(16);
                            assert!(l.windows(2).all(|w| w[1].seq == w[0].seq + 1));
                        }
                        if finished && r.caught_up() {
                            return (read, missed);
                        }
                        if i == 1 {
                            // A slow reader, so it does miss some.
                            std::thread::sleep(std::time::Duration::from_micros(200));
                        }
                    }
                })
            })
            .collect();
        for s in 0..N {
            ring.push(ev(s));
        }
        done.store(true, Ordering::Release);
        for r in readers {
            let (read, missed) = r.join().unwrap();
            assert_eq!(read + missed, N);
        }
        let c = ring.counters();
        assert_eq!((c.pushed, c.overwritten, c.len), (N, N - 512, 512));
    }
}
