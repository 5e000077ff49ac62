//! The vLLM KV-event source against a live publisher on loopback: a Rust
//! publisher built on the zeromq crate's PUB socket, serving the ROUTER side
//! of vLLM's replay protocol. Gap detection, replay over DEALER, publisher
//! restart, and `kvbm-recorder record --from zmq://`.

use kvbm_events::EventKind;
use kvbm_ingest::vllm::{END_SEQ, ZmqConfig, ZmqEndpoint, ZmqHandle, ZmqItem, ZmqSource};
use rmpv::Value;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const WAIT: Duration = Duration::from_secs(10);

fn s(x: &str) -> Value {
    Value::from(x)
}

/// A payload in vLLM's positional form: one BlockStored of `hashes` on GPU.
fn stored(hashes: &[u64]) -> Vec<u8> {
    let ev = Value::Array(vec![
        s("BlockStored"),
        Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
        Value::Nil,
        Value::Array((0..16 * hashes.len() as u32).map(Value::from).collect()),
        Value::from(16),
        Value::Nil,
        s("GPU"),
    ]);
    let v = Value::Array(vec![
        Value::F64(1_700_000_000.0),
        Value::Array(vec![ev]),
        Value::Nil,
    ]);
    let mut b = Vec::new();
    rmpv::encode::write_value(&mut b, &v).unwrap();
    b
}

fn port_of(ep: zeromq::Endpoint) -> u16 {
    match ep {
        zeromq::Endpoint::Tcp(_, p) => p,
        other => panic!("not tcp: {other}"),
    }
}

fn msg(frames: Vec<Vec<u8>>) -> ZmqMessage {
    let mut it = frames.into_iter();
    let mut m = ZmqMessage::from(it.next().unwrap());
    for f in it {
        m.push_back(f.into());
    }
    m
}

/// Every batch given to the publisher: (seq, payload).
type History = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// The test publisher: PUB for the stream, ROUTER answering replays from
/// everything it was given (published or "lost").
struct Publisher {
    sock: zeromq::PubSocket,
    port: u16,
    replay_port: u16,
    history: History,
    router: tokio::task::JoinHandle<()>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.router.abort();
    }
}

impl Publisher {
    async fn start() -> Publisher {
        let mut sock = zeromq::PubSocket::new();
        let port = port_of(sock.bind("tcp://127.0.0.1:0").await.unwrap());
        let mut router = zeromq::RouterSocket::new();
        let replay_port = port_of(router.bind("tcp://127.0.0.1:0").await.unwrap());
        let history: History = Arc::default();
        let h = history.clone();
        let router = tokio::spawn(async move {
            while let Ok(m) = router.recv().await {
                let f = m.into_vec();
                // [identity, "", start_seq]
                let (id, start) = (
                    f[0].to_vec(),
                    u64::from_be_bytes(f[2][..8].try_into().unwrap()),
                );
                let batch: Vec<(u64, Vec<u8>)> = h
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                for (seq, p) in batch {
                    let m = msg(vec![id.clone(), vec![], seq.to_be_bytes().to_vec(), p]);
                    router.send(m).await.unwrap();
                }
                let end = msg(vec![
                    id.clone(),
                    vec![],
                    END_SEQ.to_be_bytes().to_vec(),
                    vec![],
                ]);
                router.send(end).await.unwrap();
            }
        });
        Publisher {
            sock,
            port,
            replay_port,
            history,
            router,
        }
    }

    fn url(&self) -> String {
        format!("zmq://127.0.0.1:{}", self.port)
    }

    /// Keeps `seq` for replay; sends it unless `lose`.
    async fn publish(&mut self, seq: u64, payload: Vec<u8>, lose: bool) {
        self.history.lock().unwrap().push((seq, payload.clone()));
        if !lose {
            let m = msg(vec![vec![], seq.to_be_bytes().to_vec(), payload]);
            self.sock.send(m).await.unwrap();
        }
    }

