"""One direction of a device copier: host→device, device→host or device→device.

A :class:`Lane` owns that direction's stream and its ring of staging buffers, and keeps
the book of which ring slots are free. Batches of any number of threads share a lane
at once: the lane's lock guards only that book (claiming and returning slots); every
wait on the device (an event's ``synchronize()``) happens outside it, so one batch's
host wait never holds up another batch, of this direction or any other.

A batch's hold on a lane is a :class:`LaneUse`: the lane's stream is made to wait for
the caller's work before the batch's first copy on it, the slots the batch claimed are
kept in issue order, and when the batch ends it waits for an event recorded after its
last copy, runs its own copy-outs and returns its slots. A copy-out belongs to the batch
that queued it and runs in that batch or never, so a failed batch cannot write into
another caller's buffer.

A slot is claimed from the free slots; when none is free, a batch reuses the oldest
slot it holds itself once that slot's transfer has completed, and a batch that holds
none waits (lock released) until another batch returns one. A batch never waits for a
slot while it holds slots of another lane (:class:`LaneUse.drain` first), so two batches
cannot wait on each other's rings.

The device calls go through a runtime: :class:`CudaRuntime` (torch's streams and events)
or, without CUDA, :class:`HostRuntime`, whose copies complete when issued. Tests pass a
stand-in with the same methods that records every call. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

import numpy as np

from kvstore.buffers.streams import caller_order


class CudaRuntime:
    """The CUDA calls a copier makes, through torch."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch, self.device = torch, device

    def stream(self) -> Any:
        with self._torch.cuda.device(self.device):
            return self._torch.cuda.Stream(self.device)

    def event(self) -> Any:
        return self._torch.cuda.Event()

    def current_stream(self) -> Any:
        return self._torch.cuda.current_stream(self.device)

    def copy(self, stream: Any, dst: Any, src: Any) -> None:
        with self._torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def staging(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)


class _Complete:
    """The host runtime's stream and event: work is complete once issued."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


_COMPLETE = _Complete()


class HostRuntime:
    """Copies between host tensors: synchronous, so streams and events are no-ops."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch, self.device = torch, device

    def stream(self) -> Any:
        return _COMPLETE

    def event(self) -> Any:
        return _COMPLETE

    def current_stream(self) -> Any:
        return _COMPLETE

    def copy(self, stream: Any, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def staging(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8)


_Held = tuple  # (slot, copy-out to run once its transfer completed, or None)


class Lane:
    """One direction's stream and staging ring (``slots`` × ``chunk_bytes``, allocated
    and touched on first use, kept for the lane's life)."""

    def __init__(self, name: str, runtime: Any, device: Any, chunk_bytes: int, slots: int) -> None:
        self.name, self.rt, self.device = name, runtime, device
        self.stream = runtime.stream()
        self.chunk_bytes, self.num_slots = chunk_bytes, slots
        self._cond = threading.Condition(threading.Lock())
        self._stage_t: list[Any] = []
        self._stage_np: list[np.ndarray] = []
        self._events: list[Any] = []
        self._free: list[int] = []

    def gate(self) -> None:
        """Order the stream after the Store caller's work (or, called directly, after
        the work queued on this thread's current stream)."""
        order = caller_order()
        if order is not None:
            order.gate(self.stream, self.device)
        else:
            self.stream.wait_stream(self.rt.current_stream())

    def claim(self, held: deque) -> int:
        """A slot for the caller's batch, whose held slots (oldest first) are ``held``."""
        with self._cond:
            if not self._stage_t:
                self._allocate()
            while not self._free and not held:
                self._cond.wait()
            if self._free:
                return self._free.pop()
        slot, after = held.popleft()
        try:
            self.settle(slot, after)
        except BaseException:
            self.give_back([slot])
            raise
        return slot

    def settle(self, slot: int, after: Callable[[], None] | None) -> None:
        """Wait (lock not held) for the slot's transfer; then run its copy-out."""
        self._events[slot].synchronize()
        if after is not None:
            after()

    def give_back(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def _allocate(self) -> None:
        for _ in range(self.num_slots):
            t = self.rt.staging(self.chunk_bytes)
            arr = t.numpy()
            arr.fill(0)  # pre-fault once: first touch of new memory is slow on these VMs
            self._stage_t.append(t)
            self._stage_np.append(arr)
            self._events.append(self.rt.event())
        self._free = list(range(self.num_slots))


class LaneUse:
    """One batch's use of one lane. Used by the batch's thread only."""

    __slots__ = ("lane", "used", "held")

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.used = False
        self.held: deque[_Held] = deque()

    def _start(self) -> None:
        if not self.used:
            self.lane.gate()      # before the batch's first copy on this stream
            self.used = True

    def copy(self, dst: Any, src: Any) -> None:
        """One asynchronous copy between tensors on the lane's stream."""
        self._start()
        self.lane.rt.copy(self.lane.stream, dst, src)

    def stage_in(self, dst: Any, src: np.ndarray, nbytes: int) -> int:
        """Host bytes into a tensor, chunk by chunk through the ring; the CPU fills one
        slot while the DMA engine drains another. Returns the number of chunks."""
        self._start()
        lane = self.lane
        chunks = 0
        for off in range(0, nbytes, lane.chunk_bytes):
            m = min(lane.chunk_bytes, nbytes - off)
            k = lane.claim(self.held)
            self.held.append((k, None))       # held before anything can fail, so it is returned
            np.copyto(lane._stage_np[k][:m], src[off:off + m], casting="no")
            lane.rt.copy(lane.stream, dst[off:off + m], lane._stage_t[k][:m])
            lane._events[k].record(lane.stream)
            chunks += 1
        return chunks

    def stage_out(self, dst: np.ndarray, src: Any, nbytes: int) -> int:
        """Tensor bytes to host memory: DMAs issued ahead into free slots, each slot
        copied out to ``dst`` once its event fired. Returns the number of chunks."""
        self._start()
        lane = self.lane
        chunks = 0
        for off in range(0, nbytes, lane.chunk_bytes):
            m = min(lane.chunk_bytes, nbytes - off)
            k = lane.claim(self.held)
            self.held.append((k, None))
            lane.rt.copy(lane.stream, lane._stage_t[k][:m], src[off:off + m])
            lane._events[k].record(lane.stream)
            stage, out = lane._stage_np[k][:m], dst[off:off + m]
            self.held[-1] = (k, lambda out=out, stage=stage: np.copyto(out, stage, casting="no"))
            chunks += 1
        return chunks

    def record_done(self) -> Any:
        """An event after every copy this batch issued on the lane (None if it issued none)."""
        if not self.used:
            return None
        done = self.lane.rt.event()
        done.record(self.lane.stream)
        return done

    def finish(self, done: Any) -> None:
        """Wait for ``done`` (lock not held), run the copy-outs in issue order, return
        the slots. A failed copy-out drops the batch's remaining ones: they never run."""
        held, self.held = self.held, deque()
        try:
            if done is not None:
                done.synchronize()
            for slot, after in held:
                self.lane.settle(slot, after)
        finally:
            if held:
                self.lane.give_back([slot for slot, _ in held])

    def drain(self) -> None:
        """Complete and return every slot held (before this batch stages on another lane)."""
        if self.held:
            self.finish(None)


__all__ = ["CudaRuntime", "HostRuntime", "Lane", "LaneUse"]
