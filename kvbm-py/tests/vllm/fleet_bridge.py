"""The fleet bridge against a real vLLM (CPU, the tiny Llama): vLLM runs with
its own KV-event publisher (ZMQ, with a replay endpoint) and no kvbm
connector; `kvbm-recorder bridge` carries its events onto a real nats-server
as engine `vllm-0`; `kvbm-recorder record --from nats://` records the fleet.
Checks that every block hash vLLM stored reaches the fleet recording
(registered on G1 in engine vllm-0's log), that nothing is missing, and that
the recording passes `check`.

Run by scripts/test-vllm.sh:
    python fleet_bridge.py --recorder target/release/kvbm-recorder --nats-server PATH
Bounded: SIGALRM at 300 s.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import engine as E  # noqa: E402


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recorder", required=True)
    ap.add_argument("--nats-server", required=True)
    a = ap.parse_args()
    E.bounded(300)
    tmp = tempfile.mkdtemp(prefix="kvbm-fleet-bridge-")
    nport, zport, rport = E.free_port(), E.free_port(), E.free_port()
    nats = subprocess.Popen(
        [a.nats_server, "-js", "-a", "127.0.0.1", "-p", str(nport), "-sd", os.path.join(tmp, "js")],
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(tmp, "nats.log"), "w"),
    )
    procs = [nats]
    try:
        if not E.listens(nport):
            fail(f"nats-server does not listen on {nport}")
        url = f"nats://127.0.0.1:{nport}"
        bridge = subprocess.Popen(
            [a.recorder, "bridge", "--from", f"zmq://127.0.0.1:{zport}",
             "--replay-endpoint", f"zmq://127.0.0.1:{rport}",
             "--engine-id", "vllm-0", "--to", url],
            stdout=subprocess.PIPE, stderr=open(os.path.join(tmp, "bridge.log"), "w"), text=True,
        )
        procs.append(bridge)

        from vllm import LLM

        llm = LLM(
            model=E.MODEL, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
            max_model_len=512, max_num_seqs=8, block_size=E.BLOCK,
            kv_cache_memory_bytes=2 * 1024 * 1024, dtype="bfloat16", seed=0,
            kv_events_config={
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{zport}", "replay_endpoint": f"tcp://*:{rport}",
            },
        )
        # The bridge subscribes while the engine starts; give the SUB socket
        # a moment after the publisher binds (ZMQ's slow joiner), then run
        # prompts that share prefixes, twice (the second time from cache).
        time.sleep(2)
        ps = E.prompts(groups=3, per_group=4)
        E.generate(llm, ps)
        E.generate(llm, ps)
        llm.reset_prefix_cache()
        time.sleep(1)
        E.close(llm)
        time.sleep(1)

        bridge.send_signal(signal.SIGINT)
        out, _ = bridge.communicate(timeout=30)
        print(out.strip(), flush=True)
        if bridge.returncode != 0:
            fail(f"bridge exited {bridge.returncode}: {open(os.path.join(tmp, 'bridge.log')).read()}")
        sent = int(out.split("bridged ")[1].split(" ")[0])
        if sent == 0:
            fail("the bridge sent nothing: vLLM's events did not reach it")

        rec = os.path.join(tmp, "fleet")
        r = subprocess.run([a.recorder, "record", "--from", url, "--out", rec, "--idle-exit-s", "2"],
                           capture_output=True, text=True, timeout=60)
        print(r.stdout.strip(), flush=True)
        if r.returncode != 0:
            fail(f"record exited {r.returncode}: {r.stderr}")
        v = json.loads(subprocess.run([a.recorder, "inspect", "--json", rec],
                                      capture_output=True, text=True, check=True).stdout)
        e = v["engines"].get("vllm-0")
        if e is None:
            fail(f"no vllm-0 in the fleet recording: {v}")
        if e["events"] != sent:
            fail(f"the recording holds {e['events']} events of vllm-0, the bridge sent {sent}")
        if e["losses"]["holes"] != 0 or e["losses"]["unexplained"] != 0:
            fail(f"losses: {e['losses']}")
        regs = 0
        jl = subprocess.run([a.recorder, "export", "--format", "jsonl", os.path.join(rec, "engines", "vllm-0")],
                            capture_output=True, text=True, check=True).stdout
        for line in jl.splitlines():
            if '"block_registered"' in line or "BlockRegistered" in line:
                regs += 1
        if regs == 0:
            fail("no block registration of vLLM's reached the recording")
        c = subprocess.run([a.recorder, "check", rec], capture_output=True, text=True)
        print(c.stdout.strip(), flush=True)
        if c.returncode != 0:
            fail("check of the fleet recording failed")
        print(f"OK: vLLM's {regs} block registrations ({sent} kvbm events) reached the fleet recording", flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
