"""A real vLLM (CPU backend) with a tiny random-weight Llama, for kvbm's
real-engine tests. Greedy decoding and token-id prompts make outputs
deterministic; the KV cache is small, so blocks move.

Every function that builds an engine must run under
``if __name__ == "__main__":`` (vLLM spawns its engine core).
"""

import hashlib
import json
import os
import signal
import socket
import subprocess
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "tiny-llama")
BLOCK = 32


def _kill_children():
    """Kills every process this one started (vLLM's engine core outlives a
    parent that exits without shutting it down)."""
    import psutil

    for c in psutil.Process().children(recursive=True):
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass


def _die(code):
    _kill_children()
    os._exit(code)


def bounded(seconds):
    """Kill this process and its engine if it runs past `seconds`, or when
    it is told to stop (SIGTERM, SIGHUP: a closed terminal)."""
    signal.signal(signal.SIGALRM, lambda *_: _die(124))
    signal.signal(signal.SIGTERM, lambda *_: _die(143))
    signal.signal(signal.SIGHUP, lambda *_: _die(129))
    signal.alarm(int(seconds))


def kill_group(p):
    """Kills what is left of the process group of `p` (started by
    `spawn`): the scenario and its engine core, even if the scenario
    itself was SIGKILLed."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def free_port():
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listens(port, secs=10):
    """Whether something accepts connections on loopback `port` within
    `secs`."""
    t = time.time()
    while time.time() - t < secs:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def keep_off_worker_cpus():
    """Binds every thread of this process and of the processes it started,
    except vLLM's workers, to the CPUs the workers are not bound to. Returns
    (the workers' CPUs, the others'), or None when there is nothing to do.

    Why: `VLLM_CPU_NUM_OF_RESERVED_CPU` binds the worker's OpenMP threads
    to the CPUs it does not reserve, but nothing keeps the engine core and
    the front end off them. On a 2-core machine the scheduler sometimes
    moves the engine core, which busy-waits for the worker, onto the
    worker's core and leaves it there for the whole run: every round is
    then 30-60% slower, with either connector (seen with `ps`-style
    sampling of where each thread ran: the engine core on CPU 0 beside
    the worker in every slow trial, and in none of the fast ones).
    """
    import psutil

    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    workers = [p for p in procs if p.name().startswith("VLLM::Worker")]
    if not workers:
        return None
    busy = set().union(*(os.sched_getaffinity(p.pid) for p in workers))
    rest = set(range(os.cpu_count() or 1)) - busy
    if not rest:
        return None
    for p in procs:
        if p in workers:
            continue
        try:
            threads = p.threads()
        except psutil.Error:
            continue
        for t in threads:
            try:
                os.sched_setaffinity(t.id, rest)
            except OSError:
                pass  # a thread that has just ended
    return sorted(busy), sorted(rest)


def thread_cpu():
    """Every thread of this process and of the processes it started:
    {(process name, pid, thread name, tid): (CPU seconds, voluntary
    context switches, involuntary ones, scheduling policy: 0 normal, 3
    batch)}, from /proc. Two of these, before
    and after a stretch of work, say which threads spent the CPU and how
    often each woke (`cpu_by_thread`)."""
    import psutil

    tick = os.sysconf("SC_CLK_TCK")
    me = psutil.Process()
    out = {}
    for p in [me] + me.children(recursive=True):
        try:
            pname = p.name()
        except psutil.Error:
            continue
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except OSError:
            continue
        for tid in tids:
            base = f"/proc/{p.pid}/task/{tid}"
            try:
                with open(base + "/stat") as f:
                    stat = f.read()
                with open(base + "/status") as f:
                    status = f.read()
            except OSError:
                continue  # a thread that has just ended
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick
            ctx = dict(
                line.split(":\t") for line in status.splitlines() if line.endswith(tuple("0123456789"))
                and "ctxt_switches" in line
            )
            out[(pname, p.pid, name, int(tid))] = (
                cpu,
                int(ctx.get("voluntary_ctxt_switches", 0)),
                int(ctx.get("nonvoluntary_ctxt_switches", 0)),
                int(fields[38]),  # policy (the stat file's 41st field)
            )
    return out


def cpu_by_thread(before, after):
    """What each thread spent between two `thread_cpu()` snapshots, grouped
    by process and thread name (a tokio runtime's or OpenMP's threads share
    one): [[process, thread, threads, CPU s, wake-ups, preemptions, their
    scheduling policy (the lowest number among them)], ...], the busiest
    first. A thread born
    in between counts from zero."""
    groups = {}
    for key, (cpu, vol, inv, policy) in after.items():
        c0, v0, i0, _ = before.get(key, (0.0, 0, 0, policy))
        g = groups.setdefault((key[0], key[2]), [0, 0.0, 0, 0, policy])
        g[0] += 1
        g[1] += cpu - c0
        g[2] += vol - v0
        g[3] += inv - i0
        g[4] = min(g[4], policy)
    rows = [[p, t, n, round(c, 3), v, i, pol] for (p, t), (n, c, v, i, pol) in groups.items()]
    return sorted(rows, key=lambda r: -r[3])


def spawn(argv, **kw):
    """Starts `argv` in a process group of its own, for `kill_group`."""
    return subprocess.Popen(argv, start_new_session=True, **kw)


def run_isolated(argv, timeout, **kw):
    """Like `subprocess.run(argv, capture_output=True, text=True,
    timeout=timeout)`, but in a process group of its own that is killed
    however the run ends, so no engine core is left behind; a timeout
    comes back as return code -9 with what was printed until then."""
    p = spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(p)
        out, err = p.communicate()
        err = (err or "") + f"\n[killed after {timeout} s]"
    finally:
        kill_group(p)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def make_oracle_model(path):
    """Saves the tiny Llama with real random weights of a large spread
    (`initializer_range=0.25`, seeded) as safetensors in `path` (about
    1 MB), unless it is there. vLLM's `load_format="dummy"` draws weights of
    about ±1e-3, with which attention is nearly uniform and outputs hardly
    depend on the KV cache: a corrupted load changes no token and no
    logprob. With these weights it does."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with open(os.path.join(MODEL, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("architectures", None)
    cfg.pop("model_type", None)
    cfg.pop("torch_dtype", None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(initializer_range=0.25, **cfg)).to(torch.bfloat16)
    tmp = path + ".partial"
    model.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, "config.json")) as f:
        saved = json.load(f)
    saved["torch_dtype"] = "bfloat16"
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(saved, f)
    os.replace(tmp, path)
    return path


