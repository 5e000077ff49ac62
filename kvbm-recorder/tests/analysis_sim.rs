//! The analyses on real event streams from the simulated engine: the
//! invariant checker passes on a run, stats are sane, the Chrome export
//! parses with one track per request, replay rebuilds the engine's state,
//! diff tells equal runs from different ones, and the ring buffer keeps up
//! with a recording while being read.
//!
//! Needs `tokio` (the simulator runs its pipelines on a runtime the caller
//! provides), which `kvbm-recorder` does not depend on yet: add
//! `tokio = { workspace = true, features = ["rt-multi-thread"] }` to its
//! `[dev-dependencies]` (or to `[dependencies]`, for `record`) and delete
//! the `cfg` line below to enable these tests.

use kvbm_events::Event;
use kvbm_events::bus::{TapItem, TapReceiver};
use kvbm_events::reducer::fold;
use kvbm_events::ring::{RingBuffer, RingConfig};
use kvbm_events::slot::SlotState;
use kvbm_recorder::analysis::export::{ChromeOptions, write_chrome_trace, write_jsonl};
use kvbm_recorder::analysis::replay::{ReplayMode, Replayer};
use kvbm_recorder::analysis::stats::{StatsConfig, stats};
use kvbm_recorder::analysis::{CheckOptions, DiffOptions, Timeline, check, diff};
use kvbm_sim::sim::{SimConfig, Simulator};
use kvbm_sim::workload::{LengthDist, SyntheticConfig, generate};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const REQUESTS: usize = 40;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn workload(seed: u64) -> Vec<kvbm_sim::workload::RequestSpec> {
    generate(&SyntheticConfig {
        seed,
        num_requests: REQUESTS,
        arrival_rate_per_s: 40.0,
        prompt_len: LengthDist::Uniform { min: 40, max: 600 },
        output_len: LengthDist::Uniform { min: 1, max: 40 },
        shared_prefix_ratio: 0.6,
        num_shared_prefixes: 3,
        shared_prefix_len: 128,
        ..SyntheticConfig::default()
    })
    .expect("a workload")
}

fn config() -> SimConfig {
    SimConfig {
        block_size: 16,
        // Small tiers: evictions, preemptions, skipped offloads, a disk.
        device_capacity_tokens: 2048,
        host_capacity_tokens: 1024,
        disk_capacity_tokens: 4096,
        ..SimConfig::default()
    }
}

fn push(item: TapItem<Event>, out: &mut Vec<Event>) {
    match item {
        TapItem::Event(e) => out.push(e),
        TapItem::Gap { dropped } => panic!("the tap lost {dropped} events"),
    }
}

fn drain(tap: &mut TapReceiver<Event>, out: &mut Vec<Event>) {
    while let Ok(item) = tap.try_recv() {
        push(item, out);
    }
}

/// True when a finished run's stream is complete: at least what the
/// report counted, every slot `Finished`, no transfer in flight.
fn complete(events: &[Event], emitted: u64) -> bool {
    let st = fold(events);
    events.len() as u64 >= emitted
        && st.in_flight_count() == 0
        && st.slots().all(|s| s.state == SlotState::Finished)
}

