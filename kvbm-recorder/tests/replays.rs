//! The logs in `replays/` (recorded with `kvbm-recorder record`, see the
//! README) replay cleanly: no damage, the invariants hold, and the
//! statistics equal the golden ones recorded beside each log.

use kvbm_events::EventKind;
use kvbm_events::slot::SlotState;
use kvbm_recorder::analysis::{self, CheckOptions, StatsConfig};
use kvbm_recorder::recorder;
use std::path::PathBuf;

fn replays() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../replays"))
}

fn replay(name: &str) -> Vec<kvbm_events::Event> {
    let dir = replays().join(name);
    let read = recorder::read_events(&dir, |_| {}).unwrap();
    assert!(read.damage.is_none(), "{name}: {:?}", read.damage);
    let side = recorder::read_sidecar(&dir).expect("recording.json");
    assert_eq!(side.events, read.events.len() as u64, "{name}");
    let report = analysis::check(
        &read.events,
        CheckOptions {
            lost: side.lost,
            ..CheckOptions::default()
        },
    );
    assert!(report.is_ok(), "{name}: {report}");
    let stats = analysis::stats::stats(&read.events, StatsConfig::default()).unwrap();
    let got = serde_json::to_value(&stats).unwrap();
    let golden: serde_json::Value = serde_json::from_slice(
        &std::fs::read(replays().join(format!("{name}.stats.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(
        got, golden,
        "{name}: statistics differ from the golden ones"
    );
    read.events
}

fn transitions(events: &[kvbm_events::Event]) -> Vec<SlotState> {
    events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::SlotTransition { to, .. } => Some(to),
            _ => None,
        })
        .collect()
}

#[test]
fn cpu_offload_walkthrough() {
    let ev = replay("cpu-offload-walkthrough");
    assert!(transitions(&ev).contains(&SlotState::OnboardStaged(32)));
}

#[test]
fn preemption_heavy() {
    let ev = replay("preemption-heavy");
    assert!(
        transitions(&ev)
            .iter()
            .filter(|s| **s == SlotState::Preempted)
            .count()
            >= 5
    );
}

#[test]
fn mooncake_slice() {
    let ev = replay("mooncake-slice");
    let created = ev
        .iter()
        .filter(|e| matches!(e.kind, EventKind::SlotCreated { .. }))
        .count();
    assert_eq!(created, 40);
}
