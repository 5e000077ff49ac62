//! The connector's settings: vLLM's `kv_connector_extra_config`, checked.
//!
//! Every key is optional; an unknown key, a value of the wrong type or out
//! of range is an error that names the key, so a typo never silently turns
//! a feature off.

use serde_json::Value;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// When a G1 block is stored: eager (write-through), lazy (when its
/// request finishes) or at its N-th hit in vLLM's prefix cache.
pub use kvbm_core::leader::OffloadMode as Offload;

/// The connector's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Host (G2) capacity in tokens; `None`: [`default_host_capacity_tokens`]
    /// of the machine. 0 disables the host tier; with no disk tier either,
    /// kvbm only observes (see [`Config::observes_only`]).
    pub host_capacity_tokens: Option<u64>,
    /// The disk (G3) tier's file; no disk tier without it.
    pub disk_path: Option<PathBuf>,
    /// Disk capacity in tokens (required with `disk_path`).
    pub disk_capacity_tokens: Option<u64>,
    /// `eager` (default), `lazy` or `after-hits:N`.
    pub offload: Offload,
    /// G2's and G3's eviction policies (G1 is vLLM's own cache, evicted by
    /// vLLM).
    pub eviction: kvbm_core::eviction::TierEviction,
    /// Serve the attach protocol here (as `kvbm-sim --serve` does).
    pub serve: Option<SocketAddr>,
    /// The attach server's bearer token (needed off loopback).
    pub token: Option<String>,
    /// Record every event into a durable log in this directory.
    pub record: Option<PathBuf>,
    /// How long a paused call waits before it goes on by itself.
    pub breakpoint_deadline: Duration,
    /// How long the scheduler waits, once per step, for the transfers it
    /// planned to reach the worker's queue before it ships the step.
    pub ship_timeout: Duration,
    /// Where the shared host tier's file is made (default `/dev/shm`, or
    /// the temporary directory where there is none).
    pub shm_dir: Option<PathBuf>,
    /// Publish every event to the fleet's NATS JetStream (`nats://HOST:PORT`).
    pub publish: Option<String>,
    /// This engine's name on the event plane (required with `publish`).
    pub engine_id: Option<String>,
}

/// Why the settings were refused; always names the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Not a JSON object.
    #[error("kvbm: kv_connector_extra_config must be a mapping of settings, got {0}")]
    NotAMapping(String),
    /// A key kvbm does not know.
    #[error("kvbm: unknown key `{key}` in kv_connector_extra_config (known: {known})", known = KNOWN.join(", "))]
    UnknownKey {
        /// The key.
        key: String,
    },
    /// A value kvbm cannot use.
    #[error("kvbm: kv_connector_extra_config `{key}`: {reason}")]
    BadValue {
        /// The key.
        key: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// `eviction`: a policy for G2 and G3 (`"s3fifo"`, `"tinylfu+lru"`) or
/// per tier (`"G2=s3fifo,G3=tinylfu+lfu"`); G1 is vLLM's own and stays LRU
/// here.
fn eviction(v: &Value) -> Result<kvbm_core::eviction::TierEviction, ConfigError> {
    use kvbm_core::CachePolicy;
    let s = text("eviction", v)?;
    let mut e: kvbm_core::eviction::TierEviction = s
        .parse()
        .map_err(|e: kvbm_core::eviction::TierEvictionError| bad("eviction", e.to_string()))?;
    if s.contains('=') {
        if e.device != CachePolicy::default() {
            return Err(bad(
                "eviction",
                "G1 is vLLM's own cache, evicted by vLLM: name G2 and G3 only".to_string(),
            ));
        }
    } else {
        e.device = CachePolicy::default();
    }
    Ok(e)
}

/// The keys kvbm reads.
pub const KNOWN: [&str; 13] = [
    "host_capacity_tokens",
    "disk_path",
    "disk_capacity_tokens",
    "offload",
    "eviction",
    "serve",
    "token",
    "record",
    "breakpoint_deadline_s",
    "ship_timeout_s",
    "shm_dir",
    "publish",
    "engine_id",
];

impl Config {
    /// No tier of kvbm's own: kvbm follows vLLM's blocks and emits their
    /// events (lookups, allocations, evictions), keeps nothing and loads
    /// nothing. The cheapest way to watch an engine.
    pub fn observes_only(&self) -> bool {
        self.host_capacity_tokens == Some(0) && self.disk_path.is_none()
    }
}

/// The host tier's default share of the machine's memory.
pub const DEFAULT_HOST_SHARE: f64 = 0.10;

/// A default host capacity: [`DEFAULT_HOST_SHARE`] of the machine's
/// physical memory (read from `/proc/meminfo`; 4 GiB where it cannot be
/// read), in tokens of `bytes_per_token` bytes.
pub fn default_host_capacity_tokens(bytes_per_token: u64) -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kib| kib * 1024)
        .unwrap_or(4 << 30);
    ((total as f64 * DEFAULT_HOST_SHARE) as u64) / bytes_per_token.max(1)
}

