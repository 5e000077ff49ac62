//! The durable log: an append-only, crash-safe store of kvbm events on
//! disk, gathered into compressed columnar blocks, with a sparse index for
//! seeking and optional snapshots.
//!
//! # What it is for
//!
//! The recorder writes every engine event here and reads them back for
//! replay, checks and exports, live or after a crash. What it guarantees:
//!
//! - a record that was fsynced is there after a crash, and so is every record
//!   before it; after the process is killed (not the machine), every record
//!   handed to the OS is there too (records reach the OS a block at a
//!   time: on `flush`, `sync`, a full block, or per the fsync policy);
//! - a crash mid-write leaves at most a *torn tail*, which readers skip and
//!   [`LogWriter::open_append`] truncates;
//! - damage anywhere else is *corruption*, reported with the segment file and
//!   byte offset of the damaged block ([`LogError::Corrupt`]), with every
//!   record of the blocks before it still readable;
//! - reading never panics, whatever the bytes on disk, and never sizes a
//!   buffer from a length field before checking it against the maximum and
//!   against the bytes actually there (a block's decompressed size
//!   included: it is checked against [`MAX_BLOCK_BYTES`] and against what
//!   the compressed body could possibly expand to).
//!
//! # What it must not do
//!
//! - Know flatbuffers. A block's records region is built and checked by
//!   [`kvbm_schema::columnar`] (one `EventBlock` per block); this module frames,
//!   compresses, indexes and recovers blocks, and checks what the block
//!   holds against its frame header.
//! - Trust derived data. Index files and snapshots are conveniences that a
//!   reader checks and, when they do not hold up, rebuilds (the index) or
//!   skips (a snapshot). Only segment files are the source of truth.
//! - Destroy data it is not sure about. Only a bad block with nothing valid
//!   after it, at the very end of the last segment, is truncated; anything
//!   else is reported and left alone.
//! - Spawn threads. The fsync interval is checked when appending and
//!   flushing, not by a timer.
//!
//! # On disk
//!
//! A log is a directory. All integers are little-endian; CRCs are CRC-32C
//! (Castagnoli), unmasked.
//!
//! ```text
//! 00000000000000000000.kvlog        segment whose first record has seq 0
//! 00000000000000000000.kvlog.idx    its sparse index (derived)
//! 00000000000000001234.kvlog        next segment, first seq 1234
//! snapshot-00000000000000000999.bin snapshot taken after seq 999 (derived)
//! ```
//!
//! Segments are named, Kafka style, by the sequence number of the first
//! record they hold, zero-padded to 20 digits so that names sort in log
//! order. A segment is created when its first block is written, and a new
//! one is started when the next block would take the current one past
//! [`LogConfig::segment_bytes`] (a segment always holds at least one block,
//! so one block larger than the limit gets a segment of its own).
//!
//! **Segment header**, 64 bytes, written in one call when the segment is
//! created:
//!
//! | bytes  | field |
//! |--------|-------|
//! | 0..8   | magic `KVBMLOG\0` |
//! | 8..10  | format version, `u16` = 3 (1, one frame per record, and 2, one flatbuffers record per event, are refused with [`LogError::UnsupportedVersion`]) |
//! | 10..12 | header length, `u16` = 64 |
//! | 12..16 | schema version of the events, `u32`, as the caller passed it |
//! | 16..24 | engine id, `u64` |
//! | 24..32 | creation time, `u64` ns since the Unix epoch (informational) |
//! | 32..40 | first seq, `u64` (must equal the file name) |
//! | 40..60 | reserved, zero |
//! | 60..64 | CRC-32C of bytes 0..60 |
//!
//! **Block frame**, 48 bytes of header then the body, back to back from
//! byte 64 to the end of the segment (no padding, no trailer). A block holds
//! one or more consecutive events (a *record* is one event); the writer
//! seals one when the next event would take its records region past
//! [`LogConfig::block_bytes`] (60 KiB by default, by
//! [`kvbm_schema::columnar::event_bytes`]), at 65,535 events, when the next
//! event's differences from the last do not fit the block's delta columns,
//! and on every flush, sync, rotation or close (so with
//! [`FsyncPolicy::EveryRecord`] a block holds one event):
//!
//! | bytes  | field |
//! |--------|-------|
//! | 0..4   | body length `n`, `u32`, at most [`MAX_BLOCK_BYTES`] (16 MiB + 4 KiB) |
//! | 4..8   | CRC-32C over bytes 0..4, then 8..48, then the body |
//! | 8..16  | first seq, `u64` |
//! | 16..24 | last seq, `u64`; seqs are strictly increasing across the whole log |
//! | 24..32 | smallest ts_ns of its events, `u64` (timestamps are stored as the caller passed them, not required monotonic) |
//! | 32..40 | largest ts_ns of its events, `u64` |
//! | 40..44 | length of the records region, `u32`, at most [`MAX_BLOCK_BYTES`] |
//! | 44..46 | event count, `u16`, at least 1 |
//! | 46     | codec: 0 the body is the records region; 1 the body is the region compressed as one LZ4 block (the writer stores it uncompressed when LZ4 would not make it smaller) |
//! | 47     | reserved, zero |
//! | 48..48+n | body |
//!
//! The **records region** is one flatbuffers `EventBlock`
//! (`schema/kvbm_events.fbs`, file identifier `KVBB`): the block's events
//! column by column, fixed-size kinds as rows of structs (see
//! [`kvbm_schema::columnar`] for why). A reader runs the flatbuffers verifier
//! over it, checks the columns against each other, then checks it against
//! the header: the count, the first and last seq, seqs strictly
//! increasing, each timestamp inside the header's range. Each event is
//! decoded (enum values and the like checked) as it is read; one that does
//! not decode ends the read after the events before it.
//!
//! The checksum covers the lengths, the seqs and the codec, so a frame whose
//! length field is damaged fails its check rather than being misread, and an
//! all-zero region (what a power loss can leave) is never a valid frame. The
//! header's seqs and timestamps let scanning, indexing and recovery work
//! without decompressing anything.
//!
//! **Index file** `<segment>.idx`, written (temporary file, then rename) when
//! the segment is sealed or the log closed; not fsynced, since it is derived:
//!
//! | bytes  | field |
//! |--------|-------|
//! | 0..8   | magic `KVBMIDX\0` |
//! | 8..10  | version, `u16` = 2; 10..12 reserved |
//! | 12..16 | entry count `k`, `u32` |
//! | 16..24 | the segment's first seq |
//! | 24..28 | the segment header's CRC (ties the index to that very file); 28..32 reserved |
//! | 32..40 | bytes of the segment it covers (must equal the file's length) |
//! | 40..48 | record count |
//! | 48..56, 56..64, 64..68 | last block's last seq, offset and frame CRC (checked against the segment on load); 68..72 reserved |
//! | 72..80, 80..88 | smallest and largest ts_ns in the segment |
//! | 88..88+32k | entries, one per indexed block: its first seq, its smallest ts_ns, the largest ts_ns before the block in the segment, its byte offset (`u64` each) |
//! | last 4 | CRC-32C of everything before |
//!
//! An entry is taken for a segment's first block and then for the first block
//! that starts at least [`LogConfig::index_every_records`] records or
//! [`LogConfig::index_every_bytes`] bytes after the previous entry (with the
//! defaults, every block of a busy log).
//!
//! **Snapshot** `snapshot-<seq>.bin`: magic `KVBMSNAP`, version `u16` = 1,
//! header length `u16` = 56, schema version `u32`, engine id, seq, ts_ns and
//! blob length (`u64` each), 4 reserved bytes, then the CRC-32C of bytes
//! 0..52 and the blob, then the blob.
//!
//! # Recovery: torn tail or corruption
//!
//! Readers and [`LogWriter::open_append`] read each segment frame by frame
//! (streaming, through a `BufReader`). A frame is *bad* if its header is
//! incomplete, its length exceeds the maximum or what remains of the file,
//! or its checksum fails. A frame with a good checksum whose header cannot
//! describe a block, or whose first seq does not follow the previous block
//! (or, first in its segment, differs from the segment header) is corruption
//! outright: it was written whole. So is a block whose body, checksum and
//! all, does not decompress to a records region that matches its header;
//! that is found when it is read. For a bad frame:
//!
//! - in any segment but the last: corruption;
//! - in the last segment: the rest of the file is searched, byte by byte,
//!   for a frame that fits, passes its checksum and continues the sequence
//!   (trying first where the bad frame's length points). If one exists the
//!   bad frame is corruption in the middle; if none does it is a torn tail,
//!   and every record of the blocks before it is kept.
//!
//! The same holds for a segment header: a short or garbled header in the last
//! segment with nothing valid after it is a crash while creating that
//! segment (the writer removes the file). A block that itself contains a
//! complete valid frame could make a torn tail look like corruption; that
//! errs on the safe side (the writer refuses to truncate).
//!
//! # Durability ([`FsyncPolicy`])
//!
//! Appends gather in the open block (memory), and sealed blocks go through a
//! `BufWriter`. `EveryRecord` seals, flushes and fsyncs (`fdatasync`) before
//! `append` returns. `Interval(d)` fsyncs when at least
//! `d` has passed since the last fsync, checked in `append` and `flush` (so
//! an idle writer does not fsync; call `flush` periodically or `sync`).
//! `Never` leaves it to the OS. With any policy but `Never`, creating a
//! segment fsyncs the directory and sealing one fsyncs it, so a later
//! segment never reaches the disk before an earlier one is complete.
//! [`LogWriter::durable_seq`] and [`LogWriter::flushed_seq`] say what is
//! safe from a power loss and from a kill, respectively.
//!
//! # Reading
//!
//! [`LogReader::open`] takes a consistent view of the log as it is at that
//! moment (records appended later are not seen; reopen to see them). It uses
//! each segment's index file when it checks out and scans the segment
//! otherwise (in memory only: a reader never writes). Iteration checks every
//! frame again, decompresses and verifies each block, so corruption in a
//! segment whose index was trusted is still reported, when it is reached.
//! [`LogReader::blocks`] hands out verified blocks without decoding them;
//! [`LogReader::iter`] decodes them into events. Seeking by seq or time
//! starts at the nearest index entry (a block) and scans forward; blocks
//! that end before the target are checked but not decompressed.
//! [`LogReader::from_files`] reads the same files from memory through the
//! same code (the fuzz tests use it).

