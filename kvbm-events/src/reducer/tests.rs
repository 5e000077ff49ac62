use super::*;
use crate::testing::one_of_each;
use crate::tier::BlockId;
use SlotState::*;
use proptest::prelude::*;
use std::sync::Arc;

/// Builds events with an incrementing sequence and a clock that moves
/// 10 ns per event.
struct Script {
    seq: u64,
    ts: u64,
    iteration: u64,
    events: Vec<Event>,
}

impl Script {
    fn new() -> Self {
        Script {
            seq: 0,
            ts: 0,
            iteration: 0,
            events: Vec::new(),
        }
    }

    fn push(&mut self, request: Option<&str>, kind: EventKind) -> &mut Self {
        self.events.push(Event {
            engine: 1,
            seq: self.seq,
            ts_ns: self.ts,
            iteration: self.iteration,
            request: request.map(Arc::from),
            kind,
        });
        self.seq += 1;
        self.ts += 10;
        self
    }

    fn req(&mut self, r: &str, kind: EventKind) -> &mut Self {
        self.push(Some(r), kind)
    }

    fn global(&mut self, kind: EventKind) -> &mut Self {
        self.push(None, kind)
    }

    fn state(&self) -> EngineState {
        fold(&self.events)
    }
}

fn created(prompt: u32) -> EventKind {
    EventKind::SlotCreated {
        prompt_tokens: prompt,
        max_output_tokens: 4,
    }
}

fn tr(from: SlotState, to: SlotState) -> EventKind {
    EventKind::SlotTransition { from, to }
}

fn planned(id: u64, direction: Direction, blocks: u32) -> EventKind {
    EventKind::TransferPlanned {
        transfer: id,
        direction,
        blocks,
    }
}

fn completed(id: u64, direction: Direction, blocks: u32) -> EventKind {
    EventKind::TransferCompleted {
        transfer: id,
        direction,
        blocks,
    }
}

#[test]
fn every_kind_is_counted_under_its_name() {
    let kinds = one_of_each();
    assert_eq!(kinds.len(), KindTag::COUNT);
    let mut s = Script::new();
    for k in kinds.iter().cloned() {
        s.req("r", k);
    }
    let st = s.state();
    for (k, tag) in kinds.iter().zip(KindTag::ALL) {
        assert_eq!(k.tag(), *tag);
        assert_eq!(st.count_of(tag.name()), 1, "{tag}");
    }
    let n = KindTag::COUNT as u64;
    assert_eq!(st.counts_by_kind().map(|(_, n)| n).sum::<u64>(), n);
    assert_eq!(st.count_of("NoSuchKind"), 0);
    assert_eq!(st.stream().events, n);
    assert_eq!(st.last_seq(), Some(n - 1));
    assert_eq!(st.last_ts_ns(), (n - 1) * 10);
    assert_eq!(st.engine(), Some(1));
    // Every sample names its own ids and states, so they do not make one
    // story: the five transfer kinds after `TransferPlanned` name
    // transfers never planned, and the transition, the release, the
    // batch's completion, the eviction and the resume each find nothing
    // before them.
    assert_eq!(st.inconsistencies().unknown_transfer, 5);
    assert_eq!(
        st.inconsistencies().total(),
        10,
        "{:?}",
        st.inconsistencies()
    );
}

fn lookup(tier: Tier, hit_blocks: u32) -> EventKind {
    EventKind::MatchResult {
        tier,
        looked_up: 8,
        hit_blocks,
        hit_tokens: hit_blocks * BS,
    }
}

/// Tokens per block in the per-request hit tests.
const BS: u32 = 16;

fn prefix_lookup(blocks: u32) -> EventKind {
    EventKind::PrefixLookup {
        tokens: (blocks + 1) * BS,
        block_size: BS,
        computed_blocks: 0,
        hashes: (0..u64::from(blocks)).map(SequenceHash).collect(),
    }
}

/// One scheduling attempt of `r`: its device and host results, in the
/// connector's old order (host first) or the simulator's (device first).
fn ask(s: &mut Script, r: &str, g1: u32, g2: u32, host_first: bool) {
    if host_first {
        s.req(r, lookup(Tier::Host, g2))
            .req(r, lookup(Tier::Device, g1));
    } else {
        s.req(r, lookup(Tier::Device, g1))
            .req(r, lookup(Tier::Host, g2));
    }
}

/// `r` is admitted with `blocks` host blocks to load (transfer `id`),
/// loads them and starts prefilling.
fn load_from_host(s: &mut Script, r: &str, from: SlotState, id: u64, blocks: u32) {
    let n = (blocks * BS) as usize;
    s.req(r, tr(from, OnboardStaged(n)))
        .req(r, planned(id, Direction::HOST_TO_DEVICE, blocks))
        .req(r, tr(OnboardStaged(n), Onboarding(n)))
        .req(r, completed(id, Direction::HOST_TO_DEVICE, blocks))
        .req(r, tr(Onboarding(n), Prefilling));
}

