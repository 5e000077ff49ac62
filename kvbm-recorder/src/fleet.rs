//! A fleet recording: every engine of a NATS event plane in one directory,
//! one ordinary log per engine plus a manifest.
//!
//! ```text
//! DIR/fleet.json          the manifest: source, consumer, one entry per log
//! DIR/engines/<engine>/   the engine's log (the first run seen)
//! DIR/engines/<engine>.2/ the same engine after a restart (a new run: its
//!                         seqs start again, so it cannot share a log)
//! ```
//!
//! Each engine's directory is a log like any other (segments, index,
//! `recording.json`), so every command that reads a log reads one engine;
//! the CLI runs `check`, `stats` and `export` per engine and for the fleet.
//! A log's seqs must increase, which is why there is one per (engine, run)
//! rather than one interleaved log: an engine's events stay in its own
//! order and a hole is a jump in its own seqs.
//!
//! [`FleetWriter`] applies each (engine, seq) once ([`Tracker`]), writes a
//! gap where seqs jump, and [`checkpoint`](FleetWriter::checkpoint)s: every
//! log handed to the OS (and fsynced, as the policy says), every sidecar
//! and the manifest written; [`checkpoint_detached`](FleetWriter::checkpoint_detached)
//! leaves the fsyncs to run elsewhere ([`Syncs`]) while writing goes on.
//! The recorder acknowledges JetStream only after a checkpoint, so a recorder
//! killed at any moment restarts from its logs ([`FleetWriter::open`]
//! resumes them) and the redelivered messages it already wrote are skipped
//! as duplicates: no duplicates, no holes. [`FleetWriter::into_shards`]
//! splits a writer into several, each owning some engines' logs, to write
//! on threads of their own (the `kvbm-recorder` program's `kvbm_cli::shards`).
//!
//! Every log keeps its segment open, so a fleet of thousands of engines
//! needs thousands of open files, past the soft limit most systems start
//! a process with (1,024); [`raise_open_files_limit`] lifts it to the hard
//! limit, which the binaries do as they start. A log left without events
//! for [`CLOSE_IDLE_AFTER`] is closed at the next checkpoint (its sidecar
//! written, its file released) and reopened when its engine sends again,
//! so what a recorder running for months holds open is the engines that
//! spoke lately, not every pod and every run it ever saw.
//!
//! A writer holds the recording's [`LOCK`] (shared by its shards) so that
//! a second recorder given the same directory is refused. Readers take a
//! manifest only if each of its logs is named as the recorder names them,
//! so an edited one cannot send them outside the recording;
//! [`recording_kind`] tells a reader what a directory holds, or why it is
//! no recording.

use crate::log::{FsyncPolicy, PendingSync};
use crate::recorder::{RecordError, RecorderConfig, Recording, RecordingSink};
use kvbm_events::Event;
use kvbm_schema::columnar::CheckedBlock;
use kvbm_schema::nats::track::{Admit, Tracker};
use kvbm_schema::nats::wire::BatchHeader;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a log goes without events before it is closed (and reopened,
/// its bookkeeping from its sidecar, when its engine sends again): long
/// beside an engine's pauses between batches, so a live engine's log stays
/// open, short beside the days a gone pod's log would otherwise be held.
pub const CLOSE_IDLE_AFTER: Duration = Duration::from_secs(300);

/// Raises this process's soft limit on open files to its hard limit (a
/// fleet recording keeps a file open per engine); the limit now, where
/// the platform has one and it could be read.
pub fn raise_open_files_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        rlimit::increase_nofile_limit(u64::MAX).ok()
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// The manifest's file name.
pub const MANIFEST: &str = "fleet.json";
/// Where the engines' logs are.
pub const ENGINES_DIR: &str = "engines";
/// The manifest's format version.
pub const FORMAT: u32 = 1;

/// The manifest.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetManifest {
    /// [`FORMAT`].
    pub format: u32,
    /// Where the events came from (`nats://…`).
    pub source: String,
    /// The JetStream consumer that fed it.
    #[serde(default)]
    pub consumer: Option<String>,
    /// One entry per log, by its directory name under `engines/`.
    pub logs: BTreeMap<String, LogEntry>,
    /// Messages refused (not a batch, damaged) with no engine to count
    /// them on.
    #[serde(default)]
    pub refused_unattributed: u64,
    /// The last refusal, for the operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_refusal: Option<String>,
}

/// One engine run's log in the manifest.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LogEntry {
    /// The engine's name.
    pub engine: String,
    /// Its run (hex), from the batches.
    pub run: String,
    /// Events the publisher declared it dropped (its latest total).
    pub declared_dropped: u64,
    /// Events skipped because they had been written already.
    pub duplicates: u64,
    /// Messages of this engine refused as damaged.
    pub refused: u64,
}

/// The largest manifest read back: room for millions of logs' entries,
/// so that a file in its place that is not one is refused, not loaded.
pub const MAX_MANIFEST_BYTES: u64 = 1 << 30;

/// The file in a fleet recording whose lock says a recorder is writing
/// it (left behind, unlocked, when it stops).
pub const LOCK: &str = "recorder.lock";

/// Takes the recording's lock, or says another recorder holds it: two
/// recorders writing the same logs would each count the other's events as
/// theirs and interleave their frames. The lock goes with the process, so
/// a killed recorder never leaves it held.
fn lock(dir: &Path) -> Result<std::sync::Arc<std::fs::File>, FleetError> {
    let path = dir.join(LOCK);
    let error = |message: String| FleetError::Manifest {
        path: path.clone(),
        message,
    };
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| error(e.to_string()))?;
    match f.try_lock() {
        Ok(()) => Ok(std::sync::Arc::new(f)),
        Err(std::fs::TryLockError::WouldBlock) => Err(error(
            "another recorder is writing this recording (it holds this lock): stop it first, \
             or record elsewhere"
                .into(),
        )),
        Err(std::fs::TryLockError::Error(e)) => Err(error(format!("taking the lock: {e}"))),
    }
}

/// Whether `dir` holds a fleet recording.
pub fn is_fleet(dir: &Path) -> bool {
    dir.join(MANIFEST).is_file()
}

/// What a directory given to a reading command holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordingKind {
    /// One engine's log: segments, or a sidecar (a recording of no events).
    Log,
    /// A fleet recording: a manifest and its engines' logs.
    Fleet,
}

