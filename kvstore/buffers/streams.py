"""Stream order across the Store's thread boundary.

A caller hands ``save``/``load`` device buffers that kernels queued on its *current
stream* may still be writing (a save's source) or reading (a load's destination). The
copies run later, on the Store's threads, whose own current stream knows nothing of the
caller's. So at call time :func:`capture` records one CUDA event on the caller's current
stream of each device among the buffers; the work submitted with :func:`submit` carries
it (a context variable, copied into every thread that works on that call), and:

- every device copy waits on it on its own stream (:meth:`CallerOrder.gate`: the
  copier's stream, or the current one for a one-off copy);
- every access to device memory from outside any stream (kvikio's DMA, a host read)
  first waits for it on the host (:func:`wait_for_caller`).

A load's future resolves only after its copies have completed, so any stream may read
the buffers once the future is done. Without CUDA buffers nothing is recorded and
nothing waits.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from contextvars import ContextVar, copy_context
from typing import Any, Callable, Iterable

_caller: ContextVar["CallerOrder | None"] = ContextVar("kvstore_caller_order", default=None)


class CallerOrder:
    """Events recorded on a caller's current streams at call time, one per device."""

    __slots__ = ("events",)

    def __init__(self, events: dict[Any, Any]) -> None:
        self.events = events          # torch.device -> torch.cuda.Event

    def gate(self, stream: Any, device: Any) -> None:
        """Make ``stream`` (on ``device``) wait for the caller's work queued before the call."""
        event = self.events.get(device)
        if event is not None:
            stream.wait_event(event)

    def wait_host(self) -> None:
        for event in self.events.values():
            event.synchronize()


def capture(buffers: Iterable[Any]) -> CallerOrder | None:
    """Record the caller's stream position on each CUDA device among ``buffers``."""
    if not any(kind.__module__.startswith("torch") for kind in set(map(type, buffers))):
        return None                   # no tensors at all: the common host-only call, at C speed
    import torch

    devices = {buf.device for buf in buffers if isinstance(buf, torch.Tensor) and buf.is_cuda}
    if not devices:
        return None

    events = {}
    for device in devices:
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events[device] = event
    return CallerOrder(events) if events else None


def submit(pool: Executor, order: CallerOrder | None, fn: Callable[..., Any], *args: Any) -> Future:
    """``pool.submit(fn, *args)``, with ``order`` visible to ``fn`` as :func:`caller_order`."""
    ctx = copy_context()
    if order is not None:
        ctx.run(_caller.set, order)
    return pool.submit(ctx.run, fn, *args)


def in_context(pool: Executor, fn: Callable[..., Any], *args: Any) -> Future:
    """``pool.submit`` that carries the submitting thread's caller order along (for the
    threads a tier fans one call out to)."""
    return pool.submit(copy_context().run, fn, *args)


def caller_order() -> CallerOrder | None:
    return _caller.get()


def gate_current_stream(device: Any) -> None:
    """Order this thread's current stream on ``device`` after the caller's work."""
    order = _caller.get()
    if order is not None:
        import torch

        order.gate(torch.cuda.current_stream(device), device)


def wait_for_caller() -> None:
    """Block until the caller's work queued before the call is done (before device
    memory is touched outside stream order)."""
    order = _caller.get()
    if order is not None:
        order.wait_host()


__all__ = ["CallerOrder", "caller_order", "capture", "gate_current_stream", "in_context", "submit",
           "wait_for_caller"]
