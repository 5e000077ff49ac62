//! The memory behind a tier: where the bytes of a [`Layout`] actually live.
//!
//! * [`HostStorage`]: page-aligned host memory, one allocation per layout
//!   region (G2, and the stand-in for G1 when there is no GPU).
//! * [`DiskStorage`]: one preallocated file holding the regions back to back
//!   (G3).
//! * `DeviceStorage` (feature `cuda`): device memory allocated through the
//!   CUDA driver API (G1).
//!
//! Storage knows nothing about which blocks are in use; the pool decides
//! that. Its job is to map a block id to bytes, with every index checked
//! before any pointer arithmetic or I/O happens. Moving blocks between
//! storages is the job of the engines in [`crate::transfer`].

mod disk;
mod host;

#[cfg(feature = "cuda")]
mod device;

pub use disk::DiskStorage;
pub use host::{HostStorage, prefault_in_background};

#[cfg(feature = "cuda")]
pub use device::{DeviceStorage, cuda_available};

use crate::layout::{Layout, LayoutError};
use kvbm_events::tier::BlockId;
use std::path::PathBuf;

/// Why a storage could not be created or accessed.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The layout describes zero bytes.
    #[error("storage size is zero")]
    ZeroSize,
    /// The layout is invalid (zero dimension, overflow) or an index did not
    /// resolve.
    #[error("layout error: {0}")]
    Layout(#[from] LayoutError),
    /// The allocator returned null.
    #[error("failed to allocate {bytes} bytes (alignment {align})")]
    Alloc {
        /// Requested size.
        bytes: usize,
        /// Requested alignment.
        align: usize,
    },
    /// A file operation failed.
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A block id at or beyond the storage's block count.
    #[error("block {block} out of range (storage has {num_blocks} blocks)")]
    BlockOutOfRange {
        /// The requested block.
        block: BlockId,
        /// The storage's block count.
        num_blocks: usize,
    },
    /// A caller buffer whose length is not the block (or range) size.
    #[error("buffer holds {actual} bytes, expected {expected}")]
    SizeMismatch {
        /// The size the operation needs.
        expected: usize,
        /// The buffer's size.
        actual: usize,
    },
    /// A file to share or reuse exists with another size: it holds
    /// something else (or another layout).
    #[error("{} is {found} bytes, expected {expected}: it belongs to something else", path.display())]
    FileSize {
        /// The file.
        path: PathBuf,
        /// The size the layout needs.
        expected: u64,
        /// The size found.
        found: u64,
    },
    /// External memory given for a different number of regions than the
    /// layout has.
    #[error("{found} memory regions given, the layout has {expected}")]
    RegionCount {
        /// The layout's regions.
        expected: usize,
        /// The regions given.
        found: usize,
    },
    /// A CUDA driver call failed, or CUDA is unavailable.
    #[cfg(feature = "cuda")]
    #[error("CUDA error: {0}")]
    Cuda(String),
}

/// Checks a block id against a layout, as a [`StorageError`].
pub(crate) fn check_block(layout: &Layout, block: BlockId) -> Result<(), StorageError> {
    layout
        .check_block(block)
        .map_err(|_| StorageError::BlockOutOfRange {
            block,
            num_blocks: layout.num_blocks(),
        })
}

/// Checks that a caller's buffer is exactly one block.
pub(crate) fn check_len(layout: &Layout, actual: usize) -> Result<(), StorageError> {
    if actual == layout.block_bytes() {
        Ok(())
    } else {
        Err(StorageError::SizeMismatch {
            expected: layout.block_bytes(),
            actual,
        })
    }
}
