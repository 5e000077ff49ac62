//! CPU time by thread: what the fleet recorder reports of where its CPU
//! went (receiving, checking and writing, making checkpoints durable).
//! With every core busy, a recorder's rate is bound by its CPU time per
//! event in all; with cores to spare for its writer threads, the part
//! they do not share (receiving) is what can bound it. The split says
//! which.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The calling thread's CPU time since it started (Linux's
/// `CLOCK_THREAD_CPUTIME_ID`); `None` where there is no such clock here.
pub fn thread_time() -> Option<Duration> {
    #[cfg(target_os = "linux")]
    {
        use rustix::time::{ClockId, clock_gettime};
        Some(from_timespec(clock_gettime(ClockId::ThreadCPUTime)))
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// The process's CPU time since it started, all its threads together
/// (those that ended included); `None` where there is no such clock here.
pub fn process_time() -> Option<Duration> {
    #[cfg(target_os = "linux")]
    {
        use rustix::time::{ClockId, clock_gettime};
        Some(from_timespec(clock_gettime(ClockId::ProcessCPUTime)))
    }
    #[cfg(not(target_os = "linux"))]
    None
}

#[cfg(target_os = "linux")]
fn from_timespec(t: rustix::time::Timespec) -> Duration {
    // The CPU clocks never go below zero.
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// The calling thread's CPU time from a start: [`ThreadTimer::start`],
/// then [`ThreadTimer::elapsed`] on the same thread.
#[derive(Debug, Clone, Copy)]
pub struct ThreadTimer(Option<Duration>);

impl ThreadTimer {
    /// Starts timing the calling thread.
    pub fn start() -> Self {
        ThreadTimer(thread_time())
    }

    /// The CPU time the calling thread has run since the start; `None`
    /// where there is no thread clock here.
    pub fn elapsed(&self) -> Option<Duration> {
        self.0.zip(thread_time()).map(|(a, b)| b.saturating_sub(a))
    }
}

/// CPU time summed over several threads, each adding its own.
#[derive(Debug, Default)]
pub struct CpuSum {
    ns: AtomicU64,
}

impl CpuSum {
    /// Adds `d`.
    pub fn add(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Adds the calling thread's CPU time so far: called as a thread ends,
    /// its whole life.
    pub fn add_this_thread(&self) {
        if let Some(d) = thread_time() {
            self.add(d);
        }
    }

    /// Runs `f`, adding the CPU time the calling thread spent in it.
    pub fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        let timer = ThreadTimer::start();
        let out = f();
        if let Some(d) = timer.elapsed() {
            self.add(d);
        }
        out
    }

    /// The sum so far.
    pub fn get(&self) -> Duration {
        Duration::from_nanos(self.ns.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hint::black_box;

    /// Spins until this thread has run `d` on a CPU (not merely waited).
    fn burn(d: Duration) {
        let start = thread_time().expect("a thread CPU clock");
        let mut x = 0u64;
        while thread_time().unwrap() - start < d {
            x = black_box(x.wrapping_mul(31).wrapping_add(1));
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn work_is_counted_on_the_thread_that_did_it_and_sleep_is_not() {
        let sum = CpuSum::default();
        // Sleeping costs no CPU; spinning does.
        sum.timed(|| std::thread::sleep(Duration::from_millis(50)));
        assert!(sum.get() < Duration::from_millis(20), "{:?}", sum.get());
        sum.timed(|| burn(Duration::from_millis(30)));
        let after_spin = sum.get();
        assert!(after_spin >= Duration::from_millis(30), "{after_spin:?}");
        // A thread's whole life, added as it ends.
        std::thread::scope(|s| {
            s.spawn(|| {
                burn(Duration::from_millis(40));
                sum.add_this_thread();
            });
        });
        assert!(sum.get() >= after_spin + Duration::from_millis(40));
        // The process's clock counts both threads' work.
        assert!(process_time().unwrap() >= Duration::from_millis(70));
    }
}
