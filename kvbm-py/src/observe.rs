//! What watches the connector: the attach server (`serve`, the same server,
//! protocol, limits and token rules as `kvbm-sim --serve`) and the durable
//! recording (`record`). Both read the engine's one lossless tap: with a
//! recording, the recorder drains it into the log and into the server's
//! ring; without one, a feeder drains it into the ring. Or the fleet's
//! event plane (`publish`, `engine_id`): the tap goes to a NATS publisher
//! and breakpoints are controlled on `kvbm.control.<engine_id>`.

use crate::config::Config;
use kvbm_attach::nats::control::ResponderCounters;
use kvbm_attach::nats::publish::PublisherCounters;
use kvbm_attach::server::{
    Feeder, FeederConfig, ServedEngine, Server, ServerConfig, ServerHandle, spawn_feeder,
};
use kvbm_core::hooks::Breakpoints;
use kvbm_events::Emitter;
use kvbm_events::ring::{RingBuffer, RingConfig};
use kvbm_recorder::recorder::{
    RecordError, RecorderConfig, Recording, RingWatcher, spawn_recorder,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

/// Events the server's ring keeps.
const RING_EVENTS: usize = 1 << 20;

/// How long the recorder, the feeder and the publisher sleep when the engine's tap is
/// empty. Their defaults (0.2-0.5 ms) suit a simulator that emits millions
/// of events a second; inside vLLM, which emits a few thousand, each would
/// wake thousands of times a second on the engine core's CPU for nothing.
/// At 20 ms, with the attach server told of each burst (`RingWatcher`),
/// kvbm's threads woke about 475 times a second in all on the bench's
/// workload (`bench.py --guard`). The tap (65,536 events) still holds
/// over 3 million events a second for that long, far more than vLLM
/// emits, and a console's view lags by at most 20 ms, less than one of its
/// frames.
const IDLE_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// How long the publisher may take, at shutdown, to send what it holds
/// (its stop may take 1 s more). Well inside the 5 s vLLM gives its engine
/// core to stop, so that the connector's teardown (its final counters, its
/// host-tier file) ends before vLLM's kill.
pub const PUBLISH_DRAIN: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a stop waits for the recorder to write what is left and its
/// sidecar (usually a few milliseconds).
pub const RECORDER_STOP: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a stop waits, in all, for the attach server to stop.
pub const SERVER_STOP: std::time::Duration = std::time::Duration::from_millis(2500);

/// What the fleet's event plane did, final once the observers stop: the
/// publisher's counters and control's (both `None` without `publish`).
#[derive(Debug, Clone, Default)]
pub struct FleetCounters {
    /// What the NATS publisher took, sent and lost.
    pub publisher: Option<PublisherCounters>,
    /// What control on `kvbm.control.<engine_id>` answered and refused.
    pub control: Option<ResponderCounters>,
}

/// The running observers.
pub struct Observers {
    server: Option<ServerHandle>,
    feeder: Option<Feeder>,
    recorder: Option<JoinHandle<Result<Recording, RecordError>>>,
    recorder_stop: Arc<AtomicBool>,
    publisher: Option<kvbm_attach::nats::publish::Publisher>,
    control: Option<(
        Arc<kvbm_attach::nats::control::ControlResponder>,
        tokio::task::JoinHandle<()>,
    )>,
}

impl Observers {
    /// Starts what `cfg` asks for on `runtime`; `info` says what the engine
    /// runs as ([`crate::parallel::Parallel::info`]), for the recording's
    /// sidecar and the attach server's `/health`.
    pub fn start(
        cfg: &Config,
        emitter: &Arc<Emitter>,
        breakpoints: &Arc<Breakpoints>,
        runtime: &tokio::runtime::Handle,
        info: serde_json::Value,
    ) -> Result<Self, String> {
        let mut obs = Observers {
            server: None,
            feeder: None,
            recorder: None,
            recorder_stop: Arc::new(AtomicBool::new(false)),
            publisher: None,
            control: None,
        };
        if let (Some(url), Some(engine_id)) = (&cfg.publish, &cfg.engine_id) {
            use kvbm_attach::nats::control::{ControlResponder, spawn_responder};
            use kvbm_attach::nats::publish::{Publisher, PublisherConfig};
            let tap = emitter
                .bus()
                .take_tap()
                .ok_or("the engine's event tap was already taken")?;
            obs.publisher = Some(
                Publisher::spawn(
                    tap,
                    PublisherConfig {
                        idle_poll: IDLE_POLL,
                        ..PublisherConfig::new(url, engine_id)
                    },
                    runtime,
                )
                .map_err(|e| format!("kv_connector_extra_config `publish`: {e}"))?,
            );
            let client = runtime
                .block_on(kvbm_attach::nats::connect(
                    url,
                    &format!("kvbm-py {engine_id}"),
                ))
                .map_err(|e| format!("kv_connector_extra_config `publish`: {e}"))?;
            let responder = ControlResponder::new(
                breakpoints.clone(),
                kvbm_attach::nats::control::DEFAULT_LEASE,
            );
            let task = spawn_responder(responder.clone(), client, engine_id.clone(), runtime);
            obs.control = Some((responder, task));
            return Ok(obs);
        }
        if cfg.serve.is_none() && cfg.record.is_none() {
            return Ok(obs);
        }
        let tap = emitter
            .bus()
            .take_tap()
            .ok_or("the engine's event tap was already taken")?;
        let ring = match cfg.serve {
            Some(_) => Some(Arc::new(
                RingBuffer::new(RingConfig::with_capacity(RING_EVENTS))
                    .map_err(|e| e.to_string())?,
            )),
            None => None,
        };
        let mut engine = ring.as_ref().map(|ring| {
            let bus = emitter.clone();
            ServedEngine::new(ring.clone(), emitter.engine())
                .with_run(emitter.run())
                .with_info(info.clone())
                .with_control(breakpoints.clone())
                .with_bus_counters(move || bus.bus().counters())
        });
        match &cfg.record {
            Some(dir) => {
                if dir.exists() {
                    return Err(format!(
                        "kv_connector_extra_config `record`: {} exists; kvbm records into a new directory",
                        dir.display()
                    ));
                }
                let mut rcfg = RecorderConfig {
                    stop: Some(obs.recorder_stop.clone()),
                    idle_poll: IDLE_POLL,
                    ..RecorderConfig::default()
                };
                rcfg.log.engine_id = u64::from(emitter.engine());
                rcfg.run = Some(emitter.run());
                rcfg.info = Some(info);
                if let Some(e) = &engine {
                    // The recorder fills the server's ring: it tells the
                    // server of each burst, as the feeder would, so the
                    // server's tasks wait for events rather than polling
                    // the ring every millisecond.
                    let signal = e.signal();
                    signal.mark_attached();
                    rcfg.on_ring = Some(RingWatcher(Arc::new(move |pushed| signal.notify(pushed))));
                }
                obs.recorder = Some(
                    spawn_recorder(tap, dir.clone(), rcfg, ring.clone()).map_err(|e| {
                        format!("starting the recorder into {}: {e}", dir.display())
                    })?,
                );
            }
            None => {
                let (Some(ring), Some(e)) = (&ring, &engine) else {
                    return Ok(obs);
                };
                obs.feeder = Some(
                    spawn_feeder(
                        tap,
                        ring.clone(),
                        e.signal(),
                        FeederConfig {
                            idle_poll: IDLE_POLL,
                            ..FeederConfig::default()
                        },
                    )
                    .map_err(|e| format!("starting the feeder: {e}"))?,
                );
            }
        }
        if let (Some(addr), Some(engine)) = (cfg.serve, engine.take()) {
            let token = cfg
                .token
                .clone()
                .or_else(|| std::env::var("KVBM_TOKEN").ok().filter(|t| !t.is_empty()));
            let scfg = ServerConfig {
                addr,
                token,
                ..ServerConfig::default()
            };
            // The config's token was checked with the config; a bad one
            // here came from the environment.
            let server = runtime
                .block_on(Server::bind(scfg, engine))
                .map_err(|e| match e {
                    kvbm_attach::server::ServerError::BadToken(_) if cfg.token.is_none() => {
                        format!("the KVBM_TOKEN environment variable: {e}")
                    }
                    kvbm_attach::server::ServerError::BadToken(_) => {
                        format!("kv_connector_extra_config `token`: {e}")
                    }
                    _ => format!("kv_connector_extra_config `serve`: {e}"),
                })?;
            let _g = runtime.enter();
            obs.server = Some(server.spawn());
        }
        Ok(obs)
    }

    /// The server's address, when serving.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(|s| s.local_addr())
    }

    /// The NATS publisher's and control's counters now, when publishing.
    pub fn fleet_counters(&self) -> FleetCounters {
        FleetCounters {
            publisher: self.publisher.as_ref().map(|p| p.counters()),
            control: self.control.as_ref().map(|(r, _)| r.counters()),
        }
    }

    /// Finishes the recording (which writes what is left and its sidecar)
    /// first, then stops the server and the feeder, or the publisher (which
    /// sends what it still holds, for at most [`PUBLISH_DRAIN`]) and
    /// control; returns their final counters when publishing. Every wait is
    /// bounded ([`RECORDER_STOP`], [`SERVER_STOP`], [`PUBLISH_DRAIN`]), so
    /// this returns well inside the 5 s vLLM gives its engine core to stop.
    ///
    /// Why this order: vLLM kills its engine core a fixed time after asking
    /// it to stop (5 s; at once from the OpenAI server unless kvbm's
    /// connector gives it a grace, see `kvbm.vllm`), and the recording is
    /// what a kill spoils for good (its sidecar would still say it was
    /// recording). The server and the publisher lose nothing that lasts.
    pub fn stop(mut self, runtime: &tokio::runtime::Runtime) -> Result<FleetCounters, String> {
        let t0 = std::time::Instant::now();
        let mut first_err = None;
        // Everything is told to stop at once; the recorder wakes within one
        // idle poll, and the server starts its own shutdown meanwhile.
        self.recorder_stop.store(true, Ordering::Release);
        let server = self.server.take().map(|s| runtime.spawn(s.shutdown()));
        if let Some(r) = self.recorder.take() {
            // A recorder stuck in a write is left behind rather than held
            // for: the engine core is killed soon anyway.
            while !r.is_finished() && t0.elapsed() < RECORDER_STOP {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if r.is_finished() {
                match r.join() {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        first_err.get_or_insert(format!("the recording: {e}"));
                    }
                    Err(_) => {
                        first_err.get_or_insert("the recorder thread panicked".into());
                    }
                }
            } else {
                first_err.get_or_insert(format!(
                    "the recording: the recorder did not finish within {RECORDER_STOP:?}"
                ));
            }
        }
        if let Some(mut task) = server {
            // At most SERVER_STOP in all since the stop began: WebSocket
            // clients get up to 2 s of it to say goodbye (the server's own
            // bound); past it the server is dropped with its connections
            // (their drop guards release their breakpoints either way).
            let left = SERVER_STOP.saturating_sub(t0.elapsed());
            match runtime.block_on(async { tokio::time::timeout(left, &mut task).await }) {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => {
                    first_err.get_or_insert(format!("stopping the attach server: {e}"));
                }
                Ok(Err(e)) => {
                    first_err.get_or_insert(format!("stopping the attach server: {e}"));
                }
                Err(_) => {
                    task.abort();
                    tracing::warn!(
                        "kvbm: the attach server did not stop within {SERVER_STOP:?}; dropped"
                    );
                }
            }
        }
        if let Some(f) = self.feeder.take() {
            f.stop();
        }
        let mut finals = FleetCounters::default();
        if let Some((responder, task)) = self.control.take() {
            task.abort();
            // Nothing stays paused once control is gone.
            responder.release_all();
            finals.control = Some(responder.counters());
        }
        if let Some(p) = self.publisher.take() {
            let c = p.stop(PUBLISH_DRAIN);
            if c.lost() > 0 {
                tracing::warn!("kvbm publisher lost {} events: {c:?}", c.lost());
            }
            finals.publisher = Some(c);
        }
        match first_err {
            None => Ok(finals),
            Some(e) => Err(e),
        }
    }
}
