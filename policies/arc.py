"""ARC, adaptive replacement (Megiddo and Modha, FAST'03).

Held keys are in T1 (seen once recently) or T2 (seen at least twice); B1 and B2 are
ghost lists remembering keys recently evicted from T1 and T2. A miss that hits B1 means
T1 was too small, so the target size ``p`` of T1 grows; a B2 hit shrinks it. Either way
the returning key enters T2. Evictions take T1's least recent key while T1 is larger
than ``p``, else T2's least recent key.

**Byte-weighted**: ``p``, the list sizes and the ghost bounds are in bytes (ARC's page
counts become bytes; a ghost hit moves ``p`` by the returning key's size, scaled by the
ratio of the ghost lists as in the paper). The cache size ``c`` comes from
``set_capacity``; without it, from the bytes currently held. As in ARC, T1+B1 stays
within ``c`` and all four lists within ``2c``.

The policy does not see the incoming key when the Store asks for victims, so ARC's
tie rule "evict from T1 when it holds exactly ``p`` and the miss was in B2" is read as
"evict from T2 on a tie".

O(1) per insert, access and removal (``OrderedDict`` lists) and O(1) amortised per
victim. A key the Store skips is moved to the recent end of its list; a walk ends
once every held key was skipped without an eviction.

Not thread-safe: the Store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from kvstore.policies.base import EvictionPolicy


class ArcPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[Hashable, int] = OrderedDict()  # key -> nbytes, least recent first
        self._t2: OrderedDict[Hashable, int] = OrderedDict()
        self._b1: OrderedDict[Hashable, int] = OrderedDict()
        self._b2: OrderedDict[Hashable, int] = OrderedDict()
        self._bytes = {"t1": 0, "t2": 0, "b1": 0, "b2": 0}
        self.target_t1_bytes = 0.0  # ARC's p
        self._capacity_bytes: int | None = None

    def set_capacity(self, capacity_bytes: int) -> None:
        self._capacity_bytes = int(capacity_bytes)

    def on_insert(self, key: Hashable, nbytes: int, parent: Hashable | None = None) -> None:
        if key in self._t1 or key in self._t2:
            self.on_access(key)
            return
        capacity = self._capacity()
        if key in self._b1:
            ratio = max(1.0, self._bytes["b2"] / max(self._bytes["b1"], 1))
            self.target_t1_bytes = min(capacity, self.target_t1_bytes + nbytes * ratio)
            self._take("b1", self._b1, key)
            self._put("t2", self._t2, key, nbytes)
        elif key in self._b2:
            ratio = max(1.0, self._bytes["b1"] / max(self._bytes["b2"], 1))
            self.target_t1_bytes = max(0.0, self.target_t1_bytes - nbytes * ratio)
            self._take("b2", self._b2, key)
            self._put("t2", self._t2, key, nbytes)
        else:
            self._put("t1", self._t1, key, nbytes)
        self._trim_ghosts()

    def on_access(self, key: Hashable) -> None:
        if key in self._t1:
            self._put("t2", self._t2, key, self._take("t1", self._t1, key))
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        if key in self._t1:
            self._put("b1", self._b1, key, self._take("t1", self._t1, key))
        elif key in self._t2:
            self._put("b2", self._b2, key, self._take("t2", self._t2, key))
        else:
            return
        self._trim_ghosts()

    def victims(self) -> Iterator[Hashable]:
        # A skipped key (leased or pinned) moves to the end of its list, so a list whose
        # head was skipped has been skipped whole: then the other list is tried, and
        # the walk ends once both heads were skipped.
        skipped: set[Hashable] = set()
        while self._t1 or self._t2:
            prefer_t1 = self._t1 and (self._bytes["t1"] > self.target_t1_bytes or not self._t2)
            order = (self._t1, self._t2) if prefer_t1 else (self._t2, self._t1)
            held = next((q for q in order if q and next(iter(q)) not in skipped), None)
            if held is None:
                return
            key = next(iter(held))
            yield key
            if key in held:
                held.move_to_end(key)
                skipped.add(key)

    def list_of(self, key: Hashable) -> str | None:
        """``"t1"``, ``"t2"``, ``"b1"``, ``"b2"`` or None: where the key sits now."""
        for name, entries in (("t1", self._t1), ("t2", self._t2), ("b1", self._b1), ("b2", self._b2)):
            if key in entries:
                return name
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def _capacity(self) -> int:
        if self._capacity_bytes is not None:
            return self._capacity_bytes
        return self._bytes["t1"] + self._bytes["t2"]

    def _put(self, name: str, entries: OrderedDict[Hashable, int], key: Hashable, nbytes: int) -> None:
        entries[key] = nbytes
        self._bytes[name] += nbytes

    def _take(self, name: str, entries: OrderedDict[Hashable, int], key: Hashable) -> int:
        nbytes = entries.pop(key)
        self._bytes[name] -= nbytes
        return nbytes

    def _trim_ghosts(self) -> None:
        capacity = self._capacity()
        sizes = self._bytes
        while self._b1 and sizes["t1"] + sizes["b1"] > capacity:
            sizes["b1"] -= self._b1.popitem(last=False)[1]
        while self._b2 and sum(sizes.values()) > 2 * capacity:
            sizes["b2"] -= self._b2.popitem(last=False)[1]
