//! The worker's copies when vLLM's KV cache is on a GPU (feature `cuda`):
//! each step's stores and loads enqueued on kvbm's CUDA stream, ordered
//! against vLLM's, and reported once they have run.
//!
//! Per step, on vLLM's thread, before the forward pass:
//!
//! 1. kvbm's stream waits for what vLLM had enqueued so far (the passes
//!    that computed the blocks to store);
//! 2. the stores, then the loads, are enqueued (one batched driver call
//!    per batch where the driver has one);
//! 3. a fence after them is recorded, and vLLM's stream waits for it: the
//!    forward pass that reads the loaded blocks, or that writes a block
//!    vLLM freed while its store was in flight, runs after the copies.
//!
//! vLLM's thread never waits on a copy. A batch is reported to the
//! scheduler side only when its fence has passed, so a host block a store
//! wrote is not read, and a host block a load read is not reused, before
//! the copy ran. A batch that cannot be enqueued fails: a load's blocks
//! are reported as load errors at once (vLLM computes them, on its stream,
//! after the fence), as on the CPU; the batch's report waits for the fence
//! like the others, since part of it may have been enqueued.

use crate::meta::{Batch, Done, Route};
use kvbm_core::cuda_sys;
use kvbm_core::transfer::{BlockPair, Fence, StreamCopier, StreamDirection, TransferError};
use std::collections::VecDeque;
use std::time::Instant;

/// Copies of one step, enqueued, waiting for their fence.
struct Pending {
    fence: Fence,
    started: Instant,
    done: Vec<Done>,
}

/// G1 on a GPU and G2 in pinned host memory; see the module docs. Dropped,
/// the copier waits for its stream first, then the fences go.
pub struct DeviceTier {
    copier: StreamCopier,
    pending: VecDeque<Pending>,
}

impl std::fmt::Debug for DeviceTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTier")
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

/// What a step's copies gave at once.
#[derive(Debug, Default)]
pub struct Enqueued {
    /// Batches reported now: every batch when kvbm's stream could not be
    /// ordered after vLLM's (nothing was enqueued), or when no fence could
    /// be made (after waiting for the stream).
    pub failed: Vec<Done>,
    /// G1 blocks of loads that failed (vLLM computes them).
    pub load_errors: Vec<u32>,
}

fn failed(b: &Batch, e: &TransferError) -> Done {
    Done {
        route: b.route,
        id: b.id,
        bytes: 0,
        elapsed_ns: 0,
        error: Some(crate::meta::describe(e)),
    }
}

impl DeviceTier {
    /// Copies through `copier`.
    pub fn new(copier: StreamCopier) -> Self {
        DeviceTier {
            copier,
            pending: VecDeque::new(),
        }
    }

    /// The device storage (vLLM's tensors).
    pub fn copier(&self) -> &StreamCopier {
        &self.copier
    }

