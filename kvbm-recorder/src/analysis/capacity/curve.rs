//! The hit-ratio curve of a reference stream: for every LRU capacity at
//! once, the prefix-hit ratio the stream would have had.
//!
//! A request references its full blocks in prefix order. Block `j` hits
//! at capacity `C` only if blocks `1..=j` all hit, so it counts when the
//! largest stack distance among them is at most `C`; the engine never
//! looks up the block holding a prompt's last token, so a request's
//! blocks past `(tokens - 1) / block_size` are referenced (they are
//! computed and cached) but never counted as hits. One pass of
//! [`StackDistances`] gives the histogram of those prefix-maximal
//! distances, and the curve is its running sum.
//!
//! **Sampling** (SHARDS, spatial sampling by hash): only keys whose hash
//! falls under a threshold are tracked, at rate `R`; a sampled distance
//! `d` stands for `d / R`. Exact is the default; a fixed rate can be asked
//! for, and with a cap on the keys held the rate halves each time the cap
//! is reached (the keys above the new threshold are dropped), each rate's
//! samples weighted by `1 / R` (SHARDS with a bounded sample set). The
//! totals (prompt tokens, matchable blocks) are always counted exactly, and
//! the difference between the references the sample should have held and
//! those it did is put at the smallest distance (SHARDS-adj: it comes
//! mostly from whether a few very hot blocks were sampled). The
//! error estimate is the spread between eight disjoint groups of the
//! sample (split by other bits of the hash): the standard error of their
//! mean. It measures which blocks happened to be sampled, not the noise in
//! the sampled distances, so it is a floor; the capacity bench reports the
//! error against the exact curve too.

use super::stack::{StackDistances, mix};
use serde::Serialize;

/// Sample values are the top 24 bits of a mixed hash.
const SAMPLE_BITS: u32 = 24;
const SAMPLE_SPACE: u64 = 1 << SAMPLE_BITS;
/// Sampled block references below which a sampled curve is said to mean
/// little: its groups hold a few hundred references at most, and one hot
/// block in or out moves the ratio by more than the error estimate shows.
pub const MIN_SAMPLE: u64 = 2_000;

/// Groups of the sample for the error estimate (a power of two).
const GROUPS: usize = 8;

/// How the curve is computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// Every block; memory grows with the distinct blocks.
    Exact,
    /// SHARDS at a fixed rate in (0, 1].
    Fixed(f64),
    /// Exact until this many distinct blocks are held, then SHARDS,
    /// halving the rate whenever the cap is reached again.
    Bounded(usize),
}

/// How the curve was computed, for reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Method {
    /// `"exact"` or `"sampled"`.
    pub method: &'static str,
    /// The sampling rate at the end (1 when exact).
    pub rate: f64,
    /// Every rate used, first to last (several when a bound lowered it).
    pub rates: Vec<f64>,
    /// Blocks the sample held at the end.
    pub tracked_blocks: usize,
    /// The cap on blocks held, when there is one.
    pub max_blocks: Option<usize>,
}

/// One sampling rate's histograms.
#[derive(Debug, Clone)]
struct Epoch {
    rate: f64,
    /// `hist[d * groups + g]`: matchable blocks of group `g` whose
    /// prefix-maximal sampled distance is `d`.
    hist: Vec<f64>,
    /// Matchable blocks seen first (no finite distance), per group.
    cold: Vec<f64>,
    /// Matchable blocks sampled, per group.
    total: Vec<f64>,
    groups: usize,
}

impl Epoch {
    fn new(rate: f64, groups: usize) -> Self {
        Epoch {
            rate,
            hist: Vec::new(),
            cold: vec![0.0; groups],
            total: vec![0.0; groups],
            groups,
        }
    }

    #[inline]
    fn record(&mut self, d: Option<u64>, g: usize) {
        self.total[g] += 1.0;
        match d {
            None => self.cold[g] += 1.0,
            Some(d) => {
                let i = d as usize * self.groups + g;
                if i >= self.hist.len() {
                    self.hist.resize((i + 1).next_power_of_two(), 0.0);
                }
                self.hist[i] += 1.0;
            }
        }
    }
}

/// What one request added, block by block (for miss reasons).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockDistance {
    /// Not sampled: unknown.
    Unsampled,
    /// First reference.
    Cold,
    /// Its own stack distance (not the prefix maximum), in blocks
    /// (scaled by the sampling rate).
    Distance(u64),
}

