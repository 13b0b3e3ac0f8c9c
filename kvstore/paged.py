"""Move pages of a paged KV cache to and from contiguous chunk buffers.

A paged cache is any tensor with one *page dimension* (vLLM's blocks, SGLang's pages);
a page is everything else at one index of that dimension. Pages are moved as raw bytes
in memory order, so the same code serves every layout (token-major, head-major,
layer-interleaved, MLA) and every dtype, on any torch device: one batched index op per
call (per layer, for the layer-wise calls), never a Python loop per page or per chunk.

How: a page is one or more dense *runs* of memory (one run for most layouts; one per
head when heads are outermost, as in vLLM's ``LHBNC``). The cache's storage is seen as a
matrix of runs, in the widest integer words the alignment allows (torch's index ops move
8-byte words several times faster than bytes), and pages are gathered with one
``index_select`` and scattered with one ``index_copy_`` over run indices. The bytes of a
page come out in memory order, so a page of a given layout always has the same bytes.
A cache whose runs do not tile its storage falls back to the same ops on a typed view.
One layer of many chunks lies strided in the chunk buffer (``[chunk][layer][block]``):
it is moved by one advanced-index op (``aten::index`` / ``index_put_``) whose
destination or source is that strided view, so no chunk is visited from Python.

Host round trips (``torch.cuda.set_sync_debug_mode("error")`` passes on a CUDA cache):

- ids from the host (as the connectors pass them) are bounds-checked there, turned into
  the final row indices there, and reach the device in one copy from pinned memory per
  call (CUDA caches only; CPU caches use them in place, without touching CUDA). Ids
  already on the device are used as they are: checking them would read them back, so
  they are the caller's to check (a bad one is a device-side assert).
- ``keep`` masks must be host tensors: they become index lists on the host. A mask on
  a device is refused (:class:`~kvstore.errors.InvalidArgumentError`) rather than read
  back with a ``nonzero()`` that would wait for the stream. A masked scatter is two ops
  (one gathers the kept source pages, one writes them), both over all chunks at once.
- nothing calls ``.item()``, ``nonzero()`` or ``tolist()`` on a device tensor.

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
    offsets: torch.Tensor   # [runs_per_page] rows of a page's runs, in memory order (host)
    dev_offsets: torch.Tensor  # the same on the cache's device (for ids given there)

    def rows(self, pages: torch.Tensor) -> torch.Tensor:
        """``pages.shape + (runs_per_page,)`` row indices, where ``pages`` is."""
        offsets = self.offsets if pages.device.type == "cpu" else self.dev_offsets
        return (self.base + pages * self.step).unsqueeze(-1) + offsets


def page_bytes_of(cache: torch.Tensor, page_dim: int = 0) -> int:
    """Bytes in one page of ``cache``."""
    d = _dim(cache, page_dim)
    return math.prod(size for i, size in enumerate(cache.shape) if i != d) * cache.element_size()


def gather_pages(cache: torch.Tensor, page_dim: int, page_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Copy pages ``page_ids`` of ``cache`` into the contiguous tensor ``out`` (same
    device), page after page. ``out`` may have any dtype and shape; it must hold exactly
    ``len(page_ids) * page_bytes`` bytes."""
    d = _dim(cache, page_dim)
    ids = _checked_ids(page_ids, cache.shape[d], cache.device).reshape(-1)
    runs = _runs(cache, page_dim, {})
    nbytes = ids.numel() * page_bytes_of(cache, page_dim)
    if runs is None:
        view = _typed_view(cache, page_dim)
        (ids,) = _upload([ids], cache.device)
        torch.index_select(view, 0, ids, out=_typed_out(out, view, ids.numel(), nbytes))
    else:
        (rows,) = _upload([runs.rows(ids).reshape(-1)], cache.device)
        torch.index_select(runs.matrix, 0, rows, out=_as_rows(out, runs.matrix, nbytes))


