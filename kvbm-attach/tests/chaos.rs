//! Chaos on loopback, bounded in time: a real-time simulated engine serves
//! its events and takes breakpoints while clients connect, stall, send
//! slow bodies, pipeline commands, set and abandon breakpoints (over the
//! WebSocket and over HTTP, steps included), send garbage and disconnect,
//! at random (a fixed seed per actor, printed). Afterwards:
//!
//! - no pause lasted longer than the stated bound: the longest a lost
//!   owner can hold one (its silence timeout and a ping, its send timeout,
//!   or the lease of what was set without one), while the pauses' own
//!   deadline is far longer, so a pause that only its deadline ended
//!   fails this;
//! - the engine made progress throughout: it never went more than
//!   [`PROGRESS_BOUND`] without a scheduler iteration (pauses by different
//!   owners may follow one another, so this is looser than one pause);
//! - every breakpoint seen while it ran had an owner, and none is left
//!   once the clients are gone;
//! - a well-behaved client received exactly the engine's own event count,
//!   every sequence number once, no gap.

use futures_util::{SinkExt, StreamExt};
use kvbm_attach::client::{Client, ClientConfig, ClientEvent};
use kvbm_attach::server::{FeederConfig, ServedEngine, Server, ServerConfig, spawn_feeder};
use kvbm_core::hooks::{Breakpoints, HookSet};
use kvbm_events::Emitter;
use kvbm_events::breakpoint::{BreakpointInfo, BreakpointSpec};
use kvbm_events::control::ControlCommand;
use kvbm_events::ring::RingBuffer;
use kvbm_schema::protocol::{ClientMsg, ServerMsg};
use kvbm_sim::sim::{Pacing, SimConfig, SimReport, Simulator};
use kvbm_sim::workload::{LengthDist, SyntheticConfig, generate};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;

/// How long the chaos lasts.
const CHAOS: Duration = Duration::from_secs(20);
/// Pauses' own deadline: far beyond the bound, so only the server's
/// releases keep the engine going.
const DEADLINE: Duration = Duration::from_secs(60);
const PING: Duration = Duration::from_millis(200);
const SILENCE: Duration = Duration::from_millis(1000);
const SEND_TIMEOUT: Duration = Duration::from_millis(1000);
const LEASE: Duration = Duration::from_millis(1500);
/// The stated bound on one pause: the longest any lost owner holds it
/// (`max(SILENCE + PING, SEND_TIMEOUT, LEASE)` = 1.5 s), plus 1 s for the
/// breakpoint watch's poll and a busy 2-core machine.
const PAUSE_BOUND: Duration = Duration::from_millis(2500);
/// The longest the engine may go without a scheduler iteration.
const PROGRESS_BOUND: Duration = Duration::from_secs(10);

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn ms(&mut self, max: u64) -> Duration {
        Duration::from_millis(self.below(max))
    }
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn ws(addr: SocketAddr) -> Option<Ws> {
    let url = format!("ws://{addr}/events?version=3");
    let (s, _) = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_tungstenite::connect_async(url),
    )
    .await
    .ok()?
    .ok()?;
    Some(s)
}

async fn send(s: &mut Ws, id: u64, command: ControlCommand) -> bool {
    let t = serde_json::to_string(&ClientMsg::Control { id, command }).unwrap();
    s.send(Message::text(t)).await.is_ok()
}

/// Reads (events, pings and all) for `d`, or until the server closes.
async fn read_for(s: &mut Ws, d: Duration) {
    let _ = tokio::time::timeout(d, async { while let Some(Ok(_)) = s.next().await {} }).await;
}

/// Reads until the reply to `id` (at most 5 s).
async fn until_reply(s: &mut Ws, id: u64) {
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(m)) = s.next().await {
            if let Message::Text(t) = m
                && let Ok(ServerMsg::Reply { id: got, .. }) = serde_json::from_str(t.as_str())
                && got == id
            {
                return;
            }
        }
    })
    .await;
}

fn spec(rng: &mut Rng) -> BreakpointSpec {
    match rng.below(3) {
        0 => BreakpointSpec::default().with_state("Decoding"),
        1 => BreakpointSpec::default().with_state("Prefilling"),
        _ => BreakpointSpec::default().with_request_prefix("syn-"),
    }
}

