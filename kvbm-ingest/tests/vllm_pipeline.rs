//! The ZMQ source's decisions without sockets (the fast layer; the real
//! publisher's tests are in `kvbm-cli/tests/vllm_publisher.rs`): the
//! replay answer's framings, gaps filled from an in-memory replay buffer,
//! a publisher that reconnects (the same one, proved by replay, or a new
//! one), joining late, hybrid models' groups, and every engine medium.

use kvbm_events::EventKind;
use kvbm_events::tier::Tier;
use kvbm_ingest::vllm::{
    KvBatch, KvEvent, MAX_SEQ_JUMP, Medium, NoReplay, Pipeline, Replay, ReplayFailure, RestartAt,
    RestartCause, SeqRange, Skipped, Translator, TranslatorConfig, ZmqConfig, ZmqEndpoint, ZmqItem,
    split_replay_frames,
};
use rmpv::Value;

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// A vLLM payload: one BlockStored of `hashes` (map form, as vLLM sends).
fn stored(hashes: &[u64]) -> Vec<u8> {
    let ev = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (
            Value::from("block_hashes"),
            Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
        ),
        (Value::from("parent_block_hash"), Value::Nil),
        (Value::from("token_ids"), Value::Array(vec![])),
        (Value::from("block_size"), Value::from(32)),
        (Value::from("lora_id"), Value::Nil),
        (Value::from("medium"), Value::from("GPU")),
        (Value::from("lora_name"), Value::Nil),
    ]);
    let v = Value::Array(vec![
        Value::F64(1_700_000_000.0),
        Value::Array(vec![ev]),
        Value::from(0),
    ]);
    let mut b = Vec::new();
    rmpv::encode::write_value(&mut b, &v).unwrap();
    b
}

/// A replay buffer in memory: what a publisher holds, and the requests.
#[derive(Default)]
struct MemReplay {
    buffer: Vec<(u64, Vec<u8>)>,
    requests: Vec<(u64, u64)>,
    fail: bool,
    /// Fails after this many batches of the answer (an answer cut short:
    /// a deadline or frame cap reached), handing them on.
    cut_after: Option<usize>,
}

impl Replay for MemReplay {
    async fn fetch(&mut self, from: u64, to: u64) -> Result<Vec<(u64, Vec<u8>)>, ReplayFailure> {
        self.requests.push((from, to));
        if self.fail {
            return Err("no answer".into());
        }
        let mut answer: Vec<_> = self
            .buffer
            .iter()
            .filter(|(s, _)| (from..=to).contains(s))
            .cloned()
            .collect();
        if let Some(n) = self.cut_after {
            answer.truncate(n);
            return Err(ReplayFailure {
                error: "cut short".into(),
                partial: answer,
            });
        }
        Ok(answer)
    }
}

fn pipeline(replay: bool, since: Option<u64>) -> Pipeline {
    let mut cfg = ZmqConfig::new(ZmqEndpoint::parse("zmq://127.0.0.1:1").unwrap());
    if replay {
        cfg.replay = Some(ZmqEndpoint::parse("zmq://127.0.0.1:2").unwrap());
    }
    cfg.since = since;
    Pipeline::new(&cfg)
}

fn feed(p: &mut Pipeline, r: &mut impl Replay, seq: u64, payload: &[u8]) -> Vec<ZmqItem> {
    let mut out = Vec::new();
    let s = seq.to_be_bytes();
    block_on(p.message(&[b"".as_slice(), &s, payload], r, &mut out));
    out
}

fn registered(items: &[ZmqItem]) -> Vec<u64> {
    items
        .iter()
        .flat_map(|i| match i {
            ZmqItem::Events(e) => e.clone(),
            _ => vec![],
        })
        .filter_map(|e| match e.kind {
            EventKind::BlockRegistered {
                sequence_hash,
                duplicate_of: None,
                ..
            } => Some(sequence_hash.0),
            _ => None,
        })
        .collect()
}

fn evicted(items: &[ZmqItem]) -> usize {
    items
        .iter()
        .flat_map(|i| match i {
            ZmqItem::Events(e) => e.clone(),
            _ => vec![],
        })
        .filter(|e| matches!(e.kind, EventKind::BlockEvicted { .. }))
        .count()
}

