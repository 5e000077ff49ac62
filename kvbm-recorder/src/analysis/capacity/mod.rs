//! Capacity what-if: the prefix-hit ratio an LRU cache of every size would
//! have had on what the engine was asked, in one pass, and why each miss
//! missed.
//!
//! - [`stack`]: LRU stack distances (Mattson), O(log n) per reference.
//! - [`curve`]: the hit-ratio curve with prefix semantics, exact or
//!   sampled by hash (SHARDS).
//! - [`reasons`]: why each lookup's misses missed.
//! - [`restore`]: for streams without lookups (vLLM's KV events), a lower
//!   bound on the extra hits more capacity gives, from re-stores.
//!
//! The input is the reference stream: each request's full-block hashes at
//! its first lookup (`PrefixLookup`, schema version 2), in lookup order —
//! a property of the workload, not of the cache the run had, so a log
//! recorded with any capacity gives the same curve. [`CapacityAnalyzer`]
//! reads it from events (a log, live); [`TraceCurve`] from a trace's block
//! ids directly (a Mooncake file). [`CapacityReport`] is what the CLI prints and the
//! console draws.

pub mod curve;
pub mod reasons;
pub mod restore;
pub mod stack;

pub use curve::{BlockDistance, Curve, CurveBuilder, Method, Point, Sampling};
pub use reasons::{Lookup, LookupBlocks, MissReason, ReasonTotals, Reasons};
pub use restore::{RestorePoint, Restores, TierRestoreReport};
pub use stack::StackDistances;

use kvbm_events::slot::SlotState;
use kvbm_events::tier::Tier;
use kvbm_events::{Event, EventKind};
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// What the analysis holds and how.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapacityConfig {
    /// Exact or sampled curve.
    pub sampling: Sampling,
    /// Most blocks the miss reasons and the re-store bound follow (`None`:
    /// no cap); past it new blocks are counted as untracked.
    pub max_tracked_blocks: Option<usize>,
}

impl Default for CapacityConfig {
    fn default() -> Self {
        CapacityConfig {
            sampling: Sampling::Exact,
            max_tracked_blocks: None,
        }
    }
}

impl CapacityConfig {
    /// Bounded memory for a long-lived consumer (the console): exact up to
    /// `max_blocks` distinct blocks, sampled beyond; reasons and re-stores
    /// follow at most as many.
    pub fn bounded(max_blocks: usize) -> Self {
        CapacityConfig {
            sampling: Sampling::Bounded(max_blocks),
            max_tracked_blocks: Some(max_blocks),
        }
    }
}

/// The streaming analysis over events. See the module docs.
#[derive(Debug, Clone)]
pub struct CapacityAnalyzer {
    curve: CurveBuilder,
    reasons: Reasons,
    restores: Restores,
    /// Pool capacity per tier, blocks (from `PoolGauge`).
    capacity: [Option<u32>; 3],
    engine: Option<u32>,
    last_seq: Option<u64>,
    /// Events skipped as stale duplicates or another engine's.
    skipped: u64,
    lookups: u64,
    scratch: Vec<BlockDistance>,
    distances: Vec<Option<u64>>,
}

impl CapacityAnalyzer {
    /// An empty analysis.
    pub fn new(cfg: CapacityConfig) -> Self {
        CapacityAnalyzer {
            curve: CurveBuilder::new(cfg.sampling),
            reasons: Reasons::new(cfg.max_tracked_blocks),
            restores: Restores::new(cfg.max_tracked_blocks),
            capacity: [None; 3],
            engine: None,
            last_seq: None,
            skipped: 0,
            lookups: 0,
            scratch: Vec::new(),
            distances: Vec::new(),
        }
    }

