//! The reducer: `state = fold(events)`.
//!
//! [`EngineState`] rebuilds every slot, pool, in-flight transfer, batch and
//! paused call of one engine from its event stream alone. It is the single
//! model behind everything that looks at an engine — the live console, replay
//! of a recorded log, the recorder's snapshots and the test that checks the
//! engine against its own events — so that what is seen live is what is seen
//! in replay, bit for bit (docs/ARCHITECTURE.md, "How an event travels
//! from the leader to the screen").
//!
//! # Properties
//!
//! - **A left fold.** [`EngineState::apply`] is the only way events change the
//!   state, and it depends on nothing but the state and the event. So
//!   `fold(a ++ b)` equals `fold(a)` followed by applying `b`: a replay may
//!   start from a snapshot (the state is `serde`-serialisable) and go on.
//! - **Total.** No input panics. An event that contradicts the state (a
//!   transition from a state the slot is not in, a release of more blocks
//!   than the slot holds, a completion of an unknown transfer, …) is applied
//!   as far as it makes sense and counted in [`Inconsistencies`]; a CI replay
//!   asserts that [`Inconsistencies::total`] is zero.
//! - **No silent loss.** A hole in the sequence numbers adds the number of
//!   missing events to [`StreamStats::seq_gaps`].
//! - **Bounded per slot.** Per-slot history and the ring of recent transfers
//!   have fixed caps ([`Limits`]) with counters of what was dropped. Finished
//!   slots are kept (the console shows them for a while) until the owner
//!   prunes them ([`EngineState::retain_finished_since`],
//!   [`EngineState::prune_finished`]).
//!
//! # Semantics, event by event
//!
//! Every event first goes through the envelope check:
//!
//! - The first event fixes the engine id. Events from another engine are
//!   counted in [`StreamStats::foreign_engine`] and skipped: one state
//!   describes one engine, and mixing sequence numbers would make gap
//!   counting meaningless (fold one state per engine instead).
//! - After the first event, `seq == last_seq + 1` is expected. A jump adds the
//!   missing count to [`StreamStats::seq_gaps`] and the event is applied. A
//!   `seq <= last_seq` is counted in [`StreamStats::stale`] and **skipped**:
//!   the emitter assigns and publishes sequence numbers under one lock, so a
//!   non-increasing number can only be a second delivery (an overlapping
//!   backfill, a reconnect), and applying it twice would double its counters.
//! - `last_ts_ns` and `iteration` are the largest seen; a timestamp going
//!   backwards is counted in [`StreamStats::ts_regressions`].
//! - Each applied event is counted under its [`EventKind::name`].
//!
//! Then, by kind:
//!
//! - `SlotCreated` (request set): a new [`SlotView`] in
//!   [`SlotState::Initialized`], its history starting with that state. A
//!   second creation for a live (not `Finished`) slot is an inconsistency; a
//!   request id reused after `Finished` starts a fresh slot.
//! - `SlotTransition {from, to}`: the slot's state becomes `to`. If `from` is
//!   not the reducer's current state, an inconsistency is counted and `to` is
//!   still applied. A transition to the state the slot is already in (the
//!   emitter may re-announce `Decoding` each step) continues the current
//!   interval: `state_since_ns` and the history do not change, only
//!   `transitions` grows. Reaching `Finished` with transfers still
//!   outstanding is an inconsistency (a slot drains before it finishes).
//! - `MatchResult {tier, ..}`: the tier's lookup counters grow (every
//!   lookup counts there, so a request asked on every step while it waits
//!   counts once per ask). With a request and the device tier, the slot's
//!   `hit_tokens[G1]` becomes `hit_tokens`: what the engine's own cache
//!   gave its latest lookup. A host or disk result does not change the
//!   slot: see *Per-request hits* below. A host or disk result that hit
//!   teaches the reducer the block size (`hit_tokens / hit_blocks`) if no
//!   `PrefixLookup` did.
//! - `BlocksAllocated {tier, blocks}`: the tier's allocation counter grows;
//!   with a request, the slot's `blocks[tier] += blocks.len()`.
//! - `BlocksReleased {tier, count}`: likewise; the slot's count saturates at
//!   zero and going below zero is an inconsistency.
//! - `BlockRegistered {tier, sequence_hash, duplicate_of}`: counted; when
//!   `duplicate_of` is `None` the hash joins the tier's registered set (a
//!   duplicate resolves to its primary, which is registered already).
//! - `BlockEvicted {tier, sequence_hash}`: the hash leaves the registered set;
//!   evictions are counted per tier.
//! - `PoolGauge`: the tier's four gauges are replaced.
//! - `TransferPlanned`: a [`TransferView`] in `PendingEvaluation`, owned by the
//!   event's request; `TransferPromoted` → `Promoted` (blocks updated);
//!   `TransferCompleted`, `TransferSkipped`, `TransferCancelled` and
//!   `TransferFailed` are terminal: the transfer leaves the in-flight map for
//!   the bounded ring of recent transfers, with its latency (terminal time −
//!   planned time). A slot's `outstanding` is the number of its transfers in
//!   flight (kept exact even when the slot is created after its transfer was
//!   planned, or re-created). Per-direction totals count every step.
//! - `BatchDispatched`: an in-flight [`BatchView`]; its transfers remember
//!   their batch. `BatchCompleted` removes it and adds to the direction's
//!   totals (batches, failed batches, blocks, bytes, engine time).
//! - `TokensScheduled {prefill, decode, computed}` (request set): the slot's
//!   `computed` is replaced, `prefilled` and `generated` grow, and the first
//!   event with `decode > 0` sets `first_token_ns` (TTFT = that − created).
//! - `BreakpointHit`: a [`PausedCall`] appears under its breakpoint.
//!   `Resumed {breakpoint, ..}` removes the oldest paused call of that
//!   breakpoint — the oldest one of the event's request when the event names
//!   one that is paused there. A resume with nothing paused is an
//!   inconsistency.
//! - `HookCall`: counted per entry point and phase.
//! - `PrefixLookup`: counted; its `block_size` becomes the block size used
//!   to turn loaded blocks into hit tokens. Nothing else changes (the
//!   recorder's capacity analysis reads the hashes it carries).
//! - `ExternalHit {tokens, ..}` (request set): the slot's `external_tokens`
//!   grows: tokens another connector provided, counted in its total hits.
//!
//! # Per-request hits
//!
//! A slot's `hit_tokens[G2]` and `hit_tokens[G3]` are the tokens actually
//! **loaded** for the request from that tier: each `TransferCompleted` of a
//! transfer planned for the request into the device (`G2→G1`, `G3→G1`) adds
//! its blocks × the block size to the tier it was read from, over the
//! slot's whole life (a request loaded again after a preemption got both
//! loads). A disk block loaded through the host (`G3→G2`, then `G2→G1`) is
//! a disk hit: the blocks a request's `G3→G2` hop completed are claimed by
//! the next `G2→G1` transfer planned for that request, whose completion
//! credits that many blocks (at most) to G3 and the rest to G2; what no
//! such transfer claims is forgotten when the request's next load is
//! staged or begins (`OnboardStaged`, `Onboarding`) or it finishes.
//! `hit_tokens[G1]` is the latest lookup's device hit (above).
//!
//! Why loads and not lookups: a request is looked up on every scheduling
//! attempt (vLLM asks its connector again each step while the request
//! waits, and after a preemption), the results of one attempt arrive in
//! whatever order the engine emits them (kvbm's vLLM connector emitted its
//! host result before vLLM's device one; the simulator the other way
//! round), and nothing in a `MatchResult` says which attempt it belongs to
//! — so any rule that keeps "the latest lookup" per tier can pair one
//! attempt's device result with another's host result, and did (issue
//! 40: every request of a vLLM session showed no G2 hit while the Pools
//! view gave G2 an 86.5% hit rate). A completed load is one event, owned by its request, and it
//! is what the request got: the per-request figures then add up to the
//! `X→G1` blocks moved, whatever the order or number of the lookups. A
//! lookup that is never loaded (the request aborted, the load failed or
//! was skipped) is no hit. Loaded blocks are converted with the block size
//! known when the load completes; a stream that never said it (no
//! `PrefixLookup` and no host or disk hit) credits nothing.
//!
//! An event that needs a slot (transition, tokens, or a per-request
//! match/allocation/release) and names a request with no slot counts as
//! [`Inconsistencies::unknown_slot`]; its global effects still apply. A slot
//! event without a request counts as [`Inconsistencies::missing_request`].
//!
//! # Use
//!
//! ```
//! use kvbm_events::{Event, EventKind};
//! use kvbm_events::reducer::{EngineState, fold};
//! use kvbm_events::slot::SlotState;
//!
//! let ev = |seq: u64, kind| Event {
//!     engine: 0,
//!     seq,
//!     ts_ns: seq * 1_000,
//!     iteration: 0,
//!     request: Some("req-1".into()),
//!     kind,
//! };
//! let events = [
//!     ev(0, EventKind::SlotCreated { prompt_tokens: 32, max_output_tokens: 8 }),
//!     ev(1, EventKind::SlotTransition { from: SlotState::Initialized, to: SlotState::Prefilling }),
//! ];
//! // Batch (replay from the start of a log)…
//! let state = fold(&events);
//! assert_eq!(state.slot("req-1").map(|s| s.state), Some(SlotState::Prefilling));
//! // …or incremental (live, or replay from a snapshot): the same state.
//! let mut live = EngineState::new();
//! for e in &events {
//!     live.apply(e);
//! }
//! assert_eq!(live, state);
//! assert_eq!((state.seq_gaps(), state.inconsistencies().total()), (0, 0));
//! ```
//!
//! # Cost
//!
//! Applying an event is a few hash-map or B-tree look-ups; the common events
//! allocate nothing (kind counts are a fixed array, request ids are shared
//! `Arc`s, histories are bounded ring buffers that reuse their storage).
//! Allocation happens on creation: a slot, a transfer, a batch's id list, a
//! skip reason or error string, a newly registered hash.

