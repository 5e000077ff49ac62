//! vLLM / SGLang KV-event payloads, built with rmpv from the format
//! description: map and array forms, translation to kvbm events, and
//! malformed input (never a panic, always counted).

use kvbm_events::SequenceHash;
use kvbm_events::tier::Tier;
use kvbm_events::{Event, EventKind};
use kvbm_ingest::vllm::{
    KvBatch, KvEvent, Medium, NoReplay, Pipeline, Skipped, Translator, TranslatorConfig, ZmqConfig,
    ZmqEndpoint, ZmqItem, decode_payload,
};
use proptest::prelude::*;
use rmpv::Value;

fn s(x: &str) -> Value {
    Value::from(x)
}

fn enc(v: &Value) -> Vec<u8> {
    let mut b = Vec::new();
    rmpv::encode::write_value(&mut b, v).unwrap();
    b
}

fn tokens(n: u32) -> Value {
    Value::Array((0..n).map(Value::from).collect())
}

/// A `BlockStored` map in vLLM's field order plus the optional fields,
/// then reversed: key order is not part of the contract.
fn stored_map(hashes: Vec<Value>, medium: Option<&str>) -> Value {
    let mut kv = vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::Array(hashes)),
        (s("parent_block_hash"), Value::Nil),
        (s("token_ids"), tokens(32)),
        (s("block_size"), Value::from(16)),
        (s("lora_id"), Value::Nil),
        (s("medium"), medium.map_or(Value::Nil, s)),
        (s("lora_name"), Value::Nil),
        (s("extra_keys"), Value::Array(vec![Value::Nil, Value::Nil])),
        (s("group_idx"), Value::from(0)),
        (s("kv_cache_spec_kind"), s("full_attention")),
        (s("some_future_key"), Value::Map(vec![])),
    ];
    kv.reverse();
    Value::Map(kv)
}

fn removed_map(hashes: Vec<Value>, medium: Option<&str>) -> Value {
    let mut kv = vec![(s("medium"), medium.map_or(Value::Nil, s))];
    kv.push((s("block_hashes"), Value::Array(hashes)));
    kv.push((s("type"), s("BlockRemoved")));
    Value::Map(kv)
}

fn envelope_array(ts: f64, events: Vec<Value>, rank: Option<i64>) -> Value {
    Value::Array(vec![
        Value::F64(ts),
        Value::Array(events),
        rank.map_or(Value::Nil, Value::from),
    ])
}

fn envelope_map(ts: f64, events: Vec<Value>) -> Value {
    Value::Map(vec![
        (s("data_parallel_rank"), Value::from(1)),
        (s("events"), Value::Array(events)),
        (s("ts"), Value::F64(ts)),
        (s("unknown"), s("ignored")),
    ])
}

const BIG: u64 = u64::MAX - 5; // above i64::MAX

#[test]
fn array_forms_decode_with_big_and_byte_hashes() {
    let bytes_hash = vec![1u8, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];
    let payload = envelope_array(
        1_700_000_000.5,
        vec![
            // Older vLLM: positional, type first.
            Value::Array(vec![
                s("BlockStored"),
                Value::Array(vec![Value::from(BIG), Value::Binary(bytes_hash.clone())]),
                Value::from(7u64),
                tokens(32),
                Value::from(16),
                Value::Nil,
                s("CPU"),
                Value::Nil,
                Value::Array(vec![]), // extra_keys: ignored
            ]),
            // Trailing defaults omitted: medium → GPU.
            Value::Array(vec![
                s("BlockStored"),
                Value::Array(vec![Value::from(1u64)]),
                Value::Nil,
                tokens(16),
                Value::from(16),
            ]),
            Value::Array(vec![
                s("BlockRemoved"),
                Value::Array(vec![Value::from(BIG)]),
                s("CPU"),
            ]),
            Value::Array(vec![s("AllBlocksCleared")]),
        ],
        None,
    );
    let b = decode_payload(&enc(&payload)).unwrap();
    assert_eq!(b.ts, 1_700_000_000.5);
    assert_eq!(b.dp_rank, None);
    assert_eq!(b.skipped.total(), 0);
    let xx = xxhash_rust::xxh3::xxh3_64(&bytes_hash);
    assert_eq!(
        b.events,
        vec![
            KvEvent::Stored {
                block_hashes: vec![BIG, xx],
                parent: Some(7),
                num_tokens: 32,
                block_size: Some(16),
                medium: Medium::Cpu,
                group: None,
            },
            KvEvent::Stored {
                block_hashes: vec![1],
                parent: None,
                num_tokens: 16,
                block_size: Some(16),
                medium: Medium::Gpu,
                group: None,
            },
            KvEvent::Removed {
                block_hashes: vec![BIG],
                medium: Medium::Cpu,
                group: None,
            },
            KvEvent::AllCleared {
                medium: Medium::Gpu
            },
        ]
    );
}

