//! Every view drawn into a `TestBackend` at 80×24, 120×40, 160×48 and
//! 240×60: empty, after a recorded log, and overflowing; two logs from
//! `replays/` driven through the reducer and the UI state to known frames
//! at every size: golden files under `tests/frames/` (compared, never
//! written here: `cargo run -p kvbm-console --example update_frames`
//! rewrites them), and, independently of those files, what each frame of
//! the walk-through must show, worked out from its scenario; and tables no
//! wider than what they hold.

mod support;

use kvbm_console::app::{App, Source};
use kvbm_console::keys::ViewId;
use kvbm_console::model::{Model, ModelConfig};
use kvbm_events::slot::SlotState;
use kvbm_events::tier::Tier;
use kvbm_events::{Direction, Event, EventKind, RequestId};
use ratatui::crossterm::event::{KeyCode, KeyModifiers};
use support::{SIZES, draw, key, replay_app, screen, special, view_key};

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

/// A call seen paused while the link is down may be gone (the engine
/// died): the header says the count is the last one seen, and stops
/// saying so once the link is up.
#[test]
fn a_paused_count_is_marked_last_seen_while_the_link_is_down() {
    use kvbm_console::source::{Badge, Link, LiveSource, Tone};
    use std::sync::atomic::{AtomicBool, Ordering};
    struct Flaky(AtomicBool);
    impl Link for Flaky {
        fn badge(&self, _: std::time::Instant) -> Badge {
            if self.0.load(Ordering::Relaxed) {
                Badge::new("RECONNECTING", Tone::Caution)
            } else {
                Badge::new("ATTACHED", Tone::Ok)
            }
        }
    }
    let ring = std::sync::Arc::new(kvbm_events::ring::RingBuffer::with_capacity(16).unwrap());
    let link = std::sync::Arc::new(Flaky(AtomicBool::new(false)));
    let src = LiveSource::new(ring.clone(), None).with_link(link.clone());
    let mut app = App::new(Model::new(ModelConfig::default()), Source::Live(src), "t");
    // Events that arrive once the console follows the ring.
    ring.push(Event {
        engine: 0,
        seq: 0,
        ts_ns: 1,
        iteration: 0,
        request: Some(RequestId::from("r")),
        kind: EventKind::BreakpointHit {
            breakpoint: 1,
            entry: kvbm_events::EntryPoint::GetNumNewMatchedTokens,
            deadline_ns: u64::MAX,
        },
    });
    app.pull(std::time::Instant::now());
    let s = screen(&draw(&mut app, 120, 30));
    assert!(s.contains("paused 1 ") && !s.contains("last seen"), "{s}");
    link.0.store(true, Ordering::Relaxed);
    let s = screen(&draw(&mut app, 120, 30));
    assert!(s.contains("paused 1 (last seen)"), "{s}");
    link.0.store(false, Ordering::Relaxed);
    let s = screen(&draw(&mut app, 120, 30));
    assert!(!s.contains("last seen"), "{s}");
}

/// On a terminal too narrow for the transfer totals' headers, each is cut
/// at its end with `…` (never from its start, as the table widget cuts a
/// right-aligned cell).
#[test]
fn narrow_totals_headers_are_cut_at_their_end() {
    let names = [
        "Dir",
        "Planned",
        "Done",
        "Skipped",
        "Cancelled",
        "Failed",
        "Blocks",
        "Bytes",
        "Rate",
    ];
    for w in [50u16, 60, 70] {
        let mut app = replay_app("preemption-heavy");
        special(&mut app, KeyCode::End);
        key(&mut app, '2');
        let lines = draw(&mut app, w, 15);
        let header = lines
            .iter()
            .find(|l| l.contains("Dir"))
            .unwrap_or_else(|| panic!("no totals header at {w}:\n{}", lines.join("\n")));
        for token in header.trim_matches(['│', ' ']).split_whitespace() {
            let t = token.trim_end_matches('…');
            assert!(
                names.iter().any(|n| n.starts_with(t)),
                "{token:?} is not the start of a header at {w} columns: {header}"
            );
        }
    }
}

