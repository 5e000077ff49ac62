//! The real `kvbm-recorder` binary given recordings that are damaged,
//! edited or not recordings at all, and output paths that would harm what
//! it reads: each is said, naming what is wrong; what is good is still
//! read; nothing it reads is written over.

use kvbm_attach::nats::wire::BatchHeader;
use kvbm_events::{Event, EventKind, Tier};
use kvbm_recorder::fleet::FleetWriter;
use kvbm_recorder::log::LogConfig;
use kvbm_recorder::recorder::{RecorderConfig, RecordingSink};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
}

fn run(args: &[&str], path: &Path) -> Output {
    let out = bin().args(args).arg(path).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    out
}

/// `export --format jsonl LOG --out OUT`.
fn export_to(log: &Path, out: &Path) -> Output {
    bin()
        .args(["export", "--format", "jsonl"])
        .arg(log)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ev(seq: u64) -> Event {
    Event {
        engine: 3,
        seq,
        ts_ns: seq * 1_000,
        iteration: seq / 10,
        request: None,
        kind: EventKind::PoolGauge {
            tier: Tier::Host,
            capacity: 64,
            active: (seq % 7) as u32,
            inactive: 1,
            empty: 2,
        },
    }
}

/// Small blocks and segments, so a few thousand events span several.
fn small() -> RecorderConfig {
    RecorderConfig {
        log: LogConfig {
            segment_bytes: 16 << 10,
            block_bytes: 2 << 10,
            ..LogConfig::default()
        },
        ..RecorderConfig::default()
    }
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut s: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kvlog"))
        .collect();
    s.sort();
    s
}

/// A finished single-engine recording of `n` events.
fn log_of(dir: &Path, n: u64) {
    let mut sink = RecordingSink::create(dir, &small()).unwrap();
    for s in 0..n {
        sink.append(&ev(s)).unwrap();
    }
    sink.finish().unwrap();
}

/// A finished fleet recording of engines `a`, `b` and `c`, `n` events each.
fn fleet_of(dir: &Path, n: u64) {
    let mut w = FleetWriter::open(dir, "nats://127.0.0.1:1", Some("c"), small()).unwrap();
    for engine in ["a", "b", "c"] {
        for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
            let events: Vec<Event> = chunk.iter().map(|&s| ev(s)).collect();
            let h = BatchHeader {
                run: 7,
                first_seq: chunk[0],
                last_seq: *chunk.last().unwrap(),
                count: chunk.len() as u32,
                dropped_before: 0,
            };
            w.apply(engine, &h, &events).unwrap();
        }
    }
    w.finish().unwrap();
}

/// A log missing a segment from its middle reads without damage, but its
/// finished sidecar counts more: every command that works on what is
/// there says so on stderr and exits 2; `check` places the loss inside
/// the log, not at its end.
#[test]
fn a_segment_removed_from_the_middle_is_said_by_every_reader() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    log_of(&dir, 20_000);
    let segs = segments(&dir);
    assert!(segs.len() >= 3, "{segs:?}");
    std::fs::remove_file(&segs[1]).unwrap();

    let o = run(&["check"], &dir);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("missing from within it"), "{}", text(&o));
    for args in [
        &["stats"][..],
        &["stats", "--json"],
        &["replay"],
        &["capacity"],
    ] {
        let o = run(args, &dir);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("warning:") && err.contains("missing"),
            "{args:?}: {err}"
        );
    }
    let out = tmp.path().join("x.jsonl");
    let o = export_to(&dir, &out);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let lines = std::fs::read_to_string(&out).unwrap().lines().count();
    assert!(lines > 0 && lines < 20_000, "{lines}");
    // `diff` compares what is there, and says it compared part of one.
    let other = tmp.path().join("whole");
    log_of(&other, 20_000);
    let o = bin().arg("diff").arg(&other).arg(&dir).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    // `compare` too, its gates passing or not: damage decides.
    let o = bin()
        .arg("compare")
        .arg(&other)
        .arg(&dir)
        .args(["--expect", "requests >= 0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("check (new):  damaged log"),
        "{}",
        text(&o)
    );
}

/// `export --out` (and `capacity --svg`) into the recording being read is
/// refused before anything is written, its files left as they were.
#[test]
fn an_output_inside_the_recording_is_refused_and_nothing_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    log_of(&dir, 500);
    let before: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.clone(), std::fs::read(&p).unwrap()))
        .collect();
    let seg = segments(&dir)[0].clone();
    for out in [
        seg.clone(),
        dir.join("recording.json"),
        dir.join("new.jsonl"),
        dir.join("..").join("r").join("x"),
    ] {
        let o = export_to(&dir, &out);
        assert_eq!(o.status.code(), Some(2), "{out:?}: {}", text(&o));
        assert!(text(&o).contains("is inside the recording"), "{}", text(&o));
    }
    let o = bin()
        .arg("capacity")
        .arg(&dir)
        .arg("--svg")
        .arg(dir.join("c.svg"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    for (p, bytes) in &before {
        assert_eq!(&std::fs::read(p).unwrap(), bytes, "{p:?} changed");
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), before.len());
    // Beside it is fine.
    let o = export_to(&dir, &tmp.path().join("r.jsonl"));
    assert!(o.status.success(), "{}", text(&o));
}

