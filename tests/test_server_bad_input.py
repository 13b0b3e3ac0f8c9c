"""Bad input over the wire: each bad connection gets an error and is closed, the server
keeps serving others, and nothing stored changes. Plus auth and the admin port."""

from __future__ import annotations

import json
import socket
import struct
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import AuthError
from kvstore.net import protocol as P
from kvstore.testing import make_keys, payload
from tests._hello import raw_hello
from tests._servers import ThreadServer, config_dict

BLOCK = 64 * 1024
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server():
    s = ThreadServer(config_dict("32MiB", max_frame_bytes="8MiB", max_batch=64, max_inflight_bytes="4MiB"))
    with Client(s.address, transport="tcp") as c:
        keys = make_keys(4, salt="base")
        assert all(c.save(keys, [payload(i, BLOCK) for i in range(4)]).result(10))
    yield s
    s.stop()


def _raw(server, hello: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.server.port), timeout=5)
    if hello:
        raw_hello(sock)
    return sock


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        try:
            chunk = sock.recv(n - len(out))
        except ConnectionResetError:  # closed with our unread bytes still queued: a reset
            break
        if not chunk:
            break
        out += chunk
    return out


def _expect_error_and_close(sock: socket.socket, status: int | None = None) -> str:
    """The server answers with an error frame and then closes the connection."""
    head = _recv(sock, P.HEADER_BYTES)
    assert len(head) == P.HEADER_BYTES, "no error reply before close"
    hdr = P.parse_header(head, P.Limits(1 << 40, 1 << 30), reply=True)
    assert hdr.status != 0
    if status is not None:
        assert hdr.status == status
    message = _recv(sock, hdr.body_len).decode()
    assert _recv(sock, 1) == b"", "connection left open after a fatal error"
    sock.close()
    return message


def _assert_unchanged_and_serving(server) -> None:
    base = make_keys(4, salt="base")
    with Client(server.address, transport="tcp") as c:
        dsts = [np.zeros(BLOCK, np.uint8) for _ in base]
        assert c.load(base, dsts).result(10) == [True] * 4
        for i, d in enumerate(dsts):
            assert np.array_equal(d, payload(i, BLOCK))
    assert server.store.stats()["blocks"] == 4


def _frame(op: int, body: bytes = b"", payload_len: int = 0, version: int = P.VERSION,
           magic: bytes = P.MAGIC) -> bytes:
    return struct.pack("<2sBBIIIQ", magic, version, op, 7, 0, len(body), payload_len) + body


@pytest.mark.parametrize("name,data,status", [
    ("wrong version", _frame(P.Op.PING, version=9), P.Status.PROTOCOL),
    ("garbage", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", P.Status.PROTOCOL),
    ("unknown opcode", _frame(200), P.Status.PROTOCOL),
    ("oversize body", _frame(P.Op.CONTAINS, b"", 0)[:12] + struct.pack("<IQ", 1 << 31, 0), P.Status.PROTOCOL),
    ("oversize payload", _frame(P.Op.PUT, b"", 1 << 40), P.Status.PROTOCOL),
    ("bad batch count", _frame(P.Op.CONTAINS, struct.pack("<I", 1000) + b"x" * 96), P.Status.PROTOCOL),
    ("ragged body", _frame(P.Op.DELETE, struct.pack("<I", 1) + b"x" * 95), P.Status.PROTOCOL),
    ("payload on GET", _frame(P.Op.PING, b"", 8), P.Status.PROTOCOL),
])
def test_bad_frames_close_only_that_connection(server, name, data, status):
    sock = _raw(server)
    sock.sendall(data)
    _expect_error_and_close(sock, status)
    _assert_unchanged_and_serving(server)


def test_put_announcing_wrong_payload_length(server):
    key = make_keys(1, salt="liar")
    body = P.encode_records(P.PUT_REC, key, [BLOCK])
    sock = _raw(server)
    sock.sendall(_frame(P.Op.PUT, body, BLOCK + 1))
    _expect_error_and_close(sock, P.Status.PROTOCOL)
    _assert_unchanged_and_serving(server)


def test_put_over_inflight_limit_refused_before_payload(server):
    keys = make_keys(2, salt="big")
    body = P.encode_records(P.PUT_REC, keys, [3 << 20, 3 << 20])  # 6 MiB > max_inflight_bytes 4 MiB
    sock = _raw(server)
    sock.sendall(_frame(P.Op.PUT, body, 6 << 20))
    assert "max_inflight_bytes" in _expect_error_and_close(sock, P.Status.TOO_LARGE)
    with Client(server.address, transport="tcp") as c:
        assert c.contains(keys) == [False, False]
    _assert_unchanged_and_serving(server)


def test_truncated_header_then_disconnect(server):
    sock = _raw(server)
    sock.sendall(_frame(P.Op.PING)[:10])
    sock.close()
    _assert_unchanged_and_serving(server)


def test_disconnect_mid_payload_stores_nothing(server):
    keys = make_keys(3, salt="cut")
    body = P.encode_records(P.PUT_REC, keys, [BLOCK] * 3)
    sock = _raw(server)
    sock.sendall(_frame(P.Op.PUT, body, 3 * BLOCK) + payload(0, BLOCK).tobytes() + b"x" * 100)
    sock.close()
    _assert_unchanged_and_serving(server)
    with Client(server.address, transport="tcp") as c:
        assert c.contains(keys) == [False] * 3


def test_frame_before_hello_is_refused(server):
    sock = _raw(server, hello=False)
    key = make_keys(1, salt="early")
    sock.sendall(_frame(P.Op.PUT, P.encode_records(P.PUT_REC, key, [BLOCK]), BLOCK))
    _expect_error_and_close(sock, P.Status.AUTH)
    _assert_unchanged_and_serving(server)


def test_many_bad_clients_do_not_disturb_a_good_one(server):
    with Client(server.address, transport="tcp") as good:
        keys = make_keys(8, salt="good")
        srcs = [payload(100 + i, BLOCK) for i in range(8)]
        assert all(good.save(keys, srcs).result(10))
        for i in range(20):
            sock = _raw(server)
            sock.sendall(np.random.default_rng(i).integers(0, 256, 64, dtype=np.uint8).tobytes())
            sock.close()
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert good.load(keys, dsts).result(10) == [True] * 8
            assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))


