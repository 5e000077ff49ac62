//! The block encoding of events: a run of events stored column by
//! column as one flatbuffers `EventBlock` (`schema/kvbm_events.fbs`), with
//! the file identifier `KVBB`.
//!
//! The same blocks carry events everywhere they travel: the log's
//! frames, NATS batches ([`crate::nats::wire`]) and the attach protocol's
//! binary frames ([`crate::protocol`]).
//!
//! Why columns rather than a table per event: most event kinds are fixed-size, and a column of fixed-size
//! rows is a flatbuffers vector of structs, which the verifier checks with
//! one range check however many rows it has, where a table per event costs
//! a vtable lookup and a bounds check per field. The envelope (sequence
//! number, timestamp, engine, iteration, request) is a column of scalars
//! each, request ids are stored once per block, and the few kinds that
//! carry a list or free text (`BlocksAllocated`, `TransferSkipped`,
//! `TransferFailed`, `BatchDispatched`) stay tables. Writing gains as much:
//! pushing a row is a copy into a `Vec`, and the builder writes each vtable
//! once per block.
//!
//! - [`BlockEncoder`] gathers events and [`finish`](BlockEncoder::finish)es
//!   the block; it allocates nothing once its buffers have grown.
//! - [`verify_block`] takes untrusted bytes: it checks the identifier, runs
//!   the flatbuffers verifier over the whole block, then checks that the
//!   columns agree with each other (same length, one row per event of each
//!   kind, request indices in range). What it returns, a [`BlockView`], can
//!   be decoded without any further bounds failure; the values themselves
//!   (enum values, token counts) are checked as they are decoded, each
//!   failure naming the event's index in the block.
//!
//! `decode(encode(events)) == events` for any events (a property test
//! checks it), and random or mutated bytes are refused with an error, never
//! a panic.

use crate::fb;
use crate::values::{
    DecodeError, batch_dispatched_from_fb, batch_dispatched_table, blocks_allocated_from_fb,
    blocks_allocated_table, cause_from_fb, cause_to_fb, check_kind_version, check_version,
    decode_state, direction_from_fb, direction_to_fb, encode_state, entry_from_fb, entry_to_fb,
    kind_from_column, kind_to_column, phase_from_fb, phase_to_fb, prefix_lookup_from_fb,
    prefix_lookup_table, tier_from_fb, tier_to_fb, transfer_failed_from_fb, transfer_failed_table,
    transfer_skipped_from_fb, transfer_skipped_table,
};
use crate::{OLDEST_READABLE_VERSION, SCHEMA_VERSION};
use flatbuffers::{FlatBufferBuilder, InvalidFlatbuffer, Push, VerifierOptions, WIPOffset};
use kvbm_events::{Direction, SequenceHash};
use kvbm_events::{Event, EventKind, KindTag};
use std::collections::HashMap;
use std::sync::Arc;

/// The flatbuffers file identifier of an `EventBlock` (bytes 4..8).
pub const BLOCK_IDENTIFIER: &str = "KVBB";

/// The most events one block may hold (the log's frame header counts them
/// in a `u16`).
pub const MAX_BLOCK_EVENTS: usize = u16::MAX as usize;

const WRITE_VERSION: u16 = SCHEMA_VERSION as u16;

/// Bytes an event adds to a block before its kind's row: the envelope
/// columns (seq and iteration deltas 2 each, ts delta and engine 4 each,
/// request 2) and the kind byte. (The engine column is usually left out;
/// counting it keeps this an upper bound.)
const ENVELOPE_BYTES: usize = 2 + 4 + 2 + 4 + 2 + 1;

/// Slots of the request-id cache keyed by `Arc` address.
const REQUEST_CACHE: usize = 64;

/// Verifier limits for a block: at most one table per event plus a few,
/// no nesting beyond kind tables, and an apparent size that is a small
/// multiple of the largest block the log accepts.
const VERIFIER_OPTIONS: VerifierOptions = VerifierOptions {
    max_depth: 8,
    max_tables: MAX_BLOCK_EVENTS + 8,
    max_apparent_size: 1 << 28,
    ignore_missing_null_terminator: false,
};

/// Why bytes are not a valid event block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// Shorter than a root offset and a file identifier.
    #[error("block too short: {len} bytes")]
    TooShort {
        /// The length given.
        len: usize,
    },
    /// Bytes 4..8 are not `KVBB`.
    #[error(
        "not a kvbm event block: file identifier \"{}\", expected \"{BLOCK_IDENTIFIER}\"",
        found.escape_ascii()
    )]
    WrongIdentifier {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// The flatbuffers verifier refused the block.
    #[error("block fails flatbuffers verification: {0}")]
    Invalid(#[from] InvalidFlatbuffer),
    /// Written with a schema version this build cannot read.
    #[error(
        "block has schema version {found}, this build reads versions {OLDEST_READABLE_VERSION} to {SCHEMA_VERSION}"
    )]
    UnsupportedVersion {
        /// The version in the block.
        found: u16,
    },
    /// A block holds at least one event.
    #[error("block holds no events")]
    Empty,
    /// More events than a block may hold.
    #[error("block holds {len} events, at most {MAX_BLOCK_EVENTS}")]
    TooMany {
        /// The count found.
        len: usize,
    },
    /// An envelope column's length differs from the block's event count.
    #[error("column {column} has {len} entries for {events} events")]
    ColumnLength {
        /// The column.
        column: &'static str,
        /// Its length.
        len: usize,
        /// The event count (the length of `seq`).
        events: usize,
    },
    /// An event's kind byte names no kind this build knows.
    #[error("event {index} of the block: unknown event kind {kind}")]
    UnknownKind {
        /// The event's index in the block.
        index: usize,
        /// The kind byte.
        kind: u8,
    },
    /// A kind's column does not have one row per event of that kind.
    #[error("column {column} has {rows} rows for {events} events of its kind")]
    KindRows {
        /// The column.
        column: &'static str,
        /// Its rows (0 when absent).
        rows: usize,
        /// Events of that kind in the block.
        events: usize,
    },
    /// A request index past the block's request ids.
    #[error("event {index} of the block: request index {value}, the block has {count} request ids")]
    RequestIndex {
        /// The event's index in the block.
        index: usize,
        /// The index found.
        value: u16,
        /// Request ids in the block.
        count: usize,
    },
    /// An event's seq is not above the one before it (a block's seqs
    /// strictly increase).
    #[error("event {index} of the block: seq {seq} does not follow seq {after}")]
    SeqOrder {
        /// The event's index in the block.
        index: usize,
        /// Its seq.
        seq: u64,
        /// The seq before it.
        after: u64,
    },
    /// An event's values do not make an event.
    #[error("event {index} of the block: {error}")]
    Event {
        /// The event's index in the block.
        index: usize,
        /// What is wrong with it.
        error: DecodeError,
    },
}

/// How many bytes `ev` adds to a block, near enough to size blocks by and
/// never less than it takes (the log refuses events above its record limit
/// with this).
pub fn event_bytes(ev: &Event) -> usize {
    let request = ev.request.as_ref().map_or(0, |r| r.len() + 8);
    // Alignment padding of the row's column, at most 7 bytes.
    ENVELOPE_BYTES + request + kind_bytes(&ev.kind) + 8
}

