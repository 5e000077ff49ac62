//! The workspace's binaries, for tests in a crate other than the one that
//! owns them (`CARGO_BIN_EXE_*` only names a package's own binaries).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// The path of binary `bin` of workspace package `package`, built first
/// (with the profile and target directory of the running test) when the
/// test runs under cargo. `KVBM_BIN_<NAME>` (upper case, `-` as `_`)
/// overrides it, for a binary built elsewhere.
///
/// Panics with a message naming the binary when it cannot be built: a test
/// that needs another program must not pass without it.
pub fn workspace_bin(package: &str, bin: &str) -> PathBuf {
    build(package, "--bin", bin)
}

/// Like [`workspace_bin`], for example `example` of `package`
/// (`target/<profile>/examples/`).
pub fn workspace_example(package: &str, example: &str) -> PathBuf {
    build(package, "--example", example)
}

fn build(package: &str, kind: &str, bin: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let var = format!("KVBM_BIN_{}", bin.to_uppercase().replace('-', "_"));
    if let Some(p) = std::env::var_os(&var) {
        return p.into();
    }
    let built = BUILT.get_or_init(Default::default);
    // Held across the build, so concurrent tests build it once.
    let mut built = built.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = built.get(bin) {
        return p.clone();
    }
    let profile_dir = profile_dir();
    let dir = if kind == "--example" {
        profile_dir.join("examples")
    } else {
        profile_dir.clone()
    };
    let path = dir.join(format!("{bin}{}", std::env::consts::EXE_SUFFIX));
    if let Ok(cargo) = std::env::var("CARGO") {
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--quiet", "-p", package, kind, bin]);
        match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => {}
            Some("release") => {
                cmd.arg("--release");
            }
            Some(p) => {
                cmd.args(["--profile", p]);
            }
        }
        if let Some(target) = profile_dir.parent() {
            cmd.arg("--target-dir").arg(target);
        }
        let st = cmd
            .status()
            .unwrap_or_else(|e| panic!("running cargo to build {bin}: {e}"));
        assert!(st.success(), "building {bin} (package {package}) failed");
    }
    assert!(
        path.exists(),
        "{} is missing (set {var} to use another)",
        path.display()
    );
    built.insert(bin.to_string(), path.clone());
    path
}

/// `target/<profile>`: a test runs as `target/<profile>/deps/NAME-HASH`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    exe.parent()
        .and_then(Path::parent)
        .expect("a test binary lives in target/<profile>/deps")
        .to_path_buf()
}
