"""The cache server: one Store, a TCP listener, an optional Unix socket for same-host
control traffic, the admin HTTP port, and graceful shutdown.

Threading: the network runs on one asyncio loop (uvloop when installed); Store work that
can block runs on the Store's own pool or the loop's default executor. ``Server`` methods
other than :meth:`request_shutdown` must be called on the loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import signal
import socket
import tempfile
import time
from typing import Any, Iterator

from kvstore import __version__
from kvstore.config import DramTierConfig, StoreConfig, preflight
from kvstore.config.base import format_size
from kvstore.errors import ConfigError
from kvstore.net import protocol as P
from kvstore.net.server._admin import (MAX_CONNECTIONS as ADMIN_MAX_CONNECTIONS, AdminContext, AdminServer,
                                      require_aiohttp)
from kvstore.net.server._budget import TenantBudgets
from kvstore.net.server._conn import Connection
from kvstore.net.server._landing import Landing
from kvstore.net.server._context import ConnContext
from kvstore.net.server._metrics import ServerMetrics
from kvstore.net.server._paths import (ARENA_PREFIX, SHM_DIR, is_loopback, remove_stale_arenas, remove_stale_sockets,
                                   take_socket_path)
from kvstore.net.server._nixl import NixlService
from kvstore.net.server._send import Sender
from kvstore.net.server._served import ServedStore
from kvstore.net.server._shm import Arena
from kvstore.net.server._tenants import Tenant, Tenants

log = logging.getLogger("kvstore.server")


def build_store(config: StoreConfig) -> Any:
    """The Store to serve. With shared memory enabled (``transport`` auto or shm) and a
    first DRAM tier without ``shm_path``, that arena is placed under ``/dev/shm`` so
    local clients can map it."""
    from kvstore.store.build import build_tier, header_frames
    from kvstore.store import Store
    from kvstore.tiers.dram import DramTier

    first = config.tiers[0]
    if config.server.transport in ("auto", "shm") and isinstance(first, DramTierConfig) and not first.shm_path \
            and not config.server.tenants:   # tenants: the arena stays private to the server
        remove_stale_arenas()
        path = f"{SHM_DIR}/{ARENA_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        log.info("tier %s (dram, %s): arena in shared memory at %s, offered to same-host clients", first.name,
                 format_size(first.capacity), path)
        tiers = [DramTier(first.capacity, name=first.name, shm_path=path, pin=first.pin,
                          header_frames=header_frames(config.tiers, 0))]
        try:
            tiers += [build_tier(c, header_frames=header_frames(config.tiers, i))
                      for i, c in enumerate(config.tiers[1:], 1)]
        except BaseException:
            for t in tiers:
                t.close()
            raise
        return Store(config, tiers=tiers)
    return Store(config)


class Server:
    """Serves ``store`` (built from ``config`` when not given; the server then owns it)."""

    def __init__(self, config: StoreConfig, *, store: Any = None) -> None:
        self.config = config
        cfg = config.server
        preflight(config)   # what `kvstore config validate` checks too: the host/token rule, tier paths, ...
        self.tenants = Tenants(cfg)
        # TLS on the TCP listener and the admin port (the Unix socket stays plaintext:
        # same-host, private to this user). Built before anything listens: a bad file
        # stops the start with a ConfigError.
        self.tls_context = _tls_context(cfg)
        if cfg.admin_port is not None:
            require_aiohttp()   # before any resource: a missing aiohttp is a ConfigError
        self._owns_store = store is None
        self.store = store if store is not None else build_store(config)
        try:
            self._setup(cfg)
        except BaseException:
            if self._owns_store:
                self.store.close()   # the arena under /dev/shm, the tiers' files and locks
            raise

    def _setup(self, cfg: Any) -> None:
        if self.tenants.enabled:
            self._attach_tenants()
        self.limits = P.Limits(cfg.max_frame_bytes, cfg.max_batch)
        first = self.store.tiers[0]
        # Zero-copy sends, shared memory and NIXL need the first tier to be host memory.
        self.served = ServedStore(self.store)
        # With tenants the arena is never offered (HELLO names none, SHM_* ops are refused):
        # a process that maps it reads and writes every tenant's hot-tier bytes. Tenants'
        # same-host clients take the copy path (TCP or the Unix socket).
        self.arena = Arena.of(first) if cfg.transport in ("auto", "shm") and self.served.borrowable \
            and not self.tenants.enabled else None
        self.metrics = ServerMetrics(self.store, self.tenants.stats if self.tenants.enabled else None)
        self.nixl = NixlService(self.served, transport=cfg.transport, tenants=self.tenants.enabled,
                                max_inflight_bytes=cfg.max_inflight_bytes)
        self.sender = Sender(cfg.send_threads, cfg.idle_timeout_s)
        # every connection's scratch buffer, from its tenant's share
        self.buffers = TenantBudgets(cfg.max_inflight_bytes_total, [t.name for t in self.tenants.all])
        self.max_connections = cfg.max_connections                # lowered at start to fit the fd limit
        self.conns: set[Connection] = set()
        # not yet authenticated, oldest first (at most max_unauthenticated_connections)
        self.unauthed: dict[Connection, None] = {}
        self.closing = False
        self.port = 0
        self.admin_port: int | None = None
        self.socket_path: str | None = None
        self._listeners: list[socket.socket] = []
        self._tasks: list[asyncio.Task] = []
        self._stopped: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started = time.time()
        # Names this server instance in every HELLO: a same-host client checks that the
        # server behind the Unix socket is the one whose arena it mapped.
        self.instance_id = secrets.token_hex(8)
        self._admin = AdminServer(self.admin_context()) if cfg.admin_port is not None else None
        self.landing = Landing(self.store)   # LOOKUP_WAIT: woken by the saves that land the keys
        self._conn_context = ConnContext(
            served=self.served, metrics=self.metrics, tenants=self.tenants, limits=self.limits,
            max_inflight_bytes=cfg.max_inflight_bytes, idle_timeout_s=cfg.idle_timeout_s,
            tls_context=self.tls_context, sender=self.sender, buffers=self.buffers, nixl=self.nixl,
            arena=self.arena, hello_info=self.hello_info, stats=self.stats, reclaim_buffers=self.reclaim_buffers,
            authenticated=lambda conn: self.unauthed.pop(conn, None), closing=lambda: self.closing,
            forget=self._forget, landing=self.landing)

    def admin_context(self) -> AdminContext:
        """What an admin port (:class:`AdminServer`) serves of this server. ``stats`` is
        looked up on this server at each request."""
        cfg = self.config.server
        return AdminContext(store=self.store, metrics=self.metrics, tenants=self.tenants,
                            stats=lambda tenant: self.stats(tenant), closing=lambda: self.closing,
                            limits=cfg.admin, host=cfg.host)

    def _attach_tenants(self) -> None:
        """Bytes per tenant and tier, and the quotas, kept by the Store's eviction."""
        set_tenants = getattr(self.store, "set_tenants", None)
        if set_tenants is None:
            raise ConfigError("server.tenants: the served store keeps no per-tenant accounting "
                              f"({type(self.store).__name__} has no set_tenants)")
        set_tenants(self.tenants.ledger([t.name for t in self.store.tiers]))

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config.server
        self._loop = asyncio.get_running_loop()
        self.max_connections = _fit_fd_limit(cfg.max_connections)
        # Whether NIXL imports is probed (seconds, once per process) before anyone
        # connects: in the first HELLO it held the loop while other connections' handshake
        # deadlines ran out.
        await self._loop.run_in_executor(None, self.nixl.offered)
        self._stopped = asyncio.Event()
        try:
            await self._listen()
        except BaseException:            # e.g. a socket path or admin port taken: listen on nothing
            for t in self._tasks:
                t.cancel()
            for sock in self._listeners:
                sock.close()
            if self.socket_path:
                os.unlink(self.socket_path)
                self.socket_path = None
            if self._admin is not None:
                await self._admin.close()
            raise

    async def _listen(self) -> None:
        cfg = self.config.server
        with _naming("server.port", f"{cfg.host}:{cfg.port}"):
            tcp = socket.create_server((cfg.host, cfg.port), family=_family(cfg.host), backlog=256,
                                       reuse_port=False)
        tcp.setblocking(False)
        self.port = tcp.getsockname()[1]
        self._listeners.append(tcp)
        self._tasks.append(asyncio.create_task(self._accept(tcp, unix=False)))
        if cfg.socket_path or self.arena is not None:
            if not cfg.socket_path:
                remove_stale_sockets(tempfile.gettempdir())
            path = cfg.socket_path or os.path.join(tempfile.gettempdir(), f"kvstore-{self.port}-{os.getpid()}.sock")
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listeners.append(unix)
            with _naming("server.socket_path", path):
                take_socket_path(path)
                unix.bind(path)
            self.socket_path = path
            os.chmod(path, 0o600)
            unix.listen(256)
            unix.setblocking(False)
            self._tasks.append(asyncio.create_task(self._accept(unix, unix=True)))
        if self._admin is not None:
            with _naming("server.admin_port", f"{cfg.host}:{cfg.admin_port}"):
                self.admin_port = await self._admin.start(cfg.host, cfg.admin_port, ssl_context=self.tls_context)
        self._tasks.append(asyncio.create_task(self._reap()))
        log.info("listening: tcp %s:%d%s, unix socket %s, admin %s", cfg.host, self.port,
                 " (TLS)" if self.tls_context is not None else "", self.socket_path,
                 f"{cfg.host}:{self.admin_port}" if self.admin_port is not None else "off")

    def abandon(self) -> None:
        """Release what a server that never started holds (its threads, and the Store it
        built: the arena under ``/dev/shm``, tier files and locks)."""
        self.nixl.close()
        self.sender.close()
        if self._owns_store:
            self.store.close()

    async def wait_closed(self) -> None:
        await self._stopped.wait()

    def request_shutdown(self) -> None:
        """Begin a graceful shutdown; safe from signal handlers and other threads."""
        loop = self._loop
        if loop is not None and not self.closing:
            grace = self.config.server.shutdown_grace_s
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.shutdown(grace)))

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting, let requests in progress finish (up to ``grace_s``), release
        leases, flush volatile blocks to persistent tiers, and close the Store."""
        if self.closing:
            return
        self.closing = True
        for t in self._tasks:
            t.cancel()
        for s in self._listeners:
            s.close()
        if self.socket_path:
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        admin = asyncio.ensure_future(self._admin.close()) if self._admin is not None else None
        self.landing.close()    # lookups waiting for keys answer now
        idle = [c for c in self.conns if not c.busy and c.task is not None]
        for c in idle:
            c.task.cancel()
        pending = [c.task for c in list(self.conns) if c.task is not None]
        if pending:
            _, late = await asyncio.wait(pending, timeout=grace_s)
            for t in late:
                t.cancel()
        for c in list(self.conns):
            c.close()
        self.nixl.close()  # deregisters the arena before the Store unmaps it
        self.sender.close()
        if admin is not None:
            await admin          # listener closed at once; requests in progress get 1 s
        if self._owns_store:
            await asyncio.get_running_loop().run_in_executor(None, self._close_store)
        elif self.tenants.enabled:
            self.store.set_tenants(None)   # a Store that outlives this server keeps no tenants of it
        self._stopped.set()

    def _close_store(self) -> None:
        try:
            self.store.flush()   # logs how many blocks it kept, and dropped
        except Exception:
            log.exception("flush at shutdown failed")
        self.store.close()

    # -- connections -------------------------------------------------------------------------

    async def _accept(self, lsock: socket.socket, *, unix: bool) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            reason = None
            if len(self.conns) >= self.max_connections and not self.unauthed:
                reason = "max_connections"   # every slot is an authenticated session's
            elif not unix and sum(c.peer_ip == addr[0] for c in self.conns) >= \
                    self.config.server.max_connections_per_ip:
                reason = "max_connections_per_ip"   # one address cannot take every slot
            if reason is not None:
                self.metrics.refused.labels(reason).inc()   # counted before the peer can see the close
                sock.close()                 # closed before anything is read or allocated
                continue
            dropped = False
            if len(self.conns) >= self.max_connections or \
                    len(self.unauthed) >= self.config.server.max_unauthenticated_connections:
                dropped = self._drop_oldest_unauthenticated()
            sock.setblocking(False)
            if not unix:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = "unix" if unix else f"{addr[0]}:{addr[1]}"
            local = unix or is_loopback(addr[0])
            conn = Connection(self._conn_context, sock, peer, local)
            conn.peer_ip = None if unix else addr[0]
            self.conns.add(conn)
            self.unauthed[conn] = None
            conn.task = asyncio.create_task(conn.run())
            if dropped:
                await asyncio.sleep(0)   # the dropped one's task closes its socket now: a flood holds no extra fds

    def _drop_oldest_unauthenticated(self) -> bool:
        """Room for a new connection: the oldest connection that has not authenticated is
        closed (a real client authenticates in a round trip or two; a silent one only
        holds a slot), so silent connections never lock authenticated clients out. The
        oldest of the address holding the most of them: silent connections reopened as
        fast as they are closed then push out their own address's, never a client's
        handshake from an address with fewer in progress."""
        counts = collections.Counter(c.peer_ip for c in self.unauthed)
        most = max(counts.values())
        victim = next(c for c in self.unauthed if counts[c.peer_ip] == most)
        self._forget(victim)              # its slot is free now; the task closes the socket
        log.debug("closing connection %s: max_unauthenticated_connections", victim.peer)
        self.metrics.refused.labels("max_unauthenticated_connections").inc()
        if victim.task is not None:
            victim.task.cancel()
        return True

    def _forget(self, conn: Connection) -> None:
        self.conns.discard(conn)
        self.unauthed.pop(conn, None)

    async def _reap(self) -> None:
        cfg = self.config.server
        period = min(1.0, cfg.idle_timeout_s / 4, cfg.shm_lease_s / 4, cfg.handshake_timeout_s / 4,
                     cfg.read_timeout_s / 4, cfg.min_body_rate_grace_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for c in list(self.conns):
                c.expire_leases(cfg.shm_lease_s)
                if c.task is None or c.task.done():
                    continue
                if not c.authed and now - c.accepted > cfg.handshake_timeout_s:
                    reason = "handshake_timeout"     # never authenticated: holds no more than a HELLO
                elif c.stalled_since is not None and now - c.stalled_since > cfg.read_timeout_s:
                    reason = "read_timeout"          # a frame's body or payload stopped arriving
                elif c.below_min_rate(now, cfg.min_body_rate_bytes_s, cfg.min_body_rate_grace_s):
                    reason = "min_body_rate"         # it trickles: each byte in time, the frame not
                elif not c.busy and now - c.last_active > cfg.idle_timeout_s:
                    reason = "idle"
                else:
                    continue
                log.debug("closing connection %s: %s", c.peer, reason)
                self.metrics.refused.labels(reason).inc()
                c.task.cancel()

    # -- helpers for connections ---------------------------------------------------------------

    def reclaim_buffers(self, tenant: Tenant | None = None) -> None:
        """``tenant``'s idle connections (every idle one for None) drop the scratch
        buffers they keep between requests (its share is short: someone waits for it)."""
        for c in self.conns:
            if not c.busy and (tenant is None or c.tenant is tenant):
                c.drop_buffer()

    def hello_info(self, local: bool, tenant: Tenant | None = None) -> dict[str, Any]:
        return {"server": "kvstore", "version": __version__, "protocol": P.VERSION, "instance": self.instance_id,
                "tenant": tenant.name if tenant is not None and self.tenants.enabled else None,
                "max_frame_bytes": self.limits.max_frame_bytes, "max_batch": self.limits.max_batch,
                "max_inflight_bytes": self.config.server.max_inflight_bytes,
                "shm": self.arena.describe() if self.arena is not None and local else None,
                "socket_path": self.socket_path if local else None,
                "nixl": self.nixl.offered(), "lookup_wait": hasattr(self.store, "add_landed_listener")}

    def stats(self, tenant: Tenant | None = None) -> dict[str, Any]:
        """The Store's stats and the server's; with tenants, a ``tenants`` section (only
        ``tenant``'s own entry when given, unless it is the operator's)."""
        out = self.store.stats()
        if self.tenants.enabled:
            out["tenants"] = self.tenants.stats(out.get("tenants", {}), tenant)
        out["server"] = {"version": __version__, "uptime_s": round(time.time() - self.started, 3),
                         "connections": len(self.conns), "unauthenticated_connections": len(self.unauthed),
                         "leased_bytes": sum(c.leased_bytes for c in self.conns),
                         "buffer_bytes": self.buffers.used, "buffer_waits": self.buffers.waits,
                         "shm": self.arena.path if self.arena else None, "port": self.port,
                         "admin_port": self.admin_port, "socket_path": self.socket_path,
                         "tls": self.tls_context is not None,
                         "nixl": self.nixl.stats()}
        return out


def _tls_context(cfg: Any) -> Any:
    if cfg.tls is None:
        return None
    try:
        ctx = cfg.tls.context()
        mode = os.stat(cfg.tls.key).st_mode
    except (ValueError, OSError) as exc:   # a file changed since the config was validated
        raise ConfigError(f"server.tls: {exc}") from None
    if mode & 0o077:
        log.warning("server.tls.key %s can be read by other users (mode %o); chmod 600 it", cfg.tls.key,
                    mode & 0o777)
    return ctx


_FD_RESERVE = 256   # descriptors beside client connections: tier files, the index, pipes, threads


def _fit_fd_limit(max_connections: int) -> int:
    """Raise the soft file-descriptor limit (up to the hard one) so ``max_connections``
    client connections, the admin port's and the Store's own files all fit; when they
    cannot, accept fewer client connections (warned), so a connection flood is closed
    at accept instead of leaving the process without descriptors (no new client, no
    ``/healthz``)."""
    import resource

    want = max_connections + ADMIN_MAX_CONNECTIONS + _FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.debug("file-descriptor limit raised from %d to %d", soft, target)
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the file-descriptor limit to %d: %s", target, exc)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return max_connections
    fitted = max(1, soft - ADMIN_MAX_CONNECTIONS - _FD_RESERVE)
    log.warning("server.max_connections %d does not fit the file-descriptor limit %d (hard %d): accepting %d "
                "client connections at most; raise the limit (ulimit -n) to serve more", max_connections, soft,
                hard, fitted)
    return fitted


@contextlib.contextmanager
def _naming(setting: str, address: str) -> Iterator[None]:
    """An OSError while binding names the setting and the address (one line)."""
    try:
        yield
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise OSError(exc.errno, f"{setting}: cannot listen on {address}: {reason}") from exc


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


async def _main(config: StoreConfig, ready: Any) -> None:
    server = Server(config)
    try:
        await server.start()
    except BaseException:
        server.abandon()
        raise
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_shutdown)
    if ready is not None:
        ready(server)
    await server.wait_closed()


def run_server(config: StoreConfig, ready: Any = None) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully. ``ready(server)`` is called
    once listening (the CLI prints the addresses from it)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(_main(config, ready))
    else:
        uvloop.run(_main(config, ready))
