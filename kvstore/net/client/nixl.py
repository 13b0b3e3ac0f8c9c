"""The client side of the NIXL data plane: :class:`NixlTransport`, the transport of a
:class:`kvstore.net.client.Client` that took NIXL, over :class:`NixlClientPath`.

The client owns a NIXL agent and tells the server about it on each pooled connection
(``NIXL_HELLO``, again whenever it registered more memory). It sends, per request, the
address of each of its buffers; the server moves the bytes one-sided (WRITE for a load,
READ for a save) and replies with sizes/flags only.

Buffers registered with :meth:`NixlClientPath.register` (long-lived KV-cache memory,
host or GPU) are used in place. Any other buffer goes through a pooled
registered staging buffer (one memcpy on the client), so unregistered memory is never
exposed and registrations do not pile up. Thread-safe: staging buffers come from a
free list (one per concurrent call at most), registered once and reused.

A NIXL/UCX failure (the connection itself intact) switches the client to TCP for good:
:class:`NixlTransport` closes its agent, tells the client (which logs it, counts it in
``fallbacks`` and takes a :class:`~kvstore.net.client.tcp.TcpTransport`), and redoes
the batch over TCP; blocks the server holds only in slower tiers come over TCP too.

Verified both ways: a save sends the XXH3-64 of each block (hashed here before the
server reads it; the server stores only blocks that match), and a load checks what the
server wrote against the checksum it sent; a mismatch is a miss, counted in the
client's ``checksum_mismatches``. Device buffers are hashed through a host copy.
"""

from __future__ import annotations

import select
import threading
from typing import Any, Callable, Sequence

import numpy as np

from kvstore.block import checksum
from kvstore.buffers import copy_bytes, host_view, is_device, nbytes_of
from kvstore.errors import BufferSizeError, RemoteError, TierUnavailableError, TransportError
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.net.client.tcp import Integrity, TcpTransport
from kvstore.net.nixl.endpoint import Descs, NixlEndpoint, descs_of, staging_buffer

_KIND = {"DRAM": 0, "VRAM": 1}
_NIXL_FAILURES = (TransportError, TierUnavailableError)


class NixlTransport:
    """Blocks moved by the server one-sided through ``path``, which this transport owns.
    ``on_failure(self, exc)`` is called once, on the first NIXL/UCX failure (while
    introducing this client, or in a call whose connection is still intact), after which
    every call goes over TCP (``tcp``) and the agent is closed. A failure with the
    connection broken is the network's: raised, for the client to retry or report.
    Thread-safe."""

    name = "nixl"

    def __init__(self, path: "NixlClientPath", *, tcp: TcpTransport,
                 on_failure: Callable[["NixlTransport", BaseException], None]) -> None:
        self._path: NixlClientPath | None = path
        self._tcp, self._on_failure = tcp, on_failure
        self._lock = threading.Lock()

    def start(self, run: Callable[[Callable[[Any], Any]], Any]) -> None:
        """Introduce this client's agent to the server on a pooled connection (``run``,
        the client's retry-once runner); a failure falls back to TCP."""
        path = self._path
        if path is None:
            return
        try:
            run(path.introduce)
        except _NIXL_FAILURES as exc:
            self._fail(exc)

    def put_limit(self, max_payload: int) -> int:
        return max_payload

    def register(self, buf: Any) -> None:
        path = self._path
        if path is not None:
            path.register(buf)

    def get(self, conn: Any, keys: list[BlockKey], dsts: list[Any]) -> list[bool]:
        res = self._call(conn, lambda p: p.get(conn, keys, dsts))
        if res is None:
            return self._tcp.get(conn, keys, dsts)
        out, later = res
        if later:  # held in a slower tier on the server: fetched over TCP
            got = self._tcp.get(conn, [keys[i] for i in later], [dsts[i] for i in later])
            for i, ok in zip(later, got):
                out[i] = ok
        return out

    def put(self, conn: Any, keys: list[BlockKey], srcs: list[Any],
            sums: list[int | None] | None = None) -> list[bool]:
        res = self._call(conn, lambda p: p.put(conn, keys, srcs, sums))
        return self._tcp.put(conn, keys, srcs, sums) if res is None else res

    def _call(self, conn: Any, fn: Callable[["NixlClientPath"], Any]) -> Any:
        """Run a NIXL operation; on a NIXL/UCX failure (the connection itself intact)
        fall back to TCP and return None so the caller redoes the batch over TCP."""
        path = self._path
        if path is None:
            return None
        try:
            return fn(path)
        except _NIXL_FAILURES as exc:
            if conn.broken:  # the network, not NIXL: the client retries or raises
                raise
            self._fail(exc)
            return None

    def _fail(self, exc: BaseException) -> None:
        """Switch to TCP for good: the client is told once (it logs and counts it)."""
        with self._lock:
            path, self._path = self._path, None
        if path is not None:
            self._on_failure(self, exc)
            path.close()

    def close(self) -> None:
        with self._lock:
            path, self._path = self._path, None
        if path is not None:
            path.close()


