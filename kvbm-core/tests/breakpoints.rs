//! Breakpoints through the public API: calls really block their thread, and
//! every pause shows up on the bus as one `BreakpointHit` and one `Resumed`
//! with the right cause.

use kvbm_core::hooks::{Breakpoints, HookSet, Hooks};
use kvbm_events::breakpoint::{
    BreakpointError, BreakpointSpec, CallInfo, DEFAULT_DEADLINE, OwnerReleased, PausedCall,
    STEP_BREAKPOINT,
};
use kvbm_events::bus::{BusConfig, TapItem, TapReceiver};
use kvbm_events::slot::SlotState;
use kvbm_events::{
    Direction, Emitter, EntryPoint, Event, EventKind, HookPhase, ResumeCause, VirtualClock,
};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Long enough that a test never fails on a slow machine.
const PATIENCE: Duration = Duration::from_secs(20);

struct Rig {
    clock: Arc<VirtualClock>,
    emitter: Arc<Emitter>,
    tap: TapReceiver<Event>,
    bp: Arc<Breakpoints>,
}

fn rig(deadline: Duration) -> Rig {
    let clock = Arc::new(VirtualClock::new());
    let emitter = Arc::new(Emitter::new(3, BusConfig::default(), clock.clone()).unwrap());
    let tap = emitter.bus().take_tap().unwrap();
    let bp = Arc::new(Breakpoints::new(Some(emitter.clone()), deadline));
    Rig {
        clock,
        emitter,
        tap,
        bp,
    }
}

fn drain(tap: &mut TapReceiver<Event>) -> Vec<Event> {
    let mut out = Vec::new();
    while let Ok(item) = tap.try_recv() {
        match item {
            TapItem::Event(e) => out.push(e),
            TapItem::Gap { dropped } => panic!("tap lost {dropped} events"),
        }
    }
    out
}

fn call(entry: EntryPoint, request: &str) -> CallInfo {
    CallInfo::new(entry).with_request(Arc::from(request))
}

/// Runs `check(call)` on a thread of its own, as the engine's scheduler
/// thread would.
fn spawn_check(bp: &Arc<Breakpoints>, call: CallInfo) -> JoinHandle<()> {
    let bp = Arc::clone(bp);
    thread::spawn(move || bp.check(&call))
}

/// Waits until exactly `n` calls are paused.
fn wait_paused(bp: &Breakpoints, n: usize) -> Vec<PausedCall> {
    let start = Instant::now();
    loop {
        let p = bp.paused();
        if p.len() == n {
            return p;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "{} calls paused, expected {n}",
            p.len()
        );
        thread::sleep(Duration::from_millis(1));
    }
}

/// Whether `call` pauses on `bp`; a pause is resumed before returning.
fn pauses(bp: &Arc<Breakpoints>, call: CallInfo) -> bool {
    let h = spawn_check(bp, call);
    let start = Instant::now();
    loop {
        if let Some(p) = bp.paused().first() {
            assert!(bp.resume(p.pause_id));
            h.join().unwrap();
            return true;
        }
        if h.is_finished() {
            h.join().unwrap();
            return false;
        }
        assert!(start.elapsed() < PATIENCE, "neither paused nor finished");
        thread::sleep(Duration::from_millis(1));
    }
}

fn resumed(breakpoint: u64, cause: ResumeCause) -> EventKind {
    EventKind::Resumed { breakpoint, cause }
}

