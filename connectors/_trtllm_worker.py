"""The TensorRT-LLM connector's worker (one per rank): moves whole blocks of the engine's
primary pool between the pool and the store on the runtime's stream, through bounded
host staging (see :mod:`connectors.trtllm` for the whole connector)."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, List, Sequence, Tuple

from kvstore.connectors._metrics import ConnectorMetrics
from kvstore.connectors._trtllm_base import (STAGING_BYTES, STORE_FAILURES, KvCacheConnectorWorker, acquire_store,
                                     check_store_reach, load_staging_bytes, on_stream, record_event, release_store,
                                     scheme_of)
from kvstore.connectors._trtllm_plan import LOCAL, HostStaging, PoolLayout, Transfer
from kvstore.errors import BufferSizeError, ConfigError, KVStoreError

log = logging.getLogger("kvstore.connectors.trtllm")


class KVStoreConnectorWorker(KvCacheConnectorWorker):
    """Every rank: moves whole blocks between the engine's KV pool and kvstore.

    ``staging_bytes`` bounds this worker's host staging (pinned where CUDA is
    available), split in a load half and a save half so queued saves never take what
    a promised load needs. A load larger than the load half moves in staging-sized
    groups; a save that does not fit is dropped and counted, never allocated."""

    def __init__(self, llm_args: Any, *, rank: int | None = None, staging_bytes: int = STAGING_BYTES) -> None:
        super().__init__(llm_args)
        self.scheme = scheme_of(llm_args)
        self._url = check_store_reach(llm_args, self.scheme)
        if rank is None:
            from tensorrt_llm._utils import mpi_rank

            rank = mpi_rank()
        self.rank = int(rank) % self.scheme.world_size
        self.store = acquire_store(self._url)
        self.metrics = ConnectorMetrics(self.store, "trtllm")
        def held(_n: int) -> None:
            self.metrics.set("staging_bytes", self.load_staging.held_bytes + self.staging.held_bytes)

        self.load_staging = HostStaging(load_staging_bytes(staging_bytes), on_change=held)
        self.staging = HostStaging(int(staging_bytes) // 2, on_change=held)   # saves
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

    def register_kv_cache_layout(self, layout: Any) -> None:
        """KVCacheManagerV2's layout: accepted only as one pool (one group of one
        region). A second region (NVFP4's block scales, another layer group) holds KV
        state this connector would not move, so it is refused by name."""
        regions = [region for group in getattr(layout, "groups", []) for region in getattr(group, "regions", [])]
        if len(regions) != 1:
            raise ConfigError(f"trtllm connector: the KV cache layout has {len(regions)} pools (regions); only one "
                              "primary pool is supported (a block-scale pool, as NVFP4 KV keeps, or a second "
                              "layer group would not be moved)")
        super().register_kv_cache_layout(layout)

    def _keys(self, transfers: Sequence[Transfer]) -> list:
        return self.scheme.rank_keys([t.content for t in transfers], self.rank, self.layout)

    # -- loads --------------------------------------------------------------------------

    def start_load_kv(self, stream: Any) -> None:
        """Copy this pass's loads into their blocks, ordered on ``stream`` (the forward
        pass's), before the forward pass is enqueued. Blocks the scheduler staged
        (TP=1) are already verified; otherwise this rank loads its shard here, in
        groups its load staging holds (never failing for room), and, if a promised
        block cannot be loaded and verified, raises before the forward pass:
        TensorRT-LLM has no channel to report it (docs/trtllm.md)."""
        meta = self.get_connector_meta()
        if meta is None or not meta.loads:
            return
        self._reap()
        for group in meta.loads:
            if group.ticket is not None:
                claimed = LOCAL.claim(group.ticket)
                if claimed is None:
                    raise KVStoreError("trtllm connector: staged blocks for request "
                                       f"{group.request_id} are gone; refusing to run on unloaded KV")
                staging, bufs = claimed
                self._copy_in(stream, staging, bufs, [self.kv_cache[t.block_id] for t in group.transfers])
            else:
                per = max(1, self.load_staging.capacity_bytes // self.layout.block_nbytes)
                for lo in range(0, len(group.transfers), per):
                    part = group.transfers[lo:lo + per]
                    bufs = self._load_shard(group.request_id, part)
                    self._copy_in(stream, self.load_staging, bufs, [self.kv_cache[t.block_id] for t in part])
            self.metrics.add("loaded_tokens", group.tokens)

    def _take_load_staging(self, n: int) -> list:
        """``n`` load buffers; where copies still in flight hold them, waits for those."""
        bufs = self.load_staging.take(self.layout.block_nbytes, n)
        if bufs is None:
            self._reap(wait=True)
            bufs = self.load_staging.take(self.layout.block_nbytes, n)
        if bufs is None:   # only when not one block fits in the load half: a setting, not a request's load
            raise KVStoreError(f"trtllm connector: the load half of staging_bytes "
                               f"({self.load_staging.capacity_bytes}) holds no block of {self.layout.block_nbytes} "
                               "bytes; raise staging_bytes")
        return bufs

    def _load_shard(self, request_id: int, transfers: Sequence[Transfer]) -> list:
        n = len(transfers)
        bufs = self._take_load_staging(n)
        try:
            ok = list(self.store.load(self._keys(transfers), bufs).result())
        except (BufferSizeError, *STORE_FAILURES) as exc:
            ok, cause = [False] * n, exc
        else:
            cause = None
        if not all(ok):
            self.load_staging.give(bufs)
            self.metrics.add("failed_loads", ok.count(False))
            raise KVStoreError(f"trtllm connector: rank {self.rank} could not load and verify "
                               f"{ok.count(False)} promised blocks of request {request_id}; refusing to "
                               "run the forward pass on unloaded KV") from cause
        return bufs

    def _copy_in(self, stream: Any, staging: HostStaging, bufs: list, dsts: list) -> None:
        import torch

        with on_stream(stream):
            for buf, dst in zip(bufs, dsts):
                dst.view(torch.uint8).view(-1).copy_(buf, non_blocking=True)
            event = record_event(stream, dsts)
        self._in_flight.append((event, staging, bufs))

    def _reap(self, *, wait: bool = False) -> None:
        """Hand back staging buffers whose copies have completed (``wait``: wait for
        every copy in flight first)."""
        keep = []
        for event, staging, bufs in self._in_flight:
            if wait and event is not None:
                event.synchronize()
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
        by_request: dict[tuple, list[Transfer]] = {}
        for t in meta.saves:
            by_request.setdefault((t.request_id, t.hint), []).append(t)
        for (request_id, hint), transfers in by_request.items():
            bufs = self.staging.take(self.layout.block_nbytes, len(transfers))
            if bufs is None:
                self.metrics.add("dropped_saves", len(transfers))
                continue
            srcs = [self.kv_cache[t.block_id] for t in transfers]
            event = self._copy_out(stream, srcs, bufs)
            self._saves.setdefault(request_id, []).append(self._submit_save(self._keys(transfers), bufs, event, hint))

    def _copy_out(self, stream: Any, srcs: list, bufs: list) -> Any:
        import torch

        with on_stream(stream):
            for src, buf in zip(srcs, bufs):
                buf.copy_(src.view(torch.uint8).view(-1), non_blocking=True)
            event = record_event(stream, srcs)
        return event

    def _submit_save(self, keys: list, bufs: list, event: Any, hint: Any = None) -> Future:
        def run() -> list[bool]:
            try:
                if event is not None:
                    event.synchronize()
                return list(self.store.save(keys, bufs, hint=hint).result())
            finally:
                self.staging.give(bufs)

        if event is None:              # the copy is done (host tensors): no thread needed
            try:
                future = self.store.save(keys, bufs, hint=hint)
            except STORE_FAILURES as exc:
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
        except (KVStoreError, *STORE_FAILURES) as exc:
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
        self.load_staging.clear()
        self.metrics.close()
        store, self.store = self.store, None
        release_store(store)

    shutdown = close


__all__ = ["KVStoreConnectorWorker"]
