//! Reading the stream: the durable consumer a fleet recorder resumes from,
//! and the ordered consumer a console follows.
//!
//! A durable consumer remembers on the server what was acknowledged, so a
//! recorder killed and restarted gets everything after its last
//! acknowledgement again; acknowledgements are cumulative
//! (`AckPolicy::All`): the recorder acknowledges the last message of what it
//! has written and handed to the OS, and JetStream redelivers whatever
//! came after. What is redelivered but was already written is dropped by
//! the recorder's seq check ([`super::track`]).
//!
//! An engine filter is a glob on engine names ([`EngineFilter`]); NATS
//! wildcards match whole tokens only, so a glob like `sim-*` is applied by
//! the consumer, after delivery.

use super::wire::{self, BatchHeader};
use super::{EVENTS_PREFIX, NatsError, STREAM, StreamLimits, engine_of_subject, ensure_stream};
use async_nats::jetstream::{self, consumer};
use kvbm_events::Event;
use std::time::Duration;

/// Which engines to take: a glob over engine names (`*` any run of
/// characters, `?` one), or every engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFilter {
    glob: Option<String>,
}

impl EngineFilter {
    /// Every engine.
    pub fn all() -> Self {
        EngineFilter { glob: None }
    }

    /// Engines whose name matches `glob`; `*` alone is every engine.
    pub fn glob(glob: &str) -> Result<Self, NatsError> {
        let ok = !glob.is_empty()
            && glob.len() <= 256
            && glob
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_*?".contains(&b));
        if !ok {
            return Err(NatsError::BadEngineGlob {
                glob: kvbm_events::text::clip(glob, kvbm_events::text::MAX_QUOTED_CHARS),
            });
        }
        Ok(EngineFilter {
            glob: (glob != "*").then(|| glob.to_string()),
        })
    }

    /// Whether `engine` is taken.
    pub fn matches(&self, engine: &str) -> bool {
        match &self.glob {
            None => true,
            Some(g) => glob_match(g.as_bytes(), engine.as_bytes()),
        }
    }

    /// The stream subject to filter on: one engine's subject when the glob
    /// names exactly one, else every engine's.
    pub fn subject(&self) -> String {
        match &self.glob {
            Some(g) if !g.contains(['*', '?']) => format!("{EVENTS_PREFIX}{g}"),
            _ => format!("{EVENTS_PREFIX}>"),
        }
    }
}

/// Iterative glob match (`*`, `?`), linear in practice.
fn glob_match(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while si < s.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some(pi);
            mark = si;
            pi += 1;
        } else if let Some(st) = star {
            pi = st + 1;
            mark += 1;
            si = mark;
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == b'*' {
        pi += 1;
    }
    pi == p.len()
}

/// One delivered message, checked and decoded.
#[derive(Debug)]
pub struct Delivery {
    /// The engine (from the subject).
    pub engine: String,
    /// The batch's header.
    pub header: BatchHeader,
    /// Its events.
    pub events: Vec<Event>,
    /// Its sequence number in the stream.
    pub stream_seq: u64,
}

/// A message that could not be used: which engine (if the subject named
/// one) and why. It is still acknowledged with the others (redelivering
/// garbage would not make it better), and counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The engine, when the subject is a valid events subject.
    pub engine: Option<String>,
    /// The subject, clipped.
    pub subject: String,
    /// Why.
    pub error: String,
    /// Its sequence number in the stream.
    pub stream_seq: u64,
}

/// The engine of a message on `subject` with sequence `stream_seq` in the
/// stream, and `wire`'s verdict on its payload; or why it is refused.
fn read_payload<T>(
    subject: &str,
    stream_seq: u64,
    verdict: impl FnOnce() -> Result<T, wire::WireError>,
) -> Result<(&str, T), Refused> {
    let refused = |engine: Option<&str>, error: String| Refused {
        engine: engine.map(str::to_string),
        subject: kvbm_events::text::clip(subject, kvbm_events::text::MAX_QUOTED_CHARS),
        error,
        stream_seq,
    };
    let Some(engine) = engine_of_subject(subject) else {
        return Err(refused(None, "not an engine's events subject".into()));
    };
    match verdict() {
        Ok(t) => Ok((engine, t)),
        Err(e) => Err(refused(Some(engine), e.to_string())),
    }
}

/// Decodes one JetStream message.
pub fn decode_message(msg: &jetstream::Message) -> Result<Delivery, Refused> {
    let stream_seq = msg.info().map_or(0, |i| i.stream_sequence);
    let (engine, (header, events)) = read_payload(msg.subject.as_str(), stream_seq, || {
        wire::decode(&msg.payload)
    })?;
    Ok(Delivery {
        engine: engine.to_string(),
        header,
        events,
        stream_seq,
    })
}

/// Checks one message of the stream (`subject`, `payload`, its sequence
/// in the stream) whole without decoding its events ([`wire::check`]; the
/// block is decompressed into `scratch`): its engine and the checked
/// batch, for a consumer that keeps blocks as they are.
pub fn check_payload<'a>(
    subject: &'a str,
    payload: &'a [u8],
    stream_seq: u64,
    scratch: &'a mut Vec<u8>,
) -> Result<(&'a str, wire::Checked<'a>), Refused> {
    read_payload(subject, stream_seq, || wire::check(payload, scratch))
}

/// How a recorder's durable consumer is set up.
#[derive(Debug, Clone)]
pub struct DurableConfig {
    /// The consumer's name on the server (a restarted recorder with the
    /// same name resumes).
    pub name: String,
    /// Which engines (the subject filter part of it).
    pub filter: EngineFilter,
    /// Unacknowledged messages are redelivered after this long.
    pub ack_wait: Duration,
    /// Most messages delivered and not yet acknowledged.
    pub max_ack_pending: i64,
    /// The stream's limits, if it has to be created.
    pub limits: StreamLimits,
    /// Messages each pull request asks for ([`PULL_BATCH`] by default); a
    /// new request goes out once half of them have been taken, so between
    /// half of it and one and a half of it are in flight.
    pub pull_batch: usize,
}

