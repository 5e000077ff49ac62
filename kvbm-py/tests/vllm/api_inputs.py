"""Regression checks of `kvbm._kvbm` against inputs vLLM would never give:
each was once accepted (or hung, or aborted the process) and must now be a
clear error naming what was wrong, or just work. Quick, no vLLM engine:
run it with the kvbm package installed (`python api_inputs.py`); prints
one `ok: ...` line per check and exits non-zero on the first failure.

A deadlock fails instead of hanging: a watchdog below the interpreter
(faulthandler) dumps every thread's stack and exits. The host tier's
files are made only in a temporary directory, removed at the end."""

import ctypes
import faulthandler
import json
import os
import shutil
import sys
import tempfile
import threading
import time

# The whole script takes a second or two; a stuck one is a failure.
WATCHDOG_S = 60
faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)

import kvbm._kvbm as K  # noqa: E402  (after the watchdog: importing may hang too)

# 16 blocks of 4 tokens, 2 layers, 64-byte pages.
G = (16, 4, 2, 64)
TMP = tempfile.mkdtemp(prefix="kvbm-api-inputs-")


def ok(what):
    print(f"ok: {what}", flush=True)


def cfg(shm, **extra):
    c = {"host_capacity_tokens": 64, "shm_dir": shm}
    c.update(extra)
    return json.dumps(c)


def fresh_dir(name):
    d = os.path.join(TMP, name)
    os.makedirs(d)
    return d


def raises(exc, fn, *args):
    """The exception `fn(*args)` raises (of type `exc`); fails if none."""
    try:
        fn(*args)
    except exc as e:
        return str(e)
    raise AssertionError(f"{fn.__name__}{args!r:.200} did not raise {exc.__name__}")


class Cache:
    """'vLLM's' KV tensors for G: one buffer per layer, kept alive here."""

    def __init__(self, geometry=G):
        blocks, _, layers, page = geometry
        self.bufs = [(ctypes.c_uint8 * (blocks * page))() for _ in range(layers)]
        self.geometry = geometry

    def json(self, null_layer=None):
        blocks, _, _, page = self.geometry
        return json.dumps(
            [
                dict(
                    name=f"layer.{i}",
                    data_ptr=0 if i == null_layer else ctypes.addressof(b),
                    nbytes=blocks * page,
                    num_blocks=blocks,
                    block_stride_bytes=page,
                    contiguous=True,
                    device="cpu",
                )
                for i, b in enumerate(self.bufs)
            ]
        )


def store_plan(step, pairs):
    return json.dumps(
        dict(
            step=step,
            loads=[],
            failed_loads=[],
            finished_sending=[],
            stores=[
                dict(
                    route="DeviceToHost",
                    id=step,
                    pairs=[dict(src=s, dst=d, hash=s) for s, d in pairs],
                )
            ],
        )
    ).encode()


def check_geometry():
    """#2: absurd numbers are refused at start, naming them."""
    d = fresh_dir("geometry")
    e = raises(
        RuntimeError, K.Scheduler, cfg(d, host_capacity_tokens=2**41), (16, 2**40, 1, 64), "g"
    )
    assert "block_size" in e, e
    ok("a block_size of 2**40 is refused naming block_size")
    e = raises(RuntimeError, K.Scheduler, cfg(d), (2**63, 4, 2, 64), "g")
    assert "num_gpu_blocks" in e, e
    ok("2**63 device blocks are refused naming num_gpu_blocks")
    # A host tier whose bookkeeping (about 100 bytes a block: 200 GB here)
    # the machine cannot allocate aborted the process. Only where the
    # kernel refuses such an allocation (its default overcommit heuristic,
    # less memory than that): elsewhere it could take the memory.
    with open("/proc/meminfo") as f:
        mem_kib = sum(
            int(line.split()[1]) for line in f if line.startswith(("MemTotal:", "SwapTotal:"))
        )
    with open("/proc/sys/vm/overcommit_memory") as f:
        heuristic = f.read().strip() == "0"
    if heuristic and mem_kib * 1024 < 100e9:
        e = raises(RuntimeError, K.Scheduler, cfg(d, host_capacity_tokens=2**33), G, "g")
        assert "could not be allocated" in e and "host_capacity_tokens" in e, e
        ok("a host tier of 2**33 tokens is refused naming host_capacity_tokens")
    else:
        print("not run: a host tier of 2**33 tokens (this machine might hold it)")
    assert os.listdir(d) == [], os.listdir(d)


