//! Offload pipeline throughput, beside the raw engine in the same run.
//!
//! Run: `cargo bench -p kvbm-core --bench offload` (`KVBM_BENCH_QUICK=1`
//! for a short run). Two workloads:
//!
//! - 2 MiB blocks: G1 → G2 through the whole pipeline (default settings:
//!   batches of 8..64 blocks, one transfer at a time), against the same
//!   blocks copied by the raw memcpy engine through a `TierLink` in batches
//!   of 8 (what the pipeline's batches hold here);
//! - 1-byte blocks: the same, so the copy costs nothing and what is left is
//!   the pipeline's own overhead per block (policy stage, queues, batching,
//!   upgrade, destination allocation and registration, status updates).
//!   With the default settings a batch is 8 blocks and one transfer runs at a
//!   time, so tiny blocks are bound by the round trip to the engine's
//!   worker thread; a second row uses batches of 64 and 4 transfers.

use kvbm_core::layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_core::link::TierLink;
use kvbm_core::offload::{OffloadPipeline, PipelineConfig, TransferStatus};
use kvbm_core::storage::HostStorage;
use kvbm_core::transfer::{MemcpyEngine, TransferEngine};
use kvbm_core::{BlockPool, ImmutableBlock, PoolConfig, SaltHash, Tier, TokenSequence};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_testkit::bench as common;

const BS: usize = 16;

struct Setup {
    g1: BlockPool,
    g2: BlockPool,
    link: TierLink,
    block_bytes: usize,
}

fn setup(blocks: usize, big: bool) -> Setup {
    let cfg = if big {
        // 2 layers × K/V × 16 tokens × 16384 × 2 bytes = 2 MiB.
        LayoutConfig {
            num_blocks: blocks,
            num_layers: 2,
            outer_dim: 2,
            page_size: BS,
            inner_dim: 16384,
            dtype_bytes: 2,
        }
    } else {
        LayoutConfig {
            num_blocks: blocks,
            num_layers: 1,
            outer_dim: 1,
            page_size: 1,
            inner_dim: 1,
            dtype_bytes: 1,
        }
    };
    let layout = Layout::new(cfg, LayoutKind::FullyContiguous).unwrap();
    let block_bytes = layout.block_bytes();
    let s1 = Arc::new(HostStorage::new(layout).unwrap());
    let s2 = Arc::new(HostStorage::new(layout).unwrap());
    let pool = |tier| {
        BlockPool::new(PoolConfig {
            tier,
            capacity: blocks,
            block_size: BS,
            eviction: Default::default(),
            admission: Default::default(),
        })
        .unwrap()
    };
    let (g1, g2) = (pool(Tier::Device), pool(Tier::Host));
    let e: Arc<dyn TransferEngine> =
        Arc::new(MemcpyEngine::new(s1, Tier::Device, s2, Tier::Host).unwrap());
    // SAFETY: each storage belongs to exactly one pool, used only here.
    let link = unsafe { TierLink::new(e, g1.clone(), g2.clone()) }.unwrap();
    Setup {
        g1,
        g2,
        link,
        block_bytes,
    }
}

/// Registers `n` fresh blocks on G1 (fresh hashes every round, so nothing
/// is ever already present on G2).
fn fresh(g1: &BlockPool, n: usize, round: u32) -> Vec<ImmutableBlock> {
    let toks: Vec<u32> = (0..(n * BS) as u32)
        .map(|t| t ^ round.wrapping_mul(0x9E37_79B9))
        .collect();
    let seq = TokenSequence::from_tokens(&toks, BS, SaltHash(u64::from(round))).unwrap();
    g1.allocate(n)
        .unwrap()
        .into_iter()
        .zip(seq.blocks())
        .map(|(b, tb)| b.fill_from(tb).unwrap().register())
        .collect()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

async fn pipeline_round(p: &OffloadPipeline, src: &[ImmutableBlock], per: usize) {
    let handles: Vec<_> = src
        .chunks(per)
        .map(|c| p.offload(c, None).expect("queue has room"))
        .collect();
    for h in handles {
        let s = h.wait().await;
        assert!(matches!(s, TransferStatus::Completed { .. }), "{s:?}");
    }
}

async fn raw_round(link: &TierLink, src: &[ImmutableBlock], per: usize) {
    for c in src.chunks(per) {
        let d = link.destination().allocate(c.len()).unwrap();
        let copied = link.copy(c.to_vec(), d).unwrap().await.unwrap();
        drop(copied);
    }
}

async fn run(
    big: bool,
    blocks_per_round: usize,
    rounds: usize,
    cfg: PipelineConfig,
) -> (f64, f64, usize) {
    let s = setup(blocks_per_round * 2, big);
    let per = cfg.batch_config.min_batch_size;
    let p = OffloadPipeline::new(s.link.clone(), vec![], cfg).unwrap();
    let mut t_pipe = Vec::new();
    let mut t_raw = Vec::new();
    for r in 0..rounds as u32 + 1 {
        // Alternate so drift on the machine hits both alike.
        let src = fresh(&s.g1, blocks_per_round, 2 * r);
        let t = Instant::now();
        pipeline_round(&p, &src, 8).await;
        let dp = t.elapsed();
        drop(src);
        let src = fresh(&s.g1, blocks_per_round, 2 * r + 1);
        let t = Instant::now();
        raw_round(&s.link, &src, per).await;
        let dr = t.elapsed();
        drop(src);
        if r > 0 {
            t_pipe.push(dp);
            t_raw.push(dr);
        }
    }
    assert_eq!(s.g2.status().mutable, 0);
    (
        median(t_pipe).as_secs_f64(),
        median(t_raw).as_secs_f64(),
        s.block_bytes,
    )
}

fn main() {
    let quick = common::quick();
    let workers: usize = std::env::var("KVBM_BENCH_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "| offload pipeline (G1 → G2, memcpy engine) | pipeline | raw engine, same batch size | pipeline / raw |"
    );
    println!("|---|---:|---:|---:|");

    let seed = PipelineConfig::default();
    let mut wide = PipelineConfig::default();
    wide.batch_config.min_batch_size = 64;
    wide.max_concurrent_transfers = 4;
    wide.on_deck_capacity = 4;

    let (n, rounds) = if quick { (64, 3) } else { (64, 15) };
    let (tp, tr, bb) = rt.block_on(run(true, n, rounds, seed));
    let gb = |t: f64| (n * bb) as f64 / t / 1e9;
    println!(
        "| {n} blocks of {} MiB per round, default settings (batches of 8, 1 transfer at a time) | {:.0} blocks/s = {:.2} GB/s | {:.0} blocks/s = {:.2} GB/s | {:.0}% |",
        bb >> 20,
        n as f64 / tp,
        gb(tp),
        n as f64 / tr,
        gb(tr),
        100.0 * tr / tp
    );

    for (name, cfg) in [
        (
            "default settings (batches of 8, 1 transfer at a time)",
            seed,
        ),
        ("batches of 64, 4 transfers at a time", wide),
    ] {
        let (n, rounds) = if quick { (2048, 3) } else { (16384, 15) };
        let (tp, tr, _) = rt.block_on(run(false, n, rounds, cfg));
        println!(
            "| {n} one-byte blocks per round, {name} | {:.0} ns/block ({:.2} M blocks/s) | {:.0} ns/block | {:.0}% |",
            tp * 1e9 / n as f64,
            n as f64 / tp / 1e6,
            tr * 1e9 / n as f64,
            100.0 * tr / tp
        );
    }
}
