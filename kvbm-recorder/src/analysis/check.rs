//! The invariant checker behind `kvbm-recorder check`: what CI asserts on
//! every recorded replay.
//!
//! Over one engine's event stream (plus what the recorder knows it lost):
//!
//! 1. **Every slot reaches `Finished` or is still live at the end.** Live
//!    slots are listed in [`CheckReport::live_slots`] as information, not
//!    violations: a recording may stop while requests run.
//! 2. **No block leaks.** A slot that is `Finished` at the end of the stream
//!    (or when its request id is reused) holds no device blocks:
//!    `BlocksAllocated − BlocksReleased == 0` on G1, as the reducer counts
//!    them. This is judged at the end rather than at the `Finished`
//!    transition because the engine may announce `Finished` (from
//!    `request_finished`, with nothing outstanding) just before it emits the
//!    release of the request's blocks.
//! 3. **The reducer finds nothing inconsistent.** Every increase of one of
//!    the reducer's [`Inconsistencies`] counters (a transition from a state
//!    the slot is not in, a completion of an unknown transfer, a release
//!    below zero, …) is a violation at the event that caused it, so at the
//!    end of a clean stream they are all zero. Envelope problems are too: a
//!    stale (duplicate or out-of-order) sequence number, an event of
//!    another engine, a timestamp going backwards.
//! 4. **Every promoted transfer completes or fails.** A `TransferPromoted`
//!    must be followed by `TransferCompleted` or `TransferFailed` for that
//!    id (a cancel or skip after promotion breaks the commitment rule P3).
//!    One still in flight at the end is a violation only when the caller
//!    says the stream ended cleanly ([`CheckOptions::stream_complete`]);
//!    otherwise it is listed in [`CheckReport::promoted_in_flight`].
//! 5. **Sequence gaps are exactly the known losses.** The holes in the
//!    sequence numbers must add up to the events the recorder knows it lost:
//!    [`CheckOptions::lost`] plus the tap's gap markers fed through
//!    [`Checker::observe_gap`]. A marker that arrives after the last event
//!    reports a loss at the tail, which leaves no hole, so it is kept apart
//!    ([`CheckReport::tail_lost`]) rather than compared. A recording that
//!    starts after the engine did (first `seq > 0`) is not a gap: events
//!    emitted before anyone listened were never offered to the recorder.
//!
//! Such a recording (attached late, or after its server's ring had
//! overwritten the engine's first events) meets requests, transfers, batches, registered blocks and pauses that began
//! before it. What the reducer cannot place for that reason alone (an
//! unknown slot, transfer or batch, an eviction of a hash it never saw
//! registered, a release below zero, a resume with nothing paused) is not
//! judged in such a recording: it is counted in
//! [`CheckReport::not_judged_before_start`]. Anything else is judged as
//! usual.
//!
//! With losses, checks 2–4 may fire on events whose context was lost; the
//! report says how many were lost, and check 5 tells whether the losses are
//! at least accounted for.
//!
//! A stream that did not end cleanly ([`CheckOptions::stream_complete`]
//! false: a remote engine that ran on, an engine that restarted, a
//! recorder that was killed or hit a full disk) may be cut anywhere, so
//! what only its end could settle is listed rather than judged: promoted
//! transfers still in flight (check 4), and the device blocks of slots
//! that finished but whose release had not come yet (check 2 at the end;
//! a slot replaced by a new one of the same id is still judged). When the
//! losses are not known ([`CheckOptions::losses_known`] false: no usable
//! sidecar), holes in the sequence are reported, not judged (check 5).

use super::apply_accepted;
use super::stats::fmt_ns;
use kvbm_events::bus::TapItem;
use kvbm_events::reducer::{EngineState, Inconsistencies, TransferState};
use kvbm_events::slot::SlotState;
use kvbm_events::tier::Tier;
use kvbm_events::{Direction, Event, EventKind, RequestId};
use serde::{Deserialize, Serialize};
use std::borrow::Borrow;
use std::collections::HashMap;
use std::fmt;

/// Default cap on the violations kept in a report.
pub const DEFAULT_MAX_VIOLATIONS: usize = 1_000;

/// Cap on the sequence holes remembered to place an unaccounted one.
const MAX_GAPS_KEPT: usize = 100_000;

