"""Copies between host memory and one device, batched, one stream per direction.

A :class:`DeviceCopier` belongs to one device and is shared by the threads of every
tier. It has a lane per direction (:mod:`kvstore.buffers.lanes`): host→device, device→host
and device→device, each with its own stream, and the two host directions each with
their own ring of pinned staging buffers. A batch (``with copier.batch() as b:
b.copy(dst, src) ...``) queues its copies on the lanes they need and, on leaving the
``with``, waits on CUDA *events* recorded after its copies, never on the whole device.
Leaving the block means every copy of the batch is complete, so the caller may release
or reuse both sides.

Batches run concurrently, also on one lane: no lock is held while a batch waits for the
device, so an H2D batch parked in its wait never holds up a D2H batch (or another H2D
batch). The lanes' locks guard only the claiming of staging slots.

Consecutive copies of a batch whose ranges continue each other on both sides (the next
source starts where the previous one ended, in the same allocation, and likewise the
destination) are merged into one copy: blocks in adjacent slots of an arena, to or from
adjacent pages of one tensor, move in one DMA.

How a copy runs, per case:

- host ↔ host: one ``numpy.copyto`` at once;
- device ↔ device, or host memory that is already pinned (the DRAM tier's arena, a
  caller's pinned tensor): one asynchronous ``copy_`` on the direction's stream;
- pageable host memory ↔ device: in chunks through the direction's staging ring.
  Host→device: the CPU fills slot *k+1* while the DMA engine drains slot *k*.
  Device→host: DMAs are issued ahead into free slots and each slot is copied out to
  the caller's memory once its event fires, so CPU copies overlap transfers.

Ordering: before a batch's first copy on a lane, the lane's stream waits for the work
the Store's caller had queued on its current stream when it called
(:mod:`kvstore.buffers.streams`); for any other batch, for the work queued on the device's
current stream of the calling thread.

Without CUDA the same code runs with host tensors: copies complete synchronously and
events are no-ops. ``force_staging=True`` sends every host↔tensor copy through the
staging rings even then, so the chunking logic is exercised on CPU-only machines;
``runtime=`` replaces the CUDA calls (tests pass a recording stand-in, under which host
tensors play the device).

Thread-safety: any number of batches at once, from any threads; a batch itself is used
by the thread that opened it.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from kvstore.buffers.lanes import CudaRuntime, HostRuntime, Lane, LaneUse
from kvstore.buffers.views import device_view, host_view, is_device, is_torch
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
        if buf.dtype is _torch().uint8 and buf.dim() == 1 and buf.is_contiguous():
            return buf          # already a flat byte view (uint8 never carries autograd)
        return device_view(buf)
    return host_view(buf, writable=writable)


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


def _address(side) -> int:
    return side.__array_interface__["data"][0] if isinstance(side, np.ndarray) else side.data_ptr()


def _allocation_end(side) -> int | None:
    """The end address of the allocation holding ``side`` (one tensor storage, one host
    array's memory), or None where that is unknown (the side then never grows)."""
    if isinstance(side, np.ndarray):
        root = side
        while isinstance(root.base, np.ndarray):
            root = root.base
        if not (root.flags.c_contiguous or root.flags.f_contiguous):
            return None
        return root.__array_interface__["data"][0] + root.nbytes
    storage = side.untyped_storage()
    return storage.data_ptr() + storage.nbytes()


def _span(first, nbytes: int):
    """``first`` extended to ``nbytes`` over the same allocation (checked by the caller)."""
    if isinstance(first, np.ndarray):
        return np.lib.stride_tricks.as_strided(first, shape=(nbytes,), strides=(1,))
    return first.as_strided((nbytes,), (1,))


class _Run:
    """Copies of one route whose ranges continue each other on both sides. Addresses are
    unique across host and devices (CUDA's unified addressing), so a range that starts
    where the run ends and stays inside the allocation of the run's first copy is the
    same memory as the run's extension."""

    __slots__ = ("route", "dst", "src", "nbytes", "parts", "dst_at", "src_at", "ends")

    def __init__(self, route: str, dst, src, nbytes: int, dst_at: int, src_at: int) -> None:
        self.route, self.dst, self.src, self.nbytes, self.parts = route, dst, src, nbytes, 1
        self.dst_at, self.src_at = dst_at, src_at
        self.ends: tuple[int | None, int | None] | None = None     # found on the first candidate

    def extend(self, route: str, nbytes: int, dst_at: int, src_at: int) -> bool:
        """Take the next copy in if it starts where this run ends, on both sides."""
        if route != self.route or dst_at != self.dst_at + self.nbytes or src_at != self.src_at + self.nbytes:
            return False
        if self.ends is None:
            self.ends = (_allocation_end(self.dst), _allocation_end(self.src))
        dst_end, src_end = self.ends
        if (dst_end is None or src_end is None or dst_end == src_end    # within one buffer: keep order
                or dst_at + nbytes > dst_end or src_at + nbytes > src_end):
            return False
        self.nbytes += nbytes
        self.parts += 1
        return True

    def sides(self):
        if self.parts == 1:
            return self.dst, self.src
        return _span(self.dst, self.nbytes), _span(self.src, self.nbytes)


_LANE_OF = {"d2d": "d2d", "h2d": "h2d", "h2d_staged": "h2d", "d2h": "d2h", "d2h_staged": "d2h"}


class DeviceCopier:
    """Copies for one device (``"cpu"`` or ``"cuda:N"``); see the module docstring.

    Each host direction's ``chunk_bytes`` × ``slots`` of pinned staging memory are
    allocated on that direction's first staged copy and kept for the copier's life.
    ``runtime``: the device calls (default: CUDA's on a CUDA device; tests give a
    stand-in).
    """

    def __init__(self, device: Any = "cpu", *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 slots: int = DEFAULT_SLOTS, force_staging: bool = False, runtime: Any = None) -> None:
        if chunk_bytes <= 0 or slots < 2:
            raise InvalidArgumentError("staging needs chunk_bytes > 0 and at least 2 slots")
        self.device = resolve_device(device)
        self.cuda = self.device.type == "cuda"
        self.chunk_bytes, self.num_slots = int(chunk_bytes), int(slots)
        self.force_staging = force_staging
        # Without CUDA, host tensors play the device when the staging ring or a stand-in
        # runtime is to be exercised; otherwise every copy is host memory to host memory.
        self._tensors_are_device = not self.cuda and (force_staging or runtime is not None)
        if runtime is None:
            runtime = CudaRuntime(self.device) if self.cuda else HostRuntime(self.device)
        self.lanes = {name: Lane(name, runtime, self.device, self.chunk_bytes, self.num_slots)
                      for name in ("h2d", "d2h", "d2d")}
        self._counters_lock = threading.Lock()
        self.counters = {"batches": 0, "direct_copies": 0, "staged_chunks": 0, "merged_copies": 0, "bytes": 0}

    @contextmanager
    def batch(self) -> Iterator["_Batch"]:
        """Queue copies with ``b.copy(dst, src)``; all are complete when the block exits,
        also when it exits with an exception (so no DMA outlives the caller's buffers)."""
        b = _Batch(self)
        try:
            yield b
        finally:
            b._close()

    def _add(self, counts: dict[str, int]) -> None:
        with self._counters_lock:
            for name, n in counts.items():
                self.counters[name] += n

    def _is_device(self, side) -> bool:
        if isinstance(side, np.ndarray):
            return False
        return side.device.type != "cpu" or self._tensors_are_device

    def _is_pinned(self, host) -> bool:
        try:
            return bool(_tensor(host).is_pinned())
        except RuntimeError:
            return False

    def _route(self, d, s, pinned: bool) -> str:
        d_dev, s_dev = self._is_device(d), self._is_device(s)
        if d_dev and s_dev:
            return "d2d"
        if not d_dev and not s_dev:
            return "host"
        host = s if d_dev else d
        staged = self.force_staging or (self.cuda and not (pinned or self._is_pinned(host)))
        return ("h2d" if d_dev else "d2h") + ("_staged" if staged else "")


class _Batch:
    """Handle of one open batch; valid only inside ``DeviceCopier.batch()``, in the
    thread that opened it."""

    __slots__ = ("_copier", "_uses", "_run", "_staging", "_counts")

    def __init__(self, copier: DeviceCopier) -> None:
        self._copier = copier
        self._uses = {name: LaneUse(lane) for name, lane in copier.lanes.items()}
        self._run: _Run | None = None
        self._staging: LaneUse | None = None      # the lane whose ring slots this batch holds
        self._counts = {"batches": 1, "direct_copies": 0, "staged_chunks": 0, "merged_copies": 0, "bytes": 0}

    def copy(self, dst: Any, src: Any, *, pinned: bool = False) -> None:
        """Queue a copy of all bytes of ``src`` into ``dst`` (equal sizes). ``pinned``:
        the host side is known to be page-locked (skips the staging ring). Raises
        :class:`BufferSizeError` on a size mismatch, :class:`TierIOError` when the
        device reports an error."""
        d, s = _side(dst, writable=True), _side(src, writable=False)
        n = d.nbytes if isinstance(d, np.ndarray) else d.numel()
        ns = s.nbytes if isinstance(s, np.ndarray) else s.numel()
        if n != ns:
            raise BufferSizeError(f"destination has {n} bytes, source has {ns}")
        if n == 0:
            return
        self._counts["bytes"] += n
        route = self._copier._route(d, s, pinned)
        d_at, s_at = _address(d), _address(s)
        run = self._run
        if run is not None and run.extend(route, n, d_at, s_at):
            self._counts["merged_copies"] += 1
            return
        self._run = _Run(route, d, s, n, d_at, s_at)
        if run is not None:
            self._issue(run)

    def _issue(self, run: _Run) -> None:
        d, s = run.sides()
        try:
            if run.route == "host":
                np.copyto(_np(d), _np(s), casting="no")
                return
            use = self._uses[_LANE_OF[run.route]]
            if run.route.endswith("_staged"):
                if self._staging is not None and self._staging is not use:
                    self._staging.drain()        # never wait for a ring while holding another's slots
                self._staging = use
                if run.route == "h2d_staged":
                    self._counts["staged_chunks"] += use.stage_in(d, _np(s), run.nbytes)
                else:
                    self._counts["staged_chunks"] += use.stage_out(_np(d), s, run.nbytes)
                return
            use.copy(_tensor(d), _tensor(s))
            self._counts["direct_copies"] += 1
        except (BufferSizeError, InvalidArgumentError):
            raise
        except RuntimeError as exc:
            raise TierIOError(f"copy on {self._copier.device} failed: {exc}") from exc

    def _close(self) -> None:
        """Issue what is queued, wait for every lane used, run copy-outs, return slots."""
        try:
            run, self._run = self._run, None
            if run is not None:
                self._issue(run)
        finally:
            self._finish()

    def _finish(self) -> None:
        uses = [use for use in self._uses.values() if use.used]
        error: BaseException | None = None
        try:
            dones = [use.record_done() for use in uses]    # all recorded first: the waits overlap
        except RuntimeError as exc:
            dones, error = [None] * len(uses), exc
        for use, done in zip(uses, dones):
            try:
                use.finish(done)    # each lane's slots are returned even when another failed
            except BaseException as exc:
                error = error or exc
        self._copier._add(self._counts)
        if isinstance(error, RuntimeError) and not isinstance(error, TierIOError):
            raise TierIOError(f"copy on {self._copier.device} failed: {error}") from error
        if error is not None:
            raise error


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
