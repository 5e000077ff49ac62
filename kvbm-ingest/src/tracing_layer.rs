//! A [`tracing_subscriber::Layer`] that turns `tracing` events into kvbm bus
//! events, so an engine instrumented only with `tracing` macros feeds the
//! same recorder, attach server and console as one that calls the
//! [`Emitter`] directly.
//!
//! ```ignore
//! use tracing_subscriber::prelude::*;
//! let emitter = Arc::new(Emitter::new(0, BusConfig::default(), Arc::new(MonotonicClock::new()))?);
//! let layer = KvbmLayer::new(emitter.clone());
//! let stats = layer.handle();
//! tracing_subscriber::registry().with(layer).init();
//!
//! tracing::info!(target: "kvbm", kind = "slot_created", request_id = %id, prompt_tokens = 512);
//! tracing::info!(target: "kvbm", kind = "slot_transition", request_id = %id, state = "Prefilling");
//! ```
//!
//! The layout follows tokio-console's `console-subscriber`: the hot path
//! (`on_event`) reads the fields into a small fixed struct (numbers, tiers,
//! directions and states are parsed in place, without allocating; a
//! request id the per-request table knows reuses its `Arc<str>`), updates
//! shared state (atomic
//! counters and a bounded per-request table), and hands one [`EventKind`]
//! to the [`Emitter`], whose bus carries it to the recorder's tap. The tap
//! is bounded and counts what it drops ([`kvbm_events::bus::BusCounters`]); what
//! the layer itself refuses is counted in [`LayerStats`], per reason. Nothing
//! here panics on bad input, and nothing here knows of files, sockets or
//! terminals.
//!
//! # Which events
//!
//! Events whose target is `kvbm` or starts with `kvbm::`; every other target
//! is left alone (and costs one string comparison). Spans are ignored. An
//! event without a `kind` field, or with a kind not in the table, is counted
//! and dropped. Fields not named below (`message`, anything else) are
//! ignored, so the same event can also go to a `fmt` layer.
//!
//! # Vocabulary
//!
//! Every event may carry `request_id` (any value: a string, `%display`, or a
//! number) and `iteration` (sets the emitter's scheduler iteration before
//! the event is stamped). Numbers may be given as integers or as strings;
//! `hash` also as `0x…` hex. A tier is `G1`/`G2`/`G3` (or `device`, `host`,
//! `disk`); a direction is `G1->G2` (or `G1→G2`); a slot state is one of
//! [`SlotState::NAMES`], with `OnboardStaged(16)` / `Onboarding(16)` or a
//! separate `tokens = 16` for the two that carry a token count.
//!
//! | `kind`              | required fields                         | optional (default)                   | emits |
//! |---------------------|-----------------------------------------|--------------------------------------|-------|
//! | `iteration`         | `iteration`                             |                                      | nothing (sets the iteration) |
//! | `slot_created`      | `request_id`                            | `prompt_tokens` (0), `max_output_tokens` (0) | [`EventKind::SlotCreated`] |
//! | `slot_transition`   | `request_id`, `state` (or `to`)         | `from` (the last state seen for the request) | [`EventKind::SlotTransition`] |
//! | `match_result`      | `tier`                                  | `looked_up`, `hit_blocks`, `hit_tokens` (0) | [`EventKind::MatchResult`] |
//! | `blocks_allocated`  | `tier`, `blocks`: a list `"3,4,5"`, or a count with `first_block` (0) | | [`EventKind::BlocksAllocated`] |
//! | `blocks_released`   | `tier`, `count` (or `blocks` as a count) |                                     | [`EventKind::BlocksReleased`] |
//! | `block_registered`  | `tier`, `block`, `hash`                 | `duplicate_of` (none)                | [`EventKind::BlockRegistered`] |
//! | `block_evicted`     | `tier`, `block`, `hash`                 |                                      | [`EventKind::BlockEvicted`] |
//! | `transfer_planned`  | `transfer`, `direction`, `blocks`       |                                      | [`EventKind::TransferPlanned`] |
//! | `transfer_promoted` | `transfer`, `direction`, `blocks`       |                                      | [`EventKind::TransferPromoted`] |
//! | `transfer_completed`| `transfer`, `direction`, `blocks`       |                                      | [`EventKind::TransferCompleted`] |
//! | `transfer_skipped`  | `transfer`, `direction`                 | `reason` (`""`)                      | [`EventKind::TransferSkipped`] |
//! | `transfer_cancelled`| `transfer`, `direction`                 |                                      | [`EventKind::TransferCancelled`] |
//! | `transfer_failed`   | `transfer`, `direction`                 | `error` (`""`)                       | [`EventKind::TransferFailed`] |
//! | `batch_dispatched`  | `batch`, `direction`                    | `transfers` (list, empty), `blocks` (0) | [`EventKind::BatchDispatched`] |
//! | `batch_completed`   | `batch`, `direction`                    | `ok` (true), `blocks`, `bytes`, `elapsed_ns` (0) | [`EventKind::BatchCompleted`] |
//! | `pool_gauge`        | `tier`, `capacity`                      | `active`, `inactive`, `empty` (0)    | [`EventKind::PoolGauge`] |
//! | `tokens_scheduled`  | `request_id`                            | `prefill`, `decode`, `computed` (0)  | [`EventKind::TokensScheduled`] |
//! | `prefix_lookup`     | `request_id`, `tokens`, `block_size`, `hashes`: a list `"0x1f,0x2e"` | `computed_blocks` (0) | [`EventKind::PrefixLookup`] |
//! | any other kind      | each field of the kind, under its name in [`EventKind`] | a field of an `Option` type (none) | the kind |
//!
//! Kind names are the [`EventKind`] names in snake_case; hook and breakpoint
//! events are not accepted (they belong to `kvbm_core::hooks`).
//!
//! # Shared state and its bounds
//!
//! For `slot_transition` without `from`, the layer remembers each request's
//! last state. The table holds at most [`KvbmLayer::with_max_requests`]
//! requests (default [`DEFAULT_MAX_REQUESTS`]); a request reaching
//! `Finished` is forgotten; a request that finds the table full is not
//! tracked and counted ([`LayerStats::untracked_requests`]), and a
//! transition that then has no `from` is emitted with `from = to` and
//! counted ([`LayerStats::unknown_from`]).
//!
//! An event is emitted only when every field the layer knows parses; one
//! bad value refuses the whole event ([`LayerStats::bad_value`]).

