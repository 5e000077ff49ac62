//! The connector's GPU copy paths against one bulk copy of the same bytes,
//! in the same run (feature `cuda`, a GPU).
//!
//! G1 is laid out as vLLM's CUDA attention backends keep it: per layer
//! `[2, num_blocks, ...]`, 32 layers, so a block is 64 pieces (K and V of
//! each layer); G2 is pinned host memory, a block contiguous. For block
//! sizes from 64 KiB to 2 MiB, a 64 MiB batch of blocks in a scattered
//! mapping (nothing merges) goes through [`StreamCopier`] exactly as the
//! connector's worker sends it (enqueue, fence, wait for the fence):
//!
//! * store (G1 → G2) against one `cuMemcpyAsync` device → host of 64 MiB;
//! * load (G2 → G1) against one host → device;
//! * both at once (a store and a load on two copiers, different blocks)
//!   against the two bulk copies at once on two streams;
//!
//! each with the pieces handed over batched (`cuMemcpyBatchAsync`, where
//! the driver has it) and one call per piece. Medians of 9 runs after 3
//! warm-ups; the two sides alternate. Target: ≥ 80% of the bulk copy.
//!
//! Run: `cargo bench -p kvbm-core --features cuda --bench cuda_vllm`.
//! Without a GPU it says why and exits 0; with `KVBM_REQUIRE_GPU=1`, 1.

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("cuda_vllm: built without the `cuda` feature (add --features cuda)");
    if std::env::var("KVBM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    gpu::main()
}

#[cfg(feature = "cuda")]
mod gpu {
    use cudarc::driver::{CudaStream, result, sys};
    use kvbm_core::layout::{Layout, LayoutConfig, LayoutKind};
    use kvbm_core::storage::{DeviceStorage, HostStorage, cuda_available};
    use kvbm_core::transfer::{
        BlockPair, CopyCalls, StreamCopier, StreamDirection, batch_call_available,
    };
    use std::sync::Arc;
    use std::time::Instant;

