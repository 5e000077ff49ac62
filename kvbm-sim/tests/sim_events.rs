//! The simulated engine's event stream: the reducer rebuilds the engine's
//! own state from it at random points of runs, and the CPU-offload
//! walk-through comes out as the expected sequence of events.

use kvbm_core::hooks::{Breakpoints, HookSet};
use kvbm_events::breakpoint::BreakpointSpec;
use kvbm_events::bus::TapItem;
use kvbm_events::reducer::EngineState;
use kvbm_events::slot::SlotState;
use kvbm_events::tier::Tier;
use kvbm_events::{Direction, Event, EventKind};
use kvbm_sim::sim::{SimConfig, Simulator};
use kvbm_sim::workload::{LengthDist, RequestSpec, SyntheticConfig, generate};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn drain(tap: &mut kvbm_events::bus::TapReceiver<Event>, out: &mut Vec<Event>) {
    while let Ok(item) = tap.try_recv() {
        match item {
            TapItem::Event(e) => out.push(e),
            TapItem::Gap { dropped } => panic!("the tap lost {dropped} events"),
        }
    }
}

/// Compares the reducer's state with the engine's own, exactly.
fn compare(sim: &Simulator, st: &EngineState, when: &str) {
    let engine: BTreeMap<String, SlotState> = sim
        .leader()
        .slot_states()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    assert_eq!(st.slot_states(), engine, "slot states differ {when}");
    for tier in Tier::ALL {
        let Some(pool) = sim.leader().pool(tier) else {
            continue;
        };
        let s = pool.status();
        let v = st.pool(tier);
        assert_eq!(
            (v.capacity, v.active, v.inactive, v.empty),
            (
                s.capacity as u32,
                s.active as u32,
                s.inactive as u32,
                s.empty as u32
            ),
            "{tier} gauges differ {when}"
        );
        assert_eq!(
            st.registered(tier),
            &pool.registered_hashes(),
            "{tier} registered blocks differ {when}"
        );
    }
    assert_eq!(
        st.in_flight_count(),
        sim.leader().candidates_in_flight(),
        "in-flight transfers differ {when}"
    );
    assert_eq!(st.seq_gaps(), 0);
    assert_eq!(
        st.inconsistencies().total(),
        0,
        "{:?} {when}",
        st.inconsistencies()
    );
}

/// `n` requests at 40 a second, 60% of them sharing one of 3 prefixes of
/// 128 tokens: enough reuse for hits, enough new blocks for evictions.
fn sharing_workload(seed: u64, n: usize) -> Vec<RequestSpec> {
    generate(&SyntheticConfig {
        seed,
        num_requests: n,
        arrival_rate_per_s: 40.0,
        prompt_len: LengthDist::Uniform { min: 40, max: 600 },
        output_len: LengthDist::Uniform { min: 1, max: 40 },
        shared_prefix_ratio: 0.6,
        num_shared_prefixes: 3,
        shared_prefix_len: 128,
        ..SyntheticConfig::default()
    })
    .unwrap()
}

