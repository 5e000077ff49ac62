//! Sparse per-segment index: which blocks start where, so a reader can
//! jump near a sequence number or a time and scan forward from there.
//!
//! The index is derived data. The writer builds it while appending and stores
//! it beside the segment (`<segment>.idx`) when the segment is sealed or the
//! log closed; a reader that finds it missing, damaged or stale rebuilds it
//! by scanning the segment. Nothing here is ever the source of truth for a
//! record: a reader still checks each frame it reads.

use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::Path;

use super::store::Store;

use super::format::{
    FRAME_HEADER_LEN, FrameHeader, SEGMENT_HEADER_LEN, SegmentHeader, index_file_name, u16_at,
    u32_at, u64_at,
};

const INDEX_MAGIC: [u8; 8] = *b"KVBMIDX\0";
/// 2: entries point at blocks (version-2 segments); 1 pointed at records.
const INDEX_VERSION: u16 = 2;
const INDEX_HEADER_LEN: usize = 88;
const ENTRY_LEN: usize = 32;
/// An index file larger than this is not read (it would describe some eight
/// million entries, far more than any segment the writer produces).
const MAX_INDEX_FILE: u64 = 256 << 20;

/// One sparse index point: the block at `offset` in its segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    /// The sequence number of the block's first record.
    pub seq: u64,
    /// The smallest timestamp in the block.
    pub ts_ns: u64,
    /// The largest `ts_ns` of the records before this block in the same
    /// segment (0 for the first). Seeking by time uses it, so timestamps
    /// need not be monotonic for a time seek to be exact.
    pub ts_max_before: u64,
    /// Byte offset of the block's frame in the segment file.
    pub offset: u64,
}

/// The last block of a segment (its last seq, offset and checksum), so an
/// index file can be checked against the segment it describes without
/// scanning it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LastRecord {
    pub seq: u64,
    pub offset: u64,
    pub crc: u32,
}

/// Summary and sparse entries of one segment's good records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SegmentIndex {
    pub records: u64,
    /// End of the last good block (the header's end when there is none).
    pub valid_len: u64,
    pub last: Option<LastRecord>,
    pub min_ts: u64,
    pub max_ts: u64,
    pub entries: Vec<IndexEntry>,
}

impl SegmentIndex {
    pub(crate) fn empty() -> Self {
        Self {
            records: 0,
            valid_len: SEGMENT_HEADER_LEN,
            last: None,
            min_ts: 0,
            max_ts: 0,
            entries: Vec::new(),
        }
    }

    /// The entry to start a scan from for the first record with
    /// `seq >= target`: the last entry whose first seq is `<= target`.
    pub(crate) fn start_for_seq(&self, target: u64) -> Option<&IndexEntry> {
        let n = self.entries.partition_point(|e| e.seq <= target);
        self.entries.get(n.checked_sub(1)?)
    }

    /// The entry to start a scan from for the first record (in log order)
    /// with `ts_ns >= target`: the last entry before which every record of
    /// the segment is older than `target`. The first entry always qualifies.
    pub(crate) fn start_for_time(&self, target: u64) -> Option<&IndexEntry> {
        let rest = self.entries.get(1..)?;
        let n = rest.partition_point(|e| e.ts_max_before < target);
        self.entries.get(n)
    }
}

/// Builds a [`SegmentIndex`] block by block, taking an entry for the first
/// block and then for the first block that starts at least `every_records`
/// records or `every_bytes` bytes after the previous entry.
#[derive(Debug)]
pub(crate) struct IndexBuilder {
    every_records: u64,
    every_bytes: u64,
    since_records: u64,
    since_bytes: u64,
    index: SegmentIndex,
}

impl IndexBuilder {
    pub(crate) fn new(every_records: u32, every_bytes: u64) -> Self {
        Self {
            every_records: u64::from(every_records.max(1)),
            every_bytes: every_bytes.max(1),
            since_records: 0,
            since_bytes: 0,
            index: SegmentIndex::empty(),
        }
    }

