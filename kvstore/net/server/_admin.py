"""The admin HTTP port: ``GET /healthz``, ``GET /metrics`` (Prometheus text),
``GET /stats`` (JSON), ``POST /clear``, ``POST /v1/lookup`` (JSON; the cached prefix of a
prompt per tier, :mod:`kvstore.net.server._lookup`), served by aiohttp on the server's loop.

Bounds: at most :data:`MAX_CONNECTIONS` open connections (more are closed at accept);
a request's head must arrive within :data:`HEAD_TIMEOUT_S` of the connection (or of the
previous reply on a kept-alive one), its body within :data:`BODY_TIMEOUT_S`; header
lines, fields and counts are capped by aiohttp's parser, bodies at
:data:`kvstore.net.server._lookup.MAX_BODY_BYTES`. A malformed request is a 400 logged in one
line, never a traceback; a failing handler is a 503 naming the error.

With a server token or tenants, ``/stats``, ``/clear`` and ``/v1/lookup`` need
``Authorization: Bearer <token>``: a tenant's token scopes them to that tenant (its
stats, its blocks, its key space; see :mod:`kvstore.net.server._tenants`);
``/healthz`` and ``/metrics`` stay open so probes and scrapers need no secret.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from kvstore.config import AIOHTTP_MISSING
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
    (``/healthz`` is 503 once shutdown began). ``stats`` and ``closing`` are called
    per request, from the loop (``stats`` in its executor)."""

    store: Any
    metrics: ServerMetrics
    tenants: Tenants
    stats: Callable[[Tenant | None], dict[str, Any]]
    closing: Callable[[], bool]


class _Opening:
    """An accepted socket on its way into aiohttp: the handler aiohttp made for it, once made."""

    __slots__ = ("handler",)

    def __init__(self) -> None:
        self.handler: Any = None


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

    async def start(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (HTTPS with ``ssl_context``); returns the bound port."""
        web = self._web
        app = web.Application(client_max_size=_lookup.MAX_BODY_BYTES, middlewares=[self._guard()],
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

    async def _accept(self, lsock: socket.socket, ssl_context: ssl.SSLContext | None) -> None:
        """Accept connections into aiohttp's protocol, at most :data:`MAX_CONNECTIONS`
        open at once (more are closed at accept, counted), so a flood of them cannot
        take the process's file descriptors."""
        loop = asyncio.get_running_loop()
        protocols = self._runner.server
        while True:
            try:
                sock, _ = await loop.sock_accept(lsock)
            except OSError as exc:
                log.warning("admin port: accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            # each connection counts once: a socket still on its way in is counted until
            # aiohttp lists its handler (a task ends a loop step or more after that)
            live = protocols.connections
            opening = sum(1 for p in self._connecting.values() if p.handler is None or p.handler not in live)
            if len(live) + opening >= MAX_CONNECTIONS:
                self._ctx.metrics.refused.labels("admin_max_connections").inc()
                sock.close()
                continue
            pending = _Opening()
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
            if request.path in _SECURED:
                # every tenant's token tried, each in constant time; open servers: the one tenant
                tenant = self._ctx.tenants.bearer(request.headers.get("Authorization", ""))
                if tenant is None:
                    return web.Response(status=401, text="missing or wrong bearer token\n",
                                        headers={"WWW-Authenticate": 'Bearer realm="kvstore"'})
                request[self._tenant] = tenant
            try:
                return await handler(request)
            except web.HTTPNotFound:
                return web.Response(status=404, body=_NOT_FOUND, content_type="text/plain")
            except web.HTTPMethodNotAllowed as exc:
                return web.Response(status=405, text=f"use {_ALLOWED.get(request.path, exc.allowed_methods)}\n",
                                    headers={"Allow": ", ".join(sorted(exc.allowed_methods))})
            except (web.HTTPException, ConnectionError):
                raise
            except Exception as exc:  # report, never kill the admin port
                log.exception("admin request %s %s failed", request.method, request.path)
                return web.Response(status=503, text=f"{exc}\n")

        return guard

    # -- endpoints ------------------------------------------------------------------------

    async def _healthz(self, request: "web.Request") -> "web.Response":
        if self._ctx.closing():
            return self._web.Response(status=503, text="shutting down\n")
        return self._web.Response(text="ok\n")

    async def _metrics(self, request: "web.Request") -> "web.Response":
        body = await asyncio.get_running_loop().run_in_executor(None, self._ctx.metrics.render)
        return self._web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _stats(self, request: "web.Request") -> "web.Response":
        stats = await asyncio.get_running_loop().run_in_executor(None, self._ctx.stats, request[self._tenant])
        return self._json(200, stats)

    async def _clear(self, request: "web.Request") -> "web.Response":
        removed = await asyncio.get_running_loop().run_in_executor(None, admin_clear, self._ctx.store,
                                                                   request[self._tenant])
        return self._json(200, {"removed": removed})

    async def _lookup(self, request: "web.Request") -> "web.Response":
        length = request.content_length
        if length is None:
            return self._json(411, {"error": "a Content-Length header is required"})
        if length > _lookup.MAX_BODY_BYTES:
            return self._json(413, {"error": f"body over {_lookup.MAX_BODY_BYTES} bytes"})
        try:
            body = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            return self._json(408, {"error": f"body not received within {BODY_TIMEOUT_S:g} s"}, close=True)
        try:
            tenant: Tenant = request[self._tenant]
            answer = await asyncio.get_running_loop().run_in_executor(
                None, _lookup.answer, self._ctx.store, body, lambda keys: tenant.keys(keys, cached=False))
        except _lookup.BadLookup as exc:
            return self._json(400, {"error": str(exc)})
        return self._json(200, answer)

    def _json(self, status: int, value: Any, *, close: bool = False) -> "web.Response":
        headers = {"Connection": "close"} if close else None
        return self._web.Response(status=status, body=json.dumps(value, default=str).encode(),
                                  content_type="application/json", headers=headers)



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