/// A table kind's share of a block beyond its own bytes: the table's
/// header, its vtable share and the vector entry pointing at it.
const TABLE: usize = 48;

/// `$given` if there is one, else `$default` (an optional part of a
/// `kind_columns!` entry).
macro_rules! given_or {
    (, $default:expr) => {
        $default
    };
    ($given:expr, $default:expr) => {
        $given
    };
}

/// The kinds' columns, one entry a kind: its fields, its column's name in
/// the schema (its snake_case name) and what the column holds, then how a
/// kind becomes a row and back.
///
/// - `size`: what the event adds to a block by [`event_bytes`]; a row
///   kind's is its row's size, so only a table kind gives one;
/// - `encode`: the row (or, given the builder, the table) from the
///   fields, which are bound by reference;
/// - `decode(r)`: the kind from row `r`, with `?` on what is checked;
/// - `check`: what [`BlockView::validate`] runs on each row, with `?`;
///   by default the decoding itself (a table kind gives a check that
///   does not copy its lists).
///
/// Everything the codec does by kind follows from this list: the
/// encoder's columns and their clearing, the block's arguments, each
/// column's row count, sizing, pushing, checking and decoding. Each of
/// those matches every kind, so a kind missing here does not compile.
macro_rules! kind_columns {
    ($(
        $tag:ident { $($field:ident),* } => $col:ident: $ty:ty
        $(, size = $size:expr)?
        , encode $(($fbb:ident))? = $encode:expr
        , decode($r:ident) = $decode:expr
        $(, check = $check:expr)?
        ;
    )*) => {
        /// What `kind` adds to a block besides its envelope.
        #[allow(unused_variables)] // a row kind's size needs none of its fields
        fn kind_bytes(kind: &EventKind) -> usize {
            match kind {
                $(EventKind::$tag { $($field),* } => given_or!($($size)?, size_of::<$ty>()),)*
            }
        }

        /// The encoder's column of each kind.
        #[derive(Default)]
        struct Columns {
            $($col: Vec<$ty>,)*
        }

        impl Columns {
            fn clear(&mut self) {
                $(self.$col.clear();)*
            }

            /// Pushes `kind`'s row into its column (a table kind's table
            /// into `fbb` first).
            fn push(&mut self, fbb: &mut FlatBufferBuilder<'static>, kind: &EventKind) {
                match kind {
                    $(EventKind::$tag { $($field),* } => {
                        $(let $fbb = &mut *fbb;)?
                        self.$col.push($encode);
                    })*
                }
            }

            /// Writes each column that has rows into the block.
            fn write(
                &self,
                fbb: &mut FlatBufferBuilder<'static>,
                args: &mut fb::EventBlockArgs<'static>,
            ) {
                $(args.$col = column(fbb, &self.$col);)*
            }
        }

        /// Rows in the column of kind `k` (0 when the column is absent),
        /// and the column's name; `None` for a kind this build does not
        /// know.
        fn kind_rows(b: &fb::EventBlock<'_>, k: u8) -> Option<(usize, &'static str)> {
            fn n<T>(v: Option<flatbuffers::Vector<'_, T>>) -> usize {
                v.map_or(0, |v| v.len())
            }
            let tag = kind_from_column(k)?;
            let rows = match tag {
                $(KindTag::$tag => n(b.$col()),)*
            };
            Some((rows, tag.snake_name()))
        }

        /// Runs kind `tag`'s check on every row of its column: the bad
        /// row and why.
        fn check_column(b: &fb::EventBlock<'_>, tag: KindTag) -> Result<(), (usize, DecodeError)> {
            match tag {
                $(KindTag::$tag => {
                    let rows = b.$col().ok_or((0, DecodeError::MissingKind))?;
                    rows.iter().enumerate().try_for_each(|(i, $r)| {
                        let check = || -> Result<(), DecodeError> {
                            // A kind may have nothing to check.
                            let _ = &$r;
                            let _ = given_or!($($check)?, $decode);
                            Ok(())
                        };
                        check().map_err(|e| (i, e))
                    })
                })*
            }
        }

        /// Row `row` of kind `tag`'s column.
        fn kind_at(b: &fb::EventBlock<'_>, tag: KindTag, row: usize) -> Result<EventKind, DecodeError> {
            Ok(match tag {
                $(KindTag::$tag => {
                    let $r = b.$col().ok_or(DecodeError::MissingKind)?.get(row);
                    $decode
                })*
            })
        }
    };
}

