//! Attach latency and throughput on loopback: an in-process emitter, the
//! server's feeder, the attach server and one client
//! ([`kvbm_attach::client::Client`]), all in this process.
//!
//! Run: `cargo bench -p kvbm-attach --bench attach`
//! (`KVBM_BENCH_QUICK=1` for a smoke run of a few seconds).
//!
//! - **Latency**: events emitted at a steady rate (10k and 100k events/s,
//!   paced in 1 ms steps); each is stamped by the emitter's monotonic clock
//!   (`ts_ns`), and the client reads the same clock when it receives the
//!   event. emit → tap → feeder → ring → server encoder → WebSocket →
//!   client decode. p50/p99/max over every event after a warm-up second.
//! - **Throughput**: events emitted as fast as the emitter can; the rate at
//!   which one client receives them (first emit to last receipt), and how
//!   many the client did not get (reported as gaps: the tap or the ring
//!   overflowed while the client fell behind; never silently).

use hdrhistogram::Histogram;
use kvbm_attach::client::{Client, ClientConfig, ClientEvent};
use kvbm_attach::server::{FeederConfig, ServedEngine, Server, ServerConfig, spawn_feeder};
use kvbm_events::bus::BusConfig;
use kvbm_events::ring::RingBuffer;
use kvbm_events::slot::SlotState;
use kvbm_events::{Clock, Emitter, EventKind, MonotonicClock, RequestId};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

struct Pipeline {
    rt: tokio::runtime::Runtime,
    emitter: Arc<Emitter>,
    clock: Arc<MonotonicClock>,
    client: Client,
    _feeder: kvbm_attach::server::Feeder,
    _server: kvbm_attach::server::ServerHandle,
}

fn pipeline() -> Pipeline {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let clock = Arc::new(MonotonicClock::new());
    let emitter = Arc::new(
        Emitter::new(
            0,
            BusConfig {
                tap_capacity: 1 << 20,
                ..BusConfig::default()
            },
            clock.clone(),
        )
        .unwrap(),
    );
    let tap = emitter.bus().take_tap().unwrap();
    let ring = Arc::new(RingBuffer::with_capacity(1 << 20).unwrap());
    let engine = ServedEngine::new(ring.clone(), 0);
    let feeder = spawn_feeder(tap, ring, engine.signal(), FeederConfig::default()).unwrap();
    let server = rt.block_on(async {
        let cfg = ServerConfig {
            addr: "127.0.0.1:0".parse().unwrap(),
            ..ServerConfig::default()
        };
        Server::bind(cfg, engine).await.unwrap().spawn()
    });
    let mut ccfg = ClientConfig::new(&format!("http://{}", server.local_addr())).unwrap();
    ccfg.channel_capacity = 1024;
    let mut client = Client::spawn(ccfg.with_since(0), rt.handle()).unwrap();
    rt.block_on(async {
        loop {
            match client.recv().await {
                Some(ClientEvent::Connected(_)) => break,
                Some(ClientEvent::Failed(e)) => panic!("{e}"),
                _ => {}
            }
        }
    });
    Pipeline {
        rt,
        emitter,
        clock,
        client,
        _feeder: feeder,
        _server: server,
    }
}

fn kinds(i: u64) -> EventKind {
    match i % 3 {
        0 => EventKind::TokensScheduled {
            prefill: 0,
            decode: 1,
            computed: i as u32,
        },
        1 => EventKind::SlotTransition {
            from: SlotState::Prefilling,
            to: SlotState::Decoding,
        },
        _ => EventKind::TokensScheduled {
            prefill: 16,
            decode: 0,
            computed: i as u32,
        },
    }
}

