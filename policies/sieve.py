"""SIEVE (Zhang et al., NSDI'24): one FIFO queue, a visited bit per key and a hand.

New keys enter at the head (newest end). An access only sets the key's visited bit.
To find a victim the hand walks from the tail (oldest) towards the head: a visited
key has its bit cleared and is passed over (it stays where it is, unlike CLOCK's
reinsertion), the first unvisited key is the victim, and the hand stays at that
position for the next eviction, wrapping to the tail when it passes the head. Keys
that survive a sweep therefore sit behind the hand, while new keys are judged quickly.

The queue is a doubly linked list kept in two dicts (older/newer neighbour), so an
insert, access or removal is O(1) and each victim costs O(1) amortised (each bit is
cleared at most once per set). A key the Store skips is passed over like a visited
one; a walk that finds no victim after two full sweeps without an eviction ends.

Not thread-safe: the Store calls it under its lock.
"""

from __future__ import annotations

from typing import Hashable, Iterator

from kvstore.policies.base import EvictionPolicy


class SievePolicy(EvictionPolicy):
    name = "sieve"

    def __init__(self) -> None:
        self._visited: dict[Hashable, bool] = {}
        self._newer: dict[Hashable, Hashable | None] = {}
        self._older: dict[Hashable, Hashable | None] = {}
        self._head: Hashable | None = None  # newest
        self._tail: Hashable | None = None  # oldest
        self._hand: Hashable | None = None  # next key to examine; None means the tail

    def on_insert(self, key: Hashable, nbytes: int, parent: Hashable | None = None) -> None:
        if key in self._visited:
            self._visited[key] = True
            return
        self._visited[key] = False
        self._older[key] = self._head
        self._newer[key] = None
        if self._head is not None:
            self._newer[self._head] = key
        self._head = key
        if self._tail is None:
            self._tail = key

    def on_access(self, key: Hashable) -> None:
        if key in self._visited:
            self._visited[key] = True

    def on_remove(self, key: Hashable) -> None:
        if key not in self._visited:
            return
        del self._visited[key]
        older = self._older.pop(key)
        newer = self._newer.pop(key)
        if self._hand == key:
            self._hand = newer  # the hand keeps moving towards the head
        if older is None:
            self._tail = newer
        else:
            self._newer[older] = newer
        if newer is None:
            self._head = older
        else:
            self._older[newer] = older

    def victims(self) -> Iterator[Hashable]:
        steps_without_eviction = 0
        while self._visited and steps_without_eviction <= 2 * len(self._visited):
            key = self._hand if self._hand is not None else self._tail
            steps_without_eviction += 1
            if self._visited[key]:
                self._visited[key] = False
                self._hand = self._newer[key]
                continue
            self._hand = key
            yield key
            if key in self._visited:  # skipped by the Store: pass over it
                if self._hand == key:
                    self._hand = self._newer[key]
            else:
                steps_without_eviction = 0

    def is_visited(self, key: Hashable) -> bool:
        """The key's visited bit (False if not held)."""
        return self._visited.get(key, False)

    def __len__(self) -> int:
        return len(self._visited)

    def __contains__(self, key: object) -> bool:
        return key in self._visited
