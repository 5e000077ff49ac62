//! Safe block copies between tiers: pools and engines brought together.
//!
//! A [`TransferEngine`] works on raw block ids and cannot know who else is
//! touching those blocks, so its `submit` is `unsafe`. A [`TierLink`] closes
//! that gap with the pools' ownership rules: it copies *from registered
//! blocks* (immutable: nothing ever writes them) *into mutable blocks it
//! owns* (one owner: nobody else can read or write them), and it hands both
//! to the engine's worker to hold until the bytes have moved. No block can
//! be freed and reused while a copy still touches it, whatever the caller
//! does with the ticket. The one claim that cannot be checked — that the
//! engine's storages really hold these pools' blocks — is made once, when
//! the link is built ([`TierLink::new`] is `unsafe`).
//!
//! [`HostTier`] is the same idea for reading and writing a host block's
//! bytes directly (the simulated forward pass, tests).

use crate::block::{Empty, ImmutableBlock, MutableBlock};
use crate::pool::{BlockPool, PoolError};
use crate::storage::{HostStorage, StorageError};
use crate::transfer::{BlockPair, Hold, Rejected, TransferEngine, TransferError, TransferStats};
use kvbm_events::tier::{BlockId, Tier};
use std::sync::Arc;

/// Which end of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Where blocks are read.
    Source,
    /// Where blocks are written.
    Destination,
}

/// Why a link could not be built or a copy could not be made.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The pool's tier is not the engine's.
    #[error("{end:?} pool is {pool}, but the engine's {end:?} is {engine}")]
    TierMismatch {
        /// Which end.
        end: End,
        /// The engine's tier at that end.
        engine: Tier,
        /// The pool's tier.
        pool: Tier,
    },
    /// The pool has more blocks than the storage behind it.
    #[error("{end:?} pool has {capacity} blocks but its storage only {storage_blocks}")]
    CapacityExceedsStorage {
        /// Which end.
        end: End,
        /// Pool capacity.
        capacity: usize,
        /// Blocks in the storage.
        storage_blocks: usize,
    },
    /// The two pools cut tokens into blocks of different sizes.
    #[error("source pool holds {src}-token blocks, destination pool {dst}-token blocks")]
    BlockSizeMismatch {
        /// Source block size.
        src: usize,
        /// Destination block size.
        dst: usize,
    },
    /// A block that does not belong to the link's pool at that end.
    #[error("block {block} ({tier}) does not belong to the link's {end:?} pool")]
    ForeignBlock {
        /// Which end.
        end: End,
        /// The block's tier.
        tier: Tier,
        /// The block's id.
        block: BlockId,
    },
    /// Sources and destinations must pair up one to one.
    #[error("{sources} source blocks but {destinations} destination blocks")]
    CountMismatch {
        /// Number of sources.
        sources: usize,
        /// Number of destinations.
        destinations: usize,
    },
    /// The destination pool could not supply blocks.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The engine refused or failed the copy.
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// Reading or writing a block's bytes failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
}

/// A refused copy: the error and the blocks, handed back.
#[derive(Debug)]
pub struct CopyRejected {
    /// Why.
    pub error: LinkError,
    /// The source blocks given.
    pub sources: Vec<ImmutableBlock>,
    /// The destination blocks given.
    pub destinations: Vec<MutableBlock<Empty>>,
}

/// A finished copy: the blocks, now safe to use again, and what moved.
#[derive(Debug)]
pub struct Copied {
    /// The source blocks.
    pub sources: Vec<ImmutableBlock>,
    /// The destination blocks, holding the sources' bytes.
    pub destinations: Vec<MutableBlock<Empty>>,
    /// Blocks, bytes and time.
    pub stats: TransferStats,
}

type Held = (Vec<ImmutableBlock>, Vec<MutableBlock<Empty>>);

/// Copies blocks from one pool's storage to another's through an engine.
#[derive(Clone)]
pub struct TierLink {
    engine: Arc<dyn TransferEngine>,
    src: BlockPool,
    dst: BlockPool,
}

impl std::fmt::Debug for TierLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierLink")
            .field("engine", &self.engine.name())
            .field("from", &self.src.tier())
            .field("to", &self.dst.tier())
            .finish()
    }
}

