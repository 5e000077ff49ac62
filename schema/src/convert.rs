//! Conversion between kvbm-core's [`Event`]s and the flatbuffers
//! [`EventRecord`](crate::fb::EventRecord)s of `schema/kvbm_events.fbs`,
//! one event per record: what the attach protocol sends. (The durable log
//! stores blocks of events column by column instead: [`crate::columnar`],
//! which shares this module's enum conversions.)
//!
//! - [`encode`] (or an [`Encoder`]) writes an event into a reused
//!   [`FlatBufferBuilder`] and returns the finished record, file identifier
//!   `KVBE` included. After the builder has grown to fit the largest event
//!   it has seen, encoding allocates nothing.
//! - [`decode`] takes untrusted bytes: it checks the length and the file
//!   identifier, runs the flatbuffers verifier with limits sized for one
//!   event ([`verify`]), then converts field by field ([`from_record`]).
//!   Anything the types cannot express — an unknown enum value or event
//!   kind, a missing kind, a token count on a state that has none, a newer
//!   schema version — is a typed [`DecodeError`], never a panic, so a reader
//!   can point at a corrupt record instead of dying on it.
//!
//! Decoding is exact: `decode(encode(e)) == e` for every event, and every
//! record that decodes re-encodes to a record that decodes to the same event.

use crate::fb;
use crate::{FILE_IDENTIFIER, OLDEST_READABLE_VERSION, SCHEMA_VERSION};
use flatbuffers::{
    FlatBufferBuilder, InvalidFlatbuffer, UnionWIPOffset, VerifierOptions, WIPOffset,
};
use kvbm_events::SequenceHash;
use kvbm_events::slot::SlotState;
use kvbm_events::tier::{BlockId, Tier};
use kvbm_events::{Direction, EntryPoint, Event, EventKind, HookPhase, KindTag, ResumeCause};
use std::sync::Arc;

/// The largest record [`decode`] accepts. Far above any real event (a
/// million-block allocation is 4 MiB) and small enough that a corrupt length
/// cannot make the verifier walk gigabytes.
pub const MAX_RECORD_BYTES: usize = 16 << 20;

/// The smallest buffer that can hold a root offset and a file identifier.
const MIN_RECORD_BYTES: usize = 8;

// SCHEMA_VERSION travels as a uint16; refuse to build if it ever outgrows it.
const _: () = assert!(SCHEMA_VERSION <= u16::MAX as u32);
const WRITE_VERSION: u16 = SCHEMA_VERSION as u16;

/// Verifier limits for one event. A record is two tables (the envelope and
/// its kind: slot states and directions are inline structs) and holds no
/// vector of tables, so tight bounds cost nothing on valid input and cap
/// the work a hostile one can cause. The slack leaves room for a few nested
/// tables in later schema versions.
const VERIFIER_OPTIONS: VerifierOptions = VerifierOptions {
    max_depth: 8,
    max_tables: 8,
    // The verifier adds up the size of every range it checks; for this
    // schema that is at most a small multiple of the record's length.
    max_apparent_size: 4 * MAX_RECORD_BYTES,
    ignore_missing_null_terminator: false,
};

/// Why bytes are not a valid event record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Shorter than a root offset and a file identifier.
    #[error("record too short: {len} bytes, at least {MIN_RECORD_BYTES} needed")]
    TooShort {
        /// The length given.
        len: usize,
    },
    /// Longer than [`MAX_RECORD_BYTES`].
    #[error("record too large: {len} bytes, at most {MAX_RECORD_BYTES} accepted")]
    TooLarge {
        /// The length given.
        len: usize,
    },
    /// Bytes 4..8 are not `KVBE`: not an event record at all.
    #[error(
        "not a kvbm event record: file identifier \"{}\", expected \"{FILE_IDENTIFIER}\"",
        found.escape_ascii()
    )]
    WrongIdentifier {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// The flatbuffers verifier refused the record (bad offset, out of
    /// bounds, missing required field, invalid UTF-8, too deep, ...).
    #[error("record fails flatbuffers verification: {0}")]
    Invalid(#[from] InvalidFlatbuffer),
    /// Written with a schema version this build cannot read.
    #[error(
        "record has schema version {found}, this build reads versions {OLDEST_READABLE_VERSION} to {SCHEMA_VERSION}"
    )]
    UnsupportedVersion {
        /// The version in the record.
        found: u16,
    },
    /// A kind that did not exist yet in the schema version the record (or
    /// block) says it was written with: corruption, not an old writer.
    #[error(
        "event kind {kind} is from schema version {since}, but the record says version {version}"
    )]
    KindNewerThanVersion {
        /// The kind.
        kind: &'static str,
        /// The version that introduced it.
        since: u16,
        /// The version written.
        version: u16,
    },
    /// The record has no event kind.
    #[error("record has no event kind")]
    MissingKind,
    /// An event kind this build does not know (a newer writer's, or
    /// corruption).
    #[error("unknown event kind {0}")]
    UnknownKind(u8),
    /// An enum field holds a value with no meaning.
    #[error("{field}: unknown {enum_name} value {value}")]
    UnknownEnum {
        /// The enum, as named in the schema.
        enum_name: &'static str,
        /// Where it was found (`Kind.field`).
        field: &'static str,
        /// The value.
        value: u8,
    },
    /// A slot state without a token count carries one.
    #[error("{field}: slot state {state} carries {tokens} tokens but takes none")]
    UnexpectedTokens {
        /// Where it was found.
        field: &'static str,
        /// The state's name.
        state: &'static str,
        /// The count found.
        tokens: u64,
    },
    /// A field that must be zero in this position (so that every event
    /// has one encoding) is not.
    #[error("{field}: {value} where only 0 is allowed")]
    UnexpectedValue {
        /// Where it was found.
        field: &'static str,
        /// The value found.
        value: u64,
    },
    /// A token count does not fit this platform's `usize`.
    #[error("{field}: token count {tokens} does not fit in usize")]
    TokensOverflow {
        /// Where it was found.
        field: &'static str,
        /// The count found.
        tokens: u64,
    },
}

/// A reusable encoder: one builder, grown once, reused for every event.
pub struct Encoder {
    fbb: FlatBufferBuilder<'static>,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder").finish_non_exhaustive()
    }
}

impl Default for Encoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Encoder {
    /// An encoder with a builder sized for typical events (a few hundred
    /// bytes); it grows when an event needs more and keeps that size.
    pub fn new() -> Self {
        Encoder {
            fbb: FlatBufferBuilder::with_capacity(256),
        }
    }

    /// Encodes `ev`; the bytes are valid until the next call.
    pub fn encode(&mut self, ev: &Event) -> &[u8] {
        encode(ev, &mut self.fbb)
    }
}

/// Encodes `ev` into `fbb` (reset first, so pass the same builder every
/// time) and returns the finished record, with the `KVBE` identifier.
pub fn encode<'b>(ev: &Event, fbb: &'b mut FlatBufferBuilder<'_>) -> &'b [u8] {
    fbb.reset();
    // Children first: a flatbuffers table can only point at objects that
    // were written before it.
    let request = ev.request.as_deref().map(|r| fbb.create_string(r));
    let kind = encode_kind(fbb, &ev.kind);
    let kind_type = kind_to_fb(ev.kind.tag());
    let root = fb::EventRecord::create(
        fbb,
        &fb::EventRecordArgs {
            // Equal to the schema's default today, so the builder leaves it
            // out; a later version differs and is written.
            schema_version: WRITE_VERSION,
            engine: ev.engine,
            seq: ev.seq,
            ts_ns: ev.ts_ns,
            iteration: ev.iteration,
            request,
            kind_type,
            kind: Some(kind),
        },
    );
    fbb.finish(root, Some(FILE_IDENTIFIER));
    fbb.finished_data()
}

