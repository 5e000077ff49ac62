//! `kvbm-console`: the terminal console for kvbm.
//!
//! - `demo`: the console on an embedded simulated engine, running in real
//!   time with recording on.
//! - `attach URL`: the console on a remote engine's attach server.
//! - `replay DIR`: the console on a recorded log.
//! - `compare A B`: two recorded logs side by side.
//! - `walkthrough`: the CPU-offload walk-through through the real
//!   pipelines, as text.

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use kvbm_attach::client::{ClientConfig, ConnState};
use kvbm_console::app::{App, Source};
use kvbm_console::compare::Compare;
use kvbm_console::embedded::{DemoArgs, Embedded};
use kvbm_console::model::{Model, ModelConfig};
use kvbm_console::open::open_replay;
use kvbm_console::remote::{Remote, ZmqRemote};
use kvbm_console::run::{Term, run};
use kvbm_console::source::LiveSource;
use kvbm_console::walkthrough;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "kvbm-console",
    version,
    about = "Console for the kvbm KV-cache block manager"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Where logs go while the console is on screen (nothing may write to
    /// the terminal it draws on). Default: `kvbm-console.log` in the
    /// temporary directory. `RUST_LOG` sets what is logged (`warn`).
    #[arg(long, global = true)]
    log_file: Option<PathBuf>,
}

#[derive(Debug, Clone, clap::Args)]
struct ViewArgs {
    /// Seconds a finished request stays on screen (engine time).
    #[arg(long, default_value_t = 30)]
    keep_finished_s: u64,
    /// Events the event log keeps (live).
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..=50_000_000))]
    history: u64,
}

impl ViewArgs {
    fn model(&self) -> ModelConfig {
        ModelConfig {
            history: self.history as usize,
            keep_finished_ns: self.keep_finished_s.saturating_mul(1_000_000_000),
            ..ModelConfig::default()
        }
    }
}

// Parsed once per run: the size of the `demo` variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// The console on an embedded simulated engine (nothing to install).
    Demo {
        #[command(flatten)]
        engine: DemoArgs,
        #[command(flatten)]
        view: ViewArgs,
    },
    /// The console on a remote engine, through its attach server
    /// (`kvbm-sim --serve`): `attach http://127.0.0.1:PORT`; or on vLLM's
    /// KV-event publisher: `attach zmq://127.0.0.1:5557` (block events and
    /// per-tier gauges; no requests, no breakpoints); or on a fleet through
    /// NATS JetStream: `attach nats://127.0.0.1:4222` (one row per engine;
    /// Enter drills into one).
    Attach {
        /// The server, `http://HOST:PORT`, or a vLLM KV-event publisher,
        /// `zmq://HOST:PORT`.
        url: String,
        /// `zmq://` only: the publisher's replay endpoint (`zmq://HOST:PORT`),
        /// asked for the batches a sequence gap skipped.
        #[arg(long)]
        replay_endpoint: Option<String>,
        /// The server's bearer token (needed for breakpoints when it is
        /// bound beyond loopback).
        #[arg(long)]
        token: Option<String>,
        /// Events the local ring keeps.
        #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..=50_000_000))]
        ring: u64,
        #[command(flatten)]
        view: ViewArgs,
    },
    /// The console on a recorded log (a directory written by
    /// `kvbm-recorder record` or `demo --record`).
    Replay {
        /// The log directory.
        log: PathBuf,
        /// Start playing at once, at this speed (0.25 to 64).
        #[arg(long)]
        play: Option<f64>,
        #[command(flatten)]
        view: ViewArgs,
    },
    /// Two recorded logs side by side, in the same views, under the deltas
    /// of `kvbm-recorder compare A B` (B against A). Keys go to both.
    Compare {
        /// The base log (left).
        a: PathBuf,
        /// The log compared with it (right).
        b: PathBuf,
        /// Start both playing at once, at this speed (0.25 to 64).
        #[arg(long)]
        play: Option<f64>,
        #[command(flatten)]
        view: ViewArgs,
    },
    /// The CPU-offload walk-through, printed as text: request A is offloaded
    /// to the host and disk, request C pushes it out, request B hits A's
    /// prefix on disk and is onboarded back, every copy checked byte for
    /// byte.
    Walkthrough(walkthrough::WalkthroughArgs),
    /// Print a completion script for SHELL (e.g. `kvbm-console completions
    /// zsh > ~/.zfunc/_kvbm-console`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// The command line, with the demo's own defaults for the simulator's
