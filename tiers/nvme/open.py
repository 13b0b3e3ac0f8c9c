"""Start-up of one NVMe tier directory: rebuild its in-memory state from the index.

The index is the source of truth. :func:`open_shard` decodes it in bulk
(:meth:`~tiers.nvme.index.BlockIndex.load`), marks the recorded extents used in each
data file (which leaves every unindexed extent — an orphan from a crash before its
commit — free), drops records that are damaged, point past a truncated file or overlap
another block, trims the oldest blocks when the capacity was lowered, and hands back
the survivors oldest access first. A million entries cost one pass over the index,
array arithmetic, and one Python object per key and per entry.

Not thread-safe: called from the tier's constructor, before the tier is shared.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import TYPE_CHECKING, Iterator

import numpy as np

from kvstore.keys import _trusted
from kvstore.tiers.nvme.index import KEY_OFFSET

if TYPE_CHECKING:
    from kvstore.tiers.nvme.files import Shard

log = logging.getLogger(__name__)


class Entry:
    """Where one block lives, plus the tier's mutable bookkeeping for it (last access,
    readers in flight, whether it was removed while read)."""

    __slots__ = ("shard", "file_no", "offset", "length", "checksum", "last", "readers", "dead")

    def __init__(self, shard: "Shard", file_no: int, offset: int, length: int, checksum: int,
                 last: float) -> None:
        self.shard, self.file_no, self.offset, self.length = shard, file_no, offset, length
        self.checksum, self.last, self.readers, self.dead = checksum, last, 0, False

    @property
    def nbytes(self) -> int:
        """Payload bytes (``length``), the name :func:`tiers.base.check_sizes` reads."""
        return self.length


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Collector off while a bulk step makes a million long-lived objects (each
    allocation threshold crossed would otherwise walk every object made so far)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def open_shard(shard: "Shard", name: str, counters: dict[str, int]) -> tuple[list, int]:
    """Rebuild ``shard``'s allocators from its index; returns ``([(key, Entry)] oldest
    access first, payload bytes used)`` and raises ``counters`` for what was dropped."""
    with paused_gc():
        return _open(shard, name, counters)


def _open(shard: "Shard", name: str, counters: dict[str, int]) -> tuple[list, int]:
    for warning in shard.data.open_existing(shard.index.file_sizes()):
        log.warning("NVMe tier %s: %s", name, warning)
    snap = shard.index.load()
    ok = snap.ok.copy()
    good = np.flatnonzero(ok)
    order = good[np.lexsort((snap.offset[good], snap.file_no[good]))]
    files = snap.file_no[order]
    for part in np.split(order, np.flatnonzero(np.diff(files)) + 1) if len(order) else ():
        kept = shard.data.adopt_many(int(snap.file_no[part[0]]), snap.offset[part], snap.length[part])
        ok[part[~kept]] = False
    bad = [snap.digests[i] for i in np.flatnonzero(~ok).tolist()]
    if bad:
        log.warning("NVMe tier %s: dropped %d damaged or lost index entries in %s", name, len(bad), shard.path)
        counters["corrupt_blocks"] += len(bad)
    alive = np.flatnonzero(ok)
    alive = alive[np.argsort(snap.last[alive], kind="stable")]   # oldest access first
    used = int(snap.length[alive].sum())
    if used > shard.capacity:   # capacity lowered since the last run: the oldest go
        cum = np.cumsum(snap.length[alive])
        first = int(np.searchsorted(cum, used - shard.capacity, side="left")) + 1
        for i in alive[:first].tolist():
            shard.data.free(int(snap.file_no[i]), int(snap.offset[i]), int(snap.length[i]))
            bad.append(snap.digests[i])
        used -= int(cum[first - 1])
        counters["dropped_at_open"] += first
        alive = alive[first:]
    shard.index.delete(bad + snap.stray)
    return _entries(shard, snap, alive), used


def _entries(shard: "Shard", snap, alive: np.ndarray) -> list:
    """One key and one entry per surviving record, from the decoded arrays. The record
    checksum vouches for the key bytes, so keys skip validation."""
    digests, values = snap.digests, snap.values
    parent_at, ns_at = KEY_OFFSET + 32, KEY_OFFSET + 64
    has_parent, has_ns = snap.has_parent.tolist(), snap.has_namespace.tolist()
    namespaces: dict[bytes, bytes] = {}   # one bytes object per namespace, not per key
    out = []
    append = out.append
    for i, file_no, offset, length, csum, last in zip(
            alive.tolist(), snap.file_no[alive].tolist(), snap.offset[alive].tolist(),
            snap.length[alive].tolist(), snap.checksum[alive].tolist(), snap.last[alive].tolist()):
        value = values[i]
        parent = value[parent_at:ns_at] if has_parent[i] else None
        if has_ns[i]:
            ns = value[ns_at:ns_at + 32]
            ns = namespaces.setdefault(ns, ns)
        else:
            ns = None
        append((_trusted(digests[i], parent, ns), Entry(shard, file_no, offset, length, csum, last)))
    return out