/// Says whether `dir` is a recording to read, and which kind, or why it is
/// not one: so that a reader given the wrong directory says so, instead
/// of reading it as a log of no events (a directory without segments opens
/// as an empty log), and a fleet whose manifest is gone is not mistaken
/// for an empty recording.
pub fn recording_kind(dir: &Path) -> Result<RecordingKind, String> {
    let shown = dir.display();
    let meta = std::fs::metadata(dir).map_err(|e| format!("opening recording {shown}: {e}"))?;
    if !meta.is_dir() {
        return Err(format!(
            "{shown} is not a directory: a recording is the directory that holds its \
             segments (*{}), not one of its files",
            crate::log::SEGMENT_SUFFIX
        ));
    }
    if dir.join(MANIFEST).is_file() {
        return Ok(RecordingKind::Fleet);
    }
    if dir.join(ENGINES_DIR).is_dir() {
        return Err(format!(
            "{shown} holds {ENGINES_DIR}/ but no {MANIFEST}: a fleet recording whose manifest \
             is missing; each engine's log can still be read on its own, at \
             {shown}/{ENGINES_DIR}/<engine>"
        ));
    }
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{shown}: {e}"))?;
    let has_log = entries.filter_map(Result::ok).any(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        name == crate::sidecar::SIDECAR || crate::log::parse_segment_file_name(&name).is_some()
    });
    if has_log {
        Ok(RecordingKind::Log)
    } else {
        Err(format!(
            "{shown} holds no kvbm recording: no log segments (*{}), no {}, no {MANIFEST}",
            crate::log::SEGMENT_SUFFIX,
            crate::sidecar::SIDECAR
        ))
    }
}

/// Why a fleet recording could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// A log failed.
    #[error("{dir}: {source}")]
    Log {
        /// The engine's log.
        dir: PathBuf,
        /// Why.
        #[source]
        source: RecordError,
    },
    /// The manifest could not be read or written.
    #[error("{}: {message}", path.display())]
    Manifest {
        /// Its path.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// A thread to sync or close logs on could not be started.
    #[error("starting a thread for the logs: {0}")]
    Thread(#[source] std::io::Error),
}

/// Reads the manifest of the fleet recording in `dir`.
pub fn read_manifest(dir: &Path) -> Result<FleetManifest, FleetError> {
    let path = dir.join(MANIFEST);
    let bytes = crate::sidecar::read_bounded(&path, MAX_MANIFEST_BYTES).map_err(|e| {
        FleetError::Manifest {
            path: path.clone(),
            message: e.to_string(),
        }
    })?;
    let m: FleetManifest = serde_json::from_slice(&bytes).map_err(|e| FleetError::Manifest {
        path: path.clone(),
        message: e.to_string(),
    })?;
    if m.format != FORMAT {
        return Err(FleetError::Manifest {
            path,
            message: format!("format {}, this build reads {FORMAT}", m.format),
        });
    }
    // Every reader joins these names to the recording's directory: one that
    // is not a log's name as the recorder makes them (`<engine>` or
    // `<engine>.<run>`) would have it read (or a resumed recorder write)
    // outside the recording.
    for (name, entry) in &m.logs {
        if let Err(why) = check_log_name(name, &entry.engine) {
            return Err(FleetError::Manifest {
                path,
                message: format!("log {name:?}: {why}; the manifest is damaged or was edited"),
            });
        }
    }
    Ok(m)
}

/// Whether `name` is a log's name under `engines/` as the recorder makes
/// them for `engine`: the engine's name for its first run, `<engine>.N`
/// (N ≥ 2) for the Nth.
fn check_log_name(name: &str, engine: &str) -> Result<(), String> {
    kvbm_schema::nats::check_engine_name(engine).map_err(|e| e.to_string())?;
    let run = match name.strip_prefix(engine) {
        Some("") => return Ok(()),
        Some(rest) => rest.strip_prefix('.'),
        None => None,
    };
    match run.and_then(|n| n.parse::<u64>().ok()) {
        Some(n) if n >= 2 && run.is_some_and(|r| !r.starts_with('0')) => Ok(()),
        _ => Err(format!(
            "not the name of a log of engine {engine:?} (`{engine}` or `{engine}.N`, N ≥ 2)"
        )),
    }
}

/// The engines' logs of a fleet recording: (directory name, path, entry).
pub fn engine_logs(dir: &Path, m: &FleetManifest) -> Vec<(String, PathBuf, LogEntry)> {
    m.logs
        .iter()
        .map(|(name, e)| (name.clone(), dir.join(ENGINES_DIR).join(name), e.clone()))
        .collect()
}

/// The shard of `n` that writes `engine`'s logs (FNV-1a of its name): the
/// same for every run of an engine.
pub fn shard_of(engine: &str, n: usize) -> usize {
    let h = engine.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    (h % n.max(1) as u64) as usize
}

/// The manifest of a recording written by shards: `base` (what
/// [`FleetWriter::into_shards`] returned, with the refusals counted
/// outside the shards) with every shard's logs and refusals.
pub fn merge_manifests(base: &FleetManifest, shards: &[FleetManifest]) -> FleetManifest {
    let mut m = base.clone();
    for s in shards {
        m.logs
            .extend(s.logs.iter().map(|(k, v)| (k.clone(), v.clone())));
        m.refused_unattributed += s.refused_unattributed;
        if s.last_refusal.is_some() {
            m.last_refusal.clone_from(&s.last_refusal);
        }
    }
    m
}

/// Writes `m` as the manifest of the recording in `dir` (atomically).
pub fn write_manifest(dir: &Path, m: &FleetManifest) -> Result<(), FleetError> {
    let path = dir.join(MANIFEST);
    let json = serde_json::to_vec_pretty(m).unwrap_or_default();
    write_atomic(&path, &json).map_err(|e| FleetError::Manifest {
        path,
        message: e.to_string(),
    })
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a
/// reader (or a restart after a kill) sees the old or the new, never half.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

struct OpenLog {
    name: String,
    sink: RecordingSink,
    tracker: Tracker,
    /// Written since the last checkpoint (only these are checkpointed: a
    /// fleet of idle engines costs a checkpoint nothing).
    dirty: bool,
    /// Written since the last fsync.
    unsynced: bool,
    /// When it was last written.
    written_at: Instant,
}

impl OpenLog {
    /// Records in the log what was lost before an event about to be
    /// written with `seq`: the hole the tracker found, or, for the run's
    /// first event, the seqs before it. Returns the events lost.
    fn record_loss(&mut self, hole_before: u64, first_of_run: bool, seq: u64) -> u64 {
        if hole_before > 0 {
            self.sink.gap(hole_before);
            hole_before
        } else if first_of_run && seq > 0 {
            self.sink.missed_before_start(seq);
            seq
        } else {
            0
        }
    }

    /// Marks the log as written (for the next checkpoint and sync).
    fn touched(&mut self) {
        self.dirty = true;
        self.unsynced = true;
        self.written_at = Instant::now();
    }

    /// A write error, naming the log's directory under `engines`.
    fn error(&self, engines: &Path, source: RecordError) -> FleetError {
        FleetError::Log {
            dir: engines.join(&self.name),
            source,
        }
    }
}

/// What applying one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Events written.
    pub written: u64,
    /// Events skipped as already written.
    pub duplicates: u64,
    /// Events missing before ones written (holes found).
    pub missing: u64,
}

/// Logs a writer has open, and how many it closed for want of events and
/// opened again ([`CLOSE_IDLE_AFTER`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenLogs {
    /// Open now.
    pub open: u64,
    /// Closed after going without events (this session).
    pub closed_idle: u64,
    /// Reopened after such a close, their engine sending again.
    pub reopened: u64,
}

