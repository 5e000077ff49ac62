//! Cost of emitting events, and what recording costs the simulator.
//!
//! Run: `cargo bench -p kvbm-sim --bench events` (`KVBM_BENCH_QUICK=1` for
//! a short run). Two tables:
//!
//! 1. ns per `Emitter::emit` of a real event (a slot transition carrying a
//!    request id): nobody listening; one broadcast subscriber draining on
//!    its own thread; the lossless recorder tap drained by a consumer
//!    thread. Target: ≤ 100 ns per event with the tap drained. Then what
//!    the clock costs an emit: the tap drained by a consumer that keeps
//!    up, with `MonotonicClock` against std's `Instant` as the baseline,
//!    interleaved, and one read of each clock alone.
//! 2. The simulator on one synthetic workload, with no subscriber and with
//!    every event recorded through the tap (a consumer thread keeps them
//!    all), interleaved runs, median wall time. Target: ≤ 5% slowdown.

use kvbm_events::Emitter;
use kvbm_events::bus::{BusConfig, Received, TapItem};
use kvbm_events::slot::SlotState;
use kvbm_events::{Clock, EventKind, MonotonicClock, RequestId};
use kvbm_sim::sim::{SimConfig, Simulator};
use kvbm_sim::workload::{LengthDist, SyntheticConfig, generate};
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvbm_testkit::bench as common;

fn emitter() -> Arc<Emitter> {
    Arc::new(Emitter::new(0, BusConfig::default(), Arc::new(MonotonicClock::new())).unwrap())
}

fn kind() -> EventKind {
    EventKind::SlotTransition {
        from: SlotState::Prefilling,
        to: SlotState::Decoding,
    }
}

fn emit_cost(samples: usize, sample: Duration) -> Vec<(String, f64, String)> {
    let req: RequestId = Arc::from("req-12345");
    let burst = 1000u64;
    let mut rows = Vec::new();

    // Nobody listening.
    let e = emitter();
    let ns = common::median_ns_per_unit(samples, sample, burst, || {
        for _ in 0..burst {
            e.emit(Some(black_box(&req)), kind());
        }
    });
    rows.push(("no subscriber".to_string(), ns, String::new()));

    // One live subscriber on its own thread.
    let e = emitter();
    let mut sub = e.bus().subscribe();
    let stop = Arc::new(AtomicBool::new(false));
    let t = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut got, mut lagged) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                match sub.blocking_recv() {
                    Some(Received::Event(_)) => got += 1,
                    Some(Received::Lagged(n)) => lagged += n,
                    None => break,
                }
            }
            (got, lagged)
        })
    };
    let ns = common::median_ns_per_unit(samples, sample, burst, || {
        for _ in 0..burst {
            e.emit(Some(&req), kind());
        }
    });
    stop.store(true, Ordering::Relaxed);
    e.emit(None, kind()); // wake the subscriber so it sees `stop`
    let c = e.bus().counters();
    drop(e);
    let _ = t.join();
    rows.push((
        "one broadcast subscriber draining".to_string(),
        ns,
        format!(
            "{:.1}% lagged",
            100.0 * c.lagged_total as f64 / c.published.max(1) as f64
        ),
    ));

    // The recorder tap, drained by a consumer.
    let e = emitter();
    let (taken, t) = tap_consumer(&e);
    let ns = common::median_ns_per_unit(samples, sample, burst, || {
        for _ in 0..burst {
            e.emit(Some(&req), kind());
        }
    });
    let c = e.bus().counters();
    drop(e);
    let _ = t.join();
    let delivered = taken.load(Ordering::Acquire);
    rows.push((
        "lossless tap drained by a consumer".to_string(),
        ns,
        format!(
            "{:.2}% dropped ({} delivered)",
            100.0 * c.tap_dropped as f64 / c.tap_offered.max(1) as f64,
            delivered
        ),
    ));
    rows.extend(clock_cost(samples, &req));
    rows
}

/// What the clock costs an emit: the tap drained by a consumer that keeps
/// up (timed bursts of 1,000 emits; between them, untimed, the consumer
/// takes everything), with `MonotonicClock` and, as the baseline, with
/// timestamps from std's `Instant` (what `MonotonicClock` read before it
/// took the time-stamp counter). Interleaved: each round one sample of
/// each, the medians over rounds. Then one clock read of each, alone.
fn clock_cost(samples: usize, req: &RequestId) -> Vec<(String, f64, String)> {
    let bursts = if common::quick() { 20 } else { 200 };
    let mut cases = Vec::new();
    for clock in [
        Arc::new(MonotonicClock::new()) as Arc<dyn Clock>,
        Arc::new(StdClock(Instant::now())),
    ] {
        let e = Arc::new(Emitter::new(0, BusConfig::default(), clock).unwrap());
        let (taken, t) = tap_consumer(&e);
        cases.push((e, taken, t, Vec::new()));
    }
    for _ in 0..samples {
        for (e, taken, _, got) in &mut cases {
            let mut per_burst: Vec<f64> = (0..bursts)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..1000 {
                        e.emit(Some(req), kind());
                    }
                    let ns = t.elapsed().as_nanos() as f64 / 1000.0;
                    // Untimed: until the consumer has taken (or the tap
                    // dropped) everything emitted.
                    let c = e.bus().counters();
                    while taken.load(Ordering::Acquire) + c.tap_dropped < c.tap_offered {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                    ns
                })
                .collect();
            per_burst.sort_by(f64::total_cmp);
            got.push(per_burst[per_burst.len() / 2]);
        }
    }
    let mut rows: Vec<(String, f64, String)> = Vec::new();
    for ((e, _, t, mut got), name) in cases.into_iter().zip([
        "keeping up: tap drained, `MonotonicClock`",
        "keeping up: tap drained, std `Instant` (baseline)",
    ]) {
        let dropped = e.bus().counters().tap_dropped;
        drop(e);
        let _ = t.join();
        got.sort_by(f64::total_cmp);
        rows.push((
            name.to_string(),
            got[got.len() / 2],
            format!("{dropped} dropped"),
        ));
    }
    let ratio = rows[0].1 / rows[1].1;
    rows[0].2 +=
        &format!("; {ratio:.2} of the baseline (medians of {samples} rounds, interleaved)");
    let (ours, theirs) = (MonotonicClock::new(), StdClock(Instant::now()));
    for (name, clock) in [
        ("a clock read: `MonotonicClock`", &ours as &dyn Clock),
        ("a clock read: std `Instant::elapsed`", &theirs),
    ] {
        let ns = common::median_ns_per_unit(samples, Duration::from_millis(50), 1000, || {
            for _ in 0..1000 {
                black_box(clock.now_ns());
            }
        });
        rows.push((name.to_string(), ns, String::new()));
    }
    rows
}

