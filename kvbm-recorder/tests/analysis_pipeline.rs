//! The analyses together, through the public API only, as the CLI and the
//! console will use them: events go through the ring buffer (with a loss
//! marked by the tap), come back as a snapshot, are replayed, checked,
//! summarised, exported and compared.

use kvbm_events::bus::TapItem;
use kvbm_events::reducer::fold;
use kvbm_events::ring::{RingBuffer, RingConfig};
use kvbm_events::slot::SlotState::{self, *};
use kvbm_events::tier::Tier;
use kvbm_events::{Direction, EntryPoint, Event, EventKind};
use kvbm_recorder::analysis::export::{ChromeOptions, write_chrome_trace, write_jsonl};
use kvbm_recorder::analysis::replay::{ManualPacer, ReplayMode, Replayer, VecSource};
use kvbm_recorder::analysis::stats::{StatsConfig, stats};
use kvbm_recorder::analysis::{
    CheckOptions, Checker, DiffOptions, Timeline, ViolationKind, check, diff,
};
use std::sync::Arc;

/// A small engine story: `a` prefills and decodes with an eager store;
/// `b` onboards a prefix from the host, is preempted once, and finishes;
/// a breakpoint pauses `b`'s metadata build for a while.
fn story() -> Vec<Event> {
    let mut s = Story::default();
    a_prefills_and_b_is_staged(&mut s);
    the_store_lands_and_b_onboards(&mut s);
    b_is_preempted_paused_and_finishes(&mut s);
    s.events
}

/// [`story`]'s events as they are pushed, numbered from 0: engine 1, an
/// iteration a microsecond.
#[derive(Default)]
struct Story {
    events: Vec<Event>,
    seq: u64,
}

impl Story {
    fn push(&mut self, ts: u64, r: Option<&str>, kind: EventKind) {
        self.events.push(Event {
            engine: 1,
            seq: self.seq,
            ts_ns: ts,
            iteration: ts / 1_000,
            request: r.map(Arc::from),
            kind,
        });
        self.seq += 1;
    }
}

/// A slot's transition.
fn tr(from: SlotState, to: SlotState) -> EventKind {
    EventKind::SlotTransition { from, to }
}

/// 0 to 4 ms: `a` prefills, starts decoding and its eager store goes out;
/// `b` arrives and finds its prefix on the host.
fn a_prefills_and_b_is_staged(s: &mut Story) {
    let ms = 1_000_000;
    s.push(
        0,
        Some("a"),
        EventKind::SlotCreated {
            prompt_tokens: 64,
            max_output_tokens: 2,
        },
    );
    s.push(ms, Some("a"), tr(Initialized, Prefilling));
    s.push(
        ms,
        Some("a"),
        EventKind::BlocksAllocated {
            tier: Tier::Device,
            blocks: vec![0, 1, 2, 3],
        },
    );
    s.push(
        2 * ms,
        Some("a"),
        EventKind::TokensScheduled {
            prefill: 64,
            decode: 0,
            computed: 64,
        },
    );
    s.push(
        2 * ms,
        Some("a"),
        EventKind::TransferPlanned {
            transfer: 1,
            direction: Direction::DEVICE_TO_HOST,
            blocks: 4,
        },
    );
    s.push(3 * ms, Some("a"), tr(Prefilling, Decoding));
    s.push(
        3 * ms,
        Some("a"),
        EventKind::TokensScheduled {
            prefill: 0,
            decode: 1,
            computed: 65,
        },
    );
    s.push(
        3 * ms,
        Some("a"),
        EventKind::TransferPromoted {
            transfer: 1,
            direction: Direction::DEVICE_TO_HOST,
            blocks: 4,
        },
    );
    s.push(
        3 * ms,
        None,
        EventKind::BatchDispatched {
            batch: 1,
            direction: Direction::DEVICE_TO_HOST,
            transfers: vec![1],
            blocks: 4,
        },
    );
    s.push(
        4 * ms,
        Some("b"),
        EventKind::SlotCreated {
            prompt_tokens: 80,
            max_output_tokens: 1,
        },
    );
    s.push(
        4 * ms,
        Some("b"),
        EventKind::MatchResult {
            tier: Tier::Host,
            looked_up: 5,
            hit_blocks: 4,
            hit_tokens: 64,
        },
    );
    s.push(4 * ms, Some("b"), tr(Initialized, OnboardStaged(64)));
}

