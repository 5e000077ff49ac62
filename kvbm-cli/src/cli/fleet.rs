//! The fleet's commands: `record --from nats://…` (every engine of the
//! stream into one fleet recording, resumable), `bridge` (an engine we do
//! not run, from vLLM's ZMQ stream onto NATS), and `inspect`, `check`,
//! `stats` and `export` of a fleet recording (per engine and for the
//! fleet).

use super::{Format, RemoteArgs};
use crate::shards::{Replies, Reply, Shards, Work};
use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use kvbm_attach::nats::async_nats;
use kvbm_attach::nats::async_nats::jetstream::AckKind;
use kvbm_attach::nats::async_nats::jetstream::consumer::pull::MessagesError;
use kvbm_attach::nats::consume::{self, DurableConfig, EngineFilter};
use kvbm_attach::nats::publish::{Publisher, PublisherConfig};
use kvbm_attach::nats::waits::DeliveryWaits;
use kvbm_attach::nats::{StreamLimits, connect};
use kvbm_events::Event;
use kvbm_recorder::analysis;
use kvbm_recorder::cpu::{self, CpuSum};
use kvbm_recorder::fleet::{self, FleetWriter};
use kvbm_recorder::log::LogConfig;
use kvbm_recorder::recorder::RecorderConfig;
use kvbm_recorder::verdict;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The durable consumer's name unless `--consumer` names another.
const RECORDER_CONSUMER: &str = "kvbm-recorder";
/// Messages taken from the consumer at a time, at most.
const ROUTE_CHUNK: usize = 256;
/// How often the recorder checkpoints and acknowledges.
const COMMIT_EVERY: Duration = Duration::from_millis(200);
/// … or after this many messages.
const COMMIT_MESSAGES: u64 = 10_000;
/// Messages held for `--handoff-batch` are handed over after this long
/// at most.
const HANDOFF_AFTER: Duration = Duration::from_millis(1);

/// The fleet commands' runtime; `cpu`, if given, gets each of its
/// threads' CPU time as the thread ends (the runtime's drop ends them).
fn runtime(cpu: Option<Arc<CpuSum>>) -> Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.worker_threads(2).enable_all();
    if let Some(sum) = cpu {
        b.on_thread_stop(move || sum.add_this_thread());
    }
    Ok(b.build()?)
}

/// Resolves on SIGINT or SIGTERM.
async fn interrupted() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

/// `record --from nats://HOST:PORT`: every engine (or those `--engines`
/// names) into the fleet recording `out`, created or resumed.
pub fn record_nats(url: &str, out: &Path, remote: &RemoteArgs, log: LogConfig) -> Result<i32> {
    kvbm_attach::nats::check_url(url)?;
    let (filter, consumer, resuming) = nats_source(out, remote)?;
    // What the recording and the screen keep of the URL: never its
    // credentials.
    let shown = kvbm_attach::nats::redacted(url);
    let mut writer = FleetWriter::open(
        out,
        &shown,
        Some(&consumer),
        RecorderConfig {
            log,
            ..RecorderConfig::default()
        },
    )
    .with_context(|| format!("opening fleet recording {}", out.display()))?;
    if resuming {
        eprintln!(
            "resuming {} ({} logs) with consumer {consumer}",
            out.display(),
            writer.manifest().logs.len()
        );
    }
    // The receiving thread only routes, so a writer thread per CPU.
    let threads = remote.writer_threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 8)),
        usize::from,
    );
    let close_idle =
        (remote.close_idle_logs_s > 0.0).then(|| Duration::from_secs_f64(remote.close_idle_logs_s));
    writer.set_close_idle_after(close_idle);
    // With nothing arriving, a checkpoint a quarter of that apart closes
    // each idle log within a quarter of the time after it is due.
    let idle_sweep = close_idle.map(|d| (d / 4).max(COMMIT_EVERY));
    let (base, shards) = writer.into_shards(threads);
    let work = if remote.receive_only {
        Work::CountOnly
    } else {
        Work::Record
    };
    let (mut shards, replies) = Shards::start(shards, usize::from(remote.writer_queue), work)?;
    shards.set_handoff_batch(usize::from(remote.handoff_batch));
    let counters = shards.counters();
    // Where the CPU goes, by thread: the runtime's threads and this one
    // (in block_on) receive and route, the runtime's also run the
    // checkpoints' fsyncs (timed apart); the writer threads check and
    // write.
    let runtime_cpu = Arc::new(CpuSum::default());
    let rt = runtime(Some(runtime_cpu.clone()))?;
    let stops = Stops {
        deadline: remote
            .duration_s
            .map(|d| Instant::now() + Duration::from_secs_f64(d)),
        idle: remote.idle_exit_s.map(Duration::from_secs_f64),
        idle_sweep,
        events: remote.events,
    };
    let mut cfg = DurableConfig::new(&consumer);
    cfg.filter = filter.clone();
    cfg.limits = StreamLimits::default();
    cfg.pull_batch = usize::from(remote.pull_batch);
    let commits = Commits::new(
        out,
        base,
        shards.len(),
        u64::try_from(cfg.max_ack_pending).unwrap_or(0),
    );
    let banner = format!(
        "recording {} from {shown} (consumer {consumer}, {threads} writer threads, hand-offs of {} messages or more, pull requests of {} messages)",
        cfg.filter.subject(),
        remote.handoff_batch,
        cfg.pull_batch
    );
    let mut receiver = Receiver {
        shards,
        replies,
        commits,
        stats: Session::default(),
        counters: counters.clone(),
        filter,
    };
    // The loop that receives and routes runs on this thread (block_on),
    // the client's connection on the runtime's.
    let loop_timer = cpu::ThreadTimer::start();
    let outcome = rt.block_on(receiver.run(url, &cfg, &banner, &stops));
    let loop_cpu = loop_timer.elapsed().unwrap_or_default();
    // Every thread of the runtime ends here, adding its CPU time.
    drop(rt);
    let closing = Instant::now();
    let (manifest, open_logs, recs) = close_shards(receiver.shards, &receiver.commits.base, out)?;
    let closing_s = closing.elapsed().as_secs_f64();
    let why = outcome?;
    let report = NatsReport {
        remote,
        shown: &shown,
        out,
        why,
        threads,
        closes_idle: close_idle.is_some(),
        logs: manifest.logs.len(),
        open_logs,
        commits: &receiver.commits,
        stats: &receiver.stats,
        counters: &counters,
        written: counters.written(),
        last_written: counters.last_written(),
        loop_cpu,
        runtime_cpu: runtime_cpu.get(),
        closing_s,
    };
    report.print(recs);
    Ok(0)
}

