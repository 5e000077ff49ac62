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
///
/// With [`Stores::Streaming`] (see [`MemcpyEngine::with_stores`]) the
/// destination is written with non-temporal stores: for an offload into a
/// lower tier, whose bytes no one reads until a later load.
pub struct MemcpyEngine {
    // First field: dropped first, so the worker is joined before anything
    // else goes away.
    worker: Worker,
    src: Arc<HostStorage>,
    dst: Arc<HostStorage>,
    src_tier: Tier,
    dst_tier: Tier,
    same_storage: bool,
    stores: Stores,
}

/// How a [`MemcpyEngine`] writes its destination.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Stores {
    /// Ordinary stores (`memcpy`): the copied bytes end up in the CPU's
    /// cache, where the next reader finds them. For loads into G1, which
    /// the next forward pass reads.
    #[default]
    Cached,
    /// Non-temporal stores on x86-64 (SSE2 `movntdq`, then `sfence`), for
    /// pieces of 4 KiB or more; ordinary copies elsewhere. A destination
    /// not recently written (a host-tier block) is not read into the cache
    /// before it is overwritten, as an ordinary store must, nor does the
    /// copy evict what the engine works on. For offloads, whose bytes are
    /// read only by a later load. Whether it beats ordinary stores depends
    /// on the machine and its load: `cargo bench -p kvbm-core --bench
    /// small_store` compares them (the README has its runs, one where it
    /// did and one where it did not).
    Streaming,
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
        Self::with_stores(src, src_tier, dst, dst_tier, config, Stores::Cached)
    }

    /// Builds an engine that writes its destination with `stores`.
    pub fn with_stores(
        src: Arc<HostStorage>,
        src_tier: Tier,
        dst: Arc<HostStorage>,
        dst_tier: Tier,
        config: EngineConfig,
        stores: Stores,
    ) -> Result<Self, TransferError> {
        check_shapes(src.layout(), dst.layout())?;
        let same_storage = Arc::ptr_eq(&src, &dst);
        let worker = {
            let (src, dst) = (src.clone(), dst.clone());
            Worker::spawn("memcpy", &config, move |pairs| {
                copy_batch(&src, &dst, pairs, stores)
            })?
        };
        Ok(MemcpyEngine {
            worker,
            src,
            dst,
            src_tier,
            dst_tier,
            same_storage,
            stores,
        })
    }

    /// How this engine writes its destination.
    pub fn stores(&self) -> Stores {
        self.stores
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
    stores: Stores,
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
            unsafe {
                match stores {
                    Stores::Cached => std::ptr::copy_nonoverlapping(from, to, s.len),
                    Stores::Streaming => stream_copy(from, to, s.len),
                }
            };
            bytes += s.len as u64;
            Ok::<(), TransferError>(())
        })?;
    }
    Ok(bytes)
}

/// The engine's copies with nothing around them: each piece of each pair
/// copied with plain `memcpy` (`copy_nonoverlapping`) on this thread, with
/// no check of the pairs beyond the layouts' ranges, no counters and no
/// clock. Returns the bytes copied. The baseline a benchmark holds a
/// [`MemcpyEngine`] against, on the same bytes in the same place.
///
/// # Safety
///
/// As for [`TransferEngine::transfer_blocking`]: no one else accesses the
/// pairs' blocks during the call, and no pair reads and writes the same
/// memory.
pub unsafe fn plain_copy(
    src: &HostStorage,
    dst: &HostStorage,
    pairs: &[BlockPair],
) -> Result<u64, TransferError> {
    copy_batch(src, dst, pairs, Stores::Cached)
}

/// Pieces shorter than this are copied with ordinary stores: the fence
/// and the unaligned ends would cost more than the cache traffic saved.
const STREAM_MIN: usize = 4096;

