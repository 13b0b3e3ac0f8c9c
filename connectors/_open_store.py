"""Open the Store a connector talks to, from the connector's own options.

Engines hand connectors a free-form dict (SGLang's ``extra_config``, TensorRT-LLM's
connector options). Two shapes are accepted:

- ``{"store": {...}}``: an embedded :class:`~kvstore.store.Store` built from a
  ``StoreConfig`` dict (or a YAML path); the connector owns it and closes it.
- ``{"server": "host:port", "token": "..."}``: a :class:`kvstore.client.Client` to a
  running ``kvstore serve``; the connector owns the client (not the server).

Neither key: an embedded Store with the built-in default config (one DRAM tier).
"""

from __future__ import annotations

from typing import Any, Mapping

from kvstore.errors import ConfigError


def open_store(options: Mapping[str, Any], *, owner: str) -> Any:
    """A Store or Client per ``options``; ``owner`` names the connector in errors.

    The caller owns the result and must ``close()`` it.
    """
    store_cfg = options.get("store")
    server = options.get("server")
    if store_cfg is not None and server is not None:
        raise ConfigError(f"{owner}: give either 'store' (embedded) or 'server' (host:port), not both")
    if server is not None:
        if not isinstance(server, str) or not server.strip():
            raise ConfigError(f"{owner}: 'server' must be 'host:port', got {server!r}")
        token = options.get("token")
        if token is not None and not isinstance(token, str):
            raise ConfigError(f"{owner}: 'token' must be a string")
        try:
            from kvstore.client import Client
        except ImportError as exc:
            raise ConfigError(
                f"{owner}: 'server' needs kvstore.client, which this kvstore build lacks "
                f"({exc}); use an embedded 'store' instead") from exc
        return Client(server, token=token)
    if store_cfg is not None and not isinstance(store_cfg, (str, Mapping)):
        raise ConfigError(f"{owner}: 'store' must be a StoreConfig mapping or a YAML path, "
                          f"got {type(store_cfg).__name__}")
    from kvstore.store import Store

    return Store.from_config(store_cfg)


__all__ = ["open_store"]
