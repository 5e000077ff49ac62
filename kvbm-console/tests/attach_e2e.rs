//! End to end on loopback: the real `kvbm-sim --serve` and the console's
//! remote source ([`kvbm_console::remote::Remote`]) driving an [`App`]
//! through [`RemoteControl`](kvbm_console::remote::RemoteControl):
//!
//! 1. a breakpoint on Decoding for one request pauses the engine; the
//!    console sees the pause (pushed by the server, and as a BreakpointHit
//!    in its model); resuming and clearing lets the request finish;
//! 2. a breakpoint set by a console that then goes away (dropped while the
//!    call is paused) is released by the server: a fresh console sees the
//!    request finish well before the pause's deadline.
//!
//! `kvbm-sim` is another package's binary: the test builds it with the
//! same cargo and profile (a no-op when it is fresh), or takes
//! `KVBM_SIM_BIN`.

use kvbm_attach::client::ClientConfig;
use kvbm_console::app::{App, Source};
use kvbm_console::model::{Model, ModelConfig};
use kvbm_console::remote::Remote;
use kvbm_events::breakpoint::BreakpointSpec;
use kvbm_events::control::{Control, ControlCommand, ControlError, ControlResult};
use kvbm_events::slot::SlotState;
use kvbm_testkit::served::{Served, serve};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn sim_bin() -> PathBuf {
    kvbm_testkit::bin::workspace_bin("kvbm-sim", "kvbm-sim")
}

