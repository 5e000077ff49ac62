//! Timelines: what each request was doing when, and how long each transfer
//! took — the shapes a post-mortem draws (and the Chrome export writes).
//!
//! A [`TimelineBuilder`] follows a stream through the reducer and hands out
//! [`TimelineItem`]s as they become known: a track when a request first
//! appears, a [`StateInterval`] when a slot leaves a state, a
//! [`TransferSpan`] when a transfer reaches a terminal status, a first-token
//! mark, a breakpoint hit. [`TimelineBuilder::finish`] closes what is still
//! open at the end of the stream (marked `open`). [`Timeline::from_events`]
//! collects all of it.
//!
//! The reducer decides every state: an interval starts when the reducer's
//! slot changes state (a re-announcement of the current state continues the
//! interval, a `SlotTransition` whose `from` disagrees still moves the slot,
//! exactly as the console shows it), and a transfer span's times and status
//! are the reducer's [`TransferView`]. `Finished` is terminal, so it has no
//! interval; the slot's last interval ends when it finishes.
//!
//! Track numbers are stable per request id: 1, 2, 3, … in order of first
//! appearance (0 is left for engine-wide marks), and a request id reused
//! after its slot finished keeps its number.

use super::apply_accepted;
use kvbm_events::reducer::{EngineState, TransferState, TransferView};
use kvbm_events::slot::SlotState;
use kvbm_events::{Direction, EntryPoint, Event, EventKind, RequestId};
use serde::{Deserialize, Serialize};
use std::borrow::Borrow;
use std::collections::HashMap;

/// A stable per-request track number (0 is reserved for engine-wide marks).
pub type TrackId = u32;

/// A request spent `[start_ns, end_ns)` in `state`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateInterval {
    /// The request.
    pub request: RequestId,
    /// Its track.
    pub track: TrackId,
    /// The state.
    pub state: SlotState,
    /// When it entered the state.
    pub start_ns: u64,
    /// When it left (for an open interval, the end of the stream). Never
    /// below `start_ns`, even when timestamps went backwards.
    pub end_ns: u64,
    /// True when the stream ended with the request still in this state.
    pub open: bool,
}

impl StateInterval {
    /// `end_ns - start_ns`.
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

/// One transfer candidate from planning to its terminal status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferSpan {
    /// Candidate id.
    pub transfer: u64,
    /// The request that planned it.
    pub request: Option<RequestId>,
    /// That request's track.
    pub track: Option<TrackId>,
    /// Direction.
    pub direction: Direction,
    /// Blocks (as last reported).
    pub blocks: u32,
    /// When it was planned.
    pub planned_ns: u64,
    /// When it was promoted (committed), if it was.
    pub promoted_ns: Option<u64>,
    /// When it reached its status (for an open span, the end of the stream).
    pub end_ns: u64,
    /// Its terminal status, or where it stood when the stream ended.
    pub status: TransferState,
    /// The batch it went out in, if dispatched.
    pub batch: Option<u64>,
    /// True when the stream ended with the transfer still in flight.
    pub open: bool,
}

impl TransferSpan {
    /// `end_ns - planned_ns`.
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.planned_ns)
    }

    fn from_view(
        t: &TransferView,
        track: Option<TrackId>,
        promoted_ns: Option<u64>,
        end_ns: u64,
        open: bool,
    ) -> Self {
        TransferSpan {
            transfer: t.id,
            request: t.request.clone(),
            track,
            direction: t.direction,
            blocks: t.blocks,
            planned_ns: t.planned_ns,
            promoted_ns,
            end_ns: end_ns.max(t.planned_ns),
            status: t.status.clone(),
            batch: t.batch,
            open,
        }
    }
}

/// A breakpoint paused a call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BreakpointMark {
    /// Sequence number of the hit.
    pub seq: u64,
    /// When.
    pub ts_ns: u64,
    /// Breakpoint id.
    pub breakpoint: u64,
    /// The paused entry point.
    pub entry: EntryPoint,
    /// The request, if the call had one.
    pub request: Option<RequestId>,
    /// Its track (0 when there is no request).
    pub track: TrackId,
}

