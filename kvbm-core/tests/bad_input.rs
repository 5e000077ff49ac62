//! Bad input produces typed errors, never panics.

use kvbm_core::Tier;
use kvbm_core::layout::{Layout, LayoutConfig, LayoutError, LayoutKind};
use kvbm_core::storage::{DiskStorage, HostStorage, StorageError};
use kvbm_core::transfer::{
    BlockPair, DiskDirection, DiskEngine, EngineConfig, MemcpyEngine, Side, TransferEngine,
    TransferError,
};
use std::sync::Arc;

fn config(num_blocks: usize) -> LayoutConfig {
    LayoutConfig {
        num_blocks,
        num_layers: 2,
        outer_dim: 2,
        page_size: 4,
        inner_dim: 32,
        dtype_bytes: 2,
    }
}

fn host(kind: LayoutKind, num_blocks: usize) -> Arc<HostStorage> {
    Arc::new(HostStorage::new(Layout::new(config(num_blocks), kind).unwrap()).unwrap())
}

#[test]
fn zero_dimensions_and_zero_capacity_are_typed_errors() {
    let mut c = config(4);
    c.page_size = 0; // zero block size
    assert_eq!(
        Layout::new(c, LayoutKind::FullyContiguous),
        Err(LayoutError::ZeroDimension { field: "page_size" })
    );
    let mut c = config(4);
    c.dtype_bytes = 0;
    assert_eq!(
        Layout::new(c, LayoutKind::LayerSeparate),
        Err(LayoutError::ZeroDimension {
            field: "dtype_bytes"
        })
    );
    // Zero capacity.
    let err = Layout::new(config(0), LayoutKind::FullyContiguous).unwrap_err();
    assert_eq!(
        err,
        LayoutError::ZeroDimension {
            field: "num_blocks"
        }
    );
    assert!(err.to_string().contains("num_blocks"), "{err}");
    // Storage construction goes through the layout, so the same error
    // arrives wrapped.
    let wrapped: StorageError = err.into();
    assert!(matches!(
        wrapped,
        StorageError::Layout(LayoutError::ZeroDimension { .. })
    ));
}

#[test]
fn layout_size_overflow_is_an_error() {
    let c = LayoutConfig {
        num_blocks: usize::MAX / 4,
        num_layers: 80,
        outer_dim: 2,
        page_size: 32,
        inner_dim: 1024,
        dtype_bytes: 2,
    };
    for kind in [LayoutKind::FullyContiguous, LayoutKind::LayerSeparate] {
        assert!(matches!(
            Layout::new(c, kind),
            Err(LayoutError::Overflow { .. })
        ));
    }
    // Per-block size alone overflowing.
    let c = LayoutConfig {
        num_blocks: 1,
        num_layers: usize::MAX,
        outer_dim: 2,
        page_size: 1,
        inner_dim: 1,
        dtype_bytes: 1,
    };
    assert!(matches!(
        Layout::new(c, LayoutKind::FullyContiguous),
        Err(LayoutError::Overflow { .. })
    ));
}

fn assert_io_error_names(path: &str) {
    let layout = Layout::new(config(4), LayoutKind::FullyContiguous).unwrap();
    let err = DiskStorage::create(path, layout).unwrap_err();
    assert!(matches!(err, StorageError::Io { .. }), "{err:?}");
    assert!(
        err.to_string().contains(path),
        "message should name {path}: {err}"
    );
}

#[test]
fn unwritable_disk_path_is_io_error_naming_the_path() {
    assert_io_error_names("/definitely/not/a/dir/kvbm-g3.kv");
    // Even root cannot create regular files in /proc.
    assert_io_error_names("/proc/kvbm-g3.kv");
}

#[test]
fn different_shapes_are_rejected_at_engine_construction() {
    let a = host(LayoutKind::FullyContiguous, 4);
    let mut c = config(4);
    c.inner_dim = 64;
    let b =
        Arc::new(HostStorage::new(Layout::new(c, LayoutKind::FullyContiguous).unwrap()).unwrap());
    assert!(matches!(
        MemcpyEngine::new(a.clone(), Tier::Device, b, Tier::Host),
        Err(TransferError::LayoutMismatch { .. })
    ));

    let dir = tempfile::tempdir().unwrap();
    let mut c = config(4);
    c.num_layers = 3;
    let disk = Arc::new(
        DiskStorage::create(
            dir.path().join("g3.kv"),
            Layout::new(c, LayoutKind::FullyContiguous).unwrap(),
        )
        .unwrap(),
    );
    for direction in [DiskDirection::HostToDisk, DiskDirection::DiskToHost] {
        let err = DiskEngine::new(a.clone(), disk.clone(), direction, Tier::Host)
            .err()
            .expect("mismatch must be rejected");
        assert!(matches!(err, TransferError::LayoutMismatch { .. }), "{err}");
    }
    // Count and kind may differ.
    assert!(
        MemcpyEngine::new(
            a,
            Tier::Device,
            host(LayoutKind::LayerSeparate, 9),
            Tier::Host
        )
        .is_ok()
    );
}

