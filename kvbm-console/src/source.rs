//! Where the console's events come from: a live engine (through the
//! recorder's ring buffer) or a recorded log (replayed with play/pause,
//! speed, seek and step). A live engine may take breakpoint commands: its
//! [`Control`] (the engine's own `Breakpoints`, or a remote one) travels
//! with its source.

use crate::model::{Model, ModelConfig};
use kvbm_events::Event;
use kvbm_events::control::Control;
use kvbm_events::ring::{RingBuffer, RingCounters};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where the console's events come from.
pub enum Source {
    /// A live engine.
    Live(LiveSource),
    /// A recorded log.
    Replay(ReplaySource),
    /// Nothing: the model is fed by the caller (tests, benchmarks).
    Fixed,
}

impl Source {
    /// Pulls new events into `model` (a replay: those due at `now`).
    pub fn pull(&mut self, model: &mut Model, now: Instant) -> usize {
        match self {
            Source::Live(l) => l.pull(model),
            Source::Replay(r) => r.pull(model, now),
            Source::Fixed => 0,
        }
    }

    /// The engine's breakpoint control, if it takes commands.
    pub fn control(&self) -> Option<&Arc<dyn Control>> {
        match self {
            Source::Live(l) => l.control(),
            _ => None,
        }
    }

    /// The header's mode badge at `now`: `FROZEN +n` while a live view is
    /// frozen, else its link's state (or `LIVE`); `REPLAY ▶ 2× 40%`;
    /// `SNAPSHOT`.
    pub fn badge(&self, now: Instant) -> Badge {
        match self {
            Source::Live(l) if l.frozen() => Badge::new(
                format!("FROZEN +{}", crate::fmt::count(l.behind())),
                Tone::Caution,
            ),
            Source::Live(l) => l
                .link
                .as_ref()
                .map_or_else(|| Badge::new("LIVE", Tone::Ok), |k| k.badge(now)),
            Source::Replay(r) => {
                let icon = if r.playing() { "▶" } else { "⏸" };
                let pct = if r.is_empty() {
                    100.0
                } else {
                    r.position() as f64 * 100.0 / r.len() as f64
                };
                Badge::new(
                    format!("REPLAY {icon} {}× {:.0}%", r.speed(), pct),
                    Tone::Replay,
                )
            }
            Source::Fixed => Badge::new("SNAPSHOT", Tone::Still),
        }
    }

    /// Events the console missed: overwritten in a live ring before they
    /// were read (0 otherwise).
    pub fn lagged(&self) -> u64 {
        match self {
            Source::Live(l) => l.lagged(),
            _ => 0,
        }
    }

    /// Events lost before the console could see them: dropped by the
    /// engine's bus, by a remote stream, or by the recording.
    pub fn dropped(&self) -> u64 {
        match self {
            Source::Live(l) => l.counters().lost,
            Source::Replay(r) => r.lost(),
            Source::Fixed => 0,
        }
    }

    /// What the engine runs as, in one line (e.g. `vLLM · tp 2 · async
    /// scheduling · G2 8,192 tokens (4.0 MiB a rank) · G3 none`), when
    /// known: from the link (an attach server's hello), the source's
    /// own (the demo), or the recording's sidecar. The header shows it.
    pub fn engine_summary(&self) -> Option<String> {
        match self {
            Source::Live(l) => l
                .link
                .as_ref()
                .and_then(|k| k.engine_summary())
                .or_else(|| l.engine_summary.clone()),
            Source::Replay(r) => r.engine_summary.clone(),
            Source::Fixed => None,
        }
    }

    /// Why the source has no per-request slots, when it has none.
    pub fn no_slots_reason(&self) -> Option<&str> {
        match self {
            Source::Live(l) => l.no_slots_reason.as_deref(),
            _ => None,
        }
    }
}

/// A source's mode badge, for the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Badge {
    /// Its text, e.g. `LIVE`.
    pub text: String,
    /// How it is coloured.
    pub tone: Tone,
}

impl Badge {
    /// A badge.
    pub fn new(text: impl Into<String>, tone: Tone) -> Self {
        Badge {
            text: text.into(),
            tone,
        }
    }
}

/// What a badge's colour says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tone {
    /// Live and well.
    Ok,
    /// Frozen, or (re)connecting.
    Caution,
    /// Failed or stopped.
    Down,
    /// A replay.
    Replay,
    /// A fixed snapshot.
    Still,
}

