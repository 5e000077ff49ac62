//! The Python module `kvbm._kvbm`: the scheduler and worker sides behind a
//! thin layer of plain arguments (strings, ints, lists, bytes; settings and
//! tensor descriptions as JSON text), so the Python class that reads
//! vLLM's objects stays small. Errors become Python exceptions with the
//! Rust message intact: `ValueError` for settings, `RuntimeError` for the
//! rest.
//!
//! Each object keeps its side behind a mutex, and the GIL is never taken
//! back while that mutex is held (a call that lets the GIL go does so
//! before it locks): a thread holding the GIL may then wait for the mutex
//! without ever waiting for itself through another thread.
//!
//! The module is private to the Python class in `kvbm/vllm.py`, and trusts
//! it: `Worker` copies to and from the addresses its tensor descriptions
//! give (`data_ptr`, checked only for null and size), which must be vLLM's
//! own KV tensors, kept alive by the caller.

use crate::config::{Config, ConfigError};
use crate::deferred::Runner;
use crate::followed::{Followed, StepArgs};
use crate::meta::StepPlan;
use crate::phases::Phase;
use crate::scheduler::{Parallel, SchedulerError, SchedulerSide};
use crate::tiers::{Geometry, Shard};
use crate::worker::{KvTensor, WorkerError, WorkerSide};
use kvbm_core::hooks::Breakpoints;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

fn config(json: &str) -> PyResult<Config> {
    let v: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| PyValueError::new_err(format!("kvbm: settings are not JSON: {e}")))?;
    Config::from_json(&v).map_err(|e: ConfigError| PyValueError::new_err(e.to_string()))
}

fn geometry(
    (num_gpu_blocks, block_size, num_layers, page_bytes): (usize, usize, usize, usize),
) -> Geometry {
    Geometry {
        num_gpu_blocks,
        block_size,
        num_layers,
        page_bytes,
    }
}

