"""The connector's `publish` on a real vLLM (CPU, the tiny Llama): kvbm's
connector runs inside vLLM with `kv_connector_extra_config` {"publish":
"nats://127.0.0.1:PORT", "engine_id": "vllm-pod-1", a host tier}, against a
real `nats-server -js` (loopback, a free port, a temporary store); the
workload shares prefixes and resets vLLM's prefix cache between two rounds,
so blocks go G1→G2 and come back G2→G1. Then the real
`kvbm-recorder record --from nats://` records the fleet (bounded by
`--idle-exit-s`), and the recording must hold what happened:

- `inspect --json`: engine vllm-pod-1, seqs 0..events-1 with no hole, no
  loss of any kind, and as many events as the connector emitted and its
  publisher had acknowledged (its counters, from `KVBM_STATS_FILE`,
  written at shutdown), nothing lost on the way;
- `check` exits 0;
- `export`: a slot created for each of vLLM's requests and each reaching
  Finished; blocks registered on G1 and G2; transfers completed both ways
  (G1→G2 stores, G2→G1 loads); every request's G1 blocks announced by
  registered block ids; `stats --json`: transfer latency both ways;
- `kvbm-console replay` of the fleet recording, in tmux (with
  `--console`): the Where view finds a vLLM request's prefix on
  vllm-pod-1, with its bytes;
- vLLM itself: round 2 got external hits (loaded from G2) and the same
  tokens as round 1.

Run by scripts/test-vllm.sh:
    python fleet_publish.py --recorder target/release/kvbm-recorder --nats-server PATH \
        --console target/release/kvbm-console
Bounded: SIGALRM at 300 s; nats-server, the recorder and vLLM's engine core
are killed however it ends.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import engine as E  # noqa: E402

ENGINE = "vllm-pod-1"
FAILURES = []


def check(cond, msg):
    print(("ok: " if cond else "FAIL: ") + msg, flush=True)
    if not cond:
        FAILURES.append(msg)
    return cond


def fatal(msg):
    print(f"FAIL: {msg}", flush=True)
    raise SystemExit(1)


def close(llm, grace_s=60):
    """Shuts vLLM down, giving its engine core `grace_s` to finish (the
    connector's shutdown, where the publisher drains and its final counters
    are written, runs after vLLM's worker has exited; vLLM's own default of
    5 s, worker exit included, is not always enough on a loaded 2-core
    machine, and then the engine core is killed first)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown(timeout=grace_s)


