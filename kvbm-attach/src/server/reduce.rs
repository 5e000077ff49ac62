//! The server's reducer: the engine's state, folded from the ring, for
//! `/snapshot` and `/metrics`.

use super::AppState;
use super::live::wait_for_ring;
use kvbm_events::reducer::EngineState;
use kvbm_events::{Direction, EventKind};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Distinct skip reasons kept as metric labels; later ones count as
/// `other` (a reason can be free text, and labels must stay few).
const MAX_SKIP_REASONS: usize = 32;
/// Longest skip reason label kept.
const MAX_REASON_LEN: usize = 64;
/// Events applied per lock.
const CHUNK: usize = 256;

pub(super) struct ReducedInner {
    pub state: EngineState,
    /// Skipped transfers by (direction, reason).
    pub skips: BTreeMap<(Direction, String), u64>,
    /// Events the reducer never saw (the ring overwrote them first).
    pub missed: u64,
}

pub(super) struct Reduced {
    inner: Mutex<ReducedInner>,
}

impl Reduced {
    pub fn new() -> Self {
        Reduced {
            inner: Mutex::new(ReducedInner {
                state: EngineState::default(),
                skips: BTreeMap::new(),
                missed: 0,
            }),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, ReducedInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn reason_label(reason: &str, skips: &BTreeMap<(Direction, String), u64>) -> String {
    let mut r: String = reason
        .chars()
        .take(MAX_REASON_LEN)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    if r.is_empty() {
        r.push_str("unknown");
    }
    let known = skips.keys().any(|(_, k)| *k == r);
    let distinct = || {
        let mut v: Vec<&str> = skips.keys().map(|(_, k)| k.as_str()).collect();
        v.sort_unstable();
        v.dedup();
        v.len()
    };
    if known || distinct() < MAX_SKIP_REASONS {
        r
    } else {
        "other".to_string()
    }
}

pub(super) async fn run_reducer(state: Arc<AppState>) {
    let ring = state.engine.ring.clone();
    let signal = state.engine.signal.clone();
    let mut ring_rx = signal.subscribe();
    let mut shutdown = state.shutdown.clone();
    let keep = state.cfg.keep_finished_slots;
    let mut pos = ring.counters().oldest_position();
    let mut since_prune = 0usize;
    loop {
        ring_rx.borrow_and_update();
        let r = ring.read_at_most(pos, CHUNK);
        if r.events.is_empty() {
            pos = pos.max(r.next);
            if !wait_for_ring(&mut ring_rx, signal.is_attached(), &mut shutdown).await {
                return;
            }
            continue;
        }
        pos = r.next;
        {
            let mut g = state.reduced.lock();
            g.missed += r.missed;
            for ev in &r.events {
                g.state.apply(ev);
                if let EventKind::TransferSkipped {
                    direction, reason, ..
                } = &ev.kind
                {
                    let label = reason_label(reason, &g.skips);
                    *g.skips.entry((*direction, label)).or_default() += 1;
                }
            }
            since_prune += r.events.len();
            if since_prune >= 4096 {
                since_prune = 0;
                g.state.prune_finished(keep);
            }
        }
        drop(r);
        tokio::task::yield_now().await;
    }
}
