"""The HELLO challenge-response (``docs/protocol.md``, Session): both ends compute the
proof a client sends for a server's nonce, so the token itself never crosses the wire."""

from __future__ import annotations

import hashlib
import hmac

_CONTEXT = b"kvstore-hello-v3\0"


def hello_proof(token: str, nonce: bytes, client: str) -> str:
    """HMAC-SHA256 keyed by ``token`` over ``"kvstore-hello-v3\\0" || nonce || client``
    (the client's name as UTF-8), as lowercase hex."""
    msg = _CONTEXT + bytes(nonce) + client.encode("utf-8", "surrogatepass")
    return hmac.new(token.encode("utf-8"), msg, hashlib.sha256).hexdigest()


__all__ = ["hello_proof"]
