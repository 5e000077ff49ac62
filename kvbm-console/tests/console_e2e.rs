//! End to end: the real `kvbm-console` binary in a pseudo-terminal (tmux),
//! keys sent, the screen read back.
//!
//! The demo shows live slots changing state, `?` opens the help, a
//! breakpoint typed at the keyboard pauses a request and clearing it
//! releases the request, which then finishes; `q` exits 0 and the
//! terminal is restored. A replay of a log recorded by the demo opens and
//! plays.
//!
//! Needs `tmux`: without it the test fails, saying how to install it (a
//! test that passes without having run proves nothing).

use kvbm_testkit::tmux::Tmux;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

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

/// The state column of a slots row for `request`, if on screen.
fn state_of(screen: &str, request: &str) -> Option<String> {
    screen.lines().find_map(|l| {
        let cols: Vec<&str> = l.trim_start_matches('│').split_whitespace().collect();
        (cols.first() == Some(&request)).then(|| cols.get(1).map(|s| s.to_string()))?
    })
}

/// Each `syn-*` slot row's (state, generated tokens), from the wide
/// slots table (Request State Age Prompt Gen ...).
fn slot_progress(screen: &str) -> Vec<(String, (String, String))> {
    screen
        .lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.trim_start_matches('│').split_whitespace().collect();
            match cols.as_slice() {
                [id, state, _age, _prompt, generated, ..] if id.starts_with("syn-") => {
                    Some((id.to_string(), (state.to_string(), generated.to_string())))
                }
                _ => None,
            }
        })
        .collect()
}

fn slot_states(screen: &str) -> Vec<(String, String)> {
    screen
        .lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.trim_start_matches('│').split_whitespace().collect();
            match cols.as_slice() {
                [id, state, ..] if id.starts_with("syn-") => {
                    Some((id.to_string(), state.to_string()))
                }
                _ => None,
            }
        })
        .collect()
}

