//! A real terminal for end-to-end tests: a program started in a detached
//! tmux session on a private socket, keys sent to it, its screen read
//! back. Tests that use it fail when tmux is missing ([`require`]): a test
//! that passes without having run proves nothing.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Fails, saying how to install tmux, when it is not installed.
pub fn require() {
    let version = Command::new("tmux").arg("-V").output();
    assert!(
        version.as_ref().is_ok_and(|o| o.status.success()),
        "tmux is required: this test drives a real program in a tmux \
         pseudo-terminal. Install it (Debian/Ubuntu: apt-get install tmux; \
         Fedora: dnf install tmux; macOS: brew install tmux) and run the test \
         again. (`tmux -V`: {version:?})"
    );
}

/// A program running in a tmux session; the session is killed on drop.
pub struct Tmux {
    socket: String,
    dir: tempfile::TempDir,
}

impl Tmux {
    /// Starts `env bin args` (`env`: `NAME=value ` prefixes, or empty) in
    /// a detached `w`×`h` session named after `name` and this process; its
    /// stderr goes to a file ([`Tmux::stderr`]) unless `stderr_to_file` is
    /// false (then it shows in the pane, as a user would see it). Fails
    /// when tmux is missing.
    pub fn start(
        name: &str,
        env: &str,
        bin: &str,
        args: &[&str],
        (w, h): (u16, u16),
        stderr_to_file: bool,
    ) -> Tmux {
        require();
        let dir = tempfile::tempdir().expect("a temporary directory");
        let redirect = if stderr_to_file {
            format!(" 2>{}", dir.path().join("stderr").display())
        } else {
            String::new()
        };
        // The shell stays 30 s after the program exits so its last screen
        // can still be read; the exit status goes to a file.
        let cmd = format!(
            "{env}{bin} {}{redirect}; echo $? > {}; sleep 30",
            args.join(" "),
            dir.path().join("exit").display()
        );
        let socket = format!("kvbm-e2e-{}-{name}", std::process::id());
        let st = Command::new("tmux")
            .args(["-L", &socket, "-f", "/dev/null", "new-session", "-d"])
            .args(["-s", "t", "-x", &w.to_string(), "-y", &h.to_string(), &cmd])
            .status()
            .expect("running tmux");
        assert!(st.success(), "tmux new-session failed");
        Tmux { socket, dir }
    }

    fn tmux(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux")
            .args(["-L", &self.socket])
            .args(args)
            .output()
            .expect("running tmux")
    }

    /// The screen as text.
    pub fn screen(&self) -> String {
        String::from_utf8_lossy(&self.tmux(&["capture-pane", "-p", "-t", "t"]).stdout).into_owned()
    }

    /// The screen with its attributes as escape sequences (`-e`).
    pub fn screen_with_attributes(&self) -> String {
        String::from_utf8_lossy(&self.tmux(&["capture-pane", "-p", "-e", "-t", "t"]).stdout)
            .into_owned()
    }

    /// Sends one key (tmux key name), then lets the program react. Keys
    /// go one at a time: an Esc followed at once by another key would read
    /// as Alt+key.
    pub fn send(&self, key: &str) {
        assert!(self.tmux(&["send-keys", "-t", "t", key]).status.success());
        std::thread::sleep(Duration::from_millis(150));
    }

    /// Types `text` literally.
    pub fn type_text(&self, text: &str) {
        assert!(
            self.tmux(&["send-keys", "-t", "t", "-l", text])
                .status
                .success()
        );
        std::thread::sleep(Duration::from_millis(150));
    }

    /// Waits until the screen satisfies `pred`; panics with the screen.
    pub fn wait_for(&self, what: &str, secs: u64, pred: impl Fn(&str) -> bool) -> String {
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

    /// The program's exit status, waiting up to `secs` for it.
    pub fn exit_code(&self, secs: u64) -> i32 {
        let t = Instant::now();
        loop {
            if let Ok(s) = std::fs::read_to_string(self.dir.path().join("exit"))
                && let Ok(c) = s.trim().parse()
            {
                return c;
            }
            assert!(
                t.elapsed() < Duration::from_secs(secs),
                "the program did not exit; screen:\n{}",
                self.screen()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Where the program's stderr went (when started with
    /// `stderr_to_file`).
    pub fn stderr(&self) -> PathBuf {
        self.dir.path().join("stderr")
    }

    /// The session's scratch directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.tmux(&["kill-server"]);
    }
}
