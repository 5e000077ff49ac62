//! End to end: the real `kvbm-sim` binary.

use std::io::{BufRead, Read, Write};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn sim() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvbm-sim"))
}

/// Runs `cmd` to the end like `Command::output`, but kills it and fails
/// the test once it has run `limit`: a run that hangs fails rather than
/// stalling the suite.
fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let read_all = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = read_all(Box::new(child.stdout.take().unwrap()));
    let err = read_all(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// Asserts `out` is a failure with a clear error containing each of
/// `needles`, not a panic.
fn assert_refused(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "no {n:?} in: {err}");
    }
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
    // A token is named by where it came from.
    for (flag, env, needle) in [
        (Some("bad token"), None, "error: --token: unusable token"),
        (
            None,
            Some("bad token"),
            "error: the KVBM_TOKEN environment variable: unusable token",
        ),
    ] {
        let mut cmd = sim();
        cmd.args(["--requests", "1", "--serve", "127.0.0.1:0"]);
        cmd.env_remove("KVBM_TOKEN");
        if let Some(t) = flag {
            cmd.args(["--token", t]);
        }
        if let Some(t) = env {
            cmd.env("KVBM_TOKEN", t);
        }
        assert_refused(&cmd.output().unwrap(), &[needle]);
    }
    // One line, the cause said once (anyhow's report said it twice, under
    // "Caused by:", and added a backtrace when RUST_BACKTRACE was set).
    let out = sim()
        .args(["--trace", "/nonexistent/trace.jsonl"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("error: opening trace /nonexistent/trace.jsonl: ")
            && err.lines().count() == 1,
        "{err}"
    );
}