fn bad(key: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::BadValue {
        key,
        reason: reason.into(),
    }
}

fn tokens(key: &'static str, v: &Value) -> Result<u64, ConfigError> {
    v.as_u64()
        .ok_or_else(|| bad(key, format!("expected a whole number of tokens, got {v}")))
}

fn text<'a>(key: &'static str, v: &'a Value) -> Result<&'a str, ConfigError> {
    match v.as_str() {
        Some(s) if !s.trim().is_empty() => Ok(s),
        _ => Err(bad(key, format!("expected a non-empty string, got {v}"))),
    }
}

/// The shortest `ship_timeout_s`: the pipelines flush their batches every
/// millisecond, so a shorter wait would fail loads that were on their way.
pub const MIN_SHIP_TIMEOUT: Duration = Duration::from_millis(1);

/// Seconds in `[min, 86400]`. The bounds are checked on the duration the
/// number becomes, not the number: 1e-300 s is more than 0 but 0 ns.
fn seconds(key: &'static str, v: &Value, min: Duration) -> Result<Duration, ConfigError> {
    let s = v
        .as_f64()
        .ok_or_else(|| bad(key, format!("expected a number of seconds, got {v}")))?;
    let max = Duration::from_secs(86_400);
    match Duration::try_from_secs_f64(s) {
        Ok(d) if d >= min && d <= max => Ok(d),
        _ => Err(bad(
            key,
            format!(
                "{s} is not in [{}, {}] seconds",
                min.as_secs_f64(),
                max.as_secs()
            ),
        )),
    }
}

/// The attach server's rules for a bearer token, checked here so the
/// refusal names `token` before the scheduler starts (the server itself
/// would refuse it only then).
fn check_token(t: &str) -> Result<(), ConfigError> {
    match kvbm_attach::server::token_unusable(t) {
        None => Ok(()),
        Some(why) => Err(bad("token", format!("unusable token: {why}"))),
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            host_capacity_tokens: None,
            disk_path: None,
            disk_capacity_tokens: None,
            offload: Offload::Eager,
            eviction: Default::default(),
            serve: None,
            token: None,
            record: None,
            breakpoint_deadline: Duration::from_secs(60),
            ship_timeout: Duration::from_secs(1),
            shm_dir: None,
            publish: None,
            engine_id: None,
        }
    }
}

