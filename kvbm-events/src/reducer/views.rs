//! The views the reducer builds: one per slot, pool, transfer, batch and
//! paused call, plus the stream and inconsistency counters. Plain data with
//! public fields, so the console and replay read them directly; only the
//! reducer (the parent module) changes them.

use super::{Limits, push_bounded};
use crate::hash::SequenceHash;
use crate::slot::SlotState;
use crate::tier::Tier;
use crate::{Direction, EntryPoint, RequestId, ResumeCause};
use serde::{Deserialize, Serialize};
use std::collections::{HashSet, VecDeque};
use std::fmt;

/// One request's slot, as rebuilt from its events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotView {
    /// The request id.
    pub request: RequestId,
    /// Current state.
    pub state: SlotState,
    /// When the slot was created.
    pub created_ns: u64,
    /// When the current state began.
    pub state_since_ns: u64,
    /// Time of the last event that changed this slot.
    pub updated_ns: u64,
    /// Prompt length.
    pub prompt_tokens: u32,
    /// Tokens the request will generate (when known).
    pub max_output_tokens: u32,
    /// Tokens computed so far (prompt and generated), as last scheduled.
    pub computed: u32,
    /// Prompt tokens computed, summed over iterations.
    pub prefilled: u64,
    /// Tokens generated, summed over iterations.
    pub generated: u64,
    /// Blocks held, per tier (indexed by [`Tier::index`]).
    pub blocks: [u32; 3],
    /// Prefix-hit tokens, per tier: for G1 the device hit of the request's
    /// latest lookup; for G2 and G3 the tokens loaded from that tier into
    /// the device for the request (completed loads, summed over its life).
    /// See the reducer's *Per-request hits*.
    pub hit_tokens: [u64; 3],
    /// Tokens another connector beside kvbm provided (`ExternalHit`),
    /// summed over the request's admissions.
    pub external_tokens: u64,
    /// Transfers of this request in flight.
    pub outstanding: u32,
    /// When the first generated token was scheduled.
    pub first_token_ns: Option<u64>,
    /// Transitions seen, including re-announcements of the current state.
    pub transitions: u64,
    /// `(start ns, state)` of the latest intervals, oldest first; the last
    /// entry is the current state.
    pub history: VecDeque<(u64, SlotState)>,
    /// Intervals dropped from the front of `history`.
    pub history_dropped: u64,
}

impl SlotView {
    pub(super) fn new(
        request: RequestId,
        ts_ns: u64,
        prompt_tokens: u32,
        max_output_tokens: u32,
        limits: &Limits,
    ) -> Self {
        let mut slot = SlotView {
            request,
            state: SlotState::Initialized,
            created_ns: ts_ns,
            state_since_ns: ts_ns,
            updated_ns: ts_ns,
            prompt_tokens,
            max_output_tokens,
            computed: 0,
            prefilled: 0,
            generated: 0,
            blocks: [0; 3],
            hit_tokens: [0; 3],
            external_tokens: 0,
            outstanding: 0,
            first_token_ns: None,
            transitions: 0,
            history: VecDeque::new(),
            history_dropped: 0,
        };
        slot.record(ts_ns, SlotState::Initialized, limits.history_per_slot);
        slot
    }

    pub(super) fn record(&mut self, ts_ns: u64, state: SlotState, cap: usize) {
        push_bounded(
            &mut self.history,
            &mut self.history_dropped,
            (ts_ns, state),
            cap,
        );
    }

    /// Time to first token, when there is one.
    pub fn ttft_ns(&self) -> Option<u64> {
        self.first_token_ns
            .map(|t| t.saturating_sub(self.created_ns))
    }

    /// True once the slot is `Finished`.
    pub fn is_finished(&self) -> bool {
        self.state.is_terminal()
    }

    /// Prefix-hit tokens over all tiers and other connectors.
    pub fn total_hit_tokens(&self) -> u64 {
        self.hit_tokens.iter().sum::<u64>() + self.external_tokens
    }