/// While the help is open, the list keys scroll it (on a terminal too
/// short for it) and reach nothing behind it; at 80×24 its last line can
/// be brought on screen.
#[test]
fn the_help_takes_the_keys_while_open_and_scrolls_to_its_end() {
    let mut app = overflowing();
    draw(&mut app, 80, 24);
    let before = app.list().selected;
    key(&mut app, '?');
    let s = screen(&draw(&mut app, 80, 24));
    let title = |s: &str| {
        // "…; lines A–B of N, …"
        let at = s
            .find("; lines ")
            .expect("a help too long for 80×24 says so");
        let rest = &s[at + 8..];
        let nums: Vec<u16> = rest
            .split(|c: char| !c.is_ascii_digit())
            .filter(|t| !t.is_empty())
            .take(3)
            .map(|t| t.parse().unwrap())
            .collect();
        (nums[0], nums[1], nums[2])
    };
    let (a, _, _) = title(&s);
    assert_eq!(a, 1, "{s}");
    for _ in 0..5 {
        key(&mut app, 'j');
    }
    let (a, _, _) = title(&screen(&draw(&mut app, 80, 24)));
    assert_eq!(a, 6);
    key(&mut app, 'G');
    let s = screen(&draw(&mut app, 80, 24));
    let (_, b, n) = title(&s);
    assert_eq!(b, n, "the end is on screen:\n{s}");
    // Keys of the view behind do nothing: no sort, no filter prompt.
    key(&mut app, 's');
    key(&mut app, '/');
    assert!(app.ui.input.is_none());
    special(&mut app, KeyCode::Esc);
    assert_eq!(app.list().selected, before, "the selection did not move");
    let s = screen(&draw(&mut app, 80, 24));
    assert!(!s.contains("Help — keys"), "{s}");
    assert!(s.contains("sorted by state"), "still the first sort:\n{s}");
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

/// `lines` against its golden file, which only this test's counterpart
/// `examples/update_frames.rs` writes.
fn golden(name: &str, lines: &[String]) {
    let path = support::golden_path(name);
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (cargo run -p kvbm-console --example update_frames writes it)",
            path.display()
        )
    });
    assert_eq!(
        support::golden_text(lines),
        want,
        "frame {name} differs from {} (if the change is intended: \
         cargo run -p kvbm-console --example update_frames, and review the diff)",
        path.display()
    );
}

/// The cells of the table row whose first cell is `first` (box-drawing
/// borders removed); panics with the frame when there is none.
fn row<'a>(lines: &'a [String], first: &str) -> Vec<&'a str> {
    lines
        .iter()
        .map(|l| l.trim_matches(|c| c == '│' || c == ' '))
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cells| cells.first() == Some(&first))
        .unwrap_or_else(|| panic!("no row {first:?} in:\n{}", screen(lines)))
}

/// Some table row starts with `cells` (however wide its columns are).
fn has_row(lines: &[String], cells: &[&str]) {
    assert!(
        lines.iter().any(|l| {
            let got: Vec<&str> = l
                .trim_matches(|c| c == '│' || c == ' ')
                .split_whitespace()
                .collect();
            got.starts_with(cells)
        }),
        "no row {cells:?} in:\n{}",
        screen(lines)
    );
}

fn has(lines: &[String], text: &str) {
    assert!(
        lines.iter().any(|l| l.contains(text)),
        "{text:?} not in:\n{}",
        screen(lines)
    );
}

