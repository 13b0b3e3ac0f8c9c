"""Which data-plane transport a client uses; the client has one module per transport:

* ``tcp``  — block bytes travel inside frames on the control connection (always there;
  :mod:`kvstore.net.client.tcp`).
* ``shm``  — same-host clients map the server's DRAM arena and copy once themselves
  (:mod:`kvstore.net.client.shm`).
* ``nixl`` — the server moves bytes one-sided between its registered DRAM arena and the
  client's registered buffers with NIXL (UCX: RDMA where the fabric has it, else
  cross-memory attach or TCP; :mod:`kvstore.net.client.nixl` over the agent wrapper
  both ends share, :mod:`kvstore.net.nixl`).

:func:`select_transport` turns the ``server.transport`` setting into the transport for
one client; :class:`FallbackCounter` logs and counts clients that drop back to TCP after
a NIXL/UCX failure. Importing this module never loads NIXL.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable

from kvstore.errors import ConfigError
from kvstore.net.nixl import nixl_available

log = logging.getLogger("kvstore.transport")   # its name before the net/ layout

TRANSPORTS = ("tcp", "shm", "nixl")
def select_transport(value: str, *, local: bool, nixl_ok: bool | None = None, why: str | None = None,
                     setting: str = "server.transport") -> str:
    """The transport for one client: ``"tcp"``, ``"shm"`` or ``"nixl"``.

    ``value`` is the setting (``auto|tcp|shm|nixl``; ``setting`` names it in errors);
    ``local`` says the client runs on the server's host; ``nixl_ok`` overrides NIXL
    detection and ``why`` says why it is not available. ``auto`` picks the fastest
    available: shared memory for local clients (one memcpy, no transfer engine), NIXL
    for remote ones when available, else TCP. An explicit choice that cannot work
    raises :class:`ConfigError` saying why."""
    if nixl_ok is None:
        nixl_ok, detected = nixl_available()
        why = why or detected
    why = why or "NIXL is not available"
    if value == "auto":
        if local:
            return "shm"
        return "nixl" if nixl_ok else "tcp"
    if value == "tcp":
        return "tcp"
    if value == "shm":
        if not local:
            raise ConfigError(f"{setting} is 'shm' but the client is on another host; use 'auto', 'tcp' or 'nixl'")
        return "shm"
    if value == "nixl":
        if not nixl_ok:
            raise ConfigError(f"{setting} is 'nixl' but {why}")
        return "nixl"
    raise ConfigError(f"{setting} must be one of auto, {', '.join(TRANSPORTS)}; got {value!r}")


class FallbackCounter:
    """Clients that fell back from one transport to another, by reason. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def record(self, client: str, failed: str, exc: BaseException, *, to: str = "tcp") -> None:
        """Log and count one client's fallback from ``failed`` to ``to``."""
        log.warning("client %s: %s transport failed (%s: %s); falling back to %s",
                    client, failed, type(exc).__name__, exc, to)
        key = f"{failed}->{to}"
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


def describe_selection(checks: Iterable[Any]) -> str:
    """One paragraph for ``kvstore doctor``: what ``transport: auto`` picks on this node."""
    checks = list(checks)
    ucx = any(c.area == "nixl" and c.name == "backend UCX" and c.ok for c in checks)
    rdma = any(c.area == "rdma" and c.ok for c in checks)
    if ucx:
        fabric = "RDMA (InfiniBand/RoCE)" if rdma else "no RDMA here, so UCX uses cross-memory attach or TCP"
        remote = f"nixl (UCX; {fabric})"
    else:
        remote = "tcp (NIXL with a UCX backend is not available)"
    return f"transport auto: same-host clients -> shm; remote clients -> {remote}"


__all__ = ["FallbackCounter", "TRANSPORTS", "describe_selection", "select_transport"]
