//! The fleet's sources on NATS: the whole stream for the fleet view, and
//! one engine's subject (with its control) when the operator drills in.
//!
//! Both read an ordered consumer (no state on the server) from the start
//! of what the stream holds, so an engine's state is folded from
//! everything still retained. The fleet follower hands decoded batches to
//! the console through a bounded channel: when the console is behind, the
//! task waits and the pull consumer stops fetching (the stream keeps the
//! messages), so nothing is dropped and nothing grows. The engine follower
//! feeds a local ring read by the ordinary [`LiveSource`], like an attach
//! connection, with the engine's [`NatsControl`] as its control.

use crate::source::{Badge, Link, LiveSource, Tone};
use futures_util::StreamExt;
use kvbm_attach::nats::async_nats;
use kvbm_attach::nats::consume::{self, StartAt};
use kvbm_attach::nats::control::NatsControl;
use kvbm_attach::nats::track::{Admit, Tracker};
use kvbm_attach::nats::wire::BatchHeader;
use kvbm_attach::nats::{StreamLimits, events_subject};
use kvbm_events::Event;
use kvbm_events::control::Control;
use kvbm_events::ring::{RingBuffer, RingConfig};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc;

/// Batches waiting for the console.
pub const CHANNEL_BATCHES: usize = 256;

/// How long the follower waits before trying to follow again after the
/// stream could not be reached.
pub const FOLLOW_RETRY: Duration = Duration::from_secs(2);

/// One item of the fleet stream.
#[derive(Debug)]
pub enum FleetItem {
    /// A batch of one engine.
    Batch {
        /// The engine.
        engine: String,
        /// Its header.
        header: BatchHeader,
        /// Its events.
        events: Vec<Event>,
        /// From publication to arrival (by the server's clock and ours).
        lag: Duration,
    },
    /// A message that was not a usable batch.
    Refused {
        /// The engine, if the subject named one.
        engine: Option<String>,
        /// Why.
        error: String,
    },
}

/// Where the connection stands, shared with the header.
#[derive(Debug, Default)]
pub struct FollowStatus {
    state: Mutex<String>,
}

