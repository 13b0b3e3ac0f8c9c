"""The same-host operations of a connection (SHM_ATTACH, SHM_GET, SHM_DONE, SHM_PUT,
SHM_RESERVE, SHM_COMMIT): bulk bytes move through the shared arena and the client's
staging region, only control frames cross the socket (see ``docs/protocol.md``).

A mixin of :class:`kvstore.net.server._conn.Connection`; everything runs on the event loop
thread. Reader leases (``self.leases``) and reservations (``self.reservations``) both
count against ``max_inflight_bytes`` and end when the connection closes.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np

from kvstore.errors import InvalidArgumentError
from kvstore.net import protocol as P
from kvstore.net.server._refusals import Busy as _Busy, Fatal as _Fatal
from kvstore.net.server._shm import Lease, Staging


class SameHostOps:
    """SHM_* handlers; relies on the Connection's state and helpers (``ctx``,
    ``loop``, ``local``, ``leases``, ``reservations``, ``staging``, ``_reply``,
    ``_load_lower``, ``_release_lease``)."""

    def _need_local(self) -> None:
        if not self.local or self.ctx.arena is None:
            raise _Fatal(P.Status.UNAVAILABLE, "shared memory is only offered to same-host clients "
                         "of a server whose first tier is a shared DRAM arena")

    async def _op_shm_attach(self, rid: int, args: dict, header: P.Header) -> None:
        # A staging region is mapped read-write: the server reads puts from it and writes
        # gets into it. Only the process that created it may attach it, so only on the
        # Unix socket, whose peer the kernel names (SO_PEERCRED: the file's owner and the
        # pid in its name), and never with tenants (who share a uid, and no arena).
        if self.ctx.tenants.enabled:
            raise _Fatal(P.Status.UNAVAILABLE, "SHM_ATTACH is not offered with server.tenants")
        if self.sock.family != socket.AF_UNIX:
            raise _Fatal(P.Status.UNAVAILABLE, "SHM_ATTACH is only offered on the server's Unix socket")
        self._need_local()
        if self.staging is not None:
            raise InvalidArgumentError("a staging region is already attached to this connection")
        pid, uid, _ = struct.unpack("3i", self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                               struct.calcsize("3i")))
        self.staging = Staging.attach(args.get("path"), args.get("nbytes"),
                                      self.ctx.max_inflight_bytes, peer_pid=pid, peer_uid=uid)
        await self._reply(P.Op.SHM_ATTACH, rid)

    async def _op_shm_get(self, rid: int, args: tuple, header: P.Header) -> None:
        self._need_local()
        keys, rec = args
        keys = self.ctx.served.intern(keys)
        n = len(keys)
        want = rec["nbytes"].tolist()
        sizes, offsets, where = [P.MISS] * n, [0] * n, [P.WHERE_ARENA] * n
        lease = Lease(self.ctx.served.borrow(keys, offsets=True))
        try:
            sums = self.ctx.store.checksums(keys)   # as stored; the client verifies its copy
            lower, leased = [], 0
            for i, slot in enumerate(lease.views):
                if slot is None:
                    lower.append(i)
                elif slot[1] != want[i]:
                    sizes[i] = P.SIZE_MISMATCH
                else:
                    sizes[i], offsets[i] = want[i], slot[0]
                    leased += want[i]
            lease.nbytes = leased
            if self.leased_bytes + leased > self.ctx.max_inflight_bytes:
                raise _Busy(f"{self.leased_bytes + leased} leased bytes would exceed "
                            f"max_inflight_bytes; release earlier leases first")
            if lower:
                staged = self._place_lower(keys, want, lower, sizes, offsets, where)
                if staged:
                    got, srcs = [P.MISS] * n, [None] * n
                    await self._load_lower(keys, want, staged, self.staging.array, 0, got, srcs, sums)
                    for i in staged:
                        if got[i] < 0:
                            sizes[i] = got[i]
        except BaseException:
            lease.release()
            raise
        lid = 0
        if lease.nbytes:
            lid, self.next_lease = self.next_lease, self.next_lease + 1
            self.leases[lid] = lease
            self.leased_bytes += lease.nbytes
        else:
            lease.release()
        placed = np.empty(n, dtype=P.PLACED)
        placed["nbytes"], placed["offset"], placed["where"] = sizes, offsets, where
        placed["checksum"] = [c or 0 for c in sums]
        self.ctx.metrics.bytes.labels("out", "shm").inc(lease.nbytes)
        if self.ctx.tenants.enabled:   # a block left for a socket GET is counted by that GET
            self.tenant.served([s if w != P.WHERE_SOCKET else 0 for s, w in zip(sizes, where)])
        await self._reply(P.Op.SHM_GET, rid, P.encode_placed(lid, placed))

    def _place_lower(self, keys: list, want: list[int], lower: list[int], sizes: list[int],
                     offsets: list[int], where: list[int]) -> list[int]:
        """Blocks held only below the first tier: into the client's staging region while
        it has room (returned, to be loaded there), the rest marked for a socket GET."""
        present = self.ctx.store.contains([keys[i] for i in lower])
        room = self.staging.nbytes if self.staging is not None else 0
        staged, pos = [], 0
        for i, there in zip(lower, present):
            if not there:
                continue
            sizes[i] = want[i]
            if pos + want[i] <= room:
                offsets[i], where[i] = pos, P.WHERE_STAGING
                staged.append(i)
                pos += want[i]
            else:
                where[i] = P.WHERE_SOCKET
        return staged

    async def _op_shm_put(self, rid: int, args: tuple, header: P.Header) -> None:
        self._need_local()
        if self.staging is None:
            raise InvalidArgumentError("SHM_PUT needs an attached staging region (SHM_ATTACH)")
        keys, rec = args
        keys = self.ctx.served.intern(keys)
        srcs = [self.staging.slice(int(off), int(n)) for n, off in zip(rec["nbytes"], rec["offset"])]
        ok = await asyncio.wrap_future(self.ctx.store.save(keys, srcs, checksums=rec["checksum"].tolist())) \
            if keys else []
        self.ctx.metrics.bytes.labels("in", "shm").inc(int(rec["nbytes"].sum()))
        await self._reply(P.Op.SHM_PUT, rid, bytes(ok))

    async def _op_shm_reserve(self, rid: int, args: tuple, header: P.Header) -> None:
        """Room in the arena that the client fills in place, published by SHM_COMMIT.
        The slots are invisible to readers until then, count against this connection's
        in-flight bytes, and are freed if the connection closes first."""
        self._need_local()
        keys, rec = args
        keys = self.ctx.served.intern(keys)
        sizes = rec["nbytes"].tolist()
        total = sum(sizes)
        limit = self.ctx.max_inflight_bytes
        if self.leased_bytes + total > limit:
            raise _Busy(f"{self.leased_bytes + total} reserved and leased bytes would exceed max_inflight_bytes "
                        f"{limit}; commit or release earlier ones first")
        res = await self.loop.run_in_executor(None, self.ctx.store.reserve, keys, sizes)
        n = len(keys)
        placed = np.zeros(n, dtype=P.PLACED)
        got, offsets, reserved = [P.MISS] * n, [0] * n, 0
        base = self.ctx.arena.base_address
        for i, (present, view) in enumerate(zip(res.present, res.views)):
            if present:
                got[i] = P.PRESENT
            elif view is not None:
                got[i], offsets[i] = sizes[i], view.ctypes.data - base
                reserved += sizes[i]
        res_id = 0
        if reserved:
            res_id, self.next_lease = self.next_lease, self.next_lease + 1
            self.reservations[res_id] = (res, reserved)
            self.leased_bytes += reserved
        else:
            res.commit()  # nothing to fill: ends it (present keys counted as hits)
        placed["nbytes"], placed["offset"] = got, offsets
        await self._reply(P.Op.SHM_RESERVE, rid, P.encode_placed(res_id, placed))

    async def _op_shm_commit(self, rid: int, args: tuple, header: P.Header) -> None:
        res_id, commit, sums = args
        entry = self.reservations.get(res_id)
        if entry is None:
            raise InvalidArgumentError(f"no open reservation {res_id} on this connection")
        res, nbytes = entry
        if commit and len(sums) != len(res.present):
            raise InvalidArgumentError(f"SHM_COMMIT of reservation {res_id} carries {len(sums)} checksums for "
                                       f"{len(res.present)} keys")
        del self.reservations[res_id]
        self.leased_bytes -= nbytes
        if commit:
            # Each slot is published only when its bytes match the client's checksum.
            ok = await self.loop.run_in_executor(None, res.commit, sums.tolist())
            self.ctx.metrics.bytes.labels("in", "shm").inc(nbytes)
        else:
            await self.loop.run_in_executor(None, res.abort)
            ok = res.present
        await self._reply(P.Op.SHM_COMMIT, rid, bytes(ok))

    async def _op_shm_done(self, rid: int, lid: int, header: P.Header) -> None:
        self._release_lease(lid)