/// What a [`TimelineBuilder`] hands out, in stream order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimelineItem {
    /// A request appeared for the first time.
    Track {
        /// Its track number.
        track: TrackId,
        /// The request.
        request: RequestId,
    },
    /// A slot left a state (or the stream ended in it).
    Interval(StateInterval),
    /// A transfer reached a terminal status (or the stream ended first).
    Transfer(TransferSpan),
    /// A request's first generated token was scheduled.
    FirstToken {
        /// The request.
        request: RequestId,
        /// Its track.
        track: TrackId,
        /// When.
        ts_ns: u64,
        /// Time from slot creation.
        ttft_ns: u64,
    },
    /// A breakpoint hit.
    Breakpoint(BreakpointMark),
}

#[derive(Debug, Clone, Copy)]
struct Open {
    state: SlotState,
    start_ns: u64,
}

/// Follows a stream and hands out timeline items; see the module docs.
#[derive(Debug, Default, Clone)]
pub struct TimelineBuilder {
    state: EngineState,
    tracks: HashMap<RequestId, TrackId>,
    open: HashMap<RequestId, Open>,
    promoted: HashMap<u64, u64>,
    start_ns: Option<u64>,
    end_ns: u64,
    events: u64,
}

impl TimelineBuilder {
    /// A builder at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// The reducer's state after the events observed so far.
    pub fn state(&self) -> &EngineState {
        &self.state
    }

    /// Forgets finished slots that reached `Finished` before `cutoff_ns`
    /// (see [`EngineState::retain_finished_since`]); a viewer keeps
    /// finished requests on screen for a while, not for ever. Their tracks
    /// stay, so a request id seen again keeps its track.
    pub fn prune_finished_before(&mut self, cutoff_ns: u64) -> usize {
        self.state.retain_finished_since(cutoff_ns)
    }

    /// The track of a request seen so far.
    pub fn track_of(&self, request: &str) -> Option<TrackId> {
        self.tracks.get(request).copied()
    }

    /// Events observed (accepted or not).
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Earliest and latest timestamps of the accepted events.
    pub fn time_range(&self) -> Option<(u64, u64)> {
        self.start_ns.map(|s| (s, self.end_ns.max(s)))
    }

    fn track(&mut self, request: &RequestId, out: &mut impl FnMut(TimelineItem)) -> TrackId {
        if let Some(t) = self.tracks.get(request) {
            return *t;
        }
        // Saturates rather than wraps: past 4 billion requests the last
        // track is shared, which a viewer survives.
        let t = TrackId::try_from(self.tracks.len() + 1).unwrap_or(TrackId::MAX);
        self.tracks.insert(request.clone(), t);
        out(TimelineItem::Track {
            track: t,
            request: request.clone(),
        });
        t
    }

