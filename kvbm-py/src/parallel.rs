//! How vLLM runs the engine kvbm serves: its tensor-parallel workers, its
//! pipeline stages, its scheduling. What kvbm supports of each, what it
//! refuses and why, and the one line (and the same facts as JSON, for the
//! recording and `/health`) that tells the user what kvbm runs as.

use crate::config::Config;
use crate::tiers::{Geometry, TierSizes, human};

/// The engine's parallelism and scheduling, as vLLM's config says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallel {
    /// Tensor-parallel workers: each keeps its own shard of the KV heads,
    /// in its own files of every kvbm tier.
    pub ranks: usize,
    /// Pipeline stages (kvbm supports one).
    pub stages: usize,
    /// vLLM schedules the next step before the last one's output is back
    /// (two batches in flight).
    pub async_scheduling: bool,
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel {
            ranks: 1,
            stages: 1,
            async_scheduling: false,
        }
    }
}

/// The most tensor-parallel workers kvbm follows (vLLM's largest
/// deployments use 8 to 16 a node; each rank costs kvbm one host-tier file).
pub const MAX_RANKS: usize = 1024;

impl Parallel {
    /// Refuses what kvbm cannot serve, saying why.
    pub fn check(&self) -> Result<(), String> {
        if self.ranks == 0 || self.ranks > MAX_RANKS {
            return Err(format!(
                "tensor_parallel_size {} is not one kvbm follows (1 to {MAX_RANKS})",
                self.ranks
            ));
        }
        if self.stages != 1 {
            return Err(format!(
                "pipeline_parallel_size {} is not supported: each pipeline stage holds other \
                 layers of every block, and kvbm's plans name whole blocks of one stage's layers; \
                 run kvbm with pipeline_parallel_size 1",
                self.stages
            ));
        }
        Ok(())
    }

    /// What kvbm runs as, as JSON: `summary` (the line logged at start)
    /// and the facts it is made of.
    pub fn info(&self, cfg: &Config, g: &Geometry, sizes: TierSizes) -> serde_json::Value {
        let bytes = |blocks: usize| (blocks as u64).saturating_mul(g.block_bytes() as u64);
        let tier = |name: &str, blocks: usize, policy: kvbm_core::CachePolicy| {
            if blocks == 0 {
                format!("{name} none")
            } else {
                let each = if self.ranks > 1 { " a rank" } else { "" };
                // The policy is said where it is not the default.
                let policy = if policy == kvbm_core::CachePolicy::default() {
                    String::new()
                } else {
                    format!(" {policy}")
                };
                format!(
                    "{name} {} tokens ({}{each}){policy}",
                    blocks * g.block_size,
                    human(bytes(blocks))
                )
            }
        };
        let tiers = if sizes.host_blocks == 0 && sizes.disk_blocks == 0 {
            "observer: no tier of its own".to_string()
        } else {
            format!(
                "{} · {}",
                tier("G2", sizes.host_blocks, cfg.eviction.host),
                tier("G3", sizes.disk_blocks, cfg.eviction.disk)
            )
        };
        let mut summary = format!(
            "vLLM · {} · {} scheduling · block {} tokens · {}",
            if self.ranks > 1 {
                format!("tensor parallel {}", self.ranks)
            } else {
                "1 worker".to_string()
            },
            if self.async_scheduling {
                "async"
            } else {
                "sync"
            },
            g.block_size,
            tiers,
        );
        if cfg.offload != crate::config::Offload::Eager && !tiers.starts_with("observer") {
            summary.push_str(&format!(" · offload {}", cfg.offload));
        }
        serde_json::json!({
            "summary": summary,
            "source": "vllm",
            "tensor_parallel": self.ranks,
            "pipeline_parallel": self.stages,
            "async_scheduling": self.async_scheduling,
            "block_size": g.block_size,
            "device_blocks": g.num_gpu_blocks,
            "host_tokens": sizes.host_blocks * g.block_size,
            "host_bytes_per_rank": bytes(sizes.host_blocks),
            "disk_tokens": sizes.disk_blocks * g.block_size,
            "disk_bytes_per_rank": bytes(sizes.disk_blocks),
            "offload": cfg.offload.to_string(),
            "eviction": format!("G2={},G3={}", cfg.eviction.host, cfg.eviction.disk),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipeline_stages_are_refused_naming_why() {
        let p = Parallel {
            stages: 2,
            ..Parallel::default()
        };
        let e = p.check().unwrap_err();
        assert!(e.contains("pipeline_parallel_size 2"), "{e}");
        assert!(Parallel { ranks: 0, ..p }.check().is_err());
        Parallel {
            ranks: 8,
            stages: 1,
            async_scheduling: true,
        }
        .check()
        .unwrap();
    }

    #[test]
    fn the_summary_says_ranks_scheduling_and_tiers() {
        let g = Geometry {
            num_gpu_blocks: 64,
            block_size: 32,
            num_layers: 2,
            page_bytes: 16384,
        };
        let sizes = TierSizes {
            host_blocks: 256,
            disk_blocks: 0,
        };
        let p = Parallel {
            ranks: 2,
            stages: 1,
            async_scheduling: true,
        };
        let info = p.info(&Config::default(), &g, sizes);
        assert_eq!(
            info["summary"],
            "vLLM · tensor parallel 2 · async scheduling · block 32 tokens · \
             G2 8192 tokens (8.0 MiB a rank) · G3 none"
        );
        assert_eq!(info["tensor_parallel"], 2);
        assert_eq!(info["async_scheduling"], true);
        assert_eq!(info["host_bytes_per_rank"], 8 << 20);
        assert_eq!(info["offload"], "eager");
        let cfg = Config::from_json(&serde_json::json!({
            "offload": "after-hits:2",
            "eviction": "tinylfu+s3fifo",
        }))
        .unwrap();
        let info = p.info(&cfg, &g, sizes);
        assert_eq!(
            info["summary"],
            "vLLM · tensor parallel 2 · async scheduling · block 32 tokens · \
             G2 8192 tokens (8.0 MiB a rank) tinylfu+s3fifo · G3 none · offload after-hits:2"
        );
        assert_eq!(info["offload"], "after-hits:2");
        let none = TierSizes {
            host_blocks: 0,
            disk_blocks: 0,
        };
        let info = Parallel::default().info(&Config::default(), &g, none);
        assert!(
            info["summary"]
                .as_str()
                .unwrap()
                .ends_with("block 32 tokens · observer: no tier of its own"),
            "{}",
            info["summary"]
        );
    }
}
