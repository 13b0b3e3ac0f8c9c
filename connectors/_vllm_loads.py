"""The load path of the vLLM connector's worker side: chunks from the store into vLLM's
paged KV blocks, failing closed.

A chunk is scattered into vLLM's blocks only when the store reports it loaded
(verified), and never after a chunk of the same request that failed; the blocks of
every chunk not scattered are reported through :meth:`LoadPath.take_errors` so vLLM
recomputes them, and every load's outcome (by serial) goes back to the scheduler in the
step's worker metadata (:meth:`LoadPath.take_outcomes`). A failed load also marks the
request in the worker's ``poisoned`` map, which the save path reads.

Threading: vLLM's worker thread only; store futures complete on store threads.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, TimeoutError as FutureTimeout
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstore.connectors._staging import groups, spans
from kvstore.connectors._vllm_handoff import waiting_load
from kvstore.connectors._vllm_meta import ChunkTransfer, KVStoreConnectorMetadata, KVStoreWorkerMetadata
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from kvstore.connectors._vllm_worker import WorkerSide

log = logging.getLogger(__name__)


@dataclass
class _Load:
    spec: ChunkTransfer
    ids: torch.Tensor            # [n, blocks_per_chunk]
    keep: torch.Tensor | None    # which of them to write (None: all)
    buf: torch.Tensor | None     # host staging, n * chunk_bytes (None: over budget, or given back)
    groups: list[tuple[int, int, Future | None]]  # chunks [lo, hi) and their store load
    ok: list[bool] | None = None
    layers_done: int = 0
    dev: torch.Tensor | None = None   # device copy of the verified chunks (device caches)


class LoadPath:
    """Loads of one worker; shared state (caches, staging, store) lives on ``worker``."""

    def __init__(self, worker: "WorkerSide") -> None:
        self.w = worker
        self._loads: list[_Load] = []            # sync loads of this step (layer-wise)
        self._async_loads: list[_Load] = []
        self._errors: set[int] = set()
        self._outcomes: dict[int, tuple[str, int | None]] = {}   # load serial -> request, first failed chunk

    def start(self, meta: KVStoreConnectorMetadata) -> None:
        for spec in meta.loads:
            if self.w.in_place and not spec.is_async and not self.w.config.layerwise:
                spec = self._in_place(spec)
                if spec is None:
                    continue
            load = self._submit(spec)
            if spec.is_async:
                self._async_loads.append(load)
            elif self.w.config.layerwise:
                self._loads.append(load)
            else:
                self._finish(load, layers=None)

    def wait_for_layer(self, layer_name: str) -> None:
        layer = self.w.layer_index.get(layer_name)
        if layer is None:
            return
        for load in self._loads:
            self._finish(load, layers=[layer])

    def finish_step(self) -> None:
        """Scatter whatever a layer-wise step did not ask for (layers without a hook)."""
        for load in self._loads:
            self._finish(load, layers=None)
        self._loads = []

    def _in_place(self, spec: ChunkTransfer) -> ChunkTransfer | None:
        """Scatter the leading chunks the store's first tier holds straight from its
        slots (held for the copy). Returns the chunks left for the staging path, or
        None when every chunk is in place."""
        pages, cb = self.w.paged(), self.w.paged().chunk_bytes
        keys = spec.keys_for(self.w.rank)
        n = len(keys)
        ids, keep = self.w.block_tensors(spec)
        with ExitStack() as held:
            try:
                views = held.enter_context(self.w.store.borrow(keys))
            except KVStoreError:
                return spec                 # the staging path reports the failure
            good = 0
            for view in views:
                if view is None or view.nbytes != cb:
                    break
                good += 1
            for lo, hi, src in spans(views[:good]):
                pages.scatter(ids[lo:hi], src, keep=None if keep is None else keep[lo:hi])
        self._note_loaded(spec, good)
        if good == n:
            self._note_outcome(spec, n, n)
            return None
        return ChunkTransfer(spec.req_id, [k[good:] for k in spec.keys], spec.block_ids[good * spec.per:],
                             skip_blocks=0 if good else spec.skip_blocks, is_async=spec.is_async,
                             first_chunk=spec.first_chunk + good, per=spec.per, serial=spec.serial)

    def _submit(self, spec: ChunkTransfer) -> _Load:
        """Ask the store for the chunks (in groups for device caches, so that
        scattering one group overlaps the store's copy of the next)."""
        cb = self.w.paged().chunk_bytes
        n = spec.num_chunks
        ids, keep = self.w.block_tensors(spec)
        buf = self.w.pool.take(n * cb)
        if buf is None:
            log.warning("request %s: %d chunks do not fit in staging_bytes (%d): load fails closed",
                        spec.req_id, n, self.w.config.staging_bytes)
            return _Load(spec, ids, keep, None, [(0, n, None)])
        self.w.gauge()
        keys = spec.keys_for(self.w.rank)
        parts = []
        for lo, hi in groups(n, self.w.load_parts):
            try:
                dsts = [buf[i * cb:(i + 1) * cb] for i in range(lo, hi)]
                future = (waiting_load(self.w.store, keys[lo:hi], dsts, spec.wait_until, self.w.config.timeout_s,
                                       self.w.config.lease_s) if spec.wait_until
                          else self.w.store.load(keys[lo:hi], dsts))
            except KVStoreError as exc:
                log.warning("request %s: load of %d chunks refused: %s", spec.req_id, hi - lo, exc)
                future = None
            parts.append((lo, hi, future))
        return _Load(spec, ids, keep, buf, parts)

    def _stream(self, load: _Load) -> None:
        """Scatter each group of a whole load as soon as the store has verified it; stop
        at the first chunk that failed."""
        pages, cb = self.w.paged(), self.w.paged().chunk_bytes
        keep_all = load.keep
        ok_all: list[bool] = []
        stopped = False
        for lo, hi, future in load.groups:
            ok = self._wait(load, future, hi - lo)
            good = 0 if stopped or load.buf is None else prefix_len(ok)
            src = load.buf[lo * cb:(lo + good) * cb] if good else None
            if good and self.w.dev_pool is not None:
                dev = self.w.dev_pool.take(src.numel())
                if dev is None:
                    good, src = 0, None     # over the staging budget: fails closed from here
                else:
                    src = dev.copy_(src, non_blocking=True)
            ok_all += ok[:good] + [False] * (hi - lo - good)
            stopped = stopped or good < hi - lo
            if good == 0:
                continue
            pages.scatter(load.ids[lo:lo + good], src, keep=None if keep_all is None else keep_all[lo:lo + good])
            if self.w.dev_pool is not None:
                self.w.dev_pool.give(src)
        load.ok = ok_all
        self._note_errors(load)
        load.layers_done = (1 << pages.num_layers) - 1
        if load.buf is not None:
            self.w.pool.give(load.buf, self.w.copied())
            load.buf = None

    def _note_errors(self, load: _Load) -> None:
        """Report the blocks of every chunk from the first failed one on, and the load's
        outcome (for the scheduler and this worker's own saves)."""
        good = prefix_len(load.ok)
        for c in range(good, len(load.ok)):
            skip = load.spec.skip_blocks if c == 0 else 0
            self._errors.update(load.spec.chunk(c)[skip:])
        self._note_loaded(load.spec, good)
        self._note_outcome(load.spec, good, len(load.ok))

    def _note_loaded(self, spec: ChunkTransfer, good: int) -> None:
        blocks = min(len(spec.block_ids), good * spec.per) - (spec.skip_blocks if good else 0)
        self.w.metrics.add("loaded_tokens", blocks * self.w.shape.block_size)

    def _note_outcome(self, spec: ChunkTransfer, good: int, n: int) -> None:
        failed = spec.first_chunk + good if good < n else None
        if failed is not None:
            self.w.metrics.add("failed_loads", n - good)
            self.w.poisoned[spec.req_id] = min(self.w.poisoned.get(spec.req_id, failed), failed)
        before = self._outcomes.get(spec.serial, (spec.req_id, failed))[1]
        self._outcomes[spec.serial] = (spec.req_id, failed if before is None else before if failed is None
                                       else min(before, failed))

    def _finish(self, load: _Load, layers: list[int] | None) -> None:
        """Wait for the store, then scatter verified chunks (the requested layers, or
        all remaining ones). Failed chunks and everything after them become load errors."""
        pages = self.w.paged()
        if load.ok is None and layers is None:
            self._stream(load)
            return
        if load.ok is None:
            load.ok = [hit for lo, hi, f in load.groups for hit in self._wait(load, f, hi - lo)]
            good = prefix_len(load.ok) if load.buf is not None else 0
            if good and self.w.dev_pool is not None:
                load.dev = self.w.dev_pool.take(good * pages.chunk_bytes)
                if load.dev is None:
                    good = 0                # over the staging budget: fails closed
                else:
                    load.dev.copy_(load.buf[: good * pages.chunk_bytes], non_blocking=True)
            load.ok = load.ok[:good] + [False] * (len(load.ok) - good)
            self._note_errors(load)
        good = prefix_len(load.ok)
        if load.buf is None:
            return                      # finished earlier, or abandoned after a timeout
        if good == 0:
            self.w.pool.give(load.buf)
            load.buf = None
            return
        todo = range(pages.num_layers) if layers is None else layers
        ids, keep = load.ids[:good], None if load.keep is None else load.keep[:good]
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
            self.w.pool.give(load.buf, self.w.copied())
            load.buf = None
            if load.dev is not None:
                self.w.dev_pool.give(load.dev)
                load.dev = None

    def _wait(self, load: _Load, future: Future | None, n: int) -> list[bool]:
        if future is None:
            return [False] * n
        try:
            ok = future.result(timeout=self.w.config.timeout_s)
        except FutureTimeout:
            # The store may still write into the buffer: never hand it out again.
            log.warning("request %s: load timed out after %.1f s", load.spec.req_id, self.w.config.timeout_s)
            if load.buf is not None:
                self.w.pool.discard(load.buf)   # the store may still write it: never handed out again
            load.buf = None
            return [False] * n
        except Exception as exc:  # a store or transport failure: fail closed
            log.warning("request %s: load failed: %s", load.spec.req_id, exc)
            return [False] * n
        return list(ok)

    def finished(self) -> set[str]:
        """Requests whose async loads are complete (scattered or reported as errors)."""
        done = set()
        for load in list(self._async_loads):
            if all(f is None or f.done() for _, _, f in load.groups):
                self._finish(load, layers=None)
                self._async_loads.remove(load)
                done.add(load.spec.req_id)
        return done

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_outcomes(self) -> KVStoreWorkerMetadata | None:
        """The outcome of every load finished since the last call, for the scheduler."""
        if not self._outcomes:
            return None
        outcomes, self._outcomes = self._outcomes, {}
        return KVStoreWorkerMetadata(outcomes)



def prefix_len(ok: list[bool]) -> int:
    """How many leading entries of ``ok`` are true."""
    n = 0
    for hit in ok:
        if not hit:
            break
        n += 1
    return n


__all__ = ["LoadPath", "prefix_len"]
