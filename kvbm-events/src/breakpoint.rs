//! Breakpoints as data: which calls a breakpoint pauses ([`BreakpointSpec`]),
//! the call it is matched against ([`CallInfo`]), what a list of
//! breakpoints and paused calls looks like, and why a spec is refused.
//!
//! The machinery that pauses an engine's thread is the block manager's
//! (`kvbm_core::hooks::Breakpoints`); consoles, servers and recordings only
//! carry these types, so they live with the rest of the vocabulary.

use crate::event::{Direction, EntryPoint, RequestId};
use crate::slot::SlotState;
use crate::text::{MAX_QUOTED_CHARS, clip};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// What an instrumented entry point is about to do (or just did).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallInfo {
    /// Which entry point.
    pub entry: EntryPoint,
    /// The request it is for, where there is one.
    pub request: Option<RequestId>,
    /// The request's slot state when the call starts, where there is one.
    pub state: Option<SlotState>,
    /// The transfer direction, for calls that move blocks.
    pub direction: Option<Direction>,
}

impl CallInfo {
    /// A call to `entry` with nothing else known.
    pub fn new(entry: EntryPoint) -> Self {
        CallInfo {
            entry,
            request: None,
            state: None,
            direction: None,
        }
    }

    /// Sets the request.
    pub fn with_request(mut self, request: RequestId) -> Self {
        self.request = Some(request);
        self
    }

    /// Sets the slot state.
    pub fn with_state(mut self, state: SlotState) -> Self {
        self.state = Some(state);
        self
    }

    /// Sets the transfer direction.
    pub fn with_direction(mut self, direction: Direction) -> Self {
        self.direction = Some(direction);
        self
    }
}

/// Default for how long a pause lasts before it resumes by itself.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(60);
/// Shortest accepted pause deadline.
pub const MIN_DEADLINE: Duration = Duration::from_millis(1);
/// Longest accepted pause deadline. A day is far beyond any debugging
/// session, and keeps `Instant + deadline` and the event's `deadline_ns`
/// far from overflow.
pub const MAX_DEADLINE: Duration = Duration::from_secs(24 * 60 * 60);
/// Default cap on the number of breakpoints.
pub const DEFAULT_MAX_BREAKPOINTS: usize = 1024;
/// Longest accepted request id or prefix in a spec, in bytes. Specs come
/// from the network later; the cap keeps one from carrying megabytes.
pub const MAX_REQUEST_MATCH_LEN: usize = 1024;
/// Breakpoint id reported for a pause caused by `Breakpoints::step`.
pub const STEP_BREAKPOINT: u64 = 0;

/// How a breakpoint matches the request id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RequestMatch {
    /// The whole id.
    Exact(String),
    /// The id starts with this.
    Prefix(String),
}

impl RequestMatch {
    fn pattern(&self) -> &str {
        match self {
            RequestMatch::Exact(s) | RequestMatch::Prefix(s) => s,
        }
    }

    /// Whether `request` matches.
    pub fn matches(&self, request: &str) -> bool {
        match self {
            RequestMatch::Exact(s) => request == s,
            RequestMatch::Prefix(p) => request.starts_with(p.as_str()),
        }
    }
}

/// Which calls a breakpoint pauses. Every field that is set must match
/// (AND); a call without the thing a field asks about (no request, no
/// state, no direction) does not match it. At least one of `state`,
/// `request`, `direction`, `entry` must be set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakpointSpec {
    /// A slot state name (one of [`SlotState::NAMES`], e.g. `"Decoding"`),
    /// compared with [`SlotState::name`], so `"Onboarding"` matches any
    /// token count.
    pub state: Option<String>,
    /// The request id, exactly or by prefix.
    pub request: Option<RequestMatch>,
    /// The transfer direction.
    pub direction: Option<Direction>,
    /// The entry point.
    pub entry: Option<EntryPoint>,
    /// The client that set it (not a match field). A server must fill this
    /// in itself from the connection, not take it from the client, so that
    /// `Breakpoints::release_owner` can clean up after a client that
    /// goes away.
    pub owner: Option<u64>,
}

impl BreakpointSpec {
    /// Matches this slot state name.
    pub fn with_state(mut self, state: impl Into<String>) -> Self {
        self.state = Some(state.into());
        self
    }

    /// Matches this request id exactly.
    pub fn with_request(mut self, request: impl Into<String>) -> Self {
        self.request = Some(RequestMatch::Exact(request.into()));
        self
    }

    /// Matches request ids starting with `prefix`.
    pub fn with_request_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.request = Some(RequestMatch::Prefix(prefix.into()));
        self
    }

    /// Matches this transfer direction.
    pub fn with_direction(mut self, direction: Direction) -> Self {
        self.direction = Some(direction);
        self
    }

    /// Matches this entry point.
    pub fn with_entry(mut self, entry: EntryPoint) -> Self {
        self.entry = Some(entry);
        self
    }

    /// Belongs to client `owner`.
    pub fn with_owner(mut self, owner: u64) -> Self {
        self.owner = Some(owner);
        self
    }

    /// Checks the spec: something to match on, a known state name, a
    /// non-empty request pattern of bounded length.
    pub fn validate(&self) -> Result<(), BreakpointError> {
        if self.state.is_none()
            && self.request.is_none()
            && self.direction.is_none()
            && self.entry.is_none()
        {
            return Err(BreakpointError::EmptySpec);
        }
        if let Some(s) = &self.state
            && !SlotState::NAMES.contains(&s.as_str())
        {
            return Err(BreakpointError::UnknownState(clip(s, MAX_QUOTED_CHARS)));
        }
        if let Some(r) = &self.request {
            let p = r.pattern();
            // An empty pattern is almost surely a blank field in a form,
            // not a wish to match every request.
            if p.is_empty() {
                return Err(BreakpointError::EmptyRequestMatch);
            }
            if p.len() > MAX_REQUEST_MATCH_LEN {
                return Err(BreakpointError::RequestMatchTooLong {
                    len: p.len(),
                    max: MAX_REQUEST_MATCH_LEN,
                });
            }
        }
        Ok(())
    }

    /// Whether `call` matches. Assumes a validated spec.
    pub fn matches(&self, call: &CallInfo) -> bool {
        if self.entry.is_some_and(|e| e != call.entry) {
            return false;
        }
        if let Some(d) = self.direction
            && call.direction != Some(d)
        {
            return false;
        }
        if let Some(s) = &self.state
            && call.state.is_none_or(|cs| cs.name() != s)
        {
            return false;
        }
        if let Some(r) = &self.request
            && call.request.as_deref().is_none_or(|id| !r.matches(id))
        {
            return false;
        }
        true
    }
}

