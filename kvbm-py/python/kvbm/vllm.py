"""kvbm as vLLM's KV connector: ``kvbm.vllm.KvbmConnector``.

vLLM owns the device tier (its block pool, prefix cache and block ids);
kvbm owns a host tier and a disk tier and their prefix index, and follows
vLLM's device blocks through the connector calls. This module only reads
vLLM's objects and hands plain data to the Rust core (``kvbm._kvbm``):

- in vLLM's engine-core process (role SCHEDULER) a ``Scheduler`` plans
  loads and stores, runs kvbm's breakpoints, the attach server and the
  recording;
- in vLLM's worker process (role WORKER) a ``Worker`` wraps vLLM's KV
  tensors (no copy) and runs each step's copies before its forward pass.

Settings (``kv_connector_extra_config``, all optional): ``host_capacity_tokens``
(default: 10% of RAM; 0 disables the host tier), ``disk_path`` and
``disk_capacity_tokens``, ``offload`` (``eager`` or ``lazy``), ``eviction``
(``lru``, ``lfu``, ``s3fifo`` or ``arc``, or ``G2=...,G3=...``), ``serve``
(``host:port`` of an attach server), ``token``, ``record`` (a new directory),
``breakpoint_deadline_s``, ``ship_timeout_s``, ``shm_dir``, or ``publish``
(``nats://HOST:PORT``, the fleet's event plane) with ``engine_id``. An
unknown key is an error naming it. With ``KVBM_STATS_FILE`` set, the
connector's counters are kept in that file (with ``publish``, what its
publisher sent and lost and what its NATS control answered and refused,
final after shutdown).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvbm import _kvbm

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger("kvbm")


@dataclass
class KvbmMetadata(KVConnectorMetadata):
    """One step's plan (stores, then loads), from the scheduler side."""

    plan: bytes = b""


@dataclass
class KvbmWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers' copies of a step came to, for the scheduler side."""

    reports: List[bytes] = field(default_factory=list)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KvbmWorkerMetadata":
        more = other.reports if isinstance(other, KvbmWorkerMetadata) else []
        return KvbmWorkerMetadata(reports=self.reports + more)


def _extra(vllm_config: Any) -> Dict[str, Any]:
    ktc = vllm_config.kv_transfer_config
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    return dict(extra)


