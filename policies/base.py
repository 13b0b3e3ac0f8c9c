"""Policy interfaces. Policies order keys and decide admission; they do no I/O and own
no storage. Not thread-safe: the Store calls them under its lock."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Hashable, Iterator


class EvictionPolicy(ABC):
    """Orders the keys of one tier for eviction.

    The Store reports every insert, access and removal; ``victims()`` yields candidates,
    best victim first. The Store may skip a candidate (leased, pinned) and keep
    iterating; it calls ``on_remove`` for each key it actually evicts, and stops
    iterating once it has room. A policy may reorganise itself while yielding (e.g.
    S3-FIFO promotes as it scans) but must never yield a key it no longer holds.
    """

    name: str = "policy"
    uses_parent: bool = False  # True: the Store passes each key's parent to on_insert
    # True: the order is a stamp taken at insert (and, with ``renews``, at each access,
    # where ``on_insert`` of a key the policy does not hold puts it too), and skipping a
    # key changes nothing; so a key the walk passes over stays ahead of every key
    # inserted or accessed after it. The retention layer relies on this to park hinted
    # keys (``policies/_parking.py``).
    stamped: bool = False
    renews: bool = False
    # True: the policy can keep a key it holds out of its walk while a retention hint
    # holds it (``hold``/``release``), its own state still following every touch, where
    # stepping over the key would change nothing either (lineage). The retention layer
    # then holds the hinted keys its walk passed instead of stepping over them each time.
    holds: bool = False

    @abstractmethod
    def on_insert(self, key: Hashable, nbytes: int, parent: Hashable | None = None) -> None:
        """A key entered the tier. ``parent`` is the previous chunk's key, if any."""

    @abstractmethod
    def on_access(self, key: Hashable) -> None:
        """A stored key was read (a hit) or saved again."""

    @abstractmethod
    def on_remove(self, key: Hashable) -> None:
        """A key left the tier (evicted or deleted). Unknown keys are ignored."""

    @abstractmethod
    def victims(self) -> Iterator[Hashable]:
        """Candidates for eviction, best first."""

    def hold(self, key: Hashable) -> None:
        """(``holds`` only.) ``victims()`` just yielded ``key`` and it was passed over:
        yield it no more until :meth:`release`. Idempotent."""
        raise NotImplementedError(f"{self.name} does not hold keys")

    def release(self, key: Hashable) -> None:
        """(``holds`` only.) ``key`` is a candidate again, where its history puts it.
        A key not held, or no longer in the policy, is ignored."""
        raise NotImplementedError(f"{self.name} does not hold keys")

    def held_victims(self) -> Iterator[Hashable]:
        """(``holds`` only.) :meth:`victims` with the held keys offered too, each where
        its history puts it (the retention layer's last class)."""
        raise NotImplementedError(f"{self.name} does not hold keys")

    def set_capacity(self, capacity_bytes: int) -> None:
        """The tier's size, told once by the Store after construction. Policies that
        size queues from it (S3-FIFO, ARC) must also work when it is never called, by
        deriving their targets from what they currently hold. Default: ignored."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


class Decision(enum.Enum):
    """An admission outcome: a value, never an exception."""

    ADMIT = "admit"
    REJECT = "reject"      # not worth storing (e.g. seen too rarely)
    THROTTLE = "throttle"  # worth storing, but the write budget is spent for now


class AdmissionPolicy(ABC):
    """Decides whether a block may enter a (slow, wear-sensitive) tier."""

    @abstractmethod
    def decide(self, key: Hashable, nbytes: int) -> Decision:
        """Called once per offer of ``key`` to the tier; may count the offer."""