/// A lookup is not a hit: a request asked about again while it waits
/// (each scheduling attempt) shows its latest lookup's device hit, and no
/// host or disk hit until something is loaded for it, however many times
/// and in whatever order those tiers answered. The pool counters still
/// count every lookup.
#[test]
fn lookups_alone_give_only_the_latest_device_hit() {
    let mut s = Script::new();
    s.req("r", created(160));
    for _ in 0..3 {
        ask(&mut s, "r", 2, 4, false);
    }
    assert_eq!(s.state().slot("r").unwrap().hit_tokens, [32, 0, 0]);
    s.req("r", lookup(Tier::Device, 3))
        .req("r", lookup(Tier::Host, 1))
        .req("r", lookup(Tier::Disk, 2));
    assert_eq!(s.state().slot("r").unwrap().hit_tokens, [48, 0, 0]);
    s.req("r", lookup(Tier::Device, 5));
    let st = s.state();
    assert_eq!(st.slot("r").unwrap().hit_tokens, [80, 0, 0]);
    assert_eq!(st.slot("r").unwrap().total_hit_tokens(), 80);
    assert_eq!(st.pool(Tier::Device).lookups, 5);
    assert_eq!(st.pool(Tier::Host).hit_tokens, u64::from((3 * 4 + 1) * BS));
    // The host hits taught the reducer the block size.
    assert_eq!(st.block_size(), BS);
    assert_eq!(st.inconsistencies().total(), 0);
}

/// The vLLM connector's order (issue 40): each attempt's host result came
/// before its device one, on every step while the request waited. Its
/// G2 hit is what was loaded, as with the simulator's order.
#[test]
fn host_hits_are_what_was_loaded_whatever_the_order_of_the_lookups() {
    for host_first in [true, false] {
        for asks in [1, 2, 7] {
            let mut s = Script::new();
            s.req("r", created(200));
            s.req("r", prefix_lookup(12));
            for _ in 0..asks {
                ask(&mut s, "r", 1, 8, host_first);
            }
            // The attempt that got in found 12 blocks on the host.
            ask(&mut s, "r", 1, 12, host_first);
            load_from_host(&mut s, "r", Initialized, 1, 12);
            let st = s.state();
            let slot = st.slot("r").unwrap();
            let what = format!("host first {host_first}, {asks} asks");
            assert_eq!(slot.hit_tokens, [16, 192, 0], "{what}");
            assert_eq!(st.inconsistencies().total(), 0, "{what}");
            // The pool counts every lookup.
            assert_eq!(st.pool(Tier::Host).lookups, asks + 1, "{what}");
        }
    }
}

/// Staged and planned is not loaded: the G2 hit appears when the load
/// completes, and a load that did not complete is no hit.
#[test]
fn a_hit_counts_when_its_load_completes() {
    let mut s = Script::new();
    s.req("a", created(100))
        .req("b", created(100))
        .req("c", created(100));
    for r in ["a", "b", "c"] {
        ask(&mut s, r, 0, 3, true);
    }
    s.req("a", planned(1, Direction::HOST_TO_DEVICE, 3))
        .req("b", planned(2, Direction::HOST_TO_DEVICE, 3))
        .req("c", planned(3, Direction::HOST_TO_DEVICE, 3));
    assert_eq!(s.state().slot("a").unwrap().hit_tokens, [0, 0, 0]);
    s.req("a", completed(1, Direction::HOST_TO_DEVICE, 2))
        .req(
            "b",
            EventKind::TransferFailed {
                transfer: 2,
                direction: Direction::HOST_TO_DEVICE,
                error: "io".into(),
            },
        )
        .req(
            "c",
            EventKind::TransferCancelled {
                transfer: 3,
                direction: Direction::HOST_TO_DEVICE,
            },
        );
    let st = s.state();
    // Two of a's three blocks arrived.
    assert_eq!(st.slot("a").unwrap().hit_tokens, [0, 32, 0]);
    assert_eq!(st.slot("b").unwrap().hit_tokens, [0, 0, 0]);
    assert_eq!(st.slot("c").unwrap().hit_tokens, [0, 0, 0]);
    assert_eq!(st.inconsistencies().total(), 0);
}

/// A request preempted after its load is looked up again and loaded
/// again: it got both loads; its device hit is its latest lookup's.
#[test]
fn a_preempted_request_keeps_what_each_load_brought() {
    let mut s = Script::new();
    s.req("p", created(200)).req("p", prefix_lookup(12));
    ask(&mut s, "p", 0, 4, true);
    load_from_host(&mut s, "p", Initialized, 1, 4);
    s.req("p", tr(Prefilling, Decoding))
        .req("p", tr(Decoding, Preempted));
    assert_eq!(s.state().slot("p").unwrap().hit_tokens, [0, 64, 0]);
    // Asked again on three steps while it waits, host results first; the
    // engine's cache kept 6 blocks, the host has 2 more.
    for _ in 0..3 {
        ask(&mut s, "p", 6, 2, true);
    }
    load_from_host(&mut s, "p", Preempted, 2, 2);
    let st = s.state();
    assert_eq!(st.slot("p").unwrap().hit_tokens, [96, 96, 0]);
    assert_eq!(
        st.direction(Direction::HOST_TO_DEVICE)
            .unwrap()
            .completed_blocks
            * u64::from(BS),
        st.slot("p").unwrap().hit_tokens[Tier::Host.index()]
    );
    assert_eq!(st.inconsistencies().total(), 0);
}

