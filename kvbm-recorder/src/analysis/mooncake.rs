//! A recording's requests as a Mooncake trace: what `kvbm-sim --trace`
//! re-drives, so a run captured in a real engine can be replayed
//! under another configuration.
//!
//! One JSON line a request, in arrival order: `timestamp` (ms since the
//! first request arrived), `input_length` (prompt tokens), `output_length`
//! (tokens generated) and `hash_ids`, one id a full prompt block. The ids
//! number kvbm's sequence hashes densely in order of first appearance;
//! a sequence hash covers its whole prefix, so requests that share a
//! prefix share its ids, and no token id or text leaves the recording.
//! Unlike the published traces (512 tokens an id), an id here covers one
//! of the recorded engine's blocks: [`TraceMeta::block_size`] says how
//! many tokens, and the simulator is told with `--trace-block-tokens`.
//!
//! What a request needs comes from three kinds: `SlotCreated` (arrival,
//! prompt length), `PrefixLookup` (its full blocks' hashes, once per slot)
//! and `TokensScheduled` (how far it was computed: its output is what was
//! computed past the prompt, plus the token the last step produced).
//! Requests with no `PrefixLookup` (a recording made before schema
//! version 2, or one that started mid-request) are left out and counted.

use kvbm_events::{Event, EventKind, RequestId, SequenceHash, Tier};
use serde::Serialize;
use std::collections::HashMap;
use std::io::{self, Write};

/// One request of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceRequest {
    /// Arrival, ms after the first request's.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Tokens generated (at least 1: a trace line needs one).
    pub output_length: u64,
    /// One id a full prompt block.
    pub hash_ids: Vec<u64>,
}

/// What the trace leaves out and a re-run needs: the block size and the
/// recorded run's tiers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceMeta {
    /// Tokens a hash id covers (the recorded engine's block size); 0 when
    /// no request was exported.
    pub block_size: u32,
    /// Each tier's capacity in tokens, from its last pool gauge
    /// (`"G1"`, `"G2"`, `"G3"`); a tier the run did not have is absent.
    pub tiers_tokens: std::collections::BTreeMap<String, u64>,
    /// Requests written.
    pub requests: usize,
    /// Requests left out: no prefix lookup recorded for them.
    pub skipped_no_lookup: usize,
    /// Distinct hash ids.
    pub distinct_blocks: u64,
    /// The simulator's flags for the same block size and tiers.
    pub simulator_args: Vec<String>,
}

#[derive(Debug, Default)]
struct Pending {
    arrival_ns: Option<u64>,
    prompt: Option<u64>,
    lookup: Option<(u64, Vec<SequenceHash>)>,
    computed: u64,
}

/// Builds the trace from a stream of events, one at a time.
#[derive(Debug, Default)]
pub struct TraceBuilder {
    requests: HashMap<(u32, RequestId), Pending>,
    order: Vec<(u32, RequestId)>,
    block_size: u32,
    capacity_blocks: HashMap<Tier, u32>,
}

