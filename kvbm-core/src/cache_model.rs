//! One cache of a fixed number of blocks under a [`CachePolicy`], driven
//! by a reference stream rather than an engine: what `kvbm-recorder
//! capacity --policies` simulates at each capacity.
//!
//! LRU's hit ratio at every capacity at once comes exactly from stack
//! distances (the recorder's capacity curve); the other policies have no
//! such shortcut, so each (policy, capacity) pair runs this model over the
//! stream. It uses the pools' own eviction code ([`crate::eviction`]) and
//! admission rule ([`crate::admission`]), with the stream's semantics:
//!
//! - a request references its full blocks in prefix order; block `j` is a
//!   hit when blocks `0..=j` are all cached and `j` is one the engine looks
//!   up (below `matchable`: the block holding a prompt's last token never
//!   is);
//! - every block referenced is a use: counted in TinyLFU's sketch (as the
//!   leader counts a request's blocks at its first lookup), and, if
//!   cached, hit (as a duplicate registration is in a pool); one missing is
//!   offered and, if admitted, stored, evicting if the cache is full;
//! - a request holds its blocks until all are referenced, then releases
//!   them in order, so it never evicts its own blocks.
//!
//! Under plain LRU this gives the stack-distance curve exactly wherever
//! the capacity holds the longest request (a test holds that).

use crate::admission::{Admission, FrequencySketch, tinylfu_admits};
use crate::eviction::{CachePolicy, Inactive};
use crate::pool::IdentityHasher;
use crate::tokens::SequenceHash;
use kvbm_events::BlockId;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

/// A capacity the machine cannot hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a model cache of {0} blocks does not fit in memory")]
pub struct ModelTooLarge(pub usize);

/// The model. See the module docs.
#[derive(Debug)]
pub struct CacheModel {
    capacity: usize,
    order: Inactive,
    sketch: Option<FrequencySketch>,
    /// Keys are hashes already (chained block ids, sequence hashes).
    ids: HashMap<u64, BlockId, BuildHasherDefault<IdentityHasher>>,
    keys: Vec<u64>,
    free: Vec<BlockId>,
    held: Vec<BlockId>,
    hits: u64,
    references: u64,
    not_admitted: u64,
}

impl CacheModel {
    /// An empty cache of `capacity` blocks under `policy`.
    pub fn new(policy: CachePolicy, capacity: usize) -> Result<Self, ModelTooLarge> {
        let order =
            Inactive::new(policy.eviction, capacity).map_err(|_| ModelTooLarge(capacity))?;
        Ok(CacheModel {
            capacity,
            order,
            sketch: (policy.admission == Admission::TinyLfu)
                .then(|| FrequencySketch::new(capacity)),
            ids: HashMap::default(),
            keys: vec![0; capacity],
            free: (0..capacity as BlockId).rev().collect(),
            held: Vec::new(),
            hits: 0,
            references: 0,
            not_admitted: 0,
        })
    }

    /// One request: its full blocks' keys in prefix order, the first
    /// `matchable` of them looked up. Returns its prefix hits, in blocks.
    pub fn request(&mut self, keys: &[u64], matchable: usize) -> usize {
        let mut hits = 0;
        let mut prefix = true;
        for (j, &k) in keys.iter().enumerate() {
            self.references += 1;
            if let Some(s) = self.sketch.as_mut() {
                s.record(SequenceHash(k));
            }
            if let Some(&id) = self.ids.get(&k) {
                if prefix && j < matchable {
                    hits += 1;
                }
                self.order.revived(id);
                self.order.hit(id);
                self.held.push(id);
                continue;
            }
            prefix = false;
            if let Some(id) = self.store(k) {
                self.held.push(id);
            }
        }
        for id in self.held.drain(..) {
            self.order.released(id);
        }
        self.hits += hits as u64;
        hits
    }

