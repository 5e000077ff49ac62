//! A block's records region: the events of one frame as a columnar
//! flatbuffers `EventBlock` ([`kvbm_schema::columnar`]), compressed, and checked
//! against the frame header when read back.
//!
//! The writer gathers events in a [`BlockBuilder`] and [`compress`]es the
//! finished region when the block is sealed; a reader [`decompress`]es a
//! checked frame's body and [`open`]s the region: the flatbuffers verifier
//! over the whole block, the columns against each other, then every event's
//! sequence number and timestamp against the frame header (count, first and
//! last seq, strictly increasing seqs, timestamp range), so a region that
//! decompressed fine but does not add up is reported, never misread.

use kvbm_events::Event;
use lz4_flex::block::CompressTable;

use super::format::{Codec, FrameHeader};
use kvbm_schema::columnar::{BlockEncoder, BlockView, verify_block};

/// Events gathered for the next block.
#[derive(Debug, Default)]
pub(crate) struct BlockBuilder {
    enc: BlockEncoder,
    first_seq: u64,
    last_seq: u64,
    min_ts: u64,
    max_ts: u64,
}

impl BlockBuilder {
    pub(crate) fn is_empty(&self) -> bool {
        self.enc.is_empty()
    }

    /// Adds an event of `size` bytes by [`kvbm_schema::columnar::event_bytes`]
    /// if it can join the block and keep it within `limit` bytes (see
    /// [`BlockEncoder::try_push`]); false, and nothing added, otherwise. An
    /// empty block takes any event. The caller has checked that its seq
    /// follows the last one's.
    pub(crate) fn try_push(&mut self, ev: &Event, size: usize, limit: usize) -> bool {
        let first = self.enc.is_empty();
        if !self.enc.try_push(ev, size, limit) {
            return false;
        }
        if first {
            self.first_seq = ev.seq;
            self.min_ts = ev.ts_ns;
            self.max_ts = ev.ts_ns;
        } else {
            self.min_ts = self.min_ts.min(ev.ts_ns);
            self.max_ts = self.max_ts.max(ev.ts_ns);
        }
        self.last_seq = ev.seq;
        true
    }

    /// The frame header for the block (checksum and body length are filled
    /// in by [`FrameHeader::encode`]), and its finished records region.
    pub(crate) fn finish(&mut self, codec: Codec) -> (FrameHeader, &[u8]) {
        let count = u16::try_from(self.enc.len()).unwrap_or(u16::MAX);
        let raw = self.enc.finish();
        let h = FrameHeader {
            len: 0,
            crc: 0,
            first_seq: self.first_seq,
            last_seq: self.last_seq,
            min_ts: self.min_ts,
            max_ts: self.max_ts,
            raw_len: u32::try_from(raw.len()).unwrap_or(u32::MAX),
            count,
            codec: codec as u8,
        };
        (h, raw)
    }

    /// Empties the builder, keeping its buffers.
    pub(crate) fn clear(&mut self) {
        self.enc.clear();
    }
}

/// Verifies a block's records region and checks it against its frame
/// header: the event count, the first and last seq, seqs strictly
/// increasing, every timestamp inside the header's range.
pub(crate) fn open<'a>(h: &FrameHeader, region: &'a [u8]) -> Result<BlockView<'a>, OpenError> {
    let view = verify_block(region).map_err(|e| OpenError::Verify(e.to_string()))?;
    let bad = |why: String| Err(OpenError::Header(why));
    if view.len() != usize::from(h.count) {
        return bad(format!(
            "block holds {} events, the header says {}",
            view.len(),
            h.count
        ));
    }
    let span = view.span().map_err(|e| OpenError::Header(e.to_string()))?;
    if span.first_seq != h.first_seq {
        return bad(format!(
            "first event has seq {}, the header says {}",
            span.first_seq, h.first_seq
        ));
    }
    if span.last_seq != h.last_seq {
        return bad(format!(
            "last event has seq {}, the header says {}",
            span.last_seq, h.last_seq
        ));
    }
    if span.min_ts < h.min_ts || span.max_ts > h.max_ts {
        return bad(format!(
            "event timestamps {}..={} outside the block's range {}..={}",
            span.min_ts, span.max_ts, h.min_ts, h.max_ts
        ));
    }
    Ok(view)
}

