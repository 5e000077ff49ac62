//! LRU stack distances, Mattson's way: for each reference, how many
//! distinct keys were referenced since the previous reference to the same
//! key, itself included — which is the smallest LRU cache (in keys) that
//! would still have held it. O(log n) per reference.
//!
//! Each key's latest reference owns one *slot*; slots are handed out in
//! time order, so the distance of a key whose latest slot is `s` is the
//! number of live slots at or after `s`. Live slots are bits in a bitset,
//! and a Fenwick tree counts them per cache line of 512 slots: a count is
//! a walk over the (small, cache-resident) tree plus popcounts within one
//! line, and an update touches one bitset word (the newest line's slots
//! reach the tree together, when the next line starts). When the slots
//! run out,
//! the live ones are renumbered in order (linear time, no sort) into a
//! bitset four times their number, so the cost per reference stays
//! logarithmic in the number of distinct keys, not in the length of the
//! stream. Keys map to slots in an open-addressing table whose entries
//! hold key and slot together (one cache line per lookup), and
//! [`prefetch`](StackDistances::prefetch) lets a caller that knows the
//! next keys start their memory loads early.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The smallest number of slots (a multiple of [`LINE`]).
const MIN_SLOTS: usize = 1 << 12;
/// Slots per line (one 64-byte cache line of the bitset).
const LINE: usize = 512;
const WORDS_PER_LINE: usize = LINE / 64;

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

/// An empty entry's slot.
const EMPTY: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Entry {
    key: u64,
    slot: u32,
}

/// Key → slot, open addressing with linear probing, at most 3/4 full.
#[derive(Debug, Clone)]
struct SlotMap {
    entries: Vec<Entry>,
    len: usize,
}

impl Default for SlotMap {
    fn default() -> Self {
        SlotMap {
            entries: vec![
                Entry {
                    key: 0,
                    slot: EMPTY
                };
                1024
            ],
            len: 0,
        }
    }
}

impl SlotMap {
    #[inline]
    fn home(&self, key: u64) -> usize {
        (mix(key) as usize) & (self.entries.len() - 1)
    }

    #[inline]
    fn get(&self, key: u64) -> Option<u32> {
        let mask = self.entries.len() - 1;
        let mut i = self.home(key);
        loop {
            let e = self.entries[i];
            if e.slot == EMPTY {
                return None;
            }
            if e.key == key {
                return Some(e.slot);
            }
            i = (i + 1) & mask;
        }
    }

    /// Sets `key`'s slot; its previous slot, if it had one.
    #[inline]
    fn set(&mut self, key: u64, slot: u32) -> Option<u32> {
        // At most three quarters full: probes stay short, and the table
        // stays small enough to sit in cache for longer.
        if (self.len + 1) * 4 > self.entries.len() * 3 {
            self.grow();
        }
        let mask = self.entries.len() - 1;
        let mut i = self.home(key);
        loop {
            let e = &mut self.entries[i];
            if e.slot == EMPTY {
                *e = Entry { key, slot };
                self.len += 1;
                return None;
            }
            if e.key == key {
                return Some(std::mem::replace(&mut e.slot, slot));
            }
            i = (i + 1) & mask;
        }
    }

    #[cold]
    fn grow(&mut self) {
        let bigger = vec![
            Entry {
                key: 0,
                slot: EMPTY
            };
            self.entries.len() * 2
        ];
        let old = std::mem::replace(&mut self.entries, bigger);
        let mask = self.entries.len() - 1;
        for e in old.into_iter().filter(|e| e.slot != EMPTY) {
            let mut i = self.home(e.key);
            while self.entries[i].slot != EMPTY {
                i = (i + 1) & mask;
            }
            self.entries[i] = e;
        }
    }

    /// Removes `key` (backward-shift deletion keeps every probe chain
    /// unbroken).
    fn remove(&mut self, key: u64) -> Option<u32> {
        let mask = self.entries.len() - 1;
        let mut i = self.home(key);
        loop {
            let e = self.entries[i];
            if e.slot == EMPTY {
                return None;
            }
            if e.key == key {
                break;
            }
            i = (i + 1) & mask;
        }
        let removed = self.entries[i].slot;
        let mut hole = i;
        let mut j = (i + 1) & mask;
        loop {
            let e = self.entries[j];
            if e.slot == EMPTY {
                break;
            }
            let home = self.home(e.key);
            // Move `e` into the hole unless its home lies in (hole, j].
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.entries[hole] = e;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.entries[hole].slot = EMPTY;
        self.len -= 1;
        Some(removed)
    }

    fn slots_mut(&mut self) -> impl Iterator<Item = &mut u32> {
        self.entries
            .iter_mut()
            .filter(|e| e.slot != EMPTY)
            .map(|e| &mut e.slot)
    }

    fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.entries
            .iter()
            .filter(|e| e.slot != EMPTY)
            .map(|e| (e.key, e.slot))
    }