/// How a live source reaches an engine outside this process (an attach
/// connection, a ZMQ subscription): its badge replaces `LIVE`.
pub trait Link: Send + Sync {
    /// The badge at `now`.
    fn badge(&self, now: Instant) -> Badge;

    /// Ring positions where a new engine run begins (the engine
    /// restarted), ascending: the model starts afresh at each, so two runs
    /// are never folded into one state. None by default.
    fn run_starts(&self) -> Vec<u64> {
        Vec::new()
    }

    /// What the engine at the other end runs as, in one line, once known
    /// (see [`Source::engine_summary`]). None by default.
    fn engine_summary(&self) -> Option<String> {
        None
    }
}

/// Most events applied per pull, so one pull never holds up input or
/// drawing for long; the rest come on the next pull.
pub const MAX_PULL: usize = 200_000;

/// A live engine's events, read from the recorder's ring.
pub struct LiveSource {
    ring: Arc<RingBuffer>,
    cursor: u64,
    lagged: u64,
    frozen: bool,
    control: Option<Arc<dyn Control>>,
    counters: RingCounters,
    link: Option<Arc<dyn Link>>,
    no_slots_reason: Option<String>,
    /// What the engine runs as, when the source itself knows (not its
    /// link).
    engine_summary: Option<String>,
    /// Run starts not applied yet (ring positions, ascending), and the
    /// last one seen.
    run_starts: std::collections::VecDeque<u64>,
    last_run_start: Option<u64>,
    runs_started: u64,
}

impl LiveSource {
    /// Reads `ring` from its oldest event on.
    pub fn new(ring: Arc<RingBuffer>, control: Option<Arc<dyn Control>>) -> Self {
        let counters = ring.counters();
        LiveSource {
            cursor: counters.oldest_position(),
            ring,
            lagged: 0,
            frozen: false,
            control,
            counters,
            link: None,
            no_slots_reason: None,
            engine_summary: None,
            run_starts: Default::default(),
            last_run_start: None,
            runs_started: 0,
        }
    }

    /// Reached through `link`, whose badge the header shows.
    pub fn with_link(mut self, link: Arc<dyn Link>) -> Self {
        self.link = Some(link);
        self
    }

    /// An engine that runs as `summary` (one line, for the header), when
    /// no link says otherwise: an engine in this process.
    pub fn with_engine_summary(mut self, summary: impl Into<String>) -> Self {
        self.engine_summary = Some(summary.into());
        self
    }

    /// A source without per-request slots (vLLM KV events): the Slots
    /// view says `reason` instead of "no requests yet".
    pub fn without_slots(mut self, reason: impl Into<String>) -> Self {
        self.no_slots_reason = Some(reason.into());
        self
    }

    /// Applies what arrived since the last pull (nothing while frozen: the
    /// events wait in the ring, and whatever the ring overwrites meanwhile
    /// is counted as lagged). Where a new engine run begins (the link
    /// says), the model starts afresh before that run's first event.
    pub fn pull(&mut self, model: &mut Model) -> usize {
        self.counters = self.ring.counters();
        if self.frozen {
            return 0;
        }
        if let Some(link) = &self.link {
            for s in link.run_starts() {
                if self.last_run_start.is_none_or(|l| s > l) {
                    self.run_starts.push_back(s);
                    self.last_run_start = Some(s);
                }
            }
        }
        let mut n = 0;
        while n < MAX_PULL {
            let read = self.ring.read_at_most(self.cursor, MAX_PULL - n);
            self.lagged += read.missed;
            self.cursor = read.next;
            self.counters = read.counters;
            let caught_up = read.caught_up();
            n += read.events.len();
            let first = read.next - read.events.len() as u64;
            for (i, ev) in read.events.into_iter().enumerate() {
                let pos = first + i as u64;
                while self.run_starts.front().is_some_and(|&s| s <= pos) {
                    self.run_starts.pop_front();
                    *model = Model::new(*model.config());
                    self.runs_started += 1;
                }
                model.apply(ev);
            }
            if caught_up || n == 0 {
                break;
            }
        }
        n
    }

    /// Times the model started afresh for a new engine run.
    pub fn runs_started(&self) -> u64 {
        self.runs_started
    }

