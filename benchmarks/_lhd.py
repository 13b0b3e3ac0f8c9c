"""Learned hit density per block class (LHD, Beckmann et al., NSDI '18), for prefix blocks.

Evaluated for issue 22 (``python -m benchmarks.lhd_eval``) and not shipped: it loses to
LRU at a 1% cache on both the production conversation trace and a second synthetic
trace, so it lives here, with its evaluation, and not in ``policies/``.

Each block belongs to a class: whether it is the last block of its request so far (no
child inserted after it), how often it was hit (0, 1, 2, 3+), and how deep it sits in its
prefix (request length: depth 0-3, 4-15, 16-63, 64+). Per class, the policy learns from
what happened to past blocks at each age (time since last use, in block references)
how many hits a block of that age can still expect per unit of cache time it will
occupy: its hit density. The victim is the lowest-density block among a random sample.

The horizon adapts to the trace: ages are counted in coarse buckets whose width doubles
when more than 1% of events fall past the last bucket and halves when every event fits
in the first quarter, so the learned curves cover the reuse distances the trace has
instead of a fixed window. Counts decay (×0.9) at each re-estimate, every
``capacity``/4 references (at least 4096), so the curves follow a changing workload.

Only blocks with no held child are candidates (evicting a parent first would strand its
children: a prefix hit stops at the first missing block). O(1) per insert, access and
removal; O(sample) per victim. Deterministic (seeded). Not thread-safe.
"""

from __future__ import annotations

import random
from typing import Hashable, Iterator

from kvstore.policies.base import EvictionPolicy

AGES = 128
SAMPLE = 32
DECAY = 0.9
_DEPTHS = (4, 16, 64)


class _Entry:
    __slots__ = ("last", "hits", "depth", "leaf", "slot", "parent", "children")

    def __init__(self, last: int, depth: int, parent: Hashable | None) -> None:
        self.last, self.hits, self.depth, self.leaf = last, 0, depth, True
        self.parent, self.children, self.slot = parent, 0, -1


def _depth_class(depth: int) -> int:
    for i, bound in enumerate(_DEPTHS):
        if depth < bound:
            return i
    return len(_DEPTHS)