#[test]
fn the_reducer_rebuilds_the_engine_state_at_random_points() {
    for (seed, disk) in [(1u64, 0usize), (2, 4096), (3, 4096)] {
        let rt = runtime();
        let workload = sharing_workload(seed, 60);
        let cfg = SimConfig {
            block_size: 16,
            // Small tiers: evictions, preemptions, skipped offloads.
            device_capacity_tokens: 2048,
            host_capacity_tokens: 1024,
            disk_capacity_tokens: disk,
            ..SimConfig::default()
        };
        let mut sim = Simulator::new(cfg, workload, rt.handle()).unwrap();
        let mut tap = sim.emitter().bus().take_tap().unwrap();
        let mut events = Vec::new();
        let mut st = EngineState::default();
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut checks = 0;
        while sim.step() {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            if rng % 7 == 0 {
                sim.quiesce();
                let start = events.len();
                drain(&mut tap, &mut events);
                st.apply_all(&events[start..]);
                compare(
                    &sim,
                    &st,
                    &format!("at iteration {} (seed {seed})", sim.iteration()),
                );
                checks += 1;
            }
        }
        sim.quiesce();
        let start = events.len();
        drain(&mut tap, &mut events);
        st.apply_all(&events[start..]);
        compare(&sim, &st, "at the end");
        assert!(checks >= 5, "only {checks} comparisons");
        // Every slot finished, and a fresh fold of the whole stream equals
        // the incremental one.
        assert!(st.slots().all(|s| s.state == SlotState::Finished));
        assert_eq!(kvbm_events::reducer::fold(&events), st);
        let report = sim.finish();
        drain(&mut tap, &mut events); // the final gauges
        assert_eq!(report.events_emitted, events.len() as u64);
        assert_eq!(report.events_lost, 0);
        assert_eq!(report.requests_finished, 60);
        if seed == 1 {
            assert!(report.preemptions > 0 || st.pool(Tier::Device).evictions > 0);
        }
    }
}

/// In virtual time the stream is a function of the workload and the
/// options: two runs give the same events, every field (the clock is
/// virtual, a batch's time the modelled link's), with tiers small enough
/// that the host evicts, offloads are skipped and blocks cascade to disk,
/// eager and lazy.
#[test]
fn two_runs_in_virtual_time_give_the_same_events() {
    use kvbm_sim::sim::OffloadMode;
    let run = |seed: u64, mode: OffloadMode, eviction: &str| -> Vec<Event> {
        let rt = runtime();
        let workload = sharing_workload(seed, 80);
        let cfg = SimConfig {
            device_capacity_tokens: 2048,
            host_capacity_tokens: 1024,
            disk_capacity_tokens: 4096,
            offload_mode: mode,
            eviction: eviction.parse().unwrap(),
            ..SimConfig::default()
        };
        let sim = Simulator::new(cfg, workload, rt.handle()).unwrap();
        let mut tap = sim.emitter().bus().take_tap().unwrap();
        let report = sim.run();
        let mut events = Vec::new();
        drain(&mut tap, &mut events);
        assert_eq!(report.events_emitted, events.len() as u64);
        events
    };
    for (seed, mode, eviction) in [
        (1, OffloadMode::Eager, "lru"),
        (2, OffloadMode::Lazy, "lru"),
        (
            3,
            OffloadMode::AfterHits(1),
            "G2=tinylfu+s3fifo,G3=tinylfu+arc",
        ),
    ] {
        let (a, b) = (run(seed, mode, eviction), run(seed, mode, eviction));
        let kinds = |k: fn(&EventKind) -> bool| a.iter().filter(|e| k(&e.kind)).count();
        assert!(
            kinds(|k| matches!(
                k,
                EventKind::BlockEvicted {
                    tier: Tier::Host,
                    ..
                }
            )) > 0
        );
        assert!(kinds(|k| matches!(k, EventKind::BatchCompleted { .. })) > 0);
        assert_eq!(a.len(), b.len(), "seed {seed}, {mode:?}");
        if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
            panic!(
                "seed {seed}, {mode:?}: event {i} differs:\n{:?}\n{:?}",
                a[i], b[i]
            );
        }
    }
}

fn req(id: &str, at_ms: f64, prompt: Vec<u32>, out: usize) -> RequestSpec {
    RequestSpec {
        id: id.into(),
        arrival_ms: at_ms,
        prompt,
        output_len: out,
        origin: kvbm_sim::workload::Origin::Synthetic {
            index: 0,
            shared_prefix: None,
        },
    }
}