/// Disk blocks are disk hits, whether they go straight to the device or
/// through the host (G3 → G2, then a G2 → G1 transfer of their own, which
/// may complete before or after the host blocks' one).
#[test]
fn disk_hits_through_the_host_count_for_the_disk() {
    for host_hop_last in [false, true] {
        let mut s = Script::new();
        s.req("d", created(200)).req("d", prefix_lookup(12));
        s.req("d", lookup(Tier::Host, 3))
            .req("d", lookup(Tier::Disk, 2))
            .req("d", lookup(Tier::Device, 1));
        s.req("d", tr(Initialized, OnboardStaged(80)))
            .req("d", planned(1, Direction::HOST_TO_DEVICE, 3))
            .req("d", tr(OnboardStaged(80), Onboarding(80)))
            .req("d", planned(2, Direction::DISK_TO_HOST, 2));
        if !host_hop_last {
            s.req("d", completed(1, Direction::HOST_TO_DEVICE, 3));
        }
        s.req("d", completed(2, Direction::DISK_TO_HOST, 2));
        s.req("d", planned(3, Direction::HOST_TO_DEVICE, 2));
        if host_hop_last {
            s.req("d", completed(3, Direction::HOST_TO_DEVICE, 2))
                .req("d", completed(1, Direction::HOST_TO_DEVICE, 3));
        } else {
            s.req("d", completed(3, Direction::HOST_TO_DEVICE, 2));
        }
        s.req("d", tr(Onboarding(80), Prefilling));
        let st = s.state();
        assert_eq!(
            st.slot("d").unwrap().hit_tokens,
            [16, 48, 32],
            "host hop last {host_hop_last}"
        );
        assert_eq!(st.inconsistencies().total(), 0);
    }
    // No host tier: G3 → G1 in one hop.
    let mut s = Script::new();
    s.req("e", created(100))
        .req("e", lookup(Tier::Disk, 2))
        .req("e", planned(9, Direction::DISK_TO_DEVICE, 2))
        .req("e", completed(9, Direction::DISK_TO_DEVICE, 2));
    assert_eq!(s.state().slot("e").unwrap().hit_tokens, [0, 0, 32]);
}

/// Offloads owned by a request (G1 → G2, G2 → G3) are not hits, and a
/// disk hop no G2 → G1 transfer claimed does not leak into the next load.
#[test]
fn only_loads_into_the_device_are_hits() {
    let mut s = Script::new();
    s.req("o", created(100)).req("o", prefix_lookup(6));
    s.req("o", planned(1, Direction::DEVICE_TO_HOST, 4))
        .req("o", completed(1, Direction::DEVICE_TO_HOST, 4))
        .req("o", planned(2, Direction::HOST_TO_DISK, 4))
        .req("o", completed(2, Direction::HOST_TO_DISK, 4));
    // A disk hop whose G2 → G1 hop was never planned.
    s.req("o", tr(Initialized, OnboardStaged(32)))
        .req("o", tr(OnboardStaged(32), Onboarding(32)))
        .req("o", planned(3, Direction::DISK_TO_HOST, 2))
        .req("o", completed(3, Direction::DISK_TO_HOST, 2))
        .req("o", tr(Onboarding(32), Prefilling))
        .req("o", tr(Prefilling, Preempted));
    assert_eq!(s.state().slot("o").unwrap().hit_tokens, [0, 0, 0]);
    // The next load's host blocks are host hits.
    load_from_host(&mut s, "o", Preempted, 4, 2);
    let st = s.state();
    assert_eq!(st.slot("o").unwrap().hit_tokens, [0, 32, 0]);
    assert_eq!(st.inconsistencies().total(), 0);
}

/// A stream that never says its block size credits nothing (it cannot
/// turn blocks into tokens); once a `PrefixLookup` says it, loads count.
#[test]
fn loads_count_from_when_the_block_size_is_known() {
    let mut s = Script::new();
    s.req("r", created(100))
        .req("r", planned(1, Direction::HOST_TO_DEVICE, 2))
        .req("r", completed(1, Direction::HOST_TO_DEVICE, 2));
    assert_eq!(s.state().block_size(), 0);
    assert_eq!(s.state().slot("r").unwrap().hit_tokens, [0, 0, 0]);
    s.req("r", prefix_lookup(5))
        .req("r", planned(2, Direction::HOST_TO_DEVICE, 2))
        .req("r", completed(2, Direction::HOST_TO_DEVICE, 2));
    assert_eq!(s.state().slot("r").unwrap().hit_tokens, [0, 32, 0]);
}

/// One request's life for the property below: several scheduling
/// attempts, each a shuffled set of device, host and disk results, then a
/// load of `host` host blocks and `disk` disk blocks through the host
/// (completing in either order).
#[derive(Debug, Clone)]
struct Life {
    asks: Vec<Vec<(Tier, u32)>>,
    host: u32,
    disk: u32,
    disk_hop_first: bool,
}

fn arb_life() -> impl Strategy<Value = Life> {
    let one_ask = (0u32..8, 0u32..8, 0u32..8)
        .prop_map(|(a, b, c)| vec![(Tier::Device, a), (Tier::Host, b), (Tier::Disk, c)])
        .prop_shuffle();
    (
        prop::collection::vec(one_ask, 1..6),
        0u32..6,
        0u32..6,
        any::<bool>(),
    )
        .prop_map(|(asks, host, disk, disk_hop_first)| Life {
            asks,
            host,
            disk,
            disk_hop_first,
        })
}