/// Directories that are not recordings are said to be so, by every
/// reading command, instead of read as a log of no events; `record`
/// refuses to write a new recording among other files.
#[test]
fn what_is_not_a_recording_is_refused_naming_why() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(empty.join("notes.txt"), "hello").unwrap();
    let fleet = tmp.path().join("fleet");
    fleet_of(&fleet, 300);
    for cmd in ["inspect", "check", "stats", "export", "replay", "capacity"] {
        let cmd: &[&str] = if cmd == "export" {
            &["export", "--format", "jsonl"]
        } else {
            &[cmd]
        };
        let o = run(cmd, &empty);
        assert_eq!(o.status.code(), Some(2), "{cmd:?}: {}", text(&o));
        assert!(
            text(&o).contains("holds no kvbm recording"),
            "{cmd:?}: {}",
            text(&o)
        );
        let o = run(cmd, &empty.join("notes.txt"));
        assert!(
            text(&o).contains("is not a directory"),
            "{cmd:?}: {}",
            text(&o)
        );
    }
    // Commands that read one log name the way to one engine's.
    let o = run(&["replay"], &fleet);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("engines/<engine>"), "{}", text(&o));
    let o = bin().arg("diff").arg(&fleet).arg(&fleet).output().unwrap();
    assert!(text(&o).contains("is a fleet recording"), "{}", text(&o));
    // A fleet whose manifest is gone is not an empty recording.
    std::fs::remove_file(fleet.join("fleet.json")).unwrap();
    let o = run(&["stats"], &fleet);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("no fleet.json"), "{}", text(&o));
    // `record` into a directory holding other files, or a recording.
    for out in [&empty, &fleet] {
        let o = bin()
            .args(["record", "--requests", "2", "--out"])
            .arg(out)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains("a new recording needs a new or empty directory"));
    }
    assert!(segments(&empty).is_empty());
}

/// A fleet recording with one engine's log damaged and another's gone:
/// `inspect` shows every engine, the damaged one as damaged, the missing
/// one as unreadable, exit 2; `check` checks the rest; `stats` and
/// `export` give what is readable and warn, exit 2. JSON lines keep each
/// engine's own seqs and name it.
#[test]
fn a_fleet_with_a_damaged_and_a_missing_engine_still_reads_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("fleet");
    fleet_of(&dir, 3_000);
    let whole = run(&["inspect", "--json"], &dir);
    assert!(whole.status.success(), "{}", text(&whole));

    // Engine a: a byte flipped mid-log.
    let a = dir.join("engines/a");
    let seg = segments(&a)[1].clone();
    let mut bytes = std::fs::read(&seg).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    std::fs::write(&seg, bytes).unwrap();
    // Engine b: gone.
    std::fs::remove_dir_all(dir.join("engines/b")).unwrap();

    let o = run(&["inspect", "--json"], &dir);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let e = &v["engines"];
    assert!(e["a"]["damage"].is_string(), "{v}");
    assert!(e["a"]["events"].as_u64().unwrap() < 3_000, "{v}");
    assert_eq!(e["a"]["events_written"], 3_000, "{v}");
    assert!(
        e["b"]["error"].as_str().unwrap().contains("cannot be read"),
        "{v}"
    );
    assert_eq!(e["c"]["events"], 3_000, "{v}");
    assert!(e["c"]["damage"].is_null(), "{v}");
    let o = run(&["inspect"], &dir);
    let t = text(&o);
    assert!(t.contains("damaged:") && t.contains("seq 0..=2999"), "{t}");
    assert!(!t.contains("Some("), "{t}");

    let o = run(&["check"], &dir);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let t = text(&o);
    assert!(
        t.contains("a: damaged log") && t.contains("b: cannot be read"),
        "{t}"
    );
    assert!(t.contains("c: ok: 3000 events"), "{t}");

    let o = run(&["stats", "--json"], &dir);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["engines"]["c"].is_object() && v["engines"]["b"].is_null(),
        "{v}"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("engine a:") && err.contains("engine b:"),
        "{err}"
    );

    let o = run(&["export", "--format", "jsonl"], &dir);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let mut per: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        per.entry(v["engine_name"].as_str().unwrap().to_string())
            .or_default()
            .push(v["seq"].as_u64().unwrap());
    }
    assert_eq!(per["c"], (0..3_000).collect::<Vec<_>>());
    assert!(!per["a"].is_empty() && per["a"].len() < 3_000);
    assert!(!per.contains_key("b"));
}

/// A manifest edited to name a log outside the recording is refused,
/// whatever reads it (and a recorder resuming it).
#[test]
fn a_manifest_naming_a_path_outside_the_recording_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("fleet");
    fleet_of(&dir, 200);
    let outside = tmp.path().join("elsewhere");
    log_of(&outside, 10);
    let path = dir.join("fleet.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let entry = m["logs"]["a"].clone();
    for name in ["../../elsewhere", "a.1", "a.02", "a/x", "zz"] {
        let mut m = m.clone();
        m["logs"][name] = entry.clone();
        std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
        for cmd in ["inspect", "check", "capacity"] {
            let o = run(&[cmd], &dir);
            assert_eq!(o.status.code(), Some(2), "{name} {cmd}: {}", text(&o));
            assert!(
                text(&o).contains("the manifest is damaged or was edited"),
                "{name} {cmd}: {}",
                text(&o)
            );
        }
        let e = FleetWriter::open(&dir, "nats://127.0.0.1:1", Some("c"), small()).unwrap_err();
        assert!(e.to_string().contains("damaged or was edited"), "{e}");
    }
    // The genuine names still read.
    m["logs"]["a.2"] = entry;
    m["logs"]["a.2"]["run"] = "8".into();
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    std::fs::create_dir_all(dir.join("engines/a.2")).unwrap();
    let o = run(&["check"], &dir);
    assert!(!text(&o).contains("edited"), "{}", text(&o));
}
