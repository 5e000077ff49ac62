//! What the fleet view knows: per engine, the shared reducer's state
//! folded from its batches (each (engine, seq) applied once, holes
//! counted), its rates and freshness; and across engines, which prefixes
//! (sequence hashes) are cached where.

use kvbm_attach::nats::track::{Admit, Tracker};
use kvbm_attach::nats::wire::BatchHeader;
use kvbm_events::reducer::EngineState;
use kvbm_events::slot::SlotState;
use kvbm_events::{BlockId, Event, EventKind, RequestId, SequenceHash, Tier};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// An engine whose last batch is older than this is *stale*.
pub const STALE_AFTER: Duration = Duration::from_secs(5);
/// … and older than this, *gone*.
pub const GONE_AFTER: Duration = Duration::from_secs(30);
/// An engine with a call paused at a breakpoint sends nothing while it
/// waits: it is *paused*, not stale or gone, until quiet this long (a
/// breakpoint held longer than any deadline one would set, or an engine
/// killed while paused).
pub const PAUSED_GONE_AFTER: Duration = Duration::from_secs(600);
/// Finished requests are kept this long (engine time).
pub const KEEP_FINISHED_NS: u64 = 30_000_000_000;
/// Requests whose device blocks are remembered per engine (for "where is
/// this prefix"); the oldest are forgotten past it, counted.
pub const MAX_REQUESTS_REMEMBERED: usize = 20_000;
/// Distinct hashes the cross-engine index takes; past it, counted.
pub const MAX_INDEXED_HASHES: usize = 2_000_000;
/// Engines the console keeps at once. A fleet whose pods get new names
/// as they are replaced leaves gone engines behind: past this, the one
/// gone longest makes room for a new one (counted); with none gone, a new
/// engine's batches are counted and not applied, so a publisher inventing
/// names cannot grow the console without bound.
pub const MAX_ENGINES: usize = 10_000;

/// Whether an engine is publishing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Liveness {
    /// A batch within [`STALE_AFTER`].
    Live,
    /// Quiet for longer, with a call paused at a breakpoint (the engine
    /// waits for it), up to [`PAUSED_GONE_AFTER`].
    Paused,
    /// Quiet for longer.
    Stale,
    /// Quiet past [`GONE_AFTER`].
    Gone,
}

impl Liveness {
    /// As shown.
    pub fn name(self) -> &'static str {
        match self {
            Liveness::Live => "live",
            Liveness::Paused => "paused",
            Liveness::Stale => "stale",
            Liveness::Gone => "gone",
        }
    }
}

/// One engine.
#[derive(Debug)]
pub struct EngineEntry {
    /// Its name.
    pub name: String,
    /// Its run (a restart starts over).
    pub run: u64,
    /// The reducer's state of this run.
    pub state: EngineState,
    /// Each seq once; holes.
    pub tracker: Tracker,
    /// When its last batch arrived.
    pub last_arrival: Instant,
    /// Its last batch's delay from publication to arrival.
    pub lag: Duration,
    /// Events applied in all.
    pub events: u64,
    /// Events per second over the last full second.
    pub rate: f64,
    /// Messages of this engine refused as damaged.
    pub refused: u64,
    /// Requests forgotten by the bounded request memory.
    pub requests_forgotten: u64,
    window: (Instant, u64),
    /// (tier, block) → its sequence hash, while registered.
    block_hash: HashMap<(Tier, BlockId), SequenceHash>,
    /// A request's device blocks, over all its allocations.
    request_blocks: HashMap<RequestId, RequestBlocks>,
    request_order: VecDeque<RequestId>,
    /// Bytes per block, as its transfers measured them (0 until one).
    bytes_per_block: u64,
}

impl EngineEntry {
    fn new(name: &str, run: u64, now: Instant) -> Self {
        EngineEntry {
            name: name.to_string(),
            run,
            state: EngineState::default(),
            tracker: Tracker::default(),
            last_arrival: now,
            lag: Duration::ZERO,
            events: 0,
            rate: 0.0,
            refused: 0,
            requests_forgotten: 0,
            window: (now, 0),
            block_hash: HashMap::new(),
            request_blocks: HashMap::new(),
            request_order: VecDeque::new(),
            bytes_per_block: 0,
        }
    }

