//! Fidelity: on the sample Mooncake trace, with a host tier large enough to
//! keep everything, the simulator finds (within 2 percentage points) the
//! prefix hits the trace itself allows; shrinking the host lowers the hit
//! ratio monotonically.
//!
//! The reference ratio is computed here, independently of the simulator
//! and of kvbm's hashing, from the trace's `hash_ids` alone.

use kvbm_sim::sim::{SimConfig, Simulator, WorkerModel};
use kvbm_sim::workload::{MooncakeOptions, RequestSpec, parse_mooncake};
use std::collections::HashSet;
use std::io::BufReader;
use std::path::PathBuf;

const BLOCK: usize = 512;

fn trace() -> Option<PathBuf> {
    let p = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/data/mooncake/synthetic_trace.jsonl"
    ));
    p.exists().then_some(p)
}

/// Raw JSON, read without the workload module: (timestamp, input_length,
/// hash_ids) per line.
fn raw(path: &PathBuf) -> Vec<(u64, usize, Vec<u64>)> {
    let text = std::fs::read_to_string(path).unwrap();
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

/// What an unbounded cache allows: for each request in arrival order, the
/// leading full blocks whose whole prefix (the chain of hash ids up to and
/// including it) some earlier request already had. A prompt never hits on
/// its last token (the engine must compute at least one), as in vLLM.
fn reference_ratio(reqs: &[(u64, usize, Vec<u64>)]) -> f64 {
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

fn run(workload: &[RequestSpec], host_tokens: usize) -> f64 {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cfg = SimConfig {
        block_size: BLOCK,
        device_capacity_tokens: 1 << 20,
        host_capacity_tokens: host_tokens,
        real_bytes_per_token: 1,
        // A lightly loaded engine: a request that shares a prefix arrives
        // after the earlier one computed it, as the reference assumes.
        worker: WorkerModel {
            prefill_ns_per_token: 5_000,
            ..WorkerModel::default()
        },
        ..SimConfig::default()
    };
    let report = Simulator::new(cfg, workload.to_vec(), rt.handle())
        .unwrap()
        .run();
    assert_eq!(report.requests_finished, workload.len());
    assert_eq!(report.events_lost, 0);
    report.prefix_hit_ratio
}

#[test]
fn prefix_hits_match_what_the_trace_allows_and_fall_with_host_capacity() {
    let Some(path) = trace() else {
        eprintln!("skipping: the sample Mooncake trace is not beside the repository");
        return;
    };
    let reference = reference_ratio(&raw(&path));
    let f = std::fs::File::open(&path).unwrap();
    let workload = parse_mooncake(BufReader::new(f), &MooncakeOptions::default()).unwrap();
    assert_eq!(workload.len(), 3993);

    // Unbounded (64M tokens: more than the trace's 61M), then smaller hosts;
    // the runs are independent, so use both cores.
    let hosts = [64usize << 20, 8 << 20, 2 << 20, 0];
    let ratios: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = hosts
            .iter()
            .map(|&h| {
                let w = &workload;
                s.spawn(move || run(w, h))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let unbounded = ratios[0];
    eprintln!("reference {reference:.4}; simulator by host capacity {hosts:?}: {ratios:.4?}");
    assert!(
        (unbounded - reference).abs() <= 0.02,
        "simulator {unbounded:.4} vs trace {reference:.4}"
    );
    for (w, h) in ratios.windows(2).zip(hosts.windows(2)) {
        assert!(
            w[1] <= w[0] + 1e-9,
            "hit ratio rose from {:.4} to {:.4} when the host shrank from {} to {} tokens",
            w[0],
            w[1],
            h[0],
            h[1]
        );
    }
    assert!(
        ratios[3] < unbounded - 0.1,
        "a host-less run should lose most hits"
    );
}
