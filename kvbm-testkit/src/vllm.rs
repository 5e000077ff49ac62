//! The real vLLM that tests of how kvbm handles vLLM run against: the
//! Python of the virtual environment `scripts/setup-vllm.sh` creates
//! (`~/.cache/kvbm/vllm-venv`, or `KVBM_VLLM_VENV`).
//!
//! Where it is absent, a test skips with a message naming the setup
//! script, unless `KVBM_REQUIRE_VLLM=1` (CI sets it after running the
//! script): then its absence fails the test.

use std::path::PathBuf;

/// The script that creates the environment.
pub const SETUP_SCRIPT: &str = "scripts/setup-vllm.sh";

/// The environment's directory: `KVBM_VLLM_VENV`, else
/// `~/.cache/kvbm/vllm-venv`.
pub fn venv_dir() -> Option<PathBuf> {
    if let Some(v) = std::env::var_os("KVBM_VLLM_VENV") {
        return Some(v.into());
    }
    let home = std::env::var_os("HOME")?;
    Some(PathBuf::from(home).join(".cache/kvbm/vllm-venv"))
}

/// Whether `KVBM_REQUIRE_VLLM=1`.
pub fn required() -> bool {
    std::env::var("KVBM_REQUIRE_VLLM").is_ok_and(|v| v == "1")
}

/// The environment's `python` when it is there. Otherwise `None` after a
/// message on stderr naming `test` and the setup script, or a panic when
/// [`required`].
pub fn python(test: &str) -> Option<PathBuf> {
    let py = venv_dir().map(|d| d.join("bin/python"));
    if let Some(p) = py.as_ref().filter(|p| p.is_file()) {
        return Some(p.clone());
    }
    let msg = format!(
        "{test}: no vLLM environment at {} (run {SETUP_SCRIPT} to create it)",
        py.map_or_else(|| "$HOME unset".to_string(), |p| p.display().to_string())
    );
    if required() {
        panic!("{msg}; KVBM_REQUIRE_VLLM=1 makes that a failure");
    }
    eprintln!("SKIPPED {msg}");
    None
}