mod block;
mod format;
mod index;
mod reader;
mod scan;
mod snapshot;
mod store;
mod writer;

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use format::{
    FORMAT_VERSION, FRAME_HEADER_LEN, MAX_BLOCK_BYTES, MAX_RECORD_BYTES, SEGMENT_HEADER_LEN,
    SEGMENT_SUFFIX, SegmentHeader, index_file_name, parse_segment_file_name, segment_file_name,
};
pub use index::IndexEntry;
pub use reader::{
    BlockIter, BlockRef, IndexSource, LogInfo, LogIter, LogReader, Record, SeekTo, SegmentInfo,
    SegmentStatus,
};
pub use snapshot::{SNAPSHOT_HEADER_LEN, Snapshot};
pub use writer::{LogWriter, PendingSync};

/// When the writer fsyncs. See the module docs for what each guarantees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// Every record is on stable storage when `append` returns.
    EveryRecord,
    /// Fsync when at least this long has passed since the last fsync,
    /// checked on `append` and `flush`; no background thread.
    Interval(Duration),
    /// Never fsync (not even on rotation or close) unless `sync` is called.
    Never,
    /// Fsync when `sync` is called (and on rotation and close, as
    /// `Interval` does), not on `append` or `flush`; a new segment's
    /// directory entry is synced by the next `sync` rather than at once.
    /// For a caller that makes many logs durable at moments of its own
    /// choosing, such as a fleet recorder syncing every log it wrote
    /// before it acknowledges what they hold (a group commit).
    OnSync,
}