    pub(crate) fn push(&mut self, h: &FrameHeader, offset: u64) {
        let idx = &mut self.index;
        if idx.records == 0
            || self.since_records >= self.every_records
            || self.since_bytes >= self.every_bytes
        {
            idx.entries.push(IndexEntry {
                seq: h.first_seq,
                ts_ns: h.min_ts,
                ts_max_before: if idx.records == 0 { 0 } else { idx.max_ts },
                offset,
            });
            self.since_records = 0;
            self.since_bytes = 0;
        }
        self.since_records += u64::from(h.count);
        self.since_bytes += h.frame_len();
        if idx.records == 0 {
            idx.min_ts = h.min_ts;
            idx.max_ts = h.max_ts;
        } else {
            idx.min_ts = idx.min_ts.min(h.min_ts);
            idx.max_ts = idx.max_ts.max(h.max_ts);
        }
        idx.records += u64::from(h.count);
        idx.valid_len = offset + h.frame_len();
        idx.last = Some(LastRecord {
            seq: h.last_seq,
            offset,
            crc: h.crc,
        });
    }

    pub(crate) fn index(&self) -> &SegmentIndex {
        &self.index
    }

    pub(crate) fn finish(self) -> SegmentIndex {
        self.index
    }
}

/// Encodes an index file (layout in the parent module's docs).
pub(crate) fn encode(header: &SegmentHeader, idx: &SegmentIndex) -> Vec<u8> {
    let mut b = Vec::with_capacity(INDEX_HEADER_LEN + idx.entries.len() * ENTRY_LEN + 4);
    b.extend_from_slice(&INDEX_MAGIC);
    b.extend_from_slice(&INDEX_VERSION.to_le_bytes());
    b.extend_from_slice(&0u16.to_le_bytes());
    let count = u32::try_from(idx.entries.len()).unwrap_or(u32::MAX);
    b.extend_from_slice(&count.to_le_bytes());
    b.extend_from_slice(&header.first_seq.to_le_bytes());
    b.extend_from_slice(&header.crc().to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&idx.valid_len.to_le_bytes());
    b.extend_from_slice(&idx.records.to_le_bytes());
    let last = idx.last.unwrap_or(LastRecord {
        seq: 0,
        offset: 0,
        crc: 0,
    });
    b.extend_from_slice(&last.seq.to_le_bytes());
    b.extend_from_slice(&last.offset.to_le_bytes());
    b.extend_from_slice(&last.crc.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&idx.min_ts.to_le_bytes());
    b.extend_from_slice(&idx.max_ts.to_le_bytes());
    debug_assert_eq!(b.len(), INDEX_HEADER_LEN);
    for e in idx.entries.iter().take(count as usize) {
        b.extend_from_slice(&e.seq.to_le_bytes());
        b.extend_from_slice(&e.ts_ns.to_le_bytes());
        b.extend_from_slice(&e.ts_max_before.to_le_bytes());
        b.extend_from_slice(&e.offset.to_le_bytes());
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// Decodes and checks an index file's bytes against the segment it claims
/// to describe. `Err` says why it cannot be used; the caller then rebuilds.
pub(crate) fn decode(
    b: &[u8],
    header: &SegmentHeader,
    segment_len: u64,
) -> Result<SegmentIndex, String> {
    if b.len() < INDEX_HEADER_LEN + 4 {
        return Err(format!("{} bytes is too short", b.len()));
    }
    if b[0..8] != INDEX_MAGIC {
        return Err("bad magic".into());
    }
    let version = u16_at(b, 8);
    if version != INDEX_VERSION {
        return Err(format!("unsupported index version {version}"));
    }
    let count = u32_at(b, 12) as usize;
    // Check the length the count implies before trusting the count.
    let expected = count
        .checked_mul(ENTRY_LEN)
        .and_then(|n| n.checked_add(INDEX_HEADER_LEN + 4));
    if expected != Some(b.len()) {
        return Err(format!(
            "{count} entries do not fit a {}-byte file",
            b.len()
        ));
    }
    let body = &b[..b.len() - 4];
    let stored = u32_at(b, b.len() - 4);
    let computed = crc32c::crc32c(body);
    if stored != computed {
        return Err(format!(
            "checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
        ));
    }
    if u64_at(b, 16) != header.first_seq || u32_at(b, 24) != header.crc() {
        return Err("describes a different segment".into());
    }
    let valid_len = u64_at(b, 32);
    if valid_len != segment_len {
        return Err(format!(
            "covers {valid_len} bytes but the segment has {segment_len} (stale)"
        ));
    }
    let records = u64_at(b, 40);
    let last = LastRecord {
        seq: u64_at(b, 48),
        offset: u64_at(b, 56),
        crc: u32_at(b, 64),
    };
    let (min_ts, max_ts) = (u64_at(b, 72), u64_at(b, 80));
    let mut entries = Vec::with_capacity(count);
    for i in 0..count {
        let e = &body[INDEX_HEADER_LEN + i * ENTRY_LEN..][..ENTRY_LEN];
        entries.push(IndexEntry {
            seq: u64_at(e, 0),
            ts_ns: u64_at(e, 8),
            ts_max_before: u64_at(e, 16),
            offset: u64_at(e, 24),
        });
    }
    let idx = SegmentIndex {
        records,
        valid_len,
        last: (records > 0).then_some(last),
        min_ts,
        max_ts,
        entries,
    };
    check_consistent(&idx, header)?;
    Ok(idx)
}

/// Structural checks, so that a damaged-but-checksummed index can never send
/// a reader outside the segment or backwards.
fn check_consistent(idx: &SegmentIndex, header: &SegmentHeader) -> Result<(), String> {
    let Some(last) = idx.last else {
        return if idx.entries.is_empty() && idx.valid_len == SEGMENT_HEADER_LEN {
            Ok(())
        } else {
            Err("an empty segment with entries or data".into())
        };
    };
    let Some(first) = idx.entries.first() else {
        return Err("records but no entries".into());
    };
    if first.offset != SEGMENT_HEADER_LEN || first.seq != header.first_seq {
        return Err("first entry is not the segment's first record".into());
    }
    if idx.records < idx.entries.len() as u64 {
        return Err("more entries than records".into());
    }
    for w in idx.entries.windows(2) {
        if w[1].seq <= w[0].seq
            || w[1].offset <= w[0].offset
            || w[1].ts_max_before < w[0].ts_max_before
        {
            return Err("entries out of order".into());
        }
    }
    let max_entry_offset = idx.entries.last().map_or(0, |e| e.offset);
    let last_end = last.offset.checked_add(FRAME_HEADER_LEN);
    if last.offset < max_entry_offset || last_end.is_none_or(|e| e > idx.valid_len) {
        return Err("last record outside the segment".into());
    }
    if idx.entries.last().is_some_and(|e| e.seq > last.seq) || idx.min_ts > idx.max_ts {
        return Err("summary contradicts entries".into());
    }
    Ok(())
}

/// Loads `<segment>.idx` for a segment and checks it against the segment's
/// header, its length and its last frame. `Ok(Err(why))` when it is absent or
/// unusable; `Err` only for an I/O error on the segment itself.
pub(crate) fn load<R: Read + Seek>(
    store: &Store,
    header: &SegmentHeader,
    segment_len: u64,
    segment: &mut R,
) -> io::Result<Result<SegmentIndex, String>> {
    let bytes = match store.read_small(&index_file_name(header.first_seq), MAX_INDEX_FILE) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Err("missing".into())),
        Err(e) => return Ok(Err(format!("unreadable: {e}"))),
    };
    let idx = match decode(&bytes, header, segment_len) {
        Ok(idx) => idx,
        Err(why) => return Ok(Err(why)),
    };
    // The last block must be on disk exactly as the index remembers it;
    // this catches an index left over from an earlier life of the segment.
    if let Some(last) = idx.last {
        let mut h = [0u8; FRAME_HEADER_LEN as usize];
        segment.seek(SeekFrom::Start(last.offset))?;
        segment.read_exact(&mut h)?;
        let f = FrameHeader::decode(&h);
        if f.last_seq != last.seq
            || f.crc != last.crc
            || last.offset + f.frame_len() != idx.valid_len
        {
            return Ok(Err("last block does not match the segment".into()));
        }
    }
    Ok(Ok(idx))
}

