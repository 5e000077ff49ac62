//! End to end: the real `kvbm-recorder` binary records a simulated run,
//! reads it back every way it offers, and survives being killed.

use kvbm_events::{Direction, Event, EventKind};
use kvbm_recorder::log::{LogConfig, LogWriter};
use kvbm_recorder::recorder;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
}

fn record(dir: &std::path::Path, seed: &str) {
    let out = bin()
        .args(["record", "--out"])
        .arg(dir)
        .args(["--requests", "25", "--seed", seed])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// (count, max) of a series.
#[derive(Debug, Default, PartialEq)]
struct Series(u64, u64);

impl Series {
    fn add(&mut self, v: u64) {
        self.0 += 1;
        self.1 = self.1.max(v);
    }
}

/// What [`stats_agree_with_a_count_by_hand`] counts straight from the
/// events, to hold `stats --json` against.
struct HandCount<'a> {
    requests: std::collections::BTreeSet<&'a str>,
    finished: u64,
    ttft: Series,
    in_state: std::collections::BTreeMap<&'static str, Series>,
    latency: std::collections::BTreeMap<String, Series>,
    /// direction -> [completed, skipped, cancelled, failed]
    ends: std::collections::BTreeMap<String, [u64; 4]>,
    batches: std::collections::BTreeMap<String, Series>,
    batches_all: Series,
    /// Transfers planned and never ended, by direction.
    in_flight: std::collections::BTreeMap<String, u64>,
}

impl<'a> HandCount<'a> {
    fn of(events: &'a [Event]) -> Self {
        use kvbm_events::slot::SlotState;
        use std::collections::{BTreeMap, BTreeSet, HashMap};
        let mut requests = BTreeSet::new();
        let mut finished = 0;
        let mut entered: HashMap<&str, u64> = HashMap::new();
        let mut created: HashMap<&str, u64> = HashMap::new();
        let mut ttft = Series::default();
        let mut in_state: BTreeMap<&str, Series> = BTreeMap::new();
        let mut planned: HashMap<u64, (String, u64)> = HashMap::new();
        let mut latency: BTreeMap<String, Series> = BTreeMap::new();
        // direction -> [completed, skipped, cancelled, failed]
        let mut ends: BTreeMap<String, [u64; 4]> = BTreeMap::new();
        let mut batches: BTreeMap<String, Series> = BTreeMap::new();
        let mut batches_all = Series::default();
        for e in events {
            let req = e.request.as_deref();
            if let Some(r) = req {
                requests.insert(r);
            }
            // (transfer, direction, which end) when this event ends one.
            let mut ended: Option<(u64, &kvbm_events::Direction, usize)> = None;
            match &e.kind {
                EventKind::SlotCreated { .. } => {
                    created.insert(req.unwrap(), e.ts_ns);
                    entered.insert(req.unwrap(), e.ts_ns);
                }
                EventKind::SlotTransition { from, to } => {
                    let since = entered.insert(req.unwrap(), e.ts_ns).unwrap();
                    in_state
                        .entry(from.name())
                        .or_default()
                        .add(e.ts_ns - since);
                    if *to == SlotState::Finished {
                        finished += 1;
                    }
                }
                EventKind::TokensScheduled { decode, .. } if *decode > 0 => {
                    if let Some(t0) = created.remove(req.unwrap()) {
                        ttft.add(e.ts_ns - t0);
                    }
                }
                EventKind::TransferPlanned {
                    transfer,
                    direction,
                    ..
                } => {
                    planned.insert(*transfer, (direction.to_string(), e.ts_ns));
                }
                EventKind::TransferCompleted {
                    transfer,
                    direction,
                    ..
                } => {
                    let (d, t0) = planned[transfer].clone();
                    latency.entry(d).or_default().add(e.ts_ns - t0);
                    ended = Some((*transfer, direction, 0));
                }
                EventKind::TransferSkipped {
                    transfer,
                    direction,
                    ..
                } => ended = Some((*transfer, direction, 1)),
                EventKind::TransferCancelled {
                    transfer,
                    direction,
                } => ended = Some((*transfer, direction, 2)),
                EventKind::TransferFailed {
                    transfer,
                    direction,
                    ..
                } => ended = Some((*transfer, direction, 3)),
                EventKind::BatchDispatched {
                    direction, blocks, ..
                } => {
                    batches
                        .entry(direction.to_string())
                        .or_default()
                        .add(u64::from(*blocks));
                    batches_all.add(u64::from(*blocks));
                }
                _ => {}
            }
            if let Some((transfer, direction, i)) = ended {
                planned.remove(&transfer);
                ends.entry(direction.to_string()).or_default()[i] += 1;
            }
        }
        let mut in_flight: BTreeMap<String, u64> = BTreeMap::new();
        for (d, _) in planned.values() {
            *in_flight.entry(d.clone()).or_default() += 1;
        }
        HandCount {
            requests,
            finished,
            ttft,
            in_state,
            latency,
            ends,
            batches,
            batches_all,
            in_flight,
        }
    }
}

