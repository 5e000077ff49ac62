//! LRU stack distances, Mattson's way, with a Fenwick tree: for each
//! reference, how many distinct keys were referenced since the previous
//! reference to the same key, itself included — which is the smallest LRU
//! cache (in keys) that would still have held it. O(log n) per reference.
//!
//! Each key's latest reference owns one *slot*; slots are handed out in
//! time order and a Fenwick tree counts the live ones, so the distance of
//! a key whose latest slot is `s` is the number of live slots at or after
//! `s`. When the slots run out, the live ones are renumbered in order
//! (linear time, no sort) into a tree four times their number, so the cost
//! per reference stays logarithmic in the number of distinct keys, not in
//! the length of the stream.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The smallest number of slots a tree has.
const MIN_SLOTS: usize = 1 << 10;

/// A hasher for keys that are hashes already (sequence hashes, chained
/// trace ids): one multiply, folded, so the low bits hashbrown indexes by
/// depend on every input bit.
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used for this map's keys; anything else is
        // folded in byte by byte, correctly if slowly.
        for &b in bytes {
            self.write_u64(u64::from(b) ^ self.0.rotate_left(8));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = mix(x);
    }
}

/// A 64-bit mix (a folded 128-bit multiply): well spread in every bit.
#[inline]
pub fn mix(x: u64) -> u64 {
    let p = u128::from(x ^ 0x2d35_8dcc_aa6c_78a5).wrapping_mul(0x8bb8_4b93_962e_acc9);
    (p as u64) ^ ((p >> 64) as u64)
}

/// A map keyed by hashes.
pub type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

/// See the module docs.
#[derive(Debug, Clone, Default)]
pub struct StackDistances {
    /// Each live key's latest slot.
    last: KeyMap<u32>,
    /// Fenwick tree over the slots (1-based inside), counting live ones.
    tree: Vec<u32>,
    /// The next slot to hand out.
    next: u32,
    /// Keys tracked (ones in the tree).
    live: u32,
    /// References so far (a clock that renumbering never changes).
    clock: u64,
    /// The clock at each slot's reference, when asked for
    /// ([`with_times`](Self::with_times)); in slot order, so increasing.
    times: Option<Vec<u64>>,
    /// Scratch for renumbering.
    remap: Vec<u32>,
}

impl StackDistances {
    /// An empty stack.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty stack that also answers
    /// [`distinct_since`](Self::distinct_since) (8 bytes more per slot).
    pub fn with_times() -> Self {
        StackDistances {
            times: Some(Vec::new()),
            ..Self::default()
        }
    }

    /// Distinct keys tracked.
    pub fn len(&self) -> usize {
        self.live as usize
    }

    /// True before the first reference.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// References so far: the clock [`distinct_since`](Self::distinct_since)
    /// takes.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Bytes held, roughly (for reports).
    pub fn approx_bytes(&self) -> usize {
        // hashbrown: key, value and a control byte per bucket, at most 7/8 full.
        self.last.capacity() * (8 + 4 + 1)
            + self.tree.capacity() * 4
            + self.times.as_ref().map_or(0, |t| t.capacity() * 8)
            + self.remap.capacity() * 4
    }

    /// References `key`: its stack distance (1 when it was the last key
    /// referenced), or `None` the first time.
    #[inline]
    pub fn reference(&mut self, key: u64) -> Option<u64> {
        if self.next as usize + 1 >= self.tree.len() {
            self.renumber();
        }
        let now = self.next;
        self.next += 1;
        self.clock += 1;
        if let Some(t) = &mut self.times {
            t.push(self.clock);
        }
        let d = match self.last.entry(key) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                let s = *e.get();
                e.insert(now);
                // Live slots at or after `s`: all live ones less those before.
                let d = self.live - prefix(&self.tree, s);
                add(&mut self.tree, s, u32::MAX); // -1, wrapping
                Some(u64::from(d))
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(now);
                self.live += 1;
                None
            }
        };
        add(&mut self.tree, now, 1);
        d
    }

    /// The distance `key` would have now, without referencing it.
    pub fn peek(&self, key: u64) -> Option<u64> {
        let s = *self.last.get(&key)?;
        Some(u64::from(self.live - prefix(&self.tree, s)))
    }

    /// Distinct keys referenced after clock `t` (references numbered
    /// `t + 1` onwards). Needs [`with_times`](Self::with_times); 0
    /// without it.
    pub fn distinct_since(&self, t: u64) -> u64 {
        let Some(times) = &self.times else { return 0 };
        let s = times[..self.next as usize].partition_point(|&x| x <= t);
        u64::from(self.live - prefix(&self.tree, s as u32))
    }

    /// Forgets every key for which `keep` is false (spatial sampling
    /// lowering its rate); the others keep their order.
    pub fn retain(&mut self, mut keep: impl FnMut(u64) -> bool) {
        let tree = &mut self.tree;
        let mut dropped = 0u32;
        self.last.retain(|&k, &mut s| {
            let k_ok = keep(k);
            if !k_ok {
                add(tree, s, u32::MAX);
                dropped += 1;
            }
            k_ok
        });
        self.live -= dropped;
    }

    /// Renumbers the live slots 0..live in order and sizes the tree for
    /// four times as many.
    #[cold]
    fn renumber(&mut self) {
        let used = self.next as usize;
        self.remap.clear();
        self.remap.resize(used, u32::MAX);
        for &s in self.last.values() {
            self.remap[s as usize] = 0;
        }
        let mut n = 0u32;
        for r in self.remap.iter_mut() {
            if *r == 0 {
                *r = n;
                n += 1;
            }
        }
        for s in self.last.values_mut() {
            *s = self.remap[*s as usize];
        }
        if let Some(times) = &mut self.times {
            let mut w = 0;
            for (old, &r) in self.remap.iter().enumerate() {
                if r != u32::MAX {
                    times[w] = times[old];
                    w += 1;
                }
            }
            times.truncate(w);
        }
        let slots = (4 * n as usize).max(MIN_SLOTS);
        self.tree.clear();
        self.tree.resize(slots + 1, 0);
        // Ones at 1..=n, then the linear Fenwick build.
        for v in &mut self.tree[1..=n as usize] {
            *v = 1;
        }
        for i in 1..=slots {
            let j = i + (i & i.wrapping_neg());
            if j <= slots {
                self.tree[j] += self.tree[i];
            }
        }
        self.next = n;
        self.remap.clear();
    }
}

