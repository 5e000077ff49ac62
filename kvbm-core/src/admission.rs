//! Whether a block may enter a full pool: TinyLFU admission, and the
//! frequency sketch it (and frequency-gated offload) counts with.
//!
//! Eviction decides which block leaves; admission decides whether a new
//! one is worth that. Under [`Admission::TinyLfu`] (Einziger, Friedman and
//! Manes, "TinyLFU: A Highly Efficient Cache Admission Policy", 2017) a
//! block offered to a full pool enters only if it has been seen more often
//! than the block the pool's eviction policy would take out for it (ties
//! keep the block that is in, as in the paper). "Seen" is counted in a
//! [`FrequencySketch`] of the requests' references: each request counts
//! once for every full block of its prompt, at its first lookup, whichever
//! tier (if any) then serves the block. Counting references rather than
//! the tier's own hits makes the count a property of the workload, the same
//! whatever the tiers in front of it kept, and so the same as in the
//! capacity analysis' model ([`crate::cache_model`]). A burst of blocks
//! used once (a long prompt nobody repeats) cannot push out a prefix many
//! requests share, which is what write-through offload does to an LRU
//! tier; but a prefix's block that is turned away also leaves every block
//! after it useless to a prefix match, so on traffic whose reuse is mostly
//! recent, admission loses hits (see docs/eviction.md).
//!
//! Admission applies to the tiers blocks are offered to: G2 and G3. G1
//! holds what the engine computes and must take every block.

use crate::tokens::SequenceHash;

/// Whether a pool admits every block or asks a sketch first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum Admission {
    /// Every block offered is stored (evicting if need be).
    #[default]
    All,
    /// A block offered to a full pool is stored only when the sketch has
    /// seen it more often than the block it would evict.
    TinyLfu,
}

/// Rows of the sketch: each access increments one counter per row, and an
/// estimate is the smallest of them.
const ROWS: usize = 4;
/// A counter stops at 15 (four bits' worth, as in the paper): frequencies
/// only need comparing, and the periodic halving keeps them small.
const MAX_COUNT: u8 = 15;
/// Accesses per counter slot before every counter is halved (the paper's
/// sample size W is ten times the cache's entries).
const SAMPLE_PER_ENTRY: u64 = 10;
/// Counters per row at most (16 MiB over the four rows).
const MAX_WIDTH: usize = 1 << 22;

/// Per-row seeds for the index hash.
const SEEDS: [u64; ROWS] = [
    0x9e37_79b9_7f4a_7c15,
    0xc2b2_ae3d_27d4_eb4f,
    0x1656_67b1_9e37_79f9,
    0x27d4_eb2f_1656_67c5,
];

/// A count-min sketch of recent access frequencies with aging: a fixed
/// amount of memory, however many distinct blocks pass (so no table grows
/// with the traffic), and deterministic (the same accesses give the same
/// counts, run after run). Estimates are never below the true count since
/// the last halving, and above it only where blocks collide in every row.
#[derive(Debug, Clone)]
pub struct FrequencySketch {
    counters: Vec<u8>,
    mask: usize,
    /// Accesses since the last halving, and how many trigger one.
    additions: u64,
    sample: u64,
    halvings: u64,
}

impl FrequencySketch {
    /// A sketch for a cache of `entries` blocks: a row of counters per
    /// entry (a power of two, at least 64, at most 4M), halved every ten
    /// accesses per entry.
    pub fn new(entries: usize) -> Self {
        let width = entries.clamp(64, MAX_WIDTH).next_power_of_two();
        FrequencySketch {
            counters: vec![0; width * ROWS],
            mask: width - 1,
            additions: 0,
            sample: (entries.max(1) as u64).saturating_mul(SAMPLE_PER_ENTRY),
            halvings: 0,
        }
    }

    #[inline]
    fn slot(&self, h: SequenceHash, row: usize) -> usize {
        // A sequence hash is already well mixed; one multiply per row
        // decorrelates the rows.
        let x = (h.0 ^ SEEDS[row]).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        row * (self.mask + 1) + ((x >> 32) as usize & self.mask)
    }

    /// How often `h` was seen (since halvings aged it).
    pub fn estimate(&self, h: SequenceHash) -> u8 {
        (0..ROWS)
            .map(|r| self.counters[self.slot(h, r)])
            .min()
            .unwrap_or(0)
    }

    /// Counts one access to `h` (conservative update: only the counters at
    /// the current minimum go up, which keeps collisions from inflating the
    /// others). Every `sample` accesses, every counter is halved.
    pub fn record(&mut self, h: SequenceHash) {
        let est = self.estimate(h);
        if est < MAX_COUNT {
            for r in 0..ROWS {
                let i = self.slot(h, r);
                if self.counters[i] == est {
                    self.counters[i] += 1;
                }
            }
        }
        self.additions += 1;
        if self.additions >= self.sample {
            self.additions = 0;
            self.halvings += 1;
            for c in &mut self.counters {
                *c >>= 1;
            }
        }
    }

    /// Times every counter was halved.
    pub fn halvings(&self) -> u64 {
        self.halvings
    }
}

/// TinyLFU's decision: admit `candidate` in place of `victim` when it was
/// seen more often. Ties keep the block that is in: one that was only
/// offered as often as the victim was used has no claim to its place.
pub fn tinylfu_admits(
    sketch: &FrequencySketch,
    candidate: SequenceHash,
    victim: SequenceHash,
) -> bool {
    sketch.estimate(candidate) > sketch.estimate(victim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn counts_age_by_halving() {
        let mut s = FrequencySketch::new(8);
        // A sample of 80 accesses: 5 of one block, then 75 of others.
        for _ in 0..5 {
            s.record(SequenceHash(7));
        }
        assert_eq!(s.estimate(SequenceHash(7)), 5);
        for _ in 0..74 {
            s.record(SequenceHash(1000));
        }
        assert_eq!(s.halvings(), 0);
        s.record(SequenceHash(5000));
        assert_eq!(s.halvings(), 1);
        assert_eq!(s.estimate(SequenceHash(7)), 2);
    }

    #[test]
    fn the_more_frequent_block_is_admitted() {
        let mut s = FrequencySketch::new(100);
        for _ in 0..3 {
            s.record(SequenceHash(1));
        }
        s.record(SequenceHash(2));
        assert!(tinylfu_admits(&s, SequenceHash(1), SequenceHash(2)));
        assert!(!tinylfu_admits(&s, SequenceHash(2), SequenceHash(1)));
        assert!(!tinylfu_admits(&s, SequenceHash(3), SequenceHash(3)));
    }

    proptest! {
        /// Between halvings an estimate is at least the true count (capped)
        /// and the same accesses give the same sketch.
        #[test]
        fn estimates_never_undercount(keys in proptest::collection::vec(0u64..64, 0..300)) {
            let mut s = FrequencySketch::new(64); // sample 640: no halving here
            let mut again = FrequencySketch::new(64);
            let mut truth = std::collections::HashMap::new();
            for &k in &keys {
                s.record(SequenceHash(k));
                again.record(SequenceHash(k));
                *truth.entry(k).or_insert(0u32) += 1;
            }
            for (&k, &n) in &truth {
                prop_assert!(u32::from(s.estimate(SequenceHash(k))) >= n.min(15));
            }
            prop_assert_eq!(s.counters, again.counters);
        }
    }
}
