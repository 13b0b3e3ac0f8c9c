"""Slot bookkeeping for a tier that carves one arena into slots (the GPU tier).

It is the DRAM tier's design (same allocator, same reader counts) lifted out of the
tier so arenas on any device can share it; DramTier can move onto it once the
concurrent changes to its internals (in-place reservations) have landed.

:class:`SlotIndex` knows which key lives at which ``(offset, nbytes)`` of the arena,
counts payload bytes against the configured capacity and keeps a reader count per
slot, so a deleted slot is reused only after its last reader has finished copying.
It never touches the arena's bytes: the tier copies, outside the lock.

Thread-safe: every method takes the index's lock briefly.
"""

from __future__ import annotations

import threading
from typing import Iterator, Sequence

from kvstore.keys import BlockKey
from tiers._extents import ExtentAllocator


class Slot:
    """One stored block: where it is, how big, and who is reading it."""

    __slots__ = ("offset", "nbytes", "readers", "dead")

    def __init__(self, offset: int, nbytes: int) -> None:
        self.offset, self.nbytes, self.readers, self.dead = offset, nbytes, 0, False


class SlotIndex:
    """Key → slot map over an arena of ``arena_bytes`` holding at most ``capacity_bytes``
    of payload. Writes are two-phase: :meth:`reserve` takes room (counted at once, so
    concurrent writers never overshoot the capacity), :meth:`commit` publishes the key
    once its bytes are in place, :meth:`abort` returns the room after a failed copy."""

    def __init__(self, capacity_bytes: int, arena_bytes: int, align: int) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self._alloc = ExtentAllocator(arena_bytes, align)
        self._slots: dict[BlockKey, Slot] = {}
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def nbytes(self, key: BlockKey) -> int | None:
        slot = self._slots.get(key)
        return slot.nbytes if slot else None

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        slots = self._slots
        return [k in slots for k in keys]

    def offset_of(self, key: BlockKey) -> tuple[int, int] | None:
        slot = self._slots.get(key)
        return (slot.offset, slot.nbytes) if slot else None

    def reserve(self, key: BlockKey, nbytes: int) -> tuple[bool, int | None]:
        """``(True, None)`` when ``key`` is already stored; ``(False, offset)`` with room
        reserved for ``nbytes``; ``(False, None)`` when there is no room."""
        with self._lock:
            if key in self._slots:
                return True, None
            if self._used + nbytes > self.capacity_bytes:
                return False, None
            offset = self._alloc.alloc(nbytes)
            if offset is None:
                return False, None
            self._used += nbytes
            return False, offset

    def commit(self, key: BlockKey, offset: int, nbytes: int) -> None:
        """Publish a reserved slot whose bytes are in place. A concurrent writer of the
        same key that committed first wins (same key, same content); ours is freed."""
        with self._lock:
            if key in self._slots:
                self._alloc.free(offset, nbytes)
                self._used -= nbytes
            else:
                self._slots[key] = Slot(offset, nbytes)

    def abort(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._alloc.free(offset, nbytes)
            self._used -= nbytes

    def acquire(self, key: BlockKey) -> Slot | None:
        """The key's slot with a reader held (``None`` when absent); pair with release."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                slot.readers += 1
            return slot

    def release(self, slot: Slot) -> None:
        with self._lock:
            slot.readers -= 1
            if slot.dead and slot.readers == 0:
                self._alloc.free(slot.offset, slot.nbytes)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                slot = self._slots.pop(key, None)
                if slot is None:
                    continue
                removed += 1
                self._used -= slot.nbytes
                if slot.readers:
                    slot.dead = True  # freed by the last reader
                else:
                    self._alloc.free(slot.offset, slot.nbytes)
        return removed

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            snapshot = list(self._slots)
        return iter(snapshot)

    def largest_free(self) -> int:
        with self._lock:
            return self._alloc.largest_free()

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()
            self._used = 0