def scatter_pages(cache: torch.Tensor, page_dim: int, page_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Inverse of :func:`gather_pages`: write consecutive pages of ``src`` into pages
    ``page_ids`` of ``cache``. ``page_ids`` must not repeat."""
    d = _dim(cache, page_dim)
    ids = _checked_ids(page_ids, cache.shape[d], cache.device).reshape(-1)
    runs = _runs(cache, page_dim, {})
    nbytes = ids.numel() * page_bytes_of(cache, page_dim)
    if runs is None:
        view = _typed_view(cache, page_dim)
        (ids,) = _upload([ids], cache.device)
        view.index_copy_(0, ids, _typed_out(src, view, ids.numel(), nbytes))
    else:
        (rows,) = _upload([runs.rows(ids).reshape(-1)], cache.device)
        runs.matrix.index_copy_(0, rows, _as_rows(src, runs.matrix, nbytes))


class PagedLayers:
    """Several per-layer paged caches moved together, chunk by chunk.

    A *chunk* is ``blocks_per_chunk`` blocks of every layer, laid out as
    ``[layer][block][page bytes]`` in one contiguous buffer of :attr:`chunk_bytes`.
    ``pages_per_block`` > 1 covers caches whose page dim counts kernel blocks, several
    per block. When all layers live in one allocation with the same run size (vLLM's
    ``allocate_kv_cache`` does this) all layers of all chunks move with one index op;
    otherwise one op per layer, over all chunks. ``block_ids`` are
    ``[n_chunks, blocks_per_chunk]`` (host tensors, checked there; see the module
    docstring for ids on a device) and ``keep`` masks host bool tensors of that shape.

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
        self._sub = torch.arange(pages_per_block)
        self._dev_sub = self._sub.to(self.device)

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
        pages = self._pages(block_ids)
        n = pages.shape[0]
        if self._combined is None:
            self._layers_op(range(self.num_layers), pages, None, out, gather=True)
            return
        matrix = self._combined[0]
        data = _as_rows(out, matrix, n * self.chunk_bytes)      # sizes checked before the upload
        (rows,) = _upload([self._combined_rows(pages).reshape(-1)], self.device)
        torch.index_select(matrix, 0, rows, out=data)

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Inverse of :meth:`gather`. ``keep`` (bool, shaped like ``block_ids``) leaves
        the blocks where it is False untouched (e.g. blocks a request already holds)."""
        pages = self._pages(block_ids)
        n = pages.shape[0]
        kept = self._kept(keep, block_ids)
        if self._combined is None:
            self._layers_op(range(self.num_layers), pages, kept, src, gather=False)
            return
        matrix = self._combined[0]
        data = _as_rows(src, matrix, n * self.chunk_bytes)
        rows = self._combined_rows(pages)                                # [n, L, R, runs]
        if kept is None:
            (rows,) = _upload([rows.reshape(-1)], self.device)
            matrix.index_copy_(0, rows, data)
            return
        # The kept pages' rows, as positions in the chunk buffer's rows (worked out on the host).
        sel = kept[:, None, :, None].expand(rows.shape).reshape(-1).nonzero().view(-1)
        if rows.device.type == "cpu":
            rows, sel = _upload([rows.reshape(-1)[sel], sel], self.device)
        else:                                       # ids given on the device
            (sel,) = _upload([sel], self.device)
            rows = rows.reshape(-1).index_select(0, sel)
        matrix.index_copy_(0, rows, data.index_select(0, sel))

    def gather_layer(self, layer: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """One layer's pages of the chunks ``block_ids`` into its place in ``out``."""
        self._layers_op([self._layer(layer)], self._pages(block_ids), None, out, gather=True)

    def scatter_layer(self, layer: int, block_ids: torch.Tensor, src: torch.Tensor,
                      keep: torch.Tensor | None = None) -> None:
        """Inverse of :meth:`gather_layer`; ``keep`` as in :meth:`scatter`."""
        layer = self._layer(layer)
        pages = self._pages(block_ids)
        self._layers_op([layer], pages, self._kept(keep, block_ids), src, gather=False)

    # -- internals ------------------------------------------------------------------------

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(f"layer {layer} out of range for {self.num_layers} layers")
        return layer

    def _pages(self, block_ids: torch.Tensor) -> torch.Tensor:
        """``[n, blocks_per_chunk * pages_per_block]`` page indices of each chunk, where
        the ids are (the host, normally), after the host-side bounds check."""
        if block_ids.dim() != 2 or block_ids.shape[1] != self.blocks_per_chunk:
            raise InvalidArgumentError(f"block ids must be [n_chunks, {self.blocks_per_chunk}], "
                                       f"got {list(block_ids.shape)}")
        ids = _checked_ids(block_ids, self.num_blocks, self.device)
        ppb = self.pages_per_block
        if ppb == 1:
            return ids
        sub = self._sub if ids.device.type == "cpu" else self._dev_sub
        return (ids.unsqueeze(-1) * ppb + sub).reshape(ids.shape[0], -1)

    def _kept(self, keep: torch.Tensor | None, block_ids: torch.Tensor) -> torch.Tensor | None:
        """Per-block ``keep`` widened to per-page, ``[n, blocks_per_chunk * pages_per_block]``,
        on the host; None when every block is written."""
        if keep is None:
            return None
        if keep.device.type != "cpu":
            raise InvalidArgumentError(
                f"keep masks must be host tensors (got one on {keep.device}): they are turned into "
                "index lists on the host, and reading a device mask back would wait for its stream")
        if tuple(keep.shape) != tuple(block_ids.shape):
            raise InvalidArgumentError(f"keep mask {list(keep.shape)} does not match block ids {list(block_ids.shape)}")
        keep = keep.to(dtype=torch.bool)
        if bool(keep.all()):
            return None                                 # host tensor: no device round trip
        return keep.repeat_interleave(self.pages_per_block, dim=1)

    def _layers_op(self, layers, pages: torch.Tensor, kept: torch.Tensor | None, buf: torch.Tensor,
                   *, gather: bool) -> None:
        """Gather (or scatter) ``layers`` of the chunks ``pages`` to (from) their places in
        the chunk buffer ``buf``: one advanced-index op per layer over every chunk (a
        masked scatter: one gather of the kept source pages, one index_copy_). Every
        layer's indices reach the device in one upload."""
        n = pages.shape[0]
        _bytes(buf, n * self.chunk_bytes)
        views, parts = [], []
        if kept is not None:
            chunk, page = kept.nonzero(as_tuple=True)                     # host
            if pages.device.type != "cpu":                                # ids given on the device
                chunk, page = _upload([chunk, page], self.device)
            parts += [chunk, page]
        for layer in layers:
            runs, table = self._runs[layer], self._typed[layer]
            if runs is None:
                idx, inner = pages, tuple(table.shape[1:])                # [n, R]
            else:
                table = runs.matrix
                idx = runs.rows(pages)                                    # [n, R, runs]
                inner = (idx.shape[2], table.shape[1])
            views.append((table, _chunk_view(buf, n, self.chunk_bytes, self.layer_offsets[layer],
                                             table.dtype, (pages.shape[1], *inner))))
            parts.append(idx if kept is None else idx[chunk, page])
        parts = _upload(parts, self.device)
        if kept is not None:
            chunk, page, parts = parts[0], parts[1], parts[2:]
        for (table, view), idx in zip(views, parts):
            if gather:
                torch.ops.aten.index.Tensor_out(table, [idx], out=view)
            elif kept is None:
                table.index_put_((idx,), view)
            else:
                table.index_put_((idx,), view[chunk, page])

    def _combine(self):
        """Per-layer (base, step, offsets) stacked, when every layer indexes one matrix
        with the same number of runs per page: on the host, and on the device for ids
        given there."""
        runs = self._runs
        if any(r is None for r in runs):
            return None
        first = runs[0]
        if any(r.matrix is not first.matrix or r.offsets.numel() != first.offsets.numel() for r in runs):
            return None
        host = (torch.tensor([r.base for r in runs], dtype=torch.long),
                torch.tensor([r.step for r in runs], dtype=torch.long),
                torch.stack([r.offsets for r in runs]))
        return (first.matrix, host, tuple(t.to(self.device) for t in host))

    def _combined_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """``[n, L, pages, runs]`` row indices in chunk layout order, where ``pages`` is."""
        _, host, dev = self._combined
        base, step, offsets = host if pages.device.type == "cpu" else dev
        rows = base.view(1, -1, 1) + pages.unsqueeze(1) * step.view(1, -1, 1)    # [n, L, R]
        return rows.unsqueeze(-1) + offsets.unsqueeze(0).unsqueeze(2)


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
                 offsets, offsets.to(cache.device))


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


