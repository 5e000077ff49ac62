//! Host memory storage: one zeroed, page-aligned allocation per layout
//! region; or one memory-mapped file holding every region, which several
//! processes can map at once; or memory someone else owns (an engine's KV
//! tensors), wrapped without a copy.

use super::{StorageError, check_block, check_len};
use crate::layout::{Layout, MemRange, REGION_ALIGN};
use kvbm_events::tier::BlockId;
use std::alloc;
use std::ptr::NonNull;

/// Host memory for a [`Layout`]: one allocation of
/// [`Layout::region_bytes`] per region, aligned to [`REGION_ALIGN`] (4096,
/// so regions can be registered with the CUDA driver as pinned memory),
/// zero-initialised, freed on drop.
///
/// Byte access goes through raw pointers because transfer engines write into
/// this memory from their worker threads while other blocks of the same
/// region are read or written elsewhere; a `&mut [u8]` over a whole region
/// could not express that. The methods that touch bytes are therefore
/// `unsafe`: the caller promises that no one else accesses the same block
/// concurrently (see each method's `# Safety`). Higher up, the pool's
/// ownership rules (a mutable block has a single owner; registered blocks
/// are never written) are what uphold this.
pub struct HostStorage {
    layout: Layout,
    /// Bytes of each region's memory (at least `region_bytes`); what is
    /// pinned for CUDA.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    region_len: usize,
    backing: Backing,
    regions: Vec<NonNull<u8>>,
    /// The CUDA context the regions are registered (pinned) with, if any;
    /// unregistered on drop, before the memory is freed.
    #[cfg(feature = "cuda")]
    pinned: std::sync::Mutex<Option<std::sync::Arc<cudarc::driver::CudaContext>>>,
}

// SAFETY: `HostStorage` exclusively owns its allocations; the pointers are
// never handed out as references with a lifetime, and they stay valid and
// fixed until `Drop`. Everything reachable through `&self` without `unsafe`
// is immutable metadata (the layout). Concurrent byte access from several
// threads is only possible through the `unsafe` methods, whose contract
// makes the caller responsible for the absence of data races per block.
// Moving the storage to another thread moves ownership of plain heap memory,
// which has no thread affinity.
unsafe impl Send for HostStorage {}
// SAFETY: see `Send` above; shared access is read-only except through
// `unsafe` methods that require the caller to exclude races.
unsafe impl Sync for HostStorage {}

/// Who owns a [`HostStorage`]'s memory.
enum Backing {
    /// Allocated here with this layout, one allocation per region.
    Owned(alloc::Layout),
    /// A shared mapping of a file (regions back to back, page aligned).
    Mapped {
        _map: memmap2::MmapRaw,
        path: std::path::PathBuf,
    },
    /// Someone else's; they keep it alive and in place.
    External,
}

/// The stride of regions inside one mapping: each starts on a page.
fn mapped_stride(layout: &Layout) -> usize {
    layout.region_bytes().div_ceil(REGION_ALIGN) * REGION_ALIGN
}

impl std::fmt::Debug for HostStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStorage")
            .field("layout", &self.layout)
            .field("regions", &self.regions.len())
            .finish()
    }
}

impl HostStorage {
    /// Allocates zeroed memory for every region of `layout`.
    ///
    /// Errors: [`StorageError::ZeroSize`] (cannot happen for a valid layout,
    /// checked anyway), [`StorageError::Alloc`] when the allocator fails.
    /// Allocation cost: zeroing touches every page, so creation time is
    /// proportional to the size.
    pub fn new(layout: Layout) -> Result<HostStorage, StorageError> {
        let bytes = layout.region_bytes();
        if bytes == 0 {
            return Err(StorageError::ZeroSize);
        }
        // Layout::new checked that the total, rounded up to REGION_ALIGN,
        // fits in isize, so this cannot fail; map the error anyway.
        let alloc_layout = alloc::Layout::from_size_align(bytes, REGION_ALIGN).map_err(|_| {
            StorageError::Alloc {
                bytes,
                align: REGION_ALIGN,
            }
        })?;
        let mut storage = HostStorage {
            layout,
            region_len: bytes,
            backing: Backing::Owned(alloc_layout),
            regions: Vec::with_capacity(layout.num_regions()),
            #[cfg(feature = "cuda")]
            pinned: std::sync::Mutex::new(None),
        };
        for _ in 0..layout.num_regions() {
            // SAFETY: alloc_layout has a non-zero size (checked above).
            let ptr = unsafe { alloc::alloc_zeroed(alloc_layout) };
            // On failure, `storage` is dropped and frees the regions
            // allocated so far.
            let ptr = NonNull::new(ptr).ok_or(StorageError::Alloc {
                bytes,
                align: REGION_ALIGN,
            })?;
            storage.regions.push(ptr);
        }
        Ok(storage)
    }