/// The engines `record --from nats://` takes, the durable consumer it
/// reads with, and whether `out` is a fleet recording to resume; refuses
/// the flags that do not apply to NATS and a receive-only run that would
/// acknowledge what a recorder keeps.
fn nats_source(out: &Path, remote: &RemoteArgs) -> Result<(EngineFilter, String, bool)> {
    if remote.replay_endpoint.is_some() || remote.token.is_some() || remote.since.is_some() {
        bail!("--replay-endpoint, --token and --since do not apply to a nats:// source");
    }
    let filter = match remote.engines.as_deref() {
        Some(g) => EngineFilter::glob(g)?,
        None => EngineFilter::all(),
    };
    let consumer = remote
        .consumer
        .clone()
        .unwrap_or_else(|| RECORDER_CONSUMER.into());
    let resuming = fleet::is_fleet(out);
    // A receive-only run acknowledges what it does not keep: never on a
    // recorder's consumer or recording.
    if remote.receive_only && (consumer == RECORDER_CONSUMER || resuming) {
        bail!(
            "--receive-only keeps nothing it acknowledges: give it a --consumer of its own (not {RECORDER_CONSUMER}) and a new --out"
        );
    }
    Ok((filter, consumer, resuming))
}

/// Stops the writer threads and writes the manifest merged from their
/// parts; returns it, their logs' counts and their recordings by
/// directory name, sorted.
#[allow(clippy::type_complexity)]
fn close_shards(
    shards: Shards,
    base: &fleet::FleetManifest,
    out: &Path,
) -> Result<(
    fleet::FleetManifest,
    fleet::OpenLogs,
    Vec<(String, kvbm_recorder::recorder::Recording)>,
)> {
    let mut open_logs = fleet::OpenLogs::default();
    let (parts, recs): (Vec<_>, Vec<_>) = shards
        .finish()?
        .into_iter()
        .map(|e| {
            open_logs.add(e.open_logs);
            (e.manifest, e.recordings)
        })
        .unzip();
    let manifest = fleet::merge_manifests(base, &parts);
    let mut recs: Vec<_> = recs.into_iter().flatten().collect();
    recs.sort_by(|a, b| a.0.cmp(&b.0));
    fleet::write_manifest(out, &manifest)?;
    Ok((manifest, open_logs, recs))
}

/// When the receiving loop stops or checkpoints of itself, from the
/// command's flags.
struct Stops {
    /// `--duration-s` from the start.
    deadline: Option<Instant>,
    /// `--idle-exit-s`: this long without a delivery.
    idle: Option<Duration>,
    /// A checkpoint at least this often, so idle logs close.
    idle_sweep: Option<Duration>,
    /// `--events`: this many written.
    events: Option<u64>,
}

/// The loop that receives and routes, and what it works on: the writer
/// threads, their replies, the checkpoints and the session's counts.
struct Receiver {
    shards: Shards,
    replies: Replies,
    commits: Commits,
    stats: Session,
    counters: Arc<crate::shards::Counters>,
    /// The engines taken; the others' messages are acknowledged unkept.
    filter: EngineFilter,
}

