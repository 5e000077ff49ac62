//! The tiers' shapes and files, which both of vLLM's processes work out the
//! same way from what vLLM tells each of them: the KV cache's geometry
//! ([`Geometry`], from `kv_cache_config`), and where the shared host tier
//! lives ([`shm_path`], held by the scheduler side as a [`ShmClaim`]).

use crate::config::{Config, ConfigError, default_host_capacity_tokens};
use kvbm_core::layout::{Layout, LayoutConfig, LayoutError, LayoutKind};
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The most tokens a block may hold. vLLM's blocks hold 16 to a few
/// hundred tokens (its largest choice is 256, hybrid models round up to
/// a few thousand); a million is far beyond any of them, and bounds what
/// a token block costs before a single one is allocated (kvbm reserves a
/// block's tokens up front, so 2^40 would abort on the first request).
pub const MAX_BLOCK_SIZE: usize = 1 << 20;

/// The shape of vLLM's KV cache, per block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// vLLM's device blocks.
    pub num_gpu_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Attention layers with a KV cache.
    pub num_layers: usize,
    /// Bytes of one block of one layer (vLLM's `page_size_bytes`).
    pub page_bytes: usize,
}

/// What vLLM's geometry cannot be.
#[derive(Debug, thiserror::Error)]
pub enum GeometryError {
    /// A zero or inconsistent dimension.
    #[error("kvbm: vLLM's KV cache geometry is unusable: {0}")]
    Invalid(String),
    /// kvbm's layout refused it.
    #[error("kvbm: vLLM's KV cache geometry does not fit a layout: {0}")]
    Layout(#[from] LayoutError),
}

impl Geometry {
    /// Checks the numbers.
    pub fn check(&self) -> Result<(), GeometryError> {
        if self.num_gpu_blocks == 0 || self.block_size == 0 || self.num_layers == 0 {
            return Err(GeometryError::Invalid(format!("{self:?}")));
        }
        if self.page_bytes == 0 {
            return Err(GeometryError::Invalid("a block of zero bytes".into()));
        }
        if self.block_size > MAX_BLOCK_SIZE {
            return Err(GeometryError::Invalid(format!(
                "block_size {} is more than {MAX_BLOCK_SIZE} tokens",
                self.block_size
            )));
        }
        // Every size below is derived from these products: they must fit.
        if self.page_bytes.checked_mul(self.num_layers).is_none() {
            return Err(GeometryError::Invalid(format!(
                "page_bytes {} × num_layers {} overflows",
                self.page_bytes, self.num_layers
            )));
        }
        if self.page_bytes.checked_mul(self.num_gpu_blocks).is_none() {
            return Err(GeometryError::Invalid(format!(
                "num_gpu_blocks {} × page_bytes {} overflows",
                self.num_gpu_blocks, self.page_bytes
            )));
        }
        Ok(())
    }

    /// Bytes of one block over every layer (what one token block costs on
    /// the host or disk tier).
    pub fn block_bytes(&self) -> usize {
        self.page_bytes * self.num_layers
    }

    /// Bytes per token, over every layer.
    pub fn bytes_per_token(&self) -> u64 {
        (self.block_bytes() / self.block_size.max(1)) as u64
    }

    /// A layout of `blocks` blocks of this shape. A block of a layer is one
    /// page (`page_size` tokens of `page_bytes / block_size` bytes, or one
    /// chunk of the whole page when that does not divide); copies move whole
    /// pages, so how vLLM orders bytes inside a page does not matter.
    pub fn layout(&self, blocks: usize, kind: LayoutKind) -> Result<Layout, GeometryError> {
        self.layout_split(blocks, kind, 1)
    }

    /// As [`Self::layout`], with each layer's page split in `outer` equal
    /// parts (2 for vLLM's `[2, num_blocks, ...]` tensors, K then V). A
    /// block's bytes are the same in every fully contiguous layout of one
    /// geometry, whatever the split.
    pub fn layout_split(
        &self,
        blocks: usize,
        kind: LayoutKind,
        outer: usize,
    ) -> Result<Layout, GeometryError> {
        self.check()?;
        if outer == 0 || !self.page_bytes.is_multiple_of(outer) {
            return Err(GeometryError::Invalid(format!(
                "a page of {} bytes does not split in {outer} parts",
                self.page_bytes
            )));
        }
        let part = self.page_bytes / outer;
        let (page_size, inner_dim) = if part.is_multiple_of(self.block_size) {
            (self.block_size, part / self.block_size)
        } else {
            (1, part)
        };
        Ok(Layout::new(
            LayoutConfig {
                num_blocks: blocks,
                num_layers: self.num_layers,
                outer_dim: outer,
                page_size,
                inner_dim,
                dtype_bytes: 1,
            },
            kind,
        )?)
    }
}

/// The host and disk tiers' sizes in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierSizes {
    /// Host blocks (0: no host tier).
    pub host_blocks: usize,
    /// Disk blocks (0: no disk tier).
    pub disk_blocks: usize,
}

