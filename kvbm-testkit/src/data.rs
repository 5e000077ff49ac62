//! Data files kept in the repository for tests and benchmarks.

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
