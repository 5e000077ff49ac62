//! The simulated engine: a continuous-batching scheduler over the device
//! pool that drives the [`Leader`] exactly as an engine would, with real
//! bytes moving through the transfer engines.
//!
//! One iteration (continuous batching over a paged block allocator, with
//! recompute preemption):
//!
//! 1. admit arrivals (`create_slot`);
//! 2. admit waiting requests first come, first served: match the prompt on
//!    G1, ask the leader for host/disk hits beyond that
//!    (`get_num_new_matched_tokens`), allocate device blocks for the whole
//!    prompt (paged: one block per `block_size` tokens), hand the ones that
//!    receive loaded blocks to the leader (`update_state_after_alloc`);
//! 3. give decoding requests that need a new block one; under memory
//!    pressure preempt the most recently arrived running request (its
//!    blocks return to the pool, still cached, and it recomputes later);
//! 4. build the batch within `max_batch_tokens` (decodes first, then
//!    prefill chunks) and call `build_connector_metadata`;
//! 5. the worker waits for the loads, the forward pass "computes" (each
//!    block that fills goes through the block lifecycle, gets its bytes
//!    written and is registered on G1), the stores' precondition fires;
//! 6. finished requests call `request_finished`.
//!
//! Time is virtual (as fast as possible) or paced in real time × speed for
//! the live demo. A worker model turns tokens and bytes into time.

pub use crate::model::WorkerModel;
use crate::modeled::{LinkModel, ModeledEngine};
use crate::workload::RequestSpec;
use kvbm_core::assembly::{AssemblyError, LocalTiers, Pools, Route, TierSizes};
use kvbm_core::block::{ComputeDone, Empty, ImmutableBlock, MutableBlock};
/// Each tier's eviction policy, as [`SimConfig::eviction`] takes it.
pub use kvbm_core::eviction::TierEviction;
use kvbm_core::layout::{Layout, LayoutConfig, LayoutKind};
/// Eager or lazy offload, as [`SimConfig::offload_mode`] takes it.
pub use kvbm_core::leader::OffloadMode;
use kvbm_core::leader::{
    Leader, LeaderPools, LeaderWiring, PoolEvents, ScheduledRequest, SchedulerOutput, Worker,
};
use kvbm_core::link::HostTier;
use kvbm_core::offload::{OffloadPipeline, PipelineConfig, PipelineStats};
use kvbm_core::pool::PoolError;
use kvbm_core::tokens::{SaltHash, TokenSequence};
use kvbm_core::transfer::TransferEngine;
use kvbm_events::bus::BusConfig;
use kvbm_events::tier::Tier;
use kvbm_events::{Clock, Direction, Emitter, EventKind, MonotonicClock, RequestId, VirtualClock};
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Virtual time, or real time × speed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pacing {
    /// As fast as possible.
    Virtual,
    /// Sleep so that virtual time tracks wall time × `speed`.
    RealTime {
        /// 1.0 = real time.
        speed: f64,
    },
}

/// Everything that shapes a run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// G1 capacity in tokens.
    pub device_capacity_tokens: usize,
    /// G2 capacity in tokens (0 disables the tier).
    pub host_capacity_tokens: usize,
    /// G3 capacity in tokens (0 disables the tier).
    pub disk_capacity_tokens: usize,
    /// Token budget per iteration.
    pub max_batch_tokens: usize,
    /// Most sequences running at once.
    pub max_batch_seqs: usize,
    /// Eager or lazy offload.
    pub offload_mode: OffloadMode,
    /// Each tier's eviction policy.
    pub eviction: TierEviction,
    /// Real bytes per token in the simulated storages (small by default so
    /// runs stay fast).
    pub real_bytes_per_token: usize,
    /// Timing model, and the modelled KV bytes per token every byte figure
    /// counts (see [`crate::modeled`]).
    pub worker: WorkerModel,
    /// The model's name, for reports and screens.
    pub model: String,
    /// Pacing.
    pub pacing: Pacing,
    /// Engine id stamped on events.
    pub engine_id: u32,
    /// Pipeline settings for every tier link.
    pub pipeline: PipelineConfig,
    /// Event bus sizes.
    pub bus: BusConfig,
    /// Directory for the disk tier's file (a temporary one when `None`).
    pub disk_dir: Option<PathBuf>,
    /// Salt for token hashing.
    pub salt: Vec<u8>,
    /// Match prompts against G1's own prefix cache (vLLM's
    /// `--enable-prefix-caching`); off, only the host and disk tiers hit.
    pub device_prefix_cache: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        let mut pipeline = PipelineConfig::default();
        // The simulator waits for each iteration's loads; batch them at
        // once rather than after a real-time flush interval.
        pipeline.batch_config.min_batch_size = 1;
        pipeline.batch_config.flush_interval = Duration::from_millis(1);
        SimConfig {
            block_size: 16,
            device_capacity_tokens: 16 * 1024,
            host_capacity_tokens: 64 * 1024,
            disk_capacity_tokens: 0,
            max_batch_tokens: 8192,
            max_batch_seqs: 256,
            offload_mode: OffloadMode::Eager,
            eviction: TierEviction::default(),
            real_bytes_per_token: 4,
            worker: WorkerModel::default(),
            model: crate::model::ModelPreset::Llama3_8b.spec().name.to_string(),
            pacing: Pacing::Virtual,
            engine_id: 0,
            pipeline,
            bus: BusConfig::default(),
            disk_dir: None,
            salt: b"kvbm-sim".to_vec(),
            device_prefix_cache: true,
        }
    }
}

