//! Hooks around the engine's entry points, and breakpoints that pause them.
//!
//! The leader's entry points (`create_slot`, `get_num_new_matched_tokens`,
//! …) and the transfer executor are instrumented with two calls, made with a
//! [`CallInfo`] that says which entry point runs, for which request, in which
//! slot state and in which transfer direction:
//!
//! ```text
//! hooks.will_call(&call)      // HookCall{Will} event, user hook, breakpoint check
//! … the entry point's body …
//! hooks.finished_call(&call)  // HookCall{Finished} event, user hook
//! ```
//!
//! - [`HookSet`] is what the instrumented code holds. [`HookSet::none`] is
//!   the default and costs one well-predicted branch per call: no event, no
//!   virtual call, no lock, no allocation. It is *enabled* when an
//!   [`Emitter`], user [`Hooks`] or [`Breakpoints`] are attached. With an
//!   emitter attached, each `will_call` and each `finished_call` emits
//!   exactly one [`EventKind::HookCall`], whether or not user hooks are
//!   installed: the issue asks for one event per hook call, and the leader
//!   attaches the emitter exactly when an observer (console, recorder) is
//!   there to read them. Without an emitter nothing is emitted.
//! - [`Breakpoints`] match calls on slot state, request id (exact or
//!   prefix), transfer direction and entry point, and *block the calling
//!   thread* until a console resumes it, steps, clears the breakpoint, goes
//!   away ([`Breakpoints::release_owner`]) or the pause's deadline passes.
//!   Each pause emits one [`EventKind::BreakpointHit`] and one
//!   [`EventKind::Resumed`] saying why it went on.
//!
//! Why blocking, and why `std::sync` rather than tokio: the entry points are
//! synchronous functions on the engine's scheduler thread (like vLLM's KV
//! connector scheduler calls), and a paused engine is the point of a
//! breakpoint. So a pause parks the thread on a [`Condvar`] with a timeout.
//!
//! What this module must not do:
//!
//! - cost anything measurable when unused: the disabled [`HookSet`] is one
//!   branch, and [`Breakpoints::check`] with no breakpoint and no step armed
//!   is one atomic load (no lock — a test holds the lock on another thread
//!   and makes a million checks);
//! - leave an engine stuck: every pause has a deadline (60 s by default)
//!   after which it resumes by itself and says so (`Resumed { cause:
//!   Deadline }`). What a deadline does to the breakpoint depends on what
//!   the pause held up:
//!   - a *blocking* pause ([`Breakpoints::check`]: the engine's thread
//!     waited the whole deadline) removes its breakpoint, and every other
//!     call that breakpoint holds resumes too: nobody is attending to it,
//!     and a breakpoint left in place would stop the engine again at the
//!     very next matching call, one deadline after another;
//!   - a *held* request ([`Breakpoints::hold`]: the engine went on with
//!     its other requests) lets that request through that breakpoint from
//!     then on, and the breakpoint stays for the other requests: each
//!     request is held at most one deadline per breakpoint, and the engine
//!     never waited.
//!
//!   A server that takes breakpoints from the network also gives every
//!   breakpoint an owner (a connection, or a lease that expires) and
//!   removes it when the owner goes: see `kvbm_attach::server`.
//! - know about sockets, terminals or HTTP. The spec types derive serde so a
//!   server can carry them, but the server lives elsewhere.
//!
//! Callers must not hold a lock an observer needs while calling
//! [`HookSet::will_call`] / [`Breakpoints::check`]: the console has to be
//! able to look around while the engine is paused. And a pause on a tokio
//! worker thread blocks that worker: async callers (the transfer executor)
//! should check from a blocking context or accept that.
//!
//! ```
//! use kvbm_events::bus::BusConfig;
//! use kvbm_events::{Emitter, EntryPoint, MonotonicClock};
//! use kvbm_core::hooks::{Breakpoints, HookSet};
//! use kvbm_events::breakpoint::{BreakpointSpec, CallInfo};
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! let emitter = Arc::new(
//!     Emitter::new(0, BusConfig::default(), Arc::new(MonotonicClock::new())).unwrap(),
//! );
//! let breakpoints = Arc::new(Breakpoints::new(Some(emitter.clone()), Duration::from_secs(60)));
//! let hooks = HookSet::none()
//!     .with_emitter(emitter.clone())
//!     .with_breakpoints(breakpoints.clone());
//!
//! // A breakpoint on a request that this call does not belong to.
//! breakpoints
//!     .add(BreakpointSpec::default().with_request_prefix("other-"))
//!     .unwrap();
//! let call = CallInfo::new(EntryPoint::CreateSlot).with_request(Arc::from("req-1"));
//! hooks.will_call(&call); // does not pause
//! hooks.finished_call(&call);
//! assert_eq!(emitter.emitted(), 2); // HookCall{Will}, HookCall{Finished}
//! ```

use kvbm_events::breakpoint::{
    BreakpointError, BreakpointInfo, BreakpointSpec, CallInfo, DEFAULT_MAX_BREAKPOINTS,
    MAX_DEADLINE, MIN_DEADLINE, OwnerReleased, PausedCall, STEP_BREAKPOINT,
};
use kvbm_events::control::{BreakpointsView, Control, ControlCommand, ControlError, ControlResult};
use kvbm_events::{Emitter, EventKind, HookPhase, RequestId, ResumeCause};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------
// Calls and hooks
// ---------------------------------------------------------------------------

/// User code run around every instrumented entry point. Both methods do
/// nothing by default. They run on the engine's thread, inside the entry
/// point: keep them short, and never call back into the leader from them.
pub trait Hooks: Send + Sync {
    /// Before the entry point's body runs.
    fn will_call(&self, call: &CallInfo) {
        let _ = call;
    }

    /// After the entry point's body ran (also when it returned an error).
    fn finished_call(&self, call: &CallInfo) {
        let _ = call;
    }
}

#[derive(Clone, Default)]
struct HookInner {
    hooks: Option<Arc<dyn Hooks>>,
    emitter: Option<Arc<Emitter>>,
    breakpoints: Option<Arc<Breakpoints>>,
}

/// What an instrumented entry point holds: optional user [`Hooks`], an
/// optional [`Emitter`] for `HookCall` events and optional [`Breakpoints`].
///
/// Cheap to clone (one `Arc`). When nothing is attached
/// ([`HookSet::none`], also the `Default`) the `Option` inside is `None` and
/// [`will_call`](Self::will_call) / [`finished_call`](Self::finished_call)
/// are one inlined test of it — a branch that always goes the same way, so
/// the predictor gets it right — and nothing else. Callers that would do
/// work just to build a [`CallInfo`] can test [`is_enabled`](Self::is_enabled)
/// first.
#[derive(Clone, Default)]
pub struct HookSet {
    inner: Option<Arc<HookInner>>,
}

impl fmt::Debug for HookSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.inner.as_deref();
        f.debug_struct("HookSet")
            .field("hooks", &inner.is_some_and(|i| i.hooks.is_some()))
            .field("emitter", &inner.is_some_and(|i| i.emitter.is_some()))
            .field(
                "breakpoints",
                &inner.is_some_and(|i| i.breakpoints.is_some()),
            )
            .finish()
    }
}

