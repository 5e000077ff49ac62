//! A thread of kvbm's that runs the work a step leaves for later while
//! vLLM waits for its worker, woken by a timer at the time the next step is
//! expected rather than by vLLM's thread.
//!
//! With sync scheduling vLLM's engine core hands each step to its worker
//! and then waits (spinning, with `sched_yield`) for the forward pass: the
//! scheduler side leaves the step's following and planning for that wait
//! (`SchedulerSide::run_deferred`). Someone must start that work. Waking a
//! sleeping thread from vLLM's thread is a system call that, between
//! forward passes, finds the kernel's and the sleeper's state out of the
//! caches: 15–25 µs on vLLM's critical path a step on the 2-core VM of the
//! benchmarks, half of what the connector costs there. Steps come at a
//! steady pace, though, so this thread sleeps with a timeout set to just
//! after the next step's work is expected, and finds it posted there
//! (an atomic flag; vLLM's thread makes no system call). Where the step
//! came later than expected, it looks again after a growing interval;
//! once the steps stop (an idle engine), it sleeps until vLLM's thread
//! wakes it, as it would have without the timer. Where vLLM calls again
//! before this thread ran the work, that call runs it (the side is shared
//! behind a mutex), so a late timer costs vLLM the work, never a wrong
//! order.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// Steps further apart than this are not a pace to time the next by: the
/// runner sleeps until woken.
const MAX_PERIOD_NS: u64 = 250_000_000;

/// Looks after a step came late, each after twice the last: an eighth of a
/// step, a quarter, a half, one step, two; then it sleeps until woken.
const LATE_LOOKS: u32 = 5;

/// The runner's next look is not planned (it sleeps until woken).
const NO_LOOK: u64 = u64::MAX;

/// What vLLM's thread and the runner share.
struct Shared {
    /// Work was posted and not yet taken.
    pending: AtomicBool,
    /// When the runner looks next, in ns since `epoch` (`NO_LOOK`: it
    /// sleeps until woken, and a post must wake it).
    look_at_ns: AtomicU64,
    stop: AtomicBool,
    /// The posts' pace, kept by the posting thread.
    last_ns: AtomicU64,
    period_ns: AtomicU64,
    epoch: Instant,
    /// Times vLLM's thread had to wake the runner.
    woken: AtomicU64,
    /// Times the runner looked and found nothing (a step later than
    /// expected, or none).
    missed: AtomicU64,
}

/// What the runner has done, for the connector's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RunnerCounters {
    /// Posts that found the runner asleep or due to look too late, so
    /// that vLLM's thread woke it.
    pub woken: u64,
    /// The runner's looks that found no work.
    pub missed: u64,
}

