//! Test helpers: a small builder for hand-written event streams, and a
//! proptest strategy for arbitrary (mostly nonsensical) ones.

use kvbm_core::events::{Direction, EntryPoint, Event, EventKind, HookPhase, ResumeCause};
use kvbm_core::slot::SlotState;
use kvbm_core::tier::Tier;
use kvbm_core::tokens::SequenceHash;
use proptest::prelude::*;
use std::sync::Arc;

/// Builds a stream with gapless sequence numbers: `s.at(ts).create("a", 32)`.
#[derive(Debug, Default)]
pub struct Stream {
    events: Vec<Event>,
    ts: u64,
    seq: u64,
    engine: u32,
}

impl Stream {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_engine(engine: u32) -> Self {
        Stream {
            engine,
            ..Self::default()
        }
    }

    pub fn events(&self) -> &[Event] {
        &self.events
    }

    pub fn into_events(self) -> Vec<Event> {
        self.events
    }

    /// Sets the timestamp of the following events.
    pub fn at(&mut self, ts: u64) -> &mut Self {
        self.ts = ts;
        self
    }

    /// Skips `n` sequence numbers (as if they were lost).
    pub fn lose(&mut self, n: u64) -> &mut Self {
        self.seq += n;
        self
    }

    pub fn raw(&mut self, ev: Event) -> &mut Self {
        self.events.push(ev);
        self
    }

    pub fn push(&mut self, request: Option<&str>, kind: EventKind) -> &mut Self {
        self.events.push(Event {
            engine: self.engine,
            seq: self.seq,
            ts_ns: self.ts,
            iteration: self.ts / 100,
            request: request.map(Arc::from),
            kind,
        });
        self.seq += 1;
        self
    }

    pub fn create(&mut self, r: &str, prompt: u32) -> &mut Self {
        self.push(
            Some(r),
            EventKind::SlotCreated {
                prompt_tokens: prompt,
                max_output_tokens: 4,
            },
        )
    }

    pub fn to(&mut self, r: &str, from: SlotState, to: SlotState) -> &mut Self {
        self.push(Some(r), EventKind::SlotTransition { from, to })
    }

    pub fn tokens(&mut self, r: &str, prefill: u32, decode: u32) -> &mut Self {
        self.push(
            Some(r),
            EventKind::TokensScheduled {
                prefill,
                decode,
                computed: prefill + decode,
            },
        )
    }

    pub fn alloc(&mut self, r: &str, tier: Tier, n: u32) -> &mut Self {
        self.push(
            Some(r),
            EventKind::BlocksAllocated {
                tier,
                blocks: (0..n).collect(),
            },
        )
    }

    pub fn release(&mut self, r: &str, tier: Tier, count: u32) -> &mut Self {
        self.push(Some(r), EventKind::BlocksReleased { tier, count })
    }

    pub fn plan(&mut self, r: &str, id: u64, d: Direction, blocks: u32) -> &mut Self {
        self.push(
            Some(r),
            EventKind::TransferPlanned {
                transfer: id,
                direction: d,
                blocks,
            },
        )
    }

    pub fn promote(&mut self, r: &str, id: u64, d: Direction, blocks: u32) -> &mut Self {
        self.push(
            Some(r),
            EventKind::TransferPromoted {
                transfer: id,
                direction: d,
                blocks,
            },
        )
    }

    pub fn complete(&mut self, r: &str, id: u64, d: Direction, blocks: u32) -> &mut Self {
        self.push(
            Some(r),
            EventKind::TransferCompleted {
                transfer: id,
                direction: d,
                blocks,
            },
        )
    }

    pub fn fail(&mut self, r: &str, id: u64, d: Direction) -> &mut Self {
        self.push(
            Some(r),
            EventKind::TransferFailed {
                transfer: id,
                direction: d,
                error: "io".into(),
            },
        )
    }

    pub fn cancel(&mut self, r: &str, id: u64, d: Direction) -> &mut Self {
        self.push(
            Some(r),
            EventKind::TransferCancelled {
                transfer: id,
                direction: d,
            },
        )
    }

    pub fn skip(&mut self, r: &str, id: u64, d: Direction, reason: &str) -> &mut Self {
        self.push(
            Some(r),
            EventKind::TransferSkipped {
                transfer: id,
                direction: d,
                reason: reason.into(),
            },
        )
    }

