//! The durable log as a whole, through its public API, with kvbm events
//! written and read back: round trips across segments with every fsync
//! policy, torn tails cut at every byte, corruption in the middle, seeking
//! with and without index files, snapshots, blocks whose frame is sound but
//! whose contents fail verification, and a fuzz test of the reader and of
//! recovery.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbm_events::SequenceHash;
use kvbm_events::slot::SlotState;
use kvbm_events::tier::Tier;
use kvbm_events::{Direction, Event, EventKind};
use kvbm_recorder::log::{
    CorruptReason, FRAME_HEADER_LEN, FsyncPolicy, IndexSource, LogConfig, LogError, LogReader,
    LogWriter, MAX_BLOCK_BYTES, ReaderOptions, Record, SEGMENT_HEADER_LEN, SeekTo, SegmentStatus,
    index_file_name, segment_file_name,
};
use proptest::prelude::*;

const SCHEMA: u32 = 5;
const ENGINE: u64 = 77;

fn config(fsync: FsyncPolicy, segment_bytes: u64) -> LogConfig {
    LogConfig {
        schema_version: SCHEMA,
        engine_id: ENGINE,
        segment_bytes,
        fsync,
        index_every_records: 8,
        index_every_bytes: 1 << 20,
        write_buffer_bytes: 512,
        // Three or four events to a block (by `columnar::event_bytes`),
        // blocks of about 300 to 400 bytes, so that blocks and segments
        // (2 or 4 KiB in most tests) both turn over often.
        block_bytes: 300,
    }
}

/// For each record, its block: the frame's offset and end in its segment,
/// and the index of the block's first record. A block ends where the next
/// one in the same segment starts, or at the end of the file.
fn blocks_of(dir: &Path, records: &[Record]) -> Vec<(u64, u64, usize)> {
    let same_block = |a: &Record, b: &Record| a.segment == b.segment && a.offset == b.offset;
    let mut out = Vec::with_capacity(records.len());
    let mut first = 0;
    for (i, r) in records.iter().enumerate() {
        if !same_block(&records[first], r) {
            first = i;
        }
        let next = records[i..].iter().find(|n| !same_block(r, n));
        let end = match next {
            Some(n) if n.segment == r.segment => n.offset,
            _ => fs::metadata(dir.join(&*r.segment)).expect("meta").len(),
        };
        out.push((r.offset, end, first));
    }
    out
}

/// A deterministic event whose kind, request and size vary with `seq`
/// (fixed-size rows, tables with lists and text, with and without a
/// request), so that blocks are not all alike.
fn event(seq: u64, ts_ns: u64) -> Event {
    let kind = match seq % 5 {
        0 => EventKind::TokensScheduled {
            prefill: (seq % 97) as u32,
            decode: (seq % 2) as u32,
            computed: seq as u32,
        },
        1 => EventKind::BlockRegistered {
            tier: Tier::Device,
            block: (seq % 1000) as u32,
            sequence_hash: SequenceHash(seq.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            duplicate_of: seq.is_multiple_of(3).then_some(7),
        },
        2 => EventKind::BlocksAllocated {
            tier: Tier::Host,
            blocks: (0..(seq % 7) as u32).map(|b| b * 3 + seq as u32).collect(),
        },
        3 => EventKind::SlotTransition {
            from: SlotState::OnboardStaged((seq % 512) as usize),
            to: if seq.is_multiple_of(2) {
                SlotState::Decoding
            } else {
                SlotState::Preempted
            },
        },
        _ => EventKind::TransferSkipped {
            transfer: seq,
            direction: Direction::DEVICE_TO_HOST,
            reason: ["destination full", "", "duplicate"][(seq % 3) as usize].into(),
        },
    };
    Event {
        engine: ENGINE as u32,
        seq,
        ts_ns,
        iteration: seq / 3,
        request: (!seq.is_multiple_of(7)).then(|| Arc::from(format!("req-{}", seq % 5))),
        kind,
    }
}

/// Appends `n` events with seq `first + i * step` and ts `1000 + 10 * i`.
fn write_log(dir: &Path, cfg: LogConfig, n: u64, first: u64, step: u64) -> Vec<Event> {
    let mut w = LogWriter::create(dir, cfg).expect("create");
    let mut out = Vec::new();
    for i in 0..n {
        let ev = event(first + i * step, 1000 + 10 * i);
        w.append(&ev).expect("append");
        out.push(ev);
    }
    w.close().expect("close");
    out
}

fn opts() -> ReaderOptions {
    ReaderOptions::default()
}

fn no_index() -> ReaderOptions {
    ReaderOptions {
        trust_index: false,
        ..ReaderOptions::default()
    }
}

/// Every record the reader yields, and the error that ended it, if any.
fn read_all(dir: &Path, o: ReaderOptions) -> (Vec<Record>, Option<LogError>) {
    let r = LogReader::open(dir, o).expect("open reader");
    collect(r.iter())
}

fn collect(it: impl Iterator<Item = Result<Record, LogError>>) -> (Vec<Record>, Option<LogError>) {
    let mut records = Vec::new();
    for item in it {
        match item {
            Ok(r) => records.push(r),
            Err(e) => return (records, Some(e)),
        }
    }
    (records, None)
}

/// The events of records read back, to compare with those written.
fn as_written(records: &[Record]) -> Vec<Event> {
    records.iter().map(|r| r.event.clone()).collect()
}

fn segments_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "kvlog"))
        .collect();
    v.sort();
    v
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).expect("mkdir");
    for e in fs::read_dir(to).expect("read_dir") {
        fs::remove_file(e.expect("entry").path()).expect("clean");
    }
    for e in fs::read_dir(from).expect("read_dir") {
        let e = e.expect("entry");
        fs::copy(e.path(), to.join(e.file_name())).expect("copy");
    }
}

fn name_of(p: &Path) -> String {
    p.file_name()
        .expect("file name")
        .to_string_lossy()
        .into_owned()
}

