"""Faulting a DRAM arena's pages in at start-up (:func:`prefault`), saying so: an 8 GiB
arena takes about 20 s on these VMs, which an operator should not meet as silence.

The pages are touched in pieces of :data:`FAULT_CHUNK_BYTES` (one numpy strided store
each, as the single store over the whole arena was: the cost is the kernel's page
faults, not the loop), and after each piece the progress is reported: a tqdm bar when
stderr is a terminal, otherwise an INFO line at each tenth. Arenas under
:data:`PROGRESS_MIN_BYTES` (well under a second) get the start and end lines only.
"""

from __future__ import annotations

import logging
import mmap
import sys
import time
from typing import Any, Callable

import numpy as np

from kvstore.config.base import format_size

log = logging.getLogger("kvstore.tiers.dram")
PAGE = mmap.PAGESIZE
FAULT_CHUNK_BYTES = 64 << 20
PROGRESS_MIN_BYTES = 256 << 20

Progress = Callable[[int, int], None]   # (bytes faulted in so far, total)


def prefault(mm: mmap.mmap, nbytes: int | None, *, name: str, progress: Progress | None = None) -> None:
    """Fault in the first ``nbytes`` of ``mm`` (``None``: all of it), one write per page.
    ``progress`` (tests): called after each piece instead of the bar or log lines."""
    arr = np.frombuffer(mm, dtype=np.uint8)
    total = arr.nbytes if nbytes is None else min(nbytes, arr.nbytes)
    log.info("tier %s: pre-faulting %s DRAM arena...", name, format_size(total))
    started = time.monotonic()
    report, close = (progress, None) if progress is not None else _reporter(name, total)
    try:
        for start in range(0, total, FAULT_CHUNK_BYTES):   # chunk starts stay page-aligned
            end = min(start + FAULT_CHUNK_BYTES, total)
            arr[start:end:PAGE] = 0
            if report is not None:
                report(end, total)
    finally:
        if close is not None:
            close()
    log.info("tier %s: %s DRAM arena pre-faulted in %.1f s", name, format_size(total), time.monotonic() - started)


def _reporter(name: str, total: int) -> tuple[Progress | None, Callable[[], None] | None]:
    """The default report: ``(callback, close)``; nothing for a small arena."""
    if total < PROGRESS_MIN_BYTES:
        return None, None
    stream: Any = sys.stderr
    if stream is not None and getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=stream, leave=False,
                   desc=f"pre-faulting {name}")
        return (lambda done, _total: bar.update(done - bar.n)), bar.close
    return _TenthsLog(name), None


class _TenthsLog:
    """An INFO line each time the faulted share passes another tenth (not at the end:
    the "pre-faulted in" line says that)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tenths = 0

    def __call__(self, done: int, total: int) -> None:
        tenths = done * 10 // total
        if tenths > self.tenths and done < total:
            self.tenths = tenths
            log.info("tier %s: pre-faulted %d%% (%s of %s)", self.name, 100 * done // total, format_size(done),
                     format_size(total))
