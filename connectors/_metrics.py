"""The counters every engine connector keeps, reported through its store's ``stats()``
(under ``"connectors"``) and, for an embedded Store inside a cache server, ``/metrics``.

One :class:`ConnectorMetrics` per connector object; several with the same name (the
scheduler and worker sides, several engines over one embedded Store) are summed by the
store. Thread-safe: counted from engine threads and store callbacks alike.
"""

from __future__ import annotations

import threading

from kvstore.connectors._server_store import ServerStore
from kvstore.stats import COUNTERS, GAUGES
from kvstore.api import StoreAPI


class ConnectorMetrics:
    """Counters of one connector, attached to ``store`` under ``name`` (e.g. ``"vllm"``)
    until :meth:`close`."""

    def __init__(self, store: StoreAPI, name: str) -> None:
        self.name = name
        self._values = dict.fromkeys((*COUNTERS, *GAUGES), 0)
        self._lock = threading.Lock()
        self._store = store
        store.attach_stats(name, self.snapshot)
        if isinstance(store, ServerStore):
            store.count_into(self)        # its lookups answered without the server

    def add(self, counter: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._values[counter] += n

    def set(self, gauge: str, value: int) -> None:
        with self._lock:
            self._values[gauge] = value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def close(self) -> None:
        self._store.detach_stats(self.name, self.snapshot)


__all__ = ["COUNTERS", "GAUGES", "ConnectorMetrics"]
