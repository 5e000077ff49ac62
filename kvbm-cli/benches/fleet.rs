//! The fleet through JetStream: events per second from 100 engines into
//! the fleet recorder (`kvbm-recorder record --from nats://`), beside a
//! plain async-nats consumer that only counts the same messages in the same
//! run; the publisher's cost per event on the engine's thread (its wall
//! time and the thread's own CPU time), in the bus benchmark's two
//! regimes: keeping up (timed bursts of 1,000 emits, the publisher given
//! time between them to take everything: the normal case, an engine emits
//! far fewer events than a publisher can take) and flat out (emitting
//! without pause, so the tap overflows and the drop path is mixed in);
//! file store against memory store.
//! `bench/bench-fleet-slow-disk.sh` runs it with the recorder's writes
//! throttled.
//!
//! ```sh
//! bash scripts/setup-nats.sh
//! cargo bench -p kvbm-cli --bench fleet          # KVBM_BENCH_QUICK=1 for a smoke run
//! ```
//!
//! Each store gets its own `nats-server`. First the 100 engines' batches
//! are published (each engine one task, batches of the durable log's
//! columnar blocks, one at a time with message ids, as the publisher
//! sends them); then the counting consumer drains the stream (a pull
//! consumer, no acknowledgements, counting each batch's events from its
//! header); then a checking consumer drains it again, checking each batch
//! as the recorder must before it keeps one (`wire::check`: decompressed,
//! verified, every value validated) on one thread and writing nothing;
//! then an acknowledging consumer drains it: the recorder's own durable
//! consumer (acknowledge-all, its limit of unacknowledged messages),
//! counting as the first does and acknowledging as the recorder does
//! after each checkpoint, which separates what JetStream's acknowledged
//! delivery costs from what the recorder does;
//! then the recorder drains it into a fleet recording (its writer threads
//! checking and writing the engines' batches) and stops at the last
//! event; then the recorder drains it once more with `--receive-only`
//! (its own consumer; its loop, routing and acknowledgements as before,
//! its writer threads only counting each batch from its header), which
//! tells what its receiving sustains without the writers' work beside
//! the server. All read the same messages from the same server. The ratio
//! compares like with like: the counting consumer from its first message
//! to its last, the recorder from its first message to its last log
//! closed (as it reports it). Beside it: the recorder to its last batch
//! written (without the last checkpoint and the closing, which come once
//! in a recorder that runs for hours), and the recorder process's whole
//! run, from its start. Beside the rates, each phase's CPU time per
//! event, `nats-server`'s and its client's: on a machine whose cores are
//! all busy, that is what bounds each rate. Then the recorder's CPU time
//! by thread, as it reports it, beside the counting consumer's: with
//! cores to spare for its writer threads, what they do not do (receiving
//! and routing, on its loop and the NATS client's connection) is what can
//! bound it.
//!
//! `KVBM_FLEET_PER_ENGINE` sets the events per engine (300,000: 30 M in
//! all); `KVBM_FLEET_RECORDER_ARGS` adds arguments to the recorder's
//! command line (`--writer-threads 1`); `KVBM_FLEET_OUT` is the directory
//! the recording is made in (a temporary directory by default; a tmpfs
//! separates what the file system costs); `KVBM_FLEET_PHASES=1` instead
//! times each part of the check on one thread, without NATS.

use futures_util::StreamExt;
use kvbm_attach::nats::async_nats;
use kvbm_attach::nats::consume;
use kvbm_attach::nats::publish::{Publisher, PublisherConfig};
use kvbm_attach::nats::waits::DeliveryWaits;
use kvbm_attach::nats::wire::{self, BatchEncoder};
use kvbm_attach::nats::{StreamLimits, connect, ensure_stream, events_subject};
use kvbm_events::bus::{BusConfig, TapItem};
use kvbm_events::{
    Direction, Emitter, Event, EventKind, MonotonicClock, SequenceHash, SlotState, Tier,
};
use kvbm_recorder::cpu::ThreadTimer;
use kvbm_testkit::nats::NatsServer;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One encoded batch: (first seq, last seq, its bytes).
type Batch = (u64, u64, Vec<u8>);

