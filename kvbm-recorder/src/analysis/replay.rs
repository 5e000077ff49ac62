//! Replay: feed a recorded stream back through the reducer — as fast as
//! possible, in real time × speed, or one event at a time — and look at the
//! engine's state at any point, as the live console would have shown it.
//!
//! A [`Replayer`] reads from an [`EventSource`]: anything that can
//! (re)open an iterator of events — a log file (the log layer implements
//! the trait, or passes a closure through [`FnSource`]), a ring buffer's
//! snapshot or any vector ([`VecSource`]), or a one-shot iterator
//! ([`OnceSource`], which cannot seek backwards). Each event is applied to a
//! [`kvbm_events::reducer::EngineState`], the same reducer the live path uses,
//! so the state after event *n* of a replay is the state the console had
//! after event *n* live.
//!
//! # Modes
//!
//! - [`ReplayMode::AsFastAsPossible`]: [`Replayer::advance`] applies every
//!   remaining event.
//! - [`ReplayMode::RealTime`]: the same, but before each event the replayer
//!   waits until `(ts − ts_anchor) / speed` has elapsed since the anchor
//!   (the first event replayed after a start, seek or mode change). Waits
//!   are measured from the anchor, not from the previous event, so sleep
//!   overshoot does not accumulate. `speed` is clamped to
//!   [`MIN_SPEED`]..=[`MAX_SPEED`]. Time comes from a [`Pacer`]: the real
//!   clock ([`RealPacer`]) or a hand-driven one ([`ManualPacer`]) for tests.
//! - [`ReplayMode::Step`]: [`Replayer::advance`] applies exactly one event.
//!
//! [`Replayer::next_event`] applies one event in any mode (paced in
//! real-time mode); [`Replayer::step`] applies one without pacing.
//!
//! # Seeking
//!
//! [`seek_to_seq`](Replayer::seek_to_seq),
//! [`seek_to_time`](Replayer::seek_to_time) and
//! [`seek_to_position`](Replayer::seek_to_position) go forward from where
//! the replay is when they can, and otherwise reopen the source and re-fold
//! from the first event: O(events up to the target) — a snapshot-based seek
//! (the durable log's periodic reducer snapshots) will replace the re-fold
//! later without changing this interface. [`step_back`](Replayer::step_back)
//! is a seek to the previous position, so it re-folds too: stepping back
//! through a stream of *n* events one by one costs O(n²) event applications;
//! it is meant for a person pressing a key, not for loops.

use kvbm_events::Event;
use kvbm_events::reducer::EngineState;
use std::error::Error;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Slowest accepted real-time speed.
pub const MIN_SPEED: f64 = 0.01;
/// Fastest accepted real-time speed.
pub const MAX_SPEED: f64 = 1000.0;

/// Clamps a speed into [`MIN_SPEED`]..=[`MAX_SPEED`]; NaN becomes 1.
pub fn clamp_speed(speed: f64) -> f64 {
    if speed.is_nan() {
        1.0
    } else {
        speed.clamp(MIN_SPEED, MAX_SPEED)
    }
}

/// How [`Replayer::advance`] moves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReplayMode {
    /// Every remaining event, without waiting.
    AsFastAsPossible,
    /// Every remaining event, paced by the events' timestamps / `speed`.
    RealTime {
        /// 1.0 is real time, 2.0 twice as fast (clamped when used).
        speed: f64,
    },
    /// One event per call.
    Step,
}

impl ReplayMode {
    /// Real time at `speed`, clamped.
    pub fn real_time(speed: f64) -> Self {
        ReplayMode::RealTime {
            speed: clamp_speed(speed),
        }
    }
}

/// Replay failures (only opening or reopening a source can fail).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The source can be read once only, and a seek needed to go back.
    #[error("this event source cannot be rewound (seeking backwards needs a reopenable source)")]
    NotRewindable,
    /// The source failed to open.
    #[error("opening the event source failed: {0}")]
    Source(#[source] Box<dyn Error + Send + Sync>),
}

