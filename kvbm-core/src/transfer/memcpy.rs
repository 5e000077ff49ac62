//! Host-to-host block copies with `memcpy`.

use super::{
    BlockPair, EngineConfig, EngineCounters, Hold, Rejected, TransferEngine, TransferError,
    TransferStats, TransferTicket, Worker, check_shapes, validate_pairs,
};
use crate::layout::for_each_copy_piece;
use crate::storage::HostStorage;
use kvbm_events::tier::Tier;
use std::sync::Arc;

/// Copies blocks between two [`HostStorage`]s (G2 ↔ G2, or host memory
/// standing in for G1 when there is no GPU).
///
/// When both layouts are of the same kind, each block is copied as its
/// coalesced ranges (one `memcpy` per block for
/// [`FullyContiguous`](crate::layout::LayoutKind::FullyContiguous)); when the
/// kinds differ the copy goes chunk by chunk.
///
/// Source and destination may be the same storage; a batch may then not
/// read and write the same block ([`TransferError::Aliasing`]).
pub struct MemcpyEngine {
    // First field: dropped first, so the worker is joined before anything
    // else goes away.
    worker: Worker,
    src: Arc<HostStorage>,
    dst: Arc<HostStorage>,
    src_tier: Tier,
    dst_tier: Tier,
    same_storage: bool,
}

impl MemcpyEngine {
    /// Builds an engine with [`EngineConfig::default`].
    ///
    /// Errors: [`TransferError::LayoutMismatch`] when the layouts' block
    /// shapes differ; [`TransferError::Io`] if the worker thread cannot be
    /// spawned.
    pub fn new(
        src: Arc<HostStorage>,
        src_tier: Tier,
        dst: Arc<HostStorage>,
        dst_tier: Tier,
    ) -> Result<Self, TransferError> {
        Self::with_config(src, src_tier, dst, dst_tier, EngineConfig::default())
    }

    /// Builds an engine with an explicit configuration.
    pub fn with_config(
        src: Arc<HostStorage>,
        src_tier: Tier,
        dst: Arc<HostStorage>,
        dst_tier: Tier,
        config: EngineConfig,
    ) -> Result<Self, TransferError> {
        check_shapes(src.layout(), dst.layout())?;
        let same_storage = Arc::ptr_eq(&src, &dst);
        let worker = {
            let (src, dst) = (src.clone(), dst.clone());
            Worker::spawn("memcpy", &config, move |pairs| {
                copy_batch(&src, &dst, pairs)
            })?
        };
        Ok(MemcpyEngine {
            worker,
            src,
            dst,
            src_tier,
            dst_tier,
            same_storage,
        })
    }

    /// A snapshot of the engine's counters.
    pub fn counters(&self) -> EngineCounters {
        self.worker.counters()
    }
}

/// Runs on the worker thread.
fn copy_batch(
    src: &HostStorage,
    dst: &HostStorage,
    pairs: &[BlockPair],
) -> Result<u64, TransferError> {
    let mut bytes = 0u64;
    for p in pairs {
        for_each_copy_piece(src.layout(), p.src, dst.layout(), p.dst, |s, d| {
            let from = src.range_ptr(&s)?;
            let to = dst.range_ptr(&d)?;
            // SAFETY: both pointers are valid for s.len == d.len bytes
            // (range_ptr checked the ranges; for_each_copy_piece yields
            // equal lengths). They do not overlap: distinct storages are
            // distinct allocations, and within one storage `submit` refused
            // batches that read and write the same block, and ranges of
            // distinct blocks never overlap. No one else accesses these
            // blocks until the ticket resolves (submit's contract).
            unsafe { std::ptr::copy_nonoverlapping(from, to, s.len) };
            bytes += s.len as u64;
            Ok::<(), TransferError>(())
        })?;
    }
    Ok(bytes)
}

