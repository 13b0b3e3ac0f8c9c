"""Copies between host memory and one device, batched, on a dedicated stream.

A :class:`DeviceCopier` belongs to one device and is shared by the threads of a tier.
A batch (``with copier.batch() as b: b.copy(dst, src) ...``) queues its copies on the
copier's own CUDA stream and, on leaving the ``with``, waits on CUDA *events* recorded
on that stream, never on the whole device. Leaving the block means every copy of the
batch is complete, so the caller may release or reuse both sides.

How a copy runs, per case:

- host ↔ host: one ``numpy.copyto`` at once;
- device ↔ device, or host memory that is already pinned (the DRAM tier's arena, a
  caller's pinned tensor): one asynchronous ``copy_`` on the stream;
- pageable host memory ↔ device: in chunks through a ring of pinned staging buffers
  allocated once. Host→device: the CPU fills slot *k+1* while the DMA engine drains slot
  *k*. Device→host: DMAs are issued ahead into free slots and each slot is copied out to
  the caller's memory once its event fires, so CPU copies overlap transfers.

Ordering: a batch made for a Store call starts after the work the Store's caller had
queued on its current stream when it called (:mod:`kvstore._streams`); any other batch
starts after the work queued on the device's current stream of the calling thread.

Without CUDA the same code runs with host tensors: copies complete synchronously and
events are no-ops. ``force_staging=True`` sends every host↔tensor copy through the
staging ring even then, so the chunking logic is exercised on CPU-only machines.

Thread-safety: one batch at a time per copier (a lock is held for the batch), because
the stream and the staging ring are shared; copies of different devices run in parallel.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from kvstore._streams import caller_order
from kvstore.buffers import device_view, host_view, is_device, is_torch
from kvstore.errors import BufferSizeError, InvalidArgumentError, TierIOError

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_SLOTS = 4


def _torch():
    import torch

    return torch


def cuda_available() -> bool:
    try:
        return bool(_torch().cuda.is_available())
    except Exception:  # a broken CUDA install must read as "no CUDA", not crash the caller
        return False


def resolve_device(device: Any):
    """``torch.device`` for a name, with a clear error when CUDA is asked but absent."""
    torch = _torch()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"not a torch device: {device!r} (use 'cpu' or 'cuda:N')") from exc
    if dev.type == "cuda":
        if not cuda_available():
            raise InvalidArgumentError(
                f"device {device!r} needs CUDA, but torch reports none (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda}); use device 'cpu' on machines without a GPU")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise InvalidArgumentError(
                f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
        dev = torch.device("cuda", index)
    elif dev.type != "cpu":
        raise InvalidArgumentError(f"unsupported device type {dev.type!r}; use 'cpu' or 'cuda:N'")
    return dev


def _side(buf: Any, *, writable: bool):
    """One side of a copy: a flat ``uint8`` tensor for torch buffers (host or device),
    a flat ``uint8`` numpy view for every other host buffer. No copy."""
    if is_torch(buf):
        return device_view(buf)
    return host_view(buf, writable=writable)


def _on_host(side) -> bool:
    return isinstance(side, np.ndarray) or side.device.type == "cpu"


def _tensor(side):
    """A tensor over a side of a copy. Read-only numpy views (a tier's ``view()``) are
    wrapped too: torch warns that it could write through them, but sources are only read."""
    if not isinstance(side, np.ndarray):
        return side
    if side.flags.writeable:
        return _torch().from_numpy(side)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return _torch().from_numpy(side)


def _np(side) -> np.ndarray:
    return side if isinstance(side, np.ndarray) else side.numpy()


class DeviceCopier:
    """Copies for one device (``"cpu"`` or ``"cuda:N"``); see the module docstring.

    ``chunk_bytes`` × ``slots`` of pinned staging memory are allocated on first use of
    the staging path and kept for the copier's life.
    """

    def __init__(self, device: Any = "cpu", *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 slots: int = DEFAULT_SLOTS, force_staging: bool = False) -> None:
        if chunk_bytes <= 0 or slots < 2:
            raise InvalidArgumentError("staging needs chunk_bytes > 0 and at least 2 slots")
        self.device = resolve_device(device)
        self.cuda = self.device.type == "cuda"
        self.chunk_bytes, self.num_slots = int(chunk_bytes), int(slots)
        self.force_staging = force_staging
        self._lock = threading.Lock()
        self._stream = None
        self._stage_t: list[Any] = []
        self._stage_np: list[np.ndarray] = []
        self._events: list[Any] = []
        self._after: list[Callable[[], None] | None] = []
        self._busy: list[bool] = []
        self._next = 0
        self.counters = {"batches": 0, "direct_copies": 0, "staged_chunks": 0, "bytes": 0}
        if self.cuda:
            torch = _torch()
            with torch.cuda.device(self.device):
                self._stream = torch.cuda.Stream(self.device)

    @contextmanager
    def batch(self) -> Iterator["_Batch"]:
        """Queue copies with ``b.copy(dst, src)``; all are complete when the block exits,
        also when it exits with an exception (so no DMA outlives the caller's buffers)."""
        with self._lock:
            if self.cuda:
                order = caller_order()
                if order is not None:       # a Store call: after the caller's stream, not ours
                    order.gate(self._stream, self.device)
                else:
                    self._stream.wait_stream(_torch().cuda.current_stream(self.device))
            self.counters["batches"] += 1
            b = _Batch(self)
            try:
                yield b
            finally:
                self._finish()

    # -- internals (caller holds self._lock) --------------------------------------------

    def _ensure_staging(self) -> None:
        if self._stage_t:
            return
        torch = _torch()
        for _ in range(self.num_slots):
            if self.cuda:
                t = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
                self._events.append(torch.cuda.Event())
            else:
                t = torch.empty(self.chunk_bytes, dtype=torch.uint8)
                self._events.append(None)
            arr = t.numpy()
            arr.fill(0)  # pre-fault once: first touch of new memory is slow on these VMs
            self._stage_t.append(t)
            self._stage_np.append(arr)
            self._after.append(None)
            self._busy.append(False)

    def _claim(self) -> int:
        """The next ring slot, once the transfer that last used it has completed."""
        k = self._next
        self._next = (k + 1) % self.num_slots
        self._settle(k)
        return k

    def _settle(self, k: int) -> None:
        if self._busy[k]:
            if self._events[k] is not None:
                self._events[k].synchronize()
            self._busy[k] = False
        after, self._after[k] = self._after[k], None
        if after is not None:
            after()

    def _record(self, k: int) -> None:
        if self._events[k] is not None:
            self._events[k].record(self._stream)
        self._busy[k] = True

    def _finish(self) -> None:
        try:
            if self.cuda:
                done = _torch().cuda.Event()
                done.record(self._stream)
                done.synchronize()
            # Staging slots settle in issue order, oldest first: the next one to be claimed.
            for i in range(self.num_slots):
                if self._stage_t:
                    self._settle((self._next + i) % self.num_slots)
        except BaseException:
            # A failed batch's copy-outs must never run later, into a buffer its caller
            # has moved on from (the next batch would otherwise settle them).
            self._after = [None] * len(self._after)
            raise

    def _is_pinned(self, host) -> bool:
        try:
            return bool(_tensor(host).is_pinned())
        except RuntimeError:
            return False

    def _copy(self, dst, src, pinned: bool) -> None:
        torch = _torch()
        d, s = _side(dst, writable=True), _side(src, writable=False)
        n = d.nbytes if isinstance(d, np.ndarray) else d.numel()
        ns = s.nbytes if isinstance(s, np.ndarray) else s.numel()
        if n != ns:
            raise BufferSizeError(f"destination has {n} bytes, source has {ns}")
        self.counters["bytes"] += n
        d_host, s_host = _on_host(d), _on_host(s)
        if d_host and s_host and not self.force_staging:
            np.copyto(_np(d), _np(s), casting="no")
            return
        if not d_host and not s_host:
            self.counters["direct_copies"] += 1
            if self.cuda:
                with torch.cuda.stream(self._stream):
                    d.copy_(s, non_blocking=True)
            else:
                d.copy_(s)
            return
        host = d if d_host else s
        if self.cuda and not self.force_staging and (pinned or self._is_pinned(host)):
            self.counters["direct_copies"] += 1
            with torch.cuda.stream(self._stream):
                _tensor(d).copy_(_tensor(s), non_blocking=True)
            return
        # Staging: the device side is a tensor; with force_staging on host-only copies,
        # the tensor side plays the device.
        into_tensor = not d_host or (s_host and not isinstance(d, np.ndarray))
        if d_host and s_host and isinstance(d, np.ndarray) and isinstance(s, np.ndarray):
            np.copyto(d, s, casting="no")
            return
        self._ensure_staging()
        if into_tensor:
            self._stage_in(d, _np(s), n)
        else:
            self._stage_out(_np(d), s, n)

    def _stage_in(self, d, src: np.ndarray, n: int) -> None:
        torch = _torch()
        for off in range(0, n, self.chunk_bytes):
            m = min(self.chunk_bytes, n - off)
            k = self._claim()
            np.copyto(self._stage_np[k][:m], src[off:off + m], casting="no")
            if self.cuda:
                with torch.cuda.stream(self._stream):
                    d[off:off + m].copy_(self._stage_t[k][:m], non_blocking=True)
            else:
                d[off:off + m].copy_(self._stage_t[k][:m])
            self._record(k)
            self.counters["staged_chunks"] += 1

    def _stage_out(self, dst: np.ndarray, s, n: int) -> None:
        torch = _torch()
        for off in range(0, n, self.chunk_bytes):
            m = min(self.chunk_bytes, n - off)
            k = self._claim()
            if self.cuda:
                with torch.cuda.stream(self._stream):
                    self._stage_t[k][:m].copy_(s[off:off + m], non_blocking=True)
            else:
                self._stage_t[k][:m].copy_(s[off:off + m])
            self._record(k)
            stage, out = self._stage_np[k][:m], dst[off:off + m]
            self._after[k] = lambda out=out, stage=stage: np.copyto(out, stage, casting="no")
            self.counters["staged_chunks"] += 1


class _Batch:
    """Handle of one open batch; valid only inside ``DeviceCopier.batch()``."""

    __slots__ = ("_copier",)

    def __init__(self, copier: DeviceCopier) -> None:
        self._copier = copier

    def copy(self, dst: Any, src: Any, *, pinned: bool = False) -> None:
        """Queue a copy of all bytes of ``src`` into ``dst`` (equal sizes). ``pinned``:
        the host side is known to be page-locked (skips the staging ring). Raises
        :class:`BufferSizeError` on a size mismatch, :class:`TierIOError` when the
        device reports an error."""
        try:
            self._copier._copy(dst, src, pinned)
        except (BufferSizeError, InvalidArgumentError):
            raise
        except RuntimeError as exc:
            raise TierIOError(f"copy on {self._copier.device} failed: {exc}") from exc


_COPIERS: dict[str, DeviceCopier] = {}
_COPIERS_LOCK = threading.Lock()


def copier_for(device: Any) -> DeviceCopier:
    """The process-wide copier of a device (created once; its stream and staging ring
    are shared by every tier that moves bytes to or from that device)."""
    key = str(device)
    with _COPIERS_LOCK:
        c = _COPIERS.get(key)
        if c is None:
            c = _COPIERS[key] = DeviceCopier(device)
        return c


def copy_device_pairs(pairs: list[tuple[Any, Any]], *, pinned: bool = False) -> None:
    """Copy ``(dst, src)`` pairs in which one side is a device tensor: one batch per
    device, batches one after another (never two copier locks held at once), all
    complete on return. ``pinned``: the host sides are page-locked."""
    by_device: dict[str, list[tuple[Any, Any]]] = {}
    for dst, src in pairs:
        dev = dst.device if is_device(dst) else src.device
        by_device.setdefault(str(dev), []).append((dst, src))
    for dev, group in by_device.items():
        with copier_for(dev).batch() as batch:
            for dst, src in group:
                batch.copy(dst, src, pinned=pinned)


__all__ = ["DeviceCopier", "copy_device_pairs", "copier_for", "cuda_available", "resolve_device"]
