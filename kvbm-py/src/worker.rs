//! The worker side of the connector, in vLLM's worker process: vLLM's KV
//! tensors wrapped as the G1 storage (no copy), the shared host tier and
//! the disk file opened, and each step's [`StepPlan`] run with kvbm's
//! transfer engines before that step's forward pass (stores first, then
//! loads), reported back in a [`StepReport`].
//!
//! A load that fails is reported as failed blocks, which vLLM computes
//! instead: never different tokens.
//!
//! With no tier (an observer) there is nothing to copy: the tensors are
//! not wrapped, so they may be on any device.

use crate::config::Config;
use crate::meta::{Batch, Done, Pair, Route, StepPlan, StepReport};
use crate::tiers::{Geometry, Shard, TierSizes, disk_path, open_locked, same_file, shm_path};
use kvbm_core::layout::LayoutKind;
use kvbm_core::storage::{DiskStorage, HostStorage, prefault_in_background};
use kvbm_core::transfer::{
    BlockPair, DiskDirection, DiskEngine, EngineConfig, MemcpyEngine, Stores, TransferEngine,
    TransferError, TransferStats, plain_copy,
};
use kvbm_events::Tier;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Bytes of the host tier faulted in per step of the prefault thread
/// (small enough that it stops soon after the tier is dropped).
const PREFAULT_CHUNK: usize = 64 << 20;

/// One of vLLM's per-layer KV tensors, as the Python side reads it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct KvTensor {
    /// The layer's name.
    pub name: String,
    /// Address of its first byte.
    pub data_ptr: u64,
    /// Its size in bytes.
    pub nbytes: u64,
    /// Its first dimension (vLLM's blocks on the CPU backend).
    pub num_blocks: usize,
    /// Bytes between consecutive blocks.
    pub block_stride_bytes: usize,
    /// Whether its bytes are contiguous.
    pub contiguous: bool,
    /// `cpu`, `cuda:0`, ...
    pub device: String,
}

