//! The `kvbm-recorder` command line: the commands and their options
//! ([`Cli`]), and [`run`], which hands each command to its module:
//! `record` writes a log, `read` reads one back, `capacity` asks what
//! every cache size would have given.

mod capacity;
mod compare;
mod fleet;
mod read;
mod record;

use anyhow::Result;
use clap::{Args, Parser, Subcommand, ValueEnum};
use kvbm_recorder::fleet::{RecordingKind, recording_kind};
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
    /// The requests as a Mooncake trace (`kvbm-sim --trace`), with
    /// `OUT.meta.json` beside it.
    Mooncake,
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
    #[arg(long, requires = "from", value_parser = kvbm_sim::args::seconds)]
    duration_s: Option<f64>,
    /// `--from`: the first sequence number wanted (default 0, so
    /// events the server no longer holds are reported, not skipped). For
    /// `zmq://`, the publisher batch from which to fetch, through
    /// `--replay-endpoint`, what was published before the recorder joined
    /// (default 0 there too; without a replay endpoint what came before is
    /// only counted).
    #[arg(long, requires = "from")]
    since: Option<u64>,
    /// `--from nats://`: only engines whose name matches this glob
    /// (`*`, `?`).
    #[arg(long, requires = "from")]
    engines: Option<String>,
    /// `--from nats://`: the durable consumer's name; a recorder restarted
    /// with the same name and `--out` resumes where it acknowledged.
    #[arg(long, requires = "from")]
    consumer: Option<String>,
    /// `--from nats://`: stop once nothing has arrived for this many
    /// seconds.
    #[arg(long, requires = "from", value_parser = kvbm_sim::args::seconds)]
    idle_exit_s: Option<f64>,
    /// `--from nats://`: threads that check and write the engines'
    /// batches, each taking a share of the engines (default: one per CPU,
    /// at most 8).
    #[arg(long, requires = "from", value_parser = clap::value_parser!(u16).range(1..=256))]
    writer_threads: Option<u16>,
    /// `--from nats://`: hand-offs (each that thread's messages, at least
    /// `--handoff-batch` of them or what a millisecond brought) a writer
    /// thread queues; one more waits beside a full
    /// queue while the others go on, and the recorder takes no more
    /// messages until it is handed over. What is in flight is bounded
    /// anyway by the consumer's limit of unacknowledged messages.
    #[arg(long, requires = "from", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=4096))]
    writer_queue: u16,
    /// `--from nats://`: messages each pull request asks the server for;
    /// the next request goes out once half of them have been taken. More
    /// keeps the server sending through the recorder's pauses (a
    /// checkpoint, a slow hand-off) at the cost of that many messages
    /// buffered here; at most half the consumer's limit of unacknowledged
    /// messages (20000).
    #[arg(long, requires = "from", default_value_t = kvbm_attach::nats::consume::PULL_BATCH as u16, value_parser = clap::value_parser!(u16).range(1..=10_000))]
    pull_batch: u16,
    /// `--from nats://`: messages held for a writer thread until there
    /// are this many (or a millisecond has passed), then handed to it
    /// together. A thread with nothing to do waits, and handing it work
    /// wakes it from the receiving thread; more messages a hand-off mean
    /// fewer wakes, for a millisecond more before a message is written.
    /// 1: each delivery's share goes at once.
    #[arg(long, requires = "from", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=4096))]
    handoff_batch: u16,
    /// `--from nats://`: close an engine's log once it has gone this many
    /// seconds without events (reopened when the engine sends again), so
    /// that gone pods and past runs do not hold files open; 0: never.
    #[arg(long, requires = "from", default_value_t = kvbm_recorder::fleet::CLOSE_IDLE_AFTER.as_secs_f64(), value_parser = kvbm_sim::args::seconds)]
    close_idle_logs_s: f64,
    /// `--from nats://`, for measuring: receive, route and acknowledge as
    /// a recording does, but the writer threads only count each message's
    /// events from its header; nothing is checked or written. What the
    /// receiving alone sustains. The consumer acknowledges what it counts,
    /// so it must be named (`--consumer`) apart from any recorder's.
    #[arg(long, requires = "consumer")]
    receive_only: bool,
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
    /// The write buffer in bytes: what is handed to the OS at a time
    /// between flushes (a frame that does not fit waits for the next one).
    #[arg(long, default_value_t = 256 << 10, value_parser = clap::value_parser!(u32).range(1024..))]
    write_buffer_bytes: u32,
}

