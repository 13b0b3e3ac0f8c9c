"""The admin HTTP port: ``GET /healthz``, ``GET /metrics`` (Prometheus text),
``GET /stats`` (JSON), ``POST /clear``, ``POST /v1/lookup`` (JSON; the cached prefix of a
prompt per tier, :mod:`kvstore.net.server._lookup`), served by aiohttp on the server's loop.

Bounds: at most :data:`MAX_CONNECTIONS` open connections, and
``server.admin.max_connections_per_ip`` from one address (more are closed at accept);
a request's head must arrive within :data:`HEAD_TIMEOUT_S` of the connection (or of the
previous reply on a kept-alive one), its body within :data:`BODY_TIMEOUT_S`; header
lines, fields and counts are capped by aiohttp's parser, bodies at
``server.admin.max_body_bytes``, a lookup at ``server.admin.lookup_max_tokens``. A
malformed request is a 400 logged in one line, never a traceback; a failing handler is a
503 naming the error.

Work off the loop (``/metrics``, ``/stats``, ``/clear``, lookups) runs on the port's own
``server.admin.threads`` threads, never on the loop's default executor the data plane
uses; past ``threads + queue`` requests at once the next is a 503 with ``Retry-After``.
``/healthz`` is answered on the loop ahead of everything else: no token, no Host check,
no thread.

With a server token or tenants, ``/stats``, ``/clear`` and ``/v1/lookup`` need
``Authorization: Bearer <token>``: a tenant's token scopes them to that tenant (its
stats, its blocks, its key space; see :mod:`kvstore.net.server._tenants`);
``/healthz`` and ``/metrics`` stay open so probes and scrapers need no secret. Without
one (the default, loopback only), a request whose ``Host`` names neither this machine's
loopback nor the bound host is a 421 (a web page that rebinds its name to 127.0.0.1
cannot reach the port). ``POST /clear`` needs ``Content-Type: application/json`` (415
otherwise), which a web page cannot send across origins without the CORS preflight this
port never answers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from kvstore.config import AIOHTTP_MISSING, AdminConfig
from kvstore.errors import ConfigError
from kvstore.net.server import _lookup
from kvstore.net.server._metrics import ServerMetrics
from kvstore.net.server._tenants import Tenant, Tenants, admin_clear

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("kvstore.server")
HEAD_TIMEOUT_S = 5.0      # from accept (or the last reply) to a complete request head
BODY_TIMEOUT_S = 30.0     # from the head to the whole body
MAX_CONNECTIONS = 128     # open at once (probes, scrapers, routers); more are closed at accept
_SECURED = frozenset({"/stats", "/clear", "/v1/lookup"})
_NOT_FOUND = b"not found; try /healthz, /metrics, /stats, POST /clear, POST /v1/lookup\n"
_TENANT_KEY = "kvstore.tenant"   # request key: the bearer's tenant, set by the guard on secured paths
_ALLOWED = {"/healthz": "GET", "/metrics": "GET", "/stats": "GET", "/clear": "POST", "/v1/lookup": "POST"}
_STATE_CHANGING = frozenset({"/clear"})   # need a JSON content type: a cross-origin form cannot send one
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def require_aiohttp() -> Any:
    """``aiohttp.web``, or a :class:`ConfigError` saying the admin port needs it."""
    try:
        from aiohttp import web
    except ImportError:
        raise ConfigError(AIOHTTP_MISSING) from None
    return web


@dataclass(frozen=True)
class AdminContext:
    """What the admin port uses of its server: the served ``store`` (``/clear``,
    ``/v1/lookup``), its ``metrics`` (``/metrics``, refused connections), its
    ``tenants`` (bearer tokens), ``stats(tenant)`` (``/stats``) and ``closing()``
    (``/healthz`` is 503 once shutdown began), ``limits`` (``server.admin``) and the
    bound ``host`` (the Host check of a token-less server). ``stats`` and ``closing``
    are called per request, from the loop (``stats`` on the admin port's threads)."""

    store: Any
    metrics: ServerMetrics
    tenants: Tenants
    stats: Callable[[Tenant | None], dict[str, Any]]
    closing: Callable[[], bool]
    limits: AdminConfig = AdminConfig()
    host: str = "127.0.0.1"


class _Opening:
    """An accepted socket on its way into aiohttp: the handler aiohttp made for it, once made."""

    __slots__ = ("handler", "ip")

    def __init__(self, ip: str) -> None:
        self.handler: Any = None
        self.ip = ip


class AdminServer:
    """The admin port over ``context``: :meth:`start` listens, :meth:`close` stops."""

    def __init__(self, context: AdminContext) -> None:
        self._ctx = context
        self._web = require_aiohttp()
        # aiohttp >= 3.12 warns about plain str request keys (NotAppKeyWarning)
        request_key = getattr(self._web, "RequestKey", None)
        self._tenant = request_key(_TENANT_KEY, Tenant) if request_key is not None else _TENANT_KEY
        self._runner: Any = None
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._connecting: dict[asyncio.Future, _Opening] = {}   # accepted, not yet (or just) listed by aiohttp
        limits = context.limits
        self._pool = ThreadPoolExecutor(limits.threads, thread_name_prefix="kvstore-admin")
        self._room = limits.threads + limits.queue   # requests on or waiting for the pool
        self._busy = 0
        self._hosts = _own_names(context.host)

    async def start(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (HTTPS with ``ssl_context``); returns the bound port."""
        web = self._web
        app = web.Application(client_max_size=self._ctx.limits.max_body_bytes, middlewares=[self._guard()],
                              handler_args={"keepalive_timeout": HEAD_TIMEOUT_S, "lingering_time": 2.0,
                                            "logger": _BadRequestLogger(logging.getLogger("aiohttp.server"))})
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/clear", self._clear)
        app.router.add_post("/v1/lookup", self._lookup)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        try:
            self._sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=128)
        except BaseException:
            await self.close()
            raise
        self._sock.setblocking(False)
        self._accepting = asyncio.create_task(self._accept(self._sock, ssl_context))
        return self._sock.getsockname()[1]

    async def close(self) -> None:
        """Stop listening at once; requests in progress get a second to finish."""
        if self._accepting is not None:
            self._accepting.cancel()
            self._accepting = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for task in list(self._connecting):
            task.cancel()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _accept(self, lsock: socket.socket, ssl_context: ssl.SSLContext | None) -> None:
        """Accept connections into aiohttp's protocol, at most :data:`MAX_CONNECTIONS`
        open at once and ``max_connections_per_ip`` from one address (more are closed
        at accept, counted), so a flood of them cannot take the process's file
        descriptors, nor one address every slot (and the probes' ``/healthz``)."""
        loop = asyncio.get_running_loop()
        protocols = self._runner.server
        per_ip = self._ctx.limits.max_connections_per_ip
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except OSError as exc:
                log.warning("admin port: accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            # each connection counts once: a socket still on its way in is counted until
            # aiohttp lists its handler (a task ends a loop step or more after that)
            live = protocols.connections
            opening = [p for p in self._connecting.values() if p.handler is None or p.handler not in live]
            ip = addr[0] if isinstance(addr, tuple) else ""
            reason = None
            if len(live) + len(opening) >= MAX_CONNECTIONS:
                reason = "admin_max_connections"
            elif sum(1 for h in live if _peer_ip(h) == ip) + sum(1 for p in opening if p.ip == ip) >= per_ip:
                reason = "admin_max_connections_per_ip"
            if reason is not None:
                self._ctx.metrics.refused.labels(reason).inc()
                sock.close()
                continue
            pending = _Opening(ip)
            task = asyncio.ensure_future(self._serve(loop, protocols, pending, sock, ssl_context))
            self._connecting[task] = pending
            task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Future) -> None:
        self._connecting.pop(task, None)

    @staticmethod
    async def _serve(loop: asyncio.AbstractEventLoop, protocols: Any, pending: "_Opening", sock: socket.socket,
                     ssl_context: ssl.SSLContext | None) -> None:
        def handler() -> Any:
            pending.handler = protocols()
            return pending.handler

        try:
            if ssl_context is None:
                await loop.connect_accepted_socket(handler, sock)
            else:
                await loop.connect_accepted_socket(handler, sock, ssl=ssl_context,
                                                   ssl_handshake_timeout=HEAD_TIMEOUT_S)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as exc:
            log.debug("admin port: connection dropped before its first request: %s", exc)
            sock.close()

    # -- middleware: token, errors ----------------------------------------------------------

    def _guard(self) -> Callable[..., Awaitable[Any]]:
        web = self._web

        @web.middleware
        async def guard(request: "web.Request", handler: Callable[..., Awaitable[Any]]) -> "web.StreamResponse":
            if request.path == "/healthz":       # ahead of everything: probes carry no token, any Host
                return await self._guarded(request, handler)
            if self._ctx.tenants.open:
                refused = self._foreign_host(request.headers.get("Host"))
                if refused is not None:
                    return web.Response(status=421, text=refused)
            if request.path in _SECURED:
                # every tenant's token tried, each in constant time; open servers: the one tenant
                tenant = self._ctx.tenants.bearer(request.headers.get("Authorization", ""))
                if tenant is None:
                    return web.Response(status=401, text="missing or wrong bearer token\n",
                                        headers={"WWW-Authenticate": 'Bearer realm="kvstore"'})
                request[self._tenant] = tenant
            if request.method == "POST" and request.path in _STATE_CHANGING \
                    and request.content_type != "application/json":
                return web.Response(status=415, text=f"POST {request.path} needs Content-Type: application/json "
                                                     f"(got {_shown(request.headers.get('Content-Type'))})\n")
            return await self._guarded(request, handler)

        return guard

    async def _guarded(self, request: "web.Request", handler: Callable[..., Awaitable[Any]]) -> "web.StreamResponse":
        web = self._web
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return web.Response(status=404, body=_NOT_FOUND, content_type="text/plain")
        except web.HTTPMethodNotAllowed as exc:
            return web.Response(status=405, text=f"use {_ALLOWED.get(request.path, exc.allowed_methods)}\n",
                                headers={"Allow": ", ".join(sorted(exc.allowed_methods))})
        except _Busy as exc:
            return web.Response(status=503, text=f"{exc}\n", headers={"Retry-After": "1"})
        except (web.HTTPException, ConnectionError):
            raise
        except Exception as exc:  # report, never kill the admin port
            log.exception("admin request %s %s failed", request.method, request.path)
            return web.Response(status=503, text=f"{exc}\n")

    def _foreign_host(self, header: str | None) -> str | None:
        """Why a token-less server refuses a request with this ``Host`` (``None``: it
        names loopback or the bound host; a request without one is no browser's)."""
        if header is None:
            return None
        name = _host_name(header)
        if name in self._hosts or name == "localhost" or name.endswith(".localhost"):
            return None
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            ip = None
        if ip is not None and (ip.is_loopback or self._ctx.host in _WILDCARDS):
            return None
        return (f"Host {_shown(header)} does not name this admin port (bound to {self._ctx.host}); a server "
                "without server.token answers only requests addressed to localhost, a loopback address or "
                "its bound host\n")

    async def _offloaded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the admin port's threads; :class:`_Busy` when
        ``threads + queue`` requests are there already."""
        if self._busy >= self._room:
            self._ctx.metrics.refused.labels("admin_busy").inc()
            raise _Busy(f"admin port busy: {self._busy} requests in progress (server.admin.threads "
                        f"{self._ctx.limits.threads}, queue {self._ctx.limits.queue}); retry")
        self._busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._busy -= 1

    # -- endpoints ------------------------------------------------------------------------

    async def _healthz(self, request: "web.Request") -> "web.Response":
        if self._ctx.closing():
            return self._web.Response(status=503, text="shutting down\n")
        return self._web.Response(text="ok\n")

    async def _metrics(self, request: "web.Request") -> "web.Response":
        body = await self._offloaded(self._ctx.metrics.render)
        return self._web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _stats(self, request: "web.Request") -> "web.Response":
        stats = await self._offloaded(self._ctx.stats, request[self._tenant])
        return self._json(200, stats)

    async def _clear(self, request: "web.Request") -> "web.Response":
        removed = await self._offloaded(admin_clear, self._ctx.store, request[self._tenant])
        return self._json(200, {"removed": removed})

    async def _lookup(self, request: "web.Request") -> "web.Response":
        length = request.content_length
        if length is None:
            return self._json(411, {"error": "a Content-Length header is required"})
        limit = self._ctx.limits.max_body_bytes
        if length > limit:
            return self._json(413, {"error": f"body over {limit} bytes (server.admin.max_body_bytes)"})
        try:
            body = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            return self._json(408, {"error": f"body not received within {BODY_TIMEOUT_S:g} s"}, close=True)
        tenant: Tenant = request[self._tenant]

        def answer() -> dict[str, Any]:
            return _lookup.answer(self._ctx.store, body, lambda keys: tenant.keys(keys, cached=False),
                                  max_tokens=self._ctx.limits.lookup_max_tokens)

        try:
            answer = await self._offloaded(answer)
        except _lookup.LookupTooLarge as exc:
            return self._json(413, {"error": str(exc)})
        except _lookup.BadLookup as exc:
            return self._json(400, {"error": str(exc)})
        return self._json(200, answer)

    def _json(self, status: int, value: Any, *, close: bool = False) -> "web.Response":
        headers = {"Connection": "close"} if close else None
        return self._web.Response(status=status, body=json.dumps(value, default=str).encode(),
                                  content_type="application/json", headers=headers)


class _Busy(Exception):
    """Every admin thread is taken and the queue full: a 503 with ``Retry-After``."""


def _peer_ip(handler: Any) -> str | None:
    transport = getattr(handler, "transport", None)
    peer = transport.get_extra_info("peername") if transport is not None else None
    return peer[0] if isinstance(peer, tuple) else None


def _host_name(header: str) -> str:
    """The name (or address) of a ``Host`` header, lower case, without port or brackets."""
    text = header.strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    if text.count(":") == 1:
        text = text.split(":", 1)[0]
    return text.rstrip(".")


def _own_names(host: str) -> frozenset[str]:
    """The names a request to this port may carry beside loopback ones: the bound host
    and, bound to every address, this machine's name."""
    names = {host.lower().strip("[]")}
    if host in _WILDCARDS:
        names.add(socket.gethostname().lower())
    return frozenset(names)


def _shown(value: str | None, limit: int = 80) -> str:
    """A header value for a message: quoted, at most ``limit`` characters."""
    if value is None:
        return "none"
    return repr(value if len(value) <= limit else value[:limit] + "…")



class _BadRequestLogger(logging.LoggerAdapter):
    """aiohttp logs a request it cannot parse with its traceback; here that is one line
    (the peer, the parser's message) at DEBUG at most: such a request is the peer's fault."""

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kwargs: Any) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        if isinstance(exc_info, HttpProcessingError):
            log.log(min(level, logging.DEBUG), "admin: bad request from %s: %s", args[0] if args else "?",
                    exc_info.message or type(exc_info).__name__)
        else:
            self.logger.log(level, msg, *args, exc_info=exc_info, **kwargs)


__all__ = ["AdminContext", "AdminServer", "BODY_TIMEOUT_S", "HEAD_TIMEOUT_S", "MAX_CONNECTIONS", "require_aiohttp"]
