//! Why each miss missed.
//!
//! A request's first lookup (its `PrefixLookup`, then the host and disk
//! `MatchResult`s that follow it) hits a prefix of its blocks, tier by
//! tier; every other token of the prompt was computed, for one of these
//! reasons, decided from the events before the lookup:
//!
//! - **cold**: no earlier request had the block and no tier ever held it;
//! - **evicted**: a tier held it and the last copy was evicted (which
//!   tier, when, and how many distinct blocks were looked up since it was
//!   last used: the capacity that would have kept it);
//! - **in flight**: another request that is still running looked it up
//!   and had not stored it yet — computing it at that moment; the
//!   concurrency misses that make an overloaded engine miss what its cache
//!   could hold;
//! - **behind a miss**: a tier held it, but an earlier block of the prompt
//!   missed, and a prefix lookup stops at the first miss;
//! - **never stored**: an earlier request looked it up but no tier ever
//!   registered it, and no running request is computing it;
//! - **last block**: the full block holding the prompt's last token, which
//!   the engine always computes;
//! - **partial**: the tokens after the last full block, which are never
//!   cached.
//!
//! Later lookups of the same request (asked again while it waits to be
//! admitted, or after a preemption) are kept per
//! request for the request detail, and counted apart.

use super::stack::KeyMap;
use kvbm_events::tier::Tier;
use kvbm_events::{RequestId, SequenceHash};
use serde::Serialize;
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;

/// Requests finished whose lookups are kept for the detail view.
const KEEP_FINISHED: usize = 4096;
/// Lookups kept per request (the latest; older ones are dropped).
pub const KEEP_LOOKUPS: usize = 8;

/// Why one block missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum MissReason {
    /// Never seen before.
    Cold,
    /// The last tier holding it evicted it.
    Evicted {
        /// That tier.
        tier: Tier,
        /// When, engine ns.
        at_ns: u64,
        /// Distinct blocks looked up since its last use, when known
        /// (unknown for blocks a sampled curve skipped).
        distance_blocks: Option<u64>,
    },
    /// Another running request was computing it.
    InFlight,
    /// Cached, but a block before it missed.
    BehindMiss,
    /// Looked up before, never stored.
    NeverStored,
    /// The block holding the prompt's last token.
    LastBlock,
    /// Tokens after the last full block.
    Partial,
}

impl MissReason {
    /// Short name.
    pub fn name(&self) -> &'static str {
        match self {
            MissReason::Cold => "cold",
            MissReason::Evicted { .. } => "evicted",
            MissReason::InFlight => "in flight",
            MissReason::BehindMiss => "behind a miss",
            MissReason::NeverStored => "never stored",
            MissReason::LastBlock => "last block",
            MissReason::Partial => "partial",
        }
    }
}

impl fmt::Display for MissReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MissReason::Evicted {
                tier,
                at_ns,
                distance_blocks,
            } => {
                write!(
                    f,
                    "evicted from {} at {:.3} s",
                    tier.short_name(),
                    *at_ns as f64 / 1e9
                )?;
                if let Some(d) = distance_blocks {
                    write!(f, ", {d} distinct blocks since its last use")?;
                }
                Ok(())
            }
            other => f.write_str(other.name()),
        }
    }
}

/// Tokens by outcome, over first lookups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReasonTotals {
    /// Lookups counted.
    pub lookups: u64,
    /// Prompt tokens of those lookups.
    pub prompt_tokens: u64,
    /// Hit tokens per tier (G1, G2, G3).
    pub hit_tokens: [u64; 3],
    /// Cold tokens.
    pub cold: u64,
    /// Evicted tokens, by the tier that evicted them last.
    pub evicted: [u64; 3],
    /// In-flight tokens.
    pub in_flight: u64,
    /// Behind-a-miss tokens.
    pub behind_miss: u64,
    /// Never-stored tokens.
    pub never_stored: u64,
    /// Last-block tokens.
    pub last_block: u64,
    /// Partial-block tokens.
    pub partial: u64,
}

impl ReasonTotals {
    fn add(&mut self, o: &ReasonTotals) {
        self.lookups += o.lookups;
        self.prompt_tokens += o.prompt_tokens;
        for i in 0..3 {
            self.hit_tokens[i] += o.hit_tokens[i];
            self.evicted[i] += o.evicted[i];
        }
        self.cold += o.cold;
        self.in_flight += o.in_flight;
        self.behind_miss += o.behind_miss;
        self.never_stored += o.never_stored;
        self.last_block += o.last_block;
        self.partial += o.partial;
    }