/// The messages a recorder's pull requests ask for, unless told
/// otherwise ([`DurableConfig::pull_batch`]).
pub const PULL_BATCH: usize = 256;

impl DurableConfig {
    /// Defaults for consumer `name`.
    pub fn new(name: impl Into<String>) -> Self {
        DurableConfig {
            name: name.into(),
            filter: EngineFilter::all(),
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 20_000,
            limits: StreamLimits::default(),
            pull_batch: PULL_BATCH,
        }
    }
}

/// Creates the durable consumer, or takes over the one an earlier
/// recorder left (resuming right after what it acknowledged), and returns
/// its message stream. A consumer that exists with another filter is
/// refused with a message saying so.
pub async fn durable_messages(
    js: &jetstream::Context,
    cfg: &DurableConfig,
) -> Result<consumer::pull::Stream, NatsError> {
    super::check_engine_name(&cfg.name).map_err(|_| {
        NatsError::Nats(format!(
            "consumer name {:?}: use letters, digits, '-' or '_'",
            kvbm_events::text::clip(&cfg.name, kvbm_events::text::MAX_QUOTED_CHARS)
        ))
    })?;
    let stream = ensure_stream(js, &cfg.limits).await?;
    let mut config = consumer::pull::Config {
        durable_name: Some(cfg.name.clone()),
        deliver_policy: consumer::DeliverPolicy::All,
        ack_policy: consumer::AckPolicy::All,
        ack_wait: cfg.ack_wait,
        max_ack_pending: cfg.max_ack_pending,
        filter_subject: cfg.filter.subject(),
        ..Default::default()
    };
    // A consumer left by an earlier recorder: resume right after its ack
    // floor. Its messages delivered and not acknowledged would otherwise
    // come back only after `ack_wait`, behind newer ones, and the seqs
    // would run backwards; recreating it from the floor keeps the stream's
    // order.
    if let Ok(mut old) = stream
        .get_consumer::<consumer::pull::Config>(&cfg.name)
        .await
    {
        let info = old
            .info()
            .await
            .map_err(|e| NatsError::Nats(format!("consumer {}: {e}", cfg.name)))?
            .clone();
        if info.config.filter_subject != config.filter_subject {
            return Err(NatsError::Nats(format!(
                "consumer {} exists on {STREAM} with filter {:?}, not {:?}: \
                 use another --consumer name",
                cfg.name, info.config.filter_subject, config.filter_subject
            )));
        }
        let floor = info.ack_floor.stream_sequence;
        if floor > 0 {
            config.deliver_policy = consumer::DeliverPolicy::ByStartSequence {
                start_sequence: floor + 1,
            };
        }
        stream
            .delete_consumer(&cfg.name)
            .await
            .map_err(|e| NatsError::Nats(format!("consumer {}: {e}", cfg.name)))?;
    }
    let consumer: consumer::PullConsumer = stream
        .create_consumer(config)
        .await
        .map_err(|e| NatsError::Nats(format!("creating consumer {}: {e}", cfg.name)))?;
    consumer
        .stream()
        .max_messages_per_batch(cfg.pull_batch.max(1))
        .heartbeat(Duration::from_secs(5))
        .expires(Duration::from_secs(30))
        .messages()
        .await
        .map_err(|e| NatsError::Nats(format!("consumer {}: {e}", cfg.name)))
}

/// Where a follower starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartAt {
    /// Everything the stream still holds (state is complete as far as the
    /// stream's limits allow).
    All,
    /// Only what is published from now on.
    New,
}

/// An ordered consumer (no state on the server; recreated by the client
/// after a gap or a server restart) over the engines `subject` names.
pub async fn follow(
    js: &jetstream::Context,
    subject: String,
    start: StartAt,
    limits: &StreamLimits,
) -> Result<consumer::pull::Ordered, NatsError> {
    let stream = ensure_stream(js, limits).await?;
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: subject,
            deliver_policy: match start {
                StartAt::All => consumer::DeliverPolicy::All,
                StartAt::New => consumer::DeliverPolicy::New,
            },
            ..Default::default()
        })
        .await
        .map_err(|e| NatsError::Nats(format!("following {STREAM}: {e}")))?;
    consumer
        .messages()
        .await
        .map_err(|e| NatsError::Nats(format!("following {STREAM}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_engine_names() {
        let f = EngineFilter::glob("sim-*").unwrap();
        assert!(f.matches("sim-0") && f.matches("sim-") && !f.matches("vllm-0"));
        assert_eq!(f.subject(), "kvbm.events.>");
        let f = EngineFilter::glob("a?c").unwrap();
        assert!(f.matches("abc") && !f.matches("ac") && !f.matches("abbc"));
        let f = EngineFilter::glob("pod-7").unwrap();
        assert_eq!(f.subject(), "kvbm.events.pod-7");
        assert!(f.matches("pod-7") && !f.matches("pod-70"));
        assert!(EngineFilter::glob("*").unwrap().matches("anything"));
        assert!(EngineFilter::glob("*a*b*").unwrap().matches("xxaxxbxx"));
        for bad in ["", "a.b", "a b", ">", "a/b"] {
            let e = EngineFilter::glob(bad).unwrap_err().to_string();
            // The glob quoted whole, then what a glob may hold.
            assert!(e.starts_with(&format!("engine glob {bad:?}: use")), "{e}");
            assert!(e.contains("'*'") && e.contains("'?'"), "{e}");
        }
    }
}
