"""kvstore as a secondary tier under vLLM's own CPU offloading tier
(``OffloadingConnector`` + ``TieringOffloadingSpec``)::

    "secondary_tiers": [{"type": "KVStoreTier", "module_path": "kvstore.connectors.vllm",
                         "store": {...StoreConfig...}}]        # or "server": "host:port"

vLLM's tiering manager calls this from the scheduler process, under its own lock, and
every call returns at once; no call makes a store round trip on the caller's thread:

- ``lookup`` is asked one chunk at a time. A chunk not yet known answers ``RETRY`` (vLLM
  defers the request to a later pass); the chunks asked in one scheduler pass are sent,
  at ``on_schedule_end``, as one item to this tier's lookup thread, which answers them
  with one lease-taking ``store.lookup`` (plus one ``contains`` when several requests
  asked). The next pass answers ``HIT`` or ``MISS`` from the result. A request's hits are
  the prefix of the chunks it asked that the store holds, each leased.
- A lease is dropped when its load finishes, when vLLM did not turn the hit into a load
  (primary tier full), when the request is scheduled or preempted, or when it finishes.
- Copies between a primary-tier row and the store run on the store's threads and are
  reported by :meth:`KVStoreTier.get_finished_jobs`; a row is reported loaded only if
  the store verified every byte of it (``store.load``'s ``True``), a failed chunk is
  reported failed and is not offered to that request again.

A row is one offload chunk (all workers' bytes for it, as vLLM's CPU tier lays them
out); the key is vLLM's chunk hash, namespaced by model, dtype, row size, layout and
parallel shape. vLLM's block hashes are seeded per process unless ``PYTHONHASHSEED`` is
set; set it (same value everywhere) for hits across processes that share a server.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import secrets
import threading
from concurrent.futures import Future, wait
from typing import Any, Callable, ClassVar, Iterable, Mapping

import numpy as np
from vllm.v1.kv_offload.base import (LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext,
                                     ScheduleEndContext)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstore.connectors._hints import request_hint, with_hint_actions
from kvstore.connectors._metrics import ConnectorMetrics
from kvstore.connectors._store_handle import clear_namespaces, open_store, release_store
from kvstore.api import StoreAPI
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import BlockKey, Namespace

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0


class KVStoreTier(SecondaryTierManager):
    """A ``SecondaryTierManager`` backed by an embedded Store or a kvstore server.

    Thread-safety: vLLM never enters it concurrently (its manager lock), though not
    always from one thread; store completions and lookup answers arrive on other
    threads through queues and are applied on vLLM's calls.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, store: Mapping[str, Any] | str | None = None,
                 server: str | None = None, token: str | None = None, model_id: str | None = None,
                 weights_version: str | None = None, locality: str | None = None, lease_s: float = DEFAULT_LEASE_S) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._rows = _rows_of(primary_kv_view)
        cfg = offloading_spec.config
        par = cfg.parallel
        # Everything that changes what a row's bytes mean; flags only when set, so the
        # keys of the common (direct, per-rank) layout stay what they were.
        layout = (f"vllm-offload:{cfg.kv_cache_layout or 'default'};row{self._rows.shape[1]};"
                  f"tp{par.tp_size};pp{par.pp_size};pcp{par.pcp_size};dcp{par.dcp_size};"
                  f"bpc{cfg.cache.blocks_per_chunk}"
                  + (";canonical" if getattr(cfg, "canonical_layout", False) else "")
                  + (";replicated" if getattr(cfg, "replicated_layout", False) else ""))
        tokens = cfg.cache.tokens_per_hash * cfg.cache.blocks_per_chunk
        # vLLM tells a secondary tier only the model's name and KV dtype, not its revision,
        # quantization or hf_overrides: deployments that differ only in those must name
        # themselves with weights_version (or model_id); see docs/vllm.md.
        model = (model_id or cfg.model.name) + (f";weights={weights_version}" if weights_version else "")
        self.namespace = Namespace(model, cfg.model.dtype, max(tokens, 1), layout, 0, 1, "")
        self._default_tokens = max(tokens, 1)
        self._group_tokens = {g.group_id: g.tokens_per_block * cfg.cache.blocks_per_chunk for g in cfg.groups}
        if (store is None) == (server is None):
            raise ConfigError("vLLM KVStoreTier: set exactly one of 'store' (an embedded StoreConfig dict "
                              "or YAML path) and 'server' ('host:port' of a kvstore server)")
        self.store = open_store({"store": store, "server": server, "token": token}, owner="vLLM KVStoreTier")
        self.metrics = ConnectorMetrics(self.store, "vllm_tier")
        self._lookups = _LeasedLookups(self.store, self._key, lease_s)
        self._lock = threading.Lock()
        self._done: list[tuple[TransferJob, list[bool], int]] = []   # filled on store threads
        self._inflight: dict[int, Future] = {}
        self._held: dict[int, list[OffloadKey]] = {}   # promotion job -> leases it took over

    def _key(self, key: OffloadKey) -> BlockKey:
        return self.namespace.key_for(bytes(key))

    def _tokens(self, key: OffloadKey) -> int:
        return self._group_tokens.get(int.from_bytes(bytes(key)[-4:], "big"), self._default_tokens)

    # -- vLLM's SecondaryTierManager API --------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.ask(req_context.req_id, key)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # vLLM has submitted this pass's promotions (submit_load) just before this call.
        settled = [*context.new_req_ids, *context.preempted_req_ids]
        offered = self._lookups.end_pass(settled)
        self.metrics.add("hit_tokens", sum(self._tokens(k) for k in offered))

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = [self._key(k) for k in job_metadata.keys]
        rows = [self._rows[int(c)] for c in job_metadata.chunk_ids]
        ctx = job_metadata.req_context
        hint = request_hint(with_hint_actions(ctx.kv_transfer_params, ctx.kv_hints), request_id=ctx.req_id)
        self._submit(job_metadata, lambda: self.store.save(keys, rows, hint=hint))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._held[job_metadata.job_id] = self._lookups.hold(job_metadata.keys)
        keys = [self._key(k) for k in job_metadata.keys]
        rows = [self._rows[int(c)] for c in job_metadata.chunk_ids]
        self._submit(job_metadata, lambda: self.store.load(keys, rows))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._done = self._done, []
        return [self._report(job, ok, nbytes) for job, ok, nbytes in done]

    def has_pending_work(self) -> bool:
        with self._lock:
            if self._inflight or self._done:
                return True
        return self._lookups.pending()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.finish(req_context.req_id)

    def drain_jobs(self) -> None:
        """vLLM's tiering manager calls this (only) from its ``reset_cache`` (weight
        update, sleep, ``reset_prefix_cache``), which resets the CPU tier and leaves
        secondary tiers' data alone. Stored rows may be of other weights, so after
        waiting for every job in flight this tier forgets the hits it told, moves to a
        fresh generation of its namespace (rows an engine still on the old weights writes
        under the old one, on a shared server, are never this tier's hits) and drops the
        old namespace from the store. A store that cannot drop it is logged, not raised:
        raising would stop vLLM's reset half-way, and the new generation already keeps
        the old rows from being served."""
        self.wait_idle()
        self._lookups.forget_hits()
        old = self.namespace
        self.namespace = dataclasses.replace(old, salt=f"{old.salt}\0gen:{secrets.token_hex(8)}")
        if not clear_namespaces(self.store, [old.digest], owner="vLLM KVStoreTier"):
            log.warning("vLLM KVStoreTier: the store could not drop the old namespace on reset; its rows stay "
                        "stored (never loaded by this tier: it moved to a new generation)")

    def wait_idle(self) -> None:
        """Wait for every submitted load and store, and for the lookups and lease
        releases already sent to the store."""
        with self._lock:
            futures = list(self._inflight.values())
        wait(futures)
        self._lookups.wait()

    def shutdown(self) -> None:
        if self.store is None:
            return
        self.wait_idle()
        self._lookups.close()
        self.metrics.close()
        store, self.store = self.store, None
        release_store(store)

    # -- internals ------------------------------------------------------------------------

    def _submit(self, job: TransferJob, start: Callable[[], Future]) -> None:
        nbytes = sum(int(self._rows[int(c)].nbytes) for c in job.chunk_ids)
        try:
            future = start()
        except Exception as exc:  # refused before any copy: the job fails, nothing half-done
            log.warning("kvstore tier: job %s refused: %s", job.job_id, exc)
            with self._lock:
                self._done.append((job, [False] * len(job.keys), nbytes))
            return
        with self._lock:
            self._inflight[job.job_id] = future
        future.add_done_callback(lambda f: self._finished(job, nbytes, f))

    def _finished(self, job: TransferJob, nbytes: int, future: Future) -> None:
        try:
            ok = [bool(x) for x in future.result()]
        except Exception as exc:
            log.warning("kvstore tier: job %s failed: %s", job.job_id, exc)
            ok = []
        if len(ok) != len(job.keys):   # no per-key answer: nothing in the rows is trusted
            ok = [False] * len(job.keys)
        with self._lock:
            self._inflight.pop(job.job_id, None)
            self._done.append((job, ok, nbytes))

    def _report(self, job: TransferJob, ok: list[bool], nbytes: int) -> JobResult:
        """vLLM's result for a finished job, on vLLM's thread: leases and counters."""
        keys = list(job.keys)
        success = all(ok)
        if job.is_promotion:
            failed = [k for k, hit in zip(keys, ok) if not hit]
            self._lookups.loaded(job.req_context.req_id, self._held.pop(job.job_id, []),
                                 [k for k, hit in zip(keys, ok) if hit], failed)
            self.metrics.add("loaded_tokens", sum(self._tokens(k) for k, hit in zip(keys, ok) if hit))
            self.metrics.add("failed_loads", len(failed))
            # Only keys whose every byte was verified in the row count as loaded; vLLM
            # frees the others' slots without reading them.
            good = None if success else [k for k, hit in zip(keys, ok) if hit]
        else:
            self.metrics.add("dropped_saves", ok.count(False))
            good = None
        return JobResult(job.job_id, success, successful_keys=good,
                         transfer_time=None, transfer_bytes=nbytes if success else None)


