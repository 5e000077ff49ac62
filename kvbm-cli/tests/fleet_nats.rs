//! The fleet through a real `nats-server` (JetStream, file store):
//! simulated engines publish (`kvbm-sim --publish`), `kvbm-recorder record
//! --from nats://` records them all, and every engine's events arrive
//! exactly once — also while the recorder is killed with SIGKILL and
//! restarted twice and the server is restarted once. A publisher cut off
//! from NATS declares its drops and loses nothing sent after the outage.
//! Breakpoints, step and resume work through NATS request-reply.
//!
//! Needs `scripts/setup-nats.sh` (the test says so when the server is
//! missing). Bounded: a few thousand requests in all, each wait capped.

use kvbm_testkit::bin::workspace_bin;
use kvbm_testkit::nats::NatsServer;
use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// One test at a time: each runs eight engines, and on two cores they
/// would only slow each other down.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// What most tests here start with: their turn, a server of their own, a
/// temporary directory with the recording's path and the recorder's log's
/// in it, and both binaries built (so no wait for a build counts as a
/// recorder's idle time). Bound in this order, dropped in reverse: the
/// server stops before the next test's turn.
fn started() -> (
    std::sync::MutexGuard<'static, ()>,
    NatsServer,
    tempfile::TempDir,
    std::path::PathBuf,
    std::path::PathBuf,
) {
    let one = serial();
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("fleet");
    let rlog = tmp.path().join("recorder.log");
    let _ = (sim_bin(), recorder_bin());
    (one, nats, tmp, out, rlog)
}

fn sim_bin() -> std::path::PathBuf {
    workspace_bin("kvbm-sim", "kvbm-sim")
}

fn recorder_bin() -> std::path::PathBuf {
    workspace_bin("kvbm-cli", "kvbm-recorder")
}

fn spawn_sim(url: &str, name: &str, extra: &[&str], dir: &Path) -> Child {
    let out = std::fs::File::create(dir.join(format!("{name}.json"))).unwrap();
    let err = std::fs::File::create(dir.join(format!("{name}.err"))).unwrap();
    Command::new(sim_bin())
        .args(["--publish", url, "--engine-id", name, "--json"])
        .args(extra)
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("starting kvbm-sim")
}

fn spawn_recorder(url: &str, out: &Path, idle_s: &str, log: &Path) -> Child {
    spawn_recorder_with(url, out, idle_s, log, &[])
}

fn spawn_recorder_with(url: &str, out: &Path, idle_s: &str, log: &Path, extra: &[&str]) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    Command::new(recorder_bin())
        .args(["record", "--from", url, "--out"])
        .arg(out)
        .args(["--idle-exit-s", idle_s])
        .args(extra)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("starting kvbm-recorder")
}

/// Engines `names`, 20 requests each (seeds from `seed`), run at once
/// to their end: what each emitted.
fn small_engines(url: &str, names: &[&str], seed: usize, dir: &Path) -> Vec<(String, u64)> {
    let mut sims: Vec<Child> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let seed = (seed + i).to_string();
            spawn_sim(
                url,
                n,
                &["--requests", "20", "--rate", "40", "--seed", &seed],
                dir,
            )
        })
        .collect();
    let mut emitted = Vec::new();
    for (s, n) in sims.iter_mut().zip(names) {
        assert!(wait(s, n, Duration::from_secs(60)).success(), "{n} failed");
        emitted.push((n.to_string(), sim_result(dir, n).0));
    }
    emitted
}

/// Waits for `child` at most `limit`; kills it and fails past that.
fn wait(child: &mut Child, what: &str, limit: Duration) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            panic!("{what} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What a sim emitted and its publisher's counters. Every event goes
/// through the engine's tap (the breakpoints' last events come after the
/// report is taken), so what it emitted is what the tap took in plus what
/// the tap dropped; the report's own count must not exceed it.
fn sim_result(dir: &Path, name: &str) -> (u64, Value) {
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap())
            .unwrap();
    let err = std::fs::read_to_string(dir.join(format!("{name}.err"))).unwrap();
    let line = err
        .lines()
        .find_map(|l| l.strip_prefix("publisher "))
        .unwrap_or_else(|| panic!("{name}: no publisher line in its stderr:\n{err}"));
    let p: Value = serde_json::from_str(line).unwrap();
    let emitted = p["events_in"].as_u64().unwrap() + p["tap_dropped"].as_u64().unwrap();
    assert!(
        report["events_emitted"].as_u64().unwrap() <= emitted,
        "{name}: {report} {p}"
    );
    assert!(
        report["events_emitted"].as_u64().unwrap() > 1000,
        "{name}: {report}"
    );
    (emitted, p)
}

