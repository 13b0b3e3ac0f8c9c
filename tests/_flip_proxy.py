"""A loopback TCP proxy that understands kvstore frames and flips one payload byte on
demand, in either direction, for the end-to-end verification tests. It also records
every byte the client sent (to check what crosses the wire)."""

from __future__ import annotations

import socket
import threading

from kvstore.net import protocol as P


class FlipProxy:
    """Listens on 127.0.0.1; forwards each connection to ``upstream`` (``(host, port)``).
    ``arm("c2s")`` / ``arm("s2c")`` flips one byte in the middle of the next frame
    payload going client→server (a PUT's blocks) / server→client (a GET's blocks)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.armed = {"c2s": 0, "s2c": 0}
        self.flipped = {"c2s": 0, "s2c": 0}
        self.sent_by_client = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, direction: str, times: int = 1) -> None:
        with self._lock:
            self.armed[direction] += times

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, "c2s"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "s2c"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
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
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()
        for s in self._socks:
            s.close()


def _recv(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            break
        out += chunk
    return bytes(out)