kind_columns! {
    SlotCreated { prompt_tokens, max_output_tokens } => slot_created: fb::SlotCreatedRow,
        encode = fb::SlotCreatedRow::new(*prompt_tokens, *max_output_tokens),
        decode(r) = EventKind::SlotCreated {
            prompt_tokens: r.prompt_tokens(),
            max_output_tokens: r.max_output_tokens(),
        };
    SlotTransition { from, to } => slot_transition: fb::SlotTransitionRow,
        encode = fb::SlotTransitionRow::new(&encode_state(*from), &encode_state(*to)),
        decode(r) = EventKind::SlotTransition {
            from: decode_state(r.from(), "SlotTransition.from")?,
            to: decode_state(r.to(), "SlotTransition.to")?,
        };
    MatchResult { tier, looked_up, hit_blocks, hit_tokens } => match_result: fb::MatchResultRow,
        encode = fb::MatchResultRow::new(tier_to_fb(*tier), *looked_up, *hit_blocks, *hit_tokens),
        decode(r) = EventKind::MatchResult {
            tier: tier_from_fb(r.tier(), "MatchResult.tier")?,
            looked_up: r.looked_up(),
            hit_blocks: r.hit_blocks(),
            hit_tokens: r.hit_tokens(),
        };
    BlocksAllocated { tier, blocks } => blocks_allocated: WIPOffset<fb::BlocksAllocated<'static>>,
        size = TABLE + 4 * blocks.len(),
        encode(fbb) = blocks_allocated_table(fbb, *tier, blocks),
        decode(t) = blocks_allocated_from_fb(t)?,
        check = tier_from_fb(t.tier(), "BlocksAllocated.tier")?;
    BlocksReleased { tier, count } => blocks_released: fb::BlocksReleasedRow,
        encode = fb::BlocksReleasedRow::new(tier_to_fb(*tier), *count),
        decode(r) = EventKind::BlocksReleased {
            tier: tier_from_fb(r.tier(), "BlocksReleased.tier")?,
            count: r.count(),
        };
    BlockRegistered { tier, block, sequence_hash, duplicate_of } => block_registered: fb::BlockRegisteredRow,
        encode = fb::BlockRegisteredRow::new(
            tier_to_fb(*tier),
            duplicate_of.is_some(),
            *block,
            duplicate_of.unwrap_or(0),
            sequence_hash.0,
        ),
        decode(r) = block_registered_from_row(r)?;
    BlockEvicted { tier, block, sequence_hash } => block_evicted: fb::BlockEvictedRow,
        encode = fb::BlockEvictedRow::new(tier_to_fb(*tier), *block, sequence_hash.0),
        decode(r) = EventKind::BlockEvicted {
            tier: tier_from_fb(r.tier(), "BlockEvicted.tier")?,
            block: r.block(),
            sequence_hash: SequenceHash(r.sequence_hash()),
        };
    TransferPlanned { transfer, direction, blocks } => transfer_planned: fb::TransferRow,
        encode = transfer_row(*transfer, *direction, *blocks),
        decode(r) = EventKind::TransferPlanned {
            transfer: r.transfer(),
            direction: direction_from_fb(r.direction(), "TransferPlanned.direction")?,
            blocks: r.blocks(),
        };
    TransferPromoted { transfer, direction, blocks } => transfer_promoted: fb::TransferRow,
        encode = transfer_row(*transfer, *direction, *blocks),
        decode(r) = EventKind::TransferPromoted {
            transfer: r.transfer(),
            direction: direction_from_fb(r.direction(), "TransferPromoted.direction")?,
            blocks: r.blocks(),
        };
    TransferSkipped { transfer, direction, reason } => transfer_skipped: WIPOffset<fb::TransferSkipped<'static>>,
        size = TABLE + reason.len() + 8,
        encode(fbb) = transfer_skipped_table(fbb, *transfer, *direction, reason),
        decode(t) = transfer_skipped_from_fb(t)?,
        check = direction_from_fb(t.direction(), "TransferSkipped.direction")?;
    TransferCancelled { transfer, direction } => transfer_cancelled: fb::TransferCancelledRow,
        encode = fb::TransferCancelledRow::new(*transfer, &direction_to_fb(*direction)),
        decode(r) = EventKind::TransferCancelled {
            transfer: r.transfer(),
            direction: direction_from_fb(r.direction(), "TransferCancelled.direction")?,
        };
    TransferCompleted { transfer, direction, blocks } => transfer_completed: fb::TransferRow,
        encode = transfer_row(*transfer, *direction, *blocks),
        decode(r) = EventKind::TransferCompleted {
            transfer: r.transfer(),
            direction: direction_from_fb(r.direction(), "TransferCompleted.direction")?,
            blocks: r.blocks(),
        };
    TransferFailed { transfer, direction, error } => transfer_failed: WIPOffset<fb::TransferFailed<'static>>,
        size = TABLE + error.len() + 8,
        encode(fbb) = transfer_failed_table(fbb, *transfer, *direction, error),
        decode(t) = transfer_failed_from_fb(t)?,
        check = direction_from_fb(t.direction(), "TransferFailed.direction")?;
    BatchDispatched { batch, direction, transfers, blocks } => batch_dispatched: WIPOffset<fb::BatchDispatched<'static>>,
        size = TABLE + 8 * transfers.len() + 8,
        encode(fbb) = batch_dispatched_table(fbb, *batch, *direction, transfers, *blocks),
        decode(t) = batch_dispatched_from_fb(t)?,
        check = direction_from_fb(t.direction(), "BatchDispatched.direction")?;
    BatchCompleted { batch, direction, ok, blocks, bytes, elapsed_ns } => batch_completed: fb::BatchCompletedRow,
        encode = fb::BatchCompletedRow::new(
            *batch,
            &direction_to_fb(*direction),
            *ok,
            *blocks,
            *bytes,
            *elapsed_ns,
        ),
        decode(r) = EventKind::BatchCompleted {
            batch: r.batch(),
            direction: direction_from_fb(r.direction(), "BatchCompleted.direction")?,
            ok: r.ok(),
            blocks: r.blocks(),
            bytes: r.bytes(),
            elapsed_ns: r.elapsed_ns(),
        };
    PoolGauge { tier, capacity, active, inactive, empty } => pool_gauge: fb::PoolGaugeRow,
        encode = fb::PoolGaugeRow::new(tier_to_fb(*tier), *capacity, *active, *inactive, *empty),
        decode(r) = EventKind::PoolGauge {
            tier: tier_from_fb(r.tier(), "PoolGauge.tier")?,
            capacity: r.capacity(),
            active: r.active(),
            inactive: r.inactive(),
            empty: r.empty(),
        };
    HookCall { entry, phase } => hook_call: fb::HookCallRow,
        encode = fb::HookCallRow::new(entry_to_fb(*entry), phase_to_fb(*phase)),
        decode(r) = EventKind::HookCall {
            entry: entry_from_fb(r.entry(), "HookCall.entry")?,
            phase: phase_from_fb(r.phase(), "HookCall.phase")?,
        };
    BreakpointHit { breakpoint, entry, deadline_ns } => breakpoint_hit: fb::BreakpointHitRow,
        encode = fb::BreakpointHitRow::new(*breakpoint, entry_to_fb(*entry), *deadline_ns),
        decode(r) = EventKind::BreakpointHit {
            breakpoint: r.breakpoint(),
            entry: entry_from_fb(r.entry(), "BreakpointHit.entry")?,
            deadline_ns: r.deadline_ns(),
        };
    Resumed { breakpoint, cause } => resumed: fb::ResumedRow,
        encode = fb::ResumedRow::new(*breakpoint, cause_to_fb(*cause)),
        decode(r) = EventKind::Resumed {
            breakpoint: r.breakpoint(),
            cause: cause_from_fb(r.cause(), "Resumed.cause")?,
        };
    TokensScheduled { prefill, decode, computed } => tokens_scheduled: fb::TokensScheduledRow,
        encode = fb::TokensScheduledRow::new(*prefill, *decode, *computed),
        decode(r) = EventKind::TokensScheduled {
            prefill: r.prefill(),
            decode: r.decode(),
            computed: r.computed(),
        };
    PrefixLookup { tokens, block_size, computed_blocks, hashes } => prefix_lookup: WIPOffset<fb::PrefixLookup<'static>>,
        size = TABLE + 8 * hashes.len() + 8,
        encode(fbb) = prefix_lookup_table(fbb, *tokens, *block_size, *computed_blocks, hashes),
        decode(t) = prefix_lookup_from_fb(t)?,
        check = ();
    ExternalHit { from_token, tokens } => external_hit: fb::ExternalHitRow,
        encode = fb::ExternalHitRow::new(*from_token, *tokens),
        decode(r) = EventKind::ExternalHit {
            from_token: r.from_token(),
            tokens: r.tokens(),
        };
}

/// Gathers events into a block. Reused from block to block: `finish`, then
/// the next `push` starts a new block.
pub struct BlockEncoder {
    fbb: FlatBufferBuilder<'static>,
    finished: bool,
    bytes: usize,
    /// The block's first (seq, ts, iteration), and the last event's.
    base: (u64, u64, u64),
    /// The first event's engine; `engine` stays empty while every event
    /// has it.
    base_engine: u32,
    prev: (u64, u64, u64),
    seq: Vec<u16>,
    ts_ns: Vec<u32>,
    engine: Vec<u32>,
    iteration: Vec<u16>,
    request: Vec<u16>,
    kind: Vec<u8>,
    /// The block's request ids as written into the builder, and each one's
    /// index + 1. The last one is remembered apart because consecutive
    /// events mostly share a request.
    requests: Vec<WIPOffset<&'static str>>,
    request_ids: HashMap<Arc<str>, u16>,
    /// Request ids by the address of their `Arc`: the engine hands out
    /// clones of one `Arc` per request, so this avoids hashing the string
    /// for almost every event. Entries point at `Arc`s held in
    /// `request_ids`, so an address cannot be reused within a block.
    request_cache: [(usize, u16); REQUEST_CACHE],
    /// One column per kind.
    cols: Columns,
}

impl std::fmt::Debug for BlockEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockEncoder")
            .field("events", &self.seq.len())
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl Default for BlockEncoder {
    fn default() -> Self {
        Self::new()
    }
}

