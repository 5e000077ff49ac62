//! Turning decoded KV events into kvbm events.
//!
//! Blocks are keyed by hash per tier: a hash is live on a tier while any
//! *holder* holds it, a holder being a (medium, KV-cache group) pair.
//! Hybrid models publish the same hash in several groups (`group_idx`),
//! and one group removing it leaves it live in the others; SGLang's DISK
//! and EXTERNAL share G3 the same way. (Keying kvbm blocks by group instead
//! would show one hash several times in a tier whose registered set is a
//! set of hashes.)
//!
//! - `BlockStored` → one `BlockRegistered {tier, block, sequence_hash,
//!   duplicate_of: None}` per hash not yet live on that tier; a hash
//!   already live gives `duplicate_of: Some(its block)` instead (vLLM
//!   re-announces a block stored again, and another group or medium storing
//!   it is another registration of the same block), and its holder joins.
//! - `BlockRemoved` → its holder leaves; when it was the last, one
//!   `BlockEvicted`. Removed while another holder remains: nothing emitted,
//!   counted in [`TranslateCounters::still_held`]. A hash (or holder) this
//!   source never saw stored (stored before it subscribed, or lost in a
//!   gap) is counted in [`TranslateCounters::removed_unknown`] and emits
//!   nothing, so the reducer never sees an eviction of an unregistered block.
//!   A store or removal without `group_idx` stands for every group of its
//!   medium.
//! - `AllBlocksCleared` → every holder of that medium leaves; one
//!   `BlockEvicted` per hash left with none.
//! - After each batch, one `PoolGauge` per tier whose live count changed:
//!   `active` = live blocks, `capacity`, `inactive` and `empty` 0 (vLLM does
//!   not publish its pool sizes; the Pools view then shows "no capacity"
//!   with the live count).
//!
//! vLLM has no block ids: each tier numbers the blocks it registers (u32,
//! wrapping). The live set of each tier is bounded
//! ([`TranslatorConfig::max_live_per_tier`]); when full, its oldest block is
//! evicted (a `BlockEvicted` is emitted, so the reducer stays consistent)
//! and counted in [`TranslateCounters::bound_evicted`].
//!
//! The envelope: the configured engine id, this source's own seq (0, 1, 2,
//! ..., not the publisher's), gapless except that each publisher batch lost
//! for good ([`Translator::skip`]) leaves one hole, so a recording's losses
//! line up with the holes in its seq as the log checks expect; `ts_ns` from the batch's `ts` (seconds → ns, never going
//! back: a batch older than the last keeps the last time), iteration 0, no
//! request.

use super::decode::{KvBatch, KvEvent, Medium};
use kvbm_events::SequenceHash;
use kvbm_events::tier::{BlockId, Tier};
use kvbm_events::{Event, EventKind};
use serde::Serialize;
use std::collections::{HashMap, VecDeque};

/// How a [`Translator`] stamps and bounds.
#[derive(Debug, Clone, Copy)]
pub struct TranslatorConfig {
    /// Engine id in the envelope.
    pub engine: u32,
    /// Live hashes kept per tier (≥ 1).
    pub max_live_per_tier: usize,
}

impl Default for TranslatorConfig {
    fn default() -> Self {
        TranslatorConfig {
            engine: 0,
            max_live_per_tier: 1 << 20,
        }
    }
}

/// What the translator did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TranslateCounters {
    /// Batches translated.
    pub batches: u64,
    /// kvbm events produced.
    pub events: u64,
    /// `BlockRegistered` with `duplicate_of: None`.
    pub registered: u64,
    /// Stored hashes already live on their tier (the same holder again, or
    /// another group or medium).
    pub duplicates: u64,
    /// `BlockEvicted` for removed hashes.
    pub evicted: u64,
    /// `BlockEvicted` for `AllBlocksCleared`.
    pub cleared: u64,
    /// Removed hashes that were not live, or not held by the removing
    /// group and medium (nothing emitted).
    pub removed_unknown: u64,
    /// Removals that left the hash live because another group or medium
    /// still holds it (nothing emitted).
    pub still_held: u64,
    /// Stores by a holder past [`MAX_HOLDERS`] of one hash (the hash stays
    /// live; that holder is not tracked).
    pub holders_overflow: u64,
    /// Oldest blocks evicted because a tier's live set was full.
    pub bound_evicted: u64,
    /// Publisher restarts (every live block evicted).
    pub restarts: u64,
    /// Batch timestamps not taken: not a positive number, or more than
    /// [`MAX_CLOCK_AHEAD`] past this machine's clock. Their events keep
    /// the time before, so one bad stamp cannot throw the rest of the
    /// timeline into the far future.
    pub bad_timestamps: u64,
}

