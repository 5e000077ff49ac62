//! What the engine runs as, in a recording: `RecorderConfig::info` lands
//! in the sidecar as `engine_info` from its first write, and the real
//! `kvbm-recorder inspect` shows its `summary` line (and `--json` the
//! whole object), for a recording killed early as for a finished one; a
//! recording without it says nothing about it.

use kvbm_events::tier::Tier;
use kvbm_events::{Event, EventKind};
use kvbm_recorder::recorder::{RecorderConfig, RecordingSink};
use std::path::Path;
use std::process::{Command, Output};

use kvbm_testkit::data::{ENGINE_SUMMARY as SUMMARY, engine_info as info};

fn gauge_at(seq: u64) -> Event {
    Event {
        engine: 0,
        seq,
        ts_ns: seq,
        iteration: 0,
        request: None,
        kind: EventKind::PoolGauge {
            tier: Tier::Host,
            capacity: 1,
            active: 0,
            inactive: 0,
            empty: 1,
        },
    }
}

fn inspect(dir: &Path, json: bool) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"));
    c.arg("inspect").arg(dir);
    if json {
        c.arg("--json");
    }
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn text(dir: &Path) -> String {
    String::from_utf8(inspect(dir, false).stdout).unwrap()
}

fn json(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&inspect(dir, true).stdout).unwrap()
}

#[test]
fn inspect_says_what_the_engine_ran_as_killed_early_or_finished() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("log");
    let cfg = RecorderConfig {
        info: Some(info()),
        ..RecorderConfig::default()
    };
    let mut sink = RecordingSink::create(&dir, &cfg).unwrap();
    for seq in 0..5 {
        sink.append(&gauge_at(seq)).unwrap();
    }
    sink.checkpoint().unwrap();
    // A recorder killed here: nothing more is written.
    std::mem::forget(sink);
    let t = text(&dir);
    assert!(t.contains(&format!("runs as       {SUMMARY}\n")), "{t}");
    let v = json(&dir);
    assert_eq!(v["engine_info"], info(), "{v}");
    assert_eq!(v["ended"]["how"], "unfinished", "{v}");

    // Finished: the same.
    let sink = RecordingSink::resume(&dir, &RecorderConfig::default()).unwrap();
    sink.finish().unwrap();
    assert!(text(&dir).contains(SUMMARY));
    assert_eq!(json(&dir)["engine_info"], info());

    // Without a description: no line, and null in JSON.
    let plain = tmp.path().join("plain");
    let mut sink = RecordingSink::create(&plain, &RecorderConfig::default()).unwrap();
    sink.append(&gauge_at(0)).unwrap();
    sink.finish().unwrap();
    let t = text(&plain);
    assert!(!t.contains("runs as"), "{t}");
    assert!(json(&plain)["engine_info"].is_null());
}
