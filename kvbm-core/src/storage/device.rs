//! Device (G1) storage through the CUDA driver API (feature `cuda`).
//!
//! cudarc is built with `dynamic-loading`: libcuda is opened on first use,
//! and cudarc *panics* if it cannot be found. [`cuda_available`] probes for
//! the library first so that callers (and tests) can fall back instead.

use super::{StorageError, check_block, check_len};
use crate::layout::{Layout, MemRange};
use cudarc::driver::{CudaContext, result, sys};
use kvbm_events::tier::BlockId;
use std::sync::{Arc, OnceLock};

/// Formats a driver error for [`StorageError::Cuda`].
pub(crate) fn cuda_err(what: &str, e: result::DriverError) -> StorageError {
    StorageError::Cuda(format!("{what}: {e}"))
}

/// `Ok(())` when the CUDA driver library can be loaded and reports at least
/// one device; otherwise the reason. The probe runs once per process.
///
/// cudarc panics when libcuda is absent (or lacks a symbol), so this first
/// asks cudarc whether the library can be opened
/// (`cudarc::driver::sys::is_culib_present`) and then runs the first real
/// driver calls (`cuInit`, `cuDeviceGetCount`) under
/// [`std::panic::catch_unwind`] as a second line of defence.
pub fn cuda_available() -> Result<(), String> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE.get_or_init(probe).clone()
}

fn probe() -> Result<(), String> {
    // SAFETY: only tries to dlopen libcuda under its usual names and closes
    // the handle again; it runs no driver code.
    if !unsafe { sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda) could not be loaded".into());
    }
    match std::panic::catch_unwind(CudaContext::device_count) {
        Ok(Ok(n)) if n > 0 => Ok(()),
        Ok(Ok(_)) => Err("the CUDA driver reports no devices".into()),
        Ok(Err(e)) => Err(format!("CUDA driver initialisation failed: {e}")),
        Err(_) => Err("the CUDA driver library failed to load (cudarc panicked)".into()),
    }
}

/// Device memory for a [`Layout`]: one `cuMemAlloc` per region, zeroed,
/// freed on drop. Transfers go through [`crate::transfer::CudaEngine`];
/// [`write_block`](Self::write_block) / [`read_block`](Self::read_block) are
/// synchronous helpers for tests and setup.
///
/// Block access is safe here (unlike [`super::HostStorage`]) because device
/// memory is never exposed to Rust as references: the copies below read or
/// write only the caller's borrowed slice on the host side, and concurrent
/// device-side copies to the same block can only mix bytes, not violate
/// memory safety. Keeping a block's readers and writers apart is the pool's
/// job.
#[derive(Debug)]
pub struct DeviceStorage {
    layout: Layout,
    ctx: Arc<CudaContext>,
    regions: Vec<sys::CUdeviceptr>,
    /// False for memory someone else allocated ([`Self::external`]): not
    /// freed here.
    owned: bool,
}

