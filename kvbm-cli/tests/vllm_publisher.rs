//! `kvbm-recorder record --from zmq://` against vLLM's own KV-event
//! publisher (`vllm.distributed.kv_events.ZmqEventPublisher`, driven by
//! `tests/vllm/kv_publisher.py` in the environment of
//! `scripts/setup-vllm.sh`): replay over a lossy link, restarts, a late
//! start, hybrid models' groups and every medium. Skipped, with a message
//! naming the setup script, where that environment is absent, unless
//! `KVBM_REQUIRE_VLLM=1`.
//!
//! Every process is bounded: the driver ends itself after 120 s, each wait
//! here has a deadline, and recorders are stopped with SIGINT (then killed).

use kvbm_events::tier::Tier;
use kvbm_events::{Event, EventKind, SequenceHash};
use kvbm_recorder::recorder::{Recording, read_events, read_sidecar};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(20);

/// A free port below Linux's ephemeral range (32768 and up): a client
/// reconnecting to a port in that range while nothing listens there can be
/// given the same port as its own and connect to itself (TCP simultaneous
/// open), which then keeps the restarted publisher from binding it.
fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let seed = u64::from(std::process::id()) * 7919;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = 20_000 + ((seed + n * 104_729) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// vLLM's publisher (and the lossy proxy) in a Python process.
struct Driver {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Driver {
    fn start(test: &str) -> Option<Driver> {
        let py = kvbm_testkit::vllm::python(test)?;
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vllm/kv_publisher.py");
        let mut child = Command::new(py)
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting the vLLM publisher driver");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                stdout.read_line(&mut line).unwrap() > 0,
                "the driver ended before it was ready"
            );
            if line.trim() == "ready" {
                break;
            }
        }
        Some(Driver {
            child,
            stdin,
            stdout,
        })
    }

    /// Sends one command; its answer (the driver bounds its own time).
    fn cmd(&mut self, c: Value) -> Value {
        writeln!(self.stdin, "{c}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                self.stdout.read_line(&mut line).unwrap() > 0,
                "the driver ended during {c}"
            );
            if let Some(rest) = line.trim().strip_prefix("ok ") {
                return serde_json::from_str(rest).unwrap();
            }
            assert!(!line.starts_with("error"), "{c}: {line}");
        }
    }

    fn start_publisher(&mut self, port: u16, replay: u16, buffer_steps: u64) {
        self.cmd(json!({"op": "start", "port": port, "replay_port": replay, "buffer_steps": buffer_steps}));
    }

    /// Publishes `batches`; the publisher seqs they got.
    fn publish(&mut self, batches: &[Value]) -> (u64, u64) {
        let a = self.cmd(json!({"op": "publish", "batches": batches}));
        (
            a["seqs"][0].as_u64().unwrap(),
            a["seqs"][1].as_u64().unwrap(),
        )
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `kvbm-recorder record --from zmq://` process, its stderr collected.
struct Recorder {
    child: Child,
    stderr: Arc<Mutex<String>>,
}

impl Recorder {
    fn start(url: &str, replay: Option<u16>, out: PathBuf) -> Recorder {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"));
        cmd.args(["record", "--from", url, "--duration-s", "90", "--out"])
            .arg(&out);
        if let Some(r) = replay {
            cmd.args(["--replay-endpoint", &format!("zmq://127.0.0.1:{r}")]);
        }
        let mut child = cmd
            .env("RUST_LOG", "kvbm_ingest=debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let (err, sink) = (child.stderr.take().unwrap(), stderr.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        Recorder { child, stderr }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Waits until stderr says `needle` `times` times.
    fn wait_for(&self, needle: &str, times: usize) {
        let t = Instant::now();
        let wait = WAIT.max(Duration::from_millis(200) * times as u32);
        while self.stderr().matches(needle).count() < times {
            assert!(
                t.elapsed() < wait,
                "no `{needle}` ×{times} from the recorder:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    }

    /// Stops it as Ctrl-C does; its stdout.
    fn stop(mut self) -> String {
        self.signal("-INT");
        let t = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > WAIT {
                let _ = self.child.kill();
                panic!("the recorder did not stop:\n{}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stdout = String::new();
        std::io::Read::read_to_string(self.child.stdout.as_mut().unwrap(), &mut stdout).unwrap();
        assert!(status.success(), "{stdout}\n{}", self.stderr());
        // The summary first; what it said on stderr after, for failures.
        format!("{stdout}--- stderr ---\n{}", self.stderr())
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts recorders and waits until each is subscribed (PUB drops what it
/// sends before a subscription arrives).
fn recorders(specs: &[(&str, Option<u16>, &Path)]) -> Vec<Recorder> {
    let rs: Vec<Recorder> = specs
        .iter()
        .map(|(url, replay, out)| Recorder::start(url, *replay, out.to_path_buf()))
        .collect();
    for r in &rs {
        r.wait_for("subscribed to", 1);
    }
    std::thread::sleep(Duration::from_millis(500));
    rs
}

fn events(dir: &Path) -> Vec<Event> {
    let read = read_events(dir, |_| {}).unwrap();
    assert!(read.damage.is_none(), "{:?}", read.damage);
    read.events
}

fn sidecar(dir: &Path) -> Recording {
    read_sidecar(dir).expect("the recording's sidecar")
}

fn check_ok(dir: &Path) {
    let o = Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
        .arg("check")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "check {}: {}",
        dir.display(),
        String::from_utf8_lossy(&o.stdout)
    );
}

/// The hashes registered on `tier` at the end of the recording.
fn live(evs: &[Event], tier: Tier) -> BTreeSet<u64> {
    kvbm_events::reducer::fold(evs)
        .pool(tier)
        .registered
        .iter()
        .map(|h: &SequenceHash| h.0)
        .collect()
}

/// A small deterministic generator (tests need no `rand`).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// Batch `i` of a churning workload: it stores two blocks and removes the
/// pair stored five batches before; every 40th clears the GPU.
fn churn(i: u64, base: u64) -> Value {
    let mut evs = vec![json!({"stored": [base + 2 * i, base + 2 * i + 1], "group": 0})];
    if i >= 5 {
        evs.push(json!({"removed": [base + 2 * (i - 5), base + 2 * (i - 5) + 1], "group": 0}));
    }
    if i % 40 == 39 {
        evs.push(json!({"cleared": true}));
    }
    Value::Array(evs)
}

/// The hashes `churn(0..n, base)` leaves stored.
fn churn_live(n: u64, base: u64) -> BTreeSet<u64> {
    let mut live = BTreeSet::new();
    for i in 0..n {
        live.extend([base + 2 * i, base + 2 * i + 1]);
        if i >= 5 {
            live.remove(&(base + 2 * (i - 5)));
            live.remove(&(base + 2 * (i - 5) + 1));
        }
        if i % 40 == 39 {
            live.clear();
        }
    }
    live
}

fn client(r: &Recording) -> &Value {
    r.client.as_ref().expect("the source's counters")
}

/// Finding 1 and the lossy link: a proxy between vLLM's publisher and the
/// recorders drops random batches. With the replay endpoint the recording
/// equals a lossless one event for event; without it every loss is
/// counted and placed where it happened.
#[test]
fn a_lossy_link_is_replayed_exactly_or_every_loss_counted_and_placed() {
    let Some(mut d) = Driver::start("lossy link") else {
        return;
    };
    let (port, replay, proxy) = (free_port(), free_port(), free_port());
    d.start_publisher(port, replay, 10_000);
    const N: u64 = 240;
    let mut rng = Lcg(16);
    // Never the first (that is a late join, tested apart) nor the last
    // (nothing after it would reveal the loss).
    let drop: Vec<u64> = (1..N - 1).filter(|_| rng.next() % 100 < 20).collect();
    d.cmd(json!({"op": "proxy", "upstream": port, "port": proxy, "drop": drop}));
    let dir = tempfile::tempdir().unwrap();
    let (direct, replayed, lossy) = (
        dir.path().join("direct"),
        dir.path().join("replayed"),
        dir.path().join("lossy"),
    );
    let (pub_url, proxy_url) = (
        format!("zmq://127.0.0.1:{port}"),
        format!("zmq://127.0.0.1:{proxy}"),
    );
    let rs = recorders(&[
        (&pub_url, Some(replay), &direct),
        (&proxy_url, Some(replay), &replayed),
        (&proxy_url, None, &lossy),
    ]);
    let batches: Vec<Value> = (0..N).map(|i| churn(i, 1_000)).collect();
    for chunk in batches.chunks(60) {
        d.publish(chunk);
    }
    let t = Instant::now();
    loop {
        let s = d.cmd(json!({"op": "proxy_stats"}));
        let seen = s["forwarded"].as_u64().unwrap() + s["dropped"].as_array().unwrap().len() as u64;
        if seen == N {
            break;
        }
        assert!(t.elapsed() < WAIT, "the proxy saw {seen} of {N}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(drop.len() >= 20, "the link lost {} batches", drop.len());
    finish_lossy_link(rs, &drop, [&direct, &replayed, &lossy], 3 * N as usize);
}

/// Stops the three recorders of a lossy link once the replaying one has
/// had every gap answered, and checks them: `replayed` (through the proxy,
/// with the replay endpoint) equals `direct` event for event; `lossy`
/// (through the proxy, without it) counts and places every dropped batch.
fn finish_lossy_link(rs: Vec<Recorder>, drop: &[u64], dirs: [&Path; 3], at_least: usize) {
    let [direct, replayed, lossy] = dirs;
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for &x in drop {
        match ranges.last_mut() {
            Some((_, to)) if *to + 1 == x => *to = x,
            _ => ranges.push((x, x)),
        }
    }
    // vLLM's publisher answers a replay between two of its queue waits
    // (100 ms when idle): the replaying recorder is done once its log says
    // every gap's replay came back.
    let t = Instant::now();
    while {
        let e = rs[1].stderr();
        e.matches(" answered: ").count() + e.matches("replay failed").count() < ranges.len()
    } {
        assert!(t.elapsed() < 2 * WAIT, "{}", rs[1].stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    let outs: Vec<String> = rs.into_iter().map(Recorder::stop).collect();

    let (e_direct, e_replayed) = (events(direct), events(replayed));
    assert!(e_direct.len() > at_least, "{}", e_direct.len());
    if let Some(i) =
        (0..e_direct.len().max(e_replayed.len())).find(|&i| e_direct.get(i) != e_replayed.get(i))
    {
        panic!(
            "replayed over the lossy link ≠ lossless at event {i} of {}/{}: {:?} vs {:?}\n{}\n{}",
            e_replayed.len(),
            e_direct.len(),
            e_replayed.get(i),
            e_direct.get(i),
            outs[1],
            outs[0]
        );
    }
    let s = sidecar(replayed);
    assert_eq!(s.lost, 0, "{}", outs[1]);
    assert_eq!(client(&s)["replayed"], drop.len() as u64, "{}", outs[1]);
    assert_eq!(client(&s)["replay_failures"], 0);
    assert_eq!(sidecar(direct).lost, 0);

    // Without replay: each lost batch counted, where it was lost.
    let s = sidecar(lossy);
    assert_eq!(s.lost, drop.len() as u64, "{}", outs[2]);
    let logged: Vec<(u64, u64)> = client(&s)["missed_ranges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["from"].as_u64().unwrap(), r["to"].as_u64().unwrap()))
        .collect();
    assert_eq!(logged, ranges);
    assert_eq!(s.gaps.len(), ranges.len());
    check_ok(lossy);
    assert!(
        outs[2].contains(&format!("{} publisher batches lost", drop.len())),
        "{}",
        outs[2]
    );
}

/// Finding 2: the engine restarts twice while the recorders run — once
/// quickly, once while they are stopped (SIGSTOP), so that the new
/// publisher is far past the old one's seq before they reconnect. Both
/// restarts are detected; the old engine's blocks are not merged with the
/// new one's (the same hashes, as vLLM's are stable across restarts);
/// with the replay endpoint nothing is lost, without it every batch of a
/// new publisher before the first seen is counted lost.
#[test]
fn two_restarts_are_detected_and_nothing_is_merged_or_silently_lost() {
    let Some(mut d) = Driver::start("restarts") else {
        return;
    };
    let (port, replay) = (free_port(), free_port());
    d.start_publisher(port, replay, 10_000);
    let dir = tempfile::tempdir().unwrap();
    let (with, without) = (dir.path().join("with"), dir.path().join("without"));
    let url = format!("zmq://127.0.0.1:{port}");
    let rs = recorders(&[(&url, Some(replay), &with), (&url, None, &without)]);
    let b1: Vec<Value> = (0..30).map(|i| churn(i, 1_000)).collect();
    d.publish(&b1);

    // Quick restart: the same hashes again, published until both noticed.
    d.cmd(json!({"op": "stop"}));
    d.start_publisher(port, replay, 10_000);
    let mut i = 0;
    let t = Instant::now();
    while !rs
        .iter()
        .all(|r| r.stderr().contains("publisher restarted"))
    {
        assert!(t.elapsed() < WAIT, "{}\n{}", rs[0].stderr(), rs[1].stderr());
        d.publish(&[churn(i, 1_000)]);
        i += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    let p2_last = i - 1;

    // Slow restart: the recorders cannot reconnect (stopped) while the new
    // engine publishes past the old one's last seq.
    for r in &rs {
        r.signal("-STOP");
    }
    d.cmd(json!({"op": "stop"}));
    d.start_publisher(port, replay, 10_000);
    let b3: Vec<Value> = (0..p2_last + 20).map(|i| churn(i, 5_000)).collect();
    d.publish(&b3);
    for r in &rs {
        r.signal("-CONT");
    }
    for r in &rs {
        r.wait_for("reconnected to", 2);
    }
    std::thread::sleep(Duration::from_millis(300));
    let more: Vec<Value> = (p2_last + 20..p2_last + 25)
        .map(|i| churn(i, 5_000))
        .collect();
    d.publish(&more);
    for r in &rs {
        r.wait_for("publisher restarted", 2);
    }
    std::thread::sleep(Duration::from_millis(500));
    let outs: Vec<String> = rs.into_iter().map(Recorder::stop).collect();

    // What the third engine holds at the end.
    let p3_live = churn_live(p2_last + 25, 5_000);

    // With the replay endpoint.
    let s = sidecar(&with);
    let c = client(&s);
    let log = c["restart_log"].as_array().unwrap();
    assert_eq!(log.len(), 2, "{}", outs[0]);
    assert!(
        ["SeqWentBack", "ReplayDiffers"].contains(&log[0]["cause"].as_str().unwrap()),
        "{log:?}"
    );
    assert_eq!(log[1]["cause"], "ReplayDiffers", "{log:?}");
    assert!(
        log[1]["new_seq"].as_u64() > log[1]["last_seq"].as_u64(),
        "the new engine had passed the old seq: {log:?}"
    );
    assert_eq!(s.lost, 0, "every batch fetched: {}", outs[0]);
    assert_eq!(c["translate"]["duplicates"], 0, "nothing merged");
    let e = events(&with);
    assert_eq!(
        live(&e, Tier::Device),
        p3_live,
        "only the third engine's blocks"
    );
    check_ok(&with);

    // Without it: the restarts are assumed, and what was not seen is lost.
    let s = sidecar(&without);
    let c = client(&s);
    let log = c["restart_log"].as_array().unwrap();
    assert_eq!(log.len(), 2, "{}", outs[1]);
    for r in log {
        assert!(
            ["SeqWentBack", "Unverified"].contains(&r["cause"].as_str().unwrap()),
            "{log:?}"
        );
    }
    let unseen: u64 = log.iter().map(|r| r["new_seq"].as_u64().unwrap()).sum();
    assert_eq!(s.lost, unseen, "{}", outs[1]);
    assert!(s.lost >= p2_last + 20, "{}", s.lost);
    assert_eq!(c["translate"]["duplicates"], 0, "nothing merged");
    let e = events(&without);
    let end = live(&e, Tier::Device);
    assert!(
        end.iter().all(|h| *h >= 5_000),
        "old blocks remain: {end:?}"
    );
    check_ok(&without);
}

/// Finding 4: a recorder that joins at batch 50 says so, and with the
/// replay endpoint fetches what the buffer (30 batches) still holds.
#[test]
fn a_late_start_is_reported_and_the_replay_buffer_fetched() {
    let Some(mut d) = Driver::start("late start") else {
        return;
    };
    let (port, replay) = (free_port(), free_port());
    d.start_publisher(port, replay, 30);
    let before: Vec<Value> = (0..50)
        .map(|i| json!([{"stored": [100 + i], "group": 0}]))
        .collect();
    d.publish(&before);
    let dir = tempfile::tempdir().unwrap();
    let (fetching, plain) = (dir.path().join("fetching"), dir.path().join("plain"));
    let url = format!("zmq://127.0.0.1:{port}");
    let rs = recorders(&[(&url, Some(replay), &fetching), (&url, None, &plain)]);
    // Batch 50 first: the recorders ask for what came before it once they
    // have it, when the buffer (30) holds 21..=50.
    d.publish(&[json!([{"stored": [150], "group": 0}])]);
    std::thread::sleep(Duration::from_millis(500));
    let after: Vec<Value> = (51..60)
        .map(|i| json!([{"stored": [100 + i], "group": 0}]))
        .collect();
    d.publish(&after);
    std::thread::sleep(Duration::from_millis(500));
    let outs: Vec<String> = rs.into_iter().map(Recorder::stop).collect();

    let s = sidecar(&fetching);
    assert_eq!(s.missed_before_start, 21, "{}", outs[0]);
    assert_eq!(client(&s)["fetched_before_start"], 29);
    assert_eq!(s.lost, 0);
    assert!(
        outs[0]
            .contains("joined at publisher batch 50: 29 earlier batches fetched, 21 not recorded"),
        "{}",
        outs[0]
    );
    let want: BTreeSet<u64> = (121..160).collect();
    assert_eq!(live(&events(&fetching), Tier::Device), want);

    let s = sidecar(&plain);
    assert_eq!(s.missed_before_start, 50, "{}", outs[1]);
    assert!(
        outs[1]
            .contains("joined at publisher batch 50: 0 earlier batches fetched, 50 not recorded"),
        "{}",
        outs[1]
    );
    assert_eq!(client(&s)["first_seq"], 50);
}

/// Findings 3 and 5: a hybrid model's groups hold a hash independently, and
/// every medium vLLM and SGLang define lands on a tier; one no engine
/// defines is skipped, and the summary says so.
#[test]
fn groups_hold_hashes_and_every_engine_medium_has_a_tier() {
    let Some(mut d) = Driver::start("groups and media") else {
        return;
    };
    let (port, replay) = (free_port(), free_port());
    d.start_publisher(port, replay, 100);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("rec");
    let url = format!("zmq://127.0.0.1:{port}");
    let rs = recorders(&[(&url, Some(replay), &out)]);
    d.publish(&[
        json!([{"stored": [7, 70], "group": 0}, {"stored": [7], "group": 1}]),
        json!([{"removed": [7, 70], "group": 0}]),
        json!([
            {"stored": [8], "medium": "CPU"},
            {"stored": [9], "medium": "STORAGE"},
            {"stored": [10], "medium": "CPU_PINNED"},
            {"stored": [11], "medium": "DISK"},
            {"stored": [12], "medium": "EXTERNAL"},
            {"stored": [11], "medium": "EXTERNAL"},
            {"stored": [13], "medium": "TAPE"}
        ]),
        json!([{"removed": [11], "medium": "DISK"}]),
    ]);
    std::thread::sleep(Duration::from_millis(500));
    let stdout = rs.into_iter().next().unwrap().stop();
    let e = events(&out);
    assert_eq!(
        live(&e, Tier::Device),
        BTreeSet::from([7]),
        "group 1 still holds 7"
    );
    assert_eq!(live(&e, Tier::Host), BTreeSet::from([8, 10]));
    assert_eq!(
        live(&e, Tier::Disk),
        BTreeSet::from([9, 11, 12]),
        "EXTERNAL still holds 11"
    );
    assert!(stdout.contains("1 events skipped"), "{stdout}");
    assert!(
        stdout.contains("skipped events: 1 (unknown medium 1, unknown type 0, malformed 0; last: medium `TAPE` is not one kvbm maps)"),
        "{stdout}"
    );
    let evicted = e
        .iter()
        .filter(|e| matches!(e.kind, EventKind::BlockEvicted { .. }))
        .count();
    assert_eq!(evicted, 1, "only 70 was evicted");
    check_ok(&out);
}

/// The lossy link again, with vLLM's engine itself publishing (four rounds
/// of requests on the tiny model: stores, evictions, prefix cache resets):
/// replayed, the recording equals the lossless one; without replay, every
/// dropped batch is counted and placed. About a minute (the engine's start).
#[test]
fn a_real_engine_over_a_lossy_link() {
    let Some(py) = kvbm_testkit::vllm::python("real engine over a lossy link") else {
        return;
    };
    let (port, replay, proxy) = (free_port(), free_port(), free_port());
    let mut rng = Lcg(7);
    let to_drop: Vec<u64> = (1..100).filter(|_| rng.next() % 100 < 15).collect();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vllm/engine_kv_events.py");
    let mut engine = Command::new(py)
        .arg(script)
        .args([port, replay, proxy].map(|p| p.to_string()))
        .arg(serde_json::to_string(&to_drop).unwrap())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    struct Kill(Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut stdin = engine.stdin.take().unwrap();
    let lines = BufReader::new(engine.stdout.take().unwrap()).lines();
    let engine = Kill(engine);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in lines.map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let wait_line = |prefix: &str, secs: u64| -> String {
        let t = Instant::now();
        loop {
            let left = Duration::from_secs(secs).saturating_sub(t.elapsed());
            match rx.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(e) => panic!("no `{prefix}` from the engine: {e}"),
            }
        }
    };
    wait_line("ready", 240);
    let dir = tempfile::tempdir().unwrap();
    let (direct, replayed, lossy) = (
        dir.path().join("direct"),
        dir.path().join("replayed"),
        dir.path().join("lossy"),
    );
    let (pub_url, proxy_url) = (
        format!("zmq://127.0.0.1:{port}"),
        format!("zmq://127.0.0.1:{proxy}"),
    );
    let rs = recorders(&[
        (&pub_url, Some(replay), &direct),
        (&proxy_url, Some(replay), &replayed),
        (&proxy_url, None, &lossy),
    ]);
    writeln!(stdin, "go").unwrap();
    stdin.flush().unwrap();
    let done = wait_line("done ", 120);
    let report: Value = serde_json::from_str(&done["done ".len()..]).unwrap();
    let dropped: Vec<u64> = serde_json::from_value(report["dropped"].clone()).unwrap();
    assert!(dropped.len() >= 5, "{report}");
    finish_lossy_link(rs, &dropped, [&direct, &replayed, &lossy], 100);
    let kinds: BTreeSet<&str> = events(&direct)
        .iter()
        .map(|e| e.kind.name())
        .collect::<Vec<_>>()
        .into_iter()
        .collect();
    for k in ["BlockRegistered", "BlockEvicted", "PoolGauge"] {
        assert!(kinds.contains(k), "{kinds:?}");
    }
    writeln!(stdin, "quit").unwrap();
    std::mem::drop(engine);
}