#[test]
fn demo_live_slots_help_breakpoint_and_quit() {
    let rec = tempfile::tempdir().unwrap();
    let rec_dir = rec.path().join("demo.kvbm");
    let rec_arg = rec_dir.display().to_string();
    let t = console(
        "demo",
        &[
            "demo",
            "--rate",
            "20",
            "--requests",
            "400",
            "--record",
            &rec_arg,
        ],
        160,
        48,
    );
    // Live slots, changing state.
    let first = t.wait_for("live slots", 30, |s| {
        s.contains("LIVE") && s.contains("Decoding")
    });
    let before = slot_states(&first);
    assert!(!before.is_empty(), "{first}");
    t.wait_for("a slot to change state", 30, |s| {
        let now = slot_states(s);
        before
            .iter()
            .any(|(id, st)| now.iter().any(|(id2, st2)| id == id2 && st != st2))
    });

    // Help from the key table.
    t.send("?");
    let s = t.wait_for("help", 5, |s| s.contains("Help — keys"));
    assert!(s.contains("freeze / unfreeze") && s.contains("quit"), "{s}");
    t.send("Escape");
    t.wait_for("help to close", 5, |s| !s.contains("Help — keys"));

    // A breakpoint typed at the keyboard on a request that has not
    // arrived yet pauses it once it is decoding (in the simulator, the
    // entry point a decoding request calls is request_finished, after its
    // last token).
    t.send("5");
    t.send("a");
    t.type_text("request=syn-150 state=Decoding");
    t.send("Enter");
    let s = t.wait_for("the breakpoint", 5, |s| {
        s.contains("breakpoint #1 set: state=Decoding request=syn-150")
    });
    assert!(
        s.lines().any(|l| {
            let cols: Vec<&str> = l.trim_matches('│').split_whitespace().collect();
            cols.starts_with(&["#1", "state=Decoding", "request=syn-150"])
        }),
        "{s}"
    );
    // The control's table and the header (from the BreakpointHit event)
    // both show it.
    let paused_view = t.wait_for("the pause", 90, |s| {
        s.contains("Paused calls — 1") && s.contains("syn-150") && s.contains("paused 1")
    });
    // syn-150 makes no progress while paused: in the slots view, filtered
    // to it, it stays Decoding (it does not go on to Finishing) with the
    // same generated tokens over 1.5 s. (The demo's breakpoints block the
    // engine's thread, so no other request moves either; what shows the
    // screen is not simply stale is the paused call's waiting time, which
    // counts up meanwhile.)
    t.send("1");
    t.send("/");
    t.type_text("syn-150");
    t.send("Enter");
    let before = t.wait_for("syn-150's row", 10, |s| {
        slot_progress(s).iter().any(|(id, _)| id == "syn-150")
    });
    std::thread::sleep(Duration::from_millis(1500));
    let after = t.screen();
    let of = |screen: &str| {
        slot_progress(screen)
            .into_iter()
            .find(|(id, _)| id == "syn-150")
            .map(|(_, p)| p)
    };
    let (state, generated) = of(&before).unwrap();
    assert_eq!(state, "Decoding", "{before}");
    assert_eq!(
        of(&after),
        Some((state, generated.clone())),
        "syn-150 moved while paused:\n{before}\n---\n{after}"
    );
    assert!(after.contains("paused 1"), "{after}");
    t.send("Escape"); // the filter
    t.send("5");
    let paused_call = |s: &str| {
        s.lines()
            .skip_while(|l| !l.contains("Paused calls"))
            .find(|l| l.contains("syn-150"))
            .map(str::to_string)
    };
    let still = t.wait_for("the breakpoints view", 5, |s| {
        s.contains("Paused calls — 1")
    });
    assert_ne!(
        paused_call(&paused_view),
        paused_call(&still),
        "the paused call's row did not change in 1.5 s: the screen is not being redrawn"
    );
    // Clearing the breakpoint releases the request, which then finishes
    // with the tokens it had.
    t.send("d");
    t.wait_for("the release", 10, |s| {
        s.contains("Paused calls — 0") && s.contains("paused 0")
    });
    t.send("1");
    t.send("/");
    t.type_text("syn-150");
    t.send("Enter");
    let done = t.wait_for("syn-150 to finish", 60, |s| {
        state_of(s, "syn-150").as_deref() == Some("Finished")
    });
    assert_eq!(of(&done), Some(("Finished".to_string(), generated)));

    // q quits with 0 and restores the terminal (no alternate screen, no
    // console frame left).
    t.send("q");
    assert_eq!(t.exit_code(30), 0);
    let s = t.screen();
    assert!(!s.contains("LIVE") && !s.contains("Slots —"), "{s}");
    assert!(s.contains("recorded") && s.contains("events"), "{s}");

    // The recording replays.
    let r = console("replay", &["replay", &rec_arg, "--play", "64"], 120, 30);
    r.wait_for("the replay to reach the end", 60, |s| {
        s.contains("REPLAY ⏸ 64× 100%")
    });
    r.send("6");
    r.wait_for("the event log", 5, |s| s.contains("Events —"));
    r.send("q");
    assert_eq!(r.exit_code(10), 0);
    let check = Command::new(env!("CARGO_BIN_EXE_kvbm-console"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(check.status.success());
    assert!(Path::new(&rec_arg).exists());
}

#[test]
fn a_missing_log_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvbm-console"))
        .args(["replay", &dir.path().join("nope").display().to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("opening recording") && err.contains("nope"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    // A directory that holds no recording is said to, not replayed as a
    // log of no events.
    let out = Command::new(env!("CARGO_BIN_EXE_kvbm-console"))
        .args(["replay", &dir.path().display().to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("holds no kvbm recording"), "{err}");
}

/// Without a terminal (a new session with none, stdin and stdout not
/// ttys) the console says it needs one, and where text is to be had.
#[test]
fn without_a_terminal_the_console_says_it_needs_one() {
    let out = Command::new("setsid")
        .arg(env!("CARGO_BIN_EXE_kvbm-console"))
        .arg("demo")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("setsid (util-linux) runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the console needs a terminal"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `demo --record` into a directory that already holds a log fails at
/// once, naming it, before the screen opens (it used to show an engine
/// with nothing recorded until `q`). No terminal is needed to see it.
#[test]
fn demo_record_into_a_used_directory_fails_before_the_screen() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("r");
    let rec = Command::new(env!("CARGO_BIN_EXE_kvbm-console"))
        .args(["demo", "--record", &log.display().to_string()])
        .arg("--help")
        .output()
        .unwrap();
    assert!(rec.status.success(), "demo takes --record");
    let mut sink = kvbm_recorder::recorder::RecordingSink::create(
        &log,
        &kvbm_recorder::recorder::RecorderConfig::default(),
    )
    .unwrap();
    sink.append(&kvbm_events::Event {
        engine: 0,
        seq: 0,
        ts_ns: 0,
        iteration: 0,
        request: None,
        kind: kvbm_events::EventKind::PoolGauge {
            tier: kvbm_events::Tier::Host,
            capacity: 1,
            active: 0,
            inactive: 0,
            empty: 1,
        },
    })
    .unwrap();
    sink.finish().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvbm-console"))
        .args(["demo", "--record", &log.display().to_string()])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already holds a log"), "{err}");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("\u{1b}[?1049h"),
        "the screen never opened"
    );
}

/// The rows of the Transfers view's in-flight table: `(blocks, bytes)`
/// of each candidate on screen.
fn in_flight_rows(screen: &str) -> Vec<(u64, String)> {
    let mut rows = Vec::new();
    let mut inside = false;
    for l in screen.lines() {
        if l.starts_with("┌ In flight") {
            inside = true;
            continue;
        }
        if inside && l.starts_with('└') {
            break;
        }
        let cols: Vec<&str> = l.trim_matches('│').split_whitespace().collect();
        // #id request status dir blocks bytes age batch
        if inside
            && cols.first().is_some_and(|c| c.starts_with('#'))
            && let Some(i) = cols.iter().position(|c| c.contains('→'))
            && let (Some(b), Some(bytes)) = (cols.get(i + 1), cols.get(i + 2))
            && let Ok(b) = b.parse()
        {
            rows.push((b, bytes.to_string()));
        }
    }
    rows
}

/// Within 20 s of starting, the demo's Transfers view has a candidate in
/// flight, and its bytes are those of the model preset: 2 MiB per 16-token
/// block for the default Llama-3-8B-like model (128 KiB per token), 5 MiB
/// for the 70B-like one.
#[test]
fn demo_transfers_are_in_flight_with_the_presets_bytes() {
    for (model, mib_per_block, name) in [
        (None, 2, "llama-3-8b"),
        (Some("llama-3-70b"), 5, "llama-3-70b"),
    ] {
        let mut args = vec!["demo"];
        if let Some(m) = model {
            args.extend(["--model", m]);
        }
        let t = console(model.unwrap_or("default"), &args, 160, 48);
        t.wait_for("the demo", 30, |s| s.contains("LIVE"));
        let started = Instant::now();
        t.send("2");
        let s = t.wait_for("a transfer in flight with its bytes", 20, |s| {
            in_flight_rows(s).iter().any(|(_, b)| b != "-")
        });
        assert!(started.elapsed() < Duration::from_secs(20));
        // Which bytes are which: the model's, and the 4 bytes a token the
        // simulator really copies (64 B a 16-token block).
        let note = format!(
            "bytes as modelled for {name}: {mib_per_block}.0MiB a block (64B a block really copied)"
        );
        assert!(s.contains(&note), "no {note:?}:\n{s}");
        for (blocks, bytes) in in_flight_rows(&s) {
            if bytes == "-" {
                continue;
            }
            let mib = blocks * mib_per_block;
            let want = if mib >= 1024 {
                format!("~{:.1}GiB", mib as f64 / 1024.0)
            } else {
                format!("~{mib:.1}MiB", mib = mib as f64)
            };
            assert_eq!(bytes, want, "{model:?}: {blocks} blocks:\n{s}");
        }
        t.send("q");
        assert_eq!(t.exit_code(30), 0);
    }
}

/// `NO_COLOR=1` draws without colour (tmux's `capture-pane -e` shows every
/// attribute as an escape sequence): no foreground or background colour,
/// while the same screen without it has them; reverse video stays.
#[test]
fn no_color_draws_without_colour_in_a_real_terminal() {
    let bin = env!("CARGO_BIN_EXE_kvbm-console");
    let replay = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../replays/preemption-heavy")
        .display()
        .to_string();
    // SGR parameters that set a colour: 30–37, 38;…, 40–47, 48;…, 90–97,
    // 100–107.
    let colours = |s: &str| -> usize {
        s.split("\x1b[")
            .skip(1)
            .filter_map(|seq| seq.split_once('m').map(|(p, _)| p))
            .flat_map(|p| {
                p.split(';')
                    .map(|x| x.parse::<u32>().unwrap_or(0))
                    .collect::<Vec<_>>()
            })
            .filter(|&n| matches!(n, 30..=38 | 40..=48 | 90..=97 | 100..=107))
            .count()
    };
    for (env, name) in [("", "colour"), ("NO_COLOR=1 ", "nocolour")] {
        let t = Tmux::start(name, env, bin, &["replay", &replay], (120, 40), true);
        t.wait_for("the replay", 30, |s| s.contains("REPLAY"));
        t.send("End");
        t.wait_for("the end", 10, |s| s.contains("100%"));
        let s = t.screen_with_attributes();
        if env.is_empty() {
            assert!(colours(&s) > 0, "no colour without NO_COLOR:\n{s}");
        } else {
            assert_eq!(colours(&s), 0, "colour under NO_COLOR:\n{s:?}");
            // The selected row is still marked.
            assert!(s.contains("\x1b[7m") || s.contains(";7m"), "{s:?}");
        }
        t.send("q");
        assert_eq!(t.exit_code(10), 0);
    }
}

/// A run longer than a second shows progress on a terminal (and none in a
/// pipe: `conventions.rs`), and clears it before the summary.
#[test]
fn progress_shows_on_a_terminal() {
    let sim = kvbm_testkit::bin::workspace_bin("kvbm-sim", "kvbm-sim");
    let sim = sim.display().to_string();
    let t = Tmux::start(
        "progress",
        "",
        &sim,
        &["--requests", "3000", "--rate", "50"],
        (120, 20),
        false,
    );
    t.wait_for("a progress bar", 60, |s| {
        s.contains("requests finished") && s.contains("[=")
    });
    assert_eq!(t.exit_code(300), 0);
    let s = t.screen();
    assert!(s.contains("requests finished   3000"), "{s}");
    assert!(!s.contains("[="), "the bar was left behind:\n{s}");
}

/// `compare A B` in a real terminal: the deltas' header over both
/// replays, playing to their ends together; a view key switches both; `q`
/// exits 0. A log that cannot be read is an error naming it, before the
/// screen opens.
#[test]
fn compare_shows_two_recordings_side_by_side() {
    let replays = Path::new(env!("CARGO_MANIFEST_DIR")).join("../replays");
    let (a, b) = (
        replays.join("preemption-heavy").display().to_string(),
        replays
            .join("cpu-offload-walkthrough")
            .display()
            .to_string(),
    );
    let t = console("compare", &["compare", &a, &b, "--play", "64"], 200, 50);
    let s = t.wait_for("both replays at their ends", 60, |s| {
        s.contains("COMPARE") && s.matches("REPLAY ⏸ 64× 100%").count() == 2
    });
    assert!(
        s.contains("A: preemption-heavy") && s.contains("B: cpu-offload-walkthrough"),
        "{s}"
    );
    assert!(s.contains("hit_ratio ") && s.contains('→'), "{s}");
    t.send("6");
    t.wait_for("the event log in both panes", 5, |s| {
        s.matches("Events —").count() == 2
    });
    t.send("q");
    assert_eq!(t.exit_code(10), 0);

    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope").display().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_kvbm-console"))
        .args(["compare", &a, &missing])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("opening log") && err.contains("nope"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