/// vLLM's and SGLang's replay frames as a DEALER receives them, the end
/// marker, and the older form without a topic.
#[test]
fn replay_frames_are_read_in_every_framing() {
    let seq = 7u64.to_be_bytes();
    let end = u64::MAX.to_be_bytes();
    let e: &[u8] = b"";
    assert_eq!(
        split_replay_frames(&[e, b"kv", &seq, b"P"]).unwrap(),
        (7, b"P".as_slice())
    );
    assert_eq!(
        split_replay_frames(&[e, e, &end, e]).unwrap(),
        (u64::MAX, e)
    );
    assert_eq!(
        split_replay_frames(&[e, &seq, b"P"]).unwrap(),
        (7, b"P".as_slice())
    );
    assert_eq!(
        split_replay_frames(&[&seq, b"P"]).unwrap(),
        (7, b"P".as_slice())
    );
    // Four frames whose first is not the delimiter, a short seq, one frame.
    assert!(split_replay_frames(&[b"x", b"kv", &seq, b"P"]).is_err());
    assert!(split_replay_frames(&[e, b"kv", b"123", b"P"]).is_err());
    assert!(split_replay_frames(&[b"P"]).is_err());
}

#[test]
fn a_gap_is_filled_in_order_and_what_the_buffer_lacks_is_placed_as_lost() {
    let mut p = pipeline(true, None);
    let mut r = MemReplay::default();
    for s in 0..10 {
        r.buffer.push((s, stored(&[100 + s])));
    }
    // The buffer no longer holds 2 and 3.
    r.buffer.retain(|(s, _)| !(2..=3).contains(s));
    feed(&mut p, &mut r, 0, &stored(&[100]));
    let items = feed(&mut p, &mut r, 6, &stored(&[106]));
    assert_eq!(r.requests, vec![(1, 5)]);
    assert_eq!(registered(&items), vec![101, 104, 105, 106]);
    let gap_at = items
        .iter()
        .position(|i| {
            *i == ZmqItem::Gap {
                from_seq: 2,
                to_seq: 3,
            }
        })
        .unwrap();
    // The loss comes after batch 1 and before batch 4.
    assert_eq!(registered(&items[..gap_at]), vec![101]);
    let c = p.counters();
    assert_eq!((c.gaps, c.replayed, c.missed), (1, 3, 2));
    assert_eq!(c.missed_ranges, vec![SeqRange { from: 2, to: 3 }]);
}

/// A batch whose seq is in order but whose payload cannot be read, live or
/// in a replay answer: its events are lost like a batch that never came
/// (a hole in the kvbm seq and a gap the recording places), not only a
/// malformed message beside a stream that looks whole.
#[test]
fn a_batch_that_cannot_be_read_is_a_loss_not_only_a_malformed_message() {
    let mut p = pipeline(true, None);
    let mut r = MemReplay {
        buffer: vec![(1, b"not msgpack".to_vec()), (2, stored(&[102]))],
        ..MemReplay::default()
    };
    let a = feed(&mut p, &mut r, 0, &stored(&[100]));
    let b = feed(&mut p, &mut r, 1, b"\xc1 garbage");
    assert_eq!(
        b,
        vec![ZmqItem::Gap {
            from_seq: 1,
            to_seq: 1
        }]
    );
    let c = feed(&mut p, &mut r, 2, &stored(&[102]));
    // The kvbm seq has the hole where batch 1's events would be.
    let (a, c) = (seqs(&a), seqs(&c));
    assert!(c[0] > a[a.len() - 1] + 1, "{a:?} then {c:?}");
    let counters = p.counters();
    assert_eq!(
        (counters.malformed, counters.gaps, counters.missed),
        (1, 1, 1)
    );
    assert_eq!(counters.missed_ranges, vec![SeqRange { from: 1, to: 1 }]);
    // In a replay answer: batch 1 fetched but unreadable is lost too.
    let mut p = pipeline(true, None);
    feed(&mut p, &mut r, 0, &stored(&[100]));
    let items = feed(&mut p, &mut r, 3, &stored(&[103]));
    assert_eq!(registered(&items), vec![102, 103]);
    assert!(items.contains(&ZmqItem::Gap {
        from_seq: 1,
        to_seq: 1
    }));
    assert_eq!(p.counters().missed, 1);
}

