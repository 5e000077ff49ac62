//! kvbm's copies on a GPU, as vLLM's connector makes them: vLLM's KV
//! tensors wrapped as they are (per layer `[2, num_blocks, block_size,
//! heads, head_dim]`, per layer block first, and the cross-layer form),
//! stores and loads on kvbm's stream ordered against a stream standing in
//! for vLLM's, through the host tier to a disk file and back.
//!
//! Checked, byte for byte:
//! * **stores racing frees**: vLLM's stream overwrites the stored blocks
//!   right after the store is enqueued (a freed block reused); the host
//!   tier still gets the old bytes;
//! * **loads before the layer reads them**: vLLM's stream reads the loaded
//!   blocks right after the load is enqueued, with no wait on the host;
//!   it reads the loaded bytes;
//! * G1 → G2 → G3 → G2 → G1 in different block ids, both ways of handing
//!   pieces to the driver (batched where the driver has it).
//!
//! Without a GPU (or without the `cuda` feature) every test says it skips;
//! under `KVBM_REQUIRE_GPU=1` it fails instead.

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_copies_need_the_cuda_feature() {
    kvbm_testkit::gpu::skip(
        "cuda_stream_order",
        "built without the `cuda` feature (cargo test -p kvbm-core --features cuda)",
    );
}

#[cfg(feature = "cuda")]
mod gpu {
    use cudarc::driver::{CudaContext, CudaStream, sys};
    use kvbm_core::Tier;
    use kvbm_core::layout::{Layout, LayoutConfig, LayoutKind};
    use kvbm_core::storage::{DeviceStorage, DiskStorage, HostStorage, cuda_available};
    use kvbm_core::transfer::{
        BlockPair, CopyCalls, DiskDirection, DiskEngine, StreamCopier, StreamDirection,
        TransferEngine, batch_call_available,
    };
    use std::sync::Arc;

    /// A context and a stream standing in for vLLM's, or `None` (skipped).
    fn gpu(test: &str) -> Option<(Arc<CudaContext>, Arc<CudaStream>)> {
        if let Err(why) = cuda_available() {
            kvbm_testkit::gpu::skip(test, &why);
            return None;
        }
        let ctx = CudaContext::new(0).expect("context");
        let stream = ctx.new_stream().expect("stream");
        Some((ctx, stream))
    }

    use kvbm_testkit::bytes::pattern;

    /// A small model's shape: 4 layers, K and V, 16 tokens of 8 heads × 64
    /// in bf16: 16 KiB pages, 128 KiB blocks.
    fn layout(kind: LayoutKind, blocks: usize) -> Layout {
        let config = LayoutConfig {
            num_blocks: blocks,
            num_layers: 4,
            outer_dim: 2,
            page_size: 16,
            inner_dim: 8 * 64,
            dtype_bytes: 2,
        };
        Layout::new(config, kind).unwrap()
    }

    fn pairs(from: std::ops::Range<u32>, to: u32) -> Vec<BlockPair> {
        from.clone()
            .map(|b| BlockPair::new(b, to + (b - from.start)))
            .collect()
    }

    /// Every range of `blocks` of `dev`, as device addresses.
    fn ranges(dev: &DeviceStorage, blocks: std::ops::Range<u32>) -> Vec<(u64, usize)> {
        let l = dev.layout();
        blocks
            .flat_map(|b| l.block_ranges(b).unwrap())
            .map(|r| (dev.regions()[r.region] + r.offset as u64, r.len))
            .collect()
    }

