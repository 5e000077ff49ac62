//! Disk storage: one preallocated file, regions back to back.

use super::{StorageError, check_block, check_len};
use crate::layout::{Layout, MemRange};
use kvbm_events::tier::BlockId;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// A file holding every region of a [`Layout`]: region `r` starts at byte
/// `r * region_bytes`, and a range's bytes sit at `region start + offset`,
/// so a block is read and written with positional I/O
/// (`pread`/`pwrite` through [`FileExt`]) at fixed offsets.
///
/// Preallocation: [`create`](Self::create) sizes the file with
/// [`File::set_len`] only (std, no `libc`). On most file systems that makes
/// a *sparse* file: the size is reserved in the namespace, not on the
/// device, so running out of space surfaces later as a
/// [`StorageError::Io`] from a block write rather than at creation. A
/// production deployment that wants the space guaranteed up front should
/// `fallocate` the file; this crate deliberately keeps to std.
///
/// The file is not removed on drop: its location is the caller's choice and
/// so is its cleanup (tests put it in a temporary directory).
///
/// Block access is safe: positional reads and writes on a shared `File` are
/// memory-safe, and two writers to the same block only produce mixed bytes
/// on disk, never undefined behaviour. Keeping a block's readers and
/// writers apart is still the caller's (the pool's) job; a block with a
/// pending transfer must not be touched until its ticket resolves.
#[derive(Debug)]
pub struct DiskStorage {
    layout: Layout,
    path: PathBuf,
    file: File,
}

