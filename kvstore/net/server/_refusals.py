"""How a connection handler refuses a request (see ``kvstore/net/server/_conn.py``)."""

from __future__ import annotations

from kvstore.errors import KVStoreError
from kvstore.net import protocol as P


class Disconnected(Exception):
    """The peer closed the connection (between or inside frames)."""


class Fatal(Exception):
    """Reply with this status, then close the connection."""

    def __init__(self, status: P.Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class Busy(KVStoreError):
    """A per-client limit is reached; the request is refused, the connection kept."""
