"""The console on a real engine, in a real terminal (tmux): vLLM with kvbm's
connector serving the attach protocol (and recording), `kvbm-console
attach` to it. The header must say what kvbm runs as; the slots view must
show vLLM's requests moving through their states, and after a prefix-cache
reset, requests with G2 hits that equal the G2→G1 blocks the recording
loaded for them; the transfers view G1→G2 and G2→G1 transfers done, with
their blocks. With `--observer`, kvbm has no tier of its own: the header
must say so, and the slots view must show the requests' timelines, G1
blocks and G1 hits all the same (nothing is moved, so nothing more).

    python console.py --console PATH/TO/kvbm-console --recorder PATH/TO/kvbm-recorder [--observer]
"""

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import engine  # noqa: E402 (this directory; no vLLM import at load)

HERE = os.path.dirname(os.path.abspath(__file__))


def tmux(*args, check=True):
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=check)


def capture(session):
    return tmux("capture-pane", "-p", "-t", session).stdout


def diagnose(err_path, engine_tail=()):
    """What a failure needs beside the screen: the console's stderr, the
    engine's last lines (its rounds: how long, whether the prefix-cache
    reset took), the processes and the load (a blank pane says nothing of
    why)."""
    try:
        with open(err_path, encoding="utf-8", errors="replace") as f:
            err = f.read()[-4000:]
    except OSError as e:
        err = f"(unreadable: {e})"
    print(f"-- the console's stderr:\n{err or '(empty)'}")
    lines = [line.rstrip()[:200] for line in list(engine_tail)]
    print("-- the engine's last lines:\n" + ("\n".join(lines) or "(none)"))
    ps = subprocess.run(["ps", "-eo", "pid,stat,etime,pcpu,rss,args", "--sort=-pcpu"],
                        capture_output=True, text=True, check=False).stdout
    print("-- processes (busiest first):\n" + "\n".join(line[:200] for line in ps.splitlines()[:15]))
    with open("/proc/loadavg", encoding="utf-8") as f:
        print(f"-- load: {f.read().strip()}", flush=True)


