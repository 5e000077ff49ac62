//! The [`Emitter`]: stamps events with their envelope (engine, gapless
//! sequence number, timestamp, iteration) and publishes them on the
//! [`EventBus`]; and the clocks that timestamps come from.

use crate::bus::{BusConfig, BusError, EventBus};
use crate::event::{Event, EventKind, RequestId};
use crate::run::RunId;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Where timestamps come from.
pub trait Clock: Send + Sync {
    /// Nanoseconds since the clock's origin; never decreases.
    fn now_ns(&self) -> u64;
}

/// Monotonic time since creation, read on every event an engine emits.
///
/// From the CPU's time-stamp counter where it is invariant (through
/// `quanta`, calibrated once per process against the OS's monotonic clock,
/// under a millisecond), else from the OS's monotonic clock. On this
/// project's x86 VM a read costs about 10 ns against 26 ns for
/// `Instant::elapsed`, which goes through the vDSO; on a VM whose kernel
/// clock is `kvm-clock` that call costs more still. Two reads on different
/// cores may be out of order by the cores' counter skew (nanoseconds); the
/// [`Emitter`] stamps each event no earlier than the one before it.
#[derive(Debug)]
pub struct MonotonicClock {
    clock: quanta::Clock,
    start: u64,
}

impl MonotonicClock {
    /// Starts at zero now.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let start = clock.raw();
        MonotonicClock { clock, start }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        self.clock.delta_as_nanos(self.start, self.clock.raw())
    }
}

/// A clock the simulator moves by hand.
#[derive(Debug, Default)]
pub struct VirtualClock(AtomicU64);

impl VirtualClock {
    /// Starts at zero.
    pub fn new() -> Self {
        Self::default()
    }
    /// Moves to `ns` (never backwards).
    pub fn advance_to(&self, ns: u64) {
        self.0.fetch_max(ns, Ordering::AcqRel);
    }
    /// Moves forward by `ns`.
    pub fn advance_by(&self, ns: u64) {
        self.0.fetch_add(ns, Ordering::AcqRel);
    }
}

impl Clock for VirtualClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// Stamps events with the envelope and publishes them on the bus.
///
/// Sequence numbers are assigned and published under one lock, the bus's
/// own ([`EventBus::lock`]), so the order on the bus is the order of `seq`,
/// with no gaps, and timestamps never decrease along it, even when the
/// leader and the pipelines' tasks emit at once; and an emit takes no lock
/// but that one.
pub struct Emitter {
    engine: u32,
    run: RunId,
    bus: EventBus<Event>,
    clock: Arc<dyn Clock>,
    iteration: AtomicU64,
    /// The next sequence number, and the last event's timestamp (the next
    /// is no earlier). Written only under the bus's lock, which orders
    /// them; atomics so that [`emitted`](Self::emitted) reads without it.
    seq: AtomicU64,
    ts_ns: AtomicU64,
}

impl fmt::Debug for Emitter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Emitter")
            .field("engine", &self.engine)
            .field("run", &self.run)
            .field("iteration", &self.iteration())
            .finish()
    }
}

impl Emitter {
    /// An emitter for engine `engine` with its own bus, for a new run (a
    /// fresh random [`RunId`]).
    pub fn new(engine: u32, bus: BusConfig, clock: Arc<dyn Clock>) -> Result<Self, BusError> {
        Ok(Emitter {
            engine,
            run: RunId::random(),
            bus: EventBus::new(bus)?,
            clock,
            iteration: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            ts_ns: AtomicU64::new(0),
        })
    }

    /// The bus, to subscribe or take the recorder's tap.
    pub fn bus(&self) -> &EventBus<Event> {
        &self.bus
    }

    /// The engine id.
    pub fn engine(&self) -> u32 {
        self.engine
    }

    /// This run's identity: drawn at random when the emitter was created,
    /// so a restarted engine has another one whatever its engine id.
    pub fn run(&self) -> RunId {
        self.run
    }

    /// The clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Sets the scheduler iteration stamped on later events.
    pub fn set_iteration(&self, iteration: u64) {
        self.iteration.store(iteration, Ordering::Relaxed);
    }

    /// The current iteration.
    pub fn iteration(&self) -> u64 {
        self.iteration.load(Ordering::Relaxed)
    }

