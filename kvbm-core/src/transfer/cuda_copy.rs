//! Enqueuing a list of [`Piece`]s on a CUDA stream (feature `cuda`).
//!
//! vLLM keeps a block as one piece per layer (and per K and V in its CUDA
//! attention backends' outer-first tensors), so a batch of blocks is
//! hundreds of small copies. One `cuMemcpyAsync` per piece pays a driver
//! call and a DMA descriptor each; `cuMemcpyBatchAsync` (driver 12.8 and
//! later) hands the driver the whole list in one call. [`CopyCalls::Auto`]
//! uses the batched call where the driver has it and falls back to one call
//! per piece; the other two force one way, for the transfer benchmark to
//! compare them on the machine at hand.
//!
//! Addresses are unified (every 64-bit CUDA platform): a host pointer
//! registered with `cuMemHostRegister` is a valid copy address as it is, so
//! both directions use the same calls.

use super::{BlockPair, Piece, TransferError, copy_pieces};
use crate::layout::{Layout, MemRange};
use crate::storage::StorageError;
use cudarc::driver::sys;
use std::str::FromStr;
use std::sync::OnceLock;

/// How a list of pieces is handed to the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyCalls {
    /// Batched where the driver has `cuMemcpyBatchAsync`, else per piece.
    #[default]
    Auto,
    /// Always `cuMemcpyBatchAsync`; an error where the driver lacks it.
    Batched,
    /// One `cuMemcpyAsync` per piece.
    PerPiece,
}

impl FromStr for CopyCalls {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(CopyCalls::Auto),
            "batched" => Ok(CopyCalls::Batched),
            "per-piece" => Ok(CopyCalls::PerPiece),
            other => Err(format!(
                "unknown CUDA copy mode {other:?}: expected auto, batched or per-piece"
            )),
        }
    }
}

impl CopyCalls {
    /// `KVBM_CUDA_COPY` (`auto`, `batched`, `per-piece`), or `Auto` when it
    /// is unset. A value that does not parse is an error naming it.
    pub fn from_env() -> Result<Self, TransferError> {
        match std::env::var("KVBM_CUDA_COPY") {
            Err(_) => Ok(CopyCalls::Auto),
            Ok(v) => v
                .parse()
                .map_err(|e: String| TransferError::Cuda(format!("KVBM_CUDA_COPY: {e}"))),
        }
    }

    /// Whether this mode batches with the driver at hand.
    pub fn batches(self) -> bool {
        match self {
            CopyCalls::Auto => batch_call_available(),
            CopyCalls::Batched => true,
            CopyCalls::PerPiece => false,
        }
    }
}

/// Where the bytes of a side of a copy live, for the driver's hints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// Device memory of this device ordinal.
    Device(i32),
    /// Host memory.
    Host,
}

fn cuda(what: &str, e: impl std::fmt::Display) -> TransferError {
    TransferError::Cuda(format!("{what}: {e}"))
}

/// True when the loaded driver is 12.8 or later and exports
/// `cuMemcpyBatchAsync`. cudarc panics on a missing symbol, so the first
/// call (with an empty list: it copies nothing) runs under `catch_unwind`.
/// Probed once per process.
pub fn batch_call_available() -> bool {
    static PROBE: OnceLock<bool> = OnceLock::new();
    *PROBE.get_or_init(|| {
        if crate::storage::cuda_available().is_err() {
            return false;
        }
        let mut version = 0i32;
        // SAFETY: writes one int.
        let ok = unsafe { sys::cuDriverGetVersion(&mut version) }.result();
        if ok.is_err() || version < 12080 {
            return false;
        }
        std::panic::catch_unwind(|| {
            let mut fail = 0usize;
            // SAFETY: count 0: the driver reads none of the (null) arrays.
            unsafe {
                sys::cuMemcpyBatchAsync(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                    &mut fail,
                    std::ptr::null_mut(),
                )
            }
        })
        .is_ok()
    })
}