/// The CPU-offload walk-through with full blocks: A is computed and offloaded eagerly to the
/// host; B shares A's full-block prefix, misses on the device, hits on the
/// host, loads it, computes the rest and stores its new block.
#[test]
fn cpu_offload_walkthrough_with_full_blocks() {
    let rt = runtime();
    let a: Vec<u32> = (100..132).collect(); // two 16-token blocks
    let mut b = a.clone();
    b.extend(200..216); // a third block of its own
    b.push(999); // and one more token, so all three blocks are full prompt
    let cfg = SimConfig {
        block_size: 16,
        device_capacity_tokens: 100 * 16,
        host_capacity_tokens: 50 * 16,
        device_prefix_cache: false, // as in the walk-through: no GPU hit
        ..SimConfig::default()
    };
    let workload = vec![req("A", 0.0, a, 1), req("B", 10_000.0, b, 1)];
    let sim = Simulator::new(cfg, workload, rt.handle()).unwrap();
    let mut tap = sim.emitter().bus().take_tap().unwrap();
    let report = sim.run();
    let mut events = Vec::new();
    drain(&mut tap, &mut events);
    assert_eq!(report.requests_finished, 2);

    let of = |r: &str| -> Vec<&Event> {
        events
            .iter()
            .filter(|e| e.request.as_deref() == Some(r))
            .collect()
    };
    let states = |r: &str| -> Vec<SlotState> {
        of(r)
            .iter()
            .filter_map(|e| match e.kind {
                EventKind::SlotTransition { to, .. } => Some(to),
                _ => None,
            })
            .collect()
    };
    use SlotState::*;
    assert_eq!(states("A"), [Prefilling, Finishing, Finished]);
    assert_eq!(
        states("B"),
        [
            OnboardStaged(32),
            Onboarding(32),
            Prefilling,
            Finishing,
            Finished
        ]
    );

    // A: no host hit; its two blocks go G1 → G2 through one candidate.
    let a_ev = of("A");
    assert!(matches!(
        a_ev.iter()
            .find(|e| matches!(
                e.kind,
                EventKind::MatchResult {
                    tier: Tier::Host,
                    ..
                }
            ))
            .map(|e| &e.kind),
        Some(EventKind::MatchResult { hit_blocks: 0, .. })
    ));
    let lifecycle = |evs: &[&Event], d: Direction| -> Vec<&'static str> {
        evs.iter()
            .filter_map(|e| match &e.kind {
                EventKind::TransferPlanned { direction, .. }
                | EventKind::TransferPromoted { direction, .. }
                | EventKind::TransferCompleted { direction, .. }
                    if *direction == d =>
                {
                    Some(e.kind.name())
                }
                _ => None,
            })
            .collect()
    };
    let full = ["TransferPlanned", "TransferPromoted", "TransferCompleted"];
    assert_eq!(lifecycle(&a_ev, Direction::DEVICE_TO_HOST), full);
    assert!(
        a_ev.iter()
            .any(|e| matches!(e.kind, EventKind::TransferPlanned { blocks: 2, .. }))
    );

    // B: hits A's two blocks on the host, loads them into the device, then
    // stores its own new block.
    let b_ev = of("B");
    assert!(b_ev.iter().any(|e| matches!(
        e.kind,
        EventKind::MatchResult {
            tier: Tier::Host,
            looked_up: 3,
            hit_blocks: 2,
            hit_tokens: 32
        }
    )));
    assert_eq!(lifecycle(&b_ev, Direction::HOST_TO_DEVICE), full);
    assert_eq!(lifecycle(&b_ev, Direction::DEVICE_TO_HOST), full);
    assert!(b_ev.iter().any(|e| matches!(
        e.kind,
        EventKind::TransferPlanned {
            direction: Direction::DEVICE_TO_HOST,
            blocks: 1,
            ..
        }
    )));
    // B computed only what the host did not have.
    assert!(
        b_ev.iter()
            .any(|e| matches!(e.kind, EventKind::TokensScheduled { prefill: 17, .. }))
    );
    // The load finished before B's blocks were stored.
    let pos = |pred: &dyn Fn(&EventKind) -> bool| b_ev.iter().position(|e| pred(&e.kind)).unwrap();
    let load_done = pos(&|k| {
        matches!(
            k,
            EventKind::TransferCompleted {
                direction: Direction::HOST_TO_DEVICE,
                ..
            }
        )
    });
    let store_planned = pos(&|k| {
        matches!(
            k,
            EventKind::TransferPlanned {
                direction: Direction::DEVICE_TO_HOST,
                ..
            }
        )
    });
    assert!(load_done < store_planned);

    // As in the walk-through's final state: the host holds 3 blocks (A's
    // two, B's one), all inactive; host hits are 32 tokens.
    let st = kvbm_events::reducer::fold(&events);
    assert_eq!(st.registered(Tier::Host).len(), 3);
    assert_eq!(report.prefix_hit_tokens_by_tier["host"], 32);
    assert_eq!(report.transfers_by_direction["G2→G1"].blocks, 2);
    assert_eq!(report.transfers_by_direction["G1→G2"].blocks, 3);
    assert_eq!(st.inconsistencies().total(), 0);
}

