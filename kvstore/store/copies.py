"""The copies between a Store's tiers that a spill, a prefetch and a flush make: in
groups of up to :data:`MOVE_BATCH_BYTES`, one read and one write per group, zero-copy
from a tier that lends verified views (with the checksums they were verified against),
otherwise through a per-thread scratch buffer. The write goes through
:meth:`Mover.put <kvstore.store.mover.Mover.put>`, so it makes room (and spills) in the
level it lands in like any put.

Lock rule: the :class:`~kvstore.store.mover.Mover`'s; these methods take its lock
themselves, briefly, never across tier I/O.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import numpy as np

from kvstore.buffers.runs import runs
from kvstore.keys import BlockKey

if TYPE_CHECKING:
    from kvstore.store.mover import Mover

# A move between levels (a spill, a prefetch, a flush) reads and writes at most this many
# bytes per tier call, which also bounds the scratch buffer of a tier that lends no views.
MOVE_BATCH_BYTES = 64 << 20


def _groups(keys: list[BlockKey], sizes: dict[BlockKey, int]) -> Iterator[list[int]]:
    """Indices of ``keys`` still sized in the index, in runs of up to
    :data:`MOVE_BATCH_BYTES` (at least one key each)."""
    sized = [j for j, key in enumerate(keys) if key in sizes]
    for run in runs([sizes.get(keys[j], 0) for j in sized], MOVE_BATCH_BYTES):
        yield [sized[r] for r in run]


class Copies:
    """One per :class:`~kvstore.store.mover.Mover` (``mover.copies``)."""

    def __init__(self, mover: "Mover") -> None:
        self._mover = mover
        self._local = threading.local()    # per-thread scratch buffers (scratch)

    def between(self, keys: list[BlockKey], src: int, dst: int, *, admit: bool = True,
                failed: set[BlockKey] | None = None) -> list[bool]:
        """Copy blocks from level ``src`` into level ``dst`` (the source keeps them);
        returns per key whether it was written. Blocks go in groups of up to
        :data:`MOVE_BATCH_BYTES`, one read and one write per group (a Mooncake pool, a
        bucket or Redis pays per call, not per byte). From a tier that lends views
        (:meth:`_may_lend`): zero-copy, with the checksums the views were verified
        against; otherwise through a scratch buffer. A block that cannot be read is
        forgotten in ``src``. ``admit=False``: not an offer to ``dst`` (a flush; see
        :meth:`Mover.put <kvstore.store.mover.Mover.put>`); ``failed`` collects the keys
        that could not be read (unreadable, corrupt) or written (a tier error)."""
        out = [False] * len(keys)
        for group in _groups(keys, self._mover.index.sizes):
            for j, good in zip(group, self._group([keys[j] for j in group], src, dst, admit, failed)):
                out[j] = good
        return out

    def _group(self, keys: list[BlockKey], src: int, dst: int, admit: bool,
               failed: set[BlockKey] | None) -> list[bool]:
        mover = self._mover
        out = [False] * len(keys)
        lvl = mover.levels[src]
        tier = lvl.tier
        lent: list[int] = []
        if self._may_lend(src, dst, keys):
            with tier.lend(keys) as (views, sums):   # verified by a tier that keeps checksums
                lent = [n for n, view in enumerate(views) if view is not None]
                if lent:
                    stored = mover.put(dst, [keys[n] for n in lent], [views[n] for n in lent],
                                       [sums[n] for n in lent], admit=admit, failed=failed)
                    for n, good in zip(lent, stored):
                        out[n] = good
        borrowed = set(lent)
        rest, sizes = [], []   # the rest, still sized in the index
        for n, key in enumerate(keys):
            size = None if n in borrowed else mover.index.sizes.get(key)
            if size is not None:
                rest.append(n)
                sizes.append(size)
        if not rest:
            return out
        with self.scratch(sum(sizes)) as buf:
            bufs, at = [], 0
            for size in sizes:
                bufs.append(buf[at:at + size])
                at += size
            got = mover.tier_io(lvl, tier.read_into, [keys[n] for n in rest], bufs) or [False] * len(rest)
            with mover.lock:
                for n, good in zip(rest, got):
                    if not good:
                        mover.drop(keys[n], src)
            if failed is not None:
                failed.update(keys[n] for n, good in zip(rest, got) if not good)
            read = [(n, b) for n, b, good in zip(rest, bufs, got) if good]
            if read:
                stored = mover.put(dst, [keys[n] for n, _ in read], [b for _, b in read], admit=admit,
                                   failed=failed)
                for (n, _), good in zip(read, stored):
                    out[n] = good
        return out

    def _may_lend(self, src: int, dst: int, keys: list[BlockKey]) -> bool:
        """Whether a move from ``src`` into ``dst`` may borrow ``src``'s views. Down, yes:
        the put evicts only ``dst`` and the levels below it. Up (a prefetch), only while
        ``src`` has free room for what the put's own eviction may spill back into it: a
        lent block's slot stays taken until the view is returned, so evicting it there
        frees nothing and the spill would find no room. Then the move goes through
        scratch; a DRAM -> GPU promotion with room to spare stays zero-copy from DRAM's
        pinned arena."""
        mover = self._mover
        lvl = mover.levels[src]
        if not lvl.tier.capabilities.zero_copy_view:
            return False
        if dst > src:
            return True
        need = sum(mover.index.sizes.get(key, 0) for key in keys)
        with mover.lock:
            return lvl.tier.capacity_bytes - lvl.tier.used_bytes + lvl.pending_free >= need

    @contextmanager
    def scratch(self, nbytes: int) -> Iterator[np.ndarray]:
        """A per-thread scratch buffer, grown on demand and reused (no per-block alloc).
        Nested uses get a buffer each: a put through a scratch buffer may evict from a
        full tier and spill the victim through a scratch buffer of its own (one per
        level down), so the block being moved is never overwritten before it is written."""
        local = self._local
        bufs = getattr(local, "scratch", None)
        if bufs is None:
            bufs = local.scratch = []
            local.depth = 0
        depth = local.depth
        if depth == len(bufs):
            bufs.append(None)
        buf = bufs[depth]
        if buf is None or buf.nbytes < nbytes:
            buf = bufs[depth] = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        local.depth = depth + 1
        try:
            yield buf[:nbytes]
        finally:
            local.depth = depth
