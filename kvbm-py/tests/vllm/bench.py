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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import engine  # noqa: E402 (this directory; no vLLM import at load)

HERE = os.path.dirname(os.path.abspath(__file__))
SHM = tempfile.mkdtemp(prefix="kvbm-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def run(kind, rounds, tmp, trial):
    args = {"connector": kind, "rounds": rounds, "max_tokens": 32}
    env = dict(os.environ)
    stats = None
    rec = None
    if kind == "kvbm":
        rec = os.path.join(tmp, f"rec-{trial}")
        stats = os.path.join(tmp, f"stats-{trial}.json")
        # The host tier where kvbm puts it by default (/dev/shm), in a
        # directory of this run's own.
        args["extra"] = {"host_capacity_tokens": 16384, "shm_dir": SHM, "record": rec}
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


def plain_copy_gbps(nbytes, cold, copies=400, pool_bytes=256 << 20):
    """A plain memmove of `nbytes` (an average batch), in GB/s.

    `cold`: each copy goes to a part of a 256 MiB destination not written
    since it was faulted in, as an offload writes a host-tier block (its
    pages are faulted in ahead, not cached); otherwise to one destination
    over and over, which stays in the CPU's cache (a ceiling no offload
    meets). The source is the same warm buffer, as the worker copies
    blocks the forward pass has just computed. The Python call's own cost
    is measured with zero-byte copies and subtracted. Median of 5 rounds.
    """
    nbytes = max(int(nbytes), 1)
    src = (ctypes.c_char * nbytes)()
    ctypes.memset(src, 7, nbytes)
    span = pool_bytes if cold else nbytes
    dst = (ctypes.c_char * span)()
    ctypes.memset(dst, 0, span)  # fault every page in, as the host tier is
    base = ctypes.addressof(dst)
    slots = max(span // nbytes, 1)
    offsets = [base + (i % slots) * nbytes for i in range(copies)]
    rates = []
    for _ in range(5):
        t = time.perf_counter_ns()
        for o in offsets:
            ctypes.memmove(o, src, nbytes)
        full = time.perf_counter_ns() - t
        t = time.perf_counter_ns()
        for o in offsets:
            ctypes.memmove(o, src, 0)
        empty = time.perf_counter_ns() - t
        rates.append(nbytes * copies / max(full - empty, 1))  # bytes/ns == GB/s
        if cold:
            # Rewrite the whole pool: the next round's slots, written
            # first, leave the cache again.
            ctypes.memset(dst, 0, span)
    return statistics.median(rates)


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
    cold, hot = plain_copy_gbps(avg, cold=True), plain_copy_gbps(avg, cold=False)
    got = nbytes / ns if ns else 0.0
    print(f"offload G1→G2 on the CPU backend: {got:.2f} GB/s over {batches} batches "
          f"(avg {avg / 1024:.0f} KiB, copy time on the worker); a plain memmove of "
          f"{avg / 1024:.0f} KiB into memory not recently written: {cold:.2f} GB/s, "
          f"ratio {100 * got / cold:.0f}%; into one buffer kept in cache: {hot:.2f} GB/s, "
          f"ratio {100 * got / hot:.0f}%")


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(SHM, ignore_errors=True)
