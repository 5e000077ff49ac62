//! Which run of an engine events belong to ([`RunId`]).
//!
//! Sequence numbers start again at 0 when an engine restarts, and every
//! engine may report the same engine id, so neither tells one run from the
//! next: a client that reconnects after a restart would otherwise splice
//! the new run onto the old one as soon as the new run's numbers have
//! passed the old ones. Each [`Emitter`](crate::Emitter) draws a random
//! run id when it is created; the attach server states it in its `hello`
//! and `/health`, and a recording keeps it in its sidecar.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// A random 64-bit identity of one engine run, written as 16 lowercase
/// hex digits (in JSON too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RunId(pub u64);

impl RunId {
    /// A fresh random id.
    pub fn random() -> Self {
        RunId(random_u64())
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Why a run id did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a run id is 1 to 16 hex digits")]
pub struct BadRunId;

impl FromStr for RunId {
    type Err = BadRunId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() || s.len() > 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(BadRunId);
        }
        u64::from_str_radix(s, 16).map(RunId).map_err(|_| BadRunId)
    }
}

impl Serialize for RunId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for RunId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// 64 random bits from the operating system; if it cannot give any (it
/// always can on the platforms kvbm runs on), bits derived from the time,
/// the process id and the standard library's per-process hash keys, which
/// still differ from one run to the next.
pub fn random_u64() -> u64 {
    match getrandom::u64() {
        Ok(v) => v,
        Err(_) => {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
                h.write_u128(d.as_nanos());
            }
            h.finish()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_hex_in_json_and_parse_back() {
        let r = RunId(0x00ab_cdef_0123_4567);
        assert_eq!(r.to_string(), "00abcdef01234567");
        assert_eq!(serde_json::to_string(&r).unwrap(), "\"00abcdef01234567\"");
        assert_eq!(
            serde_json::from_str::<RunId>("\"00abcdef01234567\"").unwrap(),
            r
        );
        assert_eq!("ff".parse::<RunId>(), Ok(RunId(255)));
        for bad in ["", "xyz", "12345678901234567", "-1", " 1"] {
            assert_eq!(bad.parse::<RunId>(), Err(BadRunId), "{bad:?}");
        }
        assert!(serde_json::from_str::<RunId>("17").is_err());
    }

    #[test]
    fn two_runs_differ() {
        assert_ne!(RunId::random(), RunId::random());
    }
}
