"""The Store's index: where each block is, its size, and what keeps it (leases, pins).

One :class:`Index` per Store, shared by the facade (``facade``), the mover (``mover``)
and the reservation (``reservation``) instead of each reaching into the others' state.

Lock rule: ``Index.lock`` guards every field here (and the tiers' eviction policies and
counters, which change together with the index). It is held briefly and never across
tier I/O. Every method of :class:`Index` runs under it: the caller holds ``lock``
(``with index.lock: ...``); none takes it itself, so a caller can group several calls
into one atomic step.
"""

from __future__ import annotations

import threading
import time
from typing import Iterable, Sequence

from kvstore.keys import BlockKey


class Index:
    """Per-key state of the Store's blocks, and the lock that guards it (see the module
    docstring: every method runs with ``lock`` held by the caller).

    ``where``: key -> bitmask of the levels holding it (bit ``i``: level ``i``); a key
    no level holds is absent. ``sizes``: key -> block bytes, while any level holds it:
    the same in every level, fixed by the save that first indexed it. ``claims``: key ->
    ``[block bytes, puts]`` of the puts under way that no level indexed yet: the size the
    first of them claimed (:meth:`claim`), so a racing save of the key with another size
    is refused before it writes (see :meth:`fits`). ``leases``: key -> ``[holders, expiry
    on the Store's clock]``. ``pins``: key -> pin count. ``hit_counts``: key -> hits
    (selective write-through only)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.where: dict[BlockKey, int] = {}
        self.sizes: dict[BlockKey, int] = {}
        self.claims: dict[BlockKey, list[int]] = {}
        self.leases: dict[BlockKey, list] = {}
        self.pins: dict[BlockKey, int] = {}
        self.hit_counts: dict[BlockKey, int] = {}

        # Notified whenever blocks enter the index (note_landed): lookups that wait for
        # keys (wait_for_prefix). ``listeners`` are told the same, under the lock, so they
        # must only schedule work (the cache server's loop.call_soon_threadsafe).
        self.landed = threading.Condition(self.lock)
        self.listeners: list = []

    def mask(self, key: BlockKey) -> int:
        """The levels holding ``key`` (0: none)."""
        return self.where.get(key, 0)

    def holds(self, key: BlockKey, i: int) -> bool:
        """Whether level ``i`` holds ``key``."""
        return bool(self.where.get(key, 0) >> i & 1)

    def fits(self, key: BlockKey, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` may be stored under ``key``: a key's size is
        fixed by its first save (indexed, or claimed by a put under way); a save of it
        with another size is refused, so every level holding a key holds it at one size
        (and each level's tenant ledger charges exactly that)."""
        size = self.sizes.get(key)
        if size is not None:
            return size == nbytes
        claims = self.claims
        if not claims:          # nothing in flight: no look-up (a key hashes in Python)
            return True
        claim = claims.get(key)
        return claim is None or claim[0] == nbytes

    def claim(self, key: BlockKey, nbytes: int) -> None:
        """A put of ``key`` (``nbytes``, which :meth:`fits`) is under way; ends with
        :meth:`unclaim`."""
        claim = self.claims.get(key)
        if claim is None:
            self.claims[key] = [nbytes, 1]
        else:
            claim[1] += 1

    def unclaim(self, key: BlockKey) -> None:
        """One put of ``key`` ended (indexed or not)."""
        claim = self.claims.get(key)
        if claim is not None:
            claim[1] -= 1
            if claim[1] <= 0:
                del self.claims[key]

    def held_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Length of the prefix of ``keys`` that some level holds."""
        where, n = self.where, 0
        for key in keys:
            if not where.get(key):
                break
            n += 1
        return n

    def note_landed(self) -> None:
        """Blocks entered the index: wake every waiter (:meth:`wait_for_prefix`) and
        listener, which look again."""
        self.landed.notify_all()
        for listener in list(self.listeners):
            listener()

    def wait_for_prefix(self, keys: Sequence[BlockKey], timeout_s: float) -> int:
        """Wait (at most ``timeout_s``, real time) until some level holds every key,
        woken by each save that lands blocks (never polling); the held prefix length."""
        deadline = time.monotonic() + timeout_s
        n = self.held_prefix(keys)
        while n < len(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.landed.wait(left)
            n = self.held_prefix(keys)
        return n

    def lease(self, keys: Iterable[BlockKey], expiry: float) -> None:
        """One more holder of a lease on each key until ``expiry`` (another holder's
        lease is counted, the later expiry kept)."""
        leases = self.leases
        for key in keys:
            entry = leases.get(key)
            if entry is None:
                leases[key] = [1, expiry]
            else:
                entry[0] += 1
                if entry[1] < expiry:
                    entry[1] = expiry

    def drop_lease(self, key: BlockKey) -> None:
        """One holder of ``key``'s lease is done with it."""
        entry = self.leases.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] <= 0:
                del self.leases[key]

    def pin(self, keys: Iterable[BlockKey]) -> None:
        """One more pin on each key (counted)."""
        pins = self.pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        """One pin less on each key."""
        pins = self.pins
        for key in keys:
            count = pins.get(key, 0) - 1
            if count > 0:
                pins[key] = count
            else:
                pins.pop(key, None)

    def evictable(self, key: BlockKey, now: float, protect: set[bytes | None] | None) -> bool:
        """Not leased (unexpired at ``now``), not pinned, not a protected parent (its
        digest in ``protect``)."""
        lease = self.leases.get(key)
        if self.pins.get(key) or (lease is not None and lease[1] > now):
            return False
        return not (protect and key.digest in protect)

    def remove_level(self, key: BlockKey, i: int) -> int:
        """Level ``i`` no longer holds ``key``; returns the levels that still do (the
        key leaves ``where`` when none does; its other state stays: see
        :meth:`forget`)."""
        mask = self.where.get(key, 0) & ~(1 << i)
        if mask:
            self.where[key] = mask
        else:
            self.where.pop(key, None)
        return mask

    def forget(self, key: BlockKey) -> None:
        """Drop ``key``'s size, lease and hit count (once no level holds it)."""
        self.sizes.pop(key, None)
        self.leases.pop(key, None)
        self.hit_counts.pop(key, None)


__all__ = ["Index"]
