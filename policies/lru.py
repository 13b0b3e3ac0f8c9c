"""Least recently used: evict the key whose last insert or access is oldest.

O(1) per insert, access and removal, O(1) per victim yielded (an ``OrderedDict``);
a key the Store skips stays where it is and the walk steps over it.
Not thread-safe: the Store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from kvstore.policies._order import iter_live
from kvstore.policies.base import EvictionPolicy


class LruPolicy(EvictionPolicy):
    name = "lru"
    stamped = renews = True

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable, nbytes: int, parent: Hashable | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter_live(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
