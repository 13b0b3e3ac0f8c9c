"""The admin port's bounds (issue 34 items 5, 6, 8, 9): a lookup is capped in bytes and
tokens (413) and answers bad JSON with a 400, admin work runs on the port's own threads
(not the executor the data plane uses), one address cannot take every admin connection
from ``/healthz``, and a token-less server refuses a cross-origin ``POST /clear`` and
foreign ``Host`` headers."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading

import numpy as np
import pytest

from kvstore import Namespace
from kvstore.client import Client
from kvstore.net.server import _lookup
from tests._servers import ThreadServer, config_dict

NS = {"model": "m", "dtype": "bf16", "chunk_tokens": 4}
BLOCK = 4096


def _request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             source: str | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def _lookup_post(port: int, value, **headers) -> tuple[int, dict]:
    body = value if isinstance(value, bytes) else json.dumps(value).encode()
    status, _, data = _request(port, "POST", "/v1/lookup", body, {"Content-Type": "application/json", **headers})
    return status, json.loads(data)


@pytest.fixture
def open_server():
    """A token-less server (the default), default admin bounds."""
    s = ThreadServer(config_dict("4MiB"))
    yield s
    s.stop()


@pytest.fixture
def capped_server():
    """A token-less server with small admin bounds."""
    s = ThreadServer(config_dict("4MiB", admin={"max_body_bytes": "64KiB", "lookup_max_tokens": 1000}))
    yield s
    s.stop()


def _save_prompt(server, n_chunks: int) -> list[int]:
    tokens = list(range(1, 1 + n_chunks * NS["chunk_tokens"]))
    keys = Namespace(**NS).chunk_keys(tokens)
    with Client(server.address, transport="tcp") as c:
        assert c.save(keys, [np.full(BLOCK, i, np.uint8) for i in range(n_chunks)]).result(10) == [True] * n_chunks
    return tokens


# -- item 5: caps, bulk hashing, the admin port's own threads ------------------------------------

def test_a_lookup_past_the_token_or_byte_cap_is_a_413_naming_the_setting(capped_server):
    port = capped_server.server.admin_port
    tokens = _save_prompt(capped_server, 3)
    status, answer = _lookup_post(port, {"namespace": NS, "token_ids": tokens})
    assert status == 200 and answer["prefix_blocks"] == 3
    status, answer = _lookup_post(port, {"namespace": NS, "token_ids": list(range(1001))})
    assert status == 413 and "server.admin.lookup_max_tokens (1000)" in answer["error"]
    status, answer = _lookup_post(port, {"keys": ["00" * 32] * 900})              # 59 KB: within the bytes
    assert status == 200 and answer["blocks"] == 900
    with pytest.raises(_lookup.LookupTooLarge, match="keys: 11 given"):
        _lookup.answer(capped_server.store, json.dumps({"keys": ["00" * 32] * 11}).encode(), max_tokens=10)
    status, answer = _lookup_post(port, {"namespace": NS, "token_ids": [1] * 40000})   # 120 KB of JSON
    assert status == 413 and "server.admin.max_body_bytes" in answer["error"]
    status, answer = _lookup_post(port, {"namespace": NS, "token_ids": [1, True, 3, 4]})
    assert status == 400 and "token_ids" in answer["error"]


def test_a_lookup_answers_the_same_across_hashing_batches(open_server, monkeypatch):
    """Keys hashed and looked up a few at a time (and the walk stopped at the first block
    held nowhere) give the answer one pass over every key gives."""
    monkeypatch.setattr(_lookup, "BATCH", 2)
    port = open_server.server.admin_port
    tokens = _save_prompt(open_server, 7)
    status, answer = _lookup_post(port, {"namespace": NS, "token_ids": tokens + list(range(900, 940))})
    assert status == 200 and answer["blocks"] == 17 and answer["prefix_blocks"] == 7
    assert answer["tiers"][0]["prefix_blocks"] == 7 and answer["prefix_tokens"] == 28
    keys = Namespace(**NS).chunk_keys(tokens)
    status, answer = _lookup_post(port, {"keys": [k.hex() for k in keys[:5]] + ["ab" * 32] + [keys[6].hex()]})
    assert status == 200 and answer["blocks"] == 7 and answer["prefix_blocks"] == 5


def test_admin_work_does_not_wait_on_the_executor_the_data_plane_uses(open_server):
    """Every worker of the loop's default executor is taken: the admin port still
    answers /stats, /metrics and lookups (on its own threads)."""
    s = open_server
    release = threading.Event()

    def take_every_worker():
        loop = asyncio.get_running_loop()
        for _ in range(64):
            loop.run_in_executor(None, release.wait)

    async def fill():
        take_every_worker()

    asyncio.run_coroutine_threadsafe(fill(), s.loop).result(10)
    try:
        port = s.server.admin_port
        assert _request(port, "GET", "/stats")[0] == 200
        assert _request(port, "GET", "/metrics")[0] == 200
        assert _lookup_post(port, {"keys": ["00" * 32]}) == (200, {"blocks": 1, "prefix_blocks": 0,
                                                                   "prefix_tokens": None,
                                                                   "tiers": [{"name": "hot", "kind": "dram",
                                                                              "prefix_blocks": 0,
                                                                              "prefix_tokens": None}]})
    finally:
        release.set()


def test_a_full_admin_pool_is_a_503_and_health_still_answers():
    s = ThreadServer(config_dict("4MiB", admin={"threads": 1, "queue": 0}))
    entered, release = threading.Event(), threading.Event()
    real = s.server.stats

    def slow_stats(tenant=None):
        entered.set()
        release.wait(10)
        return real(tenant)

    s.server.stats = slow_stats
    try:
        port = s.server.admin_port
        first = threading.Thread(target=_request, args=(port, "GET", "/stats"))
        first.start()
        assert entered.wait(10)
        status, headers, body = _request(port, "GET", "/stats")
        assert status == 503 and headers["Retry-After"] == "1" and b"admin port busy" in body
        assert _request(port, "GET", "/healthz")[::2] == (200, b"ok\n")
        with Client(s.address, transport="tcp") as c:                 # the data plane serves on
            assert c.lookup(Namespace(**NS).chunk_keys([1, 2, 3, 4])) == 0
        release.set()
        first.join(10)
        assert _request(port, "GET", "/stats")[0] == 200
    finally:
        release.set()
        s.stop()


# -- item 6: one address cannot lock /healthz out -----------------------------------------------

def test_silent_connections_from_one_address_leave_health_to_the_others():
    s = ThreadServer(config_dict("4MiB"))          # the default bounds
    port = s.server.admin_port
    silent = []
    try:
        for _ in range(140):
            silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        for source in ("127.0.0.2", "127.0.0.3"):
            assert _request(port, "GET", "/healthz", source=source)[::2] == (200, b"ok\n")
        text = _request(port, "GET", "/metrics", source="127.0.0.4")[2].decode()
        assert 'kvstore_refused_connections_total{reason="admin_max_connections_per_ip"} 124.0' in text
    finally:
        for sock in silent:
            sock.close()
        s.stop()


# -- item 8: a token-less server and the browser ------------------------------------------------

def test_a_cross_origin_clear_is_refused_and_clears_nothing(open_server):
    port = open_server.server.admin_port
    _save_prompt(open_server, 2)
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        status, _, body = _request(port, "POST", "/clear", b"x", headers)
        assert status == 415 and b"needs Content-Type: application/json" in body
    assert open_server.store.stats()["blocks"] == 2
    status, _, body = _request(port, "POST", "/clear", headers={"Content-Type": "application/json"})
    assert status == 200 and json.loads(body) == {"removed": 2}


@pytest.mark.parametrize("host", ["evil.example", "evil.example:7481", "127.0.0.1.nip.io", "[2001:db8::1]:80",
                                  "10.1.2.3"])
def test_a_token_less_server_refuses_foreign_host_headers(open_server, host):
    port = open_server.server.admin_port
    _save_prompt(open_server, 1)
    for method, path in (("GET", "/stats"), ("GET", "/metrics"), ("POST", "/clear"), ("POST", "/v1/lookup")):
        status, _, body = _request(port, method, path, b"{}", {"Host": host, "Content-Type": "application/json"})
        assert status == 421 and b"does not name this admin port" in body, (method, path)
    assert open_server.store.stats()["blocks"] == 1
    assert _request(port, "GET", "/healthz", headers={"Host": host})[::2] == (200, b"ok\n")   # probes: any Host


@pytest.mark.parametrize("host", ["localhost", "localhost:1", "LOCALHOST.", "127.0.0.1", "127.0.0.1:80",
                                  "[::1]:7481", "app.localhost"])
def test_a_token_less_server_answers_its_own_names(open_server, host):
    assert _request(open_server.server.admin_port, "GET", "/stats", headers={"Host": host})[0] == 200


def test_a_server_with_a_token_answers_any_host_with_the_token():
    s = ThreadServer(config_dict("4MiB", token="tok-en"))
    try:
        headers = {"Host": "kvstore.internal:7481", "Authorization": "Bearer tok-en"}
        assert _request(s.server.admin_port, "GET", "/stats", headers=headers)[0] == 200
        assert _request(s.server.admin_port, "GET", "/stats", headers={"Host": "x"})[0] == 401
    finally:
        s.stop()


# -- item 9: JSON the decoder refuses is a 400, not a 503 ---------------------------------------

@pytest.mark.parametrize("body", [b'{"keys": [' + b"7" * 5000 + b"]}", b"[" * 100_000 + b"]" * 100_000,
                                  b'{"namespace": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001],
                         ids=["huge-integer", "deep-list", "deep-object"])
def test_json_the_decoder_refuses_is_a_400_naming_it_without_a_traceback(body, caplog):
    caplog.set_level(logging.DEBUG)
    s = ThreadServer(config_dict("4MiB"))
    try:
        status, answer = _lookup_post(s.server.admin_port, body)
        assert status == 400 and "body is not JSON kvstore reads" in answer["error"]
        assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)
    finally:
        s.stop()
