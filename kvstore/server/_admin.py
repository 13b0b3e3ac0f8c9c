"""The admin HTTP port: ``GET /healthz``, ``GET /metrics`` (Prometheus text),
``GET /stats`` (JSON), ``POST /clear``. A deliberately tiny HTTP/1.1 subset on asyncio
streams: one request per connection, small bodies, bounded header reads.

With a server token, ``/stats`` and ``/clear`` need ``Authorization: Bearer <token>``;
``/healthz`` and ``/metrics`` stay open so probes and scrapers need no secret.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.server._server import Server

log = logging.getLogger("kvstore.server")
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}


async def handle_admin(server: "Server", reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        status, ctype, body = await _route(server, head)
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


async def _route(server: "Server", head: bytes) -> tuple[int, str, bytes]:
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
    if path not in ("/stats", "/clear"):
        return 404, "text/plain", b"not found; try /healthz, /metrics, /stats, POST /clear\n"
    token = server.config.server.token
    if token is not None:
        header = headers.get("authorization", "")
        given = header[len("Bearer "):].strip() if header.startswith("Bearer ") else ""
        if not given or not hmac.compare_digest(given.encode("utf-8", "replace"), token.encode()):
            return 401, "text/plain", b"missing or wrong bearer token\n"
    if path == "/stats":
        if method != "GET":
            return 405, "text/plain", b"use GET\n"
        stats = await loop.run_in_executor(None, server.stats)
        return 200, "application/json", json.dumps(stats, default=str).encode()
    if method != "POST":
        return 405, "text/plain", b"use POST\n"
    removed = await loop.run_in_executor(None, server.store.clear)
    return 200, "application/json", json.dumps({"removed": removed}).encode()


__all__ = ["handle_admin"]
