//! Pool benchmarks: allocate + register + drop cycles, and longest-prefix
//! matching over a 1,000-block sequence.
//!
//! Run: `cargo bench -p kvbm-core --bench pool` (`KVBM_BENCH_QUICK=1` for a
//! short run). Prints a Markdown table for the README.

use kvbm_core::{BlockPool, ImmutableBlock, PoolConfig, SaltHash, Tier, TokenSequence};
use std::hint::black_box;
use std::time::Duration;

use kvbm_testkit::bench as common;

const BLOCK_SIZE: usize = 16;

fn sequence(blocks: usize, seed: u32) -> TokenSequence {
    let toks: Vec<u32> = (0..(blocks * BLOCK_SIZE) as u32)
        .map(|t| t.wrapping_mul(2654435761).wrapping_add(seed))
        .collect();
    TokenSequence::from_tokens(&toks, BLOCK_SIZE, kvbm_core::tokens::salt_hash(b"bench")).unwrap()
}

fn pool(capacity: usize) -> BlockPool {
    BlockPool::new(PoolConfig {
        tier: Tier::Device,
        capacity,
        block_size: BLOCK_SIZE,
        eviction: Default::default(),
        admission: Default::default(),
    })
    .unwrap()
}

fn register(p: &BlockPool, s: &TokenSequence) -> Vec<ImmutableBlock> {
    p.allocate(s.blocks().len())
        .unwrap()
        .into_iter()
        .zip(s.blocks())
        .map(|(b, tb)| b.fill_from(tb).unwrap().register())
        .collect()
}

fn main() {
    let (samples, sample_time) = if common::quick() {
        (3, Duration::from_millis(100))
    } else {
        (11, Duration::from_millis(300))
    };
    let mut rows: Vec<(String, String, String)> = Vec::new();

    // 1. Cycles: allocate N (evicting last round's inactive blocks once the
    // pool is warm), register each under a fresh hash, drop all (they become
    // inactive). Each block sees three operations per cycle.
    for &(n, batched) in &[(1024usize, true), (1024, false)] {
        let p = pool(n);
        let seqs = [sequence(n, 1), sequence(n, 2)];
        let mut round = 0usize;
        let ns = common::median_ns_per_unit(samples, sample_time, n as u64, || {
            let s = &seqs[round % 2];
            round += 1;
            if batched {
                black_box(register(&p, s));
            } else {
                for tb in s.blocks() {
                    let b = p.allocate_one().unwrap();
                    black_box(b.fill_from(tb).unwrap().register());
                }
            }
        });
        let ops = 3.0 * 1e9 / ns;
        rows.push((
            format!(
                "allocate+register+drop, {} ({n}-block pool, evicting)",
                if batched {
                    "batched allocate"
                } else {
                    "one block at a time"
                }
            ),
            format!("{:.0} ns/cycle", ns),
            format!("{:.1} M block ops/s (target ≥ 5 M)", ops / 1e6),
        ));
    }

    // 2. Longest-prefix match over 1,000 blocks.
    let n = 1000;
    let s = sequence(n, 3);
    let hashes = s.sequence_hashes();
    {
        let p = pool(n);
        let held = register(&p, &s);
        let ns = common::median_ns_per_unit(samples, sample_time, 1, || {
            black_box(p.match_prefix(black_box(&hashes)));
        });
        rows.push((
            "match 1,000 blocks, all hit (held by another request)".into(),
            format!("{:.2} µs/match", ns / 1e3),
            "target < 20 µs".into(),
        ));
        drop(held);
        let ns = common::median_ns_per_unit(samples, sample_time, 1, || {
            black_box(p.match_prefix(black_box(&hashes)));
        });
        rows.push((
            "match 1,000 blocks, all hit (inactive: revived, then returned)".into(),
            format!("{:.2} µs/match", ns / 1e3),
            "includes returning all 1,000 to the inactive set".into(),
        ));
    }
    {
        let p = pool(n);
        let half = TokenSequence::from_tokens(
            &s.blocks()[..n / 2]
                .iter()
                .flat_map(|b| b.tokens().to_vec())
                .collect::<Vec<_>>(),
            BLOCK_SIZE,
            s.salt_hash(),
        )
        .unwrap();
        let held = register(&p, &half);
        let ns = common::median_ns_per_unit(samples, sample_time, 1, || {
            black_box(p.match_prefix(black_box(&hashes)));
        });
        rows.push((
            "match 1,000 blocks, first half hit (held)".into(),
            format!("{:.2} µs/match", ns / 1e3),
            "target < 20 µs".into(),
        ));
        drop(held);
    }

    // 3. Hashing, for scale: building a 1,000-block sequence.
    let toks: Vec<u32> = (0..(n * BLOCK_SIZE) as u32).collect();
    let ns = common::median_ns_per_unit(samples, sample_time, n as u64, || {
        black_box(TokenSequence::from_tokens(black_box(&toks), BLOCK_SIZE, SaltHash(1)).unwrap());
    });
    rows.push((
        format!("hash a sequence ({BLOCK_SIZE}-token blocks)"),
        format!("{ns:.1} ns/block"),
        String::new(),
    ));

    println!("| pool benchmark | result | note |");
    println!("|---|---|---|");
    for (a, b, c) in rows {
        println!("| {a} | {b} | {c} |");
    }
}