fn inspect(out: &Path) -> Value {
    let o = Command::new(recorder_bin())
        .args(["inspect", "--json"])
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Every engine's log holds exactly seqs 0..emitted, once each, and the
/// recording's own checks pass.
fn assert_exactly_once(out: &Path, emitted: &[(String, u64)], recorder_log: &Path) {
    let v = inspect(out);
    let engines = v["engines"].as_object().expect("engines in inspect --json");
    assert_eq!(
        engines.len(),
        emitted.len(),
        "{v}\nrecorder:\n{}",
        std::fs::read_to_string(recorder_log).unwrap_or_default()
    );
    for (name, n) in emitted {
        let e = &engines[name.as_str()];
        assert_eq!(e["events"].as_u64(), Some(*n), "{name}: {e}");
        assert_eq!(e["first_seq"].as_u64(), Some(0), "{name}: {e}");
        assert_eq!(e["last_seq"].as_u64(), Some(n - 1), "{name}: {e}");
        assert_eq!(e["losses"]["holes"].as_u64(), Some(0), "{name}: {e}");
        assert_eq!(e["losses"]["unexplained"].as_u64(), Some(0), "{name}: {e}");
        // Not only the counts: the log itself, seq by seq.
        let read =
            kvbm_recorder::recorder::read_events(&out.join("engines").join(name), |_| {}).unwrap();
        assert!(read.damage.is_none(), "{name}: {:?}", read.damage);
        let seqs: Vec<u64> = read.events.iter().map(|e| e.seq).collect();
        assert!(
            seqs.iter().copied().eq(0..*n),
            "{name}: the log's seqs are not exactly 0..{n}"
        );
    }
    let st = Command::new(recorder_bin())
        .arg("check")
        .arg(out)
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(0), "check of the fleet recording");
}

#[test]
fn eight_engines_arrive_exactly_once() {
    let (_one, nats, tmp, out, rlog) = started();
    let mut rec = spawn_recorder(&nats.url(), &out, "3", &rlog);
    let names: Vec<String> = (0..8).map(|i| format!("sim-{i}")).collect();
    let mut sims: Vec<Child> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let seed = (i + 1).to_string();
            spawn_sim(
                &nats.url(),
                n,
                &["--requests", "30", "--rate", "40", "--seed", &seed],
                tmp.path(),
            )
        })
        .collect();
    let mut emitted = Vec::new();
    for (s, n) in sims.iter_mut().zip(&names) {
        assert!(wait(s, n, Duration::from_secs(60)).success(), "{n} failed");
        let (events, publisher) = sim_result(tmp.path(), n);
        assert_eq!(
            publisher["events_sent"].as_u64(),
            Some(events),
            "{n}: {publisher}"
        );
        assert_eq!(publisher["dropped"].as_u64(), Some(0), "{n}: {publisher}");
        emitted.push((n.clone(), events));
    }
    assert!(wait(&mut rec, "the recorder", Duration::from_secs(60)).success());
    assert_exactly_once(&out, &emitted, &rlog);
    fleet_analyses(&out, &emitted);
    assert_cpu_split(&std::fs::read_to_string(&rlog).unwrap());
}

