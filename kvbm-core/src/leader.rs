//! The scheduler side of the KV connector (the connector's leader) and the
//! worker side that runs its loads and stores.
//!
//! The leader is shaped like vLLM's KV-connector scheduler API: the engine
//! calls [`Leader::create_slot`], [`Leader::get_num_new_matched_tokens`]
//! (how many more prompt tokens the host/disk tiers hold beyond what the
//! device cache already matched), [`Leader::update_state_after_alloc`] (the
//! engine allocated device blocks; loads are planned into them),
//! [`Leader::build_connector_metadata`] once per iteration (slot states
//! follow what the scheduler ran; stores are planned) and
//! [`Leader::request_finished`]. Every planned transfer becomes a
//! *transfer candidate* in an offload/onboard pipeline; its status goes
//! PendingEvaluation → Promoted or Skipped(reason) → Completed, each change
//! an event. A slot in Finishing reaches Finished only when its candidates
//! have drained.
//!
//! Offload modes (as in a CPU-offload connector): **eager** stores every block as soon as a
//! forward pass has computed it (the store waits for that pass: its
//! precondition); **lazy** stores a request's blocks when it finishes, just
//! before they become evictable on the device. With a disk tier, blocks that
//! land on the host are written through to disk.
//!
//! The [`Worker`] binds the metadata, waits for the loads before the
//! forward pass, fires the stores' precondition after it, and reports which
//! requests have finished sending and receiving.

use crate::admission::FrequencySketch;
use crate::block::{Empty, ImmutableBlock, MutableBlock};
use crate::hooks::{HookSet, Verdict};
use crate::offload::{
    OffloadPipeline, PipelineObserver, Precondition, PreconditionTrigger, SourceBlock,
    TransferHandle, TransferStatus, precondition,
};
use crate::pool::{BlockPool, PoolEvent, PoolObserver};
use crate::tokens::{SaltHash, SequenceHash, Token, TokenBlock, TokenSequence};
use crate::transfer::TransferStats;
use kvbm_events::breakpoint::CallInfo;
use kvbm_events::slot::{SlotError, SlotState};
use kvbm_events::tier::Tier;
use kvbm_events::{Direction, Emitter, EntryPoint, EventKind, RequestId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The live slots by request. Looked up several times per running request
/// per step, so hashed fast (the ids are the engine's, not an attacker's).
type Slots = HashMap<RequestId, Slot, foldhash::fast::RandomState>;

/// When device blocks are copied to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum OffloadMode {
    /// Store each block right after the forward pass that computed it.
    #[default]
    Eager,
    /// Store a request's blocks when it finishes.
    Lazy,
    /// Store a block at its N-th hit in G1 (the engine's own prefix
    /// cache), N from 1 to 15: blocks no later request reuses never reach
    /// G2, so a burst of them cannot evict what is shared. Hits are counted
    /// in a [`FrequencySketch`] the size of the tier stored to, which
    /// halves its counts every ten hits per block of that tier (so old
    /// hits fade), and which may count a block early where its hash
    /// collides with hotter ones in every row (never late).
    AfterHits(u32),
}

impl std::fmt::Display for OffloadMode {
    /// `eager`, `lazy`, `after-hits:N`: reads back as the same mode.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OffloadMode::Eager => f.write_str("eager"),
            OffloadMode::Lazy => f.write_str("lazy"),
            OffloadMode::AfterHits(n) => write!(f, "after-hits:{n}"),
        }
    }
}

/// An offload mode that does not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown offload mode `{0}` (known: eager, lazy, after-hits:N with N from 1 to 15)")]
pub struct UnknownOffloadMode(pub String);

impl std::str::FromStr for OffloadMode {
    type Err = UnknownOffloadMode;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "eager" => Ok(OffloadMode::Eager),
            "lazy" => Ok(OffloadMode::Lazy),
            _ => t
                .strip_prefix("after-hits:")
                .and_then(|n| n.parse::<u32>().ok())
                .filter(|n| (1..=15).contains(n))
                .map(OffloadMode::AfterHits)
                .ok_or_else(|| UnknownOffloadMode(s.to_string())),
        }
    }
}

/// Turns pool registrations and evictions into events.
pub struct PoolEvents(pub Arc<Emitter>);

impl PoolObserver for PoolEvents {
    fn on_pool_event(&self, e: &PoolEvent) {
        let kind = match *e {
            PoolEvent::Registered {
                tier,
                block,
                sequence_hash,
                duplicate_of,
            } => EventKind::BlockRegistered {
                tier,
                block,
                sequence_hash,
                duplicate_of,
            },
            PoolEvent::Evicted {
                tier,
                block,
                sequence_hash,
                ..
            } => EventKind::BlockEvicted {
                tier,
                block,
                sequence_hash,
            },
        };
        self.0.emit(None, kind);
    }
}

struct Slot {
    state: SlotState,
    tokens: TokenSequence,
    /// Host/disk blocks found by `get_num_new_matched_tokens`, in prefix
    /// order, held strongly so they cannot be evicted before the load.
    staged: Vec<ImmutableBlock>,
    /// Candidates planned for this slot and not yet final.
    outstanding: u32,
    /// Loads planned by `update_state_after_alloc`, not yet in metadata.
    pending_loads: Vec<LoadOp>,
    /// Its `PrefixLookup` went out (once per slot: the first lookup is the
    /// request's reference in the capacity analysis).
    lookup_emitted: bool,
}

struct Candidate {
    request: Option<RequestId>,
    blocks: u32,
    /// For device → host stores: what to write through to disk once they
    /// land.
    hashes: Vec<SequenceHash>,
}

/// State shared with the pipelines' observers.
struct Shared {
    emitter: Arc<Emitter>,
    slots: Mutex<Slots>,
    /// (direction, container id) → candidate; the lock is held across
    /// enqueue + insert so an observer never sees an unknown container.
    candidates: Mutex<HashMap<(Direction, u64), (u64, Candidate)>>,
    next_transfer: AtomicU64,
    /// Write-through to disk for blocks that reach the host.
    spill: Mutex<Option<Arc<OffloadPipeline>>>,
    host: Option<BlockPool>,
    pending_spills: Mutex<Vec<SequenceHash>>,
    finished: Mutex<Finished>,
    /// Told when the last candidate in flight finishes (a [`Worker`] that
    /// drives its own runtime waits on it in `drain`).
    idle: tokio::sync::Notify,
}

/// Most finished-transfer notifications kept between two `get_finished`
/// calls.
const FINISHED_CAP: usize = 1 << 16;