/// Settings of a [`LogWriter`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogConfig {
    /// Stored in every segment header for readers.
    pub schema_version: u32,
    /// The engine whose events the log holds; stored in every header.
    pub engine_id: u64,
    /// A segment is rotated before a block would take it past this size.
    pub segment_bytes: u64,
    /// A block is sealed before its records region (by
    /// [`kvbm_schema::columnar::event_bytes`], an upper bound) would grow past
    /// this size; an event larger than this gets a block of its own, so
    /// `1` gives one event per block; at most [`MAX_RECORD_BYTES`]. Blocks
    /// are also sealed on every flush, sync and rotation, so with
    /// [`FsyncPolicy::EveryRecord`] each block holds one event.
    pub block_bytes: u32,
    /// When to fsync.
    pub fsync: FsyncPolicy,
    /// An index entry at least every this many records.
    pub index_every_records: u32,
    /// An index entry at least every this many bytes of frames.
    pub index_every_bytes: u64,
    /// Capacity of the write buffer.
    pub write_buffer_bytes: usize,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            schema_version: 0,
            engine_id: 0,
            segment_bytes: 64 << 20,
            // Just under 64 KiB, where LZ4's faster 16-bit match table
            // still covers the whole block.
            block_bytes: 60 << 10,
            fsync: FsyncPolicy::Interval(Duration::from_millis(100)),
            index_every_records: 64,
            index_every_bytes: 64 << 10,
            write_buffer_bytes: 256 << 10,
        }
    }
}

