//! `kvbm-console compare A B`: two recordings side by side, drawn into a
//! `TestBackend`: the header's deltas are `kvbm-recorder compare`'s
//! metrics, differing ones first; keys reach both panes and the mouse the
//! pane under it. The real binary runs in tmux in `console_e2e.rs`.

mod support;

use kvbm_console::compare::{Compare, MAX_METRIC_ROWS, metric_rows};
use kvbm_console::keys::ViewId;
use kvbm_console::model::ModelConfig;
use kvbm_console::open::open_replay;
use kvbm_console::run::Screen;
use kvbm_events::Event;
use kvbm_recorder::analysis::compare::Summary;
use ratatui::crossterm::event::{
    KeyCode, KeyEvent, KeyModifiers, MouseButton, MouseEvent, MouseEventKind,
};
use support::{draw, replays};

const A: &str = "preemption-heavy";
const B: &str = "mooncake-slice";

fn events(name: &str) -> Vec<Event> {
    kvbm_recorder::recorder::read_events(&replays().join(name), |_| {})
        .unwrap()
        .events
}

fn compare(a: &str, b: &str) -> Compare {
    let a = open_replay(&replays().join(a), None, ModelConfig::default()).unwrap();
    let b = open_replay(&replays().join(b), None, ModelConfig::default()).unwrap();
    let mut c = Compare::new(a.app, &a.events, b.app, &b.events);
    c.key(KeyEvent::new(KeyCode::End, KeyModifiers::NONE));
    c
}

/// The header's values are the summaries `kvbm-recorder compare` gates
/// on, every metric either recording has; those that differ come first,
/// the hit ratio first among them.
#[test]
fn the_header_holds_compares_metrics_differing_ones_first() {
    let (a, b) = (events(A), events(B));
    let rows = metric_rows(&a, &b).unwrap();
    let (ma, mb) = (
        Summary::from_events(&a).unwrap().metrics(),
        Summary::from_events(&b).unwrap().metrics(),
    );
    let mut names: Vec<&String> = ma.keys().chain(mb.keys()).collect();
    names.sort();
    names.dedup();
    assert_eq!(rows.len(), names.len());
    for r in &rows {
        assert_eq!(r.a, ma.get(&r.name).copied().unwrap_or(0.0), "{}", r.name);
        assert_eq!(r.b, mb.get(&r.name).copied().unwrap_or(0.0), "{}", r.name);
    }
    let first_equal = rows.iter().position(|r| r.a == r.b).unwrap_or(rows.len());
    assert!(first_equal > 0, "two different workloads differ somewhere");
    assert!(rows[first_equal..].iter().all(|r| r.a == r.b));
    assert_eq!(rows[0].name, "hit_ratio");
    // A recording against itself: nothing differs, every delta is `=`.
    let same = metric_rows(&a, &a).unwrap();
    assert!(same.iter().all(|r| r.a == r.b && r.text().ends_with(" =")));
}

/// The frame: the title names both logs, metric rows follow (at most
/// MAX_METRIC_ROWS, the rest counted), then each pane's own header, tabs
/// and view, side by side with a divider between them.
#[test]
fn both_recordings_are_drawn_side_by_side_under_the_deltas() {
    for (w, h) in [(80u16, 24u16), (160, 48), (240, 60)] {
        let mut c = compare(A, B);
        let frame = draw(&mut c, w, h);
        let text = frame.join("\n");
        assert!(
            frame[0].contains("COMPARE") && frame[0].contains(&format!("A: {A}")),
            "{text}"
        );
        assert!(frame[1].trim_start().starts_with("hit_ratio "), "{text}");
        let header = 1 + frame[1..]
            .iter()
            .take_while(|l| !l.contains(" kvbm  REPLAY"))
            .count();
        assert!(header - 1 <= MAX_METRIC_ROWS as usize, "{text}");
        let shown = frame[1..header]
            .iter()
            .map(|l| l.matches('→').count())
            .sum::<usize>();
        let total = c.rows().unwrap().len();
        if shown < total {
            assert!(
                text.contains(&format!("… {} more", total - shown)),
                "at {w}x{h}: {shown} of {total} shown\n{text}"
            );
        }
        // Each pane's own header: left at column 0, right past the middle.
        let panes = &frame[header];
        assert!(panes.starts_with(" kvbm  REPLAY"), "{text}");
        let right = panes.rfind(" kvbm  REPLAY").unwrap();
        assert_eq!(
            panes[..right].chars().count(),
            usize::from(w / 2 + 1),
            "{text}"
        );
        assert!(frame[h as usize - 2].contains('│'), "{text}");
    }
}

/// A key reaches both panes (the same view on each); a click on a tab
/// reaches only the pane it is in.
#[test]
fn keys_reach_both_panes_the_mouse_the_one_under_it() {
    let mut c = compare(A, B);
    let frame = draw(&mut c, 160, 48);
    c.key(KeyEvent::new(KeyCode::Char('3'), KeyModifiers::NONE));
    assert_eq!(c.panes[0].ui.view, ViewId::Pools);
    assert_eq!(c.panes[1].ui.view, ViewId::Pools);
    let tabs = frame.iter().position(|l| l.starts_with("1 Slots")).unwrap();
    let click = MouseEvent {
        kind: MouseEventKind::Down(MouseButton::Left),
        // "2 Transfers" in the right pane's tabs.
        column: 160 / 2 + 1 + 10,
        row: tabs as u16,
        modifiers: KeyModifiers::NONE,
    };
    c.mouse(click);
    assert_eq!(c.panes[0].ui.view, ViewId::Pools);
    assert_eq!(c.panes[1].ui.view, ViewId::Transfers);
    c.key(KeyEvent::new(KeyCode::Char('q'), KeyModifiers::NONE));
    assert!(c.quitting());
}
