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

Failed loads fail closed *before the promise*: TensorRT-LLM's connector API has no way
to report a failed load or fail one request once ``get_num_new_matched_tokens`` has
answered (``get_finished`` carries only finished ids). So where the scheduler shares
its process with the only worker (TP=1), it loads and verifies the blocks into host
staging *before* it answers, and offers only the verified prefix; the worker's part
is a host-to-device copy on the runtime's stream. With TP>1 every rank's blocks are
leased at lookup; a rank that still cannot load raises from ``start_load_kv``, before
the forward pass (never inside it). See docs/trtllm.md, "Failure behaviour".

Thread-safety: TensorRT-LLM calls each object from one executor thread; saves run on
a saver thread and the Store's pool and are tracked with futures.
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, List, Sequence, Tuple

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

from connectors._metrics import ConnectorMetrics
from connectors._open_store import open_store
from connectors._trtllm_plan import (LOCAL, ConnectorMeta, HostStaging, KeyScheme, LoadGroup, PendingMatch, PoolLayout,
                                     RequestState, Transfer)
from kvstore.errors import BufferSizeError, ConfigError, KVStoreError, RemoteError, StoreClosedError, TierError

log = logging.getLogger(__name__)
_STORE_FAILURES = (TierError, RemoteError, StoreClosedError, OSError)
_LEASE_S = 60.0
STAGING_BYTES = 256 << 20   # host staging per connector object (scheduler, each worker)

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


def _text(value: Any) -> str:
    """A setting as key text: enums by name, ``None`` as empty."""
    if value is None:
        return ""
    return str(getattr(value, "name", None) or getattr(value, "value", None) or value)


def _scheme(llm_args: Any) -> KeyScheme:
    """Every setting in ``llm_args`` that changes a block's bytes; the pool's resolved
    dtype and shape are added per rank (``PoolLayout``)."""
    kv_cfg = getattr(llm_args, "kv_cache_config", None)
    tokens_per_block = int(getattr(kv_cfg, "tokens_per_block", None) or 32)
    kv_dtype = _text(getattr(kv_cfg, "dtype", None)) or "auto"
    tp = getattr(llm_args, "tensor_parallel_size", None)
    if tp is None:
        tp = getattr(getattr(llm_args, "parallel_config", None), "tp_size", 1)
    pp = int(getattr(llm_args, "pipeline_parallel_size", None) or 1)
    if pp > 1:
        raise ConfigError("trtllm connector: pipeline parallelism is not supported (TensorRT-LLM's KV cache "
                          "connector does not support it either)")
    model = str(getattr(llm_args, "model", "") or "")
    if not model:
        raise ConfigError("trtllm connector: llm_args.model is empty; keys need a model name")
    quant = getattr(llm_args, "quant_config", None)
    fields = (("revision", _text(getattr(llm_args, "revision", None))),
              ("model_dtype", _text(getattr(llm_args, "dtype", None)) or "auto"),
              ("quant_algo", _text(getattr(quant, "quant_algo", None))),
              ("kv_cache_quant_algo", _text(getattr(quant, "kv_cache_quant_algo", None))),
              ("tp", str(int(tp or 1))), ("pp", str(pp)))
    return KeyScheme(model=model, dtype=kv_dtype, tokens_per_block=tokens_per_block, world_size=int(tp or 1),
                     fields=fields)


def _check_store_reach(llm_args: Any, scheme: KeyScheme) -> str | None:
    url = _server_url(llm_args)
    if url is None and scheme.world_size > 1:
        raise ConfigError("trtllm connector: with tensor parallelism the scheduler and the workers live in "
                          "different processes and must share a kvstore server; set "
                          "kv_connector_config.server_url")
    return url


def _leading(ok: Sequence[bool]) -> int:
    n = 0
    for good in ok:
        if not good:
            break
        n += 1
    return n


