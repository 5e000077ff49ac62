//! Property-test strategies for events, shared by every crate's tests
//! (feature `testing`).
//!
//! There is one strategy per kind, chosen by an exhaustive match on
//! [`KindTag`], so a new kind does not compile until it can be generated
//! here, and every test that generates events generates it.
//!
//! - [`Shape::WIDE`]: any value of every field (codecs, parsers);
//! - [`Shape::SMALL`]: small id spaces and counts, so that random events
//!   keep referring to the same transfers, batches and blocks (reducers,
//!   analyses).

use crate::event::KindTag;
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

/// Events of kind `tag` only.
pub fn kind_of(tag: KindTag, s: Shape) -> BoxedStrategy<EventKind> {
    use EventKind as K;
    let id = 0..s.ids;
    let n = 0..s.counts;
    let hash = (0..s.hashes).prop_map(SequenceHash);
    let state = slot_state(s.state_tokens);
    // Exhaustive on purpose: a new kind must be generated here.
    match tag {
        KindTag::SlotCreated => (n.clone(), n)
            .prop_map(|(prompt_tokens, max_output_tokens)| K::SlotCreated {
                prompt_tokens,
                max_output_tokens,
            })
            .boxed(),
        KindTag::SlotTransition => (state.clone(), state)
            .prop_map(|(from, to)| K::SlotTransition { from, to })
            .boxed(),
        KindTag::MatchResult => (tier(), n.clone(), n.clone(), n)
            .prop_map(|(tier, looked_up, hit_blocks, hit_tokens)| K::MatchResult {
                tier,
                looked_up,
                hit_blocks,
                hit_tokens,
            })
            .boxed(),
        KindTag::BlocksAllocated => (tier(), vec(n, 0..16))
            .prop_map(|(tier, blocks)| K::BlocksAllocated { tier, blocks })
            .boxed(),
        KindTag::BlocksReleased => (tier(), n)
            .prop_map(|(tier, count)| K::BlocksReleased { tier, count })
            .boxed(),
        KindTag::BlockRegistered => (tier(), n.clone(), hash, proptest::option::of(n))
            .prop_map(
                |(tier, block, sequence_hash, duplicate_of)| K::BlockRegistered {
                    tier,
                    block,
                    sequence_hash,
                    duplicate_of,
                },
            )
            .boxed(),
        KindTag::BlockEvicted => (tier(), n, hash)
            .prop_map(|(tier, block, sequence_hash)| K::BlockEvicted {
                tier,
                block,
                sequence_hash,
            })
            .boxed(),
        KindTag::TransferPlanned => (id, direction(), n)
            .prop_map(|(transfer, direction, blocks)| K::TransferPlanned {
                transfer,
                direction,
                blocks,
            })
            .boxed(),
        KindTag::TransferPromoted => (id, direction(), n)
            .prop_map(|(transfer, direction, blocks)| K::TransferPromoted {
                transfer,
                direction,
                blocks,
            })
            .boxed(),
        KindTag::TransferSkipped => (id, direction(), text_of(s))
            .prop_map(|(transfer, direction, reason)| K::TransferSkipped {
                transfer,
                direction,
                reason,
            })
            .boxed(),
        KindTag::TransferCancelled => (id, direction())
            .prop_map(|(transfer, direction)| K::TransferCancelled {
                transfer,
                direction,
            })
            .boxed(),
        KindTag::TransferCompleted => (id, direction(), n)
            .prop_map(|(transfer, direction, blocks)| K::TransferCompleted {
                transfer,
                direction,
                blocks,
            })
            .boxed(),
        KindTag::TransferFailed => (id, direction(), text_of(s))
            .prop_map(|(transfer, direction, error)| K::TransferFailed {
                transfer,
                direction,
                error,
            })
            .boxed(),
        KindTag::BatchDispatched => batch_dispatched(s),
        KindTag::BatchCompleted => batch_completed(s),
        KindTag::PoolGauge => (tier(), n.clone(), n.clone(), n.clone(), n)
            .prop_map(|(tier, capacity, active, inactive, empty)| K::PoolGauge {
                tier,
                capacity,
                active,
                inactive,
                empty,
            })
            .boxed(),
        KindTag::HookCall => (entry(), phase())
            .prop_map(|(entry, phase)| K::HookCall { entry, phase })
            .boxed(),
        KindTag::BreakpointHit => (id, entry(), any::<u64>())
            .prop_map(|(breakpoint, entry, deadline_ns)| K::BreakpointHit {
                breakpoint,
                entry,
                deadline_ns,
            })
            .boxed(),
        KindTag::Resumed => (id, cause())
            .prop_map(|(breakpoint, cause)| K::Resumed { breakpoint, cause })
            .boxed(),
        KindTag::TokensScheduled => (n.clone(), n, any::<u32>())
            .prop_map(|(prefill, decode, computed)| K::TokensScheduled {
                prefill,
                decode,
                computed,
            })
            .boxed(),
        KindTag::PrefixLookup => prefix_lookup(s),
    }
}

