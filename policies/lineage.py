"""Lineage: prefix-aware, frequency-aware eviction for chained KV-cache keys.

A chained key is worthless without its parent (a prefix hit stops at the first
missing block), so this policy is **leaf-first**: it only offers keys that no held key
names as its parent, and offers a parent once its last held child has gone. Only when
every leaf was skipped (leased, pinned) does it offer the skipped leaves' ancestors,
nearest first.

Among leaves it uses **GreedyDual-Size-Frequency** (Cherkasova, 1998) with unit cost
per byte, so the size term cancels: a key's priority is ``L + 1 + beta * (count - 1)``,
where ``count`` is how many times the key was inserted or accessed and ``L`` is an
inflation clock set to the priority of each victim. The least priority goes first. A
key that is not used again sinks below the clock as it rises (aging); with
``beta = 1`` a key used ``n`` times survives about ``n`` times as many evictions as a
key used once, so one-off prompts leave before the prefixes many requests share and
before conversations that already came back; with ``beta = 0`` the order is plain
recency (every touch sets ``L + 1``, and ``L`` only grows).

Counts survive eviction in two ghost lists of recently evicted keys, together as long
as the number of keys held (ARC's directory size): keys evicted after one use and keys
evicted after more. A returning key gets its count back, which is what lets a second
sighting count, and moves ``beta`` the way ARC moves its target: a key that returns
after being evicted with one use means recency was under-weighted (``beta`` goes down
one step), one that returns after several uses means frequency was (``beta`` goes up).
A step is ``1/n`` for ``n`` keys held, times the ratio of the ghost lists when the other
list is larger, and ``beta`` stays within [0, 1], starting at 1: between LRU and GDSF,
chosen by the workload, with no constant fitted to a trace.

A touch refreshes the ancestors: when a child leaves, its parent's priority becomes at
least the child's, so a prefix is never ranked colder than its most recently used
extension. Doing this when a parent becomes a leaf, rather than walking up on every
access, keeps an access O(1) for interior keys.

Why frequency and not a probation queue: on the Mooncake conversation trace three
blocks in four are never used again, but a block's first reuse comes late (a median
of ~400 requests later, the user's think time), so a probation queue or a
second-sighting filter throws most first reuses away (S3-FIFO, at 5% of the distinct
blocks, ends below LRU). Ranking by count with aging gives a first-time block a
lifetime of the same order as LRU's, and a block that came back a multiple of it. ``python
benchmarks/policy_replay.py --ttl-bound`` measures it: 22.4% prefix hits at 5% against
LRU's 19.5% (1.15x), where the best policy ranking by count and recency alone is
estimated at 22.6%; the rest of the way to Belady (36.6%) needs knowing which
conversations will come back, which the keys do not tell.

Parents may be unknown or arrive after their children: children are counted per parent
key whether or not that parent is held, so a late parent starts as an interior key.

Keys a retention hint holds (``hold``, from the retention layer: ``policies/retention.py``)
leave the walk until ``release``: a held leaf's entry moves to a second heap, which only
``held_victims`` (the layer's last class) walks, merged with the first in priority order,
and a held interior key is passed over in the ancestors' pass. Passing a key over changes
nothing here, so the order is the same as a walk that yields every key and has the held
ones skipped; a walk that would offer only held keys after its leaves ends there.

Cost: O(1) per access of an interior key, O(log n) per insert, per access of a leaf and
per victim (a binary heap of leaves with lazily dropped stale entries, compacted when
it grows past twice the number of keys). Not thread-safe: the Store calls it under its
lock. ``set_capacity`` is not needed: nothing here is sized from the tier's capacity.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Hashable, Iterator

from kvstore.policies.base import EvictionPolicy

_Entry = tuple[float, int, Hashable]  # (priority, stamp, key); stamp breaks ties FIFO


def _fresh(entry: _Entry) -> _Entry:
    """A new object equal to ``entry``. A held key's entry is live in the held heap only
    while ``_hold`` maps the key to that very object, so each hold takes a new one: a
    copy left there by an earlier hold of the key stays dead."""
    return (entry[0], entry[1], entry[2])


class LineagePolicy(EvictionPolicy):
    name = "lineage"
    uses_parent = True
    holds = True

    def __init__(self) -> None:
        self._parent: dict[Hashable, Hashable | None] = {}
        self._children: dict[Hashable, int] = {}     # parent key -> its held children (parent held or not)
        self._priority: dict[Hashable, float] = {}
        self._count: dict[Hashable, int] = {}
        self._stamp: dict[Hashable, int] = {}        # stamp of each leaf's live heap entry
        self._heap: list[_Entry] = []
        self._parked: list[_Entry] = []              # entries popped while the Store skipped them
        # keys the retention layer holds (hold): each leaf's live entry, out of the heap
        # until release (None: an interior key, or a leaf not popped since)
        self._hold: dict[Hashable, _Entry | None] = {}
        self._hold_heap: list[_Entry] = []            # their entries (held_victims), lazily dropped
        self._hold_parked: list[_Entry] = []          # ... popped by this walk, back after it
        self._out: _Entry | None = None               # the entry a walk is yielding
        # Evicted key -> its count, split by whether it had been used once or more.
        self._ghost_once: OrderedDict[Hashable, int] = OrderedDict()
        self._ghost_again: OrderedDict[Hashable, int] = OrderedDict()
        self.frequency_weight = 1.0                  # beta: 0 ranks by recency, 1 is GDSF
        self._clock = 0.0                            # GDSF's L
        self._next_stamp = 0
        self._offered: Hashable | None = None

    def on_insert(self, key: Hashable, nbytes: int, parent: Hashable | None = None) -> None:
        if key in self._parent:
            self.on_access(key)
            return
        self._parent[key] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
            if parent in self._stamp:
                del self._stamp[parent]  # no longer a leaf; its heap entry goes stale
        self._count[key] = self._returning_count(key) + 1
        self._priority[key] = self._clock + self._value(self._count[key])
        if not self._children.get(key):
            self._push(key)

    def on_access(self, key: Hashable) -> None:
        if key not in self._parent:
            return
        self._count[key] += 1
        self._priority[key] = max(self._priority[key], self._clock + self._value(self._count[key]))
        if key in self._stamp:
            self._push(key)

    def on_remove(self, key: Hashable) -> None:
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        priority = self._priority.pop(key)
        self._stamp.pop(key, None)
        self._hold.pop(key, None)
        if key == self._offered:
            self._clock = max(self._clock, priority)
            self._offered = None
        count = self._count.pop(key)
        (self._ghost_once if count == 1 else self._ghost_again)[key] = count
        while len(self._ghost_once) + len(self._ghost_again) > len(self._parent):
            larger = self._ghost_once if len(self._ghost_once) >= len(self._ghost_again) else self._ghost_again
            larger.popitem(last=False)
        if parent is None:
            return
        remaining = self._children[parent] - 1
        if remaining:
            self._children[parent] = remaining
            return
        del self._children[parent]
        if parent in self._parent:
            self._priority[parent] = max(self._priority[parent], priority)
            self._push(parent)

    def victims(self) -> Iterator[Hashable]:
        return self._walk(held=False)

    def held_victims(self) -> Iterator[Hashable]:
        return self._walk(held=True)

    def _walk(self, held: bool) -> Iterator[Hashable]:
        """Leaves lowest priority first, then (every leaf skipped) their ancestors, then
        what is left; the keys the retention layer holds are passed over (``held``:
        offered too, in their place)."""
        self._unpark()
        hold = self._hold
        skipped: list[_Entry] = []
        offered_interior: set[Hashable] = set()
        pending: _Entry | None = None     # popped and yielded: the walk may end there
        try:
            while True:
                entry = self._next_leaf(held)
                if entry is None:
                    break
                key = entry[2]
                self._offered = key
                pending = self._out = entry
                yield key
                pending = self._out = None
                if key in self._parent and self._stamp.get(key) == entry[1]:
                    self._keep(entry)
                    skipped.append(entry)
            if not held and len(self._parent) - len(hold) == sum(e[2] not in hold for e in skipped):
                return      # every key not held is a leaf this walk passed: nothing else to offer
            # the held leaves count as passed over, in the order the heap would give them
            passed = {entry[1] for entry in skipped}
            still = sorted(e for e in self._hold_heap      # the held leaves' live entries
                           if hold.get(e[2]) is e and e[1] not in passed and self._stamp.get(e[2]) == e[1])
            skipped_leaves = [entry[2] for entry in heapq.merge(skipped, still)]
            # Every leaf was skipped: offer their ancestors, nearest first, rather than
            # report a full tier that still holds evictable keys. Every held interior
            # key is an ancestor of some held leaf, so this reaches all of them.
            for leaf in skipped_leaves:
                key = self._parent.get(leaf)
                while key is not None and key in self._parent and key not in offered_interior:
                    offered_interior.add(key)
                    above = self._parent[key]
                    if held or key not in hold:
                        self._offered = key
                        yield key
                    key = above
            # Parent links that never lead to a leaf (a cycle from inconsistent parents,
            # impossible with chained digests) must not hide keys: offer what is left.
            seen_leaves = set(skipped_leaves)
            for key in list(self._parent):
                if (key in self._parent and key not in offered_interior and key not in seen_leaves
                        and (held or key not in hold)):
                    self._offered = key
                    yield key
        finally:
            # a walk the Store ended at a key it did not take: that key keeps its place
            self._out = None
            if pending is not None and self._stamp.get(pending[2]) == pending[1]:
                self._keep(pending)
            self._unpark()

    def _next_leaf(self, held: bool) -> _Entry | None:
        """Pop the live leaf entry of least priority (``held``: of the held keys' too)."""
        heap, hold_heap, hold, stamp = self._heap, self._hold_heap, self._hold, self._stamp
        while heap:
            top = heap[0]
            if stamp.get(top[2]) != top[1]:
                heapq.heappop(heap)       # stale: touched, re-pushed, no longer a leaf, or gone
            elif top[2] in hold:          # (held after it was pushed: kept with the held)
                heapq.heappop(heap)
                hold[top[2]] = entry = _fresh(top)
                self._push_held(entry)
            else:
                break
        if held:
            while hold_heap:
                top = hold_heap[0]
                if stamp.get(top[2]) == top[1] and hold.get(top[2]) is top:
                    break
                heapq.heappop(hold_heap)  # stale, or released since
            if hold_heap and (not heap or hold_heap[0] < heap[0]):
                return heapq.heappop(hold_heap)
        return heapq.heappop(heap) if heap else None

    def _keep(self, entry: _Entry) -> None:
        """A live leaf the walk popped and did not evict: back after the walk, with the
        held keys if the retention layer holds it (now or since)."""
        if entry[2] in self._hold:
            self._hold[entry[2]] = entry = _fresh(entry)
            self._hold_parked.append(entry)
        else:
            self._parked.append(entry)  # skipped: keep it for the next walk

    def hold(self, key: Hashable) -> None:
        # None: an interior key, the leaf being yielded (its entry comes here as the walk
        # resumes), or a leaf whose entry is still in the heap (one since this walk began:
        # moved here when it comes up, or when the heap is rebuilt)
        if key in self._parent and key not in self._hold:
            self._hold[key] = None

    def release(self, key: Hashable) -> None:
        entry = self._hold.pop(key, None)
        if entry is not None and self._stamp.get(key) == entry[1]:
            heapq.heappush(self._heap, entry)

    def priority(self, key: Hashable) -> float | None:
        """The key's current GDSF priority (None if not held); lower goes first. Between
        two touches of the same key it only changes by inheriting a child's."""
        return self._priority.get(key)

    def is_leaf(self, key: Hashable) -> bool:
        """True if the key is held and no held key names it as parent."""
        return key in self._parent and not self._children.get(key)

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    def _value(self, count: int) -> float:
        return 1.0 + self.frequency_weight * (count - 1)

    def _returning_count(self, key: Hashable) -> int:
        """The count a key had when it was evicted (0 if forgotten), adapting the
        frequency weight as ARC adapts its target: by one step of 1/n (n keys held),
        times the ratio of the ghost lists when the other one is larger."""
        step = 1.0 / max(len(self._parent), 1)
        if key in self._ghost_once:
            ratio = max(1.0, len(self._ghost_again) / len(self._ghost_once))
            self.frequency_weight = max(0.0, self.frequency_weight - ratio * step)
            return self._ghost_once.pop(key)
        if key in self._ghost_again:
            ratio = max(1.0, len(self._ghost_once) / len(self._ghost_again))
            self.frequency_weight = min(1.0, self.frequency_weight + ratio * step)
            return self._ghost_again.pop(key)
        return 0

    def _push(self, key: Hashable) -> None:
        self._next_stamp += 1
        self._stamp[key] = self._next_stamp
        entry = (self._priority[key], self._next_stamp, key)
        if key in self._hold:
            self._hold[key] = entry
            self._push_held(entry)
            return
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._parent) + 64:
            # out of the heap until the walk ends: the entries it popped and kept, and the
            # one it is yielding
            out = {entry[1] for entry in self._parked} | {self._out[1] if self._out else None}
            heap, hold = [], self._hold
            for k, s in self._stamp.items():
                if s in out:
                    continue
                entry = (self._priority[k], s, k)
                if k not in hold:
                    heap.append(entry)
                elif hold[k] is None:          # held while its entry was in this heap
                    hold[k] = entry
                    heapq.heappush(self._hold_heap, entry)
            self._heap = heap
            heapq.heapify(heap)
            self._compact_held()

    def _push_held(self, entry: _Entry) -> None:
        heapq.heappush(self._hold_heap, entry)
        self._compact_held()

    def _compact_held(self) -> None:
        if len(self._hold_heap) > 2 * len(self._hold) + 64:
            out = {entry[1] for entry in self._hold_parked} | {self._out[1] if self._out else None}
            self._hold_heap = [e for e in self._hold.values()
                               if e is not None and e[1] not in out and self._stamp.get(e[2]) == e[1]]
            heapq.heapify(self._hold_heap)

    def _unpark(self) -> None:
        for entry in self._parked:
            if self._stamp.get(entry[2]) == entry[1]:
                heapq.heappush(self._heap, entry)
        self._parked.clear()
        parked, self._hold_parked = self._hold_parked, []
        for entry in parked:
            if self._stamp.get(entry[2]) == entry[1] and self._hold.get(entry[2]) is entry:
                heapq.heappush(self._hold_heap, entry)
        self._compact_held()

