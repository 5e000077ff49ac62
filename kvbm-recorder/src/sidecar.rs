//! A recording's sidecar, `recording.json`: what the recorder knows that
//! the log cannot say (how many events it wrote, what it lost and where,
//! which engine run they belong to, how the recording ended), and how it
//! is written so that it says the truth after a crash or a full disk.
//!
//! - The recorder writes a sidecar saying [`Ended::Unfinished`] when the
//!   recording starts, so a recorder that is killed leaves one that says
//!   so; it is replaced when the recording ends.
//! - Every write is atomic: a temporary file, then a rename (at a
//!   checkpoint, an exchange of the two; see [`write_checkpoint`]). A
//!   reader sees the old sidecar or the new one, never a torn or empty one.
//! - The temporary file is created, [`RESERVE_BYTES`] long, when the
//!   recording starts: the final sidecar is written *into space already
//!   held*, so a disk that filled up during the recording still takes it
//!   (and the reason the recording ended). If it does not fit, the gap
//!   positions are dropped (the totals stay) and it is tried again.
//! - A sidecar without an `ended` field was written by an older recorder,
//!   which wrote its sidecar only when it finished cleanly.

use kvbm_events::RunId;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Name of the sidecar file the recorder writes next to the segments.
pub const SIDECAR: &str = "recording.json";

/// The temporary file the sidecar is written to before its rename (held
/// from the start, [`RESERVE_BYTES`] long).
pub const SIDECAR_TMP: &str = "recording.json.tmp";

/// The file a checkpoint's sidecar is written into before it trades
/// places with [`SIDECAR`] ([`write_checkpoint`]), apart from
/// [`SIDECAR_TMP`] so the space held for the final one stays. Between
/// checkpoints it holds the sidecar before the last; the final sidecar
/// removes it.
pub const SIDECAR_CHECKPOINT_TMP: &str = "recording.json.checkpoint";

/// Space held for the final sidecar while recording.
pub const RESERVE_BYTES: u64 = 64 << 10;

/// Most gap positions a sidecar keeps.
pub const MAX_GAPS: usize = 65_536;

/// The largest sidecar read back: far beyond what a recorder writes (its
/// gaps are capped at [`MAX_GAPS`]), so that a file in its place that is
/// not one (a link to a device, something huge) is refused, not loaded
/// into memory.
pub const MAX_SIDECAR_BYTES: u64 = 64 << 20;

/// Reads the file at `path` whole, refusing one over `max` bytes (with
/// `InvalidData`) after reading no more than one byte past it: for the
/// small files the recorder writes beside its logs, which someone else may
/// have replaced.
pub(crate) fn read_bounded(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    File::open(path)?
        .take(max.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {max} bytes, more than a recorder writes"),
        ));
    }
    Ok(bytes)
}

/// How a recording ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "how", rename_all = "snake_case")]
pub enum Ended {
    /// The recorder is still writing, or it stopped without saying how
    /// (killed, crashed, the machine lost): events after the last one in
    /// the log may never have been written, and what the engine lost is
    /// not known.
    #[default]
    Unfinished,
    /// The recorder finished cleanly: every event it took is in the log.
    Finished {
        /// What ended it (the engine's stream closed, a limit, Ctrl-C).
        #[serde(default)]
        why: String,
    },
    /// The engine restarted: this recording holds the old run up to where
    /// it stopped, and ends there rather than splicing the new run on.
    NewRun {
        /// The new run.
        run: RunId,
    },
    /// Writing failed: the recording holds what reached the disk before
    /// `error` (which names the file); nothing after it was recorded.
    WriteFailed {
        /// The first error, as it was reported.
        error: String,
    },
}

impl Ended {
    /// What an older recorder's sidecar (with no `ended`) means.
    pub fn legacy() -> Self {
        Ended::Finished { why: String::new() }
    }

    /// Whether the recorder finished cleanly (so the log must hold every
    /// event the sidecar counts, with no torn tail).
    pub fn is_clean(&self) -> bool {
        matches!(self, Ended::Finished { .. } | Ended::NewRun { .. })
    }
}

