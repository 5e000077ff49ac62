//! An engine restarted under a console and a recorder, end to end on
//! loopback with the real binaries: `kvbm-sim --serve` on a fixed port is
//! killed (SIGKILL) and started again with the same command twice, while
//! `kvbm-recorder record --from` and the console's remote source
//! (`kvbm-console attach`'s, driving an `App`) stay connected:
//!
//! 1. once at once: the new run's sequence numbers are below the old
//!    run's when the clients reconnect;
//! 2. once after the clients' backoff has grown, so that the new run has
//!    passed the old run's sequence number (and time) by the time they
//!    reconnect: the case a client without run ids spliced silently,
//!    skipping the new run's first events.
//!
//! The real `kvbm-console attach URL`, in a terminal (tmux), is attached
//! too, and its header must say each new run (tmux is required under CI;
//! without it elsewhere that part is skipped, said on stderr).
//!
//! Each restart must show as a new run: a new recording starting at the
//! new run's seq 0 (the old one's sidecar saying the engine restarted and
//! where the next run is), in `inspect` and `check`, and in the console's
//! header, whose model starts afresh (no inconsistency from two runs).

use kvbm_attach::client::{ClientConfig, ConnState};
use kvbm_console::app::{App, Source};
use kvbm_console::model::{Model, ModelConfig};
use kvbm_console::remote::{Remote, RemoteStatus};
use kvbm_recorder::recorder::{Ended, Recording, read_sidecar};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The same command every time: a long real-time workload on `port`.
fn start_engine(port: u16) -> Proc {
    let mut child = Command::new(kvbm_testkit::bin::workspace_bin("kvbm-sim", "kvbm-sim"))
        .args(["--serve", &format!("127.0.0.1:{port}"), "--real-time", "1"])
        .args(["--requests", "100000", "--rate", "20", "--seed", "3"])
        .args(["--prompt-len", "256", "--output-len", "40"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("serving on "), "{line:?}");
    Proc(child)
}

/// The real `kvbm-console attach URL` in a detached tmux session on a
/// private socket (killed on drop).
struct Tmux {
    socket: String,
}

impl Tmux {
    fn attach(url: &str) -> Option<Tmux> {
        let have = Command::new("tmux")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success());
        if !have {
            assert!(
                std::env::var_os("CI").is_none(),
                "tmux is required under CI"
            );
            eprintln!("SKIPPED (the terminal part): tmux is not installed");
            return None;
        }
        let socket = format!("kvbm-restart-{}", std::process::id());
        let cmd = format!(
            "{} attach {url} 2>/dev/null; sleep 30",
            env!("CARGO_BIN_EXE_kvbm-console")
        );
        let st = Command::new("tmux")
            .args(["-L", &socket, "-f", "/dev/null", "new-session", "-d"])
            .args(["-s", "t", "-x", "160", "-y", "30", &cmd])
            .status()
            .unwrap();
        assert!(st.success());
        Some(Tmux { socket })
    }

    /// The first line of the screen: the header.
    fn header(&self) -> String {
        let o = Command::new("tmux")
            .args(["-L", &self.socket, "capture-pane", "-p", "-t", "t"])
            .output()
            .unwrap();
        let s = String::from_utf8_lossy(&o.stdout).into_owned();
        s.lines().next().unwrap_or_default().to_string()
    }

    fn wait_header(&self, what: &str, secs: u64) {
        let t = Instant::now();
        loop {
            let h = self.header();
            if h.contains(what) {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(secs),
                "the terminal's header never said {what:?}: {h}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["-L", &self.socket, "kill-server"])
            .status();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn recorder_bin() -> PathBuf {
    kvbm_testkit::bin::workspace_bin("kvbm-cli", "kvbm-recorder")
}

fn header(app: &mut App) -> String {
    app.resize(160, 30);
    let mut t = Terminal::new(TestBackend::new(160, 30)).unwrap();
    t.draw(|f| app.render(f)).unwrap();
    let buf = t.backend().buffer();
    (0..160).map(|x| buf[(x, 0)].symbol().to_string()).collect()
}

/// Pulls and ticks the app until `pred` holds; panics after `secs`.
fn wait_app(app: &mut App, secs: u64, what: &str, mut pred: impl FnMut(&mut App) -> bool) {
    let t = Instant::now();
    loop {
        app.pull(Instant::now());
        app.tick();
        if pred(app) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "timed out waiting for {what}: {}",
            header(app)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Pulls the app for `d`.
fn run_for(app: &mut App, d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        app.pull(Instant::now());
        app.tick();
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn cli(args: &[&str], dir: &Path) -> Output {
    Command::new(recorder_bin())
        .args(args)
        .arg(dir)
        .output()
        .unwrap()
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// The recorder's stderr lines, as they come.
fn lines_of(child: &mut Child) -> Arc<Mutex<Vec<String>>> {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let l = lines.clone();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            l.lock().unwrap().push(line);
        }
    });
    lines
}

/// The wait the recorder announced last, in seconds ("retry N in X s").
fn recorder_retry_in(lines: &Mutex<Vec<String>>) -> Option<f64> {
    let l = lines.lock().unwrap();
    let last = l.iter().rev().find(|l| l.starts_with("disconnected"))?;
    let (_, rest) = last.rsplit_once(" in ")?;
    rest.trim_end_matches(" s").parse().ok()
}

/// The last seq the server held when the recorder last connected.
fn held_at_last_connect(lines: &Mutex<Vec<String>>) -> Option<u64> {
    let l = lines.lock().unwrap();
    let last = l.iter().rev().find(|l| l.starts_with("connected to"))?;
    // "connected to URL (engine E, run R, holding seq A..=B)"
    let (_, rest) = last.rsplit_once("..=")?;
    rest.split(')').next()?.parse().ok()
}

#[test]
fn engine_restarts_are_new_runs_in_the_recording_inspect_check_and_header() {
    let tmp = tempfile::tempdir().unwrap();
    let rec_dir = tmp.path().join("rec");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let mut engine = start_engine(port);

    let mut recorder = Command::new(recorder_bin())
        .args(["record", "--from", &url, "--out"])
        .arg(&rec_dir)
        .args(["--duration-s", "120"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rec_lines = lines_of(&mut recorder);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let remote = Remote::start(ClientConfig::new(&url).unwrap(), 1 << 20, rt.handle()).unwrap();
    let status = remote.status();
    let mut app = App::new(
        Model::new(ModelConfig::default()),
        Source::Live(remote.source()),
        status.url(),
    );
    let term = Tmux::attach(&url);
    wait_app(&mut app, 30, "run 1's events", |a| a.model.applied() > 300);
    if let Some(t) = &term {
        t.wait_header(" ATTACHED ", 30);
    }
    assert!(
        header(&mut app).contains(" ATTACHED "),
        "{}",
        header(&mut app)
    );
    run_for(&mut app, Duration::from_millis(1500));

    // Restart 1, at once.
    drop(engine);
    engine = start_engine(port);
    wait_app(&mut app, 30, "run 2 in the header", |a| {
        header(a).contains("RUN 2 (engine restarted)")
    });
    if let Some(t) = &term {
        t.wait_header("RUN 2 (engine restarted)", 30);
    }
    wait_app(&mut app, 30, "run 2's events", |a| a.model.applied() > 100);
    run_for(&mut app, Duration::from_millis(800));

    // Restart 2, once both clients wait long enough between attempts that
    // the new run overtakes the old one before they are back.
    drop(engine);
    wait_until_both_back_off(&mut app, &status, &rec_lines);
    let _engine = start_engine(port);
    wait_app(&mut app, 30, "run 3 in the header", |a| {
        header(a).contains("RUN 3 (engine restarted)")
    });
    if let Some(t) = &term {
        t.wait_header("RUN 3 (engine restarted)", 30);
    }
    drop(term);
    wait_app(&mut app, 30, "run 3's events", |a| a.model.applied() > 100);
    run_for(&mut app, Duration::from_millis(500));
    assert_eq!(
        app.model.state().inconsistencies().total(),
        0,
        "the console's model holds run 3 alone"
    );
    // Run 3 alone, from its seq 0: not run 3's events folded onto the state
    // of runs 1 and 2 (where they would be stale, below the seq seen).
    let stream = app.model.state().stream().clone();
    assert_eq!(stream.stale, 0, "{stream:?}");
    assert_eq!(stream.first_seq, Some(0), "{stream:?}");
    assert_eq!(
        Some(stream.events),
        stream.last_seq.map(|s| s + 1),
        "{stream:?}"
    );
    let run3_held_at_connect = held_at_last_connect(&rec_lines).expect("a connect line");

    // Ctrl-C: the recorder finishes cleanly.
    let pid = recorder.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let st = recorder.wait().unwrap();
    drop(app);
    drop(remote);
    let said = rec_lines.lock().unwrap().join("\n");
    assert!(st.success(), "{said}");
    assert_eq!(said.matches("the engine restarted").count(), 2, "{said}");

    check_the_recordings(&rec_dir, run3_held_at_connect);
}

/// Waits (up to 30 s) until the console and the recorder, reconnecting,
/// each wait long enough before their next attempt (2.5 s and 3 s) that a
/// new run can overtake the old one's sequence numbers meanwhile.
fn wait_until_both_back_off(app: &mut App, status: &RemoteStatus, rec_lines: &Mutex<Vec<String>>) {
    let t = Instant::now();
    loop {
        app.pull(Instant::now());
        let console_wait = match status.state() {
            ConnState::Reconnecting { next_try, .. } => {
                next_try.saturating_duration_since(Instant::now())
            }
            _ => Duration::ZERO,
        };
        let recorder_wait = recorder_retry_in(rec_lines).unwrap_or(0.0);
        if console_wait >= Duration::from_millis(2500) && recorder_wait >= 3.0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the clients never backed off: console {console_wait:?}, recorder {recorder_wait} s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Three recordings, one per run, linked to each other, each whole and
/// said to have ended by a restart (but the last) by `inspect` and
/// `check`; the third run had overtaken the second when the recorder
/// reconnected to it.
fn check_the_recordings(rec_dir: &Path, run3_held_at_connect: u64) {
    // Three recordings, one per run, each from the run's first event.
    let dirs = [
        rec_dir.to_path_buf(),
        rec_dir.with_file_name("rec-run2"),
        rec_dir.with_file_name("rec-run3"),
    ];
    let recs: Vec<Recording> = dirs
        .iter()
        .map(|d| read_sidecar(d).unwrap_or_else(|| panic!("{}: no sidecar", d.display())))
        .collect();
    let runs: Vec<_> = recs.iter().map(|r| r.run.expect("a run id")).collect();
    assert!(runs[0] != runs[1] && runs[1] != runs[2] && runs[0] != runs[2]);
    for (i, r) in recs.iter().enumerate() {
        assert_eq!(r.first_seq, Some(0), "run {}: {r:?}", i + 1);
        assert_eq!((r.lost, r.missed_before_start), (0, 0), "run {}", i + 1);
        assert!(r.events > 100, "run {}: {} events", i + 1, r.events);
    }
    assert_eq!(recs[0].ended, Ended::NewRun { run: runs[1] });
    assert_eq!(recs[0].next.as_deref(), Some(dirs[1].as_path()));
    assert_eq!(recs[1].ended, Ended::NewRun { run: runs[2] });
    assert_eq!(recs[1].previous.as_deref(), Some(dirs[0].as_path()));
    assert_eq!(recs[1].next.as_deref(), Some(dirs[2].as_path()));
    assert_eq!(recs[2].previous.as_deref(), Some(dirs[1].as_path()));
    assert!(matches!(&recs[2].ended, Ended::Finished { why } if why == "interrupted"));
    // The second restart is the one a client without run ids spliced: run 3
    // had passed run 2's last sequence number when the clients came back.
    let run2_last = recs[1].last_seq.unwrap();
    eprintln!(
        "runs of {}, {} and {} events; run 3 held up to seq {run3_held_at_connect} when the \
         recorder reconnected, run 2 ended at seq {run2_last}",
        recs[0].events, recs[1].events, recs[2].events
    );
    assert!(
        run3_held_at_connect > run2_last,
        "run 3 had not overtaken run 2 ({run3_held_at_connect} <= {run2_last}): the test did \
         not reach the case it is for"
    );

    // inspect and check say so.
    for (i, d) in dirs.iter().enumerate() {
        let o = cli(&["inspect", "--json"], d);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["verdict"], "whole", "run {}: {v}", i + 1);
        assert_eq!(v["run"], runs[i].to_string());
        let o = cli(&["check"], d);
        let text = out(&o);
        assert_eq!(o.status.code(), Some(0), "run {}: {text}", i + 1);
        if i < 2 {
            assert!(text.contains("the engine restarted"), "{text}");
            let o = cli(&["inspect"], d);
            assert!(
                out(&o).contains("ended         the engine restarted"),
                "{}",
                out(&o)
            );
        }
    }
}
