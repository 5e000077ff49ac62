//! `kvbm-recorder` keeps what an engine did and gives it back: the durable
//! log, the recorder that drains an engine's tap into it, its sidecar and
//! what a recording can be trusted to hold ([`verdict`]), a fleet's
//! recording of many engines ([`fleet`], written by [`shards`]), replay,
//! timelines, statistics, invariant checks, exports and diffs, progress
//! for the commands that take a while, and the `kvbm-recorder` CLI.
//!
//! The in-memory ring is `kvbm_events::ring`; the wire format
//! `kvbm-schema`; remote sources come through `kvbm-attach` (another
//! kvbm engine) and `kvbm-ingest` (vLLM / SGLang).

pub mod analysis;
pub mod cpu;
pub mod fleet;
pub mod log;
pub mod progress;
pub mod recorder;
pub mod shards;
pub mod sidecar;
pub mod verdict;

pub use kvbm_schema::SCHEMA_VERSION;