/// Emits `total` events at `rate` per second (`None`: as fast as
/// possible) on a thread of its own.
fn emit(
    emitter: Arc<Emitter>,
    total: u64,
    rate: Option<f64>,
    done: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Duration> {
    std::thread::spawn(move || {
        let reqs: Vec<RequestId> = (0..64).map(|i| format!("req-{i}").into()).collect();
        let t0 = Instant::now();
        let mut n = 0u64;
        while n < total {
            let due = match rate {
                Some(r) => ((t0.elapsed().as_secs_f64() * r) as u64).min(total),
                None => total,
            };
            while n < due {
                emitter.emit(Some(&reqs[(n % 64) as usize]), kinds(n));
                n += 1;
            }
            if rate.is_some() && n < total {
                std::thread::sleep(Duration::from_micros(1000));
            }
        }
        done.store(true, Ordering::Release);
        t0.elapsed()
    })
}

struct Received {
    events: u64,
    gap_events: u64,
    hist: Histogram<u64>,
    last_receipt: Instant,
}

/// Receives until `total` events are accounted for (received or in a gap),
/// recording the latency of those with `seq >= warmup`.
fn receive(p: &mut Pipeline, total: u64, warmup: u64) -> Received {
    let clock = p.clock.clone();
    let client = &mut p.client;
    p.rt.block_on(async {
        let mut r = Received {
            events: 0,
            gap_events: 0,
            hist: Histogram::new_with_bounds(1, 60_000_000_000, 3).unwrap(),
            last_receipt: Instant::now(),
        };
        while r.events + r.gap_events < total {
            let ev = tokio::time::timeout(Duration::from_secs(30), client.recv())
                .await
                .expect("the client stalled");
            match ev {
                Some(ClientEvent::Events(v)) => {
                    let now = clock.now_ns();
                    r.last_receipt = Instant::now();
                    for e in &v {
                        if e.seq >= warmup {
                            let _ = r.hist.record(now.saturating_sub(e.ts_ns).max(1));
                        }
                    }
                    r.events += v.len() as u64;
                }
                Some(ClientEvent::Gap(g)) => r.gap_events += g.len(),
                Some(ClientEvent::Failed(e)) => panic!("{e}"),
                Some(ClientEvent::Disconnected { error, .. }) => {
                    eprintln!("warning: disconnected: {error}")
                }
                Some(_) => {}
                None => panic!("the client stopped"),
            }
        }
        r
    })
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

fn main() {
    let quick = std::env::var("KVBM_BENCH_QUICK").is_ok_and(|v| v == "1");
    let secs = if quick { 2.0 } else { 10.0 };
    println!(
        "attach on loopback: emitter → feeder → ring → server → WebSocket → 1 client ({} cores)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!();
    println!(
        "| scenario                 | events    | received  | gaps | p50 µs  | p99 µs  | max µs   |"
    );
    println!(
        "|--------------------------|-----------|-----------|------|---------|---------|----------|"
    );
    for rate in [10_000.0, 100_000.0] {
        let mut p = pipeline();
        let total = (rate * secs) as u64;
        let warmup = rate as u64; // the first second
        let done = Arc::new(AtomicBool::new(false));
        let h = emit(p.emitter.clone(), total, Some(rate), done);
        let r = receive(&mut p, total, warmup);
        h.join().unwrap();
        let q = |x: f64| us(r.hist.value_at_quantile(x));
        println!(
            "| latency at {:>4}k ev/s    | {:>9} | {:>9} | {:>4} | {:>7.1} | {:>7.1} | {:>8.1} |",
            rate as u64 / 1000,
            total,
            r.events,
            r.gap_events,
            q(0.5),
            q(0.99),
            us(r.hist.max())
        );
    }
    // Flat out: as many events as the tap and the server's ring hold (so
    // the figure is the client's rate, not the ring's overflow), best of
    // a few rounds.
    let total: u64 = if quick { 300_000 } else { 1_000_000 };
    let rounds = if quick { 1 } else { 3 };
    let mut best: Option<(f64, Received, Duration, u64)> = None;
    let mut last = None;
    for _ in 0..rounds {
        let mut p = pipeline();
        let done = Arc::new(AtomicBool::new(false));
        let t0 = Instant::now();
        let h = emit(p.emitter.clone(), total, None, done);
        let r = receive(&mut p, total, u64::MAX);
        let emit_time = h.join().unwrap();
        let took = r.last_receipt.duration_since(t0).as_secs_f64();
        let rate = r.events as f64 / took;
        let batches = p.client.handle().counters().batches;
        if best.as_ref().is_none_or(|b| rate > b.0) {
            best = Some((rate, r, emit_time, batches));
        }
        last = Some(p);
    }
    let (rate, r, emit_time, batches) = best.unwrap();
    println!(
        "| throughput (flat out)    | {:>9} | {:>9} | {:>4} |         |         |          |",
        total, r.events, r.gap_events
    );
    println!();
    println!(
        "throughput: one client received {rate:.0} events/s (best of {rounds}: {} events, \
         {batches} frames; the emitter took {:.2} s)",
        r.events,
        emit_time.as_secs_f64(),
    );
    let p = last.unwrap();
    let c = p.client.handle().counters();
    println!(
        "client counters: {} batches, {:.1} MiB, {} duplicates, {} consumer-full waits",
        c.batches,
        c.bytes as f64 / (1 << 20) as f64,
        c.duplicates,
        c.consumer_full
    );
}
