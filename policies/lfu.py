"""Least frequently used, ties broken by recency (the least recent of the least used
goes first).

Keys live in frequency buckets kept in a doubly linked list in ascending frequency
(the O(1) LFU of Shah, Mitra and Matani, 2010): an access moves a key from bucket
``f`` to bucket ``f + 1``, creating it next to ``f`` if needed, so every insert,
access and removal is O(1), and each victim yielded is O(1) amortised. Inside a bucket
an ``OrderedDict`` keeps the order in which keys reached that frequency, which is
their recency among equals. Counts are not aged: a key that was hot long ago stays
ahead of newer keys, the classic LFU trade-off.

Not thread-safe: the Store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from kvstore.policies._order import iter_live
from kvstore.policies.base import EvictionPolicy


class _Bucket:
    """All keys accessed exactly ``freq`` times, in the order they got there."""

    __slots__ = ("freq", "keys", "prev", "next", "linked")

    def __init__(self, freq: int) -> None:
        self.freq = freq
        self.keys: OrderedDict[Hashable, None] = OrderedDict()
        self.prev: _Bucket | None = None
        self.next: _Bucket | None = None
        self.linked = True


class LfuPolicy(EvictionPolicy):
    name = "lfu"

    def __init__(self) -> None:
        self._bucket_of: dict[Hashable, _Bucket] = {}
        self._head: _Bucket | None = None  # the lowest frequency present

    def on_insert(self, key: Hashable, nbytes: int, parent: Hashable | None = None) -> None:
        if key in self._bucket_of:
            self.on_access(key)
            return
        head = self._head
        if head is None or head.freq != 1:
            head = self._link_after(None, 1)
        head.keys[key] = None
        self._bucket_of[key] = head

    def on_access(self, key: Hashable) -> None:
        bucket = self._bucket_of.get(key)
        if bucket is None:
            return
        following = bucket.next
        if following is None or following.freq != bucket.freq + 1:
            following = self._link_after(bucket, bucket.freq + 1)
        following.keys[key] = None
        self._bucket_of[key] = following
        del bucket.keys[key]
        if not bucket.keys:
            self._unlink(bucket)

    def on_remove(self, key: Hashable) -> None:
        bucket = self._bucket_of.pop(key, None)
        if bucket is None:
            return
        del bucket.keys[key]
        if not bucket.keys:
            self._unlink(bucket)

    def victims(self) -> Iterator[Hashable]:
        bucket = self._head
        while bucket is not None:
            if bucket.linked:
                yield from iter_live(bucket.keys)
            # An unlinked bucket keeps its ``next`` pointer, so a walk that started on
            # it still reaches the rest of the list.
            bucket = bucket.next

    def frequency(self, key: Hashable) -> int:
        """How many times ``key`` was inserted or accessed while held (0 if not held)."""
        bucket = self._bucket_of.get(key)
        return bucket.freq if bucket is not None else 0

    def __len__(self) -> int:
        return len(self._bucket_of)

    def __contains__(self, key: object) -> bool:
        return key in self._bucket_of

    def _link_after(self, before: _Bucket | None, freq: int) -> _Bucket:
        bucket = _Bucket(freq)
        bucket.prev = before
        bucket.next = self._head if before is None else before.next
        if bucket.next is not None:
            bucket.next.prev = bucket
        if before is None:
            self._head = bucket
        else:
            before.next = bucket
        return bucket

    def _unlink(self, bucket: _Bucket) -> None:
        bucket.linked = False
        if bucket.prev is None:
            self._head = bucket.next
        else:
            bucket.prev.next = bucket.next
        if bucket.next is not None:
            bucket.next.prev = bucket.prev