impl HookSet {
    /// Nothing attached: every call is a single branch.
    pub const fn none() -> Self {
        HookSet { inner: None }
    }

    /// User hooks and/or an emitter; [`none`](Self::none) when both are
    /// `None`.
    pub fn new(hooks: Option<Arc<dyn Hooks>>, emitter: Option<Arc<Emitter>>) -> Self {
        if hooks.is_none() && emitter.is_none() {
            return HookSet::none();
        }
        HookSet {
            inner: Some(Arc::new(HookInner {
                hooks,
                emitter,
                breakpoints: None,
            })),
        }
    }

    fn update(self, f: impl FnOnce(&mut HookInner)) -> Self {
        // Configuration time, not the hot path: copy the few `Arc`s.
        let mut inner = self.inner.as_deref().cloned().unwrap_or_default();
        f(&mut inner);
        HookSet {
            inner: Some(Arc::new(inner)),
        }
    }

    /// Also runs these user hooks (replacing any set before).
    pub fn with_hooks(self, hooks: Arc<dyn Hooks>) -> Self {
        self.update(|i| i.hooks = Some(hooks))
    }

    /// Also emits one `HookCall` event per `will_call` / `finished_call` on
    /// this emitter (replacing any set before).
    pub fn with_emitter(self, emitter: Arc<Emitter>) -> Self {
        self.update(|i| i.emitter = Some(emitter))
    }

    /// Also checks these breakpoints in every `will_call`, after the event
    /// and the user hook, so a pause shows up in the stream right after
    /// the `HookCall{Will}` of the call it paused.
    pub fn with_breakpoints(self, breakpoints: Arc<Breakpoints>) -> Self {
        self.update(|i| i.breakpoints = Some(breakpoints))
    }

    /// Whether anything is attached.
    #[inline]
    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// The emitter, if one is attached.
    pub fn emitter(&self) -> Option<&Arc<Emitter>> {
        self.inner.as_deref().and_then(|i| i.emitter.as_ref())
    }

    /// The breakpoints, if attached.
    pub fn breakpoints(&self) -> Option<&Arc<Breakpoints>> {
        self.inner.as_deref().and_then(|i| i.breakpoints.as_ref())
    }

    /// Before an entry point runs: emits `HookCall{Will}` (with an
    /// emitter), runs the user hook, then checks the breakpoints — which may
    /// block this thread until the pause ends.
    #[inline]
    pub fn will_call(&self, call: &CallInfo) {
        if let Some(inner) = &self.inner {
            inner.will_call(call);
        }
    }

    /// Like [`will_call`](Self::will_call) for an entry point that can put
    /// its request off instead of blocking: the breakpoints are asked with
    /// [`Breakpoints::hold`]. On `Held` the caller answers "not yet" and
    /// still calls [`finished_call`](Self::finished_call).
    #[inline]
    pub fn will_call_or_hold(&self, call: &CallInfo) -> Verdict {
        match &self.inner {
            Some(inner) => inner.will_call_or_hold(call),
            None => Verdict::Go,
        }
    }

    /// After an entry point ran: emits `HookCall{Finished}` (with an
    /// emitter) and runs the user hook.
    #[inline]
    pub fn finished_call(&self, call: &CallInfo) {
        if let Some(inner) = &self.inner {
            inner.finished_call(call);
        }
    }
}

impl HookInner {
    // Out of line so that the disabled path at each call site stays a
    // test and a jump.
    #[inline(never)]
    fn will_call(&self, call: &CallInfo) {
        self.emit(call, HookPhase::Will);
        if let Some(h) = &self.hooks {
            h.will_call(call);
        }
        if let Some(b) = &self.breakpoints {
            b.check(call);
        }
    }

    #[inline(never)]
    fn will_call_or_hold(&self, call: &CallInfo) -> Verdict {
        self.emit(call, HookPhase::Will);
        if let Some(h) = &self.hooks {
            h.will_call(call);
        }
        match &self.breakpoints {
            Some(b) => b.hold(call),
            None => Verdict::Go,
        }
    }

    #[inline(never)]
    fn finished_call(&self, call: &CallInfo) {
        self.emit(call, HookPhase::Finished);
        if let Some(h) = &self.hooks {
            h.finished_call(call);
        }
    }