/// Rewrites the block frame at `offset` in the segment `bytes`: its frame
/// header and records region (decompressed first if the body is LZ4) go
/// through `edit`, then the frame is put back with the region stored as is
/// (codec 0), its body length, records length and CRC-32C (over header
/// bytes 0..4 and 8..48, then the body) recomputed. Whatever `edit` did to
/// the contents, the frame passes its checksum. Returns the new frame's
/// length.
fn rewrite_block(
    bytes: &mut Vec<u8>,
    offset: u64,
    edit: impl FnOnce(&mut [u8; FRAME_HEADER_LEN as usize], &mut Vec<u8>),
) -> u64 {
    let at = offset as usize;
    let hl = FRAME_HEADER_LEN as usize;
    let mut h: [u8; FRAME_HEADER_LEN as usize] = bytes[at..at + hl].try_into().expect("header");
    let u32_at = |h: &[u8], i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("u32"));
    let len = u32_at(&h, 0) as usize;
    let raw_len = u32_at(&h, 40) as usize;
    let body = &bytes[at + hl..at + hl + len];
    let mut raw = match h[46] {
        0 => body.to_vec(),
        1 => lz4_flex::block::decompress(body, raw_len).expect("an LZ4 body"),
        c => panic!("unknown codec {c}"),
    };
    assert_eq!(raw.len(), raw_len, "the header's records length");
    edit(&mut h, &mut raw);
    let new_len = u32::try_from(raw.len()).expect("length");
    h[0..4].copy_from_slice(&new_len.to_le_bytes());
    h[40..44].copy_from_slice(&new_len.to_le_bytes());
    h[46] = 0;
    let crc = crc32c::crc32c(&h[0..4]);
    let crc = crc32c::crc32c_append(crc, &h[8..]);
    let crc = crc32c::crc32c_append(crc, &raw);
    h[4..8].copy_from_slice(&crc.to_le_bytes());
    let frame: Vec<u8> = h.iter().chain(raw.iter()).copied().collect();
    let new_frame_len = frame.len() as u64;
    bytes.splice(at..at + hl + len, frame);
    new_frame_len
}

#[test]
fn round_trip_across_segments_with_each_fsync_policy() {
    let policies = [
        FsyncPolicy::EveryRecord,
        FsyncPolicy::Interval(Duration::ZERO),
        FsyncPolicy::Interval(Duration::from_secs(3600)),
        FsyncPolicy::Never,
    ];
    for policy in policies {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("log");
        let cfg = config(policy, 4096);
        let mut w = LogWriter::create(&dir, cfg.clone()).expect("create");
        let mut written = Vec::new();
        for i in 0..300u64 {
            let ev = event(i * 2, 5_000 + i);
            w.append(&ev).expect("append");
            written.push(ev);
        }
        let stats = w.close().expect("close");
        assert_eq!(stats.records, 300, "{policy:?}");
        match policy {
            FsyncPolicy::EveryRecord => {
                assert!(stats.fsyncs >= 300);
                // Each append seals its block.
                assert_eq!(stats.blocks, 300);
            }
            FsyncPolicy::Never => assert_eq!(stats.fsyncs, 0),
            _ => assert!(stats.fsyncs > 0),
        }

        let reader = LogReader::open(&dir, opts()).expect("open");
        let info = reader.info();
        assert!(info.segments.len() >= 4, "{policy:?}: expected rotation");
        assert_eq!(info.segments.len() as u64, stats.segments);
        assert_eq!(
            info.segments.iter().map(|s| s.file_len).sum::<u64>(),
            stats.bytes
        );
        assert_eq!((info.first_seq, info.last_seq), (Some(0), Some(598)));
        assert_eq!(info.time_range_ns, Some((5_000, 5_299)));
        assert_eq!(info.total_records, 300);
        assert_eq!((info.torn_tail.clone(), info.torn_tail_bytes), (None, 0));
        let header = info.header.expect("header");
        assert_eq!((header.schema_version, header.engine_id), (SCHEMA, ENGINE));
        for s in &info.segments {
            let first = s.first_seq.expect("records");
            assert_eq!(s.name, segment_file_name(first));
            assert_eq!(s.header.map(|h| h.first_seq), Some(first));
            assert_eq!(s.index, IndexSource::File, "written on rotation and close");
            assert_eq!(s.status, SegmentStatus::Clean);
        }
        let (records, err) = collect(reader.iter());
        assert!(err.is_none(), "{err:?}");
        assert_eq!(as_written(&records), written);
        for r in &records {
            let seg = info
                .segments
                .iter()
                .find(|s| *s.name == *r.segment)
                .expect("segment");
            assert!(seg.first_seq <= Some(r.event.seq) && Some(r.event.seq) <= seg.last_seq);
            assert!(r.offset >= SEGMENT_HEADER_LEN && r.offset < seg.file_len);
        }
        // Block by block, without records: the same events, in the same
        // blocks at the same places.
        let mut blocks = reader.blocks();
        let (mut n, mut n_blocks) = (0, 0);
        while let Some(b) = blocks.next_block() {
            let b = b.expect("block");
            let mut events = Vec::new();
            b.view.decode_into(&mut events).expect("decode");
            assert!(!events.is_empty(), "{policy:?}: an empty block");
            assert_eq!(b.view.len(), events.len());
            assert_eq!(
                b.view.seqs_and_timestamps().collect::<Vec<_>>(),
                events.iter().map(|e| (e.seq, e.ts_ns)).collect::<Vec<_>>()
            );
            for (k, e) in events.iter().enumerate() {
                assert_eq!(e, &written[n + k], "{policy:?}");
                assert_eq!(
                    (&*records[n + k].segment, records[n + k].offset),
                    (&**b.segment, b.offset),
                    "{policy:?}"
                );
            }
            n += events.len();
            n_blocks += 1;
        }
        assert_eq!((n, n_blocks), (300, stats.blocks), "{policy:?}");

        // Reopen and go on. Closed cleanly, its index stored: the blocks'
        // checksums are checked, their contents not decoded again.
        let mut w = LogWriter::open_append(&dir, cfg.clone()).expect("open_append");
        assert_eq!(w.last_seq(), Some(598));
        assert_eq!(w.recovery().truncated, None);
        assert!(!w.recovery().last_segment_decoded, "{policy:?}");
        for seq in 599..650 {
            let ev = event(seq, 9_000 + seq);
            w.append(&ev).expect("append");
            written.push(ev);
        }
        w.close().expect("close");
        let (records, err) = read_all(&dir, no_index());
        assert!(err.is_none(), "{err:?}");
        assert_eq!(as_written(&records), written);

        // Without the last segment's index (as after a crash), or with one
        // that no longer describes it, the blocks are decoded and checked.
        let last = segments_in(&dir).pop().expect("a segment");
        let idx = PathBuf::from(format!("{}.idx", last.display()));
        let kept = fs::read(&idx).expect("the index of a cleanly closed segment");
        fs::remove_file(&idx).expect("remove the index");
        let w = LogWriter::open_append(&dir, cfg.clone()).expect("open_append");
        assert!(w.recovery().last_segment_decoded, "{policy:?}");
        assert_eq!(w.last_seq(), Some(649));
        w.close().expect("close");
        let mut w = LogWriter::open_append(&dir, cfg.clone()).expect("open_append");
        w.append(&event(650, 9_650)).expect("append");
        w.close().expect("close");
        fs::write(&idx, kept).expect("an index from before the last append");
        let w = LogWriter::open_append(&dir, cfg).expect("open_append");
        assert!(
            w.recovery().last_segment_decoded,
            "{policy:?}: a stale index"
        );
        assert_eq!(w.last_seq(), Some(650));
    }
}