#[test]
fn each_field_matches_alone_and_combined() {
    let r = rig(DEFAULT_DEADLINE);
    let full = CallInfo::new(EntryPoint::TransferExecute)
        .with_request(Arc::from("tenant-a/req-7"))
        .with_state(SlotState::Decoding)
        .with_direction(Direction::DEVICE_TO_HOST);
    let cases: Vec<(BreakpointSpec, CallInfo)> = vec![
        (
            BreakpointSpec::default().with_state("Decoding"),
            CallInfo {
                state: Some(SlotState::Prefilling),
                ..full.clone()
            },
        ),
        (
            BreakpointSpec::default().with_request("tenant-a/req-7"),
            call(EntryPoint::TransferExecute, "tenant-a/req-70"),
        ),
        (
            BreakpointSpec::default().with_request_prefix("tenant-a/"),
            call(EntryPoint::TransferExecute, "tenant-b/req-7"),
        ),
        (
            BreakpointSpec::default().with_direction(Direction::DEVICE_TO_HOST),
            CallInfo {
                direction: Some(Direction::HOST_TO_DISK),
                ..full.clone()
            },
        ),
        (
            BreakpointSpec::default().with_entry(EntryPoint::TransferExecute),
            CallInfo {
                entry: EntryPoint::RequestFinished,
                ..full.clone()
            },
        ),
        (
            BreakpointSpec::default()
                .with_state("Decoding")
                .with_request_prefix("tenant-a")
                .with_direction(Direction::DEVICE_TO_HOST)
                .with_entry(EntryPoint::TransferExecute),
            // All fields but the direction match: AND means no pause.
            CallInfo {
                direction: Some(Direction::DISK_TO_HOST),
                ..full.clone()
            },
        ),
    ];
    for (spec, miss) in cases {
        let id = r.bp.add(spec.clone()).unwrap();
        assert!(pauses(&r.bp, full.clone()), "{spec:?} should pause");
        assert!(!pauses(&r.bp, miss.clone()), "{spec:?} paused {miss:?}");
        assert_eq!(r.bp.list()[0].hits, 1);
        assert!(r.bp.clear(id));
    }
}

#[test]
fn a_paused_call_blocks_until_resumed_and_says_so_on_the_bus() {
    let mut r = rig(DEFAULT_DEADLINE);
    r.clock.advance_to(1_000);
    let id =
        r.bp.add(BreakpointSpec::default().with_request("req-1"))
            .unwrap();
    let h = spawn_check(&r.bp, call(EntryPoint::GetNumNewMatchedTokens, "req-1"));
    let p = wait_paused(&r.bp, 1);
    assert_eq!(p[0].breakpoint, id);
    assert_eq!(p[0].call.entry, EntryPoint::GetNumNewMatchedTokens);
    assert!(p[0].deadline_in <= DEFAULT_DEADLINE);
    // Still blocked a while later.
    thread::sleep(Duration::from_millis(30));
    assert!(!h.is_finished());
    assert!(r.bp.paused()[0].waited >= Duration::from_millis(30));
    assert!(r.bp.resume(p[0].pause_id));
    h.join().unwrap();
    assert!(r.bp.paused().is_empty());

    let events = drain(&mut r.tap);
    assert_eq!(events.len(), 2);
    assert_eq!(
        events[0].kind,
        EventKind::BreakpointHit {
            breakpoint: id,
            entry: EntryPoint::GetNumNewMatchedTokens,
            deadline_ns: 1_000 + DEFAULT_DEADLINE.as_nanos() as u64,
        }
    );
    assert_eq!(events[1].kind, resumed(id, ResumeCause::Resume));
    for e in &events {
        assert_eq!(e.request.as_deref(), Some("req-1"));
        assert_eq!(e.engine, 3);
    }
    assert_eq!((events[0].seq, events[1].seq), (0, 1));
}

#[test]
fn several_threads_pause_at_once_each_with_its_own_pause() {
    let mut r = rig(DEFAULT_DEADLINE);
    r.bp.add(BreakpointSpec::default().with_request_prefix("r"))
        .unwrap();
    let handles: Vec<_> = (0..3)
        .map(|i| spawn_check(&r.bp, call(EntryPoint::CreateSlot, &format!("r{i}"))))
        .collect();
    let p = wait_paused(&r.bp, 3);
    let ids: std::collections::HashSet<_> = p.iter().map(|p| p.pause_id).collect();
    assert_eq!(ids.len(), 3);
    // Resume one: only its thread goes on.
    let first = p
        .iter()
        .find(|p| p.call.request.as_deref() == Some("r1"))
        .unwrap();
    assert!(r.bp.resume(first.pause_id));
    let left = wait_paused(&r.bp, 2);
    assert!(left.iter().all(|p| p.call.request.as_deref() != Some("r1")));
    assert_eq!(r.bp.resume_all(), 2);
    for h in handles {
        h.join().unwrap();
    }
    let events = drain(&mut r.tap);
    assert_eq!(events.len(), 6);
    for req in ["r0", "r1", "r2"] {
        let mine: Vec<_> = events
            .iter()
            .filter(|e| e.request.as_deref() == Some(req))
            .map(|e| e.kind.name())
            .collect();
        assert_eq!(mine, ["BreakpointHit", "Resumed"], "{req}");
    }
}