impl Config {
    /// Reads and checks the settings from vLLM's extra config (a JSON
    /// object; `null` is no settings). Checks what can be checked without
    /// the engine (files and ports are checked when they are opened).
    pub fn from_json(v: &Value) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        let map = match v {
            Value::Null => return Ok(c),
            Value::Object(m) => m,
            other => return Err(ConfigError::NotAMapping(shorten(&other.to_string()))),
        };
        for (key, v) in map {
            match key.as_str() {
                "host_capacity_tokens" => {
                    c.host_capacity_tokens = Some(tokens("host_capacity_tokens", v)?)
                }
                "disk_path" => c.disk_path = Some(PathBuf::from(text("disk_path", v)?)),
                "disk_capacity_tokens" => {
                    c.disk_capacity_tokens = Some(tokens("disk_capacity_tokens", v)?)
                }
                "offload" => {
                    c.offload = text("offload", v)?.parse().map_err(
                        |e: kvbm_core::leader::UnknownOffloadMode| bad("offload", e.to_string()),
                    )?
                }
                "eviction" => c.eviction = eviction(v)?,
                "serve" => {
                    let s = text("serve", v)?;
                    c.serve = Some(s.parse().map_err(|_| {
                        bad(
                            "serve",
                            format!("`{}` is not an address such as 127.0.0.1:7071", shorten(s)),
                        )
                    })?);
                }
                "token" => {
                    let t = text("token", v)?;
                    check_token(t)?;
                    c.token = Some(t.to_string());
                }
                "record" => c.record = Some(PathBuf::from(text("record", v)?)),
                "breakpoint_deadline_s" => {
                    c.breakpoint_deadline = seconds(
                        "breakpoint_deadline_s",
                        v,
                        kvbm_events::breakpoint::MIN_DEADLINE,
                    )?
                }
                "ship_timeout_s" => {
                    c.ship_timeout = seconds("ship_timeout_s", v, MIN_SHIP_TIMEOUT)?
                }
                "shm_dir" => c.shm_dir = Some(PathBuf::from(text("shm_dir", v)?)),
                "publish" => {
                    let url = text("publish", v)?;
                    kvbm_attach::nats::check_url(url).map_err(|e| bad("publish", e.to_string()))?;
                    c.publish = Some(url.to_string());
                }
                "engine_id" => {
                    let name = text("engine_id", v)?;
                    kvbm_attach::nats::check_engine_name(name)
                        .map_err(|e| bad("engine_id", e.to_string()))?;
                    c.engine_id = Some(name.to_string());
                }
                other => {
                    return Err(ConfigError::UnknownKey {
                        key: shorten(other),
                    });
                }
            }
        }
        match (&c.disk_path, c.disk_capacity_tokens) {
            (None, Some(_)) => {
                return Err(bad(
                    "disk_capacity_tokens",
                    "set without disk_path: the disk tier needs a file",
                ));
            }
            (Some(_), None) => {
                return Err(bad(
                    "disk_capacity_tokens",
                    "required with disk_path (the disk tier's size in tokens)",
                ));
            }
            (Some(_), Some(0)) => {
                return Err(bad("disk_capacity_tokens", "must be positive"));
            }
            _ => {}
        }
        if c.token.is_some() && c.serve.is_none() {
            return Err(bad("token", "set without serve"));
        }
        match (&c.publish, &c.engine_id) {
            (Some(_), None) => {
                return Err(bad(
                    "engine_id",
                    "required with publish (the engine's name on NATS)",
                ));
            }
            (None, Some(_)) => return Err(bad("engine_id", "set without publish")),
            _ => {}
        }
        // One lossless tap per engine: the publisher takes it, as the
        // recorder or the attach server's feeder would.
        if c.publish.is_some() && (c.serve.is_some() || c.record.is_some()) {
            return Err(bad(
                "publish",
                "cannot be combined with serve or record (record the fleet with \
                 `kvbm-recorder record --from nats://…` and attach with \
                 `kvbm-console attach nats://…`)",
            ));
        }
        Ok(c)
    }

    /// Blocks of `block_size` tokens a capacity in tokens gives; an error
    /// naming `key` when it is not even one block.
    pub fn blocks(key: &'static str, tokens: u64, block_size: usize) -> Result<usize, ConfigError> {
        let blocks = tokens / block_size.max(1) as u64;
        if blocks == 0 {
            return Err(bad(
                key,
                format!("{tokens} tokens is less than one block of {block_size}"),
            ));
        }
        usize::try_from(blocks).map_err(|_| bad(key, "too large"))
    }
}

