//! kvbm-recorder keeps what the engine did and gives it back: an in-memory
//! ring buffer, a durable log, replay, timelines, statistics, invariant
//! checks, exports and diffs.

pub mod analysis;
pub mod client;
pub mod columnar;
pub mod convert;
pub mod log;
pub mod protocol;
pub mod recorder;
pub mod ring;
pub mod server;
pub mod vllm;

pub use kvbm_schema::SCHEMA_VERSION;
