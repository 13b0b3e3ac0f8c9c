"""The tier contract: a small, synchronous, batch-oriented interface.

A tier stores opaque blocks of bytes under :class:`~kvstore.keys.BlockKey`. It does no
eviction of its own choosing (the Store runs the policy) and never keeps a caller's
buffer after a call returns. Every method is thread-safe unless it says otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol, Sequence, runtime_checkable

from kvstore.buffers import nbytes_of
from kvstore.errors import BufferSizeError, InvalidArgumentError, NotSupportedError
from kvstore.keys import BlockKey

if TYPE_CHECKING:
    import numpy as np


# -- argument checks shared by every tier ---------------------------------------------------
# Each tier calls these at the top of its batch methods, so a bad batch fails the same
# way, with the same words, whichever tier gets it, before anything is reserved or copied.

def check_batch(keys: Sequence[Any], items: Sequence[Any], what: str = "buffers") -> None:
    """One item per key: raises :class:`~kvstore.errors.InvalidArgumentError`
    ("N keys but M buffers"; ``what`` names the items) otherwise."""
    if len(keys) != len(items):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(items)} {what}")


def given_checksums(keys: Sequence[Any], checksums: Sequence[int | None] | None) -> list[int | None]:
    """The writer's checksums of ``write(keys, srcs, checksums)``, one per key (``None``:
    hash it here); raises :class:`~kvstore.errors.InvalidArgumentError` ("N keys but M
    checksums") on a count mismatch."""
    if checksums is None:
        return [None] * len(keys)
    check_batch(keys, checksums, "checksums")
    return list(checksums)


def buffer_size_error(have: int, block: int, tier: str | None = None) -> BufferSizeError:
    """The error for a caller buffer of ``have`` bytes given for a block of ``block``
    bytes, prefixed with ``[tier]`` when given."""
    where = f"[{tier}] " if tier else ""
    return BufferSizeError(f"{where}buffer has {have} bytes, block has {block}")


def check_sizes(tier: str, bufs: Sequence[Any], blocks: Sequence[Any]) -> None:
    """Each buffer is exactly its block's size: ``blocks[i]`` is the tier's record of the
    block ``bufs[i]`` is for (anything with an ``nbytes`` attribute: a slot, an index
    entry), ``None`` where the block is absent (not checked). Raises
    :func:`buffer_size_error`'s error for the first that is not, so a read fails before
    anything is copied into a caller buffer. Records, not a list of sizes, so the hot
    DRAM path builds nothing per block to be checked."""
    for buf, block in zip(bufs, blocks):
        if block is not None and nbytes_of(buf) != block.nbytes:
            raise buffer_size_error(nbytes_of(buf), block.nbytes, tier)


@dataclass(frozen=True)
class TierCapabilities:
    """What a tier is and can do; the Store plans transfers from this record."""

    device: str = "cpu"          # where blocks live: "cpu", "cuda:0", "disk", "s3", "remote"
    persistent: bool = False     # survives a process restart (then ``recover`` is meaningful)
    alignment: int = 1           # byte alignment the tier prefers for caller buffers
    max_concurrency: int = 1     # requests one batch may keep in flight
    zero_copy_view: bool = False  # ``view()`` exposes stored bytes without a copy
    # ``write(keys, srcs, checksums)`` keeps the given XXH3-64 (``kvstore.block.checksum``,
    # flags 0) of each source as its block's checksum instead of hashing the source again
    write_checksums: bool = False
    # other processes and nodes write blocks into the same medium (a Redis Cluster, a
    # Mooncake pool, a bucket): the Store asks :meth:`Tier.find` about keys its index
    # does not hold before it reports them missing
    shared: bool = False
    # The optional methods below are declared here, never probed for with hasattr; the
    # base class's versions raise :class:`~kvstore.errors.NotSupportedError`.
    # ``reserve(keys, sizes)`` takes room that the caller fills in place, then commits
    # (a zero-copy save: a network transfer writing straight into the tier's memory)
    reserve: bool = False
    # ``slots(keys)`` lends each block's ``(offset, nbytes)`` inside the tier's host arena
    # (a process that maps the arena reads it without a view built per block)
    slots: bool = False
    # the blocks live in one host array that another process can map or a NIC register:
    # the tier is a :class:`HostArena` (``arena``, ``shm_path``)
    host_arena: bool = False


@runtime_checkable
class HostArena(Protocol):
    """What a tier declaring ``capabilities.host_arena`` also offers: the cache server
    maps it for same-host clients (:mod:`kvstore.net.server._shm`) and registers it with
    NIXL. Owned by the tier: valid until it closes (then empty)."""

    arena: np.ndarray         # the whole arena, flat ``uint8``; ``slots`` offsets index it
    shm_path: str | None      # the shared-memory file backing it, ``None`` for anonymous memory


@dataclass(frozen=True)
class RecoveredBlock:
    """One block found by :meth:`Tier.recover`, oldest access first."""

    key: BlockKey
    nbytes: int
    last_access: float = 0.0
    hint: bytes | None = None   # the Store's retention hint, as given to set_hints


class Tier(ABC):
    """Abstract tier. ``name`` is the configured tier name (for errors and stats)."""

    name: str = "tier"
    capabilities: TierCapabilities = TierCapabilities()
    # Subclasses set ``_capacity`` and keep ``_used`` current (or override the properties).
    _capacity: int
    _used: int

    @classmethod
    def from_config(cls, cfg: Any, **extra: Any) -> "Tier":
        """The tier a validated ``tiers:`` entry (``kvstore.config``'s model of this kind)
        describes: its kind's settings are this constructor's keyword arguments, with
        ``extra`` ones the Store's build decides (a DRAM tier's ``header_frames``)."""
        return cls(capacity_bytes=cfg.capacity, name=cfg.name, **cfg.settings(), **extra)

    @property
    def capacity_bytes(self) -> int:
        """Configured capacity in payload bytes; ``used_bytes`` never exceeds it."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Payload bytes currently stored (headers and padding not counted)."""
        return self._used

    @abstractmethod
    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is stored. Can be stale by the time the caller acts on it."""

    @abstractmethod
    def read_into(self, keys: Sequence[BlockKey], dsts: Sequence[Any]) -> list[bool]:
        """Copy each stored block into the caller-owned buffer beside its key.

        A miss is ``False`` and leaves that buffer's contents unspecified. ``True`` only
        when the bytes in ``dst`` are exactly what was written (verified where the
        medium can corrupt them). A buffer whose size differs from the stored block's
        raises :class:`~kvstore.errors.BufferSizeError` before anything is copied into it.
        """

    @abstractmethod
    def write(self, keys: Sequence[BlockKey], srcs: Sequence[Any]) -> list[bool]:
        """Store a copy of each source buffer; the tier keeps no reference to ``srcs``.

        Returns per key whether it is stored now (``False``: no room). A key already
        stored is left as it is and reported ``True``. Media failures raise
        :class:`~kvstore.errors.TierIOError` / ``TierUnavailableError``. A tier that
        declares ``capabilities.write_checksums`` also takes ``checksums``: one per
        source, the XXH3-64 its writer computed (``None``: hash it here), stored as the
        block's own, so a source changed since its writer hashed it fails its first read.
        """

    def checksums(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """The XXH3-64 (:func:`kvstore.block.checksum`, flags 0) each key's block was
        stored with, ``None`` where absent or not kept (the default). A block read from
        this tier is verified against it; the Store hands it to the tier a block moves
        into (see ``TierCapabilities.write_checksums``)."""
        return [None] * len(keys)

    @abstractmethod
    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove the keys; returns how many were stored. Readers in flight finish first."""

    @abstractmethod
    def keys(self) -> Iterator[BlockKey]:
        """Iterate over a snapshot of the stored keys."""

    def nbytes(self, key: BlockKey) -> int | None:
        """Payload size of a stored block, or ``None`` when absent."""
        return None

    def find(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Payload size of each key's block, ``None`` where absent. A ``shared`` tier
        asks its medium about keys its index does not hold (blocks another node wrote),
        checks what it finds as far as it can without reading payloads (a block header),
        and indexes and budgets each block found while its byte budget has room (a block
        found past it is ``None``: this node cannot take it). ``keys`` is a prompt's
        prefix in order: a tier may stop asking after the first key it does not find and
        answer ``None`` for the rest. Raises as :meth:`read_into` does when the medium
        does not answer. The default answers from :meth:`nbytes`."""
        return [self.nbytes(k) for k in keys]

    def reserve(self, keys: Sequence[BlockKey], sizes: Sequence[int]) -> Any:
        """Take room for blocks the caller fills in place (only where
        ``capabilities.reserve``). Returns a reservation: ``views[i]`` a writable buffer of
        ``sizes[i]`` bytes for ``keys[i]`` (``None``: stored already, or no room), ended
        once by ``commit(checksums=None) -> list[bool]`` (``checksums``: the writer's, one
        per key; a block whose bytes differ is not stored), ``abort()`` or ``abandon()``
        (keep the room for good: a transfer that could not be cancelled may still write
        it). Raises :class:`~kvstore.errors.NotSupportedError` otherwise (the default)."""
        raise self._unsupported("reserve")

    def slots(self, keys: Sequence[BlockKey], *, verify: bool = True
              ) -> AbstractContextManager[list[tuple[int, int] | None]]:
        """Each block's ``(offset, nbytes)`` in the tier's :class:`HostArena` (``None``
        where absent), held and verified as :meth:`views` are until the ``with`` exits
        (only where ``capabilities.slots``). Raises
        :class:`~kvstore.errors.NotSupportedError` otherwise (the default)."""
        raise self._unsupported("slots")

    def _unsupported(self, method: str) -> NotSupportedError:
        return NotSupportedError(f"{type(self).__name__}.{method} is not supported: tier {self.name!r} does not "
                                 f"declare capabilities.{method}")

    def recover(self) -> list[RecoveredBlock]:
        """Rebuild the tier's index after a restart; returns what it holds, oldest
        access first, so the Store can rebuild usage and eviction order."""
        return []

    def set_hints(self, hints: Mapping[BlockKey, bytes]) -> None:
        """Keep the Store's retention hints (opaque records of a few bytes) beside the
        blocks they name, for :meth:`recover` to return after a restart. Best effort
        and may be batched: a hint is advice, never data. A hint for a key the tier
        does not hold is ignored; a block's hint goes when the block goes. Tiers that
        do not persist return without doing anything (the default)."""

    @contextmanager
    def view(self, key: BlockKey) -> Iterator[Any]:
        """Borrow a read-only view of a stored block (``None`` when absent or when the
        tier cannot expose its memory). The block stays valid inside the ``with``."""
        yield None

    @contextmanager
    def views(self, keys: Sequence[BlockKey], *, verify: bool = True) -> Iterator[list[Any]]:
        """:meth:`view` for a batch: one entry per key (``None`` where absent), all
        valid until the ``with`` exits. Tiers with cheap batch pinning override it.
        A tier that keeps :meth:`checksums` verifies each block first (a failed one is
        ``None``) unless ``verify=False``: only for a caller that sends the checksums
        along to a reader that verifies what it receives."""
        with ExitStack() as stack:
            yield [stack.enter_context(self.view(key)) for key in keys]

    @contextmanager
    def lend(self, keys: Sequence[BlockKey]) -> Iterator[tuple[list[Any], list[int | None]]]:
        """:meth:`views` of ``keys`` (verified) and, per view, the checksum it was verified
        against (``None`` where the tier keeps none): what a move down hands the tier
        below, so bytes changed after the check fail there. Tiers that keep checksums
        give the ones their check used, not a second lookup a concurrent drop could
        empty."""
        with self.views(keys) as views:
            yield views, self.checksums(keys)

    def stats(self) -> dict[str, Any]:
        """Tier-specific counters (health, errors, I/O mode), merged into Store stats."""
        return {}

    def close(self) -> None:
        """Release the medium. Idempotent."""

    def __enter__(self) -> "Tier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
