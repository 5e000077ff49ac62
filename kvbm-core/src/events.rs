//! The event vocabulary: one structured event for every slot transition,
//! match, allocation, registration, eviction, transfer-candidate change,
//! batch, hook call and breakpoint — and the [`Emitter`] that stamps them.
//!
//! Every event carries an envelope: the engine id, a per-engine sequence
//! number without gaps, a monotonic timestamp in nanoseconds (virtual time
//! in the simulator), the scheduler iteration, and the request id where
//! there is one. The stream alone is enough to rebuild every slot, pool and
//! in-flight transfer (see `reducer`).
//!
//! These types are plain serde structs; the on-disk encoding (flatbuffers)
//! belongs to `kvbm-recorder`, which converts at its boundary.

use crate::bus::{BusConfig, BusError, EventBus};
use crate::slot::SlotState;
use crate::tier::{BlockId, Tier};
use crate::tokens::SequenceHash;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A request id. Shared, because every event of a request carries it.
pub type RequestId = Arc<str>;

/// Which way a transfer goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Direction {
    /// Tier read.
    pub src: Tier,
    /// Tier written.
    pub dst: Tier,
}

impl Direction {
    /// G1 → G2.
    pub const DEVICE_TO_HOST: Direction = Direction {
        src: Tier::Device,
        dst: Tier::Host,
    };
    /// G2 → G3.
    pub const HOST_TO_DISK: Direction = Direction {
        src: Tier::Host,
        dst: Tier::Disk,
    };
    /// G2 → G1.
    pub const HOST_TO_DEVICE: Direction = Direction {
        src: Tier::Host,
        dst: Tier::Device,
    };
    /// G3 → G2.
    pub const DISK_TO_HOST: Direction = Direction {
        src: Tier::Disk,
        dst: Tier::Host,
    };

    /// True when the destination is a faster tier than the source.
    pub fn is_onboard(&self) -> bool {
        self.dst < self.src
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}→{}", self.src.short_name(), self.dst.short_name())
    }
}

/// The leader and executor entry points that hooks wrap and breakpoints
/// match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EntryPoint {
    /// `create_slot`.
    CreateSlot,
    /// `get_num_new_matched_tokens`.
    GetNumNewMatchedTokens,
    /// `update_state_after_alloc`.
    UpdateStateAfterAlloc,
    /// `build_connector_metadata`.
    BuildConnectorMetadata,
    /// `request_finished`.
    RequestFinished,
    /// The transfer executor starting a batch.
    TransferExecute,
}

impl EntryPoint {
    /// All entry points.
    pub const ALL: [EntryPoint; 6] = [
        EntryPoint::CreateSlot,
        EntryPoint::GetNumNewMatchedTokens,
        EntryPoint::UpdateStateAfterAlloc,
        EntryPoint::BuildConnectorMetadata,
        EntryPoint::RequestFinished,
        EntryPoint::TransferExecute,
    ];

    /// The snake_case name used in code and on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            EntryPoint::CreateSlot => "create_slot",
            EntryPoint::GetNumNewMatchedTokens => "get_num_new_matched_tokens",
            EntryPoint::UpdateStateAfterAlloc => "update_state_after_alloc",
            EntryPoint::BuildConnectorMetadata => "build_connector_metadata",
            EntryPoint::RequestFinished => "request_finished",
            EntryPoint::TransferExecute => "transfer_execute",
        }
    }

    /// Parses [`name`](Self::name).
    pub fn from_name(s: &str) -> Option<EntryPoint> {
        EntryPoint::ALL.into_iter().find(|e| e.name() == s)
    }
}

/// Before or after an entry point ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HookPhase {
    /// `will_call`.
    Will,
    /// `finished_call`.
    Finished,
}

/// Why a paused call went on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ResumeCause {
    /// A resume command.
    Resume,
    /// A step command (run to the next hit).
    Step,
    /// The pause's deadline passed.
    Deadline,
    /// The breakpoint was cleared.
    Cleared,
    /// The client that set it went away.
    ClientGone,
}

