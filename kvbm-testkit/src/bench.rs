//! Timing helpers shared by the bench binaries of every crate: a median over samples, so a
//! noisy neighbour on a shared machine moves one sample rather than the
//! result.

use std::time::{Duration, Instant};

/// Runs `f` (which performs `work` units per call) in samples of at least
/// `sample_time`, `samples` times, and returns the median nanoseconds per
/// unit.
pub fn median_ns_per_unit(
    samples: usize,
    sample_time: Duration,
    work: u64,
    mut f: impl FnMut(),
) -> f64 {
    // Warm-up, and an estimate of how many calls fill a sample.
    let t = Instant::now();
    let mut calls = 0u64;
    while t.elapsed() < sample_time / 4 || calls == 0 {
        f();
        calls += 1;
    }
    let per_call = t.elapsed().as_secs_f64() / calls as f64;
    let calls_per_sample = ((sample_time.as_secs_f64() / per_call).ceil() as u64).max(1);
    let mut results: Vec<f64> = (0..samples.max(1))
        .map(|_| {
            let t = Instant::now();
            for _ in 0..calls_per_sample {
                f();
            }
            t.elapsed().as_nanos() as f64 / (calls_per_sample * work) as f64
        })
        .collect();
    results.sort_by(f64::total_cmp);
    results[results.len() / 2]
}

/// True when `KVBM_BENCH_QUICK=1`: shorter samples, for smoke runs.
pub fn quick() -> bool {
    std::env::var("KVBM_BENCH_QUICK").is_ok_and(|v| v == "1")
}
