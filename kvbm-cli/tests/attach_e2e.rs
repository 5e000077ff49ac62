//! End to end on loopback: `kvbm-recorder record --from` against the real
//! `kvbm-sim --serve`, and the client across a server restart (the server
//! library in-process, shut down and bound again on the same port) — no
//! duplicates, and what the server's ring lost meanwhile as an explicit gap.

use kvbm_attach::client::{Backoff, Client, ClientConfig, ClientEvent, ConnState};
use kvbm_attach::server::{
    Feeder, FeederConfig, ServedEngine, Server, ServerConfig, ServerHandle, spawn_feeder,
};
use kvbm_events::bus::BusConfig;
use kvbm_events::ring::RingBuffer;
use kvbm_events::tier::Tier;
use kvbm_events::{Emitter, EventKind, MonotonicClock};
use kvbm_schema::protocol::GapReason;
use kvbm_testkit::served::{Served, serve};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A child process killed when dropped.
/// Starts `kvbm-sim --serve 127.0.0.1:0 ARGS` and reads its URL.
fn serve_sim(args: &[&str]) -> (Served, String) {
    let mut cmd = Command::new(kvbm_testkit::bin::workspace_bin("kvbm-sim", "kvbm-sim"));
    cmd.args(["--serve", "127.0.0.1:0"]).args(args);
    serve(cmd)
}

fn recorder() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
}

/// `record --from url --out log --duration-s secs`, which must succeed,
/// then `check log`, which must pass: what each printed.
fn record_then_check(url: &str, log: &std::path::Path, secs: &str) -> (String, String) {
    let out = recorder()
        .args(["record", "--from", url, "--out"])
        .arg(log)
        .args(["--duration-s", secs])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let check = recorder().arg("check").arg(log).output().unwrap();
    let said = String::from_utf8_lossy(&check.stdout).into_owned();
    assert!(check.status.success(), "{said}");
    (stdout, said)
}

