"""The admin HTTP port: ``GET /healthz``, ``GET /metrics`` (Prometheus text),
``GET /stats`` (JSON), ``POST /clear``, ``POST /v1/lookup`` (JSON; the cached prefix of a
prompt per tier, :mod:`kvstore.net.server._lookup`). A deliberately tiny HTTP/1.1 subset on
asyncio streams: one request per connection, bounded bodies, bounded header reads.

With a server token or tenants, ``/stats``, ``/clear`` and ``/v1/lookup`` need
``Authorization: Bearer <token>``: a tenant's token scopes them to that tenant (its
stats, its blocks, its key space; see :mod:`kvstore.net.server._tenants`);
``/healthz`` and ``/metrics`` stay open so probes and scrapers need no secret.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from kvstore.net.server import _lookup
from kvstore.net.server._tenants import Tenant, admin_clear

if TYPE_CHECKING:
    from kvstore.net.server._server import Server

log = logging.getLogger("kvstore.server")
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            411: "Length Required", 413: "Content Too Large", 503: "Service Unavailable"}


async def handle_admin(server: "Server", reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        status, ctype, body = await _route(server, head, reader)
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
        status, ctype, body = 400, "text/plain", b"bad request\n"
    except Exception as exc:  # report, never kill the admin port
        log.exception("admin request failed")
        status, ctype, body = 503, "text/plain", f"{exc}\n".encode()
    try:
        writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _route(server: "Server", head: bytes, reader: asyncio.StreamReader) -> tuple[int, str, bytes]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split()
    if len(parts) != 3:
        return 400, "text/plain", b"bad request line\n"
    method, path = parts[0], parts[1].split("?", 1)[0]
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    loop = asyncio.get_running_loop()
    if path == "/healthz":
        if server.closing:
            return 503, "text/plain", b"shutting down\n"
        return 200, "text/plain", b"ok\n"
    if path == "/metrics":
        return 200, "text/plain; version=0.0.4; charset=utf-8", await loop.run_in_executor(None, server.metrics.render)
    if path not in ("/stats", "/clear", "/v1/lookup"):
        return 404, "text/plain", b"not found; try /healthz, /metrics, /stats, POST /clear, POST /v1/lookup\n"
    tenant = server.tenants.bearer(headers.get("authorization", ""))   # every tenant's token tried
    if tenant is None:
        return 401, "text/plain", b"missing or wrong bearer token\n"
    if path == "/stats":
        if method != "GET":
            return 405, "text/plain", b"use GET\n"
        stats = await loop.run_in_executor(None, server.stats, tenant)
        return 200, "application/json", json.dumps(stats, default=str).encode()
    if method != "POST":
        return 405, "text/plain", b"use POST\n"
    if path == "/v1/lookup":
        return await _lookup_route(server, headers, reader, tenant)
    removed = await loop.run_in_executor(None, admin_clear, server.store, tenant)
    return 200, "application/json", json.dumps({"removed": removed}).encode()


async def _lookup_route(server: "Server", headers: dict[str, str], reader: asyncio.StreamReader,
                        tenant: Tenant) -> tuple[int, str, bytes]:
    length = headers.get("content-length", "")
    if not length.isdigit():
        return 411, "application/json", _error("a Content-Length header is required")
    if int(length) > _lookup.MAX_BODY_BYTES:
        return 413, "application/json", _error(f"body over {_lookup.MAX_BODY_BYTES} bytes")
    body = await asyncio.wait_for(reader.readexactly(int(length)), 30.0)
    try:
        answer = await asyncio.get_running_loop().run_in_executor(
            None, lambda: _lookup.answer(server.store, body, lambda keys: tenant.keys(keys, cached=False)))
    except _lookup.BadLookup as exc:
        return 400, "application/json", _error(str(exc))
    return 200, "application/json", json.dumps(answer).encode()


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


__all__ = ["handle_admin"]
