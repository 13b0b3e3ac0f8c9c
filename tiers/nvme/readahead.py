"""Sequential read-ahead for the NVMe tier: while one batch is checked and handed back,
the disk already reads the start of the next.

A long prefix read back in batches is a stream of extents laid out one after another
on disk. Read batch by batch, the disk idles between calls: a batch's transfers land
together, then its blocks are checked and the next call is planned with nothing in
flight. When a ``read_into`` call reads the extents that directly follow the previous
call's, the tier reads the next span of the same file (as long as that call's, at most
``max_bytes``) into a staging buffer in the background. The next call copies the
blocks it finds there into its buffers on one pool thread while its other blocks are
read directly, and checks each copy exactly as a direct read would
(:func:`tiers.nvme.io.copy_block`). A copy that fails the check (the extent was
rewritten after it was read ahead) is read again directly, and that read alone decides
whether the block is corrupt.

Two staging buffers, allocated on the first stream: one being filled, one being copied
from. One stream at a time: the caller holds :attr:`ReadAhead.lock` (taken without
waiting; a call that finds it held reads directly) from choosing its hits until its
copies are done, so a buffer is never refilled while it is read.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvstore.buffers import host_view, is_device
from kvstore.errors import CorruptBlockError, InvalidArgumentError
from kvstore.tiers.nvme.io import PAGE, aligned_empty, copy_block, extent_bytes

FileId = tuple[int, int]   # (shard number, file number)
PIECES = 8                 # reads a window is cut into, so several are in flight
MIN_PIECE = 1 << 20


@dataclass
class Window:
    """Bytes ``[start, start + len(buf))`` of one data file, being read into ``buf``."""

    file: FileId
    start: int
    buf: np.ndarray
    pieces: list[tuple[int, Future]] = field(default_factory=list)   # (offset in buf, read)
    valid: int | None = None   # bytes read, from start; known after wait()

    def wait(self) -> int:
        """Block until the reads are done; the bytes read without a gap from ``start``."""
        if self.valid is None:
            valid = 0
            for at, task in self.pieces:
                try:
                    got = task.result()
                except OSError:   # a failed read-ahead is only a missed chance
                    got = 0
                if at != valid:
                    continue
                valid = at + got
            self.valid = valid
        return self.valid

    def view(self, file: FileId, offset: int, size: int) -> np.ndarray | None:
        """The ``size`` bytes at ``offset`` of ``file`` when this window read them."""
        at = offset - self.start
        if file != self.file or at < 0 or at + size > self.wait():
            return None
        return self.buf[at:at + size]

    def holds(self, file: FileId, offset: int, size: int) -> bool:
        """Whether ``[offset, offset + size)`` lies in the span this window reads."""
        return file == self.file and self.start <= offset and offset + size <= self.start + len(self.buf)


class ReadAhead:
    """One sequential stream's read-ahead state for a tier (see the module doc)."""

    def __init__(self, pool: ThreadPoolExecutor, max_bytes: int) -> None:
        self.max_bytes = max_bytes - max_bytes % PAGE
        self.lock = threading.Lock()
        self._pool = pool
        self._bufs: list[np.ndarray] = []
        self._filling: list[Window | None] = [None, None]   # the last window read into each buffer
        self._spare = 0                          # the buffer the next window fills
        self.window: Window | None = None
        self._follows: tuple[FileId, int] | None = None   # where the next call continues the stream

    def continues(self, file: FileId, start: int) -> bool:
        """Whether a call reading from ``start`` of ``file`` continues the stream."""
        return self._follows == (file, start)

    def advance(self, file: FileId, start: int, end: int, fd: int, file_bytes: int, *, read: bool) -> None:
        """Record that this call read ``[start, end)`` of ``file``; with ``read``, start
        reading the span after it, as long as this one (within the file), when that is at
        most ``max_bytes``. A longer batch keeps the disk busy long enough on its own, and
        copying it out of a staging buffer measured slower than reading it directly."""
        self._follows = (file, end)
        size = min(end - start, file_bytes - end)
        size -= size % PAGE
        if not read or size <= 0 or end - start > self.max_bytes:
            return
        if not self._bufs:
            self._bufs = [aligned_empty(self.max_bytes) for _ in range(2)]
        spare = self._spare
        if self._filling[spare] is not None:
            self._filling[spare].wait()   # never two reads into one buffer at once
        window = Window(file, end, self._bufs[spare][:size])
        piece = max(MIN_PIECE, -(-size // PIECES // PAGE) * PAGE)
        for at in range(0, size, piece):
            part = window.buf[at:at + piece]
            window.pieces.append((at, self._pool.submit(os.preadv, fd, [part], end + at)))
        self._filling[spare] = self.window = window
        self._spare ^= 1

    def read(self, jobs: list[tuple], read_direct: Callable[[list[tuple]], list[tuple[bool, Any]]],
             file_of: Callable[[FileId], tuple[int, int]]) -> tuple[list[tuple[bool, Any]], int]:
        """Read ``jobs`` (``(j, key, entry, dst)``): the blocks the window holds are copied
        on a pool thread while ``read_direct`` reads the others; when this call continues
        the stream, the span after it is read ahead (before the direct reads when there
        are none, else after them, so that the disk has work while this batch is handed
        back and the next one planned). ``file_of(file)`` is ``(fd, size)`` of a data file.
        Returns ``(ok, error)`` per job, in order, and how many came from the window.
        The caller holds :attr:`lock`."""
        window = self.window
        hits: list[int] = []
        if window is not None:
            hits = [i for i, (_, _, e, dst) in enumerate(jobs)
                    if not is_device(dst) and window.holds((e.shard.no, e.file_no), e.offset, extent_bytes(e.length))]
        hit_set = set(hits)
        misses = [i for i in range(len(jobs)) if i not in hit_set]
        copying = None
        if hits:
            window.wait()   # here, not on the pool: a pool thread must never wait for the pool
            copying = self._pool.submit(copy_hits, window, [jobs[i] for i in hits])
        span = span_of(jobs)
        ahead = span is not None and (bool(hits) or self.continues(span[0], span[1]))

        def read_ahead() -> None:
            if span is not None:
                file, start, end = span
                fd, size = file_of(file)
                self.advance(file, start, end, fd, size, read=ahead)

        if not misses:
            read_ahead()
        out: list[tuple[bool, Any]] = [None] * len(jobs)  # type: ignore[list-item]
        for i, res in zip(misses, read_direct([jobs[i] for i in misses]) if misses else []):
            out[i] = res
        if misses:
            read_ahead()
        served = 0
        if copying is not None:
            copied = copying.result()
            served = sum(copied)
            again = []
            for i, ok in zip(hits, copied):
                if ok:
                    out[i] = (True, None)
                else:
                    again.append(i)
            # a copy that failed its check: the extent changed after it was read ahead,
            # or the block is corrupt; a direct read tells which
            for i, res in zip(again, read_direct([jobs[i] for i in again]) if again else []):
                out[i] = res
        return out, served


def span_of(jobs: list[tuple]) -> tuple[FileId, int, int] | None:
    """``(file, start, end)`` when the extents of ``jobs`` (``(j, key, entry, dst)``) lie
    one after another in one data file, as a stream's batch does; else ``None``."""
    first = jobs[0][2]
    extents = sorted((e.offset, e.offset + extent_bytes(e.length)) for _, _, e, _ in jobs
                     if e.shard is first.shard and e.file_no == first.file_no)
    if len(extents) != len(jobs) or any(b[0] != a[1] for a, b in zip(extents, extents[1:])):
        return None
    return (first.shard.no, first.file_no), extents[0][0], extents[-1][1]


def copy_hits(window: Window, jobs: list[tuple]) -> list[bool]:
    """Copy the blocks of ``jobs`` (``(j, key, entry, dst)``) from ``window`` into their
    buffers, each checked as a direct read is; True per block that arrived intact.
    ``window`` is done reading (the caller waited)."""
    ok = []
    for _, key, e, dst in jobs:
        raw = window.view((e.shard.no, e.file_no), e.offset, extent_bytes(e.length))
        try:
            if raw is None:
                raise CorruptBlockError("not read ahead")
            copy_block(raw, key.digest, e.length, e.checksum, host_view(dst, writable=True))
            ok.append(True)
        except (CorruptBlockError, InvalidArgumentError):
            ok.append(False)
    return ok