/// One engine's events: a request's lifecycle, its blocks and transfers,
/// gauges — the kinds an engine emits most, in a plausible mix.
fn engine_events(n: usize, engine: u32) -> Vec<Event> {
    let mut out = Vec::with_capacity(n);
    let mut seq = 0u64;
    let mut push = |out: &mut Vec<Event>, req: Option<Arc<str>>, kind: EventKind| {
        out.push(Event {
            engine,
            seq,
            ts_ns: seq * 1_000,
            iteration: seq / 50,
            request: req,
            kind,
        });
        seq += 1;
    };
    let mut r = 0u64;
    while out.len() < n {
        let req: Arc<str> = format!("req-{r}").into();
        push(
            &mut out,
            Some(req.clone()),
            EventKind::SlotCreated {
                prompt_tokens: 512,
                max_output_tokens: 64,
            },
        );
        push(
            &mut out,
            Some(req.clone()),
            EventKind::SlotTransition {
                from: SlotState::Initialized,
                to: SlotState::Prefilling,
            },
        );
        for b in 0..8u32 {
            push(
                &mut out,
                None,
                EventKind::BlockRegistered {
                    tier: Tier::Device,
                    block: b + (r as u32 % 64) * 8,
                    sequence_hash: SequenceHash(
                        r.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(b),
                    ),
                    duplicate_of: None,
                },
            );
        }
        push(
            &mut out,
            Some(req.clone()),
            EventKind::TransferPlanned {
                transfer: r,
                direction: Direction::DEVICE_TO_HOST,
                blocks: 8,
            },
        );
        push(
            &mut out,
            Some(req.clone()),
            EventKind::TransferCompleted {
                transfer: r,
                direction: Direction::DEVICE_TO_HOST,
                blocks: 8,
            },
        );
        push(
            &mut out,
            Some(req.clone()),
            EventKind::SlotTransition {
                from: SlotState::Prefilling,
                to: SlotState::Decoding,
            },
        );
        push(
            &mut out,
            None,
            EventKind::PoolGauge {
                tier: Tier::Device,
                capacity: 1024,
                active: 300,
                inactive: 200,
                empty: 524,
            },
        );
        r += 1;
    }
    out.truncate(n);
    out
}

/// Every engine's batches, sealed as the publisher seals them.
fn batches(events: &[Event]) -> Vec<Batch> {
    let mut enc = BatchEncoder::new(true);
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for ev in events {
        if !enc.push(ev, 60 << 10) {
            let h = enc.seal(7, 0, &mut buf).unwrap();
            out.push((h.first_seq, u64::from(h.count), buf.clone()));
            enc.push(ev, 60 << 10);
        }
    }
    if let Some(h) = enc.seal(7, 0, &mut buf) {
        out.push((h.first_seq, u64::from(h.count), buf.clone()));
    }
    out
}

struct Run {
    store: &'static str,
    events: u64,
    bytes: u64,
    publish_s: f64,
    count_s: f64,
    check_s: f64,
    acking_s: f64,
    record_s: f64,
    written_s: f64,
    /// The recorder receiving only, to its last batch counted.
    receive_s: f64,
    process_s: f64,
    /// CPU time per phase: publishing, counting, checking, counting with
    /// the recorder's consumer, recording.
    cpu: [PhaseCpu; 5],
    /// The recorder's CPU time by thread, as it reports it.
    split: Option<RecorderCpu>,
    /// The recorder's own account of its checkpoints and of the time the
    /// server held messages back for want of acknowledgements.
    recorder_notes: Vec<String>,
    /// The same, of the recorder receiving only.
    receive_notes: Vec<String>,
    /// The counting and the acknowledging consumers' waits for
    /// deliveries, as the recorder counts its own.
    consumer_notes: Vec<String>,
}

/// The CPU time a phase took, in ns: `nats-server`'s, and the client's
/// (the bench process's for publishing and the in-process consumers, the
/// recorder process's for the recorder).
#[derive(Default, Clone, Copy)]
struct PhaseCpu {
    server_ns: Option<u64>,
    client_ns: Option<u64>,
}

/// The recorder's CPU time by thread, in seconds, from its `CPU:` line:
/// receiving and routing (its loop and its runtime's threads), checking
/// and writing (its writer threads), making checkpoints durable,
/// elsewhere (starting and ending), and the process in all.
#[derive(Clone, Copy)]
struct RecorderCpu([f64; 5]);

impl RecorderCpu {
    /// "CPU: 0.0710 s receiving …, 0.6800 s checking …, 0.0012 s making
    /// …, 0.0200 s elsewhere (starting, ending); 0.7830 s in all …": each
    /// figure in seconds, in that order (the figures in ns are not).
    fn parse(line: &str) -> Option<RecorderCpu> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let mut secs = words
            .windows(2)
            .filter(|w| w[1] == "s")
            .filter_map(|w| w[0].parse::<f64>().ok());
        let mut v = [0.0; 5];
        for slot in &mut v {
            *slot = secs.next()?;
        }
        Some(RecorderCpu(v))
    }
}

