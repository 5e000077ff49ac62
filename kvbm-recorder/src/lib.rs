//! `kvbm-recorder` keeps what an engine did and gives it back: the durable
//! log, the recorder that drains an engine's tap into it, its sidecar and
//! what a recording can be trusted to hold ([`verdict`]), a fleet's
//! recording of many engines ([`fleet`]), replay, timelines, statistics,
//! invariant checks, exports, diffs and the capacity analysis, and (with
//! the feature `progress`) a progress bar for the reads that take a while.
//!
//! A library: it depends on `kvbm-events` and `kvbm-schema` only, so the
//! vLLM connector links it without the simulator, a terminal or a network
//! client. The `kvbm-recorder` program, which wires sources (the
//! simulator, an attach server, vLLM / SGLang over ZMQ, NATS) to it, is
//! the crate `kvbm-cli`.

pub mod analysis;
pub mod cpu;
pub mod fleet;
pub mod log;
#[cfg(feature = "progress")]
pub mod progress;
pub mod recorder;
pub mod sidecar;
pub mod verdict;

pub use kvbm_schema::SCHEMA_VERSION;
