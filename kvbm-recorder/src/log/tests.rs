//! Unit tests of the log's pieces working together: the torn-tail versus
//! corruption decision on bytes in memory, and the writer's own rules.
//! Whole-log behaviour (recovery, seeking, snapshots, fuzzing) is in
//! `tests/log_recovery.rs`.

use std::io::Cursor;
use std::sync::Arc;
use std::time::Duration;

use kvbm_events::tier::Tier;
use kvbm_events::{Event, EventKind};

use super::block::BlockBuilder;
use super::format::{Codec, FrameHeader, SegmentHeader, frame_crc};
use super::scan::{ScanParams, SegmentEnd, scan_segment};
use super::*;
use kvbm_schema::columnar::{self, CheckedBlock};

/// An event of a kind that varies with `seq`, so that blocks are not all
/// alike.
fn ev(seq: u64, ts_ns: u64) -> Event {
    let kind = match seq % 3 {
        0 => EventKind::TokensScheduled {
            prefill: seq as u32,
            decode: 1,
            computed: 2,
        },
        1 => EventKind::BlocksAllocated {
            tier: Tier::Host,
            blocks: (0..(seq % 5) as u32).collect(),
        },
        _ => EventKind::TransferSkipped {
            transfer: seq,
            direction: kvbm_events::Direction {
                src: Tier::Device,
                dst: Tier::Host,
            },
            reason: "destination full".into(),
        },
    };
    Event {
        engine: 1,
        seq,
        ts_ns,
        iteration: seq / 2,
        request: (!seq.is_multiple_of(4)).then(|| Arc::from(format!("req-{}", seq % 4))),
        kind,
    }
}

/// The frame of one uncompressed block holding `events`.
fn block_frame(events: &[Event]) -> Vec<u8> {
    let mut b = BlockBuilder::default();
    for e in events {
        assert!(b.try_push(e, columnar::event_bytes(e), usize::MAX));
    }
    let (h, raw) = b.finish(Codec::Stored);
    let mut out = h.encode(raw).to_vec();
    out.extend_from_slice(raw);
    out
}

/// A segment in memory, one block per event, `n` events from `first_seq`:
/// its bytes and each block's (offset, end).
fn segment(first_seq: u64, n: u64) -> (Vec<u8>, Vec<(u64, u64)>) {
    let mut b = SegmentHeader::new(1, 1, first_seq).encode().to_vec();
    let mut spans = Vec::new();
    for seq in first_seq..first_seq + n {
        let start = b.len() as u64;
        b.extend_from_slice(&block_frame(&[ev(seq, 100 + seq)]));
        spans.push((start, b.len() as u64));
    }
    (b, spans)
}

fn scan(bytes: &[u8], name_seq: u64, last: bool) -> (u64, SegmentEnd) {
    let s = scan_segment(
        &mut Cursor::new(bytes),
        bytes.len() as u64,
        ScanParams {
            name_seq,
            prev_seq: None,
            last_segment: last,
            index_every_records: 2,
            index_every_bytes: u64::MAX,
        },
    )
    .expect("in-memory reads do not fail");
    (s.index.index().records, s.end)
}

#[test]
fn a_clean_segment_scans_clean() {
    let (b, _) = segment(7, 4);
    assert_eq!(scan(&b, 7, true), (4, SegmentEnd::Clean));
}

#[test]
fn every_cut_of_the_last_segment_is_a_torn_tail() {
    let (b, spans) = segment(7, 4);
    for cut in 0..b.len() as u64 {
        let (records, end) = scan(&b[..cut as usize], 7, true);
        let complete = spans.iter().filter(|(_, e)| *e <= cut).count() as u64;
        assert_eq!(records, complete, "cut at {cut}");
        let good_end = spans
            .iter()
            .map(|(_, e)| *e)
            .filter(|e| *e <= cut)
            .max()
            .unwrap_or(SEGMENT_HEADER_LEN);
        if cut < SEGMENT_HEADER_LEN {
            // The header itself is torn.
            assert_eq!(
                end,
                SegmentEnd::Torn {
                    offset: 0,
                    bytes: cut
                },
                "cut at {cut}"
            );
        } else if cut == good_end {
            assert_eq!(end, SegmentEnd::Clean, "cut at {cut}");
        } else {
            assert_eq!(
                end,
                SegmentEnd::Torn {
                    offset: good_end,
                    bytes: cut - good_end
                },
                "cut at {cut}"
            );
        }
    }
}

