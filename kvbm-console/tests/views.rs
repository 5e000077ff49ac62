//! Every view drawn into a `TestBackend` at 80×24 and 160×48: empty,
//! after a recorded log, and overflowing; and one log from `replays/`
//! driven through the reducer and the UI state to known frames (golden
//! files under `tests/frames/`; `UPDATE_FRAMES=1` rewrites them).

use kvbm_console::app::{App, Source};
use kvbm_console::keys::ViewId;
use kvbm_console::model::{Model, ModelConfig};
use kvbm_console::source::ReplaySource;
use kvbm_events::slot::SlotState;
use kvbm_events::tier::Tier;
use kvbm_events::{Direction, Event, EventKind, RequestId};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const SIZES: [(u16, u16); 2] = [(80, 24), (160, 48)];

fn key(app: &mut App, c: char) {
    app.key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
}

fn special(app: &mut App, code: KeyCode) {
    app.key(KeyEvent::new(code, KeyModifiers::NONE));
}

fn view_key(v: ViewId) -> char {
    char::from(b'1' + v.index() as u8)
}

/// Draws `app` at `w`×`h` and returns the screen's lines.
fn draw(app: &mut App, w: u16, h: u16) -> Vec<String> {
    app.resize(w, h);
    app.tick();
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| app.render(f)).unwrap();
    let buf = t.backend().buffer();
    (0..h)
        .map(|y| {
            (0..w)
                .map(|x| buf[(x, y)].symbol().to_string())
                .collect::<String>()
                .trim_end()
                .to_string()
        })
        .collect()
}

fn screen(lines: &[String]) -> String {
    lines.join("\n")
}

fn replays() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../replays")
}

fn replay_app(name: &str) -> App {
    let read = kvbm_recorder::recorder::read_events(&replays().join(name), |_| {}).unwrap();
    assert!(read.damage.is_none());
    let events: Arc<[Event]> = read.events.into();
    let r = ReplaySource::new(events, 0, ModelConfig::default());
    App::new(Model::new(ModelConfig::default()), Source::Replay(r), name)
}

fn empty_app() -> App {
    App::new(Model::new(ModelConfig::default()), Source::Fixed, "empty")
}

#[test]
fn every_view_draws_an_empty_model_at_both_sizes() {
    let expect = [
        (ViewId::Slots, "no requests yet"),
        (ViewId::Transfers, "Totals — no transfers yet"),
        (ViewId::Pools, "no gauge seen"),
        (ViewId::Histograms, "nothing measured yet"),
        (ViewId::Breakpoints, "Paused calls — 0"),
        (ViewId::Events, "no events"),
        (ViewId::Capacity, "No lookups recorded"),
    ];
    for (w, h) in SIZES {
        for (view, text) in expect {
            let mut app = empty_app();
            key(&mut app, view_key(view));
            let s = screen(&draw(&mut app, w, h));
            assert!(s.contains(text), "{view:?} at {w}x{h}:\n{s}");
            assert!(s.contains("SNAPSHOT"), "{s}");
            assert!(s.contains(&format!("{} {}", view.index() + 1, view.title())));
        }
    }
}

#[test]
fn every_view_draws_a_replayed_log_at_both_sizes() {
    for (w, h) in SIZES {
        let mut app = replay_app("preemption-heavy");
        special(&mut app, KeyCode::End);
        for view in ViewId::ALL {
            key(&mut app, view_key(view));
            let lines = draw(&mut app, w, h);
            let s = screen(&lines);
            assert!(lines[0].contains("REPLAY ⏸ 1× 100%"), "{}", lines[0]);
            assert!(lines[0].contains("00:11.79"), "{}", lines[0]);
            assert_eq!(lines.len(), h as usize);
            assert!(lines.iter().all(|l| l.chars().count() <= w as usize));
            let needle = match view {
                ViewId::Slots => "Finished",
                ViewId::Transfers => "G1→G2",
                ViewId::Pools => "G1 device",
                ViewId::Histograms => "in Preempted",
                ViewId::Breakpoints => "replay: breakpoints are read-only",
                ViewId::Events => "13801",
                // A version-1 log: no lookups, but stores and removals.
                ViewId::Capacity => "stored again after removal",
            };
            assert!(
                s.contains(needle),
                "{view:?} at {w}x{h} lacks {needle}:\n{s}"
            );
        }
    }
}

