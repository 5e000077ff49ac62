//! The embedded engine behind `kvbm-console demo`: the simulator running
//! in real time on its own thread, with breakpoints installed, every event
//! recorded to a durable log and kept in a ring the console reads.

use anyhow::{Context, Result};
use kvbm_core::hooks::{Breakpoints, HookSet};
use kvbm_events::control::Control;
use kvbm_events::ring::{RingBuffer, RingConfig};
use kvbm_recorder::recorder::{RecordError, RecorderConfig, Recording, spawn_recorder};
use kvbm_sim::args::SimArgs;
use kvbm_sim::sim::{Pacing, SimConfig, SimReport, Simulator};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// The demo engine's settings (from the command line): the simulator's
/// own options ([`SimArgs`], with the demo's defaults set by
/// [`demo_defaults`]) and the demo's.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub sim: SimArgs,
    /// Keep the recording in this directory (default: a temporary one,
    /// removed on exit).
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// Events the ring keeps for the console.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..=50_000_000))]
    pub ring: u64,
    /// Seconds a paused call waits before it resumes by itself (0.001 to
    /// 86400).
    #[arg(long, default_value = "120", value_parser = kvbm_sim::args::deadline_seconds)]
    pub bp_deadline_s: Duration,
}

/// The demo's own defaults for the simulator's options, shown by
/// `demo --help`: real time, a long-running, busier workload with longer
/// prompts sharing prefixes, and tiers small enough that blocks keep moving
/// between G1, G2 and G3.
pub fn demo_defaults(cmd: clap::Command) -> clap::Command {
    [
        ("real_time", "1"),
        ("requests", "5000"),
        ("rate", "6"),
        ("seed", "2"),
        ("prompt_len", "1536"),
        ("output_len", "160"),
        ("length_sigma", "0.6"),
        ("max_len", "8192"),
        ("shared_prefix_ratio", "0.6"),
        ("shared_prefixes", "6"),
        ("shared_prefix_len", "768"),
        ("device_capacity_tokens", "32768"),
        ("host_capacity_tokens", "65536"),
        ("disk_capacity_tokens", "262144"),
    ]
    .into_iter()
    .fold(cmd, |cmd, (id, v)| cmd.mut_arg(id, |a| a.default_value(v)))
}

/// "bytes as modelled for MODEL: X a block (Y a block really copied)":
/// the transfer events carry the model's bytes (so rates and times are
/// the model's), while the simulator's memory holds a few bytes a token.
pub fn bytes_note(cfg: &SimConfig) -> String {
    let bs = cfg.block_size as u64;
    format!(
        "bytes as modelled for {}: {} a block ({} a block really copied)",
        cfg.model,
        crate::fmt::bytes(bs * cfg.worker.model_kv_bytes_per_token),
        crate::fmt::bytes(bs * cfg.real_bytes_per_token as u64)
    )
}

/// A running embedded engine.
pub struct Embedded {
    stop: Arc<AtomicBool>,
    engine: Option<JoinHandle<Result<SimReport>>>,
    /// Where the log is written.
    pub dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    /// The console's ring.
    pub ring: Arc<RingBuffer>,
    /// The engine's breakpoints.
    pub breakpoints: Arc<Breakpoints>,
    recorder: Option<JoinHandle<Result<Recording, RecordError>>>,
    recorder_stop: Arc<AtomicBool>,
    runtime: tokio::runtime::Runtime,
    /// What the engine's byte figures stand for: the model's KV bytes,
    /// while the simulator copies only a few real bytes per token.
    pub bytes_note: String,
    /// What the engine runs as ([`kvbm_sim::info::engine_info`]), also in
    /// its recording.
    pub engine_info: serde_json::Value,
}

