//! The recorder: drains an engine's lossless tap into the ring buffer and
//! the durable log, with periodic reducer snapshots; and the way back, from
//! a log directory to events.
//!
//! The recorder runs on its own thread and *polls* the tap (take all there
//! is, then sleep briefly): blocking in `recv` would make the engine pay a
//! wake-up system call on nearly every event. Events the tap had to drop
//! arrive as `Gap` markers; they are counted and written to the log's
//! sidecar `recording.json` ([`crate::sidecar`]), so a reader can tell a
//! loss from a gap, with how the recording ended: finished, killed, a
//! full disk, or an engine restart.
//!
//! The first write error ends a recording: it is what the caller is told
//! (naming the file it happened on), and what the sidecar says.

use crate::log::{LogConfig, LogError, LogReader, LogWriter, ReaderOptions};
pub use crate::sidecar::{
    Ended, GapAt, MAX_GAPS, Recording, SIDECAR, Sidecar, SidecarError, read as read_sidecar,
};
use kvbm_events::bus::{TapItem, TapReceiver, TryRecvError};
use kvbm_events::reducer::EngineState;
use kvbm_events::ring::RingBuffer;
use kvbm_events::{Event, RunId};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How the recorder runs.
#[derive(Debug, Clone)]
pub struct RecorderConfig {
    /// The durable log's settings.
    pub log: LogConfig,
    /// Write a reducer snapshot every this many events (0: never).
    pub snapshot_every_events: u64,
    /// Sleep between polls of an empty tap.
    pub idle_poll: Duration,
    /// When set (and the tap has nothing more to give), the recorder ends
    /// as if the tap had closed: for an embedding that stops its engine
    /// while other owners may still hold the engine's bus.
    pub stop: Option<Arc<AtomicBool>>,
    /// While the tap is empty, hand what was appended to the OS (so that it
    /// survives the recorder being killed) once this long has passed since
    /// the last flush. Each flush ends a compressed block of the log, so
    /// flushing on every idle poll would make blocks tiny; the fsync policy
    /// still applies on top of this.
    pub flush_every: Duration,
    /// The engine run recorded (its emitter's `run()`), for the sidecar.
    pub run: Option<RunId>,
    /// What the engine runs as (a JSON object whose `summary` is one line
    /// for a person, with the facts behind it), kept as the sidecar's
    /// [`engine_info`](Recording::engine_info) from its first write on;
    /// `inspect` and the console's replay show the summary.
    pub info: Option<serde_json::Value>,
    /// Told, after each burst of events the recorder put in the ring, how
    /// many the ring has taken in all: how a server reading the ring (the
    /// attach server's `RingSignal`) learns of new events without polling.
    pub on_ring: Option<RingWatcher>,
}

/// A callback for [`RecorderConfig::on_ring`].
#[derive(Clone)]
pub struct RingWatcher(pub Arc<dyn Fn(u64) + Send + Sync>);

impl std::fmt::Debug for RingWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RingWatcher")
    }
}

impl Default for RecorderConfig {
    fn default() -> Self {
        RecorderConfig {
            log: LogConfig {
                schema_version: kvbm_schema::SCHEMA_VERSION,
                ..LogConfig::default()
            },
            snapshot_every_events: 100_000,
            idle_poll: Duration::from_micros(500),
            stop: None,
            flush_every: Duration::from_millis(50),
            run: None,
            info: None,
            on_ring: None,
        }
    }
}

/// Checks a recording's events against the invariants, feeding each loss
/// in at the place it happened (from the sidecar), so a loss at the very
/// end is a tail loss rather than a mismatch.
pub fn check_recording(
    events: &[Event],
    sidecar: Option<&Recording>,
    stream_complete: bool,
) -> crate::analysis::CheckReport {
    check_recording_with(events, sidecar, stream_complete, true)
}

/// [`check_recording`] for a recording whose losses may not be known
/// (`losses_known: false`: no usable sidecar, or one its recorder never
/// finished): holes in the sequence are then reported, not judged.
pub fn check_recording_with(
    events: &[Event],
    sidecar: Option<&Recording>,
    stream_complete: bool,
    losses_known: bool,
) -> crate::analysis::CheckReport {
    use crate::analysis::{CheckOptions, Checker};
    let (gaps, lost) = match sidecar {
        // Positions known: feed them in place.
        Some(r) if r.gaps.iter().map(|g| g.dropped).sum::<u64>() == r.lost => (&r.gaps[..], 0),
        // An older sidecar with only a total.
        Some(r) => (&[][..], r.lost),
        None => (&[][..], 0),
    };
    let mut c = Checker::new(CheckOptions {
        lost,
        stream_complete,
        losses_known,
        ..CheckOptions::default()
    });
    let mut g = gaps.iter().peekable();
    for ev in events {
        while let Some(gap) = g.next_if(|gap| gap.after_seq.is_none_or(|s| s < ev.seq)) {
            c.observe_gap(gap.dropped);
        }
        c.observe(ev);
    }
    for gap in g {
        c.observe_gap(gap.dropped);
    }
    c.finish()
}

