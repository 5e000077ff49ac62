//! The one place that assembles a block manager's tiers: the pools a
//! description asks for, the storages behind them when they live in this
//! process, and a link and an offload pipeline for each direction blocks
//! move in.
//!
//! Which directions there are follows from the tiers alone
//! ([`Pools::directions`]): with a host tier, G1 ↔ G2, and G2 ↔ G3 when
//! there is a disk; without one, G1 ↔ G3 directly. Pipelines whose
//! destination is not G1 skip blocks the destination holds already
//! ([`PresencePolicy`]); onboards into G1 copy what the caller asked for.
//!
//! Who uses it:
//! - the simulator and the CPU-offload walk-through keep every tier here
//!   ([`LocalTiers`]): G1 and G2 in this process's memory, G3 in a file;
//! - the vLLM connector's scheduler side, whose G1 is vLLM's own tensors
//!   in another process, brings engines of its own ([`connect`]).
//!
//! [`TierLink::new`] is `unsafe` (the link trusts that block `i` of each
//! pool is block `i` of the storage behind it); it is called here and
//! nowhere else.

use crate::layout::{Layout, LayoutError};
use crate::leader::{LeaderWiring, Pipelines};
use crate::link::{HostTier, LinkError, TierLink};
use crate::offload::{
    AdmissionPolicy, ConfigError, OffloadPipeline, OffloadPolicy, PipelineConfig, PresencePolicy,
};
use crate::pool::{BlockPool, PoolConfig, PoolError, PoolObserver};
use crate::storage::{DiskStorage, HostStorage, StorageError};
use crate::transfer::{DiskDirection, DiskEngine, MemcpyEngine, TransferEngine, TransferError};
use kvbm_events::{Direction, Tier};
use std::path::Path;
use std::sync::Arc;

