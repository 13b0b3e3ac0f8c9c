"""Keys and page views for the SGLang connector (no SGLang import here).

Two key spaces, never mixed, because their bytes differ:

- **v0** (``get``/``set``/``batch_get``/``batch_set``): one block per page holding the
  host pool's *flat page* (``get_data_page(i, flat=True)``), whose element order
  depends on the pool layout.
- **v1** (``batch_get_v1``/``batch_set_v1``): for the page-major layouts a page is
  the contiguous segments the pool itself reports (``get_page_buffer_meta``: K and
  V), each one block, read and written in place in the pool's memory, so the Store
  does the only copy. ``layer_first`` scatters a page over 2 x layers segments; it
  is stored as ONE block per page (K of every layer, then V of every layer),
  gathered into and scattered from a bounded staging buffer.

Both namespaces carry the model, dtype (the pool's storage dtype plus the logical
``kv_cache_dtype``), pool class and layout, layer count, page size, bytes per token,
the shard (TP rank/size; MLA: one shared shard) and the engine settings that change
every byte (model path, revision, quantization, overrides, compute dtype,
``weights_version``), so a key can only ever meet bytes of the same meaning.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np

from kvstore.buffers import host_view
from kvstore.errors import ConfigError, InvalidArgumentError
from kvstore.keys import BlockKey, Namespace


def shard_of(cfg: Any, tp_sharded: bool = False) -> tuple[int, int, str]:
    """(rank, world_size, extra) of the KV shard this SGLang rank holds.

    MLA KV is replicated over TP, so all TP ranks share rank 0 of 1 (DCP splits it
    into ``dcp_size`` shards). Pipeline and attention-CP stages hold different bytes
    and go into ``extra``. ``tp_sharded``: bytes that differ per TP rank even in an
    MLA model (Mamba state).
    """
    extra = []
    if cfg.pp_size > 1:
        extra.append(f"pp{cfg.pp_rank}/{cfg.pp_size}")
    if cfg.attn_cp_size > 1:
        extra.append(f"cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}")
    if cfg.is_mla_model and not tp_sharded:
        dcp_size = getattr(cfg, "dcp_size", 1)
        if dcp_size > 1:
            extra.append(f"page{cfg.logical_page_size}")
        return (getattr(cfg, "dcp_rank", 0), dcp_size, ",".join(extra))
    return cfg.tp_rank, cfg.tp_size, ",".join(extra)


def pool_signature(pool: Any) -> tuple[str, str, int]:
    """(dtype, layout description, page size) of a registered host pool."""
    try:
        per_token = int(pool.get_size_per_token())
    except (AttributeError, TypeError):
        per_token = int(getattr(pool, "size_per_token", 0))
    layout = (f"{type(pool).__name__}:{pool.layout}:layers={getattr(pool, 'layer_num', '?')}"
              f":bytes_per_token={per_token}")
    return str(pool.dtype).replace("torch.", ""), layout, int(pool.page_size)


class PageKeys:
    """Maps SGLang page hashes (hex strings) to BlockKeys in one namespace.

    ``segments`` is 1 for v0 and the number of pool segments per page for v1. Keys
    are stable across processes; the parent link (the previous page's key) only
    guides lineage eviction and does not enter the digest. SGLang's page hashes are
    a chain, so a page's parent never changes and keys are cached with it once
    known. Thread-safe: the cache is a bounded dict; a race only recomputes.
    """

    _CACHE_PAGES = 1 << 16

    def __init__(self, ns: Namespace, segments: int) -> None:
        self.ns = ns
        self.segments = segments
        self._cache: OrderedDict[str, list[BlockKey]] = OrderedDict()

    def _page(self, page_hash: str, prev: list[BlockKey] | None) -> list[BlockKey]:
        got = self._cache.get(page_hash)
        if got is not None and (prev is None or got[0].parent is not None):
            return got
        if got is None:
            if not isinstance(page_hash, str) or not page_hash:
                raise InvalidArgumentError(f"SGLang page keys must be non-empty strings, got {page_hash!r}")
            if self.segments == 1:
                digests = [self.ns.key_for(page_hash).digest]
            else:
                digests = [self.ns.key_for(f"{page_hash}/{s}").digest for s in range(self.segments)]
        else:
            digests = [k.digest for k in got]
        ns = self.ns.digest
        if prev is None:
            got = [BlockKey(d, None, ns) for d in digests]
        else:
            got = [BlockKey(d, p.digest, ns) for d, p in zip(digests, prev)]
        self._cache[page_hash] = got
        if len(self._cache) > self._CACHE_PAGES:
            try:
                self._cache.popitem(last=False)
            except KeyError:
                pass
        return got

    def keys(self, pages: Sequence[str], prefix: Sequence[str] | None = None) -> list[BlockKey]:
        """All segment keys of ``pages``, page-major (page 0's segments first)."""
        prev = self._page(prefix[-1], None) if prefix else None
        out: list[BlockKey] = []
        for page in pages:
            prev = self._page(page, prev)
            out.extend(prev)
        return out


# Storage dtypes that hold several KV formats (every fp8 and fp4 format is stored as uint8).
_OPAQUE_DTYPES = {"uint8", "int8"}


def kv_dtype(pool_dtype: str, kv_cache_dtype: str | None) -> str:
    """The namespace dtype: the pool's storage dtype, plus SGLang's ``kv_cache_dtype``
    when it names a format (``auto`` adds nothing, so default keys stay). A pool whose
    storage dtype cannot tell its formats apart is refused without one."""
    kv = str(kv_cache_dtype or "auto")
    if kv == "auto":
        if pool_dtype in _OPAQUE_DTYPES:
            raise ConfigError(f"sglang: the host pool stores KV as {pool_dtype}, which every fp8/fp4 format "
                              "shares, and the KV cache dtype is not known; set extra_config 'kv_cache_dtype' "
                              "(the value of --kv-cache-dtype)")
        return pool_dtype
    return f"{pool_dtype}/{kv}"


def engine_identity(server_args: Any, model: str, weights_version: str | None) -> dict[str, str]:
    """What changes every KV byte besides the served name and the pool: the model path
    (when the name is not the path) and revision, quantization, model-config
    overrides, the compute dtype and a ``weights_version``. Defaults add nothing."""
    out: dict[str, str] = {}
    sa = server_args
    path = getattr(sa, "model_path", None)
    # Any served name other than the path itself: a prefix test (for SGLang's "-<format
    # tag>" suffix) let a base model served under its instruct variant's name share it.
    if path and model != path:
        out["path"] = str(path)
    for attr, tag in (("revision", "revision"), ("quantization", "quant"), ("dtype", "dtype")):
        value = getattr(sa, attr, None)
        if value and value != "auto":
            out[tag] = str(value)
    overrides = getattr(sa, "json_model_override_args", None)
    if overrides and overrides not in ("{}", {}):
        if isinstance(overrides, str):
            try:
                overrides = json.loads(overrides)
            except ValueError:
                pass
        canonical = json.dumps(overrides, sort_keys=True, separators=(",", ":"))
        out["overrides"] = hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()
    if weights_version:
        out["weights"] = str(weights_version)
    return out


def make_namespace(model: str, dtype: str, layout: str, page_tokens: int, cfg: Any, salt: str,
                   identity: dict[str, str] | None = None, tp_sharded: bool = False) -> Namespace:
    rank, world, extra = shard_of(cfg, tp_sharded)
    fields: dict[str, Any] = {"shard": extra, "user": salt}
    if identity:
        fields["engine"] = identity
    return Namespace(model=model, dtype=dtype, chunk_tokens=page_tokens, layout=layout,
                     rank=rank, world_size=world, salt=json.dumps(fields, sort_keys=True))


class PoolSegments:
    """The blocks of a host pool's pages: in-place views, or (``layer_first``) one
    staged block per page.

    Built once at registration from ``pool.kv_buffer`` (one contiguous host tensor).
    Segment offsets of SGLang's MHA/MLA layouts are affine in the page's first token
    slot; that is checked here against ``get_page_buffer_meta`` at three pages, and
    then offsets are computed in bulk (the pool's own per-page Python loop otherwise
    costs as much as a small page's copy). Pools whose offsets are not affine are
    asked page by page. The views alias pool memory: the pool owns it; callers must
    not keep views past the batch.

    Layer-major pools (``layer_first``, more than 2 segments per page: ``staged``) are
    moved with :func:`kvstore.paged.gather_pages` / ``scatter_pages`` over
    ``kv_buffer`` seen as ``(..., pages, page, ...)``: one block of ``page_bytes`` per
    page, in the buffer's memory order. Thread-safe (read-only state).
    """

    def __init__(self, pool: Any) -> None:
        buf = getattr(pool, "kv_buffer", None)
        if buf is None or not hasattr(pool, "get_page_buffer_meta"):
            raise ConfigError(f"interface_v1 needs a host pool with one kv_buffer and get_page_buffer_meta; "
                              f"{type(pool).__name__} has none")
        if buf.device.type != "cpu":
            raise ConfigError(f"interface_v1 needs the host pool in host memory, got {buf.device}")
        self.pool = pool
        self.page_size = int(pool.page_size)
        self._slots = int(getattr(pool, "size", 0))
        self._arena = host_view(buf, writable=True)
        self._base = int(buf.data_ptr())
        first = self._meta_at(0)
        self.staged = len(first) > 2 and self._init_staged(buf, first)
        if self.staged:
            return
        self.per_page = len(first)
        self._sizes = [size for _, size in first]
        self.page_bytes = sum(self._sizes)
        self._const = np.array([off for off, _ in first], dtype=np.int64)
        self._slope: np.ndarray | None = None
        slots = self._slots
        if slots >= 3 * self.page_size:
            second = np.array([off for off, _ in self._meta_at(self.page_size)], dtype=np.int64)
            slope = (second - self._const) // self.page_size
            last = (slots // self.page_size - 1) * self.page_size
            if np.array_equal(np.array([off for off, _ in self._meta_at(last)]), self._const + slope * last):
                self._slope = slope

    def _init_staged(self, buf: Any, first: list[tuple[int, int]]) -> bool:
        """Layer-major pools (MHA ``layer_first``: ``(2, layers, slots, heads, dim)``;
        MLA ``layer_first``: ``(layers, slots, 1, dim)``): see ``kv_buffer`` as
        ``(..., pages, page, ...)`` and use it when a page there is exactly the
        segments the pool reports (checked at two pages). Else ``False``: segments."""
        from kvstore.paged import page_bytes_of

        P, slots = self.page_size, self._slots
        dims = [d for d, n in enumerate(buf.shape) if n == slots]
        if not buf.is_contiguous() or len(dims) != 1 or slots % P or slots < 2 * P:
            return False
        d = dims[0]
        paged = buf.unflatten(d, (slots // P, P))
        elt = buf.element_size()
        run = P * buf.stride(d) * elt                                    # bytes of one run
        outer = np.indices(buf.shape[:d]).reshape(d, -1).T if d else np.zeros((1, 0), np.int64)
        offs = (outer * np.array(buf.stride()[:d], dtype=np.int64)).sum(axis=1) * elt
        for page in (0, 1):
            want = sorted((int(o) + page * run, run) for o in offs)
            if sorted(first if page == 0 else self._meta_at(P)) != want:
                return False
        self._paged = paged
        self.per_page = 1
        self.page_bytes = page_bytes_of(paged, d)
        self._page_dim = d
        return True

    def _meta_at(self, slot: int) -> list[tuple[int, int]]:
        return [(off - self._base, size) for off, size in self._meta(np.arange(slot, slot + self.page_size))]

    def _meta(self, indices: Any) -> list[tuple[int, int]]:
        import torch

        idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices)
        ptrs, sizes = self.pool.get_page_buffer_meta(idx)
        return list(zip(ptrs, sizes))

    def page_starts(self, host_indices: Any, n_pages: int) -> np.ndarray:
        """First token slot of each page, after checking that every page is
        ``page_size`` consecutive slots starting at a page boundary inside the pool:
        the pool's own metadata reads only each page's first slot, so any other
        shape would move bytes of slots SGLang did not name."""
        P = self.page_size
        if len(host_indices) != n_pages * P:
            raise InvalidArgumentError(
                f"host_indices has {len(host_indices)} slots, expected {n_pages} pages x {P}")
        idx = np.asarray(host_indices.cpu() if hasattr(host_indices, "cpu") else host_indices,
                         dtype=np.int64).reshape(n_pages, P)
        starts = idx[:, 0]
        if n_pages and ((idx - starts[:, None] != np.arange(P)).any() or (starts % P).any()
                        or starts.min() < 0 or (self._slots and starts.max() + P > self._slots)
                        or len(np.unique(starts)) != n_pages):
            raise InvalidArgumentError(f"host_indices must be whole pages: {P} consecutive slots "
                                       f"from a multiple of {P}, inside the pool, none twice")
        return starts

    def views(self, host_indices: Any, n_pages: int) -> list[np.ndarray]:
        """Segment views for ``n_pages`` pages starting at each ``page_size``-th entry
        of ``host_indices`` (SGLang passes token slots), page-major. Not for staged pools."""
        starts = self.page_starts(host_indices, n_pages)
        if self._slope is not None:
            offsets = (self._const[None, :] + starts[:, None] * self._slope[None, :]).ravel().tolist()
            sizes = self._sizes * n_pages
        else:
            meta = self._meta(host_indices)
            if len(meta) != n_pages * self.per_page:
                raise InvalidArgumentError(f"pool reported {len(meta)} segments for {n_pages} pages, "
                                           f"expected {self.per_page} per page")
            offsets = [int(ptr) - self._base for ptr, _ in meta]
            sizes = [size for _, size in meta]
        arena, limit = self._arena, self._arena.nbytes
        out = []
        for off, size in zip(offsets, sizes):
            if off < 0 or off + size > limit:
                raise InvalidArgumentError(f"pool segment at offset {off} (+{size}) lies outside kv_buffer")
            out.append(arena[off:off + size])
        return out

    def gather(self, starts: np.ndarray, out: Any) -> None:
        """Staged pools: copy the pages at ``starts`` into ``out`` (a contiguous uint8
        tensor of ``len(starts) * page_bytes``), page after page."""
        import torch
        from kvstore.paged import gather_pages

        gather_pages(self._paged, self._page_dim, torch.from_numpy(starts // self.page_size), out)

    def scatter(self, starts: np.ndarray, src: Any) -> None:
        """Staged pools: write consecutive pages of ``src`` into the pages at ``starts``."""
        import torch
        from kvstore.paged import scatter_pages

        scatter_pages(self._paged, self._page_dim, torch.from_numpy(starts // self.page_size), src)


class Staging:
    """Reusable host buffers for staged pages, ``nbytes`` each, one per concurrent
    caller (SGLang's prefetch and backup threads: two). ``held_bytes`` is what it
    holds; buffers are kept for reuse, never grown. Thread-safe."""

    def __init__(self, nbytes: int, on_change: Any = None) -> None:
        self.nbytes = nbytes
        self._free: list[Any] = []
        self._held = 0
        self._lock = threading.Lock()
        self._on_change = on_change

    @property
    def held_bytes(self) -> int:
        return self._held

    @contextmanager
    def buffer(self) -> Iterator[Any]:
        import torch

        with self._lock:
            buf = self._free.pop() if self._free else None
            if buf is None:
                self._held += self.nbytes
                held = self._held
        if buf is None:
            buf = torch.empty(self.nbytes, dtype=torch.uint8)
            if self._on_change is not None:
                self._on_change(held)
        try:
            yield buf
        finally:
            with self._lock:
                self._free.append(buf)

    def close(self) -> None:
        with self._lock:
            self._free.clear()
            self._held = 0
        if self._on_change is not None:
            self._on_change(0)


class LeaseBook:
    """Store leases that ``batch_exists`` took, per query, until SGLang can no longer
    read those pages; then they are released.

    SGLang 0.5.23 never tells a backend that a prefetch was skipped (below
    ``prefetch_threshold``, no host memory, rank vote), truncated or terminated
    (``best_effort``/``timeout`` stop policies). What its HiCacheController does
    guarantee: one thread queries, one thread reads, and prefetches are read in the
    order they were queried; a prefetch reads its pages in order, in batches of
    ``batch_pages`` (the last one shorter), and stops at the first page that fails.
    So, on each read of a query's pages:

    - the pages it loads lose their lease (the Store drops it on load);
    - pages of that query before the read's first page (a head SGLang trimmed) and,
      when the read fails a page or is shorter than a batch, every page after it,
      are released: no later read of that prefetch will come;
    - every older query is released: it was read in full, cut short or skipped.

    What no read follows (the last queries before the engine falls idle) keeps its
    lease until ``lease_s`` ends; :meth:`release_all` drops everything (clear,
    close). The Store counts leases per holder: each query's lease on a key is
    released once, by that query (or consumed by the load that reads it), so a key two
    live queries lease stays protected until both let go. Thread-safe.
    """

    def __init__(self, release: Any, batch_pages: int) -> None:
        self._release = release          # callable(list of BlockKey): drop Store leases
        self._batch_pages = batch_pages
        self._queries: "OrderedDict[int, dict[str, int]]" = OrderedDict()  # id -> page -> index
        self._pages: dict[int, list[list[BlockKey]]] = {}                  # id -> keys per page
        self._next = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._queries)

    def add(self, pages: Sequence[str], page_keys: Sequence[list[BlockKey]]) -> None:
        """Record one query whose leading ``pages`` are leased (keys per page)."""
        if not pages:
            return
        with self._lock:
            qid = self._next
            self._next += 1
            index: dict[str, int] = {}
            for i, page in enumerate(pages):
                index.setdefault(page, i)
            self._queries[qid] = index
            self._pages[qid] = [list(k) for k in page_keys]

    def read(self, pages: Sequence[str], ok: Sequence[bool]) -> None:
        """A read of ``pages`` finished with ``ok`` per page; release what no read
        will use any more."""
        if not pages:
            return
        drop: list[BlockKey] = []
        with self._lock:
            qid = next((q for q, index in self._queries.items() if pages[0] in index), None)
            if qid is None:
                return   # a read no query of ours announced (SGLang's assume_stored)
            for older in [q for q in self._queries if q < qid]:
                drop += self._forget(older, 0, None)
            first = self._queries[qid][pages[0]]
            n_pages = len(self._pages[qid])
            end = min(first + len(pages), n_pages)
            drop += self._forget(qid, 0, first, keep_query=True)
            drop += self._forget(qid, first, end, keep_query=True, loaded=ok[:end - first])
            if not all(ok) or len(pages) < self._batch_pages or end >= n_pages:
                drop += self._forget(qid, end, None)
        if drop:
            self._release(drop)

    def drop_unheld(self, keys: Sequence[BlockKey]) -> None:
        """Release the leases a query took on ``keys`` that it does not keep (segments
        of a page that is only partly stored)."""
        if keys:
            self._release(list(keys))

    def release_all(self) -> None:
        with self._lock:
            drop = []
            for qid in list(self._queries):
                drop += self._forget(qid, 0, None)
        if drop:
            self._release(drop)

    def _forget(self, qid: int, start: int, stop: int | None, *, keep_query: bool = False,
                loaded: Sequence[bool] | None = None) -> list[BlockKey]:
        """Let go of query ``qid``'s pages ``[start, stop)``: their keys, to release
        once each, except those of ``loaded`` pages (the load consumed this query's
        lease). Under the lock."""
        per_page = self._pages[qid]
        stop = len(per_page) if stop is None else stop
        out: list[BlockKey] = []
        for i in range(start, stop):
            keys, per_page[i] = per_page[i], []
            if not (loaded is not None and i - start < len(loaded) and loaded[i - start]):
                out += keys
        if not keep_query:
            self._queries.pop(qid, None)
            self._pages.pop(qid, None)
        return out


__all__ = ["LeaseBook", "PageKeys", "PoolSegments", "Staging", "engine_identity", "kv_dtype", "make_namespace",
           "pool_signature", "shard_of"]
