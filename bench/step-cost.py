#!/usr/bin/env python3
"""What the connector's calls cost a step with the CPU's caches warm, and
with them cold as a forward pass leaves them, without running a model.

    python bench/step-cost.py [--steps 2000] [--requests 24] [--thrash-mib 64]

Needs kvbm's module (`pip install ./kvbm-py`, optimised: a debug build
times nothing useful) and vLLM's Python package (for the connector base
class and its block-state object); no model runs. It drives the scheduler
side of kvbm's connector class (`kvbm.vllm.KvbmConnector`, its Python
included) and the worker side's plan runner (`kvbm._kvbm.Worker`, on host
memory) with vLLM-shaped objects, as a decode-heavy vLLM step has them:
`--requests` running requests, each with a 3-block prompt and 32 decoded
tokens, one new token a step, a new request when one finishes. Beside it,
the benchmark's do-nothing connector class gets the same objects.

Each configuration runs twice, each run with its own connector and worker:
- **warm**: the calls back to back, as a loop over them would run;
- **cold**: between two steps, a copy over `--thrash-mib` of memory (a
  forward pass reads its weights and writes its activations) evicts what
  the calls touched from the caches and the TLB; then, as vLLM does, the
  engine appends the sampled tokens and builds the step's scheduler
  output, so those are fresh and what the connector keeps is not.

It prints, per call and for the step, the median and the 90th percentile
in µs, warm and cold, the ratio of cold to warm, and the do-nothing
connector's, timed in the cold run's steps (the floor any connector pays);
then kvbm's own clock of its Rust side, phase by phase, in each run. A
large cold/warm ratio says the per-step cost is memory the calls touch,
not instructions they run: a leaner per-step path is one that touches
less.
"""

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kvbm-py", "tests", "vllm"))

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import KVConnectorBlockState  # noqa: E402

from kvbm import _kvbm  # noqa: E402
from kvbm.vllm import KvbmConnector, KvbmWorkerMetadata  # noqa: E402
from noop import NoopConnector  # noqa: E402

BLOCK = 16
LAYERS = 2
PAGE = 4096
G1_BLOCKS = 2048
PROMPT_BLOCKS = 3
DECODE = 32


def vllm_config(extra):
    """The parts of vLLM's config a connector reads."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            engine_id="step-cost", kv_connector_extra_config=extra, kv_load_failure_policy="recompute"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        data_parallel_size=1, data_parallel_rank=0),
        scheduler_config=SimpleNamespace(async_scheduling=False),
    )


def kv_cache_config():
    spec = SimpleNamespace(block_size=BLOCK, page_size_bytes=PAGE)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=[f"layer.{i}" for i in range(LAYERS)])
    return SimpleNamespace(num_blocks=G1_BLOCKS, kv_cache_groups=[group])


class Blocks:
    """vLLM's `KVCacheBlocks`, as `update_state_after_alloc` reads it."""

    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


