//! Breakpoint specs typed at the console's prompt.
//!
//! The syntax is space-separated `key=value` pairs, every pair must match
//! (AND), like the engine's [`BreakpointSpec`]:
//!
//! ```text
//! state=Decoding request=req-7
//! prefix=req- entry=get_num_new_matched_tokens
//! direction=G1>G2
//! ```
//!
//! Keys: `state` (a slot state name), `request` (an exact id), `prefix` (an
//! id prefix), `direction` (`G1>G2`, `G1→G2` or `G1-G2`), `entry` (an entry
//! point's snake_case name). A bare word is taken as `request=`. Errors
//! name the word that was wrong and what was expected.

use kvbm_events::breakpoint::{BreakpointSpec, RequestMatch};
use kvbm_events::slot::SlotState;
use kvbm_events::tier::Tier;
use kvbm_events::{Direction, EntryPoint};

/// Why a typed spec could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// Nothing was typed.
    #[error("empty breakpoint: give at least one of state=, request=, prefix=, direction=, entry=")]
    Empty,
    /// An unknown key.
    #[error("unknown key `{0}`: expected state, request, prefix, direction or entry")]
    UnknownKey(String),
    /// A key given twice (or request and prefix together).
    #[error("`{0}` given twice")]
    Repeated(&'static str),
    /// The engine's own check refused it.
    #[error("{0}")]
    Invalid(String),
    /// A value that does not parse.
    #[error("bad {key} `{value}`: {expected}")]
    BadValue {
        /// The key.
        key: &'static str,
        /// What was typed.
        value: String,
        /// What would have worked.
        expected: String,
    },
}

fn tier(s: &str) -> Option<Tier> {
    Tier::ALL
        .into_iter()
        .find(|t| t.short_name().eq_ignore_ascii_case(s))
}

/// Parses `G1>G2`, `G1→G2`, `G1->G2` or `G1-G2`.
pub fn parse_direction(s: &str) -> Option<Direction> {
    let s = s.trim();
    let (a, b) = ["->", "→", ">", "-"]
        .iter()
        .find_map(|sep| s.split_once(sep))?;
    let (src, dst) = (tier(a.trim())?, tier(b.trim())?);
    (src != dst).then_some(Direction { src, dst })
}

/// Parses one spec; see the module docs.
pub fn parse(text: &str) -> Result<BreakpointSpec, SpecError> {
    let mut spec = BreakpointSpec::default();
    for word in text.split_whitespace() {
        let (key, value) = word.split_once('=').unwrap_or(("request", word));
        let bad = |key: &'static str, expected: String| SpecError::BadValue {
            key,
            value: value.to_string(),
            expected,
        };
        match key.to_ascii_lowercase().as_str() {
            "state" => {
                if spec.state.is_some() {
                    return Err(SpecError::Repeated("state"));
                }
                let name = SlotState::NAMES
                    .iter()
                    .find(|n| n.eq_ignore_ascii_case(value))
                    .ok_or_else(|| {
                        bad("state", format!("one of {}", SlotState::NAMES.join(", ")))
                    })?;
                spec.state = Some((*name).to_string());
            }
            k @ ("request" | "prefix") => {
                if spec.request.is_some() {
                    return Err(SpecError::Repeated("request/prefix"));
                }
                if value.is_empty() {
                    return Err(bad("request", "a non-empty id".into()));
                }
                spec.request = Some(if k == "request" {
                    RequestMatch::Exact(value.to_string())
                } else {
                    RequestMatch::Prefix(value.to_string())
                });
            }
            "direction" | "dir" => {
                if spec.direction.is_some() {
                    return Err(SpecError::Repeated("direction"));
                }
                spec.direction =
                    Some(parse_direction(value).ok_or_else(|| {
                        bad("direction", "two different tiers, like G1>G2".into())
                    })?);
            }
            "entry" => {
                if spec.entry.is_some() {
                    return Err(SpecError::Repeated("entry"));
                }
                let names: Vec<&str> = EntryPoint::ALL.iter().map(|e| e.name()).collect();
                spec.entry = Some(
                    EntryPoint::from_name(&value.to_ascii_lowercase())
                        .ok_or_else(|| bad("entry", format!("one of {}", names.join(", "))))?,
                );
            }
            _ => return Err(SpecError::UnknownKey(key.to_string())),
        }
    }
    if spec.state.is_none()
        && spec.request.is_none()
        && spec.direction.is_none()
        && spec.entry.is_none()
    {
        return Err(SpecError::Empty);
    }
    spec.validate()
        .map_err(|e| SpecError::Invalid(e.to_string()))?;
    Ok(spec)
}

