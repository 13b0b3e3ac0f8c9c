"""Open the store a connector talks to: an embedded :class:`~kvstore.store.Store` or a
:class:`kvstore.client.Client` of a cache server, both with the same API.

Embedded stores live in a process-wide registry keyed by their config, so the
scheduler-side and worker-side connector objects of one process (and a connector plus
its offloading tier) share one Store. Embedded mode is for single-process serving:
separate processes each get their own Store; use a server to share across processes.

Thread-safety: :func:`open_store` and :func:`release_store` may be called from any
thread.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Mapping

from kvstore.config import load_config
from kvstore.errors import ConfigError

_lock = threading.Lock()
_embedded: dict[str, list[Any]] = {}   # canonical config -> [store, refcount]


def open_store(store: Mapping[str, Any] | str | None, server: str | None, token: str | None,
               timeout_s: float | None = None) -> tuple[Any, str]:
    """The store named by a connector's config and the handle to pass to
    :func:`release_store`. Exactly one of ``store`` (a StoreConfig dict or YAML path)
    and ``server`` (``host:port``) must be given. Environment variables are not read:
    the embedded config is used exactly as given."""
    if (store is None) == (server is None):
        raise ConfigError("kvstore connector: set exactly one of 'store' (an embedded StoreConfig "
                          "dict or YAML path) and 'server' ('host:port' of a kvstore server)")
    if server is not None:
        try:
            from kvstore.client import Client
        except ImportError as exc:
            raise ConfigError(f"kvstore connector: 'server' is set but the kvstore client is not "
                              f"available in this install ({exc}); use 'store' for an embedded store") from exc
        kwargs = {"token": token}
        if timeout_s is not None:
            kwargs["timeout_s"] = timeout_s
        return Client(server, **kwargs), ""
    config = load_config(dict(store) if isinstance(store, Mapping) else store, env={})
    handle = json.dumps(config.model_dump(mode="json"), sort_keys=True)
    from kvstore.store import Store

    with _lock:
        entry = _embedded.get(handle)
        if entry is None:
            entry = _embedded[handle] = [Store(config), 0]
        entry[1] += 1
        return entry[0], handle


def release_store(store: Any, handle: str) -> None:
    """Drop one reference; the last one closes the store."""
    if not handle:
        store.close()
        return
    with _lock:
        entry = _embedded.get(handle)
        if entry is None or entry[0] is not store:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _embedded[handle]
    store.close()


__all__ = ["open_store", "release_store"]
