//! Helpers shared by the tests and benchmarks of every kvbm crate: timing
//! (a median over samples), the workspace's own binaries, built on demand
//! so one crate's test can run another crate's program, and the real vLLM
//! that tests of kvbm against vLLM use.
//!
//! Only ever a dev-dependency.

pub mod bench;
pub mod bin;
pub mod vllm;