/// Checks and converts one record: [`verify`] then [`from_record`].
pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    from_record(verify(bytes)?)
}

/// Checks the length and file identifier and runs the flatbuffers
/// verifier; the record it returns is safe to read but its values are not
/// yet checked against kvbm-core's types (that is [`from_record`]).
pub fn verify(bytes: &[u8]) -> Result<fb::EventRecord<'_>, DecodeError> {
    if bytes.len() < MIN_RECORD_BYTES {
        return Err(DecodeError::TooShort { len: bytes.len() });
    }
    if bytes.len() > MAX_RECORD_BYTES {
        return Err(DecodeError::TooLarge { len: bytes.len() });
    }
    // Checked by hand rather than with `buffer_has_identifier`, which
    // asserts on the length instead of reporting.
    let found: [u8; 4] = [bytes[4], bytes[5], bytes[6], bytes[7]];
    if found != *FILE_IDENTIFIER.as_bytes() {
        return Err(DecodeError::WrongIdentifier { found });
    }
    Ok(fb::root_as_event_record_with_opts(
        &VERIFIER_OPTIONS,
        bytes,
    )?)
}

/// Converts a verified record into an [`Event`], checking every value.
pub fn from_record(rec: fb::EventRecord<'_>) -> Result<Event, DecodeError> {
    let version = rec.schema_version();
    check_version(version)?;
    // Versions differ only by the kinds they know (version 2 added
    // PrefixLookup), so every readable version decodes the same way once
    // the kind is known to belong to it.
    if let Some(tag) = kind_from_fb(rec.kind_type()) {
        check_kind_version(tag, version)?;
    }
    Ok(Event {
        engine: rec.engine(),
        seq: rec.seq(),
        ts_ns: rec.ts_ns(),
        iteration: rec.iteration(),
        request: rec.request().map(Arc::<str>::from),
        kind: decode_kind(&rec)?,
    })
}

/// The schema version that introduced `tag`: 1 for the original kinds, 2
/// for [`PrefixLookup`](EventKind::PrefixLookup).
pub fn kind_since_version(tag: KindTag) -> u16 {
    match tag {
        KindTag::PrefixLookup => 2,
        _ => 1,
    }
}

/// Whether this build reads `version`.
pub(crate) fn check_version(version: u16) -> Result<(), DecodeError> {
    if u32::from(version) < OLDEST_READABLE_VERSION || u32::from(version) > SCHEMA_VERSION {
        return Err(DecodeError::UnsupportedVersion { found: version });
    }
    Ok(())
}

/// A kind must exist in the version its record claims.
pub(crate) fn check_kind_version(tag: KindTag, version: u16) -> Result<(), DecodeError> {
    let since = kind_since_version(tag);
    if since > version {
        return Err(DecodeError::KindNewerThanVersion {
            kind: tag.name(),
            since,
            version,
        });
    }
    Ok(())
}

// ------------------------------------------------------------- encoding

fn encode_kind(fbb: &mut FlatBufferBuilder<'_>, kind: &EventKind) -> WIPOffset<UnionWIPOffset> {
    // Exhaustive: every kind this build declares is encoded here, each by
    // the function that builds its table.
    match kind {
        EventKind::SlotCreated {
            prompt_tokens,
            max_output_tokens,
        } => slot_created_table(fbb, *prompt_tokens, *max_output_tokens).as_union_value(),
        EventKind::SlotTransition { from, to } => {
            slot_transition_table(fbb, *from, *to).as_union_value()
        }
        EventKind::MatchResult {
            tier,
            looked_up,
            hit_blocks,
            hit_tokens,
        } => match_result_table(fbb, *tier, *looked_up, *hit_blocks, *hit_tokens).as_union_value(),
        EventKind::BlocksAllocated { tier, blocks } => {
            blocks_allocated_table(fbb, *tier, blocks).as_union_value()
        }
        EventKind::BlocksReleased { tier, count } => {
            blocks_released_table(fbb, *tier, *count).as_union_value()
        }
        EventKind::BlockRegistered {
            tier,
            block,
            sequence_hash,
            duplicate_of,
        } => block_registered_table(fbb, *tier, *block, *sequence_hash, *duplicate_of)
            .as_union_value(),
        EventKind::BlockEvicted {
            tier,
            block,
            sequence_hash,
        } => block_evicted_table(fbb, *tier, *block, *sequence_hash).as_union_value(),
        EventKind::TransferPlanned {
            transfer,
            direction,
            blocks,
        } => transfer_planned_table(fbb, *transfer, *direction, *blocks).as_union_value(),
        EventKind::TransferPromoted {
            transfer,
            direction,
            blocks,
        } => transfer_promoted_table(fbb, *transfer, *direction, *blocks).as_union_value(),
        EventKind::TransferSkipped {
            transfer,
            direction,
            reason,
        } => transfer_skipped_table(fbb, *transfer, *direction, reason).as_union_value(),
        EventKind::TransferCancelled {
            transfer,
            direction,
        } => transfer_cancelled_table(fbb, *transfer, *direction).as_union_value(),
        EventKind::TransferCompleted {
            transfer,
            direction,
            blocks,
        } => transfer_completed_table(fbb, *transfer, *direction, *blocks).as_union_value(),
        EventKind::TransferFailed {
            transfer,
            direction,
            error,
        } => transfer_failed_table(fbb, *transfer, *direction, error).as_union_value(),
        EventKind::BatchDispatched {
            batch,
            direction,
            transfers,
            blocks,
        } => batch_dispatched_table(fbb, *batch, *direction, transfers, *blocks).as_union_value(),
        EventKind::BatchCompleted {
            batch,
            direction,
            ok,
            blocks,
            bytes,
            elapsed_ns,
        } => batch_completed_table(fbb, *batch, *direction, *ok, *blocks, *bytes, *elapsed_ns)
            .as_union_value(),
        EventKind::PoolGauge {
            tier,
            capacity,
            active,
            inactive,
            empty,
        } => pool_gauge_table(fbb, *tier, *capacity, *active, *inactive, *empty).as_union_value(),
        EventKind::HookCall { entry, phase } => {
            hook_call_table(fbb, *entry, *phase).as_union_value()
        }
        EventKind::BreakpointHit {
            breakpoint,
            entry,
            deadline_ns,
        } => breakpoint_hit_table(fbb, *breakpoint, *entry, *deadline_ns).as_union_value(),
        EventKind::Resumed { breakpoint, cause } => {
            resumed_table(fbb, *breakpoint, *cause).as_union_value()
        }
        EventKind::TokensScheduled {
            prefill,
            decode,
            computed,
        } => tokens_scheduled_table(fbb, *prefill, *decode, *computed).as_union_value(),
        EventKind::PrefixLookup {
            tokens,
            block_size,
            computed_blocks,
            hashes,
        } => prefix_lookup_table(fbb, *tokens, *block_size, *computed_blocks, hashes)
            .as_union_value(),
    }
}

