"""Sending a GET reply's block bytes: many buffers per ``sendmsg`` call, from sender
threads when the reply is large.

Over TCP the sending thread pays for the kernel's copy of every byte (and, on
loopback, for delivering it to the receiver). Done on the event loop, one core serves
every client's bytes; a large reply is therefore sent by a small pool of sender
threads (the GIL is released inside ``sendmsg``) for as long as the socket takes bytes,
and the event loop waits for room, so a slow reader never holds a thread. The
connection does not touch its socket until the send finishes (one request at a time
per connection).

Ownership: the buffers must stay valid until the send returns (the caller holds the
Store borrow open until then).
"""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

THREAD_BYTES = 1 << 20   # replies smaller than this are sent from the event loop
_IOV_MAX = 512           # buffers per sendmsg call (the kernel allows 1024)


def _views(buffers: Sequence[Any]) -> list[memoryview]:
    out = []
    for b in buffers:
        mv = memoryview(b).cast("B")
        if mv.nbytes:
            out.append(mv)
    return out


def _send_some(sock: socket.socket, state: list) -> bool:
    """Send from ``state = [views, index]`` until the socket is full; True when done."""
    views, i = state
    try:
        while i < len(views):
            sent = sock.sendmsg(views[i:i + _IOV_MAX])
            while sent:
                n = views[i].nbytes
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0
        return True
    except (BlockingIOError, InterruptedError):
        return False
    finally:
        state[1] = i


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout_s: float) -> None:
    fut = loop.create_future()
    fd = sock.fileno()
    loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await asyncio.wait_for(fut, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"peer took no bytes for {timeout_s} s") from None
    finally:
        loop.remove_writer(fd)


class Sender:
    """The server's pool of sender threads (created on first use)."""

    def __init__(self, threads: int, timeout_s: float) -> None:
        self._threads, self._timeout_s = threads, timeout_s
        self._pool: ThreadPoolExecutor | None = None

    def executor(self, nbytes: int) -> ThreadPoolExecutor | None:
        """The sender threads for a transfer of ``nbytes``; None: do it on the loop."""
        if nbytes < THREAD_BYTES or self._threads < 1:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kvstore-send")
        return self._pool

    async def send(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, buffers: Sequence[Any],
                   nbytes: int) -> None:
        state = [_views(buffers), 0]
        pool = self.executor(nbytes)
        if pool is None:
            while not _send_some(sock, state):
                await _writable(loop, sock, self._timeout_s)
            return
        # A thread copies while the socket takes bytes; waiting for room happens on the
        # loop, so a slow reader never holds a sender thread.
        while True:
            fut = loop.run_in_executor(pool, _send_some, sock, state)
            try:
                done = await asyncio.shield(fut)
            except asyncio.CancelledError:
                # The thread still reads the caller's buffers: let it stop before the
                # caller releases them.
                await asyncio.wait([fut])
                raise
            if done:
                return
            await _writable(loop, sock, self._timeout_s)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