/// options.
fn cli_command() -> clap::Command {
    Cli::command().mut_subcommand("demo", kvbm_console::embedded::demo_defaults)
}

/// Sends logs (the crate's own and its dependencies', `log` records
/// included) to `path`, appending; the terminal belongs to the screen. A
/// file that cannot be opened turns logging off, said once on stderr
/// before the screen starts.
fn log_to_file(path: &std::path::Path) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        Ok(f) => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_writer(std::sync::Mutex::new(f))
            .init(),
        Err(e) => eprintln!("logging off: cannot open {}: {e}", path.display()),
    }
}

fn main() -> std::process::ExitCode {
    match run_main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", kvbm_events::text::said(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_main() -> Result<()> {
    let cli = Cli::from_arg_matches(&cli_command().get_matches())?;
    if let Command::Completions { shell } = cli.command {
        use std::io::Write;
        // Into a buffer first: clap_complete panics when its writer fails,
        // and `| head` closes stdout early.
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut cli_command(), "kvbm-console", &mut script);
        return match std::io::stdout().write_all(&script) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
            _ => Ok(()),
        };
    }
    let log_path = match &cli.command {
        Command::Walkthrough(_) => None,
        _ => Some(
            cli.log_file
                .clone()
                .unwrap_or_else(|| std::env::temp_dir().join("kvbm-console.log")),
        ),
    };
    let log_len = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let logged_before = log_path.as_deref().map_or(0, log_len);
    match &log_path {
        Some(p) => log_to_file(p),
        // Text output only: stderr is free.
        None => tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_writer(std::io::stderr)
            .init(),
    }
    let result = run_command(cli.command);
    if let Some(p) = &log_path
        && log_len(p) > logged_before
    {
        eprintln!("log: {}", p.display());
    }
    result
}

fn run_command(command: Command) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    match command {
        Command::Completions { .. } => Ok(()),
        Command::Walkthrough(args) => {
            rt.block_on(walkthrough::run(&args, std::io::stdout().lock()))
        }
        Command::Demo { engine, view } => run_demo(&engine, view, &rt),
        Command::Attach {
            url, ring, view, ..
        } if kvbm_attach::nats::is_nats_url(&url) => {
            kvbm_console::fleet::attach(&url, ring as usize, view.model(), &rt)
        }
        Command::Replay { log, view, .. }
            if kvbm_recorder::fleet::recording_kind(&log).map_err(anyhow::Error::msg)?
                == kvbm_recorder::fleet::RecordingKind::Fleet =>
        {
            kvbm_console::fleet::replay(&log, view.model(), &rt)
        }
        Command::Attach {
            url,
            replay_endpoint,
            ring,
            view,
            ..
        } if kvbm_ingest::vllm::is_zmq_url(&url) => {
            attach_zmq(&url, replay_endpoint, ring, view, &rt)
        }
        Command::Attach {
            url,
            replay_endpoint,
            token,
            ring,
            view,
        } => attach_websocket(&url, replay_endpoint, token, ring, view, &rt),
        Command::Replay { log, play, view } => run_replay(&log, play, view, &rt),
        Command::Compare { a, b, play, view } => run_compare(&a, &b, play, view, &rt),
    }
}

/// `demo`: an engine in this process, watched live and recorded; what was
/// recorded is reported once the console closes.
fn run_demo(engine: &DemoArgs, view: ViewArgs, rt: &tokio::runtime::Runtime) -> Result<()> {
    let embedded = Embedded::start(engine)?;
    let result = {
        let mut source = LiveSource::new(embedded.ring.clone(), Some(embedded.control()));
        if let Some(summary) = kvbm_recorder::sidecar::engine_summary(&embedded.engine_info) {
            source = source.with_engine_summary(summary);
        }
        let mut app = App::new(Model::new(view.model()), Source::Live(source), "demo");
        app.views
            .transfers
            .set_bytes_note(Some(embedded.bytes_note.clone()));
        let mut term = Term::enter()?;
        let mut said_done = false;
        rt.block_on(run(&mut app, &mut term, |app| {
            if !said_done && embedded.finished() {
                said_done = true;
                app.ui.message = Some(kvbm_console::app::Message {
                    text: "the engine finished its workload".into(),
                    error: false,
                });
            }
        }))
        // The app (holding the engine's control) and the terminal
        // go here, before the engine is stopped.
    };
    let (rec, kept) = embedded.stop()?;
    result?;
    match kept {
        Some(dir) => println!(
            "recorded {} events ({} lost) to {}",
            rec.events,
            rec.lost,
            dir.display()
        ),
        None => println!(
            "recorded {} events ({} lost) to a temporary log, now removed \
                 (--record DIR keeps one)",
            rec.events, rec.lost
        ),
    }
    Ok(())
}