#[derive(Default)]
struct Finished {
    sending: Vec<RequestId>,
    recving: Vec<RequestId>,
    dropped: u64,
}

/// What `Worker::get_finished` reports.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FinishedTransfers {
    /// Requests with a store that finished since the last call (once per
    /// store).
    pub sending: Vec<RequestId>,
    /// Requests with a load that finished since the last call.
    pub recving: Vec<RequestId>,
    /// Notifications dropped because nobody asked for too long.
    pub dropped: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn transition(
        &self,
        slots: &mut Slots,
        id: &RequestId,
        to: SlotState,
    ) -> Result<(), SlotError> {
        let slot = slots
            .get_mut(id)
            .ok_or_else(|| SlotError::UnknownRequest(id.to_string()))?;
        if slot.state == to && matches!(to, SlotState::Prefilling | SlotState::Decoding) {
            return Ok(()); // staying put is not a transition
        }
        let from = slot.state;
        slot.state = from.check(id, to)?;
        self.emitter
            .emit(Some(id), EventKind::SlotTransition { from, to });
        Ok(())
    }

    /// A candidate reached a final status: drain it from its slot.
    fn candidate_done(&self, request: &Option<RequestId>, direction: Direction) {
        let Some(id) = request else { return };
        {
            let mut f = lock(&self.finished);
            let list = if direction.is_onboard() {
                &mut f.recving
            } else {
                &mut f.sending
            };
            // Bounded: the worker drains it every iteration; an engine that
            // never asks loses only these notifications, and counts them.
            if list.len() < FINISHED_CAP {
                list.push(id.clone());
            } else {
                f.dropped += 1;
            }
        }
        let mut slots = lock(&self.slots);
        let done = match slots.get_mut(id) {
            Some(s) => {
                s.outstanding = s.outstanding.saturating_sub(1);
                s.outstanding == 0 && s.state == SlotState::Finishing
            }
            None => false,
        };
        if done {
            let _ = self.transition(&mut slots, id, SlotState::Finished);
        }
    }
}

struct Observer {
    shared: Arc<Shared>,
    direction: Direction,
}

impl PipelineObserver for Observer {
    fn on_status(&self, container: u64, status: &TransferStatus) {
        let key = (self.direction, container);
        let mut cands = lock(&self.shared.candidates);
        let Some((id, c)) = cands.get(&key) else {
            return;
        };
        let (id, request, blocks) = (*id, c.request.clone(), c.blocks);
        if matches!(status, TransferStatus::Completed { .. })
            && self.direction == Direction::DEVICE_TO_HOST
        {
            lock(&self.shared.pending_spills).extend_from_slice(&c.hashes);
        }
        let d = self.direction;
        let kind = match status {
            TransferStatus::Transferring => EventKind::TransferPromoted {
                transfer: id,
                direction: d,
                blocks,
            },
            TransferStatus::Completed { blocks, .. } => EventKind::TransferCompleted {
                transfer: id,
                direction: d,
                blocks: *blocks as u32,
            },
            TransferStatus::Skipped(r) => EventKind::TransferSkipped {
                transfer: id,
                direction: d,
                reason: r.name().to_string(),
            },
            TransferStatus::Cancelled => EventKind::TransferCancelled {
                transfer: id,
                direction: d,
            },
            TransferStatus::Failed(e) => EventKind::TransferFailed {
                transfer: id,
                direction: d,
                error: e.clone(),
            },
            // Still PendingEvaluation.
            _ => return,
        };
        self.shared.emitter.emit(request.as_ref(), kind);
        if status.is_final() {
            // Drain the slot before the candidate leaves the map: whoever
            // waits for the map to empty (`Worker::drain`) then also sees
            // the slot's last transition. Lock order: candidates, slots.
            self.shared.candidate_done(&request, self.direction);
            cands.remove(&key);
            if cands.is_empty() {
                self.shared.idle.notify_waiters();
            }
        }
        drop(cands);
    }

    fn on_batch_dispatched(&self, batch: u64, containers: &[u64], blocks: usize) {
        let cands = lock(&self.shared.candidates);
        let transfers = containers
            .iter()
            .filter_map(|c| cands.get(&(self.direction, *c)).map(|(id, _)| *id))
            .collect();
        self.shared.emitter.emit(
            None,
            EventKind::BatchDispatched {
                batch,
                direction: self.direction,
                transfers,
                blocks: blocks as u32,
            },
        );
    }

    fn on_batch_completed(&self, batch: u64, result: Result<&TransferStats, &str>) {
        let (ok, blocks, bytes, elapsed_ns) = match result {
            Ok(s) => (true, s.blocks as u32, s.bytes, s.elapsed.as_nanos() as u64),
            Err(_) => (false, 0, 0, 0),
        };
        self.shared.emitter.emit(
            None,
            EventKind::BatchCompleted {
                batch,
                direction: self.direction,
                ok,
                blocks,
                bytes,
                elapsed_ns,
            },
        );
    }
}

/// The pipelines a leader may use; `None` disables a path.
#[derive(Default)]
pub struct Pipelines {
    /// G1 → G2.
    pub offload_device_to_host: Option<Arc<OffloadPipeline>>,
    /// G2 → G3.
    pub offload_host_to_disk: Option<Arc<OffloadPipeline>>,
    /// G2 → G1 (caller-provided destinations).
    pub onboard_host_to_device: Option<Arc<OffloadPipeline>>,
    /// G3 → G2 (pipeline-allocated destinations).
    pub onboard_disk_to_host: Option<Arc<OffloadPipeline>>,
    /// G1 → G3, when there is no host tier to go through.
    pub offload_device_to_disk: Option<Arc<OffloadPipeline>>,
    /// G3 → G1 (caller-provided destinations), when there is no host tier.
    pub onboard_disk_to_device: Option<Arc<OffloadPipeline>>,
}

impl Pipelines {
    /// Every pipeline present.
    fn all(&self) -> impl Iterator<Item = &Arc<OffloadPipeline>> {
        [
            &self.offload_device_to_host,
            &self.offload_host_to_disk,
            &self.onboard_host_to_device,
            &self.onboard_disk_to_host,
            &self.offload_device_to_disk,
            &self.onboard_disk_to_device,
        ]
        .into_iter()
        .flatten()
    }
}

/// Builds the observer a pipeline in `direction` must be created with, so
/// its candidates become events. Call before [`Leader::new`] and pass the
/// same `LeaderWiring` to it.
pub struct LeaderWiring {
    shared: Arc<Shared>,
}

