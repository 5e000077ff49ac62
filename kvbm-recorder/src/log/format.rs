//! Byte layouts of segment headers and record frames, and segment file names.
//!
//! Everything here is a pure function on byte slices: no I/O, no allocation
//! driven by a length read from disk. The layouts are described byte by byte
//! in the parent module's documentation; this file is the one place that
//! encodes and decodes them.

use std::time::{SystemTime, UNIX_EPOCH};

/// First eight bytes of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"KVBMLOG\0";
/// The segment format this build writes and reads: 3, compressed blocks of
/// events stored column by column (version 1, one frame per record, and
/// version 2, blocks of one flatbuffers record per event, are not read any
/// more).
pub const FORMAT_VERSION: u16 = 3;
/// Length of a segment header, in bytes.
pub const SEGMENT_HEADER_LEN: u64 = 64;
/// Length of a block frame's fixed header, in bytes.
pub const FRAME_HEADER_LEN: u64 = 48;
/// Largest share of a block one event may take (16 MiB, by
/// [`kvbm_schema::columnar::event_bytes`]), and the largest block the writer
/// fills up to. Checked by the writer before it takes an event.
pub const MAX_RECORD_BYTES: u32 = 16 << 20;
/// Largest records region a block may hold, and largest body a frame may
/// carry: one event of the maximum size and the block's fixed overhead
/// (its table, vtable and column headers, well under 4 KiB). Checked
/// before anything is allocated for a block.
pub const MAX_BLOCK_BYTES: u32 = MAX_RECORD_BYTES + 4096;
/// Extension of segment files.
pub const SEGMENT_SUFFIX: &str = ".kvlog";
/// Extension appended to a segment's file name for its sparse index.
pub const INDEX_SUFFIX: &str = ".idx";
/// Digits in a segment's (and a snapshot's) zero-padded sequence number:
/// enough for every `u64`.
pub const SEQ_DIGITS: usize = 20;

/// The fields of a segment's file header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SegmentHeader {
    /// Segment format version ([`FORMAT_VERSION`] for everything this build
    /// writes).
    pub format_version: u16,
    /// Schema version of the events, as the writer's caller passed it.
    pub schema_version: u32,
    /// The engine whose events the log holds.
    pub engine_id: u64,
    /// Wall-clock creation time of the segment (ns since the Unix epoch);
    /// informational only.
    pub created_unix_ns: u64,
    /// Sequence number of the segment's first record; also its file name.
    pub first_seq: u64,
}

/// Why a segment header was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeaderError {
    /// The file is shorter than a header.
    Truncated {
        len: u64,
    },
    BadMagic,
    /// Checksum does not match.
    BadCrc {
        stored: u32,
        computed: u32,
    },
    /// Declares a header length other than 64.
    BadHeaderLen(u16),
    /// A format version this build does not read.
    Unsupported(u16),
}

impl std::fmt::Display for HeaderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Truncated { len } => {
                write!(
                    f,
                    "file of {len} bytes is shorter than the {SEGMENT_HEADER_LEN}-byte header"
                )
            }
            Self::BadMagic => write!(f, "not a kvbm log segment (bad magic)"),
            Self::BadCrc { stored, computed } => write!(
                f,
                "segment header checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
            ),
            Self::BadHeaderLen(n) => write!(f, "segment header declares {n} bytes, expected 64"),
            Self::Unsupported(v) => write!(f, "unsupported format version {v}"),
        }
    }
}

impl SegmentHeader {
    /// A header of this build's format for a segment created now.
    pub fn new(schema_version: u32, engine_id: u64, first_seq: u64) -> Self {
        let created_unix_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Self {
            format_version: FORMAT_VERSION,
            schema_version,
            engine_id,
            created_unix_ns,
            first_seq,
        }
    }

    pub(crate) fn encode(&self) -> [u8; SEGMENT_HEADER_LEN as usize] {
        let mut b = [0u8; SEGMENT_HEADER_LEN as usize];
        b[0..8].copy_from_slice(&SEGMENT_MAGIC);
        b[8..10].copy_from_slice(&self.format_version.to_le_bytes());
        b[10..12].copy_from_slice(&(SEGMENT_HEADER_LEN as u16).to_le_bytes());
        b[12..16].copy_from_slice(&self.schema_version.to_le_bytes());
        b[16..24].copy_from_slice(&self.engine_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.created_unix_ns.to_le_bytes());
        b[32..40].copy_from_slice(&self.first_seq.to_le_bytes());
        // 40..60 reserved, zero.
        let crc = crc32c::crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; SEGMENT_HEADER_LEN as usize]) -> Result<Self, HeaderError> {
        if b[0..8] != SEGMENT_MAGIC {
            return Err(HeaderError::BadMagic);
        }
        let version = u16_at(b, 8);
        let stored = u32_at(b, 60);
        let computed = crc32c::crc32c(&b[0..60]);
        if version != FORMAT_VERSION {
            // A later version may lay its header out differently, so its
            // checksum cannot be checked here; say what was found.
            return Err(HeaderError::Unsupported(version));
        }
        if stored != computed {
            return Err(HeaderError::BadCrc { stored, computed });
        }
        let header_len = u16_at(b, 10);
        if u64::from(header_len) != SEGMENT_HEADER_LEN {
            return Err(HeaderError::BadHeaderLen(header_len));
        }
        Ok(Self {
            format_version: version,
            schema_version: u32_at(b, 12),
            engine_id: u64_at(b, 16),
            created_unix_ns: u64_at(b, 24),
            first_seq: u64_at(b, 32),
        })
    }

    /// The header's own checksum; ties an index file to this very segment.
    pub(crate) fn crc(&self) -> u32 {
        u32_at(&self.encode(), 60)
    }
}