impl OpenLogs {
    /// The counts of several writers together.
    pub fn add(&mut self, other: OpenLogs) {
        self.open += other.open;
        self.closed_idle += other.closed_idle;
        self.reopened += other.reopened;
    }
}

/// Writes a fleet recording; see the module docs.
pub struct FleetWriter {
    dir: PathBuf,
    manifest: FleetManifest,
    cfg: RecorderConfig,
    /// When the logs are fsynced: the caller's policy, applied by
    /// [`checkpoint`](FleetWriter::checkpoint) to every log written since
    /// the last sync at once (the logs themselves sync only when told).
    sync_policy: FsyncPolicy,
    last_sync: Instant,
    open: HashMap<(String, u64), OpenLog>,
    /// What the logs closed for want of events held when they closed
    /// (their gaps left to their sidecars), by directory name.
    closed: HashMap<String, Recording>,
    close_idle_after: Option<Duration>,
    closed_idle: u64,
    reopened: u64,
    /// (engine, run) → directory name, for runs in the manifest.
    known: HashMap<(String, u64), String>,
    /// One of several ([`into_shards`](Self::into_shards)): writes no
    /// manifest.
    shard: bool,
    /// The manifest changed since [`manifest_if_changed`](Self::manifest_if_changed)
    /// last returned it.
    manifest_changed: bool,
    /// The recording's [`LOCK`], held by every shard until the last one
    /// goes.
    lock: Option<std::sync::Arc<std::fs::File>>,
}

impl std::fmt::Debug for FleetWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetWriter")
            .field("dir", &self.dir)
            .field("logs", &self.manifest.logs.len())
            .finish_non_exhaustive()
    }
}

