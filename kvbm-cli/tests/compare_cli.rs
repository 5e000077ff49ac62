//! End to end: `kvbm-recorder compare` on two real recordings of the
//! simulator, the second with its host tier halved and its device tier
//! smaller: the table, the JSON, gates that pass and fail (exit 1, each
//! named with its values), the JUnit file, and gates that do not read.

mod common;
use common::recorder;
use std::path::Path;
use std::process::Output;

fn ok(args: &[&str]) -> Output {
    let out = recorder(args);
    assert!(
        out.status.success(),
        "{args:?}: exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn record(dir: &Path, device: &str, host: &str) {
    ok(&[
        "record",
        "--out",
        dir.to_str().unwrap(),
        "--requests",
        "40",
        "--rate",
        "40",
        "--shared-prefix-ratio",
        "0.8",
        "--shared-prefixes",
        "4",
        "--seed",
        "7",
        "--device-capacity-tokens",
        device,
        "--host-capacity-tokens",
        host,
    ]);
}

#[test]
fn compare_gates_a_smaller_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, new) = (tmp.path().join("base"), tmp.path().join("new"));
    record(&base, "65536", "65536");
    record(&new, "8192", "32768");
    let (b, n) = (base.to_str().unwrap(), new.to_str().unwrap());

    // Equal to itself: every gate against its own base holds.
    let o = ok(&[
        "compare",
        b,
        b,
        "--expect",
        "hit_ratio >= base",
        "--expect",
        "evictions.G1 <= base",
    ]);
    assert!(text(&o).contains("gates: 2 of 2 passed"), "{}", text(&o));

    let junit = tmp.path().join("gates.xml");
    let o = recorder(&[
        "compare",
        b,
        n,
        "--expect",
        "requests == base",
        "--expect",
        "evictions.G1 <= base",
        "--junit",
        junit.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("gates: 1 of 2 passed"), "{t}");
    assert!(
        t.contains("gate failed: FAILED: evictions.G1 = ") && t.contains("(base 0), wanted <= 0"),
        "{t}"
    );
    for row in [
        "hit_ratio.G1",
        "ttft_p99_ms",
        "transfer_bytes.G1->G2",
        "preemptions",
    ] {
        assert!(t.contains(row), "{row}: {t}");
    }
    let xml = std::fs::read_to_string(&junit).unwrap();
    assert!(
        xml.contains(r#"<testsuites tests="2" failures="1">"#),
        "{xml}"
    );
    assert!(
        xml.contains(r#"<testcase classname="kvbm.compare" name="requests == base"/>"#),
        "{xml}"
    );
    assert!(
        xml.contains(r#"name="evictions.G1 &lt;= base">"#) && xml.contains("<failure message="),
        "{xml}"
    );

    let o = recorder(&["compare", b, n, "--json", "--expect", "hit_ratio.G1 < base"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["base"]["metrics"]["requests"], 40.0);
    assert_eq!(v["base"]["check_exit"], 0);
    assert!(v["new"]["summary"]["evictions"]["G1"].as_u64().unwrap() > 0);
    assert!(v["deltas"]["hit_ratio.G1"].as_f64().unwrap() < 0.0, "{v}");
    assert_eq!(v["gates"][0]["passed"], true);

    // Gates that do not read, or name nothing: refused, saying which.
    for (gate, says) in [
        ("hit_ratio 0.5", "expected METRIC OP VALUE"),
        ("hit_ratio >= fast", "'fast' is not a number"),
        ("hit_rate >= 0.5", "no metric 'hit_rate'"),
    ] {
        let o = recorder(&["compare", b, n, "--expect", gate]);
        assert!(
            !o.status.success() && o.status.code() != Some(1),
            "{gate}: {}",
            text(&o)
        );
        assert!(text(&o).contains(says), "{gate}: {}", text(&o));
        assert!(!text(&o).contains("panicked"), "{}", text(&o));
    }
}