/// `stats --json` against figures counted here straight from the events,
/// without the recorder's analyses: requests and finished slots, the time
/// range, and for TTFT, time in each state, transfer latency and batch
/// sizes the count and the maximum (exact in the output; only percentiles
/// are bucketed); and how the transfers of each direction ended.
fn stats_agree_with_a_count_by_hand(s: &serde_json::Value, events: &[Event]) {
    let got =
        |p: &serde_json::Value| Series(p["count"].as_u64().unwrap(), p["max"].as_u64().unwrap());
    let HandCount {
        requests,
        finished,
        ttft,
        in_state,
        latency,
        ends,
        batches,
        batches_all,
        in_flight,
    } = HandCount::of(events);

    assert_eq!(s["events"], events.len() as u64);
    assert_eq!(s["requests"], requests.len() as u64);
    assert_eq!(s["finished"], finished);
    let ts = events.iter().map(|e| e.ts_ns);
    assert_eq!(
        s["time_range_ns"],
        serde_json::json!([ts.clone().min(), ts.max()])
    );
    assert!(ttft.0 > 0, "no request produced a token");
    assert_eq!(got(&s["ttft_ns"]), ttft, "TTFT");
    let states = s["time_in_state_ns"].as_object().unwrap();
    assert_eq!(
        states.keys().map(String::as_str).collect::<Vec<_>>(),
        in_state.keys().copied().collect::<Vec<_>>()
    );
    for (state, want) in &in_state {
        assert_eq!(&got(&states[*state]), want, "time in {state}");
    }
    let lat = s["transfer_latency_ns"].as_object().unwrap();
    assert_eq!(lat.len(), latency.len());
    for (d, want) in &latency {
        assert_eq!(&got(&lat[d]), want, "latency {d}");
    }
    let outcomes = s["transfers"].as_object().unwrap();
    assert_eq!(outcomes.len(), ends.len().max(in_flight.len()));
    for (d, [completed, skipped, cancelled, failed]) in &ends {
        let o = &outcomes[d];
        assert_eq!(
            [
                &o["completed"],
                &o["skipped"],
                &o["cancelled"],
                &o["failed"],
                &o["in_flight"]
            ],
            [
                completed,
                skipped,
                cancelled,
                failed,
                in_flight.get(d).unwrap_or(&0)
            ],
            "transfers {d}"
        );
    }
    let b = s["batch_blocks"].as_object().unwrap();
    assert_eq!(b.len(), batches.len());
    for (d, want) in &batches {
        assert_eq!(&got(&b[d]), want, "batches {d}");
    }
    assert_eq!(got(&s["batch_blocks_all"]), batches_all);
}

#[test]
fn record_then_inspect_check_stats_export_replay_and_diff() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    record(&a, "1");
    record(&c, "2");
    // A copy diffs equal. (Two runs of one seed need not: transfer events
    // come from the pipelines' own tasks and interleave with the
    // scheduler's differently from run to run.)
    std::fs::create_dir(&b).unwrap();
    for e in std::fs::read_dir(&a).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, b.join(p.file_name().unwrap())).unwrap();
    }

    let out = bin().arg("inspect").arg(&a).arg("--json").output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["events"].as_u64().unwrap() > 100);
    assert_eq!(v["lost"], 0);
    assert_eq!(v["seq_gaps"], 0);
    assert_eq!(v["counts_by_kind"]["SlotCreated"], 25);

    let out = bin().arg("check").arg(&a).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    let out = bin().arg("stats").arg(&a).arg("--json").output().unwrap();
    assert!(out.status.success());
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let events = recorder::read_events(&a, |_| {}).unwrap().events;
    stats_agree_with_a_count_by_hand(&s, &events);

    let trace = tmp.path().join("t.json");
    let out = bin()
        .arg("export")
        .arg(&a)
        .args(["--format", "chrome", "--out"])
        .arg(&trace)
        .output()
        .unwrap();
    assert!(out.status.success());
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    assert!(t["traceEvents"].as_array().unwrap().len() > 25);

    let out = bin()
        .arg("export")
        .arg(&a)
        .args(["--format", "jsonl"])
        .output()
        .unwrap();
    let lines = String::from_utf8_lossy(&out.stdout).lines().count() as u64;
    assert_eq!(lines, v["events"].as_u64().unwrap());

    let out = bin().arg("replay").arg(&a).output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("inconsistencies 0"));

    // Equal logs: no divergence; another seed: one.
    assert_eq!(
        bin().arg("diff").arg(&a).arg(&b).status().unwrap().code(),
        Some(0)
    );
    let out = bin().arg("diff").arg(&a).arg(&c).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(!out.stdout.is_empty());

    // A damaged log is reported with its offset, exit 2.
    let seg = std::fs::read_dir(&a)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "kvlog"))
        .unwrap();
    let mut bytes = std::fs::read(&seg).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&seg, bytes).unwrap();
    let out = bin().arg("check").arg(&a).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let msg = String::from_utf8_lossy(&out.stdout);
    assert!(msg.contains("byte offset"), "{msg}");
}