    /// Feeds every event of `events`.
    pub fn from_events<'a>(
        cfg: CapacityConfig,
        events: impl IntoIterator<Item = &'a Event>,
    ) -> Self {
        let mut a = Self::new(cfg);
        for e in events {
            a.observe(e);
        }
        a
    }

    /// Takes one event. Another engine's events and stale duplicates (a
    /// sequence number not above the last) are skipped, as the reducer
    /// skips them.
    pub fn observe(&mut self, ev: &Event) {
        match self.engine {
            None => self.engine = Some(ev.engine),
            Some(e) if e != ev.engine => {
                self.skipped += 1;
                return;
            }
            Some(_) => {}
        }
        if self.last_seq.is_some_and(|s| ev.seq <= s) {
            self.skipped += 1;
            return;
        }
        self.last_seq = Some(ev.seq);
        let req = ev.request.as_ref();
        match &ev.kind {
            EventKind::PrefixLookup {
                tokens,
                block_size,
                computed_blocks,
                hashes,
            } => {
                self.lookups += 1;
                self.scratch.clear();
                self.curve.request(
                    u64::from(*tokens),
                    *block_size,
                    hashes.iter().map(|h| h.0),
                    Some(&mut self.scratch),
                );
                if let Some(r) = req {
                    self.distances.clear();
                    self.distances.extend(self.scratch.iter().map(|d| match d {
                        BlockDistance::Distance(d) => Some(*d),
                        _ => None,
                    }));
                    let raw: Vec<u64> = hashes.iter().map(|h| h.0).collect();
                    let blocks = reasons::LookupBlocks {
                        tokens: *tokens,
                        block_size: *block_size,
                        computed_blocks: *computed_blocks,
                        hashes: &raw,
                    };
                    self.reasons
                        .prefix_lookup(r, ev.ts_ns, &blocks, &self.distances);
                }
            }
            EventKind::MatchResult {
                tier,
                looked_up,
                hit_blocks,
                ..
            } => {
                if let Some(r) = req {
                    self.reasons
                        .match_result(r, ev.ts_ns, *tier, *looked_up, *hit_blocks);
                }
            }
            EventKind::BlockRegistered {
                tier,
                sequence_hash,
                duplicate_of,
                ..
            } => {
                if duplicate_of.is_none() {
                    self.reasons.registered(*tier, *sequence_hash);
                    self.restores.stored(*tier, *sequence_hash);
                }
            }
            EventKind::BlockEvicted {
                tier,
                sequence_hash,
                ..
            } => {
                self.reasons.evicted(*tier, *sequence_hash, ev.ts_ns);
                self.restores.removed(*tier, *sequence_hash);
            }
            EventKind::PoolGauge { tier, capacity, .. } => {
                self.capacity[tier.index()] = Some(*capacity);
            }
            EventKind::SlotCreated { .. } => {
                if let Some(r) = req {
                    self.reasons.created(r);
                }
            }
            EventKind::SlotTransition {
                to: SlotState::Finished,
                ..
            } => {
                if let Some(r) = req {
                    self.reasons.finished(r);
                }
            }
            // The hooks' and breakpoints' own events come from inside the
            // lookup call (between its device and host results): not the
            // end of the lookup, which would count its host result as a
            // lookup of its own.
            EventKind::HookCall { .. }
            | EventKind::BreakpointHit { .. }
            | EventKind::Resumed { .. } => {}
            _ => {
                if let Some(r) = req {
                    self.reasons.other_event(r);
                }
            }
        }
    }

    /// `PrefixLookup` events taken.
    pub fn lookups(&self) -> u64 {
        self.lookups
    }

    /// The curve so far.
    pub fn curve(&self) -> Curve {
        self.curve.curve()
    }

    /// The lookups of one request, explained.
    pub fn request_lookups(&self, request: &str) -> Vec<Lookup> {
        self.reasons.lookups(request)
    }

    /// Miss reasons over first lookups.
    pub fn reason_totals(&self) -> ReasonTotals {
        self.reasons.totals()
    }

    /// The run's capacity per tier, in tokens (from its pool gauges).
    pub fn tier_capacity_tokens(&self) -> [Option<u64>; 3] {
        let bs = u64::from(self.curve.block_size());
        self.capacity
            .map(|c| c.filter(|_| bs > 0).map(|c| u64::from(c) * bs))
    }

    /// The report at `capacities` (tokens). `block_size` is used for the
    /// re-store bound when the stream itself does not say (vLLM's events
    /// do not carry it to the log).
    pub fn report(&self, capacities: &[u64], block_size: Option<u32>) -> CapacityReport {
        let curve = self.curve.curve();
        let mut rep = CapacityReport::from_curve("log", &curve, capacities);
        rep.skipped_events = self.skipped;
        if self.lookups > 0 {
            let totals = self.reasons.totals();
            rep.miss_reasons = Some(MissReasonReport::new(&totals, self.reasons.relookups()));
            rep.untracked_blocks = self.reasons.untracked();
            rep.run = Some(RunReport::new(&curve, self.tier_capacity_tokens(), &totals));
        } else {
            rep.notes.push(
                "this log has no PrefixLookup events (recorded before schema version 2, or from \
                 an engine whose lookups are not recorded, such as vLLM's KV events): no curve; \
                 see restores for what its stores and removals say"
                    .into(),
            );
        }
        if self.restores.any() {
            let bs = (curve.block_size > 0)
                .then_some(curve.block_size)
                .or(block_size);
            let blocks: Vec<u64> = match bs {
                Some(b) => capacities.iter().map(|c| c / u64::from(b.max(1))).collect(),
                None => capacities.to_vec(),
            };
            rep.restores = self.restores.report(&blocks, bs);
            if bs.is_none() {
                rep.notes.push(
                    "block size unknown (pass --block-size): re-store capacities are in blocks"
                        .into(),
                );
            }
            rep.notes.push(
                "restores: extra_hits_lower_bound is a lower bound on the hits more capacity \
                 would have given (blocks stored again after removal whose reuse distance fits), \
                 assuming LRU eviction"
                    .into(),
            );
        }
        rep
    }
}

