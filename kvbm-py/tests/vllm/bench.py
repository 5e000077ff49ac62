"""The connector's cost on a real vLLM (CPU backend, tiny model): the same
workload with kvbm's connector (recording on) and with a connector that
does nothing, alternated, in one run; the connector's own time per
scheduler step; and the offload throughput its worker reached, from the
recording, beside a plain copy of the same pages measured here.

    python bench.py --recorder PATH/TO/kvbm-recorder [--trials 3] [--rounds 6]
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import engine  # noqa: E402 (this directory; no vLLM import at load)

HERE = os.path.dirname(os.path.abspath(__file__))


def run(kind, rounds, tmp, trial):
    args = {"connector": kind, "rounds": rounds, "max_tokens": 32}
    env = dict(os.environ)
    stats = None
    rec = None
    if kind == "kvbm":
        rec = os.path.join(tmp, f"rec-{trial}")
        stats = os.path.join(tmp, f"stats-{trial}.json")
        args["extra"] = {"host_capacity_tokens": 16384, "shm_dir": tmp, "record": rec}
        env["KVBM_STATS_FILE"] = stats
    p = engine.run_isolated(
        [sys.executable, os.path.join(HERE, "scenario.py"), "bench", json.dumps(args)],
        600, env=env, cwd=HERE,
    )
    res = [json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not res:
        print(p.stderr[-3000:])
        raise SystemExit(f"{kind} run failed")
    return res[0]["wall_s"], stats, rec


def batch_throughput(recorder, rec):
    """Bytes and copy time of every G1→G2 batch in the recording."""
    out = subprocess.run([recorder, "export", rec, "--format", "jsonl"], capture_output=True, text=True, check=True)
    nbytes = ns = batches = 0
    for line in out.stdout.splitlines():
        k = json.loads(line)["kind"]
        if k.get("kind") == "BatchCompleted" and k["ok"] and k["direction"] == {"src": "Device", "dst": "Host"}:
            nbytes += k["bytes"]
            ns += k["elapsed_ns"]
            batches += 1
    return nbytes, ns, batches


def plain_copy_gbps(nbytes, repeat=200):
    """One plain memmove of `nbytes` (an average batch), best of `repeat`."""
    nbytes = max(int(nbytes), 1)
    src = (ctypes.c_char * nbytes)()
    dst = (ctypes.c_char * nbytes)()
    ctypes.memset(src, 7, nbytes)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter_ns()
        ctypes.memmove(dst, src, nbytes)
        best = min(best, time.perf_counter_ns() - t)
    return nbytes / best  # bytes per ns == GB/s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recorder", required=True)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvbm-bench-")
    walls = {"kvbm": [], "noop": []}
    last_stats = last_rec = None
    for t in range(a.trials):
        for kind in ("noop", "kvbm") if t % 2 == 0 else ("kvbm", "noop"):
            wall, stats, rec = run(kind, a.rounds, tmp, t)
            walls[kind].append(wall)
            print(f"trial {t} {kind}: {wall:.3f} s", flush=True)
            if stats:
                last_stats, last_rec = stats, rec
    k, n = statistics.median(walls["kvbm"]), statistics.median(walls["noop"])
    print(f"\nwall time, median of {a.trials}: kvbm (recording on) {k:.3f} s, "
          f"do-nothing connector {n:.3f} s, overhead {100 * (k - n) / n:+.1f}%")
    with open(last_stats) as f:
        st = json.load(f)
    tm = st["step_timing"]
    print(f"connector time per scheduler step: p50 {tm['p50_us']:.0f} µs, p99 {tm['p99_us']:.0f} µs, "
          f"max {tm['max_us']:.0f} µs over {tm['steps']} steps; counters {st['counters']}")
    nbytes, ns, batches = batch_throughput(a.recorder, last_rec)
    avg = nbytes / batches if batches else 0
    base = plain_copy_gbps(avg)
    got = nbytes / ns if ns else 0.0
    print(f"offload G1→G2 on the CPU backend: {got:.2f} GB/s over {batches} batches "
          f"(avg {avg / 1024:.0f} KiB, copy time on the worker); one plain memmove of "
          f"{avg / 1024:.0f} KiB: {base:.2f} GB/s; ratio {100 * got / base:.0f}%")


if __name__ == "__main__":
    main()