    pub fn batch(&mut self, id: u64, d: Direction, transfers: &[u64], blocks: u32) -> &mut Self {
        self.push(
            None,
            EventKind::BatchDispatched {
                batch: id,
                direction: d,
                transfers: transfers.to_vec(),
                blocks,
            },
        )
    }

    pub fn breakpoint(&mut self, r: Option<&str>, id: u64) -> &mut Self {
        self.push(
            r,
            EventKind::BreakpointHit {
                breakpoint: id,
                entry: EntryPoint::BuildConnectorMetadata,
                deadline_ns: self.ts + 1_000,
            },
        )
    }

    /// A complete, well-formed life of request `r` starting at the current
    /// time: create, prefill with 2 device blocks, one store G1→G2 (id
    /// `xfer`), decode, finish, release.
    pub fn life(&mut self, r: &str, xfer: u64) -> &mut Self {
        use SlotState::*;
        let t = self.ts;
        self.at(t).create(r, 32);
        self.at(t + 10).to(r, Initialized, Prefilling);
        self.at(t + 10).alloc(r, Tier::Device, 2);
        self.at(t + 20).tokens(r, 32, 0);
        self.at(t + 30).plan(r, xfer, Direction::DEVICE_TO_HOST, 2);
        self.at(t + 35).to(r, Prefilling, Decoding);
        self.at(t + 40).tokens(r, 0, 1);
        self.at(t + 45)
            .promote(r, xfer, Direction::DEVICE_TO_HOST, 2);
        self.at(t + 46)
            .batch(xfer, Direction::DEVICE_TO_HOST, &[xfer], 2);
        self.at(t + 50).to(r, Decoding, Finishing);
        self.at(t + 60)
            .complete(r, xfer, Direction::DEVICE_TO_HOST, 2);
        self.at(t + 60).release(r, Tier::Device, 2);
        self.at(t + 60).to(r, Finishing, Finished);
        self.at(t + 60)
    }
}

fn arb_state() -> impl Strategy<Value = SlotState> {
    use SlotState::*;
    prop_oneof![
        Just(Initialized),
        (0usize..64).prop_map(OnboardStaged),
        (0usize..64).prop_map(Onboarding),
        Just(Prefilling),
        Just(Decoding),
        Just(SkippedPrefill),
        Just(SkippedDecode),
        Just(Preempted),
        Just(Finishing),
        Just(Finished),
    ]
}

fn arb_tier() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::Device), Just(Tier::Host), Just(Tier::Disk)]
}

fn arb_direction() -> impl Strategy<Value = Direction> {
    (arb_tier(), arb_tier()).prop_map(|(src, dst)| Direction { src, dst })
}

