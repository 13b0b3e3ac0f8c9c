"""Payload views that carry writable room right before them: a tier below can put a
block header there and send header and payload as one contiguous piece.

:class:`FramedView` is a read-only flat ``uint8`` view of one block's payload whose
``frame`` is a writable view of the bytes that end where the payload starts. Only the
tier that owns both makes one (the DRAM tier lends them when it keeps header frames); a
slice or any other array derived from it has ``frame = None``, so a frame is never
taken for bytes that do not precede exactly this payload. The frame belongs to the
payload's slot for as long as the view is lent: a writer may fill it with bytes that
depend only on the block (its header), never with anything another reader needs.
"""

from __future__ import annotations

import numpy as np


class FramedView(np.ndarray):
    """A payload view with ``frame``: writable bytes right before it (``None`` on any
    array derived from it)."""

    frame: np.ndarray | None

    def __array_finalize__(self, obj: object) -> None:
        self.frame = None


def framed(payload: np.ndarray, frame: np.ndarray) -> FramedView:
    """``payload`` (flat ``uint8``) as a :class:`FramedView` with ``frame``, which must
    be a writable flat ``uint8`` array that ends exactly where ``payload`` starts."""
    _check_flat(payload, frame)
    if not frame.flags.writeable or frame.ctypes.data + frame.nbytes != payload.ctypes.data:
        raise ValueError("a frame must be writable and end where its payload starts")
    return _attach(payload, frame)


def framed_spans(region: np.ndarray, readonly: np.ndarray, spans, frame_bytes: int) -> list[FramedView | None]:
    """Many :func:`framed` views out of one arena, checked once rather than per view:
    for each ``(offset, nbytes)`` of ``spans`` (``None`` stays ``None``), the read-only
    view ``readonly[offset:offset + nbytes]`` framed by the ``frame_bytes`` of ``region``
    right before it. ``region`` (writable) and ``readonly`` must be the same flat
    ``uint8`` memory; every span must start at least ``frame_bytes`` in."""
    _check_flat(region, readonly)
    if (not region.flags.writeable or frame_bytes <= 0 or region.nbytes != readonly.nbytes
            or region.ctypes.data != readonly.ctypes.data):
        raise ValueError("a framed arena must be writable, with frames, and its read-only view the same memory")
    out: list[FramedView | None] = []
    for span in spans:
        if span is None:
            out.append(None)
            continue
        offset, nbytes = span
        if offset < frame_bytes:
            raise ValueError(f"a span at {offset} has no room for a {frame_bytes}-byte frame before it")
        out.append(_attach(readonly[offset:offset + nbytes], region[offset - frame_bytes:offset]))
    return out


def _check_flat(*arrays: np.ndarray) -> None:
    for arr in arrays:
        if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
            raise ValueError("a payload and its frame must be flat contiguous uint8 arrays")


def _attach(payload: np.ndarray, frame: np.ndarray) -> FramedView:
    view = payload.view(FramedView)
    view.frame = frame
    return view


def frame_of(buf: object) -> np.ndarray | None:
    """The frame of a :class:`FramedView` made by :func:`framed` or :func:`framed_spans`;
    ``None`` for any other buffer."""
    return buf.frame if isinstance(buf, FramedView) else None