#[test]
fn the_same_cut_in_an_earlier_segment_is_corruption() {
    let (b, spans) = segment(7, 4);
    let (start, end) = spans[3];
    let cut = (start + end) / 2;
    let (_, got) = scan(&b[..cut as usize], 7, false);
    assert!(
        matches!(got, SegmentEnd::Corrupt { offset, reason: CorruptReason::Truncated { .. } } if offset == start),
        "{got:?}"
    );
}

#[test]
fn a_flipped_byte_with_good_blocks_after_it_is_corruption_at_its_block() {
    let (b, spans) = segment(7, 4);
    for (rec, &(start, end)) in spans.iter().enumerate().take(3) {
        for at in start..end {
            for bit in [0x01, 0x80] {
                let mut d = b.clone();
                d[at as usize] ^= bit;
                let (records, got) = scan(&d, 7, true);
                assert_eq!(records, rec as u64, "flip at {at}");
                assert!(
                    matches!(got, SegmentEnd::Corrupt { offset, .. } if offset == start),
                    "flip at {at}: {got:?}"
                );
            }
        }
    }
}

#[test]
fn a_damaged_final_block_with_nothing_after_it_is_a_torn_tail() {
    // Indistinguishable from a write the OS had not finished: the rule says
    // tail, and that is what the writer truncates.
    let (mut b, spans) = segment(7, 4);
    let (start, end) = spans[3];
    b[(end - 1) as usize] ^= 0x80;
    assert_eq!(
        scan(&b, 7, true),
        (
            3,
            SegmentEnd::Torn {
                offset: start,
                bytes: end - start
            }
        )
    );
}