    /// The size of the file [`HostStorage::shared`] maps for `layout`
    /// (each region starts on a page): what a caller reserving its room
    /// ahead (`posix_fallocate`) must reserve. `None` when it overflows.
    pub fn shared_len(layout: &Layout) -> Option<usize> {
        mapped_stride(layout).checked_mul(layout.num_regions())
    }

    /// Memory every process can see: the file at `path` (created when
    /// missing, sized to hold every region of `layout`, each starting on a
    /// page), mapped shared. Two processes opening the same path with the
    /// same layout see each other's writes; that is how an engine's worker
    /// process and the block manager share the host tier. A file that
    /// exists with another size is refused ([`StorageError::FileSize`]):
    /// it belongs to something else. The file is not removed on drop.
    pub fn shared(
        path: impl AsRef<std::path::Path>,
        layout: Layout,
    ) -> Result<HostStorage, StorageError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| StorageError::Io {
            path: path.clone(),
            source,
        };
        let stride = mapped_stride(&layout);
        let total = Self::shared_len(&layout)
            .filter(|t| *t > 0)
            .ok_or(StorageError::ZeroSize)?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            file.set_len(total as u64).map_err(io)?;
        } else if len != total as u64 {
            return Err(StorageError::FileSize {
                path,
                expected: total as u64,
                found: len,
            });
        }
        let map = memmap2::MmapOptions::new()
            .len(total)
            .map_raw(&file)
            .map_err(io)?;
        let base = map.as_mut_ptr();
        let regions = (0..layout.num_regions())
            .map(|r| {
                // SAFETY: r * stride < total, the mapping's length.
                NonNull::new(unsafe { base.add(r * stride) }).ok_or(StorageError::ZeroSize)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(HostStorage {
            layout,
            region_len: stride,
            backing: Backing::Mapped { _map: map, path },
            regions,
            #[cfg(feature = "cuda")]
            pinned: std::sync::Mutex::new(None),
        })
    }

    /// Wraps memory this storage does not own: `regions[r]` is the start
    /// of region `r` of `layout` (an engine's KV tensors, one per layer).
    /// Nothing is copied or freed.
    ///
    /// # Safety
    ///
    /// Each pointer must be valid for reads and writes of
    /// [`Layout::region_bytes`] bytes for as long as the storage (and any
    /// engine holding it) lives, and nothing outside the block manager may
    /// touch a block while a transfer of it is pending.
    pub unsafe fn external(
        layout: Layout,
        regions: Vec<*mut u8>,
    ) -> Result<HostStorage, StorageError> {
        if regions.len() != layout.num_regions() {
            return Err(StorageError::RegionCount {
                expected: layout.num_regions(),
                found: regions.len(),
            });
        }
        let regions = regions
            .into_iter()
            .map(|p| NonNull::new(p).ok_or(StorageError::ZeroSize))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(HostStorage {
            layout,
            region_len: layout.region_bytes(),
            backing: Backing::External,
            regions,
            #[cfg(feature = "cuda")]
            pinned: std::sync::Mutex::new(None),
        })
    }

    /// The file behind a [`shared`](Self::shared) storage.
    pub fn shared_path(&self) -> Option<&std::path::Path> {
        match &self.backing {
            Backing::Mapped { path, .. } => Some(path),
            _ => None,
        }
    }

    /// The layout this storage was built for.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Faults in, writable, the pages of bytes `offset..offset + len` of a
    /// shared mapping ([`HostStorage::shared`]), without touching their
    /// contents (`MADV_POPULATE_WRITE`). Returns how many bytes of the
    /// range exist (0 past the end, or for memory not mapped here).
    ///
    /// Why: a shared file's pages are allocated on first write, and in a
    /// virtual machine a first write costs microseconds a page; done during
    /// an offload, that is most of a small batch's copy time. Faulting them
    /// in ahead makes an offload cost what a copy costs, the way pinned
    /// host memory is allocated up front. Safe while copies run: the call
    /// reads and writes no byte.
    ///
    /// Errors: the `madvise` error (`EINVAL` on kernels before 5.14, which
    /// lack the advice; `ENOMEM`/`EFAULT` when memory runs out).
    pub fn prefault(&self, offset: usize, len: usize) -> std::io::Result<usize> {
        let Backing::Mapped { _map: map, .. } = &self.backing else {
            return Ok(0);
        };
        let len = len.min(map.len().saturating_sub(offset));
        if len == 0 {
            return Ok(0);
        }
        #[cfg(target_os = "linux")]
        map.advise_range(memmap2::Advice::PopulateWrite, offset, len)?;
        Ok(len)
    }

    /// The bytes of the shared mapping ([`HostStorage::shared`]); 0 for
    /// memory not mapped here.
    pub fn mapped_len(&self) -> usize {
        match &self.backing {
            Backing::Mapped { _map: map, .. } => map.len(),
            _ => 0,
        }
    }

    /// Copies `data` (exactly [`Layout::block_bytes`] bytes, in
    /// `[layer][outer][chunk]` order) into `block`.
    ///
    /// # Safety
    ///
    /// While this runs, no one else may read or write `block` in this
    /// storage (including transfer engines with a pending ticket that names
    /// it). Other blocks may be accessed concurrently.
    pub unsafe fn write_block(&self, block: BlockId, data: &[u8]) -> Result<(), StorageError> {
        check_block(&self.layout, block)?;
        check_len(&self.layout, data.len())?;
        let mut pos = 0;
        for r in self.layout.block_ranges(block)? {
            let dst = self.range_ptr(&r)?;
            // SAFETY: `dst` is valid for r.len bytes (range_ptr checked it);
            // `data[pos..pos + r.len]` is in bounds because the ranges sum to
            // block_bytes == data.len(); `data` is a shared borrow that
            // cannot alias memory we own; the caller excludes other access
            // to this block.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(pos), dst, r.len) };
            pos += r.len;
        }
        Ok(())
    }

    /// Copies `block` into `out` (exactly [`Layout::block_bytes`] bytes, in
    /// `[layer][outer][chunk]` order).
    ///
    /// # Safety
    ///
    /// While this runs, no one else may write `block` in this storage
    /// (concurrent reads are fine).
    pub unsafe fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), StorageError> {
        check_block(&self.layout, block)?;
        check_len(&self.layout, out.len())?;
        let mut pos = 0;
        for r in self.layout.block_ranges(block)? {
            let src = self.range_ptr(&r)?;
            // SAFETY: as in write_block, with the roles swapped; `out` is an
            // exclusive borrow and so cannot overlap our allocation.
            unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr().add(pos), r.len) };
            pos += r.len;
        }
        Ok(())
    }

    /// Pointer to the first byte of `r`, after checking that `r` lies inside
    /// one of the regions. The pointer is valid for `r.len` bytes for as long
    /// as this storage lives; dereferencing it is subject to the same
    /// per-block exclusivity as [`write_block`](Self::write_block).
    pub(crate) fn range_ptr(&self, r: &MemRange) -> Result<*mut u8, StorageError> {
        self.layout.check_range(r)?;
        let base = self.regions.get(r.region).ok_or(StorageError::Layout(
            crate::layout::LayoutError::RangeOutOfBounds {
                range: *r,
                num_regions: self.regions.len(),
                region_bytes: self.layout.region_bytes(),
            },
        ))?;
        // SAFETY: r.offset + r.len <= region_bytes (check_range), so the
        // offset stays inside (or one past the end of) the allocation.
        Ok(unsafe { base.as_ptr().add(r.offset) })
    }

    /// Registers every region with the CUDA driver as page-locked (pinned)
    /// memory, so asynchronous copies to and from the device are real DMA
    /// rather than staged, synchronous copies. Idempotent: a second call
    /// (e.g. from a second engine) is a no-op. The registration lasts until
    /// the storage is dropped, which is after every engine holding it.
    #[cfg(feature = "cuda")]
    pub fn pin_for_cuda(
        &self,
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    ) -> Result<(), StorageError> {
        use cudarc::driver::sys;
        let mut pinned = self
            .pinned
            .lock()
            .map_err(|_| StorageError::Cuda("pin registry lock poisoned".into()))?;
        if pinned.is_some() {
            return Ok(());
        }
        ctx.bind_to_thread()
            .map_err(|e| StorageError::Cuda(format!("bind context: {e}")))?;
        for (i, region) in self.regions.iter().enumerate() {
            // SAFETY: the region is a live allocation of alloc_layout.size()
            // bytes; it stays allocated until Drop, which unregisters first.
            let res = unsafe {
                sys::cuMemHostRegister_v2(
                    region.as_ptr().cast(),
                    self.region_len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            }
            .result();
            if let Err(e) = res {
                // Undo the regions registered so far, so the storage is left
                // consistently unpinned.
                for done in &self.regions[..i] {
                    // SAFETY: registered just above by this call.
                    let _ = unsafe { sys::cuMemHostUnregister(done.as_ptr().cast()) };
                }
                return Err(StorageError::Cuda(format!(
                    "cuMemHostRegister of {} bytes: {e}",
                    self.region_len
                )));
            }
        }
        *pinned = Some(ctx.clone());
        Ok(())
    }
}

