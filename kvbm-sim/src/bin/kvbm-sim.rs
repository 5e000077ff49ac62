//! `kvbm-sim`: runs the simulated engine on a workload and reports.
//!
//! ```sh
//! kvbm-sim --trace data/mooncake/synthetic_trace.jsonl --block-size 512 --json
//! kvbm-sim --requests 200 --rate 20 --prompt-len 2048 --shared-prefix-ratio 0.5
//! # serve the attach protocol while it runs (and after, until Ctrl-C):
//! kvbm-sim --requests 5000 --rate 6 --real-time 1 --serve 127.0.0.1:7070
//! ```
//!
//! With `--serve ADDR` the engine runs with breakpoints installed and an
//! attach server (see `kvbm_attach::server`) on ADDR; the first line on
//! stdout is `serving on http://HOST:PORT` (the real port when ADDR ends in
//! `:0`). Anything but 127.0.0.1 and ::1 needs `--token` (or `KVBM_TOKEN`).
//!
//! With `--publish nats://HOST:PORT --engine-id NAME` the engine runs with
//! breakpoints installed, publishes its events to the fleet's JetStream
//! stream and answers control on `kvbm.control.NAME` (see
//! `kvbm_attach::nats`); on exit the publisher's counters go to stderr as
//! one line, `publisher {json}`.
//!
//! Served or publishing, SIGINT (Ctrl-C) or SIGTERM before the workload
//! ends stops the engine: the report says the run was interrupted and
//! counts only the requests that had arrived, and the exit status is 130
//! or 143. After the workload they only end the lingering (status 0).
//!
//! A reader of stdout that has gone (`| head`) ends the output quietly,
//! status 0 as if it had read it all; any other failure to write stdout
//! (a full disk) is an error naming stdout.

use anyhow::{Context, Result};
use clap::Parser;
use kvbm_attach::server::{
    FeederConfig, ServedEngine, Server, ServerConfig, ServerError, spawn_feeder,
};
use kvbm_core::hooks::{Breakpoints, HookSet};
use kvbm_events::Emitter;
use kvbm_events::ring::{RingBuffer, RingConfig};
use kvbm_sim::args::SimArgs;
use kvbm_sim::sim::{SimReport, Simulator};
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "kvbm-sim",
    version,
    about = "Simulated LLM engine driving the kvbm block manager",
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Extra>,
    #[command(flatten)]
    sim: SimArgs,
    /// Print one JSON object instead of a readable summary.
    #[arg(long)]
    json: bool,
    /// Serve the attach protocol on this address while the engine runs
    /// (port 0 picks a free port), with breakpoints installed.
    #[arg(long)]
    serve: Option<SocketAddr>,
    /// Bearer token for the server (needed off loopback; then required on
    /// every request). Defaults to the KVBM_TOKEN environment variable.
    #[arg(long, requires = "serve")]
    token: Option<String>,
    /// With a token: let read-only requests through without it.
    #[arg(long, requires = "serve")]
    open_read: bool,
    /// Most WebSocket clients at once.
    #[arg(long, default_value_t = 64, requires = "serve")]
    max_clients: usize,
    /// Most TCP connections at once, HTTP and WebSocket together (at least
    /// --max-clients); one more is answered 503 and closed.
    #[arg(long, default_value_t = 256, requires = "serve")]
    max_connections: usize,
    /// Most TCP connections from one client address (taken as at most
    /// --max-connections); one more place is kept for 127.0.0.1 / ::1.
    #[arg(long, default_value_t = 64, requires = "serve")]
    max_connections_per_ip: usize,
    /// Keep a client's breakpoints (and its paused calls paused) when it
    /// disconnects.
    #[arg(long, requires = "serve")]
    keep_breakpoints_on_disconnect: bool,
    /// After the workload ends, keep serving this many seconds, then exit
    /// (default: until Ctrl-C).
    #[arg(long, requires = "serve", value_parser = kvbm_sim::args::seconds)]
    linger_s: Option<f64>,
    /// Events the server's ring keeps.
    #[arg(long, default_value_t = 1 << 20, requires = "serve")]
    ring: usize,
    /// Seconds a paused call waits before it resumes by itself (0.001 to
    /// 86400).
    #[arg(long, default_value = "60", value_parser = kvbm_sim::args::deadline_seconds)]
    bp_deadline_s: Duration,
    /// Publish every event to NATS JetStream (`nats://HOST:PORT`) as
    /// engine `--engine-id`, with breakpoint control on
    /// `kvbm.control.<engine-id>`.
    #[arg(long, conflicts_with = "serve", requires = "engine_id")]
    publish: Option<String>,
    /// This engine's name on the event plane (letters, digits, '-', '_').
    #[arg(long, requires = "publish")]
    engine_id: Option<String>,
    /// On exit, keep sending what is buffered for at most this long.
    #[arg(long, default_value_t = 10.0, requires = "publish", value_parser = kvbm_sim::args::seconds)]
    publish_drain_s: f64,
    /// Seconds a controller's session lasts without a renewal before its
    /// breakpoints are removed and its paused calls resume.
    #[arg(long, default_value_t = 10.0, requires = "publish", value_parser = kvbm_sim::args::seconds)]
    control_lease_s: f64,
    /// `--publish`: after the workload ends, keep answering control this
    /// many seconds, then exit (default: exit at once).
    #[arg(long, requires = "publish", value_parser = kvbm_sim::args::seconds)]
    publish_linger_s: Option<f64>,
}

