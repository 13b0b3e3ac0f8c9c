"""The standalone cache server (``kvstore serve``): one Store shared by every engine
process on a node over the binary protocol of ``docs/protocol.md``.

Modules: ``_protocol`` (frames, pure), ``_conn`` (one client connection), ``_shm``
(same-host shared memory), ``_admin`` (HTTP admin port), ``_metrics`` (Prometheus),
``_server`` (listeners, lifecycle). Importing this package is cheap; the server pieces
load on first use, so the client can share ``_protocol`` without them.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name in ("Server", "run_server", "build_store"):
        from kvstore.server import _server

        return getattr(_server, name)
    raise AttributeError(f"module 'kvstore.server' has no attribute {name!r}")


__all__ = ["Server", "build_store", "run_server"]