impl Receiver {
    /// Connects, receives and routes until one of `stops`, the consumer's
    /// end or a signal; then everything routed is written, checkpointed
    /// and acknowledged. Returns why it stopped.
    async fn run(
        &mut self,
        url: &str,
        cfg: &DurableConfig,
        banner: &str,
        stops: &Stops,
    ) -> Result<&'static str> {
        let client = connect(url, "kvbm-recorder").await?;
        let js = async_nats::jetstream::new(client.clone());
        let mut messages = DeliveryWaits::new(
            consume::durable_messages(&js, cfg)
                .await?
                .ready_chunks(ROUTE_CHUNK),
        );
        eprintln!("{banner}");
        let stop = interrupted();
        tokio::pin!(stop);
        let mut tick = tokio::time::interval(COMMIT_EVERY);
        let mut handoff_tick = tokio::time::interval(HANDOFF_AFTER);
        handoff_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_delivery = Instant::now();
        let why = loop {
            tokio::select! {
                // Every message delivered and not yet taken, at most
                // ROUTE_CHUNK: each writer thread gets its share of them in
                // one hand-off. None while a thread's full queue holds a
                // backlog: JetStream keeps the rest meanwhile.
                chunk = messages.next(), if !self.shards.backlogged() => {
                    let Some(chunk) = chunk else { break "the consumer ended" };
                    self.route(chunk, &mut last_delivery)?;
                    if self.commits.pending >= COMMIT_MESSAGES {
                        self.commits.begin(&mut self.shards).await?;
                    }
                },
                // Room for a backlog; the replies and acknowledgements
                // go on meanwhile.
                room = self.shards.unblock(), if self.shards.backlogged() => room?,
                // Messages held for --handoff-batch go after a
                // millisecond at most.
                _ = handoff_tick.tick(), if self.shards.holds() => {
                    let routing = Instant::now();
                    self.shards.flush()?;
                    self.stats.routing += routing.elapsed();
                }
                Some(reply) = self.replies.next(), if self.commits.awaiting_replies() => {
                    self.commits.reply(reply)?;
                }
                done = self.commits.wait_durable(), if self.commits.syncing() => {
                    done?;
                    self.commits.acknowledge(&mut self.stats).await?;
                }
                () = self.counters.written_reaches(stops.events.unwrap_or(u64::MAX)),
                    if stops.events.is_some() => break "--events reached",
                _ = tick.tick() => {
                    if let Some(why) = self.on_tick(stops, last_delivery).await? {
                        break why;
                    }
                }
                _ = &mut stop => break "interrupted",
            }
        };
        self.stats.delivery_waits = (messages.times(), messages.waited());
        // Everything routed is written, checkpointed and acknowledged.
        self.commits
            .finish(&mut self.shards, &mut self.replies, &mut self.stats)
            .await?;
        let _ = client.flush().await;
        Ok(why)
    }

    /// Hands each message of `chunk` to its engine's writer thread (or
    /// counts it filtered out) and notes it for the next checkpoint.
    fn route(
        &mut self,
        chunk: Vec<Result<async_nats::jetstream::Message, MessagesError>>,
        last_delivery: &mut Instant,
    ) -> Result<()> {
        let stats = &mut self.stats;
        let mut by_thread: Vec<Vec<_>> = vec![Vec::new(); self.shards.len()];
        for m in chunk {
            let msg = match m {
                Ok(msg) => msg,
                Err(e) => {
                    // Heartbeats missed while the server
                    // restarts, and the like: the stream goes on.
                    stats.consumer_errors += 1;
                    tracing::warn!("consumer: {e}");
                    continue;
                }
            };
            *last_delivery = Instant::now();
            stats.first_delivery.get_or_insert(*last_delivery);
            stats.last_delivery = Some(*last_delivery);
            stats.messages += 1;
            let stream_seq = msg.info().map_or(0, |i| i.stream_sequence);
            let (msg, acker) = msg.split();
            let engine = kvbm_attach::nats::engine_of_subject(msg.subject.as_str());
            if engine.is_some_and(|e| !self.filter.matches(e)) {
                stats.filtered += 1;
            } else {
                by_thread[self.shards.thread_of(engine)].push((msg, stream_seq));
            }
            self.commits.delivered(acker, stream_seq);
        }
        let routing = Instant::now();
        self.shards.route(by_thread)?;
        stats.routing += routing.elapsed();
        Ok(())
    }

    /// The periodic tick: a checkpoint if anything is pending or idle logs
    /// are due a sweep; then why the loop stops, if `--duration-s` or
    /// `--idle-exit-s` is reached.
    async fn on_tick(
        &mut self,
        stops: &Stops,
        last_delivery: Instant,
    ) -> Result<Option<&'static str>> {
        // Logs close for want of events at checkpoints, so a
        // fleet gone quiet still has one now and then.
        let sweep = stops
            .idle_sweep
            .is_some_and(|d| self.commits.last_begun.elapsed() >= d);
        if self.commits.pending > 0 || sweep {
            self.commits.begin(&mut self.shards).await?;
        }
        if stops.deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(Some("--duration-s reached"));
        }
        if stops.idle.is_some_and(|i| last_delivery.elapsed() >= i) {
            return Ok(Some("--idle-exit-s reached"));
        }
        Ok(None)
    }
}

/// What `record --from nats://` prints as it ends: the session's totals,
/// what bounded it, where the CPU went, its rates and each log.
struct NatsReport<'a> {
    remote: &'a RemoteArgs,
    shown: &'a str,
    out: &'a Path,
    why: &'a str,
    threads: usize,
    /// Whether `--close-idle-logs-s` closes idle logs.
    closes_idle: bool,
    /// Logs in the manifest.
    logs: usize,
    open_logs: fleet::OpenLogs,
    commits: &'a Commits,
    stats: &'a Session,
    counters: &'a crate::shards::Counters,
    written: u64,
    last_written: Option<Instant>,
    /// CPU time of the loop's thread.
    loop_cpu: Duration,
    /// CPU time of the runtime's threads.
    runtime_cpu: Duration,
    closing_s: f64,
}