#[test]
fn a_huge_length_field_is_refused_before_anything_is_allocated() {
    let (mut b, spans) = segment(7, 4);
    let (start, _) = spans[2];
    b[start as usize..start as usize + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let (records, got) = scan(&b, 7, true);
    assert_eq!(records, 2);
    assert!(
        matches!(got, SegmentEnd::Corrupt { offset, reason: CorruptReason::TooLarge { .. } } if offset == start),
        "{got:?}"
    );
}

#[test]
fn zero_filled_and_garbage_tails_are_torn() {
    let (b, spans) = segment(7, 4);
    let good_end = spans[3].1;
    let mut z = b.clone();
    z.extend_from_slice(&[0u8; 4096]);
    assert_eq!(
        scan(&z, 7, true),
        (
            4,
            SegmentEnd::Torn {
                offset: good_end,
                bytes: 4096
            }
        )
    );
    let mut g = b.clone();
    g.extend((0..3000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
    assert_eq!(
        scan(&g, 7, true),
        (
            4,
            SegmentEnd::Torn {
                offset: good_end,
                bytes: 3000
            }
        )
    );
}

#[test]
fn a_replayed_frame_is_corruption_not_a_tail() {
    // A whole frame with a good checksum was written whole; if its seq goes
    // backwards something other than a crash happened.
    let (mut b, spans) = segment(7, 4);
    let (s, e) = spans[0];
    let first = b[s as usize..e as usize].to_vec();
    b.extend_from_slice(&first);
    assert!(matches!(
        scan(&b, 7, true),
        (
            4,
            SegmentEnd::Corrupt {
                reason: CorruptReason::SeqNotIncreasing { seq: 7, prev: 10 },
                ..
            }
        )
    ));
}

#[test]
fn header_damage() {
    let (b, _) = segment(7, 4);
    // A name that disagrees with the header.
    assert!(matches!(
        scan(&b, 8, true),
        (
            0,
            SegmentEnd::Corrupt {
                offset: 0,
                reason: CorruptReason::NameMismatch { name: 8, header: 7 }
            }
        )
    ));
    // A garbled header with good records after it: corruption.
    let mut d = b.clone();
    d[20] ^= 0xff;
    assert!(matches!(
        scan(&d, 7, true),
        (
            0,
            SegmentEnd::Corrupt {
                offset: 0,
                reason: CorruptReason::BadHeader(_)
            }
        )
    ));
    // Only a header, garbled: a crash while creating the segment.
    let mut h = b[..SEGMENT_HEADER_LEN as usize].to_vec();
    h[20] ^= 0xff;
    assert_eq!(
        scan(&h, 7, true),
        (
            0,
            SegmentEnd::Torn {
                offset: 0,
                bytes: SEGMENT_HEADER_LEN
            }
        )
    );
    assert!(matches!(
        scan(&h, 7, false),
        (0, SegmentEnd::Corrupt { offset: 0, .. })
    ));
}

fn small(fsync: FsyncPolicy) -> LogConfig {
    LogConfig {
        schema_version: 3,
        engine_id: 9,
        segment_bytes: 1024,
        fsync,
        index_every_records: 4,
        index_every_bytes: 1 << 20,
        write_buffer_bytes: 1024,
        // One event per block, so that sizes are easy to count.
        block_bytes: 1,
    }
}

/// An event whose block is `MAX_RECORD_BYTES` or a little less (`extra`
/// more block ids: over it).
fn huge(seq: u64, extra: usize) -> Event {
    let empty = Event {
        request: None,
        kind: EventKind::BlocksAllocated {
            tier: Tier::Disk,
            blocks: Vec::new(),
        },
        ..ev(seq, seq)
    };
    let n = (MAX_RECORD_BYTES as usize - columnar::event_bytes(&empty)) / 4 + extra;
    Event {
        kind: EventKind::BlocksAllocated {
            tier: Tier::Disk,
            blocks: (0..n as u32).collect(),
        },
        ..empty
    }
}

#[test]
fn writer_refuses_bad_input_without_writing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = LogWriter::create(dir.path(), small(FsyncPolicy::Never)).expect("create");
    w.append(&ev(5, 1)).expect("append");
    assert!(matches!(
        w.append(&ev(5, 2)),
        Err(LogError::NonIncreasingSeq { seq: 5, last: 5 })
    ));
    assert!(matches!(
        w.append(&ev(4, 2)),
        Err(LogError::NonIncreasingSeq { seq: 4, last: 5 })
    ));
    assert!(matches!(
        w.append(&huge(6, 1)),
        Err(LogError::RecordTooLarge { .. })
    ));
    // Still usable: refusals do not poison the writer.
    w.append(&ev(6, 2)).expect("append after refusals");
    assert!(matches!(
        w.write_snapshot(7, 0, b"s"),
        Err(LogError::SnapshotAhead {
            seq: 7,
            last: Some(6)
        })
    ));
    let stats = w.close().expect("close");
    assert_eq!((stats.records, stats.segments, stats.fsyncs), (2, 1, 0));

    assert!(matches!(
        LogWriter::create(dir.path(), small(FsyncPolicy::Never)),
        Err(LogError::AlreadyExists { .. })
    ));
    let mut other = small(FsyncPolicy::Never);
    other.engine_id = 10;
    assert!(matches!(
        LogWriter::open_append(dir.path(), other),
        Err(LogError::ConfigMismatch {
            field: "engine_id",
            found: 9,
            expected: 10,
            ..
        })
    ));
    let mut tiny = small(FsyncPolicy::Never);
    tiny.segment_bytes = 10;
    assert!(matches!(
        LogWriter::create(dir.path().join("x"), tiny),
        Err(LogError::InvalidConfig(_))
    ));
    for block_bytes in [0, MAX_RECORD_BYTES + 1] {
        let cfg = LogConfig {
            block_bytes,
            ..small(FsyncPolicy::Never)
        };
        assert!(matches!(
            LogWriter::create(dir.path().join("y"), cfg),
            Err(LogError::InvalidConfig(_))
        ));
    }
}

#[test]
fn a_block_larger_than_a_segment_gets_a_segment_of_its_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = LogWriter::create(dir.path(), small(FsyncPolicy::Never)).expect("create");
    w.append(&ev(1, 1)).expect("append");
    // Block ids that do not compress, more than a segment's worth.
    let noise = Event {
        kind: EventKind::BlocksAllocated {
            tier: Tier::Host,
            blocks: (0..1000u32)
                .map(|i| i.wrapping_mul(2_654_435_761))
                .collect(),
        },
        ..ev(2, 2)
    };
    w.append(&noise).expect("append");
    w.append(&ev(3, 3)).expect("append");
    assert_eq!(w.close().expect("close").segments, 3);
    let r = LogReader::open(dir.path(), ReaderOptions::default()).expect("open");
    let names: Vec<&str> = r.info().segments.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "00000000000000000001.kvlog",
            "00000000000000000002.kvlog",
            "00000000000000000003.kvlog"
        ]
    );
    let events: Vec<Event> = r.iter().map(|x| x.expect("record").event).collect();
    assert_eq!(events, [ev(1, 1), noise, ev(3, 3)]);
}

