//! A fleet recording written by several threads at once.
//!
//! Checking a batch (LZ4, the flatbuffers verifier, every value) and
//! writing it into its engine's log are most of a fleet recorder's work,
//! and one thread of it is slower than JetStream delivers. The engines'
//! logs are independent, so [`Shards`] gives each of `n` threads the
//! engines [`shard_of`] assigns it
//! ([`FleetWriter::into_shards`]): the thread that receives only routes a
//! message to its engine's thread, which checks it and writes it. An
//! engine's messages all go to one thread, in the order delivered, so its
//! seqs stay in order.
//!
//! A checkpoint is a barrier: [`Shards::begin_checkpoint`] puts one behind
//! everything already routed to every thread; each thread, on reaching it,
//! checkpoints its logs and replies with its part of the manifest and the
//! fsyncs its logs need ([`Replies`]). Once every thread has
//! replied, everything routed before the barrier is in the logs; the
//! caller runs the fsyncs, writes the merged manifest and acknowledges the
//! last message before the barrier, while the threads go on with what came
//! after it (group commit: the device's flush holds back acknowledgements,
//! never writes).
//!
//! Each thread's queue is bounded. A hand-off that finds its thread's
//! queue full waits in that thread's backlog (one batch a thread, which
//! later hand-offs to it join) and the others go ahead: one busy thread
//! does not hold back the rest. While any thread has a backlog the caller
//! takes no more messages ([`Shards::backlogged`]), which holds back the
//! pull consumer (JetStream keeps the rest) and bounds what waits here,
//! and goes on with its other work (checkpoint replies, acknowledgements)
//! while [`Shards::unblock`] waits for room. Each hand-off that found its
//! queue full is counted, and the time the receiving was held back is
//! timed ([`Counters::route_waits`]).
//!
//! A thread that has run out of work waits for its next hand-off, which
//! then has to wake it: a cross-thread wake on the receiving thread,
//! paid per hand-off when the threads have cores to spare. The caller can
//! have each thread's messages held until there are several
//! ([`Shards::set_handoff_batch`], flushed on a short timer), and the
//! hand-offs and waits are counted ([`Counters::handoffs`]).
//!
//! For measuring, the threads can instead only count each message's
//! events from its header ([`Work::CountOnly`]): what receiving and
//! routing sustain with the writer threads' work taken away.

use kvbm_attach::nats::async_nats;
use kvbm_attach::nats::{consume, wire};
use kvbm_recorder::cpu::CpuSum;
use kvbm_recorder::fleet::{FleetError, FleetManifest, FleetWriter, Syncs, shard_of};
use kvbm_recorder::recorder::Recording;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::{Notify, mpsc};

/// Delivered messages and their sequences in the stream.
pub type Batch = Vec<(async_nats::Message, u64)>;

/// What a writer thread is given.
enum Job {
    /// Delivered messages.
    Batch(Batch),
    /// A barrier: checkpoint, then reply.
    Checkpoint(u64),
}

/// What a writer thread says back.
#[derive(Debug)]
pub enum Reply {
    /// Shard `shard` reached barrier `token` and checkpointed its logs
    /// ([`FleetWriter::checkpoint_detached`]); `manifest` is its part of
    /// the recording's manifest if it changed since its last reply
    /// ([`FleetWriter::manifest_if_changed`]), `syncs` the fsyncs that make what it
    /// wrote before the barrier durable, left for the caller to run while
    /// the thread goes on writing.
    Checkpointed {
        /// Which thread.
        shard: usize,
        /// The barrier.
        token: u64,
        /// Its logs' entries and refusals, if they changed.
        manifest: Option<FleetManifest>,
        /// Its logs' fsyncs.
        syncs: Syncs,
    },
    /// Shard `shard` failed (a log could not be written) and stopped.
    Failed {
        /// Which thread.
        shard: usize,
        /// Why.
        error: String,
    },
}

/// What the writer threads do with each message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Work {
    /// Check it whole and write it into its engine's log.
    #[default]
    Record,
    /// Count its events from its header, and nothing else: nothing is
    /// checked or written (`record --receive-only`, for measuring).
    CountOnly,
}

