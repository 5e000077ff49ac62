//! `record`: an in-process simulated engine, a remote engine's attach
//! server (`--from http://…`) or vLLM's KV-event publisher
//! (`--from zmq://…`), each into a [`RecordingSink`].

use super::RemoteArgs;
use anyhow::{Context, Result, bail};
use kvbm_attach::client::{Client, ClientConfig, ClientEvent};
use kvbm_recorder::log::LogConfig;
use kvbm_recorder::progress::Progress;
use kvbm_recorder::recorder::{self, RecorderConfig, RecordingSink};
use kvbm_sim::args::SimArgs;
use kvbm_sim::sim::{Pacing, Simulator};
use std::path::Path;
use std::time::Duration;

/// How often a remote recording hands what it has to the OS.
const FLUSH_EVERY: Duration = Duration::from_millis(50);

/// `record`, from wherever `remote` says.
pub fn record(out: &Path, remote: &RemoteArgs, log: LogConfig, sim: &SimArgs) -> Result<i32> {
    new_recording_dir(out)?;
    let Some(url) = remote.from.as_deref() else {
        return record_simulator(out, log, sim);
    };
    if let Some(d) = remote.duration_s
        && !(d.is_finite() && d > 0.0)
    {
        bail!("--duration-s must be a positive number");
    }
    if kvbm_ingest::vllm::is_zmq_url(url) {
        record_from_zmq(url, out, remote, log)
    } else {
        if remote.replay_endpoint.is_some() {
            bail!("--replay-endpoint is for a zmq:// source");
        }
        record_from(url, out, remote, log)
    }
}

/// Refuses an `--out` that is not a new or empty directory: a log written
/// among other files (another recording, a fleet's manifest) would be
/// hidden from, or mistaken by, whatever reads that directory.
fn new_recording_dir(out: &Path) -> Result<()> {
    let mut entries = match std::fs::read_dir(out) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => bail!("--out {}: {e}", out.display()),
    };
    if let Some(first) = entries.next() {
        let first = first.map_or_else(|e| e.to_string(), |e| e.file_name().display().to_string());
        let what = match kvbm_recorder::fleet::recording_kind(out) {
            Ok(_) => "a recording",
            Err(_) => "other files",
        };
        bail!(
            "--out {} already holds {what} ({first}, …): a new recording needs a new or empty \
             directory",
            out.display()
        );
    }
    Ok(())
}

