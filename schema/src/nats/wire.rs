//! One NATS message: a batch of one engine's consecutive events.
//!
//! The body is the durable log's columnar block
//! ([`columnar`](crate::columnar)), LZ4-compressed like the log's, so a batch
//! costs about what the log costs per event (12 bytes) and a recorder
//! checks it with the same verifier. In front of it, a fixed header (all
//! integers little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `KVBN` |
//! | 4..6 | version, `u16` = 1 |
//! | 6 | codec: 0 the body is the block, 1 the block compressed as one LZ4 block |
//! | 7 | reserved, zero |
//! | 8..16 | run: the publisher's incarnation (a restarted engine starts its seqs again under a new run) |
//! | 16..24 | first seq |
//! | 24..32 | last seq |
//! | 32..36 | event count, at least 1 |
//! | 36..40 | length of the block once decompressed, at most [`MAX_BLOCK_BYTES`] |
//! | 40..48 | events of this run the publisher dropped before this batch (cumulative: the tap overflowing, the buffer overflowing while NATS was out of reach), at most first seq |
//! | 48.. | body |
//!
//! The header's seqs and count are checked against the block's own
//! columns, and its declared losses against its first seq (a run's seqs
//! start at 0, so no more than `first seq` events can have been dropped
//! before it), so a consumer may trust them once [`decode`] (or
//! [`check`]) has accepted the message. The message id is
//! [`message_id`]`(engine, run, first seq)`.

use crate::columnar::{
    BlockEncoder, BlockError, BlockSpan, CheckedBlock, MAX_BLOCK_EVENTS, verify_block,
};
use kvbm_events::Event;

/// First four bytes of a batch.
pub const MAGIC: [u8; 4] = *b"KVBN";
/// The version written and read.
pub const VERSION: u16 = 1;
/// Header bytes before the body.
pub const HEADER_BYTES: usize = 48;
/// Largest decompressed block accepted (the log's own limit is higher; a
/// batch is sealed well below this).
pub const MAX_BLOCK_BYTES: usize = 4 << 20;

/// The fixed header of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    /// The publisher's incarnation.
    pub run: u64,
    /// First seq in the batch.
    pub first_seq: u64,
    /// Last seq in the batch.
    pub last_seq: u64,
    /// Events in the batch.
    pub count: u32,
    /// Events of this run the publisher dropped before this batch (seqs
    /// below `first_seq`, so at most `first_seq`).
    pub dropped_before: u64,
}

/// The JetStream message id of a batch: JetStream drops a second message
/// with the same id inside the stream's duplicate window.
pub fn message_id(engine: &str, run: u64, first_seq: u64) -> String {
    format!("{engine}:{run:016x}:{first_seq}")
}

/// Why bytes are not a batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Shorter than the header.
    #[error("batch too short: {len} bytes, the header alone is {HEADER_BYTES}")]
    TooShort {
        /// Its length.
        len: usize,
    },
    /// Not `KVBN`.
    #[error("not a kvbm batch (magic {found:?})")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// A version this build does not read.
    #[error("batch version {found}, this build reads version {VERSION}")]
    Version {
        /// The version found.
        found: u16,
    },
    /// An unknown codec byte.
    #[error("unknown batch codec {0}")]
    Codec(u8),
    /// The stated block length is out of range.
    #[error("stated block length {0} is out of range (at most {MAX_BLOCK_BYTES})")]
    BlockLength(u32),
    /// LZ4 refused the body, or it did not expand to the stated length.
    #[error("batch body does not decompress: {0}")]
    Decompress(String),
    /// The block itself is bad.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// The header declares more events dropped before the batch than
    /// there are seqs before it. Refused rather than clamped: a header
    /// that contradicts itself comes from a broken or lying publisher, and
    /// a consumer keeps the largest declaration of a run, so one accepted
    /// would explain away every later hole of that engine.
    #[error(
        "batch header declares {dropped_before} events dropped before seq {first_seq}: at most \
         {first_seq} can be (a run's seqs start at 0)"
    )]
    DroppedBeforeFirst {
        /// Header's declared losses.
        dropped_before: u64,
        /// Header's first seq.
        first_seq: u64,
    },
    /// The header does not agree with the block.
    #[error("batch header says seqs {first}..={last} ({count} events), its block holds {found}")]
    Mismatch {
        /// Header's first seq.
        first: u64,
        /// Header's last seq.
        last: u64,
        /// Header's count.
        count: u32,
        /// What the block holds, described.
        found: String,
    },
}

