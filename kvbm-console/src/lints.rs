//! Lints: things worth a warning on screen.
//!
//! Two come from events as they pass (an offload skipped because its
//! destination was full; a block evicted from a tier and offloaded to it
//! again soon after: thrash) and are counted and listed. Two are about the
//! present (a slot stuck in Finishing with outstanding operations; a paused
//! call near its deadline) and are computed from the reducer's state on
//! demand. Everything is bounded, with counters for what a bound dropped.

use kvbm_events::SequenceHash;
use kvbm_events::reducer::EngineState;
use kvbm_events::slot::SlotState;
use kvbm_events::tier::Tier;
use kvbm_events::{Event, EventKind, RequestId};
use std::collections::{HashMap, VecDeque};

/// The kinds of warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LintKind {
    /// A slot in Finishing with outstanding operations past the threshold.
    StuckFinishing,
    /// An offload skipped because the destination pool was full.
    DestinationFull,
    /// A block evicted from a tier and offloaded to it again soon after.
    Thrash,
    /// A paused call close to its deadline.
    PauseNearDeadline,
}

impl LintKind {
    /// Every kind, in display order.
    pub const ALL: [LintKind; 4] = [
        LintKind::StuckFinishing,
        LintKind::DestinationFull,
        LintKind::Thrash,
        LintKind::PauseNearDeadline,
    ];

    /// A short name.
    pub fn name(self) -> &'static str {
        match self {
            LintKind::StuckFinishing => "stuck-finishing",
            LintKind::DestinationFull => "offload-dest-full",
            LintKind::Thrash => "thrash",
            LintKind::PauseNearDeadline => "pause-near-deadline",
        }
    }
}

/// Thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LintConfig {
    /// Finishing with outstanding operations for longer than this, ns.
    pub stuck_finishing_ns: u64,
    /// Evicted then offloaded to the same tier within this, ns.
    pub thrash_window_ns: u64,
    /// A paused call with less than this left before its deadline, ns.
    pub deadline_warn_ns: u64,
    /// Recent warnings kept for the list.
    pub recent: usize,
    /// Evictions remembered for the thrash check.
    pub tracked_evictions: usize,
}

impl Default for LintConfig {
    fn default() -> Self {
        LintConfig {
            stuck_finishing_ns: 5_000_000_000,
            thrash_window_ns: 2_000_000_000,
            deadline_warn_ns: 5_000_000_000,
            recent: 256,
            tracked_evictions: 65_536,
        }
    }
}

/// One warning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lint {
    /// What kind.
    pub kind: LintKind,
    /// When (engine ns).
    pub ts_ns: u64,
    /// The request, where there is one.
    pub request: Option<RequestId>,
    /// What exactly.
    pub detail: String,
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct Lints {
    cfg: LintConfig,
    counts: [u64; 2],
    recent: VecDeque<Lint>,
    recent_dropped: u64,
    evicted: HashMap<(Tier, SequenceHash), u64>,
    evicted_order: VecDeque<(u64, Tier, SequenceHash)>,
    tracking_dropped: u64,
}

impl Lints {
    /// Nothing seen yet.
    pub fn new(cfg: LintConfig) -> Self {
        Lints {
            cfg,
            counts: [0; 2],
            recent: VecDeque::new(),
            recent_dropped: 0,
            evicted: HashMap::new(),
            evicted_order: VecDeque::new(),
            tracking_dropped: 0,
        }
    }

    fn push(&mut self, lint: Lint) {
        if self.recent.len() >= self.cfg.recent.max(1) {
            self.recent.pop_front();
            self.recent_dropped += 1;
        }
        self.recent.push_back(lint);
    }

    /// Takes one event.
    pub fn observe(&mut self, ev: &Event) {
        // Forget evictions older than the window.
        while let Some(&(t, tier, h)) = self.evicted_order.front() {
            if ev.ts_ns.saturating_sub(t) <= self.cfg.thrash_window_ns {
                break;
            }
            self.evicted_order.pop_front();
            if self.evicted.get(&(tier, h)) == Some(&t) {
                self.evicted.remove(&(tier, h));
            }
        }
        match &ev.kind {
            EventKind::TransferSkipped {
                transfer,
                direction,
                reason,
            } if reason == "destination_full" => {
                self.counts[0] += 1;
                self.push(Lint {
                    kind: LintKind::DestinationFull,
                    ts_ns: ev.ts_ns,
                    request: ev.request.clone(),
                    detail: format!("transfer #{transfer} {direction}: destination full"),
                });
            }
            EventKind::BlockEvicted {
                tier,
                sequence_hash,
                ..
            } if *tier != Tier::Device => {
                if self.evicted_order.len() >= self.cfg.tracked_evictions.max(1)
                    && let Some((t, tier, h)) = self.evicted_order.pop_front()
                {
                    self.tracking_dropped += 1;
                    if self.evicted.get(&(tier, h)) == Some(&t) {
                        self.evicted.remove(&(tier, h));
                    }
                }
                self.evicted.insert((*tier, *sequence_hash), ev.ts_ns);
                self.evicted_order
                    .push_back((ev.ts_ns, *tier, *sequence_hash));
            }
            EventKind::BlockRegistered {
                tier,
                sequence_hash,
                ..
            } if *tier != Tier::Device => {
                if let Some(t) = self.evicted.remove(&(*tier, *sequence_hash)) {
                    self.counts[1] += 1;
                    let ago = ev.ts_ns.saturating_sub(t);
                    self.push(Lint {
                        kind: LintKind::Thrash,
                        ts_ns: ev.ts_ns,
                        request: ev.request.clone(),
                        detail: format!(
                            "block {sequence_hash} back on {} {} after its eviction",
                            tier.short_name(),
                            crate::fmt::dur(ago)
                        ),
                    });
                }
            }
            _ => {}
        }
    }