fn ev(seq: u64, ts_ns: u64, request: Option<&str>, kind: EventKind) -> Event {
    Event {
        engine: 0,
        seq,
        ts_ns,
        iteration: seq,
        request: request.map(RequestId::from),
        kind,
    }
}

/// Far more rows than the screen holds, and a request id wider than it.
fn overflowing() -> App {
    let mut m = Model::new(ModelConfig::default());
    let long = "r".repeat(300);
    let mut seq = 0;
    for i in 0..500u64 {
        let id = if i == 7 {
            long.clone()
        } else {
            format!("req-{i:03}")
        };
        for kind in [
            EventKind::SlotCreated {
                prompt_tokens: 100,
                max_output_tokens: 10,
            },
            EventKind::SlotTransition {
                from: SlotState::Initialized,
                to: SlotState::Prefilling,
            },
            EventKind::TransferPlanned {
                transfer: i,
                direction: Direction::DEVICE_TO_HOST,
                blocks: 2,
            },
        ] {
            m.apply(ev(seq, seq * 1_000_000, Some(&id), kind));
            seq += 1;
        }
    }
    m.apply(ev(
        seq,
        seq * 1_000_000,
        None,
        EventKind::PoolGauge {
            tier: Tier::Device,
            capacity: 100,
            active: 100,
            inactive: 0,
            empty: 0,
        },
    ));
    App::new(m, Source::Fixed, "overflow")
}

#[test]
fn overflowing_views_scroll_and_stay_inside_the_screen() {
    for (w, h) in SIZES {
        let mut app = overflowing();
        for view in ViewId::ALL {
            key(&mut app, view_key(view));
            let lines = draw(&mut app, w, h);
            assert!(
                lines.iter().all(|l| l.chars().count() <= w as usize),
                "{view:?}"
            );
        }
        // The slots table scrolls to keep the selection in sight.
        key(&mut app, '1');
        key(&mut app, 'G');
        let s = screen(&draw(&mut app, w, h));
        assert!(s.contains("500 shown"), "{s}");
        assert!(s.contains("req-499"), "{s}");
        assert!(!s.contains("req-000"), "{s}");
        key(&mut app, 'g');
        let s = screen(&draw(&mut app, w, h));
        assert!(s.contains("req-000") && !s.contains("req-499"), "{s}");
        // The event log follows the newest event, and stops following
        // when scrolled up.
        key(&mut app, '6');
        let s = screen(&draw(&mut app, w, h));
        assert!(s.contains("following") && s.contains("PoolGauge"), "{s}");
        key(&mut app, 'k');
        let s = screen(&draw(&mut app, w, h));
        assert!(!s.contains("following"), "{s}");
        // The transfers view lists the 500 in-flight candidates.
        key(&mut app, '2');
        let s = screen(&draw(&mut app, w, h));
        assert!(s.contains("In flight — 500 candidates"), "{s}");
    }
}

#[test]
fn filter_help_and_warnings_draw_over_the_view() {
    let mut app = overflowing();
    key(&mut app, '/');
    for c in "/req-00[0-2]$/".chars() {
        key(&mut app, c);
    }
    special(&mut app, KeyCode::Enter);
    let s = screen(&draw(&mut app, 160, 48));
    assert!(s.contains("3 shown matching `/req-00[0-2]$/`"), "{s}");
    key(&mut app, '?');
    let s = screen(&draw(&mut app, 80, 24));
    assert!(s.contains("Help — keys"), "{s}");
    assert!(s.contains("quit"), "{s}");
    special(&mut app, KeyCode::Esc);
    key(&mut app, 'w');
    let s = screen(&draw(&mut app, 160, 48));
    assert!(s.contains("Warnings (Esc or w closes)"), "{s}");
    special(&mut app, KeyCode::Esc);
    special(&mut app, KeyCode::Esc);
    let s = screen(&draw(&mut app, 160, 48));
    assert!(s.contains("500 shown"), "the filter is cleared:\n{s}");
}