/// What a run's own tiers had and got, beside what the curve says.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    /// Prefix-hit ratio the run measured on first lookups (all tiers).
    pub measured_hit_ratio: f64,
    /// The capacity of the tiers together, in tokens: the largest tier's,
    /// as kvbm's tiers are inclusive (eager offload copies every computed
    /// block to the host, which writes through to disk).
    pub capacity_tokens: Option<u64>,
    /// The curve at that capacity.
    pub curve_hit_ratio: Option<f64>,
    /// Per tier.
    pub tiers: Vec<TierRun>,
}

/// One tier of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TierRun {
    /// The tier.
    pub tier: Tier,
    /// Its capacity, tokens.
    pub capacity_tokens: u64,
    /// Hit ratio it served (its hit tokens over prompt tokens).
    pub measured_hit_ratio: f64,
    /// What the curve says it adds: the curve at this tier and the faster
    /// ones together, less the curve at the faster ones alone.
    pub curve_hit_ratio: f64,
    /// The tiers together with this one's capacity doubled.
    pub doubled_capacity_tokens: u64,
    /// The curve (all tiers) there.
    pub curve_hit_ratio_doubled: f64,
    /// The curve (all tiers) at the run's capacity, for comparison.
    pub curve_hit_ratio_now: f64,
}

impl RunReport {
    fn new(curve: &Curve, caps: [Option<u64>; 3], totals: &ReasonTotals) -> Self {
        let prompt = totals.prompt_tokens.max(1) as f64;
        let together = caps.iter().flatten().copied().max();
        let at = |c: u64| curve.at_tokens(c).hit_ratio;
        let mut tiers = Vec::new();
        let mut faster = 0u64;
        for tier in Tier::ALL {
            let Some(c) = caps[tier.index()] else {
                continue;
            };
            let cum = faster.max(c);
            let others = caps
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != tier.index())
                .filter_map(|(_, c)| *c)
                .max()
                .unwrap_or(0);
            let doubled = others.max(2 * c);
            tiers.push(TierRun {
                tier,
                capacity_tokens: c,
                measured_hit_ratio: totals.hit_tokens[tier.index()] as f64 / prompt,
                curve_hit_ratio: (at(cum) - if faster > 0 { at(faster) } else { 0.0 }).max(0.0),
                doubled_capacity_tokens: doubled,
                curve_hit_ratio_doubled: at(doubled),
                curve_hit_ratio_now: together.map_or(0.0, at),
            });
            faster = cum;
        }
        RunReport {
            measured_hit_ratio: totals.hits() as f64 / prompt,
            capacity_tokens: together,
            curve_hit_ratio: together.map(at),
            tiers,
        }
    }
}

