"""One client connection: read a frame, dispatch it to the Store, reply; repeat.

Runs on the server's event loop with non-blocking sockets (``sock_recv_into`` /
``sock_sendall``): PUT payloads land straight in a per-connection buffer that is reused
across requests, GET payloads leave from the DRAM tier's memory through read-only views
held with :meth:`Store.borrow`. Store calls that can block run on the Store's pool and
are awaited with ``asyncio.wrap_future``. One request at a time per connection; a
client pipelines by opening more connections.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.block import checksum
from kvstore.errors import (AuthError, BufferSizeError, InvalidArgumentError, KVStoreError, ProtocolError,
                            StoreClosedError, TransportError)
from kvstore.net import protocol as P
from kvstore.net.server._conn_shm import SameHostOps
from kvstore.net.server._refusals import Busy as _Busy, Disconnected as _Disconnected, Fatal as _Fatal
from kvstore.net.server._shm import Lease, Staging
from kvstore.net.server._tenants import Tenant, clear as _clear
from kvstore.net.server._tls_stream import TlsStream, peek_first_byte

if TYPE_CHECKING:
    from kvstore.net.server._budget import ByteBudget
    from kvstore.net.server._context import ConnContext

log = logging.getLogger("kvstore.server")
_KEEP_BUFFER_BYTES = 256 << 20  # scratch buffers up to this size are kept for the next request
HELLO_MAX_BYTES = 4096          # the largest HELLO body read before authentication


class Connection(SameHostOps):
    """State of one client connection; all of it lives on the event loop thread.
    Memory it may hold: a scratch buffer of at most ``max_inflight_bytes`` (dropped after
    use when over 256 MiB, or when others wait for its tenant's share of the server's
    buffer budget, ``max_inflight_bytes_total``, which every buffer comes from) and leases
    plus reservations on at most ``max_inflight_bytes`` of slots. The same-host
    operations live in :class:`SameHostOps` (``_conn_shm.py``). All it uses of the
    server comes in ``ctx`` (:class:`~kvstore.net.server._context.ConnContext`)."""

    def __init__(self, ctx: "ConnContext", sock: socket.socket, peer: str, local: bool) -> None:
        self.ctx, self.sock, self.peer, self.local = ctx, sock, peer, local
        self.peer_ip: str | None = None     # the TCP peer's address (None on the Unix socket)
        self.loop = asyncio.get_running_loop()
        self.head = bytearray(P.HEADER_BYTES)
        self.body = bytearray(4096)
        self.buf = np.empty(0, np.uint8)   # PUT payloads and lower-tier GETs, reused
        self.authed = False
        self.tenant: Tenant | None = None  # who authenticated; every key is mapped into its space
        self.nonce: bytes | None = None    # the HELLO challenge sent, until answered
        self.busy = False
        self.accepted = self.last_active = time.monotonic()
        self.stalled_since: float | None = None   # a frame's body or payload is being waited for
        self.frame_got = 0                 # bytes of the current frame's body and payload received
        self.frame_wait_s = 0.0            # time spent waiting for them (min_body_rate_bytes_s)
        self.budget: "ByteBudget | None" = None   # the tenant's share of the buffer budget (after HELLO)
        self._buf_budget: "ByteBudget | None" = None   # the share self.buf was taken from
        self.leases: dict[int, Lease] = {}
        self.reservations: dict[int, tuple[Any, int]] = {}  # id -> (Store reservation, bytes)
        self.leased_bytes = 0
        self.next_lease = 1
        self.staging: Staging | None = None
        self.nixl_peer: str | None = None   # the client's NIXL agent, after NIXL_HELLO
        self.task: asyncio.Task | None = None
        self.tls: TlsStream | None = None   # the TCP connection's TLS, with server.tls (after the handshake)

    # -- I/O -------------------------------------------------------------------------------

    async def _recv_exact(self, view: memoryview, *, in_frame: bool = True) -> None:
        """Fill ``view`` from the socket. ``in_frame``: part of a frame whose header has
        arrived, so the server's reaper closes the connection when no byte arrives for
        ``read_timeout_s``, or when the frame's bytes arrive slower than
        ``min_body_rate_bytes_s`` (a header may wait for ``idle_timeout_s``). Only the
        time spent waiting for the peer counts (not a wait for the buffer budget)."""
        if self.tls is not None:
            base = self.frame_got
            progress = (lambda waiting, k: self._progress(waiting, base + k)) if in_frame else None
            try:
                got = await self.tls.recv_exact(view, progress)
            finally:
                self._waited()
            if in_frame:
                self.frame_got = base + got
            if got < view.nbytes:
                raise _Disconnected(f"peer closed after {got} of {view.nbytes} bytes")
            return
        got, n = 0, view.nbytes
        recv = self.loop.sock_recv_into
        while got < n:
            if in_frame:
                self.stalled_since = time.monotonic()
            try:
                k = await recv(self.sock, view[got:])
            finally:
                self._waited()
            if not k:
                raise _Disconnected(f"peer closed after {got} of {n} bytes")
            got += k
            if in_frame:
                self.frame_got += k

    def _progress(self, waiting: bool, got: int) -> None:
        """A TLS read of the frame waits for the peer (``waiting``) or got more."""
        self.frame_got = got
        if waiting:
            self.stalled_since = time.monotonic()
        else:
            self._waited()

    def _waited(self) -> None:
        if self.stalled_since is not None:
            self.frame_wait_s += time.monotonic() - self.stalled_since
            self.stalled_since = None

    def below_min_rate(self, now: float, rate: int, grace_s: float) -> bool:
        """Whether the frame being read arrives slower than ``rate`` bytes per second of
        waiting for it, after the first ``grace_s`` of waiting (``min_body_rate_bytes_s``):
        a trickle of bytes keeps a per-byte timer alive, never this average."""
        if self.stalled_since is None or rate <= 0:
            return False
        waited = self.frame_wait_s + (now - self.stalled_since)
        return waited > grace_s and self.frame_got < rate * (waited - grace_s)

    async def _reply(self, op: int, rid: int, body: bytes = b"", payload_len: int = 0,
                     status: int = 0) -> None:
        frame = P.pack_header(op, rid, len(body), payload_len, status) + body
        if self.tls is not None:
            await self.tls.sendall(frame)
        else:
            await self.loop.sock_sendall(self.sock, frame)

    async def _start_tls(self) -> bool:
        """Wrap this TCP connection in TLS (``server.tls``); False when it was refused
        (counted, logged in one line, closed). A plaintext kvstore client is told in
        plaintext that this server needs TLS; any other failure is the handshake's."""
        ctx = self.ctx
        first = await peek_first_byte(self.loop, self.sock)
        if not first:
            return False
        if first == P.MAGIC[:1]:
            ctx.metrics.refused.labels("tls_required").inc()
            log.debug("closing connection %s: plaintext client, and this server requires TLS", self.peer)
            try:   # read its HELLO first: closing with unread bytes would reset the connection, reply and all
                await asyncio.wait_for(self.loop.sock_recv(self.sock, P.HEADER_BYTES + HELLO_MAX_BYTES), 1.0)
                await asyncio.wait_for(self._reply(P.Op.HELLO, 0, b"this server requires TLS (server.tls is set): "
                                                   b"connect with Client(..., tls=...) or a remote tier's tls:",
                                                   status=P.Status.PROTOCOL), 1.0)
            except (OSError, asyncio.TimeoutError):
                pass
            return False
        try:
            self.sock = ctx.tls_context.wrap_socket(self.sock, server_side=True, do_handshake_on_connect=False)
            tls = TlsStream(self.loop, self.sock, ctx.sender, ctx.idle_timeout_s)
            await tls.handshake()
        except (ssl.SSLError, OSError) as exc:
            ctx.metrics.refused.labels("tls_handshake").inc()
            log.debug("closing connection %s: TLS handshake failed: %s", self.peer,
                      getattr(exc, "reason", None) or exc)
            return False
        self.tls = tls
        return True

    async def _buffer(self, nbytes: int) -> np.ndarray:
        """The connection's scratch buffer, grown on demand and reused across requests.
        Its bytes come from its tenant's share of the server-wide budget
        (``max_inflight_bytes_total``): when that is spent, this waits (reading nothing
        more of the frame, and not counted against ``min_body_rate_bytes_s``) until it
        has room. Only after HELLO (the tenant names the share)."""
        limit = self.ctx.max_inflight_bytes
        if nbytes > limit:
            raise _Fatal(P.Status.TOO_LARGE, f"{nbytes} bytes in flight exceed max_inflight_bytes {limit}")
        if self.buf.nbytes < nbytes:
            self.drop_buffer()                 # given back before a larger one is taken
            size = min(max(nbytes, 1 << 20), limit)
            budget = self.budget
            await budget.take(size, lambda: self.ctx.reclaim_buffers(self.tenant))
            self.buf, self._buf_budget = np.empty(size, np.uint8), budget
        return self.buf

    def drop_buffer(self) -> None:
        """Free the scratch buffer and give its bytes back to the share it came from."""
        if self.buf.nbytes:
            nbytes, self.buf = self.buf.nbytes, np.empty(0, np.uint8)
            self._buf_budget.give(nbytes)
            self._buf_budget = None

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        ctx, metrics = self.ctx, self.ctx.metrics
        metrics.connections.inc()
        rid = 0
        try:
            if self.peer_ip is not None and ctx.tls_context is not None and not await self._start_tls():
                return
            while not ctx.closing():
                await self._recv_exact(memoryview(self.head), in_frame=False)
                self.busy, t0 = True, time.perf_counter()
                self.last_active = time.monotonic()
                header = P.parse_header(self.head, ctx.limits)
                self.frame_got, self.frame_wait_s = 0, 0.0
                rid, op = header.request_id, P.Op(header.op)
                if not self.authed and op is not P.Op.HELLO:
                    raise _Fatal(P.Status.AUTH, "the first frame must be HELLO (with the token, if the "
                                 "server has one)")
                if not self.authed and (header.body_len > HELLO_MAX_BYTES or header.payload_len):
                    # Nothing is allocated at a size an unauthenticated peer chose.
                    raise _Fatal(P.Status.TOO_LARGE, f"a HELLO of {header.body_len} bytes exceeds "
                                 f"{HELLO_MAX_BYTES}")
                if len(self.body) < header.body_len:
                    self.body = bytearray(header.body_len)
                body = memoryview(self.body)[:header.body_len]
                await self._recv_exact(body)
                args = P.decode_request(header, body, ctx.limits)
                if self.authed:   # the tenant's key space, for every op: no handler sees a client's key
                    args = self.tenant.scope(op, args)
                status = await self._dispatch(op, rid, args, header)
                if self.buf.nbytes > _KEEP_BUFFER_BYTES or (self.budget is not None and self.budget.waiting):
                    self.drop_buffer()   # a rare huge request, or others wait: do not hold its memory
                metrics.latency.labels(op.name).observe(time.perf_counter() - t0)
                metrics.requests.labels(op.name, status.name).inc()
                self.busy = False
                self.last_active = time.monotonic()
        except _Disconnected:
            pass
        except ProtocolError as exc:
            await self._refuse(rid, P.Status.PROTOCOL, str(exc))
        except _Fatal as exc:
            await self._refuse(rid, exc.status, str(exc))
        except ssl.SSLError as exc:   # a TLS record failed (tampered with, or a broken peer)
            ctx.metrics.refused.labels("tls_error").inc()
            log.debug("closing connection %s: TLS error: %s", self.peer, exc.reason or exc)
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            pass  # idle timeout or shutdown
        except Exception as exc:  # a bug: tell the client, log, keep serving others
            log.exception("connection %s: internal error", self.peer)
            await self._refuse(rid, P.Status.INTERNAL, f"internal server error: {exc}")
        finally:
            self.busy = False
            self.close()
            metrics.connections.dec()

    async def _refuse(self, rid: int, status: P.Status, message: str) -> None:
        self.ctx.metrics.refused.labels(status.name).inc()
        log.debug("closing connection %s: %s", self.peer, message)
        try:
            await asyncio.wait_for(self._reply(P.Op.PING, rid, message.encode()[:4096], status=status), 1.0)
        except (OSError, asyncio.TimeoutError, ConnectionError):
            pass

    def close(self) -> None:
        """Release every lease, abort every open reservation, drop the staging map, close
        the socket. Idempotent."""
        for lease in self.leases.values():
            lease.release()
        self.leases.clear()
        for res, _ in self.reservations.values():  # a dead client's slots are freed, never published
            try:
                res.abort()
            except KVStoreError as exc:
                log.warning("connection %s: aborting a reservation failed: %s", self.peer, exc)
        self.reservations.clear()
        self.leased_bytes = 0
        self.drop_buffer()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self.nixl_peer is not None:
            self.ctx.nixl.drop(self)
        try:
            self.sock.close()
        except OSError:
            pass
        self.ctx.forget(self)

    def expire_leases(self, max_age_s: float) -> None:
        now = time.monotonic()
        for lid in [lid for lid, lease in self.leases.items() if now - lease.created > max_age_s]:
            self._release_lease(lid)

    def _release_lease(self, lid: int) -> None:
        lease = self.leases.pop(lid, None)
        if lease is not None:
            self.leased_bytes -= lease.nbytes
            lease.release()

    # -- dispatch ----------------------------------------------------------------------------

    async def _dispatch(self, op: P.Op, rid: int, args: Any, header: P.Header) -> P.Status:
        try:
            await getattr(self, f"_op_{op.name.lower()}")(rid, args, header)
            return P.Status.OK
        except BufferSizeError as exc:
            status, msg = P.Status.BUFFER_SIZE, str(exc)
        except (InvalidArgumentError, KeyError) as exc:
            status, msg = P.Status.INVALID, str(exc)
        except (StoreClosedError, TransportError) as exc:  # a NIXL failure: the client falls back to TCP
            status, msg = P.Status.UNAVAILABLE, str(exc)
        except _Busy as exc:
            status, msg = P.Status.BUSY, str(exc)
        except (AuthError, ProtocolError, _Fatal):
            raise
        except KVStoreError as exc:
            status, msg = P.Status.INTERNAL, str(exc)
        if op not in P.NO_REPLY:
            await self._reply(op, rid, msg.encode()[:4096], status=status)
        return status

    async def _op_hello(self, rid: int, args: dict, header: P.Header) -> None:
        """Challenge-response: the first HELLO gets a fresh nonce (``challenge``); the
        second must carry ``proof`` = :func:`hello_proof` of the token, that nonce and
        its ``client`` name, and gets the server's info. The token never crosses the
        wire, and a captured proof is worthless on any other connection (other nonce)."""
        if args.get("protocol", P.VERSION) != P.VERSION:
            raise _Fatal(P.Status.PROTOCOL, f"client speaks protocol {args.get('protocol')!r}; this server "
                         f"speaks {P.VERSION} only (upgrade the client)")
        if "token" in args:
            raise _Fatal(P.Status.AUTH, "HELLO carries a cleartext token; protocol 3 answers a challenge "
                         "with an HMAC instead")
        nonce, self.nonce = self.nonce, None
        if nonce is None:
            self.nonce = secrets.token_bytes(32)
            await self._reply(P.Op.HELLO, rid, P.encode_json({"challenge": self.nonce.hex(),
                                                              "protocol": P.VERSION}))
            return
        # The tenant whose token the proof answers (each tenant's key tried, in constant time).
        tenant = self.ctx.tenants.authenticate(nonce, args.get("client"), args.get("proof"))
        if tenant is None:
            raise _Fatal(P.Status.AUTH, "wrong or missing token (HELLO proof does not match)")
        if self.tenant is not None and tenant is not self.tenant:
            # its leases and reservations are in the first tenant's space: never handed to another
            raise _Fatal(P.Status.AUTH, "a connection cannot change tenants; open a new one")
        self.authed, self.tenant = True, tenant
        self.budget = self.ctx.buffers.of(tenant.name)
        self.ctx.authenticated(self)   # leaves the unauthenticated pool (max_unauthenticated_connections)
        await self._reply(P.Op.HELLO, rid, P.encode_json(self.ctx.hello_info(self.local, tenant)))

    async def _op_ping(self, rid: int, args: None, header: P.Header) -> None:
        await self._reply(P.Op.PING, rid)

    async def _op_stats(self, rid: int, args: None, header: P.Header) -> None:
        stats = await self.loop.run_in_executor(None, self.ctx.stats, self.tenant)
        await self._reply(P.Op.STATS, rid, P.encode_json(stats))

    async def _op_lookup(self, rid: int, args: tuple, header: P.Header, op: P.Op = P.Op.LOOKUP) -> None:
        lease_s, keys = args
        store = self.ctx.store
        if getattr(store, "discovers", False):   # may ask shared tiers (Redis, S3, Mooncake) over the network
            n = await self.loop.run_in_executor(None, store.lookup, keys, lease_s)
        else:
            n = store.lookup(keys, lease_s)
        await self._reply(op, rid, P.encode_u32(n))

    async def _op_lookup_wait(self, rid: int, args: tuple, header: P.Header) -> None:
        """A LOOKUP that first waits up to ``wait_s`` for every key to be stored (woken
        by the saves that land them, see :mod:`kvstore.net.server._landing`); then
        answers, and leases, as LOOKUP does."""
        lease_s, wait_s, keys = args
        if wait_s and self.ctx.landing is not None and keys:
            await self.ctx.landing.wait_for(keys, wait_s)
        await self._op_lookup(rid, (lease_s, keys), header, op=P.Op.LOOKUP_WAIT)

    async def _op_hint(self, rid: int, args: tuple, header: P.Header) -> None:
        hint, keys = args
        await self._reply(P.Op.HINT, rid, P.encode_u32(self.ctx.store.hint(keys, hint)))

    async def _op_contains(self, rid: int, keys: list, header: P.Header) -> None:
        await self._reply(P.Op.CONTAINS, rid, bytes(self.ctx.store.contains(keys)))

    async def _op_release(self, rid: int, keys: list, header: P.Header) -> None:
        self.ctx.store.release(keys)
        await self._reply(P.Op.RELEASE, rid)

    async def _op_delete(self, rid: int, keys: list, header: P.Header) -> None:
        n = await self.loop.run_in_executor(None, self.ctx.store.delete, keys)
        await self._reply(P.Op.DELETE, rid, P.encode_u32(n))

    async def _op_clear(self, rid: int, namespaces: list, header: P.Header) -> None:
        """Remove the tenant's blocks (every block without tenants), or those of the
        given namespaces. Needs only what every op needs: an authenticated connection."""
        n = await self.loop.run_in_executor(None, _clear, self.ctx.store, self.tenant, namespaces)
        await self._reply(P.Op.CLEAR, rid, P.encode_u64(n))

    async def _op_put(self, rid: int, args: tuple, header: P.Header) -> None:
        keys, rec = args
        keys = self.ctx.served.intern(keys)
        total = header.payload_len
        buf = (await self._buffer(total))[:total]   # exactly this request's bytes: no slice reaches past them
        await self._recv_exact(memoryview(buf))  # straight off the socket, no copy
        self.ctx.metrics.bytes.labels("in", "tcp").inc(total)
        srcs, pos = [], 0
        for n in rec["nbytes"].tolist():
            srcs.append(buf[pos:pos + n])
            pos += n
        # The Store checks each block against the checksum its client computed before
        # sending: a block changed on the way is refused (False, counted), not stored.
        ok = await asyncio.wrap_future(self.ctx.store.save(keys, srcs, checksums=rec["checksum"].tolist())) \
            if keys else []
        await self._reply(P.Op.PUT, rid, bytes(ok))

    async def _op_get(self, rid: int, args: tuple, header: P.Header) -> None:
        keys, rec = args
        keys = self.ctx.served.intern(keys)
        want = rec["nbytes"].tolist()
        sizes = [P.MISS] * len(keys)
        with self.ctx.served.borrow(keys) as views:
            srcs: list[Any] = [None] * len(keys)
            sums = self.ctx.store.checksums(keys)   # as stored; the client verifies what arrives
            lower = []
            for i, v in enumerate(views):
                if v is None:
                    lower.append(i)
                elif v.nbytes == want[i]:
                    sizes[i], srcs[i] = want[i], v
                else:
                    sizes[i] = P.SIZE_MISMATCH
            if lower:
                buf = await self._buffer(sum(want[i] for i in lower))
                await self._load_lower(keys, want, lower, buf, 0, sizes, srcs, sums)
            total = sum(s for s in sizes if s > 0)
            body = P.encode_summed(sizes, [c or 0 for c in sums])
            frame = [P.pack_header(P.Op.GET, rid, len(body), total) + body]
            frame += [src for src in srcs if src is not None]
            if self.tls is not None:
                await self.tls.send(frame, total)
            else:
                await self.ctx.sender.send(self.loop, self.sock, frame, total)  # header and blocks, vectored
            self.ctx.metrics.bytes.labels("out", "tcp").inc(total)
        if self.ctx.tenants.enabled:
            self.tenant.served(sizes)

    async def _load_lower(self, keys: list, want: list[int], idx: list[int], buf: np.ndarray, base: int,
                          sizes: list[int], srcs: list[Any], sums: list[int | None]) -> None:
        """Load blocks the first tier does not hold (slower tiers) into ``buf`` from
        ``base`` on; fills ``sizes``, ``srcs`` (views of ``buf``) and ``sums`` (the
        checksum of each loaded copy, which those tiers verified) for the hits."""
        store = self.ctx.store
        idx = [i for i, c in zip(idx, store.contains([keys[i] for i in idx])) if c]
        dsts, pos = [], base
        for i in idx:
            dsts.append(buf[pos:pos + want[i]])
            pos += want[i]
        if not idx:
            return
        try:
            ok = await asyncio.wrap_future(store.load([keys[i] for i in idx], dsts))
        except BufferSizeError:  # find which ones differ; the rest still load
            ok = []
            for i, dst in zip(idx, dsts):
                try:
                    ok.append((await asyncio.wrap_future(store.load([keys[i]], [dst])))[0])
                except BufferSizeError:
                    sizes[i] = P.SIZE_MISMATCH
                    ok.append(False)
        hits = [(i, dst) for i, dst, good in zip(idx, dsts, ok) if good]
        got = await self.loop.run_in_executor(None, lambda: [checksum(d) for _, d in hits])
        for (i, dst), csum in zip(hits, got):
            sizes[i], srcs[i], sums[i] = want[i], dst, csum

    # -- NIXL (see kvstore/net/server/_nixl.py) ----------------------------------------------------

    async def _op_nixl_hello(self, rid: int, metadata: bytes, header: P.Header) -> None:
        if self.ctx.tenants.enabled:   # before any metadata is loaded (see NixlService.hello)
            raise TransportError("NIXL is not offered with server.tenants; use TCP")
        if not self.ctx.nixl.offered():
            raise TransportError("this server does not offer NIXL")
        meta = await self.loop.run_in_executor(None, self.ctx.nixl.hello, self, metadata)
        await self._reply(P.Op.NIXL_HELLO, rid, meta)

    async def _op_nixl_get(self, rid: int, args: tuple, header: P.Header) -> None:
        sizes, sums = await self.loop.run_in_executor(None, self.ctx.nixl.get, self, args)
        self.ctx.metrics.bytes.labels("out", "nixl").inc(sum(s for s in sizes if s > 0))
        if self.ctx.tenants.enabled:
            self.tenant.served(sizes)
        await self._reply(P.Op.NIXL_GET, rid, P.encode_summed(sizes, sums))

    async def _op_nixl_put(self, rid: int, args: tuple, header: P.Header) -> None:
        ok = await self.loop.run_in_executor(None, self.ctx.nixl.put, self, args)
        self.ctx.metrics.bytes.labels("in", "nixl").inc(int(args[3]["nbytes"].sum()))
        await self._reply(P.Op.NIXL_PUT, rid, bytes(ok))

