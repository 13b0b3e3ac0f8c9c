"""The admin port on aiohttp (issue 20): the endpoints keep their answers, bodies and
request heads are bounded in size and time, a malformed request is a 400 with no
traceback, a failing handler a 503, and the port serves HTTPS given an SSL context."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from kvstore.net.server import _admin, _lookup
from tests._servers import ThreadServer, config_dict

TOKEN = "admin-s3cret"


@pytest.fixture
def quick(monkeypatch):
    """A server whose admin port gives a request head and a body 0.5 s each."""
    monkeypatch.setattr(_admin, "HEAD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(_admin, "BODY_TIMEOUT_S", 0.5)
    s = ThreadServer(config_dict("4MiB", token=TOKEN))
    yield s
    s.stop()


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server.admin_port), timeout=5)


def _reply(sock: socket.socket) -> tuple[int, bytes]:
    """Status and everything the server sent until it closed (or 5 s passed)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    if not data:
        return 0, b""
    return int(data.split(b" ", 2)[1]), data


def _get(server, path: str, method: str = "GET", token: str | None = None, data: bytes | None = None):
    req = urllib.request.Request(f"http://127.0.0.1:{server.server.admin_port}{path}", method=method, data=data)
    if method == "POST":
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def _healthy(server) -> bool:
    return _get(server, "/healthz")[::2] == (200, b"ok\n")


def test_endpoints_answer_as_before(quick):
    status, headers, body = _get(quick, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b"kvstore_tier_used_bytes" in body
    assert _get(quick, "/stats")[0] == 401                                   # token before anything
    assert _get(quick, "/stats", "POST")[0] == 401
    status, headers, body = _get(quick, "/stats", token=TOKEN)
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert json.loads(body)["server"]["admin_port"] == quick.server.admin_port
    assert _get(quick, "/clear", token=TOKEN)[0] == 405
    status, _, body = _get(quick, "/clear", "POST", token=TOKEN)
    assert status == 200 and json.loads(body) == {"removed": 0}
    status, _, body = _get(quick, "/nope")
    assert status == 404 and b"/healthz" in body
    assert _get(quick, "/healthz", "HEAD")[0] == 200
    status, headers, _ = _get(quick, "/v1/lookup", token=TOKEN)
    assert status == 405 and "POST" in headers["Allow"]


def test_a_kept_alive_connection_serves_several_requests(quick):
    sock = _connect(quick)
    for _ in range(3):
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        data = sock.recv(4096)
        assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"ok\n")
    sock.close()


def test_a_request_head_that_stalls_is_closed(quick):
    sock = _connect(quick)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")                  # never ends its head
    start = time.monotonic()
    status, _ = _reply(sock)
    assert status == 0 and time.monotonic() - start < 4.0                   # closed, nothing answered
    idle = _connect(quick)                                                  # nor sends anything at all
    assert _reply(idle) == (0, b"")
    assert _healthy(quick)


def test_a_body_that_stalls_is_closed_with_408(quick):
    sock = _connect(quick)
    sock.sendall(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                 b"\r\nContent-Length: 100\r\n\r\n{\"keys\"")
    status, data = _reply(sock)
    assert status == 408 and b"not received" in data
    assert _healthy(quick)


def test_an_oversized_body_is_refused_unread(quick):
    sock = _connect(quick)
    sock.sendall(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                 f"\r\nContent-Length: {quick.config.server.admin.max_body_bytes + 1}\r\n\r\n".encode())
    status, data = _reply(sock)
    assert status == 413 and b"body over" in data
    sock = _connect(quick)                                                  # chunked: no length to check
    sock.sendall(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                 b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert _reply(sock)[0] == 411
    assert _healthy(quick)


@pytest.mark.parametrize("request_bytes", [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64) + b"\r\n\r\n",      # TLS to a plain port
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n",   # one huge header
    b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(300)) + b"\r\n",
    b"GET " + b"/" * 70000 + b" HTTP/1.1\r\n\r\n",                                  # huge request line
    b"POST /v1/lookup HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/lookup HTTP/1.1\r\nContent-Length: 99999999999999999999999999\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nBad Header Line\r\n\r\n",
    b"\xff\xfe\x00garbage\r\n\r\n",
], ids=["tls", "huge-header", "many-headers", "huge-line", "negative-length", "huge-length", "bad-header",
        "binary"])
def test_malformed_requests_are_a_400_without_a_traceback(quick, request_bytes, caplog):
    caplog.set_level(logging.DEBUG)
    sock = _connect(quick)
    try:
        sock.sendall(request_bytes)
    except (BrokenPipeError, ConnectionResetError):                         # closed before all of it
        pass
    status, _ = _reply(sock)
    assert status in (0, 400, 413, 431)
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)
    assert _healthy(quick)


def test_a_failing_handler_is_a_503_and_the_port_keeps_serving(quick, monkeypatch, caplog):
    def broken(tenant=None):
        raise RuntimeError("stats exploded")

    monkeypatch.setattr(quick.server, "stats", broken)
    status, _, body = _get(quick, "/stats", token=TOKEN)
    assert status == 503 and b"stats exploded" in body
    assert "admin request GET /stats failed" in caplog.text
    assert _healthy(quick)


def test_health_is_503_while_shutting_down(quick):
    quick.server.closing = True
    try:
        assert _get(quick, "/healthz")[0] == 503
    finally:
        quick.server.closing = False


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_the_admin_port_serves_https_given_an_ssl_context(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out",
                    str(cert)], check=True, capture_output=True)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    s = ThreadServer(config_dict("4MiB", admin_port=None))
    admin = _admin.AdminServer(s.server.admin_context())
    try:
        port = asyncio.run_coroutine_threadsafe(admin.start("127.0.0.1", 0, ssl_context=context), s.loop).result(10)
        client = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=5, context=client) as resp:
            assert resp.status == 200 and resp.read() == b"ok\n"
        with pytest.raises(OSError):                                        # plain HTTP is not served
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read()
    finally:
        asyncio.run_coroutine_threadsafe(admin.close(), s.loop).result(10)
        s.stop()


def test_without_aiohttp_the_admin_port_is_a_config_error(monkeypatch):
    import builtins

    from kvstore.errors import ConfigError

    real = builtins.__import__

    def no_aiohttp(name, *args, **kwargs):
        if name == "aiohttp" or name.startswith("aiohttp."):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_aiohttp)
    with pytest.raises(ConfigError, match="admin_port: null"):
        ThreadServer(config_dict("4MiB"))
