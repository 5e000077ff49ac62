//! The `kvbm-recorder` program as a library, so that its tests and
//! benchmarks can reach what it wires together: the command line
//! ([`cli`]), the fleet recorder's writer threads behind a NATS consumer
//! ([`shards`]), the capacity curve of a Mooncake trace ([`trace`]) and
//! every cache policy's hit ratio beside it ([`policies`]).
//!
//! What is kept and how it is analysed is the recorder library
//! (`kvbm-recorder`); this crate brings the sources: the simulator, an
//! attach server, vLLM / SGLang over ZMQ, and NATS.

pub mod cli;
pub mod policies;
pub mod shards;
pub mod trace;