/// How far past this machine's clock a publisher's timestamp may be (a
/// day: any clock skew, not a stamp from centuries on).
pub const MAX_CLOCK_AHEAD: std::time::Duration = std::time::Duration::from_secs(86_400);

/// The kvbm seq past which no more holes are left for lost batches (2^62):
/// holes are claims of the publisher's seq, and a hostile one could claim
/// enough to use up the seq space; past this, the 3·2^62 seqs left are more
/// than events can ever use.
pub const HOLE_LIMIT: u64 = 1 << 62;

/// Most holders tracked per hash (groups × media; real models have a few).
pub const MAX_HOLDERS: usize = 64;

/// Who holds a hash: a medium and a KV-cache group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    medium: Medium,
    group: Option<i64>,
}

struct Entry {
    id: BlockId,
    generation: u64,
    holders: Vec<Holder>,
}

#[derive(Default)]
struct TierSet {
    /// hash → its block.
    live: HashMap<u64, Entry>,
    /// Insertion order, with stale entries skipped lazily.
    order: VecDeque<(u64, u64)>,
    next_id: BlockId,
    next_gen: u64,
    reported: Option<usize>,
}

impl TierSet {
    fn compact(&mut self) {
        if self.order.len() > 2 * self.live.len() + 64 {
            let live = &self.live;
            self.order
                .retain(|(h, g)| live.get(h).is_some_and(|e| e.generation == *g));
        }
    }

    fn pop_oldest(&mut self) -> Option<(u64, BlockId)> {
        while let Some((h, g)) = self.order.pop_front() {
            if self.live.get(&h).is_some_and(|e| e.generation == g) {
                let e = self.live.remove(&h)?;
                return Some((h, e.id));
            }
        }
        None
    }
}

/// See the module docs.
pub struct Translator {
    cfg: TranslatorConfig,
    seq: u64,
    ts_ns: u64,
    tiers: [TierSet; 3],
    counters: TranslateCounters,
}

impl Translator {
    /// A translator with nothing live.
    pub fn new(mut cfg: TranslatorConfig) -> Self {
        cfg.max_live_per_tier = cfg.max_live_per_tier.max(1);
        Translator {
            cfg,
            seq: 0,
            ts_ns: 0,
            tiers: Default::default(),
            counters: TranslateCounters::default(),
        }
    }

    /// What it did so far.
    pub fn counters(&self) -> TranslateCounters {
        self.counters
    }

    /// The next seq it will stamp.
    pub fn next_seq(&self) -> u64 {
        self.seq
    }

    /// `n` publisher batches were lost: leaves `n` seqs unused, one per
    /// lost batch, so the loss shows in the kvbm stream as a seq gap.
    /// Saturates rather than wraps: a caller taking a publisher's seq at
    /// its word keeps the holes it asks for far below `u64::MAX` (the ZMQ
    /// pipeline refuses jumps past [`MAX_SEQ_JUMP`](super::source::MAX_SEQ_JUMP)
    /// and places none past [`HOLE_LIMIT`]).
    pub fn skip(&mut self, n: u64) {
        self.seq = self.seq.saturating_add(n);
    }

    /// Blocks live on `tier` now.
    pub fn live(&self, tier: Tier) -> usize {
        self.tiers[tier.index()].live.len()
    }

    fn emit(&mut self, kind: EventKind, out: &mut Vec<Event>) {
        out.push(Event {
            engine: self.cfg.engine,
            seq: self.seq,
            ts_ns: self.ts_ns,
            iteration: 0,
            request: None,
            kind,
        });
        // Saturating: holes stop at HOLE_LIMIT, so only 2^63 events could
        // reach the end of the seq space; a hostile seq must never panic
        // (debug) or wrap (release) the stamp.
        self.seq = self.seq.saturating_add(1);
        self.counters.events += 1;
    }

    fn set_time(&mut self, ts: f64) {
        let latest = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            + MAX_CLOCK_AHEAD;
        if ts.is_finite() && ts > 0.0 && ts <= latest.as_secs_f64() {
            // Saturating float → int conversion.
            let ns = (ts * 1e9) as u64;
            self.ts_ns = self.ts_ns.max(ns);
        } else {
            self.counters.bad_timestamps += 1;
        }
    }

