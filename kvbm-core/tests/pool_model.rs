//! State-machine test of `BlockPool` against a simple reference model,
//! under every eviction policy, with and without TinyLFU admission.
//!
//! Random sequences of allocate / fill+register / match / drop / touch /
//! weak-upgrade run against the real pool and a model made of plain
//! counters, sorted lists and, per policy, a naive reference of the
//! policy's rules (scans over the registered hashes, no index). After every
//! step: the counts agree with the model and add up to capacity, the same
//! hashes are registered (so every eviction chose the model's victim), the
//! eviction order as it stands agrees (S3-FIFO's and ARC's without the
//! moves an eviction makes), no
//! block id is held by two owners, and no block leaks (dropping everything
//! at the end leaves every block empty or inactive). An offer (`admits`)
//! is answered as the model answers it: the references recorded counted in
//! a frequency sketch of the model's own, and an offer to a full pool
//! admitted only when the sketch saw it more often than the model's next
//! victim. (The sketch itself is tested in `kvbm_core::admission`.)

use kvbm_core::admission::{Admission, FrequencySketch};
use kvbm_core::block::{Empty, MutableBlock};
use kvbm_core::{
    BlockPool, CachePolicy, EvictionPolicy, ImmutableBlock, PoolConfig, PoolError, SequenceHash,
    Tier, TokenSequence, WeakBlock,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashSet};

const CHAIN: usize = 6;

#[derive(Debug, Clone)]
enum Op {
    Allocate(usize),
    Register {
        mutable: usize,
        key: usize,
        prio: u32,
    },
    Match(usize),
    DropImmutable(usize),
    DropMutable(usize),
    Touch(usize),
    Downgrade(usize),
    Upgrade(usize),
    Offer(Vec<usize>),
    Reference(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..4).prop_map(Op::Allocate),
        4 => (any::<usize>(), 0..CHAIN, 0u32..3)
            .prop_map(|(mutable, key, prio)| Op::Register { mutable, key, prio }),
        2 => (1..=CHAIN).prop_map(Op::Match),
        4 => any::<usize>().prop_map(Op::DropImmutable),
        1 => any::<usize>().prop_map(Op::DropMutable),
        1 => (0..CHAIN).prop_map(Op::Touch),
        1 => any::<usize>().prop_map(Op::Downgrade),
        2 => any::<usize>().prop_map(Op::Upgrade),
        2 => proptest::collection::vec(0..CHAIN, 1..4).prop_map(Op::Offer),
        2 => (1..=CHAIN).prop_map(Op::Reference),
    ]
}

#[derive(Debug, Clone)]
struct Reg {
    refs: usize,
    prio: u32,
    /// Increments on every new registration of a hash; weak handles from an
    /// older instance must report "gone".
    instance: u64,
    /// Place in the eviction order while inactive.
    inactive_since: Option<u64>,
    /// The policies' own record: hits counted, S3-FIFO's queue or ARC's
    /// list (1 or 2), and the tick that orders it.
    freq: u32,
    queue: u8,
    ptick: u64,
}

#[derive(Debug, Default)]
struct Model {
    empty: usize,
    mutable: usize,
    regs: BTreeMap<u64, Reg>,
    clock: u64,
    instances: u64,
    policy: EvictionPolicy,
    capacity: usize,
    /// S3-FIFO's ghost FIFO, or ARC's B1; oldest first.
    ghosts: Vec<u64>,
    /// ARC's B2.
    ghosts2: Vec<u64>,
    /// ARC's target size of T1.
    target: usize,
    /// Under TinyLFU admission, every access counted.
    sketch: Option<FrequencySketch>,
}

