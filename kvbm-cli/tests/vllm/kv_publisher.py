"""vLLM's own KV-event publisher, driven line by line by a Rust test.

The publisher is ``vllm.distributed.kv_events.ZmqEventPublisher`` as vLLM
ships it (its thread, its encoder, its replay ROUTER and framing), with one
difference: it binds a loopback address. Its endpoint heuristic binds only
``tcp://*:P`` (every interface) and connects to anything else, and tests
bind 127.0.0.1 only; the subclass below answers "bind" for every endpoint.

A lossy link for tests is here too: a proxy (SUB on the publisher, PUB on
loopback for the recorders) that forwards every batch except the ones the
test names.

Commands, one JSON object a line on stdin; each answers ``ok {json}`` (or
``error …``) on stdout:

- ``{"op": "start", "port": P, "replay_port": R or null, "buffer_steps": N}``
- ``{"op": "publish", "batches": [[event, …], …]}``, an event being
  ``{"stored": [h, …], "group": g, "medium": m, "parent": p}``,
  ``{"removed": [h, …], "group": g, "medium": m}`` or ``{"cleared": true}``;
  answers once every batch has been sent, with ``{"seqs": [first, last]}``
- ``{"op": "stop"}``: ``shutdown()``; the next ``start`` counts from seq 0,
  as a restarted engine does
- ``{"op": "proxy", "upstream": P, "port": Q, "drop": [seq, …]}``
- ``{"op": "proxy_stats"}``: ``{"forwarded": n, "dropped": [seq, …]}``
- ``{"op": "quit"}``

Bounded: the process ends itself after ``KVBM_TEST_TIMEOUT_S`` (120 s).
"""

import json
import os
import signal
import socket
import sys
import threading
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
signal.signal(signal.SIGALRM, lambda *_: os._exit(124))
signal.alarm(int(os.environ.get("KVBM_TEST_TIMEOUT_S", "120")))

import zmq  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)


class LoopbackPublisher(ZmqEventPublisher):
    """vLLM's publisher, binding the loopback endpoint it is given."""

    @staticmethod
    def _is_bind_endpoint(endpoint: str) -> bool:
        return True


def event(spec):
    medium = spec.get("medium", "GPU")
    group = spec.get("group", 0)
    if "stored" in spec:
        hs = spec["stored"]
        return BlockStored(
            block_hashes=hs,
            parent_block_hash=spec.get("parent"),
            token_ids=list(range(32 * len(hs))),
            block_size=32,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=group,
            kv_cache_spec_kind="full_attention",
        )
    if "removed" in spec:
        return BlockRemoved(block_hashes=spec["removed"], medium=medium, group_idx=group)
    return AllBlocksCleared()


class Proxy:
    """Forwards the publisher's batches to its own PUB, dropping some."""

    def __init__(self, upstream, port, drop):
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(f"tcp://127.0.0.1:{upstream}")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.drop = set(drop)
        self.forwarded = 0
        self.dropped = []
        self.lock = threading.Lock()
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while True:
            frames = self.sub.recv_multipart()
            seq = int.from_bytes(frames[1], "big")
            with self.lock:
                if seq in self.drop:
                    self.dropped.append(seq)
                    continue
                self.forwarded += 1
            self.pub.send_multipart(frames)


def wait_bindable(ports, timeout=5.0):
    deadline = time.time() + timeout
    for port in ports:
        while True:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
            finally:
                s.close()


def main():
    pub = None
    proxy = None
    sent = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        answer = {}
        if op == "start":
            replay = cmd.get("replay_port")
            # A publisher just shut down frees its ports a moment later
            # (ZeroMQ closes sockets on its I/O thread): wait for them, as a
            # restarting engine would.
            wait_bindable([cmd["port"]] + ([replay] if replay else []))
            pub = LoopbackPublisher(
                data_parallel_rank=0,
                endpoint=f"tcp://127.0.0.1:{cmd['port']}",
                replay_endpoint=f"tcp://127.0.0.1:{replay}" if replay else None,
                buffer_steps=cmd.get("buffer_steps", 10_000),
            )
            sent = 0
        elif op == "publish":
            first = sent
            for b in cmd["batches"]:
                pub.publish(KVEventBatch(ts=time.time(), events=[event(e) for e in b]))
                sent += 1
            pub._event_queue.join()  # every batch sent
            answer = {"seqs": [first, sent - 1]}
        elif op == "stop":
            pub.shutdown()
            pub = None
        elif op == "proxy":
            proxy = Proxy(cmd["upstream"], cmd["port"], cmd.get("drop", []))
            time.sleep(0.3)  # its subscription reaches the publisher
        elif op == "proxy_stats":
            with proxy.lock:
                answer = {"forwarded": proxy.forwarded, "dropped": list(proxy.dropped)}
        elif op == "quit":
            print("ok {}", flush=True)
            os._exit(0)
        else:
            print(f"error unknown op {op}", flush=True)
            continue
        print("ok " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    print("ready", flush=True)
    main()
