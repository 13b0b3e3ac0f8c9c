"""A connector's store when it is a cache server: a :class:`kvstore.client.Client` the
engine can lose without noticing beyond its hit rate.

A cache is best effort. While the server cannot be reached (down, restarting, never
started) :class:`ServerStore` answers without it: a lookup is a miss (counted in the
connector's ``unreachable_lookups``), ``contains`` is all ``False``, a save resolves to
``False`` for every block (the connectors count those in ``dropped_saves``), a load
resolves to ``False`` for every block (never ``True`` for bytes not loaded: the
connectors report them as failed loads through their usual path), a release or hint is
dropped (leases expire on the server by themselves). ``clear`` and ``delete`` still
raise :class:`~kvstore.errors.TierUnavailableError`: a reset that did not happen must
not look done. Other errors (a bad argument, a closed store, a wrong token at start-up)
are raised as before.

It never blocks an engine thread on a server known to be down: the first call that
fails marks it unreachable, later calls answer at once, and one background thread tries
again every ``retry_s`` (the Client's own reconnect finds a restarted same-host server's
new socket and arena). The outage is logged when it starts, every ``log_every_s`` while
it lasts (one line with the count of calls answered without the server) and when it
ends. An engine whose server is down at start-up starts, and hits once it is up.

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from kvstore.errors import NotSupportedError, StoreClosedError, TierUnavailableError, TransportError
from kvstore.hint import Hint
from kvstore.keys import BlockKey
from kvstore.stats import sum_stat_sources

log = logging.getLogger(__name__)

RETRY_S = 1.0         # between reconnect attempts while the server is unreachable
LOG_EVERY_S = 30.0    # one log line per this while it stays unreachable
_UNREACHABLE = (TierUnavailableError, TransportError)


class ServerStore:
    """The :class:`kvstore.api.StoreAPI` of the server ``make_client`` connects to (see
    the module docstring). ``make_client`` builds a connected Client or raises
    ``TierUnavailableError``; ``owner`` names the connector in log lines."""

    lends_memory = False   # the server's memory is not in this process

    def __init__(self, make_client: Callable[[], Any], address: str, *, owner: str,
                 retry_s: float = RETRY_S, log_every_s: float = LOG_EVERY_S) -> None:
        self.address, self.owner = address, owner
        self._make = make_client
        self._retry_s, self._log_every_s = retry_s, log_every_s
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._client: Any = None
        self._down_since: float | None = None     # monotonic time the outage began
        self._answered = 0                         # calls answered without the server, this outage
        self._outages = 0
        self._prober: threading.Thread | None = None
        self._sources: list[tuple[str, Any]] = []   # attach_stats
        self._counters: list[Any] = []              # ConnectorMetrics told of unreachable lookups
        self._registered: list[Any] = []
        try:
            self._client = make_client()
        except _UNREACHABLE as exc:
            self._went_down(exc)                    # the engine starts anyway; lookups miss until it is up

    # -- state ---------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The :class:`kvstore.client.Client` (``None`` until the server first answered)."""
        return self._client

    @property
    def reachable(self) -> bool:
        """Whether the last call reached the server (may be stale on return)."""
        return self._down_since is None and self._client is not None

    def count_into(self, metrics: Any) -> None:
        """Count lookups answered as misses while unreachable in ``metrics`` (a
        :class:`~kvstore.connectors._metrics.ConnectorMetrics`), as ``unreachable_lookups``."""
        with self._lock:
            self._counters.append(metrics)

    def _live(self) -> Any:
        """The Client, or None while the server is unreachable (answered without it)."""
        if self._closed.is_set():
            raise StoreClosedError(f"{self.owner}: the store is closed")
        with self._lock:
            if self._down_since is None and self._client is not None:
                return self._client
            self._answered += 1
            return None

    def _went_down(self, exc: BaseException) -> None:
        with self._lock:
            if self._down_since is not None or self._closed.is_set():
                self._answered += 1
                return
            self._down_since = time.monotonic()
            self._answered, self._outages = 1, self._outages + 1
            self._prober = threading.Thread(target=self._reconnect, name="kvstore-reconnect", daemon=True)
            self._prober.start()
        log.warning("%s: kvstore server %s is unreachable (%s); lookups are misses and saves are skipped "
                    "until it is back (retried every %.0f s)", self.owner, self.address, exc, self._retry_s)

    def _reconnect(self) -> None:
        """The outage's background thread: try the server every ``retry_s`` until it
        answers (or the store closes), logging at most once per ``log_every_s``."""
        last_log = time.monotonic()
        while not self._closed.wait(self._retry_s):
            try:
                client = self._client
                if client is None:
                    client = self._make()
                    for buf in self._registered:
                        client.register(buf)
                else:
                    client.ping()
            except Exception as exc:   # still down (or refusing): keep answering without it
                now = time.monotonic()
                if now - last_log >= self._log_every_s:
                    last_log = now
                    with self._lock:
                        since, answered = self._down_since or now, self._answered
                    log.warning("%s: kvstore server %s still unreachable after %.0f s (%s); %d calls answered "
                                "without it", self.owner, self.address, now - since, exc, answered)
                continue
            with self._lock:
                handed = not self._closed.is_set()
                if handed:
                    since, answered = self._down_since or time.monotonic(), self._answered
                    self._client, self._down_since, self._prober = client, None, None
            if not handed:
                client.close()    # the store closed meanwhile (Client.close is idempotent)
                return
            log.warning("%s: kvstore server %s reachable again after %.0f s; %d calls were answered without it",
                        self.owner, self.address, time.monotonic() - since, answered)
            return

    def _unreachable_lookup(self) -> int:
        with self._lock:
            counters = list(self._counters)
        for metrics in counters:
            metrics.add("unreachable_lookups")
        return 0

    # -- queries: a miss while unreachable ------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey], lease_s: float | None = None, *, hint: Hint | None = None,
               wait_s: float | None = None) -> int:
        """As :meth:`kvstore.client.Client.lookup`; while the server is unreachable a
        miss at once (``wait_s`` or not)."""
        client = self._live()
        if client is None:
            return self._unreachable_lookup()
        try:
            if wait_s:
                return client.lookup(keys, lease_s, hint=hint, wait_s=wait_s)
            return client.lookup(keys, lease_s, hint=hint)
        except _UNREACHABLE as exc:
            self._went_down(exc)
            return self._unreachable_lookup()

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self._quietly(lambda c: c.contains(keys), [False] * len(keys))

    def hint(self, keys: Sequence[BlockKey], hint: Hint) -> int:
        return self._quietly(lambda c: c.hint(keys, hint), 0)

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Dropped while unreachable: a lease expires on the server by itself."""
        self._quietly(lambda c: c.release(keys), None)

    def _quietly(self, fn: Callable[[Any], Any], fallback: Any) -> Any:
        client = self._live()
        if client is None:
            return fallback
        try:
            return fn(client)
        except _UNREACHABLE as exc:
            self._went_down(exc)
            return fallback

    # -- data: False for every block while unreachable ------------------------------------

    def save(self, keys: Sequence[BlockKey], srcs: Sequence[Any], *,
             checksums: Sequence[int | None] | None = None, hint: Hint | None = None) -> "Future[list[bool]]":
        """Resolves to whether each block is stored: ``False`` for all while the server
        is unreachable (skipped; the caller may reuse ``srcs`` once it resolves)."""
        return self._data(lambda c: c.save(keys, srcs, checksums=checksums, hint=hint), len(keys))

    def load(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> "Future[list[bool]]":
        """Resolves to ``True`` only for a block verified in its buffer: ``False`` for
        all while the server is unreachable, or when it became unreachable during the
        load (the buffers may then hold part of the bytes: they are not loaded)."""
        return self._data(lambda c: c.load(keys, dsts), len(keys))

    def _data(self, submit: Callable[[Any], Future], n: int) -> Future:
        out: Future = Future()
        client = self._live()
        if client is None:
            out.set_result([False] * n)
            return out
        inner = submit(client)

        def done(f: Future) -> None:
            exc = f.exception()
            if isinstance(exc, _UNREACHABLE):
                self._went_down(exc)
                out.set_result([False] * n)
            elif exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(f.result())

        inner.add_done_callback(done)
        return out

    # -- operations that must not look done when they did not happen ------------------------

    def clear(self, namespaces: Sequence[bytes] | None = None) -> int:
        """As :meth:`kvstore.client.Client.clear`; raises TierUnavailableError while the
        server is unreachable (a reset that did not happen must say so)."""
        return self._strict(lambda c: c.clear(namespaces))

    def delete(self, keys: Sequence[BlockKey]) -> int:
        return self._strict(lambda c: c.delete(keys))

    def ping(self) -> float:
        return self._strict(lambda c: c.ping())

    def _strict(self, fn: Callable[[Any], Any]) -> Any:
        client = self._live()
        if client is None:
            raise TierUnavailableError(f"{self.owner}: kvstore server {self.address} is unreachable")
        try:
            return fn(client)
        except _UNREACHABLE as exc:
            self._went_down(exc)
            raise

    # -- stats -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The server's counters (as :meth:`kvstore.client.Client.stats`) with this
        process's connector counters under ``"connectors"`` and the link's state under
        ``"server_link"``; only those two while the server is unreachable."""
        client = self._live()
        out: dict[str, Any] = {}
        if client is not None:
            try:
                out = client.stats()
            except _UNREACHABLE as exc:
                self._went_down(exc)
                out = {}
        out["connectors"] = sum_stat_sources(self._sources)
        with self._lock:
            out["server_link"] = {"address": self.address, "reachable": self._down_since is None
                                  and self._client is not None, "outages": self._outages,
                                  "answered_without_server": self._answered if self._down_since is not None else 0}
        return out

    def attach_stats(self, name: str, source: Any) -> None:
        """As :meth:`kvstore.store.Store.attach_stats`: reported by :meth:`stats`."""
        self._sources.append((name, source))

    def detach_stats(self, name: str, source: Any) -> None:
        self._sources = [s for s in self._sources if s != (name, source)]

    def register(self, buf: Any) -> None:
        """As :meth:`kvstore.client.Client.register`, also for a Client made later."""
        self._registered.append(buf)
        client = self._client
        if client is not None:
            client.register(buf)

    # -- what a server store cannot offer --------------------------------------------------

    def pin(self, keys: Sequence[BlockKey]) -> None:
        raise _unsupported("pin", "the cache-server protocol has no pin operation")

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        raise _unsupported("unpin", "the cache-server protocol has no pin operation")

    def prefetch(self, keys: Sequence[BlockKey], tier: int | str = 0) -> "Future[int]":
        raise _unsupported("prefetch", "the cache-server protocol has no prefetch operation")

    def reserve(self, keys: Sequence[BlockKey], sizes: Sequence[int], *, evict: bool = True) -> Any:
        raise _unsupported("reserve", "the store's memory lives in the server (lends_memory is False)")

    def borrow(self, keys: Sequence[BlockKey]) -> Any:
        raise _unsupported("borrow", "the store's memory lives in the server (lends_memory is False)")

    def flush(self) -> int:
        raise _unsupported("flush", "the cache-server protocol has no flush operation")

    def close(self) -> None:
        """Stop reconnecting and close the Client. Idempotent."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            prober, client, self._client = self._prober, self._client, None
        if prober is not None:
            prober.join()
        if client is not None:
            client.close()


def _unsupported(method: str, why: str) -> NotSupportedError:
    return NotSupportedError(f"{method} is not supported on a cache server's store: {why}")


__all__ = ["LOG_EVERY_S", "RETRY_S", "ServerStore"]