/// Builds batches; keeps its buffers from one batch to the next.
pub struct BatchEncoder {
    block: BlockEncoder,
    first: Option<u64>,
    last: u64,
    compress: bool,
}

impl std::fmt::Debug for BatchEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchEncoder")
            .field("events", &self.block.len())
            .finish_non_exhaustive()
    }
}

impl Default for BatchEncoder {
    fn default() -> Self {
        Self::new(true)
    }
}

impl BatchEncoder {
    /// An encoder; `compress` turns LZ4 on.
    pub fn new(compress: bool) -> Self {
        BatchEncoder {
            block: BlockEncoder::new(),
            first: None,
            last: 0,
            compress,
        }
    }

    /// Events in the batch being built.
    pub fn len(&self) -> usize {
        if self.first.is_some() {
            self.block.len()
        } else {
            0
        }
    }

    /// True when nothing is in the batch.
    pub fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    /// Approximate block bytes so far.
    pub fn approx_bytes(&self) -> usize {
        if self.first.is_some() {
            self.block.approx_bytes()
        } else {
            0
        }
    }

    /// Adds `ev` (seqs must increase), or returns false when it does not
    /// fit within `limit` block bytes: seal and push it again. An empty
    /// batch takes any event.
    pub fn push(&mut self, ev: &Event, limit: usize) -> bool {
        if self.first.is_some_and(|_| ev.seq <= self.last) {
            // Out of order: the block's columns cannot say it. Seal first.
            return false;
        }
        let size = crate::columnar::event_bytes(ev);
        let limit = limit.min(MAX_BLOCK_BYTES - 4096);
        let ok = self.block.len() < MAX_BLOCK_EVENTS && self.block.try_push(ev, size, limit);
        if ok || self.first.is_none() {
            if self.first.is_none() {
                // `try_push` on an empty (or finished) encoder starts a new
                // block and always succeeds.
                debug_assert!(ok);
                self.first = Some(ev.seq);
            }
            self.last = ev.seq;
        }
        ok
    }

