//! `kvbm-recorder`: record, inspect, replay, check, summarise, export and
//! compare kvbm event logs.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use kvbm_attach::client::{Client, ClientConfig, ClientEvent};
use kvbm_events::Event;
use kvbm_events::reducer::EngineState;
use kvbm_recorder::analysis::{self, ReplayMode, Replayer};
use kvbm_recorder::log::{FsyncPolicy, LogConfig, LogWriter};
use kvbm_recorder::recorder::{self, GapAt, RecorderConfig, Recording};
use kvbm_sim::sim::OffloadMode;
use kvbm_sim::sim::{SimConfig, Simulator};
use kvbm_sim::workload::{
    LengthDist, MooncakeOptions, SyntheticConfig, generate, parse_mooncake_lenient,
};
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "kvbm-recorder",
    version,
    about = "Record and read back kvbm event logs"
)]
struct Cli {
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
enum Scenario {
    Walkthrough,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Jsonl,
    Chrome,
}

// Parsed once per run: the size of the `record` variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Run the simulated engine in-process and record every event; or,
    /// with `--from`, record a running engine through its attach server.
    Record {
        /// Log directory to create.
        #[arg(long)]
        out: PathBuf,
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
        /// A Mooncake JSONL trace; without it, a synthetic workload.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// A built-in scenario instead: `walkthrough` is seed 002's two
        /// requests (A offloaded to the host, B hitting A's prefix there).
        #[arg(long, value_enum)]
        scenario: Option<Scenario>,
        /// Use at most this many requests of the trace.
        #[arg(long)]
        max_requests: Option<usize>,
        /// Synthetic: number of requests.
        #[arg(long, default_value_t = 50)]
        requests: usize,
        /// Synthetic: arrivals per second.
        #[arg(long, default_value_t = 20.0)]
        rate: f64,
        /// Synthetic: mean prompt length.
        #[arg(long, default_value_t = 512)]
        prompt_len: usize,
        /// Synthetic: mean output length.
        #[arg(long, default_value_t = 32)]
        output_len: usize,
        /// Synthetic: seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Tokens per block.
        #[arg(long, default_value_t = 16)]
        block_size: usize,
        /// G1 capacity in tokens.
        #[arg(long, default_value_t = 16_384)]
        device_capacity_tokens: usize,
        /// G2 capacity in tokens (0 disables).
        #[arg(long, default_value_t = 65_536)]
        host_capacity_tokens: usize,
        /// G3 capacity in tokens (0 disables).
        #[arg(long, default_value_t = 0)]
        disk_capacity_tokens: usize,
        /// Lazy instead of eager offload.
        #[arg(long)]
        lazy: bool,
        /// When the log fsyncs.
        #[arg(long, value_enum, default_value_t = Fsync::Interval)]
        fsync: Fsync,
        /// For `--fsync interval`: milliseconds between fsyncs.
        #[arg(long, default_value_t = 100)]
        fsync_ms: u64,
        /// Segment size in bytes.
        #[arg(long, default_value_t = 64 << 20)]
        segment_bytes: u64,
    },
    /// Header, counts by kind, time range and losses of a log.
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
    /// Check the invariants; exit 1 naming the first violation, 2 if the
    /// log is damaged.
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

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
}

/// A progress bar on stderr when it is a terminal (nothing otherwise, so
/// logs and pipes stay clean).
struct Progress {
    on: bool,
    total: u64,
}

impl Progress {
    fn new(total: u64) -> Self {
        Progress {
            on: std::io::stderr().is_terminal(),
            total,
        }
    }

    /// `[=====>     ]  45%  123456/274000 reading`
    fn line(&self, what: &str, n: u64) -> String {
        const WIDTH: u64 = 30;
        if self.total == 0 {
            return format!("{what}: {n} events");
        }
        let n = n.min(self.total);
        let filled = (n * WIDTH / self.total) as usize;
        let bar: String = (0..WIDTH as usize)
            .map(|i| match i.cmp(&filled) {
                std::cmp::Ordering::Less => '=',
                std::cmp::Ordering::Equal => '>',
                std::cmp::Ordering::Greater => ' ',
            })
            .collect();
        format!(
            "[{bar}] {:>3}%  {n}/{} {what}",
            n * 100 / self.total,
            self.total
        )
    }

    fn tick(&self, what: &str, n: u64) {
        if self.on {
            eprint!("\r{}", self.line(what, n));
        }
    }

    fn done(&self) {
        if self.on {
            eprint!("\r\x1b[K");
        }
    }
}

