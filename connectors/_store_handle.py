"""Open the store a connector talks to, one way for every engine: an embedded
:class:`~kvstore.store.Store` or a :class:`kvstore.client.Client` of a cache server,
both a :class:`kvstore.api.StoreAPI`.

A connector passes its options mapping (vLLM's ``kv_connector_extra_config``, SGLang's
``extra_config``, TensorRT-LLM's ``server_url``) and gets:

- ``{"server": "host:port", "token": ..., "timeout_s": ..., "tls": ...}``: a new Client
  of that ``kvstore serve``, held by a :class:`~kvstore.connectors._server_store.ServerStore`:
  while the server is unreachable (at start-up too) lookups miss and saves are skipped,
  and it reconnects on its own, so an engine never fails because its cache did. The
  server is what processes share. ``tls`` (for a server with ``server.tls``) is ``true``
  (the system's trust store) or the remote tier's ``tls`` settings (``ca``, ``cert``,
  ``key``, ``server_hostname``, ``check_hostname``).
- ``{"store": {...} | "path.yaml"}``: an embedded Store built from exactly that config;
  ``KVSTORE_…`` environment variables are not applied to it.
- neither: an embedded Store of the environment's config, ``$KVSTORE_CONFIG`` (with
  ``KVSTORE_…`` overrides), else the built-in default (one DRAM tier).

Embedded Stores are shared inside a process: every open of the same effective config
(the scheduler and worker sides of one engine, a connector and its offloading tier)
gets the same Store, counted, and the last :func:`release_store` closes it. Separate
processes each get their own; use a server to share across processes.

Thread-safety: :func:`open_store` and :func:`release_store` may be called from any thread.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
from typing import Any, Mapping

from kvstore.api import StoreAPI
from kvstore.config import load_config
from kvstore.errors import ConfigError

log = logging.getLogger(__name__)

_lock = threading.Lock()
_embedded: dict[str, list[Any]] = {}   # canonical config -> [store, refcount]
_handles: dict[int, str] = {}          # id(embedded store) -> its canonical config


def open_store(options: Mapping[str, Any], *, owner: str) -> StoreAPI:
    """The store ``options`` name (see the module docstring); ``owner`` names the
    connector in errors. Hand the result back with :func:`release_store`."""
    store_cfg, server = options.get("store"), options.get("server")
    if store_cfg is not None and server is not None:
        raise ConfigError(f"{owner}: give either 'store' (embedded) or 'server' (host:port), not both")
    if server is not None:
        return _client(options, server, owner)
    if store_cfg is not None and not isinstance(store_cfg, (str, Mapping)):
        raise ConfigError(f"{owner}: 'store' must be a StoreConfig mapping or a YAML path, "
                          f"got {type(store_cfg).__name__}")
    if store_cfg is None:
        config = load_config(None)                      # $KVSTORE_CONFIG and overrides, else default
    else:
        config = load_config(dict(store_cfg) if isinstance(store_cfg, Mapping) else store_cfg, env={})
    handle = json.dumps(config.model_dump(mode="json"), sort_keys=True)
    from kvstore.store import Store

    with _lock:
        entry = _embedded.get(handle)
        if entry is None:
            entry = _embedded[handle] = [Store(config), 0]
            _handles[id(entry[0])] = handle
        entry[1] += 1
        return entry[0]


def release_store(store: StoreAPI) -> None:
    """Give back a store from :func:`open_store`: a Client is closed, an embedded
    Store when its last user gave it back."""
    with _lock:
        handle = _handles.get(id(store))
        entry = _embedded.get(handle) if handle is not None else None
        if entry is not None and entry[0] is store:
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _embedded[handle], _handles[id(store)]
    store.close()


def clear_namespaces(store: StoreAPI, namespaces: Any, *, owner: str) -> bool:
    """Remove every block of ``namespaces`` (namespace digests) from ``store``, an
    embedded Store or a server (which scopes it to the caller's tenant). ``False``, and a
    warning naming ``owner``, when the store cannot clear by namespace or the clear
    failed: the caller's reset must then fail rather than keep stale KV."""
    spaces = sorted({bytes(n) for n in namespaces})
    try:
        params = inspect.signature(store.clear).parameters
    except (TypeError, ValueError):
        params = {}
    if "namespaces" not in params:
        log.warning("%s: %s cannot clear by namespace; the cache was not reset", owner, type(store).__name__)
        return False
    if not spaces:
        return True
    try:
        removed = store.clear(namespaces=spaces)
    except Exception as exc:  # noqa: BLE001 - any failure means stale KV may remain
        log.warning("%s: clearing %d namespace(s) failed (%s); the cache was not reset", owner, len(spaces), exc)
        return False
    log.info("%s: reset removed %d blocks of %d namespace(s)", owner, removed, len(spaces))
    return True


def _client(options: Mapping[str, Any], server: Any, owner: str) -> StoreAPI:
    if not isinstance(server, str) or not server.strip():
        raise ConfigError(f"{owner}: 'server' must be 'host:port', got {server!r}")
    token, timeout_s = options.get("token"), options.get("timeout_s")
    if token is not None and not isinstance(token, str):
        raise ConfigError(f"{owner}: 'token' must be a string")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or timeout_s <= 0):
        raise ConfigError(f"{owner}: 'timeout_s' must be a positive number of seconds, got {timeout_s!r}")
    try:
        from kvstore.client import Client
    except ImportError as exc:
        raise ConfigError(f"{owner}: 'server' needs kvstore.client, which this kvstore build lacks "
                          f"({exc}); use an embedded 'store' instead") from exc
    kwargs: dict[str, Any] = {"timeout_s": float(timeout_s)} if timeout_s is not None else {}
    tls = options.get("tls")
    if tls is not None:
        if not isinstance(tls, (bool, Mapping)):
            raise ConfigError(f"{owner}: 'tls' must be true or a mapping of tls settings (ca, cert, key, "
                              f"server_hostname, check_hostname), got {type(tls).__name__}")
        from kvstore.net.tls import client_tls

        try:
            kwargs["tls"] = client_tls(dict(tls) if isinstance(tls, Mapping) else tls)
        except ConfigError as exc:
            raise ConfigError(f"{owner}: {exc}") from None
    from kvstore.connectors._server_store import ServerStore

    return ServerStore(lambda: Client(server, token=token, **kwargs), server, owner=owner)


__all__ = ["clear_namespaces", "open_store", "release_store"]