class Engine:
    """A decode-heavy engine's requests, block tables and token lists, and
    the scheduler outputs vLLM would make of them."""

    def __init__(self, requests):
        self.free = list(range(1, G1_BLOCKS))
        self.next_id = 0
        self.running = {}  # id -> [request, computed, blocks, fresh]
        self.n = requests

    def admit(self, conn):
        while len(self.running) < self.n:
            rid = f"req-{self.next_id}"
            base = (self.next_id % 7) * 1000 + self.next_id * 100_000
            self.next_id += 1
            prompt = list(range(base, base + PROMPT_BLOCKS * BLOCK))
            toks = list(prompt)
            req = SimpleNamespace(request_id=rid, prompt_token_ids=prompt, _all_token_ids=toks,
                                  all_token_ids=toks, num_prompt_tokens=len(prompt))
            conn.get_num_new_matched_tokens(req, 0)
            blocks = [self.free.pop() for _ in range(PROMPT_BLOCKS + 1)]
            conn.update_state_after_alloc(req, Blocks(blocks), 0)
            self.running[rid] = [req, 0, blocks, True]

    def step(self):
        """This step's `SchedulerOutput`: new requests prefill their prompt,
        the others decode one token (a block added as one fills)."""
        new, ids, added, computed, n_sched = [], [], [], [], {}
        for rid, r in self.running.items():
            req, done, blocks, fresh = r
            toks = req._all_token_ids
            if fresh:
                new.append(SimpleNamespace(req_id=rid, prompt_token_ids=req.prompt_token_ids,
                                           num_computed_tokens=0, block_ids=(list(blocks),)))
                n_sched[rid] = len(toks)
                r[1] = len(toks)
                r[3] = False
                continue
            # The token the last step sampled, appended as vLLM's engine does.
            toks.append(toks[-1] + 1)
            more = None
            if len(toks) > len(blocks) * BLOCK:
                blocks.append(self.free.pop())
                more = ([blocks[-1]],)
            ids.append(rid)
            added.append(more)
            computed.append(len(toks) - 1)
            n_sched[rid] = 1
            r[1] = len(toks) - 1
        tables = {rid: r[2] for rid, r in self.running.items()}
        return SimpleNamespace(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(req_ids=ids, resumed_req_ids=set(),
                                                  new_block_ids=added, num_computed_tokens=computed),
            num_scheduled_tokens=n_sched,
            preempted_req_ids=set(),
            kv_connector_block_state=KVConnectorBlockState(
                req_ids=set(n_sched), resolve_block_ids=lambda rid: (tables[rid],),
                boundary_state_offloads={}),
        )

    def finish(self, conn):
        done = [rid for rid, r in self.running.items()
                if len(r[0]._all_token_ids) >= PROMPT_BLOCKS * BLOCK + DECODE]
        for rid in done:
            req, _, blocks, _ = self.running.pop(rid)
            conn.request_finished(req, blocks)
            self.free.extend(blocks)


def thrash(buf, src):
    """Copies `src` over `buf`: reads the one and writes the other, every
    cache line (a slice assignment walks the memory in C)."""
    buf[:] = src