    /// Live, paused, stale or gone at `now`.
    pub fn liveness(&self, now: Instant) -> Liveness {
        let quiet = now.saturating_duration_since(self.last_arrival);
        if quiet >= STALE_AFTER && self.state.paused_count() > 0 {
            return if quiet >= PAUSED_GONE_AFTER {
                Liveness::Gone
            } else {
                Liveness::Paused
            };
        }
        if quiet >= GONE_AFTER {
            Liveness::Gone
        } else if quiet >= STALE_AFTER {
            Liveness::Stale
        } else {
            Liveness::Live
        }
    }

    /// Requests not finished.
    pub fn requests_live(&self) -> usize {
        self.state
            .slots()
            .filter(|s| s.state != SlotState::Finished)
            .count()
    }

    /// Occupancy of `tier` (active + inactive over capacity), if known.
    pub fn occupancy(&self, tier: Tier) -> Option<f64> {
        let p = self.state.pool(tier);
        (p.capacity > 0).then(|| f64::from(p.active + p.inactive) / f64::from(p.capacity))
    }

    /// Prefix hit ratio of `tier` (blocks hit over blocks looked up).
    pub fn hit_ratio(&self, tier: Tier) -> Option<f64> {
        let p = self.state.pool(tier);
        (p.looked_up_blocks > 0).then(|| p.hit_blocks as f64 / p.looked_up_blocks as f64)
    }

    /// Events lost on the way: holes, seqs before the first seen, refused
    /// messages.
    pub fn losses(&self) -> u64 {
        self.tracker.missing() + self.refused
    }

    /// Bytes per block as measured by its transfers (0 until one).
    pub fn bytes_per_block(&self) -> u64 {
        self.bytes_per_block
    }

    /// The sequence hashes of `request`'s device blocks: as they were
    /// when it let go of them, or as registered now while it holds them.
    pub fn request_hashes(&self, request: &str) -> Option<Vec<SequenceHash>> {
        let r = self.request_blocks.get(request)?;
        Some(
            r.hashes
                .clone()
                .unwrap_or_else(|| device_hashes(&self.block_hash, &r.blocks)),
        )
    }

    /// Whether it holds `hash`, per tier.
    pub fn holds(&self, hash: SequenceHash) -> [bool; 3] {
        Tier::ALL.map(|t| self.state.registered(t).contains(&hash))
    }

    fn observe(&mut self, ev: &Event) {
        match &ev.kind {
            EventKind::BlockRegistered {
                tier,
                block,
                sequence_hash,
                ..
            } => {
                self.block_hash.insert((*tier, *block), *sequence_hash);
            }
            EventKind::BlockEvicted { tier, block, .. } => {
                self.block_hash.remove(&(*tier, *block));
            }
            EventKind::BlocksAllocated {
                tier: Tier::Device,
                blocks,
            } => {
                let Some(r) = &ev.request else { return };
                match self.request_blocks.get_mut(r) {
                    Some(held) => held.allocated(blocks),
                    None => {
                        let mut held = RequestBlocks::default();
                        held.allocated(blocks);
                        self.request_blocks.insert(r.clone(), held);
                        self.request_order.push_back(r.clone());
                    }
                }
                while self.request_order.len() > MAX_REQUESTS_REMEMBERED {
                    if let Some(old) = self.request_order.pop_front() {
                        self.request_blocks.remove(&old);
                        self.requests_forgotten += 1;
                    }
                }
            }
            EventKind::BlocksReleased {
                tier: Tier::Device,
                count,
            } => {
                let Some(r) = &ev.request else { return };
                let Some(held) = self.request_blocks.get_mut(r) else {
                    return;
                };
                if held.held <= u64::from(*count) {
                    // All let go: keep what they held, before the blocks
                    // are reused for other prefixes.
                    held.held = 0;
                    held.hashes = Some(device_hashes(&self.block_hash, &held.blocks));
                } else {
                    held.held -= u64::from(*count);
                }
            }
            EventKind::BatchCompleted {
                blocks,
                bytes,
                ok: true,
                ..
            } if *blocks > 0 => {
                self.bytes_per_block = bytes / u64::from(*blocks);
            }
            _ => {}
        }
    }
}

/// The hashes `blocks` (device blocks) are registered under now.
fn device_hashes(
    block_hash: &HashMap<(Tier, BlockId), SequenceHash>,
    blocks: &[BlockId],
) -> Vec<SequenceHash> {
    blocks
        .iter()
        .filter_map(|b| block_hash.get(&(Tier::Device, *b)).copied())
        .collect()
}

