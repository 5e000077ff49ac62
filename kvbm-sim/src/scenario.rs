//! Built-in scenarios: a fixed workload and the engine it runs on.
//!
//! The CPU-offload walk-through ([`cpu_offload_workload`]): request A (32
//! tokens, two full blocks) is computed on G1 and offloaded to the host
//! after its forward pass; ten seconds later request B, whose prompt starts
//! with A's 32 tokens, misses on G1 (its prefix cache is off, so only the
//! host can hit) and loads A's two blocks back from the host. The engine
//! ([`cpu_offload_engine`]) has 16-token blocks, 100 device blocks and 50
//! host blocks.

use crate::sim::SimConfig;
use crate::workload::{Origin, RequestSpec};

/// Requests A and B of the CPU-offload walk-through.
pub fn cpu_offload_workload() -> Vec<RequestSpec> {
    let a: Vec<u32> = (100..132).collect();
    let mut b = a.clone();
    b.extend(200..217);
    let spec = |id: &str, arrival_ms: f64, prompt: Vec<u32>| RequestSpec {
        id: id.into(),
        arrival_ms,
        prompt,
        output_len: 1,
        origin: Origin::Synthetic {
            index: 0,
            shared_prefix: None,
        },
    };
    vec![spec("A", 0.0, a), spec("B", 10_000.0, b)]
}

/// Sets the walk-through's engine on `config`: 16-token blocks, 1,600
/// device tokens, 800 host tokens, and no G1 prefix cache (so B's hit comes
/// from the host).
pub fn cpu_offload_engine(config: &mut SimConfig) {
    config.block_size = 16;
    config.device_capacity_tokens = 1600;
    config.host_capacity_tokens = 800;
    config.device_prefix_cache = false;
}
