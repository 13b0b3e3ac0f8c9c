"""The HELLO handshake over a raw socket, for tests that speak frames by hand."""

from __future__ import annotations

import socket
import time

from kvstore.block import checksum
from kvstore.net import protocol as P
from kvstore.net.auth import hello_proof
from kvstore.testing import make_keys, payload

_REPLY = P.Limits(1 << 40, 1 << 30)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def call(sock: socket.socket, op: int, body: bytes, rid: int = 1) -> tuple[P.Header, bytes]:
    """Send one request; return the reply header and body."""
    sock.sendall(P.pack_header(op, rid, len(body)) + body)
    hdr = P.parse_header(recv_exact(sock, P.HEADER_BYTES), _REPLY, reply=True)
    return hdr, recv_exact(sock, hdr.body_len)


def raw_hello(sock: socket.socket, token: str | None = None, client: str = "test") -> dict:
    """Both HELLO steps (challenge, then the proof); returns the server's info."""
    _, body = call(sock, P.Op.HELLO, P.encode_json({"client": client, "protocol": P.VERSION}))
    nonce = bytes.fromhex(P.decode_json(body)["challenge"])
    hello = {"client": client, "protocol": P.VERSION}
    if token is not None:
        hello["proof"] = hello_proof(token, nonce, client)
    hdr, body = call(sock, P.Op.HELLO, P.encode_json(hello), rid=2)
    assert hdr.status == 0, body
    return P.decode_json(body)


def paced_put(sock: socket.socket, salt: str, nbytes: int, chunk: int, every_s: float) -> bytes:
    """A raw PUT of one block whose payload is sent ``chunk`` bytes every ``every_s``;
    returns the reply's per-key result (``b"\\x01"``: stored)."""
    data = payload(7, nbytes)
    body = P.encode_records(P.PUT_REC, make_keys(1, salt=salt), [nbytes], [checksum(data)])
    sock.sendall(P.pack_header(P.Op.PUT, 9, len(body), nbytes) + body)
    raw = data.tobytes()
    for i in range(0, nbytes, chunk):
        time.sleep(every_s)
        sock.sendall(raw[i:i + chunk])
    hdr = P.parse_header(recv_exact(sock, P.HEADER_BYTES), _REPLY, reply=True)
    reply = recv_exact(sock, hdr.body_len)
    assert hdr.status == 0, reply
    return reply