/// Why recording or reading failed.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The log failed.
    #[error(transparent)]
    Log(#[from] LogError),
    /// The sidecar could not be written or read.
    #[error("{}: {source}", path.display())]
    Sidecar {
        /// Its path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Writing failed earlier and the recording ended there; this is that
    /// first error, as it was reported then (its sidecar says so too).
    #[error(
        "{first}{}",
        sidecar.as_ref().map_or(String::new(), |s| format!(
            " (and the sidecar saying so could not be written: {s})"
        ))
    )]
    EndedByError {
        /// The first error.
        first: String,
        /// The sidecar could not be written either (a full disk with no
        /// space held for it).
        sidecar: Option<String>,
    },
}

impl From<SidecarError> for RecordError {
    fn from(e: SidecarError) -> Self {
        RecordError::Sidecar {
            path: e.path,
            source: e.source,
        }
    }
}

/// Starts a recorder thread draining `tap` into a new log in `dir` (and
/// into `ring`, if given). It ends when the tap closes (the engine's bus is
/// dropped) and returns what it wrote. The log is created before the
/// thread starts, so a `dir` that cannot hold a new one (it holds a log
/// already, it is a file, it cannot be written) is refused here, before
/// an engine runs and a screen opens with nothing being recorded.
pub fn spawn_recorder(
    mut tap: TapReceiver<Event>,
    dir: PathBuf,
    cfg: RecorderConfig,
    ring: Option<Arc<RingBuffer>>,
) -> Result<std::thread::JoinHandle<Result<Recording, RecordError>>, RecordError> {
    let sink = RecordingSink::create(&dir, &cfg)?;
    std::thread::Builder::new()
        .name("kvbm-recorder".into())
        .spawn(move || record(sink, &mut tap, &cfg, ring.as_deref()))
        .map_err(|source| RecordError::Log(LogError::Io { path: dir, source }))
}

fn record(
    mut sink: RecordingSink,
    tap: &mut TapReceiver<Event>,
    cfg: &RecorderConfig,
    ring: Option<&RingBuffer>,
) -> Result<Recording, RecordError> {
    if let Some(run) = cfg.run {
        sink.set_run(run);
    }
    let mut last_flush = std::time::Instant::now();
    // Events put in the ring since the watcher was last told.
    let mut untold = false;
    let mut stop_seen = false;
    let result: Result<(), RecordError> = loop {
        match tap.try_recv() {
            Ok(TapItem::Event(ev)) => {
                if let Err(e) = sink.append(&ev) {
                    break Err(e);
                }
                if let Some(r) = ring {
                    r.push(ev);
                    untold = true;
                }
            }
            Ok(TapItem::Gap { dropped }) => {
                sink.gap(dropped);
                if let Some(r) = ring {
                    r.record_gap(dropped);
                }
            }
            Err(TryRecvError::Empty) => {
                if let (true, Some(r), Some(w)) = (untold, ring, &cfg.on_ring) {
                    untold = false;
                    (w.0)(r.counters().pushed);
                }
                // Also where an interval fsync falls due while idle.
                if last_flush.elapsed() >= cfg.flush_every {
                    if let Err(e) = sink.flush() {
                        break Err(e);
                    }
                    last_flush = std::time::Instant::now();
                }
                if cfg.stop.as_ref().is_some_and(|s| s.load(Ordering::Acquire)) {
                    // Events emitted before the stop was set may have come
                    // after the `Empty` above (the flush between them takes
                    // time): one more pass takes them, or they would stay in
                    // the tap, neither recorded nor counted as lost.
                    if !stop_seen {
                        stop_seen = true;
                        continue;
                    }
                    // The bus outlives this stop: losses at the end that
                    // no event carried are placed now, or never.
                    if let Some(TapItem::Gap { dropped }) = tap.take_uncarried() {
                        sink.gap(dropped);
                        if let Some(r) = ring {
                            r.record_gap(dropped);
                        }
                    }
                    sink.end_because("stopped by its embedding, the engine's stream drained");
                    break Ok(());
                }
                std::thread::sleep(cfg.idle_poll);
            }
            Err(TryRecvError::Closed) => {
                sink.end_because("the engine's stream ended");
                break Ok(());
            }
        }
    };
    let finished = sink.finish();
    // The first error first: the one that ended the recording.
    result?;
    finished
}