/// What every frame of the walk-through's end shows in its header: the
/// replay paused at its end, 10.000 s of engine time (B ends 719,715 ns
/// after 10 s), nothing lost, both slots finished, nothing in flight or
/// paused; on a wide screen also the log's name and its 49 events and the
/// lints, all zero.
fn walkthrough_header(lines: &[String]) {
    let wide = lines.iter().any(|l| l.chars().count() > 80);
    for (text, narrow_too) in [
        ("REPLAY ⏸ 1× 100%", true),
        ("│ 00:10.000 ", true),
        ("lagged 0  dropped 0", true),
        ("slots 0 live / 2 shown · in flight 0 · paused 0", true),
        ("lagged 0  dropped 0  history-dropped 0", false),
        ("cpu-offload-walkthrough · 49 events", false),
        ("stuck 0 · dest-full 0 · thrash 0 · near-deadline 0", false),
    ] {
        if !(wide || narrow_too) {
            continue;
        }
        assert!(
            lines[..2].iter().any(|l| l.contains(text)),
            "header lacks {text:?}:\n{}",
            screen(lines)
        );
    }
}

/// What each frame must show, from the scenario (see
/// `kvbm-recorder/tests/replays.rs`, which derives the walk-through's 49
/// events): A has 32 prompt tokens and hits nothing; B has 49 and hits A's
/// 2 blocks (32 tokens) on the host; both finish with their one token from
/// the prefill (no decode, so no TTFT); 2 stores G1→G2 (A's 2 blocks, B's
/// third: 3 blocks of 16 tokens × 4 bytes = 192 B) and 1 load G2→G1 (2
/// blocks, 128 B), all completed.
fn walkthrough_contents(frames: &[(&str, Vec<String>)]) {
    let frame = |name: &str| {
        &frames
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("no frame {name}"))
            .1
    };
    for (_, lines) in frames {
        walkthrough_header(lines);
    }

    walkthrough_slots(
        frame("cpu-offload-slots-160x48"),
        frame("cpu-offload-slots-80x24"),
    );
    walkthrough_transfers(frame("cpu-offload-transfers-160x48"));
    walkthrough_pools(frame("cpu-offload-pools-160x48"));
    walkthrough_histograms(frame("cpu-offload-histograms-160x48"));
    walkthrough_events(frame("cpu-offload-events-160x48"));
    walkthrough_detail(frame("cpu-offload-detail-160x48"));
}

/// The slots view, wide and narrow: both requests finished, B with A's
/// 32 tokens hit on the host.
fn walkthrough_slots(slots: &[String], narrow: &[String]) {
    // Slots, wide: Request State Age Prompt Gen G1 G2 G3 HitG1 HitG2 HitG3
    // Hitext Xfer TTFT.
    has(slots, "Slots — 2 shown");
    assert_eq!(
        row(slots, "Request"),
        [
            "Request", "State", "Age", "Prompt", "Gen", "G1", "G2", "G3", "Hit", "G1", "Hit", "G2",
            "Hit", "G3", "Hit", "ext", "Xfer", "TTFT"
        ]
    );
    // A: created at 0, so 10.00 s old at the end; B: 719.7 µs.
    assert_eq!(
        row(slots, "A"),
        [
            "A", "Finished", "10.00s", "32", "0", "0", "0", "0", "0", "0", "0", "0", "0", "-"
        ]
    );
    assert_eq!(
        row(slots, "B"),
        [
            "B", "Finished", "719.7µs", "49", "0", "0", "0", "0", "0", "32", "0", "0", "0", "-"
        ]
    );
    // Slots, narrow: the tiers folded into G1/G2/G3 and one Hit column.
    assert_eq!(
        row(narrow, "A"),
        ["A", "Finished", "10.00s", "32", "0", "0/0/0", "0", "0"]
    );
    assert_eq!(
        row(narrow, "B"),
        ["B", "Finished", "719.7µs", "49", "0", "0/0/0", "32", "0"]
    );
}