    fn emit(&self, call: &CallInfo, phase: HookPhase) {
        if let Some(e) = &self.emitter {
            e.emit(
                call.request.as_ref(),
                EventKind::HookCall {
                    entry: call.entry,
                    phase,
                },
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Breakpoints
// ---------------------------------------------------------------------------

#[derive(Debug)]
struct Entry {
    spec: BreakpointSpec,
    hits: u64,
}

#[derive(Debug)]
struct Pause {
    breakpoint: u64,
    owner: Option<u64>,
    call: CallInfo,
    since: Instant,
    deadline: Instant,
    /// Set by whoever ends the pause; the paused thread alone removes the
    /// entry, after it has seen this — so a wakeup without it (spurious, or
    /// meant for another pause) just goes back to waiting.
    release: Option<ResumeCause>,
}

#[derive(Debug)]
struct Inner {
    /// By id, so the lowest matching id is the first found.
    breakpoints: BTreeMap<u64, Entry>,
    next_breakpoint: u64,
    max_breakpoints: usize,
    /// A step is armed: the next call pauses whatever it is.
    step: Option<StepArm>,
    paused: BTreeMap<u64, Pause>,
    next_pause: u64,
    default_deadline: Duration,
    /// Requests held without a thread waiting ([`Breakpoints::hold`]), by
    /// request: the pause that holds each.
    held: HashMap<RequestId, u64>,
    /// (breakpoint, request) pairs a held pause was released for: that
    /// breakpoint lets the request through from then on, so a request an
    /// engine asks about again and again is not held anew each time.
    passed: HashSet<(u64, RequestId)>,
}

#[derive(Debug, Clone, Copy)]
struct StepArm {
    owner: Option<u64>,
}

impl Inner {
    /// Marks unreleased pauses chosen by `pick` as released with `cause`;
    /// returns how many.
    fn release(&mut self, cause: ResumeCause, mut pick: impl FnMut(&Pause) -> bool) -> usize {
        let mut n = 0;
        for p in self.paused.values_mut() {
            if p.release.is_none() && pick(p) {
                p.release = Some(cause);
                n += 1;
            }
        }
        n
    }

    fn wants_checks(&self) -> bool {
        !self.breakpoints.is_empty() || self.step.is_some() || !self.held.is_empty()
    }

    /// The breakpoint (or step) that pauses `call`, if any, counting the
    /// hit and using up an armed step; `None` when nothing matches.
    fn matching(&mut self, call: &CallInfo) -> Option<(u64, Option<u64>)> {
        let step = self.step.take();
        let passed = &self.passed;
        let request = call.request.as_ref();
        let found = self.breakpoints.iter_mut().find(|(id, e)| {
            e.spec.matches(call) && request.is_none_or(|r| !passed.contains(&(**id, r.clone())))
        });
        match found {
            Some((&id, e)) => {
                e.hits += 1;
                Some((id, e.spec.owner))
            }
            None => step.map(|s| (STEP_BREAKPOINT, s.owner)),
        }
    }

    /// Registers a pause of `call` by `breakpoint`; its id and deadline.
    fn pause(&mut self, breakpoint: u64, owner: Option<u64>, call: &CallInfo) -> (u64, Duration) {
        let pause_id = self.next_pause;
        self.next_pause += 1;
        let deadline = self.default_deadline;
        let since = Instant::now();
        self.paused.insert(
            pause_id,
            Pause {
                breakpoint,
                owner,
                call: call.clone(),
                since,
                // In range by construction (at most MAX_DEADLINE); if the
                // platform's clock still cannot add it, a pause without a
                // deadline would break the promise, so end it now instead.
                deadline: since.checked_add(deadline).unwrap_or(since),
                release: None,
            },
        );
        (pause_id, deadline)
    }

    /// Ends held pause `pause_id` if it was released or its deadline
    /// passed: removes it, lets its request pass its breakpoint from now
    /// on, and returns what to announce.
    fn end_held(&mut self, pause_id: u64, now: Instant) -> Option<Ended> {
        let p = self.paused.get(&pause_id)?;
        let cause = match p.release {
            Some(c) => c,
            None if now >= p.deadline => ResumeCause::Deadline,
            None => return None,
        };
        let p = self.paused.remove(&pause_id)?;
        let request = p.call.request.clone();
        if let Some(r) = &request {
            self.held.remove(r);
            if p.breakpoint != STEP_BREAKPOINT {
                self.passed.insert((p.breakpoint, r.clone()));
            }
        }
        Some(Ended {
            breakpoint: p.breakpoint,
            request,
            cause,
        })
    }
}

/// A held pause that ended, to announce with a `Resumed` event.
struct Ended {
    breakpoint: u64,
    request: Option<RequestId>,
    cause: ResumeCause,
}

/// What [`Breakpoints::hold`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Go on.
    Go,
    /// The request is held by pause `pause_id`: put the call off and ask
    /// again later.
    Held {
        /// The pause (as [`Breakpoints::paused`] lists it).
        pause_id: u64,
    },
}

/// Breakpoints on the engine's entry points, shared as `Arc<Breakpoints>`
/// between the engine (which calls [`check`](Self::check)) and the console
/// (which adds, lists, resumes, steps and clears). See the module docs.
pub struct Breakpoints {
    /// True while a breakpoint exists or a step is armed: the only thing
    /// `check` reads otherwise. Written under the lock after every change.
    armed: AtomicBool,
    inner: Mutex<Inner>,
    /// Paused threads wait here; every release notifies all of them and
    /// each looks at its own pause.
    cond: Condvar,
    emitter: Option<Arc<Emitter>>,
    slow_checks: AtomicU64,
}

impl fmt::Debug for Breakpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.lock();
        f.debug_struct("Breakpoints")
            .field("armed", &self.is_armed())
            .field("breakpoints", &inner.breakpoints.len())
            .field("paused", &inner.paused.len())
            .field("default_deadline", &inner.default_deadline)
            .finish()
    }
}

impl Breakpoints {
    /// No breakpoints yet. Hits and resumes are emitted on `emitter`, if
    /// any. `default_deadline` is clamped to
    /// [`MIN_DEADLINE`]..=[`MAX_DEADLINE`] (a configuration value written
    /// by the program; commands go through the checked
    /// [`set_default_deadline`](Self::set_default_deadline)). At most
    /// [`DEFAULT_MAX_BREAKPOINTS`] breakpoints; see
    /// [`with_max_breakpoints`](Self::with_max_breakpoints).
    pub fn new(emitter: Option<Arc<Emitter>>, default_deadline: Duration) -> Self {
        Breakpoints {
            armed: AtomicBool::new(false),
            inner: Mutex::new(Inner {
                breakpoints: BTreeMap::new(),
                next_breakpoint: 1,
                max_breakpoints: DEFAULT_MAX_BREAKPOINTS,
                step: None,
                paused: BTreeMap::new(),
                next_pause: 1,
                default_deadline: default_deadline.clamp(MIN_DEADLINE, MAX_DEADLINE),
                held: HashMap::new(),
                passed: HashSet::new(),
            }),
            cond: Condvar::new(),
            emitter,
            slow_checks: AtomicU64::new(0),
        }
    }