impl TraceBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one event into account.
    pub fn observe(&mut self, e: &Event) {
        if let EventKind::PoolGauge { tier, capacity, .. } = &e.kind {
            self.capacity_blocks.insert(*tier, *capacity);
            return;
        }
        let Some(r) = &e.request else { return };
        let key = (e.engine, r.clone());
        let relevant = matches!(
            e.kind,
            EventKind::SlotCreated { .. }
                | EventKind::PrefixLookup { .. }
                | EventKind::TokensScheduled { .. }
        );
        if !relevant {
            return;
        }
        let p = self.requests.entry(key.clone()).or_insert_with(|| {
            self.order.push(key);
            Pending::default()
        });
        p.arrival_ns.get_or_insert(e.ts_ns);
        match &e.kind {
            EventKind::SlotCreated { prompt_tokens, .. } => {
                p.prompt.get_or_insert(u64::from(*prompt_tokens));
            }
            EventKind::PrefixLookup {
                tokens,
                block_size,
                hashes,
                ..
            } if p.lookup.is_none() => {
                p.lookup = Some((u64::from(*tokens), hashes.clone()));
                if self.block_size == 0 {
                    self.block_size = *block_size;
                }
            }
            EventKind::TokensScheduled { computed, .. } => {
                p.computed = p.computed.max(u64::from(*computed));
            }
            _ => {}
        }
    }

    /// The trace's requests, in arrival order, and what it leaves out.
    pub fn finish(self) -> (Vec<TraceRequest>, TraceMeta) {
        let mut skipped = 0;
        let mut rows: Vec<(u64, u64, u64, Vec<SequenceHash>)> = Vec::new();
        let mut requests = self.requests;
        for key in &self.order {
            let Some(p) = requests.remove(key) else {
                continue;
            };
            let Some((lookup_tokens, hashes)) = p.lookup else {
                skipped += 1;
                continue;
            };
            let input = p.prompt.unwrap_or(lookup_tokens).max(1);
            // Computed past the prompt, plus the token the last step
            // produced (its KV is never computed).
            let output = (p.computed + 1).saturating_sub(input).max(1);
            rows.push((p.arrival_ns.unwrap_or(0), input, output, hashes));
        }
        // Stable: requests arriving at one instant keep their order. Ids
        // are numbered in this order, so they appear in the trace in
        // order, as in the published traces.
        rows.sort_by_key(|r| r.0);
        let first = rows.first().map_or(0, |r| r.0);
        let mut ids: HashMap<SequenceHash, u64> = HashMap::new();
        let out: Vec<TraceRequest> = rows
            .into_iter()
            .map(|(t, input, output, hashes)| TraceRequest {
                timestamp: (t - first) / 1_000_000,
                input_length: input,
                output_length: output,
                hash_ids: hashes
                    .iter()
                    .map(|h| {
                        let n = ids.len() as u64;
                        *ids.entry(*h).or_insert(n)
                    })
                    .collect(),
            })
            .collect();
        let bs = if out.is_empty() { 0 } else { self.block_size };
        let tiers_tokens: std::collections::BTreeMap<String, u64> = self
            .capacity_blocks
            .iter()
            .map(|(t, c)| (t.short_name().to_string(), u64::from(*c) * u64::from(bs)))
            .collect();
        let meta = TraceMeta {
            block_size: bs,
            simulator_args: simulator_args(bs, &tiers_tokens),
            tiers_tokens,
            requests: out.len(),
            skipped_no_lookup: skipped,
            distinct_blocks: ids.len() as u64,
        };
        (out, meta)
    }
}

/// `kvbm-sim` flags for a run with the recorded block size and tiers.
fn simulator_args(block_size: u32, tiers: &std::collections::BTreeMap<String, u64>) -> Vec<String> {
    let mut args = vec![
        "--block-size".to_string(),
        block_size.to_string(),
        "--trace-block-tokens".to_string(),
        block_size.to_string(),
    ];
    for (tier, flag) in [
        ("G1", "--device-capacity-tokens"),
        ("G2", "--host-capacity-tokens"),
        ("G3", "--disk-capacity-tokens"),
    ] {
        args.push(flag.to_string());
        args.push(tiers.get(tier).copied().unwrap_or(0).to_string());
    }
    args
}

