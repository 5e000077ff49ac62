//! `kvbm-sim`: a simulated LLM engine that drives the kvbm block manager
//! exactly as a real engine would.
//!
//! - [`workload`]: what arrives (synthetic, Mooncake traces).
//! - [`sim`]: the continuous-batching engine over the paged device pool,
//!   with a worker model that turns work into (virtual or real) time.
//! - [`walkthrough`]: the CPU-offload walk-through, a small scenario on
//!   real pools, bytes and transfer engines.

pub mod sim;
pub mod walkthrough;
pub mod workload;
