"""Slot bookkeeping for a tier that carves one arena into slots (DRAM and GPU tiers).

:class:`SlotIndex` knows which key lives at which ``(offset, nbytes)`` of the arena,
counts payload bytes against the configured capacity and keeps a reader count per
slot, so a deleted slot is reused only after its last reader has finished copying.
It never touches the arena's bytes: the tier copies, outside the lock.

Thread-safe: every method takes the index's lock briefly.
"""

from __future__ import annotations

import threading
from typing import Iterator, Sequence, Union

from kvstore.keys import BlockKey
from kvstore.tiers._extents import ExtentAllocator
from kvstore.tiers.base import Tier


Reserved = Union[bool, None, tuple[int, int]]  # stored already / no room / (offset, nbytes)


class Slot:
    """One stored block: where it is, how big, who is reading it, and the XXH3-64 of
    its bytes (``None`` for a tier that keeps none)."""

    __slots__ = ("offset", "nbytes", "readers", "dead", "checksum")

    def __init__(self, offset: int, nbytes: int, checksum: int | None = None) -> None:
        self.offset, self.nbytes, self.readers, self.dead = offset, nbytes, 0, False
        self.checksum = checksum


class SlotIndex:
    """Key → slot map over an arena of ``arena_bytes`` holding at most ``capacity_bytes``
    of payload. Writes are two-phase: :meth:`reserve_many` takes room (counted at once,
    so concurrent writers never overshoot the capacity), :meth:`commit_many` publishes
    keys once their bytes are in place, :meth:`abort_many` returns the room after a
    failed copy, :meth:`abandon_many` keeps it for good (a transfer that could not be
    cancelled may still write it). Batch methods take the lock once per batch.

    ``frame_bytes`` (a multiple of ``align``; 0: none): each slot also takes that many
    arena bytes right before its payload, its header frame (see
    :class:`~kvstore.tiers.dram.DramTier`'s ``header_frames``). Offsets are always the
    payload's; frames are not counted against the capacity."""

    def __init__(self, capacity_bytes: int, arena_bytes: int, align: int, frame_bytes: int = 0) -> None:
        if frame_bytes % align:
            raise ValueError(f"frame_bytes {frame_bytes} is not a multiple of the alignment {align}")
        self.capacity_bytes = int(capacity_bytes)
        self.frame_bytes = frame_bytes
        self._alloc = ExtentAllocator(arena_bytes, align)
        self._slots: dict[BlockKey, Slot] = {}
        self._used = 0
        self.abandoned_bytes = 0
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

    def reserve_many(self, keys: Sequence[BlockKey], sizes: Sequence[int]) -> list[Reserved]:
        """Per key: ``True`` when already stored, ``(offset, nbytes)`` with room reserved,
        ``None`` when there is no room."""
        out: list[Reserved] = []
        with self._lock:
            for key, nbytes in zip(keys, sizes):
                if key in self._slots:
                    out.append(True)
                    continue
                offset = self._take(nbytes) if self._used + nbytes <= self.capacity_bytes else None
                if offset is None:
                    out.append(None)
                    continue
                self._used += nbytes
                out.append((offset, nbytes))
        return out

    def commit_many(self, keys: Sequence[BlockKey], reserved: Sequence[Reserved],
                    sums: Sequence[int | None] | None = None) -> list[bool]:
        """Publish reserved slots whose bytes are in place, with their checksums
        (``sums``, one per key). Per key: True when stored (a concurrent writer of the
        same key that committed first wins — same key, same content — and ours is
        freed), False where nothing was reserved."""
        out = []
        sums = sums if sums is not None else [None] * len(keys)
        with self._lock:
            for key, entry, csum in zip(keys, reserved, sums):
                if not isinstance(entry, tuple):
                    out.append(entry is True)
                    continue
                offset, nbytes = entry
                if key in self._slots:
                    self._give(offset, nbytes)
                    self._used -= nbytes
                else:
                    self._slots[key] = Slot(offset, nbytes, csum)
                out.append(True)
        return out

    def abort_many(self, reserved: Sequence[Reserved]) -> None:
        with self._lock:
            for entry in reserved:
                if isinstance(entry, tuple):
                    self._give(*entry)
                    self._used -= entry[1]

    def abandon_many(self, reserved: Sequence[Reserved]) -> None:
        """Keep reserved room out of use for good and store nothing."""
        with self._lock:
            self.abandoned_bytes += sum(e[1] for e in reserved if isinstance(e, tuple))

    def acquire_many(self, keys: Sequence[BlockKey]) -> list[Slot | None]:
        """The keys' slots with a reader held on each (``None`` when absent); pair with
        :meth:`release_many`."""
        with self._lock:
            slots = [self._slots.get(k) for k in keys]
            for slot in slots:
                if slot is not None:
                    slot.readers += 1
        return slots

    def release_many(self, slots: Sequence[Slot | None]) -> None:
        with self._lock:
            for slot in slots:
                if slot is None:
                    continue
                slot.readers -= 1
                if slot.dead and slot.readers == 0:
                    self._give(slot.offset, slot.nbytes)

    def acquire(self, key: BlockKey) -> Slot | None:
        return self.acquire_many([key])[0]

    def release(self, slot: Slot) -> None:
        self.release_many([slot])

    def checksums(self, keys: Sequence[BlockKey]) -> list[int | None]:
        slots = self._slots
        return [s.checksum if (s := slots.get(k)) is not None else None for k in keys]

    def drop_slot(self, key: BlockKey, slot: Slot) -> bool:
        """Delete ``key`` only while it still maps to ``slot`` (a corrupt copy found by
        a reader; a newer slot for the key is left alone)."""
        with self._lock:
            if self._slots.get(key) is not slot:
                return False
            self._remove(key)
            return True

    def delete(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            return sum(self._remove(key) for key in keys)

    def _remove(self, key: BlockKey) -> bool:
        """Caller holds the lock."""
        slot = self._slots.pop(key, None)
        if slot is None:
            return False
        self._used -= slot.nbytes
        if slot.readers:
            slot.dead = True  # freed by the last reader
        else:
            self._give(slot.offset, slot.nbytes)
        return True

    def _take(self, nbytes: int) -> int | None:
        """A new slot's payload offset (its frame before it), or ``None``. Caller holds the lock."""
        frame = self.frame_bytes
        start = self._alloc.alloc(frame + nbytes)
        return None if start is None else start + frame

    def _give(self, offset: int, nbytes: int) -> None:
        """Free a slot taken by :meth:`_take`, frame and all. Caller holds the lock."""
        frame = self.frame_bytes
        self._alloc.free(offset - frame, frame + nbytes)

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            snapshot = list(self._slots)
        return iter(snapshot)

    def largest_free(self) -> int:
        """The largest payload a new slot could take now."""
        with self._lock:
            return max(self._alloc.largest_free() - self.frame_bytes, 0)

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()
            self._used = 0


class ArenaTier(Tier):
    """The Tier methods every arena tier answers from its :class:`SlotIndex`; subclasses
    set ``_capacity`` and ``_index`` and implement the copies."""

    _capacity: int
    _index: SlotIndex

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def nbytes(self, key: BlockKey) -> int | None:
        return self._index.nbytes(key)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self._index.contains(keys)

    def offset_of(self, key: BlockKey) -> tuple[int, int] | None:
        """``(offset, nbytes)`` of a stored block inside the arena (same-host sharing,
        IPC handles)."""
        return self._index.offset_of(key)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        return self._index.delete(keys)

    def keys(self) -> Iterator[BlockKey]:
        return self._index.keys()