/// Cuts the last segment at every byte offset: each cut leaves every record
/// before the torn one readable, the reader stops cleanly, and the writer
/// truncates and continues with the next seq.
#[test]
fn torn_tail_at_every_offset_of_the_last_segment() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let orig = tmp.path().join("orig");
    let written = write_log(&orig, config(FsyncPolicy::Never, 2048), 75, 10, 1);
    let (records, _) = read_all(&orig, opts());
    let blocks = blocks_of(&orig, &records);
    let last_path = segments_in(&orig).pop().expect("segments");
    let last_name = name_of(&last_path);
    let last_len = fs::metadata(&last_path).expect("meta").len();
    // (index, end of its block's frame) of the last segment's records.
    let in_last: Vec<(usize, u64)> = records
        .iter()
        .enumerate()
        .filter(|(_, r)| *r.segment == *last_name)
        .map(|(i, _)| (i, blocks[i].1))
        .collect();
    let blocks_in_last = {
        let mut ends: Vec<u64> = in_last.iter().map(|(_, e)| *e).collect();
        ends.dedup();
        ends.len()
    };
    assert!(
        blocks_in_last >= 3 && in_last.len() > blocks_in_last,
        "the last segment should hold several blocks of several records: {blocks_in_last} blocks, {} records",
        in_last.len()
    );
    let before_last = in_last[0].0;

    let case = tmp.path().join("case");
    for cut in 0..last_len {
        copy_dir(&orig, &case);
        let seg = case.join(&last_name);
        fs::OpenOptions::new()
            .write(true)
            .open(&seg)
            .and_then(|f| f.set_len(cut))
            .expect("truncate");
        let complete = in_last.iter().filter(|(_, end)| *end <= cut).count();
        let good_end = in_last
            .iter()
            .map(|(_, e)| *e)
            .filter(|e| *e <= cut)
            .max()
            .unwrap_or(SEGMENT_HEADER_LEN);
        let expect = &written[..before_last + complete];

        let (got, err) = read_all(&case, opts());
        assert!(err.is_none(), "cut {cut}: {err:?}");
        assert_eq!(as_written(&got), expect, "cut {cut}");
        let info = LogReader::open(&case, opts()).expect("open").info().clone();
        let torn = if cut < SEGMENT_HEADER_LEN {
            cut
        } else {
            cut - good_end
        };
        assert_eq!(info.torn_tail_bytes, torn, "cut {cut}");

        let mut w =
            LogWriter::open_append(&case, config(FsyncPolicy::Never, 2048)).expect("open_append");
        let rec = w.recovery().clone();
        // A cut segment is checked whole before the writer appends to it,
        // torn or cut at a block's end (its stored index then describes
        // more than is there); one with nothing complete is removed, and
        // the one before it, closed cleanly, is the last.
        assert_eq!(rec.last_segment_decoded, complete > 0, "cut {cut}");
        if complete == 0 {
            assert_eq!(rec.removed_segments, vec![last_name.clone()], "cut {cut}");
        } else if torn > 0 {
            let t = rec.truncated.expect("truncated");
            assert_eq!(
                (t.segment.as_str(), t.offset, t.bytes),
                (last_name.as_str(), good_end, torn)
            );
        } else {
            assert_eq!(rec.truncated, None);
        }
        let next = expect.last().map_or(0, |e| e.seq) + 1;
        assert_eq!(w.last_seq(), Some(next - 1));
        let after = event(next, 1);
        w.append(&after).expect("append after recovery");
        w.close().expect("close");
        let (got, err) = read_all(&case, no_index());
        assert!(err.is_none(), "cut {cut}: {err:?}");
        assert_eq!(got.len(), expect.len() + 1);
        assert_eq!(as_written(&got[..expect.len()]), expect);
        assert_eq!(got[expect.len()].event, after, "cut {cut}");
    }
}

/// Flips a bit in every byte of the blocks of chosen events: the reader
/// yields every record of the blocks before the damaged one, then `Corrupt`
/// naming the segment and the block's offset.
#[test]
fn a_flipped_byte_mid_log_is_reported_with_segment_and_offset() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let orig = tmp.path().join("orig");
    let written = write_log(&orig, config(FsyncPolicy::Never, 2048), 120, 0, 1);
    let (records, _) = read_all(&orig, opts());
    let blocks = blocks_of(&orig, &records);
    let segs = segments_in(&orig);
    assert!(segs.len() >= 3);
    let last_name = name_of(segs.last().expect("last"));
    let first_name = name_of(&segs[0]);
    let pick = |seg: &str, which: &dyn Fn(usize) -> usize| -> usize {
        let idx: Vec<usize> = (0..records.len())
            .filter(|&i| *records[i].segment == *seg)
            .collect();
        idx[which(idx.len())]
    };
    let targets = [
        ("middle of the last segment", pick(&last_name, &|n| n / 2)),
        ("middle of the first segment", pick(&first_name, &|n| n / 2)),
        ("end of the first segment", pick(&first_name, &|n| n - 1)),
        ("first record of the log", 0),
    ];
    let case = tmp.path().join("case");
    for (what, pick) in targets {
        let r = &records[pick];
        let (_, end, i) = blocks[pick];
        if *r.segment == *last_name {
            assert!(end < fs::metadata(orig.join(&last_name)).expect("meta").len());
        }
        for at in r.offset..end {
            copy_dir(&orig, &case);
            let path = case.join(&*r.segment);
            let mut bytes = fs::read(&path).expect("read");
            bytes[at as usize] ^= 0x20;
            fs::write(&path, &bytes).expect("write");
            for o in [opts(), no_index()] {
                let trusted = o.trust_index;
                let (got, err) = read_all(&case, o.clone());
                assert_eq!(
                    as_written(&got),
                    written[..i],
                    "{what}, byte {at}, trust {trusted}"
                );
                let err = err.unwrap_or_else(|| panic!("{what}, byte {at}: no error"));
                assert_eq!(
                    err.corrupt_at(),
                    Some((&*r.segment, r.offset)),
                    "{what}, byte {at}: {err}"
                );
                if !trusted {
                    let info = LogReader::open(&case, o).expect("open").info().clone();
                    let damage = info.first_damage().expect("found on open");
                    assert_eq!(damage.corrupt_at(), Some((&*r.segment, r.offset)));
                }
            }
            let reopened = LogWriter::open_append(&case, config(FsyncPolicy::Never, 2048));
            if *r.segment == *last_name {
                // Appending after damage would strand the new records.
                let e = reopened.expect_err("refused");
                assert_eq!(e.corrupt_at(), Some((&*r.segment, r.offset)), "{e}");
            } else {
                // Damage in a sealed segment does not stop the recorder.
                let mut w = reopened.expect("open_append");
                let more = event(1_000, 0);
                w.append(&more).expect("append");
                w.close().expect("close");
                let reader = LogReader::open(&case, opts()).expect("open");
                let (got, err) = collect(reader.iter());
                assert_eq!(got.len(), i);
                assert_eq!(
                    err.and_then(|e| e.corrupt_at().map(|(s, o)| (s.to_string(), o))),
                    Some((r.segment.to_string(), r.offset))
                );
                let after = reader
                    .iter_from_seq(1_000)
                    .next()
                    .expect("some")
                    .expect("record");
                assert_eq!(after.event, more);
            }
        }
    }
}

