"""Worker side of the vLLM connector: moves whole chunks between vLLM's paged KV
blocks and the store.

A stored chunk is ``blocks_per_chunk`` blocks of every layer, as raw page bytes laid
out ``[layer][block][page]`` (see :class:`kvstore.paged.PagedLayers`); the namespace
carries the layout, so bytes are only ever loaded into caches of the same layout.

Loads fail closed: a chunk is scattered into vLLM's blocks only when the store reports
it loaded (verified), and never after a chunk of the same request that failed; the
blocks of every chunk not scattered are reported through
:meth:`WorkerSide.take_load_errors` so vLLM recomputes them.

Saves fail closed too: a chunk computed after a chunk of the same request that failed
to load on this worker is never stored (the scheduler side holds saves until every
rank's load outcome is in, see :mod:`connectors._vllm_scheduler`; this is the same rule
kept locally). Every load's outcome goes back to the scheduler in the step's worker
metadata.

Pages are gathered and scattered on the caches' own device; with device (CUDA) caches the
chunks cross to host staging (pinned) in one copy per transfer, which the store reads
or fills. Saves copy device->host on a side stream ordered after the engine's stream,
and reach the store from a background thread once the copy is done: the step never
waits for them. Staging is bounded by ``staging_bytes`` (host, and as much on the
device): a save that does not fit is skipped, a load that does not fit fails closed.

Threading: vLLM calls every hook from the worker's main thread. Store futures complete
on store threads; their callbacks only return staging buffers to the pool.
"""

from __future__ import annotations

import ctypes
import logging
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from connectors._staging import StagingPool, give_when_done
from connectors._vllm_config import KVShape, VllmConnectorConfig
from connectors._metrics import ConnectorMetrics
from connectors._vllm_meta import ChunkTransfer, KVStoreConnectorMetadata, KVStoreWorkerMetadata
from kvstore.errors import ConfigError, KVStoreError
from kvstore.paged import PagedLayers

log = logging.getLogger(__name__)


@dataclass
class _Load:
    spec: ChunkTransfer
    ids: torch.Tensor            # [n, blocks_per_chunk]
    buf: torch.Tensor | None     # host staging, n * chunk_bytes (None: over budget, or given back)
    groups: list[tuple[int, int, Future | None]]  # chunks [lo, hi) and their store load
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
    todo: list[int] | None = None  # chunks left for the staging path (None: all)


