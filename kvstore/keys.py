"""Content-addressed keys: a :class:`Namespace` names what KV bytes mean, and
:class:`BlockKey` names one chunk of a token prefix inside it.

Keys are chained: ``key_i = H(key_{i-1} || tokens[chunk_i])`` with
``key_{-1} = H(namespace)``, so one key identifies its whole prefix. ``H`` is BLAKE2b
(32-byte digest): stable across processes, machines and ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from kvstore.errors import InvalidArgumentError

DIGEST_BYTES = 32
KEY_WIRE_BYTES = 3 * DIGEST_BYTES  # digest | parent | namespace, zeros where absent
_ZERO = bytes(DIGEST_BYTES)
_NS_DOMAIN = b"kvstore/namespace/v1\0"


def _h(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


class BlockKey:
    """A 32-byte chained digest naming one chunk of a token prefix.

    ``parent`` is the previous chunk's digest (``None`` for a first chunk) and
    ``namespace`` the namespace digest; both ride along for prefix-aware eviction and
    per-namespace layout on disk and in buckets, but equality and hashing use
    ``digest`` alone. Immutable and cheap to hash; safe to share between threads.
    """

    __slots__ = ("digest", "parent", "namespace", "_hash")

    def __init__(self, digest: bytes, parent: bytes | None = None,
                 namespace: bytes | None = None) -> None:
        if not isinstance(digest, (bytes, bytearray, memoryview)) or len(digest) != DIGEST_BYTES:
            raise InvalidArgumentError(
                f"BlockKey digest must be {DIGEST_BYTES} bytes, got {type(digest).__name__} "
                f"of length {len(digest) if hasattr(digest, '__len__') else '?'}")
        object.__setattr__(self, "digest", bytes(digest))
        object.__setattr__(self, "parent", bytes(parent) if parent and bytes(parent) != _ZERO else None)
        object.__setattr__(self, "namespace", bytes(namespace) if namespace and bytes(namespace) != _ZERO else None)
        object.__setattr__(self, "_hash", hash(self.digest))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("BlockKey is immutable")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockKey) and other.digest == self.digest

    def __lt__(self, other: "BlockKey") -> bool:
        return self.digest < other.digest

    def __repr__(self) -> str:
        return f"BlockKey({self.digest.hex()[:16]}…)"

    def __reduce__(self):
        return (BlockKey, (self.digest, self.parent, self.namespace))

    def hex(self) -> str:
        """The digest as 64 lowercase hex characters."""
        return self.digest.hex()

    @classmethod
    def from_hex(cls, text: str, *, parent: str | None = None,
                 namespace: str | None = None) -> "BlockKey":
        """Parse :meth:`hex` output; raises :class:`InvalidArgumentError` on bad text."""
        try:
            return cls(bytes.fromhex(text), bytes.fromhex(parent) if parent else None,
                       bytes.fromhex(namespace) if namespace else None)
        except ValueError as exc:
            raise InvalidArgumentError(f"not a {2 * DIGEST_BYTES}-hex-digit key: {text!r}") from exc

    def to_bytes(self) -> bytes:
        """96 bytes (digest, parent, namespace) for indexes and the wire protocol."""
        return self.digest + (self.parent or _ZERO) + (self.namespace or _ZERO)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> "BlockKey":
        if len(data) != KEY_WIRE_BYTES:
            raise InvalidArgumentError(f"encoded BlockKey must be {KEY_WIRE_BYTES} bytes, got {len(data)}")
        data = bytes(data)
        parent, namespace = data[32:64], data[64:]
        return _trusted(data[:32], None if parent == _ZERO else parent, None if namespace == _ZERO else namespace)


def _trusted(digest: bytes, parent: bytes | None, namespace: bytes | None) -> BlockKey:
    """A BlockKey from fields already known to be well-formed 32-byte digests (just
    hashed, or read back from a checksummed record): skips ``__init__``'s validation on
    the hot paths (hashing a prompt, recovering a million-entry index)."""
    key = _new(BlockKey)
    _set(key, "digest", digest)
    _set(key, "parent", parent)
    _set(key, "namespace", namespace)
    _set(key, "_hash", hash(digest))
    return key


_new, _set = object.__new__, object.__setattr__


@dataclass(frozen=True)
class Namespace:
    """What the bytes of a block mean. Two namespaces differing in any field never
    share a key.

    ``layout`` describes the KV layout (layers, kv heads, head dim, layout kind) in the
    connector's own words; ``rank``/``world_size`` the parallel shard (use
    ``world_size=1`` for rank-agnostic data such as MLA); ``salt`` a tenant or cache salt.
    """

    model: str
    dtype: str
    chunk_tokens: int
    layout: str = ""
    rank: int = 0
    world_size: int = 1
    salt: str = ""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgumentError("Namespace.model must be a non-empty string")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens <= 0:
            raise InvalidArgumentError(f"Namespace.chunk_tokens must be a positive int, got {self.chunk_tokens!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError(
                f"Namespace rank/world_size must satisfy 0 <= rank < world_size, got {self.rank}/{self.world_size}")
        fields = {f: getattr(self, f) for f in ("model", "dtype", "chunk_tokens", "layout", "rank", "world_size", "salt")}
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        object.__setattr__(self, "digest", _h(_NS_DOMAIN + canonical))

    def chunk_keys(self, token_ids: Sequence[int] | np.ndarray | Any) -> list[BlockKey]:
        """Keys of every *full* chunk of ``token_ids`` (a list, numpy array or torch int
        tensor); a trailing partial chunk gets no key. Pure and thread-safe."""
        keys: list[BlockKey] = []
        for batch in self.chunk_key_batches(token_ids, 1 << 62):
            keys.extend(batch)
        return keys

    def chunk_key_batches(self, token_ids: Sequence[int] | np.ndarray | Any, batch: int) -> Iterator[list[BlockKey]]:
        """:meth:`chunk_keys` computed ``batch`` keys at a time, each list as it is
        hashed: a caller that stops early (the first block a Store lacks) hashes no
        more of a long prompt than it reads. Checks ``token_ids`` before the first one."""
        tokens = _as_token_array(token_ids)
        n = len(tokens) // self.chunk_tokens
        raw = memoryview(tokens[: n * self.chunk_tokens].tobytes())
        step = self.chunk_tokens * 4
        ns, prev = self.digest, self.digest
        parent = None
        blake = hashlib.blake2b
        for lo in range(0, n, batch):
            keys = []
            for i in range(lo, min(n, lo + batch)):
                h = blake(prev, digest_size=DIGEST_BYTES)
                h.update(raw[i * step:(i + 1) * step])
                digest = h.digest()
                keys.append(_trusted(digest, parent, ns))
                parent = prev = digest
            yield keys

    def key_for(self, ident: bytes | str | int, parent: BlockKey | None = None) -> BlockKey:
        """Map an engine's own block hash into this namespace, chained after ``parent``.
        Stable across processes as long as ``ident`` is."""
        if isinstance(ident, int):
            ident = ident.to_bytes(16, "little", signed=True)
        elif isinstance(ident, str):
            ident = ident.encode()
        prev = parent.digest if parent is not None else self.digest
        return BlockKey(_h(prev + b"\1" + bytes(ident)), parent.digest if parent else None, self.digest)


def _as_token_array(token_ids: Any) -> np.ndarray:
    if hasattr(token_ids, "detach") and hasattr(token_ids, "cpu"):  # torch tensor
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise InvalidArgumentError("token_ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False)


__all__ = ["BlockKey", "Namespace", "DIGEST_BYTES", "KEY_WIRE_BYTES"]