/// Builds a curve from requests, one at a time. See the module docs.
#[derive(Debug, Clone)]
pub struct CurveBuilder {
    sampling: Sampling,
    stack: StackDistances,
    /// Take a key when its sample value is below this.
    threshold: u64,
    rate: f64,
    epochs: Vec<Epoch>,
    block_size: u32,
    /// Requests whose block size differed from the first one's (skipped).
    mixed_block_sizes: u64,
    requests: u64,
    prompt_tokens: u64,
    blocks: u64,
    matchable_blocks: u64,
    /// Scratch: the request's keys.
    keys: Vec<u64>,
}

/// Keys whose loads are started together (see [`StackDistances::prefetch`]).
const PREFETCH: usize = 16;

impl CurveBuilder {
    /// An empty builder.
    pub fn new(sampling: Sampling) -> Self {
        let rate = match sampling {
            Sampling::Fixed(r) if r.is_finite() && r > 0.0 && r < 1.0 => r,
            _ => 1.0,
        };
        let groups = if rate < 1.0 { GROUPS } else { 1 };
        CurveBuilder {
            sampling,
            stack: StackDistances::new(),
            threshold: (rate * SAMPLE_SPACE as f64).round().max(1.0) as u64,
            rate,
            epochs: vec![Epoch::new(rate, groups)],
            block_size: 0,
            mixed_block_sizes: 0,
            requests: 0,
            prompt_tokens: 0,
            blocks: 0,
            matchable_blocks: 0,
            keys: Vec::new(),
        }
    }

    /// Adds one request: `tokens` long, its full blocks' `hashes` in
    /// prefix order. `out`, when given, receives each block's own distance.
    #[inline]
    pub fn request(
        &mut self,
        tokens: u64,
        block_size: u32,
        hashes: impl IntoIterator<Item = u64>,
        mut out: Option<&mut Vec<BlockDistance>>,
    ) {
        if block_size == 0 {
            self.mixed_block_sizes += 1;
            return;
        }
        if self.block_size == 0 {
            self.block_size = block_size;
        } else if self.block_size != block_size {
            self.mixed_block_sizes += 1;
            return;
        }
        let matchable = (tokens.saturating_sub(1) / u64::from(block_size)) as usize;
        self.requests += 1;
        self.prompt_tokens += tokens;
        let exact = self.rate >= 1.0;
        let mut max = 0u64;
        let mut cold = false;
        let mut keys = std::mem::take(&mut self.keys);
        keys.clear();
        keys.extend(hashes);
        let n = keys.len();
        for (j, &h) in keys.iter().enumerate() {
            // Every key of the next few is a likely cache miss: start their
            // loads together rather than one after another.
            if exact && j % PREFETCH == 0 && self.stack.is_large() {
                let mut acc = 0u64;
                for &k in keys[j..].iter().take(PREFETCH) {
                    acc ^= self.stack.prefetch(k);
                }
                std::hint::black_box(acc);
            }
            let (sampled, g) = if exact {
                (true, 0)
            } else {
                let m = mix(h);
                (
                    (m >> (64 - SAMPLE_BITS)) < self.threshold,
                    (m as usize) & (GROUPS - 1),
                )
            };
            if !sampled {
                if let Some(o) = out.as_deref_mut() {
                    o.push(BlockDistance::Unsampled);
                }
                continue;
            }
            let d = self.stack.reference(h);
            if d.is_none() {
                self.on_new_key();
            }
            if let Some(o) = out.as_deref_mut() {
                o.push(match d {
                    None => BlockDistance::Cold,
                    Some(d) => BlockDistance::Distance((d as f64 / self.rate).round() as u64),
                });
            }
            if j < matchable {
                match d {
                    None => cold = true,
                    Some(d) => max = max.max(d),
                }
                let e = self.epochs.last_mut().expect("always one epoch");
                e.record((!cold).then_some(max), g);
            }
        }
        self.keys = keys;
        self.blocks += n as u64;
        self.matchable_blocks += matchable.min(n) as u64;
    }

    /// A key joined the sample: under a bound, lower the rate when full.
    #[inline]
    fn on_new_key(&mut self) {
        let Sampling::Bounded(max) = self.sampling else {
            return;
        };
        if self.stack.len() <= max.max(1) {
            return;
        }
        self.lower_rate();
    }

