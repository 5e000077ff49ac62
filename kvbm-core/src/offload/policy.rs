//! Offload policies: which blocks of a container are worth moving.
//!
//! The PolicyEvaluator runs each configured policy in order over the blocks
//! a container still has; each returns one verdict per block. Blocks a
//! policy rejects are filtered out of the container (and counted); a
//! container left with no blocks is skipped with the reason of the policy
//! that removed the last ones. The whole evaluation of one container is
//! bounded by `policy_timeout`, which is why policies are async: a real
//! deployment may ask a remote tier whether it already holds a block.

use super::status::SkipReason;
use crate::pool::BlockPool;
use crate::tokens::SequenceHash;
use kvbm_events::tier::{BlockId, Tier};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a policy may know about a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockInfo {
    /// The block's sequence hash.
    pub sequence_hash: SequenceHash,
    /// The tier it is on now.
    pub source_tier: Tier,
    /// Its id there.
    pub block: BlockId,
}

/// One policy's word on one block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Move it.
    Admit,
    /// Leave it, for this reason.
    Reject(SkipReason),
}

impl Verdict {
    /// `Admit` when `ok`, else a rejection for `reason`.
    pub fn admit_if(ok: bool, reason: SkipReason) -> Verdict {
        if ok {
            Verdict::Admit
        } else {
            Verdict::Reject(reason)
        }
    }
}

/// Decides which blocks to move. See the module docs.
pub trait OffloadPolicy: Send + Sync {
    /// A short name, for logs.
    fn name(&self) -> &'static str;

    /// One verdict per block, in order. `destination` is the pool the
    /// blocks would be copied into.
    fn evaluate<'a>(
        &'a self,
        blocks: &'a [BlockInfo],
        destination: &'a BlockPool,
    ) -> BoxFuture<'a, Vec<Verdict>>;
}

/// Skips blocks the destination tier already holds (active or inactive).
#[derive(Debug, Default, Clone, Copy)]
pub struct PresencePolicy;

impl OffloadPolicy for PresencePolicy {
    fn name(&self) -> &'static str {
        "presence"
    }
    fn evaluate<'a>(
        &'a self,
        blocks: &'a [BlockInfo],
        destination: &'a BlockPool,
    ) -> BoxFuture<'a, Vec<Verdict>> {
        Box::pin(async move {
            blocks
                .iter()
                .map(|b| {
                    Verdict::admit_if(
                        !destination.contains(b.sequence_hash),
                        SkipReason::AlreadyPresent,
                    )
                })
                .collect()
        })
    }
}

/// Asks the destination pool whether it takes each block
/// ([`BlockPool::admits`]: TinyLFU, where the pool has it; every block
/// otherwise). Runs after [`PresencePolicy`], so a block already there is
/// not counted as an offer.
#[derive(Debug, Default, Clone, Copy)]
pub struct AdmissionPolicy;

impl OffloadPolicy for AdmissionPolicy {
    fn name(&self) -> &'static str {
        "admission"
    }
    fn evaluate<'a>(
        &'a self,
        blocks: &'a [BlockInfo],
        destination: &'a BlockPool,
    ) -> BoxFuture<'a, Vec<Verdict>> {
        Box::pin(async move {
            let hashes: Vec<SequenceHash> = blocks.iter().map(|b| b.sequence_hash).collect();
            destination
                .admits(&hashes)
                .into_iter()
                .map(|yes| Verdict::admit_if(yes, SkipReason::NotAdmitted))
                .collect()
        })
    }
}

/// Admits a block once it has been seen at least `min_count` times, where
/// the count halves for every whole `half_life` since it was last updated
/// (so a burst long ago does not count forever). Every evaluation is a sighting; engines may
/// record others (a prefix hit, say) with [`FrequencyPolicy::record`].
///
/// The table is bounded: past `max_entries`, the entries with the lowest
/// decayed scores are dropped (counted in `forgotten`).
#[derive(Debug)]
pub struct FrequencyPolicy {
    min_count: f64,
    half_life: Duration,
    max_entries: usize,
    table: Mutex<HashMap<SequenceHash, (f64, Instant)>>,
    forgotten: AtomicU64,
}

impl FrequencyPolicy {
    /// A policy admitting blocks seen `min_count` times (decayed).
    pub fn new(min_count: u32, half_life: Duration, max_entries: usize) -> Self {
        FrequencyPolicy {
            min_count: f64::from(min_count.max(1)),
            half_life,
            max_entries: max_entries.max(1),
            table: Mutex::new(HashMap::new()),
            forgotten: AtomicU64::new(0),
        }
    }

