"""Issue 20, finding 6: verified bytes end to end. A byte flipped on the wire (a loopback
proxy between client and server), in the server's DRAM arena, or before a spill to NVMe
is a miss or a refusal, never a load that reports True with wrong bytes. And the HELLO
is a challenge-response: no token on the wire, a captured HELLO cannot be replayed."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import AuthError
from kvstore.net import protocol as P
from kvstore.testing import make_keys, payload
from tests._flip_proxy import FlipProxy
from tests._hello import call, raw_hello
from tests._servers import ThreadServer, config_dict

BLOCK = 256 * 1024
TOKEN = "integrity-s3cret-token"


@pytest.fixture
def server():
    s = ThreadServer(config_dict("16MiB"))
    yield s
    s.stop()


@pytest.fixture
def proxy(server):
    p = FlipProxy(("127.0.0.1", server.server.port))
    yield p
    p.close()


def _zeros(n: int) -> list[np.ndarray]:
    return [np.zeros(BLOCK, np.uint8) for _ in range(n)]


def test_a_byte_flipped_on_the_way_to_the_client_is_a_miss_not_wrong_kv(server, proxy):
    keys = make_keys(3, salt="s2c")
    srcs = [payload(10 + i, BLOCK) for i in range(3)]
    with Client(server.address, transport="tcp") as direct:
        assert direct.save(keys, srcs).result(10) == [True] * 3
    with Client(proxy.address, transport="tcp") as c:
        proxy.arm("s2c")
        dsts = _zeros(3)
        got = c.load(keys, dsts).result(10)
        assert proxy.flipped["s2c"] == 1
        assert got.count(False) == 1                    # the block the flip landed in
        for ok, src, dst in zip(got, srcs, dsts):
            if ok:
                assert np.array_equal(src, dst)         # True is always the stored bytes
        assert c.stats()["client"]["checksum_mismatches"] == 1
        dsts = _zeros(3)                                 # the stored copy is intact
        assert c.load(keys, dsts).result(10) == [True] * 3
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))


def test_a_put_changed_on_the_way_is_refused_and_nothing_wrong_is_stored(server, proxy):
    keys = make_keys(2, salt="c2s")
    srcs = [payload(20 + i, BLOCK) for i in range(2)]
    with Client(proxy.address, transport="tcp") as c:
        proxy.arm("c2s")
        got = c.save(keys, srcs).result(10)
        assert proxy.flipped["c2s"] == 1 and got.count(False) == 1
        bad = got.index(False)
        assert server.store.contains([keys[bad]]) == [False]
        assert server.store.stats()["refused_checksum"] == 1
    with Client(server.address, transport="tcp") as direct:      # a clean path
        dsts = _zeros(2)
        got = direct.load(keys, dsts).result(10)
        assert got[bad] is False and got[1 - bad] is True
        assert np.array_equal(dsts[1 - bad], srcs[1 - bad])
        assert direct.save(keys, srcs).result(10) == [True, True]   # a clean retry stores it
        dsts = _zeros(2)
        assert direct.load(keys, dsts).result(10) == [True, True]
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_byte_flipped_in_the_servers_arena_is_a_miss(server, transport):
    keys = make_keys(2, salt=f"arena-{transport}")
    srcs = [payload(30 + i, BLOCK) for i in range(2)]
    with Client(server.address, transport=transport) as c:
        assert c.save(keys, srcs).result(10) == [True, True]
        tier = server.store.tiers[0]
        offset, _ = tier.offset_of(keys[0])
        tier.arena[offset + 1234] ^= 0x01                # memory error / stray write
        dsts = _zeros(2)
        assert c.load(keys, dsts).result(10) == [False, True]
        assert np.array_equal(dsts[1], srcs[1])
        assert c.stats()["client"]["checksum_mismatches"] == 1
    # the server's own reads verify too: the slot is dropped and counted
    dst = np.zeros(BLOCK, np.uint8)
    assert server.store.load(keys[:1], [dst]).result(10) == [False]
    assert server.store.contains(keys[:1]) == [False]
    assert server.store.stats()["tiers"][0]["corruptions"] == 1


def test_after_a_spill_to_nvme_blocks_still_verify_and_a_corrupt_one_never_spills(tmp_path):
    tiers = [{"name": "hot", "kind": "dram", "capacity": 4 * BLOCK, "pin": False},
             {"name": "warm", "kind": "nvme", "path": str(tmp_path / "nvme"), "capacity": "16MiB"}]
    s = ThreadServer(config_dict(tiers=tiers))
    try:
        keys = make_keys(8, salt="spill")
        srcs = [payload(40 + i, BLOCK) for i in range(8)]
        with Client(s.address, transport="tcp") as c:
            assert c.save(keys[:4], srcs[:4]).result(10) == [True] * 4
            dram = s.store.tiers[0]
            offset, _ = dram.offset_of(keys[0])
            dram.arena[offset + 99] ^= 0x08              # corrupted while in DRAM, before its spill
            assert c.save(keys[4:], srcs[4:]).result(10) == [True] * 4   # evicts (spills) the first four
            nvme = s.store.tiers[1]
            assert nvme.contains(keys[:4]) == [False, True, True, True]  # the corrupt copy was not written
            dsts = _zeros(8)
            got = c.load(keys, dsts).result(10)
            assert got == [False] + [True] * 7
            assert all(np.array_equal(srcs[i], dsts[i]) for i in range(1, 8))
            assert c.stats()["client"]["checksum_mismatches"] == 0
    finally:
        s.stop()


# -- challenge-response HELLO -----------------------------------------------------------------

@pytest.fixture
def secured():
    s = ThreadServer(config_dict("8MiB", token=TOKEN))
    yield s
    s.stop()


def test_no_token_bytes_cross_the_wire_and_the_right_token_works(secured):
    proxy = FlipProxy(("127.0.0.1", secured.server.port))
    try:
        keys = make_keys(1, salt="token")
        with Client(proxy.address, token=TOKEN, transport="tcp") as c:
            assert c.save(keys, [payload(50, BLOCK)]).result(10) == [True]
            dst = np.zeros(BLOCK, np.uint8)
            assert c.load(keys, [dst]).result(10) == [True] and np.array_equal(dst, payload(50, BLOCK))
        sent = bytes(proxy.sent_by_client)
        assert sent.count(P.MAGIC) >= 4                  # HELLO, HELLO, PUT, GET at least
        assert TOKEN.encode() not in sent and TOKEN.encode().hex().encode() not in sent
    finally:
        proxy.close()


def test_a_captured_hello_is_refused_when_replayed(secured):
    proxy = FlipProxy(("127.0.0.1", secured.server.port))
    try:
        Client(proxy.address, token=TOKEN, transport="tcp").close()
        sent = bytes(proxy.sent_by_client)
    finally:
        proxy.close()
    first_len = P.HEADER_BYTES + P.HEADER.unpack(sent[:P.HEADER_BYTES])[5]
    answer = sent[first_len:first_len + P.HEADER_BYTES + P.HEADER.unpack(sent[first_len:first_len + 24])[5]]
    assert P.HEADER.unpack(answer[:P.HEADER_BYTES])[2] == P.Op.HELLO and b"proof" in answer
    sock = socket.create_connection(("127.0.0.1", secured.server.port), timeout=5)
    try:
        call(sock, P.Op.HELLO, P.encode_json({"client": "kvstore-python", "protocol": P.VERSION}))
        sock.sendall(answer)                             # the captured answer, to a new challenge
        head = sock.recv(P.HEADER_BYTES)
        assert P.parse_header(head, P.Limits(1 << 40, 1 << 30), reply=True).status == P.Status.AUTH
    finally:
        sock.close()
    assert secured.store.stats()["blocks"] == 0


@pytest.mark.parametrize("token", [None, "wrong", TOKEN[:-1]])
def test_a_wrong_or_missing_token_is_refused(secured, token):
    with pytest.raises(AuthError):
        Client(secured.address, token=token)


def test_a_cleartext_token_or_an_old_client_is_refused_with_a_clear_error(secured):
    sock = socket.create_connection(("127.0.0.1", secured.server.port), timeout=5)
    try:
        hdr, body = call(sock, P.Op.HELLO, P.encode_json({"client": "old", "protocol": 3, "token": TOKEN}))
        assert hdr.status == P.Status.AUTH and b"cleartext token" in body
    finally:
        sock.close()
    sock = socket.create_connection(("127.0.0.1", secured.server.port), timeout=5)
    try:   # a version-2 frame: refused naming the versions, before anything else is read
        body = P.encode_json({"client": "v2", "protocol": 2, "token": TOKEN})
        sock.sendall(P.HEADER.pack(P.MAGIC, 2, P.Op.HELLO, 1, 0, len(body), 0) + body)
        head = sock.recv(P.HEADER_BYTES)
        hdr = P.parse_header(head, P.Limits(1 << 40, 1 << 30), reply=True)
        message = sock.recv(hdr.body_len)
        assert hdr.status == P.Status.PROTOCOL and b"unsupported protocol version 2" in message
    finally:
        sock.close()
    with Client(secured.address, token=TOKEN) as c:  # and the proof is per connection: raw_hello works too
        sock = socket.create_connection(("127.0.0.1", secured.server.port), timeout=5)
        try:
            assert raw_hello(sock, TOKEN, client="raw")["protocol"] == P.VERSION
        finally:
            sock.close()
        assert c.ping() >= 0
