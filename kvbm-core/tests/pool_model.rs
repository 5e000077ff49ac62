//! State-machine test of `BlockPool` against a simple reference model.
//!
//! Random sequences of allocate / fill+register / match / drop / touch /
//! weak-upgrade run against the real pool and a model made of plain
//! counters and a sorted list. After every step: the counts agree with the
//! model and add up to capacity, the eviction order agrees, no block id is
//! held by two owners, and no block leaks (dropping everything at the end
//! leaves every block empty or inactive).

use kvbm_core::block::{Empty, MutableBlock};
use kvbm_core::{
    BlockPool, ImmutableBlock, PoolConfig, PoolError, SequenceHash, Tier, TokenSequence, WeakBlock,
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
}

#[derive(Debug, Default)]
struct Model {
    empty: usize,
    mutable: usize,
    regs: BTreeMap<u64, Reg>,
    clock: u64,
    instances: u64,
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

fn run(capacity: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let pool = BlockPool::new(PoolConfig {
        tier: Tier::Host,
        capacity,
        block_size: 4,
    })
    .unwrap();
    let seq = chain();
    let hashes: Vec<SequenceHash> = seq.sequence_hashes();
    let mut m = Model {
        empty: capacity,
        ..Model::default()
    };
    let mut mutables: Vec<MutableBlock<Empty>> = Vec::new();
    let mut imms: Vec<ImmutableBlock> = Vec::new();
    let mut weaks: Vec<(WeakBlock, u64, u64)> = Vec::new();

    for op in ops {
        match op {
            Op::Allocate(n) => {
                let available = m.empty + m.inactive_order().len();
                match pool.allocate(n) {
                    Ok(v) => {
                        prop_assert!(n <= available);
                        for _ in 0..n {
                            if m.empty > 0 {
                                m.empty -= 1;
                            } else {
                                let victim = m.inactive_order()[0];
                                m.regs.remove(&victim);
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
                m.mutable -= 1;
                if m.regs.contains_key(&h) {
                    m.empty += 1; // the duplicate's slot goes back
                    m.take_ref(h);
                } else {
                    m.instances += 1;
                    m.regs.insert(
                        h,
                        Reg {
                            refs: 1,
                            prio,
                            instance: m.instances,
                            inactive_since: None,
                        },
                    );
                }
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
                let t = m.tick();
                if let Some(r) = m.regs.get_mut(&h)
                    && r.inactive_since.is_some()
                {
                    r.inactive_since = Some(t);
                }
            }
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

fn check(
    pool: &BlockPool,
    m: &Model,
    mutables: &[MutableBlock<Empty>],
    imms: &[ImmutableBlock],
) -> Result<(), TestCaseError> {
    let s = pool.status();
    let held_regs = m.regs.values().filter(|r| r.refs > 0).count();
    let inactive = m.inactive_order();
    prop_assert_eq!(s.active + s.inactive + s.empty, s.capacity);
    prop_assert_eq!(s.mutable, m.mutable);
    prop_assert_eq!(s.active, m.mutable + held_regs);
    prop_assert_eq!(s.inactive, inactive.len());
    prop_assert_eq!(s.empty, m.empty);
    let order: Vec<u64> = pool.eviction_order().iter().map(|h| h.0).collect();
    prop_assert_eq!(order, inactive);

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
        run(capacity, ops)?;
    }
}