/// Takes what is left after the engine finished. The engine may still emit
/// after `finish` returns (a slot's last `Finishing → Finished` comes from a
/// pipeline's completion callback, and the pipelines' threads keep the bus
/// open), so wait until the stream is complete.
fn drain_rest(tap: &mut TapReceiver<Event>, out: &mut Vec<Event>, emitted: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        drain(tap, out);
        if complete(out, emitted) {
            return;
        }
        assert!(Instant::now() < deadline, "the stream never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A whole run's events, drained as a recorder would while the engine
/// runs, and to the end once it has finished.
fn record_with(cfg: SimConfig, seed: u64) -> Vec<Event> {
    let rt = runtime();
    let mut sim = Simulator::new(cfg, workload(seed), rt.handle()).expect("a simulator");
    let mut tap = sim.emitter().bus().take_tap().expect("the tap");
    let mut events = Vec::new();
    while sim.step() {
        drain(&mut tap, &mut events);
    }
    let report = sim.finish();
    drain_rest(&mut tap, &mut events, report.events_emitted);
    assert_eq!(report.requests_finished, REQUESTS);
    assert!(events.len() as u64 >= report.events_emitted);
    events
}

fn record(seed: u64) -> Vec<Event> {
    record_with(config(), seed)
}

#[test]
fn the_checker_passes_on_a_real_run() {
    let events = record(1);
    let r = check(&events, CheckOptions::default());
    assert!(r.is_ok(), "{r}");
    assert_eq!(r.finished_slots, REQUESTS as u64);
    assert!(r.live_slots.is_empty());
    assert_eq!(r.events, events.len() as u64);
    assert_eq!(r.seq_range, Some((0, events.len() as u64 - 1)));
    assert_eq!(r.transfers_in_flight, 0);

    // Cut the stream in the middle: requests are live (information), and
    // with the stream declared incomplete nothing is a violation.
    let cut = &events[..events.len() / 2];
    let r = check(
        cut,
        CheckOptions {
            stream_complete: false,
            ..CheckOptions::default()
        },
    );
    assert!(r.is_ok(), "{r}");
    assert!(!r.live_slots.is_empty());

    // Drop 3 events from the middle: an unaccounted gap (and whatever the
    // reducer makes of the missing events) — unless the loss is reported.
    let mut holed = events.clone();
    let at = holed.len() / 3;
    let first_missing = holed[at].seq;
    holed.drain(at..at + 3);
    let r = check(&holed, CheckOptions::default());
    assert!(!r.is_ok());
    assert!(
        r.violations.iter().any(|v| v.kind
            == kvbm_recorder::analysis::ViolationKind::UnaccountedGap
            && v.seq == Some(first_missing + 3)),
        "{r}"
    );
    let r = check(
        &holed,
        CheckOptions {
            lost: 3,
            ..CheckOptions::default()
        },
    );
    assert!(
        !r.violations
            .iter()
            .any(|v| v.kind == kvbm_recorder::analysis::ViolationKind::UnaccountedGap),
        "{r}"
    );
}

#[test]
fn stats_of_a_real_run_are_sane() {
    let events = record(2);
    let st = stats(&events, StatsConfig::default()).unwrap();
    assert_eq!(st.requests, REQUESTS as u64);
    assert_eq!(st.finished, REQUESTS as u64);
    // TTFT is the reducer's: the first `TokensScheduled` with decode > 0.
    // A request generating a single token (sampled by its prefill's last
    // chunk) never decodes, so it has none.
    let with_first_token = fold(&events)
        .slots()
        .filter(|s| s.first_token_ns.is_some())
        .count() as u64;
    assert_eq!(st.ttft_ns.count, with_first_token);
    assert!(with_first_token > REQUESTS as u64 / 2);
    assert!(st.ttft_ns.p50 > 0, "{st}");
    assert!(st.ttft_ns.p50 <= st.ttft_ns.p90 && st.ttft_ns.p90 <= st.ttft_ns.p99);
    assert!(st.ttft_ns.p99 <= st.ttft_ns.max);
    assert!(st.ttft_ns.mean > 0.0);
    assert_eq!(st.ttft_ns.outliers, 0);
    // Every request prefilled and decoded.
    assert!(st.time_in_state_ns["Prefilling"].count as usize >= REQUESTS);
    assert!(st.time_in_state_ns["Decoding"].p50 > 0, "{st}");
    // Eager offload: G1→G2 transfers completed, in batches.
    let lat = st.transfer_latency_ns["G1→G2"];
    assert!(lat.count > 0 && lat.max > 0, "{st}");
    assert!(st.transfers["G1→G2"].completed == lat.count);
    assert!(
        st.batch_blocks_all.count > 0 && st.batch_blocks_all.p50 >= 1,
        "{st}"
    );
    assert_eq!(
        st.transfers.values().map(|o| o.in_flight).sum::<u64>(),
        0,
        "{st}"
    );
    // The JSON the CLI prints reads back.
    let json = serde_json::to_string(&st).unwrap();
    let back: kvbm_recorder::analysis::Stats = serde_json::from_str(&json).unwrap();
    assert_eq!(back.transfers, st.transfers);
    assert_eq!(back.ttft_ns.p99, st.ttft_ns.p99);
    assert!((back.ttft_ns.mean - st.ttft_ns.mean).abs() < 1e-3);
    let text = st.to_string();
    assert!(text.contains("time to first token"), "{text}");
}

#[test]
fn the_chrome_export_of_a_real_run_parses_with_a_track_per_request() {
    let events = record(3);
    let mut out = Vec::new();
    let n = write_chrome_trace(&events, &mut out, ChromeOptions::default()).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out).expect("valid JSON");
    let tev = v["traceEvents"].as_array().expect("traceEvents");
    assert_eq!(tev.len() as u64, n);
    assert_eq!(v["displayTimeUnit"], "ns");
    let names: BTreeSet<&str> = tev
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), REQUESTS);
    // Every request's track has state spans; every span is well formed.
    let mut per_tid: BTreeMap<u64, usize> = BTreeMap::new();
    for e in tev.iter().filter(|e| e["ph"] == "X") {
        assert!(e["dur"].as_f64().unwrap() >= 0.0);
        assert!(e["ts"].as_f64().unwrap() >= 0.0);
        *per_tid.entry(e["tid"].as_u64().unwrap()).or_default() += 1;
    }
    assert_eq!(per_tid.len(), REQUESTS);
    // Transfers: a b/e pair for each, none left open at the end of a run.
    let begins: Vec<_> = tev.iter().filter(|e| e["ph"] == "b").collect();
    let ends: Vec<_> = tev.iter().filter(|e| e["ph"] == "e").collect();
    assert!(!begins.is_empty());
    assert_eq!(begins.len(), ends.len());
    assert!(ends.iter().all(|e| e["args"]["open"] == false));
    let tl = Timeline::from_events(&events);
    assert_eq!(begins.len(), tl.transfers.len());
    assert_eq!(
        tev.iter().filter(|e| e["name"] == "first token").count(),
        tl.first_tokens.len()
    );

    // JSON lines of the same run read back to the same events.
    let mut jl = Vec::new();
    write_jsonl(&events, &mut jl).unwrap();
    let back: Vec<Event> = String::from_utf8(jl)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(back, events);
}