/// Why a simulation could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A setting that cannot work.
    #[error("invalid setting {field}: {reason}")]
    Invalid {
        /// The setting.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// Building pools, storages, engines or pipelines failed.
    #[error("setting up the tiers: {0}")]
    Setup(String),
}

fn setup<E: std::fmt::Display>(e: E) -> SimError {
    SimError::Setup(e.to_string())
}

impl From<AssemblyError> for SimError {
    fn from(e: AssemblyError) -> Self {
        setup(e)
    }
}

/// A summary (percentiles, max, mean) of a series in milliseconds. (The
/// recorder's `Percentiles` summarise its bounded histograms.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct MillisSummary {
    /// Median.
    pub p50: f64,
    /// 90th.
    pub p90: f64,
    /// 99th.
    pub p99: f64,
    /// Largest.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

impl MillisSummary {
    fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        MillisSummary {
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            max: v[v.len() - 1],
            mean: v.iter().sum::<f64>() / v.len() as f64,
        }
    }
}

/// What the offload or onboard pipeline of one direction reported by the
/// end of the run (the reducer's `DirectionTotals` are the same story told
/// by the events).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PipelineTotals {
    /// Candidates that completed.
    pub completed: u64,
    /// Candidates skipped (any reason).
    pub skipped: u64,
    /// Blocks moved.
    pub blocks: u64,
    /// Bytes those blocks stand for in the modelled model.
    pub bytes: u64,
    /// Bytes the simulated storages really copied.
    pub real_bytes: u64,
}

/// What a run did. `kvbm-sim --json` prints this.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SimReport {
    /// The model the engine stood for.
    pub model: String,
    /// Its KV bytes per block (what byte figures count).
    pub kv_bytes_per_block: u64,
    /// True when the run stopped before its workload ended (the engine
    /// stopped stepping, e.g. on Ctrl-C): every figure then counts only
    /// the requests that had arrived.
    pub interrupted: bool,
    /// Requests in the workload.
    pub requests_total: usize,
    /// Requests that arrived (all of them unless `interrupted`).
    pub requests_arrived: usize,
    /// Requests that finished.
    pub requests_finished: usize,
    /// Prompt tokens over the requests that arrived.
    pub prompt_tokens: u64,
    /// Prompt tokens served from cache at first admission, all tiers.
    pub prefix_hit_tokens: u64,
    /// The same by tier: device, host, disk.
    pub prefix_hit_tokens_by_tier: BTreeMap<String, u64>,
    /// `prefix_hit_tokens / prompt_tokens`.
    pub prefix_hit_ratio: f64,
    /// Requests preempted (each time).
    pub preemptions: u64,
    /// Transfers by direction ("G1→G2", ...).
    pub transfers_by_direction: BTreeMap<String, PipelineTotals>,
    /// Time to first token, ms of virtual time.
    pub ttft_ms: MillisSummary,
    /// Events emitted.
    pub events_emitted: u64,
    /// Events lost by the recorder tap or lagged by live subscribers.
    pub events_lost: u64,
    /// Loads the worker reported finished (`get_finished`).
    pub loads_finished: u64,
    /// Stores the worker reported finished (`get_finished`).
    pub stores_finished: u64,
    /// Scheduler iterations.
    pub iterations: u64,
    /// Virtual time at the end, ms.
    pub virtual_time_ms: f64,
    /// Wall time of the run, ms.
    pub wall_time_ms: f64,
}

struct Request {
    id: RequestId,
    arrival_ns: u64,
    seq: TokenSequence,
    prompt_len: usize,
    output_len: usize,
    generated: usize,
    computed: usize,
    full: Vec<ImmutableBlock>,
    pending: VecDeque<MutableBlock<Empty>>,
    /// Registered in the last forward pass; stored eagerly next iteration.
    fresh: Vec<ImmutableBlock>,
    /// Served by G1's prefix cache at admission; told once, with the first
    /// iteration that runs it.
    device_hits: Vec<ImmutableBlock>,
    first_token_ns: Option<u64>,
    admitted_once: bool,
    /// Blocks being loaded (counted in `computed` already).
    loading: usize,
}

