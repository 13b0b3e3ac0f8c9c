"""End-to-end: Client against a real server, over TCP and over the same-host path."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.net.client.wire import Conn, Address
from kvstore.client import Client
from kvstore.errors import BufferSizeError, InvalidArgumentError, RemoteError
from kvstore.net import protocol as P
from kvstore.testing import make_keys, payload
from tests._servers import ThreadServer, config_dict

BLOCK = 256 * 1024



@pytest.fixture
def server():
    s = ThreadServer(config_dict("64MiB", max_batch=16))
    yield s
    s.stop()


@pytest.fixture(params=["tcp", "shm"])
def client(request, server):
    c = Client(server.address, transport=request.param, timeout_s=10)
    assert c.transport == request.param
    yield c
    c.close()


def test_round_trip_and_batches(client):
    keys = make_keys(40, salt=client.transport)  # more than max_batch: split by the client
    srcs = [payload(i, BLOCK) for i in range(40)]
    assert client.save(keys, srcs).result() == [True] * 40
    dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
    assert client.load(keys, dsts).result() == [True] * 40
    for s, d in zip(srcs, dsts):
        assert np.array_equal(s, d)
    assert client.contains(keys[:3] + make_keys(1, salt="absent")) == [True, True, True, False]


def test_buffer_types(client):
    torch = pytest.importorskip("torch")
    key = make_keys(1, salt="types")
    src = payload(3, BLOCK)
    assert client.save(key, [torch.from_numpy(src.copy())]).result() == [True]
    for dst in (bytearray(BLOCK), torch.zeros(BLOCK // 4, dtype=torch.float32), np.zeros(BLOCK, np.uint8)):
        assert client.load(key, [dst]).result() == [True]
        got = dst.view(torch.uint8).numpy() if isinstance(dst, torch.Tensor) else np.frombuffer(dst, np.uint8)
        assert np.array_equal(got, src)


def test_miss_delete_and_sizes(client):
    keys = make_keys(3, salt="miss")
    assert client.save(keys[:2], [payload(0, BLOCK), payload(1, 4096)]).result() == [True, True]
    dsts = [np.zeros(BLOCK, np.uint8), np.zeros(4096, np.uint8), np.zeros(BLOCK, np.uint8)]
    assert client.load(keys, dsts).result() == [True, True, False]
    with pytest.raises(BufferSizeError):
        client.load(keys[:1], [np.zeros(BLOCK - 1, np.uint8)]).result()
    assert client.delete(keys) == 2
    assert client.load(keys[:1], dsts[:1]).result() == [False]
    with pytest.raises(InvalidArgumentError):
        client.save([keys[0], keys[0]], [payload(0, 8), payload(0, 8)])


def test_lookup_lease_protects_from_eviction(server):
    client = Client(server.address, transport="tcp")
    try:
        n = 64 * 1024 * 1024 // BLOCK
        first = make_keys(8, salt="leased")
        assert all(client.save(first, [payload(i, BLOCK) for i in range(8)]).result())
        assert client.lookup(first + make_keys(1, salt="nope"), lease_s=60) == 8
        assert server.store.stats()["leases"] == 8
        # Fill the whole tier again: leased blocks must survive eviction.
        filler = make_keys(n, salt="filler")
        for lo in range(0, n, 16):
            client.save(filler[lo:lo + 16], [payload(i, BLOCK) for i in range(lo, min(n, lo + 16))]).result()
        assert client.contains(first) == [True] * 8
        dsts = [np.zeros(BLOCK, np.uint8) for _ in first]
        assert client.load(first, dsts).result() == [True] * 8  # loading ends the leases
        assert server.store.stats()["leases"] == 0
        assert client.lookup(first, lease_s=60) == 8
        client.release(first)
        assert server.store.stats()["leases"] == 0
    finally:
        client.close()


def test_shm_lease_keeps_slot_until_done(server):
    client = Client(server.address, transport="shm")
    conn = Conn(Address.parse(server.server.socket_path), None, 10)
    try:
        key = make_keys(1, salt="slot")
        src = payload(11, BLOCK)
        assert client.save(key, [src]).result() == [True]
        _, body = conn.call(P.Op.SHM_GET, P.encode_records(P.SIZED, key, [BLOCK]))
        lid, placed = P.decode_placed(body, 1)
        assert lid and placed[0]["where"] == P.WHERE_ARENA
        off = int(placed[0]["offset"])
        arena = client._transport.arena.array
        # Delete the block and write others: the leased slot must not be reused.
        assert client.delete(key) == 1
        others = make_keys(200, salt="reuse")
        for lo in range(0, 200, 16):
            client.save(others[lo:lo + 16], [np.zeros(BLOCK, np.uint8)] * len(others[lo:lo + 16])).result()
        assert np.array_equal(arena[off:off + BLOCK], src)
        assert server.server.stats()["server"]["leased_bytes"] >= BLOCK
        conn.send(P.Op.SHM_DONE, P.encode_u64(lid))
        conn.call(P.Op.PING)
        assert server.server.stats()["server"]["leased_bytes"] == 0
    finally:
        conn.close()
        client.close()


def test_lower_tier_blocks_are_served(tmp_path):
    # A tiny first tier spills into a second one; gets of spilled blocks go through
    # the Store's load (TCP) or the client's staging region (shared memory).
    tiers = [{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False},
             {"name": "warm", "kind": "dram", "capacity": "32MiB", "pin": False}]
    s = ThreadServer(config_dict(tiers=tiers))
    try:
        for transport in ("tcp", "shm"):
            c = Client(s.address, transport=transport)
            keys = make_keys(12, salt=transport)
            srcs = [payload(i, BLOCK) for i in range(12)]
            assert all(c.save(keys, srcs).result())
            assert s.store.stats()["tiers"][1]["blocks"] >= 8
            if transport == "shm":
                c._run(lambda conn: conn.attach_staging(c._staging_bytes))  # else the first get attaches it
            dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert c.load(keys, dsts).result() == [True] * 12
            for a, b in zip(srcs, dsts):
                assert np.array_equal(a, b)
            c.close()
    finally:
        s.stop()


def test_shm_refused_without_shared_arena():
    s = ThreadServer(config_dict(transport="tcp"))
    try:
        with pytest.raises(RemoteError):
            Client(s.address, transport="shm")
        with Client(s.address) as c:
            assert c.transport == "tcp"
    finally:
        s.stop()


def test_stats_and_ping(client):
    assert client.ping() > 0
    stats = client.stats()
    assert stats["tiers"][0]["name"] == "hot"
    assert stats["server"]["connections"] >= 1


def test_idle_connections_are_closed_and_the_client_reconnects():
    s = ThreadServer(config_dict(idle_timeout_s=0.3))
    try:
        with Client(s.address, transport="tcp", pool_size=1) as c:
            key = make_keys(1, salt="idle")
            assert c.save(key, [payload(5, 4096)]).result(10) == [True]
            assert s.server.stats()["server"]["connections"] == 1
            deadline = time.monotonic() + 10
            while s.server.stats()["server"]["connections"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert s.server.stats()["server"]["connections"] == 0  # the server closed it
            dst = np.zeros(4096, np.uint8)
            assert c.load(key, [dst]).result(10) == [True]  # transparently reconnected
            assert np.array_equal(dst, payload(5, 4096))
    finally:
        s.stop()


def test_connectors_open_a_client_to_the_server(server):
    from kvstore.connectors._store_handle import open_store, release_store

    from kvstore.connectors._server_store import ServerStore

    store = open_store({"server": server.address}, owner="test")
    try:
        assert isinstance(store, ServerStore) and isinstance(store.client, Client)
        key = make_keys(1, salt="connector")
        assert store.save(key, [payload(8, 4096)]).result(10) == [True]
        dst = np.zeros(4096, np.uint8)
        assert store.load(key, [dst]).result(10) == [True] and np.array_equal(dst, payload(8, 4096))
    finally:
        release_store(store)
