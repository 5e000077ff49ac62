//! The scheduler side of the connector, in vLLM's engine-core process.
//!
//! vLLM owns the device tier (G1): its block pool, its prefix cache, its
//! block ids. kvbm owns the host (G2) and disk (G3) tiers and their prefix
//! index, and follows vLLM's G1 blocks in a *mirror* pool: a full block
//! vLLM computed for a request becomes a registered mirror block (kvbm's
//! hashes of the request's tokens) mapped to vLLM's block id, and a block
//! vLLM allocated for a load becomes a mirror destination. Everything else
//! is kvbm's own machinery, exactly as in the simulator: a [`Leader`] with
//! its slots, transfer candidates, offload pipelines and events.
//!
//! Copies that touch G1 happen in vLLM's worker process: the pipelines
//! into and out of G1 end in [`RemoteEngine`]s, whose batches this side
//! ships once per step in a [`StepPlan`] (block ids translated from mirror
//! ids to vLLM's) and resolves when the worker's [`StepReport`] comes back.
//! Host ↔ disk copies run here (both tiers are files this process maps;
//! under tensor parallelism every rank's files, each rank holding its own
//! shard). Every rank runs each step's plan on its own tensors and files,
//! and a batch resolves once every rank has reported it.
//!
//! The timing vLLM allows, and what it means here:
//!
//! - `get_num_new_matched_tokens` may be asked many times for a waiting
//!   request; it re-matches each time, and a breakpoint that names the
//!   request *holds* it (answers "not yet") without blocking vLLM.
//! - Loads are synchronous: a hit is loaded before the forward pass of the
//!   step that admits the request. `build_connector_meta` waits (at most
//!   `ship_timeout`) for the step's loads to reach the worker's queue; a
//!   load that does not make it is reported as failed, and vLLM computes
//!   those tokens instead (it must run with
//!   `kv_load_failure_policy="recompute"`, which the Python class sets).
//! - Eager stores of the blocks a forward pass computes wait for that pass
//!   (vLLM reports it in `update_connector_output`, steps' outputs in the
//!   order they were planned, two in flight with async scheduling) and
//!   ship with a later step, whose worker runs them before its own forward
//!   pass, i.e. before vLLM can reuse a freed block. A request that finishes with stores
//!   still out keeps its blocks (`request_finished` answers `delay_free`)
//!   until they have run. The next step ships them, waiting for them if
//!   it runs nothing (an idle engine takes that step and no other), and
//!   the worker names the request finished sending after running them, so
//!   vLLM frees the blocks one step after the finish and can reset its
//!   prefix cache. A store whose blocks vLLM freed anyway (preemption) is
//!   failed instead of shipped.

use crate::config::{Config, Offload};
use crate::meta::{Batch, Pair, Route, StepPlan, StepReport};
use crate::observe::{FleetCounters, Observers};
pub use crate::parallel::Parallel;
use crate::phases::{Phase, Phases};
use crate::tiers::{
    Geometry, Shard, ShmClaim, TierSizes, disk_path, human, remove_stale, shm_dir, shm_path,
};
use kvbm_core::assembly::{self, AssemblyError, Pools};
use kvbm_core::block::{Empty, ImmutableBlock, MutableBlock};
use kvbm_core::hooks::{Breakpoints, HookSet};
use kvbm_core::layout::LayoutKind;
use kvbm_core::leader::{
    ConnectorMetadata, Leader, LeaderPools, LeaderWiring, PoolEvents, ScheduledRequest,
    SchedulerOutput,
};
use kvbm_core::offload::{
    BatchConfig, OffloadPipeline, PipelineConfig, PreconditionTrigger, TransferHandle,
};
use kvbm_core::pool::{BlockPool, PoolConfig};
use kvbm_core::storage::{DiskStorage, HostStorage};
use kvbm_core::transfer::{
    DiskDirection, DiskEngine, EngineConfig, RemoteEngine, ShardedEngine, TransferEngine,
    TransferStats,
};
use kvbm_events::bus::BusConfig;
use kvbm_events::{BlockId, Direction, Emitter, EventKind, MonotonicClock, RequestId, Tier};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The hasher of the maps looked up per request per step: the ids are
/// vLLM's own, so SipHash's resistance to chosen keys buys nothing here.
type FastHash = foldhash::fast::RandomState;

/// Why the scheduler side could not start or go on.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    /// The settings.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// vLLM's geometry.
    #[error(transparent)]
    Geometry(#[from] crate::tiers::GeometryError),
    /// A tier's storage (the shared host file, the disk file).
    #[error("kvbm: {what}: {source}")]
    Storage {
        /// Which.
        what: String,
        /// Why.
        #[source]
        source: kvbm_core::storage::StorageError,
    },
    /// Starting the attach server or the recorder.
    #[error("kvbm: {0}")]
    Observe(String),
    /// Anything else that stopped the block manager from starting.
    #[error("kvbm: {0}")]
    Setup(String),
    /// A request vLLM asks about that kvbm cannot take.
    #[error("kvbm: request {request}: {reason}")]
    Request {
        /// The request.
        request: String,
        /// Why.
        reason: String,
    },
    /// A report from the worker that does not parse.
    #[error(transparent)]
    Meta(#[from] crate::meta::MetaError),
}

fn setup<E: std::fmt::Display>(e: E) -> SchedulerError {
    SchedulerError::Setup(e.to_string())
}

impl From<AssemblyError> for SchedulerError {
    fn from(e: AssemblyError) -> Self {
        setup(e)
    }
}

/// A refusal about `request`, its id clipped (ids come from the caller and
/// may be any length).
fn request_err(request: &str, reason: impl Into<String>) -> SchedulerError {
    SchedulerError::Request {
        request: kvbm_events::text::clip(request, kvbm_events::text::MAX_QUOTED_CHARS),
        reason: reason.into(),
    }
}

/// What a slot error says, without the request id it repeats
/// ([`SchedulerError::Request`] names the request once).
fn slot_reason(e: &kvbm_events::slot::SlotError) -> String {
    use kvbm_events::slot::SlotError;
    match e {
        SlotError::IllegalTransition { from, to, .. } => {
            format!("illegal slot transition {from} → {to}")
        }
        SlotError::UnknownRequest(_) => "kvbm has no slot for it".into(),
        SlotError::DuplicateRequest(_) => "a slot for it already exists".into(),
    }
}

/// What vLLM scheduled for one request in a step.
#[derive(Debug, Clone, Default)]
pub struct Scheduled {
    /// The request.
    pub request: RequestId,
    /// Tokens of the request (prompt and generated) kvbm has not been given
    /// yet.
    pub new_tokens: Vec<u32>,
    /// The request's prompt length.
    pub prompt_len: usize,
    /// Tokens computed before this step.
    pub computed_before: usize,
    /// Tokens this step computes (`computed_before + scheduled` must not
    /// overflow).
    pub scheduled: usize,
    /// The request's whole block table now (vLLM block ids, group 0), or
    /// `None` when it is the one last given (vLLM's tables only grow, and
    /// most steps add no block).
    pub block_ids: Option<Vec<u32>>,
}

/// vLLM's scheduler output, as the connector needs it.
#[derive(Debug, Clone, Default)]
pub struct StepInput {
    /// Requests run this step.
    pub scheduled: Vec<Scheduled>,
    /// Requests vLLM preempted this step (their blocks are free now).
    pub preempted: Vec<String>,
    /// vLLM's free device blocks now, if known (for the G1 gauge).
    pub g1_free: Option<usize>,
    /// Requests left out of the step before it got here, each with why
    /// (their input could not be read): counted and said, as those
    /// refused here are.
    pub refused: Vec<String>,
}

/// What the connector counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    /// Steps shipped.
    pub steps: u64,
    /// Loads that could not be shipped in their step (vLLM recomputed).
    pub late_loads: u64,
    /// Load blocks the worker reported failed (vLLM recomputed).
    pub failed_load_blocks: u64,
    /// Store batches failed before shipping (their G1 blocks were freed).
    pub unshippable_stores: u64,
    /// Scheduled requests left out of a step because what was passed for
    /// them was unusable (each logged); the step went on for the others.
    pub refused_scheduled: u64,
    /// Steps whose following and planning ran after `build_connector_meta`
    /// returned (sync scheduling: while vLLM waited for the worker).
    pub deferred_steps: u64,
    /// Loads a deferred step planned (none by construction: such a step
    /// is never deferred); they did not ship.
    pub deferred_loads: u64,
    /// Requests held by a breakpoint at some point.
    pub held_asks: u64,
    /// Requests whose blocks were kept for stores still out.
    pub delayed_frees: u64,
    /// Of those, requests freed in the first step after they finished,
    /// their last stores shipped with it (the rest waited for reports).
    pub early_frees: u64,
    /// Reports from the worker that did not parse.
    pub bad_reports: u64,
    /// Tokens another connector provided (`ExternalHit`), in all.
    pub external_hit_tokens: u64,
    /// Steps whose output vLLM never reported (their stores went when
    /// more than three steps were out).
    pub unmatched_outputs: u64,
    /// Steps whose plan had to wait for the pipelines to ship its
    /// transfers, and their wait in all (µs).
    pub ship_waits: u64,
    /// See `ship_waits`.
    pub ship_wait_us: u64,
}

