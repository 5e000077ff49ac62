//! `capacity --policies`: each cache policy's token hit ratio at each
//! capacity asked for, by running kvbm-core's cache model
//! ([`kvbm_core::cache_model`]) over the same reference stream the LRU
//! curve is computed from (each request's full blocks at its first
//! lookup). One model per policy and capacity, all fed in one pass.

use kvbm_core::CachePolicy;
use kvbm_core::cache_model::{CacheModel, ModelTooLarge};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One policy at one capacity.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PolicyPoint {
    /// The capacity asked for, in tokens.
    pub capacity_tokens: u64,
    /// The same in whole blocks (what the model held).
    pub capacity_blocks: u64,
    /// Prefix hits over prompt tokens.
    pub hit_ratio: f64,
    /// Misses the admission policy turned away (0 without one).
    pub not_admitted: u64,
}

/// Every policy's models, fed request by request.
#[derive(Debug)]
pub struct PolicyCurves {
    policies: Vec<CachePolicy>,
    capacities: Vec<u64>,
    /// Per policy, one model per capacity; made by `prepare`, once the
    /// block size is known.
    models: Vec<Vec<CacheModel>>,
    /// Time each policy's models took.
    spent: Vec<Duration>,
    block_size: u32,
    prompt_tokens: u64,
    mixed_block_sizes: u64,
}

/// Reads `--policies`: a comma list of cache policies (`lru`, `lfu`,
/// `s3fifo`, `arc`, each also as `tinylfu+POLICY`), each once.
pub fn parse_policies(s: &str) -> Result<Vec<CachePolicy>, String> {
    let mut out: Vec<CachePolicy> = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let p: CachePolicy = part.parse().map_err(|e| format!("{e}"))?;
        if out.contains(&p) {
            return Err(format!("policy `{p}` is given twice"));
        }
        out.push(p);
    }
    if out.is_empty() {
        return Err("no policy given".into());
    }
    Ok(out)
}

impl PolicyCurves {
    /// Models for every policy at every capacity (tokens).
    pub fn new(policies: Vec<CachePolicy>, capacities: &[u64]) -> Self {
        PolicyCurves {
            spent: vec![Duration::ZERO; policies.len()],
            policies,
            capacities: capacities.to_vec(),
            models: Vec::new(),
            block_size: 0,
            prompt_tokens: 0,
            mixed_block_sizes: 0,
        }
    }

    /// Makes the models for blocks of `block_size` tokens (the first
    /// request's; a capacity's blocks are its tokens over it). Refused
    /// when a capacity's model does not fit in memory, or when already
    /// made for another block size.
    pub fn prepare(&mut self, block_size: u32) -> Result<(), ModelTooLarge> {
        if self.block_size != 0 || block_size == 0 {
            return Ok(());
        }
        for &p in &self.policies {
            let ms = self
                .capacities
                .iter()
                .map(|&c| CacheModel::new(p, (c / u64::from(block_size)) as usize))
                .collect::<Result<Vec<_>, _>>()?;
            self.models.push(ms);
        }
        self.block_size = block_size;
        Ok(())
    }

    /// One request: `tokens` long, its full blocks' keys in prefix order,
    /// blocks of `block_size` tokens. A request whose block size is not
    /// the one [`prepare`](Self::prepare) was given is skipped and counted,
    /// as the curve does.
    pub fn request(&mut self, tokens: u64, block_size: u32, keys: &[u64]) {
        if block_size != self.block_size || self.block_size == 0 {
            self.mixed_block_sizes += 1;
            return;
        }
        self.prompt_tokens += tokens;
        let matchable = (tokens.saturating_sub(1) / u64::from(block_size)) as usize;
        for (ms, spent) in self.models.iter_mut().zip(&mut self.spent) {
            let t = Instant::now();
            for m in ms.iter_mut() {
                m.request(keys, matchable);
            }
            *spent += t.elapsed();
        }
    }

    /// Each policy's points, by name.
    pub fn report(&self) -> BTreeMap<String, Vec<PolicyPoint>> {
        let bs = u64::from(self.block_size);
        self.policies
            .iter()
            .zip(&self.models)
            .map(|(p, ms)| {
                let points = ms
                    .iter()
                    .zip(&self.capacities)
                    .map(|(m, &c)| PolicyPoint {
                        capacity_tokens: c,
                        capacity_blocks: m.capacity() as u64,
                        hit_ratio: if self.prompt_tokens == 0 {
                            0.0
                        } else {
                            (m.hits() * bs) as f64 / self.prompt_tokens as f64
                        },
                        not_admitted: m.not_admitted(),
                    })
                    .collect();
                (p.to_string(), points)
            })
            .collect()
    }

    /// The policies, in the order given.
    pub fn policies(&self) -> &[CachePolicy] {
        &self.policies
    }

    /// Block references each policy's models took, per second of their
    /// time (all its capacities together), by name.
    pub fn references_per_second(&self) -> BTreeMap<String, f64> {
        self.policies
            .iter()
            .zip(&self.models)
            .zip(&self.spent)
            .map(|((p, ms), t)| {
                let refs: u64 = ms.iter().map(CacheModel::references).sum();
                (p.to_string(), refs as f64 / t.as_secs_f64().max(1e-9))
            })
            .collect()
    }

    /// Requests skipped for a block size other than the one prepared for.
    pub fn mixed_block_sizes(&self) -> u64 {
        self.mixed_block_sizes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_read_or_are_refused_by_name() {
        let p = parse_policies("lru, s3fifo,tinylfu+lru").unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p[2].to_string(), "tinylfu+lru");
        for (bad, says) in [
            ("lru,mru", "`mru`"),
            ("lru,LRU", "twice"),
            ("", "no policy"),
        ] {
            let e = parse_policies(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_capacity_the_machine_cannot_hold_is_an_error() {
        let mut c = PolicyCurves::new(parse_policies("s3fifo").unwrap(), &[u64::MAX / 2]);
        let e = c.prepare(1).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
    }

    #[test]
    fn every_policy_gets_a_point_per_capacity() {
        let mut c = PolicyCurves::new(parse_policies("lru,arc").unwrap(), &[32, 64]);
        c.prepare(16).unwrap();
        for _ in 0..3 {
            c.request(50, 16, &[1, 2, 3]);
        }
        c.request(50, 8, &[1, 2, 3]);
        let r = c.report();
        assert_eq!(c.mixed_block_sizes(), 1);
        // 3 requests of 50 tokens, 3 blocks of 16, the first 3 matchable:
        // two repeats hit 3 blocks each at 64 tokens (4 blocks); at 32
        // tokens (2 blocks) the first two are kept (a request does not
        // evict its own blocks) and hit, the third never stored.
        let lru = &r["lru"];
        assert_eq!(lru[1].capacity_blocks, 4);
        assert!((lru[1].hit_ratio - 96.0 / 150.0).abs() < 1e-12, "{lru:?}");
        assert!((lru[0].hit_ratio - 64.0 / 150.0).abs() < 1e-12, "{lru:?}");
        assert_eq!(r["arc"].len(), 2);
    }
}