/// A recording being written: the log, periodic reducer snapshots and the
/// sidecar's bookkeeping (counts, losses placed where they happened). Every
/// way of recording (an in-process engine's tap, an attach server, a ZMQ
/// publisher) feeds one of these.
pub struct RecordingSink {
    dir: PathBuf,
    writer: LogWriter,
    state: EngineState,
    rec: Recording,
    since_snapshot: u64,
    snapshot_every: u64,
    /// The first write error: the recording ended there.
    failed: Option<String>,
    /// Why the recording ends, when it ends cleanly.
    why: Option<String>,
}

impl std::fmt::Debug for RecordingSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordingSink")
            .field("dir", &self.dir)
            .field("recording", &self.rec)
            .finish_non_exhaustive()
    }
}

impl RecordingSink {
    /// Creates the log in `dir` (which must not hold one), with a sidecar
    /// that says the recording is under way (what a killed recorder
    /// leaves) and space held for the final one.
    pub fn create(dir: &Path, cfg: &RecorderConfig) -> Result<Self, RecordError> {
        let writer = LogWriter::create(dir, cfg.log.clone())?;
        let sink = RecordingSink {
            dir: dir.to_path_buf(),
            writer,
            state: EngineState::default(),
            rec: Recording {
                engine: u32::try_from(cfg.log.engine_id).unwrap_or(u32::MAX),
                run: cfg.run,
                schema_version: cfg.log.schema_version,
                ended: Ended::Unfinished,
                engine_info: cfg.info.clone(),
                ..Recording::default()
            },
            since_snapshot: 0,
            snapshot_every: cfg.snapshot_every_events,
            failed: None,
            why: None,
        };
        sink.write_under_way()?;
        Ok(sink)
    }

    /// Writes the sidecar that says the recording is under way, and holds
    /// space for the final one if it is not held yet. The under-way
    /// sidecar is not synced: it speaks for a recorder that dies, and the
    /// log it describes is only synced by its own policy.
    fn write_under_way(&self) -> Result<(), RecordError> {
        crate::sidecar::write_checkpoint(&self.dir, &self.rec)?;
        if self.dir.join(crate::sidecar::SIDECAR_TMP).exists() {
            return Ok(());
        }
        // Best effort: without the space held, the final sidecar is written
        // the ordinary way.
        if let Err(e) = crate::sidecar::reserve(&self.dir) {
            tracing::warn!(
                "no space held for the sidecar of {}: {e}",
                self.dir.display()
            );
            let _ = std::fs::remove_file(self.dir.join(crate::sidecar::SIDECAR_TMP));
        }
        Ok(())
    }

    /// Rewrites the under-way sidecar after a change of what it names (the
    /// source, the run), so a killed recorder's sidecar says it.
    fn note_start(&mut self) {
        if self.rec.ended == Ended::Unfinished
            && self.rec.events == 0
            && let Err(e) = self.write_under_way()
        {
            tracing::warn!("{e}");
        }
    }

    /// Keeps the first write error; the recording has ended there.
    fn fail(&mut self, e: &dyn std::fmt::Display) {
        if self.failed.is_none() {
            self.failed = Some(e.to_string());
        }
    }

    /// Runs `op` on the log writer unless an earlier failure ended the
    /// recording (its first error is returned again); a failure here ends
    /// it.
    fn on_writer<T>(
        &mut self,
        op: impl FnOnce(&mut LogWriter) -> Result<T, LogError>,
    ) -> Result<T, RecordError> {
        if let Some(first) = &self.failed {
            return Err(RecordError::EndedByError {
                first: first.clone(),
                sidecar: None,
            });
        }
        op(&mut self.writer).map_err(|e| {
            self.fail(&e);
            e.into()
        })
    }

