//! The appending side of the log: gathering records into blocks,
//! compressing and framing them, rotation, fsync policy, index sidecars,
//! snapshots, and crash recovery on open.
//!
//! One writer per directory. Nothing enforces that (an advisory lock would
//! outlive a SIGKILL'd holder on some platforms and need more than `std`);
//! the recorder owns its directory.

use std::fs::{self, File, OpenOptions};
use std::io::{BufReader, BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use kvbm_events::Event;
use lz4_flex::block::CompressTable;

use super::block::{self, BlockBuilder};
use super::format::{
    Codec, FRAME_HEADER_LEN, MAX_BLOCK_BYTES, MAX_RECORD_BYTES, SEGMENT_HEADER_LEN, SegmentHeader,
    index_file_name, segment_file_name,
};
use super::index::{self, IndexBuilder};
use super::scan::{ScanParams, SegmentEnd, scan_segment};
use super::{
    FsyncPolicy, LogConfig, LogError, LogReader, LogStats, ReaderOptions, RecoveryReport, TornTail,
    buffer_for, io_err, list_segments, snapshot, sync_dir,
};
use kvbm_schema::columnar::{self, BlockSpan, CheckedBlock};

/// The segment being appended to.
#[derive(Debug)]
struct Active {
    header: SegmentHeader,
    name: String,
    path: PathBuf,
    out: BufWriter<File>,
    /// Bytes in the segment, counting what is still buffered.
    len: u64,
    index: IndexBuilder,
}

/// Appends records to a log directory. See the module docs for the format
/// and the durability each [`FsyncPolicy`] gives.
pub struct LogWriter {
    dir: PathBuf,
    cfg: LogConfig,
    active: Option<Active>,
    /// Records appended since the last block was sealed.
    block: BlockBuilder,
    /// The compressed body of the block being sealed (kept for its buffer).
    compressed: Vec<u8>,
    table: CompressTable,
    last_seq: Option<u64>,
    flushed_seq: Option<u64>,
    durable_seq: Option<u64>,
    /// Records were written since the last fsync.
    unsynced: bool,
    last_sync: Instant,
    stats: LogStats,
    recovery: RecoveryReport,
    /// A segment was created since the last fsync and its directory entry
    /// is not durable yet ([`FsyncPolicy::OnSync`]).
    dir_unsynced: bool,
    /// Set by the first failed write: the file may hold part of a frame, so
    /// nothing more is appended until the log is reopened and recovered.
    poisoned: Option<String>,
    closed: bool,
}

impl LogWriter {
    /// Starts a new log in `dir` (created if needed). Fails with
    /// [`LogError::AlreadyExists`] if `dir` already holds a segment. No file
    /// is written until the first `append`, since a segment is named by the
    /// sequence number of its first record.
    pub fn create(dir: impl AsRef<Path>, cfg: LogConfig) -> Result<Self, LogError> {
        cfg.validate()?;
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        if let Some((_, name)) = list_segments(&dir)?.into_iter().next() {
            return Err(LogError::AlreadyExists { dir, segment: name });
        }
        Ok(Self::new(dir, cfg, RecoveryReport::default()))
    }

    /// Opens an existing log for appending (or starts one, like `create`, if
    /// `dir` holds no segment yet), after recovering it:
    ///
    /// - a torn tail at the end of the last segment is truncated;
    /// - a last segment left with a torn header or no record at all is
    ///   removed, and the segment before it becomes the last;
    /// - corruption in the last segment refuses the open with
    ///   [`LogError::Corrupt`]: appending after it would put new records
    ///   where no reader reaches them. That includes a block whose frame is
    ///   sound but whose contents fail verification: every block of the
    ///   last segment is decompressed and verified (not decoded) first;
    /// - a last segment written with another schema version or engine id
    ///   refuses the open with [`LogError::ConfigMismatch`];
    /// - missing or unusable index files of earlier segments are rebuilt;
    ///   their records are not otherwise checked (a reader does that).
    ///
    /// After a SIGKILL at any moment, everything the killed writer handed to
    /// the OS (every record up to its last `flush` or `sync`, and with
    /// [`FsyncPolicy::EveryRecord`] every appended record) is kept, and
    /// whatever part of a frame followed is cut off.
    pub fn open_append(dir: impl AsRef<Path>, cfg: LogConfig) -> Result<Self, LogError> {
        cfg.validate()?;
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        remove_temp_files(&dir)?;
        let mut report = RecoveryReport::default();
        let sync = cfg.fsync != FsyncPolicy::Never;
        let mut fsyncs = 0;
        let active = loop {
            let segments = list_segments(&dir)?;
            let Some((name_seq, name)) = segments.last().cloned() else {
                break None;
            };
            let prev_seq = None; // only the last segment is scanned here
            let path = dir.join(&name);
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(io_err(&path))?;
            let file_len = file.metadata().map_err(io_err(&path))?.len();
            let mut r = BufReader::with_capacity(buffer_for(256 << 10, file_len), file);
            let scan = scan_segment(
                &mut r,
                file_len,
                ScanParams {
                    name_seq,
                    prev_seq,
                    last_segment: true,
                    index_every_records: cfg.index_every_records,
                    index_every_bytes: cfg.index_every_bytes,
                },
            )
            .map_err(io_err(&path))?;
            let mut file = r.into_inner();
            match scan.end {
                SegmentEnd::Clean => {}
                SegmentEnd::Torn { offset, bytes } => {
                    report.truncated = Some(TornTail {
                        segment: name.clone(),
                        offset,
                        bytes,
                    });
                }
                SegmentEnd::Corrupt { offset, reason } => {
                    return Err(LogError::Corrupt {
                        segment: name,
                        offset,
                        reason,
                    });
                }
                SegmentEnd::Unsupported { version } => {
                    return Err(LogError::UnsupportedVersion {
                        segment: name,
                        found: version,
                    });
                }
            }
            let header = match scan.header {
                Some(h) if scan.index.index().records > 0 => h,
                _ => {
                    // Nothing usable: a crash while creating the segment.
                    remove_if_exists(&dir.join(index_file_name(name_seq)))?;
                    fs::remove_file(&path).map_err(io_err(&path))?;
                    if sync {
                        sync_dir(&dir).map_err(io_err(&dir))?;
                    }
                    tracing::warn!(segment = %name, "removed a log segment that holds no record");
                    if report.truncated.as_ref().is_some_and(|t| t.segment == name) {
                        report.truncated = None;
                    }
                    report.removed_segments.push(name);
                    continue;
                }
            };
            // Before changing anything.
            check_matches(&name, &header, &cfg)?;
            // The scan checked every frame's checksum, so each block holds
            // the bytes its writer wrote. A segment whose stored index
            // matches it was closed cleanly by a writer of this format,
            // which built those blocks; decoding and checking them all
            // again (most of a reopening's time: a fleet recorder reopens
            // the logs of engines that went quiet) is for the others.
            let clean = matches!(scan.end, SegmentEnd::Clean)
                && stored_index_matches(&dir, &header, scan.index.index(), &mut file)?;
            if !clean {
                verify_last_segment(&dir)?;
                report.last_segment_decoded = true;
            }
            // A stale index would describe the segment before new appends;
            // it is rewritten when the segment is sealed.
            remove_if_exists(&dir.join(index_file_name(name_seq)))?;
            let valid_len = scan.index.index().valid_len;
            if valid_len < file_len {
                tracing::warn!(
                    segment = %name,
                    offset = valid_len,
                    bytes = file_len - valid_len,
                    "truncating a torn tail"
                );
                file.set_len(valid_len).map_err(io_err(&path))?;
            }
            if sync {
                // What the previous writer left may still be only in the
                // page cache; make it (and any truncation) durable before
                // calling it so.
                file.sync_all().map_err(io_err(&path))?;
                fsyncs += 1;
            }
            file.seek(SeekFrom::Start(valid_len))
                .map_err(io_err(&path))?;
            break Some(Active {
                header,
                name,
                path,
                out: BufWriter::with_capacity(cfg.write_buffer_bytes, file),
                len: valid_len,
                index: scan.index,
            });
        };
        let last_seq = active
            .as_ref()
            .and_then(|a| a.index.index().last.map(|l| l.seq));
        rebuild_sealed_indexes(
            &dir,
            &cfg,
            active.as_ref().map(|a| a.header.first_seq),
            &mut report,
        )?;
        let mut w = Self::new(dir, cfg, report);
        w.active = active;
        w.last_seq = last_seq;
        w.flushed_seq = last_seq;
        w.durable_seq = if sync { last_seq } else { None };
        w.stats.fsyncs = fsyncs;
        Ok(w)
    }

    fn new(dir: PathBuf, cfg: LogConfig, recovery: RecoveryReport) -> Self {
        Self {
            dir,
            cfg,
            active: None,
            block: BlockBuilder::default(),
            compressed: Vec::new(),
            table: CompressTable::small(),
            last_seq: None,
            flushed_seq: None,
            durable_seq: None,
            unsynced: false,
            dir_unsynced: false,
            last_sync: Instant::now(),
            stats: LogStats::default(),
            recovery,
            poisoned: None,
            closed: false,
        }
    }

    /// Appends one event. Its `seq` must be greater than every sequence
    /// number already in the log ([`LogError::NonIncreasingSeq`] otherwise,
    /// and nothing is written); `ts_ns` is stored as given. Its encoded size
    /// ([`columnar::event_bytes`]) is at most [`MAX_RECORD_BYTES`]. With
    /// [`FsyncPolicy::EveryRecord`] the event is on stable storage when this
    /// returns; otherwise it may sit in the open block (in memory) or the
    /// write buffer until the next `flush`, `sync`, full block or full
    /// buffer.
    pub fn append(&mut self, ev: &Event) -> Result<(), LogError> {
        self.usable()?;
        let seq = ev.seq;
        if let Some(last) = self.last_seq
            && seq <= last
        {
            return Err(LogError::NonIncreasingSeq { seq, last });
        }
        let size = columnar::event_bytes(ev);
        if size > MAX_RECORD_BYTES as usize {
            return Err(LogError::RecordTooLarge {
                len: size,
                max: MAX_RECORD_BYTES as usize,
            });
        }
        if !self.block.try_push(ev, size, self.cfg.block_bytes as usize) {
            self.seal_block_or_poison()?;
            // An empty block takes any event.
            self.block.try_push(ev, size, usize::MAX);
        }
        self.appended(1, seq)
    }

    /// Appends a whole block as it is, as one frame: for a block that
    /// arrives already encoded (a fleet recorder's batches), so its events
    /// are neither decoded nor encoded again. The events appended one by
    /// one before it are sealed into a block of their own first.
    ///
    /// The block was checked whole ([`CheckedBlock`]: what a reader
    /// refuses, it refuses); the writer checks only that its seqs follow
    /// the log's. `lz4`, when given, is the block's bytes compressed as
    /// one LZ4 block (what it was decompressed from); it is stored as it
    /// is when it is smaller. Returns the block's span.
    pub fn append_block(
        &mut self,
        block: CheckedBlock<'_>,
        lz4: Option<&[u8]>,
    ) -> Result<BlockSpan, LogError> {
        self.usable()?;
        let span = block.span();
        if let Some(last) = self.last_seq
            && span.first_seq <= last
        {
            return Err(LogError::NonIncreasingSeq {
                seq: span.first_seq,
                last,
            });
        }
        let raw = block.bytes();
        if raw.len() > MAX_BLOCK_BYTES as usize {
            return Err(LogError::RecordTooLarge {
                len: raw.len(),
                max: MAX_BLOCK_BYTES as usize,
            });
        }
        self.seal_block_or_poison()?;
        let (codec, body) = match lz4 {
            Some(c) if c.len() < raw.len() => (Codec::Lz4, c),
            _ => (Codec::Stored, raw),
        };
        let header = super::format::FrameHeader {
            len: 0,
            crc: 0,
            first_seq: span.first_seq,
            last_seq: span.last_seq,
            min_ts: span.min_ts,
            max_ts: span.max_ts,
            // Both bounded above: MAX_BLOCK_BYTES and MAX_BLOCK_EVENTS.
            raw_len: raw.len() as u32,
            count: block.len() as u16,
            codec: codec as u8,
        };
        if let Err(e) = self.write_frame(&header, body) {
            self.poisoned = Some(e.to_string());
            return Err(e);
        }
        self.appended(block.len() as u64, span.last_seq)?;
        Ok(span)
    }

    /// Bookkeeping after `records` were appended, the last with `last_seq`;
    /// fsyncs when the policy says it is time.
    fn appended(&mut self, records: u64, last_seq: u64) -> Result<(), LogError> {
        self.stats.records += records;
        self.last_seq = Some(last_seq);
        self.unsynced = true;
        let due = match self.cfg.fsync {
            FsyncPolicy::EveryRecord => true,
            FsyncPolicy::Interval(d) => self.last_sync.elapsed() >= d,
            FsyncPolicy::Never | FsyncPolicy::OnSync => false,
        };
        if due {
            self.sync_inner()?;
        }
        Ok(())
    }

    fn seal_block_or_poison(&mut self) -> Result<(), LogError> {
        let result = self.seal_block();
        if let Err(e) = &result {
            self.poisoned = Some(e.to_string());
        }
        result
    }

    /// Compresses the open block and writes its frame into the active
    /// segment. Nothing when the block is empty.
    fn seal_block(&mut self) -> Result<(), LogError> {
        if self.block.is_empty() {
            return Ok(());
        }
        // Taken out while their bytes are written by `write_frame`, which
        // needs the writer; put back whatever happens, for their buffers.
        let mut b = std::mem::take(&mut self.block);
        let mut compressed = std::mem::take(&mut self.compressed);
        let result = self.seal(&mut b, &mut compressed);
        if result.is_ok() {
            b.clear();
        }
        self.block = b;
        self.compressed = compressed;
        result
    }

    fn seal(&mut self, b: &mut BlockBuilder, compressed: &mut Vec<u8>) -> Result<(), LogError> {
        let (_, raw) = b.finish(Codec::Stored);
        let raw_len = raw.len();
        if raw_len > MAX_BLOCK_BYTES as usize {
            // Not reached: event_bytes bounds every event's share and the
            // fixed overhead is far below the slack. Refused rather than
            // written, since no reader would take it.
            return Err(LogError::RecordTooLarge {
                len: raw_len,
                max: MAX_BLOCK_BYTES as usize,
            });
        }
        let codec = block::compress(raw, compressed, &mut self.table);
        let (header, raw) = b.finish(codec);
        let body: &[u8] = match codec {
            Codec::Stored => raw,
            Codec::Lz4 => compressed,
        };
        self.write_frame(&header, body)
    }

    /// Writes one frame into the active segment (rotating first if the
    /// frame would take the segment past its size, creating the segment if
    /// there is none).
    fn write_frame(
        &mut self,
        header: &super::format::FrameHeader,
        body: &[u8],
    ) -> Result<(), LogError> {
        let frame_len = FRAME_HEADER_LEN + body.len() as u64;
        let rotate = self.active.as_ref().is_some_and(|a| {
            a.index.index().records > 0 && a.len + frame_len > self.cfg.segment_bytes
        });
        if rotate {
            self.seal_active()?;
        }
        if self.active.is_none() {
            self.start_segment(header.first_seq)?;
        }
        let Some(a) = self.active.as_mut() else {
            return Err(LogError::Poisoned("no active segment".into()));
        };
        let hb = header.encode(body);
        let offset = a.len;
        a.out.write_all(&hb).map_err(io_err(&a.path))?;
        a.out.write_all(body).map_err(io_err(&a.path))?;
        let h = super::format::FrameHeader::decode(&hb);
        a.index.push(&h, offset);
        a.len += frame_len;
        self.stats.blocks += 1;
        self.stats.bytes += frame_len;
        Ok(())
    }

    /// Creates the segment whose first record will be `first_seq`, writing
    /// its header straight to the file.
    fn start_segment(&mut self, first_seq: u64) -> Result<(), LogError> {
        let header = SegmentHeader::new(self.cfg.schema_version, self.cfg.engine_id, first_seq);
        let name = segment_file_name(first_seq);
        let path = self.dir.join(&name);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err(&path))?;
        file.write_all(&header.encode()).map_err(io_err(&path))?;
        match self.cfg.fsync {
            FsyncPolicy::Never => {}
            // Synced with the records, by the next `sync`.
            FsyncPolicy::OnSync => self.dir_unsynced = true,
            _ => {
                // The file's directory entry must be durable for its
                // records to be; its data is synced with the first record.
                sync_dir(&self.dir).map_err(io_err(&self.dir))?;
                self.stats.fsyncs += 1;
            }
        }
        self.stats.segments += 1;
        self.stats.bytes += SEGMENT_HEADER_LEN;
        self.active = Some(Active {
            header,
            name,
            path,
            out: BufWriter::with_capacity(self.cfg.write_buffer_bytes, file),
            len: SEGMENT_HEADER_LEN,
            index: IndexBuilder::new(self.cfg.index_every_records, self.cfg.index_every_bytes),
        });
        Ok(())
    }

    /// Finishes the active segment: flush, fsync unless the policy is
    /// `Never` (so a later segment never exists on disk before an earlier
    /// one is complete), then store its index. Called while sealing a block
    /// that goes to the next segment, so the records of the open block are
    /// not in this one.
    fn seal_active(&mut self) -> Result<(), LogError> {
        let Some(mut a) = self.active.take() else {
            return Ok(());
        };
        a.out.flush().map_err(io_err(&a.path))?;
        let sealed = a.index.index().last.map(|l| l.seq);
        self.flushed_seq = sealed;
        if self.cfg.fsync != FsyncPolicy::Never {
            a.out.get_ref().sync_data().map_err(io_err(&a.path))?;
            self.stats.fsyncs += 1;
            self.durable_seq = sealed;
        }
        if let Err(e) = index::store(&self.dir, &a.header, a.index.index()) {
            // Derived data: a reader rebuilds it. Not worth failing appends.
            tracing::warn!(segment = %a.name, error = %e, "could not write the segment index");
        }
        Ok(())
    }

    /// Seals the open block and hands buffered records to the OS (they then
    /// survive the process being killed, not a power loss), and with
    /// [`FsyncPolicy::Interval`] fsyncs if the interval has passed. Each
    /// flush ends a block, so flushing after every few records makes blocks
    /// small and compression poor.
    pub fn flush(&mut self) -> Result<(), LogError> {
        self.usable()?;
        let result = self.flush_inner();
        if let Err(e) = &result {
            self.poisoned = Some(e.to_string());
        }
        result?;
        if let FsyncPolicy::Interval(d) = self.cfg.fsync
            && self.unsynced
            && self.last_sync.elapsed() >= d
        {
            self.sync_inner()?;
        }
        Ok(())
    }

    fn flush_inner(&mut self) -> Result<(), LogError> {
        self.seal_block()?;
        if let Some(a) = self.active.as_mut() {
            a.out.flush().map_err(io_err(&a.path))?;
        }
        self.flushed_seq = self.last_seq;
        Ok(())
    }

    /// Flushes and fsyncs now, whatever the policy: every record appended so
    /// far is on stable storage when this returns.
    pub fn sync(&mut self) -> Result<(), LogError> {
        self.usable()?;
        self.sync_inner()
    }

    fn sync_inner(&mut self) -> Result<(), LogError> {
        let result = self.take_sync().and_then(PendingSync::run);
        if let Err(e) = &result {
            self.poisoned = Some(e.to_string());
        }
        result?;
        self.durable_seq = self.last_seq;
        self.unsynced = false;
        self.last_sync = Instant::now();
        Ok(())
    }

    /// Hands buffered records to the OS and returns what fsyncing them
    /// takes: the active segment's data, and its directory when a segment
    /// was created since the last sync ([`sync`](Self::sync) runs it at
    /// once, [`detach_sync`](Self::detach_sync) hands it out).
    fn take_sync(&mut self) -> Result<PendingSync, LogError> {
        self.flush_inner()?;
        let file = match &self.active {
            // A second descriptor of the same open file: its fsync covers
            // every write made through the first.
            Some(a) => Some((
                a.out.get_ref().try_clone().map_err(io_err(&a.path))?,
                a.path.clone(),
            )),
            None => None,
        };
        let pending = PendingSync {
            file,
            dir: self.dir_unsynced.then(|| self.dir.clone()),
        };
        self.stats.fsyncs += u64::from(pending.file.is_some()) + u64::from(pending.dir.is_some());
        self.dir_unsynced = false;
        Ok(pending)
    }

    /// Hands buffered records to the OS and returns the fsync that makes
    /// them durable, to run on another thread while this writer goes on
    /// appending ([`PendingSync::run`]); `None` when nothing was written
    /// since the last sync. A caller that waits for the returned sync
    /// before it acknowledges has what [`sync`](Self::sync) gives, without
    /// holding appends back for the device's flush (group commit). The
    /// writer counts its records as synced from here: a sync that then
    /// fails is the caller's to report, and [`durable_seq`](Self::durable_seq)
    /// does not move for it.
    pub fn detach_sync(&mut self) -> Result<Option<PendingSync>, LogError> {
        self.usable()?;
        if !self.unsynced && !self.dir_unsynced {
            return Ok(None);
        }
        let pending = match self.take_sync() {
            Ok(p) => p,
            Err(e) => {
                self.poisoned = Some(e.to_string());
                return Err(e);
            }
        };
        self.unsynced = false;
        self.last_sync = Instant::now();
        Ok(Some(pending))
    }

    /// Flushes, fsyncs (unless the policy is `Never`), stores the active
    /// segment's index and returns the counters. Dropping a writer does the
    /// same on a best-effort basis, logging failures.
    pub fn close(mut self) -> Result<LogStats, LogError> {
        self.finish()?;
        Ok(self.stats)
    }

    fn finish(&mut self) -> Result<(), LogError> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        if let Some(why) = self.poisoned.clone() {
            self.discard_buffer();
            return Err(LogError::Poisoned(why));
        }
        self.flush_inner()?;
        if self.cfg.fsync != FsyncPolicy::Never && self.unsynced {
            self.sync_inner()?;
        }
        if let Some(a) = &self.active
            && let Err(e) = index::store(&self.dir, &a.header, a.index.index())
        {
            tracing::warn!(segment = %a.name, error = %e, "could not write the segment index");
        }
        Ok(())
    }

    /// Stores an opaque snapshot blob taken at `seq` (the state after the
    /// record `seq`), which must already be in the log. The log is flushed
    /// first, and with any policy but `Never` fsynced, so that a snapshot is
    /// never ahead of the records it summarises. Returns the file's path.
    pub fn write_snapshot(
        &mut self,
        seq: u64,
        ts_ns: u64,
        bytes: &[u8],
    ) -> Result<PathBuf, LogError> {
        self.usable()?;
        if self.last_seq.is_none_or(|last| seq > last) {
            return Err(LogError::SnapshotAhead {
                seq,
                last: self.last_seq,
            });
        }
        let sync = self.cfg.fsync != FsyncPolicy::Never;
        if sync {
            self.sync_inner()?;
        } else {
            self.flush_inner()?;
        }
        let path = snapshot::write(
            &self.dir,
            seq,
            ts_ns,
            self.cfg.schema_version,
            self.cfg.engine_id,
            bytes,
            sync,
        )
        .map_err(io_err(&self.dir.join(snapshot::file_name(seq))))?;
        if sync {
            self.stats.fsyncs += 2;
        }
        Ok(path)
    }

    /// After a failed write the buffer may end in part of a frame; drop it
    /// rather than let `BufWriter` flush it on drop. The open block goes too:
    /// its records were never handed to the OS.
    fn discard_buffer(&mut self) {
        self.block.clear();
        if let Some(a) = self.active.take() {
            let (_file, _unwritten) = a.out.into_parts();
        }
    }

    fn usable(&self) -> Result<(), LogError> {
        if self.closed {
            return Err(LogError::Poisoned("the writer is closed".into()));
        }
        match &self.poisoned {
            Some(why) => Err(LogError::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    /// Counters since this writer was opened.
    pub fn stats(&self) -> LogStats {
        self.stats
    }

    /// The last sequence number in the log (appended or recovered).
    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// The last sequence number handed to the OS: it survives this process
    /// being killed. A lower bound (the buffer also drains when full).
    pub fn flushed_seq(&self) -> Option<u64> {
        self.flushed_seq
    }

    /// The last sequence number known to be on stable storage (fsynced).
    pub fn durable_seq(&self) -> Option<u64> {
        self.durable_seq
    }

    /// What `open_append` repaired.
    pub fn recovery(&self) -> &RecoveryReport {
        &self.recovery
    }

    /// The log directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The configuration in use.
    pub fn config(&self) -> &LogConfig {
        &self.cfg
    }
}

/// An fsync taken off a writer ([`LogWriter::detach_sync`]): its active
/// segment's data, and its directory when a segment was created since the
/// last sync.
#[derive(Debug)]
pub struct PendingSync {
    file: Option<(File, PathBuf)>,
    dir: Option<PathBuf>,
}

impl PendingSync {
    /// Runs the fsyncs: once this returns `Ok`, every record the writer had
    /// appended when it detached this is on stable storage.
    pub fn run(self) -> Result<(), LogError> {
        if let Some((file, path)) = &self.file {
            file.sync_data().map_err(io_err(path))?;
        }
        if let Some(dir) = &self.dir {
            sync_dir(dir).map_err(io_err(dir))?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for LogWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogWriter")
            .field("dir", &self.dir)
            .field("cfg", &self.cfg)
            .field("active", &self.active)
            .field("block", &self.block)
            .field("last_seq", &self.last_seq)
            .field("flushed_seq", &self.flushed_seq)
            .field("durable_seq", &self.durable_seq)
            .field("stats", &self.stats)
            .field("poisoned", &self.poisoned)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl Drop for LogWriter {
    fn drop(&mut self) {
        if self.poisoned.is_some() {
            self.discard_buffer();
        } else if !self.closed
            && let Err(e) = self.finish()
        {
            tracing::warn!(dir = %self.dir.display(), error = %e, "closing the log on drop failed");
        }
    }
}

fn check_matches(name: &str, h: &SegmentHeader, cfg: &LogConfig) -> Result<(), LogError> {
    if h.schema_version != cfg.schema_version {
        return Err(LogError::ConfigMismatch {
            segment: name.to_string(),
            field: "schema_version",
            found: u64::from(h.schema_version),
            expected: u64::from(cfg.schema_version),
        });
    }
    if h.engine_id != cfg.engine_id {
        return Err(LogError::ConfigMismatch {
            segment: name.to_string(),
            field: "engine_id",
            found: h.engine_id,
            expected: cfg.engine_id,
        });
    }
    Ok(())
}

/// Writes missing or unusable index files of the segments before the active
/// one, scanning each. A segment found damaged gets no index (readers report
/// the damage); appending is not affected.
fn rebuild_sealed_indexes(
    dir: &Path,
    cfg: &LogConfig,
    active_first: Option<u64>,
    report: &mut RecoveryReport,
) -> Result<(), LogError> {
    let mut prev_seq = None;
    for (name_seq, name) in list_segments(dir)? {
        if Some(name_seq) == active_first {
            break;
        }
        let path = dir.join(&name);
        let file = File::open(&path).map_err(io_err(&path))?;
        let file_len = file.metadata().map_err(io_err(&path))?.len();
        let mut r = BufReader::new(file);
        let header = match super::scan::read_header(&mut r, file_len).map_err(io_err(&path))? {
            Ok(h) => h,
            Err(_) => continue,
        };
        let store = super::store::Store::Dir(dir.to_path_buf());
        match index::load(&store, &header, file_len, &mut r).map_err(io_err(&path))? {
            Ok(idx) => {
                prev_seq = idx.last.map(|l| l.seq).or(prev_seq);
                continue;
            }
            Err(why) => {
                let scan = scan_segment(
                    &mut r,
                    file_len,
                    ScanParams {
                        name_seq,
                        prev_seq,
                        last_segment: false,
                        index_every_records: cfg.index_every_records,
                        index_every_bytes: cfg.index_every_bytes,
                    },
                )
                .map_err(io_err(&path))?;
                let idx = scan.index.finish();
                prev_seq = idx.last.map(|l| l.seq).or(prev_seq);
                if scan.end != SegmentEnd::Clean {
                    tracing::warn!(segment = %name, end = ?scan.end, "not indexing a damaged segment");
                    continue;
                }
                tracing::info!(segment = %name, reason = %why, "rebuilding a segment index");
                if let Err(e) = index::store(dir, &header, &idx) {
                    tracing::warn!(segment = %name, error = %e, "could not write the segment index");
                } else {
                    report.indexes_rebuilt.push(name);
                }
            }
        }
    }
    Ok(())
}

fn remove_if_exists(path: &Path) -> Result<(), LogError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(path)(e)),
        _ => Ok(()),
    }
}

/// Whether the index stored beside a segment (written when its writer
/// closed it) describes the segment as `scanned`: same records, same end,
/// and its last block where the index remembers it.
fn stored_index_matches(
    dir: &Path,
    header: &SegmentHeader,
    scanned: &index::SegmentIndex,
    segment: &mut File,
) -> Result<bool, LogError> {
    let store = super::store::Store::Dir(dir.to_path_buf());
    let path = dir.join(segment_file_name(header.first_seq));
    let stored = index::load(&store, header, scanned.valid_len, segment).map_err(io_err(&path))?;
    Ok(stored.is_ok_and(|s| {
        s.records == scanned.records && s.valid_len == scanned.valid_len && s.last == scanned.last
    }))
}

/// Decompresses and verifies every block of the last segment of the log in
/// `dir` (the frame scan alone does not look inside blocks).
fn verify_last_segment(dir: &Path) -> Result<(), LogError> {
    let reader = LogReader::open(dir, ReaderOptions::default())?;
    let mut blocks = reader.last_segment_blocks();
    while let Some(b) = blocks.next_block() {
        b?;
    }
    Ok(())
}

/// Removes the leftovers of an index or snapshot write interrupted before
/// its rename.
fn remove_temp_files(dir: &Path) -> Result<(), LogError> {
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let is_index_tmp = name
            .strip_suffix(".tmp")
            .and_then(|n| n.strip_suffix(super::format::INDEX_SUFFIX))
            .and_then(super::format::parse_segment_file_name)
            .is_some();
        if is_index_tmp || snapshot::is_temp_name(name) {
            remove_if_exists(&entry.path())?;
        }
    }
    Ok(())
}
