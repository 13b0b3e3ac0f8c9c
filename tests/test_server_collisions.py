"""Misconfiguration never turns into wrong KV (issue 20, findings 4, 5 and 7): an arena
file or a socket path another live server holds is refused, never truncated or deleted;
an arena file that is a symlink, not private or not ours is refused; an arena larger
than its tmpfs is a clear error, not SIGBUS; files left by dead processes are reused."""

import os
import socket
import subprocess

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.server import Server
from kvstore.testing import make_keys, payload
from tests._servers import ThreadServer, config_dict
from tests._users import other_user
from kvstore.tiers.dram import DramTier

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
        uid, gid = other_user()                              # skips unless root
        path.write_bytes(b"")
        os.chmod(path, 0o600)
        os.chown(path, uid, gid)
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
    uid, gid = other_user()                                # skips unless root
    # transport shm: same-host or TCP, never NIXL (an auto server offers NIXL too, and a
    # client that cannot map the arena then takes NIXL where its agent starts)
    server = ThreadServer(config_dict("4MiB", transport="shm"))
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
                os.setgid(gid)
                os.setuid(uid)                            # the second user
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

    gone = _a_dead_pid()
    dead = str(tmp_path / f"kvstore-1-{gone}.sock")
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


def _a_dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_starting_servers_socket_is_not_taken_for_stale(tmp_path):
    """Between bind and listen a server's socket refuses connections like a dead one's;
    another server starting then must not remove it (its chmod failed with ENOENT)."""
    from kvstore.net.server import _paths

    path = str(tmp_path / f"kvstore-7480-{os.getpid()}.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)          # bound, not listening: as a server between its bind and its listen
    try:
        assert _paths.remove_stale_sockets(str(tmp_path)) == 0
        assert os.path.exists(path)
    finally:
        s.close()


def test_two_servers_given_the_same_shm_path_the_second_refuses_and_the_first_keeps_serving(tmp_path):
    """Two servers on one shm_path once both started; the second truncated the first's
    arena, which then served wrong bytes as True."""
    path = f"/dev/shm/kvstore-test-two-{os.getpid()}"
    raw = config_dict(tiers=[{"name": "hot", "kind": "dram", "capacity": "4MiB", "pin": False, "shm_path": path}])
    first = ThreadServer(raw)
    try:
        keys = make_keys(2, salt="two-servers")
        with Client(first.address) as c:
            assert c.transport == "shm"
            assert c.save(keys, [payload(1, 65536), payload(2, 65536)]).result(10) == [True, True]
            with pytest.raises(ConfigError, match="in use by another live"):
                ThreadServer(raw)
            dsts = [np.zeros(65536, np.uint8) for _ in keys]
            assert c.load(keys, dsts).result(10) == [True, True]          # the same client, its mapping intact
            assert np.array_equal(dsts[0], payload(1, 65536)) and np.array_equal(dsts[1], payload(2, 65536))
        with Client(first.address, transport="tcp") as c:
            dst = np.zeros(65536, np.uint8)
            assert c.load(keys[:1], [dst]).result(10) == [True] and np.array_equal(dst, payload(1, 65536))
    finally:
        first.stop()
    assert not os.path.exists(path)


def test_a_sigkilled_servers_arena_and_socket_are_removed_by_the_next_server(tmp_path):
    from tests._servers import ProcessServer

    dead = ProcessServer(config_dict("4MiB"), tmp_path)
    arena, sock_path = dead.shm_path, dead.socket_path
    assert arena and sock_path
    dead.proc.kill()                                      # SIGKILL: no cleanup of its own
    dead.proc.wait(10)
    assert os.path.exists(arena) and os.path.exists(sock_path)
    second = ProcessServer(config_dict("4MiB"), tmp_path)
    try:
        assert not os.path.exists(arena) and not os.path.exists(sock_path)
        assert os.path.exists(second.shm_path) and os.path.exists(second.socket_path)
    finally:
        second.kill()
        dead.kill()


def test_a_server_whose_arena_outgrows_dev_shm_exits_with_a_message_not_sigbus(tmp_path):
    """An arena larger than the tmpfs once killed the server with SIGBUS and no message."""
    import subprocess
    import sys

    import yaml

    from tests._servers import ROOT

    vfs = os.statvfs("/dev/shm")
    too_big = vfs.f_bavail * vfs.f_frsize + (1 << 30)
    cfg = tmp_path / "big.yaml"
    cfg.write_text(yaml.safe_dump(config_dict(f"{too_big}B")))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KVSTORE_CONFIG", None)
    out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(cfg)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])     # a ConfigError, not -SIGBUS
    assert "free" in out.stderr and "Traceback" not in out.stderr


def test_a_server_that_fails_to_start_leaves_nothing_listening(tmp_path):
    """A start refused half-way (here: a socket path that is not a socket) closes the
    TCP listener it had opened and stops its accept loop."""
    import asyncio

    regular = tmp_path / "file.sock"
    regular.write_text("not a socket")
    server = Server(load_config(config_dict("4MiB", socket_path=str(regular)), env={}))

    async def attempt():
        with pytest.raises(ConfigError, match="not a socket"):
            await server.start()
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    try:
        assert asyncio.run(attempt()) == []
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.port), timeout=2)
    finally:
        server.store.close()
    assert regular.read_text() == "not a socket"
