//! The [`Emitter`]: stamps events with their envelope (engine, gapless
//! sequence number, timestamp, iteration) and publishes them on the
//! [`EventBus`]; and the clocks that timestamps come from.

use crate::bus::{BusConfig, BusError, EventBus};
use crate::event::{Event, EventKind, RequestId};
use crate::run::RunId;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Where timestamps come from.
pub trait Clock: Send + Sync {
    /// Nanoseconds since the clock's origin; never decreases.
    fn now_ns(&self) -> u64;
}

/// Wall-clock monotonic time since creation.
#[derive(Debug)]
pub struct MonotonicClock(Instant);

impl MonotonicClock {
    /// Starts at zero now.
    pub fn new() -> Self {
        MonotonicClock(Instant::now())
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        self.0.elapsed().as_nanos() as u64
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

struct Stamp {
    seq: u64,
}

/// Stamps events with the envelope and publishes them on the bus.
///
/// Sequence numbers are assigned and published under one lock, so the
/// order on the bus is the order of `seq`, with no gaps, even when the
/// leader and the pipelines' tasks emit at once.
pub struct Emitter {
    engine: u32,
    run: RunId,
    bus: EventBus<Event>,
    clock: Arc<dyn Clock>,
    iteration: AtomicU64,
    stamp: Mutex<Stamp>,
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
            stamp: Mutex::new(Stamp { seq: 0 }),
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
        self.stamp.lock().unwrap_or_else(|e| e.into_inner()).seq
    }

    /// Emits one event.
    ///
    /// With nobody listening, only the sequence number moves (under the
    /// same lock, so numbering stays gapless for a listener that attaches
    /// later): no clock read, no envelope, no publish.
    pub fn emit(&self, request: Option<&RequestId>, kind: EventKind) {
        let mut st = self.stamp.lock().unwrap_or_else(|e| e.into_inner());
        if !self.bus.has_listeners() {
            st.seq += 1;
            return;
        }
        let event = Event {
            engine: self.engine,
            seq: st.seq,
            ts_ns: self.clock.now_ns(),
            iteration: self.iteration.load(Ordering::Relaxed),
            request: request.cloned(),
            kind,
        };
        st.seq += 1;
        self.bus.publish(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tier;
    use crate::bus::TapItem;

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
}
