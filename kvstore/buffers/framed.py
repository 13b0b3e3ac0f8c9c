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
    for arr in (payload, frame):
        if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
            raise ValueError("a payload and its frame must be flat contiguous uint8 arrays")
    if not frame.flags.writeable or frame.ctypes.data + frame.nbytes != payload.ctypes.data:
        raise ValueError("a frame must be writable and end where its payload starts")
    view = payload.view(FramedView)
    view.frame = frame
    return view


def frame_of(buf: object) -> np.ndarray | None:
    """The frame of a :class:`FramedView` made by :func:`framed`; ``None`` for any other buffer."""
    return buf.frame if isinstance(buf, FramedView) else None
