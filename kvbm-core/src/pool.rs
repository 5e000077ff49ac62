//! A fixed-capacity pool of blocks for one tier (G1 device, G2 host, G3 disk).
//!
//! Every slot of the pool is in exactly one of four places:
//!
//! - **empty**: on the free list;
//! - **mutable**: owned by one [`MutableBlock`], being filled or computed;
//! - **active**: registered under its sequence hash and held by at least one
//!   [`ImmutableBlock`];
//! - **inactive**: registered, held by nobody; still found by prefix
//!   matching (a cache hit revives it) and the first to be evicted.
//!
//! *active* as reported by [`PoolStatus`] counts mutable and active
//! registered blocks together (both are in use), so `active + inactive +
//! empty == capacity` always.
//!
//! Allocation takes empty slots first, then evicts inactive blocks ordered by
//! (priority, least recently returned): the lowest priority goes first, and
//! within one priority the block that became inactive longest ago. Eviction
//! unregisters the block, which is what makes weak handles to it report
//! "gone". Registering a sequence hash that is already registered resolves to
//! the existing (primary) block; the new slot goes back to the free list.
//!
//! All state sits behind one mutex held for short, allocation-light critical
//! sections; block handles never drop while it is held (a drop re-enters the
//! pool). An optional [`PoolObserver`] hears about registrations and
//! evictions after the lock is released, so an observer may call back into
//! the pool.

use crate::admission::{Admission, FrequencySketch, tinylfu_admits};
use crate::block::{Complete, Empty, ImmutableBlock, MutableBlock, RegisteredBlock};
use crate::eviction::{EvictionPolicy, Inactive};
use crate::tokens::{BlockHash, BlockMeta, SaltHash, SequenceHash};
use kvbm_events::tier::{BlockId, Tier};
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// Errors from pool construction and allocation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// A pool needs at least one block.
    #[error("{tier} pool capacity must be at least 1 block (got 0)")]
    ZeroCapacity {
        /// Tier.
        tier: Tier,
    },
    /// A block needs at least one token.
    #[error("{tier} pool block size must be at least 1 token (got 0)")]
    ZeroBlockSize {
        /// Tier.
        tier: Tier,
    },
    /// Block ids are `u32`; more blocks than that cannot be addressed.
    #[error("{tier} pool capacity {capacity} exceeds the maximum of {max} blocks")]
    CapacityTooLarge {
        /// Tier.
        tier: Tier,
        /// What was asked.
        capacity: usize,
        /// The limit.
        max: usize,
    },
    /// The pool's bookkeeping (some 100 bytes a block) could not be
    /// allocated: a capacity far beyond the machine's memory.
    #[error(
        "{tier} pool of {capacity} blocks: its bookkeeping, about {bytes} bytes, could not be allocated"
    )]
    OutOfMemory {
        /// Tier.
        tier: Tier,
        /// What was asked.
        capacity: usize,
        /// About how many bytes that needs.
        bytes: u128,
    },
    /// Not enough empty or evictable blocks; nothing was allocated.
    #[error("{tier} pool exhausted: asked for {requested} blocks, {available} empty or evictable")]
    Exhausted {
        /// Tier.
        tier: Tier,
        /// Blocks asked for.
        requested: usize,
        /// Empty plus inactive blocks at the time.
        available: usize,
    },
}

/// How to build a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Which tier the pool manages.
    pub tier: Tier,
    /// Number of blocks.
    pub capacity: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Which inactive block goes first when room is needed.
    pub eviction: EvictionPolicy,
    /// Whether a block offered to the full pool is taken (see
    /// [`BlockPool::admits`]).
    pub admission: Admission,
}

/// Something the pool did, told to a [`PoolObserver`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolEvent {
    /// A block was registered under a sequence hash. `duplicate_of` is the
    /// primary block when the hash was already registered (then `block` went
    /// back to the free list).
    Registered {
        /// Tier.
        tier: Tier,
        /// The slot that was registered (or that was a duplicate).
        block: BlockId,
        /// Its sequence hash.
        sequence_hash: SequenceHash,
        /// The primary block, for a duplicate registration.
        duplicate_of: Option<BlockId>,
    },
    /// An inactive block was evicted to make room for an allocation.
    Evicted {
        /// Tier.
        tier: Tier,
        /// The slot.
        block: BlockId,
        /// The sequence hash it was registered under.
        sequence_hash: SequenceHash,
        /// Its priority.
        priority: u32,
    },
}

/// Hears what a pool does. Called after the pool's lock is released, from
/// the thread that caused the event. Keep it cheap: it runs on the engine's
/// hot path.
pub trait PoolObserver: Send + Sync {
    /// One thing happened.
    fn on_pool_event(&self, event: &PoolEvent);
}

