//! Every view drawn into a `TestBackend` at 80×24, 120×40, 160×48 and
//! 240×60: empty, after a recorded log, and overflowing; two logs from
//! `replays/` driven through the reducer and the UI state to known frames
//! at every size (golden files under `tests/frames/`; `UPDATE_FRAMES=1`
//! rewrites them); and tables no wider than what they hold.

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

const SIZES: [(u16, u16); 4] = [(80, 24), (120, 40), (160, 48), (240, 60)];

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
fn every_view_draws_an_empty_model_at_every_size() {
    let expect = [
        (ViewId::Slots, "no requests yet"),
        (ViewId::Transfers, "Totals — no transfers yet"),
        (ViewId::Pools, "no gauge seen"),
        (ViewId::Histograms, "nothing measured yet"),
        (ViewId::Breakpoints, "Paused calls — 0"),
        (ViewId::Events, "no events"),
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
fn every_view_draws_a_replayed_log_at_every_size() {
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

/// The preemption-heavy log, replayed to its end, draws these exact
/// frames in every view (and a request's detail) at every size.
#[test]
fn every_view_reaches_known_frames_at_every_size() {
    for (w, h) in SIZES {
        let mut app = replay_app("preemption-heavy");
        special(&mut app, KeyCode::End);
        for view in ViewId::ALL {
            key(&mut app, view_key(view));
            if view == ViewId::Histograms {
                // A series with a spread, for the large histogram.
                special(&mut app, KeyCode::Down);
            }
            let name = view.title().to_lowercase();
            golden(
                &format!("preemption-heavy-{name}-{w}x{h}"),
                &draw(&mut app, w, h),
            );
        }
        key(&mut app, '1');
        special(&mut app, KeyCode::Enter);
        golden(
            &format!("preemption-heavy-detail-{w}x{h}"),
            &draw(&mut app, w, h),
        );
    }
}

/// The inner lines of the panels whose titles start with `titles` (one
/// table, or tables that share their column widths), blank lines left out.
fn panel_lines(lines: &[String], titles: &[&str]) -> Vec<Vec<char>> {
    let mut out = Vec::new();
    for title in titles {
        let top = lines
            .iter()
            .position(|l| l.starts_with(&format!("┌ {title}")))
            .unwrap_or_else(|| panic!("no panel {title}:\n{}", screen(lines)));
        for l in &lines[top + 1..] {
            if l.starts_with('└') {
                break;
            }
            let inner: Vec<char> = l.chars().skip(1).take_while(|&c| c != '│').collect();
            if inner.iter().any(|c| !c.is_whitespace()) {
                out.push(inner);
            }
        }
    }
    out
}

/// Widest run of columns blank on every line, between the first and the
/// last column that holds anything: with columns sized to their content,
/// it is the gap between two columns (or a space inside a header).
fn widest_blank_run(rows: &[Vec<char>]) -> (usize, usize) {
    let width = rows.iter().map(Vec::len).max().unwrap_or(0);
    let blank = |x: usize| {
        rows.iter()
            .all(|r| r.get(x).is_none_or(|c| c.is_whitespace()))
    };
    let first = (0..width).find(|&x| !blank(x)).unwrap_or(0);
    let last = (0..width).rev().find(|&x| !blank(x)).unwrap_or(0);
    let (mut best, mut at, mut run) = (0, 0, 0);
    for x in first..=last {
        if blank(x) {
            run += 1;
            if run > best {
                best = run;
                at = x + 1 - run;
            }
        } else {
            run = 0;
        }
    }
    (best, at)
}

/// On a screen wider than the tables' content, no column is wider than
/// its longest cell plus the gap: no two columns are further apart than
/// the gap, and the space left over stays at the right.
#[test]
fn no_column_is_wider_than_its_longest_cell_plus_the_gap() {
    let mut app = replay_app("preemption-heavy");
    special(&mut app, KeyCode::End);
    let tables: [(ViewId, &[&[&str]]); 4] = [
        (ViewId::Slots, &[&["Slots"]]),
        (ViewId::Transfers, &[&["Totals"], &["In flight", "Recent"]]),
        (ViewId::Histograms, &[&["Histograms"]]),
        (ViewId::Events, &[&["Events"]]),
    ];
    for (view, groups) in tables {
        key(&mut app, view_key(view));
        let lines = draw(&mut app, 240, 60);
        for titles in groups {
            let rows = panel_lines(&lines, titles);
            assert!(
                rows.len() > 1,
                "{titles:?} has no rows:\n{}",
                screen(&lines)
            );
            let (run, at) = widest_blank_run(&rows);
            assert!(
                run <= kvbm_console::ui::columns::GAP as usize,
                "{titles:?}: {run} blank columns at {at}:\n{}",
                rows.iter()
                    .map(|r| r.iter().collect::<String>())
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            // And the screen was wider than the content.
            assert!(
                rows.iter()
                    .all(|r| r.iter().rev().take(20).all(|c| c.is_whitespace()))
            );
        }
    }
}

#[test]
fn no_color_takes_every_colour_out_and_keeps_the_selection_visible() {
    use ratatui::style::{Color, Modifier};
    for view in ViewId::ALL {
        let mut app = replay_app("preemption-heavy");
        special(&mut app, KeyCode::End);
        key(&mut app, view_key(view));
        let colours = |app: &mut App| {
            app.resize(120, 40);
            app.tick();
            let mut t = Terminal::new(TestBackend::new(120, 40)).unwrap();
            t.draw(|f| app.render(f)).unwrap();
            let buf = t.backend().buffer().clone();
            let coloured = buf
                .content
                .iter()
                .filter(|c| c.fg != Color::Reset || c.bg != Color::Reset)
                .count();
            let reversed = buf
                .content
                .iter()
                .filter(|c| {
                    c.modifier.contains(Modifier::REVERSED) || c.modifier.contains(Modifier::BOLD)
                })
                .count();
            (coloured, reversed)
        };
        let (with, emphasis) = colours(&mut app);
        assert!(with > 0, "{view:?} draws no colour at all");
        app.ui.no_color = true;
        let (without, emphasis_kept) = colours(&mut app);
        assert_eq!(without, 0, "{view:?} keeps {without} coloured cells");
        assert_eq!(emphasis, emphasis_kept, "{view:?} lost its emphasis");
    }
}
