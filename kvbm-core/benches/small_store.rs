//! Where a small store's time goes: vLLM's worker on the CPU backend
//! copying the blocks of one step from vLLM's KV tensors (G1, one region
//! per layer) into kvbm's host tier (G2, a shared file in /dev/shm, one
//! contiguous range per block), batches of 1 or 2 blocks (40 KiB on
//! average, as the tiny model of `kvbm-py/tests/vllm/bench.py` makes:
//! 2 layers of 16 KiB pages).
//!
//! Measured batch by batch, interleaved so the machine's state affects
//! all alike, each into host-tier memory faulted in and not recently
//! written (a 256 MiB tier walked in order, as a store writes a block
//! once):
//!
//! * `engine, ordinary stores`: `MemcpyEngine::transfer_blocking`, the
//!   whole call (batch validation, the pieces, timing and counters), and
//!   the time the engine reports for it (what the recording and bench.py
//!   see);
//! * `engine, streaming stores`: the same with `Stores::Streaming`, as the
//!   vLLM worker builds its G1→G2 engine;
//! * `the same pieces, bare`: the copies the engine makes (one per block
//!   per layer), bare `copy_nonoverlapping`, nothing else;
//! * `one memcpy`: the same number of bytes as one `copy_nonoverlapping`
//!   from one warm buffer into a second mapping like the tier: the plain
//!   copy bench.py compares with.
//!
//! Prints the median and the 90th percentile per batch, and all bytes
//! over all time, per variant. `KVBM_BENCH_QUICK=1` for a short run.

use kvbm_core::Tier;
use kvbm_core::layout::{Layout, LayoutConfig, LayoutKind};
use kvbm_core::storage::HostStorage;
use kvbm_core::transfer::{BlockPair, EngineConfig, MemcpyEngine, Stores, TransferEngine};
use std::sync::Arc;
use std::time::Instant;

const LAYERS: usize = 2;
const PAGE: usize = 16 << 10;
const G1_BLOCKS: usize = 64;
const G2_BLOCKS: usize = 8192; // 256 MiB of 32 KiB blocks

fn layout(blocks: usize, kind: LayoutKind) -> Layout {
    Layout::new(
        LayoutConfig {
            num_blocks: blocks,
            num_layers: LAYERS,
            outer_dim: 1,
            page_size: 32,
            inner_dim: PAGE / 32,
            dtype_bytes: 1,
        },
        kind,
    )
    .expect("bench layout")
}

fn shm_dir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm).expect("tempdir in /dev/shm")
    } else {
        tempfile::tempdir().expect("tempdir")
    }
}

/// A host tier as the vLLM worker makes it: shared, faulted in ahead.
fn tier(dir: &std::path::Path, name: &str) -> Arc<HostStorage> {
    let s = HostStorage::shared(
        dir.join(name),
        layout(G2_BLOCKS, LayoutKind::FullyContiguous),
    )
    .expect("shared tier");
    let len = s.mapped_len();
    // Where MADV_POPULATE_WRITE is missing, the first lap below faults
    // the pages in instead (the warm-up lap is not measured).
    let _ = s.prefault(0, len);
    Arc::new(s)
}

#[derive(Default)]
struct Samples {
    ns: Vec<u64>,
    bytes: u64,
}

impl Samples {
    fn push(&mut self, ns: u64, bytes: usize) {
        self.ns.push(ns);
        self.bytes += bytes as u64;
    }

    fn row(&mut self, name: &str, base: f64) -> f64 {
        self.ns.sort_unstable();
        let at = |q: f64| self.ns[((self.ns.len() - 1) as f64 * q).round() as usize];
        let total: u64 = self.ns.iter().sum();
        let per_batch = self.bytes as f64 / self.ns.len() as f64;
        let med = per_batch / at(0.5) as f64;
        let all = self.bytes as f64 / total as f64;
        let rel = if base > 0.0 {
            med / base * 100.0
        } else {
            100.0
        };
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.2} | {rel:.0}% |",
            at(0.5) as f64 / 1e3,
            at(0.9) as f64 / 1e3,
            med,
            all
        );
        med
    }
}

/// A second mapping like the tier, for the bare copies: a shared file in
/// the same directory, faulted in.
fn mapping(dir: &std::path::Path, name: &str, len: usize) -> memmap2::MmapRaw {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join(name))
        .expect("baseline file");
    f.set_len(len as u64).expect("size baseline file");
    let m = memmap2::MmapOptions::new()
        .len(len)
        .map_raw(&f)
        .expect("map baseline file");
    // Faulted in as the tier is (the warm-up lap does it where
    // MADV_POPULATE_WRITE is missing).
    let _ = m.advise(memmap2::Advice::PopulateWrite);
    m
}