impl LeaderWiring {
    /// Shared state for a leader emitting on `emitter`; `host` is the G2
    /// pool (for disk write-through), if any.
    pub fn new(emitter: Arc<Emitter>, host: Option<BlockPool>) -> Self {
        LeaderWiring {
            shared: Arc::new(Shared {
                emitter,
                slots: Mutex::new(Slots::default()),
                candidates: Mutex::new(HashMap::new()),
                idle: tokio::sync::Notify::new(),
                next_transfer: AtomicU64::new(1),
                spill: Mutex::new(None),
                host,
                pending_spills: Mutex::new(Vec::new()),
                finished: Mutex::new(Finished::default()),
            }),
        }
    }

    /// The observer for a pipeline moving blocks in `direction`.
    pub fn observer(&self, direction: Direction) -> Arc<dyn PipelineObserver> {
        Arc::new(Observer {
            shared: self.shared.clone(),
            direction,
        })
    }
}

/// A load the worker must finish before the request's forward pass.
#[derive(Debug)]
pub struct LoadOp {
    /// The request.
    pub request: RequestId,
    /// Tokens it covers.
    pub tokens: usize,
    /// Blocks coming from the host (first) and from disk (after).
    pub from_host: usize,
    /// Blocks coming from disk through the host.
    pub from_disk: usize,
    /// The G2 → G1 handle for the host part (and, once the disk part is on
    /// the host, its own handle; see [`Worker::start_load_kv`]).
    handle: Option<TransferHandle>,
    /// Disk blocks still to bring to the host first.
    disk_sources: Vec<ImmutableBlock>,
    /// Destinations for the disk part (after the host part's).
    disk_destinations: Vec<MutableBlock<Empty>>,
}

/// What the scheduler ran this iteration, for one request.
#[derive(Debug, Clone)]
pub struct ScheduledRequest {
    /// The request.
    pub request: RequestId,
    /// Prompt tokens computed this iteration.
    pub prefill_tokens: usize,
    /// Tokens generated this iteration.
    pub decode_tokens: usize,
    /// Tokens computed so far, after this iteration.
    pub computed_tokens: usize,
    /// Device blocks that became full and registered this iteration
    /// (stored at once in eager mode).
    pub new_full_blocks: Vec<ImmutableBlock>,
    /// Device blocks the engine's own prefix cache served the request, told
    /// in the iteration it is first scheduled after being admitted
    /// (counted towards [`OffloadMode::AfterHits`]).
    pub device_hits: Vec<ImmutableBlock>,
    /// Tokens appended to the request (generated) this iteration.
    pub new_tokens: Vec<Token>,
}

/// The scheduler's output handed to `build_connector_metadata`.
#[derive(Debug, Clone, Default)]
pub struct SchedulerOutput {
    /// Requests run this iteration.
    pub scheduled: Vec<ScheduledRequest>,
    /// Running requests left out of this iteration.
    pub skipped: Vec<RequestId>,
}

/// What the worker must do this iteration.
#[derive(Debug, Default)]
pub struct ConnectorMetadata {
    /// Loads to finish before the forward pass.
    pub loads: Vec<LoadOp>,
    /// Fired after the forward pass: the stores planned this iteration wait
    /// on it.
    pub store_trigger: Option<PreconditionTrigger>,
    /// Number of store candidates planned this iteration.
    pub stores: usize,
}

/// The scheduler side of the connector. See the module docs.
pub struct Leader {
    shared: Arc<Shared>,
    device: BlockPool,
    host: Option<BlockPool>,
    disk: Option<BlockPool>,
    pipelines: Pipelines,
    mode: OffloadMode,
    /// G1 hits per block, under [`OffloadMode::AfterHits`].
    hits: Option<Mutex<FrequencySketch>>,
    salt: SaltHash,
    block_size: usize,
    hooks: HookSet,
    hold_requests: bool,
}

/// Tier pools for a leader.
#[derive(Clone)]
pub struct LeaderPools {
    /// G1.
    pub device: BlockPool,
    /// G2, if enabled.
    pub host: Option<BlockPool>,
    /// G3, if enabled.
    pub disk: Option<BlockPool>,
}

impl Drop for Leader {
    fn drop(&mut self) {
        // The host → disk pipeline reports to an observer that holds
        // `shared`, which holds that pipeline: a cycle that kept the event
        // bus (and so a recording of the run) open for ever.
        lock(&self.shared.spill).take();
    }
}

impl Leader {
    /// A leader over `pools`, planning transfers into `pipelines` (built
    /// with observers from `wiring`).
    pub fn new(
        wiring: LeaderWiring,
        pools: LeaderPools,
        pipelines: Pipelines,
        mode: OffloadMode,
        salt: SaltHash,
    ) -> Self {
        *lock(&wiring.shared.spill) = pipelines.offload_host_to_disk.clone();
        let block_size = pools.device.block_size();
        let hits = match mode {
            OffloadMode::AfterHits(_) => {
                let to = pools
                    .host
                    .as_ref()
                    .or(pools.disk.as_ref())
                    .unwrap_or(&pools.device);
                Some(Mutex::new(FrequencySketch::new(to.capacity())))
            }
            _ => None,
        };
        Leader {
            hits,
            hooks: HookSet::none(),
            shared: wiring.shared,
            device: pools.device,
            host: pools.host,
            disk: pools.disk,
            pipelines,
            mode,
            salt,
            block_size,
            hold_requests: false,
        }
    }

    /// Breakpoints hold a request at `create_slot` and
    /// `get_num_new_matched_tokens` instead of blocking the engine's
    /// thread ([`Breakpoints::hold`](crate::hooks::Breakpoints::hold)), for
    /// an engine that can put a request off (vLLM asks again on a later
    /// step); use [`get_num_new_matched_tokens_or_hold`](Self::get_num_new_matched_tokens_or_hold).
    pub fn set_hold_requests(&mut self, hold: bool) {
        self.hold_requests = hold;
    }

    /// Installs hooks (user hooks, `HookCall` events, breakpoints) around
    /// the entry points. Without them each entry point pays one branch.
    pub fn set_hooks(&mut self, hooks: HookSet) {
        for pipe in self.pipelines.all() {
            pipe.set_hooks(hooks.clone());
        }
        self.hooks = hooks;
    }

    /// Where a device block is stored: the host, or straight to disk when
    /// there is no host tier.
    fn store_direction(&self) -> Direction {
        if self.host.is_none() && self.disk.is_some() {
            Direction::DEVICE_TO_DISK
        } else {
            Direction::DEVICE_TO_HOST
        }
    }

    /// The emitter.
    pub fn emitter(&self) -> &Arc<Emitter> {
        &self.shared.emitter
    }

