//! The four stages, the cancel sweeper, and the pipeline that owns them.

use super::config::{ConfigError, PipelineConfig};
use super::container::{Batch, OffloadContainer, PipelineObserver, Shared, SourceBlock, Tracker};
use super::policy::{OffloadPolicy, Verdict};
use super::precondition::Precondition;
use super::queue::CancellableQueue;
use super::status::{SkipReason, TransferHandle, TransferStatus};
use crate::block::{Empty, ImmutableBlock, MutableBlock};
use crate::link::{TierLink, register_copies};
use crate::pool::PoolError;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What to move and under which conditions.
#[derive(Debug, Default)]
pub struct EnqueueRequest {
    /// The blocks, in order.
    pub blocks: Vec<SourceBlock>,
    /// Destinations chosen by the caller (onboarding into blocks the
    /// scheduler already allocated), one per block; `None` lets the
    /// pipeline allocate them from the destination pool.
    pub destinations: Option<Vec<MutableBlock<Empty>>>,
    /// The forward pass to wait for before reading the sources.
    pub precondition: Option<Precondition>,
    /// Higher goes first in the executor's in-queue.
    pub priority: u32,
}

/// Why `enqueue` refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnqueueError {
    /// The queue in front of the policy evaluator is full. Counted in
    /// `PipelineStats::rejected_queue_full`; the caller decides (skip the
    /// offload, or retry later). The engine is never made to wait.
    #[error("offload queue full ({capacity} containers)")]
    QueueFull {
        /// The queue's bound.
        capacity: usize,
    },
    /// The pipeline is shutting down.
    #[error("the offload pipeline is shut down")]
    Closed,
    /// Caller-provided destinations must pair up with the blocks.
    #[error("{blocks} blocks but {destinations} destinations")]
    DestinationCount {
        /// Blocks given.
        blocks: usize,
        /// Destinations given.
        destinations: usize,
    },
    /// A destination that is not from the link's destination pool.
    #[error("destination block {block} is not from the pipeline's destination pool")]
    ForeignDestination {
        /// Its id.
        block: u32,
    },
}

/// A refused request, with everything it carried handed back.
#[derive(Debug)]
pub struct Refused {
    /// Why.
    pub error: EnqueueError,
    /// The request, untouched.
    pub request: EnqueueRequest,
}

/// A snapshot of the pipeline's counters and queue depths.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PipelineStats {
    /// Containers accepted.
    pub enqueued: u64,
    /// Containers refused because the first queue was full.
    pub rejected_queue_full: u64,
    /// Containers that completed.
    pub completed: u64,
    /// Containers cancelled before the upgrade.
    pub cancelled: u64,
    /// Containers whose copy failed (or that a shutdown dropped).
    pub failed: u64,
    /// Containers skipped, by reason name.
    pub skipped: Vec<(&'static str, u64)>,
    /// Blocks left out by policies.
    pub filtered_blocks: u64,
    /// Weak references that no longer upgraded, discarded.
    pub gone_blocks: u64,
    /// Cancelled containers removed from queues by the sweeper.
    pub swept: u64,
    /// Batches handed to the engine.
    pub batches: u64,
    /// Blocks copied.
    pub blocks_transferred: u64,
    /// Bytes copied.
    pub bytes_transferred: u64,
    /// Containers waiting for policy evaluation.
    pub queued_for_policy: usize,
    /// Containers waiting on their precondition.
    pub awaiting_precondition: usize,
    /// Containers queued in front of the batcher.
    pub queued_for_batcher: usize,
    /// Batches in the executor's in-queue (weak, cancellable).
    pub in_queue: usize,
    /// Batches upgraded and ready (strong).
    pub on_deck: usize,
    /// Batches transferring.
    pub in_flight: usize,
}

impl PipelineStats {
    /// Containers skipped for `reason` (by [`SkipReason::name`]).
    pub fn skipped(&self, reason: &str) -> u64 {
        self.skipped
            .iter()
            .find(|(n, _)| *n == reason)
            .map_or(0, |(_, v)| *v)
    }
}

