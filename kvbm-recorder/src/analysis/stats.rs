//! Statistics over a stream: how long requests spend in each slot state,
//! time to first token, transfer latency per direction, and batch sizes —
//! as percentiles from `hdrhistogram` histograms, for `kvbm-recorder stats`
//! (text, or `--json` through serde) and for the golden statistics CI checks
//! on recorded replays.
//!
//! Every series is a [`Series`]: a histogram with an explicit upper bound
//! (one hour in nanoseconds by default, 3 significant figures), so memory is
//! fixed however long the stream. A value above the bound is not an error:
//! it is recorded at the bound (so counts and percentile ranks stay right)
//! and counted in [`Percentiles::outliers`], while `max` and `mean` come from
//! exact running values and include it.
//!
//! The series are fed by a [`TimelineBuilder`]:
//!
//! - *time in state*: each closed [`StateInterval`](super::StateInterval),
//!   by [`SlotState::name`](kvbm_events::slot::SlotState::name). An interval
//!   still open when the stream ends is left out — it has not ended, and
//!   counting the part seen would bias every state toward short times.
//! - *TTFT*: the reducer's `first_token_ns − created_ns` (the first
//!   `TokensScheduled` with `decode > 0` after `SlotCreated`).
//! - *transfer latency*: `TransferPlanned` → `TransferCompleted`, per
//!   direction; other outcomes are counted in [`TransferOutcomes`] only.
//! - *batch sizes*: `BatchDispatched.blocks`, per direction and overall.

use super::timeline::{TimelineBuilder, TimelineItem};
use kvbm_events::reducer::{EngineState, TransferState};
use kvbm_events::slot::SlotState;
use kvbm_events::{Event, EventKind};
use serde::{Deserialize, Serialize};
use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt;

/// Default bound of the duration histograms: one hour, in nanoseconds.
pub const DEFAULT_MAX_DURATION_NS: u64 = 3_600 * 1_000_000_000;
/// Default bound of the batch-size histograms, in blocks.
pub const DEFAULT_MAX_BATCH_BLOCKS: u64 = 1 << 20;
/// Significant figures kept by every histogram.
pub const SIGNIFICANT_FIGURES: u8 = 3;

/// A refused statistics configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StatsError {
    /// A histogram bound is below 2 (hdrhistogram needs `high >= 2 * low`,
    /// with the lowest discernible value 1).
    #[error("histogram bound `{field}` must be at least 2, got {got}")]
    BadBound {
        /// Which bound.
        field: &'static str,
        /// What was given.
        got: u64,
    },
    /// hdrhistogram refused the bounds.
    #[error("cannot build a histogram up to {high}: {reason}")]
    Histogram {
        /// The bound.
        high: u64,
        /// hdrhistogram's reason.
        reason: String,
    },
}

/// Bounds of the histograms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsConfig {
    /// Largest duration tracked exactly (ns); longer ones are outliers.
    pub max_duration_ns: u64,
    /// Largest batch tracked exactly (blocks).
    pub max_batch_blocks: u64,
}

impl Default for StatsConfig {
    fn default() -> Self {
        StatsConfig {
            max_duration_ns: DEFAULT_MAX_DURATION_NS,
            max_batch_blocks: DEFAULT_MAX_BATCH_BLOCKS,
        }
    }
}

/// A summary of one series. All values are in the series' unit
/// (nanoseconds or blocks); all zero when `count == 0`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Values recorded.
    pub count: u64,
    /// Mean, rounded to 3 decimals (outliers included at their true
    /// value).
    pub mean: f64,
    /// Median (to 3 significant figures).
    pub p50: u64,
    /// 90th percentile.
    pub p90: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Exact largest value.
    pub max: u64,
    /// Values above the histogram's bound (recorded at the bound).
    pub outliers: u64,
}

/// One bounded histogram with exact count, sum and max beside it.
#[derive(Debug, Clone)]
pub struct Series {
    hist: hdrhistogram::Histogram<u64>,
    high: u64,
    outliers: u64,
    sum: u128,
    max: u64,
}

