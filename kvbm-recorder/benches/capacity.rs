//! The capacity curve's speed: references per second for the exact curve
//! (every capacity at once) and for SHARDS-sampled curves, beside a
//! brute-force LRU simulation of one capacity in the same run, and the
//! sampled curves' mean absolute error against exact; and the cache model
//! `capacity --policies` runs (`kvbm_core::cache_model`), one capacity per
//! policy, with its hit ratio.
//!
//! Two streams: the sample Mooncake trace (3,993 requests, its hash ids
//! chained into prefix keys; small enough to stay in cache), and a large
//! synthetic one shaped like a prefix-caching workload: requests share a
//! prefix drawn from a Zipf-popular set of system prompts and documents,
//! then carry blocks of their own; keys are chained as sequence hashes
//! are. `KVBM_BENCH_QUICK=1` makes the synthetic stream small (a smoke
//! run).
//!
//! ```sh
//! cargo bench -p kvbm-recorder --bench capacity
//! ```

use kvbm_core::CachePolicy;
use kvbm_core::cache_model::CacheModel;
use kvbm_recorder::analysis::capacity::stack::KeyMap;
use kvbm_recorder::analysis::capacity::{CurveBuilder, Sampling};
use kvbm_testkit::bench::{median_ns_per_unit, quick};
use std::hint::black_box;
use std::time::{Duration, Instant};

const BLOCK: u32 = 512;

/// A request: its token count and its blocks' keys (a range of `keys`).
struct Stream {
    requests: Vec<(u64, usize, usize)>,
    keys: Vec<u64>,
}

/// A small, fast PRNG (xorshift*), so the stream is the same every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }
}

fn chain(prev: u64, id: u64) -> u64 {
    let p = u128::from(prev ^ 0x9e37_79b9_7f4a_7c15).wrapping_mul(u128::from(id | 1) + 0x1_0000);
    (p as u64) ^ ((p >> 64) as u64) ^ id.rotate_left(17)
}

fn stream(requests: usize, groups: u64) -> Stream {
    let mut rng = Rng(0x5eed_cafe);
    // Zipf(1) over groups by inverse CDF on a harmonic table.
    let h: Vec<f64> = (1..=groups)
        .scan(0.0, |s, k| {
            *s += 1.0 / k as f64;
            Some(*s)
        })
        .collect();
    let total = *h.last().unwrap_or(&1.0);
    let mut s = Stream {
        requests: Vec::with_capacity(requests),
        keys: Vec::new(),
    };
    let mut next_unique = 1u64 << 40;
    for _ in 0..requests {
        let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64 * total;
        let g = h.partition_point(|&x| x < u) as u64;
        let shared = 8 + (g * 2_654_435_761) % 57; // 8..64 blocks, fixed per group
        let own = rng.below(33);
        let start = s.keys.len();
        let mut prev = 0u64;
        for j in 0..shared {
            prev = chain(prev, (g << 8) | j);
            s.keys.push(prev);
        }
        for _ in 0..own {
            next_unique += 1;
            prev = chain(prev, next_unique);
            s.keys.push(prev);
        }
        let blocks = s.keys.len() - start;
        let tokens = blocks as u64 * u64::from(BLOCK) + rng.below(u64::from(BLOCK));
        s.requests.push((tokens, start, s.keys.len()));
    }
    s
}

/// The sample trace's requests: `input_length` tokens, full blocks' ids
/// chained.
fn mooncake() -> Stream {
    let path = kvbm_testkit::data::mooncake_sample_trace();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the sample trace {}: {e}", path.display()));
    let mut s = Stream {
        requests: Vec::new(),
        keys: Vec::new(),
    };
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        let len = v["input_length"].as_u64().expect("input_length");
        let ids = v["hash_ids"].as_array().expect("hash_ids");
        let full = ((len / u64::from(BLOCK)) as usize).min(ids.len());
        let start = s.keys.len();
        let mut prev = 0u64;
        for id in &ids[..full] {
            prev = chain(prev, id.as_u64().expect("an id"));
            s.keys.push(prev);
        }
        s.requests.push((len, start, s.keys.len()));
    }
    s
}