/// A breakpoint on Decoding for one request pauses the engine; resuming
/// releases it and the request finishes.
#[test]
fn a_breakpoint_pauses_the_engine_and_resume_releases_it() {
    let rt = runtime();
    let cfg = SimConfig::default();
    let workload = vec![
        req("keep-going", 0.0, (0..64).collect(), 4),
        req("stop-me", 0.0, (1000..1064).collect(), 4),
    ];
    let mut sim = Simulator::new(cfg, workload, rt.handle()).unwrap();
    let bp = Arc::new(Breakpoints::new(
        Some(sim.emitter().clone()),
        Duration::from_secs(30),
    ));
    bp.add(
        BreakpointSpec::default()
            .with_state("Decoding")
            .with_request("stop-me"),
    )
    .unwrap();
    let hooks = HookSet::none()
        .with_emitter(sim.emitter().clone())
        .with_breakpoints(bp.clone());
    sim.leader_mut().set_hooks(hooks);
    let mut tap = sim.emitter().bus().take_tap().unwrap();
    let engine = std::thread::spawn(move || sim.run());
    // Wait for the pause, check the engine is stuck on it, resume.
    let t = std::time::Instant::now();
    while bp.paused().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(10), "never paused");
        std::thread::sleep(Duration::from_millis(2));
    }
    let paused = bp.paused();
    assert_eq!(paused[0].call.request.as_deref(), Some("stop-me"));
    assert_eq!(paused[0].call.state, Some(SlotState::Decoding));
    std::thread::sleep(Duration::from_millis(50));
    assert!(!engine.is_finished(), "the engine did not wait");
    bp.clear_all();
    assert!(bp.resume_all() <= 1);
    let report = engine.join().unwrap();
    assert_eq!(report.requests_finished, 2);
    let mut events = Vec::new();
    drain(&mut tap, &mut events);
    let hit = events
        .iter()
        .position(|e| matches!(e.kind, EventKind::BreakpointHit { .. }))
        .expect("a BreakpointHit event");
    assert_eq!(events[hit].request.as_deref(), Some("stop-me"));
    assert!(
        events[hit..]
            .iter()
            .any(|e| matches!(e.kind, EventKind::Resumed { .. }))
    );
    let st = kvbm_events::reducer::fold(&events);
    assert_eq!(
        st.slot("stop-me").map(|s| s.state),
        Some(SlotState::Finished)
    );
    assert_eq!(st.paused_count(), 0);
    assert!(st.count_of("HookCall") > 0);
}

