//! Where the scheduler side's time a step goes, phase by phase.
//!
//! The connector's calls run on vLLM's scheduler thread, and without async
//! scheduling every microsecond of them is wall time of the engine. The
//! benchmark (`bench.py`) prints these phases beside the time vLLM saw, so
//! that a regression names the phase that grew. A lap is two clock reads
//! (tens of ns), always on.

use std::time::{Duration, Instant};

/// A phase of the scheduler side's calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// `build_connector_meta`: reading vLLM's scheduler output (each
    /// running request's new tokens and blocks) into the step's input.
    Read,
    /// `build_connector_meta`: following what vLLM scheduled (slots,
    /// tokens, mirror blocks).
    Follow,
    /// The leader's plan of the step (stores, loads, slot transitions).
    Plan,
    /// Starting the step's loads.
    StartLoads,
    /// Waiting for the step's loads to reach the worker-bound queues.
    WaitShipped,
    /// Taking the batches off the remote engines and translating them.
    Ship,
    /// Late loads, preemptions, drained requests, finished slots.
    Settle,
    /// The pools' gauges.
    Gauges,
    /// `update_connector_output`: releasing the stores of the pass vLLM
    /// reported done.
    Trigger,
    /// `update_connector_output`: resolving the worker's reports.
    Resolve,
    /// `get_num_new_matched_tokens`, `update_state_after_alloc` and
    /// `request_finished`.
    Requests,
    /// `build_connector_meta`: the plan encoded for the worker.
    Encode,
    /// Following and planning a step on kvbm's runtime, after
    /// `build_connector_meta` returned, while vLLM waits for the worker
    /// (sync scheduling): off the engine's critical path.
    Background,
    /// Handing the deferred work to kvbm's runtime (waking its thread),
    /// after the call that left it returned.
    Wake,
}

impl Phase {
    /// This phase, or [`Background`](Phase::Background) for work that ran
    /// on kvbm's runtime.
    pub fn or_background(self, background: bool) -> Phase {
        if background { Phase::Background } else { self }
    }

    /// Every phase, in the order they are reported.
    pub const ALL: [Phase; 14] = [
        Phase::Read,
        Phase::Follow,
        Phase::Plan,
        Phase::StartLoads,
        Phase::WaitShipped,
        Phase::Ship,
        Phase::Settle,
        Phase::Gauges,
        Phase::Trigger,
        Phase::Resolve,
        Phase::Requests,
        Phase::Encode,
        Phase::Background,
        Phase::Wake,
    ];

    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Read => "read",
            Phase::Follow => "follow",
            Phase::Plan => "plan",
            Phase::StartLoads => "start_loads",
            Phase::WaitShipped => "wait_shipped",
            Phase::Ship => "ship",
            Phase::Settle => "settle",
            Phase::Gauges => "gauges",
            Phase::Trigger => "trigger",
            Phase::Resolve => "resolve",
            Phase::Requests => "requests",
            Phase::Encode => "encode",
            Phase::Background => "background",
            Phase::Wake => "wake",
        }
    }
}

/// Nanoseconds spent in each phase since the start.
#[derive(Debug, Default, Clone)]
pub struct Phases {
    ns: [u64; Phase::ALL.len()],
}

impl Phases {
    /// Adds the time since `*since` to `phase` and moves `*since` to now,
    /// so consecutive laps cover a call without gaps.
    pub fn lap(&mut self, phase: Phase, since: &mut Instant) {
        let now = Instant::now();
        self.add(phase, now.duration_since(*since));
        *since = now;
    }

    /// Adds `d` to `phase` (for work timed outside a lap).
    pub fn add(&mut self, phase: Phase, d: Duration) {
        let d = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.ns[phase as usize] = self.ns[phase as usize].saturating_add(d);
    }

    /// Each phase's mean µs a step over `steps` steps, by name.
    pub fn per_step_us(&self, steps: u64) -> serde_json::Map<String, serde_json::Value> {
        Phase::ALL
            .iter()
            .map(|p| {
                let us = self.ns[*p as usize] as f64 / 1e3 / steps.max(1) as f64;
                (
                    p.name().to_string(),
                    serde_json::json!((us * 10.0).round() / 10.0),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_add_up_to_the_call_and_land_in_their_phase() {
        let mut p = Phases::default();
        let start = Instant::now();
        let mut t = start;
        std::thread::sleep(Duration::from_millis(2));
        p.lap(Phase::Plan, &mut t);
        p.lap(Phase::Ship, &mut t);
        let total = start.elapsed().as_nanos() as u64;
        let got: u64 = p.ns.iter().sum();
        assert!(got <= total && got >= 2_000_000, "{got} of {total}");
        assert!(p.ns[Phase::Plan as usize] >= 2_000_000);
        let per = p.per_step_us(2);
        assert!(per["plan"].as_f64().unwrap() >= 1000.0, "{per:?}");
        assert_eq!(per["trigger"].as_f64(), Some(0.0));
        assert_eq!(per.len(), Phase::ALL.len());
    }
}
