//! `kvbm-recorder export … | head`: the reader closing the pipe early ends
//! the export quietly with status 0, as Unix tools do (it used to end with
//! "error: serialising an event failed: Broken pipe", status 2).

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn a_closed_pipe_ends_export_quietly_with_status_0() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let rec = Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
        .args(["record", "--out"])
        .arg(&log)
        .args(["--requests", "200", "--seed", "3"])
        .output()
        .unwrap();
    assert!(rec.status.success(), "{rec:?}");
    for format in ["jsonl", "chrome"] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvbm-recorder"))
            .args(["export", "--format", format])
            .arg(&log)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Read a little, as `head -c 4096` does, then close the pipe.
        let mut first = vec![0u8; 4096];
        child.stdout.take().unwrap().read_exact(&mut first).unwrap();
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "export did not end");
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert_eq!(status.code(), Some(0), "{format}: {err}");
        assert_eq!(err, "", "{format}: nothing on stderr");
    }
}