/// Monotonic counters since the pool was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounters {
    /// Blocks handed out by `allocate`.
    pub allocated: u64,
    /// Allocation calls refused for lack of space.
    pub allocation_failures: u64,
    /// Inactive blocks evicted to make room.
    pub evictions: u64,
    /// Registrations that created a new registered block.
    pub registrations: u64,
    /// Registrations that resolved to an existing primary block.
    pub duplicate_registrations: u64,
    /// Sequence hashes looked up by prefix matching.
    pub match_lookups: u64,
    /// Of those, found (active or inactive).
    pub match_hits: u64,
    /// Inactive blocks brought back to active (by a match, a duplicate
    /// registration or a weak upgrade).
    pub revivals: u64,
    /// Blocks offered to the full pool that its admission policy turned
    /// away (see [`BlockPool::admits`]).
    pub not_admitted: u64,
}

/// A snapshot of a pool's occupancy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStatus {
    /// Tier.
    pub tier: Tier,
    /// Total blocks.
    pub capacity: usize,
    /// In use: mutable plus registered-and-held.
    pub active: usize,
    /// Of `active`, the mutable (unregistered) ones.
    pub mutable: usize,
    /// Registered, held by nobody, evictable.
    pub inactive: usize,
    /// On the free list.
    pub empty: usize,
    /// Counters since creation.
    pub counters: PoolCounters,
}

/// A pool of blocks for one tier. Cheap to clone (a shared handle).
#[derive(Clone)]
pub struct BlockPool {
    shared: Arc<PoolShared>,
}

impl std::fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockPool")
            .field("id", &self.shared.id)
            .field("status", &self.status())
            .finish()
    }
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

impl BlockPool {
    /// Builds a pool with every block empty.
    pub fn new(config: PoolConfig) -> Result<Self, PoolError> {
        Self::build(config, None)
    }

    /// Builds a pool that reports registrations and evictions to `observer`.
    pub fn with_observer(
        config: PoolConfig,
        observer: Arc<dyn PoolObserver>,
    ) -> Result<Self, PoolError> {
        Self::build(config, Some(observer))
    }

    fn build(
        config: PoolConfig,
        observer: Option<Arc<dyn PoolObserver>>,
    ) -> Result<Self, PoolError> {
        let tier = config.tier;
        if config.capacity == 0 {
            return Err(PoolError::ZeroCapacity { tier });
        }
        if config.block_size == 0 {
            return Err(PoolError::ZeroBlockSize { tier });
        }
        // NIL (u32::MAX) marks list ends, so the largest id is u32::MAX - 1.
        let max = (u32::MAX - 1) as usize;
        if config.capacity > max {
            return Err(PoolError::CapacityTooLarge {
                tier,
                capacity: config.capacity,
                max,
            });
        }
        // Reserved fallibly: a capacity from a user's configuration that
        // the machine cannot hold is an error naming it, not an abort.
        let out_of_memory = |_| {
            let per_block = std::mem::size_of::<BlockEntry>()
                + std::mem::size_of::<BlockId>()
                + std::mem::size_of::<(SequenceHash, BlockId)>();
            PoolError::OutOfMemory {
                tier,
                capacity: config.capacity,
                bytes: config.capacity as u128 * per_block as u128,
            }
        };
        let mut slots = Vec::new();
        slots
            .try_reserve_exact(config.capacity)
            .map_err(out_of_memory)?;
        slots.resize_with(config.capacity, BlockEntry::default);
        // Pop order 0, 1, 2, ...: a fresh pool hands out ids in order.
        let mut free = Vec::new();
        free.try_reserve_exact(config.capacity)
            .map_err(out_of_memory)?;
        free.extend((0..config.capacity as BlockId).rev());
        let mut registry = Registry::default();
        registry
            .try_reserve(config.capacity)
            .map_err(out_of_memory)?;
        let other = match config.eviction {
            EvictionPolicy::Lru => None,
            p => Some(Inactive::new(p, config.capacity).map_err(out_of_memory)?),
        };
        let sketch = match config.admission {
            Admission::All => None,
            Admission::TinyLfu => Some(FrequencySketch::new(config.capacity)),
        };
        Ok(BlockPool {
            shared: Arc::new(PoolShared {
                id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
                tier,
                capacity: config.capacity,
                block_size: config.block_size,
                observer,
                state: Mutex::new(PoolState {
                    slots,
                    free,
                    registry,
                    lru: BTreeMap::new(),
                    other,
                    sketch,
                    next_epoch: 1,
                    mutable: 0,
                    active_registered: 0,
                    inactive: 0,
                    counters: PoolCounters::default(),
                }),
            }),
        })
    }

