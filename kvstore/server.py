"""``from kvstore.server import Server, run_server, build_store, start_line``: the cache server
(``kvstore serve``), defined in :mod:`kvstore.net.server`. Importing this module is cheap:
the server loads on first use."""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("Server", "run_server", "build_store", "start_line"):
        from kvstore.net import server

        return getattr(server, name)
    raise AttributeError(f"module 'kvstore.server' has no attribute {name!r}")


__all__ = ["Server", "build_store", "run_server", "start_line"]
