//! End to end: the real `kvbm-sim` binary.

use std::io::Write;
use std::process::Command;

fn sim() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvbm-sim"))
}

#[test]
fn json_report_has_every_field() {
    let out = sim()
        .args([
            "--requests",
            "30",
            "--rate",
            "50",
            "--prompt-len",
            "300",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    for key in [
        "requests_finished",
        "prompt_tokens",
        "prefix_hit_tokens",
        "prefix_hit_tokens_by_tier",
        "preemptions",
        "transfers_by_direction",
        "ttft_ms",
        "events_emitted",
        "events_lost",
    ] {
        assert!(v.get(key).is_some(), "missing {key} in {v}");
    }
    assert_eq!(v["requests_finished"], 30);
    assert_eq!(v["events_lost"], 0);
    assert!(v["ttft_ms"]["p99"].as_f64().unwrap() >= v["ttft_ms"]["p50"].as_f64().unwrap());
    assert!(
        v["transfers_by_direction"]["G1→G2"]["blocks"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[test]
fn a_trace_with_bad_lines_keeps_the_good_ones_and_says_which_were_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    let mut f = std::fs::File::create(&path).unwrap();
    writeln!(
        f,
        r#"{{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}}"#
    )
    .unwrap();
    writeln!(f, "this is not json").unwrap();
    writeln!(
        f,
        r#"{{"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]}}"#
    )
    .unwrap();
    drop(f);
    let out = sim()
        .args([
            "--trace",
            path.to_str().unwrap(),
            "--block-size",
            "64",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests_finished"], 2);
    assert!(
        v["prefix_hit_tokens"].as_u64().unwrap() > 0,
        "the second request shares a prefix"
    );
}

#[test]
fn bad_input_is_a_clear_error_not_a_panic() {
    let cases: &[&[&str]] = &[
        &["--block-size", "0"],
        &["--trace", "/nonexistent/trace.jsonl"],
        &["--time-scale", "-1"],
        &["--rate", "0"],
        &["--device-capacity-tokens", "3", "--block-size", "16"],
        &["--bogus"],
        // Seconds that no `Duration` or deadline holds: each panicked where
        // it was turned into one.
        &[
            "--publish",
            "nats://127.0.0.1:1",
            "--engine-id",
            "a",
            "--publish-drain-s=1e300",
        ],
        &[
            "--publish",
            "nats://127.0.0.1:1",
            "--engine-id",
            "a",
            "--publish-linger-s=1e300",
        ],
        &[
            "--publish",
            "nats://127.0.0.1:1",
            "--engine-id",
            "a",
            "--control-lease-s=-1",
        ],
        &["--serve", "127.0.0.1:0", "--linger-s=1e300"],
        &["--decode-ms-per-step=1e300"],
    ];
    for args in cases {
        let out = sim().args(*args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(err.to_lowercase().contains("error"), "{args:?}: {err}");
    }
}
