//! Cost of feeding the bus through `tracing` and [`KvbmLayer`].
//!
//! Run: `cargo bench -p kvbm-core --bench tracing_layer`
//! (`KVBM_BENCH_QUICK=1` for a short run). ns per event, with the recorder
//! tap drained by a consumer thread:
//!
//! - `Emitter::emit` called directly (the baseline);
//! - a `tracing::info!(target: "kvbm", kind = "slot_transition", …)` through
//!   the layer (field parsing, the per-request table, the emit);
//! - a `block_registered` event (numbers only, no per-request state);
//! - an event with another target (what the layer costs everyone else).

use kvbm_events::bus::BusConfig;
use kvbm_events::slot::SlotState;
use kvbm_events::{Emitter, EventKind, MonotonicClock, RequestId};
use kvbm_ingest::tracing_layer::KvbmLayer;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tracing_subscriber::prelude::*;

use kvbm_testkit::bench as common;

fn main() {
    let (samples, sample) = if common::quick() {
        (3, Duration::from_millis(50))
    } else {
        (11, Duration::from_millis(200))
    };
    let emitter =
        Arc::new(Emitter::new(0, BusConfig::default(), Arc::new(MonotonicClock::new())).unwrap());
    let mut tap = emitter.bus().take_tap().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let drain = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                buf.clear();
                if tap.recv_batch_blocking(&mut buf, 1024) == 0 {
                    break;
                }
            }
        })
    };
    let layer = KvbmLayer::new(emitter.clone());
    let stats = layer.handle();
    let subscriber = tracing_subscriber::registry().with(layer);
    let burst = 1000u64;
    let mut rows = Vec::new();
    tracing::subscriber::with_default(subscriber, || {
        let req: RequestId = Arc::from("req-12345");
        rows.push((
            "Emitter::emit (baseline)",
            common::median_ns_per_unit(samples, sample, burst, || {
                for _ in 0..burst {
                    emitter.emit(
                        Some(black_box(&req)),
                        EventKind::SlotTransition {
                            from: SlotState::Prefilling,
                            to: SlotState::Decoding,
                        },
                    );
                }
            }),
        ));
        let id = "req-12345";
        rows.push((
            "tracing slot_transition",
            common::median_ns_per_unit(samples, sample, burst, || {
                for _ in 0..burst {
                    tracing::info!(target: "kvbm", kind = "slot_transition",
                        request_id = black_box(id), state = "Decoding");
                }
            }),
        ));
        rows.push((
            "tracing block_registered",
            common::median_ns_per_unit(samples, sample, burst, || {
                for i in 0..burst {
                    tracing::info!(target: "kvbm", kind = "block_registered",
                        tier = "G1", block = black_box(i), hash = i);
                }
            }),
        ));
        rows.push((
            "other target (ignored)",
            common::median_ns_per_unit(samples, sample, burst, || {
                for i in 0..burst {
                    tracing::info!(target: "app", kind = "block_registered", block = black_box(i));
                }
            }),
        ));
    });
    let s = stats.stats();
    println!("| tracing layer | ns/event |");
    println!("|---|---:|");
    for (name, ns) in rows {
        println!("| {name} | {ns:.1} |");
    }
    println!();
    println!(
        "layer: {} seen, {} emitted, {} refused",
        s.seen,
        s.emitted,
        s.missing_kind + s.unknown_kind + s.missing_field + s.bad_value
    );
    // The dispatcher may outlive `with_default` (tracing caches it), so the
    // bus need not close: stop the drain and leave without joining it.
    stop.store(true, Ordering::Relaxed);
    drop(drain);
}
