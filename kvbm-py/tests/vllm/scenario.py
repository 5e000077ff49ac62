"""One real-engine scenario per process: `python scenario.py NAME JSON_ARGS`.

Each prints `RESULT {...}` lines that the driver (`run.py`) checks.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine  # noqa: E402
import timing  # noqa: E402

# vLLM's engine processes import this module again (multiprocessing's
# spawn): the benchmark's timing wraps the connectors in each of them.
timing.install()
# The oracle's async-scheduling runs: vLLM's CPU platform would turn it off
# (here and in every process vLLM spawns, which imports this module again).
if os.environ.get("KVBM_TEST_ASYNC") == "1":
    engine.allow_async_scheduling_on_cpu()


def baseline(args):
    """Outputs without any connector."""
    llm = engine.engine(connector=False)
    outs, cached = engine.generate(llm, engine.prompts())
    engine.say(outputs=outs, cached=cached)


def roundtrip(args):
    """Round 1 computes and stores; the device cache is reset; round 2
    must hit kvbm's tiers and produce the same tokens."""
    t0 = time.time()
    more = {k: args[k] for k in ("kv_bytes", "max_num_seqs") if k in args}
    llm = engine.engine(extra=args.get("extra", {}),
                        connector_class=tuple(args.get("connector", ("KvbmConnector", "kvbm.vllm"))), **more)
    up = engine.elapsed(t0)
    ps = engine.prompts()
    outs1, cached1 = engine.generate(llm, ps)
    if args.get("reset", True):
        llm.reset_prefix_cache()
    if args.get("between"):
        # Other prompts between the rounds: they take the device's blocks
        # as a busy engine's traffic would, with no reset.
        engine.generate(llm, engine.prompts(salt=1))
    outs2, cached2 = engine.generate(llm, ps)
    engine.say(up_s=up, outputs1=outs1, cached1=cached1, outputs2=outs2, cached2=cached2)
    engine.say(engine_core_exit=engine.close(llm))


def oracle(args):
    """The KV oracle, in one engine with real random weights of a large
    spread (`engine.make_oracle_model`):

    1. the prompts, computed (kvbm stores their blocks);
    2. the same prompts again: vLLM's own prefix cache serves their
       prefixes (the reference);
    3. vLLM's prefix cache reset; the same prompts: kvbm serves the
       prefixes (the run under test);
    4. reset again, with every load corrupted on purpose (the file named
       by `KVBM_TEST_CORRUPT_LOADS` made): the comparison must fail.

    Each pass reports each request's tokens, the exact bits of each
    generated token's logprob and its cached prefix length; with the
    engine core in process, also a digest of the batches it was in
    (`engine.Schedules`). With `KVBM_TEST_DUMP_DIR`, the clean pass's byte
    dumps are moved to `<dump>-clean` before the corrupt pass."""
    t0 = time.time()
    llm = engine.engine(
        extra=args.get("extra", {}),
        model=args["model"],
        kv_bytes=args.get("kv_bytes", 4 * 1024 * 1024),
        max_num_seqs=args.get("max_num_seqs", 8),
        connector_class=tuple(args.get("connector", ("KvbmConnector", "kvbm.vllm"))),
        **args.get("llm", {}),
    )
    up = engine.elapsed(t0)
    cfg = llm.llm_engine.vllm_config
    ps = engine.prompts(groups=4, per_group=6)
    mt = args.get("max_tokens", 8)
    # Each request's batches, where the engine core runs in process.
    sched = engine.Schedules.capture(llm)
    first = engine.generate_logprobs(llm, ps, mt, sched)
    ref = engine.generate_logprobs(llm, ps, mt, sched)
    reset1 = llm.reset_prefix_cache()
    kvbm = engine.generate_logprobs(llm, ps, mt, sched)
    dump = os.environ.get("KVBM_TEST_DUMP_DIR")
    if dump and os.path.isdir(dump):
        os.rename(dump, dump + "-clean")
    with open(os.environ["KVBM_TEST_CORRUPT_LOADS"], "w"):
        pass
    reset2 = llm.reset_prefix_cache()
    corrupt = engine.generate_logprobs(llm, ps, mt, sched)
    serve = args.get("extra", {}).get("serve")
    if serve:
        # What the console's model (the reducer) credits each request, once
        # it has applied every event the server has.
        snap = settled_snapshot(serve)
        engine.say(
            hits={rid: s.get("hit_tokens") for rid, s in snap.get("slots", {}).items()},
            pruned_slots=snap.get("pruned_slots"),
            engine_info=snap.get("engine_info"),
        )
    engine.say(
        up_s=up,
        tp=cfg.parallel_config.tensor_parallel_size,
        async_scheduling=bool(cfg.scheduler_config.async_scheduling),
        max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
        resets=[reset1, reset2],
        first=first,
        ref=ref,
        kvbm=kvbm,
        corrupt=corrupt,
    )
    engine.say(engine_core_exit=engine.close(llm))


