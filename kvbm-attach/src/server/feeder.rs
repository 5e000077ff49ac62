//! The feeder: drains an engine's lossless tap into the ring and wakes the
//! server.

use super::RingSignal;
use kvbm_events::Event;
use kvbm_events::bus::{TapItem, TapReceiver, TryRecvError};
use kvbm_events::ring::RingBuffer;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// How the feeder polls.
#[derive(Debug, Clone)]
pub struct FeederConfig {
    /// Sleep between polls of an empty tap. The engine never waits for the
    /// feeder (it publishes into the bounded tap; a full tap drops and
    /// counts), so this only sets the added latency.
    pub idle_poll: Duration,
    /// During a long burst, signal the server after this many events (it
    /// is signalled anyway whenever the tap runs dry).
    pub signal_every: usize,
}

impl Default for FeederConfig {
    fn default() -> Self {
        FeederConfig {
            idle_poll: Duration::from_micros(200),
            signal_every: 256,
        }
    }
}

/// What a feeder did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FeederStats {
    /// Events pushed into the ring.
    pub events: u64,
    /// Events the tap dropped (its gap markers), counted in the ring too.
    pub lost: u64,
}

/// A running feeder thread.
#[derive(Debug)]
pub struct Feeder {
    stop: Arc<AtomicBool>,
    join: Option<JoinHandle<FeederStats>>,
}

impl Feeder {
    /// True once the thread ended (the tap closed, or it was stopped).
    pub fn is_finished(&self) -> bool {
        self.join.as_ref().is_none_or(|j| j.is_finished())
    }

    /// Asks the feeder to end once the tap has nothing more to give (for an
    /// engine whose bus stays alive, e.g. because its breakpoints hold the
    /// emitter), and waits for it.
    pub fn stop(mut self) -> FeederStats {
        self.stop.store(true, Ordering::Release);
        self.join
            .take()
            .and_then(|j| j.join().ok())
            .unwrap_or_default()
    }

    /// Waits for the feeder to end by itself (the tap closing).
    pub fn join(mut self) -> FeederStats {
        self.join
            .take()
            .and_then(|j| j.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for Feeder {
    fn drop(&mut self) {
        // A dropped handle must not leave the thread spinning for ever.
        self.stop.store(true, Ordering::Release);
    }
}

/// Starts a thread draining `tap` into `ring`, signalling `signal` (from
/// [`ServedEngine::signal`](super::ServedEngine::signal)) after every burst. It polls
/// — takes all there is, then sleeps [`FeederConfig::idle_poll`] — so the
/// engine never pays for a wake-up. Ends when the tap closes or on
/// [`Feeder::stop`].
pub fn spawn_feeder(
    mut tap: TapReceiver<Event>,
    ring: Arc<RingBuffer>,
    signal: RingSignal,
    cfg: FeederConfig,
) -> std::io::Result<Feeder> {
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    signal.mark_attached();
    let join = std::thread::Builder::new()
        .name("kvbm-server-feeder".into())
        .spawn(move || feed(&mut tap, &ring, &signal, &cfg, &stop2))?;
    Ok(Feeder {
        stop,
        join: Some(join),
    })
}

fn feed(
    tap: &mut TapReceiver<Event>,
    ring: &RingBuffer,
    signal: &RingSignal,
    cfg: &FeederConfig,
    stop: &AtomicBool,
) -> FeederStats {
    let mut stats = FeederStats::default();
    let mut unsignalled = 0usize;
    let every = cfg.signal_every.max(1);
    let mut stop_seen = false;
    loop {
        match tap.try_recv() {
            Ok(TapItem::Event(ev)) => {
                let pos = ring.push(ev);
                stats.events += 1;
                unsignalled += 1;
                if unsignalled >= every {
                    unsignalled = 0;
                    signal.notify(pos + 1);
                }
            }
            Ok(TapItem::Gap { dropped }) => {
                ring.record_gap(dropped);
                stats.lost += dropped;
            }
            Err(TryRecvError::Empty) => {
                if unsignalled > 0 {
                    unsignalled = 0;
                    signal.notify(ring.counters().pushed);
                }
                if stop.load(Ordering::Acquire) {
                    // One more pass: events emitted before the stop may
                    // have come after the `Empty` above.
                    if !stop_seen {
                        stop_seen = true;
                        continue;
                    }
                    // The bus outlives this stop: losses at the end that
                    // no event carried are placed now, or never.
                    if let Some(TapItem::Gap { dropped }) = tap.take_uncarried() {
                        ring.record_gap(dropped);
                        stats.lost += dropped;
                    }
                    break;
                }
                std::thread::sleep(cfg.idle_poll);
            }
            Err(TryRecvError::Closed) => break,
        }
    }
    signal.notify(ring.counters().pushed);
    stats
}