// One function per kind builds its table for [`encode_kind`]. The kinds
// that carry a list or free text are tables in a block too, and
// `crate::columnar` builds those with the same functions.

/// Builds the `SlotCreated` table of a record.
fn slot_created_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    prompt_tokens: u32,
    max_output_tokens: u32,
) -> WIPOffset<fb::SlotCreated<'a>> {
    let args = fb::SlotCreatedArgs {
        prompt_tokens,
        max_output_tokens,
    };
    fb::SlotCreated::create(fbb, &args)
}

/// Builds the `SlotTransition` table of a record.
fn slot_transition_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    from: SlotState,
    to: SlotState,
) -> WIPOffset<fb::SlotTransition<'a>> {
    let from = encode_state(from);
    let to = encode_state(to);
    let args = fb::SlotTransitionArgs {
        from: Some(&from),
        to: Some(&to),
    };
    fb::SlotTransition::create(fbb, &args)
}

/// Builds the `MatchResult` table of a record.
fn match_result_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    tier: Tier,
    looked_up: u32,
    hit_blocks: u32,
    hit_tokens: u32,
) -> WIPOffset<fb::MatchResult<'a>> {
    let args = fb::MatchResultArgs {
        tier: tier_to_fb(tier),
        looked_up,
        hit_blocks,
        hit_tokens,
    };
    fb::MatchResult::create(fbb, &args)
}

/// Builds the `BlocksAllocated` table of a record, or of a block (where the kind
/// is a table too).
pub(crate) fn blocks_allocated_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    tier: Tier,
    blocks: &[BlockId],
) -> WIPOffset<fb::BlocksAllocated<'a>> {
    let blocks = fbb.create_vector(blocks);
    let args = fb::BlocksAllocatedArgs {
        tier: tier_to_fb(tier),
        blocks: Some(blocks),
    };
    fb::BlocksAllocated::create(fbb, &args)
}

/// Builds the `BlocksReleased` table of a record.
fn blocks_released_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    tier: Tier,
    count: u32,
) -> WIPOffset<fb::BlocksReleased<'a>> {
    let args = fb::BlocksReleasedArgs {
        tier: tier_to_fb(tier),
        count,
    };
    fb::BlocksReleased::create(fbb, &args)
}

/// Builds the `BlockRegistered` table of a record.
fn block_registered_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    tier: Tier,
    block: BlockId,
    sequence_hash: SequenceHash,
    duplicate_of: Option<BlockId>,
) -> WIPOffset<fb::BlockRegistered<'a>> {
    let args = fb::BlockRegisteredArgs {
        tier: tier_to_fb(tier),
        block,
        sequence_hash: sequence_hash.0,
        duplicate_of,
    };
    fb::BlockRegistered::create(fbb, &args)
}

/// Builds the `BlockEvicted` table of a record.
fn block_evicted_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    tier: Tier,
    block: BlockId,
    sequence_hash: SequenceHash,
) -> WIPOffset<fb::BlockEvicted<'a>> {
    let args = fb::BlockEvictedArgs {
        tier: tier_to_fb(tier),
        block,
        sequence_hash: sequence_hash.0,
    };
    fb::BlockEvicted::create(fbb, &args)
}

/// Builds the `TransferPlanned` table of a record.
fn transfer_planned_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    transfer: u64,
    direction: Direction,
    blocks: u32,
) -> WIPOffset<fb::TransferPlanned<'a>> {
    let d = direction_to_fb(direction);
    let args = fb::TransferPlannedArgs {
        transfer,
        direction: Some(&d),
        blocks,
    };
    fb::TransferPlanned::create(fbb, &args)
}

/// Builds the `TransferPromoted` table of a record.
fn transfer_promoted_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    transfer: u64,
    direction: Direction,
    blocks: u32,
) -> WIPOffset<fb::TransferPromoted<'a>> {
    let d = direction_to_fb(direction);
    let args = fb::TransferPromotedArgs {
        transfer,
        direction: Some(&d),
        blocks,
    };
    fb::TransferPromoted::create(fbb, &args)
}

/// Builds the `TransferSkipped` table of a record, or of a block (where the kind
/// is a table too).
pub(crate) fn transfer_skipped_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    transfer: u64,
    direction: Direction,
    reason: &str,
) -> WIPOffset<fb::TransferSkipped<'a>> {
    let reason = fbb.create_string(reason);
    let d = direction_to_fb(direction);
    let args = fb::TransferSkippedArgs {
        transfer,
        direction: Some(&d),
        reason: Some(reason),
    };
    fb::TransferSkipped::create(fbb, &args)
}

/// Builds the `TransferCancelled` table of a record.
fn transfer_cancelled_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    transfer: u64,
    direction: Direction,
) -> WIPOffset<fb::TransferCancelled<'a>> {
    let d = direction_to_fb(direction);
    let args = fb::TransferCancelledArgs {
        transfer,
        direction: Some(&d),
    };
    fb::TransferCancelled::create(fbb, &args)
}

/// Builds the `TransferCompleted` table of a record.
fn transfer_completed_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    transfer: u64,
    direction: Direction,
    blocks: u32,
) -> WIPOffset<fb::TransferCompleted<'a>> {
    let d = direction_to_fb(direction);
    let args = fb::TransferCompletedArgs {
        transfer,
        direction: Some(&d),
        blocks,
    };
    fb::TransferCompleted::create(fbb, &args)
}

/// Builds the `TransferFailed` table of a record, or of a block (where the kind
/// is a table too).
pub(crate) fn transfer_failed_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    transfer: u64,
    direction: Direction,
    error: &str,
) -> WIPOffset<fb::TransferFailed<'a>> {
    let error = fbb.create_string(error);
    let d = direction_to_fb(direction);
    let args = fb::TransferFailedArgs {
        transfer,
        direction: Some(&d),
        error: Some(error),
    };
    fb::TransferFailed::create(fbb, &args)
}

/// Builds the `BatchDispatched` table of a record, or of a block (where the kind
/// is a table too).
pub(crate) fn batch_dispatched_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    batch: u64,
    direction: Direction,
    transfers: &[u64],
    blocks: u32,
) -> WIPOffset<fb::BatchDispatched<'a>> {
    let transfers = fbb.create_vector(transfers);
    let d = direction_to_fb(direction);
    let args = fb::BatchDispatchedArgs {
        batch,
        direction: Some(&d),
        transfers: Some(transfers),
        blocks,
    };
    fb::BatchDispatched::create(fbb, &args)
}

/// Builds the `BatchCompleted` table of a record.
fn batch_completed_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    batch: u64,
    direction: Direction,
    ok: bool,
    blocks: u32,
    bytes: u64,
    elapsed_ns: u64,
) -> WIPOffset<fb::BatchCompleted<'a>> {
    let d = direction_to_fb(direction);
    let args = fb::BatchCompletedArgs {
        batch,
        direction: Some(&d),
        ok,
        blocks,
        bytes,
        elapsed_ns,
    };
    fb::BatchCompleted::create(fbb, &args)
}

/// Builds the `PoolGauge` table of a record.
fn pool_gauge_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    tier: Tier,
    capacity: u32,
    active: u32,
    inactive: u32,
    empty: u32,
) -> WIPOffset<fb::PoolGauge<'a>> {
    let args = fb::PoolGaugeArgs {
        tier: tier_to_fb(tier),
        capacity,
        active,
        inactive,
        empty,
    };
    fb::PoolGauge::create(fbb, &args)
}