#[test]
fn map_forms_decode_with_unknown_keys_in_any_order() {
    let payload = envelope_map(
        2.0,
        vec![
            stored_map(vec![Value::from(10), Value::from(11)], Some("GPU")),
            stored_map(vec![Value::from(12)], Some("STORAGE")),
            removed_map(vec![Value::from(10)], None),
            Value::Map(vec![
                (s("type"), s("AllBlocksCleared")),
                (s("medium"), s("DISK")),
            ]),
            // SGLang-ish: a medium it names in lower case, extra fields.
            Value::Map(vec![
                (s("block_hashes"), Value::Array(vec![Value::from(-3i64)])),
                (s("type"), s("BlockStored")),
                (s("medium"), s("cpu")),
                (s("priority"), Value::from(5)),
            ]),
            // Unknown type and a bad medium: skipped and counted.
            Value::Map(vec![(s("type"), s("SomethingNew"))]),
            stored_map(vec![Value::from(1)], Some("TAPE")),
        ],
    );
    let b = decode_payload(&enc(&payload)).unwrap();
    assert_eq!(b.dp_rank, Some(1));
    assert_eq!(
        b.skipped,
        Skipped {
            unknown_medium: 1,
            unknown_type: 1,
            malformed: 0,
            last: Some("medium `TAPE` is not one kvbm maps".into()),
        }
    );
    assert_eq!(b.events.len(), 5);
    assert!(
        matches!(&b.events[0], KvEvent::Stored { block_hashes, medium: Medium::Gpu, group: Some(0), .. } if block_hashes == &vec![10, 11])
    );
    assert!(matches!(
        &b.events[1],
        KvEvent::Stored {
            medium: Medium::Storage,
            ..
        }
    ));
    assert_eq!(b.events[1].tier(), Tier::Disk);
    assert_eq!(
        b.events[2],
        KvEvent::Removed {
            block_hashes: vec![10],
            medium: Medium::Gpu,
            group: None,
        }
    );
    assert_eq!(
        b.events[3],
        KvEvent::AllCleared {
            medium: Medium::Disk
        }
    );
    assert!(
        matches!(&b.events[4], KvEvent::Stored { block_hashes, medium: Medium::Cpu, .. } if block_hashes == &vec![(-3i64) as u64])
    );
}

fn kinds(evs: &[Event]) -> Vec<String> {
    evs.iter()
        .map(|e| match &e.kind {
            EventKind::BlockRegistered {
                tier,
                sequence_hash,
                duplicate_of,
                ..
            } => format!(
                "reg {tier:?} {} {}",
                sequence_hash.0,
                if duplicate_of.is_some() { "dup" } else { "" }
            ),
            EventKind::BlockEvicted {
                tier,
                sequence_hash,
                ..
            } => format!("evict {tier:?} {}", sequence_hash.0),
            EventKind::PoolGauge { tier, active, .. } => format!("gauge {tier:?} {active}"),
            k => format!("{k:?}"),
        })
        .collect()
}

