"""How the NVMe tier spreads one batch over its I/O threads.

A write batch is a list of :class:`WriteItem` (a block and the extent reserved for it).
:func:`in_runs` groups the batch's blocks into runs of extents adjacent on disk (see
:func:`tiers.nvme.io.plan_runs`) and :func:`parallel` runs them on the tier's thread
pool. Both are thread-safe as long as ``fn`` is; buffers are only borrowed for the
call (the caller owns them).
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np

from kvstore.buffers.streams import in_context
from kvstore.buffers import host_view
from kvstore.keys import BlockKey
from kvstore.tiers.nvme.io import MAX_RUN_BYTES, joinable, plan_runs

if TYPE_CHECKING:
    from kvstore.tiers.nvme.files import Shard


class WriteItem(NamedTuple):
    """One block of a write batch and the extent reserved for it
    (:func:`tiers.nvme.files.place`)."""

    j: int              # the block's position in the caller's batch
    key: BlockKey
    src: Any            # the caller's buffer, read during the call only
    shard: "Shard"
    file_no: int
    offset: int
    nbytes: int         # payload bytes


def in_runs(pool: ThreadPoolExecutor, threads: int, fn: Callable[[list, list], Any], items: list,
            bufs: list, where: list[tuple[int, int, int]], sizes: list[int], *,
            writable: bool, run_bytes: int = MAX_RUN_BYTES,
            check: Callable[[list, list, Any], list] | None = None) -> list[tuple[bool, Any]]:
    """Move ``items`` in runs of blocks adjacent on disk, the runs in parallel.

    ``bufs[i]`` is item i's caller buffer, ``where[i]`` its ``(directory, file,
    offset)`` and ``sizes[i]`` its payload bytes; a run carries at most ``run_bytes``
    of payload (or one block). ``fn(run_items, views)`` gets one
    run's items with their host views (``None`` for a block moved on its own) and
    returns per block ``(ok, value)``; a run whose call raises fails every block in it
    with that error. With ``check``, ``fn`` only moves the bytes and
    ``check(run_items, views, fn's result)`` returns the per-block results, run on the
    calling thread as each run lands (see :func:`parallel`). Returns ``(ok, value)``
    per item, in ``items`` order."""
    views: list[np.ndarray | None] = [None] * len(items)
    if len(items) > 1:
        for i, buf in enumerate(bufs):
            if type(buf) is np.ndarray:   # the DRAM tier's slots; other kinds go one by one
                try:
                    view = host_view(buf, writable=writable)
                except Exception:   # e.g. read-only: the block's own transfer reports it
                    continue
                if joinable(view):
                    views[i] = view
    # at least threads/2 runs per batch, so several transfers are in flight
    cap = max(1, -(-len(items) // max(1, threads // 2)))
    runs = plan_runs([((w[0], w[1]), w[2], n, views[i] is not None)
                      for i, (w, n) in enumerate(zip(where, sizes))], cap, run_bytes)
    got = parallel(pool, threads, fn, [([items[i] for i in run], [views[i] for i in run]) for run in runs],
                   check=check)
    out: list[tuple[bool, Any]] = [None] * len(items)  # type: ignore[list-item]
    for run, (ok, value) in zip(runs, got):
        for i, res in zip(run, value if ok else [(False, value)] * len(run)):
            out[i] = res
    return out


def parallel(pool: ThreadPoolExecutor, threads: int, fn: Callable[..., Any],
             jobs: list[tuple], *, check: Callable[..., Any] | None = None) -> list[tuple[bool, Any]]:
    """Run ``fn(*job)`` for every job, in parallel on ``pool`` when there are several;
    each result is ``(True, value)`` or ``(False, exception)``.

    With ``check``, each job's value becomes ``check(*job, value)``, computed on the
    calling thread as the jobs finish, while the pool threads go on with the next jobs:
    for reads, the disk keeps transfers in flight while landed ones are verified,
    instead of idling while every thread verifies the burst that just landed."""
    def call(job: tuple) -> tuple[bool, Any]:
        try:
            return True, fn(*job)
        except Exception as exc:  # sorted out by the caller: miss, count or re-raise
            return False, exc

    def finish(job: tuple, res: tuple[bool, Any]) -> tuple[bool, Any]:
        if check is None or not res[0]:
            return res
        try:
            return True, check(*job, res[1])
        except Exception as exc:
            return False, exc

    if len(jobs) <= 1:
        return [finish(job, call(job)) for job in jobs]
    # A few tasks (one per I/O thread) each take the next job until none is left: the
    # device sees that many transfers in flight, the executor's per-task cost is paid
    # once per thread instead of once per job, and a thread the scheduler delays holds
    # up only its current job, not a fixed share of the batch.
    out: list[tuple[bool, Any]] = [None] * len(jobs)  # type: ignore[list-item]
    todo = iter(enumerate(jobs))   # next() on it is atomic under the GIL
    landed: queue.SimpleQueue = queue.SimpleQueue()

    def lane() -> None:
        for i, job in todo:
            landed.put((i, call(job)))

    # Each lane sees the Store caller's stream order (device buffers, kvstore.buffers.streams).
    tasks = [in_context(pool, lane) for _ in range(min(len(jobs), threads))]
    for _ in jobs:
        i, res = landed.get()
        out[i] = finish(jobs[i], res)
    for task in tasks:
        task.result()
    return out
