"""The Store's per-key retention hints: absolute expiry, priority, discard, and the
counters of ``stats()["hints"]``.

A hint given for a key merges with the one it already has, so that one request cannot
undo what another asked for: a live retention hint keeps the later expiry and the
higher priority of the two; a ``discard`` hint applies only to a key that no live
retention hint holds, and a retention hint clears ``discard``.

Expiry is absolute, in seconds on the Store's clock (monotonic, injectable so tests never
sleep). A hint persisted with its block in a persistent tier carries its expiry as wall
time (``time.time``), converted back onto the clock at recovery, so it means the same
after a restart.
Expired hints leave the index lazily (on the next hint given, lookup or ``stats``),
counted as ``expired`` when their blocks were not hit before.

Not thread-safe: :class:`HintIndex` and :class:`StoreHints` run under the index's lock
(see :class:`StoreHints`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import struct
import time
from typing import TYPE_CHECKING, Callable, Iterable

from kvstore.hint import MAX_PRIORITY, Hint
from kvstore.keys import BlockKey

if TYPE_CHECKING:
    from kvstore.store.index import Index
    from kvstore.store.mover import Level

log = logging.getLogger("kvstore.store")

_WIRE = struct.Struct("<dIB")   # expires (float64, inf: never), priority (u32), discard (u8)


class HintRecord:
    """One key's hint in the index. ``hit``: the block was hit since the hint was given;
    ``given``: when it was last given (the Store's clock; at recovery, the restore time)."""

    __slots__ = ("expires", "priority", "discard", "hit", "given")

    def __init__(self, expires: float, priority: int, discard: bool, given: float = 0.0) -> None:
        self.expires, self.priority, self.discard, self.hit = expires, priority, discard, False
        self.given = given



class HintIndex:
    """Hints per key (``records``, what the eviction layer reads) and their counters.
    Not thread-safe: every method runs with the caller holding the index's lock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.records: dict[BlockKey, HintRecord] = {}
        self.counters = dict.fromkeys(("given", "hit", "expired", "discarded"), 0)
        self._heap: list[tuple[float, int, BlockKey, HintRecord]] = []   # live expiries
        self._seq = itertools.count()

    def give(self, keys: Iterable[BlockKey], hint: Hint) -> list[BlockKey]:
        """Merge ``hint`` into each key's record; returns the keys whose record changed."""
        now = self.clock()
        self.expire(now)
        changed = []
        expires = now + hint.retain_s if hint.retain_s is not None else math.inf
        for key in keys:
            self.counters["given"] += 1
            old = self.records.get(key)
            live = old is not None and not old.discard and old.expires > now
            if hint.discard:
                if live or (old is not None and old.discard):
                    continue
                rec = HintRecord(math.inf, 0, True, now)
            elif live:
                rec = HintRecord(max(old.expires, expires), max(old.priority, hint.priority), False, now)
            else:
                rec = HintRecord(expires, hint.priority, False, now)
            self.records[key] = rec
            self._push(key, rec)
            changed.append(key)
        return changed

    def encode(self, key: BlockKey) -> bytes | None:
        """``key``'s hint as a persistent tier stores it beside the block (expiry as
        wall time), or ``None`` when it has none."""
        rec = self.records.get(key)
        if rec is None:
            return None
        expires = rec.expires
        if math.isfinite(expires):
            expires = time.time() + (expires - self.clock())
        return _WIRE.pack(expires, rec.priority, rec.discard)

    def restore(self, key: BlockKey, raw: bytes | None) -> bool:
        """Take back a hint persisted with a recovered block; expired or damaged ones
        are dropped. Returns whether the key is hinted now."""
        if not raw or len(raw) != _WIRE.size:
            return False
        expires, priority, discard = _WIRE.unpack(raw)
        if math.isnan(expires) or discard > 1 or priority > MAX_PRIORITY:
            return False
        if math.isfinite(expires):
            expires = self.clock() + (expires - time.time())
        rec = HintRecord(expires, priority, bool(discard), self.clock())
        if not rec.discard and rec.expires <= self.clock():
            return False
        self.records[key] = rec
        self._push(key, rec)
        return True

    def _push(self, key: BlockKey, rec: HintRecord) -> None:
        if not math.isfinite(rec.expires) or rec.discard:
            return
        heap = self._heap
        heapq.heappush(heap, (rec.expires, next(self._seq), key, rec))
        if len(heap) > 2 * len(self.records) + 1024:
            # entries of hints replaced by a merge or forgotten with their block
            records = self.records
            self._heap = [e for e in heap if records.get(e[2]) is e[3]]
            heapq.heapify(self._heap)

    def hit(self, key: BlockKey, now: float) -> None:
        """``key`` was hit (loaded, borrowed, found by a lookup)."""
        rec = self.records.get(key)
        if rec is not None and not rec.hit and not rec.discard and rec.expires > now:
            rec.hit = True
            self.counters["hit"] += 1

    def is_discard(self, key: BlockKey) -> bool:
        rec = self.records.get(key)
        return rec is not None and rec.discard

    def forget(self, key: BlockKey) -> None:
        """No tier holds ``key`` any more."""
        rec = self.records.pop(key, None)
        if rec is not None and not rec.hit and not rec.discard and rec.expires <= self.clock():
            self.counters["expired"] += 1

    def expire(self, now: float | None = None) -> list[BlockKey]:
        """Drop hints that expired by ``now``; returns their keys."""
        now = self.clock() if now is None else now
        gone = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, key, rec = heapq.heappop(heap)
            if self.records.get(key) is rec:
                del self.records[key]
                gone.append(key)
                if not rec.hit:
                    self.counters["expired"] += 1
        return gone

    def stats(self) -> dict[str, int]:
        self.expire()
        return {**self.counters, "live": len(self.records)}


class StoreHints:
    """The Store's side of hints: the hint table (``table``, a :class:`HintIndex`; its
    ``records`` are what every level's eviction policy reads), kept in step with the
    Store's index (``index``, which tiers hold each key) and levels (their policies, and
    which tiers persist hints beside their blocks).

    Lock rule: ``Index.lock`` guards the table. Every method runs with the caller
    holding it, except :meth:`persist`, which does tier I/O and so runs without it.
    """

    def __init__(self, table: HintIndex, index: "Index", levels: "list[Level]") -> None:
        self.table = table
        self.records = table.records
        self.index = index
        self.levels = levels

    def give(self, keys: list[BlockKey], hint: Hint) -> dict[int, dict[BlockKey, bytes]]:
        """Merge ``hint`` into ``keys``' records and re-rank the keys in each tier that
        holds them. Returns what persistent tiers should record (pass it to
        :meth:`persist` once the lock is released)."""
        table = self.table
        changed = table.give(keys, hint)
        persist: dict[int, dict[BlockKey, bytes]] = {}
        where = self.index.where
        for key in changed:
            mask = where.get(key, 0)
            for i, lvl in enumerate(self.levels):
                if mask >> i & 1:
                    lvl.policy.rehint(key)
                    if lvl.tier.capabilities.persistent:
                        persist.setdefault(i, {})[key] = table.encode(key)
        return persist

    def entering(self, i: int, keys: list[BlockKey], persist: dict[int, dict[BlockKey, bytes]]) -> None:
        """``keys`` just entered level ``i``: note their hints for a persistent tier
        (into ``persist``, for :meth:`persist`)."""
        if self.records and self.levels[i].tier.capabilities.persistent:
            for key in keys:
                raw = self.table.encode(key)
                if raw is not None:
                    persist.setdefault(i, {})[key] = raw

    def persist(self, persist: dict[int, dict[BlockKey, bytes]]) -> None:
        """Hand hints to the persistent tiers that hold their blocks (best effort: a
        tier that fails to record them logs it; hints only steer eviction). Without the
        lock."""
        for i, hints in persist.items():
            lvl = self.levels[i]
            try:
                lvl.tier.set_hints(hints)
            except Exception as exc:   # a tier failure must not fail the save or lookup
                log.warning("tier %s: could not record retention hints: %s", lvl.name, exc)

    def hits(self, keys: Iterable[BlockKey]) -> None:
        """Count hinted blocks hit before their hint expired."""
        table = self.table
        now = table.clock()
        for key in keys:
            table.hit(key, now)

    def restore(self, key: BlockKey, raw: bytes | None) -> None:
        """A recovered block's persisted hint, unless the key has one already."""
        if key not in self.records:
            self.table.restore(key, raw)

    def is_discard(self, key: BlockKey) -> bool:
        return self.table.is_discard(key)

    def count_discarded(self) -> None:
        """A discard block was dropped instead of spilled."""
        self.table.counters["discarded"] += 1

    def forget(self, key: BlockKey) -> None:
        """No tier holds ``key`` any more."""
        self.table.forget(key)

    def stats(self) -> dict[str, int]:
        return self.table.stats()


__all__ = ["HintIndex", "HintRecord", "StoreHints"]
