"""Another OS user on the same host (issue 20, finding 5; run as root, which creates the
user ``kvstore-test``, see ``tests/_users.py``; skipped with the reason elsewhere): a
file or symlink that user planted at a server's ``shm_path`` is refused and never
filled, and the arena and socket a server creates are closed to that user."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest

from kvstore.errors import ConfigError
from tests._servers import ThreadServer, config_dict
from tests._users import other_user, run_as


@pytest.fixture
def shared_dir():
    """A sticky, world-writable directory on tmpfs, as /dev/shm is."""
    path = tempfile.mkdtemp(prefix="kvstore-test-users-", dir="/dev/shm")
    os.chmod(path, 0o1777)
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def _arena_config(path: str) -> dict:
    return config_dict(tiers=[{"name": "hot", "kind": "dram", "capacity": "1MiB", "pin": False, "shm_path": path}])


def test_an_arena_file_another_user_planted_world_readable_is_refused_and_never_filled(shared_dir):
    uid, gid = other_user()
    path = os.path.join(shared_dir, "arena")

    def plant() -> int:
        os.umask(0)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666))
        return 0

    assert run_as(uid, gid, plant) == 0
    with pytest.raises(ConfigError, match="not a private file of this user"):
        ThreadServer(_arena_config(path))
    st = os.stat(path)
    assert st.st_uid == uid and st.st_size == 0                   # never sized, never written

    def read_back() -> int:
        with open(path, "rb") as f:
            return 0 if f.read() == b"" else 1

    assert run_as(uid, gid, read_back) == 0


def test_a_symlink_another_user_planted_at_shm_path_is_refused_and_its_target_kept(shared_dir, tmp_path):
    uid, gid = other_user()
    victim = tmp_path / "root-owned"
    victim.write_bytes(b"root's file")
    os.chmod(victim, 0o644)
    path = os.path.join(shared_dir, "arena")

    def plant() -> int:
        os.symlink(str(victim), path)
        return 0

    assert run_as(uid, gid, plant) == 0
    with pytest.raises(ConfigError, match="symlinks are refused"):
        ThreadServer(_arena_config(path))
    assert victim.read_bytes() == b"root's file"


def test_the_servers_arena_and_socket_are_closed_to_another_user():
    uid, gid = other_user()
    server = ThreadServer(config_dict("4MiB"))
    try:
        arena, sock_path = server.server.arena.path, server.server.socket_path
        assert os.stat(arena).st_mode & 0o777 == 0o600 and os.stat(sock_path).st_mode & 0o777 == 0o600

        def probe() -> int:
            try:
                os.close(os.open(arena, os.O_RDONLY))
                return 1                                           # could read the cache
            except PermissionError:
                pass
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(sock_path)
                return 2                                           # could reach the control socket
            except PermissionError:
                return 0
            finally:
                s.close()

        assert run_as(uid, gid, probe) == 0
    finally:
        server.stop()
