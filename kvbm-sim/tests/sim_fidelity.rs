//! Fidelity: on the sample Mooncake trace (`data/mooncake/`, in the
//! repository), with a host tier large enough to keep everything, the
//! simulator finds exactly the prefix hits the trace itself allows; with
//! smaller hosts it finds the ratios the README states.
//!
//! The reference is computed here, independently of the simulator and of
//! kvbm's hashing, from the trace's `hash_ids` alone. The README's figures
//! are asserted as written there, with the tolerances written there: for a
//! 64M-token host exactly the reference's hit tokens (ratio 0.6504); for 8M
//! and 2M host tokens 0.5490 and 0.2549; with no host 0.1491 (each to the
//! four places written: a run in virtual time gives the same events every
//! time, so these do not move from run to run).

use kvbm_sim::sim::{SimConfig, Simulator, WorkerModel};
use kvbm_sim::workload::{MooncakeOptions, RequestSpec, parse_mooncake};
use std::collections::HashSet;
use std::io::BufReader;
use std::path::PathBuf;

const BLOCK: usize = 512;

/// The sample trace kept in the repository. Missing is a failure: every
/// clone has it.
fn trace() -> PathBuf {
    let p = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/mooncake/synthetic_trace.jsonl"
    ));
    assert!(
        p.is_file(),
        "the sample Mooncake trace {} is missing: it is part of the repository (data/mooncake/)",
        p.display()
    );
    p
}

/// What the README states, by host capacity in tokens: the prefix-hit
/// ratio and the tolerance it gives it. (The 64M row is also checked token
/// for token against the reference.)
const README_RATIOS: [(usize, f64, f64); 4] = [
    (64 << 20, 0.6504, 0.00005),
    (8 << 20, 0.5490, 0.00005),
    (2 << 20, 0.2549, 0.00005),
    (0, 0.1491, 0.00005),
];
/// The reference's hit and prompt tokens (also computed, in Python, from
/// the hash ids; the trace parser's own test pins the same two numbers).
const TRACE_HIT_TOKENS: u64 = 39_802_880;
const TRACE_PROMPT_TOKENS: u64 = 61_194_628;

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
/// Returns (hit tokens, prompt tokens).
fn reference_hits(reqs: &[(u64, usize, Vec<u64>)]) -> (u64, u64) {
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
    (hit, prompt)
}

fn run(workload: &[RequestSpec], host_tokens: usize) -> kvbm_sim::sim::SimReport {
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
    report
}

#[test]
fn prefix_hits_match_what_the_trace_allows_and_the_readme_figures() {
    let path = trace();
    let raw = raw(&path);
    let (ref_hit, ref_prompt) = reference_hits(&raw);
    let reference = ref_hit as f64 / ref_prompt as f64;
    let f = std::fs::File::open(&path).unwrap();
    let workload = parse_mooncake(BufReader::new(f), &MooncakeOptions::default()).unwrap();
    assert_eq!(workload.len(), 3993);
    assert_eq!(
        (ref_hit, ref_prompt),
        (TRACE_HIT_TOKENS, TRACE_PROMPT_TOKENS),
        "the independent reference moved"
    );

    // Unbounded (64M tokens: more than the trace's 61M), then smaller hosts;
    // the runs are independent, so use both cores.
    let reports: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = README_RATIOS
            .iter()
            .map(|&(h, _, _)| {
                let w = &workload;
                s.spawn(move || run(w, h))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ratios: Vec<f64> = reports.iter().map(|r| r.prefix_hit_ratio).collect();
    eprintln!(
        "reference {reference:.4}; simulator by host capacity {:?}: {ratios:.6?}",
        README_RATIOS.map(|(h, _, _)| h)
    );

    // Unbounded: exactly what the trace allows, token for token.
    let unbounded = &reports[0];
    assert_eq!(
        (unbounded.prefix_hit_tokens, unbounded.prompt_tokens),
        (TRACE_HIT_TOKENS, TRACE_PROMPT_TOKENS),
        "simulator {:.4} vs trace {reference:.4}",
        unbounded.prefix_hit_ratio
    );
    for ((host, want, tolerance), got) in README_RATIOS.iter().zip(&ratios) {
        assert!(
            (got - want).abs() <= *tolerance,
            "with a {host}-token host the simulator's prefix-hit ratio is {got:.6}; \
             the README says {want} ± {tolerance}"
        );
    }
}
