//! `capacity --policies` on the sample Mooncake trace:
//! - its LRU model gives the exact (stack-distance) curve, point for point;
//! - the simulator, run with each policy on G2 at the same capacity (G1's
//!   own prefix cache off, so that G2 is the one cache the model is of),
//!   lies within one point of the model's hit ratio;
//! - the command prints a column per policy, writes `policies` into its
//!   JSON and a line per policy into its SVG, and refuses a policy it does
//!   not know, naming it.

use kvbm_cli::policies::{PolicyCurves, parse_policies};
use kvbm_cli::trace::capacity_and_policies_of_trace;
use kvbm_recorder::analysis::capacity::{CapacityReport, Sampling};
use kvbm_sim::sim::{SimConfig, Simulator, TierEviction, WorkerModel};
use kvbm_sim::workload::{MooncakeOptions, parse_mooncake};
use std::collections::BTreeMap;
use std::io::BufReader;
use std::process::Command;

const M: u64 = 1 << 20;

fn trace() -> std::path::PathBuf {
    kvbm_testkit::data::mooncake_sample_trace()
}

fn model(policies: &str, caps: &[u64]) -> (CapacityReport, BTreeMap<String, Vec<f64>>) {
    let mut curves = PolicyCurves::new(parse_policies(policies).unwrap(), caps);
    curves.prepare(512).unwrap();
    let f = std::fs::File::open(trace()).unwrap();
    let rep = capacity_and_policies_of_trace(
        BufReader::new(f),
        Sampling::Exact,
        caps,
        Some(&mut curves),
        |l, why| panic!("line {l}: {why}"),
    )
    .unwrap();
    let by = curves
        .report()
        .into_iter()
        .map(|(k, v)| (k, v.iter().map(|p| p.hit_ratio).collect()))
        .collect();
    (rep, by)
}

#[test]
fn the_lru_model_is_the_exact_curve() {
    let caps = [M, 2 * M, 3 * M, 10 * M, 50 * M];
    let (rep, by) = model("lru", &caps);
    for (p, m) in rep.points.iter().zip(&by["lru"]) {
        assert!(
            (p.hit_ratio - m).abs() < 1e-12,
            "at {} tokens the curve says {} and the model {m}",
            p.capacity_tokens,
            p.hit_ratio
        );
    }
}

/// The simulator's prefix-hit ratio on the sample trace with `policy` on a
/// G2 of `host` tokens, G1 serving no prefix hits, lightly loaded (as the
/// fidelity test runs it).
fn simulate(policy: &str, host: usize) -> f64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let f = std::fs::File::open(trace()).unwrap();
    let workload = parse_mooncake(BufReader::new(f), &MooncakeOptions::default()).unwrap();
    let cfg = SimConfig {
        block_size: 512,
        device_capacity_tokens: 1 << 20,
        host_capacity_tokens: host,
        device_prefix_cache: false,
        eviction: format!("G2={policy}").parse::<TierEviction>().unwrap(),
        real_bytes_per_token: 1,
        worker: WorkerModel {
            prefill_ns_per_token: 5_000,
            ..WorkerModel::default()
        },
        ..SimConfig::default()
    };
    let n = workload.len();
    let mut sim = Simulator::new(cfg, workload, rt.handle()).unwrap();
    while sim.step() {}
    let report = sim.finish();
    assert_eq!(report.requests_finished, n);
    report.prefix_hit_ratio
}

#[test]
fn each_policy_in_the_simulator_lies_within_a_point_of_the_model() {
    const POLICIES: [&str; 5] = ["lru", "lfu", "s3fifo", "arc", "tinylfu+lru"];
    let host = 4 * M;
    let (_, by) = model(&POLICIES.join(","), &[host]);
    // Two at a time: this machine's two cores.
    let runs: Vec<f64> = POLICIES
        .chunks(2)
        .flat_map(|pair| {
            std::thread::scope(|s| {
                let hs: Vec<_> = pair
                    .iter()
                    .map(|p| s.spawn(move || simulate(p, host as usize)))
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for (p, sim) in POLICIES.iter().zip(runs) {
        let m = by[*p][0];
        eprintln!("{p}: simulator {sim:.4}, model {m:.4} at 4M tokens");
        assert!(
            (sim - m).abs() <= 0.01,
            "{p}: the simulator measured {sim:.4}, capacity --policies says {m:.4}"
        );
    }
}

fn recorder(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn the_command_gives_a_column_json_and_a_line_per_policy() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("c.svg");
    let t = trace().display().to_string();
    let args = [
        "capacity",
        "--trace",
        &t,
        "--capacities",
        "2M,8M",
        "--policies",
        "s3fifo,tinylfu+lru",
    ];
    let o = recorder(&[&args[..], &["--json", "--svg", &svg.display().to_string()]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let (_, by) = model("s3fifo,tinylfu+lru", &[2 * M, 8 * M]);
    for name in ["s3fifo", "tinylfu+lru"] {
        let pts = v["policies"][name].as_array().unwrap();
        assert_eq!(pts.len(), 2, "{v}");
        assert_eq!(pts[1]["capacity_tokens"], 8 * M);
        // JSON keeps the ratio to the last place or so.
        assert!((pts[1]["hit_ratio"].as_f64().unwrap() - by[name][1]).abs() < 1e-12);
    }
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(drawn.contains("s3fifo (simulated)") && drawn.contains("tinylfu+lru (simulated)"));

    let o = recorder(&args);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("lru (exact)") && text.contains("tinylfu+lru"),
        "{text}"
    );

    let o = recorder(&["capacity", "--trace", &t, "--policies", "lru,mru"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("`mru`"), "{err}");
}
