"""What one client connection (:class:`kvstore.net.server._conn.Connection`, with its
same-host and NIXL operations) uses of its server, handed to it explicitly: the served
Store, the server's limits, shared services and a few callbacks. Built once by the
server; read on the event loop thread only.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from kvstore.net import protocol as P

if TYPE_CHECKING:
    from kvstore.net.server._budget import TenantBudgets
    from kvstore.net.server._landing import Landing
    from kvstore.net.server._metrics import ServerMetrics
    from kvstore.net.server._nixl import NixlService
    from kvstore.net.server._send import Sender
    from kvstore.net.server._served import ServedStore
    from kvstore.net.server._shm import Arena
    from kvstore.net.server._tenants import Tenant, Tenants


@dataclass(frozen=True)
class ConnContext:
    """``served``: the Store with interned keys and first-tier borrows; ``limits`` and
    ``max_inflight_bytes``/``idle_timeout_s``: from ``server`` config; ``tls_context``:
    ``server.tls`` (TCP connections are wrapped in it), ``None`` without; ``sender``: the
    vectored-send threads; ``buffers``: the budget every connection's scratch buffer
    comes from (one share per tenant); ``nixl``: the NIXL data plane; ``arena``: the shared first tier offered
    to same-host clients (``None`` when not). Callbacks into the server:
    ``hello_info(local, tenant)`` (a HELLO's answer), ``stats(tenant)`` (called in the
    loop's executor), ``reclaim_buffers(tenant)`` (that tenant's idle connections give
    their scratch buffers back), ``authenticated(conn)`` (a connection's HELLO
    succeeded), ``closing()`` (shutdown began) and ``forget(conn)`` (a connection
    closed). ``landing``: wakes lookups that wait for keys (LOOKUP_WAIT)."""

    served: ServedStore
    metrics: ServerMetrics
    tenants: Tenants
    limits: P.Limits
    max_inflight_bytes: int
    idle_timeout_s: float
    tls_context: ssl.SSLContext | None
    sender: Sender
    buffers: TenantBudgets
    nixl: NixlService
    arena: Arena | None
    hello_info: Callable[[bool, Tenant | None], dict[str, Any]]
    stats: Callable[[Tenant | None], dict[str, Any]]
    reclaim_buffers: Callable[[Tenant | None], None]
    authenticated: Callable[[Any], None]
    closing: Callable[[], bool]
    forget: Callable[[Any], None]
    landing: "Landing | None" = None   # LOOKUP_WAIT's wake-ups (None: such lookups answer at once)

    @property
    def store(self) -> Any:
        """The served Store."""
        return self.served.store


__all__ = ["ConnContext"]
