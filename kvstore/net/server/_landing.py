"""LOOKUP_WAIT on the server's event loop: a lookup that waits (bounded) for keys to be
stored, woken by the saves that land them, never by polling and never holding a thread.

The Store calls :meth:`Landing._landed` (under its index lock, from whatever thread
indexed the blocks) each time blocks enter its index; that schedules one wake-up on the
loop, where every waiting lookup looks again. A waiter registers before it looks, so a
save that lands between its look and its sleep still wakes it.

Threading: :meth:`wait_for` and :meth:`close` run on the loop thread; :meth:`_landed`
on any thread.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from kvstore.keys import BlockKey


class Landing:
    def __init__(self, store: Any) -> None:
        self._store = store
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: set[asyncio.Future] = set()
        self._closed = False

    async def wait_for(self, keys: Sequence[BlockKey], wait_s: float) -> None:
        """Return once the Store holds every key of ``keys``, ``wait_s`` passed, or the
        server began shutting down. A Store that cannot tell when blocks land answers
        at once."""
        store = self._store
        if not hasattr(store, "add_landed_listener") or self._closed:
            return
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            store.add_landed_listener(self._landed)
        deadline = loop.time() + wait_s
        while not self._closed:
            woken = loop.create_future()
            self._waiters.add(woken)
            try:
                if store.held_prefix(keys) == len(keys):
                    return
                left = deadline - loop.time()
                if left <= 0:
                    return
                try:
                    await asyncio.wait_for(woken, left)
                except asyncio.TimeoutError:
                    return
            finally:
                self._waiters.discard(woken)

    def _landed(self) -> None:
        """Blocks entered the Store's index (any thread, the index lock held)."""
        if self._waiters and self._loop is not None and not self._closed:
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        for woken in list(self._waiters):
            if not woken.done():
                woken.set_result(None)

    def close(self) -> None:
        """Shutdown: every waiting lookup answers now; no listener stays on the Store."""
        self._closed = True
        self._wake()
        if self._loop is not None:
            self._store.remove_landed_listener(self._landed)


__all__ = ["Landing"]