/// Reads a log; damage becomes an error for commands that need it all.
fn load(dir: &Path) -> Result<(Vec<Event>, Option<String>)> {
    let total = recorder::open_log(dir)
        .map(|r| r.info().total_records)
        .unwrap_or(0);
    let p = Progress::new(total);
    let read = recorder::read_events(dir, |n| p.tick("events read", n))
        .with_context(|| format!("opening log {}", dir.display()))?;
    p.done();
    Ok((read.events, read.damage.map(|d| d.to_string())))
}

fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Record {
            out,
            from: Some(url),
            replay_endpoint,
            token: _,
            events,
            duration_s,
            fsync,
            fsync_ms,
            segment_bytes,
            ..
        } if kvbm_ingest::vllm::is_zmq_url(&url) => record_from_zmq(
            &url,
            replay_endpoint.as_deref(),
            &out,
            RemoteLimits {
                token: None,
                events,
                duration_s,
                since: 0,
            },
            log_config(fsync, fsync_ms, segment_bytes),
        ),
        Command::Record {
            out,
            from: Some(url),
            replay_endpoint,
            token,
            events,
            duration_s,
            since,
            fsync,
            fsync_ms,
            segment_bytes,
            ..
        } => {
            if replay_endpoint.is_some() {
                bail!("--replay-endpoint is for a zmq:// source");
            }
            record_from(
                &url,
                &out,
                RemoteLimits {
                    token,
                    events,
                    duration_s,
                    since: since.unwrap_or(0),
                },
                log_config(fsync, fsync_ms, segment_bytes),
            )
        }
        Command::Record {
            out,
            from: None,
            replay_endpoint: _,
            token: _,
            events: _,
            duration_s: _,
            since: _,
            trace,
            scenario,
            max_requests,
            requests,
            rate,
            prompt_len,
            output_len,
            seed,
            block_size,
            device_capacity_tokens,
            host_capacity_tokens,
            disk_capacity_tokens,
            lazy,
            fsync,
            fsync_ms,
            segment_bytes,
        } => {
            let walkthrough = matches!(scenario, Some(Scenario::Walkthrough));
            let workload = match trace {
                _ if walkthrough => {
                    let a: Vec<u32> = (100..132).collect();
                    let mut b = a.clone();
                    b.extend(200..217);
                    let spec =
                        |id: &str, at: f64, prompt: Vec<u32>| kvbm_sim::workload::RequestSpec {
                            id: id.into(),
                            arrival_ms: at,
                            prompt,
                            output_len: 1,
                            origin: kvbm_sim::workload::Origin::Synthetic {
                                index: 0,
                                shared_prefix: None,
                            },
                        };
                    vec![spec("A", 0.0, a), spec("B", 10_000.0, b)]
                }
                Some(path) => {
                    let f = std::fs::File::open(&path)
                        .with_context(|| format!("opening trace {}", path.display()))?;
                    let r = parse_mooncake_lenient(
                        std::io::BufReader::new(f),
                        &MooncakeOptions {
                            max_requests,
                            ..MooncakeOptions::default()
                        },
                    )?;
                    for s in r.skipped.iter().take(5) {
                        eprintln!("warning: line {} skipped: {}", s.line, s.error);
                    }
                    r.requests
                }
                None => generate(&SyntheticConfig {
                    seed,
                    num_requests: requests,
                    arrival_rate_per_s: rate,
                    prompt_len: LengthDist::LogNormal {
                        mean: prompt_len as f64,
                        sigma: 0.5,
                    },
                    output_len: LengthDist::LogNormal {
                        mean: output_len as f64,
                        sigma: 0.5,
                    },
                    shared_prefix_ratio: 0.5,
                    num_shared_prefixes: 4,
                    shared_prefix_len: prompt_len / 2,
                    ..SyntheticConfig::default()
                })?,
            };
            let (block_size, device_capacity_tokens, host_capacity_tokens) = if walkthrough {
                // Seed 002: 16-token blocks, 100 device blocks, 50 host blocks.
                (16, 1600, 800)
            } else {
                (block_size, device_capacity_tokens, host_capacity_tokens)
            };
            let cfg = SimConfig {
                block_size,
                device_capacity_tokens,
                host_capacity_tokens,
                disk_capacity_tokens,
                device_prefix_cache: !walkthrough,
                offload_mode: if lazy {
                    OffloadMode::Lazy
                } else {
                    OffloadMode::Eager
                },
                ..SimConfig::default()
            };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            let sim = Simulator::new(cfg, workload, rt.handle())?;
            let tap = sim
                .emitter()
                .bus()
                .take_tap()
                .context("the simulator's tap was already taken")?;
            let mut rcfg = RecorderConfig {
                log: log_config(fsync, fsync_ms, segment_bytes),
                ..RecorderConfig::default()
            };
            rcfg.log.engine_id = u64::from(sim.emitter().engine());
            let handle = recorder::spawn_recorder(tap, out.clone(), rcfg, None)?;
            let report = sim.run();
            drop(rt); // closes the bus: the recorder drains and stops
            let rec = handle
                .join()
                .map_err(|_| anyhow::anyhow!("the recorder thread panicked"))??;
            println!(
                "recorded {} events ({} lost) from {} requests into {}",
                rec.events,
                rec.lost,
                report.requests_finished,
                out.display()
            );
            Ok(0)
        }
        Command::Inspect { log, json } => {
            let reader = recorder::open_log(&log)
                .with_context(|| format!("opening log {}", log.display()))?;
            let info = reader.info().clone();
            let (events, damage) = load(&log)?;
            let st = kvbm_events::reducer::fold(&events);
            let counts: Vec<(&str, u64)> = st.counts_by_kind().filter(|(_, n)| *n > 0).collect();
            let side = recorder::read_sidecar(&log);
            let v = serde_json::json!({
                "dir": log,
                "engine": info.header.as_ref().map(|h| h.engine_id),
                "schema_version": info.header.as_ref().map(|h| h.schema_version),
                "segments": info.segments.len(),
                "events": events.len(),
                "first_seq": info.first_seq,
                "last_seq": info.last_seq,
                "time_range_ns": info.time_range_ns,
                "counts_by_kind": counts.iter().map(|(k, n)| (k.to_string(), *n)).collect::<std::collections::BTreeMap<_, _>>(),
                "lost": side.as_ref().map_or(0, |s| s.lost),
                "seq_gaps": st.seq_gaps(),
                "torn_tail_bytes": info.torn_tail_bytes,
                "damage": damage,
            });
            if json {
                println!("{v}");
            } else {
                println!("log           {}", log.display());
                println!("segments      {}", info.segments.len());
                println!("events        {}", events.len());
                println!("seq           {:?} ..= {:?}", info.first_seq, info.last_seq);
                if let Some((a, b)) = info.time_range_ns {
                    println!(
                        "time          {:.3} s .. {:.3} s",
                        a as f64 / 1e9,
                        b as f64 / 1e9
                    );
                }
                println!(
                    "lost          {} (tap), {} (seq gaps)",
                    v["lost"],
                    st.seq_gaps()
                );
                println!("torn tail     {} bytes", info.torn_tail_bytes);
                if let Some(d) = &damage {
                    println!("damage        {d}");
                }
                for (k, n) in counts {
                    println!("  {k:<20} {n}");
                }
            }
            Ok(0)
        }
        Command::Replay {
            log,
            speed,
            until_seq,
            verbose,
        } => {
            let (events, damage) = load(&log)?;
            let mode = match speed {
                Some(s) if !(s.is_finite() && s > 0.0) => {
                    bail!("--speed must be a positive number")
                }
                Some(s) => ReplayMode::RealTime { speed: s },
                None => ReplayMode::AsFastAsPossible,
            };
            let mut r = Replayer::from_events(events, mode);
            let mut n = 0u64;
            while let Some(ev) = r.next_event() {
                if verbose {
                    println!("{} {} {:?} {:?}", ev.seq, ev.ts_ns, ev.request, ev.kind);
                }
                n += 1;
                if until_seq.is_some_and(|u| ev.seq >= u) {
                    break;
                }
            }
            println!("replayed {n} events");
            println!("{}", r.state().summary());
            if let Some(d) = damage {
                eprintln!("stopped early: {d}");
                return Ok(2);
            }
            Ok(0)
        }
        Command::Check { log } => {
            let (events, damage) = load(&log)?;
            let side = recorder::read_sidecar(&log);
            // A recording from an attach server stops while the engine
            // runs on: transfers still in flight at its end are not lost.
            let complete = damage.is_none() && sidecar_stream_complete(&log);
            let report = recorder::check_recording(&events, side.as_ref(), complete);
            if let Some(d) = damage {
                println!("damaged log: {d}");
                return Ok(2);
            }
            match report.first_violation() {
                None => {
                    println!("ok: {} events, invariants hold", events.len());
                    Ok(0)
                }
                Some(v) => {
                    println!("violation ({} in all): {v}", report.violation_count());
                    Ok(1)
                }
            }
        }
        Command::Stats { log, json } => {
            let (events, _) = load(&log)?;
            let s = analysis::stats::stats(&events, analysis::StatsConfig::default())?;
            if json {
                println!("{}", serde_json::to_string(&s)?);
            } else {
                println!("{s}");
            }
            Ok(0)
        }
        Command::Export { log, format, out } => {
            let (events, damage) = load(&log)?;
            let sink: Box<dyn Write> = match &out {
                Some(p) => Box::new(
                    std::fs::File::create(p)
                        .with_context(|| format!("creating {}", p.display()))?,
                ),
                None => Box::new(std::io::stdout().lock()),
            };
            let mut w = BufWriter::new(sink);
            match format {
                Format::Jsonl => analysis::export::write_jsonl(&events, &mut w)?,
                Format::Chrome => analysis::export::write_chrome_trace(
                    &events,
                    &mut w,
                    analysis::ChromeOptions::default(),
                )?,
            };
            w.flush()?;
            if let Some(d) = damage {
                eprintln!("warning: the log is damaged; exported what came before: {d}");
            }
            Ok(0)
        }
        Command::Diff { a, b } => {
            let (ea, _) = load(&a)?;
            let (eb, _) = load(&b)?;
            match analysis::diff(&ea, &eb, &analysis::DiffOptions::default()) {
                None => {
                    println!("no divergence ({} events each)", ea.len());
                    Ok(0)
                }
                Some(d) => {
                    println!("{d}");
                    Ok(1)
                }
            }
        }
    }
}