/// What a recording holds; also the sidecar's contents.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Recording {
    /// Engine id.
    pub engine: u32,
    /// The engine run the events belong to, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunId>,
    /// Events written.
    pub events: u64,
    /// Events the tap dropped (marked by `Gap` items), never written.
    pub lost: u64,
    /// First and last seq written.
    pub first_seq: Option<u64>,
    /// Last seq written.
    pub last_seq: Option<u64>,
    /// Snapshots written.
    pub snapshots: u64,
    /// Schema version of the records.
    pub schema_version: u32,
    /// Where the losses fell: each gap marker with the last seq written
    /// before it (`None`: before any). At most [`MAX_GAPS`] entries; later
    /// markers are merged into the last one (totals stay exact).
    #[serde(default)]
    pub gaps: Vec<GapAt>,
    /// Where the events came from, for a recording of a remote source (an
    /// attach server's or a publisher's URL); absent for an in-process
    /// engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// `Some(false)` when the recording stopped while the engine ran on (a
    /// remote source): transfers in flight at its end are not lost.
    /// Absent: the engine's stream ended with the recording.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_complete: Option<bool>,
    /// Events the source no longer held when the recording started (a gap
    /// before the first event written): not a loss inside the recording.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub missed_before_start: u64,
    /// The source client's own counters at the end, as it reports them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<serde_json::Value>,
    /// How the recording ended. (Absent in an older recorder's sidecar,
    /// which it wrote only after finishing cleanly.)
    #[serde(default = "Ended::legacy")]
    pub ended: Ended,
    /// The recording of the engine's previous run, when this one began
    /// because the engine restarted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<PathBuf>,
    /// The recording of the engine's next run, when this one ended because
    /// the engine restarted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<PathBuf>,
    /// True when the gap positions did not fit the space left on a full
    /// disk and were dropped (the totals are exact).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gaps_dropped: bool,
    /// What the engine runs as, as its embedding described it
    /// ([`RecorderConfig::info`](crate::recorder::RecorderConfig::info)):
    /// a JSON object whose `summary` is one line for a person (e.g.
    /// `"vLLM · tp 2 · async scheduling · G2 8,192 tokens (4.0 MiB a rank)
    /// · G3 none"`), with the facts behind it beside. Written from the
    /// first sidecar on, so a recording killed early has it. Absent in an
    /// older recorder's sidecar, or when the engine said nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_info: Option<serde_json::Value>,
}

impl Recording {
    /// The one-line `summary` of [`engine_info`](Self::engine_info), fit
    /// for a terminal ([`engine_summary`]).
    pub fn engine_summary(&self) -> Option<String> {
        self.engine_info.as_ref().and_then(engine_summary)
    }
}

/// Most characters of an engine summary shown ([`engine_summary`]).
pub const MAX_SUMMARY_CHARS: usize = 200;

/// The `summary` string of an engine description (a recording's
/// [`Recording::engine_info`], an attach server's `/health`
/// `engine_info`), fit for a terminal: control characters (a line break,
/// an escape sequence) become spaces, surrounding blanks are trimmed, and
/// it is cut at [`MAX_SUMMARY_CHARS`] with `…`. `None` when there is no
/// summary string, or it is blank. It came from elsewhere (an engine, a
/// file, the network), so it is never printed as it is.
pub fn engine_summary(info: &serde_json::Value) -> Option<String> {
    let s = info.get("summary")?.as_str()?;
    let clean: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let clean = clean.trim();
    (!clean.is_empty()).then(|| kvbm_events::text::clip(clean, MAX_SUMMARY_CHARS))
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One gap marker of the tap, placed in the stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GapAt {
    /// The last seq written before the marker arrived.
    pub after_seq: Option<u64>,
    /// Events lost there.
    pub dropped: u64,
}

/// A recording's sidecar as found on disk.
#[derive(Debug, Clone, PartialEq)]
pub enum Sidecar {
    /// Read and understood.
    Present(Box<Recording>),
    /// There is none.
    Missing,
    /// There is one, but it cannot be read or understood (why).
    Unreadable(String),
}

impl Sidecar {
    /// The recording it describes, if it could be read.
    pub fn recording(&self) -> Option<&Recording> {
        match self {
            Sidecar::Present(r) => Some(r),
            _ => None,
        }
    }
}

/// Reads the sidecar of the recording in `dir`.
pub fn load(dir: &Path) -> Sidecar {
    match read_bounded(&dir.join(SIDECAR), MAX_SIDECAR_BYTES) {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(r) => Sidecar::Present(Box::new(r)),
            Err(e) if bytes.is_empty() => Sidecar::Unreadable(format!("{SIDECAR} is empty ({e})")),
            Err(e) => Sidecar::Unreadable(format!("{SIDECAR} does not parse: {e}")),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Sidecar::Missing,
        Err(e) => Sidecar::Unreadable(format!("reading {SIDECAR}: {e}")),
    }
}

/// The sidecar of a recording, if present and readable.
pub fn read(dir: &Path) -> Option<Recording> {
    match load(dir) {
        Sidecar::Present(r) => Some(*r),
        _ => None,
    }
}

/// Holds space for the final sidecar: creates [`SIDECAR_TMP`] in `dir`,
/// [`RESERVE_BYTES`] long (written, not sparse, so the blocks are really
/// taken). Best effort: without it the final sidecar is written the
/// ordinary way.
pub fn reserve(dir: &Path) -> std::io::Result<()> {
    let mut f = File::create(dir.join(SIDECAR_TMP))?;
    let zeros = vec![b' '; 8 << 10];
    let mut left = RESERVE_BYTES;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        f.write_all(&zeros[..n])?;
        left -= n as u64;
    }
    // Not synced: the file system takes the space at write (ext4's delayed
    // allocation reserves it then; tmpfs allocates), so a full disk shows
    // here already, without an fsync for every log created.
    Ok(())
}

