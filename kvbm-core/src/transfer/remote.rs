//! An engine whose copies another process performs.
//!
//! When kvbm runs inside an engine that is not ours (vLLM), the device
//! blocks live in that engine's worker process, and only that process can
//! copy them. The block manager still plans every transfer here, through
//! the same pipelines as always; a [`RemoteEngine`] is the engine at the end
//! of such a pipeline: [`TransferEngine::submit_holding`] queues the batch,
//! [`RemoteEngine::take_batches`] hands the queued batches (each with an id)
//! to whoever ships them to the other process, and
//! [`RemoteEngine::complete`] resolves a batch's ticket when that process
//! reports back. Block ids are checked against both sides' block counts
//! when a batch is submitted, as for the other engines.
//!
//! Bounded: at most `queue_depth` batches may be queued or out at once;
//! one more is refused with [`TransferError::QueueFull`] (counted). A batch
//! the other side never answers is failed by [`RemoteEngine::fail_all`]
//! (when that side went away) or when the engine is dropped, so no pipeline
//! waits forever.

use super::{
    BlockPair, EngineConfig, EngineCounters, Hold, Rejected, TicketCompleter, TransferEngine,
    TransferError, TransferStats, TransferTicket, validate_pairs,
};
use crate::layout::Layout;
use kvbm_events::tier::Tier;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A queued batch, to ship to the process that copies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteBatch {
    /// Its id, for [`RemoteEngine::complete`].
    pub id: u64,
    /// The copies: source and destination block ids.
    pub pairs: Vec<BlockPair>,
}

struct Out {
    completer: TicketCompleter,
    hold: Option<Hold>,
    blocks: usize,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    queued: Vec<RemoteBatch>,
    out: HashMap<u64, Out, foldhash::fast::RandomState>,
}

/// See the module docs.
pub struct RemoteEngine {
    name: &'static str,
    src_tier: Tier,
    dst_tier: Tier,
    src: Layout,
    dst: Layout,
    queue_depth: usize,
    inner: Mutex<Inner>,
    batches: AtomicU64,
    blocks: AtomicU64,
    bytes: AtomicU64,
    rejected: AtomicU64,
    failed: AtomicU64,
}

impl std::fmt::Debug for RemoteEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteEngine")
            .field("name", &self.name)
            .field("src_tier", &self.src_tier)
            .field("dst_tier", &self.dst_tier)
            .finish_non_exhaustive()
    }
}