impl LogConfig {
    /// Smallest accepted `segment_bytes`.
    pub const MIN_SEGMENT_BYTES: u64 = 128;

    fn validate(&self) -> Result<(), LogError> {
        if self.segment_bytes < Self::MIN_SEGMENT_BYTES {
            return Err(LogError::InvalidConfig(format!(
                "segment_bytes {} is below the minimum {}",
                self.segment_bytes,
                Self::MIN_SEGMENT_BYTES
            )));
        }
        // A block then never holds more than MAX_BLOCK_BYTES: it is sealed
        // before reaching block_bytes unless one record alone exceeds it.
        if self.block_bytes == 0 || self.block_bytes > MAX_RECORD_BYTES {
            return Err(LogError::InvalidConfig(format!(
                "block_bytes {} is not between 1 and {MAX_RECORD_BYTES}",
                self.block_bytes
            )));
        }
        if self.index_every_records == 0 || self.index_every_bytes == 0 {
            return Err(LogError::InvalidConfig(
                "index_every_records and index_every_bytes must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// A writer's counters since it was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LogStats {
    /// Records appended.
    pub records: u64,
    /// Blocks written.
    pub blocks: u64,
    /// Bytes written to segments: block frames plus segment headers (a
    /// block counts when it is sealed).
    pub bytes: u64,
    /// Segments created.
    pub segments: u64,
    /// fsync calls (on segment files, the directory and snapshots).
    pub fsyncs: u64,
}

/// Bytes at the end of the last segment that are not records.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TornTail {
    /// Segment file name.
    pub segment: String,
    /// Where the torn record starts (0: the header itself is torn).
    pub offset: u64,
    /// How many bytes from there to the end of the file.
    pub bytes: u64,
}

/// What [`LogWriter::open_append`] repaired.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RecoveryReport {
    /// The torn tail that was truncated, if any.
    pub truncated: Option<TornTail>,
    /// Last segments removed because they held no complete record.
    pub removed_segments: Vec<String>,
    /// Segments whose missing or unusable index file was rewritten.
    pub indexes_rebuilt: Vec<String>,
    /// Whether the last segment's blocks were decoded and checked before
    /// appending after them: not when its stored index shows it was closed
    /// cleanly (its checksums, which the scan checks, then vouch for them).
    pub last_segment_decoded: bool,
}

/// Why a record or segment is corrupt.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize)]
pub enum CorruptReason {
    /// The segment header is damaged.
    #[error("bad segment header: {0}")]
    BadHeader(String),
    /// The header's first seq is not the one in the file name.
    #[error("the file name says first seq {name}, the header says {header}")]
    NameMismatch {
        /// From the file name.
        name: u64,
        /// From the header.
        header: u64,
    },
    /// The frame extends past the end of the segment.
    #[error("incomplete frame: needs {needed} bytes, {available} remain")]
    Truncated {
        /// Bytes the frame needs (header, or header and body).
        needed: u64,
        /// Bytes left in the segment.
        available: u64,
    },
    /// The length field exceeds [`MAX_BLOCK_BYTES`].
    #[error("frame length {len} exceeds the maximum {max}")]
    TooLarge {
        /// The length field.
        len: u32,
        /// The maximum.
        max: u32,
    },
    /// The frame's checksum does not match.
    #[error("checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    CrcMismatch {
        /// In the frame.
        stored: u32,
        /// Over the bytes read.
        computed: u32,
    },
    /// A whole, checksummed block whose header cannot describe a block, or
    /// whose body does not decompress to records that match it.
    #[error("bad block: {0}")]
    BadBlock(String),
    /// A whole, checksummed block whose first seq does not follow its
    /// predecessor.
    #[error("sequence number {seq} does not follow {prev}")]
    SeqNotIncreasing {
        /// This frame's.
        seq: u64,
        /// The previous record's.
        prev: u64,
    },
    /// The segment's first block does not start with the seq its header
    /// announces.
    #[error("first record has seq {seq}, the segment header says {expected}")]
    FirstSeqMismatch {
        /// The record's.
        seq: u64,
        /// The header's.
        expected: u64,
    },
    /// The frame is sound but the block it holds fails the flatbuffers
    /// verifier or the column checks, or one of its events does not decode.
    #[error("block verification failed: {0}")]
    Verify(String),
}

/// Errors of the durable log.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// An I/O error, with the file or directory it happened on.
    #[error("I/O error on {}: {source}{}", path.display(), too_many_files_hint(source))]
    Io {
        /// File or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Damage in the log: everything before `offset` in `segment` (and in
    /// the segments before it) is readable.
    #[error("corrupt log segment {segment} at byte offset {offset}: {reason}")]
    Corrupt {
        /// Segment file name.
        segment: String,
        /// Byte offset of the bad record (0: the header) in that file.
        offset: u64,
        /// What is wrong.
        reason: CorruptReason,
    },
    /// A segment in a format this build does not read.
    #[error(
        "log segment {segment} has format version {found}; this build reads version {}",
        FORMAT_VERSION
    )]
    UnsupportedVersion {
        /// Segment file name.
        segment: String,
        /// Its version.
        found: u16,
    },
    /// `append` with a seq not greater than the last one; nothing written.
    #[error("sequence number {seq} does not follow the last one in the log, {last}")]
    NonIncreasingSeq {
        /// Refused.
        seq: u64,
        /// The last in the log.
        last: u64,
    },
    /// `append` with an event over [`MAX_RECORD_BYTES`] (by
    /// [`kvbm_schema::columnar::event_bytes`]); nothing written.
    #[error("record of {len} bytes exceeds the maximum of {max}")]
    RecordTooLarge {
        /// Its size by `columnar::event_bytes`, or the block's.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// `create` on a directory that already holds a log.
    #[error(
        "{} already holds a log (segment {segment}): a new recording needs a new or empty \
         directory",
        dir.display()
    )]
    AlreadyExists {
        /// The directory.
        dir: PathBuf,
        /// A segment found there.
        segment: String,
    },
    /// `open_append` with a configuration that disagrees with the log.
    #[error(
        "log segment {segment} was written with {field} {found}, the writer is configured with {expected}"
    )]
    ConfigMismatch {
        /// Segment file name.
        segment: String,
        /// `schema_version` or `engine_id`.
        field: &'static str,
        /// In the segment.
        found: u64,
        /// In the configuration.
        expected: u64,
    },
    /// A [`LogConfig`] that cannot work.
    #[error("invalid log configuration: {0}")]
    InvalidConfig(String),
    /// A snapshot for a record that is not in the log yet.
    #[error("snapshot at seq {seq} is ahead of the log (last seq {last:?})")]
    SnapshotAhead {
        /// Requested.
        seq: u64,
        /// Last in the log.
        last: Option<u64>,
    },
    /// A block handed to [`LogWriter::append_block`] that no reader would
    /// take (its seqs do not increase); nothing was written.
    #[error("block refused: {0}")]
    BadBlock(#[from] kvbm_schema::columnar::BlockError),
    /// The writer failed earlier (or was closed) and accepts nothing more;
    /// reopen the log with `open_append` to recover it.
    #[error("the log writer is unusable: {0}; reopen the log to recover it")]
    Poisoned(String),
}