use kvbm_events::SequenceHash;
use kvbm_events::fields::FieldSource;
use kvbm_events::slot::SlotState;
use kvbm_events::tier::{BlockId, Tier};
use kvbm_events::{Category, Direction, Emitter, EventKind, KindTag, RequestId};
use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use tracing::field::{Field, Visit};
use tracing::{Event as TracingEvent, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// The target (or target prefix, as `kvbm::…`) the layer listens to.
pub const TARGET: &str = "kvbm";

/// Default cap on the requests whose last state the layer remembers.
pub const DEFAULT_MAX_REQUESTS: usize = 65_536;

/// Longest list (`blocks = "1,2,…"`, `transfers = …`) accepted.
pub const MAX_LIST_LEN: usize = 4096;

/// What the layer saw and refused, per reason. A snapshot of counters that
/// move independently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerStats {
    /// Events with a kvbm target.
    pub seen: u64,
    /// Events handed to the emitter (the bus counts what its tap dropped).
    pub emitted: u64,
    /// `kind = "iteration"` markers applied.
    pub iterations: u64,
    /// Events without a `kind` field.
    pub missing_kind: u64,
    /// Events whose kind is not in the vocabulary.
    pub unknown_kind: u64,
    /// Events missing a required field.
    pub missing_field: u64,
    /// Events with a known field whose value did not parse.
    pub bad_value: u64,
    /// Transitions emitted with `from = to` because the previous state was
    /// unknown.
    pub unknown_from: u64,
    /// Requests not tracked because the per-request table was full.
    pub untracked_requests: u64,
    /// Requests tracked now.
    pub tracked_requests: u64,
}

#[derive(Debug, Default)]
struct Counters {
    seen: AtomicU64,
    emitted: AtomicU64,
    iterations: AtomicU64,
    missing_kind: AtomicU64,
    unknown_kind: AtomicU64,
    missing_field: AtomicU64,
    bad_value: AtomicU64,
    unknown_from: AtomicU64,
    untracked_requests: AtomicU64,
}

#[derive(Debug)]
struct Shared {
    emitter: Arc<Emitter>,
    counters: Counters,
    max_requests: AtomicUsize,
    // Last known state per live request; bounded by `max_requests`.
    requests: Mutex<HashMap<RequestId, SlotState>>,
}

/// The layer. See the module docs.
#[derive(Debug, Clone)]
pub struct KvbmLayer {
    shared: Arc<Shared>,
}

/// A cloneable handle on a [`KvbmLayer`]'s counters, kept after the layer
/// went into a subscriber.
#[derive(Debug, Clone)]
pub struct KvbmLayerHandle {
    shared: Arc<Shared>,
}