impl TierLink {
    /// Binds an engine to the pools whose blocks its storages hold. Checks
    /// tiers, capacities and block sizes.
    ///
    /// # Safety
    ///
    /// Block `i` of `src` must be block `i` of the engine's source storage,
    /// likewise for `dst`, and those storages must not be written other
    /// than through links and [`HostTier`]s bound to these same pools (which
    /// only ever write blocks they own).
    pub unsafe fn new(
        engine: Arc<dyn TransferEngine>,
        src: BlockPool,
        dst: BlockPool,
    ) -> Result<Self, LinkError> {
        for (end, engine_tier, pool, storage_blocks) in [
            (
                End::Source,
                engine.source_tier(),
                &src,
                engine.source_num_blocks(),
            ),
            (
                End::Destination,
                engine.destination_tier(),
                &dst,
                engine.destination_num_blocks(),
            ),
        ] {
            if engine_tier != pool.tier() {
                return Err(LinkError::TierMismatch {
                    end,
                    engine: engine_tier,
                    pool: pool.tier(),
                });
            }
            if pool.capacity() > storage_blocks {
                return Err(LinkError::CapacityExceedsStorage {
                    end,
                    capacity: pool.capacity(),
                    storage_blocks,
                });
            }
        }
        if src.block_size() != dst.block_size() {
            return Err(LinkError::BlockSizeMismatch {
                src: src.block_size(),
                dst: dst.block_size(),
            });
        }
        Ok(TierLink { engine, src, dst })
    }

    /// The source pool.
    pub fn source(&self) -> &BlockPool {
        &self.src
    }
    /// The destination pool.
    pub fn destination(&self) -> &BlockPool {
        &self.dst
    }
    /// The engine.
    pub fn engine(&self) -> &Arc<dyn TransferEngine> {
        &self.engine
    }

    /// Copies `sources[i]` into `destinations[i]`. Everything is checked
    /// before anything moves; on refusal the blocks come back in
    /// [`CopyRejected`]. The engine's worker holds the blocks until the copy
    /// is done, so dropping the returned future early is safe (the blocks
    /// are then released on the worker once the bytes have moved).
    pub fn copy(
        &self,
        sources: Vec<ImmutableBlock>,
        destinations: Vec<MutableBlock<Empty>>,
    ) -> Result<CopyTicket, Box<CopyRejected>> {
        if let Err(error) = self.check(&sources, &destinations) {
            return Err(Box::new(CopyRejected {
                error,
                sources,
                destinations,
            }));
        }
        let pairs = sources
            .iter()
            .zip(&destinations)
            .map(|(s, d)| BlockPair::new(s.id(), d.id()))
            .collect();
        let hold: Hold = Box::new((sources, destinations));
        // SAFETY: the sources are registered blocks of `self.src` (checked
        // above), which nothing writes; the destinations are mutable blocks
        // of `self.dst`, owned here and so touched by no one else. The
        // worker holds both until the copy is done (`submit_holding`), so
        // neither can be freed and reused meanwhile. `new`'s contract ties
        // the pools to the engine's storages.
        match unsafe { self.engine.submit_holding(pairs, Some(hold)) } {
            Ok(ticket) => Ok(CopyTicket { ticket }),
            Err(Rejected { error, hold }) => {
                let (sources, destinations) = unhold(hold);
                Err(Box::new(CopyRejected {
                    error: error.into(),
                    sources,
                    destinations,
                }))
            }
        }
    }

    /// Allocates destination blocks, copies `sources` into them and
    /// registers them in the destination pool under the sources' hashes.
    /// Returns the registered destination blocks, in order.
    pub async fn copy_and_register(
        &self,
        sources: Vec<ImmutableBlock>,
    ) -> Result<Vec<ImmutableBlock>, LinkError> {
        let destinations = self.dst.allocate(sources.len())?;
        let copied = self
            .copy(sources, destinations)
            .map_err(|r| r.error)?
            .await?;
        Ok(register_copies(copied))
    }

    fn check(
        &self,
        sources: &[ImmutableBlock],
        destinations: &[MutableBlock<Empty>],
    ) -> Result<(), LinkError> {
        if sources.len() != destinations.len() {
            return Err(LinkError::CountMismatch {
                sources: sources.len(),
                destinations: destinations.len(),
            });
        }
        if let Some(b) = sources.iter().find(|b| b.pool_id() != self.src.id()) {
            return Err(LinkError::ForeignBlock {
                end: End::Source,
                tier: b.tier(),
                block: b.id(),
            });
        }
        if let Some(b) = destinations.iter().find(|b| b.pool_id() != self.dst.id()) {
            return Err(LinkError::ForeignBlock {
                end: End::Destination,
                tier: b.tier(),
                block: b.id(),
            });
        }
        Ok(())
    }
}