/// "vLLM's" KV tensors: one buffer per layer, block-major, as the worker
/// wraps them (HostStorage::external).
fn kv_tensors() -> Vec<Vec<u8>> {
    (0..LAYERS)
        .map(|l| {
            (0..G1_BLOCKS * PAGE)
                .map(|i| (i % 251) as u8 ^ (l as u8).wrapping_mul(17))
                .collect()
        })
        .collect()
}

/// What one batch took, in ns, by each variant.
#[derive(Default)]
struct Times {
    outside: u64,
    own: u64,
    bare: u64,
    single: u64,
    s_outside: u64,
    s_own: u64,
}

/// Every variant's samples, over all measured batches.
#[derive(Default)]
struct Results {
    e_out: Samples,
    e_own: Samples,
    pieces: Samples,
    one: Samples,
    s_out: Samples,
    s_own: Samples,
}

impl Results {
    fn push(&mut self, t: &Times, bytes: usize) {
        self.e_out.push(t.outside, bytes);
        self.e_own.push(t.own, bytes);
        self.pieces.push(t.bare, bytes);
        self.one.push(t.single, bytes);
        self.s_out.push(t.s_outside, bytes);
        self.s_own.push(t.s_own, bytes);
    }

    /// The table: a row per variant, each against one memcpy's p50.
    fn print_table(mut self) {
        println!(
            "| variant | p50 µs | p90 µs | GB/s at p50 | GB/s all bytes / all time | p50 vs one memcpy |"
        );
        println!("|---|---:|---:|---:|---:|---:|");
        let base = {
            let mut v = self.one.ns.clone();
            v.sort_unstable();
            self.one.bytes as f64 / self.one.ns.len() as f64 / v[(v.len() - 1) / 2] as f64
        };
        self.e_out.row("engine, ordinary stores, whole call", base);
        self.e_own
            .row("engine, ordinary stores, own clock (the recording's)", base);
        self.pieces.row("the same pieces, bare", base);
        self.s_out.row("engine, streaming stores, whole call", base);
        self.s_own.row("engine, streaming stores, own clock", base);
        self.one.row("one memcpy of the same bytes", base);
    }
}

/// The variants' copies of a batch, each into a destination of its own.
struct Copies<'a> {
    /// The engine with ordinary stores.
    engine: &'a MemcpyEngine,
    /// The engine as the vLLM worker builds it for stores.
    streaming: &'a MemcpyEngine,
    /// G1's layers, for the bare pieces.
    ptrs: &'a [*mut u8],
    bare_dst: &'a memmap2::MmapRaw,
    plain_dst: &'a memmap2::MmapRaw,
    /// Two blocks' bytes, for the one memcpy.
    src_plain: &'a [u8],
    /// A block's bytes.
    bb: usize,
}

impl Copies<'_> {
    /// Copies batch `i` (`pairs`, at tier block `dst` on) by every
    /// variant, starting with the one `i` picks.
    fn time(&self, pairs: &[BlockPair], dst: usize, i: usize) -> Times {
        let bytes = pairs.len() * self.bb;
        let mut times = Times::default();
        // Each variant goes first as often as the others: the first to
        // read a source block may find it less warm. Each writes a tier
        // (or mapping) of its own, so every destination is cold.
        for v in 0..4 {
            match (v + i) % 4 {
                // The engine as the vLLM worker builds it for stores.
                3 => (times.s_outside, times.s_own) = whole_call(self.streaming, pairs),
                // The engine, as the worker calls it.
                0 => (times.outside, times.own) = whole_call(self.engine, pairs),
                1 => times.bare = self.bare(pairs),
                2 => times.single = self.one_memcpy(dst, bytes),
                _ => {}
            }
        }
        times
    }

    /// The same pieces as the engine's, bare: ns taken.
    fn bare(&self, pairs: &[BlockPair]) -> u64 {
        let t = Instant::now();
        for p in pairs {
            for (l, from) in self.ptrs.iter().enumerate() {
                // SAFETY: p.src < G1_BLOCKS and p.dst <
                // G2_BLOCKS, so both ranges are inside
                // their allocations, which are distinct.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        from.add(p.src as usize * PAGE),
                        self.bare_dst
                            .as_mut_ptr()
                            .add(p.dst as usize * self.bb + l * PAGE),
                        PAGE,
                    )
                };
            }
        }
        t.elapsed().as_nanos() as u64
    }

    /// One memcpy of the same bytes, to tier block `dst`: ns taken.
    fn one_memcpy(&self, dst: usize, bytes: usize) -> u64 {
        let t = Instant::now();
        // SAFETY: src_plain holds 2 blocks; dst + n <= G2_BLOCKS.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.src_plain.as_ptr(),
                self.plain_dst.as_mut_ptr().add(dst * self.bb),
                bytes,
            )
        };
        t.elapsed().as_nanos() as u64
    }
}

