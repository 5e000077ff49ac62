//! A block's records region: how consecutive records are packed into one
//! frame's body, compressed, and taken apart again.
//!
//! The writer gathers records in a [`BlockBuilder`] and [`compress`]es the
//! region when the block is sealed; a reader [`decompress`]es a checked
//! frame's body and walks it with a [`BlockCursor`]. Each record in the
//! region is three LEB128 varints and the payload:
//!
//! ```text
//! seq delta      seq minus the previous record's (for the first record: minus
//!                the block's first seq, so 0)
//! ts delta       ts_ns minus the previous record's (the first: minus 0),
//!                two's-complement wrapping, zigzag-encoded
//! payload len    at most MAX_RECORD_BYTES
//! payload
//! ```
//!
//! The cursor checks every entry against the frame header (count, first and
//! last seq, timestamp range) and against the bytes left, so a region that
//! decompressed fine but does not add up is reported, never misread.

use lz4_flex::block::CompressTable;

use super::format::{Codec, FrameHeader, MAX_RECORD_BYTES};

/// Most bytes the three varints of one entry can take (10 + 10 + 5).
pub(crate) const ENTRY_HEADER_MAX: usize = 25;

/// Records gathered for the next block.
#[derive(Debug, Default)]
pub(crate) struct BlockBuilder {
    raw: Vec<u8>,
    count: u16,
    first_seq: u64,
    last_seq: u64,
    prev_ts: u64,
    min_ts: u64,
    max_ts: u64,
}

impl BlockBuilder {
    pub(crate) fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub(crate) fn is_full(&self) -> bool {
        self.count == u16::MAX
    }

    /// Bytes of the records region so far.
    pub(crate) fn raw_len(&self) -> usize {
        self.raw.len()
    }

    pub(crate) fn first_seq(&self) -> u64 {
        self.first_seq
    }

    /// Adds a record. The caller has checked that `seq` follows the last
    /// one, that the payload is at most [`MAX_RECORD_BYTES`] and that the
    /// block is not full.
    pub(crate) fn push(&mut self, seq: u64, ts_ns: u64, payload: &[u8]) {
        let seq_delta = if self.count == 0 {
            self.first_seq = seq;
            self.min_ts = ts_ns;
            self.max_ts = ts_ns;
            self.prev_ts = 0;
            0
        } else {
            self.min_ts = self.min_ts.min(ts_ns);
            self.max_ts = self.max_ts.max(ts_ns);
            seq - self.last_seq
        };
        put_varint(&mut self.raw, seq_delta);
        put_varint(&mut self.raw, zigzag(ts_ns.wrapping_sub(self.prev_ts)));
        put_varint(&mut self.raw, payload.len() as u64);
        self.raw.extend_from_slice(payload);
        self.last_seq = seq;
        self.prev_ts = ts_ns;
        self.count += 1;
    }

    /// The frame header for the block (checksum and body length are filled
    /// in by [`FrameHeader::encode`]), and its records region.
    pub(crate) fn header(&self, codec: Codec) -> (FrameHeader, &[u8]) {
        let h = FrameHeader {
            len: 0,
            crc: 0,
            first_seq: self.first_seq,
            last_seq: self.last_seq,
            min_ts: self.min_ts,
            max_ts: self.max_ts,
            raw_len: u32::try_from(self.raw.len()).unwrap_or(u32::MAX),
            count: self.count,
            codec: codec as u8,
        };
        (h, &self.raw)
    }

    /// Empties the builder, keeping its buffer.
    pub(crate) fn clear(&mut self) {
        self.raw.clear();
        self.count = 0;
    }
}

/// Compresses `raw` into `out` and returns the codec to store it with:
/// [`Codec::Stored`] (and `out` left empty; the body is `raw` itself) when
/// compression would not make it smaller, as for a single small record.
pub(crate) fn compress(raw: &[u8], out: &mut Vec<u8>, table: &mut CompressTable) -> Codec {
    out.clear();
    out.resize(lz4_flex::block::get_maximum_output_size(raw.len()), 0);
    match lz4_flex::block::compress_into_with_table(raw, out, table) {
        Ok(n) if n < raw.len() => {
            out.truncate(n);
            Codec::Lz4
        }
        _ => {
            out.clear();
            Codec::Stored
        }
    }
}

