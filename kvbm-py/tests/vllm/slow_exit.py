"""kvbm's connector with a worker slow to exit: its shutdown, which vLLM's
worker process runs on its way out, takes longer than the 5 s that vLLM
gives its engine core to stop. vLLM's executor waits for that worker
before the scheduler's shutdown, so the engine core is killed before the
scheduler-side connector hears of it from vLLM; kvbm's recording must be
finished all the same (`kvbm.vllm._finish_before_engine_teardown`)."""

import time

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvbm.vllm import KvbmConnector

# Past vLLM's 5 s, with room for a slow machine's own teardown.
WORKER_EXIT_S = 8.0


class SlowExitConnector(KvbmConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._slow = role == KVConnectorRole.WORKER

    def shutdown(self):
        super().shutdown()
        if self._slow:
            self._slow = False
            time.sleep(WORKER_EXIT_S)