/// What happened. See the module docs for the envelope.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind")]
pub enum EventKind {
    /// A slot was created for a request.
    SlotCreated {
        /// Prompt length.
        prompt_tokens: u32,
        /// Tokens the request will generate (when known).
        max_output_tokens: u32,
    },
    /// A slot moved between states.
    SlotTransition {
        /// Previous state.
        from: SlotState,
        /// New state.
        to: SlotState,
    },
    /// A prefix lookup on one tier.
    MatchResult {
        /// The tier searched.
        tier: Tier,
        /// Full blocks looked up.
        looked_up: u32,
        /// Leading blocks found.
        hit_blocks: u32,
        /// Tokens those blocks cover.
        hit_tokens: u32,
    },
    /// Blocks allocated to a request (or to a transfer's destination).
    BlocksAllocated {
        /// Tier.
        tier: Tier,
        /// The block ids.
        blocks: Vec<BlockId>,
    },
    /// A request let go of blocks (finished, preempted).
    BlocksReleased {
        /// Tier.
        tier: Tier,
        /// How many.
        count: u32,
    },
    /// A block was registered under a sequence hash.
    BlockRegistered {
        /// Tier.
        tier: Tier,
        /// Block id.
        block: BlockId,
        /// Its sequence hash.
        sequence_hash: SequenceHash,
        /// The primary block, when the hash was already registered.
        duplicate_of: Option<BlockId>,
    },
    /// An inactive block was evicted.
    BlockEvicted {
        /// Tier.
        tier: Tier,
        /// Block id.
        block: BlockId,
        /// The hash it had.
        sequence_hash: SequenceHash,
    },
    /// A transfer candidate was planned (PendingEvaluation).
    TransferPlanned {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
        /// Blocks in it.
        blocks: u32,
    },
    /// A candidate passed evaluation and was committed (Promoted).
    TransferPromoted {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
        /// Blocks that will move.
        blocks: u32,
    },
    /// A candidate was skipped.
    TransferSkipped {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
        /// Why (a `SkipReason` name).
        reason: String,
    },
    /// A candidate was cancelled before its upgrade.
    TransferCancelled {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
    },
    /// A candidate's blocks arrived (Completed).
    TransferCompleted {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
        /// Blocks moved.
        blocks: u32,
    },
    /// A candidate's copy failed.
    TransferFailed {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
        /// The error.
        error: String,
    },
    /// A batch of candidates went to a transfer engine.
    BatchDispatched {
        /// Batch id.
        batch: u64,
        /// Direction.
        direction: Direction,
        /// Candidates in it.
        transfers: Vec<u64>,
        /// Blocks in it.
        blocks: u32,
    },
    /// A batch finished.
    BatchCompleted {
        /// Batch id.
        batch: u64,
        /// Direction.
        direction: Direction,
        /// False when the copy failed.
        ok: bool,
        /// Blocks moved.
        blocks: u32,
        /// Bytes moved.
        bytes: u64,
        /// Engine time, ns.
        elapsed_ns: u64,
    },
    /// Occupancy of one tier's pool.
    PoolGauge {
        /// Tier.
        tier: Tier,
        /// Blocks in all.
        capacity: u32,
        /// In use.
        active: u32,
        /// Cached, evictable.
        inactive: u32,
        /// Free.
        empty: u32,
    },
    /// A hook ran around an entry point.
    HookCall {
        /// Which entry point.
        entry: EntryPoint,
        /// Before or after.
        phase: HookPhase,
    },
    /// A breakpoint paused a call.
    BreakpointHit {
        /// Breakpoint id.
        breakpoint: u64,
        /// The paused entry point.
        entry: EntryPoint,
        /// When the pause ends by itself (same clock as `ts_ns`).
        deadline_ns: u64,
    },
    /// A paused call went on.
    Resumed {
        /// Breakpoint id.
        breakpoint: u64,
        /// Why.
        cause: ResumeCause,
    },
    /// What the scheduler ran for a request in one iteration.
    TokensScheduled {
        /// Prompt tokens computed this iteration.
        prefill: u32,
        /// Tokens generated this iteration.
        decode: u32,
        /// Tokens computed so far (prompt and generated).
        computed: u32,
    },
}

