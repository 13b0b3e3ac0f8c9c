"""A client of the kvstore cache server with the Store's API.

``Client("host:port", token=...)`` connects, authenticates, and, when the server runs
on this host and shares its DRAM arena, moves block bytes through shared memory: a
load copies straight out of the server's arena (one memcpy, or one H2D copy into a GPU
tensor) under a lease, a save reserves arena slots, copies straight into them and
commits (through a per-connection staging region where this process cannot write the
arena, or the server found no room); only small control frames cross the (Unix) socket.
For a remote server that offers NIXL, the server moves bytes one-sided between its
arena and the client's buffers (RDMA where the fabric has it; see docs/nixl.md); a
NIXL/UCX failure switches this client to TCP, logged and counted in ``fallbacks``.
Otherwise bytes travel over TCP, received straight into the caller's buffers. The
choice is made once, at connect time (:func:`~kvstore.net.client.selection.connect_transport`):
the client then holds one :class:`~kvstore.net.client.selection.Transport` (one per
module: ``tcp``, ``shm``, ``nixl``) that every save and load goes through.

Every block is verified end to end: a save sends the XXH3-64 of each block, computed
here before the bytes leave (the server stores only blocks that match), and a load
checks each block it received against the checksum the server keeps for it; a block
that fails is a miss (``False``), counted in ``stats()["client"]["checksum_mismatches"]``.
The HELLO is a challenge-response: the token itself never crosses the wire. With
``tls=...`` (a server with ``server.tls``), TCP connections are TLS 1.2+ with the
server's certificate verified (docs/server.md, "TLS").

Thread-safety: every method may be called from any thread. Calls check out a pooled
connection each, so up to ``pool_size`` run at once. ``save``/``load`` return futures;
callers must not touch their buffers until the future is done. A network failure is
retried once on a fresh connection and then raised as
:class:`~kvstore.errors.TierUnavailableError`; a load never reports ``True`` for a
block whose bytes did not fully arrive. A restarted server is found again at the given
address: its HELLO names a new instance, and the client takes the transport that
instance offers (its new same-host socket and arena: both are named after the server's
pid) in place of the old one, which is unmapped once no call uses it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Sequence

from kvstore.stats import sum_stat_sources
from kvstore.buffers import nbytes_of
from kvstore.buffers.streams import capture, submit
from kvstore.errors import (InvalidArgumentError, KVStoreError, NotSupportedError, StoreClosedError,
                            TierUnavailableError)
from kvstore._wait import check_wait
from kvstore.hint import Hint, check_hint
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.net.client.selection import Connected, FallbackCounter, Transport, connect_transport
from kvstore.net.client.tcp import Integrity, TcpTransport
from kvstore.net.client.wire import Address, Conn
from kvstore.net.tls import client_tls

log = logging.getLogger("kvstore.client")   # its name before the net/ layout

DEFAULT_STAGING_BYTES = 64 << 20


class Client:
    """``address``: ``host:port`` or a Unix socket path. ``transport``: ``auto`` (shared
    memory when the server is on this host, else NIXL when both sides have it, else
    TCP), ``tcp``, ``shm`` or ``nixl`` (fail if unavailable). ``verify=False`` skips
    checking loaded blocks against the server's checksums: for measuring what the
    check costs (``benchmarks/server.py``) only, never for serving.

    ``tls``: TLS to a server with ``server.tls`` — an :class:`ssl.SSLContext` (the name
    checked is the address's host), a :class:`kvstore.config.ClientTlsConfig`, or a
    dict of its fields (``ca``, ``cert``, ``key``, ``server_hostname``,
    ``check_hostname``, ``min_version``); ``True``: verified against the system's
    trust store. It covers TCP: a same-host client still moves bytes through shared
    memory and the server's Unix socket (plaintext, never leaving the host), and with
    ``transport="auto"`` a TLS client does not pick NIXL, whose transfers TLS does not
    cover (``transport="nixl"`` still selects it: control over TLS, bytes over NIXL)."""

    lends_memory = False   # borrow/reserve would need the server's memory in this process

    def __init__(self, address: str, *, token: str | None = None, timeout_s: float = 10.0,
                 pool_size: int = 8, transport: str = "auto",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, copy_threads: int | None = None,
                 verify: bool = True, tls: Any = None) -> None:
        if transport not in ("auto", "tcp", "shm", "nixl"):
            raise InvalidArgumentError(f"transport must be auto, tcp, shm or nixl, got {transport!r}")
        self.address = Address.parse(address)
        self._tls = client_tls(tls)
        self._token, self._timeout_s = token, timeout_s
        self._setting = transport
        self._pool_size, self._staging_wanted = max(1, pool_size), staging_bytes
        self._lock = threading.Lock()
        self._resolve_lock = threading.Lock()   # one re-resolution after a restart at a time
        self._stat_sources: list[tuple[str, Any]] = []  # this process's connectors (attach_stats)
        self._registered: list[Any] = []   # register()ed buffers, handed to each new transport
        self._closed = False
        self.integrity = Integrity(verify)
        self.fallbacks = FallbackCounter()
        # Same-host copies of a large batch are split over a few threads (SameHostTransport).
        self._copy_threads = copy_threads if copy_threads is not None else min(2, os.cpu_count() or 1)
        # One session per server instance: a restarted server gets a new one (_reresolve).
        self._session: _Session | None = None   # set below (a NIXL failure may be reported first)
        self._session = self._open_session(Conn(self.address, token, timeout_s, self._tls))
        self._pool = ThreadPoolExecutor(self._pool_size, thread_name_prefix="kvstore-client")
        self._session.transport.start(self._run)

    def _open_session(self, first: Conn) -> "_Session":
        """The transport for the server instance whose HELLO ``first`` received (chosen
        by :func:`connect_transport`: the same-host socket and arena it names, NIXL or
        TCP), with the limits that HELLO announced."""
        info = first.info
        max_batch = int(info.get("max_batch", 4096))
        self._max_payload = min(int(info.get("max_frame_bytes", 256 << 20)),
                                int(info.get("max_inflight_bytes", 1 << 30))) - (1 << 20)
        # the server refuses a staging region larger than its per-client in-flight limit
        self._staging_bytes = min(self._staging_wanted, int(info.get("max_inflight_bytes", 1 << 30)))
        self._max_batch = max_batch
        self.info = info
        chosen: Connected = connect_transport(self._setting, first, tls=self._tls, connect=self._connect,
                                              integrity=self.integrity, staging_bytes=self._staging_bytes,
                                              max_batch=max_batch, copy_threads=self._copy_threads,
                                              timeout_s=self._timeout_s, on_failure=self._fell_back)
        for buf in self._registered:
            chosen.transport.register(buf)
        return _Session(chosen.transport, chosen.addr, chosen.conns, info.get("instance"))

    def _connect(self, addr: Address) -> Conn:
        return Conn(addr, self._token, self._timeout_s, self._tls)

    def _fell_back(self, failed: Transport, exc: BaseException) -> None:
        """``failed`` (NIXL) stopped working: logged, counted, TCP from now on."""
        self.fallbacks.record(str(self.address), failed.name, exc)
        with self._lock:
            if self._session is not None and self._session.transport is failed:
                self._session.transport = TcpTransport(self.integrity)

    def register(self, buf: Any) -> None:
        """Register a long-lived buffer (e.g. a KV-cache pool, host or GPU memory) so the
        NIXL path moves blocks straight into and out of it. A no-op on other paths."""
        self._registered.append(buf)
        self._session.transport.register(buf)

    @property
    def _transport(self) -> Transport:
        return self._session.transport

    @property
    def tls(self) -> bool:
        """Whether this client's connections run over TLS (TCP with ``tls`` given; the
        same-host path never does)."""
        return self._tls is not None and self._session.addr.path is None

    @property
    def transport(self) -> str:
        """``shm`` when bulk bytes move through shared memory, ``nixl`` through NIXL,
        else ``tcp``."""
        return self._session.transport.name

    # -- connections ---------------------------------------------------------------------------

    @contextmanager
    def _conn(self, session: "_Session") -> Iterator[Conn]:
        """A connection of ``session`` (pooled, else new). A new one answered by another
        server instance (restarted where the session's socket was) is refused with
        :class:`TierUnavailableError`: its transport belongs to the old instance."""
        if self._closed:
            raise StoreClosedError("the Client is closed")
        with self._lock:
            conn = session.idle.pop() if session.idle else None
        if conn is None:
            conn = self._connect(session.addr)
            if conn.info.get("instance") != session.instance:
                conn.close()
                raise TierUnavailableError(f"kvstore server {session.addr} was restarted (another instance "
                                           "answers there)")
        try:
            yield conn
        finally:
            if conn.broken or self._closed or session.retired:
                conn.close()
            else:
                with self._lock:
                    if len(session.idle) < self._pool_size:
                        session.idle.append(conn)
                        conn = None
                if conn is not None:
                    conn.close()

    def _run(self, fn: Callable[[Conn], Any]) -> Any:
        """Run ``fn`` on a pooled connection (see :meth:`_run_on`)."""
        return self._run_on(lambda conn, _transport: fn(conn))

    def _run_on(self, fn: Callable[[Conn, Transport], Any]) -> Any:
        """Run ``fn`` on a pooled connection and the transport of the same server
        instance; on a network failure retry once on a fresh connection (a connection
        the server closed while idle, a restarted server). A restarted server is found
        again at the address the client was given: its HELLO names a new instance, whose
        same-host socket and arena (both named after its pid) replace the old ones
        (:meth:`_reresolve`)."""
        session = self._enter()
        try:
            with self._conn(session) as conn:
                return fn(conn, session.transport)
        except TierUnavailableError:
            with self._lock:
                stale, session.idle = session.idle, []
            for c in stale:
                c.close()
        finally:
            self._leave(session)
        self._reresolve(session)
        session = self._enter()
        try:
            with self._conn(session) as conn:
                return fn(conn, session.transport)
        finally:
            self._leave(session)

    def _enter(self) -> "_Session":
        with self._lock:
            session = self._session
            session.users += 1
            return session

    def _leave(self, session: "_Session") -> None:
        """A call on ``session`` is over; a retired session's transport (a mapped arena a
        call may still have been copying from) is closed by its last user."""
        with self._lock:
            session.users -= 1
            close = session.retired and session.users == 0 and not session.closed
            session.closed = session.closed or close
        if close:
            session.transport.close()

    def _reresolve(self, failed: "_Session") -> None:
        """After a network failure on ``failed``: ask the address the client was given
        which server instance answers there now; a new one (a restart) gets a session of
        its own (HELLO, transport chosen again, its arena mapped) and ``failed`` is
        retired. Raises TierUnavailableError while no server answers."""
        with self._resolve_lock:
            if self._session is not failed or self._closed:
                return                      # another call found the new instance already
            first = self._connect(self.address)
            if first.info.get("instance") == failed.instance:
                first.close()               # the same server: only a connection broke
                return
            try:
                session = self._open_session(first)
            except KVStoreError:
                raise                       # connect_transport closed ``first``
            except Exception as exc:        # e.g. the new arena cannot be mapped here
                first.close()
                raise TierUnavailableError(f"kvstore server {self.address} restarted and could not be "
                                           f"reached again: {exc}") from exc
            with self._lock:
                self._session, failed.retired = session, True
                stale, failed.idle = failed.idle, []
                close = failed.users == 0 and not failed.closed   # else its last user closes it
                failed.closed = failed.closed or close
            for c in stale:
                c.close()
            if close:
                failed.transport.close()
        # Outside the lock: starting (NIXL's introduction) runs calls that may re-resolve.
        session.transport.start(self._run)
        log.info("kvstore server %s was restarted: reconnected to its new instance (transport %s)",
                 self.address, session.transport.name)

    # -- control operations ----------------------------------------------------------------------

    def ping(self) -> float:
        """Round-trip time in seconds."""
        t0 = time.perf_counter()
        self._run(lambda c: c.call(P.Op.PING))
        return time.perf_counter() - t0

    def lookup(self, keys: Sequence[BlockKey], lease_s: float | None = None, *,
               hint: Hint | None = None, wait_s: float | None = None) -> int:
        """Length of the prefix of ``keys`` the server holds; with ``lease_s`` those
        blocks are protected from eviction until loaded or the lease expires. ``hint``
        goes to that prefix in a second request (HINT), answered before this returns.
        ``wait_s``: the server first waits up to that long for every key to be stored,
        woken by the saves that land them (LOOKUP_WAIT); the call then takes up to
        ``wait_s`` plus the client's ``timeout_s``. A server that predates LOOKUP_WAIT
        answers without waiting."""
        _check_keys(keys)
        check_hint(hint)
        wait_s = check_wait(wait_s)
        if wait_s and not self.info.get("lookup_wait"):
            wait_s = None
        total = 0
        deadline = time.monotonic() + (wait_s or 0.0)
        for part in self._chunks(keys):
            if wait_s:
                body = P.encode_lookup_wait(part, lease_s, max(0.0, deadline - time.monotonic()))
                n = P.decode_u32(self._run(lambda c: self._call_waiting(c, P.Op.LOOKUP_WAIT, body, wait_s))[1])
            else:
                body = P.encode_lookup(part, lease_s)
                n = P.decode_u32(self._run(lambda c: c.call(P.Op.LOOKUP, body))[1])
            total += n
            if n < len(part):
                break
        if hint is not None and total:
            self._hint_quietly(keys[:total], hint)
        return total

    def _call_waiting(self, conn: Conn, op: int, body: bytes, wait_s: float) -> tuple[P.Header, bytes]:
        """``conn.call`` with the socket's timeout stretched by ``wait_s`` (the server
        answers a waiting lookup up to that much later)."""
        conn.sock.settimeout(self._timeout_s + wait_s)
        try:
            return conn.call(op, body)
        finally:
            if not conn.broken:
                conn.sock.settimeout(self._timeout_s)

    def hint(self, keys: Sequence[BlockKey], hint: Hint) -> int:
        """Give a retention hint to the blocks of ``keys`` the server holds (as
        :meth:`kvstore.store.Store.hint`); returns how many it holds."""
        _check_keys(keys)
        if check_hint(hint) is None:
            raise InvalidArgumentError("hint must be a kvstore.Hint, got None")
        return sum(P.decode_u32(self._run(lambda c: c.call(P.Op.HINT, P.encode_hint(p, hint)))[1])
                   for p in self._chunks(keys))

    def _hint_quietly(self, keys: Sequence[BlockKey], hint: Hint) -> None:
        """A hint after a lookup or save that succeeded: advice, so a failure to deliver
        it is logged, never raised over the answer the caller already has."""
        try:
            self.hint(keys, hint)
        except KVStoreError as exc:
            log.warning("retention hint for %d blocks not delivered: %s", len(keys), exc)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        _check_keys(keys)
        out: list[bool] = []
        for part in self._chunks(keys):
            body = P.encode_keys(part)
            out += P.decode_flags(self._run(lambda c: c.call(P.Op.CONTAINS, body))[1], len(part))
        return out

    def delete(self, keys: Sequence[BlockKey]) -> int:
        _check_keys(keys)
        return sum(P.decode_u32(self._run(lambda c: c.call(P.Op.DELETE, P.encode_keys(p)))[1])
                   for p in self._chunks(keys))

    def release(self, keys: Sequence[BlockKey]) -> None:
        _check_keys(keys)
        for part in self._chunks(keys):
            self._run(lambda c: c.call(P.Op.RELEASE, P.encode_keys(part)))

    def clear(self, namespaces: Sequence[bytes] | None = None) -> int:
        """Remove every block on the server (as :meth:`Store.clear`), or, with
        ``namespaces`` (namespace digests, ``Namespace.digest``), only the blocks whose
        keys carry one of them. Returns how many blocks were removed."""
        spaces = list(namespaces or [])
        if not namespaces and namespaces is not None:
            return 0
        total = 0
        for lo in range(0, max(len(spaces), 1), self._max_batch):
            body = P.encode_namespaces(spaces[lo:lo + self._max_batch])
            total += P.decode_u64(self._run(lambda c: c.call(P.Op.CLEAR, body))[1])
        return total

    def stats(self) -> dict[str, Any]:
        """The server's counters, with this process's attached connector counters under
        ``"connectors"`` (the server's own, from connectors embedded in it, are replaced)."""
        out = P.decode_json(self._run(lambda c: c.call(P.Op.STATS))[1])
        out["connectors"] = sum_stat_sources(self._stat_sources)
        out["client"] = {"verify": self.integrity.verify, "checksum_mismatches": self.integrity.mismatches}
        return out

    def attach_stats(self, name: str, source: Any) -> None:
        """As :meth:`kvstore.store.Store.attach_stats`: reported by this Client's
        :meth:`stats` only (the server never sees them)."""
        self._stat_sources.append((name, source))

    def detach_stats(self, name: str, source: Any) -> None:
        self._stat_sources = [s for s in self._stat_sources if s != (name, source)]

    # -- StoreAPI methods the cache-server protocol does not carry ----------------------------------

    def pin(self, keys: Sequence[BlockKey]) -> None:
        raise _unsupported("pin", "the cache-server protocol has no pin operation (a pin outliving its "
                                  "client would never end); lease blocks with lookup(keys, lease_s=...)")

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        raise _unsupported("unpin", "the cache-server protocol has no pin operation")

    def prefetch(self, keys: Sequence[BlockKey], tier: int | str = 0) -> "Future[int]":
        raise _unsupported("prefetch", "the cache-server protocol has no prefetch operation; the server "
                                       "promotes on a hit and on lookup (placement.prefetch_depth)")

    def reserve(self, keys: Sequence[BlockKey], sizes: Sequence[int], *, evict: bool = True) -> Any:
        raise _unsupported("reserve", "a reservation lends the store's own memory, which lives in the "
                                      "server (lends_memory is False); use save()")

    def borrow(self, keys: Sequence[BlockKey]) -> Any:
        raise _unsupported("borrow", "borrowed views are the store's own memory, which lives in the "
                                     "server (lends_memory is False); use load()")

    def flush(self) -> int:
        raise _unsupported("flush", "the cache-server protocol has no flush operation; the server "
                                    "flushes its volatile tiers when it shuts down")

    # -- data operations ---------------------------------------------------------------------------

    def save(self, keys: Sequence[BlockKey], srcs: Sequence[Any], *,
             checksums: Sequence[int | None] | None = None, hint: Hint | None = None) -> "Future[list[bool]]":
        """Store copies of ``srcs`` on the server; resolves to whether each is stored.
        ``checksums``: the writer's XXH3-64 (:func:`kvstore.block.checksum`) of each
        source (``None`` entries: hashed here), sent instead of a fresh hash, so the
        server refuses a source changed since its writer hashed it (``False``).
        ``hint`` goes to every key the server holds after the save (one HINT request),
        before the future resolves."""
        keys, srcs = _check_pairs(keys, srcs)
        if checksums is not None and len(checksums) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(checksums)} checksums")
        sums = list(checksums) if checksums is not None else None
        if check_hint(hint) is not None:
            return self._submit(partial(self._save_hinted, hint=hint, sums=sums), keys, srcs)
        return self._submit(partial(self._save, sums=sums), keys, srcs)

    def _save_hinted(self, keys: list[BlockKey], srcs: list[Any], hint: Hint,
                     sums: list[int | None] | None) -> list[bool]:
        out = self._save(keys, srcs, sums)
        if keys:
            self._hint_quietly(keys, hint)
        return out

    def load(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> "Future[list[bool]]":
        """Copy blocks into caller-owned buffers; ``True`` only where every byte arrived.
        A stored block whose size differs from its buffer raises BufferSizeError."""
        keys, dsts = _check_pairs(keys, dsts)
        return self._submit(self._load, keys, dsts)

    def _submit(self, fn: Callable, keys: list, bufs: list) -> Future:
        if self._closed:
            raise StoreClosedError("the Client is closed")
        return submit(self._pool, capture(bufs), fn, keys, bufs)

    def _save(self, keys: list[BlockKey], srcs: list[Any], sums: list[int | None] | None = None) -> list[bool]:
        out: list[bool] = []
        if not keys:
            return out
        for lo, hi in self._batches(srcs, self._transport.put_limit(self._max_payload)):
            out += self._run_on(lambda c, t: t.put(c, keys[lo:hi], srcs[lo:hi],
                                                   None if sums is None else sums[lo:hi]))
        return out

    def _load(self, keys: list[BlockKey], dsts: list[Any]) -> list[bool]:
        out: list[bool] = []
        if not keys:
            return out
        for lo, hi in self._batches(dsts, self._max_payload):
            out += self._run_on(lambda c, t: t.get(c, keys[lo:hi], dsts[lo:hi]))
        return out

    # -- batching ---------------------------------------------------------------------------------

    def _chunks(self, keys: Sequence[BlockKey]) -> Iterator[list[BlockKey]]:
        keys = list(keys)
        for lo in range(0, len(keys), self._max_batch):
            yield keys[lo:lo + self._max_batch]

    def _batches(self, bufs: list[Any], limit: int) -> Iterator[tuple[int, int]]:
        """Index ranges of at most ``max_batch`` buffers and ``limit`` bytes (a single
        larger buffer goes alone; the server refuses it if it exceeds its limits)."""
        lo, acc = 0, 0
        for i, buf in enumerate(bufs):
            n = nbytes_of(buf)
            if i > lo and (acc + n > limit or i - lo >= self._max_batch):
                yield lo, i
                lo, acc = i, 0
            acc += n
        if lo < len(bufs):
            yield lo, len(bufs)

    def close(self) -> None:
        """Close every connection and unmap shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            session = self._session
            idle, session.idle = session.idle, []
            close = not session.closed
            session.closed = True
        for c in idle:
            c.close()
        if close:
            session.transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(eq=False)
class _Session:
    """One server instance as this client reaches it: the transport its HELLO chose,
    where pooled connections go (``addr``), the idle ones, and the instance id they must
    answer with. ``users``: calls running on it; a session retired after a restart is
    closed (its arena unmapped) by the last of them. Guarded by the Client's lock."""

    transport: Transport
    addr: Address
    idle: list[Conn] = field(default_factory=list)
    instance: Any = None
    users: int = 0
    retired: bool = False
    closed: bool = False


def _unsupported(method: str, why: str) -> NotSupportedError:
    return NotSupportedError(f"Client.{method} is not supported: {why}")


def _check_keys(keys: Sequence[BlockKey]) -> None:
    for key in keys:
        if not isinstance(key, BlockKey):
            raise InvalidArgumentError(f"keys must be BlockKey, got {type(key).__name__}")


def _check_pairs(keys: Sequence[BlockKey], bufs: Sequence[Any]) -> tuple[list, list]:
    if len(keys) != len(bufs):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(bufs)} buffers")
    _check_keys(keys)
    if len(set(keys)) != len(keys):
        raise InvalidArgumentError("a key appears twice in one batch")
    return list(keys), list(bufs)


__all__ = ["Client"]
