//! kvbm's threads in vLLM's processes yield to vLLM's own.
//!
//! vLLM's engine core runs its scheduler on one thread and, between steps,
//! spins on its worker's results with `sched_yield`. kvbm's threads there
//! (the pipelines' runtime, the recorder, the attach server's feeder, the
//! NATS publisher) do work that can wait: moving stores to the worker's
//! queue, writing the log. At the default priority each of their wake-ups
//! preempts vLLM's scheduler thread on its core (on 2 cores, where vLLM
//! keeps one for its worker, that was 40–50 µs a step of vLLM's wall time);
//! at the lowest they run when vLLM's thread yields, and beside it where a
//! core is free. A thread inherits its creator's priority, so the scheduler
//! side is started on a thread that lowered its own (see
//! `SchedulerSide::start`), and the runtime's threads lower theirs as they
//! start (tokio may start more later, from vLLM's thread).

/// The nice value kvbm's threads take: the lowest priority of ordinary
/// threads.
pub const NICE: i32 = 19;

/// Lowers the calling thread's priority to [`NICE`]; returns whether it
/// could (an unprivileged thread can always lower its own; on systems
/// other than Linux this does nothing).
pub fn lower_this_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        // On Linux the nice value belongs to the thread, addressed by its
        // id (`setpriority(PRIO_PROCESS, 0, ..)` would do the same for the
        // caller, but says "process").
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) };
        let Ok(tid) = libc::id_t::try_from(tid) else {
            return false;
        };
        // SAFETY: setpriority reads only its arguments.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, NICE) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// The calling thread's nice value (Linux; `None` elsewhere or on error).
pub fn this_thread_nice() -> Option<i32> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: as above.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) };
        let tid = libc::id_t::try_from(tid).ok()?;
        // getpriority may return -1 legitimately: errno tells.
        // SAFETY: errno is this thread's.
        unsafe { *libc::__errno_location() = 0 };
        // SAFETY: getpriority reads only its arguments.
        let n = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
        // SAFETY: as above.
        (n != -1 || unsafe { *libc::__errno_location() } == 0).then_some(n)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_lowered_thread_and_the_threads_it_starts_run_at_the_lowest_priority() {
        let got = std::thread::spawn(|| {
            assert!(lower_this_thread());
            let child = std::thread::spawn(this_thread_nice).join().unwrap();
            (this_thread_nice(), child)
        })
        .join()
        .unwrap();
        assert_eq!(got, (Some(NICE), Some(NICE)));
    }
}