    /// Writes one event (and, every `snapshot_every_events`, a snapshot).
    /// After a failure nothing more is written: the first error is
    /// returned again.
    pub fn append(&mut self, ev: &Event) -> Result<(), RecordError> {
        self.on_writer(|w| w.append(ev))?;
        let rec = &mut self.rec;
        rec.events += 1;
        rec.engine = ev.engine;
        rec.first_seq.get_or_insert(ev.seq);
        rec.last_seq = Some(ev.seq);
        if self.snapshot_every == 0 {
            // No snapshots (a fleet log): the state is never read.
            return Ok(());
        }
        self.state.apply(ev);
        self.since_snapshot += 1;
        if self.since_snapshot >= self.snapshot_every {
            self.since_snapshot = 0;
            // A snapshot is an index for seeking, derivable from the log: one
            // that fails to serialise or write is skipped, not fatal.
            if let Ok(json) = serde_json::to_vec(&self.state)
                && self.writer.write_snapshot(ev.seq, ev.ts_ns, &json).is_ok()
            {
                self.rec.snapshots += 1;
            }
        }
        Ok(())
    }

    /// Writes a checked block of events as it is
    /// ([`LogWriter::append_block`]), or, when this recording takes
    /// snapshots, event by event, since the snapshots need the events
    /// themselves. Its seqs must follow the last one written;
    /// losses before it are the caller's to record ([`gap`](Self::gap)).
    pub fn append_block(
        &mut self,
        block: kvbm_schema::columnar::CheckedBlock<'_>,
        lz4: Option<&[u8]>,
    ) -> Result<(), RecordError> {
        if self.snapshot_every != 0 {
            let mut events = Vec::with_capacity(block.len());
            block
                .view()
                .and_then(|v| v.decode_into(&mut events))
                .map_err(|e| RecordError::Log(e.into()))?;
            return events.iter().try_for_each(|ev| self.append(ev));
        }
        let span = self.on_writer(|w| w.append_block(block, lz4))?;
        let rec = &mut self.rec;
        rec.events += block.len() as u64;
        rec.engine = block.last_engine();
        rec.first_seq.get_or_insert(span.first_seq);
        rec.last_seq = Some(span.last_seq);
        Ok(())
    }

    /// `dropped` events were lost here (after the last event written).
    /// Past [`MAX_GAPS`] positions, a loss is merged into the last one, so
    /// the total stays exact.
    pub fn gap(&mut self, dropped: u64) {
        let rec = &mut self.rec;
        rec.lost += dropped;
        let full = rec.gaps.len() >= MAX_GAPS;
        match rec.gaps.last_mut() {
            Some(last) if full => last.dropped += dropped,
            _ => rec.gaps.push(GapAt {
                after_seq: rec.last_seq,
                dropped,
            }),
        }
    }

    /// The source no longer held `n` events from before the first one
    /// written: not a loss inside the recording.
    pub fn missed_before_start(&mut self, n: u64) {
        self.rec.missed_before_start += n;
    }

    /// Names the recording's remote source; its stream goes on after the
    /// recording ends.
    pub fn set_source(&mut self, source: impl Into<String>) {
        self.rec.source = Some(source.into());
        self.rec.stream_complete = Some(false);
        self.note_start();
    }

    /// Names the engine run whose events this recording holds.
    pub fn set_run(&mut self, run: RunId) {
        self.rec.run = Some(run);
        self.note_start();
    }

    /// Names the recording of the engine's previous run (this one began
    /// because the engine restarted).
    pub fn set_previous(&mut self, previous: &Path) {
        self.rec.previous = Some(previous.to_path_buf());
        self.note_start();
    }

    /// Says what the engine runs as ([`RecorderConfig::info`]), for a
    /// source that tells it after the recording began (an attach
    /// server's `/health`). Before the first event it is written at once,
    /// as the source is.
    pub fn set_engine_info(&mut self, info: serde_json::Value) {
        self.rec.engine_info = Some(info);
        self.note_start();
    }

    /// Says why the recording ends, for the sidecar of a clean finish
    /// (`--duration-s` reached, interrupted, the stream ended).
    pub fn end_because(&mut self, why: impl Into<String>) {
        self.why = Some(why.into());
    }

    /// Keeps the source client's counters in the sidecar.
    pub fn set_client_counters(&mut self, counters: serde_json::Value) {
        self.rec.client = Some(counters);
    }

    /// Hands what was appended to the OS (and fsyncs as the policy says).
    pub fn flush(&mut self) -> Result<(), RecordError> {
        self.on_writer(LogWriter::flush)
    }

    /// Hands what was appended to the OS and fsyncs it, whatever the
    /// policy: everything written so far is on stable storage.
    pub fn sync(&mut self) -> Result<(), RecordError> {
        self.on_writer(LogWriter::sync)
    }

    /// Hands what was appended to the OS and returns the fsync that makes
    /// it durable, to run elsewhere ([`LogWriter::detach_sync`]).
    pub fn detach_sync(&mut self) -> Result<Option<crate::log::PendingSync>, RecordError> {
        self.on_writer(LogWriter::detach_sync)
    }