    /// The G1 pool.
    pub fn device(&self) -> &BlockPool {
        &self.device
    }

    /// The pool of `tier`, if that tier is enabled.
    pub fn pool(&self, tier: Tier) -> Option<&BlockPool> {
        match tier {
            Tier::Device => Some(&self.device),
            Tier::Host => self.host.as_ref(),
            Tier::Disk => self.disk.as_ref(),
        }
    }

    /// Candidates planned and not yet final, over all pipelines.
    pub fn candidates_in_flight(&self) -> usize {
        lock(&self.shared.candidates).len()
    }

    fn call(&self, entry: EntryPoint, request: Option<&RequestId>) -> Option<CallInfo> {
        if !self.hooks.is_enabled() {
            return None;
        }
        let state = request.and_then(|r| lock(&self.shared.slots).get(r).map(|s| s.state));
        let info = CallInfo {
            entry,
            request: request.cloned(),
            state,
            direction: None,
        };
        // May block here: a breakpoint pauses the engine's thread.
        self.hooks.will_call(&info);
        Some(info)
    }

    /// [`call`](Self::call) for an entry point that may put its request
    /// off: with hold mode on, a matching breakpoint holds the request
    /// rather than blocking.
    fn call_or_hold(&self, entry: EntryPoint, request: &RequestId) -> (Option<CallInfo>, Verdict) {
        if !self.hold_requests {
            return (self.call(entry, Some(request)), Verdict::Go);
        }
        if !self.hooks.is_enabled() {
            return (None, Verdict::Go);
        }
        let state = lock(&self.shared.slots).get(request).map(|s| s.state);
        let info = CallInfo {
            entry,
            request: Some(request.clone()),
            state,
            direction: None,
        };
        let verdict = self.hooks.will_call_or_hold(&info);
        (Some(info), verdict)
    }

    fn done(&self, info: Option<CallInfo>) {
        if let Some(info) = info {
            self.hooks.finished_call(&info);
        }
    }

    /// A slot for a new request.
    pub fn create_slot(
        &self,
        request: &RequestId,
        prompt: &[Token],
        max_output_tokens: usize,
    ) -> Result<(), SlotError> {
        // A held request's slot is still created: holding it is about what
        // it is asked next.
        let (call, _) = self.call_or_hold(EntryPoint::CreateSlot, request);
        let r = (|| {
            let mut slots = lock(&self.shared.slots);
            if slots.contains_key(request) {
                return Err(SlotError::DuplicateRequest(request.to_string()));
            }
            let tokens = TokenSequence::from_tokens(prompt, self.block_size, self.salt)
                .map_err(|_| SlotError::UnknownRequest(request.to_string()))?;
            slots.insert(
                request.clone(),
                Slot {
                    state: SlotState::Initialized,
                    tokens,
                    staged: Vec::new(),
                    outstanding: 0,
                    pending_loads: Vec::new(),
                    lookup_emitted: false,
                },
            );
            self.shared.emitter.emit(
                Some(request),
                EventKind::SlotCreated {
                    prompt_tokens: prompt.len() as u32,
                    max_output_tokens: max_output_tokens as u32,
                },
            );
            Ok(())
        })();
        self.done(call);
        r
    }

    /// Staged (matched, not yet loaded) tokens of a slot by tier: (host,
    /// disk). Valid between `get_num_new_matched_tokens` and
    /// `update_state_after_alloc`.
    pub fn staged_by_tier(&self, request: &str) -> (usize, usize) {
        let slots = lock(&self.shared.slots);
        let Some(s) = slots.get(request) else {
            return (0, 0);
        };
        let host = s.staged.iter().filter(|b| b.tier() == Tier::Host).count();
        (
            host * self.block_size,
            (s.staged.len() - host) * self.block_size,
        )
    }

    /// True when a slot exists for `request`.
    pub fn has_slot(&self, request: &str) -> bool {
        lock(&self.shared.slots).contains_key(request)
    }

    /// The slot's state.
    pub fn slot_state(&self, request: &str) -> Option<SlotState> {
        lock(&self.shared.slots).get(request).map(|s| s.state)
    }

    /// States of every slot (for tests comparing against the reducer).
    pub fn slot_states(&self) -> HashMap<RequestId, SlotState> {
        lock(&self.shared.slots)
            .iter()
            .map(|(k, v)| (k.clone(), v.state))
            .collect()
    }

    /// Outstanding candidates of a slot.
    pub fn outstanding(&self, request: &str) -> u32 {
        lock(&self.shared.slots)
            .get(request)
            .map_or(0, |s| s.outstanding)
    }

    /// Tokens beyond `num_computed_tokens` (what the device cache matched)
    /// that the host and then the disk tier hold, as a prefix. Stages those
    /// blocks (held, so they survive until loaded) and moves the slot to
    /// `OnboardStaged`. Returns `(tokens, load_is_async)`; the engine must
    /// still compute at least the prompt's last token, so a fully cached
    /// prompt reports one block less. Asked again before the engine
    /// allocates, it stages anew. The first ask of a slot also emits
    /// `PrefixLookup` (the request's block hashes: the capacity analysis's
    /// reference stream).
    pub fn get_num_new_matched_tokens(
        &self,
        request: &RequestId,
        num_computed_tokens: usize,
    ) -> Result<(usize, bool), SlotError> {
        let call = self.call(EntryPoint::GetNumNewMatchedTokens, Some(request));
        let r = self.match_external(request, num_computed_tokens);
        self.done(call);
        r
    }

    /// [`get_num_new_matched_tokens`](Self::get_num_new_matched_tokens) for
    /// an engine that can put a request off: `Ok(None)` while a breakpoint
    /// holds the request (with hold mode on; see
    /// [`set_hold_requests`](Self::set_hold_requests)). Nothing is staged
    /// then.
    pub fn get_num_new_matched_tokens_or_hold(
        &self,
        request: &RequestId,
        num_computed_tokens: usize,
    ) -> Result<Option<(usize, bool)>, SlotError> {
        let (call, verdict) = self.call_or_hold(EntryPoint::GetNumNewMatchedTokens, request);
        let r = match verdict {
            Verdict::Held { .. } => Ok(None),
            Verdict::Go => self.match_external(request, num_computed_tokens).map(Some),
        };
        self.done(call);
        r
    }

