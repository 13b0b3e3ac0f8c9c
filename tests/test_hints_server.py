"""Retention hints through a real cache server on loopback: Client.save/lookup/hint
carry them (the HINT request), the server's Store ranks by them, bad hints on the wire
are protocol errors."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import Client, Hint
from kvstore.errors import InvalidArgumentError, RemoteError
from kvstore.net import protocol as P
from kvstore.testing import make_keys, payload
from tests._servers import ThreadServer, config_dict

BLOCK = 4096


@pytest.fixture(scope="module")
def server():
    s = ThreadServer(config_dict(tiers=[{"name": "hot", "kind": "dram", "capacity": 4 * BLOCK, "pin": False}]))
    yield s
    s.stop()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_client_hints_steer_the_servers_eviction(server, transport):
    keys = make_keys(8, salt=f"hints-{transport}")
    with Client(server.address, transport=transport) as client:
        client.clear()
        before = client.stats()["hints"]
        assert client.save(keys[:1], [payload(0, BLOCK)], hint=Hint(600, priority=1)).result() == [True]
        assert client.save(keys[1:2], [payload(1, BLOCK)], hint=Hint(None, discard=True)).result() == [True]
        assert client.save(keys[2:4], [payload(i, BLOCK) for i in (2, 3)]).result() == [True, True]
        assert client.lookup(keys[2:3], hint=Hint(600)) == 1        # hinted by the lookup
        assert client.save(keys[4:5], [payload(4, BLOCK)]).result() == [True]
        assert client.contains(keys[:4]) == [True, False, True, True]   # the discard block went
        assert client.save(keys[5:6], [payload(5, BLOCK)]).result() == [True]
        assert client.contains(keys[:4]) == [True, False, True, False]  # then the unhinted one
        out = np.empty(BLOCK, np.uint8)
        assert client.load(keys[:1], [out]).result() == [True] and (out == payload(0, BLOCK)).all()
        after = client.stats()["hints"]
        assert after["given"] - before["given"] == 3
        assert after["discarded"] - before["discarded"] == 1
        assert after["hit"] - before["hit"] >= 1
        assert client.hint(keys[:8], Hint(60)) == 4      # only what the server holds


def test_client_refuses_bad_hints_before_sending(server):
    with Client(server.address, transport="tcp") as client:
        with pytest.raises(InvalidArgumentError, match="kvstore.Hint"):
            client.save(make_keys(1, salt="bad"), [payload(0, BLOCK)], hint={"retain_s": 1})
        with pytest.raises(InvalidArgumentError, match="kvstore.Hint"):
            client.hint(make_keys(1, salt="bad"), None)


@pytest.mark.parametrize("body, words", [
    (P._HINT.pack(-1.0, 0, 0) + P.encode_keys([]), "retain_s"),
    (P._HINT.pack(0.0, 0, 2) + P.encode_keys([]), "discard flag"),
    (P._HINT.pack(0.0, 0, 0) + P.encode_keys([]), "empty Hint"),
    (P._HINT.pack(float("nan"), 1, 0) + P.encode_keys([]), "retain_s"),
    (b"\x00" * 4, "too short"),
])
def test_bad_hints_on_the_wire_are_protocol_errors(body, words):
    header = P.Header(P.Op.HINT, 1, 0, len(body), 0)
    with pytest.raises(RemoteError, match=words):
        P.decode_request(header, body, P.Limits())


def test_a_hint_request_reaches_the_store_of_a_live_server(server):
    keys = make_keys(2, salt="raw-hint")
    with Client(server.address, transport="tcp") as client:
        client.save(keys, [payload(i, BLOCK) for i in range(2)]).result()
        n = P.decode_u32(client._run(lambda c: c.call(P.Op.HINT, P.encode_hint(keys, Hint(30, priority=2))))[1])
        assert n == 2