/// How a block's body is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Codec {
    /// The body is the records region itself (compression did not pay).
    Stored = 0,
    /// The body is the records region compressed as one LZ4 block.
    Lz4 = 1,
}

impl Codec {
    pub(crate) fn from_byte(b: u8) -> Option<Self> {
        match b {
            0 => Some(Self::Stored),
            1 => Some(Self::Lz4),
            _ => None,
        }
    }
}

/// A block frame's fixed header, decoded but not yet checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    /// Bytes of the body on disk.
    pub len: u32,
    pub crc: u32,
    pub first_seq: u64,
    pub last_seq: u64,
    pub min_ts: u64,
    pub max_ts: u64,
    /// Bytes of the records region once decompressed.
    pub raw_len: u32,
    pub count: u16,
    /// The codec byte as found; [`Codec::from_byte`] says whether it is known.
    pub codec: u8,
}

impl FrameHeader {
    /// Encodes a frame header for `body`, computing its checksum. The
    /// caller has checked `body.len() <= MAX_BLOCK_BYTES`.
    pub(crate) fn encode(&self, body: &[u8]) -> [u8; FRAME_HEADER_LEN as usize] {
        let mut b = [0u8; FRAME_HEADER_LEN as usize];
        let len = u32::try_from(body.len()).unwrap_or(u32::MAX);
        b[0..4].copy_from_slice(&len.to_le_bytes());
        b[8..16].copy_from_slice(&self.first_seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.last_seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.min_ts.to_le_bytes());
        b[32..40].copy_from_slice(&self.max_ts.to_le_bytes());
        b[40..44].copy_from_slice(&self.raw_len.to_le_bytes());
        b[44..46].copy_from_slice(&self.count.to_le_bytes());
        b[46] = self.codec;
        // 47 reserved, zero.
        let crc = frame_crc(&b, body);
        b[4..8].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; FRAME_HEADER_LEN as usize]) -> Self {
        Self {
            len: u32_at(b, 0),
            crc: u32_at(b, 4),
            first_seq: u64_at(b, 8),
            last_seq: u64_at(b, 16),
            min_ts: u64_at(b, 24),
            max_ts: u64_at(b, 32),
            raw_len: u32_at(b, 40),
            count: u16_at(b, 44),
            codec: b[46],
        }
    }

    /// Total bytes of the frame on disk.
    pub(crate) fn frame_len(&self) -> u64 {
        FRAME_HEADER_LEN + u64::from(self.len)
    }

    /// Whether the fields of a frame whose checksum matched can describe a
    /// real block; `Err` says which does not. Checked before the body is
    /// decompressed, so that `raw_len` never sizes a buffer unchecked.
    pub(crate) fn check(&self) -> Result<Codec, String> {
        let Some(codec) = Codec::from_byte(self.codec) else {
            return Err(format!("unknown codec {}", self.codec));
        };
        if self.count == 0 {
            return Err("a block of no record".into());
        }
        if self.last_seq < self.first_seq
            || self.last_seq - self.first_seq < u64::from(self.count) - 1
        {
            return Err(format!(
                "{} records cannot span seq {}..={}",
                self.count, self.first_seq, self.last_seq
            ));
        }
        if self.min_ts > self.max_ts {
            return Err(format!(
                "smallest timestamp {} above the largest {}",
                self.min_ts, self.max_ts
            ));
        }
        if self.raw_len > MAX_BLOCK_BYTES {
            return Err(format!(
                "records region of {} bytes exceeds the maximum {MAX_BLOCK_BYTES}",
                self.raw_len
            ));
        }
        let possible = match codec {
            Codec::Stored => self.raw_len == self.len,
            // LZ4 cannot expand a byte of input into more than 255 bytes of
            // output, so a larger claim is damage, refused before anything
            // is allocated for it.
            Codec::Lz4 => u64::from(self.raw_len) <= u64::from(self.len) * 255 + 64,
        };
        if !possible {
            return Err(format!(
                "a body of {} bytes cannot hold a records region of {} bytes",
                self.len, self.raw_len
            ));
        }
        Ok(codec)
    }
}

/// CRC-32C over the frame header without its checksum field (bytes 0..4 and
/// 8..48) followed by the body.
pub(crate) fn frame_crc(header: &[u8; FRAME_HEADER_LEN as usize], body: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&header[0..4]);
    let crc = crc32c::crc32c_append(crc, &header[8..]);
    crc32c::crc32c_append(crc, body)
}