/// One `transfer_blocking` call: ns for the whole call, and the ns the
/// engine reports for it.
fn whole_call(engine: &MemcpyEngine, pairs: &[BlockPair]) -> (u64, u64) {
    let t = Instant::now();
    // SAFETY: nothing else touches these storages.
    let stats = unsafe { engine.transfer_blocking(pairs.to_vec()) }.expect("store");
    (
        t.elapsed().as_nanos() as u64,
        stats.elapsed.as_nanos() as u64,
    )
}

/// The engines' bytes are right (a copy that is fast and wrong is no
/// use): the last batch's blocks, read back from both tiers.
fn check_last_batch(
    g1: &HostStorage,
    g2: &HostStorage,
    g2s: &HostStorage,
    last: &[BlockPair],
    bb: usize,
) {
    let (mut out, mut want) = (vec![0u8; bb], vec![0u8; bb]);
    for p in last {
        // SAFETY: all copies are done.
        unsafe {
            g2.read_block(p.dst, &mut out).expect("read g2");
            g1.read_block(p.src, &mut want).expect("read g1");
        }
        assert!(out == want, "the engine's copy differs from its source");
        // SAFETY: as above.
        unsafe { g2s.read_block(p.dst, &mut out) }.expect("read g2s");
        assert!(
            out == want,
            "the streaming engine's copy differs from its source"
        );
    }
}

/// What a reading of the clock costs here, for judging the µs below.
fn print_instant_cost() {
    let t = Instant::now();
    let mut x = t;
    for _ in 0..100_000 {
        x = std::hint::black_box(Instant::now());
    }
    println!(
        "Instant::now() costs {:.0} ns here",
        x.duration_since(t).as_nanos() as f64 / 100_000.0
    );
}

fn main() {
    let quick = std::env::var("KVBM_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let laps = if quick { 1 } else { 4 };
    let dir = shm_dir();
    let mut tensors = kv_tensors();
    let ptrs: Vec<*mut u8> = tensors.iter_mut().map(|t| t.as_mut_ptr()).collect();
    // SAFETY: the tensors outlive the storage and the engine (dropped at the
    // end of main, after them), and nothing else writes them.
    let g1 = Arc::new(
        unsafe {
            HostStorage::external(layout(G1_BLOCKS, LayoutKind::LayerSeparate), ptrs.clone())
        }
        .expect("g1 storage"),
    );
    let bb = g1.layout().block_bytes();
    let g2 = tier(dir.path(), "g2");
    let g2_len = G2_BLOCKS * bb;
    let bare_dst = mapping(dir.path(), "bare", g2_len);
    let plain_dst = mapping(dir.path(), "plain", g2_len);
    let engine =
        MemcpyEngine::new(g1.clone(), Tier::Device, g2.clone(), Tier::Host).expect("engine");
    let src_plain: Vec<u8> = (0..2 * bb).map(|i| (i % 241) as u8).collect();

    let mut results = Results::default();
    let g2s = tier(dir.path(), "g2-streaming");
    let streaming = MemcpyEngine::with_stores(
        g1.clone(),
        Tier::Device,
        g2s.clone(),
        Tier::Host,
        EngineConfig::default(),
        Stores::Streaming,
    )
    .expect("streaming engine");
    let copies = Copies {
        engine: &engine,
        streaming: &streaming,
        ptrs: &ptrs,
        bare_dst: &bare_dst,
        plain_dst: &plain_dst,
        src_plain: &src_plain,
        bb,
    };
    // Batches of 1, 1, 1, 2 blocks: 40 KiB on average.
    let sizes = [1usize, 1, 1, 2];
    let mut src_next = 0u32;
    let mut last = Vec::new();
    for lap in 0..=laps {
        let mut dst = 0usize;
        let mut i = 0usize;
        while dst + 2 <= G2_BLOCKS {
            let n = sizes[i % sizes.len()];
            i += 1;
            let pairs: Vec<BlockPair> = (0..n)
                .map(|k| {
                    src_next = (src_next + 7) % G1_BLOCKS as u32;
                    BlockPair::new(src_next, (dst + k) as u32)
                })
                .collect();
            let bytes = n * bb;
            let times = copies.time(&pairs, dst, i);
            if lap > 0 {
                results.push(&times, bytes);
            }
            last = pairs;
            dst += n;
        }
    }
    check_last_batch(&g1, &g2, &g2s, &last, bb);

    println!(
        "kvbm small-store bench: {} batches of 1-2 blocks of {} KiB ({LAYERS} layers x {} KiB), avg {} KiB, into a {} MiB shared tier in {} walked in order{}",
        results.e_out.ns.len(),
        bb >> 10,
        PAGE >> 10,
        (results.e_out.bytes / results.e_out.ns.len() as u64) >> 10,
        g2_len >> 20,
        dir.path()
            .parent()
            .map_or("?".into(), |p| p.display().to_string()),
        if quick { " (quick)" } else { "" }
    );
    print_instant_cost();
    println!();
    results.print_table();
    drop(engine);
    drop(streaming);
    drop(g1);
    drop(tensors);
}