#[test]
fn replay_rebuilds_the_state_and_seeks() {
    let events = record(4);
    let mut r = Replayer::from_events(events.clone(), ReplayMode::AsFastAsPossible);
    r.advance();
    let full = fold(&events);
    assert_eq!(r.state(), &full);
    let live: Vec<String> = r
        .state()
        .slots()
        .filter(|s| s.state != SlotState::Finished)
        .map(|s| s.to_string())
        .collect();
    assert!(
        live.is_empty(),
        "{live:?}\n{}",
        check(&events, CheckOptions::default())
    );
    // Seek to the middle and back to the end.
    let mid = events[events.len() / 2].seq;
    r.seek_to_seq(mid).unwrap();
    assert_eq!(r.state(), &fold(&events[..=events.len() / 2]));
    r.set_mode(ReplayMode::Step);
    assert_eq!(r.advance(), 1);
    assert!(r.step_back().unwrap());
    assert_eq!(r.state(), &fold(&events[..=events.len() / 2]));
    r.seek_to_time(u64::MAX).unwrap();
    assert_eq!(r.state(), &full);
}

/// Diff needs runs that are reproducible event for event. Without an
/// offload tier every event comes from the scheduler's thread on the
/// virtual clock, so two runs of a seed are identical. (With offload tiers
/// they are not: transfers run in real time on the pipelines' threads, so a
/// `Finishing → Finished` that waits for a store, a promotion or a
/// write-through lands at a different point from run to run, and the
/// scheduler's later decisions can follow it — diff rightly reports that.)
fn record_without_offload(seed: u64) -> Vec<Event> {
    let cfg = SimConfig {
        host_capacity_tokens: 0,
        disk_capacity_tokens: 0,
        ..config()
    };
    record_with(cfg, seed)
}

