//! The reading side of the log: open (recovery without writing), summary,
//! iteration, seeking by sequence number or time, and snapshot lookup.
//!
//! A reader never writes to the log directory: a torn tail is reported and
//! skipped, a missing or unusable index is rebuilt in memory only.

use std::collections::BTreeMap;
use std::io::{Seek as _, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvbm_events::Event;

use super::block::{self, OpenError};
use super::format::{Codec, SEGMENT_HEADER_LEN, SegmentHeader};
use super::index::{self, SegmentIndex};
use super::scan::{self, ScanParams, SegmentEnd, Step};
use super::snapshot::{self, Snapshot};
use super::store::{Store, StoreFile};
use super::{CorruptReason, LogError, ReaderOptions, TornTail, io_err, segments_of};
use kvbm_schema::columnar::BlockView;

/// A point in the log to start reading from or to look a snapshot up at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeekTo {
    /// The first record with `seq >=` this.
    Seq(u64),
    /// The first record, in log order, with `ts_ns >=` this (exact even if
    /// timestamps are not monotonic).
    TimeNs(u64),
}

/// One event read from the log, with where its block lies.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// The event.
    pub event: Event,
    /// Segment file name it was read from.
    pub segment: Arc<str>,
    /// Byte offset of its block's frame in that file (events of one block
    /// share it).
    pub offset: u64,
}

/// One verified block, lent by [`BlockIter::next_block`].
#[derive(Clone, Copy, Debug)]
pub struct BlockRef<'a> {
    /// The block's events, verified and checked against the frame header.
    pub view: BlockView<'a>,
    /// Segment file name it was read from.
    pub segment: &'a Arc<str>,
    /// Byte offset of its frame in that file.
    pub offset: u64,
}

/// Where a segment's index came from.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum IndexSource {
    /// Its index file, checked against the segment.
    File,
    /// Rebuilt in memory by scanning the segment, for the reason given
    /// (missing, damaged, stale, or `trust_index` off).
    Scanned {
        /// Why the file was not used.
        why: String,
    },
}

/// How a segment's readable data ends, as far as opening the log found.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum SegmentStatus {
    /// All good (for a segment whose index file was trusted: as far as the
    /// index says; iteration checks every frame).
    Clean,
    /// The last segment ends in a torn record from `offset` on.
    TornTail {
        /// Where the torn bytes start.
        offset: u64,
        /// How many.
        bytes: u64,
    },
    /// Corrupt at `offset`; records before it are readable.
    Corrupt {
        /// Byte offset of the bad record (0: the header).
        offset: u64,
        /// What is wrong.
        reason: CorruptReason,
    },
    /// Written in a format version this build does not read.
    Unsupported {
        /// The version found.
        version: u16,
    },
}

/// Summary of one segment.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SegmentInfo {
    /// File name.
    pub name: String,
    /// Its header, when readable.
    pub header: Option<SegmentHeader>,
    /// File length when opened.
    pub file_len: u64,
    /// End of its last good record.
    pub valid_len: u64,
    /// Good records.
    pub records: u64,
    /// First good record's seq.
    pub first_seq: Option<u64>,
    /// Last good record's seq.
    pub last_seq: Option<u64>,
    /// Smallest and largest timestamp of its good records.
    pub time_range_ns: Option<(u64, u64)>,
    /// Sparse index entries held in memory.
    pub index_entries: usize,
    /// Where the index came from.
    pub index: IndexSource,
    /// How it ends.
    pub status: SegmentStatus,
}

/// Summary of a log as opened.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LogInfo {
    /// The directory (`None` for a log read from memory).
    pub dir: Option<PathBuf>,
    /// The first readable segment header (format and schema version, engine
    /// id, creation time).
    pub header: Option<SegmentHeader>,
    /// Every segment, in log order.
    pub segments: Vec<SegmentInfo>,
    /// First good record's seq.
    pub first_seq: Option<u64>,
    /// Last good record's seq.
    pub last_seq: Option<u64>,
    /// Smallest and largest timestamp of the good records.
    pub time_range_ns: Option<(u64, u64)>,
    /// Good records in all segments (from index files where trusted).
    pub total_records: u64,
    /// The torn tail readers skip, if any.
    pub torn_tail: Option<TornTail>,
    /// Bytes in it (0 when none).
    pub torn_tail_bytes: u64,
    /// Segments whose index had to be rebuilt by scanning.
    pub indexes_rebuilt: usize,
}

