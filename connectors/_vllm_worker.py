"""Worker side of the vLLM connector: moves whole chunks between vLLM's paged KV
blocks and the store.

A stored chunk is ``blocks_per_chunk`` blocks of every layer, as raw page bytes laid
out ``[layer][block][page]`` (see :class:`kvstore.paged.PagedLayers`); the namespace
carries the layout, so bytes are only ever loaded into caches of the same layout.

Loads fail closed: a chunk is scattered into vLLM's blocks only when the store reports
it loaded (verified), and never after a chunk of the same request that failed; the
blocks of every chunk not scattered are reported through
:meth:`WorkerSide.take_load_errors` so vLLM recomputes them.

Pages are gathered and scattered on the caches' own device; with device (CUDA) caches the
chunks cross to host staging (pinned) in one copy per transfer, which the store reads
or fills.

Threading: vLLM calls every hook from the worker's main thread. Store futures complete
on store threads; their callbacks only return staging buffers to the pool.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from connectors._vllm_config import KVShape, VllmConnectorConfig
from connectors._vllm_meta import ChunkTransfer, KVStoreConnectorMetadata
from kvstore.errors import ConfigError, KVStoreError
from kvstore.paged import PagedLayers

log = logging.getLogger(__name__)


class StagingPool:
    """Reusable buffers for chunks in flight (first-touching fresh memory is slow, so
    buffers are kept and reused); host buffers are pinned when ``pin``. Thread-safe."""

    def __init__(self, device: torch.device, *, pin: bool = False) -> None:
        self.device = device
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly ``nbytes`` (a view of a pooled one); return it with
        :meth:`give` once nothing reads or writes it."""
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._free.remove(buf)
                return buf[:nbytes]
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device, pin_memory=self.pin)
        return buf[:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        with self._lock:
            self._free.append(base)


@dataclass
class _Load:
    spec: ChunkTransfer
    ids: torch.Tensor            # [n, blocks_per_chunk]
    buf: torch.Tensor            # host staging, n * chunk_bytes
    future: Future | None        # None: failed before submission
    ok: list[bool] | None = None
    layers_done: int = 0
    dev: torch.Tensor | None = None   # device copy of the verified chunks (device caches)


@dataclass
class _Save:
    spec: ChunkTransfer
    ids: torch.Tensor
    buf: torch.Tensor            # host staging handed to the store
    target: torch.Tensor         # where pages are gathered: ``buf``, or a device buffer
    layers: set[int]


class WorkerSide:
    def __init__(self, config: VllmConnectorConfig, shape: KVShape, store: Any, rank: int) -> None:
        self.config = config
        self.shape = shape
        self.store = store
        self.rank = rank
        self.pages: PagedLayers | None = None
        self._layer_index: dict[str, int] = {}
        self._pool: StagingPool | None = None          # host staging
        self._dev_pool: StagingPool | None = None      # device staging (device caches only)
        self._loads: list[_Load] = []            # sync loads of this step (layer-wise)
        self._async_loads: list[_Load] = []
        self._saves: list[_Save] = []            # saves gathered during this step
        self._save_futures: dict[str, list[Future]] = {}
        self._finishing: set[str] = set()        # finished requests whose saves are pending
        self._errors: set[int] = set()

    # -- setup ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Index the per-layer caches in model order; layers sharing one tensor are moved
        once. Works for any layout: pages are raw bytes."""
        unique: dict[tuple, int] = {}
        tensors: list[torch.Tensor] = []
        names = [n for n in self.shape.layer_names if n in kv_caches] or sorted(kv_caches)
        for name in names:
            t = kv_caches[name]
            ident = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
            if ident not in unique:
                unique[ident] = len(tensors)
                tensors.append(t)
            self._layer_index[name] = unique[ident]
        if not tensors:
            raise ConfigError("register_kv_caches: vLLM passed no KV cache tensors")
        page_dim, ratio = _page_dim(tensors[0], num_blocks)
        self.pages = PagedLayers(tensors, blocks_per_chunk=self.shape.blocks_per_chunk,
                                 page_dim=page_dim, pages_per_block=ratio)
        device = self.pages.device
        self._pool = StagingPool(torch.device("cpu"), pin=device.type == "cuda")
        self._dev_pool = StagingPool(device) if device.type != "cpu" else None

    # -- loads ----------------------------------------------------------------------------

    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        for spec in meta.loads:
            load = self._submit_load(spec)
            if spec.is_async:
                self._async_loads.append(load)
            elif self.config.layerwise:
                self._loads.append(load)
            else:
                self._finish_load(load, layers=None)

    def wait_for_layer(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for load in self._loads:
            self._finish_load(load, layers=[layer])

    def finish_step_loads(self) -> None:
        """Scatter whatever a layer-wise step did not ask for (layers without a hook)."""
        for load in self._loads:
            self._finish_load(load, layers=None)
        self._loads = []

    def _submit_load(self, spec: ChunkTransfer) -> _Load:
        pages = self._pages()
        n = len(spec.block_ids)
        ids = torch.tensor(spec.block_ids, dtype=torch.long).view(n, self.shape.blocks_per_chunk)
        buf = self._pool.take(n * pages.chunk_bytes)
        keys = spec.keys_for(self.rank)
        try:
            future = self.store.load(keys, [buf[i * pages.chunk_bytes:(i + 1) * pages.chunk_bytes] for i in range(n)])
        except KVStoreError as exc:
            log.warning("request %s: load of %d chunks refused: %s", spec.req_id, n, exc)
            future = None
        return _Load(spec, ids, buf, future)

    def _finish_load(self, load: _Load, layers: list[int] | None) -> None:
        """Wait for the store, then scatter verified chunks (the requested layers, or
        all remaining ones). Failed chunks and everything after them become load errors."""
        pages = self._pages()
        if load.ok is None:
            load.ok = self._load_result(load)
            good = _prefix_len(load.ok)
            for c in range(good, len(load.ok)):
                skip = load.spec.skip_blocks if c == 0 else 0
                self._errors.update(load.spec.block_ids[c][skip:])
        good = _prefix_len(load.ok)
        if load.buf is None:
            return                      # finished earlier, or abandoned after a timeout
        if good == 0:
            self._pool.give(load.buf)
            load.buf = None
            return
        todo = range(pages.num_layers) if layers is None else layers
        ids, keep = load.ids[:good], _keep_mask(good, self.shape.blocks_per_chunk, load.spec.skip_blocks)
        src = load.buf[: good * pages.chunk_bytes]
        if self._dev_pool is not None:
            if load.dev is None:
                load.dev = self._dev_pool.take(src.numel())
                load.dev.copy_(src)
            src = load.dev
        if layers is None and load.layers_done == 0:
            pages.scatter(ids, src, keep=keep)
            load.layers_done = (1 << pages.num_layers) - 1
        else:
            for layer in todo:
                if not load.layers_done >> layer & 1:
                    pages.scatter_layer(layer, ids, src, keep=keep)
                    load.layers_done |= 1 << layer
        if load.layers_done == (1 << pages.num_layers) - 1:
            self._pool.give(load.buf)
            load.buf = None
            if load.dev is not None:
                self._dev_pool.give(load.dev)
                load.dev = None

    def _load_result(self, load: _Load) -> list[bool]:
        n = len(load.spec.block_ids)
        if load.future is None:
            return [False] * n
        try:
            ok = load.future.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            # The store may still write into the buffer: never hand it out again.
            log.warning("request %s: load timed out after %.1f s", load.spec.req_id, self.config.timeout_s)
            load.buf = None
            return [False] * n
        except Exception as exc:  # a store or transport failure: fail closed
            log.warning("request %s: load failed: %s", load.spec.req_id, exc)
            return [False] * n
        return list(ok)

    def finished_loads(self) -> set[str]:
        """Requests whose async loads are complete (scattered or reported as errors)."""
        done = set()
        for load in list(self._async_loads):
            if load.future is None or load.future.done():
                self._finish_load(load, layers=None)
                self._async_loads.remove(load)
                done.add(load.spec.req_id)
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ----------------------------------------------------------------------------

    def save_layer(self, layer_name: str, meta: KVStoreConnectorMetadata) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None or not meta.saves:
            return
        for save in self._step_saves(meta):
            if layer not in save.layers:
                self._pages().gather_layer(layer, save.ids, save.target)
                save.layers.add(layer)

    def wait_for_save(self, meta: KVStoreConnectorMetadata) -> None:
        """Gather this step's new chunks (layers not gathered yet) and hand them to the
        store; with ``save_async`` off, wait until stored."""
        pages = self._pages()
        for save in self._step_saves(meta):
            if not save.layers:
                pages.gather(save.ids, save.target)
            else:
                for layer in range(pages.num_layers):
                    if layer not in save.layers:
                        pages.gather_layer(layer, save.ids, save.target)
            if save.target is not save.buf:
                save.buf.copy_(save.target)     # device -> host; the blocks are free after this
                self._dev_pool.give(save.target)
            n, cb = len(save.spec.block_ids), pages.chunk_bytes
            try:
                future = self.store.save(save.spec.keys_for(self.rank),
                                         [save.buf[i * cb:(i + 1) * cb] for i in range(n)])
            except KVStoreError as exc:
                log.warning("request %s: save refused: %s", save.spec.req_id, exc)
                self._pool.give(save.buf)
                continue
            buf, pool = save.buf, self._pool
            future.add_done_callback(lambda f, buf=buf, req=save.spec.req_id: _saved(f, buf, pool, req))
            self._save_futures.setdefault(save.spec.req_id, []).append(future)
            if not self.config.save_async:
                _wait(future, self.config.timeout_s, save.spec.req_id)
        self._saves = []

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose saves are all done. Only with ``save_async``: then
        the scheduler side kept their blocks (``request_finished`` returned True) and
        frees them when every worker reports them here."""
        if not self.config.save_async:
            for req_id in finished_req_ids:
                self._save_futures.pop(req_id, None)
            return set()
        self._finishing |= {r for r in finished_req_ids if r in self._save_futures}
        done = set()
        for req_id in list(self._finishing):
            if all(f.done() for f in self._save_futures[req_id]):
                del self._save_futures[req_id]
                self._finishing.discard(req_id)
                done.add(req_id)
        for req_id, futures in self._save_futures.items():
            if req_id not in self._finishing:
                futures[:] = [f for f in futures if not f.done()]
        return done

    def close(self, timeout_s: float) -> None:
        for futures in self._save_futures.values():
            for f in futures:
                _wait(f, timeout_s, "shutdown")

    # -- internals ------------------------------------------------------------------------

    def _step_saves(self, meta: KVStoreConnectorMetadata) -> list[_Save]:
        if not self._saves and meta.saves:
            pages = self._pages()
            for spec in meta.saves:
                n = len(spec.block_ids)
                ids = torch.tensor(spec.block_ids, dtype=torch.long).view(n, self.shape.blocks_per_chunk)
                buf = self._pool.take(n * pages.chunk_bytes)
                target = buf if self._dev_pool is None else self._dev_pool.take(buf.numel())
                self._saves.append(_Save(spec, ids, buf, target, set()))
        return self._saves

    def _pages(self) -> PagedLayers:
        if self.pages is None:
            raise ConfigError("the kvstore connector got KV transfers before register_kv_caches")
        return self.pages


def _page_dim(t: torch.Tensor, num_blocks: int) -> tuple[int, int]:
    """The dim indexing blocks (vLLM 0.33: dim 0 of ``[B, H, N, C]``) and how many
    kernel pages make one block."""
    for d, size in enumerate(t.shape):
        if num_blocks and size >= num_blocks and size % num_blocks == 0:
            return d, size // num_blocks
    raise ConfigError(f"cannot find the block dim of a KV cache of shape {tuple(t.shape)} "
                      f"for {num_blocks} blocks")


def _prefix_len(ok: list[bool]) -> int:
    n = 0
    for hit in ok:
        if not hit:
            break
        n += 1
    return n


def _keep_mask(n: int, per_chunk: int, skip: int) -> torch.Tensor | None:
    if not skip:
        return None
    keep = torch.ones(n, per_chunk, dtype=torch.bool)
    keep[0, :skip] = False
    return keep


def _saved(future: Future, buf: torch.Tensor, pool: StagingPool, req_id: str) -> None:
    pool.give(buf)
    if future.exception() is not None:
        log.warning("request %s: save failed: %s", req_id, future.exception())


def _wait(future: Future, timeout_s: float, what: str) -> None:
    try:
        future.result(timeout=timeout_s)
    except Exception as exc:  # saves are best-effort: a failed save is only a lost hit
        log.warning("%s: save did not complete: %s", what, exc)


__all__ = ["StagingPool", "WorkerSide"]
