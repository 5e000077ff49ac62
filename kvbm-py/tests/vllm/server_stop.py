"""vLLM's OpenAI-compatible server with kvbm, stopped the way orchestrators
stop it. Run through `scripts/test-vllm.sh`, which prepares the environment.

    python server_stop.py --recorder PATH/TO/kvbm-recorder

Two server starts (vLLM's start-up is the cost), both with `serve` and
`record` set and the same `shm_dir`:

1. the server serves a completion given as token ids; then its whole
   process group is killed (`kill -9`): its host-tier file stays behind,
   and `kvbm-recorder check` says the recording ended early (it was
   killed);
2. the next start removes the dead engine's file (saying so) and serves a
   completion; stopped with SIGTERM (to the server's process alone, as an
   orchestrator does), it exits within vLLM's shutdown window, its
   recording is finished (`check` exits 0) and no host-tier file is left.

Why: the server, with its default `shutdown_timeout` of 0, kills its engine
core right after asking it to stop; kvbm's connector gives that teardown
vLLM's usual 5 s (`kvbm.vllm._finish_before_engine_teardown`), and finishes
the recording first (`Observers::stop`).
"""

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import engine  # noqa: E402 (this directory; no vLLM import at load)
from run import FAILURES, check  # noqa: E402 (the same ok:/FAIL: lines as run.py)

PY = sys.executable
# vLLM gives its engine core 5 s to stop (kvbm's grace where the server would
# give none); the front end then closes its HTTP server.
STOP_WITHIN_S = 10.0
START_WITHIN_S = 300.0
MAX_TOKENS = 8


def host_files(shm):
    return sorted(glob.glob(os.path.join(shm, "kvbm-*.g2")))


def tail(path, n=30):
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-n:])
    except OSError:
        return ""


