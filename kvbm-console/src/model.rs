//! The console's model: everything the views draw that comes from the
//! engine, built only from events.
//!
//! One [`Model`] is fed the same way live and in replay (principle 3: what
//! you see live is what you see in replay). It holds the shared reducer
//! (inside the recorder's [`StatsCollector`], which also keeps the
//! histograms), a bounded event history, per-second samples for rates and
//! sparklines, and the lints. Time is the engine's: the timestamp of the
//! newest event, never the wall clock, so a replay draws the same figures
//! as the live run did.

use crate::lints::{LintConfig, Lints};
use kvbm_events::reducer::EngineState;
use kvbm_events::tier::Tier;
use kvbm_events::{Event, EventKind};
use kvbm_recorder::analysis::capacity::{CapacityAnalyzer, CapacityConfig};
use kvbm_recorder::analysis::stats::{StatsCollector, StatsConfig};
use std::collections::VecDeque;
use std::sync::Arc;

const NS_PER_S: u64 = 1_000_000_000;

/// How much the model keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelConfig {
    /// Events kept for the event log (live; a replay keeps the whole file).
    pub history: usize,
    /// How long a finished slot stays on screen, engine ns.
    pub keep_finished_ns: u64,
    /// Per-second samples kept for sparklines.
    pub samples: usize,
    /// Lint thresholds.
    pub lints: LintConfig,
    /// Distinct blocks the capacity analysis holds exactly; past it the
    /// curve is sampled (the view says at what rate) and miss reasons
    /// stop following new blocks (counted on screen).
    pub capacity_blocks: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            history: 1_000_000,
            keep_finished_ns: 30 * NS_PER_S,
            samples: 120,
            lints: LintConfig::default(),
            capacity_blocks: 1 << 20,
        }
    }
}

/// The event log: owned and bounded live, a prefix of the file in replay.
#[derive(Debug, Clone)]
pub enum History {
    /// Live: the newest `cap` events; older ones are counted in `dropped`.
    Owned {
        /// The events, oldest first.
        events: VecDeque<Event>,
        /// Most kept.
        cap: usize,
        /// Pushed out by newer ones.
        dropped: u64,
    },
    /// Replay: the first `len` events of the file.
    Shared {
        /// The whole file.
        events: Arc<[Event]>,
        /// Events applied so far.
        len: usize,
    },
}

impl History {
    /// Events held.
    pub fn len(&self) -> usize {
        match self {
            History::Owned { events, .. } => events.len(),
            History::Shared { len, .. } => *len,
        }
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `i`-th held event, oldest first.
    pub fn get(&self, i: usize) -> Option<&Event> {
        match self {
            History::Owned { events, .. } => events.get(i),
            History::Shared { events, len } => events[..*len].get(i),
        }
    }

    /// Events pushed out of the bound (always 0 in replay).
    pub fn dropped(&self) -> u64 {
        match self {
            History::Owned { dropped, .. } => *dropped,
            History::Shared { .. } => 0,
        }
    }

    /// Held events, newest first.
    pub fn iter_rev(&self) -> Box<dyn Iterator<Item = &Event> + '_> {
        match self {
            History::Owned { events, .. } => Box::new(events.iter().rev()),
            History::Shared { events, len } => Box::new(events[..*len].iter().rev()),
        }
    }
}

/// What happened in one second of engine time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sample {
    /// The second (engine time / 1 s).
    pub second: u64,
    /// Events.
    pub events: u64,
    /// Evictions per tier.
    pub evictions: [u64; 3],
    /// Active blocks per tier at the last gauge of the second.
    pub active: [u32; 3],
    /// Blocks offloaded (completed transfers to a slower tier).
    pub offloaded_blocks: u64,
    /// Blocks onboarded.
    pub onboarded_blocks: u64,
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct Model {
    cfg: ModelConfig,
    stats: StatsCollector,
    history: History,
    current: Sample,
    samples: VecDeque<Sample>,
    lints: Lints,
    capacity: CapacityAnalyzer,
    now_ns: u64,
    last_prune_s: u64,
    applied: u64,
}