/// `00000000000000000042.kvlog`
pub fn segment_file_name(first_seq: u64) -> String {
    format!("{first_seq:0width$}{SEGMENT_SUFFIX}", width = SEQ_DIGITS)
}

/// `00000000000000000042.kvlog.idx`
pub fn index_file_name(first_seq: u64) -> String {
    format!("{}{INDEX_SUFFIX}", segment_file_name(first_seq))
}

/// The first sequence number named by a segment file name, if `name` is
/// exactly twenty decimal digits and the segment suffix.
pub fn parse_segment_file_name(name: &str) -> Option<u64> {
    parse_seq_digits(name.strip_suffix(SEGMENT_SUFFIX)?)
}

/// Twenty ASCII digits that fit a `u64`.
pub(crate) fn parse_seq_digits(digits: &str) -> Option<u64> {
    if digits.len() != SEQ_DIGITS || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

// Fixed-offset little-endian reads. Callers pass arrays whose length covers
// the offsets (all offsets are compile-time constants within the arrays).
pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[at..at + 2]);
    u16::from_le_bytes(a)
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_damage() {
        let h = SegmentHeader::new(7, 3, 42);
        let b = h.encode();
        assert_eq!(SegmentHeader::decode(&b), Ok(h));
        for i in 0..b.len() {
            let mut d = b;
            d[i] ^= 0x10;
            assert!(
                SegmentHeader::decode(&d).is_err(),
                "flip at byte {i} went unnoticed"
            );
        }
    }

    #[test]
    fn future_version_is_unsupported_not_corrupt() {
        for v in [1u16, 2, 4] {
            // Versions 1 (one frame per record) and 2 (one flatbuffers
            // record per event) are not read any more either.
            let mut b = SegmentHeader::new(1, 1, 0).encode();
            b[8..10].copy_from_slice(&v.to_le_bytes());
            assert_eq!(SegmentHeader::decode(&b), Err(HeaderError::Unsupported(v)));
        }
    }

    fn header() -> FrameHeader {
        FrameHeader {
            len: 0,
            crc: 0,
            first_seq: 5,
            last_seq: 9,
            min_ts: 6,
            max_ts: 60,
            raw_len: 5,
            count: 3,
            codec: Codec::Stored as u8,
        }
    }

    #[test]
    fn frame_crc_covers_every_header_field_and_the_body() {
        let body = b"hello";
        let hb = header().encode(body);
        let good = FrameHeader::decode(&hb);
        assert_eq!(good.len, 5);
        assert_eq!(good.check(), Ok(Codec::Stored));
        assert_eq!(frame_crc(&hb, body), good.crc);
        for i in (0..4).chain(8..FRAME_HEADER_LEN as usize) {
            let mut d = hb;
            d[i] ^= 1;
            assert_ne!(frame_crc(&d, body), good.crc, "byte {i} not covered");
        }
        assert_ne!(frame_crc(&hb, b"hellp"), good.crc);
    }

    #[test]
    fn impossible_block_headers_are_refused() {
        let ok = FrameHeader { len: 5, ..header() };
        assert!(ok.check().is_ok());
        let bad = [
            FrameHeader { codec: 7, ..ok },
            FrameHeader { count: 0, ..ok },
            FrameHeader { last_seq: 4, ..ok },
            FrameHeader { count: 6, ..ok },
            FrameHeader { min_ts: 61, ..ok },
            FrameHeader { raw_len: 6, ..ok },
            FrameHeader {
                raw_len: MAX_BLOCK_BYTES + 1,
                codec: Codec::Lz4 as u8,
                len: u32::MAX,
                ..ok
            },
            // A hostile size claim from a tiny body.
            FrameHeader {
                raw_len: 16 << 20,
                codec: Codec::Lz4 as u8,
                ..ok
            },
        ];
        for h in bad {
            assert!(h.check().is_err(), "{h:?}");
        }
    }

    #[test]
    fn an_all_zero_frame_is_not_valid() {
        // Power loss can leave zero-filled pages at a file's end; they must
        // never read as a record.
        let z = [0u8; FRAME_HEADER_LEN as usize];
        assert_ne!(frame_crc(&z, &[]), FrameHeader::decode(&z).crc);
    }

    #[test]
    fn names() {
        assert_eq!(segment_file_name(0), "00000000000000000000.kvlog");
        assert_eq!(index_file_name(42), "00000000000000000042.kvlog.idx");
        assert_eq!(
            parse_segment_file_name("00000000000000000042.kvlog"),
            Some(42)
        );
        assert_eq!(
            parse_segment_file_name(&segment_file_name(u64::MAX)),
            Some(u64::MAX)
        );
        assert_eq!(parse_segment_file_name("99999999999999999999.kvlog"), None);
        assert_eq!(parse_segment_file_name("0042.kvlog"), None);
        assert_eq!(parse_segment_file_name("0000000000000000004x.kvlog"), None);
        assert_eq!(
            parse_segment_file_name("00000000000000000042.kvlog.idx"),
            None
        );
    }
}
