"""kvbm's connector against a real vLLM (CPU backend, tiny random-weight
Llama): every scenario in a process of its own, bounded in time, checked
here. Run through `scripts/test-vllm.sh`, which prepares the environment.

    python run.py [--only NAME ...] --recorder PATH/TO/kvbm-recorder

Checks (issue "kvbm inside vLLM"):
1. correct bytes: outputs equal a run without the connector; after vLLM's
   prefix cache is reset, requests get external hits; every block loaded
   back into vLLM's tensors equals, byte for byte, the block vLLM computed
   for the same tokens; a deliberately corrupted load makes that check
   fail; the same with only a disk tier;
2. breakpoints: a held request makes no progress while the others finish,
   resumes with the same tokens; a short deadline releases a hold by itself;
3. (the console, in tmux: scripts/test-vllm.sh);
4. the recording: `kvbm-recorder check` exits 0, `stats` has TTFT and
   transfer latency; it is finished even when vLLM kills its engine core
   because a worker is slow to exit;
5. bad configuration: vLLM refuses to start, naming the key.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import engine  # noqa: E402 (this directory; no vLLM import at load)

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
FAILURES = []


def scenario(name, args, env=None, timeout=300, expect_ok=True):
    """Runs one scenario; returns (results, stderr, returncode)."""
    e = dict(os.environ)
    e.update(env or {})
    t0 = time.time()
    p = engine.run_isolated(
        [PY, os.path.join(HERE, "scenario.py"), name, json.dumps(args)],
        timeout,
        env=e,
        cwd=HERE,
    )
    results = [json.loads(l[len("RESULT "):]) for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    print(f"  [{name} {time.time() - t0:.0f}s exit {p.returncode}]", flush=True)
    if expect_ok and p.returncode != 0:
        tail = "\n".join(p.stderr.splitlines()[-30:])
        fail(f"{name} exited {p.returncode}:\n{tail}")
    return results, p.stderr, p.returncode


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    FAILURES.append(msg)


def check(cond, msg):
    if cond:
        print(f"ok: {msg}", flush=True)
    else:
        fail(msg)
    return cond


def compare_dumps(dump):
    """Blocks loaded into vLLM's tensors against the blocks vLLM computed
    for the same tokens (same sequence hash); (compared, mismatched)."""
    loaded_dir = os.path.join(dump, "loaded")
    stored_dir = os.path.join(dump, "stored")
    compared = mismatched = 0
    for name in sorted(os.listdir(loaded_dir)) if os.path.isdir(loaded_dir) else []:
        s = os.path.join(stored_dir, name)
        if not os.path.exists(s):
            continue
        compared += 1
        with open(os.path.join(loaded_dir, name), "rb") as a, open(s, "rb") as b:
            if a.read() != b.read():
                mismatched += 1
    return compared, mismatched


def test_bytes(tmp, baseline, recorder):
    print("== 1. correct bytes (host tier), 4. the recording", flush=True)
    dump = os.path.join(tmp, "dump-host")
    rec = os.path.join(tmp, "rec-host")
    extra = {"host_capacity_tokens": 8192, "shm_dir": tmp, "record": rec}
    (r, _), _, _ = scenario("roundtrip", {"extra": extra}, env={"KVBM_TEST_DUMP_DIR": dump})
    check(r["outputs1"] == baseline, "round 1 outputs equal a run without the connector")
    check(r["outputs2"] == baseline, "round 2 outputs (loaded from G2) equal a run without the connector")
    hits = sum(1 for c in r["cached2"] if c > 0)
    check(hits >= len(baseline) // 2, f"round 2 gets external hits after the reset ({r['cached2']})")
    compared, bad = compare_dumps(dump)
    check(compared > 0 and bad == 0, f"{compared} loaded blocks equal the computed ones byte for byte ({bad} differ)")
    c = subprocess.run([recorder, "check", rec], capture_output=True, text=True)
    check(c.returncode == 0, f"kvbm-recorder check on the connector's recording exits 0 ({c.stdout.strip()}{c.stderr.strip()})")
    s = subprocess.run([recorder, "stats", rec, "--json"], capture_output=True, text=True)
    stats = json.loads(s.stdout) if s.returncode == 0 else {}
    lat = stats.get("transfer_latency_ns", {})
    check(stats.get("ttft_ns", {}).get("count", 0) > 0, f"stats has TTFT ({stats.get('ttft_ns')})")
    check(any(k.startswith("G1→") for k in lat) and any(k.endswith("→G1") for k in lat),
          f"stats has transfer latency both ways ({sorted(lat)})")
    ev = subprocess.run([recorder, "export", rec, "--format", "jsonl"], capture_output=True, text=True)
    kinds = {}
    blocks = {"BatchCompleted": 0, "TransferCompleted": 0}
    for line in ev.stdout.splitlines():
        kind = json.loads(line).get("kind")
        k = kind.get("kind") if isinstance(kind, dict) else None
        if k:
            kinds[k] = kinds.get(k, 0) + 1
        if k in blocks and kind.get("ok", True):
            blocks[k] += kind["blocks"]
    check(kinds.get("TransferCompleted", 0) > 0 and kinds.get("SlotTransition", 0) > 0,
          f"the recording holds slot transitions and completed transfers ({kinds})")
    check(kinds.get("BlocksAllocated", 0) > 0 and kinds.get("BlocksReleased", 0) > 0,
          "the recording holds the requests' G1 blocks, given and released "
          f"({kinds.get('BlocksAllocated', 0)} and {kinds.get('BlocksReleased', 0)} events; "
          "check's no-leak invariant above covers their counts)")
    # The worker reports a batch's bytes and time, not its blocks: the
    # batches' block counts come from what was dispatched, and must add up
    # to the completed transfers' (the transfers view's Blocks column).
    check(blocks["BatchCompleted"] == blocks["TransferCompleted"] > 0,
          f"completed batches carry the blocks of the transfers they completed ({blocks})")

    print("== 1b. a corrupted load is caught", flush=True)
    dump2 = os.path.join(tmp, "dump-corrupt")
    extra = {"host_capacity_tokens": 8192, "shm_dir": tmp}
    scenario("roundtrip", {"extra": extra}, env={"KVBM_TEST_DUMP_DIR": dump2, "KVBM_TEST_CORRUPT_LOADS": "1"})
    compared, bad = compare_dumps(dump2)
    check(compared > 0 and bad > 0, f"with a byte flipped in each load, the check finds {bad} of {compared} blocks differ")

    print("== 1c. correct bytes with only a disk tier; the recording finishes though vLLM kills "
          "the engine core (a worker slow to exit: slow_exit.py)", flush=True)
    dump3 = os.path.join(tmp, "dump-disk")
    rec3 = os.path.join(tmp, "rec-disk")
    extra = {
        "host_capacity_tokens": 0,
        "disk_path": os.path.join(tmp, "g3.kvbm"),
        "disk_capacity_tokens": 8192,
        "shm_dir": tmp,
        "record": rec3,
    }
    (r, ended), _, _ = scenario("roundtrip", {"extra": extra, "connector": ["SlowExitConnector", "slow_exit"]},
                                env={"KVBM_TEST_DUMP_DIR": dump3})
    check(r["outputs2"] == baseline, "disk only: round 2 outputs equal a run without the connector")
    check(sum(1 for c in r["cached2"] if c > 0) >= len(baseline) // 2, f"disk only: external hits ({r['cached2']})")
    compared, bad = compare_dumps(dump3)
    check(compared > 0 and bad == 0, f"disk only: {compared} loaded blocks equal the computed ones ({bad} differ)")
    # Without kvbm finishing first, this recording ended early (check exit 3).
    check(ended.get("engine_core_exit") == [-9],
          "vLLM killed its engine core (SIGKILL), still waiting for the slow worker, 5 s after asking "
          f"it to stop (exit codes {ended.get('engine_core_exit')})")
    c = subprocess.run([recorder, "check", rec3], capture_output=True, text=True)
    check(c.returncode == 0, "the recording was finished before that: kvbm-recorder check exits 0 "
          f"({c.stdout.strip()}{c.stderr.strip()})")


def test_breakpoints(tmp, baseline):
    print("== 2. breakpoints on a real engine", flush=True)
    args = {
        "port": engine.free_port(),
        "deadline_s": 3,
        "held": "4-",
        "late": "12-",
        "extra": {"host_capacity_tokens": 8192, "shm_dir": tmp},
    }
    res, _, _ = scenario("breakpoints", args)
    by = {r["phase"]: r for r in res}
    h = by.get("held", {})
    check(h.get("held_seen") and h.get("others_done"), f"the held request is paused while the others finish ({h})")
    check(h.get("held_computed") == 0 and h.get("still_running"), "the held request made no progress meanwhile")
    check(by.get("resumed", {}).get("outputs") == baseline, "resumed, every request has the tokens it would have had")
    d = by.get("deadline", {})
    check(d.get("outputs") == baseline[:2] and 2.5 <= d.get("took_s", 0) < 30,
          f"a hold nobody resumes ends at its deadline ({d.get('took_s')} s for a 3 s deadline)")
    e = by.get("engine", {})
    check(e.get("paused") and e.get("blocked") and e.get("events_while_paused", 99) <= 2,
          f"a breakpoint on build_connector_metadata stops the whole engine ({e.get('events_while_paused')} events in 1.5 s)")
    check(e.get("outputs") == baseline[:4], "cleared, the engine goes on and the tokens are the same")


def test_bad_config(tmp):
    print("== 5. bad configuration", flush=True)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    ro = os.path.join(tmp, "read-only")
    os.makedirs(ro, exist_ok=True)
    os.chmod(ro, 0o500)
    cases = [
        ({"host_capacty_tokens": 4096}, "host_capacty_tokens"),
        ({"disk_path": os.path.join(ro, "sub", "g3.kvbm"), "disk_capacity_tokens": 4096, "host_capacity_tokens": 0, "shm_dir": tmp}, "disk"),
        ({"host_capacity_tokens": 0}, "host_capacity_tokens"),
        ({"serve": f"127.0.0.1:{port}", "host_capacity_tokens": 4096, "shm_dir": tmp}, "serve"),
    ]
    for extra, key in cases:
        res, err, code = scenario("badconfig", {"extra": extra}, expect_ok=False, timeout=240)
        lines = [l for l in err.splitlines() if "kvbm" in l and (key in l)]
        check(code != 0 and not res, f"vLLM refuses to start with {json.dumps(extra)}")
        check(bool(lines), f"... and says why, naming `{key}`: {lines[-1].strip()[-200:] if lines else err.splitlines()[-3:]}")
    busy.close()
    os.chmod(ro, 0o700)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recorder", required=True)
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    only = set(a.only or ["bytes", "breakpoints", "badconfig"])
    tmp = tempfile.mkdtemp(prefix="kvbm-vllm-")
    try:
        print("== baseline: no connector", flush=True)
        (b,), _, _ = scenario("baseline", {})
        baseline = b["outputs"]
        if "bytes" in only:
            test_bytes(tmp, baseline, a.recorder)
        if "breakpoints" in only:
            test_breakpoints(tmp, baseline)
        if "badconfig" in only:
            test_bad_config(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if FAILURES:
        print(f"\n{len(FAILURES)} check(s) failed", flush=True)
        sys.exit(1)
    print("\nall real-engine checks passed", flush=True)


if __name__ == "__main__":
    main()
