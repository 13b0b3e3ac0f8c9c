"""Pipelined block I/O of the redis tier on one redis-py connection.

redis-py keeps the connection (pool, AUTH/ACL handshake, TLS, timeouts, cluster
topology); this module writes the RESP2 requests of a batch onto its socket and parses
the replies itself, for one reason: redis-py returns every bulk reply as a new ``bytes``
(hiredis copies it out of its read buffer first), and takes a ``SET`` value only as one
contiguous argument. Here a ``GET`` reply's payload is received with ``recv_into``
straight into the caller's buffer (kernel -> destination, once), and a ``SET`` sends the
block header and the caller's payload as two pieces of one value, without joining them.

A batch is one pipeline: every request is sent, then every reply read in order. Any
failure part-way (timeout, reset, a reply we cannot parse) leaves the connection in an
unknown state, so the caller must ``disconnect()`` it (:func:`run_batch` does). Functions
here are stateless and thread-safe per connection; a connection serves one batch at a time.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from kvstore.block import (EXT_HEADER_BYTES, EXT_VERSION, HEADER_BYTES, checksum, header_size, parse_block_header,
                           parse_extension)
from kvstore.errors import CorruptBlockError

_CRLF = b"\r\n"
_SMALL = 16 << 10   # pieces below this are joined before a sendall


class ReplyError(Exception):
    """A ``-ERR …`` reply (MOVED, ASK, CLUSTERDOWN, NOPERM, OOM …) to one request."""

    @property
    def kind(self) -> str:
        return str(self).split(" ", 1)[0]


class ProtocolViolation(Exception):
    """The reply stream is not what the requests call for: drop the connection."""


def pack(*args: bytes) -> bytes:
    """One RESP2 request of small arguments."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def pack_set(key: bytes, header: bytes, payload: memoryview, px: int | None) -> list[Any]:
    """``SET key <header + payload> [PX ms]`` as pieces: the value is sent from the two
    buffers it lives in."""
    n = 3 if px is None else 5
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (n, len(key), key, len(header) + payload.nbytes)
    tail = _CRLF if px is None else b"\r\n$2\r\nPX\r\n" + b"$%d\r\n%d\r\n" % (len(str(px)), px)
    return [head + header, payload, tail]


class Reader:
    """RESP2 replies from a socket: short lines through a small buffer, bulk bodies
    received straight into the memory they are meant for."""

    def __init__(self, sock: Any, buf_bytes: int = 64 << 10) -> None:
        self._sock = sock
        self._buf = bytearray(buf_bytes)
        self._view = memoryview(self._buf)
        self._pos = self._end = 0

    def _fill(self) -> None:
        if self._pos == self._end:
            self._pos = self._end = 0
        elif self._end == len(self._buf):   # compact the partial line to the front
            rest = self._end - self._pos
            self._view[:rest] = self._view[self._pos:self._end]
            self._pos, self._end = 0, rest
        got = self._sock.recv_into(self._view[self._end:])
        if not got:
            raise ConnectionError("connection closed by the server")
        self._end += got

    def line(self) -> bytes:
        while True:
            i = self._buf.find(_CRLF, self._pos, self._end)
            if i >= 0:
                out = bytes(self._view[self._pos:i])
                self._pos = i + 2
                return out
            if self._end - self._pos >= len(self._buf) - 2:
                raise ProtocolViolation("reply line longer than the read buffer")
            self._fill()

    def read_into(self, dst: memoryview) -> None:
        """Exactly ``dst.nbytes`` bytes: the buffered part copied, the rest received in place."""
        n = dst.nbytes
        have = min(n, self._end - self._pos)
        if have:
            dst[:have] = self._view[self._pos:self._pos + have]
            self._pos += have
        while have < n:
            got = self._sock.recv_into(dst[have:])
            if not got:
                raise ConnectionError("connection closed by the server")
            have += got

    def skip(self, n: int) -> None:
        """Consume ``n`` bytes of a body nobody wants (a corrupt or foreign value)."""
        scratch = memoryview(bytearray(min(n, 1 << 20))) if n else None
        while n:
            k = min(n, scratch.nbytes)
            self.read_into(scratch[:k])
            n -= k

    def reply(self) -> Any:
        """A small reply: ``bytes`` for simple strings and bulk strings, ``int``,
        ``None`` for nil, a :class:`ReplyError` instance (returned, not raised)."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return ReplyError(rest.decode("utf-8", "replace"))
        if kind == b":":
            return int(rest)
        if kind == b"_":   # RESP3 null, should a server answer in RESP3 after all
            return None
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            out = bytearray(n + 2)
            self.read_into(memoryview(out))
            return bytes(out[:n])
        raise ProtocolViolation(f"unexpected reply {line[:40]!r}")

    def bulk_header(self) -> int | None | ReplyError:
        """The start of a bulk reply: its length, ``None`` for nil, or an error reply."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else n
        if kind == b"_":
            return None
        if kind == b"-":
            return ReplyError(rest.decode("utf-8", "replace"))
        raise ProtocolViolation(f"expected a bulk reply, got {line[:40]!r}")


