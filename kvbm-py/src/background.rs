//! kvbm's threads in vLLM's processes do not preempt vLLM's own.
//!
//! vLLM's engine core runs its scheduler on one thread and, between steps,
//! spins on its worker's results with `sched_yield`. kvbm's threads there
//! (the pipelines' runtime, the recorder, the attach server's feeder, the
//! NATS publisher, the runner of a step's deferred work) are woken by the
//! scheduler thread's own calls (a store released, an event emitted) or
//! by a timer. At the default policy each wake-up
//! preempts the scheduler thread on its core, mid-call, so their work
//! lands on vLLM's critical path.
//!
//! They run as `SCHED_BATCH` instead: the same fair share of the CPU as
//! any thread (their weight is unchanged, so they are never starved: a
//! load the next step needs still ships in time), but a wake-up does not
//! preempt; they run when the scheduler thread yields, blocks or uses up
//! its slice, or on a core that is free. A lower priority (nice 19) was
//! tried first and starved them: with vLLM's thread spinning on the same
//! core they got too little CPU to ship a step's loads in time.
//!
//! A thread inherits its creator's policy, so the scheduler side is
//! started on a thread that set its own (see `SchedulerSide::start`), and
//! the runtime's threads set theirs as they start (tokio may start more
//! later, from vLLM's thread), as does the runner (`crate::deferred`).

/// Linux's `SCHED_BATCH` policy number, as `/proc/<tid>/stat` reports it.
pub const SCHED_BATCH: i32 = 3;

/// Moves the calling thread to `SCHED_BATCH`; returns whether it could (an
/// unprivileged thread may always move itself between the normal and batch
/// policies; on systems other than Linux this does nothing).
pub fn batch_this_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; `param` outlives the call.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// The calling thread's scheduling policy (Linux; `None` elsewhere or on
/// error).
pub fn this_thread_policy() -> Option<i32> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: pid 0 is the calling thread.
        let p = unsafe { libc::sched_getscheduler(0) };
        (p >= 0).then_some(p)
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
    fn a_batch_thread_and_the_threads_it_starts_run_as_batch() {
        let got = std::thread::spawn(|| {
            assert!(batch_this_thread());
            let child = std::thread::spawn(this_thread_policy).join().unwrap();
            (this_thread_policy(), child)
        })
        .join()
        .unwrap();
        assert_eq!(got, (Some(SCHED_BATCH), Some(SCHED_BATCH)));
        assert_eq!(libc::SCHED_BATCH, SCHED_BATCH);
    }

    #[test]
    fn other_threads_keep_the_normal_policy() {
        let other = std::thread::spawn(|| {
            assert!(batch_this_thread());
        });
        other.join().unwrap();
        assert_eq!(this_thread_policy(), Some(libc::SCHED_OTHER));
    }
}