/// A column of rows, or nothing when the block has none of that kind.
fn column<T: Push + Copy>(
    fbb: &mut FlatBufferBuilder<'static>,
    rows: &[T],
) -> Option<WIPOffset<flatbuffers::Vector<'static, T::Output>>> {
    (!rows.is_empty()).then(|| fbb.create_vector(rows))
}

impl BlockEncoder {
    /// An empty encoder.
    pub fn new() -> Self {
        Self {
            fbb: FlatBufferBuilder::with_capacity(64 << 10),
            finished: false,
            bytes: 0,
            base: (0, 0, 0),
            base_engine: 0,
            prev: (0, 0, 0),
            seq: Vec::new(),
            ts_ns: Vec::new(),
            engine: Vec::new(),
            iteration: Vec::new(),
            request: Vec::new(),
            kind: Vec::new(),
            requests: Vec::new(),
            request_ids: HashMap::new(),
            request_cache: [(0, 0); REQUEST_CACHE],
            cols: Columns::default(),
        }
    }

    /// Events in the block so far.
    pub fn len(&self) -> usize {
        self.kind.len()
    }

    /// True before the first push of a block.
    pub fn is_empty(&self) -> bool {
        self.kind.is_empty()
    }

    /// The block's size so far by [`event_bytes`], an upper bound on what
    /// [`finish`](Self::finish) returns less a fixed overhead.
    pub fn approx_bytes(&self) -> usize {
        self.bytes
    }

    /// Empties the encoder, keeping its buffers.
    pub fn clear(&mut self) {
        // Every field by name, with no `..`: a new field does not compile
        // until it is cleared here too (the kinds' columns clear
        // themselves: `kind_columns!`).
        let BlockEncoder {
            fbb,
            finished,
            bytes,
            base,
            base_engine: _,
            prev,
            seq,
            ts_ns,
            engine,
            iteration,
            request,
            kind,
            requests,
            request_ids,
            request_cache,
            cols,
        } = self;
        fbb.reset();
        *finished = false;
        *bytes = 0;
        *base = (0, 0, 0);
        *prev = (0, 0, 0);
        *request_cache = [(0, 0); REQUEST_CACHE];
        for v in [seq, iteration, request] {
            v.clear();
        }
        ts_ns.clear();
        engine.clear();
        kind.clear();
        requests.clear();
        request_ids.clear();
        cols.clear();
    }

    /// Adds an event to the block (after a `finish`, to a new block), or
    /// returns false and adds nothing when it does not [`fit`](Self::fits):
    /// finish the block and push it again.
    pub fn push(&mut self, ev: &Event) -> bool {
        self.try_push(ev, event_bytes(ev), usize::MAX)
    }

    /// [`push`](Self::push) for a caller that has computed `size` =
    /// [`event_bytes`]`(ev)` already and wants the block to stay within
    /// `limit` bytes by that measure. An empty block takes any event.
    pub fn try_push(&mut self, ev: &Event, size: usize, limit: usize) -> bool {
        if self.finished {
            self.clear();
        }
        let (ds, dt, di) = if self.kind.is_empty() {
            self.base = (ev.seq, ev.ts_ns, ev.iteration);
            self.base_engine = ev.engine;
            self.prev = self.base;
            (0, 0, 0)
        } else {
            let d = (
                delta(self.prev.0, ev.seq),
                delta(self.prev.1, ev.ts_ns),
                delta(self.prev.2, ev.iteration),
            );
            let fits = self.kind.len() < MAX_BLOCK_EVENTS
                && d.0 <= u64::from(u16::MAX)
                && d.1 <= u64::from(u32::MAX)
                && d.2 <= u64::from(u16::MAX)
                && self.bytes.saturating_add(size) <= limit;
            if !fits {
                return false;
            }
            d
        };
        let request = match &ev.request {
            None => 0,
            Some(r) => self.request_id(r),
        };
        self.bytes += size;
        if !self.engine.is_empty() {
            self.engine.push(ev.engine);
        } else if ev.engine != self.base_engine {
            // The first event of another engine: from now on the column is
            // written, so fill it in for the events before.
            self.engine.resize(self.kind.len(), self.base_engine);
            self.engine.push(ev.engine);
        }
        // Checked against the types' ranges above. The seq column is only
        // written once a difference other than +1 (zigzag 2) turns up.
        let ds = ds as u16;
        if !self.seq.is_empty() {
            self.seq.push(ds);
        } else if ds != 2 && !self.kind.is_empty() {
            self.seq.push(0);
            self.seq.resize(self.kind.len(), 2);
            self.seq.push(ds);
        }
        self.ts_ns.push(dt as u32);
        self.iteration.push(di as u16);
        self.prev = (ev.seq, ev.ts_ns, ev.iteration);
        self.request.push(request);
        self.cols.push(&mut self.fbb, &ev.kind);
        self.kind.push(kind_to_column(ev.kind.tag()));
        true
    }

    /// Whether `ev` can join this block: its differences from the last
    /// event fit the columns' types and the block has room for one more
    /// event. Always true for an empty (or finished) block.
    pub fn fits(&self, ev: &Event) -> bool {
        if self.finished || self.kind.is_empty() {
            return true;
        }
        self.kind.len() < MAX_BLOCK_EVENTS
            && delta(self.prev.0, ev.seq) <= u64::from(u16::MAX)
            && delta(self.prev.1, ev.ts_ns) <= u64::from(u32::MAX)
            && delta(self.prev.2, ev.iteration) <= u64::from(u16::MAX)
    }

    fn request_id(&mut self, r: &Arc<str>) -> u16 {
        let addr = Arc::as_ptr(r).cast::<u8>() as usize;
        let slot = (addr >> 4) % REQUEST_CACHE;
        let (cached, id) = self.request_cache[slot];
        if cached == addr && id != 0 {
            return id;
        }
        // Only an address that `request_ids` keeps alive may be cached: a
        // different `Arc` with the same text is looked up by text each
        // time (it may be freed and its address reused).
        let (id, keep) = match self.request_ids.get_key_value(r) {
            Some((k, id)) => (*id, Arc::ptr_eq(k, r)),
            None => {
                let s = self.fbb.create_string(r);
                self.requests.push(s);
                // At most one request per event, and a block holds at most
                // MAX_BLOCK_EVENTS (u16::MAX) events: this fits a u16.
                let id = self.requests.len() as u16;
                self.request_ids.insert(Arc::clone(r), id);
                (id, true)
            }
        };
        if keep {
            self.request_cache[slot] = (addr, id);
        }
        id
    }

    /// Writes the block and returns its bytes, valid until the next call.
    /// The next [`push`](Self::push) starts a new block.
    pub fn finish(&mut self) -> &[u8] {
        if self.finished {
            return self.fbb.finished_data();
        }
        let fbb = &mut self.fbb;
        let ts_ns = fbb.create_vector(&self.ts_ns);
        let iteration = fbb.create_vector(&self.iteration);
        let request = fbb.create_vector(&self.request);
        let kind = fbb.create_vector(&self.kind);
        let requests = fbb.create_vector(&self.requests);
        let mut args = fb::EventBlockArgs {
            schema_version: WRITE_VERSION,
            base_seq: self.base.0,
            base_ts_ns: self.base.1,
            base_iteration: self.base.2,
            base_engine: self.base_engine,
            seq_delta: column(fbb, &self.seq),
            ts_delta: Some(ts_ns),
            engine: column(fbb, &self.engine),
            iteration_delta: Some(iteration),
            request: Some(request),
            kind: Some(kind),
            requests: Some(requests),
            ..Default::default()
        };
        self.cols.write(fbb, &mut args);
        let root = fb::EventBlock::create(fbb, &args);
        fbb.finish(root, Some(BLOCK_IDENTIFIER));
        self.finished = true;
        self.fbb.finished_data()
    }
}

