"""Where the retention layer keeps blocks held by a live hint once its victim walk has
passed them, for policies whose order is a stamp (LRU, FIFO: ``EvictionPolicy.stamped``).

In such a policy a key the walk passes over stays ahead of every key inserted (and, in
LRU, accessed) after it. So the keys the walk passed, in the order it passed them, are
exactly the head of the policy's order, and they can leave the policy's own queue
(:class:`Parking` then holds them) without changing where anything would go: a walk
offers the parked keys that no longer hold (``loose``: hint expired, dropped or no
longer trusted) first, in their order, then the policy's queue. Each walk then costs
what it offers plus the keys that lost their hint since the last walk, not every
hinted key at the eviction end.

Keys leave ``held`` for ``loose`` as their hints expire or grow older than the tier's
trust (two heaps, by expiry and by when the hint was given, checked lazily against the
Store's current record), and rejoin ``held`` when a walk finds their hint holds again.
A parked key read under LRU goes back to the policy's queue (the layer re-inserts it
at the most recent end, where the read would put it). Not thread-safe: the Store's lock.
"""

from __future__ import annotations

import heapq
from bisect import insort
from itertools import count
from typing import Any, Callable, Hashable, Iterator, Mapping

_COMPACT_SLACK = 64   # a heap is rebuilt once its stale entries exceed the parked keys + this