    /// The tier this pool manages.
    pub fn tier(&self) -> Tier {
        self.shared.tier
    }
    /// Total blocks.
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }
    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.shared.block_size
    }
    /// Identity of this pool (unique per process); blocks carry it.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// Allocates `n` blocks: empty ones first, then by evicting inactive
    /// registered blocks in the pool's eviction order (under LRU: priority,
    /// then least recently returned; see [`crate::eviction`]). All
    /// or nothing: on [`PoolError::Exhausted`] nothing changed.
    pub fn allocate(&self, n: usize) -> Result<Vec<MutableBlock<Empty>>, PoolError> {
        let mut evicted = Vec::new();
        let ids = {
            let mut st = self.shared.lock();
            let available = st.free.len() + st.inactive;
            if n > available {
                st.counters.allocation_failures += 1;
                return Err(PoolError::Exhausted {
                    tier: self.shared.tier,
                    requested: n,
                    available,
                });
            }
            let mut ids = Vec::with_capacity(n);
            let want_events = self.shared.observer.is_some();
            for _ in 0..n {
                let id = match st.free.pop() {
                    Some(id) => id,
                    None => {
                        let ev = st.evict_one();
                        if want_events {
                            evicted.push(PoolEvent::Evicted {
                                tier: self.shared.tier,
                                block: ev.0,
                                sequence_hash: ev.1,
                                priority: ev.2,
                            });
                        }
                        ev.0
                    }
                };
                st.slots[id as usize].status = Status::Mutable;
                ids.push(id);
            }
            st.mutable += n;
            st.counters.allocated += n as u64;
            ids
        };
        self.shared.notify(&evicted);
        Ok(ids
            .into_iter()
            .map(|id| MutableBlock::new(self.shared.clone(), id, Empty))
            .collect())
    }

    /// Allocates one block.
    pub fn allocate_one(&self) -> Result<MutableBlock<Empty>, PoolError> {
        let mut v = self.allocate(1)?;
        Ok(v.remove(0))
    }

    /// Longest-prefix match: the registered blocks (active or inactive) for
    /// `hashes[0..k]`, stopping at the first hash that is not registered.
    /// Inactive hits are revived (they become active and leave the eviction
    /// order) because the caller now holds them.
    pub fn match_prefix(&self, hashes: &[SequenceHash]) -> Vec<ImmutableBlock> {
        let mut out = Vec::with_capacity(hashes.len());
        let mut st = self.shared.lock();
        for h in hashes {
            st.counters.match_lookups += 1;
            let Some(&id) = st.registry.get(h) else { break };
            st.counters.match_hits += 1;
            st.hit(id);
            out.push(st.activate(&self.shared, id));
        }
        out
    }

    /// The registered block for one sequence hash, if any (revived if
    /// inactive). Does not count as a prefix-match lookup.
    pub fn lookup(&self, hash: SequenceHash) -> Option<ImmutableBlock> {
        let mut st = self.shared.lock();
        let id = *st.registry.get(&hash)?;
        Some(st.activate(&self.shared, id))
    }

    /// The sequence hash block `id` is registered under (active or
    /// inactive); `None` for a block that is empty, still mutable, or out of
    /// range.
    pub fn hash_of(&self, id: BlockId) -> Option<SequenceHash> {
        let st = self.shared.lock();
        let e = st.slots.get(id as usize)?;
        matches!(e.status, Status::Active | Status::Inactive).then_some(e.meta.sequence_hash)
    }

    /// True when `hash` is registered here (active or inactive).
    pub fn contains(&self, hash: SequenceHash) -> bool {
        self.shared.lock().registry.contains_key(&hash)
    }

    /// Refreshes the recency of registered blocks so they are evicted later
    /// (under LRU an inactive block moves to the back of its priority's
    /// order; under the other policies it counts as a hit). Returns
    /// how many of the hashes are registered.
    pub fn touch(&self, hashes: &[SequenceHash]) -> usize {
        let mut st = self.shared.lock();
        let mut found = 0;
        for h in hashes {
            if let Some(&id) = st.registry.get(h) {
                found += 1;
                if st.other.is_some() {
                    st.hit(id);
                } else if st.slots[id as usize].status == Status::Inactive {
                    st.lru_unlink(id);
                    st.lru_push_back(id);
                }
            }
        }
        found
    }

    /// Counts a request's reference to each of `hashes` towards
    /// [`Admission::TinyLfu`] (nothing without it). The leader calls it
    /// once per request, with every full block of its prompt, at its first
    /// lookup: what the sketch counts is how often requests needed a block,
    /// whichever tier served it (see [`crate::admission`]).
    pub fn record_references(&self, hashes: &[SequenceHash]) {
        let mut st = self.shared.lock();
        if let Some(sketch) = st.sketch.as_mut() {
            for &h in hashes {
                sketch.record(h);
            }
        }
    }

    /// Which of `hashes`, offered to this pool together (an offload's
    /// blocks), are to be stored. Under [`Admission::All`] all of them.
    /// Under [`Admission::TinyLfu`] they are taken in order: one already
    /// registered, or for which an empty block remains, is admitted; the
    /// others are each compared with the next block an allocation would
    /// evict, and admitted only if requests referenced them more often
    /// (see [`crate::admission`]), an admitted one using that victim up.
    /// Refusals are counted in [`PoolCounters::not_admitted`].
    pub fn admits(&self, hashes: &[SequenceHash]) -> Vec<bool> {
        let mut st = self.shared.lock();
        let Some(sketch) = st.sketch.as_ref() else {
            return vec![true; hashes.len()];
        };
        let mut free = st.free.len();
        let victims = st.victims(hashes.len());
        let mut victims = victims.iter().peekable();
        let mut refused = 0;
        let out = hashes
            .iter()
            .map(|&h| {
                if st.registry.contains_key(&h) {
                    return true;
                }
                if free > 0 {
                    free -= 1;
                    return true;
                }
                let Some(&&v) = victims.peek() else {
                    return true; // nothing to evict: allocation decides
                };
                if tinylfu_admits(sketch, h, st.slots[v as usize].meta.sequence_hash) {
                    victims.next();
                    true
                } else {
                    refused += 1;
                    false
                }
            })
            .collect();
        st.counters.not_admitted += refused;
        out
    }

    /// True when the pool asks before it takes a block
    /// ([`Admission::TinyLfu`]).
    pub fn has_admission(&self) -> bool {
        self.shared.lock().sketch.is_some()
    }

    /// Occupancy and counters.
    pub fn status(&self) -> PoolStatus {
        let st = self.shared.lock();
        PoolStatus {
            tier: self.shared.tier,
            capacity: self.shared.capacity,
            active: st.mutable + st.active_registered,
            mutable: st.mutable,
            inactive: st.inactive,
            empty: st.free.len(),
            counters: st.counters,
        }
    }

    /// Every registered sequence hash (active or inactive). O(registered);
    /// for tests and diagnostics.
    pub fn registered_hashes(&self) -> std::collections::HashSet<SequenceHash> {
        self.shared.lock().registry.keys().copied().collect()
    }

    /// Sequence hashes of the inactive blocks in eviction order (next victim
    /// first). For tests and diagnostics; O(inactive).
    pub fn eviction_order(&self) -> Vec<SequenceHash> {
        let st = self.shared.lock();
        if let Some(o) = &st.other {
            return o
                .order()
                .into_iter()
                .map(|id| st.slots[id as usize].meta.sequence_hash)
                .collect();
        }
        let mut out = Vec::with_capacity(st.inactive);
        for list in st.lru.values() {
            let mut cur = list.head;
            while cur != NIL {
                out.push(st.slots[cur as usize].meta.sequence_hash);
                cur = st.slots[cur as usize].next;
            }
        }
        out
    }
}

