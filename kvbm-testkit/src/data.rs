//! Data files kept in the repository for tests and benchmarks, and shared
//! fixtures (what an engine runs as).

use std::path::PathBuf;

/// The sample Mooncake trace kept in the repository
/// (`data/mooncake/synthetic_trace.jsonl` at the workspace root): 3,993
/// requests whose `hash_ids` name 512-token prefix blocks.
pub fn mooncake_sample_trace() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/mooncake/synthetic_trace.jsonl"
    ))
}

/// The one-line summary of [`engine_info`].
pub const ENGINE_SUMMARY: &str =
    "vLLM · tp 2 · async scheduling · G2 8,192 tokens (4.0 MiB a rank) · G3 none";

/// What an engine runs as, as the connector describes it (the recording's
/// sidecar `engine_info`, `/health`, the attach stream's `Hello`): a
/// tensor-parallel vLLM with async scheduling and a host tier, summed up
/// by [`ENGINE_SUMMARY`]. One fixture for every crate's tests of where it
/// goes.
pub fn engine_info() -> serde_json::Value {
    serde_json::json!({
        "summary": ENGINE_SUMMARY,
        "source": "vllm",
        "tensor_parallel": 2,
        "pipeline_parallel": 1,
        "async_scheduling": true,
        "block_size": 32,
        "host_tokens": 8192,
        "disk_tokens": 0,
    })
}