impl FollowStatus {
    fn set(&self, s: impl Into<String>) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = s.into();
    }

    /// As the header shows it.
    pub fn get(&self) -> String {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

fn lag_of(msg: &async_nats::jetstream::Message) -> Duration {
    msg.info()
        .ok()
        .and_then(|i| {
            let published: SystemTime = i.published.into();
            SystemTime::now().duration_since(published).ok()
        })
        .unwrap_or_default()
}

/// The whole stream, decoded, for the fleet view.
pub struct FleetFollower {
    /// The client (shared with the engines' controls).
    pub client: async_nats::Client,
    rx: mpsc::Receiver<FleetItem>,
    status: Arc<FollowStatus>,
    task: tokio::task::JoinHandle<()>,
    url: String,
}

impl FleetFollower {
    /// Connects to `url` and follows every engine from what the stream
    /// holds (`start`).
    pub async fn start(url: &str, start: StartAt) -> anyhow::Result<Self> {
        let client = kvbm_attach::nats::connect(url, "kvbm-console").await?;
        let js = async_nats::jetstream::new(client.clone());
        let (tx, rx) = mpsc::channel(CHANNEL_BATCHES);
        let status = Arc::new(FollowStatus::default());
        status.set("NATS CONNECTING");
        let st = status.clone();
        let task = tokio::spawn(async move {
            // A console may be started before the server, or against one
            // without JetStream: it says why it is not following and tries
            // again, so it follows as soon as it can.
            let mut messages = loop {
                match consume::follow(
                    &js,
                    format!("{}>", kvbm_attach::nats::EVENTS_PREFIX),
                    start,
                    &StreamLimits::default(),
                )
                .await
                {
                    Ok(m) => break m,
                    Err(e) => {
                        st.set(format!("NATS FAILED, RETRYING: {e}"));
                        tokio::time::sleep(FOLLOW_RETRY).await;
                    }
                }
            };
            st.set("NATS FOLLOWING");
            while let Some(m) = messages.next().await {
                let item = match m {
                    Err(e) => {
                        st.set(format!("NATS RETRYING ({e})"));
                        continue;
                    }
                    Ok(msg) => {
                        st.set("NATS FOLLOWING");
                        match consume::decode_message(&msg) {
                            Ok(d) => FleetItem::Batch {
                                engine: d.engine,
                                header: d.header,
                                events: d.events,
                                lag: lag_of(&msg),
                            },
                            Err(r) => FleetItem::Refused {
                                engine: r.engine,
                                error: format!("{}: {}", r.subject, r.error),
                            },
                        }
                    }
                };
                if tx.send(item).await.is_err() {
                    return;
                }
            }
            st.set("NATS STOPPED");
        });
        Ok(FleetFollower {
            client,
            rx,
            status,
            task,
            // Shown in the header: never the URL's credentials.
            url: kvbm_attach::nats::redacted(url),
        })
    }

    /// The next item if one is waiting.
    pub fn try_next(&mut self) -> Option<FleetItem> {
        self.rx.try_recv().ok()
    }

    /// The connection's state, e.g. `NATS FOLLOWING`; while it cannot
    /// follow, why.
    pub fn status(&self) -> String {
        let followed = self.status.get();
        match self.client.connection_state() {
            async_nats::connection::State::Connected => followed,
            // The last failure says more than the connection's state.
            _ if followed.starts_with("NATS FAILED") => followed,
            other => format!("NATS {other:?}").to_uppercase(),
        }
    }

    /// The server's URL, its credentials hidden (`nats://***@HOST:PORT`).
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for FleetFollower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One engine through NATS, for the drilled-in console: its events into a
/// local ring, its control on `kvbm.control.<engine>`.
pub struct EngineRemote {
    ring: Arc<RingBuffer>,
    control: Arc<NatsControl>,
    link: Arc<EngineLink>,
    task: tokio::task::JoinHandle<()>,
}

struct EngineLink {
    engine: String,
    status: Arc<FollowStatus>,
}

impl Link for EngineLink {
    fn badge(&self, _now: Instant) -> Badge {
        let s = self.status.get();
        let tone = if s.ends_with("FOLLOWING") {
            Tone::Ok
        } else if s.contains("FAILED") || s.contains("STOPPED") {
            Tone::Down
        } else {
            Tone::Caution
        };
        Badge::new(format!("{s} {}", self.engine), tone)
    }
}

impl EngineRemote {
    /// Follows `engine` from what the stream holds, into a ring of
    /// `ring_capacity` events.
    pub fn start(
        client: async_nats::Client,
        engine: &str,
        ring_capacity: usize,
        rt: &tokio::runtime::Handle,
    ) -> anyhow::Result<Self> {
        let ring = Arc::new(RingBuffer::new(RingConfig::with_capacity(ring_capacity))?);
        let control = Arc::new(NatsControl::new(client.clone(), engine, rt)?);
        let status = Arc::new(FollowStatus::default());
        status.set("NATS CONNECTING");
        let (r, st, subject) = (ring.clone(), status.clone(), events_subject(engine));
        let js = async_nats::jetstream::new(client);
        let task = rt.spawn(async move {
            let mut messages =
                match consume::follow(&js, subject, StartAt::All, &StreamLimits::default()).await {
                    Ok(m) => m,
                    Err(e) => {
                        st.set(format!("NATS FAILED: {e}"));
                        return;
                    }
                };
            st.set("NATS FOLLOWING");
            let mut tracker = Tracker::default();
            let mut run = None;
            while let Some(m) = messages.next().await {
                let Ok(msg) = m else { continue };
                let Ok(d) = consume::decode_message(&msg) else {
                    // Counted as a loss of unknown size: one.
                    r.record_gap(1);
                    continue;
                };
                if run != Some(d.header.run) {
                    // A restarted engine: follow its new run.
                    run = Some(d.header.run);
                    tracker = Tracker::default();
                }
                tracker.declared(d.header.dropped_before);
                for ev in d.events {
                    match tracker.admit(ev.seq) {
                        Admit::Duplicate => {}
                        Admit::Apply { hole_before } => {
                            if hole_before > 0 {
                                r.record_gap(hole_before);
                            }
                            r.push(ev);
                        }
                    }
                }
            }
            st.set("NATS STOPPED");
        });
        Ok(EngineRemote {
            ring,
            control,
            link: Arc::new(EngineLink {
                engine: engine.to_string(),
                status,
            }),
            task,
        })
    }

    /// The engine's control.
    pub fn control(&self) -> &Arc<NatsControl> {
        &self.control
    }

    /// A live source reading the ring, with the engine's control.
    pub fn source(&self) -> LiveSource {
        LiveSource::new(
            self.ring.clone(),
            Some(self.control.clone() as Arc<dyn Control>),
        )
        .with_link(self.link.clone())
    }
}

impl Drop for EngineRemote {
    fn drop(&mut self) {
        self.task.abort();
    }
}