/// The device blocks one request holds or held: every allocation since it
/// last let go of all of them (an engine grows a decoding request a block
/// at a time, and a preempted one starts over).
#[derive(Debug, Default)]
struct RequestBlocks {
    blocks: Vec<BlockId>,
    /// Blocks held now (allocated less released).
    held: u64,
    /// Their hashes when it let go of all of them; `None` while it holds
    /// some.
    hashes: Option<Vec<SequenceHash>>,
}

impl RequestBlocks {
    fn allocated(&mut self, blocks: &[BlockId]) {
        if self.hashes.take().is_some() {
            self.blocks.clear(); // a new admission (after preemption)
        }
        self.blocks.extend_from_slice(blocks);
        self.held += blocks.len() as u64;
    }
}

/// A prefix cached on more than one engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Duplicate {
    /// The sequence hash.
    pub hash: SequenceHash,
    /// Engines holding it (any tier).
    pub engines: usize,
    /// Their names, up to a few.
    pub names: Vec<String>,
}

/// The cross-engine picture of cached prefixes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixIndex {
    /// Distinct hashes cached anywhere.
    pub distinct: u64,
    /// Hashes cached on two engines or more.
    pub duplicated: u64,
    /// Blocks beyond the first copy of each hash, summed.
    pub extra_copies: u64,
    /// The bytes of those copies, from each engine's measured block size
    /// (0 where none was measured yet).
    pub extra_bytes: u64,
    /// The most duplicated prefixes, most engines first.
    pub top: Vec<Duplicate>,
    /// Hashes not indexed (past [`MAX_INDEXED_HASHES`]).
    pub not_indexed: u64,
}

/// The fleet: every engine seen on the stream (at most [`MAX_ENGINES`]).
#[derive(Debug)]
pub struct FleetModel {
    engines: BTreeMap<String, EngineEntry>,
    max_engines: usize,
    /// Gone engines dropped to make room for new ones.
    pub engines_forgotten: u64,
    /// Batches not applied: their engine was new and no room could be
    /// made ([`MAX_ENGINES`] engines, none gone).
    pub batches_over_limit: u64,
    /// Messages refused with no engine to put them on.
    pub refused_unattributed: u64,
    /// The last refusal.
    pub last_refusal: Option<String>,
    /// Events applied, all engines.
    pub events: u64,
    prefixes: PrefixIndex,
}

impl Default for FleetModel {
    fn default() -> Self {
        FleetModel::with_max_engines(MAX_ENGINES)
    }
}

impl FleetModel {
    /// An empty fleet.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty fleet that keeps at most `max` engines (tests use a few).
    pub fn with_max_engines(max: usize) -> Self {
        FleetModel {
            engines: BTreeMap::new(),
            max_engines: max.max(1),
            engines_forgotten: 0,
            batches_over_limit: 0,
            refused_unattributed: 0,
            last_refusal: None,
            events: 0,
            prefixes: PrefixIndex::default(),
        }
    }

    /// Most engines kept at once.
    pub fn max_engines(&self) -> usize {
        self.max_engines
    }

    /// Engines by name.
    pub fn engines(&self) -> impl Iterator<Item = &EngineEntry> {
        self.engines.values()
    }

    /// One engine.
    pub fn engine(&self, name: &str) -> Option<&EngineEntry> {
        self.engines.get(name)
    }

    /// Engines seen.
    pub fn len(&self) -> usize {
        self.engines.len()
    }

    /// No engine seen yet.
    pub fn is_empty(&self) -> bool {
        self.engines.is_empty()
    }

    /// Applies one batch of `engine`, which arrived at `now`, `lag` after
    /// it was published. A new run replaces the engine's state.
    pub fn apply(
        &mut self,
        engine: &str,
        h: &BatchHeader,
        events: &[Event],
        now: Instant,
        lag: Duration,
    ) {
        if !self.engines.contains_key(engine) && self.engines.len() >= self.max_engines {
            let gone_longest = self
                .engines
                .values()
                .filter(|e| e.liveness(now) == Liveness::Gone)
                .min_by_key(|e| e.last_arrival)
                .map(|e| e.name.clone());
            match gone_longest {
                Some(name) => {
                    self.engines.remove(&name);
                    self.engines_forgotten += 1;
                }
                None => {
                    self.batches_over_limit += 1;
                    return;
                }
            }
        }
        let e = self
            .engines
            .entry(engine.to_string())
            .or_insert_with(|| EngineEntry::new(engine, h.run, now));
        if e.run != h.run {
            *e = EngineEntry::new(engine, h.run, now);
        }
        e.tracker.declared(h.dropped_before);
        e.last_arrival = now;
        e.lag = lag;
        for ev in events {
            if let Admit::Apply { .. } = e.tracker.admit(ev.seq) {
                e.state.apply(ev);
                e.observe(ev);
                e.events += 1;
                self.events += 1;
            }
        }
    }