fn sched_err(e: SchedulerError) -> PyErr {
    match e {
        SchedulerError::Config(c) => PyValueError::new_err(c.to_string()),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

fn worker_err(e: WorkerError) -> PyErr {
    match e {
        WorkerError::Config(c) => PyValueError::new_err(c.to_string()),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

/// The scheduler side's counters as JSON text: the connector's, its time
/// per step, its deferred-work runner's, the events it emitted and, with
/// `publish`, its publisher's and its NATS control's.
fn counters_json(s: &SchedulerSide, runner: &Runner) -> String {
    serde_json::json!({
        "counters": s.counters(),
        "deferred_runner": runner.counters(),
        "step_timing": s.step_timing(),
        "phases_us_per_step": s.phases_per_step_us(),
        "events_emitted": s.events_emitted(),
        "publisher": s.publisher_counters(),
        "control": s.control_counters(),
    })
    .to_string()
}

/// vLLM's outputs (each its workers' reports), in the order it reported
/// them, before the call they came with.
fn told_outputs(s: &mut SchedulerSide, outputs: Vec<Vec<Vec<u8>>>) {
    for reports in outputs {
        s.update_connector_output_owned(reports);
    }
}

/// Reports borrowed from their `bytes` objects, copied once each: a
/// `Vec<u8>` argument would be extracted byte by byte, as a sequence of
/// ints.
fn owned(reports: &[PyBackedBytes]) -> Vec<Vec<u8>> {
    reports.iter().map(|r| r.to_vec()).collect()
}

fn gone() -> PyErr {
    PyRuntimeError::new_err("kvbm: the connector was shut down")
}

/// Checks `kv_connector_extra_config` (as JSON text) without starting
/// anything; raises `ValueError` naming the bad key.
#[pyfunction]
fn check_config(config_json: &str) -> PyResult<()> {
    config(config_json).map(|_| ())
}

/// The scheduler side (vLLM's engine-core process).
#[pyclass(name = "Scheduler", module = "kvbm._kvbm", frozen)]
struct PyScheduler {
    /// Shared with the runner thread that follows and plans a deferred
    /// step (see `SchedulerSide::run_deferred`).
    inner: Arc<Mutex<Option<SchedulerSide>>>,
    /// Runs the deferred work (see `run_deferred_later`).
    runner: Runner,
    /// Time spent in `run_deferred_later` since the last call accounted it.
    wake_ns: std::sync::atomic::AtomicU64,
    breakpoints: Arc<Breakpoints>,
    /// vLLM's requests between steps. Locked only with the GIL held, and
    /// never across a call that may let the GIL go.
    followed: Mutex<Followed>,
}

impl PyScheduler {
    fn lock(&self) -> MutexGuard<'_, Option<SchedulerSide>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands what the last call left for later (`SchedulerSide::run_deferred`)
    /// to the runner thread (`crate::deferred`), which runs it while vLLM's
    /// thread waits for the worker's forward pass. If vLLM calls again
    /// first, that call runs the work and the runner finds nothing to do; a
    /// call in progress is never waited for.
    fn run_deferred_later(&self, deferred: bool) {
        if !deferred {
            return;
        }
        let t = Instant::now();
        self.runner.post();
        // Accounted at the next call (this one's lock is gone).
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.wake_ns
            .fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
    }

    fn followed(&self) -> MutexGuard<'_, Followed> {
        self.followed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs one of vLLM's per-step calls on the scheduler side, holding the
    /// GIL unless a breakpoint is armed (and so the call may pause).
    ///
    /// Why not always release it: the engine core has other Python threads
    /// (its input and output sockets) waiting for the GIL, so releasing it
    /// hands it to one of them, and taking it back waits until that thread
    /// lets go — on the engine's critical path, every step. Measured on the
    /// CPU vLLM of the benchmark: `build_meta` took 47 µs a call from Python
    /// with the GIL released and 16 µs holding it (the Rust work is the same).
    /// A call that pauses at a breakpoint must release it, so that those
    /// threads go on; a breakpoint armed after the check pauses this one call
    /// with the GIL held, which only delays those threads until it resumes.
    fn with_side<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut SchedulerSide) -> PyResult<T> + Send,
    ) -> PyResult<T> {
        let call = || {
            let mut g = self.lock();
            let s = g.as_mut().ok_or_else(gone)?;
            let woke = self.wake_ns.swap(0, std::sync::atomic::Ordering::Relaxed);
            if woke > 0 {
                s.account(Phase::Wake, std::time::Duration::from_nanos(woke));
            }
            f(s)
        };
        if self.breakpoints.is_armed() {
            py.detach(call)
        } else {
            call()
        }
    }
}

#[pymethods]
impl PyScheduler {
    /// `ranks`: vLLM's tensor-parallel workers; `stages`: its pipeline
    /// stages (kvbm refuses more than one, saying why); `async_scheduling`:
    /// whether vLLM has two steps in flight.
    #[new]
    #[pyo3(signature = (config_json, geometry_, engine_id, ranks=1, stages=1, async_scheduling=false))]
    fn new(
        py: Python<'_>,
        config_json: &str,
        geometry_: (usize, usize, usize, usize),
        engine_id: &str,
        ranks: usize,
        stages: usize,
        async_scheduling: bool,
    ) -> PyResult<Self> {
        let cfg = config(config_json)?;
        let g = geometry(geometry_);
        let parallel = Parallel {
            ranks,
            stages,
            async_scheduling,
        };
        let mut side = py
            .detach(|| SchedulerSide::start(cfg, g, engine_id, parallel))
            .map_err(sched_err)?;
        // `run_deferred_later` runs what the calls leave for later.
        side.defer_to_runtime(true);
        let inner = Arc::new(Mutex::new(Some(side)));
        let theirs = Arc::clone(&inner);
        let runner = Runner::start(
            "kvbm-deferred",
            || {
                crate::background::batch_this_thread();
            },
            move || {
                // Busy means vLLM's thread is in a call, which runs the
                // work itself first.
                if let Ok(mut g) = theirs.try_lock()
                    && let Some(s) = g.as_mut()
                {
                    s.run_deferred(true);
                }
            },
        )
        .map_err(|e| PyRuntimeError::new_err(format!("kvbm: starting a thread: {e}")))?;
        let breakpoints = inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|s| s.breakpoints().clone())
            .ok_or_else(gone)?;
        Ok(PyScheduler {
            breakpoints,
            runner,
            inner,
            wake_ns: std::sync::atomic::AtomicU64::new(0),
            followed: Mutex::default(),
        })
    }

    /// External tokens beyond `num_computed_tokens`, or `None` while a
    /// breakpoint holds the request.
    ///
    /// At a request's first lookup kvbm starts following it: `tokens` is
    /// vLLM's list of its tokens (`Request._all_token_ids`, which vLLM
    /// appends each sampled token to; any sequence of ints will do), read
    /// at each step from where the last read stopped; `prompt_len` its
    /// prompt's length. Without `tokens`, `prompt` stands for it (and no
    /// token past the prompt is ever read).
    #[pyo3(signature = (request, prompt, num_computed_tokens, tokens=None, prompt_len=None))]
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        request: &str,
        prompt: Vec<u32>,
        num_computed_tokens: usize,
        tokens: Option<Bound<'_, PyAny>>,
        prompt_len: Option<usize>,
    ) -> PyResult<Option<usize>> {
        let sent = prompt.len();
        let (r, id) = self.with_side(py, |s| {
            let r = s
                .get_num_new_matched_tokens(request, &prompt, num_computed_tokens)
                .map_err(sched_err)?;
            Ok((r, s.request_id(request)))
        })?;
        // Followed once the side has a slot for it (a refused lookup
        // leaves nothing behind), by the side's own id for it.
        let mut f = self.followed();
        if let Some(id) = id
            && !f.contains(request)
        {
            let tokens = match tokens {
                Some(t) => t.unbind(),
                None => PyList::new(py, &prompt)?.into_any().unbind(),
            };
            f.follow(id, tokens, sent, prompt_len.unwrap_or(sent));
        }
        Ok(r)
    }

    fn update_state_after_alloc(
        &self,
        py: Python<'_>,
        request: &str,
        block_ids: Vec<u32>,
        num_external_tokens: usize,
    ) -> PyResult<()> {
        self.with_side(py, |s| {
            s.update_state_after_alloc(request, &block_ids, num_external_tokens)
                .map_err(sched_err)
        })?;
        self.followed().allocated(request, &block_ids);
        Ok(())
    }

    /// The step's plan, as bytes for the worker. The arguments are vLLM's
    /// scheduler output, read in place (see `followed`): `new`, a
    /// `(req_id, num_computed_tokens, block_ids)` per request scheduled
    /// for the first time; then `scheduled_cached_reqs`' `req_ids`,
    /// `new_block_ids`, `num_computed_tokens` and `resumed_req_ids`;
    /// `num_scheduled_tokens`; `kv_connector_block_state` (or `None`); the
    /// preempted requests' ids; vLLM's free device blocks, if known;
    /// `outputs`, vLLM's outputs since the last call (see
    /// [`Self::outputs`]).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (new, req_ids, new_block_ids, num_computed_tokens, num_scheduled_tokens, resumed=None, block_state=None, preempted=None, g1_free=None, outputs=Vec::new()))]
    fn build_meta<'py>(
        &self,
        py: Python<'py>,
        new: &Bound<'py, PyList>,
        req_ids: &Bound<'py, PyList>,
        new_block_ids: &Bound<'py, PyList>,
        num_computed_tokens: &Bound<'py, PyList>,
        num_scheduled_tokens: &Bound<'py, PyDict>,
        resumed: Option<&Bound<'py, PyAny>>,
        block_state: Option<&Bound<'py, PyAny>>,
        preempted: Option<&Bound<'py, PyAny>>,
        g1_free: Option<usize>,
        outputs: Vec<Vec<PyBackedBytes>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let outputs: Vec<_> = outputs.iter().map(|r| owned(r)).collect();
        let read = Instant::now();
        let input = (|| {
            let mut f = self.followed();
            let mut input = f.step(&StepArgs {
                new,
                ids: req_ids,
                added: new_block_ids,
                computed: num_computed_tokens,
                num_scheduled: num_scheduled_tokens,
                resumed,
                block_state,
            })?;
            if let Some(p) = preempted.filter(|p| !p.is_none()) {
                for id in p.try_iter()? {
                    let id: String = id?.extract().map_err(|e| {
                        pyo3::exceptions::PyTypeError::new_err(format!(
                            "kvbm: a preempted request's id is not a string: {e}"
                        ))
                    })?;
                    if f.contains(&id) {
                        input.preempted.push(id);
                    }
                }
            }
            Ok::<_, PyErr>(input)
        })();
        let mut input = match input {
            Ok(input) => input,
            Err(e) => {
                // The step's lists are refused, not the outputs that came
                // with them: their stores and reports go on.
                self.with_side(py, |s| {
                    told_outputs(s, outputs);
                    Ok(())
                })?;
                return Err(e);
            }
        };
        input.g1_free = g1_free;
        let read = read.elapsed();
        let (bytes, deferred) = self.with_side(py, |s| {
            told_outputs(s, outputs);
            s.account(Phase::Read, read);
            let plan = s.build_meta(input).map_err(sched_err)?;
            let t = Instant::now();
            let bytes = plan.to_bytes();
            s.account(Phase::Encode, t.elapsed());
            Ok((bytes, s.has_deferred()))
        })?;
        self.run_deferred_later(deferred);
        Ok(PyBytes::new(py, &bytes))
    }

    /// The worker's reports of the step that just ran.
    fn update_connector_output(&self, py: Python<'_>, reports: Vec<PyBackedBytes>) -> PyResult<()> {
        let reports = owned(&reports);
        // What this leaves for later runs with the next step's deferred
        // work (on the runner thread), or at vLLM's next call: in sync
        // scheduling one always follows (the next step's, or, for a request
        // that finished, `request_finished`, whose stores then keep it in
        // vLLM's scheduler until they drain).
        self.with_side(py, |s| {
            s.update_connector_output_owned(reports);
            Ok(())
        })
    }

    /// vLLM's outputs, each as `update_connector_output` with its
    /// reports. With sync scheduling kvbm only queues an output for its
    /// next call, so the class keeps them and tells them with that call
    /// (here, or `build_meta`'s `outputs`) rather than make a call a step
    /// for them.
    fn outputs(&self, py: Python<'_>, outputs: Vec<Vec<PyBackedBytes>>) -> PyResult<()> {
        let outputs: Vec<_> = outputs.iter().map(|r| owned(r)).collect();
        self.with_side(py, |s| {
            told_outputs(s, outputs);
            Ok(())
        })
    }

    /// `delay_free`: true while the request's stores are out.
    fn request_finished(
        &self,
        py: Python<'_>,
        request: &str,
        block_ids: Vec<u32>,
    ) -> PyResult<bool> {
        self.followed().forget(request);
        self.with_side(py, |s| {
            s.request_finished(request, &block_ids).map_err(sched_err)
        })
    }

    /// What kvbm runs as, in one line (ranks, scheduling, tiers and sizes).
    fn summary(&self, py: Python<'_>) -> String {
        py.detach(|| {
            self.lock()
                .as_ref()
                .map(|s| s.summary().to_string())
                .unwrap_or_default()
        })
    }

    /// What the start did that the user should hear of, one line each
    /// (host-tier files of killed engines it removed).
    fn start_notes(&self, py: Python<'_>) -> Vec<String> {
        py.detach(|| {
            self.lock()
                .as_ref()
                .map(|s| s.start_notes().to_vec())
                .unwrap_or_default()
        })
    }

    /// The attach server's address (`host:port`), when serving.
    fn serving(&self, py: Python<'_>) -> Option<String> {
        // Without the GIL: another thread's call may hold the side,
        // paused at a breakpoint.
        py.detach(|| self.lock().as_ref()?.serving().map(|a| a.to_string()))
    }

    /// The connector's counters and its own time per step, as JSON text.
    fn counters(&self, py: Python<'_>) -> String {
        py.detach(|| {
            let mut g = self.lock();
            let s = g.as_mut();
            // They count every step before them (vLLM's calls may have
            // left the last one to the runtime).
            s.map(|s| {
                s.run_deferred(false);
                counters_json(s, &self.runner)
            })
            .unwrap_or_default()
        })
    }

    /// Stops everything (idempotent). Returns the final counters (JSON
    /// text, as `counters`: with `publish`, what the publisher sent and
    /// lost), or "" when already stopped.
    fn shutdown(&self, py: Python<'_>) -> PyResult<String> {
        py.detach(|| {
            self.runner.stop();
            let side = self.lock().take();
            match side {
                Some(mut s) => {
                    s.shutdown().map_err(sched_err)?;
                    Ok(counters_json(&s, &self.runner))
                }
                None => Ok(String::new()),
            }
        })
    }
}