    /// The kept history as `(start, end, state)` intervals, oldest first; the
    /// current one ends at `now_ns` (or at its start, if `now_ns` is earlier).
    pub fn intervals(&self, now_ns: u64) -> impl Iterator<Item = (u64, u64, SlotState)> + '_ {
        let ends = self
            .history
            .iter()
            .skip(1)
            .map(|&(t, _)| t)
            .chain(std::iter::once(now_ns));
        self.history
            .iter()
            .zip(ends)
            .map(|(&(start, state), end)| (start, end.max(start), state))
    }
}

impl fmt::Display for SlotView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} since {} blocks {}/{}/{} computed {}/{} generated {} outstanding {}",
            self.request,
            self.state,
            self.state_since_ns,
            self.blocks[0],
            self.blocks[1],
            self.blocks[2],
            self.computed,
            self.prompt_tokens,
            self.generated,
            self.outstanding
        )?;
        if let Some(t) = self.ttft_ns() {
            write!(f, " ttft {t}ns")?;
        }
        Ok(())
    }
}

/// One tier's pool, as rebuilt from its events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolView {
    /// The tier.
    pub tier: Tier,
    /// Blocks in all (last gauge).
    pub capacity: u32,
    /// In use (last gauge).
    pub active: u32,
    /// Cached, evictable (last gauge).
    pub inactive: u32,
    /// Free (last gauge).
    pub empty: u32,
    /// When the last gauge came, if one did.
    pub gauge_ns: Option<u64>,
    /// Sequence hashes registered in this tier now.
    pub registered: HashSet<SequenceHash>,
    /// Registrations, duplicates included.
    pub registrations: u64,
    /// Registrations that resolved to an existing primary block.
    pub duplicate_registrations: u64,
    /// Evictions.
    pub evictions: u64,
    /// Blocks allocated (with or without a request).
    pub allocated_blocks: u64,
    /// Blocks released by requests.
    pub released_blocks: u64,
    /// Prefix lookups.
    pub lookups: u64,
    /// Blocks looked up.
    pub looked_up_blocks: u64,
    /// Blocks found.
    pub hit_blocks: u64,
    /// Tokens those blocks cover.
    pub hit_tokens: u64,
}

impl PoolView {
    pub(super) fn new(tier: Tier) -> Self {
        PoolView {
            tier,
            capacity: 0,
            active: 0,
            inactive: 0,
            empty: 0,
            gauge_ns: None,
            registered: HashSet::new(),
            registrations: 0,
            duplicate_registrations: 0,
            evictions: 0,
            allocated_blocks: 0,
            released_blocks: 0,
            lookups: 0,
            looked_up_blocks: 0,
            hit_blocks: 0,
            hit_tokens: 0,
        }
    }
}

/// Where a transfer candidate stands.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TransferState {
    /// Planned, not yet evaluated.
    PendingEvaluation,
    /// Committed: its blocks will move.
    Promoted,
    /// Its blocks arrived.
    Completed,
    /// Dropped by evaluation, with the reason.
    Skipped(String),
    /// Cancelled before its upgrade.
    Cancelled,
    /// The copy failed, with the error.
    Failed(String),
}

impl TransferState {
    /// True for the states after which nothing happens to the transfer.
    pub fn is_terminal(&self) -> bool {
        !matches!(
            self,
            TransferState::PendingEvaluation | TransferState::Promoted
        )
    }

    /// The state's name without its payload.
    pub fn name(&self) -> &'static str {
        match self {
            TransferState::PendingEvaluation => "PendingEvaluation",
            TransferState::Promoted => "Promoted",
            TransferState::Completed => "Completed",
            TransferState::Skipped(_) => "Skipped",
            TransferState::Cancelled => "Cancelled",
            TransferState::Failed(_) => "Failed",
        }
    }
}

impl fmt::Display for TransferState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransferState::Skipped(r) => write!(f, "Skipped({r})"),
            TransferState::Failed(e) => write!(f, "Failed({e})"),
            other => f.write_str(other.name()),
        }
    }
}

