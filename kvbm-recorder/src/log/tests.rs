//! Unit tests of the log's pieces working together: the torn-tail versus
//! corruption decision on bytes in memory, and the writer's own rules.
//! Whole-log behaviour (recovery, seeking, snapshots, fuzzing) is in
//! `tests/log_recovery.rs`.

use std::io::Cursor;
use std::time::Duration;

use super::block::BlockBuilder;
use super::format::{Codec, FrameHeader, SegmentHeader, frame_crc};
use super::scan::{ScanParams, SegmentEnd, scan_segment};
use super::*;

/// The frame of one uncompressed block holding `records` (seq, ts, payload).
fn block_frame(records: &[(u64, u64, &[u8])]) -> Vec<u8> {
    let mut b = BlockBuilder::default();
    for (seq, ts, p) in records {
        b.push(*seq, *ts, p);
    }
    let (h, raw) = b.header(Codec::Stored);
    let mut out = h.encode(raw).to_vec();
    out.extend_from_slice(raw);
    out
}

/// A segment in memory, one block per record: its bytes and each block's
/// (offset, end).
fn segment(first_seq: u64, payloads: &[&[u8]]) -> (Vec<u8>, Vec<(u64, u64)>) {
    let mut b = SegmentHeader::new(1, 1, first_seq).encode().to_vec();
    let mut spans = Vec::new();
    for (i, p) in payloads.iter().enumerate() {
        let start = b.len() as u64;
        b.extend_from_slice(&block_frame(&[(first_seq + i as u64, 100 + i as u64, p)]));
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

const PAYLOADS: [&[u8]; 4] = [b"alpha", b"", b"gamma-gamma", b"delta"];

#[test]
fn a_clean_segment_scans_clean() {
    let (b, _) = segment(7, &PAYLOADS);
    assert_eq!(scan(&b, 7, true), (4, SegmentEnd::Clean));
}

#[test]
fn every_cut_of_the_last_segment_is_a_torn_tail() {
    let (b, spans) = segment(7, &PAYLOADS);
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
    let (b, spans) = segment(7, &PAYLOADS);
    let (start, end) = spans[3];
    let cut = (start + end) / 2;
    let (_, got) = scan(&b[..cut as usize], 7, false);
    assert!(
        matches!(got, SegmentEnd::Corrupt { offset, reason: CorruptReason::Truncated { .. } } if offset == start),
        "{got:?}"
    );
}

#[test]
fn a_flipped_byte_with_good_records_after_it_is_corruption_at_its_record() {
    let (b, spans) = segment(7, &PAYLOADS);
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
fn a_damaged_final_record_with_nothing_after_it_is_a_torn_tail() {
    // Indistinguishable from a write the OS had not finished: the rule says
    // tail, and that is what the writer truncates.
    let (mut b, spans) = segment(7, &PAYLOADS);
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
    let (mut b, spans) = segment(7, &PAYLOADS);
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
    let (b, spans) = segment(7, &PAYLOADS);
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
    let (mut b, spans) = segment(7, &PAYLOADS);
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
    let (b, _) = segment(7, &PAYLOADS);
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
        segment_bytes: 256,
        fsync,
        index_every_records: 4,
        index_every_bytes: 1 << 20,
        write_buffer_bytes: 1024,
        // One record per block, so that sizes are easy to count.
        block_bytes: 1,
    }
}

#[test]
fn writer_refuses_bad_input_without_writing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = LogWriter::create(dir.path(), small(FsyncPolicy::Never)).expect("create");
    w.append(5, 1, b"x").expect("append");
    assert!(matches!(
        w.append(5, 2, b"y"),
        Err(LogError::NonIncreasingSeq { seq: 5, last: 5 })
    ));
    assert!(matches!(
        w.append(4, 2, b"y"),
        Err(LogError::NonIncreasingSeq { seq: 4, last: 5 })
    ));
    let big = vec![0u8; MAX_RECORD_BYTES as usize + 1];
    assert!(matches!(
        w.append(6, 2, &big),
        Err(LogError::RecordTooLarge { .. })
    ));
    // Still usable: refusals do not poison the writer.
    w.append(6, 2, b"y").expect("append after refusals");
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
fn a_record_larger_than_a_segment_gets_a_segment_of_its_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = LogWriter::create(dir.path(), small(FsyncPolicy::Never)).expect("create");
    w.append(1, 1, &[1u8; 10]).expect("append");
    // Bytes that do not compress.
    let noise: Vec<u8> = (0..1000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    w.append(2, 2, &noise).expect("append");
    w.append(3, 3, &[3u8; 10]).expect("append");
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
    assert!(r.iter().map(|x| x.expect("record").seq).eq(1..=3));
}

#[test]
fn fsync_counts_follow_the_policy() {
    let run = |fsync| {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut w = LogWriter::create(dir.path(), small(fsync)).expect("create");
        for seq in 0..20 {
            w.append(seq, seq, b"0123456789").expect("append");
        }
        let durable = w.durable_seq();
        (w.close().expect("close"), durable)
    };
    // 20 one-record blocks of 48 + 3 + 10 bytes, three to a 256-byte
    // segment: 7 segments.
    let (every, durable) = run(FsyncPolicy::EveryRecord);
    assert_eq!((every.segments, every.blocks), (7, 20));
    assert_eq!(durable, Some(19));
    // One per record, one per directory entry, one per sealed segment.
    assert_eq!(every.fsyncs, 20 + 7 + 6);
    let (never, durable) = run(FsyncPolicy::Never);
    assert_eq!((never.fsyncs, durable), (0, None));
    let (hourly, _) = run(FsyncPolicy::Interval(Duration::from_secs(3600)));
    // Directory entries and sealed segments, then the close.
    assert_eq!(hourly.fsyncs, 7 + 6 + 1);
    let (always, _) = run(FsyncPolicy::Interval(Duration::ZERO));
    assert_eq!(always.fsyncs, every.fsyncs);
}

#[test]
fn interval_sync_is_checked_on_flush() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = LogWriter::create(
        dir.path(),
        small(FsyncPolicy::Interval(Duration::from_millis(20))),
    )
    .expect("create");
    w.append(1, 1, b"a").expect("append");
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
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = small(FsyncPolicy::Never);
    cfg.index_every_records = 2;
    cfg.segment_bytes = 1 << 20;
    let ts = [10u64, 30, 20, 25, 50, 40, 45, 60, 55, 70];
    let mut w = LogWriter::create(dir.path(), cfg).expect("create");
    for (i, t) in ts.iter().enumerate() {
        w.append(i as u64, *t, b"p").expect("append");
    }
    w.close().expect("close");
    let r = LogReader::open(dir.path(), ReaderOptions::default()).expect("open");
    for target in 0..80 {
        let want = ts.iter().position(|t| *t >= target).map(|i| i as u64);
        let got = r
            .iter_from_time(target)
            .next()
            .map(|x| x.expect("record").seq);
        assert_eq!(got, want, "target {target}");
    }
}

/// Writes `n` records of a repetitive payload into big compressed blocks and
/// returns the segment's bytes, its name and the offsets of its blocks.
fn compressed_log(n: u64) -> (tempfile::TempDir, String, Vec<u8>, Vec<u64>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = small(FsyncPolicy::Never);
    cfg.block_bytes = 2048;
    cfg.segment_bytes = 1 << 20;
    let mut w = LogWriter::create(dir.path(), cfg).expect("create");
    for seq in 0..n {
        let payload = format!("event {seq} of a log that repeats itself a lot");
        w.append(seq, 1000 + seq, payload.as_bytes())
            .expect("append");
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
            Ok(rec) => seqs.push(rec.seq),
            Err(e) => return (seqs, Some(e)),
        }
    }
    (seqs, None)
}

