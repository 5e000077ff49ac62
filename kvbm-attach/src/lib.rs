//! `kvbm-attach`: attaching to a running engine over the attach protocol
//! (`kvbm_schema::protocol`).
//!
//! - [`server`] (feature `server`, axum): serves an engine's ring as a
//!   WebSocket stream with backfill, a reducer snapshot, Prometheus
//!   metrics, a health check and breakpoint control over an
//!   `Arc<dyn kvbm_events::control::Control>`.
//! - [`nats`] (feature `nats`): the fleet's event plane over NATS
//!   JetStream: a publisher, the consumers, control by request-reply.
//! - [`client`] (feature `client`): follows a server with reconnection and
//!   resume, and sends control commands.

// The module list links each module; without its feature a module is not
// there to link to (the workspace's docs build every feature).
#![cfg_attr(
    not(all(feature = "client", feature = "nats", feature = "server")),
    allow(rustdoc::broken_intra_doc_links)
)]

/// How long a breakpoint (or a step) that a command set without naming
/// its owner lives — over HTTP without a client (the attach server's
/// default `ServerConfig::lease`), over NATS without a session — before
/// it is removed and what it paused resumes. Such a breakpoint gets a
/// lease of its own as its owner, so it never outlives its owner, and
/// both control planes give it the same time.
pub const ANONYMOUS_LEASE: std::time::Duration = std::time::Duration::from_secs(300);

#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "server")]
pub mod server;