/// 5 and 6 ms: `a`'s store lands and `a` finishes; `b` loads its prefix
/// and starts its prefill.
fn the_store_lands_and_b_onboards(s: &mut Story) {
    let ms = 1_000_000;
    s.push(
        5 * ms,
        None,
        EventKind::BatchCompleted {
            batch: 1,
            direction: Direction::DEVICE_TO_HOST,
            ok: true,
            blocks: 4,
            bytes: 256,
            elapsed_ns: 12_345,
        },
    );
    s.push(
        5 * ms,
        Some("a"),
        EventKind::TransferCompleted {
            transfer: 1,
            direction: Direction::DEVICE_TO_HOST,
            blocks: 4,
        },
    );
    s.push(5 * ms, Some("b"), tr(OnboardStaged(64), Onboarding(64)));
    s.push(
        5 * ms,
        Some("b"),
        EventKind::BlocksAllocated {
            tier: Tier::Device,
            blocks: vec![4, 5, 6, 7],
        },
    );
    s.push(
        5 * ms,
        Some("b"),
        EventKind::TransferPlanned {
            transfer: 2,
            direction: Direction::HOST_TO_DEVICE,
            blocks: 4,
        },
    );
    s.push(
        5 * ms,
        Some("b"),
        EventKind::TransferPromoted {
            transfer: 2,
            direction: Direction::HOST_TO_DEVICE,
            blocks: 4,
        },
    );
    s.push(
        6 * ms,
        Some("b"),
        EventKind::TransferCompleted {
            transfer: 2,
            direction: Direction::HOST_TO_DEVICE,
            blocks: 4,
        },
    );
    s.push(6 * ms, Some("b"), tr(Onboarding(64), Prefilling));
    s.push(6 * ms, Some("a"), tr(Decoding, Finishing));
    s.push(6 * ms, Some("a"), tr(Finishing, Finished));
    s.push(
        6 * ms,
        Some("a"),
        EventKind::BlocksReleased {
            tier: Tier::Device,
            count: 4,
        },
    );
}

/// 7 to 12 ms: `b` is preempted and comes back, a breakpoint pauses its
/// metadata build for 2 ms, and it decodes and finishes.
fn b_is_preempted_paused_and_finishes(s: &mut Story) {
    let ms = 1_000_000;
    s.push(
        7 * ms,
        Some("b"),
        EventKind::BlocksReleased {
            tier: Tier::Device,
            count: 4,
        },
    );
    s.push(7 * ms, Some("b"), tr(Prefilling, Preempted));
    s.push(8 * ms, Some("b"), tr(Preempted, Prefilling));
    s.push(
        8 * ms,
        Some("b"),
        EventKind::BlocksAllocated {
            tier: Tier::Device,
            blocks: vec![0, 1, 2, 3, 4],
        },
    );
    s.push(
        8 * ms,
        Some("b"),
        EventKind::BreakpointHit {
            breakpoint: 9,
            entry: EntryPoint::BuildConnectorMetadata,
            deadline_ns: 68 * ms,
        },
    );
    s.push(
        10 * ms,
        Some("b"),
        EventKind::Resumed {
            breakpoint: 9,
            cause: kvbm_events::ResumeCause::Resume,
        },
    );
    s.push(
        10 * ms,
        Some("b"),
        EventKind::TokensScheduled {
            prefill: 80,
            decode: 0,
            computed: 80,
        },
    );
    s.push(11 * ms, Some("b"), tr(Prefilling, Decoding));
    s.push(
        11 * ms,
        Some("b"),
        EventKind::TokensScheduled {
            prefill: 0,
            decode: 1,
            computed: 81,
        },
    );
    s.push(12 * ms, Some("b"), tr(Decoding, Finishing));
    s.push(
        12 * ms,
        Some("b"),
        EventKind::BlocksReleased {
            tier: Tier::Device,
            count: 5,
        },
    );
    s.push(12 * ms, Some("b"), tr(Finishing, Finished));
}

#[test]
fn the_story_checks_out_and_its_numbers_add_up() {
    let ev = story();
    let r = check(&ev, CheckOptions::default());
    assert!(r.is_ok(), "{r}");
    assert_eq!((r.finished_slots, r.live_slots.len()), (2, 0));

    let st = stats(&ev, StatsConfig::default()).unwrap();
    assert_eq!((st.requests, st.finished), (2, 2));
    // a: created 0, first decode 3 ms; b: created 4 ms, first decode 11 ms.
    assert_eq!(st.ttft_ns.count, 2);
    assert_eq!(st.ttft_ns.max, 7_000_000);
    assert_eq!(st.time_in_state_ns["Preempted"].max, 1_000_000);
    assert_eq!(st.time_in_state_ns["Prefilling"].count, 3);
    assert_eq!(st.transfer_latency_ns["G1→G2"].max, 3_000_000);
    assert_eq!(st.transfer_latency_ns["G2→G1"].max, 1_000_000);
    assert_eq!(st.batch_blocks["G1→G2"].max, 4);

    let tl = Timeline::from_events(&ev);
    let b: Vec<_> = tl.intervals_of("b").map(|i| i.state).collect();
    assert_eq!(
        b,
        [
            Initialized,
            OnboardStaged(64),
            Onboarding(64),
            Prefilling,
            Preempted,
            Prefilling,
            Decoding,
            Finishing
        ]
    );
    assert_eq!(tl.breakpoints.len(), 1);
}