    /// Caps the number of breakpoints at `max`.
    pub fn with_max_breakpoints(self, max: usize) -> Self {
        self.lock().max_breakpoints = max;
        self
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing under this lock can panic half-way through a change that
        // matters, so a poisoned lock's state is still sound.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes whether `check` must look further. Called with the lock
    /// held, so the flag follows the state in the order the changes happen.
    fn rearm(&self, inner: &Inner) {
        self.armed.store(inner.wants_checks(), Ordering::Release);
    }

    /// Whether a breakpoint exists or a step is armed, i.e. whether
    /// [`check`](Self::check) may pause.
    #[inline]
    pub fn is_armed(&self) -> bool {
        self.armed.load(Ordering::Acquire)
    }

    /// How many `check` calls went past the fast path (a breakpoint existed
    /// or a step was armed). Counted only there, so it costs the fast path
    /// nothing; tests use it to show that the fast path stays fast.
    pub fn slow_checks(&self) -> u64 {
        self.slow_checks.load(Ordering::Relaxed)
    }

    /// Adds a breakpoint; returns its id.
    pub fn add(&self, spec: BreakpointSpec) -> Result<u64, BreakpointError> {
        spec.validate()?;
        let mut inner = self.lock();
        if inner.breakpoints.len() >= inner.max_breakpoints {
            return Err(BreakpointError::Full {
                max: inner.max_breakpoints,
            });
        }
        let id = inner.next_breakpoint;
        inner.next_breakpoint += 1;
        inner.breakpoints.insert(id, Entry { spec, hits: 0 });
        self.rearm(&inner);
        Ok(id)
    }

    /// Removes breakpoint `id` and resumes the calls it paused (cause
    /// `Cleared`). `clear(STEP_BREAKPOINT)` disarms a pending step and
    /// resumes calls paused by a step. Returns whether there was anything
    /// to clear.
    pub fn clear(&self, id: u64) -> bool {
        let mut inner = self.lock();
        let existed = if id == STEP_BREAKPOINT {
            inner.step.take().is_some()
        } else {
            inner.breakpoints.remove(&id).is_some()
        };
        let resumed = inner.release(ResumeCause::Cleared, |p| p.breakpoint == id);
        self.rearm(&inner);
        drop(inner);
        if resumed > 0 {
            self.cond.notify_all();
        }
        existed || resumed > 0
    }

    /// Removes every breakpoint, disarms a pending step and resumes every
    /// paused call (cause `Cleared`). Returns the number of breakpoints
    /// removed.
    pub fn clear_all(&self) -> usize {
        let mut inner = self.lock();
        let n = inner.breakpoints.len();
        inner.breakpoints.clear();
        inner.step = None;
        let resumed = inner.release(ResumeCause::Cleared, |_| true);
        self.rearm(&inner);
        drop(inner);
        if resumed > 0 {
            self.cond.notify_all();
        }
        n
    }

    /// The breakpoints, by id.
    pub fn list(&self) -> Vec<BreakpointInfo> {
        self.lock()
            .breakpoints
            .iter()
            .map(|(&id, e)| BreakpointInfo {
                id,
                spec: e.spec.clone(),
                hits: e.hits,
            })
            .collect()
    }

    /// The calls paused now, by pause id. A call already told to resume
    /// but not yet gone is not listed.
    pub fn paused(&self) -> Vec<PausedCall> {
        let inner = self.lock();
        // Read under the lock: a pause registered while this waited for it
        // must not look as if it started after `now`.
        let now = Instant::now();
        inner
            .paused
            .iter()
            .filter(|(_, p)| p.release.is_none())
            .map(|(&pause_id, p)| PausedCall {
                pause_id,
                breakpoint: p.breakpoint,
                call: p.call.clone(),
                waited: now.saturating_duration_since(p.since),
                deadline_in: p.deadline.saturating_duration_since(now),
            })
            .collect()
    }

    /// Resumes one paused call (cause `Resume`). False when no such call
    /// is paused.
    pub fn resume(&self, pause_id: u64) -> bool {
        let mut inner = self.lock();
        let found = match inner.paused.get_mut(&pause_id) {
            Some(p) if p.release.is_none() => {
                p.release = Some(ResumeCause::Resume);
                true
            }
            _ => false,
        };
        drop(inner);
        if found {
            self.cond.notify_all();
        }
        found
    }

    /// Resumes every paused call (cause `Resume`); returns how many.
    pub fn resume_all(&self) -> usize {
        let mut inner = self.lock();
        let n = inner.release(ResumeCause::Resume, |_| true);
        drop(inner);
        if n > 0 {
            self.cond.notify_all();
        }
        n
    }

    /// A debugger's single step: resumes every paused call (cause `Step`)
    /// and arms a one-shot pause at the very next entry-point call, whatever
    /// it is. That pause reports [`STEP_BREAKPOINT`] unless a breakpoint
    /// matches the call too, in which case the breakpoint takes the hit
    /// (and the step is used up all the same). Returns whether a paused
    /// call was resumed; the step is armed either way.
    pub fn step(&self) -> bool {
        self.step_inner(None)
    }

    /// [`step`](Self::step) on behalf of client `owner`: if that client
    /// goes away ([`release_owner`](Self::release_owner)), the armed step is
    /// disarmed and the pause it caused is resumed.
    pub fn step_for(&self, owner: u64) -> bool {
        self.step_inner(Some(owner))
    }

    fn step_inner(&self, owner: Option<u64>) -> bool {
        let mut inner = self.lock();
        let n = inner.release(ResumeCause::Step, |_| true);
        inner.step = Some(StepArm { owner });
        self.rearm(&inner);
        drop(inner);
        if n > 0 {
            self.cond.notify_all();
        }
        n > 0
    }

    /// Client `owner` went away: removes its breakpoints, disarms a step it
    /// armed, and resumes the calls its breakpoints or steps paused (cause
    /// `ClientGone`), so an engine is never left waiting for a console that
    /// is not there. Other clients' breakpoints and pauses are untouched.
    pub fn release_owner(&self, owner: u64) -> OwnerReleased {
        let mut inner = self.lock();
        let before = inner.breakpoints.len();
        inner.breakpoints.retain(|_, e| e.spec.owner != Some(owner));
        let removed = before - inner.breakpoints.len();
        if inner.step.is_some_and(|s| s.owner == Some(owner)) {
            inner.step = None;
        }
        let resumed = inner.release(ResumeCause::ClientGone, |p| p.owner == Some(owner));
        self.rearm(&inner);
        drop(inner);
        if resumed > 0 {
            self.cond.notify_all();
        }
        OwnerReleased {
            breakpoints: removed,
            resumed,
        }
    }

    /// Every owner that holds something now: a breakpoint, the armed step,
    /// or a pause not yet released. What a lease or a client still has to
    /// answer for; [`release_owner`](Self::release_owner) of anyone else
    /// would do nothing.
    pub fn owners(&self) -> HashSet<u64> {
        let inner = self.lock();
        inner
            .breakpoints
            .values()
            .filter_map(|e| e.spec.owner)
            .chain(inner.step.and_then(|s| s.owner))
            .chain(
                inner
                    .paused
                    .values()
                    .filter(|p| p.release.is_none())
                    .filter_map(|p| p.owner),
            )
            .collect()
    }

    /// Sets the deadline of pauses that start from now on (pauses already
    /// running keep theirs).
    pub fn set_default_deadline(&self, deadline: Duration) -> Result<(), BreakpointError> {
        if !(MIN_DEADLINE..=MAX_DEADLINE).contains(&deadline) {
            return Err(BreakpointError::BadDeadline {
                got: deadline,
                min: MIN_DEADLINE,
                max: MAX_DEADLINE,
            });
        }
        self.lock().default_deadline = deadline;
        Ok(())
    }

    /// The deadline new pauses get.
    pub fn default_deadline(&self) -> Duration {
        self.lock().default_deadline
    }

    /// Called by an instrumented entry point before its body runs. If a
    /// breakpoint matches `call` (or a step is armed), blocks this thread
    /// until the pause ends; see the module docs. A pause that ends at its
    /// deadline removes the breakpoint that made it (and resumes the other
    /// calls it holds), so the engine is not stopped again at once.
    ///
    /// With no breakpoint and no step armed this is one atomic load and a
    /// return: no lock, no allocation, no event.
    #[inline]
    pub fn check(&self, call: &CallInfo) {
        if self.armed.load(Ordering::Acquire) {
            self.check_slow(call);
        }
    }

    #[cold]
    #[inline(never)]
    fn check_slow(&self, call: &CallInfo) {
        self.slow_checks.fetch_add(1, Ordering::Relaxed);
        let mut inner = self.lock();
        // The lowest matching id pauses, once; a step is used up by the
        // first call that gets here, matched or not.
        let Some((breakpoint, owner)) = inner.matching(call) else {
            self.rearm(&inner);
            return;
        };
        let (pause_id, deadline) = inner.pause(breakpoint, owner, call);
        self.rearm(&inner);
        drop(inner);

        // Emitted outside our lock so a console looking at the lists is not
        // held up by the bus. The pause is registered first, so a console
        // reacting to the event finds it in `paused()`.
        self.emit_hit(call, breakpoint, deadline);
        let cause = self.wait(pause_id);
        if cause == ResumeCause::Deadline && breakpoint != STEP_BREAKPOINT {
            self.expire(breakpoint);
        }
        self.emit_resumed(call.request.as_ref(), breakpoint, cause);
    }

    /// A blocking pause by `breakpoint` ran out its deadline: nobody is
    /// attending to it. The breakpoint is removed and every other call it
    /// holds resumes (cause `Deadline`); otherwise the very next matching
    /// call would stop the engine again at once, and a breakpoint whose
    /// owner is gone would keep it stopped one deadline after another.
    fn expire(&self, breakpoint: u64) {
        let mut inner = self.lock();
        inner.breakpoints.remove(&breakpoint);
        let resumed = inner.release(ResumeCause::Deadline, |p| p.breakpoint == breakpoint);
        self.rearm(&inner);
        drop(inner);
        if resumed > 0 {
            self.cond.notify_all();
        }
    }

    fn emit_hit(&self, call: &CallInfo, breakpoint: u64, deadline: Duration) {
        if let Some(e) = &self.emitter {
            let deadline_ns = e
                .clock()
                .now_ns()
                .saturating_add(u64::try_from(deadline.as_nanos()).unwrap_or(u64::MAX));
            e.emit(
                call.request.as_ref(),
                EventKind::BreakpointHit {
                    breakpoint,
                    entry: call.entry,
                    deadline_ns,
                },
            );
        }
    }

    fn emit_resumed(&self, request: Option<&RequestId>, breakpoint: u64, cause: ResumeCause) {
        if let Some(e) = &self.emitter {
            e.emit(request, EventKind::Resumed { breakpoint, cause });
        }
    }

    /// Like [`check`](Self::check), for a call the engine can put off
    /// instead of blocking its thread (vLLM's `get_num_new_matched_tokens`
    /// may answer "not yet"). When a breakpoint (or an armed step) matches,
    /// the call's request is *held*: a pause is registered and announced
    /// (`BreakpointHit`) and `Held` returned, and every later call for
    /// that request returns `Held` until the pause is released (resume,
    /// step, clear, its client gone) or its deadline passes (which, unlike
    /// a blocking pause's, leaves the breakpoint in place: the engine never
    /// waited, and the request passes it from then on). The next call
    /// after that gets `Go` (`Resumed` is announced), and the released
    /// breakpoint lets that request through from then on, here and in
    /// [`check`](Self::check): a request the engine asks about on every
    /// step is not held anew. A call without a request is checked as by
    /// [`check`](Self::check) would be, without blocking: it goes.
    ///
    /// With nothing armed and nothing held this is one atomic load.
    #[inline]
    pub fn hold(&self, call: &CallInfo) -> Verdict {
        if self.armed.load(Ordering::Acquire) {
            self.hold_slow(call)
        } else {
            Verdict::Go
        }
    }

    #[cold]
    #[inline(never)]
    fn hold_slow(&self, call: &CallInfo) -> Verdict {
        self.slow_checks.fetch_add(1, Ordering::Relaxed);
        let Some(request) = call.request.as_ref() else {
            return Verdict::Go;
        };
        let mut inner = self.lock();
        let mut ended = None;
        if let Some(&pause_id) = inner.held.get(request) {
            ended = inner.end_held(pause_id, Instant::now());
            if ended.is_none() {
                return Verdict::Held { pause_id };
            }
        }
        let verdict = match inner.matching(call) {
            Some((breakpoint, owner)) => {
                let (pause_id, deadline) = inner.pause(breakpoint, owner, call);
                inner.held.insert(request.clone(), pause_id);
                Some((pause_id, breakpoint, deadline))
            }
            None => None,
        };
        self.rearm(&inner);
        drop(inner);
        if let Some(e) = ended {
            self.emit_resumed(e.request.as_ref(), e.breakpoint, e.cause);
        }
        match verdict {
            Some((pause_id, breakpoint, deadline)) => {
                self.emit_hit(call, breakpoint, deadline);
                Verdict::Held { pause_id }
            }
            None => Verdict::Go,
        }
    }

    /// Ends held pauses that were released or ran out of time, announcing
    /// each (`Resumed`), without waiting for the engine to ask about their
    /// requests again. An engine that holds requests calls it once per
    /// step, so a console sees a resume at once and a deadline is kept even
    /// for a request nobody asks about any more.
    pub fn sweep_held(&self) {
        if !self.armed.load(Ordering::Acquire) {
            return;
        }
        let mut inner = self.lock();
        if inner.held.is_empty() {
            return;
        }
        let now = Instant::now();
        let ids: Vec<u64> = inner.held.values().copied().collect();
        let ended: Vec<Ended> = ids
            .into_iter()
            .filter_map(|id| inner.end_held(id, now))
            .collect();
        self.rearm(&inner);
        drop(inner);
        for e in ended {
            self.emit_resumed(e.request.as_ref(), e.breakpoint, e.cause);
        }
    }

    /// The engine is done with `request` (finished or aborted): a pause
    /// holding it ends (cause `Cleared`) and the breakpoints it passed
    /// forget it.
    pub fn forget_request(&self, request: &str) {
        if !self.armed.load(Ordering::Acquire) {
            return;
        }
        let mut inner = self.lock();
        inner.passed.retain(|(_, r)| &**r != request);
        let ended = match inner.held.get(request).copied() {
            Some(id) => {
                if let Some(p) = inner.paused.get_mut(&id) {
                    p.release.get_or_insert(ResumeCause::Cleared);
                }
                inner.end_held(id, Instant::now())
            }
            None => None,
        };
        self.rearm(&inner);
        drop(inner);
        if let Some(e) = ended {
            self.emit_resumed(e.request.as_ref(), e.breakpoint, e.cause);
        }
    }

    /// Blocks until pause `pause_id` is released or its deadline passes;
    /// removes it and says why it ended.
    fn wait(&self, pause_id: u64) -> ResumeCause {
        let mut inner = self.lock();
        let cause = loop {
            // Only this thread removes its entry, so it is there; the
            // fallback only keeps a broken invariant from hanging the engine.
            let Some(p) = inner.paused.get(&pause_id) else {
                break ResumeCause::Resume;
            };
            if let Some(cause) = p.release {
                break cause;
            }
            let now = Instant::now();
            if now >= p.deadline {
                break ResumeCause::Deadline;
            }
            let left = p.deadline - now;
            // A wakeup — real, spurious, or for another pause — only leads
            // back to the top, where this pause's own state decides.
            inner = match self.cond.wait_timeout(inner, left) {
                Ok((g, _)) => g,
                Err(poisoned) => poisoned.into_inner().0,
            };
        };
        inner.paused.remove(&pause_id);
        cause
    }
}

/// The one place a control command is carried out: the attach server, the
/// console's local control and anything else hand commands to this.
impl Control for Breakpoints {
    fn execute(
        &self,
        command: ControlCommand,
        owner: Option<u64>,
    ) -> Result<ControlResult, ControlError> {
        Ok(match command {
            ControlCommand::Add { mut spec } => {
                spec.owner = owner;
                ControlResult::Added(self.add(spec)?)
            }
            ControlCommand::Clear { id } => ControlResult::Done(self.clear(id)),
            ControlCommand::ClearAll => ControlResult::Count(self.clear_all() as u64),
            ControlCommand::Resume { pause_id: Some(p) } => ControlResult::Done(self.resume(p)),
            ControlCommand::Resume { pause_id: None } => {
                ControlResult::Count(self.resume_all() as u64)
            }
            ControlCommand::Step => ControlResult::Done(self.step_inner(owner)),
            ControlCommand::List => ControlResult::List(BreakpointsView {
                breakpoints: self.list(),
                paused: self.paused(),
            }),
        })
    }

