//! Breakpoint control as data: the commands a console or a server sends to
//! an engine's breakpoints ([`ControlCommand`]), what they return
//! ([`ControlResult`]), why one is refused ([`ControlError`]), and the one
//! trait every engine-side or remote control implements ([`Control`]).
//!
//! A command is executed in exactly one place, the engine's
//! `kvbm_core::hooks::Breakpoints`; the attach server forwards commands to
//! it, the console's local control is that very object, and its remote
//! control sends the same commands over the wire.

use crate::breakpoint::{
    BreakpointError, BreakpointInfo, BreakpointSpec, OwnerReleased, PausedCall,
};
use serde::{Deserialize, Serialize};

/// `GET /breakpoints`, and the payload of `ServerMsg::Breakpoints`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BreakpointsView {
    /// Breakpoints set.
    pub breakpoints: Vec<BreakpointInfo>,
    /// Calls paused now.
    pub paused: Vec<PausedCall>,
}

/// Breakpoint commands (WebSocket and HTTP alike).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case", deny_unknown_fields)]
pub enum ControlCommand {
    /// Set a breakpoint.
    Add {
        /// What it matches.
        spec: BreakpointSpec,
    },
    /// Clear one (its paused calls resume).
    Clear {
        /// Its id.
        id: u64,
    },
    /// Clear every breakpoint.
    ClearAll,
    /// Resume one paused call, or all with `None`.
    Resume {
        /// The pause, or all.
        pause_id: Option<u64>,
    },
    /// Resume everything and pause at the very next call.
    Step,
    /// The current breakpoints and paused calls.
    List,
}

/// What a control command returned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlResult {
    /// `Add`: the new breakpoint's id.
    Added(u64),
    /// `Clear`, `Resume` (one), `Step`: whether it did anything.
    Done(bool),
    /// `ClearAll`, `Resume` (all): how many.
    Count(u64),
    /// `List`.
    List(BreakpointsView),
}

/// Why a control command was not carried out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// The engine refused it (a bad spec, too many breakpoints).
    #[error(transparent)]
    Refused(#[from] BreakpointError),
    /// The engine has no breakpoints installed.
    #[error("this engine has no breakpoints installed")]
    NoBreakpoints,
    /// The command could not reach the engine, or its answer could not come
    /// back (a remote control that is disconnected, timed out, or was
    /// answered with an error).
    #[error("{0}")]
    Unavailable(String),
}

/// Breakpoint control of one engine, local or remote.
pub trait Control: Send + Sync {
    /// Carries out `command` on behalf of `owner` (a connected client; the
    /// owner of an added breakpoint is always `owner`, whatever the spec
    /// says).
    fn execute(
        &self,
        command: ControlCommand,
        owner: Option<u64>,
    ) -> Result<ControlResult, ControlError>;

    /// Removes the breakpoints `owner` set and resumes the calls they
    /// paused (its client went away). Controls that cannot (a remote one:
    /// the server does this itself) do nothing.
    fn release_owner(&self, owner: u64) -> OwnerReleased {
        let _ = owner;
        OwnerReleased::default()
    }

    /// Every owner that holds something now: a breakpoint, the armed
    /// step, or a call paused for it and not yet released. `None` where the
    /// control cannot tell (a remote one); whoever keeps leases then keeps
    /// each until it runs out. The listed breakpoints are not enough to
    /// tell: an armed step is not among them.
    fn owners(&self) -> Option<std::collections::HashSet<u64>> {
        None
    }

    /// The breakpoints and paused calls now (empty when unavailable).
    fn view(&self) -> BreakpointsView {
        match self.execute(ControlCommand::List, None) {
            Ok(ControlResult::List(v)) => v,
            _ => BreakpointsView::default(),
        }
    }
}