impl NatsReport<'_> {
    fn print(&self, recs: Vec<(String, kvbm_recorder::recorder::Recording)>) {
        self.print_totals();
        self.print_bounds();
        self.print_cpu();
        self.print_rates();
        for (name, rec) in recs {
            println!(
                "  {name:<24} {} events, {}, {} missing",
                rec.events,
                verdict::seq_span(rec.first_seq, rec.last_seq),
                rec.lost + rec.missed_before_start
            );
        }
    }

    /// Events recorded (or counted), messages delivered and logs open.
    fn print_totals(&self) {
        let (remote, stats, shown, why, written) =
            (self.remote, self.stats, self.shown, self.why, self.written);
        let (duplicates, refused) = (self.counters.duplicates(), self.counters.refused());
        if remote.receive_only {
            println!(
                "received {written} events in this session, counted and not recorded (--receive-only; {refused} messages without a header, {} acknowledged) from {shown} ({why})",
                stats.acked,
            );
        } else {
            println!(
                "recorded {written} events in this session ({duplicates} duplicates skipped, {refused} messages refused, {} acknowledged) from {shown} into {} ({} logs; {why})",
                stats.acked,
                self.out.display(),
                self.logs
            );
        }
        println!(
            "  {} messages delivered ({} of engines not taken), {} consumer errors, {} acknowledgements lost (redelivered, skipped as duplicates), {} writer threads",
            stats.messages, stats.filtered, stats.consumer_errors, stats.acks_lost, self.threads
        );
        if !remote.receive_only {
            let open_logs = &self.open_logs;
            if self.closes_idle {
                println!(
                    "  {} logs open at the end, {} closed after {} s without events, {} of them reopened",
                    open_logs.open,
                    open_logs.closed_idle,
                    remote.close_idle_logs_s,
                    open_logs.reopened
                );
            } else {
                println!(
                    "  {} logs open at the end (--close-idle-logs-s 0: none closed before)",
                    open_logs.open
                );
            }
        }
    }

    /// What held the recorder back: the consumer's limit, the server, a
    /// writer thread's full queue, the hand-offs.
    fn print_bounds(&self) {
        let (stats, counters) = (self.stats, self.counters);
        // Time the server held messages back for want of acknowledgements:
        // checkpoints, not the writers, were then the bound.
        let limit = &self.commits.ack_limit;
        let held = limit.held + limit.since.map_or(Duration::ZERO, |t| t.elapsed());
        println!(
            "  at the consumer's limit of {} unacknowledged messages {} times, {:.3} s in all",
            limit.limit,
            limit.times,
            held.as_secs_f64()
        );
        // Time the loop had nothing to route and waited for the server (or
        // the connection): neither the writers nor the loop were the bound
        // then. The wait after the last message is not counted.
        if let (Some(first), Some(last)) = (stats.first_delivery, stats.last_delivery) {
            let (times, waited) = stats.delivery_waits;
            println!(
                "  waited for deliveries {times} times, {:.3} s in all, of {:.3} s from the first message to the last",
                waited.as_secs_f64(),
                last.saturating_duration_since(first).as_secs_f64()
            );
        }
        // Time the receiving was held back by a writer thread's full queue:
        // then a writer thread, not the server, was the bound.
        let (waits, waited) = counters.route_waits();
        println!(
            "  receiving held back by a full writer queue ({} hand-offs a thread) {waits} times, {:.3} s in all",
            self.remote.writer_queue,
            waited.as_secs_f64()
        );
        // Each time a writer thread found its queue empty, the loop's next
        // hand-off to it had to wake it: with cores to spare the threads
        // wait often, and the wakes are the loop's work, not theirs.
        let (handoffs, idle_waits) = counters.handoffs();
        println!(
            "  {handoffs} hand-offs to the writer threads, {idle_waits} of them to a thread waiting for work; handing off took {:.3} s (wall) on the loop's thread, whose CPU time was {:.3} s",
            stats.routing.as_secs_f64(),
            self.loop_cpu.as_secs_f64()
        );
    }

    /// The process's CPU time by what its threads did.
    fn print_cpu(&self) {
        let Some(all) = cpu::process_time() else {
            return;
        };
        let syncing = self.commits.sync_cpu.get();
        let receiving = (self.runtime_cpu + self.loop_cpu).saturating_sub(syncing);
        let writing = self.counters.writer_cpu();
        let per = |d: Duration| d.as_nanos() as f64 / self.written.max(1) as f64;
        // With every core busy, the recorder's rate is bound by all of it;
        // with cores to spare for the writer threads, receiving (which
        // they do not share) is what can bound it.
        println!(
            "  CPU: {:.4} s receiving and routing ({:.1} ns an event), {:.4} s {} in the writer threads ({:.1} ns an event), {:.4} s making checkpoints durable, {:.4} s elsewhere (starting, ending); {:.4} s in all ({:.1} ns an event)",
            receiving.as_secs_f64(),
            per(receiving),
            writing.as_secs_f64(),
            if self.remote.receive_only {
                "counting"
            } else {
                "checking and writing"
            },
            per(writing),
            syncing.as_secs_f64(),
            all.saturating_sub(receiving + syncing + writing)
                .as_secs_f64(),
            all.as_secs_f64(),
            per(all),
        );
    }

    /// Events a second from the first message, to the last log closed and
    /// to the last batch written, and the checkpoints' times.
    fn print_rates(&self) {
        let Some(t) = self.stats.first_delivery else {
            return;
        };
        let (stats, written) = (self.stats, self.written);
        // From the first message to every log closed: what the recorder's
        // own work costs, without its start (connecting, the consumer).
        let s = t.elapsed().as_secs_f64();
        println!(
            "  {:.3} s from the first message to the last log closed: {:.0} events/s",
            s,
            written as f64 / s.max(1e-9)
        );
        if let Some(l) = self.last_written {
            // The same without the last checkpoint and the closing (every
            // log synced and closed): the rate a recorder that runs for
            // hours keeps up with, whose closing comes once.
            let a = l.saturating_duration_since(t).as_secs_f64();
            println!(
                "  {:.3} s from the first message to the last batch written: {:.0} events/s; {} checkpoints ({} wrote the manifest: the others changed no entry; the last {:.3} s, the longest {:.3} s), closing {:.3} s",
                a,
                written as f64 / a.max(1e-9),
                stats.commits,
                self.commits.manifests_written,
                stats.last_commit.as_secs_f64(),
                stats.longest_commit.as_secs_f64(),
                self.closing_s,
            );
        }
    }
}

#[derive(Debug, Default)]
struct Session {
    messages: u64,
    filtered: u64,
    acked: u64,
    consumer_errors: u64,
    /// Checkpoints whose acknowledgement did not land.
    acks_lost: u64,
    first_delivery: Option<Instant>,
    last_delivery: Option<Instant>,
    /// Times the loop waited for a delivery after the first, and how
    /// long in all ([`DeliveryWaits`]).
    delivery_waits: (u64, Duration),
    /// The loop's time handing messages to the writer threads
    /// ([`Shards::route`], [`Shards::flush`]): the wakes of threads that
    /// waited for work are in it.
    routing: Duration,
    commits: u64,
    /// How long the last checkpoint took, from its barrier to its
    /// acknowledgement.
    last_commit: Duration,
    /// The longest checkpoint.
    longest_commit: Duration,
}

/// The recorder's commits: a barrier through the writer threads
/// ([`Shards::begin_checkpoint`]); once every thread has checkpointed, the
/// fsyncs they left and the merged manifest on a blocking thread; then the
/// last message before the barrier acknowledged (the consumer's
/// acknowledgements are cumulative). Never the other way round: an
/// acknowledged message is on disk. One barrier is in flight at a time;
/// messages go on being routed and written while it is, its fsyncs
/// included (group commit).
struct Commits {
    /// The recording's directory.
    dir: std::path::PathBuf,
    /// The manifest without the threads' logs.
    base: fleet::FleetManifest,
    threads: usize,
    /// The last message delivered, to acknowledge, and its stream seq.
    last: Option<(async_nats::jetstream::message::Acker, u64)>,
    /// Messages delivered since the last barrier.
    pending: u64,
    token: u64,
    /// The barrier in flight.
    barrier: Option<Barrier>,
    /// The server's limit of messages unacknowledged, and time spent at it.
    ack_limit: AckLimit,
    /// CPU time spent making checkpoints durable.
    sync_cpu: Arc<CpuSum>,
    /// When the last barrier was put.
    last_begun: Instant,
    /// Each thread's part of the manifest as it last sent it (a thread
    /// sends it when it changed).
    parts: Vec<Option<fleet::FleetManifest>>,
    /// Manifests written (a checkpoint where no part changed writes none).
    manifests_written: u64,
}