fn shorten(s: &str) -> String {
    kvbm_events::text::clip(s, kvbm_events::text::MAX_QUOTED_CHARS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_key_is_read() {
        let c = Config::from_json(&json!({
            "host_capacity_tokens": 4096,
            "disk_path": "/tmp/g3.kvbm",
            "disk_capacity_tokens": 8192,
            "offload": "lazy",
            "serve": "127.0.0.1:7071",
            "token": "t",
            "record": "/tmp/rec",
            "breakpoint_deadline_s": 2.5,
            "ship_timeout_s": 0.5,
            "shm_dir": "/tmp",
            "eviction": "G2=s3fifo,G3=lfu",
        }))
        .unwrap();
        assert_eq!(c.host_capacity_tokens, Some(4096));
        assert_eq!(c.eviction.to_string(), "G1=lru,G2=s3fifo,G3=lfu");
        // One policy: G2 and G3; G1 stays vLLM's.
        let one = Config::from_json(&json!({"eviction": "arc"})).unwrap();
        assert_eq!(one.eviction.to_string(), "G1=lru,G2=arc,G3=arc");
        assert_eq!(c.offload, Offload::Lazy);
        let gated = Config::from_json(&json!({
            "offload": "after-hits:2",
            "eviction": "tinylfu+s3fifo",
        }))
        .unwrap();
        assert_eq!(gated.offload, Offload::AfterHits(2));
        assert_eq!(
            gated.eviction.to_string(),
            "G1=lru,G2=tinylfu+s3fifo,G3=tinylfu+s3fifo"
        );
        assert_eq!(c.serve, Some("127.0.0.1:7071".parse().unwrap()));
        assert_eq!(c.breakpoint_deadline, Duration::from_millis(2500));
        assert_eq!(Config::from_json(&Value::Null).unwrap(), Config::default());
        let c = Config::from_json(&json!({
            "publish": "nats://127.0.0.1:4222",
            "engine_id": "vllm-3",
        }))
        .unwrap();
        assert_eq!(c.publish.as_deref(), Some("nats://127.0.0.1:4222"));
        assert_eq!(c.engine_id.as_deref(), Some("vllm-3"));
    }

    #[test]
    fn a_bad_setting_is_refused_naming_its_key() {
        for (v, key) in [
            (json!({"host_capacty_tokens": 1}), "host_capacty_tokens"),
            (json!({"host_capacity_tokens": -5}), "host_capacity_tokens"),
            (
                json!({"host_capacity_tokens": "lots"}),
                "host_capacity_tokens",
            ),
            (json!({"offload": "sometimes"}), "offload"),
            (json!({"offload": "after-hits:0"}), "offload"),
            (json!({"offload": 2}), "offload"),
            (json!({"eviction": "G1=tinylfu+lru"}), "eviction"),
            (json!({"eviction": "mru"}), "eviction"),
            (json!({"eviction": "G1=lfu"}), "eviction"),
            (json!({"eviction": 3}), "eviction"),
            (json!({"serve": "localhost"}), "serve"),
            (json!({"disk_path": "/x"}), "disk_capacity_tokens"),
            (
                json!({"disk_path": "/x", "disk_capacity_tokens": 0}),
                "disk_capacity_tokens",
            ),
            (json!({"disk_capacity_tokens": 10}), "disk_capacity_tokens"),
            (json!({"breakpoint_deadline_s": 0}), "breakpoint_deadline_s"),
            // More than 0, but 0 ns (or less than the least) once a duration.
            (
                json!({"breakpoint_deadline_s": 5e-324}),
                "breakpoint_deadline_s",
            ),
            (
                json!({"breakpoint_deadline_s": 0.0009}),
                "breakpoint_deadline_s",
            ),
            (json!({"ship_timeout_s": 1e-300}), "ship_timeout_s"),
            (json!({"ship_timeout_s": 1e-9}), "ship_timeout_s"),
            (json!({"ship_timeout_s": 86400.5}), "ship_timeout_s"),
            (
                json!({"serve": "127.0.0.1:0", "token": "secret\n"}),
                "token",
            ),
            (json!({"serve": "127.0.0.1:0", "token": "a b"}), "token"),
            (
                json!({"serve": "127.0.0.1:0", "token": "t".repeat(4097)}),
                "token",
            ),
            (json!({"token": "t"}), "token"),
            (json!({"record": ""}), "record"),
            (
                json!({"publish": "http://x:1", "engine_id": "a"}),
                "publish",
            ),
            (json!({"publish": "nats://127.0.0.1:4222"}), "engine_id"),
            (json!({"engine_id": "a"}), "engine_id"),
            (
                json!({"publish": "nats://127.0.0.1:4222", "engine_id": "a.b"}),
                "engine_id",
            ),
            (
                json!({"publish": "nats://127.0.0.1:4222", "engine_id": "a", "record": "/tmp/r"}),
                "publish",
            ),
        ] {
            let e = Config::from_json(&v).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")), "{v}: {e}");
        }
        assert!(Config::from_json(&json!([1])).is_err());
        // The least of each is accepted, and a token the server takes.
        let c = Config::from_json(&json!({
            "breakpoint_deadline_s": 0.001,
            "ship_timeout_s": 0.001,
            "serve": "127.0.0.1:0",
            "token": "t".repeat(4096),
        }))
        .unwrap();
        assert_eq!(c.breakpoint_deadline, kvbm_events::breakpoint::MIN_DEADLINE);
        assert_eq!(c.ship_timeout, MIN_SHIP_TIMEOUT);
        assert!(
            Config::blocks("host_capacity_tokens", 10, 32)
                .unwrap_err()
                .to_string()
                .contains("less than one block")
        );
    }

    #[test]
    fn no_tier_at_all_is_an_observer() {
        let c = Config::from_json(&json!({"host_capacity_tokens": 0})).unwrap();
        assert!(c.observes_only());
        assert!(!Config::default().observes_only());
        let disk =
            json!({"host_capacity_tokens": 0, "disk_path": "/x", "disk_capacity_tokens": 64});
        assert!(!Config::from_json(&disk).unwrap().observes_only());
    }

    #[test]
    fn the_default_host_tier_is_a_share_of_memory() {
        let t = default_host_capacity_tokens(1024);
        assert!(t > 0);
        // 10% of at least 64 MiB of memory, in 1 KiB tokens.
        assert!(t >= 6 * 1024, "{t}");
    }
}