    #[cold]
    fn lower_rate(&mut self) {
        let Sampling::Bounded(max) = self.sampling else {
            return;
        };
        // Halve until the sample fits under the cap again.
        while self.stack.len() > max.max(1) && self.threshold > 1 {
            self.threshold /= 2;
            self.rate = self.threshold as f64 / SAMPLE_SPACE as f64;
            let t = self.threshold;
            self.stack.retain(|k| (mix(k) >> (64 - SAMPLE_BITS)) < t);
        }
        self.epochs.push(Epoch::new(self.rate, GROUPS));
    }

    /// Requests added.
    pub fn requests(&self) -> u64 {
        self.requests
    }

    /// The block size of the stream (0 before the first request).
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Requests skipped because their block size differed from the first.
    pub fn mixed_block_sizes(&self) -> u64 {
        self.mixed_block_sizes
    }

    /// Blocks referenced (sampled or not).
    pub fn references(&self) -> u64 {
        self.blocks
    }

    /// How it is being computed.
    pub fn method(&self) -> Method {
        Method {
            method: if self.epochs.iter().all(|e| e.rate >= 1.0) {
                "exact"
            } else {
                "sampled"
            },
            rate: self.rate,
            rates: self.epochs.iter().map(|e| e.rate).collect(),
            tracked_blocks: self.stack.len(),
            max_blocks: match self.sampling {
                Sampling::Bounded(m) => Some(m),
                _ => None,
            },
        }
    }

    /// The curve as it stands.
    pub fn curve(&self) -> Curve {
        // Per epoch, the cumulative histogram by distance for each group.
        let groups = self.epochs.iter().map(|e| e.groups).max().unwrap_or(1);
        let cum: Vec<Vec<f64>> = self
            .epochs
            .iter()
            .map(|e| {
                let mut c = e.hist.clone();
                for i in e.groups..c.len() {
                    c[i] += c[i - e.groups];
                }
                c
            })
            .collect();
        let mut total = vec![0.0; groups];
        let mut seen = vec![0.0; groups];
        let mut sampled = 0.0;
        let mut max_distance = 0f64;
        for e in &self.epochs {
            let w = 1.0 / e.rate;
            for g in 0..e.groups {
                sampled += e.total[g];
                total[g] += w * e.total[g];
                seen[g] += w * (e.total[g] - e.cold[g]);
            }
            let buckets = e.hist.len() / e.groups;
            max_distance = max_distance.max(buckets as f64 / e.rate);
        }
        Curve {
            block_size: self.block_size,
            requests: self.requests,
            prompt_tokens: self.prompt_tokens,
            blocks: self.blocks,
            matchable_blocks: self.matchable_blocks,
            groups,
            epochs: self
                .epochs
                .iter()
                .zip(cum)
                .map(|(e, c)| (e.rate, e.groups, c))
                .collect(),
            total,
            seen,
            sampled,
            max_distance_blocks: max_distance.ceil() as u64,
            method: self.method(),
        }
    }
}

/// A computed curve: evaluate it at any capacity.
#[derive(Debug, Clone)]
pub struct Curve {
    /// Tokens per block.
    pub block_size: u32,
    /// Requests.
    pub requests: u64,
    /// Their tokens.
    pub prompt_tokens: u64,
    /// Their full blocks.
    pub blocks: u64,
    /// Their blocks a lookup may hit.
    pub matchable_blocks: u64,
    groups: usize,
    /// (rate, groups, cumulative histogram) per epoch.
    epochs: Vec<(f64, usize, Vec<f64>)>,
    /// Weighted matchable blocks sampled, per group.
    total: Vec<f64>,
    /// Weighted matchable blocks with a finite distance, per group.
    seen: Vec<f64>,
    /// Matchable blocks sampled, unweighted.
    sampled: f64,
    /// Beyond this capacity the curve is flat at its ceiling.
    pub max_distance_blocks: u64,
    /// How it was computed.
    pub method: Method,
}

/// One point of a curve.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Point {
    /// The capacity, in tokens.
    pub capacity_tokens: u64,
    /// The capacity, in blocks.
    pub capacity_blocks: u64,
    /// Prefix-hit tokens over prompt tokens.
    pub hit_ratio: f64,
    /// Hit blocks over the blocks looked up.
    pub block_hit_ratio: f64,
    /// Standard error of `hit_ratio` (sampled curves; 0 when exact).
    pub stderr: f64,
}

impl Curve {
    /// Matchable blocks over prompt tokens, in tokens: the factor from a
    /// block hit ratio to a token hit ratio.
    fn token_factor(&self) -> f64 {
        if self.prompt_tokens == 0 {
            return 0.0;
        }
        (self.matchable_blocks * u64::from(self.block_size)) as f64 / self.prompt_tokens as f64
    }

