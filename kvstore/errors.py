"""The kvstore exception tree.

Every error kvstore raises derives from :class:`KVStoreError`. Where a stdlib class
fits, an error inherits it too, so ``except ValueError`` keeps working for callers that
do not know kvstore::

    KVStoreError
    ├── ConfigError (ValueError)            bad config file, field, unit or override
    ├── InvalidArgumentError (ValueError)   bad call: mismatched lists, bad key
    │   └── BufferSizeError                 a buffer's size differs from the block's
    ├── StoreClosedError (RuntimeError)     call on a closed Store / Client
    ├── NotSupportedError (NotImplementedError)  a StoreAPI or tier method this one cannot offer
    ├── TierError                           raised at a tier boundary
    │   ├── TierIOError (OSError)           the medium failed (EIO, ENOSPC, HTTP 5xx)
    │   ├── TierFullError                   no room, even after eviction
    │   ├── TierUnavailableError (ConnectionError)  endpoint down; retried later
    │   └── CorruptBlockError               stored bytes failed verification
    └── RemoteError                         errors of the cache-server protocol
        ├── ProtocolError (ValueError)      malformed frame, bad version, bad opcode
        ├── AuthError (PermissionError)     missing or wrong token
        └── TransportError (ConnectionError)  a data-plane transfer (NIXL/UCX) failed

A miss is never an error: reads return ``False`` for a key that is not stored.
Third-party exceptions (OSError, botocore, lmdb) are mapped into this tree at the tier
boundary with ``raise ... from exc``; the Store decides the fallback and counts it.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every error raised by kvstore."""


class ConfigError(KVStoreError, ValueError):
    """The configuration is invalid; the message names the field and the bad value."""


class InvalidArgumentError(KVStoreError, ValueError):
    """A call's arguments are invalid (mismatched lengths, wrong types, bad keys)."""


class BufferSizeError(InvalidArgumentError):
    """A caller's buffer does not have the size of the block it is paired with."""


class StoreClosedError(KVStoreError, RuntimeError):
    """The Store or Client was used after ``close()``."""


class NotSupportedError(KVStoreError, NotImplementedError):
    """A :class:`kvstore.api.StoreAPI` method this implementation cannot carry out (a
    Client cannot lend the server's memory), or an optional tier method a tier does not
    declare in its ``capabilities``; the message names the method and why."""


class TierError(KVStoreError):
    """A tier failed; carries the tier's name when known."""

    def __init__(self, message: str, *, tier: str | None = None) -> None:
        super().__init__(f"[{tier}] {message}" if tier else message)
        self.tier = tier


class TierIOError(TierError, OSError):
    """The tier's medium failed: EIO, ENOSPC, an HTTP 5xx, a short read."""


class TierFullError(TierError):
    """The tier has no room for the block, even after eviction."""


class TierUnavailableError(TierError, ConnectionError):
    """The tier's endpoint cannot be reached right now; it is retried later."""


class CorruptBlockError(TierError):
    """Stored bytes failed verification (header, key digest, length or checksum)."""


class RemoteError(KVStoreError):
    """An error reported by, or about, the kvstore cache server protocol."""


class ProtocolError(RemoteError, ValueError):
    """A malformed frame: truncated, wrong version, oversize, unknown opcode."""


class AuthError(RemoteError, PermissionError):
    """The server refused the client's token (missing or wrong)."""


class TransportError(RemoteError, ConnectionError):
    """A data-plane transfer failed (NIXL/UCX: peer gone, timeout, backend error).

    ``in_flight`` is True when the transfer could not be cancelled, so the memory it
    touches may still be read or written: the caller must not reuse that memory."""

    def __init__(self, message: str, *, in_flight: bool = False) -> None:
        super().__init__(message)
        self.in_flight = in_flight


__all__ = [
    "AuthError",
    "BufferSizeError",
    "ConfigError",
    "CorruptBlockError",
    "InvalidArgumentError",
    "KVStoreError",
    "NotSupportedError",
    "ProtocolError",
    "RemoteError",
    "StoreClosedError",
    "TierError",
    "TierFullError",
    "TierIOError",
    "TierUnavailableError",
    "TransportError",
]