/// Something a replay can read from the start, again and again.
pub trait EventSource {
    /// The events, in stream order.
    type Iter: Iterator<Item = Event>;
    /// Opens the stream at its first event.
    fn open(&mut self) -> Result<Self::Iter, ReplayError>;
}

/// Events held in memory (a ring buffer's snapshot, a test's stream);
/// reopening is free.
#[derive(Debug, Clone)]
pub struct VecSource(Arc<[Event]>);

impl VecSource {
    /// A source over these events.
    pub fn new(events: impl Into<Arc<[Event]>>) -> Self {
        VecSource(events.into())
    }
}

impl From<Vec<Event>> for VecSource {
    fn from(v: Vec<Event>) -> Self {
        VecSource::new(v)
    }
}

/// Iterator of a [`VecSource`].
#[derive(Debug, Clone)]
pub struct VecIter {
    events: Arc<[Event]>,
    pos: usize,
}

impl Iterator for VecIter {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        let e = self.events.get(self.pos)?.clone();
        self.pos += 1;
        Some(e)
    }
}

impl EventSource for VecSource {
    type Iter = VecIter;
    fn open(&mut self) -> Result<VecIter, ReplayError> {
        Ok(VecIter {
            events: self.0.clone(),
            pos: 0,
        })
    }
}

/// A source that reopens by calling a closure (a log reader opening its
/// file again).
pub struct FnSource<F>(pub F);

impl<F> fmt::Debug for FnSource<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnSource")
    }
}

impl<F, I, E> EventSource for FnSource<F>
where
    F: FnMut() -> Result<I, E>,
    I: Iterator<Item = Event>,
    E: Into<Box<dyn Error + Send + Sync>>,
{
    type Iter = I;
    fn open(&mut self) -> Result<I, ReplayError> {
        (self.0)().map_err(|e| ReplayError::Source(e.into()))
    }
}

/// A one-shot iterator: replays forward, cannot seek backwards.
#[derive(Debug)]
pub struct OnceSource<I>(Option<I>);

impl<I: Iterator<Item = Event>> OnceSource<I> {
    /// A source over `iter`.
    pub fn new(iter: impl IntoIterator<IntoIter = I>) -> Self {
        OnceSource(Some(iter.into_iter()))
    }
}

impl<I: Iterator<Item = Event>> EventSource for OnceSource<I> {
    type Iter = I;
    fn open(&mut self) -> Result<I, ReplayError> {
        self.0.take().ok_or(ReplayError::NotRewindable)
    }
}

/// Where real-time pacing gets its time and how it waits.
pub trait Pacer {
    /// Time since some fixed origin.
    fn now(&self) -> Duration;
    /// Waits for `d`.
    fn sleep(&mut self, d: Duration);
}

/// The real monotonic clock and `thread::sleep`.
#[derive(Debug, Clone, Copy)]
pub struct RealPacer(Instant);

impl Default for RealPacer {
    fn default() -> Self {
        RealPacer(Instant::now())
    }
}

impl Pacer for RealPacer {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
    fn sleep(&mut self, d: Duration) {
        std::thread::sleep(d);
    }
}

/// A clock that only moves when slept on (or by hand): tests see the
/// waits without waiting.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ManualPacer {
    /// The current time.
    pub now: Duration,
    /// Sleeps requested.
    pub sleeps: u64,
    /// Their total.
    pub slept: Duration,
    /// The last one.
    pub last_sleep: Option<Duration>,
}

impl Pacer for ManualPacer {
    fn now(&self) -> Duration {
        self.now
    }
    fn sleep(&mut self, d: Duration) {
        self.sleeps += 1;
        self.slept = self.slept.saturating_add(d);
        self.now = self.now.saturating_add(d);
        self.last_sleep = Some(d);
    }
}