    /// Takes one event; calls `out` for each item it completes. Returns
    /// false when the reducer skipped the event (a stale duplicate, or
    /// another engine's), which then changes nothing.
    pub fn observe(&mut self, ev: &Event, mut out: impl FnMut(TimelineItem)) -> bool {
        self.events += 1;
        let had_first_token = match (&ev.kind, &ev.request) {
            (EventKind::TokensScheduled { .. }, Some(r)) => self
                .state
                .slot(r)
                .map(|s| s.first_token_ns.is_some())
                .unwrap_or(true),
            _ => true,
        };
        let ended_before = self.ended_transfers();
        if !apply_accepted(&mut self.state, ev) {
            return false;
        }
        let ts = ev.ts_ns;
        self.start_ns = Some(self.start_ns.map_or(ts, |s| s.min(ts)));
        self.end_ns = self.end_ns.max(ts);
        let track = ev.request.as_ref().map(|r| (r, self.track(r, &mut out)));
        match &ev.kind {
            EventKind::SlotCreated { .. } | EventKind::SlotTransition { .. } => {
                if let Some((r, track)) = track {
                    self.slot_changed(r, track, ts, &mut out);
                }
            }
            EventKind::TokensScheduled { .. } if !had_first_token => {
                if let Some((r, track)) = track
                    && let Some(ttft_ns) = self.state.slot(r).and_then(|s| s.ttft_ns()) {
                        out(TimelineItem::FirstToken {
                            request: r.clone(),
                            track,
                            ts_ns: ts,
                            ttft_ns,
                        });
                    }
            }
            EventKind::TransferPlanned { transfer, .. } => {
                // A re-plan of an id in flight replaces the old candidate.
                self.promoted.remove(transfer);
            }
            EventKind::TransferPromoted { transfer, .. }
                if self.state.transfer(*transfer).is_some() =>
            {
                self.promoted.insert(*transfer, ts);
            }
            EventKind::TransferCompleted { transfer, .. }
            | EventKind::TransferSkipped { transfer, .. }
            | EventKind::TransferCancelled { transfer, .. }
            // The reducer moved it to its ring of recent transfers only if it
            // was in flight; an unknown id ends nothing.
            | EventKind::TransferFailed { transfer, .. }
                if self.ended_transfers() != ended_before =>
            {
                if let Some(t) = self.state.recent().next_back() {
                    let promoted = self.promoted.remove(transfer);
                    let track = t.request.as_ref().and_then(|r| self.tracks.get(r)).copied();
                    out(TimelineItem::Transfer(TransferSpan::from_view(
                        t, track, promoted, t.updated_ns, false,
                    )));
                }
            }
            EventKind::BreakpointHit {
                breakpoint, entry, ..
            } => out(TimelineItem::Breakpoint(BreakpointMark {
                seq: ev.seq,
                ts_ns: ts,
                breakpoint: *breakpoint,
                entry: *entry,
                request: ev.request.clone(),
                track: track.map_or(0, |(_, t)| t),
            })),
            _ => {}
        }
        true
    }

    fn ended_transfers(&self) -> u64 {
        (self.state.recent().len() as u64).saturating_add(self.state.recent_dropped())
    }

    fn slot_changed(
        &mut self,
        r: &RequestId,
        track: TrackId,
        ts: u64,
        out: &mut impl FnMut(TimelineItem),
    ) {
        let Some(slot) = self.state.slot(r) else {
            return;
        };
        let now = Open {
            state: slot.state,
            start_ns: slot.state_since_ns,
        };
        let prev = self.open.get(r).copied();
        if prev.is_some_and(|p| p.state == now.state && p.start_ns == now.start_ns) {
            return;
        }
        if let Some(p) = prev {
            out(TimelineItem::Interval(StateInterval {
                request: r.clone(),
                track,
                state: p.state,
                start_ns: p.start_ns,
                end_ns: ts.max(p.start_ns),
                open: false,
            }));
        }
        if now.state.is_terminal() {
            self.open.remove(r);
        } else {
            self.open.insert(r.clone(), now);
        }
    }

    /// Ends the stream: hands out the intervals and transfers still open,
    /// ending them at the last timestamp seen, and returns the final state.
    pub fn finish(mut self, mut out: impl FnMut(TimelineItem)) -> EngineState {
        let end = self.end_ns;
        let mut open: Vec<(RequestId, Open)> = self.open.drain().collect();
        // Deterministic output order: by track.
        open.sort_by_key(|(r, _)| self.tracks.get(r).copied());
        for (r, o) in open {
            out(TimelineItem::Interval(StateInterval {
                track: self.tracks.get(&r).copied().unwrap_or(0),
                request: r,
                state: o.state,
                start_ns: o.start_ns,
                end_ns: end.max(o.start_ns),
                open: true,
            }));
        }
        for t in self.state.in_flight() {
            let track = t.request.as_ref().and_then(|r| self.tracks.get(r)).copied();
            let promoted = self.promoted.get(&t.id).copied();
            out(TimelineItem::Transfer(TransferSpan::from_view(
                t, track, promoted, end, true,
            )));
        }
        self.state
    }
}