/// Miss reasons in tokens, over first lookups.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MissReasonReport {
    /// Tokens by outcome.
    pub tokens: ReasonTotals,
    /// `(reason, share of prompt tokens)`.
    pub shares: Vec<(String, f64)>,
    /// Lookups after a request's first (asked again while it waits to be
    /// admitted, or after a preemption), not counted
    /// above.
    pub later_lookups: u64,
}

impl MissReasonReport {
    fn new(t: &ReasonTotals, later: u64) -> Self {
        let p = t.prompt_tokens.max(1) as f64;
        MissReasonReport {
            tokens: *t,
            shares: t
                .reasons()
                .iter()
                .map(|(n, v)| (n.to_string(), *v as f64 / p))
                .collect(),
            later_lookups: later,
        }
    }
}

/// Everything the `capacity` command prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CapacityReport {
    /// `"log"` or `"trace"`.
    pub source: &'static str,
    /// Tokens per block.
    pub block_size: u32,
    /// Requests (first lookups).
    pub requests: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Block references.
    pub references: u64,
    /// Hit ratio of an unbounded cache (tokens).
    pub ceiling: f64,
    /// The same, block-weighted.
    pub ceiling_blocks: f64,
    /// Exact or sampled, and the rate.
    pub method: Method,
    /// The mean standard error over `points` (0 when exact).
    pub error_estimate: f64,
    /// The curve at the capacities asked for.
    pub points: Vec<Point>,
    /// The curve from one block to past its largest distance (for
    /// drawing).
    pub grid: Vec<Point>,
    /// The run's own tiers (from a log with lookups).
    pub run: Option<RunReport>,
    /// Miss reasons (from a log with lookups).
    pub miss_reasons: Option<MissReasonReport>,
    /// The re-store lower bound per tier (from stores and removals).
    pub restores: Vec<TierRestoreReport>,
    /// Blocks the miss reasons did not follow (memory cap).
    pub untracked_blocks: u64,
    /// Events skipped (another engine's, stale duplicates).
    pub skipped_events: u64,
    /// Trace lines skipped as malformed.
    pub skipped_lines: u64,
    /// Trace lines whose timestamp went back (taken in file order).
    pub out_of_order_lines: u64,
    /// What else to know.
    pub notes: Vec<String>,
}

impl CapacityReport {
    fn from_curve(source: &'static str, curve: &Curve, capacities: &[u64]) -> Self {
        let points: Vec<Point> = capacities.iter().map(|&c| curve.at_tokens(c)).collect();
        let (ceiling, ceiling_blocks) = curve.ceiling();
        let error_estimate = if points.is_empty() {
            0.0
        } else {
            points.iter().map(|p| p.stderr).sum::<f64>() / points.len() as f64
        };
        let mut notes = Vec::new();
        if curve.method.method != "exact" && curve.sample_size() < curve::MIN_SAMPLE {
            notes.push(format!(
                "the sample holds {} of {} block references, fewer than {}: too few for an \
                 estimate (the ratios and their error mean little); raise --sample or \
                 --max-exact-blocks",
                curve.sample_size(),
                curve.matchable_blocks,
                curve::MIN_SAMPLE
            ));
        }
        CapacityReport {
            source,
            block_size: curve.block_size,
            requests: curve.requests,
            prompt_tokens: curve.prompt_tokens,
            references: curve.blocks,
            ceiling,
            ceiling_blocks,
            method: curve.method.clone(),
            error_estimate,
            points,
            grid: curve.grid(120),
            run: None,
            miss_reasons: None,
            restores: Vec::new(),
            untracked_blocks: 0,
            skipped_events: 0,
            skipped_lines: 0,
            out_of_order_lines: 0,
            notes,
        }
    }
}

