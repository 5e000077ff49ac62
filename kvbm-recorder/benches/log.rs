//! Durable-log throughput and size, beside JSON lines of the same events.
//!
//! Run: `cargo bench -p kvbm-recorder --bench log` (`KVBM_BENCH_QUICK=1`
//! for a short run). The events come from a simulator run (a realistic mix
//! of kinds), repeated with fresh sequence numbers up to the target count.
//! Written with fsync `Never` on both sides (the page cache), read back
//! from the same files, each round's files deleted before the next so that
//! page-cache writeback of one round does not slow the next: kvbm log =
//! gathering events into columnar flatbuffers blocks + LZ4 + frame CRC on
//! write; frame bounds + CRC + decompression + the flatbuffers verifier and
//! the column checks on every block on read (plus a row that also decodes
//! every event); JSON lines = serde_json to a buffered file, and parse
//! back into events.
//!
//! Two rows split a write's cost without a file: encoding the events into
//! columnar blocks of the log's size, and compressing those blocks with
//! LZ4 exactly as the writer does (`lz4_flex` block compression with a
//! small table, reused); the rest of a write is the frame, the checksum and
//! the file. The bytes per event of the blocks before compression are
//! printed beside the log's.
//!
//! Last, reopening a recording to append to it (`RecordingSink::resume`,
//! what a fleet recorder does when an engine whose log it closed for want
//! of events sends again, or after a restart): with its sidecar ending
//! where the log ends, beside the same recording without a sidecar, whose
//! bookkeeping is rebuilt by reading the whole log.

use kvbm_events::Event;
use kvbm_events::bus::TapItem;
use kvbm_recorder::log::{FsyncPolicy, LogConfig, LogReader, LogWriter, ReaderOptions};
use kvbm_recorder::recorder::{RecorderConfig, RecordingSink};
use kvbm_schema::columnar::BlockEncoder;
use kvbm_sim::sim::{SimConfig, Simulator};
use kvbm_sim::workload::{LengthDist, SyntheticConfig, generate};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::time::Instant;

fn events(n: usize) -> Vec<Event> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let w = generate(&SyntheticConfig {
        seed: 5,
        num_requests: 60,
        arrival_rate_per_s: 40.0,
        prompt_len: LengthDist::LogNormal {
            mean: 600.0,
            sigma: 0.5,
        },
        output_len: LengthDist::LogNormal {
            mean: 40.0,
            sigma: 0.5,
        },
        ..SyntheticConfig::default()
    })
    .unwrap();
    let sim = Simulator::new(SimConfig::default(), w, rt.handle()).unwrap();
    let mut tap = sim.emitter().bus().take_tap().unwrap();
    sim.run();
    let mut base = Vec::new();
    while let Ok(TapItem::Event(e)) = tap.try_recv() {
        base.push(e);
    }
    let mut out = Vec::with_capacity(n);
    let mut seq = 0u64;
    while out.len() < n {
        for e in &base {
            let mut e = e.clone();
            e.seq = seq;
            seq += 1;
            out.push(e);
            if out.len() == n {
                break;
            }
        }
    }
    out
}

fn dir_bytes(p: &std::path::Path) -> u64 {
    std::fs::read_dir(p)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "kvlog"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum()
}

