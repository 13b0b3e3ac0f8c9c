"""Move pages of a paged KV cache to and from contiguous chunk buffers.

A paged cache is any tensor with one *page dimension* (vLLM's blocks, SGLang's pages);
a page is everything else at one index of that dimension. Pages are moved as raw bytes
in memory order, so the same code serves every layout (token-major, head-major,
layer-interleaved, MLA) and every dtype, on any torch device: one batched index op per
call, never a Python loop per page.

Where a page is one dense run of memory (most layouts), the cache is seen as a
matrix ``[num_pages, page_words]`` of 8-byte (or narrower) words and pages are gathered with a single
``index_select`` / scattered with a single ``index_copy_``. Otherwise (a page split
across strided runs, e.g. vLLM's ``LHBNC``), the non-page dims are put in memory order
and the same ops run on the typed view; the bytes produced are then the page's elements
in memory order, which is again layout-stable.

Buffer ownership: callers own every tensor; nothing here keeps a reference after
returning. Thread-safety: the functions are pure; concurrent calls on the same cache
are safe as long as their page sets do not overlap where one of them writes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvstore.errors import BufferSizeError, InvalidArgumentError


def page_bytes_of(cache: torch.Tensor, page_dim: int = 0) -> int:
    """Bytes in one page of ``cache``."""
    return cache[(slice(None),) * _dim(cache, page_dim) + (0,)].numel() * cache.element_size()


def page_view(cache: torch.Tensor, page_dim: int = 0) -> torch.Tensor:
    """``cache`` with the page dim first and the others in memory order (a view).

    When each page is one dense run the result is a 2-D ``[num_pages, page_words]``
    view over the same memory, in the widest integer words the alignment allows (torch's
    index ops move 8-byte words several times faster than bytes); otherwise it keeps
    the cache's dtype and ``cache.ndim`` dims."""
    d = _dim(cache, page_dim)
    rest = [i for i in range(cache.dim()) if i != d]
    # Outer-to-inner memory order; size-1 dims do not matter for density.
    rest.sort(key=lambda i: cache.stride(i), reverse=True)
    view = cache.permute(d, *rest)
    es = cache.element_size()
    if _dense_page(view):
        nbytes = view[0].numel() * es
        word = _word(nbytes, view.stride(0) * es, view.storage_offset() * es, cache.data_ptr())
        flat = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage())
        flat = flat[: flat.numel() // word * word].view(_WORDS[word])
        return flat.as_strided((view.shape[0], nbytes // word), (view.stride(0) * es // word, 1),
                               view.storage_offset() * es // word)
    return view


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _word(*byte_counts: int) -> int:
    """The widest word size (8, 4, 2, 1) dividing every count."""
    for word in (8, 4, 2):
        if all(n % word == 0 for n in byte_counts):
            return word
    return 1


def gather_pages(cache: torch.Tensor, page_dim: int, page_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Copy pages ``page_ids`` of ``cache`` into the contiguous tensor ``out`` (same
    device), page after page. ``out`` may have any dtype and shape; it must hold exactly
    ``len(page_ids) * page_bytes`` bytes."""
    _gather(page_view(cache, page_dim), page_ids, out)


def scatter_pages(cache: torch.Tensor, page_dim: int, page_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Inverse of :func:`gather_pages`: write consecutive pages of ``src`` into pages
    ``page_ids`` of ``cache``. ``page_ids`` must not repeat."""
    _scatter(page_view(cache, page_dim), page_ids, src)


class PagedLayers:
    """Several per-layer paged caches moved together, chunk by chunk.

    A *chunk* is ``blocks_per_chunk`` blocks of every layer, laid out as
    ``[layer][block][page bytes]`` in one contiguous buffer of :attr:`chunk_bytes`.
    ``pages_per_block`` > 1 covers caches whose page dim counts kernel blocks, several
    per block. When every layer's pages are dense runs of one shared allocation with
    page-aligned offsets (vLLM's ``allocate_kv_cache`` does this), all layers of all
    chunks move with one index op; otherwise one op per layer and chunk.

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
        self.views = [page_view(c, page_dim) for c in caches]
        self.pages_per_block = pages_per_block
        self.blocks_per_chunk = blocks_per_chunk
        self.num_blocks = min(v.shape[0] for v in self.views) // pages_per_block
        self.page_bytes = [page_bytes_of(c, page_dim) for c in caches]
        rows = pages_per_block * blocks_per_chunk
        self.layer_bytes = [rows * p for p in self.page_bytes]  # one layer of one chunk
        self.layer_offsets = [sum(self.layer_bytes[:i]) for i in range(len(caches))]
        self.chunk_bytes = sum(self.layer_bytes)
        self._rows, self._row_base = self._shared_rows(caches)

    @property
    def num_layers(self) -> int:
        return len(self.views)

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Chunks of blocks ``block_ids`` (``[n_chunks, blocks_per_chunk]``) into ``out``
        (contiguous, ``n_chunks * chunk_bytes`` bytes, same device as the caches)."""
        dst = _bytes(out, block_ids.shape[0] * self.chunk_bytes)
        if self._rows is not None:
            rows = self._rows
            torch.index_select(rows, 0, self._all_rows(block_ids), out=dst.view(rows.dtype).view(-1, rows.shape[1]))
            return
        for layer in range(self.num_layers):
            self.gather_layer(layer, block_ids, out)

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Inverse of :meth:`gather`. ``keep`` (bool, shaped like ``block_ids``) leaves
        the blocks where it is False untouched (e.g. blocks a request already holds)."""
        data = _bytes(src, block_ids.shape[0] * self.chunk_bytes)
        if self._rows is None:
            for layer in range(self.num_layers):
                self.scatter_layer(layer, block_ids, src, keep=keep)
            return
        rows = self._all_rows(block_ids)
        data = data.view(self._rows.dtype).view(-1, self._rows.shape[1])
        if keep is not None:
            sel = self._row_mask(keep).unsqueeze(1).expand(-1, self.num_layers, -1).reshape(-1).nonzero().view(-1)
            rows, data = rows[sel], data.index_select(0, sel)
        self._rows.index_copy_(0, rows, data)

    def gather_layer(self, layer: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """One layer's pages of the chunks ``block_ids`` into its place in ``out``."""
        dst = _bytes(out, block_ids.shape[0] * self.chunk_bytes).view(block_ids.shape[0], self.chunk_bytes)
        lo, hi = self.layer_offsets[layer], self.layer_offsets[layer] + self.layer_bytes[layer]
        rows = self._page_rows(block_ids)
        for c in range(block_ids.shape[0]):
            _gather(self.views[layer], rows[c], dst[c, lo:hi])

    def scatter_layer(self, layer: int, block_ids: torch.Tensor, src: torch.Tensor,
                      keep: torch.Tensor | None = None) -> None:
        """Inverse of :meth:`gather_layer`; ``keep`` as in :meth:`scatter`."""
        data = _bytes(src, block_ids.shape[0] * self.chunk_bytes).view(block_ids.shape[0], self.chunk_bytes)
        lo, hi = self.layer_offsets[layer], self.layer_offsets[layer] + self.layer_bytes[layer]
        rows = self._page_rows(block_ids)
        mask = None if keep is None else self._row_mask(keep)
        page = self.page_bytes[layer]
        for c in range(block_ids.shape[0]):
            part = data[c, lo:hi]
            if mask is not None and not bool(mask[c].all()):
                sel = mask[c].nonzero().view(-1)
                if sel.numel():
                    _scatter(self.views[layer], rows[c][sel], part.view(-1, page).index_select(0, sel))
                continue
            _scatter(self.views[layer], rows[c], part)

    # -- internals ------------------------------------------------------------------------

    def _page_rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        """``[n, blocks_per_chunk * pages_per_block]`` page indices of each chunk."""
        ids = block_ids.to(device=self.device, dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise InvalidArgumentError(f"block ids must lie in [0, {self.num_blocks})")
        ppb = self.pages_per_block
        if ppb == 1:
            return ids
        sub = torch.arange(ppb, device=self.device)
        return (ids.unsqueeze(-1) * ppb + sub).reshape(ids.shape[0], -1)

    def _row_mask(self, keep: torch.Tensor) -> torch.Tensor:
        """Per-block ``keep`` widened to per-page, ``[n, blocks_per_chunk * pages_per_block]``."""
        keep = keep.to(device=self.device, dtype=torch.bool)
        return keep.repeat_interleave(self.pages_per_block, dim=1)

    def _all_rows(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Row indices into the shared matrix, in chunk layout order ``[n, L, rows]``."""
        pages = self._page_rows(block_ids)                        # [n, R]
        base, step = self._row_base                               # [L], [L]
        return (base.view(1, -1, 1) + pages.unsqueeze(1) * step.view(1, -1, 1)).reshape(-1)

    def _shared_rows(self, caches: Sequence[torch.Tensor]):
        """A ``[total_pages, page_bytes]`` matrix over the common allocation, and per
        layer (first row, row step per page), when every layer allows it."""
        views = self.views
        page = self.page_bytes[0]
        if any(v.dim() != 2 for v in views) or any(p != page for p in self.page_bytes):
            return None, None
        word = views[0].element_size()
        if any(v.element_size() != word for v in views):
            return None, None
        storage = caches[0].untyped_storage()
        if any(c.untyped_storage().data_ptr() != storage.data_ptr() for c in caches):
            return None, None
        base, step = [], []
        for v in views:
            offset, stride = v.storage_offset() * word, v.stride(0) * word
            if offset % page or stride % page:
                return None, None
            base.append(offset // page)
            step.append(stride // page)
        flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        rows = flat[: storage.nbytes() // page * page].view(views[0].dtype).view(-1, page // word)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return rows, (as_long(base), as_long(step))


def _dim(t: torch.Tensor, d: int) -> int:
    if not -t.dim() <= d < t.dim():
        raise InvalidArgumentError(f"page_dim {d} out of range for a {t.dim()}-d cache")
    return d % t.dim()


def _dense_page(view: torch.Tensor) -> bool:
    """Whether ``view[i]`` (dims after the first, in memory order) is one dense run."""
    expected = 1
    for size, stride in reversed(list(zip(view.shape[1:], view.stride()[1:]))):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _bytes(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
    if not buf.is_contiguous():
        raise InvalidArgumentError("chunk buffers must be contiguous")
    flat = buf.reshape(-1).view(torch.uint8)
    if flat.numel() != nbytes:
        raise BufferSizeError(f"chunk buffer has {flat.numel()} bytes, the pages need {nbytes}")
    return flat


def _gather(view: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    ids = ids.to(device=view.device, dtype=torch.long)
    page = view[0].numel() * view.element_size()
    dst = _bytes(out, ids.numel() * page)
    if dst.data_ptr() % view.element_size():
        raise InvalidArgumentError(f"chunk buffer is not {view.element_size()}-byte aligned")
    torch.index_select(view, 0, ids, out=dst.view(view.dtype).view(ids.numel(), *view.shape[1:]))


def _scatter(view: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    ids = ids.to(device=view.device, dtype=torch.long)
    page = view[0].numel() * view.element_size()
    data = _bytes(src, ids.numel() * page)
    if data.data_ptr() % view.element_size():
        raise InvalidArgumentError(f"chunk buffer is not {view.element_size()}-byte aligned")
    view.index_copy_(0, ids, data.view(view.dtype).view(ids.numel(), *view.shape[1:]))


__all__ = ["PagedLayers", "gather_pages", "page_bytes_of", "page_view", "scatter_pages"]