/// Time since creation from std's `Instant`.
struct StdClock(Instant);

impl Clock for StdClock {
    fn now_ns(&self) -> u64 {
        self.0.elapsed().as_nanos() as u64
    }
}

/// Takes `e`'s tap and drains it on a thread of its own
/// ([`drain_polling`]), counting the events it takes; the thread ends
/// once `e` is dropped.
fn tap_consumer(e: &Emitter) -> (Arc<AtomicU64>, std::thread::JoinHandle<()>) {
    let mut tap = e.bus().take_tap().unwrap();
    let taken = Arc::new(AtomicU64::new(0));
    let counted = taken.clone();
    let t = std::thread::spawn(move || {
        drain_polling(&mut tap, |i| {
            if matches!(i, TapItem::Event(_)) {
                counted.fetch_add(1, Ordering::Release);
            }
        })
    });
    (taken, t)
}

/// How a recorder should consume the tap: take everything there is, then
/// sleep a little. Blocking in `recv` instead would make the engine pay a
/// wake-up system call on nearly every event; polling every 0.5 ms keeps
/// the producer's side a plain queue push (the tap holds 65,536 events by
/// default, over 100 ms at a million events a second).
fn drain_polling<E>(tap: &mut kvbm_events::bus::TapReceiver<E>, mut each: impl FnMut(TapItem<E>)) {
    use kvbm_events::bus::TryRecvError;
    loop {
        match tap.try_recv() {
            Ok(item) => each(item),
            Err(TryRecvError::Empty) => std::thread::sleep(Duration::from_micros(500)),
            Err(TryRecvError::Closed) => return,
        }
    }
}

fn sim_run(recorded: bool, quick: bool) -> (Duration, u64, u64) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let workload = generate(&SyntheticConfig {
        seed: 7,
        num_requests: if quick { 100 } else { 600 },
        arrival_rate_per_s: 30.0,
        prompt_len: LengthDist::LogNormal {
            mean: 1500.0,
            sigma: 0.5,
        },
        output_len: LengthDist::LogNormal {
            mean: 80.0,
            sigma: 0.5,
        },
        shared_prefix_ratio: 0.5,
        num_shared_prefixes: 4,
        shared_prefix_len: 512,
        ..SyntheticConfig::default()
    })
    .unwrap();
    let cfg = SimConfig {
        bus: BusConfig {
            tap_capacity: 1 << 20,
            ..BusConfig::default()
        },
        ..SimConfig::default()
    };
    let sim = Simulator::new(cfg, workload, rt.handle()).unwrap();
    let consumer = recorded.then(|| {
        let mut tap = sim.emitter().bus().take_tap().unwrap();
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            drain_polling(&mut tap, |i| kept.push(i));
            kept.len() as u64
        })
    });
    let t = Instant::now();
    let report = sim.run();
    let wall = t.elapsed();
    let kept = consumer.map(|c| c.join().unwrap_or(0)).unwrap_or(0);
    (wall, report.events_emitted, kept)
}

fn main() {
    let quick = common::quick();
    let (samples, sample) = if quick {
        (3, Duration::from_millis(50))
    } else {
        (11, Duration::from_millis(200))
    };
    println!("| event emission | ns/event | note |");
    println!("|---|---:|---|");
    for (name, ns, note) in emit_cost(samples, sample) {
        println!("| {name} | {ns:.1} | {note} |");
    }

    let rounds = if quick { 1 } else { 5 };
    let (mut off, mut on) = (Vec::new(), Vec::new());
    let mut events = 0;
    let mut kept = 0;
    for _ in 0..rounds {
        off.push(sim_run(false, quick).0);
        let (w, e, k) = sim_run(true, quick);
        on.push(w);
        events = e;
        kept = k;
    }
    off.sort();
    on.sort();
    let (a, b) = (off[off.len() / 2], on[on.len() / 2]);
    println!();
    println!("| simulator, same workload | wall time (median of {rounds}) | events |");
    println!("|---|---:|---:|");
    println!(
        "| no subscriber | {:.0} ms | {events} emitted |",
        a.as_secs_f64() * 1e3
    );
    println!(
        "| every event recorded through the tap | {:.0} ms | {kept} kept |",
        b.as_secs_f64() * 1e3
    );
    println!(
        "| slowdown with recording | {:+.1}% | target ≤ 5% |",
        100.0 * (b.as_secs_f64() / a.as_secs_f64() - 1.0)
    );
}
