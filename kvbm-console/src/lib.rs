//! `kvbm-console`: the terminal console for kvbm — tokio-console for
//! KV-cache lifecycles.
//!
//! - [`model`]: what the engine did, folded from events by the shared
//!   reducer (the same live and in replay), plus histories, rates, lints.
//! - [`source`]: where events come from (a live engine's ring, a recorded
//!   log), with a live engine's breakpoint
//!   [`Control`](kvbm_events::control::Control).
//! - [`app`]: the UI state and the update step; [`keys`]: the key table
//!   that dispatches keys and writes the help.
//! - [`ui`]: the views, drawn from `&App`.
//! - [`remote`]: a remote engine through the attach server, fed into a
//!   local ring that a [`source::LiveSource`] reads;
//! - [`run`]: the terminal and the `tokio::select!` loop;
//!   [`embedded`]: the simulated engine behind `demo`.

pub mod app;
pub mod bpspec;
pub mod embedded;
pub mod fmt;
pub mod keys;
pub mod lints;
pub mod model;
pub mod remote;
pub mod run;
pub mod source;
pub mod ui;