/// What the writer threads have done so far, together.
#[derive(Debug)]
pub struct Counters {
    written: AtomicU64,
    duplicates: AtomicU64,
    refused: AtomicU64,
    /// When the last batch was written, in ns after `start`.
    last_written_ns: AtomicU64,
    start: Instant,
    /// Woken once `wake_at` events are written ([`Counters::written_reaches`]).
    written_batch: Notify,
    /// The written count a waiter waits for (`u64::MAX`: none). Only the
    /// batch that reaches it wakes the waiter: a wake per batch would
    /// cross threads tens of thousands of times a second for nothing.
    wake_at: AtomicU64,
    /// The writer threads' CPU time, each thread's added as it ends.
    cpu: CpuSum,
    /// Hand-offs that found their thread's queue full, the ns the
    /// receiving was held back for them in all, and since when (ns after
    /// `start`, 0 if not) it is held back now.
    route_waits: AtomicU64,
    route_wait_ns: AtomicU64,
    held_since_ns: AtomicU64,
    /// Batches handed to the writer threads, and those that ended a
    /// thread's wait for work: each such hand-off wakes the thread from
    /// the receiving thread, a cross-thread wake (a syscall, and on a
    /// virtual machine often an interrupt to another core) that a thread
    /// kept busy never needs.
    handoffs: AtomicU64,
    idle_waits: AtomicU64,
}

impl Counters {
    /// A hand-off is done: when, and the waiter woken if its count is
    /// reached.
    fn batch_done(&self) {
        let ns = self.start.elapsed().as_nanos().max(1) as u64;
        self.last_written_ns.fetch_max(ns, Ordering::Relaxed);
        if self.written.load(Ordering::SeqCst) >= self.wake_at.load(Ordering::SeqCst) {
            self.written_batch.notify_one();
        }
    }

    /// Events written in this session.
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    /// Events skipped as already written.
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }

    /// Messages refused as damaged or foreign.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Resolves once `n` events have been written in this session, woken
    /// by the batch that reaches it alone. Cancel-safe. One waiter at a
    /// time: a second replaces the first's target.
    pub async fn written_reaches(&self, n: u64) {
        // SeqCst on this store and the load below, and on the writer
        // threads' add and load: either this load sees their count, or
        // they see this target and wake (a wake with no waiter yet is
        // kept for the next `notified`).
        self.wake_at.store(n, Ordering::SeqCst);
        while self.written.load(Ordering::SeqCst) < n {
            self.written_batch.notified().await;
        }
    }

    /// The CPU time of the writer threads that have ended: all of it
    /// once [`Shards::finish`] has returned.
    pub fn writer_cpu(&self) -> std::time::Duration {
        self.cpu.get()
    }

    /// How many hand-offs found their writer thread's queue full, and how
    /// long the receiving was held back for them (a thread had a
    /// backlog), the time it is held back now included.
    pub fn route_waits(&self) -> (u64, std::time::Duration) {
        let now = match self.held_since_ns.load(Ordering::Relaxed) {
            0 => 0,
            since => self.now_ns().saturating_sub(since),
        };
        (
            self.route_waits.load(Ordering::Relaxed),
            std::time::Duration::from_nanos(
                self.route_wait_ns
                    .load(Ordering::Relaxed)
                    .saturating_add(now),
            ),
        )
    }

    /// Ns since `start`, at least 1 (0 stands for "not").
    fn now_ns(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// A thread's backlog began (the first while none had one).
    fn held(&self) {
        self.held_since_ns.store(self.now_ns(), Ordering::Relaxed);
    }

    /// No thread has a backlog any more.
    fn released(&self) {
        let since = self.held_since_ns.swap(0, Ordering::Relaxed);
        if since != 0 {
            let ns = self.now_ns().saturating_sub(since);
            self.route_wait_ns.fetch_add(ns, Ordering::Relaxed);
        }
    }

    /// Batches handed to the writer threads, and how many of them found
    /// their thread's queue empty and the thread waiting (so woke it from
    /// the receiving thread).
    pub fn handoffs(&self) -> (u64, u64) {
        (
            self.handoffs.load(Ordering::Relaxed),
            self.idle_waits.load(Ordering::Relaxed),
        )
    }

    /// When the last batch was written, if any was.
    pub fn last_written(&self) -> Option<Instant> {
        match self.last_written_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(self.start + std::time::Duration::from_nanos(ns)),
        }
    }
}

/// What a writer thread leaves when it stops: each of its logs' directory
/// name and recording, its part of the manifest and its logs' counts.
#[derive(Debug)]
pub struct ShardEnd {
    /// Its logs, by directory name.
    pub recordings: Vec<(String, Recording)>,
    /// Its part of the manifest.
    pub manifest: FleetManifest,
    /// Its logs open as it stopped, closed for want of events and reopened.
    pub open_logs: kvbm_recorder::fleet::OpenLogs,
}