/// Writes `requests` as Mooncake JSON lines.
pub fn write_trace<W: Write>(requests: &[TraceRequest], mut w: W) -> io::Result<()> {
    for r in requests {
        serde_json::to_writer(&mut w, r).map_err(io::Error::from)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

/// The trace of `events`, in one call.
pub fn trace_of<'a>(events: impl IntoIterator<Item = &'a Event>) -> (Vec<TraceRequest>, TraceMeta) {
    let mut b = TraceBuilder::new();
    for e in events {
        b.observe(e);
    }
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testutil::{Stream, arb_events};
    use proptest::prelude::*;

    fn lookup(s: &mut Stream, r: &str, tokens: u32, hashes: &[u64]) {
        s.push(
            Some(r),
            EventKind::PrefixLookup {
                tokens,
                block_size: 4,
                computed_blocks: 0,
                hashes: hashes.iter().map(|&h| SequenceHash(h)).collect(),
            },
        );
    }

    fn scheduled(s: &mut Stream, r: &str, computed: u32) {
        s.push(
            Some(r),
            EventKind::TokensScheduled {
                prefill: 0,
                decode: 1,
                computed,
            },
        );
    }

    #[test]
    fn shared_prefixes_share_ids_and_outputs_count_the_last_token() {
        let mut s = Stream::new();
        // b arrives first in time but is created second in the stream: the
        // trace is in arrival order.
        s.at(5_000_000).create("a", 10);
        lookup(&mut s, "a", 10, &[70, 71]);
        s.at(2_000_000).create("b", 9);
        lookup(&mut s, "b", 9, &[70, 90]);
        s.at(9_000_000);
        scheduled(&mut s, "a", 10);
        scheduled(&mut s, "a", 12);
        // Preempted and recomputed: the most computed counts.
        scheduled(&mut s, "a", 4);
        scheduled(&mut s, "b", 9);
        s.push(
            None,
            EventKind::PoolGauge {
                tier: Tier::Host,
                capacity: 100,
                active: 0,
                inactive: 0,
                empty: 100,
            },
        );
        // Never looked up: left out, counted.
        s.create("c", 8);
        let (reqs, meta) = trace_of(s.events());
        assert_eq!(
            reqs,
            [
                TraceRequest {
                    timestamp: 0,
                    input_length: 9,
                    output_length: 1,
                    hash_ids: vec![0, 1],
                },
                TraceRequest {
                    timestamp: 3,
                    input_length: 10,
                    output_length: 3,
                    hash_ids: vec![0, 2],
                },
            ],
            "in arrival order, ids numbered in it; a's first block is b's"
        );
        assert_eq!(meta.block_size, 4);
        assert_eq!(meta.requests, 2);
        assert_eq!(meta.skipped_no_lookup, 1);
        assert_eq!(meta.distinct_blocks, 3);
        assert_eq!(meta.tiers_tokens.get("G2"), Some(&400));
        assert!(
            meta.simulator_args
                .windows(2)
                .any(|w| w == ["--host-capacity-tokens", "400"]),
            "{:?}",
            meta.simulator_args
        );
    }

    #[test]
    fn a_trace_reads_back_in_the_simulators_format() {
        let mut s = Stream::new();
        s.create("a", 10);
        lookup(&mut s, "a", 10, &[1, 2]);
        let (reqs, _) = trace_of(s.events());
        let mut out = Vec::new();
        write_trace(&reqs, &mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"timestamp\":0,\"input_length\":10,\"output_length\":1,\"hash_ids\":[0,1]}\n"
        );
    }

    proptest! {
        /// Any stream, however nonsensical, gives a trace whose lines a
        /// simulator accepts: lengths of at least 1, ids dense from 0,
        /// timestamps in order.
        #[test]
        fn any_stream_gives_a_well_formed_trace(events in arb_events(200)) {
            let (reqs, meta) = trace_of(&events);
            prop_assert_eq!(reqs.len(), meta.requests);
            let mut seen = 0u64;
            for w in reqs.windows(2) {
                prop_assert!(w[0].timestamp <= w[1].timestamp);
            }
            for r in &reqs {
                prop_assert!(r.input_length >= 1 && r.output_length >= 1);
                for &id in &r.hash_ids {
                    prop_assert!(id <= seen);
                    seen = seen.max(id + 1);
                }
            }
            prop_assert_eq!(seen, meta.distinct_blocks);
        }
    }
}
