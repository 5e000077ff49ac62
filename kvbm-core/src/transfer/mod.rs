//! Transfer engines: move blocks between the storages of two tiers.
//!
//! Every engine connects one source storage to one destination storage and
//! owns a single dedicated worker OS thread fed by a *bounded* queue
//! ([`EngineConfig::queue_depth`]). [`TransferEngine::submit`] validates a
//! batch synchronously (block ids in range, no destination named twice,
//! no block both read and written in one storage; layout shapes were
//! checked when the engine was built) and either rejects it before anything
//! moves or enqueues it and returns a [`TransferTicket`]. The copy runs on
//! the worker, never on the caller's thread, which may be an async runtime
//! worker; the ticket can be `.await`ed (no runtime needed, it is a
//! `tokio::sync::oneshot` underneath) or waited on with
//! [`TransferTicket::wait_blocking`].
//!
//! Engines:
//!
//! * [`MemcpyEngine`]: host memory to host memory (G2, and the stand-in for
//!   G1 when there is no GPU).
//! * [`DiskEngine`]: host memory to/from a [`DiskStorage`](crate::storage::DiskStorage) file (G2 ↔ G3).
//! * `CudaEngine` (feature `cuda`): device ↔ pinned host memory on a
//!   dedicated CUDA stream (G1 ↔ G2).
//! * `StreamCopier` (feature `cuda`): the same copies ordered against an
//!   inference engine's own CUDA stream with events, for a connector that
//!   runs on the engine's thread.
//! * [`RemoteEngine`]: copies another process performs (the worker of an
//!   engine that is not ours); batches are handed out and reported back.
//! * [`ShardedEngine`]: the same move in every shard of a tensor-parallel
//!   engine (one engine per rank's files), done when every shard's is.
//!
//! Dropping an engine stops its worker: the batch being copied finishes,
//! batches still queued resolve with [`TransferError::EngineStopped`], and
//! the thread is joined, so once `drop` returns no copy touches the
//! storages any more.

mod disk;
mod memcpy;
mod pieces;
mod remote;
mod sharded;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_copy;
#[cfg(feature = "cuda")]
mod cuda_stream;

pub use disk::{DiskDirection, DiskEngine};
pub use memcpy::{MemcpyEngine, Stores, plain_copy};
pub use pieces::{Piece, copy_pieces, total_bytes};
pub use remote::{RemoteBatch, RemoteEngine};
pub use sharded::ShardedEngine;

#[cfg(feature = "cuda")]
pub use cuda::{CudaDirection, CudaEngine};
#[cfg(feature = "cuda")]
pub use cuda_copy::{CopyCalls, batch_call_available};
#[cfg(feature = "cuda")]
pub use cuda_stream::{Fence, StreamCopier, StreamDirection};

use crate::layout::{Layout, LayoutConfig, LayoutError};
use crate::storage::StorageError;
use kvbm_events::tier::{BlockId, Tier};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Copy block `src` of the source storage into block `dst` of the
/// destination storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockPair {
    /// Block id in the source storage.
    pub src: BlockId,
    /// Block id in the destination storage.
    pub dst: BlockId,
}

impl BlockPair {
    /// Shorthand constructor.
    pub fn new(src: BlockId, dst: BlockId) -> Self {
        BlockPair { src, dst }
    }
}

/// What a completed batch moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferStats {
    /// Blocks copied.
    pub blocks: usize,
    /// Bytes copied.
    pub bytes: u64,
    /// Time the worker spent on the batch (from dequeue to completion; queue
    /// wait not included).
    pub elapsed: Duration,
}

impl TransferStats {
    /// Throughput of the batch in GB/s (10^9 bytes per second).
    pub fn gb_per_s(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.bytes as f64 / secs / 1e9
        } else {
            0.0
        }
    }
}

/// Which side of a transfer an error refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The storage blocks are read from.
    Source,
    /// The storage blocks are written to.
    Destination,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Destination => "destination",
        })
    }
}

