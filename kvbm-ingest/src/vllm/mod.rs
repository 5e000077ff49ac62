//! vLLM's (and SGLang's) KV-cache events over ZeroMQ, as a kvbm source.
//!
//! vLLM publishes with `--kv-events-config '{"enable_kv_cache_events":true,
//! "publisher":"zmq","endpoint":"tcp://*:5557"}'` (and, with
//! `"replay_endpoint":"tcp://*:5558"`, answers replay requests). Wire
//! format, as read here:
//!
//! - a SUB socket receives `[topic, seq, payload]`: `seq` an 8-byte
//!   big-endian counter from 0 per publisher; `payload` msgpack
//!   `[ts, events, data_parallel_rank]` (or a map with those keys);
//! - events `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, as maps with a
//!   `type` key or positional arrays led by the type name ([`decode`]);
//! - replay: a DEALER sends `["", start_seq (8 bytes BE)]` and reads
//!   `["", topic, seq, payload]` per batch until
//!   `["", "", 0xFFFF_FFFF_FFFF_FFFF, ""]` (vLLM and SGLang; the older
//!   `["", seq, payload]` is read too).
//!
//! [`ZmqSource`] runs the sockets on a tokio runtime and follows the
//! publisher's seq and identity ([`source`] says how): a jump is a gap,
//! filled from the replay endpoint when one is given and otherwise
//! reported ([`ZmqItem::Gap`], counted in batches); a publisher that goes
//! away and comes back is a restart unless replay proves it the same
//! ([`ZmqItem::Restart`]); joining late is reported ([`ZmqItem::Joined`]).
//! Malformed messages and events are counted and skipped. [`translate`]
//! turns what is decoded into kvbm events (`BlockRegistered`,
//! `BlockEvicted`, `PoolGauge`) with their own envelope seq. This source
//! has no requests: slot views stay empty.

pub mod decode;
pub mod source;
pub mod translate;

pub use decode::{
    DecodeError, KvBatch, KvEvent, Medium, Skipped, decode_payload, hash_of, tier_of_medium,
};
pub use source::{
    END_SEQ, MAX_SEQ_JUMP, NoReplay, Pipeline, Replay, ReplayFailure, RestartAt, RestartCause,
    SeqRange, SourceError, ZmqConfig, ZmqCounters, ZmqHandle, ZmqItem, ZmqReplay, ZmqSource,
    ZmqState, split_frames, split_replay_frames,
};
pub use translate::{HOLE_LIMIT, TranslateCounters, Translator, TranslatorConfig};

use std::fmt;

/// What the console says in its Slots view for this source.
pub const NO_SLOTS_REASON: &str =
    "vLLM KV events carry no requests: this source has no slots (see the Pools and Events views)";

/// A ZeroMQ TCP endpoint, from `zmq://HOST:PORT` (or `tcp://HOST:PORT`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ZmqEndpoint {
    /// Host name or IP address (IPv6 without brackets).
    pub host: String,
    /// TCP port (never 0).
    pub port: u16,
}

/// Is `url` one for this source (`zmq://` or `tcp://`)?
pub fn is_zmq_url(url: &str) -> bool {
    let s = url.trim().to_ascii_lowercase();
    s.starts_with("zmq://") || s.starts_with("tcp://")
}

impl ZmqEndpoint {
    /// Parses `zmq://HOST:PORT` or `tcp://HOST:PORT` (`HOST` a name, an
    /// IPv4 address or a bracketed IPv6 address). Never panics.
    pub fn parse(url: &str) -> Result<ZmqEndpoint, String> {
        let s = url.trim();
        let bad = |why: &str| {
            format!(
                "`{}` is not a ZeroMQ endpoint ({why}); expected zmq://HOST:PORT",
                s.chars().take(80).collect::<String>()
            )
        };
        if s.len() > 512 {
            return Err(bad("too long"));
        }
        let Some((scheme, rest)) = s.split_once("://") else {
            return Err(bad("no scheme"));
        };
        if !matches!(scheme.to_ascii_lowercase().as_str(), "zmq" | "tcp") {
            return Err(bad("the scheme must be zmq or tcp"));
        }
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let (host, port) = kvbm_events::addr::parse_authority(rest).map_err(bad)?;
        Ok(ZmqEndpoint {
            host: host.to_string(),
            port,
        })
    }

    fn host_port(&self) -> String {
        kvbm_events::addr::join_authority(&self.host, self.port)
    }

    /// The address as ZeroMQ spells it: `tcp://HOST:PORT`.
    pub fn zmq_addr(&self) -> String {
        format!("tcp://{}", self.host_port())
    }
}

impl fmt::Display for ZmqEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "zmq://{}", self.host_port())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_zmq_and_tcp_urls() {
        let e = ZmqEndpoint::parse("zmq://127.0.0.1:5557").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("127.0.0.1", 5557));
        assert_eq!(e.zmq_addr(), "tcp://127.0.0.1:5557");
        assert_eq!(e.to_string(), "zmq://127.0.0.1:5557");
        assert_eq!(ZmqEndpoint::parse("tcp://[::1]:9/").unwrap().host, "::1");
        for bad in [
            "zmq://h",
            "zmq://:1",
            "http://h:1",
            "zmq://h:0",
            "zmq://a b:1",
            "h:1",
        ] {
            assert!(ZmqEndpoint::parse(bad).is_err(), "{bad}");
        }
        assert!(is_zmq_url("ZMQ://h:1") && !is_zmq_url("http://h:1"));
    }
}
