//! The connector's worker side with vLLM's KV cache on a GPU, driven
//! through its Rust API with device buffers shaped as vLLM's CUDA
//! attention backends allocate them (per layer `[2, num_blocks,
//! block_size, heads, head_dim]`), as the Python class describes them:
//! a step's store and load enqueued on vLLM's stream, reported once run,
//! byte-exact in the host tier and back in G1.
//!
//! Without a GPU (or the `cuda` feature) it says it skips; under
//! `KVBM_REQUIRE_GPU=1` it fails instead.

#[cfg(not(feature = "cuda"))]
#[test]
fn the_gpu_worker_needs_the_cuda_feature() {
    kvbm_testkit::gpu::skip(
        "gpu_worker",
        "built without the `cuda` feature (cargo test -p kvbm-py --features cuda)",
    );
}

#[cfg(feature = "cuda")]
#[test]
fn a_step_on_a_gpu_stores_and_loads_in_stream_order() {
    use kvbm_core::layout::LayoutKind;
    use kvbm_core::storage::{DeviceStorage, cuda_available};
    use kvbm_py::config::Config;
    use kvbm_py::meta::{Batch, Pair, Route, StepPlan, StepReport};
    use kvbm_py::tiers::{Geometry, Shard};
    use kvbm_py::worker::{KvTensor, WorkerSide};
    use serde_json::json;

    if let Err(why) = cuda_available() {
        kvbm_testkit::gpu::skip("gpu_worker", &why);
        return;
    }
    // 2 layers; 16 blocks of 16 tokens; K and V of 4 heads × 64 in bf16.
    let (layers, blocks, bs, heads, dim) = (2usize, 16usize, 16usize, 4usize, 64usize);
    let page = 2 * bs * heads * dim * 2;
    let geometry = Geometry {
        num_gpu_blocks: blocks,
        block_size: bs,
        num_layers: layers,
        page_bytes: page,
    };
    let owner = DeviceStorage::new(
        0,
        geometry
            .layout_split(blocks, LayoutKind::LayerSeparateOuterFirst, 2)
            .unwrap(),
    )
    .unwrap();
    let tensors: Vec<KvTensor> = owner
        .regions()
        .iter()
        .enumerate()
        .map(|(l, &ptr)| KvTensor {
            name: format!("model.layers.{l}.self_attn.attn"),
            data_ptr: ptr,
            nbytes: (blocks * page) as u64,
            num_blocks: 2,
            block_stride_bytes: blocks * page / 2,
            contiguous: true,
            device: "cuda:0".into(),
            shape: vec![2, blocks, bs, heads, dim],
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::from_json(&json!({
        "shm_dir": dir.path().to_str().unwrap(),
        "host_capacity_tokens": 8 * bs,
    }))
    .unwrap();
    // SAFETY: `owner` outlives the worker (dropped after it, below).
    let mut w = unsafe { WorkerSide::start(&cfg, geometry, "gpu", tensors, Shard::ONE) }.unwrap();

    let n = layers * page;
    let fill = |b: u32| -> Vec<u8> { (0..n).map(|i| (i as u32 * 13 + b * 101) as u8).collect() };
    for b in [3u32, 4] {
        owner.write_block(b, &fill(b)).unwrap();
    }
    let ctx = owner.context().clone();
    let vllm = ctx.new_stream().unwrap();
    let pair = |src, dst| Pair {
        src,
        dst,
        hash: u64::from(src),
    };
    let plan = |step, stores: Vec<Batch>, loads: Vec<Batch>| StepPlan {
        step,
        stores,
        loads,
        failed_loads: Vec::new(),
        finished_sending: Vec::new(),
    };
    let wait_report = |w: &mut WorkerSide| -> StepReport {
        let t = std::time::Instant::now();
        loop {
            if let Some(r) = w.poll() {
                return StepReport::from_bytes(&r).unwrap();
            }
            assert!(t.elapsed().as_secs() < 10, "no report within 10 s");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };

    // Step 1: store G1 3, 4 into host blocks 0, 1.
    let store = Batch {
        route: Route::DeviceToHost,
        id: 1,
        pairs: vec![pair(3, 0), pair(4, 1)],
    };
    w.bind_plan(plan(1, vec![store], vec![]));
    // SAFETY: a live stream of vLLM's (stand-in) device.
    unsafe { w.run_on(vllm.cu_stream() as u64) };
    let r = wait_report(&mut w);
    assert_eq!(r.done.len(), 1);
    assert_eq!((r.done[0].id, r.done[0].error.as_deref()), (1, None));
    assert_eq!(r.done[0].bytes, 2 * n as u64);

    // Step 2: load them back into G1 9, 10; vLLM reads after its stream
    // has passed kvbm's fence.
    let load = Batch {
        route: Route::HostToDevice,
        id: 2,
        pairs: vec![pair(0, 9), pair(1, 10)],
    };
    w.bind_plan(plan(2, vec![], vec![load]));
    // SAFETY: as above.
    unsafe { w.run_on(vllm.cu_stream() as u64) };
    vllm.synchronize().unwrap();
    let r = wait_report(&mut w);
    assert_eq!((r.done[0].id, r.done[0].error.as_deref()), (2, None));
    assert!(w.take_load_errors().is_empty());
    let mut out = vec![0u8; n];
    for (src, dst) in [(3u32, 9u32), (4, 10)] {
        owner.read_block(dst, &mut out).unwrap();
        assert!(
            out == fill(src),
            "G1 block {dst} holds what G1 block {src} held"
        );
    }

    // A load out of range fails at once and is a load error (vLLM
    // computes the block instead).
    let bad = Batch {
        route: Route::HostToDevice,
        id: 3,
        pairs: vec![pair(99, 11)],
    };
    w.bind_plan(plan(3, vec![], vec![bad]));
    // SAFETY: as above.
    unsafe { w.run_on(vllm.cu_stream() as u64) };
    assert_eq!(w.take_load_errors(), [11]);
    drop(w);
    drop(owner);
}
