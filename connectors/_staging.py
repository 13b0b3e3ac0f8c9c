"""Reusable, bounded staging buffers for chunks in flight between an engine's KV cache
and the store. Thread-safe: buffers come back from store threads."""

from __future__ import annotations

import ctypes
import logging
import threading
from concurrent.futures import Future
from typing import Any

import torch

log = logging.getLogger(__name__)


class StagingPool:
    """At most ``budget_bytes`` of buffers on ``device`` (host buffers pinned when
    ``pin``), kept and reused: first-touching fresh memory is slow, and a pool that
    only grows would take memory the engine counted on. :meth:`take` returns ``None``
    when the budget is spent; the caller skips the transfer (a save) or fails it closed
    (a load). Thread-safe."""

    def __init__(self, device: torch.device, budget_bytes: int, *, pin: bool = False) -> None:
        self.device = device
        self.pin = pin
        self.budget_bytes = budget_bytes
        self.allocated_bytes = 0
        self._free: list[tuple[torch.Tensor, Any]] = []   # (buffer, event it waits for)
        self._lock = threading.Lock()

    def _drop(self, buf: torch.Tensor) -> None:
        """Take ``buf`` off the free list, found by identity: ``list.remove`` compares the
        tuples' tensors with ``==`` (elementwise; raises for two of different sizes)."""
        for i, (b, _) in enumerate(self._free):
            if b is buf:
                del self._free[i]
                return

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of exactly ``nbytes`` (a view of a pooled one), or ``None`` when it
        would take the pool over its budget; return it with :meth:`give` once nothing
        reads or writes it."""
        nbytes = max(nbytes, 1)
        with self._lock:
            free = [(b, ready) for b, ready in self._free if ready is None or ready.query()]
            fits = [entry for entry in free if entry[0].numel() >= nbytes]
            if fits:
                entry = min(fits, key=lambda e: e[0].numel())
                self._drop(entry[0])
                return entry[0][:nbytes]
            # Idle buffers too small for this request are dropped to make room.
            for entry in free:
                if self.allocated_bytes + nbytes <= self.budget_bytes:
                    break
                self._drop(entry[0])
                self.allocated_bytes -= entry[0].numel()
            if self.allocated_bytes + nbytes > self.budget_bytes:
                return None
            self.allocated_bytes += nbytes
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin)
        except RuntimeError as exc:   # out of (pinnable) memory: a skipped transfer, not a crash
            log.warning("staging: cannot allocate %d bytes on %s: %s", nbytes, self.device, exc)
            with self._lock:
                self.allocated_bytes -= nbytes
            return None
        return buf

    def discard(self, buf: torch.Tensor) -> None:
        """Give up ``buf`` for good (something may still write it): it leaves the budget
        and is freed once nothing references it."""
        base = buf._base if buf._base is not None else buf
        with self._lock:
            self.allocated_bytes -= base.numel()

    def give(self, buf: torch.Tensor, ready: Any = None) -> None:
        """Return ``buf``; with ``ready`` (a CUDA event recorded after the last copy
        that reads or writes it) it is handed out again only once that event is done."""
        base = buf._base if buf._base is not None else buf
        with self._lock:
            self._free.append((base, ready))


def give_when_done(futures: list[Future], buf: torch.Tensor, pool: StagingPool, req_id: str) -> None:
    """Return ``buf`` to the pool once every save reading from it is done."""
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(future: Future) -> None:
        if future.exception() is not None:
            log.warning("request %s: save failed: %s", req_id, future.exception())
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            pool.give(buf)

    for future in futures:
        future.add_done_callback(done)


def groups(n: int, parts: int = 4) -> list[tuple[int, int]]:
    """``n`` chunks split into up to ``parts`` consecutive groups (store calls the store
    runs in parallel)."""
    size = max(1, -(-n // parts))
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def spans(views: list) -> list[tuple[int, int, torch.Tensor]]:
    """Runs of numpy views that lie back to back in memory, each as ``(lo, hi, tensor)``
    over views ``lo..hi`` (a batch of slots reserved together is usually one run, so
    it moves with one index op). The tensors alias the views' memory."""
    out, lo = [], 0
    ptrs = [v.ctypes.data for v in views]
    for i in range(1, len(views) + 1):
        if i < len(views) and ptrs[i] == ptrs[i - 1] + views[i - 1].nbytes:
            continue
        total = ptrs[i - 1] + views[i - 1].nbytes - ptrs[lo]
        out.append((lo, i, torch.frombuffer((ctypes.c_uint8 * total).from_address(ptrs[lo]), dtype=torch.uint8)))
        lo = i
    return out


def wait_quietly(future: Future, timeout_s: float, what: str) -> None:
    """Wait for a save; a failure is logged (a failed save is only a lost hit)."""
    try:
        future.result(timeout=timeout_s)
    except Exception as exc:
        log.warning("%s: save did not complete: %s", what, exc)


__all__ = ["StagingPool", "give_when_done", "groups", "spans", "wait_quietly"]