/// Builds the `HookCall` table of a record.
fn hook_call_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    entry: EntryPoint,
    phase: HookPhase,
) -> WIPOffset<fb::HookCall<'a>> {
    let args = fb::HookCallArgs {
        entry: entry_to_fb(entry),
        phase: phase_to_fb(phase),
    };
    fb::HookCall::create(fbb, &args)
}

/// Builds the `BreakpointHit` table of a record.
fn breakpoint_hit_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    breakpoint: u64,
    entry: EntryPoint,
    deadline_ns: u64,
) -> WIPOffset<fb::BreakpointHit<'a>> {
    let args = fb::BreakpointHitArgs {
        breakpoint,
        entry: entry_to_fb(entry),
        deadline_ns,
    };
    fb::BreakpointHit::create(fbb, &args)
}

/// Builds the `Resumed` table of a record.
fn resumed_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    breakpoint: u64,
    cause: ResumeCause,
) -> WIPOffset<fb::Resumed<'a>> {
    let args = fb::ResumedArgs {
        breakpoint,
        cause: cause_to_fb(cause),
    };
    fb::Resumed::create(fbb, &args)
}

/// Builds the `TokensScheduled` table of a record.
fn tokens_scheduled_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    prefill: u32,
    decode: u32,
    computed: u32,
) -> WIPOffset<fb::TokensScheduled<'a>> {
    let args = fb::TokensScheduledArgs {
        prefill,
        decode,
        computed,
    };
    fb::TokensScheduled::create(fbb, &args)
}

/// Builds the `PrefixLookup` table of a record, or of a block (where the kind
/// is a table too).
pub(crate) fn prefix_lookup_table<'a>(
    fbb: &mut FlatBufferBuilder<'a>,
    tokens: u32,
    block_size: u32,
    computed_blocks: u32,
    hashes: &[SequenceHash],
) -> WIPOffset<fb::PrefixLookup<'a>> {
    fbb.start_vector::<u64>(hashes.len());
    for h in hashes.iter().rev() {
        fbb.push(h.0);
    }
    let hashes = fbb.end_vector(hashes.len());
    let args = fb::PrefixLookupArgs {
        tokens,
        block_size,
        computed_blocks,
        hashes: Some(hashes),
    };
    fb::PrefixLookup::create(fbb, &args)
}

/// The schema's `EventKind` union value of a kind: the union lists the
/// kinds in the order they are declared in `kvbm_events` (after `NONE`, 0);
/// a test checks that the names agree.
pub fn kind_to_fb(tag: KindTag) -> fb::EventKind {
    fb::EventKind(tag.index() as u8 + 1)
}

/// The kind of a union value; `None` for `NONE` and for a kind this build
/// does not know.
pub fn kind_from_fb(kind: fb::EventKind) -> Option<KindTag> {
    kind.0
        .checked_sub(1)
        .and_then(|i| KindTag::from_index(usize::from(i)))
}

pub(crate) fn encode_state(s: SlotState) -> fb::SlotState {
    use fb::SlotStateKind as S;
    let (state, tokens) = match s {
        SlotState::Initialized => (S::Initialized, 0),
        // usize is at most 64 bits on every target Rust supports, so the
        // count is carried losslessly.
        SlotState::OnboardStaged(n) => (S::OnboardStaged, n as u64),
        SlotState::Onboarding(n) => (S::Onboarding, n as u64),
        SlotState::Prefilling => (S::Prefilling, 0),
        SlotState::Decoding => (S::Decoding, 0),
        SlotState::SkippedPrefill => (S::SkippedPrefill, 0),
        SlotState::SkippedDecode => (S::SkippedDecode, 0),
        SlotState::Preempted => (S::Preempted, 0),
        SlotState::Finishing => (S::Finishing, 0),
        SlotState::Finished => (S::Finished, 0),
    };
    fb::SlotState::new(state, tokens)
}

pub(crate) fn tier_to_fb(t: Tier) -> fb::Tier {
    match t {
        Tier::Device => fb::Tier::Device,
        Tier::Host => fb::Tier::Host,
        Tier::Disk => fb::Tier::Disk,
    }
}

pub(crate) fn direction_to_fb(d: Direction) -> fb::Direction {
    fb::Direction::new(tier_to_fb(d.src), tier_to_fb(d.dst))
}

pub(crate) fn entry_to_fb(e: EntryPoint) -> fb::EntryPoint {
    match e {
        EntryPoint::CreateSlot => fb::EntryPoint::CreateSlot,
        EntryPoint::GetNumNewMatchedTokens => fb::EntryPoint::GetNumNewMatchedTokens,
        EntryPoint::UpdateStateAfterAlloc => fb::EntryPoint::UpdateStateAfterAlloc,
        EntryPoint::BuildConnectorMetadata => fb::EntryPoint::BuildConnectorMetadata,
        EntryPoint::RequestFinished => fb::EntryPoint::RequestFinished,
        EntryPoint::TransferExecute => fb::EntryPoint::TransferExecute,
    }
}

pub(crate) fn phase_to_fb(p: HookPhase) -> fb::HookPhase {
    match p {
        HookPhase::Will => fb::HookPhase::Will,
        HookPhase::Finished => fb::HookPhase::Finished,
    }
}

pub(crate) fn cause_to_fb(c: ResumeCause) -> fb::ResumeCause {
    match c {
        ResumeCause::Resume => fb::ResumeCause::Resume,
        ResumeCause::Step => fb::ResumeCause::Step,
        ResumeCause::Deadline => fb::ResumeCause::Deadline,
        ResumeCause::Cleared => fb::ResumeCause::Cleared,
        ResumeCause::ClientGone => fb::ResumeCause::ClientGone,
    }
}

// ------------------------------------------------------------- decoding
//
// The verifier has already checked every offset, length, string and
// required field it knows of, so the generated accessors cannot fail here;
// what is left is the values themselves, and not following the one offset
// the verifier leaves unchecked (a union value whose type it does not know).