/// `inspect --json log`, parsed.
fn inspect_json(log: &std::path::Path) -> serde_json::Value {
    let out = recorder()
        .args(["inspect", "--json"])
        .arg(log)
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Record a whole (short) run from the attach server, then check it.
#[test]
fn record_from_a_served_sim_then_check_passes() {
    let (_sim, url) = serve_sim(&[
        "--requests",
        "12",
        "--rate",
        "20",
        "--prompt-len",
        "256",
        "--output-len",
        "16",
        "--real-time",
        "4",
        "--linger-s",
        "20",
    ]);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("remote.kvbm");
    let (stdout, _) = record_then_check(&url, &log, "4");
    assert!(stdout.contains("recorded "), "{stdout}");
    let v = inspect_json(&log);
    assert_eq!(v["first_seq"], 0, "{v}");
    assert_eq!(v["lost"], 0, "{v}");
    assert_eq!(v["seq_gaps"], 0, "{v}");
    assert!(
        v["counts_by_kind"]["SlotCreated"].as_u64() == Some(12),
        "{v}"
    );
    let side: serde_json::Value =
        serde_json::from_slice(&std::fs::read(log.join("recording.json")).unwrap()).unwrap();
    assert_eq!(side["source"], url.as_str());
    assert_eq!(side["stream_complete"], false);
}

#[test]
fn record_from_refuses_bad_and_unsupported_urls_clearly() {
    let dir = tempfile::tempdir().unwrap();
    for (url, says) in [
        ("ipc:///tmp/kvbm-events.sock", "not supported yet"),
        ("127.0.0.1:80", "expected http://HOST:PORT"),
        ("https://h:1", "TLS is not supported"),
    ] {
        let out = recorder()
            .args(["record", "--from", url, "--out"])
            .arg(dir.path().join("x"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{url}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{url}: {err}");
    }
}

/// An engine of PoolGauge events (no request context, so any prefix of the
/// stream satisfies the invariants) behind a server we can restart.
struct Rig {
    rt: tokio::runtime::Runtime,
    emitter: Arc<Emitter>,
    ring: Arc<RingBuffer>,
    _feeder: Feeder,
    engine: ServedEngine,
    server: Option<ServerHandle>,
    addr: SocketAddr,
}

impl Rig {
    fn new(ring_capacity: usize) -> Rig {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let emitter = Arc::new(
            Emitter::new(0, BusConfig::default(), Arc::new(MonotonicClock::new())).unwrap(),
        );
        let tap = emitter.bus().take_tap().unwrap();
        let ring = Arc::new(RingBuffer::with_capacity(ring_capacity).unwrap());
        let engine = ServedEngine::new(ring.clone(), 0);
        let feeder =
            spawn_feeder(tap, ring.clone(), engine.signal(), FeederConfig::default()).unwrap();
        let mut rig = Rig {
            rt,
            emitter,
            ring,
            _feeder: feeder,
            engine,
            server: None,
            addr: "127.0.0.1:0".parse().unwrap(),
        };
        rig.start_server();
        rig
    }

    fn start_server(&mut self) {
        let cfg = ServerConfig {
            addr: self.addr,
            ..ServerConfig::default()
        };
        let engine = self.engine.clone();
        let h = self
            .rt
            .block_on(async { Server::bind(cfg, engine).await.map(|s| s.spawn()) })
            .expect("binding the same port again");
        self.addr = h.local_addr();
        self.server = Some(h);
    }

    fn stop_server(&mut self) {
        if let Some(h) = self.server.take() {
            self.rt.block_on(h.shutdown()).unwrap();
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn emit(&self, n: usize) {
        for _ in 0..n {
            self.emitter.emit(
                None,
                EventKind::PoolGauge {
                    tier: Tier::Host,
                    capacity: 8,
                    active: 1,
                    inactive: 2,
                    empty: 5,
                },
            );
        }
    }

    /// Waits until the ring holds everything emitted.
    fn settle(&self) {
        let t = Instant::now();
        while self.ring.counters().pushed < self.emitter.emitted() {
            assert!(t.elapsed() < Duration::from_secs(10), "the feeder stalled");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// What a client delivered.
#[derive(Default)]
struct Got {
    seqs: Vec<u64>,
    gaps: Vec<kvbm_attach::client::Gap>,
    disconnects: usize,
}

impl Got {
    fn pump(
        &mut self,
        client: &mut Client,
        rt: &tokio::runtime::Runtime,
        until: impl Fn(&Got) -> bool,
    ) {
        let t = Instant::now();
        while !until(self) {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "stalled at {} events",
                self.seqs.len()
            );
            let ev = rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(100), client.recv()).await
            });
            match ev {
                Ok(Some(ClientEvent::Events(v))) => self.seqs.extend(v.iter().map(|e| e.seq)),
                Ok(Some(ClientEvent::Gap(g))) => self.gaps.push(g),
                Ok(Some(ClientEvent::Disconnected { .. })) => self.disconnects += 1,
                Ok(Some(ClientEvent::Failed(e))) => panic!("{e}"),
                Ok(None) => panic!("the client stopped"),
                _ => {}
            }
        }
    }
}

fn fast_backoff(cfg: &mut ClientConfig) {
    cfg.backoff = Backoff {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(400),
    };
}

/// The client follows a server that goes away and comes back on the same
/// port: it backs off while it is down, resumes at `last seq + 1`, gets no
/// duplicate, and the events the ring overwrote meanwhile come as one
/// explicit gap with their exact range.
#[test]
fn the_client_resumes_across_a_server_restart_without_duplicates() {
    let mut rig = Rig::new(256);
    let mut cfg = ClientConfig::new(&rig.url()).unwrap().with_since(0);
    fast_backoff(&mut cfg);
    let mut client = Client::spawn(cfg, rig.rt.handle()).unwrap();
    let handle = client.handle();
    let mut got = Got::default();
    rig.emit(200);
    got.pump(&mut client, &rig.rt, |g| g.seqs.len() == 200);
    assert_eq!(got.seqs, (0..200).collect::<Vec<_>>());

    // Down: the client retries with backoff while the engine goes on.
    rig.stop_server();
    let t = Instant::now();
    loop {
        if let ConnState::Reconnecting { attempt, .. } = handle.state()
            && attempt >= 3
        {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{:?}",
            handle.state()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    rig.emit(1000); // the 256-event ring keeps only the last 256
    rig.settle();
    rig.start_server();
    got.pump(&mut client, &rig.rt, |g| g.seqs.last() == Some(&1199));
    assert!(got.disconnects >= 2, "{}", got.disconnects);
    let gaps = &got.gaps;
    // 200..=943 were overwritten while the server was down.
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    assert_eq!((gaps[0].from_seq, gaps[0].to_seq), (200, 943));
    assert_eq!(gaps[0].reason, GapReason::Overwritten);
    assert!(gaps[0].announced);
    let mut want: Vec<u64> = (0..200).collect();
    want.extend(944..1200);
    assert_eq!(got.seqs, want);
    // And live again, with a counter for everything.
    rig.emit(50);
    got.pump(&mut client, &rig.rt, |g| g.seqs.last() == Some(&1249));
    let c = handle.counters();
    assert_eq!(c.events, 506);
    assert_eq!(c.gap_events, 744);
    assert_eq!(c.unannounced_gap_events, 0);
    assert!(c.connects >= 2);
    assert!(handle.state().is_connected());
}

/// `record --from` across a server restart: the log has every event once,
/// the overwritten range in the sidecar as a placed gap, and `check`
/// accounts for it (exit 0).
#[test]
fn record_from_across_a_restart_accounts_for_the_gap() {
    let mut rig = Rig::new(128);
    rig.emit(100);
    rig.settle();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("restart.kvbm");
    let child = recorder()
        .args(["record", "--from", &rig.url(), "--out"])
        .arg(&log)
        .args(["--events", "400"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Served(child);
    // Let it catch up, then restart the server under it.
    let t = Instant::now();
    while rig.server.as_ref().unwrap().stats().events_sent < 100 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the recorder never read"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    rig.stop_server();
    rig.emit(500); // 100..=471 are overwritten (the ring keeps 472..=599)
    rig.settle();
    std::thread::sleep(Duration::from_millis(200));
    rig.start_server();
    // The ring's 128 after the gap, then 200 more (it stops at 400 events).
    let t = Instant::now();
    while rig.server.as_ref().unwrap().stats().events_sent < 128 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the recorder never came back"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    for _ in 0..10 {
        rig.emit(20); // in small steps: the ring holds only 128
        std::thread::sleep(Duration::from_millis(30));
    }
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "record --from did not stop"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stdout = String::new();
    std::io::Read::read_to_string(child.0.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("gap: events 100..=471"), "{stderr}");
    assert!(stderr.contains("disconnected"), "{stderr}");
    let check = recorder().arg("check").arg(&log).output().unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    let side = kvbm_recorder::recorder::read_sidecar(&log).unwrap();
    assert_eq!(side.events, 400);
    assert_eq!(side.lost, 372);
    assert_eq!(side.gaps.len(), 1);
    assert_eq!(side.gaps[0].after_seq, Some(99));
    let read = kvbm_recorder::recorder::read_events(&log, |_| {}).unwrap();
    let seqs: Vec<u64> = read.events.iter().map(|e| e.seq).collect();
    let mut want: Vec<u64> = (0..100).collect();
    want.extend(472..772);
    assert_eq!(seqs, want, "every event once, in order");
}

/// Attached after the server's ring had overwritten the engine's first
/// events: the recording starts mid-stream, and `check` does not take
/// what began before it (requests, transfers, blocks) for a broken
/// invariant.
#[test]
fn record_from_after_the_ring_wrapped_then_check_passes() {
    let (_sim, url) = serve_sim(&[
        "--requests",
        "2000",
        "--rate",
        "40",
        "--prompt-len",
        "256",
        "--output-len",
        "16",
        "--real-time",
        "4",
        "--ring",
        "256",
        "--linger-s",
        "20",
    ]);
    // Long enough for far more than 256 events.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("late.kvbm");
    let (stdout, said) = record_then_check(&url, &log, "3");
    assert!(stdout.contains("the server no longer held the"), "{stdout}");
    assert!(said.contains("began before its first event"), "{said}");
    let v = inspect_json(&log);
    assert!(v["first_seq"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["seq_gaps"], 0, "{v}");
}