# -- auth -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def secured():
    s = ThreadServer(config_dict("16MiB", token=TOKEN))
    yield s
    s.stop()


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_wrong_or_missing_token_is_refused(secured, token):
    with pytest.raises(AuthError):
        Client(secured.address, token=token)
    assert secured.store.stats()["blocks"] == 0


def test_right_token_works(secured):
    for transport in ("tcp", "shm"):
        with Client(secured.address, token=TOKEN, transport=transport) as c:
            key = make_keys(1, salt=transport)
            assert c.save(key, [payload(1, BLOCK)]).result(10) == [True]
            dst = np.zeros(BLOCK, np.uint8)
            assert c.load(key, [dst]).result(10) == [True]
            assert np.array_equal(dst, payload(1, BLOCK))


# -- admin port -------------------------------------------------------------------------------

def _http(port: int, path: str, method: str = "GET", token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    if method == "POST":
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_admin_endpoints(server):
    port = server.server.admin_port
    assert _http(port, "/healthz") == (200, b"ok\n")
    status, text = _http(port, "/metrics")
    assert status == 200
    metrics = text.decode()
    for name in ("kvstore_tier_hits_total", "kvstore_tier_misses_total", "kvstore_tier_evictions_total",
                 "kvstore_tier_corruptions_total", "kvstore_request_seconds_bucket", "kvstore_tier_used_bytes"):
        assert name in metrics
    status, body = _http(port, "/stats")
    assert status == 200 and json.loads(body)["blocks"] == server.store.stats()["blocks"]
    assert _http(port, "/nope")[0] == 404
    assert _http(port, "/clear")[0] == 405


def test_admin_clear_needs_token(secured):
    port = secured.server.admin_port
    with Client(secured.address, token=TOKEN) as c:
        c.save(make_keys(2, salt="clear"), [payload(0, 4096), payload(1, 4096)]).result(10)
    assert _http(port, "/clear", "POST")[0] == 401
    assert _http(port, "/stats")[0] == 401
    assert secured.store.stats()["blocks"] >= 2
    status, body = _http(port, "/clear", "POST", token=TOKEN)
    assert status == 200 and json.loads(body)["removed"] >= 2
    assert secured.store.stats()["blocks"] == 0
    assert _http(port, "/healthz")[0] == 200


# -- size arithmetic --------------------------------------------------------------------------

def test_put_sizes_that_wrap_past_2_64_are_refused_and_store_nothing(server):
    """Sizes summing past 2**64 once wrapped to the payload length, and the first block's
    slice ran to the end of the reused receive buffer: another upload's bytes were
    stored under the attacker's key."""
    with Client(server.address, transport="tcp") as c:          # leave a victim's bytes in a buffer
        assert all(c.save(make_keys(2, salt="victim"), [payload(7, BLOCK)] * 2).result(10))
    blocks_before = server.store.stats()["blocks"]
    evil = make_keys(2, salt="evil")
    for sizes, payload_len in (([(1 << 64) - 8, 8 + 16], 16), ([(1 << 64) - 1, 1], 0), ([1 << 63, 1 << 63], 0)):
        sock = _raw(server)
        body = P.encode_records(P.PUT_REC, evil, sizes)
        sock.sendall(P.pack_header(P.Op.PUT, 2, len(body), payload_len) + body + bytes(payload_len))
        _expect_error_and_close(sock, P.Status.PROTOCOL)
    assert server.store.contains(evil) == [False, False]
    assert server.store.stats()["blocks"] == blocks_before
    with Client(server.address, transport="tcp") as c:          # still serving, victim intact
        dsts = [np.zeros(BLOCK, np.uint8) for _ in range(2)]
        assert c.load(make_keys(2, salt="victim"), dsts).result(10) == [True, True]
        assert all(np.array_equal(d, payload(7, BLOCK)) for d in dsts)
    server.store.delete(make_keys(2, salt="victim"))


def test_record_sizes_and_offsets_beyond_any_buffer_are_protocol_errors():
    limits = P.Limits()
    keys = make_keys(2, salt="x")
    for dtype, cols in ((P.SIZED, ([1 << 41, 1],)), (P.STAGED, ([1, 1], [0, (1 << 64) - 1]))):
        body = P.encode_records(dtype, keys, *cols)
        with pytest.raises(Exception, match="exceeds"):
            P.decode_records(dtype, body, limits)


# -- authentication cannot be turned off by accident ------------------------------------------

@pytest.mark.parametrize("value", ["", "null", "~", "  "])
def test_an_empty_token_from_the_environment_is_a_config_error(value):
    from kvstore.config import load_config
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match="token is set but empty"):
        load_config(config_dict("1MiB"), env={"KVSTORE_SERVER__TOKEN": value})
    with pytest.raises(ConfigError, match="token is set but empty"):
        load_config(config_dict("1MiB", token=None if value in ("null", "~") else value), env={})   # as YAML reads it