#[test]
fn the_mouse_selects_rows_scrolls_and_switches_views() {
    use ratatui::crossterm::event::{MouseButton, MouseEvent, MouseEventKind};
    let mouse = |kind, column, row| MouseEvent {
        kind,
        column,
        row,
        modifiers: KeyModifiers::NONE,
    };
    let mut app = overflowing();
    draw(&mut app, 160, 48);
    // Rows start under the two header lines, the tabs, the border and the
    // table header: the third row is at y = 7.
    app.mouse(mouse(MouseEventKind::Down(MouseButton::Left), 10, 7));
    assert_eq!(app.list().selected, 2);
    assert_eq!(app.views.slots.selected().map(|r| &**r), Some("req-002"));
    // A second click on the selected row opens it.
    app.mouse(mouse(MouseEventKind::Down(MouseButton::Left), 10, 7));
    assert_eq!(
        app.views.detail.as_ref().map(|d| &**d.request()),
        Some("req-002")
    );
    special(&mut app, KeyCode::Esc);
    app.mouse(mouse(MouseEventKind::ScrollDown, 10, 20));
    app.mouse(mouse(MouseEventKind::ScrollDown, 10, 20));
    assert_eq!(app.list().selected, 8);
    app.mouse(mouse(MouseEventKind::ScrollUp, 10, 20));
    assert_eq!(app.list().selected, 5);
    // The tab bar is the third line.
    let lines = draw(&mut app, 160, 48);
    let x = lines[2].find("6 Events").unwrap();
    let col = lines[2][..x].chars().count() as u16;
    app.mouse(mouse(MouseEventKind::Down(MouseButton::Left), col, 2));
    assert_eq!(app.ui.view, ViewId::Events);
    // A click outside any list or tab changes nothing.
    app.mouse(mouse(MouseEventKind::Down(MouseButton::Left), 0, 0));
    assert_eq!(app.ui.view, ViewId::Events);
}

/// The detail's event list stays right while the live history drops its
/// oldest events (the cache keeps absolute positions) and after a replay
/// seeks back.
#[test]
fn the_detail_event_list_survives_history_drops_and_seeks() {
    let cfg = ModelConfig {
        history: 40,
        ..ModelConfig::default()
    };
    let mut app = App::new(Model::new(cfg), Source::Fixed, "live");
    let mut seq = 0;
    let mut push = |app: &mut App, id: &str| {
        app.model.apply(ev(
            seq,
            seq * 1000,
            Some(id),
            EventKind::TokensScheduled {
                prefill: 0,
                decode: 1,
                computed: seq as u32,
            },
        ));
        seq += 1;
    };
    push(&mut app, "a");
    app.open("a".into());
    for round in 0..10 {
        for i in 0..7 {
            push(&mut app, if i % 3 == 0 { "a" } else { "b" });
        }
        app.tick();
        let h = app.model.history();
        let want = (0..h.len())
            .filter(|&i| h.get(i).unwrap().request.as_deref() == Some("a"))
            .count();
        assert_eq!(app.list_len(), want, "round {round}");
        let s = screen(&draw(&mut app, 160, 48));
        assert!(s.contains(&format!("Events of a ({want})")), "{s}");
    }
    assert!(app.model.history().dropped() > 0);

    let mut app = replay_app("preemption-heavy");
    special(&mut app, KeyCode::End);
    key(&mut app, '1');
    special(&mut app, KeyCode::Enter);
    let n_end = app.list_len();
    for _ in 0..3 {
        special(&mut app, KeyCode::Left);
    }
    let n_back = app.list_len();
    special(&mut app, KeyCode::End);
    assert_eq!(app.list_len(), n_end);
    assert!(n_back <= n_end);
}

fn golden(name: &str, lines: &[String]) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/frames")
        .join(format!("{name}.txt"));
    let got = screen(lines) + "\n";
    if std::env::var_os("UPDATE_FRAMES").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_FRAMES=1 writes it)", path.display()));
    assert_eq!(got, want, "frame {name} differs from {}", path.display());
}