impl LogInfo {
    /// The first damage opening the log found, as the error iteration will
    /// report when it gets there.
    pub fn first_damage(&self) -> Option<LogError> {
        self.segments.iter().find_map(|s| match &s.status {
            SegmentStatus::Corrupt { offset, reason } => Some(LogError::Corrupt {
                segment: s.name.clone(),
                offset: *offset,
                reason: reason.clone(),
            }),
            SegmentStatus::Unsupported { version } => Some(LogError::UnsupportedVersion {
                segment: s.name.clone(),
                found: *version,
            }),
            _ => None,
        })
    }
}

#[derive(Debug)]
struct Segment {
    name_seq: u64,
    name: Arc<str>,
    path: PathBuf,
    header: Option<SegmentHeader>,
    index: SegmentIndex,
    end: SegmentEnd,
}

impl Segment {
    /// End of the bytes iteration may read as frames.
    fn readable_end(&self) -> u64 {
        match (&self.header, &self.end) {
            (None, _) | (_, SegmentEnd::Corrupt { offset: 0, .. }) => 0,
            (Some(_), _) => self.index.valid_len,
        }
    }
}

/// A read-only view of a log directory (or of its files in memory). See
/// the module docs.
#[derive(Debug)]
pub struct LogReader {
    store: Store,
    opts: ReaderOptions,
    segments: Vec<Segment>,
    info: LogInfo,
    snapshots_ignored: AtomicU64,
}

impl LogReader {
    /// Opens the log in `dir` as it is now: lists its segments, checks each
    /// header, uses each index file that checks out and scans the other
    /// segments (the last one's torn tail, if any, is found here). Damage is
    /// not an error here: it is in [`LogInfo`] and iteration reports it
    /// after the records before it. Errors are I/O errors only.
    pub fn open(dir: impl AsRef<Path>, opts: ReaderOptions) -> Result<Self, LogError> {
        Self::open_store(Store::Dir(dir.as_ref().to_path_buf()), opts)
    }

    /// Reads a log whose files are held in memory, as `(file name, bytes)`
    /// pairs named as in a log directory (segments, index files,
    /// snapshots; other names are ignored): a log fetched over the network
    /// or embedded in a test. Exactly the same checks as [`Self::open`].
    pub fn from_files(
        files: impl IntoIterator<Item = (String, Vec<u8>)>,
        opts: ReaderOptions,
    ) -> Result<Self, LogError> {
        let files: BTreeMap<String, std::sync::Arc<[u8]>> = files
            .into_iter()
            .map(|(name, bytes)| (name, bytes.into()))
            .collect();
        Self::open_store(Store::Memory(files), opts)
    }

    fn open_store(store: Store, opts: ReaderOptions) -> Result<Self, LogError> {
        let names = segments_of(&store)?;
        let mut segments = Vec::with_capacity(names.len());
        let mut infos = Vec::with_capacity(names.len());
        let mut prev_seq = None;
        for (i, (name_seq, name)) in names.iter().enumerate() {
            let last = i + 1 == names.len();
            let (seg, info) = open_segment(&store, *name_seq, name, prev_seq, last, &opts)?;
            prev_seq = seg.index.last.map(|l| l.seq).or(prev_seq);
            segments.push(seg);
            infos.push(info);
        }
        let info = summarize(store.dir(), infos);
        Ok(Self {
            store,
            opts,
            segments,
            info,
            snapshots_ignored: AtomicU64::new(0),
        })
    }

    /// What opening found.
    pub fn info(&self) -> &LogInfo {
        &self.info
    }

    /// The directory (`None` for a log read from memory).
    pub fn dir(&self) -> Option<&Path> {
        self.store.dir()
    }

