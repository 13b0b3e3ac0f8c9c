"""Caller buffers: host (bytes-like, numpy, torch CPU) and device (torch CUDA) alike.

The data path never converts a buffer to ``bytes``; it takes a flat ``uint8`` view of
the caller's memory and copies into or out of it once.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvstore.errors import BufferSizeError, InvalidArgumentError


def is_torch(buf: Any) -> bool:
    kind = type(buf)
    return kind is not np.ndarray and kind.__module__.startswith("torch") and hasattr(buf, "data_ptr")


def is_device(buf: Any) -> bool:
    """True for tensors that live outside host memory (e.g. CUDA)."""
    return is_torch(buf) and buf.device.type != "cpu"


def nbytes_of(buf: Any) -> int:
    if type(buf) is np.ndarray:  # the hot path: skip the checks below
        return buf.nbytes
    if is_torch(buf):
        return buf.numel() * buf.element_size()
    if isinstance(buf, np.ndarray):
        return buf.nbytes
    return memoryview(buf).nbytes


def host_view(buf: Any, *, writable: bool = False) -> np.ndarray:
    """A flat ``uint8`` numpy view of a contiguous host buffer (no copy).

    Accepts bytes/bytearray/memoryview/mmap, numpy arrays and torch CPU tensors.
    Raises :class:`InvalidArgumentError` for device tensors, non-contiguous memory, or a
    read-only buffer where ``writable`` is asked.
    """
    if type(buf) is np.ndarray and buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous:
        if writable and not buf.flags.writeable:
            raise InvalidArgumentError("destination buffer of type ndarray is read-only")
        return buf  # already a flat byte view: the common case on the data path
    if is_torch(buf):
        if buf.device.type != "cpu":
            raise InvalidArgumentError(f"expected a host buffer, got a tensor on {buf.device}")
        if not buf.is_contiguous():
            raise InvalidArgumentError("tensor buffers must be contiguous")
        arr = buf.detach().reshape(-1).view(__import__("torch").uint8).numpy()
    elif isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InvalidArgumentError("numpy buffers must be C-contiguous")
        arr = buf.reshape(-1).view(np.uint8)
    else:
        try:
            mv = memoryview(buf)
        except TypeError as exc:
            raise InvalidArgumentError(f"not a buffer: {type(buf).__name__}") from exc
        if not mv.contiguous:
            raise InvalidArgumentError("buffers must be contiguous")
        arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
    if writable and not arr.flags.writeable:
        raise InvalidArgumentError(f"destination buffer of type {type(buf).__name__} is read-only")
    return arr


def device_view(buf: Any):
    """A flat ``torch.uint8`` view of a contiguous tensor on any device."""
    import torch

    if not buf.is_contiguous():
        raise InvalidArgumentError("tensor buffers must be contiguous")
    return buf.detach().reshape(-1).view(torch.uint8)


def copy_bytes(dst: Any, src: Any) -> None:
    """Copy all bytes of ``src`` into ``dst`` (same size), host or device, once; the
    copy has completed when this returns. A device copy is ordered after the Store
    caller's work (:func:`kvstore.buffers.streams.gate_current_stream`)."""
    if is_device(dst) or is_device(src):
        import torch

        d = device_view(dst) if is_torch(dst) else torch.from_numpy(host_view(dst, writable=True))
        s = device_view(src) if is_torch(src) else torch.from_numpy(host_view(src))
        if d.numel() != s.numel():
            raise BufferSizeError(f"buffer has {d.numel()} bytes, block has {s.numel()}")
        from kvstore.buffers.streams import gate_current_stream

        device = d.device if d.device.type != "cpu" else s.device
        if device.type == "cuda":
            gate_current_stream(device)       # after the Store caller's pending work on it
        d.copy_(s, non_blocking=False)
        if d.device.type == "cuda" and s.device.type == "cuda":
            # A host<->device copy_ without non_blocking has completed when it returns;
            # a device->device one is only queued. Complete it too, so that a load's
            # future resolving still means its bytes are in place, for any stream.
            for dev in {d.device, s.device}:
                torch.cuda.current_stream(dev).synchronize()
        return
    d, s = host_view(dst, writable=True), host_view(src)
    if d.nbytes != s.nbytes:
        raise BufferSizeError(f"buffer has {d.nbytes} bytes, block has {s.nbytes}")
    np.copyto(d, s, casting="no")


class ThreadBuffer:
    """One reusable host buffer per thread, grown on demand (1 MiB at least) and touched
    once when made, so a request never faults its pages in. For staging a block on its way
    to or from a device or the network; a thread must be done with its buffer before it
    asks again (the same thread gets the same memory)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int) -> np.ndarray:
        """This thread's buffer, its first ``nbytes`` bytes."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 1 << 20), np.uint8)
            buf.fill(0)
            self._local.buf = buf
        return buf[:nbytes]


__all__ = ["ThreadBuffer", "copy_bytes", "device_view", "host_view", "is_device", "is_torch", "nbytes_of"]
