//! The console at scale: the cost of one frame with 10,000 live slots and
//! 1,000,000 events of history, the memory that takes, and the time to
//! open a 1,000,000-event log to its first frame.
//!
//! Run: `cargo bench -p kvbm-console --bench console` (`KVBM_BENCH_QUICK=1`
//! for a short run: 1,000 slots, 100,000 events). Three tables:
//!
//! 1. ms per frame, per view. The model is built from a deterministic
//!    synthetic stream (10,000 requests created, prefilled and decoding,
//!    none finishing, with scheduling / match / allocation / pool gauge /
//!    transfer filler) fed through `Model::apply` up to 1,000,000 events
//!    (the default history bound). A frame is what the live console does
//!    every 100 ms: pull a batch of 5,000 new events (~100 ms of a busy
//!    engine, pushed into the recorder's ring beforehand, untimed) and
//!    apply them, `App::tick`, and one `Terminal::draw` of the whole screen
//!    into ratatui's in-memory `TestBackend` (160×48). Terminal I/O (the
//!    diff written to a tty as escape codes) is excluded. Median and max
//!    over the measured frames, after warm-up frames; the baseline is the
//!    same frame on an empty model. Target: ≤ 16 ms.
//! 2. Peak RSS (`VmHWM`) after building the model and after the frames.
//!    Target: ≤ 1 GiB.
//! 3. Opening the same 1,000,000 events, written with the recorder's
//!    durable log (fsync off: the page cache), exactly as `kvbm-console
//!    replay DIR` does before its first frame: `read_events` + sidecar +
//!    `ReplaySource::new` + `App::new` + the first draw; then jumping to
//!    the end (`seek_to(len)` + tick + draw). Best of N. Target: ≤ 1 s to
//!    the first frame.

use kvbm_console::app::{App, Source};
use kvbm_console::model::{Model, ModelConfig};
use kvbm_console::source::{LiveSource, ReplaySource};
use kvbm_events::ring::RingBuffer;
use kvbm_events::slot::SlotState;
use kvbm_events::tier::Tier;
use kvbm_events::{Direction, Event, EventKind, RequestId};
use kvbm_recorder::log::{FsyncPolicy, LogWriter};
use kvbm_recorder::recorder::{RecorderConfig, read_events, read_sidecar};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Engine time between events: 50,000 events/s, so a 5,000-event batch is
/// 100 ms of engine time.
const TS_STEP_NS: u64 = 20_000;
/// Requests admitted per engine iteration until all are created.
const ADMIT_PER_ITER: usize = 4;
/// Requests decoding one token per iteration (round-robin).
const DECODE_BATCH: usize = 64;
/// Transfers kept in flight.
const IN_FLIGHT: usize = 16;
const WIDTH: u16 = 160;
const HEIGHT: u16 = 48;
const G1_CAPACITY: u32 = 1_000_000;

/// A deterministic engine-like event stream: requests are created,
/// matched, prefilled and move to decoding; then they decode forever (none
/// finishes), with block allocations, pool gauges and offloads between.
struct Gen {
    n_req: usize,
    ids: Vec<RequestId>,
    computed: Vec<u32>,
    pending: VecDeque<(Option<RequestId>, EventKind)>,
    in_flight: VecDeque<(u64, RequestId)>,
    seq: u64,
    ts: u64,
    iteration: u64,
    rr: usize,
    transfer: u64,
    block: u32,
    active: u32,
}

impl Gen {
    fn new(n_req: usize) -> Self {
        Gen {
            n_req,
            ids: Vec::with_capacity(n_req),
            computed: Vec::with_capacity(n_req),
            pending: VecDeque::new(),
            in_flight: VecDeque::new(),
            seq: 0,
            ts: 0,
            iteration: 0,
            rr: 0,
            transfer: 0,
            block: 0,
            active: 0,
        }
    }

    fn blocks(&mut self, n: u32) -> Vec<u32> {
        let v = (0..n).map(|k| (self.block + k) % G1_CAPACITY).collect();
        self.block = (self.block + n) % G1_CAPACITY;
        self.active = (self.active + n).min(G1_CAPACITY);
        v
    }