def http(method, url, body=None, timeout=10):
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def settled_snapshot(serve, timeout_s=10.0):
    """The attach server's model once it has caught up: its last applied
    event is the newest the server holds, and a poll later nothing more
    came. The events of a pass's last steps reach the model a little after
    `generate` returns; a snapshot taken at once may miss them. After
    `timeout_s`, the latest snapshot as it is (the check then says what it
    lacks)."""
    deadline = time.time() + timeout_s
    prev = None
    while True:
        newest = (http("GET", f"http://{serve}/health") or {}).get("last_seq")
        snap = http("GET", f"http://{serve}/snapshot")
        got = (snap.get("stream") or {}).get("last_seq")
        if got is not None and newest is not None and got >= newest and got == prev:
            return snap
        if time.time() > deadline:
            return snap
        prev = got
        time.sleep(0.2)


def hold_while_others_finish(llm, base, ps, held, first):
    """Generates `ps` on a thread while a breakpoint holds the request
    whose id starts with `held`, until the round's other requests (ids
    numbered from `first`) have finished or 60 s pass. Returns the thread,
    where its outputs will be, and what was seen of the held request."""
    import threading

    result = {}
    t = threading.Thread(target=lambda: result.setdefault("gen", engine.generate(llm, ps)))
    t0 = time.time()
    t.start()
    held_seen = others_done = False
    h = {}
    while time.time() - t0 < 60:
        slots = http("GET", base + "/snapshot").get("slots", {})
        paused = http("GET", base + "/breakpoints")["paused"]
        held_seen = held_seen or any(str(p["call"].get("request", "")).startswith(held) for p in paused)
        h = next((v for k, v in slots.items() if k.startswith(held)), {})
        others = [v for k, v in slots.items() if int(k.split("-")[0]) >= first and not k.startswith(held)]
        if held_seen and len(others) == len(ps) - 1 and all(s["state"] == "Finished" for s in others):
            others_done = True
            break
        time.sleep(0.2)
    return t, result, {"others_done": others_done, "held_seen": held_seen, "held_state": h.get("state"),
                       "held_computed": h.get("computed", 0), "still_running": t.is_alive()}


def stopped_by_step_breakpoint(llm, base, ps):
    """Arms a breakpoint on build_connector_metadata, generates `ps` on a
    thread, and says whether a step paused there, whether generation was
    still blocked 1.5 s later, how many events came meanwhile, and the
    outputs once the breakpoint was cleared."""
    import threading

    http("POST", base + "/breakpoints", {"entry": "BuildConnectorMetadata"})
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("gen", engine.generate(llm, ps)))
    t.start()
    paused_at = None
    t0 = time.time()
    while time.time() - t0 < 30 and paused_at is None:
        paused = http("GET", base + "/breakpoints")["paused"]
        if any(p["call"]["entry"] == "BuildConnectorMetadata" for p in paused):
            # Events emitted just before the pause reach the server's ring
            # up to the feeder's poll (5 ms) later: count from after that.
            time.sleep(0.2)
            paused_at = http("GET", base + "/snapshot")["stream"]["events"]
        time.sleep(0.1)
    time.sleep(1.5)
    after = http("GET", base + "/snapshot")["stream"]["events"]
    blocked = t.is_alive()
    http("POST", base + "/breakpoints/clear", {})
    t.join(60)
    outs, _ = result.get("gen", (None, None))
    return {"paused": paused_at is not None, "events_while_paused": after - (paused_at or 0),
            "blocked": blocked, "outputs": outs}


