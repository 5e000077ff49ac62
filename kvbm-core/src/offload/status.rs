//! What a caller sees of a queued transfer: its status and its handle.

use crate::block::ImmutableBlock;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Why a container was skipped rather than transferred.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// Every block was already present in the destination tier.
    AlreadyPresent,
    /// Every block was below the frequency policy's threshold.
    BelowFrequency,
    /// A custom policy rejected every block.
    Policy(&'static str),
    /// Policy evaluation took longer than `policy_timeout`.
    PolicyTimeout,
    /// Every source block was evicted before it could be upgraded.
    SourceGone,
    /// The destination pool had no empty or evictable blocks left.
    DestinationFull {
        /// Blocks the container needed.
        requested: usize,
        /// Empty plus inactive blocks the pool had.
        available: usize,
    },
    /// The forward pass the container waited for never happened.
    PreconditionAbandoned,
    /// The container held no blocks.
    Empty,
    /// The destination's admission policy (TinyLFU) turned every block
    /// away: each was seen less often than what it would have evicted.
    NotAdmitted,
}

impl SkipReason {
    /// A short stable name (for counters and metrics labels).
    pub fn name(&self) -> &'static str {
        match self {
            SkipReason::AlreadyPresent => "already_present",
            SkipReason::BelowFrequency => "below_frequency",
            SkipReason::Policy(_) => "policy",
            SkipReason::PolicyTimeout => "policy_timeout",
            SkipReason::SourceGone => "source_gone",
            SkipReason::DestinationFull { .. } => "destination_full",
            SkipReason::PreconditionAbandoned => "precondition_abandoned",
            SkipReason::Empty => "empty",
            SkipReason::NotAdmitted => "not_admitted",
        }
    }

    pub(crate) const COUNT: usize = 9;

    pub(crate) fn index(&self) -> usize {
        match self {
            SkipReason::AlreadyPresent => 0,
            SkipReason::BelowFrequency => 1,
            SkipReason::Policy(_) => 2,
            SkipReason::PolicyTimeout => 3,
            SkipReason::SourceGone => 4,
            SkipReason::DestinationFull { .. } => 5,
            SkipReason::PreconditionAbandoned => 6,
            SkipReason::Empty => 7,
            SkipReason::NotAdmitted => 8,
        }
    }

    pub(crate) const NAMES: [&'static str; Self::COUNT] = [
        "already_present",
        "below_frequency",
        "policy",
        "policy_timeout",
        "source_gone",
        "destination_full",
        "precondition_abandoned",
        "empty",
        "not_admitted",
    ];
}

/// Where a container is in the pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferStatus {
    /// Waiting for policy evaluation.
    Queued,
    /// Policies are running.
    Evaluating,
    /// Waiting for the forward pass.
    AwaitingPrecondition,
    /// In a batch, not yet upgraded: still cancellable.
    Batched,
    /// Upgraded (committed): the copy will run even if cancelled.
    Transferring,
    /// Done. `blocks` moved; `filtered` were dropped by policies (already
    /// present, too rare); `gone` were evicted before the upgrade.
    Completed {
        /// Blocks copied and registered in the destination.
        blocks: usize,
        /// Blocks a policy left out.
        filtered: usize,
        /// Blocks whose weak reference no longer upgraded.
        gone: usize,
    },
    /// Cancelled before the upgrade; every block released, no byte moved.
    Cancelled,
    /// Not transferred, for a reason.
    Skipped(SkipReason),
    /// The copy failed.
    Failed(String),
}

impl TransferStatus {
    /// True for the states a container never leaves.
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            TransferStatus::Completed { .. }
                | TransferStatus::Cancelled
                | TransferStatus::Skipped(_)
                | TransferStatus::Failed(_)
        )
    }
}

/// The caller's side of a queued transfer.
#[derive(Debug, Clone)]
pub struct TransferHandle {
    id: u64,
    status: watch::Receiver<TransferStatus>,
    cancel: CancellationToken,
    result: Arc<Mutex<Option<Vec<ImmutableBlock>>>>,
}

impl TransferHandle {
    pub(crate) fn new(
        id: u64,
        status: watch::Receiver<TransferStatus>,
        cancel: CancellationToken,
        result: Arc<Mutex<Option<Vec<ImmutableBlock>>>>,
    ) -> Self {
        TransferHandle {
            id,
            status,
            cancel,
            result,
        }
    }

    /// The container's id (unique per pipeline).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The status now.
    pub fn status(&self) -> TransferStatus {
        self.status.borrow().clone()
    }

    /// Waits for a final status. The pipeline sets it only after releasing
    /// every block of the container.
    pub async fn wait(&self) -> TransferStatus {
        let mut rx = self.status.clone();
        let waited = rx
            .wait_for(TransferStatus::is_final)
            .await
            .map(|s| s.clone());
        // The pipeline always sends a final status before letting go of the
        // sender; if it did not, report what was last known.
        waited.unwrap_or_else(|_| self.status.borrow().clone())
    }

    /// Requests cancellation and waits until every block of the container
    /// is released. Before the upgrade this ends in `Cancelled` with no byte
    /// moved; after it (P3) the transfer runs to completion and that is the
    /// status returned.
    pub async fn cancel(&self) -> TransferStatus {
        self.cancel.cancel();
        self.wait().await
    }

    /// True once cancellation was requested.
    pub fn is_cancel_requested(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// For onboarding: the destination blocks, registered, in the order the
    /// sources were given. Available once `Completed`; taken once.
    pub fn take_blocks(&self) -> Option<Vec<ImmutableBlock>> {
        self.result.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}