impl LogArgs {
    fn config(&self) -> LogConfig {
        LogConfig {
            segment_bytes: self.segment_bytes,
            write_buffer_bytes: self.write_buffer_bytes as usize,
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
    /// Replay a log through the reducer and print the final state; exit 2
    /// when the log is damaged or holds fewer events than were written.
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
    /// Time in each slot state, TTFT, transfer latency, batch sizes;
    /// exit 2 (after the figures, which cover what was read) when the log
    /// is damaged or holds fewer events than were written.
    Stats {
        /// Log directory.
        log: PathBuf,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Export a log as JSON lines, a Chrome trace (Perfetto) or its
    /// requests as a Mooncake trace (for `kvbm-sim --trace`); exit 2
    /// (after exporting what was read) when the log is damaged or holds
    /// fewer events than were written.
    Export {
        /// Log directory.
        log: PathBuf,
        /// Format.
        #[arg(long, value_enum)]
        format: Format,
        /// Output file (default: stdout); not inside the recording read.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Carry an engine we do not run onto the NATS event plane: vLLM's
    /// KV-event ZMQ stream, published as engine `--engine-id`.
    Bridge(fleet::BridgeArgs),
    /// Compare two logs by event signature; print the first divergence
    /// (exit 1); exit 2 when either log is damaged.
    Diff {
        /// First log.
        a: PathBuf,
        /// Second log.
        b: PathBuf,
    },
    /// Two recordings side by side: requests, prompt tokens, hit ratio per
    /// tier, TTFT, bytes and latency per direction, evictions per tier,
    /// preemptions and `check`'s verdict, with NEW's deltas. `--expect`
    /// gates NEW: exit 1 naming each failed gate with its values; exit 2
    /// when either log is damaged.
    Compare {
        /// The base recording.
        base: PathBuf,
        /// The recording judged against it.
        new: PathBuf,
        /// A gate, `METRIC OP VALUE`, OP one of >= <= > < ==, VALUE a
        /// number or base, F*base, base+N, F*base-N (BASE's value of the
        /// metric); e.g. 'hit_ratio >= 0.55', 'ttft_p99_ms <= 1.10*base',
        /// 'evictions.G2 <= base'. Repeat for more.
        #[arg(long = "expect", value_name = "GATE")]
        expect: Vec<String>,
        /// Also write the gates as JUnit XML here, one test case a gate.
        #[arg(long, value_name = "FILE")]
        junit: Option<PathBuf>,
        /// One JSON object: both summaries, the deltas and the gates.
        #[arg(long)]
        json: bool,
    },
    /// Print a completion script for SHELL (e.g. `kvbm-recorder
    /// completions bash > ~/.local/share/bash-completion/completions/kvbm-recorder`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// The prefix-hit ratio an LRU cache of every capacity would have had
    /// on the requests of a log (or of a Mooncake trace, with no
    /// simulation), the ceiling, what the run's own tiers got, and why
    /// each miss missed.
    Capacity {
        /// Log directory (or give --trace); a fleet recording is taken as
        /// one cache every engine shares.
        log: Option<PathBuf>,
        /// A Mooncake trace (JSON lines with hash_ids of 512-token
        /// blocks) instead of a log.
        #[arg(long, conflicts_with = "log")]
        trace: Option<PathBuf>,
        /// Capacities to report, in tokens, comma-separated; K, M and G
        /// are powers of 1024.
        #[arg(long, default_value = "1M,3M,10M,50M", value_parser = parse_capacities)]
        capacities: Capacities,
        /// One JSON object.
        #[arg(long)]
        json: bool,
        /// Also draw the curve into this SVG file.
        #[arg(long)]
        svg: Option<PathBuf>,
        /// Sample blocks by hash (SHARDS) at this rate in (0, 1] instead
        /// of computing exactly.
        #[arg(long, conflicts_with = "max_exact_blocks")]
        sample: Option<f64>,
        /// Exact while at most this many distinct blocks are held, then
        /// sampled at a rate halved each time the cap is reached again
        /// (default 16,777,216: exact while it fits in about 0.5 GiB).
        #[arg(long)]
        max_exact_blocks: Option<usize>,
        /// Tokens per block, for logs that do not say (vLLM's KV events):
        /// the re-store bound's capacities are then in tokens.
        #[arg(long)]
        block_size: Option<u32>,
        /// Also simulate these cache policies at each capacity, beside the
        /// exact LRU curve: a comma list of `lru`, `lfu`, `s3fifo`, `arc`,
        /// each also as `tinylfu+POLICY` (TinyLFU admission in front).
        #[arg(long, value_parser = parse_policies)]
        policies: Option<Policies>,
    },
}

/// Cache policies (a type of its own so clap takes the list whole).
#[derive(Debug, Clone)]
struct Policies(Vec<kvbm_core::CachePolicy>);

fn parse_policies(s: &str) -> Result<Policies, String> {
    crate::policies::parse_policies(s).map(Policies)
}

/// Capacities in tokens (a type of its own so clap takes the list whole).
#[derive(Debug, Clone)]
struct Capacities(Vec<u64>);

fn parse_capacities(s: &str) -> Result<Capacities, String> {
    kvbm_recorder::analysis::capacity::parse_capacities(s).map(Capacities)
}

/// The error and its causes, each said once: a message that already
/// quotes its cause (as most do) is not followed by it again.
pub fn said(e: &anyhow::Error) -> String {
    kvbm_events::text::said(e.as_ref())
}

/// What `dir` holds, or why it is not a recording.
fn kind(dir: &std::path::Path) -> Result<RecordingKind> {
    recording_kind(dir).map_err(anyhow::Error::msg)
}

/// Refuses anything but one engine's log, for the commands that read one.
fn one_log(dir: &std::path::Path, command: &str) -> Result<()> {
    match kind(dir)? {
        RecordingKind::Log => Ok(()),
        RecordingKind::Fleet => anyhow::bail!(
            "{} is a fleet recording: `{command}` reads one engine's log, {}/engines/<engine> \
             (`inspect` lists them; `kvbm-console replay` opens the whole fleet)",
            dir.display(),
            dir.display()
        ),
    }
}

/// Runs one command; its exit status.
pub fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Record {
            out,
            remote,
            log,
            sim: _,
        } if remote
            .from
            .as_deref()
            .is_some_and(kvbm_attach::nats::is_nats_url) =>
        {
            fleet::record_nats(
                remote.from.as_deref().unwrap_or_default(),
                &out,
                &remote,
                log.config(),
            )
        }
        Command::Record {
            out,
            remote,
            log,
            sim,
        } => record::record(&out, &remote, log.config(), &sim),
        Command::Bridge(a) => fleet::bridge(&a),
        // A fleet recording (a directory with a manifest): per engine.
        Command::Inspect { log, json } => match kind(&log)? {
            RecordingKind::Fleet => fleet::inspect(&log, json),
            RecordingKind::Log => read::inspect(&log, json),
        },
        Command::Check { log } => match kind(&log)? {
            RecordingKind::Fleet => fleet::check(&log),
            RecordingKind::Log => read::check(&log),
        },
        Command::Stats { log, json } => match kind(&log)? {
            RecordingKind::Fleet => fleet::stats(&log, json),
            RecordingKind::Log => read::stats(&log, json),
        },
        Command::Export { log, format, out } => {
            let kind = kind(&log)?;
            if let Some(out) = &out {
                read::refuse_output_inside(out, &log)?;
            }
            match kind {
                RecordingKind::Fleet => fleet::export(&log, format, out.as_deref()),
                RecordingKind::Log => read::export(&log, format, out.as_deref()),
            }
        }
        Command::Replay {
            log,
            speed,
            until_seq,
            verbose,
        } => {
            one_log(&log, "replay")?;
            read::replay(&log, speed, until_seq, verbose)
        }
        Command::Compare {
            base,
            new,
            expect,
            junit,
            json,
        } => {
            one_log(&base, "compare")?;
            one_log(&new, "compare")?;
            compare::compare(&base, &new, &expect, junit.as_deref(), json)
        }
        Command::Diff { a, b } => {
            one_log(&a, "diff")?;
            one_log(&b, "diff")?;
            read::diff(&a, &b)
        }
        Command::Completions { shell } => {
            use clap::CommandFactory;
            use std::io::Write;
            // Into a buffer first: clap_complete panics when its writer
            // fails, and `| head` closes stdout early.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "kvbm-recorder", &mut script);
            match std::io::stdout().write_all(&script) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
                _ => Ok(0),
            }
        }
        Command::Capacity {
            log,
            trace,
            capacities,
            json,
            svg,
            sample,
            max_exact_blocks,
            block_size,
            policies,
        } => capacity::capacity(&capacity::CapacityArgs {
            log,
            trace,
            capacities: capacities.0,
            json,
            svg,
            sample,
            max_exact_blocks,
            block_size,
            policies: policies.map(|p| p.0),
        }),
    }
}