    fn evict(&mut self, tier: Tier, hash: u64, block: BlockId, out: &mut Vec<Event>) {
        self.emit(
            EventKind::BlockEvicted {
                tier,
                block,
                sequence_hash: SequenceHash(hash),
            },
            out,
        );
    }

    /// Every holder on `medium` leaves; hashes left without one are
    /// evicted (oldest first). Returns how many.
    fn clear_medium(&mut self, medium: Medium, out: &mut Vec<Event>) -> u64 {
        let tier = medium.tier();
        let set = &mut self.tiers[tier.index()];
        let mut gone: Vec<(u64, u64)> = Vec::new();
        for (h, e) in set.live.iter_mut() {
            e.holders.retain(|x| x.medium != medium);
            if e.holders.is_empty() {
                gone.push((e.generation, *h));
            }
        }
        gone.sort_unstable();
        let ids: Vec<(u64, BlockId)> = gone
            .iter()
            .filter_map(|(_, h)| set.live.remove(h).map(|e| (*h, e.id)))
            .collect();
        for (h, id) in ids {
            self.counters.cleared += 1;
            self.evict(tier, h, id, out);
        }
        self.tiers[tier.index()].compact();
        gone.len() as u64
    }

    fn clear(&mut self, tier: Tier, out: &mut Vec<Event>) -> u64 {
        let set = &mut self.tiers[tier.index()];
        let mut all: Vec<(u64, BlockId)> = Vec::with_capacity(set.live.len());
        while let Some(x) = set.pop_oldest() {
            all.push(x);
        }
        set.live.clear();
        set.order.clear();
        for (h, id) in &all {
            self.evict(tier, *h, *id, out);
        }
        all.len() as u64
    }

    /// Translates one batch, appending to `out`.
    pub fn batch(&mut self, b: &KvBatch, out: &mut Vec<Event>) {
        self.counters.batches += 1;
        self.set_time(b.ts);
        for ev in &b.events {
            match ev {
                KvEvent::Stored {
                    block_hashes,
                    medium,
                    group,
                    ..
                } => {
                    let holder = Holder {
                        medium: *medium,
                        group: *group,
                    };
                    for &h in block_hashes {
                        self.store(holder, h, out);
                    }
                }
                KvEvent::Removed {
                    block_hashes,
                    medium,
                    group,
                } => {
                    let holder = Holder {
                        medium: *medium,
                        group: *group,
                    };
                    for &h in block_hashes {
                        self.remove(holder, h, out);
                    }
                    self.tiers[medium.tier().index()].compact();
                }
                KvEvent::AllCleared { medium } => {
                    self.clear_medium(*medium, out);
                }
            }
        }
        self.gauges(out);
    }

    fn remove(&mut self, holder: Holder, h: u64, out: &mut Vec<Event>) {
        let tier = holder.medium.tier();
        let set = &mut self.tiers[tier.index()];
        let Some(e) = set.live.get_mut(&h) else {
            self.counters.removed_unknown += 1;
            return;
        };
        let before = e.holders.len();
        if let Some(i) = e.holders.iter().position(|x| *x == holder) {
            e.holders.swap_remove(i);
        } else if holder.group.is_none() {
            // A removal without a group covers every group of its medium.
            e.holders.retain(|x| x.medium != holder.medium);
        } else if let Some(i) = e
            .holders
            .iter()
            .position(|x| x.medium == holder.medium && x.group.is_none())
        {
            // A store without a group held it for every group.
            e.holders.swap_remove(i);
        }
        if e.holders.len() == before {
            self.counters.removed_unknown += 1;
            return;
        }
        if !e.holders.is_empty() {
            self.counters.still_held += 1;
            return;
        }
        let id = e.id;
        set.live.remove(&h);
        self.counters.evicted += 1;
        self.evict(tier, h, id, out);
    }