    /// Freezes or unfreezes the view.
    pub fn set_frozen(&mut self, frozen: bool) {
        self.frozen = frozen;
    }

    /// Whether the view is frozen.
    pub fn frozen(&self) -> bool {
        self.frozen
    }

    /// Events the console missed: the ring overwrote them before they were
    /// read.
    pub fn lagged(&self) -> u64 {
        self.lagged
    }

    /// Events in the ring not yet shown.
    pub fn behind(&self) -> u64 {
        self.counters.pushed.saturating_sub(self.cursor)
    }

    /// The ring's counters at the last pull (`lost`: dropped by the bus
    /// before the recorder saw them).
    pub fn counters(&self) -> RingCounters {
        self.counters
    }

    /// The engine's breakpoint control, if it takes commands.
    pub fn control(&self) -> Option<&Arc<dyn Control>> {
        self.control.as_ref()
    }
}

/// Slowest and fastest replay speeds.
pub const SPEEDS: (f64, f64) = (0.25, 64.0);

/// How far a seek moves, engine ns.
pub const SEEK_NS: u64 = 10_000_000_000;

/// A recorded log, replayed into a [`Model`].
pub struct ReplaySource {
    events: Arc<[Event]>,
    pos: usize,
    playing: bool,
    speed: f64,
    /// `(engine ts, wall instant)` that playback is measured from.
    anchor: Option<(u64, Instant)>,
    checkpoints: Vec<(usize, Model)>,
    checkpoint_every: usize,
    lost: u64,
    engine_summary: Option<String>,
}

impl ReplaySource {
    /// A replay of `events` (in log order), `lost` of which the recording
    /// itself dropped. Starts paused at the beginning.
    pub fn new(events: Arc<[Event]>, lost: u64, model_cfg: ModelConfig) -> Self {
        ReplaySource {
            events,
            pos: 0,
            playing: false,
            speed: 1.0,
            anchor: None,
            checkpoints: vec![(0, Model::new(model_cfg))],
            checkpoint_every: 100_000,
            lost,
            engine_summary: None,
        }
    }

    /// Recorded from an engine that ran as `summary` (its sidecar's
    /// `engine_info`), for the header; `None` leaves it unsaid.
    pub fn with_engine_summary(mut self, summary: Option<String>) -> Self {
        self.engine_summary = summary;
        self
    }

    /// Keeps a copy of the model every `n` events (at least 1) so seeking
    /// back re-applies at most `n` events.
    pub fn with_checkpoint_every(mut self, n: usize) -> Self {
        self.checkpoint_every = n.max(1);
        self
    }

    /// Events applied so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Events in the log.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// True for an empty log.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Playing (rather than paused).
    pub fn playing(&self) -> bool {
        self.playing
    }

    /// Speed, × real time.
    pub fn speed(&self) -> f64 {
        self.speed
    }

    /// Events the recording lost (from its sidecar).
    pub fn lost(&self) -> u64 {
        self.lost
    }

    /// Checkpoints held.
    pub fn checkpoints(&self) -> usize {
        self.checkpoints.len()
    }

    /// Time span of the log, engine ns.
    pub fn time_range(&self) -> Option<(u64, u64)> {
        Some((self.events.first()?.ts_ns, self.events.last()?.ts_ns))
    }

    fn apply_until(&mut self, model: &mut Model, target: usize) {
        let target = target.min(self.events.len());
        while self.pos < target {
            model.apply_at(&self.events, self.pos);
            self.pos += 1;
            if self.pos.is_multiple_of(self.checkpoint_every)
                && self.checkpoints.last().is_some_and(|(p, _)| *p < self.pos)
            {
                self.checkpoints.push((self.pos, model.clone()));
            }
        }
    }

    /// Moves to exactly `target` events applied: forward by applying,
    /// back from the nearest checkpoint.
    pub fn seek_to(&mut self, model: &mut Model, target: usize) {
        let target = target.min(self.events.len());
        if target < self.pos {
            let i = self.checkpoints.partition_point(|(p, _)| *p <= target);
            // Checkpoint 0 is always there, so i >= 1.
            let (p, m) = &self.checkpoints[i.saturating_sub(1)];
            *model = m.clone();
            self.pos = *p;
        }
        self.apply_until(model, target);
        self.anchor = None;
    }

