//! A trace recorded twice with the same options gives the same log, as a
//! user would check it: `kvbm-recorder record --trace` twice (the sample
//! Mooncake trace, tiers small enough that the host evicts and blocks
//! cascade to disk), then `diff` finds no divergence and `compare` no
//! delta. Each run must also end by itself: with a disk tier, `record`
//! used to wait for ever for the event stream to close.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn trace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/mooncake/synthetic_trace.jsonl")
}

/// `kvbm-recorder ARGS`, killed (and the test failed) after `limit`.
fn run(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "kvbm-recorder {args:?} still running after {limit:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn the_same_trace_and_options_record_the_same_events() {
    let dir = tempfile::tempdir().unwrap();
    let trace = trace().display().to_string();
    let record = |name: &str| {
        let out = dir.path().join(name).display().to_string();
        let o = run(
            &[
                "record",
                "--out",
                &out,
                "--trace",
                &trace,
                "--max-requests",
                "300",
                "--device-capacity-tokens",
                "262144",
                "--host-capacity-tokens",
                "262144",
                "--disk-capacity-tokens",
                "1048576",
            ],
            Duration::from_secs(300),
        );
        let said = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(
            o.status.success() && said.contains("(0 lost)"),
            "{said}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        out
    };
    let (a, b) = (record("a"), record("b"));
    let d = run(&["diff", &a, &b], Duration::from_secs(120));
    let said = String::from_utf8_lossy(&d.stdout);
    assert!(
        d.status.success() && said.contains("no divergence"),
        "{said}{}",
        String::from_utf8_lossy(&d.stderr)
    );
    // The run exercised what used to interleave: host evictions and
    // transfers to disk.
    let s = run(&["stats", &a, "--json"], Duration::from_secs(120));
    let stats: serde_json::Value = serde_json::from_slice(&s.stdout).unwrap();
    let text = stats.to_string();
    assert!(text.contains("G2→G3"), "{text}");
    let c = run(
        &[
            "compare",
            &a,
            &b,
            "--expect",
            "hit_ratio == base",
            "--expect",
            "evictions.G2 == base",
            "--expect",
            "ttft_p99_ms == base",
        ],
        Duration::from_secs(120),
    );
    assert!(
        c.status.success(),
        "{}{}",
        String::from_utf8_lossy(&c.stdout),
        String::from_utf8_lossy(&c.stderr)
    );
}