fn serve_sim() -> (Served, String) {
    let mut cmd = Command::new(sim_bin());
    cmd.args(["--serve", "127.0.0.1:0", "--real-time", "1"])
        // Arrivals over 15 s: the second round needs a request still
        // decoding after the first round's has finished, and a loaded
        // machine can take that long over the first (10 requests, all
        // done by then, failed a CI run).
        .args(["--requests", "30", "--rate", "2", "--seed", "3"])
        .args(["--prompt-len", "256", "--output-len", "200"])
        .args(["--bp-deadline-s", "120", "--linger-s", "60"]);
    serve(cmd)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn attach(url: &str, rt: &tokio::runtime::Runtime) -> (Remote, App) {
    let remote = Remote::start(ClientConfig::new(url).unwrap(), 1 << 20, rt.handle()).unwrap();
    let app = App::new(
        Model::new(ModelConfig::default()),
        Source::Live(remote.source()),
        remote.status().url(),
    );
    (remote, app)
}

/// Pulls and ticks the app until `pred` holds; panics after `secs`.
fn wait<T>(app: &mut App, secs: u64, what: &str, mut pred: impl FnMut(&App) -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        app.pull(Instant::now());
        app.tick();
        if let Some(v) = pred(app) {
            return v;
        }
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "timed out waiting for {what} ({} events applied)",
            app.model.applied()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn header(app: &mut App) -> String {
    app.resize(120, 30);
    let mut t = Terminal::new(TestBackend::new(120, 30)).unwrap();
    t.draw(|f| app.render(f)).unwrap();
    let buf = t.backend().buffer();
    (0..120).map(|x| buf[(x, 0)].symbol().to_string()).collect()
}

/// A request now decoding whose slot was created last (so others are
/// still decoding when it is done), other than `not`.
fn decoding_request(app: &App, not: Option<&str>) -> Option<String> {
    app.model
        .state()
        .slots()
        .filter(|s| s.state == SlotState::Decoding && Some(&*s.request) != not)
        .max_by_key(|s| s.created_ns)
        .map(|s| s.request.to_string())
}

/// A request now decoding with the most tokens left to generate, other
/// than `not`. Output lengths vary: the newest request may be a few
/// tokens from its end, and finish before a breakpoint set on it lands
/// (the engine runs fast for a while after a pause, catching up with
/// real time).
fn longest_decoding_request(app: &App, not: Option<&str>) -> Option<String> {
    app.model
        .state()
        .slots()
        .filter(|s| s.state == SlotState::Decoding && Some(&*s.request) != not)
        .max_by_key(|s| u64::from(s.max_output_tokens).saturating_sub(s.generated))
        .map(|s| s.request.to_string())
}

fn finished(app: &App, r: &str) -> bool {
    app.model.state().slot(r).is_some_and(|s| s.is_finished())
}

fn paused_on(app: &App, r: &str) -> Option<u64> {
    app.views
        .breakpoints
        .control()?
        .paused
        .iter()
        .find(|p| p.call.request.as_deref() == Some(r))
        .map(|p| p.pause_id)
}

#[test]
fn breakpoints_over_the_wire_pause_resume_and_are_released_when_the_console_goes() {
    let (_sim, url) = serve_sim();
    let rt = runtime();
    let (remote, mut app) = attach(&url, &rt);
    let control = remote.control();
    let status = remote.status();
    wait(&mut app, 20, "the connection", |_| {
        status.state().is_connected().then_some(())
    });
    assert!(
        header(&mut app).contains(" ATTACHED "),
        "{}",
        header(&mut app)
    );

    // Round 1: pause, resume, clear, finish.
    let r = wait(&mut app, 30, "a decoding request", |a| {
        decoding_request(a, None)
    });
    let spec = BreakpointSpec::default()
        .with_state("Decoding")
        .with_request(r.clone());
    let bp = match control.execute(ControlCommand::Add { spec }, None) {
        Ok(ControlResult::Added(id)) => id,
        other => panic!("the breakpoint is not set: {other:?}"),
    };
    assert!(control.view().breakpoints.iter().any(|b| b.id == bp));
    let pause = wait(&mut app, 20, "the pause", |a| paused_on(a, &r));
    // The model saw the hit too (the BreakpointHit event).
    wait(&mut app, 10, "the BreakpointHit", |a| {
        (a.model.state().paused_count() > 0).then_some(())
    });
    assert!(!finished(&app, &r));
    let resume = ControlCommand::Resume {
        pause_id: Some(pause),
    };
    assert_eq!(
        control.execute(resume, None),
        Ok(ControlResult::Done(true)),
        "resumed"
    );
    assert_eq!(
        control.execute(ControlCommand::Clear { id: bp }, None),
        Ok(ControlResult::Done(true)),
        "cleared"
    );
    wait(&mut app, 30, "the request to finish", |a| {
        finished(a, &r).then_some(())
    });
    assert!(control.view().breakpoints.is_empty());
    assert_eq!(control.errors(), 0, "{:?}", control.take_error());

    // Round 2: pause, then the console goes away while paused.
    let r2 = wait(&mut app, 30, "another decoding request", |a| {
        longest_decoding_request(a, Some(&r)).filter(|x| !finished(a, x))
    });
    let spec = BreakpointSpec::default()
        .with_state("Decoding")
        .with_request(r2.clone());
    let added = control.execute(ControlCommand::Add { spec }, None);
    assert!(
        matches!(added, Ok(ControlResult::Added(_))),
        "the second breakpoint is not set: {added:?}"
    );
    wait(&mut app, 20, "the second pause", |a| paused_on(a, &r2));
    let paused_at = Instant::now();
    drop(app);
    drop(control);
    drop(remote);

    let (remote2, mut app2) = attach(&url, &rt);
    wait(&mut app2, 60, "the released request to finish", |a| {
        finished(a, &r2).then_some(())
    });
    // Well before the 120 s deadline: released by the disconnect.
    assert!(paused_at.elapsed() < Duration::from_secs(60));
    let c2 = remote2.control();
    c2.refresh();
    let view = c2.view();
    assert!(view.breakpoints.is_empty(), "{:?}", view.breakpoints);
    assert!(view.paused.is_empty());
}

#[test]
fn attach_to_nothing_shows_reconnecting_and_keys_fail_cleanly() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    let rt = runtime();
    let (remote, mut app) = attach(&url, &rt);
    let status = remote.status();
    wait(&mut app, 10, "a reconnect", |_| {
        matches!(
            status.state(),
            kvbm_attach::client::ConnState::Reconnecting { attempt, .. } if attempt >= 2
        )
        .then_some(())
    });
    let h = header(&mut app);
    assert!(h.contains("RECONNECTING (attempt"), "{h}");
    let c = remote.control();
    let spec = BreakpointSpec::default().with_state("Decoding");
    let e = c.execute(ControlCommand::Add { spec }, None);
    assert_eq!(
        e,
        Err(ControlError::Unavailable(
            "not connected to the server".to_string()
        ))
    );
    let resume = ControlCommand::Resume { pause_id: Some(1) };
    assert!(matches!(
        c.execute(resume, None),
        Err(ControlError::Unavailable(_))
    ));
    assert!(c.take_error().is_some());
}