impl TierSizes {
    /// The sizes `cfg` asks for with this geometry.
    pub fn of(cfg: &Config, g: &Geometry) -> Result<TierSizes, ConfigError> {
        let host_tokens = cfg
            .host_capacity_tokens
            .unwrap_or_else(|| default_host_capacity_tokens(g.bytes_per_token()));
        let host_blocks = if host_tokens == 0 {
            0
        } else {
            Config::blocks("host_capacity_tokens", host_tokens, g.block_size)?
        };
        let disk_blocks = match cfg.disk_capacity_tokens {
            Some(t) if cfg.disk_path.is_some() => {
                Config::blocks("disk_capacity_tokens", t, g.block_size)?
            }
            _ => 0,
        };
        Ok(TierSizes {
            host_blocks,
            disk_blocks,
        })
    }
}

/// Which of an engine's workers this is. vLLM shards the KV heads across
/// its tensor-parallel workers: each keeps its own shard of every block, so
/// each rank has its own host-tier file and disk file, with the same
/// geometry (vLLM's `page_size_bytes` is per worker already).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This worker's tensor-parallel rank.
    pub rank: usize,
    /// The engine's tensor-parallel size.
    pub ranks: usize,
}

impl Shard {
    /// The one worker of an engine without tensor parallelism.
    pub const ONE: Shard = Shard { rank: 0, ranks: 1 };

    /// Every rank of an engine of `ranks` workers.
    pub fn all(ranks: usize) -> impl Iterator<Item = Shard> {
        (0..ranks).map(move |rank| Shard { rank, ranks })
    }

    /// What a rank's files add to their names: nothing for a single
    /// worker (its files keep the names they always had), `.tp<rank>`
    /// otherwise.
    fn suffix(&self) -> String {
        if self.ranks > 1 {
            format!(".tp{}", self.rank)
        } else {
            String::new()
        }
    }
}

/// The directory the shared host tier's files go in: `cfg.shm_dir`,
/// `/dev/shm`, or the temporary directory where there is none.
pub fn shm_dir(cfg: &Config) -> PathBuf {
    cfg.shm_dir.clone().unwrap_or_else(|| {
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        }
    })
}

/// The shared host tier's file of one rank of vLLM engine `engine_id` (the
/// same in the scheduler's process and that rank's):
/// `kvbm-<id>-<hash>[.tp<rank>].g2` in [`shm_dir`], where `<id>` is the
/// id's characters that are safe in a file name (at most 64, for people to
/// read) and `<hash>` the xxh3-64 of the whole id, so that distinct ids
/// never share a file.
pub fn shm_path(cfg: &Config, engine_id: &str, shard: Shard) -> PathBuf {
    // Only the id's safe characters: it names a file.
    let id: String = engine_id
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .take(64)
        .collect();
    // The same hash in every process and build (kvbm-core's salt hash is
    // xxh3-64 of the bytes, seed 0).
    let hash = kvbm_core::tokens::salt_hash(engine_id.as_bytes()).0;
    shm_dir(cfg).join(format!("kvbm-{id}-{hash:016x}{}.g2", shard.suffix()))
}

/// One rank's disk-tier file: `disk_path` itself for a single worker,
/// `disk_path.tp<rank>` under tensor parallelism.
pub fn disk_path(path: &Path, shard: Shard) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(shard.suffix());
    PathBuf::from(name)
}

/// Whether a file in [`shm_dir`] is named as a host tier's file.
fn is_tier_file(name: &str) -> bool {
    name.starts_with("kvbm-") && name.ends_with(".g2")
}