/// Why the tiers could not be assembled.
#[derive(Debug, thiserror::Error)]
pub enum AssemblyError {
    /// A pool's configuration.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A storage's layout.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A storage could not be created.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// An engine could not be created.
    #[error(transparent)]
    Engine(#[from] TransferError),
    /// An engine does not fit the pools at its ends.
    #[error(transparent)]
    Link(#[from] LinkError),
    /// A pipeline's configuration.
    #[error(transparent)]
    Pipeline(#[from] ConfigError),
    /// A tier there is no storage for (a G3 without a file).
    #[error("{0}")]
    Missing(String),
}

/// How many blocks each tier holds; a tier of 0 blocks is not there (G1
/// always is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierSizes {
    /// Tokens per block, in every tier.
    pub block_size: usize,
    /// G1.
    pub device_blocks: usize,
    /// G2; 0 for none.
    pub host_blocks: usize,
    /// G3; 0 for none.
    pub disk_blocks: usize,
    /// Each tier's eviction policy.
    pub eviction: crate::eviction::TierEviction,
}

/// The pools of the tiers there are.
#[derive(Debug, Clone)]
pub struct Pools {
    /// G1.
    pub device: BlockPool,
    /// G2, if there is one.
    pub host: Option<BlockPool>,
    /// G3, if there is one.
    pub disk: Option<BlockPool>,
}

impl Pools {
    /// A pool for each tier of `sizes` that has blocks, reporting to
    /// `observer` when one is given.
    pub fn new(
        sizes: &TierSizes,
        observer: Option<Arc<dyn PoolObserver>>,
    ) -> Result<Pools, PoolError> {
        let pool = |tier, capacity| {
            let config = PoolConfig {
                tier,
                capacity,
                block_size: sizes.block_size,
                eviction: sizes.eviction.of(tier).eviction,
                admission: sizes.eviction.of(tier).admission,
            };
            match &observer {
                Some(o) => BlockPool::with_observer(config, o.clone()),
                None => BlockPool::new(config),
            }
        };
        let optional = |tier, capacity| (capacity > 0).then(|| pool(tier, capacity)).transpose();
        Ok(Pools {
            device: pool(Tier::Device, sizes.device_blocks)?,
            host: optional(Tier::Host, sizes.host_blocks)?,
            disk: optional(Tier::Disk, sizes.disk_blocks)?,
        })
    }

    /// The directions blocks move in between these tiers, offloads first.
    pub fn directions(&self) -> Vec<Direction> {
        match (&self.host, &self.disk) {
            (Some(_), Some(_)) => vec![
                Direction::DEVICE_TO_HOST,
                Direction::HOST_TO_DEVICE,
                Direction::HOST_TO_DISK,
                Direction::DISK_TO_HOST,
            ],
            (Some(_), None) => vec![Direction::DEVICE_TO_HOST, Direction::HOST_TO_DEVICE],
            (None, Some(_)) => vec![Direction::DEVICE_TO_DISK, Direction::DISK_TO_DEVICE],
            (None, None) => Vec::new(),
        }
    }

    /// The pool of `tier`, if there is one.
    pub fn get(&self, tier: Tier) -> Option<&BlockPool> {
        match tier {
            Tier::Device => Some(&self.device),
            Tier::Host => self.host.as_ref(),
            Tier::Disk => self.disk.as_ref(),
        }
    }
}

/// What moves blocks in one direction, and the pipeline's settings.
pub struct Route {
    /// The engine that copies between the two tiers' storages.
    pub engine: Arc<dyn TransferEngine>,
    /// The pipeline's batching and concurrency.
    pub config: PipelineConfig,
}

/// The pipelines, as a leader takes them and by direction.
#[derive(Default)]
pub struct Connected {
    /// For [`Leader::new`](crate::leader::Leader::new).
    pub pipelines: Pipelines,
    /// The same pipelines with their directions, in [`Pools::directions`]'
    /// order (for statistics).
    pub by_direction: Vec<(Direction, Arc<OffloadPipeline>)>,
}

impl Connected {
    fn add(&mut self, d: Direction, p: Arc<OffloadPipeline>) {
        let slot = match (d.src, d.dst) {
            (Tier::Device, Tier::Host) => &mut self.pipelines.offload_device_to_host,
            (Tier::Host, Tier::Device) => &mut self.pipelines.onboard_host_to_device,
            (Tier::Host, Tier::Disk) => &mut self.pipelines.offload_host_to_disk,
            (Tier::Disk, Tier::Host) => &mut self.pipelines.onboard_disk_to_host,
            (Tier::Device, Tier::Disk) => &mut self.pipelines.offload_device_to_disk,
            (Tier::Disk, Tier::Device) => &mut self.pipelines.onboard_disk_to_device,
            // `Pools::directions` never gives a tier to itself.
            _ => return,
        };
        *slot = Some(p.clone());
        self.by_direction.push((d, p));
    }
}

/// Links every direction of `pools` with the engine `route` gives it, and
/// builds its pipeline (with the leader's observer when `wiring` is
/// given). Must run inside a tokio runtime, which runs the pipelines.
///
/// # Safety
///
/// As for [`TierLink::new`]: the engine `route` returns for a direction
/// copies between storages whose block `i` is block `i` of the pools at
/// its ends, and those storages are written only through these links and
/// [`HostTier`]s bound to the same pools.
pub unsafe fn connect<E: From<AssemblyError>>(
    pools: &Pools,
    wiring: Option<&LeaderWiring>,
    mut route: impl FnMut(Direction) -> Result<Route, E>,
) -> Result<Connected, E> {
    let mut out = Connected::default();
    for d in pools.directions() {
        let (src, dst) = match (pools.get(d.src), pools.get(d.dst)) {
            (Some(s), Some(t)) => (s.clone(), t.clone()),
            _ => continue,
        };
        let Route { engine, config } = route(d)?;
        let admission = dst.has_admission();
        // SAFETY: the caller's promise, passed on.
        let link = unsafe { TierLink::new(engine, src, dst) }.map_err(AssemblyError::from)?;
        let policies: Vec<Arc<dyn OffloadPolicy>> = if d.dst == Tier::Device {
            Vec::new()
        } else if admission {
            vec![Arc::new(PresencePolicy), Arc::new(AdmissionPolicy)]
        } else {
            vec![Arc::new(PresencePolicy)]
        };
        let pipe =
            OffloadPipeline::with_observer(link, policies, config, wiring.map(|w| w.observer(d)))
                .map_err(AssemblyError::from)?;
        out.add(d, Arc::new(pipe));
    }
    Ok(out)
}

/// Tiers that live in this process: G1 and G2 in memory, G3 in a file,
/// each storage created here for its pool alone.
pub struct LocalTiers {
    pools: Pools,
    device: HostTier,
    host: Option<HostTier>,
    disk: Option<Arc<DiskStorage>>,
}

impl LocalTiers {
    /// Creates a storage for each of `pools`, laid out by `layout` (given
    /// a number of blocks), G3's as the file `disk_file` (required when
    /// there is a G3), and binds G1 and G2 to theirs.
    pub fn create(
        pools: &Pools,
        layout: impl Fn(usize) -> Result<Layout, LayoutError>,
        disk_file: Option<&Path>,
    ) -> Result<LocalTiers, AssemblyError> {
        let memory = |pool: &BlockPool| -> Result<HostTier, AssemblyError> {
            let storage = Arc::new(HostStorage::new(layout(pool.capacity())?)?);
            // SAFETY: the storage was created just now for this pool alone
            // and is reached only through this binding and the links that
            // `connect` makes from it.
            Ok(unsafe { HostTier::bind(pool.clone(), storage) }?)
        };
        let disk = match (&pools.disk, disk_file) {
            (Some(pool), Some(path)) => Some(Arc::new(DiskStorage::create(
                path,
                layout(pool.capacity())?,
            )?)),
            (Some(_), None) => {
                return Err(AssemblyError::Missing("a disk tier needs a file".into()));
            }
            (None, _) => None,
        };
        Ok(LocalTiers {
            device: memory(&pools.device)?,
            host: pools.host.as_ref().map(memory).transpose()?,
            disk,
            pools: pools.clone(),
        })
    }

    /// G1, bound to its storage (to write computed KV and read it back).
    pub fn device(&self) -> &HostTier {
        &self.device
    }

    /// G2, bound to its storage, if there is one.
    pub fn host(&self) -> Option<&HostTier> {
        self.host.as_ref()
    }

    /// G3's file, if there is one.
    pub fn disk(&self) -> Option<&Arc<DiskStorage>> {
        self.disk.as_ref()
    }

    /// The engine for `d` between these storages: a memcpy between the two
    /// memories, the disk engine where G3 is an end.
    pub fn engine(&self, d: Direction) -> Result<Arc<dyn TransferEngine>, AssemblyError> {
        let memory = |t: Tier| match t {
            Tier::Device => Some(self.device.storage().clone()),
            Tier::Host => self.host.as_ref().map(|h| h.storage().clone()),
            Tier::Disk => None,
        };
        let missing = || AssemblyError::Missing(format!("no storage here for {d}"));
        Ok(match (d.src, d.dst) {
            (Tier::Disk, to) => {
                let mem = memory(to).ok_or_else(missing)?;
                let file = self.disk.clone().ok_or_else(missing)?;
                Arc::new(DiskEngine::new(mem, file, DiskDirection::DiskToHost, to)?)
            }
            (from, Tier::Disk) => {
                let mem = memory(from).ok_or_else(missing)?;
                let file = self.disk.clone().ok_or_else(missing)?;
                Arc::new(DiskEngine::new(mem, file, DiskDirection::HostToDisk, from)?)
            }
            (from, to) => Arc::new(MemcpyEngine::new(
                memory(from).ok_or_else(missing)?,
                from,
                memory(to).ok_or_else(missing)?,
                to,
            )?),
        })
    }

    /// Links and pipelines for every direction, each with this module's
    /// engine for it and the settings `config` gives.
    pub fn connect(
        &self,
        wiring: Option<&LeaderWiring>,
        config: impl Fn(Direction) -> PipelineConfig,
    ) -> Result<Connected, AssemblyError> {
        // SAFETY: every engine is `Self::engine`'s, between storages made
        // in `create` for these very pools.
        unsafe {
            connect(&self.pools, wiring, |d| {
                Ok(Route {
                    engine: self.engine(d)?,
                    config: config(d),
                })
            })
        }
    }

    /// [`connect`](Self::connect), with each engine handed to `route`,
    /// which may wrap it (the simulator models a link's speed this way).
    ///
    /// # Safety
    ///
    /// The engine `route` returns copies only through the engine it was
    /// given.
    pub unsafe fn connect_through<E: From<AssemblyError>>(
        &self,
        wiring: Option<&LeaderWiring>,
        mut route: impl FnMut(Direction, Arc<dyn TransferEngine>) -> Result<Route, E>,
    ) -> Result<Connected, E> {
        // SAFETY: the engines are `Self::engine`'s, between storages made
        // in `create` for these very pools, and the caller promises that
        // `route` copies only through them.
        unsafe {
            connect(&self.pools, wiring, |d| {
                let engine = self.engine(d).map_err(E::from)?;
                route(d, engine)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LayoutConfig, LayoutKind};

    fn sizes(host: usize, disk: usize) -> TierSizes {
        TierSizes {
            block_size: 4,
            device_blocks: 8,
            host_blocks: host,
            disk_blocks: disk,
            eviction: Default::default(),
        }
    }

    fn layout(n: usize) -> Result<Layout, LayoutError> {
        Layout::new(
            LayoutConfig {
                num_blocks: n,
                num_layers: 1,
                outer_dim: 1,
                page_size: 4,
                inner_dim: 8,
                dtype_bytes: 1,
            },
            LayoutKind::FullyContiguous,
        )
    }

    #[test]
    fn the_directions_follow_from_the_tiers() {
        let dirs = |h, d| Pools::new(&sizes(h, d), None).unwrap().directions();
        assert_eq!(dirs(0, 0), vec![]);
        assert_eq!(
            dirs(4, 0),
            vec![Direction::DEVICE_TO_HOST, Direction::HOST_TO_DEVICE]
        );
        assert_eq!(
            dirs(0, 4),
            vec![Direction::DEVICE_TO_DISK, Direction::DISK_TO_DEVICE]
        );
        assert_eq!(dirs(4, 16).len(), 4);
    }

    #[test]
    fn local_tiers_get_a_pipeline_for_every_direction() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _guard = rt.enter();
        let dir = tempfile::tempdir().unwrap();
        for (h, d) in [(0, 0), (4, 0), (0, 16), (4, 16)] {
            let pools = Pools::new(&sizes(h, d), None).unwrap();
            let file = dir.path().join(format!("g3-{h}-{d}.kvbm"));
            let local = LocalTiers::create(&pools, layout, Some(&file)).unwrap();
            let c = local.connect(None, |_| PipelineConfig::default()).unwrap();
            let got: Vec<Direction> = c.by_direction.iter().map(|(d, _)| *d).collect();
            assert_eq!(got, pools.directions());
            let p = &c.pipelines;
            assert_eq!(p.offload_device_to_host.is_some(), h > 0);
            assert_eq!(p.onboard_host_to_device.is_some(), h > 0);
            assert_eq!(p.offload_host_to_disk.is_some(), h > 0 && d > 0);
            assert_eq!(p.onboard_disk_to_host.is_some(), h > 0 && d > 0);
            assert_eq!(p.offload_device_to_disk.is_some(), h == 0 && d > 0);
            assert_eq!(p.onboard_disk_to_device.is_some(), h == 0 && d > 0);
        }
    }

    #[test]
    fn a_disk_tier_without_a_file_is_refused() {
        let pools = Pools::new(&sizes(4, 16), None).unwrap();
        assert!(LocalTiers::create(&pools, layout, None).is_err());
    }
}