def check_concurrent_worker_calls():
    """#3: Worker.run on two threads at once, and a shutdown meanwhile,
    neither deadlocks (the GIL is never taken back under the mutex)."""
    d = fresh_dir("threads")
    g = (64, 16, 4, 65536)
    c = cfg(d, host_capacity_tokens=16 * 256)
    s = K.Scheduler(c, g, "threads")
    cache = Cache(g)
    w = K.Worker(c, g, "threads", cache.json())
    plan = store_plan(1, [(i, i) for i in range(64)])
    errors = []

    def loop():
        try:
            for _ in range(50):
                w.run(plan)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=loop) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    ok("Worker.run on two threads at once finishes")

    stop = threading.Event()

    def run_until_shut_down():
        while not stop.is_set():
            try:
                w.run(plan)
            except RuntimeError as e:
                if "shut down" not in str(e):
                    errors.append(e)
                return

    t = threading.Thread(target=run_until_shut_down)
    t.start()
    time.sleep(0.05)
    w.shutdown()
    stop.set()
    t.join()
    assert not errors, errors
    ok("Worker.shutdown while another thread runs a plan finishes")
    # The scheduler's calls from two threads, and its counters meanwhile.
    ts = [
        threading.Thread(target=lambda: [s.build_meta([], [], [], [], {}) for _ in range(200)]),
        threading.Thread(target=lambda: [s.counters() for _ in range(200)]),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    ok("Scheduler.build_meta and Scheduler.counters on two threads finish")
    s.shutdown()


def check_failed_start_leaves_nothing():
    """#5: a start that fails after the host tier's file was made removes
    it; a worker whose scheduler never came removes the file it made."""
    d = fresh_dir("failed-start")
    exists = fresh_dir("exists")
    raises(RuntimeError, K.Scheduler, cfg(d, record=exists), G, "f")
    assert os.listdir(d) == [], os.listdir(d)
    ok("a Scheduler that fails on `record` leaves no file in shm_dir")
    e = raises(
        RuntimeError, K.Scheduler, cfg(d, disk_path=exists, disk_capacity_tokens=64), G, "f"
    )
    assert "`disk_path`" in e, e
    assert os.listdir(d) == [], os.listdir(d)
    ok("a Scheduler that fails on disk_path names it and leaves no file")
    cache = Cache()
    w = K.Worker(cfg(d), G, "no-such-engine", cache.json())
    assert len(os.listdir(d)) == 1, os.listdir(d)
    w.shutdown()
    assert os.listdir(d) == [], os.listdir(d)
    ok("a Worker whose Scheduler never came removes its file at shutdown")
    # vLLM's order: the worker first, then its scheduler, which keeps the
    # file until it shuts down.
    w = K.Worker(cfg(d), G, "paired", cache.json())
    s = K.Scheduler(cfg(d), G, "paired")
    w.shutdown()
    assert len(os.listdir(d)) == 1, os.listdir(d)
    s.shutdown()
    assert os.listdir(d) == [], os.listdir(d)
    ok("a Worker started before its Scheduler leaves the file to it")


def check_engine_ids():
    """#6: ids a file name would make equal are different engines; the
    same id twice is refused while the first runs."""
    d = fresh_dir("ids")
    a = K.Scheduler(cfg(d), G, "eng/1")
    b = K.Scheduler(cfg(d), G, "eng1")
    x = K.Scheduler(cfg(d), G, "")
    y = K.Scheduler(cfg(d), G, "\u00e9\u00e9")
    assert len(os.listdir(d)) == 4, os.listdir(d)
    ok("'eng/1', 'eng1', '' and 'éé' have four files")
    b.shutdown()
    assert len(os.listdir(d)) == 3, os.listdir(d)
    ok("shutting 'eng1' down leaves 'eng/1''s file")
    e = raises(RuntimeError, K.Scheduler, cfg(d), G, "eng/1")
    assert "same engine_id" in e, e
    assert len(os.listdir(d)) == 3, os.listdir(d)
    ok("a second Scheduler for 'eng/1' is refused while the first holds it")
    for s in (a, x, y):
        s.shutdown()
    assert os.listdir(d) == [], os.listdir(d)


def check_settings():
    """#7 and #10: check_config refuses what the scheduler would, naming
    the key."""
    for extra, key in [
        ({"serve": "127.0.0.1:0", "token": "secret\n"}, "token"),
        ({"serve": "127.0.0.1:0", "token": "a b"}, "token"),
        ({"ship_timeout_s": 1e-300}, "ship_timeout_s"),
        ({"breakpoint_deadline_s": 5e-324}, "breakpoint_deadline_s"),
        ({"breakpoint_deadline_s": 0.0001}, "breakpoint_deadline_s"),
    ]:
        e = raises(ValueError, K.check_config, json.dumps(extra))
        assert f"`{key}`" in e, e
        ok(f"check_config refuses {extra!r} naming `{key}`")
    K.check_config(json.dumps({"ship_timeout_s": 0.001, "breakpoint_deadline_s": 0.001}))
    ok("check_config accepts 1 ms for both durations")


def check_scheduler_inputs():
    """#8, #9, #11 and build_meta's arithmetic."""
    d = fresh_dir("inputs")
    s = K.Scheduler(cfg(d), G, "inputs")
    assert s.get_num_new_matched_tokens("A", list(range(9)), 0) == 0
    for blocks, ext, what in [
        ([1, 99999], 0, "99999"),
        ([1, 4294967295], 0, "4294967295"),
        ([1, 2, 3], 8, "num_external_tokens 8"),
    ]:
        e = raises(RuntimeError, s.update_state_after_alloc, "A", blocks, ext)
        assert "request A:" in e and what in e, e
        ok(f"update_state_after_alloc refuses {what}")
    s.update_state_after_alloc("A", [1, 2, 3], 0)

    for i in range(2000):
        raises(RuntimeError, s.update_state_after_alloc, f"ghost-{i}", [1, 2, 3], 0)
    # A refused request is not kept: kvbm knows nothing of it.
    assert s.request_finished("ghost-0", []) is False
    s.build_meta([("ghost-1", 0, ([0],))], [], [], [], {"ghost-1": 4})
    ok("refused update_state_after_alloc calls leave no entry behind")

    e = raises(RuntimeError, s.update_state_after_alloc, "req-42", [1], 0)
    assert e.count("req-42") == 1, e
    e = raises(RuntimeError, s.update_state_after_alloc, "r" * 10_000_000, [1], 0)
    assert len(e) < 1000, len(e)
    ok("a refused request is named once, clipped")

    # One request's impossible numbers leave it out of the step, not the
    # others.
    s.build_meta([], ["A", "A"], [None, ([99999],)], [2**64 - 1, 0], {"A": 2})
    refused = json.loads(s.counters())["counters"]["refused_scheduled"]
    assert refused == 2, refused
    ok("build_meta leaves out a request whose computed tokens overflow")
    s.shutdown()
    check_step_lists()

    cache = Cache()
    d = fresh_dir("null")
    e = raises(RuntimeError, K.Worker, cfg(d), G, "null", cache.json(null_layer=1))
    assert "layer.1" in e and "null" in e, e
    ok("a tensor at address 0 is said to be null")


DROPPED = """
import json, sys
sys.path.insert(0, {here!r})
import kvbm._kvbm as K
for i in range(20):
    s = K.Scheduler(json.dumps({{"host_capacity_tokens": 0}}), {g!r}, f"drop-{{i}}")
    s.get_num_new_matched_tokens("A", list(range(9)), 0)
    s.update_state_after_alloc("A", [1, 2, 3], 0)
    s.build_meta([("A", 0, ([1, 2, 3],))], [], [], [], {{"A": 9}})
    del s  # with the step left for its runtime, never shut down
print("done")
"""


def check_dropped_with_deferred_work():
    """A scheduler dropped without `shutdown` right after a step whose
    following it left to its runtime: the side ends on the dropping
    thread, never in the runtime's task (dropping a runtime from one of
    its own tasks panics)."""
    import subprocess

    code = DROPPED.format(here=os.path.dirname(os.path.abspath(__file__)), g=G)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "done" in p.stdout, (p.returncode, p.stderr[-2000:])
    assert "panicked" not in p.stderr, p.stderr[-2000:]
    ok("a scheduler dropped with a step left for its runtime ends cleanly")


def check_step_lists():
    """build_meta reads vLLM's scheduler output in place: lists that are
    not what vLLM passes are a TypeError naming what was wrong; a
    request's own unreadable tokens or blocks leave it out of the step,
    counted, and the others go on. Then a seeded fuzz: no input of the
    wrong shape or type makes anything but an exception."""
    d = fresh_dir("step-lists")
    s = K.Scheduler(cfg(d), G, "lists")
    good, bad = [0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]
    assert s.get_num_new_matched_tokens("good", good[:5], 0, good, 5) == 0
    assert s.get_num_new_matched_tokens("bad", bad[:5], 0, bad, 5) == 0
    s.update_state_after_alloc("good", [1, 2], 0)
    s.update_state_after_alloc("bad", [3, 4], 0)
    s.build_meta([("good", 0, ([1, 2],)), ("bad", 0, ([3, 4],))], [], [], [], {"good": 5, "bad": 5})
    for args, what in [
        ((["good"], [], [5], {}), "1 ids, 0 block lists, 1 computed"),
        (([7], [None], [5], {}), "request 0's id is not a string"),
        ((["good"], [None], ["5"], {}), "request 0's computed tokens"),
        (([("x",)], [], [], [], {}), None),
        (([], [], [], [], {}, None, None, [7]), "a preempted request's id is not a string"),
    ]:
        full = args if len(args) >= 5 else ([],) + args
        e = raises(TypeError, s.build_meta, *full)
        assert what is None or what in e, (what, e)
    ok("build_meta refuses lists that are not vLLM's, saying which")

    def refused():
        return json.loads(s.counters())["counters"]["refused_scheduled"]

    before = refused()
    good.append(16)
    bad.append(-1)
    s.build_meta([], ["good", "bad"], [None, None], [5, 5], {"good": 1, "bad": 1})
    assert refused() == before + 1, (before, refused())
    bad[-1] = 2**40
    s.build_meta([], ["bad"], [None], [5], {"bad": 1})
    bad[-1] = 17
    s.build_meta([], ["good", "bad"], [(["x"],), None], [6, 5], {"good": 1, "bad": 1})
    assert refused() == before + 3, (before, refused())
    ok("a request's token that is no token id, or blocks that are no ids, leave it out, counted")

    # vLLM's outputs, kept by the class and told with its next call:
    # what is not a list of reports is a TypeError, and a report that does
    # not parse is counted, not a panic.
    def bad_reports():
        return json.loads(s.counters())["counters"]["bad_reports"]

    before = bad_reports()
    raises(TypeError, s.build_meta, [], [], [], [], {}, None, None, None, None, [["no bytes"]])
    raises(TypeError, s.outputs, [7])
    s.outputs([[b"\xff{"], []])
    s.build_meta([], [], [], [], {}, None, None, None, None, [[b"not a report"]])
    assert bad_reports() == before + 2, (before, bad_reports())
    # Step lists that are refused do not take the outputs with them.
    raises(TypeError, s.build_meta, [], [7], [None], [5], {}, None, None, None, None, [[b"nor this"]])
    assert bad_reports() == before + 3, (before, bad_reports())
    ok("outputs told with the next call: junk is a TypeError, a report that does not parse is counted")

    import random

    rng = random.Random(20261130)
    junk = [None, -1, 2**64, "x", b"y", 1.5, [], (), {}, [None], [[-1]], ([2**33],), object(), {"a": 1}]

    def anything():
        return rng.choice(junk + [rng.randrange(0, 20), ["good"], ["bad"], [([1],)]])

    for _ in range(2000):
        args = [[], ["good"], [None], [7], {"good": 1}, None, None, None, None, ()]
        for _ in range(rng.randrange(1, 4)):
            args[rng.randrange(len(args))] = anything()
        try:
            s.build_meta(*args)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            pass
    s.build_meta([], [], [], [], {})
    ok("2000 fuzzed build_meta calls: each an exception or a step, none a panic")
    s.shutdown()


def check_parallel():
    """Tensor-parallel ranks and pipeline stages vLLM would never give."""
    cache = Cache()
    d = fresh_dir("ranks")
    for rank, ranks in ((2, 2), (5, 2), (0, 0)):
        e = raises(ValueError, K.Worker, cfg(d), G, "tp", cache.json(), rank, ranks)
        assert f"rank {rank} of {ranks}" in e, e
    assert not os.listdir(d), os.listdir(d)
    ok("a worker rank outside its tensor-parallel size is refused naming both, and makes no file")
    e = raises(RuntimeError, K.Scheduler, cfg(d), G, "pp", 1, 2, False)
    assert "pipeline_parallel_size 2" in e, e
    e = raises(RuntimeError, K.Scheduler, cfg(d), G, "tp0", 0, 1, False)
    assert "tensor_parallel_size 0" in e, e
    e = raises(RuntimeError, K.Scheduler, cfg(d), G, "tp-huge", 1 << 40, 1, False)
    assert "tensor_parallel_size" in e, e
    assert not os.listdir(d), os.listdir(d)
    ok("pipeline stages and absurd tensor-parallel sizes are refused naming them, and make no file")
    w = [K.Worker(cfg(d), G, "tp2", cache.json(), r, 2) for r in range(2)]
    s = K.Scheduler(cfg(d), G, "tp2", 2, 1, True)
    assert "tensor parallel 2" in s.summary() and "async" in s.summary(), s.summary()
    assert sorted(f.rsplit(".", 2)[1] for f in os.listdir(d)) == ["tp0", "tp1"], os.listdir(d)
    s.shutdown()
    for x in w:
        x.shutdown()
    assert not os.listdir(d), os.listdir(d)
    ok("two ranks have a host-tier file each, removed at shutdown; the summary says tensor parallel 2, async")


def check_data_parallel():
    """vLLM's data-parallel engines share one kv_transfer_config: each is
    made an engine of its own (tiers, recording, attach server, fleet
    name); one engine keeps its settings as given."""
    from kvbm.vllm import _per_engine  # imports vLLM

    extra = {"record": "/r/run1", "serve": "127.0.0.1:7071", "disk_path": "/d/g3", "engine_id": "pod",
             "host_capacity_tokens": 64}
    assert _per_engine(extra, "e", 1, 0) == (extra, "e")
    got = [_per_engine(extra, "e", 2, r) for r in range(2)]
    assert got[1][0] == {"record": "/r/run1-dp1", "serve": "127.0.0.1:7072", "disk_path": "/d/g3.dp1",
                         "engine_id": "pod-dp1", "host_capacity_tokens": 64}, got[1]
    assert [g[1] for g in got] == ["e-dp0", "e-dp1"], got
    assert extra["record"] == "/r/run1", "the shared settings are not changed"
    d = fresh_dir("dp")
    cache = Cache()
    ws = [K.Worker(json.dumps(_per_engine(json.loads(cfg(d)), "e", 2, r)[0]), G, f"e-dp{r}", cache.json())
          for r in range(2)]
    assert len(os.listdir(d)) == 2, os.listdir(d)
    for w in ws:
        w.shutdown()
    # A port that the rank pushes past 65535 is refused naming `serve`.
    big = _per_engine({"serve": "127.0.0.1:65535"}, "e", 2, 1)[0]
    e = raises(ValueError, K.check_config, json.dumps(big))
    assert "serve" in e, e
    ok("data-parallel engines get their own tiers, recording, attach port and fleet name")


def main():
    try:
        check_parallel()
        check_data_parallel()
        check_geometry()
        check_concurrent_worker_calls()
        check_failed_start_leaves_nothing()
        check_engine_ids()
        check_settings()
        check_scheduler_inputs()
        check_dropped_with_deferred_work()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()
        shutil.rmtree(TMP, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