/// One request as the connector follows it.
struct Req {
    id: RequestId,
    /// vLLM's block table (group 0).
    block_ids: Vec<u32>,
    /// Full blocks already mirrored (or skipped), from the start.
    mirrored: usize,
    /// The `num_computed_tokens` of the last lookup (where a load starts).
    lookup_computed: usize,
    /// The external tokens the last lookup promised (the most a load may
    /// bring).
    matched: usize,
    /// Block indices a load filled (not stored again).
    loaded: std::ops::Range<usize>,
    /// Mirror blocks held for this request: `own` are the ones it made
    /// (mapped to its G1 blocks, what lazy mode stores when it finishes),
    /// `shared` the ones vLLM's prefix cache shares with another request.
    own: Vec<ImmutableBlock>,
    shared: Vec<ImmutableBlock>,
    /// Mirror ids this request mapped to vLLM ids.
    mapped: Vec<BlockId>,
    /// Loads started this step: mirror destinations, for the late check.
    load_dests: Vec<(BlockId, u32)>,
    /// G1 blocks announced as this request's (`BlocksAllocated`) and not
    /// yet released.
    g1_announced: u32,
    /// Looked up and not scheduled since: its next schedule tells what
    /// another connector provided (see `external_hit`).
    admitting: bool,
    /// The external tokens vLLM took from kvbm at its latest admission.
    accepted: usize,
    /// The last step that scheduled it (0: none yet): which followed
    /// requests a step skipped, with no set of the step's names to build.
    scheduled_at: u64,
}

impl Req {
    fn new(id: RequestId) -> Self {
        Req {
            id,
            block_ids: Vec::new(),
            mirrored: 0,
            lookup_computed: 0,
            matched: 0,
            loaded: 0..0,
            own: Vec::new(),
            shared: Vec::new(),
            mapped: Vec::new(),
            load_dests: Vec::new(),
            g1_announced: 0,
            admitting: false,
            accepted: 0,
            scheduled_at: 0,
        }
    }
}

/// What the scheduler side's calls leave for kvbm's runtime to run while
/// vLLM waits for the worker (see `SchedulerSide::run_deferred`).
#[derive(Default)]
struct Deferral {
    /// Whether anything may be left at all (see `defer_to_runtime`).
    on: bool,
    /// A step vLLM was handed the plan of, still to be followed and
    /// planned.
    step: Option<StepInput>,
    /// The outputs vLLM reported since, still to be released and resolved.
    outputs: Vec<Vec<Vec<u8>>>,
    /// A load was planned since the last step (it ships in the next plan).
    loads_this_step: bool,
}

/// The scheduler side. See the module docs.
pub struct SchedulerSide {
    cfg: Config,
    geometry: Geometry,
    runtime: tokio::runtime::Runtime,
    emitter: Arc<Emitter>,
    breakpoints: Arc<Breakpoints>,
    leader: Leader,
    mirror: BlockPool,
    engines: Vec<(Route, Arc<RemoteEngine>)>,
    /// The pipelines into G1, with their remote engines: a step waits
    /// for its loads to reach the worker-bound queues.
    load_pipelines: Vec<(Arc<OffloadPipeline>, Option<Arc<RemoteEngine>>)>,
    /// The pipelines out of G1: once nothing is left in them that has not
    /// shipped, every finished request's blocks may be freed.
    store_pipelines: Vec<(Arc<OffloadPipeline>, Option<Arc<RemoteEngine>>)>,
    /// The host and disk tiers' storages, one per rank.
    _host: Vec<Arc<HostStorage>>,
    _disk: Vec<Arc<DiskStorage>>,
    /// How the engine runs: its workers, its scheduling.
    parallel: Parallel,
    /// Batches some ranks have reported and others not yet: (route, id)
    /// → (reports, the first error, bytes, longest time).
    partial: HashMap<(Route, u64), Partial, FastHash>,
    /// What the engine runs as, for people: the line logged at start.
    summary: String,
    /// What the start did that the user should hear of (host-tier files
    /// of dead engines it removed), for the caller to log.
    notes: Vec<String>,
    /// The shared host tier's file, locked while this side lives; removed
    /// at shutdown.
    shm: Option<ShmClaim>,
    /// Keyed by the request's id itself (the `Arc` the leader's slot and
    /// the events name it by): one allocation, read once per lookup.
    requests: HashMap<RequestId, Req, FastHash>,
    /// Mirror block id → vLLM block id, with how many requests map it.
    g1: HashMap<BlockId, (u32, u32)>,
    /// Each shipped step's store trigger (or none), oldest first: a step's
    /// stores may go once vLLM reports that step's forward pass done, which
    /// with async scheduling comes after the next step was planned.
    triggers: std::collections::VecDeque<Option<PreconditionTrigger>>,
    /// Finished requests whose blocks vLLM keeps until their stores drain.
    delayed: HashSet<String>,
    /// Work left for kvbm's runtime (see `run_deferred`).
    deferral: Deferral,
    step: u64,
    counters: Counters,
    observers: Option<Observers>,
    /// The NATS publisher's and control's final counters, once stopped.
    fleet_final: FleetCounters,
    /// Time spent in the connector since the last step was shipped, and
    /// per step before that (the last [`TIMING_SAMPLES`]).
    spent_ns: u64,
    step_ns: std::collections::VecDeque<u64>,
    /// The same time, phase by phase, since the start.
    phases: Phases,
}

/// True when every container `p` holds has reached its engine (for a
/// remote engine: its queue for the worker, or the worker); with
/// `preconditions`, containers still waiting on theirs count as held.
fn nothing_unshipped(
    p: &OffloadPipeline,
    remote: Option<&RemoteEngine>,
    preconditions: bool,
) -> bool {
    let s = p.stats();
    let mut before_engine = s.queued_for_policy + s.queued_for_batcher + s.in_queue + s.on_deck;
    if preconditions {
        before_engine += s.awaiting_precondition;
    }
    let unsubmitted = remote.map_or(0, |r| s.in_flight.saturating_sub(r.pending()));
    before_engine == 0 && unsubmitted == 0
}

/// A batch some of the engine's ranks have reported.
#[derive(Debug, Default)]
struct Partial {
    reports: usize,
    error: Option<String>,
    bytes: u64,
    elapsed_ns: u64,
}

/// The most steps vLLM has in flight at once (async scheduling: two),
/// with one to spare.
const MAX_STEPS_IN_FLIGHT: usize = 3;

/// How long a step waiting for its transfers to ship yields before it
/// sleeps.
const SHIP_SPIN: Duration = Duration::from_micros(200);

/// How often each pipeline's sweeper clears cancelled transfers out of its
/// queues. The stages skip cancelled ones anyway; the sweep only frees
/// their room sooner, and at the pipelines' 10 ms default the four of them
/// would wake the scheduler's runtime 400 times a second, on the core vLLM
/// keeps for its scheduler.
const SWEEP_INTERVAL: Duration = Duration::from_millis(100);

/// Steps whose connector time is kept for [`SchedulerSide::step_timing`].
pub const TIMING_SAMPLES: usize = 100_000;

/// The connector's own time per vLLM step, µs.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StepTiming {
    /// Steps measured.
    pub steps: usize,
    /// Mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Largest.
    pub max_us: f64,
}

impl std::fmt::Debug for SchedulerSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerSide")
            .field("step", &self.step)
            .field("requests", &self.requests.len())
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

fn route_of(d: Direction) -> Option<Route> {
    match (d.src, d.dst) {
        (Tier::Device, Tier::Host) => Some(Route::DeviceToHost),
        (Tier::Host, Tier::Device) => Some(Route::HostToDevice),
        (Tier::Device, Tier::Disk) => Some(Route::DeviceToDisk),
        (Tier::Disk, Tier::Device) => Some(Route::DiskToDevice),
        _ => None,
    }
}

/// The pools: G1's mirror of vLLM's blocks, and G2 and G3 as configured,
/// each reporting to `emitter`; a size that cannot work is named by the
/// setting (or vLLM's count) it came from.
/// What mirroring one step's blocks of a request found.
#[derive(Default)]
struct Mirrored {
    /// Blocks this request computed: newly registered in the mirror.
    fresh: Vec<ImmutableBlock>,
    /// Blocks vLLM's prefix cache served it (registered already).
    hits: Vec<ImmutableBlock>,
}