/// The writer threads; see the module docs.
pub struct Shards {
    senders: Vec<mpsc::Sender<Job>>,
    /// Per thread, what found its queue full, in the order delivered.
    backlog: Vec<Option<Batch>>,
    /// Per thread, messages held until there are `handoff_batch` of them
    /// ([`Shards::set_handoff_batch`]); empty while the thread has a
    /// backlog (which later messages join instead).
    pending: Vec<Batch>,
    handoff_batch: usize,
    threads: Vec<JoinHandle<Result<ShardEnd, FleetError>>>,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for Shards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shards")
            .field("threads", &self.senders.len())
            .finish_non_exhaustive()
    }
}

/// The writer threads' replies to barriers.
#[derive(Debug)]
pub struct Replies(mpsc::Receiver<Reply>);

impl Replies {
    /// The next reply from a thread; `None` once every thread has
    /// stopped. Cancel-safe.
    pub async fn next(&mut self) -> Option<Reply> {
        self.0.recv().await
    }
}

/// A writer thread is gone (it failed; [`Shards::finish`] says why).
#[derive(Debug, thiserror::Error)]
#[error("a fleet writer thread stopped")]
pub struct ShardGone;

impl Shards {
    /// Starts one thread per writer of `shards` (from
    /// [`FleetWriter::into_shards`]), each queueing at most `queue`
    /// hand-offs; and their replies. The replies are apart so that a
    /// caller can wait for one while it waits for room
    /// ([`unblock`](Self::unblock)).
    pub fn start(
        shards: Vec<FleetWriter>,
        queue: usize,
        work: Work,
    ) -> std::io::Result<(Shards, Replies)> {
        let counters = Arc::new(Counters {
            written: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            last_written_ns: AtomicU64::new(0),
            start: Instant::now(),
            written_batch: Notify::new(),
            wake_at: AtomicU64::new(u64::MAX),
            cpu: CpuSum::default(),
            route_waits: AtomicU64::new(0),
            route_wait_ns: AtomicU64::new(0),
            held_since_ns: AtomicU64::new(0),
            handoffs: AtomicU64::new(0),
            idle_waits: AtomicU64::new(0),
        });
        // Room for one reply per thread per barrier, and one barrier is in
        // flight at a time.
        let (reply_tx, replies) = mpsc::channel(shards.len().max(1) * 2);
        let mut senders = Vec::with_capacity(shards.len());
        let mut threads = Vec::with_capacity(shards.len());
        for (i, writer) in shards.into_iter().enumerate() {
            let (tx, rx) = mpsc::channel(queue.max(1));
            let (reply_tx, counters) = (reply_tx.clone(), counters.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvbm-fleet-{i}"))
                    .spawn(move || {
                        let end = run(i, writer, rx, &reply_tx, &counters, work);
                        counters.cpu.add_this_thread();
                        end
                    })?,
            );
            senders.push(tx);
        }
        let shards = Shards {
            backlog: (0..senders.len()).map(|_| None).collect(),
            pending: (0..senders.len()).map(|_| Vec::new()).collect(),
            handoff_batch: 1,
            senders,
            threads,
            counters,
        };
        Ok((shards, Replies(replies)))
    }

    /// Threads.
    pub fn len(&self) -> usize {
        self.senders.len()
    }

    /// Always false: there is at least one thread.
    pub fn is_empty(&self) -> bool {
        self.senders.is_empty()
    }

    /// What the threads have done.
    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// The thread that writes `engine` (a message without one goes to the
    /// first, which refuses it).
    pub fn thread_of(&self, engine: Option<&str>) -> usize {
        engine.map_or(0, |e| shard_of(e, self.senders.len()))
    }

    /// Holds each thread's messages until it has `n` of them (at least
    /// 1, the default: each delivery's share goes at once), or until
    /// [`flush`](Self::flush). A thread that has run out of work waits,
    /// and each hand-off to a waiting thread is a cross-thread wake on
    /// the receiving thread; with cores to spare the writer threads wait
    /// often, and `n` messages a hand-off makes up to `n` times fewer
    /// wakes (fewer when the caller's timer flushes first). The caller
    /// flushes on a short timer, so a quiet engine's messages are not
    /// held.
    pub fn set_handoff_batch(&mut self, n: usize) {
        self.handoff_batch = n.max(1);
    }

    /// Some thread holds messages not yet handed over
    /// ([`set_handoff_batch`](Self::set_handoff_batch)).
    pub fn holds(&self) -> bool {
        self.pending.iter().any(|p| !p.is_empty())
    }