impl Drop for PyScheduler {
    /// The side (and its runtime) ends here, on the thread that drops the
    /// object, when vLLM did not shut it down: never on the runner thread
    /// (`run_deferred_later`), which is stopped first.
    fn drop(&mut self) {
        self.runner.stop();
        let side = self.lock().take();
        drop(side);
    }
}

/// The worker side (vLLM's worker process).
#[pyclass(name = "Worker", module = "kvbm._kvbm", frozen)]
struct PyWorker {
    inner: Mutex<Option<WorkerSide>>,
}

impl PyWorker {
    fn lock(&self) -> MutexGuard<'_, Option<WorkerSide>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PyWorker {
    /// `tensors_json`: a list of `{name, data_ptr, nbytes, num_blocks,
    /// block_stride_bytes, contiguous, device, shape}`, one per layer. The caller
    /// (the Python class) keeps the tensors alive as long as this object.
    /// `data_ptr` is trusted to be the address of vLLM's own tensor: this
    /// private module's contract with its one caller.
    /// `rank` of `ranks`: this worker's tensor-parallel rank; each keeps
    /// its own shard in its own host-tier and disk files.
    #[new]
    #[pyo3(signature = (config_json, geometry_, engine_id, tensors_json, rank=0, ranks=1))]
    fn new(
        config_json: &str,
        geometry_: (usize, usize, usize, usize),
        engine_id: &str,
        tensors_json: &str,
        rank: usize,
        ranks: usize,
    ) -> PyResult<Self> {
        if ranks == 0 || rank >= ranks {
            return Err(PyValueError::new_err(format!(
                "kvbm: worker rank {rank} of {ranks} tensor-parallel workers"
            )));
        }
        let cfg = config(config_json)?;
        let tensors: Vec<KvTensor> = serde_json::from_str(tensors_json).map_err(|e| {
            PyValueError::new_err(format!("kvbm: the KV tensors' description: {e}"))
        })?;
        // SAFETY: the Python class holds vLLM's KV tensors (which vLLM keeps
        // for the engine's life) for as long as this object, and calls `run`
        // only between forward passes.
        let shard = Shard { rank, ranks };
        let side =
            unsafe { WorkerSide::start(&cfg, geometry(geometry_), engine_id, tensors, shard) }
                .map_err(worker_err)?;
        Ok(PyWorker {
            inner: Mutex::new(Some(side)),
        })
    }

