"""kvstore for vLLM (0.33): a V1 KV connector, and a secondary tier for vLLM's own
offloading.

``KVStoreConnector`` is loaded by vLLM from its module path::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"server": "127.0.0.1:7480"}}'

vLLM builds one instance in the scheduler (engine-core) process and one in each
worker. The scheduler side answers prefix lookups from the store and plans which whole
chunks (``chunk_tokens`` tokens, a multiple of vLLM's block size) to load and save; the
worker side moves those chunks between vLLM's paged KV blocks and the store. Keys are
content hashes of the token prefix, namespaced by model, KV dtype and layout, parallel
rank and the request's cache salt / LoRA / multimodal inputs. Options: docs/vllm.md.

``KVStoreTier`` is a ``SecondaryTierManager`` that puts kvstore under vLLM's CPU tier
(``OffloadingConnector`` with ``TieringOffloadingSpec``); see :mod:`connectors._vllm_tier`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvstore.connectors._metrics import ConnectorMetrics
from kvstore.connectors._store_handle import open_store, release_store
from kvstore.connectors._vllm_config import KVShape, VllmConnectorConfig
from kvstore.connectors._vllm_meta import KVStoreConnectorMetadata, KVStoreWorkerMetadata
from kvstore.connectors._vllm_scheduler import SchedulerSide
from kvstore.connectors._vllm_tier import KVStoreTier
from kvstore.connectors._vllm_worker import WorkerSide
from kvstore.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector over a kvstore Store (embedded) or cache server.

    Thread-safety: vLLM calls each role's hooks from one thread; the store it talks to
    is thread-safe and may be shared (embedded mode shares one Store per config within
    a process).
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config
        self.config = VllmConnectorConfig.parse(tc.kv_connector_extra_config)
        self.shape = KVShape(vllm_config, kv_cache_config, self.config.chunk_tokens, self.config.model_id,
                             self.config.weights_version)
        do_save = self.config.save if self.config.save is not None else tc.is_kv_producer
        do_load = self.config.load if self.config.load is not None else tc.is_kv_consumer
        if self.config.store is not None:
            _check_embedded(vllm_config, self.shape)
        self.store = open_store({"store": self.config.store, "server": self.config.server,
                                 "token": self.config.token, "timeout_s": self.config.timeout_s,
                                 "tls": self.config.tls},
                                owner="vLLM kv_connector_extra_config")
        self.metrics = ConnectorMetrics(self.store, "vllm")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if getattr(tc, "kv_load_failure_policy", "fail") == "fail" and do_load:
                log.warning("kvstore connector: kv_load_failure_policy is 'fail', so a chunk that cannot be "
                            "loaded (evicted, corrupt, unreachable) fails its request; set "
                            "\"kv_load_failure_policy\": \"recompute\" to recompute it instead")
            self._scheduler = SchedulerSide(self.config, self.shape, self.store, self.metrics, do_load=do_load,
                                            do_save=do_save, producer=tc.kv_role == "kv_producer")
        else:
            tp_rank, key_rank = _worker_rank(vllm_config, self.shape)
            self._worker = WorkerSide(self.config, self.shape, self.store, self.metrics, key_rank,
                                      writes=self.shape.writes(tp_rank))

    # -- class-level answers --------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False   # a cache: a dropped save is only a future miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None    # any layout: pages move as bytes, the layout is in the namespace

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool((extra_config or {}).get("layerwise", False))

    # -- scheduler side -------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM's scheduler hands over its KV cache manager once built: the scheduler side
        evicts a failed sync load's blocks from vLLM's prefix cache through it."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._sched().request_finished(request, block_ids)

    def reset_cache(self) -> bool:
        """Called by vLLM's scheduler on ``reset_prefix_cache(reset_connector=True)``
        (weight updates, ``pause_generation(clear_cache=True)``); see
        :meth:`SchedulerSide.reset_cache`. ``False`` (vLLM then reports the reset as
        failed) where the store cannot drop this connector's namespaces; a worker-role
        instance has no keys to reset and answers ``False`` too."""
        if self._scheduler is None:
            return False
        return self._scheduler.reset_cache()

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._work().register_kv_caches(kv_caches, int(self._kv_cache_config.num_blocks))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and meta.loads:
            self._work().start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.config.layerwise:
            self._work().wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if self.config.layerwise and meta is not None:
            self._work().save_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        worker = self._work()
        worker.finish_step_loads()
        meta = self._meta()
        if meta is not None and meta.saves:
            worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        worker = self._work()
        meta = self._meta()
        if meta is not None:
            worker.note_holds(meta)
        return worker.finished_saves(finished_req_ids) or None, worker.finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._work()
        worker.finish_step_loads()    # after the forward; vLLM may ask before wait_for_save
        return worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVStoreWorkerMetadata | None:
        worker = self._work()
        worker.finish_step_loads()
        return worker.take_load_outcomes()

    def get_kv_connector_stats(self) -> None:
        return None    # counted in the store's stats()["connectors"]["vllm"]

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close(self.config.timeout_s)
        if self.store is not None:
            self.metrics.close()
            store, self.store = self.store, None
            release_store(store)

    # -- internals ------------------------------------------------------------------------

    def _meta(self) -> KVStoreConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVStoreConnectorMetadata) else None

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise ConfigError("scheduler-side hook called on a worker-role kvstore connector")
        return self._scheduler

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise ConfigError("worker-side hook called on a scheduler-role kvstore connector")
        return self._worker


def _check_embedded(vllm_config: Any, shape: KVShape) -> None:
    """Refuse an embedded ``store`` unless every worker runs in the scheduler's process:
    a worker in its own process would open a Store of its own, so saves would land in
    one Store and lookups ask another (never a hit, and nothing would say so)."""
    if shape.world_size > 1:
        # Workers of a TP/PP group are separate processes.
        raise ConfigError("the embedded 'store' is for single-process serving (TP=1, PP=1); "
                          f"this engine has {shape.world_size} workers: use 'server' (a kvstore serve "
                          "that the scheduler and the workers share)")
    backend = vllm_config.parallel_config.distributed_executor_backend
    if not _in_process(backend):
        name = backend if isinstance(backend, str) else getattr(backend, "__qualname__", repr(backend))
        raise ConfigError(f"the embedded 'store' needs vLLM's worker in the scheduler's process, but the "
                          f"executor backend is {name!r}, which runs the worker in a process of its own (vLLM's "
                          "CPU platform picks 'mp' even at TP=1): the two would hold different Stores and "
                          "never hit; use 'server' (a kvstore serve both processes share)")


def _in_process(backend: Any) -> bool:
    """Whether vLLM's executor ``backend`` (ParallelConfig.distributed_executor_backend, as
    resolved by VllmConfig) runs the worker in the scheduler's (engine-core) process: the
    uniprocess executors (``uni``, ``external_launcher`` and their subclasses) do; ``mp``,
    ``ray`` and anything else do not, or cannot be told to."""
    if backend in ("uni", "external_launcher"):
        return True
    if backend in (None, "mp", "ray"):
        return False        # None: not resolved yet, so not known to be in process
    try:
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        cls = resolve_obj_by_qualname(backend) if isinstance(backend, str) else backend
        return isinstance(cls, type) and issubclass(cls, UniProcExecutor)
    except Exception:   # an executor that cannot be resolved here is not known to be in process
        return False


def _worker_rank(vllm_config: Any, shape: KVShape) -> tuple[int, int]:
    """This worker's TP rank and which stored copy it reads and writes (see
    :meth:`KVShape.key_rank`)."""
    if shape.world_size == 1:
        return 0, 0
    from vllm.distributed.parallel_state import get_pcp_group, get_pp_group, get_tp_group

    pp_rank = get_pp_group().rank_in_group if shape.pp_size > 1 else 0
    pcp_rank = get_pcp_group().rank_in_group if shape.pcp_size > 1 else 0
    tp_rank = get_tp_group().rank_in_group
    return tp_rank, shape.key_rank(tp_rank, pp_rank, pcp_rank)


__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "KVStoreTier", "VllmConnectorConfig"]
