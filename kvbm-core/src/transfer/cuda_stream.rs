//! Block copies between an engine's device memory (G1) and pinned host
//! memory (G2) ordered against the engine's own CUDA stream, without ever
//! blocking the engine's thread (feature `cuda`).
//!
//! An inference engine enqueues its forward passes on a stream of its own.
//! kvbm's copies run on a stream of kvbm's, tied to the engine's with
//! events, so that:
//!
//! * a store starts only after the work the engine had enqueued when the
//!   store was asked for (the pass that computed the block):
//!   [`StreamCopier::wait_for`];
//! * the engine's next work (the pass that reads a loaded block, or writes
//!   a block it has just freed and reallocated while a store of it is
//!   still in flight) starts only after kvbm's copies:
//!   [`StreamCopier::fence`] with the engine's stream;
//! * kvbm learns when its copies are done by polling a [`Fence`], so the
//!   host blocks a store wrote are reported only once they hold the bytes.
//!
//! The engine's thread enqueues and returns: it never waits on a copy. Its
//! stream does wait for kvbm's copies of a step before that step's next
//! work, which is what keeps a block's bytes safe from the engine's own
//! reuse; on a GPU, a step's copies are tens to hundreds of microseconds.

use super::cuda_copy::{CopyCalls, End, Side, enqueue_blocks};
use super::{BlockPair, TransferError, check_shapes, validate_pairs};
use crate::layout::MemRange;
use crate::storage::{DeviceStorage, HostStorage};
use cudarc::driver::sys;
use std::sync::Arc;

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamDirection {
    /// Offload: device blocks into host blocks (G1 → G2).
    Store,
    /// Onboard: host blocks into device blocks (G2 → G1).
    Load,
}

fn cuda(what: &str, e: impl std::fmt::Display) -> TransferError {
    TransferError::Cuda(format!("{what}: {e}"))
}

/// A CUDA event, destroyed on drop.
struct Event(sys::CUevent);

// SAFETY: a CUevent is a driver handle, usable from any thread of the
// process once its context is current there.
unsafe impl Send for Event {}

impl Event {
    fn new() -> Result<Event, TransferError> {
        let mut e = std::ptr::null_mut();
        // SAFETY: writes one handle; timing off (cheaper to record).
        unsafe {
            sys::cuEventCreate(
                &mut e,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint,
            )
        }
        .result()
        .map_err(|err| cuda("cuEventCreate", err))?;
        Ok(Event(e))
    }

    /// Records the work enqueued on `stream` so far.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of the current context.
    unsafe fn record(&self, stream: sys::CUstream) -> Result<(), TransferError> {
        // SAFETY: the caller's contract; the event is live.
        unsafe { sys::cuEventRecord(self.0, stream) }
            .result()
            .map_err(|e| cuda("cuEventRecord", e))
    }