/// A replay over a source; see the module docs.
pub struct Replayer<S: EventSource, P: Pacer = RealPacer> {
    source: S,
    iter: S::Iter,
    lookahead: Option<Event>,
    state: EngineState,
    mode: ReplayMode,
    pacer: P,
    max_sleep: Option<Duration>,
    /// Events taken from the source since it was opened.
    position: u64,
    last: Option<Event>,
    /// Largest seq and ts taken so far, to know whether a seek can go
    /// forward.
    max_seq: Option<u64>,
    max_ts: Option<u64>,
    /// `(event ts, pacer time)` that real-time waits are measured from.
    anchor: Option<(u64, Duration)>,
}

impl<S: EventSource, P: Pacer> fmt::Debug for Replayer<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Replayer")
            .field("mode", &self.mode)
            .field("position", &self.position)
            .field("last_seq", &self.last.as_ref().map(|e| e.seq))
            .finish()
    }
}

impl Replayer<VecSource, RealPacer> {
    /// A replay of events held in memory, paced by the real clock.
    pub fn from_events(events: impl Into<Arc<[Event]>>, mode: ReplayMode) -> Self {
        let source = VecSource::new(events);
        let iter = VecIter {
            events: source.0.clone(),
            pos: 0,
        };
        Self::build(source, iter, mode, RealPacer::default())
    }
}

impl<S: EventSource> Replayer<S, RealPacer> {
    /// A replay of `source`, paced by the real clock.
    pub fn new(source: S, mode: ReplayMode) -> Result<Self, ReplayError> {
        Self::with_pacer(source, mode, RealPacer::default())
    }
}

impl<S: EventSource, P: Pacer> Replayer<S, P> {
    /// A replay of `source` paced by `pacer`.
    pub fn with_pacer(mut source: S, mode: ReplayMode, pacer: P) -> Result<Self, ReplayError> {
        let iter = source.open()?;
        Ok(Self::build(source, iter, mode, pacer))
    }

    fn build(source: S, iter: S::Iter, mode: ReplayMode, pacer: P) -> Self {
        Replayer {
            source,
            iter,
            lookahead: None,
            state: EngineState::new(),
            mode: normalise(mode),
            pacer,
            max_sleep: None,
            position: 0,
            last: None,
            max_seq: None,
            max_ts: None,
            anchor: None,
        }
    }

    /// The engine state after the events applied so far.
    pub fn state(&self) -> &EngineState {
        &self.state
    }

    /// The mode.
    pub fn mode(&self) -> ReplayMode {
        self.mode
    }

    /// Changes the mode (a real-time speed is clamped); pacing restarts from
    /// the next event.
    pub fn set_mode(&mut self, mode: ReplayMode) {
        self.mode = normalise(mode);
        self.anchor = None;
    }

    /// Caps a single real-time wait (an idle stretch of the recording is
    /// then shortened to the cap); `None`, the default, waits as long as the
    /// timestamps say.
    pub fn set_max_sleep(&mut self, max: Option<Duration>) {
        self.max_sleep = max;
    }

    /// The pacer (a [`ManualPacer`] shows the waits).
    pub fn pacer(&self) -> &P {
        &self.pacer
    }

    /// Events taken from the source so far (applied, or skipped by the
    /// reducer as stale or foreign).
    pub fn position(&self) -> u64 {
        self.position
    }

    /// The last event taken.
    pub fn last_event(&self) -> Option<&Event> {
        self.last.as_ref()
    }

    /// The next event, without taking it.
    pub fn peek(&mut self) -> Option<&Event> {
        if self.lookahead.is_none() {
            self.lookahead = self.iter.next();
        }
        self.lookahead.as_ref()
    }

    /// True when no event is left.
    pub fn is_at_end(&mut self) -> bool {
        self.peek().is_none()
    }

    fn take(&mut self) -> Option<Event> {
        self.lookahead.take().or_else(|| self.iter.next())
    }