    /// One engine iteration's events into `pending`.
    fn iterate(&mut self) {
        self.iteration += 1;
        self.admit();
        self.decode();
        self.offload();
        self.gauges();
    }

    /// Admits up to [`ADMIT_PER_ITER`] new requests: each looks up its
    /// prefix in G1 and G2, prefills in one step and starts decoding.
    fn admit(&mut self) {
        for _ in 0..ADMIT_PER_ITER {
            let r = self.ids.len();
            if r >= self.n_req {
                break;
            }
            let id: RequestId = Arc::from(format!("req-{r:05}"));
            let prompt = 256 + (r as u32 * 37) % 1024;
            let full = prompt / 16;
            let hit = (r as u32 * 13) % (full + 1);
            let p = &mut self.pending;
            push(
                p,
                Some(&id),
                EventKind::SlotCreated {
                    prompt_tokens: prompt,
                    max_output_tokens: 1 << 20,
                },
            );
            push(
                p,
                Some(&id),
                EventKind::MatchResult {
                    tier: Tier::Device,
                    looked_up: full,
                    hit_blocks: hit,
                    hit_tokens: hit * 16,
                },
            );
            push(
                p,
                Some(&id),
                EventKind::MatchResult {
                    tier: Tier::Host,
                    looked_up: full - hit,
                    hit_blocks: (full - hit) / 2,
                    hit_tokens: (full - hit) / 2 * 16,
                },
            );
            push(
                p,
                Some(&id),
                EventKind::SlotTransition {
                    from: SlotState::Initialized,
                    to: SlotState::Prefilling,
                },
            );
            let blocks = self.blocks(prompt.div_ceil(16));
            let p = &mut self.pending;
            push(
                p,
                Some(&id),
                EventKind::BlocksAllocated {
                    tier: Tier::Device,
                    blocks,
                },
            );
            push(
                p,
                Some(&id),
                EventKind::TokensScheduled {
                    prefill: prompt,
                    decode: 0,
                    computed: prompt,
                },
            );
            push(
                p,
                Some(&id),
                EventKind::SlotTransition {
                    from: SlotState::Prefilling,
                    to: SlotState::Decoding,
                },
            );
            self.ids.push(id);
            self.computed.push(prompt);
        }
    }

    /// One decode token for [`DECODE_BATCH`] live requests in turn, a new
    /// block every 16th.
    fn decode(&mut self) {
        let live = self.ids.len();
        for k in 0..DECODE_BATCH.min(live) {
            let r = self.rr % live;
            self.rr += 1;
            self.computed[r] += 1;
            let id = self.ids[r].clone();
            push(
                &mut self.pending,
                Some(&id),
                EventKind::TokensScheduled {
                    prefill: 0,
                    decode: 1,
                    computed: self.computed[r],
                },
            );
            if k % 16 == 15 {
                let blocks = self.blocks(1);
                push(
                    &mut self.pending,
                    Some(&id),
                    EventKind::BlocksAllocated {
                        tier: Tier::Device,
                        blocks,
                    },
                );
            }
        }
    }

    /// Two offloads to G2 planned, and those planned more than
    /// [`IN_FLIGHT`] before completed.
    fn offload(&mut self) {
        let live = self.ids.len();
        // Offloads of decoding requests' blocks to G2: two planned per
        // iteration, completed IN_FLIGHT later.
        for _ in 0..2 {
            let id = self.ids[(self.transfer as usize * 7919) % live].clone();
            self.transfer += 1;
            let t = self.transfer;
            push(
                &mut self.pending,
                Some(&id),
                EventKind::TransferPlanned {
                    transfer: t,
                    direction: Direction::DEVICE_TO_HOST,
                    blocks: 4,
                },
            );
            self.in_flight.push_back((t, id));
            if self.in_flight.len() > IN_FLIGHT
                && let Some((t, id)) = self.in_flight.pop_front()
            {
                push(
                    &mut self.pending,
                    Some(&id),
                    EventKind::TransferCompleted {
                        transfer: t,
                        direction: Direction::DEVICE_TO_HOST,
                        blocks: 4,
                    },
                );
            }
        }
    }

