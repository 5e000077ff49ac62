//! End-to-end: G1 → G2 → G3 → G2 (different block ids) → G1, byte for byte.
//!
//! G1 is device memory with a `CudaEngine` when the `cuda` feature is on and
//! a GPU is usable; otherwise host memory stands in for it and a
//! `MemcpyEngine` moves G1 ↔ G2. The test prints which.
//!
//! On a machine that has a GPU, set `KVBM_REQUIRE_GPU=1` (and build with
//! `--features cuda`): every place that would fall back to host memory or
//! skip for want of a GPU then fails instead, so a run that was meant to
//! exercise the device cannot pass without touching it.

use kvbm_core::layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_core::storage::{DiskStorage, HostStorage};
use kvbm_core::transfer::{
    BlockPair, DiskDirection, DiskEngine, MemcpyEngine, TransferEngine, TransferStats,
};
use kvbm_core::{BlockId, Tier};
use std::sync::Arc;

#[cfg(feature = "cuda")]
use kvbm_core::storage::{DeviceStorage, cuda_available};
#[cfg(feature = "cuda")]
use kvbm_core::transfer::{CudaDirection, CudaEngine};

use kvbm_testkit::bytes::pattern;

fn layout(kind: LayoutKind, num_blocks: usize) -> Layout {
    Layout::new(
        LayoutConfig {
            num_blocks,
            num_layers: 4,
            outer_dim: 2,
            page_size: 8,
            inner_dim: 64,
            dtype_bytes: 2,
        },
        kind,
    )
    .expect("valid layout")
}

type WriteFn = Box<dyn Fn(BlockId, &[u8])>;
type ReadFn = Box<dyn Fn(BlockId, &mut [u8])>;

/// G1 storage plus the engines that move blocks off it and back on.
struct G1 {
    write: WriteFn,
    read: ReadFn,
    offload: Box<dyn TransferEngine>,
    onboard: Box<dyn TransferEngine>,
    what: String,
}