/// Commands besides running the engine.
#[derive(Debug, clap::Subcommand)]
enum Extra {
    /// Print a completion script for SHELL (e.g. `kvbm-sim completions
    /// fish > ~/.config/fish/completions/kvbm-sim.fish`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", kvbm_events::text::said(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    if let Some(Extra::Completions { shell }) = a.command {
        use clap::CommandFactory;
        // Into a buffer first: clap_complete panics when its writer fails,
        // and `| head` closes stdout early.
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut Args::command(), "kvbm-sim", &mut script);
        write_stdout(&script).context("writing the completion script to stdout")?;
        return Ok(ExitCode::SUCCESS);
    }
    let loaded = a.sim.load()?;
    if let Some(path) = &a.sim.trace {
        for s in loaded.skipped.iter().take(5) {
            eprintln!(
                "warning: {}: line {} skipped: {}",
                path.display(),
                s.line,
                s.error
            );
        }
        if loaded.skipped.len() > 5 {
            eprintln!("warning: {} more lines skipped", loaded.skipped.len() - 5);
        }
    }
    let (cfg, workload) = (loaded.config, loaded.workload);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let sim = Simulator::new(cfg, workload, rt.handle())?;
    let (report, signal) = match (a.serve, &a.publish) {
        (Some(addr), _) => serve(&a, addr, sim)?,
        (None, Some(url)) => publish(&a, url, sim)?,
        (None, None) => {
            // A bar on stderr when it is a terminal; nothing otherwise.
            let bar = indicatif::ProgressBar::with_draw_target(
                None,
                indicatif::ProgressDrawTarget::stderr(),
            )
            .with_style(
                indicatif::ProgressStyle::with_template(
                    "[{bar:30}] {percent:>3}%  {pos}/{len} requests finished",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            let report = sim.run_with_progress(|done, total| {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
            });
            bar.finish_and_clear();
            (report, None)
        }
    };
    if report.interrupted {
        eprintln!(
            "interrupted{} before the workload ended: {} of {} requests had arrived; \
             the report counts only those",
            signal.map_or(String::new(), |s| format!(" by {}", s.name())),
            report.requests_arrived,
            report.requests_total
        );
    }
    let text = if a.json {
        serde_json::to_string(&report)? + "\n"
    } else {
        summary(&report)
    };
    write_stdout(text.as_bytes()).context("writing the report to stdout")?;
    Ok(match (report.interrupted, signal) {
        (false, _) => ExitCode::SUCCESS,
        (true, Some(s)) => ExitCode::from(s.exit_status()),
        (true, None) => ExitCode::FAILURE,
    })
}

/// A server setting this program takes as an option is named as the
/// option (`--max-clients`), not as the library's field; a token as where
/// it came from (`--token`, or the KVBM_TOKEN environment variable when
/// `token_from_env`).
fn said_as_options(e: ServerError, token_from_env: bool) -> anyhow::Error {
    const OPTIONS: [&str; 3] = ["max_connections_per_ip", "max_connections", "max_clients"];
    match e {
        ServerError::BadToken(why) if token_from_env => {
            anyhow::anyhow!("the KVBM_TOKEN environment variable: unusable token: {why}")
        }
        ServerError::BadToken(why) => anyhow::anyhow!("--token: unusable token: {why}"),
        ServerError::BadConfig { field, reason } if OPTIONS.contains(&field) => {
            // Longest first, so `max_connections` does not eat the start
            // of `max_connections_per_ip`.
            let reason = OPTIONS.iter().fold(reason, |r, f| {
                r.replace(f, &format!("--{}", f.replace('_', "-")))
            });
            anyhow::anyhow!("--{}: {reason}", field.replace('_', "-"))
        }
        e => e.into(),
    }
}

/// Writes `bytes` to stdout and flushes. A reader that has gone (`| head`)
/// is not an error: there is nobody left to tell, so the rest is dropped.
fn write_stdout(bytes: &[u8]) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r,
    }
}

