//! Transfer engine throughput against the plain copy each engine replaces.
//!
//! In one run, on 64-block batches of 2 MiB blocks (128 MiB) with a
//! non-identity block mapping:
//!
//! * `MemcpyEngine` (host → host) vs `copy_from_slice` of the same blocks in
//!   the same pattern;
//! * `DiskEngine` host → disk vs sequential `write_all` of the same bytes to
//!   a file in the same directory, and disk → host vs sequential
//!   `read_exact`.
//!
//! Engine timings are wall clock from `submit` to the ticket resolving, so
//! they include the hand-off to the worker thread. Each measurement is the
//! median of several iterations after warm-up; engine and baseline
//! iterations alternate so drift affects both alike. Set
//! `KVBM_BENCH_QUICK=1` for a short run. Neither side fsyncs, so the disk
//! numbers mostly measure the page cache.
//!
//! Built with `--features cuda` on a machine with a GPU, it also measures
//! `CudaEngine` both ways against plain `cuMemcpy*Async` of the same blocks
//! in the same mapping (one call per block on one stream, then one
//! synchronise), between pinned host memory and device memory; and, for a
//! layer-separate device layout (a block is one piece per layer and K/V, as
//! vLLM keeps it), the engine against one bulk copy of the same bytes.
//! Without a usable GPU it says why and skips those rows.

use kvbm_core::Tier;
use kvbm_core::layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_core::storage::{DiskStorage, HostStorage};
use kvbm_core::transfer::{BlockPair, DiskDirection, DiskEngine, MemcpyEngine, TransferEngine};
use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::Arc;
use std::time::Instant;

const BLOCKS: usize = 64;

fn layout() -> Layout {
    // 1 layer x 2 (K, V) x 16 tokens x 32768 elements x 2 bytes = 2 MiB.
    let l = Layout::new(
        LayoutConfig {
            num_blocks: BLOCKS,
            num_layers: 1,
            outer_dim: 2,
            page_size: 16,
            inner_dim: 32768,
            dtype_bytes: 2,
        },
        LayoutKind::FullyContiguous,
    )
    .expect("bench layout");
    assert_eq!(l.block_bytes(), 2 << 20, "bench blocks must be 2 MiB");
    l
}

/// A fixed permutation of 0..64 (37 is coprime with 64).
fn mapping() -> Vec<(usize, usize)> {
    (0..BLOCKS).map(|i| (i, (i * 37 + 11) % BLOCKS)).collect()
}

/// What every row copies: the layout, a block's and the batch's bytes,
/// the block mapping, and the pairs both ways.
struct Plan {
    layout: Layout,
    bb: usize,
    total: usize,
    map: Vec<(usize, usize)>,
    pairs: Vec<BlockPair>,
    inverse: Vec<BlockPair>,
}