def _checked_ids(ids: torch.Tensor, bound: int, device: torch.device) -> torch.Tensor:
    """``ids`` as ``long``, checked against ``[0, bound)`` on the host: on a device a bad
    index is a device-side assert that kills the context. Host ids stay on the host
    (their row indices are worked out there and uploaded once, see :func:`_upload`); ids
    already on a device are the caller's to check (reading them back would stall the
    stream) and move to the cache's device if they are elsewhere."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InvalidArgumentError(f"page ids must be integers, got {ids.dtype}")
    if ids.device.type != "cpu":
        return ids.to(device=device, dtype=torch.long)
    ids = ids.to(dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= bound):
        raise InvalidArgumentError(f"page ids must lie in [0, {bound})")
    return ids


def _upload(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host index tensors onto ``device``: as they are for a CPU device; otherwise in
    one copy, from pinned memory for CUDA (a pageable copy would be staged by the
    driver and block the host). Tensors already on the device pass through."""
    if device.type == "cpu" or not any(p.device.type == "cpu" for p in parts):
        return list(parts)
    host = list({id(p): p for p in parts if p.device.type == "cpu"}.values())   # each tensor once
    flat = torch.cat([p.reshape(-1) for p in host])
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    placed, at = {}, 0
    for p in host:
        placed[id(p)] = flat[at: at + p.numel()].view(p.shape)
        at += p.numel()
    return [placed.get(id(p), p) for p in parts]