proptest! {
    /// Per-request hits add up: whatever the order and number of a
    /// request's lookups, its G2 and G3 hits are the blocks loaded from
    /// each tier × the block size, its G1 hit its last device result; and
    /// over all requests they sum to the `X→G1` blocks moved.
    #[test]
    fn per_request_hits_are_what_was_loaded(lives in prop::collection::vec(arb_life(), 1..5)) {
        let mut s = Script::new();
        let mut id = 0u64;
        for (i, l) in lives.iter().enumerate() {
            let r = format!("r{i}");
            s.req(&r, created(400)).req(&r, prefix_lookup(20));
            for a in &l.asks {
                for &(tier, hit) in a {
                    s.req(&r, lookup(tier, hit));
                }
            }
            let n = ((l.host + l.disk) * BS) as usize;
            if n == 0 {
                continue;
            }
            s.req(&r, tr(Initialized, OnboardStaged(n)));
            let first = id;
            if l.host > 0 {
                s.req(&r, planned(first, Direction::HOST_TO_DEVICE, l.host));
            }
            s.req(&r, tr(OnboardStaged(n), Onboarding(n)));
            if l.host > 0 && !l.disk_hop_first {
                s.req(&r, completed(first, Direction::HOST_TO_DEVICE, l.host));
            }
            if l.disk > 0 {
                s.req(&r, planned(first + 1, Direction::DISK_TO_HOST, l.disk))
                    .req(&r, completed(first + 1, Direction::DISK_TO_HOST, l.disk))
                    .req(&r, planned(first + 2, Direction::HOST_TO_DEVICE, l.disk))
                    .req(&r, completed(first + 2, Direction::HOST_TO_DEVICE, l.disk));
            }
            if l.host > 0 && l.disk_hop_first {
                s.req(&r, completed(first, Direction::HOST_TO_DEVICE, l.host));
            }
            s.req(&r, tr(Onboarding(n), Prefilling));
            id += 3;
        }
        let st = s.state();
        let mut loaded = 0;
        for (i, l) in lives.iter().enumerate() {
            let slot = st.slot(&format!("r{i}")).unwrap();
            let g1 = l
                .asks
                .iter()
                .flatten()
                .rev()
                .find(|(t, _)| *t == Tier::Device)
                .map_or(0, |(_, h)| u64::from(h * BS));
            let want = [g1, u64::from(l.host * BS), u64::from(l.disk * BS)];
            prop_assert_eq!(slot.hit_tokens, want, "{:?}", l);
            loaded += slot.hit_tokens[1] + slot.hit_tokens[2];
        }
        let moved = st
            .direction(Direction::HOST_TO_DEVICE)
            .map_or(0, |d| d.completed_blocks);
        prop_assert_eq!(loaded, moved * u64::from(BS));
        prop_assert_eq!(st.inconsistencies().total(), 0);
    }
}

#[test]
fn a_slot_lives_its_whole_life() {
    let mut s = Script::new();
    s.req("a", created(40))
        .req(
            "a",
            EventKind::MatchResult {
                tier: Tier::Host,
                looked_up: 2,
                hit_blocks: 2,
                hit_tokens: 32,
            },
        )
        .req("a", tr(Initialized, OnboardStaged(32)))
        .req(
            "a",
            EventKind::BlocksAllocated {
                tier: Tier::Device,
                blocks: vec![3, 4, 5],
            },
        )
        .req("a", tr(OnboardStaged(32), Onboarding(32)))
        .req("a", tr(Onboarding(32), Prefilling))
        .req(
            "a",
            EventKind::TokensScheduled {
                prefill: 8,
                decode: 0,
                computed: 40,
            },
        )
        .req("a", tr(Prefilling, Decoding)) // ts 70
        .req(
            "a",
            EventKind::TokensScheduled {
                prefill: 0,
                decode: 1,
                computed: 41,
            },
        ) // ts 80
        .req("a", tr(Decoding, Decoding))
        .req(
            "a",
            EventKind::TokensScheduled {
                prefill: 0,
                decode: 1,
                computed: 42,
            },
        )
        .req("a", tr(Decoding, Finishing))
        .req(
            "a",
            EventKind::BlocksReleased {
                tier: Tier::Device,
                count: 3,
            },
        )
        .req("a", tr(Finishing, Finished)); // ts 130
    let st = s.state();
    let a = st.slot("a").unwrap();
    assert_eq!(a.state, Finished);
    assert!(a.is_finished());
    assert_eq!(
        (a.created_ns, a.state_since_ns, a.updated_ns),
        (0, 130, 130)
    );
    assert_eq!((a.prompt_tokens, a.max_output_tokens), (40, 4));
    assert_eq!((a.computed, a.prefilled, a.generated), (42, 8, 2));
    assert_eq!(a.blocks, [0, 0, 0]);
    // Looked up and staged, but no load was seen: no host hit (see
    // `host_hits_are_what_was_loaded_whatever_the_order_of_the_lookups`).
    assert_eq!(a.hit_tokens, [0, 0, 0]);
    assert_eq!(a.total_hit_tokens(), 0);
    assert_eq!(a.first_token_ns, Some(80));
    assert_eq!(a.ttft_ns(), Some(80));
    assert_eq!(a.transitions, 7);
    // The re-announced Decoding continues its interval.
    let states: Vec<SlotState> = a.history.iter().map(|h| h.1).collect();
    assert_eq!(
        states,
        [
            Initialized,
            OnboardStaged(32),
            Onboarding(32),
            Prefilling,
            Decoding,
            Finishing,
            Finished
        ]
    );
    let iv: Vec<_> = a.intervals(200).collect();
    assert_eq!(iv[4], (70, 110, Decoding));
    assert_eq!(iv[6], (130, 200, Finished));
    assert_eq!(iv[0], (0, 20, Initialized));
    let pool = st.pool(Tier::Host);
    assert_eq!(
        (
            pool.lookups,
            pool.looked_up_blocks,
            pool.hit_blocks,
            pool.hit_tokens
        ),
        (1, 2, 2, 32)
    );
    assert_eq!(st.pool(Tier::Device).allocated_blocks, 3);
    assert_eq!(st.pool(Tier::Device).released_blocks, 3);
    assert_eq!(st.inconsistencies().total(), 0);
    assert_eq!(
        st.slot_states(),
        BTreeMap::from([("a".to_string(), Finished)])
    );
    assert!(a.to_string().starts_with("a Finished since 130"), "{a}");
}