/// After a reconnection, the replay endpoint's copy of the last batch seen
/// proves the same publisher, and the gap is filled from that one answer.
#[test]
fn a_reconnection_to_the_same_publisher_is_proved_and_its_gap_filled() {
    let mut p = pipeline(true, None);
    let mut r = MemReplay::default();
    for s in 0..20 {
        r.buffer.push((s, stored(&[100 + s])));
    }
    for s in 0..5 {
        feed(&mut p, &mut r, s, &stored(&[100 + s]));
    }
    p.disconnected();
    p.connected();
    let items = feed(&mut p, &mut r, 9, &stored(&[109]));
    assert_eq!(r.requests, vec![(4, 8)], "one request, from the last seen");
    assert!(!items.iter().any(|i| matches!(i, ZmqItem::Restart(_))));
    assert_eq!(registered(&items), vec![105, 106, 107, 108, 109]);
    let c = p.counters();
    assert_eq!((c.same_publisher, c.restarts, c.missed), (1, 0, 0));
}

/// The new engine passed the old one's last seq before the reconnection:
/// its replay buffer holds other bytes at that seq, so it is a restart; the
/// old blocks are evicted and the new engine's first batches fetched.
#[test]
fn a_new_publisher_past_the_old_seq_is_a_restart_not_a_merge() {
    let mut p = pipeline(true, None);
    let mut r = MemReplay::default();
    for s in 0..5 {
        feed(&mut p, &mut r, s, &stored(&[100 + s]));
    }
    p.disconnected();
    // The new engine stores the same hashes (vLLM's hashes are stable
    // across restarts), in another order, and got further.
    r.buffer = (0..12).map(|s| (s, stored(&[111 - s]))).collect();
    p.connected();
    let items = feed(&mut p, &mut r, 12, &stored(&[200]));
    assert_eq!(
        items[0],
        ZmqItem::Restart(RestartAt {
            last_seq: 4,
            new_seq: 12,
            cause: RestartCause::ReplayDiffers
        })
    );
    assert_eq!(evicted(&items), 5, "every block of the old engine");
    assert_eq!(r.requests, vec![(4, 11), (0, 11)]);
    let mut new: Vec<u64> = (0..12).map(|s| 111 - s).collect();
    new.push(200);
    assert_eq!(registered(&items), new, "registered anew, not duplicates");
    let c = p.counters();
    assert_eq!((c.restarts, c.missed, c.replayed), (1, 0, 12));
    assert_eq!(c.translate.duplicates, 0);
}

/// Without a replay endpoint nothing proves the publisher the same: a
/// reconnection is a restart, and the new one's first batches are lost.
#[test]
fn without_replay_a_reconnection_is_an_unverified_restart_and_its_start_lost() {
    let mut p = pipeline(false, None);
    for s in 0..3 {
        feed(&mut p, &mut NoReplay, s, &stored(&[100 + s]));
    }
    p.disconnected();
    p.connected();
    let items = feed(&mut p, &mut NoReplay, 7, &stored(&[100]));
    assert!(matches!(
        items[0],
        ZmqItem::Restart(RestartAt {
            cause: RestartCause::Unverified,
            ..
        })
    ));
    assert!(items.contains(&ZmqItem::Gap {
        from_seq: 0,
        to_seq: 6
    }));
    assert_eq!(
        registered(&items),
        vec![100],
        "not a duplicate of the old 100"
    );
    let c = p.counters();
    assert_eq!((c.restarts, c.missed), (1, 7));
    // A seq that went back after a reconnection is certain.
    p.disconnected();
    p.connected();
    let items = feed(&mut p, &mut NoReplay, 0, &stored(&[1]));
    assert!(matches!(
        items[0],
        ZmqItem::Restart(RestartAt {
            cause: RestartCause::SeqWentBack,
            ..
        })
    ));
}

#[test]
fn a_failed_replay_is_reported_and_leaves_a_loss() {
    let mut p = pipeline(true, None);
    let mut r = MemReplay {
        fail: true,
        ..MemReplay::default()
    };
    feed(&mut p, &mut r, 0, &stored(&[1]));
    let items = feed(&mut p, &mut r, 3, &stored(&[4]));
    assert_eq!(
        items[0],
        ZmqItem::ReplayFailed {
            error: "no answer".into()
        }
    );
    assert_eq!(
        items[1],
        ZmqItem::Gap {
            from_seq: 1,
            to_seq: 2
        }
    );
    let c = p.counters();
    assert_eq!((c.replay_failures, c.missed), (1, 2));
    assert_eq!(c.last_replay_error.as_deref(), Some("no answer"));
}