/// A whole stream's timeline, collected.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timeline {
    /// Requests with their track numbers, in order of first appearance.
    pub tracks: Vec<(TrackId, RequestId)>,
    /// State intervals, by track then start time.
    pub intervals: Vec<StateInterval>,
    /// Transfer spans, by planning time then id.
    pub transfers: Vec<TransferSpan>,
    /// First-token marks `(track, ts_ns, ttft_ns)`, in stream order.
    pub first_tokens: Vec<(TrackId, u64, u64)>,
    /// Breakpoint hits, in stream order.
    pub breakpoints: Vec<BreakpointMark>,
    /// Earliest and latest timestamps, if any event was accepted.
    pub time_range: Option<(u64, u64)>,
    /// Events read.
    pub events: u64,
}

impl Timeline {
    /// The timeline of a stream (owned or borrowed events).
    pub fn from_events<E: Borrow<Event>>(events: impl IntoIterator<Item = E>) -> Self {
        let mut tl = Timeline::default();
        let mut b = TimelineBuilder::new();
        for e in events {
            b.observe(e.borrow(), |item| tl.push(item));
        }
        tl.time_range = b.time_range();
        tl.events = b.events();
        b.finish(|item| tl.push(item));
        tl.intervals
            .sort_by_key(|i| (i.track, i.start_ns, i.end_ns, i.open));
        tl.transfers.sort_by_key(|t| (t.planned_ns, t.transfer));
        tl
    }

    fn push(&mut self, item: TimelineItem) {
        match item {
            TimelineItem::Track { track, request } => self.tracks.push((track, request)),
            TimelineItem::Interval(i) => self.intervals.push(i),
            TimelineItem::Transfer(t) => self.transfers.push(t),
            TimelineItem::FirstToken {
                track,
                ts_ns,
                ttft_ns,
                ..
            } => self.first_tokens.push((track, ts_ns, ttft_ns)),
            TimelineItem::Breakpoint(b) => self.breakpoints.push(b),
        }
    }

    /// The intervals of one request, oldest first.
    pub fn intervals_of<'a>(&'a self, request: &'a str) -> impl Iterator<Item = &'a StateInterval> {
        self.intervals
            .iter()
            .filter(move |i| &*i.request == request)
    }