#[test]
fn seeks_land_on_the_right_record_with_or_without_index_files() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let orig = tmp.path().join("orig");
    // Seqs with gaps: 1000, 1003, ...; ts 1000, 1010, ...
    let written = write_log(&orig, config(FsyncPolicy::Never, 4096), 400, 1000, 3);
    let n_segments = segments_in(&orig).len();
    assert!(n_segments >= 4);
    let idx_files = || -> Vec<PathBuf> {
        segments_in(&orig)
            .iter()
            .map(|s| s.with_file_name(format!("{}.idx", name_of(s))))
            .collect()
    };
    assert!(idx_files().iter().all(|p| p.exists()));

    type Damage = fn(&Path);
    let variants: [(&str, Damage); 5] = [
        ("index files as written", |_| {}),
        ("index files deleted", |p| fs::remove_file(p).expect("rm")),
        ("a flipped byte in each index", |p| {
            let mut b = fs::read(p).expect("read");
            let at = b.len() / 2;
            b[at] ^= 1;
            fs::write(p, b).expect("write");
        }),
        ("index files of garbage", |p| {
            fs::write(p, vec![0xA5u8; 200]).expect("write")
        }),
        ("each index truncated", |p| {
            let b = fs::read(p).expect("read");
            fs::write(p, &b[..b.len() - 9]).expect("write");
        }),
    ];
    let case = tmp.path().join("case");
    for (what, damage) in variants {
        copy_dir(&orig, &case);
        for p in idx_files() {
            damage(&case.join(p.file_name().expect("name")));
        }
        let reader = LogReader::open(&case, opts()).expect("open");
        let info = reader.info();
        let rebuilt = info
            .segments
            .iter()
            .filter(|s| matches!(s.index, IndexSource::Scanned { .. }))
            .count();
        let expected_rebuilt = if what == "index files as written" {
            0
        } else {
            n_segments
        };
        assert_eq!(
            (rebuilt, info.indexes_rebuilt),
            (expected_rebuilt, expected_rebuilt),
            "{what}"
        );
        assert_eq!(info.total_records, 400, "{what}");

        for target in 990..1000 + 3 * 400 + 5 {
            let want: Vec<&Event> = written.iter().filter(|e| e.seq >= target).take(3).collect();
            let got: Vec<Event> = reader
                .iter_from_seq(target)
                .take(3)
                .map(|r| r.expect("record").event)
                .collect();
            let got: Vec<&Event> = got.iter().collect();
            assert_eq!(got, want, "{what}: seq {target}");
        }
        for target in (990..1000 + 10 * 400 + 20).step_by(3) {
            let want: Vec<&Event> = written
                .iter()
                .filter(|e| e.ts_ns >= target)
                .take(3)
                .collect();
            let got: Vec<Event> = reader
                .iter_from_time(target)
                .take(3)
                .map(|r| r.expect("record").event)
                .collect();
            let got: Vec<&Event> = got.iter().collect();
            assert_eq!(got, want, "{what}: time {target}");
        }

        // The writer puts the sealed segments' index files back.
        let w =
            LogWriter::open_append(&case, config(FsyncPolicy::Never, 4096)).expect("open_append");
        if expected_rebuilt > 0 {
            assert_eq!(w.recovery().indexes_rebuilt.len(), n_segments - 1, "{what}");
        }
        w.close().expect("close");
        let reader = LogReader::open(&case, opts()).expect("open");
        assert!(
            reader
                .info()
                .segments
                .iter()
                .all(|s| s.index == IndexSource::File),
            "{what}"
        );
    }
}

