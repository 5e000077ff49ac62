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
        self.check()?;
        let (page_size, inner_dim) = if self.page_bytes.is_multiple_of(self.block_size) {
            (self.block_size, self.page_bytes / self.block_size)
        } else {
            (1, self.page_bytes)
        };
        Ok(Layout::new(
            LayoutConfig {
                num_blocks: blocks,
                num_layers: self.num_layers,
                outer_dim: 1,
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

/// The shared host tier's file for vLLM engine `engine_id` (the same in
/// both of its processes): `kvbm-<id>-<hash>.g2` in `cfg.shm_dir`,
/// `/dev/shm` or the temporary directory, where `<id>` is the id's
/// characters that are safe in a file name (at most 64, for people to
/// read) and `<hash>` the xxh3-64 of the whole id, so that distinct ids
/// never share a file.
pub fn shm_path(cfg: &Config, engine_id: &str) -> PathBuf {
    let dir = cfg.shm_dir.clone().unwrap_or_else(|| {
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        }
    });
    // Only the id's safe characters: it names a file.
    let id: String = engine_id
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .take(64)
        .collect();
    // The same hash in every process and build (kvbm-core's salt hash is
    // xxh3-64 of the bytes, seed 0).
    let hash = kvbm_core::tokens::salt_hash(engine_id.as_bytes()).0;
    dir.join(format!("kvbm-{id}-{hash:016x}.g2"))
}

/// Why the shared host tier's file could not be claimed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// Another scheduler holds it.
    #[error(
        "the host tier's shared file {} is held by another engine with the same engine_id \
         (give each engine its own engine_id, or its own shm_dir)",
        .0.display()
    )]
    Held(PathBuf),
    /// Opening or locking it failed.
    #[error("the host tier's shared file {} (kv_connector_extra_config `shm_dir`): {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The scheduler side's hold on its engine's shared host-tier file: an
/// exclusive advisory lock (`flock`) for as long as it lives, so that a
/// second engine with the same id is refused instead of sharing (and
/// later deleting) the first one's tier. The workers of the engine open
/// the file without locking. Dropping the claim removes the file: a
/// scheduler that failed to start leaves nothing behind, and one that
/// shuts down removes its tier. A file left by a crashed run is not
/// locked, and is claimed (and reused) as any other.
#[derive(Debug)]
pub struct ShmClaim {
    path: PathBuf,
    _file: File,
}

impl ShmClaim {
    /// Creates (when missing) and locks the file at `path`.
    pub fn take(path: &Path) -> Result<ShmClaim, ClaimError> {
        let io = |source| ClaimError::Io {
            path: path.to_path_buf(),
            source,
        };
        // A claim that was just dropped removes the file it locked: a file
        // opened before that removal is no longer the one at `path`, so it
        // is opened again.
        for _ in 0..8 {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
                .map_err(io)?;
            match file.try_lock() {
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(ClaimError::Held(path.to_path_buf()));
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
            }
            if same_file(&file, path) {
                return Ok(ShmClaim {
                    path: path.to_path_buf(),
                    _file: file,
                });
            }
        }
        Err(io(std::io::Error::other(
            "it was removed and created again while being claimed",
        )))
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ShmClaim {
    fn drop(&mut self) {
        // Removed while still locked: no other scheduler can hold it now.
        let _ = std::fs::remove_file(&self.path);
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
        let p = shm_path(&cfg, "a1b2/../c d");
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with("kvbm-a1b2cd-") && name.ends_with(".g2"),
            "{name}"
        );
        assert_eq!(name.len(), "kvbm-a1b2cd-".len() + 16 + ".g2".len());
        assert_eq!(p, shm_path(&cfg, "a1b2/../c d"), "the same in each process");
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
        let paths: std::collections::HashSet<PathBuf> =
            ids.iter().map(|id| shm_path(&cfg, id)).collect();
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
    fn one_claim_per_file_and_a_dropped_claim_removes_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvbm-e.g2");
        // A file a crashed run left (no lock on it) is claimed as it is.
        std::fs::write(&path, b"stale").unwrap();
        let first = ShmClaim::take(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"stale");
        let e = ShmClaim::take(&path).unwrap_err().to_string();
        assert!(
            e.contains(&path.display().to_string()) && e.contains("same engine_id"),
            "{e}"
        );
        assert!(path.exists(), "a refused claim leaves the holder's file");
        drop(first);
        assert!(!path.exists());
        let again = ShmClaim::take(&path).unwrap();
        assert!(path.exists());
        drop(again);
        let e = ShmClaim::take(&dir.path().join("no-such-dir/f.g2"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`shm_dir`"), "{e}");
    }
}
