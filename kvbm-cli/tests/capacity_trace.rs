//! The capacity curve on the sample Mooncake trace against a computation
//! written here, apart from the production code: an LRU cache simulated
//! one capacity at a time, keyed by the whole prefix of ids (a `Vec`, no
//! hashing), with the prefix rule and the last-token rule spelled out.
//! Also: the ceiling is the fidelity test's ideal ratio, and SHARDS at 1%
//! and 10% against exact (the mean absolute error is printed).

use kvbm_cli::trace::capacity_of_trace as from_trace;
use kvbm_recorder::analysis::capacity::Sampling;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::BufReader;

const BLOCK: usize = 512;
const M: u64 = 1 << 20;

/// (timestamp, input_length, hash_ids) per line, in file order.
fn raw() -> Vec<(u64, usize, Vec<u64>)> {
    let path = kvbm_testkit::data::mooncake_sample_trace();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the sample trace {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["timestamp"].as_u64().unwrap(),
                v["input_length"].as_u64().unwrap() as usize,
                v["hash_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .collect(),
            )
        })
        .collect()
}

/// An LRU cache of `cap` blocks, each request looked up then stored: hit
/// tokens over prompt tokens.
fn lru_ratio(reqs: &[(u64, usize, Vec<u64>)], cap: usize) -> f64 {
    let mut last_use: HashMap<Vec<u64>, u64> = HashMap::new();
    let mut by_time: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let mut clock = 0u64;
    let (mut prompt, mut hit) = (0u64, 0u64);
    for (_, len, ids) in reqs {
        prompt += *len as u64;
        let full = (len / BLOCK).min(ids.len());
        // The engine computes at least the last token.
        let lookable = (len.saturating_sub(1) / BLOCK).min(full);
        let keys: Vec<Vec<u64>> = (0..full).map(|k| ids[..=k].to_vec()).collect();
        // Look up: the leading blocks the cache holds.
        let hits = keys[..lookable]
            .iter()
            .take_while(|k| last_use.contains_key(*k))
            .count();
        hit += (hits * BLOCK) as u64;
        // Then every full block is used (hit) or stored (computed).
        for k in keys {
            clock += 1;
            if let Some(t) = last_use.insert(k.clone(), clock) {
                by_time.remove(&t);
            }
            by_time.insert(clock, k);
            if last_use.len() > cap {
                let (_, old) = by_time.pop_first().unwrap();
                last_use.remove(&old);
            }
        }
    }
    hit as f64 / prompt as f64
}

/// The simulator fidelity test's ideal ratio (kvbm-sim/tests/sim_fidelity.rs):
/// what an unbounded cache allows, requests in arrival order.
fn ideal_ratio(reqs: &[(u64, usize, Vec<u64>)]) -> f64 {
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by_key(|&i| (reqs[i].0, i));
    let mut seen: HashSet<Vec<u64>> = HashSet::new();
    let (mut prompt, mut hit) = (0u64, 0u64);
    for i in order {
        let (_, len, ids) = &reqs[i];
        prompt += *len as u64;
        let full = (len.saturating_sub(1) / BLOCK).min(ids.len());
        let mut hitting = true;
        for k in 0..ids.len().min(len / BLOCK) {
            let key = ids[..=k].to_vec();
            if hitting && k < full && seen.contains(&key) {
                hit += BLOCK as u64;
            } else {
                hitting = false;
            }
            seen.insert(key);
        }
    }
    hit as f64 / prompt as f64
}

fn curve(sampling: Sampling, caps: &[u64]) -> kvbm_recorder::analysis::capacity::CapacityReport {
    let f = std::fs::File::open(kvbm_testkit::data::mooncake_sample_trace()).unwrap();
    from_trace(BufReader::new(f), sampling, caps, |l, why| {
        panic!("line {l} skipped: {why}")
    })
    .unwrap()
}

#[test]
fn the_trace_curve_matches_an_lru_simulated_from_the_hash_ids() {
    let reqs = raw();
    assert_eq!(reqs.len(), 3993);
    let caps = [M, 3 * M, 10 * M, 50 * M];
    let rep = curve(Sampling::Exact, &caps);
    assert_eq!(rep.requests, 3993);
    assert_eq!(
        rep.prompt_tokens,
        reqs.iter().map(|r| r.1 as u64).sum::<u64>()
    );
    assert_eq!(rep.method.method, "exact");
    let brute: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = caps
            .iter()
            .map(|&c| {
                let r = &reqs;
                s.spawn(move || lru_ratio(r, c as usize / BLOCK))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (p, b) in rep.points.iter().zip(&brute) {
        eprintln!(
            "{:>3}M tokens: curve {:.4}, LRU simulated here {b:.4}",
            p.capacity_tokens / M,
            p.hit_ratio
        );
        assert!(
            (p.hit_ratio - b).abs() <= 0.005,
            "at {} tokens: curve {:.4}, LRU {b:.4}",
            p.capacity_tokens,
            p.hit_ratio
        );
    }
    // The curve rises with capacity, and at 50M it is close to the
    // ceiling, as the Mooncake paper's figure shows.
    assert!(
        rep.points
            .windows(2)
            .all(|w| w[0].hit_ratio <= w[1].hit_ratio)
    );
    let ideal = ideal_ratio(&reqs);
    eprintln!(
        "ceiling {:.4}, ideal ratio of the fidelity test {ideal:.4}",
        rep.ceiling
    );
    assert!(
        (rep.ceiling - ideal).abs() < 1e-9,
        "{} vs {ideal}",
        rep.ceiling
    );
    assert!(rep.points[3].hit_ratio > rep.ceiling - 0.05);
}

#[test]
fn sampling_at_1_and_10_percent_stays_close_to_exact() {
    // Capacities from 256K to 64M tokens, log-spaced.
    let caps: Vec<u64> = (0..=16)
        .map(|i| (2f64.powf(f64::from(i) / 2.0) * (M / 4) as f64) as u64)
        .collect();
    let exact = curve(Sampling::Exact, &caps);
    for rate in [0.1, 0.01] {
        let s = curve(Sampling::Fixed(rate), &caps);
        assert_eq!(s.method.method, "sampled");
        assert_eq!(s.prompt_tokens, exact.prompt_tokens);
        let mae = s
            .points
            .iter()
            .zip(&exact.points)
            .map(|(a, b)| (a.hit_ratio - b.hit_ratio).abs())
            .sum::<f64>()
            / caps.len() as f64;
        eprintln!(
            "SHARDS at {rate}: mean absolute error {mae:.4} over {} capacities, reported standard error {:.4}, ceiling {:.4} (exact {:.4})",
            caps.len(),
            s.error_estimate,
            s.ceiling,
            exact.ceiling
        );
        // The sample trace is small (40K distinct blocks): 1% keeps about
        // 400 of them. Loose bounds; the bench measures a larger stream.
        let bound = if rate >= 0.1 { 0.03 } else { 0.08 };
        assert!(mae <= bound, "rate {rate}: MAE {mae}");
        assert!(s.error_estimate > 0.0);
    }
}
