//! The fleet's event plane on the wire: what a NATS message and its
//! subject are, with no NATS client in sight.
//!
//! The publisher, the durable consumer and control live in `kvbm-attach`
//! (feature `nats`); a recorder that only reads what they carried needs
//! this module alone.
//!
//! - [`wire`]: a batch of one engine's consecutive events as one message.
//! - [`track`]: what a consumer needs to apply each (engine, seq) once and
//!   to tell holes from duplicates, as plain state (no I/O).
//!
//! # Subjects and the stream
//!
//! | subject | what |
//! |---|---|
//! | `kvbm.events.<engine>` | event batches of one engine, in the stream [`STREAM`] |
//! | `kvbm.control.<engine>` | control requests (core NATS request-reply, not stored) |
//!
//! An engine name is one subject token: 1 to [`MAX_ENGINE_NAME`] ASCII
//! letters, digits, `-` and `_` ([`check_engine_name`]).

pub mod track;
pub mod wire;

/// The stream that holds every engine's event batches.
pub const STREAM: &str = "KVBM_EVENTS";
/// Event batches of engine `E` go to `kvbm.events.E`.
pub const EVENTS_PREFIX: &str = "kvbm.events.";
/// Control requests for engine `E` go to `kvbm.control.E`.
pub const CONTROL_PREFIX: &str = "kvbm.control.";
/// Longest engine name.
pub const MAX_ENGINE_NAME: usize = 64;

/// The events subject of `engine`.
pub fn events_subject(engine: &str) -> String {
    format!("{EVENTS_PREFIX}{engine}")
}

/// The control subject of `engine`.
pub fn control_subject(engine: &str) -> String {
    format!("{CONTROL_PREFIX}{engine}")
}

/// The engine an events subject names, if it is one.
pub fn engine_of_subject(subject: &str) -> Option<&str> {
    let name = subject.strip_prefix(EVENTS_PREFIX)?;
    check_engine_name(name).ok().map(|_| name)
}

/// An engine name that cannot be a subject token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "engine name {name:?}: use 1 to {MAX_ENGINE_NAME} ASCII letters, digits, '-' or '_' \
     (it becomes the subject token of kvbm.events.<engine>)"
)]
pub struct BadEngineName {
    /// The name, clipped.
    pub name: String,
}

/// Checks that `name` can be an engine's subject token.
pub fn check_engine_name(name: &str) -> Result<(), BadEngineName> {
    let ok = !name.is_empty()
        && name.len() <= MAX_ENGINE_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(BadEngineName {
            name: kvbm_events::text::clip(name, kvbm_events::text::MAX_QUOTED_CHARS),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_names_are_single_subject_tokens() {
        for ok in ["a", "sim-0", "vllm_pod_17", &"x".repeat(MAX_ENGINE_NAME)] {
            assert!(check_engine_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "a.b",
            "a b",
            "*",
            ">",
            "é",
            "a\n",
            &"x".repeat(MAX_ENGINE_NAME + 1),
        ] {
            assert!(check_engine_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(engine_of_subject("kvbm.events.sim-3"), Some("sim-3"));
        assert_eq!(engine_of_subject("kvbm.events.a.b"), None);
        assert_eq!(engine_of_subject("kvbm.control.a"), None);
    }
}