impl EventKind {
    /// The variant's name.
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::SlotCreated { .. } => "SlotCreated",
            EventKind::SlotTransition { .. } => "SlotTransition",
            EventKind::MatchResult { .. } => "MatchResult",
            EventKind::BlocksAllocated { .. } => "BlocksAllocated",
            EventKind::BlocksReleased { .. } => "BlocksReleased",
            EventKind::BlockRegistered { .. } => "BlockRegistered",
            EventKind::BlockEvicted { .. } => "BlockEvicted",
            EventKind::TransferPlanned { .. } => "TransferPlanned",
            EventKind::TransferPromoted { .. } => "TransferPromoted",
            EventKind::TransferSkipped { .. } => "TransferSkipped",
            EventKind::TransferCancelled { .. } => "TransferCancelled",
            EventKind::TransferCompleted { .. } => "TransferCompleted",
            EventKind::TransferFailed { .. } => "TransferFailed",
            EventKind::BatchDispatched { .. } => "BatchDispatched",
            EventKind::BatchCompleted { .. } => "BatchCompleted",
            EventKind::PoolGauge { .. } => "PoolGauge",
            EventKind::HookCall { .. } => "HookCall",
            EventKind::BreakpointHit { .. } => "BreakpointHit",
            EventKind::Resumed { .. } => "Resumed",
            EventKind::TokensScheduled { .. } => "TokensScheduled",
        }
    }
}

/// One event with its envelope.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Which engine emitted it.
    pub engine: u32,
    /// Per-engine sequence number: 0, 1, 2, ... without gaps.
    pub seq: u64,
    /// Monotonic time, ns (virtual in the simulator).
    pub ts_ns: u64,
    /// Scheduler iteration.
    pub iteration: u64,
    /// The request, where there is one.
    pub request: Option<RequestId>,
    /// What happened.
    pub kind: EventKind,
}

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
    bus: EventBus<Event>,
    clock: Arc<dyn Clock>,
    iteration: AtomicU64,
    stamp: Mutex<Stamp>,
}

impl fmt::Debug for Emitter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Emitter")
            .field("engine", &self.engine)
            .field("iteration", &self.iteration())
            .finish()
    }
}

impl Emitter {
    /// An emitter for engine `engine` with its own bus.
    pub fn new(engine: u32, bus: BusConfig, clock: Arc<dyn Clock>) -> Result<Self, BusError> {
        Ok(Emitter {
            engine,
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

    #[test]
    fn events_round_trip_through_json() {
        let ev = Event {
            engine: 1,
            seq: 9,
            ts_ns: 10,
            iteration: 3,
            request: Some(Arc::from("r")),
            kind: EventKind::SlotTransition {
                from: SlotState::OnboardStaged(16),
                to: SlotState::Onboarding(16),
            },
        };
        let s = serde_json::to_string(&ev).unwrap();
        let back: Event = serde_json::from_str(&s).unwrap();
        assert_eq!(back, ev);
        assert!(s.contains("\"kind\":\"SlotTransition\""), "{s}");
    }

    #[test]
    fn entry_point_names_round_trip() {
        for e in EntryPoint::ALL {
            assert_eq!(EntryPoint::from_name(e.name()), Some(e));
        }
        assert_eq!(EntryPoint::from_name("nope"), None);
        assert_eq!(Direction::HOST_TO_DEVICE.to_string(), "G2→G1");
        assert!(Direction::DISK_TO_HOST.is_onboard());
        assert!(!Direction::DEVICE_TO_HOST.is_onboard());
    }
}