async fn raw(addr: SocketAddr, bytes: &[u8], hold: Duration) {
    if let Ok(Ok(mut s)) =
        tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await
    {
        let _ = s.write_all(bytes).await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(hold, s.read_to_end(&mut sink)).await;
    }
}

/// One chaos actor: a random thing, again and again, until `stop`.
async fn actor(addr: SocketAddr, seed: u64, stop: Arc<AtomicBool>, actions: Arc<AtomicU64>) {
    let mut rng = Rng(seed);
    while !stop.load(Ordering::Relaxed) {
        actions.fetch_add(1, Ordering::Relaxed);
        match rng.below(9) {
            // Connect, read a while, go.
            0 => {
                if let Some(mut s) = ws(addr).await {
                    read_for(&mut s, rng.ms(800)).await;
                }
            }
            // Set a breakpoint, then stall: stop reading (and so answer no
            // ping) with the socket open.
            1 => {
                if let Some(mut s) = ws(addr).await {
                    let _ = send(
                        &mut s,
                        1,
                        ControlCommand::Add {
                            spec: spec(&mut rng),
                        },
                    )
                    .await;
                    until_reply(&mut s, 1).await;
                    tokio::time::sleep(rng.ms(6000)).await;
                }
            }
            // Set a breakpoint and vanish at once.
            2 => {
                if let Some(mut s) = ws(addr).await {
                    let _ = send(
                        &mut s,
                        1,
                        ControlCommand::Add {
                            spec: spec(&mut rng),
                        },
                    )
                    .await;
                }
            }
            // Step and stall.
            3 => {
                if let Some(mut s) = ws(addr).await {
                    let _ = send(&mut s, 1, ControlCommand::Step).await;
                    tokio::time::sleep(rng.ms(6000)).await;
                }
            }
            // Over HTTP without a client: a leased breakpoint or step,
            // abandoned.
            4 => {
                let body = serde_json::to_vec(&spec(&mut rng)).unwrap();
                let (path, body) = if rng.below(2) == 0 {
                    ("/breakpoints", body)
                } else {
                    ("/step", Vec::new())
                };
                let mut req = format!(
                    "POST {path} HTTP/1.1\r\nHost: c\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                )
                .into_bytes();
                req.extend_from_slice(&body);
                raw(addr, &req, Duration::from_secs(2)).await;
            }
            // A body that never comes.
            5 => {
                raw(
                    addr,
                    b"POST /resume HTTP/1.1\r\nHost: c\r\nContent-Length: 100\r\n\r\n{\"pa",
                    rng.ms(3000),
                )
                .await;
            }
            // Pipelined commands while reading.
            6 => {
                if let Some(mut s) = ws(addr).await {
                    let n = 1 + rng.below(150);
                    for id in 1..=n {
                        if !send(&mut s, id, ControlCommand::List).await {
                            break;
                        }
                    }
                    until_reply(&mut s, n).await;
                }
            }
            // Garbage, and headers that never end.
            7 => {
                let junk: Vec<u8> = (0..rng.below(300)).map(|_| rng.below(256) as u8).collect();
                raw(addr, &junk, Duration::from_millis(300)).await;
                raw(addr, b"GET /health HTTP/1.1\r\nHost: c\r\n", rng.ms(1500)).await;
            }
            // Resume everything, now and then (a friendly operator).
            _ => {
                raw(
                    addr,
                    b"POST /resume HTTP/1.1\r\nHost: c\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
                    Duration::from_secs(1),
                )
                .await;
            }
        }
        tokio::time::sleep(rng.ms(150)).await;
    }
}

/// What the well-behaved client received: events, the last seq, and
/// anything wrong (a hole, a gap, a new run, a failure).
type Good = (u64, Option<u64>, Vec<String>);

#[test]
fn an_engine_under_chaos_keeps_going_and_a_good_client_misses_nothing() {
    let engine_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (mut sim, bps) = simulator(engine_rt.handle());
    let emitter = sim.emitter().clone();
    let ring = Arc::new(RingBuffer::with_capacity(1 << 21).unwrap());
    let engine = ServedEngine::new(ring.clone(), emitter.engine())
        .with_run(emitter.run())
        .with_control(bps.clone());
    let tap = emitter.bus().take_tap().unwrap();
    let feeder = spawn_feeder(tap, ring, engine.signal(), FeederConfig::default()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server =
        rt.block_on(async { Server::bind(server_config(), engine).await.unwrap().spawn() });
    let addr = server.local_addr();

    // The well-behaved client, from seq 0.
    let good = spawn_good_client(addr, &rt);

    // The engine, and a watch on its progress.
    let engine_thread = std::thread::spawn(move || {
        while sim.step() {}
        sim.finish()
    });
    let stop = Arc::new(AtomicBool::new(false));
    let actions = Arc::new(AtomicU64::new(0));
    let seed = 0x51A0_5EED_u64;
    eprintln!("chaos seed {seed:#x}");
    for i in 0..8 {
        rt.spawn(actor(addr, seed + 977 * i, stop.clone(), actions.clone()));
    }
    let start = Instant::now();
    let Watched {
        longest,
        ownerless,
        max_breakpoints,
        longest_pause,
    } = watch(&emitter, &bps, &engine_thread, start);
    stop.store(true, Ordering::Relaxed);
    let st = server.stats();
    eprintln!(
        "{} chaos actions in {:.1} s; {} events, {} iterations; longest pause {longest_pause:?} \
         (bound {PAUSE_BOUND:?}); longest without a new iteration {longest:?} (bound \
         {PROGRESS_BOUND:?}); at most {max_breakpoints} breakpoints at once; {st:?}",
        actions.load(Ordering::Relaxed),
        start.elapsed().as_secs_f64(),
        emitter.emitted(),
        emitter.iteration()
    );
    assert!(
        longest_pause <= PAUSE_BOUND,
        "a pause lasted {longest_pause:?}"
    );
    assert!(
        longest <= PROGRESS_BOUND,
        "the engine made no progress for {longest:?}"
    );
    assert!(
        ownerless.is_empty(),
        "breakpoints without an owner: {ownerless:?}"
    );
    assert!(
        st.silent_disconnects + st.slow_disconnects > 0 && st.leases_expired > 0,
        "the chaos did not reach the cases it is for: {st:?}"
    );

    // The clients go; nothing is left set or paused.
    let t = Instant::now();
    while !(bps.list().is_empty() && bps.paused().is_empty()) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "left behind: {:?} {:?}",
            bps.list(),
            bps.paused()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // The engine runs its workload to the end; the good client has every
    // event it emitted, once.
    let t = Instant::now();
    while !engine_thread.is_finished() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the engine did not finish"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let report = engine_thread.join().unwrap();
    let emitted = emitter.emitted();
    assert_eq!(report.events_lost, 0);
    expect_every_event(&good, emitted);
    rt.block_on(server.shutdown()).unwrap();
    feeder.stop();
    drop(engine_rt);
}

/// A real-time simulated engine with a 400-request workload, its
/// breakpoints (with the far-off [`DEADLINE`]) installed as its hooks.
fn simulator(handle: &tokio::runtime::Handle) -> (Simulator, Arc<Breakpoints>) {
    let workload = generate(&SyntheticConfig {
        seed: 11,
        num_requests: 400,
        arrival_rate_per_s: 16.0,
        prompt_len: LengthDist::LogNormal {
            mean: 256.0,
            sigma: 0.5,
        },
        output_len: LengthDist::LogNormal {
            mean: 30.0,
            sigma: 0.5,
        },
        ..SyntheticConfig::default()
    })
    .unwrap();
    let cfg = SimConfig {
        pacing: Pacing::RealTime { speed: 1.0 },
        ..SimConfig::default()
    };
    let mut sim = Simulator::new(cfg, workload, handle).unwrap();
    let emitter = sim.emitter().clone();
    let bps = Arc::new(Breakpoints::new(Some(emitter.clone()), DEADLINE));
    sim.leader_mut().set_hooks(
        HookSet::none()
            .with_emitter(emitter.clone())
            .with_breakpoints(bps.clone()),
    );
    (sim, bps)
}

/// The server's limits and timeouts: room for every actor, and short
/// timeouts so that lost owners are noticed well within [`PAUSE_BOUND`].
fn server_config() -> ServerConfig {
    ServerConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        max_clients: 48,
        max_connections: 128,
        max_connections_per_ip: 128,
        header_read_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(1),
        send_timeout: SEND_TIMEOUT,
        ping_interval: PING,
        silence_timeout: SILENCE,
        lease: LEASE,
        ..ServerConfig::default()
    }
}

/// Starts the well-behaved client from seq 0; what it receives is
/// tallied in the returned [`Good`].
fn spawn_good_client(addr: SocketAddr, rt: &tokio::runtime::Runtime) -> Arc<Mutex<Good>> {
    let good: Arc<Mutex<Good>> = Arc::default();
    let g = good.clone();
    let mut client = Client::spawn(
        ClientConfig::new(&format!("http://{addr}"))
            .unwrap()
            .with_since(0),
        rt.handle(),
    )
    .unwrap();
    rt.spawn(async move {
        while let Some(ev) = client.recv().await {
            let mut g = g.lock().unwrap();
            match ev {
                ClientEvent::Events(v) => {
                    for e in v {
                        if e.seq != g.1.map_or(0, |s| s + 1) {
                            let msg = format!("seq {} after {:?}", e.seq, g.1);
                            g.2.push(msg);
                        }
                        g.1 = Some(e.seq);
                        g.0 += 1;
                    }
                }
                ClientEvent::Gap(gap) => g.2.push(format!("{gap:?}")),
                ClientEvent::NewRun { .. } => g.2.push("a new run".into()),
                ClientEvent::Failed(e) => g.2.push(format!("failed: {e}")),
                _ => {}
            }
        }
    });
    good
}

/// What the watch saw while the chaos lasted.
struct Watched {
    /// The longest the engine went without a new scheduler iteration.
    longest: Duration,
    /// Breakpoints seen without an owner.
    ownerless: Vec<BreakpointInfo>,
    max_breakpoints: usize,
    longest_pause: Duration,
}

/// Watches the engine's progress, its pauses and its breakpoints every
/// 20 ms, for [`CHAOS`] from `start` or until the engine finishes.
fn watch(
    emitter: &Emitter,
    bps: &Breakpoints,
    engine_thread: &std::thread::JoinHandle<SimReport>,
    start: Instant,
) -> Watched {
    // Progress is the scheduler's iterations: events alone would count a
    // pause ending while another holds the engine at the same step.
    let (mut last_iteration, mut last_move) = (emitter.iteration(), Instant::now());
    let mut longest = Duration::ZERO;
    let mut ownerless = Vec::new();
    let mut max_breakpoints = 0;
    let mut longest_pause = Duration::ZERO;
    while start.elapsed() < CHAOS && !engine_thread.is_finished() {
        std::thread::sleep(Duration::from_millis(20));
        let now = emitter.iteration();
        if now != last_iteration {
            longest = longest.max(last_move.elapsed());
            (last_iteration, last_move) = (now, Instant::now());
        }
        for p in bps.paused() {
            longest_pause = longest_pause.max(p.waited);
        }
        let list = bps.list();
        max_breakpoints = max_breakpoints.max(list.len());
        ownerless.extend(list.into_iter().filter(|b| b.spec.owner.is_none()));
    }
    longest = longest.max(last_move.elapsed());
    Watched {
        longest,
        ownerless,
        max_breakpoints,
        longest_pause,
    }
}

/// Waits (up to 30 s) for the good client to have all `emitted` events,
/// with nothing wrong along the way.
fn expect_every_event(good: &Mutex<Good>, emitted: u64) {
    let t = Instant::now();
    loop {
        let (n, last, problems) = good.lock().unwrap().clone();
        assert!(problems.is_empty(), "the good client saw {problems:?}");
        if n == emitted {
            assert_eq!(last, Some(emitted - 1));
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the good client has {n} of {emitted} events"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