class ReadOutcome:
    """One key of a pipelined GET: ``"hit"``, ``"nil"`` (absent: evicted, expired, never
    written), ``"corrupt"`` (with the reason), ``"size"`` (stored block has another size
    than the caller's buffer), or a :class:`ReplyError`."""

    __slots__ = ("status", "detail")

    def __init__(self, status: str, detail: Any = None) -> None:
        self.status, self.detail = status, detail


def read_block(reader: Reader, digest: bytes, dst: memoryview, header: memoryview) -> ReadOutcome:
    """Parse one GET reply holding a block: the header into ``header`` (at least
    ``EXT_HEADER_BYTES``), the payload straight into ``dst``, then verify both. On any
    outcome the reply is consumed completely, so the stream stays in step."""
    n = reader.bulk_header()
    if n is None:
        return ReadOutcome("nil")
    if isinstance(n, ReplyError):
        return ReadOutcome("error", n)
    if n < HEADER_BYTES:
        reader.skip(n + 2)
        return ReadOutcome("corrupt", f"value of {n} bytes is shorter than a block header")
    reader.read_into(header[:HEADER_BYTES])
    consumed = HEADER_BYTES
    try:
        head = parse_block_header(header, digest=digest)
        hb = header_size(head.version)
        if head.version == EXT_VERSION:
            if n < hb:
                raise CorruptBlockError(f"value of {n} bytes is shorter than its block header")
            reader.read_into(header[HEADER_BYTES:EXT_HEADER_BYTES])
            consumed = hb
            parse_extension(header)
        if n - hb != head.length:
            raise CorruptBlockError(f"value holds {n - hb} payload bytes, header says {head.length}")
    except CorruptBlockError as exc:
        reader.skip(n - consumed + 2)
        return ReadOutcome("corrupt", str(exc))
    if head.length != dst.nbytes:
        reader.skip(head.length + 2)
        return ReadOutcome("size", head.length)
    reader.read_into(dst)
    if reader.line() != b"":
        raise ProtocolViolation("bulk reply not terminated by CRLF")
    if checksum(dst, head.flags) != head.checksum:
        return ReadOutcome("corrupt", "block payload checksum mismatch")
    return ReadOutcome("hit", hb)


def run_batch(conn: Any, requests: Sequence[Any], read: Callable[[Reader], list]) -> list:
    """Send ``requests`` (bytes or buffers, in order) on ``conn`` and read every reply
    with ``read``. Any exception disconnects ``conn`` (its stream is out of step) and
    propagates; redis-py reconnects it on its next use."""
    try:
        if conn._sock is None:
            conn.connect()
        sock = conn._sock
        for piece in _coalesce(requests):
            sock.sendall(piece)
        return read(Reader(sock))
    except BaseException:
        conn.disconnect()
        raise


def _coalesce(pieces: Sequence[Any]):
    """Small pieces joined into one send; large buffers sent as they are (no copy)."""
    small: list[bytes] = []
    size = 0
    for p in pieces:
        if isinstance(p, bytes) and len(p) < _SMALL:
            small.append(p)
            size += len(p)
            if size >= _SMALL:
                yield b"".join(small)
                small, size = [], 0
            continue
        if small:
            yield b"".join(small)
            small, size = [], 0
        yield p
    if small:
        yield b"".join(small)


def header_scratch() -> memoryview:
    return memoryview(np.empty(EXT_HEADER_BYTES, np.uint8)).cast("B")
