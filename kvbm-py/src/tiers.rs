//! The tiers' shapes and files, which both of vLLM's processes work out the
//! same way from what vLLM tells each of them: the KV cache's geometry
//! ([`Geometry`], from `kv_cache_config`), and where the shared host tier
//! lives ([`shm_path`]).

use crate::config::{Config, ConfigError, default_host_capacity_tokens};
use kvbm_core::layout::{Layout, LayoutConfig, LayoutError, LayoutKind};
use std::path::{Path, PathBuf};

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
/// both of its processes): `kvbm-<engine_id>.g2` in `cfg.shm_dir`,
/// `/dev/shm` or the temporary directory.
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
    dir.join(format!("kvbm-{id}.g2"))
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
        assert!(
            p.to_string_lossy().ends_with("kvbm-a1b2cd.g2"),
            "{}",
            p.display()
        );
    }
}