fn build(s: &Stream, sampling: Sampling) -> CurveBuilder {
    let mut b = CurveBuilder::new(sampling);
    for &(tokens, a, z) in &s.requests {
        b.request(tokens, BLOCK, s.keys[a..z].iter().copied(), None);
    }
    b
}

/// LRU of one capacity: a hash map into an intrusive doubly linked list
/// (indices into a slab), the usual O(1) simulator. Hit tokens over prompt
/// tokens, with the same prefix and last-token rules.
fn brute_lru(s: &Stream, cap: usize) -> f64 {
    const NIL: u32 = u32::MAX;
    struct Node {
        key: u64,
        prev: u32,
        next: u32,
    }
    let mut map: KeyMap<u32> = KeyMap::default();
    let mut nodes: Vec<Node> = Vec::with_capacity(cap + 1);
    let (mut head, mut tail) = (NIL, NIL); // head = most recent
    let unlink = |nodes: &mut Vec<Node>, head: &mut u32, tail: &mut u32, i: u32| {
        let (p, n) = (nodes[i as usize].prev, nodes[i as usize].next);
        if p != NIL {
            nodes[p as usize].next = n;
        } else {
            *head = n;
        }
        if n != NIL {
            nodes[n as usize].prev = p;
        } else {
            *tail = p;
        }
    };
    let push_front = |nodes: &mut Vec<Node>, head: &mut u32, tail: &mut u32, i: u32| {
        nodes[i as usize].prev = NIL;
        nodes[i as usize].next = *head;
        if *head != NIL {
            nodes[*head as usize].prev = i;
        }
        *head = i;
        if *tail == NIL {
            *tail = i;
        }
    };
    let (mut prompt, mut hit) = (0u64, 0u64);
    for &(tokens, a, z) in &s.requests {
        prompt += tokens;
        let keys = &s.keys[a..z];
        let lookable = ((tokens - 1) / u64::from(BLOCK)) as usize;
        let hits = keys[..lookable.min(keys.len())]
            .iter()
            .take_while(|k| map.contains_key(k))
            .count();
        hit += hits as u64 * u64::from(BLOCK);
        for &k in keys {
            if let Some(&i) = map.get(&k) {
                unlink(&mut nodes, &mut head, &mut tail, i);
                push_front(&mut nodes, &mut head, &mut tail, i);
                continue;
            }
            let i = if nodes.len() < cap {
                nodes.push(Node {
                    key: k,
                    prev: NIL,
                    next: NIL,
                });
                (nodes.len() - 1) as u32
            } else {
                let v = tail;
                unlink(&mut nodes, &mut head, &mut tail, v);
                map.remove(&nodes[v as usize].key);
                nodes[v as usize].key = k;
                v
            };
            map.insert(k, i);
            push_front(&mut nodes, &mut head, &mut tail, i);
        }
    }
    hit as f64 / prompt as f64
}

/// `capacity --policies`' model of one policy at `cap` blocks: hit tokens
/// over prompt tokens.
fn policy_model(s: &Stream, policy: CachePolicy, cap: usize) -> f64 {
    let mut m = CacheModel::new(policy, cap).expect("a model that fits");
    let mut prompt = 0u64;
    for &(tokens, a, z) in &s.requests {
        prompt += tokens;
        let matchable = (tokens.saturating_sub(1) / u64::from(BLOCK)) as usize;
        m.request(&s.keys[a..z], matchable);
    }
    (m.hits() * u64::from(BLOCK)) as f64 / prompt.max(1) as f64
}

fn distinct(s: &Stream) -> usize {
    let mut m: KeyMap<()> = KeyMap::default();
    for &k in &s.keys {
        m.insert(k, ());
    }
    m.len()
}

