"""First in, first out: insertion order, accesses change nothing.

O(1) per insert, access and removal, O(1) per victim yielded (an ``OrderedDict``);
a key the Store skips stays where it is and the walk steps over it.
Not thread-safe: the Store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from kvstore.policies._order import iter_live
from kvstore.policies.base import EvictionPolicy


class FifoPolicy(EvictionPolicy):
    name = "fifo"
    stamped = True

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable, nbytes: int, parent: Hashable | None = None) -> None:
        self._order.setdefault(key, None)

    def on_access(self, key: Hashable) -> None:
        pass

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter_live(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
