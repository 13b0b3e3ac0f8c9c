"""Server side of the same-host path: the shared DRAM arena, slot leases, and the
staging regions clients create for puts.

Design (see ``docs/protocol.md``): the first tier's arena is a file under ``/dev/shm``
that local clients map read-only. A get leases the slots (a :meth:`Store.borrow` held
open) and replies with their offsets; the client copies out once and sends SHM_DONE,
which ends the lease. Leases also end when the connection closes or after
``shm_lease_s``. A put goes through a staging region the *client* owns: it copies its
blocks there and the server copies them into store slots (one memcpy on each side), so
the server never hands out writable arena memory and a crashed client cannot leave a
half-written slot behind.
"""

from __future__ import annotations

import mmap
import os
import stat
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from kvstore.errors import InvalidArgumentError
from kvstore.net.staging import STAGING_DIR, STAGING_PREFIX
from kvstore.tiers.base import HostArena, Tier


@dataclass(frozen=True)
class Arena:
    """Where local clients find the first tier's memory."""

    path: str
    nbytes: int
    base_address: int   # the arena's address in the server, to turn views into offsets
    device: int
    inode: int

    @classmethod
    def of(cls, tier: Tier) -> "Arena | None":
        """The tier's arena when it declares a host arena backed by a shared file."""
        if not tier.capabilities.host_arena:
            return None
        host = cast(HostArena, tier)
        path = host.shm_path
        if not path:
            return None
        st = os.stat(path)
        return cls(path, st.st_size, host.arena.ctypes.data, st.st_dev, st.st_ino)

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "nbytes": self.nbytes, "dev": self.device, "ino": self.inode}


class Lease:
    """Slots held for a client's copy: a :meth:`Store.borrow` kept open. ``release``
    is idempotent and may run from the event loop or a reaper."""

    def __init__(self, borrow: AbstractContextManager) -> None:
        self._cm = borrow
        self.views = borrow.__enter__()
        self.nbytes = 0
        self.created = time.monotonic()

    def release(self) -> None:
        cm, self._cm = self._cm, None
        if cm is not None:
            self.views = []
            cm.__exit__(None, None, None)


class Staging:
    """A client's staging region mapped into the server (read-write, shared)."""

    def __init__(self, mm: mmap.mmap, nbytes: int) -> None:
        self._mmap = mm
        self.nbytes = nbytes
        self.array = np.frombuffer(mm, dtype=np.uint8, count=nbytes)

    @classmethod
    def attach(cls, path: Any, nbytes: Any, max_bytes: int, *, peer_pid: int, peer_uid: int) -> "Staging":
        """Map the region at ``path``, which must be the one the connection's peer
        created (``peer_pid``, ``peer_uid``: its SO_PEERCRED): named
        ``kvstore-client-<peer_pid>-*`` and owned by ``peer_uid``. Another client's
        region, even one this server can open, is refused."""
        if not isinstance(path, str) or os.path.dirname(path) != STAGING_DIR \
                or not os.path.basename(path).startswith(STAGING_PREFIX):
            raise InvalidArgumentError(f"staging path must be {STAGING_DIR}/{STAGING_PREFIX}*, got {path!r}")
        if os.path.basename(path)[len(STAGING_PREFIX):].split("-", 1)[0] != str(peer_pid):
            raise InvalidArgumentError(f"staging region {path} was not created by this connection's "
                                       f"process (pid {peer_pid})")
        if not isinstance(nbytes, int) or not 0 < nbytes <= max_bytes:
            raise InvalidArgumentError(f"staging size must be in (0, {max_bytes}], got {nbytes!r}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot open staging region {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != peer_uid:
                raise InvalidArgumentError(f"staging region {path} is not owned by this connection's "
                                           f"user (uid {peer_uid})")
            if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
                raise InvalidArgumentError(f"staging region {path} is not a {nbytes}-byte file")
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        return cls(mm, nbytes)

    def slice(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise InvalidArgumentError(f"staging range [{offset}, {offset + nbytes}) is outside the "
                                       f"{self.nbytes}-byte region")
        return self.array[offset:offset + nbytes]

    def close(self) -> None:
        self.array = np.empty(0, np.uint8)
        try:
            self._mmap.close()
        except BufferError:  # a store copy still holds a view; the GC unmaps it later
            pass