fn main() {
    let quick = std::env::var("KVBM_BENCH_QUICK").is_ok_and(|v| v == "1");
    let n = if quick { 100_000 } else { 2_000_000 };
    let evs = events(n);
    let tmp = tempfile::tempdir().unwrap();
    // Three rounds even when quick: one short round is mostly warm-up.
    let rounds = 3;
    let mut best = [f64::MAX; 7];
    let (mut log_bytes, mut json_bytes, mut raw_bytes) = (0, 0, 0);
    for r in 0..rounds {
        let (encode_s, lz4_s, raw) = encode_and_compress(&evs);
        best[5] = best[5].min(encode_s);
        raw_bytes = raw;
        best[6] = best[6].min(lz4_s);
        // kvbm log: write.
        let dir = tmp.path().join(format!("log{r}"));
        let t = Instant::now();
        let mut w = LogWriter::create(
            &dir,
            LogConfig {
                fsync: FsyncPolicy::Never,
                ..LogConfig::default()
            },
        )
        .unwrap();
        for e in &evs {
            w.append(e).unwrap();
        }
        w.close().unwrap();
        best[0] = best[0].min(t.elapsed().as_secs_f64());
        log_bytes = dir_bytes(&dir);
        // Read + verify: every block checked (frame, CRC, LZ4, flatbuffers
        // verifier, columns against each other and the header), every
        // event's seq looked at; nothing decoded into events.
        let t = Instant::now();
        let reader = LogReader::open(&dir, ReaderOptions::default()).unwrap();
        let mut blocks = reader.blocks();
        let mut k = 0u64;
        let mut seqs = 0u64;
        while let Some(b) = blocks.next_block() {
            let b = b.unwrap();
            k += b.view.len() as u64;
            seqs = seqs.wrapping_add(b.view.seqs().fold(0, u64::wrapping_add));
        }
        std::hint::black_box(seqs);
        assert_eq!(k, n as u64);
        best[1] = best[1].min(t.elapsed().as_secs_f64());
        // Read + verify + decode every event into a kvbm-core `Event`.
        let t = Instant::now();
        let mut k = 0u64;
        for rec in reader.iter() {
            k += rec.unwrap().event.seq & 1;
        }
        std::hint::black_box(k);
        best[2] = best[2].min(t.elapsed().as_secs_f64());
        drop(reader);
        std::fs::remove_dir_all(&dir).unwrap();
        let (write_s, read_s, bytes) = json_lines(&evs, &tmp.path().join(format!("j{r}.jsonl")));
        best[3] = best[3].min(write_s);
        json_bytes = bytes;
        best[4] = best[4].min(read_s);
    }
    let rate = |s: f64| n as f64 / s / 1e6;
    println!("| {n} events (best of {rounds}) | kvbm log | JSON lines | ratio |");
    println!("|---|---:|---:|---:|");
    println!(
        "| write | {:.2} M events/s | {:.2} M events/s | {:.1}× (target ≥ 2 M/s, ≥ 5×) |",
        rate(best[0]),
        rate(best[3]),
        best[3] / best[0]
    );
    let ns = |s: f64| s * 1e9 / n as f64;
    println!(
        "| encode alone (columnar blocks, no LZ4, no file) | {:.2} M events/s = {:.1} ns/event | — | — |",
        rate(best[5]),
        ns(best[5])
    );
    println!(
        "| LZ4 alone (those blocks, as the writer compresses them) | {:.2} M events/s = {:.1} ns/event | — | — |",
        rate(best[6]),
        ns(best[6])
    );
    println!(
        "| read + verify (log) / read + parse (JSON) | {:.2} M events/s | {:.2} M events/s | {:.1}× (target ≥ 5 M/s, ≥ 5×) |",
        rate(best[1]),
        rate(best[4]),
        best[4] / best[1]
    );
    println!(
        "| read + verify + decode to events | {:.2} M events/s | {:.2} M events/s | {:.1}× |",
        rate(best[2]),
        rate(best[4]),
        best[4] / best[2]
    );
    println!(
        "| bytes per event | {:.1} | {:.1} | {:.2}× smaller (target ≥ 3×) |",
        log_bytes as f64 / n as f64,
        json_bytes as f64 / n as f64,
        json_bytes as f64 / log_bytes as f64
    );
    println!(
        "| bytes per event of the blocks before LZ4 (no frames) | {:.1} | {:.1} | {:.2}× smaller |",
        raw_bytes as f64 / n as f64,
        json_bytes as f64 / n as f64,
        json_bytes as f64 / raw_bytes as f64
    );
    println!();
    println!(
        "write: {:.1} ns/event = encode {:.1} + LZ4 {:.1} + frames, checksums and file {:.1}",
        ns(best[0]),
        ns(best[5]),
        ns(best[6]),
        ns(best[0]) - ns(best[5]) - ns(best[6])
    );
    println!();
    // Once and five times the events: a log of one segment, and one of
    // several (64 MiB each), whose reopening still scans only the last.
    for times in [1, 5] {
        let (with, without) = reopen(&evs, times, &tmp.path().join("reopen"), rounds);
        println!(
            "reopen a recording of {} events to append (best of {rounds}): sidecar agreeing {:.1} ms, no sidecar (the log read whole) {:.1} ms: {:.1}× faster",
            n * times,
            with * 1e3,
            without * 1e3,
            without / with
        );
    }
}