/// Runs the engine with breakpoints and an attach server; returns the
/// report once the engine finished and the server stopped (a signal, or
/// `--linger-s` after the workload), with the signal if one came.
fn serve(a: &Args, addr: SocketAddr, mut sim: Simulator) -> Result<(SimReport, Option<Signal>)> {
    let from_env = a.token.is_none();
    let token = a
        .token
        .clone()
        .or_else(|| std::env::var("KVBM_TOKEN").ok().filter(|t| !t.is_empty()));
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvbm-server")
        .enable_all()
        .build()?;
    let (emitter, bps) = install_breakpoints(&mut sim, a.bp_deadline_s);
    let ring = Arc::new(RingBuffer::new(RingConfig::with_capacity(a.ring)).context("--ring")?);
    let tap = emitter
        .bus()
        .take_tap()
        .context("the engine's tap was already taken")?;
    let bus = emitter.clone();
    let engine = ServedEngine::new(ring.clone(), emitter.engine())
        .with_run(emitter.run())
        .with_control(bps.clone())
        .with_bus_counters(move || bus.bus().counters());
    let feeder = spawn_feeder(tap, ring, engine.signal(), FeederConfig::default())
        .context("starting the feeder")?;
    let cfg = ServerConfig {
        addr,
        token,
        open_read: a.open_read,
        max_clients: a.max_clients,
        max_connections: a.max_connections,
        max_connections_per_ip: a.max_connections_per_ip,
        release_on_disconnect: !a.keep_breakpoints_on_disconnect,
        ..ServerConfig::default()
    };
    let server = server_rt
        .block_on(Server::bind(cfg, engine))
        .map_err(|e| said_as_options(e, from_env))?;
    // Without a reader on stdout the server still serves.
    write_stdout(format!("serving on http://{}\n", server.local_addr()).as_bytes())
        .context("writing the address to stdout")?;
    let handle = {
        let _g = server_rt.enter();
        server.spawn()
    };
    let engine = EngineThread::spawn(sim)?;
    let linger = match a.linger_s {
        Some(s) => Linger::For(s),
        None => Linger::UntilCtrlC("workload finished; serving until Ctrl-C"),
    };
    let signal = server_rt.block_on(engine.wait(linger));
    // No client can set a breakpoint once the server is down; then nothing
    // may stay paused.
    let served = server_rt.block_on(handle.shutdown());
    bps.clear_all();
    bps.resume_all();
    let report = engine.join()?;
    feeder.stop();
    served?;
    Ok((report, signal))
}

