//! One replay answer is bounded in time and in frames, against a ROUTER on
//! loopback that never sends its end marker: it drips frames (each within
//! the per-frame timeout, so that timeout alone waited forever), or floods
//! them. Past the bound the replay counts as failed, what it brought in
//! range is kept, the rest of the gap is lost, and live reading resumes.

use kvbm_events::EventKind;
use kvbm_ingest::vllm::{Replay, ZmqConfig, ZmqEndpoint, ZmqItem, ZmqReplay, ZmqSource};
use rmpv::Value;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Longer than any bound under test: a fetch still waiting then never ends.
const WAIT: Duration = Duration::from_secs(15);

fn stored(h: u64) -> Vec<u8> {
    let ev = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(vec![Value::from(h)]),
        Value::Nil,
        Value::Array(vec![]),
        Value::from(16),
        Value::Nil,
        Value::from("GPU"),
    ]);
    let v = Value::Array(vec![Value::F64(1.0), Value::Array(vec![ev]), Value::Nil]);
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

/// A replay endpoint that answers each request with the batch at its start
/// seq (hash 1000 + seq), then frames past any range (seq 10^12 + i), one
/// every `every`, and never the end marker.
async fn endless_router(every: Duration) -> (u16, tokio::task::JoinHandle<()>) {
    let mut router = zeromq::RouterSocket::new();
    let port = port_of(router.bind("tcp://127.0.0.1:0").await.unwrap());
    let task = tokio::spawn(async move {
        while let Ok(m) = router.recv().await {
            let f = m.into_vec();
            let id = f[0].to_vec();
            let start = u64::from_be_bytes(f[2][..8].try_into().unwrap());
            let first = vec![
                id.clone(),
                vec![],
                b"kv".to_vec(),
                start.to_be_bytes().to_vec(),
                stored(1000 + start),
            ];
            if router.send(msg(first)).await.is_err() {
                continue;
            }
            for i in 0u64.. {
                let seq = 1_000_000_000_000 + i;
                let m = vec![
                    id.clone(),
                    vec![],
                    b"kv".to_vec(),
                    seq.to_be_bytes().to_vec(),
                    stored(1),
                ];
                // The requester has gone: serve the next one.
                if router.send(msg(m)).await.is_err() {
                    break;
                }
                if !every.is_zero() {
                    tokio::time::sleep(every).await;
                } else if i % 64 == 0 {
                    tokio::task::yield_now().await;
                }
            }
        }
    });
    (port, task)
}

fn endpoint(port: u16) -> ZmqEndpoint {
    ZmqEndpoint::parse(&format!("zmq://127.0.0.1:{port}")).unwrap()
}

/// A frame every 100 ms, never the end marker: the 2 s per-frame timeout
/// never fired and the fetch never returned. The deadline ends it, and the
/// in-range batch it brought is handed on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dripping_answer_ends_at_the_deadline_keeping_what_it_brought() {
    let (port, router) = endless_router(Duration::from_millis(100)).await;
    let mut replay = ZmqReplay::new(endpoint(port), Duration::from_secs(2), 1 << 14)
        .bounded(Duration::from_millis(800), 1 << 16);
    let t = Instant::now();
    let r = tokio::time::timeout(WAIT, replay.fetch(5, 9))
        .await
        .expect("the fetch never ended");
    let took = t.elapsed();
    router.abort();
    let f = r.expect_err("no end marker: a failure");
    assert!(
        f.error.contains("no end marker within 0.8 s"),
        "{}",
        f.error
    );
    assert_eq!(f.partial, vec![(5, stored(1005))]);
    assert!(took < Duration::from_secs(3), "{took:?}");
}

/// Frames as fast as the socket takes them, never the end marker: cut off
/// at the frame cap, long before the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_answer_ends_at_the_frame_cap() {
    let (port, router) = endless_router(Duration::ZERO).await;
    let mut replay = ZmqReplay::new(endpoint(port), Duration::from_secs(2), 1 << 14)
        .bounded(Duration::from_secs(60), 2_000);
    let r = tokio::time::timeout(WAIT, replay.fetch(5, 9))
        .await
        .expect("the fetch never ended");
    router.abort();
    let f = r.expect_err("no end marker: a failure");
    assert!(
        f.error
            .contains("more than 2000 frames without an end marker"),
        "{}",
        f.error
    );
    assert_eq!(f.partial, vec![(5, stored(1005))]);
}

/// Through the source: a gap asked of a dripping endpoint is reported
/// failed within the deadline, what it brought is applied, the rest is a
/// counted gap, and the live batches after it still arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_replay_past_its_deadline_live_reading_resumes() {
    let (replay_port, router) = endless_router(Duration::from_millis(100)).await;
    let mut publisher = zeromq::PubSocket::new();
    let port = port_of(publisher.bind("tcp://127.0.0.1:0").await.unwrap());
    let mut cfg = ZmqConfig::new(endpoint(port));
    cfg.replay = Some(endpoint(replay_port));
    cfg.replay_deadline = Duration::from_millis(800);
    let mut src = ZmqSource::spawn(cfg, &tokio::runtime::Handle::current());
    let h = src.handle();
    let send = |seq: u64, h: u64| msg(vec![b"kv".to_vec(), seq.to_be_bytes().to_vec(), stored(h)]);
    // PUB drops what it sends before the subscription arrives.
    let t = Instant::now();
    let mut seq = 0;
    while h.received() == 0 {
        assert!(t.elapsed() < WAIT, "the source never received anything");
        publisher.send(send(seq, 1)).await.unwrap();
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let last = h.counters().last_seq.unwrap();
    // last+1 ..= last+4 are lost on the link; the replay asked for them
    // brings last+1 and then drips forever.
    publisher.send(send(last + 5, 42)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    publisher.send(send(last + 6, 43)).await.unwrap();
    let mut items = Vec::new();
    let mut hashes = Vec::new();
    while !hashes.contains(&43) {
        let item = tokio::time::timeout(WAIT, src.recv())
            .await
            .expect("live reading never resumed")
            .expect("the source ended");
        if let ZmqItem::Events(e) = &item {
            hashes.extend(e.iter().filter_map(|e| match e.kind {
                EventKind::BlockRegistered { sequence_hash, .. } => Some(sequence_hash.0),
                _ => None,
            }));
        }
        items.push(item);
    }
    router.abort();
    assert!(
        items.iter().any(
            |i| matches!(i, ZmqItem::ReplayFailed { error } if error.contains("no end marker"))
        ),
        "{items:?}"
    );
    assert!(items.contains(&ZmqItem::Gap {
        from_seq: last + 2,
        to_seq: last + 4
    }));
    assert!(hashes.ends_with(&[1000 + last + 1, 42, 43]), "{hashes:?}");
    let c = h.counters();
    assert_eq!((c.replay_failures, c.replayed, c.missed), (1, 1, 3));
}