    fn match_external(
        &self,
        request: &RequestId,
        num_computed_tokens: usize,
    ) -> Result<(usize, bool), SlotError> {
        let mut slots = lock(&self.shared.slots);
        let slot = slots
            .get_mut(request)
            .ok_or_else(|| SlotError::UnknownRequest(request.to_string()))?;
        let hashes = slot.tokens.sequence_hashes();
        let prompt_len = slot.tokens.total_tokens();
        let first = num_computed_tokens / self.block_size;
        // Leave at least the last token to compute.
        let limit = (prompt_len.saturating_sub(1)) / self.block_size;
        let wanted = hashes.get(first..limit.max(first)).unwrap_or(&[]);
        let first_lookup = !slot.lookup_emitted;
        if first_lookup {
            slot.lookup_emitted = true;
            // TinyLFU counts each request's references once, here.
            for pool in [&self.host, &self.disk].into_iter().flatten() {
                pool.record_references(&hashes);
            }
            self.shared.emitter.emit(
                Some(request),
                EventKind::PrefixLookup {
                    tokens: u32::try_from(prompt_len).unwrap_or(u32::MAX),
                    block_size: u32::try_from(self.block_size).unwrap_or(u32::MAX),
                    computed_blocks: u32::try_from(first.min(hashes.len())).unwrap_or(u32::MAX),
                    hashes: hashes.clone(),
                },
            );
        }
        // Anything staged by an earlier ask is let go first: the answer is
        // the tiers' contents now.
        slot.staged.clear();
        let mut staged = Vec::new();
        // Where each tier's hits are among `hashes`.
        let mut served = [(0, 0); 2];
        for (i, (tier, pool)) in [(Tier::Host, &self.host), (Tier::Disk, &self.disk)]
            .into_iter()
            .enumerate()
        {
            let Some(pool) = pool else { continue };
            let rest = &wanted[staged.len()..];
            if rest.is_empty() {
                break;
            }
            let hits = pool.match_prefix(rest);
            let at = first + staged.len();
            served[i] = (at, at + hits.len());
            self.shared.emitter.emit(
                Some(request),
                EventKind::MatchResult {
                    tier,
                    looked_up: rest.len() as u32,
                    hit_blocks: hits.len() as u32,
                    hit_tokens: (hits.len() * self.block_size) as u32,
                },
            );
            let stop = hits.len() < rest.len();
            staged.extend(hits);
            if stop {
                break;
            }
        }
        if first_lookup {
            // Every block the request needs is a use of it in each tier
            // that holds it, served from there or not (from G1, or
            // recomputed after an earlier block missed), as the capacity
            // curve counts references: a prefix G1 keeps hot stays recent
            // in G2 too. The blocks a tier served were hit just now.
            for (pool, (a, b)) in [&self.host, &self.disk].into_iter().zip(served) {
                if let Some(pool) = pool {
                    pool.touch(&hashes[..a.min(hashes.len())]);
                    pool.touch(&hashes[b.min(hashes.len()).max(a.min(hashes.len()))..]);
                }
            }
        }
        let tokens = staged.len() * self.block_size;
        slot.staged = staged;
        let state = slot.state;
        if tokens > 0 && state != SlotState::OnboardStaged(tokens) {
            self.shared
                .transition(&mut slots, request, SlotState::OnboardStaged(tokens))?;
        }
        Ok((tokens, tokens > 0))
    }

    /// The engine allocated device blocks; `onboard_destinations` are the
    /// ones that will receive the `num_external_tokens` staged tokens, in
    /// prefix order. Plans the loads and moves the slot to `Onboarding`.
    /// With zero external tokens, releases anything staged.
    pub fn update_state_after_alloc(
        &self,
        request: &RequestId,
        mut onboard_destinations: Vec<MutableBlock<Empty>>,
        num_external_tokens: usize,
    ) -> Result<(), SlotError> {
        let call = self.call(EntryPoint::UpdateStateAfterAlloc, Some(request));
        let r = (|| {
            let mut slots = lock(&self.shared.slots);
            let slot = slots
                .get_mut(request)
                .ok_or_else(|| SlotError::UnknownRequest(request.to_string()))?;
            let n = num_external_tokens / self.block_size;
            let mut staged = std::mem::take(&mut slot.staged);
            staged.truncate(n.min(onboard_destinations.len()));
            onboard_destinations.truncate(staged.len());
            if staged.is_empty() {
                return Ok(());
            }
            let split = staged.iter().take_while(|b| b.tier() == Tier::Host).count();
            let tokens = staged.len() * self.block_size;
            // Without a host tier, disk blocks load straight to the device
            // in one hop, like host blocks do; with one, they go through it
            // when the load starts.
            let direct = self.host.is_none();
            let (first, disk_sources, disk_destinations) = if direct {
                (Direction::DISK_TO_DEVICE, Vec::new(), Vec::new())
            } else {
                let s = staged.split_off(split);
                let d = onboard_destinations.split_off(split);
                (Direction::HOST_TO_DEVICE, s, d)
            };
            let (from_host, from_disk) = if direct {
                (0, staged.len())
            } else {
                (staged.len(), disk_sources.len())
            };
            slot.pending_loads.push(LoadOp {
                request: request.clone(),
                tokens,
                from_host,
                from_disk,
                handle: None,
                disk_sources,
                disk_destinations,
            });
            // The first hop is enqueued now (its sources are held strongly
            // anyway).
            drop(slots);
            if !staged.is_empty() {
                let h = self.plan(
                    first,
                    Some(request),
                    staged.into_iter().map(SourceBlock::Strong).collect(),
                    Some(onboard_destinations),
                    None,
                );
                let mut slots = lock(&self.shared.slots);
                if let Some(slot) = slots.get_mut(request)
                    && let Some(l) = slot.pending_loads.last_mut()
                {
                    l.handle = h;
                }
            }
            let mut slots = lock(&self.shared.slots);
            self.shared
                .transition(&mut slots, request, SlotState::Onboarding(tokens))
        })();
        self.done(call);
        r
    }

    /// Enqueues one candidate; emits `TransferPlanned`, or a skip when the
    /// path is disabled or the queue refuses.
    fn plan(
        &self,
        direction: Direction,
        request: Option<&RequestId>,
        blocks: Vec<SourceBlock>,
        destinations: Option<Vec<MutableBlock<Empty>>>,
        pre: Option<Precondition>,
    ) -> Option<TransferHandle> {
        plan_on(
            &self.shared,
            self.pipeline(direction),
            direction,
            request,
            blocks,
            destinations,
            pre,
        )
    }

