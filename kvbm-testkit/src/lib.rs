//! Helpers shared by the tests and benchmarks of every kvbm crate: timing
//! (a median over samples), the workspace's own binaries, built on
//! demand so one crate's test can run another crate's program, and the
//! data files the repository keeps for them.
//!
//! Only ever a dev-dependency.

pub mod bench;
pub mod bin;
pub mod data;