impl Series {
    /// A series tracking values up to `high` (at least 2).
    pub fn new(high: u64) -> Result<Self, StatsError> {
        if high < 2 {
            return Err(StatsError::BadBound {
                field: "high",
                got: high,
            });
        }
        let hist = hdrhistogram::Histogram::new_with_bounds(1, high, SIGNIFICANT_FIGURES).map_err(
            |e| StatsError::Histogram {
                high,
                reason: format!("{e:?}"),
            },
        )?;
        Ok(Series {
            hist,
            high,
            outliers: 0,
            sum: 0,
            max: 0,
        })
    }

    /// Records one value; above the bound it is recorded at the bound and
    /// counted as an outlier.
    pub fn record(&mut self, value: u64) {
        if value > self.high {
            self.outliers += 1;
        }
        // Clamps into range, so it cannot fail.
        self.hist.saturating_record(value);
        self.sum += u128::from(value);
        self.max = self.max.max(value);
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// Where [`log_buckets`](Self::log_buckets) starts: the smallest value
    /// recorded (to the histogram's precision, at least 1); `None` when
    /// nothing was.
    pub fn low(&self) -> Option<u64> {
        (!self.hist.is_empty()).then(|| self.hist.min().max(1))
    }

    /// The distribution in `n` buckets spaced evenly on a log scale from
    /// the smallest to the largest value recorded: `(upper bound, count)`
    /// pairs, for a small histogram on screen. Empty when nothing was
    /// recorded or `n == 0`.
    pub fn log_buckets(&self, n: usize) -> Vec<(u64, u64)> {
        if self.hist.is_empty() || n == 0 {
            return Vec::new();
        }
        let lo = self.hist.min().max(1);
        let hi = self.max.clamp(lo, self.high);
        let ratio = (hi as f64 / lo as f64).powf(1.0 / n as f64);
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(n);
        let mut prev = 0u64;
        for i in 1..=n {
            let upper = if i == n {
                hi
            } else {
                ((lo as f64 * ratio.powi(i as i32)) as u64)
                    .max(prev + 1)
                    .min(hi)
            };
            prev = prev.max(upper);
            out.push((upper, 0));
        }
        // Each recorded bucket of the histogram goes to the first bucket
        // whose upper bound reaches it, so every value counts exactly once.
        for v in self.hist.iter_recorded() {
            let value = v.value_iterated_to().min(hi);
            let i = out.partition_point(|(upper, _)| *upper < value).min(n - 1);
            out[i].1 += v.count_at_value();
        }
        out
    }

    /// The summary.
    pub fn percentiles(&self) -> Percentiles {
        let count = self.hist.len();
        if count == 0 {
            return Percentiles::default();
        }
        // A quantile is reported as the highest value equivalent to its
        // bucket; never report more than the exact maximum.
        let q = |p: f64| self.hist.value_at_quantile(p).min(self.max);
        Percentiles {
            count,
            mean: (self.sum as f64 / count as f64 * 1e3).round() / 1e3,
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
            max: self.max,
            outliers: self.outliers,
        }
    }
}

/// How transfers of one direction ended (open ones: still in flight when
/// the stream ended).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferOutcomes {
    /// Completed.
    pub completed: u64,
    /// Skipped.
    pub skipped: u64,
    /// Cancelled.
    pub cancelled: u64,
    /// Failed.
    pub failed: u64,
    /// Still in flight at the end.
    pub in_flight: u64,
}

/// The statistics of a stream; see the module docs. Durations are in ns,
/// maps are keyed by slot state name and by direction (`G1→G2`, as the
/// simulator's report does).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Events read.
    pub events: u64,
    /// Events the reducer skipped (stale duplicates, another engine).
    pub skipped_events: u64,
    /// Requests seen (distinct ids).
    pub requests: u64,
    /// Slots that reached `Finished`.
    pub finished: u64,
    /// Earliest and latest timestamps, ns.
    pub time_range_ns: Option<(u64, u64)>,
    /// Time to first token.
    pub ttft_ns: Percentiles,
    /// Time spent in each state, per interval.
    pub time_in_state_ns: BTreeMap<String, Percentiles>,
    /// Planned → completed, per direction.
    pub transfer_latency_ns: BTreeMap<String, Percentiles>,
    /// How transfers ended, per direction.
    pub transfers: BTreeMap<String, TransferOutcomes>,
    /// Blocks per dispatched batch, per direction.
    pub batch_blocks: BTreeMap<String, Percentiles>,
    /// Blocks per dispatched batch, all directions.
    pub batch_blocks_all: Percentiles,
}

