//! Pools, storages and engines together through the safe `TierLink` API:
//! a request's computed blocks move G1 → G2 → G3, G2 forgets them, and they
//! come back G3 → G2 → G1 — found each time by prefix matching on the
//! destination tier, and byte for byte what the "forward pass" wrote.
//! Host memory stands in for G1 (the CUDA path is in `transfer_roundtrip`).

use kvbm_core::block::ComputeDone;
use kvbm_core::layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_core::link::{End, HostTier, LinkError, TierLink};
use kvbm_core::storage::{DiskStorage, HostStorage};
use kvbm_core::transfer::{DiskDirection, DiskEngine, MemcpyEngine, TransferEngine};
use kvbm_core::{BlockPool, ImmutableBlock, PoolConfig, SaltHash, Tier, TokenSequence};
use std::sync::Arc;

const BS: usize = 4;

fn layout(n: usize, kind: LayoutKind) -> Layout {
    Layout::new(
        LayoutConfig {
            num_blocks: n,
            num_layers: 3,
            outer_dim: 2,
            page_size: BS,
            inner_dim: 16,
            dtype_bytes: 2,
        },
        kind,
    )
    .unwrap()
}

fn pool(tier: Tier, capacity: usize) -> BlockPool {
    BlockPool::new(PoolConfig {
        tier,
        capacity,
        block_size: BS,
        eviction: Default::default(),
        admission: Default::default(),
    })
    .unwrap()
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    (0..n as u64)
        .map(|i| {
            (seed
                .wrapping_mul(1_000_003)
                .wrapping_add(i)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                >> 56) as u8
        })
        .collect()
}

struct Rig {
    g1: HostTier,
    g2: HostTier,
    g3_pool: BlockPool,
    g3_disk: Arc<DiskStorage>,
    l12: TierLink,
    l21: TierLink,
    l23: TierLink,
    l32: TierLink,
    _dir: tempfile::TempDir,
}

fn rig(cap: usize) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let s1 = Arc::new(HostStorage::new(layout(cap, LayoutKind::LayerSeparate)).unwrap());
    let s2 = Arc::new(HostStorage::new(layout(cap, LayoutKind::FullyContiguous)).unwrap());
    let s3 = Arc::new(
        DiskStorage::create(
            dir.path().join("g3.bin"),
            layout(cap, LayoutKind::FullyContiguous),
        )
        .unwrap(),
    );
    let (p1, p2, p3) = (
        pool(Tier::Device, cap),
        pool(Tier::Host, cap),
        pool(Tier::Disk, cap),
    );
    let e12: Arc<dyn TransferEngine> =
        Arc::new(MemcpyEngine::new(s1.clone(), Tier::Device, s2.clone(), Tier::Host).unwrap());
    let e21: Arc<dyn TransferEngine> =
        Arc::new(MemcpyEngine::new(s2.clone(), Tier::Host, s1.clone(), Tier::Device).unwrap());
    let e23: Arc<dyn TransferEngine> = Arc::new(
        DiskEngine::new(
            s2.clone(),
            s3.clone(),
            DiskDirection::HostToDisk,
            Tier::Host,
        )
        .unwrap(),
    );
    let e32: Arc<dyn TransferEngine> = Arc::new(
        DiskEngine::new(
            s2.clone(),
            s3.clone(),
            DiskDirection::DiskToHost,
            Tier::Host,
        )
        .unwrap(),
    );
    // SAFETY: each storage was made for exactly one pool above, and is only
    // touched through these links and bindings.
    unsafe {
        Rig {
            g1: HostTier::bind(p1.clone(), s1).unwrap(),
            g2: HostTier::bind(p2.clone(), s2).unwrap(),
            g3_pool: p3.clone(),
            g3_disk: s3,
            l12: TierLink::new(e12, p1.clone(), p2.clone()).unwrap(),
            l21: TierLink::new(e21, p2.clone(), p1).unwrap(),
            l23: TierLink::new(e23, p2.clone(), p3.clone()).unwrap(),
            l32: TierLink::new(e32, p3, p2).unwrap(),
            _dir: dir,
        }
    }
}

/// Computes a request's full blocks on G1 the way an engine would: walk each
/// block through the lifecycle, write its KV bytes, register it.
fn prefill(r: &Rig, seq: &TokenSequence) -> Vec<ImmutableBlock> {
    let bytes = r.g1.block_bytes();
    let blocks = r.g1.pool().allocate(seq.blocks().len()).unwrap();
    blocks
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| {
            let mut p = b.init(seq.salt_hash(), tb.parent_sequence_hash(), tb.position());
            assert_eq!(p.add_tokens(tb.tokens()), BS);
            let mut inflight = p.ready().unwrap().schedule_compute();
            r.g1.write(&mut inflight, &pattern(tb.sequence_hash().0, bytes))
                .unwrap();
            match inflight.compute_done() {
                ComputeDone::Complete(c) => {
                    assert_eq!(c.sequence_hash(), tb.sequence_hash());
                    c.register()
                }
                ComputeDone::Partial(_) => panic!("a full block must complete"),
            }
        })
        .collect()
}

fn assert_bytes_host(t: &HostTier, blocks: &[ImmutableBlock]) {
    let mut buf = vec![0u8; t.block_bytes()];
    for b in blocks {
        t.read(b, &mut buf).unwrap();
        assert_eq!(buf, pattern(b.sequence_hash().0, buf.len()), "{b:?}");
    }
}