impl LogError {
    /// For `Corrupt`: the segment and offset.
    pub fn corrupt_at(&self) -> Option<(&str, u64)> {
        match self {
            Self::Corrupt {
                segment, offset, ..
            } => Some((segment.as_str(), *offset)),
            _ => None,
        }
    }
}

/// Settings of a [`LogReader`].
#[derive(Clone, Debug)]
pub struct ReaderOptions {
    /// Use index files that check out (default). With `false` every segment
    /// is scanned on open, so counts are exact and damage anywhere is found
    /// up front, at the cost of reading the whole log.
    pub trust_index: bool,
    /// Spacing of index entries rebuilt in memory.
    pub index_every_records: u32,
    /// Spacing of index entries rebuilt in memory.
    pub index_every_bytes: u64,
    /// Capacity of the read buffer.
    pub read_buffer_bytes: usize,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        let cfg = LogConfig::default();
        Self {
            trust_index: true,
            index_every_records: cfg.index_every_records,
            index_every_bytes: cfg.index_every_bytes,
            read_buffer_bytes: 256 << 10,
        }
    }
}

/// Attaches a path to an I/O error.
fn io_err(path: &Path) -> impl Fn(std::io::Error) -> LogError + '_ {
    move |source| LogError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What to do about `e` when it is the process's limit on open files