    fn pipeline(&self, d: Direction) -> Option<&Arc<OffloadPipeline>> {
        let p = &self.pipelines;
        match (d.src, d.dst) {
            (Tier::Device, Tier::Host) => p.offload_device_to_host.as_ref(),
            (Tier::Host, Tier::Disk) => p.offload_host_to_disk.as_ref(),
            (Tier::Host, Tier::Device) => p.onboard_host_to_device.as_ref(),
            (Tier::Disk, Tier::Host) => p.onboard_disk_to_host.as_ref(),
            (Tier::Device, Tier::Disk) => p.offload_device_to_disk.as_ref(),
            (Tier::Disk, Tier::Device) => p.onboard_disk_to_device.as_ref(),
            _ => None,
        }
    }

    /// Once per iteration: slot states follow what the scheduler ran, eager
    /// stores are planned (gated on this iteration's forward pass), and the
    /// loads planned since the last call are handed to the worker.
    pub fn build_connector_metadata(&self, out: &SchedulerOutput) -> ConnectorMetadata {
        let call = self.call(EntryPoint::BuildConnectorMetadata, None);
        let (trigger, pre) = precondition();
        let mut md = ConnectorMetadata::default();
        for s in &out.scheduled {
            {
                let mut slots = lock(&self.shared.slots);
                let Some(slot) = slots.get_mut(&s.request) else {
                    continue;
                };
                md.loads.append(&mut slot.pending_loads);
                slot.tokens.extend(&s.new_tokens);
                let to = if s.decode_tokens > 0 || s.prefill_tokens == 0 {
                    SlotState::Decoding
                } else {
                    SlotState::Prefilling
                };
                // Most iterations leave a running slot where it was (staying
                // put is no transition): the slot is not looked up again.
                if slot.state != to {
                    let _ = self.shared.transition(&mut slots, &s.request, to);
                }
                self.shared.emitter.emit(
                    Some(&s.request),
                    EventKind::TokensScheduled {
                        prefill: s.prefill_tokens as u32,
                        decode: s.decode_tokens as u32,
                        computed: s.computed_tokens as u32,
                    },
                );
            }
            if let OffloadMode::AfterHits(n) = self.mode
                && !s.device_hits.is_empty()
            {
                self.store_hot(&s.request, &s.device_hits, n);
            }
            if self.mode == OffloadMode::Eager && !s.new_full_blocks.is_empty() {
                let blocks = s
                    .new_full_blocks
                    .iter()
                    .map(|b| SourceBlock::Weak(b.downgrade()))
                    .collect();
                if self
                    .plan(
                        self.store_direction(),
                        Some(&s.request),
                        blocks,
                        None,
                        Some(pre.clone()),
                    )
                    .is_some()
                {
                    md.stores += 1;
                }
            }
        }
        for r in &out.skipped {
            let mut slots = lock(&self.shared.slots);
            let to = match slots.get(r).map(|s| s.state) {
                Some(SlotState::Prefilling | SlotState::SkippedPrefill) => {
                    SlotState::SkippedPrefill
                }
                Some(SlotState::Decoding | SlotState::SkippedDecode) => SlotState::SkippedDecode,
                _ => continue,
            };
            let _ = self.shared.transition(&mut slots, r, to);
        }
        md.store_trigger = Some(trigger);
        self.flush_spills();
        self.done(call);
        md
    }

    /// Counts `hits` towards [`OffloadMode::AfterHits`] and stores those
    /// that reach `n` and are not stored yet. They were computed in an
    /// earlier pass: nothing to wait for.
    fn store_hot(&self, request: &RequestId, hits: &[ImmutableBlock], n: u32) {
        let Some(counts) = &self.hits else { return };
        let to = self.store_direction();
        let Some(dst) = self.pool(to.dst) else { return };
        let hot: Vec<SourceBlock> = {
            let mut c = lock(counts);
            hits.iter()
                .filter(|b| {
                    c.record(b.sequence_hash());
                    u32::from(c.estimate(b.sequence_hash())) >= n
                        && !dst.contains(b.sequence_hash())
                })
                .map(|b| SourceBlock::Weak(b.downgrade()))
                .collect()
        };
        if !hot.is_empty() {
            self.plan(to, Some(request), hot, None, None);
        }
    }

    /// Writes through to disk what reached the host since the last call.
    fn flush_spills(&self) {
        flush_spills(&self.shared);
    }

    /// The engine took a running request's device blocks back.
    pub fn request_preempted(&self, request: &RequestId) -> Result<(), SlotError> {
        let mut slots = lock(&self.shared.slots);
        if let Some(s) = slots.get_mut(request) {
            s.staged.clear();
            s.pending_loads.clear();
        }
        self.shared
            .transition(&mut slots, request, SlotState::Preempted)
    }

    /// The engine finished the request; `blocks` are stored now (lazy mode:
    /// all its computed device blocks; eager mode: those its last forward
    /// pass computed). Returns true while transfers are
    /// outstanding (the slot stays in Finishing until they drain).
    pub fn request_finished(
        &self,
        request: &RequestId,
        blocks: &[ImmutableBlock],
    ) -> Result<bool, SlotError> {
        let call = self.call(EntryPoint::RequestFinished, Some(request));
        let r = (|| {
            // Lazy mode stores everything now; eager mode passes the blocks
            // its last forward pass computed, which no later iteration will.
            if !blocks.is_empty() {
                let src = blocks
                    .iter()
                    .map(|b| SourceBlock::Strong(b.clone()))
                    .collect();
                self.plan(self.store_direction(), Some(request), src, None, None);
            }
            let mut slots = lock(&self.shared.slots);
            if let Some(s) = slots.get_mut(request) {
                s.staged.clear();
                s.pending_loads.clear();
            }
            self.shared
                .transition(&mut slots, request, SlotState::Finishing)?;
            let outstanding = slots.get(request).map_or(0, |s| s.outstanding);
            if outstanding == 0 {
                self.shared
                    .transition(&mut slots, request, SlotState::Finished)?;
            }
            Ok(outstanding > 0)
        })();
        self.done(call);
        r
    }

    /// Appends tokens the engine generated to a request's sequence (for an
    /// engine that reports them apart from what it ran; the simulator hands
    /// them over in [`ScheduledRequest::new_tokens`]). Returns the tokens the
    /// request holds now.
    pub fn append_tokens(&self, request: &str, tokens: &[Token]) -> Result<usize, SlotError> {
        let mut slots = lock(&self.shared.slots);
        let slot = slots
            .get_mut(request)
            .ok_or_else(|| SlotError::UnknownRequest(request.to_string()))?;
        slot.tokens.extend(tokens);
        Ok(slot.tokens.total_tokens())
    }

