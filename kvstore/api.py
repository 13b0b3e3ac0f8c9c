"""The public Store API, as a protocol: what connectors and applications may call on
a store, whether it lives in this process (:class:`kvstore.Store`) or behind a cache
server (:class:`kvstore.Client`). Both satisfy :class:`StoreAPI` (checked by
``tests/test_api.py``), so code written against it works with either.

Buffers are anything contiguous (bytearray, memoryview, numpy arrays, torch tensors).
A miss is ``False``, never an exception; errors derive from
:class:`kvstore.errors.KVStoreError`. Every method is thread-safe.

Two capabilities differ between implementations and are declared, not probed:

- ``lends_memory``: ``True`` when :meth:`StoreAPI.borrow` and :meth:`StoreAPI.reserve`
  hand out views of the store's own memory (an in-process Store). ``False`` where
  they raise :class:`kvstore.errors.NotSupportedError` (a Client: the bytes live in
  another process); use :meth:`StoreAPI.load` and :meth:`StoreAPI.save` there.
- Store-side maintenance (``pin``, ``unpin``, ``prefetch``, ``flush``) is carried out
  by an in-process Store; a Client raises :class:`kvstore.errors.NotSupportedError`
  naming the method and why (the cache-server protocol has no such operation).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, ContextManager, Protocol, Sequence, runtime_checkable

from kvstore.hint import Hint
from kvstore.keys import BlockKey


@runtime_checkable
class BlockReservation(Protocol):
    """Room for blocks in a store's memory, filled by the caller (:meth:`StoreAPI.reserve`).

    ``views[i]``: a writable buffer of the requested size, or ``None`` where the block
    needs no write (``present[i]``) or got no room (listed in ``missing``: save those
    with :meth:`StoreAPI.save`). Nothing is visible until :meth:`commit`; end it with
    exactly one of :meth:`commit` or :meth:`abort` (as a context manager: leaving the
    block commits, an exception aborts). One owner; not thread-safe."""

    views: list[Any]
    present: list[bool]
    missing: list[int]

    def commit(self) -> list[bool]:
        """Publish the filled views; per key, whether the store holds it now."""

    def abort(self) -> None:
        """Give the room back; nothing is published."""

    def __enter__(self) -> "BlockReservation": ...

    def __exit__(self, exc_type: Any, *exc: object) -> None: ...


@runtime_checkable
class StoreAPI(Protocol):
    """A content-addressed store of KV blocks: :class:`kvstore.Store` in this process,
    :class:`kvstore.Client` against a cache server."""

    lends_memory: bool

    def save(self, keys: Sequence[BlockKey], srcs: Sequence[Any], *,
             checksums: Sequence[int | None] | None = None, hint: Hint | None = None) -> "Future[list[bool]]":
        """Store a copy of each buffer; resolves to whether each block is stored.
        Callers must not modify ``srcs`` until the future is done. ``checksums``: the
        writer's XXH3-64 (:func:`kvstore.block.checksum`) of each host buffer, taken
        when its bytes were known good (``None`` entries: none given); a buffer that no
        longer matches is not stored (``False``). ``hint``: a retention hint for every key (:class:`kvstore.Hint`)."""

    def load(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> "Future[list[bool]]":
        """Copy blocks into caller-owned buffers; ``True`` only where the bytes in
        ``dst`` are verified (fail-closed)."""

    def lookup(self, keys: Sequence[BlockKey], lease_s: float | None = None, *,
               hint: Hint | None = None, wait_s: float | None = None) -> int:
        """Length of the cached prefix of ``keys``; with ``lease_s`` those blocks are
        leased (not evicted) until loaded, released, or the lease expires. ``hint``: a
        retention hint for the blocks of that prefix. ``wait_s``: first wait up to that
        long for every key to be stored, woken by the saves that land them (not polling)."""

    def hint(self, keys: Sequence[BlockKey], hint: Hint) -> int:
        """Give a retention hint to the cached blocks of ``keys``; returns how many."""

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Drop one lease taken by :meth:`lookup` on each key without loading."""

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Membership of each key in any tier (may be stale by the time it returns)."""

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove keys from every tier; returns how many were cached."""

    def clear(self) -> int:
        """Remove every block; returns how many were removed."""

    def prefetch(self, keys: Sequence[BlockKey], tier: int | str = 0) -> "Future[int]":
        """Copy blocks up into a faster tier; resolves to the number now there."""

    def pin(self, keys: Sequence[BlockKey]) -> None:
        """Protect keys from eviction until a matching :meth:`unpin` (counted)."""

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        """Undo one :meth:`pin` of each key."""

    def reserve(self, keys: Sequence[BlockKey], sizes: Sequence[int], *,
                evict: bool = True) -> BlockReservation:
        """Save without a copy: room in the store's memory that the caller fills and
        commits (see :class:`BlockReservation`). Needs ``lends_memory``."""

    def borrow(self, keys: Sequence[BlockKey]) -> ContextManager[list[Any]]:
        """Read-only views of blocks in the first tier (``None`` where not held there),
        valid until the ``with`` block exits. Needs ``lends_memory``."""

    def flush(self) -> int:
        """Write blocks held only in volatile tiers into the first persistent tier;
        returns how many were written."""

    def stats(self) -> dict[str, Any]:
        """Counters per tier and for the store (plus attached sources)."""

    def attach_stats(self, name: str, source: Any) -> None:
        """Report ``source()`` (a dict of counters) in :meth:`stats` under
        ``stats()["connectors"][name]``."""

    def detach_stats(self, name: str, source: Any) -> None:
        """Stop reporting a source attached with :meth:`attach_stats`."""

    def close(self) -> None:
        """Finish queued work and release resources. Idempotent."""

    def __enter__(self) -> "StoreAPI": ...

    def __exit__(self, *exc: object) -> None: ...


__all__ = ["BlockReservation", "StoreAPI"]