    /// Weighted hits at `blocks` per group.
    fn hits(&self, blocks: u64) -> Vec<f64> {
        let mut h = vec![0.0; self.groups];
        for (rate, groups, cum) in &self.epochs {
            if cum.is_empty() {
                continue;
            }
            let buckets = cum.len() / groups;
            // Sampled distance d stands for d / rate: d <= blocks * rate.
            let lim = ((blocks as f64) * rate).floor();
            if lim < 1.0 {
                continue;
            }
            let d = (lim as usize).min(buckets - 1);
            let w = 1.0 / rate;
            for g in 0..*groups {
                h[g] += w * cum[d * groups + g];
            }
        }
        h
    }

    /// Hits over the (exactly counted) matchable blocks, and the standard
    /// error across groups. A sample holds more or fewer references than
    /// the rate promises, mostly because a very hot block was or was not
    /// sampled; SHARDS-adj puts the difference in the smallest distance,
    /// which every capacity of at least one block hits (`adjust`). For an
    /// exact curve the difference is zero.
    fn ratio(&self, num: &[f64], adjust: bool) -> (f64, f64) {
        let n = self.matchable_blocks as f64;
        if n == 0.0 {
            return (0.0, 0.0);
        }
        let t: f64 = self.total.iter().sum();
        let adj = if adjust { n - t } else { 0.0 };
        let p = ((num.iter().sum::<f64>() + adj) / n).clamp(0.0, 1.0);
        if self.groups < 2 {
            return (p, 0.0);
        }
        // Each group is a sample of its own, expected to hold n / groups.
        let share = n / self.groups as f64;
        let ps: Vec<f64> = num
            .iter()
            .zip(&self.total)
            .filter(|(_, t)| **t > 0.0)
            .map(|(h, t)| {
                let adj = if adjust { share - t } else { 0.0 };
                ((h + adj) / share).clamp(0.0, 1.0)
            })
            .collect();
        let k = ps.len() as f64;
        if k < 2.0 {
            return (p, 0.0);
        }
        let mean = ps.iter().sum::<f64>() / k;
        let var = ps.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (k - 1.0);
        (p, (var / k).sqrt())
    }

    /// The curve at `capacity_tokens` (rounded down to whole blocks).
    pub fn at_tokens(&self, capacity_tokens: u64) -> Point {
        let bs = u64::from(self.block_size.max(1));
        self.at_blocks(capacity_tokens / bs, capacity_tokens)
    }

    fn at_blocks(&self, blocks: u64, capacity_tokens: u64) -> Point {
        let (p, se) = self.ratio(&self.hits(blocks), blocks >= 1);
        let f = self.token_factor();
        Point {
            capacity_tokens,
            capacity_blocks: blocks,
            hit_ratio: p * f,
            block_hit_ratio: p,
            stderr: se * f,
        }
    }

    /// Matchable block references the estimate rests on: those the sample
    /// held (every one when exact). Below [`MIN_SAMPLE`] a sampled curve
    /// means little, and its error estimate with it.
    pub fn sample_size(&self) -> u64 {
        self.sampled as u64
    }

    /// The hit ratio of an unbounded cache (tokens, blocks).
    pub fn ceiling(&self) -> (f64, f64) {
        let (p, _) = self.ratio(&self.seen, true);
        (p * self.token_factor(), p)
    }