#[test]
fn bad_block_ids_and_duplicates_are_rejected_by_submit() {
    let src = host(LayoutKind::LayerSeparate, 4);
    let dst = host(LayoutKind::FullyContiguous, 6);
    let engine = MemcpyEngine::new(src, Tier::Device, dst, Tier::Host).unwrap();
    // SAFETY (all submits): every one of them is rejected, nothing is copied.
    let err =
        unsafe { engine.submit(vec![BlockPair::new(0, 0), BlockPair::new(4, 1)]) }.unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::BlockOutOfRange {
                side: Side::Source,
                block: 4,
                num_blocks: 4
            }
        ),
        "{err}"
    );
    let err = unsafe { engine.submit(vec![BlockPair::new(0, u32::MAX)]) }.unwrap_err();
    assert!(
        matches!(
            err,
            TransferError::BlockOutOfRange {
                side: Side::Destination,
                ..
            }
        ),
        "{err}"
    );
    let err = unsafe {
        engine.submit(vec![
            BlockPair::new(0, 5),
            BlockPair::new(1, 2),
            BlockPair::new(2, 5),
        ])
    }
    .unwrap_err();
    assert!(
        matches!(err, TransferError::DuplicateDestination(5)),
        "{err}"
    );
    // Nothing ran.
    assert_eq!(engine.counters().batches, 0);

    let dir = tempfile::tempdir().unwrap();
    let g2 = host(LayoutKind::FullyContiguous, 4);
    let g3 = Arc::new(
        DiskStorage::create(
            dir.path().join("g3.kv"),
            Layout::new(config(2), LayoutKind::FullyContiguous).unwrap(),
        )
        .unwrap(),
    );
    let offload = DiskEngine::new(
        g2.clone(),
        g3.clone(),
        DiskDirection::HostToDisk,
        Tier::Host,
    )
    .unwrap();
    let err = unsafe { offload.submit(vec![BlockPair::new(3, 2)]) }.unwrap_err();
    assert!(matches!(
        err,
        TransferError::BlockOutOfRange {
            side: Side::Destination,
            block: 2,
            ..
        }
    ));
    let onboard = DiskEngine::new(g2, g3, DiskDirection::DiskToHost, Tier::Host).unwrap();
    let err = unsafe { onboard.submit(vec![BlockPair::new(2, 0)]) }.unwrap_err();
    assert!(matches!(
        err,
        TransferError::BlockOutOfRange {
            side: Side::Source,
            block: 2,
            ..
        }
    ));
    let err =
        unsafe { onboard.submit(vec![BlockPair::new(0, 1), BlockPair::new(1, 1)]) }.unwrap_err();
    assert!(matches!(err, TransferError::DuplicateDestination(1)));
}

#[test]
fn zero_queue_depth_is_rejected() {
    let r = MemcpyEngine::with_config(
        host(LayoutKind::FullyContiguous, 2),
        Tier::Device,
        host(LayoutKind::FullyContiguous, 2),
        Tier::Host,
        EngineConfig { queue_depth: 0 },
    );
    assert!(matches!(r, Err(TransferError::InvalidConfig { .. })));
}

/// Through the public API: a depth-1 queue behind a worker busy with a
/// large batch fills up: batch A runs (16 MiB of copying, milliseconds),
/// B waits in the queue, C is rejected (or A still waits in the queue and
/// both B and C are). Submissions take microseconds, so
/// this practically always happens in the first round; rounds repeat only
/// to rule out a scheduler stall.
#[test]
fn full_queue_returns_queue_full() {
    let big = || {
        let c = LayoutConfig {
            num_blocks: 48,
            num_layers: 1,
            outer_dim: 2,
            page_size: 16,
            inner_dim: 16384,
            dtype_bytes: 2,
        }; // 1 MiB blocks
        Arc::new(HostStorage::new(Layout::new(c, LayoutKind::FullyContiguous).unwrap()).unwrap())
    };
    let engine = MemcpyEngine::with_config(
        big(),
        Tier::Device,
        big(),
        Tier::Host,
        EngineConfig { queue_depth: 1 },
    )
    .unwrap();
    // Three disjoint groups of 16 blocks, reversed mapping.
    let group = |g: u32| {
        (0..16)
            .map(|i| BlockPair::new(g * 16 + i, g * 16 + 15 - i))
            .collect::<Vec<_>>()
    };
    let mut rejected = 0;
    for _round in 0..20 {
        let mut tickets = Vec::new();
        for g in 0..3 {
            // SAFETY: the groups are disjoint, the test never touches the
            // blocks, and every ticket is waited for before the next round.
            match unsafe { engine.submit(group(g)) } {
                Ok(t) => tickets.push(t),
                Err(TransferError::QueueFull { engine: "memcpy" }) => rejected += 1,
                Err(e) => panic!("unexpected error {e}"),
            }
        }
        for t in tickets {
            t.wait_blocking().unwrap();
        }
        if rejected > 0 {
            break;
        }
    }
    // B is rejected too when the worker has not yet dequeued A.
    assert!(
        (1..=2).contains(&rejected),
        "a depth-1 queue never filled up"
    );
    assert_eq!(engine.counters().rejected, rejected);
}

