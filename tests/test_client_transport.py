"""The Client holds one transport, chosen at connect time (kvstore.net.client.selection):
every transport implements the Transport protocol, and a NIXL failure in the middle of
a save or a load redoes that batch over TCP, byte-exact, switches the client to TCP for
good and is counted once. The NIXL cases run a server in this process (UCX picks
cross-memory attach or TCP here)."""

from __future__ import annotations

import importlib.util
import inspect

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.block import checksum
from kvstore.errors import InvalidArgumentError, RemoteError, TransportError
from kvstore.net.client.nixl import NixlClientPath, NixlTransport
from kvstore.net.client.selection import Transport
from kvstore.net.client.shm import SameHostTransport
from kvstore.net.client.tcp import TcpTransport
from kvstore.testing import IN_CI, make_keys, payload
from tests._servers import ThreadServer, config_dict

BLOCK = 256 << 10
HAS_NIXL = importlib.util.find_spec("nixl") is not None or IN_CI


def _members(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and (callable(v) or isinstance(v, str))}


@pytest.mark.parametrize("cls", [TcpTransport, SameHostTransport, NixlTransport])
def test_every_transport_implements_the_protocol(cls):
    wanted = {n for n in vars(Transport) if not n.startswith("_")} | set(Transport.__annotations__)
    assert wanted == {"name", "start", "put", "get", "put_limit", "register", "close"}
    assert wanted <= _members(cls), wanted - _members(cls)
    for name in wanted - {"name"}:
        want = list(inspect.signature(getattr(Transport, name)).parameters)
        assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls, name)


def test_tcp_and_shm_clients_name_their_transport_and_round_trip():
    s = ThreadServer(config_dict("32MiB"))
    try:
        keys = make_keys(4, salt="names")
        srcs = [payload(i, BLOCK) for i in range(4)]
        for choice in ("tcp", "shm"):
            with Client(s.address, transport=choice) as c:
                assert c.transport == choice and type(c._transport).name == choice
                assert c.save(keys, srcs).result(10) == [True] * 4
                dsts = [np.full(BLOCK, 0xEE, np.uint8) for _ in keys]
                assert c.load(keys, dsts).result(10) == [True] * 4
                assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
    finally:
        s.stop()


def _given_checksums_are_sent_as_they_are(address: str, transport: str) -> None:
    keys = make_keys(3, salt=f"given-{transport}")
    srcs = [payload(60 + i, BLOCK) for i in range(3)]
    with Client(address, transport=transport, timeout_s=30) as c:
        assert c.transport == transport
        with pytest.raises(InvalidArgumentError, match="^3 keys but 2 checksums$"):
            c.save(keys, srcs, checksums=[checksum(srcs[0]), None])
        given = [checksum(srcs[0]), checksum(srcs[1]) ^ 1, None]   # right, wrong, hash it here
        assert c.save(keys, srcs, checksums=given).result(30) == [True, False, True]
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert c.load(keys, dsts).result(30) == [True, False, True]
        assert np.array_equal(dsts[0], srcs[0]) and np.array_equal(dsts[2], srcs[2])


def test_shm_staging_sends_the_writers_checksums_as_they_are():
    """The same-host path's staged put (blocks the server's arena had no slot for, or a
    read-only mapping) and its TCP fallback carry the writer's checksums too."""
    s = ThreadServer(config_dict("32MiB"))
    try:
        keys = make_keys(3, salt="given-staged")
        srcs = [payload(80 + i, BLOCK) for i in range(3)]
        given = [checksum(srcs[0]), checksum(srcs[1]) ^ 1, None]
        with Client(s.address, transport="shm", timeout_s=30) as c:
            transport = c._transport
            assert c._run(lambda conn: transport._staged_put(conn, keys, srcs, given)) == [True, False, True]
            more = make_keys(3, salt="given-staged-tcp")
            transport._staging_refused = True   # the server's staging refused: over the socket
            assert c._run(lambda conn: transport._staged_put(conn, more, srcs, given)) == [True, False, True]
            for ks in (keys, more):
                dsts = [np.zeros(BLOCK, np.uint8) for _ in ks]
                assert c.load(ks, dsts).result(30) == [True, False, True]
                assert np.array_equal(dsts[0], srcs[0]) and np.array_equal(dsts[2], srcs[2])
    finally:
        s.stop()


def test_tcp_and_shm_send_the_writers_checksums_as_they_are():
    """``save(checksums=...)`` (a spill from DRAM through the remote tier): the server
    checks the bytes against the writer's checksum, not a fresh hash, and refuses a
    mismatch."""
    s = ThreadServer(config_dict("32MiB"))
    try:
        for choice in ("tcp", "shm"):
            _given_checksums_are_sent_as_they_are(s.address, choice)
    finally:
        s.stop()