/// The runner thread and the handle vLLM's thread posts to.
pub struct Runner {
    shared: Arc<Shared>,
    thread: Thread,
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl Runner {
    /// Starts the runner thread `name`; `setup` runs first on it (its
    /// scheduling policy), then `work` once per post taken. `work` must
    /// not block for long: it should give up where the state it needs is
    /// busy (vLLM's next call then does the work).
    pub fn start<S, W>(name: &str, setup: S, mut work: W) -> std::io::Result<Self>
    where
        S: FnOnce() + Send + 'static,
        W: FnMut() + Send + 'static,
    {
        let shared = Arc::new(Shared {
            pending: AtomicBool::new(false),
            look_at_ns: AtomicU64::new(NO_LOOK),
            stop: AtomicBool::new(false),
            last_ns: AtomicU64::new(0),
            period_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            woken: AtomicU64::new(0),
            missed: AtomicU64::new(0),
        });
        let theirs = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                setup();
                run(&theirs, &mut work);
            })?;
        Ok(Runner {
            shared,
            thread: handle.thread().clone(),
            handle: Mutex::new(Some(handle)),
        })
    }

    /// Says that there is work; wakes the runner only where it would not
    /// look in time: it sleeps until woken, or its next look is more than
    /// half a step away (the pace changed). Returns whether it woke it.
    pub fn post(&self) -> bool {
        let s = &self.shared;
        let now = s.now_ns();
        let period = s.paced(now);
        // Paired with the runner's store to `look_at_ns` then load of
        // `pending` (both SeqCst): one of the two sees the other's store,
        // so a post is never left with the runner asleep.
        s.pending.store(true, Ordering::SeqCst);
        let look = s.look_at_ns.load(Ordering::SeqCst);
        if look == NO_LOOK || period.is_none_or(|p| look > now + p / 2) {
            s.woken.fetch_add(1, Ordering::Relaxed);
            self.thread.unpark();
            return true;
        }
        false
    }

    pub fn counters(&self) -> RunnerCounters {
        RunnerCounters {
            woken: self.shared.woken.load(Ordering::Relaxed),
            missed: self.shared.missed.load(Ordering::Relaxed),
        }
    }

    /// Stops the runner and waits for it (idempotent).
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.thread.unpark();
        let h = self.handle.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = h {
            // A panic in `work` already ended the thread; nothing to add.
            let _ = h.join();
        }
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Notes a post at `now` in the pace (one posting thread: vLLM's) and
    /// returns the pace, if the posts come closer than `MAX_PERIOD_NS`.
    fn paced(&self, now: u64) -> Option<u64> {
        let last = self.last_ns.swap(now, Ordering::Relaxed);
        let period = pace(self.period_ns.load(Ordering::Relaxed), last, now);
        self.period_ns.store(period, Ordering::Relaxed);
        (period > 0).then_some(period)
    }
}

/// The smoothed gap between posts (0: none) after one at `now`, the last
/// at `last` (0: none): a quarter of the newest gap, so that a long
/// prefill step moves it a little and a new pace takes a few steps; a gap
/// over `MAX_PERIOD_NS` clears it.
fn pace(period: u64, last: u64, now: u64) -> u64 {
    if last == 0 || now <= last {
        return period;
    }
    let gap = now - last;
    match period {
        _ if gap > MAX_PERIOD_NS => 0,
        0 => gap,
        p => (3 * p + gap) / 4,
    }
}

/// When to look, from the last post at `last` and the pace `period`, after
/// `late` looks that found nothing: one step and an eighth after the last
/// post at first, then each look twice as far after the one before;
/// `None` to sleep until woken.
fn next_look(last: u64, period: u64, late: u32) -> Option<u64> {
    if period == 0 || late > LATE_LOOKS {
        return None;
    }
    // p + p/8, then + p/8, p/4, p/2, p, 2p.
    let eighth = period / 8;
    let extra: u64 = (0..late).map(|i| eighth << i).sum();
    Some(last + period + eighth + extra)
}