    /// A message that was not a usable batch.
    pub fn refused(&mut self, engine: Option<&str>, why: String) {
        match engine.and_then(|e| self.engines.get_mut(e)) {
            Some(e) => e.refused += 1,
            None => self.refused_unattributed += 1,
        }
        self.last_refusal = Some(why);
    }

    /// The periodic step: rates, finished requests pruned, the prefix
    /// index rebuilt.
    pub fn tick(&mut self, now: Instant) {
        for e in self.engines.values_mut() {
            let (t0, n0) = e.window;
            let dt = now.saturating_duration_since(t0);
            if dt >= Duration::from_secs(1) {
                e.rate = (e.events - n0) as f64 / dt.as_secs_f64();
                e.window = (now, e.events);
            }
            let cutoff = e.state.last_ts_ns().saturating_sub(KEEP_FINISHED_NS);
            e.state.retain_finished_since(cutoff);
        }
        self.prefixes = self.index();
    }

    /// The cross-engine prefix picture as of the last tick.
    pub fn prefixes(&self) -> &PrefixIndex {
        &self.prefixes
    }

    fn index(&self) -> PrefixIndex {
        // hash → (engines holding it, copies, bytes of copies)
        let mut by_hash: HashMap<SequenceHash, (u32, u64, u64, Vec<u16>)> = HashMap::new();
        let mut not_indexed = 0u64;
        for (i, e) in self.engines.values().enumerate() {
            let mut mine: HashMap<SequenceHash, u64> = HashMap::new();
            for t in Tier::ALL {
                for h in e.state.registered(t) {
                    *mine.entry(*h).or_default() += 1;
                }
            }
            for (h, copies) in mine {
                if by_hash.len() >= MAX_INDEXED_HASHES && !by_hash.contains_key(&h) {
                    not_indexed += 1;
                    continue;
                }
                let s = by_hash.entry(h).or_default();
                s.0 += 1;
                s.1 += copies;
                s.2 += copies * e.bytes_per_block;
                if s.3.len() < 4 {
                    s.3.push(i as u16);
                }
            }
        }
        let names: Vec<&str> = self.engines.keys().map(String::as_str).collect();
        let mut idx = PrefixIndex {
            distinct: by_hash.len() as u64,
            not_indexed,
            ..PrefixIndex::default()
        };
        let mut dups: Vec<(SequenceHash, u32, Vec<u16>)> = Vec::new();
        for (h, (engines, copies, bytes, who)) in by_hash {
            if engines >= 2 {
                idx.duplicated += 1;
                idx.extra_copies += copies - 1;
                idx.extra_bytes += bytes - bytes / copies.max(1);
                dups.push((h, engines, who));
            }
        }
        dups.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.0.cmp(&b.0.0)));
        idx.top = dups
            .into_iter()
            .take(50)
            .map(|(hash, engines, who)| Duplicate {
                hash,
                engines: engines as usize,
                names: who.iter().map(|i| names[*i as usize].to_string()).collect(),
            })
            .collect();
        idx
    }

    /// "Where is this prefix": `query` is a sequence hash (`0x…` or
    /// decimal), a request id, or `ENGINE/REQUEST` for the request of that
    /// engine. For a request, its device blocks' hashes on the engine that
    /// served it are the prefix; engines name their requests on their own,
    /// so when several served one by that id, the longest one's prefix is
    /// taken and `prefix_of` says whose. Returns the prefix length in
    /// blocks and, per engine holding any of it, the blocks held (any
    /// tier) and per tier.
    pub fn locate(&self, query: &str) -> Located {
        let q = query.trim();
        let hash = q
            .strip_prefix("0x")
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .or_else(|| q.parse::<u64>().ok())
            .map(SequenceHash);
        // `ENGINE/REQUEST`, when ENGINE is one: request ids may hold '/'.
        let (only, request) = match q.split_once('/') {
            Some((engine, r)) if self.engines.values().any(|e| e.name == engine) => {
                (Some(engine), r)
            }
            _ => (None, q),
        };
        let mut prefix_of = None;
        let (prefix, served_by): (Vec<SequenceHash>, Vec<String>) = match hash {
            Some(h) => (vec![h], Vec::new()),
            None => {
                let mut served = Vec::new();
                let mut prefix = Vec::new();
                for e in self.engines.values() {
                    if only.is_some_and(|o| o != e.name) {
                        continue;
                    }
                    if let Some(hs) = e.request_hashes(request) {
                        served.push(e.name.clone());
                        if hs.len() > prefix.len() || prefix_of.is_none() {
                            prefix = hs;
                            prefix_of = Some(e.name.clone());
                        }
                    }
                }
                (prefix, served)
            }
        };
        let mut rows = Vec::new();
        for e in self.engines.values() {
            let mut per_tier = [0u64; 3];
            let mut any = 0u64;
            for h in &prefix {
                let held = e.holds(*h);
                for (i, x) in held.iter().enumerate() {
                    per_tier[i] += u64::from(*x);
                }
                any += u64::from(held.iter().any(|x| *x));
            }
            if any > 0 {
                rows.push(LocatedRow {
                    engine: e.name.clone(),
                    blocks: any,
                    per_tier,
                    bytes: any * e.bytes_per_block,
                });
            }
        }
        rows.sort_by(|a, b| b.blocks.cmp(&a.blocks).then(a.engine.cmp(&b.engine)));
        Located {
            query: q.to_string(),
            prefix_blocks: prefix.len() as u64,
            served_by,
            prefix_of,
            rows,
            requests_forgotten: self.engines.values().map(|e| e.requests_forgotten).sum(),
        }
    }
}