impl TransferEngine for MemcpyEngine {
    fn name(&self) -> &'static str {
        "memcpy"
    }

    fn source_tier(&self) -> Tier {
        self.src_tier
    }

    fn destination_tier(&self) -> Tier {
        self.dst_tier
    }

    fn counters(&self) -> EngineCounters {
        self.worker.counters()
    }

    fn source_num_blocks(&self) -> usize {
        self.src.layout().num_blocks()
    }

    fn destination_num_blocks(&self) -> usize {
        self.dst.layout().num_blocks()
    }

    unsafe fn submit_holding(
        &self,
        pairs: Vec<BlockPair>,
        hold: Option<Hold>,
    ) -> Result<TransferTicket, Rejected> {
        let checked = validate_pairs(
            &pairs,
            self.src.layout(),
            self.dst.layout(),
            self.same_storage,
        );
        if let Err(error) = checked {
            return Err(Rejected { error, hold });
        }
        self.worker.submit_holding(pairs, hold)
    }

    unsafe fn transfer_blocking(
        &self,
        pairs: Vec<BlockPair>,
    ) -> Result<TransferStats, TransferError> {
        validate_pairs(
            &pairs,
            self.src.layout(),
            self.dst.layout(),
            self.same_storage,
        )?;
        let (src, dst) = (&self.src, &self.dst);
        // The same copy as the worker's, on this thread: the caller
        // promised (submit's contract) that no one touches these blocks.
        self.worker
            .run_here(&pairs, |pairs| copy_batch(src, dst, pairs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Layout, LayoutConfig, LayoutKind};

    fn storage(kind: LayoutKind, num_blocks: usize) -> Arc<HostStorage> {
        let layout = Layout::new(
            LayoutConfig {
                num_blocks,
                num_layers: 3,
                outer_dim: 2,
                page_size: 2,
                inner_dim: 8,
                dtype_bytes: 2,
            },
            kind,
        )
        .unwrap();
        Arc::new(HostStorage::new(layout).unwrap())
    }

    fn pattern(block: u32, n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| (block as usize * 31 + i * 7) as u8)
            .collect()
    }

    #[test]
    fn copies_between_all_kind_combinations() {
        use LayoutKind::*;
        for (sk, dk) in [
            (FullyContiguous, FullyContiguous),
            (LayerSeparate, LayerSeparate),
            (FullyContiguous, LayerSeparate),
            (LayerSeparate, FullyContiguous),
        ] {
            let src = storage(sk, 4);
            let dst = storage(dk, 6);
            let n = src.layout().block_bytes();
            for b in 0..4 {
                // SAFETY: no engine exists yet; single-threaded.
                unsafe { src.write_block(b, &pattern(b, n)).unwrap() };
            }
            let engine =
                MemcpyEngine::new(src.clone(), Tier::Device, dst.clone(), Tier::Host).unwrap();
            let pairs = vec![
                BlockPair::new(0, 5),
                BlockPair::new(3, 1),
                BlockPair::new(1, 2),
            ];
            // SAFETY: nothing else touches these blocks until we wait.
            let stats = unsafe { engine.submit(pairs.clone()) }
                .unwrap()
                .wait_blocking()
                .unwrap();
            assert_eq!(stats.blocks, 3);
            // The same copy on this thread gives the same bytes and counts.
            let here = storage(dk, 6);
            let inline =
                MemcpyEngine::new(src.clone(), Tier::Device, here.clone(), Tier::Host).unwrap();
            let s2 = unsafe { inline.transfer_blocking(pairs) }.unwrap();
            assert_eq!((s2.blocks, s2.bytes), (stats.blocks, stats.bytes));
            assert_eq!(inline.counters().blocks, 3);
            assert_eq!(inline.counters().bytes, stats.bytes);
            let (mut a, mut b) = (vec![0u8; n], vec![1u8; n]);
            for d in 0..6 {
                unsafe { dst.read_block(d, &mut a).unwrap() };
                unsafe { here.read_block(d, &mut b).unwrap() };
                assert_eq!(a, b, "{sk:?} -> {dk:?} block {d}, copied on this thread");
            }
            assert_eq!(stats.bytes, 3 * n as u64);
            let mut out = vec![0u8; n];
            for (s, d) in [(0, 5), (3, 1), (1, 2)] {
                unsafe { dst.read_block(d, &mut out).unwrap() };
                assert_eq!(out, pattern(s, n), "{sk:?} -> {dk:?} block {s} -> {d}");
            }
            unsafe { dst.read_block(0, &mut out).unwrap() };
            assert!(out.iter().all(|&b| b == 0));
            assert_eq!(engine.counters().blocks, 3);
        }
    }

    #[test]
    fn same_storage_copy_and_aliasing() {
        let s = storage(LayoutKind::LayerSeparate, 4);
        let n = s.layout().block_bytes();
        unsafe { s.write_block(0, &pattern(9, n)).unwrap() };
        let engine = MemcpyEngine::new(s.clone(), Tier::Host, s.clone(), Tier::Host).unwrap();
        assert!(matches!(
            unsafe { engine.submit(vec![BlockPair::new(0, 1), BlockPair::new(1, 2)]) },
            Err(TransferError::Aliasing(1))
        ));
        assert!(matches!(
            unsafe { engine.transfer_blocking(vec![BlockPair::new(0, 1), BlockPair::new(1, 2)]) },
            Err(TransferError::Aliasing(1))
        ));
        assert!(matches!(
            unsafe { engine.transfer_blocking(vec![BlockPair::new(0, 9)]) },
            Err(TransferError::BlockOutOfRange { .. })
        ));
        assert_eq!(engine.counters().batches, 0, "nothing refused is counted");
        unsafe { engine.transfer_blocking(vec![BlockPair::new(0, 3)]) }.unwrap();
        let mut out = vec![0u8; n];
        unsafe { s.read_block(3, &mut out).unwrap() };
        assert_eq!(out, pattern(9, n));
    }
}