/// A replay answer cut short (its deadline or frame cap reached) counts as
/// failed; the batches it brought are real and kept, the rest of the gap
/// is lost.
#[test]
fn an_answer_cut_short_is_a_failure_that_keeps_what_it_brought() {
    let mut p = pipeline(true, None);
    let mut r = MemReplay {
        buffer: (0..10).map(|s| (s, stored(&[100 + s]))).collect(),
        cut_after: Some(3),
        ..MemReplay::default()
    };
    feed(&mut p, &mut r, 0, &stored(&[100]));
    let items = feed(&mut p, &mut r, 9, &stored(&[109]));
    assert_eq!(
        items[0],
        ZmqItem::ReplayFailed {
            error: "cut short".into()
        }
    );
    assert_eq!(registered(&items), vec![101, 102, 103, 109]);
    assert!(items.contains(&ZmqItem::Gap {
        from_seq: 4,
        to_seq: 8
    }));
    let c = p.counters();
    assert_eq!((c.replay_failures, c.replayed, c.missed), (1, 3, 5));
}

/// Every kvbm event's seq, in order.
fn seqs(items: &[ZmqItem]) -> Vec<u64> {
    items
        .iter()
        .flat_map(|i| match i {
            ZmqItem::Events(e) => e.iter().map(|e| e.seq).collect(),
            _ => vec![],
        })
        .collect()
}

/// A hostile seq near `u64::MAX` (0, 2^64-2, 2^64-1, 0, 1): the jump was
/// taken for a gap of 2^64-3 batches, whose holes took the kvbm seq to
/// `u64::MAX`, and the next stamp overflowed (a panic in debug that killed
/// the source, a wrap in release). No engine publishes that many batches
/// in between: it is a restart, nothing is placed as lost, no replay of
/// 2^64 batches is asked for, and every batch still arrives.
#[test]
fn a_seq_jump_near_u64_max_is_a_restart_and_every_batch_still_arrives() {
    for with_replay in [false, true] {
        let mut p = pipeline(with_replay, None);
        let mut r = MemReplay::default();
        let mut items = Vec::new();
        for (seq, h) in [(0, 1), (u64::MAX - 1, 2), (u64::MAX, 3), (0, 4), (1, 5)] {
            items.extend(feed(&mut p, &mut r, seq, &stored(&[h])));
        }
        assert!(
            items.contains(&ZmqItem::Restart(RestartAt {
                last_seq: 0,
                new_seq: u64::MAX - 1,
                cause: RestartCause::SeqJumped,
            })),
            "{items:?}"
        );
        assert!(!items.iter().any(|i| matches!(i, ZmqItem::Gap { .. })));
        assert!(r.requests.is_empty(), "{:?}", r.requests);
        assert_eq!(registered(&items), vec![1, 2, 3, 4, 5]);
        // The kvbm seq is gapless: no hole stands for batches never sent.
        let s = seqs(&items);
        assert_eq!(s, (0..s.len() as u64).collect::<Vec<_>>());
        let c = p.counters();
        assert_eq!((c.restarts, c.missed, c.seq_too_far), (1, 0, 1));
    }
}

/// The bound is exact: [`MAX_SEQ_JUMP`] batches missing is a gap, one
/// hole per batch; one more is a restart.
#[test]
fn a_jump_of_max_seq_jump_batches_is_a_gap_and_one_more_a_restart() {
    let mut p = pipeline(false, None);
    let first = feed(&mut p, &mut NoReplay, 0, &stored(&[1]));
    let after_first = seqs(&first).last().unwrap() + 1;
    let items = feed(&mut p, &mut NoReplay, MAX_SEQ_JUMP + 1, &stored(&[2]));
    assert_eq!(
        items[0],
        ZmqItem::Gap {
            from_seq: 1,
            to_seq: MAX_SEQ_JUMP
        }
    );
    assert_eq!(
        seqs(&items)[0],
        after_first + MAX_SEQ_JUMP,
        "one hole a batch"
    );
    let items = feed(&mut p, &mut NoReplay, 2 * MAX_SEQ_JUMP + 3, &stored(&[3]));
    assert!(matches!(
        items[0],
        ZmqItem::Restart(RestartAt {
            cause: RestartCause::SeqJumped,
            ..
        })
    ));
    assert!(!items.iter().any(|i| matches!(i, ZmqItem::Gap { .. })));
    assert_eq!(p.counters().missed, MAX_SEQ_JUMP);
}

