"""Keys and page views for the SGLang connector (no SGLang import here).

Two key spaces, never mixed, because their bytes differ:

- **v0** (``get``/``set``/``batch_get``/``batch_set``): one block per page holding the
  host pool's *flat page* (``get_data_page(i, flat=True)``), whose element order
  depends on the pool layout.
- **v1** (``batch_get_v1``/``batch_set_v1``): a page is the list of contiguous
  segments the pool itself reports (``get_page_buffer_meta``: per layer K and V for
  ``layer_first``, K and V for the page-major layouts). Each segment is one block,
  read and written in place in the pool's memory, so the Store does the only copy.

Both namespaces carry the model, dtype, pool class and layout, layer count, page
size, bytes per token and the shard (TP rank/size; MLA: one shared shard), so a key
can only ever meet bytes of the same meaning.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from kvstore.buffers import host_view
from kvstore.errors import ConfigError, InvalidArgumentError
from kvstore.keys import BlockKey, Namespace


def shard_of(cfg: Any) -> tuple[int, int, str]:
    """(rank, world_size, extra) of the KV shard this SGLang rank holds.

    MLA KV is replicated over TP, so all TP ranks share rank 0 of 1 (DCP splits it
    into ``dcp_size`` shards). Pipeline and attention-CP stages hold different bytes
    and go into ``extra``.
    """
    extra = []
    if cfg.pp_size > 1:
        extra.append(f"pp{cfg.pp_rank}/{cfg.pp_size}")
    if cfg.attn_cp_size > 1:
        extra.append(f"cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}")
    if cfg.is_mla_model:
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


def make_namespace(model: str, dtype: str, layout: str, page_tokens: int, cfg: Any, salt: str) -> Namespace:
    rank, world, extra = shard_of(cfg)
    return Namespace(model=model, dtype=dtype, chunk_tokens=page_tokens, layout=layout,
                     rank=rank, world_size=world,
                     salt=json.dumps({"shard": extra, "user": salt}, sort_keys=True))


class PoolSegments:
    """In-place views of a host pool's pages, as the pool reports them.

    Built once at registration from ``pool.kv_buffer`` (one contiguous host tensor).
    Segment offsets of SGLang's MHA/MLA layouts are affine in the page's first token
    slot; that is checked here against ``get_page_buffer_meta`` at three pages, and
    then offsets are computed in bulk (the pool's own per-page Python loop otherwise
    costs as much as a small page's copy). Pools whose offsets are not affine are
    asked page by page. The views alias pool memory: the pool owns it; callers must
    not keep views past the batch. Thread-safe (read-only state).
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
        self._arena = host_view(buf, writable=True)
        self._base = int(buf.data_ptr())
        first = self._meta_at(0)
        self.per_page = len(first)
        self._sizes = [size for _, size in first]
        self._const = np.array([off for off, _ in first], dtype=np.int64)
        self._slope: np.ndarray | None = None
        slots = int(getattr(pool, "size", 0))
        if slots >= 3 * self.page_size:
            second = np.array([off for off, _ in self._meta_at(self.page_size)], dtype=np.int64)
            slope = (second - self._const) // self.page_size
            last = (slots // self.page_size - 1) * self.page_size
            if np.array_equal(np.array([off for off, _ in self._meta_at(last)]), self._const + slope * last):
                self._slope = slope

    def _meta_at(self, slot: int) -> list[tuple[int, int]]:
        return [(off - self._base, size) for off, size in self._meta(np.arange(slot, slot + self.page_size))]

    def _meta(self, indices: Any) -> list[tuple[int, int]]:
        import torch

        idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(indices)
        ptrs, sizes = self.pool.get_page_buffer_meta(idx)
        return list(zip(ptrs, sizes))

    def views(self, host_indices: Any, n_pages: int) -> list[np.ndarray]:
        """Segment views for ``n_pages`` pages starting at each ``page_size``-th entry
        of ``host_indices`` (SGLang passes token slots), page-major."""
        if len(host_indices) != n_pages * self.page_size:
            raise InvalidArgumentError(
                f"host_indices has {len(host_indices)} slots, expected {n_pages} pages x {self.page_size}")
        if self._slope is not None:
            starts = np.asarray(host_indices[::self.page_size], dtype=np.int64)
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


__all__ = ["PageKeys", "PoolSegments", "make_namespace", "pool_signature", "shard_of"]