/// `copy_nonoverlapping(src, dst, len)` with non-temporal stores for the
/// 16-byte-aligned middle of the destination (x86-64; an ordinary copy
/// elsewhere, or below [`STREAM_MIN`]). Ends with `sfence`, so the bytes
/// are ordered before any later store of this thread (the release that
/// tells another thread the copy is done), as ordinary stores are.
///
/// # Safety
///
/// As for [`std::ptr::copy_nonoverlapping`].
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Bytes up to the first 16-byte boundary of the destination, then
        // 64 bytes (a cache line) a step, then what is left.
        let head = dst.align_offset(16).min(len);
        let body = (len - head) / 64 * 64;
        // SAFETY: the caller's promise covers `len` bytes; head + body <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (s, d) = (src.add(head), dst.add(head));
            let mut i = 0;
            while i < body {
                // Unaligned loads; the stores are aligned (d is on a 16-byte
                // boundary, i a multiple of 64), as movntdq requires. SSE2
                // is part of x86-64, so no feature check is needed.
                let a = _mm_loadu_si128(s.add(i).cast::<__m128i>());
                let b = _mm_loadu_si128(s.add(i + 16).cast::<__m128i>());
                let c = _mm_loadu_si128(s.add(i + 32).cast::<__m128i>());
                let e = _mm_loadu_si128(s.add(i + 48).cast::<__m128i>());
                _mm_stream_si128(d.add(i).cast::<__m128i>(), a);
                _mm_stream_si128(d.add(i + 16).cast::<__m128i>(), b);
                _mm_stream_si128(d.add(i + 32).cast::<__m128i>(), c);
                _mm_stream_si128(d.add(i + 48).cast::<__m128i>(), e);
                i += 64;
            }
            std::ptr::copy_nonoverlapping(s.add(body), d.add(body), len - head - body);
            // Non-temporal stores are weakly ordered: fence them before
            // whatever reports the copy done.
            _mm_sfence();
        }
        return;
    }
    // SAFETY: the caller's promise.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
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
        let stores = self.stores;
        self.worker
            .run_here(&pairs, |pairs| copy_batch(src, dst, pairs, stores))
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
        let kinds = LayoutKind::ALL;
        for (sk, dk) in kinds
            .iter()
            .flat_map(|&s| kinds.iter().map(move |&d| (s, d)))
        {
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
    fn streaming_copies_every_byte() {
        // Every length around the threshold and the 64-byte steps, from
        // and to every alignment: a copy that dropped the head, the tail
        // or a step would differ.
        let src: Vec<u8> = (0..STREAM_MIN * 3)
            .map(|i| (i * 7 % 251) as u8 + 1)
            .collect();
        let mut lens: Vec<usize> = (0..200).collect();
        lens.extend((STREAM_MIN - 80)..(STREAM_MIN + 200));
        lens.push(src.len() - 64);
        for len in lens {
            for (so, dof) in [(0, 0), (1, 0), (0, 1), (3, 15), (16, 17), (63, 5)] {
                let mut dst = vec![0u8; len + 128];
                // SAFETY: so + len <= src.len() and dof + len < dst.len(),
                // distinct buffers.
                unsafe { stream_copy(src.as_ptr().add(so), dst.as_mut_ptr().add(dof), len) };
                assert_eq!(
                    &dst[dof..dof + len],
                    &src[so..so + len],
                    "len {len} at {so}->{dof}"
                );
                assert!(
                    dst[..dof].iter().chain(&dst[dof + len..]).all(|&b| b == 0),
                    "len {len}: wrote outside"
                );
            }
        }
    }

    #[test]
    fn streaming_engine_copies_like_the_plain_one() {
        // Blocks of 2 layers x 2 pages x 2 KiB: 4 KiB per layer, so the
        // pieces are streamed.
        let layout = |kind, num_blocks| {
            Layout::new(
                LayoutConfig {
                    num_blocks,
                    num_layers: 2,
                    outer_dim: 2,
                    page_size: 16,
                    inner_dim: 64,
                    dtype_bytes: 2,
                },
                kind,
            )
            .unwrap()
        };
        for (sk, dk) in [
            (LayoutKind::LayerSeparate, LayoutKind::FullyContiguous),
            (LayoutKind::FullyContiguous, LayoutKind::FullyContiguous),
        ] {
            let src = Arc::new(HostStorage::new(layout(sk, 4)).unwrap());
            let n = src.layout().block_bytes();
            for b in 0..4 {
                // SAFETY: no engine exists yet.
                unsafe { src.write_block(b, &pattern(b, n)).unwrap() };
            }
            let dst = Arc::new(HostStorage::new(layout(dk, 6)).unwrap());
            let engine = MemcpyEngine::with_stores(
                src.clone(),
                Tier::Device,
                dst.clone(),
                Tier::Host,
                EngineConfig::default(),
                Stores::Streaming,
            )
            .unwrap();
            assert_eq!(engine.stores(), Stores::Streaming);
            let pairs = vec![BlockPair::new(2, 5), BlockPair::new(0, 1)];
            let stats = unsafe { engine.transfer_blocking(pairs.clone()) }.unwrap();
            assert_eq!(stats.bytes, 2 * n as u64);
            // And through the worker thread.
            unsafe { engine.submit(vec![BlockPair::new(3, 0)]) }
                .unwrap()
                .wait_blocking()
                .unwrap();
            let mut out = vec![0u8; n];
            for (s, d) in [(2, 5), (0, 1), (3, 0)] {
                unsafe { dst.read_block(d, &mut out).unwrap() };
                assert_eq!(out, pattern(s, n), "{sk:?} -> {dk:?} block {s} -> {d}");
            }
            // The plain baseline copies the same bytes (into fresh memory).
            let plain = Arc::new(HostStorage::new(layout(dk, 6)).unwrap());
            let bytes = unsafe { plain_copy(&src, &plain, &pairs) }.unwrap();
            assert_eq!(bytes, stats.bytes);
            for (s, d) in [(2, 5), (0, 1)] {
                unsafe { plain.read_block(d, &mut out).unwrap() };
                assert_eq!(
                    out,
                    pattern(s, n),
                    "plain {sk:?} -> {dk:?} block {s} -> {d}"
                );
            }
            let mut untouched = vec![1u8; n];
            unsafe { plain.read_block(0, &mut untouched).unwrap() };
            assert_eq!(
                untouched,
                vec![0u8; n],
                "plain_copy wrote a block no pair names"
            );
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