    fn count(&mut self, r: &MissReason, tokens: u64) {
        match r {
            MissReason::Cold => self.cold += tokens,
            MissReason::Evicted { tier, .. } => self.evicted[tier.index()] += tokens,
            MissReason::InFlight => self.in_flight += tokens,
            MissReason::BehindMiss => self.behind_miss += tokens,
            MissReason::NeverStored => self.never_stored += tokens,
            MissReason::LastBlock => self.last_block += tokens,
            MissReason::Partial => self.partial += tokens,
        }
    }

    /// Hit tokens on every tier.
    pub fn hits(&self) -> u64 {
        self.hit_tokens.iter().sum()
    }

    /// Missed tokens for any reason.
    pub fn misses(&self) -> u64 {
        self.cold
            + self.evicted.iter().sum::<u64>()
            + self.in_flight
            + self.behind_miss
            + self.never_stored
            + self.last_block
            + self.partial
    }

    /// `(name, tokens)` of every miss reason, in a fixed order.
    pub fn reasons(&self) -> [(&'static str, u64); 9] {
        [
            ("cold", self.cold),
            ("evicted from G1", self.evicted[0]),
            ("evicted from G2", self.evicted[1]),
            ("evicted from G3", self.evicted[2]),
            ("in flight", self.in_flight),
            ("behind a miss", self.behind_miss),
            ("never stored", self.never_stored),
            ("last block", self.last_block),
            ("partial", self.partial),
        ]
    }
}

/// What a `PrefixLookup` says.
#[derive(Debug, Clone, Copy)]
pub struct LookupBlocks<'a> {
    /// Tokens of the request.
    pub tokens: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Leading blocks G1 held.
    pub computed_blocks: u32,
    /// Its full blocks' hashes.
    pub hashes: &'a [u64],
}

/// One lookup of one request, explained.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Lookup {
    /// Engine time of the lookup.
    pub ts_ns: u64,
    /// The request's first lookup (the one the curve counts).
    pub first: bool,
    /// Blocks hit per tier.
    pub hit_blocks: [u32; 3],
    /// Blocks a lookup could hit.
    pub matchable_blocks: u32,
    /// Why the lookup stopped where it did (none when every matchable
    /// block hit).
    pub stopped: Option<MissReason>,
    /// Tokens by outcome.
    pub totals: ReasonTotals,
}

/// What is known of one block.
#[derive(Debug, Clone, Copy, Default)]
struct BlockState {
    /// Tiers holding it (bit per tier).
    present: u8,
    /// The request computing it (an index into `live`), when one is.
    pending: Option<u32>,
    /// The last eviction that left no tier holding it.
    evicted: Option<(Tier, u64)>,
}

#[derive(Debug, Clone)]
struct RequestState {
    index: u32,
    tokens: u32,
    block_size: u32,
    hashes: Arc<[u64]>,
    /// The open lookup: its tier results so far.
    open: Option<OpenLookup>,
    lookups: VecDeque<Lookup>,
    /// Later lookups (after the first).
    relookups: u64,
}

#[derive(Debug, Clone)]
struct OpenLookup {
    ts_ns: u64,
    first: bool,
    /// Device hits the engine reported (first lookup) or found.
    device_hits: u32,
    /// (tier, looked up, hit) in order.
    tiers: Vec<(Tier, u32, u32)>,
    /// Classified when the lookup opened (the state before it).
    reasons: Vec<MissReason>,
}

/// The miss-reason bookkeeping. See the module docs.
#[derive(Debug, Clone, Default)]
pub struct Reasons {
    blocks: KeyMap<BlockState>,
    requests: HashMap<RequestId, RequestState>,
    live: HashSet<u32>,
    finished: VecDeque<RequestId>,
    next_index: u32,
    totals: ReasonTotals,
    relookups: u64,
    /// Blocks whose state was not tracked because the cap was reached.
    untracked: u64,
    max_blocks: Option<usize>,
}

impl Reasons {
    /// Tracks at most `max_blocks` blocks (`None`: no cap).
    pub fn new(max_blocks: Option<usize>) -> Self {
        Reasons {
            max_blocks,
            ..Reasons::default()
        }
    }

    fn block_mut(&mut self, h: u64) -> Option<&mut BlockState> {
        if !self.blocks.contains_key(&h) && self.max_blocks.is_some_and(|m| self.blocks.len() >= m)
        {
            self.untracked += 1;
            return None;
        }
        Some(self.blocks.entry(h).or_default())
    }

    /// A tier registered `h`.
    pub fn registered(&mut self, tier: Tier, h: SequenceHash) {
        if let Some(b) = self.block_mut(h.0) {
            b.present |= 1 << tier.index();
            b.pending = None;
        }
    }

