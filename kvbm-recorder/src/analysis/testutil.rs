//! Test helpers: a small builder for hand-written event streams, and a
//! proptest strategy for arbitrary (mostly nonsensical) ones.

use kvbm_events::slot::SlotState;
use kvbm_events::tier::Tier;
use kvbm_events::{Direction, EntryPoint, Event, EventKind};
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

/// Arbitrary event streams (see `kvbm_events::testing::events`).
pub fn arb_events(max: usize) -> impl Strategy<Value = Vec<Event>> {
    kvbm_events::testing::events(max, kvbm_events::testing::Shape::SMALL)
}