/// Opens (creating when missing) the host tier's file at `path` and holds a
/// shared lock on it for as long as the returned file lives. Every process
/// that maps a tier holds one, so a file whose lock can be taken
/// exclusively belongs to no living engine ([`remove_stale`]). Returns the
/// file and whether this call created it.
pub fn open_locked(path: &Path) -> std::io::Result<(File, bool)> {
    // A stale-file sweep may remove the file between its creation and the
    // lock: then the file opened is no longer the one at `path`, and it is
    // opened again.
    for _ in 0..8 {
        let (file, made) = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
        {
            Ok(f) => (f, true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => (
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(path)?,
                false,
            ),
            Err(e) => return Err(e),
        };
        file.lock_shared()?;
        if same_file(&file, path) {
            return Ok((file, made));
        }
    }
    Err(std::io::Error::other(
        "it was removed and created again while being opened",
    ))
}

/// Removes the host-tier files in `dir` that no living engine holds (a
/// process killed with SIGKILL, or a machine that lost power, leaves its
/// file behind: a `/dev/shm` file keeps its memory until it is removed).
/// Returns the files removed with their sizes; files it cannot open or
/// lock are left as they are.
pub fn remove_stale(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return removed;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(is_tier_file) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = std::fs::OpenOptions::new().read(true).open(&path) else {
            continue;
        };
        // Held (shared) by every process of a living engine: an exclusive
        // lock is only to be had on a dead engine's file. Removed while
        // locked, so no engine can open it meanwhile and then lose it.
        if file.try_lock().is_ok() && same_file(&file, &path) {
            let size = file.metadata().map(|m| m.len()).unwrap_or(0);
            if std::fs::remove_file(&path).is_ok() {
                removed.push((path, size));
            }
        }
    }
    removed
}

/// Why the host tier cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// Another scheduler holds it.
    #[error(
        "the host tier's shared file {} is held by another engine with the same engine_id \
         (give each engine its own engine_id, or its own shm_dir)",
        .0.display()
    )]
    Held(PathBuf),
    /// The filesystem has not the room for it.
    #[error(
        "the host tier does not fit: kv_connector_extra_config `host_capacity_tokens` asks for \
         {} in all ({ranks} file(s) of {} each), and `shm_dir` {} has {} free; lower \
         host_capacity_tokens, point shm_dir at a larger filesystem, or give the container \
         more shared memory (docker run --shm-size)",
        human(*.need), human(*.each), .dir.display(), human(*.free)
    )]
    NoRoom {
        /// The directory.
        dir: PathBuf,
        /// Bytes of all ranks' files.
        need: u64,
        /// Bytes of one rank's file.
        each: u64,
        /// How many files.
        ranks: usize,
        /// Bytes free there (files already there of this engine counted as free).
        free: u64,
    },
    /// Opening, locking or reserving it failed.
    #[error("the host tier's shared file {} (kv_connector_extra_config `shm_dir`): {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Bytes for people: `64.0 MiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Bytes free to an unprivileged writer of the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("a NUL byte in the path"))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `st` room for the answer.
    if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// The scheduler side's hold on its engine's shared host-tier files, one
/// per rank: each held with a shared lock (as its rank's worker holds it)
/// and its room reserved, and the engine's claim on them, which a second
/// engine with the same id (and `shm_dir`) is refused. Dropping it removes
/// the files: a scheduler that failed to start leaves nothing behind, and
/// one that shuts down removes its tier.
///
/// The claim is an abstract Unix socket named after the files (no file of
/// its own to leave behind: the kernel releases it with the process).
#[derive(Debug)]
pub struct ShmClaim {
    files: Vec<(PathBuf, File)>,
    _owner: std::os::unix::net::UnixListener,
}