def test_serving_beyond_loopback_needs_a_token_or_an_explicit_opt_out():
    from kvstore.config import load_config
    from kvstore.errors import ConfigError
    from kvstore.server import Server

    with pytest.raises(ConfigError, match="no server.token is set"):
        Server(load_config(config_dict("1MiB", host="0.0.0.0"), env={}))
    for server in (config_dict("1MiB", host="0.0.0.0", token=TOKEN),
                   config_dict("1MiB", host="0.0.0.0", allow_unauthenticated=True),
                   config_dict("1MiB", host="::1"), config_dict("1MiB", host="localhost")):
        s = ThreadServer(server)
        s.stop()


@pytest.mark.parametrize("body", [b'{"token": "\\ud800"}', b"[" * 2000 + b"]" * 2000, b"\xff\xfe"],
                         ids=["lone-surrogate", "deep", "not-utf8"])
def test_malformed_hellos_are_protocol_errors_not_internal_errors(server, body, caplog):
    sock = _raw(server, hello=False)
    sock.sendall(P.pack_header(P.Op.HELLO, 1, len(body)) + body)
    message = _expect_error_and_close(sock, P.Status.PROTOCOL)
    assert "internal" not in message
    assert "Traceback" not in caplog.text
    base = make_keys(4, salt="base")
    with Client(server.address, transport="tcp") as c:          # still serving
        assert c.load(base[:1], [np.zeros(BLOCK, np.uint8)]).result(10) == [True]


def test_the_admin_port_wants_the_bearer_scheme(secured):
    port = secured.server.admin_port
    assert _http(port, "/stats", token=None)[0] == 401
    req = urllib.request.Request(f"http://127.0.0.1:{port}/stats")
    req.add_header("Authorization", TOKEN)                      # the token without "Bearer "
    try:
        urllib.request.urlopen(req, timeout=5)
        status = 200
    except urllib.error.HTTPError as exc:
        status = exc.code
    assert status == 401
    assert _http(port, "/stats", token=TOKEN)[0] == 200