    /// Every event from the start.
    pub fn iter(&self) -> LogIter<'_> {
        LogIter::new(self, 0, SEGMENT_HEADER_LEN, None)
    }

    /// Every block of the last segment, verified but not decoded.
    pub(crate) fn last_segment_blocks(&self) -> BlockIter<'_> {
        BlockIter::new(
            self,
            self.segments.len().saturating_sub(1),
            SEGMENT_HEADER_LEN,
            None,
        )
    }

    /// Every block from the start, verified but not decoded: for bulk work
    /// that looks at a few columns, or decodes blocks itself.
    pub fn blocks(&self) -> BlockIter<'_> {
        BlockIter::new(self, 0, SEGMENT_HEADER_LEN, None)
    }

    /// Records from the first with `seq >= target`.
    pub fn iter_from_seq(&self, target: u64) -> LogIter<'_> {
        self.iter_from(SeekTo::Seq(target))
    }

    /// Records from the first (in log order) with `ts_ns >= target`.
    pub fn iter_from_time(&self, target: u64) -> LogIter<'_> {
        self.iter_from(SeekTo::TimeNs(target))
    }

    /// Records from `at`: jumps to the nearest index entry at or before it
    /// and scans forward, skipping the records before it (the blocks they
    /// are in are still checked).
    pub fn iter_from(&self, at: SeekTo) -> LogIter<'_> {
        match at {
            SeekTo::Seq(target) => {
                // The last segment that can hold `target`.
                let i = self
                    .segments
                    .partition_point(|s| s.name_seq <= target)
                    .saturating_sub(1);
                let pos = self
                    .segments
                    .get(i)
                    .and_then(|s| s.index.start_for_seq(target))
                    .map_or(SEGMENT_HEADER_LEN, |e| e.offset);
                LogIter::new(self, i, pos, Some(at))
            }
            SeekTo::TimeNs(target) => {
                // Every record before the chosen segment is older than
                // `target`; stop early at damage so that it is reported
                // rather than skipped.
                let found = self.segments.iter().position(|s| {
                    !matches!(s.end, SegmentEnd::Clean | SegmentEnd::Torn { .. })
                        || (s.index.records > 0 && s.index.max_ts >= target)
                });
                let Some(i) = found else {
                    return LogIter::new(self, self.segments.len(), SEGMENT_HEADER_LEN, None);
                };
                let pos = self.segments[i]
                    .index
                    .start_for_time(target)
                    .map_or(SEGMENT_HEADER_LEN, |e| e.offset);
                LogIter::new(self, i, pos, Some(at))
            }
        }
    }

    /// The newest valid snapshot at or before `at` (by its seq, or by its
    /// timestamp), or `None`. Damaged snapshots, and snapshots of another
    /// engine or schema version than the log's first segment, are skipped
    /// with a warning and counted in [`Self::snapshots_ignored`]. Errors only
    /// when the directory cannot be listed.
    pub fn latest_snapshot_at_or_before(&self, at: SeekTo) -> Result<Option<Snapshot>, LogError> {
        let mut candidates = snapshot::list(&self.store)?;
        match at {
            SeekTo::Seq(target) => candidates.retain(|(seq, _)| *seq <= target),
            SeekTo::TimeNs(target) => {
                candidates.retain(|(_, name)| match snapshot::read_header(&self.store, name) {
                    Ok(h) => h.ts_ns <= target,
                    Err(why) => {
                        self.ignore_snapshot(name, &why);
                        false
                    }
                })
            }
        }
        for (seq, name) in candidates.iter().rev() {
            match snapshot::read(&self.store, name, *seq) {
                Ok(s) => match self.info.header {
                    Some(h)
                        if h.engine_id != s.engine_id || h.schema_version != s.schema_version =>
                    {
                        self.ignore_snapshot(name, "belongs to another engine or schema version");
                    }
                    _ => return Ok(Some(s)),
                },
                Err(why) => self.ignore_snapshot(name, &why),
            }
        }
        Ok(None)
    }

    fn ignore_snapshot(&self, name: &str, why: &str) {
        tracing::warn!(snapshot = name, reason = why, "ignoring a snapshot");
        self.snapshots_ignored.fetch_add(1, Ordering::Relaxed);
    }

    /// Snapshots skipped as unusable by lookups so far (a snapshot skipped
    /// by two lookups counts twice).
    pub fn snapshots_ignored(&self) -> u64 {
        self.snapshots_ignored.load(Ordering::Relaxed)
    }
}