#[test]
fn blocks_without_a_request_count_only_globally() {
    let mut s = Script::new();
    s.req("a", created(4))
        .global(EventKind::BlocksAllocated {
            tier: Tier::Host,
            blocks: vec![1, 2],
        })
        .req(
            "a",
            EventKind::BlocksAllocated {
                tier: Tier::Host,
                blocks: vec![3],
            },
        )
        .global(EventKind::BlocksReleased {
            tier: Tier::Host,
            count: 2,
        });
    let st = s.state();
    assert_eq!(st.slot("a").unwrap().blocks, [0, 1, 0]);
    assert_eq!(st.pool(Tier::Host).allocated_blocks, 3);
    assert_eq!(st.pool(Tier::Host).released_blocks, 2);
    assert_eq!(st.inconsistencies().total(), 0);
}

#[test]
fn registrations_and_evictions_track_the_registered_set() {
    let reg = |h: u64, block: BlockId, dup: Option<BlockId>| EventKind::BlockRegistered {
        tier: Tier::Host,
        block,
        sequence_hash: SequenceHash(h),
        duplicate_of: dup,
    };
    let evict = |h: u64| EventKind::BlockEvicted {
        tier: Tier::Host,
        block: 0,
        sequence_hash: SequenceHash(h),
    };
    let mut s = Script::new();
    s.global(reg(1, 0, None))
        .global(reg(2, 1, None))
        .global(reg(1, 2, Some(0)))
        .global(evict(1))
        .global(EventKind::PoolGauge {
            tier: Tier::Host,
            capacity: 8,
            active: 1,
            inactive: 1,
            empty: 6,
        });
    let st = s.state();
    let p = st.pool(Tier::Host);
    assert_eq!(st.registered(Tier::Host), &HashSet::from([SequenceHash(2)]));
    assert!(st.registered(Tier::Device).is_empty());
    assert_eq!(
        (p.registrations, p.duplicate_registrations, p.evictions),
        (3, 1, 1)
    );
    assert_eq!(
        (p.capacity, p.active, p.inactive, p.empty, p.gauge_ns),
        (8, 1, 1, 6, Some(40))
    );
    assert_eq!(st.pools()[Tier::Host.index()], *p);
    assert_eq!(st.inconsistencies().total(), 0);

    // Evicting what is not registered, registering twice: counted.
    let mut bad = s.state();
    let mut more = Script::new();
    more.seq = 5;
    more.global(evict(9)).global(reg(2, 3, None));
    bad.apply_all(&more.events);
    assert_eq!(bad.inconsistencies().evict_unregistered, 1);
    assert_eq!(bad.inconsistencies().register_already_registered, 1);
}

#[test]
fn transfers_go_from_planned_to_the_recent_ring() {
    let d = Direction::DEVICE_TO_HOST;
    let mut st = EngineState::with_limits(Limits {
        history_per_slot: 8,
        recent_transfers: 4,
    });
    let mut s = Script::new();
    s.req("a", created(16));
    for id in 0..10u64 {
        s.req("a", planned(id, d, 2));
    }
    st.apply_all(&s.events);
    assert_eq!(st.slot("a").unwrap().outstanding, 10);
    assert_eq!(st.in_flight_ids(), (0..10).collect());
    assert_eq!(
        st.transfer(3).unwrap().status,
        TransferState::PendingEvaluation
    );
    assert_eq!(st.transfer(3).unwrap().request.as_deref(), Some("a"));

    let mut t = Script::new();
    t.seq = s.seq;
    t.ts = 1000;
    t.global(EventKind::TransferPromoted {
        transfer: 0,
        direction: d,
        blocks: 1,
    })
    .global(EventKind::BatchDispatched {
        batch: 5,
        direction: d,
        transfers: vec![0],
        blocks: 1,
    });
    st.apply_all(&t.events);
    let t0 = st.transfer(0).unwrap();
    assert_eq!(
        (t0.status.clone(), t0.blocks, t0.batch, t0.updated_ns),
        (TransferState::Promoted, 1, Some(5), 1000)
    );
    assert_eq!(st.batches_in_flight().count(), 1);

    let mut u = Script::new();
    u.seq = t.seq;
    u.ts = 2000;
    u.global(EventKind::BatchCompleted {
        batch: 5,
        direction: d,
        ok: true,
        blocks: 1,
        bytes: 4096,
        elapsed_ns: 77,
    })
    .global(completed(0, d, 1))
    .global(EventKind::TransferSkipped {
        transfer: 1,
        direction: d,
        reason: "NotResident".into(),
    })
    .global(EventKind::TransferCancelled {
        transfer: 2,
        direction: d,
    })
    .global(EventKind::TransferFailed {
        transfer: 3,
        direction: d,
        error: "disk full".into(),
    });
    for id in 4..10u64 {
        u.global(completed(id, d, 2));
    }
    st.apply_all(&u.events);
    assert_eq!(st.in_flight_count(), 0);
    assert_eq!(st.batches_in_flight().count(), 0);
    assert_eq!(st.slot("a").unwrap().outstanding, 0);
    // Ten ended, four kept: the last four, oldest first.
    assert_eq!(st.recent().len(), 4);
    assert_eq!(st.recent_dropped(), 6);
    assert_eq!(st.recent().map(|t| t.id).collect::<Vec<_>>(), [6, 7, 8, 9]);
    let last = st.recent().next_back().unwrap();
    assert_eq!(last.status, TransferState::Completed);
    assert_eq!(last.planned_ns, 100);
    assert_eq!(last.latency_ns(), 2000 + 10 * 10 - 100);

    let tot = st.direction(d).unwrap();
    assert_eq!(
        (
            tot.planned,
            tot.promoted,
            tot.completed,
            tot.skipped,
            tot.cancelled,
            tot.failed
        ),
        (10, 1, 7, 1, 1, 1)
    );
    assert_eq!(tot.completed_blocks, 1 + 6 * 2);
    assert_eq!(
        (tot.batches_dispatched, tot.batches, tot.batches_failed),
        (1, 1, 0)
    );
    assert_eq!((tot.blocks, tot.bytes, tot.elapsed_ns), (1, 4096, 77));
    assert!(st.direction(Direction::HOST_TO_DISK).is_none());
    assert_eq!(st.direction_totals().len(), 1);
    assert_eq!(st.inconsistencies().total(), 0);
}