    fn apply(&mut self, ev: Event) -> Option<&Event> {
        self.state.apply(&ev);
        self.position += 1;
        self.max_seq = Some(self.max_seq.map_or(ev.seq, |m| m.max(ev.seq)));
        self.max_ts = Some(self.max_ts.map_or(ev.ts_ns, |m| m.max(ev.ts_ns)));
        self.last = Some(ev);
        self.last.as_ref()
    }

    /// Applies the next event without waiting, whatever the mode.
    pub fn step(&mut self) -> Option<&Event> {
        let ev = self.take()?;
        self.anchor = None;
        self.apply(ev)
    }

    /// Applies the next event, waiting for it first in real-time mode.
    pub fn next_event(&mut self) -> Option<&Event> {
        let ev = self.take()?;
        if let ReplayMode::RealTime { speed } = self.mode {
            self.pace(ev.ts_ns, speed);
        }
        self.apply(ev)
    }

    fn pace(&mut self, ts: u64, speed: f64) {
        let Some((a_ts, a_wall)) = self.anchor else {
            self.anchor = Some((ts, self.pacer.now()));
            return;
        };
        // Timestamps going backwards wait for nothing.
        let offset_ns = ts.saturating_sub(a_ts) as f64 / speed;
        // `as` saturates at u64::MAX for huge values.
        let offset = Duration::from_nanos(offset_ns as u64);
        let target = a_wall.checked_add(offset).unwrap_or(Duration::MAX);
        let wait = target.saturating_sub(self.pacer.now());
        if wait.is_zero() {
            return;
        }
        match self.max_sleep {
            Some(max) if wait > max => {
                self.pacer.sleep(max);
                // The rest of the idle stretch is skipped: pace on from here.
                self.anchor = Some((ts, self.pacer.now()));
            }
            _ => self.pacer.sleep(wait),
        }
    }

    /// Moves as the mode says: every remaining event (paced in real time),
    /// or one in step mode. Returns the number applied.
    pub fn advance(&mut self) -> u64 {
        if self.mode == ReplayMode::Step {
            return u64::from(self.step().is_some());
        }
        let mut n = 0;
        while self.next_event().is_some() {
            n += 1;
        }
        n
    }

    /// Back to before the first event: reopens the source, fresh state.
    pub fn rewind(&mut self) -> Result<(), ReplayError> {
        self.iter = self.source.open()?;
        self.lookahead = None;
        self.state = EngineState::new();
        self.position = 0;
        self.last = None;
        self.max_seq = None;
        self.max_ts = None;
        self.anchor = None;
        Ok(())
    }

    /// Applies events, without waiting, while `keep(next event)` holds.
    fn forward_while(&mut self, mut keep: impl FnMut(&Event) -> bool) {
        while self.peek().is_some_and(&mut keep) {
            self.step();
        }
        self.anchor = None;
    }

    /// The state after every event up to (not including) the first one
    /// whose sequence number is above `seq`.
    pub fn seek_to_seq(&mut self, seq: u64) -> Result<(), ReplayError> {
        if self.max_seq.is_some_and(|m| m > seq) {
            self.rewind()?;
        }
        self.forward_while(|e| e.seq <= seq);
        Ok(())
    }

    /// The state after every event up to (not including) the first one
    /// stamped after `ts_ns`.
    pub fn seek_to_time(&mut self, ts_ns: u64) -> Result<(), ReplayError> {
        if self.max_ts.is_some_and(|m| m > ts_ns) {
            self.rewind()?;
        }
        self.forward_while(|e| e.ts_ns <= ts_ns);
        Ok(())
    }

    /// The state after exactly `position` events (or all of them, if the
    /// stream is shorter).
    pub fn seek_to_position(&mut self, position: u64) -> Result<(), ReplayError> {
        if position < self.position {
            self.rewind()?;
        }
        while self.position < position && self.step().is_some() {}
        self.anchor = None;
        Ok(())
    }