    /// The transfers one request planned.
    pub fn transfers_of<'a>(&'a self, request: &'a str) -> impl Iterator<Item = &'a TransferSpan> {
        self.transfers
            .iter()
            .filter(move |t| t.request.as_deref() == Some(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testutil::{Stream, arb_events};
    use SlotState::*;
    use kvbm_events::tier::Tier;
    use proptest::prelude::*;

    #[test]
    fn intervals_follow_the_reducer() {
        let mut s = Stream::new();
        s.at(100).create("a", 32);
        s.at(200).to("a", Initialized, Prefilling);
        s.at(250).to("a", Prefilling, Prefilling); // re-announced: same interval
        s.at(300).tokens("a", 32, 1);
        s.at(400).to("a", Prefilling, Decoding);
        s.at(500).create("b", 16);
        s.at(900).to("a", Decoding, Finishing);
        s.at(1000).to("a", Finishing, Finished);
        s.at(1100).to("b", Initialized, Prefilling);
        let tl = Timeline::from_events(s.events());
        let a: Vec<_> = tl
            .intervals_of("a")
            .map(|i| (i.state, i.start_ns, i.end_ns, i.open))
            .collect();
        assert_eq!(
            a,
            [
                (Initialized, 100, 200, false),
                (Prefilling, 200, 400, false),
                (Decoding, 400, 900, false),
                (Finishing, 900, 1000, false),
            ]
        );
        let b: Vec<_> = tl
            .intervals_of("b")
            .map(|i| (i.state, i.start_ns, i.end_ns, i.open))
            .collect();
        assert_eq!(
            b,
            [
                (Initialized, 500, 1100, false),
                (Prefilling, 1100, 1100, true)
            ]
        );
        assert_eq!(tl.tracks.len(), 2);
        assert_eq!((tl.tracks[0].0, &*tl.tracks[0].1), (1, "a"));
        assert_eq!(tl.first_tokens, [(1, 300, 200)]);
        assert_eq!(tl.time_range, Some((100, 1100)));
    }

    #[test]
    fn transfer_spans_from_plan_to_terminal() {
        let mut s = Stream::new();
        s.at(0).create("a", 32);
        s.at(10).plan("a", 7, Direction::DEVICE_TO_HOST, 2);
        s.at(20).plan("a", 8, Direction::HOST_TO_DEVICE, 1);
        s.at(30).promote("a", 7, Direction::DEVICE_TO_HOST, 2);
        s.at(35).batch(1, Direction::DEVICE_TO_HOST, &[7], 2);
        s.at(70).complete("a", 7, Direction::DEVICE_TO_HOST, 2);
        s.at(80)
            .skip("a", 8, Direction::HOST_TO_DEVICE, "AlreadyPresent");
        s.at(90).plan("a", 9, Direction::DEVICE_TO_HOST, 1);
        s.at(95).complete("a", 1234, Direction::DEVICE_TO_HOST, 1); // unknown id
        let tl = Timeline::from_events(s.events());
        let spans: Vec<_> = tl
            .transfers
            .iter()
            .map(|t| {
                (
                    t.transfer,
                    t.planned_ns,
                    t.promoted_ns,
                    t.end_ns,
                    t.status.name(),
                    t.batch,
                    t.open,
                )
            })
            .collect();
        assert_eq!(
            spans,
            [
                (7, 10, Some(30), 70, "Completed", Some(1), false),
                (8, 20, None, 80, "Skipped", None, false),
                (9, 90, None, 95, "PendingEvaluation", None, true),
            ]
        );
        assert!(tl.transfers.iter().all(|t| t.track == Some(1)));
    }

    #[test]
    fn a_reused_request_keeps_its_track_and_stale_events_are_skipped() {
        let mut s = Stream::new();
        s.at(0).create("a", 16);
        s.at(5).to("a", Initialized, Finished);
        s.at(10).create("a", 16);
        // A duplicate delivery of an old event: the reducer skips it.
        let mut dup = s.events()[1].clone();
        dup.ts_ns = 11;
        s.raw(dup);
        s.at(20).to("a", Initialized, Prefilling);
        let tl = Timeline::from_events(s.events());
        assert_eq!(tl.tracks.len(), 1);
        let a: Vec<_> = tl
            .intervals_of("a")
            .map(|i| (i.state, i.start_ns, i.end_ns))
            .collect();
        assert_eq!(
            a,
            [
                (Initialized, 0, 5),
                (Initialized, 10, 20),
                (Prefilling, 20, 20)
            ]
        );
        let _ = Tier::Device;
    }

    #[test]
    fn breakpoints_are_marked() {
        let mut s = Stream::new();
        s.at(0).create("a", 16);
        s.at(5).breakpoint(Some("a"), 3);
        s.at(6).breakpoint(None, 4);
        let tl = Timeline::from_events(s.events());
        let marks: Vec<_> = tl
            .breakpoints
            .iter()
            .map(|b| (b.breakpoint, b.track, b.ts_ns))
            .collect();
        assert_eq!(marks, [(3, 1, 5), (4, 0, 6)]);
    }

    proptest! {
        #[test]
        fn never_panics_and_intervals_are_well_formed(events in arb_events(60)) {
            let tl = Timeline::from_events(&events);
            for i in &tl.intervals {
                prop_assert!(i.start_ns <= i.end_ns);
                prop_assert!(!i.state.is_terminal());
            }
            for t in &tl.transfers {
                prop_assert!(t.planned_ns <= t.end_ns);
                prop_assert_eq!(t.open, !t.status.is_terminal());
            }
        }
    }
}