fn log_config(fsync: Fsync, fsync_ms: u64, segment_bytes: u64) -> LogConfig {
    LogConfig {
        segment_bytes,
        fsync: match fsync {
            Fsync::Every => FsyncPolicy::EveryRecord,
            Fsync::Interval => FsyncPolicy::Interval(Duration::from_millis(fsync_ms)),
            Fsync::Never => FsyncPolicy::Never,
        },
        ..RecorderConfig::default().log
    }
}

/// The sidecar key a remote recording sets to `false`: the stream was cut
/// while the engine ran on (absent: complete, as for an in-process run).
const STREAM_COMPLETE_KEY: &str = "stream_complete";

fn sidecar_stream_complete(dir: &Path) -> bool {
    std::fs::read(dir.join(recorder::SIDECAR))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.get(STREAM_COMPLETE_KEY)?.as_bool())
        .unwrap_or(true)
}

/// When `record --from` stops.
struct RemoteLimits {
    token: Option<String>,
    events: Option<u64>,
    duration_s: Option<f64>,
    since: u64,
}

/// The log being written from a remote stream: the same writer, snapshots
/// and sidecar as the in-process recorder.
struct RemoteLog {
    writer: LogWriter,
    state: EngineState,
    rec: Recording,
    since_snapshot: u64,
    snapshot_every: u64,
    /// Events the server no longer held when the recording started (a gap
    /// before the first event written): not a loss inside the recording.
    missed_before_start: u64,
}

