"""The connector's own time per step, as vLLM sees it: every call vLLM
makes to a connector class, Python and Rust alike, on the scheduler side
and on the worker side (benchmark only).

`install()` wraps the methods of kvbm's connector and of the do-nothing
connector alike, so both pay the same for being measured (two clock reads
a call, well under a microsecond). A scheduler-side step is every call
from one `build_connector_meta` to the next, that one included (as the
Rust side counts its own time); a worker-side step, every call from one
`build_connector_worker_meta` to the next. Each process keeps its steps
and writes what it has to `$KVBM_BENCH_TIMING.<pid>.json` at most once a
second and when vLLM shuts the connector down; `read(prefix)` gathers a
trial's files.

Python's garbage collector is timed beside them, in every process that
makes a connector call (`gc.callbacks`): the collections by generation and
their time, so that a connector that leaves the worker more objects to scan
shows as the GC time it adds, not as an unexplained slower forward pass.

vLLM's own calls on each side of a step are timed too: the scheduler's
`schedule` and `update_from_output` in the engine core (the connector's
scheduler-side calls run inside them), the worker's `execute_model` and
`sample_tokens` (the forward pass, the connector's worker-side calls
inside it). On a 2-core machine each of vLLM's two processes busy-waits
for the other (`sched_yield` in its shared-memory queue), so their CPU a
round is the round's wall time whatever runs; these say which side's
work a step grew.
"""

import functools
import gc
import glob
import json
import os
import time

