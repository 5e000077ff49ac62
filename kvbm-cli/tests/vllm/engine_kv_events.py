"""vLLM's engine itself (CPU backend, tiny random-weight Llama, no
download) publishing its KV events, behind the lossy proxy of
``kv_publisher.py``, for ``vllm_engine.rs``.

    python engine_kv_events.py PORT REPLAY_PORT PROXY_PORT '[seq, ...]'

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
so that its publisher, vLLM's ``ZmqEventPublisher``, can be told to bind
loopback (see ``kv_publisher.py``). Prints ``ready`` once the engine is up
and the proxy subscribed; on the line ``go`` it serves
four rounds of requests sharing prefixes (a KV cache small enough to evict, and prefix
cache resets: BlockStored, BlockRemoved, AllBlocksCleared),
then one more request with nothing dropped, so every loss is followed by a
batch that reveals it; prints ``done {"forwarded": n, "dropped": [...]}``
and waits for ``quit``. Bounded: ends itself after 300 s.
"""

import json
import os
import sys
import time

os.environ["KVBM_TEST_TIMEOUT_S"] = "300"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_publisher  # noqa: E402  (bounds the process, imports vLLM)
from vllm.distributed import kv_events  # noqa: E402

MODEL = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "../../../kvbm-py/tests/vllm/tiny-llama"
)


def main():
    port, replay, proxy_port = (int(a) for a in sys.argv[1:4])
    drop = json.loads(sys.argv[4])
    # The one change: bind the loopback endpoint it is given.
    kv_events.ZmqEventPublisher._is_bind_endpoint = staticmethod(lambda e: True)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=MODEL,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=8,
        block_size=32,
        kv_cache_memory_bytes=1024 * 1024,
        dtype="bfloat16",
        seed=0,
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        },
    )
    proxy = kv_publisher.Proxy(port, proxy_port, drop)
    time.sleep(0.5)
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for r in range(4):
        prompts = [
            TokensPrompt(prompt_token_ids=[(g * 97 + j) % 991 + 3 for j in range(64)]
                         + [(r * 31 + i * 13 + j) % 991 + 3 for j in range(20 + 9 * i)])
            for g in range(3)
            for i in range(6)
        ]
        llm.generate(prompts, sp, use_tqdm=False)
        if r % 2 == 1:
            llm.reset_prefix_cache()
    time.sleep(0.5)
    with proxy.lock:
        proxy.drop = set()
    llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 70)))], sp, use_tqdm=False)
    time.sleep(1.0)
    with proxy.lock:
        print("done " + json.dumps({"forwarded": proxy.forwarded, "dropped": sorted(proxy.dropped)}), flush=True)
    sys.stdin.readline()
    os._exit(0)


if __name__ == "__main__":
    main()
