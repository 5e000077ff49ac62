//! A program of the workspace started as a server on a free loopback port,
//! which prints `serving on URL` as its first line (`kvbm-sim --serve
//! 127.0.0.1:0`, the ingest example): the child, killed when dropped, and
//! the URL it serves.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A child process killed (and reaped) when dropped, so that a failing
/// test leaves no server behind.
#[derive(Debug)]
pub struct Served(pub Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` (whose arguments make it serve on `127.0.0.1:0`) with its
/// stdout piped and its stderr dropped, and reads the URL from its first
/// line, `serving on URL`. Panics, naming the line, when the first line
/// is anything else: a test that needs the server must not go on without.
pub fn serve(mut cmd: Command) -> (Served, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let stdout = child.stdout.take().expect("stdout is piped");
    let served = Served(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .unwrap_or_else(|e| panic!("reading the first line of {cmd:?}: {e}"));
    let url = line
        .trim()
        .strip_prefix("serving on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?} from {cmd:?}"))
        .to_string();
    (served, url)
}
