//! Per-request slot states (the KV connector's slot lifecycle) as a checked state
//! machine.
//!
//! ```text
//! Initialized ─▶ (OnboardStaged(n) ─▶ Onboarding(n)) ─▶ Prefilling ─▶ Decoding ─▶ Finishing ─▶ Finished
//!                     detours: Prefilling ⇄ SkippedPrefill, Decoding ⇄ SkippedDecode,
//!                              running states ─▶ Preempted ─▶ (OnboardStaged | Prefilling)
//! ```
//!
//! - `OnboardStaged(n)`: host/disk blocks covering `n` tokens were found and
//!   staged (from `Initialized` or `Preempted`); staged anew when the engine
//!   asks again before allocating, and given up (straight to `Prefilling`
//!   or `Decoding`) when it allocates none of them.
//! - `Onboarding(n)`: device blocks were paired with them and loads issued.
//! - `Prefilling` / `Decoding`: set from what the scheduler ran this
//!   iteration (prompt tokens vs. generated ones).
//! - `SkippedPrefill` / `SkippedDecode`: the scheduler left the request out
//!   of an iteration.
//! - `Preempted`: device blocks were taken back; the tokens are kept.
//! - `Finishing`: the engine finished the request; outstanding transfers
//!   may still be draining. `Finished` once they have.
//!
//! [`SlotState::check`] is the one place the legal edges are written down;
//! anything else is a [`SlotError::IllegalTransition`].

use serde::{Deserialize, Serialize};
use std::fmt;

/// A request's slot state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SlotState {
    /// Created, nothing decided yet.
    Initialized,
    /// External (host/disk) blocks covering this many tokens are staged.
    OnboardStaged(usize),
    /// Loads of this many tokens are in flight.
    Onboarding(usize),
    /// Computing the prompt.
    Prefilling,
    /// Generating tokens.
    Decoding,
    /// Left out of an iteration while prefilling.
    SkippedPrefill,
    /// Left out of an iteration while decoding.
    SkippedDecode,
    /// Device blocks taken back under memory pressure; tokens kept.
    Preempted,
    /// Finished by the engine; outstanding operations draining.
    Finishing,
    /// Done: nothing outstanding.
    Finished,
}

/// A refused slot operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    /// The state machine has no such edge.
    #[error("request {request}: illegal slot transition {from} → {to}")]
    IllegalTransition {
        /// The request.
        request: String,
        /// Where it was.
        from: SlotState,
        /// Where it was asked to go.
        to: SlotState,
    },
    /// No slot for this request id.
    #[error("no slot for request {0}")]
    UnknownRequest(String),
    /// A slot for this request id already exists.
    #[error("a slot for request {0} already exists")]
    DuplicateRequest(String),
}

impl SlotState {
    /// A short name without the token count, for tables and filters.
    pub fn name(&self) -> &'static str {
        match self {
            SlotState::Initialized => "Initialized",
            SlotState::OnboardStaged(_) => "OnboardStaged",
            SlotState::Onboarding(_) => "Onboarding",
            SlotState::Prefilling => "Prefilling",
            SlotState::Decoding => "Decoding",
            SlotState::SkippedPrefill => "SkippedPrefill",
            SlotState::SkippedDecode => "SkippedDecode",
            SlotState::Preempted => "Preempted",
            SlotState::Finishing => "Finishing",
            SlotState::Finished => "Finished",
        }
    }

    /// All state names, in lifecycle order.
    pub const NAMES: [&'static str; 10] = [
        "Initialized",
        "OnboardStaged",
        "Onboarding",
        "Prefilling",
        "Decoding",
        "SkippedPrefill",
        "SkippedDecode",
        "Preempted",
        "Finishing",
        "Finished",
    ];

    /// True once nothing can happen to the slot any more.
    pub fn is_terminal(&self) -> bool {
        matches!(self, SlotState::Finished)
    }

    /// True for the states in which the request holds device blocks and
    /// may be scheduled.
    pub fn is_running(&self) -> bool {
        matches!(
            self,
            SlotState::Prefilling
                | SlotState::Decoding
                | SlotState::SkippedPrefill
                | SlotState::SkippedDecode
                | SlotState::Onboarding(_)
        )
    }

    /// Whether `self → to` is an edge of the state machine.
    pub fn can_go(&self, to: SlotState) -> bool {
        use SlotState::*;
        match (*self, to) {
            // Anything not yet finishing can be finished (the engine may
            // abort a request at any point) — except Finished itself.
            (Finishing | Finished, Finishing) => false,
            (_, Finishing) => true,
            (Finishing, Finished) => true,
            (Finished, _) | (_, Finished) => false,

            (Initialized | Preempted, OnboardStaged(n)) => n > 0,
            // An engine may ask again before it allocates (vLLM does, while
            // a request waits): the hit is staged anew, or given up and the
            // prompt computed instead.
            (OnboardStaged(a), OnboardStaged(b)) => b > 0 && b != a,
            (OnboardStaged(_), Prefilling | Decoding) => true,
            (OnboardStaged(a), Onboarding(b)) => b > 0 && b <= a,
            (Initialized | Preempted | Onboarding(_), Prefilling) => true,
            // A prompt fully served from cache goes straight to decoding.
            (Initialized | Preempted | Onboarding(_), Decoding) => true,
            (Prefilling, Prefilling | Decoding | SkippedPrefill) => true,
            (Decoding, Decoding | SkippedDecode) => true,
            (SkippedPrefill, Prefilling | SkippedPrefill | Decoding) => true,
            (SkippedDecode, Decoding | SkippedDecode) => true,
            (
                OnboardStaged(_) | Onboarding(_) | Prefilling | Decoding | SkippedPrefill
                | SkippedDecode,
                Preempted,
            ) => true,
            _ => false,
        }
    }

    /// `Ok(to)` for a legal edge, else a typed error naming the request.
    pub fn check(&self, request: &str, to: SlotState) -> Result<SlotState, SlotError> {
        if self.can_go(to) {
            Ok(to)
        } else {
            Err(SlotError::IllegalTransition {
                request: request.to_string(),
                from: *self,
                to,
            })
        }
    }
}