/// The answer to "where is this prefix".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Located {
    /// What was asked.
    pub query: String,
    /// Blocks in the prefix (1 for a hash; 0 for an unknown request).
    pub prefix_blocks: u64,
    /// Engines that served the request (empty for a hash).
    pub served_by: Vec<String>,
    /// The engine whose request's prefix this is (for a request).
    pub prefix_of: Option<String>,
    /// Engines holding any of it, most first.
    pub rows: Vec<LocatedRow>,
    /// Requests the engines have forgotten (past
    /// [`MAX_REQUESTS_REMEMBERED`] each): a request id not found may be
    /// one of them.
    pub requests_forgotten: u64,
}

/// One engine's share of a prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocatedRow {
    /// The engine.
    pub engine: String,
    /// Blocks of the prefix it holds (on any tier).
    pub blocks: u64,
    /// Per tier (G1, G2, G3).
    pub per_tier: [u64; 3],
    /// Bytes, from its measured block size.
    pub bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(seq: u64, request: Option<&str>, kind: EventKind) -> Event {
        Event {
            engine: 0,
            seq,
            ts_ns: seq,
            iteration: 0,
            request: request.map(Into::into),
            kind,
        }
    }

    fn reg(seq: u64, tier: Tier, block: u32, hash: u64) -> Event {
        ev(
            seq,
            None,
            EventKind::BlockRegistered {
                tier,
                block,
                sequence_hash: SequenceHash(hash),
                duplicate_of: None,
            },
        )
    }

    fn header(run: u64, events: &[Event]) -> BatchHeader {
        BatchHeader {
            run,
            first_seq: events[0].seq,
            last_seq: events.last().unwrap().seq,
            count: events.len() as u32,
            dropped_before: 0,
        }
    }

    #[test]
    fn duplicated_prefixes_and_where_a_request_prefix_lives() {
        let mut m = FleetModel::new();
        let now = Instant::now();
        let a = vec![
            ev(
                0,
                Some("r1"),
                EventKind::BlocksAllocated {
                    tier: Tier::Device,
                    blocks: vec![1, 2],
                },
            ),
            reg(1, Tier::Device, 1, 100),
            reg(2, Tier::Device, 2, 200),
            reg(3, Tier::Host, 9, 100),
        ];
        m.apply("a", &header(1, &a), &a, now, Duration::ZERO);
        let b = vec![reg(0, Tier::Device, 5, 100), reg(1, Tier::Device, 6, 300)];
        m.apply("b", &header(2, &b), &b, now, Duration::ZERO);
        // Redelivered: applied once.
        m.apply("b", &header(2, &b), &b, now, Duration::ZERO);
        assert_eq!(m.engine("b").unwrap().events, 2);
        m.tick(now);
        let p = m.prefixes();
        assert_eq!((p.distinct, p.duplicated), (3, 1));
        assert_eq!(p.top[0].hash, SequenceHash(100));
        assert_eq!(p.top[0].names, ["a", "b"]);
        // a holds hash 100 twice (G1 and G2), b once: two extra copies.
        assert_eq!(p.extra_copies, 2);

        let l = m.locate("r1");
        assert_eq!(l.prefix_blocks, 2);
        assert_eq!(l.served_by, ["a"]);
        assert_eq!(l.rows[0].engine, "a");
        assert_eq!(l.rows[0].blocks, 2);
        assert_eq!(l.rows[0].per_tier, [2, 1, 0]);
        assert_eq!(l.rows[1].engine, "b");
        assert_eq!(l.rows[1].blocks, 1);
        let l = m.locate("0x12c"); // 300
        assert_eq!(l.rows.len(), 1);
        assert_eq!(l.rows[0].engine, "b");
        assert!(m.locate("nobody").rows.is_empty());
        assert_eq!(m.locate("nobody").requests_forgotten, 0);
        // b serves a request of the same id, of one block (hash 300):
        // "r1" takes the longer (a's) and says so; "b/r1" is b's.
        let c = vec![ev(
            2,
            Some("r1"),
            EventKind::BlocksAllocated {
                tier: Tier::Device,
                blocks: vec![6],
            },
        )];
        m.apply("b", &header(2, &c), &c, now, Duration::ZERO);
        let l = m.locate("r1");
        assert_eq!(l.served_by, ["a", "b"]);
        assert_eq!((l.prefix_of.as_deref(), l.prefix_blocks), (Some("a"), 2));
        let l = m.locate("b/r1");
        assert_eq!(l.served_by, ["b"]);
        assert_eq!((l.prefix_of.as_deref(), l.prefix_blocks), (Some("b"), 1));
        assert_eq!(l.rows.len(), 1);
        assert_eq!(l.rows[0].engine, "b");
        assert!(
            m.locate("zz/r1").rows.is_empty(),
            "no engine zz: a request id"
        );
    }

    #[test]
    fn requests_past_the_memory_are_forgotten_and_counted() {
        let mut m = FleetModel::new();
        let now = Instant::now();
        let n = MAX_REQUESTS_REMEMBERED + 3;
        let evs: Vec<Event> = (0..n)
            .map(|i| {
                ev(
                    i as u64,
                    Some(&format!("r{i}")),
                    EventKind::BlocksAllocated {
                        tier: Tier::Device,
                        blocks: vec![1],
                    },
                )
            })
            .collect();
        m.apply("a", &header(1, &evs), &evs, now, Duration::ZERO);
        assert_eq!(m.engine("a").unwrap().requests_forgotten, 3);
        // The oldest are gone, the newest kept; the answer says how many
        // were forgotten, so "not found" is not taken for "never seen".
        let l = m.locate("r0");
        assert_eq!((l.prefix_blocks, l.requests_forgotten), (0, 3));
        assert_eq!(m.locate(&format!("r{}", n - 1)).served_by, ["a"]);
    }

    #[test]
    fn a_request_prefix_spans_its_allocations_and_outlives_its_blocks() {
        let mut m = FleetModel::new();
        let now = Instant::now();
        let alloc = |seq, blocks: Vec<u32>| {
            ev(
                seq,
                Some("r1"),
                EventKind::BlocksAllocated {
                    tier: Tier::Device,
                    blocks,
                },
            )
        };
        let release = |seq, count| {
            ev(
                seq,
                Some("r1"),
                EventKind::BlocksReleased {
                    tier: Tier::Device,
                    count,
                },
            )
        };
        // Admitted with two blocks, grown by one as it decodes; the
        // prefix is all three, not the last allocation.
        let a = vec![
            alloc(0, vec![1, 2]),
            reg(1, Tier::Device, 1, 100),
            reg(2, Tier::Device, 2, 200),
            alloc(3, vec![3]),
            reg(4, Tier::Device, 3, 300),
        ];
        m.apply("a", &header(1, &a), &a, now, Duration::ZERO);
        assert_eq!(m.locate("r1").prefix_blocks, 3);
        // It finishes; block 1 is evicted and reused for another prefix:
        // r1's prefix is still what it held.
        let b = vec![
            release(5, 3),
            ev(
                6,
                None,
                EventKind::BlockEvicted {
                    tier: Tier::Device,
                    block: 1,
                    sequence_hash: SequenceHash(100),
                },
            ),
            reg(7, Tier::Device, 1, 900),
        ];
        m.apply("a", &header(1, &b), &b, now, Duration::ZERO);
        let l = m.locate("r1");
        assert_eq!(l.prefix_blocks, 3);
        assert_eq!(
            l.rows[0].blocks, 2,
            "hash 100 was evicted: 200 and 300 remain"
        );
        // Preempted and admitted again: a new allocation starts over.
        let c = vec![alloc(8, vec![7]), reg(9, Tier::Device, 7, 700)];
        m.apply("a", &header(1, &c), &c, now, Duration::ZERO);
        assert_eq!(m.locate("r1").prefix_blocks, 1);
    }

    #[test]
    fn engines_are_bounded_and_the_one_gone_longest_makes_room() {
        let mut m = FleetModel::with_max_engines(3);
        let t0 = Instant::now();
        let one = vec![reg(0, Tier::Device, 1, 1)];
        let h = header(1, &one);
        for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
            m.apply(
                name,
                &h,
                &one,
                t0 + Duration::from_secs(i as u64),
                Duration::ZERO,
            );
        }
        // Full, none gone: a new engine's batch is counted, not applied;
        // the engines it has keep their batches.
        m.apply("d", &h, &one, t0 + Duration::from_secs(3), Duration::ZERO);
        assert_eq!((m.len(), m.batches_over_limit), (3, 1));
        assert!(m.engine("d").is_none());
        let two = vec![reg(1, Tier::Device, 2, 2)];
        m.apply(
            "b",
            &header(1, &two),
            &two,
            t0 + Duration::from_secs(4),
            Duration::ZERO,
        );
        assert_eq!(m.engine("b").unwrap().events, 2);
        // Later, "a" and "c" are gone: the one quiet longest ("a") goes.
        let later = t0 + GONE_AFTER + Duration::from_secs(3);
        m.apply("d", &h, &one, later, Duration::ZERO);
        assert_eq!((m.len(), m.engines_forgotten), (3, 1));
        assert!(m.engine("a").is_none() && m.engine("c").is_some() && m.engine("d").is_some());
    }

    #[test]
    fn engines_go_stale_then_gone_and_a_new_run_starts_over() {
        let mut m = FleetModel::new();
        let t0 = Instant::now();
        let a = vec![reg(0, Tier::Device, 1, 1), reg(5, Tier::Device, 2, 2)];
        m.apply("a", &header(1, &a), &a, t0, Duration::ZERO);
        let e = m.engine("a").unwrap();
        assert_eq!(e.losses(), 4);
        assert_eq!(e.liveness(t0), Liveness::Live);
        assert_eq!(e.liveness(t0 + STALE_AFTER), Liveness::Stale);
        assert_eq!(e.liveness(t0 + GONE_AFTER), Liveness::Gone);
        // A call paused at a breakpoint: the engine waits, quiet, and is
        // paused (not stale, not gone) until PAUSED_GONE_AFTER.
        let hit = |seq| Event {
            engine: 0,
            seq,
            ts_ns: seq,
            iteration: 0,
            request: Some("r".into()),
            kind: EventKind::BreakpointHit {
                breakpoint: 1,
                entry: kvbm_events::EntryPoint::GetNumNewMatchedTokens,
                deadline_ns: u64::MAX,
            },
        };
        let p = vec![hit(6)];
        m.apply("a", &header(1, &p), &p, t0, Duration::ZERO);
        let e = m.engine("a").unwrap();
        assert_eq!(e.state.paused_count(), 1);
        assert_eq!(e.liveness(t0), Liveness::Live);
        assert_eq!(e.liveness(t0 + STALE_AFTER), Liveness::Paused);
        assert_eq!(e.liveness(t0 + GONE_AFTER), Liveness::Paused);
        assert_eq!(e.liveness(t0 + PAUSED_GONE_AFTER), Liveness::Gone);
        let b = vec![reg(0, Tier::Device, 1, 1)];
        m.apply("a", &header(2, &b), &b, t0, Duration::ZERO);
        assert_eq!(m.engine("a").unwrap().events, 1);
        assert_eq!(m.engine("a").unwrap().losses(), 0);
    }
}
