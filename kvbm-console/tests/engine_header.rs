//! What the engine runs as, in the console's header: a third header line
//! (` runs as SUMMARY`, cut with `…` at the screen's edge) when the source
//! knows it — a replay from its recording's sidecar, an attach from the
//! server's hello — and nothing else moved but the one row the views
//! give up for it. Drawn into a `TestBackend`, with `replay` also run for
//! real in tmux.

mod support;

use kvbm_attach::client::ClientConfig;
use kvbm_attach::server::{ServedEngine, Server, ServerConfig};
use kvbm_console::app::{App, Source};
use kvbm_console::model::{Model, ModelConfig};
use kvbm_console::remote::Remote;
use kvbm_console::source::ReplaySource;
use kvbm_events::ring::RingBuffer;
use kvbm_events::tier::Tier;
use kvbm_events::{Event, EventKind};
use kvbm_recorder::recorder::{RecorderConfig, RecordingSink};
use ratatui::crossterm::event::KeyModifiers;
use ratatui::crossterm::event::{KeyCode, MouseButton, MouseEvent, MouseEventKind};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{draw, replays, special};

use kvbm_testkit::data::{ENGINE_SUMMARY as SUMMARY, engine_info as info};

/// The preemption-heavy log replayed to its end, its engine said to run
/// as `summary` (or not said).
fn replay(summary: Option<&str>) -> App {
    let name = "preemption-heavy";
    let read = kvbm_recorder::recorder::read_events(&replays().join(name), |_| {}).unwrap();
    let events: Arc<[Event]> = read.events.into();
    let r = ReplaySource::new(events, 0, ModelConfig::default())
        .with_engine_summary(summary.map(str::to_string));
    let mut app = App::new(Model::new(ModelConfig::default()), Source::Replay(r), name);
    special(&mut app, KeyCode::End);
    app
}

/// With a summary, the header's third line says it, and the rest of the
/// frame is the frame without it, one row shorter: the two header lines
/// as they were, then the tabs, the view and the footer one row down.
#[test]
fn a_replay_header_says_what_the_engine_ran_as() {
    for (w, h) in support::SIZES {
        let with = draw(&mut replay(Some(SUMMARY)), w, h);
        let without = draw(&mut replay(None), w, h - 1);
        let want = format!(" runs as {SUMMARY}");
        let third = if want.chars().count() <= w as usize {
            want
        } else {
            let mut cut: String = want.chars().take(w as usize - 1).collect();
            cut.push('…');
            cut
        };
        assert_eq!(with[2], third, "at {w}x{h}");
        assert_eq!(with[..2], without[..2], "at {w}x{h}");
        assert_eq!(with[3..], without[2..], "at {w}x{h}");
    }
    // The frame at 80×24, whole.
    let frame = draw(&mut replay(Some(SUMMARY)), 80, 24);
    assert_eq!(
        frame[..4],
        [
            " kvbm  REPLAY ⏸ 1× 100%  │ 00:11.799  │ 1,365 ev/s │ lagged 0  dropped 0  histor",
            " slots 0 live / 60 shown · in flight 0 · paused 0 │ ⚠ stuck 0 · dest-full 0 · th",
            " runs as vLLM · tp 2 · async scheduling · G2 8,192 tokens (4.0 MiB a rank) · G3…",
            "1 Slots  2 Transfers  3 Pools  4 Histograms  5 Breakpoints  6 Events  7 Capacity",
        ],
        "\n{}",
        frame.join("\n")
    );
}

/// The mouse follows the tabs where they are drawn: a row lower with the
/// third header line.
#[test]
fn the_tabs_take_clicks_on_the_row_they_are_drawn_on() {
    let click = |app: &mut App, row: u16| {
        app.mouse(MouseEvent {
            kind: MouseEventKind::Down(MouseButton::Left),
            column: 10,
            row,
            modifiers: KeyModifiers::NONE,
        })
    };
    let mut app = replay(Some(SUMMARY));
    let lines = draw(&mut app, 120, 40);
    assert!(lines[3].starts_with("1 Slots  2 Transfers"), "{}", lines[3]);
    click(&mut app, 2); // the summary: nothing
    assert!(draw(&mut app, 120, 40)[4].contains("Slots —"));
    click(&mut app, 3); // "2 Transfers"
    let lines = draw(&mut app, 120, 40);
    assert!(!lines[4].contains("Slots —"), "{}", lines.join("\n"));
}