/// A figure with one decimal, or "n/a" where it could not be measured.
fn or_na(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".to_string(), |v| format!("{v:.1}"))
}

/// CPU time a process's threads have run so far, in ns: the scheduler's
/// own account (`/proc/PID/task/*/schedstat`; a thread that has exited is
/// no longer counted, which `nats-server`'s long-lived threads make
/// rare). `None` where there is no such file.
fn process_cpu_ns(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut sum = 0;
    for t in tasks.flatten() {
        // A thread may exit between listing and reading: skip it.
        if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
            sum += s.split_whitespace().next()?.parse::<u64>().ok()?;
        }
    }
    Some(sum)
}

/// CPU time (user and system) of this process, or of its waited-for
/// children, in ns (`getrusage`).
#[cfg(unix)]
fn rusage_ns(who: libc::c_int) -> Option<u64> {
    // SAFETY: an all-zero rusage is a valid value of the plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is valid and writable for the call's duration.
    let rc = unsafe { libc::getrusage(who, &mut ru) };
    let ns = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    (rc == 0).then(|| ns(ru.ru_utime) + ns(ru.ru_stime))
}

#[cfg(not(unix))]
fn rusage_ns(_who: i32) -> Option<u64> {
    None
}

#[cfg(unix)]
const SELF: libc::c_int = libc::RUSAGE_SELF;
#[cfg(unix)]
const CHILDREN: libc::c_int = libc::RUSAGE_CHILDREN;
#[cfg(not(unix))]
const SELF: i32 = 0;
#[cfg(not(unix))]
const CHILDREN: i32 = -1;

/// Runs `phase`, and returns its result with the CPU time `nats-server`
/// (`server`) and the client (`who`: this process or its children)
/// spent meanwhile.
fn with_cpu<T>(server: Option<u32>, who: i32, phase: impl FnOnce() -> T) -> (T, PhaseCpu) {
    let s0 = server.and_then(process_cpu_ns);
    let c0 = rusage_ns(who);
    let out = phase();
    let cpu = PhaseCpu {
        server_ns: s0
            .zip(server.and_then(process_cpu_ns))
            .map(|(a, b)| b.saturating_sub(a)),
        client_ns: c0.zip(rusage_ns(who)).map(|(a, b)| b.saturating_sub(a)),
    };
    (out, cpu)
}

/// A batch's events, from its header: all the counting consumers read.
fn count(m: &[u8], _: &mut Vec<u8>) -> u64 {
    u64::from(wire::header(m).unwrap().count)
}