/// What a stopped writer left on disk, read here from the bytes by the
/// format the log documents (segment header, then frames of a 48-byte
/// header and a body, CRC-32C over both), independently of the log's own
/// reader and recovery.
#[cfg(unix)]
#[derive(Debug, PartialEq)]
struct OnDisk {
    /// Every complete, checksummed frame in log order: (first seq, last
    /// seq, event count).
    frames: Vec<(u64, u64, u64)>,
    /// Bytes after the last complete frame of the last segment (a torn
    /// tail), or the whole last file when it is shorter than its header.
    torn_bytes: u64,
    /// Whether those bytes start a frame after at least one complete one
    /// in the same segment: the writer died inside a frame.
    torn_inside_a_frame: bool,
    /// Bytes of every segment together.
    bytes: u64,
}

#[cfg(unix)]
fn on_disk(dir: &std::path::Path) -> OnDisk {
    const HEADER: usize = 64;
    const FRAME: usize = 48;
    let mut segments: Vec<_> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "kvlog"))
                .collect()
        })
        .unwrap_or_default();
    segments.sort();
    let mut d = OnDisk {
        frames: Vec::new(),
        torn_bytes: 0,
        torn_inside_a_frame: false,
        bytes: 0,
    };
    let last = segments.len().saturating_sub(1);
    for (i, path) in segments.iter().enumerate() {
        let b = std::fs::read(path).unwrap();
        d.bytes += b.len() as u64;
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        if b.len() < HEADER {
            assert_eq!(
                i,
                last,
                "{}: a short segment before the last",
                path.display()
            );
            d.torn_bytes = b.len() as u64;
            break;
        }
        assert_eq!(&b[..8], b"KVBMLOG\0", "{}", path.display());
        let (mut off, mut in_segment) = (HEADER, 0);
        let torn = loop {
            if off == b.len() {
                break None;
            }
            if off + FRAME > b.len() {
                break Some(off);
            }
            let n = u32_at(off) as usize;
            if off + FRAME + n > b.len() {
                break Some(off);
            }
            let crc = crc32c::crc32c(&b[off..off + 4]);
            let crc = crc32c::crc32c_append(crc, &b[off + 8..off + FRAME + n]);
            if crc != u32_at(off + 4) {
                break Some(off);
            }
            let count = u64::from(u16::from_le_bytes([b[off + 44], b[off + 45]]));
            d.frames.push((u64_at(off + 8), u64_at(off + 16), count));
            in_segment += 1;
            off += FRAME + n;
        };
        if let Some(at) = torn {
            assert_eq!(
                i,
                last,
                "{}: damage at byte {at} of a sealed segment",
                path.display()
            );
            d.torn_bytes = (b.len() - at) as u64;
            d.torn_inside_a_frame = in_segment > 0;
        }
    }
    d
}

/// Sends `sig` to `child`.
#[cfg(unix)]
fn signal(child: &std::process::Child, sig: libc::c_int) {
    // SAFETY: kill(2) on our own child, which has not been reaped yet.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({sig}): {}", std::io::Error::last_os_error());
}