/// A spec written back in the syntax [`parse`] reads.
pub fn describe(spec: &BreakpointSpec) -> String {
    let mut parts = Vec::new();
    if let Some(s) = &spec.state {
        parts.push(format!("state={s}"));
    }
    match &spec.request {
        Some(RequestMatch::Exact(r)) => parts.push(format!("request={r}")),
        Some(RequestMatch::Prefix(p)) => parts.push(format!("prefix={p}")),
        None => {}
    }
    if let Some(d) = &spec.direction {
        parts.push(format!(
            "direction={}>{}",
            d.src.short_name(),
            d.dst.short_name()
        ));
    }
    if let Some(e) = &spec.entry {
        parts.push(format!("entry={}", e.name()));
    }
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn reads_every_key() {
        let s = parse("state=decoding request=req-7").unwrap();
        assert_eq!(s.state.as_deref(), Some("Decoding"));
        assert_eq!(s.request, Some(RequestMatch::Exact("req-7".into())));
        let s = parse("prefix=req- dir=G1→G2 entry=transfer_execute").unwrap();
        assert_eq!(s.request, Some(RequestMatch::Prefix("req-".into())));
        assert_eq!(s.direction, Some(Direction::DEVICE_TO_HOST));
        assert_eq!(s.entry, Some(EntryPoint::TransferExecute));
        assert_eq!(
            parse("req-9").unwrap().request,
            Some(RequestMatch::Exact("req-9".into()))
        );
        assert_eq!(parse_direction("g3-g2"), Some(Direction::DISK_TO_HOST));
        assert!(s.validate().is_ok());
    }

    #[test]
    fn errors_name_what_was_wrong() {
        assert_eq!(parse("  "), Err(SpecError::Empty));
        assert_eq!(
            parse("color=red"),
            Err(SpecError::UnknownKey("color".into()))
        );
        assert_eq!(
            parse("state=a state=b").unwrap_err(),
            SpecError::BadValue {
                key: "state",
                value: "a".into(),
                expected: format!("one of {}", SlotState::NAMES.join(", ")),
            }
        );
        assert_eq!(
            parse("request=a prefix=b"),
            Err(SpecError::Repeated("request/prefix"))
        );
        assert!(
            parse("direction=G1>G1")
                .unwrap_err()
                .to_string()
                .contains("G1>G1")
        );
        assert!(
            parse("entry=nope")
                .unwrap_err()
                .to_string()
                .contains("create_slot")
        );
        assert!(matches!(parse("request="), Err(SpecError::BadValue { .. })));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn never_panics_and_what_parses_validates(text in ".{0,80}") {
            if let Ok(spec) = parse(&text) {
                prop_assert!(spec.validate().is_ok());
            }
        }

        #[test]
        fn describe_round_trips(
            state in proptest::option::of(proptest::sample::select(SlotState::NAMES.to_vec())),
            request in proptest::option::of("[a-z0-9-]{1,12}"),
            entry in proptest::option::of(proptest::sample::select(EntryPoint::ALL.to_vec())),
        ) {
            let spec = BreakpointSpec {
                state: state.map(str::to_string),
                request: request.map(RequestMatch::Exact),
                entry,
                direction: Some(Direction::HOST_TO_DISK),
                owner: None,
            };
            prop_assert_eq!(parse(&describe(&spec)).unwrap(), spec);
        }
    }
}
