//! [`ShardedEngine`]: one tier move over the shards of a tensor-parallel
//! engine. vLLM shards the KV heads across its tensor-parallel workers, and
//! each rank keeps its own shard of every block in its own host-tier and
//! disk files; a block id names the same block in every shard. Moving a
//! block between two tiers is moving it in every shard, and the move is
//! done when every shard's is.

use super::{BlockPair, EngineCounters, Hold, Rejected, TicketCompleter, TransferEngine};
use super::{TransferError, TransferStats, TransferTicket};
use kvbm_events::Tier;
use std::sync::Arc;

/// The same move in every shard: one engine per shard, all between the
/// same two tiers with the same block counts. See the module docs.
pub struct ShardedEngine {
    shards: Vec<Arc<dyn TransferEngine>>,
}

impl std::fmt::Debug for ShardedEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedEngine")
            .field("shards", &self.shards.len())
            .finish()
    }
}

impl ShardedEngine {
    /// One engine per shard, in rank order. Refused when there are none,
    /// or when they differ in their tiers or block counts (a block id must
    /// name the same block in every shard).
    pub fn new(shards: Vec<Arc<dyn TransferEngine>>) -> Result<Self, TransferError> {
        let Some(first) = shards.first() else {
            return Err(TransferError::InvalidConfig {
                what: "a sharded engine needs a shard",
            });
        };
        let key = |e: &Arc<dyn TransferEngine>| {
            (
                e.source_tier(),
                e.destination_tier(),
                e.source_num_blocks(),
                e.destination_num_blocks(),
            )
        };
        let want = key(first);
        if shards.iter().any(|e| key(e) != want) {
            return Err(TransferError::InvalidConfig {
                what: "the shards differ in their tiers or block counts",
            });
        }
        Ok(ShardedEngine { shards })
    }

    /// How many shards.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }
}

/// Folds the shards' results: the first error, or the blocks of one shard
/// (each copies the same blocks) with every shard's bytes and the longest
/// time.
fn fold(
    results: Vec<Result<TransferStats, TransferError>>,
) -> Result<TransferStats, TransferError> {
    let mut all = TransferStats {
        blocks: 0,
        bytes: 0,
        elapsed: std::time::Duration::ZERO,
    };
    for r in results {
        let s = r?;
        all.blocks = s.blocks;
        all.bytes += s.bytes;
        all.elapsed = all.elapsed.max(s.elapsed);
    }
    Ok(all)
}

impl TransferEngine for ShardedEngine {
    fn name(&self) -> &'static str {
        "sharded"
    }

    fn source_tier(&self) -> Tier {
        self.shards[0].source_tier()
    }

    fn destination_tier(&self) -> Tier {
        self.shards[0].destination_tier()
    }

    fn counters(&self) -> EngineCounters {
        let mut c = EngineCounters::default();
        for s in &self.shards {
            let o = s.counters();
            // A batch is one batch however many shards copy it.
            c.batches = c.batches.max(o.batches);
            c.blocks = c.blocks.max(o.blocks);
            c.bytes += o.bytes;
            c.rejected += o.rejected;
            c.failed += o.failed;
        }
        c
    }

    fn source_num_blocks(&self) -> usize {
        self.shards[0].source_num_blocks()
    }

    fn destination_num_blocks(&self) -> usize {
        self.shards[0].destination_num_blocks()
    }

    unsafe fn transfer_blocking(
        &self,
        pairs: Vec<BlockPair>,
    ) -> Result<TransferStats, TransferError> {
        let mut results = Vec::with_capacity(self.shards.len());
        for s in &self.shards {
            // SAFETY: the caller's promise holds for every shard's copy of
            // these blocks.
            results.push(unsafe { s.transfer_blocking(pairs.clone()) });
        }
        fold(results)
    }

    unsafe fn submit_holding(
        &self,
        pairs: Vec<BlockPair>,
        hold: Option<Hold>,
    ) -> Result<TransferTicket, Rejected> {
        let mut tickets = Vec::with_capacity(self.shards.len());
        for s in &self.shards {
            // SAFETY: the caller's promise holds for every shard's copy.
            match unsafe { s.submit(pairs.clone()) } {
                Ok(t) => tickets.push(t),
                Err(error) if tickets.is_empty() => return Err(Rejected { error, hold }),
                Err(error) => {
                    // Earlier shards are copying already: the batch (and its
                    // hold) resolves once they are done, as failed.
                    let (done, ticket) = TransferTicket::pending("sharded");
                    finish_all(tickets, Some(error), hold, done);
                    return Ok(ticket);
                }
            }
        }
        let (done, ticket) = TransferTicket::pending("sharded");
        finish_all(tickets, None, hold, done);
        Ok(ticket)
    }
}