impl Request {
    fn total_tokens(&self) -> usize {
        self.seq.total_tokens()
    }
    fn blocks_needed(&self, bs: usize) -> usize {
        self.total_tokens().div_ceil(bs)
    }
    fn held_blocks(&self) -> usize {
        self.full.len() + self.pending.len() + self.loading
    }
}

/// The engine: tiers, leader, worker, scheduler state.
pub struct Simulator {
    cfg: SimConfig,
    emitter: Arc<Emitter>,
    virtual_clock: Option<Arc<VirtualClock>>,
    leader: Leader,
    worker: Worker,
    device: HostTier,
    pipelines: Vec<(Direction, Arc<OffloadPipeline>)>,
    /// The engines that really copy, under their [`ModeledEngine`]s.
    copiers: Vec<(Direction, Arc<dyn TransferEngine>)>,
    salt: SaltHash,
    _disk_dir: Option<tempfile_dir::TempDir>,
    arrivals: VecDeque<RequestSpec>,
    waiting: VecDeque<Request>,
    running: Vec<Request>,
    iteration: u64,
    now_ns: u64,
    started: Instant,
    report: SimReport,
    ttft: Vec<f64>,
    hits: [u64; 3],
    requests_total: usize,
    /// Virtual time: the runtime the pipelines run on (see `new`). Last, so
    /// it goes after the leader and pipelines whose tasks it holds.
    _driver: Option<Arc<tokio::runtime::Runtime>>,
}

/// A tiny owned temporary directory (removed on drop) so the core crate
/// needs no tempfile dependency.
mod tempfile_dir {
    use std::path::{Path, PathBuf};

    pub struct TempDir(PathBuf);

    impl TempDir {
        pub fn new() -> std::io::Result<Self> {
            use std::sync::atomic::{AtomicU64, Ordering};
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "kvbm-sim-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&p)?;
            Ok(TempDir(p))
        }
        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// G3's file, when there is a G3: in the directory asked for, or in a
/// temporary one that goes with the simulator (returned with it).
fn g3_file(
    cfg: &SimConfig,
    has_disk: bool,
) -> Result<(Option<PathBuf>, Option<tempfile_dir::TempDir>), SimError> {
    if !has_disk {
        return Ok((None, None));
    }
    let name = format!("g3-{}.kvbm", cfg.engine_id);
    Ok(match &cfg.disk_dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(setup)?;
            (Some(d.join(name)), None)
        }
        None => {
            let t = tempfile_dir::TempDir::new().map_err(setup)?;
            (Some(t.path().join(name)), Some(t))
        }
    })
}

/// Settings the simulator cannot run with.
fn validate(cfg: &SimConfig) -> Result<(), SimError> {
    let bs = cfg.block_size;
    if bs == 0 {
        return Err(SimError::Invalid {
            field: "block_size",
            reason: "must be at least 1".into(),
        });
    }
    if blocks_for(cfg.device_capacity_tokens, bs) == 0 {
        return Err(SimError::Invalid {
            field: "device_capacity_tokens",
            reason: format!("must hold at least one {bs}-token block"),
        });
    }
    if cfg.max_batch_tokens == 0 || cfg.max_batch_seqs == 0 {
        return Err(SimError::Invalid {
            field: "max_batch_tokens/max_batch_seqs",
            reason: "must be at least 1".into(),
        });
    }
    Ok(())
}