class NixlClientPath:
    def __init__(self, *, timeout_s: float, staging_bytes: int, integrity: Integrity | None = None) -> None:
        self._integrity = integrity or Integrity()
        # No progress thread (it busy-polls a core for the process's lifetime): the
        # client drives UCX itself while it waits for the server's reply (_call).
        self.endpoint = NixlEndpoint("client", timeout_s=timeout_s, progress_thread=False)
        self._staging_bytes = staging_bytes
        self._lock = threading.Lock()
        self._version = 1  # bumped on every registration: connections re-introduce us
        self._free: list[np.ndarray] = []  # registered staging buffers not in use

    def register(self, buf: Any) -> None:
        """Register a long-lived buffer so transfers use it in place."""
        self.endpoint.register(buf)
        with self._lock:
            self._version += 1

    def introduce(self, conn: Any) -> None:
        """Send our metadata on ``conn`` unless it has the current version."""
        with self._lock:
            version = self._version
        if getattr(conn, "nixl_version", 0) == version:
            return
        _, body = self._call(conn, P.Op.NIXL_HELLO, self.endpoint.metadata())
        self.endpoint.add_peer(body)
        conn.nixl_version = version

    def _take_staging(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        buf = staging_buffer(max(nbytes, self._staging_bytes))  # touched once, reused
        self.register(buf)
        return buf

    def _give_back(self, buf: np.ndarray | None) -> None:
        if buf is not None:
            with self._lock:
                self._free.append(buf)

    def _place(self, bufs: Sequence[Any]) -> tuple[Descs, list[np.ndarray] | None, np.ndarray | None]:
        """Descriptors for ``bufs`` in place when all are registered (one memory kind),
        else for slices of a staging buffer (returned with the slices; give it back)."""
        try:
            direct = descs_of(bufs)
            if self.endpoint.covers(direct):
                return direct, None, None
        except Exception:  # mixed host/GPU or odd buffer types: stage them
            pass
        sizes = [nbytes_of(b) for b in bufs]
        staging = self._take_staging(sum(sizes))
        views, pos = [], 0
        for n in sizes:
            views.append(staging[pos:pos + n])
            pos += n
        return descs_of(views), views, staging

    def get(self, conn: Any, keys: list[BlockKey], dsts: list[Any]) -> tuple[list[bool], list[int]]:
        """Load into ``dsts``. Returns per-key hits and the indices the server did not
        send (held in a slower tier: fetch them over TCP)."""
        sizes = [nbytes_of(d) for d in dsts]
        descs, staged, staging = self._place(dsts)
        try:
            return self._get(conn, keys, dsts, sizes, descs, staged)
        finally:
            self._give_back(staging)

    def _get(self, conn, keys, dsts, sizes, descs, staged) -> tuple[list[bool], list[int]]:
        self.introduce(conn)
        body = P.encode_nixl(_KIND[descs.mem], int(descs.rows[0, 2]), keys, sizes, descs.rows[:, 0].tolist())
        _, reply = self._call(conn, P.Op.NIXL_GET, body)
        rec = P.decode_summed(reply, len(keys))
        got, sums = rec["nbytes"].tolist(), rec["checksum"].tolist()
        out, later = [], []
        for i, (g, want) in enumerate(zip(got, sizes)):
            if g == P.SIZE_MISMATCH:
                raise BufferSizeError(f"buffer for {keys[i]!r} has {want} bytes; the stored block differs")
            if g == P.NOT_SENT:
                later.append(i)
            elif g >= 0 and g != want:
                raise RemoteError(f"server {conn.addr}: NIXL_GET sent {g} bytes into a {want}-byte buffer")
            out.append(g >= 0)
        verify, bad = self._integrity.verify, 0
        for i, ok in enumerate(out):
            if not ok:
                continue
            if verify and _hash(staged[i] if staged is not None else dsts[i]) != sums[i]:
                out[i] = False      # what the server wrote is not the block it stored
                bad += 1
            elif staged is not None:
                if is_device(dsts[i]):
                    copy_bytes(dsts[i], staged[i])
                else:
                    np.copyto(host_view(dsts[i], writable=True), staged[i], casting="no")
        if bad:
            self._integrity.failed(bad)
        return out, later

    def put(self, conn: Any, keys: list[BlockKey], srcs: list[Any],
            given: list[int | None] | None = None) -> list[bool]:
        sizes = [nbytes_of(s) for s in srcs]
        descs, staged, staging = self._place(srcs)
        try:
            if staged is not None:
                for view, src in zip(staged, srcs):
                    copy_bytes(view, src)
            sums = [_hash(b) if g is None else g   # before the server reads (or the writer's)
                    for b, g in zip(staged if staged is not None else srcs, given or [None] * len(srcs))]
            self.introduce(conn)
            body = P.encode_nixl(_KIND[descs.mem], int(descs.rows[0, 2]), keys, sizes, descs.rows[:, 0].tolist(),
                                 sums)
            _, reply = self._call(conn, P.Op.NIXL_PUT, body)
            return P.decode_flags(reply, len(keys))
        finally:
            self._give_back(staging)

    def _call(self, conn: Any, op: int, body: bytes) -> tuple[Any, bytes]:
        """Send a request and progress NIXL until the reply is readable (the server's
        one-sided transfer may need this side's UCX worker, e.g. to connect). The wait
        between progress calls grows to 10 ms: the reply wakes ``select`` at once, and
        many waiting clients must not spin the CPU the server needs."""
        conn.send(op, body)
        sock, progress = conn.sock, self.endpoint.progress
        wait = 1e-4
        while True:
            progress()
            readable, _, _ = select.select([sock], [], [], wait)
            if readable:
                return conn.recv_reply(op)
            wait = min(wait * 2, 1e-2)

    def close(self) -> None:
        self.endpoint.close()


def _hash(buf: Any) -> int:
    """XXH3-64 of a host buffer, or of a device buffer through a host copy."""
    if is_device(buf):
        tmp = np.empty(nbytes_of(buf), np.uint8)
        copy_bytes(tmp, buf)
        return checksum(tmp)
    return checksum(host_view(buf))


__all__ = ["NixlClientPath", "NixlTransport"]
