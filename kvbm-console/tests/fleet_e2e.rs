//! End to end: the fleet console (`kvbm-console attach nats://…`, the
//! real binary in tmux) against eight simulated engines publishing to a
//! real `nats-server`: the Fleet view lists them, `Enter` drills into one
//! and shows its slots, a breakpoint typed there pauses a request on that
//! engine only (through `kvbm.control.<engine>`), the Fleet view shows the
//! pause on that engine's row alone, and clearing it releases it.
//!
//! Needs tmux (as the console's other end-to-end tests) and
//! `scripts/setup-nats.sh`.

use kvbm_testkit::nats::NatsServer;
use kvbm_testkit::tmux::Tmux;
use std::process::{Child, Command, Stdio};

/// `kvbm-console ARGS` in a real terminal (tmux; the test fails without it).
fn console(name: &str, args: &[&str], w: u16, h: u16) -> Tmux {
    Tmux::start(
        name,
        "",
        env!("CARGO_BIN_EXE_kvbm-console"),
        args,
        (w, h),
        true,
    )
}

struct Sims(Vec<Child>);

impl Drop for Sims {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The PAUSED column of each engine row of the Fleet view.
fn paused_by_engine(screen: &str) -> Vec<(String, String)> {
    screen
        .lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.trim_start_matches('│').split_whitespace().collect();
            match cols.as_slice() {
                [name, _state, rest @ ..] if name.starts_with("eng-") && rest.len() >= 12 => {
                    Some((name.to_string(), rest[10].to_string()))
                }
                _ => None,
            }
        })
        .collect()
}

#[test]
fn fleet_console_drills_in_and_breaks_on_one_engine_through_nats() {
    let nats = NatsServer::start();
    let url = nats.url();
    let sim = kvbm_testkit::bin::workspace_bin("kvbm-sim", "kvbm-sim");
    let sims = Sims(
        (0..8)
            .map(|i| {
                Command::new(&sim)
                    .args(["--publish", &url, "--engine-id", &format!("eng-{i}")])
                    .args(["--real-time", "1", "--requests", "300", "--rate", "3"])
                    .args(["--seed", &(i + 1).to_string(), "--output-len", "200"])
                    .args(["--bp-deadline-s", "120", "--publish-linger-s", "60"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("starting kvbm-sim")
            })
            .collect(),
    );
    let t = console("fleet", &["attach", &url], 160, 48);
    t.wait_for("eight live engines", 60, |s| {
        s.contains("engines 8 (live 8")
    });

    // Drill into eng-3: filter to it, Enter.
    t.send("/");
    t.type_text("eng-3");
    t.send("Enter");
    t.wait_for("the filter", 10, |s| {
        let rows = paused_by_engine(s);
        rows.len() == 1 && rows[0].0 == "eng-3"
    });
    t.send("Enter");
    let s = t.wait_for("eng-3's slots", 30, |s| {
        s.contains("NATS FOLLOWING eng-3") && s.contains("syn-")
    });
    assert!(s.contains("fleet › eng-3"), "{s}");

    // A breakpoint on Decoding, set through NATS, pauses a call there.
    t.send("5");
    t.send("a");
    t.type_text("state=Decoding");
    t.send("Enter");
    // As long as the paused call's wait: a loaded 2-core machine took
    // over 15 s to take these keys in a debug build (seen once in CI).
    t.wait_for("the breakpoint set", 60, |s| {
        s.contains("breakpoint #1 set")
    });
    t.wait_for("a paused call", 60, |s| s.contains("Paused calls — 1"));

    // Back to the fleet: the pause shows on eng-3's row only.
    t.send("Escape");
    t.send("Escape"); // clears the filter
    let s = t.wait_for("eng-3 paused, the others not", 30, |s| {
        let rows = paused_by_engine(s);
        rows.len() == 8
            && rows
                .iter()
                .all(|(n, p)| if n == "eng-3" { p == "1" } else { p == "0" })
    });
    assert!(s.contains("live 8"), "{s}");

    // Back into eng-3 (its console was kept), clear every breakpoint.
    t.send("/");
    t.type_text("eng-3");
    t.send("Enter");
    t.send("Enter");
    t.wait_for("eng-3's breakpoints again", 15, |s| {
        s.contains("Breakpoints — 1")
    });
    t.send("D");
    t.wait_for("cleared", 15, |s| s.contains("1 breakpoints cleared"));
    t.wait_for("nothing paused", 30, |s| s.contains("paused 0"));
    t.send("Escape");
    t.send("Escape");
    t.wait_for("no engine paused", 30, |s| {
        let rows = paused_by_engine(s);
        rows.len() == 8 && rows.iter().all(|(_, p)| p == "0")
    });
    t.send("q");
    assert_eq!(t.exit_code(15), 0);
    drop(sims);
}

/// A console started before its server says why it is not following and
/// follows once the server is up: the real `nats-server`, stopped while
/// the console starts, then started again with an engine publishing.
#[test]
fn a_fleet_console_started_before_its_server_follows_once_it_is_up() {
    let mut nats = NatsServer::start();
    let url = nats.url();
    nats.stop();
    let t = console("fleet-late", &["attach", &url], 220, 16);
    t.wait_for("the reason it is not following", 40, |s| {
        s.contains("NATS FAILED, RETRYING") && s.contains("no NATS server answers at that address")
    });
    nats.start_again();
    let sim = kvbm_testkit::bin::workspace_bin("kvbm-sim", "kvbm-sim");
    let _sims = Sims(vec![
        Command::new(&sim)
            .args([
                "--publish",
                &url,
                "--engine-id",
                "late-0",
                "--requests",
                "30",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting kvbm-sim"),
    ]);
    t.wait_for("the engine, once the server is up", 40, |s| {
        s.contains("NATS FOLLOWING") && s.contains("engines 1 ") && s.contains("late-0")
    });
}
