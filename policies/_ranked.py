"""Class 3's order within one priority: live-hinted blocks ranked by what their hint
says about their next use (issue 39).

A hint given at ``given`` with a window ``R = expires - given`` says "back within R
seconds". A block whose hint is ``a`` seconds old and not yet read is modelled as: the
hint is right with probability ``p`` (the tier's observed reuse of hinted blocks, a
Beta posterior mean), and a right hint's read comes at rate ``C / R`` (memoryless, most
of them within the window). Its value to the tier is the chance that it is read at all,
given it has not been yet, over the expected wait, ``post(a) * C / R`` with
``post(a) = p e^(-Ca/R) / (p e^(-Ca/R) + 1 - p)``; the lowest value leaves first. So
within one window length the oldest hint leaves first (the order before issue 39), and
of two hints of equal age the one with the longer window leaves first: a client that
says "back in a minute" is kept over one that says "back within the hour". A hint with
no expiry (priority only) says nothing about when: its value is 0, it leaves first of
its priority, oldest first.

Kept O(1) amortised: blocks are bucketed by window (powers of 4 seconds, a fixed
number of buckets); within a bucket by when given (an ordered dict of groups, one group
per time a hint was given, so one request's blocks are together; a group is walked
deepest block first). Every bucket's order is its value order up to the window's
spread within the bucket, so a walk compares only the heads of the buckets: O(buckets)
per victim, no snapshot of the class.

Not thread-safe: the Store calls it under its lock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Hashable, Iterator

from kvstore.policies._order import iter_live

C = 3.0                 # a right hint's reads come at C / window (most within the window)
_BASE = 4.0             # bucket b holds windows in [4^b, 4^(b+1)) seconds
_BUCKETS = 16           # 0: under 4 s ... 14: over 4^14 s (~8.5 years) ... 15: no expiry
_NONE = _BUCKETS - 1


def bucket_of(window: float) -> int:
    if not math.isfinite(window):
        return _NONE
    if window < _BASE:
        return 0
    return min(int(math.log(window, _BASE)), _NONE - 1)


def value(rec: Any, now: float, p: float) -> float:
    """The value of keeping a block under hint ``rec`` at ``now``: lower leaves first."""
    window = rec.expires - rec.given
    if not math.isfinite(window):
        return 0.0
    if window <= 0:
        return math.inf if p > 0 else 0.0   # (expired: the caller never offers it)
    rate = C / window
    kept = p * math.exp(-min(rate * max(now - rec.given, 0.0), 700.0))
    return rate * kept / (kept + 1.0 - p) if kept + 1.0 - p > 0 else rate


class RankedHeld:
    """The live-hinted blocks of one priority class, each under its hint record."""

    __slots__ = ("_buckets", "_at")

    def __init__(self) -> None:
        # bucket -> given -> {key: record}, groups in the order the tier got the hints
        self._buckets: dict[int, OrderedDict[float, dict[Hashable, Any]]] = {}
        self._at: dict[Hashable, tuple[int, float]] = {}

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: object) -> bool:
        return key in self._at

    def add(self, key: Hashable, rec: Any) -> None:
        self.remove(key)
        b = bucket_of(rec.expires - rec.given)
        groups = self._buckets.get(b)
        if groups is None:
            groups = self._buckets[b] = OrderedDict()
        group = groups.get(rec.given)
        if group is None:
            group = groups[rec.given] = {}
        group[key] = rec
        self._at[key] = (b, rec.given)

    def remove(self, key: Hashable) -> None:
        at = self._at.pop(key, None)
        if at is None:
            return
        groups = self._buckets[at[0]]
        group = groups[at[1]]
        del group[key]
        if not group:
            del groups[at[1]]
            if not groups:
                del self._buckets[at[0]]

    def _bucket_walk(self, b: int) -> Iterator[Hashable]:
        groups = self._buckets.get(b)
        if groups is None:
            return
        for given in iter_live(groups):
            group = groups.get(given)
            if group is None:
                continue
            for key in list(reversed(group)):       # one request's blocks: deepest first
                if key in group:
                    yield key

    def walk(self, now: float, p: float) -> Iterator[Hashable]:
        """Candidates, lowest value first (the caller re-checks each key's hint and
        evicts or skips it between yields)."""
        if len(self._buckets) == 1:                 # one window length: oldest hint first
            yield from self._bucket_walk(next(iter(self._buckets)))
            return
        heads: dict[int, tuple[Hashable, Iterator[Hashable]]] = {}
        for b in list(self._buckets):
            it = self._bucket_walk(b)
            key = next(it, None)
            if key is not None:
                heads[b] = (key, it)
        while heads:
            best, best_v = None, math.inf
            for b, (key, _) in heads.items():
                at = self._at.get(key)
                if at is None:                      # gone since it was peeked
                    v = -math.inf
                else:
                    rec = self._buckets[at[0]][at[1]][key]
                    v = value(rec, now, p)
                if best is None or v < best_v:
                    best, best_v = b, v
            key, it = heads[best]
            if key in self._at:
                yield key
            nxt = next(it, None)
            if nxt is None:
                del heads[best]
            else:
                heads[best] = (nxt, it)


__all__ = ["RankedHeld", "bucket_of", "value"]
