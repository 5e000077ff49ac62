//! `kvbm-events`: the vocabulary every kvbm crate speaks.
//!
//! - [`event`]: the envelope and the event kinds (each declared once);
//!   [`tier`], [`slot`] and [`hash`]: the tiers, slot states and block
//!   hashes the kinds talk about; [`fields`]: a kind read from named
//!   values, field by field, as its declaration says.
//! - [`emitter`]: stamps events and publishes them on the [`bus`], a
//!   lossy broadcast for live viewers plus one bounded lossless tap.
//! - [`ring`]: the last N events in memory, for consoles and servers to
//!   read at their own pace.
//! - [`reducer`]: `state = fold(events)`, the one model behind the console,
//!   replay, the server's snapshots and every analysis.
//! - [`run`]: the random identity of one engine run.
//! - [`breakpoint`] and [`control`]: breakpoint specs and the control
//!   commands, as data.
//! - [`text`]: clipping untrusted text echoed back in an error; [`addr`]:
//!   the `HOST:PORT` every address the tools take ends in, read alike.
//! - `testing` (feature `testing`): property-test strategies for events.
//!
//! What must not live here: the block manager itself (`kvbm-core`), file
//! formats (`kvbm-schema`, `kvbm-recorder`), sockets or terminals.

pub mod addr;
pub mod breakpoint;
pub mod bus;
pub mod control;
pub mod emitter;
#[macro_use]
pub mod event;
pub mod fields;
pub mod hash;
pub mod reducer;
pub mod ring;
pub mod run;
pub mod slot;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod text;
pub mod tier;

pub use emitter::{Clock, Emitter, MonotonicClock, VirtualClock};
pub use event::{
    Category, Direction, EntryPoint, Event, EventKind, HookPhase, KindTag, RequestId, ResumeCause,
};
pub use hash::{BlockHash, SaltHash, SequenceHash};
pub use run::RunId;
pub use slot::SlotState;
pub use tier::{BlockId, Tier};