/// The CPU-offload walk-through, replayed to its end through the reducer and
/// the UI state, draws these exact frames.
#[test]
fn the_cpu_offload_replay_reaches_known_frames() {
    let mut app = replay_app("cpu-offload-walkthrough");
    special(&mut app, KeyCode::End);
    golden("cpu-offload-slots-160x48", &draw(&mut app, 160, 48));
    golden("cpu-offload-slots-80x24", &draw(&mut app, 80, 24));
    key(&mut app, '2');
    golden("cpu-offload-transfers-160x48", &draw(&mut app, 160, 48));
    key(&mut app, '3');
    golden("cpu-offload-pools-160x48", &draw(&mut app, 160, 48));
    key(&mut app, '4');
    golden("cpu-offload-histograms-160x48", &draw(&mut app, 160, 48));
    key(&mut app, '6');
    golden("cpu-offload-events-160x48", &draw(&mut app, 160, 48));
    key(&mut app, '1');
    special(&mut app, KeyCode::Enter);
    golden("cpu-offload-detail-160x48", &draw(&mut app, 160, 48));
    // Stepping back one event at a time and forward again lands on the
    // same frame (the checkpointed model rebuilds exactly).
    special(&mut app, KeyCode::Esc);
    for _ in 0..10 {
        key(&mut app, ',');
    }
    for _ in 0..10 {
        key(&mut app, '.');
    }
    golden("cpu-offload-slots-160x48", &draw(&mut app, 160, 48));
}

/// A small simulator run with shared prefixes and a small host, its
/// events fed to the model as the live console would.
fn sim_app() -> App {
    use kvbm_events::bus::TapItem;
    use kvbm_sim::sim::{SimConfig, Simulator};
    use kvbm_sim::workload::{LengthDist, SyntheticConfig, generate};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let w = generate(&SyntheticConfig {
        seed: 5,
        num_requests: 60,
        arrival_rate_per_s: 30.0,
        prompt_len: LengthDist::Uniform { min: 64, max: 400 },
        output_len: LengthDist::Uniform { min: 1, max: 20 },
        shared_prefix_ratio: 0.7,
        num_shared_prefixes: 4,
        shared_prefix_len: 128,
        ..SyntheticConfig::default()
    })
    .unwrap();
    let cfg = SimConfig {
        block_size: 16,
        device_capacity_tokens: 1024,
        host_capacity_tokens: 2048,
        ..SimConfig::default()
    };
    let mut sim = Simulator::new(cfg, w, rt.handle()).unwrap();
    let mut tap = sim.emitter().bus().take_tap().unwrap();
    let mut m = Model::new(ModelConfig::default());
    let take = |m: &mut Model, item| match item {
        TapItem::Event(e) => m.apply(e),
        TapItem::Gap { dropped } => panic!("lost {dropped}"),
    };
    while sim.step() {
        while let Ok(item) = tap.try_recv() {
            take(&mut m, item);
        }
    }
    sim.finish();
    std::thread::sleep(std::time::Duration::from_millis(200));
    while let Ok(item) = tap.try_recv() {
        take(&mut m, item);
    }
    App::new(m, Source::Fixed, "sim")
}

#[test]
fn the_capacity_view_draws_the_curve_the_tiers_and_the_miss_reasons() {
    let mut app = sim_app();
    let rep = app.model.capacity().report(&[], None);
    assert_eq!(rep.requests, 60);
    assert!(rep.ceiling > 0.1, "shared prefixes hit: {}", rep.ceiling);
    for (w, h) in SIZES {
        key(&mut app, '7');
        let lines = draw(&mut app, w, h);
        let s = screen(&lines);
        assert!(lines.iter().all(|l| l.chars().count() <= w as usize));
        assert!(s.contains("Hit ratio by LRU capacity"), "{s}");
        assert!(s.contains(&format!("ceiling {:.3}", rep.ceiling)), "{s}");
        assert!(s.contains("G2"), "the host's capacity is marked:\n{s}");
        assert!(s.contains("misses"), "{s}");
        assert!(s.contains("cold"), "{s}");
        assert!(s.contains("7 Capacity"), "{s}");
    }
    // The request detail says why each of its lookups missed.
    key(&mut app, '1');
    special(&mut app, KeyCode::Enter);
    let s = screen(&draw(&mut app, 160, 48));
    assert!(s.contains("lookup 1: hit G1"), "{s}");
}