impl RemoteLog {
    fn create(dir: &Path, mut cfg: LogConfig, engine: u32) -> Result<Self> {
        cfg.engine_id = u64::from(engine);
        let writer = LogWriter::create(dir, cfg.clone())
            .with_context(|| format!("creating log {}", dir.display()))?;
        Ok(RemoteLog {
            writer,
            state: EngineState::default(),
            rec: Recording {
                engine,
                schema_version: cfg.schema_version,
                ..Recording::default()
            },
            since_snapshot: 0,
            snapshot_every: RecorderConfig::default().snapshot_every_events,
            missed_before_start: 0,
        })
    }

    fn append(&mut self, ev: &Event) -> Result<()> {
        self.writer.append(ev)?;
        let rec = &mut self.rec;
        rec.events += 1;
        rec.first_seq.get_or_insert(ev.seq);
        rec.last_seq = Some(ev.seq);
        self.state.apply(ev);
        self.since_snapshot += 1;
        if self.snapshot_every > 0 && self.since_snapshot >= self.snapshot_every {
            self.since_snapshot = 0;
            if let Ok(json) = serde_json::to_vec(&self.state)
                && self.writer.write_snapshot(ev.seq, ev.ts_ns, &json).is_ok()
            {
                self.rec.snapshots += 1;
            }
        }
        Ok(())
    }