/// Resolves `done` once every ticket has: on the current tokio runtime
/// when there is one (the pipelines submit from theirs), else on a thread.
fn finish_all(
    tickets: Vec<TransferTicket>,
    error: Option<TransferError>,
    hold: Option<Hold>,
    done: TicketCompleter,
) {
    let wait = async move {
        let mut results = Vec::with_capacity(tickets.len() + 1);
        for t in tickets {
            results.push(t.await);
        }
        if let Some(e) = error {
            results.push(Err(e));
        }
        done.complete(fold(results), hold);
    };
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn(wait);
        }
        Err(_) => {
            std::thread::spawn(move || {
                match tokio::runtime::Builder::new_current_thread().build() {
                    Ok(rt) => rt.block_on(wait),
                    // Without a runtime the future is dropped: its completer
                    // with it, and the ticket reports the engine stopped.
                    Err(_) => drop(wait),
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Layout, LayoutConfig, LayoutKind};
    use crate::storage::HostStorage;
    use crate::transfer::MemcpyEngine;

    fn storage(blocks: usize) -> Arc<HostStorage> {
        let config = LayoutConfig {
            num_blocks: blocks,
            num_layers: 2,
            outer_dim: 1,
            page_size: 4,
            inner_dim: 8,
            dtype_bytes: 1,
        };
        Arc::new(
            HostStorage::new(Layout::new(config, LayoutKind::FullyContiguous).unwrap()).unwrap(),
        )
    }

    /// Each shard's block moves in that shard only: shards never mix.
    #[test]
    fn every_shard_moves_its_own_bytes() {
        let shards: Vec<(Arc<HostStorage>, Arc<HostStorage>)> =
            (0..3).map(|_| (storage(4), storage(4))).collect();
        let n = shards[0].0.layout().block_bytes();
        for (k, (src, _)) in shards.iter().enumerate() {
            // SAFETY: single-threaded; nothing else holds them.
            unsafe { src.write_block(1, &vec![k as u8 + 1; n]).unwrap() };
        }
        let engines: Vec<Arc<dyn TransferEngine>> = shards
            .iter()
            .map(|(s, d)| {
                Arc::new(MemcpyEngine::new(s.clone(), Tier::Host, d.clone(), Tier::Disk).unwrap())
                    as Arc<dyn TransferEngine>
            })
            .collect();
        let e = ShardedEngine::new(engines).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        // SAFETY: nothing else touches these storages.
        let stats = rt
            .block_on(async {
                unsafe { e.submit(vec![BlockPair::new(1, 3)]) }
                    .unwrap()
                    .await
            })
            .unwrap();
        assert_eq!(stats.blocks, 1);
        assert_eq!(stats.bytes, 3 * n as u64, "every shard's bytes");
        for (k, (_, dst)) in shards.iter().enumerate() {
            let mut out = vec![0; n];
            unsafe { dst.read_block(3, &mut out).unwrap() };
            assert_eq!(out, vec![k as u8 + 1; n], "shard {k}");
        }
        // Blocking, and without a runtime.
        let stats = unsafe { e.transfer_blocking(vec![BlockPair::new(1, 2)]) }.unwrap();
        assert_eq!(stats.bytes, 3 * n as u64);
        let t = unsafe { e.submit(vec![BlockPair::new(1, 0)]) }.unwrap();
        assert_eq!(t.wait_blocking().unwrap().bytes, 3 * n as u64);
    }

    #[test]
    fn shards_must_agree_and_an_error_in_one_fails_the_batch() {
        let a: Arc<dyn TransferEngine> =
            Arc::new(MemcpyEngine::new(storage(4), Tier::Host, storage(4), Tier::Disk).unwrap());
        let b: Arc<dyn TransferEngine> =
            Arc::new(MemcpyEngine::new(storage(4), Tier::Host, storage(5), Tier::Disk).unwrap());
        assert!(ShardedEngine::new(vec![a.clone(), b]).is_err());
        assert!(ShardedEngine::new(Vec::new()).is_err());
        let e = ShardedEngine::new(vec![a.clone(), a]).unwrap();
        // Out of range in every shard: refused before anything moves.
        let r = unsafe { e.submit(vec![BlockPair::new(9, 0)]) };
        assert!(
            matches!(r, Err(TransferError::BlockOutOfRange { .. })),
            "{r:?}"
        );
    }
}