/// Joining at batch 879: said, and what the buffer holds is fetched.
#[test]
fn joining_late_says_what_was_missed_and_fetches_what_the_buffer_holds() {
    // Without replay: counted as missed before the start.
    let mut p = pipeline(false, None);
    let items = feed(&mut p, &mut NoReplay, 879, &stored(&[1]));
    assert_eq!(
        items[0],
        ZmqItem::Joined {
            first_seq: 879,
            fetched: 0,
            missed: 879
        }
    );
    let c = p.counters();
    assert_eq!((c.missed_before_start, c.missed), (879, 0));
    // With replay from 0: the buffer holds 379..=878.
    let mut p = pipeline(true, Some(0));
    let mut r = MemReplay::default();
    for s in 379..879 {
        r.buffer.push((s, stored(&[s])));
    }
    let items = feed(&mut p, &mut r, 879, &stored(&[879]));
    assert_eq!(r.requests, vec![(0, 878)]);
    assert!(items.contains(&ZmqItem::Joined {
        first_seq: 879,
        fetched: 500,
        missed: 379
    }));
    assert_eq!(registered(&items), (379..=879).collect::<Vec<_>>());
    let c = p.counters();
    assert_eq!(
        (c.fetched_before_start, c.missed_before_start, c.missed),
        (500, 379, 0)
    );
}

fn batch(events: Vec<KvEvent>) -> KvBatch {
    KvBatch {
        ts: 1.0,
        events,
        skipped: Skipped::default(),
        dp_rank: None,
    }
}

fn store(h: u64, medium: Medium, group: Option<i64>) -> KvEvent {
    KvEvent::Stored {
        block_hashes: vec![h],
        parent: None,
        num_tokens: 32,
        block_size: Some(32),
        medium,
        group,
    }
}

fn remove(h: u64, medium: Medium, group: Option<i64>) -> KvEvent {
    KvEvent::Removed {
        block_hashes: vec![h],
        medium,
        group,
    }
}

/// A hybrid model: one group removing a hash another still holds leaves it
/// live; the last holder's removal evicts it. DISK and EXTERNAL share G3
/// the same way.
#[test]
fn a_hash_is_live_while_any_group_or_medium_holds_it() {
    let mut tr = Translator::new(TranslatorConfig::default());
    let mut out = Vec::new();
    tr.batch(
        &batch(vec![
            store(7, Medium::Gpu, Some(0)),
            store(7, Medium::Gpu, Some(1)),
            store(8, Medium::Disk, None),
            store(8, Medium::External, None),
        ]),
        &mut out,
    );
    tr.batch(
        &batch(vec![
            remove(7, Medium::Gpu, Some(0)),
            remove(8, Medium::External, None),
        ]),
        &mut out,
    );
    assert_eq!((tr.live(Tier::Device), tr.live(Tier::Disk)), (1, 1));
    let st = kvbm_events::reducer::fold(&out);
    assert_eq!(st.pool(Tier::Device).active, 1);
    assert_eq!(st.pool(Tier::Disk).active, 1);
    tr.batch(
        &batch(vec![
            remove(7, Medium::Gpu, Some(1)),
            // Group 1 again: it no longer holds 7.
            remove(7, Medium::Gpu, Some(1)),
            KvEvent::AllCleared {
                medium: Medium::Disk,
            },
        ]),
        &mut out,
    );
    assert_eq!((tr.live(Tier::Device), tr.live(Tier::Disk)), (0, 0));
    let c = tr.counters();
    assert_eq!(
        (
            c.registered,
            c.duplicates,
            c.still_held,
            c.evicted,
            c.cleared
        ),
        (2, 2, 2, 1, 1)
    );
    assert_eq!(c.removed_unknown, 1);
    let st = kvbm_events::reducer::fold(&out);
    assert_eq!(
        st.inconsistencies().total(),
        0,
        "{:?}",
        st.inconsistencies()
    );
    assert!(st.pool(Tier::Device).registered.is_empty());
}

/// Every medium vLLM and SGLang define maps to a tier.
#[test]
fn every_engine_medium_has_a_tier() {
    let mapping = [
        ("GPU", Tier::Device),
        ("CPU", Tier::Host),
        ("CPU_PINNED", Tier::Host),
        ("STORAGE", Tier::Disk),
        ("DISK", Tier::Disk),
        ("EXTERNAL", Tier::Disk),
        ("cpu", Tier::Host), // vLLM's Mooncake store connector
    ];
    for (name, tier) in mapping {
        assert_eq!(
            kvbm_ingest::vllm::tier_of_medium(name),
            Some(tier),
            "{name}"
        );
    }
    for m in Medium::ALL {
        assert_eq!(Medium::parse(m.name()), Some(m));
    }
    assert_eq!(Medium::parse("TAPE"), None);
}