    fn gap(&mut self, dropped: u64) {
        let rec = &mut self.rec;
        if rec.last_seq.is_none() {
            self.missed_before_start += dropped;
            return;
        }
        rec.lost += dropped;
        if rec.gaps.len() < recorder::MAX_GAPS {
            rec.gaps.push(GapAt {
                after_seq: rec.last_seq,
                dropped,
            });
        } else if let Some(last) = rec.gaps.last_mut() {
            last.dropped += dropped;
        }
    }

    fn finish(
        self,
        dir: &Path,
        url: &str,
        counters: serde_json::Value,
    ) -> Result<(Recording, u64)> {
        let closed = self.writer.close();
        let mut v = serde_json::to_value(&self.rec)?;
        if let Some(o) = v.as_object_mut() {
            o.insert("source".into(), url.into());
            o.insert(STREAM_COMPLETE_KEY.into(), false.into());
            o.insert(
                "missed_before_start".into(),
                self.missed_before_start.into(),
            );
            o.insert("client".into(), counters);
        }
        let path = dir.join(recorder::SIDECAR);
        std::fs::write(&path, serde_json::to_vec_pretty(&v)?)
            .with_context(|| format!("writing {}", path.display()))?;
        closed?;
        Ok((self.rec, self.missed_before_start))
    }
}