/// Seconds to encode `evs` into columnar blocks of the log's size (no
/// log), seconds to compress those blocks with LZ4 as the writer does
/// (timed without the encoding), and the blocks' bytes before LZ4.
fn encode_and_compress(evs: &[Event]) -> (f64, f64, usize) {
    // Encoding alone (no log): events into blocks of the log's size.
    let block_bytes = LogConfig::default().block_bytes as usize;
    let t = Instant::now();
    let mut enc = BlockEncoder::new();
    let mut k = 0usize;
    for e in evs {
        let size = kvbm_schema::columnar::event_bytes(e);
        if !enc.try_push(e, size, block_bytes) {
            k += enc.finish().len();
            enc.try_push(e, size, usize::MAX);
        }
    }
    k += enc.finish().len();
    std::hint::black_box(k);
    let encode_s = t.elapsed().as_secs_f64();
    let raw_bytes = k;
    // LZ4 alone: the same blocks, kept, then compressed as the writer
    // compresses them (timed without the encoding).
    let mut blocks: Vec<Vec<u8>> = Vec::new();
    for e in evs {
        let size = kvbm_schema::columnar::event_bytes(e);
        if !enc.try_push(e, size, block_bytes) {
            blocks.push(enc.finish().to_vec());
            enc.try_push(e, size, usize::MAX);
        }
    }
    blocks.push(enc.finish().to_vec());
    let mut table = lz4_flex::block::CompressTable::small();
    let mut out = Vec::new();
    let t = Instant::now();
    let mut k = 0usize;
    for b in &blocks {
        out.clear();
        out.resize(lz4_flex::block::get_maximum_output_size(b.len()), 0);
        k += lz4_flex::block::compress_into_with_table(b, &mut out, &mut table).unwrap();
    }
    std::hint::black_box(k);
    let lz4_s = t.elapsed().as_secs_f64();
    drop(blocks);
    (encode_s, lz4_s, raw_bytes)
}

/// Seconds to write `evs` as JSON lines to `path`, seconds to read and
/// parse them back, and the file's bytes; the file is removed after.
fn json_lines(evs: &[Event], path: &std::path::Path) -> (f64, f64, u64) {
    // JSON lines: write.
    let t = Instant::now();
    let mut f = BufWriter::new(std::fs::File::create(path).unwrap());
    for e in evs {
        serde_json::to_writer(&mut f, e).unwrap();
        f.write_all(b"\n").unwrap();
    }
    f.flush().unwrap();
    drop(f);
    let write_s = t.elapsed().as_secs_f64();
    let json_bytes = std::fs::metadata(path).unwrap().len();
    // JSON lines: read + parse.
    let t = Instant::now();
    let mut k = 0u64;
    for line in BufReader::new(std::fs::File::open(path).unwrap()).lines() {
        let e: Event = serde_json::from_str(&line.unwrap()).unwrap();
        k += e.seq & 1;
    }
    std::hint::black_box(k);
    let read_s = t.elapsed().as_secs_f64();
    std::fs::remove_file(path).unwrap();
    (write_s, read_s, json_bytes)
}

/// Best times of reopening (and closing again) a recording of `evs`
/// `times` over (seqs renumbered) in `dir`: with its sidecar, and with the
/// sidecar removed first.
fn reopen(evs: &[Event], times: usize, dir: &std::path::Path, rounds: usize) -> (f64, f64) {
    let cfg = RecorderConfig {
        log: LogConfig {
            fsync: FsyncPolicy::Never,
            ..RecorderConfig::default().log
        },
        snapshot_every_events: 0,
        ..RecorderConfig::default()
    };
    let mut sink = RecordingSink::resume(dir, &cfg).unwrap();
    let mut seq = 0;
    for _ in 0..times {
        for e in evs {
            let mut e = e.clone();
            e.seq = seq;
            seq += 1;
            sink.append(&e).unwrap();
        }
    }
    sink.finish().unwrap();
    let n = seq;
    let mut best = (f64::MAX, f64::MAX);
    for _ in 0..rounds {
        let t = Instant::now();
        let sink = RecordingSink::resume(dir, &cfg).unwrap();
        assert_eq!(sink.recording().events, n);
        sink.finish().unwrap();
        best.0 = best.0.min(t.elapsed().as_secs_f64());
        // Without it; the close writes it again for the next round.
        std::fs::remove_file(dir.join(kvbm_recorder::sidecar::SIDECAR)).unwrap();
        let t = Instant::now();
        let sink = RecordingSink::resume(dir, &cfg).unwrap();
        assert_eq!(sink.recording().events, n);
        sink.finish().unwrap();
        best.1 = best.1.min(t.elapsed().as_secs_f64());
    }
    std::fs::remove_dir_all(dir).unwrap();
    best
}