    /// Hands every thread the messages held for it, as
    /// [`route`](Self::route) does with a batch that is due.
    pub fn flush(&mut self) -> Result<(), ShardGone> {
        for thread in 0..self.pending.len() {
            if !self.pending[thread].is_empty() {
                let batch = std::mem::take(&mut self.pending[thread]);
                self.hand_off(thread, batch)?;
            }
        }
        Ok(())
    }

    /// Hands each thread its batch of `by_thread` (indexed by
    /// [`thread_of`](Self::thread_of); messages in the order delivered),
    /// without waiting, once it holds
    /// [`handoff_batch`](Self::set_handoff_batch) messages: a batch whose
    /// thread's queue is full becomes that thread's backlog, counted
    /// ([`Counters::route_waits`]), and one for a thread with a backlog
    /// already joins it. Messages go in batches, at least what was
    /// delivered together, since waking a thread costs about what
    /// checking a small message does.
    pub fn route(&mut self, by_thread: Vec<Batch>) -> Result<(), ShardGone> {
        for (thread, batch) in by_thread.into_iter().enumerate() {
            if batch.is_empty() {
                continue;
            }
            if let Some(waiting) = &mut self.backlog[thread] {
                waiting.extend(batch);
                continue;
            }
            let held = &mut self.pending[thread];
            let batch = if held.is_empty() {
                batch
            } else {
                held.extend(batch);
                std::mem::take(held)
            };
            if batch.len() >= self.handoff_batch {
                self.hand_off(thread, batch)?;
            } else {
                self.pending[thread] = batch;
            }
        }
        Ok(())
    }