    fn bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
    }
}

/// Live slots: a bitset, and a Fenwick tree of per-line counts.
///
/// Slots are set in increasing order, so the slots set since `flushed`
/// all lie in one line, the newest: they are counted in `pending` and
/// enter the tree in one update when the next line is started. A count
/// never reads the tree entry of its own line (it popcounts within it),
/// so the newest line's entry may lag; every older line's is exact. That
/// saves one of the three tree walks a reference costs.
#[derive(Debug, Clone, Default)]
struct Slots {
    bits: Vec<u64>,
    /// 1-based Fenwick tree over lines.
    tree: Vec<u32>,
    /// Slots below this are all counted in the tree.
    flushed: usize,
    /// Live slots at or above `flushed` (all in `flushed`'s line).
    pending: u32,
}

impl Slots {
    fn capacity(&self) -> usize {
        self.bits.len() * 64
    }

    /// Sets slot `s`, which must be above every slot set so far.
    #[inline]
    fn set(&mut self, s: u32) {
        let s = s as usize;
        debug_assert!(s >= self.flushed);
        if s.is_multiple_of(LINE) && s > self.flushed {
            // `s` starts a line: the pending slots (all in the line
            // before) go into the tree.
            self.add_line(self.flushed / LINE, self.pending);
            self.flushed = s;
            self.pending = 0;
        }
        self.bits[s >> 6] |= 1 << (s & 63);
        self.pending += 1;
    }

    #[inline]
    fn clear(&mut self, s: u32) {
        let s = s as usize;
        self.bits[s >> 6] &= !(1 << (s & 63));
        if s >= self.flushed {
            self.pending -= 1;
        } else {
            self.add_line(s / LINE, u32::MAX);
        }
    }

    #[inline]
    fn add_line(&mut self, line: usize, delta: u32) {
        let mut i = line + 1;
        let n = self.tree.len();
        while i < n {
            self.tree[i] = self.tree[i].wrapping_add(delta);
            i += i & i.wrapping_neg();
        }
    }

    /// Live slots before `s`.
    #[inline]
    fn before(&self, s: u32) -> u32 {
        let s = s as usize;
        let line = s / LINE;
        let mut sum = 0u32;
        let mut i = line;
        while i > 0 {
            sum = sum.wrapping_add(self.tree[i]);
            i &= i - 1;
        }
        if line > self.flushed / LINE {
            // The pending slots' line is before `s`'s, and its tree entry
            // does not hold them yet.
            sum += self.pending;
        }
        let w = s >> 6;
        for &word in &self.bits[line * WORDS_PER_LINE..w] {
            sum += word.count_ones();
        }
        let below = (1u64 << (s & 63)) - 1;
        sum + (self.bits[w] & below).count_ones()
    }

    /// Room for `slots` slots with slots `0..n` live.
    fn reset(&mut self, slots: usize, n: usize) {
        let slots = slots.div_ceil(LINE) * LINE;
        self.bits.clear();
        self.bits.resize(slots / 64, 0);
        for (w, word) in self.bits.iter_mut().enumerate() {
            let lo = w * 64;
            if lo + 64 <= n {
                *word = u64::MAX;
            } else if lo < n {
                *word = (1u64 << (n - lo)) - 1;
            }
        }
        let lines = slots / LINE;
        self.tree.clear();
        self.tree.resize(lines + 1, 0);
        for l in 0..lines {
            self.tree[l + 1] = n.saturating_sub(l * LINE).min(LINE) as u32;
        }
        for i in 1..=lines {
            let j = i + (i & i.wrapping_neg());
            if j <= lines {
                self.tree[j] += self.tree[i];
            }
        }
        // Every live slot is in the tree.
        self.flushed = n;
        self.pending = 0;
    }

    fn bytes(&self) -> usize {
        self.bits.capacity() * 8 + self.tree.capacity() * 4
    }
}

