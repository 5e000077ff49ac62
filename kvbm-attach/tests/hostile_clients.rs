//! The attach server against clients that do not play fair, on loopback,
//! each bounded in count and time: a console that freezes while it owns a
//! pause, a breakpoint set without an owner, bodies that never come or
//! claim to be huge, one address taking every place, a flood of refusals,
//! requests the HTTP layer cannot parse, bodies that are not objects, a
//! flood of breakpoints set without an owner, a client id borrowed by
//! someone else, and a client that pipelines commands. Each test states the promise it checks.

use futures_util::{SinkExt, StreamExt};
use kvbm_attach::server::{ServedEngine, Server, ServerConfig, ServerHandle};
use kvbm_core::hooks::Breakpoints;
use kvbm_events::EntryPoint;
use kvbm_events::breakpoint::{BreakpointSpec, CallInfo};
use kvbm_events::control::{BreakpointsView, ControlCommand, ControlResult};
use kvbm_events::ring::RingBuffer;
use kvbm_schema::protocol::{Added, ApiError, ClientMsg, ServerMsg};
use std::io::{BufRead, BufReader, Read};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::{self, Message};

// ---------------------------------------------------------------- helpers

/// An engine with breakpoints and nothing else (no events needed).
fn engine(deadline: Duration) -> (ServedEngine, Arc<Breakpoints>) {
    let bps = Arc::new(Breakpoints::new(None, deadline));
    let ring = Arc::new(RingBuffer::with_capacity(1024).unwrap());
    (ServedEngine::new(ring, 0).with_control(bps.clone()), bps)
}

fn local() -> ServerConfig {
    ServerConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        ..ServerConfig::default()
    }
}

async fn serve(cfg: ServerConfig, engine: ServedEngine) -> ServerHandle {
    Server::bind(cfg, engine).await.unwrap().spawn()
}

/// A TCP connection from source address `from` (any 127.x.y.z reaches a
/// server on 127.0.0.1).
async fn connect_from(from: &str, to: SocketAddr) -> std::io::Result<TcpStream> {
    let s = TcpSocket::new_v4()?;
    s.bind(SocketAddr::new(from.parse::<IpAddr>().unwrap(), 0))?;
    s.connect(to).await
}

#[derive(Debug)]
struct Resp {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Resp {
    fn error(&self) -> ApiError {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "not a JSON error ({e}): {}\n{:?}",
                self.head,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }
}

fn parse(raw: &[u8]) -> Option<Resp> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..end]).to_string();
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some(Resp {
        status,
        head,
        body: raw[end + 4..].to_vec(),
    })
}

/// Writes `raw` and reads the answer to the end (at most `secs`).
async fn exchange(mut s: TcpStream, raw: &[u8], secs: u64) -> Option<Resp> {
    s.write_all(raw).await.ok()?;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(secs), s.read_to_end(&mut out)).await;
    parse(&out)
}

fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut r = format!("{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n");
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    r.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut b = r.into_bytes();
    b.extend_from_slice(body);
    b
}

async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    hdr: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let s = TcpStream::connect(addr).await.unwrap();
    exchange(s, &request(method, path, hdr, body), 10)
        .await
        .expect("an answer")
}

type WsStream =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn ws(addr: SocketAddr) -> (WsStream, u64, String) {
    let (mut s, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/events?version=3"))
        .await
        .unwrap();
    loop {
        let m = s.next().await.unwrap().unwrap();
        if let Message::Text(t) = m
            && let Ok(ServerMsg::Hello {
                client, client_key, ..
            }) = serde_json::from_str(t.as_str())
        {
            return (s, client, client_key);
        }
    }
}

async fn send(s: &mut WsStream, id: u64, command: ControlCommand) {
    let t = serde_json::to_string(&ClientMsg::Control { id, command }).unwrap();
    s.send(Message::text(t)).await.unwrap();
}

/// Reads until the reply to `id`.
async fn reply(s: &mut WsStream, id: u64) -> Result<ControlResult, ApiError> {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), s.next())
            .await
            .expect("a reply within 10 s")
            .expect("open")
            .expect("readable");
        if let Message::Text(t) = m
            && let Ok(ServerMsg::Reply { id: got, result }) = serde_json::from_str(t.as_str())
            && got == id
        {
            return result;
        }
    }
}