    /// Offloads skipped for a full destination, so far.
    pub fn destination_full(&self) -> u64 {
        self.counts[0]
    }

    /// Thrash events, so far.
    pub fn thrash(&self) -> u64 {
        self.counts[1]
    }

    /// The recent event-based warnings, oldest first.
    pub fn recent(&self) -> &VecDeque<Lint> {
        &self.recent
    }

    /// Warnings pushed out of the recent list.
    pub fn recent_dropped(&self) -> u64 {
        self.recent_dropped
    }

    /// Evictions forgotten before their window ended because the tracking
    /// table was full (thrash may be under-counted by at most this).
    pub fn tracking_dropped(&self) -> u64 {
        self.tracking_dropped
    }

    /// The warnings about the present state at engine time `now_ns`.
    pub fn current(&self, state: &EngineState, now_ns: u64) -> Vec<Lint> {
        let mut out = Vec::new();
        for s in state.slots() {
            let stuck = now_ns.saturating_sub(s.state_since_ns);
            if s.state == SlotState::Finishing
                && s.outstanding > 0
                && stuck > self.cfg.stuck_finishing_ns
            {
                out.push(Lint {
                    kind: LintKind::StuckFinishing,
                    ts_ns: s.state_since_ns,
                    request: Some(s.request.clone()),
                    detail: format!(
                        "{} in Finishing for {} with {} outstanding",
                        s.request,
                        crate::fmt::dur(stuck),
                        s.outstanding
                    ),
                });
            }
        }
        for p in state.paused() {
            let left = p.deadline_ns.saturating_sub(now_ns);
            if left < self.cfg.deadline_warn_ns {
                out.push(Lint {
                    kind: LintKind::PauseNearDeadline,
                    ts_ns: p.hit_ns,
                    request: p.request.clone(),
                    detail: format!(
                        "{} paused at {} resumes by itself in {}",
                        p.request.as_deref().unwrap_or("(no request)"),
                        p.entry.name(),
                        crate::fmt::dur(left)
                    ),
                });
            }
        }
        out.sort_by_key(|l| (l.kind, l.ts_ns));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::Direction;

    fn ev(seq: u64, ts_ns: u64, kind: EventKind) -> Event {
        Event {
            engine: 0,
            seq,
            ts_ns,
            iteration: 0,
            request: Some("r".into()),
            kind,
        }
    }

    fn evicted(seq: u64, ts: u64, tier: Tier, h: u64) -> Event {
        ev(
            seq,
            ts,
            EventKind::BlockEvicted {
                tier,
                block: 1,
                sequence_hash: kvbm_events::SequenceHash(h),
            },
        )
    }

    fn registered(seq: u64, ts: u64, tier: Tier, h: u64) -> Event {
        ev(
            seq,
            ts,
            EventKind::BlockRegistered {
                tier,
                block: 2,
                sequence_hash: kvbm_events::SequenceHash(h),
                duplicate_of: None,
            },
        )
    }

    #[test]
    fn eviction_then_offload_within_the_window_is_thrash() {
        let mut l = Lints::new(LintConfig::default());
        l.observe(&evicted(0, 0, Tier::Host, 7));
        l.observe(&registered(1, 1_000_000_000, Tier::Host, 7));
        assert_eq!(l.thrash(), 1);
        // Outside the window: not thrash.
        l.observe(&evicted(2, 2_000_000_000, Tier::Host, 8));
        l.observe(&registered(3, 5_000_000_000, Tier::Host, 8));
        // Another tier, or G1 (recompute, not offload): not thrash.
        l.observe(&evicted(4, 5_000_000_000, Tier::Disk, 9));
        l.observe(&registered(5, 5_000_000_001, Tier::Host, 9));
        l.observe(&evicted(6, 5_000_000_000, Tier::Device, 10));
        l.observe(&registered(7, 5_000_000_001, Tier::Device, 10));
        assert_eq!(l.thrash(), 1);
        assert_eq!(l.recent().len(), 1);
        assert_eq!(l.recent()[0].kind, LintKind::Thrash);
    }

    #[test]
    fn destination_full_skips_are_counted_others_not() {
        let mut l = Lints::new(LintConfig::default());
        for (i, reason) in ["destination_full", "already_present", "destination_full"]
            .iter()
            .enumerate()
        {
            l.observe(&ev(
                i as u64,
                0,
                EventKind::TransferSkipped {
                    transfer: i as u64,
                    direction: Direction::DEVICE_TO_HOST,
                    reason: reason.to_string(),
                },
            ));
        }
        assert_eq!(l.destination_full(), 2);
    }

    #[test]
    fn bounds_hold_and_count_what_they_drop() {
        let mut l = Lints::new(LintConfig {
            recent: 2,
            tracked_evictions: 3,
            ..LintConfig::default()
        });
        for h in 0..5 {
            l.observe(&evicted(h, 0, Tier::Host, h));
        }
        assert_eq!(l.tracking_dropped(), 2);
        for h in 0..5 {
            l.observe(&registered(10 + h, 1, Tier::Host, h));
        }
        assert_eq!(l.thrash(), 3, "the two forgotten evictions are not seen");
        assert_eq!(l.recent().len(), 2);
        assert_eq!(l.recent_dropped(), 1);
    }
}
