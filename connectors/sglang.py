"""SGLang HiCache L3 storage backed by kvstore (sglang 0.5.23).

Load it through SGLang's ``dynamic`` storage backend (see docs/sglang.md)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1, "server": "127.0.0.1:7480"}'

Options in ``extra_config`` (besides SGLang's own ``backend_name``/``module_path``/
``class_name``/``interface_v1``):

- ``store``: an embedded StoreConfig dict or YAML path, or ``server`` (``host:port``)
  with an optional ``token``, for a shared ``kvstore serve``;
- ``namespace``: a tenant / deployment salt mixed into every key;
- ``model``: overrides SGLang's model name in the keys;
- ``kv_cache_dtype``: the KV cache format (``fp8_e4m3``, ``fp8_e5m2``, ...), read from
  SGLang's ServerArgs when not given; a ``uint8`` host pool is refused without it;
- ``weights_version``: names the weights, for new weights deployed under one path;
- ``lease_s``: the longest that pages counted by ``batch_exists`` are kept from
  eviction (default 30 s), so the prefetch that follows finds them. Leases are
  released as soon as SGLang can no longer read those pages (see
  :class:`~connectors._sglang_pages.LeaseBook`); ``lease_s`` bounds only the
  queries no read ever follows;
- ``staging_bytes``: host staging for ``layer_first`` pools, per I/O thread
  (default 64 MiB; at least one page).

Keys are SGLang's page hashes (a SHA-256 chain over token ids) mapped into a
:class:`~kvstore.keys.Namespace` of model, dtype, pool layout and shard, so a new
SGLang process finds what an earlier one stored. Loads fail closed: a page is
reported loaded only when every byte of it was verified into the destination.

Thread-safety: SGLang calls a backend from its prefetch and backup threads at once;
every method here may run concurrently (the Store is thread-safe, counters are locked).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional

try:
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorage, HiCacheStorageConfig
except ImportError as exc:  # pragma: no cover - exercised only without sglang
    raise ImportError("connectors.sglang needs sglang==0.5.23 (install: scripts/deps/50-sglang.sh, "
                      "see docs/sglang.md)") from exc

from kvstore.connectors._hints import request_hint
from kvstore.connectors._metrics import ConnectorMetrics
from kvstore.connectors._store_handle import open_store, release_store
from kvstore.connectors._sglang_pages import (LeaseBook, PageKeys, PoolSegments, Staging, engine_identity, kv_dtype,
                                              make_namespace, pool_signature)
from kvstore.connectors._sglang_pools import (KV_POOLS, TP_SHARDED_POOLS, check_pool, page_starts, pool_name,
                                              restorable_prefixes, side_pool_signature)
from kvstore.api import StoreAPI
from kvstore.buffers import copy_bytes, nbytes_of
from kvstore.config import parse_size
from kvstore.errors import (BufferSizeError, ConfigError, InvalidArgumentError, RemoteError,
                            StoreClosedError, TierError)
from kvstore.hint import Hint

log = logging.getLogger(__name__)

# SGLang passes its own keys through; file_storage_path is added when --file-storage-path is set.
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "file_storage_path"}
_OUR_KEYS = {"store", "server", "token", "tls", "namespace", "model", "lease_s", "staging_bytes",
             "kv_cache_dtype", "weights_version"}
DEFAULT_STAGING_BYTES = 64 << 20
# Failures of the store behind us: reported as misses / failed saves, never raised
# into SGLang's I/O threads. Bad arguments (InvalidArgumentError) still raise.
_STORE_FAILURES = (TierError, RemoteError, StoreClosedError, OSError)


def _server_args() -> Any:
    """SGLang's ServerArgs for this process, or None where none is published (a
    backend built outside an engine)."""
    try:
        from sglang.srt.runtime_context import get_server_args
        return get_server_args()
    except (ImportError, ValueError, AttributeError):
        return None


def _check_speculative(server_args: Any) -> None:
    """Refuse speculative decoding with a draft model (EAGLE, EAGLE3, MTP/NEXTN,
    STANDALONE, DFlash...). HiCache carries the draft's KV in the target's host pages
    (fused or packed draft lanes, "the target's page envelopes already carry every
    draft layer") or as a side pool, and an EAGLE-style draft's KV at a position is
    computed from the *next* token: a stored page's draft KV at its last position would
    belong to one continuation only. Model-free drafting (NGRAM) keeps no draft KV."""
    algo = getattr(server_args, "speculative_algorithm", None)
    if algo is None or str(algo).upper() in ("NGRAM", "NONE"):
        return
    raise ConfigError(f"sglang: the kvstore HiCache backend does not support speculative decoding with a draft model "
                      f"(speculative_algorithm={algo!r}): the draft's KV travels in the stored pages and an EAGLE/MTP "
                      "draft's KV at a page's last position depends on the token after the page; use NGRAM or no "
                      "speculative decoding with this backend")


class KVStoreHiCacheStorage(HiCacheStorage):
    """A ``HiCacheStorage`` over a kvstore Store or cache server.

    Built by SGLang as ``KVStoreHiCacheStorage(storage_config, kwargs)``; SGLang then
    calls :meth:`register_mem_pool_host`. Owns the Store/Client it opens.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - _SGLANG_KEYS - _OUR_KEYS)
        if unknown:
            raise ConfigError(f"sglang extra_config: unknown option(s) {', '.join(unknown)}; "
                              f"kvstore accepts {', '.join(sorted(_OUR_KEYS))}")
        self.storage_config = storage_config
        self.interface_v1 = bool(int(extra.get("interface_v1", 0)))
        self.model = str(extra.get("model") or storage_config.model_name or "")
        if not self.model:
            raise ConfigError("sglang: no model name (SGLang passed none); set extra_config 'model'")
        self._salt = str(extra.get("namespace", ""))
        # What SGLang does not pass a storage backend (ServerArgs, published in this process).
        self._server_args = _server_args()
        _check_speculative(self._server_args)
        self._kv_cache_dtype = extra.get("kv_cache_dtype") or getattr(self._server_args, "kv_cache_dtype", None)
        self._identity = engine_identity(self._server_args, self.model, extra.get("weights_version"))
        try:
            self.lease_s = float(extra.get("lease_s", 30.0))
        except (TypeError, ValueError):
            raise ConfigError(f"sglang extra_config 'lease_s' must be a number, got {extra['lease_s']!r}") from None
        try:
            self._staging_bytes = parse_size(extra.get("staging_bytes", DEFAULT_STAGING_BYTES))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"sglang extra_config 'staging_bytes': {exc}") from None
        self.is_writer = storage_config.is_storage_writer
        self._store = open_store(extra, owner="sglang extra_config")
        self._server = extra.get("server")
        self._embedded = self._server is None
        # hit_tokens, loaded_tokens, failed_loads, dropped_saves, staging_bytes: in store.stats()["connectors"]
        self.metrics = ConnectorMetrics(self._store, "sglang")
        self._leases = LeaseBook(self._release, STORAGE_BATCH_SIZE)
        self._staging: Staging | None = None
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(("pages_loaded", "pages_missed", "pages_saved", "pages_save_failed",
                                        "store_failures", "side_pages_loaded", "side_pages_missed",
                                        "side_pages_saved", "side_pages_save_failed"), 0)
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [],
                                          "prefetch_bandwidth": [], "backup_bandwidth": []}
        self.mem_pool_host = None
        self._segments: PoolSegments | None = None
        page = int(getattr(storage_config, "logical_page_size", None) or 1)
        # Until a host pool is registered, values are opaque bytes in their own namespace.
        self._v0 = PageKeys(make_namespace(self.model, "raw", "sglang-v0:raw", page,
                                           storage_config, self._salt, self._identity), 1)
        self._v1: PageKeys | None = None
        self._page_tokens = page
        self._namespaces = [self._v0.ns.digest]   # every key space this backend used (clear)
        # v2 side pools (Mamba, SWA, indexer): name -> (host pool, keys, pool page slots)
        self._side: dict[str, tuple[Any, PageKeys, int]] = {}
        self._pools_registered = False
        self._closed = False

    # -- registration -------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        dtype, layout, page = pool_signature(mem_pool_host)
        dtype = kv_dtype(dtype, self._kv_cache_dtype)
        cfg = self.storage_config
        ident = self._identity
        self._v0 = PageKeys(make_namespace(self.model, dtype, f"sglang-v0:{layout}", page, cfg, self._salt, ident), 1)
        self._page_tokens = page
        self._namespaces.append(self._v0.ns.digest)
        if self.interface_v1:
            self._segments = PoolSegments(mem_pool_host)
            # "v1" pages are the pool's segments, "v1-page" one staged block per page
            kind = "sglang-v1-page" if self._segments.staged else "sglang-v1"
            ns = make_namespace(self.model, dtype, f"{kind}:{layout}", page, cfg, self._salt, ident)
            self._v1 = PageKeys(ns, self._segments.per_page)
            self._namespaces.append(ns.digest)
            if self._segments.staged:
                page_bytes = self._segments.page_bytes
                nbytes = max(self._staging_bytes // page_bytes, 1) * page_bytes
                self._staging = Staging(nbytes, lambda held: self.metrics.set("staging_bytes", held))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's host pool (SGLang registers the anchor KV pool here too, which
        keeps its v0/v1 key spaces). A side pool gets a key space of its own; one this
        backend cannot store is refused by name at start-up (see
        :mod:`~connectors._sglang_pools`). One registered later (SGLang's dynamic
        sidecars) is logged and reads as a miss: raising there would stop the scheduler."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = pool_name(host_pool_name)
        if name == "kv":
            return
        try:
            check_pool(name, host_pool)
        except ConfigError as exc:
            if not self._pools_registered:
                raise
            log.error("%s; its pages are reported as misses", exc)
            return
        dtype, layout, slots, _ = side_pool_signature(name, host_pool)
        kv = self._kv_cache_dtype
        dtype = kv_dtype(dtype, kv) if name in KV_POOLS else (f"{dtype}/{kv}" if kv and kv != "auto" else dtype)
        ns = make_namespace(self.model, dtype, layout, self._page_tokens, self.storage_config, self._salt,
                            self._identity, tp_sharded=name in TP_SHARDED_POOLS)
        self._side[name] = (host_pool, PageKeys(ns, 1), slots)
        self._namespaces.append(ns.digest)

    def on_host_pools_registered(self) -> None:
        self._pools_registered = True

    @property
    def store(self) -> StoreAPI:
        """The Store or Client behind this backend (an embedded Store is shared with the
        other connectors of this process that name the same config)."""
        return self._store

    # -- generic (v0) path: one flat page per block --------------------------------------

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Any:
        """Load one page into ``target_location`` (or a new flat page); ``None`` on a miss."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Any]:
        """Load pages into caller-owned flat tensors; each entry is the tensor or ``None``."""
        if target_locations is None:
            if self.mem_pool_host is None:
                raise InvalidArgumentError("batch_get needs target_locations before a host pool is registered")
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        if len(target_locations) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(target_locations)} target locations")
        start = time.perf_counter()
        ok = self._load(self._v0.keys(keys), list(target_locations))
        if not self.interface_v1:   # else batch_exists leased v1 keys, not these
            self._leases.read(keys, ok)
        self._count_load(ok, sum(nbytes_of(t) for t, hit in zip(target_locations, ok) if hit), start)
        return [t if hit else None for t, hit in zip(target_locations, ok)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store flat pages; ``True`` only if every page is stored. The caller keeps
        ownership of ``values``; nothing references them after the call returns."""
        if values is None or len(values) != len(keys):
            raise InvalidArgumentError(f"batch_set needs one value per key, got {keys and len(values or [])}")
        if not self.is_writer:
            return True  # MLA: another rank writes the shared copy
        values = [v.contiguous() if hasattr(v, "is_contiguous") and not v.is_contiguous() else v for v in values]
        start = time.perf_counter()
        ok = self._save(self._v0.keys(keys), values)
        self._count_save(ok, sum(nbytes_of(v) for v in values), start)
        return all(ok)

    def exists(self, key: str) -> bool:
        """Whether every block of the page is stored (may be stale on return)."""
        return all(self._store.contains(self._space().keys([key])))

    def batch_exists(self, keys: List[str], extra_info: Optional[Any] = None) -> int:
        """Number of leading pages that are stored. Those pages are leased until
        SGLang reads them, cannot read them any more, or ``lease_s`` passes."""
        space = self._space()
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        block_keys = space.keys(keys, prefix)
        lease_s = self.lease_s or None
        try:
            n = self._store.lookup(block_keys, lease_s=lease_s, hint=_hint_of(extra_info))
        except _STORE_FAILURES as exc:
            self._failure("lookup", exc)
            return 0
        seg = space.segments
        pages = n // seg
        if lease_s and n:
            self._leases.add(keys[:pages], [block_keys[i * seg:(i + 1) * seg] for i in range(pages)])
            if n % seg:   # leading segments of a page that is not whole: never read
                self._leases.drop_unheld(block_keys[pages * seg:n])
        self.metrics.add("hit_tokens", pages * self._page_tokens)
        return pages

    # -- zero-copy (v1) path: segments read and written in place -------------------------

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Optional[Any] = None) -> List[bool]:
        """Load pages straight into the host pool at ``host_indices`` (token slots,
        ``page_size`` per key). ``True`` per page only if all of its bytes verified."""
        segs, space = self._require_v1()
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        start = time.perf_counter()
        if segs.staged:
            ok = self._staged_load(segs, space.keys(keys, prefix), segs.page_starts(host_indices, len(keys)))
        else:
            views = segs.views(host_indices, len(keys))
            ok = self._per_page(self._load(space.keys(keys, prefix), views), space.segments)
        self._leases.read(keys, ok)
        self._count_load(ok, segs.page_bytes * sum(ok), start)
        return ok

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Optional[Any] = None) -> List[bool]:
        """Store pages straight from the host pool. A page is stored only if all of its
        segments are; stray segments of a failed page are removed."""
        segs, space = self._require_v1()
        if not self.is_writer:
            return [True] * len(keys)
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        block_keys = space.keys(keys, prefix)
        hint = _hint_of(extra_info)
        start = time.perf_counter()
        if segs.staged:
            ok = self._staged_save(segs, block_keys, segs.page_starts(host_indices, len(keys)), hint)
            self._count_save(ok, segs.page_bytes * len(keys), start)
            return ok
        views = segs.views(host_indices, len(keys))
        raw = self._save(block_keys, views, hint)
        ok = self._per_page(raw, space.segments)
        stray = [k for i, k in enumerate(block_keys) if raw[i] and not ok[i // space.segments]]
        if stray:
            try:
                self._store.delete(stray)
            except _STORE_FAILURES as exc:
                self._failure("delete", exc)
        self._count_save(ok, sum(v.nbytes for v in views), start)
        return ok

    # -- hybrid (v2) path: side pools beside the KV pool ---------------------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[Any]] = None,
                        extra_info: Optional[Any] = None) -> Any:
        """The longest prefix of ``keys`` (KV page hashes) that the KV pool AND every
        side pool in ``pool_transfers`` can restore, under each pool's hit policy
        (``all_pages``: every page of the prefix; ``trailing_pages``: its last
        ``len(transfer.keys)`` pages, e.g. the Mamba state at the prefix's end).
        ``restorable_prefix_pages`` lists every such length; only the KV pages of the
        longest are leased. A pool this backend does not hold restores nothing."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        space = self._space()
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        block_keys = space.keys(keys, prefix)
        lease_s = self.lease_s or None
        try:
            n = self._store.lookup(block_keys, lease_s=lease_s, hint=_hint_of(extra_info))
        except _STORE_FAILURES as exc:
            self._failure("lookup", exc)
            return PoolTransferResult(0, {}, [])
        seg = space.segments
        kv_pages = n // seg
        restorable = set(range(1, kv_pages + 1))
        hits: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
        for transfer in pool_transfers or ():
            name = pool_name(transfer.name)
            if name == "kv" or not restorable:
                continue
            side = self._side.get(name)
            if side is None:
                log.warning("sglang: no kvstore key space for host pool %r; the query is a miss", name)
                restorable = set()
                break
            try:
                present = self._store.contains(side[1].keys(keys[:kv_pages], prefix)) if kv_pages else []
            except _STORE_FAILURES as exc:
                self._failure("contains", exc)
                present = [False] * kv_pages
            pool_ok = restorable_prefixes(kv_pages, list(present), pool_name(transfer.hit_policy),
                                          len(transfer.keys or ()))
            if pool_ok:
                hits[name] = max(pool_ok)
            restorable &= pool_ok
        final = max(restorable, default=0)
        if lease_s and n:
            leased = final * seg
            if final:
                self._leases.add(keys[:final], [block_keys[i * seg:(i + 1) * seg] for i in range(final)])
            self._leases.drop_unheld(block_keys[leased:n])
        self.metrics.add("hit_tokens", final * self._page_tokens)
        return PoolTransferResult(final, hits, sorted(restorable))

    def batch_get_v2(self, transfers: List[Any], extra_info: Optional[Any] = None) -> dict:
        """Load each side pool's pages into its host slots. ``True`` per page only when
        the page's block verified and was written into the pool; a pool this backend
        does not hold, or slots that are not whole pages of it, read as misses."""
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        out: dict = {}
        for transfer in transfers:
            side, keys, starts = self._side_batch(transfer, "load")
            ok = [False] * len(keys)
            if side is not None and keys:
                pool, space, _ = side
                dsts = [pool.get_dummy_flat_data_page() for _ in keys]
                ok = self._load(space.keys(keys, prefix), dsts)
                for start, dst, hit in zip(starts, dsts, ok):
                    if hit:
                        pool.set_from_flat_data_page(int(start), dst)
            self._count_side("loaded", "missed", ok)
            out[transfer.name] = ok
        return out

    def batch_set_v2(self, transfers: List[Any], extra_info: Optional[Any] = None) -> dict:
        """Store each side pool's pages (one block per page) from its host slots."""
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        hint = _hint_of(extra_info)
        out: dict = {}
        for transfer in transfers:
            name = pool_name(transfer.name)
            side, keys, starts = self._side_batch(transfer, "save")
            if side is not None and not self.is_writer and name not in TP_SHARDED_POOLS:
                out[transfer.name] = [True] * len(keys)   # MLA: another rank writes the shared copy
                continue
            ok = [False] * len(keys)
            if side is not None and keys:
                pool, space, _ = side
                srcs = [pool.get_data_page(int(start), flat=True).contiguous() for start in starts]
                ok = self._save(space.keys(keys, prefix), srcs, hint)
            self._count_side("saved", "save_failed", ok)
            out[transfer.name] = ok
        return out

    def _side_batch(self, transfer: Any, op: str) -> tuple[Any, list, Any]:
        """(side pool or None, keys, first slot per page) of one transfer; None where
        this backend holds no such pool or the slots are not whole pages of it."""
        name = pool_name(transfer.name)
        keys = list(transfer.keys or ())
        side = self._side.get(name)
        if side is None:
            log.warning("sglang: no kvstore key space for host pool %r; %d pages not %sed", name, len(keys),
                        "load" if op == "load" else "sav")
            return None, keys, None
        pool, _, slots = side
        try:
            starts = page_starts(transfer.host_indices, len(keys), slots, int(getattr(pool, "size", 0) or 0))
        except InvalidArgumentError as exc:
            log.error("sglang: %s pool %r: %s; reported as failed", op, name, exc)
            return None, keys, None
        return side, keys, starts

    def _count_side(self, good_name: str, bad_name: str, ok: list[bool]) -> None:
        good = sum(ok)
        with self._lock:
            self._counters[f"side_pages_{good_name}"] += good
            self._counters[f"side_pages_{bad_name}"] += len(ok) - good

    # -- management ---------------------------------------------------------------------

    def clear(self) -> None:
        """Remove this backend's pages (SGLang calls this on ``POST
        /hicache/storage-backend/clear`` only; its ``/flush_cache`` and weight updates
        do not, see docs/sglang.md "Weight updates"). An embedded Store (this
        process's, shared only with connectors naming the same config) is emptied; on a
        shared server only the key spaces
        this backend uses (model, layout, shard, salt) are removed, so other engines'
        and tenants' pages stay. Raises when the store cannot clear: a flush that
        silently kept stale KV would serve it later."""
        self._leases.release_all()
        if self._embedded:
            self._store.clear()
        else:
            removed = self._store.clear(namespaces=self._namespaces)
            log.info("sglang: cleared %d blocks of this backend from kvstore server %s", removed, self._server)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` for the batches since the last call (drained),
        or ``None`` where SGLang's metrics module is not importable."""
        with self._lock:
            drained = {k: list(v) for k, v in self._metrics.items()}
            for v in self._metrics.values():
                v.clear()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        metrics = StorageMetrics()
        for name, values in drained.items():
            getattr(metrics, name).extend(values)
        return metrics

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot of the connector's page counters."""
        with self._lock:
            return dict(self._counters)

    def stats(self) -> dict[str, Any]:
        """Connector counters plus the Store's own ``stats()``."""
        return {**self.counters, "store": self._store.stats()}

    def close(self) -> None:
        """Give back the Store/Client this backend opened (a shared embedded Store
        closes with its last user). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._leases.release_all()
        except Exception as exc:  # closing anyway; the leases expire on their own
            log.warning("sglang: releasing leases on close failed (%s)", exc)
        self.metrics.close()
        if self._staging is not None:
            self._staging.close()
        release_store(self._store)

    # -- internals ----------------------------------------------------------------------

    def _space(self) -> PageKeys:
        if self.interface_v1:
            return self._require_v1()[1]
        return self._v0

    def _require_v1(self) -> tuple[PoolSegments, PageKeys]:
        if self._segments is None or self._v1 is None:
            raise InvalidArgumentError("the v1 interface needs extra_config interface_v1=1 and a registered host pool")
        return self._segments, self._v1

    def _release(self, keys: list) -> None:
        try:
            self._store.release(keys)
        except _STORE_FAILURES as exc:
            self._failure("release", exc)

    def _staged_load(self, segs: PoolSegments, keys: list, starts: Any) -> list[bool]:
        """Load one block per page into staging, then write into the pool only the
        pages whose every byte verified."""
        pb, ok = segs.page_bytes, []
        for lo, n, buf in self._staged_batches(len(keys), pb):
            host = buf.numpy()
            got = self._load(keys[lo:lo + n], [host[i * pb:(i + 1) * pb] for i in range(n)])
            if all(got):
                segs.scatter(starts[lo:lo + n], buf[:n * pb])
            else:
                for i in (i for i in range(n) if got[i]):
                    segs.scatter(starts[lo + i:lo + i + 1], buf[i * pb:(i + 1) * pb])
            ok += got
        return ok

    def _staged_save(self, segs: PoolSegments, keys: list, starts: Any, hint: Hint | None = None) -> list[bool]:
        """Gather pages into staging and store one block per page."""
        pb, ok = segs.page_bytes, []
        for lo, n, buf in self._staged_batches(len(keys), pb):
            segs.gather(starts[lo:lo + n], buf[:n * pb])
            host = buf.numpy()
            ok += self._save(keys[lo:lo + n], [host[i * pb:(i + 1) * pb] for i in range(n)], hint)
        return ok

    def _staged_batches(self, count: int, page_bytes: int) -> Any:
        """``(first, n, buffer)`` for each run of pages that fits the staging buffer
        (held for the whole iteration)."""
        assert self._staging is not None
        per = self._staging.nbytes // page_bytes
        with self._staging.buffer() as buf:
            for lo in range(0, count, per):
                yield lo, min(per, count - lo), buf

    @staticmethod
    def _per_page(ok: list[bool], segments: int) -> list[bool]:
        return [all(ok[i:i + segments]) for i in range(0, len(ok), segments)]

    def _load(self, keys: list, dsts: list) -> list[bool]:
        """Fail-closed load; a repeated key is loaded once and copied."""
        first, uniq = _first_positions(keys)
        try:
            got = self._store.load([keys[i] for i in uniq], [dsts[i] for i in uniq]).result()
        except BufferSizeError:
            got = [self._load_one(keys[i], dsts[i]) for i in uniq]
        except _STORE_FAILURES as exc:
            self._failure("load", exc)
            got = [False] * len(uniq)
        ok = [False] * len(keys)
        for i, hit in zip(uniq, got):
            ok[i] = bool(hit)
        for i, key in enumerate(keys):
            j = first[key]
            if j != i and ok[j]:
                copy_bytes(dsts[i], dsts[j])
                ok[i] = True
        return ok

    def _load_one(self, key: Any, dst: Any) -> bool:
        try:
            return bool(self._store.load([key], [dst]).result()[0])
        except BufferSizeError as exc:
            log.warning("sglang: stored block %r does not fit the page buffer (%s); reported as a miss", key, exc)
            return False
        except _STORE_FAILURES as exc:
            self._failure("load", exc)
            return False

    def _save(self, keys: list, srcs: list, hint: Hint | None = None) -> list[bool]:
        first, uniq = _first_positions(keys)
        try:
            got = self._store.save([keys[i] for i in uniq], [srcs[i] for i in uniq], hint=hint).result()
        except _STORE_FAILURES as exc:
            self._failure("save", exc)
            got = [False] * len(uniq)
        stored = dict(zip(uniq, got))
        return [bool(stored[first[key]]) for key in keys]

    def _failure(self, op: str, exc: BaseException) -> None:
        with self._lock:
            self._counters["store_failures"] += 1
        log.warning("sglang: kvstore %s failed (%s: %s); treated as a miss", op, type(exc).__name__, exc)

    def _count_load(self, ok: list[bool], nbytes: int, start: float) -> None:
        hits = sum(ok)
        self.metrics.add("loaded_tokens", hits * self._page_tokens)
        self.metrics.add("failed_loads", len(ok) - hits)
        with self._lock:
            self._counters["pages_loaded"] += hits
            self._counters["pages_missed"] += len(ok) - hits
            if self.storage_config.enable_storage_metrics and hits:
                self._metrics["prefetch_pgs"].append(hits)
                self._metrics["prefetch_bandwidth"].append(nbytes / max(time.perf_counter() - start, 1e-9) / 1e9)

    def _count_save(self, ok: list[bool], nbytes: int, start: float) -> None:
        good = sum(ok)
        self.metrics.add("dropped_saves", len(ok) - good)
        with self._lock:
            self._counters["pages_saved"] += good
            self._counters["pages_save_failed"] += len(ok) - good
            if self.storage_config.enable_storage_metrics and good:
                self._metrics["backup_pgs"].append(good)
                self._metrics["backup_bandwidth"].append(nbytes / max(time.perf_counter() - start, 1e-9) / 1e9)


def _hint_of(extra_info: Any) -> Hint | None:
    """A retention hint from ``extra_info.extra_info["kvstore"]``. SGLang's HiCache
    fills only ``prefix_keys`` (no request priority; its extra key is already in the
    page hash), so hints arrive where a deployment's own hook sets that dict."""
    fields = getattr(extra_info, "extra_info", None)
    return request_hint(fields) if fields else None


def _first_positions(keys: list) -> tuple[dict, list[int]]:
    """Where each distinct key first appears, and those positions in order (SGLang may
    name one page hash twice in a batch; the Store refuses duplicate keys)."""
    first: dict = {}
    uniq: list[int] = []
    for i, key in enumerate(keys):
        if key not in first:
            first[key] = i
            uniq.append(i)
    return first, uniq


__all__ = ["KVStoreHiCacheStorage"]