#[test]
fn step_resumes_and_pauses_the_very_next_call() {
    let mut r = rig(DEFAULT_DEADLINE);
    let id =
        r.bp.add(BreakpointSpec::default().with_entry(EntryPoint::CreateSlot))
            .unwrap();
    let h = spawn_check(&r.bp, call(EntryPoint::CreateSlot, "a"));
    wait_paused(&r.bp, 1);
    assert!(r.bp.step());
    h.join().unwrap();
    assert!(r.bp.paused().is_empty());

    // The next call pauses although no breakpoint matches it.
    let h = spawn_check(&r.bp, call(EntryPoint::RequestFinished, "b"));
    let p = wait_paused(&r.bp, 1);
    assert_eq!(p[0].breakpoint, STEP_BREAKPOINT);
    assert_eq!(p[0].call.entry, EntryPoint::RequestFinished);
    assert!(r.bp.resume(p[0].pause_id));
    h.join().unwrap();

    // The step was one-shot: the call after that runs through.
    assert!(!pauses(&r.bp, call(EntryPoint::RequestFinished, "c")));

    let kinds: Vec<_> = drain(&mut r.tap).into_iter().map(|e| e.kind).collect();
    assert!(matches!(kinds[0], EventKind::BreakpointHit { breakpoint, .. } if breakpoint == id));
    assert_eq!(kinds[1], resumed(id, ResumeCause::Step));
    assert!(matches!(
        kinds[2],
        EventKind::BreakpointHit {
            breakpoint: STEP_BREAKPOINT,
            entry: EntryPoint::RequestFinished,
            ..
        }
    ));
    assert_eq!(kinds[3], resumed(STEP_BREAKPOINT, ResumeCause::Resume));
    assert_eq!(kinds.len(), 4);
}

#[test]
fn step_with_nothing_paused_still_arms() {
    let r = rig(DEFAULT_DEADLINE);
    assert!(!r.bp.is_armed());
    assert!(!r.bp.step(), "nothing was paused");
    assert!(r.bp.is_armed());
    assert!(pauses(&r.bp, CallInfo::new(EntryPoint::TransferExecute)));
    assert!(!r.bp.is_armed());
    // Clearing the step pseudo-breakpoint disarms a pending step.
    r.bp.step();
    assert!(r.bp.clear(STEP_BREAKPOINT));
    assert!(!r.bp.is_armed());
}

#[test]
fn a_pause_ends_by_itself_at_its_deadline() {
    let mut r = rig(Duration::from_millis(50));
    let id =
        r.bp.add(BreakpointSpec::default().with_state("Prefilling"))
            .unwrap();
    let start = Instant::now();
    r.bp.check(&call(EntryPoint::UpdateStateAfterAlloc, "slow").with_state(SlotState::Prefilling));
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(50), "{waited:?}");
    assert!(waited < PATIENCE);
    let events = drain(&mut r.tap);
    assert_eq!(events.len(), 2);
    assert!(matches!(
        events[0].kind,
        EventKind::BreakpointHit { deadline_ns, .. } if deadline_ns == 50_000_000
    ));
    assert_eq!(events[1].kind, resumed(id, ResumeCause::Deadline));
    assert!(r.bp.paused().is_empty());
    // Nobody attended to it: the breakpoint is gone with the pause, so the
    // engine is not stopped again at the next matching call.
    assert!(r.bp.list().is_empty());
    assert!(!r.bp.is_armed());
    let start = Instant::now();
    r.bp.check(&call(EntryPoint::UpdateStateAfterAlloc, "slow").with_state(SlotState::Prefilling));
    assert!(start.elapsed() < Duration::from_millis(50));
}

