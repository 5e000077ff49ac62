//! A transfer engine that stands for the modelled model's link.
//!
//! The simulator's storages hold a few bytes per token so runs stay fast,
//! while the model it stands for (a Llama-3-8B-like one by default) has
//! about 128 KiB of KV per token. [`ModeledEngine`] wraps the engine that
//! really copies those few bytes and reports what the modelled copy would
//! have been:
//!
//! - **bytes**: the modelled bytes of the blocks moved (blocks × block size
//!   × KV bytes per token), so every byte figure downstream (the batch
//!   events, the pipeline's totals, the console, `/metrics`) is in the
//!   model's units; the bytes really copied stay on the inner engine's
//!   [`counters`](TransferEngine::counters);
//! - **time**, in real-time runs: a batch completes when the modelled link
//!   (PCIe or disk bandwidth, divided by the run's speed) would have moved
//!   it, and batches queue behind each other on that link, so transfers are
//!   visibly in flight and the transfer latencies mean something. In
//!   virtual-time runs the copy is made on the submitting thread and
//!   completes at once, reporting the modelled link time (the engine's
//!   clock already charges it to the iteration that waits for a load): no
//!   other thread finishes anything, so a run's events do not depend on how
//!   fast this machine is.

use kvbm_core::transfer::{
    BlockPair, EngineCounters, Hold, Rejected, TransferEngine, TransferStats, TransferTicket,
};
use kvbm_events::tier::Tier;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a [`ModeledEngine`] turns blocks into bytes and time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// Modelled bytes of one block.
    pub bytes_per_block: u64,
    /// The link's modelled bandwidth, bytes per second.
    pub bytes_per_s: f64,
    /// Real-time speed-up (`None`: virtual time, no waiting).
    pub speed: Option<f64>,
}

impl LinkModel {
    /// How long `blocks` occupy the link, in wall time.
    pub fn wall_time(&self, blocks: usize) -> Duration {
        match self.speed {
            Some(speed) => self.time_at(blocks, speed),
            None => Duration::ZERO,
        }
    }

    /// How long `blocks` occupy the modelled link in the model's own time
    /// (speed 1).
    pub fn link_time(&self, blocks: usize) -> Duration {
        self.time_at(blocks, 1.0)
    }

    fn time_at(&self, blocks: usize, speed: f64) -> Duration {
        let secs = blocks as f64 * self.bytes_per_block as f64 / self.bytes_per_s / speed;
        if secs.is_finite() && secs > 0.0 {
            // Capped so that a silly setting cannot stall a run for days.
            Duration::from_secs_f64(secs.min(3600.0))
        } else {
            Duration::ZERO
        }
    }
}

/// Wraps an engine so that it reports, and in real time takes, what the
/// modelled model's copy would. See the module doc.
pub struct ModeledEngine {
    inner: Arc<dyn TransferEngine>,
    model: LinkModel,
    /// When the modelled link is next free (batches queue behind it).
    busy_until: Mutex<Instant>,
    runtime: tokio::runtime::Handle,
}

impl ModeledEngine {
    /// Wraps `inner`; completions are delayed on `runtime`'s timer.
    pub fn new(
        inner: Arc<dyn TransferEngine>,
        model: LinkModel,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        ModeledEngine {
            inner,
            model,
            busy_until: Mutex::new(Instant::now()),
            runtime,
        }
    }

    /// When a batch of `blocks` submitted now leaves the modelled link.
    fn reserve(&self, blocks: usize) -> Instant {
        let now = Instant::now();
        // A poisoned lock only means another submitter panicked between two
        // plain assignments; the instant inside is still meaningful.
        let mut busy = self.busy_until.lock().unwrap_or_else(|p| p.into_inner());
        let start = (*busy).max(now);
        *busy = start + self.model.wall_time(blocks);
        *busy
    }
}