impl Embedded {
    /// Starts the engine (with a runtime of its own for its transfer
    /// pipelines) and the recorder.
    pub fn start(args: &DemoArgs) -> Result<Self> {
        // The engine's own runtime: dropping it at stop ends the pipeline
        // tasks, which hold the engine's emitter, so the recorder's tap
        // closes and the recorder finishes.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvbm-demo-pipelines")
            .enable_all()
            .build()
            .context("starting the engine's runtime")?;
        let runtime = rt.handle().clone();
        let loaded = args.sim.load().context("the demo's engine")?;
        let (mut cfg, workload) = (loaded.config, loaded.workload);
        let bytes_note = bytes_note(&cfg);
        let info = kvbm_sim::info::engine_info(&cfg);
        let info2 = info.clone();
        // The console shows a live engine: it always runs in real time.
        if !matches!(cfg.pacing, Pacing::RealTime { .. }) {
            cfg.pacing = Pacing::RealTime { speed: 1.0 };
        }
        let (dir, tmp) = match &args.record {
            Some(d) => (d.clone(), None),
            None => {
                let t = tempfile::tempdir().context("creating a directory for the recording")?;
                (t.path().join("demo.kvbm"), Some(t))
            }
        };
        let ring = Arc::new(
            RingBuffer::new(RingConfig::with_capacity(args.ring as usize))
                .context("creating the ring")?,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let deadline = args.bp_deadline_s;
        // The simulator is built on its own thread (it must not be built on
        // a runtime worker) and hands back what the console needs.
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let (ring2, dir2, stop2) = (ring.clone(), dir.clone(), stop.clone());
        let rec_stop = Arc::new(AtomicBool::new(false));
        let rec_stop_outer = rec_stop.clone();
        let engine = std::thread::Builder::new()
            .name("kvbm-demo-engine".into())
            .spawn(move || -> Result<SimReport> {
                let setup = (|| -> Result<_> {
                    let mut sim = Simulator::new(cfg, workload, &runtime)
                        .context("starting the simulator")?;
                    let emitter = sim.emitter().clone();
                    let emitter_engine = emitter.engine();
                    let bps = Arc::new(Breakpoints::new(Some(emitter.clone()), deadline));
                    sim.leader_mut().set_hooks(
                        HookSet::none()
                            .with_emitter(emitter)
                            .with_breakpoints(bps.clone()),
                    );
                    let tap = sim
                        .emitter()
                        .bus()
                        .take_tap()
                        .context("the engine's tap was already taken")?;
                    let mut rcfg = RecorderConfig {
                        stop: Some(rec_stop),
                        info: Some(info2),
                        ..RecorderConfig::default()
                    };
                    rcfg.log.engine_id = u64::from(emitter_engine);
                    let rec = spawn_recorder(tap, dir2.clone(), rcfg, Some(ring2)).with_context(
                        || format!("starting the recorder into {}", dir2.display()),
                    )?;
                    Ok((sim, bps, rec))
                })();
                let mut sim = match setup {
                    Ok((sim, bps, rec)) => {
                        let _ = tx.send(Ok((bps, rec)));
                        sim
                    }
                    Err(e) => {
                        let msg = format!("{e:#}");
                        let _ = tx.send(Err(e));
                        anyhow::bail!(msg);
                    }
                };
                while !stop2.load(Ordering::Relaxed) && sim.step() {}
                Ok(sim.finish())
            })
            .context("starting the engine thread")?;
        let (breakpoints, recorder) = rx
            .recv()
            .context("the engine thread ended before starting")??;
        Ok(Embedded {
            stop,
            engine: Some(engine),
            dir,
            _tmp: tmp,
            ring,
            breakpoints,
            recorder: Some(recorder),
            recorder_stop: rec_stop_outer,
            runtime: rt,
            bytes_note,
            engine_info: info,
        })
    }

    /// The breakpoint control for the console.
    pub fn control(&self) -> Arc<dyn Control> {
        self.breakpoints.clone()
    }

    /// True once the engine ran out of work (or stopped).
    pub fn finished(&self) -> bool {
        self.engine.as_ref().is_none_or(|h| h.is_finished())
    }

    /// Stops the engine (releasing any paused call so it cannot hang) and
    /// the recorder; returns what was recorded.
    pub fn stop(self) -> Result<(Recording, Option<PathBuf>)> {
        let Embedded {
            stop,
            engine,
            dir,
            _tmp,
            ring: _,
            breakpoints,
            recorder,
            recorder_stop,
            runtime,
            bytes_note: _,
            engine_info: _,
        } = self;
        stop.store(true, Ordering::Relaxed);
        breakpoints.clear_all();
        breakpoints.resume_all();
        // The breakpoints hold the engine's emitter, and with it the bus:
        // the recorder's tap closes only when every holder is gone (the
        // caller must have dropped the console's control too).
        drop(breakpoints);
        if let Some(h) = engine {
            match h.join() {
                Ok(r) => {
                    r?;
                }
                Err(_) => anyhow::bail!("the engine thread panicked"),
            }
        }
        runtime.shutdown_timeout(Duration::from_secs(5));
        // The engine is stopped and its transfers are over; whatever it
        // emitted is in the tap. The flag lets the recorder finish even if
        // something still holds the engine's bus.
        recorder_stop.store(true, Ordering::Release);
        let rec = match recorder.map(|h| h.join()) {
            Some(Ok(r)) => r.context("recording")?,
            Some(Err(_)) => anyhow::bail!("the recorder thread panicked"),
            None => Recording::default(),
        };
        let kept = _tmp.is_none().then_some(dir);
        Ok((rec, kept))
    }

    /// The log directory.
    pub fn log_dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bytes_note_names_the_model_and_both_sizes() {
        let cfg = SimConfig {
            block_size: 16,
            real_bytes_per_token: 4,
            model: "llama-3-8b".into(),
            ..SimConfig::default()
        };
        assert_eq!(
            bytes_note(&cfg),
            "bytes as modelled for llama-3-8b: 2.0MiB a block (64B a block really copied)"
        );
    }
}
