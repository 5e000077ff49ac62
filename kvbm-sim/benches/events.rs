//! Cost of emitting events, and what recording costs the simulator.
//!
//! Run: `cargo bench -p kvbm-core --bench events` (`KVBM_BENCH_QUICK=1` for
//! a short run). Two tables:
//!
//! 1. ns per `Emitter::emit` of a real event (a slot transition carrying a
//!    request id): nobody listening; one broadcast subscriber draining on
//!    its own thread; the lossless recorder tap drained by a consumer
//!    thread. Target: ≤ 100 ns per event with the tap drained.
//! 2. The simulator on one synthetic workload, with no subscriber and with
//!    every event recorded through the tap (a consumer thread keeps them
//!    all), interleaved runs, median wall time. Target: ≤ 5% slowdown.

use kvbm_events::Emitter;
use kvbm_events::bus::{BusConfig, Received, TapItem};
use kvbm_events::slot::SlotState;
use kvbm_events::{EventKind, MonotonicClock, RequestId};
use kvbm_sim::sim::{SimConfig, Simulator};
use kvbm_sim::workload::{LengthDist, SyntheticConfig, generate};
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
    let mut tap = e.bus().take_tap().unwrap();
    let t = std::thread::spawn(move || {
        let mut n = 0u64;
        drain_polling(&mut tap, |i| {
            if matches!(i, TapItem::Event(_)) {
                n += 1;
            }
        });
        n
    });
    let ns = common::median_ns_per_unit(samples, sample, burst, || {
        for _ in 0..burst {
            e.emit(Some(&req), kind());
        }
    });
    let c = e.bus().counters();
    drop(e);
    let delivered = t.join().unwrap_or(0);
    rows.push((
        "lossless tap drained by a consumer".to_string(),
        ns,
        format!(
            "{:.2}% dropped ({} delivered)",
            100.0 * c.tap_dropped as f64 / c.tap_offered.max(1) as f64,
            delivered
        ),
    ));
    rows
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