/// `record --from URL`: records a running engine through its attach
/// server until Ctrl-C or a limit.
fn record_from(url: &str, out: &Path, limits: RemoteLimits, log: LogConfig) -> Result<i32> {
    let mut cfg = ClientConfig::new(url)?.with_since(limits.since);
    cfg.token = limits.token;
    if let Some(d) = limits.duration_s
        && !(d.is_finite() && d > 0.0)
    {
        bail!("--duration-s must be a positive number");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut client = Client::spawn(cfg, rt.handle())?;
    let handle = client.handle();
    let deadline = deadline_of(limits.duration_s);
    let mut log_out: Option<RemoteLog> = None;
    let outcome: Result<&str> = rt.block_on(async {
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        let until = stop_at(deadline);
        tokio::pin!(until);
        let mut flush = tokio::time::interval(Duration::from_millis(50));
        loop {
            tokio::select! {
                ev = client.recv() => match ev {
                    None => return Ok("the client stopped"),
                    Some(ClientEvent::Connected(h)) => {
                        eprintln!(
                            "connected to {url} (engine {}, holding seq {:?}..={:?})",
                            h.engine, h.first_seq, h.last_seq
                        );
                        match &log_out {
                            None => log_out = Some(RemoteLog::create(out, log.clone(), h.engine)?),
                            Some(l) if l.rec.engine != h.engine => bail!(
                                "the server now serves engine {}, not engine {}",
                                h.engine,
                                l.rec.engine
                            ),
                            Some(_) => {}
                        }
                    }
                    Some(ClientEvent::Events(events)) => {
                        let Some(l) = log_out.as_mut() else {
                            bail!("events before the server's hello");
                        };
                        for ev in &events {
                            l.append(ev)?;
                            if limits.events.is_some_and(|n| l.rec.events >= n) {
                                return Ok("--events reached");
                            }
                        }
                    }
                    Some(ClientEvent::Gap(g)) => {
                        eprintln!(
                            "gap: events {}..={} will not arrive ({:?}{})",
                            g.from_seq,
                            g.to_seq,
                            g.reason,
                            if g.announced { "" } else { ", unannounced" }
                        );
                        if let Some(l) = log_out.as_mut() {
                            l.gap(g.len());
                        }
                    }
                    Some(ClientEvent::Disconnected { error, failures, retry_in }) => {
                        eprintln!(
                            "disconnected ({error}); retry {} in {:.1} s",
                            failures + 1,
                            retry_in.as_secs_f64()
                        );
                    }
                    Some(ClientEvent::Failed(e)) => return Err(e.into()),
                    Some(ClientEvent::Live | ClientEvent::Breakpoints(_)) => {}
                },
                _ = &mut until => return Ok("--duration-s reached"),
                _ = &mut ctrl_c => return Ok("interrupted"),
                _ = flush.tick() => {
                    if let Some(l) = log_out.as_mut() {
                        l.writer.flush()?;
                    }
                }
            }
        }
    });
    drop(client);
    let counters = handle.counters();
    let Some(l) = log_out else {
        outcome?;
        bail!("never connected to {url}; nothing recorded");
    };
    let (rec, missed) = l.finish(out, url, serde_json::to_value(counters)?)?;
    let why = outcome?;
    println!(
        "recorded {} events ({} lost in gaps, {} duplicates dropped, {} reconnections) from {url} into {} ({why})",
        rec.events,
        rec.lost,
        counters.duplicates,
        counters.connects.saturating_sub(1),
        out.display()
    );
    if missed > 0 {
        println!(
            "the server no longer held the {missed} events before seq {:?}",
            rec.first_seq
        );
    }
    Ok(0)
}

/// `record --from zmq://HOST:PORT`: records vLLM's KV-event stream until
/// Ctrl-C or a limit. Engine id 0; the publisher's unrecovered gaps are the
/// sidecar's losses (in publisher batches), its counters the sidecar's
/// `client`.
fn record_from_zmq(
    url: &str,
    replay: Option<&str>,
    out: &Path,
    limits: RemoteLimits,
    log: LogConfig,
) -> Result<i32> {
    use kvbm_ingest::vllm::{ZmqConfig, ZmqEndpoint, ZmqItem, ZmqSource};
    let endpoint = ZmqEndpoint::parse(url).map_err(anyhow::Error::msg)?;
    let mut cfg = ZmqConfig::new(endpoint);
    cfg.replay = replay
        .map(ZmqEndpoint::parse)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    if let Some(d) = limits.duration_s
        && !(d.is_finite() && d > 0.0)
    {
        bail!("--duration-s must be a positive number");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut l = RemoteLog::create(out, log, cfg.translator.engine)?;
    let mut src = ZmqSource::spawn(cfg, rt.handle());
    let handle = src.handle();
    let deadline = deadline_of(limits.duration_s);
    eprintln!("subscribing to {url}");
    let outcome: Result<&str> = rt.block_on(async {
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        let until = stop_at(deadline);
        tokio::pin!(until);
        let mut flush = tokio::time::interval(Duration::from_millis(50));
        loop {
            tokio::select! {
                item = src.recv() => match item {
                    None => return Ok("the source stopped"),
                    Some(ZmqItem::Events(events)) => {
                        for ev in &events {
                            l.append(ev)?;
                            if limits.events.is_some_and(|n| l.rec.events >= n) {
                                return Ok("--events reached");
                            }
                        }
                    }
                    Some(g @ ZmqItem::Gap { .. }) => {
                        if let ZmqItem::Gap { from_seq, to_seq } = g {
                            eprintln!("gap: publisher batches {from_seq}..={to_seq} missed");
                        }
                        // Counted as lost even before the first event: the
                        // publisher's seq says they existed.
                        l.rec.lost += g.missed();
                        if l.rec.gaps.len() < recorder::MAX_GAPS {
                            l.rec.gaps.push(GapAt {
                                after_seq: l.rec.last_seq,
                                dropped: g.missed(),
                            });
                        }
                    }
                    Some(ZmqItem::Restart { last_seq, new_seq }) => {
                        eprintln!("publisher restarted (seq {last_seq} then {new_seq}); its live blocks are evicted");
                    }
                },
                _ = &mut until => return Ok("--duration-s reached"),
                _ = &mut ctrl_c => return Ok("interrupted"),
                _ = flush.tick() => l.writer.flush()?,
            }
        }
    });
    drop(src);
    let counters = handle.counters();
    let (rec, _) = l.finish(out, url, serde_json::to_value(&counters)?)?;
    let why = outcome?;
    println!(
        "recorded {} events ({} publisher batches lost in {} gaps, {} replayed, {} malformed, {} restarts) from {url} into {} ({why})",
        rec.events,
        rec.lost,
        counters.gaps,
        counters.replayed,
        counters.malformed,
        counters.restarts,
        out.display()
    );
    Ok(0)
}

/// When `--duration-s` runs out, counted from now.
fn deadline_of(duration_s: Option<f64>) -> Option<tokio::time::Instant> {
    duration_s.map(|d| tokio::time::Instant::now() + Duration::from_secs_f64(d))
}

/// Resolves at `deadline`, or never without one.
async fn stop_at(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::Progress;

    #[test]
    fn progress_bar_draws_the_fraction_done() {
        let p = Progress {
            on: false,
            total: 200,
        };
        assert_eq!(
            p.line("events read", 100),
            format!(
                "[{}>{}]  50%  100/200 events read",
                "=".repeat(15),
                " ".repeat(14)
            )
        );
        assert!(p.line("x", 500).contains("100%  200/200"));
        let unknown = Progress {
            on: false,
            total: 0,
        };
        assert_eq!(unknown.line("reading", 7), "reading: 7 events");
    }
}