/// Why a transfer was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// Source and destination layouts have different block shapes (layers,
    /// outer dim, page size, inner dim, dtype), so a block of one cannot be
    /// copied into a block of the other. Raised when the engine is built.
    #[error(
        "source and destination layouts differ in block shape: source {src:?}, destination {dst:?}"
    )]
    LayoutMismatch {
        /// The source layout's dimensions.
        src: LayoutConfig,
        /// The destination layout's dimensions.
        dst: LayoutConfig,
    },
    /// A block id at or beyond its storage's block count.
    #[error("{side} block {block} out of range ({num_blocks} blocks)")]
    BlockOutOfRange {
        /// Which storage.
        side: Side,
        /// The offending id.
        block: BlockId,
        /// That storage's block count.
        num_blocks: usize,
    },
    /// Two pairs of one batch write the same destination block.
    #[error("destination block {0} appears more than once in the batch")]
    DuplicateDestination(BlockId),
    /// Source and destination are the same storage and a block is both read
    /// and written by the batch.
    #[error("block {0} is both a source and a destination in the same storage")]
    Aliasing(BlockId),
    /// The engine's queue is full; retry later or grow
    /// [`EngineConfig::queue_depth`].
    #[error("{engine} engine queue is full")]
    QueueFull {
        /// The engine's name.
        engine: &'static str,
    },
    /// The engine was dropped (or its worker died) before the batch ran.
    #[error("{engine} engine stopped")]
    EngineStopped {
        /// The engine's name.
        engine: &'static str,
    },
    /// An engine configuration value is invalid.
    #[error("invalid engine configuration: {what}")]
    InvalidConfig {
        /// What is wrong.
        what: &'static str,
    },
    /// An OS-level operation of the engine itself failed (e.g. spawning the
    /// worker thread). Storage I/O errors arrive as
    /// [`TransferError::Storage`] with the file's path.
    #[error("{context}: {source}")]
    Io {
        /// What the engine was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A storage operation failed (I/O on the disk file, a range check).
    #[error("storage error: {0}")]
    Storage(#[from] StorageError),
    /// The process that performs a [`RemoteEngine`]'s copies reported the
    /// batch failed, or went away before answering.
    #[error("{engine} engine: the copy failed on the other side: {reason}")]
    Remote {
        /// The engine's name.
        engine: &'static str,
        /// What the other side said.
        reason: String,
    },
    /// A CUDA driver call failed. Only produced with the `cuda` feature;
    /// present regardless so matches do not depend on features.
    #[error("CUDA error: {0}")]
    Cuda(String),
}

impl From<LayoutError> for TransferError {
    fn from(e: LayoutError) -> Self {
        TransferError::Storage(StorageError::Layout(e))
    }
}

/// Engine construction options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// How many batches may wait in the queue (besides the one being
    /// copied) before [`TransferEngine::submit`] returns
    /// [`TransferError::QueueFull`]. Must be at least 1.
    pub queue_depth: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { queue_depth: 16 }
    }
}

/// A snapshot of an engine's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineCounters {
    /// Batches completed successfully.
    pub batches: u64,
    /// Blocks moved by those batches.
    pub blocks: u64,
    /// Bytes moved by those batches.
    pub bytes: u64,
    /// Submissions rejected with [`TransferError::QueueFull`].
    pub rejected: u64,
    /// Batches that ran and failed (e.g. an I/O error).
    pub failed: u64,
}

/// An engine that moves blocks from one tier's storage to another's.
pub trait TransferEngine: Send + Sync {
    /// Short name, used in errors and logs.
    fn name(&self) -> &'static str;

    /// The tier blocks are read from.
    fn source_tier(&self) -> Tier;

    /// The tier blocks are written to.
    fn destination_tier(&self) -> Tier;

    /// A snapshot of the engine's counters.
    fn counters(&self) -> EngineCounters;

    /// Number of blocks in the source storage.
    fn source_num_blocks(&self) -> usize;

    /// Number of blocks in the destination storage.
    fn destination_num_blocks(&self) -> usize;

    /// Validates `pairs` and enqueues the copy. Errors (out-of-range ids,
    /// duplicate destinations, aliasing, full queue, stopped engine) are
    /// returned before anything is copied. An empty batch resolves at once.
    ///
    /// # Safety
    ///
    /// From this call until the returned ticket resolves, no one else may
    /// write the source blocks, nor read or write the destination blocks,
    /// of `pairs`. Dropping the ticket does not cancel the copy: the blocks
    /// stay off-limits until the copy has finished, which after a drop can
    /// only be known by dropping the engine (that joins its worker). Use
    /// [`submit_holding`](Self::submit_holding) to have the worker keep the
    /// owners of the blocks alive until then.
    unsafe fn submit(&self, pairs: Vec<BlockPair>) -> Result<TransferTicket, TransferError> {
        // SAFETY: same contract as this function.
        unsafe { self.submit_holding(pairs, None) }.map_err(|r| r.error)
    }