/// What the checker is told besides the events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckOptions {
    /// Events the recorder knows it lost, as a total (a log header's
    /// counter). Gap markers seen in the stream are added to it.
    pub lost: u64,
    /// True when the stream ended cleanly (the engine finished and the
    /// recorder drained everything), so transfers still in flight at the end
    /// are violations.
    pub stream_complete: bool,
    /// Most violations kept (the rest are counted).
    pub max_violations: usize,
    /// True when the recorder's losses are known (`lost` and the gap
    /// markers are the whole story), so holes in the sequence can be
    /// judged against them.
    pub losses_known: bool,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            lost: 0,
            stream_complete: true,
            max_violations: DEFAULT_MAX_VIOLATIONS,
            losses_known: true,
        }
    }
}

/// Which invariant a violation breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ViolationKind {
    /// A finished slot still holds device blocks.
    BlockLeak,
    /// A promoted transfer was cancelled or skipped, or never finished in a
    /// complete stream.
    PromotedTransferUnfinished,
    /// The reducer counted an inconsistency.
    Inconsistency,
    /// A stale or foreign sequence number, or a timestamp going backwards.
    Envelope,
    /// Holes in the sequence numbers that no loss counter accounts for.
    UnaccountedGap,
    /// The loss counters report more losses than there are holes.
    LossMismatch,
}

impl ViolationKind {
    /// A short name for messages and exit reports.
    pub fn name(&self) -> &'static str {
        match self {
            ViolationKind::BlockLeak => "block leak",
            ViolationKind::PromotedTransferUnfinished => "promoted transfer unfinished",
            ViolationKind::Inconsistency => "inconsistent event",
            ViolationKind::Envelope => "bad envelope",
            ViolationKind::UnaccountedGap => "unaccounted sequence gap",
            ViolationKind::LossMismatch => "loss counters do not match the gaps",
        }
    }
}

/// One broken invariant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// The event where it shows (`None` for a stream-wide one).
    pub seq: Option<u64>,
    /// Which invariant.
    pub kind: ViolationKind,
    /// The request concerned, if any.
    pub request: Option<RequestId>,
    /// What happened, for a person.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.seq {
            Some(s) => write!(f, "seq {s}: ")?,
            None => write!(f, "end of stream: ")?,
        }
        write!(f, "{}: {}", self.kind.name(), self.message)
    }
}

/// A slot still live at the end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveSlot {
    /// The request.
    pub request: RequestId,
    /// Its state.
    pub state: SlotState,
    /// Since when.
    pub since_ns: u64,
}

/// What the checker found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckReport {
    /// Violations, ordered by sequence number (stream-wide ones last), at
    /// most [`CheckOptions::max_violations`].
    pub violations: Vec<Violation>,
    /// Violations beyond the cap.
    pub violations_dropped: u64,
    /// Slots not `Finished` at the end (information).
    pub live_slots: Vec<LiveSlot>,
    /// Slots `Finished` at the end.
    pub finished_slots: u64,
    /// Events read.
    pub events: u64,
    /// Events the reducer applied.
    pub applied: u64,
    /// First and last sequence numbers applied.
    pub seq_range: Option<(u64, u64)>,
    /// Events missing from the sequence (sum of the holes).
    pub seq_gaps: u64,
    /// Losses the recorder reported (options plus gap markers), tail
    /// included.
    pub lost: u64,
    /// Losses reported by gap markers after the last event.
    pub tail_lost: u64,
    /// Promoted transfers still in flight at the end (ids).
    pub promoted_in_flight: Vec<u64>,
    /// All transfers still in flight at the end.
    pub transfers_in_flight: u64,
    /// The reducer's inconsistency counters at the end.
    pub inconsistencies: Inconsistencies,
    /// Whether the stream was declared complete.
    pub stream_complete: bool,
    /// Whether the losses were known (holes judged against them).
    pub losses_known: bool,
    /// Slots finished at the end of an incomplete stream that still held
    /// device blocks: their release may simply not have come before the
    /// cut (listed, not judged).
    pub unreleased_at_end: Vec<RequestId>,
    /// In a recording that starts after its engine did, events the reducer
    /// could not place only because what they act on began before the
    /// first event (see the module docs): counted, not judged.
    #[serde(default)]
    pub not_judged_before_start: u64,
}

impl CheckReport {
    /// True when no invariant is broken.
    pub fn is_ok(&self) -> bool {
        self.violations.is_empty() && self.violations_dropped == 0
    }

    /// The earliest violation.
    pub fn first_violation(&self) -> Option<&Violation> {
        self.violations.first()
    }