def wait_for(session, pred, what, timeout=60, err_path=None, engine_tail=()):
    t0 = time.time()
    screen = ""
    while time.time() - t0 < timeout:
        screen = capture(session)
        if pred(screen):
            return screen
        time.sleep(0.5)
    print(screen)
    if err_path:
        diagnose(err_path, engine_tail)
    raise SystemExit(f"FAIL: {what} (not seen within {timeout} s)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--console", required=True)
    ap.add_argument("--recorder", required=True)
    ap.add_argument("--observer", action="store_true", help="kvbm with no tier of its own")
    a = ap.parse_args()
    if shutil.which("tmux") is None:
        raise SystemExit("FAIL: tmux is not installed (apt-get install tmux)")
    port = engine.free_port()
    tmp = tempfile.mkdtemp(prefix="kvbm-console-vllm-")
    session = f"kvbm-vllm-{os.getpid()}"
    # The engine serves longer than the checks below can wait in all
    # (60 + 60 + 90 s); they end it as soon as they pass.
    rec = os.path.join(tmp, "rec")
    # The host tier in the test's own directory: the engine is killed at
    # the end, which would leave its file in /dev/shm until the next start.
    args = {"port": port, "seconds": 270, "max_tokens": 48, "record": rec, "shm_dir": tmp,
            "host_capacity_tokens": 0 if a.observer else 8192}
    eng = engine.spawn(
        [sys.executable, os.path.join(HERE, "scenario.py"), "serve_workload", json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=HERE,
        env=dict(os.environ, KVBM_SCENARIO_TIMEOUT_S="480"),
    )
    try:
        t0 = time.time()
        for line in eng.stdout:
            if line.startswith("RESULT ") and "serving" in line:
                break
            if time.time() - t0 > 180:
                raise SystemExit("FAIL: the engine did not come up")
        print(f"ok: vLLM with kvbm serving on 127.0.0.1:{port} after {time.time() - t0:.0f} s", flush=True)
        # Keep reading what the engine prints (vLLM logs to stdout): a pipe
        # nobody drains fills and stops the engine mid-write. The last lines
        # and the rounds it reports go into a failure's diagnosis.
        engine_tail = collections.deque(maxlen=40)
        threading.Thread(target=engine_tail.extend, args=(eng.stdout,), daemon=True).start()
        err_path = os.path.join(tmp, "console.err")
        tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "48",
             f"{a.console} attach http://127.0.0.1:{port} 2>{err_path}; sleep 30")
        # vLLM's request ids are `<n>-<8 hex>`; states are the slot states.
        req = re.compile(r"\b\d+-[0-9a-f]{8}\b")
        states = ("Prefilling", "Decoding", "Finished", "Initialized", "Onboarding", "OnboardStaged")
        first = wait_for(session, lambda s: "ATTACHED" in s and req.search(s) and any(x in s for x in states),
                         "requests with slot states on the slots view", err_path=err_path, engine_tail=engine_tail)
        print("ok: the slots view lists vLLM's requests with their states", flush=True)
        header = next((l.strip() for l in first.splitlines() if "runs as" in l), "")
        if not ("vLLM" in header and "1 worker" in header and "sync scheduling" in header
                and ("observer" in header) == a.observer):
            print(first)
            raise SystemExit(f"FAIL: the header does not say what kvbm runs as (ranks, scheduling): {header!r}")
        print(f"ok: the header says what kvbm runs as: {header[:150]}", flush=True)
        seen_states = {x for x in states if x in first}
        ids_first = set(req.findall(first))
        # A row: request, state, age, prompt, generated, G1 G2 G3 (blocks
        # held), Hit G1 (tokens found in vLLM's own prefix cache), Hit G2
        # (tokens loaded from kvbm's host tier).
        row = re.compile(r"\b(\d+-[0-9a-f]{8})\s+(\w+)\s+\S+\s+\d+\s+\d+\s+(\d+)\s+\d+\s+\d+\s+(\d+)\s+([\d,]+)")
        finished_g2 = {}

        def note_g2(s):
            """Finished requests' Hit G2 on the screen (final figures)."""
            for m in row.findall(s):
                if m[1] == "Finished":
                    finished_g2[m[0]] = int(m[4].replace(",", ""))

        def g1_held(s):
            """The most G1 blocks a running request holds on the screen."""
            return max((int(m[2]) for m in row.findall(s) if m[1] in ("Prefilling", "Decoding")), default=0)

        def g1_hit(s):
            """The most tokens a request on the screen found in G1."""
            return max((int(m[3]) for m in row.findall(s)), default=0)

        t1 = time.time()
        moved = False
        g1, hit = g1_held(first), g1_hit(first)
        while time.time() - t1 < 60 and not (moved and g1 > 0 and hit > 0):
            time.sleep(1)
            s = capture(session)
            note_g2(s)
            seen_states |= {x for x in states if x in s}
            moved = set(req.findall(s)) != ids_first and len(seen_states) >= 2
            g1, hit = max(g1, g1_held(s)), max(hit, g1_hit(s))
        check = moved and {"Decoding", "Finished"} & seen_states and g1 > 0 and hit > 0
        if not check:
            print(capture(session))
            diagnose(err_path, engine_tail)
            raise SystemExit(f"FAIL: requests did not move through states holding G1 blocks, with G1 hits "
                             f"(seen {sorted(seen_states)}, at most {g1} G1 blocks, {hit} G1 hit tokens)")
        print(f"ok: requests move through their states (seen {sorted(seen_states)}), "
              f"holding G1 blocks (up to {g1}), some found in vLLM's prefix cache (up to {hit} tokens)", flush=True)
        if a.observer:
            tmux("send-keys", "-t", session, "q")
            print("all console checks passed (observer)", flush=True)
            return
        tmux("send-keys", "-t", session, "2")

        def done_and_blocks(s, direction):
            """The totals row's Done and Blocks for one direction (counts
            have thousands separators: `1,120`)."""
            m = re.search(direction + r"((?:\s+[\d,]+){6})", s)
            if m is None:
                return 0, 0
            cols = [int(c.replace(",", "")) for c in m.group(1).split()]
            return cols[1], cols[5]

        def transfers(s):
            return all(min(done_and_blocks(s, d)) > 0 for d in ("G1→G2", "G2→G1"))

        wait_for(session, transfers, "G1→G2 and G2→G1 transfers done, with their blocks, on the transfers view", timeout=90,
                 err_path=err_path, engine_tail=engine_tail)
        print("ok: the transfers view shows G1→G2 and G2→G1 transfers done, with their blocks", flush=True)
        # Back on the slots view, until finished requests with G2 hits
        # (loaded after a reset) are on the screen.
        tmux("send-keys", "-t", session, "1")
        t2 = time.time()
        while time.time() - t2 < 60 and not any(finished_g2.values()):
            note_g2(capture(session))
            time.sleep(0.5)
        tmux("send-keys", "-t", session, "q")
        done = [line.strip() for line in list(engine_tail) if '"round"' in line]
        engine.kill_group(eng)
        # What the recording says was loaded for the requests seen finished.
        import run  # noqa: E402 (this directory)

        loaded = run.loaded_per_request(a.recorder, rec)
        want = {r: loaded.get(r, {}).get("Host", 0) * engine.BLOCK for r in finished_g2}
        wrong = {r: (finished_g2[r], want[r]) for r in finished_g2 if finished_g2[r] != want[r]}
        hit = sum(1 for v in finished_g2.values() if v > 0)
        if not finished_g2 or hit == 0 or wrong:
            raise SystemExit(f"FAIL: the slots view's Hit G2 of finished requests against the G2→G1 blocks the "
                             f"recording loaded for them ({hit} of {len(finished_g2)} with hits; differ "
                             f"(screen, recording): {dict(list(wrong.items())[:5])})")
        print(f"ok: after vLLM's prefix cache was reset, the slots view credits {hit} of the {len(finished_g2)} "
              f"finished requests seen with G2 hits, each equal to the G2→G1 blocks the recording loaded for it "
              f"(up to {max(finished_g2.values())} tokens)", flush=True)
        print(f"all console checks passed (the engine's last round: {done[-1] if done else 'none yet'})", flush=True)
    finally:
        tmux("kill-session", "-t", session, check=False)
        engine.kill_group(eng)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