/// An engine thread paused at a breakpoint on request `r1`; joins when the
/// pause ends.
fn paused_call(bps: &Arc<Breakpoints>) -> std::thread::JoinHandle<()> {
    let b = bps.clone();
    let h = std::thread::spawn(move || {
        b.check(&CallInfo::new(EntryPoint::CreateSlot).with_request(Arc::from("r1")));
    });
    let t = Instant::now();
    while bps.paused().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(10), "never paused");
        std::thread::sleep(Duration::from_millis(5));
    }
    h
}

/// Waits (bounded) for a thread to finish; how long it took.
async fn joined_within(h: std::thread::JoinHandle<()>, secs: u64) -> Duration {
    let t = Instant::now();
    while !h.is_finished() {
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "the engine is still paused after {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    h.join().unwrap();
    t.elapsed()
}

fn on_r1() -> BreakpointSpec {
    BreakpointSpec::default().with_request("r1")
}

// ---------------------------------------------------------------- stuck

/// A console that owns a pause and then stops reading (stopped, or its
/// connection half-open) answers no ping: the server drops it within the
/// silence timeout and the engine goes on, long before the pause's own
/// deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_owner_is_dropped_and_its_pause_released() {
    let (engine, bps) = engine(Duration::from_secs(120));
    let cfg = ServerConfig {
        ping_interval: Duration::from_millis(100),
        silence_timeout: Duration::from_millis(600),
        ..local()
    };
    let h = serve(cfg, engine).await;
    let (mut s, _, _) = ws(h.local_addr()).await;
    send(&mut s, 1, ControlCommand::Add { spec: on_r1() }).await;
    assert!(matches!(
        reply(&mut s, 1).await,
        Ok(ControlResult::Added(_))
    ));
    let paused = paused_call(&bps);
    // From here on the client reads nothing (and so answers no ping); the
    // socket stays open.
    let took = joined_within(paused, 10).await;
    assert!(bps.list().is_empty(), "its breakpoint is gone too");
    assert_eq!(h.stats().silent_disconnects, 1, "{:?}", h.stats());
    eprintln!("a frozen owner's pause ended after {took:?} (silence timeout 600 ms)");
    drop(s);
    h.shutdown().await.unwrap();
}

/// A client that keeps reading is pinged and answers: it is never dropped
/// as silent, however long nothing else happens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_is_never_silent() {
    let (engine, _bps) = engine(Duration::from_secs(120));
    let cfg = ServerConfig {
        ping_interval: Duration::from_millis(50),
        silence_timeout: Duration::from_millis(300),
        ..local()
    };
    let h = serve(cfg, engine).await;
    let (mut s, _, _) = ws(h.local_addr()).await;
    let until = Instant::now() + Duration::from_millis(1500);
    let mut pings = 0;
    while Instant::now() < until {
        if let Ok(Some(Ok(Message::Ping(_)))) =
            tokio::time::timeout(Duration::from_millis(100), s.next()).await
        {
            pings += 1;
        }
    }
    assert!(pings >= 5, "{pings} pings in 1.5 s");
    send(&mut s, 1, ControlCommand::List).await;
    assert!(reply(&mut s, 1).await.is_ok(), "still connected");
    assert_eq!(h.stats().silent_disconnects, 0);
    h.shutdown().await.unwrap();
}

/// A breakpoint set over HTTP without a client belongs to a lease: when
/// it runs out the breakpoint is removed and the call it paused resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_breakpoint_set_without_a_client_has_a_lease() {
    let (engine, bps) = engine(Duration::from_secs(120));
    let cfg = ServerConfig {
        lease: Duration::from_millis(500),
        ..local()
    };
    let h = serve(cfg, engine).await;
    let addr = h.local_addr();
    let r = http(
        addr,
        "POST",
        "/breakpoints",
        &[],
        br#"{"request":{"Exact":"r1"}}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
    let added: Added = serde_json::from_slice(&r.body).unwrap();
    let lease = added.lease.expect("a lease");
    assert_eq!(lease.expires_in_ms, 500);
    let v: BreakpointsView =
        serde_json::from_slice(&http(addr, "GET", "/breakpoints", &[], b"").await.body).unwrap();
    assert_eq!(v.breakpoints[0].spec.owner, Some(lease.owner));
    let paused = paused_call(&bps);
    joined_within(paused, 10).await;
    assert!(bps.list().is_empty());
    assert_eq!(h.stats().leases_expired, 1);
    // A step is a one-shot breakpoint: leased too.
    assert_eq!(http(addr, "POST", "/step", &[], b"").await.status, 200);
    let b = bps.clone();
    let stepped = std::thread::spawn(move || b.check(&CallInfo::new(EntryPoint::CreateSlot)));
    joined_within(stepped, 10).await;
    assert_eq!(h.stats().leases_expired, 2);
    h.shutdown().await.unwrap();
}

