//! End to end: the real `kvbm-recorder capacity` on the sample trace, on a
//! log it recorded, on a version-1 log from `replays/`, and on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().unwrap()
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn trace() -> String {
    kvbm_testkit::data::mooncake_sample_trace()
        .to_string_lossy()
        .into_owned()
}

fn replays() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../replays")
}

#[test]
fn a_trace_gives_points_the_ceiling_and_an_svg() {
    let tmp = tempfile::tempdir().unwrap();
    let svg = tmp.path().join("curve.svg");
    let out = bin()
        .args(["capacity", "--trace", &trace(), "--json", "--svg"])
        .arg(&svg)
        .output()
        .unwrap();
    let v = json(&out);
    assert!(v["prompt_tokens"].as_u64().unwrap() > 60_000_000);
    let ceiling = v["ceiling"].as_f64().unwrap();
    assert!((0.6..0.7).contains(&ceiling), "{ceiling}");
    let points = v["points"].as_array().unwrap();
    let caps: Vec<u64> = points
        .iter()
        .map(|p| p["capacity_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(caps, [1 << 20, 3 << 20, 10 << 20, 50 << 20]);
    let ratios: Vec<f64> = points
        .iter()
        .map(|p| p["hit_ratio"].as_f64().unwrap())
        .collect();
    assert!(ratios.windows(2).all(|w| w[0] <= w[1]), "{ratios:?}");
    assert!(ratios[3] <= ceiling + 1e-12);
    assert_eq!(v["method"]["method"], "exact");
    assert_eq!(v["method"]["rate"], 1.0);
    assert!(v.get("miss_reasons").is_some());
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg"), "{}", &s[..s.len().min(200)]);
    assert!(s.contains("ceiling"), "the ceiling is labelled");
    assert!(
        s.contains("<polyline") || s.contains("<path"),
        "a curve is drawn"
    );

    // Sampled: the method and the rate say so, with an error estimate.
    let v = json(&run(&[
        "capacity",
        "--trace",
        &trace(),
        "--json",
        "--sample",
        "0.1",
        "--capacities",
        "2M,8m",
    ]));
    assert_eq!(v["method"]["method"], "sampled");
    assert!((v["method"]["rate"].as_f64().unwrap() - 0.1).abs() < 1e-3);
    assert!(v["error_estimate"].as_f64().unwrap() > 0.0);
    assert_eq!(v["points"][1]["capacity_tokens"], 8u64 << 20);

    // Text: says what it is.
    let out = run(&["capacity", "--trace", &trace(), "--capacities", "10M"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ceiling") && text.contains("10M"), "{text}");
}

/// A sample too small to estimate from (a rate that keeps nothing, a cap
/// of one block) says so beside its figures; a reasonable one does not.
#[test]
fn a_sample_too_small_for_an_estimate_says_so() {
    for (args, small) in [
        (&["--sample", "1e-300"][..], true),
        (&["--max-exact-blocks", "1"], true),
        (&["--sample", "0.5"], false),
    ] {
        let out = bin()
            .args(["capacity", "--trace", &trace(), "--json"])
            .args(args)
            .output()
            .unwrap();
        let v = json(&out);
        let notes = v["notes"].to_string();
        assert_eq!(
            notes.contains("too few for an estimate"),
            small,
            "{args:?}: {notes}"
        );
    }
}

#[test]
fn a_recorded_log_gives_the_curve_the_run_and_miss_reasons() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let out = bin()
        .args(["record", "--out"])
        .arg(&dir)
        .args([
            "--requests",
            "60",
            "--rate",
            "40",
            "--prompt-len",
            "400",
            "--output-len",
            "40",
            "--seed",
            "4",
            "--device-capacity-tokens",
            "4096",
            "--host-capacity-tokens",
            "8192",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(
        &bin()
            .arg("capacity")
            .arg(&dir)
            .args(["--json", "--capacities", "1K,4K,64K"])
            .output()
            .unwrap(),
    );
    assert_eq!(v["requests"], 60);
    let run = &v["run"];
    assert_eq!(run["capacity_tokens"], 8192);
    assert_eq!(run["tiers"].as_array().unwrap().len(), 2);
    let t = &v["miss_reasons"]["tokens"];
    let sum = |k: &str| -> u64 {
        match &t[k] {
            serde_json::Value::Array(a) => a.iter().map(|x| x.as_u64().unwrap()).sum(),
            x => x.as_u64().unwrap(),
        }
    };
    let accounted: u64 = [
        "hit_tokens",
        "cold",
        "evicted",
        "in_flight",
        "behind_miss",
        "never_stored",
        "last_block",
        "partial",
    ]
    .iter()
    .map(|k| sum(k))
    .sum();
    assert_eq!(accounted, t["prompt_tokens"].as_u64().unwrap(), "{t}");
    assert_eq!(t["prompt_tokens"], v["prompt_tokens"]);
    // The run's measured ratio is what its tiers served.
    let measured = run["measured_hit_ratio"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&measured));
}

#[test]
fn a_version_1_log_reads_and_says_what_it_lacks() {
    let v = json(
        &bin()
            .arg("capacity")
            .arg(replays().join("mooncake-slice"))
            .arg("--json")
            .output()
            .unwrap(),
    );
    assert_eq!(v["requests"], 0);
    assert!(v["run"].is_null());
    let notes = v["notes"].to_string();
    assert!(notes.contains("schema version 2"), "{notes}");
    // Its stores and removals still say something: per tier, a lower
    // bound, and it says it is one.
    let restores = v["restores"].as_array().unwrap();
    assert!(!restores.is_empty());
    assert!(notes.contains("lower bound"), "{notes}");
    for t in restores {
        let pts = t["points"].as_array().unwrap();
        let b: Vec<u64> = pts
            .iter()
            .map(|p| p["extra_hits_lower_bound"].as_u64().unwrap())
            .collect();
        assert!(b.windows(2).all(|w| w[0] <= w[1]), "{b:?}");
        assert!(b.last().unwrap() <= &t["restores"].as_u64().unwrap());
    }
}

#[test]
fn bad_input_is_a_clear_error_never_a_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let bad_only = tmp.path().join("bad.jsonl");
    std::fs::write(&bad_only, "{\"timestamp\": 0}\nnot json\n").unwrap();
    let bad_only = bad_only.display().to_string();
    for (args, says) in [
        (
            vec!["capacity", "--trace", "/nonexistent/t.jsonl"],
            "opening trace",
        ),
        (
            vec!["capacity", "--trace", "X", "--capacities", "1M,lots"],
            "lots",
        ),
        (vec!["capacity", "--trace", "X", "--capacities", "-5"], "-5"),
        (
            vec!["capacity", "--trace", "X", "--sample", "0"],
            "--sample",
        ),
        (
            vec!["capacity", "--trace", "X", "--sample", "2"],
            "--sample",
        ),
        (vec!["capacity"], "--trace"),
        (vec!["capacity", "/nonexistent/log"], "opening recording"),
        (vec!["capacity", "--trace", &bad_only], "no usable request"),
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // A trace with a bad line: the line is skipped, named, and counted;
    // the good ones count.
    let t = tmp.path().join("t.jsonl");
    std::fs::write(
        &t,
        "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 2, \"hash_ids\": [1, 2, 3]}\n\
         {\"timestamp\": 1, \"input_length\": \"many\"}\n\
         {\"timestamp\": 2, \"input_length\": 1100, \"output_length\": 2, \"hash_ids\": [1, 2, 9]}\n",
    )
    .unwrap();
    let out = bin()
        .args(["capacity", "--json", "--trace"])
        .arg(&t)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let v = json(&out);
    assert!(err.contains("line 2"), "{err}");
    assert_eq!(v["skipped_lines"], 1);
    assert_eq!(v["requests"], 2);
    // 1100 tokens: two full blocks, both matchable; the second request
    // hits both at 1K tokens and above.
    assert_eq!(v["ceiling"].as_f64().unwrap(), 1024.0 / 2200.0);
}
