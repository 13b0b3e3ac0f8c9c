"""The server-wide budget of scratch-buffer bytes (``server.max_inflight_bytes_total``),
split into one share per tenant.

Every connection's scratch buffer (PUT payloads, blocks a GET loads from slower tiers)
is taken from its tenant's share before it is allocated and given back when it is
dropped, so the buffers of all connections together never pass the limit, however many
uploads stall at once, and one tenant's connections never hold (or queue for) another
tenant's share: each share is a budget of its own with its own queue. Within a share a
connection holds one buffer of at most ``max_inflight_bytes``. A connection that finds
its share spent waits, reading nothing more of its frame (TCP back-pressure on its
client), first asking its tenant's idle connections to drop the buffers they keep
between requests. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Callable, Sequence


class ByteBudget:
    """``limit`` bytes, taken and given back in FIFO order of the takers."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.waits = 0                       # takes that had to wait, ever
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def charge(self, nbytes: int) -> int:
        """What a buffer of ``nbytes`` costs: one larger than the whole budget may still
        be taken, alone (it costs the whole budget)."""
        return min(nbytes, self.limit)

    async def take(self, nbytes: int, reclaim: Callable[[], None]) -> None:
        """Wait until ``charge(nbytes)`` fits (after earlier waiters), then take it.
        ``reclaim()`` is called once when it does not fit at once."""
        cost = self.charge(nbytes)
        if not self._waiters and self.used + cost <= self.limit:
            self.used += cost
            return
        reclaim()
        if not self._waiters and self.used + cost <= self.limit:
            self.used += cost
            return
        self.waits += 1
        fut = asyncio.get_running_loop().create_future()
        entry = (cost, fut)
        self._waiters.append(entry)
        try:
            await fut                          # _wake took it for us
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.give(nbytes)              # granted just as we were cancelled
            else:
                if entry in self._waiters:
                    self._waiters.remove(entry)
                self._wake()
            raise

    def give(self, nbytes: int) -> None:
        self.used -= self.charge(nbytes)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.limit:
            cost, fut = self._waiters.popleft()
            if fut.done():
                continue
            self.used += cost
            fut.set_result(None)


class TenantBudgets:
    """``total`` bytes split evenly over ``tenants`` (names): one :class:`ByteBudget`
    each, so a tenant's stalled or slow uploads wait in its own queue only."""

    def __init__(self, total: int, tenants: Sequence[str]) -> None:
        share = max(1, total // max(1, len(tenants)))
        self.total = total
        self.shares = {name: ByteBudget(share) for name in tenants}

    def of(self, tenant: str) -> ByteBudget:
        return self.shares[tenant]

    @property
    def used(self) -> int:
        return sum(b.used for b in self.shares.values())

    @property
    def waits(self) -> int:
        return sum(b.waits for b in self.shares.values())

    @property
    def waiting(self) -> int:
        return sum(b.waiting for b in self.shares.values())


__all__ = ["ByteBudget", "TenantBudgets"]