/// Leases are bounded (4,096). Past the bound a new one is refused while
/// every lease still owns something, and counted; once what they set is
/// cleared, they are forgotten to make room, but not the lease of an armed
/// step, which the listed breakpoints do not show: forgotten, that step
/// would never lapse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_lease_bound_only_leases_that_own_nothing_are_forgotten() {
    const BOUND: usize = 4096;
    let bps =
        Arc::new(Breakpoints::new(None, Duration::from_secs(120)).with_max_breakpoints(BOUND));
    let ring = Arc::new(RingBuffer::with_capacity(1024).unwrap());
    let engine = ServedEngine::new(ring, 0).with_control(bps.clone());
    let cfg = ServerConfig {
        lease: Duration::from_secs(600),
        ..local()
    };
    let h = serve(cfg, engine).await;
    let addr = h.local_addr();
    let add = br#"{"request":{"Exact":"never"}}"#;
    assert_eq!(http(addr, "POST", "/step", &[], b"").await.status, 200);
    for _ in 1..BOUND {
        let r = http(addr, "POST", "/breakpoints", &[], add).await;
        assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
    }
    let r = http(addr, "POST", "/breakpoints", &[], add).await;
    assert_eq!(r.status, 409, "{:?}", String::from_utf8_lossy(&r.body));
    let st = h.stats();
    assert_eq!((st.leases_alive, st.leases_refused), (BOUND, 1));
    // Cleared one by one (clearing all would disarm the step too).
    for b in bps.list() {
        assert!(bps.clear(b.id));
    }
    assert!(bps.is_armed());
    let r = http(addr, "POST", "/breakpoints", &[], add).await;
    assert_eq!(r.status, 200, "{:?}", String::from_utf8_lossy(&r.body));
    let st = h.stats();
    assert_eq!(
        (st.leases_alive, st.leases_refused),
        (2, 1),
        "the step's lease and the new breakpoint's"
    );
    let m = http(addr, "GET", "/metrics", &[], b"").await;
    let m = String::from_utf8_lossy(&m.body);
    assert!(m.contains("\nkvbm_breakpoint_leases 2\n"), "{m}");
    assert!(
        m.contains("\nkvbm_breakpoint_leases_refused_total 1\n"),
        "{m}"
    );
    h.shutdown().await.unwrap();
}

// ---------------------------------------------------------------- bodies

/// A POST whose body never arrives is answered `408` within the request
/// deadline and its connection closed; a declared body over the limit is
/// refused at once, without waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_that_do_not_come_or_are_too_large_are_refused_in_time() {
    let (engine, _bps) = engine(Duration::from_secs(60));
    let cfg = ServerConfig {
        request_timeout: Duration::from_millis(500),
        ..local()
    };
    let h = serve(cfg, engine).await;
    let addr = h.local_addr();
    // Headers promise 100 bytes; 10 come.
    let mut raw = b"POST /resume HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n".to_vec();
    raw.extend_from_slice(b"{\"pause_id");
    let t = Instant::now();
    let r = exchange(TcpStream::connect(addr).await.unwrap(), &raw, 10)
        .await
        .expect("answered, not left hanging");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(
        (r.status, r.error().code.as_str()),
        (408, "request_timeout")
    );
    assert_eq!(h.stats().request_timeouts, 1);
    // 2^40 bytes declared: 413 at once.
    let raw = b"POST /breakpoints HTTP/1.1\r\nHost: t\r\nContent-Length: 1099511627776\r\n\r\n";
    let t = Instant::now();
    let r = exchange(TcpStream::connect(addr).await.unwrap(), raw, 10)
        .await
        .expect("answered");
    assert!(
        t.elapsed() < Duration::from_millis(400),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(
        (r.status, r.error().code.as_str()),
        (413, "payload_too_large")
    );
    h.shutdown().await.unwrap();
}

// ---------------------------------------------------------------- places