#[test]
fn translation_registers_evicts_clears_and_gauges() {
    let mut tr = Translator::new(TranslatorConfig {
        engine: 9,
        max_live_per_tier: 100,
    });
    let mut out = Vec::new();
    let b1 = decode_payload(&enc(&envelope_map(
        3.25,
        vec![
            stored_map(vec![Value::from(1), Value::from(2), Value::from(BIG)], None),
            stored_map(vec![Value::from(1)], Some("GPU")), // again: a duplicate
            stored_map(vec![Value::from(5)], Some("CPU")),
        ],
    )))
    .unwrap();
    tr.batch(&b1, &mut out);
    let b2 = decode_payload(&enc(&envelope_array(
        3.0, // older: the time does not go back
        vec![
            removed_map(vec![Value::from(2), Value::from(77)], Some("GPU")),
            Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
        ],
        Some(0),
    )))
    .unwrap();
    tr.batch(&b2, &mut out);
    assert_eq!(
        kinds(&out),
        vec![
            "reg Device 1 ",
            "reg Device 2 ",
            &format!("reg Device {BIG} "),
            "reg Device 1 dup",
            "reg Host 5 ",
            "gauge Device 3",
            "gauge Host 1",
            "evict Device 2",
            "evict Device 1",
            &format!("evict Device {BIG}"),
            "gauge Device 0",
        ]
    );
    for (i, e) in out.iter().enumerate() {
        assert_eq!(e.seq, i as u64, "gapless seq");
        assert_eq!(e.engine, 9);
        assert_eq!(e.iteration, 0);
        assert_eq!(e.request, None);
        assert_eq!(e.ts_ns, 3_250_000_000);
    }
    let c = tr.counters();
    assert_eq!(
        (
            c.registered,
            c.duplicates,
            c.evicted,
            c.cleared,
            c.removed_unknown
        ),
        (4, 1, 1, 2, 1)
    );
    // The reducer sees a consistent block history.
    let st = kvbm_events::reducer::fold(&out);
    assert_eq!(
        st.inconsistencies().total(),
        0,
        "{:?}",
        st.inconsistencies()
    );
    assert!(st.pool(Tier::Device).registered.is_empty());
    assert!(st.pool(Tier::Host).registered.contains(&SequenceHash(5)));
    assert_eq!(st.pool(Tier::Host).active, 1);
}

