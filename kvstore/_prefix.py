"""The cached prefix of a key sequence in each tier of a Store, read from its index:
what a router asks before placing a request (the admin port's ``POST /v1/lookup``).

A companion of :class:`kvstore.store.Store` (as ``store.reservation`` is): it reads the Store's
index (``_where``, ``_levels``) under its lock. Read-only: no lease, no counters, no
policy touch, no tier I/O, so a router's probes neither keep blocks alive nor skew the
hit statistics. The answer can be stale by the time it is used (blocks may be evicted
right after); a caller that loads must still ``lookup(keys, lease_s=…)``.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from kvstore.keys import BlockKey


def prefix_runs(store: Any, batches: Iterable[Sequence[BlockKey]]) -> tuple[int, list[tuple[str, str, int]]]:
    """``(blocks cached in any tier, [(tier name, kind, blocks cached there), ...])``:
    the length of the leading run of the keys held anywhere, and in each tier (fastest
    first), for keys given batch after batch. A batch is taken only while the run is
    unbroken (a lazily hashed prompt is hashed no further than its first block held
    nowhere); the lock is held for one batch at a time. Thread-safe."""
    levels = store._levels
    runs = [0] * len(levels)          # each tier's leading run so far
    broken = [False] * len(levels)
    anywhere = 0
    for batch in batches:
        with store._lock:
            masks = [store._where.get(key, 0) for key in batch]
        for mask in masks:
            if not mask:
                return anywhere, _named(levels, runs)
            anywhere += 1
            for i in range(len(levels)):
                if not broken[i]:
                    if mask >> i & 1:
                        runs[i] += 1
                    else:
                        broken[i] = True
    return anywhere, _named(levels, runs)


def _named(levels: Sequence[Any], runs: list[int]) -> list[tuple[str, str, int]]:
    return [(lvl.name, lvl.kind, n) for lvl, n in zip(levels, runs)]


__all__ = ["prefix_runs"]