/// Faults in a shared storage's pages ([`HostStorage::prefault`]) on a
/// thread of its own, `chunk` bytes at a time, so that creating a large
/// host tier does not wait for it. The thread holds only a weak reference:
/// it stops when the storage is dropped, and on the first error (logged:
/// the pages are then faulted in by the copies, as without it). Returns
/// the thread, whose result is the bytes faulted in.
pub fn prefault_in_background(
    storage: &std::sync::Arc<HostStorage>,
    chunk: usize,
) -> std::io::Result<std::thread::JoinHandle<usize>> {
    let weak = std::sync::Arc::downgrade(storage);
    let chunk = chunk.max(REGION_ALIGN);
    std::thread::Builder::new()
        .name("kvbm-prefault".into())
        .spawn(move || {
            let mut done = 0;
            while let Some(s) = weak.upgrade() {
                match s.prefault(done, chunk) {
                    Ok(0) => break,
                    Ok(n) => done += n,
                    Err(e) => {
                        // Said, not hidden: on a full tmpfs the copies
                        // would fault too (a caller reserving the file's
                        // room ahead, as kvbm's vLLM connector does, makes
                        // that impossible).
                        tracing::warn!(
                            error = %e,
                            faulted = done,
                            "host tier: pages not faulted in ahead (the copies will fault them)"
                        );
                        break;
                    }
                }
            }
            done
        })
}