use crate::event::KindTag;
use crate::hash::SequenceHash;
use crate::slot::SlotState;
use crate::tier::{BlockId, Tier};
use crate::{Direction, EntryPoint, Event, EventKind, HookPhase, RequestId, ResumeCause};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fmt;

mod views;

use views::cause_index;
pub use views::{
    BatchView, BreakpointStats, DirectionTotals, Inconsistencies, PausedCall, PoolView, SlotView,
    StreamStats, TransferState, TransferView,
};

/// Default cap on the history kept per slot.
pub const DEFAULT_HISTORY_PER_SLOT: usize = 256;
/// Default cap on the ring of recent (terminal) transfers.
pub const DEFAULT_RECENT_TRANSFERS: usize = 1024;

/// Caps on what the reducer keeps beyond the live state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Entries of `(ts_ns, state)` kept per slot; older ones are dropped and
    /// counted in [`SlotView::history_dropped`].
    pub history_per_slot: usize,
    /// Terminal transfers kept in the recent ring; older ones are dropped and
    /// counted ([`EngineState::recent_dropped`]).
    pub recent_transfers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            history_per_slot: DEFAULT_HISTORY_PER_SLOT,
            recent_transfers: DEFAULT_RECENT_TRANSFERS,
        }
    }
}

fn entry_index(entry: EntryPoint) -> usize {
    // `EntryPoint::ALL` lists every entry point, so this always finds one;
    // the fallback only keeps the function total.
    EntryPoint::ALL
        .iter()
        .position(|e| *e == entry)
        .unwrap_or(0)
}

