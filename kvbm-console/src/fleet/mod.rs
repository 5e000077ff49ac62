//! The fleet console: many engines through NATS JetStream (or a fleet
//! recording) in one console.
//!
//! - [`model`]: per engine, the shared reducer's state folded from its
//!   batches (each seq once, holes counted), rates and freshness; across
//!   engines, which prefixes are cached where.
//! - [`nats`]: the fleet's stream for the fleet view, one engine's subject
//!   and control for the drilled-in console.
//! - [`app`]: the Fleet, Prefixes and Where views with their key table;
//!   `Enter` drills into an engine with every single-engine view.
//!
//! Dependencies: `app → model, nats, crate::app, crate::ui, crate::keys,
//! crate::run`; `nats → crate::source`; `model` on nothing in this crate.

pub mod app;
pub mod model;
pub mod nats;

use crate::app::{App, Source};
use crate::model::{Model, ModelConfig};
use crate::run::{Term, run};
use crate::source::ReplaySource;
use anyhow::{Context, Result};
use std::path::Path;
use std::sync::Arc;

/// `kvbm-console attach nats://HOST:PORT`: the fleet, live.
pub fn attach(
    url: &str,
    ring: usize,
    view: ModelConfig,
    rt: &tokio::runtime::Runtime,
) -> Result<()> {
    kvbm_attach::nats::check_url(url)?;
    let follower = rt.block_on(nats::FleetFollower::start(
        url,
        kvbm_attach::nats::consume::StartAt::All,
    ))?;
    let client = follower.client.clone();
    let handle = rt.handle().clone();
    let opener: app::Opener = Box::new(move |engine: &str| {
        let remote = nats::EngineRemote::start(client.clone(), engine, ring, &handle)?;
        let app = App::new(
            Model::new(view),
            Source::Live(remote.source()),
            format!("fleet › {engine}"),
        );
        Ok((app, Box::new(remote) as Box<dyn std::any::Any>))
    });
    let mut fleet = app::FleetApp::new(
        model::FleetModel::new(),
        app::FleetSource::Live(follower),
        opener,
    );
    let mut term = Term::enter()?;
    rt.block_on(run(&mut fleet, &mut term, |_| {}))
}

/// `kvbm-console replay DIR` of a fleet recording: the fleet as the
/// recording left it; `Enter` replays one engine with every replay
/// control.
pub fn replay(dir: &Path, view: ModelConfig, rt: &tokio::runtime::Runtime) -> Result<()> {
    use kvbm_recorder::fleet as rf;
    let manifest = rf::read_manifest(dir)?;
    let mut model = model::FleetModel::new();
    let now = std::time::Instant::now();
    let mut damaged = Vec::new();
    for (name, path, entry) in rf::engine_logs(dir, &manifest) {
        let read = kvbm_recorder::recorder::read_events(&path, |_| {})
            .with_context(|| format!("opening log {}", path.display()))?;
        if let Some(d) = read.damage {
            damaged.push(format!("{name}: {d}"));
        }
        let run = u64::from_str_radix(&entry.run, 16).unwrap_or(0);
        for chunk in read.events.chunks(4096) {
            let h = kvbm_attach::nats::wire::BatchHeader {
                run,
                first_seq: chunk[0].seq,
                last_seq: chunk[chunk.len() - 1].seq,
                count: chunk.len() as u32,
                dropped_before: entry.declared_dropped,
            };
            model.apply(&name, &h, chunk, now, std::time::Duration::ZERO);
        }
        for _ in 0..entry.refused {
            model.refused(Some(&name), "refused while recording".into());
        }
    }
    let root = dir.to_path_buf();
    let opener: app::Opener = Box::new(move |engine: &str| {
        let path = root.join(rf::ENGINES_DIR).join(engine);
        let read = kvbm_recorder::recorder::read_events(&path, |_| {})?;
        let lost = kvbm_recorder::recorder::read_sidecar(&path).map_or(0, |r| r.lost);
        let events: Arc<[kvbm_events::Event]> = read.events.into();
        let replay = ReplaySource::new(events, lost, view);
        let app = App::new(
            Model::new(view),
            Source::Replay(replay),
            format!("fleet › {engine}"),
        );
        Ok((app, Box::new(()) as Box<dyn std::any::Any>))
    });
    let label = dir.display().to_string();
    let mut fleet = app::FleetApp::new(model, app::FleetSource::Recorded { label }, opener);
    if !damaged.is_empty() {
        fleet.message = Some(crate::app::Message {
            text: format!(
                "damaged logs, shown up to the damage: {}",
                damaged.join("; ")
            ),
            error: true,
        });
    }
    let mut term = Term::enter()?;
    rt.block_on(run(&mut fleet, &mut term, |_| {}))
}