class KVStoreConnectorScheduler(KvCacheConnectorScheduler):
    """Rank-0 side: finds stored prefixes and plans loads and saves per forward pass.

    ``staging_bytes`` bounds the host memory holding blocks loaded and verified before
    they are offered (TP=1); an offer is cut to what fits."""

    def __init__(self, llm_args: Any, *, staging_bytes: int = STAGING_BYTES) -> None:
        super().__init__(llm_args)
        self.scheme = _scheme(llm_args)
        self._url = _check_store_reach(llm_args, self.scheme)
        self.store = _acquire_store(self._url)
        self.metrics = ConnectorMetrics(self.store, "trtllm")
        self.staging = HostStaging(staging_bytes, on_change=lambda n: self.metrics.set("staging_bytes", n))
        self._pending: dict[int, PendingMatch] = {}
        self._requests: dict[int, RequestState] = {}
        self._allocated: dict[int, list[int]] = {}

    # -- matching ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        """Tokens after the ``num_computed_tokens`` the engine holds (block-aligned or
        not: partial block reuse) that every rank has stored: ``stored * block_size -
        num_computed_tokens``. With TP=1 the blocks are loaded and verified into host
        staging first and only the verified prefix is offered. At least one prompt
        token is always left for the engine to compute. A repeated query for the same
        request replaces (and releases) the previous answer."""
        rid = request.request_id
        self._drop_pending(rid)
        layout = LOCAL.layout(self._url or "")
        if layout is None:             # no worker of this process has registered its pool yet
            return 0, False
        bs = self.scheme.tokens_per_block
        tokens = list(request.get_tokens(0))
        limit = max(len(tokens) - 1, 0) // bs
        if limit * bs <= num_computed_tokens:
            return 0, False
        first = num_computed_tokens // bs
        content = [k.digest for k in self.scheme.content_keys(tokens[:limit * bs], getattr(request, "cache_salt", None))]
        stored, leased = limit, []
        try:
            for rank in self.scheme.storing_ranks(layout):
                keys = self.scheme.rank_keys(content[:stored], rank, layout)
                found = self.store.lookup(keys, lease_s=_LEASE_S)
                leased.append(keys[:found])
                stored = min(stored, found)
        except _STORE_FAILURES as exc:
            log.warning("trtllm: kvstore lookup failed (%s); no tokens matched", exc)
            stored = 0
        ticket = None
        if stored * bs > num_computed_tokens and self._stages_here():
            stored, ticket = self._stage(leased[0][first:stored], layout, first)
            self._release(leased)      # verified bytes are in hand: no lease needed
            leased = []
        if stored * bs <= num_computed_tokens:
            self._release(leased)
            return 0, False
        self._release([keys[stored:] for keys in leased])
        leased = [keys[:stored] for keys in leased]
        matched = stored * bs - num_computed_tokens
        self._pending[rid] = PendingMatch(num_computed_tokens, first, stored, content[:stored], leased,
                                          accepted_end=stored * bs, ticket=ticket)
        self.metrics.add("hit_tokens", matched)
        return matched, False

    def _stages_here(self) -> bool:
        """Whether the only worker lives in this process (TP=1), so blocks loaded here
        are the ones it copies in."""
        return self.scheme.world_size == 1 and LOCAL.has_rank(self._url or "", 0)

    def _stage(self, keys: list, layout: PoolLayout, first: int) -> tuple[int, int | None]:
        """Load ``keys`` (blocks ``first``...) into host staging and verify them; the
        leading verified blocks, parked for the worker under a ticket."""
        count = len(keys)
        bufs = self.staging.take(layout.block_nbytes, count)
        while bufs is None and count > 1:
            count //= 2
            bufs = self.staging.take(layout.block_nbytes, count)
        if bufs is None:
            return first, None
        try:
            ok = list(self.store.load(keys[:count], bufs).result())
        except BufferSizeError as exc:
            log.error("trtllm: stored blocks do not match this engine's pool layout (%s); not offered", exc)
            ok = [False] * count
        except _STORE_FAILURES as exc:
            log.warning("trtllm: loading %d blocks failed (%s); they are recomputed", count, exc)
            ok = [False] * count
        good = _leading(ok)
        self.metrics.add("failed_loads", ok.count(False))
        self.staging.give(bufs[good:])
        if good == 0:
            return first, None
        return first + good, LOCAL.park(self.staging, bufs[:good])

    # -- what the runtime accepted ----------------------------------------------------

    def cancel_load(self, request: Any, start: int, end: int) -> None:
        """The runtime will not consume the offered tokens ``[start, end)`` (absolute
        prompt positions): it could not allocate for them, or the request went away."""
        pending = self._pending.get(request.request_id)
        if pending is None or end <= start:
            return
        if start <= pending.num_computed:
            self._drop_pending(request.request_id)
            return
        pending.accepted_end = min(pending.accepted_end, start)

    def update_state_after_alloc(self, request: Any, block_ids: List[int]) -> None:
        self._allocated[request.request_id] = list(block_ids)
        accepted = getattr(request, "py_num_connector_matched_tokens", None)
        pending = self._pending.get(request.request_id)
        if pending is not None and isinstance(accepted, int) and not isinstance(accepted, bool):
            pending.accepted_end = min(pending.accepted_end, pending.num_computed + max(accepted, 0))

    def request_reset(self, request: Any) -> None:
        """The request's pages were released and it will run again from the start."""
        self._drop_pending(request.request_id)
        self._requests.pop(request.request_id, None)
        self._allocated.pop(request.request_id, None)

    # -- planning -----------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMeta:
        meta = ConnectorMeta()
        for data in scheduler_output.new_requests:
            rid = data.request_id
            pending = self._pending.pop(rid, None)
            state = self._requests[rid] = RequestState(salt=getattr(data, "cache_salt", None))
            state.tokens = list(data.new_tokens)
            state.block_ids = list(data.new_block_ids) or self._allocated.get(rid, [])
            external = 0
            if pending is not None:
                external = self._plan_load(meta, rid, state, pending)
            self._plan_saves(meta, rid, state, data.computed_position + external + data.num_scheduled_tokens)
        for data in scheduler_output.cached_requests:
            state = self._requests.get(data.request_id)
            if state is None:
                continue
            state.tokens.extend(data.new_tokens)
            state.block_ids.extend(data.new_block_ids)
            self._plan_saves(meta, data.request_id, state, data.computed_position + data.num_scheduled_tokens)
        return meta

    def _plan_load(self, meta: ConnectorMeta, rid: int, state: RequestState, pending: PendingMatch) -> int:
        """Loads for the accepted part of ``pending``; returns the tokens it covers."""
        bs = self.scheme.tokens_per_block
        last = min(math.ceil(pending.accepted_end / bs), pending.stored, len(state.block_ids))
        ids = state.block_ids
        while last > pending.first and any(ids[i] < 0 for i in range(pending.first, last)):
            last -= 1                  # a block with no page (-1) is never a load target
        last = max(last, pending.first)
        self._release([keys[last:] for keys in pending.leased])
        count = last - pending.first
        ticket = self._trim_ticket(pending.ticket, count)
        if count == 0:
            return 0
        transfers = [Transfer(rid, ids[i], pending.content[i]) for i in range(pending.first, last)]
        tokens = min(pending.accepted_end, last * bs) - pending.num_computed
        meta.loads.append(LoadGroup(rid, transfers, tokens, ticket))
        state.content = list(pending.content[:last])
        state.saved_upto = last
        return tokens

    def _trim_ticket(self, ticket: int | None, count: int) -> int | None:
        if ticket is None:
            return None
        claimed = LOCAL.claim(ticket)
        if claimed is None:
            return None
        staging, bufs = claimed
        staging.give(bufs[count:])
        return LOCAL.park(staging, bufs[:count]) if count else None

    def _plan_saves(self, meta: ConnectorMeta, request_id: int, state: RequestState, valid_tokens: int) -> None:
        """Save each block that is full once this forward pass has run."""
        bs = self.scheme.tokens_per_block
        full = min(valid_tokens, len(state.tokens), len(state.block_ids) * bs) // bs
        if full <= state.saved_upto:
            return
        content = state.content_upto(self.scheme, full)
        for idx in range(state.saved_upto, full):
            if state.block_ids[idx] >= 0:
                meta.saves.append(Transfer(request_id, state.block_ids[idx], content[idx]))
        state.saved_upto = full
        state.saves_scheduled = True

    # -- finishing ----------------------------------------------------------------------

    def request_finished(self, request: Any, cache_block_ids: List[int]) -> bool:
        """True when saves were scheduled: the blocks stay allocated until every worker
        reports the request in ``get_finished``."""
        self._allocated.pop(request.request_id, None)
        self._drop_pending(request.request_id)
        state = self._requests.pop(request.request_id, None)
        return bool(state and state.saves_scheduled)

    def _drop_pending(self, rid: int) -> None:
        pending = self._pending.pop(rid, None)
        if pending is not None:
            self._release(pending.leased)
            self._trim_ticket(pending.ticket, 0)

    def _release(self, leased: list) -> None:
        for keys in leased:
            if not keys:
                continue
            try:
                self.store.release(keys)
            except _STORE_FAILURES:
                pass

    def close(self) -> None:
        """Release what pending answers hold; drop this scheduler's reference to the
        shared Store/Client."""
        if self.store is None:
            return
        for rid in list(self._pending):
            self._drop_pending(rid)
        self.staging.clear()
        self.metrics.close()
        self.store = None
        _release_store(self._url)

    shutdown = close


