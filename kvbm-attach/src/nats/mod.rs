//! The fleet's event plane: kvbm events over NATS JetStream, breakpoint
//! control over NATS request-reply.
//!
//! Many engines publish to one stream; one recorder keeps them all with a
//! durable consumer; one console shows them. The broker is an existing
//! program (`nats-server -js`), never one of ours.
//!
//! - [`wire`] (from `kvbm_schema::nats`, the wire formats): a batch of
//!   one engine's consecutive events as one message: a fixed header (run,
//!   seq range, the publisher's declared losses) and the durable log's
//!   columnar block, LZ4-compressed. Untrusted bytes are checked before
//!   anything is decoded.
//! - [`publish`]: drains an engine's tap on a thread of its own into
//!   batches, keeps a bounded buffer while NATS is out of reach (dropping
//!   the oldest, counted) and publishes each batch with a message id from
//!   (engine, run, first seq), so JetStream drops a re-sent one.
//! - [`track`] (from `kvbm_schema::nats`): what a consumer needs to apply
//!   each (engine, seq) once and to tell holes from duplicates, as plain
//!   state (no I/O).
//! - [`consume`]: the durable pull consumer a fleet recorder reads, and the
//!   ordered consumer a console reads.
//! - [`control`]: `kvbm.control.<engine>`: the engine side answers
//!   breakpoint commands with its `Control`; a controller holds a session
//!   whose lease it renews, and when the lease lapses (the controller went
//!   away) its breakpoints are removed and its paused calls resume — the
//!   attach server's release-on-disconnect, without a connection.
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
//!
//! The stream is created when missing with [`StreamLimits`] (file store,
//! 1 GiB, 24 h, 8 MiB messages, 2 min duplicate window, discard old); an
//! existing stream is used as it is.

pub mod consume;
pub mod control;
pub mod publish;
pub mod waits;

/// The batch format, the tracker and the subject rules: wire formats, so
/// they live in the schema crate; re-exported here, where they are used.
pub use kvbm_schema::nats::{
    CONTROL_PREFIX, EVENTS_PREFIX, MAX_ENGINE_NAME, STREAM, control_subject, engine_of_subject,
    events_subject, track, wire,
};

use async_nats::jetstream;

/// The NATS client this plane is built on, for callers that hold its
/// messages (a recorder acknowledging them).
pub use async_nats;
use std::time::Duration;

/// Why something given for NATS is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NatsError {
    /// An engine name that cannot be a subject token.
    #[error(transparent)]
    BadEngineName(#[from] kvbm_schema::nats::BadEngineName),
    /// An engine filter that no engine name could match as meant.
    #[error(
        "engine glob {glob:?}: use 1 to 256 ASCII letters, digits, '-', '_', '*' (any run of \
         characters) or '?' (any one character)"
    )]
    BadEngineGlob {
        /// The glob, clipped.
        glob: String,
    },
    /// Not a `nats://HOST:PORT` URL.
    #[error("{url:?} is not a NATS URL ({reason}): expected nats://HOST:PORT")]
    BadUrl {
        /// The URL, clipped.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Connecting, or a JetStream call, failed.
    #[error("NATS: {0}")]
    Nats(String),
}

/// Checks that `name` can be an engine's subject token
/// ([`kvbm_schema::nats::check_engine_name`], as a [`NatsError`]).
pub fn check_engine_name(name: &str) -> Result<(), NatsError> {
    Ok(kvbm_schema::nats::check_engine_name(name)?)
}

/// Whether `url` names a NATS server (`nats://…`).
pub fn is_nats_url(url: &str) -> bool {
    url.starts_with("nats://")
}

/// Checks a `nats://HOST:PORT` URL (async-nats parses it again when
/// connecting); returns it unchanged.
pub fn check_url(url: &str) -> Result<&str, NatsError> {
    let bad = |reason| NatsError::BadUrl {
        url: kvbm_events::text::clip(&redacted(url), kvbm_events::text::MAX_QUOTED_CHARS),
        reason,
    };
    let rest = url
        .strip_prefix("nats://")
        .ok_or(bad("the scheme must be nats"))?;
    // Credentials (`nats://USER:PASSWORD@HOST:PORT`, `nats://TOKEN@…`) are
    // read by `credentials`; only what follows them is checked here.
    let authority = rest.rsplit_once('@').map_or(rest, |(_, after)| after);
    kvbm_events::addr::parse_authority(authority).map_err(bad)?;
    Ok(url)
}

/// `url` with its credentials (`USER:PASSWORD@` or `TOKEN@`) replaced by
/// `***`: the form to print, log or keep in a recording.
pub fn redacted(url: &str) -> String {
    match url.strip_prefix("nats://").and_then(|r| r.rsplit_once('@')) {
        Some((_, host)) => format!("nats://***@{host}"),
        None => url.to_string(),
    }
}

/// The options carrying `url`'s credentials: `nats://USER:PASSWORD@…` or
/// `nats://TOKEN@…`, as NATS URLs give them.
///
/// Why here: async-nats (0.51) parses a URL's credentials into its
/// `ServerAddr` but sends only those of its `ConnectOptions`, so a server
/// that requires them refused every connection made from a URL alone.
fn credentials(url: &str) -> Result<async_nats::ConnectOptions, NatsError> {
    let addr: async_nats::ServerAddr = url.parse().map_err(|_| NatsError::BadUrl {
        url: kvbm_events::text::clip(&redacted(url), kvbm_events::text::MAX_QUOTED_CHARS),
        reason: "the NATS client cannot read it as a server address",
    })?;
    let opts = async_nats::ConnectOptions::new();
    Ok(match (addr.username(), addr.password()) {
        (Some(user), Some(pass)) => opts.user_and_password(user.into(), pass.into()),
        (Some(token), None) => opts.token(token.into()),
        _ => opts,
    })
}

