"""Loopback TCP proxies that damage bytes on the wire, for the end-to-end verification
tests: :class:`FlipProxy` understands kvstore frames and flips one payload byte on demand,
in either direction, and records every byte the client sent (to check what crosses the
wire); :class:`ByteFlipProxy` flips one client-to-server byte at a fixed offset of the
first connection, for a stream it cannot parse (TLS)."""

from __future__ import annotations

import socket
import threading

from kvstore.net import protocol as P


class _Proxy:
    """Listens on 127.0.0.1; forwards each connection to ``upstream`` (``(host, port)``),
    one thread per direction through :meth:`_pump` (``"c2s"`` or ``"s2c"``)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._socks += [client, server]
            threading.Thread(target=self._run, args=(client, server, "c2s"), daemon=True).start()
            threading.Thread(target=self._run, args=(server, client, "s2c"), daemon=True).start()

    def _run(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            self._pump(src, dst, direction)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()
        for s in self._socks:
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FlipProxy(_Proxy):
    """``arm("c2s")`` / ``arm("s2c")`` flips one byte in the middle of the next frame
    payload going client→server (a PUT's blocks) / server→client (a GET's blocks)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.armed = {"c2s": 0, "s2c": 0}
        self.flipped = {"c2s": 0, "s2c": 0}
        self.sent_by_client = bytearray()
        super().__init__(upstream)

    def arm(self, direction: str, times: int = 1) -> None:
        with self._lock:
            self.armed[direction] += times

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        while True:
            head = _recv(src, P.HEADER_BYTES)
            if len(head) < P.HEADER_BYTES:
                break
            body_len, payload_len = P.HEADER.unpack(head)[5:]
            frame = bytearray(head + _recv(src, body_len) + _recv(src, payload_len))
            with self._lock:
                if payload_len and self.armed[direction]:
                    self.armed[direction] -= 1
                    self.flipped[direction] += 1
                    frame[len(frame) - payload_len // 2] ^= 0x40
                if direction == "c2s":
                    self.sent_by_client += frame
            dst.sendall(frame)


class ByteFlipProxy(_Proxy):
    """Flips one client-to-server byte ``after`` bytes into the stream (once, whichever
    connection gets there first): for a stream it cannot parse."""

    def __init__(self, upstream: tuple[str, int], after: int) -> None:
        self.after, self.flipped = after, False
        super().__init__(upstream)

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        seen = 0
        while True:
            chunk = bytearray(src.recv(1 << 16))
            if not chunk:
                break
            with self._lock:
                if direction == "c2s" and not self.flipped and seen + len(chunk) > self.after:
                    chunk[self.after - seen] ^= 0x40
                    self.flipped = True
            seen += len(chunk)
            dst.sendall(chunk)


def _recv(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            break
        out += chunk
    return bytes(out)
