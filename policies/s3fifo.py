"""S3-FIFO (Yang et al., SOSP'23): a small FIFO (10% of the space) that filters
one-hit wonders, a main FIFO with 2-bit CLOCK reinsertion, and a ghost FIFO of keys
recently evicted from the small queue.

- Insert: a key found in the ghost goes straight to main; any other key to small.
- Access: the key's frequency goes up by one, capped at 3; nothing moves.
- Evict: while small holds at least 10% of the held bytes (or main is empty), take
  small's oldest key: if it was accessed since insertion it moves to main (frequency
  cleared), otherwise it is the victim and its key goes to the ghost. Otherwise take
  main's oldest key: accessed keys are reinserted with their frequency decremented,
  others are the victim.

**Byte-weighted**: the 10% target, the main share and the ghost bound are in bytes (the
ghost remembers as many bytes of keys as main is meant to hold, 90%), as the tiers
count space in bytes. The target comes from ``set_capacity``; without it, from the
bytes currently held, which at eviction time equals the tier's capacity to within one
block. The move-to-main threshold is one access (libCacheSim's default).

O(1) per insert, access and removal (``OrderedDict`` queues); each victim costs O(1)
amortised, since a key is moved or reinserted at most once per access. A key the Store
skips is moved to the newest end of its queue, so the walk makes progress; it ends
once every held key was yielded or skipped without an eviction.

Not thread-safe: the Store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from kvstore.policies.base import EvictionPolicy

SMALL_FRACTION = 0.1  # the paper's 10%, chosen there across many traces
MAX_FREQ = 3          # two bits per key


class S3FifoPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self) -> None:
        self._small: OrderedDict[Hashable, None] = OrderedDict()
        self._main: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()  # key -> nbytes
        self._freq: dict[Hashable, int] = {}
        self._nbytes: dict[Hashable, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0
        self._ghost_bytes = 0
        self._capacity_bytes: int | None = None

    def set_capacity(self, capacity_bytes: int) -> None:
        self._capacity_bytes = int(capacity_bytes)

    def on_insert(self, key: Hashable, nbytes: int, parent: Hashable | None = None) -> None:
        if key in self._freq:
            self.on_access(key)
            return
        self._freq[key] = 0
        self._nbytes[key] = nbytes
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            self._main[key] = None
            self._main_bytes += nbytes
        else:
            self._small[key] = None
            self._small_bytes += nbytes

    def on_access(self, key: Hashable) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < MAX_FREQ:
            self._freq[key] = freq + 1

    def on_remove(self, key: Hashable) -> None:
        if self._freq.pop(key, None) is None:
            return
        nbytes = self._nbytes.pop(key)
        if key in self._small:
            del self._small[key]
            self._small_bytes -= nbytes
            self._remember(key, nbytes)
        else:
            del self._main[key]
            self._main_bytes -= nbytes

    def victims(self) -> Iterator[Hashable]:
        steps_without_eviction = 0
        # A skipped key (leased or pinned) moves to the end of its queue, so a queue whose
        # head was skipped has been skipped whole: then the other queue is used. Every
        # key can be promoted once and reinserted MAX_FREQ times before it is yielded,
        # so the step bound only ends walks where the Store skips everything.
        skipped: set[Hashable] = set()
        while self._freq and steps_without_eviction <= (MAX_FREQ + 2) * len(self._freq):
            steps_without_eviction += 1
            small_open = bool(self._small) and next(iter(self._small)) not in skipped
            main_open = bool(self._main) and next(iter(self._main)) not in skipped
            if not small_open and not main_open:
                return
            if small_open and (self._small_bytes >= self._small_target() or not main_open):
                key = next(iter(self._small))
                if self._freq[key] > 0:
                    self._promote(key)
                    continue
                queue = self._small
            else:
                key = next(iter(self._main))
                if self._freq[key] > 0:
                    self._freq[key] -= 1
                    self._main.move_to_end(key)
                    continue
                queue = self._main
            yield key
            if key in self._freq:
                queue.move_to_end(key)
                skipped.add(key)
            else:
                steps_without_eviction = 0

    def queue_of(self, key: Hashable) -> str | None:
        """``"small"``, ``"main"``, ``"ghost"`` or None: where the key sits now."""
        if key in self._small:
            return "small"
        if key in self._main:
            return "main"
        return "ghost" if key in self._ghost else None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def _held_bytes(self) -> int:
        return self._small_bytes + self._main_bytes

    def _small_target(self) -> float:
        total = self._capacity_bytes if self._capacity_bytes is not None else self._held_bytes()
        return SMALL_FRACTION * total

    def _promote(self, key: Hashable) -> None:
        nbytes = self._nbytes[key]
        del self._small[key]
        self._small_bytes -= nbytes
        self._main[key] = None
        self._main_bytes += nbytes
        self._freq[key] = 0

    def _remember(self, key: Hashable, nbytes: int) -> None:
        total = self._capacity_bytes if self._capacity_bytes is not None else self._held_bytes() + nbytes
        ghost_limit = (1.0 - SMALL_FRACTION) * total
        self._ghost[key] = nbytes
        self._ghost_bytes += nbytes
        while self._ghost and self._ghost_bytes > ghost_limit:
            self._ghost_bytes -= self._ghost.popitem(last=False)[1]
