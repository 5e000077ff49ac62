//! Device ↔ host block copies on a dedicated CUDA stream (feature `cuda`).
//!
//! The worker thread enqueues a batch's pieces (merged where blocks follow
//! each other; one `cuMemcpyBatchAsync` where the driver has it: see
//! `cuda_copy`) on the engine's own stream, records an event, and polls
//! `cuEventQuery`
//! (spinning briefly, then sleeping in short steps) until the copies are
//! done. Nothing ever blocks a caller's thread, and the worker never calls a
//! blocking CUDA synchronisation in the normal path.

use super::cuda_copy::{CopyCalls, End, Side, enqueue_blocks};
use super::{
    BlockPair, EngineConfig, EngineCounters, Hold, Rejected, TransferEngine, TransferError,
    TransferTicket, Worker, check_shapes, validate_pairs,
};
use crate::layout::MemRange;
use crate::storage::{DeviceStorage, HostStorage};
use cudarc::driver::{CudaEvent, CudaStream, DriverError};
use kvbm_events::tier::Tier;
use std::sync::Arc;
use std::time::Duration;

/// Which way a [`CudaEngine`] copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaDirection {
    /// Onboard: host blocks to device blocks (G2 → G1).
    HostToDevice,
    /// Offload: device blocks to host blocks (G1 → G2).
    DeviceToHost,
}

fn cuda(what: &str, e: DriverError) -> TransferError {
    TransferError::Cuda(format!("{what}: {e}"))
}

/// Moves blocks between a [`DeviceStorage`] (G1) and a [`HostStorage`] (G2)
/// in one direction.
///
/// Pinning: construction registers the host storage's regions with the
/// driver ([`HostStorage::pin_for_cuda`], `cuMemHostRegister`), so the async
/// copies are true DMA. Registration belongs to the storage, not the engine:
/// it is idempotent (both directions can share one host storage) and lasts
/// until the storage is dropped. Failure to pin is an error rather than a
/// silent fallback to pageable (staged, synchronous) copies.
pub struct CudaEngine {
    // First field: dropped (joined) first; the worker owns the stream and
    // event and waits for outstanding copies before it answers a batch.
    worker: Worker,
    device: Arc<DeviceStorage>,
    host: Arc<HostStorage>,
    direction: CudaDirection,
}

impl CudaEngine {
    /// Builds an engine with [`EngineConfig::default`].
    ///
    /// Errors: [`TransferError::LayoutMismatch`] when the layouts' block
    /// shapes differ; [`TransferError::Storage`] if pinning fails;
    /// [`TransferError::Cuda`] if the stream or event cannot be created.
    pub fn new(
        device: Arc<DeviceStorage>,
        host: Arc<HostStorage>,
        direction: CudaDirection,
    ) -> Result<Self, TransferError> {
        Self::with_config(device, host, direction, EngineConfig::default())
    }

    /// Builds an engine with an explicit configuration.
    pub fn with_config(
        device: Arc<DeviceStorage>,
        host: Arc<HostStorage>,
        direction: CudaDirection,
        config: EngineConfig,
    ) -> Result<Self, TransferError> {
        match direction {
            CudaDirection::HostToDevice => check_shapes(host.layout(), device.layout())?,
            CudaDirection::DeviceToHost => check_shapes(device.layout(), host.layout())?,
        }
        let ctx = device.context().clone();
        host.pin_for_cuda(&ctx)?;
        let stream = ctx.new_stream().map_err(|e| cuda("create stream", e))?;
        // Timing disabled (the default): cheaper to record and query.
        let event = ctx.new_event(None).map_err(|e| cuda("create event", e))?;
        let name = match direction {
            CudaDirection::HostToDevice => "cuda-h2d",
            CudaDirection::DeviceToHost => "cuda-d2h",
        };
        let calls = CopyCalls::from_env()?;
        let worker = {
            let (device, host) = (device.clone(), host.clone());
            Worker::spawn(name, &config, move |pairs| {
                copy_batch(&device, &host, direction, calls, &stream, &event, pairs)
            })?
        };
        Ok(CudaEngine {
            worker,
            device,
            host,
            direction,
        })
    }

    /// The direction this engine copies in.
    pub fn direction(&self) -> CudaDirection {
        self.direction
    }

    /// A snapshot of the engine's counters.
    pub fn counters(&self) -> EngineCounters {
        self.worker.counters()
    }
}

