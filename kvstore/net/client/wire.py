"""The client's side of one server connection: a blocking socket (TCP or Unix) that
speaks the frames of ``kvstore/net/protocol.py``, plus the client's staging region
for same-host puts. Used by :class:`kvstore.net.client.Client`; one thread at a time.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import ssl
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvstore.buffers.pinning import HostPin
from kvstore.errors import (AuthError, BufferSizeError, InvalidArgumentError, ProtocolError, RemoteError,
                            TierUnavailableError)
from kvstore.net import protocol as P
from kvstore.net.auth import hello_proof
from kvstore.net.staging import STAGING_DIR, STAGING_PREFIX
from kvstore.net.tls import ClientTls, describe as describe_tls

_REPLY_LIMITS = P.Limits(max_frame_bytes=1 << 62, max_batch=1 << 30)
_CLOSING = {P.Status.PROTOCOL, P.Status.AUTH, P.Status.TOO_LARGE, P.Status.INTERNAL}


@dataclass(frozen=True)
class Address:
    """``host:port`` (TCP) or a Unix socket path (``unix:/path`` or ``/path``)."""

    host: str | None
    port: int | None
    path: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Address":
        if not isinstance(text, str) or not text:
            raise InvalidArgumentError(f"server address must be 'host:port' or a socket path, got {text!r}")
        if text.startswith("unix:"):
            return cls(None, None, text[5:])
        if text.startswith("/"):
            return cls(None, None, text)
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise InvalidArgumentError(f"server address must be 'host:port' or a socket path, got {text!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.path else f"{self.host}:{self.port}"


def _raise_status(status: int, message: str, addr: Address) -> None:
    text = f"server {addr}: {message}"
    if status == P.Status.AUTH:
        raise AuthError(text)
    if status in (P.Status.PROTOCOL, P.Status.TOO_LARGE):
        raise ProtocolError(text)
    if status == P.Status.INVALID:
        raise InvalidArgumentError(text)
    if status == P.Status.BUFFER_SIZE:
        raise BufferSizeError(text)
    if status == P.Status.UNAVAILABLE:
        raise TierUnavailableError(text)
    raise RemoteError(text)


class Conn:
    """A connected, authenticated socket. Any network failure raises
    :class:`TierUnavailableError` and marks the connection ``broken`` (never reused).
    With ``tls``, a TCP connection is wrapped in TLS before the HELLO (a Unix socket
    never is: the same-host path is plaintext); a TLS failure is a
    TierUnavailableError whose message says what TLS found."""

    def __init__(self, addr: Address, token: str | None, timeout_s: float, tls: ClientTls | None = None) -> None:
        self.addr = addr
        self.broken = False
        self.staging: ClientStaging | None = None
        self._rid = 0
        self._head = bytearray(P.HEADER_BYTES)
        try:
            if addr.path:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(timeout_s)
                self.sock.connect(addr.path)
            else:
                self.sock = socket.create_connection((addr.host, addr.port), timeout=timeout_s)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise TierUnavailableError(f"cannot connect to kvstore server {addr}: {exc}") from exc
        self.tls = tls is not None and not addr.path
        if self.tls:
            raw = self.sock
            try:
                self.sock = tls.wrap(raw, addr.host)
            except (ssl.SSLError, OSError) as exc:
                raw.close()
                raise TierUnavailableError(f"TLS handshake with kvstore server {addr} failed: "
                                           f"{describe_tls(exc)}") from exc
        hello: dict[str, Any] = {"client": "kvstore-python", "protocol": P.VERSION}
        try:
            # Challenge-response: the server's nonce, then an HMAC of it under the token
            # (never the token itself; a captured answer fails on any other connection).
            _, body = self.call(P.Op.HELLO, P.encode_json(hello))
            nonce = P.decode_json(body).get("challenge")
            if not isinstance(nonce, str) or len(nonce) != 64 or not all(c in "0123456789abcdef" for c in nonce):
                raise ProtocolError(f"server {addr}: HELLO reply carries no challenge (not a protocol "
                                    f"{P.VERSION} server?)")
            if token is not None:
                hello["proof"] = hello_proof(token, bytes.fromhex(nonce), hello["client"])
            _, body = self.call(P.Op.HELLO, P.encode_json(hello))
            self.info = P.decode_json(body)
        except BaseException:
            self.close()
            raise

    # -- frames ------------------------------------------------------------------------------

    def send(self, op: int, body: bytes = b"", payloads: Sequence[Any] = ()) -> int:
        """Send one request; ``payloads`` are buffers sent as they are (no copy)."""
        self._rid = (self._rid + 1) & 0xFFFFFFFF
        total = sum(memoryview(p).nbytes for p in payloads)
        try:
            self.sock.sendall(P.pack_header(op, self._rid, len(body), total) + body)
            for p in payloads:
                self.sock.sendall(p)
        except OSError as exc:
            self._fail(exc)
        return self._rid

    def recv_reply(self, op: int) -> tuple[P.Header, bytes]:
        """Read one reply header and body; raise the mapped error for a failure status."""
        self.recv_into(memoryview(self._head))
        try:
            hdr = P.parse_header(self._head, _REPLY_LIMITS, reply=True)
        except ProtocolError:
            self.broken = True
            raise
        body = bytearray(hdr.body_len)
        if hdr.body_len:
            self.recv_into(memoryview(body))
        if hdr.status:
            if hdr.status in _CLOSING or hdr.request_id != self._rid:
                self.broken = True
            _raise_status(hdr.status, bytes(body).decode(errors="replace"), self.addr)
        if hdr.op != op or hdr.request_id != self._rid:
            self.broken = True
            raise ProtocolError(f"server {self.addr}: reply {hdr.op}/{hdr.request_id} to request {op}/{self._rid}")
        return hdr, bytes(body)

    def call(self, op: int, body: bytes = b"", payloads: Sequence[Any] = ()) -> tuple[P.Header, bytes]:
        self.send(op, body, payloads)
        return self.recv_reply(op)

    def recv_into(self, view: memoryview) -> None:
        got, n = 0, view.nbytes
        try:
            while got < n:
                k = self.sock.recv_into(view[got:])
                if not k:
                    raise ConnectionResetError(f"server closed the connection after {got} of {n} bytes")
                got += k
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.broken = True
        self.close()
        if self.tls and (isinstance(exc, ssl.SSLError) or not hasattr(self, "info")):
            # e.g. a TLS 1.3 server refusing this client's certificate: the client's side of
            # the handshake completes, the refusal arrives with (or instead of) the HELLO reply
            raise TierUnavailableError(f"kvstore server {self.addr}: TLS: "
                                       f"{describe_tls(exc, after_handshake=not hasattr(self, 'info'))}") from exc
        raise TierUnavailableError(f"kvstore server {self.addr}: {exc}") from exc

    def attach_staging(self, nbytes: int) -> "ClientStaging":
        if self.staging is None:
            staging = ClientStaging(nbytes)
            try:
                self.call(P.Op.SHM_ATTACH, P.encode_json({"path": staging.path, "nbytes": nbytes}))
            finally:
                staging.unlink()  # the server holds its own map now; nothing to leak on a crash
            self.staging = staging
        return self.staging

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass
        if self.staging is not None:
            self.staging.close()
            self.staging = None


class ClientStaging:
    """A region under ``/dev/shm`` this client writes puts into; the server maps it."""

    def __init__(self, nbytes: int) -> None:
        self.path = os.path.join(STAGING_DIR, f"{STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = self.array.ctypes.data

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.array = np.empty(0, np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass


class ArenaMap:
    """The server's DRAM arena mapped into this process: read-write when this process
    may open the file for writing (same-host puts then fill reserved slots in place),
    else read-only (puts go through the staging region). ``writable`` says which."""

    def __init__(self, info: dict[str, Any]) -> None:
        try:
            fd, prot, self.writable = os.open(info["path"], os.O_RDWR), mmap.PROT_READ | mmap.PROT_WRITE, True
        except PermissionError:
            fd, prot, self.writable = os.open(info["path"], os.O_RDONLY), mmap.PROT_READ, False
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (info["dev"], info["ino"]):
                raise RemoteError("the server's arena file is not the one this host sees")
            self._mmap = mmap.mmap(fd, info["nbytes"], flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                   prot=prot)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.nbytes = self.array.nbytes
        self.address = self.array.ctypes.data
        # Registered with CUDA on the first device copy only (read-only where we may
        # only read), so device buffers move in one batch straight from the arena.
        self.pin = HostPin(self._mmap, self.address, self.nbytes, name="client arena map", shared=True,
                           read_only=not self.writable)

    @staticmethod
    def is_local(info: dict[str, Any] | None) -> bool:
        if not info:
            return False
        try:
            st = os.stat(info["path"])
        except (OSError, KeyError, TypeError):
            return False
        return (st.st_dev, st.st_ino) == (info.get("dev"), info.get("ino"))

    def close(self) -> None:
        self.pin.release()            # before the unmap: a later mapping may reuse the address
        self.array = np.empty(0, np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            pass