    /// What has been recorded so far.
    pub fn recording(&self) -> &Recording {
        &self.rec
    }

    /// Reopens the recording in `dir` to append to it, after a clean stop
    /// or a crash: the log's torn tail is cut, and the bookkeeping is the
    /// sidecar's when it agrees with the log (same last seq), else rebuilt
    /// from the log itself — counts, seq range, and a gap at every jump in
    /// the seqs (a loss the log cannot explain further). The log is read
    /// whole only then, or to fold the state snapshots need. A log that
    /// does not exist yet is created.
    pub fn resume(dir: &Path, cfg: &RecorderConfig) -> Result<Self, RecordError> {
        let writer = LogWriter::open_append(dir, cfg.log.clone())?;
        let mut state = EngineState::default();
        let side = read_sidecar(dir);
        let mut rec = Recording {
            engine: u32::try_from(cfg.log.engine_id).unwrap_or(u32::MAX),
            run: cfg.run,
            schema_version: cfg.log.schema_version,
            ..Recording::default()
        };
        let fold = cfg.snapshot_every_events > 0;
        // A sidecar that ends where the log ends holds what a read of the
        // whole log would count (and more: the losses the log cannot
        // explain). Then only a state to fold for snapshots needs the read,
        // which costs as much as the log is long: a fleet recorder
        // reopening a long log of an engine that went quiet does not.
        let side_agrees = side
            .as_ref()
            .is_some_and(|s| s.last_seq.is_some() && s.last_seq == writer.last_seq());
        if writer.last_seq().is_some() && (fold || !side_agrees) {
            // Damage stops the read; the writer refused a log it could not
            // append to, so what is read here is what it continues.
            let reader = LogReader::open(dir, ReaderOptions::default())?;
            for r in reader.iter() {
                let Ok(r) = r else { break };
                let ev = r.event;
                if let Some(last) = rec.last_seq
                    && ev.seq > last + 1
                {
                    rec.gaps.push(GapAt {
                        after_seq: Some(last),
                        dropped: ev.seq - last - 1,
                    });
                    rec.lost += ev.seq - last - 1;
                }
                rec.events += 1;
                rec.engine = ev.engine;
                rec.first_seq.get_or_insert(ev.seq);
                rec.last_seq = Some(ev.seq);
                if fold {
                    state.apply(&ev);
                }
            }
            rec.gaps.truncate(MAX_GAPS);
        }
        // What the engine says it runs as now, else what the sidecar said
        // (even one whose counts are not taken).
        let engine_info = cfg
            .info
            .clone()
            .or_else(|| side.as_ref().and_then(|s| s.engine_info.clone()));
        if let Some(s) = side
            && (s.last_seq == rec.last_seq || (side_agrees && !fold))
        {
            rec = s;
        }
        // Under way again: a recorder killed from here on leaves a
        // sidecar that says so.
        rec.ended = Ended::Unfinished;
        rec.engine_info = engine_info;
        let sink = RecordingSink {
            dir: dir.to_path_buf(),
            writer,
            state,
            rec,
            since_snapshot: 0,
            snapshot_every: cfg.snapshot_every_events,
            failed: None,
            why: None,
        };
        sink.write_under_way()?;
        Ok(sink)
    }

    /// Hands what was appended to the OS and writes the sidecar as it
    /// stands, so a recording killed after this keeps its bookkeeping.
    pub fn checkpoint(&mut self) -> Result<(), RecordError> {
        self.flush()?;
        crate::sidecar::write_checkpoint(&self.dir, &self.rec)?;
        Ok(())
    }

    /// Closes the log and writes the sidecar saying how the recording
    /// ended; returns what was recorded. If writing failed (now or
    /// earlier), the error returned is the *first* one, the one that
    /// ended the recording, and the sidecar says so.
    pub fn finish(self) -> Result<Recording, RecordError> {
        self.finish_as(None)
    }

    /// Ends this recording because the engine restarted: it holds the old
    /// run whole, and says that the new run `run` is recorded in `next`.
    pub fn finish_new_run(mut self, run: RunId, next: &Path) -> Result<Recording, RecordError> {
        self.rec.next = Some(next.to_path_buf());
        self.finish_as(Some(Ended::NewRun { run }))
    }