    /// PUB drops what it sends before the subscription arrives: sends
    /// empty batches (seq 0, 1, 2, …) until the source has one, then one
    /// more, and waits for it. Returns the next seq to use.
    async fn warm_up(&mut self, h: &ZmqHandle) -> u64 {
        let empty = {
            let v = Value::Array(vec![Value::F64(1.0), Value::Array(vec![]), Value::Nil]);
            let mut b = Vec::new();
            rmpv::encode::write_value(&mut b, &v).unwrap();
            b
        };
        let t = tokio::time::Instant::now();
        let mut seq = 0;
        while h.received() == 0 {
            assert!(t.elapsed() < WAIT, "the source never received anything");
            self.publish(seq, empty.clone(), false).await;
            seq += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.history.lock().unwrap().clear();
        let last = seq + 5;
        // Whatever of these it already saw, it sees them in order now.
        for s in seq..=last {
            self.publish(s, empty.clone(), false).await;
        }
        while h.counters().last_seq != Some(last) {
            assert!(t.elapsed() < WAIT, "the warm-up never arrived");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        last + 1
    }
}

/// The next item about the stream (connection notices and the late join
/// of the warm-up skipped).
async fn next(src: &mut ZmqSource) -> ZmqItem {
    loop {
        let item = tokio::time::timeout(WAIT, src.recv())
            .await
            .expect("timed out")
            .expect("source ended");
        if !matches!(
            item,
            ZmqItem::Connected { .. } | ZmqItem::Joined { .. } | ZmqItem::Disconnected
        ) {
            return item;
        }
    }
}

fn registered(item: &ZmqItem) -> Vec<u64> {
    match item {
        ZmqItem::Events(e) => e
            .iter()
            .filter_map(|e| match e.kind {
                EventKind::BlockRegistered { sequence_hash, .. } => Some(sequence_hash.0),
                _ => None,
            })
            .collect(),
        _ => vec![],
    }
}

fn evicted(item: &ZmqItem) -> Vec<u64> {
    match item {
        ZmqItem::Events(e) => e
            .iter()
            .filter_map(|e| match e.kind {
                EventKind::BlockEvicted { sequence_hash, .. } => Some(sequence_hash.0),
                _ => None,
            })
            .collect(),
        _ => vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_are_reported_and_a_restart_recognised() {
    let mut p = Publisher::start().await;
    let cfg = ZmqConfig::new(ZmqEndpoint::parse(&p.url()).unwrap());
    let mut src = ZmqSource::spawn(cfg, &tokio::runtime::Handle::current());
    let h = src.handle();
    let seq = p.warm_up(&h).await;
    let base = h.counters();
    p.publish(seq, stored(&[1, 2]), false).await;
    p.publish(seq + 1, stored(&[3]), true).await; // lost
    p.publish(seq + 2, stored(&[4]), true).await; // lost
    p.publish(seq + 3, stored(&[5]), false).await;
    assert_eq!(registered(&next(&mut src).await), vec![1, 2]);
    assert_eq!(
        next(&mut src).await,
        ZmqItem::Gap {
            from_seq: seq + 1,
            to_seq: seq + 2
        }
    );
    assert_eq!(registered(&next(&mut src).await), vec![5]);
    // The publisher restarts behind the same connection: seq back to 0.
    p.publish(0, stored(&[9]), false).await;
    assert_eq!(
        next(&mut src).await,
        ZmqItem::Restart(kvbm_ingest::vllm::RestartAt {
            last_seq: seq + 3,
            new_seq: 0,
            cause: kvbm_ingest::vllm::RestartCause::SeqWentBack,
        })
    );
    let mut gone = evicted(&next(&mut src).await);
    gone.sort_unstable();
    assert_eq!(gone, vec![1, 2, 5]);
    assert_eq!(registered(&next(&mut src).await), vec![9]);
    let c = h.counters();
    assert_eq!(c.gaps - base.gaps, 1);
    assert_eq!(c.missed - base.missed, 2);
    assert_eq!(c.restarts - base.restarts, 1);
    assert_eq!(c.malformed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_from_the_replay_endpoint() {
    let mut p = Publisher::start().await;
    let mut cfg = ZmqConfig::new(ZmqEndpoint::parse(&p.url()).unwrap());
    cfg.replay = Some(ZmqEndpoint::parse(&format!("zmq://127.0.0.1:{}", p.replay_port)).unwrap());
    let mut src = ZmqSource::spawn(cfg, &tokio::runtime::Handle::current());
    let h = src.handle();
    let seq = p.warm_up(&h).await;
    let base = h.counters();
    p.publish(seq, stored(&[1]), false).await;
    p.publish(seq + 1, stored(&[2]), true).await;
    p.publish(seq + 2, stored(&[3, 4]), true).await;
    p.publish(seq + 3, stored(&[5]), false).await;
    let mut got = Vec::new();
    while got.len() < 5 {
        let item = next(&mut src).await;
        assert!(!matches!(item, ZmqItem::Gap { .. }), "{item:?}");
        got.extend(registered(&item));
    }
    assert_eq!(got, vec![1, 2, 3, 4, 5], "in publisher order");
    let c = h.counters();
    assert_eq!(c.gaps - base.gaps, 1);
    assert_eq!(c.missed - base.missed, 0);
    assert_eq!(c.replay_requests - base.replay_requests, 1);
    assert_eq!(c.replayed - base.replayed, 2);
    assert_eq!(c.replay_failures, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_replay_endpoint_leaves_a_counted_gap() {
    let mut p = Publisher::start().await;
    let mut cfg = ZmqConfig::new(ZmqEndpoint::parse(&p.url()).unwrap());
    // Nothing listens there.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    drop(dead);
    cfg.replay = Some(ZmqEndpoint::parse(&format!("zmq://127.0.0.1:{dead_port}")).unwrap());
    cfg.replay_timeout = Duration::from_millis(300);
    let mut src = ZmqSource::spawn(cfg, &tokio::runtime::Handle::current());
    let h = src.handle();
    let seq = p.warm_up(&h).await;
    p.publish(seq, stored(&[1]), true).await;
    p.publish(seq + 1, stored(&[2]), false).await;
    assert!(
        matches!(&next(&mut src).await, ZmqItem::ReplayFailed { error } if error.contains("timed out")),
        "the failure is reported"
    );
    assert_eq!(
        next(&mut src).await,
        ZmqItem::Gap {
            from_seq: seq,
            to_seq: seq
        }
    );
    assert_eq!(registered(&next(&mut src).await), vec![2]);
    assert!(h.counters().replay_failures >= 1);
}

#[test]
fn record_from_zmq_writes_a_log_with_gaps_as_losses() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("log");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut p = rt.block_on(Publisher::start());
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
        .args([
            "record",
            "--from",
            &p.url(),
            "--events",
            "120",
            "--duration-s",
            "20",
            "--out",
        ])
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Publish until the recorder has its events and exits; every 10th
    // batch is lost.
    let status = rt.block_on(async {
        let mut seq = 0u64;
        let t = tokio::time::Instant::now();
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                return st;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the recorder did not stop"
            );
            p.publish(seq, stored(&[seq * 2 + 1, seq * 2 + 2]), seq % 10 == 7)
                .await;
            seq += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let o = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("recorded 120 events"), "{stdout}");
    let side: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("recording.json")).unwrap()).unwrap();
    assert_eq!(side["source"], p.url().as_str());
    assert_eq!(side["stream_complete"], false);
    assert!(side["lost"].as_u64().unwrap() >= 1, "{side}");
    assert!(side["client"]["gaps"].as_u64().unwrap() >= 1, "{side}");
    let inspect = std::process::Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
        .args(["inspect", "--json"])
        .arg(&out)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
    assert_eq!(v["events"], 120, "{v}");
    // Each lost publisher batch is one hole in the kvbm seq.
    assert_eq!(v["seq_gaps"], side["lost"], "{v}");
    assert!(
        v["counts_by_kind"]["BlockRegistered"].as_u64().unwrap() > 0,
        "{v}"
    );
    assert!(
        v["counts_by_kind"]["PoolGauge"].as_u64().unwrap() > 0,
        "{v}"
    );
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
        .arg("check")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
}