#[test]
fn fsync_counts_follow_the_policy() {
    let run = |fsync| {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut w = LogWriter::create(dir.path(), small(fsync)).expect("create");
        for seq in 1..=20 {
            w.append(&ev(seq, seq)).expect("append");
        }
        let durable = w.durable_seq();
        (w.close().expect("close"), durable)
    };
    // 20 one-event blocks of a few hundred bytes each, several 1 KiB
    // segments.
    let (every, durable) = run(FsyncPolicy::EveryRecord);
    let segs = every.segments;
    assert_eq!(every.blocks, 20);
    assert!((3..20).contains(&segs), "{every:?}");
    assert_eq!(durable, Some(20));
    // One per event, one per directory entry, one per sealed segment.
    assert_eq!(every.fsyncs, 20 + segs + (segs - 1));
    let (never, durable) = run(FsyncPolicy::Never);
    assert_eq!((never.fsyncs, durable, never.segments), (0, None, segs));
    let (hourly, _) = run(FsyncPolicy::Interval(Duration::from_secs(3600)));
    // Directory entries and sealed segments, then the close.
    assert_eq!(hourly.fsyncs, segs + (segs - 1) + 1);
    let (always, _) = run(FsyncPolicy::Interval(Duration::ZERO));
    assert_eq!(always.fsyncs, every.fsyncs);
}

/// A detached sync hands the records to the OS at once and leaves their
/// fsyncs (and the directory's, for a segment created since the last) to
/// whoever runs it, while the writer goes on appending.
#[test]
fn a_detached_sync_leaves_its_fsyncs_and_the_writer_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = LogWriter::create(dir.path(), small(FsyncPolicy::OnSync)).expect("create");
    assert!(
        w.detach_sync().expect("detach").is_none(),
        "nothing appended"
    );
    w.append(&ev(1, 1)).expect("append");
    let before = w.stats().fsyncs;
    let first = w.detach_sync().expect("detach").expect("a record to sync");
    // The record's data and the new segment's directory entry.
    assert_eq!(w.stats().fsyncs, before + 2);
    assert_eq!(w.flushed_seq(), Some(1));
    assert_eq!(w.durable_seq(), None, "not durable before it runs");
    assert!(w.detach_sync().expect("detach").is_none(), "nothing since");
    w.append(&ev(2, 2)).expect("append");
    let second = w.detach_sync().expect("detach").expect("a record to sync");
    assert_eq!(
        w.stats().fsyncs,
        before + 3,
        "the same segment: its data only"
    );
    // Run on another thread, after more appends.
    w.append(&ev(3, 3)).expect("append");
    std::thread::spawn(move || first.run().and_then(|()| second.run()))
        .join()
        .expect("thread")
        .expect("fsyncs");
    w.close().expect("close");
    let r = LogReader::open(dir.path(), ReaderOptions::default()).expect("open");
    let seqs: Vec<u64> = r.iter().map(|x| x.expect("record").event.seq).collect();
    assert_eq!(seqs, [1, 2, 3]);
}

#[test]
fn interval_sync_is_checked_on_flush() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = LogWriter::create(
        dir.path(),
        small(FsyncPolicy::Interval(Duration::from_millis(20))),
    )
    .expect("create");
    w.append(&ev(1, 1)).expect("append");
    assert_eq!(w.flushed_seq(), None);
    w.flush().expect("flush");
    assert_eq!(w.flushed_seq(), Some(1));
    std::thread::sleep(Duration::from_millis(25));
    w.flush().expect("flush");
    assert_eq!(w.durable_seq(), Some(1));
    w.sync().expect("sync");
    drop(w);
    // Dropping closed it: the index is there.
    let r = LogReader::open(dir.path(), ReaderOptions::default()).expect("open");
    assert_eq!(r.info().segments[0].index, IndexSource::File);
}