    /// Copies `pairs` and returns once they are copied: [`submit`](Self::submit)
    /// then [`TransferTicket::wait_blocking`], unless the engine can copy on
    /// the calling thread (the memcpy engine does). For a caller that waits
    /// anyway (vLLM's worker, between two forward passes) that saves two
    /// thread hand-offs, which on a busy machine cost more than copying a
    /// small batch.
    ///
    /// # Safety
    ///
    /// As for [`submit`](Self::submit), until this returns.
    unsafe fn transfer_blocking(
        &self,
        pairs: Vec<BlockPair>,
    ) -> Result<TransferStats, TransferError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.submit(pairs) }?.wait_blocking()
    }

    /// Like [`submit`](Self::submit), and the worker holds `hold` until the
    /// copy has finished: it comes back through
    /// [`TransferTicket::finish`], or is dropped on the worker thread after
    /// the copy when the ticket was dropped. Holding the blocks' owners
    /// (pool handles) this way is what lets [`crate::link::TierLink`] offer
    /// a safe API: no block can be reused while its bytes are in flight. On
    /// rejection, `hold` is handed back untouched.
    ///
    /// # Safety
    ///
    /// As for [`submit`](Self::submit).
    unsafe fn submit_holding(
        &self,
        pairs: Vec<BlockPair>,
        hold: Option<Hold>,
    ) -> Result<TransferTicket, Rejected>;
}

/// Whatever the caller wants kept alive until a copy finishes.
pub type Hold = Box<dyn std::any::Any + Send>;

/// A submission that was refused before anything moved.
#[derive(Debug)]
pub struct Rejected {
    /// Why.
    pub error: TransferError,
    /// The `hold` that came with it, returned.
    pub hold: Option<Hold>,
}

type JobResult = Result<TransferStats, TransferError>;

struct Reply {
    result: JobResult,
    hold: Option<Hold>,
}

impl fmt::Debug for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reply")
            .field("result", &self.result)
            .field("holds", &self.hold.is_some())
            .finish()
    }
}

/// The pending result of a submitted batch.
///
/// Resolves once the worker has finished with the batch (copied it, failed
/// it, or dropped it because the engine stopped). Await it from async code
/// (works under any executor) or call [`wait_blocking`](Self::wait_blocking)
/// from synchronous code.
#[must_use = "the blocks of a batch stay off-limits until its ticket resolves"]
#[derive(Debug)]
pub struct TransferTicket {
    rx: oneshot::Receiver<Reply>,
    engine: &'static str,
}

impl TransferTicket {
    /// A ticket that is already resolved.
    fn ready(engine: &'static str, result: JobResult, hold: Option<Hold>) -> Self {
        let (tx, rx) = oneshot::channel();
        // The receiver is alive (it is right here), so this cannot fail.
        let _ = tx.send(Reply { result, hold });
        TransferTicket { rx, engine }
    }

    /// A ticket and the completer that resolves it, for engines written
    /// outside this crate (an RDMA engine, a test double): the engine does
    /// its copy wherever it likes and calls [`TicketCompleter::complete`].
    pub fn pending(engine: &'static str) -> (TicketCompleter, TransferTicket) {
        let (tx, rx) = oneshot::channel();
        (TicketCompleter { tx }, TransferTicket { rx, engine })
    }

    /// Waits for the batch and returns its result together with the `hold`
    /// given to [`TransferEngine::submit_holding`] (`None` if the worker
    /// died without answering, in which case the hold was dropped with it).
    pub async fn finish(self) -> (Result<TransferStats, TransferError>, Option<Hold>) {
        let engine = self.engine;
        match self.rx.await {
            Ok(Reply { result, hold }) => (result, hold),
            Err(_) => (Err(TransferError::EngineStopped { engine }), None),
        }
    }