class WorkerSide:
    def __init__(self, config: VllmConnectorConfig, shape: KVShape, store: Any, metrics: ConnectorMetrics,
                 rank: int, *, writes: bool = True) -> None:
        self.config = config
        self.shape = shape
        self.store = store
        self.metrics = metrics
        self.rank = rank               # which stored copy this worker reads and writes
        self.writes = writes           # False: an MLA replica whose copy another rank stores
        self.pages: PagedLayers | None = None
        self._layer_index: dict[str, int] = {}
        self._pool: StagingPool | None = None          # host staging
        self._dev_pool: StagingPool | None = None      # device staging (device caches only)
        self._load_parts = 1
        self._loads: list[_Load] = []            # sync loads of this step (layer-wise)
        self._async_loads: list[_Load] = []
        self._saves: list[_Save] = []            # saves gathered during this step
        self._save_futures: dict[str, list[Future]] = {}
        self._errors: set[int] = set()
        self._outcomes: dict[int, tuple[str, int | None]] = {}   # load serial -> request, first failed chunk
        self._poisoned: dict[str, int] = {}          # request -> first chunk that failed to load
        self._hold: set[str] = set()                  # requests whose blocks the scheduler keeps
        self._side: Any = None                       # CUDA: stream for device->host copies
        self._copy_out: ThreadPoolExecutor | None = None

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
        budget = self.config.staging_bytes
        self._pool = StagingPool(torch.device("cpu"), budget, pin=device.type == "cuda")
        self._dev_pool = StagingPool(device, budget) if device.type != "cpu" else None
        if device.type == "cuda":
            self._side = torch.cuda.Stream(device)
            self._copy_out = ThreadPoolExecutor(1, thread_name_prefix="kvstore-vllm-d2h")
        # Device caches: scatter group i on the device while the store copies group
        # i + 1 on the host. Host caches: both are CPU copies and would only compete.
        self._load_parts = 1 if device.type == "cpu" else 4
        # Host caches over an embedded Store: gather straight into the store's slots and
        # scatter straight out of them (one copy each way instead of two via staging).
        self._in_place = device.type == "cpu" and hasattr(self.store, "reserve")

    # -- loads ----------------------------------------------------------------------------

    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        for spec in meta.loads:
            if self._in_place and not spec.is_async and not self.config.layerwise:
                spec = self._load_in_place(spec)
                if spec is None:
                    continue
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

    def _load_in_place(self, spec: ChunkTransfer) -> ChunkTransfer | None:
        """Scatter the leading chunks the store's first tier holds straight from its
        slots (held for the copy). Returns the chunks left for the staging path, or
        None when every chunk is in place."""
        pages, cb = self._pages(), self._pages().chunk_bytes
        keys = spec.keys_for(self.rank)
        n = len(keys)
        ids, keep = self._block_tensors(spec)
        with ExitStack() as held:
            try:
                views = held.enter_context(self.store.borrow(keys))
            except KVStoreError:
                return spec                 # the staging path reports the failure
            good = 0
            for view in views:
                if view is None or view.nbytes != cb:
                    break
                good += 1
            for lo, hi, src in _spans(views[:good]):
                pages.scatter(ids[lo:hi], src, keep=None if keep is None else keep[lo:hi])
        self._note_loaded(spec, good)
        if good == n:
            self._note_outcome(spec, n, n)
            return None
        return ChunkTransfer(spec.req_id, [k[good:] for k in spec.keys], spec.block_ids[good * spec.per:],
                             skip_blocks=0 if good else spec.skip_blocks, is_async=spec.is_async,
                             first_chunk=spec.first_chunk + good, per=spec.per, serial=spec.serial)

    def _submit_load(self, spec: ChunkTransfer) -> _Load:
        """Ask the store for the chunks (in groups for device caches, so that
        scattering one group overlaps the store's copy of the next)."""
        cb = self._pages().chunk_bytes
        n = spec.num_chunks
        ids, _ = self._block_tensors(spec)
        buf = self._pool.take(n * cb)
        if buf is None:
            log.warning("request %s: %d chunks do not fit in staging_bytes (%d): load fails closed",
                        spec.req_id, n, self.config.staging_bytes)
            return _Load(spec, ids, None, [(0, n, None)])
        self._gauge()
        keys = spec.keys_for(self.rank)
        groups = []
        for lo, hi in _groups(n, self._load_parts):
            try:
                future = self.store.load(keys[lo:hi], [buf[i * cb:(i + 1) * cb] for i in range(lo, hi)])
            except KVStoreError as exc:
                log.warning("request %s: load of %d chunks refused: %s", spec.req_id, hi - lo, exc)
                future = None
            groups.append((lo, hi, future))
        return _Load(spec, ids, buf, groups)

    def _stream_load(self, load: _Load) -> None:
        """Scatter each group of a whole load as soon as the store has verified it; stop
        at the first chunk that failed."""
        pages, cb = self._pages(), self._pages().chunk_bytes
        _, keep_all = self._block_tensors(load.spec)
        ok_all: list[bool] = []
        stopped = False
        for lo, hi, future in load.groups:
            ok = self._wait_load(load, future, hi - lo)
            good = 0 if stopped or load.buf is None else _prefix_len(ok)
            src = load.buf[lo * cb:(lo + good) * cb] if good else None
            if good and self._dev_pool is not None:
                dev = self._dev_pool.take(src.numel())
                if dev is None:
                    good, src = 0, None     # over the staging budget: fails closed from here
                else:
                    src = dev.copy_(src, non_blocking=True)
            ok_all += ok[:good] + [False] * (hi - lo - good)
            stopped = stopped or good < hi - lo
            if good == 0:
                continue
            pages.scatter(load.ids[lo:lo + good], src, keep=None if keep_all is None else keep_all[lo:lo + good])
            if self._dev_pool is not None:
                self._dev_pool.give(src)
        load.ok = ok_all
        self._note_errors(load)
        load.layers_done = (1 << pages.num_layers) - 1
        if load.buf is not None:
            self._pool.give(load.buf, self._copied())
            load.buf = None

    def _note_errors(self, load: _Load) -> None:
        """Report the blocks of every chunk from the first failed one on, and the load's
        outcome (for the scheduler and this worker's own saves)."""
        good = _prefix_len(load.ok)
        for c in range(good, len(load.ok)):
            skip = load.spec.skip_blocks if c == 0 else 0
            self._errors.update(load.spec.chunk(c)[skip:])
        self._note_loaded(load.spec, good)
        self._note_outcome(load.spec, good, len(load.ok))

    def _note_loaded(self, spec: ChunkTransfer, good: int) -> None:
        blocks = len(spec.block_ids[:good * spec.per]) - (spec.skip_blocks if good else 0)
        self.metrics.add("loaded_tokens", blocks * self.shape.block_size)

    def _note_outcome(self, spec: ChunkTransfer, good: int, n: int) -> None:
        failed = spec.first_chunk + good if good < n else None
        if failed is not None:
            self.metrics.add("failed_loads", n - good)
            self._poisoned[spec.req_id] = min(self._poisoned.get(spec.req_id, failed), failed)
        before = self._outcomes.get(spec.serial, (spec.req_id, failed))[1]
        self._outcomes[spec.serial] = (spec.req_id, failed if before is None else before if failed is None
                                       else min(before, failed))

    def _finish_load(self, load: _Load, layers: list[int] | None) -> None:
        """Wait for the store, then scatter verified chunks (the requested layers, or
        all remaining ones). Failed chunks and everything after them become load errors."""
        pages = self._pages()
        if load.ok is None and layers is None:
            self._stream_load(load)
            return
        if load.ok is None:
            load.ok = [hit for lo, hi, f in load.groups for hit in self._wait_load(load, f, hi - lo)]
            good = _prefix_len(load.ok) if load.buf is not None else 0
            if good and self._dev_pool is not None:
                load.dev = self._dev_pool.take(good * pages.chunk_bytes)
                if load.dev is None:
                    good = 0                # over the staging budget: fails closed
                else:
                    load.dev.copy_(load.buf[: good * pages.chunk_bytes], non_blocking=True)
            load.ok = load.ok[:good] + [False] * (len(load.ok) - good)
            self._note_errors(load)
        good = _prefix_len(load.ok)
        if load.buf is None:
            return                      # finished earlier, or abandoned after a timeout
        if good == 0:
            self._pool.give(load.buf)
            load.buf = None
            return
        todo = range(pages.num_layers) if layers is None else layers
        ids, keep = self._block_tensors(load.spec)
        ids, keep = ids[:good], None if keep is None else keep[:good]
        src = load.dev if load.dev is not None else load.buf[: good * pages.chunk_bytes]
        if layers is None and load.layers_done == 0:
            pages.scatter(ids, src, keep=keep)
            load.layers_done = (1 << pages.num_layers) - 1
        else:
            for layer in todo:
                if not load.layers_done >> layer & 1:
                    pages.scatter_layer(layer, ids, src, keep=keep)
                    load.layers_done |= 1 << layer
        if load.layers_done == (1 << pages.num_layers) - 1:
            self._pool.give(load.buf, self._copied())
            load.buf = None
            if load.dev is not None:
                self._dev_pool.give(load.dev)
                load.dev = None

    def _wait_load(self, load: _Load, future: Future | None, n: int) -> list[bool]:
        if future is None:
            return [False] * n
        try:
            ok = future.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            # The store may still write into the buffer: never hand it out again.
            log.warning("request %s: load timed out after %.1f s", load.spec.req_id, self.config.timeout_s)
            if load.buf is not None:
                self._pool.discard(load.buf)   # the store may still write it: never handed out again
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
            if all(f is None or f.done() for _, _, f in load.groups):
                self._finish_load(load, layers=None)
                self._async_loads.remove(load)
                done.add(load.spec.req_id)
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def note_holds(self, meta: KVStoreConnectorMetadata) -> None:
        """Requests whose blocks the scheduler keeps until reported (``hold`` saves),
        known as soon as the step's metadata is bound: vLLM may ask for finished
        requests before ``wait_for_save`` (speculative decoding defers it)."""
        for spec in meta.saves:
            if spec.hold:
                self._hold.add(spec.req_id)

    def take_load_outcomes(self) -> KVStoreWorkerMetadata | None:
        """The outcome of every load finished since the last call, for the scheduler."""
        if not self._outcomes:
            return None
        outcomes, self._outcomes = self._outcomes, {}
        return KVStoreWorkerMetadata(outcomes)

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
        store; with ``save_async`` off, wait until stored. On return vLLM's blocks are
        free to reuse, except on a device, where the copy-out is still reading them
        (the scheduler keeps a finished request's blocks until it is reported)."""
        pages = self._pages()
        cb = pages.chunk_bytes
        saves = self._step_saves(meta)
        for save in saves:
            if self._in_place and not save.layers:
                save.todo = self._save_in_place(save)
                if save.todo:
                    pages.gather(save.ids[save.todo], save.buf[: len(save.todo) * cb])
                continue
            for layer in range(pages.num_layers):
                if save.layers and layer not in save.layers:
                    pages.gather_layer(layer, save.ids, save.target)
            if not save.layers:
                pages.gather(save.ids, save.target)
        # Gather everything first, then hand the store groups it copies in parallel:
        # copying while gathering would slow down the gather that the step waits for.
        for save in saves:
            if save.target is not save.buf:
                self._copy_out_later(save)
            else:
                self._submit_save(save)
        self._saves = []
        self._gauge()

    def _copy_out_later(self, save: _Save) -> None:
        """Device caches: copy the gathered chunks to pinned host staging on the side
        stream (after the engine's stream), and submit them to the store once the copy
        is done, off the step."""
        side = self._side
        side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side):
            save.buf.copy_(save.target, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        save.target.record_stream(side)
        futures: Future = self._copy_out.submit(self._after_copy, save, done)
        self._save_futures.setdefault(save.spec.req_id, []).append(futures)
        if not self.config.save_async:
            _wait(futures, self.config.timeout_s, save.spec.req_id)

    def _after_copy(self, save: _Save, done: Any) -> None:
        done.synchronize()
        self._dev_pool.give(save.target)
        save.target = save.buf
        futures = self._submit_save(save, wait=False)
        if not self.config.save_async:
            for future in futures:
                _wait(future, self.config.timeout_s, save.spec.req_id)

    def _submit_save(self, save: _Save, *, wait: bool = True) -> list[Future]:
        cb = self._pages().chunk_bytes
        keys = save.spec.keys_for(self.rank)
        if save.todo is not None:
            keys = [keys[i] for i in save.todo]
        n = len(keys)
        futures = []
        for lo, hi in _groups(n) if n else []:
            try:
                futures.append(self.store.save(keys[lo:hi], [save.buf[i * cb:(i + 1) * cb] for i in range(lo, hi)]))
            except KVStoreError as exc:
                log.warning("request %s: save refused: %s", save.spec.req_id, exc)
                self.metrics.add("dropped_saves", n - lo)
                break
        if wait:
            # Registered even with nothing pending (saved in place, or refused).
            self._save_futures.setdefault(save.spec.req_id, []).extend(futures)
        if not futures:
            self._pool.give(save.buf)
            return futures
        give_when_done(futures, save.buf, self._pool, save.spec.req_id)
        if wait and not self.config.save_async:
            for future in futures:
                _wait(future, self.config.timeout_s, save.spec.req_id)
        return futures

    def _save_in_place(self, save: _Save) -> list[int]:
        """Gather chunks straight into first-tier slots reserved in the store and
        publish them. Returns the chunks that got no slot (saved through staging).
        Synchronous saves let the reservation evict; asynchronous ones take free room
        only, so the step never waits for a spill (the staging path evicts behind)."""
        pages, cb = self._pages(), self._pages().chunk_bytes
        keys = save.spec.keys_for(self.rank)
        try:
            res = self.store.reserve(keys, [cb] * len(keys), evict=not self.config.save_async)
        except KVStoreError as exc:
            log.warning("request %s: save refused: %s", save.spec.req_id, exc)
            return []
        with res:
            idx = [i for i, view in enumerate(res.views) if view is not None]
            ids = save.ids if len(idx) == len(keys) else save.ids[idx]
            for lo, hi, dst in _spans([res.views[i] for i in idx]):
                pages.gather(ids[lo:hi], dst)
        return res.missing

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose blocks the scheduler kept (``hold`` saves): their
        chunks are gathered in this step, on the engine's stream, before vLLM reuses the
        blocks, so they are reported at once. Every other finished request is forgotten."""
        done = self._hold & finished_req_ids
        self._hold -= done
        for req_id in finished_req_ids:
            self._poisoned.pop(req_id, None)
        for req_id, futures in list(self._save_futures.items()):
            futures[:] = [f for f in futures if not f.done()]
            if not futures and req_id in finished_req_ids:
                del self._save_futures[req_id]
        return done

    def close(self, timeout_s: float) -> None:
        for futures in list(self._save_futures.values()):
            for f in list(futures):
                _wait(f, timeout_s, "shutdown")
        if self._copy_out is not None:
            self._copy_out.shutdown(wait=True)

    # -- internals ------------------------------------------------------------------------

    def _step_saves(self, meta: KVStoreConnectorMetadata) -> list[_Save]:
        """This step's saves, minus what must not or cannot be stored: chunks from a
        failed load of the same request on (until the request recomputes them), an MLA
        replica's copy, and saves over the staging budget."""
        if self._saves or not meta.saves:
            return self._saves
        pages = self._pages()
        for spec in meta.saves:
            if spec.hold:
                self._hold.add(spec.req_id)
            spec = self._unpoisoned(spec)
            if spec is None or not self.writes:
                continue
            n = spec.num_chunks
            buf = self._pool.take(n * pages.chunk_bytes)
            target = buf if buf is None or self._dev_pool is None else self._dev_pool.take(buf.numel())
            if target is None:
                if buf is not None:
                    self._pool.give(buf)
                log.warning("request %s: %d chunks do not fit in staging_bytes (%d): not saved",
                            spec.req_id, n, self.config.staging_bytes)
                self.metrics.add("dropped_saves", n)
                continue
            ids, _ = self._block_tensors(spec)
            self._saves.append(_Save(spec, ids, buf, target, set()))
        return self._saves

    def _unpoisoned(self, spec: ChunkTransfer) -> ChunkTransfer | None:
        failed = self._poisoned.get(spec.req_id)
        if failed is None:
            return spec
        if spec.first_chunk <= failed:
            del self._poisoned[spec.req_id]   # the request recomputes from before the failure
            return spec
        self.metrics.add("dropped_saves", spec.num_chunks)
        log.info("request %s: chunks from %d on were computed over a failed load: not saved",
                 spec.req_id, spec.first_chunk)
        return None

    def _block_tensors(self, spec: ChunkTransfer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[n, blocks_per_chunk]`` block ids of the chunks (a short last chunk padded
        with its own last block) and which blocks to write (``None``: all): not the
        leading ``skip_blocks``, not the padding."""
        per, n = self.shape.blocks_per_chunk, spec.num_chunks
        if spec.per != per:
            raise ConfigError(f"request {spec.req_id}: {spec.per} blocks per chunk planned, the caches hold {per}")
        ids = spec.block_ids
        short = n * per - len(ids)
        if short:
            ids = ids + [ids[-1]] * short
        tensor = torch.tensor(ids, dtype=torch.long).view(n, per)
        if not spec.skip_blocks and not short:
            return tensor, None
        keep = torch.ones(n, per, dtype=torch.bool)
        keep[0, :spec.skip_blocks] = False
        if short:
            keep[-1, per - short:] = False
        return tensor, keep

    def _copied(self) -> Any:
        """Device caches: an event on the engine's stream after the host->device copies
        enqueued so far, so a host staging buffer is reused only once they have read it."""
        if self._side is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._side.device))
        return event

    def _gauge(self) -> None:
        dev = self._dev_pool.allocated_bytes if self._dev_pool is not None else 0
        self.metrics.set("staging_bytes", self._pool.allocated_bytes + dev)

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


def _groups(n: int, parts: int = 4) -> list[tuple[int, int]]:
    """``n`` chunks split into up to ``parts`` consecutive groups."""
    size = max(1, -(-n // parts))
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def _spans(views: list) -> list[tuple[int, int, torch.Tensor]]:
    """Runs of views that lie back to back in memory, each as ``(lo, hi, tensor)``
    over views ``lo..hi`` (a batch of slots reserved together is usually one run, so
    it moves with one index op). The tensors alias the views' memory."""
    spans, lo = [], 0
    ptrs = [v.ctypes.data for v in views]
    for i in range(1, len(views) + 1):
        if i < len(views) and ptrs[i] == ptrs[i - 1] + views[i - 1].nbytes:
            continue
        total = ptrs[i - 1] + views[i - 1].nbytes - ptrs[lo]
        spans.append((lo, i, torch.frombuffer((ctypes.c_uint8 * total).from_address(ptrs[lo]), dtype=torch.uint8)))
        lo = i
    return spans


def _prefix_len(ok: list[bool]) -> int:
    n = 0
    for hit in ok:
        if not hit:
            break
        n += 1
    return n


def _wait(future: Future, timeout_s: float, what: str) -> None:
    try:
        future.result(timeout=timeout_s)
    except Exception as exc:  # saves are best-effort: a failed save is only a lost hit
        log.warning("%s: save did not complete: %s", what, exc)


__all__ = ["WorkerSide"]