/// See the module docs.
#[derive(Debug, Clone, Default)]
pub struct StackDistances {
    /// Each live key's latest slot.
    last: SlotMap,
    slots: Slots,
    /// The next slot to hand out.
    next: u32,
    /// Keys tracked (live slots).
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
        self.last.bytes()
            + self.slots.bytes()
            + self.times.as_ref().map_or(0, |t| t.capacity() * 8)
            + self.remap.capacity() * 4
    }

    /// True when the tables outgrow the caches (tens of megabytes), where
    /// [`prefetch`](Self::prefetch) pays for itself.
    #[inline]
    pub fn is_large(&self) -> bool {
        self.last.entries.len() >= 1 << 20
    }

    /// Starts the memory loads [`reference`](Self::reference)`(key)` will
    /// need, and returns a value that depends on them (pass it to
    /// `std::hint::black_box`, so the loads are not optimised away).
    /// Touching the next few keys before referencing them lets their cache
    /// misses overlap.
    #[inline]
    pub fn prefetch(&self, key: u64) -> u64 {
        let e = self.last.entries[self.last.home(key)];
        if e.key == key && e.slot != EMPTY {
            let w = (e.slot as usize) >> 6;
            self.slots.bits.get(w).copied().unwrap_or(0) ^ u64::from(e.slot)
        } else {
            u64::from(e.slot)
        }
    }

    /// References `key`: its stack distance (1 when it was the last key
    /// referenced), or `None` the first time.
    #[inline]
    pub fn reference(&mut self, key: u64) -> Option<u64> {
        if self.next as usize >= self.slots.capacity() {
            self.renumber();
        }
        let now = self.next;
        self.next += 1;
        self.clock += 1;
        if let Some(t) = &mut self.times {
            t.push(self.clock);
        }
        let d = match self.last.set(key, now) {
            Some(s) => {
                // Live slots at or after `s`: all live ones less those before.
                let d = self.live - self.slots.before(s);
                self.slots.clear(s);
                Some(u64::from(d))
            }
            None => {
                self.live += 1;
                None
            }
        };
        self.slots.set(now);
        d
    }

    /// The distance `key` would have now, without referencing it.
    pub fn peek(&self, key: u64) -> Option<u64> {
        let s = self.last.get(key)?;
        Some(u64::from(self.live - self.slots.before(s)))
    }

    /// Distinct keys referenced after clock `t` (references numbered
    /// `t + 1` onwards). Needs [`with_times`](Self::with_times); 0
    /// without it.
    pub fn distinct_since(&self, t: u64) -> u64 {
        let Some(times) = &self.times else { return 0 };
        let s = times[..self.next as usize].partition_point(|&x| x <= t);
        u64::from(self.live - self.slots.before(s as u32))
    }

    /// Forgets every key for which `keep` is false (spatial sampling
    /// lowering its rate); the others keep their order.
    pub fn retain(&mut self, mut keep: impl FnMut(u64) -> bool) {
        let gone: Vec<(u64, u32)> = self.last.iter().filter(|(k, _)| !keep(*k)).collect();
        for (k, s) in gone {
            self.last.remove(k);
            self.slots.clear(s);
            self.live -= 1;
        }
    }

    /// Renumbers the live slots 0..live in order and sizes the bitset for
    /// four times as many.
    #[cold]
    fn renumber(&mut self) {
        let used = self.next as usize;
        self.remap.clear();
        self.remap.resize(used, u32::MAX);
        for (_, s) in self.last.iter() {
            self.remap[s as usize] = 0;
        }
        let mut n = 0u32;
        for r in self.remap.iter_mut() {
            if *r == 0 {
                *r = n;
                n += 1;
            }
        }
        for s in self.last.slots_mut() {
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
        self.slots
            .reset((4 * n as usize).max(MIN_SLOTS), n as usize);
        self.next = n;
        self.remap.clear();
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

    /// The newest line's slots reach the tree only when the next line
    /// starts; a count from the first slot of that next line (which
    /// `distinct_since` asks for when nothing came after `t`) must still
    /// see them.
    #[test]
    fn counts_at_a_line_boundary_see_the_newest_line() {
        let mut s = StackDistances::with_times();
        for k in 0..LINE as u64 {
            assert_eq!(s.reference(k), None);
        }
        assert_eq!(s.distinct_since(s.clock()), 0);
        assert_eq!(s.distinct_since(0), LINE as u64);
        assert_eq!(s.peek(0), Some(LINE as u64));
        assert_eq!(s.reference(0), Some(LINE as u64));
        assert_eq!(s.distinct_since(s.clock() - 1), 1);
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
        fn the_slot_map_agrees_with_a_hash_map(
            ops in proptest::collection::vec((0u64..64, any::<bool>()), 0..3000)
        ) {
            let mut m = SlotMap::default();
            let mut want = std::collections::HashMap::new();
            for (i, (k, insert)) in ops.into_iter().enumerate() {
                // Keys that collide in the low bits too, to exercise probing.
                let key = k << 40;
                if insert {
                    prop_assert_eq!(m.set(key, i as u32), want.insert(key, i as u32));
                } else {
                    prop_assert_eq!(m.remove(key), want.remove(&key));
                }
                prop_assert_eq!(m.len, want.len());
            }
            for (k, v) in &want {
                prop_assert_eq!(m.get(*k), Some(*v));
            }
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