    /// Hands `batch` to `thread` (which has no backlog) without waiting,
    /// or makes it the thread's backlog if its queue is full.
    fn hand_off(&mut self, thread: usize, batch: Batch) -> Result<(), ShardGone> {
        let batch = match self.senders[thread].try_send(Job::Batch(batch)) {
            Ok(()) => {
                self.counters.handoffs.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(ShardGone),
            Err(mpsc::error::TrySendError::Full(Job::Batch(b))) => b,
            Err(mpsc::error::TrySendError::Full(Job::Checkpoint(_))) => {
                unreachable!("a batch was sent")
            }
        };
        self.counters.route_waits.fetch_add(1, Ordering::Relaxed);
        if !self.backlogged() {
            self.counters.held();
        }
        self.backlog[thread] = Some(batch);
        Ok(())
    }

    /// Some thread has a backlog: take no more messages until
    /// [`unblock`](Self::unblock) has handed it over.
    pub fn backlogged(&self) -> bool {
        self.backlog.iter().any(Option::is_some)
    }

    /// Waits until a thread with a backlog has room and hands it its
    /// backlog; returns at once if none has one. Cancel-safe: a backlog
    /// not handed over stays.
    pub async fn unblock(&mut self) -> Result<(), ShardGone> {
        let waiting: Vec<usize> = (0..self.backlog.len())
            .filter(|&t| self.backlog[t].is_some())
            .collect();
        if waiting.is_empty() {
            return Ok(());
        }
        let senders = &self.senders;
        let room = waiting.iter().map(|&t| Box::pin(senders[t].reserve()));
        let (permit, i, _) = futures_util::future::select_all(room).await;
        let permit = permit.map_err(|_| ShardGone)?;
        if let Some(batch) = self.backlog[waiting[i]].take() {
            permit.send(Job::Batch(batch));
            self.counters.handoffs.fetch_add(1, Ordering::Relaxed);
        }
        if !self.backlogged() {
            self.counters.released();
        }
        Ok(())
    }

    /// Puts barrier `token` behind everything routed so far, on every
    /// thread (its backlog, or the messages held for it, handed over
    /// first).
    pub async fn begin_checkpoint(&mut self, token: u64) -> Result<(), ShardGone> {
        for ((s, waiting), held) in self
            .senders
            .iter()
            .zip(&mut self.backlog)
            .zip(&mut self.pending)
        {
            // A thread has a backlog or holds messages, never both.
            let due = waiting
                .take()
                .or_else(|| (!held.is_empty()).then(|| std::mem::take(held)));
            if let Some(batch) = due {
                s.send(Job::Batch(batch)).await.map_err(|_| ShardGone)?;
                self.counters.handoffs.fetch_add(1, Ordering::Relaxed);
            }
            s.send(Job::Checkpoint(token))
                .await
                .map_err(|_| ShardGone)?;
        }
        self.counters.released();
        Ok(())
    }

    /// Stops the threads once they have written what they were given,
    /// closing every log: what each thread leaves, or the first error of
    /// a thread that failed.
    pub fn finish(self) -> Result<Vec<ShardEnd>, FleetError> {
        // A backlog or messages held, left (the caller stopped on an
        // error), are written too, though never acknowledged:
        // redelivered, they are skipped as duplicates.
        for ((s, waiting), held) in self.senders.iter().zip(self.backlog).zip(self.pending) {
            let due = waiting.or_else(|| (!held.is_empty()).then_some(held));
            if let Some(batch) = due
                && s.blocking_send(Job::Batch(batch)).is_ok()
            {
                self.counters.handoffs.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.counters.released();
        drop(self.senders);
        let mut ends = Vec::with_capacity(self.threads.len());
        let mut first_error = None;
        for t in self.threads {
            match t.join() {
                Ok(Ok(end)) => ends.push(end),
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(p) => std::panic::resume_unwind(p),
            }
        }
        first_error.map_or(Ok(ends), Err)
    }
}

/// A writer thread: checks and writes each batch it is given, checkpoints
/// at each barrier; closes its logs when its queue closes.
fn run(
    shard: usize,
    mut writer: FleetWriter,
    mut jobs: mpsc::Receiver<Job>,
    replies: &mpsc::Sender<Reply>,
    counters: &Counters,
    work: Work,
) -> Result<ShardEnd, FleetError> {
    let failed = |e: FleetError| {
        let _ = replies.blocking_send(Reply::Failed {
            shard,
            error: e.to_string(),
        });
        e
    };
    let mut scratch = Vec::new();
    loop {
        let (job, waited) = match jobs.try_recv() {
            Ok(job) => (job, false),
            Err(mpsc::error::TryRecvError::Empty) => match jobs.blocking_recv() {
                Some(job) => (job, true),
                None => break,
            },
            Err(mpsc::error::TryRecvError::Disconnected) => break,
        };
        // The waits a hand-off ended (not a barrier's, nor the last, for
        // the queue to close).
        if waited && matches!(job, Job::Batch(_)) {
            counters.idle_waits.fetch_add(1, Ordering::Relaxed);
        }
        match job {
            Job::Batch(batch) if work == Work::CountOnly => {
                for (msg, _) in batch {
                    match wire::header(&msg.payload) {
                        Ok(h) => counters
                            .written
                            .fetch_add(u64::from(h.count), Ordering::SeqCst),
                        Err(_) => counters.refused.fetch_add(1, Ordering::Relaxed),
                    };
                }
                counters.batch_done();
            }
            Job::Batch(batch) => {
                for (msg, stream_seq) in batch {
                    let subject = msg.subject.as_str();
                    match consume::check_payload(subject, &msg.payload, stream_seq, &mut scratch) {
                        Ok((engine, c)) => {
                            let a = writer
                                .apply_block(engine, &c.header, c.block, c.lz4)
                                .map_err(failed)?;
                            counters.written.fetch_add(a.written, Ordering::SeqCst);
                            counters
                                .duplicates
                                .fetch_add(a.duplicates, Ordering::Relaxed);
                        }
                        Err(r) => {
                            counters.refused.fetch_add(1, Ordering::Relaxed);
                            eprintln!(
                                "refused message {} on {}: {}",
                                r.stream_seq, r.subject, r.error
                            );
                            writer.refused(r.engine.as_deref(), &r.error);
                        }
                    }
                }
                counters.batch_done();
            }
            Job::Checkpoint(token) => {
                let syncs = writer.checkpoint_detached().map_err(failed)?;
                let manifest = writer.manifest_if_changed().cloned();
                // The owner waits for every reply; if it is gone, so is
                // the recording's session.
                let _ = replies.blocking_send(Reply::Checkpointed {
                    shard,
                    token,
                    manifest,
                    syncs,
                });
            }
        }
    }
    let recordings = writer.recordings();
    let open_logs = writer.open_logs();
    let manifest = writer.finish()?;
    Ok(ShardEnd {
        recordings,
        manifest,
        open_logs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_attach::nats::wire::BatchEncoder;
    use kvbm_recorder::fleet::merge_manifests;
    use kvbm_recorder::recorder::RecorderConfig;

    /// A batch of `engine`'s events with seqs `seqs`, as a message.
    fn message(engine: &str, seqs: std::ops::Range<u64>) -> async_nats::Message {
        let mut enc = BatchEncoder::new(true);
        for seq in seqs {
            assert!(enc.push(&kvbm_events::testing::gauge(seq), 1 << 20));
        }
        let mut payload = Vec::new();
        enc.seal(7, 0, &mut payload).expect("a batch");
        raw(engine, payload)
    }

    fn raw(engine: &str, payload: Vec<u8>) -> async_nats::Message {
        async_nats::Message {
            subject: format!("kvbm.events.{engine}").into(),
            reply: None,
            payload: payload.into(),
            headers: None,
            status: None,
            description: None,
            length: 0,
        }
    }

    /// A fleet recording opened in `dir` and split over `threads` writer
    /// threads, each queueing `queue` hand-offs: its base manifest, the
    /// threads and their replies.
    fn started(
        dir: &std::path::Path,
        threads: usize,
        queue: usize,
    ) -> (FleetManifest, Shards, Replies) {
        let w =
            FleetWriter::open(dir, "nats://test", Some("c"), RecorderConfig::default()).unwrap();
        let (base, parts) = w.into_shards(threads);
        let (shards, replies) = Shards::start(parts, queue, Work::Record).unwrap();
        (base, shards, replies)
    }

    /// `msg`, and its stream seq, for its engine's thread alone.
    fn only_to(shards: &Shards, engine: &str, msg: async_nats::Message, seq: u64) -> Vec<Batch> {
        let mut by_thread: Vec<Batch> = vec![Vec::new(); shards.len()];
        by_thread[shards.thread_of(Some(engine))].push((msg, seq));
        by_thread
    }

    /// Engines split over threads are each written whole, in order; a
    /// barrier is answered by every thread with its part of the manifest,
    /// and the parts merge into the manifest of them all; a damaged
    /// message is counted on its engine.
    #[test]
    fn engines_split_over_threads_are_written_whole_and_their_manifests_merge() {
        let tmp = tempfile::tempdir().unwrap();
        let (base, mut shards, mut replies) = started(tmp.path(), 3, 2);
        let engines = ["a", "b", "c", "d", "e"];
        let threads: std::collections::BTreeSet<usize> =
            engines.iter().map(|e| shards.thread_of(Some(e))).collect();
        assert!(threads.len() > 1, "the engines all landed on one thread");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let merged = rt.block_on(async {
            for round in 0..4u64 {
                for e in engines {
                    let m = message(e, round * 10..round * 10 + 10);
                    shards.route(only_to(&shards, e, m, round)).unwrap();
                    while shards.backlogged() {
                        shards.unblock().await.unwrap();
                    }
                }
            }
            let bad = raw("c", b"KVBN not a batch".to_vec());
            shards.route(only_to(&shards, "c", bad, 99)).unwrap();
            shards.begin_checkpoint(1).await.unwrap();
            let mut parts = Vec::new();
            while parts.len() < shards.len() {
                match replies.next().await.unwrap() {
                    Reply::Checkpointed {
                        token: 1,
                        manifest,
                        syncs,
                        ..
                    } => {
                        syncs.run().unwrap();
                        parts.push(manifest.expect("a first reply carries the manifest"))
                    }
                    r => panic!("{r:?}"),
                }
            }
            // More events for a log each thread has: no part changed, so
            // none is sent again.
            for e in engines {
                shards
                    .route(only_to(&shards, e, message(e, 40..45), 100))
                    .unwrap();
            }
            shards.begin_checkpoint(2).await.unwrap();
            for _ in 0..shards.len() {
                match replies.next().await.unwrap() {
                    Reply::Checkpointed {
                        token: 2,
                        manifest,
                        syncs,
                        ..
                    } => {
                        syncs.run().unwrap();
                        assert!(manifest.is_none(), "{manifest:?}");
                    }
                    r => panic!("{r:?}"),
                }
            }
            merge_manifests(&base, &parts)
        });
        assert_eq!(merged.logs.len(), engines.len());
        assert_eq!(merged.logs["c"].refused, 1);
        assert_eq!(merged.logs["a"].refused, 0);
        let counters = shards.counters();
        assert_eq!((counters.written(), counters.refused()), (225, 1));
        let ends = shards.finish().unwrap();
        assert_eq!(ends.len(), 3);
        let recs: Vec<_> = ends.into_iter().flat_map(|e| e.recordings).collect();
        assert_eq!(recs.len(), engines.len());
        for (name, rec) in recs {
            assert_eq!(
                (rec.events, rec.first_seq, rec.last_seq, rec.lost),
                (45, Some(0), Some(44), 0),
                "{name}"
            );
        }
    }

    /// A waiter for a written count is woken by the batch that reaches
    /// it, not by each batch before it.
    #[test]
    fn written_reaches_wakes_its_waiter_at_the_target_alone() {
        use std::future::Future;
        use std::task::{Context, Poll, Wake, Waker};
        use std::time::Duration;
        struct Wakes(AtomicU64);
        impl Wake for Wakes {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let tmp = tempfile::tempdir().unwrap();
        let (_base, mut shards, _replies) = started(tmp.path(), 1, 4);
        let counters = shards.counters();
        let wakes = Arc::new(Wakes(AtomicU64::new(0)));
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let mut target = std::pin::pin!(counters.written_reaches(30));
        assert!(target.as_mut().poll(&mut cx).is_pending());
        let written = |n: u64| {
            let t = Instant::now();
            while counters.written() < n {
                assert!(t.elapsed() < Duration::from_secs(5), "{n} never written");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        for (i, seqs) in [0..10, 10..20].into_iter().enumerate() {
            shards
                .route(only_to(&shards, "a", message("a", seqs), i as u64))
                .unwrap();
        }
        written(20);
        // The writer thread wakes (or not) before it takes its next job.
        shards
            .route(only_to(&shards, "b", message("b", 0..1), 9))
            .unwrap();
        written(21);
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            0,
            "woken short of its target"
        );
        assert!(target.as_mut().poll(&mut cx).is_pending());
        shards
            .route(only_to(&shards, "a", message("a", 20..29), 3))
            .unwrap();
        written(30);
        let t = Instant::now();
        while wakes.0.load(Ordering::SeqCst) == 0 {
            assert!(t.elapsed() < Duration::from_secs(5), "never woken");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(target.as_mut().poll(&mut cx), Poll::Ready(()));
        shards.finish().unwrap();
    }

    /// A writer thread held up (here: its replies not read) fills its
    /// queue; what is routed to it then waits in its backlog, counted,
    /// and timed for as long as it waits, while the other thread is
    /// handed its messages at once and writes them; a wait cut short
    /// keeps the backlog, room hands it over, and a barrier goes behind
    /// it.
    #[test]
    fn a_full_queue_holds_back_its_thread_alone_and_is_counted() {
        use std::time::Duration;
        let tmp = tempfile::tempdir().unwrap();
        let (_base, mut shards, mut replies) = started(tmp.path(), 2, 1);
        let first = shards.thread_of(Some("a"));
        let other = ["b", "c", "d", "e", "f", "g", "h"]
            .into_iter()
            .find(|e| shards.thread_of(Some(e)) != first)
            .expect("an engine on the other thread");
        let counters = shards.counters();
        let written = |n: u64| {
            let counters = counters.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(5), counters.written_reaches(n))
                    .await
                    .is_ok()
            }
        };
        // One message for each engine, seqs `seqs`.
        let both = |shards: &Shards, seqs: std::ops::Range<u64>| {
            let mut by_thread = only_to(shards, "a", message("a", seqs.clone()), 1);
            by_thread[shards.thread_of(Some(other))].push((message(other, seqs), 2));
            by_thread
        };
        // Until every thread has taken everything queued for it.
        let taken = |shards: &Shards| {
            let t = Instant::now();
            while shards
                .senders
                .iter()
                .any(|s| s.capacity() < s.max_capacity())
            {
                assert!(t.elapsed() < Duration::from_secs(5), "a queue not taken");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            // The replies have room for four, two a thread: the threads'
            // six replies to three barriers fill it, and with one read,
            // one thread (whichever) has sent its three and goes on, the
            // other is held at its third, its queue empty.
            for token in 1..=3 {
                shards.begin_checkpoint(token).await.unwrap();
            }
            replies.next().await.unwrap();
            taken(&shards);
            assert_eq!(counters.route_waits().0, 0);
            // Each thread's queue has room for one hand-off: the free
            // thread writes its message, the held one's waits queued.
            shards.route(both(&shards, 0..5)).unwrap();
            assert!(!shards.backlogged(), "the queues had room for one hand-off");
            assert!(written(5).await, "neither thread wrote");
            // Now the held thread's queue is full: its hand-off waits in
            // its backlog, and the free thread is given its own at once.
            shards.route(both(&shards, 5..10)).unwrap();
            assert!(shards.backlogged(), "the held thread's hand-off found room");
            assert_eq!(
                counters.route_waits().0,
                1,
                "one hand-off found its queue full"
            );
            assert!(written(10).await, "a full queue held back the other thread");
            assert_eq!(counters.written(), 10, "the held thread wrote");
            let cut = tokio::time::timeout(Duration::from_millis(60), shards.unblock()).await;
            assert!(cut.is_err(), "room while the thread is held");
            assert!(shards.backlogged(), "a wait cut short lost its backlog");
            assert!(
                counters.route_waits().1 >= Duration::from_millis(50),
                "the wait so far is not counted"
            );
            // One more reply read: the held thread sends its third, writes
            // what it had queued, and has room for its backlog.
            replies.next().await.unwrap();
            tokio::time::timeout(Duration::from_secs(5), shards.unblock())
                .await
                .expect("no room once the thread went on")
                .unwrap();
            assert!(!shards.backlogged());
            assert!(written(20).await, "the backlog was not written");
            // The replies are full again: a fourth barrier holds both
            // threads, and with their queues full both hand-offs wait.
            shards.begin_checkpoint(4).await.unwrap();
            taken(&shards);
            shards.route(both(&shards, 10..15)).unwrap();
            shards.route(both(&shards, 15..20)).unwrap();
            assert_eq!(counters.route_waits().0, 3);
            // A barrier goes behind the backlogs: by the threads' replies
            // to it, the backlogs are written.
            let barrier = async {
                shards.begin_checkpoint(5).await.unwrap();
                assert!(!shards.backlogged());
            };
            let replies = async {
                let mut after = 0;
                while after < 2 {
                    if let Reply::Checkpointed { token: 5, .. } = replies.next().await.unwrap() {
                        after += 1;
                    }
                }
                counters.written()
            };
            let (_, at_barrier) = tokio::join!(barrier, replies);
            assert_eq!(at_barrier, 40, "the barrier overtook a backlog");
        });
        let (waits, waited) = counters.route_waits();
        assert_eq!(waits, 3);
        assert!(waited >= Duration::from_millis(50), "{waited:?}");
        let ends = shards.finish().unwrap();
        let got: Vec<_> = ends
            .into_iter()
            .flat_map(|e| e.recordings)
            .map(|(_, r)| (r.events, r.first_seq, r.last_seq))
            .collect();
        assert_eq!(
            got,
            [(20, Some(0), Some(19)); 2],
            "each engine whole, in order"
        );
    }

    /// With a hand-off batch of 3, messages are held until their thread
    /// has 3, or a flush, or a barrier (which goes behind them); every
    /// hand-off is counted, and so is a writer thread's wait for one.
    #[test]
    fn held_messages_go_at_the_batch_a_flush_or_a_barrier_and_are_counted() {
        let tmp = tempfile::tempdir().unwrap();
        let (_, mut shards, mut replies) = started(tmp.path(), 1, 4);
        shards.set_handoff_batch(3);
        let counters = shards.counters();
        let written_reaches = |n: u64| {
            let t = Instant::now();
            while counters.written() < n {
                assert!(
                    t.elapsed() < std::time::Duration::from_secs(10),
                    "{} of {n} events written",
                    counters.written()
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        };
        let mut seq = 0;
        let mut send = |shards: &mut Shards| {
            let m = message("a", seq * 10..seq * 10 + 10);
            shards.route(only_to(shards, "a", m, seq)).unwrap();
            seq += 1;
        };
        send(&mut shards);
        send(&mut shards);
        assert!(shards.holds());
        assert_eq!(counters.handoffs().0, 0, "handed over short of the batch");
        send(&mut shards);
        assert!(!shards.holds());
        assert_eq!(counters.handoffs().0, 1);
        written_reaches(30);
        // The thread has run out of work: the next hand-off wakes it.
        send(&mut shards);
        assert_eq!(counters.handoffs().0, 1);
        shards.flush().unwrap();
        assert_eq!(counters.handoffs().0, 2);
        written_reaches(40);
        let (_, idle_waits) = counters.handoffs();
        assert!(
            idle_waits >= 1,
            "the thread's wait for work was not counted"
        );
        // A barrier goes behind what is held.
        send(&mut shards);
        assert!(shards.holds());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            shards.begin_checkpoint(1).await.unwrap();
            match replies.next().await.unwrap() {
                Reply::Checkpointed { token: 1, .. } => {}
                r => panic!("{r:?}"),
            }
        });
        assert!(!shards.holds());
        assert_eq!(counters.written(), 50, "the barrier overtook held messages");
        assert_eq!(counters.handoffs().0, 3);
        let ends = shards.finish().unwrap();
        let (_, rec) = &ends[0].recordings[0];
        assert_eq!(
            (rec.events, rec.first_seq, rec.last_seq, rec.lost),
            (50, Some(0), Some(49), 0)
        );
    }
}