/// Stops `child` (SIGSTOP) and waits until it is stopped; fails if it
/// exited instead, i.e. finished before it could be killed.
#[cfg(unix)]
fn stop(child: &std::process::Child, trial: usize) {
    signal(child, libc::SIGSTOP);
    let mut status = 0;
    // SAFETY: waitpid(2) on our own child; WUNTRACED reports the stop
    // without reaping it.
    let rc = unsafe { libc::waitpid(child.id() as libc::pid_t, &mut status, libc::WUNTRACED) };
    assert_eq!(rc, child.id() as libc::pid_t, "waitpid");
    assert!(
        libc::WIFSTOPPED(status),
        "trial {trial}: the recorder exited (status {status:#x}) before it could be killed"
    );
}

/// Kill -9 a `record` that is still writing, 20 times; every trial must
/// leave a log that reopens cleanly holding a gapless prefix of the run's
/// events (seq 0, 1, 2, ...), namely every event the writer had handed to
/// the OS, nothing more, and that can be appended to again.
///
/// Each trial waits until the log grows (the writer is writing), stops the
/// process (SIGSTOP), reads what it left on disk by the documented format
/// (see [`on_disk`]), then kills it (SIGKILL) and checks that it died of
/// that signal, not of having finished. Ten trials run with `--fsync every`,
/// where each event is synced before the next is appended, so what is on
/// disk is everything up to the last sync (small segments, so rotations
/// are among the moments hit). Ten run with `--fsync never`, where the
/// write buffer hands blocks to the OS in pieces: those trials kill only
/// at a moment when the last segment ends inside a frame, so each of them
/// recovers a real torn tail, which must be cut exactly.
#[cfg(unix)]
#[test]
fn kill_dash_nine_while_writing_leaves_a_gapless_prefix_of_what_was_written() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut torn, mut events_recovered) = (0, 0u64);
    for trial in 0..20 {
        let torn_trial = trial >= 10;
        let dir = tmp.path().join(format!("k{trial}"));
        let mut cmd = bin();
        cmd.args(["record", "--out"])
            .arg(&dir)
            // Far more than a trial lets it write.
            .args(["--requests", "20000", "--seed", &trial.to_string()]);
        if torn_trial {
            // A write buffer a few frames long fills between the
            // recorder's flushes whatever the machine's load, and each time
            // it hands the OS the frames before and the header of the one
            // that did not fit: a log that ends inside a frame.
            cmd.args(["--fsync", "never", "--write-buffer-bytes", "32768"]);
        } else {
            cmd.args(["--fsync", "every", "--segment-bytes", "2048"]);
        }
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t = std::time::Instant::now();
        let give_up = Duration::from_secs(30);
        // Some events written, then a random moment.
        while on_disk(&dir).frames.is_empty() {
            assert!(t.elapsed() < give_up, "trial {trial}: nothing written");
            assert!(child.try_wait().unwrap().is_none(), "trial {trial}: exited");
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(next() % 300));
        let left = loop {
            // Stop it right after it wrote something.
            let before = on_disk(&dir).bytes;
            while on_disk(&dir).bytes == before {
                assert!(
                    t.elapsed() < give_up,
                    "trial {trial}: the log stopped growing"
                );
                assert!(
                    child.try_wait().unwrap().is_none(),
                    "trial {trial}: the recorder finished before it could be killed"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            stop(&child, trial);
            let left = on_disk(&dir);
            if !torn_trial || left.torn_inside_a_frame {
                break left;
            }
            assert!(
                t.elapsed() < give_up,
                "trial {trial}: the log never ended inside a frame when stopped"
            );
            signal(&child, libc::SIGCONT);
        };
        child.kill().unwrap(); // SIGKILL, to a stopped process
        let status = child.wait().unwrap();
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "trial {trial}: {status:?}"
        );
        assert_eq!(on_disk(&dir), left, "trial {trial}: the files changed");

        // What it left: complete frames of consecutive seqs from 0.
        let mut expect_next = 0;
        for &(first, last, count) in &left.frames {
            assert_eq!(
                first, expect_next,
                "trial {trial}: frames {:?}",
                left.frames
            );
            assert_eq!(last - first + 1, count, "trial {trial}");
            expect_next = last + 1;
        }
        assert!(expect_next > 0, "trial {trial}");
        if torn_trial {
            assert!(left.torn_inside_a_frame && left.torn_bytes > 0);
            torn += 1;
        }

        // Read back: exactly those events, gapless, no damage.
        let read = recorder::read_events(&dir, |_| {}).expect("the log opens");
        assert!(read.damage.is_none(), "trial {trial}: {:?}", read.damage);
        let seqs: Vec<u64> = read.events.iter().map(|e| e.seq).collect();
        assert!(
            seqs.iter().copied().eq(0..expect_next),
            "trial {trial}: read {} events, seqs {:?}..{:?}; {expect_next} were on disk",
            seqs.len(),
            seqs.first(),
            seqs.last()
        );
        let info = recorder::open_log(&dir).unwrap().info().clone();
        assert_eq!(
            info.torn_tail_bytes, left.torn_bytes,
            "trial {trial}: the reader's torn tail"
        );
        events_recovered += expect_next;
        eprintln!(
            "trial {trial} (--fsync {}): killed after {:.2?} with {expect_next} events in {} \
             frames on disk, torn tail {} bytes",
            if torn_trial { "never" } else { "every" },
            t.elapsed(),
            left.frames.len(),
            left.torn_bytes
        );

        // The writer recovers it (cutting the torn tail) and goes on.
        append_after_recovery(&dir, trial, &read, expect_next);
    }
    eprintln!(
        "20 recorders killed while writing; {events_recovered} events recovered in all, \
         {torn} torn tails cut"
    );
    assert_eq!(torn, 10);
}