    /// A tier evicted `h`.
    pub fn evicted(&mut self, tier: Tier, h: SequenceHash, ts_ns: u64) {
        if let Some(b) = self.blocks.get_mut(&h.0) {
            b.present &= !(1 << tier.index());
            if b.present == 0 {
                b.evicted = Some((tier, ts_ns));
            }
        }
    }

    /// A request's slot was created (or reused).
    pub fn created(&mut self, request: &RequestId) {
        self.close(request);
        if let Some(r) = self.requests.remove(request) {
            self.live.remove(&r.index);
        }
    }

    /// A request finished: what it was computing is no longer in flight.
    pub fn finished(&mut self, request: &RequestId) {
        self.close(request);
        if let Some(r) = self.requests.get(request) {
            self.live.remove(&r.index);
            self.finished.push_back(request.clone());
            while self.finished.len() > KEEP_FINISHED {
                if let Some(old) = self.finished.pop_front()
                    && self
                        .requests
                        .get(&old)
                        .is_some_and(|r| !self.live.contains(&r.index))
                {
                    self.requests.remove(&old);
                }
            }
        }
    }

    /// Any other event of `request` closes its open lookup.
    pub fn other_event(&mut self, request: &RequestId) {
        if self.requests.get(request).is_some_and(|r| r.open.is_some()) {
            self.close(request);
        }
    }

    /// The request's first lookup: its blocks and the engine's own (G1)
    /// hits; `distances` are the curve's, block by block.
    pub fn prefix_lookup(
        &mut self,
        request: &RequestId,
        ts_ns: u64,
        l: &LookupBlocks<'_>,
        distances: &[Option<u64>],
    ) {
        let LookupBlocks {
            tokens,
            block_size,
            computed_blocks,
            hashes,
        } = *l;
        self.close(request);
        let index = self.next_index;
        self.next_index = self.next_index.wrapping_add(1);
        self.live.insert(index);
        let hashes: Arc<[u64]> = hashes.into();
        let matchable = matchable(tokens, block_size, hashes.len());
        let device_hits = computed_blocks.min(matchable as u32);
        let reasons = self.classify(&hashes, distances, device_hits as usize, matchable, index);
        // What nobody holds, this request will compute.
        for &h in hashes.iter() {
            if let Some(b) = self.block_mut(h)
                && b.present == 0
                && b.pending.is_none()
            {
                b.pending = Some(index);
            }
        }
        if let Some(old) = self.requests.get(request) {
            self.live.remove(&old.index);
        }
        self.requests.insert(
            request.clone(),
            RequestState {
                index,
                tokens,
                block_size,
                hashes,
                open: Some(OpenLookup {
                    ts_ns,
                    first: true,
                    device_hits,
                    tiers: Vec::new(),
                    reasons,
                }),
                lookups: VecDeque::new(),
                relookups: 0,
            },
        );
    }

    /// One tier's result of a lookup of `request`.
    pub fn match_result(
        &mut self,
        request: &RequestId,
        ts_ns: u64,
        tier: Tier,
        looked_up: u32,
        hit_blocks: u32,
    ) {
        let Some(r) = self.requests.get(request) else {
            return;
        };
        let continues = r.open.as_ref().is_some_and(|o| {
            tier != Tier::Device && o.tiers.last().is_none_or(|(t, _, _)| *t < tier)
        });
        if !continues {
            // A later lookup (asked again while it waits to be admitted,
            // or after a preemption): classified now, against
            // the state before it.
            self.close(request);
            let Some(r) = self.requests.get(request) else {
                return;
            };
            let m = matchable(r.tokens, r.block_size, r.hashes.len());
            let start = (m as u32).saturating_sub(looked_up);
            let device_hits = if tier == Tier::Device { 0 } else { start };
            let (hashes, index) = (r.hashes.clone(), r.index);
            let none = vec![None; hashes.len()];
            let reasons = self.classify(&hashes, &none, device_hits as usize, m, index);
            if let Some(r) = self.requests.get_mut(request) {
                r.relookups += 1;
                r.open = Some(OpenLookup {
                    ts_ns,
                    first: false,
                    device_hits,
                    tiers: Vec::new(),
                    reasons,
                });
            }
            self.relookups += 1;
        }
        if let Some(o) = self.requests.get_mut(request).and_then(|r| r.open.as_mut()) {
            o.tiers.push((tier, looked_up, hit_blocks));
        }
    }