/// The recorder's `CPU:` line: every part it names was measured (the
/// receiving loop and the writer threads did work, so neither is zero)
/// and the parts fit in the process's own clock.
fn assert_cpu_split(log: &str) {
    let line = log
        .lines()
        .find(|l| l.trim_start().starts_with("CPU: "))
        .unwrap_or_else(|| panic!("no CPU line in the recorder's summary:\n{log}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let secs: Vec<f64> = (1..words.len())
        .filter(|&i| words[i] == "s")
        .filter_map(|i| words[i - 1].parse().ok())
        .collect();
    let [receiving, writing, syncing, elsewhere, all] = secs[..] else {
        panic!("five figures in seconds expected: {line}");
    };
    assert!(receiving > 0.0 && writing > 0.0, "{line}");
    // Each figure is rounded to 0.1 ms.
    let parts = receiving + writing + syncing + elsewhere;
    assert!((parts - all).abs() < 0.001, "{line}");
}

/// `--engines GLOB` records the engines whose names match and no other;
/// a glob that cannot name an engine is refused before anything starts.
#[test]
fn an_engine_glob_records_only_the_engines_it_names() {
    let (_one, nats, tmp, out, rlog) = started();
    let bad = Command::new(recorder_bin())
        .args(["record", "--from", &nats.url(), "--out"])
        .arg(tmp.path().join("never"))
        .args(["--engines", "keep.*"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("keep.*") && err.contains("glob"), "{err}");
    assert!(!tmp.path().join("never").exists());

    let mut rec = spawn_recorder_with(&nats.url(), &out, "3", &rlog, &["--engines", "keep-?"]);
    let names = ["keep-a", "skip-b", "keep-c", "keep-dd"];
    let emitted: Vec<_> = small_engines(&nats.url(), &names, 1, tmp.path())
        .into_iter()
        .filter(|(n, _)| n == "keep-a" || n == "keep-c")
        .collect();
    assert!(wait(&mut rec, "the recorder", Duration::from_secs(60)).success());
    // Exactly the two matching engines (not skip-b, not keep-dd), each
    // exactly once.
    assert_exactly_once(&out, &emitted, &rlog);
}

/// `--receive-only` (for measuring) counts every event the engines
/// published, through its own consumer, and keeps none: a recorder on its
/// own consumer afterwards still records each engine exactly once. It is
/// refused on a recorder's consumer or recording, and without a consumer
/// of its own.
#[test]
fn receive_only_counts_every_event_and_takes_none_from_a_recorder() {
    let _one = serial();
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let _ = (sim_bin(), recorder_bin());
    let names = ["ro-a", "ro-b"];
    let emitted = small_engines(&nats.url(), &names, 7, tmp.path());
    let total: u64 = emitted.iter().map(|e| e.1).sum();
    let record = |out: &Path, extra: &[&str]| {
        Command::new(recorder_bin())
            .args(["record", "--from", &nats.url(), "--out"])
            .arg(out)
            .args(["--idle-exit-s", "2"])
            .args(extra)
            .output()
            .unwrap()
    };
    let no_consumer = record(&tmp.path().join("never"), &["--receive-only"]);
    assert_eq!(no_consumer.status.code(), Some(2), "{no_consumer:?}");
    let recorders = record(
        &tmp.path().join("never"),
        &["--receive-only", "--consumer", "kvbm-recorder"],
    );
    assert!(!recorders.status.success(), "{recorders:?}");
    let err = String::from_utf8_lossy(&recorders.stderr);
    assert!(
        err.contains("--receive-only") && err.contains("--consumer"),
        "{err}"
    );
    assert!(!tmp.path().join("never").exists());

    let only = record(
        &tmp.path().join("measure"),
        &["--receive-only", "--consumer", "measure"],
    );
    assert!(only.status.success(), "{only:?}");
    let said = String::from_utf8_lossy(&only.stdout);
    assert!(
        said.contains(&format!("received {total} events")),
        "{total}: {said}"
    );
    assert!(said.contains("waited for deliveries"), "{said}");
    // Every message went to a writer thread in some hand-off, and a
    // hand-off ends at most one wait for work.
    let (handoffs, idle_waits) = said
        .lines()
        .find_map(|l| {
            let (n, rest) = l.trim().split_once(" hand-offs to the writer threads, ")?;
            let waited = rest.split_once(" of them to a thread waiting")?.0;
            Some((n.parse::<u64>().ok()?, waited.parse::<u64>().ok()?))
        })
        .unwrap_or_else(|| panic!("no hand-offs line: {said}"));
    assert!(handoffs >= 1 && idle_waits <= handoffs, "{said}");
    // Nothing was written: no engine has a log.
    let logs = std::fs::read_dir(tmp.path().join("measure/engines"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(logs, 0, "--receive-only wrote logs");

    let out = tmp.path().join("fleet");
    let rlog = tmp.path().join("recorder.log");
    let mut rec = spawn_recorder(&nats.url(), &out, "2", &rlog);
    assert!(wait(&mut rec, "the recorder", Duration::from_secs(60)).success());
    assert_exactly_once(&out, &emitted, &rlog);
    let onto = record(&out, &["--receive-only", "--consumer", "measure-2"]);
    assert!(!onto.status.success(), "{onto:?}");
    assert!(
        String::from_utf8_lossy(&onto.stderr).contains("a new --out"),
        "{onto:?}"
    );
}

/// `stats`, `export` and `capacity` of a fleet recording: per engine and
/// for the fleet, which holds every engine's events once.
fn fleet_analyses(out: &Path, emitted: &[(String, u64)]) {
    let run = |args: &[&str], dir: &Path| -> Vec<u8> {
        let o = Command::new(recorder_bin())
            .args(args)
            .arg(dir)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        o.stdout
    };
    let total: u64 = emitted.iter().map(|(_, n)| n).sum();
    let stats: Value = serde_json::from_slice(&run(&["stats", "--json"], out)).unwrap();
    let engines = stats["engines"].as_object().expect("stats per engine");
    assert_eq!(engines.len(), emitted.len());
    let per_engine_requests: u64 = engines
        .values()
        .map(|s| s["requests"].as_u64().unwrap())
        .sum();
    assert_eq!(stats["fleet"]["events"].as_u64(), Some(total));
    // Request ids are qualified by engine, so none is counted twice.
    assert_eq!(
        stats["fleet"]["requests"].as_u64(),
        Some(per_engine_requests)
    );
    assert_eq!(per_engine_requests, 30 * emitted.len() as u64);
    let jsonl = run(&["export", "--format", "jsonl"], out);
    assert_eq!(
        jsonl
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .count() as u64,
        total
    );
    // Capacity: the fleet as one shared cache sees every engine's
    // requests; each engine alone its own.
    let fleet: Value = serde_json::from_slice(&run(&["capacity", "--json"], out)).unwrap();
    let mut references = 0;
    for (name, _) in emitted {
        let one: Value = serde_json::from_slice(&run(
            &["capacity", "--json"],
            &out.join("engines").join(name),
        ))
        .unwrap();
        assert_eq!(one["requests"].as_u64(), Some(30), "{name}: {one}");
        references += one["references"].as_u64().unwrap();
    }
    assert_eq!(
        fleet["requests"].as_u64(),
        Some(per_engine_requests),
        "{fleet}"
    );
    assert_eq!(fleet["references"].as_u64(), Some(references), "{fleet}");
    // Its lookups give a curve with something to hit.
    assert!(fleet["ceiling"].as_f64().unwrap() > 0.0, "{fleet}");
}

/// The same while the recorder is killed with SIGKILL and restarted twice
/// and the server (file store) is killed and restarted once.
#[test]
fn exactly_once_through_recorder_kills_and_a_server_restart() {
    let (_one, mut nats, tmp, out, rlog) = started();
    let names: Vec<String> = (0..8).map(|i| format!("eng-{i}")).collect();
    // Paced in real time, so the kills land while the engines publish.
    let mut sims: Vec<Child> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let seed = (i + 11).to_string();
            spawn_sim(
                &nats.url(),
                n,
                &[
                    "--requests",
                    "80",
                    "--rate",
                    "12",
                    "--real-time",
                    "1",
                    "--seed",
                    &seed,
                ],
                tmp.path(),
            )
        })
        .collect();
    // Each recorder with its own number of writer threads, so the engines'
    // logs move between threads across the restarts.
    let recorder = |threads: &str| {
        spawn_recorder_with(
            &nats.url(),
            &out,
            "6",
            &rlog,
            &["--writer-threads", threads],
        )
    };
    let mut rec = recorder("3");
    let start = Instant::now();
    let at = |s: f64| {
        let t = Duration::from_secs_f64(s);
        if let Some(d) = t.checked_sub(start.elapsed()) {
            std::thread::sleep(d);
        }
    };
    for (i, (when, threads)) in [(1.5, "1"), (3.0, "5")].into_iter().enumerate() {
        at(when);
        rec.kill().unwrap(); // SIGKILL
        rec.wait().unwrap();
        assert!(
            sims.iter_mut().all(|s| s.try_wait().unwrap().is_none()),
            "the engines finished before kill {i}: the test would prove nothing"
        );
        rec = recorder(threads);
    }
    at(4.5);
    nats.restart();
    assert!(
        sims.iter_mut().all(|s| s.try_wait().unwrap().is_none()),
        "the engines finished before the server restart"
    );
    let mut emitted = Vec::new();
    for (s, n) in sims.iter_mut().zip(&names) {
        assert!(wait(s, n, Duration::from_secs(90)).success(), "{n} failed");
        let (events, publisher) = sim_result(tmp.path(), n);
        assert_eq!(
            publisher["events_sent"].as_u64(),
            Some(events),
            "{n}: {publisher}"
        );
        emitted.push((n.clone(), events));
    }
    assert!(wait(&mut rec, "the recorder", Duration::from_secs(60)).success());
    assert_exactly_once(&out, &emitted, &rlog);
    let log = std::fs::read_to_string(&rlog).unwrap();
    assert_eq!(log.matches("resuming").count(), 2, "{log}");
}

/// A publisher whose server goes away: its bounded buffer overflows, it
/// counts what it dropped, and declares it; nothing it emits after the
/// server is back is lost, and the recording accounts for every hole.
#[test]
fn a_publisher_cut_off_declares_its_drops_and_loses_nothing_later() {
    let _one = serial();
    use kvbm_attach::nats::publish::{Publisher, PublisherConfig};
    use kvbm_events::bus::BusConfig;
    use kvbm_events::{Emitter, EventKind, MonotonicClock, Tier};
    use std::sync::Arc;

    let mut nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let bus = BusConfig {
        tap_capacity: 1 << 20,
        ..BusConfig::default()
    };
    let emitter = Emitter::new(5, bus, Arc::new(MonotonicClock::new())).unwrap();
    let tap = emitter.bus().take_tap().unwrap();
    let mut cfg = PublisherConfig::new(nats.url(), "cut-off");
    cfg.buffer_bytes = 64 << 10; // a few batches
    cfg.publish_timeout = Duration::from_millis(500);
    let publisher = Publisher::spawn(tap, cfg, rt.handle()).unwrap();
    let emit = |n: u64| {
        for i in 0..n {
            emitter.emit(
                None,
                EventKind::PoolGauge {
                    tier: Tier::Host,
                    capacity: 1000,
                    active: (i % 1000) as u32,
                    inactive: 0,
                    empty: 0,
                },
            );
            if i % 1000 == 999 {
                // An engine's pace, not a tight loop: the tap keeps up.
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    };
    let until = |what: &str, f: &dyn Fn() -> bool| {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{what}: {:?}",
                publisher.counters()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    until("connected", &|| publisher.counters().connected);
    emit(20_000);
    until("the first events sent", &|| {
        publisher.counters().events_sent == 20_000
    });
    nats.stop();
    emit(100_000);
    until("drops while cut off", &|| publisher.counters().dropped > 0);
    nats.start_again();
    // Back: reconnected, and what the buffer held from the outage sent
    // (or counted dropped). What is emitted from here on must all arrive;
    // on a loaded machine the reconnection can take a second or two, and
    // events emitted before it would only test the buffer's size again.
    until("reconnected and the outage's buffer drained", &|| {
        let c = publisher.counters();
        c.connected && c.events_sent + c.dropped == 120_000
    });
    let before_after = emitter.emitted();
    emit(20_000);
    let c = std::thread::scope(|s| {
        s.spawn(|| publisher.stop(Duration::from_secs(20)))
            .join()
            .unwrap()
    });
    assert_eq!(c.tap_dropped, 0, "{c:?}");
    assert!(c.dropped > 0, "the buffer never overflowed: {c:?}");
    assert_eq!(c.events_in, 140_000, "{c:?}");
    assert_eq!(c.events_sent + c.dropped, 140_000, "{c:?}");
    drop(emitter);

    let out = tmp.path().join("fleet");
    let rlog = tmp.path().join("recorder.log");
    let mut rec = spawn_recorder(&nats.url(), &out, "2", &rlog);
    assert!(wait(&mut rec, "the recorder", Duration::from_secs(60)).success());
    let v = inspect(&out);
    let e = &v["engines"]["cut-off"];
    assert_eq!(e["events"].as_u64(), Some(c.events_sent), "{e}");
    assert_eq!(e["losses"]["holes"].as_u64(), Some(c.dropped), "{e}");
    assert_eq!(
        e["losses"]["declared_by_publisher"].as_u64(),
        Some(c.dropped),
        "{e}"
    );
    assert_eq!(e["losses"]["unexplained"].as_u64(), Some(0), "{e}");
    // Everything emitted after the server came back is there.
    let read = kvbm_recorder::recorder::read_events(&out.join("engines/cut-off"), |_| {}).unwrap();
    let tail: Vec<u64> = read
        .events
        .iter()
        .map(|e| e.seq)
        .filter(|s| *s >= before_after)
        .collect();
    assert!(
        tail.iter().copied().eq(before_after..140_000),
        "later events lost"
    );
    // And so is everything sent before the outage.
    assert!(read.events.iter().map(|e| e.seq).take(20_000).eq(0..20_000));
}

/// Breakpoint control through NATS request-reply against a real engine and
/// server, with the console's own controller (`NatsControl`): a breakpoint
/// pauses the engine, step resumes it and pauses it again at the very
/// next call, resume lets it run, and closing the session (the console
/// going away) releases what it set.
#[test]
fn control_through_nats_pauses_steps_and_resumes_an_engine() {
    use kvbm_attach::nats::control::NatsControl;
    use kvbm_events::breakpoint::{BreakpointSpec, STEP_BREAKPOINT};
    use kvbm_events::control::{BreakpointsView, Control, ControlCommand, ControlResult};

    let _one = serial();
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let _ = sim_bin();
    let mut sim = spawn_sim(
        &nats.url(),
        "ctl-0",
        &[
            "--real-time",
            "1",
            "--requests",
            "400",
            "--rate",
            "4",
            "--output-len",
            "200",
            "--bp-deadline-s",
            "120",
            "--publish-linger-s",
            "60",
        ],
        tmp.path(),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let client = rt
        .block_on(kvbm_attach::nats::connect(&nats.url(), "control-test"))
        .unwrap();
    let ctl = NatsControl::new(client, "ctl-0", rt.handle()).unwrap();
    let until = |what: &str, ok: &dyn Fn(&BreakpointsView) -> bool| -> BreakpointsView {
        let t = Instant::now();
        loop {
            let v = ctl.view();
            if ok(&v) {
                return v;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "{what}: {v:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // The engine's responder answers once it is up.
    let t = Instant::now();
    let id = loop {
        match ctl.execute(
            ControlCommand::Add {
                spec: BreakpointSpec::default().with_state("Decoding"),
            },
            None,
        ) {
            Ok(ControlResult::Added(id)) => break id,
            other => {
                assert!(
                    t.elapsed() < Duration::from_secs(30),
                    "no engine: {other:?}"
                );
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    };
    let v = until("a call paused by the breakpoint", &|v| {
        v.paused.iter().any(|p| p.breakpoint == id)
    });
    let first = v.paused[0].pause_id;
    // Step: clear the breakpoint, resume, and pause at the very next call.
    assert_eq!(
        ctl.execute(ControlCommand::Clear { id }, None).ok(),
        Some(ControlResult::Done(true))
    );
    assert!(matches!(
        ctl.execute(ControlCommand::Step, None),
        Ok(ControlResult::Done(_))
    ));
    let v = until("a call paused by the step", &|v| {
        v.paused
            .iter()
            .any(|p| p.breakpoint == STEP_BREAKPOINT && p.pause_id > first)
    });
    assert!(v.breakpoints.is_empty(), "{v:?}");
    // Resume everything: nothing stays paused.
    assert!(matches!(
        ctl.execute(ControlCommand::Resume { pause_id: None }, None),
        Ok(ControlResult::Count(n)) if n >= 1
    ));
    until("nothing paused after resume", &|v| v.paused.is_empty());
    // A breakpoint set, then the controller dropped: its session is closed
    // and the engine runs on.
    let again = ctl
        .execute(
            ControlCommand::Add {
                spec: BreakpointSpec::default().with_state("Decoding"),
            },
            None,
        )
        .unwrap();
    assert!(matches!(again, ControlResult::Added(_)));
    until("paused again", &|v| !v.paused.is_empty());
    drop(ctl);
    let client = rt
        .block_on(kvbm_attach::nats::connect(&nats.url(), "control-test-2"))
        .unwrap();
    let watcher = NatsControl::new(client, "ctl-0", rt.handle()).unwrap();
    let t = Instant::now();
    // A command that changes nothing (no pause has that id) makes the
    // watcher read the engine's view at once, from the engine itself.
    loop {
        let r = watcher.execute(
            ControlCommand::Resume {
                pause_id: Some(u64::MAX),
            },
            None,
        );
        assert_eq!(r.ok(), Some(ControlResult::Done(false)));
        let v = watcher.view();
        if v.breakpoints.is_empty() && v.paused.is_empty() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the dropped controller's breakpoint outlived it: {v:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Sessions are bounded: with the watcher's open, a controller that
    // opens and never closes gets the rest, then `busy`; so does a
    // console, which says why.
    sessions_are_bounded(&rt, &nats.url());
    let _ = sim.kill();
    let _ = sim.wait();
}

/// With one session open (the watcher's), `ctl-0`'s responder opens the
/// rest of its `MAX_SESSIONS` to a controller that never closes them,
/// then refuses both a raw `Open` and a console's controller as `busy`.
fn sessions_are_bounded(rt: &tokio::runtime::Runtime, url: &str) {
    use kvbm_attach::nats::control::{ControlReply, ControlRequest, MAX_SESSIONS, NatsControl};
    use kvbm_events::control::{Control, ControlCommand};
    let raw = rt
        .block_on(kvbm_attach::nats::connect(url, "control-test-3"))
        .unwrap();
    let open = serde_json::to_vec(&ControlRequest::Open { client: None }).unwrap();
    let mut opened = 0;
    let refusal = loop {
        let reply = rt
            .block_on(raw.request(
                kvbm_attach::nats::control_subject("ctl-0"),
                open.clone().into(),
            ))
            .unwrap();
        match serde_json::from_slice::<ControlReply>(&reply.payload).unwrap() {
            ControlReply::Opened { .. } => opened += 1,
            ControlReply::Error { code, message } => break (code, message),
            other => panic!("{other:?}"),
        }
        assert!(opened <= MAX_SESSIONS, "no limit on sessions");
    };
    assert_eq!(refusal.0, "busy", "{refusal:?}");
    assert_eq!(opened, MAX_SESSIONS - 1, "the watcher holds one");
    let client = rt
        .block_on(kvbm_attach::nats::connect(url, "control-test-4"))
        .unwrap();
    let late = NatsControl::new(client, "ctl-0", rt.handle()).unwrap();
    let err = late
        .execute(ControlCommand::Resume { pause_id: None }, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("busy"), "{err}");
}

/// The recorder under a limit on open files, `soft` and `hard`, set in
/// the child before it runs (as `ulimit -n` would), recording from `url`
/// into `out` with a consumer of its own until idle.
#[cfg(unix)]
fn record_under_limit(
    url: &str,
    out: &Path,
    consumer: &str,
    (soft, hard): (u64, u64),
) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(recorder_bin());
    cmd.args(["record", "--from", url, "--out"]).arg(out).args([
        "--idle-exit-s",
        "2",
        "--consumer",
        consumer,
    ]);
    // SAFETY: setrlimit is async-signal-safe and touches only the child.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: soft as libc::rlim_t,
                rlim_max: hard as libc::rlim_t,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.output().expect("starting kvbm-recorder")
}

/// A fleet recording keeps a file open per engine, so a fleet larger than
/// the soft limit on open files a process starts with (often 1,024) would
/// stop the recorder. Here 40 engines against a soft limit of 32: the
/// recorder raises it to the hard limit and records every engine exactly
/// once; held to 32 (the hard limit too), it stops with an error that
/// names the limit and how to raise it, and restarted with room it
/// resumes that recording with nothing lost or doubled.
#[cfg(unix)]
#[test]
fn more_engines_than_the_soft_limit_on_open_files_are_recorded() {
    let _one = serial();
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let _ = (sim_bin(), recorder_bin());
    let names: Vec<String> = (0..40).map(|i| format!("fd-{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let emitted = small_engines(&nats.url(), &refs, 1, tmp.path());
    let mut hard = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a plain read of this process's limit into a local.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut hard) },
        0
    );
    // `rlim_t` is u64 on Linux, not everywhere.
    #[allow(clippy::unnecessary_cast)]
    let hard = hard.rlim_max as u64;
    assert!(
        hard > 128,
        "this machine's hard limit ({hard}) is too low for the test"
    );

    // Records into DIR/name with room to raise the limit; every engine
    // there exactly once.
    let recorded_with_room = |name: &str| {
        let out = tmp.path().join(name);
        let o = record_under_limit(&nats.url(), &out, &format!("fd-{name}"), (32, hard));
        let log = tmp.path().join(format!("{name}.log"));
        std::fs::write(&log, [o.stdout.clone(), o.stderr.clone()].concat()).unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_exactly_once(&out, &emitted, &log);
    };
    recorded_with_room("raised");

    let held = tmp.path().join("held");
    let o = record_under_limit(&nats.url(), &held, "fd-held", (32, 32));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("ulimit -n"), "{err}");
    // Restarted with room, the same recording resumes: every engine
    // exactly once, what the stopped run wrote included.
    recorded_with_room("held");
}

/// An engine that goes quiet mid-run has its log closed (`--close-idle-logs-s`)
/// and reopened when it speaks again, and one that ends has its log closed
/// for good: every event of both is recorded exactly once, and the
/// recorder's summary counts the closes and the reopening.
#[test]
fn a_quiet_engine_s_log_is_closed_and_reopened_without_loss() {
    let (_one, nats, tmp, out, rlog) = started();
    // 20 requests, then 3 s of nothing, then 20 more, paced in real time.
    let trace = tmp.path().join("pause.jsonl");
    let lines: Vec<String> = (0..40)
        .map(|i| {
            let t = if i < 20 { i * 10 } else { 3000 + i * 10 };
            format!(
                r#"{{"timestamp": {t}, "input_length": 600, "output_length": 4, "hash_ids": [{i}, {}]}}"#,
                1000 + i
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).unwrap();
    let mut rec = spawn_recorder_with(&nats.url(), &out, "3", &rlog, &["--close-idle-logs-s", "1"]);
    let trace = trace.to_str().unwrap();
    let mut quiet = spawn_sim(
        &nats.url(),
        "quiet",
        &["--trace", trace, "--real-time", "1"],
        tmp.path(),
    );
    let mut short = spawn_sim(
        &nats.url(),
        "short",
        &["--requests", "20", "--rate", "40", "--seed", "4"],
        tmp.path(),
    );
    let mut emitted = Vec::new();
    for (s, n) in [(&mut quiet, "quiet"), (&mut short, "short")] {
        assert!(wait(s, n, Duration::from_secs(60)).success(), "{n} failed");
        emitted.push((n.to_string(), sim_result(tmp.path(), n).0));
    }
    assert!(wait(&mut rec, "the recorder", Duration::from_secs(60)).success());
    let log = std::fs::read_to_string(&rlog).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("closed after 1 s without events"))
        .unwrap_or_else(|| panic!("no line of open logs:\n{log}"));
    let n: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    // [open at the end, closed, 1 (the seconds), reopened]
    let (open, closed, reopened) = (n[0], n[1], n[3]);
    assert!(reopened >= 1, "the quiet engine's log was reopened: {line}");
    assert!(
        closed > reopened,
        "and closed again with the other's: {line}"
    );
    assert!(open <= 2, "{line}");
    assert_exactly_once(&out, &emitted, &rlog);
}

/// A `nats-server` that requires a user and password, given in the URLs
/// (`nats://USER:PASSWORD@HOST:PORT`) to an engine and the recorder: the
/// events arrive exactly once, and the password is in nothing printed or
/// kept (the recorder's output, the manifest, the engine's stderr).
#[test]
fn credentials_in_the_url_reach_a_server_that_requires_them_and_are_never_kept() {
    let one = serial();
    let nats = NatsServer::start_with_args(&["--user", "kv", "--pass", "s3cret-pw"]);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("fleet");
    let rlog = tmp.path().join("recorder.log");
    let url = format!("nats://kv:s3cret-pw@127.0.0.1:{}", nats.port());
    // Built first, so no build counts as the recorder's idle time.
    let _ = (sim_bin(), recorder_bin());
    let mut rec = spawn_recorder(&url, &out, "3", &rlog);
    let emitted = small_engines(&url, &["auth-a"], 7, tmp.path());
    assert!(wait(&mut rec, "the recorder", Duration::from_secs(60)).success());
    assert_exactly_once(&out, &emitted, &rlog);
    let kept = [
        std::fs::read_to_string(&rlog).unwrap(),
        std::fs::read_to_string(out.join("fleet.json")).unwrap(),
        std::fs::read_to_string(tmp.path().join("auth-a.err")).unwrap(),
    ];
    for text in &kept {
        assert!(!text.contains("s3cret-pw"), "the password was kept: {text}");
    }
    let manifest: Value = serde_json::from_str(&kept[1]).unwrap();
    assert_eq!(
        manifest["source"],
        format!("nats://***@127.0.0.1:{}", nats.port()),
        "{manifest}"
    );
    drop(one);
}
