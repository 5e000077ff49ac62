//! Which inactive block a pool evicts next: the eviction policies.
//!
//! A pool's registered blocks are active (someone holds them) or inactive
//! (kept for a later hit, held by no one). Only inactive blocks can be
//! evicted, so every policy orders the inactive ones, informed by what it
//! saw of all of them: registrations (a miss filled), hits (a prefix
//! match, a lookup, a touch, a duplicate registration) and releases.
//!
//! - [`EvictionPolicy::Lru`]: least recently released first, lower
//!   priority first. The pool keeps it in intrusive lists of its own (the
//!   fastest path; see `pool`); the others live here.
//! - [`EvictionPolicy::Lfu`]: fewest hits since registration first, least
//!   recently used among equals.
//! - [`EvictionPolicy::S3Fifo`]: S3-FIFO (Yang et al., SOSP 2023). New
//!   blocks enter a small FIFO (a tenth of the pool); one evicted from its
//!   end with no hit since it entered leaves its hash in a ghost FIFO (as
//!   many hashes as the main FIFO holds blocks), one with a hit moves to
//!   the main FIFO. A block registered while its hash is a ghost enters
//!   the main FIFO directly. The main FIFO's end is evicted unless it was
//!   hit: then it goes back to the front with one hit less (at most 3
//!   counted).
//! - [`EvictionPolicy::Arc`]: ARC (Megiddo and Modha, FAST 2003). Blocks
//!   seen once are in T1, blocks hit since in T2, both in recency order;
//!   ghosts B1 and B2 keep the hashes evicted from each, and a
//!   registration that finds its hash in B1 (B2) moves the target size of
//!   T1 up (down). The victim is T1's least recent while T1 is over its
//!   target, else T2's. Unlike the paper's REPLACE, which also looks at
//!   the key being inserted, the choice here is made when a block is
//!   allocated, before its hash is known.
//!
//! Held blocks cannot be evicted: they stay members of their queue or
//! list (and count towards its size) but are skipped until released. The
//! non-LRU policies ignore block priorities.

pub use crate::admission::Admission;
use crate::tokens::SequenceHash;
use kvbm_events::BlockId;
use std::collections::{BTreeSet, HashMap, VecDeque};

/// How a pool picks the inactive block to evict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum EvictionPolicy {
    /// Least recently released first, by priority (the default).
    #[default]
    Lru,
    /// Least frequently hit first.
    Lfu,
    /// S3-FIFO: a small probationary FIFO, a main FIFO, a ghost FIFO.
    S3Fifo,
    /// Adaptive replacement between recency and frequency.
    Arc,
}

impl EvictionPolicy {
    /// Every policy, in the order they are listed.
    pub const ALL: [EvictionPolicy; 4] = [
        EvictionPolicy::Lru,
        EvictionPolicy::Lfu,
        EvictionPolicy::S3Fifo,
        EvictionPolicy::Arc,
    ];

    /// Its name on command lines and in recordings (`lru`, `lfu`,
    /// `s3fifo`, `arc`).
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Lfu => "lfu",
            EvictionPolicy::S3Fifo => "s3fifo",
            EvictionPolicy::Arc => "arc",
        }
    }
}

