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
one client; :func:`connect_transport` makes that choice for a connected client and
builds the one :class:`Transport` it then uses for every save and load (the same-host
checks and fallbacks included); :class:`FallbackCounter` logs and counts clients that
drop back to TCP after a NIXL/UCX failure. Importing this module never loads NIXL.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from kvstore.errors import ConfigError, RemoteError, TierUnavailableError, TransportError
from kvstore.keys import BlockKey
from kvstore.net.client.shm import SameHostTransport, same_server_socket
from kvstore.net.client.tcp import Integrity, TcpTransport
from kvstore.net.client.wire import Address, ArenaMap, Conn
from kvstore.net.nixl import nixl_available

log = logging.getLogger("kvstore.transport")   # its name before the net/ layout
_client_log = logging.getLogger("kvstore.client")

TRANSPORTS = ("tcp", "shm", "nixl")


class Transport(Protocol):
    """How one client's block bytes move; control frames always go over its pooled
    connections (:class:`~kvstore.net.client.wire.Conn`), which the client owns and
    hands to each call. One implementation per module: :class:`TcpTransport`,
    :class:`SameHostTransport`, :class:`~kvstore.net.client.nixl.NixlTransport`.
    Every method may be called from any thread, each call on its own connection."""

    name: str   # "tcp", "shm" or "nixl": Client.transport

    def start(self, run: Callable[[Callable[[Conn], Any]], Any]) -> None:
        """Finish setting up once the client's pool exists (``run`` runs a function on a
        pooled connection, retrying once); may fall back instead of raising."""

    def put(self, conn: Conn, keys: list[BlockKey], srcs: list[Any],
            sums: list[int | None] | None = None) -> list[bool]:
        """Store one batch; per key whether the server holds it now. ``sums``: the
        writer's XXH3-64 of each source (``None``: hash it here), sent as the block's
        checksum, so the server refuses a source changed since its writer hashed it."""

    def get(self, conn: Conn, keys: list[BlockKey], dsts: list[Any]) -> list[bool]:
        """Load one batch into ``dsts``; ``True`` only for a block verified there."""

    def put_limit(self, max_payload: int) -> int:
        """The bytes one put batch may carry, given the server's ``max_payload``."""

    def register(self, buf: Any) -> None:
        """A long-lived buffer the transport may use in place (a no-op where it cannot)."""

    def close(self) -> None:
        """Release what the transport owns (a mapped arena, copy threads, a NIXL agent)."""


@dataclass
class Connected:
    """A client's transport (:func:`connect_transport`), where its pooled connections go
    (``addr``: the server's Unix socket for shared memory) and those already open there."""

    transport: Transport
    addr: Address
    conns: list[Conn]


def connect_transport(setting: str, first: Conn, *, tls: Any, connect: Callable[[Address], Conn],
                      integrity: Integrity, staging_bytes: int, max_batch: int, copy_threads: int,
                      timeout_s: float, on_failure: Callable[[Any, BaseException], None]) -> Connected:
    """The transport for a client whose first connection is ``first`` (its HELLO said
    what the server offers) and whose ``transport`` setting is ``setting``:

    * shared memory (``auto``/``shm``) when the server's arena is on this host and this
      user may map it, and the server's Unix socket answers as the same server
      (``connect`` opens a connection to an address); a refused map is an error with
      ``shm``, TCP with ``auto``; another server on the socket means TCP;
    * else NIXL (``nixl``, or ``auto`` without ``tls``: TLS does not cover NIXL's
      transfers) when both sides have it; ``on_failure`` is told of a later NIXL failure;
    * else TCP.

    An explicit choice that cannot work raises (``first`` closed); ``first`` is closed
    too when the pool goes to another address."""
    info = first.info
    address = first.addr
    if setting in ("auto", "shm") and ArenaMap.is_local(info.get("shm")):
        arena, addr, conns = _map_arena(setting, first, info, connect)
        if arena is not None:
            return Connected(SameHostTransport(arena, copy_threads=copy_threads, staging_bytes=staging_bytes,
                                               max_batch=max_batch, integrity=integrity), addr, conns)
    elif setting == "shm":
        first.close()
        raise RemoteError(f"server {address} offers no shared memory to this host")
    else:
        conns = [first]
    tcp = TcpTransport(integrity)
    if setting == "nixl" or (setting == "auto" and tls is None):
        ok, why = nixl_available()
        try:
            choice = select_transport(setting, local=False, nixl_ok=ok and bool(info.get("nixl")),
                                      setting="Client transport",
                                      why=why if not ok else f"server {address} does not offer NIXL")
        except ConfigError:
            for conn in conns:
                conn.close()
            raise
        if choice == "nixl":
            from kvstore.net.client.nixl import NixlClientPath, NixlTransport

            try:
                path = NixlClientPath(timeout_s=timeout_s, staging_bytes=staging_bytes, integrity=integrity)
            except (TransportError, TierUnavailableError) as exc:
                if setting == "nixl":       # asked for by name: an error, never a silent TCP
                    for conn in conns:
                        conn.close()
                    raise RemoteError(f"Client transport is 'nixl' but this client's NIXL agent could not "
                                      f"start ({exc}); use 'auto' or 'tcp'") from exc
                on_failure(_NotStarted(), exc)   # auto: logged and counted as a fallback to TCP
            else:
                return Connected(NixlTransport(path, tcp=tcp, on_failure=on_failure), address, conns)
    return Connected(tcp, address, conns)


class _NotStarted:
    """The NIXL transport that never started, as :func:`connect_transport` reports it."""

    name = "nixl"


def _map_arena(setting: str, first: Conn, info: dict[str, Any],
               connect: Callable[[Address], Conn]) -> tuple[ArenaMap | None, Address, list[Conn]]:
    """The server's arena mapped here, the address for pooled connections and those open
    there; ``(None, first.addr, [first])`` where the client is to stay on TCP."""
    address = first.addr
    try:
        arena = ArenaMap(info["shm"])
    except PermissionError as exc:
        # The server's arena is private to its user (mode 0600): another user's
        # client talks TCP instead.
        if setting == "shm":
            first.close()
            raise RemoteError(f"server {address}: its shared memory is not readable by this "
                              f"user ({exc.strerror}); run as the server's user or use TCP") from exc
        _client_log.info("server %s: shared memory not readable by this user; using TCP", address)
        return None, address, [first]
    if not info.get("socket_path") or address.path:
        return arena, address, [first]
    probe = same_server_socket(address, info["socket_path"], info.get("instance"), connect)
    if probe is None:     # another server answers there: not its arena either
        arena.close()
        return None, address, [first]
    first.close()
    return arena, probe.addr, [probe]


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


__all__ = ["Connected", "FallbackCounter", "TRANSPORTS", "Transport", "connect_transport", "describe_selection",
           "select_transport"]