/// A refused breakpoint command.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BreakpointError {
    /// The spec sets none of state, request, direction, entry.
    #[error("a breakpoint must match on at least one of state, request, direction or entry")]
    EmptySpec,
    /// The state is not a slot state name.
    #[error("unknown slot state `{0}`; expected one of {names}", names = SlotState::NAMES.join(", "))]
    UnknownState(String),
    /// The request id or prefix is empty.
    #[error("the request id or prefix to match is empty")]
    EmptyRequestMatch,
    /// The request id or prefix is too long.
    #[error("the request id or prefix to match is {len} bytes long; at most {max} are accepted")]
    RequestMatchTooLong {
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// As many breakpoints as allowed already exist.
    #[error("too many breakpoints: at most {max} may exist at once")]
    Full {
        /// The cap.
        max: usize,
    },
    /// A pause deadline outside [`MIN_DEADLINE`]..=[`MAX_DEADLINE`].
    #[error("pause deadline {got:?} is out of range {min:?}..={max:?}")]
    BadDeadline {
        /// What was asked for.
        got: Duration,
        /// Shortest accepted.
        min: Duration,
        /// Longest accepted.
        max: Duration,
    },
}

/// One breakpoint, as `Breakpoints::list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BreakpointInfo {
    /// Its id (1 and up; never reused).
    pub id: u64,
    /// What it matches.
    pub spec: BreakpointSpec,
    /// Calls it has paused.
    pub hits: u64,
}

/// A call paused now, as `Breakpoints::paused` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PausedCall {
    /// Its id, for `Breakpoints::resume` (1 and up; never reused).
    pub pause_id: u64,
    /// The breakpoint that paused it; [`STEP_BREAKPOINT`] (0) for a step.
    pub breakpoint: u64,
    /// The call.
    pub call: CallInfo,
    /// How long it has been paused.
    pub waited: Duration,
    /// How long until it resumes by itself.
    pub deadline_in: Duration,
}

/// What `Breakpoints::release_owner` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OwnerReleased {
    /// Breakpoints removed.
    pub breakpoints: usize,
    /// Paused calls resumed.
    pub resumed: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn spec_matching_per_field() {
        let c = CallInfo::new(EntryPoint::UpdateStateAfterAlloc)
            .with_request(Arc::from("chat-17"))
            .with_state(SlotState::Onboarding(32))
            .with_direction(Direction::HOST_TO_DEVICE);
        let yes = [
            BreakpointSpec::default().with_state("Onboarding"),
            BreakpointSpec::default().with_request("chat-17"),
            BreakpointSpec::default().with_request_prefix("chat-"),
            BreakpointSpec::default().with_direction(Direction::HOST_TO_DEVICE),
            BreakpointSpec::default().with_entry(EntryPoint::UpdateStateAfterAlloc),
            BreakpointSpec::default()
                .with_state("Onboarding")
                .with_request_prefix("chat")
                .with_direction(Direction::HOST_TO_DEVICE)
                .with_entry(EntryPoint::UpdateStateAfterAlloc),
        ];
        for s in &yes {
            s.validate().unwrap();
            assert!(s.matches(&c), "{s:?}");
        }
        let no = [
            BreakpointSpec::default().with_state("Decoding"),
            BreakpointSpec::default().with_request("chat-1"),
            BreakpointSpec::default().with_request_prefix("chat-18"),
            BreakpointSpec::default().with_direction(Direction::DEVICE_TO_HOST),
            BreakpointSpec::default().with_entry(EntryPoint::CreateSlot),
            // One field off is enough to miss.
            BreakpointSpec::default()
                .with_state("Onboarding")
                .with_entry(EntryPoint::CreateSlot),
        ];
        for s in &no {
            assert!(!s.matches(&c), "{s:?}");
        }
        // A call lacking the thing asked about does not match.
        let bare = CallInfo::new(EntryPoint::UpdateStateAfterAlloc);
        for s in &yes[..4] {
            assert!(!s.matches(&bare), "{s:?}");
        }
        assert!(yes[4].matches(&bare));
    }

    #[test]
    fn spec_serde_round_trip_and_unknown_fields_rejected() {
        let s = BreakpointSpec::default()
            .with_state("Decoding")
            .with_request_prefix("r-")
            .with_direction(Direction::DISK_TO_HOST)
            .with_entry(EntryPoint::TransferExecute)
            .with_owner(9);
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<BreakpointSpec>(&json).unwrap(), s);
        let sparse: BreakpointSpec = serde_json::from_str(r#"{"state":"Decoding"}"#).unwrap();
        assert_eq!(sparse, BreakpointSpec::default().with_state("Decoding"));
        assert!(serde_json::from_str::<BreakpointSpec>(r#"{"stat":"Decoding"}"#).is_err());
    }
}
