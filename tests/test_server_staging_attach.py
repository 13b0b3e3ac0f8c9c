"""Issue 20 (review F3): SHM_ATTACH maps a client's staging region read-write, so a
connection may attach only the region its own process created: only on the Unix socket
(never over TCP), named with the peer's pid and owned by the peer's uid (SO_PEERCRED),
and never with tenants. A client that attaches its own region still puts and gets."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from kvstore.net.client.wire import ClientStaging
from kvstore.client import Client
from kvstore.net import protocol as P
from kvstore.net.staging import STAGING_DIR, STAGING_PREFIX
from kvstore.testing import make_keys, payload
from tests._hello import call, raw_hello
from tests._servers import ThreadServer, config_dict

NBYTES = 1 << 20


@pytest.fixture(scope="module")
def server():
    s = ThreadServer(config_dict("16MiB"))
    yield s
    s.stop()


def _unix(server) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(server.server.socket_path)
    raw_hello(sock)
    return sock


def _attach(sock: socket.socket, path: str, nbytes: int = NBYTES) -> tuple[P.Header, bytes]:
    return call(sock, P.Op.SHM_ATTACH, P.encode_json({"path": path, "nbytes": nbytes}), rid=5)


def _region(name_pid: int) -> str:
    path = os.path.join(STAGING_DIR, f"{STAGING_PREFIX}{name_pid}-{os.urandom(6).hex()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, NBYTES)
    finally:
        os.close(fd)
    return path


def test_own_region_attaches_on_the_unix_socket(server):
    staging = ClientStaging(NBYTES)
    sock = _unix(server)
    try:
        hdr, body = _attach(sock, staging.path)
        assert hdr.status == P.Status.OK, body
    finally:
        sock.close()
        staging.unlink()
        staging.close()
    keys = make_keys(2, salt="f3-own")
    srcs = [payload(90 + i, 256 * 1024) for i in range(2)]
    with Client(server.address, transport="shm") as c:   # a read-only arena: staged puts
        c._transport.arena.writable = False
        assert c.save(keys, srcs).result(10) == [True, True]
        dsts = [np.zeros(256 * 1024, np.uint8) for _ in keys]
        assert c.load(keys, dsts).result(10) == [True, True]
        assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))


def test_shm_attach_over_tcp_is_refused(server):
    staging = ClientStaging(NBYTES)
    sock = socket.create_connection(("127.0.0.1", server.server.port))
    try:
        raw_hello(sock)
        hdr, body = _attach(sock, staging.path)
        assert hdr.status == P.Status.UNAVAILABLE and b"Unix socket" in body
    finally:
        sock.close()
        staging.unlink()
        staging.close()


def test_another_processs_region_is_refused(server):
    other = os.getppid() if os.getppid() != os.getpid() else 1
    path = _region(other)           # this uid's file, but named for another process
    sock = _unix(server)
    try:
        hdr, body = _attach(sock, path)
        assert hdr.status == P.Status.INVALID and b"not created by this connection's process" in body
    finally:
        sock.close()
        os.unlink(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file another user owns")
def test_a_region_another_user_owns_is_refused(server):
    path = _region(os.getpid())     # named for this process, owned by someone else
    os.chown(path, 65534, 65534)
    sock = _unix(server)
    try:
        hdr, body = _attach(sock, path)
        assert hdr.status == P.Status.INVALID and b"not owned by this connection's user" in body
    finally:
        sock.close()
        os.unlink(path)


def test_shm_attach_with_tenants_is_refused(tmp_path):
    tenants = [{"name": "a", "token": "token-of-a", "salt": "salt-of-tenant-a-0001"}]
    s = ThreadServer(config_dict("16MiB", tenants=tenants, socket_path=str(tmp_path / "kv.sock")))
    staging = ClientStaging(NBYTES)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(s.server.socket_path)
        raw_hello(sock, "token-of-a")
        hdr, body = _attach(sock, staging.path)
        assert hdr.status == P.Status.UNAVAILABLE and b"tenants" in body
    finally:
        sock.close()
        staging.unlink()
        staging.close()
        s.stop()


def test_a_client_whose_region_is_refused_puts_and_gets_over_the_socket(monkeypatch):
    # A client the server cannot tell from its pid (another PID namespace, here a
    # region named for another pid): SHM_ATTACH is refused, its staged blocks go over
    # the socket instead, and nothing fails.
    tiers = [{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False},
             {"name": "warm", "kind": "dram", "capacity": "16MiB", "pin": False}]
    s = ThreadServer(config_dict(tiers=tiers))
    try:
        keys = make_keys(8, salt="f3-refused")
        srcs = [payload(100 + i, 256 * 1024) for i in range(8)]
        with Client(s.address, transport="shm") as c:
            c._transport.arena.writable = False
            real_pid = os.getpid
            monkeypatch.setattr(os, "getpid", lambda: real_pid() + 1)   # the region's name
            assert c.save(keys, srcs).result(10) == [True] * 8           # 4 spill to warm
            monkeypatch.undo()
            dsts = [np.zeros(256 * 1024, np.uint8) for _ in keys]
            assert c.load(keys, dsts).result(10) == [True] * 8          # warm blocks: the socket
            assert all(np.array_equal(a, b) for a, b in zip(srcs, dsts))
            assert c._transport._staging_refused
    finally:
        s.stop()