    /// Runs a step's plan (stores, then loads) and returns what vLLM asks
    /// for after it: the report for the scheduler side (or `None`), the
    /// requests whose stores are all done, and the G1 blocks whose load
    /// failed. One call a step: each call into Rust costs the step a
    /// little, and the copies are synchronous, so all three are known here.
    ///
    /// `stream`: vLLM's current CUDA stream when its KV cache is on a GPU
    /// (`torch.cuda.current_stream().cuda_stream`), 0 otherwise. There the
    /// copies are only enqueued, ordered against it, and the report holds
    /// the batches that have run so far (the rest come with later calls
    /// or [`Self::poll`]).
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (plan, stream=0))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        plan: &[u8],
        stream: u64,
    ) -> PyResult<(Option<Bound<'py, PyBytes>>, Vec<String>, Vec<u32>)> {
        let plan = StepPlan::from_bytes(plan).map_err(|e| worker_err(WorkerError::Meta(e)))?;
        let copies = plan.copies();
        let run = move || {
            let mut g = self.lock();
            let w = g.as_mut().ok_or_else(gone)?;
            w.bind_plan(plan);
            // SAFETY: the Python class passes torch's current stream of
            // vLLM's device (or 0): this private module's contract.
            unsafe { w.run_on(stream) };
            Ok::<_, PyErr>((
                w.take_report(),
                w.take_finished_sending(),
                w.take_load_errors(),
            ))
        };
        // The GIL is let go only around copies (for another thread that
        // may want it meanwhile); a plan with none is bookkeeping, cheaper
        // than handing the GIL over and taking it back. Either way the
        // mutex is taken and let go inside (see the module docs).
        let (report, sending, errors) = if copies { py.detach(run) } else { run() }?;
        Ok((report.map(|b| PyBytes::new(py, &b)), sending, errors))
    }

    /// The report of GPU copies that have run since the last one, or
    /// `None`. Never blocks.
    fn poll<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let report = self.lock().as_mut().ok_or_else(gone)?.poll();
        Ok(report.map(|b| PyBytes::new(py, &b)))
    }

    fn shutdown(&self, py: Python<'_>) {
        // Without the GIL: a `run` on another thread may hold the side.
        py.detach(|| {
            let side = self.lock().take();
            drop(side);
        });
    }
}