#[test]
fn skipped_and_failed_keep_their_reason() {
    let d = Direction::HOST_TO_DISK;
    let mut s = Script::new();
    s.global(planned(1, d, 1))
        .global(planned(2, d, 1))
        .global(EventKind::TransferSkipped {
            transfer: 1,
            direction: d,
            reason: "Policy".into(),
        })
        .global(EventKind::TransferFailed {
            transfer: 2,
            direction: d,
            error: "EIO".into(),
        });
    let st = s.state();
    let r: Vec<_> = st.recent().map(|t| t.status.to_string()).collect();
    assert_eq!(r, ["Skipped(Policy)", "Failed(EIO)"]);
    assert!(st.recent().all(|t| t.status.is_terminal()));
    assert!(!TransferState::Promoted.is_terminal());
}

#[test]
fn outstanding_is_exact_when_the_slot_comes_after_its_transfer() {
    let d = Direction::HOST_TO_DEVICE;
    let mut s = Script::new();
    s.req("late", planned(1, d, 1)).req("late", created(4));
    let st = s.state();
    assert_eq!(st.slot("late").unwrap().outstanding, 1);
    s.global(completed(1, d, 1))
        .req("late", tr(Initialized, Finishing))
        .req("late", tr(Finishing, Finished));
    let st = s.state();
    assert_eq!(st.slot("late").unwrap().outstanding, 0);
    assert_eq!(st.inconsistencies().total(), 0);
}

#[test]
fn gaps_duplicates_and_other_engines_are_counted() {
    let mut s = Script::new();
    s.req("a", created(4)).global(EventKind::HookCall {
        entry: EntryPoint::RequestFinished,
        phase: HookPhase::Finished,
    });
    s.seq = 5; // lose 2, 3, 4
    s.global(EventKind::HookCall {
        entry: EntryPoint::RequestFinished,
        phase: HookPhase::Finished,
    });
    s.seq = 9; // lose 6, 7, 8
    s.req("a", tr(Initialized, Prefilling));
    let mut events = s.events.clone();
    // A second delivery of seq 9 and a stale seq 1: skipped.
    events.push(events[3].clone());
    events.push(events[1].clone());
    // Another engine's event: skipped.
    let mut foreign = events[0].clone();
    foreign.engine = 2;
    foreign.seq = 10;
    events.push(foreign);
    let st = fold(&events);
    let ss = st.stream();
    assert_eq!(
        (ss.seq_gaps, ss.gaps, ss.stale, ss.foreign_engine),
        (6, 2, 2, 1)
    );
    assert_eq!(
        (ss.first_seq, ss.last_seq, ss.events),
        (Some(0), Some(9), 4)
    );
    assert_eq!(st.seq_gaps(), 6);
    assert_eq!(
        st.hook_calls(EntryPoint::RequestFinished, HookPhase::Finished),
        2
    );
    assert_eq!(st.hook_calls(EntryPoint::CreateSlot, HookPhase::Will), 0);
    // The duplicate transition was not applied twice.
    assert_eq!(st.slot("a").unwrap().transitions, 1);
    assert_eq!(st.inconsistencies().total(), 0);
}

#[test]
fn a_stream_joined_late_starts_without_a_gap_and_ts_regressions_count() {
    let mut s = Script::new();
    s.seq = 100;
    s.ts = 50;
    s.iteration = 7;
    s.global(EventKind::HookCall {
        entry: EntryPoint::CreateSlot,
        phase: HookPhase::Will,
    });
    s.ts = 10;
    s.iteration = 3;
    s.global(EventKind::HookCall {
        entry: EntryPoint::CreateSlot,
        phase: HookPhase::Finished,
    });
    let st = s.state();
    assert_eq!(st.seq_gaps(), 0);
    assert_eq!(st.stream().first_seq, Some(100));
    assert_eq!(st.stream().ts_regressions, 1);
    assert_eq!(st.last_ts_ns(), 50);
    assert_eq!(st.iteration(), 7);
}