fn phase_index(phase: HookPhase) -> usize {
    match phase {
        HookPhase::Will => 0,
        HookPhase::Finished => 1,
    }
}

/// Pushes onto a bounded ring, dropping (and counting) from the front.
fn push_bounded<T>(ring: &mut VecDeque<T>, dropped: &mut u64, item: T, cap: usize) {
    if cap == 0 {
        *dropped += 1;
        return;
    }
    while ring.len() >= cap {
        ring.pop_front();
        *dropped += 1;
    }
    ring.push_back(item);
}

fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The state of one engine, rebuilt from its events. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineState {
    limits: Limits,
    stream: StreamStats,
    kinds: [u64; KindTag::COUNT],
    slots: HashMap<RequestId, SlotView>,
    pruned_slots: u64,
    // In-flight transfers per request, kept beside the slots so a slot's
    // `outstanding` stays exact even when the slot is (re)created after its
    // transfers were planned.
    outstanding: HashMap<RequestId, u32>,
    pools: [PoolView; 3],
    in_flight: BTreeMap<u64, TransferView>,
    recent: VecDeque<TransferView>,
    recent_dropped: u64,
    batches: BTreeMap<u64, BatchView>,
    // Sorted by direction; at most nine entries, so a vector beats a map
    // and serialises without non-string keys.
    directions: Vec<DirectionTotals>,
    paused: BTreeMap<u64, VecDeque<PausedCall>>,
    breakpoints: BreakpointStats,
    // Indexed by position in `EntryPoint::ALL`, so a new entry point only
    // grows the array.
    hooks: [[u64; 2]; EntryPoint::ALL.len()],
    inconsistencies: Inconsistencies,
    // Tokens per block, once the stream said (0 until then): turns loaded
    // blocks into per-request hit tokens (module docs, *Per-request hits*).
    #[serde(default)]
    block_size: u32,
    // Blocks a request's G3 → G2 hops brought to the host and no G2 → G1
    // transfer of that request has claimed yet.
    #[serde(default)]
    via_host: HashMap<RequestId, u32>,
    // In-flight G2 → G1 transfers that carry blocks read from disk (through
    // the host), and how many.
    #[serde(default)]
    from_disk: BTreeMap<u64, u32>,
}

impl Default for EngineState {
    fn default() -> Self {
        Self::with_limits(Limits::default())
    }
}

/// Folds events into a fresh state with default limits.
pub fn fold<'a>(events: impl IntoIterator<Item = &'a Event>) -> EngineState {
    let mut state = EngineState::default();
    state.apply_all(events);
    state
}