class KVStoreConnectorWorker(KvCacheConnectorWorker):
    """Every rank: moves whole blocks between the engine's KV pool and kvstore.

    ``staging_bytes`` bounds this worker's host staging (pinned where CUDA is
    available); a save that does not fit is dropped and counted, never allocated."""

    def __init__(self, llm_args: Any, *, rank: int | None = None, staging_bytes: int = STAGING_BYTES) -> None:
        super().__init__(llm_args)
        self.scheme = _scheme(llm_args)
        self._url = _check_store_reach(llm_args, self.scheme)
        if rank is None:
            from tensorrt_llm._utils import mpi_rank

            rank = mpi_rank()
        self.rank = int(rank) % self.scheme.world_size
        self.store = _acquire_store(self._url)
        self.metrics = ConnectorMetrics(self.store, "trtllm")
        self.staging = HostStaging(staging_bytes, on_change=lambda n: self.metrics.set("staging_bytes", n))
        self.kv_cache: Any = None
        self.layout: PoolLayout | None = None
        self._saves: dict[int, list[Future]] = {}
        self._finishing: set[int] = set()
        self._in_flight: list[tuple[Any, HostStaging, list]] = []   # (event, staging, buffers)
        self._saver: ThreadPoolExecutor | None = None

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """``kv_cache_tensor``: the primary pool, ``(num_blocks, layers, kv_factor,
        tokens_per_block * heads * head_dim)``; the engine owns it."""
        if kv_cache_tensor.dim() < 2 or not kv_cache_tensor.is_contiguous():
            raise ConfigError(f"trtllm connector: expected one contiguous KV pool indexed by block id, got "
                              f"shape {tuple(kv_cache_tensor.shape)}")
        self.kv_cache = kv_cache_tensor
        block = kv_cache_tensor[0]
        self.layout = PoolLayout(str(kv_cache_tensor.dtype), tuple(int(d) for d in block.shape),
                                 block.numel() * block.element_size())
        LOCAL.set_layout(self._url or "", self.rank, self.layout)

    def _keys(self, transfers: Sequence[Transfer]) -> list:
        return self.scheme.rank_keys([t.content for t in transfers], self.rank, self.layout)

    # -- loads --------------------------------------------------------------------------

    def start_load_kv(self, stream: Any) -> None:
        """Copy this pass's loads into their blocks, ordered on ``stream`` (the forward
        pass's), before the forward pass is enqueued. Blocks the scheduler staged
        (TP=1) are already verified; otherwise this rank loads its shard here and,
        if a promised block cannot be loaded and verified, raises before the forward
        pass: TensorRT-LLM has no channel to report it (docs/trtllm.md)."""
        meta = self.get_connector_meta()
        if meta is None or not meta.loads:
            return
        self._reap()
        for group in meta.loads:
            dsts = [self.kv_cache[t.block_id] for t in group.transfers]
            if group.ticket is not None:
                claimed = LOCAL.claim(group.ticket)
                if claimed is None:
                    raise KVStoreError("trtllm connector: staged blocks for request "
                                       f"{group.request_id} are gone; refusing to run on unloaded KV")
                staging, bufs = claimed
            else:
                staging, bufs = self.staging, self._load_shard(group)
            self._copy_in(stream, staging, bufs, dsts)
            self.metrics.add("loaded_tokens", group.tokens)

    def _load_shard(self, group: LoadGroup) -> list:
        n = len(group.transfers)
        bufs = self.staging.take(self.layout.block_nbytes, n)
        if bufs is None:
            self.metrics.add("failed_loads", n)
            raise KVStoreError(f"trtllm connector: no staging room for {n} promised blocks; raise staging_bytes")
        try:
            ok = list(self.store.load(self._keys(group.transfers), bufs).result())
        except (BufferSizeError, *_STORE_FAILURES) as exc:
            ok, cause = [False] * n, exc
        else:
            cause = None
        if not all(ok):
            self.staging.give(bufs)
            self.metrics.add("failed_loads", ok.count(False))
            raise KVStoreError(f"trtllm connector: rank {self.rank} could not load and verify "
                               f"{ok.count(False)} promised blocks of request {group.request_id}; refusing to "
                               "run the forward pass on unloaded KV") from cause
        return bufs

    def _copy_in(self, stream: Any, staging: HostStaging, bufs: list, dsts: list) -> None:
        import torch

        with _on(stream):
            for buf, dst in zip(bufs, dsts):
                dst.view(torch.uint8).view(-1).copy_(buf, non_blocking=True)
            event = _record(stream, dsts)
        self._in_flight.append((event, staging, bufs))

    def _reap(self) -> None:
        """Hand back staging buffers whose copies have completed."""
        keep = []
        for event, staging, bufs in self._in_flight:
            if event is None or event.query():
                staging.give(bufs)
            else:
                keep.append((event, staging, bufs))
        self._in_flight = keep

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Nothing to wait for: loads were enqueued on the forward stream before it."""

    # -- saves --------------------------------------------------------------------------

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Nothing per layer: whole blocks are saved once the forward pass is done."""

    def wait_for_save(self, stream: Any) -> None:
        """Copy this pass's full blocks into host staging, ordered after the forward
        pass on ``stream`` (no host synchronisation), and store them from a saver
        thread once the copy's event completes. Under MLA only rank 0 writes."""
        meta = self.get_connector_meta()
        if meta is None or not meta.saves:
            return
        self._reap()
        if self.layout.mla and self.rank != 0:
            return
        by_request: dict[int, list[Transfer]] = {}
        for t in meta.saves:
            by_request.setdefault(t.request_id, []).append(t)
        for request_id, transfers in by_request.items():
            bufs = self.staging.take(self.layout.block_nbytes, len(transfers))
            if bufs is None:
                self.metrics.add("dropped_saves", len(transfers))
                continue
            srcs = [self.kv_cache[t.block_id] for t in transfers]
            event = self._copy_out(stream, srcs, bufs)
            self._saves.setdefault(request_id, []).append(self._submit_save(self._keys(transfers), bufs, event))

    def _copy_out(self, stream: Any, srcs: list, bufs: list) -> Any:
        import torch

        with _on(stream):
            for src, buf in zip(srcs, bufs):
                buf.copy_(src.view(torch.uint8).view(-1), non_blocking=True)
            event = _record(stream, srcs)
        return event

    def _submit_save(self, keys: list, bufs: list, event: Any) -> Future:
        def run() -> list[bool]:
            try:
                if event is not None:
                    event.synchronize()
                return list(self.store.save(keys, bufs).result())
            finally:
                self.staging.give(bufs)

        if event is None:              # the copy is done (host tensors): no thread needed
            try:
                future = self.store.save(keys, bufs)
            except _STORE_FAILURES as exc:
                self.staging.give(bufs)
                failed: Future = Future()
                failed.set_exception(exc)
                return failed
            future.add_done_callback(lambda _f: self.staging.give(bufs))
            return future
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-trtllm-save")
        return self._saver.submit(run)

    def get_finished(self, finished_gen_req_ids: List[int],
                     started_loading_req_ids: List[int]) -> Tuple[List[int], List[int]]:
        """(requests whose saves are done, requests whose async loads are done). Loads
        are never asynchronous here, so any request said to be loading is done."""
        self._reap()
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
        except (KVStoreError, *_STORE_FAILURES) as exc:
            log.warning("trtllm: a block save failed: %s", exc)
            self.metrics.add("dropped_saves", 1)
            return
        self.metrics.add("dropped_saves", len(ok) - sum(ok))

    def close(self) -> None:
        """Wait for saves in flight, then drop this worker's reference to the Store."""
        if self.store is None:
            return
        for futures in self._saves.values():
            for f in futures:
                self._count_save(f)
        self._saves.clear()
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        for event, staging, bufs in self._in_flight:
            if event is not None:
                event.synchronize()
            staging.give(bufs)
        self._in_flight = []
        LOCAL.set_layout(self._url or "", self.rank, None)
        self.staging.clear()
        self.metrics.close()
        self.store = None
        _release_store(self._url)

    shutdown = close


def _on(stream: Any) -> Any:
    """Issue copies on ``stream`` when it is a CUDA stream; host copies need none."""
    import torch

    if stream is not None and torch.cuda.is_available() and isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return nullcontext()


def _record(stream: Any, tensors: list) -> Any:
    """An event after the copies just issued, or ``None`` when they were host copies
    (already complete)."""
    import torch

    if not tensors or tensors[0].device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.current_stream())
    return event


__all__ = ["ConnectorMeta", "KVStoreConnectorScheduler", "KVStoreConnectorWorker", "STAGING_BYTES"]