/// The curve of a trace, straight from its block ids (no simulation),
/// fed one request at a time in the trace's order by whoever reads the
/// trace (the `kvbm-recorder` program reads Mooncake files with the
/// simulator's reader): each request is `input_length` tokens whose full
/// blocks are its ids chained (an id names a block only with its prefix).
#[derive(Debug)]
pub struct TraceCurve {
    builder: CurveBuilder,
    block_tokens: usize,
    keys: Vec<u64>,
    last_ts: u64,
    out_of_order: u64,
    skipped: u64,
}

impl TraceCurve {
    /// An empty curve for blocks of `block_tokens` tokens.
    pub fn new(sampling: Sampling, block_tokens: usize) -> TraceCurve {
        TraceCurve {
            builder: CurveBuilder::new(sampling),
            block_tokens: block_tokens.max(1),
            keys: Vec::new(),
            last_ts: 0,
            out_of_order: 0,
            skipped: 0,
        }
    }

    /// The next request: when it arrived, its prompt's length and its
    /// blocks' ids (ids past the prompt's full blocks are ignored).
    pub fn request(&mut self, timestamp_ms: u64, input_length: usize, hash_ids: &[u64]) {
        if timestamp_ms < self.last_ts {
            self.out_of_order += 1;
        }
        self.last_ts = self.last_ts.max(timestamp_ms);
        self.keys.clear();
        let full = (input_length / self.block_tokens).min(hash_ids.len());
        let mut prev = 0u64;
        for &id in &hash_ids[..full] {
            prev = chain(prev, id);
            self.keys.push(prev);
        }
        self.builder.request(
            input_length as u64,
            self.block_tokens as u32,
            self.keys.iter().copied(),
            None,
        );
    }

    /// The keys of the request last added, in prefix order: a block's id
    /// chained with its prefix's (what the curve references).
    pub fn last_keys(&self) -> &[u64] {
        &self.keys
    }

    /// A line of the trace that could not be read (counted in the report).
    pub fn skipped_line(&mut self) {
        self.skipped += 1;
    }

    /// The report at `capacities`.
    pub fn report(self, capacities: &[u64]) -> CapacityReport {
        let mut rep = CapacityReport::from_curve("trace", &self.builder.curve(), capacities);
        rep.skipped_lines = self.skipped;
        rep.out_of_order_lines = self.out_of_order;
        rep
    }
}

/// A trace block's key: its id together with its whole prefix.
fn chain(prev: u64, id: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&prev.to_le_bytes());
    buf[8..].copy_from_slice(&id.to_le_bytes());
    xxh3_64_with_seed(&buf, 0x6b76_626d)
}

/// Parses a capacity: a number of tokens with an optional `K`, `M` or `G`
/// suffix (powers of 1024 — `1M` is 1,048,576 tokens, as the simulator's
/// `--host-capacity-tokens 1048576`), case-insensitive.
pub fn parse_capacity(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => return Err(format!("{s:?}: unknown suffix {c:?} (K, M or G)")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let num = num.trim();
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: not a number of tokens"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("{s:?}: must be a positive number of tokens"));
    }
    let tokens = v * mult as f64;
    if tokens >= u64::MAX as f64 / 2.0 {
        return Err(format!("{s:?}: too large"));
    }
    Ok(tokens.round() as u64)
}