class LhdPolicy(EvictionPolicy):
    name = "lhd"
    uses_parent = True

    CLASSES = 2 * 4 * (len(_DEPTHS) + 1)

    def __init__(self, seed: int = 0) -> None:
        self._entries: dict[Hashable, _Entry] = {}
        self._keys: list[Hashable] = []          # held blocks without held children: the candidates
        self._rng = random.Random(seed)
        self._clock = 0
        self._shift = 4                          # age bucket width: 2**shift references
        self._hits = [[0.0] * AGES for _ in range(self.CLASSES)]
        self._evictions = [[0.0] * AGES for _ in range(self.CLASSES)]
        self._density = [[1.0 / (a + 1) for a in range(AGES)] for _ in range(self.CLASSES)]
        self._overflow = 0.0
        self._events = 0.0
        self._interval = 4096
        self._next_update = self._interval

    # -- events ----------------------------------------------------------------------------

    def set_capacity(self, capacity_bytes: int) -> None:
        # Bytes are not blocks, but a re-estimate every few thousand references suffices.
        self._interval = max(4096, len(self._entries) // 4)

    def on_insert(self, key: Hashable, nbytes: int, parent: Hashable | None = None) -> None:
        self._tick()
        entry = self._entries.get(key)
        if entry is not None:
            entry.last = self._clock
            return
        above = self._entries.get(parent) if parent is not None else None
        depth = above.depth + 1 if above is not None else (1 if parent is not None else 0)
        if above is not None:
            above.leaf = False
            above.children += 1
            self._unlist(above)
        entry = self._entries[key] = _Entry(self._clock, depth, parent if above is not None else None)
        self._list(key, entry)

    def on_access(self, key: Hashable) -> None:
        self._tick()
        entry = self._entries.get(key)
        if entry is None:
            return
        self._record(self._hits, entry)
        entry.hits += 1
        entry.last = self._clock

    def on_remove(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._record(self._evictions, entry)
        self._unlist(entry)
        above = self._entries.get(entry.parent) if entry.parent is not None else None
        if above is not None:
            above.children -= 1
            if above.children == 0:
                self._list(entry.parent, above)

    def _list(self, key: Hashable, entry: _Entry) -> None:
        if entry.slot < 0 and entry.children == 0:
            entry.slot = len(self._keys)
            self._keys.append(key)

    def _unlist(self, entry: _Entry) -> None:
        if entry.slot >= 0:
            last = self._keys.pop()
            if entry.slot < len(self._keys):
                self._keys[entry.slot] = last
                self._entries[last].slot = entry.slot
            entry.slot = -1

    def victims(self) -> Iterator[Hashable]:
        skipped: set[Hashable] = set()
        while len(skipped) < len(self._keys):
            best, best_density = None, float("inf")
            for _ in range(SAMPLE if len(self._keys) > SAMPLE else 1):
                key = self._keys[self._rng.randrange(len(self._keys))]
                if key in skipped:
                    continue
                density = self._density_of(self._entries[key])
                if density < best_density:
                    best, best_density = key, density
            if best is None:
                best = next((k for k in self._keys if k not in skipped), None)
                if best is None:
                    return
            yield best
            if best in self._entries:
                skipped.add(best)

    # -- the model -------------------------------------------------------------------------

    def _cls(self, entry: _Entry) -> int:
        return (entry.leaf * 4 + min(entry.hits, 3)) * (len(_DEPTHS) + 1) + _depth_class(entry.depth)

    def _age(self, entry: _Entry) -> int:
        return (self._clock - entry.last) >> self._shift

    def _density_of(self, entry: _Entry) -> float:
        age = self._age(entry)
        return self._density[self._cls(entry)][age] if age < AGES else 0.0

    def _record(self, table: list[list[float]], entry: _Entry) -> None:
        age = self._age(entry)
        self._events += 1
        if age >= AGES:
            self._overflow += 1
            age = AGES - 1
        table[self._cls(entry)][age] += 1

    def _tick(self) -> None:
        self._clock += 1
        if self._clock >= self._next_update:
            self._reestimate()
            self._next_update = self._clock + self._interval

    def _reestimate(self) -> None:
        for cls in range(self.CLASSES):
            hits, evictions, density = self._hits[cls], self._evictions[cls], self._density[cls]
            hits_above = events_above = lifetime_above = 0.0
            for age in range(AGES - 1, -1, -1):
                hits_above += hits[age]
                events_above += hits[age] + evictions[age]
                lifetime_above += events_above
                density[age] = hits_above / lifetime_above if lifetime_above > 0 else 0.0
                hits[age] *= DECAY
                evictions[age] *= DECAY
        self._adapt_horizon()
        self._interval = max(4096, len(self._entries) // 4)

    def _adapt_horizon(self) -> None:
        if self._events <= 0:
            return
        if self._overflow / self._events > 0.01 and self._shift < 30:
            self._shift += 1
            self._rescale(2)
        elif self._shift > 0 and self._within_quarter():
            self._shift -= 1
            self._rescale(0.5)
        self._overflow = self._events = 0.0

    def _within_quarter(self) -> bool:
        quarter = AGES // 4
        return not any(row[a] > 0.5 for table in (self._hits, self._evictions)
                       for row in table for a in range(quarter, AGES))

    def _rescale(self, factor: float) -> None:
        """Move the learned curves onto buckets ``factor`` times wider (or narrower)."""
        for table in (self._hits, self._evictions, self._density):
            for cls, row in enumerate(table):
                if factor > 1:
                    new = [0.0] * AGES
                    for a, value in enumerate(row):
                        new[a // 2] += value if table is not self._density else value / 2
                else:
                    new = [row[a // 2] / (2 if table is not self._density else 1) for a in range(AGES)]
                table[cls] = new

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
