//! kvbm-recorder keeps what the engine did and gives it back: an in-memory
//! ring buffer, a durable log, replay, timelines and exports.
//!
//! Not built yet: this crate is a placeholder so the workspace has its final
//! shape (see the recorder issue). It re-exports the schema version it will
//! write so the console can show it.

pub use kvbm_schema::SCHEMA_VERSION;