def breakpoints(args):
    """A breakpoint on one request holds that request only: the others
    finish while it makes no progress; resumed, it finishes with the
    tokens it would have had. Then a request held with nobody resuming it
    goes on by itself at its short deadline."""
    port = args["port"]
    base = f"http://127.0.0.1:{port}"
    extra = dict(args.get("extra", {}), serve=f"127.0.0.1:{port}", breakpoint_deadline_s=args["deadline_s"])
    llm = engine.engine(extra=extra)
    ps = engine.prompts()
    held = args["held"]
    # vLLM's request ids are `<n>-<random>`: the breakpoint names a prefix.
    bp = http("POST", base + "/breakpoints", {"request": {"Prefix": held}})
    t, result, info = hold_while_others_finish(llm, base, ps, held, first=0)
    engine.say(phase="held", **info)
    http("POST", base + "/resume", {})
    t.join(120)
    outs, cached = result.get("gen", (None, None))
    engine.say(phase="resumed", outputs=outs, breakpoint=bp)
    # Part two: nobody resumes; the deadline does.
    http("POST", base + "/breakpoints/clear", {})
    later = args["late"]
    http("POST", base + "/breakpoints", {"request": {"Prefix": later}})
    t1 = time.time()
    outs2, _ = engine.generate(llm, ps[:2])
    engine.say(phase="deadline", outputs=outs2, took_s=engine.elapsed(t1))
    # Part three: a breakpoint on a per-step entry point stops the whole
    # engine until it is cleared.
    http("POST", base + "/breakpoints/clear", {})
    engine.say(phase="engine", **stopped_by_step_breakpoint(llm, base, ps[:4]))


def logprobs(args):
    """The oracle's prompts twice (computed, then from vLLM's own prefix
    cache), each token's logprob as exact bits: with kvbm as configured
    (`extra`), or with no connector at all (`connector: false`)."""
    llm = engine.engine(extra=args.get("extra", {}), connector=args.get("connector", True),
                        model=args["model"], kv_bytes=args.get("kv_bytes", 4 * 1024 * 1024),
                        **args.get("llm", {}))
    cfg = llm.llm_engine.vllm_config
    ps = engine.prompts(groups=4, per_group=6)
    mt = args.get("max_tokens", 8)
    passes = [engine.generate_logprobs(llm, ps, mt), engine.generate_logprobs(llm, ps, mt)]
    engine.say(passes=passes, async_scheduling=bool(cfg.scheduler_config.async_scheduling),
               tp=cfg.parallel_config.tensor_parallel_size)
    engine.close(llm)


def beside(args):
    """kvbm (`extra`) after another connector (`beside`) in vLLM's
    MultiConnector. Round one: every request's prefix as vLLM counted it
    (`num_cached_tokens`) beside what kvbm's console model credits it
    (its G1 hit, the other connector's tokens). Round two: a breakpoint
    on one request holds it while the others finish; resumed, it
    finishes. Then a breakpoint on build_connector_metadata stops the
    engine until it is cleared."""
    port = args["port"]
    base = f"http://127.0.0.1:{port}"
    extra = dict(args.get("extra", {}), serve=f"127.0.0.1:{port}")
    llm = engine.engine(extra=extra, beside=args["beside"], **args.get("llm", {}))
    ps = engine.prompts()
    outs, cached = engine.generate(llm, ps)
    ids = [f"{i}-" for i in range(len(ps))]
    slots = http("GET", base + "/snapshot").get("slots", {})
    seen = {}
    for prefix, c in zip(ids, cached):
        s = next((v for k, v in slots.items() if k.startswith(prefix)), {})
        seen[prefix] = {"vllm_cached": c, "g1_hit": (s.get("hit_tokens") or [None])[0],
                        "external": s.get("external_tokens")}
    engine.say(phase="hits", requests=seen, outputs=outs)
    held = f"{len(ps) + 2}-"
    http("POST", base + "/breakpoints", {"request": {"Prefix": held}})
    t, result, info = hold_while_others_finish(llm, base, ps, held, first=len(ps))
    engine.say(phase="held", **info)
    http("POST", base + "/resume", {})
    t.join(120)
    outs2, _ = result.get("gen", (None, None))
    engine.say(phase="resumed", finished=outs2 is not None and all(len(o) == 8 for o in outs2))
    # A breakpoint on a per-step entry point stops the whole engine until
    # it is cleared.
    http("POST", base + "/breakpoints/clear", {})
    engine.say(phase="step", **stopped_by_step_breakpoint(llm, base, ps[:4]))
    engine.close(llm)


def badconfig(args):
    """Starting vLLM with this extra config must fail."""
    engine.engine(extra=args["extra"])
    engine.say(started=True)