/// The reference policies, written from their rules (see
/// `kvbm_core::eviction`) as plainly as possible.
impl Model {
    fn inactive_in(&self, queue: u8) -> Vec<u64> {
        let mut v: Vec<(u64, u64)> = self
            .regs
            .iter()
            .filter(|(_, r)| r.inactive_since.is_some() && r.queue == queue)
            .map(|(h, r)| (r.ptick, *h))
            .collect();
        v.sort();
        v.into_iter().map(|(_, h)| h).collect()
    }
    fn members(&self, queue: u8) -> usize {
        self.regs.values().filter(|r| r.queue == queue).count()
    }
    fn push_ghost(ghosts: &mut Vec<u64>, h: u64, cap: usize) {
        if cap == 0 || ghosts.contains(&h) {
            return;
        }
        ghosts.push(h);
        while ghosts.len() > cap {
            ghosts.remove(0);
        }
    }
    fn take_ghost(ghosts: &mut Vec<u64>, h: u64) -> bool {
        let before = ghosts.len();
        ghosts.retain(|g| *g != h);
        ghosts.len() < before
    }
    fn arc_trim(&mut self) {
        let c = self.capacity;
        while self.members(1) + self.ghosts.len() > c && !self.ghosts.is_empty() {
            self.ghosts.remove(0);
        }
        while self.regs.len() + self.ghosts.len() + self.ghosts2.len() > 2 * c
            && !self.ghosts2.is_empty()
        {
            self.ghosts2.remove(0);
        }
    }
    /// A new registration of `h` (already in `regs`).
    fn policy_registered(&mut self, h: u64) {
        let now = self.tick();
        let queue = match self.policy {
            EvictionPolicy::S3Fifo if Self::take_ghost(&mut self.ghosts, h) => 2,
            EvictionPolicy::Arc => {
                let (b1, b2) = (self.ghosts.len().max(1), self.ghosts2.len().max(1));
                if Self::take_ghost(&mut self.ghosts, h) {
                    self.target = (self.target + (b2 / b1).max(1)).min(self.capacity);
                    2
                } else if Self::take_ghost(&mut self.ghosts2, h) {
                    self.target = self.target.saturating_sub((b1 / b2).max(1));
                    2
                } else {
                    1
                }
            }
            _ => 1,
        };
        let r = self.regs.get_mut(&h).expect("registered");
        (r.freq, r.queue, r.ptick) = (0, queue, now);
        if self.policy == EvictionPolicy::Arc {
            self.arc_trim();
        }
    }
    /// A hit on registered `h`.
    fn policy_hit(&mut self, h: u64) {
        let now = self.tick();
        let policy = self.policy;
        let r = self.regs.get_mut(&h).expect("registered");
        match policy {
            EvictionPolicy::Lfu => (r.freq, r.ptick) = (r.freq + 1, now),
            EvictionPolicy::S3Fifo => r.freq = (r.freq + 1).min(3),
            EvictionPolicy::Arc => (r.queue, r.ptick) = (2, now),
            EvictionPolicy::Lru => {}
        }
    }
    /// Chooses the victim, plays out the policy's moves and forgets it.
    fn evict(&mut self) -> u64 {
        let victim = match self.policy {
            EvictionPolicy::S3Fifo => self.s3fifo_victim(),
            // LRU's, LFU's and ARC's first victim moves nothing.
            _ => self.victim_order()[0],
        };
        let r = self.regs.remove(&victim).expect("victim registered");
        let cap = self.capacity;
        match (self.policy, r.queue) {
            (EvictionPolicy::S3Fifo, 1) => {
                Self::push_ghost(&mut self.ghosts, victim, cap - cap / 10)
            }
            (EvictionPolicy::Arc, 1) => Self::push_ghost(&mut self.ghosts, victim, cap),
            (EvictionPolicy::Arc, _) => Self::push_ghost(&mut self.ghosts2, victim, cap),
            _ => {}
        }
        if self.policy == EvictionPolicy::Arc {
            self.arc_trim();
        }
        victim
    }
    fn s3fifo_victim(&mut self) -> u64 {
        let small = (self.capacity / 10).max(1);
        loop {
            let (s, m) = (self.inactive_in(1), self.inactive_in(2));
            let now = self.tick();
            if !s.is_empty() && (self.members(1) >= small || m.is_empty()) {
                let r = self.regs.get_mut(&s[0]).unwrap();
                if r.freq == 0 {
                    return s[0];
                }
                (r.queue, r.freq, r.ptick) = (2, 0, now);
            } else {
                let r = self.regs.get_mut(&m[0]).unwrap();
                if r.freq == 0 {
                    return m[0];
                }
                (r.freq, r.ptick) = (r.freq - 1, now);
            }
        }
    }
}