def _geometry(kv_cache_config: Any) -> Tuple[int, int, int, int]:
    """(num_gpu_blocks, block_size, num_layers, page_bytes) from vLLM's
    ``KVCacheConfig``; kvbm follows one KV-cache group."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ValueError(
            f"kvbm: vLLM's KV cache has {len(groups)} groups; kvbm follows models with one "
            "(hybrid models are not supported yet)"
        )
    spec = groups[0].kv_cache_spec
    return (
        int(kv_cache_config.num_blocks),
        int(spec.block_size),
        len(groups[0].layer_names),
        int(spec.page_size_bytes),
    )


def _parallel(vllm_config: Any) -> Tuple[int, int, bool]:
    """(tensor-parallel workers, pipeline stages, async scheduling) of the
    engine. Each tensor-parallel rank keeps its own shard of the KV heads
    in kvbm's tiers (a host-tier file and a disk file per rank); every rank
    runs each step's plan, and a copy is done when every rank has done it.
    With async scheduling (vLLM's default on GPUs) a step's stores wait for
    vLLM to report that step's output, not the next one planned.
    Pipeline parallelism is refused by the scheduler side, saying why.
    Data-parallel engines are each an engine of their own
    (`_per_engine`)."""
    pc = getattr(vllm_config, "parallel_config", None)
    sc = getattr(vllm_config, "scheduler_config", None)
    ranks = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    stages = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    return ranks, stages, bool(getattr(sc, "async_scheduling", False))


def _per_engine(extra: Dict[str, Any], engine_id: str, dp: int, dp_rank: int) -> Tuple[Dict[str, Any], str]:
    """The settings and engine id of data-parallel engine `dp_rank` of `dp`.

    vLLM's data-parallel engines share one `kv_transfer_config`, but each
    has its own scheduler, block ids and workers: kvbm makes each a distinct
    engine, with its own tiers (engine id `<id>-dp<rank>`, so its own
    host-tier files; `disk_path.dp<rank>`), its own recording
    (`record-dp<rank>`), attach server (`serve`'s port + rank) and fleet name
    (`engine_id-dp<rank>`). One engine (`dp` 1) keeps its settings as given."""
    if dp <= 1:
        return extra, engine_id
    extra = dict(extra)
    suffix = f"-dp{dp_rank}"
    if isinstance(extra.get("record"), str):
        extra["record"] = extra["record"] + suffix
    if isinstance(extra.get("disk_path"), str):
        extra["disk_path"] = f"{extra['disk_path']}.dp{dp_rank}"
    if isinstance(extra.get("engine_id"), str):
        extra["engine_id"] = extra["engine_id"] + suffix
    serve = extra.get("serve")
    if isinstance(serve, str) and ":" in serve:
        host, _, port = serve.rpartition(":")
        if port.isdigit() and int(port) > 0:
            # Past 65535 the config check refuses it, naming `serve`.
            extra["serve"] = f"{host}:{int(port) + dp_rank}"
    return extra, engine_id + suffix


def _tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (vLLM's process group is up by the
    time it registers its KV caches)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _finish_before_engine_teardown() -> None:
    """Makes vLLM's engine-core teardown finish kvbm's scheduler side
    before anything else, and gives that teardown time to run where vLLM
    would kill the engine core at once (once per process; idempotent; run
    at import, in whichever vLLM process imports this module, and again by
    the scheduler side).

    Why first: ``EngineCore.shutdown`` shuts its executor down first and its
    scheduler (whose shutdown reaches the connector's) after, and the
    process that started the engine core kills it 5 s after asking it to
    stop. Waiting for the executor's worker to exit took 3.2 of those 5 s
    in one run on the 2-core CPU machine of the tests (a build beside it),
    and in one test run of fourteen the connector was never told to stop:
    its recording was left unfinished and its final counters unwritten. No connector call marks
    the end of the engine's last step, but the teardown does: nothing is
    scheduled once it begins. So the teardown is wrapped to finish every
    kvbm connector of that engine core first; vLLM's own call to the
    connector's ``shutdown`` then finds it finished. Where vLLM has no
    ``EngineCore.shutdown`` to wrap, the connector finishes when vLLM's
    scheduler shuts down, as before.

    Why a grace: vLLM's OpenAI server, stopped by SIGTERM or SIGINT with its
    default ``shutdown_timeout`` of 0 ("abort"), sends SIGTERM to its engine
    core and SIGKILL right after it, without waiting: about 13 ms apart on
    the test machine, less than kvbm's teardown took with ``serve`` and
    ``record`` (the recording was left saying it was recording, and the
    host-tier file stayed behind). vLLM gives its engine core a window
    before the kill everywhere else (5 s when no timeout is given, 15 s on
    ROCm after an abort, for the same reason: teardown must not be cut
    short). This process, the one that imported the connector to read its
    metrics (vLLM's front end), is where that kill is decided, so its
    engine-process manager is wrapped to allow the same 5 s when vLLM would
    allow none. Requests are still aborted at once (the abort is the engine
    core's, from its own ``shutdown_timeout``); the wait ends as soon as
    the engine core exits, so a stop takes as long as the teardown does.
    """
    try:
        from vllm.v1.engine.utils import CoreEngineProcManager
    except ImportError:  # pragma: no cover (another vLLM layout)
        CoreEngineProcManager = None
    stop = getattr(CoreEngineProcManager, "shutdown", None)
    if stop is not None and not getattr(stop, "_kvbm_grace", False):

        @functools.wraps(stop)
        def stop_with_grace(self: Any, timeout: Optional[float] = None) -> Any:
            if timeout == 0 and getattr(self, "_request_shutdown_timeout", None) == 0:
                timeout = _ENGINE_CORE_GRACE_S
            return stop(self, timeout=timeout)

        stop_with_grace._kvbm_grace = True  # type: ignore[attr-defined]
        CoreEngineProcManager.shutdown = stop_with_grace  # type: ignore[method-assign]

    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # pragma: no cover (another vLLM layout)
        return
    original = getattr(EngineCore, "shutdown", None)
    if original is None or getattr(original, "_kvbm_finishes_first", False):
        return

    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        connector = getattr(getattr(self, "scheduler", None), "connector", None)
        # vLLM's MultiConnector keeps the connectors it combines.
        for c in [connector, *getattr(connector, "_connectors", ())]:
            if isinstance(c, KvbmConnector):
                try:
                    c.shutdown()
                except Exception:  # vLLM's teardown must go on regardless
                    logger.exception("kvbm: finishing before vLLM's engine teardown failed")
        return original(self, *args, **kwargs)

    shutdown._kvbm_finishes_first = True  # type: ignore[attr-defined]
    EngineCore.shutdown = shutdown  # type: ignore[method-assign]


# What vLLM allows its engine core when no timeout is given (seconds).
_ENGINE_CORE_GRACE_S = 5.0


# Passed where there are no reports (made once, not per call).
_EMPTY: Tuple[Any, ...] = ()

# vLLM's outputs kept for kvbm's next call at most (one a step: vLLM calls
# `build_connector_meta` every step; the bound is for a caller that does not).
_MAX_KEPT_OUTPUTS = 8


class KvbmConnector(KVConnectorBase_V1):
    """vLLM's KV connector backed by kvbm. See the module docs."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        pc = getattr(vllm_config, "parallel_config", None)
        extra, self._engine_id = _per_engine(
            _extra(vllm_config),
            str(getattr(ktc, "engine_id", None) or "kvbm"),
            int(getattr(pc, "data_parallel_size", 1) or 1),
            int(getattr(pc, "data_parallel_rank", 0) or 0),
        )
        self._config_json = json.dumps(extra)
        # Refused here, in both processes, with the key named.
        _kvbm.check_config(self._config_json)
        self._parallel = _parallel(vllm_config)
        self._geometry = _geometry(kv_cache_config)
        self._sched: Optional[_kvbm.Scheduler] = None
        self._worker: Optional[_kvbm.Worker] = None
        self._tensors: List["torch.Tensor"] = []
        self._on_gpu = False
        self._current_stream: Any = None
        self._layer_names: List[str] = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._stats_at = 0.0
        self._stats_path = os.environ.get("KVBM_STATS_FILE")
        # The worker's results of its last plan, until vLLM asks for them.
        self._reports: List[bytes] = []
        self._finished_sending: Set[str] = set()
        self._load_errors: Set[int] = set()
        # vLLM runs each step's plan at `handle_preemptions` (this vLLM
        # does once it has called it): `start_load_kv` then has nothing to do.
        self._runs_at_preemptions = False
        # vLLM's outputs (each its workers' reports) not yet told to kvbm
        # (see `update_connector_output`).
        self._outputs: List[Sequence[bytes]] = []
        self._tell_outputs_later = False
        self._stopped = False
        if role == KVConnectorRole.SCHEDULER:
            if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
                # A load kvbm cannot deliver must be recomputed, never fail
                # the request: the scheduler reads this right after
                # building the connector.
                logger.info("kvbm: kv_load_failure_policy set to 'recompute'")
                ktc.kv_load_failure_policy = "recompute"
            ranks, stages, async_scheduling = self._parallel
            self._tell_outputs_later = not async_scheduling
            self._sched = _kvbm.Scheduler(
                self._config_json, self._geometry, self._engine_id, ranks, stages, async_scheduling
            )
            _finish_before_engine_teardown()
            # What kvbm runs as, in one line (also in the recording and
            # the attach server's /health).
            logger.warning("kvbm: %s", self._sched.summary())
            for note in self._sched.start_notes():
                logger.warning("kvbm: %s", note)
            addr = self._sched.serving()
            if addr:
                logger.warning("kvbm: attach server on http://%s", addr)

    # ------------------------------------------------------------ properties

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a store that never happens is a future miss, not a loss.
        return False

    # --------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        assert self._sched is not None
        self._tell_outputs()
        prompt = request.prompt_token_ids or []
        # kvbm follows the request from here on through vLLM's own list of
        # its tokens, which vLLM appends each sampled token to (the
        # read-only view over it where this vLLM has no such list).
        tokens = getattr(request, "_all_token_ids", None)
        if not isinstance(tokens, list):
            tokens = request.all_token_ids
        n = self._sched.get_num_new_matched_tokens(
            request.request_id,
            list(prompt),
            int(num_computed_tokens),
            tokens,
            int(getattr(request, "num_prompt_tokens", len(prompt))),
        )
        if n is None:
            return None, False  # held by a breakpoint: vLLM asks again
        return n, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._tell_outputs()
        ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        self._sched.update_state_after_alloc(request.request_id, ids, int(num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        cached = scheduler_output.scheduled_cached_reqs
        # vLLM's per-step lists go to kvbm as they are: it reads each
        # running request's new tokens and added blocks there, with no
        # loop here over the requests, every step, on vLLM's critical path.
        new = [(n.req_id, n.num_computed_tokens, n.block_ids) for n in scheduler_output.scheduled_new_reqs]
        g1_free = None
        pool = getattr(self._kv_cache_manager, "block_pool", None) if self._kv_cache_manager else None
        if pool is not None:
            try:
                g1_free = int(pool.get_num_free_blocks())
            except Exception:  # noqa: BLE001 - a gauge is not worth failing a step
                g1_free = None
        plan = self._sched.build_meta(
            new,
            cached.req_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
            scheduler_output.num_scheduled_tokens,
            getattr(cached, "resumed_req_ids", None),
            getattr(scheduler_output, "kv_connector_block_state", None),
            getattr(scheduler_output, "preempted_req_ids", None),
            g1_free,
            self._take_outputs(),
        )
        self._write_stats()
        return KvbmMetadata(plan=plan)

    def _write_stats(self, force: bool = False, text: Optional[str] = None) -> None:
        """With ``KVBM_STATS_FILE`` set, keeps the connector's counters and
        its own time per step there (at most once a second; the final ones,
        ``text``, at shutdown), for benchmarks and diagnostics."""
        path = self._stats_path
        if not path or self._sched is None:
            return
        now = time.monotonic()
        if not force and now - self._stats_at < 1.0:
            return
        self._stats_at = now
        if text is None:
            self._tell_outputs()
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text if text is not None else self._sched.counters())
        os.replace(tmp, path)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        reports = meta.reports if isinstance(meta, KvbmWorkerMetadata) else _EMPTY
        if self._tell_outputs_later:
            # With sync scheduling kvbm only queues an output for its next
            # call anyway (it releases the stores of the step's forward
            # pass and resolves the reports off vLLM's thread): kept here
            # and told with that call, which spares vLLM's thread a call
            # into kvbm a step.
            self._outputs.append(reports)
            if len(self._outputs) >= _MAX_KEPT_OUTPUTS:
                self._tell_outputs()
            return
        self._sched.update_connector_output(reports)

    def _take_outputs(self) -> Sequence[Sequence[bytes]]:
        if not self._outputs:
            return _EMPTY
        outputs, self._outputs = self._outputs, []
        return outputs

    def _tell_outputs(self) -> None:
        """Tells kvbm the outputs kept since its last call, before
        anything else reaches it (it sees vLLM's calls in their order)."""
        if self._outputs:
            assert self._sched is not None
            self._sched.outputs(self._take_outputs())

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self._sched is not None
        self._tell_outputs()
        rid = request.request_id
        return self._sched.request_finished(rid, [int(b) for b in block_ids]), None

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: Dict[str, "torch.Tensor"]) -> None:
        names = [n for n in self._layer_names if n in kv_caches] or list(kv_caches)
        described = []
        for name in names:
            t = kv_caches[name]
            self._tensors.append(t)
            described.append(
                {
                    "name": name,
                    "data_ptr": int(t.data_ptr()),
                    "nbytes": int(t.numel() * t.element_size()),
                    "num_blocks": int(t.shape[0]),
                    "block_stride_bytes": int(t.stride(0) * t.element_size()),
                    "contiguous": bool(t.is_contiguous()),
                    "device": str(t.device),
                    "shape": [int(d) for d in t.shape],
                }
            )
        # On a GPU, kvbm's copies are ordered against the stream vLLM's
        # forward pass runs on (read at each step: vLLM may switch it).
        self._on_gpu = bool(self._tensors) and self._tensors[0].device.type == "cuda"
        if self._on_gpu:
            import torch

            self._current_stream = torch.cuda.current_stream
        ranks = self._parallel[0]
        rank = _tensor_parallel_rank() if ranks > 1 else 0
        self._worker = _kvbm.Worker(
            self._config_json, self._geometry, self._engine_id, json.dumps(described), rank, ranks
        )

    def _run(self, metadata: Any) -> None:
        if self._worker is None or not isinstance(metadata, KvbmMetadata):
            return
        # No bytes: an idle plan (most steps), nothing for kvbm to do.
        if not metadata.plan or getattr(metadata, "_kvbm_ran", False):
            return
        if self._on_gpu:
            stream = int(self._current_stream().cuda_stream)
            report, sending, errors = self._worker.run(metadata.plan, stream)
        else:
            report, sending, errors = self._worker.run(metadata.plan)
        if report:
            self._reports.append(report)
        self._finished_sending.update(sending)
        self._load_errors.update(errors)
        metadata._kvbm_ran = True  # noqa: SLF001 - our own marker

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # Called every step before the forward pass (and before vLLM may
        # write blocks it freed): the step's stores, then its loads, run
        # here.
        self._runs_at_preemptions = True
        self._run(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Older vLLMs without handle_preemptions: run the plan here.
        if not self._runs_at_preemptions and self._connector_metadata is not None:
            self._run(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        if self._worker is None:
            return None, None
        sending, self._finished_sending = self._finished_sending, set()
        return (sending or None), None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        if self._worker is None:
            return set()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        if self._worker is None:
            return None
        if self._on_gpu:
            # GPU copies are reported once they have run: those done since.
            late = self._worker.poll()
            if late:
                self._reports.append(late)
        reports, self._reports = self._reports, []
        return KvbmWorkerMetadata(reports=reports) if reports else None

    def shutdown(self) -> None:
        # Called twice in vLLM's engine core (see
        # `_finish_before_engine_teardown`): the second finds it stopped.
        if self._stopped:
            return
        self._stopped = True
        if self._sched is not None:
            self._tell_outputs()
            # The counters now (in case vLLM kills this process before the
            # shutdown below ends: it gives its engine core 5 s in all),
            # then the final ones: with `publish`, what the publisher sent
            # once it has drained (and what it lost, said here: nothing
            # else would tell).
            self._write_stats(force=True)
            final = self._sched.shutdown()
            if final:
                self._write_stats(force=True, text=final)
                stats = json.loads(final)
                pub = stats.get("publisher")
                if pub is not None:
                    lost = int(pub.get("tap_dropped", 0)) + int(pub.get("dropped", 0))
                    if lost:
                        logger.warning(
                            "kvbm: the NATS publisher lost %d of %d events (last error: %s)",
                            lost, stats.get("events_emitted"), pub.get("last_error"),
                        )
                    else:
                        logger.info("kvbm: published %d events to NATS", pub.get("events_sent", 0))
                ctl = stats.get("control")
                if ctl is not None and (ctl.get("malformed") or ctl.get("sessions_refused")):
                    logger.warning(
                        "kvbm: NATS control refused %d malformed requests and %d sessions, of %d requests",
                        ctl.get("malformed", 0), ctl.get("sessions_refused", 0), ctl.get("requests", 0),
                    )
        if self._worker is not None:
            self._worker.shutdown()


# In vLLM's front end too, which imports this module but builds no
# connector (see the function).
_finish_before_engine_teardown()