/// Parses a comma-separated list of capacities ([`parse_capacity`]).
pub fn parse_capacities(s: &str) -> Result<Vec<u64>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(parse_capacity)
        .collect::<Result<Vec<_>, _>>()
        .and_then(|v| {
            if v.is_empty() {
                Err("no capacity given".into())
            } else {
                Ok(v)
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_parse_with_suffixes_and_refuse_garbage() {
        assert_eq!(parse_capacity("1M"), Ok(1 << 20));
        assert_eq!(parse_capacity("3m"), Ok(3 << 20));
        assert_eq!(parse_capacity("512"), Ok(512));
        assert_eq!(parse_capacity("1.5K"), Ok(1536));
        assert_eq!(parse_capacity(" 2G "), Ok(2 << 30));
        assert_eq!(
            parse_capacities("1M,3M,10M,50M"),
            Ok(vec![1 << 20, 3 << 20, 10 << 20, 50 << 20])
        );
        for bad in ["", "M", "1X", "-3", "0", "nan", "1e30G", "1,,x"] {
            assert!(parse_capacities(bad).is_err(), "{bad:?} accepted");
        }
    }

    use kvbm_events::{RequestId, SequenceHash};

    struct Stream {
        events: Vec<Event>,
    }

    impl Stream {
        fn push(&mut self, ts_s: u64, request: Option<&str>, kind: EventKind) {
            let seq = self.events.len() as u64;
            self.events.push(Event {
                engine: 0,
                seq,
                ts_ns: ts_s * 1_000_000_000,
                iteration: seq,
                request: request.map(RequestId::from),
                kind,
            });
        }

        fn lookup(&mut self, ts: u64, r: &str, device_hits: u32, hashes: &[u64]) {
            self.push(
                ts,
                Some(r),
                EventKind::SlotCreated {
                    prompt_tokens: hashes.len() as u32 * 4 + 2,
                    max_output_tokens: 1,
                },
            );
            self.push(
                ts,
                Some(r),
                EventKind::PrefixLookup {
                    tokens: hashes.len() as u32 * 4 + 2,
                    block_size: 4,
                    computed_blocks: device_hits,
                    hashes: hashes.iter().map(|&h| SequenceHash(h)).collect(),
                },
            );
        }

        fn host_match(&mut self, ts: u64, r: &str, looked_up: u32, hit: u32) {
            self.push(
                ts,
                Some(r),
                EventKind::MatchResult {
                    tier: Tier::Host,
                    looked_up,
                    hit_blocks: hit,
                    hit_tokens: hit * 4,
                },
            );
        }

        fn register(&mut self, ts: u64, tier: Tier, h: u64) {
            self.push(
                ts,
                None,
                EventKind::BlockRegistered {
                    tier,
                    block: h as u32,
                    sequence_hash: SequenceHash(h),
                    duplicate_of: None,
                },
            );
        }

        fn evict(&mut self, ts: u64, tier: Tier, h: u64) {
            self.push(
                ts,
                None,
                EventKind::BlockEvicted {
                    tier,
                    block: h as u32,
                    sequence_hash: SequenceHash(h),
                },
            );
        }

        fn finish(&mut self, ts: u64, r: &str) {
            self.push(
                ts,
                Some(r),
                EventKind::SlotTransition {
                    from: SlotState::Decoding,
                    to: SlotState::Finished,
                },
            );
        }
    }

    /// A request asked about at each scheduling attempt while it waits:
    /// each attempt is one lookup (its device result, the hooks' events of
    /// the call, its host result), so three attempts are the first lookup
    /// and two later ones, not five.
    #[test]
    fn a_lookup_s_hook_events_do_not_split_it_in_two() {
        let mut s = Stream { events: Vec::new() };
        let hook = |phase| EventKind::HookCall {
            entry: kvbm_events::EntryPoint::GetNumNewMatchedTokens,
            phase,
        };
        let device = EventKind::MatchResult {
            tier: Tier::Device,
            looked_up: 2,
            hit_blocks: 0,
            hit_tokens: 0,
        };
        s.push(1, Some("a"), device.clone());
        s.push(1, Some("a"), hook(kvbm_events::HookPhase::Will));
        s.lookup(1, "a", 0, &[1, 2]);
        s.host_match(1, "a", 2, 0);
        s.push(1, Some("a"), hook(kvbm_events::HookPhase::Finished));
        for ts in [2, 3] {
            s.push(ts, Some("a"), device.clone());
            s.push(ts, Some("a"), hook(kvbm_events::HookPhase::Will));
            s.host_match(ts, "a", 2, 0);
            s.push(ts, Some("a"), hook(kvbm_events::HookPhase::Finished));
        }
        let a = CapacityAnalyzer::from_events(CapacityConfig::default(), &s.events);
        let lookups = a.request_lookups("a");
        assert_eq!(lookups.len(), 3, "{lookups:?}");
        assert!(lookups[0].first && !lookups[1].first && !lookups[2].first);
        assert_eq!(a.reasons.relookups(), 2);
    }

    #[test]
    fn each_miss_gets_its_reason() {
        let mut s = Stream { events: Vec::new() };
        // a: two cold blocks, computing them.
        s.lookup(1, "a", 0, &[1, 2]);
        s.host_match(1, "a", 2, 0);
        // b, while a runs: the same blocks are in flight.
        s.lookup(2, "b", 0, &[1, 2]);
        s.host_match(2, "b", 2, 0);
        // a stores them on G1 and G2 and finishes; b finishes.
        for h in [1, 2] {
            s.register(3, Tier::Device, h);
            s.register(3, Tier::Host, h);
        }
        s.finish(3, "a");
        s.finish(3, "b");
        // c: new blocks 3, 4, 5, 6, 7; then G1 drops everything and G2
        // evicts 1.
        s.lookup(4, "c", 0, &[3, 4, 5, 6, 7]);
        s.host_match(4, "c", 5, 0);
        for h in [1, 2] {
            s.evict(5, Tier::Device, h);
        }
        s.evict(6, Tier::Host, 1);
        s.finish(6, "c");
        // d: block 1 was evicted from G2 at 6 s; 2 is still on G2 but
        // behind the miss.
        s.lookup(7, "d", 0, &[1, 2]);
        s.host_match(7, "d", 2, 0);
        let a = CapacityAnalyzer::from_events(CapacityConfig::default(), &s.events);
        let first = |r: &str| a.request_lookups(r).remove(0);
        assert_eq!(first("a").stopped, Some(MissReason::Cold));
        assert_eq!(first("b").stopped, Some(MissReason::InFlight));
        assert_eq!(first("c").stopped, Some(MissReason::Cold));
        let d = first("d");
        assert_eq!(
            d.stopped,
            Some(MissReason::Evicted {
                tier: Tier::Host,
                at_ns: 6_000_000_000,
                // Since 1's last use (by b): 2, then c's five blocks.
                distance_blocks: Some(7),
            })
        );
        assert_eq!(d.totals.evicted[Tier::Host.index()], 4);
        assert_eq!(d.totals.behind_miss, 4);
        assert_eq!(d.totals.partial, 2);
        let t = a.reason_totals();
        assert_eq!(t.lookups, 4);
        assert_eq!(t.cold, 4 * (2 + 5));
        assert_eq!(t.in_flight, 8);
        assert_eq!(t.hits() + t.misses(), t.prompt_tokens);
        // A hit on G2: e, after d, finds 1 and 2 nowhere but 2 on G2.
        let mut s2 = Stream {
            events: s.events.clone(),
        };
        s2.register(8, Tier::Host, 1);
        s2.lookup(9, "e", 0, &[1, 2]);
        s2.host_match(9, "e", 2, 2);
        let a = CapacityAnalyzer::from_events(CapacityConfig::default(), &s2.events);
        let e = a.request_lookups("e").remove(0);
        assert_eq!(e.hit_blocks, [0, 2, 0]);
        assert_eq!(e.stopped, None);
    }

    proptest::proptest! {
        #[test]
        fn capacity_parsing_never_panics(s in ".{0,12}") {
            let _ = parse_capacities(&s);
        }
    }
}
