//! End to end: the real `kvbm-console` binary runs the CPU-offload walk-through (text) and succeeds.

use std::process::Command;

fn console() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvbm-console"))
}

#[test]
fn walkthrough_runs_and_verifies_every_copy() {
    let out = console()
        .arg("walkthrough")
        .output()
        .expect("run kvbm-console");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("prefix match: G1 0 blocks, G2 0 blocks, G3 2 blocks"),
        "{stdout}"
    );
    assert!(
        stdout.contains("demo finished: every copy verified"),
        "{stdout}"
    );
}

#[test]
fn walkthrough_works_with_another_block_size() {
    let out = console()
        .args(["walkthrough", "--block-size", "4"])
        .output()
        .expect("run kvbm-console");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bad_flags_are_clear_errors_not_panics() {
    for args in [
        &["walkthrough", "--block-size", "0"][..],
        &["walkthrough", "--block-size", "x"],
        &["nope"],
    ] {
        let out = console().args(args).output().expect("run kvbm-console");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
