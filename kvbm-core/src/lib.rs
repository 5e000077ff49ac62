//! `kvbm-core`: the KV-cache block manager.
//!
//! What lives here: token blocks and their chained hashes ([`tokens`]), the
//! typestate block lifecycle ([`block`]), tiered pools with prefix matching
//! and eviction ([`pool`], by the policies in [`eviction`] and
//! [`admission`]), block layouts ([`layout`]), the memory behind each
//! tier ([`storage`]), the engines that move bytes between tiers
//! ([`transfer`]), the safe bridge between pools and engines ([`link`]), and
//! the offload/onboard pipeline with its cancellation rules ([`offload`]).
//!
//! What must not live here: anything about log files, sockets or terminals.
//! Those belong to `kvbm-recorder` and `kvbm-console`, which depend on this
//! crate and never the other way round. (The disk *tier* is a block store,
//! not a log, and so it is here.)

pub mod admission;
pub mod assembly;
pub mod block;
pub mod cache_model;
pub mod eviction;
pub mod hooks;
pub mod layout;
pub mod leader;
pub mod link;
pub mod offload;
pub mod pool;
pub mod storage;
pub mod tokens;
pub mod transfer;

pub use block::{BlockError, ImmutableBlock, MutableBlock, WeakBlock};
pub use eviction::{CachePolicy, EvictionPolicy};
pub use kvbm_events::{BlockId, Tier};
pub use link::{HostTier, LinkError, TierLink};
pub use pool::{BlockPool, PoolConfig, PoolError, PoolStatus};
pub use tokens::{BlockHash, BlockMeta, SaltHash, SequenceHash, Token, TokenBlock, TokenSequence};

/// The CUDA driver API's raw types and calls (feature `cuda`), through
/// the same cudarc kvbm-core is built with, for crates that hand kvbm an
/// engine's CUDA stream.
#[cfg(feature = "cuda")]
pub use cudarc::driver::sys as cuda_sys;
