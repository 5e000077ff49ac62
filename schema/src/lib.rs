//! `kvbm-schema`: the wire and file format of kvbm events.
//!
//! - [`fb`]: what `flatc` 25.12.19 generates from `schema/kvbm_events.fbs`
//!   (`src/generated/`, committed, rebuilt by `schema/regen.sh`; CI fails
//!   when the two drift apart): one flatbuffers record,
//!   [`fb::EventRecord`], per `kvbm_events::Event` (the envelope and an
//!   [`fb::EventKind`] union with one table per event kind), and one
//!   durable-log block, [`fb::EventBlock`], which holds a run of events
//!   column by column (fixed-size kinds as rows of structs).
//! - [`convert`]: one event to and from an `EventRecord`.
//! - [`columnar`]: a run of events to and from an `EventBlock`.
//! - [`protocol`]: the attach protocol's messages and event batches.
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
pub mod convert;
pub mod nats;
pub mod protocol;

/// The generated flatbuffers types.
pub mod fb {
    pub use crate::generated::kvbm::events::*;
}

/// Version of the event schema this build writes; bumped whenever what a
/// log or a record may hold changes.
///
/// Records carry it in `EventRecord.schema_version` (and log blocks in
/// `EventBlock.schema_version`), whose default in the schema is frozen at
/// 1: version-1 records spend no bytes on it, and a record of any later
/// version stores its number explicitly.
///
/// - 1: the original kinds.
/// - 2: adds `PrefixLookup` (each request's block hashes at its first
///   lookup, for the capacity analysis). A version-1 log still reads: its
///   blocks simply hold no `PrefixLookup`, and a version-1 block or record
///   that claims one is refused as corrupt
///   ([`convert::kind_since_version`]).
pub const SCHEMA_VERSION: u32 = 2;

/// The oldest schema version this build reads.
pub const OLDEST_READABLE_VERSION: u32 = 1;

/// The flatbuffers file identifier of an [`EventRecord`](fb::EventRecord) buffer (bytes 4..8).
pub const FILE_IDENTIFIER: &str = "KVBE";

#[cfg(test)]
mod tests {
    use super::fb::*;
    use super::*;

    #[test]
    fn constants_match_the_schema() {
        assert_eq!(FILE_IDENTIFIER, EVENT_RECORD_IDENTIFIER);
        // The schema's default for `schema_version` must stay 1 (see the
        // .fbs); SCHEMA_VERSION may grow past it, never below.
        assert_eq!(EventRecordArgs::default().schema_version, 1);
        const { assert!(SCHEMA_VERSION >= 1) };
    }

    #[test]
    fn a_minimal_record_round_trips_through_the_generated_code() {
        let mut fbb = flatbuffers::FlatBufferBuilder::new();
        let kind = SlotCreated::create(
            &mut fbb,
            &SlotCreatedArgs {
                prompt_tokens: 7,
                max_output_tokens: 3,
            },
        );
        let request = fbb.create_string("r-1");
        let rec = EventRecord::create(
            &mut fbb,
            &EventRecordArgs {
                seq: 5,
                request: Some(request),
                kind_type: EventKind::SlotCreated,
                kind: Some(kind.as_union_value()),
                ..Default::default()
            },
        );
        finish_event_record_buffer(&mut fbb, rec);
        let buf = fbb.finished_data();
        assert!(event_record_buffer_has_identifier(buf));
        let rec = root_as_event_record(buf).unwrap();
        assert_eq!(rec.schema_version(), 1);
        assert_eq!(rec.seq(), 5);
        assert_eq!(rec.request(), Some("r-1"));
        let created = rec.kind_as_slot_created().unwrap();
        assert_eq!(
            (created.prompt_tokens(), created.max_output_tokens()),
            (7, 3)
        );
    }
}
