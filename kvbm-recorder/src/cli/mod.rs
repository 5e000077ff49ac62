//! The `kvbm-recorder` command line: the commands and their options
//! ([`Cli`]), and [`run`], which hands each command to its module:
//! [`record`] writes a log, [`read`] reads one back.

mod progress;
mod read;
mod record;

use anyhow::Result;
use clap::{Args, Parser, Subcommand, ValueEnum};
use kvbm_recorder::log::{FsyncPolicy, LogConfig};
use kvbm_recorder::recorder::RecorderConfig;
use kvbm_sim::args::SimArgs;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "kvbm-recorder",
    version,
    about = "Record and read back kvbm event logs"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Fsync {
    Every,
    Interval,
    Never,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Jsonl,
    Chrome,
}

/// Where `record` gets its events when not from an in-process simulator.
#[derive(Debug, Args)]
#[command(next_help_heading = "Remote source")]
struct RemoteArgs {
    /// Record from this attach server (`http://HOST:PORT`, e.g. a
    /// `kvbm-sim --serve`) instead of running the simulator. Stops on
    /// Ctrl-C, `--events` or `--duration-s`; survives reconnections
    /// without duplicates, and writes the server's gaps to the sidecar.
    /// Or from vLLM's KV-event publisher, `zmq://HOST:PORT`: its block
    /// events become BlockRegistered / BlockEvicted / PoolGauge, its
    /// sequence gaps the sidecar's losses (counted in publisher batches).
    #[arg(long, conflicts_with_all = ["trace", "scenario"])]
    from: Option<String>,
    /// `--from zmq://`: the publisher's replay endpoint
    /// (`zmq://HOST:PORT`), asked for the batches a gap skipped.
    #[arg(long, requires = "from")]
    replay_endpoint: Option<String>,
    /// `--from`: the server's bearer token.
    #[arg(long, requires = "from")]
    token: Option<String>,
    /// `--from`: stop after this many events.
    #[arg(long, requires = "from")]
    events: Option<u64>,
    /// `--from`: stop after this many seconds.
    #[arg(long, requires = "from")]
    duration_s: Option<f64>,
    /// `--from`: the first sequence number wanted (default 0, so
    /// events the server no longer holds are reported, not skipped).
    #[arg(long, requires = "from")]
    since: Option<u64>,
}

/// How the log is written.
#[derive(Debug, Args)]
#[command(next_help_heading = "Log")]
struct LogArgs {
    /// When the log fsyncs.
    #[arg(long, value_enum, default_value_t = Fsync::Interval)]
    fsync: Fsync,
    /// For `--fsync interval`: milliseconds between fsyncs.
    #[arg(long, default_value_t = 100)]
    fsync_ms: u64,
    /// Segment size in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    segment_bytes: u64,
}

impl LogArgs {
    fn config(&self) -> LogConfig {
        LogConfig {
            segment_bytes: self.segment_bytes,
            fsync: match self.fsync {
                Fsync::Every => FsyncPolicy::EveryRecord,
                Fsync::Interval => FsyncPolicy::Interval(Duration::from_millis(self.fsync_ms)),
                Fsync::Never => FsyncPolicy::Never,
            },
            ..RecorderConfig::default().log
        }
    }
}

// Parsed once per run: the size of the `record` variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Run the simulated engine in-process and record every event; or,
    /// with `--from`, record a running engine through its attach server or
    /// vLLM's KV-event publisher.
    Record {
        /// Log directory to create.
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        remote: RemoteArgs,
        #[command(flatten)]
        log: LogArgs,
        #[command(flatten)]
        sim: SimArgs,
    },
    /// Header, counts by kind, time range, losses and how the recording
    /// ended (finished, the engine restarted, killed, disk full, unknown).
    Inspect {
        /// Log directory.
        log: PathBuf,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Replay a log through the reducer and print the final state.
    Replay {
        /// Log directory.
        log: PathBuf,
        /// Real time × this speed (default: as fast as possible).
        #[arg(long)]
        speed: Option<f64>,
        /// Stop after this sequence number.
        #[arg(long)]
        until_seq: Option<u64>,
        /// Print every event as it is applied.
        #[arg(long)]
        verbose: bool,
    },
    /// Check the invariants; exit 0 when they hold over a whole
    /// recording, 1 naming the first violation, 2 if the log is damaged
    /// (a cleanly finished recording missing events included), 3 if they
    /// hold but the recording ended early (recorder killed, disk full) or
    /// its completeness is unknown (no usable sidecar).
    Check {
        /// Log directory.
        log: PathBuf,
    },
    /// Time in each slot state, TTFT, transfer latency, batch sizes.
    Stats {
        /// Log directory.
        log: PathBuf,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Export a log as JSON lines or a Chrome trace (Perfetto).
    Export {
        /// Log directory.
        log: PathBuf,
        /// Format.
        #[arg(long, value_enum)]
        format: Format,
        /// Output file (default: stdout).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Compare two logs by event signature; print the first divergence.
    Diff {
        /// First log.
        a: PathBuf,
        /// Second log.
        b: PathBuf,
    },
}

/// Runs one command; its exit status.
pub fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Record {
            out,
            remote,
            log,
            sim,
        } => record::record(&out, &remote, log.config(), &sim),
        Command::Inspect { log, json } => read::inspect(&log, json),
        Command::Replay {
            log,
            speed,
            until_seq,
            verbose,
        } => read::replay(&log, speed, until_seq, verbose),
        Command::Check { log } => read::check(&log),
        Command::Stats { log, json } => read::stats(&log, json),
        Command::Export { log, format, out } => read::export(&log, format, out.as_deref()),
        Command::Diff { a, b } => read::diff(&a, &b),
    }
}