/// Reopens for appending the log a killed recorder left in `dir` (whose
/// events `read` read back, `expect_next` of them) and appends one event:
/// the writer cuts any torn tail, and what was there stays, followed by
/// the new event exactly as appended.
fn append_after_recovery(
    dir: &std::path::Path,
    trial: usize,
    read: &recorder::EventsRead,
    expect_next: u64,
) {
    let mut w = LogWriter::open_append(
        dir,
        LogConfig {
            schema_version: kvbm_recorder::SCHEMA_VERSION,
            ..LogConfig::default()
        },
    )
    .unwrap_or_else(|e| panic!("trial {trial}: {e}"));
    let after = Event {
        engine: read.events.last().map_or(0, |e| e.engine),
        seq: expect_next,
        ts_ns: u64::MAX / 2,
        iteration: read.events.last().map_or(0, |e| e.iteration + 1),
        request: Some(Arc::from("after-the-crash")),
        kind: EventKind::TransferSkipped {
            transfer: expect_next,
            direction: Direction::HOST_TO_DISK,
            reason: "after the crash".into(),
        },
    };
    w.append(&after).unwrap();
    w.close().unwrap();
    let again = recorder::open_log(dir).unwrap().info().clone();
    assert_eq!(again.last_seq, Some(expect_next));
    assert_eq!(again.torn_tail_bytes, 0);
    // Everything read before the append is still there, then the new
    // event, exactly as appended.
    let reread = recorder::read_events(dir, |_| {}).expect("the log opens");
    assert!(
        reread.damage.is_none(),
        "trial {trial}: {:?}",
        reread.damage
    );
    assert_eq!(reread.events.len(), read.events.len() + 1, "trial {trial}");
    assert_eq!(reread.events[..read.events.len()], read.events[..]);
    assert_eq!(reread.events.last(), Some(&after), "trial {trial}");
}

/// Every seconds option of `record` and `bridge` refuses what no deadline
/// holds, naming the option: each of these panicked where it became a
/// `Duration` (clap took them as numbers, nothing checked the range).
#[test]
fn seconds_no_deadline_holds_are_refused_by_name_not_a_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("never");
    let out = out.to_str().unwrap();
    let nats = ["record", "--from", "nats://127.0.0.1:1", "--out", out];
    let bridge = [
        "bridge",
        "--from",
        "zmq://127.0.0.1:1",
        "--engine-id",
        "a",
        "--to",
        "nats://127.0.0.1:1",
    ];
    for (base, flag, value) in [
        (&nats[..], "--duration-s", "-1"),
        (&nats[..], "--idle-exit-s", "-1"),
        (&nats[..], "--idle-exit-s", "1e300"),
        (&nats[..], "--close-idle-logs-s", "nan"),
        (&bridge[..], "--duration-s", "1e300"),
        (&bridge[..], "--drain-s", "inf"),
    ] {
        let o = bin()
            .args(base)
            .arg(format!("{flag}={value}"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{flag}={value}: {err}");
        assert!(!err.contains("panicked"), "{flag}={value}: {err}");
        assert!(
            err.contains(flag) && err.contains("seconds"),
            "{flag}={value}: {err}"
        );
    }
    assert!(
        !std::path::Path::new(out).exists(),
        "nothing is created for a refused command"
    );
}