#[test]
fn contradictions_are_counted_not_panics() {
    let d = Direction::DEVICE_TO_HOST;
    let mut s = Script::new();
    s.req("a", created(4))
        // From the wrong state: counted, `to` still applied.
        .req("a", tr(Decoding, Prefilling))
        .req(
            "a",
            EventKind::BlocksAllocated {
                tier: Tier::Device,
                blocks: vec![1],
            },
        )
        // Below zero: counted, saturates.
        .req(
            "a",
            EventKind::BlocksReleased {
                tier: Tier::Device,
                count: 5,
            },
        )
        .req("nobody", tr(Initialized, Prefilling))
        .global(tr(Initialized, Prefilling))
        .global(EventKind::TokensScheduled {
            prefill: 1,
            decode: 0,
            computed: 1,
        })
        .global(created(3))
        .req("a", created(4))
        .req("a", planned(1, d, 1))
        .req("a", planned(1, d, 1))
        .global(EventKind::TransferPromoted {
            transfer: 1,
            direction: Direction::HOST_TO_DISK,
            blocks: 1,
        })
        .global(completed(42, d, 1))
        .global(EventKind::BatchCompleted {
            batch: 3,
            direction: d,
            ok: false,
            blocks: 0,
            bytes: 0,
            elapsed_ns: 0,
        })
        .global(EventKind::BatchDispatched {
            batch: 4,
            direction: d,
            transfers: vec![],
            blocks: 0,
        })
        .global(EventKind::BatchDispatched {
            batch: 4,
            direction: d,
            transfers: vec![99],
            blocks: 0,
        })
        .global(EventKind::Resumed {
            breakpoint: 8,
            cause: ResumeCause::Deadline,
        })
        .req("a", tr(Initialized, Finishing))
        .req("a", tr(Finishing, Finished));
    let st = s.state();
    let i = st.inconsistencies();
    assert_eq!(i.slot_from_mismatch, 1);
    assert_eq!(i.blocks_underflow, 1);
    assert_eq!(i.unknown_slot, 1);
    assert_eq!(i.missing_request, 3);
    assert_eq!(i.duplicate_slot, 1);
    assert_eq!(i.duplicate_transfer, 1);
    assert_eq!(i.transfer_direction_mismatch, 1);
    assert_eq!(i.unknown_transfer, 1);
    assert_eq!(i.unknown_batch, 1);
    assert_eq!(i.duplicate_batch, 1);
    assert_eq!(i.unmatched_resume, 1);
    assert_eq!(i.finished_with_outstanding, 1);
    assert_eq!(i.total(), 14);
    let a = st.slot("a").unwrap();
    assert_eq!(a.state, Finished);
    assert_eq!(a.outstanding, 1);
    assert_eq!(st.direction(d).unwrap().batches_failed, 1);
    assert_eq!(st.breakpoints().resumed_by(ResumeCause::Deadline), 1);
}

#[test]
fn history_is_bounded_and_counts_what_it_drops() {
    let mut st = EngineState::with_limits(Limits {
        history_per_slot: 4,
        recent_transfers: 4,
    });
    let mut s = Script::new();
    s.req("a", created(4)).req("a", tr(Initialized, Prefilling));
    for _ in 0..10 {
        s.req("a", tr(Prefilling, SkippedPrefill))
            .req("a", tr(SkippedPrefill, Prefilling));
    }
    st.apply_all(&s.events);
    let a = st.slot("a").unwrap();
    assert_eq!(a.history.len(), 4);
    assert_eq!(a.history_dropped, 2 + 20 - 4);
    assert_eq!(a.history.back(), Some(&(s.ts - 10, Prefilling)));
    assert_eq!(a.state_since_ns, s.ts - 10);

    // A zero cap keeps nothing and still counts.
    let mut none = EngineState::with_limits(Limits {
        history_per_slot: 0,
        recent_transfers: 0,
    });
    none.apply_all(&s.events);
    assert!(none.slot("a").unwrap().history.is_empty());
    assert_eq!(none.slot("a").unwrap().history_dropped, 22);
}

#[test]
fn breakpoints_pause_and_resume() {
    let hit = |bp: u64| EventKind::BreakpointHit {
        breakpoint: bp,
        entry: EntryPoint::UpdateStateAfterAlloc,
        deadline_ns: 60_000,
    };
    let resume = |bp: u64| EventKind::Resumed {
        breakpoint: bp,
        cause: ResumeCause::Step,
    };
    let mut s = Script::new();
    s.req("a", hit(1)).req("b", hit(1)).req("c", hit(2));
    let st = s.state();
    assert_eq!(st.paused_count(), 3);
    let p: Vec<_> = st
        .paused()
        .map(|p| (p.breakpoint, p.request.as_deref().map(str::to_string)))
        .collect();
    assert_eq!(p[0], (1, Some("a".to_string())));
    // Naming a request resumes that request's call; otherwise the oldest.
    s.req("b", resume(1));
    let st = s.state();
    assert_eq!(
        st.paused()
            .map(|p| p.request.as_deref().unwrap())
            .collect::<Vec<_>>(),
        ["a", "c"]
    );
    s.global(resume(2)).global(resume(1));
    let st = s.state();
    assert_eq!(st.paused_count(), 0);
    assert_eq!(st.breakpoints().hits, 3);
    assert_eq!(st.breakpoints().resumed, 3);
    assert_eq!(st.breakpoints().resumed_by(ResumeCause::Step), 3);
    assert_eq!(st.inconsistencies().total(), 0);
    // Paused-then-resumed leaves the same state as never paused.
    assert_eq!(st.paused, BTreeMap::new());
}

