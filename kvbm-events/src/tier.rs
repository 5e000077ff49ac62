//! Storage tiers and block identifiers shared by pools, storage and engines.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Index of a block inside one tier's pool and storage (0..capacity).
pub type BlockId = u32;

/// The memory hierarchy, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Tier {
    /// G1: accelerator memory, where the forward pass reads and writes.
    Device,
    /// G2: host memory (pinned when a GPU is present).
    Host,
    /// G3: local disk.
    Disk,
}

impl Tier {
    /// All tiers, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    /// The short name used in the design documents: G1, G2, G3.
    pub fn short_name(self) -> &'static str {
        match self {
            Tier::Device => "G1",
            Tier::Host => "G2",
            Tier::Disk => "G3",
        }
    }

    /// Position in [`Tier::ALL`], handy for per-tier arrays.
    pub fn index(self) -> usize {
        match self {
            Tier::Device => 0,
            Tier::Host => 1,
            Tier::Disk => 2,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        };
        write!(f, "{} ({name})", self.short_name())
    }
}