#[tokio::test]
async fn blocks_round_trip_through_all_tiers_and_are_found_by_prefix() {
    let r = rig(8);
    let toks: Vec<u32> = (100..100 + 4 * BS as u32 + 2).collect();
    let seq = TokenSequence::from_tokens(&toks, BS, kvbm_core::tokens::salt_hash(b"t")).unwrap();
    let hashes = seq.sequence_hashes();

    let g1 = prefill(&r, &seq);
    assert_bytes_host(&r.g1, &g1);

    // G1 → G2: registered on the host, found by prefix there.
    let g2 = r.l12.copy_and_register(g1.clone()).await.unwrap();
    assert_eq!(r.g2.pool().match_prefix(&hashes).len(), 4);
    assert_bytes_host(&r.g2, &g2);

    // G2 → G3, then G2 forgets everything (another workload evicts it).
    let g3 = r.l23.copy_and_register(g2.clone()).await.unwrap();
    let mut buf = vec![0u8; r.g2.block_bytes()];
    for b in &g3 {
        r.g3_disk.read_block(b.id(), &mut buf).unwrap();
        assert_eq!(buf, pattern(b.sequence_hash().0, buf.len()));
    }
    drop((g1, g2, g3));
    let filler = r.g2.pool().allocate(8).unwrap();
    assert!(r.g2.pool().match_prefix(&hashes).is_empty());
    assert_eq!(r.g2.pool().status().counters.evictions, 4);
    drop(filler);
    // And G1 too.
    drop(r.g1.pool().allocate(8).unwrap());
    assert!(r.g1.pool().match_prefix(&hashes).is_empty());

    // G3 → G2 → G1: the prefix comes back, byte for byte.
    let on_disk = r.g3_pool.match_prefix(&hashes);
    assert_eq!(on_disk.len(), 4);
    let back2 = r.l32.copy_and_register(on_disk).await.unwrap();
    assert_bytes_host(&r.g2, &back2);
    let back1 = r.l21.copy_and_register(back2).await.unwrap();
    assert_bytes_host(&r.g1, &back1);
    assert_eq!(r.g1.pool().match_prefix(&hashes).len(), 4);
}

#[tokio::test]
async fn bad_copies_are_refused_and_hand_the_blocks_back() {
    let r = rig(4);
    let toks: Vec<u32> = (0..2 * BS as u32).collect();
    let seq = TokenSequence::from_tokens(&toks, BS, SaltHash(1)).unwrap();
    let g1 = prefill(&r, &seq);

    // Count mismatch.
    let dst = r.g2.pool().allocate(1).unwrap();
    let rej = r.l12.copy(g1.clone(), dst).unwrap_err();
    assert!(matches!(
        rej.error,
        LinkError::CountMismatch {
            sources: 2,
            destinations: 1
        }
    ));
    assert_eq!((rej.sources.len(), rej.destinations.len()), (2, 1));
    drop(rej);

    // Destination from the wrong pool (G1's own pool).
    let wrong = r.g1.pool().allocate(2).unwrap();
    let rej = r.l12.copy(g1.clone(), wrong).unwrap_err();
    assert!(matches!(
        rej.error,
        LinkError::ForeignBlock {
            end: End::Destination,
            ..
        }
    ));
    drop(rej);

    // Source from the wrong pool.
    let g2 = r.l12.copy_and_register(g1.clone()).await.unwrap();
    let dst = r.g2.pool().allocate(2);
    assert!(dst.is_ok());
    let rej = r.l12.copy(g2.clone(), dst.unwrap()).unwrap_err();
    assert!(matches!(
        rej.error,
        LinkError::ForeignBlock {
            end: End::Source,
            ..
        }
    ));
    drop(rej);

    // Destination pool exhausted: a typed pool error, nothing leaks.
    let hold = r.g2.pool().allocate(2).unwrap();
    let e = r.l12.copy_and_register(g1.clone()).await;
    // Both hashes are registered and held on G2, the other 2 blocks are
    // mutable: nothing empty, nothing evictable.
    assert!(matches!(e, Err(LinkError::Pool(_))), "{e:?}");
    drop(hold);

    // Wiring errors at construction.
    let s = Arc::new(HostStorage::new(layout(2, LayoutKind::FullyContiguous)).unwrap());
    let e: Arc<dyn TransferEngine> =
        Arc::new(MemcpyEngine::new(s.clone(), Tier::Device, s.clone(), Tier::Host).unwrap());
    // SAFETY: refused before any use.
    let err =
        unsafe { TierLink::new(e.clone(), pool(Tier::Host, 2), pool(Tier::Host, 2)) }.unwrap_err();
    assert!(matches!(
        err,
        LinkError::TierMismatch {
            end: End::Source,
            ..
        }
    ));
    let err = unsafe { TierLink::new(e, pool(Tier::Device, 3), pool(Tier::Host, 2)) }.unwrap_err();
    assert!(matches!(
        err,
        LinkError::CapacityExceedsStorage {
            capacity: 3,
            storage_blocks: 2,
            ..
        }
    ));
    assert!(err.to_string().contains("3 blocks"), "{err}");
    drop((g1, g2));
}

#[tokio::test]
async fn dropping_a_copy_early_releases_the_blocks_after_the_copy() {
    let r = rig(8);
    let toks: Vec<u32> = (0..8 * BS as u32).collect();
    let seq = TokenSequence::from_tokens(&toks, BS, SaltHash(2)).unwrap();
    let g1 = prefill(&r, &seq);
    let dst = r.g2.pool().allocate(8).unwrap();
    let ticket = r.l12.copy(g1, dst).unwrap();
    drop(ticket);
    // The worker still holds the blocks until the bytes have moved, then
    // releases them: G2's eight mutable blocks return to the free list and
    // G1's registered blocks become inactive. Nothing leaks.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (s1, s2) = (r.g1.pool().status(), r.g2.pool().status());
        if s1.active == 0 && s2.active == 0 {
            assert_eq!((s1.inactive, s2.empty), (8, 8));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "blocks never released"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(r.l12.engine().counters().blocks, 8);
}
