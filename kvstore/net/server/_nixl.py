"""The server side of the NIXL data plane (``NIXL_HELLO`` / ``NIXL_GET`` / ``NIXL_PUT``).

One :class:`NixlService` per server owns one :class:`NixlEndpoint`, created on the first
``NIXL_HELLO``, with the first DRAM tier's arena registered once. A connection that
sent ``NIXL_HELLO`` is bound to the client's NIXL agent; several connections of one
client share that peer, dropped when the last of them closes.

* get: blocks in the first tier leave straight from the arena with one NIXL WRITE into
  the client's buffers, under :meth:`Store.borrow` leases (the slots are not reused
  until the transfer ends). Blocks held only in slower tiers are answered ``NOT_SENT``;
  the client fetches those with ``GET``.
* put: one NIXL READ from the client's buffers into a registered staging buffer (from
  a pool shared by all connections, touched and registered once), then
  :meth:`Store.save` (one copy), so admission, eviction and the index run as for any
  other save — as on the shared-memory path.

Large transfers are cut by NIXL across the endpoint's copy threads (``_UCX_THREADS``; on
one host each chunk is a kernel cross-memory copy made by the thread that posts it), so
one client's batch is not held to one core.

Every method blocks (it waits for transfers): the connection runs them in an executor.
A transfer failure raises :class:`TransportError` (the client falls back to TCP) and
is counted in ``stats()``.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import ExitStack
from typing import Any, cast

import numpy as np

from kvstore.errors import TransportError
from kvstore.net import protocol as P
from kvstore.net.server._served import ServedStore
from kvstore.tiers.base import HostArena

log = logging.getLogger("kvstore.server")
_MEM = {0: "DRAM", 1: "VRAM"}
_UCX_WORKERS = 4  # concurrent clients' transfers spread over this many UCX workers
# one large transfer (a 64-block get) is split over this many copy threads, so a single
# client is not held to one core's copy speed; none on a one-core machine
_UCX_THREADS = min(4, os.cpu_count() or 1) if (os.cpu_count() or 1) > 1 else 0
_MAX_IDLE_STAGING = 4  # idle staging buffers kept registered for the next puts
_PREWARM_BUFFERS, _PREWARM_BYTES = 2, 64 << 20  # made when NIXL starts, before any put waits on them


class NixlService:
    """Serves ``served``'s first tier over NIXL. ``transport`` is ``server.transport``
    (NIXL only with ``auto`` or ``nixl``); ``tenants``: the server has tenants (NIXL is
    then never offered); ``max_inflight_bytes`` bounds one put. Thread-safe; every NIXL
    call goes through one endpoint (read-write sync mode)."""

    def __init__(self, served: ServedStore, *, transport: str, tenants: bool, max_inflight_bytes: int) -> None:
        self._served = served
        self._transport, self._tenants = transport, tenants
        self._max_inflight_bytes = max_inflight_bytes
        self._lock = threading.Lock()
        self._endpoint: Any = None
        self._start_error: str | None = None
        self._peers: dict[str, int] = {}       # agent name -> connections bound to it
        self._peer_tenant: dict[str, str] = {}  # agent name -> the tenant of those connections
        self._free: list[tuple[np.ndarray, int]] = []  # idle registered staging buffers, region ids
        self.counters = {"gets": 0, "puts": 0, "bytes_out": 0, "bytes_in": 0, "not_sent": 0,
                         "failures": 0}

    # -- availability ----------------------------------------------------------------------

    def offered(self) -> bool:
        """Whether clients are told NIXL is available (config allows it, nixl imports,
        the first tier is borrowable host memory)."""
        from kvstore.net.nixl import nixl_available

        if self._transport not in ("auto", "nixl") or self._start_error or self._tenants:
            return False
        return bool(self._served.borrowable and nixl_available()[0])

    def _ensure_endpoint(self) -> Any:
        with self._lock:
            if self._endpoint is not None:
                return self._endpoint
            if self._start_error:
                raise TransportError(self._start_error)
            from kvstore.net.nixl.endpoint import NixlEndpoint

            try:
                ep = NixlEndpoint("server", workers=_UCX_WORKERS, threads=_UCX_THREADS, progress_thread=False)
                first = self._served.store.tiers[0]
                if not first.capabilities.host_arena:
                    raise TransportError("the first tier has no host arena to register")
                ep.register(cast(HostArena, first).arena)
            except TransportError as exc:
                self._start_error = f"NIXL could not start on the server: {exc}"
                self.counters["failures"] += 1
                log.warning("%s; serving clients over TCP", self._start_error)
                raise TransportError(self._start_error) from exc
            self._endpoint = ep
        # pre-touched, registered staging for the first puts (faulting pages in is slow here)
        size = min(_PREWARM_BYTES, self._max_inflight_bytes)
        warm = [self._take_staging(size) for _ in range(_PREWARM_BUFFERS)]
        for staging in warm:
            self._give_staging(staging)
        return ep

    # -- per connection --------------------------------------------------------------------

    def hello(self, conn: Any, metadata: bytes) -> bytes:
        """Bind ``conn`` to the client agent in ``metadata`` (or refresh it: a client
        that registered new buffers says so again). Returns the server's metadata.

        Refused with ``server.tenants``, before any peer metadata is loaded: the reply
        is the server agent's full metadata, the registered arena included, with which
        a client could READ and WRITE every tenant's hot-tier bytes. (NIXL's
        ``get_partial_agent_metadata`` can send the connection info without memory
        descriptors: the way to offer NIXL to tenants again, since the server starts
        every transfer.)"""
        if self._tenants:
            raise TransportError("NIXL is not offered with server.tenants; use TCP")
        ep = self._ensure_endpoint()
        name = ep.add_peer(metadata)
        tenant = getattr(getattr(conn, "tenant", None), "name", None)
        with self._lock:
            # A client's agent names its memory: one tenant's connection never transfers
            # through an agent another tenant's connections bound (server.tenants).
            if self._peer_tenant.get(name, tenant) != tenant:
                raise TransportError("this NIXL agent is bound to another tenant's connections")
            old = getattr(conn, "nixl_peer", None)
            if old != name:
                self._peers[name] = self._peers.get(name, 0) + 1
                self._peer_tenant[name] = tenant
                conn.nixl_peer = name
        if old is not None and old != name:
            self._unref(old)
        return ep.metadata()

    def drop(self, conn: Any) -> None:
        """The connection closed: with its last connection, forget the client's agent."""
        name = getattr(conn, "nixl_peer", None)
        if name is not None:
            conn.nixl_peer = None
            self._unref(name)

    def _unref(self, name: str) -> None:
        with self._lock:
            left = self._peers.get(name, 0) - 1
            if left > 0:
                self._peers[name] = left
                return
            self._peers.pop(name, None)
            self._peer_tenant.pop(name, None)
        if self._endpoint is not None:
            self._endpoint.remove_peer(name)

    def _remote(self, args: tuple) -> tuple[list, list[int], Any]:
        from kvstore.net.nixl.endpoint import Descs

        mem_kind, device, keys, rec = args
        rows = np.empty((len(keys), 3), dtype=np.uint64)
        rows[:, 0] = rec["addr"]
        rows[:, 1] = rec["nbytes"]
        rows[:, 2] = device
        return keys, rec["nbytes"].tolist(), Descs(_MEM[mem_kind], rows)

    def get(self, conn: Any, args: tuple) -> tuple[list[int], list[int]]:
        """WRITE the requested blocks into the client's buffers. Per key: its size when
        sent, ``MISS``, ``SIZE_MISMATCH``, or ``NOT_SENT`` (slower tier; use GET), and
        the stored checksum of each block sent (0 elsewhere), which the client verifies."""
        from kvstore.net.nixl.endpoint import Descs

        peer = self._peer_of(conn)
        keys, want, remote = self._remote(args)
        sizes = [P.MISS] * len(keys)
        store = self._served.store
        with ExitStack() as stack:
            views = stack.enter_context(self._served.borrow(keys))
            stored = store.checksums(keys)
            lower = [i for i, v in enumerate(views) if v is None]
            if lower:
                for i, held in zip(lower, store.contains([keys[i] for i in lower])):
                    sizes[i] = P.NOT_SENT if held else P.MISS
            idx, addrs = [], []
            for i, v in enumerate(views):
                if v is None:
                    continue
                if v.nbytes != want[i]:
                    sizes[i] = P.SIZE_MISMATCH
                    continue
                sizes[i] = want[i]
                idx.append(i)
                addrs.append((v.ctypes.data, v.nbytes, 0))
            if idx:
                local = Descs("DRAM", np.array(addrs, dtype=np.uint64))
                try:
                    self._endpoint.write(local, peer, remote.subset(idx))
                except TransportError as exc:
                    self._count("failures")
                    if exc.in_flight:
                        self._endpoint.keep_forever(stack.pop_all())  # UCX may still read the slots
                    raise
            with self._lock:
                self.counters["gets"] += 1
                self.counters["bytes_out"] += sum(want[i] for i in idx)
                self.counters["not_sent"] += sum(1 for s in sizes if s == P.NOT_SENT)
            # Only the checksum the block was stored with vouches for it. None means the
            # slot left the index after the borrow (evicted, or dropped as corrupt by a
            # verifying reader): 0 makes it a miss at the client, where a hash of the
            # view as it is now would vouch for whatever bytes are there.
            sums = [0] * len(keys)
            for i in idx:
                sums[i] = stored[i] or 0
        return sizes, sums

    def put(self, conn: Any, args: tuple) -> list[bool]:
        """READ the client's buffers into a staging buffer, then save."""
        from kvstore.net.nixl.endpoint import descs_of

        peer = self._peer_of(conn)
        keys, want, remote = self._remote(args)
        total = sum(want)
        limit = self._max_inflight_bytes
        if total > limit:
            raise TransportError(f"NIXL_PUT of {total} bytes exceeds max_inflight_bytes {limit}")
        staging = self._take_staging(total)
        buf, views, pos = staging[0], [], 0
        for n in want:
            views.append(buf[pos:pos + n])
            pos += n
        try:
            try:
                self._endpoint.read(descs_of(views), peer, remote)
            except TransportError as exc:
                self._count("failures")
                if exc.in_flight:  # UCX may still write this buffer: never reuse it
                    self._endpoint.keep_forever(staging)
                    staging = None
                raise
            ok = self._served.store.save(keys, views, checksums=args[3]["checksum"].tolist()).result()
        finally:
            if staging is not None:
                self._give_staging(staging)
        with self._lock:
            self.counters["puts"] += 1
            self.counters["bytes_in"] += total
        return ok

    def _take_staging(self, nbytes: int) -> tuple[np.ndarray, int]:
        """A registered, pre-touched staging buffer of at least ``nbytes`` (pooled)."""
        with self._lock:
            for i, (buf, region) in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        from kvstore.net.nixl.endpoint import staging_buffer

        buf = staging_buffer(max(nbytes, 16 << 20))
        return buf, self._endpoint.register(buf)

    def _give_staging(self, staging: tuple[np.ndarray, int]) -> None:
        with self._lock:
            self._free.append(staging)
            self._free.sort(key=lambda s: s[0].nbytes)
            spare = self._free[:-_MAX_IDLE_STAGING] if len(self._free) > _MAX_IDLE_STAGING else []
            del self._free[:len(spare)]
        for _, region in spare:  # keep the largest few; return the rest
            self._endpoint.deregister(region)

    def _peer_of(self, conn: Any) -> str:
        peer = getattr(conn, "nixl_peer", None)
        if peer is None or self._endpoint is None:
            raise TransportError("send NIXL_HELLO on this connection first")
        return peer

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            out["peers"] = len(self._peers)
        out["started"] = self._endpoint is not None
        out["error"] = self._start_error
        if self._endpoint is not None:
            out["stuck_transfers"] = self._endpoint.stuck_transfers
        return out

    def close(self) -> None:
        with self._lock:
            ep, self._endpoint = self._endpoint, None
        if ep is not None:
            ep.close()