/// A barrier in flight: what it acknowledges once durable, the threads'
/// replies so far, and, once they are all in, its fsyncs and manifest
/// running.
struct Barrier {
    ack: Option<(async_nats::jetstream::message::Acker, u64)>,
    /// Threads that replied.
    replies: usize,
    /// Whether one of them sent a changed part of the manifest.
    changed: bool,
    syncs: fleet::Syncs,
    durable: Option<tokio::task::JoinHandle<Result<(), fleet::FleetError>>>,
    began: Instant,
    /// Messages it acknowledges.
    messages: u64,
}

/// When the server held messages back because the consumer's limit of
/// unacknowledged messages was reached: the recorder then waits for a
/// checkpoint to be durable before it receives more. Reported, so that a
/// run says whether its checkpoints bounded it.
#[derive(Debug, Default)]
struct AckLimit {
    /// The consumer's `max_ack_pending`.
    limit: u64,
    /// Messages delivered and not yet acknowledged.
    unacked: u64,
    /// Since when the limit has been reached, while it is.
    since: Option<Instant>,
    /// Times it was reached.
    times: u64,
    /// Time spent at it.
    held: Duration,
    /// Messages of checkpoints whose acknowledgement was lost: still
    /// unacknowledged for the server until a later (cumulative) one lands.
    unconfirmed: u64,
}

impl AckLimit {
    fn delivered(&mut self) {
        self.unacked += 1;
        if self.limit > 0 && self.unacked >= self.limit && self.since.is_none() {
            self.since = Some(Instant::now());
            self.times += 1;
        }
    }

    /// A checkpoint of `messages` was acknowledged, or its acknowledgement
    /// was lost (`landed` false): those stay unacknowledged until the next
    /// one lands, which covers them (the acknowledgements are cumulative).
    fn acknowledged(&mut self, messages: u64, landed: bool) {
        self.unconfirmed += messages;
        if !landed {
            return;
        }
        self.unacked = self
            .unacked
            .saturating_sub(std::mem::take(&mut self.unconfirmed));
        if self.unacked < self.limit
            && let Some(t) = self.since.take()
        {
            self.held += t.elapsed();
        }
    }
}

impl Commits {
    fn new(dir: &Path, base: fleet::FleetManifest, threads: usize, ack_limit: u64) -> Self {
        Commits {
            dir: dir.to_path_buf(),
            base,
            threads,
            last: None,
            pending: 0,
            token: 0,
            barrier: None,
            ack_limit: AckLimit {
                limit: ack_limit,
                ..AckLimit::default()
            },
            sync_cpu: Arc::default(),
            last_begun: Instant::now(),
            parts: vec![None; threads],
            manifests_written: 0,
        }
    }

    /// A barrier is waiting for the threads' replies.
    fn awaiting_replies(&self) -> bool {
        self.barrier
            .as_ref()
            .is_some_and(|b| b.replies < self.threads)
    }

    /// A barrier's fsyncs and manifest are running.
    fn syncing(&self) -> bool {
        self.barrier.as_ref().is_some_and(|b| b.durable.is_some())
    }

    fn delivered(&mut self, acker: async_nats::jetstream::message::Acker, stream_seq: u64) {
        self.last = Some((acker, stream_seq));
        self.pending += 1;
        self.ack_limit.delivered();
    }

    /// Puts a barrier behind what was delivered, unless one is in flight
    /// (the next tick tries again).
    async fn begin(&mut self, shards: &mut Shards) -> Result<()> {
        if self.barrier.is_some() {
            return Ok(());
        }
        self.token += 1;
        shards.begin_checkpoint(self.token).await?;
        self.barrier = Some(Barrier {
            ack: self.last.take(),
            replies: 0,
            changed: false,
            syncs: fleet::Syncs::default(),
            durable: None,
            began: Instant::now(),
            messages: self.pending,
        });
        self.last_begun = Instant::now();
        self.pending = 0;
        Ok(())
    }

    /// A thread's reply to the barrier in flight; after the last, starts
    /// its fsyncs and manifest.
    fn reply(&mut self, reply: Reply) -> Result<()> {
        let (shard, manifest, syncs) = match reply {
            Reply::Failed { shard, error } => bail!("fleet writer thread {shard}: {error}"),
            Reply::Checkpointed {
                shard,
                token,
                manifest,
                syncs,
            } if token == self.token => (shard, manifest, syncs),
            Reply::Checkpointed { token, .. } => {
                bail!(
                    "a checkpoint reply for barrier {token}, expected {}",
                    self.token
                )
            }
        };
        let threads = self.threads;
        let Some(b) = self.barrier.as_mut().filter(|b| b.replies < threads) else {
            bail!("a checkpoint reply with no barrier waiting for one");
        };
        let Some(part) = self.parts.get_mut(shard) else {
            bail!("a checkpoint reply from thread {shard} of {threads}");
        };
        b.replies += 1;
        if let Some(m) = manifest {
            *part = Some(m);
            b.changed = true;
        }
        b.syncs.append(syncs);
        if b.replies == self.threads {
            let syncs = std::mem::take(&mut b.syncs);
            // Only when a part changed: a fleet whose logs only grew has
            // nothing new to say in it, and it lists every log ever
            // recorded.
            let manifest = b.changed.then(|| {
                let parts: Vec<_> = self.parts.iter().flatten().cloned().collect();
                fleet::merge_manifests(&self.base, &parts)
            });
            self.manifests_written += u64::from(manifest.is_some());
            let dir = self.dir.clone();
            // The device's flush, off the loop that routes: the threads
            // write what came after the barrier meanwhile.
            let cpu = self.sync_cpu.clone();
            b.durable = Some(tokio::task::spawn_blocking(move || {
                cpu.timed(|| {
                    syncs.run()?;
                    match &manifest {
                        Some(m) => fleet::write_manifest(&dir, m),
                        None => Ok(()),
                    }
                })
            }));
        }
        Ok(())
    }