@pytest.fixture
def nixl_server():
    if not HAS_NIXL:
        pytest.skip("nixl is not installed (bash scripts/deps/60-nixl.sh installs it)")
    s = ThreadServer(config_dict("64MiB", transport="nixl"))
    yield s
    s.stop()


def _fail_once(monkeypatch, op: str) -> list[int]:
    calls = []

    def broken(self, *args, **kwargs):
        calls.append(1)
        raise TransportError(f"injected NIXL {op} failure")

    monkeypatch.setattr(NixlClientPath, op, broken)
    return calls


def test_a_nixl_failure_mid_load_redoes_the_batch_over_tcp(nixl_server, monkeypatch):
    keys = make_keys(6, salt="nixl-get-fails")
    srcs = [payload(10 + i, BLOCK) for i in range(6)]
    with Client(nixl_server.address, transport="nixl", timeout_s=30) as c:
        assert c.transport == "nixl"
        assert c.save(keys, srcs).result(30) == [True] * 6          # over NIXL
        calls = _fail_once(monkeypatch, "get")
        dsts = [np.full(BLOCK, 0xEE, np.uint8) for _ in keys]
        assert c.load(keys, dsts).result(30) == [True] * 6          # the same batch, over TCP
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts)), "wrong bytes after the fallback"
        assert len(calls) == 1 and c.transport == "tcp"
        assert c.fallbacks.stats() == {"nixl->tcp": 1}
        c.register(np.zeros(BLOCK, np.uint8))                       # a no-op on TCP
        missing = make_keys(1, salt="never-saved")
        more = [np.full(BLOCK, 7, np.uint8)]
        assert c.load(keys[:2] + missing, dsts[:2] + more).result(30) == [True, True, False]
        assert (more[0] == 7).all(), "a miss must leave the buffer untouched"
        assert len(calls) == 1 and c.fallbacks.total == 1          # TCP from now on, counted once
        assert c.stats()["server"]["nixl"]["gets"] == 0


def test_a_nixl_failure_mid_save_redoes_the_batch_over_tcp(nixl_server, monkeypatch):
    keys = make_keys(5, salt="nixl-put-fails")
    srcs = [payload(40 + i, BLOCK) for i in range(5)]
    with Client(nixl_server.address, transport="nixl", timeout_s=30) as c:
        assert c.transport == "nixl"
        calls = _fail_once(monkeypatch, "put")
        assert c.save(keys, srcs).result(30) == [True] * 5
        assert len(calls) == 1 and c.transport == "tcp" and c.fallbacks.stats() == {"nixl->tcp": 1}
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert c.load(keys, dsts).result(30) == [True] * 5
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts)), "wrong bytes after the fallback"
        assert c.stats()["server"]["nixl"]["puts"] == 0


def test_nixl_sends_the_writers_checksums_as_they_are(nixl_server):
    _given_checksums_are_sent_as_they_are(nixl_server.address, "nixl")


def test_a_nixl_failure_mid_save_redoes_it_over_tcp_with_the_writers_checksums(nixl_server, monkeypatch):
    keys = make_keys(3, salt="given-nixl-fallback")
    srcs = [payload(90 + i, BLOCK) for i in range(3)]
    with Client(nixl_server.address, transport="nixl", timeout_s=30) as c:
        calls = _fail_once(monkeypatch, "put")
        given = [checksum(srcs[0]), checksum(srcs[1]) ^ 1, None]
        assert c.save(keys, srcs, checksums=given).result(30) == [True, False, True]
        assert len(calls) == 1 and c.transport == "tcp"
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert c.load(keys, dsts).result(30) == [True, False, True]
        assert np.array_equal(dsts[0], srcs[0]) and np.array_equal(dsts[2], srcs[2])


def _agent_never_starts(monkeypatch) -> None:
    def broken(self, *args, **kwargs):
        raise TransportError("injected: the NIXL agent could not start")

    monkeypatch.setattr(NixlClientPath, "__init__", broken)


def test_an_explicit_nixl_whose_agent_cannot_start_is_an_error(nixl_server, monkeypatch):
    _agent_never_starts(monkeypatch)
    with pytest.raises(RemoteError, match="'nixl' but this client's NIXL agent could not start"):
        Client(nixl_server.address, transport="nixl", timeout_s=30)


def test_auto_whose_nixl_agent_cannot_start_uses_tcp_logged_and_counted(nixl_server, monkeypatch):
    _agent_never_starts(monkeypatch)
    keys = make_keys(3, salt="nixl-never-started")
    srcs = [payload(70 + i, BLOCK) for i in range(3)]
    with Client(nixl_server.address, transport="auto", timeout_s=30) as c:
        if c.transport == "shm":
            pytest.skip("this server offers shared memory to this host: auto never tries NIXL")
        assert c.transport == "tcp" and c.fallbacks.stats() == {"nixl->tcp": 1}
        assert c.save(keys, srcs).result(30) == [True] * 3
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert c.load(keys, dsts).result(30) == [True] * 3
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