/// The transfers view: the totals per direction and the three transfers,
/// newest first.
fn walkthrough_transfers(t: &[String]) {
    // Transfers: Dir Planned Done Skipped Cancelled Failed Blocks Bytes Rate.
    assert_eq!(
        row(t, "G1→G2")[..8],
        ["G1→G2", "2", "2", "0", "0", "0", "3", "192B"]
    );
    assert_eq!(
        row(t, "G2→G1")[..8],
        ["G2→G1", "1", "1", "0", "0", "0", "2", "128B"]
    );
    has(t, "In flight — 0 candidates · 0 batches");
    has(t, "Recent — 3 kept");
    // Id Request Status Dir Blocks Bytes Latency Batch, newest first.
    assert_eq!(row(t, "#3")[..5], ["#3", "B", "Completed", "G1→G2", "1"]);
    assert_eq!(row(t, "#2")[..5], ["#2", "B", "Completed", "G2→G1", "2"]);
    assert_eq!(row(t, "#1")[..5], ["#1", "A", "Completed", "G1→G2", "2"]);
}

/// The pools view: occupancy, hit rates and registrations per tier.
fn walkthrough_pools(p: &[String]) {
    // Pools: G1 holds A's 2 blocks and B's third (inactive); B's loaded
    // copies were duplicates of A's (5 registered, 2 duplicates); G1's
    // prefix cache is off, so its 4 looked-up blocks (1 for A, 3 for B)
    // all miss, while G2 hits 2 of the same 4. No disk tier.
    has(p, "G1 device — 100 blocks");
    has(p, "active 0  ▓ inactive 3  ░ free 97");
    has(p, "hit rate 0.0% (0 of 4 blocks looked up, 2 lookups)");
    has(p, "registered 5 (2 duplicates)");
    has(p, "G2 host — 50 blocks");
    has(p, "active 0  ▓ inactive 3  ░ free 47");
    has(p, "hit rate 50.0% (2 of 4 blocks looked up, 2 lookups)");
    has(p, "registered 3 (0 duplicates)");
    has(p, "no gauge seen");
}

/// The histograms view: the time in each state and the transfers' latencies.
fn walkthrough_histograms(h: &[String]) {
    // Histograms: Series Count p50 p90 p99 Max. Prefilling: A 960 µs, B
    // 719.7 µs; every other interval is an instant.
    has(h, "Histograms — 2 requests, 2 finished");
    assert_eq!(row(h, "TTFT")[..2], ["TTFT", "0"]);
    for (state, count) in [
        ("Initialized", "2"),
        ("OnboardStaged", "1"),
        ("Onboarding", "1"),
        ("Finishing", "2"),
    ] {
        let r = h
            .iter()
            .map(|l| l.trim_matches(|c| c == '│' || c == ' '))
            .find(|l| l.starts_with(&format!("in {state} ")))
            .unwrap_or_else(|| panic!("no {state} row"));
        let cells: Vec<_> = r.split_whitespace().collect();
        assert_eq!(cells[..7], ["in", state, count, "0ns", "0ns", "0ns", "0ns"]);
    }
    has_row(
        h,
        &[
            "in",
            "Prefilling",
            "2",
            "719.9µs",
            "960.0µs",
            "960.0µs",
            "960.0µs",
        ],
    );
    has_row(h, &["transfer", "G1→G2", "2", "0ns"]);
    has_row(h, &["transfer", "G2→G1", "1", "0ns"]);
}

