//! The real `kvbm-console` on a ZMQ source in tmux, with its stderr on the
//! terminal as a user runs it: the clock is the time of day (vLLM stamps
//! `time.time()`), the Events view's time column is whole, a failed replay
//! shows in the header, a publisher that goes away shows as gone (not
//! `ZMQ SUBSCRIBED`), and nothing (the zeromq crate's reconnection warnings
//! included) is written over the screen; the publisher coming back is a
//! restart in the header.
//!
//! Needs `tmux`: without it the test fails, saying how to install it.

use kvbm_testkit::tmux::Tmux;
use rmpv::Value;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use zeromq::{Socket, SocketSend, ZmqMessage};

/// `kvbm-console ARGS` in a real terminal (tmux; the test fails without it).
fn console(name: &str, args: &[&str], w: u16, h: u16) -> Tmux {
    Tmux::start(
        name,
        "",
        env!("CARGO_BIN_EXE_kvbm-console"),
        args,
        (w, h),
        false,
    )
}

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

/// A vLLM batch stamped now: one BlockStored of `h`.
fn batch(h: u64) -> Vec<u8> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let ev = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (
            Value::from("block_hashes"),
            Value::Array(vec![Value::from(h)]),
        ),
        (Value::from("parent_block_hash"), Value::Nil),
        (Value::from("token_ids"), Value::Array(vec![])),
        (Value::from("block_size"), Value::from(32)),
        (Value::from("lora_id"), Value::Nil),
        (Value::from("medium"), Value::from("GPU")),
        (Value::from("lora_name"), Value::Nil),
    ]);
    let v = Value::Array(vec![
        Value::F64(now.as_secs_f64()),
        Value::Array(vec![ev]),
        Value::from(0),
    ]);
    let mut b = Vec::new();
    rmpv::encode::write_value(&mut b, &v).unwrap();
    b
}

async fn publish(sock: &mut zeromq::PubSocket, seq: u64, h: u64) {
    let mut m = ZmqMessage::from(Vec::<u8>::new());
    m.push_back(seq.to_be_bytes().to_vec().into());
    m.push_back(batch(h).into());
    sock.send(m).await.unwrap();
}

/// Publishes on `sock` (from `seq` on, every 50 ms) until `done(screen)`.
async fn publish_until(
    sock: &mut zeromq::PubSocket,
    seq: &mut u64,
    t: &Tmux,
    what: &str,
    done: impl Fn(&str) -> bool,
) -> String {
    let start = Instant::now();
    loop {
        publish(sock, *seq, 1000 + *seq).await;
        *seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let s = t.screen();
        if done(&s) {
            return s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}; screen:\n{s}"
        );
    }
}

fn top(screen: &str) -> &str {
    screen.lines().next().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zmq_source_on_screen_time_gaps_a_gone_publisher_and_no_stray_logs() {
    let port = free_port();
    let dead = free_port(); // nothing answers replays there
    let mut sock = zeromq::PubSocket::new();
    sock.bind(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
    let url = format!("zmq://127.0.0.1:{port}");
    let replay = format!("zmq://127.0.0.1:{dead}");
    let t = console(
        "zmq",
        &["attach", &url, "--replay-endpoint", &replay],
        160,
        30,
    );
    let mut seq = 0;
    publish_until(&mut sock, &mut seq, &t, "events", |s| {
        top(s).contains("ZMQ SUBSCRIBED") && !s.contains(" 0 events")
    })
    .await;
    // The Events view: the time of day, whole, in the header and the rows.
    t.send("6");
    let s = publish_until(&mut sock, &mut seq, &t, "the events view", |s| {
        s.contains("BlockRegistered")
    })
    .await;
    let clock = regex_like_time(top(&s)).expect("a HH:MM:SS.mmm clock in the header");
    assert!(clock.len() == 12, "{clock}: {s}");
    let row = s
        .lines()
        .find(|l| l.contains("BlockRegistered"))
        .unwrap()
        .to_string();
    assert!(regex_like_time(&row).is_some(), "a whole time in: {row}");
    // A gap whose replay fails: in the header. (Joining after seq 0 may
    // have asked for the batches before it already.)
    let before = replay_failures(top(&t.screen()));
    seq += 3;
    publish_until(&mut sock, &mut seq, &t, "the replay failure", |s| {
        replay_failures(top(s)) > before
    })
    .await;
    // The publisher goes away.
    drop(sock);
    let start = Instant::now();
    let mut s = t.screen();
    while !top(&s).contains("ZMQ PUBLISHER GONE") {
        assert!(start.elapsed() < Duration::from_secs(10), "{s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        s = t.screen();
    }
    // Reconnection attempts run on; none may write over the screen.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let s = t.screen();
    assert!(top(&s).contains("ZMQ PUBLISHER GONE"), "{s}");
    for stray in ["WARN", "Reconnection", "zeromq"] {
        assert!(
            !s.contains(stray),
            "`{stray}` written over the screen:\n{s}"
        );
    }
    assert!(s.lines().count() <= 30);
    // It comes back (a new engine: seq from 0): a restart, subscribed again.
    let mut sock = zeromq::PubSocket::new();
    sock.bind(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
    let mut seq = 0;
    let s = publish_until(&mut sock, &mut seq, &t, "the restart", |s| {
        top(s).contains("ZMQ SUBSCRIBED") && top(s).contains("restarts 1")
    })
    .await;
    assert!(!s.contains("WARN"), "{s}");
    t.send("q");
    assert_eq!(t.exit_code(10), 0);
}

/// `replay failed N` in the header, or 0.
fn replay_failures(top: &str) -> u64 {
    top.split("replay failed ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The first `HH:MM:SS.mmm` in `line`.
fn regex_like_time(line: &str) -> Option<String> {
    let b: Vec<char> = line.chars().collect();
    let pat = "dd:dd:dd.ddd";
    (0..b.len().saturating_sub(pat.len() - 1)).find_map(|i| {
        let w: String = b[i..i + pat.len()].iter().collect();
        let ok = w.chars().zip(pat.chars()).all(|(c, p)| match p {
            'd' => c.is_ascii_digit(),
            _ => c == p,
        });
        let before_ok = i == 0 || !b[i - 1].is_ascii_digit() && b[i - 1] != ':';
        (ok && before_ok).then_some(w)
    })
}