fn run(s: &Shared, work: &mut dyn FnMut()) {
    let mut late = 0;
    loop {
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        if s.pending.swap(false, Ordering::SeqCst) {
            late = 0;
            work();
        } else if s.look_at_ns.load(Ordering::Relaxed) != NO_LOOK {
            s.missed.fetch_add(1, Ordering::Relaxed);
            late += 1;
        }
        let (last, period) = (
            s.last_ns.load(Ordering::Relaxed),
            s.period_ns.load(Ordering::Relaxed),
        );
        match next_look(last, period, late) {
            Some(at) => {
                s.look_at_ns.store(at, Ordering::SeqCst);
                // Until the look is due; an unpark before it (a post that
                // found the look too far, a stop, or one left over from a
                // post the runner had already seen) ends the wait only
                // when there is something to do.
                loop {
                    let now = s.now_ns();
                    if now >= at
                        || s.pending.load(Ordering::SeqCst)
                        || s.stop.load(Ordering::SeqCst)
                    {
                        break;
                    }
                    std::thread::park_timeout(Duration::from_nanos(at - now));
                }
            }
            None => {
                s.look_at_ns.store(NO_LOOK, Ordering::SeqCst);
                if s.pending.load(Ordering::SeqCst) || s.stop.load(Ordering::SeqCst) {
                    continue;
                }
                std::thread::park();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pace_is_the_smoothed_gap_and_lapses_after_a_long_one() {
        assert_eq!(pace(0, 0, 1_000_000), 0, "one post is no pace");
        assert_eq!(pace(0, 1_000_000, 3_000_000), 2_000_000);
        assert_eq!(pace(2_000_000, 3_000_000, 7_000_000), 2_500_000);
        assert_eq!(pace(2_500_000, 7_000_000, 7_000_000 + MAX_PERIOD_NS + 1), 0);
        // A clock that did not move leaves it as it was.
        assert_eq!(pace(2_000_000, 5, 5), 2_000_000);
    }

    #[test]
    fn looks_come_a_step_and_an_eighth_after_then_further_apart() {
        let p = 2_000_000;
        assert_eq!(next_look(3_000_000, 0, 0), None, "no pace: sleep");
        assert_eq!(next_look(3_000_000, p, 0), Some(3_000_000 + 2_250_000));
        assert_eq!(next_look(3_000_000, p, 1), Some(3_000_000 + 2_500_000));
        assert_eq!(next_look(3_000_000, p, 2), Some(3_000_000 + 3_000_000));
        assert_eq!(
            next_look(3_000_000, p, LATE_LOOKS),
            Some(3_000_000 + 10_000_000)
        );
        assert_eq!(next_look(3_000_000, p, LATE_LOOKS + 1), None);
    }

    fn counting() -> (Arc<Mutex<u32>>, Runner) {
        let runs = Arc::new(Mutex::new(0u32));
        let r = Arc::clone(&runs);
        let runner =
            Runner::start("kvbm-test-runner", || {}, move || *r.lock().unwrap() += 1).unwrap();
        (runs, runner)
    }

    fn wait_for(runs: &Mutex<u32>, n: u32) {
        let until = Instant::now() + Duration::from_secs(10);
        while *runs.lock().unwrap() < n {
            assert!(Instant::now() < until, "the runner never ran post {n}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Posts `n` times, `gap` apart, each once the one before has run.
    fn post_steadily(runner: &Runner, runs: &Mutex<u32>, n: u32, gap: Duration) {
        for i in 1..=n {
            runner.post();
            wait_for(runs, i);
            std::thread::sleep(gap);
        }
    }

    #[test]
    fn steady_posts_are_found_by_the_timer_not_woken_for() {
        let (runs, runner) = counting();
        // Posts 20 ms apart: the first two wake the runner (no pace yet);
        // from then on it is awake, looking at the expected time.
        post_steadily(&runner, &runs, 12, Duration::from_millis(20));
        let c = runner.counters();
        assert!(c.woken <= 4, "woken {} times of 12 steady posts", c.woken);
        runner.stop();
        assert_eq!(*runs.lock().unwrap(), 12);
    }

    #[test]
    fn after_the_posts_stop_it_sleeps_and_a_post_wakes_it() {
        let (runs, runner) = counting();
        post_steadily(&runner, &runs, 3, Duration::from_millis(5));
        // Looks that found nothing while the posts came (a loaded machine
        // makes the gaps uneven) are not this test's business: only those
        // after the last post. One more may land between this read and
        // the post, from the schedule of the post before.
        let missed_before = runner.counters().missed;
        runner.post();
        wait_for(&runs, 4);
        // Past every late look (about 5 periods after the last post) and
        // past the longest gap that still makes a pace.
        std::thread::sleep(Duration::from_nanos(MAX_PERIOD_NS + 50_000_000));
        let missed = runner.counters().missed;
        let after_last = missed - missed_before;
        assert!(
            after_last > 0 && after_last <= u64::from(LATE_LOOKS) + 2,
            "{after_last} empty looks after the last post"
        );
        let before = runner.counters().woken;
        assert!(
            runner.post(),
            "a post after the pace lapsed wakes the runner"
        );
        wait_for(&runs, 5);
        assert_eq!(runner.counters().woken, before + 1);
        // No pace after so long a gap: asleep, it looks no more.
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(runner.counters().missed, missed);
        runner.stop();
    }

    #[test]
    fn stop_ends_a_sleeping_runner() {
        let (_runs, runner) = counting();
        runner.stop();
        runner.stop();
    }
}