impl Drop for HostStorage {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        {
            let ctx = match self.pinned.get_mut() {
                Ok(p) => p.take(),
                Err(poisoned) => poisoned.into_inner().take(),
            };
            if let Some(ctx) = ctx {
                if let Err(e) = ctx.bind_to_thread() {
                    tracing::warn!("HostStorage drop: cannot bind CUDA context: {e}");
                }
                for region in &self.regions {
                    // SAFETY: registered in pin_for_cuda; unregistering before
                    // the free below.
                    if let Err(e) =
                        unsafe { cudarc::driver::sys::cuMemHostUnregister(region.as_ptr().cast()) }
                            .result()
                    {
                        tracing::warn!("cuMemHostUnregister failed: {e}");
                    }
                }
            }
        }
        if let Backing::Owned(alloc_layout) = self.backing {
            for region in self.regions.drain(..) {
                // SAFETY: allocated with exactly this layout in `new`, freed
                // once.
                unsafe { alloc::dealloc(region.as_ptr(), alloc_layout) };
            }
        }
        // A mapping is unmapped when `backing` drops; external memory is
        // its owner's.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LayoutConfig, LayoutKind};

    fn layout(kind: LayoutKind) -> Layout {
        Layout::new(
            LayoutConfig {
                num_blocks: 6,
                num_layers: 3,
                outer_dim: 2,
                page_size: 4,
                inner_dim: 16,
                dtype_bytes: 2,
            },
            kind,
        )
        .unwrap()
    }

