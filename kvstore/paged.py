"""Move pages of a paged KV cache to and from contiguous chunk buffers.

A paged cache is any tensor with one *page dimension* (vLLM's blocks, SGLang's pages);
a page is everything else at one index of that dimension. Pages are moved as raw bytes
in memory order, so the same code serves every layout (token-major, head-major,
layer-interleaved, MLA) and every dtype, on any torch device: one batched index op per
call, never a Python loop per page.

How: a page is one or more dense *runs* of memory (one run for most layouts; one per
head when heads are outermost, as in vLLM's ``LHBNC``). The cache's storage is seen as a
matrix of runs, in the widest integer words the alignment allows (torch's index ops move
8-byte words several times faster than bytes), and pages are gathered with one
``index_select`` and scattered with one ``index_copy_`` over run indices. The bytes of a
page come out in memory order, so a page of a given layout always has the same bytes.
A cache whose runs do not tile its storage falls back to the same ops on a typed view.

Buffer ownership: callers own every tensor; nothing here keeps a reference after
returning. Thread-safety: the functions are pure; concurrent calls on the same cache
are safe as long as their page sets do not overlap where one of them writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from kvstore.errors import BufferSizeError, InvalidArgumentError

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class _Runs:
    """Where one cache's pages lie in a matrix of runs over its storage."""

    matrix: torch.Tensor    # [rows, run_words], a view over the whole storage
    base: int               # row of page 0's first run
    step: int               # rows from one page to the next
    offsets: torch.Tensor   # [runs_per_page] rows of a page's runs, in memory order

    def rows(self, pages: torch.Tensor) -> torch.Tensor:
        """``pages.shape + (runs_per_page,)`` row indices."""
        return (self.base + pages * self.step).unsqueeze(-1) + self.offsets


def page_bytes_of(cache: torch.Tensor, page_dim: int = 0) -> int:
    """Bytes in one page of ``cache``."""
    d = _dim(cache, page_dim)
    return math.prod(size for i, size in enumerate(cache.shape) if i != d) * cache.element_size()


