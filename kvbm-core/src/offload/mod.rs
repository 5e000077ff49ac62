//! The offload and onboard pipeline (seeds 000 and 001).
//!
//! ```text
//! enqueue ─▶ PolicyEvaluator ─▶ PreconditionAwaiter ─▶ [queue] ─▶ Batcher ─▶ [in-queue] ─▶ TransferExecutor
//!                                                         ▲                      ▲           (on deck ▶ engine)
//!                                                         └──── CancelSweeper ───┘
//! ```
//!
//! A caller hands over a *container*: blocks, an optional forward-pass
//! precondition, and a cancellation token cloned from the returned
//! [`TransferHandle`] (P2). The container is the unit of cancellation (P1):
//! its blocks go or stay together. Offloaded blocks are held as `Weak`
//! references until the TransferExecutor upgrades them to strong ones, and
//! that upgrade is the commitment boundary (P3): before it, a cancel
//! releases every block and moves no byte; after it, the copy runs to the
//! end. The executor sweeps cancelled containers out of a batch immediately
//! before upgrading it (P4), then flattens all blocks of the batch into one
//! list for one transfer (P5). A container waiting on its precondition
//! selects on the precondition and its token, so a cancel drops it at once
//! (P6).
//!
//! The executor is the OffloadManager: batches wait in the
//! *in-queue* (weak references, by priority); up to `on_deck_capacity`
//! batches are upgraded ahead of time and wait *on deck* (strong
//! references, ready to go, filled first); at most
//! `max_concurrent_transfers` run. When a transfer finishes, the next
//! on-deck batch starts and on-deck is refilled from the in-queue; weak
//! references that no longer upgrade are discarded and counted
//! (`gone_blocks`).
//!
//! When a transfer completes, the destination blocks are registered in the
//! destination pool, so a later prefix match finds them there. Onboarding
//! (host or disk → device) is the same machinery over the opposite link,
//! with strong sources and destinations the caller allocated
//! ([`OffloadPipeline::onboard`]).
//!
//! **When the destination pool is full.** Destinations are allocated at the
//! commitment boundary. Allocation first takes empty blocks, then evicts
//! inactive registered blocks (LRU by priority), so cold cached blocks make
//! room for new ones. Only when every destination block is in use is a
//! container skipped, with `SkipReason::DestinationFull { requested,
//! available }`, counted under `destination_full`. Nothing is dropped
//! silently: every container ends in exactly one final status, and every
//! final status is counted in [`PipelineStats`].
//!
//! Every queue is bounded. `enqueue` never waits: when the first queue is
//! full it refuses with [`EnqueueError::QueueFull`] (counted); later stages
//! wait for room, which holds work back up the pipeline.

mod config;
mod container;
mod pipeline;
mod policy;
mod precondition;
mod queue;
mod status;

pub use config::{BatchConfig, ConfigError, PipelineConfig};
pub use container::{PipelineObserver, SourceBlock};
pub use pipeline::{EnqueueError, EnqueueRequest, OffloadPipeline, PipelineStats, Refused};
pub use policy::{
    AdmissionPolicy, BlockInfo, BoxFuture, FrequencyPolicy, OffloadPolicy, PresencePolicy, Verdict,
};
pub use precondition::{Precondition, PreconditionAbandoned, PreconditionTrigger, precondition};
pub use queue::{CancellableQueue, Prioritized};
pub use status::{SkipReason, TransferHandle, TransferStatus};
