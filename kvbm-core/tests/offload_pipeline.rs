//! The offload pipeline against its cancellation rules (P1 to P6, as the
//! README defines them) and its other promises.
//! Each test is built so that it fails when the rule it names is broken.

use kvbm_core::layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_core::link::{HostTier, TierLink};
use kvbm_core::offload::{
    BlockInfo, BoxFuture, EnqueueError, EnqueueRequest, FrequencyPolicy, OffloadPipeline,
    OffloadPolicy, PipelineConfig, PipelineObserver, PresencePolicy, SkipReason, SourceBlock,
    TransferHandle, TransferStatus, Verdict, precondition,
};
use kvbm_core::storage::HostStorage;
use kvbm_core::transfer::{
    BlockPair, EngineCounters, Hold, MemcpyEngine, Rejected, TransferEngine, TransferStats,
    TransferTicket,
};
use kvbm_core::{BlockPool, ImmutableBlock, PoolConfig, SaltHash, Tier, TokenSequence};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const BS: usize = 4;
const BLOCK_BYTES: usize = 2 * 2 * BS * 8; // layers × K/V × tokens × inner(8) × 1 byte

fn layout(n: usize) -> Layout {
    Layout::new(
        LayoutConfig {
            num_blocks: n,
            num_layers: 2,
            outer_dim: 2,
            page_size: BS,
            inner_dim: 8,
            dtype_bytes: 1,
        },
        LayoutKind::FullyContiguous,
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

/// An engine whose copies wait for a gate: lets a test hold a transfer in
/// flight for as long as it needs. Copies no bytes; counts what it "moved".
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
    started: AtomicU64,
    blocks: AtomicU64,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }
    async fn wait_started(&self, n: u64) {
        let t = Instant::now();
        while self.started.load(Ordering::SeqCst) < n {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "transfer never started"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

struct GatedEngine {
    gate: Arc<Gate>,
    blocks: usize,
}

impl TransferEngine for GatedEngine {
    fn name(&self) -> &'static str {
        "gated"
    }
    fn source_tier(&self) -> Tier {
        Tier::Device
    }
    fn destination_tier(&self) -> Tier {
        Tier::Host
    }
    fn counters(&self) -> EngineCounters {
        EngineCounters {
            blocks: self.gate.blocks.load(Ordering::SeqCst),
            ..Default::default()
        }
    }
    fn source_num_blocks(&self) -> usize {
        self.blocks
    }
    fn destination_num_blocks(&self) -> usize {
        self.blocks
    }
    unsafe fn submit_holding(
        &self,
        pairs: Vec<BlockPair>,
        hold: Option<Hold>,
    ) -> Result<TransferTicket, Rejected> {
        let (done, ticket) = TransferTicket::pending("gated");
        let gate = self.gate.clone();
        gate.started.fetch_add(1, Ordering::SeqCst);
        std::thread::spawn(move || {
            let mut open = gate.open.lock().unwrap();
            while !*open {
                open = gate.cv.wait(open).unwrap();
            }
            drop(open);
            gate.blocks.fetch_add(pairs.len() as u64, Ordering::SeqCst);
            let stats = TransferStats {
                blocks: pairs.len(),
                bytes: 0,
                elapsed: Duration::ZERO,
            };
            done.complete(Ok(stats), hold);
        });
        Ok(ticket)
    }
}

struct Rig {
    g1: BlockPool,
    g2: BlockPool,
    /// Keeps the storages bound for the rig's lifetime.
    _tiers: Option<(HostTier, HostTier)>,
    link: TierLink,
    gate: Arc<Gate>,
}

/// G1 → G2 over a gated engine (no bytes) or a real memcpy engine.
fn rig(c1: usize, c2: usize, gated: bool) -> Rig {
    let (g1, g2) = (pool(Tier::Device, c1), pool(Tier::Host, c2));
    let gate = Arc::new(Gate::default());
    if gated {
        let e: Arc<dyn TransferEngine> = Arc::new(GatedEngine {
            gate: gate.clone(),
            blocks: c1.max(c2),
        });
        // SAFETY: the gated engine touches no memory.
        let link = unsafe { TierLink::new(e, g1.clone(), g2.clone()) }.unwrap();
        return Rig {
            g1,
            g2,
            _tiers: None,
            link,
            gate,
        };
    }
    let s1 = Arc::new(HostStorage::new(layout(c1)).unwrap());
    let s2 = Arc::new(HostStorage::new(layout(c2)).unwrap());
    let e: Arc<dyn TransferEngine> =
        Arc::new(MemcpyEngine::new(s1.clone(), Tier::Device, s2.clone(), Tier::Host).unwrap());
    // SAFETY: each storage belongs to exactly one pool, used only here.
    unsafe {
        Rig {
            link: TierLink::new(e, g1.clone(), g2.clone()).unwrap(),
            _tiers: Some((
                HostTier::bind(g1.clone(), s1).unwrap(),
                HostTier::bind(g2.clone(), s2).unwrap(),
            )),
            g1,
            g2,
            gate,
        }
    }
}

fn config() -> PipelineConfig {
    PipelineConfig::default()
}

/// Registers `n` full blocks on `pool`, distinct per `seed`.
fn blocks(pool: &BlockPool, n: usize, seed: u32) -> Vec<ImmutableBlock> {
    let toks: Vec<u32> = (0..(n * BS) as u32).map(|t| t + seed * 100_000).collect();
    let seq = TokenSequence::from_tokens(&toks, BS, SaltHash(seed as u64)).unwrap();
    pool.allocate(n)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.fill_from(tb).unwrap().register())
        .collect()
}

fn strong(b: &[ImmutableBlock]) -> Vec<SourceBlock> {
    b.iter().cloned().map(SourceBlock::Strong).collect()
}

async fn wait_status(h: &TransferHandle, want: impl Fn(&TransferStatus) -> bool) {
    let t = Instant::now();
    while !want(&h.status()) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "stuck at {:?}",
            h.status()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn cancel_within(h: &TransferHandle, secs: u64) -> TransferStatus {
    tokio::time::timeout(Duration::from_secs(secs), h.cancel())
        .await
        .expect("cancel never returned")
}

async fn final_within(h: &TransferHandle, secs: u64) -> TransferStatus {
    tokio::time::timeout(Duration::from_secs(secs), h.wait())
        .await
        .expect("handle never reached a final status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p1_p4_cancel_before_upgrade_releases_every_block_and_moves_no_byte() {
    let r = rig(64, 64, true);
    let p = OffloadPipeline::new(r.link.clone(), vec![], config()).unwrap();
    // A is transferring (held at the gate), B is upgraded on deck; C waits
    // in the in-queue, not upgraded.
    let a = p.offload(&blocks(&r.g1, 8, 1), None).unwrap();
    r.gate.wait_started(1).await;
    let b_blocks = blocks(&r.g1, 8, 2);
    let b = p.offload(&b_blocks, None).unwrap();
    wait_status(&b, |s| *s == TransferStatus::Transferring).await;
    let c_blocks = blocks(&r.g1, 8, 3);
    let c = p
        .enqueue(EnqueueRequest {
            blocks: strong(&c_blocks),
            ..Default::default()
        })
        .unwrap();
    wait_status(&c, |s| *s == TransferStatus::Batched).await;
    // Batched is set before the batcher hands C on to the in-queue.
    let t = Instant::now();
    while p.stats().in_queue != 1 {
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", p.stats());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let hashes: Vec<_> = c_blocks.iter().map(|b| b.sequence_hash()).collect();
    drop(c_blocks);
    // The pipeline holds C's blocks strongly: they are still active.
    assert_eq!(r.g1.status().active, 24);

    // P1: the whole container goes; the final status promises release.
    assert_eq!(cancel_within(&c, 5).await, TransferStatus::Cancelled);
    assert_eq!(r.g1.status().active, 16, "C's blocks were not released");
    r.gate.open();
    assert!(matches!(
        final_within(&a, 5).await,
        TransferStatus::Completed { blocks: 8, .. }
    ));
    assert!(matches!(
        final_within(&b, 5).await,
        TransferStatus::Completed { blocks: 8, .. }
    ));
    tokio::time::sleep(Duration::from_millis(50)).await;
    // No byte of C moved: the engine saw A and B only, G2 holds none of C.
    assert_eq!(r.gate.blocks.load(Ordering::SeqCst), 16);
    assert!(r.g2.match_prefix(&hashes).is_empty());
    assert_eq!(p.stats().cancelled, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p3_cancel_after_upgrade_does_not_stop_the_transfer() {
    let r = rig(16, 16, true);
    let p = OffloadPipeline::new(r.link.clone(), vec![], config()).unwrap();
    let src = blocks(&r.g1, 8, 1);
    let h = p.offload(&src, None).unwrap();
    r.gate.wait_started(1).await;
    assert_eq!(h.status(), TransferStatus::Transferring);
    let h2 = h.clone();
    let canceller = tokio::spawn(async move { h2.cancel().await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Still transferring: the cancel waits for the blocks to be released.
    assert_eq!(h.status(), TransferStatus::Transferring);
    assert!(!canceller.is_finished());
    r.gate.open();
    let fin = tokio::time::timeout(Duration::from_secs(5), canceller)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        fin,
        TransferStatus::Completed {
            blocks: 8,
            filtered: 0,
            gone: 0
        }
    );
    let hashes: Vec<_> = src.iter().map(|b| b.sequence_hash()).collect();
    assert_eq!(r.g2.match_prefix(&hashes).len(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p6_cancel_while_awaiting_precondition_drops_the_container_at_once() {
    let r = rig(16, 16, true);
    let mut cfg = config();
    // The sweeper cannot be what releases it.
    cfg.sweep_interval = Duration::from_secs(3600);
    let p = OffloadPipeline::new(r.link.clone(), vec![], cfg).unwrap();
    let (_trigger, pre) = precondition();
    let src = blocks(&r.g1, 4, 1);
    let h = p
        .enqueue(EnqueueRequest {
            blocks: strong(&src),
            precondition: Some(pre),
            ..Default::default()
        })
        .unwrap();
    wait_status(&h, |s| *s == TransferStatus::AwaitingPrecondition).await;
    drop(src);
    assert_eq!(r.g1.status().active, 4);
    let t = Instant::now();
    assert_eq!(cancel_within(&h, 2).await, TransferStatus::Cancelled);
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(r.g1.status().active, 0, "blocks not released on cancel");
    assert_eq!(r.gate.started.load(Ordering::SeqCst), 0);
    assert_eq!(p.stats().awaiting_precondition, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precondition_gates_the_transfer_and_abandonment_skips() {
    let r = rig(16, 16, false);
    let p = OffloadPipeline::new(r.link.clone(), vec![], config()).unwrap();
    let (trigger, pre) = precondition();
    let src = blocks(&r.g1, 8, 1);
    let h = p.offload(&src, Some(pre)).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.status(), TransferStatus::AwaitingPrecondition);
    trigger.trigger();
    assert!(matches!(
        final_within(&h, 5).await,
        TransferStatus::Completed { blocks: 8, .. }
    ));
    let (trigger, pre) = precondition();
    let h = p.offload(&blocks(&r.g1, 2, 2), Some(pre)).unwrap();
    drop(trigger);
    assert_eq!(
        final_within(&h, 5).await,
        TransferStatus::Skipped(SkipReason::PreconditionAbandoned)
    );
}

/// Records when each container's batch was dispatched.
#[derive(Default)]
struct Dispatches(Mutex<Vec<(Instant, Vec<u64>, usize)>>);
impl PipelineObserver for Dispatches {
    fn on_batch_dispatched(&self, _batch: u64, containers: &[u64], blocks: usize) {
        self.0
            .lock()
            .unwrap()
            .push((Instant::now(), containers.to_vec(), blocks));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_batch_flushes_after_flush_interval_and_a_full_one_at_once() {
    let r = rig(32, 32, false);
    let obs = Arc::new(Dispatches::default());
    let mut cfg = config();
    cfg.batch_config.flush_interval = Duration::from_millis(200);
    let p = OffloadPipeline::with_observer(r.link.clone(), vec![], cfg, Some(obs.clone())).unwrap();
    let t0 = Instant::now();
    let h = p.offload(&blocks(&r.g1, 2, 1), None).unwrap();
    assert!(matches!(
        final_within(&h, 5).await,
        TransferStatus::Completed { blocks: 2, .. }
    ));
    let (at, _, n) = obs.0.lock().unwrap()[0].clone();
    assert_eq!(n, 2);
    assert!(
        at.duration_since(t0) >= Duration::from_millis(200),
        "partial batch left after {:?}, before flush_interval",
        at.duration_since(t0)
    );

    // With a long interval, reaching min_batch_size is what sends a batch.
    let mut cfg = config();
    cfg.batch_config.flush_interval = Duration::from_secs(3600);
    let p2 = OffloadPipeline::new(r.link.clone(), vec![], cfg).unwrap();
    let h = p2.offload(&blocks(&r.g1, 8, 2), None).unwrap();
    assert!(matches!(
        final_within(&h, 5).await,
        TransferStatus::Completed { blocks: 8, .. }
    ));
    // And a batch never exceeds max_batch_size (containers are not split).
    drop((p, p2));
    let mut cfg = config();
    cfg.batch_config.min_batch_size = 6;
    cfg.batch_config.max_batch_size = 6;
    let obs = Arc::new(Dispatches::default());
    let p3 =
        OffloadPipeline::with_observer(r.link.clone(), vec![], cfg, Some(obs.clone())).unwrap();
    let hs: Vec<_> = (0..4)
        .map(|i| p3.offload(&blocks(&r.g1, 4, 10 + i), None).unwrap())
        .collect();
    for h in &hs {
        assert!(matches!(
            final_within(h, 5).await,
            TransferStatus::Completed { blocks: 4, .. }
        ));
    }
    assert!(
        obs.0
            .lock()
            .unwrap()
            .iter()
            .all(|(_, c, n)| c.len() == 1 && *n == 4)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_weak_references_are_discarded_and_counted() {
    let r = rig(8, 16, false);
    let p = OffloadPipeline::new(r.link.clone(), vec![], config()).unwrap();
    let (trigger, pre) = precondition();
    let src = blocks(&r.g1, 4, 1);
    let h = p.offload(&src, Some(pre)).unwrap();
    wait_status(&h, |s| *s == TransferStatus::AwaitingPrecondition).await;
    // The request finishes and G1 reuses all its blocks: the weak
    // references die before the upgrade.
    drop(src);
    let hog = r.g1.allocate(8).unwrap();
    trigger.trigger();
    assert_eq!(
        final_within(&h, 5).await,
        TransferStatus::Skipped(SkipReason::SourceGone)
    );
    assert_eq!(p.stats().gone_blocks, 4);
    drop(hog);

    // Half dead: the living half still goes, and the rest is counted.
    let (trigger, pre) = precondition();
    let src = blocks(&r.g1, 4, 2);
    let h = p.offload(&src, Some(pre)).unwrap();
    wait_status(&h, |s| *s == TransferStatus::AwaitingPrecondition).await;
    let (keep, lose) = src.split_at(2);
    let keep = keep.to_vec();
    drop(lose.to_vec());
    drop(src);
    let hog = r.g1.allocate(6).unwrap(); // 4 empty + the 2 inactive
    trigger.trigger();
    assert_eq!(
        final_within(&h, 5).await,
        TransferStatus::Completed {
            blocks: 2,
            filtered: 0,
            gone: 2
        }
    );
    assert_eq!(p.stats().gone_blocks, 6);
    drop((hog, keep));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containers_in_one_batch_are_cancelled_independently() {
    let r = rig(64, 64, true);
    let obs = Arc::new(Dispatches::default());
    let mut cfg = config();
    cfg.batch_config.flush_interval = Duration::from_millis(30);
    let p = OffloadPipeline::with_observer(r.link.clone(), vec![], cfg, Some(obs.clone())).unwrap();
    let a = p.offload(&blocks(&r.g1, 8, 1), None).unwrap();
    r.gate.wait_started(1).await;
    let b = p.offload(&blocks(&r.g1, 8, 2), None).unwrap();
    wait_status(&b, |s| *s == TransferStatus::Transferring).await;
    // C1 and C2 (3 blocks each) share one partial batch in the in-queue.
    let (c1_blocks, c2_blocks) = (blocks(&r.g1, 3, 3), blocks(&r.g1, 3, 4));
    let c1 = p.offload(&c1_blocks, None).unwrap();
    let c2 = p.offload(&c2_blocks, None).unwrap();
    let t = Instant::now();
    while p.stats().in_queue != 1 {
        assert!(t.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(
        (c1.status(), c2.status()),
        (TransferStatus::Batched, TransferStatus::Batched)
    );
    assert_eq!(c1.cancel().await, TransferStatus::Cancelled);
    assert_eq!(
        c2.status(),
        TransferStatus::Batched,
        "cancelling C1 touched C2"
    );
    r.gate.open();
    for h in [&a, &b] {
        assert!(matches!(
            final_within(h, 5).await,
            TransferStatus::Completed { blocks: 8, .. }
        ));
    }
    assert_eq!(
        final_within(&c2, 5).await,
        TransferStatus::Completed {
            blocks: 3,
            filtered: 0,
            gone: 0
        }
    );
    let h1: Vec<_> = c1_blocks.iter().map(|b| b.sequence_hash()).collect();
    let h2: Vec<_> = c2_blocks.iter().map(|b| b.sequence_hash()).collect();
    assert!(r.g2.match_prefix(&h1).is_empty());
    assert_eq!(r.g2.match_prefix(&h2).len(), 3);
    let last = obs.0.lock().unwrap().last().cloned().unwrap();
    assert_eq!((last.1, last.2), (vec![c2.id()], 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destination_full_evicts_inactive_then_skips_with_a_counted_reason() {
    let r = rig(16, 4, false);
    let p = OffloadPipeline::new(r.link.clone(), vec![], config()).unwrap();
    // G2 full of cold (inactive) blocks: they are evicted to make room.
    drop(blocks(&r.g2, 4, 9));
    let h = p.offload(&blocks(&r.g1, 2, 1), None).unwrap();
    assert!(matches!(
        final_within(&h, 5).await,
        TransferStatus::Completed { blocks: 2, .. }
    ));
    assert_eq!(r.g2.status().counters.evictions, 2);
    // G2 full of blocks in use: skipped, with the numbers, and counted.
    let held = r.g2.allocate(4).unwrap();
    let h = p.offload(&blocks(&r.g1, 2, 2), None).unwrap();
    assert_eq!(
        final_within(&h, 5).await,
        TransferStatus::Skipped(SkipReason::DestinationFull {
            requested: 2,
            available: 0
        })
    );
    assert_eq!(p.stats().skipped("destination_full"), 1);
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_and_frequency_policies_filter_blocks() {
    let r = rig(32, 32, false);
    let freq = Arc::new(FrequencyPolicy::new(2, Duration::from_secs(60), 1024));
    let p = OffloadPipeline::new(
        r.link.clone(),
        vec![Arc::new(PresencePolicy), freq.clone()],
        config(),
    )
    .unwrap();
    let src = blocks(&r.g1, 4, 1);
    // First sighting: below frequency.
    let h = p.offload(&src, None).unwrap();
    assert_eq!(
        final_within(&h, 5).await,
        TransferStatus::Skipped(SkipReason::BelowFrequency)
    );
    // Second: admitted and moved.
    let h = p.offload(&src, None).unwrap();
    assert!(matches!(
        final_within(&h, 5).await,
        TransferStatus::Completed { blocks: 4, .. }
    ));
    // Now present: skipped by presence, even though frequent.
    let h = p.offload(&src, None).unwrap();
    assert_eq!(
        final_within(&h, 5).await,
        TransferStatus::Skipped(SkipReason::AlreadyPresent)
    );
    // Mixed: two present, two new-but-frequent.
    let more = blocks(&r.g1, 2, 2);
    for b in &more {
        freq.record(b.sequence_hash());
    }
    let mixed: Vec<_> = src[..2].iter().chain(&more).cloned().collect();
    let h = p.offload(&mixed, None).unwrap();
    assert_eq!(
        final_within(&h, 5).await,
        TransferStatus::Completed {
            blocks: 2,
            filtered: 2,
            gone: 0
        }
    );
    assert_eq!(p.stats().skipped("below_frequency"), 1);
}

struct Slow;
impl OffloadPolicy for Slow {
    fn name(&self) -> &'static str {
        "slow"
    }
    fn evaluate<'a>(
        &'a self,
        blocks: &'a [BlockInfo],
        _: &'a BlockPool,
    ) -> BoxFuture<'a, Vec<Verdict>> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            vec![Verdict::Admit; blocks.len()]
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_policies_time_out_and_a_full_queue_refuses_without_losing_anything() {
    let r = rig(16, 16, false);
    let mut cfg = config();
    cfg.policy_timeout = Duration::from_millis(50);
    cfg.queue_capacity = 1;
    let p = OffloadPipeline::new(r.link.clone(), vec![Arc::new(Slow)], cfg).unwrap();
    let src = blocks(&r.g1, 3, 1);
    let h1 = p.offload(&src[..1], None).unwrap();
    wait_status(&h1, |s| *s == TransferStatus::Evaluating).await;
    let _h2 = p.offload(&src[1..2], None).unwrap(); // fills the queue
    let refused = p
        .enqueue(EnqueueRequest {
            blocks: strong(&src[2..]),
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(refused.error, EnqueueError::QueueFull { capacity: 1 });
    assert_eq!(
        refused.request.blocks.len(),
        1,
        "the request comes back whole"
    );
    assert_eq!(p.stats().rejected_queue_full, 1);
    assert_eq!(
        final_within(&h1, 5).await,
        TransferStatus::Skipped(SkipReason::PolicyTimeout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onboarding_fills_the_given_destinations_and_registers_them() {
    // G2 → G1 with real bytes: the destinations are the scheduler's blocks.
    let (g2, g1) = (pool(Tier::Host, 8), pool(Tier::Device, 8));
    let (s2, s1) = (
        Arc::new(HostStorage::new(layout(8)).unwrap()),
        Arc::new(HostStorage::new(layout(8)).unwrap()),
    );
    let e: Arc<dyn TransferEngine> =
        Arc::new(MemcpyEngine::new(s2.clone(), Tier::Host, s1.clone(), Tier::Device).unwrap());
    // SAFETY: each storage belongs to one pool, used only here.
    let (link, t2, t1) = unsafe {
        (
            TierLink::new(e, g2.clone(), g1.clone()).unwrap(),
            HostTier::bind(g2.clone(), s2).unwrap(),
            HostTier::bind(g1.clone(), s1).unwrap(),
        )
    };
    // Put recognisable bytes on G2.
    let toks: Vec<u32> = (0..(3 * BS) as u32).collect();
    let seq = TokenSequence::from_tokens(&toks, BS, SaltHash(5)).unwrap();
    let on_g2: Vec<ImmutableBlock> = g2
        .allocate(3)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .enumerate()
        .map(|(i, (mut b, tb))| {
            t2.write(&mut b, &[i as u8 + 1; BLOCK_BYTES]).unwrap();
            b.fill_from(tb).unwrap().register()
        })
        .collect();
    let p = OffloadPipeline::new(link, vec![], config()).unwrap();
    let matched = g2.match_prefix(&seq.sequence_hashes());
    let dests = g1.allocate(3).unwrap();
    let h = p.onboard(matched, dests, 1).unwrap();
    assert!(matches!(
        final_within(&h, 5).await,
        TransferStatus::Completed { blocks: 3, .. }
    ));
    let got = h.take_blocks().expect("onboarded blocks");
    assert_eq!(
        got.iter().map(|b| b.sequence_hash()).collect::<Vec<_>>(),
        seq.sequence_hashes()
    );
    let mut buf = vec![0u8; BLOCK_BYTES];
    for (i, b) in got.iter().enumerate() {
        t1.read(b, &mut buf).unwrap();
        assert!(
            buf.iter().all(|&x| x == i as u8 + 1),
            "block {i} bytes wrong"
        );
    }
    assert_eq!(g1.match_prefix(&seq.sequence_hashes()).len(), 3);
    drop(on_g2);

    // Wrong destination count or pool: refused, blocks handed back.
    let refused = p
        .onboard(
            g2.match_prefix(&seq.sequence_hashes()),
            g1.allocate(1).unwrap(),
            0,
        )
        .unwrap_err();
    assert!(matches!(
        refused.error,
        EnqueueError::DestinationCount { .. }
    ));
    let refused = p
        .onboard(
            g2.match_prefix(&seq.sequence_hashes()[..1]),
            g2.allocate(1).unwrap(),
            0,
        )
        .unwrap_err();
    assert!(matches!(
        refused.error,
        EnqueueError::ForeignDestination { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_every_handle() {
    let r = rig(16, 16, true);
    let p = OffloadPipeline::new(r.link.clone(), vec![], config()).unwrap();
    let a = p.offload(&blocks(&r.g1, 8, 1), None).unwrap();
    r.gate.wait_started(1).await;
    let (_t, pre) = precondition();
    let b = p.offload(&blocks(&r.g1, 2, 2), Some(pre)).unwrap();
    wait_status(&b, |s| *s == TransferStatus::AwaitingPrecondition).await;
    let c = p.offload(&blocks(&r.g1, 2, 3), None).unwrap();
    r.gate.open();
    p.shutdown().await;
    for h in [&a, &b, &c] {
        assert!(final_within(h, 5).await.is_final());
    }
    assert!(matches!(a.status(), TransferStatus::Completed { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_the_executor_sweeps_cancelled_containers_immediately_before_upgrade() {
    let r = rig(64, 64, true);
    let mut cfg = config();
    // No sweeper: only the executor's own check can catch the cancel.
    cfg.sweep_interval = Duration::from_secs(3600);
    let p = OffloadPipeline::new(r.link.clone(), vec![], cfg).unwrap();
    let a = p.offload(&blocks(&r.g1, 8, 1), None).unwrap();
    r.gate.wait_started(1).await;
    let b = p.offload(&blocks(&r.g1, 8, 2), None).unwrap();
    wait_status(&b, |s| *s == TransferStatus::Transferring).await;
    let c_blocks = blocks(&r.g1, 8, 3);
    let c = p.offload(&c_blocks, None).unwrap();
    wait_status(&c, |s| *s == TransferStatus::Batched).await;
    // Request the cancel while C sits in the in-queue, then let the
    // executor reach it.
    let c2 = c.clone();
    let cancelling = tokio::spawn(async move { c2.cancel().await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        c.status(),
        TransferStatus::Batched,
        "nothing else may catch it"
    );
    r.gate.open();
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), cancelling)
            .await
            .unwrap()
            .unwrap(),
        TransferStatus::Cancelled
    );
    for h in [&a, &b] {
        assert!(matches!(
            final_within(h, 5).await,
            TransferStatus::Completed { .. }
        ));
    }
    assert_eq!(
        r.gate.started.load(Ordering::SeqCst),
        2,
        "C was transferred"
    );
    let hashes: Vec<_> = c_blocks.iter().map(|b| b.sequence_hash()).collect();
    assert!(r.g2.match_prefix(&hashes).is_empty());
    assert_eq!(p.stats().swept, 0);
}

/// A policy that holds every container until opened, then admits all.
#[derive(Default)]
struct HeldPolicy {
    open: tokio::sync::Notify,
    opened: std::sync::atomic::AtomicBool,
}

impl HeldPolicy {
    fn open(&self) {
        self.opened.store(true, Ordering::SeqCst);
        self.open.notify_waiters();
    }
}

impl OffloadPolicy for HeldPolicy {
    fn name(&self) -> &'static str {
        "held"
    }
    fn evaluate<'a>(
        &'a self,
        blocks: &'a [BlockInfo],
        _: &'a BlockPool,
    ) -> BoxFuture<'a, Vec<Verdict>> {
        Box::pin(async move {
            loop {
                let notified = self.open.notified();
                if self.opened.load(Ordering::SeqCst) {
                    break;
                }
                notified.await;
            }
            vec![Verdict::Admit; blocks.len()]
        })
    }
}

/// P2: the container carries a token cloned from its handle. A cancel
/// requested through a *clone* of a handle, at a moment when no stage is
/// looking at the container, is carried by the container into whichever
/// stage takes it next, and that stage drops it: here the policy stage
/// (taking it from its queue), the batcher (flushing) and the executor
/// (upgrading). The sweeper is off, so only the container's own token can
/// tell a stage. The other containers, whose handles were not cancelled,
/// complete. If the container had a token of its own (not the handle's),
/// the three cancelled containers would be copied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p2_the_token_cloned_from_the_handle_travels_with_the_container() {
    let r = rig(64, 64, true);
    let mut cfg = config();
    cfg.sweep_interval = Duration::from_secs(3600);
    cfg.policy_timeout = Duration::from_secs(3600);
    cfg.batch_config.flush_interval = Duration::from_secs(3600);
    let policy = Arc::new(HeldPolicy::default());
    let p = OffloadPipeline::new(r.link.clone(), vec![policy.clone()], cfg).unwrap();
    /// Requests the cancel through a clone of `h`; the clone's `cancel`
    /// resolves when the container's final status arrives.
    fn cancel_through_a_clone(h: &TransferHandle) -> tokio::task::JoinHandle<TransferStatus> {
        let clone = h.clone();
        tokio::spawn(async move { clone.cancel().await })
    }

    // 1. The policy stage holds G; F waits in the stage's queue.
    let g_blocks = blocks(&r.g1, 8, 1);
    let g = p.offload(&g_blocks, None).unwrap();
    wait_status(&g, |s| *s == TransferStatus::Evaluating).await;
    let f_blocks = blocks(&r.g1, 8, 2);
    let f = p.offload(&f_blocks, None).unwrap();
    let cancel_f = cancel_through_a_clone(&f);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(f.is_cancel_requested() && !g.is_cancel_requested());
    assert_eq!(f.status(), TransferStatus::Queued, "nothing took F yet");
    policy.open();
    // G passes and is transferred (held at the engine's gate); F is
    // dropped when the policy stage takes it.
    r.gate.wait_started(1).await;
    assert_eq!(final_within(&f, 5).await, TransferStatus::Cancelled);

    // 2. B goes on deck, C waits in the in-queue, D alone in the batcher
    //    (4 blocks: under the batch minimum, and the flush interval is an
    //    hour).
    let b_blocks = blocks(&r.g1, 8, 3);
    let b = p.offload(&b_blocks, None).unwrap();
    wait_status(&b, |s| *s == TransferStatus::Transferring).await;
    let c_blocks = blocks(&r.g1, 8, 4);
    let c = p.offload(&c_blocks, None).unwrap();
    wait_status(&c, |s| *s == TransferStatus::Batched).await;
    let d_blocks = blocks(&r.g1, 4, 5);
    let d = p.offload(&d_blocks, None).unwrap();
    wait_status(&d, |s| *s == TransferStatus::Batched).await;
    let (cancel_c, cancel_d) = (cancel_through_a_clone(&c), cancel_through_a_clone(&d));
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        (c.status(), d.status()),
        (TransferStatus::Batched, TransferStatus::Batched),
        "nothing took C or D yet"
    );
    // E fills D's batch: the batcher flushes it and drops D on the way.
    let e_blocks = blocks(&r.g1, 4, 6);
    let e = p.offload(&e_blocks, None).unwrap();
    assert_eq!(final_within(&d, 5).await, TransferStatus::Cancelled);
    assert_eq!(c.status(), TransferStatus::Batched);
    // The engine finishes G; the executor drops C when it reaches it.
    r.gate.open();
    for (h, blocks) in [(&g, 8), (&b, 8), (&e, 4)] {
        assert_eq!(
            final_within(h, 5).await,
            TransferStatus::Completed {
                blocks,
                filtered: 0,
                gone: 0
            }
        );
    }
    assert_eq!(final_within(&c, 5).await, TransferStatus::Cancelled);
    for (what, t) in [("F", cancel_f), ("C", cancel_c), ("D", cancel_d)] {
        let through_the_clone = tokio::time::timeout(Duration::from_secs(5), t)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(through_the_clone, TransferStatus::Cancelled, "{what}");
    }
    // Not a byte of F, C or D moved: the engine saw G, B and E only.
    assert_eq!(r.gate.blocks.load(Ordering::SeqCst), 8 + 8 + 4);
    for cancelled in [&f_blocks, &c_blocks, &d_blocks] {
        let hashes: Vec<_> = cancelled.iter().map(|b| b.sequence_hash()).collect();
        assert!(r.g2.match_prefix(&hashes).is_empty());
    }
    let s = p.stats();
    assert_eq!((s.cancelled, s.swept), (3, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p5_a_batch_of_several_containers_is_one_flat_transfer() {
    let r = rig(64, 64, true);
    let obs = Arc::new(Dispatches::default());
    let mut cfg = config();
    cfg.batch_config.flush_interval = Duration::from_millis(100);
    let p = OffloadPipeline::with_observer(r.link.clone(), vec![], cfg, Some(obs.clone())).unwrap();
    let hs: Vec<_> = (0..3)
        .map(|i| p.offload(&blocks(&r.g1, 2, i + 1), None).unwrap())
        .collect();
    r.gate.wait_started(1).await;
    r.gate.open();
    for h in &hs {
        assert!(matches!(
            final_within(h, 5).await,
            TransferStatus::Completed { blocks: 2, .. }
        ));
    }
    // One engine submission carried all six blocks of the three containers.
    assert_eq!(r.gate.started.load(Ordering::SeqCst), 1);
    assert_eq!(r.gate.blocks.load(Ordering::SeqCst), 6);
    let d = obs.0.lock().unwrap().clone();
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].1.len(), d[0].2), (3, 6));
}

/// Thousands of containers, random sizes, random precondition delays,
/// random cancels, a destination that fills up: every handle ends in a
/// final status, the counters add up, and no block leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_every_handle_finishes_and_no_block_leaks() {
    let r = rig(512, 96, false);
    let mut cfg = config();
    cfg.max_concurrent_transfers = 2;
    cfg.batch_config.flush_interval = Duration::from_millis(2);
    let p = Arc::new(
        OffloadPipeline::new(r.link.clone(), vec![Arc::new(PresencePolicy)], cfg).unwrap(),
    );
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    const N: usize = 3000;
    let mut handles = Vec::with_capacity(N);
    let mut refused = 0;
    let mut triggers = Vec::new();
    for i in 0..N {
        let n = 1 + (next() % 6) as usize;
        // Sources cycle through a bounded working set; G1 evicts as it goes,
        // so some weak references die.
        // G1 may be full of blocks the pipeline holds strongly; wait for
        // room like an engine would.
        let seed = (next() % 400) as u32 + 1;
        let t = Instant::now();
        while r.g1.status().empty + r.g1.status().inactive < n {
            assert!(t.elapsed() < Duration::from_secs(30), "G1 never freed up");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let src = blocks(&r.g1, n, seed);
        let pre = match next() % 3 {
            0 => None,
            _ => {
                let (t, pre) = precondition();
                let delay = Duration::from_micros(next() % 5000);
                let drop_it = next() % 50 == 0;
                triggers.push(tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    if !drop_it {
                        t.trigger();
                    }
                }));
                Some(pre)
            }
        };
        let weak = next() % 4 != 0;
        let req = EnqueueRequest {
            blocks: if weak {
                src.iter()
                    .map(|b| SourceBlock::Weak(b.downgrade()))
                    .collect()
            } else {
                strong(&src)
            },
            destinations: None,
            precondition: pre,
            priority: (next() % 3) as u32,
        };
        drop(src);
        match p.enqueue(req) {
            Ok(h) => {
                if next() % 5 == 0 {
                    let h2 = h.clone();
                    let delay = Duration::from_micros(next() % 3000);
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        h2.cancel().await
                    });
                }
                handles.push(h);
            }
            Err(e) => {
                assert!(matches!(e.error, EnqueueError::QueueFull { .. }));
                refused += 1;
            }
        }
        if i % 64 == 0 {
            tokio::task::yield_now().await;
        }
    }
    for t in triggers {
        t.await.unwrap();
    }
    let mut finals = std::collections::BTreeMap::new();
    for h in &handles {
        let s = final_within(h, 30).await;
        let key = match s {
            TransferStatus::Completed { .. } => "completed".to_string(),
            TransferStatus::Cancelled => "cancelled".into(),
            TransferStatus::Skipped(r) => format!("skipped:{}", r.name()),
            TransferStatus::Failed(e) => panic!("no transfer should fail here: {e}"),
            other => panic!("not final: {other:?}"),
        };
        *finals.entry(key).or_insert(0u64) += 1;
    }
    let st = p.stats();
    let skipped: u64 = st.skipped.iter().map(|(_, v)| v).sum();
    assert_eq!(st.enqueued, handles.len() as u64);
    assert_eq!(st.rejected_queue_full, refused);
    assert_eq!(
        st.enqueued,
        st.completed + st.cancelled + skipped + st.failed,
        "{st:?}"
    );
    assert!(
        finals.get("completed").copied().unwrap_or(0) > 0,
        "{finals:?}"
    );
    assert!(
        finals.get("cancelled").copied().unwrap_or(0) > 0,
        "{finals:?}"
    );
    eprintln!("stress outcome: {finals:?}; gone blocks {}", st.gone_blocks);
    // No leaks: with the pipeline gone and no handles held, nothing is
    // active on either tier.
    drop(handles);
    match Arc::try_unwrap(p) {
        Ok(p) => p.shutdown().await,
        Err(_) => panic!("the test holds the only pipeline handle"),
    }
    let (s1, s2) = (r.g1.status(), r.g2.status());
    assert_eq!(s1.active, 0, "G1 leaked: {s1:?}");
    assert_eq!(s2.active, 0, "G2 leaked: {s2:?}");
    assert_eq!(s1.active + s1.inactive + s1.empty, s1.capacity);
}