impl Model {
    fn inactive_order(&self) -> Vec<u64> {
        let mut v: Vec<(u32, u64, u64)> = self
            .regs
            .iter()
            .filter_map(|(h, r)| r.inactive_since.map(|t| (r.prio, t, *h)))
            .collect();
        v.sort();
        v.into_iter().map(|(_, _, h)| h).collect()
    }
    /// A mutable block registered under `h`: a new registration, or a
    /// duplicate whose slot goes back (a hit on the primary).
    fn register(&mut self, h: u64, prio: u32) {
        self.mutable -= 1;
        if self.regs.contains_key(&h) {
            self.empty += 1;
            self.policy_hit(h);
            self.take_ref(h);
            return;
        }
        self.instances += 1;
        self.regs.insert(
            h,
            Reg {
                refs: 1,
                prio,
                instance: self.instances,
                inactive_since: None,
                freq: 0,
                queue: 1,
                ptick: 0,
            },
        );
        self.policy_registered(h);
    }
    /// `touch` of `h`: LRU moves an inactive block to the back; the
    /// other policies count a hit.
    fn touch(&mut self, h: u64) {
        if self.policy != EvictionPolicy::Lru {
            if self.regs.contains_key(&h) {
                self.policy_hit(h);
            }
            return;
        }
        let t = self.tick();
        if let Some(r) = self.regs.get_mut(&h)
            && r.inactive_since.is_some()
        {
            r.inactive_since = Some(t);
        }
    }
    /// The inactive blocks in the order evictions would look at them,
    /// moving nothing (S3-FIFO: the FIFO it takes from first, then the
    /// other; ARC: by its target as it stands).
    fn victim_order(&self) -> Vec<u64> {
        let chain = |a: Vec<u64>, b: Vec<u64>| a.into_iter().chain(b).collect();
        match self.policy {
            EvictionPolicy::Lru => self.inactive_order(),
            EvictionPolicy::Lfu => {
                let mut v: Vec<(u32, u64, u64)> = self
                    .regs
                    .iter()
                    .filter(|(_, r)| r.inactive_since.is_some())
                    .map(|(h, r)| (r.freq, r.ptick, *h))
                    .collect();
                v.sort();
                v.into_iter().map(|x| x.2).collect()
            }
            EvictionPolicy::S3Fifo => {
                let (s, m) = (self.inactive_in(1), self.inactive_in(2));
                let small = (self.capacity / 10).max(1);
                if !s.is_empty() && (self.members(1) >= small || m.is_empty()) {
                    chain(s, m)
                } else {
                    chain(m, s)
                }
            }
            EvictionPolicy::Arc => {
                let (t1, t2) = (self.inactive_in(1), self.inactive_in(2));
                if !t1.is_empty() && (self.members(1) > self.target || t2.is_empty()) {
                    chain(t1, t2)
                } else {
                    chain(t2, t1)
                }
            }
        }
    }
    /// Which of `keys`, offered together, are admitted: in order, each
    /// not registered and with no empty block left against the next
    /// victim, which an admitted one uses up.
    fn offer(&self, keys: &[u64]) -> Vec<bool> {
        let Some(s) = self.sketch.as_ref() else {
            return vec![true; keys.len()];
        };
        let mut empty = self.empty;
        let mut victims = self.victim_order().into_iter();
        let mut next = victims.next();
        keys.iter()
            .map(|&h| {
                if self.regs.contains_key(&h) {
                    return true;
                }
                if empty > 0 {
                    empty -= 1;
                    return true;
                }
                let Some(v) = next else { return true };
                let yes = s.estimate(SequenceHash(h)) > s.estimate(SequenceHash(v));
                if yes {
                    next = victims.next();
                }
                yes
            })
            .collect()
    }
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }
    fn take_ref(&mut self, h: u64) {
        let r = self.regs.get_mut(&h).expect("registered");
        r.refs += 1;
        r.inactive_since = None;
    }
    fn drop_ref(&mut self, h: u64) {
        let t = self.tick();
        let r = self.regs.get_mut(&h).expect("registered");
        r.refs -= 1;
        if r.refs == 0 {
            r.inactive_since = Some(t);
        }
    }
}

fn chain() -> TokenSequence {
    let toks: Vec<u32> = (0..(CHAIN * 4) as u32).collect();
    TokenSequence::from_tokens(&toks, 4, kvbm_core::tokens::salt_hash(b"model")).unwrap()
}

