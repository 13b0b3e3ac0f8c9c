"""The cache client's same-host data path: blocks move through the server's DRAM arena,
mapped into this process (reserve, fill in place, commit; or read a leased slot), or
through a staging region the client owns when it may only read the arena. Blocks the
server holds only below its first tier come over the socket (:mod:`kvstore.net.client.tcp`).

Both directions are verified: a put hashes each block as it copies it out of the
caller's buffer and sends the checksums with SHM_COMMIT / SHM_PUT (the server publishes
only matching blocks); a get hashes each block in the caller's buffer as it copies it
there (the copy, not the arena slot it came from) and reports ``True`` only where it
matches the checksum the server keeps for the slot.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from kvstore.buffers import nbytes_of
from kvstore.buffers.host import copy_batch, copy_batch_hashed
from kvstore.buffers.views import is_device
from kvstore.errors import InvalidArgumentError, KVStoreError, RemoteError
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.net.client.tcp import Integrity, raise_mismatch, tcp_get, tcp_put
from kvstore.net.client.wire import Address, ArenaMap, Conn

log = logging.getLogger("kvstore.client")


def same_server_socket(address: Address, path: str, instance: Any, connect: Callable[[Address], Conn]) -> Conn | None:
    """A connection (``connect``) to the server's Unix socket at ``path`` when the server
    answering there is the one at ``address`` (its HELLO names ``instance``), else ``None``
    (logged: the client then stays on TCP)."""
    addr = Address(None, None, path)
    try:
        probe = connect(addr)
    except (OSError, KVStoreError) as exc:
        log.info("server %s: its socket %s is not usable (%s); using TCP", address, path, exc)
        return None
    if probe.info.get("instance") != instance:
        log.warning("server %s: another server answers on its socket %s; using TCP", address, path)
        probe.close()
        return None
    return probe


class SameHostTransport:
    """Puts and gets through ``arena`` (the server's, mapped here; owned by this
    transport from now on, unmapped by :meth:`close`). ``copy_threads`` split large
    copies (a pool of ``copy_threads - 1`` helpers, owned here); ``staging_bytes`` sizes
    the staging region and bounds one put batch. Thread-safe: each call works on the
    connection it is given."""

    name = "shm"

    def __init__(self, arena: ArenaMap, *, copy_threads: int, staging_bytes: int,
                 max_batch: int, integrity: Integrity | None = None) -> None:
        self.arena = arena
        self._integrity = integrity or Integrity()
        # One memcpy stream does not saturate memory bandwidth, and numpy/torch copies
        # drop the GIL: a large batch is split over a few threads.
        self._copy_threads = max(1, copy_threads)
        self._copier: Executor | None = ThreadPoolExecutor(self._copy_threads - 1, thread_name_prefix="kvstore-copy") \
            if self._copy_threads > 1 else None
        self._staging_bytes = staging_bytes
        self.max_batch = max_batch
        self._staging_refused = False

    def start(self, run: Any) -> None:
        """Nothing to set up: the arena is mapped, the connections are on its socket."""

    def put_limit(self, max_payload: int) -> int:
        """A put batch fits the staging region too (where the arena has no room)."""
        return min(max_payload, self._staging_bytes)

    def register(self, buf: Any) -> None:
        """A no-op: the copies read and write any buffer."""

    def close(self) -> None:
        """Stop the copy helpers and unmap the arena."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        self.arena.close()

    def _attach(self, conn: Conn) -> bool:
        """The connection's staging region, attached now if need be. False where the
        server refuses it: it maps only a region it can tell is this process's (its pid
        in the name, seen through SO_PEERCRED; a client in another PID namespace is not
        told apart): such blocks then go over the socket."""
        if conn.staging is not None:
            return True
        if self._staging_refused:
            return False
        try:
            conn.attach_staging(self._staging_bytes)
        except InvalidArgumentError as exc:
            self._staging_refused = True
            log.info("%s; staged blocks go over the socket", exc)
            return False
        return True

    def put(self, conn: Conn, keys: list[BlockKey], srcs: list[Any],
            sums: list[int | None] | None = None) -> list[bool]:
        given = sums or [None] * len(keys)
        if not self.arena.writable:
            return self._staged_put(conn, keys, srcs, given)
        # Reserve slots in the server's arena, write the blocks straight into them,
        # commit: one copy, no staging. Blocks it found no room for go through staging.
        sizes = [nbytes_of(s) for s in srcs]
        _, body = conn.call(P.Op.SHM_RESERVE, P.encode_records(P.SIZED, keys, sizes))
        rid, placed = P.decode_placed(body, len(keys))
        got = placed["nbytes"]
        take = np.flatnonzero(got >= 0)
        sent = [0] * len(keys)
        try:
            if len(take):
                off = placed["offset"][take]
                if (got[take] != np.asarray(sizes)[take]).any() or int((off + got[take]).max()) > self.arena.nbytes:
                    raise RemoteError(f"server {conn.addr}: SHM_RESERVE placement outside the arena "
                                      "or of the wrong size")
                idx = take.tolist()
                copied = copy_batch_hashed([srcs[i] for i in idx], [sizes[i] for i in idx], self.arena.array,
                                           self.arena.address, off.tolist(), True, self._copier,
                                           self._copy_threads, self.arena.pin, hash_source=True)
                for i, csum in zip(idx, copied):
                    sent[i] = csum if given[i] is None else given[i]
        except BaseException:
            if rid and not conn.broken:
                conn.call(P.Op.SHM_COMMIT, P.encode_commit(rid, False))
            raise
        out = P.decode_flags(conn.call(P.Op.SHM_COMMIT, P.encode_commit(rid, True, sent))[1], len(keys)) if rid \
            else [False] * len(keys)
        for i in np.flatnonzero(got == P.PRESENT).tolist():
            out[i] = True
        rest = np.flatnonzero(got == P.MISS).tolist()
        if rest:
            for i, ok in zip(rest, self._staged_put(conn, [keys[i] for i in rest], [srcs[i] for i in rest],
                                                    [given[i] for i in rest])):
                out[i] = ok
        return out

    def _staged_put(self, conn: Conn, keys: list[BlockKey], srcs: list[Any], given: list[int | None]) -> list[bool]:
        if not self._attach(conn):
            return tcp_put(conn, keys, srcs, self._integrity, given)
        staging = conn.staging
        sizes, offsets, pos = [], [], 0
        for src in srcs:
            n = nbytes_of(src)
            sizes.append(n)
            offsets.append(pos)
            pos += n
        sums = copy_batch_hashed(srcs, sizes, staging.array, staging.address, offsets, True, self._copier,
                                 self._copy_threads, hash_source=True)
        sums = [csum if g is None else g for csum, g in zip(sums, given)]
        _, body = conn.call(P.Op.SHM_PUT, P.encode_records(P.STAGED, keys, sizes, offsets, sums))
        return P.decode_flags(body, len(keys))

    def get(self, conn: Conn, keys: list[BlockKey], dsts: list[Any]) -> list[bool]:
        sizes = [nbytes_of(d) for d in dsts]
        _, body = conn.call(P.Op.SHM_GET, P.encode_records(P.SIZED, keys, sizes))
        lid, placed = P.decode_placed(body, len(keys))
        got, where, stored = placed["nbytes"], placed["where"], placed["checksum"]
        verify = self._integrity.verify
        try:
            want = np.asarray(sizes, dtype=np.int64)
            if ((got >= 0) & (got != want)).any():
                raise RemoteError(f"server {conn.addr}: SHM_GET placed a block of another size than its buffer")
            out = (got >= 0).tolist()
            for code, region in ((P.WHERE_ARENA, self.arena), (P.WHERE_STAGING, conn.staging)):
                idx = np.flatnonzero((got >= 0) & (where == code))
                if not len(idx):
                    continue
                off = placed["offset"][idx]
                if region is None or int((off + got[idx]).max()) > region.nbytes:
                    raise RemoteError(f"server {conn.addr}: SHM_GET placement outside the shared regions")
                ii = idx.tolist()
                args = ([dsts[i] for i in ii], [sizes[i] for i in ii], region.array, region.address,
                        off.tolist(), False, self._copier, self._copy_threads,
                        self.arena.pin if code == P.WHERE_ARENA else None)
                if not verify:
                    copy_batch(*args)
                    continue
                # Each block is hashed in the caller's buffer right after its copy (still
                # in cache): what landed there, not the shared slot it came from, which
                # a concurrent writer may change back between the copy and the hash. A
                # block whose copy differs from the bytes the server stored is a miss.
                # A device buffer cannot be hashed here: its block lands in a private
                # host buffer first (hashed there), then goes on to the device.
                dev = [k for k, i in enumerate(ii) if is_device(dsts[i])]
                if dev:
                    bounce = np.empty(sum(sizes[ii[k]] for k in dev), np.uint8)
                    bounced, at, pos = list(args[0]), [], 0
                    for k in dev:
                        n = sizes[ii[k]]
                        bounced[k] = bounce[pos:pos + n]
                        at.append(pos)
                        pos += n
                    args = (bounced,) + args[1:8] + (None,)
                got_sums = copy_batch_hashed(*args)
                if dev:
                    copy_batch([dsts[ii[k]] for k in dev], [sizes[ii[k]] for k in dev], bounce,
                               bounce.ctypes.data, at, False, None, 1)
                bad = [i for i, csum in zip(ii, got_sums) if csum != int(stored[i])]
                for i in bad:
                    out[i] = False
                if bad:
                    self._integrity.failed(len(bad))
        finally:
            if lid:
                conn.send(P.Op.SHM_DONE, P.encode_u64(lid))
        raise_mismatch(keys, got.tolist(), sizes)
        socket_idx = np.flatnonzero((got >= 0) & (where == P.WHERE_SOCKET)).tolist()
        if socket_idx:
            if conn.staging is None:  # next time the server loads such blocks into staging
                self._attach(conn)
            res = tcp_get(conn, [keys[i] for i in socket_idx], [dsts[i] for i in socket_idx], self._integrity)
            for i, ok in zip(socket_idx, res):
                out[i] = ok
        return out


__all__ = ["SameHostTransport", "same_server_socket"]
