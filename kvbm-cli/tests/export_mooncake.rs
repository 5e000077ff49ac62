//! End to end: a recording's requests exported as a Mooncake trace
//! (`kvbm-recorder export --format mooncake`) and re-driven in the
//! simulator with the flags the export wrote beside it give the same
//! workload: the same requests and prompt tokens, and the same capacity
//! curve, which depends only on which blocks each request shares.

mod common;

use std::path::Path;
use std::process::Output;

/// `kvbm-recorder` with `args`, which must succeed.
fn recorder(args: &[&str]) -> Output {
    let out = common::recorder(args);
    assert!(
        out.status.success(),
        "kvbm-recorder {args:?}: exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap()
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn an_exported_trace_re_drives_the_same_workload() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let trace = tmp.path().join("t.jsonl");
    // Prefixes shared between requests, a host tier, a device small
    // enough to evict.
    recorder(&[
        "record",
        "--out",
        path(&a),
        "--requests",
        "40",
        "--rate",
        "40",
        "--shared-prefix-ratio",
        "0.8",
        "--shared-prefixes",
        "4",
        "--device-capacity-tokens",
        "16384",
        "--host-capacity-tokens",
        "32768",
    ]);
    recorder(&[
        "export",
        path(&a),
        "--format",
        "mooncake",
        "--out",
        path(&trace),
    ]);
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tmp.path().join("t.jsonl.meta.json")).unwrap())
            .unwrap();
    assert_eq!(meta["requests"], 40, "{meta}");
    assert_eq!(meta["block_size"], 16, "{meta}");
    assert_eq!(meta["tiers_tokens"]["G2"], 32768, "{meta}");
    let text = std::fs::read_to_string(&trace).unwrap();
    assert_eq!(text.lines().count(), 40);
    let args: Vec<String> = meta["simulator_args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let mut redrive = vec!["record", "--out", path(&b), "--trace", path(&trace)];
    redrive.extend(args.iter().map(String::as_str));
    recorder(&redrive);
    let (sa, sb) = (
        json(&recorder(&["stats", path(&a), "--json"])),
        json(&recorder(&["stats", path(&b), "--json"])),
    );
    assert_eq!(sa["requests"], sb["requests"]);
    assert_eq!(sb["finished"], 40);
    let (ca, cb) = (
        json(&recorder(&["capacity", path(&a), "--json"])),
        json(&recorder(&["capacity", path(&b), "--json"])),
    );
    for key in ["prompt_tokens", "ceiling", "block_size", "points"] {
        assert_eq!(ca[key], cb[key], "{key}");
    }
    assert!(
        ca["ceiling"].as_f64().unwrap() > 0.05,
        "prefixes are shared: {ca}"
    );
}
