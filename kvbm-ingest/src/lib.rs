//! `kvbm-ingest`: kvbm events from engines that are not ours.
//!
//! - [`vllm`]: vLLM's and SGLang's KV events over ZMQ (msgpack), turned
//!   into block events with gaps, replay and restarts accounted for.
//! - [`tracing_layer`]: a `tracing_subscriber::Layer` that turns `tracing`
//!   events with target `kvbm` into kvbm events, for Rust engines.

pub mod tracing_layer;
pub mod vllm;