/// Enqueues every piece on `stream`, with `src` and `dst` giving each
/// range's address. Returns the bytes enqueued. Nothing is waited for.
///
/// # Safety
///
/// Every address `src` and `dst` return must be valid for its range's
/// length until the stream has run the copies, device memory of `stream`'s
/// context or host memory registered with it; the caller keeps other
/// writers off both sides until then.
pub(crate) unsafe fn enqueue_pieces(
    pieces: &[Piece],
    src: impl Fn(&MemRange) -> Result<sys::CUdeviceptr, StorageError>,
    dst: impl Fn(&MemRange) -> Result<sys::CUdeviceptr, StorageError>,
    sides: (Side, Side),
    calls: CopyCalls,
    stream: sys::CUstream,
) -> Result<u64, TransferError> {
    if pieces.is_empty() {
        return Ok(0);
    }
    let mut srcs = Vec::with_capacity(pieces.len());
    let mut dsts = Vec::with_capacity(pieces.len());
    let mut sizes = Vec::with_capacity(pieces.len());
    for p in pieces {
        srcs.push(src(&p.src)?);
        dsts.push(dst(&p.dst)?);
        sizes.push(p.src.len);
    }
    if calls.batches() {
        // SAFETY: the caller's contract; the arrays outlive the call.
        unsafe { batched(&mut dsts, &mut srcs, &mut sizes, sides, stream)? };
    } else {
        for ((d, s), n) in dsts.iter().zip(&srcs).zip(&sizes) {
            // SAFETY: the caller's contract.
            unsafe { sys::cuMemcpyAsync(*d, *s, *n, stream) }
                .result()
                .map_err(|e| cuda("cuMemcpyAsync", e))?;
        }
    }
    Ok(sizes.iter().map(|&n| n as u64).sum())
}

/// One side of a block copy: its layout, each range's address, where it
/// lives.
pub(crate) struct End<'a, F> {
    pub layout: &'a Layout,
    pub addr: F,
    pub side: Side,
}

/// The pieces of copying `pairs` from `src` into `dst` ([`copy_pieces`]),
/// enqueued with [`enqueue_pieces`]; the bytes enqueued.
///
/// # Safety
///
/// As [`enqueue_pieces`].
pub(crate) unsafe fn enqueue_blocks<S, D>(
    src: End<'_, S>,
    dst: End<'_, D>,
    pairs: &[BlockPair],
    calls: CopyCalls,
    stream: sys::CUstream,
) -> Result<u64, TransferError>
where
    S: Fn(&MemRange) -> Result<sys::CUdeviceptr, StorageError>,
    D: Fn(&MemRange) -> Result<sys::CUdeviceptr, StorageError>,
{
    let pieces = copy_pieces(src.layout, dst.layout, pairs)?;
    // SAFETY: the caller's contract.
    unsafe {
        enqueue_pieces(
            &pieces,
            src.addr,
            dst.addr,
            (src.side, dst.side),
            calls,
            stream,
        )
    }
}

fn location(side: Side) -> sys::CUmemLocation {
    match side {
        Side::Device(ordinal) => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        Side::Host => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        },
    }
}

/// One `cuMemcpyBatchAsync` for the whole list, with one set of
/// attributes: sources read in stream order (the copy may not start before
/// the work enqueued ahead of it), and where each side lives.
///
/// # Safety
///
/// As [`enqueue_pieces`].
unsafe fn batched(
    dsts: &mut [sys::CUdeviceptr],
    srcs: &mut [sys::CUdeviceptr],
    sizes: &mut [usize],
    (src, dst): (Side, Side),
    stream: sys::CUstream,
) -> Result<(), TransferError> {
    let mut attrs = [sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: location(src),
        dstLocHint: location(dst),
        flags: 0,
    }];
    let mut attr_index = [0usize];
    let mut fail = usize::MAX;
    // SAFETY: the three arrays have one entry per piece; one attribute set
    // applies from index 0; the caller vouches for the addresses.
    unsafe {
        sys::cuMemcpyBatchAsync(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            sizes.len(),
            attrs.as_mut_ptr(),
            attr_index.as_mut_ptr(),
            1,
            &mut fail,
            stream,
        )
    }
    .result()
    .map_err(|e| {
        let at = if fail == usize::MAX {
            String::new()
        } else {
            format!(" (piece {fail} of {})", sizes.len())
        };
        cuda(&format!("cuMemcpyBatchAsync{at}"), e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_name_a_bad_value() {
        assert_eq!("auto".parse(), Ok(CopyCalls::Auto));
        assert_eq!("batched".parse(), Ok(CopyCalls::Batched));
        assert_eq!("per-piece".parse(), Ok(CopyCalls::PerPiece));
        let e = "fast".parse::<CopyCalls>().unwrap_err();
        assert!(e.contains("\"fast\"") && e.contains("per-piece"), "{e}");
        assert!(!CopyCalls::PerPiece.batches());
        assert!(CopyCalls::Batched.batches());
    }
}