impl EngineState {
    /// An empty state with default limits.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty state with these limits.
    pub fn with_limits(limits: Limits) -> Self {
        EngineState {
            limits,
            stream: StreamStats::default(),
            kinds: [0; KindTag::COUNT],
            slots: HashMap::new(),
            pruned_slots: 0,
            outstanding: HashMap::new(),
            pools: Tier::ALL.map(PoolView::new),
            in_flight: BTreeMap::new(),
            recent: VecDeque::new(),
            recent_dropped: 0,
            batches: BTreeMap::new(),
            directions: Vec::new(),
            paused: BTreeMap::new(),
            breakpoints: BreakpointStats::default(),
            hooks: [[0; 2]; EntryPoint::ALL.len()],
            inconsistencies: Inconsistencies::default(),
            block_size: 0,
            via_host: HashMap::new(),
            from_disk: BTreeMap::new(),
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Applies events in order.
    pub fn apply_all<'a>(&mut self, events: impl IntoIterator<Item = &'a Event>) {
        for ev in events {
            self.apply(ev);
        }
    }

    /// Applies one event. Never panics; see the module docs for what each
    /// kind does and what is counted as an inconsistency.
    pub fn apply(&mut self, ev: &Event) {
        if !self.accept(ev) {
            return;
        }
        self.kinds[ev.kind.tag().index()] += 1;
        let ts = ev.ts_ns;
        let req = ev.request.as_ref();
        match &ev.kind {
            EventKind::SlotCreated {
                prompt_tokens,
                max_output_tokens,
            } => self.slot_created(req, ts, *prompt_tokens, *max_output_tokens),
            EventKind::SlotTransition { from, to } => self.slot_transition(req, ts, *from, *to),
            EventKind::MatchResult {
                tier,
                looked_up,
                hit_blocks,
                hit_tokens,
            } => self.match_result(req, ts, *tier, *looked_up, *hit_blocks, *hit_tokens),
            EventKind::BlocksAllocated { tier, blocks } => {
                self.pools[tier.index()].allocated_blocks += blocks.len() as u64;
                if let Some(slot) = self.request_slot(req, ts) {
                    let held = &mut slot.blocks[tier.index()];
                    *held = held.saturating_add(len_u32(blocks.len()));
                }
            }
            EventKind::BlocksReleased { tier, count } => {
                self.blocks_released(req, ts, *tier, *count)
            }
            EventKind::BlockRegistered {
                tier,
                sequence_hash,
                duplicate_of,
                ..
            } => self.block_registered(*tier, *sequence_hash, *duplicate_of),
            EventKind::BlockEvicted {
                tier,
                sequence_hash,
                ..
            } => self.block_evicted(*tier, *sequence_hash),
            EventKind::PoolGauge {
                tier,
                capacity,
                active,
                inactive,
                empty,
            } => self.pool_gauge(ts, *tier, *capacity, *active, *inactive, *empty),
            EventKind::TransferPlanned {
                transfer,
                direction,
                blocks,
            } => self.transfer_planned(req, ts, *transfer, *direction, *blocks),
            EventKind::TransferPromoted {
                transfer,
                direction,
                blocks,
            } => self.transfer_promoted(ts, *transfer, *direction, *blocks),
            EventKind::TransferCompleted {
                transfer,
                direction,
                blocks,
            } => self.transfer_completed(ts, *transfer, *direction, *blocks),
            EventKind::TransferSkipped {
                transfer,
                direction,
                reason,
            } => self.transfer_skipped(ts, *transfer, *direction, reason),
            EventKind::TransferCancelled {
                transfer,
                direction,
            } => {
                self.direction_mut(*direction).cancelled += 1;
                self.transfer_ended(ts, *transfer, *direction, TransferState::Cancelled, None);
            }
            EventKind::TransferFailed {
                transfer,
                direction,
                error,
            } => self.transfer_failed(ts, *transfer, *direction, error),
            EventKind::BatchDispatched {
                batch,
                direction,
                transfers,
                blocks,
            } => self.batch_dispatched(ts, *batch, *direction, transfers, *blocks),
            EventKind::BatchCompleted {
                batch,
                direction,
                ok,
                blocks,
                bytes,
                elapsed_ns,
            } => self.batch_completed(*batch, *direction, *ok, *blocks, *bytes, *elapsed_ns),
            EventKind::HookCall { entry, phase } => {
                self.hooks[entry_index(*entry)][phase_index(*phase)] += 1;
            }
            EventKind::BreakpointHit {
                breakpoint,
                entry,
                deadline_ns,
            } => self.breakpoint_hit(req, ts, ev.seq, *breakpoint, *entry, *deadline_ns),
            EventKind::Resumed { breakpoint, cause } => self.resumed(req, *breakpoint, *cause),
            EventKind::TokensScheduled {
                prefill,
                decode,
                computed,
            } => self.tokens_scheduled(req, ts, *prefill, *decode, *computed),
            // What a request looked up is the capacity analysis's input
            // (kvbm-recorder); only the block size is kept here.
            EventKind::PrefixLookup { block_size, .. } => {
                if *block_size > 0 {
                    self.block_size = *block_size;
                }
            }
            EventKind::ExternalHit { tokens, .. } => {
                if let Some(slot) = self.request_slot(req, ts) {
                    slot.external_tokens += u64::from(*tokens);
                }
            }
        }
    }

    /// The envelope check: false when the event must be skipped.
    fn accept(&mut self, ev: &Event) -> bool {
        let s = &mut self.stream;
        match s.engine {
            None => s.engine = Some(ev.engine),
            Some(e) if e != ev.engine => {
                s.foreign_engine += 1;
                return false;
            }
            Some(_) => {}
        }
        match s.last_seq {
            None => s.first_seq = Some(ev.seq),
            Some(last) if ev.seq <= last => {
                s.stale += 1;
                return false;
            }
            Some(last) => {
                let missing = ev.seq - last - 1;
                if missing > 0 {
                    s.seq_gaps = s.seq_gaps.saturating_add(missing);
                    s.gaps += 1;
                }
            }
        }
        s.last_seq = Some(ev.seq);
        if ev.ts_ns < s.last_ts_ns {
            s.ts_regressions += 1;
        } else {
            s.last_ts_ns = ev.ts_ns;
        }
        s.iteration = s.iteration.max(ev.iteration);
        s.events += 1;
        true
    }

    /// The slot an event names, marked as updated at `ts`; counts an
    /// unknown request. `None` without counting when there is no request
    /// (the event is then a global one).
    fn request_slot(&mut self, req: Option<&RequestId>, ts: u64) -> Option<&mut SlotView> {
        let r = req?;
        match self.slots.get_mut(&**r) {
            Some(slot) => {
                slot.updated_ns = ts;
                Some(slot)
            }
            None => {
                self.inconsistencies.unknown_slot += 1;
                None
            }
        }
    }

    fn slot_created(&mut self, req: Option<&RequestId>, ts: u64, prompt: u32, max_out: u32) {
        let Some(r) = req else {
            self.inconsistencies.missing_request += 1;
            return;
        };
        self.via_host.remove(&**r);
        let mut slot = SlotView::new(r.clone(), ts, prompt, max_out, &self.limits);
        slot.outstanding = self.outstanding.get(&**r).copied().unwrap_or(0);
        // Rust 1.85 (the MSRV) has no let chains.
        let replaced_live = self
            .slots
            .insert(r.clone(), slot)
            .is_some_and(|old| !old.state.is_terminal());
        self.inconsistencies.duplicate_slot += u64::from(replaced_live);
    }

    fn slot_transition(
        &mut self,
        req: Option<&RequestId>,
        ts: u64,
        from: SlotState,
        to: SlotState,
    ) {
        if req.is_none() {
            self.inconsistencies.missing_request += 1;
        }
        // A new load is staged or begins (its first G2 → G1 hop is planned
        // between the two; a disk hop only after both), or the request is
        // done: disk blocks brought to the host for an earlier load that no
        // G2 → G1 transfer claimed are not this one's.
        let new_load = matches!(to, SlotState::OnboardStaged(_) | SlotState::Onboarding(_));
        if let Some(r) = req
            && (new_load || to.is_terminal())
        {
            self.via_host.remove(&**r);
        }
        let cap = self.limits.history_per_slot;
        let Some(slot) = self.request_slot(req, ts) else {
            return;
        };
        let mismatch = slot.state != from;
        slot.transitions += 1;
        let mut finished_early = false;
        if slot.state != to {
            slot.state = to;
            slot.state_since_ns = ts;
            slot.record(ts, to, cap);
            finished_early = to.is_terminal() && slot.outstanding > 0;
        }
        self.inconsistencies.slot_from_mismatch += u64::from(mismatch);
        self.inconsistencies.finished_with_outstanding += u64::from(finished_early);
    }

    fn transfer_planned(
        &mut self,
        req: Option<&RequestId>,
        ts: u64,
        id: u64,
        direction: Direction,
        blocks: u32,
    ) {
        self.direction_mut(direction).planned += 1;
        let view = TransferView {
            id,
            request: req.cloned(),
            direction,
            blocks,
            status: TransferState::PendingEvaluation,
            planned_ns: ts,
            updated_ns: ts,
            batch: None,
        };
        if let Some(old) = self.in_flight.insert(id, view) {
            // The old candidate is replaced, not finished: it does not go
            // to the recent ring, but it no longer counts as outstanding.
            self.inconsistencies.duplicate_transfer += 1;
            self.adjust_outstanding(old.request.as_ref(), false);
            self.from_disk.remove(&id);
        }
        self.adjust_outstanding(req, true);
        // The G2 → G1 hop of a disk load: it carries the blocks the
        // request's G3 → G2 hop brought up.
        if direction == Direction::HOST_TO_DEVICE
            && let Some(n) = req.and_then(|r| self.via_host.remove(&**r))
        {
            self.from_disk.insert(id, n.min(blocks));
        }
    }

    fn transfer_ended(
        &mut self,
        ts: u64,
        id: u64,
        direction: Direction,
        status: TransferState,
        blocks: Option<u32>,
    ) {
        let Some(mut t) = self.in_flight.remove(&id) else {
            self.inconsistencies.unknown_transfer += 1;
            return;
        };
        if t.direction != direction {
            self.inconsistencies.transfer_direction_mismatch += 1;
        }
        let from_disk = self.from_disk.remove(&id).unwrap_or(0);
        if matches!(status, TransferState::Completed)
            && let (Some(r), Some(b)) = (t.request.as_ref(), blocks)
        {
            self.loaded(r, t.direction, b, from_disk);
        }
        t.status = status;
        t.updated_ns = ts;
        if let Some(b) = blocks {
            t.blocks = b;
        }
        self.adjust_outstanding(t.request.as_ref(), false);
        push_bounded(
            &mut self.recent,
            &mut self.recent_dropped,
            t,
            self.limits.recent_transfers,
        );
    }

    /// A transfer of `request` completed `blocks` blocks in `direction`, of
    /// which `from_disk` (for a G2 → G1 hop) came from disk: the request's
    /// per-tier hits (module docs, *Per-request hits*).
    fn loaded(&mut self, request: &RequestId, direction: Direction, blocks: u32, from_disk: u32) {
        if direction == Direction::DISK_TO_HOST {
            let n = self.via_host.entry(request.clone()).or_insert(0);
            *n = n.saturating_add(blocks);
            return;
        }
        if direction.dst != Tier::Device || direction.src == Tier::Device {
            return;
        }
        let bs = u64::from(self.block_size);
        let Some(slot) = self.slots.get_mut(&**request) else {
            return;
        };
        let (host, disk) = match direction.src {
            Tier::Disk => (0, blocks),
            _ => {
                let disk = from_disk.min(blocks);
                (blocks - disk, disk)
            }
        };
        for (tier, n) in [(Tier::Host, host), (Tier::Disk, disk)] {
            let h = &mut slot.hit_tokens[tier.index()];
            *h = h.saturating_add(u64::from(n) * bs);
        }
    }

    /// Keeps `outstanding` equal to the number of in-flight transfers per
    /// request, and mirrors it into the request's slot.
    fn adjust_outstanding(&mut self, req: Option<&RequestId>, up: bool) {
        let Some(r) = req else { return };
        let now = match self.outstanding.get_mut(&**r) {
            Some(n) => {
                // Only ever decremented for a transfer that was counted when it
                // entered the in-flight map, so this cannot go below zero.
                *n = if up {
                    n.saturating_add(1)
                } else {
                    n.saturating_sub(1)
                };
                *n
            }
            None if up => {
                self.outstanding.insert(r.clone(), 1);
                1
            }
            None => 0,
        };
        if now == 0 {
            self.outstanding.remove(&**r);
        }
        if let Some(slot) = self.slots.get_mut(&**r) {
            slot.outstanding = now;
        }
    }

    fn resumed(&mut self, req: Option<&RequestId>, breakpoint: u64, cause: ResumeCause) {
        self.breakpoints.resumed += 1;
        self.breakpoints.resumed_by_cause[cause_index(cause)] += 1;
        let Some(queue) = self.paused.get_mut(&breakpoint) else {
            self.inconsistencies.unmatched_resume += 1;
            return;
        };
        let pos = req
            .and_then(|r| {
                queue
                    .iter()
                    .position(|p| p.request.as_deref() == Some(&**r))
            })
            .unwrap_or(0);
        queue.remove(pos);
        // Empty queues are removed so equal histories give equal states.
        if queue.is_empty() {
            self.paused.remove(&breakpoint);
        }
    }

    /// A prefix lookup on one tier: its pool's hit counters, the block size
    /// (learned from the first host or disk hit) and the slot's G1 hits.
    fn match_result(
        &mut self,
        req: Option<&RequestId>,
        ts: u64,
        tier: Tier,
        looked_up: u32,
        hit_blocks: u32,
        hit_tokens: u32,
    ) {
        let pool = &mut self.pools[tier.index()];
        pool.lookups += 1;
        pool.looked_up_blocks += u64::from(looked_up);
        pool.hit_blocks += u64::from(hit_blocks);
        pool.hit_tokens += u64::from(hit_tokens);
        let learns = tier != Tier::Device
            && self.block_size == 0
            && hit_blocks > 0
            && hit_tokens.is_multiple_of(hit_blocks);
        if learns {
            self.block_size = hit_tokens / hit_blocks;
        }
        // Host and disk hits are credited when they are loaded
        // (module docs, *Per-request hits*).
        if let Some(slot) = self.request_slot(req, ts)
            && tier == Tier::Device
        {
            slot.hit_tokens[Tier::Device.index()] = u64::from(hit_tokens);
        }
    }

    /// A request let go of blocks: its pool's count and what the slot
    /// holds, counting a release of more than it held.
    fn blocks_released(&mut self, req: Option<&RequestId>, ts: u64, tier: Tier, count: u32) {
        self.pools[tier.index()].released_blocks += u64::from(count);
        let underflow = self.request_slot(req, ts).is_some_and(|slot| {
            let held = &mut slot.blocks[tier.index()];
            let under = count > *held;
            *held = held.saturating_sub(count);
            under
        });
        self.inconsistencies.blocks_underflow += u64::from(underflow);
    }

    /// A block registered under a hash: a primary registration adds the
    /// hash to its pool's registered set.
    fn block_registered(
        &mut self,
        tier: Tier,
        sequence_hash: SequenceHash,
        duplicate_of: Option<BlockId>,
    ) {
        let pool = &mut self.pools[tier.index()];
        pool.registrations += 1;
        if duplicate_of.is_some() {
            pool.duplicate_registrations += 1;
        } else if !pool.registered.insert(sequence_hash) {
            self.inconsistencies.register_already_registered += 1;
        }
    }

    /// A block evicted: its hash leaves its pool's registered set.
    fn block_evicted(&mut self, tier: Tier, sequence_hash: SequenceHash) {
        let pool = &mut self.pools[tier.index()];
        pool.evictions += 1;
        if !pool.registered.remove(&sequence_hash) {
            self.inconsistencies.evict_unregistered += 1;
        }
    }

    /// Occupancy of one tier's pool, as last reported.
    fn pool_gauge(
        &mut self,
        ts: u64,
        tier: Tier,
        capacity: u32,
        active: u32,
        inactive: u32,
        empty: u32,
    ) {
        let pool = &mut self.pools[tier.index()];
        pool.capacity = capacity;
        pool.active = active;
        pool.inactive = inactive;
        pool.empty = empty;
        pool.gauge_ns = Some(ts);
    }

    /// A candidate committed: the in-flight transfer becomes Promoted.
    fn transfer_promoted(&mut self, ts: u64, transfer: u64, direction: Direction, blocks: u32) {
        self.direction_mut(direction).promoted += 1;
        match self.in_flight.get_mut(&transfer) {
            Some(t) => {
                if t.direction != direction {
                    self.inconsistencies.transfer_direction_mismatch += 1;
                }
                t.status = TransferState::Promoted;
                t.blocks = blocks;
                t.updated_ns = ts;
            }
            None => self.inconsistencies.unknown_transfer += 1,
        }
    }

    /// A candidate's blocks arrived: its direction's totals count them,
    /// and the transfer ends Completed.
    fn transfer_completed(&mut self, ts: u64, transfer: u64, direction: Direction, blocks: u32) {
        let totals = self.direction_mut(direction);
        totals.completed += 1;
        totals.completed_blocks += u64::from(blocks);
        self.transfer_ended(
            ts,
            transfer,
            direction,
            TransferState::Completed,
            Some(blocks),
        );
    }

    /// A candidate skipped: the transfer ends Skipped, with the reason.
    fn transfer_skipped(&mut self, ts: u64, transfer: u64, direction: Direction, reason: &str) {
        self.direction_mut(direction).skipped += 1;
        let status = TransferState::Skipped(reason.to_owned());
        self.transfer_ended(ts, transfer, direction, status, None);
    }

    /// A candidate's copy failed: the transfer ends Failed, with the error.
    fn transfer_failed(&mut self, ts: u64, transfer: u64, direction: Direction, error: &str) {
        self.direction_mut(direction).failed += 1;
        let status = TransferState::Failed(error.to_owned());
        self.transfer_ended(ts, transfer, direction, status, None);
    }

    /// A batch dispatched: its transfers are marked with it, and it is in
    /// flight until it completes.
    fn batch_dispatched(
        &mut self,
        ts: u64,
        batch: u64,
        direction: Direction,
        transfers: &[u64],
        blocks: u32,
    ) {
        self.direction_mut(direction).batches_dispatched += 1;
        for id in transfers {
            if let Some(t) = self.in_flight.get_mut(id) {
                t.batch = Some(batch);
            }
        }
        let view = BatchView {
            id: batch,
            direction,
            transfers: transfers.to_vec(),
            blocks,
            dispatched_ns: ts,
        };
        if self.batches.insert(batch, view).is_some() {
            self.inconsistencies.duplicate_batch += 1;
        }
    }

    /// A batch finished: it leaves the in-flight batches, and its
    /// direction's totals count it.
    fn batch_completed(
        &mut self,
        batch: u64,
        direction: Direction,
        ok: bool,
        blocks: u32,
        bytes: u64,
        elapsed_ns: u64,
    ) {
        if self.batches.remove(&batch).is_none() {
            self.inconsistencies.unknown_batch += 1;
        }
        let totals = self.direction_mut(direction);
        totals.batches += 1;
        totals.batches_failed += u64::from(!ok);
        totals.blocks += u64::from(blocks);
        totals.bytes = totals.bytes.saturating_add(bytes);
        totals.elapsed_ns = totals.elapsed_ns.saturating_add(elapsed_ns);
    }

    /// A breakpoint paused a call: the call joins the breakpoint's queue.
    fn breakpoint_hit(
        &mut self,
        req: Option<&RequestId>,
        ts: u64,
        seq: u64,
        breakpoint: u64,
        entry: EntryPoint,
        deadline_ns: u64,
    ) {
        self.breakpoints.hits += 1;
        self.paused
            .entry(breakpoint)
            .or_default()
            .push_back(PausedCall {
                breakpoint,
                entry,
                request: req.cloned(),
                hit_ns: ts,
                deadline_ns,
                seq,
            });
    }

    /// What the scheduler ran for a request: the slot's token counts, and
    /// its first token's time.
    fn tokens_scheduled(
        &mut self,
        req: Option<&RequestId>,
        ts: u64,
        prefill: u32,
        decode: u32,
        computed: u32,
    ) {
        if req.is_none() {
            self.inconsistencies.missing_request += 1;
        }
        if let Some(slot) = self.request_slot(req, ts) {
            slot.computed = computed;
            slot.prefilled += u64::from(prefill);
            slot.generated += u64::from(decode);
            if decode > 0 && slot.first_token_ns.is_none() {
                slot.first_token_ns = Some(ts);
            }
        }
    }

    fn direction_mut(&mut self, direction: Direction) -> &mut DirectionTotals {
        let i = match self
            .directions
            .binary_search_by_key(&direction, |d| d.direction)
        {
            Ok(i) => i,
            Err(i) => {
                self.directions.insert(i, DirectionTotals::new(direction));
                i
            }
        };
        &mut self.directions[i]
    }

    // ---- queries -------------------------------------------------------

    /// What the envelopes said: engine, sequence, gaps, time, iteration.
    pub fn stream(&self) -> &StreamStats {
        &self.stream
    }

    /// The engine id, once an event was applied.
    pub fn engine(&self) -> Option<u32> {
        self.stream.engine
    }

    /// The last sequence number applied.
    pub fn last_seq(&self) -> Option<u64> {
        self.stream.last_seq
    }

    /// The largest timestamp seen.
    pub fn last_ts_ns(&self) -> u64 {
        self.stream.last_ts_ns
    }

    /// The largest iteration seen.
    pub fn iteration(&self) -> u64 {
        self.stream.iteration
    }

    /// Events missing from the sequence.
    pub fn seq_gaps(&self) -> u64 {
        self.stream.seq_gaps
    }

    /// The block size the stream said (`PrefixLookup`, or a host or disk
    /// hit), 0 until it did.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Contradictions found so far.
    pub fn inconsistencies(&self) -> &Inconsistencies {
        &self.inconsistencies
    }

    /// Events applied, per kind, in the vocabulary's order (zeros included).
    pub fn counts_by_kind(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        KindTag::ALL
            .iter()
            .map(|k| k.name())
            .zip(self.kinds.iter().copied())
    }

    /// Events applied of the kind with this [`EventKind::name`] (0 for an
    /// unknown name).
    pub fn count_of(&self, kind: &str) -> u64 {
        KindTag::from_name(kind).map_or(0, |k| self.kinds[k.index()])
    }

    /// One slot.
    pub fn slot(&self, request: &str) -> Option<&SlotView> {
        self.slots.get(request)
    }

    /// Every kept slot, in no particular order.
    pub fn slots(&self) -> impl Iterator<Item = &SlotView> {
        self.slots.values()
    }

    /// Every kept slot, oldest first (ties by request id): a stable order for
    /// tables and text output.
    pub fn slots_sorted(&self) -> Vec<&SlotView> {
        let mut v: Vec<&SlotView> = self.slots.values().collect();
        v.sort_unstable_by(|a, b| (a.created_ns, &a.request).cmp(&(b.created_ns, &b.request)));
        v
    }

    /// Number of kept slots.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Each kept slot's state, by request id (for comparing with the engine).
    pub fn slot_states(&self) -> BTreeMap<String, SlotState> {
        self.slots
            .iter()
            .map(|(r, s)| (r.to_string(), s.state))
            .collect()
    }

    /// Number of kept slots in each state, by [`SlotState::name`], in
    /// lifecycle order (zeros included).
    pub fn state_counts(&self) -> [(&'static str, usize); 10] {
        let mut out = SlotState::NAMES.map(|n| (n, 0usize));
        for s in self.slots.values() {
            let name = s.state.name();
            if let Some(e) = out.iter_mut().find(|(n, _)| *n == name) {
                e.1 += 1;
            }
        }
        out
    }

    /// Finished slots dropped by pruning so far.
    pub fn pruned_slots(&self) -> u64 {
        self.pruned_slots
    }

    /// Drops `Finished` slots that finished before `cutoff_ns`; returns how
    /// many. The state then no longer equals a plain fold of the same events
    /// (that is what [`pruned_slots`](Self::pruned_slots) records), so a
    /// consumer that compares states prunes at the same points or not at all.
    pub fn retain_finished_since(&mut self, cutoff_ns: u64) -> usize {
        let before = self.slots.len();
        self.slots
            .retain(|_, s| !(s.state.is_terminal() && s.state_since_ns < cutoff_ns));
        let pruned = before - self.slots.len();
        self.pruned_slots += pruned as u64;
        pruned
    }

    /// Keeps only the `keep` most recently finished `Finished` slots; returns
    /// how many were dropped.
    pub fn prune_finished(&mut self, keep: usize) -> usize {
        let mut finished: Vec<(u64, RequestId)> = self
            .slots
            .values()
            .filter(|s| s.state.is_terminal())
            .map(|s| (s.state_since_ns, s.request.clone()))
            .collect();
        if finished.len() <= keep {
            return 0;
        }
        finished.sort_unstable();
        let drop = finished.len() - keep;
        for (_, r) in &finished[..drop] {
            self.slots.remove(&**r);
        }
        self.pruned_slots += drop as u64;
        drop
    }

    /// The three pools, indexed by [`Tier::index`].
    pub fn pools(&self) -> &[PoolView; 3] {
        &self.pools
    }

    /// One tier's pool.
    pub fn pool(&self, tier: Tier) -> &PoolView {
        &self.pools[tier.index()]
    }

    /// The sequence hashes registered in a tier.
    pub fn registered(&self, tier: Tier) -> &HashSet<SequenceHash> {
        &self.pools[tier.index()].registered
    }

    /// In-flight transfers, by id.
    pub fn in_flight(&self) -> impl DoubleEndedIterator<Item = &TransferView> {
        self.in_flight.values()
    }

    /// Number of in-flight transfers.
    pub fn in_flight_count(&self) -> usize {
        self.in_flight.len()
    }

    /// The ids of the in-flight transfers.
    pub fn in_flight_ids(&self) -> BTreeSet<u64> {
        self.in_flight.keys().copied().collect()
    }

    /// One in-flight transfer.
    pub fn transfer(&self, id: u64) -> Option<&TransferView> {
        self.in_flight.get(&id)
    }

    /// Recently ended transfers, oldest first.
    pub fn recent(&self) -> impl DoubleEndedIterator<Item = &TransferView> + ExactSizeIterator {
        self.recent.iter()
    }

    /// Ended transfers dropped from the recent ring.
    pub fn recent_dropped(&self) -> u64 {
        self.recent_dropped
    }

    /// Batches in flight, by id.
    pub fn batches_in_flight(&self) -> impl DoubleEndedIterator<Item = &BatchView> {
        self.batches.values()
    }

    /// Totals per direction, in direction order (only directions seen).
    pub fn direction_totals(&self) -> &[DirectionTotals] {
        &self.directions
    }

    /// Totals for one direction, if it was seen.
    pub fn direction(&self, direction: Direction) -> Option<&DirectionTotals> {
        self.directions
            .binary_search_by_key(&direction, |d| d.direction)
            .ok()
            .map(|i| &self.directions[i])
    }

    /// Calls paused now, by breakpoint then age.
    pub fn paused(&self) -> impl Iterator<Item = &PausedCall> {
        self.paused.values().flatten()
    }

    /// Number of calls paused now.
    pub fn paused_count(&self) -> usize {
        self.paused.values().map(VecDeque::len).sum()
    }

    /// Breakpoint hits and resumes.
    pub fn breakpoints(&self) -> &BreakpointStats {
        &self.breakpoints
    }

    /// Hook calls around one entry point in one phase.
    pub fn hook_calls(&self, entry: EntryPoint, phase: HookPhase) -> u64 {
        self.hooks[entry_index(entry)][phase_index(phase)]
    }

    /// A compact multi-line description, for logs and debugging (the same
    /// text as `Display`).
    pub fn summary(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for EngineState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.stream;
        let engine = s.engine.map_or_else(|| "-".to_string(), |e| e.to_string());
        let seq = match (s.first_seq, s.last_seq) {
            (Some(a), Some(b)) => format!("{a}..={b}"),
            _ => "-".to_string(),
        };
        writeln!(
            f,
            "engine {engine}: {} events, seq {seq}, gaps {} ({} missing), stale {}, foreign {}, ts {}ns, iteration {}",
            s.events, s.gaps, s.seq_gaps, s.stale, s.foreign_engine, s.last_ts_ns, s.iteration
        )?;
        write!(
            f,
            "slots {} (pruned {})",
            self.slots.len(),
            self.pruned_slots
        )?;
        for (name, n) in self.state_counts() {
            if n > 0 {
                write!(f, " {name} {n}")?;
            }
        }
        writeln!(f)?;
        for p in &self.pools {
            writeln!(
                f,
                "{}: cap {} active {} inactive {} empty {} registered {} evictions {} hits {}/{} blocks",
                p.tier.short_name(),
                p.capacity,
                p.active,
                p.inactive,
                p.empty,
                p.registered.len(),
                p.evictions,
                p.hit_blocks,
                p.looked_up_blocks
            )?;
        }
        write!(
            f,
            "transfers in flight {}, recent {} (dropped {}), batches in flight {}",
            self.in_flight.len(),
            self.recent.len(),
            self.recent_dropped,
            self.batches.len()
        )?;
        for d in &self.directions {
            write!(
                f,
                "; {} planned {} completed {} skipped {} cancelled {} failed {} bytes {}",
                d.direction, d.planned, d.completed, d.skipped, d.cancelled, d.failed, d.bytes
            )?;
        }
        writeln!(f)?;
        write!(
            f,
            "paused {}, breakpoint hits {}, inconsistencies {}",
            self.paused_count(),
            self.breakpoints.hits,
            self.inconsistencies.total()
        )
    }
}

#[cfg(test)]
mod tests;