impl fmt::Display for SlotState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SlotState::OnboardStaged(n) => write!(f, "OnboardStaged({n})"),
            SlotState::Onboarding(n) => write!(f, "Onboarding({n})"),
            other => f.write_str(other.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SlotState::*;
    use proptest::prelude::*;

    #[test]
    fn the_v1_happy_paths_are_legal() {
        let paths: &[&[SlotState]] = &[
            &[
                Initialized,
                Prefilling,
                Prefilling,
                Decoding,
                Decoding,
                Finishing,
                Finished,
            ],
            &[
                Initialized,
                OnboardStaged(32),
                Onboarding(32),
                Prefilling,
                Decoding,
                Finishing,
                Finished,
            ],
            &[
                Initialized,
                Prefilling,
                SkippedPrefill,
                Prefilling,
                Decoding,
                SkippedDecode,
                Decoding,
                Finishing,
                Finished,
            ],
            &[
                Initialized,
                Prefilling,
                Decoding,
                Preempted,
                OnboardStaged(16),
                Onboarding(16),
                Decoding,
                Finishing,
                Finished,
            ],
            &[Initialized, Finishing, Finished],
            // Asked again while waiting: staged anew, then given up.
            &[
                Initialized,
                OnboardStaged(64),
                OnboardStaged(32),
                Prefilling,
                Decoding,
                Finishing,
                Finished,
            ],
        ];
        for p in paths {
            for w in p.windows(2) {
                assert_eq!(w[0].check("r", w[1]), Ok(w[1]), "{} → {}", w[0], w[1]);
            }
        }
    }

    #[test]
    fn illegal_edges_are_typed_errors() {
        for (from, to) in [
            (Finished, Prefilling),
            (Finishing, Decoding),
            (Decoding, Prefilling),
            (Initialized, Onboarding(4)),
            (OnboardStaged(4), Onboarding(8)),
            (Initialized, OnboardStaged(0)),
            (OnboardStaged(4), OnboardStaged(4)),
            (OnboardStaged(4), OnboardStaged(0)),
            (Finished, Finishing),
            (Prefilling, Finished),
        ] {
            let e = from.check("req-7", to).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("request req-7: illegal slot transition {from} → {to}")
            );
        }
    }

    fn state() -> impl Strategy<Value = SlotState> {
        prop_oneof![
            Just(Initialized),
            (0usize..4).prop_map(OnboardStaged),
            (0usize..4).prop_map(Onboarding),
            Just(Prefilling),
            Just(Decoding),
            Just(SkippedPrefill),
            Just(SkippedDecode),
            Just(Preempted),
            Just(Finishing),
            Just(Finished),
        ]
    }

    proptest! {
        // Any walk that only takes legal edges reaches Finished only through
        // Finishing, never leaves Finished, and never revisits Initialized.
        #[test]
        fn random_walks_respect_the_invariants(steps in proptest::collection::vec(state(), 0..60)) {
            let mut s = Initialized;
            let mut seen_finishing = false;
            for to in steps {
                match s.check("p", to) {
                    Ok(next) => {
                        prop_assert_ne!(next, Initialized);
                        if next == Finished { prop_assert!(seen_finishing && s == Finishing); }
                        prop_assert!(!s.is_terminal());
                        seen_finishing |= next == Finishing;
                        s = next;
                    }
                    Err(SlotError::IllegalTransition { from, to: t, .. }) => {
                        prop_assert_eq!(from, s);
                        prop_assert_eq!(t, to);
                    }
                    Err(e) => prop_assert!(false, "unexpected {e}"),
                }
            }
        }
    }
}
