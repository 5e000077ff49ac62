//! The shell conventions every kvbm binary follows, checked on the real
//! binaries: `--version`, `completions SHELL` (scripts a real bash loads),
//! a closed pipe is not a crash, and no progress output when stderr is not
//! a terminal. (Progress on a terminal and `NO_COLOR` are checked in tmux,
//! in `console_e2e.rs`.)

use kvbm_testkit::bin::workspace_bin;
use std::path::PathBuf;
use std::process::{Command, Stdio};

const BINS: [(&str, &str); 3] = [
    ("kvbm-console", "kvbm-console"),
    ("kvbm-recorder", "kvbm-recorder"),
    ("kvbm-sim", "kvbm-sim"),
];

fn bin(package: &str, name: &str) -> PathBuf {
    if name == "kvbm-console" {
        PathBuf::from(env!("CARGO_BIN_EXE_kvbm-console"))
    } else {
        workspace_bin(package, name)
    }
}

#[test]
fn every_binary_states_its_version() {
    for (package, name) in BINS {
        let o = Command::new(bin(package, name))
            .arg("--version")
            .output()
            .unwrap();
        assert!(o.status.success(), "{name} --version failed");
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).trim(),
            format!("{name} {}", env!("CARGO_PKG_VERSION"))
        );
    }
}

#[test]
fn every_binary_prints_completions_a_real_bash_loads() {
    // A flag or subcommand each script must offer.
    let offers = [
        ("kvbm-console", "demo"),
        ("kvbm-recorder", "record"),
        ("kvbm-sim", "model"),
    ];
    for (package, name) in BINS {
        let exe = bin(package, name);
        for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
            let o = Command::new(&exe)
                .args(["completions", shell])
                .output()
                .unwrap();
            assert!(o.status.success(), "{name} completions {shell} failed");
            let script = String::from_utf8_lossy(&o.stdout);
            let want = offers.iter().find(|(n, _)| *n == name).unwrap().1;
            assert!(
                script.contains(want),
                "{name}'s {shell} script lacks {want}"
            );
        }
        let o = Command::new(&exe)
            .args(["completions", "nushell-or-so"])
            .output()
            .unwrap();
        assert!(!o.status.success());
        assert!(String::from_utf8_lossy(&o.stderr).contains("possible values"));

        if Command::new("bash").arg("--version").output().is_err() {
            continue;
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("completion.bash");
        let script = Command::new(&exe)
            .args(["completions", "bash"])
            .output()
            .unwrap()
            .stdout;
        std::fs::write(&file, script).unwrap();
        let o = Command::new("bash")
            .arg("-c")
            .arg(format!("source {} && complete -p {name}", file.display()))
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "bash could not load {name}'s completions: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(String::from_utf8_lossy(&o.stdout).contains(name));
    }
}

#[test]
fn a_closed_stdout_is_not_a_crash() {
    for (package, name) in BINS {
        let mut child = Command::new(bin(package, name))
            .args(["completions", "zsh"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Closed before the script is written: the write fails with EPIPE.
        drop(child.stdout.take());
        let o = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("panicked"), "{name}: {err}");
        assert!(o.status.success(), "{name}: {err}");
    }
}

#[test]
fn no_progress_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("log");
    let runs: [(PathBuf, Vec<String>); 3] = [
        (
            workspace_bin("kvbm-sim", "kvbm-sim"),
            vec!["--requests".into(), "100".into()],
        ),
        (
            workspace_bin("kvbm-cli", "kvbm-recorder"),
            vec![
                "record".into(),
                "--out".into(),
                out.display().to_string(),
                "--requests".into(),
                "100".into(),
            ],
        ),
        (
            workspace_bin("kvbm-cli", "kvbm-recorder"),
            vec!["stats".into(), out.display().to_string()],
        ),
    ];
    for (exe, args) in runs {
        let o = Command::new(&exe).args(&args).output().unwrap();
        assert!(o.status.success(), "{} {args:?} failed", exe.display());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !err.contains('\r') && !err.contains("[=") && !err.contains('%'),
            "{} {args:?} drew progress into a pipe: {err:?}",
            exe.display()
        );
    }
}