impl Model {
    /// An empty model keeping what `cfg` says.
    pub fn new(cfg: ModelConfig) -> Self {
        Model {
            cfg,
            // The default bounds are valid, so this cannot fail.
            stats: StatsCollector::new(StatsConfig::default())
                .expect("default stats bounds are valid"),
            history: History::Owned {
                events: VecDeque::new(),
                cap: cfg.history.max(1),
                dropped: 0,
            },
            current: Sample::default(),
            samples: VecDeque::with_capacity(cfg.samples),
            lints: Lints::new(cfg.lints),
            capacity: CapacityAnalyzer::new(CapacityConfig::bounded(cfg.capacity_blocks.max(1))),
            now_ns: 0,
            last_prune_s: 0,
            applied: 0,
        }
    }

    /// Applies a live event and keeps it in the bounded history.
    pub fn apply(&mut self, ev: Event) {
        self.observe(&ev);
        if let History::Owned {
            events,
            cap,
            dropped,
        } = &mut self.history
        {
            if events.len() >= *cap {
                events.pop_front();
                *dropped += 1;
            }
            events.push_back(ev);
        }
    }

    /// Applies `events[i]` of a replayed file; the history becomes the
    /// file's first `i + 1` events. Call with `i` = 0, 1, 2, ... in order.
    pub fn apply_at(&mut self, events: &Arc<[Event]>, i: usize) {
        let Some(ev) = events.get(i) else { return };
        self.observe(ev);
        self.history = History::Shared {
            events: events.clone(),
            len: i + 1,
        };
    }

    fn observe(&mut self, ev: &Event) {
        self.applied += 1;
        self.stats.observe(ev);
        self.now_ns = self.now_ns.max(ev.ts_ns);
        self.sample(ev);
        self.lints.observe(ev);
        self.capacity.observe(ev);
        // Prune once per engine second: finished slots leave the screen
        // after `keep_finished_ns`, at the same points live and in replay.
        let second = self.now_ns / NS_PER_S;
        if second != self.last_prune_s {
            self.last_prune_s = second;
            let cutoff = self.now_ns.saturating_sub(self.cfg.keep_finished_ns);
            if cutoff > 0 {
                self.stats.prune_finished_before(cutoff);
            }
        }
    }

    fn sample(&mut self, ev: &Event) {
        let second = ev.ts_ns / NS_PER_S;
        if second > self.current.second {
            // Close the current second and any empty ones after it (at most
            // a window's worth: a long idle gap shows as zeros, not as a
            // million pushes).
            let active = self.current.active;
            let gap = (second - self.current.second).min(self.cfg.samples as u64 + 1);
            for k in 0..gap {
                let s = if k == 0 {
                    self.current
                } else {
                    Sample {
                        second: self.current.second + k,
                        active,
                        ..Sample::default()
                    }
                };
                if self.samples.len() >= self.cfg.samples.max(1) {
                    self.samples.pop_front();
                }
                self.samples.push_back(s);
            }
            self.current = Sample {
                second,
                active,
                ..Sample::default()
            };
        }
        self.current.events += 1;
        match &ev.kind {
            EventKind::BlockEvicted { tier, .. } => self.current.evictions[tier.index()] += 1,
            EventKind::PoolGauge { tier, active, .. } => {
                self.current.active[tier.index()] = *active;
            }
            EventKind::TransferCompleted {
                direction, blocks, ..
            } => {
                if direction.is_onboard() {
                    self.current.onboarded_blocks += u64::from(*blocks);
                } else {
                    self.current.offloaded_blocks += u64::from(*blocks);
                }
            }
            _ => {}
        }
    }

    /// The reducer's state.
    pub fn state(&self) -> &EngineState {
        self.stats.state()
    }

    /// The histograms (and the reducer inside them).
    pub fn stats(&self) -> &StatsCollector {
        &self.stats
    }

    /// The event log.
    pub fn history(&self) -> &History {
        &self.history
    }

    /// Engine time: the newest event's timestamp.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// Events applied.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// Closed seconds, oldest first.
    pub fn samples(&self) -> &VecDeque<Sample> {
        &self.samples
    }

    /// The last closed second, if any.
    pub fn last_second(&self) -> Option<&Sample> {
        self.samples.back()
    }

    /// Events per second of engine time (the last closed second).
    pub fn events_per_s(&self) -> u64 {
        self.last_second().map_or(0, |s| s.events)
    }

    /// Evictions per second on `tier` (the last closed second).
    pub fn evictions_per_s(&self, tier: Tier) -> u64 {
        self.last_second().map_or(0, |s| s.evictions[tier.index()])
    }

    /// The lints.
    pub fn lints(&self) -> &Lints {
        &self.lints
    }