    /// Stores `k` (a miss) if there is room or it is admitted.
    fn store(&mut self, k: u64) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let victim = self.order.peek()?;
                if let Some(s) = &self.sketch
                    && !tinylfu_admits(s, SequenceHash(k), SequenceHash(self.keys[victim as usize]))
                {
                    self.not_admitted += 1;
                    return None;
                }
                let id = self.order.evict()?;
                self.ids.remove(&self.keys[id as usize]);
                id
            }
        };
        self.ids.insert(k, id);
        self.keys[id as usize] = k;
        self.order.registered(id, SequenceHash(k));
        Some(id)
    }

    /// Its capacity, in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Prefix hits so far, in blocks.
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Blocks referenced so far.
    pub fn references(&self) -> u64 {
        self.references
    }

    /// Misses the admission policy turned away.
    pub fn not_admitted(&self) -> u64 {
        self.not_admitted
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::EvictionPolicy;

    /// LRU by brute force: a list, most recent last.
    fn lru_hits(stream: &[(Vec<u64>, usize)], capacity: usize) -> u64 {
        let mut list: Vec<u64> = Vec::new();
        let mut hits = 0;
        for (keys, matchable) in stream {
            let mut prefix = true;
            for (j, k) in keys.iter().enumerate() {
                match list.iter().position(|x| x == k) {
                    Some(i) => {
                        if prefix && j < *matchable {
                            hits += 1;
                        }
                        list.remove(i);
                    }
                    None => prefix = false,
                }
                list.push(*k);
                if list.len() > capacity {
                    list.remove(0);
                }
            }
        }
        hits
    }

    fn stream(seed: u64, n: usize) -> Vec<(Vec<u64>, usize)> {
        // Requests over a few shared prefixes, of up to 6 blocks.
        let mut x = seed;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        (0..n)
            .map(|_| {
                let root = next() % 5;
                let len = 1 + (next() % 6) as usize;
                let tail = next() % 3;
                let keys: Vec<u64> = (0..len)
                    .map(|j| {
                        if j < 3 {
                            root * 100 + j as u64
                        } else {
                            root * 100 + tail * 10 + j as u64
                        }
                    })
                    .collect();
                let m = len.saturating_sub((next() % 2) as usize);
                (keys, m)
            })
            .collect()
    }

    #[test]
    fn plain_lru_is_the_stack_curve() {
        for seed in 1..20 {
            let s = stream(seed, 300);
            for cap in [6, 8, 12, 40] {
                let mut m = CacheModel::new(EvictionPolicy::Lru.into(), cap).unwrap();
                for (k, n) in &s {
                    m.request(k, *n);
                }
                assert_eq!(m.hits(), lru_hits(&s, cap), "seed {seed}, capacity {cap}");
            }
        }
    }

    #[test]
    fn a_request_longer_than_the_cache_keeps_what_fits() {
        let mut m = CacheModel::new(EvictionPolicy::S3Fifo.into(), 2).unwrap();
        assert_eq!(m.request(&[1, 2, 3, 4], 4), 0);
        assert_eq!(m.request(&[1, 2, 3, 4], 4), 2);
    }

    #[test]
    fn tinylfu_keeps_the_hot_prefix_through_a_scan() {
        let hot = [1u64, 2];
        let run = |policy: CachePolicy| {
            let mut m = CacheModel::new(policy, 4).unwrap();
            let mut hits = 0;
            for i in 0..200u64 {
                hits += m.request(&hot, 2);
                // A one-off request of 3 blocks between two uses.
                m.request(&[1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i], 3);
            }
            (hits, m.not_admitted())
        };
        let (lru, _) = run(EvictionPolicy::Lru.into());
        let (tiny, turned_away) = run("tinylfu+lru".parse().unwrap());
        assert_eq!(lru, 0, "a scan of 3 pushes both hot blocks out of 4");
        assert!(
            tiny >= 390,
            "TinyLFU kept the hot blocks: {tiny} hits of 400"
        );
        assert!(turned_away > 0);
    }
}
