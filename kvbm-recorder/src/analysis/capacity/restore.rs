//! Capacity from stores and removals alone (vLLM / SGLang KV events over
//! ZMQ, or a log from before lookups were recorded), where no lookup is
//! recorded.
//!
//! A block stored again after it was removed was a miss that a larger
//! cache would have avoided. How much larger: when a cache evicts its
//! least recently used block, every other block it holds was used more
//! recently, so at the removal at most `live` blocks (those the tier held
//! then) were more recent; after it, a block not in the cache can only
//! come back by being stored. So the block's stack distance at its
//! re-store is at most `live + S`, with `S` the distinct blocks stored
//! between the removal and the re-store. An LRU cache of capacity `C`
//! would have hit every re-store whose bound is at most `C`: counting
//! those gives, per capacity, a **lower bound** on the extra hits (block
//! by block; the lookups themselves, and so the prefix rule, are not in
//! such a stream). It assumes the engine evicts LRU, as vLLM's prefix
//! cache does.

use super::stack::{KeyMap, StackDistances};
use kvbm_events::SequenceHash;
use kvbm_events::tier::Tier;
use serde::Serialize;

/// One tier's stores and removals.
#[derive(Debug, Clone, Default)]
struct TierRestores {
    stack: Option<StackDistances>,
    /// Live blocks.
    live: KeyMap<()>,
    /// Removed blocks: (clock at removal, live blocks then).
    removed: KeyMap<(u64, u64)>,
    stores: u64,
    removals: u64,
    /// Bounds of each re-store's stack distance, in blocks.
    bounds: Vec<u64>,
    max_live: u64,
    /// Events not followed because the cap was reached.
    untracked: u64,
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct Restores {
    tiers: [TierRestores; 3],
    max_blocks: Option<usize>,
}

/// One tier's summary at some capacities.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TierRestoreReport {
    /// The tier.
    pub tier: Tier,
    /// Blocks stored (registrations that were not duplicates).
    pub stores: u64,
    /// Blocks removed.
    pub removals: u64,
    /// Stores of a block that had been removed: misses more capacity
    /// would have avoided.
    pub restores: u64,
    /// The most blocks the tier held at once.
    pub max_live_blocks: u64,
    /// Per capacity, re-stores whose distance bound fits: a lower bound on
    /// the extra hits.
    pub points: Vec<RestorePoint>,
    /// Stores or removals not followed because the analysis's memory cap
    /// was reached.
    pub untracked: u64,
}

/// One capacity's lower bound.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RestorePoint {
    /// Capacity in blocks.
    pub capacity_blocks: u64,
    /// Capacity in tokens, when the block size is known.
    pub capacity_tokens: Option<u64>,
    /// At least this many of the re-stores would have been hits.
    pub extra_hits_lower_bound: u64,
}

impl Restores {
    /// Follows at most `max_blocks` blocks per tier (`None`: no cap).
    pub fn new(max_blocks: Option<usize>) -> Self {
        Restores {
            tiers: Default::default(),
            max_blocks,
        }
    }

    /// A tier stored `h`.
    pub fn stored(&mut self, tier: Tier, h: SequenceHash) {
        let t = &mut self.tiers[tier.index()];
        if t.live.contains_key(&h.0) {
            return;
        }
        let stack = t.stack.get_or_insert_with(StackDistances::with_times);
        if self.max_blocks.is_some_and(|m| stack.len() >= m) && stack.peek(h.0).is_none() {
            t.untracked += 1;
            return;
        }
        t.stores += 1;
        if let Some((at, live)) = t.removed.remove(&h.0) {
            t.bounds.push(live + stack.distinct_since(at));
        }
        stack.reference(h.0);
        t.live.insert(h.0, ());
        t.max_live = t.max_live.max(t.live.len() as u64);
    }

    /// A tier removed `h`.
    pub fn removed(&mut self, tier: Tier, h: SequenceHash) {
        let t = &mut self.tiers[tier.index()];
        if t.live.remove(&h.0).is_none() {
            t.untracked += 1;
            return;
        }
        t.removals += 1;
        let clock = t.stack.as_ref().map_or(0, |s| s.clock());
        // `live` counts the block itself, as a stack distance does.
        t.removed.insert(h.0, (clock, t.live.len() as u64 + 1));
    }

    /// True when any tier saw a store.
    pub fn any(&self) -> bool {
        self.tiers.iter().any(|t| t.stores > 0)
    }

    /// Each tier that saw stores, at `capacities` (in blocks).
    pub fn report(&self, capacities: &[u64], block_size: Option<u32>) -> Vec<TierRestoreReport> {
        Tier::ALL
            .into_iter()
            .zip(&self.tiers)
            .filter(|(_, t)| t.stores > 0)
            .map(|(tier, t)| {
                let mut sorted = t.bounds.clone();
                sorted.sort_unstable();
                TierRestoreReport {
                    tier,
                    stores: t.stores,
                    removals: t.removals,
                    restores: t.bounds.len() as u64,
                    max_live_blocks: t.max_live,
                    points: capacities
                        .iter()
                        .map(|&c| RestorePoint {
                            capacity_blocks: c,
                            capacity_tokens: block_size.map(|b| c * u64::from(b)),
                            extra_hits_lower_bound: sorted.partition_point(|&b| b <= c) as u64,
                        })
                        .collect(),
                    untracked: t.untracked,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An LRU cache of `cap` blocks over a reference stream, emitting its
    /// stores and removals as an engine's event stream would.
    fn lru_events(stream: &[u64], cap: usize) -> (Vec<(bool, u64)>, u64) {
        let mut order: Vec<u64> = Vec::new();
        let mut events = Vec::new();
        let mut misses = 0;
        for &k in stream {
            if let Some(i) = order.iter().position(|x| *x == k) {
                order.remove(i);
            } else {
                misses += 1;
                if order.len() == cap {
                    let v = order.remove(0);
                    events.push((false, v));
                }
                events.push((true, k));
            }
            order.push(k);
        }
        (events, misses)
    }

    fn lru_misses(stream: &[u64], cap: usize) -> u64 {
        lru_events(stream, cap).1
    }

    proptest::proptest! {
        #[test]
        fn the_bound_never_claims_more_hits_than_a_bigger_lru_gets(
            stream in proptest::collection::vec(0u64..60, 1..600),
            cap in 1usize..20,
            more in 1usize..40,
        ) {
            let (events, misses) = lru_events(&stream, cap);
            let mut r = Restores::new(None);
            for (store, k) in events {
                if store {
                    r.stored(Tier::Device, SequenceHash(k));
                } else {
                    r.removed(Tier::Device, SequenceHash(k));
                }
            }
            let big = (cap + more) as u64;
            let rep = r.report(&[big], None);
            let bound = rep.first().map_or(0, |t| t.points[0].extra_hits_lower_bound);
            let gained = misses - lru_misses(&stream, cap + more);
            proptest::prop_assert!(bound <= gained, "bound {} > gained {}", bound, gained);
        }
    }
}