    /// The capacity what-if and the miss reasons.
    pub fn capacity(&self) -> &CapacityAnalyzer {
        &self.capacity
    }

    /// The settings.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::reducer::fold;
    use kvbm_events::slot::SlotState;
    use kvbm_events::{Direction, RequestId};

    pub(crate) fn ev(seq: u64, ts_ns: u64, request: Option<&str>, kind: EventKind) -> Event {
        Event {
            engine: 0,
            seq,
            ts_ns,
            iteration: 0,
            request: request.map(RequestId::from),
            kind,
        }
    }

    fn gauge() -> EventKind {
        EventKind::PoolGauge {
            tier: Tier::Device,
            capacity: 10,
            active: 1,
            inactive: 0,
            empty: 9,
        }
    }

    fn life(seq0: u64, t0: u64, id: &str) -> Vec<Event> {
        let r = Some(id);
        vec![
            ev(
                seq0,
                t0,
                r,
                EventKind::SlotCreated {
                    prompt_tokens: 32,
                    max_output_tokens: 4,
                },
            ),
            ev(
                seq0 + 1,
                t0 + 10,
                r,
                EventKind::SlotTransition {
                    from: SlotState::Initialized,
                    to: SlotState::Prefilling,
                },
            ),
            ev(
                seq0 + 2,
                t0 + 20,
                r,
                EventKind::SlotTransition {
                    from: SlotState::Prefilling,
                    to: SlotState::Finishing,
                },
            ),
            ev(
                seq0 + 3,
                t0 + 30,
                r,
                EventKind::SlotTransition {
                    from: SlotState::Finishing,
                    to: SlotState::Finished,
                },
            ),
        ]
    }

    #[test]
    fn live_and_replay_feeding_give_the_same_state() {
        let mut events = life(0, 0, "a");
        events.extend(life(4, 2 * NS_PER_S, "b"));
        events.push(ev(
            8,
            3 * NS_PER_S,
            None,
            EventKind::TransferCompleted {
                transfer: 1,
                direction: Direction::DEVICE_TO_HOST,
                blocks: 3,
            },
        ));
        let shared: Arc<[Event]> = events.clone().into();
        let mut live = Model::new(ModelConfig::default());
        let mut replay = Model::new(ModelConfig::default());
        for (i, e) in events.iter().enumerate() {
            live.apply(e.clone());
            replay.apply_at(&shared, i);
        }
        assert_eq!(live.state(), replay.state());
        assert_eq!(live.state(), &fold(&events));
        assert_eq!(live.history().len(), replay.history().len());
        assert_eq!(live.samples(), replay.samples());
        // Seconds 0, 1 (empty) and 2 are closed; 3 is open.
        let s: Vec<u64> = live.samples().iter().map(|s| s.events).collect();
        assert_eq!(s, vec![4, 0, 4]);
    }

    #[test]
    fn history_is_bounded_and_counts_what_it_drops() {
        let mut m = Model::new(ModelConfig {
            history: 3,
            ..ModelConfig::default()
        });
        for e in life(0, 0, "a") {
            m.apply(e);
        }
        assert_eq!(m.history().len(), 3);
        assert_eq!(m.history().dropped(), 1);
        assert_eq!(m.history().iter_rev().next().unwrap().seq, 3);
        assert_eq!(m.history().get(0).unwrap().seq, 1);
    }

    #[test]
    fn finished_slots_leave_after_the_keep_time() {
        let mut m = Model::new(ModelConfig {
            keep_finished_ns: 5 * NS_PER_S,
            ..ModelConfig::default()
        });
        for e in life(0, 0, "a") {
            m.apply(e);
        }
        assert!(m.state().slot("a").is_some());
        m.apply(ev(4, 3 * NS_PER_S, None, gauge()));
        assert!(m.state().slot("a").is_some(), "kept within 5 s");
        m.apply(ev(5, 6 * NS_PER_S, None, gauge()));
        assert!(m.state().slot("a").is_none(), "gone after 5 s");
    }

    #[test]
    fn a_long_idle_gap_adds_a_bounded_number_of_samples() {
        let mut m = Model::new(ModelConfig {
            samples: 10,
            ..ModelConfig::default()
        });
        m.apply(ev(0, 0, None, gauge()));
        m.apply(ev(1, 1_000_000 * NS_PER_S, None, gauge()));
        assert_eq!(m.samples().len(), 10);
        assert_eq!(m.events_per_s(), 0);
    }
}