    /// While playing, applies the events whose time has come (at most
    /// [`MAX_PULL`]); stops at the end.
    pub fn pull(&mut self, model: &mut Model, now: Instant) -> usize {
        if !self.playing || self.pos >= self.events.len() {
            self.playing = false;
            return 0;
        }
        let next_ts = self.events[self.pos].ts_ns;
        let (ts0, t0) = *self.anchor.get_or_insert((next_ts, now));
        let played = now.saturating_duration_since(t0).as_nanos() as f64 * self.speed;
        let target_ts = ts0.saturating_add(played as u64);
        let end = self.pos + self.events[self.pos..].partition_point(|e| e.ts_ns <= target_ts);
        let end = end.min(self.pos + MAX_PULL);
        let before = self.pos;
        self.apply_until(model, end);
        if self.pos >= self.events.len() {
            self.playing = false;
        }
        self.pos - before
    }

    /// Play or pause.
    pub fn toggle_play(&mut self) {
        self.playing = !self.playing && self.pos < self.events.len();
        self.anchor = None;
    }

    /// Sets playing explicitly.
    pub fn set_playing(&mut self, playing: bool) {
        self.playing = playing && self.pos < self.events.len();
        self.anchor = None;
    }

    /// Doubles (`faster`) or halves the speed within [`SPEEDS`].
    pub fn change_speed(&mut self, faster: bool) {
        let s = if faster {
            self.speed * 2.0
        } else {
            self.speed / 2.0
        };
        self.speed = s.clamp(SPEEDS.0, SPEEDS.1);
        self.anchor = None;
    }

    /// Seeks [`SEEK_NS`] of engine time back or forward from the current
    /// event.
    pub fn seek_time(&mut self, model: &mut Model, forward: bool) {
        let now = self
            .pos
            .checked_sub(1)
            .and_then(|i| self.events.get(i))
            .or(self.events.first())
            .map_or(0, |e| e.ts_ns);
        let target_ts = if forward {
            now.saturating_add(SEEK_NS)
        } else {
            now.saturating_sub(SEEK_NS)
        };
        let target = self.events.partition_point(|e| e.ts_ns <= target_ts);
        // Going back from the very start of a second lands before it.
        self.seek_to(model, target);
    }

    /// One event forward or back; pauses.
    pub fn step(&mut self, model: &mut Model, forward: bool) {
        self.playing = false;
        let target = if forward {
            self.pos + 1
        } else {
            self.pos.saturating_sub(1)
        };
        self.seek_to(model, target);
    }