/// One address cannot take every place: past `max_connections_per_ip`
/// it is refused while another address is still served; and when every
/// place is taken, a request from 127.0.0.1 still gets the one kept for
/// loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_take_every_place_and_loopback_keeps_one() {
    let (engine, _bps) = engine(Duration::from_secs(60));
    let cfg = ServerConfig {
        max_clients: 2,
        max_connections: 8,
        max_connections_per_ip: 4,
        ..local()
    };
    let h = serve(cfg, engine).await;
    let addr = h.local_addr();
    let wait_open = |n: usize| {
        let h = &h;
        async move {
            let t = Instant::now();
            while h.stats().connections_open < n {
                assert!(t.elapsed() < Duration::from_secs(10), "{:?}", h.stats());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    // 127.0.0.2 takes its four places with connections that send nothing.
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(connect_from("127.0.0.2", addr).await.unwrap());
    }
    wait_open(4).await;
    // A fifth from the same address is refused, and says why.
    let r = exchange(
        connect_from("127.0.0.2", addr).await.unwrap(),
        &request("GET", "/health", &[], b""),
        10,
    )
    .await
    .expect("told why");
    assert_eq!(r.status, 503);
    let e = r.error();
    assert_eq!(e.code, "too_many_connections");
    assert!(e.message.contains("127.0.0.2"), "{}", e.message);
    // Another address is served.
    let r = exchange(
        connect_from("127.0.0.3", addr).await.unwrap(),
        &request("GET", "/health", &[], b""),
        10,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    // 127.0.0.3 takes the last four places: every place is taken.
    for _ in 0..4 {
        idle.push(connect_from("127.0.0.3", addr).await.unwrap());
    }
    wait_open(8).await;
    let r = exchange(
        connect_from("127.0.0.4", addr).await.unwrap(),
        &request("GET", "/health", &[], b""),
        10,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 503, "full");
    // A health check from 127.0.0.1 gets the place kept for loopback, one
    // request at a time; it takes no WebSocket.
    for _ in 0..3 {
        let r = exchange(
            connect_from("127.0.0.1", addr).await.unwrap(),
            &request("GET", "/health", &[], b""),
            10,
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200, "{}", r.head);
    }
    match tokio_tungstenite::connect_async(format!("ws://{addr}/events?version=3")).await {
        Err(tungstenite::Error::Http(resp)) => assert_eq!(resp.status(), 503),
        other => panic!("a WebSocket on the reserved place: {other:?}"),
    }
    let st = h.stats();
    assert!(st.reserve_used >= 3, "{st:?}");
    assert_eq!(st.connections_refused, 2, "{st:?}");
    drop(idle);
    h.shutdown().await.unwrap();
}

/// A flood of refused connections writes a handful of log lines, not one
/// per refusal; the rest are counted in `/metrics`. Against the real
/// `kvbm-sim --serve`, its stderr counted.
#[test]
fn refusals_are_logged_at_a_bounded_rate_and_counted() {
    let mut child =
        std::process::Command::new(kvbm_testkit::bin::workspace_bin("kvbm-sim", "kvbm-sim"))
            .args([
                "--serve",
                "127.0.0.1:0",
                "--real-time",
                "1",
                "--requests",
                "1",
            ])
            .args(["--max-clients", "1", "--max-connections", "2"])
            .args(["--linger-s", "60"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("serving on http://")
        .unwrap_or_else(|| panic!("{line:?}"))
        .parse()
        .unwrap();
    // Read as it comes, so that a chatty server never blocks on a full pipe.
    let mut stderr = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut err = String::new();
        let _ = stderr.read_to_string(&mut err);
        err
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let refused = rt.block_on(async {
        // Two places and the loopback reserve, held by connections that
        // send nothing (each is closed by the header deadline in 10 s, or
        // 2 s for the reserve, so the flood is kept short).
        let mut hold = Vec::new();
        for _ in 0..3 {
            hold.push(TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut refused = 0;
        for _ in 0..1000 {
            let Ok(mut s) = TcpStream::connect(addr).await else {
                continue;
            };
            let mut b = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut b)).await;
            if parse(&b).is_some_and(|r| r.status == 503) {
                refused += 1;
            }
        }
        let metrics = http(hold_free(addr).await, "GET", "/metrics", &[], b"").await;
        drop(hold);
        (refused, String::from_utf8_lossy(&metrics.body).to_string())
    });
    let _ = child.kill();
    let _ = child.wait();
    let err = log.join().unwrap();
    let (refused, metrics) = refused;
    let logged = err
        .lines()
        .filter(|l| l.contains("refusing a connection"))
        .count();
    eprintln!("{refused} refused, {logged} log lines");
    assert!(refused >= 900, "{refused} refused");
    assert!(logged <= 3, "{logged} lines for {refused} refusals:\n{err}");
    let unlogged: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvbm_http_refusals_unlogged_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(unlogged + logged as u64 >= refused, "{unlogged} unlogged");
}

/// The address to reach a server whose places are held: waits until one
/// frees (the reserve's 2 s header deadline) and returns it.
async fn hold_free(addr: SocketAddr) -> SocketAddr {
    let t = Instant::now();
    loop {
        let s = TcpStream::connect(addr).await.unwrap();
        if let Some(r) = exchange(s, &request("GET", "/health", &[], b""), 5).await
            && r.status == 200
        {
            return addr;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "never a free place");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------- errors

/// What the HTTP layer cannot parse is answered like every other error:
/// a JSON body and the protocol header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unparsable_requests_get_json_errors_too() {
    let (engine, _bps) = engine(Duration::from_secs(60));
    let h = serve(local(), engine).await;
    let addr = h.local_addr();
    // More headers than the HTTP layer reads (small, so the whole request
    // is read and the answer is not lost to a reset).
    let many: String = (0..200).map(|i| format!("X-H{i}: v\r\n")).collect();
    let huge = format!("GET /health HTTP/1.1\r\nHost: t\r\n{many}\r\n");
    for (raw, status) in [
        (b"GARBAGE\r\n\r\n".to_vec(), 400),
        (b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n".to_vec(), 400),
        (
            b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: x\r\n\r\n".to_vec(),
            400,
        ),
        (huge.into_bytes(), 431),
    ] {
        let r = exchange(TcpStream::connect(addr).await.unwrap(), &raw, 10)
            .await
            .expect("an answer");
        assert_eq!(r.status, status, "{}", r.head);
        assert_eq!(
            r.header("x-kvbm-protocol").as_deref(),
            Some("3"),
            "{}",
            r.head
        );
        let e = r.error();
        assert!(!e.message.is_empty(), "{e:?}");
    }
    assert_eq!(h.stats().unparsable_requests, 4);
    h.shutdown().await.unwrap();
}

/// A body is an object or nothing: `[]` is not an empty body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_must_be_objects() {
    let (engine, _bps) = engine(Duration::from_secs(60));
    let h = serve(local(), engine).await;
    let addr = h.local_addr();
    for path in ["/resume", "/step", "/breakpoints/clear"] {
        for body in [&b"[]"[..], b"[5]", b"null", b"3"] {
            let r = http(addr, "POST", path, &[], body).await;
            assert_eq!(
                (r.status, r.error().code.as_str()),
                (400, "bad_request"),
                "{path} {:?}",
                String::from_utf8_lossy(body)
            );
        }
        assert_eq!(
            http(addr, "POST", path, &[], b"{}").await.status,
            200,
            "{path}"
        );
    }
    h.shutdown().await.unwrap();
}

/// Acting for a client over HTTP needs that client's key, from its hello:
/// its id alone does not let anyone tie breakpoints to its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_id_alone_does_not_let_anyone_act_for_it() {
    let (engine, bps) = engine(Duration::from_secs(60));
    let h = serve(local(), engine).await;
    let addr = h.local_addr();
    let (s, id, key) = ws(addr).await;
    assert_eq!(key.len(), 32);
    let idh = id.to_string();
    let body = br#"{"state":"Decoding"}"#;
    for hdr in [
        vec![("x-kvbm-client", idh.as_str())],
        vec![
            ("x-kvbm-client", idh.as_str()),
            ("x-kvbm-client-key", "0123"),
        ],
    ] {
        let r = http(addr, "POST", "/breakpoints", &hdr, body).await;
        assert_eq!((r.status, r.error().code.as_str()), (403, "forbidden"));
    }
    assert!(bps.list().is_empty());
    let r = http(
        addr,
        "POST",
        "/breakpoints",
        &[("x-kvbm-client", &idh), ("x-kvbm-client-key", &key)],
        body,
    )
    .await;
    assert_eq!(r.status, 200);
    let added: Added = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(added.lease, None, "owned by the client, not leased");
    assert_eq!(bps.list()[0].spec.owner, Some(id));
    // The owner goes: its breakpoint goes with it.
    drop(s);
    let t = Instant::now();
    while !bps.list().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    h.shutdown().await.unwrap();
}

/// A client may send many commands before reading the replies: all are
/// answered, in order, and it is not cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_commands_are_all_answered() {
    let (engine, _bps) = engine(Duration::from_secs(60));
    let h = serve(local(), engine).await;
    let (mut s, _, _) = ws(h.local_addr()).await;
    const N: u64 = 500;
    for id in 1..=N {
        send(&mut s, id, ControlCommand::List).await;
    }
    for id in 1..=N {
        assert!(reply(&mut s, id).await.is_ok(), "reply {id}");
    }
    let st = h.stats();
    assert_eq!(
        (st.slow_disconnects, st.clients_connected),
        (0, 1),
        "{st:?}"
    );
    h.shutdown().await.unwrap();
}