#[test]
fn finished_slots_stay_until_pruned() {
    let mut s = Script::new();
    for r in ["a", "b", "c"] {
        s.req(r, created(1))
            .req(r, tr(Initialized, Finishing))
            .req(r, tr(Finishing, Finished));
    }
    s.req("d", created(1));
    let mut st = s.state();
    assert_eq!(st.slot_count(), 4);
    assert_eq!(st.state_counts()[9], ("Finished", 3));
    // a finished at 20, b at 50, c at 80.
    assert_eq!(st.retain_finished_since(50), 1);
    assert!(st.slot("a").is_none());
    assert_eq!(st.prune_finished(1), 1);
    assert!(st.slot("b").is_none());
    assert!(st.slot("c").is_some() && st.slot("d").is_some());
    assert_eq!(st.prune_finished(5), 0);
    assert_eq!(st.pruned_slots(), 2);
    let sorted: Vec<_> = st
        .slots_sorted()
        .iter()
        .map(|s| s.request.to_string())
        .collect();
    assert_eq!(sorted, ["c", "d"]);
    // A request id reused after Finished starts a fresh slot.
    s.req("c", created(9));
    let st = s.state();
    assert_eq!(st.slot("c").unwrap().state, Initialized);
    assert_eq!(st.slot("c").unwrap().prompt_tokens, 9);
    assert_eq!(st.inconsistencies().total(), 0);
}

#[test]
fn summary_and_snapshot_round_trip() {
    let mut s = Script::new();
    for k in one_of_each() {
        s.req("r", k);
    }
    s.req("r", planned(77, Direction::DISK_TO_HOST, 3));
    let st = s.state();
    let text = st.summary();
    assert!(
        text.starts_with(&format!(
            "engine 1: {} events, seq 0..={}",
            KindTag::COUNT + 1,
            KindTag::COUNT
        )),
        "{text}"
    );
    assert!(text.contains("OnboardStaged 1"), "{text}");
    // The sample's `TransferPlanned` and transfer 77.
    assert!(text.contains("transfers in flight 2"), "{text}");
    assert!(text.contains("inconsistencies 10"), "{text}");
    assert_eq!(EngineState::new().summary().lines().count(), 7);

    // A snapshot is the serialised state; loading it and going on equals
    // folding everything.
    let json = serde_json::to_string(&st).unwrap();
    let mut back: EngineState = serde_json::from_str(&json).unwrap();
    assert_eq!(back, st);
    let mut more = Script::new();
    more.seq = s.seq;
    more.global(completed(77, Direction::DISK_TO_HOST, 3));
    back.apply_all(&more.events);
    let all: Vec<Event> = s.events.iter().chain(&more.events).cloned().collect();
    assert_eq!(back, fold(&all));
}

// ---- property tests --------------------------------------------------

fn arb_events() -> impl Strategy<Value = Vec<Event>> {
    crate::testing::events(200, crate::testing::Shape::SMALL)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn fold_is_a_total_left_fold(events in arb_events(), split in 0usize..200, cut in 0u64..2000) {
        let split = split.min(events.len());
        let whole = fold(&events);
        let mut parts = fold(&events[..split]);
        parts.apply_all(&events[split..]);
        prop_assert_eq!(&parts, &whole);

        // The small limits path must hold the same invariants.
        let mut small = EngineState::with_limits(Limits { history_per_slot: 2, recent_transfers: 2 });
        small.apply_all(&events);
        for st in [&whole, &small] {
            let ss = st.stream();
            prop_assert_eq!(ss.events + ss.stale + ss.foreign_engine, events.len() as u64);
            prop_assert_eq!(st.counts_by_kind().map(|(_, n)| n).sum::<u64>(), ss.events);
            // A slot's outstanding count is exactly its transfers in flight.
            for slot in st.slots() {
                let n = st.in_flight().filter(|t| t.request.as_deref() == Some(&*slot.request)).count();
                prop_assert_eq!(slot.outstanding as usize, n);
                prop_assert!(slot.history.len() <= st.limits().history_per_slot);
                if let Some(&(_, last)) = slot.history.back() {
                    prop_assert_eq!(last, slot.state);
                }
            }
            prop_assert!(st.recent().len() <= st.limits().recent_transfers);
            prop_assert!(st.recent().all(|t| t.status.is_terminal()));
            prop_assert!(st.in_flight().all(|t| !t.status.is_terminal()));
            let _ = st.summary();
        }

        // Snapshots round-trip.
        let json = serde_json::to_string(&whole).unwrap();
        let back: EngineState = serde_json::from_str(&json).unwrap();
        prop_assert_eq!(&back, &whole);

        // Pruning only removes finished slots and counts them.
        let mut pruned = whole.clone();
        let n = pruned.retain_finished_since(cut);
        prop_assert_eq!(pruned.slot_count() + n, whole.slot_count());
        prop_assert_eq!(pruned.pruned_slots(), n as u64);
    }
}