fn tier_pools(
    emitter: &Arc<Emitter>,
    geometry: &Geometry,
    sizes: TierSizes,
    eviction: kvbm_core::eviction::TierEviction,
) -> Result<Pools, SchedulerError> {
    let observer = Arc::new(PoolEvents(emitter.clone()));
    let pool = |tier, capacity| -> Result<BlockPool, SchedulerError> {
        BlockPool::with_observer(
            PoolConfig {
                tier,
                capacity,
                block_size: geometry.block_size,
                eviction: eviction.of(tier).eviction,
                admission: eviction.of(tier).admission,
            },
            observer.clone(),
        )
        .map_err(|e| {
            // Named by what sized it: a setting, or vLLM's own count.
            let what = match tier {
                Tier::Host => "kv_connector_extra_config `host_capacity_tokens`",
                Tier::Disk => "kv_connector_extra_config `disk_capacity_tokens`",
                Tier::Device => "vLLM's num_gpu_blocks",
            };
            setup(format!("{e} ({what})"))
        })
    };
    // Room for a mirror of every vLLM block and as many load
    // destinations in flight; evicted (LRU) when vLLM's blocks move on.
    let mirror_blocks = geometry.num_gpu_blocks.checked_mul(2).ok_or_else(|| {
        crate::tiers::GeometryError::Invalid(format!(
            "num_gpu_blocks {} is too large (kvbm mirrors twice as many)",
            geometry.num_gpu_blocks
        ))
    })?;
    let mirror = pool(Tier::Device, mirror_blocks)?;
    let g2 = (sizes.host_blocks > 0)
        .then(|| pool(Tier::Host, sizes.host_blocks))
        .transpose()?;
    let g3 = (sizes.disk_blocks > 0)
        .then(|| pool(Tier::Disk, sizes.disk_blocks))
        .transpose()?;
    Ok(Pools {
        device: mirror,
        host: g2,
        disk: g3,
    })
}

/// A remote engine's name, for its errors and the worker's logs.
fn remote_name(d: Direction) -> &'static str {
    match (d.src, d.dst) {
        (Tier::Device, Tier::Host) => "G1→G2 (vLLM worker)",
        (Tier::Host, Tier::Device) => "G2→G1 (vLLM worker)",
        (Tier::Device, Tier::Disk) => "G1→G3 (vLLM worker)",
        (Tier::Disk, Tier::Device) => "G3→G1 (vLLM worker)",
        _ => "kvbm (vLLM worker)",
    }
}

/// Each rank's host-tier file, shared with its worker: stale files of
/// killed engines removed first (said in `notes`), room claimed, each
/// mapped.
fn host_files(
    cfg: &Config,
    engine_id: &str,
    geometry: &Geometry,
    sizes: TierSizes,
    parallel: &Parallel,
    notes: &mut Vec<String>,
) -> Result<(ShmClaim, Vec<Arc<HostStorage>>), SchedulerError> {
    let dir = shm_dir(cfg);
    for (path, size) in remove_stale(&dir) {
        notes.push(format!(
            "removed {} ({}), a host-tier file no running engine holds (left by one that was killed)",
            path.display(),
            human(size)
        ));
    }
    let hl = geometry.layout(sizes.host_blocks, LayoutKind::FullyContiguous)?;
    let each = HostStorage::shared_len(&hl).ok_or_else(|| {
        setup("kv_connector_extra_config `host_capacity_tokens`: the host tier's size overflows")
    })?;
    let paths: Vec<_> = Shard::all(parallel.ranks)
        .map(|r| shm_path(cfg, engine_id, r))
        .collect();
    let claim = ShmClaim::take(&paths, each as u64).map_err(setup)?;
    let mut storage = Vec::new();
    for path in claim.paths() {
        storage.push(Arc::new(HostStorage::shared(path, hl).map_err(
            |source| SchedulerError::Storage {
                what: format!(
                    "the host tier's shared file {} (kv_connector_extra_config `shm_dir`)",
                    path.display()
                ),
                source,
            },
        )?));
    }
    Ok((claim, storage))
}

/// Each rank's disk-tier file, opened or created.
fn disk_files(
    path: &std::path::Path,
    geometry: &Geometry,
    sizes: TierSizes,
    parallel: &Parallel,
) -> Result<Vec<Arc<DiskStorage>>, SchedulerError> {
    let dl = geometry.layout(sizes.disk_blocks, LayoutKind::FullyContiguous)?;
    Shard::all(parallel.ranks)
        .map(|rank| {
            let path = disk_path(path, rank);
            DiskStorage::open_or_create(&path, dl)
                .map(Arc::new)
                .map_err(|source| SchedulerError::Storage {
                    what: format!(
                        "the disk tier's file {} (kv_connector_extra_config `disk_path`)",
                        path.display()
                    ),
                    source,
                })
        })
        .collect()
}

/// The pipelines' settings for a direction that runs in vLLM's worker.
fn remote_pipeline_config() -> PipelineConfig {
    PipelineConfig {
        batch_config: BatchConfig {
            max_batch_size: 64,
            min_batch_size: 1,
            flush_interval: Duration::from_millis(1),
        },
        // A remote batch is out until the next step: let many be.
        max_concurrent_transfers: 256,
        on_deck_capacity: 16,
        sweep_interval: SWEEP_INTERVAL,
        ..PipelineConfig::default()
    }
}

/// The pipelines' settings for host ↔ disk, which runs in this process.
fn local_pipeline_config() -> PipelineConfig {
    PipelineConfig {
        batch_config: BatchConfig {
            min_batch_size: 1,
            flush_interval: Duration::from_millis(1),
            ..BatchConfig::default()
        },
        sweep_interval: SWEEP_INTERVAL,
        ..PipelineConfig::default()
    }
}

/// The engine for `d` when G1 is one end: batches shipped to vLLM's
/// worker, over storages laid out as vLLM's (G1 a tensor per layer).
fn remote_engine(
    geometry: &Geometry,
    d: Direction,
    src_blocks: usize,
    dst_blocks: usize,
) -> Result<Arc<RemoteEngine>, SchedulerError> {
    let layout = |t: Tier, n| {
        geometry.layout(
            n,
            if t == Tier::Device {
                LayoutKind::LayerSeparate
            } else {
                LayoutKind::FullyContiguous
            },
        )
    };
    Ok(Arc::new(
        RemoteEngine::new(
            remote_name(d),
            (layout(d.src, src_blocks)?, d.src),
            (layout(d.dst, dst_blocks)?, d.dst),
            EngineConfig { queue_depth: 4096 },
        )
        .map_err(setup)?,
    ))
}