impl KvbmLayer {
    /// A layer publishing through `emitter`.
    pub fn new(emitter: Arc<Emitter>) -> Self {
        KvbmLayer {
            shared: Arc::new(Shared {
                emitter,
                counters: Counters::default(),
                max_requests: AtomicUsize::new(DEFAULT_MAX_REQUESTS),
                requests: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Caps the per-request state table (at least 1). Lowering the cap
    /// forgets nothing already tracked; it stops new requests coming in.
    pub fn with_max_requests(self, max: usize) -> Self {
        self.shared.max_requests.store(max.max(1), Relaxed);
        self
    }

    /// A handle on the counters.
    pub fn handle(&self) -> KvbmLayerHandle {
        KvbmLayerHandle {
            shared: self.shared.clone(),
        }
    }

    /// The counters now.
    pub fn stats(&self) -> LayerStats {
        self.shared.stats()
    }

    /// The emitter events go to.
    pub fn emitter(&self) -> &Arc<Emitter> {
        &self.shared.emitter
    }
}

impl KvbmLayerHandle {
    /// The counters now.
    pub fn stats(&self) -> LayerStats {
        self.shared.stats()
    }

    /// The emitter events go to (for its bus counters).
    pub fn emitter(&self) -> &Arc<Emitter> {
        &self.shared.emitter
    }
}

/// True for `kvbm` and `kvbm::…`.
pub fn is_kvbm_target(target: &str) -> bool {
    match target.strip_prefix(TARGET) {
        Some(rest) => rest.is_empty() || rest.starts_with("::"),
        None => false,
    }
}

impl<S: Subscriber> Layer<S> for KvbmLayer {
    fn on_event(&self, event: &TracingEvent<'_>, _ctx: Context<'_, S>) {
        if !is_kvbm_target(event.metadata().target()) {
            return;
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        self.shared.handle(fields);
    }
}

// ------------------------------------------------------------ the vocabulary

/// What a `kind` field names: the iteration marker, or an event kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Iteration,
    Event(KindTag),
}

/// The `kind` value that sets the scheduler iteration.
pub const ITERATION: &str = "iteration";

/// Whether an engine may emit `tag` through `tracing`: breakpoints and hook
/// calls are the block manager's own (its hooks emit them), so a traced
/// engine cannot.
const fn traced(tag: KindTag) -> bool {
    !matches!(tag.category(), Category::Hook | Category::Breakpoint)
}

/// The accepted `kind` values: [`ITERATION`] and the snake_case name of
/// every event kind but hook calls and breakpoints.
pub fn kind_names() -> impl Iterator<Item = &'static str> {
    std::iter::once(ITERATION).chain(
        KindTag::ALL
            .iter()
            .filter(|k| traced(**k))
            .map(|k| k.snake_name()),
    )
}

fn parse_kind(s: &str) -> Option<Kind> {
    if s == ITERATION {
        return Some(Kind::Iteration);
    }
    KindTag::from_snake_name(s)
        .filter(|k| traced(*k))
        .map(Kind::Event)
}

/// Numeric fields, by position in [`Fields::num`].
#[derive(Debug, Clone, Copy)]
enum Num {
    PromptTokens,
    MaxOutputTokens,
    LookedUp,
    HitBlocks,
    HitTokens,
    Count,
    Block,
    FirstBlock,
    Hash,
    DuplicateOf,
    Transfer,
    Blocks,
    Bytes,
    Batch,
    ElapsedNs,
    Capacity,
    Active,
    Inactive,
    Empty,
    Prefill,
    Decode,
    Computed,
    Iteration,
    Tokens,
    BlockSize,
    ComputedBlocks,
}

const NUMS: usize = 26;

fn parse_tier(s: &str) -> Option<Tier> {
    Some(match s {
        "G1" | "g1" | "device" | "Device" => Tier::Device,
        "G2" | "g2" | "host" | "Host" => Tier::Host,
        "G3" | "g3" | "disk" | "Disk" => Tier::Disk,
        _ => return None,
    })
}

fn parse_direction(s: &str) -> Option<Direction> {
    let (src, dst) = s.split_once("->").or_else(|| s.split_once('→'))?;
    let (src, dst) = (parse_tier(src.trim())?, parse_tier(dst.trim())?);
    (src != dst).then_some(Direction { src, dst })
}

/// `Name` or `Name(n)`; `tokens` fills the count when the name has none.
fn parse_state(s: &str, tokens: Option<u64>) -> Option<SlotState> {
    let (name, n) = match s.split_once('(') {
        Some((name, rest)) => (name, Some(rest.strip_suffix(')')?.trim().parse().ok()?)),
        None => (s, None),
    };
    let n: usize = match n.or(tokens) {
        Some(v) => usize::try_from(v).ok()?,
        None => 0,
    };
    Some(match name.trim() {
        "Initialized" => SlotState::Initialized,
        "OnboardStaged" => SlotState::OnboardStaged(n),
        "Onboarding" => SlotState::Onboarding(n),
        "Prefilling" => SlotState::Prefilling,
        "Decoding" => SlotState::Decoding,
        "SkippedPrefill" => SlotState::SkippedPrefill,
        "SkippedDecode" => SlotState::SkippedDecode,
        "Preempted" => SlotState::Preempted,
        "Finishing" => SlotState::Finishing,
        "Finished" => SlotState::Finished,
        _ => return None,
    })
}

fn parse_u64(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

fn parse_list(s: &str) -> Option<Vec<u64>> {
    let s = s.trim().trim_start_matches('[').trim_end_matches(']');
    if s.trim().is_empty() {
        return Some(Vec::new());
    }
    let mut out = Vec::new();
    for part in s.split(',') {
        if out.len() >= MAX_LIST_LEN {
            return None;
        }
        out.push(parse_u64(part)?);
    }
    Some(out)
}

// ------------------------------------------------------------ field reading

/// What one event said, in fixed slots. A request id of a tracked request,
/// and numbers, tiers, states and directions, cost no allocation.
#[derive(Debug, Default)]
struct Fields {
    kind: Option<Result<Kind, ()>>,
    request: Option<ReqText>,
    // State strings are parsed once `tokens` is known; kept on the stack.
    state: Option<Small>,
    from: Option<Small>,
    tier: Option<Tier>,
    direction: Option<Direction>,
    num: [Option<u64>; NUMS],
    ok: Option<bool>,
    text: Option<String>,
    blocks_list: Option<Vec<u64>>,
    transfers: Option<Vec<u64>>,
    hashes: Option<Vec<u64>>,
    /// Fields of names not above, as text, for the kinds read by their
    /// declared names (`EventKind::read_fields`); at most [`OTHERS`], on
    /// the stack.
    other: [Option<(&'static str, Small)>; OTHERS],
    bad: bool,
}

/// Fields of other names kept per event; a field beyond these is ignored,
/// as every unknown field is.
const OTHERS: usize = 4;

/// A short string on the stack (state names, numbers written with `?`).
#[derive(Clone, Copy)]
struct Small {
    buf: [u8; 48],
    len: usize,
    overflow: bool,
}

impl Default for Small {
    fn default() -> Self {
        Small {
            buf: [0; 48],
            len: 0,
            overflow: false,
        }
    }
}

impl fmt::Debug for Small {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl Small {
    fn copy_of(s: &str) -> Small {
        let mut out = Small::default();
        let _ = out.write_str(s);
        out
    }

    fn from_debug(v: &dyn fmt::Debug) -> Small {
        let mut out = Small::default();
        let _ = write!(out, "{v:?}");
        out
    }

    /// The text, without the quotes `?"x"` adds; empty on overflow.
    fn as_str(&self) -> &str {
        if self.overflow {
            return "";
        }
        let s = std::str::from_utf8(&self.buf[..self.len]).unwrap_or("");
        s.strip_prefix('"')
            .and_then(|t| t.strip_suffix('"'))
            .unwrap_or(s)
    }

    fn ok(&self) -> bool {
        !self.overflow
    }
}

impl fmt::Write for Small {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        if self.overflow || end > self.buf.len() {
            self.overflow = true;
            return Err(fmt::Error);
        }
        self.buf[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// A request id as read: on the stack when short.
#[derive(Debug)]
enum ReqText {
    Inline(Small),
    Heap(String),
}

impl ReqText {
    fn new(s: &str) -> ReqText {
        let small = Small::copy_of(s);
        if small.ok() {
            ReqText::Inline(small)
        } else {
            ReqText::Heap(s.to_owned())
        }
    }

    fn as_str(&self) -> &str {
        match self {
            ReqText::Inline(s) => s.as_str(),
            ReqText::Heap(s) => s,
        }
    }
}

enum KnownField {
    Kind,
    Request,
    State,
    From,
    Tier,
    Direction,
    Num(Num),
    Ok,
    Text,
    Transfers,
    Hashes,
}

fn field_of(name: &str) -> Option<KnownField> {
    Some(match name {
        "kind" => KnownField::Kind,
        "request_id" | "request" => KnownField::Request,
        "state" | "to" => KnownField::State,
        "from" => KnownField::From,
        "tier" => KnownField::Tier,
        "direction" => KnownField::Direction,
        "ok" => KnownField::Ok,
        "reason" | "error" => KnownField::Text,
        "transfers" => KnownField::Transfers,
        "hashes" => KnownField::Hashes,
        "prompt_tokens" => KnownField::Num(Num::PromptTokens),
        "max_output_tokens" => KnownField::Num(Num::MaxOutputTokens),
        "looked_up" => KnownField::Num(Num::LookedUp),
        "hit_blocks" => KnownField::Num(Num::HitBlocks),
        "hit_tokens" => KnownField::Num(Num::HitTokens),
        "count" => KnownField::Num(Num::Count),
        "block" => KnownField::Num(Num::Block),
        "first_block" => KnownField::Num(Num::FirstBlock),
        "hash" | "sequence_hash" => KnownField::Num(Num::Hash),
        "duplicate_of" => KnownField::Num(Num::DuplicateOf),
        "transfer" | "transfer_id" => KnownField::Num(Num::Transfer),
        "blocks" => KnownField::Num(Num::Blocks),
        "bytes" => KnownField::Num(Num::Bytes),
        "batch" | "batch_id" => KnownField::Num(Num::Batch),
        "elapsed_ns" => KnownField::Num(Num::ElapsedNs),
        "capacity" => KnownField::Num(Num::Capacity),
        "active" => KnownField::Num(Num::Active),
        "inactive" => KnownField::Num(Num::Inactive),
        "empty" => KnownField::Num(Num::Empty),
        "prefill" => KnownField::Num(Num::Prefill),
        "decode" => KnownField::Num(Num::Decode),
        "computed" => KnownField::Num(Num::Computed),
        "iteration" => KnownField::Num(Num::Iteration),
        "tokens" => KnownField::Num(Num::Tokens),
        "block_size" => KnownField::Num(Num::BlockSize),
        "computed_blocks" => KnownField::Num(Num::ComputedBlocks),
        _ => return None,
    })
}

impl Fields {
    fn num(&self, n: Num) -> Option<u64> {
        self.num[n as usize]
    }

    /// Keeps a field of a name the layer does not know, as text, while
    /// there is room (`message`, which every event with text has, is
    /// never a kind's field).
    fn other(&mut self, field: &Field, value: Small) {
        let name = field.name();
        if name == "message" {
            return;
        }
        if let Some(slot) = self.other.iter_mut().find(|s| s.is_none()) {
            *slot = Some((name, value));
        }
    }

    /// The text of a field kept by [`other`](Self::other).
    fn other_text(&self, name: &str) -> Result<&str, Refused> {
        let (_, text) = self
            .other
            .iter()
            .flatten()
            .find(|(n, _)| *n == name)
            .ok_or(Refused::MissingField)?;
        // Longer than the stack copy holds: not a value a field can take.
        if text.ok() {
            Ok(text.as_str())
        } else {
            Err(Refused::BadValue)
        }
    }

    /// A field given as text (a `&str`, or a value's `Debug`/`Display`).
    fn set_text(&mut self, known: KnownField, s: &str) {
        match known {
            KnownField::Kind => self.kind = Some(parse_kind(s).ok_or(())),
            KnownField::Request => self.request = Some(ReqText::new(s)),
            KnownField::State => self.state = Some(Small::copy_of(s)),
            KnownField::From => self.from = Some(Small::copy_of(s)),
            KnownField::Tier => match parse_tier(s) {
                Some(t) => self.tier = Some(t),
                None => self.bad = true,
            },
            KnownField::Direction => match parse_direction(s) {
                Some(d) => self.direction = Some(d),
                None => self.bad = true,
            },
            KnownField::Ok => match s {
                "true" => self.ok = Some(true),
                "false" => self.ok = Some(false),
                _ => self.bad = true,
            },
            KnownField::Text => self.text = Some(s.to_owned()),
            KnownField::Transfers => match parse_list(s) {
                Some(l) => self.transfers = Some(l),
                None => self.bad = true,
            },
            KnownField::Hashes => match parse_list(s) {
                Some(l) => self.hashes = Some(l),
                None => self.bad = true,
            },
            KnownField::Num(Num::Blocks) => match parse_u64(s) {
                Some(v) => self.num[Num::Blocks as usize] = Some(v),
                None => match parse_list(s) {
                    Some(l) => self.blocks_list = Some(l),
                    None => self.bad = true,
                },
            },
            KnownField::Num(n) => match parse_u64(s) {
                Some(v) => self.num[n as usize] = Some(v),
                None => self.bad = true,
            },
        }
    }

    fn set_number(&mut self, known: KnownField, v: u64) {
        match known {
            KnownField::Num(n) => self.num[n as usize] = Some(v),
            KnownField::Request => {
                let mut s = Small::default();
                let _ = write!(s, "{v}");
                self.request = Some(ReqText::Inline(s));
            }
            _ => self.bad = true,
        }
    }
}

impl Visit for Fields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        match field_of(field.name()) {
            Some(known) => self.set_number(known, value),
            None => self.other(field, Small::from_debug(&value)),
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        match field_of(field.name()) {
            Some(known) => match u64::try_from(value) {
                Ok(v) => self.set_number(known, v),
                Err(_) => self.bad = true,
            },
            None => self.other(field, Small::from_debug(&value)),
        }
    }

    fn record_u128(&mut self, field: &Field, value: u128) {
        if let Some(known) = field_of(field.name()) {
            match u64::try_from(value) {
                Ok(v) => self.set_number(known, v),
                Err(_) => self.bad = true,
            }
        }
    }

    fn record_i128(&mut self, field: &Field, value: i128) {
        if let Some(known) = field_of(field.name()) {
            match u64::try_from(value) {
                Ok(v) => self.set_number(known, v),
                Err(_) => self.bad = true,
            }
        }
    }

    fn record_f64(&mut self, field: &Field, _value: f64) {
        if field_of(field.name()).is_some() {
            self.bad = true;
        }
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        match field_of(field.name()) {
            Some(KnownField::Ok) => self.ok = Some(value),
            Some(_) => self.bad = true,
            None => self.other(field, Small::from_debug(&value)),
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        match field_of(field.name()) {
            Some(known) => self.set_text(known, value),
            None => self.other(field, Small::copy_of(value)),
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let Some(known) = field_of(field.name()) else {
            self.other(field, Small::from_debug(value));
            return;
        };
        let small = Small::from_debug(value);
        if small.ok() {
            self.set_text(known, small.as_str());
            return;
        }
        // Only free text and ids may be long; formatting them allocates.
        match known {
            KnownField::Request
            | KnownField::Text
            | KnownField::Transfers
            | KnownField::Hashes
            | KnownField::Num(Num::Blocks) => {
                let s = format!("{value:?}");
                let s = s
                    .strip_prefix('"')
                    .and_then(|t| t.strip_suffix('"'))
                    .unwrap_or(&s);
                self.set_text(known, s);
            }
            _ => self.bad = true,
        }
    }
}

/// The fields as a kind's declaration names them, for the kinds read by
/// [`EventKind::read_fields`]: a name the layer knows reads its slot (so
/// its aliases, such as `hash` for `sequence_hash`, work there too), any
/// other name the text kept for it.
impl FieldSource for Fields {
    type Error = Refused;

    fn has(&self, name: &'static str) -> bool {
        match field_of(name) {
            Some(KnownField::Num(Num::Blocks)) => {
                self.num(Num::Blocks).is_some() || self.blocks_list.is_some()
            }
            Some(KnownField::Num(n)) => self.num(n).is_some(),
            Some(KnownField::Tier) => self.tier.is_some(),
            Some(KnownField::Direction) => self.direction.is_some(),
            Some(KnownField::State) => self.state.is_some(),
            Some(KnownField::From) => self.from.is_some(),
            Some(KnownField::Ok) => self.ok.is_some(),
            Some(KnownField::Text) => self.text.is_some(),
            Some(KnownField::Transfers) => self.transfers.is_some(),
            Some(KnownField::Hashes) => self.hashes.is_some(),
            Some(KnownField::Kind | KnownField::Request) => true,
            None => self.other.iter().flatten().any(|(n, _)| *n == name),
        }
    }

    fn number(&self, name: &'static str) -> Result<u64, Refused> {
        match field_of(name) {
            Some(KnownField::Num(n)) => self.num(n).ok_or(Refused::MissingField),
            Some(_) => Err(Refused::BadValue),
            None => parse_u64(self.other_text(name)?).ok_or(Refused::BadValue),
        }
    }

    fn flag(&self, name: &'static str) -> Result<bool, Refused> {
        match field_of(name) {
            Some(KnownField::Ok) => self.ok.ok_or(Refused::MissingField),
            Some(_) => Err(Refused::BadValue),
            None => match self.other_text(name)? {
                "true" => Ok(true),
                "false" => Ok(false),
                _ => Err(Refused::BadValue),
            },
        }
    }

    fn text(&self, name: &'static str) -> Result<String, Refused> {
        match field_of(name) {
            Some(KnownField::Text) => self.text.clone().ok_or(Refused::MissingField),
            Some(_) => Err(Refused::BadValue),
            None => self.other_text(name).map(str::to_owned),
        }
    }

    fn numbers(&self, name: &'static str) -> Result<Vec<u64>, Refused> {
        let list = match field_of(name) {
            Some(KnownField::Transfers) => &self.transfers,
            Some(KnownField::Hashes) => &self.hashes,
            Some(KnownField::Num(Num::Blocks)) => &self.blocks_list,
            Some(_) => return Err(Refused::BadValue),
            None => return parse_list(self.other_text(name)?).ok_or(Refused::BadValue),
        };
        list.clone().ok_or(Refused::MissingField)
    }

    fn tier(&self, name: &'static str) -> Result<Tier, Refused> {
        match field_of(name) {
            Some(KnownField::Tier) => self.tier.ok_or(Refused::MissingField),
            Some(_) => Err(Refused::BadValue),
            None => parse_tier(self.other_text(name)?).ok_or(Refused::BadValue),
        }
    }

    fn direction(&self, name: &'static str) -> Result<Direction, Refused> {
        match field_of(name) {
            Some(KnownField::Direction) => self.direction.ok_or(Refused::MissingField),
            Some(_) => Err(Refused::BadValue),
            None => parse_direction(self.other_text(name)?).ok_or(Refused::BadValue),
        }
    }

    fn state(&self, name: &'static str) -> Result<SlotState, Refused> {
        let text = match field_of(name) {
            Some(KnownField::State) => self.state.as_ref().map(Small::as_str),
            Some(KnownField::From) => self.from.as_ref().map(Small::as_str),
            Some(_) => return Err(Refused::BadValue),
            None => Some(self.other_text(name)?),
        };
        parse_state(text.ok_or(Refused::MissingField)?, None).ok_or(Refused::BadValue)
    }

    fn bad_value(&self, _: &'static str) -> Refused {
        Refused::BadValue
    }
}

// ------------------------------------------------------------ the hot path

/// Why an event was refused.
enum Refused {
    MissingField,
    BadValue,
}

fn u32_of(v: u64) -> Result<u32, Refused> {
    u32::try_from(v).map_err(|_| Refused::BadValue)
}

/// The blocks a `BlocksAllocated` names: its list, else `blocks` ids in a
/// row from `first_block` (0 when not given), at most [`MAX_LIST_LEN`].
fn allocated_blocks(f: &Fields) -> Result<Vec<BlockId>, Refused> {
    Ok(match (&f.blocks_list, f.num(Num::Blocks)) {
        (Some(list), _) => list.iter().map(|&b| u32_of(b)).collect::<Result<_, _>>()?,
        (None, Some(n)) => {
            if n > MAX_LIST_LEN as u64 {
                return Err(Refused::BadValue);
            }
            let first = f.num(Num::FirstBlock).map_or(Ok(0), u32_of)?;
            let end = first.checked_add(u32_of(n)?).ok_or(Refused::BadValue)?;
            (first..end).collect()
        }
        (None, None) => return Err(Refused::MissingField),
    })
}

impl Shared {
    fn stats(&self) -> LayerStats {
        let c = &self.counters;
        let tracked = self.requests.lock().map_or(0, |m| m.len()) as u64;
        LayerStats {
            seen: c.seen.load(Relaxed),
            emitted: c.emitted.load(Relaxed),
            iterations: c.iterations.load(Relaxed),
            missing_kind: c.missing_kind.load(Relaxed),
            unknown_kind: c.unknown_kind.load(Relaxed),
            missing_field: c.missing_field.load(Relaxed),
            bad_value: c.bad_value.load(Relaxed),
            unknown_from: c.unknown_from.load(Relaxed),
            untracked_requests: c.untracked_requests.load(Relaxed),
            tracked_requests: tracked,
        }
    }

    fn handle(&self, f: Fields) {
        let c = &self.counters;
        c.seen.fetch_add(1, Relaxed);
        let kind = match f.kind {
            None => {
                c.missing_kind.fetch_add(1, Relaxed);
                return;
            }
            Some(Err(())) => {
                c.unknown_kind.fetch_add(1, Relaxed);
                return;
            }
            Some(Ok(k)) => k,
        };
        if f.bad {
            c.bad_value.fetch_add(1, Relaxed);
            return;
        }
        let request = f.request.as_ref().map(|r| self.resolve(r.as_str()));
        match self.build(kind, &f, request.as_ref()) {
            Ok(Some(ev)) => {
                if let Some(i) = f.num(Num::Iteration) {
                    self.emitter.set_iteration(i);
                }
                self.emitter.emit(request.as_ref(), ev);
                c.emitted.fetch_add(1, Relaxed);
            }
            Ok(None) => {}
            Err(Refused::MissingField) => {
                c.missing_field.fetch_add(1, Relaxed);
            }
            Err(Refused::BadValue) => {
                c.bad_value.fetch_add(1, Relaxed);
            }
        }
    }

    /// The bus event for `kind`, or `None` for a marker that emits nothing.
    fn build(
        &self,
        kind: Kind,
        f: &Fields,
        request: Option<&RequestId>,
    ) -> Result<Option<EventKind>, Refused> {
        use Refused::MissingField as Missing;
        let need = |n: Num| f.num(n).ok_or(Missing);
        let need32 = |n: Num| need(n).and_then(u32_of);
        let opt32 = |n: Num| f.num(n).map_or(Ok(0), u32_of);
        let tier = || f.tier.ok_or(Missing);
        let direction = || f.direction.ok_or(Missing);
        let transfer = || need(Num::Transfer);
        let tag = match kind {
            Kind::Iteration => {
                self.emitter.set_iteration(need(Num::Iteration)?);
                self.counters.iterations.fetch_add(1, Relaxed);
                return Ok(None);
            }
            Kind::Event(tag) => tag,
        };
        // Kinds with defaults, other names or per-request state have an
        // arm; the rest are read by their declaration.
        Ok(Some(match tag {
            KindTag::HookCall | KindTag::BreakpointHit | KindTag::Resumed => {
                // `parse_kind` never yields these (see `traced`).
                return Err(Refused::BadValue);
            }
            KindTag::SlotCreated => {
                let req = request.ok_or(Missing)?;
                let ev = EventKind::SlotCreated {
                    prompt_tokens: opt32(Num::PromptTokens)?,
                    max_output_tokens: opt32(Num::MaxOutputTokens)?,
                };
                self.remember(req, SlotState::Initialized);
                ev
            }
            KindTag::SlotTransition => self.transition(f, request.ok_or(Missing)?)?,
            KindTag::MatchResult => EventKind::MatchResult {
                tier: tier()?,
                looked_up: opt32(Num::LookedUp)?,
                hit_blocks: opt32(Num::HitBlocks)?,
                hit_tokens: opt32(Num::HitTokens)?,
            },
            KindTag::BlocksAllocated => EventKind::BlocksAllocated {
                tier: tier()?,
                blocks: allocated_blocks(f)?,
            },
            KindTag::BlocksReleased => EventKind::BlocksReleased {
                tier: tier()?,
                count: f
                    .num(Num::Count)
                    .or_else(|| f.num(Num::Blocks))
                    .ok_or(Missing)
                    .and_then(u32_of)?,
            },
            KindTag::BlockRegistered => EventKind::BlockRegistered {
                tier: tier()?,
                block: need32(Num::Block)?,
                sequence_hash: SequenceHash(need(Num::Hash)?),
                duplicate_of: f.num(Num::DuplicateOf).map(u32_of).transpose()?,
            },
            KindTag::TransferSkipped => EventKind::TransferSkipped {
                transfer: transfer()?,
                direction: direction()?,
                reason: f.text.clone().unwrap_or_default(),
            },
            KindTag::TransferFailed => EventKind::TransferFailed {
                transfer: transfer()?,
                direction: direction()?,
                error: f.text.clone().unwrap_or_default(),
            },
            KindTag::BatchDispatched => EventKind::BatchDispatched {
                batch: need(Num::Batch)?,
                direction: direction()?,
                transfers: f.transfers.clone().unwrap_or_default(),
                blocks: opt32(Num::Blocks)?,
            },
            KindTag::BatchCompleted => EventKind::BatchCompleted {
                batch: need(Num::Batch)?,
                direction: direction()?,
                ok: f.ok.unwrap_or(true),
                blocks: opt32(Num::Blocks)?,
                bytes: f.num(Num::Bytes).unwrap_or(0),
                elapsed_ns: f.num(Num::ElapsedNs).unwrap_or(0),
            },
            KindTag::PoolGauge => EventKind::PoolGauge {
                tier: tier()?,
                capacity: need32(Num::Capacity)?,
                active: opt32(Num::Active)?,
                inactive: opt32(Num::Inactive)?,
                empty: opt32(Num::Empty)?,
            },
            KindTag::TokensScheduled => {
                request.ok_or(Missing)?;
                EventKind::TokensScheduled {
                    prefill: opt32(Num::Prefill)?,
                    decode: opt32(Num::Decode)?,
                    computed: opt32(Num::Computed)?,
                }
            }
            KindTag::PrefixLookup => {
                request.ok_or(Missing)?;
                EventKind::PrefixLookup {
                    tokens: need32(Num::Tokens)?,
                    block_size: need32(Num::BlockSize)?,
                    computed_blocks: opt32(Num::ComputedBlocks)?,
                    hashes: f
                        .hashes
                        .as_ref()
                        .ok_or(Missing)?
                        .iter()
                        .map(|&h| SequenceHash(h))
                        .collect(),
                }
            }
            // Every other kind: each field under its declared name, all
            // required but an `Option`. A new kind is read this way until
            // it needs defaults or other names (an arm above).
            tag => EventKind::read_fields(tag, f)?,
        }))
    }

    /// A `SlotTransition` of `req` to the state named, from the state
    /// named, else the one remembered (see [`Self::advance`]).
    fn transition(&self, f: &Fields, req: &RequestId) -> Result<EventKind, Refused> {
        let tokens = f.num(Num::Tokens);
        let to = f.state.as_ref().ok_or(Refused::MissingField)?;
        let to = parse_state(to.as_str(), tokens).ok_or(Refused::BadValue)?;
        let from = match &f.from {
            Some(s) => Some(parse_state(s.as_str(), None).ok_or(Refused::BadValue)?),
            None => None,
        };
        let from = self.advance(req, from, to);
        Ok(EventKind::SlotTransition { from, to })
    }

    fn shared_max(&self) -> usize {
        self.max_requests.load(Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, SlotState>> {
        self.requests.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The shared id of a tracked request, else a new one.
    fn resolve(&self, s: &str) -> RequestId {
        match self.lock().get_key_value(s) {
            Some((k, _)) => k.clone(),
            None => Arc::from(s),
        }
    }

    /// Records `state` for `req`, within the cap.
    fn remember(&self, req: &RequestId, state: SlotState) {
        let mut map = self.lock();
        if state == SlotState::Finished {
            map.remove(req);
        } else if let Some(s) = map.get_mut(req) {
            *s = state;
        } else if map.len() < self.shared_max() {
            map.insert(req.clone(), state);
        } else {
            self.counters.untracked_requests.fetch_add(1, Relaxed);
        }
    }

    /// Moves `req` to `to`; returns the `from` to emit: the one given, else
    /// the one remembered, else `to` (counted).
    fn advance(&self, req: &RequestId, from: Option<SlotState>, to: SlotState) -> SlotState {
        let prev = {
            let mut map = self.lock();
            let prev = map.get(req.as_ref()).copied();
            if to == SlotState::Finished {
                map.remove(req.as_ref());
            } else if let Some(s) = map.get_mut(req.as_ref()) {
                *s = to;
            } else if map.len() < self.shared_max() {
                map.insert(req.clone(), to);
            } else {
                self.counters.untracked_requests.fetch_add(1, Relaxed);
            }
            prev
        };
        from.or(prev).unwrap_or_else(|| {
            self.counters.unknown_from.fetch_add(1, Relaxed);
            to
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::bus::{BusConfig, TapItem, TapReceiver};
    use kvbm_events::{Event, VirtualClock};
    use tracing_subscriber::prelude::*;

    fn setup(tap: usize) -> (Arc<Emitter>, TapReceiver<Event>) {
        let cfg = BusConfig {
            broadcast_capacity: 16,
            tap_capacity: tap,
        };
        let e = Arc::new(Emitter::new(3, cfg, Arc::new(VirtualClock::new())).unwrap());
        let t = e.bus().take_tap().unwrap();
        (e, t)
    }

    fn with_layer(layer: KvbmLayer, f: impl FnOnce()) {
        let sub = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(sub, f);
    }

    fn drain(t: &mut TapReceiver<Event>) -> Vec<Event> {
        let mut out = Vec::new();
        while let Ok(item) = t.try_recv() {
            if let TapItem::Event(e) = item {
                out.push(e);
            }
        }
        out
    }

    #[test]
    fn fields_parse_into_events() {
        let (e, mut tap) = setup(64);
        let layer = KvbmLayer::new(e.clone());
        let h = layer.handle();
        let id = String::from("req-7");
        with_layer(layer, || {
            tracing::info!(target: "kvbm", kind = "slot_created", request_id = %id,
                prompt_tokens = 64, max_output_tokens = 8u32);
            tracing::info!(target: "kvbm", kind = "slot_transition", request_id = %id,
                state = "OnboardStaged(32)", iteration = 4);
            tracing::info!(target: "kvbm", kind = "slot_transition", request_id = %id,
                state = "Onboarding", tokens = 32);
            tracing::info!(target: "kvbm::sched", kind = "slot_transition", request_id = %id,
                from = "Prefilling", to = "Decoding");
            tracing::info!(target: "kvbm", kind = "block_registered", tier = "G1",
                block = 5, hash = "0xff", request_id = 12u64);
            tracing::info!(target: "kvbm", kind = "blocks_allocated", tier = "device",
                blocks = "3, 4,5");
            tracing::info!(target: "kvbm", kind = "blocks_allocated", tier = "G2",
                blocks = 2, first_block = 10);
            tracing::info!(target: "kvbm", kind = "transfer_planned", transfer = 1,
                direction = "G1->G2", blocks = 2);
            tracing::info!(target: "kvbm", kind = "transfer_completed", transfer = 1,
                direction = %"G2→G1", blocks = 2);
            tracing::info!(target: "kvbm", kind = "batch_completed", batch = 9,
                direction = "G1->G2", ok = false, bytes = 4096u64, elapsed_ns = 10);
            tracing::info!(target: "kvbm", kind = "tokens_scheduled", request_id = ?"req-7",
                prefill = 16, computed = 16);
            tracing::info!(target: "kvbm", kind = "iteration", iteration = 11);
            tracing::info!(target: "kvbm", kind = "slot_transition", request_id = %id,
                state = "Finished");
        });
        let evs = drain(&mut tap);
        let kinds: Vec<EventKind> = evs.iter().map(|e| e.kind.clone()).collect();
        assert_eq!(
            kinds,
            vec![
                EventKind::SlotCreated {
                    prompt_tokens: 64,
                    max_output_tokens: 8
                },
                EventKind::SlotTransition {
                    from: SlotState::Initialized,
                    to: SlotState::OnboardStaged(32)
                },
                EventKind::SlotTransition {
                    from: SlotState::OnboardStaged(32),
                    to: SlotState::Onboarding(32)
                },
                EventKind::SlotTransition {
                    from: SlotState::Prefilling,
                    to: SlotState::Decoding
                },
                EventKind::BlockRegistered {
                    tier: Tier::Device,
                    block: 5,
                    sequence_hash: SequenceHash(255),
                    duplicate_of: None
                },
                EventKind::BlocksAllocated {
                    tier: Tier::Device,
                    blocks: vec![3, 4, 5]
                },
                EventKind::BlocksAllocated {
                    tier: Tier::Host,
                    blocks: vec![10, 11]
                },
                EventKind::TransferPlanned {
                    transfer: 1,
                    direction: Direction::DEVICE_TO_HOST,
                    blocks: 2
                },
                EventKind::TransferCompleted {
                    transfer: 1,
                    direction: Direction::HOST_TO_DEVICE,
                    blocks: 2
                },
                EventKind::BatchCompleted {
                    batch: 9,
                    direction: Direction::DEVICE_TO_HOST,
                    ok: false,
                    blocks: 0,
                    bytes: 4096,
                    elapsed_ns: 10
                },
                EventKind::TokensScheduled {
                    prefill: 16,
                    decode: 0,
                    computed: 16
                },
                EventKind::SlotTransition {
                    from: SlotState::Decoding,
                    to: SlotState::Finished
                },
            ]
        );
        assert_eq!(evs[0].request.as_deref(), Some("req-7"));
        assert_eq!(evs[1].iteration, 4);
        assert_eq!(evs[4].request.as_deref(), Some("12"));
        assert_eq!(evs[10].request.as_deref(), Some("req-7"));
        assert_eq!(evs[11].iteration, 11);
        let s = h.stats();
        assert_eq!((s.seen, s.emitted, s.iterations), (13, 12, 1));
        assert_eq!(s.tracked_requests, 0, "a finished request is forgotten");
        assert_eq!(s.unknown_from, 0);
    }

    #[test]
    fn bad_input_is_counted_and_never_panics() {
        let (e, mut tap) = setup(64);
        let layer = KvbmLayer::new(e);
        let h = layer.handle();
        with_layer(layer, || {
            tracing::info!(target: "kvbm", request_id = "r", "no kind");
            tracing::info!(target: "kvbm", kind = "warp_drive", request_id = "r");
            tracing::info!(target: "kvbm", kind = "hook_call");
            tracing::info!(target: "kvbm", kind = "slot_created");
            tracing::info!(target: "kvbm", kind = "block_evicted", tier = "G1", block = 1);
            tracing::info!(target: "kvbm", kind = "block_evicted", tier = "G9", block = 1, hash = 2);
            tracing::info!(target: "kvbm", kind = "block_evicted", tier = "G1", block = -1, hash = 2);
            tracing::info!(target: "kvbm", kind = "pool_gauge", tier = "G1", capacity = 1u64 << 40);
            tracing::info!(target: "kvbm", kind = "transfer_planned", transfer = 1,
                direction = "G1->G1", blocks = 1);
            tracing::info!(target: "kvbm", kind = "slot_transition", request_id = "r",
                state = "Dancing");
            tracing::info!(target: "kvbm", kind = "slot_transition", request_id = "r",
                state = "Onboarding(x)");
            tracing::info!(target: "kvbm", kind = "blocks_allocated", tier = "G1",
                blocks = "1,x");
            tracing::info!(target: "kvbm", kind = "blocks_allocated", tier = "G1",
                blocks = 1u64 << 40);
            tracing::info!(target: "kvbm", kind = "batch_completed", batch = 1,
                direction = "G1->G2", ok = "maybe");
            tracing::info!(target: "kvbm", kind = "match_result", tier = "G2", hit_blocks = 1.5);
            tracing::info!(target: "kvbm", kind = "slot_created", request_id = "r",
                prompt_tokens = ?[0u8; 100]);
            // Unknown fields are not an error.
            tracing::info!(target: "kvbm", kind = "match_result", tier = "G2", colour = "red");
        });
        let s = h.stats();
        assert_eq!(s.seen, 17);
        assert_eq!(s.missing_kind, 1);
        assert_eq!(s.unknown_kind, 2);
        assert_eq!(s.missing_field, 2);
        assert_eq!(s.bad_value, 11);
        assert_eq!(s.emitted, 1);
        assert_eq!(drain(&mut tap).len(), 1);
    }

    #[test]
    fn other_targets_are_ignored() {
        let (e, mut tap) = setup(64);
        let layer = KvbmLayer::new(e);
        let h = layer.handle();
        with_layer(layer, || {
            tracing::info!(target: "kvbmx", kind = "slot_created", request_id = "a");
            tracing::info!(target: "app::kvbm", kind = "slot_created", request_id = "a");
            tracing::info!(kind = "slot_created", request_id = "a");
            let _span =
                tracing::info_span!(target: "kvbm", "span", kind = "slot_created").entered();
        });
        assert_eq!(h.stats(), LayerStats::default());
        assert!(drain(&mut tap).is_empty());
        assert!(is_kvbm_target("kvbm") && is_kvbm_target("kvbm::a::b"));
        assert!(!is_kvbm_target("kvbm_core") && !is_kvbm_target("kvbm:"));
    }

    #[test]
    fn a_full_tap_counts_its_drops() {
        let (e, mut tap) = setup(4);
        let layer = KvbmLayer::new(e.clone());
        let h = layer.handle();
        with_layer(layer, || {
            for i in 0..10u64 {
                tracing::info!(target: "kvbm", kind = "pool_gauge", tier = "G1",
                    capacity = 8, active = i);
            }
        });
        assert_eq!(h.stats().emitted, 10);
        let c = h.emitter().bus().counters();
        assert_eq!((c.tap_offered, c.tap_dropped), (10, 6));
        assert_eq!(drain(&mut tap).len(), 4);
    }

    #[test]
    fn per_request_state_is_bounded() {
        let (e, mut tap) = setup(256);
        let layer = KvbmLayer::new(e).with_max_requests(2);
        let h = layer.handle();
        with_layer(layer, || {
            for r in ["a", "b", "c"] {
                tracing::info!(target: "kvbm", kind = "slot_created", request_id = r);
            }
            let s = h.stats();
            assert_eq!((s.tracked_requests, s.untracked_requests), (2, 1));
            // "c" is not tracked: its transition has no known `from`.
            tracing::info!(target: "kvbm", kind = "slot_transition", request_id = "c",
                state = "Prefilling");
            assert_eq!(h.stats().unknown_from, 1);
            // Finishing "a" makes room.
            tracing::info!(target: "kvbm", kind = "slot_transition", request_id = "a",
                state = "Finished");
            tracing::info!(target: "kvbm", kind = "slot_created", request_id = "d");
            tracing::info!(target: "kvbm", kind = "slot_transition", request_id = "d",
                state = "Prefilling");
        });
        let s = h.stats();
        assert_eq!((s.tracked_requests, s.untracked_requests), (2, 2));
        assert_eq!(s.unknown_from, 1);
        let evs = drain(&mut tap);
        let last = evs.last().unwrap();
        assert_eq!(last.request.as_deref(), Some("d"));
        assert_eq!(
            last.kind,
            EventKind::SlotTransition {
                from: SlotState::Initialized,
                to: SlotState::Prefilling
            }
        );
        // Many short-lived requests never grow the table.
        let (e, _tap) = setup(16);
        let layer = KvbmLayer::new(e).with_max_requests(8);
        let h = layer.handle();
        with_layer(layer, || {
            for i in 0..1000u64 {
                tracing::info!(target: "kvbm", kind = "slot_created", request_id = i);
                tracing::info!(target: "kvbm", kind = "slot_transition", request_id = i,
                    state = "Finished");
            }
        });
        let s = h.stats();
        assert_eq!(
            (s.tracked_requests, s.untracked_requests, s.unknown_from),
            (0, 0, 0)
        );
    }

    /// A field's value as an engine would write it in a `tracing` event.
    fn as_field_text(v: &serde_json::Value) -> Option<String> {
        use serde_json::Value as V;
        Some(match v {
            V::Null => return None,
            V::String(s) => s.clone(),
            V::Array(a) => a
                .iter()
                .filter_map(as_field_text)
                .collect::<Vec<_>>()
                .join(","),
            // A direction, or a slot state with its token count.
            V::Object(o) => match (o.get("src"), o.get("dst")) {
                (Some(src), Some(dst)) => {
                    format!("{}->{}", as_field_text(src)?, as_field_text(dst)?)
                }
                _ => {
                    let (name, n) = o.iter().next()?;
                    format!("{name}({})", as_field_text(n)?)
                }
            },
            other => other.to_string(),
        })
    }

    #[test]
    fn every_traced_kind_reads_back_from_its_declared_field_names() {
        // Each kind's sample, written as fields under the names its
        // declaration gives them, builds that sample again: so a kind read
        // by its declaration (the generic arm) and every hand-written arm
        // take the declared names.
        let (e, _t) = setup(16);
        let layer = KvbmLayer::new(e);
        let req: RequestId = Arc::from("r");
        for &tag in KindTag::ALL.iter().filter(|t| traced(**t)) {
            let sample = tag.sample();
            let json = serde_json::to_value(&sample).unwrap();
            let mut f = Fields::default();
            let mut others = 0;
            for &name in tag.field_names() {
                let Some(text) = as_field_text(&json[name]) else {
                    continue;
                };
                match field_of(name) {
                    Some(known) => f.set_text(known, &text),
                    None => {
                        f.other[others] = Some((name, Small::copy_of(&text)));
                        others += 1;
                    }
                }
            }
            assert!(!f.bad, "{tag}: {json}");
            let built = layer.shared.build(Kind::Event(tag), &f, Some(&req));
            assert!(
                matches!(&built, Ok(Some(k)) if *k == sample),
                "{tag}: {json} gave {:?}",
                built.map_err(|e| matches!(e, Refused::MissingField))
            );
        }
    }

    #[test]
    fn a_field_of_a_name_the_layer_does_not_know_is_read_by_its_declared_type() {
        let mut f = Fields::default();
        f.other[0] = Some(("new_size", Small::copy_of("0x20")));
        f.other[1] = Some(("to_tier", Small::copy_of("disk")));
        f.other[2] = Some(("route", Small::copy_of("G1->G2")));
        f.other[3] = Some(("ids", Small::copy_of("[1, 2,3]")));
        assert_eq!(f.number("new_size").ok(), Some(32));
        assert_eq!(f.tier("to_tier").ok(), Some(Tier::Disk));
        assert_eq!(f.direction("route").ok(), Some(Direction::DEVICE_TO_HOST));
        assert_eq!(f.numbers("ids").ok(), Some(vec![1, 2, 3]));
        assert!(f.has("new_size") && !f.has("old_size"));
        assert!(matches!(f.number("old_size"), Err(Refused::MissingField)));
        assert!(matches!(f.number("to_tier"), Err(Refused::BadValue)));
        let long = Small::copy_of(&"9".repeat(60));
        assert!(!long.ok());
        f.other[0] = Some(("new_size", long));
        assert!(matches!(f.number("new_size"), Err(Refused::BadValue)));
    }

    #[test]
    fn the_vocabulary_is_complete() {
        let names: Vec<_> = kind_names().collect();
        assert_eq!(names.len(), 1 + KindTag::COUNT - 3);
        for name in names {
            assert!(parse_kind(name).is_some(), "{name}");
        }
        for tag in KindTag::ALL {
            assert_eq!(
                parse_kind(tag.snake_name()).is_some(),
                traced(*tag),
                "{tag}"
            );
        }
        for name in SlotState::NAMES {
            assert_eq!(parse_state(name, None).map(|s| s.name()), Some(name));
        }
        // The module's table has a row for no kind the layer does not
        // accept; a kind without a row is read by its declaration, as the
        // table's last row says.
        let docs = include_str!("tracing_layer.rs");
        let rows = docs.lines().filter_map(|l| l.strip_prefix("//! | `"));
        for name in rows.map(|row| row.split('`').next().unwrap_or("")) {
            if name == "kind" {
                continue; // the header
            }
            assert!(
                parse_kind(name).is_some(),
                "the table has a row for `{name}`, which the layer does not accept"
            );
        }
        assert!(docs.contains("//! | any other kind"));
        for t in Tier::ALL {
            assert_eq!(parse_tier(t.short_name()), Some(t));
        }
    }
}