/// Why a segment was scanned when the caller asked for no index files.
const TRUST_OFF: &str = "trust_index is off";

fn open_segment(
    store: &Store,
    name_seq: u64,
    name: &str,
    prev_seq: Option<u64>,
    last: bool,
    opts: &ReaderOptions,
) -> Result<(Segment, SegmentInfo), LogError> {
    let path = store.path(name);
    let (mut r, file_len) = store
        .open(name, opts.read_buffer_bytes)
        .map_err(io_err(&path))?;
    let mut why = String::from(TRUST_OFF);
    let mut trusted = None;
    if opts.trust_index {
        match scan::read_header(&mut r, file_len).map_err(io_err(&path))? {
            Ok(h) if h.first_seq == name_seq => {
                match index::load(store, &h, file_len, &mut r).map_err(io_err(&path))? {
                    Ok(idx) => trusted = Some((h, idx)),
                    Err(w) => why = w,
                }
            }
            _ => why = "the segment header is unusable".into(),
        }
    }
    let (header, index, end, source) = match trusted {
        Some((h, idx)) => {
            let first = idx.entries.first().map(|e| e.seq);
            match (first, prev_seq) {
                (Some(seq), Some(prev)) if seq <= prev => {
                    let reason = CorruptReason::SeqNotIncreasing { seq, prev };
                    let end = SegmentEnd::Corrupt {
                        offset: SEGMENT_HEADER_LEN,
                        reason,
                    };
                    (Some(h), SegmentIndex::empty(), end, IndexSource::File)
                }
                _ => (Some(h), idx, SegmentEnd::Clean, IndexSource::File),
            }
        }
        None => {
            let params = ScanParams {
                name_seq,
                prev_seq,
                last_segment: last,
                index_every_records: opts.index_every_records,
                index_every_bytes: opts.index_every_bytes,
            };
            let s = scan::scan_segment(&mut r, file_len, params).map_err(io_err(&path))?;
            (
                s.header,
                s.index.finish(),
                s.end,
                IndexSource::Scanned { why },
            )
        }
    };
    let status = match &end {
        SegmentEnd::Clean => SegmentStatus::Clean,
        SegmentEnd::Torn { offset, bytes } => SegmentStatus::TornTail {
            offset: *offset,
            bytes: *bytes,
        },
        SegmentEnd::Corrupt { offset, reason } => SegmentStatus::Corrupt {
            offset: *offset,
            reason: reason.clone(),
        },
        SegmentEnd::Unsupported { version } => SegmentStatus::Unsupported { version: *version },
    };
    let info = SegmentInfo {
        name: name.to_string(),
        header,
        file_len,
        valid_len: index.valid_len.min(file_len),
        records: index.records,
        first_seq: index.entries.first().map(|e| e.seq),
        last_seq: index.last.map(|l| l.seq),
        time_range_ns: (index.records > 0).then_some((index.min_ts, index.max_ts)),
        index_entries: index.entries.len(),
        index: source,
        status,
    };
    let seg = Segment {
        name_seq,
        name: Arc::from(name),
        path,
        header,
        index,
        end,
    };
    Ok((seg, info))
}

fn summarize(dir: Option<&Path>, segments: Vec<SegmentInfo>) -> LogInfo {
    let with_records = || segments.iter().filter(|s| s.records > 0);
    let torn_tail = segments.iter().find_map(|s| match s.status {
        SegmentStatus::TornTail { offset, bytes } => Some(TornTail {
            segment: s.name.clone(),
            offset,
            bytes,
        }),
        _ => None,
    });
    let time_range_ns = with_records()
        .filter_map(|s| s.time_range_ns)
        .reduce(|(a, b), (c, d)| (a.min(c), b.max(d)));
    LogInfo {
        dir: dir.map(Path::to_path_buf),
        header: segments.iter().find_map(|s| s.header),
        first_seq: with_records().next().and_then(|s| s.first_seq),
        last_seq: with_records().next_back().and_then(|s| s.last_seq),
        time_range_ns,
        total_records: segments.iter().map(|s| s.records).sum(),
        torn_tail_bytes: torn_tail.as_ref().map_or(0, |t| t.bytes),
        torn_tail,
        indexes_rebuilt: segments
            .iter()
            .filter(|s| matches!(&s.index, IndexSource::Scanned { why } if why != TRUST_OFF))
            .count(),
        segments,
    }
}

