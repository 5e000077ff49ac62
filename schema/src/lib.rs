//! The wire and file format of kvbm events.
//!
//! This crate will hold the Rust generated from `schema/kvbm_events.fbs` by
//! `flatc` (the recorder issue). Until then it only names the schema version
//! the recorder will write, so that the dependency direction
//! `kvbm-recorder → kvbm-schema` is in place from the start.

/// Version of the event schema; bumped on every incompatible change.
pub const SCHEMA_VERSION: u32 = 0;
