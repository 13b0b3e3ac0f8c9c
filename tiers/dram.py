"""Host DRAM tier: one page-aligned arena carved into slots.

The arena is a single ``mmap`` (anonymous, or a file under ``/dev/shm`` when the cache
server shares it with local clients), pre-faulted at start-up and pinned through CUDA
when a GPU is present, so blocks move with one memcpy and no allocation per block.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np

from kvstore._transfer import copier_for
from kvstore.buffers import host_view, is_device, nbytes_of
from kvstore.errors import BufferSizeError, InvalidArgumentError
from kvstore.keys import BlockKey
from tiers._arena import SlotIndex
from tiers.base import Tier, TierCapabilities

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE
SLOT_ALIGN = 4096  # slots stay O_DIRECT-aligned so NVMe I/O can use them in place


class DramTier(Tier):
    """Blocks in one pre-faulted host arena of ``capacity_bytes``.

    ``shm_path``: back the arena with this file (e.g. ``/dev/shm/kvstore-main``) so other
    processes can map it; otherwise anonymous memory. ``pin``: register the arena with
    CUDA (default: when CUDA is available). Thread-safe; copies run outside the lock,
    protected by per-slot reader counts so a slot is never reused mid-copy.
    """

    def __init__(self, capacity_bytes: int, *, name: str = "dram", shm_path: str | None = None,
                 pin: bool | None = None) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgumentError(f"DRAM tier capacity must be positive, got {capacity_bytes}")
        self.name = name
        self._capacity = int(capacity_bytes)
        size = -(-self._capacity // PAGE) * PAGE
        self.shm_path = shm_path
        if shm_path:
            fd = os.open(shm_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
        else:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(-1, size, flags=flags)
        self.arena = np.frombuffer(self._mmap, dtype=np.uint8)
        self.pinned = self._pin() if pin is not False else False
        self._index = SlotIndex(self._capacity, size, SLOT_ALIGN)
        self._lock = threading.Lock()
        self.capabilities = TierCapabilities(device="cpu", alignment=SLOT_ALIGN, max_concurrency=1,
                                             zero_copy_view=True)

    def _pin(self) -> bool:
        try:
            import torch

            if not torch.cuda.is_available():
                return False
            ptr = self.arena.ctypes.data
            err = torch.cuda.cudart().cudaHostRegister(ptr, self.arena.nbytes, 0)
            return int(err) == 0 if not isinstance(err, tuple) else int(err[0]) == 0
        except Exception as exc:  # pinning is an optimisation; plain memory still works
            log.warning("could not pin DRAM tier %s: %s", self.name, exc)
            return False

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def nbytes(self, key: BlockKey) -> int | None:
        return self._index.nbytes(key)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self._index.contains(keys)

    def offset_of(self, key: BlockKey) -> tuple[int, int] | None:
        """``(offset, nbytes)`` of a stored block inside the arena, for same-host sharing."""
        return self._index.offset_of(key)

    def read_into(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> list[bool]:
        index = self._index
        slots = [index.acquire(k) for k in keys]
        try:
            for slot, dst in zip(slots, dsts, strict=True):
                if slot is not None and nbytes_of(dst) != slot.nbytes:
                    raise BufferSizeError(
                        f"[{self.name}] buffer has {nbytes_of(dst)} bytes, block has {slot.nbytes}")
            device = [j for j, (slot, dst) in enumerate(zip(slots, dsts)) if slot and is_device(dst)]
            for slot, dst in zip(slots, dsts):
                if slot is not None and not is_device(dst):
                    np.copyto(host_view(dst, writable=True), self._span(slot.offset, slot.nbytes), casting="no")
            if device:
                self._device_copies([(dsts[j], self._span(slots[j].offset, slots[j].nbytes)) for j in device])
        finally:
            for slot in slots:
                if slot is not None:
                    index.release(slot)
        return [slot is not None for slot in slots]

    def write(self, keys: Sequence[BlockKey], srcs: Sequence[Any]) -> list[bool]:
        index = self._index
        out: list[bool] = []
        placed: list[tuple[BlockKey, int, int]] = []
        device: list[tuple[np.ndarray, Any]] = []
        try:
            for key, src in zip(keys, srcs, strict=True):
                n = nbytes_of(src)
                stored, offset = index.reserve(key, n)
                out.append(stored or offset is not None)
                if offset is None:
                    continue
                placed.append((key, offset, n))
                if is_device(src):
                    device.append((self._span(offset, n), src))
                else:
                    np.copyto(self._span(offset, n), host_view(src), casting="no")
            if device:
                self._device_copies(device)
        except BaseException:
            for _, offset, n in placed:
                index.abort(offset, n)
            raise
        for key, offset, n in placed:
            index.commit(key, offset, n)  # visible only once the bytes are in place
        return out

    def delete(self, keys: Sequence[BlockKey]) -> int:
        return self._index.delete(keys)

    def keys(self) -> Iterator[BlockKey]:
        return self._index.keys()

    @contextmanager
    def view(self, key: BlockKey) -> Iterator[np.ndarray | None]:
        slot = self._index.acquire(key)
        if slot is None:
            yield None
            return
        try:
            v = self._span(slot.offset, slot.nbytes)
            v.flags.writeable = False
            yield v
        finally:
            self._index.release(slot)

    def _span(self, offset: int, nbytes: int) -> np.ndarray:
        return self.arena[offset:offset + nbytes]

    def _device_copies(self, pairs: list[tuple[Any, Any]]) -> None:
        """Copy (dst, src) pairs where one side is a device tensor, as one batch on that
        device's copy stream (see kvstore._transfer); the arena side is pinned when
        ``self.pinned``, so no staging is needed then."""
        by_device: dict[str, list[tuple[Any, Any]]] = {}
        for dst, src in pairs:
            dev = dst.device if is_device(dst) else src.device
            by_device.setdefault(str(dev), []).append((dst, src))
        for dev, group in by_device.items():
            with copier_for(dev).batch() as batch:
                for dst, src in group:
                    batch.copy(dst, src, pinned=self.pinned)

    def stats(self) -> dict[str, Any]:
        return {"pinned": self.pinned, "shared_memory": bool(self.shm_path),
                "largest_free_bytes": self._index.largest_free()}

    def close(self) -> None:
        with self._lock:
            if self._mmap is None:
                return
            self._index.clear()
            mm, self._mmap = self._mmap, None
        self.arena = np.empty(0, dtype=np.uint8)
        try:
            mm.close()
        except BufferError:  # a view is still exported; the GC unmaps it later
            pass
        if self.shm_path:
            try:
                os.unlink(self.shm_path)
            except FileNotFoundError:
                pass