impl Plan {
    fn new() -> Plan {
        let layout = layout();
        let map = mapping();
        let pairs: Vec<BlockPair> = map
            .iter()
            .map(|&(s, d)| BlockPair::new(s as u32, d as u32))
            .collect();
        let inverse = pairs.iter().map(|p| BlockPair::new(p.dst, p.src)).collect();
        Plan {
            layout,
            bb: layout.block_bytes(),
            total: layout.block_bytes() * BLOCKS,
            map,
            pairs,
            inverse,
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs `engine` and `baseline` alternately; returns median GB/s of each.
fn measure(
    warmup: usize,
    iters: usize,
    bytes: usize,
    mut engine: impl FnMut(),
    mut baseline: impl FnMut(),
) -> (f64, f64) {
    let gbps = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        bytes as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    for _ in 0..warmup {
        engine();
        baseline();
    }
    let (mut e, mut b) = (Vec::new(), Vec::new());
    for _ in 0..iters {
        e.push(gbps(&mut engine));
        b.push(gbps(&mut baseline));
    }
    (median(e), median(b))
}

fn run(engine: &dyn TransferEngine, pairs: &[BlockPair]) {
    // SAFETY: the bench never touches a block while a batch naming it is in
    // flight: every batch is waited for before the next step.
    unsafe { engine.submit(pairs.to_vec()) }
        .expect("submit")
        .wait_blocking()
        .expect("transfer");
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::var("KVBM_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let (warmup, iters) = if quick { (1, 3) } else { (3, 25) };
    let plan = Plan::new();
    let Plan {
        layout,
        bb,
        total,
        ref map,
        ref pairs,
        ref inverse,
    } = plan;

    let fill: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
    let src = Arc::new(HostStorage::new(layout)?);
    let dst = Arc::new(HostStorage::new(layout)?);
    for b in 0..BLOCKS {
        // SAFETY: no engine exists yet.
        unsafe { src.write_block(b as u32, &fill[b * bb..(b + 1) * bb])? };
    }
    // Baseline buffers, touched so page faults are not measured.
    let src_vec = fill.clone();
    let mut dst_vec = vec![1u8; total];

    println!(
        "kvbm transfer bench: {BLOCKS} blocks x {} MiB per batch, median of {iters} after {warmup} warm-up{}",
        bb >> 20,
        if quick { " (quick)" } else { "" }
    );

    // (a) memcpy engine vs copy_from_slice.
    let memcpy = MemcpyEngine::new(src.clone(), Tier::Device, dst.clone(), Tier::Host)?;
    let (mem_e, mem_b) = measure(
        warmup,
        iters,
        total,
        || run(&memcpy, pairs),
        || {
            for &(s, d) in map.iter() {
                dst_vec[d * bb..(d + 1) * bb].copy_from_slice(&src_vec[s * bb..(s + 1) * bb]);
            }
        },
    );
    std::hint::black_box(&dst_vec);

    // (b) disk engines vs sequential write_all / read_exact, same directory,
    // both files sized up front, neither fsynced.
    let dir = tempfile::tempdir()?;
    let g3 = Arc::new(DiskStorage::create(dir.path().join("g3.kv"), layout)?);
    let base_path = dir.path().join("baseline.bin");
    let mut base = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&base_path)?;
    base.set_len(total as u64)?;
    let offload = DiskEngine::new(
        src.clone(),
        g3.clone(),
        DiskDirection::HostToDisk,
        Tier::Host,
    )?;
    let onboard = DiskEngine::new(
        dst.clone(),
        g3.clone(),
        DiskDirection::DiskToHost,
        Tier::Host,
    )?;

    let (w_e, w_b) = measure(
        warmup,
        iters,
        total,
        || run(&offload, pairs),
        || {
            base.seek(SeekFrom::Start(0)).expect("seek");
            for &(s, _) in map.iter() {
                base.write_all(&src_vec[s * bb..(s + 1) * bb])
                    .expect("write");
            }
        },
    );
    let (r_e, r_b) = measure(
        warmup,
        iters,
        total,
        || run(&onboard, inverse),
        || {
            base.seek(SeekFrom::Start(0)).expect("seek");
            for &(_, d) in map.iter() {
                base.read_exact(&mut dst_vec[d * bb..(d + 1) * bb])
                    .expect("read");
            }
        },
    );

    // Sanity: what went G2 -> G3 -> G2 came back intact (block s went to
    // disk block map(s), and back to host block s).
    let mut out = vec![0u8; bb];
    for b in [0usize, 17, 63] {
        // SAFETY: all engines are idle.
        unsafe { dst.read_block(b as u32, &mut out)? };
        assert!(out == fill[b * bb..(b + 1) * bb], "block {b} corrupted");
    }

    println!();
    println!(
        "| transfer (64 x 2 MiB) | engine GB/s | baseline | baseline GB/s | engine / baseline |"
    );
    println!("|---|---:|---|---:|---:|");
    for (name, e, base_name, b) in [
        (
            "host -> host, MemcpyEngine",
            mem_e,
            "copy_from_slice",
            mem_b,
        ),
        ("host -> disk, DiskEngine", w_e, "sequential write_all", w_b),
        (
            "disk -> host, DiskEngine",
            r_e,
            "sequential read_exact",
            r_b,
        ),
    ] {
        println!(
            "| {name} | {e:.2} | {base_name} | {b:.2} | {:.0}% |",
            e / b * 100.0
        );
    }
    #[cfg(feature = "cuda")]
    match cuda_rows(&plan, warmup, iters, &fill)? {
        Ok(rows) => {
            for (name, e, base_name, b) in rows {
                println!(
                    "| {name} | {e:.2} | {base_name} | {b:.2} | {:.0}% |",
                    e / b * 100.0
                );
            }
        }
        Err(why) => println!("\n(no CUDA rows: {why})"),
    }
    println!();
    println!(
        "Note: disk numbers go through the page cache (no O_DIRECT, no fsync on either side), \
         so they mostly measure memory bandwidth, not the device."
    );
    Ok(())
}

/// One row of the table: engine, its GB/s, the baseline, its GB/s.
#[cfg(feature = "cuda")]
type Row = (&'static str, f64, &'static str, f64);

/// The CUDA rows, or (inner `Err`) why there are none on this machine.
#[cfg(feature = "cuda")]
fn cuda_rows(
    plan: &Plan,
    warmup: usize,
    iters: usize,
    fill: &[u8],
) -> Result<Result<Vec<Row>, String>, Box<dyn std::error::Error>> {
    use cudarc::driver::{result, sys};
    use kvbm_core::storage::{DeviceStorage, cuda_available};
    use kvbm_core::transfer::{CudaDirection, CudaEngine};

    if let Err(why) = cuda_available() {
        return Ok(Err(why));
    }
    let Plan {
        layout,
        bb,
        total,
        ref map,
        ref pairs,
        ref inverse,
    } = *plan;

    let dev = Arc::new(DeviceStorage::new(0, layout)?);
    let host = Arc::new(HostStorage::new(layout)?);
    for b in 0..BLOCKS {
        dev.write_block(b as u32, &fill[b * bb..(b + 1) * bb])?;
    }
    let d2h = CudaEngine::new(dev.clone(), host.clone(), CudaDirection::DeviceToHost)?;
    let h2d = CudaEngine::new(dev.clone(), host.clone(), CudaDirection::HostToDevice)?;

    // Baseline: its own device buffer and pinned host buffer of the same
    // size, and its own stream, in the engine's context.
    let ctx = dev.context().clone();
    ctx.bind_to_thread()?;
    let stream = ctx.new_stream()?;
    let cu = stream.cu_stream();
    // SAFETY: sizes are non-zero; both are freed at the end of this
    // function, after the last synchronise.
    let dbuf = unsafe { result::malloc_sync(total) }?;
    let hbuf = unsafe { result::malloc_host(total, 0) }?.cast::<u8>();
    let copy_blocks = |to_host: bool| {
        ctx.bind_to_thread().expect("bind");
        for &(s, d) in map.iter() {
            let (s, d) = ((s * bb) as u64, d * bb);
            // SAFETY: both ranges lie inside the buffers allocated above,
            // and the stream is synchronised before anything reads them.
            let r = unsafe {
                if to_host {
                    sys::cuMemcpyDtoHAsync_v2(hbuf.add(d).cast(), dbuf + s, bb, cu)
                } else {
                    sys::cuMemcpyHtoDAsync_v2(dbuf + d as u64, hbuf.add(s as usize).cast(), bb, cu)
                }
            };
            r.result().expect("baseline copy");
        }
        stream.synchronize().expect("synchronize");
    };
    let (dh_e, dh_b) = measure(
        warmup,
        iters,
        total,
        || run(&d2h, pairs),
        || copy_blocks(true),
    );
    // What went to the host is device block s at host block map(s).
    let mut out = vec![0u8; bb];
    for &(s, d) in map.iter().step_by(13) {
        // SAFETY: the engines are idle.
        unsafe { host.read_block(d as u32, &mut out)? };
        assert!(out == fill[s * bb..(s + 1) * bb], "cuda d2h block {s}");
    }
    let (hd_e, hd_b) = measure(
        warmup,
        iters,
        total,
        || run(&h2d, inverse),
        || copy_blocks(false),
    );
    for b in [0u32, 31, 63] {
        dev.read_block(b, &mut out)?;
        assert!(
            out == fill[b as usize * bb..(b as usize + 1) * bb],
            "cuda h2d block {b}"
        );
    }

    // Layer-separate device blocks (vLLM's shape): 32 layers x K/V, so a
    // 2 MiB block is 64 pieces of 32 KiB; against one bulk copy.
    let sep = Layout::new(
        LayoutConfig {
            num_blocks: BLOCKS,
            num_layers: 32,
            outer_dim: 2,
            page_size: 16,
            inner_dim: 1024,
            dtype_bytes: 2,
        },
        LayoutKind::LayerSeparate,
    )?;
    let flat = Layout::new(*sep.config(), LayoutKind::FullyContiguous)?;
    assert_eq!(sep.block_bytes(), bb);
    let sep_dev = Arc::new(DeviceStorage::new(0, sep)?);
    let flat_host = Arc::new(HostStorage::new(flat)?);
    let sep_d2h = CudaEngine::new(
        sep_dev.clone(),
        flat_host.clone(),
        CudaDirection::DeviceToHost,
    )?;
    let bulk = || {
        ctx.bind_to_thread().expect("bind");
        // SAFETY: as in copy_blocks.
        unsafe { sys::cuMemcpyDtoHAsync_v2(hbuf.cast(), dbuf, total, cu) }
            .result()
            .expect("bulk copy");
        stream.synchronize().expect("synchronize");
    };
    let (sep_e, sep_b) = measure(warmup, iters, total, || run(&sep_d2h, pairs), bulk);

    drop((d2h, h2d, sep_d2h));
    ctx.bind_to_thread()?;
    // SAFETY: allocated above; every copy on `stream` has completed.
    unsafe {
        result::free_sync(dbuf)?;
        result::free_host(hbuf.cast())?;
    }
    Ok(Ok(vec![
        (
            "device -> host, CudaEngine",
            dh_e,
            "cuMemcpyDtoHAsync per block",
            dh_b,
        ),
        (
            "host -> device, CudaEngine",
            hd_e,
            "cuMemcpyHtoDAsync per block",
            hd_b,
        ),
        (
            "device (32 layers x K/V) -> host, CudaEngine",
            sep_e,
            "one bulk cuMemcpyDtoHAsync",
            sep_b,
        ),
    ]))
}
