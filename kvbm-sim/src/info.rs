//! What the simulated engine runs as, as an engine embedding kvbm says it
//! (the attach server's hello, a recording's sidecar): a one-line
//! `summary` for the console's header, the facts behind it beside.

use crate::sim::{OffloadMode, SimConfig};
use kvbm_core::CachePolicy;
use kvbm_events::text::thousands;

/// The summary and facts of `cfg`. A tier's eviction policy is named
/// after its size when it is not LRU (`G2 65,536 tokens s3fifo`), the
/// offload mode at the end when it is not eager.
pub fn engine_info(cfg: &SimConfig) -> serde_json::Value {
    let tier = |name: &str, tokens: usize, policy: CachePolicy| match tokens {
        0 => format!("{name} none"),
        n if policy == CachePolicy::default() => format!("{name} {} tokens", thousands(n as u64)),
        n => format!("{name} {} tokens {policy}", thousands(n as u64)),
    };
    let e = cfg.eviction;
    let mut summary = format!(
        "simulator · {} · {} · {} · {}",
        cfg.model,
        tier("G1", cfg.device_capacity_tokens, e.device),
        tier("G2", cfg.host_capacity_tokens, e.host),
        tier("G3", cfg.disk_capacity_tokens, e.disk),
    );
    if cfg.offload_mode != OffloadMode::Eager {
        summary.push_str(&format!(" · offload {}", cfg.offload_mode));
    }
    serde_json::json!({
        "summary": summary,
        "source": "simulator",
        "model": cfg.model,
        "block_size": cfg.block_size,
        "device_tokens": cfg.device_capacity_tokens,
        "host_tokens": cfg.host_capacity_tokens,
        "disk_tokens": cfg.disk_capacity_tokens,
        "eviction": e.to_string(),
        "offload": cfg.offload_mode.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_core::eviction::TierEviction;

    #[test]
    fn the_engine_info_sums_up_the_tiers_and_names_a_policy_other_than_lru() {
        let mut cfg = SimConfig {
            model: "llama-3-8b".into(),
            device_capacity_tokens: 32_768,
            host_capacity_tokens: 65_536,
            disk_capacity_tokens: 0,
            ..SimConfig::default()
        };
        let info = engine_info(&cfg);
        assert_eq!(
            info["summary"],
            "simulator · llama-3-8b · G1 32,768 tokens · G2 65,536 tokens · G3 none"
        );
        assert_eq!(info["host_tokens"], 65_536);
        assert_eq!(info["eviction"], "G1=lru,G2=lru,G3=lru");
        cfg.eviction = "G2=s3fifo".parse::<TierEviction>().unwrap();
        let info = engine_info(&cfg);
        assert_eq!(
            info["summary"],
            "simulator · llama-3-8b · G1 32,768 tokens · G2 65,536 tokens s3fifo · G3 none"
        );
        assert_eq!(info["eviction"], "G1=lru,G2=s3fifo,G3=lru");
        assert_eq!(info["offload"], "eager");
        cfg.eviction = "tinylfu+lru".parse::<TierEviction>().unwrap();
        cfg.offload_mode = "after-hits:2".parse().unwrap();
        let info = engine_info(&cfg);
        assert_eq!(
            info["summary"],
            "simulator · llama-3-8b · G1 32,768 tokens · G2 65,536 tokens tinylfu+lru · G3 none \
             · offload after-hits:2"
        );
    }
}
