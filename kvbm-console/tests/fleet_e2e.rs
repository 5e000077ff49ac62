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
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Tmux {
    socket: String,
    exit_file: PathBuf,
    _dir: tempfile::TempDir,
}

fn have_tmux() -> bool {
    let ok = Command::new("tmux")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "tmux is required under CI"
        );
        eprintln!("skipping: tmux is not installed");
    }
    ok
}

impl Tmux {
    /// Starts `args` in a detached `w`×`h` session on a private socket.
    fn start(name: &str, args: &[&str], w: u16, h: u16) -> Tmux {
        let dir = tempfile::tempdir().unwrap();
        let exit_file = dir.path().join("exit");
        let socket = format!("kvbm-e2e-{}-{name}", std::process::id());
        let bin = env!("CARGO_BIN_EXE_kvbm-console");
        let cmd = format!(
            "{bin} {} 2>{}; echo $? > {}; sleep 30",
            args.join(" "),
            dir.path().join("stderr").display(),
            exit_file.display()
        );
        let st = Command::new("tmux")
            .args([
                "-L",
                &socket,
                "-f",
                "/dev/null",
                "new-session",
                "-d",
                "-s",
                "t",
            ])
            .args(["-x", &w.to_string(), "-y", &h.to_string(), &cmd])
            .status()
            .unwrap();
        assert!(st.success());
        Tmux {
            socket,
            exit_file,
            _dir: dir,
        }
    }

    fn screen(&self) -> String {
        let o = Command::new("tmux")
            .args(["-L", &self.socket, "capture-pane", "-p", "-t", "t"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Sends one key (tmux key name), then lets the console react. Keys
    /// go one at a time: an Esc followed at once by another key would read
    /// as Alt+key.
    fn send(&self, key: &str) {
        let st = Command::new("tmux")
            .args(["-L", &self.socket, "send-keys", "-t", "t", key])
            .status()
            .unwrap();
        assert!(st.success());
        std::thread::sleep(Duration::from_millis(150));
    }

    fn type_text(&self, text: &str) {
        let st = Command::new("tmux")
            .args(["-L", &self.socket, "send-keys", "-t", "t", "-l", text])
            .status()
            .unwrap();
        assert!(st.success());
        std::thread::sleep(Duration::from_millis(150));
    }

    /// Waits until the screen satisfies `pred`; panics with the screen.
    fn wait_for(&self, what: &str, secs: u64, pred: impl Fn(&str) -> bool) -> String {
        let t = Instant::now();
        loop {
            let s = self.screen();
            if pred(&s) {
                return s;
            }
            assert!(
                t.elapsed() < Duration::from_secs(secs),
                "timed out waiting for {what}; screen:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn exit_code(&self, secs: u64) -> i32 {
        let t = Instant::now();
        loop {
            if let Ok(s) = std::fs::read_to_string(&self.exit_file)
                && let Ok(c) = s.trim().parse()
            {
                return c;
            }
            assert!(
                t.elapsed() < Duration::from_secs(secs),
                "the console did not exit; screen:\n{}",
                self.screen()
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
    if !have_tmux() {
        return;
    }
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
    let t = Tmux::start("fleet", &["attach", &url], 160, 48);
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
    t.wait_for("the breakpoint set", 15, |s| {
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