impl MutableBlock<Complete> {
    /// Complete → Registered, at priority 0. See
    /// [`MutableBlock::register_with_priority`].
    pub fn register(self) -> ImmutableBlock {
        self.register_with_priority(0)
    }

    /// Complete → Registered in the block's own pool. If the sequence hash
    /// is already registered, the result is the primary block and this slot
    /// returns to the free list. `priority`: lower values are evicted first.
    pub fn register_with_priority(self, priority: u32) -> ImmutableBlock {
        let (pool, id, meta) = self.into_meta();
        let hash = meta.sequence_hash;
        let (block, duplicate_of) = {
            let mut st = pool.lock();
            st.mutable -= 1;
            if let Some(&primary) = st.registry.get(&hash) {
                st.slots[id as usize].status = Status::Empty;
                st.free.push(id);
                st.counters.duplicate_registrations += 1;
                st.hit(primary);
                (st.activate(&pool, primary), Some(primary))
            } else {
                st.registry.insert(hash, id);
                if let Some(o) = st.other.as_mut() {
                    o.registered(id, hash);
                }
                let slot = &mut st.slots[id as usize];
                slot.meta = meta;
                slot.priority = priority;
                st.active_registered += 1;
                st.counters.registrations += 1;
                (st.make_live(&pool, id), None)
            }
        };
        if pool.observer.is_some() {
            pool.notify(&[PoolEvent::Registered {
                tier: pool.tier,
                block: id,
                sequence_hash: hash,
                duplicate_of,
            }]);
        }
        block
    }
}

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Status {
    #[default]
    Empty,
    Mutable,
    Active,
    Inactive,
}