/// Why a decompressed records region was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OpenError {
    /// The flatbuffers verifier or the column checks refused it.
    Verify(String),
    /// It does not match its frame header.
    Header(String),
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::EventKind;

    fn ev(seq: u64, ts_ns: u64) -> Event {
        Event {
            engine: 0,
            seq,
            ts_ns,
            iteration: seq / 4,
            request: Some("r-1".into()),
            kind: EventKind::TokensScheduled {
                prefill: seq as u32,
                decode: 1,
                computed: 2,
            },
        }
    }

    fn block(events: &[Event]) -> (FrameHeader, Vec<u8>) {
        let mut b = BlockBuilder::default();
        for e in events {
            assert!(b.try_push(e, kvbm_schema::columnar::event_bytes(e), usize::MAX));
        }
        let (h, raw) = b.finish(Codec::Stored);
        (h, raw.to_vec())
    }

    fn read(h: &FrameHeader, raw: &[u8]) -> Result<Vec<Event>, OpenError> {
        let view = open(h, raw)?;
        let mut out = Vec::new();
        view.decode_into(&mut out)
            .map_err(|e| OpenError::Verify(e.to_string()))?;
        Ok(out)
    }

    #[test]
    fn events_round_trip_with_gaps_and_timestamps_going_back() {
        let events = [ev(10, 500), ev(11, 400), ev(15, 40_000), ev(16, 0)];
        let (h, raw) = block(&events);
        assert_eq!((h.count, h.first_seq, h.last_seq), (4, 10, 16));
        assert_eq!((h.min_ts, h.max_ts), (0, 40_000));
        assert_eq!(read(&h, &raw), Ok(events.to_vec()));
    }

    #[test]
    fn a_region_that_disagrees_with_its_header_is_refused() {
        let (h, raw) = block(&[ev(1, 5), ev(2, 6)]);
        let bad_headers = [
            FrameHeader { count: 1, ..h },
            FrameHeader { count: 3, ..h },
            FrameHeader { first_seq: 0, ..h },
            FrameHeader { last_seq: 3, ..h },
            FrameHeader { min_ts: 6, ..h },
            FrameHeader { max_ts: 5, ..h },
        ];
        for bad in bad_headers {
            assert!(
                matches!(read(&bad, &raw), Err(OpenError::Header(_))),
                "{bad:?}"
            );
        }
        for cut in 0..raw.len() {
            assert!(read(&h, &raw[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn compression_falls_back_to_stored_and_round_trips() {
        let mut table = CompressTable::small();
        let mut out = Vec::new();
        assert_eq!(compress(b"abc", &mut out, &mut table), Codec::Stored);
        assert!(out.is_empty());
        let mut b = BlockBuilder::default();
        for i in 0..500u64 {
            let e = ev(i, 1000 + i);
            assert!(b.try_push(&e, kvbm_schema::columnar::event_bytes(&e), usize::MAX));
        }
        let (h, raw) = b.finish(Codec::Lz4);
        let raw = raw.to_vec();
        assert_eq!(compress(&raw, &mut out, &mut table), Codec::Lz4);
        assert!(out.len() * 2 < raw.len());
        let h = FrameHeader {
            len: out.len() as u32,
            ..h
        };
        assert_eq!(h.check(), Ok(Codec::Lz4));
        let mut back = Vec::new();
        decompress(&h, &out, &mut back).unwrap();
        assert_eq!(back, raw);
        assert_eq!(read(&h, &back).map(|v| v.len()), Ok(500));
        // A body that does not decompress, or to another size, is an error.
        let short = FrameHeader {
            raw_len: h.raw_len - 1,
            ..h
        };
        assert!(decompress(&short, &out, &mut back).is_err());
        assert!(decompress(&h, &out[..out.len() / 2], &mut back).is_err());
    }
}
