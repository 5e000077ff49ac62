//! Property-test strategies for events, shared by every crate's tests
//! (feature `testing`).
//!
//! Each kind's strategy and its sample are made by the kind's declaration
//! from its fields' types ([`FieldValue`]), so every test that generates
//! events generates a new kind without an edit here.
//!
//! - [`Shape::WIDE`]: any value of every field (codecs, parsers);
//! - [`Shape::SMALL`]: small id spaces and counts, so that random events
//!   keep referring to the same transfers, batches and blocks (reducers,
//!   analyses).

use crate::event::KindTag;
use crate::tier::BlockId;
use crate::{
    Direction, EntryPoint, Event, EventKind, HookPhase, RequestId, ResumeCause, SequenceHash,
    SlotState, Tier,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::strategy::Union;
use std::sync::Arc;

/// The ranges generated values are drawn from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Transfer, batch and breakpoint ids are below this.
    pub ids: u64,
    /// Token and block counts, block ids and gauges are below this.
    pub counts: u32,
    /// Sequence hashes are below this.
    pub hashes: u64,
    /// Token counts inside slot states are below this.
    pub state_tokens: usize,
    /// Free text (skip reasons, errors) is any unicode; otherwise a fixed
    /// string with quotes and escapes in it.
    pub any_text: bool,
}

impl Shape {
    /// Every value possible.
    pub const WIDE: Shape = Shape {
        ids: u64::MAX,
        counts: u32::MAX,
        hashes: u64::MAX,
        state_tokens: usize::MAX,
        any_text: true,
    };

    /// Small spaces, so events refer to one another.
    pub const SMALL: Shape = Shape {
        ids: 6,
        counts: 5,
        hashes: 4,
        state_tokens: 64,
        any_text: false,
    };
}

/// Any tier.
pub fn tier() -> impl Strategy<Value = Tier> + Clone {
    proptest::sample::select(Tier::ALL.to_vec())
}

/// Any pair of tiers (including the odd ones, such as G1→G1).
pub fn direction() -> impl Strategy<Value = Direction> + Clone {
    (tier(), tier()).prop_map(|(src, dst)| Direction { src, dst })
}

/// Any entry point.
pub fn entry() -> impl Strategy<Value = EntryPoint> + Clone {
    proptest::sample::select(EntryPoint::ALL.to_vec())
}

/// Before or after.
pub fn phase() -> impl Strategy<Value = HookPhase> + Clone {
    prop_oneof![Just(HookPhase::Will), Just(HookPhase::Finished)]
}

/// Any resume cause.
pub fn cause() -> impl Strategy<Value = ResumeCause> + Clone {
    prop_oneof![
        Just(ResumeCause::Resume),
        Just(ResumeCause::Step),
        Just(ResumeCause::Deadline),
        Just(ResumeCause::Cleared),
        Just(ResumeCause::ClientGone),
    ]
}

/// Any slot state, token counts below `max_tokens`.
pub fn slot_state(max_tokens: usize) -> impl Strategy<Value = SlotState> + Clone {
    let n = 0..max_tokens.max(1);
    prop_oneof![
        Just(SlotState::Initialized),
        n.clone().prop_map(SlotState::OnboardStaged),
        n.prop_map(SlotState::Onboarding),
        Just(SlotState::Prefilling),
        Just(SlotState::Decoding),
        Just(SlotState::SkippedPrefill),
        Just(SlotState::SkippedDecode),
        Just(SlotState::Preempted),
        Just(SlotState::Finishing),
        Just(SlotState::Finished),
    ]
}

/// Free text: any unicode, the empty string included.
pub fn text() -> impl Strategy<Value = String> + Clone {
    prop_oneof![".{0,40}", any::<String>()]
}

fn text_of(shape: Shape) -> BoxedStrategy<String> {
    if shape.any_text {
        text().boxed()
    } else {
        Just("\"why\"\n\\".to_string()).boxed()
    }
}

/// Any event kind, each kind equally likely.
pub fn event_kind(shape: Shape) -> BoxedStrategy<EventKind> {
    // Boxed per kind: the unboxed union of every kind's nested strategy
    // types needs more than a test thread's stack in a debug build.
    Union::new(KindTag::ALL.iter().map(|&k| kind_of(k, shape))).boxed()
}

/// Events of kind `tag` only ([`KindTag::strategy`]).
pub fn kind_of(tag: KindTag, s: Shape) -> BoxedStrategy<EventKind> {
    tag.strategy(s)
}