    const BATCH_BYTES: usize = 64 << 20;
    const LAYERS: usize = 32;

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    }

    /// GB/s of `f` moving `bytes`, median over runs alternating with `g`.
    fn pair(bytes: usize, mut f: impl FnMut(), mut g: impl FnMut()) -> (f64, f64) {
        let gbps = |h: &mut dyn FnMut()| {
            let t = Instant::now();
            h();
            bytes as f64 / t.elapsed().as_secs_f64() / 1e9
        };
        for _ in 0..3 {
            f();
            g();
        }
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..9 {
            a.push(gbps(&mut f));
            b.push(gbps(&mut g));
        }
        (median(a), median(b))
    }

    /// vLLM's layout for blocks of `block_bytes` over 32 layers × K/V.
    fn layouts(block_bytes: usize, blocks: usize) -> (Layout, Layout) {
        let config = LayoutConfig {
            num_blocks: blocks,
            num_layers: LAYERS,
            outer_dim: 2,
            page_size: 16,
            inner_dim: block_bytes / (LAYERS * 2 * 16 * 2),
            dtype_bytes: 2,
        };
        (
            Layout::new(config, LayoutKind::LayerSeparateOuterFirst).unwrap(),
            Layout::new(config, LayoutKind::FullyContiguous).unwrap(),
        )
    }

    /// Bulk buffers of 64 MiB each way, and a stream per direction.
    struct Bulk {
        dev: [sys::CUdeviceptr; 2],
        host: [*mut u8; 2],
        streams: [Arc<CudaStream>; 2],
    }

    impl Bulk {
        fn d2h(&self, i: usize) {
            // SAFETY: both buffers hold BATCH_BYTES; synchronised by callers.
            unsafe {
                sys::cuMemcpyAsync(
                    self.host[i] as u64,
                    self.dev[i],
                    BATCH_BYTES,
                    self.streams[i].cu_stream(),
                )
            }
            .result()
            .expect("bulk d2h");
        }

        fn h2d(&self, i: usize) {
            // SAFETY: as above.
            unsafe {
                sys::cuMemcpyAsync(
                    self.dev[i],
                    self.host[i] as u64,
                    BATCH_BYTES,
                    self.streams[i].cu_stream(),
                )
            }
            .result()
            .expect("bulk h2d");
        }

        fn sync(&self) {
            for s in &self.streams {
                s.synchronize().expect("synchronize");
            }
        }
    }

    fn run(copier: &StreamCopier, direction: StreamDirection, pairs: &[BlockPair]) {
        // SAFETY: nothing else touches the storages; each batch is waited
        // for before the next.
        unsafe { copier.enqueue(direction, pairs) }.expect("enqueue");
        // SAFETY: no engine stream to order (the bench is the engine).
        unsafe { copier.fence(None) }
            .expect("fence")
            .wait()
            .expect("wait");
    }

    pub fn main() -> Result<(), Box<dyn std::error::Error>> {
        let required = std::env::var("KVBM_REQUIRE_GPU").is_ok_and(|v| v == "1");
        if let Err(why) = cuda_available() {
            println!("cuda_vllm: no GPU ({why})");
            if required {
                std::process::exit(1);
            }
            return Ok(());
        }
        let ctx = cudarc::driver::CudaContext::new(0)?;
        ctx.bind_to_thread()?;
        let mut version = 0;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
        println!(
            "GPU 0: {}; driver {}.{}; cuMemcpyBatchAsync {}",
            ctx.name()?,
            version / 1000,
            version % 1000 / 10,
            if batch_call_available() {
                "available"
            } else {
                "not available"
            }
        );
        // SAFETY: sizes are non-zero; freed at the end after a sync.
        let bulk = unsafe {
            Bulk {
                dev: [
                    result::malloc_sync(BATCH_BYTES)?,
                    result::malloc_sync(BATCH_BYTES)?,
                ],
                host: [
                    result::malloc_host(BATCH_BYTES, 0)?.cast(),
                    result::malloc_host(BATCH_BYTES, 0)?.cast(),
                ],
                streams: [ctx.new_stream()?, ctx.new_stream()?],
            }
        };
        println!();
        println!(
            "| block | calls | store GB/s | bulk d→h | store % | load GB/s | bulk h→d | load % | both GB/s | bulk both | both % |"
        );
        println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for block in [64usize << 10, 256 << 10, 1 << 20, 2 << 20] {
            let n = BATCH_BYTES / block;
            // Twice the batch on each side: the "both" row stores one half
            // while it loads the other.
            let (g1l, g2l) = layouts(block, 2 * n);
            let g1 = Arc::new(DeviceStorage::new(0, g1l)?);
            let g2 = Arc::new(HostStorage::new(g2l)?);
            // Scattered: block i to (i * 37 + 11) mod n, so nothing merges.
            let scatter = |i: usize| ((i * 37 + 11) % n) as u32;
            let stores: Vec<_> = (0..n)
                .map(|i| BlockPair::new(i as u32, scatter(i)))
                .collect();
            let loads: Vec<_> = (0..n)
                .map(|i| BlockPair::new((n + i) as u32, (n as u32) + scatter(i)))
                .collect();
            for calls in [CopyCalls::Batched, CopyCalls::PerPiece] {
                if calls == CopyCalls::Batched && !batch_call_available() {
                    continue;
                }
                let a = StreamCopier::new(g1.clone(), g2.clone(), calls)?;
                let b = StreamCopier::new(g1.clone(), g2.clone(), calls)?;
                let (s, sb) = pair(
                    BATCH_BYTES,
                    || run(&a, StreamDirection::Store, &stores),
                    || {
                        bulk.d2h(0);
                        bulk.sync();
                    },
                );
                let (l, lb) = pair(
                    BATCH_BYTES,
                    || run(&a, StreamDirection::Load, &loads),
                    || {
                        bulk.h2d(0);
                        bulk.sync();
                    },
                );
                let (both, bothb) = pair(
                    2 * BATCH_BYTES,
                    || {
                        // SAFETY: disjoint blocks on two streams.
                        unsafe {
                            a.enqueue(StreamDirection::Store, &stores).expect("store");
                            b.enqueue(StreamDirection::Load, &loads).expect("load");
                            let (fa, fb) =
                                (a.fence(None).expect("fence"), b.fence(None).expect("fence"));
                            fa.wait().expect("wait");
                            fb.wait().expect("wait");
                        }
                    },
                    || {
                        bulk.d2h(0);
                        bulk.h2d(1);
                        bulk.sync();
                    },
                );
                println!(
                    "| {} KiB | {} | {s:.1} | {sb:.1} | {:.0}% | {l:.1} | {lb:.1} | {:.0}% | {both:.1} | {bothb:.1} | {:.0}% |",
                    block >> 10,
                    match calls {
                        CopyCalls::Batched => "batched",
                        _ => "per piece",
                    },
                    s / sb * 100.0,
                    l / lb * 100.0,
                    both / bothb * 100.0,
                );
            }
        }
        bulk.sync();
        // SAFETY: allocated above; every copy has completed.
        unsafe {
            for i in 0..2 {
                result::free_sync(bulk.dev[i])?;
                result::free_host(bulk.host[i].cast())?;
            }
        }
        Ok(())
    }
}
