"""A server connection's bytes over TLS (``server.tls``): a non-blocking
:class:`ssl.SSLSocket` driven from the event loop.

asyncio's ``sock_*`` calls refuse SSL sockets, and its TLS streams would copy every
payload through a StreamReader; this keeps the plaintext path's shape instead: a PUT
payload is decrypted straight into the connection's buffer, a GET reply is encrypted
straight from the DRAM tier's borrowed views. OpenSSL needs the socket readable or
writable (``SSLWantReadError`` / ``SSLWantWriteError``); the loop waits for that and
the call is retried with the same buffer. Transfers of at least ``THREAD_BYTES`` run
their OpenSSL calls on the server's sender threads (the GIL is released inside them),
so several clients' encryption uses several cores; waiting for the socket still
happens on the loop, so a slow peer never holds a thread. One request at a time per
connection: the loop does not touch the socket while a thread does.

Ownership: buffers given to :meth:`TlsStream.send` and :meth:`TlsStream.recv_exact`
must stay valid until they return (a cancelled call waits for its thread first).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any, Callable, Sequence

from kvstore.net.server._send import THREAD_BYTES, Sender

COALESCE_BYTES = 64 << 10   # smaller buffers are joined up to this size: one TLS record run, not one each
_EOF = "eof"


async def wait_ready(loop: asyncio.AbstractEventLoop, fd: int, write: bool, timeout_s: float | None) -> None:
    fut = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: fut.done() or fut.set_result(None))
    try:
        if timeout_s is None:
            await fut
        else:
            try:
                await asyncio.wait_for(fut, timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"peer took no bytes for {timeout_s} s") from None
    finally:
        remove(fd)


async def peek_first_byte(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """The first byte the peer sent, left in the socket (b"" when it closed)."""
    while True:
        try:
            return sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            await wait_ready(loop, sock.fileno(), False, None)


def _chunks(buffers: Sequence[Any]) -> list[Any]:
    """``buffers`` as byte views; runs of small ones joined into one bytes object."""
    out: list[Any] = []
    small: list[memoryview] = []
    size = 0
    for b in buffers:
        mv = memoryview(b).cast("B")
        if not mv.nbytes:
            continue
        if mv.nbytes >= COALESCE_BYTES:
            if small:
                out.append(b"".join(small))
                small, size = [], 0
            out.append(mv)
            continue
        small.append(mv)
        size += mv.nbytes
        if size >= COALESCE_BYTES:
            out.append(b"".join(small))
            small, size = [], 0
    if small:
        out.append(b"".join(small))
    return out


def _send_some(sock: ssl.SSLSocket, state: list) -> str | None:
    """Send ``state = [chunks, index]`` until OpenSSL needs the socket: None when done,
    else ``"r"``/``"w"``: what to wait for before calling again."""
    chunks, i = state
    try:
        while i < len(chunks):
            n = sock.send(chunks[i])     # retried with the same buffer after a Want error
            if n < len(chunks[i]):
                chunks[i] = memoryview(chunks[i])[n:]
            else:
                i += 1
        return None
    except ssl.SSLWantWriteError:
        return "w"
    except ssl.SSLWantReadError:
        return "r"
    finally:
        state[1] = i


def _recv_some(sock: ssl.SSLSocket, state: list) -> str | None:
    """Fill ``state = [view, got]`` until OpenSSL needs the socket: None when full,
    ``"eof"`` when the peer closed, else ``"r"``/``"w"``."""
    view, got = state
    n = view.nbytes
    try:
        while got < n:
            k = sock.recv_into(view[got:])
            if not k:
                return _EOF
            got += k
        return None
    except ssl.SSLWantReadError:
        return "r"
    except ssl.SSLWantWriteError:
        return "w"
    finally:
        state[1] = got


class TlsStream:
    """The TLS side of one connection. ``timeout_s`` bounds each wait for room to send
    (as :class:`Sender`); reads are bounded by the server's reaper (``stalled``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: ssl.SSLSocket, sender: Sender,
                 timeout_s: float) -> None:
        self.loop, self.sock, self.sender, self.timeout_s = loop, sock, sender, timeout_s
        self.fd = sock.fileno()

    async def _wait(self, want: str) -> None:
        await wait_ready(self.loop, self.fd, want == "w", self.timeout_s if want == "w" else None)

    async def handshake(self) -> None:
        while True:
            try:
                self.sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self._wait("r")
            except ssl.SSLWantWriteError:
                await self._wait("w")

    async def _drive(self, step: Callable[[ssl.SSLSocket, list], str | None], state: list, nbytes: int,
                     stalled: Callable[[bool, int], None] | None = None) -> str | None:
        pool = self.sender.executor(nbytes)
        while True:
            if pool is None:
                want = step(self.sock, state)
            else:
                fut = self.loop.run_in_executor(pool, step, self.sock, state)
                try:
                    want = await asyncio.shield(fut)
                except asyncio.CancelledError:
                    await asyncio.wait([fut])   # the thread still uses the buffers and the socket
                    raise
            if want is None or want == _EOF:
                return want
            if stalled is not None:
                stalled(True, state[1])
            await self._wait(want)
            if stalled is not None:
                stalled(False, state[1])

    async def recv_exact(self, view: memoryview, stalled: Callable[[bool, int], None] | None = None) -> int:
        """Fill ``view``; returns the bytes received (fewer only when the peer closed).
        ``stalled(True, got)`` is called before each wait for the peer, ``stalled(False,
        got)`` once it sent more (``got``: the bytes of ``view`` filled so far)."""
        state = [view, 0]
        await self._drive(_recv_some, state, view.nbytes, stalled)
        return state[1]

    async def send(self, buffers: Sequence[Any], nbytes: int) -> None:
        """Send ``buffers`` in order (a GET reply: header, body, blocks)."""
        await self._drive(_send_some, [_chunks(buffers), 0], nbytes)

    async def sendall(self, data: bytes) -> None:
        await self._drive(_send_some, [[data], 0], 0)


__all__ = ["TlsStream", "peek_first_byte", "wait_ready"]