#[derive(Debug)]
struct BlockEntry {
    status: Status,
    /// Bumped on eviction: weak handles taken before it no longer upgrade.
    generation: u32,
    /// Epoch of the live `RegisteredBlock` for an active slot; a release
    /// carrying an older epoch was superseded by a revival and is ignored.
    epoch: u64,
    meta: BlockMeta,
    priority: u32,
    weak: Option<Weak<RegisteredBlock>>,
    prev: u32,
    next: u32,
}

impl Default for BlockEntry {
    fn default() -> Self {
        BlockEntry {
            status: Status::Empty,
            generation: 0,
            epoch: 0,
            meta: BlockMeta {
                salt_hash: SaltHash(0),
                block_hash: BlockHash(0),
                sequence_hash: SequenceHash(0),
                parent_sequence_hash: None,
                position: 0,
            },
            priority: 0,
            weak: None,
            prev: NIL,
            next: NIL,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct LruList {
    head: u32,
    tail: u32,
}

/// Sequence hashes are already xxh3 output: hashing them again is waste.
#[derive(Default)]
pub(crate) struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u64 keys; fold bytes so it stays correct.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Registry = HashMap<SequenceHash, BlockId, BuildHasherDefault<IdentityHasher>>;

struct PoolState {
    slots: Vec<BlockEntry>,
    free: Vec<BlockId>,
    registry: Registry,
    /// Inactive blocks under LRU: one intrusive list per priority, oldest
    /// first.
    lru: BTreeMap<u32, LruList>,
    /// Inactive blocks under any other policy (then `lru` stays empty).
    other: Option<Inactive>,
    /// Access frequencies, under TinyLFU admission.
    sketch: Option<FrequencySketch>,
    next_epoch: u64,
    mutable: usize,
    active_registered: usize,
    inactive: usize,
    counters: PoolCounters,
}

impl PoolState {
    /// A hit on registered block `id`, for the policies that count them
    /// (LRU orders by release only).
    fn hit(&mut self, id: BlockId) {
        if let Some(o) = self.other.as_mut() {
            o.hit(id);
        }
    }

    /// Up to `n` blocks allocations would evict next, in order.
    fn victims(&self, n: usize) -> Vec<BlockId> {
        if let Some(o) = &self.other {
            return o.victims(n);
        }
        let mut out = Vec::with_capacity(n.min(self.inactive));
        for list in self.lru.values() {
            let mut cur = list.head;
            while cur != NIL && out.len() < n {
                out.push(cur);
                cur = self.slots[cur as usize].next;
            }
        }
        out
    }

    fn lru_push_back(&mut self, id: BlockId) {
        let prio = self.slots[id as usize].priority;
        let list = self.lru.entry(prio).or_insert(LruList {
            head: NIL,
            tail: NIL,
        });
        let old_tail = list.tail;
        if old_tail == NIL {
            list.head = id;
        }
        list.tail = id;
        if old_tail != NIL {
            self.slots[old_tail as usize].next = id;
        }
        let s = &mut self.slots[id as usize];
        s.prev = old_tail;
        s.next = NIL;
    }

    fn lru_unlink(&mut self, id: BlockId) {
        let (prev, next, prio) = {
            let s = &self.slots[id as usize];
            (s.prev, s.next, s.priority)
        };
        if prev != NIL {
            self.slots[prev as usize].next = next;
        }
        if next != NIL {
            self.slots[next as usize].prev = prev;
        }
        let mut empty = false;
        if let Some(list) = self.lru.get_mut(&prio) {
            if list.head == id {
                list.head = next;
            }
            if list.tail == id {
                list.tail = prev;
            }
            empty = list.head == NIL;
        }
        if empty {
            self.lru.remove(&prio);
        }
        let s = &mut self.slots[id as usize];
        s.prev = NIL;
        s.next = NIL;
    }

    /// Evicts the next victim and hands its slot out as mutable. The caller
    /// has checked that an inactive block exists.
    fn evict_one(&mut self) -> (BlockId, SequenceHash, u32) {
        let id = match &mut self.other {
            Some(o) => o.evict(),
            None => self.lru.values().next().map(|list| list.head),
        };
        let Some(id) = id else {
            unreachable!("evict_one called with no inactive block")
        };
        if self.other.is_none() {
            self.lru_unlink(id);
        }
        let slot = &mut self.slots[id as usize];
        let hash = slot.meta.sequence_hash;
        let prio = slot.priority;
        slot.generation = slot.generation.wrapping_add(1);
        slot.status = Status::Mutable;
        self.registry.remove(&hash);
        self.inactive -= 1;
        self.counters.evictions += 1;
        (id, hash, prio)
    }

    /// A strong handle to registered block `id`: the live one if someone
    /// holds it, else a fresh one (reviving an inactive block).
    fn activate(&mut self, pool: &Arc<PoolShared>, id: BlockId) -> ImmutableBlock {
        let idx = id as usize;
        match self.slots[idx].status {
            Status::Active => {
                if let Some(live) = self.slots[idx].weak.as_ref().and_then(Weak::upgrade) {
                    return ImmutableBlock(live);
                }
                // The last handle is being dropped on another thread and has
                // not reached the lock yet: supersede it with a new epoch.
            }
            Status::Inactive => {
                match self.other.as_mut() {
                    Some(o) => o.revived(id),
                    None => self.lru_unlink(id),
                }
                self.inactive -= 1;
                self.active_registered += 1;
                self.counters.revivals += 1;
            }
            Status::Empty | Status::Mutable => {
                unreachable!("activate on an unregistered slot")
            }
        }
        self.make_live(pool, id)
    }

    /// Creates the `Arc` for a registered slot under a fresh epoch.
    fn make_live(&mut self, pool: &Arc<PoolShared>, id: BlockId) -> ImmutableBlock {
        let idx = id as usize;
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let slot = &mut self.slots[idx];
        slot.status = Status::Active;
        slot.epoch = epoch;
        let arc = Arc::new(RegisteredBlock::new(
            pool.clone(),
            id,
            epoch,
            slot.generation,
            slot.meta,
            slot.priority,
        ));
        slot.weak = Some(Arc::downgrade(&arc));
        ImmutableBlock(arc)
    }
}

/// Revival of a weak handle through the pool.
pub(crate) enum RevivedOrGone {
    Revived(ImmutableBlock),
    Gone,
}

/// The part of a pool that blocks point back to.
pub struct PoolShared {
    id: u64,
    tier: Tier,
    capacity: usize,
    block_size: usize,
    observer: Option<Arc<dyn PoolObserver>>,
    state: Mutex<PoolState>,
}

impl PoolShared {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // No code path panics while holding the lock, so a poisoned mutex
        // still guards consistent state; keep going rather than cascade.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self, events: &[PoolEvent]) {
        if let Some(obs) = &self.observer {
            for e in events {
                obs.on_pool_event(e);
            }
        }
    }

    pub(crate) fn tier(&self) -> Tier {
        self.tier
    }
    pub(crate) fn id(&self) -> u64 {
        self.id
    }
    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// A mutable block was dropped: its slot goes back to the free list.
    pub(crate) fn release_mutable(&self, id: BlockId) {
        let mut st = self.lock();
        st.slots[id as usize].status = Status::Empty;
        st.free.push(id);
        st.mutable -= 1;
    }

    /// The last strong handle of a registration was dropped.
    pub(crate) fn release_registered(&self, id: BlockId, epoch: u64) {
        let mut st = self.lock();
        let slot = &mut st.slots[id as usize];
        if slot.status != Status::Active || slot.epoch != epoch {
            return; // superseded by a revival
        }
        slot.status = Status::Inactive;
        slot.weak = None;
        st.active_registered -= 1;
        st.inactive += 1;
        match st.other.as_mut() {
            Some(o) => o.released(id),
            None => st.lru_push_back(id),
        }
    }

    pub(crate) fn revive(pool: &Arc<PoolShared>, id: BlockId, generation: u32) -> RevivedOrGone {
        let mut st = pool.lock();
        let slot = &st.slots[id as usize];
        if slot.generation != generation
            || !matches!(slot.status, Status::Active | Status::Inactive)
        {
            return RevivedOrGone::Gone;
        }
        RevivedOrGone::Revived(st.activate(pool, id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::{SaltHash, TokenSequence};

    fn pool(cap: usize) -> BlockPool {
        BlockPool::new(PoolConfig {
            tier: Tier::Device,
            capacity: cap,
            block_size: 4,
            eviction: Default::default(),
            admission: Default::default(),
        })
        .unwrap()
    }

    fn seq(n_blocks: usize, seed: u32) -> TokenSequence {
        let toks: Vec<u32> = (0..(n_blocks * 4) as u32)
            .map(|t| t + seed * 1000)
            .collect();
        TokenSequence::from_tokens(&toks, 4, SaltHash(9)).unwrap()
    }

    fn register_all(p: &BlockPool, s: &TokenSequence) -> Vec<ImmutableBlock> {
        p.allocate(s.blocks().len())
            .unwrap()
            .into_iter()
            .zip(s.blocks())
            .map(|(b, tb)| b.fill_from(tb).unwrap().register())
            .collect()
    }

    fn check(p: &BlockPool) -> PoolStatus {
        let s = p.status();
        assert_eq!(s.active + s.inactive + s.empty, s.capacity, "{s:?}");
        s
    }

    /// The most blocks a pool may have need some 400 GB of bookkeeping:
    /// where the kernel refuses such an allocation (overcommit's default
    /// heuristic, less memory than that), building the pool is an error
    /// naming the tier and the capacity, not an abort. Elsewhere it could
    /// succeed and take the memory, so the test says it did not run.
    #[test]
    fn a_pool_the_machine_cannot_hold_is_an_error() {
        let capacity = (u32::MAX - 1) as usize;
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib = |key: &str| -> u128 {
            meminfo
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(u128::MAX / 4096)
        };
        let heuristic = std::fs::read_to_string("/proc/sys/vm/overcommit_memory")
            .is_ok_and(|v| v.trim() == "0");
        let have = (kib("MemTotal:") + kib("SwapTotal:")) * 1024;
        let need = capacity as u128 * std::mem::size_of::<BlockEntry>() as u128;
        if !heuristic || have * 2 > need {
            eprintln!("not run: this kernel may grant {need} bytes (memory and swap: {have})");
            return;
        }
        let e = BlockPool::new(PoolConfig {
            tier: Tier::Host,
            capacity,
            block_size: 16,
            eviction: Default::default(),
            admission: Default::default(),
        })
        .unwrap_err();
        assert!(
            matches!(e, PoolError::OutOfMemory { tier: Tier::Host, capacity: c, .. } if c == capacity),
            "{e:?}"
        );
        assert!(e.to_string().contains(&capacity.to_string()), "{e}");
    }

    #[test]
    fn bad_configs_are_errors() {
        let e = BlockPool::new(PoolConfig {
            tier: Tier::Host,
            capacity: 0,
            block_size: 4,
            eviction: Default::default(),
            admission: Default::default(),
        })
        .unwrap_err();
        assert_eq!(e, PoolError::ZeroCapacity { tier: Tier::Host });
        let e = BlockPool::new(PoolConfig {
            tier: Tier::Host,
            capacity: 3,
            block_size: 0,
            eviction: Default::default(),
            admission: Default::default(),
        })
        .unwrap_err();
        assert_eq!(e, PoolError::ZeroBlockSize { tier: Tier::Host });
        assert!(e.to_string().contains("block size"));
    }

    #[test]
    fn full_lifecycle_through_typestates() {
        let p = pool(2);
        let b = p.allocate_one().unwrap().init(SaltHash(9), None, 0);
        let mut b = b;
        assert_eq!(b.add_tokens(&[0, 1, 2]), 3);
        let r = b.ready().unwrap().schedule_compute();
        let b = match r.compute_done() {
            crate::block::ComputeDone::Partial(b) => b,
            other => panic!("expected partial, got {other:?}"),
        };
        // Nothing new to compute: refused, and the block comes back.
        let err = b.ready().unwrap_err();
        let mut b = err.block;
        assert_eq!(b.add_tokens(&[3, 4, 5]), 1, "only one slot left");
        let r = b.ready().unwrap();
        let b = r.cancel_schedule().ready().unwrap().schedule_compute();
        let c = match b.compute_done() {
            crate::block::ComputeDone::Complete(c) => c,
            other => panic!("expected complete, got {other:?}"),
        };
        assert_eq!(c.sequence_hash(), seq(1, 0).blocks()[0].sequence_hash());
        let imm = c.register();
        assert_eq!(check(&p).active, 1);
        drop(imm);
        let s = check(&p);
        assert_eq!((s.active, s.inactive, s.empty), (0, 1, 1));
    }

    #[test]
    fn dropping_a_mutable_block_frees_it() {
        let p = pool(3);
        let v = p.allocate(3).unwrap();
        assert!(matches!(p.allocate(1), Err(PoolError::Exhausted { .. })));
        assert_eq!(p.status().counters.allocation_failures, 1);
        drop(v);
        assert_eq!(check(&p).empty, 3);
    }

    #[test]
    fn duplicate_registration_resolves_to_primary() {
        let p = pool(4);
        let s = seq(1, 1);
        let a = register_all(&p, &s);
        let b = register_all(&p, &s);
        assert_eq!(a[0].id(), b[0].id());
        let st = check(&p);
        assert_eq!((st.active, st.empty), (1, 3));
        assert_eq!(st.counters.duplicate_registrations, 1);
        // Duplicate of an inactive primary revives it.
        drop((a, b));
        let c = register_all(&p, &s);
        assert_eq!(check(&p).inactive, 0);
        assert_eq!(c[0].strong_count(), 1);
    }

    #[test]
    fn prefix_match_stops_at_first_miss() {
        let p = pool(8);
        let s = seq(4, 2);
        let held = register_all(&p, &s);
        let mut hashes = s.sequence_hashes();
        hashes[2] = SequenceHash(12345);
        let m = p.match_prefix(&hashes);
        assert_eq!(m.len(), 2);
        assert_eq!(m[1].id(), held[1].id());
        drop(held);
        // Inactive blocks match too, and are revived.
        let m = p.match_prefix(&s.sequence_hashes());
        assert_eq!(m.len(), 4);
        assert_eq!(check(&p).inactive, 0);
    }

    #[test]
    fn eviction_is_lowest_priority_then_least_recently_returned() {
        let p = pool(4);
        let s = seq(4, 3);
        let blocks: Vec<_> = p
            .allocate(4)
            .unwrap()
            .into_iter()
            .zip(s.blocks())
            .enumerate()
            .map(|(i, (b, tb))| {
                let prio = if i == 3 { 0 } else { 5 };
                b.fill_from(tb).unwrap().register_with_priority(prio)
            })
            .collect();
        let h: Vec<_> = s.sequence_hashes();
        // Return order: 1, 0, 3, 2.
        let mut blocks: Vec<Option<ImmutableBlock>> = blocks.into_iter().map(Some).collect();
        for i in [1, 0, 3, 2] {
            blocks[i].take();
        }
        assert_eq!(p.eviction_order(), vec![h[3], h[1], h[0], h[2]]);
        // Touch moves block 1 behind its priority peers.
        p.touch(&[h[1]]);
        assert_eq!(p.eviction_order(), vec![h[3], h[0], h[2], h[1]]);
        let got = p.allocate(2).unwrap();
        assert_eq!(p.eviction_order(), vec![h[2], h[1]]);
        assert!(!p.contains(h[3]) && !p.contains(h[0]));
        assert_eq!(p.status().counters.evictions, 2);
        drop(got);
    }

    #[test]
    fn weak_handles_upgrade_or_report_gone() {
        let p = pool(1);
        let s = seq(1, 4);
        let held = register_all(&p, &s);
        let w = held[0].downgrade();
        assert_eq!(w.upgrade().unwrap().id(), held[0].id());
        drop(held);
        // Inactive but not evicted: revives through the pool.
        let again = w.upgrade().unwrap();
        assert_eq!(check(&p).inactive, 0);
        drop(again);
        // Evicted: gone, with a message naming the block.
        let _m = p.allocate(1).unwrap();
        let err = w.upgrade().unwrap_err();
        assert!(err.to_string().contains("gone"), "{err}");
    }

    #[test]
    fn observer_hears_registrations_and_evictions() {
        #[derive(Default)]
        struct Log(Mutex<Vec<PoolEvent>>);
        impl PoolObserver for Log {
            fn on_pool_event(&self, e: &PoolEvent) {
                // Calling back into the pool must not deadlock; the lock is
                // released before observers run.
                self.0.lock().unwrap().push(e.clone());
            }
        }
        let log = Arc::new(Log::default());
        let p = BlockPool::with_observer(
            PoolConfig {
                tier: Tier::Host,
                capacity: 1,
                block_size: 4,
                eviction: Default::default(),
                admission: Default::default(),
            },
            log.clone(),
        )
        .unwrap();
        drop(register_all(&p, &seq(1, 5)));
        let _b = p.allocate(1).unwrap();
        let ev = log.0.lock().unwrap().clone();
        assert!(matches!(
            ev[0],
            PoolEvent::Registered {
                duplicate_of: None,
                ..
            }
        ));
        assert!(matches!(ev[1], PoolEvent::Evicted { block: 0, .. }));
    }

    #[test]
    fn concurrent_drops_and_matches_keep_counts_consistent() {
        let p = pool(64);
        let s = seq(32, 6);
        drop(register_all(&p, &s));
        let hashes = s.sequence_hashes();
        std::thread::scope(|sc| {
            for _ in 0..2 {
                sc.spawn(|| {
                    for _ in 0..2000 {
                        let m = p.match_prefix(&hashes);
                        assert_eq!(m.len(), 32);
                        let w: Vec<_> = m.iter().map(|b| b.downgrade()).collect();
                        drop(m);
                        for w in &w {
                            assert!(w.upgrade().is_ok());
                        }
                    }
                });
            }
        });
        let st = check(&p);
        assert_eq!((st.active, st.inactive, st.empty), (0, 32, 32));
    }
}