/// Writes `rec` as the sidecar of `dir` atomically: into [`SIDECAR_TMP`]
/// (the space reserved for it, if any), then renamed over [`SIDECAR`].
/// When it does not fit a full disk, the gap positions are dropped (the
/// totals stay) and it is tried once more.
pub fn write(dir: &Path, rec: &Recording) -> Result<(), SidecarError> {
    let path = dir.join(SIDECAR);
    match write_once(dir, rec) {
        Ok(()) => Ok(()),
        Err(e) if !rec.gaps.is_empty() && is_no_space(&e) => {
            let lean = Recording {
                gaps: Vec::new(),
                gaps_dropped: true,
                ..rec.clone()
            };
            write_once(dir, &lean).map_err(|source| SidecarError { path, source })
        }
        Err(source) => Err(SidecarError { path, source }),
    }
}

/// Writes `rec` as the sidecar of `dir` at a checkpoint of a recording
/// under way: atomic for a process that dies, but not synced, as the log
/// it describes is only handed to the OS between its own fsyncs; the
/// space held for the final sidecar is left alone. (A fleet recorder
/// checkpoints every engine's log several times a second: three fsyncs a
/// log each time took it to 1% of what the event plane delivers.)
///
/// The new sidecar is written over [`SIDECAR_CHECKPOINT_TMP`], which then
/// trades places with [`SIDECAR`] in one atomic step (Linux's
/// `RENAME_EXCHANGE`), so it holds the old sidecar until the next
/// checkpoint writes over it: no file is created or freed once both
/// exist. A new file renamed over the sidecar created one file and freed
/// another at every checkpoint of every log: 500 a second for 100 logs
/// checkpointed five times a second, for as long as the recorder runs.
/// On an ext4 without a journal (this project's build machine) each
/// creation also scans past the inodes freed recently: in `perf` runs of
/// a short fleet recording there, creating files fell from 38% of the
/// recorder's samples to 16% (the logs' own files, created once).
/// Where the exchange is not supported, or there is no sidecar yet, the
/// file is renamed over it. The price: the old sidecar's file is written
/// over at the next checkpoint, where a renamed-over one stayed intact
/// for whoever had it open, so a reader that opened the sidecar and
/// stalled past the next checkpoint (200 ms or more in a fleet recorder)
/// could read a mixture, which then fails to parse; readers here read it
/// whole at once.
pub fn write_checkpoint(dir: &Path, rec: &Recording) -> Result<(), SidecarError> {
    let path = dir.join(SIDECAR);
    let tmp = dir.join(SIDECAR_CHECKPOINT_TMP);
    let json = serde_json::to_vec_pretty(rec).map_err(|e| SidecarError {
        path: path.clone(),
        source: std::io::Error::other(e),
    })?;
    write_over(&tmp, &json)
        .and_then(|()| exchange_or_rename(&tmp, &path))
        .map_err(|source| SidecarError { path, source })
}

/// Writes `bytes` over the file at `path` (created if missing): in place,
/// then cut to their length, so an existing file keeps its inode and, if
/// no longer, its blocks.
fn write_over(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    f.write_all(bytes)?;
    f.set_len(bytes.len() as u64)
}

