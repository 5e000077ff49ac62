//! The values events carry, in the schema's types: the enums, slot
//! states and directions (flatbuffers structs and enums), the tables of the
//! kinds whose payload has a variable size, the kind column's values, and
//! the schema versions each kind may appear in. Columnar blocks
//! ([`crate::columnar`]) are built from these.
//!
//! Decoding takes values that passed the flatbuffers verifier but may still
//! mean nothing (an unknown enum value, a token count on a state that has
//! none, a kind newer than its block): each is a typed [`DecodeError`],
//! never a panic.

use crate::fb;
use crate::{OLDEST_READABLE_VERSION, SCHEMA_VERSION};
use flatbuffers::{FlatBufferBuilder, WIPOffset};
use kvbm_events::SequenceHash;
use kvbm_events::slot::SlotState;
use kvbm_events::tier::{BlockId, Tier};
use kvbm_events::{Direction, EntryPoint, EventKind, HookPhase, KindTag, ResumeCause};

/// Why a decoded value is not a valid event (or part of one).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Written with a schema version this build cannot read.
    #[error(
        "schema version {found}, this build reads versions {OLDEST_READABLE_VERSION} to {SCHEMA_VERSION}"
    )]
    UnsupportedVersion {
        /// The version found.
        found: u16,
    },
    /// A kind that did not exist yet in the schema version the block says
    /// it was written with: corruption, not an old writer.
    #[error(
        "event kind {kind} is from schema version {since}, but the block says version {version}"
    )]
    KindNewerThanVersion {
        /// The kind.
        kind: &'static str,
        /// The version that introduced it.
        since: u16,
        /// The version written.
        version: u16,
    },
    /// An event with no kind.
    #[error("an event has no kind")]
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

/// The kind column's value of a kind: its index in `kvbm_events`'
/// declaration, plus one (0 means no kind).
pub fn kind_to_column(tag: KindTag) -> u8 {
    tag.index() as u8 + 1
}

/// The kind of a kind column's value; `None` for 0 and for a kind this
/// build does not know.
pub fn kind_from_column(k: u8) -> Option<KindTag> {
    k.checked_sub(1)
        .and_then(|i| KindTag::from_index(usize::from(i)))
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

/// A kind must exist in the version its block claims.
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

/// Builds the `BlocksAllocated` table in a block (the kinds of variable size are
/// stored as tables).
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

/// Builds the `TransferSkipped` table in a block (the kinds of variable size are
/// stored as tables).
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

/// Builds the `TransferFailed` table in a block (the kinds of variable size are
/// stored as tables).
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

/// Builds the `BatchDispatched` table in a block (the kinds of variable size are
/// stored as tables).
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

/// Builds the `PrefixLookup` table in a block (the kinds of variable size are
/// stored as tables).
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

    #[test]
    fn the_kinds_already_written_keep_their_bytes() {
        // A kind's byte in a block is its place in the declaration, and
        // logs already written hold these: a new kind goes at the end.
        const WRITTEN: [&str; 21] = [
            "slot_created",
            "slot_transition",
            "match_result",
            "blocks_allocated",
            "blocks_released",
            "block_registered",
            "block_evicted",
            "transfer_planned",
            "transfer_promoted",
            "transfer_skipped",
            "transfer_cancelled",
            "transfer_completed",
            "transfer_failed",
            "batch_dispatched",
            "batch_completed",
            "pool_gauge",
            "hook_call",
            "breakpoint_hit",
            "resumed",
            "tokens_scheduled",
            "prefix_lookup",
        ];
        for (i, name) in WRITTEN.iter().enumerate() {
            let tag = KindTag::from_snake_name(name).unwrap();
            assert_eq!(kind_to_column(tag), i as u8 + 1, "{name}");
        }
    }

    /// A corruption of valid bytes.
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

    #[test]
    fn kind_column_values_are_declaration_indices_plus_one() {
        assert_eq!(kind_from_column(0), None);
        for &tag in KindTag::ALL {
            assert_eq!(kind_from_column(kind_to_column(tag)), Some(tag));
        }
        assert_eq!(kind_from_column(KindTag::COUNT as u8 + 1), None);
    }

    #[test]
    fn values_with_no_meaning_are_typed_errors() {
        assert!(matches!(
            tier_from_fb(fb::Tier(200), "X.tier"),
            Err(DecodeError::UnknownEnum {
                enum_name: "Tier",
                field: "X.tier",
                value: 200
            })
        ));
        assert!(matches!(
            entry_from_fb(fb::EntryPoint(99), "X.entry"),
            Err(DecodeError::UnknownEnum { value: 99, .. })
        ));
        assert!(phase_from_fb(fb::HookPhase(7), "X.phase").is_err());
        assert!(cause_from_fb(fb::ResumeCause(7), "X.cause").is_err());
        let bad = fb::Direction::new(fb::Tier::Device, fb::Tier(9));
        assert!(direction_from_fb(&bad, "X.direction").is_err());
        // A count on a state that takes none, and an unknown state.
        let counted = fb::SlotState::new(fb::SlotStateKind::Decoding, 3);
        assert!(matches!(
            decode_state(&counted, "X.to"),
            Err(DecodeError::UnexpectedTokens {
                state: "Decoding",
                tokens: 3,
                ..
            })
        ));
        let unknown = fb::SlotState::new(fb::SlotStateKind(77), 0);
        assert!(decode_state(&unknown, "X.to").is_err());
        // Every value written reads back.
        for s in [
            SlotState::Initialized,
            SlotState::OnboardStaged(4),
            SlotState::Onboarding(9),
            SlotState::Decoding,
            SlotState::Finished,
        ] {
            assert_eq!(decode_state(&encode_state(s), "X.to"), Ok(s));
        }
        for t in [Tier::Device, Tier::Host, Tier::Disk] {
            assert_eq!(tier_from_fb(tier_to_fb(t), "X.tier"), Ok(t));
        }
    }
}