    /// G1's pool gauge every iteration, G2's every fourth.
    fn gauges(&mut self) {
        let active = self.active;
        push(
            &mut self.pending,
            None,
            EventKind::PoolGauge {
                tier: Tier::Device,
                capacity: G1_CAPACITY,
                active,
                inactive: 0,
                empty: G1_CAPACITY - active,
            },
        );
        if self.iteration.is_multiple_of(4) {
            let host = (self.transfer as u32 * 4).min(4 * G1_CAPACITY);
            push(
                &mut self.pending,
                None,
                EventKind::PoolGauge {
                    tier: Tier::Host,
                    capacity: 4 * G1_CAPACITY,
                    active: 0,
                    inactive: host,
                    empty: 4 * G1_CAPACITY - host,
                },
            );
        }
    }

    fn next_event(&mut self) -> Event {
        while self.pending.is_empty() {
            self.iterate();
        }
        let (request, kind) = self.pending.pop_front().expect("refilled above");
        let ev = Event {
            engine: 0,
            seq: self.seq,
            ts_ns: self.ts,
            iteration: self.iteration,
            request,
            kind,
        };
        self.seq += 1;
        self.ts += TS_STEP_NS;
        ev
    }
}

/// Queues one event of `request` (none for engine-wide events).
fn push(p: &mut VecDeque<(Option<RequestId>, EventKind)>, r: Option<&RequestId>, k: EventKind) {
    p.push_back((r.cloned(), k));
}

/// (VmRSS, VmHWM) in bytes.
fn rss() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn key(app: &mut App, code: KeyCode) {
    app.key(KeyEvent::new(code, KeyModifiers::NONE));
}

fn term() -> Terminal<TestBackend> {
    Terminal::new(TestBackend::new(WIDTH, HEIGHT)).unwrap()
}

