//! Drawing the console into a `TestBackend`, and the CPU-offload
//! walk-through's golden frames: shared by `tests/views.rs`, which compares
//! the frames with the files under `tests/frames/`, and by
//! `examples/update_frames.rs`, the one command that rewrites those files
//! (`cargo run -p kvbm-console --example update_frames`). No test writes
//! a golden file.

#![allow(dead_code)] // each includer uses its own part

use kvbm_console::app::{App, Source};
use kvbm_console::keys::ViewId;
use kvbm_console::model::{Model, ModelConfig};
use kvbm_console::source::ReplaySource;
use kvbm_events::Event;
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub fn key(app: &mut App, c: char) {
    app.key(KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE));
}

pub fn special(app: &mut App, code: KeyCode) {
    app.key(KeyEvent::new(code, KeyModifiers::NONE));
}

/// Draws `app` (the console, or `compare`'s two panes) at `w`×`h` and
/// returns the screen's lines.
pub fn draw<S: kvbm_console::run::Screen>(app: &mut S, w: u16, h: u16) -> Vec<String> {
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

pub fn screen(lines: &[String]) -> String {
    lines.join("\n")
}

pub fn replays() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../replays")
}

/// A replay of the log `replays/NAME`, at its start.
pub fn replay_app(name: &str) -> App {
    let read = kvbm_recorder::recorder::read_events(&replays().join(name), |_| {}).unwrap();
    assert!(read.damage.is_none());
    let events: Arc<[Event]> = read.events.into();
    let r = ReplaySource::new(events, 0, ModelConfig::default());
    App::new(Model::new(ModelConfig::default()), Source::Replay(r), name)
}

/// Where the golden frame `name` is kept.
pub fn golden_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/frames")
        .join(format!("{name}.txt"))
}

/// A frame as its golden file holds it.
pub fn golden_text(lines: &[String]) -> String {
    screen(lines) + "\n"
}

/// The CPU-offload walk-through replayed to its end, each view drawn:
/// (golden name, lines), in the order the keys reach them. `app` is left
/// on the request detail of A.
pub fn walkthrough_frames(app: &mut App) -> Vec<(&'static str, Vec<String>)> {
    special(app, KeyCode::End);
    let mut out = vec![
        ("cpu-offload-slots-160x48", draw(app, 160, 48)),
        ("cpu-offload-slots-80x24", draw(app, 80, 24)),
    ];
    for (k, name) in [
        ('2', "cpu-offload-transfers-160x48"),
        ('3', "cpu-offload-pools-160x48"),
        ('4', "cpu-offload-histograms-160x48"),
        ('6', "cpu-offload-events-160x48"),
    ] {
        key(app, k);
        out.push((name, draw(app, 160, 48)));
    }
    key(app, '1');
    special(app, KeyCode::Enter);
    out.push(("cpu-offload-detail-160x48", draw(app, 160, 48)));
    out
}

/// The sizes every view is drawn at: a small terminal, two common ones and
/// a large one.
pub const SIZES: [(u16, u16); 4] = [(80, 24), (120, 40), (160, 48), (240, 60)];

/// The key that opens `view`.
pub fn view_key(v: ViewId) -> char {
    char::from(b'1' + v.index() as u8)
}

/// The preemption-heavy log replayed to its end, every view (and a
/// request's detail) drawn at every size: (golden name, lines).
pub fn preemption_frames() -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
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
            out.push((
                format!("preemption-heavy-{name}-{w}x{h}"),
                draw(&mut app, w, h),
            ));
        }
        key(&mut app, '1');
        special(&mut app, KeyCode::Enter);
        out.push((
            format!("preemption-heavy-detail-{w}x{h}"),
            draw(&mut app, w, h),
        ));
    }
    out
}
