"""Offline check of one NVMe tier directory (``kvstore fsck``).

Verifies every indexed block (header, key digest, length, checksum), finds index
records that are damaged, point past the end of a data file (missing) or overlap
another block, and scans the space no record claims for orphans: valid block headers
in free space, left by a crash between the data write and the index commit or by
deleted blocks. A tier reclaims orphans' space by construction (free space is what the
index does not claim), so they are reported, not counted as problems.

``repair=True`` removes every bad record from the index (those blocks become misses,
never wrong bytes) and wipes orphan header pages so later scans stay quiet. The
directory lock is held throughout, so fsck refuses to run beside a live tier.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from tqdm import tqdm

from kvstore.errors import CorruptBlockError, InvalidArgumentError, TierIOError
from kvstore.tiers.nvme.files import data_file_name, lock_directory, probe_direct_io
from kvstore.tiers.nvme.index import BlockIndex
from kvstore.tiers.nvme.io import (MAX_RUN_BLOCKS, PAGE, aligned_empty, extent_bytes, open_data_file, plan_runs, read_block,
                            read_run, verify_header_page)

_SCAN_CHUNK = 8 << 20
_VERIFY_THREADS = 8


@dataclass
class FsckReport:
    """What fsck found in one directory; ``corrupt``/``missing`` hold key digests (hex)."""

    path: str
    blocks: int = 0
    verified: int = 0
    verified_bytes: int = 0
    corrupt: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    damaged_records: int = 0
    stray_access_records: int = 0
    orphans: int = 0
    orphan_bytes: int = 0
    repaired: bool = False

    @property
    def problems(self) -> int:
        """Index entries that would not load. Orphans are not problems: their space is
        free already, they are only reported."""
        return len(self.corrupt) + len(self.missing) + self.damaged_records

    def as_dict(self) -> dict:
        return {**asdict(self), "problems": self.problems}


def fsck(path: str, *, repair: bool = False, progress: bool = True) -> FsckReport:
    """Check (and with ``repair`` fix) the NVMe tier directory ``path``."""
    if not os.path.isdir(os.path.join(path, "index")):
        raise InvalidArgumentError(f"{path} is not an NVMe tier directory (no index/ inside)")
    lock_fd = lock_directory(path)
    try:
        index = BlockIndex(path)
        try:
            return _check(path, index, repair, progress)
        finally:
            index.close()
    finally:
        os.close(lock_fd)


def _check(path: str, index: BlockIndex, repair: bool, progress: bool) -> FsckReport:
    report = FsckReport(path)
    direct = probe_direct_io(path)
    sizes = index.file_sizes()
    fds: dict[int, tuple[int, int]] = {}   # file_no -> (fd, bytes on disk)
    for file_no, size in sizes.items():
        name = os.path.join(path, data_file_name(file_no))
        if os.path.exists(name):
            fd, _ = open_data_file(name, direct=direct, create=False)
            fds[file_no] = (fd, min(size, os.fstat(fd).st_size) // PAGE * PAGE)
    try:
        rows = sorted(index.scan(), key=lambda r: (r[1].file_no, r[1].offset) if r[1] else (-1, 0))
        report.blocks = len(rows)
        drop: list[bytes] = []
        used: dict[int, list[tuple[int, int]]] = {n: [] for n in fds}
        total = sum(n for _, n in fds.values())   # every byte is either verified or scanned
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"fsck {path}", disable=not progress)
        checks = []
        for digest, rec, _ in rows:
            if rec is None:
                report.damaged_records += 1
                drop.append(digest)
                continue
            fd_size = fds.get(rec.file_no)
            end = rec.offset + extent_bytes(rec.length)
            if fd_size is None or end > fd_size[1]:
                report.missing.append(digest.hex())
                drop.append(digest)
                continue
            spans = used[rec.file_no]
            if spans and spans[-1][1] > rec.offset:   # overlaps the previous block
                report.corrupt.append(digest.hex())
                drop.append(digest)
                continue
            spans.append((rec.offset, end))
            checks.append((digest, rec, fd_size[0]))
        local = threading.local()

        def verify(run: list[tuple]) -> list[bool]:
            """One run of adjacent blocks (see plan_runs) read in one call, each checked."""
            need = sum(-(-rec.length // PAGE) * PAGE for _, rec, _ in run)
            buf = getattr(local, "buf", None)
            if buf is None or buf.nbytes < need:
                buf = local.buf = aligned_empty(max(need, 8 << 20))
            if len(run) == 1:
                digest, rec, fd = run[0]
                try:
                    read_block(fd, rec.offset, digest, rec.length, rec.checksum, buf[:rec.length])
                    return [True]
                except (CorruptBlockError, TierIOError):
                    return [False]
            views, pos = [], 0
            for _, rec, _ in run:
                views.append(buf[pos:pos + rec.length])
                pos += rec.length
            try:
                errors = read_run(run[0][2], run[0][1].offset,
                                  [(digest, rec.length, rec.checksum) for digest, rec, _ in run], views)
            except TierIOError:
                return [False] * len(run)
            return [err is None for err in errors]

        # checks are in file order: blocks adjacent on disk are verified in runs
        runs = [[checks[i] for i in run] for run in plan_runs(
            [((rec.file_no,), rec.offset, rec.length, rec.length > 0 and rec.length % PAGE == 0)
             for _, rec, _ in checks], MAX_RUN_BLOCKS)]
        bad_spans = set()
        with ThreadPoolExecutor(_VERIFY_THREADS) as pool:   # reads in flight keep the drive busy
            for run, goods in zip(runs, pool.map(verify, runs)):
                for (digest, rec, _), good in zip(run, goods):
                    if good:
                        report.verified += 1
                        report.verified_bytes += rec.length
                    else:
                        report.corrupt.append(digest.hex())
                        drop.append(digest)
                        bad_spans.add((rec.file_no, rec.offset))   # its space is scanned as free
                    bar.update(extent_bytes(rec.length))
        if bad_spans:
            used = {n: [sp for sp in spans if (n, sp[0]) not in bad_spans] for n, spans in used.items()}
        orphan_pages = []
        for file_no, (fd, size) in fds.items():
            orphan_pages += [(fd, off) for off in _scan_orphans(fd, size, used[file_no], report, bar)]
        bar.close()
        stray = index.stray_access()
        report.stray_access_records = len(stray)
        if repair and (drop or stray or orphan_pages):
            index.delete(drop + stray)
            zero = aligned_empty(PAGE)
            for fd, off in orphan_pages:
                os.pwritev(fd, [zero], off)
            index.sync()
            report.repaired = True
        return report
    finally:
        for fd, _ in fds.values():
            os.close(fd)


def _scan_orphans(fd: int, size: int, used: list[tuple[int, int]], report: FsckReport, bar) -> list[int]:
    """Offsets of valid block headers in the gaps between indexed extents."""
    found = []
    chunk = aligned_empty(_SCAN_CHUNK)
    gaps, pos = [], 0
    for start, end in used:
        if start > pos:
            gaps.append((pos, start))
        pos = max(pos, end)
    if pos < size:
        gaps.append((pos, size))
    for start, end in gaps:
        off = start
        while off < end:
            n = min(_SCAN_CHUNK, end - off)
            got = os.preadv(fd, [chunk[:n]], off) // PAGE * PAGE
            if got <= 0:
                break
            pages = chunk[:got].reshape(-1, PAGE)
            hits = np.flatnonzero((pages[:, 0] == ord("K")) & (pages[:, 1] == ord("V"))
                                  & (pages[:, 2] == ord("S")) & (pages[:, 3] == ord("B")))
            skip_to = off
            for i in hits:
                page_off = off + int(i) * PAGE
                if page_off < skip_to:
                    continue
                parsed = verify_header_page(bytes(pages[i, :64]))
                if parsed is not None:
                    found.append(page_off)
                    report.orphans += 1
                    report.orphan_bytes += parsed[0]
                    skip_to = page_off + extent_bytes(parsed[0])
            bar.update(got)
            off = max(off + got, skip_to)
    return found