/// In virtual time the pipelines run on a runtime of the simulator's own,
/// on one thread, driven only inside the worker's waits (loads, drains):
/// their events come at fixed points of an iteration, in an order that
/// depends only on the workload and the options, so two runs give the same
/// stream (see `Worker::driving`). Returns that runtime (none in real
/// time) and the pipelines' settings for it.
fn driver(
    cfg: &SimConfig,
) -> Result<(Option<Arc<tokio::runtime::Runtime>>, PipelineConfig), SimError> {
    let mut pipeline = cfg.pipeline;
    if cfg.pacing != Pacing::Virtual {
        return Ok((None, pipeline));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(setup)?;
    // The cancel sweeper's wall-clock tick is the one timer that would fire
    // inside a drive and reorder its tasks; nothing in a simulation cancels
    // a transfer, so it has nothing to sweep.
    pipeline.sweep_interval = Duration::from_secs(86_400);
    Ok((Some(Arc::new(rt)), pipeline))
}

fn blocks_for(tokens: usize, bs: usize) -> usize {
    tokens / bs
}

impl Simulator {
    /// Builds the tiers and the leader. Must be called, and the simulator
    /// stepped and dropped, outside any tokio runtime's worker threads.
    /// In real time, `runtime` runs the pipelines; in virtual time they run
    /// on a single-threaded runtime of the simulator's own, and `runtime`
    /// is not used.
    pub fn new(
        cfg: SimConfig,
        workload: Vec<RequestSpec>,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Self, SimError> {
        validate(&cfg)?;
        let bs = cfg.block_size;
        let device_blocks = blocks_for(cfg.device_capacity_tokens, bs);
        let host_blocks = blocks_for(cfg.host_capacity_tokens, bs);
        // Without a host tier, G1 and G3 exchange blocks directly.
        let disk_blocks = blocks_for(cfg.disk_capacity_tokens, bs);
        let (clock, virtual_clock): (Arc<dyn Clock>, _) = match cfg.pacing {
            Pacing::Virtual => {
                let c = Arc::new(VirtualClock::new());
                (c.clone(), Some(c))
            }
            Pacing::RealTime { .. } => (Arc::new(MonotonicClock::new()), None),
        };
        let emitter = Arc::new(Emitter::new(cfg.engine_id, cfg.bus, clock).map_err(setup)?);
        let observer: Arc<dyn kvbm_core::pool::PoolObserver> =
            Arc::new(PoolEvents(emitter.clone()));
        let sizes = TierSizes {
            block_size: bs,
            device_blocks,
            host_blocks,
            disk_blocks,
            eviction: cfg.eviction,
        };
        let pools = Pools::new(&sizes, Some(observer)).map_err(setup)?;
        let layout = |n: usize| {
            Layout::new(
                LayoutConfig {
                    num_blocks: n,
                    num_layers: 1,
                    outer_dim: 1,
                    page_size: bs,
                    inner_dim: cfg.real_bytes_per_token.max(1),
                    dtype_bytes: 1,
                },
                LayoutKind::FullyContiguous,
            )
        };
        let (disk_file, disk_dir) = g3_file(&cfg, pools.disk.is_some())?;
        let local = LocalTiers::create(&pools, layout, disk_file.as_deref()).map_err(setup)?;
        let device = local.device().clone();
        let wiring = LeaderWiring::new(emitter.clone(), pools.host.clone());
        let (driver, pipeline) = driver(&cfg)?;
        let handle = driver
            .as_ref()
            .map_or_else(|| runtime.clone(), |d| d.handle().clone());
        let _guard = handle.enter();
        let speed = match cfg.pacing {
            Pacing::Virtual => None,
            Pacing::RealTime { speed } => Some(speed),
        };
        // Saturating: both factors come from the command line.
        let bytes_per_block = (bs as u64).saturating_mul(cfg.worker.model_kv_bytes_per_token);
        let mut copiers = Vec::new();
        // SAFETY: a ModeledEngine copies only through the engine it wraps
        // (it adds the modelled link's time and byte figures).
        let connected = unsafe {
            local.connect_through(Some(&wiring), |d, e| -> Result<Route, SimError> {
                // Byte figures and, in real time, completion follow the
                // modelled link: PCIe between device and host, the disk's
                // bandwidth wherever the disk is one end.
                let bytes_per_s = if d.src == Tier::Disk || d.dst == Tier::Disk {
                    cfg.worker.disk_bytes_per_s
                } else {
                    cfg.worker.pcie_bytes_per_s
                };
                copiers.push((d, e.clone()));
                Ok(Route {
                    engine: Arc::new(ModeledEngine::new(
                        e,
                        LinkModel {
                            bytes_per_block,
                            bytes_per_s,
                            speed,
                        },
                        handle.clone(),
                    )),
                    config: pipeline,
                })
            })
        }?;
        let Pools {
            device: g1,
            host: g2,
            disk: g3,
        } = pools;
        let (pipelines, list) = (connected.pipelines, connected.by_direction);
        let leader = Leader::new(
            wiring,
            LeaderPools {
                device: g1,
                host: g2,
                disk: g3,
            },
            pipelines,
            cfg.offload_mode,
            kvbm_core::tokens::salt_hash(&cfg.salt),
        );
        let worker = match &driver {
            Some(d) => Worker::driving(&leader, d.clone()),
            None => Worker::new(&leader, runtime.clone()),
        };
        let mut arrivals: Vec<RequestSpec> = workload;
        arrivals.sort_by(|a, b| a.arrival_ms.total_cmp(&b.arrival_ms));
        let model_name = cfg.model.clone();
        let requests_total = arrivals.len();
        Ok(Simulator {
            salt: kvbm_core::tokens::salt_hash(&cfg.salt),
            cfg,
            emitter,
            virtual_clock,
            leader,
            worker,
            device,
            pipelines: list,
            copiers,
            _disk_dir: disk_dir,
            arrivals: arrivals.into(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            iteration: 0,
            now_ns: 0,
            started: Instant::now(),
            report: SimReport {
                requests_total,
                model: model_name,
                kv_bytes_per_block: bytes_per_block,
                ..SimReport::default()
            },
            ttft: Vec::new(),
            hits: [0; 3],
            requests_total,
            _driver: driver,
        })
    }

    /// The event emitter (subscribe or take the tap before running).
    pub fn emitter(&self) -> &Arc<Emitter> {
        &self.emitter
    }

    /// The leader (breakpoints, hooks, slot states).
    pub fn leader(&self) -> &Leader {
        &self.leader
    }

    /// The leader, mutably (to install hooks or breakpoints).
    pub fn leader_mut(&mut self) -> &mut Leader {
        &mut self.leader
    }

    /// Waits until no transfer is in flight (every candidate final), so the
    /// event stream and the engine's state can be compared exactly.
    pub fn quiesce(&self) {
        self.worker.drain();
        self.leader.emit_gauges();
    }

    /// The current iteration.
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// True when every request has finished.
    pub fn is_done(&self) -> bool {
        self.arrivals.is_empty() && self.waiting.is_empty() && self.running.is_empty()
    }

    /// Runs to the end and reports.
    pub fn run(self) -> SimReport {
        self.run_with_progress(|_, _| {})
    }

    /// Runs to the end and reports, calling `progress(finished, total)`
    /// with the requests finished so far after every iteration.
    pub fn run_with_progress(mut self, mut progress: impl FnMut(usize, usize)) -> SimReport {
        while !self.is_done() {
            self.step();
            progress(self.report.requests_finished, self.requests_total);
        }
        self.finish()
    }

    fn now(&self) -> u64 {
        match &self.virtual_clock {
            Some(_) => self.now_ns,
            None => self.emitter.clock().now_ns(),
        }
    }

    fn advance(&mut self, ns: u64) {
        self.now_ns = self.now_ns.saturating_add(ns);
        if let Some(c) = &self.virtual_clock {
            c.advance_to(self.now_ns);
        } else if let Pacing::RealTime { speed } = self.cfg.pacing {
            let target = Duration::from_nanos((self.now_ns as f64 / speed.max(1e-6)) as u64);
            let el = self.started.elapsed();
            if target > el {
                std::thread::sleep(target - el);
            }
        }
    }

    /// One scheduler iteration. Returns false when there was nothing to do.
    pub fn step(&mut self) -> bool {
        if self.is_done() {
            return false;
        }
        self.iteration += 1;
        self.emitter.set_iteration(self.iteration);
        self.admit_arrivals();
        if self.running.is_empty() && self.waiting.is_empty() {
            // Idle: let transfers land, then jump to the next arrival.
            self.worker.drain();
            if let Some(next) = self.arrivals.front() {
                let at = (next.arrival_ms * 1e6) as u64;
                if at > self.now_ns {
                    self.advance(at - self.now_ns);
                }
            }
            return true;
        }
        self.schedule_waiting();
        self.grow_decodes();
        let (out, load_ns) = self.run_batch();
        let compute = self.compute_cost(&out);
        self.advance(compute + load_ns);
        self.finish_requests();
        if self.virtual_clock.is_some() {
            // The iteration's stores (their forward pass is done) run now,
            // after its own events and before the next iteration's.
            self.worker.drain();
        }
        self.leader.emit_gauges();
        true
    }

    fn admit_arrivals(&mut self) {
        let now = self.now();
        while let Some(r) = self.arrivals.front() {
            if (r.arrival_ms * 1e6) as u64 > now {
                break;
            }
            let Some(spec) = self.arrivals.pop_front() else {
                break;
            };
            // Counted on arrival, so a run stopped early counts only what
            // it was given.
            self.report.requests_arrived += 1;
            self.report.prompt_tokens += spec.prompt.len() as u64;
            let id: RequestId = Arc::from(spec.id.as_str());
            let seq = match TokenSequence::from_tokens(&spec.prompt, self.cfg.block_size, self.salt)
            {
                Ok(s) => s,
                Err(_) => continue,
            };
            if self
                .leader
                .create_slot(&id, &spec.prompt, spec.output_len)
                .is_err()
            {
                continue;
            }
            self.waiting.push_back(Request {
                id,
                arrival_ns: (spec.arrival_ms * 1e6) as u64,
                prompt_len: spec.prompt.len(),
                output_len: spec.output_len.max(1),
                seq,
                generated: 0,
                computed: 0,
                full: Vec::new(),
                pending: VecDeque::new(),
                fresh: Vec::new(),
                device_hits: Vec::new(),
                first_token_ns: None,
                admitted_once: false,
                loading: 0,
            });
        }
    }

    fn schedule_waiting(&mut self) {
        let bs = self.cfg.block_size;
        if !self.waiting.is_empty() && self.leader.candidates_in_flight() > 0 {
            // In real time transfers run beside the scheduler: let the ones
            // already issued land before looking anything up, so what a
            // request finds does not depend on how fast this machine is.
            // (In virtual time every iteration ends drained, so none is.)
            self.worker.drain();
        }
        while self.running.len() < self.cfg.max_batch_seqs {
            let Some(mut r) = self.waiting.pop_front() else {
                break;
            };
            let hashes = r.seq.sequence_hashes();
            let limit = (r.total_tokens().saturating_sub(1)) / bs;
            let g1 = if self.cfg.device_prefix_cache {
                self.leader
                    .device()
                    .match_prefix(&hashes[..limit.min(hashes.len())])
            } else {
                Vec::new()
            };
            self.emitter.emit(
                Some(&r.id),
                EventKind::MatchResult {
                    tier: Tier::Device,
                    looked_up: limit as u32,
                    hit_blocks: g1.len() as u32,
                    hit_tokens: (g1.len() * bs) as u32,
                },
            );
            let computed = g1.len() * bs;
            let (ext, _) = self
                .leader
                .get_num_new_matched_tokens(&r.id, computed)
                .unwrap_or((0, false));
            let (ext_host, ext_disk) = self.leader.staged_by_tier(&r.id);
            let need = r.blocks_needed(bs).saturating_sub(g1.len());
            match self.leader.device().allocate(need) {
                Ok(blocks) => {
                    self.emitter.emit(
                        Some(&r.id),
                        EventKind::BlocksAllocated {
                            tier: Tier::Device,
                            blocks: g1
                                .iter()
                                .map(|b| b.id())
                                .chain(blocks.iter().map(|b| b.id()))
                                .collect(),
                        },
                    );
                    let mut blocks: VecDeque<_> = blocks.into();
                    let n_ext = (ext / bs).min(blocks.len());
                    let dests: Vec<_> = blocks.drain(..n_ext).collect();
                    if !r.admitted_once {
                        // Like vLLM, loaded tokens count as computed from
                        // here; a failed load rolls them back.
                        self.hits[0] += computed as u64;
                        let host = ext_host.min(n_ext * bs);
                        self.hits[1] += host as u64;
                        self.hits[2] += (n_ext * bs - host).min(ext_disk) as u64;
                        r.admitted_once = true;
                    }
                    let _ = self
                        .leader
                        .update_state_after_alloc(&r.id, dests, n_ext * bs);
                    if matches!(self.cfg.offload_mode, OffloadMode::AfterHits(_)) {
                        r.device_hits = g1.clone();
                    }
                    r.full = g1;
                    r.pending = blocks;
                    r.computed = computed + n_ext * bs;
                    r.loading = n_ext;
                    self.running.push(r);
                }
                Err(PoolError::Exhausted { .. }) | Err(_) => {
                    // Not enough memory: wait (the staged blocks go back).
                    let _ = self.leader.update_state_after_alloc(&r.id, Vec::new(), 0);
                    drop(g1);
                    self.waiting.push_front(r);
                    break;
                }
            }
        }
    }

    /// Decoding requests whose next token starts a new block get one,
    /// preempting the latest arrival when the pool is out.
    fn grow_decodes(&mut self) {
        let bs = self.cfg.block_size;
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            let needs =
                r.computed >= r.prompt_len && r.held_blocks() < (r.total_tokens() + 1).div_ceil(bs);
            if !needs {
                i += 1;
                continue;
            }
            match self.leader.device().allocate(1) {
                Ok(mut b) => {
                    let id = self.running[i].id.clone();
                    self.emitter.emit(
                        Some(&id),
                        EventKind::BlocksAllocated {
                            tier: Tier::Device,
                            blocks: b.iter().map(|x| x.id()).collect(),
                        },
                    );
                    if let Some(b) = b.pop() {
                        self.running[i].pending.push_back(b);
                    }
                    i += 1;
                }
                Err(_) => {
                    // Victim: latest arrival (the usual recompute-preemption policy).
                    let victim = (0..self.running.len())
                        .max_by_key(|&j| (self.running[j].arrival_ns, j))
                        .unwrap_or(i);
                    self.preempt(victim);
                    if victim < i {
                        i -= 1;
                    }
                }
            }
        }
    }

    fn preempt(&mut self, idx: usize) {
        let mut r = self.running.remove(idx);
        let released = r.held_blocks() as u32;
        r.full.clear();
        r.pending.clear();
        r.fresh.clear();
        r.device_hits.clear();
        r.computed = 0;
        r.loading = 0;
        self.emitter.emit(
            Some(&r.id),
            EventKind::BlocksReleased {
                tier: Tier::Device,
                count: released,
            },
        );
        let _ = self.leader.request_preempted(&r.id);
        self.report.preemptions += 1;
        self.waiting.push_front(r);
    }

    fn run_batch(&mut self) -> (SchedulerOutput, u64) {
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_batch_tokens;
        let mut plan: Vec<(usize, usize, usize)> = Vec::new(); // (idx, prefill, decode)
        let mut skipped = Vec::new();
        // Decodes first, then prefill chunks.
        for (i, r) in self.running.iter().enumerate() {
            if r.computed >= r.prompt_len && budget > 0 {
                plan.push((i, 0, 1));
                budget -= 1;
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            if r.computed < r.prompt_len {
                let chunk = (r.prompt_len - r.computed).min(budget);
                if chunk == 0 {
                    skipped.push(r.id.clone());
                    continue;
                }
                plan.push((i, chunk, 0));
                budget -= chunk;
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            if r.computed >= r.prompt_len && !plan.iter().any(|p| p.0 == i) {
                skipped.push(r.id.clone());
            }
        }
        let mut out = SchedulerOutput {
            scheduled: Vec::new(),
            skipped,
        };
        for &(i, prefill, decode) in &plan {
            let r = &mut self.running[i];
            out.scheduled.push(ScheduledRequest {
                request: r.id.clone(),
                prefill_tokens: prefill,
                decode_tokens: decode,
                computed_tokens: r.computed + prefill + decode,
                new_full_blocks: std::mem::take(&mut r.fresh),
                device_hits: std::mem::take(&mut r.device_hits),
                new_tokens: Vec::new(),
            });
        }
        let md = self.leader.build_connector_metadata(&out);
        self.worker.bind_connector_metadata(md);
        let loads = self.worker.start_load_kv();
        let mut load_bytes = 0u64;
        let mut disk_bytes = 0u64;
        for l in loads {
            let Some(r) = self.running.iter_mut().find(|r| r.id == l.request) else {
                continue;
            };
            let got = l.blocks.len();
            let per_block = self.report.kv_bytes_per_block;
            load_bytes = load_bytes.saturating_add((got as u64).saturating_mul(per_block));
            // Disk blocks cross the disk link first.
            disk_bytes = disk_bytes
                .saturating_add((got.saturating_sub(l.from_host) as u64).saturating_mul(per_block));
            let planned = l.planned_tokens / bs;
            // Loaded blocks sit right after the G1 hits.
            let at = r.full.len();
            r.full.splice(at..at, l.blocks);
            r.loading = 0;
            if got < planned {
                // Part of the load failed: those tokens are recomputed, in
                // fresh blocks, and were not a hit after all.
                let lost = (planned - got) * bs;
                r.computed -= lost;
                self.hits[1] = self.hits[1].saturating_sub(lost as u64);
                if let Ok(more) = self.leader.device().allocate(planned - got) {
                    r.pending.extend(more);
                }
            }
        }
        // The forward pass.
        for &(i, prefill, decode) in &plan {
            self.forward(i, prefill, decode);
        }
        self.worker.forward_pass_done();
        let w = &self.cfg.worker;
        let load_ns = (load_bytes as f64 / w.pcie_bytes_per_s * 1e9
            + disk_bytes as f64 / w.disk_bytes_per_s * 1e9) as u64;
        let fin = self.worker.get_finished();
        self.report.loads_finished += fin.recving.len() as u64;
        self.report.stores_finished += fin.sending.len() as u64;
        (out, load_ns)
    }

    fn compute_cost(&self, out: &SchedulerOutput) -> u64 {
        let w = &self.cfg.worker;
        let prefill: u64 = out.scheduled.iter().map(|s| s.prefill_tokens as u64).sum();
        let decodes = out.scheduled.iter().filter(|s| s.decode_tokens > 0).count() as u64;
        // Saturating: the costs and the batch size come from the command
        // line.
        let mut ns = prefill.saturating_mul(w.prefill_ns_per_token);
        if decodes > 0 {
            ns = ns
                .saturating_add(w.decode_ns_per_step)
                .saturating_add(decodes.saturating_mul(w.decode_ns_per_seq));
        }
        ns.max(1)
    }

    /// Computes `prefill` prompt tokens or one decode token for request
    /// `i`: every block that fills goes through the lifecycle, gets its
    /// bytes and is registered on G1.
    fn forward(&mut self, i: usize, prefill: usize, decode: usize) {
        let bs = self.cfg.block_size;
        let bytes = self.device.block_bytes();
        let salt = self.salt;
        let now = self.now_ns;
        let r = &mut self.running[i];
        if decode > 0 {
            // The sampled token: deterministic from the request and position.
            let pos = r.total_tokens() as u32;
            let tok = pos.wrapping_mul(2_654_435_761) ^ (r.arrival_ns as u32);
            r.seq.append(tok % 32_000);
            r.generated += 1;
        }
        r.computed += prefill + decode;
        let produced_first = prefill > 0 && r.computed >= r.prompt_len && r.generated == 0;
        if produced_first {
            // The prefill's last chunk samples the first token.
            let pos = r.total_tokens() as u32;
            r.seq.append(pos.wrapping_mul(2_654_435_761) % 32_000);
            r.generated = 1;
            r.first_token_ns = Some(now);
        }
        // Blocks fully computed now.
        let full_now = r.computed.min(r.total_tokens()) / bs;
        while r.full.len() < full_now {
            let idx = r.full.len();
            let Some(tb) = r.seq.blocks().get(idx).cloned() else {
                break;
            };
            let Some(b) = r.pending.pop_front() else {
                break;
            };
            let mut p = b.init(salt, tb.parent_sequence_hash(), tb.position());
            p.add_tokens(tb.tokens());
            let Ok(ready) = p.ready() else { break };
            let mut running = ready.schedule_compute();
            let data = kv_bytes(tb.sequence_hash().0, bytes);
            let _ = self.device.write(&mut running, &data);
            let ComputeDone::Complete(c) = running.compute_done() else {
                break;
            };
            let reg = c.register();
            r.fresh.push(reg.clone());
            r.full.push(reg);
        }
    }

    fn finish_requests(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.generated < r.output_len {
                i += 1;
                continue;
            }
            let mut r = self.running.remove(i);
            if let Some(t) = r.first_token_ns {
                self.ttft
                    .push((t.max(r.arrival_ns) - r.arrival_ns) as f64 / 1e6);
            }
            let to_store = match self.cfg.offload_mode {
                OffloadMode::Eager => std::mem::take(&mut r.fresh),
                OffloadMode::Lazy => r.full.clone(),
                OffloadMode::AfterHits(_) => Vec::new(),
            };
            let released = r.held_blocks() as u32;
            let _ = self.leader.request_finished(&r.id, &to_store);
            drop(to_store);
            r.full.clear();
            r.pending.clear();
            self.emitter.emit(
                Some(&r.id),
                EventKind::BlocksReleased {
                    tier: Tier::Device,
                    count: released,
                },
            );
            self.report.requests_finished += 1;
        }
    }

    /// Waits for every transfer, then reports.
    pub fn finish(mut self) -> SimReport {
        self.worker.drain();
        self.leader.emit_gauges();
        let mut by_dir = BTreeMap::new();
        for (d, p) in &self.pipelines {
            let s: PipelineStats = p.stats();
            by_dir.insert(
                d.to_string(),
                PipelineTotals {
                    completed: s.completed,
                    skipped: s.skipped.iter().map(|(_, n)| n).sum(),
                    blocks: s.blocks_transferred,
                    bytes: s.bytes_transferred,
                    real_bytes: self
                        .copiers
                        .iter()
                        .filter(|(cd, _)| cd == d)
                        .map(|(_, e)| e.counters().bytes)
                        .sum(),
                },
            );
        }
        let c = self.emitter.bus().counters();
        let interrupted = !self.is_done();
        let r = &mut self.report;
        r.interrupted = interrupted;
        r.iterations = self.iteration;
        r.virtual_time_ms = self.now_ns as f64 / 1e6;
        r.wall_time_ms = self.started.elapsed().as_secs_f64() * 1e3;
        r.transfers_by_direction = by_dir;
        r.prefix_hit_tokens_by_tier = [
            ("device", self.hits[0]),
            ("host", self.hits[1]),
            ("disk", self.hits[2]),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        r.prefix_hit_tokens = self.hits.iter().sum();
        r.prefix_hit_ratio = if r.prompt_tokens == 0 {
            0.0
        } else {
            r.prefix_hit_tokens as f64 / r.prompt_tokens as f64
        };
        r.ttft_ms = MillisSummary::of(std::mem::take(&mut self.ttft));
        r.events_emitted = self.emitter.emitted();
        r.events_lost = c.tap_dropped + c.lagged_total;
        self.report
    }
}

/// What the simulated forward pass writes into a block: derived from its
/// sequence hash, so any copy of it can be checked.
pub fn kv_bytes(seq_hash: u64, n: usize) -> Vec<u8> {
    let mut x = seq_hash | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}