/// Registers each destination of a finished copy under its source's hashes.
pub fn register_copies(copied: Copied) -> Vec<ImmutableBlock> {
    copied
        .destinations
        .into_iter()
        .zip(&copied.sources)
        .map(|(d, s)| match d.copy_of(s) {
            Ok(c) => c.register_with_priority(s.priority()),
            // Block sizes were checked equal when the link was built.
            Err(e) => unreachable!("link pools have equal block sizes: {e}"),
        })
        .collect()
}

fn unhold(hold: Option<Hold>) -> Held {
    match hold.map(|h| h.downcast::<Held>()) {
        Some(Ok(held)) => *held,
        // Only `TierLink::copy` builds these holds, always of type `Held`.
        _ => (Vec::new(), Vec::new()),
    }
}

/// A copy in flight. Await it for the blocks and the stats.
#[must_use = "await the ticket to get the blocks back"]
#[derive(Debug)]
pub struct CopyTicket {
    ticket: crate::transfer::TransferTicket,
}

impl CopyTicket {
    /// Waits for the copy. On an engine failure the blocks are dropped
    /// (released to their pools) after the worker is done with them.
    pub async fn wait(self) -> Result<Copied, LinkError> {
        let (result, hold) = self.ticket.finish().await;
        let stats = result?;
        let (sources, destinations) = unhold(hold);
        Ok(Copied {
            sources,
            destinations,
            stats,
        })
    }
}

impl std::future::IntoFuture for CopyTicket {
    type Output = Result<Copied, LinkError>;
    type IntoFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Self::Output> + Send>>;
    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.wait())
    }
}

/// A host pool bound to its storage: safe reads and writes of block bytes.
#[derive(Clone)]
pub struct HostTier {
    pool: BlockPool,
    storage: Arc<HostStorage>,
}

impl HostTier {
    /// Binds a pool to the storage that holds its blocks.
    ///
    /// # Safety
    ///
    /// As for [`TierLink::new`]: block `i` of `pool` is block `i` of
    /// `storage`, and the storage is written only through bindings of this
    /// pool.
    pub unsafe fn bind(pool: BlockPool, storage: Arc<HostStorage>) -> Result<Self, LinkError> {
        let storage_blocks = storage.layout().num_blocks();
        if pool.capacity() > storage_blocks {
            return Err(LinkError::CapacityExceedsStorage {
                end: End::Destination,
                capacity: pool.capacity(),
                storage_blocks,
            });
        }
        Ok(HostTier { pool, storage })
    }

    /// The pool.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
    /// The storage.
    pub fn storage(&self) -> &Arc<HostStorage> {
        &self.storage
    }
    /// Bytes per block.
    pub fn block_bytes(&self) -> usize {
        self.storage.layout().block_bytes()
    }

    /// Writes a block's bytes (what a forward pass does). The `&mut` proves
    /// the caller is the block's only owner.
    pub fn write<S>(&self, block: &mut MutableBlock<S>, data: &[u8]) -> Result<(), LinkError> {
        if block.pool_id() != self.pool.id() {
            return Err(LinkError::ForeignBlock {
                end: End::Destination,
                tier: block.tier(),
                block: block.id(),
            });
        }
        // SAFETY: the block is owned (`&mut`) and belongs to this pool, so
        // no one else reads or writes it; `bind` ties pool and storage.
        unsafe { self.storage.write_block(block.id(), data)? };
        Ok(())
    }

    /// Reads a registered block's bytes. Registered blocks are never
    /// written, so any number of readers is fine.
    pub fn read(&self, block: &ImmutableBlock, out: &mut [u8]) -> Result<(), LinkError> {
        if block.pool_id() != self.pool.id() {
            return Err(LinkError::ForeignBlock {
                end: End::Source,
                tier: block.tier(),
                block: block.id(),
            });
        }
        // SAFETY: registered blocks are immutable; `bind` ties pool and
        // storage.
        unsafe { self.storage.read_block(block.id(), out)? };
        Ok(())
    }
}