    fn finish_as(mut self, ending: Option<Ended>) -> Result<Recording, RecordError> {
        let closed = self.writer.close();
        if let Err(e) = &closed
            && self.failed.is_none()
        {
            self.failed = Some(e.to_string());
        }
        self.rec.ended = match (&self.failed, ending) {
            (Some(error), _) => Ended::WriteFailed {
                error: error.clone(),
            },
            (None, Some(e)) => e,
            (None, None) => Ended::Finished {
                why: self
                    .why
                    .take()
                    .unwrap_or_else(|| "the recording was closed".into()),
            },
        };
        let side = crate::sidecar::write(&self.dir, &self.rec);
        if let Some(first) = self.failed.take() {
            return Err(RecordError::EndedByError {
                first,
                sidecar: side.err().map(|e| e.to_string()),
            });
        }
        side?;
        Ok(self.rec)
    }
}

/// Events read back from a log: every good one, then the first damage (if
/// any) that stopped the read.
#[derive(Debug, Default)]
pub struct EventsRead {
    /// The events, in log order.
    pub events: Vec<Event>,
    /// What stopped the read early, with its segment and offset.
    pub damage: Option<RecordError>,
}

/// Opens a log for reading (every block is verified as it is read).
pub fn open_log(dir: &Path) -> Result<LogReader, LogError> {
    LogReader::open(dir, ReaderOptions::default())
}

/// Reads every event of the log in `dir`; `on_progress(events)` is called
/// now and then for long reads.
pub fn read_events(dir: &Path, on_progress: impl FnMut(u64)) -> Result<EventsRead, LogError> {
    Ok(read_all(&open_log(dir)?, on_progress))
}