#[test]
fn the_default_deadline_can_be_changed_for_later_pauses() {
    let mut r = rig(DEFAULT_DEADLINE);
    r.bp.set_default_deadline(Duration::from_millis(20))
        .unwrap();
    assert_eq!(
        r.bp.set_default_deadline(Duration::ZERO),
        Err(BreakpointError::BadDeadline {
            got: Duration::ZERO,
            min: kvbm_events::breakpoint::MIN_DEADLINE,
            max: kvbm_events::breakpoint::MAX_DEADLINE,
        })
    );
    r.bp.add(BreakpointSpec::default().with_entry(EntryPoint::CreateSlot))
        .unwrap();
    r.bp.check(&call(EntryPoint::CreateSlot, "x"));
    let kinds: Vec<_> = drain(&mut r.tap).into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds[1], resumed(1, ResumeCause::Deadline));
}

#[test]
fn clear_resumes_only_the_calls_paused_on_that_breakpoint() {
    let mut r = rig(DEFAULT_DEADLINE);
    let a =
        r.bp.add(BreakpointSpec::default().with_request("a"))
            .unwrap();
    let b =
        r.bp.add(BreakpointSpec::default().with_request("b"))
            .unwrap();
    let ha = spawn_check(&r.bp, call(EntryPoint::CreateSlot, "a"));
    let hb = spawn_check(&r.bp, call(EntryPoint::CreateSlot, "b"));
    wait_paused(&r.bp, 2);
    assert!(r.bp.clear(a));
    ha.join().unwrap();
    let left = wait_paused(&r.bp, 1);
    assert_eq!(left[0].breakpoint, b);
    assert!(!hb.is_finished());
    assert_eq!(r.bp.list().len(), 1);
    // clear_all resumes the rest.
    assert_eq!(r.bp.clear_all(), 1);
    hb.join().unwrap();
    assert!(!r.bp.is_armed());

    let events = drain(&mut r.tap);
    let resumes: Vec<_> = events
        .iter()
        .filter(|e| e.kind.name() == "Resumed")
        .map(|e| (e.request.as_deref().unwrap().to_string(), e.kind.clone()))
        .collect();
    assert_eq!(
        resumes,
        vec![
            ("a".to_string(), resumed(a, ResumeCause::Cleared)),
            ("b".to_string(), resumed(b, ResumeCause::Cleared)),
        ]
    );
}

#[test]
fn a_client_going_away_releases_only_its_own_breakpoints_and_pauses() {
    let mut r = rig(DEFAULT_DEADLINE);
    let mine =
        r.bp.add(BreakpointSpec::default().with_request("a").with_owner(1))
            .unwrap();
    let theirs =
        r.bp.add(BreakpointSpec::default().with_request("b").with_owner(2))
            .unwrap();
    let _unowned =
        r.bp.add(BreakpointSpec::default().with_request("c"))
            .unwrap();
    let ha = spawn_check(&r.bp, call(EntryPoint::CreateSlot, "a"));
    let hb = spawn_check(&r.bp, call(EntryPoint::CreateSlot, "b"));
    wait_paused(&r.bp, 2);

    assert_eq!(
        r.bp.release_owner(1),
        OwnerReleased {
            breakpoints: 1,
            resumed: 1
        }
    );
    ha.join().unwrap();
    let left = wait_paused(&r.bp, 1);
    assert_eq!(left[0].breakpoint, theirs);
    let ids: Vec<_> = r.bp.list().iter().map(|i| i.id).collect();
    assert!(!ids.contains(&mine) && ids.contains(&theirs) && ids.len() == 2);
    // Releasing an owner with nothing left is harmless.
    assert_eq!(r.bp.release_owner(1), OwnerReleased::default());
    assert!(!hb.is_finished());
    assert_eq!(r.bp.release_owner(2).resumed, 1);
    hb.join().unwrap();

    let resumes: Vec<_> = drain(&mut r.tap)
        .into_iter()
        .filter(|e| e.kind.name() == "Resumed")
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        resumes,
        vec![
            resumed(mine, ResumeCause::ClientGone),
            resumed(theirs, ResumeCause::ClientGone)
        ]
    );
}