/// Runs the engine with breakpoints, publishing to NATS and answering
/// control there; returns the report once the engine finished (or a
/// signal came) and the publisher drained, with the signal if one came.
fn publish(a: &Args, url: &str, mut sim: Simulator) -> Result<(SimReport, Option<Signal>)> {
    use kvbm_attach::nats::control::{ControlResponder, spawn_responder};
    use kvbm_attach::nats::publish::{Publisher, PublisherConfig};
    let engine_id = a.engine_id.clone().unwrap_or_default();
    kvbm_attach::nats::check_engine_name(&engine_id)?;
    kvbm_attach::nats::check_url(url)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvbm-publish")
        .enable_all()
        .build()?;
    let (emitter, bps) = install_breakpoints(&mut sim, a.bp_deadline_s);
    let tap = emitter
        .bus()
        .take_tap()
        .context("the engine's tap was already taken")?;
    let publisher = Publisher::spawn(tap, PublisherConfig::new(url, &engine_id), rt.handle())?;
    let responder = ControlResponder::new(bps.clone(), Duration::from_secs_f64(a.control_lease_s));
    let client = rt.block_on(kvbm_attach::nats::connect(
        url,
        &format!("kvbm-sim {engine_id}"),
    ))?;
    let control = spawn_responder(responder.clone(), client, engine_id.clone(), rt.handle());
    eprintln!(
        "publishing to {} as engine {engine_id} (run {:016x})",
        kvbm_attach::nats::redacted(url),
        publisher.run()
    );
    let engine = EngineThread::spawn(sim)?;
    let signal = rt.block_on(engine.wait(a.publish_linger_s.map_or(Linger::No, Linger::For)));
    // Nothing may stay paused once control is gone.
    control.abort();
    responder.release_all();
    bps.clear_all();
    bps.resume_all();
    let report = engine.join()?;
    let counters = publisher.stop(Duration::from_secs_f64(a.publish_drain_s));
    eprintln!("publisher {}", serde_json::to_string(&counters)?);
    // What control through NATS answered, refused and released.
    eprintln!("control {}", serde_json::to_string(&responder.counters())?);
    Ok((report, signal))
}

/// Breakpoints on the simulator's leader (a pause lasting at most
/// `deadline`, which `--bp-deadline-s`'s parser keeps in the range
/// `Breakpoints` takes), with its emitter: what a served or publishing
/// engine is controlled through.
fn install_breakpoints(
    sim: &mut Simulator,
    deadline: Duration,
) -> (Arc<Emitter>, Arc<Breakpoints>) {
    let emitter = sim.emitter().clone();
    let bps = Arc::new(Breakpoints::new(Some(emitter.clone()), deadline));
    sim.leader_mut().set_hooks(
        HookSet::none()
            .with_emitter(emitter.clone())
            .with_breakpoints(bps.clone()),
    );
    (emitter, bps)
}

/// What a served or publishing engine does once its workload is done.
enum Linger {
    /// Stays up this many seconds (or until a signal).
    For(f64),
    /// Says this, then stays up until a signal.
    UntilCtrlC(&'static str),
    /// Ends at once.
    No,
}

/// A signal that stops a served or publishing engine.
#[derive(Debug, Clone, Copy)]
enum Signal {
    /// Ctrl-C.
    Int,
    /// `kill`, a service manager stopping it.
    Term,
}

impl Signal {
    fn name(self) -> &'static str {
        match self {
            Signal::Int => "SIGINT",
            Signal::Term => "SIGTERM",
        }
    }

    /// 128 + the signal's number, as a shell reports a process the signal
    /// killed.
    fn exit_status(self) -> u8 {
        match self {
            Signal::Int => 130,
            Signal::Term => 143,
        }
    }