/// Decompresses a checked frame's LZ4 body into `raw` (resized to the
/// header's `raw_len`, which [`FrameHeader::check`] has bounded).
pub(crate) fn decompress(h: &FrameHeader, body: &[u8], raw: &mut Vec<u8>) -> Result<(), String> {
    let want = h.raw_len as usize;
    // Reused from block to block: only the length changes, and the bytes are
    // all overwritten by a successful decompression.
    raw.resize(want, 0);
    match lz4_flex::block::decompress_into(body, raw) {
        Ok(n) if n == want => Ok(()),
        Ok(n) => Err(format!(
            "compressed body holds {n} bytes of records, the header says {want}"
        )),
        Err(e) => Err(format!("compressed body does not decompress: {e}")),
    }
}

/// Walks a block's records region, checking each entry.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BlockCursor {
    pos: usize,
    left: u16,
    prev_seq: u64,
    prev_ts: u64,
    first: bool,
    last_seq: u64,
    min_ts: u64,
    max_ts: u64,
}

/// One entry: its seq, timestamp and where its payload lies in the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub seq: u64,
    pub ts_ns: u64,
    pub start: usize,
    pub end: usize,
}

impl BlockCursor {
    pub(crate) fn new(h: &FrameHeader) -> Self {
        Self {
            pos: 0,
            left: h.count,
            prev_seq: h.first_seq,
            prev_ts: 0,
            first: true,
            last_seq: h.last_seq,
            min_ts: h.min_ts,
            max_ts: h.max_ts,
        }
    }

    /// Records not yet read.
    pub(crate) fn left(&self) -> u16 {
        self.left
    }

    /// The next entry of `region`, `Ok(None)` after the last, or why the
    /// region does not match its header.
    #[inline]
    pub(crate) fn next(&mut self, region: &[u8]) -> Result<Option<Entry>, String> {
        if self.left == 0 {
            return Ok(None);
        }
        let seq_delta = get_varint(region, &mut self.pos)?;
        let ts_delta = get_varint(region, &mut self.pos)?;
        let len = get_varint(region, &mut self.pos)?;
        let seq = if self.first {
            if seq_delta != 0 {
                return Err("first record's seq is not the block's first seq".into());
            }
            self.prev_seq
        } else if seq_delta == 0 {
            return Err(format!(
                "sequence does not increase after {}",
                self.prev_seq
            ));
        } else {
            self.prev_seq
                .checked_add(seq_delta)
                .ok_or_else(|| "sequence number overflows".to_string())?
        };
        let ts_ns = self.prev_ts.wrapping_add(unzigzag(ts_delta));
        if ts_ns < self.min_ts || ts_ns > self.max_ts {
            return Err(format!(
                "record timestamp {ts_ns} outside the block's range {}..={}",
                self.min_ts, self.max_ts
            ));
        }
        if len > u64::from(MAX_RECORD_BYTES) || len > (region.len() - self.pos) as u64 {
            return Err(format!(
                "record of {len} bytes overruns the block ({} left)",
                region.len() - self.pos
            ));
        }
        let start = self.pos;
        let end = start + len as usize;
        self.pos = end;
        self.left -= 1;
        self.first = false;
        self.prev_seq = seq;
        self.prev_ts = ts_ns;
        if self.left == 0 {
            if seq != self.last_seq {
                return Err(format!(
                    "last record has seq {seq}, the header says {}",
                    self.last_seq
                ));
            }
            if end != region.len() {
                return Err(format!(
                    "{} bytes after the last record",
                    region.len() - end
                ));
            }
        } else if seq >= self.last_seq {
            return Err(format!(
                "record seq {seq} reaches the block's last seq {} too early",
                self.last_seq
            ));
        }
        Ok(Some(Entry {
            seq,
            ts_ns,
            start,
            end,
        }))
    }
}

fn zigzag(v: u64) -> u64 {
    (v << 1) ^ (((v as i64) >> 63) as u64)
}