/// Collects [`Stats`] from a stream, one event at a time.
#[derive(Debug, Clone)]
pub struct StatsCollector {
    config: StatsConfig,
    timeline: TimelineBuilder,
    ttft: Series,
    states: BTreeMap<&'static str, Series>,
    latency: BTreeMap<String, Series>,
    outcomes: BTreeMap<String, TransferOutcomes>,
    batches: BTreeMap<String, Series>,
    batches_all: Series,
    requests: u64,
    finished: u64,
}

impl StatsCollector {
    /// A collector with these bounds.
    pub fn new(config: StatsConfig) -> Result<Self, StatsError> {
        for (field, got) in [
            ("max_duration_ns", config.max_duration_ns),
            ("max_batch_blocks", config.max_batch_blocks),
        ] {
            if got < 2 {
                return Err(StatsError::BadBound { field, got });
            }
        }
        Ok(StatsCollector {
            config,
            timeline: TimelineBuilder::new(),
            ttft: Series::new(config.max_duration_ns)?,
            states: BTreeMap::new(),
            latency: BTreeMap::new(),
            outcomes: BTreeMap::new(),
            batches: BTreeMap::new(),
            batches_all: Series::new(config.max_batch_blocks)?,
            requests: 0,
            finished: 0,
        })
    }

    fn series<K: Ord>(map: &mut BTreeMap<K, Series>, key: K, high: u64) -> Option<&mut Series> {
        use std::collections::btree_map::Entry;
        match map.entry(key) {
            Entry::Occupied(e) => Some(e.into_mut()),
            // `high` was validated in `new`, so this cannot fail; if it did,
            // the value is dropped rather than the run.
            Entry::Vacant(v) => Series::new(high).ok().map(|s| v.insert(s)),
        }
    }

    /// The reducer's state after the events observed so far.
    pub fn state(&self) -> &EngineState {
        self.timeline.state()
    }

    /// Forgets slots that finished before `cutoff_ns`; see
    /// [`TimelineBuilder::prune_finished_before`].
    pub fn prune_finished_before(&mut self, cutoff_ns: u64) -> usize {
        self.timeline.prune_finished_before(cutoff_ns)
    }

    /// Events observed so far.
    pub fn events(&self) -> u64 {
        self.timeline.events()
    }

    /// Distinct requests seen so far.
    pub fn requests(&self) -> u64 {
        self.requests
    }

    /// Slots that reached `Finished` so far.
    pub fn finished(&self) -> u64 {
        self.finished
    }

    /// Time to first token, so far.
    pub fn ttft(&self) -> &Series {
        &self.ttft
    }

    /// Closed intervals per slot state name, so far.
    pub fn time_in_state(&self) -> impl Iterator<Item = (&'static str, &Series)> {
        self.states.iter().map(|(k, s)| (*k, s))
    }

    /// Planned → completed latency per direction (`G1→G2`), so far.
    pub fn transfer_latency(&self) -> impl Iterator<Item = (&str, &Series)> {
        self.latency.iter().map(|(k, s)| (k.as_str(), s))
    }

    /// How transfers ended per direction, so far.
    pub fn outcomes(&self) -> &BTreeMap<String, TransferOutcomes> {
        &self.outcomes
    }