def gather_pages(cache: torch.Tensor, page_dim: int, page_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Copy pages ``page_ids`` of ``cache`` into the contiguous tensor ``out`` (same
    device), page after page. ``out`` may have any dtype and shape; it must hold exactly
    ``len(page_ids) * page_bytes`` bytes."""
    ids = _device_ids(page_ids, cache.shape[_dim(cache, page_dim)], cache.device)
    runs = _runs(cache, page_dim, {})
    if runs is None:
        _typed_gather(_typed_view(cache, page_dim), ids, out)
    else:
        _gather_rows(runs.matrix, runs.rows(ids).reshape(-1), out, ids.numel() * page_bytes_of(cache, page_dim))


def scatter_pages(cache: torch.Tensor, page_dim: int, page_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Inverse of :func:`gather_pages`: write consecutive pages of ``src`` into pages
    ``page_ids`` of ``cache``. ``page_ids`` must not repeat."""
    ids = _device_ids(page_ids, cache.shape[_dim(cache, page_dim)], cache.device)
    runs = _runs(cache, page_dim, {})
    if runs is None:
        _typed_scatter(_typed_view(cache, page_dim), ids, src)
    else:
        _scatter_rows(runs.matrix, runs.rows(ids).reshape(-1), src, ids.numel() * page_bytes_of(cache, page_dim))


class PagedLayers:
    """Several per-layer paged caches moved together, chunk by chunk.

    A *chunk* is ``blocks_per_chunk`` blocks of every layer, laid out as
    ``[layer][block][page bytes]`` in one contiguous buffer of :attr:`chunk_bytes`.
    ``pages_per_block`` > 1 covers caches whose page dim counts kernel blocks, several
    per block. When all layers live in one allocation with the same run size (vLLM's
    ``allocate_kv_cache`` does this) all layers of all chunks move with one index op;
    otherwise one op per layer (and chunk).

    Thread-safety: the object is immutable after construction.
    """

    def __init__(self, caches: Sequence[torch.Tensor], *, blocks_per_chunk: int,
                 page_dim: int = 0, pages_per_block: int = 1) -> None:
        if not caches:
            raise InvalidArgumentError("PagedLayers needs at least one cache tensor")
        if blocks_per_chunk < 1 or pages_per_block < 1:
            raise InvalidArgumentError("blocks_per_chunk and pages_per_block must be >= 1")
        self.device = caches[0].device
        if any(c.device != self.device for c in caches):
            raise InvalidArgumentError("all caches must live on one device")
        matrices: dict = {}
        self._runs = [_runs(c, page_dim, matrices) for c in caches]
        self._typed = [_typed_view(c, page_dim) if r is None else None for c, r in zip(caches, self._runs)]
        self.pages_per_block = pages_per_block
        self.blocks_per_chunk = blocks_per_chunk
        self.num_blocks = min(c.shape[_dim(c, page_dim)] for c in caches) // pages_per_block
        self.page_bytes = [page_bytes_of(c, page_dim) for c in caches]
        rows = pages_per_block * blocks_per_chunk
        self.layer_bytes = [rows * p for p in self.page_bytes]  # one layer of one chunk
        self.layer_offsets = [sum(self.layer_bytes[:i]) for i in range(len(caches))]
        self.chunk_bytes = sum(self.layer_bytes)
        self._combined = self._combine()

    @property
    def num_layers(self) -> int:
        return len(self._runs)

    @property
    def single_op(self) -> bool:
        """Whether whole-chunk moves are one index op over all layers."""
        return self._combined is not None

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Chunks of blocks ``block_ids`` (``[n_chunks, blocks_per_chunk]``) into ``out``
        (contiguous, ``n_chunks * chunk_bytes`` bytes, same device as the caches)."""
        n = block_ids.shape[0]
        if self._combined is None:
            for layer in range(self.num_layers):
                self.gather_layer(layer, block_ids, out)
            return
        matrix, rows = self._combined_rows(block_ids)
        _gather_rows(matrix, rows.reshape(-1), out, n * self.chunk_bytes)

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Inverse of :meth:`gather`. ``keep`` (bool, shaped like ``block_ids``) leaves
        the blocks where it is False untouched (e.g. blocks a request already holds)."""
        n = block_ids.shape[0]
        if self._combined is None:
            for layer in range(self.num_layers):
                self.scatter_layer(layer, block_ids, src, keep=keep)
            return
        matrix, rows = self._combined_rows(block_ids)                  # [n, L, R, runs]
        mask = None if keep is None else self._page_mask(keep)[:, None, :, None].expand(rows.shape)
        _scatter_rows(matrix, rows.reshape(-1), src, n * self.chunk_bytes, mask)

    def gather_layer(self, layer: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """One layer's pages of the chunks ``block_ids`` into its place in ``out``."""
        dst = _bytes(out, block_ids.shape[0] * self.chunk_bytes).view(block_ids.shape[0], self.chunk_bytes)
        lo, hi = self.layer_offsets[layer], self.layer_offsets[layer] + self.layer_bytes[layer]
        pages = self._pages(block_ids)
        runs = self._runs[layer]
        for c in range(block_ids.shape[0]):
            if runs is None:
                _typed_gather(self._typed[layer], pages[c], dst[c, lo:hi])
            else:
                _gather_rows(runs.matrix, runs.rows(pages[c]).reshape(-1), dst[c, lo:hi], hi - lo)

    def scatter_layer(self, layer: int, block_ids: torch.Tensor, src: torch.Tensor,
                      keep: torch.Tensor | None = None) -> None:
        """Inverse of :meth:`gather_layer`; ``keep`` as in :meth:`scatter`."""
        data = _bytes(src, block_ids.shape[0] * self.chunk_bytes).view(block_ids.shape[0], self.chunk_bytes)
        lo, hi = self.layer_offsets[layer], self.layer_offsets[layer] + self.layer_bytes[layer]
        pages = self._pages(block_ids)
        mask = None if keep is None else self._page_mask(keep)
        runs = self._runs[layer]
        for c in range(block_ids.shape[0]):
            if runs is None:
                part, ids = data[c, lo:hi], pages[c]
                if mask is not None:
                    sel = mask[c].nonzero().view(-1).to(data.device, non_blocking=True)
                    page = self.page_bytes[layer]
                    part, ids = part.view(-1, page).index_select(0, sel), ids[sel]
                _typed_scatter(self._typed[layer], ids, part)
            else:
                rows = runs.rows(pages[c])
                m = None if mask is None else mask[c].unsqueeze(-1).expand(rows.shape)
                _scatter_rows(runs.matrix, rows.reshape(-1), data[c, lo:hi], hi - lo, m)

    # -- internals ------------------------------------------------------------------------

    def _pages(self, block_ids: torch.Tensor) -> torch.Tensor:
        """``[n, blocks_per_chunk * pages_per_block]`` page indices of each chunk."""
        ids = _device_ids(block_ids, self.num_blocks, self.device)
        ppb = self.pages_per_block
        if ppb == 1:
            return ids
        sub = torch.arange(ppb, device=self.device)
        return (ids.unsqueeze(-1) * ppb + sub).reshape(ids.shape[0], -1)

    def _page_mask(self, keep: torch.Tensor) -> torch.Tensor:
        """Per-block ``keep`` widened to per-page, ``[n, blocks_per_chunk * pages_per_block]``,
        left where it is (masks from the host are turned into index lists there)."""
        return keep.to(dtype=torch.bool).repeat_interleave(self.pages_per_block, dim=1)

    def _combine(self):
        """Per-layer (base, step, offsets) stacked, when every layer indexes one matrix
        with the same number of runs per page."""
        runs = self._runs
        if any(r is None for r in runs):
            return None
        first = runs[0]
        if any(r.matrix is not first.matrix or r.offsets.numel() != first.offsets.numel() for r in runs):
            return None
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return (first.matrix, as_long([r.base for r in runs]), as_long([r.step for r in runs]),
                torch.stack([r.offsets for r in runs]))

    def _combined_rows(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, L, pages, runs]`` row indices in chunk layout order."""
        matrix, base, step, offsets = self._combined
        pages = self._pages(block_ids)                                            # [n, R]
        rows = base.view(1, -1, 1) + pages.unsqueeze(1) * step.view(1, -1, 1)    # [n, L, R]
        return matrix, rows.unsqueeze(-1) + offsets.unsqueeze(0).unsqueeze(2)


def _runs(cache: torch.Tensor, page_dim: int, matrices: dict) -> _Runs | None:
    """The run matrix of ``cache``, or None when its runs do not tile the storage.
    ``matrices`` caches one matrix per (storage, run size) so layers can share it."""
    d = _dim(cache, page_dim)
    es = cache.element_size()
    dims = sorted((i for i in range(cache.dim()) if i != d and cache.shape[i] != 1),
                  key=lambda i: cache.stride(i), reverse=True)       # outer to inner
    run, k = 1, len(dims)
    while k and cache.stride(dims[k - 1]) == run:                   # the dense inner dims
        run *= cache.shape[dims[k - 1]]
        k -= 1
    run_bytes = run * es
    storage = cache.untyped_storage()
    starts = [cache.storage_offset() * es, cache.stride(d) * es] + [cache.stride(i) * es for i in dims[:k]]
    if any(s % run_bytes for s in starts) or storage.nbytes() < run_bytes:
        return None
    word = _word(run_bytes, storage.data_ptr())
    key = (storage.data_ptr(), storage.nbytes(), run_bytes, word)
    matrix = matrices.get(key)
    if matrix is None:
        flat = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage)
        matrix = flat[: storage.nbytes() // run_bytes * run_bytes].view(_WORDS[word]).view(-1, run_bytes // word)
        matrices[key] = matrix
    offsets = torch.zeros(1, dtype=torch.long)
    for i in dims[:k]:
        offsets = (offsets.unsqueeze(1) + torch.arange(cache.shape[i]) * (cache.stride(i) * es // run_bytes)).reshape(-1)
    return _Runs(matrix, cache.storage_offset() * es // run_bytes, cache.stride(d) * es // run_bytes,
                 offsets.to(cache.device))


def _typed_view(cache: torch.Tensor, page_dim: int) -> torch.Tensor:
    """``cache`` with the page dim first and the others in memory order."""
    d = _dim(cache, page_dim)
    rest = sorted((i for i in range(cache.dim()) if i != d), key=lambda i: cache.stride(i), reverse=True)
    return cache.permute(d, *rest)


def _word(*byte_counts: int) -> int:
    """The widest word size (8, 4, 2, 1) dividing every count."""
    for word in (8, 4, 2):
        if all(n % word == 0 for n in byte_counts):
            return word
    return 1


def _dim(t: torch.Tensor, d: int) -> int:
    if not -t.dim() <= d < t.dim():
        raise InvalidArgumentError(f"page_dim {d} out of range for a {t.dim()}-d cache")
    return d % t.dim()


def _device_ids(ids: torch.Tensor, bound: int, device: torch.device) -> torch.Tensor:
    """``ids`` as ``long`` on ``device``, checked against ``[0, bound)`` on the host first:
    on a device a bad index is a device-side assert that kills the context. Ids already
    on a device are the caller's to check (reading them back would stall the stream)."""
    if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= bound):
        raise InvalidArgumentError(f"page ids must lie in [0, {bound})")
    return ids.to(device=device, dtype=torch.long, non_blocking=True)


def _bytes(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
    if not buf.is_contiguous():
        raise InvalidArgumentError("chunk buffers must be contiguous")
    flat = buf.reshape(-1).view(torch.uint8)
    if flat.numel() != nbytes:
        raise BufferSizeError(f"chunk buffer has {flat.numel()} bytes, the pages need {nbytes}")
    return flat


def _as_rows(buf: torch.Tensor, matrix: torch.Tensor, nbytes: int) -> torch.Tensor:
    flat = _bytes(buf, nbytes)
    if flat.data_ptr() % matrix.element_size():
        raise InvalidArgumentError(f"chunk buffer is not {matrix.element_size()}-byte aligned")
    return flat.view(matrix.dtype).view(-1, matrix.shape[1])


def _gather_rows(matrix: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, nbytes: int) -> None:
    torch.index_select(matrix, 0, rows, out=_as_rows(out, matrix, nbytes))


def _scatter_rows(matrix: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, nbytes: int,
                  mask: torch.Tensor | None = None) -> None:
    data = _as_rows(src, matrix, nbytes)
    if mask is not None:
        # The selection is worked out where the mask is (the host, for masks built from
        # the scheduler's lists): nonzero() on a device tensor would wait for the stream.
        sel = mask.reshape(-1).nonzero().view(-1).to(rows.device, non_blocking=True)
        rows, data = rows[sel], data.index_select(0, sel)
    matrix.index_copy_(0, rows, data)


def _typed_gather(view: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    page = view[0].numel() * view.element_size()
    dst = _bytes(out, ids.numel() * page)
    torch.index_select(view, 0, ids, out=dst.view(view.dtype).view(ids.numel(), *view.shape[1:]))


def _typed_scatter(view: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    page = view[0].numel() * view.element_size()
    data = _bytes(src, ids.numel() * page)
    view.index_copy_(0, ids, data.view(view.dtype).view(ids.numel(), *view.shape[1:]))


__all__ = ["PagedLayers", "gather_pages", "page_bytes_of", "scatter_pages"]