class Parking:
    """Parked keys of one tier: ``held`` (a live, trusted hint keeps them) and ``loose``
    (offered first, in order), each ``key -> seq`` (the order the walk passed them)."""

    def __init__(self, hints: Mapping[Hashable, Any], release: Callable[[Hashable], None] | None = None) -> None:
        self._hints = hints
        self._release = release      # set: a key that no longer holds goes back to the policy
        self._seq = count()
        self.held: dict[Hashable, int] = {}
        self.loose: dict[Hashable, int] = {}
        self._loose_order: list[tuple[int, Hashable]] = []      # (seq, key), sorted; stale entries skipped
        # (expires or given, push count: ties, seq, key, record)
        self._by_expiry: list[tuple[float, int, int, Hashable, Any]] = []
        self._by_given: list[tuple[float, int, int, Hashable, Any]] = []
        self._pushes = count()
        self._last: list[Hashable] = []    # keys in the order they were (re)parked, for the tail

    def __len__(self) -> int:
        return len(self.held) + len(self.loose)

    def __contains__(self, key: object) -> bool:
        return key in self.held or key in self.loose

    def park(self, key: Hashable, record: Any, seq: int | None = None) -> None:
        """The walk passed ``key``, held by ``record`` (a new key takes the next place)."""
        if seq is None:
            seq = next(self._seq)
        self.loose.pop(key, None)
        self.held[key] = seq
        self._last.append(key)
        self._push(key, seq, record)

    def park_loose(self, key: Hashable) -> None:
        """The walk stepped past ``key`` without taking it (the Store skipped it, or a
        discard block class 1 offers): it keeps its place, loose."""
        seq = next(self._seq)
        self.loose[key] = seq
        self._loose_order.append((seq, key))
        self._compact_loose()

    def repark(self, key: Hashable, record: Any) -> None:
        """A loose key's hint holds again: back to ``held``, in its place."""
        self.park(key, record, self.loose[key])

    def rehinted(self, key: Hashable, record: Any | None) -> None:
        """``key``'s record changed: a held key with no retention hint left goes loose,
        one with a new record is re-checked from it."""
        seq = self.held.get(key)
        if seq is None:
            return
        if record is None or record.discard:
            self.loosen(key)
        else:
            self._push(key, seq, record)

    def loosen(self, key: Hashable) -> None:
        seq = self.held.pop(key)
        if self._release is not None:
            self._release(key)
            return
        self.loose[key] = seq
        insort(self._loose_order, (seq, key))
        self._compact_loose()

    def loosen_many(self, keys: list[Hashable]) -> None:
        """:meth:`loosen` each of the held ``keys`` (one sort, however many)."""
        if not keys:
            return
        held, loose = self.held, self.loose
        if self._release is not None:
            for key in keys:
                del held[key]
                self._release(key)
            return
        for key in keys:
            loose[key] = held.pop(key)
        self._loose_order = sorted({(seq, key) for key, seq in loose.items()})

    def remove(self, key: Hashable) -> bool:
        """``key`` left the tier or went back to the policy's queue; whether it was here."""
        return self.held.pop(key, None) is not None or self.loose.pop(key, None) is not None

    def release_due(self, now: float, limit: float) -> None:
        """Loosen the held keys whose hint expired by ``now`` or is ``limit`` seconds old,
        as the Store's current records say (a record replaced since it was pushed is
        checked as it is now)."""
        for heap, due in ((self._by_expiry, lambda e: e[0] <= now), (self._by_given, lambda e: now - e[0] >= limit)):
            while heap and due(heap[0]):
                _, _, seq, key, rec = heapq.heappop(heap)
                if self.held.get(key) != seq:
                    continue
                cur = self._hints.get(key)
                if cur is rec or cur is None or cur.discard or cur.expires <= now or now - cur.given >= limit:
                    self.loosen(key)
                else:
                    self._push(key, seq, cur)
            if len(heap) > 2 * len(self.held) + _COMPACT_SLACK:
                self._compact(heap)

    def oldest_given(self) -> float | None:
        """When the oldest hint among the held keys was given (``None``: none held); call
        after :meth:`release_due`."""
        heap, held, hints = self._by_given, self.held, self._hints
        while heap:
            _, _, seq, key, rec = heap[0]
            if held.get(key) == seq:
                cur = hints.get(key)
                if cur is rec:
                    return rec.given
                heapq.heappop(heap)
                if cur is None or cur.discard:
                    self.loosen(key)
                else:
                    self._push(key, seq, cur)
                continue
            heapq.heappop(heap)
        return None

    def last_held(self) -> Hashable | None:
        """The held key parked last: the walk's last hinted block at the eviction end."""
        last, held = self._last, self.held
        while last and last[-1] not in held:
            last.pop()
        if len(last) > 2 * len(held) + _COMPACT_SLACK:
            self._last = last = sorted(held, key=held.__getitem__)
        return last[-1] if last else None

    def loose_in_order(self) -> Iterator[Hashable]:
        """The loose keys, in order, read lazily (a walk that takes the first few pays
        for those; the keys taken since the last walk are dropped from the head first)."""
        order, loose = self._loose_order, self.loose
        stale = 0
        while stale < len(order) and loose.get(order[stale][1]) != order[stale][0]:
            stale += 1
        del order[:stale]
        return self._read_loose(order, len(order))

    def _read_loose(self, order: list, n: int) -> Iterator[Hashable]:
        loose, last = self.loose, None
        for i in range(n):
            if i >= len(order):
                return
            entry = order[i]       # a key loosened twice has two equal entries, side by side
            if entry != last and loose.get(entry[1]) == entry[0]:
                yield entry[1]
            last = entry

    def _compact_loose(self) -> None:
        if len(self._loose_order) > 2 * len(self.loose) + _COMPACT_SLACK:
            loose = self.loose
            self._loose_order = sorted({(seq, key) for key, seq in loose.items()})

    def all_in_order(self) -> list[Hashable]:
        """Every parked key, held or loose, in order."""
        seqs = {**self.held, **self.loose}
        return sorted(seqs, key=seqs.__getitem__)

    def _push(self, key: Hashable, seq: int, record: Any) -> None:
        tick = next(self._pushes)
        heapq.heappush(self._by_expiry, (record.expires, tick, seq, key, record))
        heapq.heappush(self._by_given, (record.given, tick, seq, key, record))

    def _compact(self, heap: list) -> None:
        """Drop the entries of keys no longer held; each held key keeps one entry, for
        its current record (a key whose record is gone keeps its last one, and so goes
        loose when that one comes due)."""
        held, hints, keep = self.held, self._hints, {}
        for e in heap:
            key, cur = e[3], hints.get(e[3])
            if held.get(key) == e[2]:
                old = keep.get(key)
                if old is None or cur is e[4] or (old[4] is not cur and e[0] < old[0]):
                    keep[key] = e
        heap[:] = keep.values()
        heapq.heapify(heap)


__all__ = ["Parking"]
