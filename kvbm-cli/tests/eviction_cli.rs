//! `--eviction` on the command line: a policy per tier changes which
//! blocks the host evicts (and so what `compare` finds), the recording
//! says which policy ran, and a setting that does not read is refused
//! naming what was wrong.

mod common;
use common::recorder;

#[test]
fn a_policy_per_tier_runs_shows_in_the_recording_and_changes_the_evictions() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, eviction: &str| {
        let out = dir.path().join(name).display().to_string();
        let o = recorder(&[
            "record",
            "--out",
            &out,
            "--requests",
            "200",
            "--seed",
            "4",
            "--device-capacity-tokens",
            "4096",
            "--host-capacity-tokens",
            "8192",
            "--shared-prefix-ratio",
            "0.7",
            "--eviction",
            eviction,
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        out
    };
    let (lru, s3) = (run("lru", "lru"), run("s3fifo", "G2=s3fifo"));
    let inspect = recorder(&["inspect", &s3]);
    let said = String::from_utf8_lossy(&inspect.stdout);
    assert!(said.contains("G2 8,192 tokens s3fifo"), "{said}");
    let said = String::from_utf8_lossy(&recorder(&["inspect", &lru]).stdout).to_string();
    assert!(
        said.contains("runs as") && !said.contains("s3fifo"),
        "{said}"
    );
    // The same requests; the host's victims differ.
    let c = recorder(&[
        "compare",
        &lru,
        &s3,
        "--expect",
        "requests == base",
        "--json",
    ]);
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
    let d = recorder(&["diff", &lru, &s3]);
    let said = String::from_utf8_lossy(&d.stdout);
    assert!(
        !d.status.success() && said.contains("BlockEvicted"),
        "{said}"
    );

    for (bad, why) in [
        ("G4=lru", "unknown tier"),
        ("G2=mru", "unknown cache policy `mru`"),
        ("G2=lfu,host=arc", "given twice"),
    ] {
        let o = recorder(&["record", "--out", "/nonexistent/x", "--eviction", bad]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(why) && !err.contains("panicked"),
            "{bad}: {err}"
        );
    }
}
