#!/usr/bin/env python3
"""What the connector's calls cost a step with the CPU's caches warm, and
with them cold as a forward pass leaves them, without vLLM.

    python bench/step-cost.py [--steps 2000] [--requests 24] [--thrash-mib 64]

Needs kvbm's module (`pip install ./kvbm-py`, optimised: a debug build
times nothing useful) and nothing else: no vLLM, no model. It drives the
scheduler side (`kvbm._kvbm.Scheduler`) and the worker side
(`kvbm._kvbm.Worker`, on host memory) with the calls kvbm's connector class
makes, in the shape a decode-heavy vLLM step has them: `--requests`
running requests, each with a 3-block prompt and 32 decoded tokens, one
new token a step, a new request when one finishes.

Each configuration runs twice, each run with its own scheduler and worker:
- **warm**: the calls back to back, as a loop over them would run;
- **cold**: between two steps, a copy over `--thrash-mib` of memory (a
  forward pass reads its weights and writes its activations) evicts what
  the calls touched from the caches and the TLB.

It prints, per call and for the step, the median and the 90th percentile
in µs, warm and cold, the ratio of cold to warm, and beside them a
do-nothing Python method taking the same arguments, timed in the cold
run's steps (the floor any connector pays); then kvbm's own clock of its
Rust side, phase by phase, in each run. A large cold/warm ratio says the per-step cost is memory
the calls touch, not instructions they run: a leaner per-step path is one
that touches less.
"""

import argparse
import ctypes
import json
import statistics
import sys
import time

from kvbm import _kvbm

BLOCK = 16
LAYERS = 2
PAGE = 4096
G1_BLOCKS = 2048
PROMPT_BLOCKS = 3
DECODE = 32


class Noop:
    """The do-nothing connector's calls, with the same arguments."""

    def build_meta(self, scheduled, preempted, g1_free):
        return b""

    def run(self, plan):
        return None, [], []

    def update_connector_output(self, reports):
        return None


class Engine:
    """A decode-heavy engine's requests, block tables and token lists."""

    def __init__(self, requests):
        self.free = list(range(1, G1_BLOCKS))
        self.next_id = 0
        self.running = {}
        self.n = requests

    def admit(self, sched):
        while len(self.running) < self.n:
            rid = f"req-{self.next_id}"
            base = (self.next_id % 7) * 1000 + self.next_id * 100_000
            self.next_id += 1
            prompt = list(range(base, base + PROMPT_BLOCKS * BLOCK))
            if sched is not None:
                sched.get_num_new_matched_tokens(rid, prompt, 0)
            blocks = [self.free.pop() for _ in range(PROMPT_BLOCKS + 1)]
            if sched is not None:
                sched.update_state_after_alloc(rid, blocks, 0)
            # [tokens, computed, blocks, new (never sent), fresh]
            self.running[rid] = [prompt, 0, blocks, True]

    def scheduled(self):
        out = []
        for rid, r in self.running.items():
            toks, computed, blocks, fresh = r
            if fresh:
                out.append((rid, list(toks), len(toks), 0, len(toks), list(blocks)))
                r[1] = len(toks)
                r[3] = False
            else:
                toks.append(toks[-1] + 1)
                table = None
                if len(toks) > len(blocks) * BLOCK:
                    blocks.append(self.free.pop())
                    table = list(blocks)
                out.append((rid, [toks[-1]], PROMPT_BLOCKS * BLOCK, computed, 1, table))
                r[1] = len(toks) - 1
        return out

    def finish(self, sched):
        done = [rid for rid, r in self.running.items() if len(r[0]) >= PROMPT_BLOCKS * BLOCK + DECODE]
        for rid in done:
            blocks = self.running.pop(rid)[2]
            if sched is not None:
                sched.request_finished(rid, blocks)
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
    cfg = json.dumps(config)
    sched = _kvbm.Scheduler(cfg, geometry, "step-cost")
    worker = _kvbm.Worker(cfg, geometry, "step-cost", tensors, 0, 1)
    noop = Noop()
    buf = bytearray(args.thrash_mib << 20)
    # Not zeros: pages never written would all be the kernel's one zero page.
    src = b"\x01" * len(buf)
    times = {(who, call): [] for who in ("kvbm", "noop")
             for call in ("build_meta", "run", "update_connector_output", "step")}
    engines = {"kvbm": Engine(args.requests), "noop": Engine(args.requests)}
    clock = time.perf_counter_ns
    for i in range(args.steps):
        for who in ("kvbm", "noop"):
            s, w = (sched, worker) if who == "kvbm" else (noop, noop)
            eng = engines[who]
            eng.admit(s if who == "kvbm" else None)
            scheduled = eng.scheduled()
            if mode == "cold":
                thrash(buf, src)
            t0 = clock()
            plan = s.build_meta(scheduled, [], len(eng.free))
            t1 = clock()
            report, _sending, _errors = w.run(plan)
            t2 = clock()
            s.update_connector_output([report] if report else [])
            t3 = clock()
            eng.finish(s if who == "kvbm" else None)
            if i >= args.warmup:
                for call, dt in (("build_meta", t1 - t0), ("run", t2 - t1),
                                 ("update_connector_output", t3 - t2), ("step", t3 - t0)):
                    times[(who, call)].append(dt / 1000)
    counters = json.loads(sched.counters() or "{}")
    sched.shutdown()
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
                    help="observer (no tier), tiers (a host tier)")
    args = ap.parse_args()
    if _kvbm.DEBUG_BUILD:
        sys.exit("kvbm's module is a debug build: `pip install ./kvbm-py` (optimised) first")
    configs = {"observer": {"host_capacity_tokens": 0},
               "tiers": {"host_capacity_tokens": 16384}}
    print(f"{args.requests} requests decoding, {args.steps} steps ({args.warmup} not timed), "
          f"cold = {args.thrash_mib} MiB walked between steps; µs: median / p90")
    calls = ("build_meta", "run", "update_connector_output", "step")
    for name in args.configs.split(","):
        runs = {mode: run(args, configs[name], mode) for mode in ("warm", "cold")}
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

if __name__ == "__main__":
    main()