fn decode_kind(rec: &fb::EventRecord<'_>) -> Result<EventKind, DecodeError> {
    let ty = rec.kind_type();
    // Decided from the type byte alone, before the value is touched: the
    // verifier checks the value only for the kinds it knows, so for NONE
    // (which a corrupt record may pair with a value anyway) and for an
    // unknown kind the value's offset is unchecked and must not be followed.
    if ty == fb::EventKind::NONE {
        return Err(DecodeError::MissingKind);
    }
    let tag = kind_from_fb(ty).ok_or(DecodeError::UnknownKind(ty.0))?;
    // For a known kind the verifier has checked that the value is there and
    // is a table of that kind, so each arm's accessor returns Some.
    let missing = || DecodeError::MissingKind;
    // Exhaustive: every kind this build declares is decoded here; the
    // transfer and batch kinds, and the kinds a block stores as tables too,
    // by a function each.
    Ok(match tag {
        KindTag::SlotCreated => {
            let t = rec.kind_as_slot_created().ok_or_else(missing)?;
            EventKind::SlotCreated {
                prompt_tokens: t.prompt_tokens(),
                max_output_tokens: t.max_output_tokens(),
            }
        }
        KindTag::SlotTransition => {
            let t = rec.kind_as_slot_transition().ok_or_else(missing)?;
            EventKind::SlotTransition {
                from: decode_state(t.from(), "SlotTransition.from")?,
                to: decode_state(t.to(), "SlotTransition.to")?,
            }
        }
        KindTag::MatchResult => {
            let t = rec.kind_as_match_result().ok_or_else(missing)?;
            EventKind::MatchResult {
                tier: tier_from_fb(t.tier(), "MatchResult.tier")?,
                looked_up: t.looked_up(),
                hit_blocks: t.hit_blocks(),
                hit_tokens: t.hit_tokens(),
            }
        }
        KindTag::BlocksAllocated => {
            blocks_allocated_from_fb(rec.kind_as_blocks_allocated().ok_or_else(missing)?)?
        }
        KindTag::BlocksReleased => {
            let t = rec.kind_as_blocks_released().ok_or_else(missing)?;
            EventKind::BlocksReleased {
                tier: tier_from_fb(t.tier(), "BlocksReleased.tier")?,
                count: t.count(),
            }
        }
        KindTag::BlockRegistered => {
            let t = rec.kind_as_block_registered().ok_or_else(missing)?;
            EventKind::BlockRegistered {
                tier: tier_from_fb(t.tier(), "BlockRegistered.tier")?,
                block: t.block(),
                sequence_hash: SequenceHash(t.sequence_hash()),
                duplicate_of: t.duplicate_of(),
            }
        }
        KindTag::BlockEvicted => {
            let t = rec.kind_as_block_evicted().ok_or_else(missing)?;
            EventKind::BlockEvicted {
                tier: tier_from_fb(t.tier(), "BlockEvicted.tier")?,
                block: t.block(),
                sequence_hash: SequenceHash(t.sequence_hash()),
            }
        }
        KindTag::TransferPlanned => {
            transfer_planned_from_fb(rec.kind_as_transfer_planned().ok_or_else(missing)?)?
        }
        KindTag::TransferPromoted => {
            transfer_promoted_from_fb(rec.kind_as_transfer_promoted().ok_or_else(missing)?)?
        }
        KindTag::TransferSkipped => {
            transfer_skipped_from_fb(rec.kind_as_transfer_skipped().ok_or_else(missing)?)?
        }
        KindTag::TransferCancelled => {
            transfer_cancelled_from_fb(rec.kind_as_transfer_cancelled().ok_or_else(missing)?)?
        }
        KindTag::TransferCompleted => {
            transfer_completed_from_fb(rec.kind_as_transfer_completed().ok_or_else(missing)?)?
        }
        KindTag::TransferFailed => {
            transfer_failed_from_fb(rec.kind_as_transfer_failed().ok_or_else(missing)?)?
        }
        KindTag::BatchDispatched => {
            batch_dispatched_from_fb(rec.kind_as_batch_dispatched().ok_or_else(missing)?)?
        }
        KindTag::BatchCompleted => {
            batch_completed_from_fb(rec.kind_as_batch_completed().ok_or_else(missing)?)?
        }
        KindTag::PoolGauge => {
            let t = rec.kind_as_pool_gauge().ok_or_else(missing)?;
            EventKind::PoolGauge {
                tier: tier_from_fb(t.tier(), "PoolGauge.tier")?,
                capacity: t.capacity(),
                active: t.active(),
                inactive: t.inactive(),
                empty: t.empty(),
            }
        }
        KindTag::HookCall => {
            let t = rec.kind_as_hook_call().ok_or_else(missing)?;
            EventKind::HookCall {
                entry: entry_from_fb(t.entry(), "HookCall.entry")?,
                phase: phase_from_fb(t.phase(), "HookCall.phase")?,
            }
        }
        KindTag::BreakpointHit => {
            let t = rec.kind_as_breakpoint_hit().ok_or_else(missing)?;
            EventKind::BreakpointHit {
                breakpoint: t.breakpoint(),
                entry: entry_from_fb(t.entry(), "BreakpointHit.entry")?,
                deadline_ns: t.deadline_ns(),
            }
        }
        KindTag::Resumed => {
            let t = rec.kind_as_resumed().ok_or_else(missing)?;
            EventKind::Resumed {
                breakpoint: t.breakpoint(),
                cause: cause_from_fb(t.cause(), "Resumed.cause")?,
            }
        }
        KindTag::TokensScheduled => {
            let t = rec.kind_as_tokens_scheduled().ok_or_else(missing)?;
            EventKind::TokensScheduled {
                prefill: t.prefill(),
                decode: t.decode(),
                computed: t.computed(),
            }
        }
        KindTag::PrefixLookup => {
            prefix_lookup_from_fb(rec.kind_as_prefix_lookup().ok_or_else(missing)?)?
        }
    })
}

/// Decodes a `BlocksAllocated` table, of a record or of a block (where the kind is a table
/// too).
pub(crate) fn blocks_allocated_from_fb(
    t: fb::BlocksAllocated<'_>,
) -> Result<EventKind, DecodeError> {
    Ok(EventKind::BlocksAllocated {
        tier: tier_from_fb(t.tier(), "BlocksAllocated.tier")?,
        blocks: t.blocks().iter().collect(),
    })
}

/// Decodes a `TransferPlanned` table of a record.
fn transfer_planned_from_fb(t: fb::TransferPlanned<'_>) -> Result<EventKind, DecodeError> {
    Ok(EventKind::TransferPlanned {
        transfer: t.transfer(),
        direction: direction_from_fb(t.direction(), "TransferPlanned.direction")?,
        blocks: t.blocks(),
    })
}

/// Decodes a `TransferPromoted` table of a record.
fn transfer_promoted_from_fb(t: fb::TransferPromoted<'_>) -> Result<EventKind, DecodeError> {
    Ok(EventKind::TransferPromoted {
        transfer: t.transfer(),
        direction: direction_from_fb(t.direction(), "TransferPromoted.direction")?,
        blocks: t.blocks(),
    })
}

/// Decodes a `TransferSkipped` table, of a record or of a block (where the kind is a table
/// too).
pub(crate) fn transfer_skipped_from_fb(
    t: fb::TransferSkipped<'_>,
) -> Result<EventKind, DecodeError> {
    Ok(EventKind::TransferSkipped {
        transfer: t.transfer(),
        direction: direction_from_fb(t.direction(), "TransferSkipped.direction")?,
        reason: t.reason().to_owned(),
    })
}

/// Decodes a `TransferCancelled` table of a record.
fn transfer_cancelled_from_fb(t: fb::TransferCancelled<'_>) -> Result<EventKind, DecodeError> {
    Ok(EventKind::TransferCancelled {
        transfer: t.transfer(),
        direction: direction_from_fb(t.direction(), "TransferCancelled.direction")?,
    })
}

/// Decodes a `TransferCompleted` table of a record.
fn transfer_completed_from_fb(t: fb::TransferCompleted<'_>) -> Result<EventKind, DecodeError> {
    Ok(EventKind::TransferCompleted {
        transfer: t.transfer(),
        direction: direction_from_fb(t.direction(), "TransferCompleted.direction")?,
        blocks: t.blocks(),
    })
}

/// Decodes a `TransferFailed` table, of a record or of a block (where the kind is a table
/// too).
pub(crate) fn transfer_failed_from_fb(t: fb::TransferFailed<'_>) -> Result<EventKind, DecodeError> {
    Ok(EventKind::TransferFailed {
        transfer: t.transfer(),
        direction: direction_from_fb(t.direction(), "TransferFailed.direction")?,
        error: t.error().to_owned(),
    })
}