    /// Waits for the barrier's fsyncs and manifest; cancel-safe (the task
    /// runs on and is waited for again).
    async fn wait_durable(&mut self) -> Result<()> {
        let Some(handle) = self.barrier.as_mut().and_then(|b| b.durable.as_mut()) else {
            bail!("no checkpoint is being made durable");
        };
        let done = handle.await;
        // Finished: the barrier is not waited for again, whatever came of it.
        if let Some(b) = self.barrier.as_mut() {
            b.durable = None;
        }
        done.context("the checkpoint's fsync task")?
            .context("making a checkpoint durable")
    }

    /// After [`wait_durable`](Self::wait_durable): acknowledges what the
    /// barrier covers.
    async fn acknowledge(&mut self, stats: &mut Session) -> Result<()> {
        let Some(b) = self.barrier.take() else {
            bail!("no checkpoint to acknowledge");
        };
        let landed = match b.ack {
            // A lost acknowledgement only means a redelivery, which the
            // recording skips as duplicates; counted, and the next one
            // covers it.
            Some((acker, stream_seq)) => match acker.double_ack_with(AckKind::Ack).await {
                Ok(()) => {
                    stats.acked = stream_seq;
                    true
                }
                Err(e) => {
                    stats.acks_lost += 1;
                    tracing::warn!("acknowledging: {e}");
                    false
                }
            },
            None => true,
        };
        self.ack_limit.acknowledged(b.messages, landed);
        stats.commits += 1;
        let took = b.began.elapsed();
        stats.last_commit = took;
        stats.longest_commit = stats.longest_commit.max(took);
        Ok(())
    }

    /// Waits for the barrier in flight, then commits everything delivered
    /// since.
    async fn finish(
        &mut self,
        shards: &mut Shards,
        replies: &mut Replies,
        stats: &mut Session,
    ) -> Result<()> {
        for round in 0..2 {
            if round == 1 {
                if self.last.is_none() {
                    break;
                }
                self.begin(shards).await?;
            }
            while self.awaiting_replies() {
                let Some(reply) = replies.next().await else {
                    bail!("the fleet writer threads stopped");
                };
                self.reply(reply)?;
            }
            if self.syncing() {
                self.wait_durable().await?;
                self.acknowledge(stats).await?;
            }
        }
        Ok(())
    }
}

/// What `bridge` is given.
#[derive(Debug, clap::Args)]
pub struct BridgeArgs {
    /// vLLM's (or SGLang's) KV-event publisher, `zmq://HOST:PORT`.
    #[arg(long)]
    from: String,
    /// The publisher's replay endpoint, `zmq://HOST:PORT`.
    #[arg(long)]
    replay_endpoint: Option<String>,
    /// The engine's name on the event plane (a subject token).
    #[arg(long)]
    engine_id: String,
    /// The NATS server, `nats://HOST:PORT`.
    #[arg(long)]
    to: String,
    /// Stop after this many seconds (default: until Ctrl-C).
    #[arg(long, value_parser = kvbm_sim::args::seconds)]
    duration_s: Option<f64>,
    /// On stop, keep sending what is buffered for at most this long.
    #[arg(long, default_value_t = 5.0, value_parser = kvbm_sim::args::seconds)]
    drain_s: f64,
}