/// Iterates verified blocks in log order. Yields every good block, then at
/// most one error (damage, or an I/O error), then nothing. Each frame's
/// bounds, checksum and header are checked, then its order; then its body
/// is decompressed, the flatbuffers verifier runs over the whole block, and
/// its columns are checked against each other and against the header.
#[derive(Debug)]
pub struct BlockIter<'r> {
    reader: &'r LogReader,
    seg: usize,
    /// Offset of the next frame to read.
    pos: u64,
    file: Option<StoreFile>,
    prev_seq: Option<u64>,
    /// Frames wholly before this are checked but not decompressed.
    skip: Option<SeekTo>,
    /// The current block's body as read.
    buf: Vec<u8>,
    /// The current block's records region when the body is compressed.
    raw: Vec<u8>,
    done: bool,
}

impl<'r> BlockIter<'r> {
    fn new(reader: &'r LogReader, seg: usize, pos: u64, skip: Option<SeekTo>) -> Self {
        Self {
            reader,
            seg,
            pos,
            file: None,
            prev_seq: None,
            skip,
            buf: Vec::new(),
            raw: Vec::new(),
            done: false,
        }
    }

    /// Ends the iteration (after an error).
    fn stop(&mut self) {
        self.done = true;
        self.file = None;
    }

    fn fail<T>(&mut self, e: LogError) -> Option<Result<T, LogError>> {
        self.stop();
        Some(Err(e))
    }

    fn corrupt<T>(&mut self, offset: u64, reason: CorruptReason) -> Option<Result<T, LogError>> {
        let segment = self
            .reader
            .segments
            .get(self.seg)
            .map_or_else(String::new, |s| s.name.to_string());
        self.fail(LogError::Corrupt {
            segment,
            offset,
            reason,
        })
    }

    /// The next block, verified, borrowed from the iterator.
    pub fn next_block(&mut self) -> Option<Result<BlockRef<'_>, LogError>> {
        let reader: &'r LogReader = self.reader;
        loop {
            if self.done {
                return None;
            }
            let Some(seg) = reader.segments.get(self.seg) else {
                self.done = true;
                return None;
            };
            let end = seg.readable_end();
            if self.pos >= end {
                match &seg.end {
                    SegmentEnd::Clean | SegmentEnd::Torn { .. } => {
                        self.seg += 1;
                        self.pos = SEGMENT_HEADER_LEN;
                        self.file = None;
                        continue;
                    }
                    SegmentEnd::Corrupt { offset, reason } => {
                        return self.fail(LogError::Corrupt {
                            segment: seg.name.to_string(),
                            offset: *offset,
                            reason: reason.clone(),
                        });
                    }
                    SegmentEnd::Unsupported { version } => {
                        return self.fail(LogError::UnsupportedVersion {
                            segment: seg.name.to_string(),
                            found: *version,
                        });
                    }
                }
            }
            let Some(header) = seg.header else {
                // readable_end is 0 without a header; not reached.
                self.seg += 1;
                continue;
            };
            if self.file.is_none() {
                let buffer = reader.opts.read_buffer_bytes;
                let opened = reader.store.open(&seg.name, buffer).and_then(|(mut r, _)| {
                    r.seek(SeekFrom::Start(self.pos))?;
                    Ok(r)
                });
                match opened {
                    Ok(r) => self.file = Some(r),
                    Err(e) => return self.fail(io_err(&seg.path)(e)),
                }
            }
            let Some(file) = self.file.as_mut() else {
                continue;
            };
            let offset = self.pos;
            let h = match scan::read_frame(file, offset, end, &mut self.buf) {
                Err(e) => return self.fail(io_err(&seg.path)(e)),
                Ok(Step::End) => {
                    self.pos = end;
                    continue;
                }
                Ok(Step::Bad { reason, .. }) => return self.corrupt(offset, reason),
                Ok(Step::Frame(h)) => h,
            };
            if let Some(reason) = scan::check_frame(&h, offset, &header, self.prev_seq) {
                return self.corrupt(offset, reason);
            }
            self.pos += h.frame_len();
            self.prev_seq = Some(h.last_seq);
            // A block that ends before the seek target is checked (bounds,
            // checksum, header, order) but not decompressed.
            let before_target = match self.skip {
                Some(SeekTo::Seq(s)) => h.last_seq < s,
                Some(SeekTo::TimeNs(t)) => h.max_ts < t,
                None => false,
            };
            if before_target {
                continue;
            }
            self.skip = None;
            // `check_frame` passed, so the codec is known.
            let codec = Codec::from_byte(h.codec).unwrap_or(Codec::Stored);
            if codec == Codec::Lz4
                && let Err(why) = block::decompress(&h, &self.buf, &mut self.raw)
            {
                return self.corrupt(offset, CorruptReason::BadBlock(why));
            }
            // Only the buffers are borrowed by the view, so that the error
            // path below can still end the iteration.
            let region: &[u8] = match codec {
                Codec::Stored => &self.buf,
                Codec::Lz4 => &self.raw,
            };
            return match block::open(&h, region) {
                Ok(view) => Some(Ok(BlockRef {
                    view,
                    segment: &seg.name,
                    offset,
                })),
                Err(e) => {
                    self.done = true;
                    self.file = None;
                    Some(Err(LogError::Corrupt {
                        segment: seg.name.to_string(),
                        offset,
                        reason: match e {
                            OpenError::Verify(why) => CorruptReason::Verify(why),
                            OpenError::Header(why) => CorruptReason::BadBlock(why),
                        },
                    }))
                }
            };
        }
    }
}

