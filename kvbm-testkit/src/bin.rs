//! The workspace's binaries, for tests in a crate other than the one that
//! owns them (`CARGO_BIN_EXE_*` only names a package's own binaries).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// The path of binary `bin` of workspace package `package`, built first
/// (with the profile and target directory of the running test) when the
/// test runs under cargo: every binary and example of the workspace, once
/// per test process, which resolves features as `cargo test --workspace`
/// does, so after it nothing is compiled again. (Building one package
/// resolves them for that package alone, and compiled `kvbm-attach` and
/// what it links again for each binary the tests use.) `KVBM_BIN_<NAME>`
/// (upper case, `-` as `_`) overrides it, for a binary built elsewhere.
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
    // Whether this process has run the build: held across it, so
    // concurrent tests build once.
    static BUILT: OnceLock<Mutex<bool>> = OnceLock::new();
    let var = format!("KVBM_BIN_{}", bin.to_uppercase().replace('-', "_"));
    if let Some(p) = std::env::var_os(&var) {
        return p.into();
    }
    let profile_dir = profile_dir();
    let dir = if kind == "--example" {
        profile_dir.join("examples")
    } else {
        profile_dir.clone()
    };
    let path = dir.join(format!("{bin}{}", std::env::consts::EXE_SUFFIX));
    let mut built = BUILT
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if !*built && let Ok(cargo) = std::env::var("CARGO") {
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--quiet", "--workspace", "--bins", "--examples"]);
        // What cargo sets for the running test, not for a build: `ring`'s
        // build script reads CARGO_MANIFEST_DIR, so inheriting the test's
        // ran it again, and rustls, async-nats, kvbm-attach and all above
        // them were compiled again (40 s) each time a test of another
        // package built, and once more by the next `cargo test`.
        for (key, _) in std::env::vars_os() {
            let Some(key) = key.to_str() else { continue };
            if is_set_for_a_test(key) {
                cmd.env_remove(key);
            }
        }
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
        assert!(
            st.success(),
            "building the workspace's binaries, {bin} (package {package}) among them, failed"
        );
        *built = true;
    }
    assert!(
        path.exists(),
        "{} is missing (set {var} to use another)",
        path.display()
    );
    path
}

/// Whether `key` is among the variables cargo sets for a test it runs
/// (and for a build script of the package), rather than ones that
/// configure cargo.
fn is_set_for_a_test(key: &str) -> bool {
    key == "OUT_DIR"
        || key == "CARGO_CRATE_NAME"
        || key == "CARGO_BIN_NAME"
        || key == "CARGO_PRIMARY_PACKAGE"
        || key == "CARGO_TARGET_TMPDIR"
        || key.starts_with("CARGO_MANIFEST_")
        || key.starts_with("CARGO_PKG_")
        || key.starts_with("CARGO_BIN_EXE_")
}

/// `target/<profile>`: a test runs as `target/<profile>/deps/NAME-HASH`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    exe.parent()
        .and_then(Path::parent)
        .expect("a test binary lives in target/<profile>/deps")
        .to_path_buf()
}