#[test]
fn a_reader_that_goes_away_ends_the_output_quietly() {
    for json in [false, true] {
        let mut cmd = sim();
        cmd.args(["--requests", "3"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if json {
            cmd.arg("--json");
        }
        let mut child = cmd.spawn().unwrap();
        // As `| true` does: the reader is gone before the report is written.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(out.status.code(), Some(0), "{err}");
    }
}

#[cfg(target_os = "linux")]
#[test]
fn a_full_stdout_is_an_error_naming_stdout() {
    for args in [&["--requests", "3"][..], &["--requests", "3", "--json"]] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = sim()
            .args(args)
            .stdout(full)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_refused(
            &out,
            &["error: writing the report to stdout", "No space left"],
        );
        assert_eq!(out.status.code(), Some(1));
    }
}

#[test]
fn out_of_range_options_are_refused_by_name_with_their_range() {
    for (args, needles) in [
        // Panicked multiplying it by the block size.
        (
            &["--kv-bytes-per-token", "18446744073709551615"][..],
            &["--kv-bytes-per-token", "from 1 to 1073741824"][..],
        ),
        // Wrapped the byte totals.
        (
            &["--kv-bytes-per-token", "1000000000000000"],
            &["--kv-bytes-per-token", "from 1 to 1073741824"],
        ),
        // Silently 1 s, and silently a day.
        (
            &["--bp-deadline-s", "0"],
            &["--bp-deadline-s", "from 0.001 to 86400"],
        ),
        (
            &["--bp-deadline-s", "1e9"],
            &["--bp-deadline-s", "from 0.001 to 86400"],
        ),
        (&["--max-trace-tokens", "0"], &["--max-trace-tokens"]),
        // Named as the engine's and the server's fields before.
        (
            &["--device-capacity-tokens", "8"],
            &["--device-capacity-tokens: 8 tokens hold no 16-token block"],
        ),
        (
            &["--serve", "127.0.0.1:0", "--max-clients", "0"],
            &["--max-clients: must be at least 1"],
        ),
        (
            &[
                "--serve",
                "127.0.0.1:0",
                "--max-clients",
                "8",
                "--max-connections",
                "4",
            ],
            &["--max-connections: must be at least --max-clients"],
        ),
    ] {
        let mut a = args.to_vec();
        a.extend(["--requests", "1"]);
        assert_refused(&sim().args(&a).output().unwrap(), needles);
    }
    // The bounds themselves are taken.
    let out = sim()
        .args([
            "--requests",
            "2",
            "--kv-bytes-per-token",
            "1073741824",
            "--bp-deadline-s",
            "0.001",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["kv_bytes_per_block"], 16u64 << 30);
}

#[test]
fn an_empty_or_blank_trace_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in [("empty.jsonl", ""), ("blank.jsonl", "\n  \n")] {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let out = sim()
            .args(["--trace", path.to_str().unwrap(), "--json"])
            .output()
            .unwrap();
        assert_refused(&out, &["no usable request", name, "empty or blank"]);
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn a_few_kb_trace_asking_for_too_many_tokens_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("amp.jsonl");
    // 27 KB asking for 300 Mi tokens: 100 of these lines ran on for
    // minutes in ~1 GB before.
    let text: String = (0..300u64)
        .map(|i| {
            format!(
                "{{\"timestamp\": {}, \"input_length\": 1048576, \"output_length\": 1, \"hash_ids\": []}}\n",
                i * 1_000_000_000
            )
        })
        .collect();
    std::fs::write(&path, text).unwrap();
    let out = output_within(
        sim().args([
            "--trace",
            path.to_str().unwrap(),
            "--json",
            "--device-capacity-tokens",
            "2097152",
        ]),
        Duration::from_secs(30),
    );
    assert_refused(
        &out,
        &["amp.jsonl", "line 256", "--max-trace-tokens 268435456"],
    );
}

#[cfg(unix)]
#[test]
fn a_trace_that_never_ends_a_line_is_refused_not_skipped_forever() {
    let out = output_within(
        sim().args(["--trace", "/dev/zero"]),
        Duration::from_secs(60),
    );
    assert_refused(
        &out,
        &[
            "/dev/zero",
            "line 1",
            "no end of line in the 83886081 bytes",
        ],
    );
}

/// SIGINT or SIGTERM before the workload ends: the report says so and
/// counts only what arrived, and the status is 128 + the signal.
#[cfg(unix)]
#[test]
fn an_interrupted_served_run_says_so_and_exits_with_the_signals_status() {
    for (signal, status, json) in [("INT", 130, true), ("TERM", 143, false)] {
        let mut cmd = sim();
        cmd.args([
            "--serve",
            "127.0.0.1:0",
            "--requests",
            "2000",
            "--rate",
            "5",
            "--real-time",
            "1",
            "--max-len",
            "4096",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        if json {
            cmd.arg("--json");
        }
        let mut child = cmd.spawn().unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        stdout.read_line(&mut first).unwrap();
        assert!(first.starts_with("serving on http://"), "{first}");
        // A few requests arrive (5 a second).
        std::thread::sleep(Duration::from_millis(1500));
        let killed = Command::new("kill")
            .args([format!("-{signal}"), child.id().to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let mut report = String::new();
        stdout.read_to_string(&mut report).unwrap();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(status), "SIG{signal}: {err}");
        assert!(
            err.contains(&format!(
                "interrupted by SIG{signal} before the workload ended"
            )),
            "{err}"
        );
        if json {
            let v: serde_json::Value = serde_json::from_str(&report).unwrap();
            assert_eq!(v["interrupted"], true, "{v}");
            assert_eq!(v["requests_total"], 2000, "{v}");
            let arrived = v["requests_arrived"].as_u64().unwrap();
            assert!((1..2000).contains(&arrived), "{v}");
            // Prompts of at most 4096 tokens: only the arrived ones count.
            let prompt = v["prompt_tokens"].as_u64().unwrap();
            assert!(prompt > 0 && prompt <= arrived * 4096, "{v}");
        } else {
            assert!(
                report.starts_with("INTERRUPTED ") && report.contains("of 2000 requests"),
                "{report}"
            );
        }
    }
}
