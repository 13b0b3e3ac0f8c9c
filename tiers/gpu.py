"""GPU HBM tier: one device allocation carved into slots.

The arena is a single ``torch.uint8`` tensor of the configured size on ``device``,
allocated and touched once at start-up (no allocation per block, nothing left to the
caching allocator's mercy later). Slots are carved with the same allocator and reader
counts as the DRAM tier (:mod:`tiers._arena`). Copies in and out go through the
device's copy streams (:mod:`kvstore.buffers.device`): device↔device copies stay on the GPU,
host buffers move by DMA (directly when pinned, through the staging ring otherwise).

Written device-generically: ``device="cpu"`` gives the same tier in host memory, which
is how its conformance suite runs on machines without a GPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from kvstore.buffers.device import DeviceCopier, copier_for, resolve_device
from kvstore.buffers import nbytes_of
from kvstore.config.tiers import GpuTierConfig
from kvstore._extras import install_hint
from kvstore.errors import ConfigError, InvalidArgumentError, TierUnavailableError
from kvstore.keys import BlockKey
from kvstore.tiers._arena import ArenaTier, SlotIndex
from kvstore.tiers.base import TierCapabilities, check_batch, check_sizes

_D = GpuTierConfig.defaults()   # keyword defaults: the config model's (one definition)

SLOT_ALIGN = 256  # CUDA's allocation granularity for coalesced access and DMA


class GpuTier(ArenaTier):
    """Blocks in one arena of ``capacity_bytes`` on ``device`` (``"cuda:N"`` or ``"cpu"``).

    Capacity is byte-accurate: ``used_bytes`` counts payload bytes and never exceeds
    ``capacity_bytes``; the arena is the capacity rounded up to :data:`SLOT_ALIGN`.
    Thread-safe; copies run outside the index lock and are batched per call, each batch
    waiting on its own CUDA event rather than synchronising the device.
    """

    def __init__(self, capacity_bytes: int, *, name: str = "gpu", device: str = _D.device,
                 copier: DeviceCopier | None = None) -> None:
        if capacity_bytes <= 0:
            raise InvalidArgumentError(f"GPU tier capacity must be positive, got {capacity_bytes}")
        try:
            import torch
        except ModuleNotFoundError as exc:   # torch is not a core dependency (the gpu extra)
            raise ConfigError(f"GPU tier {name!r}: the gpu tier needs torch ({install_hint('gpu')})") from exc

        self.name = name
        try:
            self.device = resolve_device(device)
        except InvalidArgumentError as exc:
            raise TierUnavailableError(f"GPU tier {name!r}: {exc}") from exc
        self._capacity = int(capacity_bytes)
        size = -(-self._capacity // SLOT_ALIGN) * SLOT_ALIGN
        try:
            self.arena = torch.zeros(size, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # torch.OutOfMemoryError derives from RuntimeError
            raise TierUnavailableError(
                f"GPU tier {name!r}: cannot allocate {size} bytes on {self.device}: {exc}") from exc
        self._copier = copier or copier_for(self.device)   # the device's shared stream and pinned ring
        self._index = SlotIndex(self._capacity, size, SLOT_ALIGN)
        self.capabilities = TierCapabilities(device=str(self.device), alignment=SLOT_ALIGN,
                                             max_concurrency=1, zero_copy_view=True)

    def read_into(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> list[bool]:
        """Copy blocks into caller buffers (host or any-device tensors). All copies of
        the call complete before it returns."""
        check_batch(keys, dsts)
        index = self._index
        slots = index.acquire_many(keys)
        try:
            check_sizes(self.name, dsts, slots)
            with self._copier.batch() as batch:
                for slot, dst in zip(slots, dsts):
                    if slot is not None:
                        batch.copy(dst, self._span(slot.offset, slot.nbytes))
        finally:
            index.release_many(slots)
        return [slot is not None for slot in slots]

    def write(self, keys: Sequence[BlockKey], srcs: Sequence[Any]) -> list[bool]:
        """Copy each source (host buffer or tensor) into a new slot; the tier keeps no
        reference to ``srcs`` once this returns."""
        check_batch(keys, srcs)
        index = self._index
        reserved = index.reserve_many(keys, [nbytes_of(src) for src in srcs])
        try:
            with self._copier.batch() as batch:
                for entry, src in zip(reserved, srcs):
                    if isinstance(entry, tuple):
                        batch.copy(self._span(*entry), src)
        except BaseException:
            index.abort_many(reserved)
            raise
        return index.commit_many(keys, reserved)  # visible only once the bytes are in place

    @contextmanager
    def view(self, key: BlockKey) -> Iterator[Any]:
        """A flat ``uint8`` tensor over the stored bytes, on the tier's device. Callers
        must not write to it; the slot is not reused until the ``with`` exits."""
        slot = self._index.acquire(key)
        if slot is None:
            yield None
            return
        try:
            yield self._span(slot.offset, slot.nbytes)
        finally:
            self._index.release(slot)

    def _span(self, offset: int, nbytes: int):
        return self.arena[offset:offset + nbytes]

    def stats(self) -> dict[str, Any]:
        return {"device": str(self.device), "arena_bytes": self.arena.numel(),
                "largest_free_bytes": self._index.largest_free(), "transfers": dict(self._copier.counters)}

    def close(self) -> None:
        self._index.clear()
        arena, self.arena = self.arena, self.arena.new_empty(0)
        del arena  # the caching allocator reuses it; the process keeps the reservation