/// Dropping an engine with batches queued: when `drop` returns every
/// ticket is resolved (the worker is joined), and each answer is the truth
/// about its batch. In queue order, the batches the worker reached are `Ok`
/// and their bytes are in the destination; from the first `EngineStopped`
/// on, every later batch is `EngineStopped` too and its destination block
/// still holds zeros. The first batch is waited for before the others are
/// submitted, so at least one is copied; how many more depends on how far
/// the worker got before the drop, and that no answer is wrong does not.
#[test]
fn dropping_an_engine_resolves_pending_tickets() {
    const N: u32 = 8;
    let src = host(LayoutKind::FullyContiguous, N as usize);
    let dst = host(LayoutKind::FullyContiguous, N as usize);
    let n = src.layout().block_bytes();
    let pattern = |b: u32| -> Vec<u8> { (0..n).map(|i| (b as usize * 31 + i) as u8 | 1).collect() };
    for b in 0..N {
        // SAFETY: no engine exists yet.
        unsafe { src.write_block(b, &pattern(b)).unwrap() };
    }
    let engine = MemcpyEngine::new(src, Tier::Device, dst.clone(), Tier::Host).unwrap();
    // SAFETY (both submits): one batch per destination block; the test
    // reads them only after every ticket has resolved.
    let submit = |b: u32| unsafe { engine.submit(vec![BlockPair::new(b, N - 1 - b)]) }.unwrap();
    // The first batch is done before the rest go in, so both answers occur.
    let first = submit(0).wait_blocking();
    let tickets: Vec<_> = (1..N).map(submit).collect();
    drop(engine);
    // Resolved already; a bound so that a ticket left pending fails the
    // test instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rest = tickets.into_iter().map(|t| t.wait_blocking());
        let _ = tx.send(std::iter::once(first).chain(rest).collect::<Vec<_>>());
    });
    let results = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("tickets still pending 10 s after the engine was dropped");
    let stopped_from = results
        .iter()
        .position(Result::is_err)
        .unwrap_or(results.len());
    assert!(
        stopped_from >= 1,
        "the first batch was waited for: {:?}",
        results[0]
    );
    let mut out = vec![0u8; n];
    for (b, r) in (0..N).zip(&results) {
        // SAFETY: every ticket has resolved and the engine is gone.
        unsafe { dst.read_block(N - 1 - b, &mut out).unwrap() };
        if (b as usize) < stopped_from {
            let stats = r.as_ref().unwrap();
            assert_eq!((stats.blocks, stats.bytes), (1, n as u64), "batch {b}");
            assert_eq!(
                out,
                pattern(b),
                "batch {b} answered Ok but its bytes are not there"
            );
        } else {
            assert!(
                matches!(r, Err(TransferError::EngineStopped { engine: "memcpy" })),
                "batch {b} after a stopped one: {r:?}"
            );
            assert!(
                out.iter().all(|&x| x == 0),
                "batch {b} answered EngineStopped but its destination was written"
            );
        }
    }
    eprintln!(
        "{stopped_from} of {N} batches copied (the first before the others went in), {} answered EngineStopped",
        N as usize - stopped_from
    );
}

#[test]
fn disk_io_failure_is_reported_with_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g3.kv");
    let layout = Layout::new(config(4), LayoutKind::FullyContiguous).unwrap();
    let g3 = Arc::new(DiskStorage::create(&path, layout).unwrap());
    let g2 = host(LayoutKind::FullyContiguous, 4);
    // Shrink the file behind the storage's back: reading block 3 hits EOF.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(layout.block_bytes() as u64)
        .unwrap();
    let onboard = DiskEngine::new(g2, g3, DiskDirection::DiskToHost, Tier::Host).unwrap();
    // SAFETY: the test does not touch G2 block 0.
    let err = unsafe { onboard.submit(vec![BlockPair::new(3, 0)]) }
        .unwrap()
        .wait_blocking()
        .unwrap_err();
    assert!(
        matches!(err, TransferError::Storage(StorageError::Io { .. })),
        "{err:?}"
    );
    assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");
    assert_eq!(onboard.counters().failed, 1);
}