/// Exact and brute-force LRU at one capacity (a quarter of the distinct
/// blocks), in the same run; then SHARDS at `rates` with their error
/// against exact.
fn measure(name: &str, s: &Stream, rates: &[f64], samples: usize, time: Duration) {
    let refs = s.keys.len() as u64;
    let distinct = distinct(s);
    let per_s = |ns: f64| 1e9 / ns / 1e6;
    println!();
    println!(
        "{name}: {} requests, {refs} block references, {distinct} distinct blocks",
        s.requests.len()
    );
    println!("| {name} | M references/s | note |");
    println!("|---|---:|---|");
    let exact_ns = median_ns_per_unit(samples, time, refs, || {
        black_box(build(s, Sampling::Exact));
    });
    let exact = build(s, Sampling::Exact).curve();
    let cap = (distinct / 4).max(1);
    let lru_ns = median_ns_per_unit(samples, time, refs, || {
        black_box(brute_lru(s, cap));
    });
    let lru = brute_lru(s, cap);
    let at = exact.at_tokens(cap as u64 * u64::from(BLOCK)).hit_ratio;
    println!(
        "| exact curve (every capacity) | {:.1} | ceiling {:.4}; {:.2}× the brute-force LRU's rate |",
        per_s(exact_ns),
        exact.ceiling().0,
        lru_ns / exact_ns
    );
    println!(
        "| brute-force LRU, one capacity ({cap} blocks) | {:.1} | hit ratio {lru:.4}; the exact curve there {at:.4} |",
        per_s(lru_ns)
    );
    for name in ["lru", "lfu", "s3fifo", "arc", "tinylfu+lru"] {
        let policy: CachePolicy = name.parse().expect("a policy");
        let ns = median_ns_per_unit(samples, time, refs, || {
            black_box(policy_model(s, policy, cap));
        });
        println!(
            "| `capacity --policies` model, {name}, one capacity | {:.1} | hit ratio {:.4}; {:.2}× the exact curve's rate |",
            per_s(ns),
            policy_model(s, policy, cap),
            exact_ns / ns
        );
    }
    // Capacities for the error: log-spaced from 1/64 to 2× the distinct
    // blocks.
    let caps: Vec<u64> = (0..=24)
        .map(|i| {
            let f = 2f64.powf(-6.0 + 7.0 * f64::from(i) / 24.0);
            ((distinct as f64 * f).max(1.0) as u64) * u64::from(BLOCK)
        })
        .collect();
    for &rate in rates {
        let ns = median_ns_per_unit(samples, time, refs, || {
            black_box(build(s, Sampling::Fixed(rate)));
        });
        let c = build(s, Sampling::Fixed(rate)).curve();
        let mae = caps
            .iter()
            .map(|&t| (c.at_tokens(t).hit_ratio - exact.at_tokens(t).hit_ratio).abs())
            .sum::<f64>()
            / caps.len() as f64;
        let se = caps.iter().map(|&t| c.at_tokens(t).stderr).sum::<f64>() / caps.len() as f64;
        println!(
            "| SHARDS at {}% | {:.1} | mean absolute error {mae:.4} over {} capacities (reported standard error {se:.4}); {:.1}× exact's rate |",
            rate * 100.0,
            per_s(ns),
            caps.len(),
            exact_ns / ns
        );
    }
}

fn main() {
    let q = quick();
    let (samples, time) = if q {
        (1, Duration::from_millis(200))
    } else {
        (5, Duration::from_secs(2))
    };
    measure("Mooncake sample trace", &mooncake(), &[], samples, time);
    let (requests, groups) = if q {
        (20_000, 5_000)
    } else {
        (400_000, 100_000)
    };
    let t = Instant::now();
    let s = stream(requests, groups);
    println!(
        "\n(synthetic stream built in {:.1} s: Zipf-popular shared prefixes of 8-64 blocks, 0-32 blocks of each request's own)",
        t.elapsed().as_secs_f64()
    );
    measure("synthetic", &s, &[0.1, 0.01], samples.min(3), time);
}