/// Puts `from` at `to` atomically: the two trade places when both exist
/// and the file system can, else `from` is renamed over `to`.
fn exchange_or_rename(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use rustix::fs::{CWD, RenameFlags, renameat_with};
        // Otherwise there is no sidecar yet (ENOENT), or no exchange on
        // this file system or kernel (EINVAL, ENOSYS, EOPNOTSUPP): the
        // plain rename, whose own error says what is wrong if anything is.
        if renameat_with(CWD, from, CWD, to, RenameFlags::EXCHANGE).is_ok() {
            return Ok(());
        }
    }
    std::fs::rename(from, to)
}

fn is_no_space(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull || e.raw_os_error() == Some(28)
}

fn write_once(dir: &Path, rec: &Recording) -> std::io::Result<()> {
    let json = serde_json::to_vec_pretty(rec).map_err(std::io::Error::other)?;
    let tmp = dir.join(SIDECAR_TMP);
    // Into the reserved file when there is one: overwriting blocks it
    // already holds needs no new space.
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&tmp)?;
    f.seek(SeekFrom::Start(0))?;
    f.write_all(&json)?;
    f.set_len(json.len() as u64)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, dir.join(SIDECAR))?;
    // The sidecar before the last checkpoint's, if any: not needed now.
    let _ = std::fs::remove_file(dir.join(SIDECAR_CHECKPOINT_TMP));
    // The rename itself, durable.
    #[cfg(unix)]
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The sidecar could not be written.
#[derive(Debug, thiserror::Error)]
#[error("writing {}: {source}", path.display())]
pub struct SidecarError {
    /// Its path.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checkpoints replace the sidecar whole; once the sidecar and the
    /// checkpoint file both exist they trade places, so no file is
    /// created or freed; the final sidecar removes the checkpoint file.
    #[test]
    fn checkpoints_trade_places_with_the_sidecar_and_the_end_tidies_up() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let rec = |events| Recording {
            events,
            ..Recording::default()
        };
        write_checkpoint(d, &rec(1)).unwrap();
        assert_eq!(read(d), Some(rec(1)));
        write_checkpoint(d, &rec(2)).unwrap();
        assert_eq!(read(d), Some(rec(2)));
        // The file it traded places with holds the sidecar before.
        let before: Recording =
            serde_json::from_slice(&std::fs::read(d.join(SIDECAR_CHECKPOINT_TMP)).unwrap())
                .unwrap();
        assert_eq!(before, rec(1));
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::fs::MetadataExt;
            let inodes = || {
                let mut v = [SIDECAR, SIDECAR_CHECKPOINT_TMP]
                    .map(|f| std::fs::metadata(d.join(f)).unwrap().ino());
                v.sort_unstable();
                v
            };
            let pair = inodes();
            // A longer sidecar, then a shorter one: each read back whole.
            let mut long = rec(3);
            long.gaps = vec![
                GapAt {
                    after_seq: Some(5),
                    dropped: 9,
                };
                100
            ];
            write_checkpoint(d, &long).unwrap();
            assert_eq!(read(d), Some(long));
            write_checkpoint(d, &rec(4)).unwrap();
            assert_eq!(read(d), Some(rec(4)));
            assert_eq!(inodes(), pair, "no file created or freed");
        }
        write(d, &rec(5)).unwrap();
        assert_eq!(read(d), Some(rec(5)));
        assert!(!d.join(SIDECAR_CHECKPOINT_TMP).exists());
    }

    #[test]
    fn an_older_sidecar_without_an_ending_was_finished_cleanly() {
        let old = r#"{"engine":0,"events":3,"lost":0,"first_seq":0,"last_seq":2,
                      "snapshots":0,"schema_version":1}"#;
        let r: Recording = serde_json::from_str(old).unwrap();
        assert_eq!(r.ended, Ended::legacy());
        assert!(r.ended.is_clean());
        assert_eq!(r.run, None);
    }

    /// The engine's description goes out and comes back as it was; a
    /// sidecar without one (an older recorder's, or an engine that said
    /// nothing) reads as `None` and is written without the field.
    #[test]
    fn engine_info_round_trips_and_an_older_sidecar_has_none() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let info = serde_json::json!({
            "summary": "vLLM · tp 2 · async scheduling · G2 8,192 tokens (4.0 MiB a rank) · G3 none",
            "source": "vllm",
            "tensor_parallel": 2,
            "pipeline_parallel": 1,
            "async_scheduling": true,
            "block_size": 32,
            "host_tokens": 8192,
            "disk_tokens": 0,
        });
        let rec = Recording {
            events: 3,
            engine_info: Some(info.clone()),
            ..Recording::default()
        };
        write_checkpoint(d, &rec).unwrap();
        assert_eq!(read(d), Some(rec.clone()));
        write(d, &rec).unwrap();
        let back = read(d).unwrap();
        assert_eq!(back.engine_info, Some(info));
        assert_eq!(
            back.engine_summary().as_deref(),
            Some("vLLM · tp 2 · async scheduling · G2 8,192 tokens (4.0 MiB a rank) · G3 none")
        );
        let raw: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.join(SIDECAR)).unwrap()).unwrap();
        assert_eq!(raw["engine_info"]["tensor_parallel"], 2);

        // Written by a recorder before the field existed.
        let old = r#"{"engine":0,"run":"00000000000000ff","events":3,"lost":0,"first_seq":0,
                      "last_seq":2,"snapshots":0,"schema_version":2,"gaps":[],
                      "ended":{"how":"finished","why":"the stream ended"}}"#;
        std::fs::write(d.join(SIDECAR), old).unwrap();
        let r = match load(d) {
            Sidecar::Present(r) => r,
            other => panic!("{other:?}"),
        };
        assert_eq!((r.events, r.engine_info.clone()), (3, None));
        assert_eq!(r.engine_summary(), None);
        let without = serde_json::to_string(&Recording::default()).unwrap();
        assert!(!without.contains("engine_info"), "{without}");
    }

    /// Only a non-blank `summary` string is a summary, and it is made safe
    /// for a terminal: no control characters, bounded.
    #[test]
    fn an_engine_summary_is_one_bounded_line() {
        use serde_json::json;
        assert_eq!(engine_summary(&json!({"source": "vllm"})), None);
        assert_eq!(engine_summary(&json!({"summary": 2})), None);
        assert_eq!(engine_summary(&json!({"summary": " \n "})), None);
        assert_eq!(engine_summary(&json!("summary")), None);
        assert_eq!(
            engine_summary(&json!({"summary": "tp 2\n\u{1b}[2Jasync "})).as_deref(),
            Some("tp 2  [2Jasync")
        );
        let long = engine_summary(&json!({"summary": "x".repeat(1000)})).unwrap();
        assert_eq!(long.chars().count(), MAX_SUMMARY_CHARS + 1);
        assert!(long.ends_with('…'));
    }

    /// A written sidecar replaces the old one whole, through the reserved
    /// file, which is gone afterwards; missing, empty and garbled
    /// sidecars are told apart.
    #[test]
    fn a_file_over_the_bound_is_refused_after_reading_one_byte_past_it() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, [7u8; 11]).unwrap();
        assert_eq!(read_bounded(&p, 11).unwrap().len(), 11);
        let e = read_bounded(&p, 10).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("larger than 10 bytes"), "{e}");
        // Something endless in its place.
        let e = read_bounded(Path::new("/dev/zero"), 1 << 16).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        std::os::unix::fs::symlink("/dev/zero", d.path().join(SIDECAR)).unwrap();
        assert!(matches!(load(d.path()), Sidecar::Unreadable(why) if why.contains("larger than")));
    }

    #[test]
    fn sidecars_are_replaced_whole_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        assert_eq!(load(d), Sidecar::Missing);
        reserve(d).unwrap();
        assert_eq!(
            std::fs::metadata(d.join(SIDECAR_TMP)).unwrap().len(),
            RESERVE_BYTES
        );
        let mut rec = Recording {
            run: Some(RunId(9)),
            ..Recording::default()
        };
        write(d, &rec).unwrap();
        assert_eq!(load(d), Sidecar::Present(Box::new(rec.clone())));
        assert!(!d.join(SIDECAR_TMP).exists());
        rec.ended = Ended::WriteFailed {
            error: "disk full".into(),
        };
        write(d, &rec).unwrap();
        assert_eq!(read(d), Some(rec));
        std::fs::write(d.join(SIDECAR), b"").unwrap();
        assert!(matches!(load(d), Sidecar::Unreadable(m) if m.contains("empty")));
        std::fs::write(d.join(SIDECAR), b"{\"engine\":").unwrap();
        assert!(matches!(load(d), Sidecar::Unreadable(m) if m.contains("does not parse")));
    }
}
