//! The unit that flows through the pipeline: an `OffloadContainer`, its
//! status tracker, and the pipeline-wide counters.

use super::policy::BlockInfo;
use super::precondition::Precondition;
use super::queue::Prioritized;
use super::status::{SkipReason, TransferStatus};
use crate::block::{Empty, ImmutableBlock, MutableBlock, WeakBlock};
use crate::transfer::TransferStats;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A block handed to the pipeline.
#[derive(Debug, Clone)]
pub enum SourceBlock {
    /// Held strongly until the transfer (onboarding a prefix the caller has
    /// already matched and must not lose).
    Strong(ImmutableBlock),
    /// Held weakly until the upgrade (offloading: if the block is evicted
    /// meanwhile, it is simply not offloaded).
    Weak(WeakBlock),
}

impl SourceBlock {
    /// The block's sequence hash.
    pub fn sequence_hash(&self) -> crate::tokens::SequenceHash {
        match self {
            SourceBlock::Strong(b) => b.sequence_hash(),
            SourceBlock::Weak(w) => w.sequence_hash(),
        }
    }

    pub(crate) fn info(&self) -> BlockInfo {
        match self {
            SourceBlock::Strong(b) => BlockInfo {
                sequence_hash: b.sequence_hash(),
                source_tier: b.tier(),
                block: b.id(),
            },
            SourceBlock::Weak(w) => BlockInfo {
                sequence_hash: w.sequence_hash(),
                source_tier: w.tier(),
                block: w.id(),
            },
        }
    }

    /// The commitment boundary (P3): weak → strong, or `None` if gone.
    pub(crate) fn upgrade(self) -> Option<ImmutableBlock> {
        match self {
            SourceBlock::Strong(b) => Some(b),
            SourceBlock::Weak(w) => w.upgrade().ok(),
        }
    }
}

/// Told what the pipeline does; for event emission and metrics. Called on
/// the pipeline's tasks: keep it cheap.
pub trait PipelineObserver: Send + Sync {
    /// A container changed status.
    fn on_status(&self, container: u64, status: &TransferStatus) {
        let _ = (container, status);
    }
    /// A batch was upgraded, flattened and handed to the engine.
    fn on_batch_dispatched(&self, batch: u64, containers: &[u64], blocks: usize) {
        let _ = (batch, containers, blocks);
    }
    /// A batch finished (`Err` carries the engine's error message).
    fn on_batch_completed(&self, batch: u64, result: Result<&TransferStats, &str>) {
        let _ = (batch, result);
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub enqueued: AtomicU64,
    pub rejected_queue_full: AtomicU64,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    pub skipped: [AtomicU64; SkipReason::COUNT],
    pub filtered_blocks: AtomicU64,
    pub gone_blocks: AtomicU64,
    pub swept: AtomicU64,
    pub batches: AtomicU64,
    pub blocks_transferred: AtomicU64,
    pub bytes_transferred: AtomicU64,
}

/// State every tracker reports into.
pub(crate) struct Shared {
    pub counters: Counters,
    pub observer: Option<Arc<dyn PipelineObserver>>,
}

/// Owns the container's status channel; sends exactly one final status.
pub(crate) struct Tracker {
    id: u64,
    tx: watch::Sender<TransferStatus>,
    cancel: CancellationToken,
    shared: Arc<Shared>,
    done: bool,
}

impl Tracker {
    pub(crate) fn new(
        id: u64,
        tx: watch::Sender<TransferStatus>,
        cancel: CancellationToken,
        shared: Arc<Shared>,
    ) -> Self {
        Tracker {
            id,
            tx,
            cancel,
            shared,
            done: false,
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn set(&self, status: TransferStatus) {
        if let Some(o) = &self.shared.observer {
            o.on_status(self.id, &status);
        }
        self.tx.send_replace(status);
    }

    /// Sends the final status. Callers drop the container's blocks first:
    /// a final status promises they are released.
    pub(crate) fn finish(mut self, status: TransferStatus) {
        self.finish_in_place(status);
    }

    fn finish_in_place(&mut self, status: TransferStatus) {
        let c = &self.shared.counters;
        match &status {
            TransferStatus::Completed { .. } => &c.completed,
            TransferStatus::Cancelled => &c.cancelled,
            TransferStatus::Skipped(r) => &c.skipped[r.index()],
            _ => &c.failed,
        }
        .fetch_add(1, Ordering::Relaxed);
        self.done = true;
        self.set(status);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        // Never leave a handle waiting forever: a container dropped without
        // a verdict (pipeline shut down) still gets a final status.
        if !self.done {
            let s = if self.cancel.is_cancelled() {
                TransferStatus::Cancelled
            } else {
                TransferStatus::Failed("the offload pipeline shut down".into())
            };
            self.finish_in_place(s);
        }
    }
}

/// Blocks to move, what gates them, and how to cancel them (P1, P2).
pub(crate) struct OffloadContainer {
    // Field order matters: fields drop in declaration order, so the blocks
    // are released before the tracker (last) sends a final status.
    pub blocks: Vec<SourceBlock>,
    /// Caller-provided destinations (onboarding), aligned with `blocks`.
    pub destinations: Option<Vec<MutableBlock<Empty>>>,
    pub precondition: Option<Precondition>,
    pub cancel: CancellationToken,
    pub priority: u32,
    pub filtered: usize,
    /// Where an onboarding's registered destinations are left for the handle.
    pub result: Arc<Mutex<Option<Vec<ImmutableBlock>>>>,
    pub tracker: Tracker,
}

impl OffloadContainer {
    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Releases every block, then sends the final status.
    pub(crate) fn finish(self, status: TransferStatus) {
        let OffloadContainer {
            blocks,
            destinations,
            tracker,
            ..
        } = self;
        drop(blocks);
        drop(destinations);
        tracker.finish(status);
    }
}

impl Prioritized for OffloadContainer {
    fn priority(&self) -> u32 {
        self.priority
    }
}

/// Containers grouped by the batcher, still cancellable one by one.
pub(crate) struct Batch {
    pub containers: Vec<OffloadContainer>,
    pub priority: u32,
}

impl Batch {
    /// Removes cancelled containers into `out` (P4); true if any are left.
    pub(crate) fn sweep_cancelled(&mut self, out: &mut Vec<OffloadContainer>) -> bool {
        for c in std::mem::take(&mut self.containers) {
            if c.is_cancelled() {
                out.push(c);
            } else {
                self.containers.push(c);
            }
        }
        !self.containers.is_empty()
    }
}

impl Prioritized for Batch {
    fn priority(&self) -> u32 {
        self.priority
    }
}