impl std::fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name that is not one of [`EvictionPolicy::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown cache policy `{0}` (known: lru, lfu, s3fifo, arc, each also as tinylfu+POLICY)")]
pub struct UnknownPolicy(pub String);

impl std::str::FromStr for EvictionPolicy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EvictionPolicy::ALL
            .into_iter()
            .find(|p| p.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| UnknownPolicy(s.to_string()))
    }
}

/// A tier's cache policy: admission and eviction, written `lru`,
/// `s3fifo`, or `tinylfu+lru` (`tinylfu` alone is `tinylfu+lru`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct CachePolicy {
    /// Who gets in.
    pub admission: Admission,
    /// Who leaves.
    pub eviction: EvictionPolicy,
}

impl CachePolicy {
    /// Eviction `e`, admitting everything.
    pub const fn evict(e: EvictionPolicy) -> Self {
        CachePolicy {
            admission: Admission::All,
            eviction: e,
        }
    }
}

impl From<EvictionPolicy> for CachePolicy {
    fn from(e: EvictionPolicy) -> Self {
        CachePolicy::evict(e)
    }
}

impl std::fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.admission {
            Admission::All => write!(f, "{}", self.eviction),
            Admission::TinyLfu => write!(f, "tinylfu+{}", self.eviction),
        }
    }
}

impl std::str::FromStr for CachePolicy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        let (admission, rest) = match t.split_once('+') {
            Some(("tinylfu", e)) => (Admission::TinyLfu, e),
            Some(_) => return Err(UnknownPolicy(s.to_string())),
            None if t == "tinylfu" => (Admission::TinyLfu, "lru"),
            None => (Admission::All, t.as_str()),
        };
        let eviction = rest
            .parse::<EvictionPolicy>()
            .map_err(|_| UnknownPolicy(s.to_string()))?;
        Ok(CachePolicy {
            admission,
            eviction,
        })
    }
}

/// The policy of each tier: `POLICY` for every tier, or a comma list of
/// `TIER=POLICY` (`G1`, `G2`, `G3`, or `device`, `host`, `disk`), the
/// tiers not named keeping LRU: `s3fifo`, `G2=arc,G3=lfu`,
/// `G2=tinylfu+lru`. A policy is a [`CachePolicy`]: TinyLFU admission
/// applies to G2 and G3 only (G1 takes every block the engine computes),
/// so `tinylfu+lru` for every tier leaves G1 at plain `lru`, and
/// `G1=tinylfu+…` is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierEviction {
    /// G1.
    pub device: CachePolicy,
    /// G2.
    pub host: CachePolicy,
    /// G3.
    pub disk: CachePolicy,
}

/// A `--eviction` (or `eviction`) setting that does not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierEvictionError {
    /// A policy name.
    #[error(transparent)]
    Policy(#[from] UnknownPolicy),
    /// A tier name.
    #[error("unknown tier `{0}` (known: G1, G2, G3, device, host, disk)")]
    Tier(String),
    /// A tier named twice.
    #[error("tier {0} is given twice")]
    Twice(kvbm_events::Tier),
    /// Admission asked of G1.
    #[error(
        "admission (`{0}`) applies to G2 and G3 only: G1 takes every block the engine computes"
    )]
    DeviceAdmission(CachePolicy),
}

impl TierEviction {
    /// The same policy on every tier (G1 without its admission).
    pub fn all(p: impl Into<CachePolicy>) -> Self {
        let p = p.into();
        TierEviction {
            device: CachePolicy::evict(p.eviction),
            host: p,
            disk: p,
        }
    }

    /// The policy of `tier`.
    pub fn of(&self, tier: kvbm_events::Tier) -> CachePolicy {
        match tier {
            kvbm_events::Tier::Device => self.device,
            kvbm_events::Tier::Host => self.host,
            kvbm_events::Tier::Disk => self.disk,
        }
    }
}

impl std::fmt::Display for TierEviction {
    /// `G1=lru,G2=s3fifo,G3=lru`: reads back as the same setting.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "G1={},G2={},G3={}", self.device, self.host, self.disk)
    }
}

impl std::str::FromStr for TierEviction {
    type Err = TierEvictionError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        use kvbm_events::Tier;
        if !s.contains('=') {
            return Ok(TierEviction::all(s.parse::<CachePolicy>()?));
        }
        let mut out = TierEviction::default();
        let mut seen = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (tier, policy) = part
                .split_once('=')
                .ok_or_else(|| TierEvictionError::Tier(part.to_string()))?;
            let tier = match tier.trim().to_ascii_lowercase().as_str() {
                "g1" | "device" => Tier::Device,
                "g2" | "host" => Tier::Host,
                "g3" | "disk" => Tier::Disk,
                other => return Err(TierEvictionError::Tier(other.to_string())),
            };
            if seen.contains(&tier) {
                return Err(TierEvictionError::Twice(tier));
            }
            seen.push(tier);
            let p: CachePolicy = policy.parse()?;
            match tier {
                Tier::Device if p.admission != Admission::All => {
                    return Err(TierEvictionError::DeviceAdmission(p));
                }
                Tier::Device => out.device = p,
                Tier::Host => out.host = p,
                Tier::Disk => out.disk = p,
            }
        }
        Ok(out)
    }
}

/// Hits counted at most (S3-FIFO's two bits).
const S3_MAX_FREQ: u32 = 3;

/// Where a block is, for S3-FIFO (small or main FIFO) and ARC (T1 or T2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Queue {
    #[default]
    First,
    Second,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    member: bool,
    inactive: bool,
    queue: Queue,
    /// LFU and S3-FIFO: hits counted (S3-FIFO: since it entered its queue).
    freq: u32,
    /// Its place in its order: last use (LFU, ARC) or entry into its queue
    /// (S3-FIFO).
    tick: u64,
    hash: SequenceHash,
}

impl Default for Entry {
    fn default() -> Self {
        Entry {
            member: false,
            inactive: false,
            queue: Queue::First,
            freq: 0,
            tick: 0,
            hash: SequenceHash(0),
        }
    }
}

/// A bounded FIFO of evicted hashes. Taking a hash out is O(1): it leaves
/// the map at once and its place in the order is skipped when reached
/// (the order is compacted when more than half of it is such places).
#[derive(Debug, Default)]
struct Ghosts {
    order: VecDeque<(SequenceHash, u64)>,
    /// Live ghosts, with the number of the push that made each.
    live: HashMap<SequenceHash, u64>,
    pushes: u64,
}

impl Ghosts {
    fn push(&mut self, h: SequenceHash, cap: usize) {
        if cap == 0 || self.live.contains_key(&h) {
            return;
        }
        self.pushes += 1;
        self.live.insert(h, self.pushes);
        self.order.push_back((h, self.pushes));
        while self.live.len() > cap {
            self.pop_oldest();
        }
        if self.order.len() > 2 * self.live.len() + 64 {
            let live = &self.live;
            self.order.retain(|(h, n)| live.get(h) == Some(n));
        }
    }
    fn pop_oldest(&mut self) {
        while let Some((h, n)) = self.order.pop_front() {
            if self.live.get(&h) == Some(&n) {
                self.live.remove(&h);
                return;
            }
        }
    }
    fn take(&mut self, h: SequenceHash) -> bool {
        self.live.remove(&h).is_some()
    }
    fn len(&self) -> usize {
        self.live.len()
    }
}

/// The inactive blocks of a pool under LFU, S3-FIFO or ARC, with what the
/// policy remembers of every registered block. The pool calls
/// [`registered`](Self::registered) when a block is registered,
/// [`hit`](Self::hit) on every hit, [`released`](Self::released) when
/// the last holder lets go, [`revived`](Self::revived) when a hit takes an
/// inactive block back, and [`evict`](Self::evict) to choose a victim.
#[derive(Debug)]
pub(crate) struct Inactive {
    policy: EvictionPolicy,
    capacity: usize,
    entries: Vec<Entry>,
    /// Inactive blocks: `(freq, tick, id)` for LFU; `(0, tick, id)` per
    /// queue for S3-FIFO and ARC.
    first: BTreeSet<(u32, u64, BlockId)>,
    second: BTreeSet<(u32, u64, BlockId)>,
    /// Members of each queue, held ones included.
    first_len: usize,
    second_len: usize,
    ghosts: Ghosts,
    /// ARC's second ghost list (B2); `ghosts` is B1.
    ghosts2: Ghosts,
    /// ARC's target size of T1.
    target: usize,
    clock: u64,
}

impl Inactive {
    /// For a pool of `capacity` blocks under `policy`. A pool keeps LRU in
    /// its own lists and never builds one of these for it; the reference
    /// model of [`crate::cache_model`] does, and gets least recently
    /// released first.
    pub(crate) fn new(
        policy: EvictionPolicy,
        capacity: usize,
    ) -> Result<Self, std::collections::TryReserveError> {
        let mut entries = Vec::new();
        entries.try_reserve_exact(capacity)?;
        entries.resize(capacity, Entry::default());
        Ok(Inactive {
            policy,
            capacity,
            entries,
            first: BTreeSet::new(),
            second: BTreeSet::new(),
            first_len: 0,
            second_len: 0,
            ghosts: Ghosts::default(),
            ghosts2: Ghosts::default(),
            target: 0,
            clock: 0,
        })
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn key(&self, id: BlockId) -> (u32, u64, BlockId) {
        let e = &self.entries[id as usize];
        match self.policy {
            EvictionPolicy::Lfu => (e.freq, e.tick, id),
            _ => (0, e.tick, id),
        }
    }

    fn set_of(&mut self, q: Queue) -> &mut BTreeSet<(u32, u64, BlockId)> {
        match q {
            Queue::First => &mut self.first,
            Queue::Second => &mut self.second,
        }
    }

    /// Takes `id` out of its inactive set (if it is in one), runs `f` on
    /// its entry, and puts it back where the entry now says.
    fn reposition(&mut self, id: BlockId, f: impl FnOnce(&mut Entry, u64)) {
        let now = self.tick();
        let (was, q) = (self.key(id), self.entries[id as usize].queue);
        let inactive = self.entries[id as usize].inactive;
        if inactive {
            self.set_of(q).remove(&was);
        }
        f(&mut self.entries[id as usize], now);
        if inactive {
            let (k, q) = (self.key(id), self.entries[id as usize].queue);
            self.set_of(q).insert(k);
        }
    }

    fn count(&mut self, q: Queue, delta: isize) {
        let n = match q {
            Queue::First => &mut self.first_len,
            Queue::Second => &mut self.second_len,
        };
        *n = n.saturating_add_signed(delta);
    }

    /// Block `id` was registered under `hash` (held by its registrant).
    pub(crate) fn registered(&mut self, id: BlockId, hash: SequenceHash) {
        let now = self.tick();
        let queue = match self.policy {
            EvictionPolicy::S3Fifo if self.ghosts.take(hash) => Queue::Second,
            EvictionPolicy::Arc => self.arc_admit(hash),
            _ => Queue::First,
        };
        self.entries[id as usize] = Entry {
            member: true,
            inactive: false,
            queue,
            freq: 0,
            tick: now,
            hash,
        };
        self.count(queue, 1);
        if self.policy == EvictionPolicy::Arc {
            self.arc_trim_ghosts();
        }
    }

    /// ARC on a registration: which list the block enters, the target
    /// adapted when its hash was a ghost.
    fn arc_admit(&mut self, hash: SequenceHash) -> Queue {
        let (b1, b2) = (self.ghosts.len().max(1), self.ghosts2.len().max(1));
        if self.ghosts.take(hash) {
            self.target = (self.target + (b2 / b1).max(1)).min(self.capacity);
            Queue::Second
        } else if self.ghosts2.take(hash) {
            self.target = self.target.saturating_sub((b1 / b2).max(1));
            Queue::Second
        } else {
            Queue::First
        }
    }

    /// ARC keeps |T1| + |B1| ≤ c and everything ≤ 2c.
    fn arc_trim_ghosts(&mut self) {
        let c = self.capacity;
        while self.first_len + self.ghosts.len() > c && self.ghosts.len() > 0 {
            self.ghosts.pop_oldest();
        }
        while self.first_len + self.second_len + self.ghosts.len() + self.ghosts2.len() > 2 * c
            && self.ghosts2.len() > 0
        {
            self.ghosts2.pop_oldest();
        }
    }

    /// A hit on registered block `id` (held or not).
    pub(crate) fn hit(&mut self, id: BlockId) {
        if !self.entries[id as usize].member {
            return;
        }
        match self.policy {
            EvictionPolicy::Lfu => self.reposition(id, |e, now| {
                e.freq = e.freq.saturating_add(1);
                e.tick = now;
            }),
            // A FIFO: the place does not move, the count goes up.
            EvictionPolicy::S3Fifo => self.reposition(id, |e, _| {
                e.freq = (e.freq + 1).min(S3_MAX_FREQ);
            }),
            EvictionPolicy::Arc => {
                if self.entries[id as usize].queue == Queue::First {
                    self.count(Queue::First, -1);
                    self.count(Queue::Second, 1);
                }
                self.reposition(id, |e, now| {
                    e.queue = Queue::Second;
                    e.tick = now;
                });
            }
            EvictionPolicy::Lru => {}
        }
    }

    /// The last holder of `id` let go: it may be evicted now.
    pub(crate) fn released(&mut self, id: BlockId) {
        let e = self.entries[id as usize];
        if !e.member || e.inactive {
            return;
        }
        if self.policy == EvictionPolicy::Lru {
            // Least recently released first (the model of `cache_model`;
            // a pool keeps LRU in its own lists).
            let now = self.tick();
            self.entries[id as usize].tick = now;
        }
        let e = &mut self.entries[id as usize];
        e.inactive = true;
        let (k, q) = (self.key(id), self.entries[id as usize].queue);
        self.set_of(q).insert(k);
    }

    /// A hit took inactive `id` back (it is held again); [`hit`](Self::hit)
    /// is told separately.
    pub(crate) fn revived(&mut self, id: BlockId) {
        let e = self.entries[id as usize];
        if !e.member || !e.inactive {
            return;
        }
        let k = self.key(id);
        self.set_of(e.queue).remove(&k);
        self.entries[id as usize].inactive = false;
    }

    /// Up to `n` inactive blocks in the order [`evict`](Self::evict)
    /// would look at them if nothing else happened: LRU's and LFU's
    /// exactly; ARC's as its target stands now; S3-FIFO's the FIFO it
    /// would take from first, then the other (it may move a block that
    /// was hit on instead of evicting it: those moves are not played out).
    pub(crate) fn victims(&self, n: usize) -> Vec<BlockId> {
        let first_first = match self.policy {
            EvictionPolicy::Lru | EvictionPolicy::Lfu => true,
            EvictionPolicy::S3Fifo => {
                let small = (self.capacity / 10).max(1);
                !self.first.is_empty() && (self.first_len >= small || self.second.is_empty())
            }
            EvictionPolicy::Arc => {
                !self.first.is_empty() && (self.first_len > self.target || self.second.is_empty())
            }
        };
        let (a, b) = if first_first {
            (&self.first, &self.second)
        } else {
            (&self.second, &self.first)
        };
        a.iter().chain(b.iter()).map(|k| k.2).take(n).collect()
    }

    /// The first of [`victims`](Self::victims).
    pub(crate) fn peek(&self) -> Option<BlockId> {
        self.victims(1).first().copied()
    }

    /// Chooses an inactive block, forgets it and returns it; `None` when
    /// none is inactive.
    pub(crate) fn evict(&mut self) -> Option<BlockId> {
        let id = match self.policy {
            EvictionPolicy::Lru | EvictionPolicy::Lfu => self.first.pop_first()?.2,
            EvictionPolicy::S3Fifo => self.s3_victim()?,
            EvictionPolicy::Arc => self.arc_victim()?,
        };
        let e = std::mem::take(&mut self.entries[id as usize]);
        self.count(e.queue, -1);
        match (self.policy, e.queue) {
            (EvictionPolicy::S3Fifo, Queue::First) => {
                let cap = self.capacity - self.capacity / 10;
                self.ghosts.push(e.hash, cap);
            }
            (EvictionPolicy::Arc, Queue::First) => self.ghosts.push(e.hash, self.capacity),
            (EvictionPolicy::Arc, Queue::Second) => self.ghosts2.push(e.hash, self.capacity),
            _ => {}
        }
        if self.policy == EvictionPolicy::Arc {
            self.arc_trim_ghosts();
        }
        Some(id)
    }

    /// S3-FIFO's victim, taken out of its set (the entry is still there).
    fn s3_victim(&mut self) -> Option<BlockId> {
        let small = (self.capacity / 10).max(1);
        loop {
            let from_small =
                !self.first.is_empty() && (self.first_len >= small || self.second.is_empty());
            if from_small {
                let (_, _, id) = self.first.pop_first()?;
                if self.entries[id as usize].freq == 0 {
                    return Some(id);
                }
                // Hit while on probation: into the main FIFO, at its front.
                let now = self.tick();
                let e = &mut self.entries[id as usize];
                e.queue = Queue::Second;
                e.freq = 0;
                e.tick = now;
                self.count(Queue::First, -1);
                self.count(Queue::Second, 1);
                self.second.insert((0, now, id));
            } else {
                let (_, _, id) = self.second.pop_first()?;
                if self.entries[id as usize].freq == 0 {
                    return Some(id);
                }
                let now = self.tick();
                let e = &mut self.entries[id as usize];
                e.freq -= 1;
                e.tick = now;
                self.second.insert((0, now, id));
            }
        }
    }

    /// ARC's victim: T1's least recent while T1 is over its target (or T2
    /// has nothing to give), else T2's.
    fn arc_victim(&mut self) -> Option<BlockId> {
        let from_first =
            !self.first.is_empty() && (self.first_len > self.target || self.second.is_empty());
        let set = if from_first {
            &mut self.first
        } else {
            &mut self.second
        };
        set.pop_first().map(|(_, _, id)| id)
    }

    /// Every inactive block, in [`victims`](Self::victims)' order. For
    /// tests and diagnostics; O(inactive).
    pub(crate) fn order(&self) -> Vec<BlockId> {
        self.victims(usize::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_read_and_print_back() {
        for s in ["lru", "lfu", "s3fifo", "arc", "tinylfu+lru", "tinylfu+arc"] {
            let p: CachePolicy = s.parse().unwrap();
            assert_eq!(p.to_string(), s);
        }
        assert_eq!(
            "TinyLFU".parse::<CachePolicy>().unwrap().to_string(),
            "tinylfu+lru"
        );
        for bad in ["tinylfu+", "lfu+lru", "tinylfu+fifo", ""] {
            let e = bad.parse::<CachePolicy>().unwrap_err();
            assert!(e.to_string().contains("unknown"), "{bad}: {e}");
        }
    }

    fn h(n: u64) -> SequenceHash {
        SequenceHash(n)
    }

    /// Registers `ids` (hash = id) and releases them.
    fn fill(s: &mut Inactive, ids: &[u32]) {
        for &i in ids {
            s.registered(i, h(u64::from(i)));
            s.released(i);
        }
    }

    #[test]
    fn names_round_trip_and_unknown_ones_are_named() {
        for p in EvictionPolicy::ALL {
            assert_eq!(p.name().parse::<EvictionPolicy>(), Ok(p));
        }
        assert_eq!(
            "S3FIFO".parse::<EvictionPolicy>(),
            Ok(EvictionPolicy::S3Fifo)
        );
        let e = "lur".parse::<EvictionPolicy>().unwrap_err();
        assert!(e.to_string().contains("`lur`") && e.to_string().contains("s3fifo"));
    }

    #[test]
    fn tier_settings_read_one_policy_or_a_list_by_tier() {
        use kvbm_events::Tier;
        let all: TierEviction = "arc".parse().unwrap();
        assert_eq!(all, TierEviction::all(EvictionPolicy::Arc));
        let some: TierEviction = "G2=s3fifo, disk=lfu".parse().unwrap();
        assert_eq!(some.of(Tier::Device), EvictionPolicy::Lru.into());
        assert_eq!(some.of(Tier::Host), EvictionPolicy::S3Fifo.into());
        assert_eq!(some.of(Tier::Disk), EvictionPolicy::Lfu.into());
        assert_eq!(some.to_string().parse::<TierEviction>(), Ok(some));
        // Admission is for the tiers blocks are offered to.
        let t: TierEviction = "tinylfu+s3fifo".parse().unwrap();
        assert_eq!(
            t.to_string(),
            "G1=s3fifo,G2=tinylfu+s3fifo,G3=tinylfu+s3fifo"
        );
        assert_eq!(t.to_string().parse::<TierEviction>(), Ok(t));
        let e = "G1=tinylfu+lru".parse::<TierEviction>().unwrap_err();
        assert!(e.to_string().contains("G2 and G3 only"), "{e}");
        for bad in ["G4=lru", "G2=lfu,host=arc", "G2=fifo", "nope", "G2"] {
            let e = bad.parse::<TierEviction>().unwrap_err().to_string();
            assert!(e.contains("unknown") || e.contains("twice"), "{bad}: {e}");
        }
    }

    proptest::proptest! {
        /// Any text: a setting or an error, never a panic.
        #[test]
        fn any_text_reads_or_is_refused(s in ".{0,40}") {
            let _ = s.parse::<TierEviction>();
        }
    }

    #[test]
    fn lfu_evicts_the_least_hit_then_the_least_recent() {
        let mut s = Inactive::new(EvictionPolicy::Lfu, 8).unwrap();
        fill(&mut s, &[0, 1, 2, 3]);
        s.hit(0);
        s.hit(0);
        s.hit(2);
        assert_eq!(s.order(), vec![1, 3, 2, 0]);
        assert_eq!(s.evict(), Some(1));
        s.revived(3);
        assert_eq!(s.evict(), Some(2));
        assert_eq!(s.evict(), Some(0));
        assert_eq!(s.evict(), None);
    }

    #[test]
    fn s3fifo_gives_a_hit_block_a_second_chance_and_remembers_ghosts() {
        // 20 blocks: the small FIFO's target is 2.
        let mut s = Inactive::new(EvictionPolicy::S3Fifo, 20).unwrap();
        fill(&mut s, &[0, 1, 2]);
        s.hit(0);
        // 0 was hit on probation: it moves to the main FIFO; 1 goes.
        assert_eq!(s.evict(), Some(1));
        assert_eq!(s.entries[0].queue, Queue::Second);
        // 1's hash is a ghost: registered again, it enters the main FIFO.
        s.registered(5, h(1));
        assert_eq!(s.entries[5].queue, Queue::Second);
        s.released(5);
        // The small FIFO (2) is under target now: the main FIFO's oldest
        // goes, unless hit.
        assert_eq!(s.evict(), Some(0));
    }

    #[test]
    fn arc_moves_hit_blocks_to_t2_and_adapts_its_target_on_ghost_hits() {
        let mut s = Inactive::new(EvictionPolicy::Arc, 4).unwrap();
        fill(&mut s, &[0, 1, 2, 3]);
        s.hit(2);
        assert_eq!(s.entries[2].queue, Queue::Second);
        // T1 (3 blocks) is over its target (0): T1's least recent goes.
        assert_eq!(s.evict(), Some(0));
        assert_eq!(s.target, 0);
        // 0's hash in B1: registered again, the target grows, into T2.
        s.registered(0, h(0));
        assert_eq!((s.entries[0].queue, s.target), (Queue::Second, 1));
        s.released(0);
        // T1 (2) over its target (1): T1's least recent.
        assert_eq!(s.evict(), Some(1));
        // T1 (1) at its target: T2's least recent, twice; then T1's.
        assert_eq!(s.evict(), Some(2));
        assert_eq!(s.evict(), Some(0));
        assert_eq!(s.evict(), Some(3));
        assert_eq!(s.evict(), None);
    }
}