/// Publishes each engine's batches from a task of its own, one batch at
/// a time, with message ids, into a stream made with `limits`; returns
/// the seconds from the first publish to the last acknowledged.
fn publish(
    rt: &tokio::runtime::Runtime,
    url: &str,
    limits: &StreamLimits,
    sets: Vec<(String, Vec<Batch>)>,
) -> f64 {
    rt.block_on(async {
        let client = connect(url, "bench").await.unwrap();
        let js = async_nats::jetstream::new(client.clone());
        ensure_stream(&js, limits).await.unwrap();
        let t = Instant::now();
        let mut tasks = Vec::new();
        for (name, bs) in sets {
            let js = js.clone();
            tasks.push(tokio::spawn(async move {
                let subject = events_subject(&name);
                for (first, _, body) in bs {
                    let p = async_nats::jetstream::message::PublishMessage::build()
                        .payload(body.into())
                        .message_id(wire::message_id(&name, 7, first));
                    js.send_publish(subject.clone(), p)
                        .await
                        .unwrap()
                        .await
                        .unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        t.elapsed().as_secs_f64()
    })
}

fn run_store(
    file_store: bool,
    engines: usize,
    per_engine: usize,
    rt: &tokio::runtime::Runtime,
) -> Run {
    let nats = NatsServer::start();
    let url = nats.url();
    let sets: Vec<(String, Vec<Batch>)> = (0..engines)
        .map(|i| {
            let ev = engine_events(per_engine, i as u32);
            (format!("e{i:03}"), batches(&ev))
        })
        .collect();
    let events: u64 = sets.iter().flat_map(|(_, b)| b.iter().map(|x| x.1)).sum();
    let bytes: u64 = sets
        .iter()
        .flat_map(|(_, b)| b.iter().map(|x| x.2.len() as u64))
        .sum();
    let messages: u64 = sets.iter().map(|(_, b)| b.len() as u64).sum();
    // The stream holds the whole run (nothing may be discarded before the
    // recorder reads it), but no more: JetStream refuses a stream whose
    // limit exceeds the disk or memory it has, and a CI machine may have
    // only a few GiB free.
    let limits = StreamLimits {
        file_store,
        max_bytes: (4 * bytes).max(64 << 20) as i64,
        ..StreamLimits::default()
    };

    // 1. Publish: one task per engine, one batch at a time, with ids.
    let server = nats.pid();
    let (publish_s, publish_cpu) = with_cpu(server, SELF, || publish(rt, &url, &limits, sets));

    // 2. The counting consumer, then one that also checks each batch as
    // the recorder must before it keeps one (decompressed, verified,
    // every value validated: `wire::check`), writing nothing.
    let drained = |consumer, per_message: fn(&[u8], &mut Vec<u8>) -> u64| {
        with_cpu(server, SELF, || {
            drain(rt, &url, &limits, (messages, events), consumer, per_message)
        })
    };
    let ((count_s, count_waits), count_cpu) = drained(Consumer::Plain, count);
    let ((check_s, _), check_cpu) = drained(Consumer::Plain, |m, scratch| {
        u64::from(wire::check(m, scratch).unwrap().header.count)
    });
    // And one that counts as the first does, through the recorder's own
    // durable consumer, acknowledging as the recorder does: what
    // JetStream's acknowledged delivery costs, apart from the recorder.
    let ((acking_s, acking_waits), acking_cpu) = drained(Consumer::Acking, count);

    // 3. The recorder, the real binary, until the last event.
    // KVBM_FLEET_OUT: where the recording goes (a tmpfs separates what
    // the file system costs).
    let dir = match std::env::var_os("KVBM_FLEET_OUT").filter(|d| !d.is_empty()) {
        Some(d) => tempfile::tempdir_in(d),
        None => tempfile::tempdir(),
    }
    .unwrap();
    let bin = kvbm_testkit::bin::workspace_bin("kvbm-cli", "kvbm-recorder");
    let recorder = |out: std::path::PathBuf, extra: &[&str]| {
        Command::new(&bin)
            .args(["record", "--from", &url, "--out"])
            .arg(out)
            .args(["--events", &events.to_string()])
            .args(extra)
            .args(
                std::env::var("KVBM_FLEET_RECORDER_ARGS")
                    .unwrap_or_default()
                    .split_whitespace(),
            )
            .output()
            .unwrap()
    };
    let t = Instant::now();
    let (o, record_cpu) = with_cpu(server, CHILDREN, || recorder(dir.path().join("fleet"), &[]));
    let process_s = t.elapsed().as_secs_f64();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(&format!("recorded {events} events")), "{out}");
    // The recorder's own account: from its first message to its last log
    // closed (every log flushed, its sidecar written, JetStream
    // acknowledged) — the span the counting consumer is timed over, from
    // its first message to its last, plus the recorder's closing.
    let record_s = seconds_to(&out, "the last log closed");
    // Without the last checkpoint and the closing, which come once in a
    // recorder that runs for hours.
    let written_s = seconds_to(&out, "the last batch written");

    // 4. The recorder again, receiving only (`--receive-only`, a consumer
    // of its own): its loop, routing and acknowledgements as in 3, its
    // writer threads counting each message from its header: what its
    // receiving sustains without the writers' work beside the server.
    let o = recorder(
        dir.path().join("receive-only"),
        &["--receive-only", "--consumer", "bench-receive-only"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let only = String::from_utf8_lossy(&o.stdout);
    assert!(
        only.contains(&format!("received {events} events")),
        "{only}"
    );
    let receive_s = seconds_to(&only, "the last batch written");
    let split = out
        .lines()
        .find(|l| l.trim().starts_with("CPU: "))
        .and_then(RecorderCpu::parse);
    drop(nats);
    Run {
        store: if file_store { "file" } else { "memory" },
        events,
        bytes,
        publish_s,
        count_s,
        check_s,
        acking_s,
        record_s,
        written_s,
        receive_s,
        process_s,
        cpu: [publish_cpu, count_cpu, check_cpu, acking_cpu, record_cpu],
        split,
        recorder_notes: notes(&out),
        receive_notes: notes(&only),
        consumer_notes: [("counting", count_s, count_waits), ("acknowledging", acking_s, acking_waits)]
            .map(|(name, s, (times, waited))| {
                format!(
                    "the {name} consumer: waited for deliveries {times} times, {:.3} s in all, of {s:.3} s from the first message to the last",
                    waited.as_secs_f64()
                )
            })
            .to_vec(),
    }
}

/// Seconds from the first message to `to`, as the recorder reports them.
fn seconds_to(out: &str, to: &str) -> f64 {
    out.lines()
        .find_map(|l| {
            l.trim()
                .split_once(&format!(" s from the first message to {to}"))
                .and_then(|(v, _)| v.parse::<f64>().ok())
        })
        .unwrap_or_else(|| panic!("no timing to {to} in the recorder's output: {out}"))
}

/// The lines of the recorder's report that say what bounded it.
fn notes(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| {
            l.contains("checkpoints")
                || l.contains("unacknowledged messages")
                || l.contains("full writer queue")
                || l.contains("waited for deliveries")
                || l.contains("hand-offs to the writer threads")
                || l.trim().starts_with("CPU: ")
        })
        .map(|l| l.trim().to_string())
        .collect()
}

/// Which consumer drains the stream.
#[derive(Clone, Copy, PartialEq)]
enum Consumer {
    /// A fresh pull consumer that acknowledges nothing.
    Plain,
    /// The recorder's durable consumer (`consume::durable_messages`:
    /// acknowledge-all, its limit of unacknowledged messages, its pull
    /// batches), acknowledging the last message (waiting for the server's
    /// confirmation) every 10,000 messages or 200 ms, as the recorder
    /// does after each checkpoint.
    Acking,
}

/// Reads the whole stream with `consumer`, applying `per_message` to
/// each payload, which returns its event count; seconds from the first
/// message to the last, and its waits for deliveries (`DeliveryWaits`,
/// as the recorder times its own).
fn drain(
    rt: &tokio::runtime::Runtime,
    url: &str,
    limits: &StreamLimits,
    (messages, events): (u64, u64),
    consumer: Consumer,
    per_message: impl Fn(&[u8], &mut Vec<u8>) -> u64,
) -> (f64, (u64, Duration)) {
    rt.block_on(async {
        let client = connect(url, "bench-drain").await.unwrap();
        let js = async_nats::jetstream::new(client);
        let mut msgs = DeliveryWaits::new(match consumer {
            Consumer::Plain => {
                let stream = ensure_stream(&js, limits).await.unwrap();
                let c: async_nats::jetstream::consumer::PullConsumer = stream
                    .create_consumer(async_nats::jetstream::consumer::pull::Config {
                        ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                c.stream()
                    .max_messages_per_batch(consume::PULL_BATCH)
                    .messages()
                    .await
                    .unwrap()
            }
            Consumer::Acking => {
                let mut cfg = consume::DurableConfig::new("bench-acking");
                cfg.limits = *limits;
                consume::durable_messages(&js, &cfg).await.unwrap()
            }
        });
        let (mut n, mut ev, mut unacked) = (0u64, 0u64, 0u64);
        let mut scratch = Vec::new();
        let (mut t, mut acked) = (None, Instant::now());
        while n < messages {
            let m = msgs.next().await.unwrap().unwrap();
            t.get_or_insert_with(Instant::now);
            ev += per_message(&m.payload, &mut scratch);
            n += 1;
            unacked += 1;
            if consumer == Consumer::Acking
                && (unacked >= 10_000
                    || n == messages
                    || acked.elapsed() >= Duration::from_millis(200))
            {
                m.double_ack().await.unwrap();
                (unacked, acked) = (0, Instant::now());
            }
        }
        assert_eq!(ev, events);
        (
            t.map_or(0.0, |t| t.elapsed().as_secs_f64()),
            (msgs.times(), msgs.waited()),
        )
    })
}

/// Runs `emit` `n` times without pause; (wall ns, this thread's CPU ns)
/// per call.
fn per_emit(n: u64, mut emit: impl FnMut()) -> (f64, Option<f64>) {
    // The thread's own CPU time: what the engine's thread itself spends,
    // without the time it waits for a core.
    let (t, cpu) = (Instant::now(), ThreadTimer::start());
    for _ in 0..n {
        emit();
    }
    let per_call = |d: Duration| d.as_nanos() as f64 / n as f64;
    (per_call(t.elapsed()), cpu.elapsed().map(per_call))
}

/// Emits per timed burst when keeping up, as in the bus benchmark.
const BURST: u64 = 1000;

/// Runs `emit` `n` times in bursts of [`BURST`], only the bursts timed;
/// before each burst waits (untimed, sleeping, so the tap's consumer has
/// the core) until the tap's consumer has taken everything emitted so
/// far. (wall ns, this thread's CPU ns) per call.
fn per_emit_keeping_up(
    n: u64,
    bus: &kvbm_events::bus::EventBus<Event>,
    mut emit: impl FnMut(),
) -> (f64, Option<f64>) {
    let bursts = n.div_ceil(BURST);
    let samples: Vec<Cost> = (0..bursts)
        .map(|_| {
            while bus.counters().tap_queued > 0 {
                std::thread::sleep(Duration::from_micros(20));
            }
            per_emit(BURST, &mut emit)
        })
        .collect();
    // Bursts are all the same size: the mean of their per-call figures.
    let mean = |v: f64| v / bursts as f64;
    (
        mean(samples.iter().map(|s| s.0).sum()),
        samples.iter().map(|s| s.1).sum::<Option<f64>>().map(mean),
    )
}

/// (wall ns, CPU ns) per event.
type Cost = (f64, Option<f64>);

/// The engine's side, per event, in both regimes: with the publisher and
/// with the plain drain, flat out and keeping up; the publisher's losses
/// in each regime.
struct EngineCost {
    pub_flat: Cost,
    drain_flat: Cost,
    pub_kept: Cost,
    drain_kept: Cost,
    lost_flat: u64,
    lost_kept: u64,
}

/// The tap drained by a thread that only receives, as a baseline: the
/// drain thread and a flag that stops it.
fn plain_drain(
    mut tap: kvbm_events::bus::TapReceiver<Event>,
) -> (
    Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<u64>,
) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    let h = std::thread::spawn(move || {
        let mut k = 0u64;
        loop {
            match tap.try_recv() {
                Ok(TapItem::Event(_)) => k += 1,
                Ok(TapItem::Gap { .. }) => {}
                Err(_) => {
                    if s2.load(std::sync::atomic::Ordering::Acquire) {
                        break k;
                    }
                    std::thread::sleep(Duration::from_micros(500));
                }
            }
        }
    });
    (stop, h)
}

/// The engine's side: `Emitter::emit` with the tap drained by a publisher
/// connected to NATS, beside the tap drained by a thread that only
/// receives, in the same run, keeping up and flat out (ns per event,
/// median of rounds).
fn engine_cost(rt: &tokio::runtime::Runtime, n: u64, rounds: usize) -> EngineCost {
    let nats = NatsServer::start();
    let kind = EventKind::SlotTransition {
        from: SlotState::Prefilling,
        to: SlotState::Decoding,
    };
    let req: kvbm_events::RequestId = Arc::from("req-1");
    let (mut pub_flat, mut drain_flat, mut pub_kept, mut drain_kept) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut lost_flat, mut lost_kept) = (0, 0);
    // Each round takes one sample of every case, so the cases are
    // compared under the same conditions (this VM drifts from minute to
    // minute).
    for _ in 0..rounds {
        for keep_up in [false, true] {
            let measure = |e: &Emitter| {
                let emit = || e.emit(Some(&req), kind.clone());
                if keep_up {
                    per_emit_keeping_up(n, e.bus(), emit)
                } else {
                    per_emit(n, emit)
                }
            };
            let (with_pub, with_drain) = if keep_up {
                (&mut pub_kept, &mut drain_kept)
            } else {
                (&mut pub_flat, &mut drain_flat)
            };
            // Publisher.
            let e = Emitter::new(0, BusConfig::default(), Arc::new(MonotonicClock::new())).unwrap();
            let tap = e.bus().take_tap().unwrap();
            let p = Publisher::spawn(tap, PublisherConfig::new(nats.url(), "cost"), rt.handle())
                .unwrap();
            with_pub.push(measure(&e));
            let c =
                std::thread::scope(|s| s.spawn(|| p.stop(Duration::from_secs(30))).join().unwrap());
            *if keep_up {
                &mut lost_kept
            } else {
                &mut lost_flat
            } += c.lost();
            // Plain drain.
            let e = Emitter::new(0, BusConfig::default(), Arc::new(MonotonicClock::new())).unwrap();
            let (stop, h) = plain_drain(e.bus().take_tap().unwrap());
            with_drain.push(measure(&e));
            stop.store(true, std::sync::atomic::Ordering::Release);
            h.join().unwrap();
        }
    }
    // Medians of wall and CPU times, each on its own.
    let med = |v: &[Cost]| {
        let mid = |mut x: Vec<f64>| {
            x.sort_by(|a, b| a.total_cmp(b));
            x[x.len() / 2]
        };
        let cpu: Option<Vec<f64>> = v.iter().map(|p| p.1).collect();
        (mid(v.iter().map(|p| p.0).collect()), cpu.map(mid))
    };
    EngineCost {
        pub_flat: med(&pub_flat),
        drain_flat: med(&drain_flat),
        pub_kept: med(&pub_kept),
        drain_kept: med(&drain_kept),
        lost_flat,
        lost_kept,
    }
}

/// `KVBM_FLEET_PHASES=1`: what each part of the check a recorder makes of
/// a batch (`wire::check`) costs per event, on one thread, without NATS:
/// the same engines' batches, best of 7 passes.
fn phases() {
    let sets: Vec<Vec<Batch>> = (0..10)
        .map(|i| batches(&engine_events(100_000, i)))
        .collect();
    let all: Vec<&Vec<u8>> = sets.iter().flatten().map(|b| &b.2).collect();
    let events: u64 = sets.iter().flatten().map(|b| b.1).sum();
    // The block's length once decompressed, from the header.
    let raw_len = |m: &[u8]| u32::from_le_bytes(m[36..40].try_into().unwrap()) as usize;
    let raw: usize = all.iter().map(|m| raw_len(m)).sum();
    let wire: usize = all.iter().map(|m| m.len()).sum();
    println!(
        "{} messages, {events} events, {:.1} events/msg, raw {:.1} B/event, wire {:.1} B/event",
        all.len(),
        events as f64 / all.len() as f64,
        raw as f64 / events as f64,
        wire as f64 / events as f64
    );
    let mut scratch = vec![0u8; 4 << 20];
    let time = |name: &str, f: &mut dyn FnMut()| {
        let mut best = f64::MAX;
        for _ in 0..7 {
            let t = Instant::now();
            f();
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("{name:>12}: {:.2} ns/event", best * 1e9 / events as f64);
    };
    time("header", &mut || {
        for m in &all {
            std::hint::black_box(wire::header(m).unwrap());
        }
    });
    time("lz4", &mut || {
        for m in &all {
            let n = raw_len(m);
            lz4_flex::block::decompress_into(&m[wire::HEADER_BYTES..], &mut scratch[..n]).unwrap();
        }
    });
    let blocks: Vec<Vec<u8>> = all
        .iter()
        .map(|m| lz4_flex::block::decompress(&m[wire::HEADER_BYTES..], raw_len(m)).unwrap())
        .collect();
    time("verify", &mut || {
        for b in &blocks {
            std::hint::black_box(kvbm_schema::columnar::verify_block(b).unwrap());
        }
    });
    let views: Vec<_> = blocks
        .iter()
        .map(|b| kvbm_schema::columnar::verify_block(b).unwrap())
        .collect();
    time("span", &mut || {
        for v in &views {
            std::hint::black_box(v.span().unwrap());
        }
    });
    time("validate", &mut || {
        for v in &views {
            v.validate().unwrap();
        }
    });
    let mut sc = Vec::new();
    time("check", &mut || {
        for m in &all {
            std::hint::black_box(wire::check(m, &mut sc).unwrap().header);
        }
    });
}

fn main() {
    if std::env::var("KVBM_FLEET_PHASES").is_ok() {
        return phases();
    }
    let quick = kvbm_testkit::bench::quick();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Long enough that the recorder's fixed costs (a log per engine,
    // created and closed) are a small part of the run, as in a recorder
    // that runs for hours.
    let (engines, per) = if quick {
        (100, 2_000)
    } else {
        let per = std::env::var("KVBM_FLEET_PER_ENGINE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(300_000);
        (100, per)
    };
    println!(
        "{} CPUs; recorder arguments: {:?}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::env::var("KVBM_FLEET_RECORDER_ARGS").unwrap_or_default()
    );
    println!(
        "| store | engines | events | MB on the wire | publish (events/s) | counting consumer (events/s) | checking consumer (events/s) | acknowledging consumer: the recorder's, counting (events/s) | recorder, first message to last batch written (events/s) | recorder, first message to last log closed (events/s) | recorder / counting | recorder / checking | acknowledging / counting | recorder / acknowledging | recorder process, start to exit (events/s) | recorder receiving only, first message to last batch counted (events/s) | receiving only / acknowledging |"
    );
    println!(
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let mut runs = Vec::new();
    for file in [true, false] {
        let r = run_store(file, engines, per, &rt);
        let rate = |s: f64| r.events as f64 / s / 1e6;
        println!(
            "| {} | {engines} | {} | {:.1} | {:.2} M | {:.2} M | {:.2} M | {:.2} M | {:.2} M | {:.2} M | {:.0}% | {:.0}% | {:.0}% | {:.0}% | {:.2} M | {:.2} M | {:.0}% |",
            r.store,
            r.events,
            r.bytes as f64 / 1e6,
            rate(r.publish_s),
            rate(r.count_s),
            rate(r.check_s),
            rate(r.acking_s),
            rate(r.written_s),
            rate(r.record_s),
            100.0 * r.count_s / r.record_s,
            100.0 * r.check_s / r.record_s,
            100.0 * r.count_s / r.acking_s,
            100.0 * r.acking_s / r.record_s,
            rate(r.process_s),
            rate(r.receive_s),
            100.0 * r.acking_s / r.receive_s,
        );
        runs.push(r);
    }
    for r in &runs {
        for note in &r.consumer_notes {
            println!("({} store, {note})", r.store);
        }
        for note in &r.recorder_notes {
            println!("({} store, the recorder: {note})", r.store);
        }
        for note in &r.receive_notes {
            println!("({} store, the recorder receiving only: {note})", r.store);
        }
    }
    phase_cpu_table(&runs);
    recorder_cpu_table(&runs);
    engine_cost_table(&rt, quick);
}

/// The second table: each phase's CPU time an event, the server's and
/// the client's, and the rate that cost allows on this machine's cores.
fn phase_cpu_table(runs: &[Run]) {
    // Where the CPU goes: on a machine whose cores are all busy, a
    // consumer's rate is bound by the CPU time it and the server spend
    // per event.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!();
    println!(
        "| store | phase | nats-server CPU ns/event | client CPU ns/event (publisher or consumer) | in all | events/s {cpus} CPUs allow at that cost | measured events/s |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    for r in runs {
        let phases = [
            ("publishing (the bench's 100 tasks)", r.publish_s),
            ("counting consumer", r.count_s),
            ("checking consumer", r.check_s),
            (
                "acknowledging consumer (the recorder's, counting)",
                r.acking_s,
            ),
            ("recorder process, start to exit", r.process_s),
        ];
        for ((name, secs), cpu) in phases.into_iter().zip(r.cpu) {
            let per = |ns: Option<u64>| ns.map(|ns| ns as f64 / r.events as f64);
            let (server, client) = (per(cpu.server_ns), per(cpu.client_ns));
            let all = server.zip(client).map(|(a, b)| a + b);
            println!(
                "| {} | {name} | {} | {} | {} | {} | {:.2} M |",
                r.store,
                or_na(server),
                or_na(client),
                or_na(all),
                all.map_or_else(
                    || "n/a".to_string(),
                    |a| format!("{:.2} M", cpus as f64 * 1e3 / a)
                ),
                r.events as f64 / secs / 1e6,
            );
        }
    }
}

/// The third table: the recorder's CPU time an event by what its
/// threads do, beside the counting consumer's.
fn recorder_cpu_table(runs: &[Run]) {
    // With cores to spare for its writer threads, what can bound the
    // recorder is what they do not do: receiving and routing, beside the
    // counting consumer's whole client.
    println!();
    println!(
        "| store | counting consumer, client CPU ns/event (all its threads) | recorder: receiving and routing (its loop, its runtime's threads) | recorder: checking and writing (writer threads) | recorder: making checkpoints durable | recorder: elsewhere (starting, ending) | recorder process in all | receiving / counting consumer |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in runs {
        let count = r.cpu[1].client_ns.map(|ns| ns as f64 / r.events as f64);
        let Some(RecorderCpu(s)) = r.split else {
            println!(
                "| {} | {} | n/a | n/a | n/a | n/a | n/a | n/a |",
                r.store,
                or_na(count)
            );
            continue;
        };
        let per = s.map(|secs| secs * 1e9 / r.events as f64);
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
            r.store,
            or_na(count),
            per[0],
            per[1],
            per[2],
            per[3],
            per[4],
            count.map_or_else(|| "n/a".to_string(), |c| format!("{:.2}", per[0] / c)),
        );
    }
}

/// The last table: what publishing costs on the engine's thread, beside
/// a tap drained by a thread that only receives.
fn engine_cost_table(rt: &tokio::runtime::Runtime, quick: bool) {
    let (n, rounds) = if quick { (200_000, 3) } else { (2_000_000, 5) };
    let c = engine_cost(rt, n, rounds);
    println!();
    println!(
        "| on the engine's thread (Emitter::emit, {n} events a case, median of {rounds} interleaved rounds) | wall ns/event | the thread's CPU ns/event | publisher's losses (all rounds) |"
    );
    println!("|---|---:|---:|---:|");
    let row = |name: &str, c: Cost, lost: Option<u64>| {
        println!(
            "| {name} | {:.1} | {} | {} |",
            c.0,
            or_na(c.1),
            lost.map_or_else(|| "-".to_string(), |l| l.to_string())
        );
    };
    row(
        "keeping up: tap drained by the NATS publisher",
        c.pub_kept,
        Some(c.lost_kept),
    );
    row(
        "keeping up: tap drained by a thread that only receives (baseline)",
        c.drain_kept,
        None,
    );
    row(
        "flat out: tap drained by the NATS publisher",
        c.pub_flat,
        Some(c.lost_flat),
    );
    row(
        "flat out: tap drained by a thread that only receives (baseline)",
        c.drain_flat,
        None,
    );
}