SCHEDULER = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)
WORKER = (
    "bind_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)
# Where a side's step ends.
LAST = {"scheduler": "build_connector_meta", "worker": "build_connector_worker_meta"}
# vLLM's own calls a step, by the side whose process makes them:
# (module, class, method).
VLLM = {
    "scheduler": (("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
                  ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output")),
    "worker": (("vllm.v1.worker.gpu_worker", "Worker", "execute_model"),
               ("vllm.v1.worker.gpu_worker", "Worker", "sample_tokens")),
}
MAX_STEPS = 200_000


class _Side:
    def __init__(self):
        self.now = 0
        self.steps = []
        self.methods = {}  # name -> [calls, ns]
        self.vllm = {}  # vLLM's own method -> [calls, ns]


_SIDES = {"scheduler": _Side(), "worker": _Side()}
_written = [0.0]
# Collections by generation in this process: [count, ns] each; the pid
# whose callback is installed (a forked child installs its own).
_GC = {"pid": None, "gens": [[0, 0], [0, 0], [0, 0]], "start": 0}
# The scheduler-side connector object, when it is kvbm's: its Rust side's
# time by phase goes out with each dump.
_kvbm = [None]


def _gc_callback(phase, info):
    if phase == "start":
        _GC["start"] = time.perf_counter_ns()
        return
    gen = _GC["gens"][min(info.get("generation", 2), 2)]
    gen[0] += 1
    gen[1] += time.perf_counter_ns() - _GC["start"]


def _watch_gc():
    pid = os.getpid()
    if _GC["pid"] == pid:
        return
    if _GC["pid"] is None:
        gc.callbacks.append(_gc_callback)
    # Counts inherited from a parent are the parent's.
    _GC["pid"], _GC["gens"] = pid, [[0, 0], [0, 0], [0, 0]]


def _dump(prefix, force=False):
    now = time.monotonic()
    if not force and now - _written[0] < 1.0:
        return
    _written[0] = now
    out = {k: s.steps for k, s in _SIDES.items() if s.steps}
    out["methods"] = {k: s.methods for k, s in _SIDES.items() if s.methods}
    out["vllm"] = {k: s.vllm for k, s in _SIDES.items() if s.vllm}
    # This process's collections, under the side whose steps it ran.
    out["gc"] = {k: _GC["gens"] for k, s in _SIDES.items() if s.steps}
    sched = getattr(_kvbm[0], "_sched", None)
    if sched is not None:
        c = json.loads(sched.counters())
        out["phases"] = c.get("phases_us_per_step", {})
        # How the deferred work's runner found each step's work: the steps
        # left to it, and the posts that had to wake it.
        out["runner"] = dict(c.get("deferred_runner", {}),
                             deferred_steps=c.get("counters", {}).get("deferred_steps", 0))
    path = f"{prefix}.{os.getpid()}.json"
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


def _wrap(cls, name, side, prefix):
    fn = cls.__dict__.get(name) or getattr(cls, name, None)
    if fn is None or getattr(fn, "_kvbm_timed", False):
        return
    s = _SIDES[side]
    last = LAST[side] == name

    @functools.wraps(fn)
    def timed(*a, **k):
        if last and side == "scheduler" and _kvbm[0] is None and getattr(a[0], "_sched", None) is not None:
            _kvbm[0] = a[0]
        _watch_gc()
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter_ns() - t
            s.now += dt
            m = s.methods.setdefault(name, [0, 0])
            m[0] += 1
            m[1] += dt
            if last:
                if len(s.steps) < MAX_STEPS:
                    s.steps.append(s.now)
                s.now = 0
                _dump(prefix)

    timed._kvbm_timed = True
    setattr(cls, name, timed)


def _wrap_vllm(cls, name, side):
    fn = cls.__dict__.get(name)
    if fn is None or getattr(fn, "_kvbm_timed", False):
        return
    acc = _SIDES[side].vllm.setdefault(name, [0, 0])

    @functools.wraps(fn)
    def timed(*a, **k):
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += 1
            acc[1] += time.perf_counter_ns() - t

    timed._kvbm_timed = True
    setattr(cls, name, timed)


def _wrap_shutdown(cls, prefix):
    fn = cls.__dict__.get("shutdown") or getattr(cls, "shutdown", None)
    if fn is None or getattr(fn, "_kvbm_timed", False):
        return

    @functools.wraps(fn)
    def shutdown(*a, **k):
        _dump(prefix, force=True)
        return fn(*a, **k)

    shutdown._kvbm_timed = True
    setattr(cls, "shutdown", shutdown)


def install():
    """Wraps both connector classes when `KVBM_BENCH_TIMING` names a file
    prefix; does nothing otherwise."""
    prefix = os.environ.get("KVBM_BENCH_TIMING")
    if not prefix:
        return
    import noop
    from kvbm.vllm import KvbmConnector

    for cls in (KvbmConnector, noop.NoopConnector):
        for side, names in (("scheduler", SCHEDULER), ("worker", WORKER)):
            for n in names:
                _wrap(cls, n, side, prefix)
        _wrap_shutdown(cls, prefix)
    import importlib

    for side, calls in VLLM.items():
        for module, cls, name in calls:
            _wrap_vllm(getattr(importlib.import_module(module), cls), name, side)


def read(prefix):
    """{side: [ns per step, ...]} over a trial's processes, under
    "methods" {side: {method: [calls, ns]}}, and under "phases" kvbm's
    scheduler side's µs a step by phase, one dict per process (under
    "runner", its deferred-work runner's counters, likewise), and under
    "gc" {side: [[collections, ns] by generation]}, and under "vllm"
    {side: {vLLM's method: [calls, ns]}}."""
    got = {"methods": {}, "gc": {}, "vllm": {}}
    for path in glob.glob(f"{glob.escape(prefix)}.*.json"):
        with open(path) as f:
            for side, steps in json.load(f).items():
                if side in ("phases", "runner"):
                    got.setdefault(side, []).append(steps)
                elif side == "gc":
                    for sd, gens in steps.items():
                        acc = got["gc"].setdefault(sd, [[0, 0], [0, 0], [0, 0]])
                        for a, (n, ns) in zip(acc, gens):
                            a[0] += n
                            a[1] += ns
                elif side in ("methods", "vllm"):
                    for sd, ms in steps.items():
                        for name, (calls, ns) in ms.items():
                            acc = got[side].setdefault(sd, {}).setdefault(name, [0, 0])
                            acc[0] += calls
                            acc[1] += ns
                else:
                    got.setdefault(side, []).extend(steps)
    return got
