"""Retention hints: what a client knows about a request's future that a cache cannot see.

A chat front end knows its session is still open, an agent framework that a tool call
will come back in seconds, a batch job that its system prompt will be reused. A
:class:`Hint` passed to ``save`` or ``lookup`` carries that to the Store for every block
of the call:

- ``retain_s``: the blocks are expected back within this many seconds. Until then they
  are evicted only after every unhinted block of the same tier; afterwards the hint is
  ignored (the block ranks as if it had never been hinted).
- ``priority``: among hinted blocks, a higher class is kept longer. ``retain_s=None``
  with a priority gives a hint that does not expire.
- ``discard``: one-shot blocks. They are evicted before any other block of their tier,
  and never spilled or written through into the tiers below.

Hints steer eviction only: they never make the Store keep a block past its capacity,
nor keep a block that a lease or pin does not protect from an explicit ``delete``. On
a cache server with tenants a hint protects a block only within its tenant's quota in
that tier (:mod:`kvstore.store.tenants`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Mapping

from kvstore.errors import InvalidArgumentError

MAX_PRIORITY = 2**31 - 1
_FIELDS = ("retain_s", "priority", "discard")


@dataclass(frozen=True)
class Hint:
    """One request's retention hint (see the module docstring). Validated on
    construction: bad values raise :class:`~kvstore.errors.InvalidArgumentError`."""

    retain_s: float | None
    priority: int = 0
    discard: bool = False

    def __post_init__(self) -> None:
        r, p, d = self.retain_s, self.priority, self.discard
        if r is not None:
            if isinstance(r, bool) or not isinstance(r, Real) or not math.isfinite(r) or r <= 0:
                raise InvalidArgumentError(f"Hint.retain_s must be a positive, finite number of seconds "
                                           f"or None, got {r!r}")
            object.__setattr__(self, "retain_s", float(r))
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= MAX_PRIORITY:
            raise InvalidArgumentError(f"Hint.priority must be an integer in [0, {MAX_PRIORITY}], got {p!r}")
        if not isinstance(d, bool):
            raise InvalidArgumentError(f"Hint.discard must be a bool, got {d!r}")
        if d and (r is not None or p):
            raise InvalidArgumentError("a discard Hint cannot also ask to retain (retain_s) or rank (priority)")
        if not d and r is None and not p:
            raise InvalidArgumentError("an empty Hint: give retain_s, a priority above 0, or discard=True "
                                       "(or pass hint=None)")

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> "Hint":
        """A Hint from ``{"retain_s": 600, "priority": 1}`` (what engines and the wire
        carry); unknown fields are errors that name them."""
        if not isinstance(fields, Mapping):
            raise InvalidArgumentError(f"a hint must be a mapping of {', '.join(_FIELDS)}, "
                                       f"got {type(fields).__name__}")
        unknown = sorted(str(k) for k in fields if k not in _FIELDS)
        if unknown:
            raise InvalidArgumentError(f"unknown hint field(s) {', '.join(unknown)}; "
                                       f"known: {', '.join(_FIELDS)}")
        return cls(fields.get("retain_s"), fields.get("priority", 0), fields.get("discard", False))

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from the defaults (the inverse of :meth:`from_dict`)."""
        out: dict[str, Any] = {}
        if self.retain_s is not None:
            out["retain_s"] = self.retain_s
        if self.priority:
            out["priority"] = self.priority
        if self.discard:
            out["discard"] = True
        return out


def check_hint(hint: object) -> "Hint | None":
    """``hint`` if it is a :class:`Hint` or ``None``; anything else is an error."""
    if hint is not None and not isinstance(hint, Hint):
        raise InvalidArgumentError(f"hint must be a kvstore.Hint or None, got {type(hint).__name__}")
    return hint


__all__ = ["Hint", "MAX_PRIORITY", "check_hint"]