/// Connects to `url`, retrying in the background if the server is not up
/// yet (so an engine starts whether or not NATS is there) and reconnecting
/// for ever after a loss. `name` shows in the server's connection list.
pub async fn connect(url: &str, name: &str) -> Result<async_nats::Client, NatsError> {
    check_url(url)?;
    credentials(url)?
        .name(name)
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(2))
        .reconnect_delay_callback(|attempt| {
            // 50 ms doubling to 2 s: a restarted server is found quickly.
            let ms = 50u64.saturating_mul(1 << attempt.min(6));
            Duration::from_millis(ms.min(2_000))
        })
        .connect(url)
        .await
        .map_err(|e| NatsError::Nats(format!("connecting to {}: {e}", redacted(url))))
}

/// The stream's limits, used when it has to be created.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamLimits {
    /// Oldest batches are discarded past this many bytes.
    pub max_bytes: i64,
    /// … or past this age.
    pub max_age: Duration,
    /// Largest message accepted.
    pub max_message_size: i32,
    /// How long JetStream remembers a message id to drop a duplicate.
    pub duplicate_window: Duration,
    /// File store (survives a server restart) or memory.
    pub file_store: bool,
}

impl Default for StreamLimits {
    fn default() -> Self {
        StreamLimits {
            max_bytes: 1 << 30,
            max_age: Duration::from_secs(24 * 3600),
            max_message_size: 8 << 20,
            duplicate_window: Duration::from_secs(120),
            file_store: true,
        }
    }
}

impl StreamLimits {
    /// The stream's configuration.
    pub fn config(&self) -> jetstream::stream::Config {
        jetstream::stream::Config {
            name: STREAM.into(),
            subjects: vec![format!("{EVENTS_PREFIX}>")],
            max_bytes: self.max_bytes,
            max_age: self.max_age,
            max_message_size: self.max_message_size,
            duplicate_window: self.duplicate_window,
            discard: jetstream::stream::DiscardPolicy::Old,
            storage: if self.file_store {
                jetstream::stream::StorageType::File
            } else {
                jetstream::stream::StorageType::Memory
            },
            num_replicas: 1,
            ..Default::default()
        }
    }
}

/// Gets the stream, creating it with `limits` when missing.
pub async fn ensure_stream(
    js: &jetstream::Context,
    limits: &StreamLimits,
) -> Result<jetstream::stream::Stream, NatsError> {
    use jetstream::context::CreateStreamErrorKind as Kind;
    js.get_or_create_stream(limits.config()).await.map_err(|e| {
        // The failures an operator meets first (no server, a server
        // without JetStream, a small machine): say what to do about them,
        // not only what the client or the server said.
        let hint = match e.kind() {
            Kind::TimedOut
                if js.client().connection_state() != async_nats::connection::State::Connected =>
            {
                " (no NATS server answers at that address, or it refused the URL's credentials: \
                 is `nats-server -js` running there?)"
                    .to_string()
            }
            Kind::JetStreamUnavailable => {
                " (the server runs without JetStream: start it with `nats-server -js`)".to_string()
            }
            _ if e.to_string().contains("insufficient storage") => format!(
                " (the server cannot reserve {} bytes: give JetStream more storage, \
                     or create the stream {STREAM} beforehand with smaller limits; \
                     an existing stream is used as it is)",
                limits.max_bytes
            ),
            _ => String::new(),
        };
        NatsError::Nats(format!("stream {STREAM}: {e}{hint}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_must_be_nats_host_port() {
        assert!(check_url("nats://127.0.0.1:4222").is_ok());
        assert!(check_url("nats://localhost:1").is_ok());
        for bad in [
            "http://x:1",
            "nats://x",
            "nats://:4222",
            "nats://x:99999",
            "nats://a/b:1",
            "nats://a b:4222",
            "nats://h:4222/x",
            "nats://[::1:4222",
        ] {
            assert!(check_url(bad).is_err(), "{bad}");
        }
        assert!(check_url("nats://[::1]:4222").is_ok());
        assert!(check_url("nats://user:pw@127.0.0.1:4222").is_ok());
        let e = check_url("nats://a b:4222").unwrap_err().to_string();
        assert!(
            e.contains("the host must be a name or an IP address"),
            "{e}"
        );
    }

    #[test]
    fn credentials_are_read_from_the_url_and_never_shown() {
        assert_eq!(
            redacted("nats://kv:pw@127.0.0.1:4222"),
            "nats://***@127.0.0.1:4222"
        );
        assert_eq!(redacted("nats://tok@h:1"), "nats://***@h:1");
        assert_eq!(redacted("nats://h:1"), "nats://h:1");
        // A bad host after credentials is named without them.
        let e = check_url("nats://kv:pw@a b:4222").unwrap_err().to_string();
        assert!(!e.contains("pw"), "{e}");
        for url in [
            "nats://kv:pw@127.0.0.1:4222",
            "nats://tok@127.0.0.1:4222",
            "nats://127.0.0.1:1",
        ] {
            assert!(credentials(url).is_ok(), "{url}");
        }
    }
}