// ------------------------------------------------------------- decoding

/// A block that passed [`verify_block`]: every column is in bounds and
/// they agree with each other.
#[derive(Clone, Copy)]
pub struct BlockView<'a> {
    block: fb::EventBlock<'a>,
    bytes: &'a [u8],
    len: usize,
}

/// Where a block lies in its stream: its first and last sequence numbers
/// and the range of its timestamps ([`BlockView::span`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSpan {
    /// The first event's seq.
    pub first_seq: u64,
    /// The last event's seq.
    pub last_seq: u64,
    /// The smallest timestamp.
    pub min_ts: u64,
    /// The largest timestamp.
    pub max_ts: u64,
}

/// A block that passed every check a reader of it makes (the verifier,
/// the columns against each other, every event's values) with what a
/// writer needs to know of it: its span, its events, its last engine. Only
/// [`CheckedBlock::check`] makes one, so a value of this type is a block a
/// reader takes, and a writer can keep it as it is without reading it
/// again.
#[derive(Debug, Clone, Copy)]
pub struct CheckedBlock<'a> {
    bytes: &'a [u8],
    span: BlockSpan,
    len: usize,
    last_engine: u32,
}

impl<'a> CheckedBlock<'a> {
    /// Checks `bytes` as a block: [`verify_block`], then
    /// [`BlockView::validate`] and [`BlockView::span`].
    pub fn check(bytes: &'a [u8]) -> Result<Self, BlockError> {
        let view = verify_block(bytes)?;
        view.validate()?;
        Ok(CheckedBlock {
            bytes,
            span: view.span()?,
            len: view.len(),
            last_engine: view.last_engine(),
        })
    }

    /// The block's bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Its seqs and timestamps.
    pub fn span(&self) -> BlockSpan {
        self.span
    }

    /// Events in it (at least one).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a checked block holds at least one event.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The engine of its last event.
    pub fn last_engine(&self) -> u32 {
        self.last_engine
    }

    /// The block, to read its events. The verifier runs again (the cheap
    /// part of the check), so reading needs no trust in where this value
    /// came from; it cannot fail on bytes that passed the check.
    pub fn view(&self) -> Result<BlockView<'a>, BlockError> {
        verify_block(self.bytes)
    }
}

impl std::fmt::Debug for BlockView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockView")
            .field("events", &self.len)
            .finish_non_exhaustive()
    }
}

/// Checks untrusted bytes as an event block: identifier, the flatbuffers
/// verifier over the whole block, then the columns against each other.
pub fn verify_block(bytes: &[u8]) -> Result<BlockView<'_>, BlockError> {
    if bytes.len() < 8 {
        return Err(BlockError::TooShort { len: bytes.len() });
    }
    let found: [u8; 4] = [bytes[4], bytes[5], bytes[6], bytes[7]];
    if found != *BLOCK_IDENTIFIER.as_bytes() {
        return Err(BlockError::WrongIdentifier { found });
    }
    let block = flatbuffers::root_with_opts::<fb::EventBlock>(&VERIFIER_OPTIONS, bytes)?;
    let version = block.schema_version();
    if check_version(version).is_err() {
        return Err(BlockError::UnsupportedVersion { found: version });
    }
    let events = block.kind().len();
    if events == 0 {
        return Err(BlockError::Empty);
    }
    if events > MAX_BLOCK_EVENTS {
        return Err(BlockError::TooMany { len: events });
    }
    for (column, len) in [
        ("seq_delta", block.seq_delta().map_or(events, |v| v.len())),
        ("ts_delta", block.ts_delta().len()),
        ("engine", block.engine().map_or(events, |v| v.len())),
        ("iteration_delta", block.iteration_delta().len()),
        ("request", block.request().len()),
    ] {
        if len != events {
            return Err(BlockError::ColumnLength {
                column,
                len,
                events,
            });
        }
    }
    let kinds = block.kind().bytes();
    let mut counts = [0usize; 256];
    for &k in kinds {
        counts[usize::from(k)] += 1;
    }
    for (k, &count) in counts.iter().enumerate() {
        if count == 0 {
            continue;
        }
        let k = k as u8;
        let first = || kinds.iter().position(|&x| x == k).unwrap_or(0);
        let Some((rows, column)) = kind_rows(&block, k) else {
            return Err(BlockError::UnknownKind {
                index: first(),
                kind: k,
            });
        };
        // A kind the block's version did not have yet is corruption.
        if let Some(tag) = kind_from_column(k)
            && let Err(error) = check_kind_version(tag, version)
        {
            return Err(BlockError::Event {
                index: first(),
                error,
            });
        }
        if rows != count {
            return Err(BlockError::KindRows {
                column,
                rows,
                events: count,
            });
        }
    }
    // Columns of kinds no event has must be absent or empty too.
    for k in 1..=KindTag::COUNT as u8 {
        if let Some((rows, column)) = kind_rows(&block, k)
            && rows != counts[usize::from(k)]
        {
            return Err(BlockError::KindRows {
                column,
                rows,
                events: counts[usize::from(k)],
            });
        }
    }
    let count = block.requests().len();
    for (index, value) in block.request().iter().enumerate() {
        if usize::from(value) > count {
            return Err(BlockError::RequestIndex {
                index,
                value,
                count,
            });
        }
    }
    Ok(BlockView {
        block,
        bytes,
        len: events,
    })
}

