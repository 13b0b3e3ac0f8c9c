"""Reusable staging buffers for chunks in flight between an engine's KV cache and
the store. Thread-safe: buffers come back from store threads."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import torch

log = logging.getLogger(__name__)


class StagingPool:
    """Reusable buffers for chunks in flight (first-touching fresh memory is slow, so
    buffers are kept and reused); host buffers are pinned when ``pin``. Thread-safe."""

    def __init__(self, device: torch.device, *, pin: bool = False) -> None:
        self.device = device
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly ``nbytes`` (a view of a pooled one); return it with
        :meth:`give` once nothing reads or writes it."""
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._free.remove(buf)
                return buf[:nbytes]
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device, pin_memory=self.pin)
        return buf[:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        with self._lock:
            self._free.append(base)


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


__all__ = ["StagingPool", "give_when_done"]