    /// Enqueues a step's `stores` then `loads` after the work vLLM has put
    /// on `stream` so far, and makes `stream` wait for them.
    ///
    /// # Safety
    ///
    /// `stream` is vLLM's current CUDA stream on the device (0: the legacy
    /// default stream), and the blocks named are vLLM's own, not written
    /// by vLLM except through work it enqueues on `stream` after this call.
    pub unsafe fn run(&mut self, stream: u64, stores: &[Batch], loads: &[Batch]) -> Enqueued {
        let mut out = Enqueued::default();
        if stores.is_empty() && loads.is_empty() {
            // Most steps: nothing to order, no event to make.
            return out;
        }
        let engine = stream as usize as cuda_sys::CUstream;
        let mut done = Vec::with_capacity(stores.len() + loads.len());
        // SAFETY: the caller's contract.
        if let Err(e) = unsafe { self.copier.wait_for(engine) } {
            // Nothing may be copied unordered: every batch fails.
            for b in stores.iter().chain(loads) {
                out.failed.push(failed(b, &e));
                if b.route.is_load() {
                    out.load_errors.extend(b.pairs.iter().map(|p| p.dst));
                }
            }
            return out;
        }
        for (b, direction) in stores
            .iter()
            .map(|b| (b, StreamDirection::Store))
            .chain(loads.iter().map(|b| (b, StreamDirection::Load)))
        {
            if !matches!(b.route, Route::DeviceToHost | Route::HostToDevice) {
                let e = TransferError::Cuda(format!(
                    "a {:?} batch: on a GPU this worker copies to and from the host tier only",
                    b.route
                ));
                if b.route.is_load() {
                    out.load_errors.extend(b.pairs.iter().map(|p| p.dst));
                }
                out.failed.push(failed(b, &e));
                continue;
            }
            let pairs: Vec<BlockPair> = b
                .pairs
                .iter()
                .map(|p| BlockPair::new(p.src, p.dst))
                .collect();
            // SAFETY: the caller's contract; the fence below orders vLLM's
            // later work after these copies.
            match unsafe { self.copier.enqueue(direction, &pairs) } {
                Ok(bytes) => done.push(Done {
                    route: b.route,
                    id: b.id,
                    bytes,
                    elapsed_ns: 0,
                    error: None,
                }),
                Err(e) => {
                    // Part of the batch may be enqueued already: its report
                    // waits for the fence like the others, and vLLM, which
                    // computes a failed load's blocks instead, writes them
                    // only after it.
                    if b.route.is_load() {
                        out.load_errors.extend(b.pairs.iter().map(|p| p.dst));
                    }
                    done.push(failed(b, &e));
                }
            }
        }
        // SAFETY: the caller's contract.
        match unsafe { self.copier.fence(Some(engine)) } {
            Ok(fence) => self.pending.push_back(Pending {
                fence,
                started: Instant::now(),
                done,
            }),
            Err(e) => {
                // Without a fence, vLLM's stream would not wait: wait here
                // (on vLLM's thread, the one case it does) so that nothing
                // is reported or reused before its copy ran.
                let drained = self.wait_all();
                let synced = cudarc_sync(&self.copier);
                for mut d in done {
                    if let Err(s) = &synced {
                        d.error = Some(format!("{e}; then {s}"));
                        d.bytes = 0;
                    }
                    out.failed.push(d);
                }
                out.failed.extend(drained);
            }
        }
        out
    }

    /// The batches whose copies have run, oldest first; never blocks. A
    /// fence that cannot be queried fails its batches (the context is
    /// then broken for vLLM too).
    pub fn poll(&mut self) -> Vec<Done> {
        let mut out = Vec::new();
        while let Some(p) = self.pending.front() {
            match p.fence.is_done() {
                Ok(false) => break,
                Ok(true) => {
                    let p = self.pending.pop_front().expect("front exists");
                    out.extend(finish(p, None));
                }
                Err(e) => {
                    let p = self.pending.pop_front().expect("front exists");
                    out.extend(finish(p, Some(e)));
                }
            }
        }
        out
    }

    /// Blocks until every enqueued copy has run; their batches.
    pub fn wait_all(&mut self) -> Vec<Done> {
        let mut out = Vec::new();
        while let Some(p) = self.pending.pop_front() {
            let e = p.fence.wait().err();
            out.extend(finish(p, e));
        }
        out
    }
}

fn finish(p: Pending, error: Option<TransferError>) -> Vec<Done> {
    // The copies ran somewhere between the enqueue and now: an upper bound.
    let elapsed_ns = u64::try_from(p.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
    p.done
        .into_iter()
        .map(|mut d| {
            d.elapsed_ns = elapsed_ns;
            if let Some(e) = &error {
                d.bytes = 0;
                d.error = Some(crate::meta::describe(e));
            }
            d
        })
        .collect()
}

/// Waits for kvbm's whole stream (the fallback when a fence fails).
fn cudarc_sync(copier: &StreamCopier) -> Result<(), TransferError> {
    // SAFETY: kvbm's own live stream.
    unsafe { cuda_sys::cuStreamSynchronize(copier.cu_stream()) }
        .result()
        .map_err(|e| TransferError::Cuda(format!("cuStreamSynchronize: {e}")))
}
