//! `kvbm-console`: the terminal console for kvbm — tokio-console for
//! KV-cache lifecycles.
//!
//! - [`model`]: what the engine did, folded from events by the shared
//!   reducer (the same live and in replay), plus histories, rates,
//!   [`lints`].
//! - [`source`]: where events come from (a live engine's ring, a recorded
//!   log), with a live engine's breakpoint
//!   [`Control`](kvbm_events::control::Control) and the header badge each
//!   source draws for itself.
//! - [`ui`]: one type per view, each owning its rows (computed in the
//!   update step), its selection and its filter, and drawing from `&self`
//!   and the model; [`ui::chrome`] draws the header, tabs, footer and
//!   popups from plain values.
//! - [`app`]: the update step: the model, the source, the chrome's state
//!   and the views, changed by keys, the mouse and ticks; breakpoint
//!   commands go out as [`ControlCommand`](kvbm_events::control::ControlCommand)s.
//!   [`keys`]: the key table that dispatches keys and writes the help.
//! - [`remote`]: a remote engine through the attach server (or a vLLM ZMQ
//!   stream), fed into a local ring that a [`source::LiveSource`] reads;
//!   it builds sources, and the caller builds the app.
//! - [`run`]: the terminal and the `tokio::select!` loop;
//!   [`embedded`]: the simulated engine behind `demo`.
//! - [`bpspec`]: breakpoint specs as typed at the prompt; [`fmt`]: number
//!   and duration formatting.
//! - [`open`]: a recorded log read into a replay app (`replay`);
//!   [`compare`]: two of them side by side under the deltas of
//!   `kvbm-recorder compare` (`compare A B`).
//! - [`fleet`]: many engines through NATS (or a fleet recording): the
//!   Fleet, Prefixes and Where views, and drilling into one engine.
//!
//! Module dependencies point one way (`a → b`: `a` uses `b`):
//!
//! ```text
//! main (the binary) → run, app, remote, embedded, source, model, open, compare
//! compare  → run, app
//! open     → app, source, model
//! run      → app
//! app      → ui, keys, source, model, bpspec
//! ui       → keys, source (Badge), model, lints, bpspec, fmt
//! remote   → source
//! source   → model, fmt
//! model    → lints
//! lints    → fmt
//! fleet    → app, run, ui, keys, source, model, fmt
//! embedded, keys, bpspec, fmt: nothing in this crate
//! ```
//!
//! So the views never see the app, and the remote engine never sees the
//! views or the app.

pub mod app;
pub mod bpspec;
pub mod compare;
pub mod embedded;
pub mod fleet;
pub mod fmt;
pub mod keys;
pub mod lints;
pub mod model;
pub mod open;
pub mod remote;
pub mod run;
pub mod source;
pub mod ui;
pub mod walkthrough;