def _bytes(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
    if not buf.is_contiguous():
        raise InvalidArgumentError("chunk buffers must be contiguous")
    flat = buf.reshape(-1).view(torch.uint8)
    if flat.numel() != nbytes:
        raise BufferSizeError(f"chunk buffer has {flat.numel()} bytes, the pages need {nbytes}")
    return flat


def _words(buf: torch.Tensor, dtype: torch.dtype, nbytes: int, *, stride_bytes: int = 0) -> torch.Tensor:
    """The contiguous ``buf`` (``nbytes`` bytes) as a flat tensor of ``dtype``."""
    flat = _bytes(buf, nbytes)
    es = dtype.itemsize
    if flat.data_ptr() % es or stride_bytes % es or flat.storage_offset() % es:
        raise InvalidArgumentError(f"chunk buffer is not {es}-byte aligned")
    return flat.view(dtype)


def _as_rows(buf: torch.Tensor, matrix: torch.Tensor, nbytes: int) -> torch.Tensor:
    return _words(buf, matrix.dtype, nbytes).view(-1, matrix.shape[1])


def _typed_out(buf: torch.Tensor, view: torch.Tensor, n: int, nbytes: int) -> torch.Tensor:
    return _words(buf, view.dtype, nbytes).view(n, *view.shape[1:])


def _chunk_view(buf: torch.Tensor, n: int, chunk_bytes: int, lo: int, dtype: torch.dtype,
                shape: tuple[int, ...]) -> torch.Tensor:
    """``[n, *shape]`` view of ``dtype`` over the bytes ``[lo, lo + size)`` of each of the
    ``n`` chunks of ``buf`` (contiguous, ``n * chunk_bytes`` bytes), dense within a chunk."""
    words = _words(buf, dtype, n * chunk_bytes, stride_bytes=math.gcd(chunk_bytes if n > 1 else 0, lo))
    es = words.element_size()
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return words.as_strided((n, *shape), (chunk_bytes // es, *reversed(strides)), words.storage_offset() + lo // es)


__all__ = ["PagedLayers", "gather_pages", "page_bytes_of", "scatter_pages"]