    fn release_owner(&self, owner: u64) -> OwnerReleased {
        Breakpoints::release_owner(self, owner)
    }

    fn owners(&self) -> Option<HashSet<u64>> {
        Some(Breakpoints::owners(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::breakpoint::{DEFAULT_DEADLINE, MAX_REQUEST_MATCH_LEN};
    use kvbm_events::bus::{BusConfig, TapItem, TapReceiver};
    use kvbm_events::{EntryPoint, Event, SlotState, VirtualClock};
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc;
    use std::thread;

    fn emitter() -> (Arc<Emitter>, TapReceiver<Event>) {
        let e =
            Arc::new(Emitter::new(1, BusConfig::default(), Arc::new(VirtualClock::new())).unwrap());
        let tap = e.bus().take_tap().unwrap();
        (e, tap)
    }

    fn drain(tap: &mut TapReceiver<Event>) -> Vec<Event> {
        let mut out = Vec::new();
        while let Ok(item) = tap.try_recv() {
            match item {
                TapItem::Event(e) => out.push(e),
                TapItem::Gap { dropped } => panic!("tap lost {dropped} events"),
            }
        }
        out
    }

    fn call(entry: EntryPoint, request: &str) -> CallInfo {
        CallInfo::new(entry).with_request(Arc::from(request))
    }

    /// `owners` names whoever holds something: a breakpoint, the armed
    /// step (not among the listed breakpoints), a pause its step made;
    /// nobody once each is released or used up.
    #[test]
    fn owners_are_those_holding_a_breakpoint_a_step_or_a_pause() {
        let bp = Arc::new(Breakpoints::new(None, DEFAULT_DEADLINE));
        assert!(bp.owners().is_empty());
        let id = bp
            .add(BreakpointSpec {
                owner: Some(1),
                ..BreakpointSpec::default().with_request("never")
            })
            .unwrap();
        bp.add(BreakpointSpec::default().with_request("nobody's"))
            .unwrap();
        bp.step_for(2);
        assert_eq!(bp.owners(), HashSet::from([1, 2]));
        assert_eq!(bp.list().len(), 2, "the armed step is not listed");
        // The step fires: its pause is still owner 2's.
        let b = bp.clone();
        let paused = thread::spawn(move || b.check(&call(EntryPoint::CreateSlot, "r")));
        wait_paused(&bp, 1);
        assert_eq!(bp.owners(), HashSet::from([1, 2]));
        assert_eq!(bp.release_owner(2).resumed, 1);
        paused.join().unwrap();
        assert!(bp.clear(id));
        assert!(bp.owners().is_empty(), "{:?}", bp.owners());
    }

    /// Waits (bounded) until `n` calls are paused.
    fn wait_paused(bp: &Breakpoints, n: usize) -> Vec<PausedCall> {
        let start = Instant::now();
        loop {
            let p = bp.paused();
            if p.len() == n {
                return p;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{} paused, want {n}",
                p.len()
            );
            thread::sleep(Duration::from_millis(1));
        }
    }

    #[derive(Default)]
    struct Counting {
        will: AtomicUsize,
        finished: AtomicUsize,
    }

    impl Hooks for Counting {
        fn will_call(&self, _: &CallInfo) {
            self.will.fetch_add(1, Ordering::Relaxed);
        }
        fn finished_call(&self, _: &CallInfo) {
            self.finished.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn hookset_emits_one_event_per_call_and_runs_user_hooks() {
        let (e, mut tap) = emitter();
        let user = Arc::new(Counting::default());
        let hooks = HookSet::new(Some(user.clone()), Some(e.clone()));
        assert!(hooks.is_enabled());
        let c = call(EntryPoint::BuildConnectorMetadata, "r1");
        hooks.will_call(&c);
        hooks.finished_call(&c);
        let got = drain(&mut tap);
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[0].kind,
            EventKind::HookCall {
                entry: EntryPoint::BuildConnectorMetadata,
                phase: HookPhase::Will
            }
        );
        assert_eq!(
            got[1].kind,
            EventKind::HookCall {
                entry: EntryPoint::BuildConnectorMetadata,
                phase: HookPhase::Finished
            }
        );
        assert_eq!(got[0].request.as_deref(), Some("r1"));
        assert_eq!(user.will.load(Ordering::Relaxed), 1);
        assert_eq!(user.finished.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn disabled_hookset_emits_nothing_and_hooks_alone_emit_nothing() {
        let (e, mut tap) = emitter();
        let none = HookSet::none();
        assert!(!none.is_enabled());
        assert!(!HookSet::new(None, None).is_enabled());
        assert!(!HookSet::default().is_enabled());
        let c = call(EntryPoint::CreateSlot, "r");
        none.will_call(&c);
        none.finished_call(&c);
        // User hooks without an emitter: hooks run, no event.
        let user = Arc::new(Counting::default());
        let only_hooks = HookSet::none().with_hooks(user.clone());
        only_hooks.will_call(&c);
        only_hooks.finished_call(&c);
        assert_eq!(user.will.load(Ordering::Relaxed), 1);
        assert!(drain(&mut tap).is_empty());
        assert_eq!(e.emitted(), 0);
        // The builder keeps what was attached before.
        let both = only_hooks.with_emitter(e.clone());
        both.will_call(&c);
        assert_eq!(user.will.load(Ordering::Relaxed), 2);
        assert_eq!(drain(&mut tap).len(), 1);
    }

    #[test]
    fn invalid_specs_are_typed_errors() {
        let bp = Breakpoints::new(None, DEFAULT_DEADLINE);
        assert_eq!(
            bp.add(BreakpointSpec::default()),
            Err(BreakpointError::EmptySpec)
        );
        assert_eq!(
            bp.add(BreakpointSpec::default().with_owner(3)),
            Err(BreakpointError::EmptySpec),
            "an owner is not something to match on"
        );
        assert_eq!(
            bp.add(BreakpointSpec::default().with_state("Decodin")),
            Err(BreakpointError::UnknownState("Decodin".into()))
        );
        assert_eq!(
            bp.add(BreakpointSpec::default().with_request_prefix("")),
            Err(BreakpointError::EmptyRequestMatch)
        );
        let long = "x".repeat(MAX_REQUEST_MATCH_LEN + 1);
        assert!(matches!(
            bp.add(BreakpointSpec::default().with_request(long)),
            Err(BreakpointError::RequestMatchTooLong { .. })
        ));
        let huge_state = "y".repeat(10_000);
        let Err(err) = bp.add(BreakpointSpec::default().with_state(huge_state)) else {
            panic!("accepted")
        };
        assert!(err.to_string().len() < 500, "{err}");
        assert!(bp.list().is_empty());
        assert!(!bp.is_armed());
        assert!(matches!(
            bp.set_default_deadline(Duration::ZERO),
            Err(BreakpointError::BadDeadline { .. })
        ));
        assert!(
            bp.set_default_deadline(MAX_DEADLINE + Duration::from_secs(1))
                .is_err()
        );
        assert_eq!(bp.default_deadline(), DEFAULT_DEADLINE);
        // Every state name is accepted.
        for name in SlotState::NAMES {
            let id = bp.add(BreakpointSpec::default().with_state(name)).unwrap();
            assert!(bp.clear(id));
        }
    }

    #[test]
    fn cap_is_enforced_and_ids_are_not_reused() {
        let bp = Breakpoints::new(None, DEFAULT_DEADLINE).with_max_breakpoints(2);
        let spec = BreakpointSpec::default().with_entry(EntryPoint::CreateSlot);
        let a = bp.add(spec.clone()).unwrap();
        let b = bp.add(spec.clone()).unwrap();
        assert_eq!((a, b), (1, 2));
        assert_eq!(bp.add(spec.clone()), Err(BreakpointError::Full { max: 2 }));
        assert!(bp.clear(a));
        assert!(!bp.clear(a));
        assert_eq!(bp.add(spec).unwrap(), 3);
        assert_eq!(
            bp.list().iter().map(|i| i.id).collect::<Vec<_>>(),
            vec![2, 3]
        );
        assert_eq!(bp.clear_all(), 2);
        assert!(!bp.is_armed());
    }

    #[test]
    fn fast_path_takes_no_lock() {
        let bp = Arc::new(Breakpoints::new(None, DEFAULT_DEADLINE));
        // Hold the lock here while another thread checks a million calls:
        // if `check` took it, the thread could not finish.
        let guard = bp.lock();
        let (tx, rx) = mpsc::channel();
        let bp2 = Arc::clone(&bp);
        let h = thread::spawn(move || {
            let c = call(EntryPoint::GetNumNewMatchedTokens, "r");
            for _ in 0..1_000_000 {
                bp2.check(&c);
            }
            let _ = tx.send(());
        });
        let done = rx.recv_timeout(Duration::from_secs(60));
        drop(guard);
        h.join().unwrap();
        assert!(done.is_ok(), "check blocked on the lock");
        assert_eq!(bp.slow_checks(), 0);
    }

    #[test]
    fn non_matching_calls_take_the_slow_path_but_do_not_pause() {
        let (e, mut tap) = emitter();
        let bp = Breakpoints::new(Some(e), DEFAULT_DEADLINE);
        let id = bp
            .add(BreakpointSpec::default().with_request("other"))
            .unwrap();
        for entry in EntryPoint::ALL {
            bp.check(&call(entry, "mine"));
        }
        assert_eq!(bp.slow_checks(), 6);
        assert!(drain(&mut tap).is_empty());
        assert_eq!(bp.list()[0].hits, 0);
        assert!(bp.clear(id));
        bp.check(&call(EntryPoint::CreateSlot, "other"));
        assert_eq!(bp.slow_checks(), 6, "disarmed again after the clear");
    }

    #[test]
    fn spurious_wakeups_do_not_end_a_pause() {
        let (e, mut tap) = emitter();
        let bp = Arc::new(Breakpoints::new(Some(e), DEFAULT_DEADLINE));
        bp.add(BreakpointSpec::default().with_entry(EntryPoint::CreateSlot))
            .unwrap();
        let bp2 = Arc::clone(&bp);
        let h = thread::spawn(move || bp2.check(&call(EntryPoint::CreateSlot, "r")));
        let p = wait_paused(&bp, 1);
        for _ in 0..100 {
            bp.cond.notify_all();
        }
        thread::sleep(Duration::from_millis(20));
        assert!(!h.is_finished());
        assert_eq!(bp.paused().len(), 1);
        assert!(bp.resume(p[0].pause_id));
        assert!(!bp.resume(p[0].pause_id), "already released");
        h.join().unwrap();
        let kinds: Vec<_> = drain(&mut tap).into_iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds[1],
            EventKind::Resumed {
                breakpoint: 1,
                cause: ResumeCause::Resume
            }
        );
    }

    #[test]
    fn lowest_matching_id_pauses_once() {
        let bp = Arc::new(Breakpoints::new(None, DEFAULT_DEADLINE));
        let a = bp
            .add(BreakpointSpec::default().with_request_prefix("r"))
            .unwrap();
        let b = bp
            .add(BreakpointSpec::default().with_entry(EntryPoint::CreateSlot))
            .unwrap();
        let bp2 = Arc::clone(&bp);
        let h = thread::spawn(move || bp2.check(&call(EntryPoint::CreateSlot, "r1")));
        let p = wait_paused(&bp, 1);
        assert_eq!(p[0].breakpoint, a);
        assert_eq!(bp.resume_all(), 1);
        h.join().unwrap();
        let hits: Vec<_> = bp.list().iter().map(|i| (i.id, i.hits)).collect();
        assert_eq!(hits, vec![(a, 1), (b, 0)]);
        assert!(bp.paused().is_empty());
    }

    #[test]
    fn hookset_with_breakpoints_pauses_after_the_will_event() {
        let (e, mut tap) = emitter();
        let bp = Arc::new(Breakpoints::new(Some(e.clone()), DEFAULT_DEADLINE));
        bp.add(BreakpointSpec::default().with_state("Decoding"))
            .unwrap();
        let hooks = HookSet::none().with_emitter(e).with_breakpoints(bp.clone());
        let h = thread::spawn(move || {
            let c = call(EntryPoint::BuildConnectorMetadata, "r").with_state(SlotState::Decoding);
            hooks.will_call(&c);
            hooks.finished_call(&c);
        });
        wait_paused(&bp, 1);
        bp.resume_all();
        h.join().unwrap();
        let names: Vec<_> = drain(&mut tap).iter().map(|e| e.kind.name()).collect();
        assert_eq!(names, ["HookCall", "BreakpointHit", "Resumed", "HookCall"]);
    }

    /// A blocking pause that runs out its deadline removes its breakpoint
    /// (and resumes the other calls it holds): the engine is not stopped
    /// again at the next matching call. Other breakpoints stay.
    #[test]
    fn a_deadline_removes_the_breakpoint_that_blocked_the_engine() {
        let (e, mut tap) = emitter();
        let bp = Arc::new(Breakpoints::new(Some(e), Duration::from_secs(1)));
        let id = bp
            .add(BreakpointSpec::default().with_request_prefix("r"))
            .unwrap();
        let other = bp
            .add(BreakpointSpec::default().with_entry(EntryPoint::RequestFinished))
            .unwrap();
        // Two engine threads paused by the same breakpoint, the second a
        // little later: the first deadline ends both.
        let bp2 = Arc::clone(&bp);
        let first = thread::spawn(move || bp2.check(&call(EntryPoint::CreateSlot, "r1")));
        wait_paused(&bp, 1);
        bp.set_default_deadline(Duration::from_secs(30)).unwrap();
        let bp3 = Arc::clone(&bp);
        let second = thread::spawn(move || bp3.check(&call(EntryPoint::CreateSlot, "r2")));
        wait_paused(&bp, 2);
        let start = Instant::now();
        first.join().unwrap();
        second.join().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the second pause waited for its own deadline"
        );
        assert_eq!(
            bp.list().iter().map(|b| b.id).collect::<Vec<_>>(),
            vec![other],
            "the expired breakpoint is gone, the other stays"
        );
        // The next matching call goes straight through.
        let t = Instant::now();
        bp.check(&call(EntryPoint::CreateSlot, "r1"));
        assert!(t.elapsed() < Duration::from_secs(1));
        assert!(bp.paused().is_empty());
        let resumed: Vec<EventKind> = drain(&mut tap)
            .into_iter()
            .map(|e| e.kind)
            .filter(|k| matches!(k, EventKind::Resumed { .. }))
            .collect();
        assert_eq!(
            resumed,
            vec![
                EventKind::Resumed {
                    breakpoint: id,
                    cause: ResumeCause::Deadline
                };
                2
            ]
        );
    }

    /// A held request is put off, not blocked: one hit, `Held` on every
    /// ask while the pause lasts, `Go` (and `Resumed`) once released, and
    /// the breakpoint lets that request through from then on, blocking
    /// checks included; other requests are still held.
    #[test]
    fn hold_puts_a_request_off_until_released_then_lets_it_pass() {
        let (e, mut tap) = emitter();
        let bp = Breakpoints::new(Some(e), Duration::from_secs(30));
        let id = bp
            .add(BreakpointSpec::default().with_request_prefix("r"))
            .unwrap();
        let c = call(EntryPoint::GetNumNewMatchedTokens, "r1");
        let Verdict::Held { pause_id } = bp.hold(&c) else {
            panic!("not held")
        };
        for _ in 0..5 {
            assert_eq!(bp.hold(&c), Verdict::Held { pause_id });
        }
        assert_eq!(bp.paused().len(), 1);
        let other = call(EntryPoint::GetNumNewMatchedTokens, "r2");
        assert!(matches!(bp.hold(&other), Verdict::Held { .. }));
        assert!(bp.resume(pause_id));
        assert_eq!(bp.hold(&c), Verdict::Go);
        assert_eq!(bp.hold(&c), Verdict::Go);
        // A blocking check of the same request does not pause either.
        bp.check(&call(EntryPoint::RequestFinished, "r1"));
        assert_eq!(bp.paused().len(), 1, "r2 is still held");
        let kinds: Vec<EventKind> = drain(&mut tap).into_iter().map(|e| e.kind).collect();
        let hits = kinds
            .iter()
            .filter(|k| matches!(k, EventKind::BreakpointHit { .. }))
            .count();
        assert_eq!(hits, 2, "{kinds:?}");
        assert!(kinds.contains(&EventKind::Resumed {
            breakpoint: id,
            cause: ResumeCause::Resume
        }));
        // Forgetting r2 ends its pause; a new r1 (same id, reused) passes.
        bp.forget_request("r2");
        assert!(bp.paused().is_empty());
        assert!(drain(&mut tap).iter().any(|e| e.kind
            == EventKind::Resumed {
                breakpoint: id,
                cause: ResumeCause::Cleared
            }));
    }

    /// A held pause keeps its deadline even when nobody asks again:
    /// `sweep_held` ends it; a cleared breakpoint's pause ends at the next
    /// sweep too.
    #[test]
    fn held_pauses_end_at_their_deadline_or_when_cleared() {
        let (e, mut tap) = emitter();
        let bp = Breakpoints::new(Some(e), Duration::from_millis(20));
        let a = bp.add(BreakpointSpec::default().with_request("a")).unwrap();
        let b = bp.add(BreakpointSpec::default().with_request("b")).unwrap();
        assert!(matches!(
            bp.hold(&call(EntryPoint::GetNumNewMatchedTokens, "a")),
            Verdict::Held { .. }
        ));
        assert!(matches!(
            bp.hold(&call(EntryPoint::CreateSlot, "b")),
            Verdict::Held { .. }
        ));
        bp.set_default_deadline(Duration::from_secs(60)).unwrap();
        assert!(bp.clear(b));
        thread::sleep(Duration::from_millis(40));
        bp.sweep_held();
        assert!(bp.paused().is_empty());
        let resumed: Vec<EventKind> = drain(&mut tap)
            .into_iter()
            .map(|e| e.kind)
            .filter(|k| matches!(k, EventKind::Resumed { .. }))
            .collect();
        assert_eq!(resumed.len(), 2, "{resumed:?}");
        assert!(resumed.contains(&EventKind::Resumed {
            breakpoint: a,
            cause: ResumeCause::Deadline
        }));
        assert!(resumed.contains(&EventKind::Resumed {
            breakpoint: b,
            cause: ResumeCause::Cleared
        }));
        assert_eq!(
            bp.list().len(),
            1,
            "breakpoint a stays after its pause ended"
        );
    }
}