impl ShmClaim {
    /// Claims, creates where missing, and reserves `bytes_each` bytes of
    /// every file in `paths` (all in one directory): refused when the
    /// filesystem has not the room, before anything is written, so that
    /// no copy into the tier can later fault (SIGBUS) on a full tmpfs.
    pub fn take(paths: &[PathBuf], bytes_each: u64) -> Result<ShmClaim, ClaimError> {
        use std::os::linux::net::SocketAddrExt;
        let first = paths.first().cloned().unwrap_or_default();
        let io = |path: &Path, source| ClaimError::Io {
            path: path.to_path_buf(),
            source,
        };
        let name = format!(
            "kvbm-shm-{:016x}",
            kvbm_core::tokens::salt_hash(first.as_os_str().as_encoded_bytes()).0
        );
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| io(&first, e))?;
        let owner = match std::os::unix::net::UnixListener::bind_addr(&addr) {
            Ok(l) => l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                return Err(ClaimError::Held(first));
            }
            Err(e) => return Err(io(&first, e)),
        };
        let dir = first.parent().map(Path::to_path_buf).unwrap_or_default();
        let need = bytes_each.saturating_mul(paths.len() as u64);
        // Room already taken by this engine's files (its workers made them)
        // counts as free: it is this tier's.
        let have: u64 = paths
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.blocks().saturating_mul(512).min(bytes_each))
            .sum();
        let free = free_bytes(&dir)
            .map_err(|e| io(&dir, e))?
            .saturating_add(have);
        if free < need {
            return Err(ClaimError::NoRoom {
                dir,
                need,
                each: bytes_each,
                ranks: paths.len(),
                free,
            });
        }
        let mut claim = ShmClaim {
            files: Vec::with_capacity(paths.len()),
            _owner: owner,
        };
        for path in paths {
            let (file, _) = open_locked(path).map_err(|e| io(path, e))?;
            // Kept in the claim before anything can fail: dropped with the
            // error, it removes what it made.
            claim.files.push((path.clone(), file));
            let file = &claim.files[claim.files.len() - 1].1;
            reserve(file, bytes_each).map_err(|e| {
                if e.raw_os_error() == Some(libc::ENOSPC) {
                    ClaimError::NoRoom {
                        dir: dir.clone(),
                        need,
                        each: bytes_each,
                        ranks: paths.len(),
                        free: free_bytes(&dir).unwrap_or(0),
                    }
                } else {
                    io(path, e)
                }
            })?;
        }
        Ok(claim)
    }

    /// The files, by rank.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }
}

/// Gives `file` `len` bytes of backing store now (`posix_fallocate`), so
/// that writing into a mapping of it can never fault for lack of room.
fn reserve(file: &File, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len).map_err(|_| std::io::Error::other("too large"))?;
    // SAFETY: a valid open descriptor; the call only sizes its file.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

