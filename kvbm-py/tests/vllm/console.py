"""The console on a real engine, in a real terminal (tmux): vLLM with kvbm's
connector serving the attach protocol, `kvbm-console attach` to it. The
slots view must show vLLM's requests moving through their states, and the
transfers view G1→G2 and G2→G1 traffic.

    python console.py --console PATH/TO/kvbm-console
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import engine  # noqa: E402 (this directory; no vLLM import at load)

HERE = os.path.dirname(os.path.abspath(__file__))


def tmux(*args, check=True):
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=check)


def capture(session):
    return tmux("capture-pane", "-p", "-t", session).stdout


def diagnose(err_path):
    """What a failure needs beside the screen: the console's stderr, the
    processes and the load (a blank pane says nothing of why)."""
    try:
        with open(err_path, encoding="utf-8", errors="replace") as f:
            err = f.read()[-4000:]
    except OSError as e:
        err = f"(unreadable: {e})"
    print(f"-- the console's stderr:\n{err or '(empty)'}")
    ps = subprocess.run(["ps", "-eo", "pid,stat,etime,pcpu,rss,args", "--sort=-pcpu"],
                        capture_output=True, text=True, check=False).stdout
    print("-- processes (busiest first):\n" + "\n".join(line[:200] for line in ps.splitlines()[:15]))
    with open("/proc/loadavg", encoding="utf-8") as f:
        print(f"-- load: {f.read().strip()}", flush=True)


def wait_for(session, pred, what, timeout=60, err_path=None):
    t0 = time.time()
    screen = ""
    while time.time() - t0 < timeout:
        screen = capture(session)
        if pred(screen):
            return screen
        time.sleep(0.5)
    print(screen)
    if err_path:
        diagnose(err_path)
    raise SystemExit(f"FAIL: {what} (not seen within {timeout} s)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--console", required=True)
    a = ap.parse_args()
    if shutil.which("tmux") is None:
        raise SystemExit("FAIL: tmux is not installed (apt-get install tmux)")
    port = engine.free_port()
    tmp = tempfile.mkdtemp(prefix="kvbm-console-vllm-")
    session = f"kvbm-vllm-{os.getpid()}"
    args = {"port": port, "seconds": 150, "max_tokens": 48}
    eng = engine.spawn(
        [sys.executable, os.path.join(HERE, "scenario.py"), "serve_workload", json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=HERE,
        env=dict(os.environ, KVBM_SCENARIO_TIMEOUT_S="240"),
    )
    try:
        t0 = time.time()
        for line in eng.stdout:
            if line.startswith("RESULT ") and "serving" in line:
                break
            if time.time() - t0 > 180:
                raise SystemExit("FAIL: the engine did not come up")
        print(f"ok: vLLM with kvbm serving on 127.0.0.1:{port} after {time.time() - t0:.0f} s", flush=True)
        err_path = os.path.join(tmp, "console.err")
        tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "48",
             f"{a.console} attach http://127.0.0.1:{port} 2>{err_path}; sleep 30")
        # vLLM's request ids are `<n>-<8 hex>`; states are the slot states.
        req = re.compile(r"\b\d+-[0-9a-f]{8}\b")
        states = ("Prefilling", "Decoding", "Finished", "Initialized", "Onboarding", "OnboardStaged")
        first = wait_for(session, lambda s: "ATTACHED" in s and req.search(s) and any(x in s for x in states),
                         "requests with slot states on the slots view", err_path=err_path)
        print("ok: the slots view lists vLLM's requests with their states", flush=True)
        seen_states = {x for x in states if x in first}
        ids_first = set(req.findall(first))
        t1 = time.time()
        moved = False
        while time.time() - t1 < 60 and not moved:
            time.sleep(1)
            s = capture(session)
            seen_states |= {x for x in states if x in s}
            moved = set(req.findall(s)) != ids_first and len(seen_states) >= 2
        check = moved and {"Decoding", "Finished"} & seen_states
        if not check:
            print(capture(session))
            diagnose(err_path)
            raise SystemExit(f"FAIL: requests did not move through states (seen {sorted(seen_states)})")
        print(f"ok: requests move through their states (seen {sorted(seen_states)})", flush=True)
        tmux("send-keys", "-t", session, "2")

        def transfers(s):
            return "G1→G2" in s and "G2→G1" in s and re.search(r"G2→G1\s+\d+\s+[1-9]\d*", s) is not None

        wait_for(session, transfers, "G1→G2 and G2→G1 traffic on the transfers view", timeout=90,
                 err_path=err_path)
        print("ok: the transfers view shows G1→G2 and G2→G1 traffic", flush=True)
        tmux("send-keys", "-t", session, "q")
        print("all console checks passed", flush=True)
    finally:
        tmux("kill-session", "-t", session, check=False)
        engine.kill_group(eng)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