/// One transfer candidate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferView {
    /// Candidate id.
    pub id: u64,
    /// The request that planned it, if any.
    pub request: Option<RequestId>,
    /// Direction (as planned).
    pub direction: Direction,
    /// Blocks in it (updated on promotion and completion).
    pub blocks: u32,
    /// Where it stands.
    pub status: TransferState,
    /// When it was planned.
    pub planned_ns: u64,
    /// When its status last changed.
    pub updated_ns: u64,
    /// The batch it went out in, once dispatched.
    pub batch: Option<u64>,
}

impl TransferView {
    /// Time from planning to the last status change (for a terminal
    /// transfer: its latency).
    pub fn latency_ns(&self) -> u64 {
        self.updated_ns.saturating_sub(self.planned_ns)
    }
}

impl fmt::Display for TransferView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "#{} {} {} blocks {}",
            self.id, self.direction, self.status, self.blocks
        )?;
        if let Some(r) = &self.request {
            write!(f, " req {r}")?;
        }
        if let Some(b) = self.batch {
            write!(f, " batch {b}")?;
        }
        write!(f, " {}ns", self.latency_ns())
    }
}

/// A batch handed to a transfer engine and not yet completed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchView {
    /// Batch id.
    pub id: u64,
    /// Direction.
    pub direction: Direction,
    /// Candidates in it.
    pub transfers: Vec<u64>,
    /// Blocks in it.
    pub blocks: u32,
    /// When it was dispatched.
    pub dispatched_ns: u64,
}

/// Running totals for one transfer direction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectionTotals {
    /// The direction.
    pub direction: Direction,
    /// Candidates planned.
    pub planned: u64,
    /// Candidates promoted.
    pub promoted: u64,
    /// Candidates completed.
    pub completed: u64,
    /// Blocks of completed candidates.
    pub completed_blocks: u64,
    /// Candidates skipped.
    pub skipped: u64,
    /// Candidates cancelled.
    pub cancelled: u64,
    /// Candidates failed.
    pub failed: u64,
    /// Batches dispatched.
    pub batches_dispatched: u64,
    /// Batches completed (ok or not).
    pub batches: u64,
    /// Batches completed with `ok == false`.
    pub batches_failed: u64,
    /// Blocks reported by completed batches.
    pub blocks: u64,
    /// Bytes reported by completed batches.
    pub bytes: u64,
    /// Engine time reported by completed batches, ns.
    pub elapsed_ns: u64,
}

impl DirectionTotals {
    /// All-zero totals for `direction` (nothing seen yet).
    pub fn new(direction: Direction) -> Self {
        DirectionTotals {
            direction,
            planned: 0,
            promoted: 0,
            completed: 0,
            completed_blocks: 0,
            skipped: 0,
            cancelled: 0,
            failed: 0,
            batches_dispatched: 0,
            batches: 0,
            batches_failed: 0,
            blocks: 0,
            bytes: 0,
            elapsed_ns: 0,
        }
    }
}

/// A call paused at a breakpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PausedCall {
    /// Breakpoint id.
    pub breakpoint: u64,
    /// The paused entry point.
    pub entry: EntryPoint,
    /// The request, where there is one.
    pub request: Option<RequestId>,
    /// When it paused.
    pub hit_ns: u64,
    /// When it resumes by itself.
    pub deadline_ns: u64,
    /// Sequence number of the hit.
    pub seq: u64,
}

/// Breakpoint activity.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BreakpointStats {
    /// Hits.
    pub hits: u64,
    /// Resumes, whatever the cause.
    pub resumed: u64,
    /// Resumes by cause, in the order of [`BreakpointStats::CAUSES`].
    pub resumed_by_cause: [u64; 5],
}

impl BreakpointStats {
    /// The causes, in the order of `resumed_by_cause`.
    pub const CAUSES: [ResumeCause; 5] = [
        ResumeCause::Resume,
        ResumeCause::Step,
        ResumeCause::Deadline,
        ResumeCause::Cleared,
        ResumeCause::ClientGone,
    ];

