//! Event bus benchmark: nanoseconds per `publish` of a 64-byte event with no
//! listener, with one live (broadcast) subscriber drained by a thread, with
//! the lossless tap drained by a thread, and with both; two baselines for
//! the tap, measured in the same run, each drained the same way (a thread
//! that polls and sleeps between polls as the tap's blocking receive does):
//! the ring the tap is built on (`rtrb`) alone, so the difference is the
//! bus's own cost, and a std `sync_channel`, which the tap was built on
//! before.
//!
//! Two regimes, because they answer different questions:
//!
//! - **keeping up**: bursts of 1,000 publishes, timed; between bursts
//!   (untimed) the publisher waits until the consumer has taken everything.
//!   This is the cost the engine pays per event while its observers keep up,
//!   the normal case: an engine emits far fewer events per second than a
//!   consumer can take.
//! - **flat out**: publishing without pause. A publisher this fast can
//!   outrun a consumer on another core, so the figure mixes in the (cheaper)
//!   drop path; the note gives the share dropped or lagged. It is a stress
//!   test of the accounting more than of speed.
//!
//! Consumer threads share the machine with the publisher, and on a small
//! virtual machine cross-core costs drift from minute to minute. So samples
//! are interleaved: each round takes one sample of every case, and each
//! case's figure is the median over rounds — cases are compared under the
//! same conditions.
//!
//! Run: `cargo bench -p kvbm-events --bench bus` (`KVBM_BENCH_QUICK=1` for a
//! short run). Prints a Markdown table for the README.

use kvbm_events::bus::{BusConfig, BusCounters, EventBus, FIRST_NAP, LAST_NAP, Received, TapItem};
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use kvbm_testkit::bench as common;

/// A small event, the size of a typical envelope plus a few fields.
#[derive(Clone, Copy)]
#[allow(dead_code)] // the fields are payload, only ever copied
struct Event {
    seq: u64,
    ts_ns: u64,
    fields: [u64; 6],
}
const _: () = assert!(std::mem::size_of::<Event>() == 64);

fn event(i: u64) -> Event {
    Event {
        seq: i,
        ts_ns: i.wrapping_mul(7),
        fields: [i; 6],
    }
}

/// Publishes per burst. Below the default broadcast capacity, so a
/// subscriber that keeps up never lags.
const BURST: u64 = 1000;

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// One benchmark case. `run` publishes `bursts * BURST` events and returns
/// the time to count (all of it flat out; only the bursts when keeping up).
trait Case {
    fn name(&self) -> String;
    fn run(&mut self, bursts: u64) -> Duration;
    /// Shuts the case down and describes what happened.
    fn finish(&mut self) -> String;
}

/// A received count a consumer thread publishes for the publisher to wait
/// on.
type Seen = Arc<AtomicU64>;

fn wait_for(seen: &Seen, n: u64) {
    while seen.load(Ordering::Acquire) < n {
        std::hint::spin_loop();
    }
}

/// Runs `bursts` bursts of `publish`; when `drained` is given, waits (untimed)
/// before each burst until it reports everything so far was taken.
fn bursts(
    n: u64,
    next: &mut u64,
    mut publish: impl FnMut(u64),
    mut drained: Option<&mut dyn FnMut(u64)>,
) -> Duration {
    let mut timed = Duration::ZERO;
    let wall = Instant::now();
    for _ in 0..n {
        if let Some(wait) = drained.as_mut() {
            wait(*next);
        }
        let t = Instant::now();
        for _ in 0..BURST {
            publish(*next);
            *next += 1;
        }
        timed += t.elapsed();
    }
    if drained.is_some() {
        timed
    } else {
        wall.elapsed()
    }
}

struct NoListener {
    bus: EventBus<Event>,
    next: u64,
}

impl Case for NoListener {
    fn name(&self) -> String {
        "no subscriber".into()
    }
    fn run(&mut self, n: u64) -> Duration {
        let bus = &self.bus;
        bursts(
            n,
            &mut self.next,
            |i| bus.publish(black_box(event(i))),
            None,
        )
    }
    fn finish(&mut self) -> String {
        "the lock, one counter and two flags read; the event is not cloned".into()
    }
}

/// A bus with a live subscriber and/or the tap, each drained by its own
/// thread one item at a time (the same shape as the baseline's consumer).
struct BusCase {
    bus: Option<EventBus<Event>>,
    live: Option<Seen>,
    tap: Option<Seen>,
    keep_up: bool,
    threads: Vec<thread::JoinHandle<()>>,
    next: u64,
}