    /// Takes one event.
    pub fn observe(&mut self, ev: &Event) {
        let is_finished = |c: &Self| {
            ev.request
                .as_ref()
                .and_then(|r| c.timeline.state().slot(r))
                .is_some_and(|s| s.is_finished())
        };
        let was_finished = is_finished(self);
        let StatsCollector {
            config,
            timeline,
            ttft,
            states,
            latency,
            outcomes,
            requests,
            ..
        } = self;
        let accepted = timeline.observe(ev, |item| {
            Self::take(item, config, ttft, states, latency, outcomes, requests)
        });
        if !accepted {
            return;
        }
        match &ev.kind {
            EventKind::BatchDispatched {
                direction, blocks, ..
            } => {
                let b = u64::from(*blocks);
                self.batches_all.record(b);
                let high = self.config.max_batch_blocks;
                if let Some(s) = Self::series(&mut self.batches, direction.to_string(), high) {
                    s.record(b);
                }
            }
            // Judged by the reducer's slot, so a re-announced `Finished`
            // does not count twice.
            EventKind::SlotTransition { .. } if !was_finished && is_finished(self) => {
                self.finished += 1;
            }
            _ => {}
        }
    }

    fn take(
        item: TimelineItem,
        config: &StatsConfig,
        ttft: &mut Series,
        states: &mut BTreeMap<&'static str, Series>,
        latency: &mut BTreeMap<String, Series>,
        outcomes: &mut BTreeMap<String, TransferOutcomes>,
        requests: &mut u64,
    ) {
        match item {
            TimelineItem::Track { .. } => *requests += 1,
            TimelineItem::Interval(i) if !i.open => {
                if let Some(s) = Self::series(states, i.state.name(), config.max_duration_ns) {
                    s.record(i.duration_ns());
                }
            }
            TimelineItem::FirstToken { ttft_ns, .. } => ttft.record(ttft_ns),
            TimelineItem::Transfer(t) => {
                let key = t.direction.to_string();
                let o = outcomes.entry(key.clone()).or_default();
                match &t.status {
                    TransferState::Completed => {
                        o.completed += 1;
                        if let Some(s) = Self::series(latency, key, config.max_duration_ns) {
                            s.record(t.duration_ns());
                        }
                    }
                    TransferState::Skipped(_) => o.skipped += 1,
                    TransferState::Cancelled => o.cancelled += 1,
                    TransferState::Failed(_) => o.failed += 1,
                    TransferState::PendingEvaluation | TransferState::Promoted => o.in_flight += 1,
                }
            }
            TimelineItem::Interval(_) | TimelineItem::Breakpoint(_) => {}
        }
    }

    /// Ends the stream and summarises.
    pub fn finish(self) -> Stats {
        let StatsCollector {
            config,
            timeline,
            mut ttft,
            mut states,
            mut latency,
            mut outcomes,
            batches,
            batches_all,
            mut requests,
            finished,
        } = self;
        let events = timeline.events();
        let time_range_ns = timeline.time_range();
        let state = timeline.finish(|item| {
            Self::take(
                item,
                &config,
                &mut ttft,
                &mut states,
                &mut latency,
                &mut outcomes,
                &mut requests,
            )
        });
        let summarise = |m: BTreeMap<String, Series>| {
            m.into_iter()
                .map(|(k, s)| (k, s.percentiles()))
                .collect::<BTreeMap<_, _>>()
        };
        Stats {
            events,
            skipped_events: events.saturating_sub(state.stream().events),
            requests,
            finished,
            time_range_ns,
            ttft_ns: ttft.percentiles(),
            time_in_state_ns: states
                .into_iter()
                .map(|(k, s)| (k.to_string(), s.percentiles()))
                .collect(),
            transfer_latency_ns: summarise(latency),
            transfers: outcomes,
            batch_blocks: summarise(batches),
            batch_blocks_all: batches_all.percentiles(),
        }
    }
}

/// The statistics of a whole stream (owned or borrowed events).
pub fn stats<E: Borrow<Event>>(
    events: impl IntoIterator<Item = E>,
    config: StatsConfig,
) -> Result<Stats, StatsError> {
    let mut c = StatsCollector::new(config)?;
    for e in events {
        c.observe(e.borrow());
    }
    Ok(c.finish())
}

