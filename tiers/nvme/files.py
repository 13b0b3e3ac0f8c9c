"""The data files of one NVMe tier directory and the space allocator over them.

A directory holds ``data-NNNNN.kvd`` files of ``file_bytes`` each, created (and
``fallocate``\\ d) on demand while the directory's byte budget allows, never up front:
a fresh tier costs no disk until blocks arrive. Each file is carved into extents by an
:class:`~tiers._extents.ExtentAllocator` with page alignment.

:func:`place` picks the directory and extent for a new block (striping by free space).

The directory is locked (``flock`` on ``kvstore.lock``) for the lifetime of the object,
so two processes never write the same files; the kernel drops the lock if the process
dies. Not thread-safe: the tier calls it under its own lock.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
from dataclasses import dataclass

import numpy as np

from kvstore.config.tiers import nvme_dir_budget
from kvstore.errors import ConfigError, TierError, TierFullError, TierIOError, TierUnavailableError
from kvstore.tiers._extents import ExtentAllocator
from kvstore.tiers.nvme.index import BlockIndex
from kvstore.tiers.nvme.io import PAGE, aligned_empty, extent_bytes, open_data_file

log = logging.getLogger(__name__)
_NAME = re.compile(r"^data-(\d{5})\.kvd$")


def data_file_name(file_no: int) -> str:
    return f"data-{file_no:05d}.kvd"


@dataclass
class DataFile:
    fd: int
    size: int
    alloc: ExtentAllocator
    valid_bytes: int   # bytes that existed when opened; extents past it are lost


def lock_directory(path: str) -> int:
    """Take the directory's exclusive lock; raises :class:`TierUnavailableError` if another
    process (a running Store, a running fsck) holds it."""
    fd = os.open(os.path.join(path, "kvstore.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise TierUnavailableError(f"{path} is in use by another kvstore process") from exc
        raise TierIOError(f"cannot lock {path}: {exc.strerror}") from exc
    return fd


def probe_direct_io(path: str) -> bool:
    """Whether files in ``path`` accept aligned ``O_DIRECT`` writes and reads."""
    probe = os.path.join(path, ".direct-probe")
    try:
        fd, direct = open_data_file(probe, direct=True, create=True)
    except OSError as exc:
        raise TierIOError(f"cannot create files in {path}: {exc.strerror}") from exc
    try:
        if not direct:
            return False
        page = aligned_empty(PAGE)
        os.pwritev(fd, [page], 0)
        os.preadv(fd, [page], 0)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise TierIOError(f"cannot write in {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
        os.unlink(probe)


class DataDir:
    """The data files of one directory. ``budget_bytes``: the most disk the files may
    take together (payload capacity plus header pages and rounding)."""

    def __init__(self, path: str, *, file_bytes: int, budget_bytes: int, direct: bool) -> None:
        self.path = path
        self.direct = direct
        self.new_file_bytes = max(PAGE, min(file_bytes, budget_bytes) // PAGE * PAGE)
        self.budget_bytes = budget_bytes
        self.files: dict[int, DataFile] = {}
        self.on_new_file = None   # callback(file_no, size): the tier records it in the index

    def open_existing(self, recorded: dict[int, int]) -> list[str]:
        """Open the files on disk and those the index knows. A file shorter than its
        recorded size is extended back (its lost tail reads as zeros and fails
        verification). Returns warnings for the caller to log and count."""
        warnings = []
        found = {int(m.group(1)) for n in os.listdir(self.path) if (m := _NAME.match(n))}
        for file_no in sorted(found | set(recorded)):
            path = os.path.join(self.path, data_file_name(file_no))
            want = recorded.get(file_no)
            if want is None:
                # A file created but never recorded (crash in between): its space is free.
                want = os.stat(path).st_size // PAGE * PAGE
                if self.on_new_file is not None:
                    self.on_new_file(file_no, want)
            fd, _ = open_data_file(path, direct=self.direct, create=True)
            have = os.fstat(fd).st_size
            if have < want:
                warnings.append(f"{path} is {have} bytes, expected {want}: blocks past the end are lost")
                os.ftruncate(fd, want)
            self.files[file_no] = DataFile(fd, want, ExtentAllocator(want, PAGE), min(have, want))
        return warnings

    def adopt(self, file_no: int, blocks: list[tuple[int, int]]) -> list[bool]:
        """Mark recovered blocks' extents used in one file; ``blocks`` are ``(offset,
        payload nbytes)`` sorted by offset. Returns per block whether it was kept: a block
        out of range, past a truncation, or overlapping the one before is not (the
        caller drops its record). Call once per file, before any allocation."""
        f = self.files.get(file_no)
        if f is None:
            return [False] * len(blocks)
        kept, used, end = [], [], 0
        for offset, nbytes in blocks:
            size = extent_bytes(nbytes)
            ok = offset % PAGE == 0 and offset >= end and offset + size <= f.valid_bytes
            kept.append(ok)
            if ok:
                used.append((offset, size))
                end = offset + size
        f.alloc = ExtentAllocator.with_used(f.size, PAGE, used)
        return kept

    def adopt_many(self, file_no: int, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """:meth:`adopt` for arrays (int64, sorted by offset), computed in bulk: when every
        block is aligned, inside the valid part of the file and clear of the one before
        (the normal case), the free gaps come straight from the arrays; otherwise the
        row-by-row rules of :meth:`adopt` decide. Returns a bool mask of kept blocks."""
        f = self.files.get(file_no)
        if f is None:
            return np.zeros(len(offsets), bool)
        sane = (lengths >= 0) & (lengths <= f.size) & (offsets >= 0) & (offsets <= f.size)  # no overflow below
        sizes = PAGE + (np.where(sane, lengths, 0) + (PAGE - 1)) // PAGE * PAGE
        ends = np.where(sane, offsets, 0) + sizes
        prev = np.concatenate(([0], ends[:-1]))
        if not (sane & (offsets % PAGE == 0) & (offsets >= prev) & (ends <= f.valid_bytes)).all():
            return np.array(self.adopt(file_no, list(zip(offsets.tolist(), lengths.tolist()))), bool)
        size = f.size - f.size % PAGE
        gap = offsets > prev
        free = list(zip(prev[gap].tolist(), (offsets[gap] - prev[gap]).tolist()))
        tail = int(ends[-1]) if len(ends) else 0
        if tail < size:
            free.append((tail, size - tail))
        f.alloc = ExtentAllocator.with_free(f.size, PAGE, free)
        return np.ones(len(offsets), bool)

    def alloc(self, nbytes: int) -> tuple[int, int] | None:
        """``(file_no, offset)`` of a free extent for ``nbytes`` of payload, creating a
        new file when every file is full and the budget allows; ``None`` when no room."""
        size = extent_bytes(nbytes)
        for file_no, f in self.files.items():
            off = f.alloc.alloc(size)
            if off is not None:
                return file_no, off
        if size > self.new_file_bytes or self.file_bytes + self.new_file_bytes > self.budget_bytes:
            return None
        file_no = self._create_file()
        off = self.files[file_no].alloc.alloc(size)
        return None if off is None else (file_no, off)

    def _create_file(self) -> int:
        file_no = max(self.files, default=-1) + 1
        path = os.path.join(self.path, data_file_name(file_no))
        size = self.new_file_bytes
        fd, _ = open_data_file(path, direct=self.direct, create=True)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            if exc.errno == errno.ENOSPC:
                raise TierFullError(f"no space for a new {size}-byte data file in {self.path}") from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise TierIOError(f"cannot allocate {path}: {exc.strerror}") from exc
            fd, _ = open_data_file(path, direct=self.direct, create=True)
            os.ftruncate(fd, size)   # no fallocate here: a sparse file grows as written
        if self.on_new_file is not None:
            self.on_new_file(file_no, size)
        self.files[file_no] = DataFile(fd, size, ExtentAllocator(size, PAGE), size)
        log.info("created data file %s (%d bytes)", path, size)
        return file_no

    def free(self, file_no: int, offset: int, nbytes: int) -> None:
        self.files[file_no].alloc.free(offset, extent_bytes(nbytes))

    def fd(self, file_no: int) -> int:
        return self.files[file_no].fd

    @property
    def file_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def allocated_bytes(self) -> int:
        return sum(f.size - f.alloc.free_bytes for f in self.files.values())

    def close(self) -> None:
        for f in self.files.values():
            try:
                os.close(f.fd)
            except OSError:
                pass
        self.files.clear()


def check_directory(path: str, capacity: int) -> None:
    """Refuse, with a message naming the problem, a tier directory that cannot work: a
    path that exists and is not a directory, or the file system's root. A capacity
    larger than the whole file system it lives on is flagged (a full disk is a counted
    refusal of writes, not a failure, so the tier still runs)."""
    real = os.path.realpath(path)
    if os.path.exists(real) and not os.path.isdir(real):
        raise ConfigError(f"nvme tier path {path!r} exists and is not a directory")
    if real == os.path.sep:
        raise ConfigError(f"nvme tier path {path!r} is the root directory; give the tier a directory of its own")
    probe = real
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    vfs = os.statvfs(probe)
    total = vfs.f_blocks * vfs.f_frsize
    if total and capacity > total:
        log.warning("nvme tier path %r: capacity %d bytes is more than its whole file system (%d bytes); "
                    "writes will be refused as the disk fills", path, capacity, total)


class Shard:
    """One directory of a tier: its lock, index, data files and byte accounting."""

    def __init__(self, no: int, path: str, capacity: int, *, direct: bool, file_bytes: int,
                 sync: bool) -> None:
        self.no, self.path, self.capacity, self.used = no, path, capacity, 0
        check_directory(path, capacity)
        os.makedirs(path, mode=0o700, exist_ok=True)
        self.lock_fd = lock_directory(path)
        try:
            self.direct = direct and probe_direct_io(path)
            self.index = BlockIndex(path, sync=sync)
        except BaseException:
            os.close(self.lock_fd)
            raise
        budget = nvme_dir_budget(capacity)
        self.data = DataDir(path, file_bytes=file_bytes, budget_bytes=budget, direct=self.direct)
        self.data.on_new_file = self.index.set_file_size

    def close(self) -> None:
        self.data.close()
        self.index.close()
        os.close(self.lock_fd)


def place(shards: list[Shard], nbytes: int, name: str, counters: dict[str, int]) -> tuple[Shard, int, int] | None:
    """Where a new block of ``nbytes`` payload goes, striping by free space: an extent in
    the directory with the most room left that can take it, as ``(shard, file_no,
    offset)``, its bytes already counted in ``shard.used``; ``None`` when no directory
    can. A directory whose allocation fails (disk full, I/O error) is counted in
    ``counters`` (``enospc``, ``io_errors``) and logged, and the next one is tried.
    Caller holds the tier's lock."""
    for shard in sorted(shards, key=lambda s: s.used - s.capacity):
        if shard.used + nbytes > shard.capacity:
            continue
        try:
            where = shard.data.alloc(nbytes)
        except TierFullError as exc:
            counters["enospc"] += 1
            log.warning("NVMe tier %s: %s", name, exc)
            continue
        except (TierError, OSError) as exc:
            counters["io_errors"] += 1
            log.warning("NVMe tier %s: cannot allocate in %s: %s", name, shard.path, exc)
            continue
        if where is not None:
            shard.used += nbytes
            return shard, where[0], where[1]
    return None