impl BusCase {
    fn new(config: BusConfig, live: bool, tap: bool, keep_up: bool) -> Self {
        let bus = EventBus::new(config).unwrap();
        let mut threads = Vec::new();
        let live = live.then(|| {
            let mut sub = bus.subscribe();
            let seen = Seen::default();
            let s = Arc::clone(&seen);
            threads.push(thread::spawn(move || {
                // Lagged events count as seen: they are gone, and the
                // publisher must not wait for them.
                while let Some(item) = sub.blocking_recv() {
                    let n = match item {
                        Received::Event(e) => {
                            black_box(e);
                            1
                        }
                        Received::Lagged(k) => k,
                    };
                    s.fetch_add(n, Ordering::Release);
                }
            }));
            seen
        });
        let tap = tap.then(|| {
            let mut rx = bus.take_tap().unwrap();
            let seen = Seen::default();
            let s = Arc::clone(&seen);
            threads.push(thread::spawn(move || {
                while let Some(item) = rx.recv_blocking() {
                    let n = match item {
                        TapItem::Event(e) => {
                            black_box(e);
                            1
                        }
                        TapItem::Gap { dropped } => dropped,
                    };
                    s.fetch_add(n, Ordering::Release);
                }
            }));
            seen
        });
        BusCase {
            bus: Some(bus),
            live,
            tap,
            keep_up,
            threads,
            next: 0,
        }
    }

    fn counters(&self) -> BusCounters {
        self.bus
            .as_ref()
            .map(EventBus::counters)
            .unwrap_or_default()
    }
}

impl Case for BusCase {
    fn name(&self) -> String {
        let what = match (self.live.is_some(), self.tap.is_some()) {
            (true, false) => "one broadcast subscriber",
            (false, true) => "lossless tap",
            _ => "tap + one broadcast subscriber",
        };
        let how = if self.keep_up {
            "keeping up"
        } else {
            "flat out"
        };
        format!("{what}, {how}")
    }

    fn run(&mut self, n: u64) -> Duration {
        let Some(bus) = self.bus.as_ref() else {
            return Duration::ZERO;
        };
        let (live, tap) = (self.live.clone(), self.tap.clone());
        let mut wait = move |published: u64| {
            for seen in live.iter().chain(tap.iter()) {
                wait_for(seen, published);
            }
        };
        let drained: Option<&mut dyn FnMut(u64)> = self.keep_up.then_some(&mut wait);
        bursts(
            n,
            &mut self.next,
            |i| bus.publish(black_box(event(i))),
            drained,
        )
    }

    fn finish(&mut self) -> String {
        let c = self.counters();
        drop(self.bus.take());
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
        let mut parts = Vec::new();
        if self.live.is_some() {
            parts.push(format!(
                "subscriber lagged on {:.2}%",
                pct(c.lagged_total, c.published)
            ));
        }
        if self.tap.is_some() {
            parts.push(format!(
                "tap dropped and marked {:.2}%",
                pct(c.tap_dropped, c.tap_offered)
            ));
        }
        format!("{} of {} events", parts.join(", "), c.published)
    }
}

/// A baseline: the tap's ring alone, or std's bounded channel with
/// `try_send`, drained by a thread one item at a time.
struct Channel {
    tx: Option<Tx>,
    /// What it is, for the table (`tx` is gone once it has finished).
    what: &'static str,
    seen: Seen,
    keep_up: bool,
    drainer: Option<thread::JoinHandle<()>>,
    sent: u64,
    full: u64,
    next: u64,
}

/// A baseline's sending end.
enum Tx {
    Std(mpsc::SyncSender<Event>),
    Ring(rtrb::Producer<Event>),
}

/// Drains with `take` (an item, none yet, or the end) on a thread of its
/// own, sleeping between empty polls as the tap's blocking receive does.
fn polling_drainer(
    seen: &Seen,
    mut take: impl FnMut() -> Result<Event, bool> + Send + 'static,
) -> thread::JoinHandle<()> {
    let s = Arc::clone(seen);
    thread::spawn(move || {
        let mut nap = FIRST_NAP;
        loop {
            match take() {
                Ok(e) => {
                    black_box(e);
                    s.fetch_add(1, Ordering::Release);
                    nap = FIRST_NAP;
                }
                Err(true) => return,
                Err(false) => {
                    thread::sleep(nap);
                    nap = (nap * 2).min(LAST_NAP);
                }
            }
        }
    })
}

impl Channel {
    fn new(capacity: usize, ring: bool, keep_up: bool) -> Self {
        let seen = Seen::default();
        let (tx, drainer) = if ring {
            let (tx, mut rx) = rtrb::RingBuffer::<Event>::new(capacity);
            let d = polling_drainer(&seen, move || match rx.pop() {
                Ok(e) => Ok(e),
                // Abandoned: one more look, then the end.
                Err(_) if rx.is_abandoned() => rx.pop().map_err(|_| true),
                Err(_) => Err(false),
            });
            (Tx::Ring(tx), d)
        } else {
            let (tx, rx) = mpsc::sync_channel::<Event>(capacity);
            let d = polling_drainer(&seen, move || {
                rx.try_recv()
                    .map_err(|e| e == mpsc::TryRecvError::Disconnected)
            });
            (Tx::Std(tx), d)
        };
        Channel {
            tx: Some(tx),
            what: if ring {
                "the ring alone (rtrb push)"
            } else {
                "std sync_channel try_send"
            },
            seen,
            keep_up,
            drainer: Some(drainer),
            sent: 0,
            full: 0,
            next: 0,
        }
    }
}