impl DiskStorage {
    /// Creates (or truncates) the file at `path` and sizes it to
    /// [`Layout::total_bytes`]. The file reads as zeroes until written.
    ///
    /// Errors: [`StorageError::Io`] naming `path` when the file cannot be
    /// created or sized (missing directory, no permission, no space).
    pub fn create(path: impl AsRef<Path>, layout: Layout) -> Result<DiskStorage, StorageError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| StorageError::Io {
            path: path.clone(),
            source,
        };
        if layout.total_bytes() == 0 {
            return Err(StorageError::ZeroSize);
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(io)?;
        // total_bytes <= isize::MAX (Layout::new), so it fits in u64.
        let size = u64::try_from(layout.total_bytes()).map_err(|_| {
            io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "layout too large for a file",
            ))
        })?;
        file.set_len(size).map_err(io)?;
        Ok(DiskStorage { layout, path, file })
    }

    /// Opens the file at `path` for `layout` as another process left it,
    /// or creates it (sized, reading as zeroes) when missing; for a tier two
    /// processes share (an engine's worker and the block manager each open
    /// it; whichever comes first creates it). A file of another size is
    /// refused ([`StorageError::FileSize`]): it holds something else.
    pub fn open_or_create(
        path: impl AsRef<Path>,
        layout: Layout,
    ) -> Result<DiskStorage, StorageError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| StorageError::Io {
            path: path.clone(),
            source,
        };
        if layout.total_bytes() == 0 {
            return Err(StorageError::ZeroSize);
        }
        let size = layout.total_bytes() as u64;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            file.set_len(size).map_err(io)?;
        } else if len != size {
            return Err(StorageError::FileSize {
                path,
                expected: size,
                found: len,
            });
        }
        Ok(DiskStorage { layout, path, file })
    }

    /// The layout this storage was built for.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The backing file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io_err(&self, source: std::io::Error) -> StorageError {
        StorageError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// File offset of a range, after checking it lies inside the layout.
    fn file_offset(&self, r: &MemRange) -> Result<u64, StorageError> {
        self.layout.check_range(r)?;
        // In bounds, so region * region_bytes + offset < total_bytes, which
        // fits in isize; checked anyway since it is cheap next to I/O.
        r.region
            .checked_mul(self.layout.region_bytes())
            .and_then(|start| start.checked_add(r.offset))
            .and_then(|off| u64::try_from(off).ok())
            .ok_or(StorageError::Layout(crate::layout::LayoutError::Overflow {
                what: "file offset",
            }))
    }

    /// Writes `data` (exactly `r.len` bytes) at range `r`.
    pub(crate) fn write_range(&self, r: &MemRange, data: &[u8]) -> Result<(), StorageError> {
        let off = self.file_offset(r)?;
        if data.len() != r.len {
            return Err(StorageError::SizeMismatch {
                expected: r.len,
                actual: data.len(),
            });
        }
        self.file
            .write_all_at(data, off)
            .map_err(|e| self.io_err(e))
    }

    /// Reads range `r` into `out` (exactly `r.len` bytes).
    pub(crate) fn read_range(&self, r: &MemRange, out: &mut [u8]) -> Result<(), StorageError> {
        let off = self.file_offset(r)?;
        if out.len() != r.len {
            return Err(StorageError::SizeMismatch {
                expected: r.len,
                actual: out.len(),
            });
        }
        self.file
            .read_exact_at(out, off)
            .map_err(|e| self.io_err(e))
    }

    /// Writes `data` (exactly [`Layout::block_bytes`] bytes, in
    /// `[layer][outer][chunk]` order) into `block`.
    pub fn write_block(&self, block: BlockId, data: &[u8]) -> Result<(), StorageError> {
        check_block(&self.layout, block)?;
        check_len(&self.layout, data.len())?;
        let mut pos = 0;
        for r in self.layout.block_ranges(block)? {
            // In bounds: the ranges sum to block_bytes == data.len().
            self.write_range(&r, &data[pos..pos + r.len])?;
            pos += r.len;
        }
        Ok(())
    }

    /// Reads `block` into `out` (exactly [`Layout::block_bytes`] bytes).
    pub fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), StorageError> {
        check_block(&self.layout, block)?;
        check_len(&self.layout, out.len())?;
        let mut pos = 0;
        for r in self.layout.block_ranges(block)? {
            self.read_range(&r, &mut out[pos..pos + r.len])?;
            pos += r.len;
        }
        Ok(())
    }

    /// Flushes written blocks to the device (`fsync`). Transfers do not do
    /// this on their own: G3 is a cache, and losing it on a crash only costs
    /// recomputation.
    pub fn sync(&self) -> Result<(), StorageError> {
        self.file.sync_data().map_err(|e| self.io_err(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LayoutConfig, LayoutKind};

    fn layout(kind: LayoutKind) -> Layout {
        Layout::new(
            LayoutConfig {
                num_blocks: 5,
                num_layers: 2,
                outer_dim: 2,
                page_size: 4,
                inner_dim: 8,
                dtype_bytes: 1,
            },
            kind,
        )
        .unwrap()
    }

    #[test]
    fn roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        for kind in LayoutKind::ALL {
            let path = dir.path().join(format!("{kind:?}.kv"));
            let d = DiskStorage::create(&path, layout(kind)).unwrap();
            assert_eq!(d.path(), path);
            assert_eq!(
                std::fs::metadata(&path).unwrap().len(),
                d.layout().total_bytes() as u64
            );
            let n = d.layout().block_bytes();
            let data: Vec<u8> = (0..n).map(|i| (i % 200) as u8 + 1).collect();
            d.write_block(4, &data).unwrap();
            let mut out = vec![0u8; n];
            d.read_block(4, &mut out).unwrap();
            assert_eq!(out, data);
            d.read_block(3, &mut out).unwrap();
            assert!(out.iter().all(|&b| b == 0));
            assert!(matches!(
                d.read_block(5, &mut out),
                Err(StorageError::BlockOutOfRange { .. })
            ));
            assert!(matches!(
                d.write_block(0, &data[1..]),
                Err(StorageError::SizeMismatch { .. })
            ));
        }
    }

    #[test]
    fn unwritable_path_names_the_path() {
        let path = Path::new("/nonexistent-kvbm-dir/sub/g3.kv");
        let err = DiskStorage::create(path, layout(LayoutKind::FullyContiguous)).unwrap_err();
        assert!(matches!(err, StorageError::Io { .. }));
        assert!(
            err.to_string().contains("/nonexistent-kvbm-dir/sub/g3.kv"),
            "{err}"
        );
    }
}