/// Decodes a `BatchDispatched` table, of a record or of a block (where the kind is a table
/// too).
pub(crate) fn batch_dispatched_from_fb(
    t: fb::BatchDispatched<'_>,
) -> Result<EventKind, DecodeError> {
    Ok(EventKind::BatchDispatched {
        batch: t.batch(),
        direction: direction_from_fb(t.direction(), "BatchDispatched.direction")?,
        transfers: t.transfers().iter().collect(),
        blocks: t.blocks(),
    })
}

/// Decodes a `BatchCompleted` table of a record.
fn batch_completed_from_fb(t: fb::BatchCompleted<'_>) -> Result<EventKind, DecodeError> {
    Ok(EventKind::BatchCompleted {
        batch: t.batch(),
        direction: direction_from_fb(t.direction(), "BatchCompleted.direction")?,
        ok: t.ok(),
        blocks: t.blocks(),
        bytes: t.bytes(),
        elapsed_ns: t.elapsed_ns(),
    })
}

/// Decodes a `PrefixLookup` table, of a record or of a block (where the kind is a table
/// too).
pub(crate) fn prefix_lookup_from_fb(t: fb::PrefixLookup<'_>) -> Result<EventKind, DecodeError> {
    Ok(EventKind::PrefixLookup {
        tokens: t.tokens(),
        block_size: t.block_size(),
        computed_blocks: t.computed_blocks(),
        hashes: t.hashes().iter().map(SequenceHash).collect(),
    })
}

pub(crate) fn decode_state(
    s: &fb::SlotState,
    field: &'static str,
) -> Result<SlotState, DecodeError> {
    use fb::SlotStateKind as S;
    let tokens = s.tokens();
    let count =
        || usize::try_from(tokens).map_err(|_| DecodeError::TokensOverflow { field, tokens });
    let state = match s.state() {
        S::Initialized => SlotState::Initialized,
        S::OnboardStaged => return Ok(SlotState::OnboardStaged(count()?)),
        S::Onboarding => return Ok(SlotState::Onboarding(count()?)),
        S::Prefilling => SlotState::Prefilling,
        S::Decoding => SlotState::Decoding,
        S::SkippedPrefill => SlotState::SkippedPrefill,
        S::SkippedDecode => SlotState::SkippedDecode,
        S::Preempted => SlotState::Preempted,
        S::Finishing => SlotState::Finishing,
        S::Finished => SlotState::Finished,
        other => {
            return Err(DecodeError::UnknownEnum {
                enum_name: "SlotStateKind",
                field,
                value: other.0,
            });
        }
    };
    // One encoding per state: a count on a state that has none is
    // corruption, not something to drop silently.
    if tokens != 0 {
        return Err(DecodeError::UnexpectedTokens {
            field,
            state: state.name(),
            tokens,
        });
    }
    Ok(state)
}

pub(crate) fn tier_from_fb(t: fb::Tier, field: &'static str) -> Result<Tier, DecodeError> {
    match t {
        fb::Tier::Device => Ok(Tier::Device),
        fb::Tier::Host => Ok(Tier::Host),
        fb::Tier::Disk => Ok(Tier::Disk),
        other => Err(DecodeError::UnknownEnum {
            enum_name: "Tier",
            field,
            value: other.0,
        }),
    }
}

pub(crate) fn direction_from_fb(
    d: &fb::Direction,
    field: &'static str,
) -> Result<Direction, DecodeError> {
    Ok(Direction {
        src: tier_from_fb(d.src(), field)?,
        dst: tier_from_fb(d.dst(), field)?,
    })
}

pub(crate) fn entry_from_fb(
    e: fb::EntryPoint,
    field: &'static str,
) -> Result<EntryPoint, DecodeError> {
    match e {
        fb::EntryPoint::CreateSlot => Ok(EntryPoint::CreateSlot),
        fb::EntryPoint::GetNumNewMatchedTokens => Ok(EntryPoint::GetNumNewMatchedTokens),
        fb::EntryPoint::UpdateStateAfterAlloc => Ok(EntryPoint::UpdateStateAfterAlloc),
        fb::EntryPoint::BuildConnectorMetadata => Ok(EntryPoint::BuildConnectorMetadata),
        fb::EntryPoint::RequestFinished => Ok(EntryPoint::RequestFinished),
        fb::EntryPoint::TransferExecute => Ok(EntryPoint::TransferExecute),
        other => Err(DecodeError::UnknownEnum {
            enum_name: "EntryPoint",
            field,
            value: other.0,
        }),
    }
}

pub(crate) fn phase_from_fb(
    p: fb::HookPhase,
    field: &'static str,
) -> Result<HookPhase, DecodeError> {
    match p {
        fb::HookPhase::Will => Ok(HookPhase::Will),
        fb::HookPhase::Finished => Ok(HookPhase::Finished),
        other => Err(DecodeError::UnknownEnum {
            enum_name: "HookPhase",
            field,
            value: other.0,
        }),
    }
}