impl Case for Channel {
    fn name(&self) -> String {
        let how = if self.keep_up {
            "keeping up"
        } else {
            "flat out"
        };
        format!("baseline: {}, {how}", self.what)
    }

    fn run(&mut self, n: u64) -> Duration {
        let Some(tx) = self.tx.as_mut() else {
            return Duration::ZERO;
        };
        let (sent, full) = (&mut self.sent, &mut self.full);
        // Rejected sends count as taken: nobody will take them.
        let rejected = std::cell::Cell::new(0u64);
        let seen = Arc::clone(&self.seen);
        let before = *full;
        let mut wait = |published: u64| wait_for(&seen, published - before - rejected.get());
        let drained: Option<&mut dyn FnMut(u64)> = self.keep_up.then_some(&mut wait);
        let d = bursts(
            n,
            &mut self.next,
            |i| {
                *sent += 1;
                let ok = match tx {
                    Tx::Std(tx) => tx.try_send(black_box(event(i))).is_ok(),
                    Tx::Ring(tx) => tx.push(black_box(event(i))).is_ok(),
                };
                if !ok {
                    rejected.set(rejected.get() + 1);
                }
            },
            drained,
        );
        *full += rejected.get();
        d
    }

    fn finish(&mut self) -> String {
        drop(self.tx.take());
        if let Some(d) = self.drainer.take() {
            d.join().unwrap();
        }
        format!(
            "same capacity as the tap, drained by a thread that polls as the tap's does; rejected as full {:.2}% of {} events",
            pct(self.full, self.sent),
            self.sent
        )
    }
}

fn main() {
    let (rounds, sample_time) = if common::quick() {
        (3, Duration::from_millis(30))
    } else {
        (15, Duration::from_millis(200))
    };
    let config = BusConfig::default();
    let mut cases: Vec<Box<dyn Case>> = vec![
        Box::new(NoListener {
            bus: EventBus::new(config).unwrap(),
            next: 0,
        }),
        Box::new(BusCase::new(config, true, false, true)),
        Box::new(BusCase::new(config, false, true, true)),
        Box::new(BusCase::new(config, true, true, true)),
        Box::new(Channel::new(config.tap_capacity, true, true)),
        Box::new(Channel::new(config.tap_capacity, false, true)),
        Box::new(BusCase::new(config, true, false, false)),
        Box::new(BusCase::new(config, false, true, false)),
        Box::new(Channel::new(config.tap_capacity, true, false)),
        Box::new(Channel::new(config.tap_capacity, false, false)),
    ];

    // Calibrate: how many bursts fill a sample (by wall time, waits
    // included, so that every case's sample lasts about as long).
    let per_sample: Vec<u64> = cases
        .iter_mut()
        .map(|c| {
            let mut n = 1u64;
            loop {
                let t = Instant::now();
                c.run(n);
                let took = t.elapsed();
                if took >= sample_time / 8 {
                    let scale = sample_time.as_secs_f64() / took.as_secs_f64();
                    break ((n as f64 * scale) as u64).max(1);
                }
                n *= 2;
            }
        })
        .collect();

    let mut results: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..rounds {
        for (i, c) in cases.iter_mut().enumerate() {
            let d = c.run(per_sample[i]);
            results[i].push(d.as_nanos() as f64 / (per_sample[i] * BURST) as f64);
        }
    }

    println!(
        "| bus benchmark (64-byte event; broadcast {}, tap {}) | ns/event | note |",
        config.broadcast_capacity, config.tap_capacity
    );
    println!("|---|---:|---|");
    let mut medians = Vec::new();
    for (c, mut r) in cases.iter_mut().zip(results) {
        r.sort_by(f64::total_cmp);
        let median = r[r.len() / 2];
        medians.push(median);
        let note = c.finish();
        println!(
            "| {} | {:.1} | {} (samples {:.1}–{:.1}) |",
            c.name(),
            median,
            note,
            r[0],
            r[r.len() - 1]
        );
    }
    println!();
    println!(
        "tap keeping up: {:.1} ns/event (target ≤ 100); the ring under it alone: {:.1} ns/event; a std sync_channel: {:.1} ns/event",
        medians[2], medians[4], medians[5]
    );
}