struct Inner {
    config: PipelineConfig,
    /// Hooks around each batch's transfer (`TransferExecute`); set after
    /// construction, read once per batch.
    hooks: Mutex<crate::hooks::HookSet>,
    link: TierLink,
    policies: Vec<Arc<dyn OffloadPolicy>>,
    eval_q: CancellableQueue<OffloadContainer>,
    batch_q: CancellableQueue<OffloadContainer>,
    in_queue: CancellableQueue<Batch>,
    awaiting: Arc<Semaphore>,
    awaiting_now: AtomicUsize,
    on_deck_now: AtomicUsize,
    in_flight_now: AtomicUsize,
    /// Containers (batches, for `committing`) a stage has taken from the
    /// queue in front of it and not yet handed on or finished (see
    /// `stats`).
    evaluating: AtomicUsize,
    batching: AtomicUsize,
    committing: AtomicUsize,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    next_batch: AtomicU64,
    shutdown: CancellationToken,
}

/// The offload (or onboard) pipeline over one [`TierLink`]: PolicyEvaluator
/// → PreconditionAwaiter → Batcher → TransferExecutor, with a CancelSweeper.
/// See the [module docs](super).
pub struct OffloadPipeline {
    inner: Arc<Inner>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for OffloadPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadPipeline")
            .field("link", &self.inner.link)
            .field("stats", &self.stats())
            .finish()
    }
}

impl OffloadPipeline {
    /// Starts the stages on the current tokio runtime.
    pub fn new(
        link: TierLink,
        policies: Vec<Arc<dyn OffloadPolicy>>,
        config: PipelineConfig,
    ) -> Result<Self, ConfigError> {
        Self::with_observer(link, policies, config, None)
    }

    /// Like [`new`](Self::new), reporting to `observer`.
    pub fn with_observer(
        link: TierLink,
        policies: Vec<Arc<dyn OffloadPolicy>>,
        config: PipelineConfig,
        observer: Option<Arc<dyn PipelineObserver>>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let rt = tokio::runtime::Handle::try_current().map_err(|_| ConfigError::NoRuntime)?;
        let inner = Arc::new(Inner {
            link,
            policies,
            eval_q: CancellableQueue::new(config.queue_capacity),
            batch_q: CancellableQueue::new(config.queue_capacity),
            in_queue: CancellableQueue::new(config.queue_capacity),
            awaiting: Arc::new(Semaphore::new(config.max_awaiting_precondition)),
            awaiting_now: AtomicUsize::new(0),
            on_deck_now: AtomicUsize::new(0),
            in_flight_now: AtomicUsize::new(0),
            evaluating: AtomicUsize::new(0),
            batching: AtomicUsize::new(0),
            committing: AtomicUsize::new(0),
            shared: Arc::new(Shared {
                counters: Default::default(),
                observer,
            }),
            next_id: AtomicU64::new(1),
            next_batch: AtomicU64::new(1),
            shutdown: CancellationToken::new(),
            hooks: Mutex::new(crate::hooks::HookSet::none()),
            config,
        });
        let tasks = vec![
            rt.spawn(policy_evaluator(inner.clone())),
            rt.spawn(batcher(inner.clone())),
            rt.spawn(transfer_executor(inner.clone())),
            rt.spawn(cancel_sweeper(inner.clone())),
        ];
        Ok(OffloadPipeline { inner, tasks })
    }

    /// The link the pipeline copies through.
    pub fn link(&self) -> &TierLink {
        &self.inner.link
    }

    /// Installs hooks (and breakpoints) around each batch's transfer, the
    /// `TransferExecute` entry point. A breakpoint there pauses this
    /// pipeline's executor; on a multi-threaded runtime the pause moves the
    /// runtime's other tasks off the paused thread (`block_in_place`).
    pub fn set_hooks(&self, hooks: crate::hooks::HookSet) {
        *self.inner.hooks.lock().unwrap_or_else(|e| e.into_inner()) = hooks;
    }

    /// The direction this pipeline moves blocks in.
    pub fn direction(&self) -> kvbm_events::Direction {
        kvbm_events::Direction {
            src: self.inner.link.source().tier(),
            dst: self.inner.link.destination().tier(),
        }
    }