    /// Makes `stream`'s later work wait for this event.
    ///
    /// # Safety
    ///
    /// As [`Self::record`].
    unsafe fn make_wait(&self, stream: sys::CUstream) -> Result<(), TransferError> {
        // SAFETY: the caller's contract.
        unsafe { sys::cuStreamWaitEvent(stream, self.0, 0) }
            .result()
            .map_err(|e| cuda("cuStreamWaitEvent", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once. Destroying an event a
        // stream still waits on is allowed: the driver frees it after.
        let _ = unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// The point in kvbm's stream after the copies enqueued before it.
pub struct Fence {
    event: Event,
    /// Keeps the device memory (and its context) alive while copies may
    /// still run.
    device: Arc<DeviceStorage>,
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence").finish_non_exhaustive()
    }
}

impl Fence {
    /// True once every copy before the fence has run. Never blocks.
    pub fn is_done(&self) -> Result<bool, TransferError> {
        bind(&self.device)?;
        // SAFETY: a live event of the bound context.
        match unsafe { sys::cuEventQuery(self.event.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(cuda("cuEventQuery", format!("{other:?}"))),
        }
    }

    /// Blocks until every copy before the fence has run (tests, shutdown,
    /// and the test hooks that read G1 back).
    pub fn wait(&self) -> Result<(), TransferError> {
        bind(&self.device)?;
        // SAFETY: a live event of the bound context.
        unsafe { sys::cuEventSynchronize(self.event.0) }
            .result()
            .map_err(|e| cuda("cuEventSynchronize", e))
    }
}

fn bind(device: &DeviceStorage) -> Result<(), TransferError> {
    device
        .context()
        .bind_to_thread()
        .map_err(|e| cuda("bind context", e))
}

/// Copies blocks between `device` and `host` on a stream of its own; see
/// the module docs. Construction pins the host storage
/// ([`HostStorage::pin_for_cuda`]).
pub struct StreamCopier {
    device: Arc<DeviceStorage>,
    host: Arc<HostStorage>,
    stream: Arc<cudarc::driver::CudaStream>,
    calls: CopyCalls,
}

impl std::fmt::Debug for StreamCopier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamCopier")
            .field("calls", &self.calls)
            .finish_non_exhaustive()
    }
}

impl StreamCopier {
    /// A copier between `device` and `host`, handing pieces to the driver
    /// as `calls` says.
    ///
    /// Errors: the shapes differ, pinning fails, or the stream cannot be
    /// made.
    pub fn new(
        device: Arc<DeviceStorage>,
        host: Arc<HostStorage>,
        calls: CopyCalls,
    ) -> Result<Self, TransferError> {
        check_shapes(device.layout(), host.layout())?;
        host.pin_for_cuda(device.context())?;
        let stream = device
            .context()
            .new_stream()
            .map_err(|e| cuda("create stream", e))?;
        Ok(StreamCopier {
            device,
            host,
            stream,
            calls,
        })
    }

    /// The device storage (G1).
    pub fn device(&self) -> &Arc<DeviceStorage> {
        &self.device
    }

    /// The host storage (G2).
    pub fn host(&self) -> &Arc<HostStorage> {
        &self.host
    }

    /// kvbm's stream.
    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// Makes kvbm's later copies wait for the work enqueued on `engine` so
    /// far. `engine` may be null (the legacy default stream).
    ///
    /// # Safety
    ///
    /// `engine` is a live stream of the device's context.
    pub unsafe fn wait_for(&self, engine: sys::CUstream) -> Result<(), TransferError> {
        bind(&self.device)?;
        let e = Event::new()?;
        // SAFETY: the caller's contract; our stream is live.
        unsafe {
            e.record(engine)?;
            e.make_wait(self.cu_stream())
        }
    }

    /// Enqueues copies of `pairs` in `direction`; returns the bytes
    /// enqueued. A batch that fails validation enqueues nothing.
    ///
    /// # Safety
    ///
    /// Nobody but kvbm's stream touches the blocks named until a [`Fence`]
    /// after this call is done, and the engine's work on them is ordered
    /// by [`Self::wait_for`] and [`Self::fence`].
    pub unsafe fn enqueue(
        &self,
        direction: StreamDirection,
        pairs: &[BlockPair],
    ) -> Result<u64, TransferError> {
        bind(&self.device)?;
        let (d, h) = (self.device.layout(), self.host.layout());
        let device = End {
            layout: d,
            addr: |r: &MemRange| self.device.range_dptr(r),
            side: Side::Device(self.device.ordinal() as i32),
        };
        let host = End {
            layout: h,
            addr: |r: &MemRange| Ok(self.host.range_ptr(r)? as u64),
            side: Side::Host,
        };
        let stream = self.cu_stream();
        // SAFETY (both arms): the addresses are inside the storages (range
        // checks), which outlive the copies (fences hold the device; the
        // host is pinned for its life); the caller keeps other writers
        // away.
        match direction {
            StreamDirection::Store => {
                validate_pairs(pairs, d, h, false)?;
                unsafe { enqueue_blocks(device, host, pairs, self.calls, stream) }
            }
            StreamDirection::Load => {
                validate_pairs(pairs, h, d, false)?;
                unsafe { enqueue_blocks(host, device, pairs, self.calls, stream) }
            }
        }
    }

    /// A fence after every copy enqueued so far; `engine`, when given,
    /// waits for it before its later work.
    ///
    /// # Safety
    ///
    /// `engine`, when given, is a live stream of the device's context.
    pub unsafe fn fence(&self, engine: Option<sys::CUstream>) -> Result<Fence, TransferError> {
        bind(&self.device)?;
        let event = Event::new()?;
        // SAFETY: our stream is live; the caller vouches for `engine`.
        unsafe {
            event.record(self.cu_stream())?;
            if let Some(s) = engine {
                event.make_wait(s)?;
            }
        }
        Ok(Fence {
            event,
            device: self.device.clone(),
        })
    }
}

impl Drop for StreamCopier {
    fn drop(&mut self) {
        // Copies still queued read or write both storages: let them finish
        // before the host memory can be unpinned and unmapped.
        if bind(&self.device).is_ok() {
            let _ = self.stream.synchronize();
        }
    }
}