class Server:
    """One OpenAI server with kvbm, its stderr and stdout in `log`."""

    def __init__(self, work, name, shm):
        self.port = engine.free_port()
        self.attach = engine.free_port()
        self.rec = os.path.join(work, f"rec-{name}")
        self.log = os.path.join(work, f"server-{name}.log")
        extra = {
            "host_capacity_tokens": 8192,
            "shm_dir": shm,
            "serve": f"127.0.0.1:{self.attach}",
            "record": self.rec,
        }
        ktc = {
            "kv_connector": "KvbmConnector",
            "kv_connector_module_path": "kvbm.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        argv = [
            PY, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--model", engine.MODEL, "--load-format", "dummy",
            "--skip-tokenizer-init", "--enforce-eager",
            "--max-model-len", "512", "--block-size", str(engine.BLOCK),
            "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(2 * 1024 * 1024),
            "--max-num-seqs", "8", "--seed", "0",
            "--kv-transfer-config", json.dumps(ktc),
        ]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="INFO")
        self._out = open(self.log, "w")
        t0 = time.time()
        self.p = engine.spawn(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env, cwd=engine.HERE)
        self.up_s = None
        while time.time() - t0 < START_WITHIN_S and self.p.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        self.up_s = time.time() - t0
                        break
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)

    def stderr(self):
        self._out.flush()
        with open(self.log, errors="replace") as f:
            return f.read()

    def complete(self, prompt):
        """A completion of `prompt` (token ids): (status, generated token ids)."""
        body = {
            "model": engine.MODEL,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            # Without a tokenizer (`--skip-tokenizer-init`) the output must
            # not be detokenized; the token ids come back instead.
            "detokenize": False,
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                out = json.loads(r.read())
                return r.status, out["choices"][0].get("token_ids")
        except urllib.error.HTTPError as e:
            return e.code, e.read()[:500]
        except OSError as e:
            return None, str(e)

    def close(self):
        engine.kill_group(self.p)
        self._out.close()


def recorder_check(recorder, rec):
    c = subprocess.run([recorder, "check", rec], capture_output=True, text=True, timeout=120)
    said = " / ".join(l.strip() for l in (c.stdout + c.stderr).splitlines() if l.strip())
    return c.returncode, said


def prompt(k):
    # Three blocks and a bit: the host tier gets stores.
    return [(31 * k + 7 * j) % 990 + 5 for j in range(3 * engine.BLOCK + 5)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recorder", required=True, help="the kvbm-recorder binary")
    args = ap.parse_args()
    recorder = os.path.abspath(args.recorder)
    # Two starts of up to START_WITHIN_S each and the checks between them;
    # on SIGTERM, SIGHUP or this alarm every process started here is killed.
    engine.bounded(2 * START_WITHIN_S + 240)
    work = tempfile.mkdtemp(prefix="kvbm-server-stop-")
    shm = os.path.join(work, "shm")
    os.mkdir(shm)
    servers = []
    try:
        run(recorder, work, shm, servers)
    finally:
        for s in servers:
            s.close()
    if FAILURES:
        print(f"{len(FAILURES)} server-stop checks failed (logs in {work})", flush=True)
        sys.exit(1)
    # KVBM_TEST_KEEP=1 keeps the logs and recordings, as run.py does.
    if os.environ.get("KVBM_TEST_KEEP"):
        print(f"logs in {work}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    print("all server-stop checks passed", flush=True)


def run(recorder, work, shm, servers):
    # 1. Killed: its file stays, its recording ended early.
    s1 = Server(work, "killed", shm)
    servers.append(s1)
    if not check(s1.up_s is not None, f"server #1 answers /health ({s1.up_s or 0:.0f} s)"):
        print(tail(s1.log), flush=True)
        return
    status, toks = s1.complete(prompt(1))
    check(status == 200 and isinstance(toks, list) and len(toks) == MAX_TOKENS,
          f"server #1 serves a completion given as token ids ({status}: {toks})")
    left = host_files(shm)
    check(len(left) == 1, f"server #1 holds one host-tier file ({[os.path.basename(f) for f in left]})")
    engine.kill_group(s1.p)
    check(host_files(shm) == left and left, "after kill -9 of its process group, its host-tier file is still there")
    rc, said = recorder_check(recorder, s1.rec)
    print(f"  check of the killed server's recording: exit {rc}: {said}", flush=True)
    check(rc == 3 and "ended early" in said, "check says the killed server's recording ended early (exit 3)")

    # 2. The next start removes the dead engine's file; SIGTERM stops it
    #    cleanly.
    s2 = Server(work, "stopped", shm)
    servers.append(s2)
    if not check(s2.up_s is not None, f"server #2 answers /health ({s2.up_s or 0:.0f} s)"):
        print(tail(s2.log), flush=True)
        return
    err = s2.stderr()
    dead = [os.path.basename(f) for f in left]
    said = [l.strip() for l in err.splitlines() if "no running engine holds" in l]
    check(said and all(any(d in l for l in said) for d in dead),
          f"server #2 says it removed the dead engine's file: {said}")
    now = host_files(shm)
    check(not set(left) & set(now) and len(now) == 1,
          f"the dead engine's file is gone; server #2 holds its own ({[os.path.basename(f) for f in now]})")
    status, toks = s2.complete(prompt(2))
    check(status == 200 and isinstance(toks, list) and len(toks) == MAX_TOKENS,
          f"server #2 serves a completion given as token ids ({status}: {toks})")
    core = engine_core(s2.p.pid)
    t0 = time.time()
    s2.p.send_signal(signal.SIGTERM)  # the server's own process, as an orchestrator does
    stacks = watch_stop(s2, core, t0)
    took = time.time() - t0
    code = s2.p.poll()
    check(code is not None and took <= STOP_WITHIN_S,
          f"server #2 exits within {STOP_WITHIN_S:.0f} s of SIGTERM ({took:.2f} s, exit {code})")
    engine.kill_group(s2.p)
    err = s2.stderr()
    for l in err.splitlines():
        if "[shutdown]" in l and ("force killing" in l or "workers still running" in l):
            print(f"  vLLM: {l.strip()}", flush=True)
    rc, said = recorder_check(recorder, s2.rec)
    print(f"  check of the stopped server's recording: exit {rc}: {said}", flush=True)
    check(rc == 0, "check says the stopped server's recording is finished (exit 0)")
    try:
        with open(os.path.join(s2.rec, "recording.json")) as f:
            ended = json.load(f).get("ended")
    except (OSError, ValueError) as e:
        ended = str(e)
    check(isinstance(ended, dict) and ended.get("how") == "finished", f"its sidecar says finished ({ended})")
    left = host_files(shm)
    check(not left, f"no host-tier file is left after SIGTERM ({[os.path.basename(f) for f in left]})")
    if FAILURES:
        print(tail(s2.log, 40), flush=True)
        if stacks:
            print(stacks, flush=True)


def engine_core(server_pid):
    """The server's engine-core process (psutil), or None."""
    import psutil

    try:
        kids = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    return next((k for k in kids if "EngineCore" in k.name()), None)


def watch_stop(server, core, t0):
    """Waits for the server to exit. If its engine core has not said it
    received the signal 2 s after it was sent (vLLM force-kills it at 5 s,
    and kvbm's teardown needs that signal handled; one CI run of many
    missed it), takes py-spy's dump of the engine core's threads, where
    py-spy is installed (scripts/test-vllm.sh installs it), and returns it:
    where its main thread was instead."""
    stacks = None
    end = t0 + STOP_WITHIN_S + 20
    while server.p.poll() is None and time.time() < end:
        if stacks is None and core is not None and time.time() - t0 >= 2.0:
            stacks = ""
            if "EngineCore: trigger received signal" not in server.stderr():
                stacks = py_spy_dump(core.pid)
        time.sleep(0.1)
    return stacks


def py_spy_dump(pid):
    spy = os.path.join(os.path.dirname(PY), "py-spy")
    if not os.path.exists(spy):
        return f"(the engine core had not handled SIGTERM after 2 s; no py-spy at {spy} to show where it was)"
    try:
        d = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "(py-spy dump took over 20 s)"
    return f"the engine core had not handled SIGTERM after 2 s; py-spy dump:\n{d.stdout}{d.stderr}"


if __name__ == "__main__":
    main()
