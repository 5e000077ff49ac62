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
//! fsyncs its logs need ([`Shards::reply`]). Once every thread has
//! replied, everything routed before the barrier is in the logs; the
//! caller runs the fsyncs, writes the merged manifest and acknowledges the
//! last message before the barrier, while the threads go on with what came
//! after it (group commit: the device's flush holds back acknowledgements,
//! never writes).
//!
//! Each thread's queue is bounded; routing waits when it is full, which
//! holds back the pull consumer (JetStream keeps the rest), and counts
//! each wait and its length ([`Counters::route_waits`]): one thread's full
//! queue stops the routing to all of them.

use crate::cpu::CpuSum;
use crate::fleet::{FleetError, FleetManifest, FleetWriter, Syncs, shard_of};
use crate::recorder::Recording;
use kvbm_attach::nats::async_nats;
use kvbm_attach::nats::consume;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::{Notify, mpsc};

/// What a writer thread is given.
enum Job {
    /// Delivered messages and their sequences in the stream.
    Batch(Vec<(async_nats::Message, u64)>),
    /// A barrier: checkpoint, then reply.
    Checkpoint(u64),
}

/// What a writer thread says back.
#[derive(Debug)]
pub enum Reply {
    /// Shard `shard` reached barrier `token` and checkpointed its logs
    /// ([`FleetWriter::checkpoint_detached`]); `manifest` is its part of
    /// the recording's manifest, `syncs` the fsyncs that make what it
    /// wrote before the barrier durable, left for the caller to run while
    /// the thread goes on writing.
    Checkpointed {
        /// Which thread.
        shard: usize,
        /// The barrier.
        token: u64,
        /// Its logs' entries and refusals.
        manifest: FleetManifest,
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

/// What the writer threads have done so far, together.
#[derive(Debug)]
pub struct Counters {
    written: AtomicU64,
    duplicates: AtomicU64,
    refused: AtomicU64,
    /// When the last batch was written, in ns after `start`.
    last_written_ns: AtomicU64,
    start: Instant,
    /// Woken after each batch written.
    written_batch: Notify,
    /// The writer threads' CPU time, each thread's added as it ends.
    cpu: CpuSum,
    /// Hand-offs that found their thread's queue full, and the ns the
    /// routing waited for them in all.
    route_waits: AtomicU64,
    route_wait_ns: AtomicU64,
}

impl Counters {
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

    /// Resolves once a batch has been written since the last call (or
    /// before the first). Cancel-safe.
    pub async fn written_batch(&self) {
        self.written_batch.notified().await;
    }

    /// The CPU time of the writer threads that have ended: all of it
    /// once [`Shards::finish`] has returned.
    pub fn writer_cpu(&self) -> std::time::Duration {
        self.cpu.get()
    }

    /// How many hand-offs found their writer thread's queue full, and how
    /// long the routing (all of it, for every thread) waited for them.
    pub fn route_waits(&self) -> (u64, std::time::Duration) {
        (
            self.route_waits.load(Ordering::Relaxed),
            std::time::Duration::from_nanos(self.route_wait_ns.load(Ordering::Relaxed)),
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

/// Adds the time from `since` to the routing's waits when dropped.
struct Waiting<'a> {
    counters: &'a Counters,
    since: Instant,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let ns = u64::try_from(self.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.counters.route_wait_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

/// What a writer thread leaves when it stops: each of its logs' directory
/// name and recording, and its part of the manifest.
#[derive(Debug)]
pub struct ShardEnd {
    /// Its logs, by directory name.
    pub recordings: Vec<(String, Recording)>,
    /// Its part of the manifest.
    pub manifest: FleetManifest,
}

/// The writer threads; see the module docs.
pub struct Shards {
    senders: Vec<mpsc::Sender<Job>>,
    replies: mpsc::Receiver<Reply>,
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

/// A writer thread is gone (it failed; [`Shards::finish`] says why).
#[derive(Debug, thiserror::Error)]
#[error("a fleet writer thread stopped")]
pub struct ShardGone;

impl Shards {
    /// Starts one thread per writer of `shards` (from
    /// [`FleetWriter::into_shards`]), each queueing at most `queue`
    /// messages.
    pub fn start(shards: Vec<FleetWriter>, queue: usize) -> std::io::Result<Shards> {
        let counters = Arc::new(Counters {
            written: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            last_written_ns: AtomicU64::new(0),
            start: Instant::now(),
            written_batch: Notify::new(),
            cpu: CpuSum::default(),
            route_waits: AtomicU64::new(0),
            route_wait_ns: AtomicU64::new(0),
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
                        let end = run(i, writer, rx, &reply_tx, &counters);
                        counters.cpu.add_this_thread();
                        end
                    })?,
            );
            senders.push(tx);
        }
        Ok(Shards {
            senders,
            replies,
            threads,
            counters,
        })
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

    /// Hands `batch` (messages and their sequences in the stream, all for
    /// [`thread_of`](Self::thread_of) `thread`, in the order delivered) to
    /// that thread; waits while its queue is full. Messages go in batches
    /// of what was delivered together, since waking a thread costs about
    /// what checking a small message does. A wait is counted
    /// ([`Counters::route_waits`]).
    pub async fn route(
        &self,
        thread: usize,
        batch: Vec<(async_nats::Message, u64)>,
    ) -> Result<(), ShardGone> {
        let job = match self.senders[thread].try_send(Job::Batch(batch)) {
            Ok(()) => return Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(ShardGone),
            Err(mpsc::error::TrySendError::Full(job)) => job,
        };
        self.counters.route_waits.fetch_add(1, Ordering::Relaxed);
        // Timed by a guard, so that a wait cut short (the recorder
        // stopping) still counts.
        let _waiting = Waiting {
            counters: &self.counters,
            since: Instant::now(),
        };
        self.senders[thread].send(job).await.map_err(|_| ShardGone)
    }

    /// Puts barrier `token` behind everything routed so far, on every
    /// thread.
    pub async fn begin_checkpoint(&self, token: u64) -> Result<(), ShardGone> {
        for s in &self.senders {
            s.send(Job::Checkpoint(token))
                .await
                .map_err(|_| ShardGone)?;
        }
        Ok(())
    }

    /// The next reply from a thread. Cancel-safe.
    pub async fn reply(&mut self) -> Option<Reply> {
        self.replies.recv().await
    }

    /// Stops the threads once they have written what they were given,
    /// closing every log: what each thread leaves, or the first error of
    /// a thread that failed.
    pub fn finish(self) -> Result<Vec<ShardEnd>, FleetError> {
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
) -> Result<ShardEnd, FleetError> {
    let failed = |e: FleetError| {
        let _ = replies.blocking_send(Reply::Failed {
            shard,
            error: e.to_string(),
        });
        e
    };
    let mut scratch = Vec::new();
    while let Some(job) = jobs.blocking_recv() {
        match job {
            Job::Batch(batch) => {
                for (msg, stream_seq) in batch {
                    let subject = msg.subject.as_str();
                    match consume::check_payload(subject, &msg.payload, stream_seq, &mut scratch) {
                        Ok((engine, c)) => {
                            let a = writer
                                .apply_block(engine, &c.header, c.block, c.lz4)
                                .map_err(failed)?;
                            counters.written.fetch_add(a.written, Ordering::Relaxed);
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
                let ns = counters.start.elapsed().as_nanos().max(1) as u64;
                counters.last_written_ns.fetch_max(ns, Ordering::Relaxed);
                counters.written_batch.notify_one();
            }
            Job::Checkpoint(token) => {
                let syncs = writer.checkpoint_detached().map_err(failed)?;
                let manifest = writer.manifest().clone();
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
    let manifest = writer.finish()?;
    Ok(ShardEnd {
        recordings,
        manifest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::merge_manifests;
    use crate::recorder::RecorderConfig;
    use kvbm_attach::nats::wire::BatchEncoder;

    /// A batch of `engine`'s events with seqs `seqs`, as a message.
    fn message(engine: &str, seqs: std::ops::Range<u64>) -> async_nats::Message {
        let mut enc = BatchEncoder::new(true);
        for seq in seqs {
            assert!(enc.push(&crate::fleet::tests::ev(seq), 1 << 20));
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
    /// threads, each queueing `queue` hand-offs: its base manifest and
    /// the threads.
    fn started(dir: &std::path::Path, threads: usize, queue: usize) -> (FleetManifest, Shards) {
        let w =
            FleetWriter::open(dir, "nats://test", Some("c"), RecorderConfig::default()).unwrap();
        let (base, parts) = w.into_shards(threads);
        (base, Shards::start(parts, queue).unwrap())
    }

    /// Engines split over threads are each written whole, in order; a
    /// barrier is answered by every thread with its part of the manifest,
    /// and the parts merge into the manifest of them all; a damaged
    /// message is counted on its engine.
    #[test]
    fn engines_split_over_threads_are_written_whole_and_their_manifests_merge() {
        let tmp = tempfile::tempdir().unwrap();
        let (base, mut shards) = started(tmp.path(), 3, 2);
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
                    shards
                        .route(shards.thread_of(Some(e)), vec![(m, round)])
                        .await
                        .unwrap();
                }
            }
            let bad = raw("c", b"KVBN not a batch".to_vec());
            shards
                .route(shards.thread_of(Some("c")), vec![(bad, 99)])
                .await
                .unwrap();
            shards.begin_checkpoint(1).await.unwrap();
            let mut parts = Vec::new();
            while parts.len() < shards.len() {
                match shards.reply().await.unwrap() {
                    Reply::Checkpointed {
                        token: 1,
                        manifest,
                        syncs,
                        ..
                    } => {
                        syncs.run().unwrap();
                        parts.push(manifest)
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
        assert_eq!((counters.written(), counters.refused()), (200, 1));
        let ends = shards.finish().unwrap();
        assert_eq!(ends.len(), 3);
        let recs: Vec<_> = ends.into_iter().flat_map(|e| e.recordings).collect();
        assert_eq!(recs.len(), engines.len());
        for (name, rec) in recs {
            assert_eq!(
                (rec.events, rec.first_seq, rec.last_seq, rec.lost),
                (40, Some(0), Some(39), 0),
                "{name}"
            );
        }
    }

    /// A writer thread held up (here: its replies not read) fills its
    /// queue; routing to it then waits, and the wait is counted and
    /// timed (a wait cut short too), where before a full queue stalled the
    /// routing unseen.
    #[test]
    fn routing_that_waits_on_a_full_queue_is_counted() {
        use std::time::Duration;
        let tmp = tempfile::tempdir().unwrap();
        let (_base, mut shards) = started(tmp.path(), 1, 1);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            // Room for two replies: the thread stops at the third, and
            // the queue (one hand-off) fills behind it.
            for token in 1..=3 {
                shards.begin_checkpoint(token).await.unwrap();
            }
            assert_eq!(shards.counters().route_waits().0, 0);
            let first = message("a", 0..10);
            tokio::time::timeout(Duration::from_secs(5), shards.route(0, vec![(first, 1)]))
                .await
                .expect("the queue had room for one hand-off")
                .unwrap();
            let second = message("a", 10..20);
            let cut = tokio::time::timeout(
                Duration::from_millis(60),
                shards.route(0, vec![(second, 2)]),
            )
            .await;
            assert!(cut.is_err(), "the second hand-off found room");
            for _ in 0..3 {
                shards.reply().await.unwrap();
            }
        });
        let (waits, waited) = shards.counters().route_waits();
        assert!(waits >= 1, "no wait counted");
        assert!(waited >= Duration::from_millis(50), "{waited:?}");
        let ends = shards.finish().unwrap();
        let rec = &ends[0].recordings[0].1;
        assert_eq!((rec.events, rec.last_seq), (10, Some(9)));
    }
}