#[test]
fn records_are_gathered_into_compressed_blocks() {
    let (_dir, _, bytes, offsets) = compressed_log(400);
    assert!(offsets.len() > 3, "{offsets:?}");
    let h = FrameHeader::decode(&bytes[64..112].try_into().expect("header"));
    assert_eq!(h.codec, Codec::Lz4 as u8);
    assert!(h.count > 20);
    assert!(u64::from(h.len) * 3 < u64::from(h.raw_len), "{h:?}");
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
    // is decompressed or walked, and reported at the same place.
    // (A flipped literal byte can decompress to other bytes of the same
    // shape; the payload verifier is what catches that.)
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
fn a_record_of_the_maximum_size_fits_its_block() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = LogConfig {
        block_bytes: MAX_RECORD_BYTES,
        segment_bytes: 1 << 20,
        ..small(FsyncPolicy::Never)
    };
    let mut w = LogWriter::create(dir.path(), cfg).expect("create");
    w.append(1, 1, b"small").expect("append");
    w.append(2, 2, &vec![9u8; MAX_RECORD_BYTES as usize])
        .expect("append");
    w.close().expect("close");
    let r = LogReader::open(dir.path(), ReaderOptions::default()).expect("open");
    let lens: Vec<usize> = r.iter().map(|x| x.expect("record").payload.len()).collect();
    assert_eq!(lens, [5, MAX_RECORD_BYTES as usize]);
}
