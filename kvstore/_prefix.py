"""The cached prefix of a key sequence in each tier of a Store, read from its index:
what a router asks before placing a request (the admin port's ``POST /v1/lookup``).

A companion of :class:`kvstore.store.Store` (as ``store.reservation`` is): it reads the Store's
index (``_where``, ``_levels``) under its lock. Read-only: no lease, no counters, no
policy touch, no tier I/O, so a router's probes neither keep blocks alive nor skew the
hit statistics. The answer can be stale by the time it is used (blocks may be evicted
right after); a caller that loads must still ``lookup(keys, lease_s=…)``.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvstore.keys import BlockKey


def prefix_by_tier(store: Any, keys: Sequence[BlockKey]) -> tuple[int, list[tuple[str, str, int]]]:
    """``(blocks cached in any tier, [(tier name, kind, blocks cached there), ...])``:
    the length of the leading run of ``keys`` held anywhere, and in each tier (fastest
    first). Thread-safe."""
    levels = store._levels
    with store._lock:
        masks = [store._where.get(key, 0) for key in keys]
    anywhere = next((j for j, mask in enumerate(masks) if not mask), len(masks))
    per_tier = []
    for i, lvl in enumerate(levels):
        n = next((j for j, mask in enumerate(masks) if not mask >> i & 1), len(masks))
        per_tier.append((lvl.name, lvl.kind, n))
    return anywhere, per_tier


__all__ = ["prefix_by_tier"]