    #[test]
    fn roundtrip_and_zeroed() {
        for kind in LayoutKind::ALL {
            let s = HostStorage::new(layout(kind)).unwrap();
            let n = s.layout().block_bytes();
            let mut out = vec![1u8; n];
            // SAFETY: single-threaded test, no concurrent access.
            unsafe { s.read_block(5, &mut out).unwrap() };
            assert!(out.iter().all(|&b| b == 0));
            let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
            unsafe { s.write_block(3, &data).unwrap() };
            unsafe { s.read_block(3, &mut out).unwrap() };
            assert_eq!(out, data);
            // Neighbours untouched.
            unsafe { s.read_block(2, &mut out).unwrap() };
            assert!(out.iter().all(|&b| b == 0));
            unsafe { s.read_block(4, &mut out).unwrap() };
            assert!(out.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn bad_block_and_size() {
        let s = HostStorage::new(layout(LayoutKind::LayerSeparate)).unwrap();
        let n = s.layout().block_bytes();
        let mut out = vec![0u8; n];
        assert!(matches!(
            unsafe { s.read_block(6, &mut out) },
            Err(StorageError::BlockOutOfRange {
                block: 6,
                num_blocks: 6
            })
        ));
        assert!(matches!(
            unsafe { s.write_block(0, &out[1..]) },
            Err(StorageError::SizeMismatch { .. })
        ));
        assert!(
            s.range_ptr(&MemRange {
                region: 3,
                offset: 0,
                len: 1
            })
            .is_err()
        );
        assert!(
            s.range_ptr(&MemRange {
                region: 0,
                offset: s.layout().region_bytes(),
                len: 1
            })
            .is_err()
        );
    }

    #[test]
    fn region_alignment() {
        let s = HostStorage::new(layout(LayoutKind::LayerSeparate)).unwrap();
        for r in 0..3 {
            let p = s
                .range_ptr(&MemRange {
                    region: r,
                    offset: 0,
                    len: 0,
                })
                .unwrap();
            assert_eq!(p as usize % REGION_ALIGN, 0);
        }
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn is_send_sync() {
        assert_send_sync::<HostStorage>();
    }

    /// Two storages on one file (as two processes would map it) see each
    /// other's writes; a file of another size is refused, not reused.
    #[test]
    fn a_shared_file_is_one_memory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g2.shm");
        let l = layout(LayoutKind::LayerSeparate);
        let a = HostStorage::shared(&path, l).unwrap();
        let b = HostStorage::shared(&path, l).unwrap();
        assert_eq!(a.shared_path(), Some(path.as_path()));
        let data: Vec<u8> = (0..l.block_bytes()).map(|i| (i * 7) as u8).collect();
        let mut out = vec![0u8; l.block_bytes()];
        unsafe { a.write_block(3, &data).unwrap() };
        unsafe { b.read_block(3, &mut out).unwrap() };
        assert_eq!(out, data);
        drop((a, b));
        let other = Layout::new(
            LayoutConfig {
                num_blocks: l.num_blocks() * 1000,
                ..*l.config()
            },
            LayoutKind::LayerSeparate,
        )
        .unwrap();
        assert!(matches!(
            HostStorage::shared(&path, other),
            Err(StorageError::FileSize { .. })
        ));
    }

    /// Prefaulting a shared file allocates its pages (the file stops being
    /// sparse) without changing a byte of it; on memory that is not a
    /// mapping it does nothing.
    #[cfg(target_os = "linux")]
    #[test]
    fn prefault_allocates_a_shared_file_without_writing_it() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g2.shm");
        // Many pages a region, so that one block written is not all of it.
        let small = layout(LayoutKind::LayerSeparate);
        let l = Layout::new(
            LayoutConfig {
                num_blocks: 4096,
                ..*small.config()
            },
            LayoutKind::LayerSeparate,
        )
        .unwrap();
        let s = std::sync::Arc::new(HostStorage::shared(&path, l).unwrap());
        let data: Vec<u8> = (0..l.block_bytes()).map(|i| (i * 13) as u8).collect();
        unsafe { s.write_block(2, &data).unwrap() };
        let allocated = || std::fs::metadata(&path).unwrap().blocks() * 512;
        let before = allocated();
        assert!(before < s.mapped_len() as u64 / 4, "{before}");
        let t = prefault_in_background(&s, 2 * REGION_ALIGN).unwrap();
        assert_eq!(t.join().unwrap(), s.mapped_len());
        assert!(allocated() >= s.mapped_len() as u64, "{}", allocated());
        let mut out = vec![0u8; l.block_bytes()];
        unsafe { s.read_block(2, &mut out).unwrap() };
        assert_eq!(out, data);
        unsafe { s.read_block(5, &mut out).unwrap() };
        assert!(out.iter().all(|b| *b == 0));
        assert_eq!(
            HostStorage::new(l).unwrap().prefault(0, 1 << 20).unwrap(),
            0
        );
    }

    /// Memory owned elsewhere is read and written in place, never freed.
    #[test]
    fn external_memory_is_used_in_place() {
        let l = layout(LayoutKind::LayerSeparate);
        let mut owner: Vec<Vec<u8>> = (0..l.num_regions())
            .map(|_| vec![0u8; l.region_bytes()])
            .collect();
        let ptrs = owner.iter_mut().map(|v| v.as_mut_ptr()).collect();
        let s = unsafe { HostStorage::external(l, ptrs) }.unwrap();
        let data: Vec<u8> = (0..l.block_bytes()).map(|i| i as u8 ^ 0x5a).collect();
        unsafe { s.write_block(1, &data).unwrap() };
        drop(s);
        // Region 0 holds block 1's first layer at offset layer_block_bytes.
        let per = l.layer_block_bytes();
        assert_eq!(&owner[0][per..2 * per], &data[..per]);
        assert!(matches!(
            unsafe { HostStorage::external(l, vec![owner[0].as_mut_ptr()]) },
            Err(StorageError::RegionCount { .. })
        ));
    }
}