    /// Violations found, kept or not.
    pub fn violation_count(&self) -> u64 {
        self.violations.len() as u64 + self.violations_dropped
    }
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_ok() {
            write!(f, "ok: ")?;
        } else {
            write!(f, "FAILED: {} violations; ", self.violation_count())?;
        }
        write!(
            f,
            "{} events, {} slots finished, {} live",
            self.events,
            self.finished_slots,
            self.live_slots.len()
        )?;
        if let Some((a, b)) = self.seq_range {
            write!(f, ", seq {a}..={b}")?;
        }
        if !self.losses_known {
            write!(
                f,
                ", {} missing from the sequence, losses unknown",
                self.seq_gaps
            )?;
        } else if self.seq_gaps > 0 || self.lost > 0 {
            write!(
                f,
                ", {} missing from the sequence, {} reported lost",
                self.seq_gaps, self.lost
            )?;
        }
        if !self.promoted_in_flight.is_empty() {
            write!(
                f,
                ", {} promoted transfers in flight",
                self.promoted_in_flight.len()
            )?;
        }
        if self.not_judged_before_start > 0 {
            write!(
                f,
                ", {} events on what began before the first not judged",
                self.not_judged_before_start
            )?;
        }
        writeln!(f)?;
        for v in &self.violations {
            writeln!(f, "  {v}")?;
        }
        if self.violations_dropped > 0 {
            writeln!(f, "  … and {} more", self.violations_dropped)?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Promoted {
    seq: u64,
    request: Option<RequestId>,
    direction: Direction,
}

/// Checks a stream one event at a time; see the module docs.
#[derive(Debug)]
pub struct Checker {
    opts: CheckOptions,
    state: EngineState,
    violations: Vec<Violation>,
    dropped: u64,
    incons: Inconsistencies,
    promoted: HashMap<u64, Promoted>,
    finished_at: HashMap<RequestId, u64>,
    /// `(seq after the hole, cumulative missing)`.
    gaps: Vec<(u64, u64)>,
    lost_markers: u64,
    lost_pending: u64,
    events: u64,
    unreleased_at_end: Vec<RequestId>,
    /// The first event's seq was above 0: the engine ran before it.
    joined_late: bool,
    not_judged_before_start: u64,
}

/// The reducer's counters that rise when an event acts on something the
/// stream never showed beginning: in a recording that starts late, that
/// is what began before it.
const CONTEXT_BEFORE_START: &[&str] = &[
    "unknown_slot",
    "unknown_transfer",
    "unknown_batch",
    "evict_unregistered",
    "blocks_underflow",
    "unmatched_resume",
];

impl Checker {
    /// A checker at the start of a stream.
    pub fn new(opts: CheckOptions) -> Self {
        Checker {
            opts,
            state: EngineState::new(),
            violations: Vec::new(),
            dropped: 0,
            incons: Inconsistencies::default(),
            promoted: HashMap::new(),
            finished_at: HashMap::new(),
            gaps: Vec::new(),
            lost_markers: 0,
            lost_pending: 0,
            events: 0,
            unreleased_at_end: Vec::new(),
            joined_late: false,
            not_judged_before_start: 0,
        }
    }

    /// The reducer's state so far.
    pub fn state(&self) -> &EngineState {
        &self.state
    }

    fn violate(
        &mut self,
        seq: Option<u64>,
        kind: ViolationKind,
        request: Option<&RequestId>,
        message: String,
    ) {
        if self.violations.len() < self.opts.max_violations {
            self.violations.push(Violation {
                seq,
                kind,
                request: request.cloned(),
                message,
            });
        } else {
            self.dropped += 1;
        }
    }

    /// Takes a gap marker from the tap: `dropped` events were lost here.
    pub fn observe_gap(&mut self, dropped: u64) {
        self.lost_pending = self.lost_pending.saturating_add(dropped);
    }

    /// Takes one item from the tap (an event or a gap marker).
    pub fn observe_item(&mut self, item: &TapItem<Event>) {
        match item {
            TapItem::Event(e) => self.observe(e),
            TapItem::Gap { dropped } => self.observe_gap(*dropped),
        }
    }

    /// Takes one event.
    pub fn observe(&mut self, ev: &Event) {
        if self.events == 0 {
            self.joined_late = ev.seq > 0;
        }
        self.events += 1;
        // A marker followed by an event is a loss in the middle, which must
        // show as a hole; only markers after the last event are the tail.
        self.lost_markers = self.lost_markers.saturating_add(self.lost_pending);
        self.lost_pending = 0;
        let before = self.state.stream().clone();
        let req = ev.request.as_ref();
        // A finished slot about to be replaced by a new one with the same
        // id is judged now, while its counts are still there (only if the
        // reducer will accept the creation: a stale one replaces nothing).
        if let (EventKind::SlotCreated { .. }, Some(r)) = (&ev.kind, req) {
            let accepted = before.engine.is_none_or(|e| e == ev.engine)
                && before.last_seq.is_none_or(|l| ev.seq > l);
            if accepted {
                self.judge_finished(r);
            }
        }
        let was_finished = req
            .and_then(|r| self.state.slot(r))
            .is_some_and(|s| s.is_finished());
        if !apply_accepted(&mut self.state, ev) {
            self.envelope_skipped(ev, &before);
            return;
        }
        let seq = ev.seq;
        let after = self.state.stream();
        if after.seq_gaps > before.seq_gaps && self.gaps.len() < MAX_GAPS_KEPT {
            self.gaps.push((seq, after.seq_gaps));
        }
        if after.ts_regressions > before.ts_regressions {
            let msg = format!(
                "timestamp {} is below the largest seen, {}",
                ev.ts_ns, before.last_ts_ns
            );
            self.violate(Some(seq), ViolationKind::Envelope, req, msg);
        }
        if self.state.inconsistencies().total() != self.incons.total() {
            self.inconsistency(ev);
        }
        match &ev.kind {
            EventKind::SlotTransition { .. } if !was_finished => {
                if let Some(r) = req
                    && self.state.slot(r).is_some_and(|s| s.is_finished())
                {
                    self.finished_at.insert(r.clone(), seq);
                }
            }
            EventKind::TransferPromoted {
                transfer,
                direction,
                ..
            } => {
                let promoted = self
                    .state
                    .transfer(*transfer)
                    .is_some_and(|t| t.status == TransferState::Promoted);
                if promoted {
                    self.promoted.insert(
                        *transfer,
                        Promoted {
                            seq,
                            request: req.cloned(),
                            direction: *direction,
                        },
                    );
                }
            }
            EventKind::TransferPlanned { transfer, .. }
            | EventKind::TransferCompleted { transfer, .. }
            | EventKind::TransferFailed { transfer, .. } => {
                // A re-plan of a promoted id is the reducer's duplicate
                // transfer, reported as an inconsistency already.
                self.promoted.remove(transfer);
            }
            EventKind::TransferCancelled { transfer, .. }
            | EventKind::TransferSkipped { transfer, .. } => {
                if let Some(p) = self.promoted.remove(transfer) {
                    let msg = format!(
                        "transfer #{transfer} ({}) was promoted at seq {} and then {}; \
                         a promoted transfer must complete or fail",
                        p.direction,
                        p.seq,
                        describe_end(&ev.kind)
                    );
                    self.violate(
                        Some(seq),
                        ViolationKind::PromotedTransferUnfinished,
                        p.request.as_ref().or(req),
                        msg,
                    );
                }
            }
            _ => {}
        }
    }

    fn envelope_skipped(&mut self, ev: &Event, before: &kvbm_events::reducer::StreamStats) {
        let after = self.state.stream();
        let msg = if after.foreign_engine > before.foreign_engine {
            format!(
                "event of engine {} in a stream of engine {}",
                ev.engine,
                before.engine.unwrap_or_default()
            )
        } else {
            format!(
                "sequence number {} is not above the last one, {} (duplicate or out of order)",
                ev.seq,
                before.last_seq.unwrap_or_default()
            )
        };
        self.violate(
            Some(ev.seq),
            ViolationKind::Envelope,
            ev.request.as_ref(),
            msg,
        );
    }

    fn inconsistency(&mut self, ev: &Event) {
        let now = self.state.inconsistencies().clone();
        // Field by field through serde, so a counter added to the reducer
        // later is reported by name without a change here.
        let (old, new) = match (
            serde_json::to_value(&self.incons),
            serde_json::to_value(&now),
        ) {
            (Ok(serde_json::Value::Object(o)), Ok(serde_json::Value::Object(n))) => (o, n),
            _ => Default::default(),
        };
        let mut what: Vec<String> = new
            .iter()
            .filter_map(|(k, v)| {
                let n = v.as_u64()?;
                let o = old.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
                (n > o).then(|| k.clone())
            })
            .collect();
        if what.is_empty() {
            what.push("inconsistency".into());
        }
        self.incons = now;
        if self.joined_late
            && what
                .iter()
                .all(|k| CONTEXT_BEFORE_START.contains(&k.as_str()))
        {
            self.not_judged_before_start += 1;
            return;
        }
        let who = ev
            .request
            .as_deref()
            .map(|r| format!(" for request {r}"))
            .unwrap_or_default();
        let msg = format!(
            "{} {}{who}: the reducer counted {}",
            ev.kind.name(),
            describe(&ev.kind),
            what.join(", ")
        );
        self.violate(
            Some(ev.seq),
            ViolationKind::Inconsistency,
            ev.request.as_ref(),
            msg,
        );
    }

    /// Judges a finished slot's device blocks; `at_end`: because the
    /// stream ended (rather than because its id is being reused).
    fn judge_finished(&mut self, r: &RequestId) {
        self.judge_finished_at(r, false);
    }

    fn judge_finished_at(&mut self, r: &RequestId, at_end: bool) {
        let Some(slot) = self.state.slot(r) else {
            return;
        };
        if !slot.is_finished() {
            return;
        }
        let held = slot.blocks[Tier::Device.index()];
        let finished_ns = slot.state_since_ns;
        let seq = self.finished_at.remove(&**r);
        if held > 0 && at_end && !self.opts.stream_complete {
            self.unreleased_at_end.push(r.clone());
            return;
        }
        if held > 0 {
            let msg = format!(
                "request {r} finished at {} still holding {held} device blocks \
                 (allocated minus released)",
                fmt_ns(finished_ns)
            );
            self.violate(seq, ViolationKind::BlockLeak, Some(r), msg);
        }
    }

    /// Ends the stream and reports.
    pub fn finish(mut self) -> CheckReport {
        // Block leaks of the slots finished at the end, oldest first.
        let finished: Vec<RequestId> = self
            .state
            .slots_sorted()
            .into_iter()
            .filter(|s| s.is_finished())
            .map(|s| s.request.clone())
            .collect();
        for r in &finished {
            self.judge_finished_at(r, true);
        }
        // Promoted transfers that never ended.
        let mut promoted: Vec<(u64, Promoted)> = self.promoted.drain().collect();
        promoted.sort_by_key(|(id, p)| (p.seq, *id));
        let promoted_in_flight: Vec<u64> = promoted.iter().map(|(id, _)| *id).collect();
        if self.opts.stream_complete {
            for (id, p) in promoted {
                let msg = format!(
                    "transfer #{id} ({}) was promoted and never completed or failed \
                     before the stream ended",
                    p.direction
                );
                self.violate(
                    Some(p.seq),
                    ViolationKind::PromotedTransferUnfinished,
                    p.request.as_ref(),
                    msg,
                );
            }
        }
        // Holes against losses.
        let seq_gaps = self.state.seq_gaps();
        let placed = self.opts.lost.saturating_add(self.lost_markers);
        let tail_lost = self.lost_pending;
        if !self.opts.losses_known {
            // Nothing to judge the holes against.
        } else if seq_gaps > placed {
            // The first hole that takes the running total past the losses.
            let at = self.gaps.iter().find(|(_, cum)| *cum > placed).map(|g| g.0);
            let msg = format!(
                "{seq_gaps} events are missing from the sequence but the loss counters \
                 account for {placed}"
            );
            self.violate(at, ViolationKind::UnaccountedGap, None, msg);
        } else if seq_gaps < placed {
            let msg = format!(
                "the loss counters report {placed} events lost before the last event, \
                 but only {seq_gaps} are missing from the sequence"
            );
            self.violate(None, ViolationKind::LossMismatch, None, msg);
        }
        // Earliest first; stream-wide ones last; stable for ties.
        self.violations
            .sort_by_key(|v| (v.seq.is_none(), v.seq.unwrap_or(0)));
        let stream = self.state.stream();
        let live_slots = self
            .state
            .slots_sorted()
            .into_iter()
            .filter(|s| !s.is_finished())
            .map(|s| LiveSlot {
                request: s.request.clone(),
                state: s.state,
                since_ns: s.state_since_ns,
            })
            .collect();
        CheckReport {
            violations: self.violations,
            violations_dropped: self.dropped,
            live_slots,
            finished_slots: finished.len() as u64,
            events: self.events,
            applied: stream.events,
            seq_range: stream.first_seq.zip(stream.last_seq),
            seq_gaps,
            lost: placed.saturating_add(tail_lost),
            tail_lost,
            promoted_in_flight,
            transfers_in_flight: self.state.in_flight_count() as u64,
            inconsistencies: self.state.inconsistencies().clone(),
            stream_complete: self.opts.stream_complete,
            losses_known: self.opts.losses_known,
            unreleased_at_end: self.unreleased_at_end,
            not_judged_before_start: self.not_judged_before_start,
        }
    }
}

fn describe_end(kind: &EventKind) -> String {
    match kind {
        EventKind::TransferSkipped { reason, .. } => format!("skipped ({reason})"),
        EventKind::TransferCancelled { .. } => "cancelled".into(),
        other => other.name().into(),
    }
}

/// A few words about an event's payload for a message.
fn describe(kind: &EventKind) -> String {
    match kind {
        EventKind::SlotTransition { from, to } => format!("{from} → {to}"),
        EventKind::BlocksReleased { tier, count } => {
            format!("{count} blocks on {}", tier.short_name())
        }
        EventKind::TransferPlanned { transfer, .. }
        | EventKind::TransferPromoted { transfer, .. }
        | EventKind::TransferSkipped { transfer, .. }
        | EventKind::TransferCancelled { transfer, .. }
        | EventKind::TransferCompleted { transfer, .. }
        | EventKind::TransferFailed { transfer, .. } => format!("#{transfer}"),
        EventKind::BatchDispatched { batch, .. } | EventKind::BatchCompleted { batch, .. } => {
            format!("batch {batch}")
        }
        EventKind::BlockRegistered {
            tier,
            sequence_hash,
            ..
        }
        | EventKind::BlockEvicted {
            tier,
            sequence_hash,
            ..
        } => format!("{sequence_hash} on {}", tier.short_name()),
        EventKind::Resumed { breakpoint, .. } => format!("breakpoint {breakpoint}"),
        _ => String::new(),
    }
}

/// Checks a whole stream (owned or borrowed events).
pub fn check<E: Borrow<Event>>(
    events: impl IntoIterator<Item = E>,
    opts: CheckOptions,
) -> CheckReport {
    let mut c = Checker::new(opts);
    for e in events {
        c.observe(e.borrow());
    }
    c.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testutil::{Stream, arb_events};
    use SlotState::*;
    use proptest::prelude::*;

    fn kinds(r: &CheckReport) -> Vec<(Option<u64>, ViolationKind)> {
        r.violations.iter().map(|v| (v.seq, v.kind)).collect()
    }

    #[test]
    fn a_clean_stream_passes_and_lists_live_slots() {
        let mut s = Stream::new();
        s.at(0).life("a", 1);
        s.at(100).life("b", 2);
        s.at(200).create("c", 8);
        let r = check(s.events(), CheckOptions::default());
        assert!(r.is_ok(), "{r}");
        assert_eq!(r.first_violation(), None);
        assert_eq!(r.finished_slots, 2);
        assert_eq!(r.live_slots.len(), 1);
        assert_eq!(
            (&*r.live_slots[0].request, r.live_slots[0].state),
            ("c", Initialized)
        );
        assert_eq!(r.seq_range, Some((0, s.events().len() as u64 - 1)));
        assert!(r.to_string().starts_with("ok: "), "{r}");
    }

    /// Events on a request, a transfer and blocks that began earlier,
    /// then a new request moved from a state it is not in.
    fn joined(late: bool) -> Stream {
        let d = kvbm_events::Direction::DEVICE_TO_HOST;
        let mut s = Stream::new();
        if late {
            s.lose(100); // the server no longer held seqs 0..100
        }
        s.at(0)
            .to("old", Prefilling, Decoding)
            .release("old", Tier::Device, 3)
            .complete("old", 7, d, 1);
        s.at(1).create("new", 8);
        s.at(2).to("new", Decoding, Finished);
        s
    }

    #[test]
    fn a_recording_that_starts_late_does_not_judge_what_began_before_it() {
        let r = check(joined(true).events(), CheckOptions::default());
        assert_eq!(
            kinds(&r),
            [(Some(104), ViolationKind::Inconsistency)],
            "{r}"
        );
        assert!(
            r.violations[0].message.contains("slot_from_mismatch"),
            "{r}"
        );
        assert_eq!(r.not_judged_before_start, 3, "{r}");
        assert!(
            r.to_string()
                .contains("3 events on what began before the first not judged"),
            "{r}"
        );
        // From seq 0 nothing began before: every one is judged.
        let r = check(joined(false).events(), CheckOptions::default());
        assert_eq!(r.violation_count(), 4, "{r}");
        assert_eq!(r.not_judged_before_start, 0);
    }

    #[test]
    fn a_release_after_finished_is_not_a_leak_but_a_missing_one_is() {
        let mut s = Stream::new();
        s.at(0).create("a", 8);
        s.at(1).alloc("a", Tier::Device, 3);
        s.at(2).to("a", Initialized, Finished);
        s.at(3).release("a", Tier::Device, 3); // after Finished, as the sim does
        s.at(4).create("b", 8);
        s.at(5).alloc("b", Tier::Device, 2);
        s.at(6).release("b", Tier::Device, 1);
        s.at(7).to("b", Initialized, Finished);
        s.at(8).alloc("b", Tier::Host, 4); // host blocks are not the slot's
        let r = check(s.events(), CheckOptions::default());
        assert_eq!(kinds(&r), [(Some(7), ViolationKind::BlockLeak)]);
        let v = r.first_violation().unwrap();
        assert_eq!(v.request.as_deref(), Some("b"));
        assert!(v.message.contains("1 device blocks"), "{v}");
        assert!(r.to_string().starts_with("FAILED: 1 violations"), "{r}");
    }

    #[test]
    fn a_leak_is_judged_when_the_request_id_is_reused() {
        let mut s = Stream::new();
        s.at(0).create("a", 8);
        s.at(1).alloc("a", Tier::Device, 2);
        s.at(2).to("a", Initialized, Finished);
        s.at(3).create("a", 8); // reuse: the old slot is judged first
        s.at(4).to("a", Initialized, Finished);
        let r = check(s.events(), CheckOptions::default());
        assert_eq!(kinds(&r), [(Some(2), ViolationKind::BlockLeak)]);
    }

    #[test]
    fn a_stale_creation_does_not_judge_a_slot_twice() {
        let mut s = Stream::new();
        s.at(0).create("a", 8);
        s.at(1).alloc("a", Tier::Device, 2);
        s.at(2).to("a", Initialized, Finished);
        let dup = s.events()[0].clone();
        s.raw(dup); // seq 0 again: skipped by the reducer
        let r = check(s.events(), CheckOptions::default());
        assert_eq!(
            kinds(&r),
            [
                (Some(0), ViolationKind::Envelope),
                (Some(2), ViolationKind::BlockLeak)
            ]
        );
    }

    #[test]
    fn promoted_transfers_must_complete_or_fail() {
        let d = kvbm_events::Direction::DEVICE_TO_HOST;
        let mut s = Stream::new();
        s.at(0).create("a", 8);
        s.at(1)
            .plan("a", 1, d, 1)
            .promote("a", 1, d, 1)
            .complete("a", 1, d, 1);
        s.at(2)
            .plan("a", 2, d, 1)
            .promote("a", 2, d, 1)
            .fail("a", 2, d);
        s.at(3).plan("a", 3, d, 1).cancel("a", 3, d); // not promoted: fine
        s.at(4).plan("a", 4, d, 1).promote("a", 4, d, 1); // seq 10
        s.at(5).cancel("a", 4, d); // seq 11: after promotion
        s.at(6).plan("a", 5, d, 1).promote("a", 5, d, 1); // seq 13: never ends
        let r = check(s.events(), CheckOptions::default());
        assert_eq!(
            kinds(&r),
            [
                (Some(11), ViolationKind::PromotedTransferUnfinished),
                (Some(13), ViolationKind::PromotedTransferUnfinished),
            ]
        );
        assert_eq!(r.promoted_in_flight, [5]);
        // Not complete: the in-flight one is information only.
        let r = check(
            s.events(),
            CheckOptions {
                stream_complete: false,
                ..CheckOptions::default()
            },
        );
        assert_eq!(
            kinds(&r),
            [(Some(11), ViolationKind::PromotedTransferUnfinished)]
        );
        assert_eq!(r.promoted_in_flight, [5]);
    }

    #[test]
    fn inconsistencies_are_violations_at_their_event() {
        let d = kvbm_events::Direction::HOST_TO_DEVICE;
        let mut s = Stream::new();
        s.at(0).create("a", 8);
        s.at(1).to("a", Prefilling, Decoding); // from mismatch, seq 1
        s.at(2).complete("a", 77, d, 1); // unknown transfer, seq 2
        s.at(3).to("zzz", Initialized, Prefilling); // unknown slot, seq 3
        let r = check(s.events(), CheckOptions::default());
        assert_eq!(
            kinds(&r),
            [
                (Some(1), ViolationKind::Inconsistency),
                (Some(2), ViolationKind::Inconsistency),
                (Some(3), ViolationKind::Inconsistency),
            ]
        );
        assert!(r.violations[0].message.contains("slot_from_mismatch"));
        assert!(r.violations[1].message.contains("unknown_transfer"));
        assert!(r.violations[1].message.contains("#77"));
        assert!(r.violations[2].message.contains("unknown_slot"));
        assert_eq!(r.inconsistencies.total(), 3);
    }

    #[test]
    fn gaps_must_match_the_losses() {
        let mut s = Stream::new();
        s.at(0).create("a", 8);
        s.lose(3);
        s.at(1).to("a", Initialized, Prefilling); // seq 4
        s.lose(2);
        s.at(2).to("a", Prefilling, Decoding); // seq 7
        let ev = s.events().to_vec();
        // No losses known: the first hole is unaccounted.
        let r = check(&ev, CheckOptions::default());
        assert_eq!(kinds(&r), [(Some(4), ViolationKind::UnaccountedGap)]);
        assert_eq!(r.seq_gaps, 5);
        // Three known: the second hole is the first one unaccounted.
        let opts = CheckOptions {
            lost: 3,
            ..CheckOptions::default()
        };
        assert_eq!(
            kinds(&check(&ev, opts)),
            [(Some(7), ViolationKind::UnaccountedGap)]
        );
        // All five known, through the option and in-band markers.
        let mut c = Checker::new(CheckOptions {
            lost: 2,
            ..CheckOptions::default()
        });
        c.observe(&ev[0]);
        c.observe_item(&TapItem::Gap { dropped: 3 });
        c.observe(&ev[1]);
        c.observe(&ev[2]);
        // A tail loss leaves no hole and is not compared.
        c.observe_gap(4);
        let r = c.finish();
        assert!(r.is_ok(), "{r}");
        assert_eq!((r.lost, r.tail_lost), (9, 4));
        // More losses than holes before the last event.
        let r = check(
            &ev,
            CheckOptions {
                lost: 6,
                ..CheckOptions::default()
            },
        );
        assert_eq!(kinds(&r), [(None, ViolationKind::LossMismatch)]);
    }

    #[test]
    fn envelope_problems_are_violations() {
        let mut s = Stream::new();
        s.at(10).create("a", 8);
        s.at(5).to("a", Initialized, Prefilling); // time goes backwards, seq 1
        let mut dup = s.events()[1].clone();
        dup.ts_ns = 20;
        s.raw(dup); // seq 1 again
        let mut other = s.events()[0].clone();
        other.engine = 9;
        other.seq = 2;
        s.raw(other);
        let r = check(s.events(), CheckOptions::default());
        assert_eq!(
            kinds(&r),
            [
                (Some(1), ViolationKind::Envelope),
                (Some(1), ViolationKind::Envelope),
                (Some(2), ViolationKind::Envelope),
            ]
        );
        assert!(r.violations[1].message.contains("duplicate"));
        assert!(r.violations[2].message.contains("engine 9"));
    }

    #[test]
    fn violations_are_capped_and_counted() {
        let mut s = Stream::new();
        for i in 0..10 {
            s.at(i).to("nobody", Initialized, Prefilling);
        }
        let r = check(
            s.events(),
            CheckOptions {
                max_violations: 3,
                ..CheckOptions::default()
            },
        );
        assert_eq!((r.violations.len(), r.violations_dropped), (3, 7));
        assert_eq!(r.violation_count(), 10);
        assert!(!r.is_ok());
        assert_eq!(r.first_violation().and_then(|v| v.seq), Some(0));
    }

    proptest! {
        #[test]
        fn never_panics_and_the_first_violation_is_the_earliest(
            events in arb_events(80),
            lost in 0u64..5,
            complete in any::<bool>(),
        ) {
            let r = check(&events, CheckOptions { lost, stream_complete: complete, max_violations: 5, losses_known: true });
            let seqs: Vec<_> = r.violations.iter().map(|v| (v.seq.is_none(), v.seq)).collect();
            let mut sorted = seqs.clone();
            sorted.sort();
            prop_assert_eq!(seqs, sorted);
            prop_assert!(r.violations.len() <= 5);
            let _ = r.to_string();
            prop_assert!(serde_json::to_string(&r).is_ok());
        }
    }
}