fn arb_kind() -> impl Strategy<Value = EventKind> {
    // Small id spaces so that random events often refer to the same
    // requests, transfers and batches.
    let id = 0u64..6;
    let n = 0u32..5;
    prop_oneof![
        (n.clone(), n.clone()).prop_map(|(p, m)| EventKind::SlotCreated {
            prompt_tokens: p,
            max_output_tokens: m
        }),
        (arb_state(), arb_state()).prop_map(|(from, to)| EventKind::SlotTransition { from, to }),
        (arb_tier(), n.clone(), n.clone(), n.clone()).prop_map(|(tier, a, b, c)| {
            EventKind::MatchResult {
                tier,
                looked_up: a,
                hit_blocks: b,
                hit_tokens: c,
            }
        }),
        (arb_tier(), proptest::collection::vec(0u32..8, 0..4))
            .prop_map(|(tier, blocks)| EventKind::BlocksAllocated { tier, blocks }),
        (arb_tier(), n.clone()).prop_map(|(tier, count)| EventKind::BlocksReleased { tier, count }),
        (arb_tier(), 0u32..8, 0u64..4, proptest::option::of(0u32..8)).prop_map(
            |(tier, block, h, duplicate_of)| EventKind::BlockRegistered {
                tier,
                block,
                sequence_hash: SequenceHash(h),
                duplicate_of,
            }
        ),
        (arb_tier(), 0u32..8, 0u64..4).prop_map(|(tier, block, h)| EventKind::BlockEvicted {
            tier,
            block,
            sequence_hash: SequenceHash(h),
        }),
        (id.clone(), arb_direction(), n.clone()).prop_map(|(transfer, direction, blocks)| {
            EventKind::TransferPlanned {
                transfer,
                direction,
                blocks,
            }
        }),
        (id.clone(), arb_direction(), n.clone()).prop_map(|(transfer, direction, blocks)| {
            EventKind::TransferPromoted {
                transfer,
                direction,
                blocks,
            }
        }),
        (id.clone(), arb_direction()).prop_map(|(transfer, direction)| {
            EventKind::TransferSkipped {
                transfer,
                direction,
                reason: "\"why\"\n".into(),
            }
        }),
        (id.clone(), arb_direction()).prop_map(|(transfer, direction)| {
            EventKind::TransferCancelled {
                transfer,
                direction,
            }
        }),
        (id.clone(), arb_direction(), n.clone()).prop_map(|(transfer, direction, blocks)| {
            EventKind::TransferCompleted {
                transfer,
                direction,
                blocks,
            }
        }),
        (id.clone(), arb_direction()).prop_map(|(transfer, direction)| {
            EventKind::TransferFailed {
                transfer,
                direction,
                error: "boom\\".into(),
            }
        }),
        (
            id.clone(),
            arb_direction(),
            proptest::collection::vec(0u64..6, 0..3),
            any::<u32>()
        )
            .prop_map(|(batch, direction, transfers, blocks)| {
                EventKind::BatchDispatched {
                    batch,
                    direction,
                    transfers,
                    blocks,
                }
            }),
        (
            id.clone(),
            arb_direction(),
            any::<bool>(),
            n.clone(),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(|(batch, direction, ok, blocks, bytes, elapsed_ns)| {
                EventKind::BatchCompleted {
                    batch,
                    direction,
                    ok,
                    blocks,
                    bytes,
                    elapsed_ns,
                }
            }),
        (arb_tier(), n.clone(), n.clone(), n.clone(), n.clone()).prop_map(
            |(tier, capacity, active, inactive, empty)| EventKind::PoolGauge {
                tier,
                capacity,
                active,
                inactive,
                empty,
            }
        ),
        (0usize..6, any::<bool>()).prop_map(|(e, will)| EventKind::HookCall {
            entry: EntryPoint::ALL[e],
            phase: if will {
                HookPhase::Will
            } else {
                HookPhase::Finished
            },
        }),
        (id.clone(), 0usize..6, any::<u64>()).prop_map(|(breakpoint, e, deadline_ns)| {
            EventKind::BreakpointHit {
                breakpoint,
                entry: EntryPoint::ALL[e],
                deadline_ns,
            }
        }),
        (id, any::<bool>()).prop_map(|(breakpoint, r)| EventKind::Resumed {
            breakpoint,
            cause: if r {
                ResumeCause::Resume
            } else {
                ResumeCause::Deadline
            },
        }),
        (n.clone(), n.clone(), any::<u32>()).prop_map(|(prefill, decode, computed)| {
            EventKind::TokensScheduled {
                prefill,
                decode,
                computed,
            }
        }),
    ]
}

/// Arbitrary events: mostly increasing sequence numbers and timestamps (so
/// the analyses get past the envelope check), with jumps, repeats, another
/// engine, timestamps near `u64::MAX` and odd request ids mixed in.
pub fn arb_events(max: usize) -> impl Strategy<Value = Vec<Event>> {
    let one = (
        0u8..20,
        0u64..3,
        0u64..1_000_000,
        proptest::option::of(prop_oneof![
            Just("a"),
            Just("b"),
            Just("c\"\n\\"),
            Just("ü"),
        ]),
        arb_kind(),
    );
    proptest::collection::vec(one, 0..max).prop_map(|raw| {
        let mut seq = 0u64;
        let mut ts = 0u64;
        raw.into_iter()
            .map(|(mode, dseq, dts, req, kind)| {
                match mode {
                    0 => seq = seq.saturating_sub(dseq),        // repeat / go back
                    1 => seq = seq.saturating_add(dseq * 1000), // big hole
                    _ => seq = seq.saturating_add(dseq.min(1) + u64::from(dseq == 2)),
                }
                ts = match mode {
                    2 => ts.saturating_sub(dts), // time goes backwards
                    3 => u64::MAX - dts,         // near the end of time
                    _ => ts.saturating_add(dts),
                };
                Event {
                    engine: u32::from(mode == 4),
                    seq,
                    ts_ns: ts,
                    iteration: seq / 3,
                    request: req.map(Arc::from),
                    kind,
                }
            })
            .collect()
    })
}