    /// Undoes the last event by re-folding from the start to the position
    /// before it (see the module docs for the cost). False at the start.
    pub fn step_back(&mut self) -> Result<bool, ReplayError> {
        match self.position {
            0 => Ok(false),
            p => self.seek_to_position(p - 1).map(|()| true),
        }
    }
}

fn normalise(mode: ReplayMode) -> ReplayMode {
    match mode {
        ReplayMode::RealTime { speed } => ReplayMode::real_time(speed),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testutil::{Stream, arb_events};
    use kvbm_events::reducer::fold;
    use kvbm_events::slot::SlotState;
    use proptest::prelude::*;

    fn stream() -> Vec<Event> {
        let mut s = Stream::new();
        s.at(1_000_000).life("a", 1);
        s.at(5_000_000).life("b", 2);
        s.into_events()
    }

    #[test]
    fn as_fast_as_possible_equals_a_fold() {
        let ev = stream();
        let mut r = Replayer::from_events(ev.clone(), ReplayMode::AsFastAsPossible);
        assert_eq!(r.advance(), ev.len() as u64);
        assert_eq!(r.state(), &fold(&ev));
        assert!(r.is_at_end());
        assert_eq!(r.advance(), 0);
        assert_eq!(r.last_event(), ev.last());
    }

    #[test]
    fn step_mode_advances_one_event_per_call() {
        let ev = stream();
        let mut r = Replayer::from_events(ev.clone(), ReplayMode::Step);
        for (i, e) in ev.iter().enumerate() {
            assert_eq!(r.peek(), Some(e));
            assert_eq!(r.advance(), 1);
            assert_eq!(r.position(), i as u64 + 1);
            assert_eq!(r.state(), &fold(&ev[..=i]));
        }
        assert_eq!(r.advance(), 0);
    }

    #[test]
    fn real_time_waits_for_the_timestamps_over_speed() {
        let ev = stream();
        let span = ev.last().unwrap().ts_ns - ev[0].ts_ns;
        for speed in [1.0, 4.0, 0.5] {
            let mut r = Replayer::with_pacer(
                VecSource::from(ev.clone()),
                ReplayMode::RealTime { speed },
                ManualPacer::default(),
            )
            .unwrap();
            r.advance();
            let want = Duration::from_nanos((span as f64 / speed) as u64);
            let got = r.pacer().now;
            let diff = got.abs_diff(want);
            assert!(
                diff <= Duration::from_nanos(2),
                "speed {speed}: {got:?} vs {want:?}"
            );
            assert_eq!(r.state(), &fold(&ev));
        }
    }

    #[test]
    fn real_time_waits_are_measured_from_the_anchor() {
        // A pacer whose clock ran ahead (the replay was slow): no wait
        // until the timestamps catch up, and no drift afterwards.
        let ev = stream();
        let mut r = Replayer::with_pacer(
            VecSource::from(ev.clone()),
            ReplayMode::real_time(1.0),
            ManualPacer::default(),
        )
        .unwrap();
        r.next_event();
        r.pacer.now += Duration::from_millis(2); // 2 ms lost elsewhere
        // The events of "a" span 60 ns after the first: no waits.
        for _ in 0..12 {
            r.next_event();
        }
        assert_eq!(r.pacer().sleeps, 0);
        // "b" starts 4 ms after "a": only the remaining ~2 ms is waited.
        r.next_event();
        let last = r.pacer().last_sleep.unwrap();
        assert_eq!(
            last,
            Duration::from_nanos(5_000_000 - 1_000_000 - 2_000_000)
        );
    }

    #[test]
    fn speed_is_clamped_and_long_idle_stretches_can_be_capped() {
        assert_eq!(clamp_speed(0.0), MIN_SPEED);
        assert_eq!(clamp_speed(1e9), MAX_SPEED);
        assert_eq!(clamp_speed(f64::NAN), 1.0);
        assert_eq!(clamp_speed(f64::NEG_INFINITY), MIN_SPEED);
        let ev = stream();
        let mut r = Replayer::with_pacer(
            VecSource::from(ev.clone()),
            ReplayMode::RealTime { speed: 1e-9 },
            ManualPacer::default(),
        )
        .unwrap();
        assert_eq!(r.mode(), ReplayMode::RealTime { speed: MIN_SPEED });
        r.set_max_sleep(Some(Duration::from_millis(1)));
        r.advance();
        // Every wait was capped at 1 ms.
        assert!(r.pacer().last_sleep.unwrap() <= Duration::from_millis(1));
        assert!(r.pacer().slept <= Duration::from_millis(ev.len() as u64));
    }

    #[test]
    fn seeking_by_seq_time_and_position_refolds() {
        let ev = stream();
        let mut r = Replayer::from_events(ev.clone(), ReplayMode::Step);
        r.seek_to_seq(5).unwrap();
        assert_eq!(r.state(), &fold(&ev[..6]));
        assert_eq!(r.peek().map(|e| e.seq), Some(6));
        // Forward: continues.
        r.seek_to_seq(9).unwrap();
        assert_eq!(r.state(), &fold(&ev[..10]));
        // Backward: re-folds.
        r.seek_to_seq(2).unwrap();
        assert_eq!(r.state(), &fold(&ev[..3]));
        assert_eq!(r.position(), 3);
        // By time: everything up to a's Finished at 1_000_060.
        r.seek_to_time(1_000_060).unwrap();
        assert_eq!(
            r.state().slot("a").map(|s| s.state),
            Some(SlotState::Finished)
        );
        assert!(r.state().slot("b").is_none());
        r.seek_to_time(0).unwrap();
        assert_eq!(r.position(), 0);
        // Step back from the end, one event at a time.
        r.seek_to_position(u64::MAX).unwrap();
        assert_eq!(r.position(), ev.len() as u64);
        for n in (0..ev.len()).rev() {
            assert!(r.step_back().unwrap());
            assert_eq!(r.state(), &fold(&ev[..n]));
            assert_eq!(r.last_event(), n.checked_sub(1).map(|i| &ev[i]));
        }
        assert!(!r.step_back().unwrap());
    }

    #[test]
    fn a_one_shot_source_cannot_seek_back_but_can_go_forward() {
        let ev = stream();
        let mut r = Replayer::new(OnceSource::new(ev.clone()), ReplayMode::Step).unwrap();
        r.seek_to_seq(4).unwrap();
        r.seek_to_seq(8).unwrap();
        assert_eq!(r.state(), &fold(&ev[..9]));
        assert!(matches!(r.seek_to_seq(1), Err(ReplayError::NotRewindable)));
        assert!(matches!(r.step_back(), Err(ReplayError::NotRewindable)));
    }

    #[test]
    fn a_closure_source_reopens_and_reports_failures() {
        let ev = stream();
        let mut opened = 0;
        let src = FnSource(move || {
            opened += 1;
            if opened > 2 {
                Err(std::io::Error::other("file gone"))
            } else {
                Ok(ev.clone().into_iter())
            }
        });
        let mut r = Replayer::new(src, ReplayMode::AsFastAsPossible).unwrap();
        r.advance();
        r.rewind().unwrap();
        r.step();
        let err = r.rewind().unwrap_err();
        assert!(err.to_string().contains("file gone"), "{err}");
    }

    proptest! {
        #[test]
        fn any_stream_replays_to_the_fold(events in arb_events(40), back in 0usize..40) {
            let mut r = Replayer::with_pacer(
                VecSource::from(events.clone()),
                ReplayMode::RealTime { speed: 1000.0 },
                ManualPacer::default(),
            ).unwrap();
            r.set_max_sleep(Some(Duration::from_secs(1)));
            r.advance();
            prop_assert_eq!(r.state(), &fold(&events));
            let target = events.len().saturating_sub(back);
            r.seek_to_position(target as u64).unwrap();
            prop_assert_eq!(r.state(), &fold(&events[..target]));
        }
    }
}
