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
"""

import functools
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
MAX_STEPS = 200_000


class _Side:
    def __init__(self):
        self.now = 0
        self.steps = []
        self.methods = {}  # name -> [calls, ns]


_SIDES = {"scheduler": _Side(), "worker": _Side()}
_written = [0.0]
# The scheduler-side connector object, when it is kvbm's: its Rust side's
# time by phase goes out with each dump.
_kvbm = [None]


def _dump(prefix, force=False):
    now = time.monotonic()
    if not force and now - _written[0] < 1.0:
        return
    _written[0] = now
    out = {k: s.steps for k, s in _SIDES.items() if s.steps}
    out["methods"] = {k: s.methods for k, s in _SIDES.items() if s.methods}
    sched = getattr(_kvbm[0], "_sched", None)
    if sched is not None:
        out["phases"] = json.loads(sched.counters()).get("phases_us_per_step", {})
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


def read(prefix):
    """{side: [ns per step, ...]} over a trial's processes, under
    "methods" {side: {method: [calls, ns]}}, and under "phases" kvbm's
    scheduler side's µs a step by phase, one dict per process."""
    got = {"methods": {}}
    for path in glob.glob(f"{glob.escape(prefix)}.*.json"):
        with open(path) as f:
            for side, steps in json.load(f).items():
                if side == "phases":
                    got.setdefault("phases", []).append(steps)
                elif side == "methods":
                    for sd, ms in steps.items():
                        for name, (calls, ns) in ms.items():
                            acc = got["methods"].setdefault(sd, {}).setdefault(name, [0, 0])
                            acc[0] += calls
                            acc[1] += ns
                else:
                    got.setdefault(side, []).extend(steps)
    return got