/// The Rust core of kvbm's vLLM connector.
#[pymodule]
fn _kvbm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Inside vLLM nothing subscribes to `tracing`: without this, kvbm's
    // warnings (a step's request left out, a host tier whose pages could not
    // be faulted in, an attach server slow to stop) reached no one. To
    // stderr, which vLLM's processes keep; `KVBM_LOG` sets the filter
    // (`warn` by default; `kvbm_core=debug,warn` and the like, the
    // targets form of `RUST_LOG`, which needs no regex engine). A process
    // that installed its own subscriber keeps it.
    {
        use tracing_subscriber::filter::Targets;
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        let asked = std::env::var("KVBM_LOG").ok();
        let parsed = asked.as_deref().map(str::parse::<Targets>);
        let filter = match &parsed {
            Some(Ok(t)) => t.clone(),
            _ => Targets::new().with_default(tracing::Level::WARN),
        };
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            // Colours only for a person at a terminal, not in vLLM's log files.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .finish()
            .with(filter)
            .try_init();
        if let (Some(asked), Some(Err(e))) = (asked, parsed) {
            tracing::warn!(
                "KVBM_LOG={asked:?} is not a filter ({e}): give levels by target, as \
                 `kvbm_py=debug,warn`; using `warn`"
            );
        }
    }
    m.add_function(wrap_pyfunction!(check_config, m)?)?;
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyWorker>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // So a benchmark can refuse to time a debug build: the real-engine
    // tests install one (scripts/test-vllm.sh) into the same environment.
    m.add("DEBUG_BUILD", cfg!(debug_assertions))?;
    Ok(())
}
