"""Type stubs for the Rust core of kvbm's vLLM connector."""

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

__version__: str
DEBUG_BUILD: bool
"""True when built without optimisation (debug assertions on), as
scripts/test-vllm.sh installs it; `pip install ./kvbm-py` builds optimised."""

def check_config(config_json: str) -> None:
    """Raises ValueError naming the bad key of kv_connector_extra_config."""

Geometry = Tuple[int, int, int, int]
"""(num_gpu_blocks, block_size, num_layers, page_bytes)."""

NewRequest = Tuple[str, int, Sequence[List[int]]]
"""(request id, computed tokens, block ids per KV-cache group) of a request
scheduled for the first time."""

class Scheduler:
    def __init__(
        self,
        config_json: str,
        geometry: Geometry,
        engine_id: str,
        ranks: int = 1,
        stages: int = 1,
        async_scheduling: bool = False,
    ) -> None: ...
    def summary(self) -> str:
        """What kvbm runs as, in one line: ranks, scheduling, tiers and sizes."""
    def start_notes(self) -> List[str]:
        """What the start did that the user should hear of (host-tier files of
        killed engines it removed), one line each."""
    def get_num_new_matched_tokens(
        self,
        request: str,
        prompt: List[int],
        num_computed_tokens: int,
        tokens: Optional[Sequence[int]] = None,
        prompt_len: Optional[int] = None,
    ) -> Optional[int]:
        """At a request's first lookup kvbm follows it through `tokens`,
        vLLM's list of its tokens (appended to as they are sampled)."""
    def update_state_after_alloc(
        self, request: str, block_ids: List[int], num_external_tokens: int
    ) -> None: ...
    def build_meta(
        self,
        new: List[NewRequest],
        req_ids: List[str],
        new_block_ids: List[Optional[Sequence[List[int]]]],
        num_computed_tokens: List[int],
        num_scheduled_tokens: Dict[str, int],
        resumed: Optional[Iterable[str]] = None,
        block_state: Optional[Any] = None,
        preempted: Optional[Iterable[str]] = None,
        g1_free: Optional[int] = None,
        outputs: Sequence[Sequence[bytes]] = (),
    ) -> bytes:
        """The step's plan, from vLLM's scheduler output read in place:
        `scheduled_cached_reqs`' lists, `num_scheduled_tokens`,
        `kv_connector_block_state` (its `get_block_ids`); `outputs`: vLLM's
        outputs since the last call (each its reports), told first. No
        bytes: nothing for the worker to do."""
    def update_connector_output(self, reports: List[bytes]) -> None: ...
    def outputs(self, outputs: Sequence[Sequence[bytes]]) -> None:
        """vLLM's outputs, each as `update_connector_output` with its
        reports."""
    def request_finished(self, request: str, block_ids: List[int]) -> bool: ...
    def serving(self) -> Optional[str]: ...
    def counters(self) -> str: ...
    def shutdown(self) -> None: ...

class Worker:
    """The worker side. It copies to and from the addresses in
    `tensors_json` (`data_ptr`, checked only for null and size): they must
    be vLLM's own KV tensors, kept alive by the caller for as long as this
    object. This private module trusts its one caller, `kvbm.vllm`."""

    def __init__(
        self,
        config_json: str,
        geometry: Geometry,
        engine_id: str,
        tensors_json: str,
        rank: int = 0,
        ranks: int = 1,
    ) -> None: ...
    def run(self, plan: bytes, stream: int = 0) -> Tuple[Optional[bytes], List[str], List[int]]:
        """Runs a step's plan; returns (report, finished sending, failed load blocks).

        `stream`: vLLM's current CUDA stream when its KV cache is on a GPU;
        the copies are then enqueued on it and reported once they have run.
        """
    def poll(self) -> Optional[bytes]:
        """The report of GPU copies that have run since the last one, if any."""
    def shutdown(self) -> None: ...
