//! Host ↔ disk block copies with positional I/O (`pwrite` / `pread`).

use super::{
    BlockPair, EngineConfig, EngineCounters, Hold, Rejected, TransferEngine, TransferError,
    TransferTicket, Worker, check_shapes, validate_pairs,
};
use crate::storage::{DiskStorage, HostStorage};
use kvbm_events::tier::Tier;
use std::sync::Arc;

/// Which way a [`DiskEngine`] copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DiskDirection {
    /// Offload: host blocks are written to the file (G2 → G3).
    HostToDisk,
    /// Onboard: file blocks are read into host memory (G3 → G2).
    DiskToHost,
}

/// Moves blocks between a [`HostStorage`] and a [`DiskStorage`] in one
/// direction.
///
/// When both layouts are of the same kind, each coalesced block range is
/// written from (or read into) host memory directly, with no intermediate
/// buffer: one `pwrite`/`pread` per block for fully contiguous layouts.
/// When the kinds differ, chunk-sized I/O would be slow, so each block is
/// staged through a block-sized buffer owned by the worker and moved with
/// the coalesced I/O of the disk side.
///
/// The page cache is not bypassed and nothing is `fsync`ed (see
/// [`DiskStorage::sync`]): G3 is a cache.
pub struct DiskEngine {
    // First field: dropped (joined) first.
    worker: Worker,
    host: Arc<HostStorage>,
    disk: Arc<DiskStorage>,
    direction: DiskDirection,
    host_tier: Tier,
}

impl DiskEngine {
    /// Builds an engine with [`EngineConfig::default`]. `host_tier` is the
    /// tier the host storage serves (normally [`Tier::Host`]).
    ///
    /// Errors: [`TransferError::LayoutMismatch`] when the layouts' block
    /// shapes differ; [`TransferError::Io`] if the worker cannot be spawned.
    pub fn new(
        host: Arc<HostStorage>,
        disk: Arc<DiskStorage>,
        direction: DiskDirection,
        host_tier: Tier,
    ) -> Result<Self, TransferError> {
        Self::with_config(host, disk, direction, host_tier, EngineConfig::default())
    }

    /// Builds an engine with an explicit configuration.
    pub fn with_config(
        host: Arc<HostStorage>,
        disk: Arc<DiskStorage>,
        direction: DiskDirection,
        host_tier: Tier,
        config: EngineConfig,
    ) -> Result<Self, TransferError> {
        match direction {
            DiskDirection::HostToDisk => check_shapes(host.layout(), disk.layout())?,
            DiskDirection::DiskToHost => check_shapes(disk.layout(), host.layout())?,
        }
        let name = match direction {
            DiskDirection::HostToDisk => "disk-write",
            DiskDirection::DiskToHost => "disk-read",
        };
        let worker = {
            let (host, disk) = (host.clone(), disk.clone());
            // Only needed when the kinds differ; allocated on first use.
            let mut staging: Vec<u8> = Vec::new();
            Worker::spawn(name, &config, move |pairs| {
                copy_batch(&host, &disk, direction, &mut staging, pairs)
            })?
        };
        Ok(DiskEngine {
            worker,
            host,
            disk,
            direction,
            host_tier,
        })
    }

    /// The direction this engine copies in.
    pub fn direction(&self) -> DiskDirection {
        self.direction
    }

    /// A snapshot of the engine's counters.
    pub fn counters(&self) -> EngineCounters {
        self.worker.counters()
    }
}

/// Runs on the worker thread.
fn copy_batch(
    host: &HostStorage,
    disk: &DiskStorage,
    direction: DiskDirection,
    staging: &mut Vec<u8>,
    pairs: &[BlockPair],
) -> Result<u64, TransferError> {
    let (hl, dl) = (host.layout(), disk.layout());
    let block_bytes = hl.block_bytes();
    let mut bytes = 0u64;
    if hl.kind() == dl.kind() {
        for p in pairs {
            let (host_block, disk_block) = match direction {
                DiskDirection::HostToDisk => (p.src, p.dst),
                DiskDirection::DiskToHost => (p.dst, p.src),
            };
            // Same kind and shape: the i-th ranges of both blocks match.
            for (h, d) in hl
                .block_ranges(host_block)?
                .zip(dl.block_ranges(disk_block)?)
            {
                let ptr = host.range_ptr(&h)?;
                match direction {
                    DiskDirection::HostToDisk => {
                        // SAFETY: `ptr` is valid for h.len initialised
                        // (zeroed at allocation) bytes; submit's contract
                        // guarantees no one writes this source block while
                        // the slice lives.
                        let data = unsafe { std::slice::from_raw_parts(ptr, h.len) };
                        disk.write_range(&d, data)?;
                    }
                    DiskDirection::DiskToHost => {
                        // SAFETY: as above; for a destination block the
                        // contract also excludes readers, so this exclusive
                        // slice aliases nothing.
                        let out = unsafe { std::slice::from_raw_parts_mut(ptr, h.len) };
                        disk.read_range(&d, out)?;
                    }
                }
                bytes += h.len as u64;
            }
        }
    } else {
        // Both layouts list a block's bytes in the same [layer][outer][chunk]
        // order, so a block-sized buffer converts between them.
        staging.resize(block_bytes, 0);
        for p in pairs {
            match direction {
                DiskDirection::HostToDisk => {
                    // SAFETY: submit's contract: no one writes p.src meanwhile.
                    unsafe { host.read_block(p.src, staging)? };
                    disk.write_block(p.dst, staging)?;
                }
                DiskDirection::DiskToHost => {
                    disk.read_block(p.src, staging)?;
                    // SAFETY: submit's contract: no one else touches p.dst.
                    unsafe { host.write_block(p.dst, staging)? };
                }
            }
            bytes += block_bytes as u64;
        }
    }
    Ok(bytes)
}

impl TransferEngine for DiskEngine {
    fn name(&self) -> &'static str {
        match self.direction {
            DiskDirection::HostToDisk => "disk-write",
            DiskDirection::DiskToHost => "disk-read",
        }
    }

    fn source_tier(&self) -> Tier {
        match self.direction {
            DiskDirection::HostToDisk => self.host_tier,
            DiskDirection::DiskToHost => Tier::Disk,
        }
    }

    fn destination_tier(&self) -> Tier {
        match self.direction {
            DiskDirection::HostToDisk => Tier::Disk,
            DiskDirection::DiskToHost => self.host_tier,
        }
    }

    fn counters(&self) -> EngineCounters {
        self.worker.counters()
    }

    fn source_num_blocks(&self) -> usize {
        match self.direction {
            DiskDirection::HostToDisk => self.host.layout(),
            DiskDirection::DiskToHost => self.disk.layout(),
        }
        .num_blocks()
    }

    fn destination_num_blocks(&self) -> usize {
        match self.direction {
            DiskDirection::HostToDisk => self.disk.layout(),
            DiskDirection::DiskToHost => self.host.layout(),
        }
        .num_blocks()
    }

    unsafe fn submit_holding(
        &self,
        pairs: Vec<BlockPair>,
        hold: Option<Hold>,
    ) -> Result<TransferTicket, Rejected> {
        let checked = match self.direction {
            DiskDirection::HostToDisk => {
                validate_pairs(&pairs, self.host.layout(), self.disk.layout(), false)
            }
            DiskDirection::DiskToHost => {
                validate_pairs(&pairs, self.disk.layout(), self.host.layout(), false)
            }
        };
        if let Err(error) = checked {
            return Err(Rejected { error, hold });
        }
        self.worker.submit_holding(pairs, hold)
    }
}