    /// Seals the batch into `out` (cleared first) with the given run and
    /// declared losses; returns its header, or `None` when empty.
    pub fn seal(
        &mut self,
        run: u64,
        dropped_before: u64,
        out: &mut Vec<u8>,
    ) -> Option<BatchHeader> {
        let first = self.first.take()?;
        let count = self.block.len() as u32;
        let block = self.block.finish();
        let header = BatchHeader {
            run,
            first_seq: first,
            last_seq: self.last,
            count,
            dropped_before,
        };
        out.clear();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.push(u8::from(self.compress));
        out.push(0);
        out.extend_from_slice(&run.to_le_bytes());
        out.extend_from_slice(&first.to_le_bytes());
        out.extend_from_slice(&self.last.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
        out.extend_from_slice(&(block.len() as u32).to_le_bytes());
        out.extend_from_slice(&dropped_before.to_le_bytes());
        if self.compress {
            let start = out.len();
            out.resize(
                start + lz4_flex::block::get_maximum_output_size(block.len()),
                0,
            );
            // Cannot fail: the output has the maximum size LZ4 can need.
            let n = lz4_flex::block::compress_into(block, &mut out[start..]).unwrap_or(0);
            out.truncate(start + n);
        } else {
            out.extend_from_slice(block);
        }
        Some(header)
    }
}

/// Rewrites the declared losses of a sealed batch (the publisher learns of
/// buffer drops only when it sends).
pub fn set_dropped_before(batch: &mut [u8], dropped_before: u64) {
    if batch.len() >= HEADER_BYTES {
        batch[40..48].copy_from_slice(&dropped_before.to_le_bytes());
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

/// Reads a batch's header without checking its body (only the header
/// against itself: its declared losses against its first seq).
pub fn header(bytes: &[u8]) -> Result<BatchHeader, WireError> {
    if bytes.len() < HEADER_BYTES {
        return Err(WireError::TooShort { len: bytes.len() });
    }
    let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
    if magic != MAGIC {
        return Err(WireError::BadMagic { found: magic });
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != VERSION {
        return Err(WireError::Version { found: version });
    }
    let h = BatchHeader {
        run: u64_at(bytes, 8),
        first_seq: u64_at(bytes, 16),
        last_seq: u64_at(bytes, 24),
        count: u32_at(bytes, 32),
        dropped_before: u64_at(bytes, 40),
    };
    // What the publisher dropped before the batch had seqs below its
    // first: a declaration past that cannot be true.
    if h.dropped_before > h.first_seq {
        return Err(WireError::DroppedBeforeFirst {
            dropped_before: h.dropped_before,
            first_seq: h.first_seq,
        });
    }
    Ok(h)
}

/// A batch whose block passed every check a reader of the log makes: the
/// flatbuffers verifier, the columns against each other and against the
/// header, every event's values ([`check`]).
#[derive(Debug, Clone, Copy)]
pub struct Checked<'a> {
    /// Its header, which agrees with the block.
    pub header: BatchHeader,
    /// The block, with its span.
    pub block: CheckedBlock<'a>,
    /// The body as received when it is the block compressed with LZ4 (the
    /// log's own codec): a recorder keeps it without compressing again.
    pub lz4: Option<&'a [u8]>,
}

/// A batch's header, its block, and its body when that is the block
/// compressed.
struct Opened<'a> {
    header: BatchHeader,
    block: &'a [u8],
    lz4: Option<&'a [u8]>,
}

/// The block of a batch: `bytes`' body, or what it decompresses to in
/// `scratch`.
fn open<'a>(bytes: &'a [u8], scratch: &'a mut Vec<u8>) -> Result<Opened<'a>, WireError> {
    let header = header(bytes)?;
    let raw_len = u32_at(bytes, 36);
    if raw_len as usize > MAX_BLOCK_BYTES || raw_len == 0 {
        return Err(WireError::BlockLength(raw_len));
    }
    let n = raw_len as usize;
    let body = &bytes[HEADER_BYTES..];
    let (block, lz4) = match bytes[6] {
        0 if body.len() == n => (body, None),
        0 => return Err(WireError::BlockLength(raw_len)),
        1 => {
            // Only growth is zeroed: a decompression of the stated length
            // (checked below) overwrites every byte.
            scratch.resize(n, 0);
            let got = lz4_flex::block::decompress_into(body, scratch)
                .map_err(|e| WireError::Decompress(e.to_string()))?;
            if got != n {
                return Err(WireError::Decompress(format!(
                    "{got} bytes, the header says {raw_len}"
                )));
            }
            (&scratch[..], Some(body))
        }
        c => return Err(WireError::Codec(c)),
    };
    Ok(Opened { header, block, lz4 })
}

/// Holds the header to the block: the same count, the same first and last
/// seq.
fn against_header(h: &BatchHeader, count: usize, span: &BlockSpan) -> Result<(), WireError> {
    let mismatch = |found: String| WireError::Mismatch {
        first: h.first_seq,
        last: h.last_seq,
        count: h.count,
        found,
    };
    if count != h.count as usize {
        return Err(mismatch(format!("{count} events")));
    }
    if span.first_seq != h.first_seq || span.last_seq != h.last_seq {
        return Err(mismatch(format!(
            "seqs {}..={}",
            span.first_seq, span.last_seq
        )));
    }
    Ok(())
}

/// Checks a batch whole without decoding its events: what [`decode`]
/// refuses, this refuses, so a consumer that keeps the block as it is
/// (the fleet recorder) never keeps one a reader of its log would refuse.
/// The block is decompressed into `scratch` when needed.
pub fn check<'a>(bytes: &'a [u8], scratch: &'a mut Vec<u8>) -> Result<Checked<'a>, WireError> {
    let Opened { header, block, lz4 } = open(bytes, scratch)?;
    let block = CheckedBlock::check(block)?;
    against_header(&header, block.len(), &block.span())?;
    Ok(Checked { header, block, lz4 })
}

/// Checks and decodes a batch into its header and events.
pub fn decode(bytes: &[u8]) -> Result<(BatchHeader, Vec<Event>), WireError> {
    let mut scratch = Vec::new();
    let Opened { header, block, .. } = open(bytes, &mut scratch)?;
    let view = verify_block(block)?;
    against_header(&header, view.len(), &view.span()?)?;
    let mut events = Vec::with_capacity(view.len());
    view.decode_into(&mut events)?;
    Ok((header, events))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::testing::event as arb_event;
    use proptest::prelude::*;

    fn encode(events: &[Event], run: u64, dropped: u64, compress: bool) -> Vec<Vec<u8>> {
        let mut enc = BatchEncoder::new(compress);
        let mut out = Vec::new();
        let mut buf = Vec::new();
        for ev in events {
            if !enc.push(ev, 60 << 10) {
                enc.seal(run, dropped, &mut buf).unwrap();
                out.push(buf.clone());
                assert!(enc.push(ev, 60 << 10));
            }
        }
        if enc.seal(run, dropped, &mut buf).is_some() {
            out.push(buf.clone());
        }
        out
    }

    fn renumber(mut events: Vec<Event>) -> Vec<Event> {
        let mut seq = 0;
        for e in &mut events {
            seq += 1 + e.seq % 3; // increasing, with small holes
            e.seq = seq;
        }
        events
    }

    proptest! {
        // Bounded: a few hundred random batches are plenty for a codec
        // whose block layer has its own property tests.
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn batches_decode_to_what_was_encoded(
            events in proptest::collection::vec(arb_event(), 1..100).prop_map(renumber),
            run in any::<u64>(),
            dropped in any::<u64>(),
            compress in any::<bool>(),
        ) {
            // Anything a publisher can truly declare: at most the seqs
            // before the first batch (and so before every later one).
            let dropped = dropped % (events[0].seq + 1);
            let batches = encode(&events, run, dropped, compress);
            let mut back = Vec::new();
            for b in &batches {
                let (h, evs) = decode(b).unwrap();
                prop_assert_eq!(h.run, run);
                prop_assert_eq!(h.dropped_before, dropped);
                prop_assert_eq!(h.first_seq, evs[0].seq);
                prop_assert_eq!(h.last_seq, evs.last().unwrap().seq);
                prop_assert_eq!(h.count as usize, evs.len());
                back.extend(evs);
            }
            prop_assert_eq!(back, events);
        }

        /// Any byte changed, any cut, any garbage: an error or a batch whose
        /// header agrees with its block, never a panic.
        #[test]
        fn damaged_batches_are_refused_not_panicked_on(
            events in proptest::collection::vec(arb_event(), 1..50).prop_map(renumber),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
            cut in any::<prop::sample::Index>(),
            compress in any::<bool>(),
        ) {
            let mut b = encode(&events, 1, 0, compress).remove(0);
            for (i, v) in &flips {
                let at = i.index(b.len());
                b[at] ^= v | 1;
            }
            // What the recorder keeps without decoding (`check`) is
            // exactly what a reader can decode.
            let mut scratch = Vec::new();
            let checked = check(&b, &mut scratch).map(|c| (c.header, c.block.span()));
            match decode(&b) {
                Ok((h, evs)) => {
                    prop_assert_eq!(h.count as usize, evs.len());
                    prop_assert_eq!(h.first_seq, evs[0].seq);
                    let (ch, span) = checked.expect("decode accepted what check refused");
                    prop_assert_eq!(ch, h);
                    prop_assert_eq!(span.last_seq, evs.last().unwrap().seq);
                    prop_assert_eq!(span.min_ts, evs.iter().map(|e| e.ts_ns).min().unwrap());
                    prop_assert_eq!(span.max_ts, evs.iter().map(|e| e.ts_ns).max().unwrap());
                }
                Err(e) => prop_assert!(checked.is_err(), "check accepted what decode refused: {e}"),
            }
            let n = cut.index(b.len());
            let _ = decode(&b[..n]);
            let _ = check(&b[..n], &mut scratch);
        }

        #[test]
        fn random_bytes_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode(&bytes);
            let mut b = bytes.clone();
            if b.len() >= 8 {
                b[..4].copy_from_slice(&MAGIC);
                b[4..6].copy_from_slice(&VERSION.to_le_bytes());
            }
            let _ = decode(&b);
        }
    }

    /// A block the flatbuffers verifier accepts but whose values make no
    /// event (an out-of-range enum byte) is refused by `check` as by
    /// `decode`: the recorder never keeps what a reader would refuse.
    #[test]
    fn a_value_no_event_can_have_is_refused_without_decoding() {
        let events: Vec<Event> = (0..4)
            .map(|i| Event {
                engine: 0,
                seq: i,
                ts_ns: i,
                iteration: 0,
                request: None,
                kind: kvbm_events::EventKind::SlotTransition {
                    from: kvbm_events::SlotState::Prefilling,
                    to: kvbm_events::SlotState::Decoding,
                },
            })
            .collect();
        let good = encode(&events, 1, 0, false).remove(0);
        let mut value_errors = 0;
        for at in HEADER_BYTES..good.len() {
            let mut b = good.clone();
            b[at] = 0xEE;
            if let Err(WireError::Block(BlockError::Event { .. })) = decode(&b) {
                value_errors += 1;
                let mut scratch = Vec::new();
                let e = check(&b, &mut scratch).map(|c| c.header).unwrap_err();
                assert!(
                    matches!(e, WireError::Block(BlockError::Event { .. })),
                    "{e}"
                );
            }
        }
        // The states of four transitions.
        assert!(value_errors >= 4, "{value_errors}");
    }

    /// `dropped_before` counts events of the run with seqs below the
    /// batch's first (seqs start at 0), so it can be at most `first_seq`.
    /// A header declaring more (a lying or broken publisher) would explain
    /// away every later hole of its engine; it is refused like any other
    /// header that contradicts itself, by `check` as by `decode`.
    #[test]
    fn a_declaration_of_more_losses_than_seqs_before_the_batch_is_refused() {
        let events: Vec<Event> = (5..9)
            .map(|i| Event {
                engine: 0,
                seq: i,
                ts_ns: i,
                iteration: 0,
                request: None,
                kind: kvbm_events::EventKind::Resumed {
                    breakpoint: i,
                    cause: kvbm_events::ResumeCause::Resume,
                },
            })
            .collect();
        for compress in [false, true] {
            let mut b = encode(&events, 3, 0, compress).remove(0);
            let mut scratch = Vec::new();
            // Every seq below the first one lost: possible.
            set_dropped_before(&mut b, 5);
            assert_eq!(decode(&b).unwrap().0.dropped_before, 5);
            assert_eq!(check(&b, &mut scratch).unwrap().header.dropped_before, 5);
            for lie in [6, u64::MAX] {
                set_dropped_before(&mut b, lie);
                let refused = WireError::DroppedBeforeFirst {
                    dropped_before: lie,
                    first_seq: 5,
                };
                assert_eq!(decode(&b).map(|(h, _)| h), Err(refused.clone()));
                let c = check(&b, &mut scratch).map(|c| c.header);
                assert_eq!(c, Err(refused.clone()));
                assert_eq!(header(&b), Err(refused.clone()));
                // The reason a consumer counts the refusal under.
                assert!(refused.to_string().contains("at most 5"), "{refused}");
            }
        }
    }

    #[test]
    fn a_header_that_lies_about_its_block_is_refused() {
        let events: Vec<Event> = renumber(
            (0..10)
                .map(|i| Event {
                    engine: 0,
                    seq: i,
                    ts_ns: i,
                    iteration: 0,
                    request: None,
                    kind: kvbm_events::EventKind::Resumed {
                        breakpoint: i,
                        cause: kvbm_events::ResumeCause::Resume,
                    },
                })
                .collect(),
        );
        let mut b = encode(&events, 1, 0, true).remove(0);
        b[16..24].copy_from_slice(&0u64.to_le_bytes());
        assert!(
            matches!(decode(&b), Err(WireError::Mismatch { .. })),
            "{:?}",
            decode(&b)
        );
        let mut b = encode(&events, 1, 0, true).remove(0);
        b[32..36].copy_from_slice(&3u32.to_le_bytes());
        assert!(matches!(decode(&b), Err(WireError::Mismatch { .. })));
        let mut b = encode(&events, 1, 0, false).remove(0);
        b[36..40].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode(&b), Err(WireError::BlockLength(_))));
        let mut b = encode(&events, 7, 0, true).remove(0);
        // Its first seq is 1: one event can have been dropped before it.
        set_dropped_before(&mut b, 1);
        assert_eq!(decode(&b).unwrap().0.dropped_before, 1);
        assert_eq!(decode(&b).unwrap().0.run, 7);
    }
}