/// (`EMFILE`, 24 on Linux and macOS), which a fleet of engines, a log
/// open for each, reaches first.
fn too_many_files_hint(e: &std::io::Error) -> &'static str {
    if cfg!(unix) && e.raw_os_error() == Some(24) {
        " (the limit on open files this process may hold is reached, and a \
         fleet recording keeps one open per engine: raise it, `ulimit -n`)"
    } else {
        ""
    }
}

/// A read buffer no larger than what there is to read: a small segment
/// (or the tail of one) does not need a large allocation.
fn buffer_for(wanted: usize, bytes_to_read: u64) -> usize {
    wanted
        .min(usize::try_from(bytes_to_read).unwrap_or(usize::MAX))
        .max(512)
}

/// The segment files in `dir`, in log order. Other files are ignored.
fn list_segments(dir: &Path) -> Result<Vec<(u64, String)>, LogError> {
    segments_of(&store::Store::Dir(dir.to_path_buf()))
}

/// The segment files of a store, in log order. Other files are ignored.
fn segments_of(store: &store::Store) -> Result<Vec<(u64, String)>, LogError> {
    let mut out: Vec<(u64, String)> = store
        .names()?
        .into_iter()
        .filter_map(|name| Some((parse_segment_file_name(&name)?, name)))
        .collect();
    out.sort();
    Ok(out)
}

/// Makes a directory's entries (a new or renamed file) durable.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::fs::File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        // Directories cannot be opened as files here; rename durability is
        // the file system's.
        let _ = dir;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
