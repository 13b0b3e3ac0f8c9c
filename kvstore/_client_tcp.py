"""The cache client's TCP data path: a PUT sends the blocks after their records, a GET
receives them after their sizes, on one connection; device buffers cross through host
memory. Used by :class:`kvstore.client.Client` and, for blocks the server can only
send over the socket, by the same-host path."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore._wire import Conn
from kvstore.buffers import copy_bytes, host_view, is_device, nbytes_of
from kvstore.errors import BufferSizeError, RemoteError
from kvstore.keys import BlockKey
from kvstore.server import _protocol as P


def tcp_put(conn: Conn, keys: list[BlockKey], srcs: list[Any]) -> list[bool]:
    sizes = [nbytes_of(s) for s in srcs]
    views = [memoryview(_host_copy(s)) for s in srcs]
    _, body = conn.call(P.Op.PUT, P.encode_records(P.SIZED, keys, sizes), views)
    return P.decode_flags(body, len(keys))


def tcp_get(conn: Conn, keys: list[BlockKey], dsts: list[Any]) -> list[bool]:
    sizes = [nbytes_of(d) for d in dsts]
    hdr, body = conn.call(P.Op.GET, P.encode_records(P.SIZED, keys, sizes))
    got = P.decode_sizes(body, len(keys)).tolist()
    expected = sum(s for s in got if s > 0)
    if hdr.payload_len != expected or any(s >= 0 and s != w for s, w in zip(got, sizes)):
        conn.close()
        raise RemoteError(f"server {conn.addr}: GET reply sizes do not match the request")
    for dst, size in zip(dsts, got):
        if size > 0:
            _recv_block(conn, dst, size)
    raise_mismatch(keys, got, sizes)
    return [s >= 0 for s in got]


def _host_copy(buf: Any) -> np.ndarray:
    """A host view of ``buf`` (a staged copy only for device tensors)."""
    if is_device(buf):
        out = np.empty(nbytes_of(buf), np.uint8)
        copy_bytes(out, buf)
        return out
    return host_view(buf)


def _recv_block(conn: Conn, dst: Any, size: int) -> None:
    if is_device(dst):
        tmp = np.empty(size, np.uint8)
        conn.recv_into(memoryview(tmp))
        copy_bytes(dst, tmp)
    else:
        conn.recv_into(memoryview(host_view(dst, writable=True)))


def raise_mismatch(keys: list[BlockKey], got: list[int], sizes: list[int]) -> None:
    for key, g, want in zip(keys, got, sizes):
        if g == P.SIZE_MISMATCH:
            raise BufferSizeError(f"buffer for {key!r} has {want} bytes; the stored block differs")


__all__ = ["raise_mismatch", "tcp_get", "tcp_put"]