fn unzigzag(v: u64) -> u64 {
    (v >> 1) ^ (v & 1).wrapping_neg()
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

#[inline(always)]
fn get_varint(b: &[u8], pos: &mut usize) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let Some(&byte) = b.get(*pos) else {
            return Err("record entry runs past the end of the block".into());
        };
        *pos += 1;
        // The tenth byte may only carry the top bit of a u64.
        if shift == 63 && byte > 1 {
            break;
        }
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("malformed varint in a record entry".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(records: &[(u64, u64, &[u8])]) -> (FrameHeader, Vec<u8>) {
        let mut b = BlockBuilder::default();
        for (seq, ts, p) in records {
            b.push(*seq, *ts, p);
        }
        let (h, raw) = b.header(Codec::Stored);
        (h, raw.to_vec())
    }

    fn read(h: &FrameHeader, raw: &[u8]) -> Result<Vec<(u64, u64, Vec<u8>)>, String> {
        let mut c = BlockCursor::new(h);
        let mut out = Vec::new();
        while let Some(e) = c.next(raw)? {
            out.push((e.seq, e.ts_ns, raw[e.start..e.end].to_vec()));
        }
        Ok(out)
    }

    #[test]
    fn varints_and_zigzag_round_trip() {
        for v in [0, 1, 127, 128, 300, u64::MAX / 2, u64::MAX - 1, u64::MAX] {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            let mut pos = 0;
            assert_eq!(get_varint(&b, &mut pos), Ok(v));
            assert_eq!(pos, b.len());
            assert_eq!(unzigzag(zigzag(v)), v);
        }
        assert_eq!(zigzag(u64::MAX), 1, "-1 is small");
        let mut pos = 0;
        assert!(get_varint(&[0xff; 11], &mut pos).is_err());
        let mut pos = 0;
        assert!(get_varint(&[0x80], &mut pos).is_err());
    }

    #[test]
    fn records_round_trip_with_gaps_and_timestamps_going_back() {
        let recs: [(u64, u64, &[u8]); 4] = [
            (10, 500, b"a"),
            (11, 400, b""),
            (15, u64::MAX, b"ccc"),
            (u64::MAX, 0, b"dd"),
        ];
        let (h, raw) = block(&recs);
        assert_eq!((h.count, h.first_seq, h.last_seq), (4, 10, u64::MAX));
        assert_eq!((h.min_ts, h.max_ts), (0, u64::MAX));
        let got = read(&h, &raw).unwrap();
        let want: Vec<_> = recs.iter().map(|(s, t, p)| (*s, *t, p.to_vec())).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_region_that_disagrees_with_its_header_is_refused() {
        let (h, raw) = block(&[(1, 5, b"xy"), (2, 6, b"z")]);
        let bad_headers = [
            FrameHeader { count: 1, ..h },
            FrameHeader { count: 3, ..h },
            FrameHeader { first_seq: 0, ..h },
            FrameHeader { last_seq: 3, ..h },
            FrameHeader { min_ts: 6, ..h },
            FrameHeader { max_ts: 5, ..h },
        ];
        for bad in bad_headers {
            assert!(read(&bad, &raw).is_err(), "{bad:?}");
        }
        for cut in 0..raw.len() {
            assert!(read(&h, &raw[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = raw.clone();
        longer.push(0);
        assert!(read(&h, &longer).is_err());
    }

    #[test]
    fn compression_falls_back_to_stored_and_round_trips() {
        let mut table = CompressTable::small();
        let mut out = Vec::new();
        assert_eq!(compress(b"abc", &mut out, &mut table), Codec::Stored);
        assert!(out.is_empty());
        let mut b = BlockBuilder::default();
        for i in 0..500u64 {
            b.push(i, 1000 + i, b"a payload that repeats, as events do");
        }
        let (h, raw) = b.header(Codec::Lz4);
        assert_eq!(compress(raw, &mut out, &mut table), Codec::Lz4);
        assert!(out.len() * 4 < raw.len());
        let h = FrameHeader {
            len: out.len() as u32,
            ..h
        };
        assert_eq!(h.check(), Ok(Codec::Lz4));
        let mut back = Vec::new();
        decompress(&h, &out, &mut back).unwrap();
        assert_eq!(back, raw);
        // A body that does not decompress, or to another size, is an error.
        let short = FrameHeader {
            raw_len: h.raw_len - 1,
            ..h
        };
        assert!(decompress(&short, &out, &mut back).is_err());
        assert!(decompress(&h, &out[..out.len() / 2], &mut back).is_err());
    }
}
