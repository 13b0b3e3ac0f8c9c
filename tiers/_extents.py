"""A first-fit extent allocator over one address range, with exact-size reuse.

Used by every tier that carves one big region (an arena in memory, a preallocated file)
into variable-size slots. Not thread-safe: callers hold their own lock.
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    """Hands out ``[offset, offset + size)`` ranges of a region of ``size`` bytes.

    Sizes are rounded up to ``align``. Freed neighbours coalesce; a freed extent of the
    same rounded size is reused first, so equal-size blocks never fragment the region.
    """

    def __init__(self, size: int, align: int = 1) -> None:
        self.align = align
        self.size = size - size % align
        self._starts: list[int] = [0] if self.size else []   # sorted free extent starts
        self._len: dict[int, int] = {0: self.size} if self.size else {}
        self._by_size: dict[int, set[int]] = {self.size: {0}} if self.size else {}
        self.free_bytes = self.size

    @classmethod
    def with_used(cls, size: int, align: int, used: list[tuple[int, int]]) -> "ExtentAllocator":
        """An allocator with ``used`` extents ``(offset, nbytes)`` already taken: the bulk
        form of :meth:`reserve` for index recovery, linear in ``len(used)``. The extents
        must be sorted by offset, aligned, inside the region and not overlap."""
        alloc = cls(0, align)
        alloc.size = size - size % align
        pos = 0
        for offset, nbytes in used:
            if offset > pos:
                alloc._add(pos, offset - pos)
            pos = offset + alloc.rounded(nbytes)
        if pos < alloc.size:
            alloc._add(pos, alloc.size - pos)
        return alloc

    @classmethod
    def with_free(cls, size: int, align: int, free: list[tuple[int, int]]) -> "ExtentAllocator":
        """An allocator whose only free space is ``free`` extents ``(offset, nbytes)``,
        sorted by offset, aligned, inside the region, not overlapping or touching: the
        form index recovery builds when it has computed the gaps between used extents
        in bulk."""
        alloc = cls(0, align)
        alloc.size = size - size % align
        for offset, nbytes in free:
            alloc._add(offset, nbytes)
        return alloc

    def rounded(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align if nbytes else self.align

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of ``rounded(nbytes)`` bytes, or ``None`` if none fits."""
        need = self.rounded(nbytes)
        exact = self._by_size.get(need)
        if exact:
            start = next(iter(exact))
            self._remove(start)
            return start
        for start in self._starts:
            length = self._len[start]
            if length >= need:
                self._remove(start)
                if length > need:
                    self._add(start + need, length - need)
                return start
        return None

    def reserve(self, offset: int, nbytes: int) -> bool:
        """Mark a specific extent used (index recovery). False if any of it is not free."""
        need = self.rounded(nbytes)
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start = self._starts[i]
        length = self._len[start]
        if offset + need > start + length:
            return False
        self._remove(start)
        if offset > start:
            self._add(start, offset - start)
        if start + length > offset + need:
            self._add(offset + need, start + length - offset - need)
        return True

    def free(self, offset: int, nbytes: int) -> None:
        length = self.rounded(nbytes)
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] == offset + length:  # merge right
            nxt = self._starts[i]
            length += self._len[nxt]
            self._remove(nxt)
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._len[prev] == offset:  # merge left
                offset, length = prev, self._len[prev] + length
                self._remove(prev)
        self._add(offset, length)

    def largest_free(self) -> int:
        return max(self._len.values(), default=0)

    def _add(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._len[start] = length
        self._by_size.setdefault(length, set()).add(start)
        self.free_bytes += length

    def _remove(self, start: int) -> None:
        length = self._len.pop(start)
        del self._starts[bisect.bisect_left(self._starts, start)]
        bucket = self._by_size[length]
        bucket.discard(start)
        if not bucket:
            del self._by_size[length]
        self.free_bytes -= length