#[test]
fn time_seek_is_exact_with_timestamps_that_go_backwards() {
    let ts = [10u64, 30, 20, 25, 50, 40, 45, 60, 55, 70];
    // One event per block, then all in one block: the skip happens across
    // blocks and inside one.
    for block_bytes in [1, 1 << 16] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = small(FsyncPolicy::Never);
        cfg.index_every_records = 2;
        cfg.segment_bytes = 1 << 20;
        cfg.block_bytes = block_bytes;
        let mut w = LogWriter::create(dir.path(), cfg).expect("create");
        for (i, t) in ts.iter().enumerate() {
            w.append(&ev(i as u64, *t)).expect("append");
        }
        w.close().expect("close");
        let r = LogReader::open(dir.path(), ReaderOptions::default()).expect("open");
        for target in 0..80 {
            let want = ts.iter().position(|t| *t >= target).map(|i| i as u64);
            let got = r
                .iter_from_time(target)
                .next()
                .map(|x| x.expect("record").event.seq);
            assert_eq!(got, want, "target {target}, block_bytes {block_bytes}");
        }
        for target in 0..12 {
            let got: Vec<u64> = r
                .iter_from_seq(target)
                .map(|x| x.expect("record").event.seq)
                .collect();
            assert_eq!(got, (target.min(10)..10).collect::<Vec<_>>());
        }
    }
}

/// Writes `n` events into compressed blocks of about 2 KiB and returns the
/// segment's bytes, its name and the offsets of its blocks.
fn compressed_log(n: u64) -> (tempfile::TempDir, String, Vec<u8>, Vec<u64>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = small(FsyncPolicy::Never);
    cfg.block_bytes = 2048;
    cfg.segment_bytes = 1 << 20;
    let mut w = LogWriter::create(dir.path(), cfg).expect("create");
    for seq in 0..n {
        w.append(&ev(seq, 1000 + seq)).expect("append");
    }
    w.close().expect("close");
    let name = segment_file_name(0);
    let bytes = std::fs::read(dir.path().join(&name)).expect("read");
    let r = LogReader::open(dir.path(), ReaderOptions::default()).expect("open");
    let mut offsets: Vec<u64> = r.iter().map(|x| x.expect("record").offset).collect();
    offsets.dedup();
    (dir, name, bytes, offsets)
}

fn read_mem(name: &str, bytes: Vec<u8>) -> (Vec<u64>, Option<LogError>) {
    let r =
        LogReader::from_files([(name.to_string(), bytes)], ReaderOptions::default()).expect("open");
    let mut seqs = Vec::new();
    for x in r.iter() {
        match x {
            Ok(rec) => seqs.push(rec.event.seq),
            Err(e) => return (seqs, Some(e)),
        }
    }
    (seqs, None)
}

#[test]
fn events_are_gathered_into_compressed_blocks() {
    let (_dir, _, bytes, offsets) = compressed_log(400);
    assert!(offsets.len() > 3, "{offsets:?}");
    let h = FrameHeader::decode(&bytes[64..112].try_into().expect("header"));
    assert_eq!(h.codec, Codec::Lz4 as u8);
    assert!(h.count > 20);
    assert!(u64::from(h.len) * 3 < u64::from(h.raw_len) * 2, "{h:?}");
    // The blocks are what was written, in order.
    let (seqs, err) = read_mem(&segment_file_name(0), bytes);
    assert!(err.is_none());
    assert!(seqs.into_iter().eq(0..400));
}

#[test]
fn a_block_torn_mid_way_is_a_torn_tail_after_the_blocks_before_it() {
    let (_dir, name, bytes, offsets) = compressed_log(400);
    let last = *offsets.last().expect("blocks");
    let records_before = {
        let (seqs, _) = read_mem(&name, bytes[..last as usize].to_vec());
        seqs.len()
    };
    for cut in [
        last + 1,
        last + 47,
        last + 48,
        (last + bytes.len() as u64) / 2,
    ] {
        let (seqs, err) = read_mem(&name, bytes[..cut as usize].to_vec());
        assert!(err.is_none(), "cut at {cut}: {err:?}");
        assert_eq!(seqs.len(), records_before, "cut at {cut}");
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(&name), &bytes[..cut as usize]).expect("write");
        let w = LogWriter::open_append(dir.path(), {
            let mut c = small(FsyncPolicy::Never);
            c.segment_bytes = 1 << 20;
            c
        })
        .expect("recover");
        let t = w.recovery().truncated.clone().expect("truncated");
        assert_eq!((t.offset, t.bytes), (last, cut - last));
        assert_eq!(w.last_seq(), Some(records_before as u64 - 1));
    }
}