fn draw(t: &mut Terminal<TestBackend>, app: &App) {
    t.draw(|f| app.render(f)).unwrap();
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Per-frame times: total, pull, tick, draw (ms).
#[derive(Default)]
struct Frames {
    total: Vec<f64>,
    pull: Vec<f64>,
    tick: Vec<f64>,
    draw: Vec<f64>,
}

/// `warm` + `frames` frames of: pull `batch` new events (pushed into the
/// ring beforehand, untimed), tick, draw.
fn frames(
    app: &mut App,
    ring: &RingBuffer,
    gen_: &mut Gen,
    t: &mut Terminal<TestBackend>,
    batch: usize,
    warm: usize,
    frames: usize,
) -> Frames {
    let mut out = Frames::default();
    for i in 0..warm + frames {
        for _ in 0..batch {
            ring.push(gen_.next_event());
        }
        let t0 = Instant::now();
        let pulled = app.pull(Instant::now());
        assert_eq!(pulled, batch);
        let t1 = Instant::now();
        app.tick();
        let t2 = Instant::now();
        draw(t, app);
        let t3 = Instant::now();
        if i >= warm {
            let d = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
            out.total.push(d(t0, t3));
            out.pull.push(d(t0, t1));
            out.tick.push(d(t1, t2));
            out.draw.push(d(t2, t3));
        }
    }
    out
}

/// Frame times (ms) on an empty model, with nothing to pull: the
/// baseline the loaded views are compared with.
fn empty_frames(
    cfg: ModelConfig,
    batch: usize,
    t: &mut Terminal<TestBackend>,
    warm: usize,
    n_frames: usize,
) -> Vec<f64> {
    let ring = Arc::new(RingBuffer::with_capacity(2 * batch).unwrap());
    let mut app = App::new(
        Model::new(cfg),
        Source::Live(LiveSource::new(ring.clone(), None)),
        "bench",
    );
    app.resize(WIDTH, HEIGHT);
    let mut empty = Vec::new();
    for i in 0..warm + n_frames {
        let t0 = Instant::now();
        app.pull(Instant::now());
        app.tick();
        draw(t, &app);
        if i >= warm {
            empty.push(ms(t0));
        }
    }
    empty
}

/// Each view's frames on the loaded model, switched to by its keys and
/// left with Esc.
fn view_frames(
    app: &mut App,
    ring: &RingBuffer,
    gen_: &mut Gen,
    t: &mut Terminal<TestBackend>,
    batch: usize,
    warm: usize,
    n_frames: usize,
) -> Vec<(&'static str, Frames)> {
    let views: [(&str, &[KeyCode]); 6] = [
        ("Slots", &[KeyCode::Char('1')]),
        ("Events (following)", &[KeyCode::Char('6')]),
        ("Histograms", &[KeyCode::Char('4')]),
        ("Pools", &[KeyCode::Char('3')]),
        ("Transfers", &[KeyCode::Char('2')]),
        (
            "Request detail (oldest request)",
            &[KeyCode::Char('1'), KeyCode::Enter],
        ),
    ];
    let mut rows = Vec::new();
    for (name, keys) in views {
        for k in keys {
            key(app, *k);
        }
        if name.starts_with("Request") {
            assert!(app.views.detail.is_some(), "Enter opened the detail");
        }
        let f = frames(app, ring, gen_, t, batch, warm, n_frames);
        rows.push((name, f));
        key(app, KeyCode::Esc);
    }
    rows
}

/// The same stream as the loaded model's, written with the recorder's
/// durable log (no fsync: the bench times reading it back).
fn write_log(dir: &Path, n_req: usize, n_events: usize) {
    let mut w = LogWriter::create(dir, {
        let mut c = RecorderConfig::default().log;
        c.fsync = FsyncPolicy::Never;
        c
    })
    .unwrap();
    let mut gen_ = Gen::new(n_req);
    for _ in 0..n_events {
        w.append(&gen_.next_event()).unwrap();
    }
    w.close().unwrap();
}

/// The best of `rounds` opens of the log, in ms: reading it alone, to
/// the first frame, and on to a frame at its end.
fn open_log(dir: &Path, cfg: ModelConfig, n_events: usize, rounds: usize) -> [f64; 3] {
    let mut best = [f64::MAX; 3];
    for _ in 0..rounds {
        let mut t = term();
        let t0 = Instant::now();
        let read = read_events(dir, |_| {}).unwrap();
        let read_ms = ms(t0);
        assert!(read.damage.is_none());
        assert_eq!(read.events.len(), n_events);
        let lost = read_sidecar(dir).map_or(0, |r| r.lost);
        let events: Arc<[Event]> = read.events.into();
        let replay = ReplaySource::new(events, lost, cfg);
        let mut app = App::new(Model::new(cfg), Source::Replay(replay), "log");
        app.resize(WIDTH, HEIGHT);
        draw(&mut t, &app);
        let first_ms = ms(t0);
        if let Source::Replay(r) = &mut app.source {
            let n = r.len();
            r.seek_to(&mut app.model, n);
        }
        app.tick();
        draw(&mut t, &app);
        let end_ms = ms(t0);
        assert_eq!(app.model.history().len(), n_events);
        best[0] = best[0].min(read_ms);
        best[1] = best[1].min(first_ms);
        best[2] = best[2].min(end_ms);
    }
    best
}

fn main() {
    let quick = std::env::var("KVBM_BENCH_QUICK").is_ok_and(|v| v == "1");
    let (n_req, n_events) = if quick {
        (1_000, 100_000)
    } else {
        (10_000, 1_000_000)
    };
    let batch = 5_000;
    let (warm, n_frames) = if quick { (2, 10) } else { (3, 30) };
    let open_rounds = if quick { 1 } else { 3 };
    // The history keeps `n_events` (the default, 1,000,000, in a full
    // run), so every frame's view holds exactly that many.
    let cfg = ModelConfig {
        history: n_events,
        ..ModelConfig::default()
    };
    let bench_start = Instant::now();

    // Baseline: the same frame on an empty model (nothing to pull).
    let mut t = term();
    let empty = empty_frames(cfg, batch, &mut t, warm, n_frames);
    let empty_ms = median(&empty);

    // The loaded model, fed event by event (no copy of the stream is held).
    let (rss0, _) = rss();
    let mut gen_ = Gen::new(n_req);
    let t0 = Instant::now();
    let mut model = Model::new(cfg);
    for _ in 0..n_events {
        model.apply(gen_.next_event());
    }
    let build_s = t0.elapsed().as_secs_f64();
    let (rss_built, hwm_built) = rss();
    let live = model.state().slots().filter(|s| !s.is_finished()).count();
    assert_eq!(live, n_req, "every request is live");
    assert_eq!(model.history().len(), n_events);

    let ring = Arc::new(RingBuffer::with_capacity(2 * batch).unwrap());
    let mut app = App::new(
        model,
        Source::Live(LiveSource::new(ring.clone(), None)),
        "bench",
    );
    app.resize(WIDTH, HEIGHT);
    let rows = view_frames(&mut app, &ring, &mut gen_, &mut t, batch, warm, n_frames);
    let (_, hwm_frames) = rss();
    let history = app.model.history().len();
    drop(app);

    // The same stream, written with the recorder's durable log.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("log");
    write_log(&dir, n_req, n_events);
    let best = open_log(&dir, cfg, n_events, open_rounds);
    let (_, hwm_end) = rss();

    let ok = |v: f64, target: f64| if v <= target { "ok" } else { "MISSED" };
    println!(
        "Console frame: {n_req} live slots, {history} events of history, {batch} new events \
         per frame, TestBackend {WIDTH}×{HEIGHT} (in-memory; terminal I/O excluded). \
         Model built in {build_s:.2} s ({:.2} M events/s through Model::apply).",
        n_events as f64 / build_s / 1e6
    );
    println!();
    println!(
        "| view ({n_frames} frames after {warm} warm-up) | median ms/frame | max | pull+apply | tick | draw | ×empty | target ≤ 16 ms |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---|");
    println!(
        "| empty model, Slots (baseline) | {empty_ms:.2} | {:.2} | | | | 1.0× | {} |",
        empty.iter().copied().fold(0.0, f64::max),
        ok(empty_ms, 16.0)
    );
    for (name, f) in &rows {
        let m = median(&f.total);
        println!(
            "| {name} | {m:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1}× | {} |",
            f.total.iter().copied().fold(0.0, f64::max),
            median(&f.pull),
            median(&f.tick),
            median(&f.draw),
            m / empty_ms,
            ok(m, 16.0)
        );
    }
    println!();
    println!("| memory (process, /proc/self/status) | MiB | target ≤ 1024 MiB |");
    println!("|---|---:|---|");
    println!("| RSS before building the model | {:.0} | |", mib(rss0));
    println!(
        "| RSS after building ({n_req} slots, {n_events} events) | {:.0} | |",
        mib(rss_built)
    );
    println!(
        "| peak RSS (VmHWM) after building | {:.0} | {} |",
        mib(hwm_built),
        ok(mib(hwm_built), 1024.0)
    );
    println!(
        "| peak RSS (VmHWM) after the frames | {:.0} | {} |",
        mib(hwm_frames),
        ok(mib(hwm_frames), 1024.0)
    );
    println!(
        "| peak RSS (VmHWM) whole run, incl. the replay below | {:.0} | (info) |",
        mib(hwm_end)
    );
    println!();
    println!(
        "| open a {n_events}-event log (best of {open_rounds}, warm page cache) | ms | target |"
    );
    println!("|---|---:|---|");
    println!(
        "| read_events alone (read + verify + decode) | {:.0} | (info) |",
        best[0]
    );
    println!(
        "| open to the first frame (read_events + ReplaySource::new + App::new + draw) | {:.0} | ≤ 1000 ms: {} |",
        best[1],
        ok(best[1], 1000.0)
    );
    println!(
        "| open and jump to the end (+ seek_to(len) + tick + draw) | {:.0} | (info) |",
        best[2]
    );
    println!();
    println!(
        "total bench time {:.1} s",
        bench_start.elapsed().as_secs_f64()
    );
}