/// The simulator in-process, as fast as possible (or paced with
/// `--real-time`), every event through the tap into the log.
fn record_simulator(out: &Path, log: LogConfig, sim: &SimArgs) -> Result<i32> {
    let loaded = sim.load()?;
    for s in loaded.skipped.iter().take(5) {
        eprintln!("warning: line {} skipped: {}", s.line, s.error);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let loaded_requests = loaded.workload.len();
    let virtual_time = loaded.config.pacing == Pacing::Virtual;
    let info = kvbm_sim::info::engine_info(&loaded.config);
    let sim = Simulator::new(loaded.config, loaded.workload, rt.handle())?;
    let tap = sim
        .emitter()
        .bus()
        .take_tap()
        .context("the simulator's tap was already taken")?;
    let mut rcfg = RecorderConfig {
        log,
        ..RecorderConfig::default()
    };
    rcfg.log.engine_id = u64::from(sim.emitter().engine());
    rcfg.run = Some(sim.emitter().run());
    // What it ran as (tiers, policies) goes in the sidecar: `inspect` and
    // the console's header say it.
    rcfg.info = Some(info);
    let handle = recorder::spawn_recorder(tap, out.to_path_buf(), rcfg, None)?;
    let bar = Progress::new(loaded_requests as u64, "requests finished");
    let emitter = sim.emitter().clone();
    let report = sim.run_with_progress(|done, _| {
        bar.set(done as u64);
        if virtual_time {
            keep_pace_with_the_recorder(&emitter);
        }
    });
    bar.done();
    // The last holders of the emitter: dropping them closes the bus, and
    // the recorder drains and stops.
    drop(emitter);
    drop(rt);
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

/// In virtual time the engine can outrun the recorder (it runs as fast as
/// it can, the recorder as fast as the disk): between two iterations it
/// waits while the tap is more than half full, so that a recording of a
/// simulated run loses nothing and two runs of one trace give the same
/// log. Waiting costs the simulation nothing; in real time the engine
/// never waits, and what the tap drops is counted as lost.
fn keep_pace_with_the_recorder(emitter: &kvbm_events::Emitter) {
    let bus = emitter.bus();
    let half = bus.config().tap_capacity as u64 / 2;
    while bus.counters().tap_queued > half {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// A sink for a remote source's events.
fn remote_sink(out: &Path, mut log: LogConfig, engine: u32, url: &str) -> Result<RecordingSink> {
    log.engine_id = u64::from(engine);
    let cfg = RecorderConfig {
        log,
        ..RecorderConfig::default()
    };
    let mut sink = RecordingSink::create(out, &cfg)
        .with_context(|| format!("creating log {}", out.display()))?;
    sink.set_source(url);
    Ok(sink)
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

/// Where the recording of the `n`th engine run followed (1 for the first)
/// goes: `OUT` for the first, then `OUT-run2`, `OUT-run3`, … beside it (or,
/// if that name is taken, the first of `OUT-run2-2`, … that is free).
fn run_dir(out: &Path, n: u32) -> std::path::PathBuf {
    if n <= 1 {
        return out.to_path_buf();
    }
    let name = out
        .file_name()
        .map_or_else(|| "recording".into(), |f| f.to_string_lossy().into_owned());
    let base = out.with_file_name(format!("{name}-run{n}"));
    if !base.exists() {
        return base;
    }
    (2..)
        .map(|k| out.with_file_name(format!("{name}-run{n}-{k}")))
        .find(|p| !p.exists())
        .unwrap_or(base)
}

/// `record --from URL`: a running engine through its attach server, until
/// Ctrl-C or a limit. An engine restart is never spliced onto the run
/// before it: the recording of the old run ends there (its sidecar says
/// the engine restarted, and where the next run is) and the new run is
/// recorded from its first event into a new directory ([`run_dir`]).
fn record_from(url: &str, out: &Path, remote: &RemoteArgs, log: LogConfig) -> Result<i32> {
    let mut cfg = ClientConfig::new(url)?.with_since(remote.since.unwrap_or(0));
    cfg.token = remote.token.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut client = Client::spawn(cfg, rt.handle())?;
    let handle = client.handle();
    let deadline = deadline_of(remote.duration_s);
    let mut sink: Option<RecordingSink> = None;
    // Runs recorded so far, oldest first: (directory, what it holds).
    let mut done: Vec<(std::path::PathBuf, kvbm_recorder::recorder::Recording)> = Vec::new();
    let mut dir = out.to_path_buf();
    let mut total = 0u64;
    let outcome: Result<&str> = rt.block_on(async {
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        let until = stop_at(deadline);
        tokio::pin!(until);
        let mut flush = tokio::time::interval(FLUSH_EVERY);
        loop {
            tokio::select! {
                ev = client.recv() => match ev {
                    None => return Ok("the client stopped"),
                    Some(ClientEvent::NewRun { previous, run, number }) => {
                        let next = run_dir(out, number);
                        eprintln!(
                            "the engine restarted (run {previous} -> {run}): its new run is recorded from its start in {}",
                            next.display()
                        );
                        if let Some(s) = sink.take() {
                            let rec = s.finish_new_run(run, &next)?;
                            done.push((dir.clone(), rec));
                        }
                        dir = next;
                    }
                    Some(ClientEvent::Connected(h)) => {
                        eprintln!(
                            "connected to {url} (engine {}, run {}, holding {})",
                            h.engine,
                            h.run,
                            kvbm_recorder::verdict::seq_span(h.first_seq, h.last_seq)
                        );
                        match &sink {
                            None => {
                                let mut s = remote_sink(&dir, log.clone(), h.engine, url)?;
                                s.set_run(h.run);
                                if let Some((prev, _)) = done.last() {
                                    s.set_previous(prev);
                                }
                                sink = Some(s);
                            }
                            Some(s) if s.recording().engine != h.engine => bail!(
                                "the server now serves engine {}, not engine {}",
                                h.engine,
                                s.recording().engine
                            ),
                            Some(_) => {}
                        }
                    }
                    Some(ClientEvent::Events(events)) => {
                        let Some(s) = sink.as_mut() else {
                            bail!("events before the server's hello");
                        };
                        for ev in &events {
                            s.append(ev)?;
                            total += 1;
                            if remote.events.is_some_and(|n| total >= n) {
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
                        if let Some(s) = sink.as_mut() {
                            // Before the first event written, what the
                            // server no longer held is not a loss inside
                            // the recording.
                            if s.recording().last_seq.is_none() {
                                s.missed_before_start(g.len());
                            } else {
                                s.gap(g.len());
                            }
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
                    if let Some(s) = sink.as_mut() {
                        s.flush()?;
                    }
                }
            }
        }
    });
    drop(client);
    let counters = handle.counters();
    let Some(mut sink) = sink else {
        outcome?;
        if done.is_empty() {
            bail!("never connected to {url}; nothing recorded");
        }
        bail!(
            "the engine restarted and the client stopped before its new run said hello; {} runs recorded",
            done.len()
        );
    };
    sink.set_client_counters(serde_json::to_value(counters)?);
    if let Ok(why) = &outcome {
        sink.end_because(*why);
    }
    // The first error first: a failure that ended the recording (the
    // sink returns it again here), then the outcome.
    let rec = sink.finish()?;
    let why = outcome?;
    done.push((dir, rec));
    print_runs(&done, url, &counters, why);
    Ok(0)
}

/// What `record --from URL` prints as it ends: each engine run recorded,
/// where, and what it missed; then the totals and why it stopped.
fn print_runs(
    done: &[(std::path::PathBuf, kvbm_recorder::recorder::Recording)],
    url: &str,
    counters: &kvbm_attach::client::ClientCounters,
    why: &str,
) {
    for (d, rec) in done {
        println!(
            "recorded {} events ({} lost in gaps) of engine run {} from {url} into {}",
            rec.events,
            rec.lost,
            rec.run.map_or("?".to_string(), |r| r.to_string()),
            d.display()
        );
        if rec.missed_before_start > 0 {
            println!(
                "the server no longer held the {} events before seq {:?}",
                rec.missed_before_start, rec.first_seq
            );
        }
    }
    println!(
        "{} events in all, {} duplicates dropped, {} reconnections, {} engine restarts ({why})",
        done.iter().map(|(_, r)| r.events).sum::<u64>(),
        counters.duplicates,
        counters.connects.saturating_sub(1),
        counters.new_runs
    );
}

/// `record --from zmq://HOST:PORT`: vLLM's KV-event stream until Ctrl-C or
/// a limit. Engine id 0; the publisher's unrecovered gaps are the
/// sidecar's losses (in publisher batches), what it published before the
/// recorder joined and could not be fetched its `missed_before_start`, its
/// counters the sidecar's `client`.
fn record_from_zmq(url: &str, out: &Path, remote: &RemoteArgs, log: LogConfig) -> Result<i32> {
    use kvbm_ingest::vllm::{ZmqConfig, ZmqEndpoint, ZmqItem, ZmqSource};
    let endpoint = ZmqEndpoint::parse(url).map_err(anyhow::Error::msg)?;
    let mut cfg = ZmqConfig::new(endpoint);
    cfg.replay = remote
        .replay_endpoint
        .as_deref()
        .map(ZmqEndpoint::parse)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    if remote.since.is_some() && cfg.replay.is_none() {
        bail!("--since with a zmq:// source needs --replay-endpoint (batches are fetched from it)");
    }
    // With a replay endpoint, fetch everything its buffer still holds, as
    // a recording from an attach server starts at seq 0.
    cfg.since = cfg.replay.as_ref().map(|_| remote.since.unwrap_or(0));
    let has_replay = cfg.replay.is_some();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut sink = remote_sink(out, log, cfg.translator.engine, url)?;
    let mut src = ZmqSource::spawn(cfg, rt.handle());
    let handle = src.handle();
    let deadline = deadline_of(remote.duration_s);
    eprintln!("subscribing to {url}");
    let outcome: Result<&str> = rt.block_on(async {
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        let until = stop_at(deadline);
        tokio::pin!(until);
        let mut flush = tokio::time::interval(FLUSH_EVERY);
        loop {
            tokio::select! {
                item = src.recv() => match item {
                    // Its task died (its failure is in the sidecar's
                    // counters too): an error, not a clean stop.
                    None => match handle.failure() {
                        Some(e) => return Err(e.into()),
                        None => return Ok("the source stopped"),
                    },
                    Some(ZmqItem::Events(events)) => {
                        for ev in &events {
                            sink.append(ev)?;
                            if remote.events.is_some_and(|n| sink.recording().events >= n) {
                                return Ok("--events reached");
                            }
                        }
                    }
                    Some(g @ ZmqItem::Gap { .. }) => {
                        if let ZmqItem::Gap { from_seq, to_seq } = g {
                            eprintln!("gap: publisher batches {from_seq}..={to_seq} lost");
                        }
                        // Counted as lost even before the first event: the
                        // publisher's seq says they existed.
                        sink.gap(g.missed());
                    }
                    Some(ZmqItem::Joined { first_seq, fetched, missed }) => {
                        sink.missed_before_start(missed);
                        eprintln!(
                            "joined the publisher at its batch {first_seq}: {fetched} earlier batches fetched from its replay endpoint, {missed} not recorded{}",
                            if missed > 0 && !has_replay {
                                " (give --replay-endpoint to fetch what its replay buffer still holds)"
                            } else {
                                ""
                            }
                        );
                    }
                    Some(ZmqItem::Restart(at)) => {
                        eprintln!(
                            "publisher restarted (batch {} then {}; {}): the old engine's blocks are evicted",
                            at.last_seq,
                            at.new_seq,
                            at.cause.describe()
                        );
                    }
                    Some(ZmqItem::Disconnected) => {
                        eprintln!("the publisher went away; reconnecting");
                    }
                    Some(ZmqItem::Connected { connects }) => {
                        if connects > 1 {
                            eprintln!("reconnected to {url}");
                        } else {
                            eprintln!("subscribed to {url}");
                        }
                    }
                    Some(ZmqItem::ReplayFailed { error }) => {
                        eprintln!("replay failed: {error}");
                    }
                },
                _ = &mut until => return Ok("--duration-s reached"),
                _ = &mut ctrl_c => return Ok("interrupted"),
                _ = flush.tick() => sink.flush()?,
            }
        }
    });
    drop(src);
    let counters = handle.counters();
    sink.set_client_counters(serde_json::to_value(&counters)?);
    let rec = sink.finish()?;
    let why = outcome?;
    println!(
        "recorded {} events ({} publisher batches lost in {} gaps, {} replayed, {} replay failures, {} malformed messages, {} events skipped, {} restarts) from {url} into {} ({why})",
        rec.events,
        rec.lost,
        counters.gaps,
        counters.replayed,
        counters.replay_failures,
        counters.malformed,
        counters.skipped.total(),
        counters.restarts,
        out.display()
    );
    if counters.skipped.total() > 0 {
        println!("skipped events: {}", counters.skipped);
    }
    for r in &counters.restart_log {
        println!(
            "restart: batch {} then {} ({})",
            r.last_seq,
            r.new_seq,
            r.cause.describe()
        );
    }
    if rec.missed_before_start > 0 || counters.fetched_before_start > 0 {
        println!(
            "joined at publisher batch {}: {} earlier batches fetched, {} not recorded",
            counters.first_seq.unwrap_or(0),
            counters.fetched_before_start,
            rec.missed_before_start
        );
    }
    if let Some(e) = &counters.last_replay_error {
        println!("last replay failure: {e}");
    }
    Ok(0)
}