def allow_async_scheduling_on_cpu():
    """vLLM's CPU platform turns async scheduling off
    (`CpuPlatform.check_and_update_config`); on GPUs it is vLLM's default.
    This keeps an explicit `async_scheduling=True` through that override,
    so the CPU model runner runs with two batches in flight. Must run in
    every process that builds vLLM's config (the scenario module calls it
    at import, which vLLM's spawned processes repeat)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, "_kvbm_keeps_async", False):
        return

    def check_and_update_config(cls, vllm_config):
        wanted = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        if wanted:
            vllm_config.scheduler_config.async_scheduling = True

    check_and_update_config._kvbm_keeps_async = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def engine(extra=None, connector=True, kv_bytes=2 * 1024 * 1024, max_num_seqs=8,
           connector_class=("KvbmConnector", "kvbm.vllm"), model=None, beside=None, **more):
    """The tiny engine; `connector_class` is (class, module) of the
    connector, kvbm's unless a test names a subclass of it. `model`: a
    directory with weights (`make_oracle_model`); without it, vLLM's dummy
    weights. `beside`: other connectors' configurations (vLLM's
    `KVTransferConfig` fields); kvbm then runs after them in vLLM's
    `MultiConnector`, which takes each request's hit from the first that
    has one. `more`: other `LLM` arguments."""
    from vllm import LLM

    kw = dict(
        model=model or MODEL,
        load_format="auto" if model else "dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=max_num_seqs,
        block_size=BLOCK,
        kv_cache_memory_bytes=kv_bytes,
        dtype="bfloat16",
        seed=0,
    )
    kw.update(more)
    if connector:
        kw["kv_transfer_config"] = {
            "kv_connector": connector_class[0],
            "kv_connector_module_path": connector_class[1],
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra or {},
        }
    if connector and beside:
        kw["kv_transfer_config"] = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            # vLLM reads the policy here, not from its connectors' own
            # configurations (kvbm's class sets it on its own copy only).
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": list(beside) + [kw["kv_transfer_config"]]},
        }
    return LLM(**kw)


def noop_engine(kv_bytes=2 * 1024 * 1024, max_num_seqs=8, **more):
    """The same engine with a connector that does nothing (the benchmark's
    baseline: vLLM's connector plumbing without kvbm); `more`: other `LLM`
    arguments."""
    from vllm import LLM

    return LLM(
        **more,
        model=MODEL,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=max_num_seqs,
        block_size=BLOCK,
        kv_cache_memory_bytes=kv_bytes,
        dtype="bfloat16",
        seed=0,
        kv_transfer_config={
            "kv_connector": "NoopConnector",
            "kv_connector_module_path": "noop",
            "kv_role": "kv_both",
        },
    )


def prompts(groups=3, per_group=4, prefix_blocks=3, tail=(5, 40), salt=0):
    """Requests sharing a prefix of `prefix_blocks` blocks within each group.
    Another `salt` (up to 989) gives prompts of the same shape whose blocks
    are all different."""
    from vllm.inputs import TokensPrompt

    out = []
    for g in range(groups):
        prefix = [(97 * g + 13 * j + 131 * salt) % 990 + 5 for j in range(prefix_blocks * BLOCK)]
        for k in range(per_group):
            n = tail[0] + (k * 11) % (tail[1] - tail[0])
            out.append(TokensPrompt(prompt_token_ids=prefix + [(7 * g + 3 * k + j) % 990 + 5 for j in range(n)]))
    return out


def generate(llm, ps, max_tokens=8):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(ps, sp, use_tqdm=False)
    settle(llm)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def generate_logprobs(llm, ps, max_tokens=8, schedules=None):
    """Greedy outputs with each generated token's logprob, as the exact
    bits of the float (hex), and each request's cached prefix length.
    With `schedules` (a `Schedules` of this engine), also each request's
    batches (`Schedules.histories`)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    if schedules is not None:
        schedules.steps.clear()
    outs = llm.generate(ps, sp, use_tqdm=False)
    settle(llm)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [float(step[t].logprob).hex() for t, step in zip(c.token_ids, c.logprobs)]
        res.append({"tokens": list(c.token_ids), "logprobs": lps, "cached": o.num_cached_tokens})
    if schedules is not None:
        for r, h in zip(res, schedules.histories([o.request_id for o in outs])):
            r.update(h)
    return res


class Schedules:
    """Every step's batch as vLLM's scheduler made it: for each request in
    it, in the batch's order, the tokens it had computed and the tokens
    scheduled now. Only where the engine core runs in this process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); `capture` gives None elsewhere.

    Why: on the CPU a logprob's last bits depend on the batch it was
    computed in, and under preemption kvbm's timing can change vLLM's
    batches. Its stores ship with the first step they reach in time, so a
    finished request's blocks may be held a step longer (the delayed free)
    and a store whose blocks vLLM preempted first fails. Observed: the
    oracle's first pass, the same prompts each run, took 134 steps in some
    runs and 135 in others, with two or three preemptions; in one run of
    forty, the reference and kvbm's pass batched 17 of 24 requests
    otherwise (all 24 still bit-equal). A request two passes batched
    otherwise may differ in a logprob's last bits with its KV right, so
    the oracle excuses a difference there, and only there."""

    def __init__(self, scheduler):
        self.steps = []
        inner = scheduler.schedule

        def schedule(*a, **k):
            out = inner(*a, **k)
            step = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
            c = out.scheduled_cached_reqs
            step += list(zip(c.req_ids, c.num_computed_tokens))
            if step:
                self.steps.append([(rid, done, out.num_scheduled_tokens[rid]) for rid, done in step])
            return out

        scheduler.schedule = schedule

    @classmethod
    def capture(cls, llm):
        core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
        return cls(core.scheduler) if core is not None else None

    def histories(self, rids):
        """For each of `rids` (the pass's requests, in order): `schedule`, a
        digest of every batch it was in (each request named by its place
        in the pass, so passes compare), and `preempted`, how often its
        computed tokens went back (vLLM preempted it and computes it
        again)."""
        place = {rid: i for i, rid in enumerate(rids)}
        mine = [[] for _ in rids]
        preempted = [0] * len(rids)
        last = [0] * len(rids)
        for step in self.steps:
            # The engine core's ids are the front end's with a suffix.
            shape = [(place.get(r, place.get(r.rsplit("-", 1)[0], -1)), d, n) for r, d, n in step]
            for at, (i, done, n) in enumerate(shape):
                if i < 0:
                    continue
                preempted[i] += done < last[i]
                last[i] = done + n
                mine[i].append([at, shape])
        return [{"schedule": hashlib.sha256(json.dumps(m).encode()).hexdigest()[:16], "preempted": p, "steps": len(m)}
                for m, p in zip(mine, preempted)]


def settle(llm, timeout_s=30):
    """Steps an engine core that runs in this process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) until its scheduler has nothing
    left, as vLLM's own engine-core process does in its busy loop.

    `LLM.generate` steps only while a request is unfinished. A request
    whose stores were still in flight at its last step has its blocks
    freed later (the connector's delayed free), at a step that, in
    process, never comes: the blocks stay held until the next `generate`,
    and `reset_prefix_cache` refuses while they are. An engine core in
    its own process is a no-op here."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if core is None:
        return
    end = time.time() + timeout_s
    while core.scheduler.has_requests() and time.time() < end:
        llm.llm_engine.step()


def say(**kv):
    """One JSON line on stdout, for the test driver."""
    print("RESULT " + json.dumps(kv), flush=True)


def elapsed(t0):
    return round(time.time() - t0, 2)


def close(llm):
    """Shuts the engine down the way vLLM does on exit (the engine core
    gets SIGTERM and runs its shutdown, the connector's included), and
    waits for it."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    # How the engine core ended (-9: vLLM killed it), where this vLLM
    # keeps its processes.
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    procs = getattr(manager, "processes", [])
    for p in procs:
        p.join(timeout=10)  # a SIGKILL just sent is not yet reaped
    return [p.exitcode for p in procs]