/// Runs on the worker thread: the batch's pieces, merged where blocks
/// follow each other, handed to the driver as `calls` says.
fn copy_batch(
    device: &DeviceStorage,
    host: &HostStorage,
    direction: CudaDirection,
    calls: CopyCalls,
    stream: &Arc<CudaStream>,
    event: &CudaEvent,
    pairs: &[BlockPair],
) -> Result<u64, TransferError> {
    device
        .context()
        .bind_to_thread()
        .map_err(|e| cuda("bind context", e))?;
    let cu_stream = stream.cu_stream();
    let dev = End {
        layout: device.layout(),
        addr: |r: &MemRange| device.range_dptr(r),
        side: Side::Device(device.ordinal() as i32),
    };
    let host = End {
        layout: host.layout(),
        addr: |r: &MemRange| Ok(host.range_ptr(r)? as u64),
        side: Side::Host,
    };
    // SAFETY (both arms): every address is inside its storage (range
    // checks) and stays allocated until the storages drop, which is after
    // this worker is joined; the host side is pinned. submit's contract
    // keeps everyone else off the blocks until we have waited below.
    let enqueued = match direction {
        CudaDirection::HostToDevice => unsafe {
            enqueue_blocks(host, dev, pairs, calls, cu_stream)
        },
        CudaDirection::DeviceToHost => unsafe {
            enqueue_blocks(dev, host, pairs, calls, cu_stream)
        },
    };
    // Wait even if enqueueing failed halfway: the ticket must not resolve
    // while DMA already queued may still touch the blocks.
    let waited = wait_for_stream(stream, event);
    let bytes = enqueued?;
    waited?;
    Ok(bytes)
}

/// Records `event` on `stream` and polls it until the stream's work so far
/// has completed.
fn wait_for_stream(stream: &Arc<CudaStream>, event: &CudaEvent) -> Result<(), TransferError> {
    if let Err(e) = event.record(stream) {
        // Without an event, fall back to a blocking wait on our own worker
        // thread (never a caller's) so the guarantee above still holds.
        stream
            .synchronize()
            .map_err(|e2| cuda(&format!("record event failed ({e}); synchronize"), e2))?;
        return Ok(());
    }
    let mut polls = 0u32;
    loop {
        match event.try_is_complete() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => return Err(cuda("cuEventQuery", e)),
        }
        // A 2 MiB block takes tens of microseconds over PCIe: spin (with
        // yields) for a short while, then back off to short sleeps so an
        // idle-waiting worker does not burn a core.
        polls += 1;
        if polls < 64 {
            std::hint::spin_loop();
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

impl TransferEngine for CudaEngine {
    fn name(&self) -> &'static str {
        match self.direction {
            CudaDirection::HostToDevice => "cuda-h2d",
            CudaDirection::DeviceToHost => "cuda-d2h",
        }
    }

    fn source_tier(&self) -> Tier {
        match self.direction {
            CudaDirection::HostToDevice => Tier::Host,
            CudaDirection::DeviceToHost => Tier::Device,
        }
    }

    fn destination_tier(&self) -> Tier {
        match self.direction {
            CudaDirection::HostToDevice => Tier::Device,
            CudaDirection::DeviceToHost => Tier::Host,
        }
    }

    fn counters(&self) -> EngineCounters {
        self.worker.counters()
    }

    fn source_num_blocks(&self) -> usize {
        match self.direction {
            CudaDirection::HostToDevice => self.host.layout(),
            CudaDirection::DeviceToHost => self.device.layout(),
        }
        .num_blocks()
    }

    fn destination_num_blocks(&self) -> usize {
        match self.direction {
            CudaDirection::HostToDevice => self.device.layout(),
            CudaDirection::DeviceToHost => self.host.layout(),
        }
        .num_blocks()
    }

    unsafe fn submit_holding(
        &self,
        pairs: Vec<BlockPair>,
        hold: Option<Hold>,
    ) -> Result<TransferTicket, Rejected> {
        let checked = match self.direction {
            CudaDirection::HostToDevice => {
                validate_pairs(&pairs, self.host.layout(), self.device.layout(), false)
            }
            CudaDirection::DeviceToHost => {
                validate_pairs(&pairs, self.device.layout(), self.host.layout(), false)
            }
        };
        if let Err(error) = checked {
            return Err(Rejected { error, hold });
        }
        self.worker.submit_holding(pairs, hold)
    }
}