/// Iterates events in log order, block by block ([`BlockIter`]), decoding
/// each block as it is reached. Yields every good event, then at most one
/// error (damage, or an I/O error), then nothing: an event whose values do
/// not decode ends the iteration after the events before it in its block.
#[derive(Debug)]
pub struct LogIter<'r> {
    blocks: BlockIter<'r>,
    /// Events before this are skipped (in the first block decoded).
    skip: Option<SeekTo>,
    /// The current block's events not yet handed out.
    events: std::vec::IntoIter<Event>,
    /// Where the current block lies.
    segment: Arc<str>,
    offset: u64,
    /// An error found while decoding the current block, yielded once its
    /// good events are out.
    pending: Option<LogError>,
}

impl<'r> LogIter<'r> {
    fn new(reader: &'r LogReader, seg: usize, pos: u64, skip: Option<SeekTo>) -> Self {
        Self {
            blocks: BlockIter::new(reader, seg, pos, skip),
            skip,
            events: Vec::new().into_iter(),
            segment: Arc::from(""),
            offset: 0,
            pending: None,
        }
    }

    /// Decodes the next block into `self.events`; `false` at the end.
    fn load(&mut self) -> Option<Result<(), LogError>> {
        let b = match self.blocks.next_block()? {
            Ok(b) => b,
            Err(e) => return Some(Err(e)),
        };
        let mut events = Vec::with_capacity(b.view.len());
        let decoded = b.view.decode_into(&mut events);
        if !Arc::ptr_eq(&self.segment, b.segment) {
            self.segment = Arc::clone(b.segment);
        }
        self.offset = b.offset;
        if let Err(e) = decoded {
            self.pending = Some(LogError::Corrupt {
                segment: self.segment.to_string(),
                offset: self.offset,
                reason: CorruptReason::Verify(e.to_string()),
            });
            self.blocks.stop();
        }
        self.events = events.into_iter();
        Some(Ok(()))
    }
}

impl Iterator for LogIter<'_> {
    type Item = Result<Record, LogError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(event) = self.events.next() {
                if let Some(target) = self.skip {
                    let reached = match target {
                        SeekTo::Seq(s) => event.seq >= s,
                        SeekTo::TimeNs(t) => event.ts_ns >= t,
                    };
                    if !reached {
                        continue;
                    }
                    self.skip = None;
                }
                return Some(Ok(Record {
                    event,
                    segment: Arc::clone(&self.segment),
                    offset: self.offset,
                }));
            }
            if let Some(e) = self.pending.take() {
                return Some(Err(e));
            }
            if let Err(e) = self.load()? {
                return Some(Err(e));
            }
        }
    }
}

impl std::iter::FusedIterator for LogIter<'_> {}