    /// The full token blocks `range` of a request's sequence (fewer when it
    /// holds fewer), with their hashes.
    pub fn token_blocks(
        &self,
        request: &str,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<TokenBlock>, SlotError> {
        let slots = lock(&self.shared.slots);
        let slot = slots
            .get(request)
            .ok_or_else(|| SlotError::UnknownRequest(request.to_string()))?;
        let blocks = slot.tokens.blocks();
        let end = range.end.min(blocks.len());
        let start = range.start.min(end);
        Ok(blocks[start..end].to_vec())
    }

    /// For an engine whose worker runs in another process: starts every
    /// load of `md` without waiting for it to reach the device. A load's
    /// first hop was enqueued by [`update_state_after_alloc`](Self::update_state_after_alloc);
    /// a disk part that goes through the host is brought to the host here
    /// (waited for, on `runtime`: that copy is local) and its host → device
    /// hop enqueued. Returns, per request, the handles of its device-bound
    /// transfers; a part that could not start is left out (the engine
    /// computes those tokens instead).
    pub fn start_loads(
        &self,
        md: &mut ConnectorMetadata,
        runtime: &tokio::runtime::Handle,
    ) -> Vec<(RequestId, Vec<TransferHandle>)> {
        let (d2h, h2d) = self.onboard_paths();
        let runtime = &Waiter::Handle(runtime.clone());
        std::mem::take(&mut md.loads)
            .into_iter()
            .map(|mut l| {
                let mut handles: Vec<TransferHandle> = l.handle.take().into_iter().collect();
                if !l.disk_sources.is_empty() {
                    handles.extend(disk_then_host(
                        &self.shared,
                        runtime,
                        (d2h.as_ref(), h2d.as_ref()),
                        &l.request,
                        std::mem::take(&mut l.disk_sources),
                        std::mem::take(&mut l.disk_destinations),
                    ));
                }
                (l.request, handles)
            })
            .collect()
    }

    /// Forgets Finished slots (the engine is done with them).
    pub fn remove_finished(&self) -> usize {
        let mut slots = lock(&self.shared.slots);
        let before = slots.len();
        slots.retain(|_, s| s.state != SlotState::Finished);
        before - slots.len()
    }

    /// Emits a `PoolGauge` for every enabled tier.
    pub fn emit_gauges(&self) {
        for p in [Some(&self.device), self.host.as_ref(), self.disk.as_ref()]
            .into_iter()
            .flatten()
        {
            let s = p.status();
            self.shared.emitter.emit(
                None,
                EventKind::PoolGauge {
                    tier: p.tier(),
                    capacity: s.capacity as u32,
                    active: s.active as u32,
                    inactive: s.inactive as u32,
                    empty: s.empty as u32,
                },
            );
        }
    }

    /// The host → device pipeline, for the worker's two-hop disk loads.
    fn onboard_paths(&self) -> (Option<Arc<OffloadPipeline>>, Option<Arc<OffloadPipeline>>) {
        (
            self.pipelines.onboard_disk_to_host.clone(),
            self.pipelines.onboard_host_to_device.clone(),
        )
    }
}

fn plan_on(
    shared: &Arc<Shared>,
    pipeline: Option<&Arc<OffloadPipeline>>,
    direction: Direction,
    request: Option<&RequestId>,
    blocks: Vec<SourceBlock>,
    destinations: Option<Vec<MutableBlock<Empty>>>,
    pre: Option<Precondition>,
) -> Option<TransferHandle> {
    let p = pipeline?;
    let n = blocks.len() as u32;
    let hashes = if direction == Direction::DEVICE_TO_HOST || direction == Direction::DEVICE_TO_DISK
    {
        blocks.iter().map(|b| b.sequence_hash()).collect()
    } else {
        Vec::new()
    };
    let mut cands = lock(&shared.candidates);
    let id = shared.next_transfer.fetch_add(1, Ordering::Relaxed);
    shared.emitter.emit(
        request,
        EventKind::TransferPlanned {
            transfer: id,
            direction,
            blocks: n,
        },
    );
    let res = p.enqueue(crate::offload::EnqueueRequest {
        blocks,
        destinations,
        precondition: pre,
        priority: u32::from(direction.is_onboard()),
    });
    match res {
        Ok(h) => {
            if let Some(r) = request
                && let Some(s) = lock(&shared.slots).get_mut(r)
            {
                s.outstanding += 1;
            }
            if !h.status().is_final() {
                cands.insert(
                    (direction, h.id()),
                    (
                        id,
                        Candidate {
                            request: request.cloned(),
                            blocks: n,
                            hashes,
                        },
                    ),
                );
                Some(h)
            } else {
                // Finished before we could track it (empty container).
                drop(cands);
                shared.emitter.emit(
                    request,
                    EventKind::TransferSkipped {
                        transfer: id,
                        direction,
                        reason: "empty".into(),
                    },
                );
                shared.candidate_done(&request.cloned(), direction);
                Some(h)
            }
        }
        Err(refused) => {
            drop(cands);
            shared.emitter.emit(
                request,
                EventKind::TransferSkipped {
                    transfer: id,
                    direction,
                    reason: refused.error.to_string(),
                },
            );
            None
        }
    }
}

/// The two-hop load of disk blocks: disk → host (waited for on
/// `runtime`), then the host → device hop enqueued into `destinations`; its
/// handle, or `None` when a hop is missing or failed (the engine computes
/// those tokens instead).
fn disk_then_host(
    shared: &Arc<Shared>,
    runtime: &Waiter,
    (d2h, h2d): (Option<&Arc<OffloadPipeline>>, Option<&Arc<OffloadPipeline>>),
    request: &RequestId,
    sources: Vec<ImmutableBlock>,
    mut destinations: Vec<MutableBlock<Empty>>,
) -> Option<TransferHandle> {
    let (d2h, h2d) = (d2h?, h2d?);
    let hashes: Vec<_> = sources.iter().map(|b| b.sequence_hash()).collect();
    let src = sources.into_iter().map(SourceBlock::Strong).collect();
    let h = plan_on(
        shared,
        Some(d2h),
        Direction::DISK_TO_HOST,
        Some(request),
        src,
        None,
        None,
    )?;
    if !matches!(runtime.block_on(h.wait()), TransferStatus::Completed { .. }) {
        return None;
    }
    let on_host = shared.host.as_ref()?.match_prefix(&hashes);
    destinations.truncate(on_host.len());
    let src = on_host.into_iter().map(SourceBlock::Strong).collect();
    plan_on(
        shared,
        Some(h2d),
        Direction::HOST_TO_DEVICE,
        Some(request),
        src,
        Some(destinations),
        None,
    )
}

fn flush_spills(shared: &Arc<Shared>) {
    let spill = lock(&shared.spill).clone();
    let (Some(p), Some(host)) = (spill, &shared.host) else {
        lock(&shared.pending_spills).clear();
        return;
    };
    let hashes = std::mem::take(&mut *lock(&shared.pending_spills));
    // Blocks evicted from the host meanwhile are simply not written.
    let src: Vec<SourceBlock> = hashes
        .iter()
        .filter_map(|h| host.lookup(*h))
        .map(|b| SourceBlock::Weak(b.downgrade()))
        .collect();
    if !src.is_empty() {
        plan_on(
            shared,
            Some(&p),
            Direction::HOST_TO_DISK,
            None,
            src,
            None,
            None,
        );
    }
}

/// How a [`Worker`] waits for transfers.
enum Waiter {
    /// On a runtime other threads drive (its tasks run meanwhile).
    Handle(tokio::runtime::Handle),
    /// On a single-threaded runtime that only this worker drives: the
    /// pipelines' tasks run only inside its waits, on the caller's thread,
    /// in an order that depends on nothing but what was asked (the
    /// simulator's virtual time).
    Owned(Arc<tokio::runtime::Runtime>),
}

impl Waiter {
    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        match self {
            Waiter::Handle(h) => h.block_on(f),
            Waiter::Owned(rt) => rt.block_on(f),
        }
    }
}

