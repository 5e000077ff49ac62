//! `kvbm-py`: kvbm inside vLLM, as its KV connector.
//!
//! The Rust core of `kvbm.vllm.KvbmConnector`, one side per vLLM process:
//!
//! - [`scheduler`]: the engine-core process. vLLM's scheduler-side calls
//!   drive kvbm's leader, pipelines and breakpoints; vLLM's device blocks
//!   are followed in a mirror pool; the attach server and the recording
//!   live here.
//! - [`worker`]: the worker process. vLLM's KV tensors are wrapped as G1
//!   (no copy), and each step's plan of stores and loads runs on kvbm's
//!   transfer engines.
//! - [`g1`]: vLLM's KV tensors read as a kvbm layout; `device` (feature
//!   `cuda`): the worker's copies when they are on a GPU.
//! - [`meta`]: what travels between the two, once per step.
//! - [`config`]: the `kv_connector_extra_config` keys; [`tiers`]: the
//!   shapes and files both sides derive alike.
//!
//! The Python module `kvbm._kvbm` (feature `python`, built by maturin) is
//! a thin layer over these; the Python class in `python/kvbm/vllm.py`
//! subclasses vLLM's `KVConnectorBase_V1` and reads vLLM's objects.

pub mod background;
pub mod config;
pub mod deferred;
#[cfg(feature = "cuda")]
pub mod device;
pub mod g1;
pub mod meta;
pub mod observe;
pub mod parallel;
pub mod phases;
pub mod scheduler;
pub mod tiers;
pub mod worker;

#[cfg(feature = "python")]
mod followed;
#[cfg(feature = "python")]
mod python;