/// Why the worker side could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The settings.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// vLLM's geometry.
    #[error(transparent)]
    Geometry(#[from] crate::tiers::GeometryError),
    /// The KV tensors are not what kvbm can copy.
    #[error("kvbm: vLLM's KV cache tensor {name}: {reason}")]
    Tensor {
        /// The layer.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A tier's storage or engine.
    #[error("kvbm: {what}: {reason}")]
    Tier {
        /// Which.
        what: String,
        /// Why.
        reason: String,
    },
    /// A plan that does not parse.
    #[error(transparent)]
    Meta(#[from] crate::meta::MetaError),
}

/// Test- and bench-only behaviour, from the environment (the real-engine
/// tests use it to check bytes and to show that the check catches a
/// corrupt load; the vLLM bench, to measure the offload's baseline).
#[derive(Debug, Default)]
struct TestHooks {
    /// `KVBM_TEST_DUMP_DIR`: every stored block's bytes go to
    /// `stored/<hash>`, every loaded block's (as it lies in vLLM's tensor
    /// after the load) to `loaded/<hash>`; under tensor parallelism in a
    /// directory per rank, `tp<rank>/`.
    dump: Option<PathBuf>,
    /// `KVBM_TEST_CORRUPT_LOADS`: flips a byte of the first block of each
    /// load, after the copy: always with `1`, or while the file it names
    /// exists (so that one engine can load both ways in one test).
    corrupt_loads: Corrupt,
    /// `KVBM_BENCH_MEMCPY_BASELINE=PREFIX`: see [`Baseline`].
    baseline: Option<Baseline>,
}

/// When loads are corrupted on purpose (tests only).
#[derive(Debug, Default)]
enum Corrupt {
    #[default]
    Never,
    Always,
    WhileExists(PathBuf),
}

impl Corrupt {
    fn now(&self) -> bool {
        match self {
            Corrupt::Never => false,
            Corrupt::Always => true,
            Corrupt::WhileExists(p) => p.exists(),
        }
    }
}

impl TestHooks {
    fn from_env(shard: Shard) -> Self {
        let baseline = std::env::var_os("KVBM_BENCH_MEMCPY_BASELINE").and_then(|prefix| {
            let mut path = prefix;
            path.push(format!(".{}.jsonl", std::process::id()));
            match std::fs::File::create(&path) {
                Ok(file) => Some(Baseline { file, batches: 0 }),
                Err(e) => {
                    tracing::warn!(path = %PathBuf::from(path).display(), error = %e, "no memcpy baseline");
                    None
                }
            }
        });
        let corrupt_loads = match std::env::var_os("KVBM_TEST_CORRUPT_LOADS") {
            None => Corrupt::Never,
            Some(v) if v == "1" => Corrupt::Always,
            Some(v) if v.is_empty() || v == "0" => Corrupt::Never,
            Some(v) => Corrupt::WhileExists(PathBuf::from(v)),
        };
        TestHooks {
            dump: std::env::var_os("KVBM_TEST_DUMP_DIR").map(|d| {
                let d = PathBuf::from(d);
                if shard.ranks > 1 {
                    d.join(format!("tp{}", shard.rank))
                } else {
                    d
                }
            }),
            corrupt_loads,
            baseline,
        }
    }
}

/// The offload benchmark's baseline, measured where the offload runs: each
/// G1→G2 batch is also copied with plain `memcpy` ([`plain_copy`]), from
/// the same vLLM blocks into the same host-tier blocks, just before the
/// engine's copy on even batches and just after it on odd ones. The copy
/// that goes first finds the bytes where vLLM's forward pass left them;
/// the second finds them just read. One JSON line a batch, in
/// `PREFIX.<pid>.jsonl`: `{"first": "plain"|"engine", "bytes",
/// "engine_ns"` (the engine's own clock, as the recording holds it)`,
/// "call_ns"` (the whole call)`, "plain_ns"}`. A trial with it
/// on copies every offload twice, so the bench runs it in trials of their
/// own and does not use their wall time.
#[derive(Debug)]
struct Baseline {
    file: std::fs::File,
    batches: u64,
}

impl Baseline {
    /// Runs `engine_copy` and the plain copy of the same pairs, in this
    /// batch's order, and writes their times.
    fn measure(
        &mut self,
        g1: &HostStorage,
        g2: &HostStorage,
        pairs: &[BlockPair],
        engine_copy: impl FnOnce() -> Result<TransferStats, TransferError>,
    ) -> Result<TransferStats, TransferError> {
        use std::io::Write;
        use std::time::Instant;
        let plain = || {
            let t = Instant::now();
            // SAFETY: the engine's copy of these pairs is running on this
            // thread under the same promise (see WorkerSide::copy): vLLM
            // does not touch them, and G1 and G2 are distinct memory.
            let r = unsafe { plain_copy(g1, g2, pairs) };
            (r, t.elapsed())
        };
        let plain_first = self.batches.is_multiple_of(2);
        self.batches += 1;
        let before = plain_first.then(plain);
        let t = Instant::now();
        let r = engine_copy();
        let call = t.elapsed();
        let (p, plain_t) = before.unwrap_or_else(plain);
        if let (Ok(stats), Ok(bytes)) = (&r, p) {
            let line = serde_json::json!({
                "first": if plain_first { "plain" } else { "engine" },
                "bytes": bytes,
                "engine_ns": stats.elapsed.as_nanos() as u64,
                "call_ns": call.as_nanos() as u64,
                "plain_ns": plain_t.as_nanos() as u64,
            });
            // Bench only: a line that cannot be written is a shorter sample.
            let _ = writeln!(self.file, "{line}");
        }
        r
    }
}

/// The worker side. See the module docs.
pub struct WorkerSide {
    /// vLLM's tensors, when kvbm copies to and from them (an observer
    /// keeps none).
    g1: Option<Arc<HostStorage>>,
    /// The host tier, when there is one.
    g2: Option<Arc<HostStorage>>,
    engines: HashMap<Route, Arc<dyn TransferEngine>>,
    plan: Option<StepPlan>,
    report: StepReport,
    load_errors: Vec<u32>,
    finished_sending: Vec<String>,
    hooks: TestHooks,
    /// Every layer's tensor kept as reported, to check later calls against.
    _tensors: Vec<KvTensor>,
    /// This rank's shared host-tier file, held while the worker lives.
    _shm: Option<ShmHeld>,
}

/// This rank's shared host-tier file, held with a shared lock for the
/// worker's life (so that no other engine's start takes it for a dead
/// engine's: [`crate::tiers::remove_stale`]). vLLM starts its workers
/// before its scheduler, so the worker may be the one that makes it; its
/// scheduler claims it ([`crate::tiers::ShmClaim`]) and removes it at
/// shutdown. Dropped while no scheduler holds it (a worker whose start
/// failed, or whose scheduler never came), a file this worker made is
/// removed, so nothing is left behind.
#[derive(Debug)]
struct ShmHeld {
    path: PathBuf,
    file: std::fs::File,
    made: bool,
}

impl Drop for ShmHeld {
    fn drop(&mut self) {
        if !self.made {
            return;
        }
        // This worker's own lock goes first; then an exclusive lock is only
        // to be had when no scheduler (nor anything else) holds the file.
        let _ = self.file.unlock();
        if let Ok(f) = std::fs::File::open(&self.path)
            && f.try_lock().is_ok()
            && same_file(&f, &self.path)
            && same_file(&self.file, &self.path)
        {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl std::fmt::Debug for WorkerSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerSide")
            .field("routes", &self.engines.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

fn tier_err(what: impl Into<String>, e: impl std::fmt::Display) -> WorkerError {
    WorkerError::Tier {
        what: what.into(),
        reason: e.to_string(),
    }
}

/// Checks that vLLM's tensors are what the geometry says: one per layer,
/// and, when kvbm copies blocks in and out of them (`copies`), on the CPU,
/// contiguous, with a block's bytes per block first and room for every
/// block. An observer reads none of their bytes, so they may be on any
/// device and in any layout. (`geometry` is checked already.)
fn check_tensors(
    geometry: &Geometry,
    tensors: &[KvTensor],
    copies: bool,
) -> Result<(), WorkerError> {
    if tensors.len() != geometry.num_layers {
        return Err(WorkerError::Tensor {
            name: "(all)".into(),
            reason: format!(
                "{} tensors for {} layers",
                tensors.len(),
                geometry.num_layers
            ),
        });
    }
    if !copies {
        return Ok(());
    }
    for t in tensors {
        let bad = |reason: String| WorkerError::Tensor {
            name: t.name.clone(),
            reason,
        };
        if t.device != "cpu" {
            return Err(bad(format!(
                "on {}; this build of kvbm copies CPU tensors only (the cuda engine has not been run on a GPU yet)",
                t.device
            )));
        }
        if !t.contiguous {
            return Err(bad("not contiguous".into()));
        }
        if t.num_blocks < geometry.num_gpu_blocks {
            return Err(bad(format!(
                "{} blocks, vLLM configured {}",
                t.num_blocks, geometry.num_gpu_blocks
            )));
        }
        if t.block_stride_bytes != geometry.page_bytes {
            return Err(bad(format!(
                "{} bytes per block, the cache config says {} (the block dimension must come first)",
                t.block_stride_bytes, geometry.page_bytes
            )));
        }
        if t.data_ptr == 0 {
            return Err(bad("its data_ptr is null (0)".into()));
        }
        // Cannot overflow: Geometry::check.
        let need = (geometry.num_gpu_blocks * geometry.page_bytes) as u64;
        if t.nbytes < need {
            return Err(bad(format!(
                "{} bytes at {:#x}, need {need}",
                t.nbytes, t.data_ptr
            )));
        }
    }
    Ok(())
}

impl WorkerSide {
    /// Wraps `tensors` (one per layer, in vLLM's order) as G1 and opens
    /// the tiers `cfg` configures for rank `shard` of vLLM engine
    /// `engine_id`: that rank's own host-tier and disk files.
    ///
    /// # Safety
    ///
    /// The tensors' memory must stay valid and in place for as long as the
    /// returned value lives (vLLM keeps its KV cache for the engine's
    /// life), and vLLM must not touch a block while a plan that names it
    /// runs (it does not: plans run between its steps' forward passes).
    pub unsafe fn start(
        cfg: &Config,
        geometry: Geometry,
        engine_id: &str,
        tensors: Vec<KvTensor>,
        shard: Shard,
    ) -> Result<Self, WorkerError> {
        geometry.check()?;
        let sizes = TierSizes::of(cfg, &geometry)?;
        // With no tier kvbm only observes: it moves no bytes and keeps no
        // pointer into vLLM's tensors, so they may be on a GPU.
        let copies = sizes.host_blocks > 0 || sizes.disk_blocks > 0;
        check_tensors(&geometry, &tensors, copies)?;
        let mut engines: HashMap<Route, Arc<dyn TransferEngine>> = HashMap::new();
        let mut host = None;
        let mut shm = None;
        let g1 = if copies {
            let g1_layout = geometry.layout(geometry.num_gpu_blocks, LayoutKind::LayerSeparate)?;
            let regions = tensors
                .iter()
                .map(|t| t.data_ptr as usize as *mut u8)
                .collect();
            // SAFETY: checked above that each region holds the layout's
            // bytes; the caller keeps them alive and in place.
            Some(Arc::new(
                unsafe { HostStorage::external(g1_layout, regions) }
                    .map_err(|e| tier_err("wrapping vLLM's KV tensors", e))?,
            ))
        } else {
            None
        };
        if let (Some(g1), true) = (&g1, sizes.host_blocks > 0) {
            let path = shm_path(cfg, engine_id, shard);
            let what = || {
                format!(
                    "the host tier's shared file {} (kv_connector_extra_config `shm_dir`)",
                    path.display()
                )
            };
            // vLLM starts its workers before its scheduler: the worker may
            // be the one that makes the file.
            let (file, made) = open_locked(&path).map_err(|e| tier_err(what(), e))?;
            shm = Some(ShmHeld {
                path: path.clone(),
                file,
                made,
            });
            let l = geometry.layout(sizes.host_blocks, LayoutKind::FullyContiguous)?;
            let g2 = Arc::new(HostStorage::shared(&path, l).map_err(|e| tier_err(what(), e))?);
            // The worker writes the host tier: fault its pages in now, in
            // the background, rather than one by one inside each offload
            // (see HostStorage::prefault). Not starting it is no error:
            // the copies then fault the pages themselves.
            if let Err(e) = prefault_in_background(&g2, PREFAULT_CHUNK) {
                tracing::info!(error = %e, "host tier: no prefault thread");
            }
            // Stores write host-tier blocks no one reads until a later
            // load: streaming stores skip reading each destination line
            // into the cache first (see Stores::Streaming). Loads into
            // vLLM's tensors, which the next forward pass reads, keep
            // ordinary stores.
            engines.insert(
                Route::DeviceToHost,
                Arc::new(
                    MemcpyEngine::with_stores(
                        g1.clone(),
                        Tier::Device,
                        g2.clone(),
                        Tier::Host,
                        EngineConfig::default(),
                        Stores::Streaming,
                    )
                    .map_err(|e| tier_err("the G1→G2 engine", e))?,
                ),
            );
            engines.insert(
                Route::HostToDevice,
                Arc::new(
                    MemcpyEngine::new(g2.clone(), Tier::Host, g1.clone(), Tier::Device)
                        .map_err(|e| tier_err("the G2→G1 engine", e))?,
                ),
            );
            host = Some(g2);
        } else if let (Some(g1), true, Some(path)) = (&g1, sizes.disk_blocks > 0, &cfg.disk_path) {
            let path = &disk_path(path, shard);
            let l = geometry.layout(sizes.disk_blocks, LayoutKind::FullyContiguous)?;
            let g3 = Arc::new(DiskStorage::open_or_create(path, l).map_err(|e| {
                tier_err(
                    format!(
                        "the disk tier's file {} (kv_connector_extra_config `disk_path`)",
                        path.display()
                    ),
                    e,
                )
            })?);
            engines.insert(
                Route::DeviceToDisk,
                Arc::new(
                    DiskEngine::new(
                        g1.clone(),
                        g3.clone(),
                        DiskDirection::HostToDisk,
                        Tier::Device,
                    )
                    .map_err(|e| tier_err("the G1→G3 engine", e))?,
                ),
            );
            engines.insert(
                Route::DiskToDevice,
                Arc::new(
                    DiskEngine::new(g1.clone(), g3, DiskDirection::DiskToHost, Tier::Device)
                        .map_err(|e| tier_err("the G3→G1 engine", e))?,
                ),
            );
        }
        Ok(WorkerSide {
            g1,
            g2: host,
            engines,
            plan: None,
            report: StepReport::default(),
            load_errors: Vec::new(),
            finished_sending: Vec::new(),
            hooks: TestHooks::from_env(shard),
            _tensors: tensors,
            _shm: shm,
        })
    }

    /// Takes this step's plan (vLLM's `bind_connector_metadata`).
    pub fn bind(&mut self, plan: &[u8]) -> Result<(), WorkerError> {
        self.bind_plan(StepPlan::from_bytes(plan)?);
        Ok(())
    }

    /// Takes this step's plan, already parsed.
    pub fn bind_plan(&mut self, plan: StepPlan) {
        self.plan = Some(plan);
    }

    /// Runs the bound plan: stores, then loads. Called once per step before
    /// the forward pass (vLLM's `handle_preemptions`); a second call in the
    /// same step does nothing.
    pub fn run(&mut self) {
        let Some(plan) = self.plan.take() else {
            return;
        };
        self.report = StepReport {
            step: plan.step,
            done: Vec::with_capacity(plan.stores.len() + plan.loads.len()),
        };
        for b in &plan.stores {
            let d = self.copy(b);
            self.report.done.push(d);
        }
        for b in &plan.loads {
            let d = self.copy(b);
            if d.error.is_some() {
                self.load_errors.extend(b.pairs.iter().map(|p| p.dst));
            }
            self.report.done.push(d);
        }
        self.load_errors.extend(&plan.failed_loads);
        self.finished_sending.extend(plan.finished_sending);
    }

    fn copy(&mut self, b: &Batch) -> Done {
        let fail = |error: String| Done {
            route: b.route,
            id: b.id,
            bytes: 0,
            elapsed_ns: 0,
            error: Some(error),
        };
        let Some(engine) = self.engines.get(&b.route) else {
            return fail(format!("this worker has no {:?} engine", b.route));
        };
        let pairs: Vec<BlockPair> = b
            .pairs
            .iter()
            .map(|p| BlockPair::new(p.src, p.dst))
            .collect();
        if !b.route.is_load() {
            self.dump("stored", b.pairs.iter().map(|p| (p.src, p.hash)));
        }
        // SAFETY: the plan's blocks are not touched by vLLM between its
        // forward passes, and each engine's storages are distinct. Blocking:
        // vLLM's forward pass waits for these copies anyway, so the memcpy
        // engine does them on this thread rather than handing them off.
        let r = match (&mut self.hooks.baseline, &self.g2, &self.g1) {
            (Some(baseline), Some(g2), Some(g1)) if b.route == Route::DeviceToHost => {
                let same = pairs.clone();
                baseline.measure(g1, g2, &same, || unsafe { engine.transfer_blocking(pairs) })
            }
            _ => unsafe { engine.transfer_blocking(pairs) },
        };
        match r {
            Ok(stats) => {
                if b.route.is_load() {
                    if self.hooks.corrupt_loads.now()
                        && let Some(p) = b.pairs.first()
                    {
                        self.corrupt(p);
                    }
                    self.dump("loaded", b.pairs.iter().map(|p| (p.dst, p.hash)));
                }
                Done {
                    route: b.route,
                    id: b.id,
                    bytes: stats.bytes,
                    elapsed_ns: u64::try_from(stats.elapsed.as_nanos()).unwrap_or(u64::MAX),
                    error: None,
                }
            }
            Err(e) => fail(describe(&e)),
        }
    }

    fn dump(&self, kind: &str, blocks: impl Iterator<Item = (u32, u64)>) {
        let (Some(dir), Some(g1)) = (&self.hooks.dump, &self.g1) else {
            return;
        };
        let dir = dir.join(kind);
        if std::fs::create_dir_all(&dir).is_err() {
            return;
        }
        let mut buf = vec![0u8; g1.layout().block_bytes()];
        for (block, hash) in blocks {
            // SAFETY: as for the copies: vLLM is not writing this block now.
            if unsafe { g1.read_block(block, &mut buf) }.is_ok() {
                let _ = std::fs::write(dir.join(format!("{hash:016x}")), &buf);
            }
        }
    }

    fn corrupt(&self, p: &Pair) {
        let Some(g1) = &self.g1 else { return };
        let mut buf = vec![0u8; g1.layout().block_bytes()];
        // SAFETY: as for the copies.
        unsafe {
            if g1.read_block(p.dst, &mut buf).is_ok() {
                let mid = buf.len() / 2;
                buf[mid] ^= 0x40;
                let _ = g1.write_block(p.dst, &buf);
            }
        }
    }

    /// The report of the last run (vLLM's worker metadata), once; `None`
    /// when it ran no batch (most steps), since the scheduler side has
    /// nothing to resolve then and vLLM need not carry it back.
    pub fn take_report(&mut self) -> Option<Vec<u8>> {
        let report = std::mem::take(&mut self.report);
        (!report.done.is_empty()).then(|| report.to_bytes())
    }

    /// G1 blocks whose load failed this step (vLLM recomputes them).
    pub fn take_load_errors(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.load_errors)
    }

    /// Requests whose stores are all done (vLLM frees their blocks).
    pub fn take_finished_sending(&mut self) -> Vec<String> {
        std::mem::take(&mut self.finished_sending)
    }
}

fn describe(e: &TransferError) -> String {
    kvbm_events::text::clip(&e.to_string(), kvbm_events::text::MAX_MESSAGE_CHARS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_core::layout::{Layout, LayoutConfig};
    use std::time::Duration;

    fn storage(kind: LayoutKind) -> HostStorage {
        let config = LayoutConfig {
            num_blocks: 4,
            num_layers: 2,
            outer_dim: 2,
            page_size: 4,
            inner_dim: 8,
            dtype_bytes: 2,
        };
        HostStorage::new(Layout::new(config, kind).unwrap()).unwrap()
    }

    #[test]
    fn the_baseline_copies_the_same_blocks_and_alternates_which_goes_first() {
        let (g1, g2) = (
            storage(LayoutKind::LayerSeparate),
            storage(LayoutKind::FullyContiguous),
        );
        let n = g1.layout().block_bytes();
        let block: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
        // SAFETY (here and below): single-threaded; nothing else holds them.
        unsafe { g1.write_block(1, &block).unwrap() };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("baseline.jsonl");
        let mut baseline = Baseline {
            file: std::fs::File::create(&path).unwrap(),
            batches: 0,
        };
        let pairs = [BlockPair::new(1, 2)];
        let read = |s: &HostStorage| {
            let mut out = vec![0u8; n];
            unsafe { s.read_block(2, &mut out).unwrap() };
            out
        };
        // A stand-in for the engine that reports whether the plain copy
        // had already filled the destination when it ran.
        let mut found = Vec::new();
        for _ in 0..2 {
            unsafe { g2.write_block(2, &vec![0u8; n]).unwrap() };
            let r = baseline.measure(&g1, &g2, &pairs, || {
                found.push(read(&g2) == block);
                Ok(TransferStats {
                    blocks: 1,
                    bytes: n as u64,
                    elapsed: Duration::from_nanos(5),
                })
            });
            assert_eq!(r.unwrap().bytes, n as u64);
            assert_eq!(read(&g2), block, "the plain copy's bytes");
        }
        assert_eq!(found, [true, false], "plain first, then the engine first");
        // A failed engine copy is returned as it is and leaves no line.
        let failed = baseline.measure(&g1, &g2, &pairs, || {
            Err(TransferError::EngineStopped { engine: "test" })
        });
        assert!(failed.is_err());
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        for (line, first) in lines.iter().zip(["plain", "engine"]) {
            assert_eq!(line["first"], first);
            assert_eq!(line["bytes"], n as u64);
            assert_eq!(line["engine_ns"], 5);
            assert!(line["call_ns"].as_u64().is_some() && line["plain_ns"].as_u64().is_some());
        }
    }
}