/// The worker side: binds metadata, runs loads and stores, reports.
pub struct Worker {
    runtime: Waiter,
    bound: Option<ConnectorMetadata>,
    disk_to_host: Option<Arc<OffloadPipeline>>,
    host_to_device: Option<Arc<OffloadPipeline>>,
    shared: Arc<Shared>,
}

/// What a load produced for one request.
#[derive(Debug)]
pub struct LoadResult {
    /// The request.
    pub request: RequestId,
    /// Device blocks now holding the loaded prefix, in order (fewer than
    /// planned if part of the load failed; the engine recomputes the rest).
    pub blocks: Vec<ImmutableBlock>,
    /// Tokens planned.
    pub planned_tokens: usize,
    /// Of the planned blocks, how many came from the host (the rest from
    /// disk); `blocks` holds the host ones first.
    pub from_host: usize,
}

impl Worker {
    /// A worker for `leader`, waiting on transfers with `runtime`. It must
    /// not run on one of that runtime's worker threads (it blocks).
    pub fn new(leader: &Leader, runtime: tokio::runtime::Handle) -> Self {
        Self::waiting_with(leader, Waiter::Handle(runtime))
    }

    /// A worker that drives `runtime` itself, a current-thread runtime the
    /// leader's pipelines run on and that nothing else drives: their work
    /// happens only inside this worker's waits (loads, [`drain`](Self::drain)),
    /// on the calling thread, so the events it emits never interleave with
    /// the caller's and come in the same order every run.
    pub fn driving(leader: &Leader, runtime: Arc<tokio::runtime::Runtime>) -> Self {
        Self::waiting_with(leader, Waiter::Owned(runtime))
    }

    fn waiting_with(leader: &Leader, runtime: Waiter) -> Self {
        let (disk_to_host, host_to_device) = leader.onboard_paths();
        Worker {
            runtime,
            bound: None,
            disk_to_host,
            host_to_device,
            shared: leader.shared.clone(),
        }
    }

    /// Takes this iteration's metadata.
    pub fn bind_connector_metadata(&mut self, md: ConnectorMetadata) {
        self.bound = Some(md);
    }

    /// Runs every load and waits for it (loads gate the forward pass).
    /// Disk blocks go disk → host → device.
    pub fn start_load_kv(&mut self) -> Vec<LoadResult> {
        let Some(md) = self.bound.as_mut() else {
            return Vec::new();
        };
        let loads = std::mem::take(&mut md.loads);
        let mut out = Vec::new();
        for mut l in loads {
            let mut blocks = Vec::new();
            let mut ok = true;
            if let Some(h) = l.handle.take() {
                let s = self.runtime.block_on(h.wait());
                match (&s, h.take_blocks()) {
                    (TransferStatus::Completed { .. }, Some(b)) => blocks = b,
                    _ => ok = false,
                }
            } else if l.from_host > 0 {
                ok = false;
            }
            if ok && !l.disk_sources.is_empty() {
                blocks.extend(self.load_from_disk(&l.request, l.disk_sources, l.disk_destinations));
            }
            out.push(LoadResult {
                request: l.request,
                blocks,
                planned_tokens: l.tokens,
                from_host: l.from_host,
            });
        }
        out
    }

    fn load_from_disk(
        &self,
        request: &RequestId,
        sources: Vec<ImmutableBlock>,
        destinations: Vec<MutableBlock<Empty>>,
    ) -> Vec<ImmutableBlock> {
        let Some(h) = disk_then_host(
            &self.shared,
            &self.runtime,
            (self.disk_to_host.as_ref(), self.host_to_device.as_ref()),
            request,
            sources,
            destinations,
        ) else {
            return Vec::new();
        };
        match self.runtime.block_on(h.wait()) {
            TransferStatus::Completed { .. } => h.take_blocks().unwrap_or_default(),
            _ => Vec::new(),
        }
    }

    /// The forward pass is done: the stores planned for it may read their
    /// blocks now.
    pub fn forward_pass_done(&mut self) {
        if let Some(md) = self.bound.take()
            && let Some(t) = md.store_trigger
        {
            t.trigger();
        }
    }

    /// The requests whose stores (`sending`) and loads (`recving`) finished
    /// since the last call, like vLLM's `get_finished`.
    pub fn get_finished(&self) -> FinishedTransfers {
        let mut f = lock(&self.shared.finished);
        FinishedTransfers {
            sending: std::mem::take(&mut f.sending),
            recving: std::mem::take(&mut f.recving),
            dropped: std::mem::take(&mut f.dropped),
        }
    }

    /// Waits until no candidate is in flight (end of a simulation).
    pub fn drain(&self) {
        flush_spills(&self.shared);
        match &self.runtime {
            Waiter::Handle(_) => {
                while !lock(&self.shared.candidates).is_empty() {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
            }
            // Nothing runs the pipelines unless this thread does.
            Waiter::Owned(rt) => rt.block_on(async {
                loop {
                    let idle = self.shared.idle.notified();
                    tokio::pin!(idle);
                    // Registered before the map is read, so the last
                    // candidate finishing in between is not missed.
                    idle.as_mut().enable();
                    if lock(&self.shared.candidates).is_empty() {
                        return;
                    }
                    idle.await;
                }
            }),
        }
    }
}