/// Rewrites the checksum of the frame at `at` after its bytes were changed,
/// as a writer bug (or a checksum collision) would leave it.
fn reseal(bytes: &mut [u8], at: usize) {
    let hb: [u8; 48] = bytes[at..at + 48].try_into().expect("header");
    let h = FrameHeader::decode(&hb);
    let end = at + 48 + h.len as usize;
    let crc = frame_crc(&hb, &bytes[at + 48..end]);
    bytes[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
}

#[test]
fn a_corrupt_compressed_body_is_reported_at_its_block() {
    let (_dir, name, bytes, offsets) = compressed_log(400);
    let victim = offsets[2];
    let before = {
        let (seqs, _) = read_mem(&name, bytes[..victim as usize].to_vec());
        seqs.len()
    };
    // Without a matching checksum: a checksum mismatch, with the blocks after
    // it intact, so corruption rather than a tail.
    let mut d = bytes.clone();
    d[victim as usize + 60] ^= 0x5a;
    let (seqs, err) = read_mem(&name, d.clone());
    assert_eq!(seqs.len(), before);
    let err = err.expect("damage reported");
    assert_eq!(err.corrupt_at(), Some((name.as_str(), victim)), "{err}");
    assert!(matches!(
        err,
        LogError::Corrupt {
            reason: CorruptReason::CrcMismatch { .. },
            ..
        }
    ));
    // With the checksum made to match: the body itself is found bad when it
    // is decompressed, verified or checked against the header, and reported
    // at the same place.
    let body = victim as usize + 48..offsets[3] as usize;
    for fill in [0x00u8, 0xff, 0x10] {
        let mut d = bytes.clone();
        d[body.clone()].fill(fill);
        reseal(&mut d, victim as usize);
        let (seqs, err) = read_mem(&name, d);
        assert_eq!(seqs.len(), before, "fill {fill}");
        let err = err.expect("damage reported");
        assert_eq!(
            err.corrupt_at(),
            Some((name.as_str(), victim)),
            "fill {fill}: {err}"
        );
        assert!(
            err.to_string().contains(&name) && err.to_string().contains(&victim.to_string()),
            "{err}"
        );
    }
}

#[test]
fn a_body_that_decompresses_but_fails_verification_is_reported_at_its_block() {
    // Stored (uncompressed) one-event blocks: change a byte of the
    // flatbuffer itself and fix the checksum, so that only the verifier
    // or the checks after it can find it.
    let (b, spans) = segment(7, 4);
    let (start, end) = spans[1];
    let mut caught = 0;
    for at in start + 48..end {
        for x in [0x01u8, 0x80, 0xff] {
            let mut d = b.clone();
            d[at as usize] ^= x;
            reseal(&mut d, start as usize);
            let (seqs, err) = read_mem(&segment_file_name(7), d);
            match err {
                None => {
                    // A change the format does not see (padding, a value
                    // that is still valid): the events still come back, one
                    // of them maybe different.
                    assert_eq!(seqs.len(), 4, "flip {x:#x} at {at}");
                }
                Some(e) => {
                    caught += 1;
                    assert_eq!(seqs, [7], "flip {x:#x} at {at}: {e}");
                    assert_eq!(e.corrupt_at(), Some((segment_file_name(7).as_str(), start)));
                    assert!(matches!(
                        e,
                        LogError::Corrupt {
                            reason: CorruptReason::Verify(_) | CorruptReason::BadBlock(_),
                            ..
                        }
                    ));
                }
            }
        }
    }
    assert!(caught > 50, "only {caught} damaged bodies were noticed");
}

#[test]
fn a_hostile_decompressed_size_is_refused_before_allocating() {
    let (_dir, name, bytes, offsets) = compressed_log(400);
    let victim = offsets[1] as usize;
    for raw_len in [u32::MAX, MAX_BLOCK_BYTES + 1, 16 << 20] {
        let mut d = bytes.clone();
        d[victim + 40..victim + 44].copy_from_slice(&raw_len.to_le_bytes());
        reseal(&mut d, victim);
        let (_, err) = read_mem(&name, d);
        let err = err.expect("damage reported");
        assert_eq!(err.corrupt_at(), Some((name.as_str(), victim as u64)));
        assert!(
            matches!(
                err,
                LogError::Corrupt {
                    reason: CorruptReason::BadBlock(_),
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn an_event_of_the_maximum_size_fits_its_block() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = LogConfig {
        block_bytes: MAX_RECORD_BYTES,
        segment_bytes: 1 << 20,
        ..small(FsyncPolicy::Never)
    };
    let mut w = LogWriter::create(dir.path(), cfg).expect("create");
    let big = huge(2, 0);
    assert!(columnar::event_bytes(&big) <= MAX_RECORD_BYTES as usize);
    w.append(&ev(1, 1)).expect("append");
    w.append(&big).expect("append");
    w.close().expect("close");
    let r = LogReader::open(dir.path(), ReaderOptions::default()).expect("open");
    let events: Vec<Event> = r.iter().map(|x| x.expect("record").event).collect();
    assert_eq!(events, [ev(1, 1), big]);
}

/// A block of `events` as an encoder finishes it, and its LZ4 form.
fn encoded_block(events: &[Event]) -> (Vec<u8>, Vec<u8>) {
    let mut enc = columnar::BlockEncoder::new();
    for e in events {
        assert!(enc.push(e));
    }
    let raw = enc.finish().to_vec();
    let lz4 = lz4_flex::block::compress(&raw);
    (raw, lz4)
}

/// Blocks appended whole sit between events appended one by one, each a
/// frame of its own (compressed as given, or stored), and read back as
/// the same events in order; a reopened log goes on after them. A block
/// whose seqs do not follow the log's is refused and nothing is written.
#[test]
fn whole_blocks_append_as_frames_of_their_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = small(FsyncPolicy::Never);
    cfg.block_bytes = 1 << 16;
    cfg.segment_bytes = 1 << 20;
    let all: Vec<Event> = (0..200).map(|s| ev(s, 1000 + s)).collect();
    let mut w = LogWriter::create(dir.path(), cfg.clone()).expect("create");
    for e in &all[..10] {
        w.append(e).expect("append");
    }
    let (raw, lz4) = encoded_block(&all[10..110]);
    let block = CheckedBlock::check(&raw[..]).expect("check");
    let span = w.append_block(block, Some(&lz4)).expect("block");
    assert_eq!((span.first_seq, span.last_seq), (10, 109));
    assert_eq!((span.min_ts, span.max_ts), (1010, 1109));
    // Behind the log's last seq: refused, nothing written.
    let (old, _) = encoded_block(&all[100..120]);
    let e = w
        .append_block(CheckedBlock::check(&old[..]).expect("check"), None)
        .expect_err("overlap");
    assert!(
        matches!(e, LogError::NonIncreasingSeq { seq: 100, .. }),
        "{e}"
    );
    // Stored when no compressed form is given.
    let (raw2, _) = encoded_block(&all[110..150]);
    w.append_block(CheckedBlock::check(&raw2[..]).expect("check"), None)
        .expect("stored block");
    for e in &all[150..160] {
        w.append(e).expect("append");
    }
    let stats = w.close().expect("close");
    assert_eq!(stats.records, 160);
    // Four frames: the ten single events, the two blocks, the last ten.
    assert_eq!(stats.blocks, 4);
    let mut w = LogWriter::open_append(dir.path(), cfg).expect("reopen");
    let (raw3, lz43) = encoded_block(&all[160..200]);
    w.append_block(CheckedBlock::check(&raw3[..]).expect("check"), Some(&lz43))
        .expect("block after reopen");
    w.close().expect("close");
    let r = LogReader::open(dir.path(), ReaderOptions::default()).expect("open");
    let back: Vec<Event> = r.iter().map(|x| x.expect("record").event).collect();
    assert_eq!(back, all);
    let bytes = std::fs::read(dir.path().join(segment_file_name(0))).expect("read");
    let mut at = SEGMENT_HEADER_LEN as usize;
    let mut codecs = Vec::new();
    while at < bytes.len() {
        let h = FrameHeader::decode(&bytes[at..at + 48].try_into().expect("header"));
        codecs.push((h.first_seq, h.codec));
        at += 48 + h.len as usize;
    }
    assert_eq!(
        codecs,
        [
            (0, Codec::Lz4 as u8),
            (10, Codec::Lz4 as u8),
            (110, Codec::Stored as u8),
            (150, Codec::Lz4 as u8),
            // After the reopen, in the same segment.
            (160, Codec::Lz4 as u8),
        ]
    );
}
