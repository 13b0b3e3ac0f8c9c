"""kvstore as a secondary tier under vLLM's own CPU offloading tier
(``OffloadingConnector`` + ``TieringOffloadingSpec``)::

    "secondary_tiers": [{"type": "KVStoreTier", "module_path": "connectors.vllm",
                         "store": {...StoreConfig...}}]        # or "server": "host:port"

vLLM's tiering manager calls this from the scheduler process, under its own lock. Every
call returns at once: copies between a primary-tier row and the store run on the
store's threads and are reported by :meth:`KVStoreTier.get_finished_jobs`. A row is one
offload chunk (all workers' bytes for it, as vLLM's CPU tier lays them out); the key is
vLLM's chunk hash, namespaced by model, dtype, row size, layout and parallel shape.

vLLM's block hashes are seeded per process unless ``PYTHONHASHSEED`` is set; set it
(same value everywhere) for hits across processes that share a kvstore server.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, wait
from typing import Any, ClassVar, Iterable, Mapping

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from connectors._store_handle import open_store, release_store
from kvstore.keys import BlockKey, Namespace

log = logging.getLogger(__name__)


class KVStoreTier(SecondaryTierManager):
    """A ``SecondaryTierManager`` backed by an embedded Store or a kvstore server.

    Thread-safety: vLLM never enters it concurrently; completions arrive on store
    threads and are queued under a private lock.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, store: Mapping[str, Any] | str | None = None,
                 server: str | None = None, token: str | None = None, model_id: str | None = None,
                 locality: str | None = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._rows = _rows_of(primary_kv_view)
        cfg = offloading_spec.config
        par = cfg.parallel
        layout = (f"vllm-offload:{cfg.kv_cache_layout or 'default'};row{self._rows.shape[1]};"
                  f"tp{par.tp_size};pp{par.pp_size};pcp{par.pcp_size};dcp{par.dcp_size};"
                  f"bpc{cfg.cache.blocks_per_chunk}")
        tokens = cfg.cache.tokens_per_hash * cfg.cache.blocks_per_chunk
        self.namespace = Namespace(model_id or cfg.model.name, cfg.model.dtype, max(tokens, 1), layout,
                                   0, 1, "")
        self.store, self._handle = open_store(store, server, token)
        self._lock = threading.Lock()
        self._done: list[JobResult] = []
        self._inflight: dict[int, Future] = {}

    def _key(self, key: OffloadKey) -> BlockKey:
        return self.namespace.key_for(bytes(key))

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.store.contains([self._key(key)])[0] else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = [self._key(k) for k in job_metadata.keys]
        rows = [self._rows[int(c)] for c in job_metadata.chunk_ids]
        self._submit(job_metadata, keys, lambda: self.store.save(keys, rows))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = [self._key(k) for k in job_metadata.keys]
        rows = [self._rows[int(c)] for c in job_metadata.chunk_ids]
        self._submit(job_metadata, keys, lambda: self.store.load(keys, rows))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._inflight)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        with self._lock:
            futures = list(self._inflight.values())
        wait(futures)

    def shutdown(self) -> None:
        self.drain_jobs()
        if self.store is not None:
            store, self.store = self.store, None
            release_store(store, self._handle)

    # -- internals ------------------------------------------------------------------------

    def _submit(self, job: TransferJob, keys: list[BlockKey], start) -> None:
        original = list(job.keys)
        try:
            future = start()
        except Exception as exc:  # refused before any copy: the job fails, nothing half-done
            log.warning("kvstore tier: job %s refused: %s", job.job_id, exc)
            with self._lock:
                self._done.append(JobResult(job.job_id, False, successful_keys=[] if job.is_promotion else None))
            return
        with self._lock:
            self._inflight[job.job_id] = future
        nbytes = sum(r.nbytes for r in (self._rows[int(c)] for c in job.chunk_ids))
        future.add_done_callback(lambda f: self._finished(job, original, nbytes, f))

    def _finished(self, job: TransferJob, keys: list[OffloadKey], nbytes: int, future: Future) -> None:
        try:
            ok = list(future.result())
        except Exception as exc:
            log.warning("kvstore tier: job %s failed: %s", job.job_id, exc)
            ok = [False] * len(keys)
        success = all(ok)
        good = None if success or not job.is_promotion else [k for k, hit in zip(keys, ok) if hit]
        result = JobResult(job.job_id, success, successful_keys=good,
                           transfer_time=None, transfer_bytes=nbytes if success else None)
        with self._lock:
            self._inflight.pop(job.job_id, None)
            self._done.append(result)


def _rows_of(view: memoryview) -> np.ndarray:
    """The primary tier's buffer as ``uint8`` rows, one per chunk (no copy)."""
    arr = np.asarray(view)
    rows = arr.shape[0]
    return arr.reshape(rows, -1).view(np.uint8).reshape(rows, -1)


__all__ = ["KVStoreTier"]
