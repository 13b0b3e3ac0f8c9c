"""Retention classes over any eviction policy: one layer that makes every policy honour
client hints, so the policies themselves stay unaware of them.

Victims come in three classes, each in the wrapped policy's own order:

1. ``discard`` blocks (one-shot), oldest hint first;
2. unhinted blocks, and blocks whose hint has expired (an expired hint is ignored: the
   block sits wherever the policy's own history puts it);
3. blocks held by a live hint, lowest priority class first.

The wrapped policy sees every insert, access and removal, so its order is the same as
without hints; the layer only filters its walk. A class-3 block is offered only once
the walk has passed every block of classes 1 and 2. Walking past a hinted block is a
skip as far as the policy can tell (as for a leased block: S3-FIFO and SIEVE move such
keys on). Cost: a victim walk steps over the live-hinted blocks ahead of the first
unhinted one; class 3 walks the policy once more per priority class present.

Hints are read, never written, from ``hints``: a mapping from key to a record with
``expires`` (seconds on ``clock``), ``priority`` and ``discard``, kept by the Store.
The Store calls :meth:`rehint` when a held key's hint changes. Not thread-safe: the
Store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterator, Mapping

from policies._order import iter_live
from policies.base import EvictionPolicy


class RetentionClasses(EvictionPolicy):
    """``inner`` with the victim classes above. ``clock()`` is the time base of the
    hints' ``expires`` (injectable, so tests never sleep)."""

    def __init__(self, inner: EvictionPolicy, hints: Mapping[Hashable, Any],
                 clock: Callable[[], float]) -> None:
        self.inner = inner
        self.name = inner.name
        self.uses_parent = inner.uses_parent
        self._hints = hints
        self._clock = clock
        self._discard: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable, nbytes: int, parent: Hashable | None = None) -> None:
        self.inner.on_insert(key, nbytes, parent)
        self.rehint(key)

    def on_access(self, key: Hashable) -> None:
        self.inner.on_access(key)

    def on_remove(self, key: Hashable) -> None:
        self.inner.on_remove(key)
        self._discard.pop(key, None)

    def rehint(self, key: Hashable) -> None:
        """``key``'s hint changed (set, merged or dropped)."""
        hint = self._hints.get(key)
        if hint is not None and hint.discard and key in self.inner:
            self._discard[key] = None
        else:
            self._discard.pop(key, None)

    def set_capacity(self, capacity_bytes: int) -> None:
        self.inner.set_capacity(capacity_bytes)

    def victims(self) -> Iterator[Hashable]:
        if not self._hints:          # no hints anywhere: the policy's own walk, untouched
            return self.inner.victims()
        return self._classed()

    def _classed(self) -> Iterator[Hashable]:
        now = self._clock()
        hints = self._hints
        yield from iter_live(self._discard)
        kept: set[int] = set()
        for key in self.inner.victims():
            hint = hints.get(key)
            if hint is None or (not hint.discard and hint.expires <= now):
                yield key
            elif not hint.discard:
                kept.add(hint.priority)
        for priority in sorted(kept):
            for key in self.inner.victims():
                hint = hints.get(key)
                if hint is not None and not hint.discard and hint.expires > now and hint.priority == priority:
                    yield key

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner


__all__ = ["RetentionClasses"]