#[test]
fn snapshots_are_found_and_damaged_ones_are_skipped() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let mut w = LogWriter::create(dir, config(FsyncPolicy::EveryRecord, 4096)).expect("create");
    for seq in 1..=300 {
        w.append(&event(seq, seq * 100)).expect("append");
    }
    for seq in [100u64, 200, 300] {
        w.write_snapshot(seq, seq * 100, format!("state at {seq}").as_bytes())
            .expect("snapshot");
    }
    assert!(matches!(
        w.write_snapshot(301, 0, b"x"),
        Err(LogError::SnapshotAhead { .. })
    ));
    w.close().expect("close");

    let reader = LogReader::open(dir, opts()).expect("open");
    let at = |q| {
        reader
            .latest_snapshot_at_or_before(q)
            .expect("lookup")
            .map(|s| (s.seq, s.bytes))
    };
    assert_eq!(at(SeekTo::Seq(99)), None);
    assert_eq!(at(SeekTo::Seq(100)), Some((100, b"state at 100".to_vec())));
    assert_eq!(at(SeekTo::Seq(299)), Some((200, b"state at 200".to_vec())));
    assert_eq!(
        at(SeekTo::Seq(u64::MAX)),
        Some((300, b"state at 300".to_vec()))
    );
    assert_eq!(
        at(SeekTo::TimeNs(25_000)),
        Some((200, b"state at 200".to_vec()))
    );
    assert_eq!(at(SeekTo::TimeNs(9_999)), None);
    assert_eq!(reader.snapshots_ignored(), 0);
    let s = reader
        .latest_snapshot_at_or_before(SeekTo::Seq(200))
        .expect("lookup")
        .expect("found");
    assert_eq!(
        (s.ts_ns, s.schema_version, s.engine_id),
        (20_000, SCHEMA, ENGINE)
    );

    // Damage the one at 200: the lookup falls back to 100, counted.
    let p200 = dir.join("snapshot-00000000000000000200.bin");
    let mut b = fs::read(&p200).expect("read");
    let last = b.len() - 1;
    b[last] ^= 0xFF;
    fs::write(&p200, &b).expect("write");
    assert_eq!(at(SeekTo::Seq(250)), Some((100, b"state at 100".to_vec())));
    assert_eq!(reader.snapshots_ignored(), 1);
    fs::write(&p200, &b[..20]).expect("truncate");
    assert_eq!(
        at(SeekTo::TimeNs(25_000)),
        Some((100, b"state at 100".to_vec()))
    );
    assert_eq!(reader.snapshots_ignored(), 2);
    // A half-written temporary file is not a snapshot.
    fs::write(
        dir.join("snapshot-00000000000000000250.bin.tmp"),
        b"partial",
    )
    .expect("write");
    assert_eq!(at(SeekTo::Seq(250)).map(|s| s.0), Some(100));
    // And the writer tidies it away.
    LogWriter::open_append(dir, config(FsyncPolicy::Never, 4096))
        .expect("open_append")
        .close()
        .expect("close");
    assert!(!dir.join("snapshot-00000000000000000250.bin.tmp").exists());
}

/// How a crafted block is expected to be refused.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Refusal {
    /// Not at all: the control.
    None,
    /// `CorruptReason::Verify`: the flatbuffers verifier or column checks.
    Verify,
    /// `CorruptReason::BadBlock`: the region does not match its header.
    BadBlock,
}

/// An edit of a block's frame header and of its region.
type Edit = fn(&mut [u8; FRAME_HEADER_LEN as usize], &mut Vec<u8>);