/// Attached to a server whose engine says what it runs as: the server's
/// hello says it at connect and the console's header shows the summary; a
/// server that says nothing leaves the header as it was.
#[test]
fn an_attached_header_says_what_the_engine_runs_as() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ring = Arc::new(RingBuffer::with_capacity(1024).unwrap());
    ring.push(Event {
        engine: 7,
        seq: 0,
        ts_ns: 1,
        iteration: 0,
        request: None,
        kind: EventKind::PoolGauge {
            tier: Tier::Host,
            capacity: 1,
            active: 0,
            inactive: 0,
            empty: 1,
        },
    });
    let cfg = ServerConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        ..ServerConfig::default()
    };
    for told in [true, false] {
        let mut engine = ServedEngine::new(ring.clone(), 7);
        if told {
            engine = engine.with_info(info());
        }
        let server = rt.block_on(Server::bind(cfg.clone(), engine)).unwrap();
        let url = format!("http://{}", server.local_addr());
        let handle = {
            let _g = rt.enter();
            server.spawn()
        };
        let remote = Remote::start(ClientConfig::new(&url).unwrap(), 1 << 16, rt.handle()).unwrap();
        let status = remote.status();
        let mut app = App::new(
            Model::new(ModelConfig::default()),
            Source::Live(remote.source()),
            status.url(),
        );
        let t = Instant::now();
        let lines = loop {
            app.pull(Instant::now());
            let lines = draw(&mut app, 120, 30);
            let done = app.model.applied() == 1
                && lines[0].contains("ATTACHED")
                && (!told || lines[2].contains("runs as"));
            if done || t.elapsed() > Duration::from_secs(20) {
                break lines;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if told {
            assert_eq!(
                lines[2],
                format!(" runs as {SUMMARY}"),
                "\n{}",
                lines.join("\n")
            );
            assert_eq!(status.engine_info(), Some(info()));
            assert!(lines[3].starts_with("1 Slots"), "{}", lines[3]);
        } else {
            // Give anything late a moment to (wrongly) show something.
            std::thread::sleep(Duration::from_millis(200));
            let lines = draw(&mut app, 120, 30);
            assert!(lines[0].contains("ATTACHED"), "{}", lines.join("\n"));
            assert!(lines[2].starts_with("1 Slots"), "{}", lines.join("\n"));
            assert_eq!(status.engine_info(), None);
        }
        drop(app);
        drop(remote);
        rt.block_on(handle.shutdown()).unwrap();
    }
}

/// An engine restarted on the same address running otherwise: at the
/// reconnection the new hello's description replaces the old one in the
/// header, and one that says nothing takes the third line away.
#[test]
fn a_restarted_engine_shows_what_it_runs_as_now() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ring = Arc::new(RingBuffer::with_capacity(1024).unwrap());
    let second = "vLLM · tp 4 · G2 none · G3 none";
    let mut info2 = info();
    info2["summary"] = second.into();
    // A new ServedEngine is a new engine run, as a restart is.
    let start = |addr: std::net::SocketAddr, info: Option<serde_json::Value>| {
        let mut engine = ServedEngine::new(ring.clone(), 7);
        if let Some(i) = info {
            engine = engine.with_info(i);
        }
        let cfg = ServerConfig {
            addr,
            ..ServerConfig::default()
        };
        // The port a stopped server let go of may take a moment to free.
        let t = Instant::now();
        let server = loop {
            match rt.block_on(Server::bind(cfg.clone(), engine.clone())) {
                Ok(s) => break s,
                Err(e) if t.elapsed() < Duration::from_secs(10) => {
                    eprintln!("binding {addr}: {e}; again");
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("binding {addr}: {e}"),
            }
        };
        let addr = server.local_addr();
        let _g = rt.enter();
        (addr, server.spawn())
    };
    let (addr, first) = start("127.0.0.1:0".parse().unwrap(), Some(info()));
    let mut cfg = ClientConfig::new(&format!("http://{addr}")).unwrap();
    cfg.backoff.max = Duration::from_millis(200);
    let remote = Remote::start(cfg, 1 << 16, rt.handle()).unwrap();
    let status = remote.status();
    let mut app = App::new(
        Model::new(ModelConfig::default()),
        Source::Live(remote.source()),
        status.url(),
    );
    let mut until = |what: &str, done: &dyn Fn(&[String]) -> bool| {
        let t = Instant::now();
        loop {
            app.pull(Instant::now());
            let lines = draw(&mut app, 120, 30);
            if done(&lines) {
                return lines;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "{what}:\n{}",
                lines.join("\n")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    until("the first engine", &|l| {
        l[0].contains("ATTACHED") && l[2] == format!(" runs as {SUMMARY}")
    });

    // Restarted, running otherwise.
    rt.block_on(first.shutdown()).unwrap();
    let (_, restarted) = start(addr, Some(info2.clone()));
    let lines = until("the restarted engine", &|l| {
        l[0].contains("RUN 2") && l[2] == format!(" runs as {second}")
    });
    assert!(lines[3].starts_with("1 Slots"), "{}", lines.join("\n"));
    assert_eq!(status.engine_info(), Some(info2));

    // Restarted again, saying nothing: two header lines again.
    rt.block_on(restarted.shutdown()).unwrap();
    let (_, silent) = start(addr, None);
    until("the silent engine", &|l| {
        l[0].contains("RUN 3") && l[2].starts_with("1 Slots")
    });
    assert_eq!(status.engine_info(), None);

    drop(app);
    drop(remote);
    rt.block_on(silent.shutdown()).unwrap();
}

fn gauge_at(seq: u64) -> Event {
    Event {
        engine: 0,
        seq,
        ts_ns: seq * 1_000_000,
        iteration: 0,
        request: None,
        kind: EventKind::PoolGauge {
            tier: Tier::Host,
            capacity: 4,
            active: 0,
            inactive: 0,
            empty: 4,
        },
    }
}

/// `kvbm-console replay DIR` for real: the summary comes from the
/// recording's sidecar.
#[test]
fn replay_in_a_terminal_shows_the_recorded_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("vllm.kvbm");
    let cfg = RecorderConfig {
        info: Some(info()),
        ..RecorderConfig::default()
    };
    let mut sink = RecordingSink::create(&dir, &cfg).unwrap();
    for seq in 0..20 {
        sink.append(&gauge_at(seq)).unwrap();
    }
    sink.finish().unwrap();
    let bin = env!("CARGO_BIN_EXE_kvbm-console");
    let dir_s = dir.display().to_string();
    let t = kvbm_testkit::tmux::Tmux::start(
        "engine-header",
        "",
        bin,
        &["replay", &dir_s],
        (140, 30),
        true,
    );
    t.wait_for("the replay", 30, |s| s.contains("REPLAY"));
    let s = t.screen();
    let lines: Vec<&str> = s.lines().collect();
    assert_eq!(lines[2].trim_end(), format!(" runs as {SUMMARY}"), "\n{s}");
    t.send("q");
    assert_eq!(t.exit_code(10), 0);
}