/// The events view: all 49 kept, the screen following the last.
fn walkthrough_events(e: &[String]) {
    // Events: all 49 kept, following, so the screen ends at seq 48 (the
    // last host gauge) with consecutive seqs above it.
    has(e, "Events — 49 shown of 49 kept · following");
    let seqs: Vec<u64> = e
        .iter()
        .filter(|l| l.starts_with('│'))
        .filter_map(|l| {
            l.trim_start_matches('│')
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(seqs.last(), Some(&48));
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    assert_eq!(
        row(e, "48")[1..],
        [
            "00:10.000",
            "3",
            "-",
            "PoolGauge",
            "G2",
            "active",
            "0",
            "inactive",
            "3",
            "free",
            "47",
            "of",
            "50"
        ]
    );
}

/// Request A's detail: its summary, timeline and own events.
fn walkthrough_detail(d: &[String]) {
    // Request A's detail: its 12 events (the others of iterations 1 and 2
    // carry no request), 960 µs of prefill, its one store.
    has(d, "Request A");
    has(d, "Finished  age 10.00s");
    has(d, "prompt 32 · computed 32");
    has(d, "■ Prefilling 960.0µs");
    has(d, "#1 G1→G2 2 blk completed");
    has(d, "Events of A (12)");
    let a_seqs: Vec<u64> = d
        .iter()
        .skip_while(|l| !l.contains("Events of A"))
        .filter_map(|l| {
            l.trim_start_matches('│')
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(a_seqs, [0, 1, 2, 3, 4, 5, 8, 9, 11, 12, 18, 19]);
}

/// The CPU-offload walk-through, replayed to its end through the reducer
/// and the UI state, shows what the scenario implies and draws exactly the
/// stored frames.
#[test]
fn the_cpu_offload_replay_reaches_known_frames() {
    let mut app = replay_app("cpu-offload-walkthrough");
    let frames = support::walkthrough_frames(&mut app);
    assert_eq!(frames.len(), 7);
    walkthrough_contents(&frames);
    for (name, lines) in &frames {
        golden(name, lines);
    }
    // Stepping back one event at a time and forward again lands on the
    // same frame (the checkpointed model rebuilds exactly).
    special(&mut app, KeyCode::Esc);
    for _ in 0..10 {
        key(&mut app, ',');
    }
    for _ in 0..10 {
        key(&mut app, '.');
    }
    assert_eq!(draw(&mut app, 160, 48), frames[0].1);
}

/// The preemption-heavy log, replayed to its end, draws these exact
/// frames in every view (and a request's detail) at every size.
#[test]
fn every_view_reaches_known_frames_at_every_size() {
    let frames = support::preemption_frames();
    assert_eq!(frames.len(), SIZES.len() * (ViewId::ALL.len() + 1));
    for (name, lines) in &frames {
        golden(name, lines);
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
            let mut t =
                ratatui::Terminal::new(ratatui::backend::TestBackend::new(120, 40)).unwrap();
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
    // And each lookup again in its own row of the request's events.
    assert!(
        s.lines()
            .any(|l| l.contains("PrefixLookup") && l.contains("tokens: hit G1")),
        "{s}"
    );
}

/// A request another connector served (kvbm beside it in vLLM's
/// MultiConnector): its detail and its event say "external (other
/// connector)", and the slots table counts those tokens among its hits.
#[test]
fn another_connectors_hit_is_labelled_external() {
    let mut m = Model::new(ModelConfig::default());
    let r = Some("beside-1");
    for (seq, kind) in [
        EventKind::SlotCreated {
            prompt_tokens: 65,
            max_output_tokens: 8,
        },
        EventKind::MatchResult {
            tier: Tier::Device,
            looked_up: 4,
            hit_blocks: 1,
            hit_tokens: 16,
        },
        EventKind::ExternalHit {
            from_token: 16,
            tokens: 48,
        },
        EventKind::SlotTransition {
            from: SlotState::Initialized,
            to: SlotState::Prefilling,
        },
    ]
    .into_iter()
    .enumerate()
    {
        m.apply(ev(seq as u64, seq as u64 * 1_000_000, r, kind));
    }
    let mut app = App::new(m, Source::Fixed, "beside");
    let narrow = draw(&mut app, 100, 30);
    has_row(&narrow, &["beside-1", "Prefilling"]);
    assert_eq!(
        row(&narrow, "beside-1")[6],
        "64",
        "the hits, external among them"
    );
    let slots = draw(&mut app, 160, 48);
    assert_eq!(
        row(&slots, "beside-1")[8..12],
        ["16", "0", "0", "48"],
        "hits on G1, G2, G3, and external"
    );
    special(&mut app, KeyCode::Enter);
    let detail = draw(&mut app, 160, 48);
    has(
        &detail,
        "cached tokens hit G1 16 G2 0 G3 0 external (other connector) 48",
    );
    has(
        &detail,
        "48 tokens external (other connector) from token 16",
    );
}