/// The crafted blocks of
/// [`a_block_that_fails_verification_is_corruption_at_that_block`]: what
/// each edit does, the edit, and how the block is expected to be refused.
fn crafted_blocks() -> [(&'static str, Edit, Refusal); 7] {
    [
        ("rewritten stored, unchanged", |_, _| {}, Refusal::None),
        (
            "file identifier damaged",
            |_, raw| raw[4..8].copy_from_slice(b"KVBX"),
            Refusal::Verify,
        ),
        (
            "root offset past the end",
            |_, raw| {
                let past = u32::try_from(raw.len() + 8).expect("u32");
                raw[0..4].copy_from_slice(&past.to_le_bytes());
            },
            Refusal::Verify,
        ),
        (
            "region cut in half",
            |_, raw| raw.truncate(raw.len() / 2),
            Refusal::Verify,
        ),
        ("region of zeros", |_, raw| raw.fill(0), Refusal::Verify),
        (
            "header timestamps moved past the events'",
            |h, _| {
                for at in [24, 32] {
                    let ts = u64::from_le_bytes(h[at..at + 8].try_into().expect("u64"));
                    h[at..at + 8].copy_from_slice(&(ts + 1).to_le_bytes());
                }
            },
            Refusal::BadBlock,
        ),
        (
            "header event count off by one",
            |h, _| {
                let count = u16::from_le_bytes([h[44], h[45]]);
                let wrong = if count > 1 { count - 1 } else { count + 1 };
                h[44..46].copy_from_slice(&wrong.to_le_bytes());
            },
            Refusal::BadBlock,
        ),
    ]
}

/// A block whose frame is sound (length and checksum good) but whose
/// contents fail verification, or do not match the frame header, is
/// corruption at that block: every event of the blocks before it is read,
/// then `Corrupt` with the segment and the block's offset, through both the
/// event and the block iterators, with or without index files. Seeking past
/// it does not run into it.
#[test]
fn a_block_that_fails_verification_is_corruption_at_that_block() {
    let variants = crafted_blocks();
    let tmp = tempfile::tempdir().expect("tempdir");
    // One event per block, and two or three.
    for block_bytes in [1, 300] {
        let orig = tmp.path().join(format!("orig-{block_bytes}"));
        let cfg = LogConfig {
            block_bytes,
            ..config(FsyncPolicy::Never, 1 << 20)
        };
        let mut w = LogWriter::create(&orig, cfg).expect("create");
        let written: Vec<Event> = (0..10u64).map(|seq| event(seq, 10 * seq)).collect();
        for ev in &written {
            w.append(ev).expect("append");
        }
        w.close().expect("close");
        let (all, err) = read_all(&orig, opts());
        assert!(err.is_none(), "{err:?}");
        assert_eq!(as_written(&all), written);
        // The block holding seq 6.
        let victim = &all[6];
        let first = all
            .iter()
            .position(|r| r.offset == victim.offset)
            .expect("first");
        let after = all
            .iter()
            .rposition(|r| r.offset == victim.offset)
            .expect("last")
            + 1;
        assert!(after < all.len(), "a block after the victim");
        if block_bytes == 1 {
            assert_eq!((first, after), (6, 7));
        } else {
            assert!(after - first >= 2, "several events in the victim's block");
        }
        let segment = victim.segment.to_string();
        assert_eq!(segment, segment_file_name(0));

        for (what, edit, refusal) in variants {
            if what.starts_with("header event count") && after - first == 1 {
                // A one-event block cannot claim another count without its
                // frame header failing its own checks (seq span), which a
                // seek runs into too; the timestamp variant covers it.
                continue;
            }
            let what = format!("{what}, block_bytes {block_bytes}");
            let case = tmp.path().join("case");
            copy_dir(&orig, &case);
            let path = case.join(&segment);
            let mut bytes = fs::read(&path).expect("read");
            rewrite_block(&mut bytes, victim.offset, edit);
            fs::write(&path, &bytes).expect("write");

            for o in [opts(), no_index()] {
                let trusted = o.trust_index;
                let (got, err) = read_all(&case, o.clone());
                if refusal == Refusal::None {
                    assert!(err.is_none(), "{what}, trust {trusted}: {err:?}");
                    assert_eq!(as_written(&got), written, "{what}, trust {trusted}");
                    continue;
                }
                assert_eq!(
                    as_written(&got),
                    written[..first],
                    "{what}, trust {trusted}"
                );
                let check = |err: Option<LogError>| match err {
                    Some(LogError::Corrupt {
                        segment: s,
                        offset,
                        reason,
                    }) => {
                        assert_eq!(
                            (s.as_str(), offset),
                            (segment.as_str(), victim.offset),
                            "{what}, trust {trusted}: {reason}"
                        );
                        let kind = match reason {
                            CorruptReason::Verify(_) => Refusal::Verify,
                            CorruptReason::BadBlock(_) => Refusal::BadBlock,
                            other => panic!("{what}, trust {trusted}: {other}"),
                        };
                        assert_eq!(kind, refusal, "{what}, trust {trusted}");
                    }
                    other => panic!("{what}, trust {trusted}: expected corruption, got {other:?}"),
                };
                check(err);

                // The block iterator: the blocks before it, then the same.
                let reader = LogReader::open(&case, o).expect("open");
                let mut blocks = reader.blocks();
                let mut events = Vec::new();
                let err = loop {
                    match blocks.next_block() {
                        Some(Ok(b)) => b.view.decode_into(&mut events).expect("decode"),
                        Some(Err(e)) => break Some(e),
                        None => break None,
                    }
                };
                assert_eq!(events, written[..first], "{what}, trust {trusted}");
                check(err);
                assert!(
                    blocks.next_block().is_none(),
                    "{what}: blocks after the error"
                );

                // Seeking past it does not run into it.
                let (rest, err) = collect(reader.iter_from_seq(after as u64));
                assert!(err.is_none(), "{what}, trust {trusted}: {err:?}");
                assert_eq!(as_written(&rest), written[after..], "{what}");
            }

            // A writer does not append after it: new events would sit where
            // no reader gets to them.
            let reopened = LogWriter::open_append(
                &case,
                LogConfig {
                    block_bytes,
                    ..config(FsyncPolicy::Never, 1 << 20)
                },
            );
            match (refusal, reopened) {
                (Refusal::None, Ok(w)) => assert_eq!(w.last_seq(), Some(9), "{what}"),
                (Refusal::None, Err(e)) => panic!("{what}: open_append refused: {e}"),
                (_, Ok(_)) => panic!("{what}: open_append accepted a block that fails"),
                (_, Err(e)) => assert_eq!(
                    e.corrupt_at(),
                    Some((segment.as_str(), victim.offset)),
                    "{what}: {e}"
                ),
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Fuzzing

/// SplitMix64: small, deterministic, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Applies one random mutation.
fn mutate(rng: &mut Rng, b: &mut Vec<u8>) {
    let len = b.len();
    match rng.below(8) {
        0 if len > 0 => {
            let at = rng.below(len);
            b[at] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let at = rng.below(len);
            b[at] = rng.next() as u8;
        }
        2 => b.truncate(rng.below(len + 1)),
        3 => {
            let at = rng.below(len + 1);
            let n = 1 + rng.below(30);
            let ins = rng.bytes(n);
            b.splice(at..at, ins);
        }
        4 if len > 0 => {
            let at = rng.below(len);
            let n = 1 + rng.below((len - at).min(40));
            b.drain(at..at + n);
        }
        5 if len > 0 => {
            let at = rng.below(len);
            let n = 1 + rng.below((len - at).min(60));
            let dup = b[at..at + n].to_vec();
            let to = rng.below(len + 1);
            b.splice(to..to, dup);
        }
        6 if len >= 4 => {
            // A length-like field: small, huge, or just past the maximum.
            let at = rng.below(len - 3);
            let v: u32 = match rng.below(4) {
                0 => rng.below(64) as u32,
                1 => u32::MAX - rng.below(4) as u32,
                2 => MAX_BLOCK_BYTES - 1 + rng.below(3) as u32,
                _ => (16 << 20) + rng.below(2) as u32,
            };
            b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        _ => {
            let at = rng.below(len + 1);
            let n = rng.below(16);
            b.splice(at..at, std::iter::repeat_n(0u8, n));
        }
    }
}

/// Files of a log directory: (name, bytes).
type Files = Vec<(String, Vec<u8>)>;
/// Events as written, by seq.
type Known = BTreeMap<u64, Event>;

/// A small valid log used as fuzz material: its files and its records.
struct Base {
    files: Files,
    records: Known,
}

fn base(tmp: &Path, name: &str, n: u64, segment_bytes: u64, block_bytes: u32) -> Base {
    let dir = tmp.join(name);
    let cfg = LogConfig {
        block_bytes,
        ..config(FsyncPolicy::Never, segment_bytes)
    };
    let mut w = LogWriter::create(&dir, cfg).expect("create");
    let mut records = BTreeMap::new();
    for i in 0..n {
        let ev = event(3 + i * 2, 50 + i);
        w.append(&ev).expect("append");
        records.insert(ev.seq, ev);
    }
    w.write_snapshot(3 + (n / 2) * 2, 50 + n / 2, b"snap")
        .expect("snapshot");
    w.close().expect("close");
    let mut files: Files = fs::read_dir(&dir)
        .expect("read_dir")
        .map(|e| {
            let e = e.expect("entry");
            (
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path()).expect("read"),
            )
        })
        .collect();
    files.sort();
    Base { files, records }
}

/// Fuzz material: three small valid logs (one segment of one compressed
/// block; one segment of a few blocks; several segments of small blocks
/// with their index files), plus a valid segment header.
struct Material {
    one: Base,
    blocks: Base,
    two: Base,
    header: Vec<u8>,
    _tmp: tempfile::TempDir,
}

fn material() -> Material {
    let tmp = tempfile::tempdir().expect("tempdir");
    let one = base(tmp.path(), "one", 24, 1 << 20, 1 << 16);
    let blocks = base(tmp.path(), "blocks", 10, 1 << 20, 12);
    let two = base(tmp.path(), "two", 8, 160, 8);
    assert!(
        two.files
            .iter()
            .filter(|(n, _)| n.ends_with(".kvlog"))
            .count()
            >= 2
    );
    // `one` is a segment of one LZ4 block, and the segment is its first
    // file (then its index, then the snapshot).
    let seg = &one.files[0].1;
    let frame = &seg[SEGMENT_HEADER_LEN as usize..];
    let body = u32::from_le_bytes(frame[0..4].try_into().expect("u32")) as u64;
    assert_eq!(
        SEGMENT_HEADER_LEN + FRAME_HEADER_LEN + body,
        seg.len() as u64,
        "one block"
    );
    assert_eq!(frame[46], 1, "compressed");
    let header = seg[..SEGMENT_HEADER_LEN as usize].to_vec();
    Material {
        one,
        blocks,
        two,
        header,
        _tmp: tmp,
    }
}

/// One fuzz case: the files of a log directory, and the records that were
/// written to them when they come from a valid log (`None` for random bytes).
fn fuzz_case<'m>(rng: &mut Rng, m: &'m Material) -> (Files, Option<&'m Known>) {
    let pick = |rng: &mut Rng, files: &[(String, Vec<u8>)], suffix: &str| -> usize {
        let of: Vec<usize> = (0..files.len())
            .filter(|&i| files[i].0.ends_with(suffix))
            .collect();
        of[rng.below(of.len())]
    };
    match rng.below(7) {
        0 => {
            let n = rng.below(120);
            (vec![(segment_file_name(0), rng.bytes(n))], None)
        }
        1 => {
            let n = rng.below(120);
            let mut b = m.header.clone();
            b.extend(rng.bytes(n));
            (vec![(segment_file_name(3), b)], None)
        }
        kind @ (2 | 3) => {
            let src = match (kind, rng.below(2)) {
                (2, 0) => &m.one,
                (2, _) => &m.blocks,
                _ => &m.two,
            };
            let mut files = src.files.clone();
            let which = pick(rng, &files, ".kvlog");
            for _ in 0..1 + rng.below(3) {
                mutate(rng, &mut files[which].1);
            }
            (files, Some(&src.records))
        }
        4 => {
            // Damaged derived data: an index file or a snapshot.
            let mut files = m.two.files.clone();
            let suffix = if rng.below(2) == 0 { ".idx" } else { ".bin" };
            let which = pick(rng, &files, suffix);
            mutate(rng, &mut files[which].1);
            (files, Some(&m.two.records))
        }
        5 => {
            // Several mutations across files.
            let mut files = m.two.files.clone();
            for _ in 0..2 + rng.below(4) {
                let which = rng.below(files.len());
                mutate(rng, &mut files[which].1);
            }
            (files, Some(&m.two.records))
        }
        _ => {
            // A file under the wrong name: a segment or index file renamed.
            let mut files = m.two.files.clone();
            let i = rng.below(files.len());
            let seq = rng.below(40) as u64;
            files[i].0 = if rng.below(2) == 0 {
                segment_file_name(seq)
            } else {
                index_file_name(seq)
            };
            files.sort();
            files.dedup_by(|a, b| a.0 == b.0);
            (files, Some(&m.two.records))
        }
    }
}

/// Checks what a reader yields for one fuzz case: never a panic; records in
/// increasing order, each one that was written (when the material is known);
/// then at most one clear error, after which the iterator is finished.
fn check_iter(
    it: impl Iterator<Item = Result<Record, LogError>>,
    known: Option<&Known>,
    files: &[(String, Vec<u8>)],
    case: u64,
) -> usize {
    let mut it = it.fuse();
    let mut prev = None;
    let mut n = 0;
    for item in it.by_ref().take(10_000) {
        match item {
            Ok(r) => {
                assert!(prev.is_none_or(|p| r.event.seq > p), "case {case}: order");
                prev = Some(r.event.seq);
                if let Some(known) = known {
                    assert_eq!(
                        known.get(&r.event.seq),
                        Some(&r.event),
                        "case {case}: an event that was never written"
                    );
                }
                n += 1;
            }
            Err(LogError::Corrupt {
                segment, offset, ..
            }) => {
                let file = files.iter().find(|(name, _)| *name == segment);
                let len = file.map_or(0, |(_, b)| b.len() as u64);
                assert!(
                    file.is_some() && offset <= len,
                    "case {case}: corrupt at {segment}:{offset}"
                );
                break;
            }
            Err(LogError::UnsupportedVersion { .. }) => break,
            Err(e) => panic!("case {case}: unexpected error {e}"),
        }
    }
    assert!(
        it.next().is_none(),
        "case {case}: the iterator went on after an error"
    );
    n
}

/// Everything a reader offers, on one fuzz case.
fn check_reader(
    reader: &LogReader,
    rng: &mut Rng,
    known: Option<&Known>,
    files: &[(String, Vec<u8>)],
    case: u64,
) -> usize {
    let n = check_iter(reader.iter(), known, files, case);
    if !case.is_multiple_of(4) {
        return n;
    }
    let target = rng.below(30) as u64;
    check_iter(reader.iter_from_seq(target), known, files, case);
    check_iter(reader.iter_from_time(40 + target), known, files, case);
    let at = if rng.below(2) == 0 {
        SeekTo::Seq(target)
    } else {
        SeekTo::TimeNs(40 + target)
    };
    match reader.latest_snapshot_at_or_before(at) {
        Ok(Some(s)) => assert_eq!(
            s.bytes, b"snap",
            "case {case}: a damaged snapshot was returned"
        ),
        Ok(None) => {}
        Err(e) => panic!("case {case}: snapshot lookup failed: {e}"),
    }
    n
}

fn fuzz_options(rng: &mut Rng) -> ReaderOptions {
    ReaderOptions {
        trust_index: rng.below(2) == 0,
        ..ReaderOptions::default()
    }
}

fn fuzz_cases(default: u64) -> u64 {
    std::env::var("KVBM_LOG_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Random bytes and mutated valid logs (segments, index files, snapshots,
/// file names) through the reader, in memory: 100,000 cases. The reader code
/// is the same as for a directory; only where the bytes come from differs.
#[test]
fn fuzz_reader_with_random_and_mutated_bytes() {
    let cases = fuzz_cases(100_000);
    let started = Instant::now();
    let m = material();
    let mut rng = Rng(0x5EED_1234_ABCD_0042);
    let mut yielded = 0;
    for case in 0..cases {
        let (files, known) = fuzz_case(&mut rng, &m);
        let o = fuzz_options(&mut rng);
        let reader = LogReader::from_files(files.clone(), o)
            .unwrap_or_else(|e| panic!("case {case}: open failed: {e}"));
        yielded += check_reader(&reader, &mut rng, known, &files, case);
    }
    eprintln!(
        "fuzz (in memory): {cases} cases in {:.2?}, {yielded} records yielded",
        started.elapsed()
    );
    assert!(yielded > 0);
}

/// The same material on disk, through the reader and then recovery by the
/// writer: `open_append` either refuses with a clear error or leaves a log
/// that takes a new record and reads it back.
#[test]
fn fuzz_recovery_on_disk() {
    let cases = fuzz_cases(100_000) / 100;
    let started = Instant::now();
    let m = material();
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut rng = Rng(0xD15C_0000_0000_0001);
    let mut recovered = 0;
    for case in 0..cases {
        let dir = tmp.path().join(format!("case{case}"));
        fs::create_dir(&dir).expect("mkdir");
        let (files, known) = fuzz_case(&mut rng, &m);
        for (name, bytes) in &files {
            fs::write(dir.join(name), bytes).expect("write");
        }
        let o = fuzz_options(&mut rng);
        let reader =
            LogReader::open(&dir, o).unwrap_or_else(|e| panic!("case {case}: open failed: {e}"));
        check_reader(&reader, &mut rng, known, &files, case);
        drop(reader);
        match LogWriter::open_append(&dir, config(FsyncPolicy::Never, 160)) {
            Ok(mut w) => {
                let next = w.last_seq().map_or(0, |s| s + 1);
                let new = event(next, 1);
                w.append(&new)
                    .unwrap_or_else(|e| panic!("case {case}: append: {e}"));
                w.close()
                    .unwrap_or_else(|e| panic!("case {case}: close: {e}"));
                let reader = LogReader::open(&dir, opts()).expect("reopen");
                let rec = reader.iter_from_seq(next).next();
                assert!(
                    matches!(&rec, Some(Ok(r)) if r.event == new),
                    "case {case}: the appended record is not readable: {rec:?}"
                );
                recovered += 1;
            }
            Err(
                LogError::Corrupt { .. }
                | LogError::UnsupportedVersion { .. }
                | LogError::ConfigMismatch { .. },
            ) => {}
            Err(e) => panic!("case {case}: open_append failed unclearly: {e}"),
        }
        fs::remove_dir_all(&dir).expect("clean up");
    }
    eprintln!(
        "fuzz (on disk, with recovery): {cases} cases in {:.2?}, {recovered} recovered and appended to",
        started.elapsed()
    );
    assert!(recovered > 0);
}

/// Exact expectations on random small logs: a cut anywhere in the last
/// segment is a clean torn tail after the whole blocks before it; a flip in
/// a block before the last is corruption at that block.
fn small_log(dir: &Path, sizes: &[usize]) -> Vec<Record> {
    let cfg = LogConfig {
        // One to four events to a block, depending on their sizes.
        block_bytes: 256,
        ..config(FsyncPolicy::Never, 1 << 20)
    };
    let mut w = LogWriter::create(dir, cfg).expect("create");
    let written: Vec<Event> = sizes
        .iter()
        .enumerate()
        .map(|(i, n)| sized_event(i as u64, *n))
        .collect();
    for ev in &written {
        w.append(ev).expect("append");
    }
    w.close().expect("close");
    let (records, err) = read_all(dir, opts());
    assert!(err.is_none(), "{err:?}");
    assert_eq!(as_written(&records), written);
    records
}

/// Event `seq` of a size that grows with `n`: `n` block ids, a reason of
/// `n` bytes, or a fixed-size row, with a request id for odd `n`.
fn sized_event(seq: u64, n: usize) -> Event {
    let kind = match seq % 3 {
        0 => EventKind::BlocksAllocated {
            tier: Tier::Disk,
            blocks: (0..n as u32).map(|b| b ^ seq as u32).collect(),
        },
        1 => EventKind::TransferSkipped {
            transfer: seq,
            direction: Direction::HOST_TO_DISK,
            reason: "x".repeat(n),
        },
        _ => EventKind::TokensScheduled {
            prefill: n as u32,
            decode: 0,
            computed: seq as u32,
        },
    };
    Event {
        engine: ENGINE as u32,
        seq,
        ts_ns: seq,
        iteration: seq,
        request: (n % 2 == 1).then(|| Arc::from(format!("req-{n}"))),
        kind,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn prop_cut_is_a_torn_tail(sizes in prop::collection::vec(0usize..48, 1..8), cut_frac in 0.0f64..1.0) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let records = small_log(tmp.path(), &sizes);
        let seg = tmp.path().join(segment_file_name(0));
        let len = fs::metadata(&seg).expect("meta").len();
        let cut = SEGMENT_HEADER_LEN + ((len - SEGMENT_HEADER_LEN) as f64 * cut_frac) as u64;
        let blocks = blocks_of(tmp.path(), &records);
        fs::OpenOptions::new().write(true).open(&seg).and_then(|f| f.set_len(cut)).expect("truncate");
        let (got, err) = read_all(tmp.path(), opts());
        prop_assert!(err.is_none());
        let want: Vec<Event> = records.iter().zip(&blocks).filter(|(_, b)| b.1 <= cut).map(|(r, _)| r.event.clone()).collect();
        prop_assert_eq!(as_written(&got), want);
    }

    #[test]
    fn prop_flip_before_the_last_record_is_corruption_there(sizes in prop::collection::vec(0usize..48, 2..8), pick in any::<prop::sample::Index>(), byte in any::<prop::sample::Index>(), bit in 0u8..8) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let records = small_log(tmp.path(), &sizes);
        let blocks = blocks_of(tmp.path(), &records);
        let last_block = blocks[records.len() - 1].2;
        prop_assume!(last_block > 0);
        let v = pick.index(last_block);
        let victim = &records[v];
        let (start, end, first) = blocks[v];
        let at = start + byte.index((end - start) as usize) as u64;
        let seg = tmp.path().join(segment_file_name(0));
        let mut b = fs::read(&seg).expect("read");
        b[at as usize] ^= 1 << bit;
        fs::write(&seg, b).expect("write");
        let (got, err) = read_all(tmp.path(), opts());
        prop_assert_eq!(as_written(&got), as_written(&records[..first]));
        let err = err.expect("an error");
        let name = segment_file_name(0);
        prop_assert_eq!(err.corrupt_at(), Some((name.as_str(), victim.offset)));
    }
}
