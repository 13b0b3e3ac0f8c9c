"""Same-host puts that write straight into reserved arena slots (SHM_RESERVE /
SHM_COMMIT): published only on commit, freed on abort or when the client's connection
goes away, bounded by the per-client in-flight limit; the staging path still works
where a client cannot write the arena."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.net.client.wire import Address, ArenaMap, Conn
from kvstore.block import checksum
from kvstore.client import Client
from kvstore.errors import InvalidArgumentError, RemoteError
from kvstore.net import protocol as P
from kvstore.testing import make_keys, payload
from tests._servers import ThreadServer, config_dict

BLOCK = 256 * 1024


@pytest.fixture
def server():
    s = ThreadServer(config_dict("16MiB", max_inflight_bytes="4MiB"))
    yield s
    s.stop()


def _conn(server) -> Conn:
    return Conn(Address.parse(server.server.socket_path), None, 10)


def _reserve(conn: Conn, keys, sizes) -> tuple[int, np.ndarray]:
    _, body = conn.call(P.Op.SHM_RESERVE, P.encode_records(P.SIZED, keys, sizes))
    return P.decode_placed(body, len(keys))


def _saves_and_loads_back(client: Client, keys) -> None:
    """Every key saves through ``client`` and loads back byte-exact."""
    srcs = [payload(i, BLOCK) for i in range(len(keys))]
    assert client.save(keys, srcs).result() == [True] * len(keys)
    dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
    assert client.load(keys, dsts).result() == [True] * len(keys)
    assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))


def _wait(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_reserved_slots_are_published_on_commit_only(server):
    conn = _conn(server)
    arena = ArenaMap(conn.info["shm"])
    reader = Client(server.address, transport="shm")
    try:
        assert arena.writable
        keys = make_keys(3, salt="commit")
        srcs = [payload(i, BLOCK) for i in range(3)]
        rid, placed = _reserve(conn, keys, [BLOCK] * 3)
        assert rid and placed["nbytes"].tolist() == [BLOCK] * 3
        assert placed["offset"].tolist() == sorted(placed["offset"].tolist())  # one batch, adjacent slots
        for src, off in zip(srcs, placed["offset"].tolist()):
            arena.array[off:off + BLOCK] = src
        assert reader.contains(keys) == [False] * 3  # written, not yet visible
        _, body = conn.call(P.Op.SHM_COMMIT, P.encode_commit(rid, True, [checksum(s) for s in srcs]))
        assert P.decode_flags(body, 3) == [True] * 3
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert reader.load(keys, dsts).result() == [True] * 3
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
        # Already stored: nothing to write, no reservation to end.
        rid, placed = _reserve(conn, keys, [BLOCK] * 3)
        assert rid == 0 and placed["nbytes"].tolist() == [P.PRESENT] * 3
        assert server.server.stats()["server"]["leased_bytes"] == 0
    finally:
        arena.close()
        conn.close()
        reader.close()


def test_a_commit_publishes_only_blocks_that_match_the_clients_checksums(server):
    conn = _conn(server)
    arena = ArenaMap(conn.info["shm"])
    try:
        keys = make_keys(3, salt="commit-sums")
        srcs = [payload(40 + i, BLOCK) for i in range(3)]
        rid, placed = _reserve(conn, keys, [BLOCK] * 3)
        for src, off in zip(srcs, placed["offset"].tolist()):
            arena.array[off:off + BLOCK] = src
        sums = [checksum(s) for s in srcs]
        arena.array[int(placed["offset"][1]) + 17] ^= 0x01      # changed after the client hashed it
        with pytest.raises(InvalidArgumentError, match="carries 2 checksums for 3 keys"):
            conn.call(P.Op.SHM_COMMIT, P.encode_commit(rid, True, sums[:2]))
        _, body = conn.call(P.Op.SHM_COMMIT, P.encode_commit(rid, True, sums))
        assert P.decode_flags(body, 3) == [True, False, True]
        assert server.store.contains(keys) == [True, False, True]
        assert server.store.stats()["tiers"][0]["refused_writes"] == 1
    finally:
        arena.close()
        conn.close()


def test_abort_and_a_dead_client_free_the_slots(server):
    used0 = server.store.stats()["tiers"][0]["used_bytes"]
    keys = make_keys(4, salt="abort")
    conn = _conn(server)
    try:
        rid, _ = _reserve(conn, keys[:2], [BLOCK] * 2)
        assert server.server.stats()["server"]["leased_bytes"] == 2 * BLOCK
        _, body = conn.call(P.Op.SHM_COMMIT, P.encode_commit(rid, False))
        assert P.decode_flags(body, 2) == [False, False]
        assert server.store.contains(keys[:2]) == [False, False]
        assert server.store.stats()["tiers"][0]["used_bytes"] == used0
        _reserve(conn, keys[2:], [BLOCK] * 2)  # then the client dies before committing
    finally:
        conn.close()
    assert _wait(lambda: server.server.stats()["server"]["leased_bytes"] == 0)
    assert server.store.contains(keys) == [False] * 4
    assert server.store.stats()["tiers"][0]["used_bytes"] == used0
    with Client(server.address, transport="shm") as c:  # the room is usable again
        _saves_and_loads_back(c, keys)


def test_bad_commits_and_limits_are_refused(server):
    conn = _conn(server)
    try:
        with pytest.raises(InvalidArgumentError, match="no open reservation"):
            conn.call(P.Op.SHM_COMMIT, P.encode_commit(12345, True))
        with pytest.raises(RemoteError, match="max_inflight_bytes"):  # 8 MiB reserved > 4 MiB allowed
            _reserve(conn, make_keys(32, salt="big"), [BLOCK] * 32)
        with pytest.raises(InvalidArgumentError):
            _reserve(conn, make_keys(1, salt="empty"), [0])
        conn.call(P.Op.PING)  # the connection is still good
        assert server.server.stats()["server"]["leased_bytes"] == 0
    finally:
        conn.close()


def test_client_without_arena_write_access_puts_through_staging(server):
    with Client(server.address, transport="shm") as c:
        c._transport.arena.writable = False  # as for a process of another user: read-only map
        keys = make_keys(6, salt="staged")
        _saves_and_loads_back(c, keys)
    # the server's request counters show which path the bytes took: staging, never a reservation
    assert _requests(server, "SHM_PUT") >= 1
    assert _requests(server, "SHM_RESERVE") == 0 and _requests(server, "SHM_COMMIT") == 0


def _requests(server, op: str) -> float:
    """Requests of ``op`` the server answered OK (its ``kvstore_requests`` counter)."""
    value = server.server.metrics.registry.get_sample_value("kvstore_requests_total", {"op": op, "status": "OK"})
    return value or 0.0


def test_client_put_larger_than_the_limit_is_split_and_stored(server):
    with Client(server.address, transport="shm", staging_bytes=2 << 20) as c:
        keys = make_keys(24, salt="split")  # 6 MiB: more than one 4 MiB reservation
        _saves_and_loads_back(c, keys)