/// Reads every event of a log already open (whose [`LogInfo`] the caller
/// wanted first: a progress total, the index for a verdict), as
/// [`read_events`] does.
///
/// [`LogInfo`]: crate::log::LogInfo
pub fn read_all(reader: &LogReader, mut on_progress: impl FnMut(u64)) -> EventsRead {
    let mut out = EventsRead::default();
    for r in reader.iter() {
        match r {
            Ok(rec) => {
                out.events.push(rec.event);
                if out.events.len() % 65_536 == 0 {
                    on_progress(out.events.len() as u64);
                }
            }
            Err(e) => {
                out.damage = Some(e.into());
                break;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::bus::BusConfig;
    use kvbm_events::tier::Tier;
    use kvbm_events::{Emitter, EventKind, VirtualClock};

    fn gauge() -> EventKind {
        EventKind::PoolGauge {
            tier: Tier::Host,
            capacity: 1,
            active: 0,
            inactive: 0,
            empty: 1,
        }
    }

    /// A gauge event with `seq`, stamped `seq`.
    fn gauge_at(seq: u64) -> Event {
        Event {
            engine: 0,
            seq,
            ts_ns: seq,
            iteration: 0,
            request: None,
            kind: gauge(),
        }
    }

    /// The stop flag ends a recording while the engine's bus is still held,
    /// after everything already emitted is written.
    #[test]
    fn a_stop_flag_ends_the_recording_with_the_bus_alive() {
        let dir = tempfile::tempdir().unwrap();
        let e = Emitter::new(
            0,
            BusConfig::default(),
            std::sync::Arc::new(VirtualClock::new()),
        )
        .unwrap();
        let tap = e.bus().take_tap().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let cfg = RecorderConfig {
            stop: Some(stop.clone()),
            ..RecorderConfig::default()
        };
        let h = spawn_recorder(tap, dir.path().join("log"), cfg, None).unwrap();
        for _ in 0..100 {
            e.emit(None, gauge());
        }
        stop.store(true, Ordering::Release);
        let rec = h.join().unwrap().unwrap();
        assert_eq!(rec.events, 100);
        assert_eq!(
            read_events(&dir.path().join("log"), |_| {})
                .unwrap()
                .events
                .len(),
            100
        );
        drop(e);
    }

    /// A recorder that fills a ring tells its watcher how many events the
    /// ring holds after each burst, so a server reading the ring need not
    /// poll it; the last it tells is everything.
    #[test]
    fn the_ring_watcher_is_told_after_each_burst() {
        let dir = tempfile::tempdir().unwrap();
        let e = Emitter::new(
            0,
            BusConfig::default(),
            std::sync::Arc::new(VirtualClock::new()),
        )
        .unwrap();
        let tap = e.bus().take_tap().unwrap();
        let told = Arc::new(std::sync::Mutex::new(Vec::new()));
        let t2 = told.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let cfg = RecorderConfig {
            stop: Some(stop.clone()),
            on_ring: Some(RingWatcher(Arc::new(move |n| t2.lock().unwrap().push(n)))),
            ..RecorderConfig::default()
        };
        let ring = Arc::new(RingBuffer::with_capacity(1024).unwrap());
        let h = spawn_recorder(tap, dir.path().join("log"), cfg, Some(ring.clone())).unwrap();
        for _ in 0..50 {
            e.emit(None, gauge());
        }
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..50 {
            e.emit(None, gauge());
        }
        stop.store(true, Ordering::Release);
        h.join().unwrap().unwrap();
        let told = told.lock().unwrap();
        assert!(!told.is_empty());
        assert!(told.windows(2).all(|w| w[0] < w[1]), "{told:?}");
        assert_eq!(*told.last().unwrap(), 100);
    }

    /// An emitter whose tap holds 4 events, and that tap.
    fn four_slot_tap() -> (Emitter, TapReceiver<Event>) {
        let e = Emitter::new(
            0,
            BusConfig {
                tap_capacity: 4,
                ..BusConfig::default()
            },
            std::sync::Arc::new(VirtualClock::new()),
        )
        .unwrap();
        let tap = e.bus().take_tap().unwrap();
        (e, tap)
    }

    /// The stop flag with losses at the end that no event carried (the
    /// connector's recording stops while its engine's bus lives): they are
    /// placed at the end, so the recording does not claim to be whole.
    /// Before, they were never seen: `check` passed a log that had lost 6.
    #[test]
    fn a_stop_flag_places_the_losses_no_event_carried() {
        let dir = tempfile::tempdir().unwrap();
        let (e, tap) = four_slot_tap();
        for _ in 0..10 {
            e.emit(None, gauge()); // 4 fit, the last 6 are dropped
        }
        let stop = Arc::new(AtomicBool::new(true));
        let cfg = RecorderConfig {
            stop: Some(stop),
            ..RecorderConfig::default()
        };
        let rec = spawn_recorder(tap, dir.path().join("log"), cfg, None)
            .unwrap()
            .join()
            .unwrap()
            .unwrap();
        assert_eq!((rec.events, rec.lost), (4, 6), "{rec:?}");
        assert_eq!(
            rec.gaps,
            vec![GapAt {
                after_seq: Some(3),
                dropped: 6
            }]
        );
        drop(e);
    }

    /// A tap too small for a burst: the losses are counted, placed, and the
    /// checker accounts for them, in the middle of the stream and at its end.
    #[test]
    fn losses_are_recorded_where_they_happened_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let (e, tap) = four_slot_tap();
        for _ in 0..50 {
            e.emit(None, gauge()); // 4 fit, 46 are dropped
        }
        let h =
            spawn_recorder(tap, dir.path().join("log"), RecorderConfig::default(), None).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..3 {
            e.emit(None, gauge()); // the gap marker goes before these
        }
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..20 {
            e.emit(None, gauge()); // a few fit, the rest are lost at the end
        }
        drop(e);
        let rec = h.join().unwrap().unwrap();
        assert!(rec.lost >= 46, "{rec:?}");
        assert_eq!(rec.gaps.iter().map(|g| g.dropped).sum::<u64>(), rec.lost);
        assert_eq!(
            rec.gaps[0],
            GapAt {
                after_seq: Some(3),
                dropped: 46
            }
        );
        let side = read_sidecar(&dir.path().join("log")).unwrap();
        assert_eq!(side, rec);
        let read = read_events(&dir.path().join("log"), |_| {}).unwrap();
        assert!(read.damage.is_none());
        let report = check_recording(&read.events, Some(&side), true);
        assert!(report.is_ok(), "{report}");
        // With only the total, a loss at the tail could not be told from a
        // missing hole; the placed positions are what make it pass.
        let total_only = Recording {
            gaps: Vec::new(),
            ..side.clone()
        };
        let tail_lost = rec.lost - 46;
        if tail_lost > 0 {
            assert!(!check_recording(&read.events, Some(&total_only), true).is_ok());
        }
    }

    /// Past `MAX_GAPS` positions a sink merges losses into the last one:
    /// nothing is dropped, the total stays exact.
    #[test]
    fn a_full_gap_list_merges_rather_than_drops() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink =
            RecordingSink::create(&dir.path().join("log"), &RecorderConfig::default()).unwrap();
        sink.append(&gauge_at(0)).unwrap();
        for _ in 0..MAX_GAPS + 10 {
            sink.gap(2);
        }
        sink.append(&gauge_at(1)).unwrap();
        sink.gap(5);
        let rec = sink.finish().unwrap();
        assert_eq!(rec.gaps.len(), MAX_GAPS);
        assert_eq!(rec.lost, 2 * (MAX_GAPS as u64 + 10) + 5);
        assert_eq!(rec.gaps.iter().map(|g| g.dropped).sum::<u64>(), rec.lost);
        assert_eq!(
            rec.gaps.last(),
            Some(&GapAt {
                after_seq: Some(0),
                dropped: 2 * 11 + 5
            })
        );
        assert_eq!(read_sidecar(&dir.path().join("log")), Some(rec));
    }

    /// The engine's description is in the sidecar from its first write
    /// (a recorder killed before any event leaves it), stays through a
    /// reopening that does not name one, and a reopening that names one
    /// takes the new one.
    #[test]
    fn engine_info_is_in_the_sidecar_from_the_first_write() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("log");
        let info = serde_json::json!({"summary": "vLLM · tp 2", "tensor_parallel": 2});
        let cfg = RecorderConfig {
            info: Some(info.clone()),
            ..RecorderConfig::default()
        };
        let mut sink = RecordingSink::create(&dir, &cfg).unwrap();
        let side = read_sidecar(&dir).unwrap();
        assert_eq!((side.ended, side.events), (Ended::Unfinished, 0));
        assert_eq!(side.engine_info.as_ref(), Some(&info));
        sink.append(&gauge_at(0)).unwrap();
        sink.checkpoint().unwrap();
        // Killed: the sink is never finished.
        drop(sink);
        assert_eq!(
            read_sidecar(&dir).unwrap().engine_info.as_ref(),
            Some(&info)
        );

        let sink = RecordingSink::resume(&dir, &RecorderConfig::default()).unwrap();
        assert_eq!(sink.recording().engine_info.as_ref(), Some(&info));
        let rec = sink.finish().unwrap();
        assert_eq!(rec.engine_summary().as_deref(), Some("vLLM · tp 2"));
        assert_eq!(read_sidecar(&dir), Some(rec));

        let now = serde_json::json!({"summary": "vLLM · tp 4"});
        let cfg4 = RecorderConfig {
            info: Some(now.clone()),
            ..RecorderConfig::default()
        };
        let rec = RecordingSink::resume(&dir, &cfg4)
            .unwrap()
            .finish()
            .unwrap();
        assert_eq!(rec.engine_info, Some(now));
        assert_eq!(read_sidecar(&dir).unwrap().events, 1);

        // Told after the start (a remote source): written at once.
        let later = tmp.path().join("later");
        let mut sink = RecordingSink::create(&later, &RecorderConfig::default()).unwrap();
        assert_eq!(read_sidecar(&later).unwrap().engine_info, None);
        sink.set_engine_info(info.clone());
        assert_eq!(read_sidecar(&later).unwrap().engine_info, Some(info));
    }

    /// Reopening a recording whose sidecar ends where its log ends takes
    /// the sidecar's bookkeeping without reading the log (a fleet recorder
    /// reopens long logs of engines that went quiet); without a sidecar,
    /// or to fold the state for snapshots, the log is read. Damage in an
    /// earlier segment tells the two apart: a read stops there.
    #[test]
    fn a_sidecar_that_ends_where_the_log_ends_spares_reading_the_log() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("log");
        let cfg = RecorderConfig {
            log: LogConfig {
                segment_bytes: 4096,
                block_bytes: 1024,
                ..RecorderConfig::default().log
            },
            snapshot_every_events: 0,
            ..RecorderConfig::default()
        };
        let mut sink = RecordingSink::create(&dir, &cfg).unwrap();
        for seq in 0..3000 {
            sink.append(&gauge_at(seq)).unwrap();
        }
        sink.finish().unwrap();
        let mut segments: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().ends_with(".kvlog"))
            .collect();
        segments.sort();
        assert!(segments.len() > 2, "{segments:?}");
        let mut bytes = std::fs::read(&segments[0]).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&segments[0], bytes).unwrap();

        let sink = RecordingSink::resume(&dir, &cfg).unwrap();
        assert_eq!(sink.recording().events, 3000);
        assert_eq!(sink.recording().last_seq, Some(2999));
        sink.finish().unwrap();
        // To fold a state for snapshots, the log is read: it stops at the
        // damage.
        let folding = RecorderConfig {
            snapshot_every_events: 100,
            ..cfg.clone()
        };
        let sink = RecordingSink::resume(&dir, &folding).unwrap();
        assert!(sink.recording().events < 3000, "{:?}", sink.recording());
        drop(sink);
        std::fs::remove_file(dir.join(SIDECAR)).unwrap();
        let sink = RecordingSink::resume(&dir, &cfg).unwrap();
        assert!(sink.recording().events < 3000, "{:?}", sink.recording());
    }
}