impl TransferEngine for ModeledEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn source_tier(&self) -> Tier {
        self.inner.source_tier()
    }

    fn destination_tier(&self) -> Tier {
        self.inner.destination_tier()
    }

    /// The inner engine's counters: the bytes really copied.
    fn counters(&self) -> EngineCounters {
        self.inner.counters()
    }

    fn source_num_blocks(&self) -> usize {
        self.inner.source_num_blocks()
    }

    fn destination_num_blocks(&self) -> usize {
        self.inner.destination_num_blocks()
    }

    unsafe fn submit_holding(
        &self,
        pairs: Vec<BlockPair>,
        hold: Option<Hold>,
    ) -> Result<TransferTicket, Rejected> {
        let blocks = pairs.len();
        let bytes = (blocks as u64).saturating_mul(self.model.bytes_per_block);
        if self.model.speed.is_none() {
            // Virtual time: copied here, done now, timed by the model.
            // SAFETY: as below; the copy is over when this returns.
            let result = unsafe { self.inner.transfer_blocking(pairs) }.map(|real| TransferStats {
                blocks: real.blocks,
                bytes,
                elapsed: self.model.link_time(blocks),
            });
            let (completer, ticket) = TransferTicket::pending(self.inner.name());
            completer.complete(result, hold);
            return Ok(ticket);
        }
        let submitted = Instant::now();
        // SAFETY: the caller keeps the blocks off-limits until the ticket
        // returned here resolves, which is after the inner one resolves.
        let inner = unsafe { self.inner.submit_holding(pairs, hold) }?;
        let due = self.reserve(blocks);
        let (completer, ticket) = TransferTicket::pending(self.inner.name());
        self.runtime.spawn(async move {
            let (result, hold) = inner.finish().await;
            let result = result.map(|real| TransferStats {
                blocks: real.blocks,
                bytes,
                // The time the batch held the link, queueing on it
                // included, or the real copy's when that took longer.
                elapsed: real.elapsed.max(due.saturating_duration_since(submitted)),
            });
            // Delays only this batch's completion: the inner engine has
            // already moved on to the next one.
            // Only when there is a wait: tokio's timer rounds up to the
            // next millisecond, which in a virtual-time run (no link time)
            // cost a millisecond of wall time per batch the engine waited
            // for.
            if due > Instant::now() {
                tokio::time::sleep_until(due.into()).await;
            }
            completer.complete(result, hold);
        });
        Ok(ticket)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_core::layout::{Layout, LayoutConfig, LayoutKind};
    use kvbm_core::storage::HostStorage;
    use kvbm_core::transfer::MemcpyEngine;

    fn engines(speed: Option<f64>, rt: &tokio::runtime::Runtime) -> ModeledEngine {
        let layout = || {
            Layout::new(
                LayoutConfig {
                    num_blocks: 8,
                    num_layers: 1,
                    outer_dim: 1,
                    page_size: 4,
                    inner_dim: 2,
                    dtype_bytes: 1,
                },
                LayoutKind::FullyContiguous,
            )
            .unwrap()
        };
        let a = Arc::new(HostStorage::new(layout()).unwrap());
        let b = Arc::new(HostStorage::new(layout()).unwrap());
        let inner = Arc::new(MemcpyEngine::new(a, Tier::Device, b, Tier::Host).unwrap());
        ModeledEngine::new(
            inner,
            LinkModel {
                bytes_per_block: 1 << 20,
                // 100 MiB/s: a 4-block batch holds the link for 40 ms.
                bytes_per_s: 100.0 * (1 << 20) as f64,
                speed,
            },
            rt.handle().clone(),
        )
    }

    fn submit(e: &ModeledEngine, pairs: &[(u32, u32)]) -> TransferTicket {
        let pairs = pairs.iter().map(|&(s, d)| BlockPair::new(s, d)).collect();
        // SAFETY: nothing else touches these test storages.
        unsafe { e.submit(pairs) }.unwrap()
    }

    #[test]
    fn reports_modelled_bytes_and_keeps_the_real_ones_on_the_counters() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let e = engines(None, &rt);
        let s = submit(&e, &[(0, 0), (1, 1)]).wait_blocking().unwrap();
        assert_eq!(s.blocks, 2);
        assert_eq!(s.bytes, 2 << 20);
        // 4 tokens × 2 bytes per block really copied.
        assert_eq!(e.counters().bytes, 16);
    }

    #[test]
    fn in_real_time_batches_take_the_link_time_and_queue_behind_each_other() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let e = engines(Some(1.0), &rt);
        let t0 = Instant::now();
        let first = submit(&e, &[(0, 0), (1, 1), (2, 2), (3, 3)]);
        let second = submit(&e, &[(4, 4), (5, 5), (6, 6), (7, 7)]);
        let a = first.wait_blocking().unwrap();
        let after_first = t0.elapsed();
        let b = second.wait_blocking().unwrap();
        let after_second = t0.elapsed();
        assert!(after_first >= Duration::from_millis(40), "{after_first:?}");
        // The second batch waited for the first on the link.
        assert!(
            after_second >= Duration::from_millis(80),
            "{after_second:?}"
        );
        assert!(a.elapsed >= Duration::from_millis(40));
        // Submitted a moment after the first, it held the link (queueing
        // included) for about two batches' time.
        assert!(b.elapsed >= Duration::from_millis(75), "{:?}", b.elapsed);
    }

    #[test]
    fn speed_divides_the_link_time() {
        let m = LinkModel {
            bytes_per_block: 1000,
            bytes_per_s: 1e6,
            speed: Some(10.0),
        };
        assert_eq!(m.wall_time(10), Duration::from_millis(1));
        assert_eq!(LinkModel { speed: None, ..m }.wall_time(10), Duration::ZERO);
        assert_eq!(
            LinkModel {
                bytes_per_s: 0.0,
                ..m
            }
            .wall_time(10),
            Duration::ZERO
        );
    }
}
