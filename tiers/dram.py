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

from kvstore._transfer import copy_device_pairs
from kvstore.buffers import host_view, is_device, nbytes_of
from kvstore.errors import BufferSizeError, InvalidArgumentError
from kvstore.keys import BlockKey
from tiers._extents import ExtentAllocator
from tiers.base import Tier, TierCapabilities

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE
SLOT_ALIGN = 4096  # slots stay O_DIRECT-aligned so NVMe I/O can use them in place


class _Slot:
    __slots__ = ("offset", "nbytes", "readers", "dead")

    def __init__(self, offset: int, nbytes: int) -> None:
        self.offset, self.nbytes, self.readers, self.dead = offset, nbytes, 0, False


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
        self._readonly = self.arena.view()
        self._readonly.flags.writeable = False
        self.pinned = self._pin() if pin is not False else False
        self._alloc = ExtentAllocator(size, SLOT_ALIGN)
        self._slots: dict[BlockKey, _Slot] = {}
        self._used = 0
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
        return self._used

    def nbytes(self, key: BlockKey) -> int | None:
        slot = self._slots.get(key)
        return slot.nbytes if slot else None

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        slots = self._slots
        return [k in slots for k in keys]

    def offset_of(self, key: BlockKey) -> tuple[int, int] | None:
        """``(offset, nbytes)`` of a stored block inside the arena, for same-host sharing."""
        slot = self._slots.get(key)
        return (slot.offset, slot.nbytes) if slot else None

    def read_into(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> list[bool]:
        out = []
        held: list[_Slot] = []   # released once every copy, device ones included, is done
        device: list[tuple[Any, np.ndarray]] = []
        try:
            for key, dst in zip(keys, dsts, strict=True):
                slot = self._acquire(key)
                if slot is None:
                    out.append(False)
                    continue
                held.append(slot)
                if nbytes_of(dst) != slot.nbytes:
                    raise BufferSizeError(
                        f"[{self.name}] buffer has {nbytes_of(dst)} bytes, block has {slot.nbytes}")
                src = self.arena[slot.offset:slot.offset + slot.nbytes]
                if is_device(dst):
                    device.append((dst, src))
                else:
                    np.copyto(host_view(dst, writable=True), src, casting="no")
                out.append(True)
            # One batch per device on its copy stream; the arena is pinned where CUDA is.
            copy_device_pairs(device, pinned=self.pinned)
        finally:
            for slot in held:
                self._release(slot)
        return out

    def write(self, keys: Sequence[BlockKey], srcs: Sequence[Any]) -> list[bool]:
        # Reserve every slot of the batch under one lock hold, so a batch lands in
        # adjacent slots when the arena has the room (same-host readers then copy it
        # as one range); copy outside the lock (device sources as one batch), publish
        # at the end.
        out = [False] * len(keys)
        plan: list[tuple[int, BlockKey, Any, int, int]] = []
        with self._lock:
            for j, (key, src) in enumerate(zip(keys, srcs, strict=True)):
                if key in self._slots:
                    out[j] = True
                    continue
                n = nbytes_of(src)
                if self._used + n > self._capacity:
                    continue
                offset = self._alloc.alloc(n)
                if offset is None:
                    continue
                self._used += n  # reserved now; visible once the bytes are in place
                plan.append((j, key, src, offset, n))
        device: list[tuple[np.ndarray, Any]] = []
        try:
            for _, _, src, offset, n in plan:
                dst = self.arena[offset:offset + n]
                if is_device(src):
                    device.append((dst, src))
                else:
                    np.copyto(dst, host_view(src), casting="no")
            copy_device_pairs(device, pinned=self.pinned)
        except BaseException:
            with self._lock:
                for _, _, _, offset, n in plan:
                    self._alloc.free(offset, n)
                    self._used -= n
            raise
        with self._lock:
            for j, key, _, offset, n in plan:
                if key in self._slots:  # a concurrent writer won; keep its copy
                    self._alloc.free(offset, n)
                    self._used -= n
                else:
                    self._slots[key] = _Slot(offset, n)
                out[j] = True
        return out

    def delete(self, keys: Sequence[BlockKey]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                slot = self._slots.pop(key, None)
                if slot is None:
                    continue
                removed += 1
                self._used -= slot.nbytes
                if slot.readers:
                    slot.dead = True  # freed by the last reader
                else:
                    self._alloc.free(slot.offset, slot.nbytes)
        return removed

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            snapshot = list(self._slots)
        return iter(snapshot)

    @contextmanager
    def view(self, key: BlockKey) -> Iterator[np.ndarray | None]:
        slot = self._acquire(key)
        if slot is None:
            yield None
            return
        try:
            v = self.arena[slot.offset:slot.offset + slot.nbytes]
            v.flags.writeable = False
            yield v
        finally:
            self._release(slot)

    @contextmanager
    def views(self, keys: Sequence[BlockKey]) -> Iterator[list[np.ndarray | None]]:
        """Read-only views of many blocks, their slots held under one lock round trip
        each way (the cache server borrows whole batches this way)."""
        with self._lock:
            slots = [self._slots.get(k) for k in keys]
            for slot in slots:
                if slot is not None:
                    slot.readers += 1
        try:
            ro = self._readonly
            yield [ro[s.offset:s.offset + s.nbytes] if s is not None else None for s in slots]
        finally:
            with self._lock:
                for slot in slots:
                    if slot is None:
                        continue
                    slot.readers -= 1
                    if slot.dead and slot.readers == 0:
                        self._alloc.free(slot.offset, slot.nbytes)

    def _acquire(self, key: BlockKey) -> _Slot | None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                slot.readers += 1
            return slot

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            slot.readers -= 1
            if slot.dead and slot.readers == 0:
                self._alloc.free(slot.offset, slot.nbytes)

    def stats(self) -> dict[str, Any]:
        return {"pinned": self.pinned, "shared_memory": bool(self.shm_path),
                "largest_free_bytes": self._alloc.largest_free()}

    def close(self) -> None:
        with self._lock:
            if self._mmap is None:
                return
            self._slots.clear()
            self._used = 0
            mm, self._mmap = self._mmap, None
        self.arena = self._readonly = np.empty(0, dtype=np.uint8)
        try:
            mm.close()
        except BufferError:  # a view is still exported; the GC unmaps it later
            pass
        if self.shm_path:
            try:
                os.unlink(self.shm_path)
            except FileNotFoundError:
                pass