def run(args, config, mode):
    geometry = (G1_BLOCKS, BLOCK, LAYERS, PAGE)
    layers = [ctypes.create_string_buffer(G1_BLOCKS * PAGE) for _ in range(LAYERS)]
    tensors = json.dumps(
        [
            {
                "name": f"layer.{i}",
                "data_ptr": ctypes.addressof(b),
                "nbytes": G1_BLOCKS * PAGE,
                "num_blocks": G1_BLOCKS,
                "block_stride_bytes": PAGE,
                "contiguous": True,
                "device": "cpu",
            }
            for i, b in enumerate(layers)
        ]
    )
    conn = KvbmConnector(vllm_config(config), KVConnectorRole.SCHEDULER, kv_cache_config())
    worker = _kvbm.Worker(conn._config_json, conn._geometry, conn._engine_id, tensors, 0, 1)  # noqa: SLF001
    noop = NoopConnector(vllm_config({}), KVConnectorRole.SCHEDULER, kv_cache_config())
    buf = bytearray(args.thrash_mib << 20)
    # Not zeros: pages never written would all be the kernel's one zero page.
    src = b"\x01" * len(buf)
    times = {(who, call): [] for who in ("kvbm", "noop")
             for call in ("build_connector_meta", "worker run", "update_connector_output", "step")}
    engines = {"kvbm": Engine(args.requests), "noop": Engine(args.requests)}
    clock = time.perf_counter_ns
    for i in range(args.steps):
        for who, c in (("kvbm", conn), ("noop", noop)):
            eng = engines[who]
            # As in vLLM: the forward pass (the thrash), then the engine
            # appends the sampled tokens and schedules the next step, so
            # vLLM's own objects are fresh when the connector is called
            # and only what the connector keeps between steps is cold.
            if mode == "cold":
                thrash(buf, src)
            eng.admit(c)
            out = eng.step()
            t0 = clock()
            md = c.build_connector_meta(out)
            t1 = clock()
            report = None
            # An idle plan is no bytes, which the class skips (as here).
            if who == "kvbm" and md.plan:
                report, _sending, _errors = worker.run(md.plan)
            t2 = clock()
            # Built by the worker and vLLM, not in the call.
            meta = KvbmWorkerMetadata(reports=[report]) if who == "kvbm" and report else None
            output = SimpleNamespace(kv_connector_worker_meta=meta)
            t3 = clock()
            c.update_connector_output(output)
            t4 = clock()
            eng.finish(c)
            if i >= args.warmup:
                for call, dt in (("build_connector_meta", t1 - t0), ("worker run", t2 - t1),
                                 ("update_connector_output", t4 - t3), ("step", t2 - t0 + t4 - t3)):
                    times[(who, call)].append(dt / 1000)
    counters = json.loads(conn._sched.counters() or "{}")  # noqa: SLF001
    conn._sched.shutdown()  # noqa: SLF001
    worker.shutdown()
    return times, counters


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--thrash-mib", type=int, default=64)
    ap.add_argument("--configs", default="observer,tiers",
                    help="observer (no tier), tiers (a host tier), recording (a host tier and the recording)")
    args = ap.parse_args()
    if _kvbm.DEBUG_BUILD:
        sys.exit("kvbm's module is a debug build: `pip install ./kvbm-py` (optimised) first")
    rec_dir = tempfile.mkdtemp(prefix="kvbm-step-cost-")
    configs = {"observer": {"host_capacity_tokens": 0},
               "tiers": {"host_capacity_tokens": 16384},
               "recording": {"host_capacity_tokens": 16384, "record": None}}
    print(f"{args.requests} requests decoding, {args.steps} steps ({args.warmup} not timed), "
          f"cold = {args.thrash_mib} MiB walked between steps; µs: median / p90")
    calls = ("build_connector_meta", "worker run", "update_connector_output", "step")
    for name in args.configs.split(","):
        # A recording per run: a recording directory is never reused.
        runs = {mode: run(args, {**configs[name], **({"record": os.path.join(rec_dir, f"{name}-{mode}")}
                                                        if "record" in configs[name] else {})}, mode)
                for mode in ("warm", "cold")}
        print(f"\n{name}: events emitted {runs['cold'][1].get('events_emitted', '?')}")
        print(f"{'call':<26}{'kvbm warm':>16}{'kvbm cold':>16}{'cold/warm':>11}{'noop cold':>16}")
        for call in calls:
            w = runs["warm"][0][("kvbm", call)]
            c = runs["cold"][0][("kvbm", call)]
            n = runs["cold"][0][("noop", call)]
            ratio = statistics.median(c) / max(statistics.median(w), 1e-9)
            print(f"{call:<26}{statistics.median(w):>8.1f} /{pct(w, .9):>6.1f}"
                  f"{statistics.median(c):>8.1f} /{pct(c, .9):>6.1f}{ratio:>10.1f}x"
                  f"{statistics.median(n):>8.1f} /{pct(n, .9):>6.1f}")
        # kvbm's own clock, phase by phase (mean a step, whole run).
        for mode in ("warm", "cold"):
            ph = runs[mode][1].get("phases_us_per_step") or {}
            if isinstance(ph, dict):
                top = sorted(ph.items(), key=lambda kv: -float(kv[1]) if isinstance(kv[1], (int, float)) else 0)
                text = ", ".join(f"{k} {v:.1f}" for k, v in top if isinstance(v, (int, float)))
                print(f"  kvbm's Rust side, {mode}, µs a step: {text}")
    shutil.rmtree(rec_dir, ignore_errors=True)

if __name__ == "__main__":
    main()