    /// Resumes with this cause.
    pub fn resumed_by(&self, cause: ResumeCause) -> u64 {
        self.resumed_by_cause[cause_index(cause)]
    }
}

pub(super) fn cause_index(cause: ResumeCause) -> usize {
    match cause {
        ResumeCause::Resume => 0,
        ResumeCause::Step => 1,
        ResumeCause::Deadline => 2,
        ResumeCause::Cleared => 3,
        ResumeCause::ClientGone => 4,
    }
}

/// What the envelopes said.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamStats {
    /// The engine this state describes (fixed by the first event).
    pub engine: Option<u32>,
    /// Events applied.
    pub events: u64,
    /// Sequence number of the first event applied.
    pub first_seq: Option<u64>,
    /// Sequence number of the last event applied.
    pub last_seq: Option<u64>,
    /// Largest timestamp seen, ns.
    pub last_ts_ns: u64,
    /// Largest scheduler iteration seen.
    pub iteration: u64,
    /// Events missing from the sequence (sum of the holes' sizes).
    pub seq_gaps: u64,
    /// Holes in the sequence.
    pub gaps: u64,
    /// Events skipped because their `seq` was not above the last one
    /// (duplicates, out of order).
    pub stale: u64,
    /// Events skipped because another engine emitted them.
    pub foreign_engine: u64,
    /// Events whose timestamp was below the largest seen (applied).
    pub ts_regressions: u64,
}

/// Events that contradicted the state. All zero for a well-formed stream
/// that was followed from its start; each is counted, never a panic.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inconsistencies {
    /// `SlotTransition.from` was not the slot's current state.
    pub slot_from_mismatch: u64,
    /// A slot event named a request with no slot.
    pub unknown_slot: u64,
    /// A slot event had no request.
    pub missing_request: u64,
    /// `SlotCreated` for a request whose slot is live.
    pub duplicate_slot: u64,
    /// A slot reached `Finished` with transfers in flight.
    pub finished_with_outstanding: u64,
    /// `BlocksReleased` took a slot's count below zero.
    pub blocks_underflow: u64,
    /// A transfer event named a candidate not in flight.
    pub unknown_transfer: u64,
    /// `TransferPlanned` for a candidate already in flight.
    pub duplicate_transfer: u64,
    /// A transfer event's direction differed from the planned one.
    pub transfer_direction_mismatch: u64,
    /// `BatchCompleted` for a batch not in flight.
    pub unknown_batch: u64,
    /// `BatchDispatched` for a batch already in flight.
    pub duplicate_batch: u64,
    /// A new (non-duplicate) registration of a hash already registered.
    pub register_already_registered: u64,
    /// An eviction of a hash not registered.
    pub evict_unregistered: u64,
    /// `Resumed` for a breakpoint with nothing paused.
    pub unmatched_resume: u64,
}

impl Inconsistencies {
    /// The sum of all counters.
    pub fn total(&self) -> u64 {
        let Inconsistencies {
            slot_from_mismatch,
            unknown_slot,
            missing_request,
            duplicate_slot,
            finished_with_outstanding,
            blocks_underflow,
            unknown_transfer,
            duplicate_transfer,
            transfer_direction_mismatch,
            unknown_batch,
            duplicate_batch,
            register_already_registered,
            evict_unregistered,
            unmatched_resume,
        } = self;
        [
            slot_from_mismatch,
            unknown_slot,
            missing_request,
            duplicate_slot,
            finished_with_outstanding,
            blocks_underflow,
            unknown_transfer,
            duplicate_transfer,
            transfer_direction_mismatch,
            unknown_batch,
            duplicate_batch,
            register_already_registered,
            evict_unregistered,
            unmatched_resume,
        ]
        .into_iter()
        .fold(0u64, |a, b| a.saturating_add(*b))
    }
}