impl FleetWriter {
    /// Creates the recording in `dir`, or resumes the one there (same
    /// source expected; the logs are reopened as their engines send).
    /// Snapshots are off (`cfg.snapshot_every_events` is ignored): a
    /// fleet recorder writes as fast as the stream delivers, and readers
    /// build their own checkpoints.
    pub fn open(
        dir: &Path,
        source: &str,
        consumer: Option<&str>,
        cfg: RecorderConfig,
    ) -> Result<Self, FleetError> {
        let sync_policy = cfg.log.fsync;
        let mut cfg = RecorderConfig {
            snapshot_every_events: 0,
            ..cfg
        };
        // A log per engine, each fsyncing on its own timer, would make a
        // fleet of N engines N fsyncs an interval, one after the other in
        // the receiving loop; they sync together at checkpoints instead.
        if sync_policy != FsyncPolicy::Never {
            cfg.log.fsync = FsyncPolicy::OnSync;
        }
        let mpath = dir.join(MANIFEST);
        let manifest = if mpath.is_file() {
            read_manifest(dir)?
        } else {
            let not_empty = std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some());
            if not_empty {
                return Err(FleetError::Manifest {
                    path: mpath,
                    message: "the directory exists, is not empty and holds no fleet recording"
                        .into(),
                });
            }
            FleetManifest {
                format: FORMAT,
                source: source.to_string(),
                consumer: consumer.map(str::to_string),
                ..FleetManifest::default()
            }
        };
        let known = manifest
            .logs
            .iter()
            .filter_map(|(name, e)| {
                let run = u64::from_str_radix(&e.run, 16).ok()?;
                Some(((e.engine.clone(), run), name.clone()))
            })
            .collect();
        let w = FleetWriter {
            dir: dir.to_path_buf(),
            manifest,
            cfg,
            sync_policy,
            last_sync: Instant::now(),
            open: HashMap::new(),
            closed: HashMap::new(),
            close_idle_after: Some(CLOSE_IDLE_AFTER),
            closed_idle: 0,
            reopened: 0,
            known,
            shard: false,
            manifest_changed: true,
            lock: None,
        };
        std::fs::create_dir_all(dir.join(ENGINES_DIR)).map_err(|e| FleetError::Manifest {
            path: dir.to_path_buf(),
            message: e.to_string(),
        })?;
        let w = FleetWriter {
            lock: Some(lock(dir)?),
            ..w
        };
        w.write_manifest()?;
        Ok(w)
    }

    /// The manifest as it stands.
    pub fn manifest(&self) -> &FleetManifest {
        &self.manifest
    }

    /// The manifest, if it changed since this last returned it (a log
    /// added, a refusal, duplicates or declared drops counted); the first
    /// call returns it. A checkpoint of a fleet whose logs only grew need
    /// not copy, merge and write an entry for every log ever recorded.
    pub fn manifest_if_changed(&mut self) -> Option<&FleetManifest> {
        std::mem::take(&mut self.manifest_changed).then_some(&self.manifest)
    }

    /// The recording's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Closes, at a checkpoint, each log that has gone this long without
    /// events (`None`: never); [`CLOSE_IDLE_AFTER`] unless set. Shards made
    /// after this take it on.
    pub fn set_close_idle_after(&mut self, after: Option<Duration>) {
        self.close_idle_after = after;
    }

    /// Logs open now, closed for want of events and reopened.
    pub fn open_logs(&self) -> OpenLogs {
        OpenLogs {
            open: self.open.len() as u64,
            closed_idle: self.closed_idle,
            reopened: self.reopened,
        }
    }

    fn write_manifest(&self) -> Result<(), FleetError> {
        if self.shard {
            // The shards' owner writes the manifest of them all.
            return Ok(());
        }
        write_manifest(&self.dir, &self.manifest)
    }

    /// Splits a writer that has not written yet into `n` (at least one)
    /// that together write the same recording, each on a thread of its
    /// own: shard `i` takes the engines [`shard_of`] gives `i`, with their
    /// entries in the manifest. A shard writes no manifest; the caller
    /// writes the one of them all ([`merge_manifests`] of the base this
    /// returns and each shard's [`manifest`](Self::manifest)) after their
    /// checkpoints. An engine's runs all go to one shard, so its logs are
    /// named as by one writer.
    pub fn into_shards(self, n: usize) -> (FleetManifest, Vec<FleetWriter>) {
        let n = n.max(1);
        let base = FleetManifest {
            logs: BTreeMap::new(),
            ..self.manifest.clone()
        };
        let shards = (0..n)
            .map(|i| {
                let mut manifest = FleetManifest {
                    refused_unattributed: 0,
                    last_refusal: None,
                    ..self.manifest.clone()
                };
                manifest.logs.retain(|_, e| shard_of(&e.engine, n) == i);
                let known = self
                    .known
                    .iter()
                    .filter(|((engine, _), _)| shard_of(engine, n) == i)
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                FleetWriter {
                    dir: self.dir.clone(),
                    manifest,
                    cfg: self.cfg.clone(),
                    sync_policy: self.sync_policy,
                    last_sync: self.last_sync,
                    open: HashMap::new(),
                    closed: HashMap::new(),
                    close_idle_after: self.close_idle_after,
                    closed_idle: 0,
                    reopened: 0,
                    known,
                    shard: true,
                    manifest_changed: true,
                    lock: self.lock.clone(),
                }
            })
            .collect();
        (base, shards)
    }

    fn log_for(&mut self, engine: &str, run: u64) -> Result<&mut OpenLog, FleetError> {
        let key = (engine.to_string(), run);
        if !self.open.contains_key(&key) {
            let (name, resumed) = match self.known.get(&key) {
                Some(n) => {
                    if self.closed.remove(n).is_some() {
                        self.reopened += 1;
                    }
                    (n.clone(), true)
                }
                None => {
                    // A new run: the engine's name, or name.k after a restart.
                    let runs = self
                        .manifest
                        .logs
                        .values()
                        .filter(|e| e.engine == engine)
                        .count();
                    let name = if runs == 0 {
                        engine.to_string()
                    } else {
                        format!("{engine}.{}", runs + 1)
                    };
                    self.manifest.logs.insert(
                        name.clone(),
                        LogEntry {
                            engine: engine.to_string(),
                            run: format!("{run:016x}"),
                            ..LogEntry::default()
                        },
                    );
                    self.known.insert(key.clone(), name.clone());
                    self.manifest_changed = true;
                    self.write_manifest()?;
                    (name, false)
                }
            };
            let dir = self.dir.join(ENGINES_DIR).join(&name);
            let wrap = |source| FleetError::Log {
                dir: dir.clone(),
                source,
            };
            let mut sink = RecordingSink::resume(&dir, &self.cfg).map_err(wrap)?;
            let rec = sink.recording().clone();
            sink.set_source(format!("{}#{engine}", self.manifest.source));
            let declared = self
                .manifest
                .logs
                .get(&name)
                .map_or(0, |e| e.declared_dropped);
            let tracker = match (rec.first_seq, rec.last_seq) {
                (Some(f), Some(l)) => {
                    if resumed && rec.missed_before_start == 0 && f > 0 {
                        sink.missed_before_start(f);
                    }
                    Tracker::resume(f, l, rec.events, declared)
                }
                _ => Tracker {
                    declared_dropped: declared,
                    ..Tracker::default()
                },
            };
            self.open.insert(
                key.clone(),
                OpenLog {
                    name,
                    sink,
                    tracker,
                    dirty: false,
                    unsynced: false,
                    written_at: Instant::now(),
                },
            );
        }
        Ok(self.open.get_mut(&key).expect("inserted above"))
    }

    /// Applies one batch of `engine`: each event written once, a gap
    /// written where its seqs jump.
    pub fn apply(
        &mut self,
        engine: &str,
        header: &BatchHeader,
        events: &[Event],
    ) -> Result<Applied, FleetError> {
        let engines = self.dir.join(ENGINES_DIR);
        let log = self.log_for(engine, header.run)?;
        log.tracker.declared(header.dropped_before);
        let mut out = Applied::default();
        log.touched();
        for ev in events {
            match log.tracker.admit(ev.seq) {
                Admit::Duplicate => out.duplicates += 1,
                Admit::Apply { hole_before } => {
                    let first_of_run = log.tracker.applied == 1;
                    out.missing += log.record_loss(hole_before, first_of_run, ev.seq);
                    log.sink
                        .append(ev)
                        .map_err(|source| log.error(&engines, source))?;
                    out.written += 1;
                }
            }
        }
        let (name, declared) = (log.name.clone(), log.tracker.declared_dropped);
        self.note_in_manifest(&name, declared, out.duplicates);
        Ok(out)
    }

    /// Applies one batch of `engine` whose block arrived encoded: when its
    /// seqs are consecutive and all new (the usual case), the block goes
    /// into the log as it is ([`RecordingSink::append_block`]), neither
    /// decoded nor encoded again; otherwise (a redelivery that overlaps
    /// what was written, holes inside the batch) event by event, as
    /// [`apply`](Self::apply). `header` is the batch's, checked against
    /// `block` (`wire::check`); `lz4` is its compressed form as received,
    /// if any.
    pub fn apply_block(
        &mut self,
        engine: &str,
        header: &BatchHeader,
        block: CheckedBlock<'_>,
        lz4: Option<&[u8]>,
    ) -> Result<Applied, FleetError> {
        let consecutive = header.last_seq.checked_sub(header.first_seq)
            == Some(u64::from(header.count).saturating_sub(1));
        let engines = self.dir.join(ENGINES_DIR);
        let log = self.log_for(engine, header.run)?;
        log.tracker.declared(header.dropped_before);
        let first_of_run = log.tracker.last.is_none();
        let admitted = if consecutive {
            log.tracker.admit_range(header.first_seq, header.last_seq)
        } else {
            None
        };
        let Some(hole_before) = admitted else {
            let mut events = Vec::with_capacity(block.len());
            block
                .view()
                .and_then(|v| v.decode_into(&mut events))
                .map_err(|e| log.error(&engines, RecordError::Log(e.into())))?;
            return self.apply(engine, header, &events);
        };
        let out = Applied {
            written: u64::from(header.count),
            missing: log.record_loss(hole_before, first_of_run, header.first_seq),
            ..Applied::default()
        };
        log.touched();
        log.sink
            .append_block(block, lz4)
            .map_err(|source| log.error(&engines, source))?;
        let (name, declared) = (log.name.clone(), log.tracker.declared_dropped);
        self.note_in_manifest(&name, declared, 0);
        Ok(out)
    }

    /// Keeps in the manifest's entry for log `name` what its publisher
    /// declared dropped and the duplicates it skipped.
    fn note_in_manifest(&mut self, name: &str, declared_dropped: u64, duplicates: u64) {
        if let Some(e) = self.manifest.logs.get_mut(name)
            && (declared_dropped > e.declared_dropped || duplicates > 0)
        {
            e.declared_dropped = e.declared_dropped.max(declared_dropped);
            e.duplicates += duplicates;
            self.manifest_changed = true;
        }
    }

    /// A message that was not a usable batch: counted on its engine when
    /// the subject named one.
    pub fn refused(&mut self, engine: Option<&str>, why: &str) {
        let entry = engine.and_then(|e| {
            self.manifest
                .logs
                .iter_mut()
                .rev()
                .find(|(_, l)| l.engine == e)
                .map(|(_, l)| l)
        });
        match entry {
            Some(l) => l.refused += 1,
            None => self.manifest.refused_unattributed += 1,
        }
        self.manifest_changed = true;
        self.manifest.last_refusal = Some(kvbm_events::text::clip(
            why,
            kvbm_events::text::MAX_MESSAGE_CHARS,
        ));
    }

    /// Every log handed to the OS, every sidecar and the manifest written:
    /// after this returns, what was applied survives the recorder being
    /// killed. When the fsync policy says it is time (always for
    /// `EveryRecord`, once the interval has passed for `Interval`), every
    /// log written since the last sync is fsynced first, all at once on a
    /// few threads (the device merges concurrent flushes), so what is
    /// acknowledged after a synced checkpoint survives a power loss too.
    pub fn checkpoint(&mut self) -> Result<(), FleetError> {
        self.checkpoint_detached()?.run()?;
        self.write_manifest()
    }

    /// [`checkpoint`](Self::checkpoint) without its fsyncs and its
    /// manifest: every log handed to the OS and every sidecar written, and
    /// the fsyncs the policy calls for returned, to run on other threads
    /// while this writer goes on ([`Syncs::run`]). What was applied before
    /// this call is durable once they have run; a caller that acknowledges
    /// only then keeps the guarantee of `checkpoint` without holding its
    /// writes back while the device flushes.
    pub fn checkpoint_detached(&mut self) -> Result<Syncs, FleetError> {
        let sync = match self.sync_policy {
            FsyncPolicy::Never => false,
            FsyncPolicy::Interval(d) => self.last_sync.elapsed() >= d,
            FsyncPolicy::EveryRecord | FsyncPolicy::OnSync => true,
        };
        let engines = self.dir.join(ENGINES_DIR);
        let mut syncs = Syncs::default();
        for log in self.open.values_mut() {
            if sync && log.unsynced {
                if let Some(p) = log.sink.detach_sync().map_err(|e| log.error(&engines, e))? {
                    syncs.0.push((engines.join(&log.name), p));
                }
                log.unsynced = false;
            }
            if log.dirty {
                log.sink.checkpoint().map_err(|e| log.error(&engines, e))?;
                log.dirty = false;
            }
        }
        if sync {
            self.last_sync = Instant::now();
        }
        self.close_idle()?;
        Ok(syncs)
    }

    /// Closes the logs checkpointed above that have gone
    /// `close_idle_after` without events. An fsync detached for one still
    /// runs on its own handle of the file, so closing it takes nothing
    /// from that checkpoint's durability.
    fn close_idle(&mut self) -> Result<(), FleetError> {
        let Some(after) = self.close_idle_after else {
            return Ok(());
        };
        let idle: Vec<_> = self
            .open
            .iter()
            .filter(|(_, l)| l.written_at.elapsed() >= after)
            .map(|(k, _)| k.clone())
            .collect();
        let engines = self.dir.join(ENGINES_DIR);
        for key in idle {
            let Some(mut log) = self.open.remove(&key) else {
                continue;
            };
            log.sink.end_because(format!(
                "closed after {} s without events; reopened when its engine sends again",
                after.as_secs()
            ));
            let name = log.name.clone();
            let mut rec = log.sink.finish().map_err(|source| FleetError::Log {
                dir: engines.join(&name),
                source,
            })?;
            // The gaps are in the sidecar; the summary keeps the counts.
            rec.gaps = Vec::new();
            self.closed.insert(name, rec);
            self.closed_idle += 1;
        }
        Ok(())
    }

    /// Per log written in this session: its directory name and what it
    /// holds so far (for a log closed for want of events, without its
    /// gaps: they are in its sidecar).
    pub fn recordings(&self) -> Vec<(String, Recording)> {
        let mut v: Vec<_> = self
            .open
            .values()
            .map(|l| (l.name.clone(), l.sink.recording().clone()))
            .chain(self.closed.iter().map(|(n, r)| (n.clone(), r.clone())))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Events written in this session and before (every log written in
    /// this session).
    pub fn events(&self) -> u64 {
        let open: u64 = self.open.values().map(|l| l.sink.recording().events).sum();
        open + self.closed.values().map(|r| r.events).sum::<u64>()
    }

    /// Closes every log (each synced unless the policy is `Never`, its
    /// sidecar written) and the manifest.
    pub fn finish(mut self) -> Result<FleetManifest, FleetError> {
        let engines = self.dir.join(ENGINES_DIR);
        let mut logs: Vec<Option<OpenLog>> = self.open.drain().map(|(_, l)| Some(l)).collect();
        let closed = in_parallel(&mut logs, |slot| match slot.take() {
            Some(log) => log
                .sink
                .finish()
                .map(drop)
                .map_err(|source| FleetError::Log {
                    dir: engines.join(&log.name),
                    source,
                }),
            None => Ok(()),
        });
        self.write_manifest()?;
        closed.map(|()| self.manifest)
    }
}

/// The fsyncs a checkpoint leaves to run
/// ([`FleetWriter::checkpoint_detached`]), each with its log's directory.
#[derive(Debug, Default)]
pub struct Syncs(Vec<(PathBuf, PendingSync)>);

impl Syncs {
    /// Logs to fsync.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there is nothing to fsync.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds `other`'s fsyncs to these.
    pub fn append(&mut self, other: Syncs) {
        self.0.extend(other.0);
    }

    /// Runs every fsync, on up to eight threads (the device
    /// merges concurrent flushes); the first error, naming its log.
    pub fn run(self) -> Result<(), FleetError> {
        let mut items: Vec<_> = self.0.into_iter().map(Some).collect();
        in_parallel(&mut items, |slot| match slot.take() {
            Some((dir, p)) => p.run().map_err(|e| FleetError::Log {
                dir,
                source: e.into(),
            }),
            None => Ok(()),
        })
    }
}

/// Runs `f` on every item, on up to [`SYNC_THREADS`] threads: a fleet's
/// logs are independent files, and their fsyncs wait on the device, not the
/// CPU. Every item is visited even after a failure (but for those of a
/// thread that could not be started, which give that error); the first
/// error (in item order) is returned.
fn in_parallel<T: Send>(
    items: &mut [T],
    f: impl Fn(&mut T) -> Result<(), FleetError> + Sync,
) -> Result<(), FleetError> {
    let first = |results: Vec<Result<(), FleetError>>| results.into_iter().find(Result::is_err);
    if items.len() < 2 {
        return first(items.iter_mut().map(&f).collect()).unwrap_or(Ok(()));
    }
    let per = items.len().div_ceil(SYNC_THREADS);
    let f = &f;
    let results: Vec<Result<(), FleetError>> = std::thread::scope(|s| {
        let handles: Vec<_> = items
            .chunks_mut(per)
            .map(|chunk| {
                // Named, so that a per-thread profile tells them from the
                // writer threads that start them.
                std::thread::Builder::new()
                    .name("kvbm-sync".into())
                    .spawn_scoped(s, move || chunk.iter_mut().map(f).collect::<Vec<_>>())
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| match h {
                Ok(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                Err(e) => vec![Err(FleetError::Thread(e))],
            })
            .collect()
    });
    first(results).unwrap_or(Ok(()))
}

/// Threads [`in_parallel`] uses at most.
const SYNC_THREADS: usize = 8;

/// What `inspect` says of one engine's log.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EngineSummary {
    /// The engine's name.
    pub engine: String,
    /// Its run.
    pub run: String,
    /// Events read from its log (up to any damage).
    pub events: u64,
    /// Events its sidecar says the recorder wrote (`None`: no readable
    /// sidecar); more than `events` after damage, or while recording.
    pub events_written: Option<u64>,
    /// First seq read.
    pub first_seq: Option<u64>,
    /// Last seq read.
    pub last_seq: Option<u64>,
    /// Smallest and largest timestamp read, ns.
    pub time_range_ns: Option<(u64, u64)>,
    /// What is wrong with the log, as `check` says it: damage that stopped
    /// the read, or fewer events than a finished recording wrote.
    pub damage: Option<String>,
    /// Losses.
    pub losses: Losses,
}

/// An engine's losses, by where they are known from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Losses {
    /// Events missing between events written (seq jumps).
    pub holes: u64,
    /// Seqs before the first event written.
    pub before_start: u64,
    /// What the publisher declared it dropped.
    pub declared_by_publisher: u64,
    /// Missing and not declared (0 when every loss is accounted for).
    pub unexplained: u64,
    /// Messages refused as damaged.
    pub refused_messages: u64,
    /// Events skipped because they were written already.
    pub duplicates_skipped: u64,
}

/// Summarises one engine's log and its manifest entry. Every block of the
/// log is read and verified (not decoded into events), so damage anywhere
/// in it, or a log holding fewer events than its finished sidecar says
/// were written (a segment removed), shows here as `check` would say it.
pub fn summarize(path: &Path, entry: &LogEntry) -> Result<EngineSummary, FleetError> {
    let reader = crate::recorder::open_log(path).map_err(|e| FleetError::Log {
        dir: path.to_path_buf(),
        source: e.into(),
    })?;
    let (mut events, mut holes) = (0u64, 0u64);
    let (mut first, mut last): (Option<u64>, Option<u64>) = (None, None);
    let mut time: Option<(u64, u64)> = None;
    let mut damage = None;
    let mut blocks = reader.blocks();
    while let Some(b) = blocks.next_block() {
        let b = match b {
            Ok(b) => b,
            Err(e) => {
                damage = Some(e.to_string());
                break;
            }
        };
        for (seq, ts) in b.view.seqs_and_timestamps() {
            if let Some(l) = last {
                holes += seq.saturating_sub(l + 1);
            }
            first.get_or_insert(seq);
            last = Some(seq);
            events += 1;
            time = Some(time.map_or((ts, ts), |(a, z)| (a.min(ts), z.max(ts))));
        }
    }
    drop(blocks);
    let side = crate::sidecar::load(path);
    let holds = crate::verdict::LogHolds {
        events,
        first_seq: first,
        last_seq: last,
    };
    let verdict = crate::verdict::assess(&side, reader.info(), holds).verdict;
    if let (None, crate::verdict::Verdict::Damaged(why)) = (&damage, verdict) {
        damage = Some(why);
    }
    let rec = side.recording();
    let before = rec
        .filter(|r| r.last_seq == last)
        .map_or(first.unwrap_or(0), |r| r.missed_before_start);
    let missing = holes + before;
    Ok(EngineSummary {
        engine: entry.engine.clone(),
        run: entry.run.clone(),
        events,
        events_written: rec.map(|r| r.events),
        first_seq: first,
        last_seq: last,
        time_range_ns: time,
        damage,
        losses: Losses {
            holes,
            before_start: before,
            declared_by_publisher: entry.declared_dropped,
            unexplained: missing.saturating_sub(entry.declared_dropped),
            refused_messages: entry.refused,
            duplicates_skipped: entry.duplicates,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::testing::gauge as ev;

    fn header(run: u64, events: &[Event], dropped_before: u64) -> BatchHeader {
        BatchHeader {
            run,
            first_seq: events[0].seq,
            last_seq: events.last().unwrap().seq,
            count: events.len() as u32,
            dropped_before,
        }
    }

    fn batch(seqs: std::ops::Range<u64>) -> Vec<Event> {
        seqs.map(ev).collect()
    }

    /// Duplicates are skipped, holes become gaps, a restart of the writer
    /// (without finishing: a kill) resumes from the logs, and a new run of
    /// an engine gets a log of its own.
    #[test]
    fn batches_apply_once_resume_after_a_kill_and_runs_get_their_own_logs() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("fleet");
        let cfg = RecorderConfig::default();
        let mut w = FleetWriter::open(&dir, "nats://x:1", Some("c"), cfg.clone()).unwrap();
        let b1 = batch(0..10);
        assert_eq!(w.apply("a", &header(1, &b1, 0), &b1).unwrap().written, 10);
        let b2 = batch(5..12);
        let r = w.apply("a", &header(1, &b2, 0), &b2).unwrap();
        assert_eq!((r.written, r.duplicates), (2, 5));
        let b3 = batch(15..20);
        let r = w.apply("a", &header(1, &b3, 3), &b3).unwrap();
        assert_eq!((r.written, r.missing), (5, 3));
        let b = batch(0..4);
        w.apply("b", &header(9, &b, 0), &b).unwrap();
        w.checkpoint().unwrap();
        // Written after the checkpoint, then killed: still in the log (the
        // OS has it after the next flush) — here, flushed by a checkpoint
        // of the log alone, as a kill between the two would leave it.
        let b4 = batch(20..25);
        w.apply("a", &header(1, &b4, 3), &b4).unwrap();
        w.checkpoint().unwrap();
        drop(w); // a kill: nothing finished

        let mut w = FleetWriter::open(&dir, "nats://x:1", Some("c"), cfg.clone()).unwrap();
        // The redelivery of everything is all duplicates.
        for b in [&b1, &b2, &b3, &b4] {
            let r = w.apply("a", &header(1, b, 3), b).unwrap();
            assert_eq!(r.written, 0);
        }
        let b5 = batch(25..30);
        assert_eq!(w.apply("a", &header(1, &b5, 3), &b5).unwrap().written, 5);
        // Engine a restarted: run 2, seqs from 0 again.
        let b6 = batch(0..3);
        assert_eq!(w.apply("a", &header(2, &b6, 0), &b6).unwrap().written, 3);
        w.refused(Some("b"), "bad batch");
        w.refused(None, "not a subject");
        let m = w.finish().unwrap();
        assert_eq!(m.logs.keys().collect::<Vec<_>>(), ["a", "a.2", "b"]);
        assert_eq!(m.logs["a"].declared_dropped, 3);
        assert_eq!(m.logs["b"].refused, 1);
        assert_eq!(m.refused_unattributed, 1);

        let m = read_manifest(&dir).unwrap();
        let logs = engine_logs(&dir, &m);
        let a = summarize(&logs[0].1, &logs[0].2).unwrap();
        assert_eq!(a.events, 27);
        assert_eq!((a.first_seq, a.last_seq), (Some(0), Some(29)));
        assert_eq!(a.losses.holes, 3);
        assert_eq!(a.losses.unexplained, 0);
        let read = crate::recorder::read_events(&logs[0].1, |_| {}).unwrap();
        let seqs: Vec<u64> = read.events.iter().map(|e| e.seq).collect();
        let want: Vec<u64> = (0..12).chain(15..30).collect();
        assert_eq!(seqs, want);
        let a2 = summarize(&logs[1].1, &logs[1].2).unwrap();
        assert_eq!(a2.events, 3);
    }

    /// A log that goes without events is closed at the next checkpoint
    /// (its file released, its sidecar written) and reopened where it
    /// was when its engine sends again: nothing written twice, no hole,
    /// its count still in the writer's summary; a log with events stays
    /// open, and without a limit none closes.
    #[test]
    fn idle_logs_close_at_a_checkpoint_and_reopen_where_they_were() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("fleet");
        let mut w = FleetWriter::open(&dir, "nats://x:1", None, RecorderConfig::default()).unwrap();
        // Long beside a stall of this test's thread, which would close a log
        // written just now.
        w.set_close_idle_after(Some(Duration::from_secs(1)));
        let (a1, b1) = (batch(0..10), batch(0..4));
        w.apply("a", &header(1, &a1, 0), &a1).unwrap();
        w.apply("b", &header(1, &b1, 0), &b1).unwrap();
        w.checkpoint().unwrap();
        assert_eq!(w.open_logs().open, 2, "written just now: both stay open");
        std::thread::sleep(Duration::from_millis(1100));
        let a2 = batch(10..20);
        w.apply("a", &header(1, &a2, 0), &a2).unwrap();
        w.checkpoint().unwrap();
        assert_eq!(
            w.open_logs(),
            OpenLogs {
                open: 1,
                closed_idle: 1,
                reopened: 0
            },
            "b went without events"
        );
        let side = crate::recorder::read_sidecar(&dir.join(ENGINES_DIR).join("b")).unwrap();
        assert!(
            matches!(&side.ended, crate::sidecar::Ended::Finished { why } if why.contains("without events")),
            "{:?}",
            side.ended
        );
        // Its engine sends again: a redelivery, then new events.
        let b2 = batch(2..9);
        let r = w.apply("b", &header(1, &b2, 0), &b2).unwrap();
        assert_eq!((r.written, r.duplicates, r.missing), (5, 2, 0));
        assert_eq!(
            w.open_logs(),
            OpenLogs {
                open: 2,
                closed_idle: 1,
                reopened: 1
            }
        );
        std::thread::sleep(Duration::from_millis(1100));
        w.checkpoint().unwrap();
        assert_eq!(w.open_logs().open, 0, "both idle now");
        let events: Vec<_> = w
            .recordings()
            .iter()
            .map(|(n, r)| (n.clone(), r.events))
            .collect();
        assert_eq!(events, [("a".to_string(), 20), ("b".to_string(), 9)]);
        assert_eq!(w.events(), 29);
        // Killed while both are closed, then restarted: a closed log
        // resumes like any other, redeliveries skipped.
        drop(w);
        let mut w = FleetWriter::open(&dir, "nats://x:1", None, RecorderConfig::default()).unwrap();
        let b3 = batch(5..12);
        let r = w.apply("b", &header(1, &b3, 0), &b3).unwrap();
        assert_eq!((r.written, r.duplicates, r.missing), (3, 4, 0));
        w.finish().unwrap();
        for (name, n) in [("a", 20), ("b", 12)] {
            let read =
                crate::recorder::read_events(&dir.join(ENGINES_DIR).join(name), |_| {}).unwrap();
            assert!(read.damage.is_none());
            let seqs: Vec<u64> = read.events.iter().map(|e| e.seq).collect();
            assert!(seqs.iter().copied().eq(0..n), "{name}: {seqs:?}");
        }

        // Without a limit, a log stays open however long it is idle.
        let dir = tmp.path().join("kept");
        let mut w = FleetWriter::open(&dir, "nats://x:1", None, RecorderConfig::default()).unwrap();
        w.set_close_idle_after(None);
        w.apply("a", &header(1, &a1, 0), &a1).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        w.checkpoint().unwrap();
        assert_eq!(w.open_logs().open, 1);
    }

    /// The manifest is handed out when an entry changed (a new log,
    /// duplicates, declared drops, a refusal), not for events alone.
    /// Two writers on one recording would interleave their frames: the
    /// second is refused while the first (or any of its shards) lives.
    #[test]
    fn a_second_writer_on_a_recording_is_refused_while_the_first_lives() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("fleet");
        let cfg = RecorderConfig::default();
        let w = FleetWriter::open(&dir, "nats://x:1", None, cfg.clone()).unwrap();
        let again = || FleetWriter::open(&dir, "nats://x:1", None, cfg.clone());
        let e = again().unwrap_err().to_string();
        assert!(
            e.contains("another recorder is writing this recording"),
            "{e}"
        );
        let (_, mut shards) = w.into_shards(2);
        assert!(again().is_err());
        shards.pop();
        assert!(again().is_err(), "one shard still holds it");
        drop(shards);
        again().unwrap();
    }

    #[test]
    fn the_manifest_is_handed_out_only_when_it_changed() {
        let tmp = tempfile::tempdir().unwrap();
        let mut w = FleetWriter::open(
            &tmp.path().join("fleet"),
            "nats://x:1",
            None,
            RecorderConfig::default(),
        )
        .unwrap();
        assert!(w.manifest_if_changed().is_some(), "the first time");
        assert!(w.manifest_if_changed().is_none());
        let changed = |w: &mut FleetWriter, seqs: std::ops::Range<u64>, dropped: u64| {
            let b = batch(seqs);
            w.apply("a", &header(1, &b, dropped), &b).unwrap();
            w.manifest_if_changed().is_some()
        };
        assert!(changed(&mut w, 0..10, 0), "a new log");
        assert!(!changed(&mut w, 10..20, 0), "events alone");
        assert!(changed(&mut w, 15..25, 0), "duplicates");
        assert!(changed(&mut w, 30..35, 5), "declared drops");
        assert!(!changed(&mut w, 35..40, 5), "the same total again");
        w.refused(Some("a"), "bad");
        assert!(w.manifest_if_changed().is_some(), "a refusal");
        assert!(w.manifest_if_changed().is_none());
    }

    /// A batch's block as a publisher encodes it: its bytes and LZ4 form.
    fn encoded(events: &[Event]) -> (Vec<u8>, Vec<u8>) {
        let mut enc = kvbm_schema::columnar::BlockEncoder::new();
        for e in events {
            assert!(enc.push(e));
        }
        let raw = enc.finish().to_vec();
        let lz4 = lz4_flex::block::compress(&raw);
        (raw, lz4)
    }

    fn apply_encoded(
        w: &mut FleetWriter,
        engine: &str,
        run: u64,
        events: &[Event],
        dropped_before: u64,
    ) -> Applied {
        let (raw, lz4) = encoded(events);
        let block = CheckedBlock::check(&raw[..]).unwrap();
        w.apply_block(
            engine,
            &header(run, events, dropped_before),
            block,
            Some(&lz4),
        )
        .unwrap()
    }

    /// A detached checkpoint leaves one fsync per log written since the
    /// last (none with `Never`); run after more writes, they succeed, and
    /// the logs hold everything.
    #[test]
    fn a_detached_checkpoint_leaves_one_fsync_per_log_written() {
        let tmp = tempfile::tempdir().unwrap();
        let open = |name: &str, fsync| {
            let mut cfg = RecorderConfig::default();
            cfg.log.fsync = fsync;
            FleetWriter::open(&tmp.path().join(name), "nats://x:1", Some("c"), cfg).unwrap()
        };
        let mut w = open("f", FsyncPolicy::OnSync);
        let apply = |w: &mut FleetWriter, engine: &str, seqs| {
            let b = batch(seqs);
            w.apply(engine, &header(1, &b, 0), &b).unwrap();
        };
        apply(&mut w, "a", 0..10);
        apply(&mut w, "b", 0..5);
        let first = w.checkpoint_detached().unwrap();
        assert_eq!(first.len(), 2);
        assert!(w.checkpoint_detached().unwrap().is_empty(), "nothing since");
        apply(&mut w, "a", 10..20);
        let second = w.checkpoint_detached().unwrap();
        assert_eq!(second.len(), 1);
        apply(&mut w, "a", 20..30);
        first.run().unwrap();
        second.run().unwrap();
        let events: Vec<u64> = w.recordings().iter().map(|(_, r)| r.events).collect();
        assert_eq!(events, [30, 5]);
        w.finish().unwrap();

        let mut w = open("g", FsyncPolicy::Never);
        apply(&mut w, "a", 0..10);
        assert!(w.checkpoint_detached().unwrap().is_empty());
    }

    /// Blocks kept as they arrived give the same logs, counts and losses as
    /// events applied one by one: new consecutive batches go in whole, an
    /// overlapping redelivery and a batch with a hole inside fall back to
    /// event by event.
    #[test]
    fn blocks_apply_whole_when_new_and_event_by_event_otherwise() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = RecorderConfig::default();
        let batches: Vec<(&str, Vec<Event>, u64)> = vec![
            ("a", batch(0..10), 0),
            ("a", batch(5..12), 0),
            ("a", batch(15..20), 3),
            ("b", batch(4..9), 4),
            ("a", [ev(20), ev(21), ev(23)].to_vec(), 4),
            ("a", batch(24..30), 4),
        ];
        let mut whole =
            FleetWriter::open(&tmp.path().join("w"), "nats://x:1", None, cfg.clone()).unwrap();
        let mut single = FleetWriter::open(&tmp.path().join("s"), "nats://x:1", None, cfg).unwrap();
        for (engine, events, dropped) in &batches {
            let a = apply_encoded(&mut whole, engine, 1, events, *dropped);
            let b = single
                .apply(engine, &header(1, events, *dropped), events)
                .unwrap();
            assert_eq!(a, b, "{engine} {:?}", events[0].seq);
        }
        assert_eq!(whole.recordings(), single.recordings());
        let (mw, ms) = (whole.finish().unwrap(), single.finish().unwrap());
        assert_eq!(mw.logs, ms.logs);
        for name in ["a", "b"] {
            let read = |d: &str| {
                let path = tmp.path().join(d).join(ENGINES_DIR).join(name);
                crate::recorder::read_events(&path, |_| {}).unwrap().events
            };
            assert_eq!(read("w"), read("s"), "engine {name}");
        }
        let m = read_manifest(&tmp.path().join("w")).unwrap();
        let logs = engine_logs(&tmp.path().join("w"), &m);
        let a = summarize(&logs[0].1, &logs[0].2).unwrap();
        assert_eq!((a.events, a.losses.holes, a.losses.unexplained), (26, 4, 0));
        let b = summarize(&logs[1].1, &logs[1].2).unwrap();
        assert_eq!((b.events, b.losses.before_start), (5, 4));
    }

    #[test]
    fn a_directory_with_something_else_in_it_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("x"), b"1").unwrap();
        let e = FleetWriter::open(tmp.path(), "nats://x:1", None, RecorderConfig::default())
            .unwrap_err();
        assert!(e.to_string().contains("holds no fleet recording"), "{e}");
    }
}