    fn roundtrip(kind: LayoutKind, calls: CopyCalls) {
        let test = format!("roundtrip {kind:?} {calls:?}");
        let Some((_ctx, engine)) = gpu(&test) else {
            return;
        };
        if calls == CopyCalls::Batched && !batch_call_available() {
            kvbm_testkit::gpu::skip(&test, "the driver has no cuMemcpyBatchAsync (before 12.8)");
            return;
        }
        let es = engine.cu_stream();
        // vLLM's tensors, allocated elsewhere and wrapped as they are.
        let owner = DeviceStorage::new(0, layout(kind, 24)).unwrap();
        // SAFETY: `owner` outlives `g1` (dropped after it, below).
        let g1 = Arc::new(
            unsafe { DeviceStorage::external(0, *owner.layout(), owner.regions().to_vec()) }
                .unwrap(),
        );
        let g2 = Arc::new(HostStorage::new(layout(LayoutKind::FullyContiguous, 32)).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let g3 = Arc::new(
            DiskStorage::create(
                dir.path().join("g3"),
                layout(LayoutKind::FullyContiguous, 16),
            )
            .unwrap(),
        );
        let n = g1.layout().block_bytes();
        for b in 0..8 {
            g1.write_block(b, &pattern(b, n)).unwrap();
        }
        let copier = StreamCopier::new(g1.clone(), g2.clone(), calls).unwrap();

        // Stores racing frees: G1 0..8 → G2 10..18, then vLLM's stream at
        // once overwrites G1 0..8.
        // SAFETY (all enqueues below): the test touches the blocks only
        // through the engine stream, ordered by the fences, or after
        // waiting for them.
        let fence = unsafe {
            copier.wait_for(es).unwrap();
            copier
                .enqueue(StreamDirection::Store, &pairs(0..8, 10))
                .unwrap();
            copier.fence(Some(es)).unwrap()
        };
        for (addr, len) in ranges(&g1, 0..8) {
            // SAFETY: device memory of `owner`, on vLLM's stand-in stream.
            unsafe { sys::cuMemsetD8Async(addr, 0xEE, len, es) }
                .result()
                .unwrap();
        }
        fence.wait().unwrap();
        engine.synchronize().unwrap();
        let mut out = vec![0u8; n];
        for b in 0..8 {
            // SAFETY: the copies have run.
            unsafe { g2.read_block(10 + b, &mut out).unwrap() };
            assert!(
                out == pattern(b, n),
                "{test}: host block {} holds G1 block {b}",
                10 + b
            );
            g1.read_block(b, &mut out).unwrap();
            assert!(
                out.iter().all(|&x| x == 0xEE),
                "{test}: vLLM's write to G1 block {b} landed"
            );
        }

        // Through the disk file and back into other host blocks.
        let to_disk = DiskEngine::new(
            g2.clone(),
            g3.clone(),
            DiskDirection::HostToDisk,
            Tier::Host,
        )
        .unwrap();
        let from_disk = DiskEngine::new(
            g2.clone(),
            g3.clone(),
            DiskDirection::DiskToHost,
            Tier::Host,
        )
        .unwrap();
        // SAFETY: nothing else touches these blocks meanwhile.
        unsafe {
            to_disk.transfer_blocking(pairs(10..18, 3)).unwrap();
            from_disk.transfer_blocking(pairs(3..11, 20)).unwrap();
        }

        // Loads before the layer reads them: G2 20..28 → G1 12..20, and
        // vLLM's stream copies them out (its "read") right after.
        let scratch = DeviceStorage::new(0, layout(kind, 8)).unwrap();
        let fence = unsafe {
            copier.wait_for(es).unwrap();
            copier
                .enqueue(StreamDirection::Load, &pairs(20..28, 12))
                .unwrap();
            copier.fence(Some(es)).unwrap()
        };
        for ((src, len), (dst, len2)) in ranges(&g1, 12..20).into_iter().zip(ranges(&scratch, 0..8))
        {
            assert_eq!(len, len2);
            // SAFETY: both device memory of this context.
            unsafe { sys::cuMemcpyAsync(dst, src, len, es) }
                .result()
                .unwrap();
        }
        engine.synchronize().unwrap();
        assert!(
            fence.is_done().unwrap(),
            "{test}: vLLM's stream ran before kvbm's fence"
        );
        for b in 0..8 {
            scratch.read_block(b, &mut out).unwrap();
            assert!(
                out == pattern(b, n),
                "{test}: vLLM read G1 block {} before its load",
                12 + b
            );
        }
        drop(copier);
        drop(g1);
        drop(owner);
    }

    #[test]
    fn vllm_kv_first_tensors() {
        roundtrip(LayoutKind::LayerSeparateOuterFirst, CopyCalls::Auto);
        roundtrip(LayoutKind::LayerSeparateOuterFirst, CopyCalls::PerPiece);
        roundtrip(LayoutKind::LayerSeparateOuterFirst, CopyCalls::Batched);
    }

    #[test]
    fn vllm_block_first_tensors() {
        roundtrip(LayoutKind::LayerSeparate, CopyCalls::Auto);
        roundtrip(LayoutKind::LayerSeparate, CopyCalls::PerPiece);
    }

    #[test]
    fn vllm_cross_layer_tensor() {
        roundtrip(LayoutKind::FullyContiguous, CopyCalls::Auto);
        roundtrip(LayoutKind::FullyContiguous, CopyCalls::PerPiece);
    }

    #[test]
    fn a_bad_batch_enqueues_nothing() {
        let Some((_ctx, engine)) = gpu("a_bad_batch_enqueues_nothing") else {
            return;
        };
        let g1 = Arc::new(
            DeviceStorage::new(0, layout(LayoutKind::LayerSeparateOuterFirst, 4)).unwrap(),
        );
        let g2 = Arc::new(HostStorage::new(layout(LayoutKind::FullyContiguous, 4)).unwrap());
        let copier = StreamCopier::new(g1, g2, CopyCalls::Auto).unwrap();
        // SAFETY: nothing is copied (the batch is refused).
        let e = unsafe {
            copier.wait_for(engine.cu_stream()).unwrap();
            copier.enqueue(StreamDirection::Store, &[BlockPair::new(0, 9)])
        };
        assert!(e.unwrap_err().to_string().contains('9'));
        // Shapes that differ are refused at construction.
        let other = Arc::new(
            HostStorage::new(
                Layout::new(
                    LayoutConfig {
                        num_blocks: 4,
                        num_layers: 3,
                        outer_dim: 2,
                        page_size: 16,
                        inner_dim: 512,
                        dtype_bytes: 2,
                    },
                    LayoutKind::FullyContiguous,
                )
                .unwrap(),
            )
            .unwrap(),
        );
        let g1 = Arc::new(DeviceStorage::new(0, layout(LayoutKind::LayerSeparate, 4)).unwrap());
        assert!(StreamCopier::new(g1, other, CopyCalls::Auto).is_err());
    }
}