/// `bridge`: vLLM's KV events onto the event plane as engine
/// `--engine-id`, through the same publisher an engine uses.
pub fn bridge(a: &BridgeArgs) -> Result<i32> {
    use kvbm_ingest::vllm::{ZmqConfig, ZmqEndpoint, ZmqItem, ZmqSource};
    kvbm_attach::nats::check_engine_name(&a.engine_id)?;
    kvbm_attach::nats::check_url(&a.to)?;
    if !(a.drain_s.is_finite() && a.drain_s >= 0.0) {
        bail!("--drain-s must be a non-negative number");
    }
    if let Some(d) = a.duration_s
        && !(d.is_finite() && d > 0.0)
    {
        bail!("--duration-s must be a positive number");
    }
    let mut cfg = ZmqConfig::new(ZmqEndpoint::parse(&a.from).map_err(anyhow::Error::msg)?);
    cfg.replay = a
        .replay_endpoint
        .as_deref()
        .map(ZmqEndpoint::parse)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let rt = runtime(None)?;
    let bus = Arc::new(kvbm_events::bus::EventBus::<Event>::new(Default::default())?);
    let tap = bus.take_tap().context("the bridge's tap")?;
    let publisher = Publisher::spawn(tap, PublisherConfig::new(&a.to, &a.engine_id), rt.handle())?;
    let deadline = a
        .duration_s
        .map(|d| Instant::now() + Duration::from_secs_f64(d));
    eprintln!(
        "bridging {} to {} as engine {}",
        a.from,
        kvbm_attach::nats::redacted(&a.to),
        a.engine_id
    );
    // The pure-Rust ZMQ socket refuses to connect to a publisher that is not
    // listening yet (an engine still starting), so the source is started
    // again until it connects; once subscribed, ZMQ reconnects by itself.
    let mut reconnects = 0u64;
    let (why, handle) = rt.block_on(async {
        let stop = interrupted();
        tokio::pin!(stop);
        loop {
            let mut src = ZmqSource::spawn(cfg.clone(), rt.handle());
            let handle = src.handle();
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            let mut got_any = false;
            let ended = loop {
                tokio::select! {
                    item = src.recv() => match item {
                        None => break None,
                        Some(ZmqItem::Events(events)) => {
                            got_any = true;
                            for e in events { bus.publish(e) }
                        }
                        Some(ZmqItem::Gap { from_seq, to_seq }) => {
                            // The translator leaves a seq unused per lost
                            // batch, so the recorder sees the hole too.
                            eprintln!("zmq gap: publisher batches {from_seq}..={to_seq} missed");
                        }
                        Some(ZmqItem::Restart(at)) => {
                            eprintln!(
                                "zmq publisher restarted (batch {} then {}; {}): the old engine's blocks are evicted",
                                at.last_seq,
                                at.new_seq,
                                at.cause.describe()
                            );
                        }
                        Some(ZmqItem::Joined { first_seq, fetched, missed }) => {
                            eprintln!("joined the zmq publisher at its batch {first_seq}: {fetched} earlier batches fetched, {missed} not bridged");
                        }
                        Some(ZmqItem::Disconnected) => eprintln!("the zmq publisher went away; reconnecting"),
                        Some(ZmqItem::Connected { .. }) => {}
                        Some(ZmqItem::ReplayFailed { error }) => eprintln!("zmq replay failed: {error}"),
                    },
                    _ = tick.tick() => {
                        if deadline.is_some_and(|d| Instant::now() >= d) {
                            break Some("--duration-s reached");
                        }
                    }
                    _ = &mut stop => break Some("interrupted"),
                }
            };
            match ended {
                Some(why) => return (why, handle),
                // A task that died is not a publisher to wait for.
                None if handle.failure().is_some() => return ("the zmq source failed", handle),
                None if got_any => return ("the zmq source stopped", handle),
                None => {
                    reconnects += 1;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
    });
    let zmq = handle.counters();
    let c = std::thread::scope(|s| {
        s.spawn(|| publisher.stop(Duration::from_secs_f64(a.drain_s)))
            .join()
    })
    .map_err(|_| anyhow::anyhow!("the publisher panicked"))?;
    // The source's own summary: what it lost, refused and skipped (by
    // reason), as `record --from zmq://` reports it.
    println!(
        "bridged {} events to {} as {} ({} batches; {} dropped, {} publish errors; zmq: {}, {reconnects} connection retries) ({why})",
        c.events_sent,
        kvbm_attach::nats::redacted(&a.to),
        a.engine_id,
        c.batches_sent,
        c.lost(),
        c.publish_errors,
        zmq.summary()
    );
    if let Some(e) = handle.failure() {
        anyhow::bail!("the bridge stopped: {e}");
    }
    Ok(0)
}

// ------------------------------------------------------------- reading

/// Each engine of a fleet recording: its name, its log's directory, its
/// manifest entry.
type EngineLogs = Vec<(String, std::path::PathBuf, fleet::LogEntry)>;

fn manifest(dir: &Path) -> Result<(fleet::FleetManifest, EngineLogs)> {
    let m = fleet::read_manifest(dir)?;
    let logs = fleet::engine_logs(dir, &m);
    Ok((m, logs))
}

/// `inspect` of a fleet recording: the fleet and each engine's count,
/// time range and losses. An engine whose log is damaged or cannot be
/// read is shown so, beside the others; the exit status is then 2.
pub fn inspect(dir: &Path, json: bool) -> Result<i32> {
    let (m, logs) = manifest(dir)?;
    let mut engines = serde_json::Map::new();
    let mut total = 0u64;
    let mut rows = Vec::new();
    let mut code = 0;
    for (name, path, entry) in &logs {
        match fleet::summarize(path, entry) {
            Ok(s) => {
                total += s.events;
                if s.damage.is_some() {
                    code = 2;
                }
                engines.insert(name.clone(), serde_json::to_value(&s)?);
                rows.push((name.clone(), Ok(s)));
            }
            Err(e) => {
                code = 2;
                let why = format!("cannot be read: {e}");
                engines.insert(name.clone(), serde_json::json!({ "error": why }));
                rows.push((name.clone(), Err(why)));
            }
        }
    }
    let v = serde_json::json!({
        "dir": dir,
        "fleet": true,
        "source": m.source,
        "consumer": m.consumer,
        "events": total,
        "engines": engines,
        "refused_unattributed": m.refused_unattributed,
        "last_refusal": m.last_refusal,
    });
    if json {
        println!("{v}");
        return Ok(code);
    }
    println!(
        "fleet         {} ({} logs) from {}",
        dir.display(),
        logs.len(),
        m.source
    );
    println!("events        {total}");
    for (name, row) in rows {
        let s = match row {
            Ok(s) => s,
            Err(why) => {
                println!("  {name:<24} {why}");
                continue;
            }
        };
        let l = &s.losses;
        let seqs = verdict::seq_span(s.first_seq, s.last_seq);
        println!(
            "  {name:<24} {:>10} events  {seqs}  missing {} (declared {}, unexplained {})  refused {}",
            s.events,
            l.holes + l.before_start,
            l.declared_by_publisher,
            l.unexplained,
            l.refused_messages
        );
        if let Some(d) = &s.damage {
            println!("  {:<24} damaged: {d}", "");
        }
    }
    Ok(code)
}

/// `check` of a fleet recording: every engine's log, as `check` judges
/// one (a log that cannot be read counts as damaged); the worst status.
pub fn check(dir: &Path) -> Result<i32> {
    let (_, logs) = manifest(dir)?;
    let mut worst = 0;
    for (name, path, _) in &logs {
        let code = match super::read::check_one(path, &format!("{name}: ")) {
            Ok(code) => code,
            Err(e) => {
                println!("{name}: cannot be read: {}", super::said(&e));
                2
            }
        };
        worst = super::read::worse(worst, code);
    }
    Ok(worst)
}

/// Every engine's events as one stream for the fleet-wide analyses:
/// engine by engine, with request ids qualified by the engine
/// (`engine/request`), transfer and batch ids moved into a range per
/// engine, and seqs renumbered, so no two engines' ids meet (each event's
/// `engine` is 0: the analyses read one stream). Each engine's events are
/// what its log holds up to any damage; what is wrong with an engine's
/// log (damaged, fewer events than were written, unreadable) is in
/// `problems`, to be said beside the figures.
pub fn fleet_events(dir: &Path) -> Result<FleetEvents> {
    let mut out = FleetEvents::default();
    out.problems = each_engine(dir, |i, name, events| {
        out.join(i, name, events);
        Ok(())
    })?;
    Ok(out)
}

/// Reads every engine's log of the fleet recording in `dir`, in the
/// manifest's order, handing each readable one's events (as its log holds
/// them) to `each(index, name, events)`; what is wrong with the logs, one
/// line per engine.
fn each_engine(
    dir: &Path,
    mut each: impl FnMut(usize, &str, Vec<Event>) -> Result<()>,
) -> Result<Vec<String>> {
    let (_, logs) = manifest(dir)?;
    let mut problems = Vec::new();
    for (i, (name, path, _)) in logs.iter().enumerate() {
        match super::read::load_for_analysis(path) {
            Ok((events, problem)) => {
                if let Some(p) = problem {
                    problems.push(format!("engine {name}: {p}"));
                }
                each(i, name, events)?;
            }
            Err(e) => problems.push(format!(
                "engine {name}: cannot be read, left out: {}",
                super::said(&e)
            )),
        }
    }
    Ok(problems)
}

/// A fleet's events as one stream, and what is wrong with its logs.
#[derive(Debug, Default)]
pub struct FleetEvents {
    /// The events ([`fleet_events`]).
    pub events: Vec<Event>,
    /// One line per engine whose log is damaged or could not be read.
    pub problems: Vec<String>,
}

impl FleetEvents {
    /// Adds the events of engine `name`, the `index`th log, to the stream.
    fn join(&mut self, index: usize, name: &str, events: Vec<Event>) {
        let base = (index as u64) << 40;
        let first = self.events.len() as u64;
        for (seq, mut e) in (first..).zip(events) {
            e.engine = 0;
            e.seq = seq;
            if let Some(r) = &e.request {
                e.request = Some(format!("{name}/{r}").into());
            }
            qualify_ids(&mut e.kind, base);
            self.events.push(e);
        }
    }

    /// Says each problem on stderr, after `what` the figures cover; the
    /// exit status (2 when any).
    pub fn warn(&self, what: &str) -> i32 {
        for p in &self.problems {
            eprintln!("warning: {p}");
        }
        if self.problems.is_empty() {
            0
        } else {
            eprintln!("warning: {what}");
            2
        }
    }
}

fn qualify_ids(kind: &mut kvbm_events::EventKind, base: u64) {
    use kvbm_events::EventKind as K;
    match kind {
        K::TransferPlanned { transfer, .. }
        | K::TransferPromoted { transfer, .. }
        | K::TransferSkipped { transfer, .. }
        | K::TransferCancelled { transfer, .. }
        | K::TransferCompleted { transfer, .. }
        | K::TransferFailed { transfer, .. } => *transfer |= base,
        K::BatchDispatched {
            batch, transfers, ..
        } => {
            *batch |= base;
            for t in transfers {
                *t |= base;
            }
        }
        K::BatchCompleted { batch, .. } => *batch |= base,
        _ => {}
    }
}

/// `stats` of a fleet recording: each engine's, then the fleet's.
pub fn stats(dir: &Path, json: bool) -> Result<i32> {
    let mut per = serde_json::Map::new();
    let mut all = FleetEvents::default();
    all.problems = each_engine(dir, |i, name, events| {
        let s = analysis::stats::stats(&events, analysis::StatsConfig::default())?;
        if !json {
            println!("== {name}\n{s}");
        }
        per.insert(name.to_string(), serde_json::to_value(&s)?);
        all.join(i, name, events);
        Ok(())
    })?;
    let fleet = analysis::stats::stats(&all.events, analysis::StatsConfig::default())?;
    if json {
        println!("{}", serde_json::json!({"fleet": fleet, "engines": per}));
    } else {
        println!("== the fleet ({} logs)\n{fleet}", per.len());
    }
    Ok(all.warn("the figures cover what the readable logs hold"))
}

/// `export` of a fleet recording. JSON lines: engine by engine, each
/// event as its log holds it (its own seq and request id) with its
/// engine's name added as `engine_name`. A Chrome trace: the one stream
/// of [`fleet_events`], a track per engine's request.
pub fn export(dir: &Path, format: Format, out: Option<&Path>) -> Result<i32> {
    let problems = match format {
        Format::Chrome | Format::Mooncake => {
            let all = fleet_events(dir)?;
            super::read::write_export(&all.events, format, out)?;
            all.problems
        }
        Format::Jsonl => {
            let mut w = std::io::BufWriter::new(super::read::output(out)?);
            let problems = each_engine(dir, |_, name, events| {
                for e in &events {
                    let mut v = serde_json::to_value(e)?;
                    if let Some(o) = v.as_object_mut() {
                        o.insert("engine_name".into(), name.into());
                    }
                    // As an io::Error, so that a closed pipe (`| head`)
                    // is seen as one.
                    serde_json::to_writer(&mut w, &v).map_err(std::io::Error::from)?;
                    w.write_all(b"\n")?;
                }
                Ok(())
            })?;
            w.flush()?;
            problems
        }
    };
    let all = FleetEvents {
        events: Vec::new(),
        problems,
    };
    Ok(all.warn("exported what the readable logs hold"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ack_limit_is_timed_from_reaching_it_to_an_acknowledgement_below_it() {
        let mut l = AckLimit {
            limit: 3,
            ..AckLimit::default()
        };
        l.delivered();
        l.delivered();
        assert_eq!((l.times, l.since.is_some()), (0, false));
        l.delivered();
        assert_eq!((l.times, l.since.is_some()), (1, true));
        // The server delivers nothing more at the limit; an acknowledgement
        // that leaves it there does not end the wait.
        l.acknowledged(0, true);
        assert!(l.since.is_some());
        // A lost acknowledgement leaves its messages unacknowledged …
        l.acknowledged(1, false);
        assert_eq!((l.unacked, l.since.is_some()), (3, true));
        std::thread::sleep(Duration::from_millis(5));
        // … until the next lands, which covers them too.
        l.acknowledged(1, true);
        assert_eq!((l.unacked, l.since.is_some()), (1, false));
        assert!(l.held >= Duration::from_millis(5), "{:?}", l.held);
        l.delivered();
        l.delivered();
        assert_eq!(l.times, 2);
        // No limit known: never counted.
        let mut none = AckLimit::default();
        none.delivered();
        assert_eq!((none.times, none.since.is_some()), (0, false));
    }
}
