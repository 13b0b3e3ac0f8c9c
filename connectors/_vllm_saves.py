"""The save path of the vLLM connector's worker side: new chunks from vLLM's paged KV
blocks into the store.

Saves fail closed: chunks of a request computed after a chunk that failed to load on
this worker are never stored (the scheduler side holds saves until every rank's load
outcome is in, see :mod:`connectors._vllm_scheduler`; this is the same rule kept
locally), nor an MLA replica's copy, nor what does not fit in ``staging_bytes``.

A step's chunks are gathered in that step, on the engine's stream. Host caches over an
embedded Store gather straight into reserved first-tier slots; otherwise into staging,
which the store copies behind the step. Device caches copy device->host on a side
stream ordered after the engine's stream, and a background thread hands the bytes to
the store once that copy is done: the step never waits for them.

Threading: vLLM's worker thread; the copy-out thread only touches its own save.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvstore.connectors._staging import give_when_done, groups, spans, wait_quietly
from kvstore.connectors._vllm_handoff import settled
from kvstore.connectors._vllm_meta import ChunkTransfer, KVStoreConnectorMetadata
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from kvstore.connectors._vllm_worker import WorkerSide

log = logging.getLogger(__name__)


@dataclass
class _Save:
    spec: ChunkTransfer
    ids: torch.Tensor
    buf: torch.Tensor            # host staging handed to the store
    target: torch.Tensor         # where pages are gathered: ``buf``, or a device buffer
    layers: set[int]
    todo: list[int] | None = None  # chunks left for the staging path (None: all)


class SavePath:
    """Saves of one worker; shared state (caches, staging, store) lives on ``worker``."""

    def __init__(self, worker: "WorkerSide") -> None:
        self.w = worker
        self._saves: list[_Save] = []            # saves gathered during this step
        self.futures: dict[str, list[Future]] = {}   # request -> store saves still running
        self.hold: set[str] = set()                 # requests whose blocks the scheduler keeps
        self.handoffs: set[str] = set()             # of those, handed off: reported once their saves settled
        self._copy_out = (ThreadPoolExecutor(1, thread_name_prefix="kvstore-vllm-d2h")
                          if worker.side is not None else None)

    def layer(self, layer_name: str, meta: KVStoreConnectorMetadata) -> None:
        layer = self.w.layer_index.get(layer_name)
        if layer is None or not meta.saves:
            return
        for save in self._step_saves(meta):
            if layer not in save.layers:
                self.w.paged().gather_layer(layer, save.ids, save.target)
                save.layers.add(layer)

    def flush(self, meta: KVStoreConnectorMetadata) -> None:
        """Gather this step's new chunks (layers not gathered yet) and hand them to the
        store; with ``save_async`` off, wait until stored. On return vLLM's blocks are
        free to reuse: every gather is queued on the engine's stream before anything
        that could write them again (the device->host copy reads staging, not blocks)."""
        pages = self.w.paged()
        cb = pages.chunk_bytes
        saves = self._step_saves(meta)
        for save in saves:
            if self.w.in_place and not save.layers:
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
        self.w.gauge()

    def _copy_out_later(self, save: _Save) -> None:
        """Device caches: copy the gathered chunks to pinned host staging on the side
        stream (after the engine's stream), and submit them to the store once the copy
        is done, off the step."""
        side = self.w.side
        side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side):
            save.buf.copy_(save.target, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        save.target.record_stream(side)
        futures: Future = self._copy_out.submit(self._after_copy, save, done)
        self.futures.setdefault(save.spec.req_id, []).append(futures)
        if not self.w.config.save_async:
            wait_quietly(futures, self.w.config.timeout_s, save.spec.req_id)

    def _after_copy(self, save: _Save, done: Any) -> list[Future]:
        done.synchronize()
        self.w.save_dev_pool.give(save.target)
        save.target = save.buf
        futures = self._submit_save(save, wait=False)
        if not self.w.config.save_async:
            for future in futures:
                wait_quietly(future, self.w.config.timeout_s, save.spec.req_id)
        return futures     # a handoff waits for these too (_vllm_handoff.settled)

    def _submit_save(self, save: _Save, *, wait: bool = True) -> list[Future]:
        cb = self.w.paged().chunk_bytes
        keys = save.spec.keys_for(self.w.rank)
        if save.todo is not None:
            keys = [keys[i] for i in save.todo]
        n = len(keys)
        futures = []
        for lo, hi in groups(n) if n else []:
            try:
                futures.append(self.w.store.save(keys[lo:hi], [save.buf[i * cb:(i + 1) * cb] for i in range(lo, hi)],
                                                 hint=save.spec.hint))
            except KVStoreError as exc:
                log.warning("request %s: save refused: %s", save.spec.req_id, exc)
                self.w.metrics.add("dropped_saves", n - lo)
                break
        for (lo, hi), future in zip(groups(n) if n else [], futures):
            future.add_done_callback(lambda f, n=hi - lo: self._count_unsaved(f, n))
        if wait:
            # Registered even with nothing pending (saved in place, or refused).
            self.futures.setdefault(save.spec.req_id, []).extend(futures)
        if not futures:
            self.w.save_pool.give(save.buf)
            return futures
        give_when_done(futures, save.buf, self.w.save_pool, save.spec.req_id)
        if wait and not self.w.config.save_async:
            for future in futures:
                wait_quietly(future, self.w.config.timeout_s, save.spec.req_id)
        return futures

    def _count_unsaved(self, future: Future, n: int) -> None:
        """Count the chunks of a finished store save that were not stored (refused, or
        the server unreachable) in ``dropped_saves``."""
        ok = future.result() if future.exception() is None else []
        self.w.metrics.add("dropped_saves", n - sum(1 for stored in ok if stored))

    def _save_in_place(self, save: _Save) -> list[int]:
        """Gather chunks straight into first-tier slots reserved in the store and
        publish them. Returns the chunks that got no slot (saved through staging).
        Synchronous saves let the reservation evict; asynchronous ones take free room
        only, so the step never waits for a spill (the staging path evicts behind)."""
        pages, cb = self.w.paged(), self.w.paged().chunk_bytes
        keys = save.spec.keys_for(self.w.rank)
        try:
            res = self.w.store.reserve(keys, [cb] * len(keys), evict=not self.w.config.save_async)
        except KVStoreError as exc:
            log.warning("request %s: save refused: %s", save.spec.req_id, exc)
            return []
        with res:
            idx = [i for i, view in enumerate(res.views) if view is not None]
            ids = save.ids if len(idx) == len(keys) else save.ids[idx]
            for lo, hi, dst in spans([res.views[i] for i in idx]):
                pages.gather(ids[lo:hi], dst)
        if save.spec.hint is not None and len(res.missing) < len(keys):
            try:
                self.w.store.hint(keys, save.spec.hint)   # the committed ones
            except KVStoreError as exc:
                log.warning("request %s: retention hint not given: %s", save.spec.req_id, exc)
        return res.missing

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose blocks the scheduler kept (``hold`` saves): their
        chunks are gathered in this step, on the engine's stream, before vLLM reuses the
        blocks, so they are reported at once. Every other finished request is forgotten."""
        done = (self.hold - self.handoffs) & finished_req_ids
        self.hold -= done
        for req_id in finished_req_ids:
            self.w.poisoned.pop(req_id, None)
        for req_id, futures in list(self.futures.items()):
            futures[:] = [f for f in futures if not settled([f])]
            if not futures and req_id in finished_req_ids:
                del self.futures[req_id]
        for req_id in list(self.handoffs):
            if not self.futures.get(req_id):      # every save of it settled (stored or not)
                self.handoffs.discard(req_id)
                self.hold.discard(req_id)
                self.futures.pop(req_id, None)
                done.add(req_id)
        return done

    def note_holds(self, meta: KVStoreConnectorMetadata) -> None:
        """Requests whose blocks the scheduler keeps until reported (``hold`` saves),
        known as soon as the step's metadata is bound: vLLM may ask for finished
        requests before ``wait_for_save`` (speculative decoding defers it)."""
        for spec in meta.saves:
            if spec.hold:
                self.hold.add(spec.req_id)
        self.handoffs.update(meta.handoffs)

    def close(self, timeout_s: float) -> None:
        for futures in list(self.futures.values()):
            for f in list(futures):
                wait_quietly(f, timeout_s, "shutdown")
        if self._copy_out is not None:
            self._copy_out.shutdown(wait=True)

    def _step_saves(self, meta: KVStoreConnectorMetadata) -> list[_Save]:
        """This step's saves, minus what must not or cannot be stored: chunks from a
        failed load of the same request on (until the request recomputes them), an MLA
        replica's copy, and saves over the staging budget."""
        if self._saves or not meta.saves:
            return self._saves
        pages = self.w.paged()
        for spec in meta.saves:
            if spec.hold:
                self.hold.add(spec.req_id)
            spec = self._unpoisoned(spec)
            if spec is None or not self.w.writes:
                continue
            n = spec.num_chunks
            buf = self.w.save_pool.take(n * pages.chunk_bytes)
            target = buf if buf is None or self.w.save_dev_pool is None else self.w.save_dev_pool.take(buf.numel())
            if target is None:
                if buf is not None:
                    self.w.save_pool.give(buf)
                log.warning("request %s: %d chunks do not fit in the save half of staging_bytes (%d): not saved",
                            spec.req_id, n, self.w.save_pool.budget_bytes)
                self.w.metrics.add("dropped_saves", n)
                continue
            ids, _ = self.w.block_tensors(spec)
            self._saves.append(_Save(spec, ids, buf, target, set()))
        return self._saves

    def _unpoisoned(self, spec: ChunkTransfer) -> ChunkTransfer | None:
        failed = self.w.poisoned.get(spec.req_id)
        if failed is None:
            return spec
        if spec.first_chunk <= failed:
            del self.w.poisoned[spec.req_id]   # the request recomputes from before the failure
            return spec
        self.w.metrics.add("dropped_saves", spec.num_chunks)
        log.info("request %s: chunks from %d on were computed over a failed load: not saved",
                 spec.req_id, spec.first_chunk)
        return None



__all__ = ["SavePath"]
