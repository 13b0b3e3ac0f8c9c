"""Misconfiguration never turns into wrong KV (issue 20, findings 4, 5 and 7): an arena
file or a socket path another live server holds is refused, never truncated or deleted;
an arena file that is a symlink, not private or not ours is refused; an arena larger
than its tmpfs is a clear error, not SIGBUS; files left by dead processes are reused."""

import os
import socket

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.server import Server
from kvstore.testing import make_keys, payload
from tests._servers import ThreadServer, config_dict
from tiers.dram import DramTier

KEYS = Namespace("m", "f16", 16).chunk_keys(np.arange(32, dtype=np.uint32))


def test_a_second_tier_on_a_live_arena_file_is_refused_and_the_first_keeps_its_bytes(tmp_path):
    path = str(tmp_path / "arena")
    first = DramTier(1 << 20, name="a", shm_path=path)
    first.write(KEYS[:1], [np.full(4096, 5, np.uint8)])
    with pytest.raises(ConfigError, match="in use by another live"):
        DramTier(1 << 20, name="b", shm_path=path)
    dst = np.empty(4096, np.uint8)
    assert first.read_into(KEYS[:1], [dst]) == [True] and (dst == 5).all()
    first.close()
    assert not os.path.exists(path)


def test_an_arena_file_left_by_a_dead_process_is_reused_from_zero(tmp_path):
    path = tmp_path / "arena"
    path.write_bytes(b"\xab" * (1 << 20))
    os.chmod(path, 0o600)
    tier = DramTier(1 << 20, name="a", shm_path=str(path))
    assert not tier.arena.any()
    tier.close()


@pytest.mark.parametrize("kind", ["symlink", "world-writable", "other-owner", "directory"])
def test_an_arena_path_that_is_not_a_private_file_of_ours_is_refused(tmp_path, kind):
    path = tmp_path / "arena"
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "world-writable":
        path.write_bytes(b"")
        os.chmod(path, 0o666)
    elif kind == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file to another user")
        path.write_bytes(b"")
        os.chmod(path, 0o600)
        os.chown(path, 65534, 65534)
    else:
        path.mkdir()
    with pytest.raises(ConfigError, match="shm_path"):
        DramTier(1 << 20, name="a", shm_path=str(path))
    assert victim.read_bytes() == b"keep me"


def test_an_arena_larger_than_its_file_system_is_a_clear_error(tmp_path):
    vfs = os.statvfs(tmp_path)
    too_big = vfs.f_bavail * vfs.f_frsize + (1 << 30)
    with pytest.raises(ConfigError, match="free"):
        DramTier(too_big, name="a", shm_path=str(tmp_path / "arena"))
    assert not (tmp_path / "arena").exists() or (tmp_path / "arena").stat().st_size == 0


def test_a_second_server_on_a_live_socket_path_is_refused_and_the_first_keeps_serving(tmp_path):
    sock_path = str(tmp_path / "kv.sock")
    first = ThreadServer(config_dict("4MiB", socket_path=sock_path))
    try:
        with pytest.raises(ConfigError, match="another live server"):
            second = Server(load_config(config_dict("4MiB", socket_path=sock_path), env={}))
            try:
                import asyncio
                asyncio.run(second.start())
            finally:
                second.store.close()
        keys = make_keys(1, salt="sock")
        with Client(first.address) as c:                 # same host: through the socket and arena
            assert c.save(keys, [payload(1, 8192)]).result(10) == [True]
            dst = np.zeros(8192, np.uint8)
            assert c.load(keys, [dst]).result(10) == [True] and np.array_equal(dst, payload(1, 8192))
        assert os.path.exists(sock_path)
    finally:
        first.stop()


def test_a_stale_socket_is_taken_over_and_a_non_socket_is_refused(tmp_path):
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()                                            # bound, nobody listening: a dead server's
    server = ThreadServer(config_dict("4MiB", socket_path=stale))
    server.stop()
    regular = tmp_path / "file.sock"
    regular.write_text("not a socket")
    with pytest.raises(ConfigError, match="not a socket"):
        ThreadServer(config_dict("4MiB", socket_path=str(regular)))
    assert regular.read_text() == "not a socket"


def test_arenas_left_by_killed_servers_are_removed_at_start_and_live_ones_kept(tmp_path):
    from kvstore.net.server import _paths

    dead = f"/dev/shm/kvstore-test-dead-{os.getpid()}"
    with open(dead, "wb") as f:
        f.write(b"x" * 4096)
    live = DramTier(1 << 20, name="live", shm_path=f"/dev/shm/kvstore-test-live-{os.getpid()}")
    try:
        assert _paths.remove_stale_arenas() >= 1
        assert not os.path.exists(dead) and os.path.exists(live.shm_path)
    finally:
        live.close()


def test_a_client_of_another_user_falls_back_to_tcp(tmp_path):
    """The arena is private to the server's user: a client running as another user uses
    TCP instead of failing with PermissionError."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user (nobody)")
    server = ThreadServer(config_dict("4MiB"))
    try:
        with Client(server.address) as c:                  # loads every module the child needs
            assert c.transport == "shm"
        keys = make_keys(1, salt="other-user")
        data = payload(9, 8192)                            # before the fork: nothing left to import
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)                          # nobody
                with Client(server.address) as c:
                    ok = c.save(keys, [data]).result(10) == [True]
                    dst = np.zeros(8192, np.uint8)
                    ok = ok and c.load(keys, [dst]).result(10) == [True] and np.array_equal(dst, data)
                    code = 0 if ok and c.transport == "tcp" else 2
            except BaseException:
                import traceback
                with open(f"/tmp/kvstore-child-{os.getpid()}.err", "w") as f:
                    traceback.print_exc(file=f)
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert server.store.contains(keys) == [True]
    finally:
        server.stop()


def test_a_client_never_pairs_one_servers_arena_with_another_servers_socket(tmp_path):
    """The server a client said HELLO to over TCP offers its arena and a socket path; if
    another server answers on that socket, the client uses the network path for
    everything."""
    first = ThreadServer(config_dict("4MiB"))
    other = ThreadServer(config_dict("4MiB"))
    try:
        with Client(first.address) as c:
            assert c.transport == "shm"
        real_path = first.server.socket_path
        first.server.socket_path = other.server.socket_path    # the first now advertises the other's socket
        keys = make_keys(1, salt="paired")
        with Client(first.address) as c:
            assert c.transport != "shm"                        # network path, to the first server only
            assert c.save(keys, [payload(4, 8192)]).result(10) == [True]
        assert first.store.contains(keys) == [True] and other.store.contains(keys) == [False]
        first.server.socket_path = real_path
    finally:
        first.stop()
        other.stop()


def test_sockets_left_by_killed_servers_are_removed_and_live_ones_kept(tmp_path):
    from kvstore.net.server import _paths

    dead = str(tmp_path / "kvstore-1-1.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(dead)
    s.close()
    live_path = str(tmp_path / "kvstore-2-2.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(live_path)
    live.listen(1)
    try:
        assert _paths.remove_stale_sockets(str(tmp_path)) == 1
        assert not os.path.exists(dead) and os.path.exists(live_path)
    finally:
        live.close()