impl<'a> BlockView<'a> {
    /// Events in the block (at least one).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a verified block holds at least one event.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sequence numbers, one per event.
    pub fn seqs(&self) -> impl Iterator<Item = u64> + 'a {
        let deltas = self.block.seq_delta();
        // Without the column the seqs are consecutive: +1 (zigzag 2) after
        // the first. verify_block checked the column's length.
        let zigzags = (0..self.len).map(move |i| match deltas {
            Some(v) => u64::from(v.get(i)),
            None => 2 * u64::from(i > 0),
        });
        undelta(self.block.base_seq(), zigzags)
    }

    /// The timestamps, one per event.
    pub fn timestamps(&self) -> impl Iterator<Item = u64> + 'a {
        undelta(
            self.block.base_ts_ns(),
            self.block.ts_delta().iter().map(u64::from),
        )
    }

    /// The sequence number and timestamp of each event.
    pub fn seqs_and_timestamps(&self) -> impl Iterator<Item = (u64, u64)> + 'a {
        self.seqs().zip(self.timestamps())
    }

    /// The engine of the block's last event.
    pub fn last_engine(&self) -> u32 {
        let b = &self.block;
        // verify_block checked the column's length against the count (≥ 1).
        b.engine()
            .map_or(b.base_engine(), |v| v.get(self.len.saturating_sub(1)))
    }

    /// The block's bytes, as verified.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The block's first and last seq and its timestamp range, after
    /// checking that its seqs strictly increase (what a log and a batch
    /// require of a block, and what its own columns cannot promise).
    pub fn span(&self) -> Result<BlockSpan, BlockError> {
        let b = &self.block;
        // Without a seq column the seqs are consecutive from the base: only
        // their end can go wrong (past u64::MAX, where they would wrap).
        // The timestamps are summed in one plain loop: this runs for every
        // block a fleet recorder receives.
        let consecutive_last = match b.seq_delta() {
            None => b.base_seq().checked_add(self.len as u64 - 1),
            Some(_) => None,
        };
        let Some(last_seq) = consecutive_last else {
            return self.span_of_seqs();
        };
        let (mut min_ts, mut max_ts) = (u64::MAX, 0);
        let mut ts = b.base_ts_ns();
        for z in b.ts_delta().iter() {
            ts = ts.wrapping_add(unzigzag(u64::from(z)));
            min_ts = min_ts.min(ts);
            max_ts = max_ts.max(ts);
        }
        Ok(BlockSpan {
            first_seq: b.base_seq(),
            last_seq,
            min_ts,
            max_ts,
        })
    }

    /// [`span`](Self::span) of a block with a seq column, event by event.
    fn span_of_seqs(&self) -> Result<BlockSpan, BlockError> {
        let mut it = self.seqs_and_timestamps();
        // verify_block refused an empty block.
        let Some((first_seq, ts)) = it.next() else {
            return Err(BlockError::Empty);
        };
        let mut s = BlockSpan {
            first_seq,
            last_seq: first_seq,
            min_ts: ts,
            max_ts: ts,
        };
        for (i, (seq, ts)) in it.enumerate() {
            if seq <= s.last_seq {
                return Err(BlockError::SeqOrder {
                    index: i + 1,
                    seq,
                    after: s.last_seq,
                });
            }
            s.last_seq = seq;
            s.min_ts = s.min_ts.min(ts);
            s.max_ts = s.max_ts.max(ts);
        }
        Ok(s)
    }

    /// Checks every event's values as [`decode_into`](Self::decode_into)
    /// does, without building the events: for a consumer that keeps the
    /// block as it is, such as a recorder writing a received block into
    /// its log, and must not keep one that a reader would refuse. It checks
    /// a column at a time, and only the fields that can be wrong (enums,
    /// token counts, a duplicate without its flag), through the same
    /// conversions as decoding; a property test holds the two to the same
    /// verdict. On an error it names one bad event (not always the first).
    pub fn validate(&self) -> Result<(), BlockError> {
        let kinds = self.block.kind().bytes();
        let mut present = [false; 256];
        for &k in kinds {
            present[usize::from(k)] = true;
        }
        for k in (0..=u8::MAX).filter(|&k| present[usize::from(k)]) {
            let checked = match kind_from_column(k) {
                Some(tag) => check_column(&self.block, tag),
                None => Err((0, DecodeError::UnknownKind(k))),
            };
            if let Err((row, error)) = checked {
                // The row-th event of kind k.
                let index = kinds
                    .iter()
                    .enumerate()
                    .filter(|&(_, &x)| x == k)
                    .nth(row)
                    .map_or(0, |(i, _)| i);
                return Err(BlockError::Event { index, error });
            }
        }
        Ok(())
    }

    /// Decodes every event of the block, in order, appending them to `out`.
    /// On an error, `out` holds the events before the bad one.
    pub fn decode_into(&self, out: &mut Vec<Event>) -> Result<(), BlockError> {
        let b = &self.block;
        let requests: Vec<Arc<str>> = b.requests().iter().map(Arc::from).collect();
        let (engine, base_engine, request) = (b.engine(), b.base_engine(), b.request());
        let mut seqs = self.seqs();
        let mut timestamps = self.timestamps();
        let mut iterations = undelta(
            b.base_iteration(),
            b.iteration_delta().iter().map(u64::from),
        );
        let kinds = b.kind().bytes();
        // The next unread row of each kind's column.
        let mut next = [0usize; 256];
        out.reserve(self.len);
        for (index, &k) in kinds.iter().enumerate() {
            let row = next[usize::from(k)];
            next[usize::from(k)] += 1;
            let kind = self
                .kind_at(k, row)
                .map_err(|error| BlockError::Event { index, error })?;
            let request = match request.get(index) {
                0 => None,
                // verify_block checked that the index is in range.
                r => Some(Arc::clone(&requests[usize::from(r) - 1])),
            };
            // All columns have `len` entries (verify_block), so none runs
            // out before `kinds` does.
            let (Some(seq), Some(ts_ns), Some(iteration)) =
                (seqs.next(), timestamps.next(), iterations.next())
            else {
                break;
            };
            out.push(Event {
                engine: engine.map_or(base_engine, |v| v.get(index)),
                seq,
                ts_ns,
                iteration,
                request,
                kind,
            });
        }
        Ok(())
    }

    /// Row `row` of kind `k`'s column. `verify_block` checked that the
    /// column has a row for every event of its kind, so it is there.
    fn kind_at(&self, k: u8, row: usize) -> Result<EventKind, DecodeError> {
        let tag = kind_from_column(k).ok_or(DecodeError::UnknownKind(k))?;
        kind_at(&self.block, tag, row)
    }
}

/// The row of a `TransferPlanned`, `TransferPromoted` or
/// `TransferCompleted` (their columns share the row type).
fn transfer_row(transfer: u64, direction: Direction, blocks: u32) -> fb::TransferRow {
    fb::TransferRow::new(transfer, &direction_to_fb(direction), blocks)
}

/// Decodes a `BlockRegistered` row, refusing a `duplicate_of` set without
/// its flag.
fn block_registered_from_row(r: &fb::BlockRegisteredRow) -> Result<EventKind, DecodeError> {
    let duplicate_of = if r.has_duplicate() {
        Some(r.duplicate_of())
    } else if r.duplicate_of() != 0 {
        return Err(DecodeError::UnexpectedValue {
            field: "BlockRegisteredRow.duplicate_of",
            value: u64::from(r.duplicate_of()),
        });
    } else {
        None
    };
    Ok(EventKind::BlockRegistered {
        tier: tier_from_fb(r.tier(), "BlockRegistered.tier")?,
        block: r.block(),
        sequence_hash: SequenceHash(r.sequence_hash()),
        duplicate_of,
    })
}

/// `to - from`, wrapping, zigzag-encoded: small either way.
fn delta(from: u64, to: u64) -> u64 {
    let d = to.wrapping_sub(from);
    (d << 1) ^ (((d as i64) >> 63) as u64)
}

/// The values whose [`delta`]s from `base` (then from each other) are
/// `deltas`.
fn undelta(base: u64, deltas: impl Iterator<Item = u64>) -> impl Iterator<Item = u64> {
    deltas.scan(base, |prev, z| {
        *prev = prev.wrapping_add(unzigzag(z));
        Some(*prev)
    })
}

/// The difference a [`delta`] encodes.
fn unzigzag(z: u64) -> u64 {
    (z >> 1) ^ (z & 1).wrapping_neg()
}