/// Writes `<segment>.idx` atomically (temporary file, then rename). Not
/// fsynced: the index is derived, and a reader rebuilds one that did not
/// survive a crash.
pub(crate) fn store(dir: &Path, header: &SegmentHeader, idx: &SegmentIndex) -> io::Result<()> {
    let path = dir.join(index_file_name(header.first_seq));
    let tmp = dir.join(format!("{}.tmp", index_file_name(header.first_seq)));
    let mut f = File::create(&tmp)?;
    f.write_all(&encode(header, idx))?;
    drop(f);
    fs::rename(&tmp, &path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-record block's frame header with a body of `len` bytes.
    fn frame(seq: u64, ts: u64, len: usize) -> FrameHeader {
        let h = FrameHeader {
            len: 0,
            crc: 0,
            first_seq: seq,
            last_seq: seq,
            min_ts: ts,
            max_ts: ts,
            raw_len: len as u32,
            count: 1,
            codec: 0,
        };
        FrameHeader::decode(&h.encode(&vec![7u8; len]))
    }

    fn build(n: u64, every: u32) -> (SegmentHeader, SegmentIndex) {
        let header = SegmentHeader::new(1, 2, 10);
        let mut b = IndexBuilder::new(every, u64::MAX);
        let mut off = SEGMENT_HEADER_LEN;
        for i in 0..n {
            let f = frame(10 + i * 2, 1000 + i, 5);
            b.push(&f, off);
            off += f.frame_len();
        }
        (header, b.finish())
    }

    #[test]
    fn entries_every_n_records_and_the_first() {
        let (_, idx) = build(10, 4);
        let seqs: Vec<u64> = idx.entries.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![10, 18, 26]);
        assert_eq!(idx.records, 10);
        assert_eq!((idx.min_ts, idx.max_ts), (1000, 1009));
        assert_eq!(idx.entries[1].ts_max_before, 1003);
    }

    #[test]
    fn entries_every_k_bytes() {
        let mut b = IndexBuilder::new(u32::MAX, 100);
        let mut off = SEGMENT_HEADER_LEN;
        for i in 0..10 {
            let f = frame(i, i, 2); // 50-byte frames: an entry every 2 records
            b.push(&f, off);
            off += f.frame_len();
        }
        assert_eq!(b.index().entries.len(), 5);
    }

    #[test]
    fn start_points() {
        let (_, idx) = build(10, 4);
        assert_eq!(idx.start_for_seq(9), None);
        assert_eq!(idx.start_for_seq(10).map(|e| e.seq), Some(10));
        assert_eq!(idx.start_for_seq(17).map(|e| e.seq), Some(10));
        assert_eq!(idx.start_for_seq(18).map(|e| e.seq), Some(18));
        assert_eq!(idx.start_for_seq(1000).map(|e| e.seq), Some(26));
        assert_eq!(idx.start_for_time(0).map(|e| e.seq), Some(10));
        assert_eq!(idx.start_for_time(1004).map(|e| e.seq), Some(18));
        assert_eq!(idx.start_for_time(1003).map(|e| e.seq), Some(10));
    }

    #[test]
    fn file_round_trip_and_damage_is_refused() {
        let (header, idx) = build(10, 4);
        let bytes = encode(&header, &idx);
        assert_eq!(decode(&bytes, &header, idx.valid_len), Ok(idx.clone()));
        assert!(
            decode(&bytes, &header, idx.valid_len + 1).is_err(),
            "stale length"
        );
        for i in 0..bytes.len() {
            let mut d = bytes.clone();
            d[i] ^= 0x40;
            assert!(decode(&d, &header, idx.valid_len).is_err(), "flip at {i}");
        }
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut], &header, idx.valid_len).is_err());
        }
        let other = SegmentHeader::new(1, 2, 10);
        if other.created_unix_ns != header.created_unix_ns {
            assert!(
                decode(&bytes, &other, idx.valid_len).is_err(),
                "other segment"
            );
        }
    }
}
