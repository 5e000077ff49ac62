//! Helpers shared by kvbm-cli's integration tests.

use std::process::{Command, Output};

/// Runs this package's `kvbm-recorder` with `args` and returns its output.
pub fn recorder(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
        .args(args)
        .output()
        .unwrap()
}