#[test]
fn a_client_going_away_disarms_its_step_and_ends_the_pause_it_caused() {
    let mut r = rig(DEFAULT_DEADLINE);
    r.bp.step_for(5);
    let h = spawn_check(&r.bp, call(EntryPoint::CreateSlot, "s"));
    wait_paused(&r.bp, 1);
    assert_eq!(r.bp.release_owner(5).resumed, 1);
    h.join().unwrap();
    r.bp.step_for(5);
    r.bp.release_owner(5);
    assert!(!r.bp.is_armed());
    let kinds: Vec<_> = drain(&mut r.tap).into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds[1], resumed(STEP_BREAKPOINT, ResumeCause::ClientGone));
}

#[test]
fn a_million_checks_without_breakpoints_stay_on_the_fast_path() {
    let r = rig(DEFAULT_DEADLINE);
    let c = CallInfo::new(EntryPoint::BuildConnectorMetadata)
        .with_request(Arc::from("r"))
        .with_state(SlotState::Decoding);
    for _ in 0..1_000_000 {
        r.bp.check(&c);
    }
    assert_eq!(r.bp.slow_checks(), 0);
    assert_eq!(r.emitter.emitted(), 0);
    // Adding and clearing a breakpoint leaves it fast again.
    let id =
        r.bp.add(BreakpointSpec::default().with_request("nope"))
            .unwrap();
    r.bp.check(&c);
    assert_eq!(r.bp.slow_checks(), 1);
    r.bp.clear(id);
    for _ in 0..1_000 {
        r.bp.check(&c);
    }
    assert_eq!(r.bp.slow_checks(), 1);
}

#[test]
fn invalid_specs_and_a_full_table_are_typed_errors() {
    let r = rig(DEFAULT_DEADLINE);
    assert_eq!(
        r.bp.add(BreakpointSpec::default()),
        Err(BreakpointError::EmptySpec)
    );
    assert_eq!(
        r.bp.add(BreakpointSpec::default().with_state("decoding")),
        Err(BreakpointError::UnknownState("decoding".into())),
        "names are case-sensitive, as SlotState::name() spells them"
    );
    let small = Breakpoints::new(None, DEFAULT_DEADLINE).with_max_breakpoints(3);
    for _ in 0..3 {
        small
            .add(BreakpointSpec::default().with_entry(EntryPoint::CreateSlot))
            .unwrap();
    }
    assert_eq!(
        small.add(BreakpointSpec::default().with_entry(EntryPoint::CreateSlot)),
        Err(BreakpointError::Full { max: 3 })
    );
    assert_eq!(small.list().len(), 3);
}

#[derive(Default)]
struct Recording(Mutex<Vec<(EntryPoint, HookPhase)>>);

impl Hooks for Recording {
    fn will_call(&self, call: &CallInfo) {
        self.0.lock().unwrap().push((call.entry, HookPhase::Will));
    }
    fn finished_call(&self, call: &CallInfo) {
        self.0
            .lock()
            .unwrap()
            .push((call.entry, HookPhase::Finished));
    }
}

#[test]
fn hookset_emits_one_hook_call_per_call_when_enabled_and_none_when_disabled() {
    let mut r = rig(DEFAULT_DEADLINE);
    let user = Arc::new(Recording::default());
    let enabled = HookSet::new(Some(user.clone()), Some(r.emitter.clone()));
    for entry in EntryPoint::ALL {
        let c = call(entry, "h");
        enabled.will_call(&c);
        enabled.finished_call(&c);
    }
    let events = drain(&mut r.tap);
    assert_eq!(events.len(), 2 * EntryPoint::ALL.len());
    for (pair, entry) in events.chunks(2).zip(EntryPoint::ALL) {
        assert_eq!(
            pair[0].kind,
            EventKind::HookCall {
                entry,
                phase: HookPhase::Will
            }
        );
        assert_eq!(
            pair[1].kind,
            EventKind::HookCall {
                entry,
                phase: HookPhase::Finished
            }
        );
        assert_eq!(pair[0].request.as_deref(), Some("h"));
    }
    assert_eq!(user.0.lock().unwrap().len(), 2 * EntryPoint::ALL.len());

    let disabled = HookSet::none();
    for entry in EntryPoint::ALL {
        let c = call(entry, "h");
        disabled.will_call(&c);
        disabled.finished_call(&c);
    }
    assert!(drain(&mut r.tap).is_empty());
    assert_eq!(r.emitter.emitted(), 2 * EntryPoint::ALL.len() as u64);
}