impl DeviceStorage {
    /// Allocates `layout` on device `ordinal` (its primary context).
    ///
    /// Errors: [`StorageError::Cuda`] when CUDA is unavailable (see
    /// [`cuda_available`]) or an allocation fails.
    pub fn new(ordinal: usize, layout: Layout) -> Result<DeviceStorage, StorageError> {
        cuda_available().map_err(StorageError::Cuda)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("create context", e))?;
        Self::with_context(ctx, layout)
    }

    /// Allocates `layout` in an existing context.
    pub fn with_context(
        ctx: Arc<CudaContext>,
        layout: Layout,
    ) -> Result<DeviceStorage, StorageError> {
        let bytes = layout.region_bytes();
        if bytes == 0 {
            return Err(StorageError::ZeroSize);
        }
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        let mut storage = DeviceStorage {
            layout,
            ctx,
            regions: Vec::with_capacity(layout.num_regions()),
            owned: true,
        };
        for _ in 0..layout.num_regions() {
            // SAFETY: the context is bound to this thread; size is non-zero.
            // On error, `storage` drops and frees what was allocated so far.
            let ptr = unsafe { result::malloc_sync(bytes) }
                .map_err(|e| cuda_err(&format!("cuMemAlloc of {bytes} bytes"), e))?;
            storage.regions.push(ptr);
            // SAFETY: `ptr` is a fresh allocation of `bytes` bytes.
            unsafe { result::memset_d8_sync(ptr, 0, bytes) }
                .map_err(|e| cuda_err("cuMemsetD8", e))?;
        }
        Ok(storage)
    }

    /// Wraps device memory someone else allocated (vLLM's KV tensors), one
    /// region per entry of `regions`, without copying or freeing it.
    ///
    /// Errors: [`StorageError::Cuda`] when CUDA is unavailable or the
    /// context cannot be had; [`StorageError::Layout`] when `regions` is
    /// not one address per region of `layout` or an address is null.
    ///
    /// # Safety
    ///
    /// Each address must be device memory of device `ordinal` (its primary
    /// context, the one PyTorch uses), valid for
    /// [`Layout::region_bytes`] bytes for as long as the storage lives.
    pub unsafe fn external(
        ordinal: usize,
        layout: Layout,
        regions: Vec<sys::CUdeviceptr>,
    ) -> Result<DeviceStorage, StorageError> {
        cuda_available().map_err(StorageError::Cuda)?;
        if regions.len() != layout.num_regions() || regions.contains(&0) {
            return Err(StorageError::Cuda(format!(
                "{} device regions (null ones: {}) for a layout of {}",
                regions.len(),
                regions.iter().filter(|&&r| r == 0).count(),
                layout.num_regions()
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("create context", e))?;
        Ok(DeviceStorage {
            layout,
            ctx,
            regions,
            owned: false,
        })
    }

    /// The device address of each region.
    pub fn regions(&self) -> &[sys::CUdeviceptr] {
        &self.regions
    }

    /// The device ordinal of the memory.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The layout this storage was built for.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The CUDA context owning the memory.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Device address of the first byte of `r`, after checking that `r`
    /// lies inside one of the regions.
    pub(crate) fn range_dptr(&self, r: &MemRange) -> Result<sys::CUdeviceptr, StorageError> {
        self.layout.check_range(r)?;
        let base = self
            .regions
            .get(r.region)
            .copied()
            .ok_or(StorageError::Layout(
                crate::layout::LayoutError::RangeOutOfBounds {
                    range: *r,
                    num_regions: self.regions.len(),
                    region_bytes: self.layout.region_bytes(),
                },
            ))?;
        // In bounds of the allocation (check_range), so no wrap-around.
        Ok(base + r.offset as u64)
    }

    /// Copies `data` (exactly [`Layout::block_bytes`] bytes) into `block`,
    /// synchronously.
    pub fn write_block(&self, block: BlockId, data: &[u8]) -> Result<(), StorageError> {
        check_block(&self.layout, block)?;
        check_len(&self.layout, data.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        let mut pos = 0;
        for r in self.layout.block_ranges(block)? {
            let dst = self.range_dptr(&r)?;
            let src = &data[pos..pos + r.len];
            // SAFETY: `dst` is valid for r.len bytes of device memory;
            // `src` is a live host slice of the same length. The copy is
            // synchronous, so `src` outlives it.
            unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) }
                .result()
                .map_err(|e| cuda_err("cuMemcpyHtoD", e))?;
            pos += r.len;
        }
        Ok(())
    }

    /// Copies `block` into `out` (exactly [`Layout::block_bytes`] bytes),
    /// synchronously.
    pub fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), StorageError> {
        check_block(&self.layout, block)?;
        check_len(&self.layout, out.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        let mut pos = 0;
        for r in self.layout.block_ranges(block)? {
            let src = self.range_dptr(&r)?;
            let dst = &mut out[pos..pos + r.len];
            // SAFETY: as in write_block; `dst` is an exclusive host borrow.
            unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) }
                .result()
                .map_err(|e| cuda_err("cuMemcpyDtoH", e))?;
            pos += r.len;
        }
        Ok(())
    }
}

impl Drop for DeviceStorage {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!("DeviceStorage drop: cannot bind CUDA context: {e}");
        }
        for ptr in self.regions.drain(..) {
            // SAFETY: allocated by cuMemAlloc in with_context, freed once.
            // Engines hold an Arc to this storage, so no copy is in flight.
            if let Err(e) = unsafe { result::free_sync(ptr) } {
                tracing::warn!("cuMemFree failed: {e}");
            }
        }
    }
}
