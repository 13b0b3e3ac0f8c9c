"""The cache client's TCP data path: a PUT sends the blocks after their records (each
with the XXH3-64 of its bytes, computed here before they leave), a GET receives them
after their sizes and checksums, on one connection, and verifies every block before
reporting it loaded; device buffers cross through host memory. :class:`TcpTransport`
is :class:`kvstore.net.client.Client`'s transport when it takes neither shared memory
nor NIXL (and after a NIXL failure); :func:`tcp_get` / :func:`tcp_put` also carry the
blocks the other transports leave to the socket."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvstore.block import checksum
from kvstore.buffers import copy_bytes, host_view, is_device, nbytes_of
from kvstore.errors import BufferSizeError, RemoteError
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.net.client.wire import Conn


class Integrity:
    """Whether a client verifies received blocks against the server's checksums
    (``verify``; off only to measure what verification costs) and how many failed
    (``mismatches``: each a miss, never a hit). Thread-safe."""

    def __init__(self, verify: bool = True) -> None:
        self.verify = verify
        self.mismatches = 0
        self._lock = threading.Lock()

    def failed(self, n: int = 1) -> None:
        with self._lock:
            self.mismatches += n


class TcpTransport:
    """Block bytes inside frames on the control connection (the
    :class:`~kvstore.net.client.selection.Transport` every server offers). Stateless
    but for ``integrity``; thread-safe."""

    name = "tcp"

    def __init__(self, integrity: Integrity) -> None:
        self._integrity = integrity

    def start(self, run: Any) -> None:
        """Nothing to set up: the HELLO was all."""

    def put(self, conn: Conn, keys: list[BlockKey], srcs: list[Any],
            sums: list[int | None] | None = None) -> list[bool]:
        return tcp_put(conn, keys, srcs, self._integrity, sums)

    def get(self, conn: Conn, keys: list[BlockKey], dsts: list[Any]) -> list[bool]:
        return tcp_get(conn, keys, dsts, self._integrity)

    def put_limit(self, max_payload: int) -> int:
        return max_payload

    def register(self, buf: Any) -> None:
        """A no-op: TCP receives into any buffer."""

    def close(self) -> None:
        """Nothing of its own to close (the connections are the Client's)."""


def tcp_put(conn: Conn, keys: list[BlockKey], srcs: list[Any], integrity: Integrity | None = None,
            given: list[int | None] | None = None) -> list[bool]:
    """PUT one batch; ``given``: the writer's checksums (see :meth:`Transport.put`)."""
    sizes = [nbytes_of(s) for s in srcs]
    views = [_host_copy(s) for s in srcs]
    # taken before the bytes leave (or the writer's): the server refuses a changed block
    sums = [checksum(v) if g is None else g for v, g in zip(views, given or [None] * len(views))]
    _, body = conn.call(P.Op.PUT, P.encode_records(P.PUT_REC, keys, sizes, sums), [memoryview(v) for v in views])
    return P.decode_flags(body, len(keys))


def tcp_get(conn: Conn, keys: list[BlockKey], dsts: list[Any], integrity: Integrity | None = None) -> list[bool]:
    """Receive blocks into ``dsts``; ``True`` only for a block whose bytes match the
    checksum the server sent (unless ``integrity.verify`` is off)."""
    sizes = [nbytes_of(d) for d in dsts]
    hdr, body = conn.call(P.Op.GET, P.encode_records(P.SIZED, keys, sizes))
    rec = P.decode_summed(body, len(keys))
    got, sums = rec["nbytes"].tolist(), rec["checksum"].tolist()
    expected = sum(s for s in got if s > 0)
    if hdr.payload_len != expected or any(s >= 0 and s != w for s, w in zip(got, sizes)):
        conn.close()
        raise RemoteError(f"server {conn.addr}: GET reply sizes do not match the request")
    verify = integrity is None or integrity.verify
    out = [s >= 0 for s in got]
    bad = 0
    for i, (dst, size) in enumerate(zip(dsts, got)):
        if size > 0 and _recv_block(conn, dst, size, verify) not in (None, sums[i]):
            out[i] = False
            bad += 1
    if bad and integrity is not None:
        integrity.failed(bad)
    raise_mismatch(keys, got, sizes)
    return out


def _host_copy(buf: Any) -> np.ndarray:
    """A host view of ``buf`` (a staged copy only for device tensors)."""
    if is_device(buf):
        out = np.empty(nbytes_of(buf), np.uint8)
        copy_bytes(out, buf)
        return out
    return host_view(buf)


def _recv_block(conn: Conn, dst: Any, size: int, verify: bool) -> int | None:
    """Receive one block into ``dst``; returns the checksum of what arrived (``None``
    when not verifying)."""
    if is_device(dst):
        tmp = np.empty(size, np.uint8)
        conn.recv_into(memoryview(tmp))
        csum = checksum(tmp) if verify else None
        copy_bytes(dst, tmp)
        return csum
    view = host_view(dst, writable=True)
    conn.recv_into(memoryview(view))
    return checksum(view) if verify else None


def raise_mismatch(keys: list[BlockKey], got: list[int], sizes: list[int]) -> None:
    for key, g, want in zip(keys, got, sizes):
        if g == P.SIZE_MISMATCH:
            raise BufferSizeError(f"buffer for {key!r} has {want} bytes; the stored block differs")


__all__ = ["Integrity", "TcpTransport", "raise_mismatch", "tcp_get", "tcp_put"]