fn run(capacity: usize, ops: Vec<Op>, cache: CachePolicy) -> Result<(), TestCaseError> {
    let policy = cache.eviction;
    let pool = BlockPool::new(PoolConfig {
        tier: Tier::Host,
        capacity,
        block_size: 4,
        eviction: policy,
        admission: cache.admission,
    })
    .unwrap();
    let seq = chain();
    let hashes: Vec<SequenceHash> = seq.sequence_hashes();
    let mut m = Model {
        empty: capacity,
        policy,
        capacity,
        sketch: (cache.admission == Admission::TinyLfu).then(|| FrequencySketch::new(capacity)),
        ..Model::default()
    };
    let mut mutables: Vec<MutableBlock<Empty>> = Vec::new();
    let mut imms: Vec<ImmutableBlock> = Vec::new();
    let mut weaks: Vec<(WeakBlock, u64, u64)> = Vec::new();

    for op in ops {
        match op.clone() {
            Op::Allocate(n) => {
                let available = m.empty + m.inactive_order().len();
                match pool.allocate(n) {
                    Ok(v) => {
                        prop_assert!(n <= available);
                        for _ in 0..n {
                            if m.empty > 0 {
                                m.empty -= 1;
                            } else {
                                m.evict();
                            }
                            m.mutable += 1;
                        }
                        mutables.extend(v);
                    }
                    Err(PoolError::Exhausted {
                        requested,
                        available: a,
                        ..
                    }) => {
                        prop_assert!(n > available);
                        prop_assert_eq!((requested, a), (n, available));
                    }
                    Err(e) => prop_assert!(false, "unexpected error {e}"),
                }
            }
            Op::Register { mutable, key, prio } => {
                if mutables.is_empty() {
                    continue;
                }
                let b = mutables.swap_remove(mutable % mutables.len());
                let tb = &seq.blocks()[key];
                let imm = b.fill_from(tb).unwrap().register_with_priority(prio);
                let h = tb.sequence_hash().0;
                prop_assert_eq!(imm.sequence_hash().0, h);
                m.register(h, prio);
                imms.push(imm);
            }
            Op::Match(len) => {
                let got = pool.match_prefix(&hashes[..len]);
                let want = hashes[..len]
                    .iter()
                    .take_while(|h| m.regs.contains_key(&h.0))
                    .count();
                prop_assert_eq!(got.len(), want);
                for (b, h) in got.iter().zip(&hashes) {
                    prop_assert_eq!(b.sequence_hash(), *h);
                    m.policy_hit(h.0);
                    m.take_ref(h.0);
                }
                imms.extend(got);
            }
            Op::DropImmutable(i) => {
                if imms.is_empty() {
                    continue;
                }
                let b = imms.swap_remove(i % imms.len());
                let h = b.sequence_hash().0;
                drop(b);
                m.drop_ref(h);
            }
            Op::DropMutable(i) => {
                if mutables.is_empty() {
                    continue;
                }
                drop(mutables.swap_remove(i % mutables.len()));
                m.mutable -= 1;
                m.empty += 1;
            }
            Op::Touch(key) => {
                let h = hashes[key].0;
                let found = pool.touch(&[hashes[key]]);
                prop_assert_eq!(found, usize::from(m.regs.contains_key(&h)));
                m.touch(h);
            }
            Op::Reference(_) | Op::Offer(_) => admission(&pool, &mut m, &hashes, &op)?,
            Op::Downgrade(i) => {
                if imms.is_empty() {
                    continue;
                }
                let b = &imms[i % imms.len()];
                let h = b.sequence_hash().0;
                weaks.push((b.downgrade(), h, m.regs[&h].instance));
            }
            Op::Upgrade(i) => {
                if weaks.is_empty() {
                    continue;
                }
                let (w, h, inst) = &weaks[i % weaks.len()];
                let alive = m.regs.get(h).is_some_and(|r| r.instance == *inst);
                match w.upgrade() {
                    Ok(b) => {
                        prop_assert!(alive, "weak upgraded after eviction");
                        prop_assert_eq!(b.sequence_hash().0, *h);
                        m.take_ref(*h);
                        imms.push(b);
                    }
                    Err(_) => prop_assert!(!alive, "live block reported gone"),
                }
            }
        }
        check(&pool, &m, &mutables, &imms)?;
    }

    // No leaks: once every handle is gone, nothing is active.
    drop(mutables);
    drop(imms);
    let s = pool.status();
    prop_assert_eq!(s.active, 0);
    prop_assert_eq!(s.inactive + s.empty, capacity);
    Ok(())
}