    /// Points from one block to past the largest distance, `n` of them
    /// spaced evenly on a log scale (for drawing).
    pub fn grid(&self, n: usize) -> Vec<Point> {
        let bs = u64::from(self.block_size.max(1));
        let top = (self.max_distance_blocks.max(1) as f64 * 1.25).max(2.0);
        let n = n.max(2);
        let mut out: Vec<Point> = (0..n)
            .map(|i| {
                let b = top.powf(i as f64 / (n - 1) as f64).round() as u64;
                self.at_blocks(b, b * bs)
            })
            .collect();
        out.dedup_by_key(|p| p.capacity_blocks);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_semantics_and_the_last_token_rule_by_hand() {
        let mut b = CurveBuilder::new(Sampling::Exact);
        // 4 tokens per block. Request 1: 9 tokens = 2 full blocks (both
        // matchable); request 2: 8 tokens = 2 full blocks, only the first
        // matchable (the last token is always computed).
        b.request(9, 4, [1, 2], None);
        b.request(8, 4, [1, 2], None);
        b.request(12, 4, [1, 2, 3], None);
        let c = b.curve();
        assert_eq!(c.prompt_tokens, 29);
        assert_eq!(c.matchable_blocks, 2 + 1 + 2);
        // Distances: request 2: block 1 → 2, block 2 → 2 (not matchable);
        // request 3: 1 → 2, 2 → 2, 3 new (not matchable). Nothing fits in
        // one block.
        assert_eq!(c.at_tokens(4).hit_ratio, 0.0);
        let full = c.at_tokens(8);
        // Hits at 2 blocks: r2's block 1 and r3's blocks 1 and 2: 3 blocks.
        assert!((full.block_hit_ratio - 3.0 / 5.0).abs() < 1e-12);
        assert!((full.hit_ratio - 12.0 / 29.0).abs() < 1e-12);
        assert_eq!(c.ceiling().1, full.block_hit_ratio);
    }

    /// An LRU cache of `cap` blocks, the obvious way: each request looks up
    /// its leading matchable blocks, then uses every block in order (a hit
    /// moves to the front, a miss is stored and the oldest block goes).
    /// Hit blocks.
    fn brute_force(reqs: &[(u64, Vec<u64>)], bs: u64, cap: usize) -> u64 {
        let mut lru: Vec<u64> = Vec::new(); // most recent last
        let mut hits = 0;
        for (tokens, keys) in reqs {
            let m = ((tokens.saturating_sub(1) / bs) as usize).min(keys.len());
            hits += keys[..m].iter().take_while(|k| lru.contains(k)).count() as u64;
            for k in keys {
                if let Some(i) = lru.iter().position(|x| x == k) {
                    lru.remove(i);
                } else if lru.len() == cap {
                    lru.remove(0);
                }
                lru.push(*k);
            }
        }
        hits
    }

    fn requests() -> impl Strategy<Value = Vec<(u64, Vec<u64>)>> {
        // Requests of 0..10 blocks from a few ids, keys chained or not
        // (the prefix rule must hold either way), token counts that put
        // the last token in the last full block or past it.
        proptest::collection::vec(
            (
                0u64..45,
                proptest::collection::vec(0u64..24, 0..10),
                any::<bool>(),
            )
                .prop_map(|(extra, ids, chained)| {
                    let mut prev = 0u64;
                    let keys: Vec<u64> = ids
                        .iter()
                        .map(|&id| {
                            prev = if chained { mix(prev ^ id) } else { id };
                            prev
                        })
                        .collect();
                    (
                        keys.len() as u64 * 4 + extra % 5 + u64::from(keys.is_empty()),
                        keys,
                    )
                }),
            0..80,
        )
    }

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_curve_equals_a_brute_force_lru_at_every_capacity(
            reqs in requests(),
            caps in proptest::collection::vec(1usize..40, 1..6),
        ) {
            let mut b = CurveBuilder::new(Sampling::Exact);
            for (tokens, keys) in &reqs {
                b.request(*tokens, 4, keys.iter().copied(), None);
            }
            let c = b.curve();
            for cap in caps {
                let want = brute_force(&reqs, 4, cap);
                let p = c.at_tokens(cap as u64 * 4);
                let got = (p.block_hit_ratio * c.matchable_blocks as f64).round() as u64;
                prop_assert_eq!(got, want, "capacity {} blocks", cap);
                if c.prompt_tokens > 0 {
                    let tokens = p.hit_ratio * c.prompt_tokens as f64;
                    prop_assert!((tokens - (want * 4) as f64).abs() < 1e-6);
                }
            }
        }

        #[test]
        fn a_bounded_sample_never_holds_more_than_its_cap(
            keys in proptest::collection::vec(any::<u64>(), 1..3000),
            cap in 10usize..200,
        ) {
            let mut b = CurveBuilder::new(Sampling::Bounded(cap));
            for chunk in keys.chunks(7) {
                b.request(chunk.len() as u64 * 4, 4, chunk.iter().copied(), None);
            }
            let m = b.method();
            prop_assert!(m.tracked_blocks <= cap);
            let distinct: std::collections::HashSet<_> = keys.iter().collect();
            if distinct.len() > cap {
                prop_assert_eq!(m.method, "sampled");
                prop_assert!(m.rate < 1.0);
            } else {
                prop_assert_eq!(m.method, "exact");
            }
        }
    }
}