    /// The next SIGINT or SIGTERM. One whose handler cannot be installed is
    /// never awaited, rather than taken as having come.
    async fn next() -> Signal {
        let int = async {
            match tokio::signal::ctrl_c().await {
                Ok(()) => Signal::Int,
                Err(_) => std::future::pending().await,
            }
        };
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let term = async {
                match signal(SignalKind::terminate()) {
                    Ok(mut s) => {
                        s.recv().await;
                        Signal::Term
                    }
                    Err(_) => std::future::pending().await,
                }
            };
            tokio::select! {
                s = int => s,
                s = term => s,
            }
        }
        #[cfg(not(unix))]
        int.await
    }
}

/// The simulator stepping on its own thread, while the caller's runtime
/// serves or publishes.
struct EngineThread {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<SimReport>,
}

impl EngineThread {
    fn spawn(mut sim: Simulator) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvbm-sim-engine".into())
            .spawn(move || {
                while !stop2.load(Ordering::Relaxed) && sim.step() {}
                sim.finish()
            })?;
        Ok(EngineThread { stop, thread })
    }

    /// Until the workload finishes and then `linger`, or until SIGINT or
    /// SIGTERM, which stops the engine; returns the signal if one came.
    async fn wait(&self, linger: Linger) -> Option<Signal> {
        let signal = Signal::next();
        tokio::pin!(signal);
        let finished = async {
            while !self.thread.is_finished() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::select! {
            s = &mut signal => {
                // The engine sees this between two steps; its report then
                // says whether the workload had ended.
                self.stop.store(true, Ordering::Relaxed);
                Some(s)
            }
            _ = finished => match linger {
                Linger::For(secs) => tokio::select! {
                    s = &mut signal => Some(s),
                    _ = tokio::time::sleep(Duration::from_secs_f64(secs)) => None,
                },
                Linger::UntilCtrlC(say) => {
                    eprintln!("{say}");
                    Some((&mut signal).await)
                }
                Linger::No => None,
            },
        }
    }

    fn join(self) -> Result<SimReport> {
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the engine thread panicked"))
    }
}

/// The readable report.
fn summary(r: &SimReport) -> String {
    let mut s = String::new();
    // Writing to a String cannot fail: the results are ignored.
    if r.interrupted {
        let _ = writeln!(
            s,
            "INTERRUPTED         before the workload ended: {} of {} requests had arrived, \
             and every figure counts only those",
            r.requests_arrived, r.requests_total
        );
    }
    let _ = writeln!(
        s,
        "model               {} ({} KV bytes per block; byte figures count these, \
         the simulated storages copy far fewer)",
        r.model, r.kv_bytes_per_block
    );
    let _ = writeln!(s, "requests finished   {}", r.requests_finished);
    let _ = writeln!(
        s,
        "prompt tokens       {}  (prefix hits {} = {:.1}%)",
        r.prompt_tokens,
        r.prefix_hit_tokens,
        100.0 * r.prefix_hit_ratio
    );
    for (tier, t) in &r.prefix_hit_tokens_by_tier {
        let _ = writeln!(s, "  hits on {tier:<7}   {t}");
    }
    let _ = writeln!(s, "preemptions         {}", r.preemptions);
    for (d, t) in &r.transfers_by_direction {
        let _ = writeln!(
            s,
            "transfers {d}      {} completed, {} skipped, {} blocks, {} bytes ({} really copied)",
            t.completed, t.skipped, t.blocks, t.bytes, t.real_bytes
        );
    }
    let _ = writeln!(
        s,
        "TTFT ms             p50 {:.1}  p90 {:.1}  p99 {:.1}  max {:.1}",
        r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99, r.ttft_ms.max
    );
    let _ = writeln!(
        s,
        "events              {} emitted, {} lost",
        r.events_emitted, r.events_lost
    );
    let _ = writeln!(
        s,
        "iterations          {} ({:.0} ms virtual, {:.0} ms wall)",
        r.iterations, r.virtual_time_ms, r.wall_time_ms
    );
    s
}