/// The engine for host ↔ disk: one disk engine per rank's pair of files,
/// sharded by block when there are several ranks.
fn sharded_disk(
    host: &[Arc<HostStorage>],
    disk: &[Arc<DiskStorage>],
    d: Direction,
) -> Result<Arc<dyn TransferEngine>, SchedulerError> {
    let direction = if d.dst == Tier::Disk {
        DiskDirection::HostToDisk
    } else {
        DiskDirection::DiskToHost
    };
    let shards = host
        .iter()
        .zip(disk)
        .map(|(s2, s3)| {
            DiskEngine::new(s2.clone(), s3.clone(), direction, Tier::Host)
                .map(|e| Arc::new(e) as Arc<dyn TransferEngine>)
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(setup)?;
    Ok(if shards.len() == 1 {
        shards.into_iter().next().expect("one shard")
    } else {
        Arc::new(ShardedEngine::new(shards).map_err(setup)?)
    })
}

/// The scheduler side's runtime: the pipelines' tasks, and the attach
/// server's and the NATS clients' where configured.
///
/// One worker: the pipelines' tasks are short, and a second worker mostly
/// woke to look for work the first had already taken (about two wake-ups
/// a step where one does). Measured by bench.py's guard on the 2-core
/// machine, dev build: kvbm's threads woke 1,284 to 1,946 times a second
/// with two workers, 929 to 1,076 with one. A pipeline's hook that may
/// block leaves the worker first (`block_in_place`), so one worker never
/// stalls the others' tasks.
fn pipelines_runtime() -> Result<tokio::runtime::Runtime, SchedulerError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("kvbm-scheduler")
        // Threads tokio starts later may be started from vLLM's.
        .on_thread_start(|| {
            crate::background::batch_this_thread();
        })
        .enable_all()
        .build()
        .map_err(setup)
}

impl SchedulerSide {
    /// Starts the block manager for vLLM engine `engine_id` with this
    /// geometry (one worker's: under tensor parallelism each rank's shard):
    /// the tiers (each rank's shared host file and disk file), the
    /// pipelines, breakpoints, and the attach server and recording when
    /// configured. Host-tier files that no living engine holds are removed
    /// from `shm_dir` first.
    ///
    /// Everything is built on a thread of its own that runs as
    /// `SCHED_BATCH`, so that every thread kvbm starts here does (see
    /// [`crate::background`]).
    pub fn start(
        cfg: Config,
        geometry: Geometry,
        engine_id: &str,
        parallel: Parallel,
    ) -> Result<Self, SchedulerError> {
        std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("kvbm-start".into())
                .spawn_scoped(s, || {
                    crate::background::batch_this_thread();
                    Self::start_here(cfg, geometry, engine_id, parallel)
                })
                .map_err(setup)?
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    fn start_here(
        cfg: Config,
        geometry: Geometry,
        engine_id: &str,
        parallel: Parallel,
    ) -> Result<Self, SchedulerError> {
        geometry.check()?;
        parallel.check().map_err(SchedulerError::Setup)?;
        let sizes = TierSizes::of(&cfg, &geometry)?;
        let runtime = pipelines_runtime()?;
        let _guard = runtime.enter();
        let emitter = Arc::new(
            Emitter::new(0, BusConfig::default(), Arc::new(MonotonicClock::new()))
                .map_err(setup)?,
        );
        let breakpoints = Arc::new(Breakpoints::new(
            Some(emitter.clone()),
            cfg.breakpoint_deadline,
        ));
        let pools = tier_pools(&emitter, &geometry, sizes, cfg.eviction)?;
        let (mirror, g2, g3) = (pools.device.clone(), pools.host.clone(), pools.disk.clone());
        let wiring = LeaderWiring::new(emitter.clone(), g2.clone());
        // What the start did that the user should hear of (vLLM's
        // processes print Python's logging, not `tracing`).
        let mut notes = Vec::new();
        // Claimed (room reserved) before it is mapped, and removed if this
        // start fails from here on (the claim is dropped with the error).
        let (shm, host_storage) = match &g2 {
            Some(_) => {
                let (claim, storage) =
                    host_files(&cfg, engine_id, &geometry, sizes, &parallel, &mut notes)?;
                (Some(claim), storage)
            }
            None => (None, Vec::new()),
        };
        let disk_storage = match (&g3, &cfg.disk_path) {
            (Some(_), Some(path)) => disk_files(path, &geometry, sizes, &parallel)?,
            _ => Vec::new(),
        };
        let mut remotes = Vec::new();
        let route = |d: Direction| -> Result<assembly::Route, SchedulerError> {
            Ok(if d.src != Tier::Device && d.dst != Tier::Device {
                // Host ↔ disk runs here, in every rank's files.
                assembly::Route {
                    engine: sharded_disk(&host_storage, &disk_storage, d)?,
                    config: local_pipeline_config(),
                }
            } else {
                // Whatever touches G1 runs in vLLM's worker, from the
                // batches this side ships.
                let size = |t: Tier| pools.get(t).map_or(0, BlockPool::capacity);
                let e = remote_engine(&geometry, d, size(d.src), size(d.dst))?;
                remotes.push((d, e.clone()));
                assembly::Route {
                    engine: e,
                    config: remote_pipeline_config(),
                }
            })
        };
        // SAFETY: each storage belongs to exactly one pool here; G1's
        // blocks are vLLM's and reached only by the worker, through the
        // batches this side ships.
        let connected = unsafe { assembly::connect(&pools, Some(&wiring), route) }?;
        let remote_of = |d: Direction| {
            remotes
                .iter()
                .find(|(r, _)| *r == d)
                .map(|(_, e)| e.clone())
        };
        let engines: Vec<(Route, Arc<RemoteEngine>)> = remotes
            .iter()
            .filter_map(|(d, e)| route_of(*d).map(|r| (r, e.clone())))
            .collect();
        // Only loads hold a busy step back (see `wait_until_shipped`).
        let touching = |dev: fn(&Direction) -> bool| -> Vec<(Arc<OffloadPipeline>, Option<Arc<RemoteEngine>>)> {
            connected
                .by_direction
                .iter()
                .filter(|(d, _)| dev(d))
                .map(|(d, p)| (p.clone(), remote_of(*d)))
                .collect()
        };
        let load_pipelines = touching(|d| d.dst == Tier::Device);
        let store_pipelines = touching(|d| d.src == Tier::Device);
        let p = connected.pipelines;
        let mut leader = Leader::new(
            wiring,
            LeaderPools {
                device: mirror.clone(),
                host: g2,
                disk: g3,
            },
            p,
            cfg.offload,
            kvbm_core::tokens::salt_hash(b"kvbm-vllm"),
        );
        leader.set_hooks(
            HookSet::none()
                .with_emitter(emitter.clone())
                .with_breakpoints(breakpoints.clone()),
        );
        leader.set_hold_requests(true);
        let info = parallel.info(&cfg, &geometry, sizes);
        let summary = info["summary"].as_str().unwrap_or_default().to_string();
        let observers = Observers::start(&cfg, &emitter, &breakpoints, runtime.handle(), info)
            .map_err(SchedulerError::Observe)?;
        drop(_guard);
        Ok(SchedulerSide {
            shm,
            cfg,
            geometry,
            runtime,
            emitter,
            breakpoints,
            leader,
            mirror,
            engines,
            load_pipelines,
            store_pipelines,
            _host: host_storage,
            _disk: disk_storage,
            requests: HashMap::default(),
            g1: HashMap::new(),
            triggers: std::collections::VecDeque::new(),
            parallel,
            partial: HashMap::default(),
            summary,
            notes,
            delayed: HashSet::new(),
            deferral: Deferral::default(),
            step: 0,
            counters: Counters::default(),
            observers: Some(observers),
            fleet_final: Default::default(),
            spent_ns: 0,
            step_ns: std::collections::VecDeque::new(),
            phases: Phases::default(),
        })
    }

    /// What kvbm runs as, in one line: ranks, scheduling, tiers and sizes
    /// (logged at start; the same facts are in the recording's sidecar and
    /// the attach server's `/health`).
    pub fn summary(&self) -> &str {
        &self.summary
    }

    /// What the start did that the user should hear of, one line each:
    /// the host-tier files of engines that were killed, which it removed.
    pub fn start_notes(&self) -> &[String] {
        &self.notes
    }

    /// The emitter (tests subscribe to it).
    pub fn emitter(&self) -> &Arc<Emitter> {
        &self.emitter
    }

    /// The breakpoints.
    pub fn breakpoints(&self) -> &Arc<Breakpoints> {
        &self.breakpoints
    }

    /// What the connector counted.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Events the connector has emitted (every one gets the next seq,
    /// watched or not).
    pub fn events_emitted(&self) -> u64 {
        self.emitter.emitted()
    }

    /// With `publish`: the NATS publisher's counters (live; after
    /// [`SchedulerSide::shutdown`], final: what it sent and lost).
    pub fn publisher_counters(&self) -> Option<kvbm_attach::nats::publish::PublisherCounters> {
        self.fleet_counters().publisher
    }

    /// With `publish`: what control on `kvbm.control.<engine_id>` answered,
    /// refused as malformed, and how many sessions it refused or let lapse
    /// (live; final after [`SchedulerSide::shutdown`]).
    pub fn control_counters(&self) -> Option<kvbm_attach::nats::control::ResponderCounters> {
        self.fleet_counters().control
    }

    fn fleet_counters(&self) -> FleetCounters {
        match &self.observers {
            Some(o) => o.fleet_counters(),
            None => self.fleet_final.clone(),
        }
    }

    /// The connector's own time per step (every call vLLM made to it from
    /// one `build_connector_meta` to the next, waits included).
    pub fn step_timing(&self) -> StepTiming {
        let mut v: Vec<u64> = self.step_ns.iter().copied().collect();
        if v.is_empty() {
            return StepTiming::default();
        }
        v.sort_unstable();
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64 / 1e3;
        StepTiming {
            steps: v.len(),
            mean_us: v.iter().sum::<u64>() as f64 / v.len() as f64 / 1e3,
            p50_us: at(0.5),
            p99_us: at(0.99),
            max_us: *v.last().unwrap_or(&0) as f64 / 1e3,
        }
    }

    /// The connector's time a step by phase, µs, over the steps so far.
    pub fn phases_per_step_us(&self) -> serde_json::Map<String, serde_json::Value> {
        self.phases.per_step_us(self.counters.steps)
    }

    /// Counts `d` of the connector's own work done outside this side's
    /// calls (reading vLLM's objects, encoding the plan) as `phase` of its
    /// time a step.
    pub fn account(&mut self, phase: Phase, d: Duration) {
        self.phases.add(phase, d);
        self.spent_ns += u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    }

    fn spent(&mut self, since: Instant) {
        self.spent_ns += u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
    }

    /// The attach server's address, when serving.
    pub fn serving(&self) -> Option<std::net::SocketAddr> {
        self.observers.as_ref().and_then(|o| o.addr())
    }

    fn req(&mut self, request: &str) -> &mut Req {
        // Looked up before an entry is made: the key's copy is made once,
        // not at every call (this runs per request per step).
        if !self.requests.contains_key(request) {
            let id = RequestId::from(request);
            self.requests.insert(id.clone(), Req::new(id));
        }
        self.requests
            .get_mut(request)
            .expect("inserted above when missing")
    }

    /// The id `request` is followed by (the one its events name), once it
    /// was looked up.
    pub fn request_id(&self, request: &str) -> Option<RequestId> {
        self.requests.get(request).map(|r| r.id.clone())
    }

    /// vLLM's `get_num_new_matched_tokens`: external tokens beyond
    /// `num_computed_tokens` that G2/G3 hold (loaded synchronously), or
    /// `None` while a breakpoint holds the request (vLLM asks again).
    pub fn get_num_new_matched_tokens(
        &mut self,
        request: &str,
        prompt: &[u32],
        num_computed_tokens: usize,
    ) -> Result<Option<usize>, SchedulerError> {
        let t = Instant::now();
        let r = self.get_num_new_matched_tokens_inner(request, prompt, num_computed_tokens);
        self.spent(t);
        self.phases.lap(Phase::Requests, &mut { t });
        r
    }

    fn get_num_new_matched_tokens_inner(
        &mut self,
        request: &str,
        prompt: &[u32],
        num_computed_tokens: usize,
    ) -> Result<Option<usize>, SchedulerError> {
        // Every call sees the steps before it followed and planned.
        self.run_deferred(false);
        let _guard = self.runtime.enter();
        let fail = |e: kvbm_events::slot::SlotError| request_err(request, slot_reason(&e));
        let id = match self.requests.get(request) {
            Some(r) => r.id.clone(),
            None => RequestId::from(request),
        };
        if !self.leader.has_slot(request) {
            self.leader.create_slot(&id, prompt, 0).map_err(fail)?;
        }
        // Followed from here on: it has a slot (a refused one leaves no
        // entry behind).
        self.req(request);
        // vLLM's own prefix cache answered before kvbm was asked:
        // `num_computed_tokens` is its G1 hit, over the full blocks it looks
        // up (it computes at least the prompt's last token). Said before
        // the leader's lookup emits the host and disk results, so that one
        // attempt's results come G1, G2, G3, as the simulator's do (a
        // reader that groups them by order pairs the right ones). A held
        // ask says it too: vLLM did look its cache up; the verdict is only
        // known inside the leader's call.
        let bs = self.geometry.block_size;
        self.emitter.emit(
            Some(&id),
            EventKind::MatchResult {
                tier: Tier::Device,
                looked_up: (prompt.len().saturating_sub(1) / bs) as u32,
                hit_blocks: (num_computed_tokens / bs) as u32,
                hit_tokens: num_computed_tokens as u32,
            },
        );
        let r = self
            .leader
            .get_num_new_matched_tokens_or_hold(&id, num_computed_tokens)
            .map_err(fail)?;
        match r {
            None => {
                self.counters.held_asks += 1;
                Ok(None)
            }
            Some((tokens, _)) => {
                let r = self.req(request);
                r.lookup_computed = num_computed_tokens;
                r.matched = tokens;
                r.admitting = true;
                r.accepted = 0;
                Ok(Some(tokens))
            }
        }
    }

    /// vLLM's `update_state_after_alloc`: `block_ids` is the request's
    /// whole block table; the `num_external_tokens` it was promised go into
    /// the blocks after the last lookup's local hit.
    pub fn update_state_after_alloc(
        &mut self,
        request: &str,
        block_ids: &[u32],
        num_external_tokens: usize,
    ) -> Result<(), SchedulerError> {
        let t = Instant::now();
        let r = self.update_state_after_alloc_inner(request, block_ids, num_external_tokens);
        self.spent(t);
        self.phases.lap(Phase::Requests, &mut { t });
        r
    }

    fn update_state_after_alloc_inner(
        &mut self,
        request: &str,
        block_ids: &[u32],
        num_external_tokens: usize,
    ) -> Result<(), SchedulerError> {
        // Every call sees the steps before it followed and planned.
        self.run_deferred(false);
        let _guard = self.runtime.enter();
        let bs = self.geometry.block_size;
        // Checked before anything changes: a refused call leaves no trace.
        self.check_block_ids(request, block_ids)?;
        let Some(r) = self.requests.get_mut(request) else {
            return Err(request_err(
                request,
                "kvbm has no slot for it (get_num_new_matched_tokens was not asked first)",
            ));
        };
        if num_external_tokens > r.matched {
            return Err(request_err(
                request,
                format!(
                    "num_external_tokens {num_external_tokens} is more than the {} \
                     get_num_new_matched_tokens promised",
                    r.matched
                ),
            ));
        }
        r.block_ids = block_ids.to_vec();
        r.accepted = num_external_tokens;
        let id = r.id.clone();
        let first = r.lookup_computed / bs;
        let n = num_external_tokens / bs;
        let mut dests: Vec<MutableBlock<Empty>> = Vec::new();
        if n > 0 {
            let targets: Vec<u32> = block_ids.iter().skip(first).take(n).copied().collect();
            dests = self
                .mirror
                .allocate(targets.len())
                .map_err(|e| request_err(request, format!("no mirror blocks for its load: {e}")))?;
            for (d, v) in dests.iter().zip(&targets) {
                self.map_g1(request, d.id(), *v);
                self.req(request).load_dests.push((d.id(), *v));
            }
            self.req(request).loaded = first..first + targets.len();
            let ids = dests.iter().map(|d| d.id()).collect();
            self.announce_g1(request, ids);
        }
        if num_external_tokens > 0 {
            self.deferral.loads_this_step = true;
        }
        self.leader
            .update_state_after_alloc(&id, dests, num_external_tokens)
            .map_err(|e| request_err(request, slot_reason(&e)))
    }

    /// vLLM's block ids name its device blocks: each must be one of them.
    fn check_block_ids(&self, request: &str, block_ids: &[u32]) -> Result<(), SchedulerError> {
        let n = self.geometry.num_gpu_blocks;
        match block_ids.iter().find(|b| **b as usize >= n) {
            Some(b) => Err(request_err(
                request,
                format!("block id {b} is not one of vLLM's {n} device blocks"),
            )),
            None => Ok(()),
        }
    }

    fn map_g1(&mut self, request: &str, mirror: BlockId, vllm: u32) {
        let e = self.g1.entry(mirror).or_insert((vllm, 0));
        if e.0 != vllm {
            // A mirror id freed and reused: the newest mapping wins.
            *e = (vllm, 0);
        }
        e.1 += 1;
        if let Some(r) = self.requests.get_mut(request) {
            r.mapped.push(mirror);
        }
    }

    /// The request lets go of its G1 blocks: its mirror mappings end (a
    /// batch still naming them fails instead of shipping).
    fn release_g1(&mut self, request: &str) {
        let Some(r) = self.requests.get_mut(request) else {
            return;
        };
        let mapped = std::mem::take(&mut r.mapped);
        let announced = std::mem::take(&mut r.g1_announced);
        if announced > 0 {
            self.emitter.emit(
                Some(&r.id),
                EventKind::BlocksReleased {
                    tier: Tier::Device,
                    count: announced,
                },
            );
        }
        r.own.clear();
        r.shared.clear();
        r.load_dests.clear();
        r.mirrored = 0;
        r.loaded = 0..0;
        for m in mapped {
            if let Some(e) = self.g1.get_mut(&m) {
                e.1 = e.1.saturating_sub(1);
                if e.1 == 0 {
                    self.g1.remove(&m);
                }
            }
        }
    }

    /// Mirrors the blocks of `s.request` that this step completes; returns
    /// the newly registered ones (for eager stores) and those vLLM's prefix
    /// cache served (for `after-hits:N`).
    fn mirror_full_blocks(&mut self, s: &Scheduled) -> Result<Mirrored, SchedulerError> {
        let bs = self.geometry.block_size;
        // Checked before anything changes.
        let computed = s.computed_before.checked_add(s.scheduled).ok_or_else(|| {
            request_err(
                &s.request,
                format!(
                    "computed before ({}) + scheduled ({}) overflows",
                    s.computed_before, s.scheduled
                ),
            )
        })?;
        if let Some(ids) = &s.block_ids {
            self.check_block_ids(&s.request, ids)?;
        }
        let known = self
            .leader
            .append_tokens(&s.request, &s.new_tokens)
            .map_err(|e| request_err(&s.request, slot_reason(&e)))?;
        let r = self.req(&s.request);
        if let Some(ids) = &s.block_ids {
            r.block_ids.clone_from(ids);
        }
        let full_after = (computed.min(known) / bs).min(r.block_ids.len());
        let from = r.mirrored;
        if full_after <= from {
            return Ok(Mirrored::default());
        }
        let loaded = r.loaded.clone();
        let ids: Vec<u32> = r.block_ids[from..full_after].to_vec();
        let blocks = self
            .leader
            .token_blocks(&s.request, from..full_after)
            .map_err(|e| request_err(&s.request, slot_reason(&e)))?;
        let mut fresh = Vec::new();
        let mut hits = Vec::new();
        let mut held = Vec::new();
        for (k, (tb, vllm)) in blocks.iter().zip(ids).enumerate() {
            let j = from + k;
            if loaded.contains(&j) {
                continue; // it came from kvbm's own tiers
            }
            let Ok(b) = self.mirror.allocate_one() else {
                continue; // no room: this block is not stored, a future miss
            };
            let mid = b.id();
            let Ok(c) = b.fill_from(tb) else { continue };
            let reg = c.register();
            held.push(reg.id());
            if reg.id() != mid {
                // vLLM's prefix cache shares a block kvbm mirrors already:
                // it was stored (or planned) by the request that made it.
                if matches!(self.cfg.offload, Offload::AfterHits(_)) {
                    // It may be stored from here (its N-th hit): the copy
                    // reads it where this request holds it.
                    self.map_g1(&s.request, reg.id(), vllm);
                    hits.push(reg.clone());
                }
                self.req(&s.request).shared.push(reg);
                continue;
            }
            self.map_g1(&s.request, mid, vllm);
            self.req(&s.request).own.push(reg.clone());
            fresh.push(reg);
        }
        self.req(&s.request).mirrored = full_after;
        self.announce_g1(&s.request, held);
        Ok(Mirrored { fresh, hits })
    }

    /// Marks the request scheduled this step and, at its first schedule
    /// after its lookup, says what vLLM had computed beyond its own prefix
    /// hit and kvbm's loads: that came from another connector (kvbm beside
    /// it in vLLM's `MultiConnector`, which tells kvbm only that its own
    /// answer was not taken). Said as an `ExternalHit`; nothing when there
    /// is none.
    fn scheduled_now(&mut self, s: &Scheduled) {
        let Some(r) = self.requests.get_mut(&s.request) else {
            return;
        };
        r.scheduled_at = self.step;
        if !std::mem::take(&mut r.admitting) {
            return;
        }
        let from = r.lookup_computed.saturating_add(r.accepted);
        let tokens = s.computed_before.saturating_sub(from);
        if tokens == 0 {
            return;
        }
        let id = r.id.clone();
        self.counters.external_hit_tokens += tokens as u64;
        self.emitter.emit(
            Some(&id),
            EventKind::ExternalHit {
                from_token: u32::try_from(from).unwrap_or(u32::MAX),
                tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
            },
        );
    }

    /// Tells the stream which G1 blocks `request` now holds, by kvbm's
    /// mirror ids (the ids its `BlockRegistered` events name, so a
    /// consumer can map a request to its prefix): its full blocks as they
    /// are mirrored, and its loads' destinations. vLLM's own block ids are
    /// another numbering, and its partial last block has no mirror.
    fn announce_g1(&mut self, request: &str, blocks: Vec<BlockId>) {
        if blocks.is_empty() {
            return;
        }
        let r = self.req(request);
        r.g1_announced = r.g1_announced.saturating_add(blocks.len() as u32);
        let id = r.id.clone();
        self.emitter.emit(
            Some(&id),
            EventKind::BlocksAllocated {
                tier: Tier::Device,
                blocks,
            },
        );
    }

    /// Follows what vLLM scheduled: each request's tokens and full blocks
    /// (mirrored, their stores to plan), and the running requests it
    /// skipped; the leader's view of the step.
    fn follow(&mut self, input: &StepInput) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        for s in &input.scheduled {
            let Some(id) = self.requests.get(&s.request).map(|r| r.id.clone()) else {
                continue; // a request kvbm never saw (added before the connector)
            };
            // One request's unusable input leaves it out of this step
            // (mirror_full_blocks checks before it changes anything); the
            // others' stores and loads go on.
            let Mirrored { fresh, hits } = match self.mirror_full_blocks(s) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!("{e}; left out of step {}", self.step);
                    self.counters.refused_scheduled += 1;
                    continue;
                }
            };
            self.scheduled_now(s);
            let prefill = s
                .scheduled
                .min(s.prompt_len.saturating_sub(s.computed_before));
            out.scheduled.push(ScheduledRequest {
                request: id,
                prefill_tokens: prefill,
                decode_tokens: s.scheduled - prefill,
                // Checked by mirror_full_blocks.
                computed_tokens: s.computed_before.saturating_add(s.scheduled),
                new_full_blocks: if self.cfg.offload == Offload::Eager {
                    fresh
                } else {
                    Vec::new()
                },
                device_hits: if matches!(self.cfg.offload, Offload::AfterHits(_)) {
                    hits
                } else {
                    Vec::new()
                },
                new_tokens: Vec::new(),
            });
        }
        let preempted: HashSet<&str> = input.preempted.iter().map(String::as_str).collect();
        for (name, r) in &self.requests {
            let name: &str = name;
            if r.scheduled_at == self.step
                || preempted.contains(name)
                || self.delayed.contains(name)
            {
                continue;
            }
            if self.leader.slot_state(name).is_some_and(|s| s.is_running()) {
                out.skipped.push(r.id.clone());
            }
        }
        out
    }

    /// Whether this step's following and planning may wait for
    /// [`run_deferred`](Self::run_deferred): with sync scheduling, vLLM's
    /// thread waits for the worker's forward pass right after this call,
    /// and the work can run then, on kvbm's runtime, off the engine's
    /// critical path. Never for a step whose plan needs it now: loads
    /// planned for it (they ship in this plan), preempted or finished
    /// requests (their blocks are settled in this plan), or an armed
    /// breakpoint (it pauses vLLM's thread, not kvbm's).
    fn may_defer(&self, input: &StepInput) -> bool {
        self.defers()
            && !self.deferral.loads_this_step
            && input.preempted.is_empty()
            && self.delayed.is_empty()
            && !self.breakpoints.is_armed()
    }

    /// Lets steps and outputs wait for [`run_deferred`](Self::run_deferred)
    /// (off by default): the caller promises to run it on a thread of
    /// kvbm's once each call that leaves work for it has returned
    /// ([`has_deferred`](Self::has_deferred) says when; see
    /// [`crate::deferred`]).
    pub fn defer_to_runtime(&mut self, on: bool) {
        self.deferral.on = on;
    }

    /// Whether work may wait for `run_deferred` at all: with sync
    /// scheduling only (with async scheduling the calls already run while
    /// the worker computes).
    fn defers(&self) -> bool {
        self.deferral.on && !self.parallel.async_scheduling
    }

    /// Whether a call left work for [`run_deferred`](Self::run_deferred).
    pub fn has_deferred(&self) -> bool {
        self.deferral.step.is_some() || !self.deferral.outputs.is_empty()
    }

    /// Follows and plans the deferred step, if there is one: on kvbm's
    /// runtime while vLLM waits for the worker (`background`), or at the
    /// start of vLLM's next call when that has not happened yet, so that
    /// every call sees the steps before it whole, in order.
    pub fn run_deferred(&mut self, background: bool) {
        // In vLLM's order: an output always came before a deferred step
        // (`update_connector_output` runs the step before it first).
        for reports in std::mem::take(&mut self.deferral.outputs) {
            self.output(&reports, background);
        }
        let Some(input) = self.deferral.step.take() else {
            return;
        };
        let _guard = self.runtime.enter();
        let mut t = Instant::now();
        let out = self.follow(&input);
        self.phases
            .lap(Phase::Follow.or_background(background), &mut t);
        let mut md = self.leader.build_connector_metadata(&out);
        self.triggers.push_back(md.store_trigger.take());
        if !md.loads.is_empty() {
            // Not by construction (a step with loads is never deferred);
            // counted rather than lost without a trace.
            debug_assert!(false, "a deferred step planned loads");
            self.counters.deferred_loads += md.loads.len() as u64;
        }
        self.phases
            .lap(Phase::Plan.or_background(background), &mut t);
        self.emit_gauges(input.g1_free);
        self.phases
            .lap(Phase::Gauges.or_background(background), &mut t);
    }

    /// vLLM's `build_connector_meta`: follows what vLLM scheduled (slot
    /// states, tokens, blocks), plans this step's stores, starts its loads,
    /// waits (bounded) for them to reach the worker's queue and returns the
    /// step's plan.
    pub fn build_meta(&mut self, input: StepInput) -> Result<StepPlan, SchedulerError> {
        let t = Instant::now();
        let r = self.build_meta_inner(input);
        self.spent(t);
        if self.step_ns.len() == TIMING_SAMPLES {
            self.step_ns.pop_front();
        }
        self.step_ns.push_back(std::mem::take(&mut self.spent_ns));
        r
    }

    fn build_meta_inner(&mut self, input: StepInput) -> Result<StepPlan, SchedulerError> {
        let _guard = self.runtime.enter();
        let defer = self.may_defer(&input);
        // A step that is deferred leaves the last output for the runtime
        // too (this plan needs nothing from it: no load, no finished
        // request); a step before it is run here, to keep their order.
        if !defer || self.deferral.step.is_some() {
            self.run_deferred(false);
        }
        let mut t = Instant::now();
        self.step += 1;
        self.breakpoints.sweep_held();
        for why in &input.refused {
            tracing::warn!("{why}; left out of step {}", self.step);
            self.counters.refused_scheduled += 1;
        }
        self.deferral.loads_this_step = false;
        // Read after `input` may have moved (usually empty: no copy).
        let preempted = input.preempted.clone();
        let g1_free = input.g1_free;
        let (mut md, drain) = if defer {
            // Followed and planned off vLLM's thread (see `run_deferred`).
            self.deferral.step = Some(input);
            self.counters.deferred_steps += 1;
            (ConnectorMetadata::default(), false)
        } else {
            let out = self.follow(&input);
            self.phases.lap(Phase::Follow, &mut t);
            let mut md = self.leader.build_connector_metadata(&out);
            self.triggers.push_back(md.store_trigger.take());
            self.phases.lap(Phase::Plan, &mut t);
            // A step that runs nothing may be the last one an idle engine
            // takes: finished requests' stores ship with it rather than wait.
            (md, out.scheduled.is_empty() && !self.delayed.is_empty())
        };
        let loads = self.leader.start_loads(&mut md, self.runtime.handle());
        self.phases.lap(Phase::StartLoads, &mut t);
        // Triggers leave the queue as they fire, and this idle step's own
        // holds no store: when it is the only one left, every store still
        // counted as awaiting its precondition has had it met and is on
        // its way to the batcher, so the wait covers it too.
        let all_fired = self.triggers.iter().rev().skip(1).all(Option::is_none);
        let waited = self.wait_until_shipped(&loads, drain.then_some(all_fired));
        self.phases.lap(Phase::WaitShipped, &mut t);
        if !waited.is_zero() {
            self.counters.ship_waits += 1;
            self.counters.ship_wait_us += u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        }
        let mut plan = StepPlan {
            step: self.step,
            ..StepPlan::default()
        };
        // Checked before the batches are taken: whatever reached the
        // remote engines by now ships in this plan.
        let stores_shipped = !self.delayed.is_empty()
            && self
                .store_pipelines
                .iter()
                .all(|(p, r)| nothing_unshipped(p, r.as_deref(), true));
        let shipped_loads = self.ship_batches(&mut plan);
        self.phases.lap(Phase::Ship, &mut t);
        self.fail_late_loads(&shipped_loads, &mut plan);
        drop(loads);
        for name in &preempted {
            if let Some(id) = self.requests.get(name.as_str()).map(|r| r.id.clone()) {
                let _ = self.leader.request_preempted(&id);
            }
            self.release_g1(name);
        }
        // Finished requests whose stores have drained, or (every store out
        // of G1 shipped) will have run before the worker reports this plan:
        // vLLM may free their blocks at this step's end, one step after
        // they finished.
        let drained: Vec<String> = self
            .delayed
            .iter()
            .filter(|n| {
                stores_shipped
                    || self
                        .leader
                        .slot_state(n)
                        .is_none_or(|s| s == kvbm_events::SlotState::Finished)
            })
            .cloned()
            .collect();
        if stores_shipped {
            self.counters.early_frees += drained.len() as u64;
        }
        for n in drained {
            self.delayed.remove(&n);
            self.forget(&n);
            plan.finished_sending.push(n);
        }
        self.leader.remove_finished();
        self.phases.lap(Phase::Settle, &mut t);
        if !defer {
            // A deferred step's come after its following (`run_deferred`).
            self.emit_gauges(g1_free);
        }
        self.counters.steps += 1;
        self.phases.lap(Phase::Gauges, &mut t);
        Ok(plan)
    }

    /// Takes the batches the remote engines hold into `plan`, their block
    /// ids translated to vLLM's; a batch naming a G1 block vLLM freed is
    /// failed instead. Returns the mirror blocks the shipped loads fill.
    fn ship_batches(&mut self, plan: &mut StepPlan) -> HashSet<BlockId> {
        let mut shipped_loads: HashSet<BlockId> = HashSet::new();
        for (route, engine) in &self.engines {
            let registered = match route {
                Route::DeviceToHost | Route::DeviceToDisk => Some(&self.mirror),
                Route::HostToDevice => self.leader.pool(Tier::Host),
                Route::DiskToDevice => self.leader.pool(Tier::Disk),
            };
            for b in engine.take_batches() {
                let pairs = registered.and_then(|pool| translate(*route, &b.pairs, &self.g1, pool));
                match pairs {
                    Some(pairs) => {
                        if route.is_load() {
                            shipped_loads.extend(b.pairs.iter().map(|p| p.dst));
                            plan.loads.push(Batch {
                                route: *route,
                                id: b.id,
                                pairs,
                            });
                        } else {
                            plan.stores.push(Batch {
                                route: *route,
                                id: b.id,
                                pairs,
                            });
                        }
                    }
                    None => {
                        // A G1 block it names was freed: copying it now could
                        // move another request's data.
                        if !route.is_load() {
                            self.counters.unshippable_stores += 1;
                        }
                        engine.complete(
                            b.id,
                            Err("its device blocks were freed before it shipped".into()),
                        );
                    }
                }
            }
        }
        shipped_loads
    }

    /// Loads promised for this step that did not ship: vLLM computes
    /// those blocks, and their copies must never land later.
    fn fail_late_loads(&mut self, shipped_loads: &HashSet<BlockId>, plan: &mut StepPlan) {
        let late: Vec<Vec<(BlockId, u32)>> = self
            .requests
            .values_mut()
            .filter(|r| !r.load_dests.is_empty())
            .map(|r| std::mem::take(&mut r.load_dests))
            .collect();
        for dests in late {
            let missing: Vec<(BlockId, u32)> = dests
                .into_iter()
                .filter(|(m, _)| !shipped_loads.contains(m))
                .collect();
            if !missing.is_empty() {
                self.counters.late_loads += 1;
            }
            for (m, v) in missing {
                plan.failed_loads.push(v);
                self.g1.remove(&m);
            }
        }
    }

    /// Waits until the loads planned so far are in the worker-bound
    /// queues, at most `ship_timeout`: a load must run before this step's
    /// forward pass reads its blocks. Stores hold the step back only when
    /// `stores` is given (an idle step with finished requests waiting),
    /// those still awaiting their precondition only when it is true (every
    /// trigger has fired): otherwise
    /// one that is not queued yet ships with a later step (its blocks stay
    /// vLLM's until then, see the module docs), and the pipelines' work
    /// for it runs while the engine waits for its worker instead of on
    /// vLLM's scheduler thread.
    fn wait_until_shipped(
        &self,
        loads: &[(RequestId, Vec<TransferHandle>)],
        stores: Option<bool>,
    ) -> Duration {
        let start = Instant::now();
        let deadline = start + self.cfg.ship_timeout;
        let mut waited = false;
        loop {
            let ready = self
                .load_pipelines
                .iter()
                .all(|(p, r)| nothing_unshipped(p, r.as_deref(), false))
                // Not stores waiting for a forward pass not yet reported:
                // only an output vLLM reports on this thread releases them,
                // never while it waits here (with async scheduling, the
                // step in flight's).
                && stores.is_none_or(|fired| {
                    self.store_pipelines
                        .iter()
                        .all(|(p, r)| nothing_unshipped(p, r.as_deref(), fired))
                })
                && loads.iter().flat_map(|(_, h)| h).all(|h| {
                    h.status().is_final()
                        || h.status() == kvbm_core::offload::TransferStatus::Transferring
                });
            if ready || Instant::now() >= deadline {
                return if waited {
                    start.elapsed()
                } else {
                    Duration::ZERO
                };
            }
            waited = true;
            // The pipelines' tasks usually need a few tens of µs: give
            // way to them first (on a busy core they may be queued behind
            // this thread), and sleep only when that is not enough. A
            // 100 µs sleep alone made every wait at least ~150 µs.
            if start.elapsed() < SHIP_SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// vLLM's `update_connector_output`: the step's forward pass is done
    /// (its stores may go), and the worker's report resolves the batches it
    /// ran.
    pub fn update_connector_output(&mut self, reports: &[Vec<u8>]) {
        self.update_connector_output_owned(reports.to_vec());
    }

    /// [`update_connector_output`](Self::update_connector_output) with
    /// reports the caller already owns (kept as they are when they wait).
    pub fn update_connector_output_owned(&mut self, reports: Vec<Vec<u8>>) {
        let t = Instant::now();
        // Every call sees the steps before it followed and planned.
        self.run_deferred(false);
        if self.defers() {
            // Released and resolved with the next step's following, off
            // vLLM's thread (see `run_deferred`).
            self.deferral.outputs.push(reports);
        } else {
            self.output(&reports, false);
        }
        self.spent(t);
    }

    /// The stores of the oldest shipped step's pass released, and the
    /// worker's reports resolved.
    fn output(&mut self, reports: &[Vec<u8>], background: bool) {
        let _guard = self.runtime.enter();
        let mut t = Instant::now();
        // vLLM reports its steps' outputs in the order it scheduled them:
        // this is the oldest shipped step's, whose forward pass computed
        // the blocks its trigger holds back.
        if let Some(trigger) = self.triggers.pop_front().flatten() {
            trigger.trigger();
        }
        // More steps shipped than vLLM has in flight (two with async
        // scheduling) means outputs that never came: their forward passes
        // are long done, and their stores go rather than wait for good.
        while self.triggers.len() > MAX_STEPS_IN_FLIGHT {
            self.counters.unmatched_outputs += 1;
            if let Some(trigger) = self.triggers.pop_front().flatten() {
                trigger.trigger();
            }
        }
        self.phases
            .lap(Phase::Trigger.or_background(background), &mut t);
        for bytes in reports {
            let report = match StepReport::from_bytes(bytes) {
                Ok(r) => r,
                Err(e) => {
                    self.counters.bad_reports += 1;
                    tracing::warn!("{e}");
                    continue;
                }
            };
            for d in report.done {
                self.resolve(d);
            }
        }
        self.phases
            .lap(Phase::Resolve.or_background(background), &mut t);
    }

    /// One rank's report of one batch; the batch resolves once every rank
    /// has reported it (vLLM gathers each step's reports from all its
    /// workers), failed if any rank failed it.
    fn resolve(&mut self, d: crate::meta::Done) {
        let Some(engine) = self
            .engines
            .iter()
            .find(|(r, _)| *r == d.route)
            .map(|(_, e)| e.clone())
        else {
            return;
        };
        let ranks = self.parallel.ranks;
        let p = self.partial.entry((d.route, d.id)).or_default();
        p.reports += 1;
        p.bytes = p.bytes.saturating_add(d.bytes);
        p.elapsed_ns = p.elapsed_ns.max(d.elapsed_ns);
        if let (None, Some(e)) = (&p.error, d.error) {
            p.error = Some(e);
        }
        if p.reports < ranks {
            return;
        }
        let Some(p) = self.partial.remove(&(d.route, d.id)) else {
            return;
        };
        let result = match p.error {
            None => Ok(TransferStats {
                // The workers report bytes and time; the engine fills in
                // the batch's blocks.
                blocks: 0,
                bytes: p.bytes,
                elapsed: Duration::from_nanos(p.elapsed_ns),
            }),
            Some(e) => {
                if d.route.is_load() {
                    self.counters.failed_load_blocks += 1;
                }
                Err(e)
            }
        };
        engine.complete(d.id, result);
    }

    /// vLLM's `request_finished` with the request's computed blocks (group
    /// 0): lazy mode stores them now. Returns `delay_free`: true while the
    /// request's stores are out (vLLM keeps its blocks until the worker
    /// reports it finished sending).
    pub fn request_finished(
        &mut self,
        request: &str,
        block_ids: &[u32],
    ) -> Result<bool, SchedulerError> {
        let t = Instant::now();
        let r = self.request_finished_inner(request, block_ids);
        self.spent(t);
        self.phases.lap(Phase::Requests, &mut { t });
        r
    }

    fn request_finished_inner(
        &mut self,
        request: &str,
        block_ids: &[u32],
    ) -> Result<bool, SchedulerError> {
        // Every call sees the steps before it followed and planned.
        self.run_deferred(false);
        let _guard = self.runtime.enter();
        let Some(id) = self.requests.get(request).map(|r| r.id.clone()) else {
            return Ok(false);
        };
        self.check_block_ids(request, block_ids)?;
        let mut blocks = Vec::new();
        if self.cfg.offload == Offload::Lazy && !block_ids.is_empty() {
            // Mirror what vLLM computed that no step has yet, then store
            // every block the request made.
            let computed = block_ids.len().saturating_mul(self.geometry.block_size);
            let s = Scheduled {
                request: RequestId::from(request),
                new_tokens: Vec::new(),
                prompt_len: 0,
                computed_before: computed,
                scheduled: 0,
                block_ids: Some(block_ids.to_vec()),
            };
            self.mirror_full_blocks(&s)?;
            blocks = self
                .requests
                .get(request)
                .map(|r| r.own.clone())
                .unwrap_or_default();
        }
        let outstanding = self
            .leader
            .request_finished(&id, &blocks)
            .map_err(|e| request_err(request, slot_reason(&e)))?;
        if outstanding {
            self.delayed.insert(request.to_string());
            self.counters.delayed_frees += 1;
            Ok(true)
        } else {
            self.forget(request);
            Ok(false)
        }
    }

    fn forget(&mut self, request: &str) {
        self.release_g1(request);
        self.requests.remove(request);
        self.breakpoints.forget_request(request);
    }

    fn emit_gauges(&self, g1_free: Option<usize>) {
        if let Some(free) = g1_free {
            let cap = self.geometry.num_gpu_blocks;
            self.emitter.emit(
                None,
                EventKind::PoolGauge {
                    tier: Tier::Device,
                    capacity: cap as u32,
                    active: cap.saturating_sub(free) as u32,
                    inactive: 0,
                    empty: free.min(cap) as u32,
                },
            );
        }
        for tier in [Tier::Host, Tier::Disk] {
            if let Some(p) = self.leader.pool(tier) {
                let s = p.status();
                self.emitter.emit(
                    None,
                    EventKind::PoolGauge {
                        tier,
                        capacity: s.capacity as u32,
                        active: s.active as u32,
                        inactive: s.inactive as u32,
                        empty: s.empty as u32,
                    },
                );
            }
        }
    }

    /// Stops: every paused call goes on, every batch out fails, the attach
    /// server and the recording finish, the shared host file is removed.
    pub fn shutdown(&mut self) -> Result<(), SchedulerError> {
        // Every call sees the steps before it followed and planned.
        self.run_deferred(false);
        self.breakpoints.clear_all();
        self.breakpoints.resume_all();
        for (_, e) in &self.engines {
            e.fail_all("vLLM shut down");
        }
        // vLLM lets go of every block at teardown, those it kept for
        // finished requests' stores too. An engine may take no step after
        // its last request (vLLM in process steps only inside `generate`),
        // so they are said released here, before the recording closes.
        let delayed: Vec<String> = self.delayed.drain().collect();
        for n in delayed {
            self.forget(&n);
        }
        let obs = self.observers.take();
        let r = match obs {
            // The observers are taken once: nothing was published before.
            Some(o) => o
                .stop(&self.runtime)
                .map(|finals| self.fleet_final = finals)
                .map_err(SchedulerError::Observe),
            None => Ok(()),
        };
        // Dropping the claim removes the file.
        self.shm.take();
        r
    }
}

impl Drop for SchedulerSide {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// A batch's block ids for the worker: the G1 side from mirror ids to
/// vLLM's, the other side as it is, each with the block's hash (read from
/// the pool that holds it registered: the mirror for a store, the source
/// tier for a load). `None` when a G1 block it names is no longer mapped.
fn translate(
    route: Route,
    pairs: &[kvbm_core::transfer::BlockPair],
    g1: &HashMap<BlockId, (u32, u32)>,
    registered: &BlockPool,
) -> Option<Vec<Pair>> {
    pairs
        .iter()
        .map(|p| {
            let (src, dst) = if route.is_load() {
                (p.src, g1.get(&p.dst)?.0)
            } else {
                (g1.get(&p.src)?.0, p.dst)
            };
            let hash = registered.hash_of(p.src).map_or(0, |h| h.0);
            Some(Pair { src, dst, hash })
        })
        .collect()
}