/// `KindTag::strategy` and `KindTag::sample`, from the kinds as declared
/// (see `with_event_kinds!` in [`crate::event`]).
macro_rules! testing_of_kinds {
    ($( $variant:ident { $($field:ident: $fty:ty),* } )*) => {
        impl KindTag {
            /// Events of this kind, each field drawn by its type as
            /// `shape` says ([`FieldValue`]).
            pub fn strategy(self, shape: Shape) -> BoxedStrategy<EventKind> {
                match self {
                    $(KindTag::$variant => ($(<$fty as FieldValue>::strategy(shape),)*)
                        .prop_map(|($($field,)*)| EventKind::$variant { $($field),* })
                        .boxed(),)*
                }
            }

            /// One fixed event of this kind: every field set by its type
            /// to something other than its default, the fields of a kind
            /// to different examples where their types allow (so a codec
            /// that swaps two of a kind's fields fails on it).
            pub fn sample(self) -> EventKind {
                // 8 a kind: more than any kind's fields.
                let mut n = 8 * self.index() as u32;
                let mut next = || {
                    n += 1;
                    n
                };
                match self {
                    $(KindTag::$variant => EventKind::$variant {
                        $($field: <$fty as FieldValue>::sample(next())),*
                    },)*
                }
            }
        }
    };
}

with_event_kinds!(testing);

/// A type an event kind's field may have: how tests draw it, and a fixed
/// example. The kinds' strategies and samples are made from these by the
/// kind's declaration, so a kind whose fields have these types needs
/// nothing here; a field of a new type does not compile until its type
/// has an impl.
pub trait FieldValue: Sized + Clone + std::fmt::Debug + 'static {
    /// Values as `shape` draws them.
    fn strategy(shape: Shape) -> BoxedStrategy<Self>;
    /// A fixed value other than the default, varying with `n` (each field
    /// of [`KindTag::sample`] has its own `n`).
    fn sample(n: u32) -> Self;
}

impl FieldValue for u32 {
    /// Token and block counts, block ids and gauges.
    fn strategy(s: Shape) -> BoxedStrategy<Self> {
        (0..s.counts).boxed()
    }
    fn sample(n: u32) -> Self {
        3 * n + 1
    }
}

impl FieldValue for u64 {
    /// Transfer, batch and breakpoint ids, bytes and durations.
    fn strategy(s: Shape) -> BoxedStrategy<Self> {
        (0..s.ids).boxed()
    }
    fn sample(n: u32) -> Self {
        1000 * u64::from(n) + 7
    }
}

impl FieldValue for bool {
    fn strategy(_: Shape) -> BoxedStrategy<Self> {
        any::<bool>().boxed()
    }
    fn sample(_: u32) -> Self {
        true
    }
}

impl FieldValue for String {
    fn strategy(s: Shape) -> BoxedStrategy<Self> {
        text_of(s)
    }
    fn sample(n: u32) -> Self {
        format!("why {n}: \"quoted\", \\ and ü\n")
    }
}

impl FieldValue for Tier {
    fn strategy(_: Shape) -> BoxedStrategy<Self> {
        tier().boxed()
    }
    fn sample(n: u32) -> Self {
        Tier::ALL[n as usize % Tier::ALL.len()]
    }
}

impl FieldValue for Direction {
    fn strategy(_: Shape) -> BoxedStrategy<Self> {
        direction().boxed()
    }
    fn sample(n: u32) -> Self {
        let d = [
            Direction::DEVICE_TO_HOST,
            Direction::HOST_TO_DISK,
            Direction::DISK_TO_HOST,
            Direction::HOST_TO_DEVICE,
        ];
        d[n as usize % d.len()]
    }
}

impl FieldValue for SlotState {
    fn strategy(s: Shape) -> BoxedStrategy<Self> {
        slot_state(s.state_tokens).boxed()
    }
    fn sample(n: u32) -> Self {
        let tokens = 16 * n as usize;
        if n.is_multiple_of(2) {
            SlotState::OnboardStaged(tokens)
        } else {
            SlotState::Onboarding(tokens)
        }
    }
}

impl FieldValue for EntryPoint {
    fn strategy(_: Shape) -> BoxedStrategy<Self> {
        entry().boxed()
    }
    fn sample(n: u32) -> Self {
        EntryPoint::ALL[n as usize % EntryPoint::ALL.len()]
    }
}

impl FieldValue for HookPhase {
    fn strategy(_: Shape) -> BoxedStrategy<Self> {
        phase().boxed()
    }
    fn sample(_: u32) -> Self {
        HookPhase::Finished
    }
}

impl FieldValue for ResumeCause {
    fn strategy(_: Shape) -> BoxedStrategy<Self> {
        cause().boxed()
    }
    fn sample(_: u32) -> Self {
        ResumeCause::Deadline
    }
}