    fn store(&mut self, holder: Holder, h: u64, out: &mut Vec<Event>) {
        let tier = holder.medium.tier();
        let max = self.cfg.max_live_per_tier;
        let set = &mut self.tiers[tier.index()];
        if let Some(e) = set.live.get_mut(&h) {
            if !e.holders.contains(&holder) {
                if e.holders.len() < MAX_HOLDERS {
                    e.holders.push(holder);
                } else {
                    self.counters.holders_overflow += 1;
                }
            }
            let id = e.id;
            self.counters.duplicates += 1;
            let block = set.next_id;
            set.next_id = set.next_id.wrapping_add(1);
            self.emit(
                EventKind::BlockRegistered {
                    tier,
                    block,
                    sequence_hash: SequenceHash(h),
                    duplicate_of: Some(id),
                },
                out,
            );
            return;
        }
        let mut dropped = None;
        if set.live.len() >= max {
            dropped = set.pop_oldest();
        }
        let id = set.next_id;
        set.next_id = set.next_id.wrapping_add(1);
        let g = set.next_gen;
        set.next_gen += 1;
        set.live.insert(
            h,
            Entry {
                id,
                generation: g,
                holders: vec![holder],
            },
        );
        set.order.push_back((h, g));
        if let Some((oh, oid)) = dropped {
            self.counters.bound_evicted += 1;
            self.evict(tier, oh, oid, out);
        }
        self.counters.registered += 1;
        self.emit(
            EventKind::BlockRegistered {
                tier,
                block: id,
                sequence_hash: SequenceHash(h),
                duplicate_of: None,
            },
            out,
        );
    }

    /// The publisher restarted (its seq went back): the engine behind it
    /// starts with empty caches, so every live block on every tier is
    /// evicted.
    pub fn restart(&mut self, out: &mut Vec<Event>) {
        self.counters.restarts += 1;
        for tier in Tier::ALL {
            self.clear(tier, out);
        }
        self.gauges(out);
    }

    fn gauges(&mut self, out: &mut Vec<Event>) {
        for tier in Tier::ALL {
            let set = &mut self.tiers[tier.index()];
            let n = set.live.len();
            if set.reported != Some(n) && (set.reported.is_some() || n > 0) {
                set.reported = Some(n);
                let active = u32::try_from(n).unwrap_or(u32::MAX);
                self.emit(
                    EventKind::PoolGauge {
                        tier,
                        capacity: 0,
                        active,
                        inactive: 0,
                        empty: 0,
                    },
                    out,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch at `ts` storing one GPU block, `hash`.
    fn stored(ts: f64, hash: u64) -> KvBatch {
        KvBatch {
            ts,
            events: vec![KvEvent::Stored {
                block_hashes: vec![hash],
                parent: None,
                num_tokens: 16,
                block_size: Some(16),
                medium: Medium::Gpu,
                group: None,
            }],
            skipped: Default::default(),
            dp_rank: None,
        }
    }

    /// `skip` saturated the seq at `u64::MAX` and the next stamp added 1:
    /// a panic in debug (the ZMQ source's task died), a wrap to 0 in
    /// release. The stamp saturates now; callers keep holes below
    /// [`HOLE_LIMIT`], so it never gets there from a publisher's seq.
    #[test]
    fn a_stamp_at_the_end_of_the_seq_space_does_not_overflow() {
        let mut tr = Translator::new(TranslatorConfig::default());
        tr.skip(u64::MAX - 1);
        tr.skip(5);
        assert_eq!(tr.next_seq(), u64::MAX);
        let mut out = Vec::new();
        tr.batch(&stored(1.0, 7), &mut out);
        assert!(!out.is_empty());
        assert!(out.iter().all(|e| e.seq == u64::MAX));
    }

    /// A stamp of 1e300 s saturated the time at u64::MAX ns, and as time
    /// only moves forward, every later event kept it. It is refused and
    /// counted now, as are stamps that are not positive numbers; a stamp
    /// within a day of this machine's clock is taken.
    #[test]
    fn absurd_timestamps_are_counted_and_do_not_move_the_time() {
        let mut tr = Translator::new(TranslatorConfig::default());
        let mut out = Vec::new();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        tr.batch(&stored(now, 1), &mut out);
        let good = out.last().unwrap().ts_ns;
        for (i, ts) in [
            1e300,
            f64::INFINITY,
            f64::NAN,
            -1.0,
            0.0,
            now + 2.0 * 86_400.0,
        ]
        .into_iter()
        .enumerate()
        {
            tr.batch(&stored(ts, 10 + i as u64), &mut out);
            assert_eq!(out.last().unwrap().ts_ns, good, "{ts}");
        }
        assert_eq!(tr.counters().bad_timestamps, 6);
        tr.batch(&stored(now + 3600.0, 99), &mut out);
        assert!(out.last().unwrap().ts_ns > good);
        assert_eq!(tr.counters().bad_timestamps, 6);
    }
}