/// Verifies and decodes a whole block.
pub fn decode_block(bytes: &[u8]) -> Result<Vec<Event>, BlockError> {
    let view = verify_block(bytes)?;
    let mut out = Vec::with_capacity(view.len());
    view.decode_into(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::values::tests::{apply, mutation};
    use kvbm_events::testing::{event, sample_events};
    use proptest::collection::vec;
    use proptest::prelude::*;

    /// The events as blocks, a new one whenever the next event does not
    /// fit.
    fn encode(events: &[Event]) -> Vec<Vec<u8>> {
        let mut enc = BlockEncoder::new();
        let mut blocks = Vec::new();
        for e in events {
            if !enc.push(e) {
                blocks.push(enc.finish().to_vec());
                assert!(enc.push(e), "an empty block takes any event");
            }
        }
        blocks.push(enc.finish().to_vec());
        blocks
    }

    fn decode(blocks: &[Vec<u8>]) -> Result<Vec<Event>, BlockError> {
        let mut out = Vec::new();
        for b in blocks {
            out.extend(decode_block(b)?);
        }
        Ok(out)
    }

    /// No panic, a readable error, and anything accepted re-encodes to
    /// blocks that decode to the same events.
    fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
        match decode_block(bytes) {
            Ok(events) => {
                prop_assert!(!events.is_empty());
                prop_assert_eq!(decode(&encode(&events)), Ok(events));
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        Ok(())
    }

    fn ev(seq: u64, ts_ns: u64, iteration: u64) -> Event {
        Event {
            seq,
            ts_ns,
            iteration,
            ..sample_events()[0].clone()
        }
    }

    #[test]
    fn sample_events_round_trip_and_share_request_ids() {
        let events = sample_events();
        let blocks = encode(&events);
        assert_eq!(&blocks[0][4..8], BLOCK_IDENTIFIER.as_bytes());
        assert_eq!(decode(&blocks), Ok(events.clone()));
        // The encoder is reused: a second block holds nothing of the first.
        let mut enc = BlockEncoder::new();
        for e in &events {
            enc.push(e);
        }
        enc.finish();
        enc.push(&events[0]);
        assert_eq!(enc.len(), 1);
        assert_eq!(decode_block(enc.finish()), Ok(vec![events[0].clone()]));
        // Many events of one request store its id once.
        let many: Vec<Event> = (0..100).map(|i| ev(i, 1000 - i, 7)).collect();
        let blocks = encode(&many);
        assert_eq!(blocks.len(), 1);
        let view = verify_block(&blocks[0]).unwrap();
        assert_eq!(view.block.requests().len(), 1);
        assert!(view.block.engine().is_none(), "one engine: no column");
        assert!(view.block.seq_delta().is_none(), "consecutive: no column");
        assert_eq!(
            view.seqs().collect::<Vec<_>>(),
            (0..100).collect::<Vec<_>>()
        );
        assert_eq!(view.timestamps().last(), Some(901));
        assert_eq!(decode(&blocks), Ok(many));
        // Separate `Arc`s with the same text are one request id too.
        let fresh: Vec<Event> = (0..10)
            .map(|i| Event {
                request: Some(Arc::from(if i % 2 == 0 { "a" } else { "b" })),
                ..ev(i, i, 0)
            })
            .collect();
        let blocks = encode(&fresh);
        assert_eq!(verify_block(&blocks[0]).unwrap().block.requests().len(), 2);
        assert_eq!(decode(&blocks), Ok(fresh));
    }

    /// `validate` refuses exactly what decoding refuses, on every byte of a
    /// block holding every kind changed to values no enum has: the check a
    /// fleet recorder makes instead of decoding keeps nothing a reader
    /// would refuse, and refuses nothing a reader would take.
    #[test]
    fn validate_agrees_with_decoding_on_every_changed_byte() {
        let good = encode(&sample_events()).remove(0);
        let mut value_errors = 0;
        for at in 0..good.len() {
            for v in [0x05u8, 0x7F, 0xEE] {
                let mut b = good.clone();
                b[at] = v;
                let Ok(view) = verify_block(&b) else { continue };
                let mut evs = Vec::new();
                let decoded = view.decode_into(&mut evs);
                let validated = view.validate();
                assert_eq!(
                    decoded.is_ok(),
                    validated.is_ok(),
                    "byte {at} = {v:#x}: decode {decoded:?}, validate {validated:?}"
                );
                value_errors += usize::from(decoded.is_err());
            }
        }
        assert!(
            value_errors > 20,
            "only {value_errors} value errors exercised"
        );
    }

    #[test]
    fn a_gap_in_the_sequence_brings_in_the_seq_column() {
        let events: Vec<Event> = [5, 6, 9, 10].map(|i| ev(i, i, 0)).to_vec();
        let blocks = encode(&events);
        let view = verify_block(&blocks[0]).unwrap();
        assert_eq!(
            view.block.seq_delta().map(|v| v.iter().collect::<Vec<_>>()),
            Some(vec![0, 2, 6, 2])
        );
        assert_eq!(view.seqs().collect::<Vec<_>>(), [5, 6, 9, 10]);
        assert_eq!(decode(&blocks), Ok(events));
    }

    #[test]
    fn a_second_engine_brings_in_the_engine_column() {
        let events: Vec<Event> = (0..6)
            .map(|i| Event {
                engine: if i < 3 { 7 } else { 8 + (i % 2) as u32 },
                ..ev(i, i, i)
            })
            .collect();
        let blocks = encode(&events);
        assert_eq!(blocks.len(), 1);
        let view = verify_block(&blocks[0]).unwrap();
        assert_eq!(view.block.base_engine(), 7);
        assert_eq!(
            view.block.engine().map(|v| v.iter().collect::<Vec<_>>()),
            Some(vec![7, 7, 7, 9, 8, 9])
        );
        assert_eq!(decode(&blocks), Ok(events));
    }

    #[test]
    fn differences_that_do_not_fit_start_a_new_block() {
        let mut enc = BlockEncoder::new();
        assert!(
            enc.fits(&ev(u64::MAX, 0, 0)),
            "an empty block takes anything"
        );
        enc.push(&ev(10, 1_000, 5));
        assert!(enc.fits(&ev(10 + 32_767, 1_000 + (u32::MAX as u64 / 2), 5 + 32_767)));
        assert!(enc.fits(&ev(
            10u64.wrapping_sub(32_768),
            1_000u64.wrapping_sub(u32::MAX as u64 / 2 + 1),
            5
        )));
        assert!(!enc.fits(&ev(10 + 32_768, 1_000, 5)));
        assert!(!enc.fits(&ev(11, 1_000 + (1 << 31), 5)));
        assert!(!enc.fits(&ev(11, 1_000, 5 + 40_000)));
        let t = 1u64 << 40;
        let wild = [
            ev(0, 0, 0),
            ev(t, 0, 0),
            ev(t + 1, t, 0),
            ev(t + 2, t, 1 << 20),
            ev(t + 3, t - 5, 1 << 20),
        ];
        let blocks = encode(&wild);
        assert_eq!(blocks.len(), 4);
        assert_eq!(decode(&blocks), Ok(wild.to_vec()));
    }

    /// A block of two HookCall events built by hand, with `ts` timestamp
    /// deltas, these request indices and `rows` HookCall rows.
    fn hand_block(ts: &[u32], request: &[u16], rows: usize) -> Vec<u8> {
        let mut fbb = FlatBufferBuilder::new();
        let seq = fbb.create_vector(&[0u16, 2]);
        let ts = fbb.create_vector(ts);
        let engine = fbb.create_vector(&[0u32, 0]);
        let iteration = fbb.create_vector(&[0u16, 0]);
        let request = fbb.create_vector(request);
        let kind = fbb.create_vector(&[crate::values::kind_to_column(KindTag::HookCall); 2]);
        let requests = fbb.create_vector::<WIPOffset<&str>>(&[]);
        let row = fb::HookCallRow::new(fb::EntryPoint::CreateSlot, fb::HookPhase::Will);
        let hook_call = fbb.create_vector(&vec![row; rows]);
        let root = fb::EventBlock::create(
            &mut fbb,
            &fb::EventBlockArgs {
                seq_delta: Some(seq),
                ts_delta: Some(ts),
                engine: Some(engine),
                iteration_delta: Some(iteration),
                request: Some(request),
                kind: Some(kind),
                requests: Some(requests),
                hook_call: Some(hook_call),
                ..Default::default()
            },
        );
        fbb.finish(root, Some(BLOCK_IDENTIFIER));
        fbb.finished_data().to_vec()
    }

    /// A block of one PrefixLookup, claiming `version`.
    fn lookup_block(version: u16) -> Vec<u8> {
        let mut fbb = FlatBufferBuilder::new();
        let ts = fbb.create_vector(&[0u32]);
        let iteration = fbb.create_vector(&[0u16]);
        let request = fbb.create_vector(&[0u16]);
        let kind = fbb.create_vector(&[crate::values::kind_to_column(KindTag::PrefixLookup)]);
        let requests = fbb.create_vector::<WIPOffset<&str>>(&[]);
        let hashes = fbb.create_vector(&[5u64, 6]);
        let t = fb::PrefixLookup::create(
            &mut fbb,
            &fb::PrefixLookupArgs {
                tokens: 33,
                block_size: 16,
                computed_blocks: 0,
                hashes: Some(hashes),
            },
        );
        let lookups = fbb.create_vector(&[t]);
        let root = fb::EventBlock::create(
            &mut fbb,
            &fb::EventBlockArgs {
                schema_version: version,
                ts_delta: Some(ts),
                iteration_delta: Some(iteration),
                request: Some(request),
                kind: Some(kind),
                requests: Some(requests),
                prefix_lookup: Some(lookups),
                ..Default::default()
            },
        );
        fbb.finish(root, Some(BLOCK_IDENTIFIER));
        fbb.finished_data().to_vec()
    }

    #[test]
    fn version_1_blocks_read_and_may_not_hold_a_later_kind() {
        // hand_block leaves schema_version at its default, 1: an old log's
        // block, which this build reads.
        let old = hand_block(&[0, 0], &[0, 0], 2);
        assert_eq!(
            flatbuffers::root::<fb::EventBlock>(&old)
                .unwrap()
                .schema_version(),
            1
        );
        assert_eq!(decode_block(&old).unwrap().len(), 2);
        // What this build writes is version 2.
        let mut enc = BlockEncoder::new();
        assert!(enc.push(&sample_events()[0]));
        let new = enc.finish().to_vec();
        assert_eq!(
            flatbuffers::root::<fb::EventBlock>(&new)
                .unwrap()
                .schema_version(),
            2
        );
        let v2 = decode_block(&lookup_block(2)).unwrap();
        assert!(matches!(
            v2[0].kind,
            EventKind::PrefixLookup { tokens: 33, .. }
        ));
        assert_eq!(
            verify_block(&lookup_block(1)).unwrap_err(),
            BlockError::Event {
                index: 0,
                error: DecodeError::KindNewerThanVersion {
                    kind: "PrefixLookup",
                    since: 2,
                    version: 1
                }
            }
        );
        assert_eq!(
            verify_block(&lookup_block(3)).unwrap_err(),
            BlockError::UnsupportedVersion { found: 3 }
        );
    }

    #[test]
    fn inconsistent_columns_are_refused() {
        let good = decode_block(&hand_block(&[0, 0], &[0, 0], 2)).unwrap();
        assert_eq!(good.iter().map(|e| e.seq).collect::<Vec<_>>(), [0, 1]);
        assert!(matches!(
            verify_block(&hand_block(&[0], &[0, 0], 2)),
            Err(BlockError::ColumnLength {
                column: "ts_delta",
                len: 1,
                events: 2
            })
        ));
        assert!(matches!(
            verify_block(&hand_block(&[0, 0], &[0, 0], 1)),
            Err(BlockError::KindRows {
                column: "hook_call",
                rows: 1,
                events: 2
            })
        ));
        assert!(matches!(
            verify_block(&hand_block(&[0, 0], &[0, 3], 2)),
            Err(BlockError::RequestIndex {
                index: 1,
                value: 3,
                count: 0
            })
        ));
        assert!(decode_block(b"short").is_err());
        let mut other = encode(&sample_events()).remove(0);
        other[4..8].copy_from_slice(b"KVBE");
        assert!(matches!(
            decode_block(&other),
            Err(BlockError::WrongIdentifier { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// A block's span is its events' own (first and last seq, least
        /// and greatest timestamp), and it is refused exactly when the
        /// seqs do not strictly increase: with a seq column or without
        /// one (consecutive seqs), up to the end of the u64 range.
        #[test]
        fn a_span_is_the_events_own(
            mut events in vec(event(), 1..40),
            consecutive_from in proptest::option::of(prop_oneof![
                Just(0u64), any::<u64>(), (u64::MAX - 50)..=u64::MAX
            ]),
        ) {
            if let Some(base) = consecutive_from {
                for (i, e) in events.iter_mut().enumerate() {
                    e.seq = base.wrapping_add(i as u64);
                }
            }
            for block in encode(&events) {
                let view = verify_block(&block).unwrap();
                let mut evs = Vec::new();
                view.decode_into(&mut evs).unwrap();
                let increasing = evs.windows(2).all(|w| w[0].seq < w[1].seq);
                match view.span() {
                    Ok(s) => {
                        prop_assert!(increasing);
                        prop_assert_eq!(s.first_seq, evs[0].seq);
                        prop_assert_eq!(s.last_seq, evs[evs.len() - 1].seq);
                        prop_assert_eq!(s.min_ts, evs.iter().map(|e| e.ts_ns).min().unwrap());
                        prop_assert_eq!(s.max_ts, evs.iter().map(|e| e.ts_ns).max().unwrap());
                    }
                    Err(e) => prop_assert!(!increasing, "{e}"),
                }
            }
        }

        #[test]
        fn any_events_round_trip(events in vec(event(), 1..40)) {
            prop_assert_eq!(decode(&encode(&events)), Ok(events));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn random_bytes_never_panic(mut bytes in vec(any::<u8>(), 0..512), with_id in any::<bool>()) {
            if with_id && bytes.len() >= 8 {
                bytes[4..8].copy_from_slice(BLOCK_IDENTIFIER.as_bytes());
            }
            check(&bytes)?;
        }

        #[test]
        fn mutated_blocks_never_panic(events in vec(event(), 1..12), muts in vec(mutation(), 1..4)) {
            let blocks = encode(&events);
            let mut bytes = blocks[0].clone();
            for m in &muts {
                if bytes.len() < 8 {
                    break;
                }
                apply(&mut bytes, m);
            }
            check(&bytes)?;
        }
    }
}
