"""The standalone cache server (``kvstore serve``): one Store shared by every engine
process on a node over the binary protocol of ``docs/protocol.md``.

Modules: ``_server`` (listeners, lifecycle), ``_conn`` (one client connection) and
``_conn_shm`` (its same-host operations), ``_shm`` (the shared arena, leases, clients'
staging regions), ``_paths`` (socket and arena files), ``_nixl`` (the server end of NIXL),
``_send`` / ``_tls_stream`` (writing replies, TLS), ``_refusals``, ``_tenants``,
``_startline`` (the line ``kvstore serve`` prints once listening),
``_admin`` + ``_lookup`` (HTTP admin port), ``_metrics`` (Prometheus). The frames both
ends speak are :mod:`kvstore.net.protocol`. Importing this package is cheap; the server
pieces load on first use. The public names are also ``kvstore.server``'s.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("Server", "run_server", "build_store"):
        from kvstore.net.server import _server

        return getattr(_server, name)
    if name == "start_line":
        from kvstore.net.server._startline import start_line

        return start_line
    raise AttributeError(f"module 'kvstore.net.server' has no attribute {name!r}")


__all__ = ["Server", "build_store", "run_server", "start_line"]