/// A run stopped before its workload ends says so, and counts only the
/// requests that arrived (before, `prompt_tokens` counted the whole
/// workload, diluting the hit ratio of an interrupted `--serve` run).
#[test]
fn a_run_stopped_early_says_so_and_counts_only_what_arrived() {
    let rt = runtime();
    let workload = vec![
        req("first", 0.0, (0..64).collect(), 2),
        req("much-later", 3_600_000.0, (1000..1100).collect(), 2),
    ];
    let mut sim = Simulator::new(SimConfig::default(), workload.clone(), rt.handle()).unwrap();
    // Prefill, decode, then an idle step up to the second's arrival: it
    // would be admitted on the next.
    while sim.iteration() < 3 && sim.step() {}
    let report = sim.finish();
    assert!(report.interrupted);
    assert_eq!(
        (
            report.requests_total,
            report.requests_arrived,
            report.requests_finished
        ),
        (2, 1, 1)
    );
    assert_eq!(report.prompt_tokens, 64);
    // Run to the end, it counts them all and is not interrupted.
    let report = Simulator::new(SimConfig::default(), workload, rt.handle())
        .unwrap()
        .run();
    assert!(!report.interrupted);
    assert_eq!((report.requests_arrived, report.prompt_tokens), (2, 164));
}

/// `after-hits:N`: a block reaches G2 only once G1's prefix cache has
/// served it N times (hits told by `MatchResult` on the device, of the
/// request's hashes in its `PrefixLookup`), and fewer blocks are stored
/// the larger N is.
#[test]
fn frequency_gated_offload_stores_a_block_at_its_nth_hit() {
    use kvbm_sim::sim::OffloadMode;
    let stored = |mode: OffloadMode| -> (usize, Vec<u32>) {
        let rt = runtime();
        let cfg = SimConfig {
            device_capacity_tokens: 4096,
            host_capacity_tokens: 8192,
            offload_mode: mode,
            ..SimConfig::default()
        };
        let sim = Simulator::new(cfg, sharing_workload(7, 120), rt.handle()).unwrap();
        let mut tap = sim.emitter().bus().take_tap().unwrap();
        sim.run();
        let mut events = Vec::new();
        drain(&mut tap, &mut events);
        // Per request, its hashes and the device hits not yet matched to
        // them (the device's result comes before the lookup's event).
        let mut hashes: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        let mut pending: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        let mut hits: BTreeMap<u64, u32> = BTreeMap::new();
        let mut at_store = Vec::new();
        let count = |hs: &[u64], n: u32, hits: &mut BTreeMap<u64, u32>| {
            for h in &hs[..(n as usize).min(hs.len())] {
                *hits.entry(*h).or_default() += 1;
            }
        };
        for e in &events {
            let r = e
                .request
                .as_ref()
                .map(|r| r.to_string())
                .unwrap_or_default();
            match &e.kind {
                EventKind::MatchResult {
                    tier: Tier::Device,
                    hit_blocks,
                    ..
                } => match hashes.get(&r) {
                    Some(hs) => count(hs, *hit_blocks, &mut hits),
                    None => pending.entry(r).or_default().push(*hit_blocks),
                },
                EventKind::PrefixLookup { hashes: hs, .. } => {
                    let hs: Vec<u64> = hs.iter().map(|h| h.0).collect();
                    for n in pending.remove(&r).unwrap_or_default() {
                        count(&hs, n, &mut hits);
                    }
                    hashes.insert(r, hs);
                }
                EventKind::BlockRegistered {
                    tier: Tier::Host,
                    sequence_hash,
                    duplicate_of: None,
                    ..
                } => at_store.push(hits.get(&sequence_hash.0).copied().unwrap_or(0)),
                _ => {}
            }
        }
        (at_store.len(), at_store)
    };
    let (eager, _) = stored(OffloadMode::Eager);
    let (one, at_one) = stored(OffloadMode::AfterHits(1));
    let (three, at_three) = stored(OffloadMode::AfterHits(3));
    assert!(
        eager > one && one > three && three > 0,
        "{eager} {one} {three}"
    );
    assert!(at_one.iter().all(|&n| n >= 1), "{at_one:?}");
    assert!(at_three.iter().all(|&n| n >= 3), "{at_three:?}");
}