pub(crate) fn cause_from_fb(
    c: fb::ResumeCause,
    field: &'static str,
) -> Result<ResumeCause, DecodeError> {
    match c {
        fb::ResumeCause::Resume => Ok(ResumeCause::Resume),
        fb::ResumeCause::Step => Ok(ResumeCause::Step),
        fb::ResumeCause::Deadline => Ok(ResumeCause::Deadline),
        fb::ResumeCause::Cleared => Ok(ResumeCause::Cleared),
        fb::ResumeCause::ClientGone => Ok(ResumeCause::ClientGone),
        other => Err(DecodeError::UnknownEnum {
            enum_name: "ResumeCause",
            field,
            value: other.0,
        }),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    pub(crate) use kvbm_events::testing::{event, sample_events};

    /// A corruption of a valid record.
    #[derive(Debug, Clone)]
    pub(crate) enum Mutation {
        /// XOR these bytes at these positions (taken modulo the length).
        Flip(Vec<(usize, u8)>),
        /// Keep only this many bytes (modulo the length).
        Truncate(usize),
        /// Append these bytes.
        Extend(Vec<u8>),
        /// Overwrite a little-endian u32 (an offset or a length, likely) at
        /// this position.
        Offset(usize, u32),
    }

    pub(crate) fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            vec((any::<usize>(), 1..=255u8), 1..6).prop_map(Mutation::Flip),
            any::<usize>().prop_map(Mutation::Truncate),
            vec(any::<u8>(), 1..32).prop_map(Mutation::Extend),
            (any::<usize>(), any::<u32>()).prop_map(|(at, v)| Mutation::Offset(at, v)),
        ]
    }

    pub(crate) fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
        let len = bytes.len();
        match m {
            Mutation::Flip(flips) => {
                for (at, x) in flips {
                    bytes[at % len] ^= x;
                }
            }
            Mutation::Truncate(n) => bytes.truncate(n % len),
            Mutation::Extend(more) => bytes.extend_from_slice(more),
            Mutation::Offset(at, v) => {
                let at = at % (len - 3);
                bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
    }

    /// What every decode must satisfy: no panic (proptest reports one as a
    /// failure), a readable error, and anything accepted is a real event
    /// that survives another round trip unchanged.
    fn check_decode(bytes: &[u8], fbb: &mut FlatBufferBuilder<'_>) -> Result<(), TestCaseError> {
        match decode(bytes) {
            Ok(ev) => {
                let again = encode(&ev, fbb).to_vec();
                prop_assert_eq!(decode(&again), Ok(ev));
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        Ok(())
    }

    // ------------------------------------------------------------ tests

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn any_event_round_trips(ev in event()) {
            let mut fbb = FlatBufferBuilder::new();
            let bytes = encode(&ev, &mut fbb).to_vec();
            prop_assert_eq!(&bytes[4..8], FILE_IDENTIFIER.as_bytes());
            prop_assert_eq!(decode(&bytes), Ok(ev.clone()));
            // The same builder again, after an unrelated event: reuse must
            // not leak anything from the previous record.
            encode(&sample_events()[3], &mut fbb);
            prop_assert_eq!(decode(encode(&ev, &mut fbb)), Ok(ev));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        #[test]
        fn random_bytes_never_panic(
            mut bytes in vec(any::<u8>(), 0..256),
            with_identifier in any::<bool>(),
        ) {
            // Half the cases carry the right identifier so that they reach
            // the verifier instead of stopping at the identifier check.
            if with_identifier && bytes.len() >= 8 {
                bytes[4..8].copy_from_slice(FILE_IDENTIFIER.as_bytes());
            }
            check_decode(&bytes, &mut FlatBufferBuilder::new())?;
        }

        #[test]
        fn mutated_records_never_panic(ev in event(), muts in vec(mutation(), 1..4)) {
            let mut fbb = FlatBufferBuilder::new();
            let mut bytes = encode(&ev, &mut fbb).to_vec();
            for m in &muts {
                if bytes.len() < 8 {
                    break;
                }
                apply(&mut bytes, m);
            }
            check_decode(&bytes, &mut fbb)?;
        }
    }

    /// One event of every kind, with values that are not the defaults (so
    /// every field is actually stored).
    #[test]
    fn every_kind_in_the_schema_is_converted_both_ways() {
        // The union lists the kinds in declaration order, under their names.
        for &tag in KindTag::ALL {
            assert_eq!(kind_to_fb(tag).variant_name(), Some(tag.name()));
            assert_eq!(kind_from_fb(kind_to_fb(tag)), Some(tag));
        }
        assert_eq!(kind_from_fb(fb::EventKind::NONE), None);
        let mut enc = Encoder::new();
        let mut seen = BTreeSet::new();
        for ev in sample_events() {
            let bytes = enc.encode(&ev).to_vec();
            seen.insert(verify(&bytes).unwrap().kind_type().0);
            assert_eq!(decode(&bytes), Ok(ev));
        }
        // A kind added to the union but not to this module would be missing.
        let schema: BTreeSet<u8> = fb::EventKind::ENUM_VALUES
            .iter()
            .filter(|k| **k != fb::EventKind::NONE)
            .map(|k| k.0)
            .collect();
        assert_eq!(seen, schema);
    }

    #[test]
    fn a_wrong_identifier_is_rejected() {
        let ev = &sample_events()[1];
        let mut bytes = Encoder::new().encode(ev).to_vec();
        bytes[4..8].copy_from_slice(b"KVBX");
        assert_eq!(
            decode(&bytes),
            Err(DecodeError::WrongIdentifier { found: *b"KVBX" })
        );
        assert_eq!(
            decode(&bytes).unwrap_err().to_string(),
            "not a kvbm event record: file identifier \"KVBX\", expected \"KVBE\""
        );

        // The same record finished without any identifier.
        let mut fbb = FlatBufferBuilder::new();
        let kind = fb::TokensScheduled::create(&mut fbb, &fb::TokensScheduledArgs::default());
        let root = fb::EventRecord::create(
            &mut fbb,
            &fb::EventRecordArgs {
                kind_type: fb::EventKind::TokensScheduled,
                kind: Some(kind.as_union_value()),
                ..Default::default()
            },
        );
        fbb.finish_minimal(root);
        assert!(matches!(
            decode(fbb.finished_data()),
            Err(DecodeError::WrongIdentifier { .. })
        ));

        assert_eq!(decode(b"KVBE"), Err(DecodeError::TooShort { len: 4 }));
        let huge = vec![0u8; MAX_RECORD_BYTES + 1];
        assert_eq!(
            decode(&huge),
            Err(DecodeError::TooLarge {
                len: MAX_RECORD_BYTES + 1
            })
        );
    }

    /// Builds a record by hand, as a buggy or newer writer might.
    fn record(
        build: impl FnOnce(
            &mut FlatBufferBuilder<'static>,
        ) -> (fb::EventKind, Option<WIPOffset<UnionWIPOffset>>),
        schema_version: u16,
    ) -> Vec<u8> {
        let mut fbb = FlatBufferBuilder::new();
        let (kind_type, kind) = build(&mut fbb);
        let root = fb::EventRecord::create(
            &mut fbb,
            &fb::EventRecordArgs {
                schema_version,
                kind_type,
                kind,
                ..Default::default()
            },
        );
        fbb.finish(root, Some(FILE_IDENTIFIER));
        fbb.finished_data().to_vec()
    }

    fn pool_gauge(
        fbb: &mut FlatBufferBuilder<'static>,
        tier: fb::Tier,
    ) -> WIPOffset<UnionWIPOffset> {
        let args = fb::PoolGaugeArgs {
            tier,
            ..Default::default()
        };
        fb::PoolGauge::create(fbb, &args).as_union_value()
    }

    fn transition(
        fbb: &mut FlatBufferBuilder<'static>,
        state: fb::SlotStateKind,
        tokens: u64,
    ) -> WIPOffset<UnionWIPOffset> {
        let from = fb::SlotState::new(state, tokens);
        let to = fb::SlotState::default();
        let args = fb::SlotTransitionArgs {
            from: Some(&from),
            to: Some(&to),
        };
        fb::SlotTransition::create(fbb, &args).as_union_value()
    }

    #[test]
    fn invalid_values_are_typed_errors() {
        let ok = record(
            |f| {
                (
                    fb::EventKind::PoolGauge,
                    Some(pool_gauge(f, fb::Tier::Disk)),
                )
            },
            1,
        );
        assert!(decode(&ok).is_ok());

        let bad_tier = record(
            |f| (fb::EventKind::PoolGauge, Some(pool_gauge(f, fb::Tier(3)))),
            1,
        );
        assert_eq!(
            decode(&bad_tier),
            Err(DecodeError::UnknownEnum {
                enum_name: "Tier",
                field: "PoolGauge.tier",
                value: 3
            })
        );
        let e = decode(&bad_tier).unwrap_err().to_string();
        assert_eq!(e, "PoolGauge.tier: unknown Tier value 3");

        let bad_state = record(
            |f| {
                (
                    fb::EventKind::SlotTransition,
                    Some(transition(f, fb::SlotStateKind(10), 0)),
                )
            },
            1,
        );
        assert!(matches!(
            decode(&bad_state),
            Err(DecodeError::UnknownEnum {
                enum_name: "SlotStateKind",
                field: "SlotTransition.from",
                value: 10
            })
        ));
        let tokens_on_prefilling = record(
            |f| {
                (
                    fb::EventKind::SlotTransition,
                    Some(transition(f, fb::SlotStateKind::Prefilling, 5)),
                )
            },
            1,
        );
        assert_eq!(
            decode(&tokens_on_prefilling),
            Err(DecodeError::UnexpectedTokens {
                field: "SlotTransition.from",
                state: "Prefilling",
                tokens: 5
            })
        );
    }

    #[test]
    fn only_the_readable_versions_decode() {
        // Versions 1 and 2 read; a later one does not, nor version 0.
        for v in [1, 2] {
            let rec = record(
                |f| {
                    (
                        fb::EventKind::PoolGauge,
                        Some(pool_gauge(f, fb::Tier::Disk)),
                    )
                },
                v,
            );
            assert!(decode(&rec).is_ok(), "version {v}");
        }
        for v in [0, 3] {
            let rec = record(
                |f| {
                    (
                        fb::EventKind::PoolGauge,
                        Some(pool_gauge(f, fb::Tier::Disk)),
                    )
                },
                v,
            );
            assert_eq!(
                decode(&rec),
                Err(DecodeError::UnsupportedVersion { found: v })
            );
        }
        assert_eq!(
            decode(&record(|_| (fb::EventKind::NONE, None), 3))
                .unwrap_err()
                .to_string(),
            "record has schema version 3, this build reads versions 1 to 2"
        );
    }

    #[test]
    fn a_kind_newer_than_the_record_version_is_refused() {
        // A PrefixLookup in a record that says version 1 is corruption: the
        // kind did not exist yet.
        let lookup = |f: &mut FlatBufferBuilder<'static>| {
            let hashes = f.create_vector(&[7u64, 9]);
            let t = fb::PrefixLookup::create(
                f,
                &fb::PrefixLookupArgs {
                    tokens: 40,
                    block_size: 16,
                    computed_blocks: 1,
                    hashes: Some(hashes),
                },
            );
            (fb::EventKind::PrefixLookup, Some(t.as_union_value()))
        };
        assert_eq!(
            decode(&record(lookup, 1)),
            Err(DecodeError::KindNewerThanVersion {
                kind: "PrefixLookup",
                since: 2,
                version: 1
            })
        );
        assert!(matches!(
            decode(&record(lookup, 2)),
            Ok(Event {
                kind: EventKind::PrefixLookup { tokens: 40, .. },
                ..
            })
        ));
    }

    #[test]
    fn a_missing_or_unknown_kind_is_refused() {
        let no_kind = record(|_| (fb::EventKind::NONE, None), 1);
        assert_eq!(decode(&no_kind), Err(DecodeError::MissingKind));
        // A type byte without a table, and a table without a type byte:
        // the verifier calls the union inconsistent.
        let no_table = record(|_| (fb::EventKind::PoolGauge, None), 1);
        assert!(matches!(decode(&no_table), Err(DecodeError::Invalid(_))));
        let no_type = record(
            |f| (fb::EventKind::NONE, Some(pool_gauge(f, fb::Tier::Host))),
            1,
        );
        assert!(matches!(decode(&no_type), Err(DecodeError::Invalid(_))));

        let unknown = record(
            |f| (fb::EventKind(200), Some(pool_gauge(f, fb::Tier::Host))),
            1,
        );
        assert_eq!(decode(&unknown), Err(DecodeError::UnknownKind(200)));
    }

    #[test]
    fn a_missing_required_field_is_a_verifier_error() {
        // A kind table without its required direction: the verifier's
        // error, wrapped.
        let no_direction = record(
            |f| {
                let start = f.start_table();
                let t = f.end_table(start);
                (fb::EventKind::TransferCancelled, Some(t.as_union_value()))
            },
            1,
        );
        let e = decode(&no_direction).unwrap_err();
        assert!(matches!(e, DecodeError::Invalid(_)), "{e}");
        assert!(e.to_string().contains("direction"), "{e}");
    }

    /// The verifier checks a union's value only for the kinds it knows, so
    /// a record whose type byte is NONE or unknown may carry a wild offset
    /// there; decode must answer from the type byte without following it.
    /// (Found by `mutated_records_never_panic`: it used to panic.)
    #[test]
    fn an_unverified_kind_offset_is_never_followed() {
        for (ty, want) in [
            (fb::EventKind::NONE, DecodeError::MissingKind),
            (fb::EventKind(200), DecodeError::UnknownKind(200)),
        ] {
            let mut fbb = FlatBufferBuilder::new();
            // Store the type byte even when it equals the default (NONE).
            fbb.force_defaults(true);
            let kind = pool_gauge(&mut fbb, fb::Tier::Host);
            let root = fb::EventRecord::create(
                &mut fbb,
                &fb::EventRecordArgs {
                    kind_type: ty,
                    kind: Some(kind),
                    ..Default::default()
                },
            );
            fbb.finish(root, Some(FILE_IDENTIFIER));
            let mut bytes = fbb.finished_data().to_vec();
            let tab = verify(&bytes).unwrap()._tab;
            let at = tab.loc() + usize::from(tab.vtable().get(fb::EventRecord::VT_KIND));
            // Point the value far past the end of the buffer.
            bytes[at..at + 4].copy_from_slice(&0x7fff_0000u32.to_le_bytes());
            assert_eq!(decode(&bytes), Err(want));
        }
    }

    #[test]
    fn an_encoder_can_move_to_a_recorder_thread() {
        fn send<T: Send>() {}
        send::<Encoder>();
    }

    #[test]
    fn encoding_reuses_the_builder() {
        let events = sample_events();
        let mut enc = Encoder::new();
        for ev in &events {
            enc.encode(ev);
        }
        // Every record fits the grown builder again: a second pass must
        // give identical bytes (nothing carried over between records).
        let first: Vec<Vec<u8>> = events.iter().map(|e| enc.encode(e).to_vec()).collect();
        let second: Vec<Vec<u8>> = events.iter().map(|e| enc.encode(e).to_vec()).collect();
        assert_eq!(first, second);
    }

    /// Bytes per event against serde_json (what a JSON-lines log would
    /// write, newline not counted). Run with `--nocapture` to see them.
    #[test]
    fn typical_event_size_vs_json() {
        let typical = Event {
            engine: 0,
            seq: 123_456,
            ts_ns: 12_345_678_901,
            iteration: 4_321,
            request: Some(Arc::from("req-000042")),
            kind: EventKind::SlotTransition {
                from: SlotState::Prefilling,
                to: SlotState::Decoding,
            },
        };
        let mut enc = Encoder::new();
        let mut rows = vec![("SlotTransition, 10-char request id".to_string(), typical)];
        rows.extend(
            sample_events()
                .into_iter()
                .map(|e| (e.kind.name().to_string(), e)),
        );
        let (mut fb_total, mut json_total) = (0, 0);
        for (name, ev) in &rows {
            let fb_len = enc.encode(ev).len();
            let json_len = serde_json::to_string(ev).unwrap().len();
            println!(
                "{name:<36} flatbuffers {fb_len:>4} B   json {json_len:>4} B   ratio {:.2}",
                json_len as f64 / fb_len as f64
            );
            fb_total += fb_len;
            json_total += json_len;
        }
        println!("all of the above: flatbuffers {fb_total} B, json {json_total} B");
        let fb_len = enc.encode(&rows[0].1).len();
        let json_len = serde_json::to_string(&rows[0].1).unwrap().len();
        assert!(fb_len < json_len, "{fb_len} vs {json_len}");
    }
}