/// Whether `KVBM_REQUIRE_GPU=1` asks for a GPU.
fn gpu_required() -> bool {
    std::env::var("KVBM_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// Where a GPU test would skip or fall back for `why`: fails instead under
/// `KVBM_REQUIRE_GPU=1`, otherwise says why and lets the caller go on.
fn no_gpu(why: &str) {
    assert!(
        !gpu_required(),
        "KVBM_REQUIRE_GPU=1 but no GPU is used: {why}"
    );
    eprintln!("no GPU: {why}");
}

fn host_g1(g1_layout: Layout, g2: &Arc<HostStorage>, why: &str) -> G1 {
    no_gpu(why);
    let g1 = Arc::new(HostStorage::new(g1_layout).unwrap());
    let (w, r) = (g1.clone(), g1.clone());
    G1 {
        // SAFETY (both closures): the test is the only user of these blocks
        // and never accesses them while a transfer naming them is pending.
        write: Box::new(move |b, d| unsafe { w.write_block(b, d).unwrap() }),
        read: Box::new(move |b, o| unsafe { r.read_block(b, o).unwrap() }),
        offload: Box::new(
            MemcpyEngine::new(g1.clone(), Tier::Device, g2.clone(), Tier::Host).unwrap(),
        ),
        onboard: Box::new(MemcpyEngine::new(g2.clone(), Tier::Host, g1, Tier::Device).unwrap()),
        what: format!("host memory stand-in ({why})"),
    }
}

#[cfg(feature = "cuda")]
fn make_g1(g1_layout: Layout, g2: &Arc<HostStorage>) -> G1 {
    if let Err(reason) = cuda_available() {
        return host_g1(g1_layout, g2, &format!("CUDA unavailable: {reason}"));
    }
    let dev = Arc::new(DeviceStorage::new(0, g1_layout).unwrap());
    let (w, r) = (dev.clone(), dev.clone());
    G1 {
        write: Box::new(move |b, d| w.write_block(b, d).unwrap()),
        read: Box::new(move |b, o| r.read_block(b, o).unwrap()),
        offload: Box::new(
            CudaEngine::new(dev.clone(), g2.clone(), CudaDirection::DeviceToHost).unwrap(),
        ),
        onboard: Box::new(CudaEngine::new(dev, g2.clone(), CudaDirection::HostToDevice).unwrap()),
        what: "device memory (CudaEngine)".into(),
    }
}

#[cfg(not(feature = "cuda"))]
fn make_g1(g1_layout: Layout, g2: &Arc<HostStorage>) -> G1 {
    host_g1(g1_layout, g2, "built without the `cuda` feature")
}

fn pairs(map: &[(BlockId, BlockId)]) -> Vec<BlockPair> {
    map.iter().map(|&(s, d)| BlockPair::new(s, d)).collect()
}

fn run(engine: &dyn TransferEngine, map: &[(BlockId, BlockId)]) -> TransferStats {
    // SAFETY: the test touches none of these blocks until the ticket resolves.
    unsafe { engine.submit(pairs(map)) }
        .unwrap()
        .wait_blocking()
        .unwrap()
}

fn roundtrip(g1_kind: LayoutKind, g2_kind: LayoutKind, g3_kind: LayoutKind) {
    let dir = tempfile::tempdir().unwrap();
    let g2 = Arc::new(HostStorage::new(layout(g2_kind, 16)).unwrap());
    let g3 = Arc::new(DiskStorage::create(dir.path().join("g3.kv"), layout(g3_kind, 24)).unwrap());
    let g1 = make_g1(layout(g1_kind, 8), &g2);
    eprintln!(
        "G1 {g1_kind:?} / G2 {g2_kind:?} / G3 {g3_kind:?}: G1 is {}",
        g1.what
    );

    let n = g2.layout().block_bytes();
    let origins: [BlockId; 4] = [1, 3, 4, 6];
    for &b in &origins {
        (g1.write)(b, &pattern(b, n));
    }

    let offload = DiskEngine::new(
        g2.clone(),
        g3.clone(),
        DiskDirection::HostToDisk,
        Tier::Host,
    )
    .unwrap();
    let onboard = DiskEngine::new(
        g2.clone(),
        g3.clone(),
        DiskDirection::DiskToHost,
        Tier::Host,
    )
    .unwrap();
    assert_eq!(
        (offload.source_tier(), offload.destination_tier()),
        (Tier::Host, Tier::Disk)
    );
    assert_eq!(
        (onboard.source_tier(), onboard.destination_tier()),
        (Tier::Disk, Tier::Host)
    );

    // Mixed, non-identity mappings at every hop.
    let g1_to_g2 = [(1, 9), (3, 2), (4, 14), (6, 0)];
    let g2_to_g3 = [(9, 20), (2, 5), (14, 11), (0, 17)];
    let g3_to_g2 = [(20, 3), (5, 12), (11, 7), (17, 10)];
    let g2_to_g1 = [(3, 0), (12, 2), (7, 5), (10, 7)];

    let s = run(g1.offload.as_ref(), &g1_to_g2);
    assert_eq!((s.blocks, s.bytes), (4, 4 * n as u64));
    let s = run(&offload, &g2_to_g3);
    assert_eq!((s.blocks, s.bytes), (4, 4 * n as u64));
    let s = run(&onboard, &g3_to_g2);
    assert_eq!((s.blocks, s.bytes), (4, 4 * n as u64));

    // Each hop's destination holds the pattern of the G1 block it came from.
    let mut out = vec![0u8; n];
    for (i, &origin) in origins.iter().enumerate() {
        let g3_block = g2_to_g3[i].1;
        g3.read_block(g3_block, &mut out).unwrap();
        assert_eq!(
            out,
            pattern(origin, n),
            "G3 block {g3_block} (from G1 {origin})"
        );
        let g2_block = g3_to_g2[i].1;
        // SAFETY: no transfer is pending.
        unsafe { g2.read_block(g2_block, &mut out).unwrap() };
        assert_eq!(
            out,
            pattern(origin, n),
            "G2 block {g2_block} (from G1 {origin})"
        );
    }

    // And back to G1, into different ids again.
    run(g1.onboard.as_ref(), &g2_to_g1);
    for (i, &origin) in origins.iter().enumerate() {
        let g1_block = g2_to_g1[i].1;
        (g1.read)(g1_block, &mut out);
        assert_eq!(
            out,
            pattern(origin, n),
            "G1 block {g1_block} (from G1 {origin})"
        );
    }

    let c = offload.counters();
    assert_eq!(
        (c.batches, c.blocks, c.bytes, c.rejected, c.failed),
        (1, 4, 4 * n as u64, 0, 0)
    );
}

#[test]
fn roundtrip_fully_contiguous() {
    use LayoutKind::FullyContiguous as FC;
    roundtrip(FC, FC, FC);
}

#[test]
fn roundtrip_layer_separate_g1() {
    // The usual deployment: per-layer tensors on the device, contiguous
    // blocks in host memory and on disk.
    use LayoutKind::{FullyContiguous as FC, LayerSeparate as LS};
    roundtrip(LS, FC, FC);
}

#[test]
fn roundtrip_vllm_kv_first_g1() {
    // vLLM's CUDA attention backends: per layer [2, num_blocks, ...], K of
    // every block then V; a block of a layer is two pieces far apart.
    use LayoutKind::{FullyContiguous as FC, LayerSeparateOuterFirst as KV};
    roundtrip(KV, FC, FC);
}

#[test]
fn roundtrip_mixed_kinds_on_every_hop() {
    // G1 FC -> G2 LS (chunked memcpy), G2 LS -> G3 FC (staged disk I/O).
    use LayoutKind::{FullyContiguous as FC, LayerSeparate as LS};
    roundtrip(FC, LS, FC);
    roundtrip(LS, FC, LS);
}

#[test]
fn tickets_can_be_awaited() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let g2 = Arc::new(HostStorage::new(layout(LayoutKind::FullyContiguous, 4)).unwrap());
    let g3 = Arc::new(
        DiskStorage::create(
            dir.path().join("g3.kv"),
            layout(LayoutKind::LayerSeparate, 4),
        )
        .unwrap(),
    );
    let n = g2.layout().block_bytes();
    // SAFETY: no engine exists yet.
    unsafe { g2.write_block(2, &pattern(2, n)).unwrap() };
    let offload = DiskEngine::new(
        g2.clone(),
        g3.clone(),
        DiskDirection::HostToDisk,
        Tier::Host,
    )
    .unwrap();
    let stats = rt.block_on(async {
        // SAFETY: nothing touches G2 block 2 or G3 block 1 until the await.
        unsafe { offload.submit(vec![BlockPair::new(2, 1)]) }
            .unwrap()
            .await
    });
    assert_eq!(stats.unwrap().bytes, n as u64);
    let mut out = vec![0u8; n];
    g3.read_block(1, &mut out).unwrap();
    assert_eq!(out, pattern(2, n));
}

/// Device-only checks; skipped (with the reason printed) without a GPU.
#[cfg(feature = "cuda")]
#[test]
fn cuda_engine_batches_and_shape_check() {
    if let Err(reason) = cuda_available() {
        no_gpu(&format!("skipping the device-only checks: {reason}"));
        return;
    }
    let dev = Arc::new(DeviceStorage::new(0, layout(LayoutKind::LayerSeparate, 32)).unwrap());
    let host = Arc::new(HostStorage::new(layout(LayoutKind::FullyContiguous, 32)).unwrap());
    let n = host.layout().block_bytes();
    for b in 0..32 {
        dev.write_block(b, &pattern(b, n)).unwrap();
    }
    let d2h = CudaEngine::new(dev.clone(), host.clone(), CudaDirection::DeviceToHost).unwrap();
    let h2d = CudaEngine::new(dev.clone(), host.clone(), CudaDirection::HostToDevice).unwrap();
    assert_eq!(
        (d2h.source_tier(), d2h.destination_tier()),
        (Tier::Device, Tier::Host)
    );
    // Several batches in flight at once, reversed mapping.
    let tickets: Vec<_> = (0..4u32)
        .map(|g| {
            let batch = (0..8)
                .map(|i| BlockPair::new(g * 8 + i, 31 - (g * 8 + i)))
                .collect();
            // SAFETY: disjoint blocks per batch; nothing else touches them.
            unsafe { d2h.submit(batch) }.unwrap()
        })
        .collect();
    for t in tickets {
        assert_eq!(t.wait_blocking().unwrap().blocks, 8);
    }
    let mut out = vec![0u8; n];
    for b in 0..32 {
        // SAFETY: all tickets resolved.
        unsafe { host.read_block(31 - b, &mut out).unwrap() };
        assert_eq!(out, pattern(b, n), "host block {}", 31 - b);
    }
    // Back onto the device, shifted by one.
    let batch = (0..31).map(|b| BlockPair::new(b, b + 1)).collect();
    // SAFETY: as above.
    unsafe { h2d.submit(batch) }
        .unwrap()
        .wait_blocking()
        .unwrap();
    for b in 1..32u32 {
        dev.read_block(b, &mut out).unwrap();
        assert_eq!(out, pattern(32 - b, n), "device block {b}");
    }
    // Bad input through the CUDA engine.
    assert!(unsafe { h2d.submit(vec![BlockPair::new(0, 32)]) }.is_err());
    let mut other = *layout(LayoutKind::FullyContiguous, 4).config();
    other.page_size = 16;
    let odd = Arc::new(
        HostStorage::new(Layout::new(other, LayoutKind::FullyContiguous).unwrap()).unwrap(),
    );
    assert!(matches!(
        CudaEngine::new(dev, odd, CudaDirection::HostToDevice),
        Err(kvbm_core::transfer::TransferError::LayoutMismatch { .. })
    ));
}