def run(argv, timeout=60):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def where_in_console(console, rec, request, tmp):
    """`kvbm-console replay` of the fleet recording in a real terminal
    (tmux): `f`, the request id, Enter; returns the Where view's title and
    vllm-pod-1's row (None where not seen within 30 s) and the screen."""
    import re

    session = f"kvbm-fleet-publish-{os.getpid()}"
    err = os.path.join(tmp, "console.err")
    tmux = lambda *args: subprocess.run(["tmux", *args], capture_output=True, text=True)  # noqa: E731
    tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "40", f"{console} replay {rec} 2>{err}; sleep 30")
    screen = ""
    try:
        deadline = time.time() + 30
        while time.time() < deadline and ENGINE not in screen:
            time.sleep(0.5)
            screen = tmux("capture-pane", "-p", "-t", session).stdout
        tmux("send-keys", "-t", session, "f")
        time.sleep(0.5)
        tmux("send-keys", "-t", session, "-l", request)
        tmux("send-keys", "-t", session, "Enter")
        # "Where is REQ — N block(s), served by vllm-pod-1", then the row:
        # engine, blocks, % of prefix, G1, G2, G3, bytes.
        title_re = re.compile(r"Where is " + re.escape(request) + r" — (\d+) block\(s\), served by " + ENGINE)
        row_re = re.compile(ENGINE + r"\s+(\d+)\s+\S+\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)")
        title = row = None
        while time.time() < deadline + 15 and not (title and row):
            time.sleep(0.5)
            screen = tmux("capture-pane", "-p", "-t", session).stdout
            title = title_re.search(screen)
            row = next((m for m in row_re.finditer(screen) if "Where is" not in m.group(0)), None)
        tmux("send-keys", "-t", session, "q")
        return title, row, screen
    finally:
        tmux("kill-session", "-t", session)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recorder", required=True)
    ap.add_argument("--nats-server", required=True)
    ap.add_argument("--console", help="kvbm-console: replay the recording in tmux and use its Where view")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (printed)")
    a = ap.parse_args()
    E.bounded(300)
    tmp = tempfile.mkdtemp(prefix="kvbm-fleet-publish-")
    nport = E.free_port()
    nats = E.spawn(
        [a.nats_server, "-js", "-a", "127.0.0.1", "-p", str(nport), "-sd", os.path.join(tmp, "js")],
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(tmp, "nats.log"), "w"),
    )
    llm = None
    try:
        if not E.listens(nport):
            fatal(f"nats-server does not listen on {nport}")
        url = f"nats://127.0.0.1:{nport}"
        stats_file = os.path.join(tmp, "connector-stats.json")
        # Read by the connector in vLLM's engine-core process (spawned
        # after this, so it inherits it).
        os.environ["KVBM_STATS_FILE"] = stats_file
        extra = {"publish": url, "engine_id": ENGINE, "host_capacity_tokens": 8192, "shm_dir": tmp}
        t0 = time.time()
        llm = E.engine(extra=extra)
        print(f"vLLM up in {E.elapsed(t0)} s, publishing to {url} as {ENGINE}", flush=True)
        ps = E.prompts(groups=3, per_group=4)
        outs1, cached1 = E.generate(llm, ps)
        # Refused while some finished request's blocks are still held
        # (kvbm's stores of them not yet run: the connector frees them
        # one step after they finish, and an idle engine takes that step
        # at once); round 2 would then hit vLLM's own cache, not kvbm's.
        reset = llm.reset_prefix_cache()
        outs2, cached2 = E.generate(llm, ps)
        t1 = time.time()
        close(llm)
        llm = None
        print(f"vLLM shut down in {E.elapsed(t1)} s", flush=True)
        check(reset is not False, f"vLLM's prefix cache was reset between the rounds ({reset})")
        check(outs1 == outs2, "round 2 (after the prefix-cache reset) has round 1's tokens")
        hits = sum(1 for c in cached2 if c > 0)
        check(hits >= len(ps) // 2, f"round 2 gets external hits from G2 ({cached2})")
        n_requests = 2 * len(ps)

        try:
            with open(stats_file) as f:
                stats = json.load(f)
        except (OSError, ValueError) as e:
            stats = {}
            print(f"(no connector stats: {e})", flush=True)
        pub = stats.get("publisher")
        emitted = stats.get("events_emitted")
        print(f"connector: emitted {emitted}, publisher {pub}", flush=True)

        rec = os.path.join(tmp, "fleet")
        r = run([a.recorder, "record", "--from", url, "--out", rec, "--idle-exit-s", "3"], timeout=90)
        print(r.stdout.strip(), flush=True)
        if r.returncode != 0:
            fatal(f"record exited {r.returncode}: {r.stderr[-2000:]}")
        i = run([a.recorder, "inspect", "--json", rec])
        if i.returncode != 0:
            fatal(f"inspect exited {i.returncode}: {i.stderr[-2000:]}")
        v = json.loads(i.stdout)
        engines = v.get("engines", {})
        e = engines.get(ENGINE)
        if e is None:
            fatal(f"no engine {ENGINE} in the fleet recording (engines: {sorted(engines)})")
        check(sorted(engines) == [ENGINE], f"the recording holds engine {ENGINE} alone ({sorted(engines)})")
        n = e["events"]
        print(f"recorded {ENGINE}: {json.dumps(e)}", flush=True)
        check(n > 0, f"{n} events recorded")
        check(e.get("first_seq") == 0 and e.get("last_seq") == n - 1,
              f"seqs {e.get('first_seq')}..{e.get('last_seq')}: every seq from 0, once each")
        losses = e.get("losses", {})
        check(all(v == 0 for v in losses.values()), f"no losses of any kind ({losses})")
        if pub is not None and emitted is not None:
            check(pub.get("events_sent") == n and emitted == n,
                  f"the connector emitted {emitted} events, its publisher had {pub.get('events_sent')} "
                  f"acknowledged, the recording holds {n}")
            check(pub.get("tap_dropped", 1) == 0 and pub.get("dropped", 1) == 0 and pub.get("publish_errors", 1) == 0,
                  f"the publisher lost nothing and no publish failed ({pub})")
        else:
            check(False, f"the connector's counters ({stats_file}) say what it emitted and published ({stats})")

        c = run([a.recorder, "check", rec])
        print(c.stdout.strip(), flush=True)
        check(c.returncode == 0, f"kvbm-recorder check on the fleet recording exits 0 (exit {c.returncode})")

        x = run([a.recorder, "export", "--format", "jsonl", os.path.join(rec, "engines", ENGINE)])
        if x.returncode != 0:
            fatal(f"export exited {x.returncode}: {x.stderr[-2000:]}")
        kinds, created, finished = {}, set(), set()
        registered, completed = {}, {}
        device_ids, given = set(), {}
        for line in x.stdout.splitlines():
            ev = json.loads(line)
            k = ev["kind"]
            kind = k["kind"]
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "SlotCreated":
                created.add(ev.get("request"))
            elif kind == "SlotTransition" and k.get("to") == "Finished":
                finished.add(ev.get("request"))
            elif kind == "BlockRegistered":
                registered[k["tier"]] = registered.get(k["tier"], 0) + 1
                if k["tier"] == "Device":
                    device_ids.add(k["block"])
            elif kind == "BlocksAllocated" and k["tier"] == "Device":
                given.setdefault(ev.get("request"), []).extend(k["blocks"])
            elif kind == "TransferCompleted":
                d = k["direction"]
                d = f"{d['src']}→{d['dst']}" if isinstance(d, dict) else str(d)
                completed[d] = completed.get(d, 0) + 1
        print(f"kinds: {json.dumps(kinds, sort_keys=True)}", flush=True)
        check(sum(kinds.values()) == n, f"export gives the {n} events ({sum(kinds.values())})")
        created.discard(None)
        check(len(created) == n_requests, f"a slot created for each of vLLM's {n_requests} requests ({len(created)})")
        check(finished == created and len(finished) == n_requests,
              f"every slot reached Finished ({len(finished)} of {len(created)})")
        print(f"registered per tier: {registered}; completed transfers: {completed}", flush=True)
        check(registered.get("Device", 0) > 0 and registered.get("Host", 0) > 0,
              f"blocks registered on G1 and on G2 ({registered})")
        stores = sum(c for d, c in completed.items() if d.startswith("Device") and d.endswith("Host"))
        loads = sum(c for d, c in completed.items() if d.startswith("Host") and d.endswith("Device"))
        # The connector's own account of its loads and frees: a load not
        # shipped within `ship_timeout_s` is failed as late (vLLM
        # recomputes those blocks) and plans no transfer; a finished
        # request's blocks freed late keep vLLM from resetting its cache.
        levels = [stats] + [v for v in stats.values() if isinstance(v, dict)]
        shipping = {k: v for d in levels for k, v in d.items()
                    if not isinstance(v, dict) and any(w in k for w in ("late", "ship", "load", "frees"))}
        check(stores > 0 and loads > 0,
              f"transfers completed G1→G2 ({stores}) and G2→G1 ({loads}); the connector's loads: {shipping}")

        # What the fleet's Where view needs: each request's G1 blocks, by the
        # ids the registrations name (a request's prefix, as hashes).
        unnamed = sorted({b for bs in given.values() for b in bs} - device_ids)
        check(set(given) == created and not unnamed,
              f"every request's G1 blocks are announced ({len(given)} of {len(created)}), by registered "
              f"block ids ({len(unnamed)} never registered: {unnamed[:5]})")

        s = run([a.recorder, "stats", "--json", os.path.join(rec, "engines", ENGINE)])
        st = json.loads(s.stdout) if s.returncode == 0 else {}
        lat = st.get("transfer_latency_ns", {})
        check(any(k.startswith("G1→") for k in lat) and any(k.endswith("→G1") for k in lat),
              f"stats has transfer latency both ways ({sorted(lat)})")

        if a.console:
            # The request with the longest prefix: its blocks are held on G1
            # (kvbm's mirror) and, stored, on G2.
            request = max(given, key=lambda r: len(given[r]), default="(none announced)")
            title, row, screen = where_in_console(a.console, rec, request, tmp)
            ok = check(title is not None and row is not None and int(title.group(1)) > 0
                       and int(row.group(1)) > 0 and row.group(5) not in ("0B", "-"),
                       f"the console's Where view on the fleet recording finds {request}'s prefix on {ENGINE} "
                       f"({title.group(0) if title else 'no title'}; "
                       f"row: {' '.join(row.groups()) if row else 'none'}: blocks, G1, G2, G3, bytes)")
            if not ok:
                print(screen, flush=True)
        else:
            print("(no --console: the Where view on the recording not checked)", flush=True)
    finally:
        if llm is not None:
            close(llm, 10)
        E.kill_group(nats)
        E._kill_children()  # anything else left (an engine core that failed to start)
        if a.keep:
            print(f"kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if FAILURES:
        print(f"\n{len(FAILURES)} check(s) failed", flush=True)
        sys.exit(1)
    print(f"\nOK: the connector's events reached the fleet recording as {ENGINE}, all of them", flush=True)


if __name__ == "__main__":
    main()
