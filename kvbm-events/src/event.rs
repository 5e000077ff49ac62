//! The event vocabulary: one structured event for every slot transition,
//! match, allocation, registration, eviction, transfer-candidate change,
//! batch, hook call and breakpoint — and the [`Emitter`](crate::Emitter) that stamps them.
//!
//! Every event carries an envelope: the engine id, a per-engine sequence
//! number without gaps, a monotonic timestamp in nanoseconds (virtual time
//! in the simulator), the scheduler iteration, and the request id where
//! there is one. The stream alone is enough to rebuild every slot, pool and
//! in-flight transfer (see `reducer`).
//!
//! These types are plain serde structs; the on-disk encoding (flatbuffers)
//! belongs to `kvbm-recorder`, which converts at its boundary.

use crate::hash::SequenceHash;
use crate::slot::SlotState;
use crate::tier::{BlockId, Tier};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

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
    /// G1 → G3 (no host tier between them).
    pub const DEVICE_TO_DISK: Direction = Direction {
        src: Tier::Device,
        dst: Tier::Disk,
    };
    /// G3 → G1 (no host tier between them).
    pub const DISK_TO_DEVICE: Direction = Direction {
        src: Tier::Disk,
        dst: Tier::Device,
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

/// Declares [`EventKind`], [`KindTag`] and what follows from them, from one
/// list of kinds: `Name("snake_name", Category) { fields }`.
macro_rules! declare_event_kinds {
    (
        $(#[$enum_meta:meta])*
        pub enum EventKind {
            $(
                $(#[$vmeta:meta])*
                $variant:ident($snake:literal, $cat:ident) {
                    $( $(#[$fmeta:meta])* $field:ident : $fty:ty ),* $(,)?
                }
            ),* $(,)?
        }
    ) => {
        $(#[$enum_meta])*
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "kind")]
        pub enum EventKind {
            $(
                $(#[$vmeta])*
                $variant { $( $(#[$fmeta])* $field: $fty ),* },
            )*
        }

        /// Which kind an [`EventKind`] is, without its data: one per kind,
        /// in declaration order (which is also the order of the schema's
        /// `EventKind` union).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[repr(u8)]
        pub enum KindTag {
            $(
                #[doc = concat!("[`EventKind::", stringify!($variant), "`].")]
                $variant,
            )*
        }

        impl KindTag {
            /// Every kind, in declaration order: `ALL[k.index()] == k`.
            pub const ALL: &'static [KindTag] = &[$(KindTag::$variant),*];
            /// How many kinds there are.
            pub const COUNT: usize = Self::ALL.len();

            /// The kind's name, as in `EventKind` (`"SlotCreated"`).
            pub const fn name(self) -> &'static str {
                match self {
                    $(KindTag::$variant => stringify!($variant),)*
                }
            }

            /// The kind's snake_case name (`"slot_created"`), as the
            /// `tracing` layer takes it.
            pub const fn snake_name(self) -> &'static str {
                match self {
                    $(KindTag::$variant => $snake,)*
                }
            }

            /// What the kind is about.
            pub const fn category(self) -> Category {
                match self {
                    $(KindTag::$variant => Category::$cat,)*
                }
            }
        }

        impl EventKind {
            /// Which kind this is.
            pub const fn tag(&self) -> KindTag {
                match self {
                    $(EventKind::$variant { .. } => KindTag::$variant,)*
                }
            }
        }

        impl KindTag {
            /// The kind's fields' names, in declaration order.
            pub const fn field_names(self) -> &'static [&'static str] {
                match self {
                    $(KindTag::$variant => &[$(stringify!($field)),*],)*
                }
            }
        }

        /// Hands every kind, with its fields and their types as declared,
        /// to the per-kind code other modules build from the declaration:
        /// `read_fields` ([`crate::fields`]) and `testing`
        /// ([`crate::testing`]). Each defines its generator macro and
        /// calls this, so the code follows from the declaration while this
        /// module depends on neither.
        macro_rules! with_event_kinds {
            (read_fields) => {
                read_fields_of_kinds! { $( $variant { $($field: $fty),* } )* }
            };
            (testing) => {
                testing_of_kinds! { $( $variant { $($field: $fty),* } )* }
            };
        }
    };
}

/// What an event kind is about (for colouring and grouping).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Category {
    /// A request's slot and what the scheduler ran for it.
    Slot,
    /// Blocks: lookups, allocation, registration, eviction.
    Block,
    /// One transfer candidate.
    Transfer,
    /// A batch of candidates on a transfer engine.
    Batch,
    /// A pool's occupancy.
    Pool,
    /// A hook around an entry point.
    Hook,
    /// A breakpoint pausing or resuming a call.
    Breakpoint,
}

impl KindTag {
    /// Position in [`KindTag::ALL`] (for per-kind arrays).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The kind at `index` in [`KindTag::ALL`].
    pub fn from_index(index: usize) -> Option<KindTag> {
        Self::ALL.get(index).copied()
    }

    /// Parses [`name`](Self::name).
    pub fn from_name(name: &str) -> Option<KindTag> {
        Self::ALL.iter().copied().find(|k| k.name() == name)
    }

    /// Parses [`snake_name`](Self::snake_name).
    pub fn from_snake_name(name: &str) -> Option<KindTag> {
        Self::ALL.iter().copied().find(|k| k.snake_name() == name)
    }
}

impl fmt::Display for KindTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl EventKind {
    /// The kind's name (`"SlotCreated"`).
    pub const fn name(&self) -> &'static str {
        self.tag().name()
    }
}

declare_event_kinds! {
    /// What happened. See the module docs for the envelope.
    ///
    /// Each kind is declared here once, with its snake_case name and its
    /// [`Category`]; [`KindTag`], the names, the index of each kind and
    /// [`EventKind::tag`] follow from this declaration, and every match on
    /// a kind elsewhere (the reducer, the conversions, the descriptions)
    /// is exhaustive, so a new kind does not compile until each place
    /// handles it.
    pub enum EventKind {
    /// A slot was created for a request.
    SlotCreated("slot_created", Slot) {
        /// Prompt length.
        prompt_tokens: u32,
        /// Tokens the request will generate (when known).
        max_output_tokens: u32,
    },
    /// A slot moved between states.
    SlotTransition("slot_transition", Slot) {
        /// Previous state.
        from: SlotState,
        /// New state.
        to: SlotState,
    },
    /// A prefix lookup on one tier.
    MatchResult("match_result", Block) {
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
    BlocksAllocated("blocks_allocated", Block) {
        /// Tier.
        tier: Tier,
        /// The block ids.
        blocks: Vec<BlockId>,
    },
    /// A request let go of blocks (finished, preempted).
    BlocksReleased("blocks_released", Block) {
        /// Tier.
        tier: Tier,
        /// How many.
        count: u32,
    },
    /// A block was registered under a sequence hash.
    BlockRegistered("block_registered", Block) {
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
    BlockEvicted("block_evicted", Block) {
        /// Tier.
        tier: Tier,
        /// Block id.
        block: BlockId,
        /// The hash it had.
        sequence_hash: SequenceHash,
    },
    /// A transfer candidate was planned (PendingEvaluation).
    TransferPlanned("transfer_planned", Transfer) {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
        /// Blocks in it.
        blocks: u32,
    },
    /// A candidate passed evaluation and was committed (Promoted).
    TransferPromoted("transfer_promoted", Transfer) {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
        /// Blocks that will move.
        blocks: u32,
    },
    /// A candidate was skipped.
    TransferSkipped("transfer_skipped", Transfer) {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
        /// Why (a `SkipReason` name).
        reason: String,
    },
    /// A candidate was cancelled before its upgrade.
    TransferCancelled("transfer_cancelled", Transfer) {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
    },
    /// A candidate's blocks arrived (Completed).
    TransferCompleted("transfer_completed", Transfer) {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
        /// Blocks moved.
        blocks: u32,
    },
    /// A candidate's copy failed.
    TransferFailed("transfer_failed", Transfer) {
        /// Candidate id.
        transfer: u64,
        /// Direction.
        direction: Direction,
        /// The error.
        error: String,
    },
    /// A batch of candidates went to a transfer engine.
    BatchDispatched("batch_dispatched", Batch) {
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
    BatchCompleted("batch_completed", Batch) {
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
    PoolGauge("pool_gauge", Pool) {
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
    HookCall("hook_call", Hook) {
        /// Which entry point.
        entry: EntryPoint,
        /// Before or after.
        phase: HookPhase,
    },
    /// A breakpoint paused a call.
    BreakpointHit("breakpoint_hit", Breakpoint) {
        /// Breakpoint id.
        breakpoint: u64,
        /// The paused entry point.
        entry: EntryPoint,
        /// When the pause ends by itself (same clock as `ts_ns`).
        deadline_ns: u64,
    },
    /// A paused call went on.
    Resumed("resumed", Breakpoint) {
        /// Breakpoint id.
        breakpoint: u64,
        /// Why.
        cause: ResumeCause,
    },
    /// What the scheduler ran for a request in one iteration.
    TokensScheduled("tokens_scheduled", Slot) {
        /// Prompt tokens computed this iteration.
        prefill: u32,
        /// Tokens generated this iteration.
        decode: u32,
        /// Tokens computed so far (prompt and generated).
        computed: u32,
    },
    /// A request's blocks as its first prefix lookup saw them: the
    /// reference stream of the capacity analysis. Emitted once per slot,
    /// before the lookup's host and disk `MatchResult`s; a lookup may hit
    /// at most the first `(tokens - 1) / block_size` blocks (the engine
    /// computes at least the last token). Since schema version 2.
    PrefixLookup("prefix_lookup", Block) {
        /// Tokens of the request at the lookup.
        tokens: u32,
        /// Tokens per block.
        block_size: u32,
        /// Leading blocks the engine's own cache (G1) held already: the
        /// lookup's device hits.
        computed_blocks: u32,
        /// The sequence hash of each full block, in prefix order.
        hashes: Vec<SequenceHash>,
    },
    /// Tokens of a request that another connector beside kvbm provided
    /// (vLLM's `MultiConnector`): what the engine had computed when it
    /// first scheduled the request, less its own prefix hit and kvbm's
    /// loads. Inferred from what the engine scheduled; that connector
    /// reports nothing to kvbm.
    ExternalHit("external_hit", Block) {
        /// The first of them: the engine's own hit ends here.
        from_token: u32,
        /// How many.
        tokens: u32,
    },
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

#[cfg(test)]
mod tests {
    use super::*;

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