    fn decayed(&self, score: f64, since: Instant, now: Instant) -> f64 {
        if self.half_life.is_zero() {
            return score;
        }
        // Whole half-lives only: sightings within one half-life count in
        // full, so "seen N times just now" is exactly N.
        let halves = (now.saturating_duration_since(since).as_secs_f64()
            / self.half_life.as_secs_f64())
        .floor();
        score * 0.5f64.powf(halves)
    }

    /// Records a sighting; returns the decayed count including it.
    pub fn record(&self, hash: SequenceHash) -> f64 {
        self.record_at(hash, Instant::now())
    }

    /// Records a sighting at a given time (for tests and simulated clocks).
    pub fn record_at(&self, hash: SequenceHash, now: Instant) -> f64 {
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let prev = t
            .get(&hash)
            .map(|&(s, at)| self.decayed(s, at, now))
            .unwrap_or(0.0);
        let score = prev + 1.0;
        t.insert(hash, (score, now));
        if t.len() > self.max_entries {
            self.prune(&mut t, now);
        }
        score
    }

    fn prune(&self, t: &mut HashMap<SequenceHash, (f64, Instant)>, now: Instant) {
        // Keep the better-scored 3/4 so pruning is rare (amortised O(1)).
        let keep = self.max_entries * 3 / 4;
        let mut scored: Vec<(f64, SequenceHash)> = t
            .iter()
            .map(|(h, &(s, at))| (self.decayed(s, at, now), *h))
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (_, h) in scored.into_iter().skip(keep) {
            t.remove(&h);
            self.forgotten.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Entries dropped to keep the table bounded.
    pub fn forgotten(&self) -> u64 {
        self.forgotten.load(Ordering::Relaxed)
    }

    /// Blocks tracked now.
    pub fn tracked(&self) -> usize {
        self.table.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl OffloadPolicy for FrequencyPolicy {
    fn name(&self) -> &'static str {
        "frequency"
    }
    fn evaluate<'a>(
        &'a self,
        blocks: &'a [BlockInfo],
        _destination: &'a BlockPool,
    ) -> BoxFuture<'a, Vec<Verdict>> {
        Box::pin(async move {
            let now = Instant::now();
            blocks
                .iter()
                .map(|b| {
                    Verdict::admit_if(
                        self.record_at(b.sequence_hash, now) >= self.min_count,
                        SkipReason::BelowFrequency,
                    )
                })
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolConfig;

    fn info(h: u64) -> BlockInfo {
        BlockInfo {
            sequence_hash: SequenceHash(h),
            source_tier: Tier::Device,
            block: 0,
        }
    }

    #[test]
    fn frequency_admits_on_the_nth_sighting_and_decays() {
        let p = FrequencyPolicy::new(3, Duration::from_secs(10), 100);
        let t0 = Instant::now();
        assert!(p.record_at(SequenceHash(1), t0) < 3.0);
        assert!(p.record_at(SequenceHash(1), t0) < 3.0);
        assert!(p.record_at(SequenceHash(1), t0) >= 3.0);
        // Two half-lives later the three sightings weigh 0.75.
        let later = t0 + Duration::from_secs(20);
        let s = p.record_at(SequenceHash(1), later);
        assert!((s - 1.75).abs() < 1e-9, "{s}");
    }

    #[test]
    fn frequency_table_is_bounded_and_counts_what_it_forgets() {
        let p = FrequencyPolicy::new(2, Duration::from_secs(1), 8);
        for h in 0..100 {
            p.record(SequenceHash(h));
        }
        assert!(p.tracked() <= 8);
        assert!(p.forgotten() >= 92);
    }

    #[tokio::test]
    async fn presence_rejects_what_the_destination_holds() {
        let pool = BlockPool::new(PoolConfig {
            tier: Tier::Host,
            capacity: 2,
            block_size: 2,
            eviction: Default::default(),
            admission: Default::default(),
        })
        .unwrap();
        let seq = crate::TokenSequence::from_tokens(&[1, 2], 2, crate::SaltHash(0)).unwrap();
        let b = pool
            .allocate_one()
            .unwrap()
            .fill_from(&seq.blocks()[0])
            .unwrap()
            .register();
        let v = PresencePolicy
            .evaluate(&[info(b.sequence_hash().0), info(42)], &pool)
            .await;
        assert_eq!(
            v,
            [Verdict::Reject(SkipReason::AlreadyPresent), Verdict::Admit]
        );
        let f = FrequencyPolicy::new(2, Duration::from_secs(60), 10);
        assert_eq!(
            f.evaluate(&[info(7)], &pool).await,
            [Verdict::Reject(SkipReason::BelowFrequency)]
        );
        assert_eq!(f.evaluate(&[info(7)], &pool).await, [Verdict::Admit]);
    }
}