    /// Events emitted so far (the next sequence number).
    pub fn emitted(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    /// Emits one event.
    ///
    /// With nobody listening, only the sequence number moves (under the
    /// same lock, so numbering stays gapless for a listener that attaches
    /// later): no clock read, no envelope, no publish.
    pub fn emit(&self, request: Option<&RequestId>, kind: EventKind) {
        use Ordering::Relaxed;
        let mut out = self.bus.lock();
        // Load-then-store, not read-modify-write: the lock already makes
        // this thread the only writer.
        let seq = self.seq.load(Relaxed);
        self.seq.store(seq + 1, Relaxed);
        if !out.has_listeners() {
            return;
        }
        // Under the lock, so timestamps follow sequence numbers even when
        // two threads' clock reads come out of order.
        let ts_ns = self.ts_ns.load(Relaxed).max(self.clock.now_ns());
        self.ts_ns.store(ts_ns, Relaxed);
        out.publish(Event {
            engine: self.engine,
            seq,
            ts_ns,
            iteration: self.iteration.load(Relaxed),
            request: request.cloned(),
            kind,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tier;
    use crate::bus::TapItem;
    use std::sync::Mutex;

    #[test]
    fn envelope_has_gapless_sequence_and_stamps() {
        let clock = Arc::new(VirtualClock::new());
        let e = Emitter::new(7, BusConfig::default(), clock.clone()).unwrap();
        let mut tap = e.bus().take_tap().unwrap();
        let r: RequestId = Arc::from("req-1");
        e.emit(
            Some(&r),
            EventKind::SlotCreated {
                prompt_tokens: 3,
                max_output_tokens: 1,
            },
        );
        clock.advance_by(500);
        e.set_iteration(2);
        e.emit(
            None,
            EventKind::PoolGauge {
                tier: Tier::Host,
                capacity: 4,
                active: 1,
                inactive: 0,
                empty: 3,
            },
        );
        let mut got = Vec::new();
        while let Ok(TapItem::Event(ev)) = tap.try_recv() {
            got.push(ev);
        }
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].seq, got[1].seq), (0, 1));
        assert_eq!((got[0].ts_ns, got[1].ts_ns), (0, 500));
        assert_eq!((got[0].iteration, got[1].iteration), (0, 2));
        assert_eq!(got[0].request.as_deref(), Some("req-1"));
        assert_eq!(got[1].engine, 7);
        assert_eq!(e.emitted(), 2);
    }

    /// A clock that reads back what it was given, in turn.
    struct Replay(Mutex<Vec<u64>>);

    impl Clock for Replay {
        fn now_ns(&self) -> u64 {
            self.0.lock().unwrap().remove(0)
        }
    }

    /// Two reads on different cores may come out of order; the events'
    /// timestamps still never decrease along their sequence numbers.
    #[test]
    fn timestamps_never_decrease_when_the_clock_reads_run_backwards() {
        let clock = Arc::new(Replay(Mutex::new(vec![100, 90, 150, 149, 200])));
        let e = Emitter::new(1, BusConfig::default(), clock).unwrap();
        let mut tap = e.bus().take_tap().unwrap();
        for _ in 0..5 {
            e.emit(
                None,
                EventKind::SlotCreated {
                    prompt_tokens: 1,
                    max_output_tokens: 1,
                },
            );
        }
        let mut ts = Vec::new();
        while let Ok(TapItem::Event(ev)) = tap.try_recv() {
            ts.push(ev.ts_ns);
        }
        assert_eq!(ts, [100, 100, 150, 150, 200]);
    }

    /// The counter-based clock keeps time with the OS's monotonic clock:
    /// its span between two reads lies within the OS clock's spans
    /// bracketing them (inner and outer, so a thread preempted between
    /// the reads moves the bracket, not the verdict), give or take 1% of
    /// calibration error; a clock counting raw ticks would be off by the
    /// counter's frequency.
    #[test]
    fn the_monotonic_clock_keeps_time_with_the_os_clock() {
        use std::time::{Duration, Instant};
        let c = MonotonicClock::new();
        let (t0, a, t1) = (Instant::now(), c.now_ns(), Instant::now());
        std::thread::sleep(Duration::from_millis(30));
        let (t2, b, t3) = (Instant::now(), c.now_ns(), Instant::now());
        let ns = |d: Duration| d.as_nanos() as f64;
        let (inner, outer) = (ns(t2 - t1), ns(t3 - t0));
        let span = b.saturating_sub(a) as f64;
        assert!(
            span >= inner * 0.99 && span <= outer * 1.01,
            "{span} ns, against {inner}..={outer} ns"
        );
    }
}