    /// Queues a container. Never waits: a full queue is an error (counted).
    pub fn enqueue(&self, request: EnqueueRequest) -> Result<TransferHandle, Box<Refused>> {
        let refuse = |error, request| Err(Box::new(Refused { error, request }));
        if let Some(d) = &request.destinations {
            if d.len() != request.blocks.len() {
                let error = EnqueueError::DestinationCount {
                    blocks: request.blocks.len(),
                    destinations: d.len(),
                };
                return refuse(error, request);
            }
            let dst = self.inner.link.destination().id();
            if let Some(b) = d.iter().find(|b| b.pool_id() != dst) {
                let error = EnqueueError::ForeignDestination { block: b.id() };
                return refuse(error, request);
            }
        }
        if self.inner.eval_q.is_closed() {
            return refuse(EnqueueError::Closed, request);
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let cancel = CancellationToken::new();
        let (tx, rx) = watch::channel(TransferStatus::Queued);
        let result = Arc::new(Mutex::new(None));
        let handle = TransferHandle::new(id, rx, cancel.clone(), result.clone());
        let EnqueueRequest {
            blocks,
            destinations,
            precondition,
            priority,
        } = request;
        let container = OffloadContainer {
            blocks,
            destinations,
            precondition,
            // P2: the container's token is a clone of the handle's.
            cancel: cancel.clone(),
            priority,
            filtered: 0,
            result,
            tracker: Tracker::new(id, tx, cancel, self.inner.shared.clone()),
        };
        if container.blocks.is_empty() {
            self.count(|c| &c.enqueued);
            container.finish(TransferStatus::Skipped(SkipReason::Empty));
            return Ok(handle);
        }
        match self.inner.eval_q.try_push(container) {
            Ok(()) => {
                self.count(|c| &c.enqueued);
                Ok(handle)
            }
            Err(c) => {
                let error = if self.inner.eval_q.is_closed() {
                    EnqueueError::Closed
                } else {
                    self.count(|c| &c.rejected_queue_full);
                    EnqueueError::QueueFull {
                        capacity: self.inner.eval_q.capacity(),
                    }
                };
                // Hand everything back; the tracker is retired quietly.
                let OffloadContainer {
                    blocks,
                    destinations,
                    precondition,
                    priority,
                    tracker,
                    ..
                } = c;
                std::mem::forget(tracker);
                refuse(
                    error,
                    EnqueueRequest {
                        blocks,
                        destinations,
                        precondition,
                        priority,
                    },
                )
            }
        }
    }

    /// Offloads registered blocks, held weakly until the upgrade.
    pub fn offload(
        &self,
        blocks: &[ImmutableBlock],
        precondition: Option<Precondition>,
    ) -> Result<TransferHandle, Box<Refused>> {
        self.enqueue(EnqueueRequest {
            blocks: blocks
                .iter()
                .map(|b| SourceBlock::Weak(b.downgrade()))
                .collect(),
            destinations: None,
            precondition,
            priority: 0,
        })
    }

    /// Onboards `sources` (held strongly) into caller-allocated
    /// `destinations`; the registered destinations come back through
    /// [`TransferHandle::take_blocks`].
    pub fn onboard(
        &self,
        sources: Vec<ImmutableBlock>,
        destinations: Vec<MutableBlock<Empty>>,
        priority: u32,
    ) -> Result<TransferHandle, Box<Refused>> {
        self.enqueue(EnqueueRequest {
            blocks: sources.into_iter().map(SourceBlock::Strong).collect(),
            destinations: Some(destinations),
            precondition: None,
            priority,
        })
    }

    fn count(&self, f: impl Fn(&super::container::Counters) -> &AtomicU64) {
        f(&self.inner.shared.counters).fetch_add(1, Ordering::Relaxed);
    }

    /// Counters and queue depths.
    pub fn stats(&self) -> PipelineStats {
        let i = &self.inner;
        let c = &i.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PipelineStats {
            enqueued: l(&c.enqueued),
            rejected_queue_full: l(&c.rejected_queue_full),
            completed: l(&c.completed),
            cancelled: l(&c.cancelled),
            failed: l(&c.failed),
            skipped: SkipReason::NAMES
                .iter()
                .zip(&c.skipped)
                .map(|(n, v)| (*n, l(v)))
                .collect(),
            filtered_blocks: l(&c.filtered_blocks),
            gone_blocks: l(&c.gone_blocks),
            swept: l(&c.swept),
            batches: l(&c.batches),
            blocks_transferred: l(&c.blocks_transferred),
            bytes_transferred: l(&c.bytes_transferred),
            // Read in the order work moves (each queue, then what its
            // stage has taken from it, then the next), and each count is
            // raised before the one it leaves is lowered: work between two
            // stages is counted in one of them, never in none (so "nothing
            // before the engine" means nothing is).
            queued_for_policy: i.eval_q.len() + i.evaluating.load(Ordering::SeqCst),
            awaiting_precondition: i.awaiting_now.load(Ordering::SeqCst),
            queued_for_batcher: i.batch_q.len() + i.batching.load(Ordering::SeqCst),
            in_queue: i.in_queue.len() + i.committing.load(Ordering::SeqCst),
            on_deck: i.on_deck_now.load(Ordering::SeqCst),
            in_flight: i.in_flight_now.load(Ordering::SeqCst),
        }
    }

    /// Stops accepting work, stops the stages, and finishes every queued
    /// container (`Failed`, or `Cancelled` if its cancel was requested).
    /// Transfers already running complete first.
    pub async fn shutdown(mut self) {
        self.stop();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        while self.inner.in_flight_now.load(Ordering::Acquire) > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    fn stop(&self) {
        let i = &self.inner;
        i.shutdown.cancel();
        i.awaiting.close();
        i.eval_q.close();
        i.batch_q.close();
        i.in_queue.close();
        // Dropping a container sends its final status.
        drop(i.eval_q.drain());
        drop(i.batch_q.drain());
        drop(i.in_queue.drain());
    }
}

impl Drop for OffloadPipeline {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Lowers a stage's count of work taken from its queue when that work has
/// been handed on or finished (see `PipelineStats` in `stats`). Work that
/// ends in a stage is uncounted before its final status is sent
/// ([`Taken::finish`]), so whoever sees that status never sees the work
/// still counted.
struct Taken<'a>(&'a AtomicUsize);

impl Taken<'_> {
    /// Lowers the count, then finishes `c` with `status`.
    fn finish(self, c: OffloadContainer, status: TransferStatus) {
        drop(self);
        c.finish(status);
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Stage 1: runs the policies on each container, bounded by
/// `policy_timeout`, and filters out the blocks they reject.
async fn policy_evaluator(inner: Arc<Inner>) {
    let dst = inner.link.destination().clone();
    while let Some(mut c) = inner.eval_q.pop_held(Some(&inner.evaluating)).await {
        let taken = Taken(&inner.evaluating);
        if c.is_cancelled() {
            taken.finish(c, TransferStatus::Cancelled);
            continue;
        }
        if !inner.policies.is_empty() {
            c.tracker.set(TransferStatus::Evaluating);
            let cancel = c.cancel.clone();
            let infos: Vec<_> = c.blocks.iter().map(SourceBlock::info).collect();
            let eval = async {
                let mut keep = vec![true; infos.len()];
                let mut last_reason = None;
                for p in &inner.policies {
                    let idx: Vec<usize> = (0..infos.len()).filter(|&i| keep[i]).collect();
                    if idx.is_empty() {
                        break;
                    }
                    let subset: Vec<_> = idx.iter().map(|&i| infos[i]).collect();
                    let verdicts = p.evaluate(&subset, &dst).await;
                    for (&i, v) in idx.iter().zip(verdicts.iter().chain(std::iter::repeat(
                        // A policy that returns too few verdicts rejects the rest.
                        &Verdict::Reject(SkipReason::Policy("short verdict list")),
                    ))) {
                        if let Verdict::Reject(r) = v {
                            keep[i] = false;
                            last_reason = Some(r.clone());
                        }
                    }
                }
                (keep, last_reason)
            };
            let outcome = tokio::select! {
                biased;
                _ = cancel.cancelled() => None,
                r = tokio::time::timeout(inner.config.policy_timeout, eval) => Some(r),
            };
            let (keep, last_reason) = match outcome {
                None => {
                    taken.finish(c, TransferStatus::Cancelled);
                    continue;
                }
                Some(Err(_elapsed)) => {
                    taken.finish(c, TransferStatus::Skipped(SkipReason::PolicyTimeout));
                    continue;
                }
                Some(Ok(r)) => r,
            };
            let before = c.blocks.len();
            retain_aligned(&mut c, &keep);
            let filtered = before - c.blocks.len();
            c.filtered += filtered;
            inner
                .shared
                .counters
                .filtered_blocks
                .fetch_add(filtered as u64, Ordering::Relaxed);
            if c.blocks.is_empty() {
                let reason = last_reason.unwrap_or(SkipReason::Empty);
                taken.finish(c, TransferStatus::Skipped(reason));
                continue;
            }
        }
        precondition_awaiter(&inner, c).await;
        drop(taken);
    }
}

fn retain_aligned(c: &mut OffloadContainer, keep: &[bool]) {
    let blocks = std::mem::take(&mut c.blocks);
    let mut dests = c.destinations.take().map(|d| d.into_iter());
    let mut kept_dests = dests.as_ref().map(|_| Vec::new());
    for (b, &k) in blocks.into_iter().zip(keep) {
        let d = dests.as_mut().and_then(Iterator::next);
        if k {
            c.blocks.push(b);
            if let (Some(v), Some(d)) = (kept_dests.as_mut(), d) {
                v.push(d);
            }
        }
    }
    c.destinations = kept_dests;
}

/// Stage 2: a container with a precondition waits for it on its own task
/// (at most `max_awaiting_precondition` at once), selecting on the
/// container's token so a cancel drops it at once (P6).
async fn precondition_awaiter(inner: &Arc<Inner>, mut c: OffloadContainer) {
    let Some(mut pre) = c.precondition.take() else {
        forward_to_batcher(inner, c).await;
        return;
    };
    if pre.is_met() {
        forward_to_batcher(inner, c).await;
        return;
    }
    c.tracker.set(TransferStatus::AwaitingPrecondition);
    let permit = tokio::select! {
        biased;
        p = inner.awaiting.clone().acquire_owned() => p,
        _ = c.cancel.cancelled() => {
            c.finish(TransferStatus::Cancelled);
            return;
        }
    };
    let Ok(permit) = permit else {
        return; // semaphore closed: shutting down; dropping c finishes it
    };
    inner.awaiting_now.fetch_add(1, Ordering::SeqCst);
    let inner = inner.clone();
    tokio::spawn(async move {
        let cancel = c.cancel.clone();
        let res = tokio::select! {
            biased;
            r = pre.wait() => Some(Some(r)),
            _ = cancel.cancelled() => Some(None),
            _ = inner.shutdown.cancelled() => None,
        };
        // Counted as awaiting until it is in the batcher's queue.
        let awaiting = Taken(&inner.awaiting_now);
        drop(permit);
        let Some(res) = res else {
            // Shut down: `awaiting` goes first, then dropping `c` (moved
            // into this task) sends its final status.
            return;
        };
        match res {
            None => awaiting.finish(c, TransferStatus::Cancelled),
            Some(Err(_)) => {
                awaiting.finish(
                    c,
                    TransferStatus::Skipped(SkipReason::PreconditionAbandoned),
                );
            }
            Some(Ok(())) => {
                forward_to_batcher(&inner, c).await;
                drop(awaiting);
            }
        }
    });
}

async fn forward_to_batcher(inner: &Inner, c: OffloadContainer) {
    // Waits for room (backpressure). If the queue closed, `c` comes back
    // and dropping it sends its final status.
    let _ = inner.batch_q.push(c).await;
}

/// Stage 3: groups containers into batches of `min_batch_size` ..
/// `max_batch_size` blocks; a smaller batch leaves after `flush_interval`.
async fn batcher(inner: Arc<Inner>) {
    let cfg = inner.config.batch_config;
    let mut pending: Vec<OffloadContainer> = Vec::new();
    let mut total = 0usize;
    let mut deadline: Option<Instant> = None;
    loop {
        let held = Some(&inner.batching);
        let next = match deadline {
            None => inner.batch_q.pop_held(held).await,
            Some(d) => tokio::select! {
                biased;
                c = inner.batch_q.pop_held(held) => c,
                _ = tokio::time::sleep_until(d) => {
                    flush(&inner, &mut pending, &mut total).await;
                    deadline = None;
                    continue;
                }
            },
        };
        let Some(c) = next else {
            flush(&inner, &mut pending, &mut total).await;
            return;
        };
        if c.is_cancelled() {
            Taken(&inner.batching).finish(c, TransferStatus::Cancelled);
            continue;
        }
        if total + c.len() > cfg.max_batch_size && !pending.is_empty() {
            flush(&inner, &mut pending, &mut total).await;
            deadline = None;
        }
        c.tracker.set(TransferStatus::Batched);
        total += c.len();
        pending.push(c);
        deadline.get_or_insert_with(|| Instant::now() + cfg.flush_interval);
        if total >= cfg.min_batch_size {
            flush(&inner, &mut pending, &mut total).await;
            deadline = None;
        }
    }
}

/// Hands the pending containers to the executor as one batch; they stop
/// counting as `batching` once they are in its queue (or finished).
async fn flush(inner: &Inner, pending: &mut Vec<OffloadContainer>, total: &mut usize) {
    *total = 0;
    let taken = pending.len();
    let mut batch = Batch {
        priority: pending.iter().map(|c| c.priority).max().unwrap_or(0),
        containers: std::mem::take(pending),
    };
    let mut cancelled = Vec::new();
    let any = batch.sweep_cancelled(&mut cancelled);
    let ended = cancelled.len();
    for c in cancelled {
        Taken(&inner.batching).finish(c, TransferStatus::Cancelled);
    }
    if any {
        let _ = inner.in_queue.push(batch).await;
    }
    inner.batching.fetch_sub(taken - ended, Ordering::SeqCst);
}

/// A batch past the commitment boundary: strong sources, destinations.
struct Committed {
    id: u64,
    sources: Vec<ImmutableBlock>,
    destinations: Vec<MutableBlock<Empty>>,
    parts: Vec<Part>,
}

struct Part {
    tracker: Tracker,
    blocks: usize,
    filtered: usize,
    gone: usize,
    result: Option<Arc<Mutex<Option<Vec<ImmutableBlock>>>>>,
}

/// Stage 4, the OffloadManager (on deck / in queue): batches wait in the in-queue
/// holding weak references (cancellable); up to `on_deck_capacity` batches
/// are upgraded ahead into strong, ready-to-go transfers (on deck, filled
/// first); at most `max_concurrent_transfers` run. When one finishes, the
/// next on-deck batch goes and on-deck is refilled from the in-queue.
async fn transfer_executor(inner: Arc<Inner>) {
    let max = inner.config.max_concurrent_transfers;
    let cap = inner.config.on_deck_capacity;
    let mut on_deck: VecDeque<Committed> = VecDeque::new();
    // Transfers are driven by this task itself rather than spawned: a
    // finished copy wakes the executor directly, which then starts the next
    // on-deck batch without another task hop.
    let mut running: Vec<Running> = Vec::new();
    let mut closed = false;
    loop {
        while running.len() < max {
            let Some(c) = on_deck.pop_front() else { break };
            running.push(Box::pin(run_transfer(inner.clone(), c)));
        }
        let mut taken = 0;
        while on_deck.len() < cap {
            let Some(b) = inner.in_queue.try_pop_held(Some(&inner.committing)) else {
                break;
            };
            taken += 1;
            if let Some(c) = commit(&inner, b) {
                on_deck.push_back(c);
            }
        }
        // Raised before lowered (see `stats`): running first, then on
        // deck, then the batches taken from the in-queue.
        inner.in_flight_now.store(running.len(), Ordering::SeqCst);
        inner.on_deck_now.store(on_deck.len(), Ordering::SeqCst);
        inner.committing.fetch_sub(taken, Ordering::SeqCst);
        if running.len() < max && !on_deck.is_empty() {
            continue;
        }
        if closed && running.is_empty() {
            return; // on-deck work was dropped at shutdown (below)
        }
        let room = on_deck.len() < cap && !closed;
        tokio::select! {
            biased;
            _ = std::future::poll_fn(|cx| poll_any(&mut running, cx)), if !running.is_empty() => {}
            b = inner.in_queue.pop_held(Some(&inner.committing)), if room => match b {
                Some(b) => {
                    if let Some(c) = commit(&inner, b) {
                        on_deck.push_back(c);
                    }
                    inner.on_deck_now.store(on_deck.len(), Ordering::SeqCst);
                    inner.committing.fetch_sub(1, Ordering::SeqCst);
                }
                None => closed = true,
            },
            _ = inner.shutdown.cancelled(), if !closed => closed = true,
        }
        if closed {
            // Committed batches never started: release them (their
            // containers get `Failed`: shut down).
            on_deck.clear();
        }
    }
}

type Running = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Polls every running transfer; ready when at least one finished.
fn poll_any(running: &mut Vec<Running>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
    let before = running.len();
    running.retain_mut(|f| f.as_mut().poll(cx).is_pending());
    if running.len() < before {
        std::task::Poll::Ready(())
    } else {
        std::task::Poll::Pending
    }
}

/// The commitment boundary: sweep (P4), upgrade (P3), allocate
/// destinations, flatten (P5).
fn commit(inner: &Inner, mut batch: Batch) -> Option<Committed> {
    let mut cancelled = Vec::new();
    batch.sweep_cancelled(&mut cancelled);
    for c in cancelled {
        c.finish(TransferStatus::Cancelled);
    }
    let counters = &inner.shared.counters;
    let dst = inner.link.destination();
    let mut sources = Vec::new();
    let mut destinations = Vec::new();
    let mut parts = Vec::new();
    for c in batch.containers {
        let OffloadContainer {
            blocks,
            destinations: given,
            filtered,
            result,
            tracker,
            ..
        } = c;
        let mut srcs = Vec::with_capacity(blocks.len());
        let mut dsts = Vec::new();
        let mut gone = 0usize;
        let had_given = given.is_some();
        let mut given = given.map(|v| v.into_iter());
        for b in blocks {
            let d = given.as_mut().and_then(Iterator::next);
            match b.upgrade() {
                Some(s) => {
                    srcs.push(s);
                    dsts.extend(d);
                }
                None => gone += 1,
            }
        }
        drop(given);
        counters
            .gone_blocks
            .fetch_add(gone as u64, Ordering::Relaxed);
        if srcs.is_empty() {
            drop(dsts);
            tracker.finish(TransferStatus::Skipped(SkipReason::SourceGone));
            continue;
        }
        let mut filtered = filtered;
        if !had_given {
            // Another container may have landed the same blocks since the
            // policies ran: do not copy them twice.
            let before = srcs.len();
            srcs.retain(|s| !dst.contains(s.sequence_hash()));
            let now_present = before - srcs.len();
            filtered += now_present;
            counters
                .filtered_blocks
                .fetch_add(now_present as u64, Ordering::Relaxed);
            if srcs.is_empty() {
                tracker.finish(TransferStatus::Skipped(SkipReason::AlreadyPresent));
                continue;
            }
            // Allocation evicts inactive blocks first; only when the pool
            // is full of blocks in use is the container skipped.
            match dst.allocate(srcs.len()) {
                Ok(d) => dsts = d,
                Err(PoolError::Exhausted {
                    requested,
                    available,
                    ..
                }) => {
                    drop(srcs);
                    let reason = SkipReason::DestinationFull {
                        requested,
                        available,
                    };
                    tracker.finish(TransferStatus::Skipped(reason));
                    continue;
                }
                Err(e) => {
                    drop(srcs);
                    tracker.finish(TransferStatus::Failed(e.to_string()));
                    continue;
                }
            }
        }
        tracker.set(TransferStatus::Transferring);
        parts.push(Part {
            tracker,
            blocks: srcs.len(),
            filtered,
            gone,
            result: had_given.then_some(result),
        });
        sources.extend(srcs);
        destinations.extend(dsts);
    }
    if parts.is_empty() {
        return None;
    }
    Some(Committed {
        id: inner.next_batch.fetch_add(1, Ordering::Relaxed),
        sources,
        destinations,
        parts,
    })
}

async fn run_transfer(inner: Arc<Inner>, c: Committed) {
    if let Some(o) = &inner.shared.observer {
        let ids: Vec<u64> = c.parts.iter().map(|p| p.tracker.id()).collect();
        o.on_batch_dispatched(c.id, &ids, c.sources.len());
    }
    let Committed {
        id,
        sources,
        destinations,
        parts,
    } = c;
    let hooks = inner
        .hooks
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let call = hooks.is_enabled().then(|| {
        kvbm_events::breakpoint::CallInfo::new(kvbm_events::EntryPoint::TransferExecute)
            .with_direction(kvbm_events::Direction {
                src: inner.link.source().tier(),
                dst: inner.link.destination().tier(),
            })
    });
    if let Some(call) = &call {
        let multi = tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread;
        if multi {
            tokio::task::block_in_place(|| hooks.will_call(call));
        } else {
            hooks.will_call(call);
        }
    }
    let outcome = match inner.link.copy(sources, destinations) {
        Ok(ticket) => ticket.wait().await,
        Err(rejected) => Err(rejected.error),
    };
    let counters = &inner.shared.counters;
    match outcome {
        Ok(copied) => {
            let stats = copied.stats;
            counters.batches.fetch_add(1, Ordering::Relaxed);
            counters
                .blocks_transferred
                .fetch_add(stats.blocks as u64, Ordering::Relaxed);
            counters
                .bytes_transferred
                .fetch_add(stats.bytes, Ordering::Relaxed);
            // Registered in the destination pool: a later prefix match
            // finds them there.
            let mut registered = register_copies(copied).into_iter();
            if let Some(o) = &inner.shared.observer {
                o.on_batch_completed(id, Ok(&stats));
            }
            for p in parts {
                let mine: Vec<ImmutableBlock> = registered.by_ref().take(p.blocks).collect();
                match &p.result {
                    Some(slot) => {
                        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(mine);
                    }
                    None => drop(mine),
                }
                p.tracker.finish(TransferStatus::Completed {
                    blocks: p.blocks,
                    filtered: p.filtered,
                    gone: p.gone,
                });
            }
        }
        Err(e) => {
            let msg = e.to_string();
            tracing::warn!(batch = id, error = %msg, "offload batch failed");
            if let Some(o) = &inner.shared.observer {
                o.on_batch_completed(id, Err(&msg));
            }
            for p in parts {
                p.tracker.finish(TransferStatus::Failed(msg.clone()));
            }
        }
    }
    if let Some(call) = &call {
        hooks.finished_call(call);
    }
}

/// Every `sweep_interval`, pulls cancelled containers out of the queues so
/// they release their blocks even while a stage is stalled.
async fn cancel_sweeper(inner: Arc<Inner>) {
    // The first sweep one interval from now, not at once (an `interval`'s
    // first tick): at start the queues are empty, and a sweeper task that
    // first runs late would sweep work that a stage should have found
    // cancelled (with a long interval, none should).
    let every = inner.config.sweep_interval;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = tick.tick() => {}
            _ = inner.shutdown.cancelled() => return,
        }
        let mut removed = inner.eval_q.take_where(OffloadContainer::is_cancelled);
        removed.extend(inner.batch_q.take_where(OffloadContainer::is_cancelled));
        removed.extend(inner.in_queue.sweep(Batch::sweep_cancelled));
        if !removed.is_empty() {
            inner
                .shared
                .counters
                .swept
                .fetch_add(removed.len() as u64, Ordering::Relaxed);
            for c in removed {
                c.finish(TransferStatus::Cancelled);
            }
        }
    }
}