/// `BatchDispatched` events, for [`kind_of`].
fn batch_dispatched(s: Shape) -> BoxedStrategy<EventKind> {
    (0..s.ids, direction(), vec(0..s.ids, 0..8), any::<u32>())
        .prop_map(
            |(batch, direction, transfers, blocks)| EventKind::BatchDispatched {
                batch,
                direction,
                transfers,
                blocks,
            },
        )
        .boxed()
}

/// `BatchCompleted` events, for [`kind_of`].
fn batch_completed(s: Shape) -> BoxedStrategy<EventKind> {
    (
        0..s.ids,
        direction(),
        any::<bool>(),
        0..s.counts,
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(batch, direction, ok, blocks, bytes, elapsed_ns)| EventKind::BatchCompleted {
                batch,
                direction,
                ok,
                blocks,
                bytes,
                elapsed_ns,
            },
        )
        .boxed()
}

/// `PrefixLookup` events, for [`kind_of`].
fn prefix_lookup(s: Shape) -> BoxedStrategy<EventKind> {
    let n = 0..s.counts;
    let hash = (0..s.hashes).prop_map(SequenceHash);
    (n.clone(), n.clone(), n, vec(hash, 0..24))
        .prop_map(
            |(tokens, block_size, computed_blocks, hashes)| EventKind::PrefixLookup {
                tokens,
                block_size,
                computed_blocks,
                hashes,
            },
        )
        .boxed()
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

/// One fixed example of kind `tag`, every field set to something other
/// than its default.
pub fn sample_kind(tag: KindTag) -> EventKind {
    use EventKind as K;
    let d = Direction::DEVICE_TO_HOST;
    match tag {
        KindTag::SlotCreated => K::SlotCreated {
            prompt_tokens: 48,
            max_output_tokens: 8,
        },
        KindTag::SlotTransition => K::SlotTransition {
            from: SlotState::OnboardStaged(32),
            to: SlotState::Onboarding(32),
        },
        KindTag::MatchResult => K::MatchResult {
            tier: Tier::Host,
            looked_up: 3,
            hit_blocks: 2,
            hit_tokens: 32,
        },
        KindTag::BlocksAllocated => K::BlocksAllocated {
            tier: Tier::Device,
            blocks: vec![4, 5, 6],
        },
        KindTag::BlocksReleased => K::BlocksReleased {
            tier: Tier::Device,
            count: 3,
        },
        KindTag::BlockRegistered => K::BlockRegistered {
            tier: Tier::Disk,
            block: 7,
            sequence_hash: SequenceHash(0x1f2e_3d4c_5b6a_7988),
            duplicate_of: Some(2),
        },
        KindTag::BlockEvicted => K::BlockEvicted {
            tier: Tier::Host,
            block: 9,
            sequence_hash: SequenceHash(u64::MAX),
        },
        KindTag::TransferPlanned => K::TransferPlanned {
            transfer: 11,
            direction: d,
            blocks: 2,
        },
        KindTag::TransferPromoted => K::TransferPromoted {
            transfer: 11,
            direction: d,
            blocks: 2,
        },
        KindTag::TransferSkipped => K::TransferSkipped {
            transfer: 12,
            direction: Direction::HOST_TO_DISK,
            reason: "DestinationFull".into(),
        },
        KindTag::TransferCancelled => K::TransferCancelled {
            transfer: 13,
            direction: Direction::DISK_TO_HOST,
        },
        KindTag::TransferCompleted => K::TransferCompleted {
            transfer: 11,
            direction: d,
            blocks: 2,
        },
        KindTag::TransferFailed => K::TransferFailed {
            transfer: 14,
            direction: Direction::HOST_TO_DEVICE,
            error: "short read: 3 of 4096 bytes".into(),
        },
        KindTag::BatchDispatched => K::BatchDispatched {
            batch: 3,
            direction: d,
            transfers: vec![11, 15],
            blocks: 4,
        },
        KindTag::BatchCompleted => K::BatchCompleted {
            batch: 3,
            direction: d,
            ok: true,
            blocks: 4,
            bytes: 1 << 20,
            elapsed_ns: 250_000,
        },
        KindTag::PoolGauge => K::PoolGauge {
            tier: Tier::Host,
            capacity: 64,
            active: 10,
            inactive: 20,
            empty: 34,
        },
        KindTag::HookCall => K::HookCall {
            entry: EntryPoint::BuildConnectorMetadata,
            phase: HookPhase::Finished,
        },
        KindTag::BreakpointHit => K::BreakpointHit {
            breakpoint: 2,
            entry: EntryPoint::GetNumNewMatchedTokens,
            deadline_ns: 60_000_000_000,
        },
        KindTag::Resumed => K::Resumed {
            breakpoint: 2,
            cause: ResumeCause::Deadline,
        },
        KindTag::TokensScheduled => K::TokensScheduled {
            prefill: 16,
            decode: 1,
            computed: 49,
        },
        KindTag::PrefixLookup => K::PrefixLookup {
            tokens: 49,
            block_size: 16,
            computed_blocks: 1,
            hashes: vec![
                SequenceHash(0x0a0b),
                SequenceHash(u64::MAX),
                SequenceHash(7),
            ],
        },
    }
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
