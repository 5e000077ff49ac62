//! Opening a recorded log as a replay: read in full first (with a
//! progress bar on the terminal before the screen takes it), damage shown
//! as the app's first message, what the engine ran as in the header. For
//! `replay` and each side of `compare`.

use crate::app::{App, Message, Source};
use crate::model::{Model, ModelConfig};
use crate::source::ReplaySource;
use anyhow::{Context, Result};
use kvbm_events::Event;
use std::path::Path;
use std::sync::Arc;

/// A log read for replay: the app on it (at the log's start), and the
/// events it holds (up to any damage).
pub struct Opened {
    /// The console on the log.
    pub app: App,
    /// What was read.
    pub events: Arc<[Event]>,
}

/// Reads `log` and builds the console on it, labelled with the log's
/// directory name; `play` starts it playing at that speed (0.25 to 64).
pub fn open_replay(log: &Path, play: Option<f64>, model: ModelConfig) -> Result<Opened> {
    if let Some(speed) = play {
        anyhow::ensure!(
            (0.25..=64.0).contains(&speed),
            "--play {speed}: the speed must be within 0.25 to 64"
        );
    }
    let total = kvbm_recorder::recorder::open_log(log)
        .map(|r| r.info().total_records)
        .unwrap_or(0);
    let bar = kvbm_recorder::progress::Progress::new(total, "events read");
    let read = kvbm_recorder::recorder::read_events(log, |n| bar.set(n))
        .with_context(|| format!("opening log {}", log.display()))?;
    bar.done();
    let side = kvbm_recorder::recorder::read_sidecar(log);
    let lost = side.as_ref().map_or(0, |r| r.lost);
    let events: Arc<[Event]> = read.events.into();
    let n = events.len();
    let mut replay = ReplaySource::new(events.clone(), lost, model)
        .with_engine_summary(side.and_then(|r| r.engine_summary()));
    if let Some(speed) = play {
        while replay.speed() < speed {
            replay.change_speed(true);
        }
        while replay.speed() > speed {
            replay.change_speed(false);
        }
        replay.set_playing(true);
    }
    let name = log.file_name().map_or_else(
        || log.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let mut app = App::new(Model::new(model), Source::Replay(replay), name);
    if let Some(damage) = &read.damage {
        app.ui.message = Some(Message {
            text: format!("log damaged, {n} events before the damage are shown: {damage}"),
            error: true,
        });
    }
    Ok(Opened { app, events })
}