#[test]
fn diff_tells_equal_runs_from_different_ones() {
    let a = record_without_offload(5);
    let b = record_without_offload(5);
    let c = record_without_offload(6);
    let opts = DiffOptions::default();
    assert!(a.len() > 1_000);
    if let Some(d) = diff(&a, &b, &opts) {
        panic!("two runs of one seed differ: {d}");
    }
    let d = diff(&a, &c, &opts).expect("different seeds diverge");
    assert!(d.a.index < a.len() as u64 || d.b.index < c.len() as u64);
    assert_eq!(d.a.index, d.matched, "lockstep: everything before matched");
    assert!(
        d.message.contains("diverge") || d.message.contains("ended"),
        "{d}"
    );
    // The same run with its requests renamed and its clock shifted is
    // still the same story.
    let renamed: Vec<Event> = a
        .iter()
        .map(|e| {
            let mut e = e.clone();
            e.request = e.request.map(|r| Arc::from(format!("other-{r}")));
            e.ts_ns += 1_000_000_000;
            e.seq += 7;
            e.engine = 3;
            e
        })
        .collect();
    assert_eq!(diff(&a, &renamed, &opts), None);
}

/// A recorder thread feeds the ring from the tap while the engine runs and
/// a reader follows it: whatever the reader did not get, it was told it
/// missed, and the ring's tail is the run's tail.
#[test]
fn the_ring_is_read_while_a_run_is_recorded() {
    let rt = runtime();
    let sim = Simulator::new(config(), workload(7), rt.handle()).expect("a simulator");
    let mut tap = sim.emitter().bus().take_tap().expect("the tap");
    let ring = Arc::new(
        RingBuffer::new(RingConfig {
            capacity: 4096,
            max_read: 256,
        })
        .unwrap(),
    );
    let done = Arc::new(AtomicBool::new(false));
    let all = Arc::new(std::sync::Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let recorder = {
        let (ring, all, stop) = (ring.clone(), all.clone(), stop.clone());
        std::thread::spawn(move || {
            loop {
                let stopping = stop.load(Ordering::Acquire);
                while let Ok(item) = tap.try_recv() {
                    if let TapItem::Event(e) = &item {
                        all.lock().unwrap().push(e.clone());
                    }
                    ring.push_item(item);
                }
                if stopping {
                    return;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    let reader = {
        let (ring, done) = (ring.clone(), done.clone());
        std::thread::spawn(move || {
            let (mut cursor, mut got, mut missed, mut last_seq) = (0u64, 0u64, 0u64, None);
            loop {
                let finished = done.load(Ordering::Acquire);
                let r = ring.read(cursor);
                for e in &r.events {
                    if let (Some(l), 0) = (last_seq, r.missed) {
                        assert_eq!(e.seq, l + 1);
                    }
                    last_seq = Some(e.seq);
                }
                got += r.events.len() as u64;
                missed += r.missed;
                cursor = r.next;
                if finished && r.caught_up() && r.counters.pushed == cursor {
                    return (got, missed);
                }
                if r.events.is_empty() {
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
        })
    };
    let report = sim.run();
    // Until the recording is complete (see `drain_rest`).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !complete(&all.lock().unwrap(), report.events_emitted) {
        assert!(Instant::now() < deadline, "the stream never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Release);
    recorder.join().unwrap();
    done.store(true, Ordering::Release);
    let (got, missed) = reader.join().unwrap();
    let c = ring.counters();
    assert!(c.pushed >= report.events_emitted);
    assert_eq!(c.lost, 0);
    assert_eq!(got + missed, c.pushed);
    let all = all.lock().unwrap();
    let tail = ring.latest(256);
    assert_eq!(&all[all.len() - tail.len()..], &tail[..]);
    // The ring's snapshot replays into the same state as the run's tail:
    // a checker on it (started mid-stream, not complete) reports where the
    // snapshot begins.
    let (snap, _) = ring.snapshot();
    assert_eq!(snap.len(), 4096.min(all.len()));
    let r = check(
        &snap,
        CheckOptions {
            stream_complete: false,
            ..CheckOptions::default()
        },
    );
    assert_eq!(
        r.seq_range.map(|(a, _)| a),
        snap.first().map(|e| e.seq),
        "{r}"
    );
}
