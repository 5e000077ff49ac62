//! Everything that reads a recorded event stream back: replay, timelines,
//! statistics, the invariant checker, exports and the diff.
//!
//! All of it works on plain [`kvbm_events::Event`] values, whatever
//! they were read from (the durable log, the ring buffer, a JSON lines
//! file), and all of it goes through the same reducer the live path uses
//! ([`kvbm_events::reducer::EngineState`]): a request's state, a transfer's
//! status, whether an event is a stale duplicate — each is decided in one
//! place, so a replay shows what the console showed live and the checker
//! judges the same stream the console drew.
//!
//! Each analysis is a streaming consumer with `observe(&Event)` and
//! `finish()`, plus a one-call helper over any iterator of events (owned or
//! borrowed), so a CLI can feed a log through several of them in one pass
//! without holding it in memory:
//!
//! | module | for | one-call helper |
//! |---|---|---|
//! | [`replay`] | stepping or pacing through a stream, seeking | [`replay::Replayer`] |
//! | [`timeline`] | per-request state intervals, transfer spans | [`timeline::Timeline::from_events`] |
//! | [`stats`](mod@stats) | histograms of state times, TTFT, transfer latency, batch sizes | [`stats::stats`] |
//! | [`check`](mod@check) | the invariants CI asserts on a replay | [`check::check`] |
//! | [`export`] | JSON lines, Chrome trace JSON (Perfetto) | [`export::write_jsonl`], [`export::write_chrome_trace`] |
//! | [`mooncake`] | the requests as a Mooncake trace, for the simulator | [`mooncake::trace_of`] |
//! | [`compare`] | two recordings' figures side by side, and CI gates on them | [`compare::Summary::from_events`], [`compare::evaluate`] |
//! | [`diff`](mod@diff) | the first divergence between two streams | [`diff::diff`] |
//! | [`capacity`] | hit ratio at every cache size, miss reasons | [`capacity::CapacityAnalyzer::from_events`] |
//!
//! None of them panics on any input: a malformed stream (events out of
//! order, unknown requests, transfers that never started) is reported or
//! counted, never fatal.

pub mod capacity;
pub mod check;
pub mod compare;
pub mod diff;
pub mod export;
pub mod mooncake;
pub mod replay;
pub mod stats;
pub mod timeline;

#[cfg(test)]
pub(crate) mod testutil;

pub use check::{CheckOptions, CheckReport, Checker, LiveSlot, Violation, ViolationKind, check};
pub use diff::{DiffOptions, Divergence, Signature, diff};
pub use export::{
    ChromeOptions, ChromeTraceWriter, ExportError, JsonLinesWriter, write_chrome_trace, write_jsonl,
};
pub use replay::{
    EventSource, FnSource, ManualPacer, OnceSource, Pacer, RealPacer, ReplayError, ReplayMode,
    Replayer, VecSource,
};
pub use stats::{
    Percentiles, Series, Stats, StatsCollector, StatsConfig, StatsError, TransferOutcomes, stats,
};
pub use timeline::{
    BreakpointMark, StateInterval, Timeline, TimelineBuilder, TimelineItem, TrackId, TransferSpan,
};

use kvbm_events::Event;
use kvbm_events::reducer::EngineState;

/// Applies `ev` to `state`; true when the reducer accepted it (it skips
/// stale duplicates and events of another engine, and those must be
/// skipped by every analysis too, or they would disagree with the state).
pub(crate) fn apply_accepted(state: &mut EngineState, ev: &Event) -> bool {
    let before = state.stream().events;
    state.apply(ev);
    state.stream().events != before
}
