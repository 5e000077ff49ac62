//! Pipeline configuration, with the offload pipeline's published defaults
//! (batches of 8–64 blocks, 10 ms flush, 100 ms policy timeout, 10 ms sweep,
//! one transfer at a time).

use std::time::Duration;

/// How the batcher groups containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchConfig {
    /// Most blocks in one batch. A single container larger than this forms
    /// a batch of its own (a container is never split: P1).
    pub max_batch_size: usize,
    /// A batch is sent as soon as it holds this many blocks.
    pub min_batch_size: usize,
    /// A smaller batch is sent this long after its first container arrived.
    pub flush_interval: Duration,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_batch_size: 64,
            min_batch_size: 8,
            flush_interval: Duration::from_millis(10),
        }
    }
}

/// Everything that tunes an [`OffloadPipeline`](super::OffloadPipeline).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineConfig {
    /// Batching.
    pub batch_config: BatchConfig,
    /// Longest a container's policy evaluation may take; past it the
    /// container is skipped (`SkipReason::PolicyTimeout`).
    pub policy_timeout: Duration,
    /// How often the cancel sweeper clears cancelled containers out of the
    /// queues in front of the batcher and the executor.
    pub sweep_interval: Duration,
    /// Transfers (batches) running at once.
    pub max_concurrent_transfers: usize,
    /// Upgraded batches held ready on deck, beyond those transferring.
    pub on_deck_capacity: usize,
    /// Bound of each queue between stages (containers before the batcher,
    /// batches before the executor). `enqueue` refuses with `QueueFull`
    /// when the first one is full; later stages wait for room.
    pub queue_capacity: usize,
    /// Most containers waiting on their precondition at once.
    pub max_awaiting_precondition: usize,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            batch_config: BatchConfig::default(),
            policy_timeout: Duration::from_millis(100),
            sweep_interval: Duration::from_millis(10),
            max_concurrent_transfers: 1,
            on_deck_capacity: 1,
            queue_capacity: 4096,
            max_awaiting_precondition: 4096,
        }
    }
}

/// A configuration that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A size that must be at least 1.
    #[error("{field} must be at least 1")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// `min_batch_size` above `max_batch_size`.
    #[error("min_batch_size ({min}) exceeds max_batch_size ({max})")]
    MinAboveMax {
        /// min_batch_size.
        min: usize,
        /// max_batch_size.
        max: usize,
    },
    /// A duration that must be positive.
    #[error("{field} must be longer than zero")]
    ZeroDuration {
        /// The field.
        field: &'static str,
    },
    /// The pipeline spawns tasks and must be built inside a tokio runtime.
    #[error("the offload pipeline must be created inside a tokio runtime")]
    NoRuntime,
}

impl PipelineConfig {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let b = &self.batch_config;
        for (field, v) in [
            ("batch_config.max_batch_size", b.max_batch_size),
            ("batch_config.min_batch_size", b.min_batch_size),
            ("max_concurrent_transfers", self.max_concurrent_transfers),
            ("on_deck_capacity", self.on_deck_capacity),
            ("queue_capacity", self.queue_capacity),
            ("max_awaiting_precondition", self.max_awaiting_precondition),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if b.min_batch_size > b.max_batch_size {
            return Err(ConfigError::MinAboveMax {
                min: b.min_batch_size,
                max: b.max_batch_size,
            });
        }
        for (field, d) in [
            ("batch_config.flush_interval", b.flush_interval),
            ("policy_timeout", self.policy_timeout),
            ("sweep_interval", self.sweep_interval),
        ] {
            if d.is_zero() {
                return Err(ConfigError::ZeroDuration { field });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_seeds() {
        let c = PipelineConfig::default();
        assert_eq!(c.batch_config.max_batch_size, 64);
        assert_eq!(c.batch_config.min_batch_size, 8);
        assert_eq!(c.batch_config.flush_interval, Duration::from_millis(10));
        assert_eq!(c.policy_timeout, Duration::from_millis(100));
        assert_eq!(c.sweep_interval, Duration::from_millis(10));
        assert_eq!(c.max_concurrent_transfers, 1);
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn bad_configs_name_the_field() {
        let mut c = PipelineConfig::default();
        c.batch_config.min_batch_size = 100;
        assert!(matches!(c.validate(), Err(ConfigError::MinAboveMax { .. })));
        let c = PipelineConfig {
            max_concurrent_transfers: 0,
            ..Default::default()
        };
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "max_concurrent_transfers must be at least 1"
        );
        let c = PipelineConfig {
            sweep_interval: Duration::ZERO,
            ..Default::default()
        };
        assert!(matches!(
            c.validate(),
            Err(ConfigError::ZeroDuration { .. })
        ));
    }
}