/// `attach` to a vLLM engine's ZMQ event publisher, from its replay
/// buffer when it has one.
fn attach_zmq(
    url: &str,
    replay_endpoint: Option<String>,
    ring: u64,
    view: ViewArgs,
    rt: &tokio::runtime::Runtime,
) -> Result<()> {
    use kvbm_ingest::vllm::{ZmqConfig, ZmqEndpoint};
    let mut cfg = ZmqConfig::new(ZmqEndpoint::parse(url).map_err(anyhow::Error::msg)?);
    cfg.replay = replay_endpoint
        .as_deref()
        .map(ZmqEndpoint::parse)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    // Joining a running engine: fetch what its replay buffer holds.
    let has_replay = cfg.replay.is_some();
    cfg.since = has_replay.then_some(0);
    let remote = ZmqRemote::start(cfg, ring as usize, rt.handle())?;
    let handle = remote.handle().clone();
    let mut app = App::new(
        Model::new(view.model()),
        Source::Live(remote.source()),
        handle.url(),
    );
    let mut term = Term::enter()?;
    let mut notices = kvbm_console::remote::ZmqNotices::default();
    rt.block_on(run(&mut app, &mut term, |app| {
        if let Some((text, error)) = notices.next(&handle.counters(), has_replay) {
            app.ui.message = Some(kvbm_console::app::Message { text, error });
        }
    }))
}

/// `attach` to a kvbm engine's WebSocket server, showing a failed
/// connection or control command as an error message.
fn attach_websocket(
    url: &str,
    replay_endpoint: Option<String>,
    token: Option<String>,
    ring: u64,
    view: ViewArgs,
    rt: &tokio::runtime::Runtime,
) -> Result<()> {
    anyhow::ensure!(
        replay_endpoint.is_none(),
        "--replay-endpoint is for a zmq:// source"
    );
    let mut cfg = ClientConfig::new(url)?;
    cfg.token = token;
    let remote = Remote::start(cfg, ring as usize, rt.handle())?;
    let control = remote.control();
    let status = remote.status();
    let mut app = App::new(
        Model::new(view.model()),
        Source::Live(remote.source()),
        status.url(),
    );
    let mut term = Term::enter()?;
    let mut said_failed = false;
    rt.block_on(run(&mut app, &mut term, |app| {
        if let Some(e) = control.take_error() {
            app.ui.message = Some(kvbm_console::app::Message {
                text: e,
                error: true,
            });
        }
        if let ConnState::Failed { error } = status.state()
            && !said_failed
        {
            said_failed = true;
            app.ui.message = Some(kvbm_console::app::Message {
                text: error,
                error: true,
            });
        }
    }))
}

/// `replay` an engine's recorded log, read in full first (with a progress
/// bar), optionally playing from the start at `play` times real time.
fn run_replay(
    log: &std::path::Path,
    play: Option<f64>,
    view: ViewArgs,
    rt: &tokio::runtime::Runtime,
) -> Result<()> {
    let mut app = open_replay(log, play, view.model())?.app;
    let mut term = Term::enter()?;
    rt.block_on(run(&mut app, &mut term, |_| {}))
}

/// `compare A B`: both logs read before the screen opens (a bad one is an
/// error naming it), then side by side.
fn run_compare(
    a: &std::path::Path,
    b: &std::path::Path,
    play: Option<f64>,
    view: ViewArgs,
    rt: &tokio::runtime::Runtime,
) -> Result<()> {
    let (a, b) = (
        open_replay(a, play, view.model())?,
        open_replay(b, play, view.model())?,
    );
    let mut screen = Compare::new(a.app, &a.events, b.app, &b.events);
    let mut term = Term::enter()?;
    rt.block_on(run(&mut screen, &mut term, |_| {}))
}
