"""TensorRT-LLM KV cache connector backed by kvstore (PyTorch backend).

Use it through ``kv_connector_config`` (see docs/trtllm.md)::

    kv_connector_config:
      connector_module: connectors.trtllm
      connector_scheduler_class: KVStoreConnectorScheduler
      connector_worker_class: KVStoreConnectorWorker
      server_url: 127.0.0.1:7480        # a kvstore serve; omit for an embedded Store

TensorRT-LLM runs the scheduler on rank 0 and a worker on every rank. A block is one
entry of the engine's primary pool (``kv_cache_tensor[block_id]``: all layers, K and
V of one rank's heads) and is saved and loaded whole, in place. Keys chain the token
ids of full blocks with the request's ``cache_salt`` (see ``_trtllm_plan``), then
add the TP rank, so equal prefixes meet across processes and restarts.

Without ``server_url`` the scheduler and the worker of one process share one
embedded Store (``$KVSTORE_CONFIG`` or the default); that only fits TP=1, where both
live in the same process, and is refused otherwise.

Loads are synchronous within the forward pass: TensorRT-LLM offers no way to report
a failed load of tokens the scheduler already promised, so a block that cannot be
loaded and verified raises instead of handing the engine stale KV. Leases taken at
lookup keep promised blocks from eviction until they are loaded.

Thread-safety: TensorRT-LLM calls each object from one executor thread; saves run on
the Store's pool and are tracked with futures.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, List, Tuple

try:
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
        KvCacheConnectorScheduler, KvCacheConnectorWorker)
except ImportError:
    try:  # TensorRT-LLM <= 1.2.x
        from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (KvCacheConnectorScheduler,
                                                                       KvCacheConnectorWorker)
    except ImportError as exc:  # pragma: no cover - exercised only without TensorRT-LLM
        raise ImportError("connectors.trtllm needs TensorRT-LLM (PyTorch backend) with the KV cache "
                          "connector API; see docs/trtllm.md") from exc

from connectors._open_store import open_store
from connectors._trtllm_plan import ConnectorMeta, KeyScheme, PendingMatch, RequestState, Transfer
from kvstore.errors import BufferSizeError, ConfigError, KVStoreError, RemoteError, StoreClosedError, TierError

log = logging.getLogger(__name__)
_STORE_FAILURES = (TierError, RemoteError, StoreClosedError, OSError)
_LEASE_S = 60.0

_shared_lock = threading.Lock()
_shared: dict[str, list] = {}   # server url or "" -> [store, refcount]


def _connector_config(llm_args: Any) -> Any:
    return getattr(llm_args, "kv_connector_config", None) or getattr(llm_args, "connector_config", None)


def _server_url(llm_args: Any) -> str | None:
    url = getattr(_connector_config(llm_args), "server_url", None)
    if not url:
        return None
    return url.split("://", 1)[-1].rstrip("/")


def _acquire_store(url: str | None) -> Any:
    """One Store/Client per process and server URL, shared by scheduler and worker."""
    with _shared_lock:
        entry = _shared.get(url or "")
        if entry is None:
            entry = _shared[url or ""] = [open_store({"server": url} if url else {}, owner="trtllm connector"), 0]
        entry[1] += 1
        return entry[0]


def _release_store(url: str | None) -> None:
    with _shared_lock:
        entry = _shared.get(url or "")
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _shared[url or ""]
            entry[0].close()


def _scheme(llm_args: Any) -> KeyScheme:
    kv_cfg = getattr(llm_args, "kv_cache_config", None)
    tokens_per_block = int(getattr(kv_cfg, "tokens_per_block", None) or 32)
    dtype = str(getattr(kv_cfg, "dtype", None) or "auto")
    tp = getattr(llm_args, "tensor_parallel_size", None)
    if tp is None:
        tp = getattr(getattr(llm_args, "parallel_config", None), "tp_size", 1)
    model = str(getattr(llm_args, "model", "") or "")
    if not model:
        raise ConfigError("trtllm connector: llm_args.model is empty; keys need a model name")
    return KeyScheme(model=model, dtype=dtype, tokens_per_block=tokens_per_block, world_size=int(tp or 1))


def _check_store_reach(llm_args: Any, scheme: KeyScheme) -> str | None:
    url = _server_url(llm_args)
    if url is None and scheme.world_size > 1:
        raise ConfigError("trtllm connector: with tensor parallelism the scheduler and the workers live in "
                          "different processes and must share a kvstore server; set "
                          "kv_connector_config.server_url")
    return url


class KVStoreConnectorScheduler(KvCacheConnectorScheduler):
    """Rank-0 side: finds stored prefixes and plans loads and saves per forward pass."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self.scheme = _scheme(llm_args)
        self._url = _check_store_reach(llm_args, self.scheme)
        self.store = _acquire_store(self._url)
        self._pending: dict[int, PendingMatch] = {}
        self._requests: dict[int, RequestState] = {}
        self._allocated: dict[int, list[int]] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        """Tokens after the device-matched ones that every rank has stored. At least one
        prompt token is always left for the engine to compute."""
        tokens = list(request.get_tokens(0))
        bs = self.scheme.tokens_per_block
        limit = max(len(tokens) - 1, 0) // bs
        first = num_computed_tokens // bs
        if limit <= first:
            self._pending.pop(request.request_id, None)
            return 0, False
        content = [k.digest for k in self.scheme.content_keys(tokens[:limit * bs], getattr(request, "cache_salt", None))]
        stored, leased = limit, []
        try:
            for rank in range(self.scheme.world_size):
                keys = self.scheme.rank_keys(content[:stored], rank)
                stored = min(stored, self.store.lookup(keys, lease_s=_LEASE_S))
                leased.append(keys)
        except _STORE_FAILURES as exc:
            log.warning("trtllm: kvstore lookup failed (%s); no tokens matched", exc)
            stored = 0
        if stored <= first:
            self._release(leased)
            self._pending.pop(request.request_id, None)
            return 0, False
        self._pending[request.request_id] = PendingMatch(first, stored, content[:stored], leased)
        return (stored - first) * bs, False

    def update_state_after_alloc(self, request: Any, block_ids: List[int]) -> None:
        self._allocated[request.request_id] = list(block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMeta:
        meta = ConnectorMeta()
        bs = self.scheme.tokens_per_block
        for data in scheduler_output.new_requests:
            pending = self._pending.pop(data.request_id, None)
            salt = getattr(data, "cache_salt", None)
            state = self._requests[data.request_id] = RequestState(salt=salt)
            state.tokens = list(data.new_tokens)
            state.block_ids = list(data.new_block_ids) or self._allocated.get(data.request_id, [])
            external = 0
            if pending is not None:
                external = (pending.stored - pending.first) * bs
                state.content = list(pending.content)
                for idx in range(pending.first, pending.stored):
                    meta.loads.append(Transfer(data.request_id, state.block_ids[idx], pending.content[idx]))
                state.saved_upto = pending.stored
            self._plan_saves(meta, data.request_id, state, data.computed_position + external + data.num_scheduled_tokens)
        for data in scheduler_output.cached_requests:
            state = self._requests.get(data.request_id)
            if state is None:
                continue
            state.tokens.extend(data.new_tokens)
            state.block_ids.extend(data.new_block_ids)
            self._plan_saves(meta, data.request_id, state, data.computed_position + data.num_scheduled_tokens)
        return meta

    def _plan_saves(self, meta: ConnectorMeta, request_id: int, state: RequestState, valid_tokens: int) -> None:
        """Save each block that is full once this forward pass has run."""
        bs = self.scheme.tokens_per_block
        full = min(valid_tokens, len(state.tokens), len(state.block_ids) * bs) // bs
        if full <= state.saved_upto:
            return
        content = state.content_upto(self.scheme, full)
        for idx in range(state.saved_upto, full):
            meta.saves.append(Transfer(request_id, state.block_ids[idx], content[idx]))
        state.saved_upto = full
        state.saves_scheduled = True

    def request_finished(self, request: Any, cache_block_ids: List[int]) -> bool:
        """True when saves were scheduled: the blocks stay allocated until every worker
        reports the request in ``get_finished``."""
        self._allocated.pop(request.request_id, None)
        pending = self._pending.pop(request.request_id, None)
        if pending is not None:
            self._release(pending.leased)
        state = self._requests.pop(request.request_id, None)
        return bool(state and state.saves_scheduled)

    def _release(self, leased: list) -> None:
        for keys in leased:
            try:
                self.store.release(keys)
            except _STORE_FAILURES:
                pass

    def close(self) -> None:
        """Drop this scheduler's reference to the shared Store/Client."""
        if self.store is not None:
            self.store = None
            _release_store(self._url)


class KVStoreConnectorWorker(KvCacheConnectorWorker):
    """Every rank: moves whole blocks between the engine's KV pool and kvstore."""

    def __init__(self, llm_args: Any, *, rank: int | None = None) -> None:
        super().__init__(llm_args)
        self.scheme = _scheme(llm_args)
        self._url = _check_store_reach(llm_args, self.scheme)
        if rank is None:
            from tensorrt_llm._utils import mpi_rank

            rank = mpi_rank()
        self.rank = int(rank) % self.scheme.world_size
        self.store = _acquire_store(self._url)
        self.kv_cache: Any = None
        self._load: tuple[Future, list] | None = None
        self._saves: dict[int, list[Future]] = {}
        self._finishing: set[int] = set()
        self.counters = dict.fromkeys(("blocks_loaded", "blocks_saved", "blocks_save_failed"), 0)

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """``kv_cache_tensor``: the primary pool, ``(num_blocks, layers, kv_factor,
        tokens_per_block * heads * head_dim)``; the engine owns it."""
        if kv_cache_tensor.dim() < 2 or not kv_cache_tensor.is_contiguous():
            raise ConfigError(f"trtllm connector: expected one contiguous KV pool indexed by block id, got "
                              f"shape {tuple(kv_cache_tensor.shape)}")
        self.kv_cache = kv_cache_tensor

    def _keys(self, transfers: list[Transfer]) -> list:
        return self.scheme.rank_keys([t.content for t in transfers], self.rank)

    def start_load_kv(self, stream: Any) -> None:
        meta = self.get_connector_meta()
        if meta is None or not meta.loads:
            return
        dsts = [self.kv_cache[t.block_id] for t in meta.loads]
        try:
            self._load = (self.store.load(self._keys(meta.loads), dsts), meta.loads)
        except BufferSizeError as exc:
            raise KVStoreError(f"trtllm connector: stored blocks do not match this engine's block size: {exc}") from exc

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Blocks hold all layers, so the first call waits for the whole load."""
        if self._load is None:
            return
        future, transfers = self._load
        self._load = None
        try:
            ok = future.result()
        except _STORE_FAILURES as exc:
            raise KVStoreError(f"trtllm connector: loading {len(transfers)} promised blocks failed: {exc}") from exc
        bad = [t.block_id for t, good in zip(transfers, ok) if not good]
        if bad:
            raise KVStoreError(f"trtllm connector: blocks {bad} could not be loaded and verified; refusing to run "
                               "the forward pass on stale KV")
        self.counters["blocks_loaded"] += len(transfers)

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Nothing per layer: whole blocks are saved once the forward pass is done."""

    def wait_for_save(self, stream: Any) -> None:
        """Start saving this pass's full blocks once the forward pass has finished;
        the saves run on the Store's pool and are awaited in :meth:`get_finished`."""
        meta = self.get_connector_meta()
        if meta is None or not meta.saves:
            return
        if stream is not None and hasattr(stream, "synchronize"):
            stream.synchronize()
        by_request: dict[int, list[Transfer]] = {}
        for t in meta.saves:
            by_request.setdefault(t.request_id, []).append(t)
        for request_id, transfers in by_request.items():
            srcs = [self.kv_cache[t.block_id] for t in transfers]
            try:
                future = self.store.save(self._keys(transfers), srcs)
            except _STORE_FAILURES as exc:
                log.warning("trtllm: saving %d blocks failed: %s", len(transfers), exc)
                self.counters["blocks_save_failed"] += len(transfers)
                continue
            self._saves.setdefault(request_id, []).append(future)

    def get_finished(self, finished_gen_req_ids: List[int],
                     started_loading_req_ids: List[int]) -> Tuple[List[int], List[int]]:
        """(requests whose saves are done, requests whose async loads are done). Loads
        are synchronous here, so any request said to be loading is done."""
        self._finishing.update(finished_gen_req_ids)
        done = []
        for request_id in sorted(self._finishing):
            futures = self._saves.get(request_id, [])
            if all(f.done() for f in futures):
                for f in futures:
                    self._count_save(f)
                self._saves.pop(request_id, None)
                done.append(request_id)
        self._finishing.difference_update(done)
        return done, list(started_loading_req_ids)

    def _count_save(self, future: Future) -> None:
        try:
            ok = future.result()
        except _STORE_FAILURES as exc:
            log.warning("trtllm: a block save failed: %s", exc)
            self.counters["blocks_save_failed"] += 1
            return
        self.counters["blocks_saved"] += sum(ok)
        self.counters["blocks_save_failed"] += len(ok) - sum(ok)

    def close(self) -> None:
        """Wait for saves in flight, then drop this worker's reference to the Store."""
        for futures in self._saves.values():
            for f in futures:
                self._count_save(f)
        self._saves.clear()
        if self.store is not None:
            self.store = None
            _release_store(self._url)


__all__ = ["ConnectorMeta", "KVStoreConnectorScheduler", "KVStoreConnectorWorker"]