/// TinyLFU's two operations: a request's references counted, and blocks
/// offered (the pool's answer must be the model's).
fn admission(
    pool: &BlockPool,
    m: &mut Model,
    hashes: &[SequenceHash],
    op: &Op,
) -> Result<(), TestCaseError> {
    match op {
        Op::Reference(len) => {
            pool.record_references(&hashes[..*len]);
            if let Some(s) = m.sketch.as_mut() {
                hashes[..*len].iter().for_each(|h| s.record(*h));
            }
        }
        Op::Offer(keys) => {
            let hs: Vec<SequenceHash> = keys.iter().map(|&k| hashes[k]).collect();
            let raw: Vec<u64> = hs.iter().map(|h| h.0).collect();
            prop_assert_eq!(
                pool.admits(&hs),
                m.offer(&raw),
                "offer of blocks {:?}",
                keys
            );
        }
        _ => {}
    }
    Ok(())
}

fn check(
    pool: &BlockPool,
    m: &Model,
    mutables: &[MutableBlock<Empty>],
    imms: &[ImmutableBlock],
) -> Result<(), TestCaseError> {
    let s = pool.status();
    let held_regs = m.regs.values().filter(|r| r.refs > 0).count();
    let inactive = m.inactive_order().len();
    prop_assert_eq!(s.active + s.inactive + s.empty, s.capacity);
    prop_assert_eq!(s.mutable, m.mutable);
    prop_assert_eq!(s.active, m.mutable + held_regs);
    prop_assert_eq!(s.inactive, inactive);
    prop_assert_eq!(s.empty, m.empty);
    let registered: HashSet<u64> = pool.registered_hashes().iter().map(|h| h.0).collect();
    prop_assert_eq!(registered, m.regs.keys().copied().collect::<HashSet<u64>>());
    let order: Vec<u64> = pool.eviction_order().iter().map(|h| h.0).collect();
    // Every policy's order as it stands (S3-FIFO's and ARC's without the
    // moves an eviction makes on the way), which admission weighs against.
    prop_assert_eq!(order, m.victim_order());

    // One owner per block: mutable ids are distinct and never shared with a
    // registered block; one id per registered hash and vice versa.
    let mut ids = HashSet::new();
    for b in mutables {
        prop_assert!(ids.insert(b.id()), "block {} owned twice", b.id());
    }
    let mut by_hash = BTreeMap::new();
    let mut by_id = BTreeMap::new();
    for b in imms {
        prop_assert!(
            !ids.contains(&b.id()),
            "registered block {} also mutable",
            b.id()
        );
        let h = b.sequence_hash().0;
        prop_assert_eq!(*by_hash.entry(h).or_insert(b.id()), b.id());
        prop_assert_eq!(*by_id.entry(b.id()).or_insert(h), h);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    #[test]
    fn pool_matches_reference_model(capacity in 1usize..8, ops in proptest::collection::vec(op(), 1..120)) {
        run(capacity, ops, EvictionPolicy::Lru.into())?;
    }

    #[test]
    fn lfu_pool_matches_reference_model(capacity in 1usize..8, ops in proptest::collection::vec(op(), 1..120)) {
        run(capacity, ops, EvictionPolicy::Lfu.into())?;
    }

    #[test]
    fn s3fifo_pool_matches_reference_model(capacity in 1usize..24, ops in proptest::collection::vec(op(), 1..160)) {
        run(capacity, ops, EvictionPolicy::S3Fifo.into())?;
    }

    #[test]
    fn arc_pool_matches_reference_model(capacity in 1usize..8, ops in proptest::collection::vec(op(), 1..160)) {
        run(capacity, ops, EvictionPolicy::Arc.into())?;
    }

    /// TinyLFU admission in front of each eviction policy (the sketch of a
    /// pool this small holds 64 counters a row: the model's and the pool's
    /// count alike, collisions included).
    #[test]
    fn tinylfu_pool_matches_reference_model(
        capacity in 1usize..12,
        ops in proptest::collection::vec(op(), 1..160),
        eviction in proptest::sample::select(EvictionPolicy::ALL.to_vec()),
    ) {
        let cache = CachePolicy { admission: Admission::TinyLfu, eviction };
        run(capacity, ops, cache)?;
    }
}