/// Formats nanoseconds with a readable unit.
pub(crate) fn fmt_ns(ns: u64) -> String {
    let v = ns as f64;
    if ns < 1_000 {
        format!("{ns} ns")
    } else if ns < 1_000_000 {
        format!("{:.1} µs", v / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.2} ms", v / 1e6)
    } else {
        format!("{:.3} s", v / 1e9)
    }
}

fn fmt_row(
    f: &mut fmt::Formatter<'_>,
    name: &str,
    p: &Percentiles,
    unit: fn(u64) -> String,
) -> fmt::Result {
    let mean = if p.mean.is_finite() && p.mean >= 0.0 {
        unit(p.mean.round() as u64)
    } else {
        "-".into()
    };
    write!(
        f,
        "  {name:<28} {:>8} {:>11} {:>11} {:>11} {:>11} {:>11}",
        p.count,
        mean,
        unit(p.p50),
        unit(p.p90),
        unit(p.p99),
        unit(p.max)
    )?;
    if p.outliers > 0 {
        write!(f, "  ({} above the histogram bound)", p.outliers)?;
    }
    writeln!(f)
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} events, {} requests ({} finished)",
            self.events, self.requests, self.finished
        )?;
        if let Some((a, b)) = self.time_range_ns {
            write!(f, ", {} of engine time", fmt_ns(b.saturating_sub(a)))?;
        }
        if self.skipped_events > 0 {
            write!(f, ", {} events skipped by the reducer", self.skipped_events)?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "  {:<28} {:>8} {:>11} {:>11} {:>11} {:>11} {:>11}",
            "series", "count", "mean", "p50", "p90", "p99", "max"
        )?;
        fmt_row(f, "time to first token", &self.ttft_ns, fmt_ns)?;
        // Lifecycle order rather than alphabetical.
        for name in SlotState::NAMES {
            if let Some(p) = self.time_in_state_ns.get(name) {
                fmt_row(f, &format!("in {name}"), p, fmt_ns)?;
            }
        }
        for (d, p) in &self.transfer_latency_ns {
            fmt_row(f, &format!("transfer {d} latency"), p, fmt_ns)?;
        }
        let blocks = |b: u64| format!("{b} blk");
        for (d, p) in &self.batch_blocks {
            fmt_row(f, &format!("batch {d} size"), p, blocks)?;
        }
        if self.batch_blocks.len() > 1 {
            fmt_row(f, "batch size (all)", &self.batch_blocks_all, blocks)?;
        }
        for (d, o) in &self.transfers {
            writeln!(
                f,
                "  transfers {d}: {} completed, {} skipped, {} cancelled, {} failed, {} in flight",
                o.completed, o.skipped, o.cancelled, o.failed, o.in_flight
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testutil::{Stream, arb_events};
    use kvbm_events::Direction;
    use proptest::prelude::*;

    #[test]
    fn series_percentiles_and_outliers() {
        let mut s = Series::new(1_000).unwrap();
        assert_eq!(s.percentiles(), Percentiles::default());
        for v in 1..=100 {
            s.record(v);
        }
        s.record(0);
        s.record(5_000); // above the bound
        let p = s.percentiles();
        assert_eq!(p.count, 102);
        assert_eq!(p.outliers, 1);
        assert_eq!(p.max, 5_000);
        assert_eq!(p.p50, 50);
        assert_eq!(p.p90, 91); // the 92nd of 102 values (0 included)
        assert_eq!(p.mean, 98.529); // (5050 + 5000) / 102, to 3 decimals
        // The outlier sits at the bound in the histogram.
        assert!(p.p99 >= 100);
        assert!(Series::new(1).is_err());
        assert!(
            StatsCollector::new(StatsConfig {
                max_duration_ns: 0,
                ..StatsConfig::default()
            })
            .is_err()
        );
    }

    #[test]
    fn log_buckets_cover_every_value_once() {
        let mut s = Series::new(1 << 40).unwrap();
        assert!(s.log_buckets(8).is_empty());
        let values = [1u64, 2, 3, 10, 100, 1_000, 10_000, 10_000, 123_456];
        for v in values {
            s.record(v);
        }
        let b = s.log_buckets(6);
        assert_eq!(b.len(), 6);
        assert_eq!(b.iter().map(|(_, c)| c).sum::<u64>(), values.len() as u64);
        assert!(b.windows(2).all(|w| w[0].0 < w[1].0), "{b:?}");
        assert!(b.last().unwrap().0 >= 123_456);
        // A single value lands in one bucket, whatever n is.
        let mut one = Series::new(1000).unwrap();
        one.record(7);
        let b = one.log_buckets(5);
        assert_eq!(b.iter().map(|(_, c)| c).sum::<u64>(), 1);
    }

    #[test]
    fn stats_of_a_small_stream() {
        let mut s = Stream::new();
        s.at(1_000).life("a", 1);
        s.at(2_000).life("b", 2);
        // An extra batch of 6 blocks the other way.
        s.at(3_000)
            .batch(99, Direction::HOST_TO_DEVICE, &[], 6)
            .create("c", 8);
        let st = stats(s.events(), StatsConfig::default()).unwrap();
        assert_eq!((st.requests, st.finished), (3, 2));
        // Created at t, first token at t + 40.
        assert_eq!(st.ttft_ns.count, 2);
        assert_eq!((st.ttft_ns.p50, st.ttft_ns.max), (40, 40));
        let pre = st.time_in_state_ns["Prefilling"];
        assert_eq!((pre.count, pre.p50), (2, 25));
        // c's Initialized is still open: not counted.
        assert_eq!(st.time_in_state_ns["Initialized"].count, 2);
        let lat = st.transfer_latency_ns["G1→G2"];
        assert_eq!((lat.count, lat.p50), (2, 30));
        assert_eq!(st.transfers["G1→G2"].completed, 2);
        assert_eq!(st.batch_blocks["G1→G2"].p50, 2);
        assert_eq!(st.batch_blocks["G2→G1"].max, 6);
        assert_eq!(st.batch_blocks_all.count, 3);
        assert_eq!(st.time_range_ns, Some((1_000, 3_000)));
        // Serialises for `stats --json` and reads back (floats to within
        // serde_json's parsing precision).
        let json = serde_json::to_string(&st).unwrap();
        let back: Stats = serde_json::from_str(&json).unwrap();
        assert_eq!(back.transfers, st.transfers);
        assert_eq!(back.ttft_ns.p50, st.ttft_ns.p50);
        assert!((back.ttft_ns.mean - st.ttft_ns.mean).abs() < 1e-6);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["time_in_state_ns"]["Prefilling"]["p50"], 25);
        assert_eq!(v["transfer_latency_ns"]["G1→G2"]["count"], 2);
        let text = st.to_string();
        assert!(text.contains("time to first token"), "{text}");
        assert!(text.contains("in Prefilling"), "{text}");
        assert!(text.contains("transfer G1→G2 latency"), "{text}");
    }

    #[test]
    fn stale_and_reannounced_events_do_not_count_twice() {
        let mut s = Stream::new();
        s.at(0).life("a", 1);
        let fin = s.events().last().unwrap().clone();
        s.raw(fin); // duplicate delivery of Finished
        let batch = s.events()[8].clone();
        assert_eq!(batch.kind.name(), "BatchDispatched");
        s.raw(batch); // duplicate batch: stale
        let st = stats(s.events(), StatsConfig::default()).unwrap();
        assert_eq!(st.finished, 1);
        assert_eq!(st.batch_blocks_all.count, 1);
        assert_eq!(st.skipped_events, 2);
    }

    proptest! {
        #[test]
        fn never_panics_on_arbitrary_streams(events in arb_events(60)) {
            let st = stats(&events, StatsConfig { max_duration_ns: 2, max_batch_blocks: 2 }).unwrap();
            prop_assert!(st.ttft_ns.p50 <= st.ttft_ns.max);
            let _ = st.to_string();
            prop_assert!(serde_json::to_string(&st).is_ok());
        }
    }
}
