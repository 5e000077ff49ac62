//! Helpers shared by the tests and benchmarks of every kvbm crate: timing
//! (a median over samples) and the workspace's own binaries, built on
//! demand so one crate's test can run another crate's program, and a
//! real `nats-server` for the fleet's tests.
//!
//! Only ever a dev-dependency.

pub mod bench;
pub mod bin;
pub mod nats;