    /// Each block's reason if it were to miss, from block `from` on
    /// (blocks before it are the device's hits).
    fn classify(
        &self,
        hashes: &[u64],
        distances: &[Option<u64>],
        from: usize,
        matchable: usize,
        me: u32,
    ) -> Vec<MissReason> {
        let mut out = Vec::with_capacity(hashes.len());
        for (j, &h) in hashes.iter().enumerate() {
            if j < from {
                out.push(MissReason::BehindMiss); // not used: hit on G1
                continue;
            }
            if j >= matchable {
                out.push(MissReason::LastBlock);
                continue;
            }
            let r = match self.blocks.get(&h) {
                None => MissReason::Cold,
                Some(b) if b.present != 0 => MissReason::BehindMiss,
                Some(b) if b.pending.is_some_and(|p| p != me && self.live.contains(&p)) => {
                    MissReason::InFlight
                }
                Some(b) => match b.evicted {
                    Some((tier, at_ns)) => MissReason::Evicted {
                        tier,
                        at_ns,
                        distance_blocks: distances.get(j).copied().flatten(),
                    },
                    None => MissReason::NeverStored,
                },
            };
            out.push(r);
        }
        out
    }

    /// Finishes the open lookup of `request`, if any.
    fn close(&mut self, request: &RequestId) {
        let Some(r) = self.requests.get_mut(request) else {
            return;
        };
        let Some(open) = r.open.take() else { return };
        let lookup = explain(r, &open);
        if open.first {
            self.totals.add(&lookup.totals);
        }
        r.lookups.push_back(lookup);
        while r.lookups.len() > KEEP_LOOKUPS {
            r.lookups.pop_front();
        }
    }

    /// Totals over first lookups, the open ones included.
    pub fn totals(&self) -> ReasonTotals {
        let mut t = self.totals;
        for r in self.requests.values() {
            if let Some(o) = &r.open
                && o.first
            {
                t.add(&explain(r, o).totals);
            }
        }
        t
    }

    /// Lookups after the first (asked again while waiting, or after a
    /// preemption).
    pub fn relookups(&self) -> u64 {
        self.relookups
    }

    /// Blocks not tracked because of the cap.
    pub fn untracked(&self) -> u64 {
        self.untracked
    }

    /// The lookups of `request`, oldest first (the open one last).
    pub fn lookups(&self, request: &str) -> Vec<Lookup> {
        let Some(r) = self.requests.get(request) else {
            return Vec::new();
        };
        let mut v: Vec<Lookup> = r.lookups.iter().cloned().collect();
        if let Some(o) = &r.open {
            v.push(explain(r, o));
        }
        v
    }
}

fn matchable(tokens: u32, block_size: u32, blocks: usize) -> usize {
    if block_size == 0 {
        return 0;
    }
    ((tokens.saturating_sub(1) / block_size) as usize).min(blocks)
}

/// A lookup's outcome from its tier results and its classification.
fn explain(r: &RequestState, o: &OpenLookup) -> Lookup {
    let bs = u64::from(r.block_size);
    let m = matchable(r.tokens, r.block_size, r.hashes.len()) as u32;
    let mut hit_blocks = [0u32; 3];
    hit_blocks[0] = o.device_hits;
    let mut covered = o.device_hits;
    for &(tier, looked_up, hit) in &o.tiers {
        let start = m.saturating_sub(looked_up);
        // Each tier continues where the one before stopped; anything else
        // is a stream that contradicts itself, read as far as it goes.
        if start != covered && tier != Tier::Device {
            covered = covered.max(start);
        }
        let hit = hit.min(m.saturating_sub(covered));
        hit_blocks[tier.index()] += hit;
        covered += hit;
    }
    let covered = covered.min(m) as usize;
    let mut totals = ReasonTotals {
        lookups: 1,
        prompt_tokens: u64::from(r.tokens),
        ..ReasonTotals::default()
    };
    for (i, h) in hit_blocks.iter().enumerate() {
        totals.hit_tokens[i] = u64::from(*h) * bs;
    }
    let mut stopped = None;
    for (j, reason) in o.reasons.iter().enumerate().skip(covered) {
        totals.count(reason, bs);
        if stopped.is_none() && j < m as usize {
            stopped = Some(*reason);
        }
    }
    let full = r.hashes.len() as u64 * bs;
    let partial = u64::from(r.tokens).saturating_sub(full);
    if partial > 0 {
        totals.count(&MissReason::Partial, partial);
    }
    Lookup {
        ts_ns: o.ts_ns,
        first: o.first,
        hit_blocks,
        matchable_blocks: m,
        stopped,
        totals,
    }
}