#[test]
fn the_live_set_bound_evicts_the_oldest_and_counts_it() {
    let mut tr = Translator::new(TranslatorConfig {
        engine: 0,
        max_live_per_tier: 2,
    });
    let mut out = Vec::new();
    let b = KvBatch {
        ts: 1.0,
        events: vec![KvEvent::Stored {
            block_hashes: vec![1, 2, 3],
            parent: None,
            num_tokens: 0,
            block_size: None,
            medium: Medium::Gpu,
            group: None,
        }],
        skipped: Skipped::default(),
        dp_rank: None,
    };
    tr.batch(&b, &mut out);
    assert_eq!(tr.counters().bound_evicted, 1);
    assert_eq!(tr.live(Tier::Device), 2);
    assert_eq!(
        kinds(&out),
        vec![
            "reg Device 1 ",
            "reg Device 2 ",
            "evict Device 1",
            "reg Device 3 ",
            "gauge Device 2"
        ]
    );
    assert_eq!(
        kvbm_events::reducer::fold(&out).inconsistencies().total(),
        0
    );
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

fn pipeline(engine_max_live: usize) -> Pipeline {
    let mut cfg = ZmqConfig::new(ZmqEndpoint::parse("zmq://127.0.0.1:1").unwrap());
    cfg.translator.max_live_per_tier = engine_max_live;
    Pipeline::new(&cfg)
}

/// One live message `[topic, seq, payload]`, with no replay endpoint.
fn feed(p: &mut Pipeline, seq: u64, payload: &[u8], out: &mut Vec<ZmqItem>) {
    let s = seq.to_be_bytes();
    block_on(p.message(&[b"".as_slice(), &s, payload], &mut NoReplay, out));
}

#[test]
fn pipeline_counts_gaps_restarts_and_malformed_messages() {
    let mut p = pipeline(1 << 20);
    let mut out = Vec::new();
    let good = |h: u64| {
        enc(&envelope_array(
            1.0,
            vec![stored_map(vec![Value::from(h)], None)],
            None,
        ))
    };
    feed(&mut p, 0, &good(1), &mut out);
    feed(&mut p, 1, &good(2), &mut out);
    feed(&mut p, 4, &good(3), &mut out);
    assert!(out.contains(&ZmqItem::Gap {
        from_seq: 2,
        to_seq: 3
    }));
    // Malformed payload: counted, its seq still tracked (no gap after it
    // for batch 6), and its batch lost (one of its own).
    feed(&mut p, 5, b"\xc1garbage", &mut out);
    assert!(out.contains(&ZmqItem::Gap {
        from_seq: 5,
        to_seq: 5
    }));
    feed(&mut p, 6, &good(4), &mut out);
    // Bad frames.
    block_on(p.message(&[b"only one frame".as_slice()], &mut NoReplay, &mut out));
    block_on(p.message(
        &[b"".as_slice(), b"short".as_slice(), b"x".as_slice()],
        &mut NoReplay,
        &mut out,
    ));
    // Restart on the same connection: seq back to 0, every live block evicted.
    out.clear();
    feed(&mut p, 0, &good(9), &mut out);
    assert!(matches!(
        out[0],
        ZmqItem::Restart(kvbm_ingest::vllm::RestartAt {
            last_seq: 6,
            new_seq: 0,
            cause: kvbm_ingest::vllm::RestartCause::SeqWentBack
        })
    ));
    let c = p.counters();
    assert_eq!(c.messages, 8);
    assert_eq!(c.malformed, 3);
    assert_eq!((c.gaps, c.missed, c.restarts), (2, 3, 1));
    assert_eq!(
        c.missed_ranges,
        vec![
            kvbm_ingest::vllm::SeqRange { from: 2, to: 3 },
            kvbm_ingest::vllm::SeqRange { from: 5, to: 5 }
        ]
    );
    assert_eq!(c.translate.registered, 5);
    assert_eq!(c.translate.restarts, 1);
    let evicted: usize = out
        .iter()
        .map(|i| match i {
            ZmqItem::Events(e) => e
                .iter()
                .filter(|e| matches!(e.kind, EventKind::BlockEvicted { .. }))
                .count(),
            _ => 0,
        })
        .sum();
    assert_eq!(evicted, 4);
}

fn valid_payload() -> Vec<u8> {
    enc(&envelope_map(
        5.0,
        vec![
            stored_map(
                vec![Value::from(BIG), Value::Binary(vec![9; 32])],
                Some("GPU"),
            ),
            removed_map(vec![Value::from(BIG)], Some("GPU")),
            Value::Array(vec![s("AllBlocksCleared")]),
        ],
    ))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic_and_are_counted(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut p = pipeline(1 << 20);
        let mut out = Vec::new();
        let ok = decode_payload(&bytes).is_ok();
        feed(&mut p, 0, &bytes, &mut out);
        let c = p.counters();
        prop_assert_eq!(c.messages, 1);
        prop_assert_eq!(c.malformed, u64::from(!ok));
        // Random frames too: counted, never a panic.
        block_on(p.message(&[&bytes[..bytes.len() / 2], &bytes[bytes.len() / 2..]], &mut NoReplay, &mut out));
        prop_assert_eq!(p.counters().messages, 2);
    }

    #[test]
    fn mutated_valid_payloads_never_panic_and_are_counted(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut b = valid_payload();
        for (at, byte, op) in edits {
            let i = at.index(b.len().max(1));
            match op {
                0 if !b.is_empty() => {
                    let j = i.min(b.len() - 1);
                    b[j] = byte;
                }
                1 => b.insert(i.min(b.len()), byte),
                _ if !b.is_empty() => { b.remove(i.min(b.len() - 1)); }
                _ => {}
            }
        }
        if truncate && !b.is_empty() {
            b.truncate(cut.index(b.len()));
        }
        let mut p = pipeline(4);
        let mut out = Vec::new();
        let decoded = decode_payload(&b);
        feed(&mut p, 0, &b, &mut out);
        feed(&mut p, 1, &b, &mut out);
        let c = p.counters();
        prop_assert_eq!(c.messages, 2);
        match decoded {
            Ok(batch) => {
                prop_assert_eq!(c.malformed, 0);
                prop_assert_eq!(c.skipped.total(), 2 * batch.skipped.total());
            }
            Err(_) => prop_assert_eq!(c.malformed, 2),
        }
        // Whatever came through, the kvbm stream stays gapless and consistent.
        let evs: Vec<Event> = out.into_iter().flat_map(|i| match i { ZmqItem::Events(e) => e, _ => vec![] }).collect();
        for (i, e) in evs.iter().enumerate() {
            prop_assert_eq!(e.seq, i as u64);
        }
        prop_assert_eq!(kvbm_events::reducer::fold(&evs).inconsistencies().total(), 0);
    }
}