impl FieldValue for SequenceHash {
    fn strategy(s: Shape) -> BoxedStrategy<Self> {
        (0..s.hashes).prop_map(SequenceHash).boxed()
    }
    fn sample(n: u32) -> Self {
        // High bits set: hashes are full-width.
        SequenceHash(0x1f2e_3d4c_5b6a_0000 ^ u64::from(n))
    }
}

impl<T: FieldValue> FieldValue for Option<T> {
    fn strategy(s: Shape) -> BoxedStrategy<Self> {
        proptest::option::of(T::strategy(s)).boxed()
    }
    fn sample(n: u32) -> Self {
        Some(T::sample(n))
    }
}

impl<T: FieldValue> FieldValue for Vec<T> {
    /// Up to 16 values.
    fn strategy(s: Shape) -> BoxedStrategy<Self> {
        vec(T::strategy(s), 0..16).boxed()
    }
    fn sample(n: u32) -> Self {
        (0..3).map(|i| T::sample(100 * n + i)).collect()
    }
}

/// Any single event: random envelope, no request or any request id, any
/// kind, any values.
pub fn event() -> BoxedStrategy<Event> {
    (
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        proptest::option::of(text()),
        event_kind(Shape::WIDE),
    )
        .prop_map(|(engine, seq, ts_ns, iteration, request, kind)| Event {
            engine,
            seq,
            ts_ns,
            iteration,
            request: request.map(Arc::from),
            kind,
        })
        .boxed()
}

/// The request ids [`events`] draws from: a few plain ones and a few that
/// quoting and escaping get wrong.
pub const REQUESTS: [&str; 5] = ["a", "b", "c", "d\"\n\\", "ü"];

/// A stream of up to `max` events as an engine (mostly) emits them:
/// sequence numbers mostly consecutive and timestamps mostly rising, with
/// repeats, holes, time going backwards, timestamps near `u64::MAX` and a
/// second engine mixed in, requests drawn from [`REQUESTS`], kinds from
/// `shape`.
pub fn events(max: usize, shape: Shape) -> impl Strategy<Value = Vec<Event>> {
    let one = (
        prop_oneof![
            16 => Just(Step::Next),
            1 => Just(Step::Repeat),
            1 => Just(Step::Hole),
            1 => Just(Step::Backwards),
            1 => Just(Step::EndOfTime),
            1 => Just(Step::Foreign),
        ],
        0u64..3,
        0u64..1_000_000,
        proptest::option::of(0..REQUESTS.len()),
        event_kind(shape),
    );
    vec(one, 0..max.max(1)).prop_map(|raw| {
        let mut seq = 0u64;
        let mut ts = 0u64;
        raw.into_iter()
            .enumerate()
            .map(|(i, (step, d, dts, req, kind))| {
                if i > 0 {
                    seq = match step {
                        Step::Repeat => seq.saturating_sub(d),
                        Step::Hole => seq.saturating_add(1 + d * 1000),
                        _ => seq.saturating_add(1),
                    };
                }
                ts = match step {
                    Step::Backwards => ts.saturating_sub(dts),
                    Step::EndOfTime => u64::MAX - dts,
                    _ => ts.saturating_add(dts),
                };
                Event {
                    engine: u32::from(step == Step::Foreign),
                    seq,
                    ts_ns: ts,
                    iteration: seq / 3,
                    request: req.map(|r| RequestId::from(REQUESTS[r])),
                    kind,
                }
            })
            .collect()
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Next,
    Repeat,
    Hole,
    Backwards,
    EndOfTime,
    Foreign,
}

/// One fixed example of kind `tag` ([`KindTag::sample`]).
pub fn sample_kind(tag: KindTag) -> EventKind {
    tag.sample()
}

/// [`sample_kind`] of every kind, in declaration order.
pub fn one_of_each() -> Vec<EventKind> {
    KindTag::ALL.iter().map(|&k| sample_kind(k)).collect()
}

/// One event of every kind with a gapless envelope (engine 1, seq 0..,
/// 10 ns apart, request `"r"` on each).
pub fn sample_events() -> Vec<Event> {
    one_of_each()
        .into_iter()
        .enumerate()
        .map(|(i, kind)| Event {
            engine: 1,
            seq: i as u64,
            ts_ns: 10 * i as u64,
            iteration: i as u64 / 4,
            request: Some(RequestId::from("r")),
            kind,
        })
        .collect()
}

/// A plain event with `seq` (a host pool's gauge, engine 3), for tests of
/// what carries events whatever they say: batches, logs, writers.
pub fn gauge(seq: u64) -> Event {
    Event {
        engine: 3,
        seq,
        ts_ns: seq * 10,
        iteration: 0,
        request: None,
        kind: EventKind::PoolGauge {
            tier: Tier::Host,
            capacity: 1,
            active: 0,
            inactive: 0,
            empty: 1,
        },
    }
}