impl Drop for ShmClaim {
    fn drop(&mut self) {
        for (path, file) in &self.files {
            // Still the file this claim holds (not a later engine's).
            if same_file(file, path) {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// Whether `path` names the file open as `file` now.
pub(crate) fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g() -> Geometry {
        Geometry {
            num_gpu_blocks: 64,
            block_size: 32,
            num_layers: 2,
            page_bytes: 16384,
        }
    }

    #[test]
    fn layouts_follow_the_geometry() {
        let l = g().layout(10, LayoutKind::FullyContiguous).unwrap();
        assert_eq!(l.block_bytes(), 32768);
        assert_eq!(l.layer_block_bytes(), 16384);
        let odd = Geometry {
            page_bytes: 1000,
            ..g()
        };
        assert_eq!(
            odd.layout(1, LayoutKind::LayerSeparate)
                .unwrap()
                .block_bytes(),
            2000
        );
        assert!(
            Geometry {
                num_layers: 0,
                ..g()
            }
            .layout(1, LayoutKind::FullyContiguous)
            .is_err()
        );
    }

    #[test]
    fn tier_sizes_and_the_shared_file() {
        let cfg = Config {
            host_capacity_tokens: Some(3200),
            ..Config::default()
        };
        let s = TierSizes::of(&cfg, &g()).unwrap();
        assert_eq!((s.host_blocks, s.disk_blocks), (100, 0));
        let p = shm_path(&cfg, "a1b2/../c d", Shard::ONE);
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with("kvbm-a1b2cd-") && name.ends_with(".g2"),
            "{name}"
        );
        assert_eq!(name.len(), "kvbm-a1b2cd-".len() + 16 + ".g2".len());
        assert_eq!(
            p,
            shm_path(&cfg, "a1b2/../c d", Shard::ONE),
            "the same in each process"
        );
        // Under tensor parallelism, a file per rank beside it.
        let ranks: Vec<PathBuf> = Shard::all(2)
            .map(|r| shm_path(&cfg, "a1b2/../c d", r))
            .collect();
        let stem = name.trim_end_matches(".g2");
        assert_eq!(
            ranks[0].file_name().unwrap().to_string_lossy(),
            format!("{stem}.tp0.g2")
        );
        assert_eq!(
            ranks[1].file_name().unwrap().to_string_lossy(),
            format!("{stem}.tp1.g2")
        );
        assert_eq!(
            disk_path(Path::new("/d/g3.kvbm"), Shard::ONE),
            Path::new("/d/g3.kvbm")
        );
        assert_eq!(
            disk_path(Path::new("/d/g3.kvbm"), Shard { rank: 1, ranks: 4 }),
            Path::new("/d/g3.kvbm.tp1")
        );
    }

    /// Ids that differ only in characters a file name drops, or after the
    /// part of the id the name keeps, are still different engines.
    #[test]
    fn distinct_engine_ids_have_distinct_files() {
        let cfg = Config::default();
        let long = "x".repeat(64);
        let ids = [
            "eng/1".to_string(),
            "eng1".to_string(),
            String::new(),
            "\u{e9}\u{e9}".to_string(),
            format!("{long}a"),
            format!("{long}b"),
        ];
        let paths: std::collections::HashSet<PathBuf> = ids
            .iter()
            .map(|id| shm_path(&cfg, id, Shard::ONE))
            .collect();
        assert_eq!(paths.len(), ids.len(), "{paths:?}");
    }

    #[test]
    fn absurd_geometries_are_refused_naming_the_number() {
        for (bad, name) in [
            (
                Geometry {
                    block_size: 1 << 40,
                    ..g()
                },
                "block_size",
            ),
            (
                Geometry {
                    block_size: MAX_BLOCK_SIZE + 1,
                    ..g()
                },
                "block_size",
            ),
            (
                Geometry {
                    page_bytes: 1 << 63,
                    ..g()
                },
                "num_layers",
            ),
            (
                Geometry {
                    num_gpu_blocks: usize::MAX / 2,
                    num_layers: 1,
                    ..g()
                },
                "num_gpu_blocks",
            ),
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains(name), "{bad:?}: {e}");
        }
        Geometry {
            block_size: MAX_BLOCK_SIZE,
            ..g()
        }
        .check()
        .unwrap();
    }

    #[test]
    fn one_claim_per_engine_and_a_dropped_claim_removes_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> = (0..2)
            .map(|r| dir.path().join(format!("kvbm-e.tp{r}.g2")))
            .collect();
        // A worker made rank 1's file first (and holds it).
        let (worker, made) = open_locked(&paths[1]).unwrap();
        assert!(made);
        let first = ShmClaim::take(&paths, 8192).unwrap();
        for p in &paths {
            assert_eq!(std::fs::metadata(p).unwrap().len(), 8192, "room reserved");
        }
        let e = ShmClaim::take(&paths, 8192).unwrap_err().to_string();
        assert!(e.contains("same engine_id"), "{e}");
        assert!(
            paths.iter().all(|p| p.exists()),
            "a refused claim leaves the holder's files"
        );
        drop(first);
        assert!(paths.iter().all(|p| !p.exists()));
        drop(worker);
        let again = ShmClaim::take(&paths[..1], 4096).unwrap();
        assert!(paths[0].exists());
        drop(again);
        let e = ShmClaim::take(&[dir.path().join("no-such-dir/f.g2")], 4096)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`shm_dir`"), "{e}");
    }

    /// A tier larger than its filesystem's free room is refused before
    /// anything is written, naming the setting, the directory and the sizes.
    #[test]
    fn a_tier_that_does_not_fit_is_refused_with_the_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvbm-big.g2");
        let e = ShmClaim::take(std::slice::from_ref(&path), u64::MAX / 4)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("host_capacity_tokens") && e.contains("shm_dir"),
            "{e}"
        );
        assert!(
            e.contains(&dir.path().display().to_string()) && e.contains("free"),
            "{e}"
        );
        assert!(!path.exists(), "nothing made: {e}");
    }

    /// Files no living engine holds are removed; held ones, and files that
    /// are not host tiers, stay.
    #[test]
    fn stale_files_are_removed_and_held_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join("kvbm-dead-0000000000000000.g2");
        std::fs::write(&stale, vec![0u8; 100]).unwrap();
        let held = dir.path().join("kvbm-live-0000000000000001.tp0.g2");
        let (_hold, _) = open_locked(&held).unwrap();
        let other = dir.path().join("kvbm-notes.txt");
        std::fs::write(&other, b"x").unwrap();
        let removed = remove_stale(dir.path());
        assert_eq!(removed, vec![(stale.clone(), 100)]);
        assert!(!stale.exists() && held.exists() && other.exists());
        assert!(remove_stale(&dir.path().join("missing")).is_empty());
    }

    #[test]
    fn sizes_for_people() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(64 << 20), "64.0 MiB");
        assert_eq!(human(3 << 29), "1.5 GiB");
    }
}
