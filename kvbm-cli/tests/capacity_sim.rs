//! The capacity curve is a property of the workload: recordings of the
//! simulator running the sample Mooncake trace with a small host tier and
//! with an unbounded one give the same curve, the one the trace itself
//! gives; and what the lightly loaded simulator measured at its host
//! capacity lies on that curve. Also the miss reasons of those runs add up
//! to the prompt, and a version-2 log written to disk reads back with the
//! same curve.

use kvbm_cli::trace::capacity_of_trace as from_trace;
use kvbm_events::Event;
use kvbm_events::bus::TapItem;
use kvbm_recorder::analysis::capacity::{
    CapacityAnalyzer, CapacityConfig, CapacityReport, Sampling,
};
use kvbm_sim::sim::{SimConfig, SimReport, Simulator, WorkerModel};
use kvbm_sim::workload::{MooncakeOptions, RequestSpec, parse_mooncake};
use std::io::BufReader;
use std::time::{Duration, Instant};

const M: u64 = 1 << 20;
const CAPS: [u64; 5] = [M, 2 * M, 3 * M, 10 * M, 50 * M];

fn workload() -> Vec<RequestSpec> {
    let f = std::fs::File::open(kvbm_testkit::data::mooncake_sample_trace()).unwrap();
    parse_mooncake(BufReader::new(f), &MooncakeOptions::default()).unwrap()
}

/// Runs the simulator with `host` tokens of host tier, lightly loaded (as
/// the fidelity test runs it), feeding every event to a capacity analysis
/// as a recorder would drain them.
fn run(workload: &[RequestSpec], host: usize) -> (CapacityAnalyzer, SimReport) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cfg = SimConfig {
        block_size: 512,
        device_capacity_tokens: 1 << 20,
        host_capacity_tokens: host,
        real_bytes_per_token: 1,
        worker: WorkerModel {
            prefill_ns_per_token: 5_000,
            ..WorkerModel::default()
        },
        ..SimConfig::default()
    };
    let mut sim = Simulator::new(cfg, workload.to_vec(), rt.handle()).unwrap();
    let mut tap = sim.emitter().bus().take_tap().unwrap();
    let mut an = CapacityAnalyzer::new(CapacityConfig::default());
    let mut take = |item: TapItem<Event>| match item {
        TapItem::Event(e) => an.observe(&e),
        TapItem::Gap { dropped } => panic!("the tap lost {dropped} events"),
    };
    while sim.step() {
        while let Ok(item) = tap.try_recv() {
            take(item);
        }
    }
    let report = sim.finish();
    // The pipelines' last events come after `finish`; wait for them.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut idle_since = Instant::now();
    while Instant::now() < deadline && idle_since.elapsed() < Duration::from_millis(300) {
        match tap.try_recv() {
            Ok(item) => {
                take(item);
                idle_since = Instant::now();
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    assert_eq!(report.requests_finished, workload.len());
    assert_eq!(report.events_lost, 0);
    (an, report)
}

fn trace_curve() -> CapacityReport {
    let f = std::fs::File::open(kvbm_testkit::data::mooncake_sample_trace()).unwrap();
    from_trace(BufReader::new(f), Sampling::Exact, &CAPS, |l, why| {
        panic!("line {l}: {why}")
    })
    .unwrap()
}

#[test]
fn recordings_at_any_host_capacity_give_the_trace_curve_and_the_run_lies_on_it() {
    let w = workload();
    let hosts = [8usize << 20, 64 << 20];
    let runs: Vec<(CapacityAnalyzer, SimReport)> = std::thread::scope(|s| {
        let hs: Vec<_> = hosts
            .iter()
            .map(|&h| {
                let w = &w;
                s.spawn(move || run(w, h))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let trace = trace_curve();
    for ((an, sim), host) in runs.iter().zip(hosts) {
        let rep = an.report(&CAPS, None);
        assert_eq!(rep.requests, trace.requests, "host {host}");
        assert_eq!(rep.prompt_tokens, trace.prompt_tokens, "host {host}");
        assert_eq!(rep.references, trace.references, "host {host}");
        for (a, b) in rep.points.iter().zip(&trace.points) {
            assert!(
                (a.hit_ratio - b.hit_ratio).abs() < 1e-12,
                "host {host}: at {} tokens the recording gives {} and the trace {}",
                a.capacity_tokens,
                a.hit_ratio,
                b.hit_ratio
            );
        }
        assert!((rep.ceiling - trace.ceiling).abs() < 1e-12);

        // What the run measured, beside the curve at its capacity (the
        // tiers are inclusive: the host's capacity is theirs together).
        let run = rep.run.as_ref().expect("a run report");
        let at = an.curve().at_tokens(host as u64).hit_ratio;
        assert_eq!(run.capacity_tokens, Some(host as u64));
        eprintln!(
            "host {}M: simulator measured {:.4} (its report: {:.4}), curve at {}M {:.4}",
            host >> 20,
            run.measured_hit_ratio,
            sim.prefix_hit_ratio,
            host >> 20,
            at
        );
        assert!((run.measured_hit_ratio - sim.prefix_hit_ratio).abs() < 1e-9);
        assert!(
            (run.measured_hit_ratio - at).abs() <= 0.01,
            "host {host}: measured {:.4}, curve {at:.4}",
            run.measured_hit_ratio
        );

        // Every prompt token is a hit or has a reason.
        let mr = rep.miss_reasons.as_ref().expect("miss reasons");
        let t = mr.tokens;
        assert_eq!(t.lookups, trace.requests);
        assert_eq!(t.hits() + t.misses(), t.prompt_tokens, "{t:?}");
        assert_eq!(t.prompt_tokens, trace.prompt_tokens);
        eprintln!("host {}M: miss reasons {:?}", host >> 20, mr.shares);
        if host < 60 << 20 {
            assert!(t.evicted.iter().sum::<u64>() > 0, "a small host evicts");
        }
    }
}