def serve_workload(args):
    """A long-running engine for the console test: rounds of requests, the
    device cache reset between them so blocks come back from kvbm."""
    port = args["port"]
    extra = {"serve": f"127.0.0.1:{port}", "host_capacity_tokens": args.get("host_capacity_tokens", 8192)}
    for key in ("record", "shm_dir"):
        if args.get(key):
            extra[key] = args[key]
    llm = engine.engine(extra=extra)
    engine.say(serving=port)
    deadline = time.time() + args["seconds"]
    rounds = 0
    while time.time() < deadline:
        t = time.time()
        _, cached = engine.generate(llm, engine.prompts(), max_tokens=args.get("max_tokens", 48))
        # vLLM refuses the reset while blocks are still held; the round's
        # line says so (the next round would then hit the device cache, and
        # nothing would come back from G2).
        reset = llm.reset_prefix_cache()
        rounds += 1
        engine.say(round=rounds, round_s=round(time.time() - t, 2), cached_tokens=sum(cached), reset=reset)
    engine.say(rounds=rounds)


def bench(args):
    """The same workload with kvbm's connector (recording on) or a
    connector that does nothing: wall time over several rounds."""
    from vllm import LLM  # noqa: F401

    kind = args["connector"]
    more = args.get("llm", {})
    kw = {}
    if kind == "kvbm":
        llm = engine.engine(extra=args.get("extra", {}), **more)
    elif kind == "noop":
        llm = engine.noop_engine(**more)
    else:
        llm = engine.engine(connector=False, **more)
    ps = engine.prompts(groups=4, per_group=6)
    engine.generate(llm, ps)  # warm up
    llm.reset_prefix_cache()
    if args.get("pin", True):
        kw["cpus"] = engine.keep_off_worker_cpus()
    cpu0 = engine.thread_cpu()
    t0 = time.perf_counter()
    rounds = []
    for _ in range(args["rounds"]):
        t = time.perf_counter()
        engine.generate(llm, ps, max_tokens=args.get("max_tokens", 32))
        llm.reset_prefix_cache()
        rounds.append(round(time.perf_counter() - t, 4))
    wall = time.perf_counter() - t0
    kw["threads"] = engine.cpu_by_thread(cpu0, engine.thread_cpu())
    engine.say(connector=kind, wall_s=round(wall, 4), rounds_s=rounds, **kw)
    # Shut down and wait: the connectors' shutdown writes the last of the
    # per-step timings (timing.py), and the bench kills what is left of
    # this process group once this process exits.
    engine.close(llm)


def serve(args):
    """One engine for the interleaved benchmark (`bench.py`): built like
    `bench`'s, warmed up and pinned, then a round of the workload each time
    a line `round` comes on stdin (new prompts each round, or with `reuse`
    the warm-up's again), answered with the round's wall time and
    the CPU each thread of the engine's processes spent in it; `quit` shuts
    it down. Between rounds the benchmark stops this whole process group
    (SIGSTOP), so only one engine runs at a time."""
    kind = args["connector"]
    more = args.get("llm", {})
    if kind == "kvbm":
        llm = engine.engine(extra=args.get("extra", {}), **more)
    else:
        llm = engine.noop_engine(**more)
    reuse = args.get("reuse", False)
    ps = engine.prompts(groups=4, per_group=6)
    engine.generate(llm, ps)  # warm up
    llm.reset_prefix_cache()
    cpus = engine.keep_off_worker_cpus() if args.get("pin", True) else None
    engine.say(ready=True, cpus=cpus)
    rounds = 0
    for line in sys.stdin:
        if line.strip() != "round":
            break
        rounds += 1
        # Without reuse each round's prompts are new (another salt): no
        # tier can serve any of them, so what kvbm adds is its cost alone.
        # With reuse the same prompts come back after vLLM's prefix cache
        # was reset, and kvbm serves their prefixes from its host tier.
        if not reuse:
            ps = engine.prompts(groups=4, per_group=6, salt=rounds)
        c0 = engine.thread_cpu()
        t = time.perf_counter()
        engine.generate(llm, ps, max_tokens=args.get("max_tokens", 32))
        llm.reset_prefix_cache()
        wall = time.perf_counter() - t
        engine.say(round_s=round(wall, 5), threads=engine.cpu_by_thread(c0, engine.thread_cpu()))
    engine.close(llm)
    engine.say(closed=True)


def main():
    engine.bounded(int(os.environ.get("KVBM_SCENARIO_TIMEOUT_S", "240")))
    name = sys.argv[1]
    args = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    globals()[name](args)


if __name__ == "__main__":
    main()