class _Probe:
    """One request's lookups: chunk -> ``None`` (asked, no answer yet), ``True`` (held
    in the store and leased for this request) or ``False`` (a miss for this request)."""

    __slots__ = ("verdicts", "asked", "reported", "live")

    def __init__(self) -> None:
        self.verdicts: dict[OffloadKey, bool | None] = {}
        self.asked: list[OffloadKey] = []        # asked this pass, not yet sent
        self.reported: set[OffloadKey] = set()   # answered HIT this pass
        self.live = True


class _LeasedLookups:
    """Lease-taking lookups batched per scheduler pass, answered on the next pass.

    The scheduler-side methods run under vLLM's manager lock; the store is called only
    from this object's thread, one queued item per pass (lease releases, then the
    pass's lookups). The store counts leases per holder, so this tier gives back
    exactly the leases it took: ``_owned`` counts them per chunk (a lookup adds one, a
    successful load drops one, as the store does), and they are released once no holder
    here (a request told HIT or about to be, a load job) needs the chunk.
    """

    def __init__(self, store: StoreAPI, to_block: Callable[[OffloadKey], BlockKey], lease_s: float) -> None:
        self._store, self._to_block, self._lease_s = store, to_block, lease_s
        self._reqs: dict[str, _Probe] = {}
        self._holders: dict[OffloadKey, int] = {}    # chunk -> holders here
        self._owned: dict[OffloadKey, int] = {}      # chunk -> store leases this tier took
        self._to_release: set[OffloadKey] = set()    # chunks whose holders are all gone
        self._in_flight = 0
        self._need_drain = False
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvstore-tier-lookup", daemon=True)
        self._thread.start()

    # -- scheduler side ---------------------------------------------------------------------

    def ask(self, req_id: str, key: OffloadKey) -> bool | None:
        if self._need_drain:   # once per pass, so one pass sees one set of answers
            self._need_drain = False
            self._drain()
        probe = self._reqs.get(req_id)
        if probe is None:
            probe = self._reqs[req_id] = _Probe()
        found = probe.verdicts.get(key, _UNKNOWN)
        if found is _UNKNOWN:
            probe.verdicts[key] = None
            probe.asked.append(key)
            return None
        if found:
            probe.reported.add(key)
        return found

    def end_pass(self, settled: Iterable[str]) -> list[OffloadKey]:
        """Close a pass: hits reported this pass hand their lease to the load vLLM
        submitted for them (or drop it: no load, e.g. a full primary tier); requests in
        ``settled`` (scheduled, preempted) are done looking up. Sends this pass's
        lookups and releases. Returns the chunks reported as hits."""
        self._drain()
        offered = []
        for probe in self._reqs.values():
            for key in probe.reported:
                if probe.verdicts.get(key):
                    del probe.verdicts[key]
                    self._unhold(key)
                    offered.append(key)
            probe.reported.clear()
        for req_id in settled:
            self.finish(req_id)
        self._post()
        self._need_drain = True
        return offered

    def hold(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """A load takes over the leases this tier holds for ``keys``; returns those."""
        held = [k for k in keys if k in self._holders]
        for key in held:
            self._holders[key] += 1
        return held

    def loaded(self, req_id: str, held: list[OffloadKey], loaded: list[OffloadKey],
               failed: list[OffloadKey]) -> None:
        """A load finished: the store dropped one lease of each chunk it loaded, and the
        job's holds go; a chunk that failed is a miss for this request from now on
        (offering it again would fail again)."""
        for key in loaded:
            left = self._owned.get(key, 0) - 1
            if left > 0:
                self._owned[key] = left
            else:
                self._owned.pop(key, None)
        for key in held:
            self._unhold(key)
        probe = self._reqs.get(req_id)
        if probe is not None:
            for key in failed:
                probe.verdicts[key] = False

    def finish(self, req_id: str) -> None:
        probe = self._reqs.pop(req_id, None)
        if probe is None:
            return
        probe.live = False
        for key, found in probe.verdicts.items():
            if found:
                self._unhold(key)
        probe.verdicts.clear()
        probe.asked.clear()
        probe.reported.clear()

    def forget_hits(self) -> None:
        """After a reset: every chunk a request was told (or is about to be told) is a
        hit becomes a miss for it, and its lease goes, as at :meth:`finish`."""
        for probe in self._reqs.values():
            for key, found in list(probe.verdicts.items()):
                if found:
                    self._unhold(key)
                    probe.verdicts[key] = False
            probe.reported.clear()
        self._post()

    def pending(self) -> bool:
        return bool(self._in_flight or self._to_release)

    def wait(self) -> None:
        """Apply every answer already asked for (blocks for the store's replies)."""
        self._drain(block=True)

    def close(self) -> None:
        """Stop the thread and release every lease still held (blocking)."""
        self._work.put(None)
        self._thread.join()
        self._drain()
        for req_id in list(self._reqs):
            self.finish(req_id)
        keys = [k for k, n in self._owned.items() for _ in range(n)]
        self._holders.clear()
        self._owned.clear()
        self._to_release.clear()
        if keys:
            try:
                self._store.release([self._to_block(k) for k in keys])
            except Exception as exc:
                log.warning("kvstore tier: releasing %d leases at shutdown failed: %s", len(keys), exc)

    def _unhold(self, key: OffloadKey) -> None:
        left = self._holders[key] - 1
        if left:
            self._holders[key] = left
        else:
            del self._holders[key]
            self._to_release.add(key)

    def _post(self) -> None:
        releases = [k for k in self._to_release if k not in self._holders
                    for _ in range(self._owned.pop(k, 0))]
        self._to_release.clear()
        probes = []
        for probe in self._reqs.values():
            if probe.asked:
                probes.append((probe, probe.asked))
                probe.asked = []
        if releases or probes:
            self._in_flight += 1
            self._work.put((releases, probes))

    def _drain(self, block: bool = False) -> None:
        while self._in_flight:
            try:
                answers = self._results.get() if block else self._results.get_nowait()
            except queue.Empty:
                return
            self._in_flight -= 1
            # One lease per chunk per lookup call, however many requests asked it.
            for key in {k for _, keys, hits in answers for k, hit in zip(keys, hits) if hit}:
                self._owned[key] = self._owned.get(key, 0) + 1
            for probe, keys, hits in answers:
                for key, hit in zip(keys, hits):
                    if probe.live and key in probe.verdicts and probe.verdicts[key] is None:
                        probe.verdicts[key] = hit
                        if hit:
                            self._holders[key] = self._holders.get(key, 0) + 1
                    elif hit:   # nobody wants it any more (request gone, or settled)
                        self._to_release.add(key)

    # -- the lookup thread --------------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            releases, probes = item
            if releases:
                try:
                    self._store.release([self._to_block(k) for k in releases])
                except Exception as exc:   # the leases expire on their own
                    log.warning("kvstore tier: releasing %d leases failed: %s", len(releases), exc)
            groups = [[self._to_block(k) for k in keys] for _, keys in probes]
            try:
                hits = self._probe(groups)
            except Exception as exc:   # no answer is a miss, never a guess
                log.warning("kvstore tier: lookup of %d chunks failed: %s", sum(map(len, groups)), exc)
                hits = [[False] * len(g) for g in groups]
            self._results.put([(probe, keys, h) for (probe, keys), h in zip(probes, hits)])

    def _probe(self, groups: list[list[BlockKey]]) -> list[list[bool]]:
        """Per request, which of its keys are hits: the prefix the store holds, leased.
        One ``lookup`` for one request; ``contains`` then one ``lookup`` for several."""
        if not groups:
            return []
        if len(groups) == 1:
            n = self._store.lookup(groups[0], lease_s=self._lease_s)
            return [[i < n for i in range(len(groups[0]))]]
        unique = list(dict.fromkeys(k for g in groups for k in g))
        present = {k for k, held in zip(unique, self._store.contains(unique)) if held}
        ends = [next((i for i, k in enumerate(g) if k not in present), len(g)) for g in groups]
        wanted = list(dict.fromkeys(k for g, end in zip(groups, ends) for k in g[:end]))
        # A chunk evicted between the two calls ends the leased prefix: the chunks after
        # it are not leased, so they are misses.
        leased = set(wanted[:self._store.lookup(wanted, lease_s=self._lease_s)]) if wanted else set()
        return [[i < end and k in leased for i, k in enumerate(g)] for g, end in zip(groups, ends)]


_UNKNOWN = object()


def _rows_of(view: memoryview) -> np.ndarray:
    """The primary tier's buffer as ``uint8`` rows, one per chunk, in place: a copy
    here would make loads land in memory vLLM never reads."""
    arr = np.asarray(view)
    return arr.reshape(arr.shape[0], -1, copy=False).view(np.uint8)


__all__ = ["KVStoreTier"]