#[test]
fn from_the_ring_with_a_loss_to_the_checker() {
    let ev = story();
    let ring = RingBuffer::new(RingConfig {
        capacity: 1024,
        max_read: 8,
    })
    .unwrap();
    let mut checker = Checker::new(CheckOptions::default());
    // The tap dropped events 10..12 and said so.
    for (i, e) in ev.iter().enumerate() {
        match i {
            10 => {
                let item = TapItem::Gap { dropped: 2 };
                checker.observe_item(&item);
                ring.push_item(item);
            }
            11 => {}
            _ => {
                let item = TapItem::Event(e.clone());
                checker.observe_item(&item);
                ring.push_item(item);
            }
        }
    }
    let c = ring.counters();
    assert_eq!((c.pushed, c.lost, c.gaps), (ev.len() as u64 - 2, 2, 1));
    let (snap, missed) = ring.snapshot();
    assert_eq!((snap.len(), missed), (ev.len() - 2, 0));
    let report = checker.finish();
    // The hole is accounted for; what the lost events would have explained
    // (b's slot jumps from Initialized to OnboardStaged) still shows.
    assert_eq!((report.seq_gaps, report.lost), (2, 2));
    assert!(
        report
            .violations
            .iter()
            .all(|v| v.kind != ViolationKind::UnaccountedGap),
        "{report}"
    );
    // The same snapshot without the loss count: the gap is unaccounted, at
    // the first event after the hole.
    let r = check(&snap, CheckOptions::default());
    let v = r
        .violations
        .iter()
        .find(|v| v.kind == ViolationKind::UnaccountedGap)
        .expect("an unaccounted gap");
    assert_eq!(v.seq, Some(12));

    // Replay the snapshot step by step and back.
    let mut rp = Replayer::with_pacer(
        VecSource::from(snap.clone()),
        ReplayMode::Step,
        ManualPacer::default(),
    )
    .unwrap();
    while rp.advance() == 1 {}
    assert_eq!(rp.state(), &fold(&snap));
    rp.seek_to_time(6_000_000).unwrap();
    assert_eq!(
        rp.state().slot("a").map(|s| s.state),
        Some(SlotState::Finished)
    );
    // The last event at 6 ms is a's release; two steps back, a is
    // Finishing again.
    assert!(matches!(
        rp.last_event().map(|e| &e.kind),
        Some(EventKind::BlocksReleased { count: 4, .. })
    ));
    assert!(rp.step_back().unwrap());
    assert!(rp.step_back().unwrap());
    assert_eq!(
        rp.state().slot("a").map(|s| s.state),
        Some(SlotState::Finishing)
    );
    // Real time at 10×: 12 ms of engine time is 1.2 ms of waiting.
    rp.rewind().unwrap();
    rp.set_mode(ReplayMode::real_time(10.0));
    rp.advance();
    assert_eq!(rp.pacer().now.as_nanos(), 1_200_000);
}

#[test]
fn exports_and_diff() {
    let ev = story();
    let mut chrome = Vec::new();
    write_chrome_trace(&ev, &mut chrome, ChromeOptions::default()).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&chrome).unwrap();
    let tracks: Vec<_> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(tracks, ["a", "b"]);

    let mut jl = Vec::new();
    assert_eq!(write_jsonl(&ev, &mut jl).unwrap(), ev.len() as u64);

    // Same story, other names and clock: equal. One decode less: not.
    let other: Vec<Event> = ev
        .iter()
        .map(|e| {
            let mut e = e.clone();
            e.request = e.request.map(|r| Arc::from(format!("req-{r}")));
            // The whole clock shifts, deadlines included.
            e.ts_ns += 5;
            if let EventKind::BreakpointHit { deadline_ns, .. } = &mut e.kind {
                *deadline_ns += 5;
            }
            e.engine = 2;
            e
        })
        .collect();
    assert_eq!(diff(&ev, &other, &DiffOptions::default()), None);
    let mut shorter = ev.clone();
    let i = shorter
        .iter()
        .rposition(|e| matches!(e.kind, EventKind::TokensScheduled { decode: 1, .. }))
        .unwrap();
    shorter.remove(i);
    let d = diff(&ev, &shorter, &DiffOptions::default()).unwrap();
    assert_eq!((d.a.index, d.b.index), (i as u64, i as u64));
    assert!(d.message.contains("TokensScheduled"), "{d}");
}