/// Sum of slots `0..s` (the tree is 1-based: slot `k` is index `k + 1`).
#[inline]
fn prefix(tree: &[u32], s: u32) -> u32 {
    let mut i = s as usize;
    let mut sum = 0u32;
    while i > 0 {
        sum = sum.wrapping_add(tree[i]);
        i &= i - 1;
    }
    sum
}

/// Adds `delta` (wrapping: `u32::MAX` is -1) at slot `s`.
#[inline]
fn add(tree: &mut [u32], s: u32, delta: u32) {
    let mut i = s as usize + 1;
    let n = tree.len();
    while i < n {
        tree[i] = tree[i].wrapping_add(delta);
        i += i & i.wrapping_neg();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition: distinct keys since the previous reference.
    fn naive(stream: &[u64]) -> Vec<Option<u64>> {
        stream
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let prev = stream[..i].iter().rposition(|x| x == k)?;
                let mut seen = std::collections::HashSet::new();
                for x in &stream[prev + 1..i] {
                    seen.insert(*x);
                }
                Some(seen.len() as u64 + 1)
            })
            .collect()
    }

    #[test]
    fn distances_by_hand() {
        let mut s = StackDistances::new();
        let got: Vec<_> = [1, 2, 3, 1, 1, 3, 4, 2]
            .iter()
            .map(|&k| s.reference(k))
            .collect();
        assert_eq!(
            got,
            vec![None, None, None, Some(3), Some(1), Some(2), None, Some(4)]
        );
        assert_eq!(s.len(), 4);
        // Since 1's last use: 3, 4 and 2.
        assert_eq!(s.peek(1), Some(4));
        assert_eq!(s.peek(2), Some(1));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn equal_the_definition_across_renumbering(
            stream in proptest::collection::vec(0u64..300, 0..3000)
        ) {
            let mut s = StackDistances::with_times();
            let got: Vec<_> = stream.iter().map(|&k| s.reference(k)).collect();
            prop_assert_eq!(got, naive(&stream));
        }

        #[test]
        fn distinct_since_counts_keys_referenced_after_a_time(
            stream in proptest::collection::vec(0u64..200, 1..3000),
            cut in 0usize..3000,
        ) {
            let cut = cut % stream.len();
            let mut s = StackDistances::with_times();
            for &k in &stream {
                s.reference(k);
            }
            let want: std::collections::HashSet<u64> = stream[cut..].iter().copied().collect();
            prop_assert_eq!(s.distinct_since(cut as u64), want.len() as u64);
        }

        #[test]
        fn retain_keeps_the_order_of_what_is_left(
            stream in proptest::collection::vec(0u64..100, 1..2000),
        ) {
            let mut s = StackDistances::new();
            for &k in &stream[..stream.len() / 2] {
                s.reference(k);
            }
            s.retain(|k| k % 3 != 0);
            let mut kept = StackDistances::new();
            for &k in stream[..stream.len() / 2].iter().filter(|k| *k % 3 != 0) {
                kept.reference(k);
            }
            for &k in stream[stream.len() / 2..].iter().filter(|k| *k % 3 != 0) {
                prop_assert_eq!(s.reference(k), kept.reference(k));
            }
        }
    }
}
