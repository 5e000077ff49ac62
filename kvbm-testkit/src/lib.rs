//! Helpers shared by the tests and benchmarks of every kvbm crate: timing
//! (a median over samples), block contents for round trips, the workspace's own binaries, built on demand
//! so one crate's test can run another crate's program, the data files the
//! repository keeps for them, the GPU tests' skip-or-fail rule, the real vLLM that tests of kvbm against vLLM
//! use, a real `nats-server` for the fleet's tests, and a served program's
//! URL.
//!
//! Only ever a dev-dependency.

pub mod bench;
pub mod bin;
pub mod bytes;
pub mod data;
pub mod gpu;
pub mod nats;
pub mod served;
pub mod tmux;
pub mod vllm;
