"""Pre-authentication and stall limits of the cache server (issue 20, finding 2): no
allocation sized by an unauthenticated peer, a handshake deadline, a deadline on every
body read, and a cap on connections. Raw frames over loopback against a real server."""

import socket

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.net import protocol as P
from kvstore.testing import make_keys, payload
from tests._hello import raw_hello
from tests._servers import ThreadServer, config_dict

WAIT_S = 20          # the longest a test waits for the server to act (a bound, not a timing)


@pytest.fixture(scope="module")
def server():
    s = ThreadServer(config_dict("8MiB", handshake_timeout_s=0.5, read_timeout_s=0.5, max_connections=6))
    yield s
    s.stop()


def _connect(server, hello=False):
    sock = socket.create_connection(("127.0.0.1", server.server.port), timeout=WAIT_S)
    if hello:
        raw_hello(sock)
    return sock


def _recv(sock, n):
    out = b""
    while len(out) < n:
        try:
            chunk = sock.recv(n - len(out))
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    return out


def _closed_by_server(sock) -> bool:
    """Drain until the server closes (True) or WAIT_S passes with the socket open (False)."""
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    finally:
        sock.close()


def _serving(server):
    keys = make_keys(1, salt="limits")
    with Client(server.address, transport="tcp") as c:
        assert c.save(keys, [payload(3, 4096)]).result(10) == [True]
        dst = np.zeros(4096, np.uint8)
        assert c.load(keys, [dst]).result(10) == [True] and np.array_equal(dst, payload(3, 4096))


def test_a_huge_hello_is_refused_before_anything_is_allocated_or_read(server):
    sock = _connect(server)
    announced = P.Limits().max_body_bytes - 1                     # a legal body size, once authenticated
    sock.sendall(P.pack_header(P.Op.HELLO, 1, announced))         # announced, never sent
    head = _recv(sock, P.HEADER_BYTES)
    assert len(head) == P.HEADER_BYTES, "no refusal: the server is waiting for the announced body"
    assert P.parse_header(head, P.Limits(1 << 40, 1 << 30), reply=True).status == P.Status.TOO_LARGE
    assert _closed_by_server(sock)
    _serving(server)


def test_a_connection_that_never_authenticates_is_closed(server):
    silent = _connect(server)
    partial = _connect(server)
    body = P.encode_json({"client": "slow"})
    partial.sendall(P.pack_header(P.Op.HELLO, 1, len(body)) + body[:3])   # a HELLO that stops
    assert _closed_by_server(silent) and _closed_by_server(partial)
    _serving(server)


def test_a_frame_whose_payload_stops_arriving_is_closed(server):
    sock = _connect(server, hello=True)
    keys = make_keys(1, salt="stalled")
    body = P.encode_records(P.PUT_REC, keys, [1 << 20])
    sock.sendall(P.pack_header(P.Op.PUT, 2, len(body), 1 << 20) + body + bytes(1000))  # 1 MiB announced
    assert _closed_by_server(sock)
    assert server.store.contains(keys) == [False]
    _serving(server)


def test_connections_past_max_connections_are_closed_at_accept(server):
    held = [_connect(server, hello=True) for _ in range(6)]
    try:
        extra = _connect(server)
        assert _closed_by_server(extra)
    finally:
        for s in held:
            s.close()
    deadline_ok = False
    for _ in range(200):                      # the held ones are gone: new clients get in again
        try:
            _serving(server)
            deadline_ok = True
            break
        except Exception:
            import time
            time.sleep(0.05)
    assert deadline_ok


def test_one_address_cannot_take_every_connection():
    s = ThreadServer(config_dict("4MiB", max_connections=8, max_connections_per_ip=3))
    try:
        held = [_connect(s, hello=True) for _ in range(3)]
        try:
            assert _closed_by_server(_connect(s))          # a fourth from 127.0.0.1
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # the Unix socket is not an address
            unix.settimeout(WAIT_S)
            unix.connect(s.server.socket_path)
            body = P.encode_json({"client": "unix"})
            unix.sendall(P.pack_header(P.Op.HELLO, 1, len(body)) + body)
            head = _recv(unix, P.HEADER_BYTES)
            assert P.parse_header(head, P.Limits(1 << 40, 1 << 30), reply=True).status == 0
            unix.close()
        finally:
            for h in held:
                h.close()
    finally:
        s.stop()