    /// Wall time until the next event is due, for the event loop's sleep.
    pub fn next_due(&self, now: Instant) -> Option<Duration> {
        if !self.playing {
            return None;
        }
        let next = self.events.get(self.pos)?.ts_ns;
        let (ts0, t0) = self.anchor?;
        let due = Duration::from_nanos((next.saturating_sub(ts0) as f64 / self.speed) as u64);
        Some(due.saturating_sub(now.saturating_duration_since(t0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::EventKind;
    use kvbm_events::reducer::fold;
    use kvbm_events::slot::SlotState;

    fn events(n: usize) -> Arc<[Event]> {
        (0..n)
            .map(|i| Event {
                engine: 0,
                seq: i as u64,
                ts_ns: i as u64 * 1_000_000_000,
                iteration: i as u64,
                request: Some(format!("r{}", i / 2).into()),
                kind: if i % 2 == 0 {
                    EventKind::SlotCreated {
                        prompt_tokens: 8,
                        max_output_tokens: 1,
                    }
                } else {
                    EventKind::SlotTransition {
                        from: SlotState::Initialized,
                        to: SlotState::Prefilling,
                    }
                },
            })
            .collect::<Vec<_>>()
            .into()
    }

    #[test]
    fn seeking_back_and_forth_equals_a_fold_of_the_prefix() {
        let ev = events(50);
        let cfg = ModelConfig::default();
        let mut r = ReplaySource::new(ev.clone(), 0, cfg).with_checkpoint_every(7);
        let mut m = Model::new(cfg);
        for target in [30, 10, 49, 0, 50, 21, 20, 22, 3] {
            r.seek_to(&mut m, target);
            assert_eq!(r.position(), target);
            assert_eq!(m.state(), &fold(&ev[..target]), "at {target}");
            assert_eq!(m.history().len(), target);
        }
        assert!(r.checkpoints() >= 7);
    }

    #[test]
    fn stepping_and_seeking_by_time() {
        let ev = events(40);
        let cfg = ModelConfig::default();
        let mut r = ReplaySource::new(ev, 0, cfg);
        let mut m = Model::new(cfg);
        r.step(&mut m, true);
        r.step(&mut m, true);
        r.step(&mut m, false);
        assert_eq!(r.position(), 1);
        // Event i is at i seconds; after event 0 (t=0), +10 s applies
        // events 0..=10.
        r.seek_time(&mut m, true);
        assert_eq!(r.position(), 11);
        r.seek_time(&mut m, false);
        assert_eq!(r.position(), 1);
        r.step(&mut m, false);
        r.step(&mut m, false);
        assert_eq!(r.position(), 0);
    }

    #[test]
    fn playback_follows_the_clock_times_speed_and_stops_at_the_end() {
        let ev = events(40);
        let cfg = ModelConfig::default();
        let mut r = ReplaySource::new(ev, 0, cfg);
        let mut m = Model::new(cfg);
        let t0 = Instant::now();
        assert_eq!(r.pull(&mut m, t0), 0, "paused");
        r.toggle_play();
        r.change_speed(true);
        assert_eq!(r.speed(), 2.0);
        // The first pull anchors on the next event and applies it.
        assert_eq!(r.pull(&mut m, t0), 1);
        // 2.5 s later at 2×: events up to t = 5 s.
        assert_eq!(r.pull(&mut m, t0 + Duration::from_millis(2500)), 5);
        assert_eq!(r.position(), 6);
        assert!(
            r.next_due(t0 + Duration::from_millis(2500)).unwrap() <= Duration::from_millis(500)
        );
        r.pull(&mut m, t0 + Duration::from_secs(1000));
        assert_eq!(r.position(), 40);
        assert!(!r.playing());
        for _ in 0..20 {
            r.change_speed(true);
        }
        assert_eq!(r.speed(), SPEEDS.1);
        for _ in 0..20 {
            r.change_speed(false);
        }
        assert_eq!(r.speed(), SPEEDS.0);
    }

    /// A link that says where new engine runs begin: the model starts
    /// afresh exactly there, so the runs are never folded together.
    #[test]
    fn a_new_engine_run_starts_a_fresh_model() {
        struct Runs(std::sync::Mutex<Vec<u64>>);
        impl Link for Runs {
            fn badge(&self, _: Instant) -> Badge {
                Badge::new("ATTACHED", Tone::Ok)
            }
            fn run_starts(&self) -> Vec<u64> {
                self.0.lock().unwrap().clone()
            }
        }
        let ring = Arc::new(RingBuffer::with_capacity(100).unwrap());
        let link = Arc::new(Runs(Default::default()));
        let mut src = LiveSource::new(ring.clone(), None).with_link(link.clone());
        let mut m = Model::new(ModelConfig::default());
        let run = events(6);
        for e in run.iter() {
            ring.push(e.clone());
        }
        assert_eq!(src.pull(&mut m), 6);
        // The engine restarts: the same requests again, from seq 0.
        link.0.lock().unwrap().push(ring.counters().pushed);
        for e in run.iter().take(4) {
            ring.push(e.clone());
        }
        assert_eq!(src.pull(&mut m), 4);
        assert_eq!(src.runs_started(), 1);
        assert_eq!(m.state(), &fold(&run[..4]), "only the new run");
        assert_eq!(m.state().inconsistencies().total(), 0);
    }

    #[test]
    fn live_pull_counts_what_the_ring_overwrote() {
        let ring = Arc::new(RingBuffer::with_capacity(4).unwrap());
        let mut src = LiveSource::new(ring.clone(), None);
        let mut m = Model::new(ModelConfig::default());
        for e in events(3).iter() {
            ring.push(e.clone());
        }
        assert_eq!(src.pull(&mut m), 3);
        src.set_frozen(true);
        for e in events(10).iter().skip(3) {
            ring.push(e.clone());
        }
        assert_eq!(src.pull(&mut m), 0);
        assert_eq!(src.behind(), 7);
        src.set_frozen(false);
        assert_eq!(src.pull(&mut m), 4);
        assert_eq!(src.lagged(), 3);
        assert_eq!(m.applied(), 7);
    }
}
