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
use crate::g1::{Device, G1Shape, g1_shape};
use crate::meta::{Batch, Done, Pair, Route, StepPlan, StepReport, describe};
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

pub use crate::g1::KvTensor;

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
    #[error(transparent)]
    Tensor(#[from] crate::g1::TensorError),
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

/// Where a worker's tiers go: its settings, vLLM's geometry, engine and
/// rank, and the tiers' sizes.
#[derive(Clone, Copy)]
struct Site<'a> {
    cfg: &'a Config,
    geometry: &'a Geometry,
    engine_id: &'a str,
    shard: Shard,
    sizes: TierSizes,
}

/// The worker side. See the module docs.
pub struct WorkerSide {
    /// vLLM's tensors in host memory, when kvbm copies to and from them
    /// (an observer keeps none).
    g1: Option<Arc<HostStorage>>,
    /// vLLM's tensors on a GPU, with kvbm's stream-ordered copies.
    #[cfg(feature = "cuda")]
    device: Option<crate::device::DeviceTier>,
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

/// A build without the `cuda` feature, given tensors on `device`.
#[cfg(not(feature = "cuda"))]
fn no_cuda(device: &str) -> WorkerError {
    tier_err(
        format!("vLLM's KV cache on {device}"),
        "this build of kvbm has no CUDA support: build it with the `cuda` feature \
         (pip install with MATURIN_PEP517_ARGS=\"--features python,pyo3/extension-module,cuda\"), or run kvbm as an \
         observer (host_capacity_tokens 0, no disk_path)",
    )
}

fn tier_err(what: impl Into<String>, e: impl std::fmt::Display) -> WorkerError {
    WorkerError::Tier {
        what: what.into(),
        reason: e.to_string(),
    }
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
    /// runs (it does not: plans run between its steps' forward passes; on
    /// a GPU, its later work is ordered after kvbm's copies).
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
        // pointer into vLLM's tensors, so they may be on any device and in
        // any arrangement.
        let copies = sizes.host_blocks > 0 || sizes.disk_blocks > 0;
        let mut side = WorkerSide {
            g1: None,
            g2: None,
            #[cfg(feature = "cuda")]
            device: None,
            engines: HashMap::new(),
            plan: None,
            report: StepReport::default(),
            load_errors: Vec::new(),
            finished_sending: Vec::new(),
            hooks: TestHooks::from_env(shard),
            _tensors: Vec::new(),
            _shm: None,
        };
        if !copies {
            if tensors.len() != geometry.num_layers {
                return Err(crate::g1::TensorError::Tensor {
                    name: "(all)".into(),
                    reason: format!(
                        "{} tensors for {} layers",
                        tensors.len(),
                        geometry.num_layers
                    ),
                }
                .into());
            }
            side._tensors = tensors;
            return Ok(side);
        }
        // A build without CUDA says so before anything about the tensors'
        // arrangement, which it could not use anyway.
        #[cfg(not(feature = "cuda"))]
        if let Some(t) = tensors.iter().find(|t| t.device.starts_with("cuda")) {
            return Err(no_cuda(&t.device));
        }
        #[cfg(feature = "cuda")]
        if let Some(t) = tensors.iter().find(|t| t.device.starts_with("cuda"))
            && let Err(why) = kvbm_core::storage::cuda_available()
        {
            return Err(tier_err(format!("vLLM's KV cache on {}", t.device), why));
        }
        let shape = g1_shape(&geometry, &tensors)?;
        side._tensors = tensors;
        let site = Site {
            cfg,
            geometry: &geometry,
            engine_id,
            shard,
            sizes,
        };
        match shape.device {
            Device::Cpu => {
                // SAFETY: the caller's contract.
                unsafe { side.open_host_g1(&site, &shape)? }
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                // SAFETY: the caller's contract.
                unsafe { side.open_device_g1(&site, &shape, ordinal)? }
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(ordinal) => return Err(no_cuda(&format!("cuda:{ordinal}"))),
        }
        Ok(side)
    }

    /// This rank's host-tier file, opened (or made) and held, and its
    /// storage in `l`'s layout.
    fn open_host_tier(
        &mut self,
        site: &Site<'_>,
        l: kvbm_core::layout::Layout,
    ) -> Result<Arc<HostStorage>, WorkerError> {
        let path = shm_path(site.cfg, site.engine_id, site.shard);
        let what = || {
            format!(
                "the host tier's shared file {} (kv_connector_extra_config `shm_dir`)",
                path.display()
            )
        };
        // vLLM starts its workers before its scheduler: the worker may
        // be the one that makes the file.
        let (file, made) = open_locked(&path).map_err(|e| tier_err(what(), e))?;
        self._shm = Some(ShmHeld {
            path: path.clone(),
            file,
            made,
        });
        let g2 = Arc::new(HostStorage::shared(&path, l).map_err(|e| tier_err(what(), e))?);
        // The worker writes the host tier: fault its pages in now, in
        // the background, rather than one by one inside each offload
        // (see HostStorage::prefault). Not starting it is no error:
        // the copies then fault the pages themselves.
        if let Err(e) = prefault_in_background(&g2, PREFAULT_CHUNK) {
            tracing::info!(error = %e, "host tier: no prefault thread");
        }
        self.g2 = Some(g2.clone());
        Ok(g2)
    }

    /// G1 in host memory: kvbm's memcpy and disk engines.
    ///
    /// # Safety
    ///
    /// As [`Self::start`].
    unsafe fn open_host_g1(&mut self, site: &Site<'_>, shape: &G1Shape) -> Result<(), WorkerError> {
        let Site {
            cfg,
            geometry,
            shard,
            sizes,
            ..
        } = *site;
        let regions = shape
            .regions
            .iter()
            .map(|&p| p as usize as *mut u8)
            .collect();
        // SAFETY: g1_shape checked that each region holds the layout's
        // bytes; the caller keeps them alive and in place.
        let g1 = Arc::new(
            unsafe { HostStorage::external(shape.layout, regions) }
                .map_err(|e| tier_err("wrapping vLLM's KV tensors", e))?,
        );
        self.g1 = Some(g1.clone());
        let outer = shape.outer();
        if sizes.host_blocks > 0 {
            let l = geometry.layout_split(sizes.host_blocks, LayoutKind::FullyContiguous, outer)?;
            let g2 = self.open_host_tier(site, l)?;
            // Stores write host-tier blocks no one reads until a later
            // load: streaming stores skip reading each destination line
            // into the cache first (see Stores::Streaming). Loads into
            // vLLM's tensors, which the next forward pass reads, keep
            // ordinary stores.
            self.engines.insert(
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
            self.engines.insert(
                Route::HostToDevice,
                Arc::new(
                    MemcpyEngine::new(g2, Tier::Host, g1, Tier::Device)
                        .map_err(|e| tier_err("the G2→G1 engine", e))?,
                ),
            );
        } else if let (true, Some(path)) = (sizes.disk_blocks > 0, &cfg.disk_path) {
            let path = &disk_path(path, shard);
            let l = geometry.layout_split(sizes.disk_blocks, LayoutKind::FullyContiguous, outer)?;
            let g3 = Arc::new(DiskStorage::open_or_create(path, l).map_err(|e| {
                tier_err(
                    format!(
                        "the disk tier's file {} (kv_connector_extra_config `disk_path`)",
                        path.display()
                    ),
                    e,
                )
            })?);
            self.engines.insert(
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
            self.engines.insert(
                Route::DiskToDevice,
                Arc::new(
                    DiskEngine::new(g1, g3, DiskDirection::DiskToHost, Tier::Device)
                        .map_err(|e| tier_err("the G3→G1 engine", e))?,
                ),
            );
        }
        Ok(())
    }

    /// G1 on a GPU: vLLM's tensors wrapped as device storage, the host
    /// tier pinned, and the copies ordered on CUDA streams (see
    /// [`crate::device`]). The disk tier is written from the host tier by
    /// the scheduler side, so on a GPU it needs one: a disk tier alone is
    /// refused, naming the setting.
    ///
    /// # Safety
    ///
    /// As [`Self::start`]: the regions are vLLM's CUDA tensors on device
    /// `ordinal`.
    #[cfg(feature = "cuda")]
    unsafe fn open_device_g1(
        &mut self,
        site: &Site<'_>,
        shape: &G1Shape,
        ordinal: usize,
    ) -> Result<(), WorkerError> {
        let Site {
            geometry, sizes, ..
        } = *site;
        use kvbm_core::storage::DeviceStorage;
        use kvbm_core::transfer::{CopyCalls, StreamCopier};
        if sizes.host_blocks == 0 {
            return Err(tier_err(
                "a disk tier with vLLM's KV cache on a GPU",
                "kvbm moves GPU blocks through its host tier: set host_capacity_tokens above 0 \
                 (the disk tier then holds what the host tier evicts)",
            ));
        }
        let what = format!("vLLM's KV tensors on cuda:{ordinal}");
        // SAFETY: the caller's contract: device memory of `ordinal`, each
        // region the layout's size (g1_shape), alive while we are.
        let g1 = unsafe { DeviceStorage::external(ordinal, shape.layout, shape.regions.clone()) }
            .map_err(|e| tier_err(&what, e))?;
        let l = geometry.layout_split(
            sizes.host_blocks,
            LayoutKind::FullyContiguous,
            shape.outer(),
        )?;
        let g2 = self.open_host_tier(site, l)?;
        let calls = CopyCalls::from_env().map_err(|e| tier_err(&what, e))?;
        let copier = StreamCopier::new(Arc::new(g1), g2, calls)
            .map_err(|e| tier_err("the GPU ↔ host-tier copies", e))?;
        self.device = Some(crate::device::DeviceTier::new(copier));
        Ok(())
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
    /// same step does nothing. On a GPU, with vLLM's legacy default stream:
    /// see [`Self::run_on`].
    pub fn run(&mut self) {
        // SAFETY: the null stream is always a valid stream.
        unsafe { self.run_on(0) }
    }

    /// [`Self::run`], with vLLM's current CUDA stream when its KV cache is
    /// on a GPU (ignored otherwise): the copies are ordered against it and
    /// reported once they have run ([`Self::poll`]).
    ///
    /// # Safety
    ///
    /// `stream` is 0 or a live CUDA stream of vLLM's device, the one its
    /// next forward pass runs on.
    pub unsafe fn run_on(&mut self, stream: u64) {
        let Some(plan) = self.plan.take() else {
            return;
        };
        self.report.step = plan.step;
        #[cfg(feature = "cuda")]
        if self.device.is_some() {
            // SAFETY: the caller's contract.
            unsafe { self.run_on_device(&plan, stream) };
            self.load_errors.extend(&plan.failed_loads);
            self.finished_sending.extend(plan.finished_sending);
            return;
        }
        let _ = stream;
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

    /// The GPU path of [`Self::run_on`]: enqueue, then report what has
    /// run. With a test hook that reads or writes G1, wait for the copies
    /// first (tests only: the hooks read vLLM's blocks as they are after
    /// the copies).
    ///
    /// # Safety
    ///
    /// As [`Self::run_on`].
    #[cfg(feature = "cuda")]
    unsafe fn run_on_device(&mut self, plan: &StepPlan, stream: u64) {
        let Some(dev) = self.device.as_mut() else {
            return;
        };
        // SAFETY: the caller's contract.
        let out = unsafe { dev.run(stream, &plan.stores, &plan.loads) };
        self.report.done.extend(out.failed);
        self.load_errors.extend(out.load_errors);
        if self.hooks.dump.is_some() || self.hooks.corrupt_loads.now() {
            let done = dev.wait_all();
            let ok = |route: Route, id: u64| {
                done.iter()
                    .any(|d| d.route == route && d.id == id && d.error.is_none())
            };
            for b in &plan.stores {
                if ok(b.route, b.id) {
                    self.dump("stored", b.pairs.iter().map(|p| (p.src, p.hash)));
                }
            }
            for b in &plan.loads {
                if ok(b.route, b.id) {
                    if self.hooks.corrupt_loads.now()
                        && let Some(p) = b.pairs.first()
                    {
                        self.corrupt(p);
                    }
                    self.dump("loaded", b.pairs.iter().map(|p| (p.dst, p.hash)));
                }
            }
            self.report.done.extend(done);
        }
        self.poll_device();
    }

    /// Moves the GPU copies that have run into the next report.
    fn poll_device(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(dev) = self.device.as_mut() {
            self.report.done.extend(dev.poll());
        }
    }

    /// The report of the copies that have run since the last report (GPU
    /// copies complete after the step that enqueued them); `None` when
    /// there are none. Never blocks.
    pub fn poll(&mut self) -> Option<Vec<u8>> {
        self.poll_device();
        self.take_report()
    }

    /// Reads G1's `block` (test hooks), wherever G1 is.
    fn read_g1(&self, block: u32, buf: &mut [u8]) -> bool {
        #[cfg(feature = "cuda")]
        if let Some(dev) = &self.device {
            return dev.copier().device().read_block(block, buf).is_ok();
        }
        // SAFETY: as for the copies: vLLM is not writing this block now.
        self.g1
            .as_ref()
            .is_some_and(|g1| unsafe { g1.read_block(block, buf) }.is_ok())
    }

    /// Writes G1's `block` (test hooks).
    fn write_g1(&self, block: u32, buf: &[u8]) {
        #[cfg(feature = "cuda")]
        if let Some(dev) = &self.device {
            let _ = dev.copier().device().write_block(block, buf);
            return;
        }
        if let Some(g1) = &self.g1 {
            // SAFETY: as for the copies.
            let _ = unsafe { g1.write_block(block, buf) };
        }
    }

    /// Bytes of one block of G1, when kvbm copies in and out of it.
    fn g1_block_bytes(&self) -> Option<usize> {
        #[cfg(feature = "cuda")]
        if let Some(dev) = &self.device {
            return Some(dev.copier().device().layout().block_bytes());
        }
        self.g1.as_ref().map(|g1| g1.layout().block_bytes())
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
        let (Some(dir), Some(n)) = (&self.hooks.dump, self.g1_block_bytes()) else {
            return;
        };
        let dir = dir.join(kind);
        if std::fs::create_dir_all(&dir).is_err() {
            return;
        }
        let mut buf = vec![0u8; n];
        for (block, hash) in blocks {
            if self.read_g1(block, &mut buf) {
                let _ = std::fs::write(dir.join(format!("{hash:016x}")), &buf);
            }
        }
    }

    fn corrupt(&self, p: &Pair) {
        let Some(n) = self.g1_block_bytes() else {
            return;
        };
        let mut buf = vec![0u8; n];
        if self.read_g1(p.dst, &mut buf) {
            let mid = buf.len() / 2;
            buf[mid] ^= 0x40;
            self.write_g1(p.dst, &buf);
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
