"""The server's files on this host: claiming its Unix socket path without ever taking
a live server's, and removing the arenas and sockets that killed servers left behind;
and whether an address is loopback."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import socket
import stat

from kvstore.config import is_loopback   # re-exported: the one rule, with the pre-start checks
from kvstore.errors import ConfigError
from kvstore.net.staging import STAGING_PREFIX

log = logging.getLogger("kvstore.server")

SHM_DIR = "/dev/shm"
ARENA_PREFIX = "kvstore-"


def remove_stale_arenas() -> int:
    """Remove the arenas that servers killed before they could clean up left under
    ``/dev/shm``: this user's ``kvstore-*`` files that no live process holds (a live
    server keeps an exclusive lock on its arena). Returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(ARENA_PREFIX) or name.startswith(STAGING_PREFIX):
            continue   # a live client's staging region holds no lock: never taken for a dead arena
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue                       # a live server's
            os.unlink(path)
            removed += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d arena(s) left under %s by servers that died", removed, SHM_DIR)
    return removed


def remove_stale_sockets(directory: str) -> int:
    """Remove the ``kvstore-*.sock`` sockets of this user in ``directory`` that no server
    answers on any more (left by servers that were killed). Returns how many."""
    removed = 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(ARENA_PREFIX) and n.endswith(".sock")]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if _owner_alive(name):
            continue                       # a server still starting: bound, not yet listening
        try:
            take_socket_path(path)
            removed += not os.path.exists(path)
        except ConfigError:
            continue                       # a live server's
    return removed


def _owner_alive(name: str) -> bool:
    """Whether the process named in an automatic socket's name (``kvstore-PORT-PID.sock``)
    still runs. Between its bind and its listen a starting server's socket refuses
    connections like a dead one's; removing it then broke that server's start."""
    m = re.fullmatch(r"kvstore-\d+-(\d+)\.sock", name)
    if m is None:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def take_socket_path(path: str) -> None:
    """Make ``path`` free for this server's socket: a socket no server answers on (left by
    a crashed one) is removed; a live server's socket, or anything that is not a socket,
    is never touched."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"server.socket_path {path!r} exists and is not a socket; remove it or choose another")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)                 # nobody listens: stale
        return
    except OSError as exc:
        raise ConfigError(f"server.socket_path {path!r} cannot be checked: {exc}") from exc
    finally:
        probe.close()
    raise ConfigError(f"server.socket_path {path!r} belongs to another live server; give each server its own")


__all__ = ["ARENA_PREFIX", "SHM_DIR", "is_loopback", "remove_stale_arenas", "remove_stale_sockets", "take_socket_path"]
