//! `kvbm-schema`: the wire and file format of kvbm events.
//!
//! - [`fb`]: what `flatc` 25.12.19 generates from `schema/kvbm_events.fbs`
//!   (`src/generated/`, committed, rebuilt by `schema/regen.sh`; CI fails
//!   when the two drift apart): the [`fb::EventBlock`], which holds a run
//!   of events column by column (fixed-size kinds as rows of structs).
//! - [`columnar`]: a run of events to and from an `EventBlock`, the one
//!   encoding of events wherever they go: the durable log, NATS batches
//!   ([`nats::wire`]) and the attach protocol's frames ([`protocol`]).
//! - [`values`]: the enums, states and variable-size kinds the columns
//!   hold, to and from the schema's types.
//! - [`protocol`]: the attach protocol's messages and event frames.
//! - [`nats`]: the fleet's NATS batches and subjects.
//!
//! What must not live here: files, sockets, the block manager.

// The generated code is flatc's, byte for byte: the drift check compares it
// with a fresh generation, so neither rustfmt nor clippy may touch it, and
// the lints it trips (names that follow the schema, not Rust conventions,
// and code written for any schema) are allowed here rather than fixed.
#[rustfmt::skip]
#[allow(
    clippy::all,
    clippy::pedantic,
    dead_code,
    deprecated,
    missing_docs,
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    unused_imports,
    unsafe_op_in_unsafe_fn
)]
#[path = "generated/kvbm_events_generated.rs"]
mod generated;

pub mod columnar;
pub mod nats;
pub mod protocol;
pub mod values;

/// The generated flatbuffers types.
pub mod fb {
    pub use crate::generated::kvbm::events::*;
}

/// Version of the event schema this build writes; bumped whenever what a
/// log or a record may hold changes.
///
/// Blocks carry it in `EventBlock.schema_version`, whose default in the
/// schema is frozen at 1: version-1 blocks spend no bytes on it, and a
/// block of any later version stores its number explicitly.
///
/// - 1: the original kinds.
/// - 2: adds `PrefixLookup` (each request's block hashes at its first
///   lookup, for the capacity analysis). A version-1 log still reads: its
///   blocks simply hold no `PrefixLookup`, and a version-1 block that
///   claims one is refused as corrupt ([`values::kind_since_version`]).
pub const SCHEMA_VERSION: u32 = 2;

/// The oldest schema version this build reads.
pub const OLDEST_READABLE_VERSION: u32 = 1;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_schema() {
        assert_eq!(columnar::BLOCK_IDENTIFIER, fb::EVENT_BLOCK_IDENTIFIER);
        // The schema's default for `schema_version` must stay 1 (see the
        // .fbs); SCHEMA_VERSION may grow past it, never below.
        assert_eq!(fb::EventBlockArgs::default().schema_version, 1);
        const { assert!(SCHEMA_VERSION >= 1) };
    }
}