impl RemoteEngine {
    /// An engine from `src` (tier `src_tier`) to `dst` (tier `dst_tier`);
    /// the layouts give the block counts and must have the same block
    /// shape.
    pub fn new(
        name: &'static str,
        src: (Layout, Tier),
        dst: (Layout, Tier),
        cfg: EngineConfig,
    ) -> Result<Self, TransferError> {
        if cfg.queue_depth == 0 {
            return Err(TransferError::InvalidConfig {
                what: "queue_depth must be at least 1",
            });
        }
        super::check_shapes(&src.0, &dst.0)?;
        Ok(RemoteEngine {
            name,
            src_tier: src.1,
            dst_tier: dst.1,
            src: src.0,
            dst: dst.0,
            queue_depth: cfg.queue_depth,
            inner: Mutex::new(Inner::default()),
            batches: AtomicU64::new(0),
            blocks: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The batches queued since the last call, in submission order; they
    /// are out (awaiting [`complete`](Self::complete)) from now on.
    pub fn take_batches(&self) -> Vec<RemoteBatch> {
        std::mem::take(&mut self.lock().queued)
    }

    /// Batches queued or out.
    pub fn pending(&self) -> usize {
        self.lock().out.len()
    }

    /// The other side finished batch `id`: resolves its ticket with
    /// `result` (the bytes it moved and how long it took, or why it
    /// failed). The blocks are the batch's own, whatever the report says:
    /// a batch is copied whole or fails, and the other side need not count
    /// them. False for an id that is not out (already completed, or never
    /// issued): a late or duplicate report changes nothing.
    pub fn complete(&self, id: u64, result: Result<TransferStats, String>) -> bool {
        let out = {
            let mut g = self.lock();
            let Some(out) = g.out.remove(&id) else {
                return false;
            };
            // A batch still queued (never taken) is not shipped any more.
            g.queued.retain(|b| b.id != id);
            out
        };
        let result = match result {
            Ok(mut stats) => {
                stats.blocks = out.blocks;
                self.batches.fetch_add(1, Ordering::Relaxed);
                self.blocks.fetch_add(out.blocks as u64, Ordering::Relaxed);
                self.bytes.fetch_add(stats.bytes, Ordering::Relaxed);
                Ok(stats)
            }
            Err(reason) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                Err(TransferError::Remote {
                    engine: self.name,
                    reason,
                })
            }
        };
        out.completer.complete(result, out.hold);
        true
    }

    /// Fails every batch queued or out (the other side went away, or its
    /// answers can no longer be trusted); how many.
    pub fn fail_all(&self, reason: &str) -> usize {
        let out: Vec<Out> = {
            let mut g = self.lock();
            g.queued.clear();
            g.out.drain().map(|(_, o)| o).collect()
        };
        let n = out.len();
        for o in out {
            self.failed.fetch_add(1, Ordering::Relaxed);
            o.completer.complete(
                Err(TransferError::Remote {
                    engine: self.name,
                    reason: reason.to_string(),
                }),
                o.hold,
            );
        }
        n
    }

    /// Bytes a batch of `blocks` blocks moves.
    pub fn batch_bytes(&self, blocks: usize) -> u64 {
        (blocks as u64).saturating_mul(self.src.block_bytes() as u64)
    }
}

impl TransferEngine for RemoteEngine {
    fn name(&self) -> &'static str {
        self.name
    }

    fn source_tier(&self) -> Tier {
        self.src_tier
    }

    fn destination_tier(&self) -> Tier {
        self.dst_tier
    }

    fn counters(&self) -> EngineCounters {
        EngineCounters {
            batches: self.batches.load(Ordering::Relaxed),
            blocks: self.blocks.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }

    fn source_num_blocks(&self) -> usize {
        self.src.num_blocks()
    }

    fn destination_num_blocks(&self) -> usize {
        self.dst.num_blocks()
    }

    unsafe fn submit_holding(
        &self,
        pairs: Vec<BlockPair>,
        hold: Option<Hold>,
    ) -> Result<TransferTicket, Rejected> {
        if let Err(error) = validate_pairs(&pairs, &self.src, &self.dst, false) {
            return Err(Rejected { error, hold });
        }
        if pairs.is_empty() {
            let (c, t) = TransferTicket::pending(self.name);
            c.complete(
                Ok(TransferStats {
                    blocks: 0,
                    bytes: 0,
                    elapsed: std::time::Duration::ZERO,
                }),
                hold,
            );
            return Ok(t);
        }
        let mut g = self.lock();
        if g.out.len() >= self.queue_depth {
            drop(g);
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(Rejected {
                error: TransferError::QueueFull { engine: self.name },
                hold,
            });
        }
        let id = g.next_id;
        g.next_id += 1;
        let (completer, ticket) = TransferTicket::pending(self.name);
        g.out.insert(
            id,
            Out {
                completer,
                hold,
                blocks: pairs.len(),
            },
        );
        g.queued.push(RemoteBatch { id, pairs });
        Ok(ticket)
    }
}

impl Drop for RemoteEngine {
    fn drop(&mut self) {
        self.fail_all("the engine was dropped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LayoutConfig, LayoutKind};

    fn layout(blocks: usize) -> Layout {
        Layout::new(
            LayoutConfig {
                num_blocks: blocks,
                num_layers: 2,
                outer_dim: 1,
                page_size: 4,
                inner_dim: 8,
                dtype_bytes: 2,
            },
            LayoutKind::FullyContiguous,
        )
        .unwrap()
    }

    fn engine(depth: usize) -> RemoteEngine {
        RemoteEngine::new(
            "remote",
            (layout(8), Tier::Device),
            (layout(4), Tier::Host),
            EngineConfig { queue_depth: depth },
        )
        .unwrap()
    }

    fn stats(blocks: usize) -> TransferStats {
        TransferStats {
            blocks,
            bytes: blocks as u64 * 128,
            elapsed: std::time::Duration::from_micros(5),
        }
    }

    #[test]
    fn batches_go_out_and_come_back() {
        let e = engine(4);
        let t1 = unsafe { e.submit(vec![BlockPair::new(0, 1), BlockPair::new(7, 3)]) }.unwrap();
        let t2 = unsafe { e.submit(vec![BlockPair::new(2, 0)]) }.unwrap();
        let out = e.take_batches();
        assert_eq!(out.len(), 2);
        assert_eq!(
            out[0].pairs,
            vec![BlockPair::new(0, 1), BlockPair::new(7, 3)]
        );
        assert!(e.take_batches().is_empty());
        assert!(e.complete(out[1].id, Err("short read".into())));
        // The other side reports bytes and time; the blocks are the batch's.
        assert!(e.complete(out[0].id, Ok(stats(0))));
        assert!(
            !e.complete(out[0].id, Ok(stats(2))),
            "a second report changes nothing"
        );
        assert_eq!(t1.wait_blocking().unwrap().blocks, 2);
        let err = t2.wait_blocking().unwrap_err().to_string();
        assert!(err.contains("short read"), "{err}");
        let c = e.counters();
        assert_eq!((c.batches, c.blocks, c.failed), (1, 2, 1));
    }

    #[test]
    fn bad_ids_and_a_full_queue_are_refused_before_anything_goes_out() {
        let e = engine(1);
        let r = unsafe { e.submit(vec![BlockPair::new(8, 0)]) };
        assert!(matches!(r, Err(TransferError::BlockOutOfRange { .. })));
        let r = unsafe { e.submit(vec![BlockPair::new(0, 4)]) };
        assert!(matches!(r, Err(TransferError::BlockOutOfRange { .. })));
        let r = unsafe { e.submit(vec![BlockPair::new(0, 1), BlockPair::new(1, 1)]) };
        assert!(matches!(r, Err(TransferError::DuplicateDestination(1))));
        let _t = unsafe { e.submit(vec![BlockPair::new(0, 0)]) }.unwrap();
        let r = unsafe { e.submit(vec![BlockPair::new(1, 1)]) };
        assert!(matches!(r, Err(TransferError::QueueFull { .. })));
        assert_eq!(e.counters().rejected, 1);
        assert_eq!(e.take_batches().len(), 1);
    }

    #[test]
    fn unanswered_batches_fail_when_the_other_side_is_gone() {
        let e = engine(4);
        let t = unsafe { e.submit(vec![BlockPair::new(0, 0)]) }.unwrap();
        let _ = e.take_batches();
        assert_eq!(e.fail_all("worker restarted"), 1);
        assert!(t.wait_blocking().is_err());
        let t = unsafe { e.submit(vec![BlockPair::new(1, 1)]) }.unwrap();
        drop(e);
        assert!(t.wait_blocking().is_err());
    }
}
