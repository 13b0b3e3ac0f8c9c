"""The bound on a lookup that waits for keys to be stored (``lookup(..., wait_s=)``):
one rule for the embedded Store, the Client and the wire (docs/protocol.md, LOOKUP_WAIT)."""

from __future__ import annotations

import math

from kvstore.errors import InvalidArgumentError

MAX_WAIT_S = 3600.0   # the longest wait one lookup may ask for


def check_wait(wait_s: object) -> float | None:
    """``wait_s`` as seconds (``None`` or 0: no wait); anything but a finite number in
    ``[0, MAX_WAIT_S]`` is an error naming it."""
    if wait_s is None:
        return None
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not math.isfinite(wait_s) \
            or not 0 <= wait_s <= MAX_WAIT_S:
        raise InvalidArgumentError(f"wait_s must be a number of seconds in [0, {MAX_WAIT_S:g}], got {wait_s!r}")
    return float(wait_s) or None


__all__ = ["MAX_WAIT_S", "check_wait"]