    /// Blocks the calling thread until the batch has finished.
    ///
    /// Meant for synchronous callers; inside async code, `.await` the ticket
    /// instead (this would block a runtime worker thread). Does not panic in
    /// either case.
    pub fn wait_blocking(mut self) -> Result<TransferStats, TransferError> {
        struct Unpark(std::thread::Thread);
        impl Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
            fn wake_by_ref(self: &Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        loop {
            // try_recv first: unlike poll, it is not subject to tokio's
            // cooperative budget, so this terminates even if called from a
            // task whose budget is exhausted.
            match self.rx.try_recv() {
                Ok(reply) => return reply.result,
                Err(oneshot::error::TryRecvError::Closed) => {
                    return Err(TransferError::EngineStopped {
                        engine: self.engine,
                    });
                }
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
            // Register our waker, then sleep until woken. The timeout is a
            // safety net for a waker that a budget-exhausted poll deferred.
            match Pin::new(&mut self).poll(&mut cx) {
                Poll::Ready(result) => return result,
                Poll::Pending => std::thread::park_timeout(Duration::from_millis(1)),
            }
        }
    }
}

/// Resolves a [`TransferTicket`] made by [`TransferTicket::pending`].
#[derive(Debug)]
pub struct TicketCompleter {
    tx: oneshot::Sender<Reply>,
}

impl TicketCompleter {
    /// Reports the batch finished (or failed) and hands back its hold. Call
    /// it only once the engine no longer touches the batch's blocks.
    pub fn complete(self, result: Result<TransferStats, TransferError>, hold: Option<Hold>) {
        // A dropped ticket is fine: the hold is then dropped here.
        let _ = self.tx.send(Reply { result, hold });
    }
}

impl Future for TransferTicket {
    type Output = Result<TransferStats, TransferError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let engine = self.engine;
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(Ok(reply)) => Poll::Ready(reply.result),
            // The worker dropped the reply without answering: it died.
            Poll::Ready(Err(_)) => Poll::Ready(Err(TransferError::EngineStopped { engine })),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Checks at engine construction that blocks of `src` fit blocks of `dst`.
pub(crate) fn check_shapes(src: &Layout, dst: &Layout) -> Result<(), TransferError> {
    if src.same_shape(dst) {
        Ok(())
    } else {
        Err(TransferError::LayoutMismatch {
            src: *src.config(),
            dst: *dst.config(),
        })
    }
}

/// Synchronous validation of a batch; see [`TransferEngine::submit`].
/// `same_storage` is true when source and destination are one storage, in
/// which case no block may be both read and written.
pub(crate) fn validate_pairs(
    pairs: &[BlockPair],
    src: &Layout,
    dst: &Layout,
    same_storage: bool,
) -> Result<(), TransferError> {
    for p in pairs {
        if src.check_block(p.src).is_err() {
            return Err(TransferError::BlockOutOfRange {
                side: Side::Source,
                block: p.src,
                num_blocks: src.num_blocks(),
            });
        }
        if dst.check_block(p.dst).is_err() {
            return Err(TransferError::BlockOutOfRange {
                side: Side::Destination,
                block: p.dst,
                num_blocks: dst.num_blocks(),
            });
        }
    }
    if pairs.len() <= SMALL_BATCH {
        conflicts_small(pairs, same_storage)
    } else {
        conflicts_sorted(pairs, same_storage)
    }
}

/// Batches up to this many pairs are checked for conflicts pair against
/// pair, with no allocation: most batches are a block or two (an offload
/// in vLLM's worker is 1-3), and the check runs on every transfer.
const SMALL_BATCH: usize = 32;

/// [`conflicts_sorted`]'s verdict by comparing every pair with every
/// other: the smallest duplicated destination, else the first pair whose
/// source is some pair's destination.
fn conflicts_small(pairs: &[BlockPair], same_storage: bool) -> Result<(), TransferError> {
    let duplicate = pairs
        .iter()
        .enumerate()
        .filter(|(i, p)| pairs[..*i].iter().any(|q| q.dst == p.dst))
        .map(|(_, p)| p.dst)
        .min();
    if let Some(block) = duplicate {
        return Err(TransferError::DuplicateDestination(block));
    }
    let aliased = same_storage
        .then(|| pairs.iter().find(|p| pairs.iter().any(|q| q.dst == p.src)))
        .flatten();
    if let Some(p) = aliased {
        return Err(TransferError::Aliasing(p.src));
    }
    Ok(())
}

/// Two pairs writing one block, or (within one storage) a pair reading a
/// block another writes. Sorting a copy is O(n log n) with no hashing and
/// no allocation proportional to the storage size.
fn conflicts_sorted(pairs: &[BlockPair], same_storage: bool) -> Result<(), TransferError> {
    let mut dsts: Vec<BlockId> = pairs.iter().map(|p| p.dst).collect();
    dsts.sort_unstable();
    if let Some(w) = dsts.windows(2).find(|w| w[0] == w[1]) {
        return Err(TransferError::DuplicateDestination(w[0]));
    }
    let aliased = if same_storage {
        pairs.iter().find(|p| dsts.binary_search(&p.src).is_ok())
    } else {
        None
    };
    if let Some(p) = aliased {
        return Err(TransferError::Aliasing(p.src));
    }
    Ok(())
}

struct Job {
    pairs: Vec<BlockPair>,
    reply: oneshot::Sender<Reply>,
    hold: Option<Hold>,
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    blocks: AtomicU64,
    bytes: AtomicU64,
    rejected: AtomicU64,
    failed: AtomicU64,
}

/// Runs one batch's copy, timed, and counts it: what the worker thread does
/// with each job, and what [`Worker::run_here`] does on the caller's thread.
fn timed<F>(
    name: &'static str,
    counters: &Counters,
    pairs: &[BlockPair],
    copy: &mut F,
) -> Result<TransferStats, TransferError>
where
    F: FnMut(&[BlockPair]) -> Result<u64, TransferError>,
{
    let start = Instant::now();
    let result = copy(pairs);
    let elapsed = start.elapsed();
    match result {
        Ok(bytes) => {
            counters.batches.fetch_add(1, Ordering::Relaxed);
            counters
                .blocks
                .fetch_add(pairs.len() as u64, Ordering::Relaxed);
            counters.bytes.fetch_add(bytes, Ordering::Relaxed);
            Ok(TransferStats {
                blocks: pairs.len(),
                bytes,
                elapsed,
            })
        }
        Err(e) => {
            counters.failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(engine = name, error = %e, "transfer failed");
            Err(e)
        }
    }
}

/// The worker thread and bounded queue shared by all engines. The engine
/// supplies the copy as a closure returning the number of bytes moved.
pub(crate) struct Worker {
    name: &'static str,
    tx: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
    stopping: Arc<AtomicBool>,
    counters: Arc<Counters>,
}

impl Worker {
    pub(crate) fn spawn<F>(
        name: &'static str,
        config: &EngineConfig,
        mut copy: F,
    ) -> Result<Worker, TransferError>
    where
        F: FnMut(&[BlockPair]) -> Result<u64, TransferError> + Send + 'static,
    {
        if config.queue_depth == 0 {
            return Err(TransferError::InvalidConfig {
                what: "queue_depth must be at least 1",
            });
        }
        let (tx, rx) = sync_channel::<Job>(config.queue_depth);
        let stopping = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let thread = {
            let stopping = stopping.clone();
            let counters = counters.clone();
            std::thread::Builder::new()
                .name(format!("kvbm-{name}"))
                .spawn(move || {
                    // recv fails once the engine drops the sender and the
                    // queue is drained.
                    while let Ok(job) = rx.recv() {
                        if stopping.load(Ordering::Acquire) {
                            let _ = job.reply.send(Reply {
                                result: Err(TransferError::EngineStopped { engine: name }),
                                hold: job.hold,
                            });
                            continue;
                        }
                        let reply = timed(name, &counters, &job.pairs, &mut copy);
                        // The ticket may have been dropped; then the hold
                        // comes back here and is dropped now, after the copy.
                        let _ = job.reply.send(Reply {
                            result: reply,
                            hold: job.hold,
                        });
                    }
                })
                .map_err(|source| TransferError::Io {
                    context: format!("spawning the {name} engine worker thread"),
                    source,
                })?
        };
        Ok(Worker {
            name,
            tx: Some(tx),
            thread: Some(thread),
            stopping,
            counters,
        })
    }

    /// Runs a validated batch on the calling thread, counted and timed as
    /// the worker thread would; for callers that would only wait for it.
    pub(crate) fn run_here<F>(
        &self,
        pairs: &[BlockPair],
        mut copy: F,
    ) -> Result<TransferStats, TransferError>
    where
        F: FnMut(&[BlockPair]) -> Result<u64, TransferError>,
    {
        if self.stopping.load(Ordering::Acquire) {
            return Err(TransferError::EngineStopped { engine: self.name });
        }
        if pairs.is_empty() {
            return Ok(TransferStats {
                blocks: 0,
                bytes: 0,
                elapsed: Duration::ZERO,
            });
        }
        timed(self.name, &self.counters, pairs, &mut copy)
    }

    /// Enqueues a validated batch without blocking.
    #[cfg(test)]
    pub(crate) fn submit(&self, pairs: Vec<BlockPair>) -> Result<TransferTicket, TransferError> {
        self.submit_holding(pairs, None).map_err(|r| r.error)
    }

    /// Enqueues a validated batch without blocking; `hold` travels with it.
    pub(crate) fn submit_holding(
        &self,
        pairs: Vec<BlockPair>,
        hold: Option<Hold>,
    ) -> Result<TransferTicket, Rejected> {
        if pairs.is_empty() {
            let stats = TransferStats {
                blocks: 0,
                bytes: 0,
                elapsed: Duration::ZERO,
            };
            return Ok(TransferTicket::ready(self.name, Ok(stats), hold));
        }
        let Some(tx) = self.tx.as_ref() else {
            return Err(Rejected {
                error: TransferError::EngineStopped { engine: self.name },
                hold,
            });
        };
        let (reply, rx) = oneshot::channel();
        match tx.try_send(Job { pairs, reply, hold }) {
            Ok(()) => Ok(TransferTicket {
                rx,
                engine: self.name,
            }),
            Err(TrySendError::Full(job)) => {
                self.counters.rejected.fetch_add(1, Ordering::Relaxed);
                Err(Rejected {
                    error: TransferError::QueueFull { engine: self.name },
                    hold: job.hold,
                })
            }
            Err(TrySendError::Disconnected(job)) => Err(Rejected {
                error: TransferError::EngineStopped { engine: self.name },
                hold: job.hold,
            }),
        }
    }

    pub(crate) fn counters(&self) -> EngineCounters {
        let c = &self.counters;
        EngineCounters {
            batches: c.batches.load(Ordering::Relaxed),
            blocks: c.blocks.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            rejected: c.rejected.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        // Closing the channel ends the worker's loop once it has answered
        // everything still queued (with EngineStopped).
        drop(self.tx.take());
        if let Some(Err(_)) = self.thread.take().map(JoinHandle::join) {
            tracing::error!(engine = self.name, "transfer worker panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LayoutConfig, LayoutKind};
    use std::sync::mpsc;

    fn layout(num_blocks: usize) -> Layout {
        Layout::new(
            LayoutConfig {
                num_blocks,
                num_layers: 2,
                outer_dim: 2,
                page_size: 2,
                inner_dim: 4,
                dtype_bytes: 1,
            },
            LayoutKind::FullyContiguous,
        )
        .unwrap()
    }

    #[test]
    fn validation() {
        let (s, d) = (layout(4), layout(8));
        let ok = [
            BlockPair::new(0, 7),
            BlockPair::new(0, 3),
            BlockPair::new(3, 0),
        ];
        assert!(validate_pairs(&ok, &s, &d, false).is_ok());
        assert!(matches!(
            validate_pairs(&[BlockPair::new(4, 0)], &s, &d, false),
            Err(TransferError::BlockOutOfRange {
                side: Side::Source,
                block: 4,
                num_blocks: 4
            })
        ));
        assert!(matches!(
            validate_pairs(&[BlockPair::new(0, 8)], &s, &d, false),
            Err(TransferError::BlockOutOfRange {
                side: Side::Destination,
                block: 8,
                ..
            })
        ));
        assert!(matches!(
            validate_pairs(&[BlockPair::new(0, 5), BlockPair::new(1, 5)], &s, &d, false),
            Err(TransferError::DuplicateDestination(5))
        ));
        assert!(
            validate_pairs(&[BlockPair::new(0, 1), BlockPair::new(2, 3)], &d, &d, true).is_ok()
        );
        assert!(matches!(
            validate_pairs(&[BlockPair::new(0, 1), BlockPair::new(1, 2)], &d, &d, true),
            Err(TransferError::Aliasing(1))
        ));
        assert!(matches!(
            validate_pairs(&[BlockPair::new(2, 2)], &d, &d, true),
            Err(TransferError::Aliasing(2))
        ));
    }

    proptest::proptest! {
        /// The allocation-free check of small batches gives the sorted
        /// check's verdict, error and block included.
        #[test]
        fn small_batches_conflict_as_sorted_ones_do(
            raw in proptest::collection::vec((0u32..12, 0u32..12), 0..=SMALL_BATCH),
            same_storage in proptest::bool::ANY,
        ) {
            let pairs: Vec<BlockPair> = raw.iter().map(|&(s, d)| BlockPair::new(s, d)).collect();
            proptest::prop_assert_eq!(
                format!("{:?}", conflicts_small(&pairs, same_storage)),
                format!("{:?}", conflicts_sorted(&pairs, same_storage))
            );
        }
    }

    #[test]
    fn zero_queue_depth_is_rejected() {
        let r = Worker::spawn("t", &EngineConfig { queue_depth: 0 }, |_| Ok(0));
        assert!(matches!(r, Err(TransferError::InvalidConfig { .. })));
    }

    /// Deterministic: the first batch blocks the worker until released, the
    /// second fills the depth-1 queue, the third is rejected.
    #[test]
    fn full_queue_returns_queue_full() {
        let (started_tx, started_rx) = mpsc::channel::<()>();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let worker = Worker::spawn("gated", &EngineConfig { queue_depth: 1 }, move |pairs| {
            let _ = started_tx.send(());
            let _ = release_rx.recv();
            Ok(pairs.len() as u64)
        })
        .unwrap();
        let one = || vec![BlockPair::new(0, 0)];
        let first = worker.submit(one()).unwrap();
        started_rx.recv().unwrap(); // the worker holds batch 1, queue empty
        let second = worker.submit(one()).unwrap(); // fills the queue
        assert!(matches!(
            worker.submit(one()),
            Err(TransferError::QueueFull { engine: "gated" })
        ));
        assert_eq!(worker.counters().rejected, 1);
        release_tx.send(()).unwrap();
        release_tx.send(()).unwrap();
        assert_eq!(first.wait_blocking().unwrap().bytes, 1);
        started_rx.recv().unwrap();
        assert_eq!(second.wait_blocking().unwrap().blocks, 1);
        let c = worker.counters();
        assert_eq!(
            (c.batches, c.blocks, c.bytes, c.rejected, c.failed),
            (2, 2, 2, 1, 0)
        );
    }

    #[test]
    fn drop_answers_queued_batches_with_engine_stopped() {
        let (started_tx, started_rx) = mpsc::channel::<()>();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let worker = Worker::spawn("stopping", &EngineConfig { queue_depth: 4 }, move |_| {
            let _ = started_tx.send(());
            let _ = release_rx.recv();
            Ok(0)
        })
        .unwrap();
        let first = worker.submit(vec![BlockPair::new(0, 0)]).unwrap();
        started_rx.recv().unwrap();
        let queued = worker.submit(vec![BlockPair::new(0, 0)]).unwrap();
        // Release the running batch from another thread once drop has begun.
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            let _ = release_tx.send(());
        });
        drop(worker);
        releaser.join().unwrap();
        assert!(first.wait_blocking().is_ok());
        assert!(matches!(
            queued.wait_blocking(),
            Err(TransferError::EngineStopped { engine: "stopping" })
        ));
    }

    #[test]
    fn failed_batches_are_counted_and_reported() {
        let worker = Worker::spawn("failing", &EngineConfig::default(), |_| {
            Err(TransferError::Cuda("boom".into()))
        })
        .unwrap();
        let t = worker.submit(vec![BlockPair::new(1, 1)]).unwrap();
        assert!(matches!(t.wait_blocking(), Err(TransferError::Cuda(_))));
        assert_eq!(worker.counters().failed, 1);
        assert_eq!(worker.counters().batches, 0);
    }

    #[test]
    fn empty_batch_resolves_immediately() {
        let worker = Worker::spawn("empty", &EngineConfig::default(), |_| Ok(0)).unwrap();
        let stats = worker.submit(Vec::new()).unwrap().wait_blocking().unwrap();
        assert_eq!(stats.blocks, 0);
    }

    #[test]
    fn ticket_is_awaitable_on_a_runtime() {
        let worker = Worker::spawn("async", &EngineConfig::default(), |p| {
            Ok(p.len() as u64 * 10)
        })
        .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let stats = rt
            .block_on(async {
                worker
                    .submit(vec![BlockPair::new(0, 1), BlockPair::new(1, 0)])
                    .unwrap()
                    .await
            })
            .unwrap();
        assert_eq!(stats.bytes, 20);
    }
}
