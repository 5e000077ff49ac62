//! `kvbm-sim`: a simulated LLM engine that drives the kvbm block manager
//! exactly as a real engine would.
//!
//! - [`workload`]: what arrives (synthetic, Mooncake traces).
//! - [`sim`]: the continuous-batching engine over the paged device pool,
//!   with a worker model that turns work into (virtual or real) time.
//! - [`model`]: the models the engine can stand for (KV bytes per token,
//!   forward-pass timings).
//! - [`modeled`]: the transfer engine wrapper that reports, and in real
//!   time takes, what the modelled model's copies would.
//! - [`scenario`]: built-in scenarios (the CPU-offload walk-through's two
//!   requests).
//! - [`info`]: what the engine runs as, for headers and recordings.
//! - [`args`]: the command-line options, declared once for every command
//!   that runs the simulator.

pub mod args;
pub mod info;
pub mod model;
pub mod modeled;
pub mod scenario;
pub mod sim;
pub mod workload;
